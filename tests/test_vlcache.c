/* test_vlcache.c — VL-Cache's scoring against its oracle: fast vs double _ref over dtypes, G, d,
 * τ and chunk splits (column sums and sparsity counts), a tiny case worked by hand, causality,
 * the layer budgets of Algorithm 1, and the argument checks. */
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

#include "common/rng.h"
#include "common/dtype.h"
#include "kernels/vlcache.h"
#include "tests/test_numeric.h"

/* Fast vs _ref column sums: the fast path rounds the scaled queries, the sgemm scores and the
 * exps to f32 (~1 ulp each) and sums up to m = 3000 exps per row and τ·G ≤ 259 rows per column
 * in f32; relative error ~sqrt(terms) ulps, measured ≤ 8.5e-7, so 4e-6 leaves margin without
 * hiding a wrong mask or normaliser (those move scores by ≥ 1e-3). */
#define SCORE_REL_TOL 4e-6
/* The same with scores of magnitude ~50: their f32 rounding (~1e-5 absolute) enters the exps;
 * measured ≤ 2e-6. */
#define SCORE_LARGE_REL_TOL 2e-5
/* Σ_j score[j] = τ·G (every row of A' sums to 1), up to the f32 sums above (measured ≤ 3.3e-7). */
#define ROWSUM_REL_TOL 2e-6
/* On random data the fast and the double oracle may disagree on entries within rounding of
 * the threshold; the fast count must lie between the oracle's counts at p·(1 ∓ this), a window
 * 100× wider than the fast path's error in exp(s − max) (~1e-6 relative). */
#define COUNT_BRACKET_REL 1e-4
/* The hand-made case: values from closed forms; f32 arithmetic and the f32 rounding of ln 2 in
 * the keys give errors of a few 1e-8. */
#define TINY_ABS_TOL 1e-6
/* Decompositions of the same computation (one call vs per-row calls): only the f32 summation
 * order and the sgemm's blocking differ (measured ≤ 7e-8); a leak moves mass by O(1). */
#define CAUSAL_REL_TOL 1e-6
/* Budgets are a few double operations. */
#define BUDGET_ABS_TOL 1e-12

static const float P = 0.01f; /* DESIGN §6 */

/* ---- helpers -------------------------------------------------------------------------------- */

/* Causal entries of A' for one head: G·Σ_i (m − τ + i + 1). */
static int64_t causal_entries(int tau, int G, int m)
{
    int64_t e = 0;
    for (int i = 0; i < tau; i++)
        e += m - tau + i + 1;
    return e * G;
}

/* Keys [m][d] f32 stored as `dtype` in one buffer with `stride` elements per row (the gap holds
 * NaN so a kernel reading past d shows up), seen as chunks of the given sizes. */
struct keyset {
    unsigned char *buf;
    enum kvcap_dtype dt;
    size_t stride;
    int m, d, n_chunks;
    struct kvcap_rows chunks[64];
};

static void keys_store_row(struct keyset *ks, int j, const float *x)
{
    float row[512];
    assert_true(ks->stride <= sizeof row / sizeof *row);
    for (size_t c = 0; c < ks->stride; c++)
        row[c] = c < (size_t)ks->d ? x[c] : NAN;
    size_t es = kvcap_dtype_size(ks->dt);
    assert_int_equal(kvcap_convert_from_f32(ks->dt, row, ks->stride,
                                            ks->buf + (size_t)j * ks->stride * es),
                     KVCAP_OK);
}

/* sizes: n_chunks chunk lengths summing to m (0 allowed: such a chunk gets k = NULL). */
static void keys_make(struct keyset *ks, const float *x, int m, int d, size_t stride,
                      enum kvcap_dtype dt, const int *sizes, int n_chunks)
{
    assert_true(n_chunks >= 1 && n_chunks <= 64);
    ks->dt = dt;
    ks->stride = stride;
    ks->m = m;
    ks->d = d;
    ks->n_chunks = n_chunks;
    size_t es = kvcap_dtype_size(dt);
    ks->buf = malloc(es * stride * (size_t)m);
    assert_non_null(ks->buf);
    for (int j = 0; j < m; j++)
        keys_store_row(ks, j, x + (size_t)j * d);
    int j0 = 0;
    for (int c = 0; c < n_chunks; c++) {
        ks->chunks[c] = (struct kvcap_rows){
            sizes[c] ? ks->buf + (size_t)j0 * stride * es : NULL, NULL, dt, stride, sizes[c]};
        j0 += sizes[c];
    }
    assert_int_equal(j0, m);
}

