/* test_flashcache.c — FlashCache's numerical core (the DCT it runs on is tests/test_dct.c):
 * deviations and energies against brute force, a planted outlier, layer weights, and the
 * water-filled integer layer budgets against a bisection oracle. */
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
#include "kernels/flashcache.h"
#include "common/rng.h"
#include "kernels/select.h"
#include "tests/test_numeric.h"

/* Fast deviation vs brute force, per token, divided by the mean of k² + v² over the head: the
 * fast Base is off by ~1e-7·|x| (f32 DCT both ways), which moves (x − base)² by ~2e-7·x²
 * (measured ≤ 7e-7 at d = 1, where nothing averages out). */
#define DEV_ABS_TOL 2e-6
/* Low-band energy from f32 coefficients vs double ones: twice their relative error
 * (measured ≤ 2.5e-7). */
#define ENERGY_REL_TOL 1e-6
/* Σ_j d·dev_ref[j] vs the high-band energy, both from the double oracle: only the f32
 * rounding of each stored deviation (2^-24 relative) separates them. */
#define DEV_SUM_REL_TOL 1e-6
/* Total energy: the same float inputs squared and summed in double, in another order. */
#define TOTAL_REL_TOL 1e-12
/* Integer budget vs the exact continuous share: largest-remainder rounding moves each layer by
 * less than one token; the margin covers the oracle's bisection (relative 1e-15). */
#define BUDGET_SHARE_TOL (1.0 + 1e-6)
/* Exact-ratio layer weights differ from the closed form by double rounding only. */
#define HAND_F64_TOL 1e-15
/* Signals built from only low or only high DCT modes, stored in f32: the rounding of the
 * signal leaks ~1e-7 of its amplitude (1e-14 of its energy) into the other band, the f32
 * transform adds ~2e-7 relative to the energy split. */
#define BAND_SPLIT_TOL 1e-6

/* ---- helpers -------------------------------------------------------------------------------- */

static void fill_normal(struct kvcap_rng *r, float *x, size_t n, double mean, double sd)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(mean + sd * kvcap_rng_normal(r));
}


/* ---- deviation, energies, layer weight ------------------------------------------------------ */

static void test_omega(void **state)
{
    (void)state;
    assert_int_equal(kvcap_flashcache_omega(0.1, 30), 3);
    assert_int_equal(kvcap_flashcache_omega(0.07, 100), 7);  /* 7.000000000000001 in double */
    assert_int_equal(kvcap_flashcache_omega(0.55, 100), 55); /* 55.00000000000001 */
    assert_int_equal(kvcap_flashcache_omega(0.07, 101), 8);
    assert_int_equal(kvcap_flashcache_omega(0.1, 31), 4);
    assert_int_equal(kvcap_flashcache_omega(0.1, 10), 1);
    assert_int_equal(kvcap_flashcache_omega(0.1, 5), 1);
    assert_int_equal(kvcap_flashcache_omega(0.25, 7), 2);
    assert_int_equal(kvcap_flashcache_omega(0.1, 576), 58);
    assert_int_equal(kvcap_flashcache_omega(1.0, 7), 7);
    assert_int_equal(kvcap_flashcache_omega(3.0, 7), 7);
    assert_int_equal(kvcap_flashcache_omega(0.0, 7), 1);
    assert_int_equal(kvcap_flashcache_omega(-1.0, 7), 1);
    assert_int_equal(kvcap_flashcache_omega(NAN, 7), 1);
    assert_int_equal(kvcap_flashcache_omega(0.1, 1), 1);
    assert_int_equal(kvcap_flashcache_omega(0.5, 0), 0);
}

static void check_energy(double got, double want, double tol, const char *what)
{
    if (!(fabs(got - want) <= tol * fabs(want) + 1e-30))
        fail_msg("%s: %.12g vs %.12g", what, got, want);
}

