/* test_dtype.c — element types (common/dtype.h): the bit-exact scalar conversions F16/BF16 <->
 * F32 on known values and exhaustively, the branchless f16 converter of the vectorised loops
 * against the readable one over all 65536 inputs (NaNs may come back quieted), array conversion and its errors, the storage
 * test, sizes and the oracles' scalar load. */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/dtype.h"
#include "tests/test_status.h"

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float f32_from(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- Element conversion ----------------------------------------------------------------- */

static int f16_is_nan(uint16_t h)
{
    return (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0;
}

static void test_f16_known_values(void **state)
{
    (void)state;
    static const struct {
        float f;
        uint16_t h;
    } to16[] = {
        {1.0f, 0x3c00},
        {-2.5f, 0xc100},
        {65504.0f, 0x7bff},
        {65519.99f, 0x7bff},
        {65520.0f, 0x7c00},          /* halfway to 65536, odd mantissa: rounds to inf */
        {-65520.0f, 0xfc00},
        {1e10f, 0x7c00},
        {0x1p-24f, 0x0001},          /* smallest subnormal */
        {0x1p-25f, 0x0000},          /* exactly half of it: tie to even (0) */
        {0x1.000002p-25f, 0x0001},   /* just above the tie */
        {0x1.8p-24f, 0x0002},        /* 1.5 units: tie to even (2) */
        {0x1.4p-23f, 0x0002},        /* 2.5 units: tie to even (2) */
        {0x1p-14f, 0x0400},          /* smallest normal */
        {0x1.ffcp-15f, 0x0400},      /* 1023.5 units rounds up into the normal range */
        {0x3ffp-24f, 0x03ff},        /* largest subnormal */
        {1.0f + 0x1p-11f, 0x3c00},   /* tie between 1 and 1+2^-10: even */
        {1.0f + 0x3p-11f, 0x3c02},   /* tie between 1+2^-10 and 1+2^-9: even */
        {2049.0f, 0x6800},           /* ties at integer spacing 2 */
        {2051.0f, 0x6802},
        {0.0f, 0x0000},
        {-0.0f, 0x8000},
        {INFINITY, 0x7c00},
        {-INFINITY, 0xfc00},
        {1e-30f, 0x0000},
        {-1e-30f, 0x8000},
    };
    for (size_t i = 0; i < sizeof to16 / sizeof to16[0]; i++) {
        uint16_t got = kvcap_f32_to_f16(to16[i].f);
        if (got != to16[i].h)
            fail_msg("f32_to_f16(%a) = 0x%04x, expected 0x%04x", (double)to16[i].f, got,
                     to16[i].h);
    }
    assert_true(f16_is_nan(kvcap_f32_to_f16(NAN)));
    assert_true(f16_is_nan(kvcap_f32_to_f16(-NAN)));
    assert_true(f16_is_nan(kvcap_f32_to_f16(f32_from(0x7f800001)))); /* sNaN, tiny payload */
    assert_true(f16_is_nan(kvcap_f32_to_f16(f32_from(0xff800001))));
    assert_int_equal(kvcap_f32_to_f16(f32_from(0xff800001)) & 0x8000, 0x8000);

    assert_true(kvcap_f16_to_f32(0x3c00) == 1.0f);
    assert_true(kvcap_f16_to_f32(0xc100) == -2.5f);
    assert_true(kvcap_f16_to_f32(0x7bff) == 65504.0f);
    assert_true(kvcap_f16_to_f32(0x0001) == 0x1p-24f);
    assert_true(kvcap_f16_to_f32(0x03ff) == 0x3ffp-24f);
    assert_true(kvcap_f16_to_f32(0x0400) == 0x1p-14f);
    assert_true(kvcap_f16_to_f32(0x7c00) == INFINITY);
    assert_true(kvcap_f16_to_f32(0xfc00) == -INFINITY);
    assert_true(isnan(kvcap_f16_to_f32(0x7e00)));
    assert_true(isnan(kvcap_f16_to_f32(0x7c01)));
    assert_int_equal(f32_bits(kvcap_f16_to_f32(0x8000)), 0x80000000u);
}

/* The f16 whose value is nearest to f (ties to even), by brute force over all finite f16 —
 * an oracle that shares nothing with the implementation. Values past 65520 are inf. */
static uint16_t f16_nearest_oracle(float f)
{
    double v = fabs((double)f);
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    if (v >= 65520.0)
        return sign | 0x7c00;
    uint16_t best = 0;
    double best_d = INFINITY;
    /* Binary search the monotone positive patterns 0..0x7bff, then look at neighbours. */
    unsigned lo = 0, hi = 0x7bff;
    while (lo < hi) {
        unsigned mid = (lo + hi + 1) / 2;
        if ((double)kvcap_f16_to_f32((uint16_t)mid) <= v)
            lo = mid;
        else
            hi = mid - 1;
    }
    for (unsigned c = lo; c <= lo + 1 && c <= 0x7bff; c++) {
        double d = fabs((double)kvcap_f16_to_f32((uint16_t)c) - v);
        if (d < best_d || (d == best_d && (c & 1) == 0)) {
            best = (uint16_t)c;
            best_d = d;
        }
    }
    return sign | best;
}

static void test_f16_exhaustive(void **state)
{
    (void)state;
    /* f16 -> f32 -> f16 is the identity on every non-NaN pattern; NaN stays NaN. */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kvcap_f16_to_f32((uint16_t)h);
        uint16_t back = kvcap_f32_to_f16(f);
        if (f16_is_nan((uint16_t)h)) {
            if (!isnan(f) || !f16_is_nan(back))
                fail_msg("NaN 0x%04x -> %a -> 0x%04x", h, (double)f, back);
        } else if (back != h) {
            fail_msg("0x%04x -> %a -> 0x%04x", h, (double)f, back);
        }
    }
    /* Random f32 in the f16 range (and a little past it) against the oracle. */
    uint32_t s = 12345;
    for (int i = 0; i < 200000; i++) {
        s = s * 1664525u + 1013904223u;
        uint32_t bits = (s & 0x80000000u) | (0x32000000u + (s >> 1) % (0x47900000u - 0x32000000u));
        float f = f32_from(bits);
        uint16_t got = kvcap_f32_to_f16(f), want = f16_nearest_oracle(f);
        if (got != want)
            fail_msg("f32_to_f16(%a) = 0x%04x, oracle 0x%04x", (double)f, got, want);
    }
}

static void test_bf16(void **state)
{
    (void)state;
    static const struct {
        uint32_t f;
        uint16_t b;
    } cases[] = {
        {0x3f800000, 0x3f80}, /* 1.0 */
        {0xc0200000, 0xc020}, /* -2.5 */
        {0x3f808000, 0x3f80}, /* tie, even stays */
        {0x3f818000, 0x3f82}, /* tie, odd rounds up */
        {0x3f808001, 0x3f81}, /* above the tie */
        {0x3f807fff, 0x3f80}, /* below the tie */
        {0x7f7fffff, 0x7f80}, /* FLT_MAX rounds to inf */
        {0x7f7f7fff, 0x7f7f}, /* largest that stays finite */
        {0x7f800000, 0x7f80}, /* inf */
        {0xff800000, 0xff80}, /* -inf */
        {0x80000000, 0x8000}, /* -0 */
        {0x00000001, 0x0000}, /* tiniest subnormal rounds to 0 */
        {0x00018000, 0x0002}, /* subnormal tie to even */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = kvcap_f32_to_bf16(f32_from(cases[i].f));
        if (got != cases[i].b)
            fail_msg("f32_to_bf16(0x%08x) = 0x%04x, expected 0x%04x", cases[i].f, got,
                     cases[i].b);
    }
    /* NaN stays NaN and becomes quiet, also when only low payload bits were set. */
    uint16_t n1 = kvcap_f32_to_bf16(f32_from(0x7f800001));
    uint16_t n2 = kvcap_f32_to_bf16(f32_from(0xff800001));
    assert_int_equal(n1, 0x7fc0);
    assert_int_equal(n2, 0xffc0);
    assert_int_equal(kvcap_f32_to_bf16(NAN) & 0x7fc0, 0x7fc0);
    assert_true(kvcap_bf16_to_f32(0x3f80) == 1.0f);
    assert_true(kvcap_bf16_to_f32(0xc020) == -2.5f);
    assert_true(isnan(kvcap_bf16_to_f32(0x7fc0)));
    for (uint32_t b = 0; b < 65536; b++) {
        float f = kvcap_bf16_to_f32((uint16_t)b);
        uint16_t back = kvcap_f32_to_bf16(f);
        int is_nan = (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0;
        if (is_nan ? !(isnan(f) && (back & 0x7fc0) == 0x7fc0) : back != b)
            fail_msg("bf16 0x%04x -> %a -> 0x%04x", b, (double)f, back);
    }
}

static void test_convert_arrays(void **state)
{
    (void)state;
    const float src[5] = {1.0f, -2.5f, 0.1f, 65504.0f, -0.0f};
    float back[5];
    unsigned char buf[40];

    expect_ok(kvcap_convert_from_f32(KVCAP_DTYPE_F16, src, 5, buf));
    uint16_t h[5];
    memcpy(h, buf, sizeof h);
    assert_int_equal(h[0], 0x3c00);
    assert_int_equal(h[1], 0xc100);
    assert_int_equal(h[2], 0x2e66); /* 0.1 -> 0.0999755859375 */
    assert_int_equal(h[3], 0x7bff);
    assert_int_equal(h[4], 0x8000);
    expect_ok(kvcap_convert_to_f32(KVCAP_DTYPE_F16, buf, 5, back));
    assert_true(back[0] == 1.0f && back[1] == -2.5f && back[3] == 65504.0f);
    assert_true(fabsf(back[2] - 0.1f) < 1e-4f);

    expect_ok(kvcap_convert_from_f32(KVCAP_DTYPE_BF16, src, 5, buf));
    expect_ok(kvcap_convert_to_f32(KVCAP_DTYPE_BF16, buf, 5, back));
    assert_true(back[0] == 1.0f && back[1] == -2.5f && back[3] == 65536.0f);

    expect_ok(kvcap_convert_from_f32(KVCAP_DTYPE_F64, src, 5, buf));
    double d[5];
    memcpy(d, buf, sizeof d);
    assert_true(d[2] == (double)0.1f);
    expect_ok(kvcap_convert_to_f32(KVCAP_DTYPE_F64, buf, 5, back));
    assert_memory_equal(back, src, sizeof src);

    expect_ok(kvcap_convert_from_f32(KVCAP_DTYPE_F32, src, 5, buf));
    expect_ok(kvcap_convert_to_f32(KVCAP_DTYPE_F32, buf, 5, back));
    assert_memory_equal(back, src, sizeof src);

    /* Unaligned buffers are fine. */
    expect_ok(kvcap_convert_from_f32(KVCAP_DTYPE_F16, src, 5, buf + 1));
    expect_ok(kvcap_convert_to_f32(KVCAP_DTYPE_F16, buf + 1, 5, back));
    assert_true(back[1] == -2.5f);

    expect_error(kvcap_convert_to_f32(KVCAP_DTYPE_I32, buf, 5, back),
                 KVCAP_ERR_INVALID_ARGUMENT, "I32", "not a float type");
    expect_error(kvcap_convert_from_f32(KVCAP_DTYPE_U8, src, 5, buf),
                 KVCAP_ERR_INVALID_ARGUMENT, "U8", "not a float type");
    expect_error(kvcap_convert_to_f32(KVCAP_DTYPE_F16, NULL, 5, back),
                 KVCAP_ERR_INVALID_ARGUMENT, "src", NULL);
    expect_ok(kvcap_convert_to_f32(KVCAP_DTYPE_F16, NULL, 0, NULL));
}

/* ---- The fast converter, the storage test, sizes, the scalar load ------------------------ */

static void test_f16_fast_matches_exact(void **state)
{
    (void)state;
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        uint32_t want = kvcap_f32_bits(kvcap_f16_to_f32(h));
        uint32_t got = kvcap_f32_bits(kvcap_f16_to_f32_fast(h));
        /* a NaN stays a NaN of the same sign; the fast form's multiply may set the quiet bit */
        if ((want & 0x7fffffffu) > 0x7f800000u)
            want |= 0x00400000u, got |= 0x00400000u;
        if (got != want)
            fail_msg("f16 0x%04x: fast 0x%08x, exact 0x%08x", (unsigned)h, (unsigned)got,
                     (unsigned)want);
    }
}

static void test_storage_and_sizes(void **state)
{
    (void)state;
    assert_true(kvcap_dtype_is_storage(KVCAP_DTYPE_F32));
    assert_true(kvcap_dtype_is_storage(KVCAP_DTYPE_F16));
    assert_true(kvcap_dtype_is_storage(KVCAP_DTYPE_BF16));
    assert_false(kvcap_dtype_is_storage(KVCAP_DTYPE_F64));
    assert_false(kvcap_dtype_is_storage(KVCAP_DTYPE_I32));
    assert_false(kvcap_dtype_is_storage(KVCAP_DTYPE_U8));
    assert_false(kvcap_dtype_is_storage((enum kvcap_dtype)77));
    assert_int_equal(kvcap_dtype_size(KVCAP_DTYPE_F32), 4);
    assert_int_equal(kvcap_dtype_size(KVCAP_DTYPE_F16), 2);
    assert_int_equal(kvcap_dtype_size(KVCAP_DTYPE_BF16), 2);
    assert_int_equal(kvcap_dtype_size(KVCAP_DTYPE_F64), 8);
    assert_int_equal(kvcap_dtype_size(KVCAP_DTYPE_I32), 4);
    assert_int_equal(kvcap_dtype_size(KVCAP_DTYPE_U8), 1);
    enum kvcap_dtype d = KVCAP_DTYPE_U8;
    assert_true(kvcap_dtype_parse("bf16", &d));
    assert_int_equal(d, KVCAP_DTYPE_BF16);
    assert_false(kvcap_dtype_parse("fp8", &d));
    assert_int_equal(d, KVCAP_DTYPE_BF16); /* untouched on failure */
    assert_string_equal(kvcap_dtype_name(KVCAP_DTYPE_F16), "F16");
}

static void test_load_elem(void **state)
{
    (void)state;
    const float xs[3] = {1.5f, -0.25f, 65504.0f};
    uint16_t h[3], b[3];
    for (int i = 0; i < 3; i++) {
        h[i] = kvcap_f32_to_f16(xs[i]);
        b[i] = kvcap_f32_to_bf16(xs[i]);
    }
    for (size_t i = 0; i < 3; i++) {
        assert_true(kvcap_load_elem(KVCAP_DTYPE_F32, xs, i) == (double)xs[i]);
        assert_true(kvcap_load_elem(KVCAP_DTYPE_F16, h, i) == (double)kvcap_f16_to_f32(h[i]));
        assert_true(kvcap_load_elem(KVCAP_DTYPE_BF16, b, i) == (double)kvcap_bf16_to_f32(b[i]));
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_known_values),
        cmocka_unit_test(test_f16_exhaustive),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_convert_arrays),
        cmocka_unit_test(test_f16_fast_matches_exact),
        cmocka_unit_test(test_storage_and_sizes),
        cmocka_unit_test(test_load_elem),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
