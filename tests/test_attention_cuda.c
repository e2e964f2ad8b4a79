/* test_attention_cuda.c — the device decode-attention kernels (kernels/cuda/attention_cuda.h)
 * against the CPU oracles kvcap_attend_rows_ref and kvcap_capsule_attend_ref on the same stored
 * values: plain rows over batches of ragged lengths, dense and tiled KVCapsule maps, folding
 * into existing partials, and a CUDA graph replay equal to the direct calls. Every buffer a
 * kernel writes is poisoned with NaN first, so an element left unwritten fails the comparison.
 * The argument checks run in every build (no device is touched); without a device the test
 * then reports itself skipped (exit 77). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/attention.h"
#include "kernels/cuda/attention_cuda.h"
#include "common/rng.h"
#include "common/dtype.h"
#include "tests/test_cuda.h"
#include "tests/test_numeric.h"


/* The kernels compute in f32 (dot products over d, sums over chunks of <= 256 tokens or pieces
 * of <= 256 points, a log-sum-exp merge of <= 128 chunk partials, FMA contraction) where the
 * oracles accumulate in double. With values of non-zero mean (no cancellation in o) the
 * relative error of o / sum is a few f32 ulps times the square root of the terms summed,
 * ~1e-6 at these sizes. F16 and BF16 need no looser bound: kernel and oracle read the same
 * stored values, each converted exactly to f32, so storage rounding is not part of the error. */
#define ROWS_REL_TOL 1e-5
/* KVCapsule adds the chain z = H q' (d terms), s = W2ᵀ z (h terms), y = U p (<= 256 points per
 * piece) and o += Ṽᵀ y (rv terms), each f32 with O(1) condition at these data: the same
 * few-ulps-times-sqrt(terms) estimate, the same bound as the CPU fast path's CAPSULE_REL_TOL. */
#define CAPSULE_REL_TOL 1e-5
/* lse = mx + log(sum) does not depend on the shift mx, so it is compared although the kernels'
 * max (an f32 dot product) differs in its last bits from the oracle's; relative to max(1, |lse|)
 * because the error of a score grows with its size (planted keys reach scores of ~70). */
#define LSE_REL_TOL 1e-5

/* ---- Argument checks: no device needed ------------------------------------------------------ */


/* Never dereferenced: every call below fails its host-side checks before anything is enqueued
 * or, where it succeeds, has nothing to enqueue. */
#define FAKE_DEVICE_PTR ((void *)(uintptr_t)0x1000)