static void test_deviation_vs_ref(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 5);
    const int ns[] = {1, 2, 7, 64, 97, 300}, ds[] = {1, 5, 40};
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (size_t b = 0; b < sizeof ds / sizeof ds[0]; b++) {
            const int n = ns[a], d = ds[b], omega = kvcap_flashcache_omega(0.1, n);
            struct kvcap_dct *p = plan_new(n);
            size_t nsc = kvcap_flashcache_scratch_floats(p, d);
            float *k = alloc_f((size_t)n * d), *v = alloc_f((size_t)n * d),
                  *dev = alloc_f((size_t)n), *ref = alloc_f((size_t)n), *s = scratch_new(nsc);
            fill_normal(&r, k, (size_t)n * d, 0.7, 1.5);
            fill_normal(&r, v, (size_t)n * d, -0.2, 0.5);
            /* Energies accumulate: start from a non-zero value in both. */
            struct kvcap_energy e = {1, 1, 1, 1}, er = {1, 1, 1, 1};
            kvcap_flashcache_deviation(p, k, v, d, omega, dev, &e, s);
            kvcap_flashcache_deviation_ref(n, k, v, d, omega, ref, &er);
            scratch_check(s, nsc);
            double scale = (er.k_total + er.v_total - 2) / ((double)n * d);
            for (int j = 0; j < n; j++)
                if (!(fabs(dev[j] - ref[j]) <= DEV_ABS_TOL * scale))
                    fail_msg("n = %d d = %d token %d: dev %.9g vs %.9g", n, d, j, dev[j], ref[j]);
            check_energy(e.k_total, er.k_total, TOTAL_REL_TOL, "k_total");
            check_energy(e.v_total, er.v_total, TOTAL_REL_TOL, "v_total");
            check_energy(e.k_low, er.k_low, ENERGY_REL_TOL, "k_low");
            check_energy(e.v_low, er.v_low, ENERGY_REL_TOL, "v_low");
            /* Deviation is the energy above ω: Σ_j dev·d = high K + high V (Parseval). */
            double sum = 0;
            for (int j = 0; j < n; j++)
                sum += ref[j] * (double)d;
            check_energy(sum, (er.k_total - er.k_low) + (er.v_total - er.v_low), DEV_SUM_REL_TOL,
                         "Σ dev vs high-band energy");
            free(k);
            free(v);
            free(dev);
            free(ref);
            free(s);
            kvcap_dct_free(p);
        }
}

/* Smooth K and V (a few low DCT modes plus faint noise) with a spike on token 37 in K and on
 * token 150 in V: those two must be the two largest deviations, far above the rest. */
static void test_deviation_outlier(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 6);
    const int n = 200, d = 16, omega = kvcap_flashcache_omega(0.1, n);
    struct kvcap_dct *p = plan_new(n);
    float *k = alloc_f((size_t)n * d), *v = alloc_f((size_t)n * d), *dev = alloc_f(n),
          *ref = alloc_f(n), *s = alloc_f(kvcap_flashcache_scratch_floats(p, d));
    for (int c = 0; c < d; c++) {
        double ak[4], av[4];
        for (int q = 0; q < 4; q++) {
            ak[q] = 3 * kvcap_rng_normal(&r);
            av[q] = 3 * kvcap_rng_normal(&r);
        }
        for (int j = 0; j < n; j++) {
            double sk = 0.01 * kvcap_rng_normal(&r), sv = 0.01 * kvcap_rng_normal(&r);
            for (int q = 0; q < 4; q++) {
                sk += ak[q] * kvcap_dct_basis(n, q, j) * sqrt((double)n);
                sv += av[q] * kvcap_dct_basis(n, q, j) * sqrt((double)n);
            }
            k[(size_t)j * d + c] = (float)sk;
            v[(size_t)j * d + c] = (float)sv;
        }
        k[(size_t)37 * d + c] += (c & 1) ? 4.0f : -4.0f;
        v[(size_t)150 * d + c] += 3.0f;
    }
    kvcap_flashcache_deviation(p, k, v, d, omega, dev, NULL, s);
    kvcap_flashcache_deviation_ref(n, k, v, d, omega, ref, NULL);
    /* kvcap_topk_indices lists the kept indices in ascending order. */
    int idx[2], work[200];
    assert_int_equal(kvcap_topk_indices(dev, n, 2, idx, work), 2);
    assert_int_equal(idx[0], 37);
    assert_int_equal(idx[1], 150);
    assert_int_equal(kvcap_topk_indices(ref, n, 2, idx, work), 2);
    assert_int_equal(idx[0], 37);
    assert_int_equal(idx[1], 150);
    float rest = 0;
    for (int j = 0; j < n; j++)
        if (j != 37 && j != 150 && dev[j] > rest)
            rest = dev[j];
    if (!(fminf(dev[37], dev[150]) > 4 * rest))
        fail_msg("outliers %.4g, %.4g not clear of the next %.4g", dev[37], dev[150], rest);
    free(k);
    free(v);
    free(dev);
    free(ref);
    free(s);
    kvcap_dct_free(p);
}