/* How a configuration splits its m keys. */
enum layout {
    ONE_CHUNK,
    UNEVEN,      /* lengths cycling through 1, 255, 0, 257, 3, 256, 97: blocks straddle chunks */
    TAIL_SINGLES /* the last 40 keys one per chunk: the causal tail crosses many chunks */
};

static int chunk_sizes(enum layout l, int m, int *sizes)
{
    static const int cycle[] = {1, 255, 0, 257, 3, 256, 97};
    int n = 0, left = m;
    switch (l) {
    case ONE_CHUNK:
        sizes[n++] = m;
        break;
    case UNEVEN:
        for (int i = 0; left > 0; i++) {
            int s = cycle[i % 7] < left ? cycle[i % 7] : left;
            sizes[n++] = s;
            left -= s;
        }
        break;
    case TAIL_SINGLES:
        assert_true(m > 40);
        sizes[n++] = m - 40;
        for (int i = 0; i < 40; i++)
            sizes[n++] = 1;
        break;
    }
    assert_true(n <= 64);
    return n;
}

/* Data whose scores lie on a grid: keys are integers in [-2, 2], each query has four ±1
 * entries, scale 0.5, so every score is an exact multiple of 0.5 in f32, f16 and bf16 alike,
 * and s − max never comes within 0.1 of ln p = −4.605 (the nearest grid points are −4.5 and
 * −5). Fast and oracle must then count exactly the same entries. */
static void fill_grid(struct kvcap_rng *r, float *q, int nq, size_t q_stride_rows, int d,
                      float *k, int m)
{
    for (int a = 0; a < nq; a++) {
        float *qa = q + (size_t)a * q_stride_rows;
        for (int c = 0; c < d; c++)
            qa[c] = 0.0f;
        for (int t = 0; t < 4; t++)
            qa[kvcap_rng_below(r, (uint64_t)d)] = kvcap_rng_below(r, 2) ? 1.0f : -1.0f;
    }
    for (size_t i = 0; i < (size_t)m * d; i++)
        k[i] = (float)((int)kvcap_rng_below(r, 5) - 2);
}

struct result {
    float *score;
    int64_t below, entries;
};

static struct result run_fast(const float *q, size_t q_stride, int tau, int G, int d,
                              float scale, const struct kvcap_rows *keys, int n_chunks, int m,
                              float p)
{
    size_t nsc = kvcap_vlcache_scratch_floats(tau, G, d);
    assert_true(nsc > 0 && nsc != SIZE_MAX);
    float *scratch = malloc(sizeof(float) * nsc); /* exact size: ASan sees any overrun */
    assert_non_null(scratch);
    for (size_t i = 0; i < nsc; i++)
        scratch[i] = NAN; /* a value read before it is written poisons the result */
    struct result res = {alloc_f((size_t)m), 0, 0};
    assert_int_equal(kvcap_vlcache_head(q, q_stride, tau, G, d, scale, keys, n_chunks, p,
                                        res.score, &res.below, &res.entries, scratch),
                     KVCAP_OK);
    free(scratch);
    return res;
}

static struct result run_ref(const float *q, size_t q_stride, int tau, int G, int d, float scale,
                             const struct kvcap_rows *keys, int n_chunks, int m, float p)
{
    struct result res = {alloc_f((size_t)m), 0, 0};
    assert_int_equal(kvcap_vlcache_head_ref(q, q_stride, tau, G, d, scale, keys, n_chunks, p,
                                            res.score, &res.below, &res.entries),
                     KVCAP_OK);
    return res;
}

static double total(const float *x, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += x[i];
    return s;
}

/* ---- fast vs oracle ------------------------------------------------------------------------- */

struct config {
    enum kvcap_dtype dt;
    int G, d, tau, m;
    enum layout layout;
    int key_gap, q_gap; /* extra elements per key row / per token's queries, filled with NaN */
};

enum data { GRID, RANDOM, LARGE };

