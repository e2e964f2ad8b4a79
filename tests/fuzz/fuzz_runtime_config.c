/* fuzz_runtime_config.c — the runtime YAML config parser (configs/runtime_config.c) over hostile
 * text, as a string and as a file (which also resolves a relative artifact path): a config that loads
 * keeps every documented invariant, one that does not holds the defaults. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "configs/config.h"
#include "tests/fuzz/fuzz_common.h"

/* What kvcap_runtime_config_load_* promise of a config they accept (config.h). */
static void check_loaded(const struct kvcap_runtime_config *c)
{
    FUZZ_ASSERT(memchr(c->artifact, '\0', sizeof c->artifact) != NULL, "artifact not terminated");
    for (int k = 0; k < 3; k++)
        FUZZ_ASSERT(c->policy[k] >= KVCAP_POLICY_FULL && c->policy[k] < KVCAP_POLICY_COUNT,
                    "policy[%d] = %d", k, (int)c->policy[k]);
    FUZZ_ASSERT(c->fallback == KVCAP_FALLBACK_NONE ||
                    (c->fallback >= KVCAP_POLICY_FULL && c->fallback < KVCAP_POLICY_COUNT &&
                     c->fallback != KVCAP_POLICY_KVCAPSULE),
                "fallback %d", (int)c->fallback);
    const struct kvcap_flashcache_config *fc = &c->flashcache;
    FUZZ_ASSERT(fc->gamma > 0 && fc->gamma <= 1 && fc->retention > 0 && fc->retention <= 1 &&
                    fc->min_tokens >= 0 && fc->sinks >= 0 && fc->window >= 0,
                "flashcache out of range");
    const struct kvcap_vlcache_config *vc = &c->vlcache;
    FUZZ_ASSERT(vc->p > 0 && vc->p < 1 && vc->budget > 0 && vc->budget <= 1 &&
                    vc->min_fraction > 0 && vc->min_fraction <= 1 && vc->recent_fraction >= 0 &&
                    vc->recent_fraction <= 1 && vc->sinks >= 0 && vc->window >= 0,
                "vlcache out of range");
    const struct kvcap_freekv_config *fk = &c->freekv;
    FUZZ_ASSERT(fk->page_size >= 1 && fk->page_size <= 65536 && fk->tau >= -1 && fk->tau <= 1 &&
                    fk->sink_pages >= 0 && fk->window_pages >= 1 &&
                    (int64_t)fk->budget >=
                        ((int64_t)fk->sink_pages + fk->window_pages + 1) * fk->page_size,
                "freekv out of range");
    FUZZ_ASSERT(c->streaming.sinks >= 0 && c->streaming.window >= 1, "streaming out of range");
    if (c->has_model)
        FUZZ_ASSERT(kvcap_geometry_validate(&c->model) == KVCAP_OK, "invalid model accepted: %s",
                    kvcap_last_error());
}

/* A failed load leaves the defaults (config.h). */
static void check_defaults(const struct kvcap_runtime_config *c)
{
    struct kvcap_runtime_config d;
    kvcap_runtime_config_default(&d);
    /* Field by field: padding bytes are not part of the promise. */
    int same = strcmp(c->artifact, d.artifact) == 0 && c->fallback == d.fallback &&
               c->has_model == d.has_model &&
               c->flashcache.gamma == d.flashcache.gamma &&
               c->flashcache.retention == d.flashcache.retention &&
               c->flashcache.min_tokens == d.flashcache.min_tokens &&
               c->flashcache.sinks == d.flashcache.sinks &&
               c->flashcache.window == d.flashcache.window && c->vlcache.p == d.vlcache.p &&
               c->vlcache.budget == d.vlcache.budget &&
               c->vlcache.min_fraction == d.vlcache.min_fraction &&
               c->vlcache.recent_fraction == d.vlcache.recent_fraction &&
               c->vlcache.sinks == d.vlcache.sinks && c->vlcache.window == d.vlcache.window &&
               c->vlcache.uniform_layers == d.vlcache.uniform_layers &&
               c->freekv.page_size == d.freekv.page_size && c->freekv.budget == d.freekv.budget &&
               c->freekv.tau == d.freekv.tau && c->freekv.sink_pages == d.freekv.sink_pages &&
               c->freekv.window_pages == d.freekv.window_pages &&
               c->streaming.sinks == d.streaming.sinks &&
               c->streaming.window == d.streaming.window;
    for (int k = 0; k < 3; k++)
        same = same && c->policy[k] == d.policy[k];
    FUZZ_ASSERT(same, "a failed load left something other than the defaults");
    kvcap_runtime_config_free(&d);
}

static void load(enum kvcap_status st, struct kvcap_runtime_config *cfg, const char *call)
{
    fuzz_check_status(st, call);
    if (st == KVCAP_OK)
        check_loaded(cfg);
    else
        check_defaults(cfg);
    kvcap_runtime_config_free(cfg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > KVCAP_CONFIG_MAX_BYTES)
        return 0;
    /* The string entry point sees the text up to its first NUL, the file one all of it. */
    char *text = malloc(size + 1);
    FUZZ_ASSERT(text != NULL, "out of memory");
    memcpy(text, data, size);
    text[size] = '\0';
    struct kvcap_runtime_config cfg;
    /* Not initialised on purpose: the loaders overwrite the whole struct. */
    memset(&cfg, 0xA5, sizeof cfg);
    kvcap_clear_error();
    load(kvcap_runtime_config_load_string(text, "fuzz.yaml", &cfg), &cfg,
         "kvcap_runtime_config_load_string");
    free(text);

    char path[4400];
    fuzz_write_file(path, sizeof path, "runtime.yaml", data, size);
    memset(&cfg, 0x5A, sizeof cfg);
    kvcap_clear_error();
    load(kvcap_runtime_config_load_file(path, &cfg), &cfg, "kvcap_runtime_config_load_file");
    return 0;
}
