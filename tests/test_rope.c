/* test_rope.c — rotary position embedding (kernels/rope.h): the fast rotation against the
 * double-angle oracle for both pairings and a partial rotary dimension, R(-p) undoing R(p), and
 * the property offset normalisation rests on: (R(a) q)·(R(b) k) depends on a − b only; no
 * rotation without RoPE, and rows at any stride. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/rope.h"
#include "tests/test_util.h"

/* f32 rotations by positions up to ~5000: angle rounding in float costs ~1e-6 relative. */
#define ROPE_TOL 2e-5

static void test_rope_fast_matches_ref_and_inverts(void **state)
{
    (void)state;
    enum { ROWS = 5, D = 128 };
    for (int pairing = 0; pairing < 2; pairing++) {
        struct kvcap_model_geometry g = test_tiny_geometry((enum kvcap_rope_pairing)pairing);
        g.head_dim = D;
        g.rope_dim = 96; /* partial rotary: the last 32 channels stay put */
        float x[ROWS * D], a[ROWS * D], b[ROWS * D];
        for (int i = 0; i < ROWS * D; i++)
            x[i] = (float)sin(0.37 * i + 1.0);
        memcpy(a, x, sizeof x);
        memcpy(b, x, sizeof x);
        kvcap_rope_rotate_ref(&g, a, ROWS, D, 4321.0);
        kvcap_rope_rotate(&g, b, ROWS, D, 4321.0);
        for (int i = 0; i < ROWS * D; i++)
            assert_true(fabsf(a[i] - b[i]) <= ROPE_TOL);
        for (int r = 0; r < ROWS; r++)
            for (int c = 96; c < D; c++)
                assert_true(a[r * D + c] == x[r * D + c]);
        kvcap_rope_rotate(&g, b, ROWS, D, -4321.0);
        for (int i = 0; i < ROWS * D; i++)
            assert_true(fabsf(b[i] - x[i]) <= ROPE_TOL);
    }
}

/* The property offset normalisation relies on: (R(a) q).(R(b) k) depends on a - b only. */
static void test_rope_relative(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = test_tiny_geometry(KVCAP_ROPE_PAIRING_HALF);
    float q[64], k[64], q1[64], k1[64], q2[64], k2[64];
    for (int i = 0; i < 64; i++) {
        q[i] = (float)cos(0.1 * i);
        k[i] = (float)sin(0.3 * i + 0.2);
    }
    memcpy(q1, q, sizeof q);
    memcpy(k1, k, sizeof k);
    memcpy(q2, q, sizeof q);
    memcpy(k2, k, sizeof k);
    kvcap_rope_rotate_ref(&g, q1, 1, 64, 1000.0);
    kvcap_rope_rotate_ref(&g, k1, 1, 64, 990.0);
    kvcap_rope_rotate_ref(&g, q2, 1, 64, 17.0);
    kvcap_rope_rotate_ref(&g, k2, 1, 64, 7.0);
    double d1 = 0, d2 = 0;
    for (int i = 0; i < 64; i++) {
        d1 += (double)q1[i] * k1[i];
        d2 += (double)q2[i] * k2[i];
    }
    assert_true(fabs(d1 - d2) <= 1e-4 * (fabs(d1) + 1.0));
}

static void test_rope_none_and_stride(void **state)
{
    (void)state;
    enum { ROWS = 3, D = 64, STRIDE = D + 5 };
    struct kvcap_model_geometry g = test_tiny_geometry(KVCAP_ROPE_PAIRING_ADJACENT);
    float packed[ROWS * D], strided[ROWS * STRIDE], x[ROWS * STRIDE];
    for (int i = 0; i < ROWS * STRIDE; i++)
        x[i] = (float)cos(0.21 * i - 0.5);
    g.rope_type = KVCAP_ROPE_NONE;
    memcpy(strided, x, sizeof x);
    kvcap_rope_rotate(&g, strided, ROWS, STRIDE, 321.0);
    assert_memory_equal(strided, x, sizeof x);
    kvcap_rope_rotate_ref(&g, strided, ROWS, STRIDE, 321.0);
    assert_memory_equal(strided, x, sizeof x);
    g.rope_type = KVCAP_ROPE_ROPE;
    for (int fast = 0; fast < 2; fast++) {
        memcpy(strided, x, sizeof x);
        for (int r = 0; r < ROWS; r++)
            memcpy(packed + r * D, x + r * STRIDE, sizeof(float) * D);
        if (fast) {
            kvcap_rope_rotate(&g, packed, ROWS, D, 321.0);
            kvcap_rope_rotate(&g, strided, ROWS, STRIDE, 321.0);
        } else {
            kvcap_rope_rotate_ref(&g, packed, ROWS, D, 321.0);
            kvcap_rope_rotate_ref(&g, strided, ROWS, STRIDE, 321.0);
        }
        for (int r = 0; r < ROWS; r++) {
            assert_memory_equal(strided + r * STRIDE, packed + r * D, sizeof(float) * D);
            for (int c = D; c < STRIDE; c++)
                assert_true(strided[r * STRIDE + c] == x[r * STRIDE + c]);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rope_fast_matches_ref_and_inverts),
        cmocka_unit_test(test_rope_relative),
        cmocka_unit_test(test_rope_none_and_stride),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
