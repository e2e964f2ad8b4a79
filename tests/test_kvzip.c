/* test_kvzip.c — KVzip's scoring against its oracle: the fast column maxima vs the double
 * _ref over dtypes, G, d, query counts and chunk splits (blocks straddling chunks, empty
 * chunks, padded rows), a case worked by hand, the shared budget's selection vs its sorting
 * oracle (ties, NaN, clamping, per-head floors) and by hand, and the argument checks. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/dtype.h"
#include "common/rng.h"
#include "kernels/kvzip.h"

/* Fast vs _ref: the fast path rounds the scaled queries, sgemm scores and exps to f32 and sums
 * up to m = 1100 exps per row in f32 for the normaliser: relative error ~sqrt(m) ulps (~4e-6);
 * 2e-5 leaves margin without hiding a wrong normaliser or a missed block (those move a
 * probability by far more). The absolute floor covers probabilities near 0. */
#define SCORE_REL_TOL 2e-5
#define SCORE_ABS_TOL 1e-9
/* The hand-made case: closed forms in f32. */
#define TINY_ABS_TOL 1e-6

static void fill(struct kvcap_rng *r, float *x, size_t n, double scale)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(scale * kvcap_rng_normal(r));
}

/* m keys [m][d] stored as dt with `stride` elements per row (NaN in the gap), cut into chunks
 * cycling through `cycle` lengths (0 allowed). */
static int make_keys(const float *x, int m, int d, size_t stride, enum kvcap_dtype dt,
                     unsigned char **buf, struct kvcap_rows *chunks)
{
    static const int cycle[] = {1, 255, 0, 257, 3, 256, 97};
    size_t es = kvcap_dtype_size(dt);
    *buf = malloc(es * stride * (size_t)m);
    assert_non_null(*buf);
    float row[512];
    for (int j = 0; j < m; j++) {
        for (size_t c = 0; c < stride; c++)
            row[c] = c < (size_t)d ? x[(size_t)j * d + c] : NAN;
        assert_int_equal(kvcap_convert_from_f32(dt, row, stride, *buf + (size_t)j * stride * es),
                         KVCAP_OK);
    }
    int n = 0, j0 = 0;
    for (int i = 0; j0 < m; i++) {
        int s = cycle[i % 7] < m - j0 ? cycle[i % 7] : m - j0;
        chunks[n++] = (struct kvcap_rows){s ? *buf + (size_t)j0 * stride * es : NULL, NULL, dt,
                                          stride, s};
        j0 += s;
    }
    return n;
}

/* with_lse: every query also saw keys outside the m given (log-sum-exp around the prompt's
 * own, some -inf), which must join each normaliser. */