static void check_config(struct kvcap_rng *r, const struct config *cf, enum data kind)
{
    int G = cf->G, d = cf->d, tau = cf->tau, m = cf->m;
    size_t q_stride = (size_t)G * d + (size_t)cf->q_gap;
    float *q = alloc_f(q_stride * tau), *kx = alloc_f((size_t)m * d);
    for (size_t i = 0; i < q_stride * tau; i++)
        q[i] = NAN; /* the gaps stay NaN */
    float scale;
    if (kind == GRID) {
        float *qd = alloc_f((size_t)tau * G * d);
        fill_grid(r, qd, tau * G, (size_t)d, d, kx, m);
        for (int i = 0; i < tau; i++)
            memcpy(q + (size_t)i * q_stride, qd + (size_t)i * G * d, sizeof(float) * G * d);
        free(qd);
        scale = 0.5f;
    } else {
        for (int i = 0; i < tau; i++)
            fill_random(r, q + (size_t)i * q_stride, (size_t)G * d, 0.0, 1.5);
        fill_random(r, kx, (size_t)m * d, 0.0, 1.0);
        /* scores of spread ~1.5, or ~45 for LARGE (exps far outside f32 without the max) */
        scale = (kind == LARGE ? 30.0f : 1.0f) / sqrtf((float)d);
    }
    int sizes[64];
    int nc = chunk_sizes(cf->layout, m, sizes);
    struct keyset ks;
    keys_make(&ks, kx, m, d, (size_t)d + (size_t)cf->key_gap, cf->dt, sizes, nc);
    char what[160];
    snprintf(what, sizeof what, "%s %s G=%d d=%d tau=%d m=%d chunks=%d",
             kind == GRID ? "grid" : kind == RANDOM ? "random" : "large", kvcap_dtype_name(cf->dt),
             G, d, tau, m, nc);

    struct result f = run_fast(q, q_stride, tau, G, d, scale, ks.chunks, nc, m, P);
    int64_t want_entries = causal_entries(tau, G, m);
    assert_true(f.entries == want_entries);
    if (!(fabs(total(f.score, m) - (double)tau * G) <= ROWSUM_REL_TOL * tau * G))
        fail_msg("%s: column sums add up to %.9g, not tau*G = %d", what, total(f.score, m),
                 tau * G);

    if (kind == GRID) {
        struct result o = run_ref(q, q_stride, tau, G, d, scale, ks.chunks, nc, m, P);
        assert_true(o.entries == want_entries);
        if (f.below != o.below)
            fail_msg("%s: below %lld, oracle %lld", what, (long long)f.below,
                     (long long)o.below);
        /* the data must exercise both sides of the threshold */
        assert_true(o.below > 0 && o.below < o.entries);
        assert_close(f.score, o.score, (size_t)m, SCORE_REL_TOL, what);
        free(o.score);
    } else {
        /* Fewer entries are below a lower threshold: lo ≤ below(p) ≤ hi. Column sums do not
         * depend on p, so either oracle run gives the scores. */
        struct result lo = run_ref(q, q_stride, tau, G, d, scale, ks.chunks, nc, m,
                                   P * (float)(1 - COUNT_BRACKET_REL));
        struct result hi = run_ref(q, q_stride, tau, G, d, scale, ks.chunks, nc, m,
                                   P * (float)(1 + COUNT_BRACKET_REL));
        assert_true(lo.entries == want_entries && hi.entries == want_entries);
        if (f.below < lo.below || f.below > hi.below)
            fail_msg("%s: below %lld outside the oracle's [%lld, %lld]", what,
                     (long long)f.below, (long long)lo.below, (long long)hi.below);
        assert_true(lo.below > 0 && hi.below < hi.entries);
        assert_close(f.score, lo.score, (size_t)m,
                     kind == LARGE ? SCORE_LARGE_REL_TOL : SCORE_REL_TOL, what);
        free(lo.score);
        free(hi.score);
    }
    free(f.score);
    free(ks.buf);
    free(q);
    free(kx);
}

/* G ∈ {1, 2, 7}, d ∈ {64, 128}, τ ∈ {1, 5, 37}, the three storage dtypes, one chunk and many
 * uneven ones, m from τ (the first post-vision token sees key 0 only) to 3000, strided rows
 * and queries; sized so that the sanitizer build stays within a few seconds. */