static void test_arguments(void **state)
{
    (void)state;
    const enum kvcap_status INVAL = KVCAP_ERR_INVALID_ARGUMENT, UNSUP = KVCAP_ERR_UNSUPPORTED;
    size_t bytes = 0;
    float *f = FAKE_DEVICE_PTR;
    const struct kvcap_cuda_rows_problem *probs = FAKE_DEVICE_PTR;
    const struct kvcap_cuda_capsule_span *spans = FAKE_DEVICE_PTR;
    const enum kvcap_dtype f16 = KVCAP_DTYPE_F16;

    /* Rows. */
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(1, 100, 4, 40, &bytes), UNSUP, "d = 40");
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(1, 100, 4, 264, &bytes), UNSUP, "d = 264");
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(1, 100, 4, 100, &bytes), UNSUP, "d = 100");
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(1, 100, 4, 0, &bytes), INVAL, "d = 0");
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(1, 100, 0, 64, &bytes), INVAL, "nq = 0");
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(1, 100, 17, 64, &bytes), UNSUP, "nq = 17");
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(0, 100, 4, 64, &bytes), INVAL, "batch = 0");
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(1, -1, 4, 64, &bytes), INVAL, "max_n = -1");
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(1, 100, 4, 64, NULL), INVAL, "bytes");
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(8, 0, 4, 64, &bytes), KVCAP_OK, "");
    if (BUILT_WITH_CUDA)
        assert_int_equal(bytes, 0); /* nothing to split: no scratch */
    EXPECT(kvcap_cuda_attend_rows_scratch_bytes(8, 5000, 4, 64, &bytes), KVCAP_OK, "");
    if (BUILT_WITH_CUDA)
        assert_true(bytes >= 8 * 4 * (64 + 2) * sizeof(float)); /* a partial per problem at least */
    size_t need = bytes;

    EXPECT(kvcap_cuda_attend_rows(NULL, 8, 5000, f16, 4, 64, 0.125f, f, need, NULL), INVAL,
           "problems");
    EXPECT(kvcap_cuda_attend_rows(probs, 8, 5000, f16, 0, 64, 0.125f, f, need, NULL), INVAL,
           "nq = 0");
    EXPECT(kvcap_cuda_attend_rows(probs, 8, 5000, f16, 4, 40, 0.125f, f, need, NULL), UNSUP,
           "d = 40");
    EXPECT(kvcap_cuda_attend_rows(probs, 8, 5000, KVCAP_DTYPE_F64, 4, 64, 0.125f, f, need, NULL),
           UNSUP, "F64");
    EXPECT(kvcap_cuda_attend_rows(probs, 0, 5000, f16, 4, 64, 0.125f, f, need, NULL), INVAL,
           "batch = 0");
    EXPECT(kvcap_cuda_attend_rows(probs, 8, 5000, f16, 4, 64, 0.125f, NULL, need, NULL), INVAL,
           "scratch is NULL");
    EXPECT(kvcap_cuda_attend_rows(probs, 8, 5000, f16, 4, 64, 0.125f, f, need - 1, NULL), INVAL,
           "scratch_bytes");
    /* max_n = 0: nothing to read, nothing enqueued, no scratch needed. */
    EXPECT(kvcap_cuda_attend_rows(probs, 8, 0, f16, 4, 64, 0.125f, NULL, 0, NULL), KVCAP_OK, "");

    /* KVCapsule. */
    struct kvcap_capsule_maps maps = {16, 8, 6, f, f, f};
    EXPECT(kvcap_cuda_capsule_scratch_bytes(&maps, 4, 10, 8, 40, &bytes), UNSUP, "d = 40");
    EXPECT(kvcap_cuda_capsule_scratch_bytes(&maps, 4, 10, 0, 64, &bytes), INVAL, "nq = 0");
    EXPECT(kvcap_cuda_capsule_scratch_bytes(NULL, 4, 10, 8, 64, &bytes), INVAL, "maps is NULL");
    EXPECT(kvcap_cuda_capsule_scratch_bytes(&maps, 0, 10, 8, 64, &bytes), INVAL, "n_spans = 0");
    EXPECT(kvcap_cuda_capsule_scratch_bytes(&maps, 4, -1, 8, 64, &bytes), INVAL,
           "max_tiles = -1");
    EXPECT(kvcap_cuda_capsule_scratch_bytes(&maps, 4, 0, 8, 64, &bytes), KVCAP_OK, "");
    if (BUILT_WITH_CUDA)
        assert_int_equal(bytes, 0);
    EXPECT(kvcap_cuda_capsule_scratch_bytes(&maps, 4, 10, 8, 64, &bytes), KVCAP_OK, "");
    need = bytes;
    if (BUILT_WITH_CUDA)
        assert_true(need >= 4 * 8 * (64 + 2) * sizeof(float));
    struct kvcap_capsule_maps bad = maps;
    bad.m = 0;
    EXPECT(kvcap_cuda_capsule_scratch_bytes(&bad, 4, 10, 8, 64, &bytes), INVAL, "m = 0");
    bad = maps;
    bad.b2 = NULL;
    EXPECT(kvcap_cuda_capsule_attend(&bad, spans, 4, 10, f16, 8, 64, 0.125f, f, need, NULL), INVAL,
           "b2");
    bad = maps;
    bad.w2 = NULL;
    EXPECT(kvcap_cuda_capsule_attend(&bad, spans, 4, 10, f16, 8, 64, 0.125f, f, need, NULL), INVAL,
           "w2");
    EXPECT(kvcap_cuda_capsule_attend(&maps, NULL, 4, 10, f16, 8, 64, 0.125f, f, need, NULL),
           INVAL, "spans");
    EXPECT(kvcap_cuda_capsule_attend(&maps, spans, 4, 10, f16, 8, 40, 0.125f, f, need, NULL),
           UNSUP, "d = 40");
    EXPECT(kvcap_cuda_capsule_attend(&maps, spans, 4, 10, f16, 0, 64, 0.125f, f, need, NULL),
           INVAL, "nq = 0");
    EXPECT(kvcap_cuda_capsule_attend(&maps, spans, 4, 10, f16, 8, 64, 0.125f, f, need / 2, NULL),
           INVAL, "scratch_bytes");
    EXPECT(kvcap_cuda_capsule_attend(&maps, spans, 4, 0, f16, 8, 64, 0.125f, NULL, 0, NULL),
           KVCAP_OK, "");

    /* Partials. */
    struct kvcap_partial p = {f, f, f}, nomx = {NULL, f, f};
    EXPECT(kvcap_cuda_partial_reset(nomx, 4, 64, NULL), INVAL, "p.mx");
    EXPECT(kvcap_cuda_partial_reset(p, -1, 64, NULL), INVAL, "rows = -1");
    EXPECT(kvcap_cuda_partial_reset(p, 0, 64, NULL), KVCAP_OK, "");
    EXPECT(kvcap_cuda_partial_finish(p, 4, 64, NULL, 64, NULL), INVAL, "out is NULL");
    EXPECT(kvcap_cuda_partial_finish(p, 4, 64, f, 63, NULL), INVAL, "out_stride = 63");
    EXPECT(kvcap_cuda_partial_finish(p, 4, 0, f, 64, NULL), INVAL, "d = 0");
}

