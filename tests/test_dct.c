/* test_dct.c — the DCT-II FlashCache runs on (kernels/dct.h): the FFT form against its O(n²)
 * oracle over many lengths (primes and Bluestein ones included), the oracle on hand-computed
 * values, the low-pass inverse, round trips and Parseval, long transforms, and errors. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/dct.h"
#include "kernels/flashcache.h" /* kvcap_flashcache_omega: the keep FlashCache uses */
#include "common/rng.h"
#include "tests/test_numeric.h"

/* Fast DCT (f32 KissFFT, twiddles in double) vs the double oracle, as ‖fast − ref‖/‖ref‖:
 * a float FFT carries a few ulps (6e-8) times log2 n of relative error, Bluestein lengths
 * (prime, 7·k) run two FFTs of length m ≈ 2n–4n; measured ≤ 2.5e-7 for n <= 1009. */
#define DCT_REL_TOL 1e-6
/* forward → inverse: two transforms' worth of the error above (measured ≤ 3.5e-7). */
#define ROUND_TRIP_REL_TOL 1.5e-6
/* |‖C‖² − ‖x‖²| / ‖x‖² with both sums in double: at most twice the coefficients' relative
 * error, mostly cancelling (measured ≤ 1.5e-7). */
#define PARSEVAL_REL_TOL 1e-6
/* n = 8191 (Bluestein, m = 16384) and 8192: log2 n grows the float FFT error a little
 * (measured ≤ 4e-7 for the round trip). */
#define LARGE_REL_TOL 2e-6
/* Hand-computed values: the oracle's f32 output is within half an ulp (< 5e-7 below 8) of the
 * exact value. */
#define HAND_F32_TOL 1e-6

/* ---- helpers -------------------------------------------------------------------------------- */

static void fill_normal(struct kvcap_rng *r, float *x, size_t n, double mean, double sd)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(mean + sd * kvcap_rng_normal(r));
}

/* ‖a − b‖ / ‖b‖ over an n × cols block with row strides lda, ldb (‖b‖ = 0: absolute). */
static double rel_err_rows(const float *a, size_t lda, const float *b, size_t ldb, int n, int cols)
{
    double num = 0, den = 0;
    for (int j = 0; j < n; j++)
        for (int c = 0; c < cols; c++) {
            double x = a[(size_t)j * lda + c], y = b[(size_t)j * ldb + c];
            if (!isfinite(x))
                fail_msg("element (%d, %d) is %g", j, c, x);
            num += (x - y) * (x - y);
            den += y * y;
        }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void check_close(const float *a, size_t lda, const float *b, size_t ldb, int n, int cols,
                        double tol, const char *what, int len)
{
    double e = rel_err_rows(a, lda, b, ldb, n, cols);
    if (!(e <= tol))
        fail_msg("%s, n = %d: relative error %.3g > %.3g", what, len, e, tol);
}

static const int lengths[] = {1,  2,  3,  4,  5,   6,   7,   8,   9,   11,  13,  16,
                              30, 49, 64, 97, 100, 127, 128, 210, 243, 257, 1000};
#define N_LENGTHS ((int)(sizeof lengths / sizeof lengths[0]))

/* ---- DCT ------------------------------------------------------------------------------------ */

/* Forward vs oracle, 3 channels (one pair + a lone channel) in rows of stride 5 whose gap
 * holds NaN (a read past cols poisons the result) and an output whose gap must stay intact. */
static void test_dct_forward_vs_ref(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 1);
    const int cols = 3;
    const size_t ld = 5, ld_out = 4;
    for (int t = 0; t < N_LENGTHS; t++) {
        const int n = lengths[t];
        struct kvcap_dct *p = plan_new(n);
        size_t ns = kvcap_dct_scratch_floats(p);
        float *x = alloc_f((size_t)n * ld), *got = alloc_f((size_t)n * ld_out),
              *want = alloc_f((size_t)n * cols), *s = scratch_new(ns);
        for (int j = 0; j < n; j++)
            for (size_t c = 0; c < ld; c++)
                x[j * ld + c] = c < (size_t)cols ? (float)(0.5 + kvcap_rng_normal(&r)) : NAN;
        for (size_t i = 0; i < (size_t)n * ld_out; i++)
            got[i] = -7.0f;
        kvcap_dct_forward(p, x, ld, cols, got, ld_out, s);
        kvcap_dct_forward_ref(n, x, ld, cols, want, (size_t)cols);
        check_close(got, ld_out, want, (size_t)cols, n, cols, DCT_REL_TOL, "forward", n);
        for (int j = 0; j < n; j++)
            assert_true(got[j * ld_out + 3] == -7.0f);
        scratch_check(s, ns);
        /* In place (out = x, same stride) gives the same coefficients. */
        kvcap_dct_forward(p, x, ld, cols, x, ld, s);
        check_close(x, ld, want, (size_t)cols, n, cols, DCT_REL_TOL, "forward in place", n);
        free(x);
        free(got);
        free(want);
        free(s);
        kvcap_dct_free(p);
    }
}