static const struct config configs[] = {
    {KVCAP_DTYPE_F32, 1, 64, 1, 700, ONE_CHUNK, 0, 0},
    {KVCAP_DTYPE_F16, 2, 128, 5, 1500, UNEVEN, 3, 5},
    {KVCAP_DTYPE_BF16, 7, 64, 37, 3000, UNEVEN, 0, 0},
    {KVCAP_DTYPE_F32, 7, 128, 5, 1100, UNEVEN, 5, 0},
    {KVCAP_DTYPE_BF16, 2, 128, 37, 37, ONE_CHUNK, 0, 7},
    {KVCAP_DTYPE_F16, 1, 64, 37, 600, TAIL_SINGLES, 0, 0},
    {KVCAP_DTYPE_F32, 2, 64, 1, 257, UNEVEN, 1, 0}, /* one block and one row */
    {KVCAP_DTYPE_F16, 7, 64, 1, 513, ONE_CHUNK, 0, 0},
    {KVCAP_DTYPE_BF16, 1, 128, 5, 900, TAIL_SINGLES, 2, 0},
};

static void test_fast_vs_ref_grid(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 601);
    for (size_t i = 0; i < sizeof configs / sizeof *configs; i++)
        check_config(&r, &configs[i], GRID);
}

static void test_fast_vs_ref_random(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 602);
    for (size_t i = 0; i < sizeof configs / sizeof *configs; i++)
        check_config(&r, &configs[i], RANDOM);
}

static void test_large_scores(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 603);
    const struct config a = {KVCAP_DTYPE_F32, 2, 64, 5, 700, UNEVEN, 0, 0};
    const struct config b = {KVCAP_DTYPE_BF16, 7, 128, 37, 300, ONE_CHUNK, 0, 0};
    check_config(&r, &a, LARGE);
    check_config(&r, &b, LARGE);
}

/* ---- the hand-made case --------------------------------------------------------------------- */

/* m = 4, τ = 2, G = 1, d = 2, scale 0.5, queries q0 = (2, 0), q1 = (0, 2), so token 0's scores
 * are the keys' first coordinates and token 1's their second:
 *   k0 = (0, ln2), k1 = (0, 0), k2 = (ln2, −10), k3 = (100, 0).
 * Token 0 sees keys 0..2 (m−τ+0 = 2): scores (0, 0, ln2), exps (1, 1, 2), sum 4
 *   A'[0] = (1/4, 1/4, 1/2, —); rowmax 1/2. k3's score 100 would take all the mass if it leaked.
 * Token 1 sees keys 0..3: scores (ln2, 0, −10, 0), exps (2, 1, e^−10, 1), z = 4 + e^−10
 *   A'[1] = (2/z, 1/z, e^−10/z, 1/z) ≈ (0.4999943, 0.2499972, 0.0000113, 0.2499972); rowmax 2/z.
 * Column sums: (1/4 + 2/z, 1/4 + 1/z, 1/2 + e^−10/z, 1/z) ≈ (0.7499943, 0.4999972, 0.5000113,
 *   0.2499972). Entries: 3 + 4 = 7.
 * p = 0.01: token 0's threshold is 0.005, nothing below; token 1's is 0.02/z, only e^−10/z is
 *   below: 1 of 7 (sparsity 1/7).
 * p = 0.6: thresholds 0.3 and 1.2/z: token 0 has 2 below (the quarters), token 1 has 3 (all but
 *   its max): 5 of 7. */
static void tiny_case(int fast)
{
    const float ln2 = (float)log(2.0);
    const float q[] = {2, 0, 0, 2};
    const float k[] = {0, ln2, 0, 0, ln2, -10, 100, 0};
    struct kvcap_rows keys = {k, NULL, KVCAP_DTYPE_F32, 2, 4};
    double z = 4.0 + exp(-10.0);
    double want[4] = {0.25 + 2 / z, 0.25 + 1 / z, 0.5 + exp(-10.0) / z, 1 / z};
    static const float ps[] = {0.01f, 0.6f};
    static const int64_t want_below[] = {1, 5};
    float scratch[4096];
    assert_true(kvcap_vlcache_scratch_floats(2, 1, 2) <= sizeof scratch / sizeof *scratch);
    for (int t = 0; t < 2; t++) {
        /* the outputs are accumulated into, not overwritten */
        float score[4] = {1, 1, 1, 1};
        int64_t below = 10, entries = 100;
        enum kvcap_status st =
            fast ? kvcap_vlcache_head(q, 2, 2, 1, 2, 0.5f, &keys, 1, ps[t], score, &below,
                                      &entries, scratch)
                 : kvcap_vlcache_head_ref(q, 2, 2, 1, 2, 0.5f, &keys, 1, ps[t], score, &below,
                                          &entries);
        assert_int_equal(st, KVCAP_OK);
        for (int j = 0; j < 4; j++)
            if (!(fabs(score[j] - (1 + want[j])) <= TINY_ABS_TOL))
                fail_msg("%s p=%g score[%d] = %.8f, want %.8f", fast ? "fast" : "ref",
                         (double)ps[t], j, (double)score[j], 1 + want[j]);
        assert_true(below == 10 + want_below[t]);
        assert_true(entries == 100 + 7);
    }
}

