/* test_basis_rows.c — attention over kept keys with values in a value basis
 * (kernels/basis_rows.h): the oracle against a softmax over values built independently in
 * double, the fast form against the oracle (F32, F16 and BF16 storage), a pass split in two and
 * merged by log-sum-exp, with and without exact values, the bytes read, and the refusals (a point
 * or an exact value out of range, small scratch),
 * after which nothing is folded. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/basis_rows.h"
#include "common/dtype.h"
#include "common/rng.h"
#include "tests/test_numeric.h"

/* The oracle (values rebuilt in double, rounded to f32, then the plain rows' oracle in double)
 * vs a softmax over values kept in double in the test: one f32 rounding of each value. */
#define REF_REL_TOL 1e-6
/* The fast form accumulates scores, weights and coefficients in f32 (sgemms, expf): a few f32
 * ulps times sqrt(terms), ~1e-6 for these sizes. */
#define FAST_REL_TOL 1e-5
/* Two slices merged by log-sum-exp vs one pass: the same f32 sums in another grouping. */
#define MERGE_REL_TOL 1e-5

/* One kept-key set over a span of `tiles` tiles of m points, head_dim d, rank rv. */
struct case_data {
    int n, m, rv, tiles, d, n_vx;
    float *k, *u, *vt, *mu; /* [n][d], [rv][m], [tiles][rv][d], [d] as stored (f32 copies) */
    float *vx;              /* [n_vx][d]: exact values, of rows 1, 3, 5, ... */
    int32_t *point;         /* [n], a random subset of the points in random order */
    void *ks, *vts, *mus, *vxs; /* the same in the storage dtype */
    enum kvcap_dtype dtype;
};

static void *stored(const float *x, size_t n, enum kvcap_dtype dt, float *back)
{
    void *buf = malloc(kvcap_dtype_size(dt) * (n ? n : 1));
    assert_non_null(buf);
    assert_int_equal(kvcap_convert_from_f32(dt, x, n, buf), KVCAP_OK);
    assert_int_equal(kvcap_convert_to_f32(dt, buf, n, back), KVCAP_OK); /* what is stored */
    return buf;
}

