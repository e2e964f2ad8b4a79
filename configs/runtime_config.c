/* runtime_config.c — the runtime config (what libkvcap does with each span kind, config.h):
 * defaults and the keys it reads through the strict reader (yaml.h). */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "configs/yaml.h"

KVCAP_YAML_NAME_SET(policy, enum kvcap_policy, kvcap_policy, 0)

/* ---- Defaults ---------------------------------------------------------------------------- */
void kvcap_runtime_config_default(struct kvcap_runtime_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->policy[KVCAP_SPAN_VISION] = KVCAP_POLICY_FLASHCACHE; /* no artifact configured */
    cfg->policy[KVCAP_SPAN_TEXT] = KVCAP_POLICY_FULL;
    cfg->policy[KVCAP_SPAN_GENERATED] = KVCAP_POLICY_FULL;
    cfg->fallback = KVCAP_POLICY_FLASHCACHE;
    cfg->flashcache = (struct kvcap_flashcache_config){
        .gamma = 0.2, .retention = 0.4, .min_tokens = 0, .sinks = 0, .window = 0};
    cfg->vlcache = (struct kvcap_vlcache_config){
        .p = 0.01, .budget = 0.4, .min_fraction = 0.01, .recent_fraction = 0.1, .sinks = 0,
        .window = 0, .uniform_layers = 0};
    cfg->freekv = (struct kvcap_freekv_config){
        .page_size = 32, .budget = 2048, .tau = 0.9, .sink_pages = 1, .window_pages = 2};
    cfg->streaming = (struct kvcap_streaming_config){.sinks = 4, .window = 1024};
    cfg->kvzip =
        (struct kvcap_kvzip_config){.retention = 0.4, .sinks = 0, .window = 0, .safeguard = 0,
                                    .value_basis = 0, .exact_values = 0};
    cfg->random = (struct kvcap_random_config){.retention = 0.4, .sinks = 0, .window = 0,
                                               .seed = 0};
    cfg->expected = (struct kvcap_expected_config){
        .retention = 0.4, .n_future = 512, .query_sinks = 4, .sinks = 0, .window = 0};
    cfg->kvcapsule = (struct kvcap_kvcapsule_config){.exact_tiles = 0};
    cfg->has_model = 0;
}

void kvcap_runtime_config_free(struct kvcap_runtime_config *cfg)
{
    (void)cfg; /* no heap today; see config.h */
}

/* ---- Runtime config ---------------------------------------------------------------------- */
/* An optional key of `map` (`field`.`key`) naming one of two choices: *out = 0 for `no`, 1 for
 * `yes`; anything else is an error naming both, with what each means. */
static enum kvcap_status get_choice(struct kvcap_yaml *c, yaml_node_t *map, const char *field,
                                    const char *key, const char *no, const char *no_means,
                                    const char *yes, const char *yes_means, int *out)
{
    yaml_node_t *v = kvcap_yaml_lookup(c, map, key);
    if (!v)
        return KVCAP_OK;
    const char *s = v->type == YAML_SCALAR_NODE ? kvcap_yaml_scalar(v) : "";
    if (strcmp(s, no) != 0 && strcmp(s, yes) != 0)
        return kvcap_yaml_fail_at(c, v->start_mark, "%s.%s: '%s' is not %s (%s) or %s (%s)",
                                  field, key, s, no, no_means, yes, yes_means);
    *out = strcmp(s, yes) == 0;
    return KVCAP_OK;
}

/* `field`.sinks and `field`.window (window >= window_min), each a token count, and their sum
 * too: together they are the rows a segment always keeps (StreamingLLM's ring for generated
 * tokens is sinks + window rows), counted in an int. */