#ifdef KVCAP_WITH_CUDA

/* ---- Device memory (helpers in test_cuda.h) --------------------------------------------------- */

/* x (n rows of d) in `dt` with `stride` elements per row; the gaps hold NaN, so a kernel reading
 * past d shows. */
static void *store_rows(const float *x, int n, int d, size_t stride, enum kvcap_dtype dt)
{
    size_t es = kvcap_dtype_size(dt);
    unsigned char *buf = malloc(es * stride * (size_t)(n ? n : 1));
    float *row = malloc(sizeof(float) * stride);
    assert_non_null(buf);
    assert_non_null(row);
    for (int j = 0; j < n; j++) {
        for (size_t c = 0; c < stride; c++)
            row[c] = c < (size_t)d ? x[(size_t)j * d + c] : NAN;
        assert_int_equal(kvcap_convert_from_f32(dt, row, stride, buf + (size_t)j * stride * es),
                         KVCAP_OK);
    }
    free(row);
    return buf;
}

static void *to_storage(const float *x, size_t n, enum kvcap_dtype dt)
{
    void *p = malloc(kvcap_dtype_size(dt) * (n ? n : 1));
    assert_non_null(p);
    assert_int_equal(kvcap_convert_from_f32(dt, x, n, p), KVCAP_OK);
    return p;
}

/* The same partials on both sides: host copies (CPU oracle) and a device array [count][nq] laid
 * out contiguously (mx, sum, o) so one finish call covers them all. */
struct partials {
    int count, nq, d;
    struct part *host;
    float *dev;      /* device: mx [count·nq], sum [count·nq], o [count·nq·d] */
    float *dev_init; /* device: the starting state, copied over dev before each run */
    float *dev_out;  /* device: finished outputs [count·nq][d] */
};

static struct kvcap_partial dev_partial(const struct partials *P, int i)
{
    size_t rows = (size_t)P->count * P->nq;
    struct kvcap_partial p = {P->dev + (size_t)i * P->nq, P->dev + rows + (size_t)i * P->nq,
                              P->dev + 2 * rows + (size_t)i * P->nq * P->d};
    return p;
}

static size_t partials_bytes(const struct partials *P)
{
    return sizeof(float) * (size_t)P->count * P->nq * (size_t)(P->d + 2);
}

/* `count` empty partials, or partials an earlier span of `prefill_n` random rows has already
 * been folded into (by the oracle, the same starting state for both sides). An empty partial's
 * o is NaN on the device: a merge must overwrite it without reading it. */
static void partials_init(struct kvcap_rng *r, struct partials *P, int count, int nq, int d,
                          int prefill_n, const float *const *queries)
{
    P->count = count;
    P->nq = nq;
    P->d = d;
    P->host = malloc(sizeof *P->host * (size_t)count);
    assert_non_null(P->host);
    size_t rows = (size_t)count * nq;
    float *init = alloc_f(rows * (size_t)(d + 2));
    for (int i = 0; i < count; i++) {
        P->host[i] = part_new(nq, d);
        if (prefill_n > 0) {
            float *k = alloc_f((size_t)prefill_n * d), *v = alloc_f((size_t)prefill_n * d);
            fill_random(r, k, (size_t)prefill_n * d, 0.0, 1.0);
            fill_random(r, v, (size_t)prefill_n * d, 0.5, 1.0);
            struct kvcap_rows rw = {k, v, KVCAP_DTYPE_F32, (size_t)d, prefill_n};
            assert_int_equal(kvcap_attend_rows_ref(&rw, queries[i], nq, d,
                                                   1.0f / sqrtf((float)d), P->host[i].p, NULL),
                             KVCAP_OK);
            free(k);
            free(v);
        }
        for (int g = 0; g < nq; g++) {
            init[(size_t)i * nq + g] = P->host[i].p.mx[g];
            init[rows + (size_t)i * nq + g] = P->host[i].p.sum[g];
            for (int c = 0; c < d; c++)
                init[2 * rows + ((size_t)i * nq + g) * d + c] =
                    prefill_n > 0 ? P->host[i].p.o[(size_t)g * d + c] : NAN;
        }
    }
    P->dev_init = dev_upload(init, partials_bytes(P));
    P->dev = dev_poisoned(partials_bytes(P));
    P->dev_out = dev_poisoned(sizeof(float) * rows * d);
    free(init);
}

