/* test_load.c — the f32 loader and storer (kernels/load.h): the bulk loader, SIMD and portable,
 * against the bit-exact converters of common/dtype.h on every 16-bit pattern, F32 copied as is;
 * the bulk storer against them on every rounding case. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/load.h"
#include "common/dtype.h"

/* kvcap_load_f32 agrees with the bit-exact converters on every 16-bit pattern, both paths. */
static void test_load_f32(void **state)
{
    (void)state;
    uint16_t *all = malloc(sizeof(uint16_t) * 65536);
    float *got = malloc(sizeof(float) * 65536), *want = malloc(sizeof(float) * 65536);
    assert_non_null(all);
    assert_non_null(got);
    assert_non_null(want);
    for (uint32_t i = 0; i < 65536; i++)
        all[i] = (uint16_t)i;
    static const enum kvcap_dtype types[] = {KVCAP_DTYPE_F16, KVCAP_DTYPE_BF16, 0};
    for (int simd = 0; simd < 2; simd++) {
        kvcap_kernels_set_simd(simd);
        for (int t = 0; t < 2; t++) {
            assert_int_equal(kvcap_convert_to_f32(types[t], all, 65536, want), KVCAP_OK);
            /* odd start and length exercise the vector tails */
            kvcap_load_f32(types[t], all, 1, got);
            kvcap_load_f32(types[t], all + 1, 65535, got + 1);
            for (uint32_t i = 0; i < 65536; i++) {
                if (isnan(want[i])) {
                    assert_true(isnan(got[i]));
                    continue;
                }
                uint32_t a, b;
                memcpy(&a, &got[i], 4);
                memcpy(&b, &want[i], 4);
                if (a != b)
                    fail_msg("%s 0x%04x: got %a want %a (simd %d)", kvcap_dtype_name(types[t]),
                             i, (double)got[i], (double)want[i], simd);
            }
        }
        float src[37], dst[37];
        for (int i = 0; i < 37; i++)
            src[i] = (float)i - 18.5f;
        kvcap_load_f32(KVCAP_DTYPE_F32, src, 37, dst);
        assert_memory_equal(src, dst, sizeof src);
    }
    kvcap_kernels_set_simd(1);
    free(all);
    free(got);
    free(want);
}

/* kvcap_store_f32 gives kvcap_convert_from_f32's bits, both paths: every f32 near each f16
 * value and halfway between neighbours (ties to even), overflow, subnormals, NaN and infinity,
 * zeros of both signs, at odd starts and lengths. */
static void test_store_f32(void **state)
{
    (void)state;
    enum { N = 65536 * 6 };
    float *src = malloc(sizeof(float) * N);
    uint16_t *got = malloc(sizeof(uint16_t) * N), *want = malloc(sizeof(uint16_t) * N);
    assert_non_null(src);
    assert_non_null(got);
    assert_non_null(want);
    for (uint32_t i = 0; i < 65536; i++) {
        /* the f16 value widened, and its bit pattern moved to each rounding boundary */
        uint32_t x = (i & 0x8000u) << 16 | (i & 0x7fffu) << 13;
        uint32_t around[6] = {x + 0x38000000u, x + 0x38000000u + 0x1000u,
                              x + 0x38000000u + 0xfffu, x + 0x38000000u + 0x1001u, x, x + 0x1000u};
        for (int k = 0; k < 6; k++)
            memcpy(&src[(size_t)i * 6 + k], &around[k], 4);
    }
    static const uint32_t special[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
                                       0xffbfe001u, 0x477ff000u, 0x477fefffu, 0x80000000u,
                                       0x00000001u, 0x33000000u, 0x33000001u};
    memcpy(src + 1000, special, sizeof special);
    static const enum kvcap_dtype types[] = {KVCAP_DTYPE_F16, KVCAP_DTYPE_BF16};
    for (int simd = 0; simd < 2; simd++) {
        kvcap_kernels_set_simd(simd);
        for (int t = 0; t < 2; t++) {
            assert_int_equal(kvcap_convert_from_f32(types[t], src, N, want), KVCAP_OK);
            kvcap_store_f32(types[t], src, 3, got);
            kvcap_store_f32(types[t], src + 3, N - 3, got + 3);
            for (size_t i = 0; i < N; i++)
                if (got[i] != want[i]) {
                    uint32_t b;
                    memcpy(&b, &src[i], 4);
                    fail_msg("%s of 0x%08x: got 0x%04x want 0x%04x (simd %d)",
                             kvcap_dtype_name(types[t]), b, got[i], want[i], simd);
                }
        }
        float f32[37];
        kvcap_store_f32(KVCAP_DTYPE_F32, src + 100, 37, f32);
        assert_memory_equal(src + 100, f32, sizeof f32);
    }
    kvcap_kernels_set_simd(1);
    free(src);
    free(got);
    free(want);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_load_f32),
        cmocka_unit_test(test_store_f32),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