static void test_tiny_by_hand(void **state)
{
    (void)state;
    tiny_case(1);
    tiny_case(0);
}

/* ---- causality ------------------------------------------------------------------------------ */

typedef struct result (*runner)(const float *, size_t, int, int, int, float,
                                const struct kvcap_rows *, int, int, float);

static void diff(const float *a, const float *b, int n, float *out)
{
    for (int i = 0; i < n; i++)
        out[i] = a[i] - b[i];
}

/* Grid data (exact counts) whose queries all have +1 in coordinate 0, where every key has 0;
 * then key m−1 becomes (20, 0, ...): a score of 10 for every query, which would draw nearly all
 * of any row's mass. Only token τ−1 may see it. Checks, with the keys split unevenly so the
 * causal tail crosses a chunk boundary:
 *  - one call = the sum over i of one-token calls (τ = 1) on keys truncated to 0..m−τ+i, which
 *    physically lack every key token i must not see (scores, below and entries);
 *  - after poisoning key m−1, full − last-token-only is unchanged (the other rows' part), and
 *    the poisoned column gained about G (the last token's heads) rather than τ·G. */
static void causality(runner run)
{
    const int G = 2, d = 64, tau = 5, m = 600;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 604);
    size_t q_stride = (size_t)G * d;
    float *q = alloc_f(q_stride * tau), *kx = alloc_f((size_t)m * d);
    fill_grid(&r, q, tau * G, (size_t)d, d, kx, m);
    for (int a = 0; a < tau * G; a++)
        q[(size_t)a * d] = 1.0f;
    for (int j = 0; j < m; j++)
        kx[(size_t)j * d] = 0.0f;
    const int sizes[] = {300, 297, 2, 1}; /* the last τ = 5 keys span three chunks */
    struct keyset ks;
    keys_make(&ks, kx, m, d, (size_t)d, KVCAP_DTYPE_F16, sizes, 4);

    struct result full = run(q, q_stride, tau, G, d, 0.5f, ks.chunks, 4, m, P);
    float *sum_rows = alloc_f((size_t)m);
    int64_t below = 0, entries = 0;
    for (int i = 0; i < tau; i++) {
        int n = m - tau + i + 1;
        struct kvcap_rows trunc = {ks.buf, NULL, ks.dt, ks.stride, n};
        struct result ri = run(q + (size_t)i * q_stride, q_stride, 1, G, d, 0.5f, &trunc, 1, n, P);
        for (int j = 0; j < n; j++)
            sum_rows[j] += ri.score[j];
        below += ri.below;
        entries += ri.entries;
        free(ri.score);
    }
    assert_close(full.score, sum_rows, (size_t)m, CAUSAL_REL_TOL, "one call vs rows");
    assert_true(full.below == below);
    assert_true(full.entries == entries);

    const float *q_last = q + (size_t)(tau - 1) * q_stride;
    struct result last = run(q_last, q_stride, 1, G, d, 0.5f, ks.chunks, 4, m, P);
    float *poison = alloc_f((size_t)d);
    poison[0] = 20.0f;
    keys_store_row(&ks, m - 1, poison);
    struct result full2 = run(q, q_stride, tau, G, d, 0.5f, ks.chunks, 4, m, P);
    struct result last2 = run(q_last, q_stride, 1, G, d, 0.5f, ks.chunks, 4, m, P);
    float *others = alloc_f((size_t)m), *others2 = alloc_f((size_t)m);
    diff(full.score, last.score, m, others);
    diff(full2.score, last2.score, m, others2);
    assert_close(others2, others, (size_t)m, CAUSAL_REL_TOL, "rows before the last");
    double gained = (double)full2.score[m - 1] - full.score[m - 1];
    if (!(gained > 0.9 * G && gained < 1.01 * G))
        fail_msg("poisoned key gained %.6f of mass, want about G = %d", gained, G);

    free(full.score);
    free(last.score);
    free(full2.score);
    free(last2.score);
    free(others);
    free(others2);
    free(poison);
    free(sum_rows);
    free(ks.buf);
    free(q);
    free(kx);
}