/* Enqueues: partials back to their starting state (device to device, so it can be captured). */
static void partials_restart(const struct partials *P, cudaStream_t st)
{
    CUDA_OK(cudaMemcpyAsync(P->dev, P->dev_init, partials_bytes(P), cudaMemcpyDeviceToDevice, st));
}

static void partials_finish(const struct partials *P, cudaStream_t st)
{
    size_t rows = (size_t)P->count * P->nq;
    struct kvcap_partial all = {P->dev, P->dev + rows, P->dev + 2 * rows};
    KV_OK(kvcap_cuda_partial_finish(all, (int)rows, P->d, P->dev_out, (size_t)P->d, st));
}

/* Finished device outputs and lse against the oracle's partials. */
static void partials_compare(const struct partials *P, double tol, const char *what)
{
    int nq = P->nq, d = P->d;
    size_t rows = (size_t)P->count * nq;
    float *out = alloc_f(rows * d), *dp = alloc_f(rows * (size_t)(d + 2));
    float *want = alloc_f((size_t)nq * d);
    download(out, P->dev_out, sizeof(float) * rows * d);
    download(dp, P->dev, partials_bytes(P));
    char msg[256];
    for (int i = 0; i < P->count; i++) {
        kvcap_partial_finish(P->host[i].p, nq, d, want, (size_t)d);
        snprintf(msg, sizeof msg, "%s: entry %d output", what, i);
        assert_close(out + (size_t)i * nq * d, want, (size_t)nq * d, tol, msg);
        for (int g = 0; g < nq; g++) {
            float hm = P->host[i].p.mx[g], hs = P->host[i].p.sum[g];
            float gm = dp[(size_t)i * nq + g], gs = dp[rows + (size_t)i * nq + g];
            if (!(hs > 0.0f)) { /* nothing seen: the device partial must still be empty */
                if (gs > 0.0f)
                    fail_msg("%s: entry %d query %d: sum %g, want an empty partial", what, i, g,
                             (double)gs);
                continue;
            }
            double hl = (double)hm + log((double)hs), gl = (double)gm + log((double)gs);
            double lim = LSE_REL_TOL * (fabs(hl) > 1.0 ? fabs(hl) : 1.0);
            if (!(fabs(gl - hl) <= lim))
                fail_msg("%s: entry %d query %d: lse %.9g, want %.9g", what, i, g, gl, hl);
        }
    }
    free(out);
    free(dp);
    free(want);
}

static void partials_free(struct partials *P)
{
    for (int i = 0; i < P->count; i++)
        free(P->host[i].buf);
    free(P->host);
}

/* ---- Plain rows ----------------------------------------------------------------------------- */

struct rows_case {
    enum kvcap_dtype dt;
    int d, nq, batch, max_n;
    int n[8];
    int peaky;   /* large query spread and a key planted on query 0's direction */
    int prefill; /* fold into partials that already hold an earlier span */
};

/* Host data, device descriptors and oracle results of one rows case. */
struct rows_setup {
    struct rows_case c;
    float scale;
    struct partials P;
    struct kvcap_cuda_rows_problem *dprobs;
    void *scratch;
    size_t scratch_bytes;
};

static void rows_setup(struct kvcap_rng *r, const struct rows_case *c, struct rows_setup *S)
{
    int d = c->d, nq = c->nq, B = c->batch;
    size_t stride = (size_t)d + 8, es = kvcap_dtype_size(c->dt);
    S->c = *c;
    S->scale = 1.0f / sqrtf((float)d);
    float **qs = malloc(sizeof *qs * (size_t)B);
    assert_non_null(qs);
    for (int b = 0; b < B; b++) {
        qs[b] = alloc_f((size_t)nq * d);
        fill_random(r, qs[b], (size_t)nq * d, 0.0, c->peaky ? 3.0 : 1.0);
    }
    partials_init(r, &S->P, B, nq, d, c->prefill ? 37 : 0, (const float *const *)qs);

    struct kvcap_cuda_rows_problem *probs = calloc((size_t)B, sizeof *probs);
    assert_non_null(probs);
    for (int b = 0; b < B; b++) {
        int n = c->n[b];
        assert_true(n <= c->max_n);
        float *kx = alloc_f((size_t)n * d), *vx = alloc_f((size_t)n * d);
        fill_random(r, kx, (size_t)n * d, 0.0, 1.0);
        fill_random(r, vx, (size_t)n * d, 0.5, 1.0); /* non-zero mean: no cancellation in o */
        if (c->peaky && n > 0) { /* one key along query 0: a score of ~4.5 sqrt(d) */
            size_t j = (size_t)kvcap_rng_below(r, (uint64_t)n);
            for (int cc = 0; cc < d; cc++)
                kx[j * d + cc] = 0.5f * qs[b][cc];
        }
        void *kb = store_rows(kx, n, d, stride, c->dt), *vb = store_rows(vx, n, d, stride, c->dt);
        if (n > 0) {
            struct kvcap_rows rw = {kb, vb, c->dt, stride, n};
            assert_int_equal(kvcap_attend_rows_ref(&rw, qs[b], nq, d, S->scale, S->P.host[b].p,
                                                   NULL),
                             KVCAP_OK);
        }
        probs[b].k = n > 0 ? dev_upload(kb, (size_t)n * stride * es) : NULL;
        probs[b].v = n > 0 ? dev_upload(vb, (size_t)n * stride * es) : NULL;
        probs[b].q = dev_upload(qs[b], sizeof(float) * (size_t)nq * d);
        probs[b].acc = dev_partial(&S->P, b);
        probs[b].row_stride = (int64_t)stride;
        probs[b].n = n;
        free(kx);
        free(vx);
        free(kb);
        free(vb);
    }
    S->dprobs = dev_upload(probs, sizeof *probs * (size_t)B);
    KV_OK(kvcap_cuda_attend_rows_scratch_bytes(B, c->max_n, nq, d, &S->scratch_bytes));
    S->scratch = dev_poisoned(S->scratch_bytes);
    free(probs);
    for (int b = 0; b < B; b++)
        free(qs[b]);
    free(qs);
}