/* The oracle itself on tiny cases by hand: n = 1 is the identity, n = 2 is the Haar pair. */
static void test_dct_ref_by_hand(void **state)
{
    (void)state;
    float x1 = 3.5f, c1 = 0;
    kvcap_dct_forward_ref(1, &x1, 1, 1, &c1, 1);
    assert_float_equal(c1, 3.5f, 0);
    float x2[2] = {1.0f, 3.0f}, c2[2];
    kvcap_dct_forward_ref(2, x2, 1, 1, c2, 1);
    assert_float_equal(c2[0], 4.0 / sqrt(2.0), HAND_F32_TOL);
    assert_float_equal(c2[1], -2.0 / sqrt(2.0), HAND_F32_TOL);
    /* A constant has only the DC coefficient, √n times the constant. */
    float x7[7], c7[7];
    for (int j = 0; j < 7; j++)
        x7[j] = 2.0f;
    kvcap_dct_forward_ref(7, x7, 1, 1, c7, 1);
    assert_float_equal(c7[0], 2.0 * sqrt(7.0), HAND_F32_TOL);
    for (int k = 1; k < 7; k++)
        assert_float_equal(c7[k], 0.0, HAND_F32_TOL);
}

/* Inverse vs oracle with keep = n, ω and 0/1/n−1; rows >= keep hold NaN (must not be read). */
static void test_dct_inverse_vs_ref(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 2);
    const int cols = 5;
    for (int t = 0; t < N_LENGTHS; t++) {
        const int n = lengths[t];
        struct kvcap_dct *p = plan_new(n);
        size_t ns = kvcap_dct_scratch_floats(p);
        float *c = alloc_f((size_t)n * cols), *cz = alloc_f((size_t)n * cols),
              *got = alloc_f((size_t)n * cols), *want = alloc_f((size_t)n * cols),
              *s = scratch_new(ns);
        int keeps[5] = {n, kvcap_flashcache_omega(0.1, n), 0, 1, n - 1};
        for (int q = 0; q < 5; q++) {
            int keep = keeps[q];
            fill_normal(&r, c, (size_t)n * cols, 0.0, 1.0);
            memcpy(cz, c, sizeof(float) * (size_t)n * cols);
            for (size_t i = (size_t)keep * cols; i < (size_t)n * cols; i++) {
                c[i] = NAN;
                cz[i] = 0.0f;
            }
            kvcap_dct_inverse(p, c, (size_t)cols, cols, keep, got, (size_t)cols, s);
            kvcap_dct_inverse_ref(n, cz, (size_t)cols, cols, n, want, (size_t)cols);
            check_close(got, (size_t)cols, want, (size_t)cols, n, cols, DCT_REL_TOL, "inverse", n);
            scratch_check(s, ns);
            /* The oracle's own keep agrees with zeroed rows. */
            float *want2 = alloc_f((size_t)n * cols);
            kvcap_dct_inverse_ref(n, cz, (size_t)cols, cols, keep, want2, (size_t)cols);
            assert_memory_equal(want, want2, sizeof(float) * (size_t)n * cols);
            free(want2);
        }
        free(c);
        free(cz);
        free(got);
        free(want);
        free(s);
        kvcap_dct_free(p);
    }
}

/* forward → inverse(keep = n) is the identity, out of place and in place; ‖C‖ = ‖x‖. */
static void test_dct_round_trip_parseval(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 3);
    const int cols = 4;
    for (int t = 0; t < N_LENGTHS; t++) {
        const int n = lengths[t];
        struct kvcap_dct *p = plan_new(n);
        float *x = alloc_f((size_t)n * cols), *c = alloc_f((size_t)n * cols),
              *y = alloc_f((size_t)n * cols), *s = alloc_f(kvcap_dct_scratch_floats(p));
        fill_normal(&r, x, (size_t)n * cols, -1.0, 2.0);
        kvcap_dct_forward(p, x, (size_t)cols, cols, c, (size_t)cols, s);
        double ex = 0, ec = 0;
        for (size_t i = 0; i < (size_t)n * cols; i++) {
            ex += (double)x[i] * x[i];
            ec += (double)c[i] * c[i];
        }
        if (!(fabs(ec - ex) <= PARSEVAL_REL_TOL * ex))
            fail_msg("Parseval, n = %d: %.9g vs %.9g", n, ec, ex);
        kvcap_dct_inverse(p, c, (size_t)cols, cols, n, y, (size_t)cols, s);
        check_close(y, (size_t)cols, x, (size_t)cols, n, cols, ROUND_TRIP_REL_TOL, "round trip", n);
        kvcap_dct_inverse(p, c, (size_t)cols, cols, n, c, (size_t)cols, s);
        check_close(c, (size_t)cols, x, (size_t)cols, n, cols, ROUND_TRIP_REL_TOL,
                    "round trip in place", n);
        free(x);
        free(c);
        free(y);
        free(s);
        kvcap_dct_free(p);
    }
}

