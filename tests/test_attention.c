/* test_attention.c — the decode-attention kernels against their oracles: fast rows attention vs
 * the double _ref vs a materialised softmax, the fused KVCapsule path vs its _ref vs attention
 * over explicitly reconstructed K̂', V̂, the log-sum-exp merge (split passes, mixed span kinds,
 * empty partials), bytes read, large scores, and both the SIMD and the portable kernels. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <cblas.h>

#include "kernels/attention.h"
#include "kernels/load.h"
#include "common/rng.h"
#include "common/dtype.h"
#include "tests/test_numeric.h"


/* Fast kernels accumulate in f32 (blocks of rows, exp to ~1 ulp) where the oracles use double;
 * with outputs that are not cancellation-dominated (values have a non-zero mean) the error is
 * a few f32 ulps times sqrt(terms), ~1e-6 at n = 1000. */
#define FAST_REL_TOL 1e-5
/* Two passes merged by log-sum-exp vs one pass: the same f32 sums in a different grouping. */
#define MERGE_REL_TOL 1e-5
/* Fused KVCapsule (f32 storage) vs attention over K̂', V̂ materialised in double: f32 dot
 * products, two sgemms and f32 accumulation, each a few ulps. */
#define CAPSULE_REL_TOL 1e-5
/* F16 storage vs the unrounded f32 state: H, Ṽ, μ carry 2^-11 relative rounding each, which
 * moves scores by ~1e-3 absolute and the output by ~2e-4 relative (measured). */
#define F16_STORAGE_REL_TOL 1e-3

/* ---- helpers -------------------------------------------------------------------------------- */

/* The kernels through their status: each asserts KVCAP_OK and returns the bytes read. */
static uint64_t rows_fast(const struct kvcap_rows *rows, const float *q, int nq, int d,
                          float scale, struct kvcap_partial acc)
{
    uint64_t bytes = UINT64_MAX;
    assert_int_equal(kvcap_attend_rows(rows, q, nq, d, scale, acc, &bytes), KVCAP_OK);
    return bytes;
}

static uint64_t rows_ref(const struct kvcap_rows *rows, const float *q, int nq, int d,
                         float scale, struct kvcap_partial acc)
{
    uint64_t bytes = UINT64_MAX;
    assert_int_equal(kvcap_attend_rows_ref(rows, q, nq, d, scale, acc, &bytes), KVCAP_OK);
    return bytes;
}

static uint64_t capsule_fast(const struct kvcap_capsule_maps *maps,
                             const struct kvcap_capsule_span *spans, int n_spans, int nq, int d,
                             float scale, float *scratch, size_t scratch_floats)
{
    uint64_t bytes = UINT64_MAX;
    assert_int_equal(kvcap_capsule_attend(maps, spans, n_spans, nq, d, scale, scratch,
                                          scratch_floats, &bytes),
                     KVCAP_OK);
    return bytes;
}

static uint64_t capsule_ref(const struct kvcap_capsule_maps *maps,
                            const struct kvcap_capsule_span *spans, int n_spans, int nq, int d,
                            float scale)
{
    uint64_t bytes = UINT64_MAX;
    assert_int_equal(kvcap_capsule_attend_ref(maps, spans, n_spans, nq, d, scale, &bytes),
                     KVCAP_OK);
    return bytes;
}

static void assert_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            fail_msg("element %zu is %g", i, (double)x[i]);
}

static float *finish(struct part *s, int nq, int d)
{
    float *out = malloc(sizeof(float) * (size_t)nq * d);
    assert_non_null(out);
    kvcap_partial_finish(s->p, nq, d, out, (size_t)d);
    return out;
}

/* Stores x (n rows of d, f32) as `dtype` with `stride` elements per row; the gap holds NaN
 * so a kernel reading past d shows up. deq receives the stored values back in f32 (n × d). */
static void *store_rows(const float *x, int n, int d, size_t stride, enum kvcap_dtype dtype,
                        float *deq)
{
    size_t es = kvcap_dtype_size(dtype);
    unsigned char *buf = malloc(es * stride * (size_t)n);
    assert_non_null(buf);
    float *row = malloc(sizeof(float) * stride);
    assert_non_null(row);
    for (int j = 0; j < n; j++) {
        for (size_t c = 0; c < stride; c++)
            row[c] = c < (size_t)d ? x[(size_t)j * d + c] : NAN;
        assert_int_equal(kvcap_convert_from_f32(dtype, row, stride, buf + (size_t)j * stride * es),
                         KVCAP_OK);
        assert_int_equal(kvcap_convert_to_f32(dtype, buf + (size_t)j * stride * es, (size_t)d,
                                              deq + (size_t)j * d),
                         KVCAP_OK);
    }
    free(row);
    return buf;
}

/* Softmax attention materialised in double: per query, all scores, then the weighted mean.
 * Row j's score uses query qsel[j] ∈ {qa, qb} so that spans with different (offset-free)
 * queries can share one softmax. */
static void naive_attention_mixed(const float *qa, const float *qb, const unsigned char *qsel,
                                  const float *k, const float *v, int n, int nq, int d,
                                  float scale, float *out)
{
    double *s = malloc(sizeof(double) * (size_t)n);
    assert_non_null(s);
    for (int qi = 0; qi < nq; qi++) {
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < n; j++) {
            const float *q = (qsel && qsel[j] ? qb : qa) + (size_t)qi * d;
            double a = 0;
            for (int c = 0; c < d; c++)
                a += (double)q[c] * k[(size_t)j * d + c];
            s[j] = a * scale;
            mx = s[j] > mx ? s[j] : mx;
        }
        for (int j = 0; j < n; j++) {
            s[j] = exp(s[j] - mx);
            sum += s[j];
        }
        for (int c = 0; c < d; c++) {
            double o = 0;
            for (int j = 0; j < n; j++)
                o += s[j] * v[(size_t)j * d + c];
            out[(size_t)qi * d + c] = (float)(o / sum);
        }
    }
    free(s);
}