static enum kvcap_status get_protected(struct kvcap_yaml *c, yaml_node_t *map, const char *field,
                                       int window_min, int *sinks, int *window)
{
    KVCAP_TRY(kvcap_yaml_get_int(c, map, field, "sinks", 0, KVCAP_CONFIG_MAX_TOKENS, sinks));
    KVCAP_TRY(
        kvcap_yaml_get_int(c, map, field, "window", window_min, KVCAP_CONFIG_MAX_TOKENS, window));
    long long sum = (long long)*sinks + *window;
    if (sum <= KVCAP_CONFIG_MAX_TOKENS)
        return KVCAP_OK;
    yaml_node_t *w = kvcap_yaml_lookup(c, map, "window");
    return kvcap_yaml_fail_at(c, w ? w->start_mark : map->start_mark,
                              "%s.sinks + %s.window: %d + %d = %lld tokens, at most %d", field,
                              field, *sinks, *window, sum, KVCAP_CONFIG_MAX_TOKENS);
}

static enum kvcap_status parse_artifact(struct kvcap_yaml *c, yaml_node_t *n, char *out)
{
    if (kvcap_yaml_is_null(n)) {
        out[0] = '\0'; /* `artifact: null` says "none" explicitly */
        return KVCAP_OK;
    }
    char path[KVCAP_CONFIG_MAX_PATH];
    KVCAP_TRY(kvcap_yaml_as_string(c, n, "artifact", path, sizeof path));
    if (path[0] == '/' || !c->dir || c->dir_len == 0) {
        memcpy(out, path, strlen(path) + 1);
        return KVCAP_OK;
    }
    const char *sep = c->dir[c->dir_len - 1] == '/' ? "" : "/";
    int w = snprintf(out, KVCAP_CONFIG_MAX_PATH, "%.*s%s%s", (int)c->dir_len, c->dir, sep, path);
    if (w < 0 || w >= KVCAP_CONFIG_MAX_PATH) {
        out[0] = '\0';
        return kvcap_yaml_fail_at(c, n->start_mark,
                                  "artifact: path relative to %.*s is longer than %d bytes",
                                  (int)c->dir_len, c->dir, KVCAP_CONFIG_MAX_PATH - 1);
    }
    return KVCAP_OK;
}

static enum kvcap_status parse_runtime(struct kvcap_yaml *c, yaml_node_t *root, void *out)
{
    static const char *const keys[] = {"artifact", "policies", "fallback",  "flashcache",
                                       "vlcache",  "freekv",   "streaming", "kvcapsule",
                                       "kvzip",    "random",   "expected_attention",
                                       "model",    NULL};
    static const char *const kinds[] = {"vision", "text", "generated", NULL};
    static const char *const flash_keys[] = {"gamma", "retention", "min_tokens", "sinks",
                                             "window", NULL};
    static const char *const vl_keys[] = {"p",     "budget", "min_fraction", "recent_fraction",
                                          "sinks", "window", "layer_budgets", NULL};
    static const char *const freekv_keys[] = {"page_size", "budget", "tau", "sink_pages",
                                              "window_pages", NULL};
    static const char *const streaming_keys[] = {"sinks", "window", NULL};
    static const char *const kvzip_keys[] = {"retention", "sinks", "window", "safeguard",
                                             "values",    "exact_values", NULL};
    static const char *const random_keys[] = {"retention", "sinks", "window", "seed", NULL};
    static const char *const expected_keys[] = {"retention", "n_future", "query_sinks", "sinks",
                                                "window", NULL};
    static const char *const kvcapsule_keys[] = {"exact_tiles", NULL};
    struct kvcap_runtime_config *cfg = out;
    KVCAP_TRY(kvcap_yaml_check_mapping(c, root, "", keys, NULL));

    yaml_node_t *n = kvcap_yaml_lookup(c, root, "artifact");
    if (n)
        KVCAP_TRY(parse_artifact(c, n, cfg->artifact));
    if (cfg->artifact[0])
        cfg->policy[KVCAP_SPAN_VISION] = KVCAP_POLICY_KVCAPSULE;

