/* load.c — the bulk f32 loader and storer and the kernels' CPU probe (see load.h). */
#include <stdatomic.h>

#include "kernels/load.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#  define LOAD_X86 1
#  include <cpuid.h>
#  include <immintrin.h>
#else
#  define LOAD_X86 0
#endif

static atomic_int simd_enabled = 1;

int kvcap_kernels_set_simd(int enabled)
{
    return atomic_exchange_explicit(&simd_enabled, enabled ? 1 : 0, memory_order_relaxed);
}

#if LOAD_X86
/* AVX2 and FMA with OS support for the YMM state (what __builtin_cpu_supports checks), and
 * F16C from CPUID leaf 1 (clang's __builtin_cpu_supports does not know "f16c"). */
static int cpu_has_avx2_set(void)
{
    __builtin_cpu_init();
    unsigned a, b, c, d;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}
#endif

/* Probed once (CPUID traps to the hypervisor in a VM: microseconds); racing first calls store
 * the same value. 0: not probed yet, 1: portable only, 2: the AVX2 set is usable. */
static atomic_int cpu_level = 0;

int kvcap_kernels_avx2(void)
{
#if LOAD_X86
    int level = atomic_load_explicit(&cpu_level, memory_order_relaxed);
    if (level == 0) {
        level = cpu_has_avx2_set() ? 2 : 1;
        atomic_store_explicit(&cpu_level, level, memory_order_relaxed);
    }
    return level == 2 && atomic_load_explicit(&simd_enabled, memory_order_relaxed);
#else
    return 0;
#endif
}

#if LOAD_X86
__attribute__((target("avx2,fma,f16c"))) static void load_f16_avx2(const unsigned char *s,
                                                                     size_t n, float *dst)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i,
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 2 * i))));
    kvcap_load_f32_portable(KVCAP_DTYPE_F16, s + 2 * i, n - i, dst + i);
}
#endif

void kvcap_load_f32(enum kvcap_dtype dtype, const void *src, size_t n, float *dst)
{
#if LOAD_X86
    if (dtype == KVCAP_DTYPE_F16 && kvcap_kernels_avx2()) {
        load_f16_avx2(src, n, dst);
        return;
    }
#endif
    kvcap_load_f32_portable(dtype, src, n, dst);
}

#if LOAD_X86
/* Round to nearest even, as kvcap_f32_to_f16: the same bits for every input (NaNs quieted with
 * their top payload bits kept, overflow to infinity, subnormals exact). */
__attribute__((target("avx2,fma,f16c"))) static void store_f16_avx2(const float *src, size_t n,
                                                                      unsigned char *d)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + 2 * i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    kvcap_convert_from_f32(KVCAP_DTYPE_F16, src + i, n - i, d + 2 * i);
}
#endif

void kvcap_store_f32(enum kvcap_dtype dtype, const float *src, size_t n, void *dst)
{
#if LOAD_X86
    if (dtype == KVCAP_DTYPE_F16 && kvcap_kernels_avx2()) {
        store_f16_avx2(src, n, dst);
        return;
    }
#endif
    kvcap_convert_from_f32(dtype, src, n, dst);
}
