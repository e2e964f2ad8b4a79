/* fuzz_artifact.c — opening a compressor artifact (runtime/artifact.c over formats/schema.c)
 * from hostile bytes: an artifact that opens has maps of the sizes it claims, and a cache built
 * on it compresses a span of each bucket, appends a token and attends with finite outputs. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/artifact.h"
#include "tests/fuzz/fuzz_common.h"

/* K/V floats (all layers) above which a bucket's span is not run through a cache: the file may
 * be small while its grid is large (tiled maps), and the point is the maps, not the size. */
#define SPAN_FLOATS_MAX (1 << 18)
/* Maps larger than this in magnitude may overflow fp32 in decode on their own (no trained map
 * comes near it); such artifacts are only opened and checked. */
#define MAP_MAGNITUDE_MAX 1e4f

static float max_abs(const float *x, size_t n, float m)
{
    for (size_t i = 0; i < n; i++)
        m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
    return m;
}

/* Sizes and masks as SPEC §4.3 says; returns the largest map magnitude. */
static float check_units(const struct kvcap_artifact *a)
{
    kvcap_clear_error();
    FUZZ_ASSERT(kvcap_geometry_validate(&a->model) == KVCAP_OK, "invalid model accepted: %s",
                kvcap_last_error());
    FUZZ_ASSERT(a->n_buckets >= 1 && a->n_buckets <= KVCAP_MAX_BUCKETS, "%d buckets",
                a->n_buckets);
    float mag = 0;
    for (int l = 0; l < a->model.n_layers; l++)
        for (int h = 0; h < a->model.n_kv_heads; h++)
            for (int b = 0; b < a->n_buckets; b++) {
                const struct kvcap_unit_maps *u = kvcap_artifact_unit(a, l, h, b);
                size_t m = (size_t)u->m;
                FUZZ_ASSERT(u->m == kvcap_bucket_points(&a->buckets[b]) && u->rk >= 1 &&
                                u->rk <= u->m && u->h >= 1 && u->rv >= 1 && u->rv <= u->m,
                            "l%d.h%d.b%d: m %d rk %d h %d rv %d", l, h, b, u->m, u->rk, u->h,
                            u->rv);
                for (int i = 0; i < u->rk; i++)
                    FUZZ_ASSERT(u->mask[i] >= 0 && u->mask[i] < u->m &&
                                    (i == 0 || u->mask[i] > u->mask[i - 1]),
                                "l%d.h%d.b%d: mask[%d] = %d", l, h, b, i, (int)u->mask[i]);
                mag = max_abs(u->w1, (size_t)u->rk * u->h, mag);
                mag = max_abs(u->b1, (size_t)u->h, mag);
                mag = max_abs(u->w2, (size_t)u->h * m, mag);
                mag = max_abs(u->b2, m, mag);
                mag = max_abs(u->u, (size_t)u->rv * m, mag);
                FUZZ_ASSERT(isfinite(mag), "l%d.h%d.b%d: a non-finite map was loaded", l, h, b);
            }
    return mag;
}

static void fill(float *x, size_t n, double phase)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)sin(0.37 * (double)i + phase);
}

/* One sequence, one span of bucket b on every layer, one generated token, attention. */
static void exercise(const struct kvcap_artifact *a, int b)
{
    const struct kvcap_model_geometry *g = &a->model;
    const struct kvcap_bucket *bk = &a->buckets[b];
    size_t n = (size_t)bk->rows * bk->cols, d = (size_t)g->head_dim;
    size_t per_layer = n * d * (size_t)g->n_kv_heads;
    if ((double)per_layer * 2 * g->n_layers > SPAN_FLOATS_MAX)
        return;
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = *g;
    p.storage = KVCAP_DTYPE_F32;
    p.artifact = a;
    p.n_threads = 1;
    struct kvcap_cache *c = NULL;
    kvcap_clear_error();
    enum kvcap_status st = kvcap_cache_create(&p, &c);
    FUZZ_ASSERT(st == KVCAP_OK, "a cache on an artifact that opened: %s", kvcap_last_error());
    float *k = malloc(sizeof(float) * per_layer), *v = malloc(sizeof(float) * per_layer);
    size_t qn = (size_t)g->n_q_heads * d;
    float *q = malloc(sizeof(float) * qn), *out = malloc(sizeof(float) * qn);
    FUZZ_ASSERT(k && v && q && out, "out of memory");
    struct kvcap_span_desc span = {KVCAP_SPAN_VISION, (int)n, bk->rows, bk->cols, 3};
    /* HND: head_stride = n * d, token_stride = d. */
    struct kvcap_tensor_view kv = {k, NULL, 0, KVCAP_DTYPE_F32, (int64_t)(n * d), (int64_t)d};
    struct kvcap_tensor_view vv = {v, NULL, 0, KVCAP_DTYPE_F32, (int64_t)(n * d), (int64_t)d};
    for (int l = 0; st == KVCAP_OK && l < g->n_layers; l++) {
        fill(k, per_layer, l), fill(v, per_layer, 0.5 + l);
        kvcap_clear_error();
        st = kvcap_cache_add_span(c, 0, l, &span, &kv, &vv);
        fuzz_check_status(st, "kvcap_cache_add_span");
    }
    if (st == KVCAP_OK) {
        kvcap_clear_error();
        st = kvcap_cache_end_prefill(c, 0);
        fuzz_check_status(st, "kvcap_cache_end_prefill");
    }
    /* One token: NHD of a single row, head_stride = d. */
    struct kvcap_tensor_view kt = {k, NULL, 0, KVCAP_DTYPE_F32, (int64_t)d, (int64_t)d};
    struct kvcap_tensor_view vt = {v, NULL, 0, KVCAP_DTYPE_F32, (int64_t)d, (int64_t)d};
    for (int l = 0; st == KVCAP_OK && l < g->n_layers; l++) {
        kvcap_clear_error();
        st = kvcap_cache_append(c, 0, l, &kt, &vt);
        fuzz_check_status(st, "kvcap_cache_append");
        if (st != KVCAP_OK)
            break;
        fill(q, qn, 1.5 + l);
        kvcap_clear_error();
        st = kvcap_cache_attend(c, l, q, out);
        fuzz_check_status(st, "kvcap_cache_attend");
        if (st == KVCAP_OK)
            FUZZ_ASSERT(fuzz_all_finite(out, qn), "bucket %d layer %d: non-finite output", b, l);
    }
    free(k), free(v), free(q), free(out);
    kvcap_cache_free(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[4400];
    fuzz_write_file(path, sizeof path, "fuzz.kvcap", data, size);
    struct kvcap_artifact *a = NULL;
    kvcap_clear_error();
    enum kvcap_status st = kvcap_artifact_open(path, &a);
    fuzz_check_status(st, "kvcap_artifact_open");
    if (st != KVCAP_OK) {
        FUZZ_ASSERT(a == NULL, "a failed open left a handle");
        return 0;
    }
    FUZZ_ASSERT(kvcap_artifact_geometry(a) == &a->model, "geometry not the artifact's own");
    float mag = check_units(a);
    for (int b = 0; b < a->n_buckets && mag <= MAP_MAGNITUDE_MAX; b++)
        exercise(a, b);
    kvcap_artifact_free(a);
    return 0;
}
