/* test_expected.c — Expected Attention's scoring against its oracle: the fast path vs the double
 * _ref over pairings, partial rope_dim, no RoPE, G and sizes; the averaged rotation against its
 * definition; a case worked by hand; the argument checks. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/rng.h"
#include "kernels/expected.h"

/* Fast vs _ref: f32 sums of n·d products for the covariance and d² for each quadratic form,
 * then exps of scores of magnitude ~10: relative error measured below 2e-5; 2e-4 leaves margin
 * without hiding a missing rotation or covariance term (those move scores by ~1e-1). */
#define SCORE_REL_TOL 2e-4
/* The rotation: n_future terms of cos/sin summed in double. */
#define ROT_ABS_TOL 1e-12

static struct kvcap_model_geometry geom(int d, int rope_dim, enum kvcap_rope_pairing pairing,
                                        enum kvcap_rope_type type)
{
    struct kvcap_model_geometry g = {.name = "t", .n_layers = 1, .n_q_heads = 4, .n_kv_heads = 1,
                                     .head_dim = d, .rope_type = type, .rope_pairing = pairing,
                                     .rope_theta = 1e4, .rope_dim = rope_dim};
    return g;
}

static void fill(struct kvcap_rng *r, float *x, size_t n, double scale, double shift)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(shift + scale * kvcap_rng_normal(r));
}

static void check(const struct kvcap_model_geometry *g, int n, int G, int m, uint64_t seed)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, seed);
    const int d = g->head_dim;
    const size_t q_stride = (size_t)G * d + 3;
    float *q = malloc(sizeof(float) * (size_t)n * q_stride);
    float *k = malloc(sizeof(float) * (size_t)m * d), *v = malloc(sizeof(float) * (size_t)m * d);
    float *got = malloc(sizeof(float) * (size_t)m), *want = malloc(sizeof(float) * (size_t)m);
    float *scratch = malloc(sizeof(float) * kvcap_expected_scratch_floats(n, m, d));
    fill(&r, q, (size_t)n * q_stride, 1.0, 0.3); /* a mean away from 0 */
    fill(&r, k, (size_t)m * d, 1.0, 0.0);
    fill(&r, v, (size_t)m * d, 1.0, 0.0);
    double cs[256];
    assert_int_equal(kvcap_expected_rotation(g, 300, 512, cs), KVCAP_OK);
    const float scale = 1.0f / sqrtf((float)d);
    assert_int_equal(kvcap_expected_head_ref(g, q, q_stride, n, G, cs, k, v, m, scale, want),
                     KVCAP_OK);
    assert_int_equal(kvcap_expected_head(g, q, q_stride, n, G, cs, k, v, m, scale, got, scratch),
                     KVCAP_OK);
    for (int j = 0; j < m; j++)
        if (!(fabs((double)got[j] - want[j]) <= SCORE_REL_TOL * fabs(want[j]) + 1e-12))
            fail_msg("d=%d rope_dim=%d G=%d n=%d m=%d: score[%d] %.9g, oracle %.9g", d,
                     g->rope_dim, G, n, m, j, (double)got[j], (double)want[j]);
    free(q), free(k), free(v), free(got), free(want), free(scratch);
}

static void test_fast_matches_ref(void **state)
{
    (void)state;
    struct kvcap_model_geometry g1 = geom(64, 0, KVCAP_ROPE_PAIRING_HALF, KVCAP_ROPE_ROPE);
    struct kvcap_model_geometry g2 = geom(64, 0, KVCAP_ROPE_PAIRING_ADJACENT, KVCAP_ROPE_ROPE);
    struct kvcap_model_geometry g3 = geom(128, 32, KVCAP_ROPE_PAIRING_HALF, KVCAP_ROPE_ROPE);
    struct kvcap_model_geometry g4 = geom(64, 0, KVCAP_ROPE_PAIRING_HALF, KVCAP_ROPE_NONE);
    check(&g1, 40, 3, 100, 1);
    check(&g1, 1, 1, 1, 2);
    check(&g2, 77, 7, 33, 3);
    check(&g3, 20, 2, 257, 4);
    check(&g4, 50, 4, 64, 5);
}