static struct case_data case_new(int n, int m, int rv, int tiles, int d, int n_vx,
                                 enum kvcap_dtype dt, uint64_t seed)
{
    struct case_data c = {.n = n, .m = m, .rv = rv, .tiles = tiles, .d = d, .n_vx = n_vx,
                          .dtype = dt};
    struct kvcap_rng r;
    kvcap_rng_seed(&r, seed);
    c.k = alloc_f((size_t)n * d), c.u = alloc_f((size_t)rv * m);
    c.vt = alloc_f((size_t)tiles * rv * d), c.mu = alloc_f((size_t)d);
    fill_random(&r, c.k, (size_t)n * d, 0.0, 1.0);
    fill_random(&r, c.u, (size_t)rv * m, 0.0, 1.0 / sqrt((double)m));
    fill_random(&r, c.vt, (size_t)tiles * rv * d, 0.3, 1.0);
    fill_random(&r, c.mu, (size_t)d, 0.5, 0.5);
    c.ks = stored(c.k, (size_t)n * d, dt, c.k);
    c.vts = stored(c.vt, (size_t)tiles * rv * d, dt, c.vt);
    c.mus = stored(c.mu, (size_t)d, dt, c.mu);
    c.vx = alloc_f((size_t)n_vx * d); /* far from what the basis gives: a sink's value */
    fill_random(&r, c.vx, (size_t)n_vx * d, -2.0, 3.0);
    c.vxs = stored(c.vx, (size_t)n_vx * d, dt, c.vx);
    const int all = tiles * m; /* a random n of the points, shuffled */
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)all);
    assert_non_null(perm);
    for (int i = 0; i < all; i++)
        perm[i] = i;
    for (int i = all - 1; i > 0; i--) {
        int j = (int)kvcap_rng_below(&r, (uint64_t)i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    c.point = perm;
    for (int x = 0; x < n_vx; x++)
        c.point[2 * x + 1] = -1 - x;
    return c;
}

static void case_free(struct case_data *c)
{
    free(c->k), free(c->u), free(c->vt), free(c->mu), free(c->point);
    free(c->ks), free(c->vts), free(c->mus), free(c->vx), free(c->vxs);
}

static struct kvcap_basis_rows case_rows(const struct case_data *c, int j0, int n)
{
    const size_t es = kvcap_dtype_size(c->dtype);
    return (struct kvcap_basis_rows){(const char *)c->ks + (size_t)j0 * c->d * es, c->dtype,
                                     (size_t)c->d, n, c->point + j0, c->m, c->rv, c->tiles,
                                     c->u, c->vts, c->mus, c->n_vx ? c->vxs : NULL, c->n_vx};
}

/* The expected output: v̂_j = Σ_r U[r][p] Ṽ_t[r] + μ from the stored values, then softmax
 * attention, all in double. */
static void expected(const struct case_data *c, const float *q, int nq, float scale, float *out)
{
    const int d = c->d;
    double *vhat = malloc(sizeof(double) * (size_t)c->n * d), *s = malloc(sizeof(double) * c->n);
    assert_non_null(vhat), assert_non_null(s);
    for (int j = 0; j < c->n; j++) {
        const int t = c->point[j] / c->m, p = c->point[j] % c->m;
        for (int e = 0; e < d && c->point[j] < 0; e++)
            vhat[(size_t)j * d + e] = c->vx[(size_t)(-1 - c->point[j]) * d + e];
        for (int e = 0; e < d && c->point[j] >= 0; e++) {
            double v = c->mu[e];
            for (int a = 0; a < c->rv; a++)
                v += (double)c->u[(size_t)a * c->m + p] * c->vt[((size_t)t * c->rv + a) * d + e];
            vhat[(size_t)j * d + e] = v;
        }
    }
    for (int qi = 0; qi < nq; qi++) {
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < c->n; j++) {
            double dot = 0;
            for (int e = 0; e < d; e++)
                dot += (double)q[(size_t)qi * d + e] * c->k[(size_t)j * d + e];
            s[j] = dot * scale;
            mx = s[j] > mx ? s[j] : mx;
        }
        for (int j = 0; j < c->n; j++)
            sum += (s[j] = exp(s[j] - mx));
        for (int e = 0; e < d; e++) {
            double o = 0;
            for (int j = 0; j < c->n; j++)
                o += s[j] * vhat[(size_t)j * d + e];
            out[(size_t)qi * d + e] = (float)(o / sum);
        }
    }
    free(vhat), free(s);
}

static float *finished(struct part *p, int nq, int d)
{
    float *out = alloc_f((size_t)nq * d);
    kvcap_partial_finish(p->p, nq, d, out, (size_t)d);
    return out;
}

static void check_case(int n, int m, int rv, int tiles, int d, int n_vx, int nq,
                       enum kvcap_dtype dt, uint64_t seed)
{
    struct case_data c = case_new(n, m, rv, tiles, d, n_vx, dt, seed);
    struct kvcap_rng r;
    kvcap_rng_seed(&r, seed + 1);
    float *q = alloc_f((size_t)nq * d), *want = alloc_f((size_t)nq * d);
    fill_random(&r, q, (size_t)nq * d, 0.0, 1.0);
    const float scale = 1.0f / sqrtf((float)d);
    expected(&c, q, nq, scale, want);
    const size_t es = kvcap_dtype_size(dt);
    const uint64_t bytes = (uint64_t)n * (d * es + 4) +
                           ((uint64_t)tiles * rv + 1 + n_vx) * d * es + (uint64_t)rv * m * 4;

    struct kvcap_basis_rows rows = case_rows(&c, 0, n);
    struct part ref = part_new(nq, d), fast = part_new(nq, d), split = part_new(nq, d);
    uint64_t got = 0;
    assert_int_equal(kvcap_attend_basis_rows_ref(&rows, q, nq, d, scale, ref.p, &got), KVCAP_OK);
    assert_int_equal(got, bytes);
    float *o_ref = finished(&ref, nq, d);
    assert_close(o_ref, want, (size_t)nq * d, REF_REL_TOL, "oracle vs materialised");