/* Enqueues one run: restart the partials, attend, finish. */
static void rows_run(const struct rows_setup *S, cudaStream_t st)
{
    const struct rows_case *c = &S->c;
    partials_restart(&S->P, st);
    KV_OK(kvcap_cuda_attend_rows(S->dprobs, c->batch, c->max_n, c->dt, c->nq, c->d, S->scale,
                                 S->scratch, S->scratch_bytes, st));
    partials_finish(&S->P, st);
}

static void rows_check(struct kvcap_rng *r, const struct rows_case *c)
{
    struct rows_setup S;
    rows_setup(r, c, &S);
    rows_run(&S, 0);
    CUDA_OK(cudaDeviceSynchronize());
    char what[160];
    snprintf(what, sizeof what, "rows %s d=%d nq=%d B=%d max_n=%d%s%s", kvcap_dtype_name(c->dt),
             c->d, c->nq, c->batch, c->max_n, c->peaky ? " peaky" : "",
             c->prefill ? " prefilled" : "");
    partials_compare(&S.P, ROWS_REL_TOL, what);
    partials_free(&S.P);
    dev_free_all();
}

static const enum kvcap_dtype dtypes[] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16, KVCAP_DTYPE_BF16};

/* Ragged batches of 8: empty, single-row, chunk-boundary (256, 257) and multi-chunk problems,
 * max_n above every n (chunks past a problem's end). */
static void test_rows_sweep(void **state)
{
    (void)state;
    static const int ds[] = {64, 128, 256}, nqs[] = {1, 4, 7, 8, 11, 16};
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 21);
    int k = 0;
    for (size_t t = 0; t < 3; t++)
        for (size_t i = 0; i < sizeof ds / sizeof *ds; i++)
            for (size_t j = 0; j < sizeof nqs / sizeof *nqs; j++, k++) {
                struct rows_case c = {dtypes[t], ds[i], nqs[j], 8, 8300,
                                      {100, 1, 8192, 0, 257, 1000, 256, 33}, k % 3 == 1, k % 2};
                rows_check(&r, &c);
            }
}

/* B = 1 at the sizes of a single decode step, and the long contexts. */
static void test_rows_sizes(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 22);
    for (size_t t = 0; t < 3; t++) {
        struct rows_case one = {dtypes[t], 128, 4, 1, 1, {1}, 0, 0};
        rows_check(&r, &one);
        struct rows_case hundred = {dtypes[t], 64, 7, 1, 100, {100}, 0, 1};
        rows_check(&r, &hundred);
        struct rows_case long1 = {dtypes[t], 128, 8, 1, 32768, {32768}, 1, 0};
        rows_check(&r, &long1);
    }
    struct rows_case d256 = {KVCAP_DTYPE_F16, 256, 11, 1, 8192, {8192}, 1, 1};
    rows_check(&r, &d256);
    struct rows_case batch_long = {
        KVCAP_DTYPE_BF16, 128, 4, 8, 32768, {32768, 32768, 1, 32767, 20000, 8192, 100, 5000},
        0, 1};
    rows_check(&r, &batch_long);
}

/* ---- KVCapsule ------------------------------------------------------------------------------ */

#  define MAX_SPANS 6

struct caps_case {
    int m, h, rv, d, nq, n_spans;
    int tiles[MAX_SPANS];
    enum kvcap_dtype dt;
    int prefill; /* fold into partials that already hold an earlier span */
    int shared;  /* span 1 folds into span 0's partial, in a second call */
};