/* Long spans: 8192 (2^13, direct) and 8191 (prime, Bluestein) round-trip and keep Parseval;
 * a few coefficients are checked against the basis formula (the full oracle is O(n²)). */
static void test_dct_large(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 4);
    const int ns[2] = {8192, 8191}, cols = 2;
    for (int t = 0; t < 2; t++) {
        const int n = ns[t];
        struct kvcap_dct *p = plan_new(n);
        float *x = alloc_f((size_t)n * cols), *c = alloc_f((size_t)n * cols),
              *y = alloc_f((size_t)n * cols), *s = alloc_f(kvcap_dct_scratch_floats(p));
        fill_normal(&r, x, (size_t)n * cols, 0.3, 1.0);
        kvcap_dct_forward(p, x, (size_t)cols, cols, c, (size_t)cols, s);
        const int ks[5] = {0, 1, 17, n / 2, n - 1};
        double num = 0, den = 0;
        for (int q = 0; q < 5; q++)
            for (int ch = 0; ch < cols; ch++) {
                double want = 0;
                for (int j = 0; j < n; j++)
                    want += kvcap_dct_basis(n, ks[q], j) * x[(size_t)j * cols + ch];
                double e = c[(size_t)ks[q] * cols + ch] - want;
                num += e * e;
                den += want * want;
            }
        /* Absolute errors of single coefficients scale with ‖x‖/√n, not with the coefficient. */
        double ex = 0, ec = 0;
        for (size_t i = 0; i < (size_t)n * cols; i++) {
            ex += (double)x[i] * x[i];
            ec += (double)c[i] * c[i];
        }
        if (!(sqrt(num) <= LARGE_REL_TOL * sqrt(ex)))
            fail_msg("n = %d: coefficient error %.3g vs ‖x‖ %.3g", n, sqrt(num), sqrt(ex));
        if (!(fabs(ec - ex) <= LARGE_REL_TOL * ex))
            fail_msg("Parseval, n = %d: %.9g vs %.9g", n, ec, ex);
        kvcap_dct_inverse(p, c, (size_t)cols, cols, n, y, (size_t)cols, s);
        check_close(y, (size_t)cols, x, (size_t)cols, n, cols, LARGE_REL_TOL, "large round trip", n);
        free(x);
        free(c);
        free(y);
        free(s);
        kvcap_dct_free(p);
    }
}

static void test_dct_errors(void **state)
{
    (void)state;
    struct kvcap_dct *p = (struct kvcap_dct *)&p; /* must be reset to NULL on failure */
    assert_int_equal(kvcap_dct_create(0, &p), KVCAP_ERR_INVALID_ARGUMENT);
    assert_null(p);
    assert_non_null(strstr(kvcap_last_error(), "n = 0"));
    assert_int_equal(kvcap_dct_create(-5, &p), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_dct_create(7, NULL), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "out"));
    kvcap_dct_free(NULL);
    assert_int_equal(kvcap_dct_length(NULL), 0);
    assert_int_equal((int)kvcap_dct_scratch_floats(NULL), 0);
}

/* One plain FFT exactly for the lengths whose prime factors are all 2, 3 or 5 (by trial
 * division here); none for n < 1. */
static void test_dct_fast_length(void **state)
{
    (void)state;
    for (int n = -3; n <= 5000; n++) {
        int m = n, smooth = n >= 1;
        for (int p = 2; smooth && p <= 5; p++)
            while (m % p == 0)
                m /= p;
        smooth = smooth && m == 1;
        if (kvcap_dct_fast_length(n) != smooth)
            fail_msg("kvcap_dct_fast_length(%d) = %d, expected %d", n, kvcap_dct_fast_length(n),
                     smooth);
    }
    assert_true(kvcap_dct_fast_length(1 << 30));
    assert_false(kvcap_dct_fast_length(2147483647)); /* prime */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dct_ref_by_hand),
        cmocka_unit_test(test_dct_forward_vs_ref),
        cmocka_unit_test(test_dct_inverse_vs_ref),
        cmocka_unit_test(test_dct_round_trip_parseval),
        cmocka_unit_test(test_dct_large),
        cmocka_unit_test(test_dct_errors),
        cmocka_unit_test(test_dct_fast_length),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