static void test_causality_fast(void **state)
{
    (void)state;
    causality(run_fast);
}

static void test_causality_ref(void **state)
{
    (void)state;
    causality(run_ref);
}

/* ---- budgets (Algorithm 1) ------------------------------------------------------------------ */

static void check_budgets(const double *gamma, int L, double alpha, double lo, const double *want)
{
    double beta[8];
    assert_true(L <= 8);
    assert_int_equal(kvcap_vlcache_budgets(gamma, L, alpha, lo, beta), KVCAP_OK);
    for (int l = 0; l < L; l++)
        if (!(fabs(beta[l] - want[l]) <= BUDGET_ABS_TOL))
            fail_msg("beta[%d] = %.15g, want %.15g", l, beta[l], want[l]);
}

static void test_budgets(void **state)
{
    (void)state;
    /* Nothing clips: 1 − γ = (.5, .4, .3, .2), Σ = 1.4, α·L = 1.2, β = (1 − γ)·1.2/1.4. */
    const double g1[] = {0.5, 0.6, 0.7, 0.8};
    const double w1[] = {0.6 / 1.4, 0.48 / 1.4, 0.36 / 1.4, 0.24 / 1.4};
    check_budgets(g1, 4, 0.3, 0.01, w1);
    double beta[4], s = 0;
    assert_int_equal(kvcap_vlcache_budgets(g1, 4, 0.3, 0.01, beta), KVCAP_OK);
    for (int l = 0; l < 4; l++)
        s += beta[l];
    assert_true(fabs(s - 0.3 * 4) <= BUDGET_ABS_TOL); /* Σβ = α·L */

    /* Clipped at 1: 1 − γ = (1, .1, .1, .1), Σ = 1.3, α·L = 2: β0 = 2/1.3 > 1 → 1, the others
     * 0.2/1.3 (Algorithm 1 does not hand the excess back). */
    const double g2[] = {0.0, 0.9, 0.9, 0.9};
    const double w2[] = {1.0, 0.2 / 1.3, 0.2 / 1.3, 0.2 / 1.3};
    check_budgets(g2, 4, 0.5, 0.01, w2);

    /* Clipped at lo: 1 − γ = (.001, 1, 1), Σ = 2.001, α·L = 0.9: β0 = 0.0009/2.001 < 0.01. */
    const double g3[] = {0.999, 0.0, 0.0};
    const double w3[] = {0.01, 0.9 / 2.001, 0.9 / 2.001};
    check_budgets(g3, 3, 0.3, 0.01, w3);

    /* All γ = 1: β = α (and α itself is clipped to [lo, 1]). */
    const double g4[] = {1.0, 1.0, 1.0};
    const double w4[] = {0.2, 0.2, 0.2};
    check_budgets(g4, 3, 0.2, 0.01, w4);
    const double w5[] = {0.05, 0.05, 0.05};
    check_budgets(g4, 3, 0.001, 0.05, w5);

    /* One layer takes the whole α·L = α. */
    const double g6[] = {0.42};
    const double w6[] = {0.25};
    check_budgets(g6, 1, 0.25, 0.01, w6);
}

/* ---- argument checks ------------------------------------------------------------------------ */

static void expect_error(enum kvcap_status st, const char *needle)
{
    assert_int_equal(st, KVCAP_ERR_INVALID_ARGUMENT);
    if (!strstr(kvcap_last_error(), needle))
        fail_msg("error '%s' does not name '%s'", kvcap_last_error(), needle);
}

/* One call of the fast version (fast = 1) or the oracle, q_stride 2, into fixed outputs. */
struct call_out {
    float score[4];
    int64_t below, entries;
    float scratch[4096];
};

