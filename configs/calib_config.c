/* calib_config.c — the calibration config (what kvcap-calibrate fits, config.h): defaults,
 * retention schedules and the keys it reads through the strict reader (yaml.h). Built into the
 * calibration tools, not into libkvcap. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "configs/yaml.h"

KVCAP_YAML_NAME_SET(structure, enum kvcap_structure, kvcap_structure, 0)
KVCAP_YAML_NAME_SET(key_method, enum kvcap_key_method, kvcap_key_method, 0)
KVCAP_YAML_NAME_SET(activation, enum kvcap_activation, kvcap_activation, 0)
KVCAP_YAML_NAME_SET(schedule_kind, enum kvcap_schedule_kind, kvcap_schedule_kind, 0)
/* Storage: only F32, F16 and BF16, the dtype values 0..2 (kvcap.h pins them). */
KVCAP_YAML_NAME_SET(storage, enum kvcap_dtype, kvcap_dtype, 3)

/* ---- Schedules --------------------------------------------------------------------------- */
enum kvcap_status kvcap_schedule_expand(const struct kvcap_schedule *s, int n_layers, double *out)
{
    KVCAP_RETURN_IF(!s || !out, KVCAP_ERR_INVALID_ARGUMENT, "schedule: NULL pointer");
    KVCAP_RETURN_IF(n_layers < 1, KVCAP_ERR_INVALID_ARGUMENT, "schedule: %d layers", n_layers);
    switch (s->kind) {
    case KVCAP_SCHEDULE_PYRAMID:
        for (int l = 0; l < n_layers; l++) {
            /* Written as a convex combination so both endpoints are exact. */
            double t = n_layers > 1 ? (double)l / (double)(n_layers - 1) : 0.0;
            out[l] = (1.0 - t) * s->first + t * s->last;
        }
        return KVCAP_OK;
    case KVCAP_SCHEDULE_UNIFORM:
        for (int l = 0; l < n_layers; l++)
            out[l] = s->ratio;
        return KVCAP_OK;
    case KVCAP_SCHEDULE_LIST:
        KVCAP_RETURN_IF(!s->ratios || s->n_ratios != n_layers, KVCAP_ERR_INVALID_ARGUMENT,
                        "schedule: list of %d ratios for %d layers", s->n_ratios, n_layers);
        memcpy(out, s->ratios, (size_t)n_layers * sizeof *out);
        return KVCAP_OK;
    }
    return kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "schedule: unknown kind %d", (int)s->kind);
}

static void schedule_free(struct kvcap_schedule *s)
{
    free(s->ratios);
    s->ratios = NULL;
    s->n_ratios = 0;
}

/* ---- Defaults ---------------------------------------------------------------------------- */
void kvcap_calib_config_default(struct kvcap_calib_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    struct kvcap_schedule uniform = {.kind = KVCAP_SCHEDULE_UNIFORM, .ratio = 0.4};
    cfg->schedule_keys = uniform;
    cfg->schedule_values = uniform;
    cfg->keys.method = KVCAP_KEY_METHOD_CLOSED_FORM;
    cfg->keys.activation = KVCAP_ACTIVATION_GELU;
    cfg->keys.hidden = 0;
    cfg->keys.ridge = 1e-3;
    cfg->keys.train = (struct kvcap_train_config){.steps = 300,
                                                  .lr = 1e-3,
                                                  .tau_start = 1.0,
                                                  .tau_end = 0.05,
                                                  .lambda_bce = 0.01,
                                                  .lambda_r = 1.0,
                                                  .finetune_steps = 100,
                                                  .seed = 0};
    cfg->validation_fraction = 0.1;
    cfg->validation_seed = 0;
    cfg->storage = KVCAP_DTYPE_F16;
}

void kvcap_calib_config_free(struct kvcap_calib_config *cfg)
{
    if (!cfg)
        return;
    schedule_free(&cfg->schedule_keys);
    schedule_free(&cfg->schedule_values);
}