static void test_layer_weight(void **state)
{
    (void)state;
    struct kvcap_energy e = {.k_total = 4, .k_low = 1, .v_total = 2, .v_low = 2};
    assert_float_equal(kvcap_flashcache_layer_weight(&e), 0.75, HAND_F64_TOL);
    e = (struct kvcap_energy){.k_total = 10, .k_low = 5, .v_total = 8, .v_low = 2};
    assert_float_equal(kvcap_flashcache_layer_weight(&e), 0.5 + 0.75, HAND_F64_TOL);
    e = (struct kvcap_energy){0, 0, 0, 0}; /* empty layer */
    assert_float_equal(kvcap_flashcache_layer_weight(&e), 0.0, 0);
    e = (struct kvcap_energy){.k_total = 1, .k_low = 1 + 1e-15, .v_total = 1, .v_low = 0};
    assert_float_equal(kvcap_flashcache_layer_weight(&e), 1.0, 0); /* rounding clamps R_k to 0 */
    assert_true(isnan(kvcap_flashcache_layer_weight(NULL)));

    /* From real energies: K made of modes < ω only has R_k ≈ 0; V made of modes >= ω only
     * has R_v ≈ 1. */
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 7);
    const int n = 50, d = 3, omega = kvcap_flashcache_omega(0.1, n);
    struct kvcap_dct *p = plan_new(n);
    float *k = alloc_f((size_t)n * d), *v = alloc_f((size_t)n * d), *dev = alloc_f(n),
          *s = alloc_f(kvcap_flashcache_scratch_floats(p, d));
    for (int c = 0; c < d; c++)
        for (int q = 0; q < n; q++) {
            double a = kvcap_rng_normal(&r);
            for (int j = 0; j < n; j++) {
                float b = (float)(a * kvcap_dct_basis(n, q, j));
                if (q < omega)
                    k[(size_t)j * d + c] += b;
                else
                    v[(size_t)j * d + c] += b;
            }
        }
    e = (struct kvcap_energy){0, 0, 0, 0};
    kvcap_flashcache_deviation(p, k, v, d, omega, dev, &e, s);
    assert_float_equal(1.0 - e.k_low / e.k_total, 0.0, BAND_SPLIT_TOL);
    assert_float_equal(e.v_low / e.v_total, 0.0, BAND_SPLIT_TOL);
    assert_float_equal(kvcap_flashcache_layer_weight(&e), 1.0, BAND_SPLIT_TOL);
    /* The low-mode K is its own Base: its deviation is V's alone, the high V energy per token. */
    double vsum = 0;
    for (int j = 0; j < n; j++)
        vsum += dev[j] * (double)d;
    assert_float_equal(vsum / e.v_total, 1.0, BAND_SPLIT_TOL);
    free(k);
    free(v);
    free(dev);
    free(s);
    kvcap_dct_free(p);
}

/* ---- layer budgets -------------------------------------------------------------------------- */

static int lo_of(const int *cap, int lo, int l)
{
    return lo < cap[l] ? lo : cap[l];
}

/* Oracle, one stage: the active layers get clip(t·wt, floor, cap) with t found by bisection so
 * that everything sums to T (or all sit at cap when even that is short). */
static void oracle_stage(const double *wt, const unsigned char *act, const int *cap, int lo,
                         int L, double T, double *x)
{
    double rest = T;
    int any = 0;
    for (int l = 0; l < L; l++) {
        if (act[l])
            any = 1;
        else
            rest -= x[l];
    }
    if (!any)
        return;
    double hi = 1;
    for (;;) {
        double f = 0;
        for (int l = 0; l < L; l++)
            if (act[l])
                f += fmin(fmax(hi * wt[l], lo_of(cap, lo, l)), cap[l]);
        if (f >= rest || hi > 1e300)
            break;
        hi *= 2;
    }
    double a = 0, b = hi;
    for (int it = 0; it < 2100; it++) {
        double mid = 0.5 * (a + b), f = 0;
        if (mid <= a || mid >= b)
            break;
        for (int l = 0; l < L; l++)
            if (act[l])
                f += fmin(fmax(mid * wt[l], lo_of(cap, lo, l)), cap[l]);
        if (f < rest)
            a = mid;
        else
            b = mid;
    }
    for (int l = 0; l < L; l++)
        if (act[l])
            x[l] = fmin(fmax(b * wt[l], lo_of(cap, lo, l)), cap[l]);
}

