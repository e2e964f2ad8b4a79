/* test_train_util.h — what the key-training tests (CPU and device) share: low-rank data, the
 * relative error they state their tolerances in, and the check that an error names its cause.
 * Include after <cmocka.h>. */
#ifndef KVCAP_TEST_TRAIN_UTIL_H
#define KVCAP_TEST_TRAIN_UTIL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/internal.h"
#include "common/rng.h"
#include "tests/test_numeric.h"

/* X = A S + noise (m x n, leading dimension ld >= n): A m x k given, S k x n standard normal. */
static inline float *low_rank_data(const double *a, int m, int k, size_t n, size_t ld,
                                   double noise, struct kvcap_rng *rng)
{
    float *x = alloc_f((size_t)m * ld);
    double *s = calloc((size_t)k, sizeof *s);
    assert_non_null(s);
    for (size_t c = 0; c < n; c++) {
        for (int t = 0; t < k; t++)
            s[t] = kvcap_rng_normal(rng);
        for (int j = 0; j < m; j++) {
            double v = noise * kvcap_rng_normal(rng);
            for (int t = 0; t < k; t++)
                v += a[(size_t)j * k + t] * s[t];
            x[(size_t)j * ld + c] = (float)v;
        }
    }
    free(s);
    return x;
}

/* ‖a − b‖ / ‖b‖ in double; NaN anywhere, or b = 0, gives a value no tolerance accepts
 * (so `!(x <= tol)` rejects it). */
static inline double rel_diff(const float *a, const float *b, size_t n)
{
    double d = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        e += (double)b[i] * b[i];
    }
    return sqrt(d / e);
}

static inline void assert_error_names(const char *needle)
{
    const char *msg = kvcap_last_error();
    if (!strstr(msg, needle))
        fail_msg("error message does not name %s: %s", needle, msg);
}

#endif