/* The mean rotation is the mean of the rotations: n_future = 1 is the rotation itself. */
static void test_rotation(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geom(64, 0, KVCAP_ROPE_PAIRING_HALF, KVCAP_ROPE_ROPE);
    double cs[64], cs1[64];
    assert_int_equal(kvcap_expected_rotation(&g, 17, 1, cs1), KVCAP_OK);
    for (int i = 0; i < 32; i++) {
        double w = pow(1e4, -2.0 * i / 64);
        assert_true(fabs(cs1[2 * i] - cos(17 * w)) < ROT_ABS_TOL);
        assert_true(fabs(cs1[2 * i + 1] - sin(17 * w)) < ROT_ABS_TOL);
    }
    assert_int_equal(kvcap_expected_rotation(&g, 10, 3, cs), KVCAP_OK);
    double w = pow(1e4, -2.0 * 5 / 64);
    assert_true(fabs(cs[10] - (cos(10 * w) + cos(11 * w) + cos(12 * w)) / 3) < ROT_ABS_TOL);
    /* M-RoPE is refused by name, bad arguments too */
    g.rope_type = KVCAP_ROPE_MROPE;
    assert_int_equal(kvcap_expected_rotation(&g, 10, 3, cs), KVCAP_ERR_UNSUPPORTED);
    g.rope_type = KVCAP_ROPE_ROPE;
    assert_int_equal(kvcap_expected_rotation(&g, 10, 0, cs), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_expected_rotation(&g, -1, 3, cs), KVCAP_ERR_INVALID_ARGUMENT);
}

/* No RoPE, one query head, two equal queries (covariance 0): z_j = scale q·k_j exactly, so the
 * scores are softmax(q·k) times the values' norms. */
static void test_by_hand(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geom(64, 0, KVCAP_ROPE_PAIRING_HALF, KVCAP_ROPE_NONE);
    float q[2 * 64] = {0}, k[2 * 64] = {0}, v[2 * 64] = {0}, s[2], sr[2];
    q[0] = q[64] = 2.0f;       /* both queries 2 e0 */
    k[0] = 1.0f;               /* key 0: e0, score 2 */
    k[64 + 1] = 1.0f;          /* key 1: e1, score 0 */
    v[0] = 3.0f, v[64] = 4.0f; /* norms 3 and 4 */
    double cs[64];
    float *scratch = malloc(sizeof(float) * kvcap_expected_scratch_floats(2, 2, 64));
    assert_int_equal(kvcap_expected_rotation(&g, 0, 8, cs), KVCAP_OK);
    assert_int_equal(kvcap_expected_head(&g, q, 64, 2, 1, cs, k, v, 2, 1.0f, s, scratch), KVCAP_OK);
    assert_int_equal(kvcap_expected_head_ref(&g, q, 64, 2, 1, cs, k, v, 2, 1.0f, sr), KVCAP_OK);
    double p0 = exp(2.0) / (exp(2.0) + 1.0);
    assert_true(fabs(s[0] - 3 * p0) < 1e-5 && fabs(sr[0] - 3 * p0) < 1e-6);
    assert_true(fabs(s[1] - 4 * (1 - p0)) < 1e-5 && fabs(sr[1] - 4 * (1 - p0)) < 1e-6);
    free(scratch);
}

static void test_arguments(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geom(64, 0, KVCAP_ROPE_PAIRING_HALF, KVCAP_ROPE_ROPE);
    float x[64] = {0}, s[1], scratch[1024];
    double cs[64] = {0};
    assert_int_equal(kvcap_expected_head(&g, NULL, 64, 1, 1, cs, x, x, 1, 1.0f, s, scratch),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_expected_head(&g, x, 64, 0, 1, cs, x, x, 1, 1.0f, s, scratch),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_expected_head(&g, x, 64, 1, 1, cs, x, x, 1, NAN, s, scratch),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_expected_head(&g, x, 64, 1, 1, cs, x, x, 1, 1.0f, s, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_expected_head_ref(&g, x, 64, 1, 1, cs, x, x, 0, 1.0f, s),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_expected_scratch_floats(0, 1, 64), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fast_matches_ref),
        cmocka_unit_test(test_rotation),
        cmocka_unit_test(test_by_hand),
        cmocka_unit_test(test_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