    yaml_node_t *pol = kvcap_yaml_lookup(c, root, "policies");
    if (pol) {
        KVCAP_TRY(kvcap_yaml_check_mapping(c, pol, "policies", kinds, NULL));
        for (int k = 0; kinds[k]; k++) {
            KVCAP_YAML_GET_NAMED(c, pol, "policies", kinds[k], &policy_set, &cfg->policy[k]);
            yaml_node_t *v = kvcap_yaml_lookup(c, pol, kinds[k]);
            if (!v || cfg->policy[k] != KVCAP_POLICY_KVCAPSULE)
                continue;
            /* kvcapsule's artifact may also come from the engine (kvcap_cache_params), so its
             * presence is checked where the cache is created, not here. */
            if (k != KVCAP_SPAN_VISION)
                return kvcap_yaml_fail_at(c, v->start_mark,
                                          "policies.%s: kvcapsule applies to vision spans only",
                                          kinds[k]);
        }
    }
    n = kvcap_yaml_lookup(c, root, "fallback");
    if (n && n->type == YAML_SCALAR_NODE && strcmp(kvcap_yaml_scalar(n), "none") == 0)
        cfg->fallback = KVCAP_FALLBACK_NONE;
    else if (n) {
        KVCAP_YAML_GET_NAMED(c, root, "", "fallback", &policy_set, &cfg->fallback);
        if (cfg->fallback == KVCAP_POLICY_KVCAPSULE)
            return kvcap_yaml_fail_at(
                c, n->start_mark,
                "fallback: cannot be kvcapsule (it serves the spans kvcapsule has "
                "no bucket for)");
    }