static void naive_attention(const float *q, const float *k, const float *v, int n, int nq, int d,
                            float scale, float *out)
{
    naive_attention_mixed(q, q, NULL, k, v, n, nq, d, scale, out);
}

static const enum kvcap_dtype row_dtypes[] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16, KVCAP_DTYPE_BF16};

/* ---- plain rows ----------------------------------------------------------------------------- */

/* One configuration: fast (current ISA) vs ref vs naive, bytes, and a two-chunk split. */
static void check_rows(struct kvcap_rng *r, enum kvcap_dtype dt, int n, int d, int nq, int with_ref)
{
    size_t stride = (size_t)d + 16;
    float *kx = alloc_f((size_t)n * d), *vx = alloc_f((size_t)n * d);
    float *kd = alloc_f((size_t)n * d), *vd = alloc_f((size_t)n * d);
    float *q = alloc_f((size_t)nq * d), *want = alloc_f((size_t)nq * d);
    fill_random(r, kx, (size_t)n * d, 0.0, 1.0);
    fill_random(r, vx, (size_t)n * d, 0.5, 1.0); /* non-zero mean: no cancellation in o */
    fill_random(r, q, (size_t)nq * d, 0.0, 2.0); /* scores of spread ~2: a non-trivial softmax */
    void *kb = store_rows(kx, n, d, stride, dt, kd);
    void *vb = store_rows(vx, n, d, stride, dt, vd);
    float scale = 1.0f / sqrtf((float)d);
    naive_attention(q, kd, vd, n, nq, d, scale, want);

    struct kvcap_rows rows = {kb, vb, dt, stride, n};
    uint64_t expect_bytes = 2u * (uint64_t)n * d * kvcap_dtype_size(dt);
    char what[128];
    snprintf(what, sizeof what, "%s n=%d d=%d nq=%d", kvcap_dtype_name(dt), n, d, nq);

    struct part fast = part_new(nq, d);
    assert_int_equal(rows_fast(&rows, q, nq, d, scale, fast.p), expect_bytes);
    float *got = finish(&fast, nq, d);
    assert_close(got, want, (size_t)nq * d, FAST_REL_TOL, what);

    if (with_ref) {
        struct part ref = part_new(nq, d);
        assert_int_equal(rows_ref(&rows, q, nq, d, scale, ref.p), expect_bytes);
        float *rout = finish(&ref, nq, d);
        assert_close(rout, want, (size_t)nq * d, FAST_REL_TOL, what);
        assert_close(got, rout, (size_t)nq * d, FAST_REL_TOL, what);
        free(rout);
        free(ref.buf);
    }

    /* Two chunks, each into its own partial, merged: equals the one pass. */
    if (n >= 2) {
        int split = n / 3 + 1;
        size_t es = kvcap_dtype_size(dt);
        struct kvcap_rows a = {kb, vb, dt, stride, split};
        struct kvcap_rows b = {(const unsigned char *)kb + (size_t)split * stride * es,
                               (const unsigned char *)vb + (size_t)split * stride * es, dt, stride,
                               n - split};
        struct part pa = part_new(nq, d), pb = part_new(nq, d);
        rows_fast(&b, q, nq, d, scale, pb.p);
        rows_fast(&a, q, nq, d, scale, pa.p);
        kvcap_partial_merge(pa.p, pb.p, nq, d);
        float *merged = finish(&pa, nq, d);
        assert_close(merged, got, (size_t)nq * d, MERGE_REL_TOL, what);
        free(merged);
        free(pa.buf);
        free(pb.buf);
    }
    free(got);
    free(fast.buf);
    free(kb);
    free(vb);
    free(kx);
    free(vx);
    free(kd);
    free(vd);
    free(q);
    free(want);
}

static void rows_sweep(int with_ref)
{
    static const int ds[] = {64, 80, 96, 128, 256}, nqs[] = {1, 4, 7}, ns[] = {1, 3, 1000};
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 11);
    for (size_t t = 0; t < sizeof row_dtypes / sizeof *row_dtypes; t++)
        for (size_t i = 0; i < sizeof ds / sizeof *ds; i++)
            for (size_t j = 0; j < sizeof nqs / sizeof *nqs; j++)
                for (size_t k = 0; k < sizeof ns / sizeof *ns; k++)
                    check_rows(&r, row_dtypes[t], ns[k], ds[i], nqs[j], with_ref);
    /* Group sizes other than the sweep's, incl. more than one 8-query group, odd d. */
    check_rows(&r, KVCAP_DTYPE_F16, 200, 128, 11, with_ref);
    check_rows(&r, KVCAP_DTYPE_F32, 77, 128, 2, with_ref);
    check_rows(&r, KVCAP_DTYPE_BF16, 77, 64, 8, with_ref);
    check_rows(&r, KVCAP_DTYPE_F16, 100, 96, 6, with_ref); /* value pass split as 4 + 2 */
    check_rows(&r, KVCAP_DTYPE_F32, 100, 64, 5, with_ref); /* score passes 4 + 1 */
    check_rows(&r, KVCAP_DTYPE_F32, 65, 36, 3, with_ref); /* d % 8 != 0: the scalar tails */
    check_rows(&r, KVCAP_DTYPE_F16, 50, 36, 1, with_ref);
    check_rows(&r, KVCAP_DTYPE_BF16, 33, 20, 5, with_ref);
}