/* ---- Calibration config ------------------------------------------------------------------ */
static enum kvcap_status parse_buckets(struct kvcap_yaml *c, yaml_node_t *n,
                                       struct kvcap_calib_config *cfg)
{
    static const char *const keys[] = {"rows", "cols", "structure", "tile", NULL};
    static const char *const required[] = {"rows", "cols", NULL};
    KVCAP_TRY(kvcap_yaml_expect(c, n, "buckets", YAML_SEQUENCE_NODE));
    ptrdiff_t len = n->data.sequence.items.top - n->data.sequence.items.start;
    if (len < 1 || len > KVCAP_CONFIG_MAX_BUCKETS)
        return kvcap_yaml_fail_at(c, n->start_mark, "buckets: %td buckets, expected 1..%d", len,
                                  KVCAP_CONFIG_MAX_BUCKETS);
    for (int i = 0; i < (int)len; i++) {
        yaml_node_t *m = kvcap_yaml_node_at(c, n->data.sequence.items.start[i]);
        char f[KVCAP_YAML_FIELD_CAP];
        snprintf(f, sizeof f, "buckets[%d]", i);
        KVCAP_TRY(kvcap_yaml_check_mapping(c, m, f, keys, NULL));
        KVCAP_TRY(kvcap_yaml_require(c, m, f, required));
        struct kvcap_bucket b = {0};
        KVCAP_TRY(kvcap_yaml_get_int(c, m, f, "rows", INT_MIN, INT_MAX, &b.rows));
        KVCAP_TRY(kvcap_yaml_get_int(c, m, f, "cols", INT_MIN, INT_MAX, &b.cols));
        b.structure = KVCAP_STRUCTURE_DENSE;
        KVCAP_YAML_GET_NAMED(c, m, f, "structure", &structure_set, &b.structure);
        yaml_node_t *tile = kvcap_yaml_lookup(c, m, "tile");
        char tf[KVCAP_YAML_FIELD_CAP];
        kvcap_yaml_join(tf, f, "tile");
        if (b.structure == KVCAP_STRUCTURE_TILED) {
            KVCAP_TRY(kvcap_yaml_require(c, m, f, (const char *const[]){"tile", NULL}));
            int t[2], nt;
            KVCAP_TRY(kvcap_yaml_get_int_list(c, tile, tf, 2, 2, t, &nt));
            b.tile_rows = t[0];
            b.tile_cols = t[1];
        } else if (tile) {
            return kvcap_yaml_fail_at(c, tile->start_mark, "%s: only valid with structure tiled",
                                      tf);
        }
        if (kvcap_bucket_check(&b, f) != KVCAP_OK)
            return kvcap_yaml_relocate(c, m->start_mark);
        for (int j = 0; j < i; j++) {
            const struct kvcap_bucket *o = &cfg->buckets[j];
            if (o->rows == b.rows && o->cols == b.cols && o->structure == b.structure &&
                o->tile_rows == b.tile_rows && o->tile_cols == b.tile_cols)
                return kvcap_yaml_fail_at(c, m->start_mark,
                                          "%s: same grid, structure and tile as buckets[%d]", f, j);
        }
        cfg->buckets[i] = b;
        cfg->n_buckets = i + 1;
    }
    return KVCAP_OK;
}

/* One schedule mapping {kind: ..., ...} at `f`; a list must have `n_layers` ratios. */
static enum kvcap_status parse_schedule_one(struct kvcap_yaml *c, yaml_node_t *n, const char *f,
                                            int n_layers, struct kvcap_schedule *s)
{
    static const char *const pyramid[] = {"kind", "first", "last", NULL};
    static const char *const uniform[] = {"kind", "ratio", NULL};
    static const char *const list[] = {"kind", "ratios", NULL};
    static const char *const *const keys_of[] = {pyramid, uniform, list};
    KVCAP_TRY(kvcap_yaml_expect(c, n, f, YAML_MAPPING_NODE));
    KVCAP_TRY(kvcap_yaml_require(c, n, f, (const char *const[]){"kind", NULL}));
    int kind = 0;
    KVCAP_YAML_GET_NAMED(c, n, f, "kind", &schedule_kind_set, &kind);
    const char *const *keys = keys_of[kind];
    KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, keys,
                                       kvcap_schedule_kind_name((enum kvcap_schedule_kind)kind)));
    KVCAP_TRY(kvcap_yaml_require(c, n, f, keys + 1));
    memset(s, 0, sizeof *s);
    s->kind = (enum kvcap_schedule_kind)kind;
    if (kind == KVCAP_SCHEDULE_PYRAMID) {
        KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "first", KVCAP_YAML_RATIO, &s->first));
        return kvcap_yaml_get_double(c, n, f, "last", KVCAP_YAML_RATIO, &s->last);
    }
    if (kind == KVCAP_SCHEDULE_UNIFORM)
        return kvcap_yaml_get_double(c, n, f, "ratio", KVCAP_YAML_RATIO, &s->ratio);

    char lf[KVCAP_YAML_FIELD_CAP];
    kvcap_yaml_join(lf, f, "ratios");
    yaml_node_t *l = kvcap_yaml_lookup(c, n, "ratios");
    KVCAP_TRY(kvcap_yaml_expect(c, l, lf, YAML_SEQUENCE_NODE));
    ptrdiff_t len = l->data.sequence.items.top - l->data.sequence.items.start;
    if (len != n_layers)
        return kvcap_yaml_fail_at(c, l->start_mark,
                                  "%s: %td ratios, expected one per layer (model.layers = %d)", lf,
                                  len, n_layers);
    double *r = malloc((size_t)len * sizeof *r);
    if (!r)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory for %td ratios", c->label,
                          len);
    for (ptrdiff_t i = 0; i < len; i++) {
        char sub[KVCAP_YAML_FIELD_CAP];
        snprintf(sub, sizeof sub, "%.100s[%td]", lf, i);
        enum kvcap_status st =
            kvcap_yaml_as_double(c, kvcap_yaml_node_at(c, l->data.sequence.items.start[i]), sub,
                                 KVCAP_YAML_RATIO, &r[i]);
        if (st != KVCAP_OK) {
            free(r);
            return st;
        }
    }
    s->ratios = r;
    s->n_ratios = (int)len;
    return KVCAP_OK;
}