static void check_config(int m, int n_q, int G, int d, enum kvcap_dtype dt, size_t stride,
                         double qscale, uint64_t seed, int with_lse)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, seed);
    float *x = malloc(sizeof(float) * (size_t)m * d);
    size_t q_stride = (size_t)G * d + 5; /* rows of queries with a gap */
    float *q = malloc(sizeof(float) * (size_t)n_q * q_stride);
    fill(&r, x, (size_t)m * d, 1.0);
    fill(&r, q, (size_t)n_q * q_stride, qscale);
    unsigned char *buf;
    struct kvcap_rows chunks[64];
    int nc = make_keys(x, m, d, stride, dt, &buf, chunks);
    float *got = malloc(sizeof(float) * (size_t)m), *want = malloc(sizeof(float) * (size_t)m);
    float *scratch = malloc(sizeof(float) * kvcap_kvzip_scratch_floats(n_q, G, d));
    for (int j = 0; j < m; j++)
        got[j] = want[j] = j % 5 == 0 ? 0.5f : 0.0f; /* max with what is there already */
    float scale = 1.0f / sqrtf((float)d);
    const size_t lse_stride = (size_t)G + 1;
    float *lse = with_lse ? malloc(sizeof(float) * (size_t)n_q * lse_stride) : NULL;
    for (size_t i = 0; lse && i < (size_t)n_q * lse_stride; i++)
        lse[i] = i % 5 == 0 ? -INFINITY : (float)(log((double)m) + 3.0 * kvcap_rng_normal(&r));
    assert_int_equal(kvcap_kvzip_head_ref(q, q_stride, lse, lse_stride, n_q, G, d, scale, chunks,
                                          nc, want),
                     KVCAP_OK);
    assert_int_equal(kvcap_kvzip_head(q, q_stride, lse, lse_stride, n_q, G, d, scale, chunks, nc,
                                      got, scratch),
                     KVCAP_OK);
    free(lse);
    double worst = 0;
    for (int j = 0; j < m; j++) {
        double err = fabs((double)got[j] - want[j]);
        double tol = SCORE_REL_TOL * fabs(want[j]) + SCORE_ABS_TOL;
        if (err > tol)
            fail_msg("m=%d n_q=%d G=%d d=%d %s: score[%d] = %.9g, oracle %.9g", m, n_q, G, d,
                     kvcap_dtype_name(dt), j, (double)got[j], (double)want[j]);
        worst = err > worst ? err : worst;
        assert_true(got[j] >= (j % 5 == 0 ? 0.5f : 0.0f) && got[j] <= 1.0f);
    }
    free(x), free(q), free(buf), free(got), free(want), free(scratch);
}

static void test_fast_matches_ref(void **state)
{
    (void)state;
    static const enum kvcap_dtype dts[] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16, KVCAP_DTYPE_BF16};
    uint64_t seed = 1;
    for (int t = 0; t < 6; t++) {
        const int lse = t >= 3;
        check_config(1, 1, 1, 64, dts[t % 3], 64, 1.0, seed++, lse);
        check_config(300, 7, 3, 64, dts[t % 3], 64, 1.0, seed++, lse);
        check_config(1100, 20, 1, 128, dts[t % 3], 136, 2.0, seed++, lse);   /* padded rows */
        check_config(513, 300, 4, 64, dts[t % 3], 64, 4.0, seed++, lse);     /* sharp attention */
        check_config(257, 3, 7, 96, dts[t % 3], 96, 0.3, seed++, lse);
    }
}

/* Two keys, one query: probabilities e^a/(e^a+e^b) and e^b/(e^a+e^b) in closed form; a second
 * query that prefers the other key raises that key's maximum. */
static void test_by_hand(void **state)
{
    (void)state;
    const int d = 64;
    float k[2 * 64] = {0}, q[2 * 64] = {0};
    k[0] = 1.0f;          /* key 0 = e0 */
    k[64 + 1] = 1.0f;     /* key 1 = e1 */
    q[0] = 2.0f;          /* query 0: scores 2, 0 */
    q[64 + 1] = 3.0f;     /* query 1: scores 0, 3 */
    struct kvcap_rows ch = {k, NULL, KVCAP_DTYPE_F32, (size_t)d, 2};
    float s[2] = {0, 0}, sr[2] = {0, 0};
    float *scratch = malloc(sizeof(float) * kvcap_kvzip_scratch_floats(2, 1, d));
    assert_int_equal(kvcap_kvzip_head(q, (size_t)d, NULL, 0, 2, 1, d, 1.0f, &ch, 1, s, scratch), KVCAP_OK);
    assert_int_equal(kvcap_kvzip_head_ref(q, (size_t)d, NULL, 0, 2, 1, d, 1.0f, &ch, 1, sr), KVCAP_OK);
    double p0 = exp(2.0) / (exp(2.0) + 1.0), p1 = exp(3.0) / (exp(3.0) + 1.0);
    assert_true(fabs(s[0] - p0) < TINY_ABS_TOL && fabs(sr[0] - p0) < TINY_ABS_TOL);
    assert_true(fabs(s[1] - p1) < TINY_ABS_TOL && fabs(sr[1] - p1) < TINY_ABS_TOL);
    /* query 0 also saw a key outside (log-sum-exp 2): e^2/(2e^2+1); query 1 none (-inf) */
    const float lse[2] = {2.0f, -INFINITY};
    s[0] = s[1] = sr[0] = sr[1] = 0;
    assert_int_equal(kvcap_kvzip_head(q, (size_t)d, lse, 1, 2, 1, d, 1.0f, &ch, 1, s, scratch),
                     KVCAP_OK);
    assert_int_equal(kvcap_kvzip_head_ref(q, (size_t)d, lse, 1, 2, 1, d, 1.0f, &ch, 1, sr),
                     KVCAP_OK);
    double p0x = exp(2.0) / (2 * exp(2.0) + 1.0);
    assert_true(fabs(s[0] - p0x) < TINY_ABS_TOL && fabs(sr[0] - p0x) < TINY_ABS_TOL);
    assert_true(fabs(s[1] - p1) < TINY_ABS_TOL && fabs(sr[1] - p1) < TINY_ABS_TOL);
    free(scratch);
}