/* "simd": the run-time choice (the AVX2 kernels where the CPU has them, else portable). */
static void test_rows_simd(void **state)
{
    (void)state;
    kvcap_kernels_set_simd(1);
    rows_sweep(1);
}

static void test_rows_portable(void **state)
{
    (void)state;
    kvcap_kernels_set_simd(0);
    rows_sweep(0); /* the oracles are ISA-independent: checked once, in test_rows_simd */
    kvcap_kernels_set_simd(1);
}

/* ---- KVCapsule ------------------------------------------------------------------------------ */

static float gelu(float x)
{
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

struct capsule_case {
    int m, h, rv, d, nq, n_spans, gelu;
    int tiles[5];
    int shared_acc; /* spans 0 and 1 fold into the same partial */
    enum kvcap_dtype dtype;
    double qsd; /* spread of the queries (0: 1.5, scores of order 1) */
};

struct capsule_data {
    float *w2, *b2, *u;   /* maps */
    float *hs[5], *vt[5], *mu[5], *q[5]; /* f32 state per span (unrounded) */
    void *hs_st[5], *vt_st[5], *mu_st[5]; /* in storage dtype */
    float *khat[5], *vhat[5];              /* materialised in double from the f32 state */
};

static void *to_storage(const float *x, size_t n, enum kvcap_dtype dt)
{
    void *p = malloc(kvcap_dtype_size(dt) * (n ? n : 1));
    assert_non_null(p);
    assert_int_equal(kvcap_convert_from_f32(dt, x, n, p), KVCAP_OK);
    return p;
}

static void capsule_build(struct kvcap_rng *r, const struct capsule_case *c, struct capsule_data *D)
{
    int m = c->m, h = c->h, rv = c->rv, d = c->d, rk = m / 2 > 0 ? m / 2 : 1;
    D->w2 = alloc_f((size_t)h * m);
    D->b2 = alloc_f((size_t)m);
    D->u = alloc_f((size_t)rv * m);
    fill_random(r, D->w2, (size_t)h * m, 0.0, 1.0 / sqrt((double)h));
    fill_random(r, D->b2, (size_t)m, 0.0, 0.3);
    fill_random(r, D->u, (size_t)rv * m, 0.0, 1.0 / sqrt((double)m));
    /* W1, b1 only build H (decode never sees them): H_t = φ(W1ᵀ K̃_t + b1 1ᵀ). */
    float *w1 = alloc_f((size_t)rk * h), *b1 = alloc_f((size_t)h), *kt = alloc_f((size_t)rk * d);
    fill_random(r, w1, (size_t)rk * h, 0.0, 1.0 / sqrt((double)rk));
    fill_random(r, b1, (size_t)h, 0.0, 0.2);
    for (int i = 0; i < c->n_spans; i++) {
        int T = c->tiles[i];
        D->hs[i] = alloc_f((size_t)T * h * d);
        D->vt[i] = alloc_f((size_t)T * rv * d);
        D->mu[i] = alloc_f((size_t)d);
        D->q[i] = alloc_f((size_t)c->nq * d);
        for (int t = 0; t < T; t++) {
            fill_random(r, kt, (size_t)rk * d, 0.0, 1.0);
            for (int a = 0; a < h; a++)
                for (int cc = 0; cc < d; cc++) {
                    double z = b1[a];
                    for (int k = 0; k < rk; k++)
                        z += (double)w1[(size_t)k * h + a] * kt[(size_t)k * d + cc];
                    float zf = (float)z;
                    D->hs[i][((size_t)t * h + a) * d + cc] = c->gelu ? gelu(zf) : zf;
                }
        }
        fill_random(r, D->vt[i], (size_t)T * rv * d, 0.0, 1.0);
        fill_random(r, D->mu[i], (size_t)d, 0.5, 0.5);
        fill_random(r, D->q[i], (size_t)c->nq * d, 0.0, c->qsd > 0 ? c->qsd : 1.5);
        D->hs_st[i] = to_storage(D->hs[i], (size_t)T * h * d, c->dtype);
        D->vt_st[i] = to_storage(D->vt[i], (size_t)T * rv * d, c->dtype);
        D->mu_st[i] = to_storage(D->mu[i], (size_t)d, c->dtype);
        /* K̂'_t = W2ᵀ H_t + b2 1ᵀ, V̂_t = Uᵀ Ṽ_t + 1 μᵀ, tiles stacked: T·m rows. */
        D->khat[i] = alloc_f((size_t)T * m * d);
        D->vhat[i] = alloc_f((size_t)T * m * d);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < m; j++)
                for (int cc = 0; cc < d; cc++) {
                    double kk = D->b2[j], vv = D->mu[i][cc];
                    for (int a = 0; a < h; a++)
                        kk += (double)D->w2[(size_t)a * m + j] *
                              D->hs[i][((size_t)t * h + a) * d + cc];
                    for (int a = 0; a < rv; a++)
                        vv += (double)D->u[(size_t)a * m + j] *
                              D->vt[i][((size_t)t * rv + a) * d + cc];
                    D->khat[i][((size_t)t * m + j) * d + cc] = (float)kk;
                    D->vhat[i][((size_t)t * m + j) * d + cc] = (float)vv;
                }
    }
    free(w1);
    free(b1);
    free(kt);
}

static void capsule_free(const struct capsule_case *c, struct capsule_data *D)
{
    free(D->w2);
    free(D->b2);
    free(D->u);
    for (int i = 0; i < c->n_spans; i++) {
        free(D->hs[i]);
        free(D->vt[i]);
        free(D->mu[i]);
        free(D->q[i]);
        free(D->hs_st[i]);
        free(D->vt_st[i]);
        free(D->mu_st[i]);
        free(D->khat[i]);
        free(D->vhat[i]);
    }
}