static enum kvcap_status call_head(int fast, const float *q, int tau, int G, float scale,
                                   const struct kvcap_rows *keys, int n_chunks, float p,
                                   struct call_out *o)
{
    if (fast)
        return kvcap_vlcache_head(q, 2, tau, G, 2, scale, keys, n_chunks, p, o->score, &o->below,
                                  &o->entries, o->scratch);
    return kvcap_vlcache_head_ref(q, 2, tau, G, 2, scale, keys, n_chunks, p, o->score, &o->below,
                                  &o->entries);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    const float q[8] = {1, 0, 0, 1, 1, 1, 0, 0};
    const float k[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    struct kvcap_rows keys[2] = {{k, NULL, KVCAP_DTYPE_F32, 2, 2},
                                 {k + 4, NULL, KVCAP_DTYPE_F32, 2, 2}};
    static struct call_out o = {{3, 3, 3, 3}, 5, 6, {0}};
    float *score = o.score, *scratch = o.scratch;
    int64_t *below = &o.below, *entries = &o.entries;
    for (int fast = 0; fast < 2; fast++) {
        expect_error(call_head(fast, q, 5, 1, 1.0f, keys, 2, P, &o), "fewer than tau");
        expect_error(call_head(fast, NULL, 1, 1, 1.0f, keys, 2, P, &o), "q is NULL");
        expect_error(call_head(fast, q, 1, 0, 1.0f, keys, 2, P, &o), "G = 0");
        expect_error(call_head(fast, q, 1, 1, 1.0f, keys, 0, P, &o), "n_chunks");
        expect_error(call_head(fast, q, 1, 1, 1.0f, keys, 2, NAN, &o), "p = nan");
        expect_error(call_head(fast, q, 1, 1, INFINITY, keys, 2, P, &o), "scale");
        expect_error(call_head(fast, q, 1, 1, 1.0f, NULL, 2, P, &o), "keys is NULL");
        keys[1].dtype = KVCAP_DTYPE_U8;
        expect_error(call_head(fast, q, 1, 1, 1.0f, keys, 2, P, &o), "keys[1].dtype");
        keys[1].dtype = KVCAP_DTYPE_F32;
        keys[0].row_stride = 1;
        expect_error(call_head(fast, q, 1, 1, 1.0f, keys, 2, P, &o), "keys[0].row_stride");
        keys[0].row_stride = 2;
        keys[0].n = -1;
        expect_error(call_head(fast, q, 1, 1, 1.0f, keys, 2, P, &o), "keys[0].n");
        keys[0].n = 2;
    }
    expect_error(kvcap_vlcache_head(q, 2, 1, 1, 2, 1.0f, keys, 2, P, NULL, below, entries,
                                    scratch),
                 "score is NULL");
    expect_error(kvcap_vlcache_head(q, 2, 1, 1, 2, 1.0f, keys, 2, P, score, below, entries,
                                    NULL),
                 "scratch is NULL");
    /* nothing was written by a failed call */
    for (int j = 0; j < 4; j++)
        assert_true(score[j] == 3.0f);
    assert_true(*below == 5 && *entries == 6);
    /* and the same arguments, fixed, work */
    assert_int_equal(call_head(1, q, 1, 1, 1.0f, keys, 2, P, &o), KVCAP_OK);
    assert_true(*entries == 6 + 4 && *below >= 5); /* token 0 sees the 4 keys */

    assert_int_equal(kvcap_vlcache_scratch_floats(0, 1, 64), 0);
    assert_int_equal(kvcap_vlcache_scratch_floats(1, 1, 0), 0);
    assert_true(kvcap_vlcache_scratch_floats(1 << 30, 1 << 30, 1 << 30) == SIZE_MAX ||
                sizeof(size_t) > 8);

    const double g[] = {0.5, 1.5};
    double beta[2];
    expect_error(kvcap_vlcache_budgets(g, 0, 0.3, 0.01, beta), "L = 0");
    expect_error(kvcap_vlcache_budgets(g, 2, 0.3, 0.01, beta), "gamma[1]");
    expect_error(kvcap_vlcache_budgets(g, 1, NAN, 0.01, beta), "alpha");
    expect_error(kvcap_vlcache_budgets(g, 1, 0.3, 2.0, beta), "lo");
    expect_error(kvcap_vlcache_budgets(NULL, 1, 0.3, 0.01, beta), "gamma is NULL");
}

int main(void)
{
    openblas_set_num_threads(1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_by_hand),
        cmocka_unit_test(test_fast_vs_ref_grid),
        cmocka_unit_test(test_fast_vs_ref_random),
        cmocka_unit_test(test_large_scores),
        cmocka_unit_test(test_causality_fast),
        cmocka_unit_test(test_causality_ref),
        cmocka_unit_test(test_budgets),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