struct caps_setup {
    struct caps_case c;
    float scale;
    struct kvcap_capsule_maps dmaps; /* sizes, with device pointers */
    struct partials P;               /* one per span (span 1's unused when shared) */
    struct kvcap_cuda_capsule_span *dspans_a, *dspans_b; /* call 1; call 2 (shared) */
    int n_a, n_b, max_tiles_a, max_tiles_b;
    void *scratch;
    size_t scratch_bytes;
};

static int caps_acc_of(const struct caps_case *c, int i)
{
    return c->shared && i == 1 ? 0 : i;
}

static void caps_setup(struct kvcap_rng *r, const struct caps_case *c, struct caps_setup *S)
{
    int m = c->m, h = c->h, rv = c->rv, d = c->d, nq = c->nq, ns = c->n_spans;
    assert_true(ns <= MAX_SPANS && (!c->shared || ns >= 2));
    S->c = *c;
    S->scale = 1.0f / sqrtf((float)d);
    float *w2 = alloc_f((size_t)h * m), *b2 = alloc_f((size_t)m), *u = alloc_f((size_t)rv * m);
    fill_random(r, w2, (size_t)h * m, 0.0, h > 0 ? 1.0 / sqrt((double)h) : 1.0);
    fill_random(r, b2, (size_t)m, 0.0, 0.3);
    fill_random(r, u, (size_t)rv * m, 0.0, 1.0 / sqrt((double)m));
    struct kvcap_capsule_maps hmaps = {m, h, rv, w2, b2, u};
    S->dmaps = hmaps;
    S->dmaps.w2 = dev_upload(w2, sizeof(float) * (size_t)h * m);
    S->dmaps.b2 = dev_upload(b2, sizeof(float) * (size_t)m);
    S->dmaps.u = dev_upload(u, sizeof(float) * (size_t)rv * m);

    float *q[MAX_SPANS] = {NULL};
    for (int i = 0; i < ns; i++) {
        q[i] = alloc_f((size_t)nq * d);
        fill_random(r, q[i], (size_t)nq * d, 0.0, 1.5);
    }
    partials_init(r, &S->P, ns, nq, d, c->prefill ? 29 : 0, (const float *const *)q);

    struct kvcap_capsule_span hspans[MAX_SPANS];
    struct kvcap_cuda_capsule_span dsp[MAX_SPANS];
    void *st[MAX_SPANS][3];
    memset(dsp, 0, sizeof dsp);
    for (int i = 0; i < ns; i++) {
        int T = c->tiles[i];
        size_t nh = (size_t)T * h * d, nv = (size_t)T * rv * d;
        float *hs = alloc_f(nh), *vt = alloc_f(nv), *mu = alloc_f((size_t)d);
        fill_random(r, hs, nh, 0.0, 1.0);
        fill_random(r, vt, nv, 0.0, 1.0);
        fill_random(r, mu, (size_t)d, 0.5, 0.5);
        st[i][0] = to_storage(hs, nh, c->dt);
        st[i][1] = to_storage(vt, nv, c->dt);
        st[i][2] = to_storage(mu, (size_t)d, c->dt);
        struct kvcap_capsule_span hsp = {st[i][0], st[i][1], st[i][2], c->dt, T, q[i],
                                         S->P.host[caps_acc_of(c, i)].p};
        hspans[i] = hsp;
        size_t es = kvcap_dtype_size(c->dt);
        dsp[i].hs = dev_upload(st[i][0], nh * es);
        dsp[i].vt = dev_upload(st[i][1], nv * es);
        dsp[i].mu = dev_upload(st[i][2], (size_t)d * es);
        dsp[i].q = dev_upload(q[i], sizeof(float) * (size_t)nq * d);
        dsp[i].acc = dev_partial(&S->P, caps_acc_of(c, i));
        dsp[i].tiles = T;
        free(hs);
        free(vt);
        free(mu);
    }
    /* The oracle folds the spans in order, span 1 after span 0 when they share a partial: the
     * device does the same with span 1 in a second call. */
    assert_int_equal(kvcap_capsule_attend_ref(&hmaps, hspans, ns, nq, d, S->scale, NULL),
                     KVCAP_OK);

    struct kvcap_cuda_capsule_span a[MAX_SPANS];
    S->n_a = 0;
    S->max_tiles_a = S->max_tiles_b = 0;
    for (int i = 0; i < ns; i++)
        if (!(c->shared && i == 1)) {
            a[S->n_a++] = dsp[i];
            S->max_tiles_a = c->tiles[i] > S->max_tiles_a ? c->tiles[i] : S->max_tiles_a;
        }
    S->dspans_a = dev_upload(a, sizeof *a * (size_t)S->n_a);
    S->n_b = c->shared ? 1 : 0;
    S->dspans_b = c->shared ? dev_upload(&dsp[1], sizeof *dsp) : NULL;
    S->max_tiles_b = c->shared ? c->tiles[1] : 0;
    size_t sa, sb = 0;
    KV_OK(kvcap_cuda_capsule_scratch_bytes(&S->dmaps, S->n_a, S->max_tiles_a, nq, d, &sa));
    if (c->shared)
        KV_OK(kvcap_cuda_capsule_scratch_bytes(&S->dmaps, 1, S->max_tiles_b, nq, d, &sb));
    S->scratch_bytes = sa > sb ? sa : sb;
    S->scratch = dev_poisoned(S->scratch_bytes);

    for (int i = 0; i < ns; i++) {
        free(q[i]);
        for (int k = 0; k < 3; k++)
            free(st[i][k]);
    }
    free(w2);
    free(b2);
    free(u);
}