    if ((n = kvcap_yaml_lookup(c, root, "flashcache"))) {
        struct kvcap_flashcache_config *p = &cfg->flashcache;
        const char *f = "flashcache";
        KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, flash_keys, NULL));
        KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "gamma", KVCAP_YAML_RATIO, &p->gamma));
        KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "retention", KVCAP_YAML_RATIO, &p->retention));
        KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "min_tokens", 0, KVCAP_CONFIG_MAX_TOKENS,
                                     &p->min_tokens));
        KVCAP_TRY(get_protected(c, n, f, 0, &p->sinks, &p->window));
    }
    if ((n = kvcap_yaml_lookup(c, root, "vlcache"))) {
        struct kvcap_vlcache_config *p = &cfg->vlcache;
        const char *f = "vlcache";
        KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, vl_keys, NULL));
        KVCAP_TRY(
            kvcap_yaml_get_double(c, n, f, "p", (struct kvcap_yaml_range){0.0, 1.0, 1, 1}, &p->p));
        KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "budget", KVCAP_YAML_RATIO, &p->budget));
        KVCAP_TRY(
            kvcap_yaml_get_double(c, n, f, "min_fraction", KVCAP_YAML_RATIO, &p->min_fraction));
        KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "recent_fraction",
                                        (struct kvcap_yaml_range){0.0, 1.0, 0, 0},
                                        &p->recent_fraction));
        KVCAP_TRY(get_protected(c, n, f, 0, &p->sinks, &p->window));
        KVCAP_TRY(get_choice(c, n, f, "layer_budgets", "sparsity", "the paper's Algorithm 1",
                             "uniform", "budget in every layer", &p->uniform_layers));
    }
    if ((n = kvcap_yaml_lookup(c, root, "freekv"))) {
        struct kvcap_freekv_config *p = &cfg->freekv;
        const char *f = "freekv";
        KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, freekv_keys, NULL));
        KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "page_size", 1, 65536, &p->page_size));
        KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "budget", 1, KVCAP_CONFIG_MAX_TOKENS, &p->budget));
        KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "tau", (struct kvcap_yaml_range){-1.0, 1.0, 0, 0},
                                        &p->tau));
        KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "sink_pages", 0, 1 << 20, &p->sink_pages));
        KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "window_pages", 1, 1 << 20, &p->window_pages));
        /* At least one page beyond sinks and window must be selectable, or FreeKV is
         * StreamingLLM. Products fit in 64 bits: pages < 2^21, page_size <= 2^16. */
        long long need = ((long long)p->sink_pages + p->window_pages + 1) * p->page_size;
        if (p->budget < need) {
            yaml_node_t *b = kvcap_yaml_lookup(c, n, "budget");
            return kvcap_yaml_fail_at(
                c, b ? b->start_mark : n->start_mark,
                "freekv.budget: %d tokens leave no page to retrieve: need >= %lld "
                "((sink_pages %d + window_pages %d + 1) x page_size %d)",
                p->budget, need, p->sink_pages, p->window_pages, p->page_size);
        }
    }
    if ((n = kvcap_yaml_lookup(c, root, "streaming"))) {
        const char *f = "streaming";
        KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, streaming_keys, NULL));
        KVCAP_TRY(get_protected(c, n, f, 1, &cfg->streaming.sinks, &cfg->streaming.window));
    }
    if ((n = kvcap_yaml_lookup(c, root, "kvzip"))) {
        struct kvcap_kvzip_config *p = &cfg->kvzip;
        const char *f = "kvzip";
        KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, kvzip_keys, NULL));
        KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "retention",
                                        KVCAP_YAML_RATIO, &p->retention));
        KVCAP_TRY(get_protected(c, n, f, 0, &p->sinks, &p->window));
        KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "safeguard",
                                        (struct kvcap_yaml_range){0.0, 1.0, 0, 0}, &p->safeguard));
        KVCAP_TRY(get_choice(c, n, f, "values", "rows", "a row per kept token", "basis",
                             "the artifact's value bases", &p->value_basis));
        KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "exact_values", 0, 1 << 20, &p->exact_values));
    }
    if ((n = kvcap_yaml_lookup(c, root, "random"))) {
        struct kvcap_random_config *p = &cfg->random;
        const char *f = "random";
        KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, random_keys, NULL));
        KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "retention",
                                        KVCAP_YAML_RATIO, &p->retention));
        KVCAP_TRY(get_protected(c, n, f, 0, &p->sinks, &p->window));
        int seed = 0;
        KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "seed", 0, INT_MAX, &seed));
        p->seed = seed;
    }
    if ((n = kvcap_yaml_lookup(c, root, "expected_attention"))) {
        struct kvcap_expected_config *p = &cfg->expected;
        const char *f = "expected_attention";
        KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, expected_keys, NULL));
        KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "retention", KVCAP_YAML_RATIO, &p->retention));
        KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "n_future", 1, 1 << 24, &p->n_future));
        KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "query_sinks", 0, KVCAP_CONFIG_MAX_TOKENS,
                                     &p->query_sinks));
        KVCAP_TRY(get_protected(c, n, f, 0, &p->sinks, &p->window));
    }
    if ((n = kvcap_yaml_lookup(c, root, "kvcapsule"))) {
        KVCAP_TRY(kvcap_yaml_check_mapping(c, n, "kvcapsule", kvcapsule_keys, NULL));
        KVCAP_TRY(kvcap_yaml_get_int(c, n, "kvcapsule", "exact_tiles", 0, 1 << 20,
                                     &cfg->kvcapsule.exact_tiles));
    }
    if ((n = kvcap_yaml_lookup(c, root, "model"))) {
        KVCAP_TRY(kvcap_yaml_parse_model(c, n, &cfg->model));
        cfg->has_model = 1;
    }
    return KVCAP_OK;
}

/* ---- Loading ----------------------------------------------------------------------------- */
enum kvcap_status kvcap_runtime_config_load_file(const char *path,
                                                 struct kvcap_runtime_config *cfg)
{
    KVCAP_RETURN_IF(!path || !cfg, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_runtime_config_load_file: NULL argument");
    kvcap_runtime_config_default(cfg);
    enum kvcap_status st = kvcap_yaml_load_file(path, parse_runtime, cfg);
    if (st != KVCAP_OK)
        kvcap_runtime_config_default(cfg);
    return st;
}

enum kvcap_status kvcap_runtime_config_load_string(const char *text, const char *label,
                                                   struct kvcap_runtime_config *cfg)
{
    KVCAP_RETURN_IF(!text || !cfg, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_runtime_config_load_string: NULL argument");
    kvcap_runtime_config_default(cfg);
    enum kvcap_status st = kvcap_yaml_load(text, strlen(text), label ? label : "<string>", NULL, 0,
                                           parse_runtime, cfg);
    if (st != KVCAP_OK)
        kvcap_runtime_config_default(cfg);
    return st;
}

