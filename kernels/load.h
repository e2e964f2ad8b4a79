/* load.h — float tensors of any storage dtype read as f32, the first step of every host kernel
 * and of the runtime's row reads: the portable conversion (inlined into the kernels' blocks) and
 * the bulk loader, F16 through F16C where the CPU has it; and the bulk store back. Also the one
 * CPU probe the dispatching kernels share (AVX2 + FMA + F16C) and its test switch. */
#ifndef KVCAP_KERNELS_LOAD_H
#define KVCAP_KERNELS_LOAD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/dtype.h"
#include "kvcap.h"

#if defined(__GNUC__)
#  define KVCAP_LOAD_INLINE static inline __attribute__((always_inline))
#else
#  define KVCAP_LOAD_INLINE static inline
#endif

/* n elements of dtype at src as f32 into dst, in portable C (F32 copied, F16/BF16/F64 converted
 * exactly; a non-float dtype, which callers never pass, gives zeros rather than garbage). */
KVCAP_LOAD_INLINE void kvcap_load_f32_portable(enum kvcap_dtype dtype, const void *src, size_t n,
                                               float *dst)
{
    const unsigned char *s = src;
    switch (dtype) {
    case KVCAP_DTYPE_F32:
        if (n)
            memcpy(dst, src, n * sizeof(float));
        break;
    case KVCAP_DTYPE_F16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = kvcap_f16_to_f32_fast(h);
        }
        break;
    case KVCAP_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) {
            uint16_t b;
            memcpy(&b, s + 2 * i, 2);
            dst[i] = kvcap_bits_f32((uint32_t)b << 16);
        }
        break;
    case KVCAP_DTYPE_F64:
        for (size_t i = 0; i < n; i++) {
            double v;
            memcpy(&v, s + 8 * i, 8);
            dst[i] = (float)v;
        }
        break;
    default:
        if (n)
            memset(dst, 0, n * sizeof(float));
        break;
    }
}

/* The same as kvcap_load_f32_portable, F16 eight at a time with F16C where the CPU has the
 * AVX2 set (and the SIMD kernels are not switched off). */
void kvcap_load_f32(enum kvcap_dtype dtype, const void *src, size_t n, float *dst);

/* The reverse, the runtime's row stores: n f32 values into dst in dtype, the same bits as
 * kvcap_convert_from_f32 (whose dtypes it takes), F16 eight at a time with F16C where the CPU
 * has the AVX2 set. */
void kvcap_store_f32(enum kvcap_dtype dtype, const float *src, size_t n, void *dst);

/* 1 when the host kernels' AVX2 set may run: the CPU has AVX2, FMA and F16C with OS support
 * for the YMM state, and kvcap_kernels_set_simd has not switched it off. Probed once. */
int kvcap_kernels_avx2(void);

/* Test hook (not API): 0 forces every dispatching kernel onto its portable form, 1 restores the
 * run-time choice. Returns the previous setting. Lets one test program check both paths. */
int kvcap_kernels_set_simd(int enabled);

#endif