static void caps_run(const struct caps_setup *S, cudaStream_t st)
{
    const struct caps_case *c = &S->c;
    partials_restart(&S->P, st);
    KV_OK(kvcap_cuda_capsule_attend(&S->dmaps, S->dspans_a, S->n_a, S->max_tiles_a, c->dt, c->nq,
                                    c->d, S->scale, S->scratch, S->scratch_bytes, st));
    if (S->n_b)
        KV_OK(kvcap_cuda_capsule_attend(&S->dmaps, S->dspans_b, S->n_b, S->max_tiles_b, c->dt,
                                        c->nq, c->d, S->scale, S->scratch, S->scratch_bytes, st));
    partials_finish(&S->P, st);
}

static void caps_check(struct kvcap_rng *r, const struct caps_case *c, const char *name)
{
    struct caps_setup S;
    caps_setup(r, c, &S);
    caps_run(&S, 0);
    CUDA_OK(cudaDeviceSynchronize());
    char what[160];
    snprintf(what, sizeof what, "capsule %s %s m=%d h=%d rv=%d d=%d nq=%d", name,
             kvcap_dtype_name(c->dt), c->m, c->h, c->rv, c->d, c->nq);
    partials_compare(&S.P, CAPSULE_REL_TOL, what);
    partials_free(&S.P);
    dev_free_all();
}

static void test_capsule_dense(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 31);
    /* One tile of m = n points per span; a span without tiles leaves its partial alone. */
    struct caps_case a = {256, 40, 32, 128, 4, 3, {1, 0, 1}, KVCAP_DTYPE_F16, 0, 0};
    caps_check(&r, &a, "dense 16x16");
    /* m = 1000: four point ranges of 250 in separate blocks, merged. */
    struct caps_case b = {1000, 100, 80, 64, 7, 3, {1, 1, 1}, KVCAP_DTYPE_BF16, 1, 0};
    caps_check(&r, &b, "dense 1000 points");
    /* Large h and rv with d = 256 and 16 queries: the maps stay in global memory and the
     * queries are served in groups. */
    struct caps_case c = {576, 300, 300, 256, 16, 2, {1, 1}, KVCAP_DTYPE_F32, 1, 0};
    caps_check(&r, &c, "dense 24x24 wide");
    /* Two spans folding into the same partial (two calls), after an earlier span. */
    struct caps_case d = {300, 64, 48, 128, 8, 3, {1, 1, 1}, KVCAP_DTYPE_F16, 1, 1};
    caps_check(&r, &d, "dense shared partial");
}

static void test_capsule_tiled(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 32);
    /* 4x4 tiles: 16 tiles per chunk; spans of 1 .. 200 tiles, one without tiles. */
    struct caps_case a = {16, 8, 6, 128, 8, 5, {1, 17, 64, 0, 200}, KVCAP_DTYPE_F16, 0, 0};
    caps_check(&r, &a, "tiled 4x4");
    struct caps_case b = {49, 16, 16, 256, 11, 3, {3, 40, 2}, KVCAP_DTYPE_BF16, 1, 0};
    caps_check(&r, &b, "tiled 7x7");
    /* Many tiny tiles (9000 pieces: more than 128 chunks of the usual 64 pieces, so the
     * chunks grow) and no value basis (rv = 0: the output is μ alone). */
    struct caps_case c = {4, 4, 0, 64, 1, 2, {9000, 7}, KVCAP_DTYPE_F32, 0, 0};
    caps_check(&r, &c, "tiled 2x2 rv=0");
    /* No key reconstructor (h = 0: scores from the bias alone). */
    struct caps_case d = {16, 0, 4, 64, 2, 2, {5, 9}, KVCAP_DTYPE_F32, 1, 0};
    caps_check(&r, &d, "tiled h=0");
    struct caps_case e = {16, 8, 8, 128, 4, 3, {12, 30, 5}, KVCAP_DTYPE_BF16, 1, 1};
    caps_check(&r, &e, "tiled shared partial");
}

