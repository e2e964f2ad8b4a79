/* test_load.c — the f32 loader (kernels/load.h): the bulk loader, SIMD and portable, against the
 * bit-exact converters of formats/safetensors.h on every 16-bit pattern, and F32 copied as is. */
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_load_f32),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
