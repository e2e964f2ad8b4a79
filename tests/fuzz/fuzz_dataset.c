/* fuzz_dataset.c — a dataset shard (formats/dataset.c over formats/schema.c) from hostile
 * bytes: a shard that opens is streamed span by span, every view it hands out is read end to
 * end and has the shape the span says, and kvcap-calibrate runs over it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "calibrate/calibrate.h"
#include "formats/dataset.h"
#include "tests/fuzz/fuzz_common.h"

/* Grids up to this many tokens become buckets of a calibration over the shard. */
#define CALIBRATE_POINTS_MAX 64

static uint8_t read_view(const struct kvst_tensor *t)
{
    const uint8_t *bytes = t->data;
    uint8_t x = 0;
    for (size_t k = 0; k < t->nbytes; k++)
        x ^= bytes[k];
    return x;
}

/* K/V views are [kv_heads][n][head_dim]; query views [q_heads][count >= 1][head_dim]
 * (n < 0). */
static void check_view(const struct kvst_tensor *t, int heads, int n, int d, const char *what)
{
    FUZZ_ASSERT(t->ndim == 3 && t->shape[0] == heads &&
                    (n < 0 ? t->shape[1] >= 1 : t->shape[1] == n) && t->shape[2] == d,
                "%s '%s': shape [%lld, %lld, %lld]", what, t->name, (long long)t->shape[0],
                (long long)t->shape[1], (long long)t->shape[2]);
}

/* kvcap-calibrate on the shard, one dense bucket per small grid it holds: the spans' values
 * (NaN, huge, subnormal) reach the Gram accumulation, the fit and the validation, which answer
 * with a status. */
static void calibrate(const char *path, const struct kvcap_model_geometry *g,
                      const struct kvcap_bucket *grids, int n_grids)
{
    struct kvcap_calib_config cfg;
    kvcap_calib_config_default(&cfg);
    cfg.model = *g;
    cfg.n_buckets = n_grids;
    memcpy(cfg.buckets, grids, sizeof grids[0] * (size_t)n_grids);
    cfg.validation_fraction = 0.25;
    struct kvcap_calibrate_options o;
    kvcap_calibrate_default_options(&o);
    o.data = (const char *const[]){path};
    o.n_data = 1;
    o.skip_unmatched = 1;
    o.device = KVCAP_CALIB_DEVICE_CPU;
    struct kvcap_calib_state state;
    struct kvcap_calibrate_report report;
    kvcap_clear_error();
    fuzz_check_status(kvcap_calibrate(&cfg, &o, &state, &report), "kvcap_calibrate");
    kvcap_calib_state_free(&state);
    kvcap_calib_config_free(&cfg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[4400];
    fuzz_write_file(path, sizeof path, "shard-00000.safetensors", data, size);
    const char *paths[1] = {path};
    struct kvcap_dataset *ds = NULL;
    kvcap_clear_error();
    enum kvcap_status st = kvcap_dataset_open(paths, 1, &ds);
    fuzz_check_status(st, "kvcap_dataset_open");
    if (st != KVCAP_OK) {
        FUZZ_ASSERT(ds == NULL, "a failed open left a handle");
        return 0;
    }
    const struct kvcap_model_geometry geometry = *kvcap_dataset_geometry(ds), *g = &geometry;
    kvcap_clear_error();
    FUZZ_ASSERT(kvcap_geometry_validate(g) == KVCAP_OK, "invalid model accepted: %s",
                kvcap_last_error());
    FUZZ_ASSERT(kvcap_dataset_shard_count(ds) == 1, "%d shards", kvcap_dataset_shard_count(ds));
    volatile uint8_t sink = 0;
    int64_t spans = 0;
    struct kvcap_bucket grids[KVCAP_CONFIG_MAX_BUCKETS];
    int n_grids = 0;
    for (int pass = 0; pass < 2; pass++) {
        const struct kvcap_span_view *sv = NULL;
        spans = 0;
        for (;;) {
            kvcap_clear_error();
            st = kvcap_dataset_next(ds, &sv);
            fuzz_check_status(st, "kvcap_dataset_next");
            if (st != KVCAP_OK || !sv)
                break;
            FUZZ_ASSERT(sv->ordinal == spans, "span %lld has ordinal %lld", (long long)spans,
                        (long long)sv->ordinal);
            FUZZ_ASSERT(sv->rows >= 1 && sv->cols >= 1 && sv->p0 >= 0 &&
                            (int64_t)sv->rows * sv->cols == sv->n,
                        "span %lld: %dx%d, n %d, p0 %d", (long long)spans, sv->rows, sv->cols,
                        sv->n, sv->p0);
            for (int l = 0; l < g->n_layers; l++) {
                check_view(sv->k[l], g->n_kv_heads, sv->n, g->head_dim, "k");
                check_view(sv->v[l], g->n_kv_heads, sv->n, g->head_dim, "v");
                sink ^= read_view(sv->k[l]) ^ read_view(sv->v[l]);
                if (sv->q_post[l]) {
                    check_view(sv->q_post[l], g->n_q_heads, -1, g->head_dim, "q_post");
                    sink ^= read_view(sv->q_post[l]);
                }
                if (sv->q_dec[l]) {
                    check_view(sv->q_dec[l], g->n_q_heads, -1, g->head_dim, "q_dec");
                    sink ^= read_view(sv->q_dec[l]);
                }
            }
            spans++;
            int known = 0;
            for (int i = 0; i < n_grids; i++)
                known |= grids[i].rows == sv->rows && grids[i].cols == sv->cols;
            if (!known && pass == 0 && n_grids < KVCAP_CONFIG_MAX_BUCKETS &&
                sv->n <= CALIBRATE_POINTS_MAX)
                grids[n_grids++] = (struct kvcap_bucket){sv->rows, sv->cols,
                                                         KVCAP_STRUCTURE_DENSE, 0, 0};
        }
        if (st != KVCAP_OK)
            break;
        FUZZ_ASSERT(spans == kvcap_dataset_span_count(ds), "streamed %lld of %lld spans",
                    (long long)spans, (long long)kvcap_dataset_span_count(ds));
        kvcap_dataset_rewind(ds);
    }
    (void)sink;
    kvcap_dataset_close(ds);
    if (st == KVCAP_OK && n_grids > 0)
        calibrate(path, g, grids, n_grids);
    return 0;
}