static enum kvcap_status copy_schedule(struct kvcap_schedule *dst, const struct kvcap_schedule *src,
                                       const char *label)
{
    *dst = *src;
    if (src->kind != KVCAP_SCHEDULE_LIST)
        return KVCAP_OK;
    dst->ratios = malloc((size_t)src->n_ratios * sizeof *dst->ratios);
    if (!dst->ratios) {
        dst->n_ratios = 0;
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory for schedule", label);
    }
    memcpy(dst->ratios, src->ratios, (size_t)src->n_ratios * sizeof *dst->ratios);
    return KVCAP_OK;
}

/* `schedule: {keys: S, values: S}` or a bare `schedule: S` for both. */
static enum kvcap_status parse_schedule(struct kvcap_yaml *c, yaml_node_t *n,
                                        struct kvcap_calib_config *cfg)
{
    static const char *const keys[] = {"keys", "values", NULL};
    const char *f = "schedule";
    int n_layers = cfg->model.n_layers;
    schedule_free(&cfg->schedule_keys);
    schedule_free(&cfg->schedule_values);
    KVCAP_TRY(kvcap_yaml_expect(c, n, f, YAML_MAPPING_NODE));
    if (kvcap_yaml_lookup(c, n, "kind")) {
        KVCAP_TRY(parse_schedule_one(c, n, f, n_layers, &cfg->schedule_keys));
        return copy_schedule(&cfg->schedule_values, &cfg->schedule_keys, c->label);
    }
    KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, keys, NULL));
    if (!kvcap_yaml_lookup(c, n, "keys") && !kvcap_yaml_lookup(c, n, "values"))
        return kvcap_yaml_fail_at(
            c, n->start_mark,
            "schedule: give 'kind' (one schedule for keys and values) or 'keys' "
            "and 'values'");
    KVCAP_TRY(kvcap_yaml_require(c, n, f, keys));
    KVCAP_TRY(parse_schedule_one(c, kvcap_yaml_lookup(c, n, "keys"), "schedule.keys", n_layers,
                                 &cfg->schedule_keys));
    return parse_schedule_one(c, kvcap_yaml_lookup(c, n, "values"), "schedule.values", n_layers,
                              &cfg->schedule_values);
}