/* The selection against its oracle; also that every row keeps at least its clamped floor. */
static void check_select(const float *score, int units, int n, int64_t budget, int head_floor)
{
    int keep[64], keep_ref[64];
    unsigned char *sel = malloc((size_t)units * n + 1), *sel_ref = malloc((size_t)units * n + 1);
    int64_t a = kvcap_kvzip_select(score, units, n, budget, head_floor, keep, sel);
    int64_t b = kvcap_kvzip_select_ref(score, units, n, budget, head_floor, keep_ref, sel_ref);
    int64_t want = budget < 0 ? 0 : budget > (int64_t)units * n ? (int64_t)units * n : budget;
    assert_int_equal(a, want);
    assert_int_equal(b, want);
    assert_memory_equal(keep, keep_ref, sizeof(int) * (size_t)units);
    assert_memory_equal(sel, sel_ref, (size_t)units * n);
    int f = head_floor < 0 ? 0 : head_floor > n ? n : head_floor;
    if (units > 0 && f > want / units)
        f = (int)(want / units);
    for (int u = 0; u < units; u++) {
        int count = 0;
        for (int j = 0; j < n; j++)
            count += sel[(size_t)u * n + j];
        assert_int_equal(count, keep[u]);
        assert_true(keep[u] >= f);
    }
    free(sel), free(sel_ref);
}