static uint64_t capsule_expected_bytes(const struct capsule_case *c)
{
    uint64_t b = 4u * ((uint64_t)c->h * c->m + c->m + (uint64_t)c->rv * c->m);
    for (int i = 0; i < c->n_spans; i++)
        b += kvcap_dtype_size(c->dtype) *
             ((uint64_t)c->tiles[i] * (uint64_t)(c->h + c->rv) * c->d + (uint64_t)c->d);
    return b;
}

/* Index of the partial span i folds into. */
static int acc_of(const struct capsule_case *c, int i)
{
    return c->shared_acc && i == 1 ? 0 : i;
}

static void run_capsule(const struct capsule_case *c, const struct capsule_data *D, int fast,
                        struct part *parts)
{
    struct kvcap_capsule_maps maps = {c->m, c->h, c->rv, D->w2, D->b2, D->u};
    struct kvcap_capsule_span spans[5];
    int max_tiles = 0;
    for (int i = 0; i < c->n_spans; i++) {
        struct kvcap_capsule_span s = {D->hs_st[i], D->vt_st[i], D->mu_st[i], c->dtype,
                                       c->tiles[i], D->q[i], parts[acc_of(c, i)].p};
        spans[i] = s;
        max_tiles = c->tiles[i] > max_tiles ? c->tiles[i] : max_tiles;
    }
    uint64_t bytes;
    if (fast) {
        size_t nf = kvcap_capsule_scratch_floats(&maps, c->n_spans, max_tiles, c->nq, c->d);
        float *scratch = alloc_f(nf);
        bytes = capsule_fast(&maps, spans, c->n_spans, c->nq, c->d,
                                     1.0f / sqrtf((float)c->d), scratch, nf);
        free(scratch);
    } else {
        bytes = capsule_ref(&maps, spans, c->n_spans, c->nq, c->d,
                                         1.0f / sqrtf((float)c->d));
    }
    assert_int_equal(bytes, capsule_expected_bytes(c));
}

/* Attention of span i's queries over the materialised rows of every span folding into acc a. */
static void capsule_want(const struct capsule_case *c, const struct capsule_data *D, int a,
                         float *want)
{
    int d = c->d, n = 0;
    for (int i = 0; i < c->n_spans; i++)
        if (acc_of(c, i) == a)
            n += c->tiles[i] * c->m;
    float *k = alloc_f((size_t)n * d), *v = alloc_f((size_t)n * d);
    unsigned char *sel = malloc((size_t)n);
    assert_non_null(sel);
    int row = 0, first = -1, second = -1;
    for (int i = 0; i < c->n_spans; i++) {
        if (acc_of(c, i) != a)
            continue;
        if (first < 0)
            first = i;
        else
            second = i;
        size_t rows = (size_t)c->tiles[i] * c->m;
        memcpy(k + (size_t)row * d, D->khat[i], sizeof(float) * rows * d);
        memcpy(v + (size_t)row * d, D->vhat[i], sizeof(float) * rows * d);
        memset(sel + row, second == i, rows);
        row += (int)rows;
    }
    naive_attention_mixed(D->q[first], second >= 0 ? D->q[second] : D->q[first], sel, k, v, n,
                          c->nq, d, 1.0f / sqrtf((float)d), want);
    free(k);
    free(v);
    free(sel);
}

static void check_capsule(struct kvcap_rng *r, const struct capsule_case *c)
{
    struct capsule_data D;
    capsule_build(r, c, &D);
    int nq = c->nq, d = c->d;
    struct part fast[5], ref[5];
    for (int i = 0; i < c->n_spans; i++) {
        fast[i] = part_new(nq, d);
        ref[i] = part_new(nq, d);
    }
    run_capsule(c, &D, 1, fast);
    run_capsule(c, &D, 0, ref);
    char what[160];
    for (int i = 0; i < c->n_spans; i++) {
        if (acc_of(c, i) != i)
            continue;
        snprintf(what, sizeof what, "%s m=%d h=%d rv=%d d=%d nq=%d spans=%d span %d%s%s",
                 kvcap_dtype_name(c->dtype), c->m, c->h, c->rv, d, nq, c->n_spans, i,
                 c->gelu ? " gelu" : "", c->shared_acc ? " shared" : "");
        float *want = alloc_f((size_t)nq * d);
        capsule_want(c, &D, i, want);
        float *fo = finish(&fast[i], nq, d), *ro = finish(&ref[i], nq, d);
        double storage_tol = c->dtype == KVCAP_DTYPE_F32 ? CAPSULE_REL_TOL : F16_STORAGE_REL_TOL;
        assert_close(fo, ro, (size_t)nq * d, CAPSULE_REL_TOL, what); /* same stored values */
        assert_close(ro, want, (size_t)nq * d, storage_tol, what);
        assert_close(fo, want, (size_t)nq * d, storage_tol, what);
        free(want);
        free(fo);
        free(ro);
    }
    for (int i = 0; i < c->n_spans; i++) {
        free(fast[i].buf);
        free(ref[i].buf);
    }
    capsule_free(c, &D);
}