/* The exact continuous shares the integer budgets must stay within one token of. */
static void oracle_budget(const double *w, const int *cap, int L, int lo, int64_t T, double *x)
{
    unsigned char act[64];
    double capw[64], sum = 0;
    int positive = 0;
    for (int l = 0; l < L; l++) {
        act[l] = w[l] > 0;
        positive |= act[l];
        x[l] = lo_of(cap, lo, l);
        capw[l] = cap[l];
    }
    oracle_stage(w, act, cap, lo, L, (double)T, x);
    for (int l = 0; l < L; l++)
        sum += x[l];
    if (!positive || sum < (double)T - 0.5) {
        for (int l = 0; l < L; l++)
            act[l] = w[l] == 0 && cap[l] > 0;
        oracle_stage(capw, act, cap, lo, L, (double)T, x);
    }
}

static void expect_budget(const double *w, const int *cap, int L, int lo, int64_t total,
                          const int *want)
{
    int got[16];
    assert_int_equal(kvcap_budget_allocate(w, cap, L, lo, total, got), KVCAP_OK);
    for (int l = 0; l < L; l++)
        if (got[l] != want[l])
            fail_msg("layer %d: budget %d, expected %d", l, got[l], want[l]);
}

static void test_budget_by_hand(void **state)
{
    (void)state;
    const int cap100[3] = {100, 100, 100};
    /* Plain proportion. */
    expect_budget((const double[]){1, 1, 2}, cap100, 3, 0, 100, (const int[]){25, 25, 50});
    /* Layer 2 would get 80 > cap 40: clipped, its excess split 30/30. */
    expect_budget((const double[]){1, 1, 8}, (const int[]){100, 100, 40}, 3, 0, 100,
                  (const int[]){30, 30, 40});
    /* Layer 0 would get 0.3 < lo 10: raised, the others give back 50 → 25/25. */
    expect_budget((const double[]){0.01, 1, 1}, cap100, 3, 10, 60, (const int[]){10, 25, 25});
    /* Both ends at once: 2·2.5 > cap 4 on layer 3, 0.025 < lo 2 on layer 0. */
    expect_budget((const double[]){0.01, 1, 1, 4}, (const int[]){50, 50, 50, 4}, 4, 2, 16,
                  (const int[]){2, 5, 5, 4});
    /* 10/3 each: one leftover unit, remainders tie, the lower index gets it. */
    expect_budget((const double[]){1, 1, 1}, (const int[]){10, 10, 10}, 3, 0, 10,
                  (const int[]){4, 3, 3});
    /* Largest remainder: shares 2.6, 3.9, 6.5 → floors 2, 3, 6 (11), the two units go to the
     * remainders .9 and .6. */
    expect_budget((const double[]){2, 3, 5}, cap100, 3, 0, 13, (const int[]){3, 4, 6});
    /* All weights zero: proportional to cap. */
    expect_budget((const double[]){0, 0}, (const int[]){10, 30}, 2, 0, 20, (const int[]){5, 15});
    /* Total above Σ cap is clamped to it; below Σ min(lo, cap) clamped up to that. */
    expect_budget((const double[]){1, 3}, (const int[]){10, 30}, 2, 0, 1000, (const int[]){10, 30});
    expect_budget((const double[]){1, 3}, (const int[]){10, 3}, 2, 5, -7, (const int[]){5, 3});
    expect_budget((const double[]){1, 3}, (const int[]){10, 3}, 2, 5, INT64_MIN,
                  (const int[]){5, 3});
    /* The only positive-weight layer fills its cap; the zero-weight one takes the rest. */
    expect_budget((const double[]){1, 0}, (const int[]){10, 50}, 2, 2, 30, (const int[]){10, 20});
    /* lo above a cap: that layer's floor is its cap. */
    expect_budget((const double[]){1, 1}, (const int[]){3, 100}, 2, 5, 50, (const int[]){3, 47});
    /* One layer takes everything it can. */
    expect_budget((const double[]){0.5}, (const int[]){70}, 1, 4, 33, (const int[]){33});
    /* Weights near DBL_MAX do not overflow their sum. */
    expect_budget((const double[]){1e308, 1e308}, (const int[]){100, 100}, 2, 0, 100,
                  (const int[]){50, 50});
    /* A weight that underflows next to the largest counts as zero: it only takes the rest. */
    expect_budget((const double[]){1e308, 5e-324}, (const int[]){10, 50}, 2, 0, 30,
                  (const int[]){10, 20});
}

