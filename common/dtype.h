/* dtype.h — element types: their sizes and names (kvcap_dtype_size/name are public, in
 * kvcap.h), parsing, the float storage test every reader and kernel applies, bit-exact scalar
 * conversions between F16/BF16/F64 and the F32 every kernel computes in, and the scalar element
 * load of the readable oracles. Needs include/ only. The ISA-dispatched bulk loader is a kernel
 * (kvcap_load_f32, kernels/load.h); the device loads are in kernels/cuda/common.cuh. */
#ifndef KVCAP_DTYPE_H
#define KVCAP_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvcap.h"

/* 1 when K/V may be stored in `d`: F32, F16 or BF16 (F64 is a file type for calibration
 * statistics, never a storage type; I32 and U8 are not floats). */
int kvcap_dtype_is_storage(enum kvcap_dtype d);

/* Parses "F32"/"f32", "BF16"/"bf16", ...: 1 and *out set, or 0 and *out untouched. */
int kvcap_dtype_parse(const char *s, enum kvcap_dtype *out);

/* ---- Scalar conversions (bit-exact, independent of the FPU rounding mode) ---------------- */
float kvcap_f16_to_f32(uint16_t h);
uint16_t kvcap_f32_to_f16(float f);   /* round to nearest even, overflow to ±inf, NaN kept */
float kvcap_bf16_to_f32(uint16_t b);
uint16_t kvcap_f32_to_bf16(float f);  /* round to nearest even, NaN kept quiet */

/* Converts n elements of a float tensor (F32/F16/BF16/F64) to f32 / from f32; buffers may be
 * unaligned. KVCAP_ERR_INVALID_ARGUMENT for a non-float dtype or a NULL buffer with n > 0. */
enum kvcap_status kvcap_convert_to_f32(enum kvcap_dtype src_dtype, const void *src, size_t n,
                                       float *dst);
enum kvcap_status kvcap_convert_from_f32(enum kvcap_dtype dst_dtype, const float *src, size_t n,
                                         void *dst);

/* Element i of a float storage array (F32, F16 or BF16), widened to double: the readable
 * oracles' load. Anything but F16/BF16 is read as F32. */
double kvcap_load_elem(enum kvcap_dtype dtype, const void *base, size_t i);

/* ---- Inline helpers for vectorised loops -------------------------------------------------- */
#if defined(__GNUC__) || defined(__clang__)
#  define KVCAP_DTYPE_INLINE static inline __attribute__((always_inline))
#else
#  define KVCAP_DTYPE_INLINE static inline
#endif

KVCAP_DTYPE_INLINE float kvcap_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

KVCAP_DTYPE_INLINE uint32_t kvcap_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* f16 -> f32 without branches, so loops over it vectorise (the FP16 library's method: normals
 * by an exponent re-bias and a power-of-two multiply, subnormals through a magic float
 * subtraction; inf/NaN land in the all-ones exponent). Agrees bit for bit with
 * kvcap_f16_to_f32, the readable form, over all 65536 inputs except that a signalling NaN may
 * come back quieted by the multiply (tests/test_dtype.c). */
KVCAP_DTYPE_INLINE float kvcap_f16_to_f32_fast(uint16_t h)
{
    uint32_t w = (uint32_t)h << 16;
    uint32_t sign = w & 0x80000000u;
    uint32_t two_w = w + w;
    float normalized = kvcap_bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = kvcap_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t sub = 0u - (uint32_t)(two_w < (1u << 27)); /* a mask, not a branch */
    uint32_t mag = (kvcap_f32_bits(denormalized) & sub) | (kvcap_f32_bits(normalized) & ~sub);
    return kvcap_bits_f32(sign | mag);
}

#endif /* KVCAP_DTYPE_H */