static void capsule_sweep(int full)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 23);
    static const int ds[] = {64, 80, 128};
    for (size_t di = 0; di < sizeof ds / sizeof *ds; di++)
        for (int nq = 1; nq <= 8; nq++) {
            /* every nq with one d, and nq = 4, 7 with every d; the portable set is smaller */
            if (nq % 3 != (int)di && nq != 4 && nq != 7)
                continue;
            if (!full && nq != 1 && nq != 3 && nq != 7)
                continue;
            int n_spans = 1 + (nq - 1) % 5;
            /* dense: one tile of m = n points */
            struct capsule_case dense = {96, 24, 20, ds[di], nq, n_spans, nq % 2,
                                         {1, 1, 1, 1, 1}, 0, KVCAP_DTYPE_F32, 0};
            check_capsule(&r, &dense);
            /* tiled: m = 16 points per tile, 64 tiles (fewer for later spans) */
            struct capsule_case tiled = {16, 6, 5, ds[di], nq, n_spans, (nq + 1) % 2,
                                         {64, 48, 64, 7, 1}, 0, KVCAP_DTYPE_F32, 0};
            check_capsule(&r, &tiled);
        }
    /* Two spans in one softmax (one partial), more than 8 queries, F16/BF16 storage. */
    struct capsule_case shared = {16, 6, 5, 64, 4, 3, 1, {64, 20, 3}, 1, KVCAP_DTYPE_F32, 0};
    check_capsule(&r, &shared);
    struct capsule_case wide = {16, 8, 6, 128, 11, 2, 1, {10, 64}, 0, KVCAP_DTYPE_F32, 0};
    check_capsule(&r, &wide);
    struct capsule_case f16d = {128, 32, 24, 128, 7, 2, 1, {1, 1}, 0, KVCAP_DTYPE_F16, 0};
    check_capsule(&r, &f16d);
    struct capsule_case f16t = {16, 6, 5, 128, 7, 3, 0, {64, 64, 5}, 1, KVCAP_DTYPE_F16, 0};
    check_capsule(&r, &f16t);
    /* Tiled edges: the widest small maps (h = rv = 16) on tiles of 64 points, for 6 queries and
     * for 3 (whose maps run packed, several tiles per vector), tiles of more than 256 points
     * (one tile at a time), rank-1 maps on 3-point tiles. */
    struct capsule_case wide_tiles = {64, 16, 16, 80, 6, 2, 1, {40, 3}, 0, KVCAP_DTYPE_F16, 0};
    check_capsule(&r, &wide_tiles);
    struct capsule_case wide_packed = {64, 16, 16, 80, 3, 2, 0, {40, 3}, 0, KVCAP_DTYPE_F16, 0};
    check_capsule(&r, &wide_packed); /* the same maps with the tiles packed into the lanes */
    struct capsule_case big_tiles = {300, 12, 9, 64, 3, 2, 0, {5, 2}, 1, KVCAP_DTYPE_F32, 0};
    check_capsule(&r, &big_tiles);
    struct capsule_case rank1 = {3, 1, 1, 64, 9, 1, 1, {500}, 0, KVCAP_DTYPE_F32, 0};
    check_capsule(&r, &rank1);
    /* Scores spread over hundreds: a softmax shift other than the true max would overflow. */
    struct capsule_case peaky = {16, 6, 5, 64, 5, 3, 1, {64, 30, 2}, 1, KVCAP_DTYPE_F32, 60.0};
    check_capsule(&r, &peaky);
    struct capsule_case peaky_dense = {96, 24, 20, 64, 3, 2, 0, {1, 1}, 0, KVCAP_DTYPE_F32, 60.0};
    check_capsule(&r, &peaky_dense);
    struct capsule_case bf16t = {16, 6, 5, 96, 2, 2, 1, {64, 64}, 0, KVCAP_DTYPE_BF16, 0};
    /* bf16: 2^-8 rounding of the state, so only fast vs ref is compared (same stored values) */
    struct capsule_data D;
    capsule_build(&r, &bf16t, &D);
    struct part fp[2] = {part_new(2, 96), part_new(2, 96)}, rp[2] = {part_new(2, 96), part_new(2, 96)};
    run_capsule(&bf16t, &D, 1, fp);
    run_capsule(&bf16t, &D, 0, rp);
    for (int i = 0; i < 2; i++) {
        float *a = finish(&fp[i], 2, 96), *b = finish(&rp[i], 2, 96);
        assert_close(a, b, 2 * 96, CAPSULE_REL_TOL, "bf16 capsule");
        free(a);
        free(b);
        free(fp[i].buf);
        free(rp[i].buf);
    }
    capsule_free(&bf16t, &D);
}

static void test_capsule_simd(void **state)
{
    (void)state;
    kvcap_kernels_set_simd(1);
    capsule_sweep(1);
}

static void test_capsule_portable(void **state)
{
    (void)state;
    kvcap_kernels_set_simd(0);
    capsule_sweep(0);
    kvcap_kernels_set_simd(1);
}

/* Fused spans and plain rows in one softmax: rows first then capsule into the same partial,
 * the reverse, and separate partials merged — all equal attention over the concatenation. */
