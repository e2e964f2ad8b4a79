/* dtype.c — element types: sizes, the storage test, the oracles' scalar load, and conversion
 * between the float types of kvcap files (F16, BF16, F64) and the F32 every kernel computes in.
 * Bit-exact and independent of the FPU rounding mode for the 16-bit formats: round to nearest
 * even, subnormals exact, NaN stays NaN. Names and parsing are in names.c's one table. */
#include <string.h>

#include "common/dtype.h"
#include "common/internal.h"

size_t kvcap_dtype_size(enum kvcap_dtype dtype)
{
    switch (dtype) {
    case KVCAP_DTYPE_F32: return 4;
    case KVCAP_DTYPE_F16: return 2;
    case KVCAP_DTYPE_BF16: return 2;
    case KVCAP_DTYPE_F64: return 8;
    case KVCAP_DTYPE_I32: return 4;
    case KVCAP_DTYPE_U8: return 1;
    }
    return 0;
}

int kvcap_dtype_is_storage(enum kvcap_dtype d)
{
    return d == KVCAP_DTYPE_F32 || d == KVCAP_DTYPE_F16 || d == KVCAP_DTYPE_BF16;
}

double kvcap_load_elem(enum kvcap_dtype dtype, const void *base, size_t i)
{
    const unsigned char *b = base;
    uint16_t h;
    float f;
    switch (dtype) {
    case KVCAP_DTYPE_F16:
        memcpy(&h, b + 2 * i, 2);
        return kvcap_f16_to_f32(h);
    case KVCAP_DTYPE_BF16:
        memcpy(&h, b + 2 * i, 2);
        return kvcap_bf16_to_f32(h);
    default:
        memcpy(&f, b + 4 * i, 4);
        return f;
    }
}

float kvcap_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) /* inf, or NaN with its payload (the quiet bit maps to the quiet bit) */
        return kvcap_bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in f32 */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    return kvcap_bits_f32(sign | ((exp + (127 - 15)) << 23) | (mant << 13));
}

/* Shifts `v` right by `s` (1..31) rounding to nearest, ties to even. */
static inline uint32_t shift_rne(uint32_t v, unsigned s)
{
    uint32_t r = v >> s;
    uint32_t rem = v & ((1u << s) - 1u);
    uint32_t half = 1u << (s - 1);
    if (rem > half || (rem == half && (r & 1u)))
        r++;
    return r;
}

uint16_t kvcap_f32_to_f16(float f)
{
    uint32_t x = kvcap_f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) /* NaN: keep the top payload bits, force quiet so it stays NaN */
        return (uint16_t)(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
    if (x >= 0x477ff000u) /* >= 65520, halfway past 65504 (odd mantissa): rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    uint32_t e = x >> 23;
    if (e >= 113) /* normal in f16 (>= 2^-14); a carry out of the mantissa bumps the exponent */
        return (uint16_t)(sign | shift_rne(((e - 112) << 23) | (x & 0x7fffffu), 13));
    if (e < 102) /* below 2^-25: rounds to zero */
        return sign;
    /* Subnormal in f16: value / 2^-24 = (1.mant) * 2^(e - 126); may round up to 2^-14. */
    return (uint16_t)(sign | shift_rne((x & 0x7fffffu) | 0x800000u, 126 - e));
}

float kvcap_bf16_to_f32(uint16_t b)
{
    return kvcap_bits_f32((uint32_t)b << 16);
}

uint16_t kvcap_f32_to_bf16(float f)
{
    uint32_t x = kvcap_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign and top payload, set the quiet bit */
        return (uint16_t)((x >> 16) | 0x0040u);
    /* RNE on the low 16 bits; a carry into the exponent rounds up to inf as it should. */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static enum kvcap_status not_float(const char *fn, enum kvcap_dtype d)
{
    return kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                      "%s: dtype %s is not a float type (F32, F16, BF16, F64)", fn,
                      kvcap_dtype_name(d));
}

/* Elements are read and written with memcpy so callers may pass unaligned buffers; the
 * compiler turns these into plain loads and stores (and, the helpers being static, calls the
 * converter directly). */
static void widen16(const unsigned char *s, size_t n, float *dst, float (*to_f32)(uint16_t))
{
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, s + 2 * i, 2);
        dst[i] = to_f32(h);
    }
}

static void narrow16(const float *src, size_t n, unsigned char *d, uint16_t (*from_f32)(float))
{
    for (size_t i = 0; i < n; i++) {
        uint16_t h = from_f32(src[i]);
        memcpy(d + 2 * i, &h, 2);
    }
}

enum kvcap_status kvcap_convert_to_f32(enum kvcap_dtype src_dtype, const void *src, size_t n,
                                       float *dst)
{
    KVCAP_RETURN_IF(n && (!src || !dst), KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_convert_to_f32: NULL %s", !src ? "src" : "dst");
    const unsigned char *s = src;
    switch (src_dtype) {
    case KVCAP_DTYPE_F32:
        if (n)
            memmove(dst, src, n * sizeof(float));
        return KVCAP_OK;
    case KVCAP_DTYPE_F16:
        widen16(s, n, dst, kvcap_f16_to_f32);
        return KVCAP_OK;
    case KVCAP_DTYPE_BF16:
        widen16(s, n, dst, kvcap_bf16_to_f32);
        return KVCAP_OK;
    case KVCAP_DTYPE_F64:
        for (size_t i = 0; i < n; i++) {
            double d;
            memcpy(&d, s + 8 * i, 8);
            dst[i] = (float)d;
        }
        return KVCAP_OK;
    default:
        return not_float("kvcap_convert_to_f32", src_dtype);
    }
}

enum kvcap_status kvcap_convert_from_f32(enum kvcap_dtype dst_dtype, const float *src, size_t n,
                                         void *dst)
{
    KVCAP_RETURN_IF(n && (!src || !dst), KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_convert_from_f32: NULL %s", !src ? "src" : "dst");
    unsigned char *d = dst;
    switch (dst_dtype) {
    case KVCAP_DTYPE_F32:
        if (n)
            memmove(dst, src, n * sizeof(float));
        return KVCAP_OK;
    case KVCAP_DTYPE_F16:
        narrow16(src, n, d, kvcap_f32_to_f16);
        return KVCAP_OK;
    case KVCAP_DTYPE_BF16:
        narrow16(src, n, d, kvcap_f32_to_bf16);
        return KVCAP_OK;
    case KVCAP_DTYPE_F64:
        for (size_t i = 0; i < n; i++) {
            double v = src[i];
            memcpy(d + 8 * i, &v, 8);
        }
        return KVCAP_OK;
    default:
        return not_float("kvcap_convert_from_f32", dst_dtype);
    }
}