/* ---- CUDA graph ----------------------------------------------------------------------------- */

/* The calls enqueue only asynchronous work and allocate nothing, so they can be captured: a
 * graph of (restart, rows, capsule, finish) replays to results bit-identical to the direct calls
 * (same kernels, same launch configuration, no atomics), twice in a row. */
static void test_graph(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 41);
    struct rows_case rc = {KVCAP_DTYPE_F16, 128, 8, 8, 3000, {3000, 1, 257, 0, 999, 2048, 64, 5},
                           1, 1};
    struct caps_case cc = {16, 8, 6, 128, 8, 3, {20, 3, 50}, KVCAP_DTYPE_F16, 1, 1};
    struct rows_setup R;
    struct caps_setup C;
    rows_setup(&r, &rc, &R);
    caps_setup(&r, &cc, &C);
    /* A blocking stream: ordered after the legacy-stream uploads and poisoning of the setup. */
    cudaStream_t st;
    CUDA_OK(cudaStreamCreate(&st));

    rows_run(&R, st);
    caps_run(&C, st);
    CUDA_OK(cudaStreamSynchronize(st));
    partials_compare(&R.P, ROWS_REL_TOL, "graph test, direct rows");
    partials_compare(&C.P, CAPSULE_REL_TOL, "graph test, direct capsule");
    size_t rb = sizeof(float) * (size_t)rc.batch * rc.nq * rc.d;
    size_t cb = sizeof(float) * (size_t)cc.n_spans * cc.nq * cc.d;
    float *r_direct = alloc_f(rb / 4), *c_direct = alloc_f(cb / 4);
    float *r_graph = alloc_f(rb / 4), *c_graph = alloc_f(cb / 4);
    download(r_direct, R.P.dev_out, rb);
    download(c_direct, C.P.dev_out, cb);

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    rows_run(&R, st);
    caps_run(&C, st);
    CUDA_OK(cudaStreamEndCapture(st, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; rep++) {
        /* Poison everything the graph writes, so a stale result cannot pass. */
        CUDA_OK(cudaMemsetAsync(R.P.dev, 0xFF, partials_bytes(&R.P), st));
        CUDA_OK(cudaMemsetAsync(R.P.dev_out, 0xFF, rb, st));
        CUDA_OK(cudaMemsetAsync(R.scratch, 0xFF, R.scratch_bytes, st));
        CUDA_OK(cudaMemsetAsync(C.P.dev, 0xFF, partials_bytes(&C.P), st));
        CUDA_OK(cudaMemsetAsync(C.P.dev_out, 0xFF, cb, st));
        CUDA_OK(cudaMemsetAsync(C.scratch, 0xFF, C.scratch_bytes, st));
        CUDA_OK(cudaGraphLaunch(exec, st));
        CUDA_OK(cudaStreamSynchronize(st));
        download(r_graph, R.P.dev_out, rb);
        download(c_graph, C.P.dev_out, cb);
        assert_memory_equal(r_graph, r_direct, rb);
        assert_memory_equal(c_graph, c_direct, cb);
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(st));
    free(r_direct);
    free(c_direct);
    free(r_graph);
    free(c_graph);
    partials_free(&R.P);
    partials_free(&C.P);
    dev_free_all();
}

#endif /* KVCAP_WITH_CUDA */

int main(void)
{
    const struct CMUnitTest host_tests[] = {
        cmocka_unit_test(test_arguments),
    };
    if (cmocka_run_group_tests_name("arguments", host_tests, NULL, NULL) != 0)
        return 1;
    if (kvcap_cuda_device_count() == 0) {
#ifdef KVCAP_WITH_CUDA
        /* A valid call without a device fails as a device error naming the operation. */
        float *f = FAKE_DEVICE_PTR;
        struct kvcap_partial p = {f, f, f};
        enum kvcap_status s = kvcap_cuda_partial_reset(p, 1, 8, NULL);
        if (s != KVCAP_ERR_DEVICE || !strstr(kvcap_last_error(), "partial_reset")) {
            fprintf(stderr, "FAIL: launch without a device: %s ('%s')\n", kvcap_status_str(s),
                    kvcap_last_error());
            return 1;
        }
#endif
        printf("SKIP: no CUDA device\n");
        return 77;
    }
#ifdef KVCAP_WITH_CUDA
    const struct CMUnitTest device_tests[] = {
        cmocka_unit_test(test_rows_sweep),    cmocka_unit_test(test_rows_sizes),
        cmocka_unit_test(test_capsule_dense), cmocka_unit_test(test_capsule_tiled),
        cmocka_unit_test(test_graph),
    };
    return cmocka_run_group_tests_name("device", device_tests, NULL, NULL);
#else
    return 1; /* a build without CUDA reports no devices */
#endif
}