static void test_capsule_mixed_with_rows(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 5);
    struct capsule_case c = {16, 6, 5, 128, 7, 1, 1, {64}, 0, KVCAP_DTYPE_F16, 0};
    struct capsule_data D;
    capsule_build(&r, &c, &D);
    int nq = c.nq, d = c.d, nt = 300, nc = c.tiles[0] * c.m;
    float scale = 1.0f / sqrtf((float)d);
    /* text rows use the plain query q, the span its offset-free q' (D.q[0]) */
    float *kx = alloc_f((size_t)nt * d), *vx = alloc_f((size_t)nt * d);
    float *kd = alloc_f((size_t)nt * d), *vd = alloc_f((size_t)nt * d), *q = alloc_f((size_t)nq * d);
    fill_random(&r, kx, (size_t)nt * d, 0.0, 1.0);
    fill_random(&r, vx, (size_t)nt * d, 0.5, 1.0);
    fill_random(&r, q, (size_t)nq * d, 0.0, 1.5);
    void *kb = store_rows(kx, nt, d, (size_t)d, c.dtype, kd);
    void *vb = store_rows(vx, nt, d, (size_t)d, c.dtype, vd);
    struct kvcap_rows rows = {kb, vb, c.dtype, (size_t)d, nt};

    /* reference: the capsule's materialised rows from the f16-rounded state */
    float *hs = alloc_f((size_t)64 * c.h * d), *vt = alloc_f((size_t)64 * c.rv * d),
          *mu = alloc_f((size_t)d);
    kvcap_convert_to_f32(c.dtype, D.hs_st[0], (size_t)64 * c.h * d, hs);
    kvcap_convert_to_f32(c.dtype, D.vt_st[0], (size_t)64 * c.rv * d, vt);
    kvcap_convert_to_f32(c.dtype, D.mu_st[0], (size_t)d, mu);
    int n = nt + nc;
    float *k = alloc_f((size_t)n * d), *v = alloc_f((size_t)n * d), *want = alloc_f((size_t)nq * d);
    unsigned char *sel = malloc((size_t)n);
    assert_non_null(sel);
    memcpy(k, kd, sizeof(float) * (size_t)nt * d);
    memcpy(v, vd, sizeof(float) * (size_t)nt * d);
    memset(sel, 0, (size_t)nt);
    memset(sel + nt, 1, (size_t)nc);
    for (int t = 0; t < 64; t++)
        for (int j = 0; j < c.m; j++)
            for (int cc = 0; cc < d; cc++) {
                double kk = D.b2[j], vv = mu[cc];
                for (int a = 0; a < c.h; a++)
                    kk += (double)D.w2[(size_t)a * c.m + j] * hs[((size_t)t * c.h + a) * d + cc];
                for (int a = 0; a < c.rv; a++)
                    vv += (double)D.u[(size_t)a * c.m + j] * vt[((size_t)t * c.rv + a) * d + cc];
                size_t row = (size_t)nt + (size_t)t * c.m + j;
                k[row * d + cc] = (float)kk;
                v[row * d + cc] = (float)vv;
            }
    naive_attention_mixed(q, D.q[0], sel, k, v, n, nq, d, scale, want);

    struct kvcap_capsule_maps maps = {c.m, c.h, c.rv, D.w2, D.b2, D.u};
    size_t nf = kvcap_capsule_scratch_floats(&maps, 1, 64, nq, d);
    float *scratch = alloc_f(nf);
    for (int order = 0; order < 3; order++) {
        struct part acc = part_new(nq, d), other = part_new(nq, d);
        struct kvcap_capsule_span span = {D.hs_st[0], D.vt_st[0], D.mu_st[0], c.dtype, 64, D.q[0],
                                          order == 2 ? other.p : acc.p};
        if (order == 0) {
            rows_fast(&rows, q, nq, d, scale, acc.p);
            capsule_fast(&maps, &span, 1, nq, d, scale, scratch, nf);
        } else if (order == 1) {
            capsule_fast(&maps, &span, 1, nq, d, scale, scratch, nf);
            rows_fast(&rows, q, nq, d, scale, acc.p);
        } else {
            capsule_fast(&maps, &span, 1, nq, d, scale, scratch, nf);
            rows_fast(&rows, q, nq, d, scale, acc.p);
            kvcap_partial_merge(acc.p, other.p, nq, d);
        }
        float *got = finish(&acc, nq, d);
        assert_close(got, want, (size_t)nq * d, CAPSULE_REL_TOL, "capsule + rows");
        free(got);
        free(acc.buf);
        free(other.buf);
    }
    free(scratch);
    free(kx);
    free(vx);
    free(kd);
    free(vd);
    free(q);
    free(kb);
    free(vb);
    free(hs);
    free(vt);
    free(mu);
    free(k);
    free(v);
    free(want);
    free(sel);
    capsule_free(&c, &D);
}

/* Too little scratch: nothing is read or written, 0 bytes. */
static void test_capsule_scratch_too_small(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 9);
    struct capsule_case c = {16, 6, 5, 64, 3, 1, 0, {8}, 0, KVCAP_DTYPE_F32, 0};
    struct capsule_data D;
    capsule_build(&r, &c, &D);
    struct kvcap_capsule_maps maps = {c.m, c.h, c.rv, D.w2, D.b2, D.u};
    struct part acc = part_new(c.nq, c.d);
    struct kvcap_capsule_span span = {D.hs_st[0], D.vt_st[0], D.mu_st[0], c.dtype, 8, D.q[0], acc.p};
    size_t nf = kvcap_capsule_scratch_floats(&maps, 1, 8, c.nq, c.d);
    assert_true(nf > 0);
    float *scratch = alloc_f(nf);
    uint64_t bytes = 1;
    assert_int_equal(kvcap_capsule_attend(&maps, &span, 1, c.nq, c.d, 0.125f, scratch, nf - 1,
                                          &bytes),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(bytes, 0);
    bytes = 1;
    assert_int_equal(kvcap_capsule_attend(&maps, &span, 1, c.nq, c.d, 0.125f, NULL, nf, &bytes),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(bytes, 0);
    for (int i = 0; i < c.nq; i++) {
        assert_true(acc.p.mx[i] == -INFINITY);
        assert_true(acc.p.sum[i] == 0.0f);
    }
    for (int i = 0; i < c.nq * c.d; i++)
        assert_true(acc.p.o[i] == 0.0f);
    assert_true(capsule_fast(&maps, &span, 1, c.nq, c.d, 0.125f, scratch, nf) > 0);
    free(scratch);
    free(acc.buf);
    capsule_free(&c, &D);
}

/* The scratch contract: from any float offset (no alignment asked of the caller) the result is
 * the same to the bit, and no float outside the nf that kvcap_capsule_scratch_floats asked for
 * is touched. */
static void capsule_scratch_offsets(int nq)
{
    enum { GUARD = 32 };
    const float canary = -12345.0f;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 10);
    struct capsule_case c = {16, 6, 5, 64, nq, 1, 0, {12}, 0, KVCAP_DTYPE_F16, 0};
    struct capsule_data D;
    capsule_build(&r, &c, &D);
    struct kvcap_capsule_maps maps = {c.m, c.h, c.rv, D.w2, D.b2, D.u};
    size_t nf = kvcap_capsule_scratch_floats(&maps, 1, 12, c.nq, c.d);
    size_t no = (size_t)c.nq * (c.d + 2);
    assert_true(nf > 0);
    float *buf = alloc_f(nf + GUARD + 16), *first = alloc_f(no);
    for (int off = 0; off < 16; off++) {
        for (size_t i = 0; i < nf + GUARD + 16; i++)
            buf[i] = canary;
        struct part acc = part_new(c.nq, c.d);
        struct kvcap_capsule_span span = {D.hs_st[0], D.vt_st[0], D.mu_st[0], c.dtype,
                                          12,         D.q[0],     acc.p};
        assert_true(capsule_fast(&maps, &span, 1, c.nq, c.d, 0.125f, buf + off, nf) > 0);
        for (size_t i = 0; i < (size_t)off; i++)
            assert_true(buf[i] == canary);
        for (size_t i = off + nf; i < nf + GUARD + 16; i++)
            assert_true(buf[i] == canary);
        if (off == 0)
            memcpy(first, acc.buf, sizeof(float) * no);
        else
            assert_memory_equal(acc.buf, first, sizeof(float) * no);
        free(acc.buf);
    }
    free(buf);
    free(first);
    capsule_free(&c, &D);
}