static enum kvcap_status parse_keys(struct kvcap_yaml *c, yaml_node_t *n,
                                    struct kvcap_keys_config *k)
{
    static const char *const keys[] = {"method", "activation", "hidden", "ridge", "train", NULL};
    static const char *const train_keys[] = {"steps",      "lr",       "tau_start",
                                             "tau_end",    "lambda_bce", "lambda_r",
                                             "finetune_steps", "seed", NULL};
    const char *f = "keys";
    KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, keys, NULL));
    KVCAP_YAML_GET_NAMED(c, n, f, "method", &key_method_set, &k->method);
    KVCAP_YAML_GET_NAMED(c, n, f, "activation", &activation_set, &k->activation);
    KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "hidden", 0, 65536, &k->hidden));
    KVCAP_TRY(kvcap_yaml_get_double(c, n, f, "ridge", KVCAP_YAML_NONNEG, &k->ridge));
    yaml_node_t *t = kvcap_yaml_lookup(c, n, "train");
    if (!t)
        return KVCAP_OK;
    const char *tf = "keys.train";
    struct kvcap_train_config *tr = &k->train;
    KVCAP_TRY(kvcap_yaml_check_mapping(c, t, tf, train_keys, NULL));
    KVCAP_TRY(kvcap_yaml_get_int(c, t, tf, "steps", 0, 100000000, &tr->steps));
    KVCAP_TRY(kvcap_yaml_get_double(c, t, tf, "lr", KVCAP_YAML_POSITIVE, &tr->lr));
    KVCAP_TRY(kvcap_yaml_get_double(c, t, tf, "tau_start", KVCAP_YAML_POSITIVE, &tr->tau_start));
    KVCAP_TRY(kvcap_yaml_get_double(c, t, tf, "tau_end", KVCAP_YAML_POSITIVE, &tr->tau_end));
    KVCAP_TRY(kvcap_yaml_get_double(c, t, tf, "lambda_bce", KVCAP_YAML_NONNEG, &tr->lambda_bce));
    KVCAP_TRY(kvcap_yaml_get_double(c, t, tf, "lambda_r", KVCAP_YAML_NONNEG, &tr->lambda_r));
    KVCAP_TRY(kvcap_yaml_get_int(c, t, tf, "finetune_steps", 0, 100000000, &tr->finetune_steps));
    KVCAP_TRY(kvcap_yaml_get_u64(c, t, tf, "seed", &tr->seed));
    if (tr->tau_end > tr->tau_start) {
        yaml_node_t *at = kvcap_yaml_lookup(c, t, "tau_end");
        return kvcap_yaml_fail_at(
            c, at ? at->start_mark : t->start_mark,
            "keys.train.tau_end: %g exceeds tau_start %g (the temperature anneals "
            "downwards)",
            tr->tau_end, tr->tau_start);
    }
    return KVCAP_OK;
}

static enum kvcap_status parse_calib(struct kvcap_yaml *c, yaml_node_t *root, void *out)
{
    static const char *const keys[] = {"model", "buckets", "schedule", "keys",
                                       "validation", "storage", NULL};
    static const char *const required[] = {"model", "buckets", "schedule", NULL};
    static const char *const validation_keys[] = {"fraction", "seed", NULL};
    struct kvcap_calib_config *cfg = out;
    KVCAP_TRY(kvcap_yaml_check_mapping(c, root, "", keys, NULL));
    KVCAP_TRY(kvcap_yaml_require(c, root, "", required));
    KVCAP_TRY(kvcap_yaml_parse_model(c, kvcap_yaml_lookup(c, root, "model"), &cfg->model));
    KVCAP_TRY(parse_buckets(c, kvcap_yaml_lookup(c, root, "buckets"), cfg));
    KVCAP_TRY(parse_schedule(c, kvcap_yaml_lookup(c, root, "schedule"), cfg));
    yaml_node_t *k = kvcap_yaml_lookup(c, root, "keys");
    if (k)
        KVCAP_TRY(parse_keys(c, k, &cfg->keys));
    yaml_node_t *v = kvcap_yaml_lookup(c, root, "validation");
    if (v) {
        KVCAP_TRY(kvcap_yaml_check_mapping(c, v, "validation", validation_keys, NULL));
        KVCAP_TRY(kvcap_yaml_get_double(c, v, "validation", "fraction",
                                        (struct kvcap_yaml_range){0.0, 1.0, 0, 1},
                                        &cfg->validation_fraction));
        KVCAP_TRY(kvcap_yaml_get_u64(c, v, "validation", "seed", &cfg->validation_seed));
    }
    KVCAP_YAML_GET_NAMED(c, root, "", "storage", &storage_set, &cfg->storage);
    return KVCAP_OK;
}

/* ---- Loading ----------------------------------------------------------------------------- */
enum kvcap_status kvcap_calib_config_load_file(const char *path, struct kvcap_calib_config *cfg)
{
    KVCAP_RETURN_IF(!path || !cfg, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_calib_config_load_file: NULL argument");
    kvcap_calib_config_default(cfg);
    enum kvcap_status st = kvcap_yaml_load_file(path, parse_calib, cfg);
    if (st != KVCAP_OK) {
        kvcap_calib_config_free(cfg);
        kvcap_calib_config_default(cfg);
    }
    return st;
}

enum kvcap_status kvcap_calib_config_load_string(const char *text, const char *label,
                                                 struct kvcap_calib_config *cfg)
{
    KVCAP_RETURN_IF(!text || !cfg, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_calib_config_load_string: NULL argument");
    kvcap_calib_config_default(cfg);
    enum kvcap_status st =
        kvcap_yaml_load(text, strlen(text), label ? label : "<string>", NULL, 0, parse_calib, cfg);
    if (st != KVCAP_OK) {
        kvcap_calib_config_free(cfg);
        kvcap_calib_config_default(cfg);
    }
    return st;
}

