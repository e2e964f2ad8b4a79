/* fuzz_calib_config.c — the calibration YAML config parser (configs/calib_config.c) over hostile
 * text, as a string and as a file: a config that loads is complete and valid (geometry, buckets,
 * schedules), one that does not holds no heap memory, and both entry points agree. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "configs/config.h"
#include "tests/fuzz/fuzz_common.h"

static int same_bucket(const struct kvcap_bucket *a, const struct kvcap_bucket *b)
{
    return a->rows == b->rows && a->cols == b->cols && a->structure == b->structure &&
           a->tile_rows == b->tile_rows && a->tile_cols == b->tile_cols;
}

static void check_schedule(const struct kvcap_schedule *s, int layers, const char *which)
{
    double *r = malloc(sizeof(double) * (size_t)layers);
    FUZZ_ASSERT(r != NULL, "out of memory");
    kvcap_clear_error();
    FUZZ_ASSERT(kvcap_schedule_expand(s, layers, r) == KVCAP_OK, "%s does not expand: %s", which,
                kvcap_last_error());
    for (int l = 0; l < layers; l++)
        FUZZ_ASSERT(r[l] > 0 && r[l] <= 1, "%s[%d] = %g", which, l, r[l]);
    free(r);
}

/* What kvcap_calib_config_load_* promise of a config they accept (config.h). */
static void check_loaded(const struct kvcap_calib_config *c)
{
    kvcap_clear_error();
    FUZZ_ASSERT(kvcap_geometry_validate(&c->model) == KVCAP_OK, "invalid model accepted: %s",
                kvcap_last_error());
    FUZZ_ASSERT(c->n_buckets >= 1 && c->n_buckets <= KVCAP_CONFIG_MAX_BUCKETS, "%d buckets",
                c->n_buckets);
    for (int b = 0; b < c->n_buckets; b++) {
        kvcap_clear_error();
        FUZZ_ASSERT(kvcap_bucket_check(&c->buckets[b], "bucket") == KVCAP_OK,
                    "invalid bucket %d accepted: %s", b, kvcap_last_error());
        for (int o = 0; o < b; o++)
            FUZZ_ASSERT(!same_bucket(&c->buckets[b], &c->buckets[o]), "buckets %d and %d equal",
                        o, b);
    }
    check_schedule(&c->schedule_keys, c->model.n_layers, "schedule.keys");
    check_schedule(&c->schedule_values, c->model.n_layers, "schedule.values");
    FUZZ_ASSERT(c->validation_fraction >= 0 && c->validation_fraction < 1,
                "validation fraction %g", c->validation_fraction);
    FUZZ_ASSERT(c->storage == KVCAP_DTYPE_F32 || c->storage == KVCAP_DTYPE_F16 ||
                    c->storage == KVCAP_DTYPE_BF16,
                "storage %d", (int)c->storage);
    FUZZ_ASSERT(c->keys.ridge >= 0 && c->keys.hidden >= 0, "keys out of range");
    const struct kvcap_train_config *t = &c->keys.train;
    FUZZ_ASSERT(t->tau_end > 0 && t->tau_end <= t->tau_start, "tau %g -> %g", t->tau_start,
                t->tau_end);
}

/* A failed load leaves the defaults and no heap memory (config.h). */
static void check_failed(const struct kvcap_calib_config *c)
{
    FUZZ_ASSERT(c->schedule_keys.ratios == NULL && c->schedule_values.ratios == NULL,
                "a failed load kept a schedule list");
    FUZZ_ASSERT(c->n_buckets == 0, "a failed load kept %d buckets", c->n_buckets);
}

static enum kvcap_status load(enum kvcap_status st, struct kvcap_calib_config *cfg,
                              const char *call)
{
    fuzz_check_status(st, call);
    if (st == KVCAP_OK)
        check_loaded(cfg);
    else
        check_failed(cfg);
    kvcap_calib_config_free(cfg);
    return st;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > KVCAP_CONFIG_MAX_BYTES)
        return 0;
    char *text = malloc(size + 1);
    FUZZ_ASSERT(text != NULL, "out of memory");
    memcpy(text, data, size);
    text[size] = '\0';
    struct kvcap_calib_config cfg;
    /* Not initialised on purpose: the loaders overwrite the whole struct. */
    memset(&cfg, 0xA5, sizeof cfg);
    kvcap_clear_error();
    enum kvcap_status from_string = load(kvcap_calib_config_load_string(text, "fuzz.yaml", &cfg),
                                         &cfg, "kvcap_calib_config_load_string");
    free(text);

    char path[4400];
    fuzz_write_file(path, sizeof path, "calib.yaml", data, size);
    memset(&cfg, 0x5A, sizeof cfg);
    kvcap_clear_error();
    enum kvcap_status from_file = load(kvcap_calib_config_load_file(path, &cfg), &cfg,
                                       "kvcap_calib_config_load_file");
    /* Without a NUL both saw the same text. */
    if (!memchr(data, '\0', size))
        FUZZ_ASSERT(from_string == from_file, "string: %s, file: %s", kvcap_status_str(from_string),
                    kvcap_status_str(from_file));
    return 0;
}