static void test_capsule_scratch_any_offset(void **state)
{
    (void)state;
    capsule_scratch_offsets(3); /* packed maps (with the AVX2 kernels) */
    capsule_scratch_offsets(7); /* lane maps */
}

/* ---- edge cases ----------------------------------------------------------------------------- */

/* Scores of magnitude 1e4, exactly representable (integer data, scale 1) so that f32 and double
 * agree exactly on them: no overflow, and the softmax over differences of a few units is right. */
static void test_large_scores(void **state)
{
    (void)state;
    int n = 257, d = 64, nq = 2;
    float *k = alloc_f((size_t)n * d), *v = alloc_f((size_t)n * d), *q = alloc_f((size_t)nq * d);
    float *want = alloc_f((size_t)nq * d);
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 3);
    for (int j = 0; j < n; j++)
        for (int c = 0; c < d; c++) {
            k[(size_t)j * d + c] = c == 0 ? 10000.0f - (float)(j % 7)
                                          : (float)((int)kvcap_rng_below(&r, 5) - 2);
            v[(size_t)j * d + c] = (float)kvcap_rng_normal(&r) + 0.5f;
        }
    for (int c = 0; c < d; c++) {
        q[c] = 1.0f;  /* scores ≈ +1e4 */
        q[d + c] = -1.0f; /* scores ≈ -1e4 */
    }
    naive_attention(q, k, v, n, nq, d, 1.0f, want);
    struct kvcap_rows rows = {k, v, KVCAP_DTYPE_F32, (size_t)d, n};
    for (int simd = 0; simd < 2; simd++) {
        kvcap_kernels_set_simd(simd);
        struct part fast = part_new(nq, d), ref = part_new(nq, d);
        rows_fast(&rows, q, nq, d, 1.0f, fast.p);
        rows_ref(&rows, q, nq, d, 1.0f, ref.p);
        assert_finite(fast.p.sum, (size_t)nq);
        float *a = finish(&fast, nq, d), *b = finish(&ref, nq, d);
        assert_close(a, want, (size_t)nq * d, FAST_REL_TOL, "large scores fast");
        assert_close(b, want, (size_t)nq * d, FAST_REL_TOL, "large scores ref");
        /* split in two and merged: the merge sees maxima 1e4 apart from nothing */
        struct kvcap_rows r1 = {k, v, KVCAP_DTYPE_F32, (size_t)d, 100};
        struct kvcap_rows r2 = {k + 100 * d, v + 100 * d, KVCAP_DTYPE_F32, (size_t)d, n - 100};
        struct part p1 = part_new(nq, d), p2 = part_new(nq, d);
        rows_fast(&r1, q, nq, d, 1.0f, p1.p);
        rows_fast(&r2, q, nq, d, 1.0f, p2.p);
        kvcap_partial_merge(p1.p, p2.p, nq, d);
        float *m = finish(&p1, nq, d);
        assert_close(m, want, (size_t)nq * d, MERGE_REL_TOL, "large scores merged");
        free(m);
        free(p1.buf);
        free(p2.buf);
        free(a);
        free(b);
        free(fast.buf);
        free(ref.buf);
    }
    kvcap_kernels_set_simd(1);
    /* F16 keys with q of magnitude 1e3: scores ~1e4 with gaps of ~1e3, the softmax is one-hot */
    uint16_t *kh = malloc(sizeof(uint16_t) * (size_t)n * d), *vh = malloc(sizeof(uint16_t) * (size_t)n * d);
    assert_true(kh && vh);
    fill_random(&r, k, (size_t)n * d, 0.0, 1.0);
    fill_random(&r, q, (size_t)nq * d, 0.0, 1000.0);
    kvcap_convert_from_f32(KVCAP_DTYPE_F16, k, (size_t)n * d, kh);
    kvcap_convert_from_f32(KVCAP_DTYPE_F16, v, (size_t)n * d, vh);
    kvcap_convert_to_f32(KVCAP_DTYPE_F16, kh, (size_t)n * d, k);
    kvcap_convert_to_f32(KVCAP_DTYPE_F16, vh, (size_t)n * d, v);
    naive_attention(q, k, v, n, nq, d, 1.0f, want);
    struct kvcap_rows rh = {kh, vh, KVCAP_DTYPE_F16, (size_t)d, n};
    struct part fast = part_new(nq, d);
    rows_fast(&rh, q, nq, d, 1.0f, fast.p);
    float *a = finish(&fast, nq, d);
    assert_close(a, want, (size_t)nq * d, FAST_REL_TOL, "f16 huge scores");
    free(a);
    free(fast.buf);
    free(kh);
    free(vh);
    free(k);
    free(v);
    free(q);
    free(want);
}

