// cuda_util.cu — device helpers of kvcap-bench-cuda (cuda.h): random fill in a
// storage dtype, a read-only pass that evicts the L2 cache between timed calls, and a timed spin.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bench/cuda.h"

namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ void store(float *p, float x)
{
    *p = x;
}

__device__ __forceinline__ void store(__half *p, float x)
{
    *p = __float2half_rn(x);
}

__device__ __forceinline__ void store(__nv_bfloat16 *p, float x)
{
    *p = __float2bfloat16_rn(x);
}

template <typename T>
__global__ void fill_kernel(T *dst, size_t n, uint64_t seed, float lo, float span)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float u = (float)(mix64(seed ^ (i * 0xd1342543de82ef95ull)) >> 40) * 0x1.0p-24f;
        store(dst + i, lo + span * u);
    }
}

// Every thread XORs what it reads; the store happens only for one impossible value, so the
// pass writes nothing while the compiler must still perform every load.
__global__ void read_kernel(const uint4 *buf, size_t n, unsigned *sink)
{
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = buf[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u && threadIdx.x == 0x3ff)
        *sink = acc;
}

__device__ __forceinline__ unsigned long long global_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The global timer rather than clock64(): it counts nanoseconds whatever the SM clock does.
__global__ void busy_kernel(unsigned long long ns)
{
    const unsigned long long t0 = global_ns();
    while (global_ns() - t0 < ns) {
    }
}

unsigned blocks_for(size_t n, unsigned threads)
{
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 8192 ? (b ? b : 1) : 8192);
}

} // namespace

extern "C" cudaError_t kvcap_bench_fill(void *dst, enum kvcap_dtype dtype, size_t n,
                                        uint64_t seed, float lo, float hi, cudaStream_t stream)
{
    if (n == 0)
        return cudaSuccess;
    const unsigned threads = 256, blocks = blocks_for(n, threads);
    switch (dtype) {
    case KVCAP_DTYPE_F32:
        fill_kernel<float><<<blocks, threads, 0, stream>>>((float *)dst, n, seed, lo, hi - lo);
        break;
    case KVCAP_DTYPE_F16:
        fill_kernel<__half><<<blocks, threads, 0, stream>>>((__half *)dst, n, seed, lo, hi - lo);
        break;
    case KVCAP_DTYPE_BF16:
        fill_kernel<__nv_bfloat16>
            <<<blocks, threads, 0, stream>>>((__nv_bfloat16 *)dst, n, seed, lo, hi - lo);
        break;
    default:
        return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

extern "C" cudaError_t kvcap_bench_read(const void *buf, size_t bytes, unsigned *sink,
                                        cudaStream_t stream)
{
    const size_t n = bytes / 16;
    if (n == 0)
        return cudaSuccess;
    read_kernel<<<blocks_for(n, 512), 512, 0, stream>>>((const uint4 *)buf, n, sink);
    return cudaGetLastError();
}

extern "C" cudaError_t kvcap_bench_busy(double us, int blocks, cudaStream_t stream)
{
    if (!(us > 0) || blocks < 1)
        return us > 0 ? cudaErrorInvalidValue : cudaSuccess;
    busy_kernel<<<(unsigned)blocks, 256, 0, stream>>>((unsigned long long)(us * 1e3 + 0.5));
    return cudaGetLastError();
}
