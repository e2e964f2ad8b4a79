/* test_numeric.h — what the kernel tests share for comparing floats: zeroed buffers that fail
 * the test instead of returning NULL, uniform random fill, relative error in double, a
 * closeness assertion that also rejects non-finite values, and attention partials with their
 * own storage. Include after <cmocka.h>. */
#ifndef KVCAP_TEST_NUMERIC_H
#define KVCAP_TEST_NUMERIC_H

#include <math.h>
#include <stdlib.h>

#include "kernels/attention.h"
#include "common/rng.h"

/* Zeroed floats (never NULL: a failed allocation fails the test). */
static inline float *alloc_f(size_t n)
{
    float *p = calloc(n ? n : 1, sizeof(float));
    assert_non_null(p);
    return p;
}

/* Uniform with the given mean and standard deviation (cheaper than normal draws, which keeps
 * the sanitizer build fast; the kernels do not care about the distribution). */
static inline void fill_random(struct kvcap_rng *r, float *x, size_t n, double mean, double sd)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(mean + sd * 1.7320508075688772 * (2.0 * kvcap_rng_uniform(r) - 1.0));
}

/* ‖a − b‖ / ‖b‖ in double (‖b‖ = 0: the absolute error). */
static inline double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double e = (double)a[i] - (double)b[i];
        num += e * e;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Every element of got finite, and rel_err(got, want) <= tol. */
static inline void assert_close(const float *got, const float *want, size_t n, double tol,
                                const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(got[i]))
            fail_msg("%s: element %zu is %g", what, i, (double)got[i]);
    double e = rel_err(got, want, n);
    if (!(e <= tol))
        fail_msg("%s: relative error %.3g > %.3g", what, e, tol);
}

/* An empty attention partial with its own storage (free buf). */
struct part {
    float *buf;
    struct kvcap_partial p;
};

static inline struct part part_new(int nq, int d)
{
    struct part s;
    s.buf = malloc(sizeof(float) * (size_t)nq * (size_t)(d + 2));
    assert_non_null(s.buf);
    s.p.mx = s.buf;
    s.p.sum = s.buf + nq;
    s.p.o = s.buf + 2 * nq;
    kvcap_partial_reset(s.p, nq, d);
    return s;
}

/* Scratch with a NaN guard after it: a kernel writing past its stated size shows up. */
static inline float *scratch_new(size_t floats)
{
    float *s = alloc_f(floats + 8);
    for (int i = 0; i < 8; i++)
        s[floats + i] = NAN;
    return s;
}

static inline void scratch_check(const float *s, size_t floats)
{
    for (int i = 0; i < 8; i++)
        assert_true(isnan(s[floats + i]));
}

#ifdef KVCAP_DCT_H /* the DCT's tests (test_dct.c, test_flashcache.c) */
static inline struct kvcap_dct *plan_new(int n)
{
    struct kvcap_dct *p = NULL;
    assert_int_equal(kvcap_dct_create(n, &p), KVCAP_OK);
    assert_non_null(p);
    assert_int_equal(kvcap_dct_length(p), n);
    return p;
}
#endif

#endif