/* Two rows whose scores differ by x: out[1] / out[0] = exp(-x), so the kernels' exp is checked
 * directly over the range a softmax uses (weights down to 1e-35). */
#define EXP_REL_TOL 6e-7 /* the exp polynomial (~1-2 ulp) plus two f32 divisions in finish */
static void test_softmax_weights(void **state)
{
    (void)state;
    int d = 8;
    float k[16] = {0}, v[16] = {0}, q[8] = {1, 0, 0, 0, 0, 0, 0, 0}, out[8];
    v[0] = 1.0f;
    v[8 + 1] = 1.0f;
    for (int simd = 0; simd < 2; simd++) {
        kvcap_kernels_set_simd(simd);
        for (float x = 0.0f; x < 80.0f; x += 0.173f) {
            k[0] = x;
            struct kvcap_rows rows = {k, v, KVCAP_DTYPE_F32, (size_t)d, 2};
            struct part p = part_new(1, d);
            rows_fast(&rows, q, 1, d, 1.0f, p.p);
            kvcap_partial_finish(p.p, 1, d, out, (size_t)d);
            double want = exp(-(double)x), got = (double)out[1] / out[0];
            if (!(fabs(got - want) <= EXP_REL_TOL * want))
                fail_msg("x = %g: weight %.9g, exp(-x) = %.9g (simd %d)", (double)x, got, want,
                         simd);
            free(p.buf);
        }
    }
    kvcap_kernels_set_simd(1);
}

static void test_single_row(void **state)
{
    (void)state;
    int d = 80, nq = 3;
    float k[80], v[80], q[3 * 80], out[3 * 80];
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 4);
    fill_random(&r, k, 80, 0, 1);
    fill_random(&r, v, 80, 0, 1);
    fill_random(&r, q, 240, 0, 1);
    struct kvcap_rows rows = {k, v, KVCAP_DTYPE_F32, (size_t)d, 1};
    struct part p = part_new(nq, d);
    assert_int_equal(rows_fast(&rows, q, nq, d, 0.1f, p.p), 2 * 80 * 4);
    kvcap_partial_finish(p.p, nq, d, out, (size_t)d);
    for (int i = 0; i < nq; i++)
        assert_close(out + i * d, v, (size_t)d, 1e-7, "one row: output is that row's value");
    free(p.buf);
}

static void test_empty_partials(void **state)
{
    (void)state;
    int nq = 2, d = 64;
    struct part e1 = part_new(nq, d), e2 = part_new(nq, d), full = part_new(nq, d);
    for (int i = 0; i < nq; i++) {
        full.p.mx[i] = 3.0f + (float)i;
        full.p.sum[i] = 2.5f;
        for (int c = 0; c < d; c++)
            full.p.o[i * d + c] = (float)(c - 7) * 0.25f;
    }
    float before[2 * 66];
    memcpy(before, full.buf, sizeof before);
    /* non-empty ⊕= empty: unchanged, bit for bit */
    kvcap_partial_merge(full.p, e1.p, nq, d);
    assert_memory_equal(full.buf, before, sizeof before);
    /* empty ⊕= non-empty: a copy */
    kvcap_partial_merge(e1.p, full.p, nq, d);
    assert_memory_equal(e1.buf, before, sizeof before);
    /* empty ⊕= empty: still empty, no NaN */
    struct part e3 = part_new(nq, d);
    kvcap_partial_merge(e2.p, e3.p, nq, d);
    for (int i = 0; i < nq; i++) {
        assert_true(e2.p.mx[i] == -INFINITY);
        assert_true(e2.p.sum[i] == 0.0f);
    }
    /* finish with sum 0: zeros (out_stride > d leaves the gap alone) */
    float out[2 * 70];
    for (int i = 0; i < 140; i++)
        out[i] = 42.0f;
    kvcap_partial_finish(e2.p, nq, d, out, 70);
    for (int i = 0; i < nq; i++)
        for (int c = 0; c < 70; c++)
            assert_true(out[i * 70 + c] == (c < d ? 0.0f : 42.0f));
    /* attention over no rows is a no-op reading nothing */
    struct kvcap_rows none = {NULL, NULL, KVCAP_DTYPE_F16, (size_t)d, 0};
    float q[2 * 64] = {0};
    assert_int_equal(rows_fast(&none, q, nq, d, 1.0f, e2.p), 0);
    assert_int_equal(rows_ref(&none, q, nq, d, 1.0f, e2.p), 0);
    assert_true(e2.p.mx[0] == -INFINITY);
    free(e1.buf);
    free(e2.buf);
    free(e3.buf);
    free(full.buf);
}

int main(void)
{
    openblas_set_num_threads(1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_empty_partials),
        cmocka_unit_test(test_single_row),
        cmocka_unit_test(test_softmax_weights),
        cmocka_unit_test(test_large_scores),
        cmocka_unit_test(test_rows_simd),
        cmocka_unit_test(test_rows_portable),
        cmocka_unit_test(test_capsule_simd),
        cmocka_unit_test(test_capsule_portable),
        cmocka_unit_test(test_capsule_mixed_with_rows),
        cmocka_unit_test(test_capsule_scratch_too_small),
        cmocka_unit_test(test_capsule_scratch_any_offset),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