static void test_budget_random(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 8);
    double w[64], x[64];
    int cap[64], b[64];
    int clipped_low = 0, clipped_high = 0;
    for (int it = 0; it < 3000; it++) {
        const int L = 1 + (int)kvcap_rng_below(&r, 40);
        const int wmode = (int)kvcap_rng_below(&r, 4);
        for (int l = 0; l < L; l++) {
            switch (wmode) {
            case 0: w[l] = kvcap_rng_uniform(&r); break;
            case 1: w[l] = kvcap_rng_below(&r, 3) ? kvcap_rng_uniform(&r) : 0.0; break;
            case 2: w[l] = 0.0; break;
            default: w[l] = exp(-30 + 35 * kvcap_rng_uniform(&r)); break; /* skewed */
            }
            cap[l] = kvcap_rng_below(&r, 10) ? (int)kvcap_rng_below(&r, 500) : 0;
        }
        const int lo = kvcap_rng_below(&r, 4) ? (int)kvcap_rng_below(&r, 60) : 0;
        int64_t sum_lo = 0, sum_cap = 0;
        for (int l = 0; l < L; l++) {
            sum_lo += lo_of(cap, lo, l);
            sum_cap += cap[l];
        }
        int64_t total;
        switch (kvcap_rng_below(&r, 5)) {
        case 0: total = sum_lo - (int64_t)kvcap_rng_below(&r, 20); break;
        case 1: total = sum_cap + (int64_t)kvcap_rng_below(&r, 20); break;
        case 2: total = sum_lo + (int64_t)kvcap_rng_below(&r, 5); break;
        case 3: total = sum_cap - (int64_t)kvcap_rng_below(&r, 5); break;
        default: total = (int64_t)kvcap_rng_below(&r, (uint64_t)sum_cap + 1); break;
        }
        int64_t T = total < sum_lo ? sum_lo : total > sum_cap ? sum_cap : total;
        assert_int_equal(kvcap_budget_allocate(w, cap, L, lo, total, b), KVCAP_OK);
        oracle_budget(w, cap, L, lo, T, x);
        int64_t sum = 0;
        for (int l = 0; l < L; l++) {
            sum += b[l];
            if (b[l] < lo_of(cap, lo, l) || b[l] > cap[l])
                fail_msg("case %d layer %d: %d outside [%d, %d]", it, l, b[l], lo_of(cap, lo, l),
                         cap[l]);
            if (!(fabs(b[l] - x[l]) < BUDGET_SHARE_TOL))
                fail_msg("case %d layer %d: budget %d, exact share %.6f", it, l, b[l], x[l]);
            clipped_low += w[l] > 0 && b[l] == lo && lo > 0 && b[l] < cap[l];
            clipped_high += w[l] > 0 && b[l] == cap[l] && cap[l] > 0 && T < sum_cap;
        }
        if (sum != T)
            fail_msg("case %d: Σ budget %lld, target %lld", it, (long long)sum, (long long)T);
    }
    /* The generator must actually exercise both clips. */
    assert_true(clipped_low > 100);
    assert_true(clipped_high > 100);
}

static void test_budget_errors(void **state)
{
    (void)state;
    double w[3] = {1, 2, 3};
    int cap[3] = {10, 10, 10}, b[3];
    assert_int_equal(kvcap_budget_allocate(NULL, cap, 3, 0, 10, b), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_budget_allocate(w, NULL, 3, 0, 10, b), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_budget_allocate(w, cap, 3, 0, 10, NULL), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_budget_allocate(w, cap, 0, 0, 10, b), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "L = 0"));
    assert_int_equal(kvcap_budget_allocate(w, cap, 3, -1, 10, b), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "lo = -1"));
    const double bad[3] = {-1.0, NAN, INFINITY};
    for (int i = 0; i < 3; i++) {
        w[1] = bad[i];
        assert_int_equal(kvcap_budget_allocate(w, cap, 3, 0, 10, b), KVCAP_ERR_INVALID_ARGUMENT);
        assert_non_null(strstr(kvcap_last_error(), "w[1]"));
    }
    w[1] = 2;
    cap[2] = -3;
    assert_int_equal(kvcap_budget_allocate(w, cap, 3, 0, 10, b), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "cap[2]"));
    cap[2] = 10;
    assert_int_equal(kvcap_budget_allocate(w, cap, 3, 0, 10, b), KVCAP_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_omega),
        cmocka_unit_test(test_deviation_vs_ref),
        cmocka_unit_test(test_deviation_outlier),
        cmocka_unit_test(test_layer_weight),
        cmocka_unit_test(test_budget_by_hand),
        cmocka_unit_test(test_budget_random),
        cmocka_unit_test(test_budget_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