    const size_t floats = kvcap_attend_basis_rows_scratch_floats(n, tiles, rv, n_vx, nq, d);
    float *sc = scratch_new(floats);
    assert_int_equal(kvcap_attend_basis_rows(&rows, q, nq, d, scale, fast.p, sc, floats, &got),
                     KVCAP_OK);
    scratch_check(sc, floats);
    assert_int_equal(got, bytes);
    float *o_fast = finished(&fast, nq, d);
    assert_close(o_fast, o_ref, (size_t)nq * d, FAST_REL_TOL, "fast vs oracle");

    /* two slices of the rows, each folded into the same partial */
    const int cut = n / 3;
    struct kvcap_basis_rows a = case_rows(&c, 0, cut), b = case_rows(&c, cut, n - cut);
    assert_int_equal(kvcap_attend_basis_rows(&a, q, nq, d, scale, split.p, sc, floats, NULL),
                     KVCAP_OK);
    assert_int_equal(kvcap_attend_basis_rows(&b, q, nq, d, scale, split.p, sc, floats, NULL),
                     KVCAP_OK);
    float *o_split = finished(&split, nq, d);
    assert_close(o_split, o_fast, (size_t)nq * d, MERGE_REL_TOL, "two slices vs one");

    free(o_ref), free(o_fast), free(o_split), free(q), free(want), free(sc);
    free(ref.buf), free(fast.buf), free(split.buf);
    case_free(&c);
}

static void test_matches_oracle(void **state)
{
    (void)state;
    check_case(37, 16, 3, 16, 64, 0, 3, KVCAP_DTYPE_F32, 1);    /* tiled, few keys, G = 3 */
    check_case(200, 16, 6, 16, 64, 4, 3, KVCAP_DTYPE_F16, 2);   /* most of a 256-token span,
                                                                 * 4 exact values */
    check_case(90, 256, 40, 1, 128, 2, 7, KVCAP_DTYPE_BF16, 3); /* a dense bucket, G = 7 */
    check_case(70, 8, 0, 12, 32, 1, 1, KVCAP_DTYPE_F32, 4);     /* rank 0: μ, one exact */
}

/* Refusals leave the partial as it was: a point outside the tiles, scratch too small. */
static void test_refusals(void **state)
{
    (void)state;
    const int n = 20, d = 32, nq = 2;
    struct case_data c = case_new(n, 4, 2, 8, d, 1, KVCAP_DTYPE_F32, 9);
    float q[2 * 32];
    for (int i = 0; i < nq * d; i++)
        q[i] = 0.1f * (float)(i % 7);
    const size_t floats = kvcap_attend_basis_rows_scratch_floats(n, 8, 2, 1, nq, d);
    float *sc = scratch_new(floats);
    struct part p = part_new(nq, d);
    struct kvcap_basis_rows rows = case_rows(&c, 0, n);
    uint64_t got = 1;
    assert_int_equal(kvcap_attend_basis_rows(&rows, q, nq, d, 0.2f, p.p, sc, floats - 1, &got),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(got, 0);
    c.point[5] = 8 * 4; /* one past the last point */
    assert_int_equal(kvcap_attend_basis_rows(&rows, q, nq, d, 0.2f, p.p, sc, floats, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    c.point[5] = -2; /* one past the last exact value */
    assert_int_equal(kvcap_attend_basis_rows(&rows, q, nq, d, 0.2f, p.p, sc, floats, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_attend_basis_rows_ref(&rows, q, nq, d, 0.2f, p.p, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    for (int i = 0; i < nq; i++)
        assert_true(p.p.mx[i] == -INFINITY && p.p.sum[i] == 0.0f);
    rows.n = 0; /* no rows: nothing to do */
    assert_int_equal(kvcap_attend_basis_rows(&rows, q, nq, d, 0.2f, p.p, NULL, 0, &got),
                     KVCAP_OK);
    assert_int_equal(got, 0);
    free(sc), free(p.buf);
    case_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_oracle),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