static void test_select(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 7);
    float s[12 * 50];
    fill(&r, s, 12 * 50, 1.0);
    /* rows of unequal scale, so the shared budget starves some and the floor matters */
    for (int u = 0; u < 12; u++)
        for (int j = 0; j < 50; j++)
            s[u * 50 + j] *= (float)(1 + u * u);
    const int floors[] = {0, 1, 4, 13, 50, 51, -2};
    for (int fi = 0; fi < (int)(sizeof floors / sizeof floors[0]); fi++)
        for (int64_t b = -3; b <= 12 * 50 + 3; b += 37)
            check_select(s, 12, 50, b, floors[fi]);
    for (int i = 0; i < 12 * 50; i++) /* ties everywhere, and NaN: lower index and numbers win */
        s[i] = i % 7 == 0 ? NAN : (float)(i % 4);
    for (int fi = 0; fi < (int)(sizeof floors / sizeof floors[0]); fi++)
        for (int64_t b = 0; b <= 12 * 50; b += 13)
            check_select(s, 12, 50, b, floors[fi]);
    check_select(s, 0, 50, 10, 3);
    check_select(s, 12, 0, 10, 3);
    /* by hand: units of 3, budget 3 → the three largest wherever they are */
    const float h[6] = {0.1f, 0.9f, 0.2f, 0.8f, 0.7f, 0.05f};
    int keep[2];
    unsigned char sel[6];
    assert_int_equal(kvcap_kvzip_select(h, 2, 3, 3, 0, keep, sel), 3);
    assert_int_equal(keep[0], 1);
    assert_int_equal(keep[1], 2);
    const unsigned char want[6] = {0, 1, 0, 1, 1, 0};
    assert_memory_equal(sel, want, 6);
    /* a floor of 1 per row, budget 4: first 0.9 and 0.8, then 0.7 and 0.2 (as without) */
    assert_int_equal(kvcap_kvzip_select(h, 2, 3, 4, 1, keep, sel), 4);
    const unsigned char want_floor[6] = {0, 1, 1, 1, 1, 0};
    assert_memory_equal(sel, want_floor, 6);
    /* a floor of 2, budget 4: each row its own two largest, so 0.2 in place of 0.7 */
    const float g[6] = {0.1f, 0.2f, 0.3f, 0.9f, 0.8f, 0.7f};
    assert_int_equal(kvcap_kvzip_select(g, 2, 3, 4, 0, keep, sel), 4);
    assert_int_equal(keep[0], 1); /* without: 0.9, 0.8, 0.7 and 0.3 */
    assert_int_equal(kvcap_kvzip_select(g, 2, 3, 4, 2, keep, sel), 4);
    assert_int_equal(keep[0], 2);
    assert_int_equal(keep[1], 2);
    const unsigned char want_two[6] = {0, 1, 1, 1, 1, 0};
    assert_memory_equal(sel, want_two, 6);
}

static void test_arguments(void **state)
{
    (void)state;
    float q[64] = {0}, k[64] = {0}, s[1] = {0}, scratch[1024];
    struct kvcap_rows ch = {k, NULL, KVCAP_DTYPE_F32, 64, 1};
    struct kvcap_rows bad = {k, NULL, KVCAP_DTYPE_F64, 64, 1};
    struct kvcap_rows empty = {NULL, NULL, KVCAP_DTYPE_F32, 64, 0};
    assert_int_equal(kvcap_kvzip_head(NULL, 64, NULL, 0, 1, 1, 64, 1.0f, &ch, 1, s, scratch),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_kvzip_head(q, 64, NULL, 0, 0, 1, 64, 1.0f, &ch, 1, s, scratch),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_kvzip_head(q, 64, NULL, 0, 1, 1, 64, NAN, &ch, 1, s, scratch),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_kvzip_head(q, 64, NULL, 0, 1, 1, 64, 1.0f, &bad, 1, s, scratch),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_kvzip_head(q, 64, NULL, 0, 1, 1, 64, 1.0f, &empty, 1, s, scratch),
                     KVCAP_ERR_INVALID_ARGUMENT); /* no key at all */
    assert_int_equal(kvcap_kvzip_head(q, 64, NULL, 0, 1, 1, 64, 1.0f, &ch, 1, s, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_kvzip_head_ref(q, 64, NULL, 0, 1, 1, 64, 1.0f, &ch, 1, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    const float bad_lse[1] = {NAN};
    assert_int_equal(kvcap_kvzip_head(q, 64, bad_lse, 1, 1, 1, 64, 1.0f, &ch, 1, s, scratch),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_kvzip_scratch_floats(0, 1, 64), 0);
    int keep[1];
    unsigned char sel[1];
    assert_int_equal(kvcap_kvzip_select(NULL, 1, 1, 1, 0, keep, sel), -1);
    assert_int_equal(kvcap_kvzip_select(s, -1, 1, 1, 0, keep, sel), -1);
    assert_int_equal(kvcap_kvzip_select(s, 1, 1, 1, 0, keep, NULL), -1);
    assert_int_equal(kvcap_kvzip_select_ref(s, 1, -1, 1, 0, keep, sel), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fast_matches_ref),
        cmocka_unit_test(test_by_hand),
        cmocka_unit_test(test_select),
        cmocka_unit_test(test_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
