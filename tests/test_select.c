/* test_select.c — top-k selection (kernels/select.c): the quickselect against the O(n·k)
 * oracle on random, tied, sorted, reversed and NaN-holding scores, and the edge cases. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/rng.h"
#include "kernels/select.h"

/* Fast and reference must agree index for index (they share one total order). */
static void check_case(const float *s, int n, int keep)
{
    int *a = malloc(sizeof(int) * (size_t)(n + 1)), *b = malloc(sizeof(int) * (size_t)(n + 1));
    int *work = malloc(sizeof(int) * (size_t)(n + 1));
    assert_non_null(a), assert_non_null(b), assert_non_null(work);
    int na = kvcap_topk_indices(s, n, keep, a, work);
    int nb = kvcap_topk_indices_ref(s, n, keep, b);
    int expect = keep < 0 ? 0 : (keep > n ? n : keep);
    assert_int_equal(na, expect);
    assert_int_equal(nb, expect);
    assert_memory_equal(a, b, sizeof(int) * (size_t)expect);
    for (int i = 1; i < na; i++)
        assert_true(a[i - 1] < a[i]); /* ascending, distinct */
    /* nothing left out ranks above anything kept */
    float worst = INFINITY;
    for (int i = 0; i < na; i++)
        if (!isnan(s[a[i]]) && s[a[i]] < worst)
            worst = s[a[i]];
    for (int i = 0, j = 0; i < n; i++) {
        if (j < na && a[j] == i) {
            j++;
            continue;
        }
        if (!isnan(s[i]) && na > 0)
            assert_true(s[i] <= worst);
    }
    free(a), free(b), free(work);
}

static void test_random(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 7);
    for (int trial = 0; trial < 300; trial++) {
        int n = 1 + (int)kvcap_rng_below(&r, 700);
        float *s = malloc(sizeof(float) * (size_t)n);
        int levels = 1 + (int)kvcap_rng_below(&r, 5); /* few levels: many ties */
        for (int i = 0; i < n; i++)
            s[i] = trial % 2 ? (float)kvcap_rng_normal(&r)
                             : (float)kvcap_rng_below(&r, (uint64_t)levels);
        check_case(s, n, (int)kvcap_rng_below(&r, (uint64_t)n + 2));
        free(s);
    }
}

static void test_ordered_and_nan(void **state)
{
    (void)state;
    enum { N = 513 };
    float s[N];
    for (int i = 0; i < N; i++)
        s[i] = (float)i;
    check_case(s, N, 100); /* ascending */
    for (int i = 0; i < N; i++)
        s[i] = (float)(N - i);
    check_case(s, N, 100); /* descending */
    for (int i = 0; i < N; i++)
        s[i] = 1.0f;
    check_case(s, N, 17); /* all tied: the lowest indices */
    int idx[N], work[N];
    assert_int_equal(kvcap_topk_indices(s, N, 3, idx, work), 3);
    assert_int_equal(idx[0], 0), assert_int_equal(idx[2], 2);
    for (int i = 0; i < N; i++)
        s[i] = i % 3 ? NAN : (float)i;
    check_case(s, N, 200); /* NaN ranks last: every number is taken first */
    assert_int_equal(kvcap_topk_indices(s, N, 171, idx, work), 171);
    for (int i = 0; i < 171; i++)
        assert_int_equal(idx[i], 3 * i);
}

static void test_edges(void **state)
{
    (void)state;
    float s[3] = {1, 3, 2};
    int idx[3], work[3];
    assert_int_equal(kvcap_topk_indices(s, 3, 0, idx, work), 0);
    assert_int_equal(kvcap_topk_indices(s, 3, -1, idx, work), 0);
    assert_int_equal(kvcap_topk_indices(s, 0, 2, idx, work), 0);
    assert_int_equal(kvcap_topk_indices(s, 3, 9, idx, work), 3);
    assert_int_equal(kvcap_topk_indices(s, 3, 1, idx, work), 1);
    assert_int_equal(idx[0], 1);
    assert_int_equal(kvcap_topk_indices(s, 3, 2, idx, work), 2);
    assert_int_equal(idx[0], 1), assert_int_equal(idx[1], 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random),
        cmocka_unit_test(test_ordered_and_nan),
        cmocka_unit_test(test_edges),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
