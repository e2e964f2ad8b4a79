// common.cuh — what the project's device code shares (kernels/cuda, the device store in
// runtime/cache_cuda.cu, calibration's calibrate/cuda): storage-dtype loads and the dispatch
// over them, warp and block sums, the per-layer pointer tables the kernels take by value, and
// the one helper that turns CUDA, cuBLAS and cuSOLVER failures into kvcap statuses.
#ifndef KVCAP_POLICIES_COMMON_CUH
#define KVCAP_POLICIES_COMMON_CUH

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "common/internal.h"
}

// Layers per launch. Their device pointers travel in the kernel parameters (two tables of 128
// pointers: 2 KiB, inside the classic 4 KiB parameter limit), so the host never copies a
// pointer table to the device, which would need pinned memory or a synchronisation. Models
// with more layers take one more launch per 128 layers.
#define KVCAP_CUDA_LAYERS_PER_LAUNCH 128

struct kvcap_cuda_layer_ptrs {
    const void *a[KVCAP_CUDA_LAYERS_PER_LAUNCH]; // K (FlashCache) or Q (VL-Cache) of each layer
    const void *b[KVCAP_CUDA_LAYERS_PER_LAUNCH]; // V (FlashCache) or K (VL-Cache) of each layer
};

// ---- Loads ------------------------------------------------------------------------------------

__device__ __forceinline__ float kvcap_cuda_load(const float *p)
{
    return *p;
}
__device__ __forceinline__ float kvcap_cuda_load(const __half *p)
{
    return __half2float(*p);
}
__device__ __forceinline__ float kvcap_cuda_load(const __nv_bfloat16 *p)
{
    return __bfloat162float(*p);
}

// Runs the statements with T the element type of `dtype` (one kernel instantiation per storage
// type, so no branch on the dtype sits in an inner loop). dtype has been checked to be a float.
#define KVCAP_CUDA_DTYPE_DISPATCH(dtype, T, ...)                                                   \
    do {                                                                                           \
        switch (dtype) {                                                                           \
        case KVCAP_DTYPE_F16: {                                                                    \
            typedef __half T;                                                                      \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        case KVCAP_DTYPE_BF16: {                                                                   \
            typedef __nv_bfloat16 T;                                                               \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        default: {                                                                                 \
            typedef float T;                                                                       \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        }                                                                                          \
    } while (0)

// ---- Element access by runtime dtype (the device store's views and rows) --------------------

__device__ __forceinline__ float kvcap_cuda_load_any(const void *p, size_t i, int dtype)
{
    switch (dtype) {
    case KVCAP_DTYPE_F16: return __half2float(static_cast<const __half *>(p)[i]);
    case KVCAP_DTYPE_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    default: return static_cast<const float *>(p)[i];
    }
}

__device__ __forceinline__ void kvcap_cuda_store(float *p, size_t i, float x)
{
    p[i] = x;
}
__device__ __forceinline__ void kvcap_cuda_store(__half *p, size_t i, float x)
{
    p[i] = __float2half_rn(x);
}
__device__ __forceinline__ void kvcap_cuda_store(__nv_bfloat16 *p, size_t i, float x)
{
    p[i] = __float2bfloat16_rn(x);
}

__device__ __forceinline__ int kvcap_cuda_dtype_bytes(int dtype)
{
    return dtype == KVCAP_DTYPE_F32 ? 4 : 2;
}

// ---- Element-wise launches ---------------------------------------------------------------------
// Threads per block of the element-wise kernels, and their blocks for `total` elements: at least
// one, at most 65535 (the kernels stride over the rest).
#define KVCAP_CUDA_ELEM_THREADS 256

static inline unsigned kvcap_cuda_elem_blocks(size_t total)
{
    size_t b = (total + KVCAP_CUDA_ELEM_THREADS - 1) / KVCAP_CUDA_ELEM_THREADS;
    return (unsigned)(b < 65535 ? (b ? b : 1) : 65535);
}

// ---- Reductions -------------------------------------------------------------------------------
// Fixed butterfly orders: every lane ends with the same value, and runs give the same bits.

__device__ __forceinline__ float kvcap_warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double kvcap_warp_sum(double v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ unsigned kvcap_warp_sum(unsigned v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float kvcap_warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sums each of v[0..N) over the block (blockDim.x a multiple of 32, at most 1024); the totals
// are valid in thread 0. Every thread of the block must call it, once per kernel.
template <int N>
__device__ void kvcap_block_sum(double (&v)[N])
{
    __shared__ double part[N][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int i = 0; i < N; i++)
        v[i] = kvcap_warp_sum(v[i]);
    if (lane == 0)
        for (int i = 0; i < N; i++)
            part[i][warp] = v[i];
    __syncthreads();
    if (warp == 0)
        for (int i = 0; i < N; i++)
            v[i] = kvcap_warp_sum(lane < warps ? part[i][lane] : 0.0);
}

// ---- Errors -----------------------------------------------------------------------------------
// One message for every CUDA, cuBLAS or cuSOLVER failure of the project's device code (kernels,
// the device store, calibration): "cuda <op>: <what>: <error> [file:line]", where <op> is the
// caller's operation or the failed call (a statement's text up to its argument list). Failed
// allocations are KVCAP_ERR_OUT_OF_MEMORY (so callers may fall back to the CPU), everything
// else KVCAP_ERR_DEVICE.

static inline const char *kvcap_cuda_base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static inline enum kvcap_status kvcap_cuda_report(int oom, const char *op, const char *what,
                                                  const char *error, const char *file, int line)
{
    return kvcap_fail(oom ? KVCAP_ERR_OUT_OF_MEMORY : KVCAP_ERR_DEVICE, "cuda %.*s: %s: %s [%s:%d]",
                      (int)strcspn(op, "("), op, what, error, kvcap_cuda_base_name(file), line);
}

// A CUDA runtime error, cleared so that a non-sticky one is not reported again by a later call.
static inline enum kvcap_status kvcap_cuda_fail(cudaError_t e, const char *op, const char *what,
                                                const char *file, int line)
{
    (void)cudaGetLastError();
    char error[160];
    snprintf(error, sizeof error, "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
    return kvcap_cuda_report(e == cudaErrorMemoryAllocation, op, what, error, file, line);
}

// Evaluates a CUDA runtime statement once; returns the status of a failure, naming the call.
#define KVCAP_CUDA_TRY(stmt, what)                                                                 \
    do {                                                                                           \
        cudaError_t e_ = (stmt);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return kvcap_cuda_fail(e_, #stmt, (what), __FILE__, __LINE__);                         \
    } while (0)

// After a launch: a bad configuration or a missing device shows up here, naming the kernel.
#define KVCAP_CUDA_CHECK_LAUNCH(op, what)                                                          \
    do {                                                                                           \
        cudaError_t e_ = cudaGetLastError();                                                       \
        if (e_ != cudaSuccess)                                                                     \
            return kvcap_cuda_fail(e_, (op), (what), __FILE__, __LINE__);                          \
    } while (0)

#if defined(CUBLAS_VER_MAJOR) // files that include <cublas_v2.h> first (calibration)
#  define KVCAP_CUBLAS_TRY(stmt, what)                                                             \
      do {                                                                                         \
          cublasStatus_t e_ = (stmt);                                                              \
          if (e_ != CUBLAS_STATUS_SUCCESS)                                                         \
              return kvcap_cuda_report(e_ == CUBLAS_STATUS_ALLOC_FAILED, #stmt, (what),            \
                                       cublasGetStatusString(e_), __FILE__, __LINE__);             \
      } while (0)
#endif

// KVCAP_ERR_UNSUPPORTED when no device is visible (zero devices is not a fault, but there is
// nothing to run on); `op` names the caller.
static inline enum kvcap_status kvcap_cuda_need_device(const char *op)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        return kvcap_fail(KVCAP_ERR_UNSUPPORTED, "cuda %s: no CUDA device is visible", op);
    }
    return KVCAP_OK;
}

// Rounds a device address up to a multiple of 256 (the alignment cudaMalloc gives), so callers
// may hand any sub-range of their memory as scratch.
#define KVCAP_CUDA_SCRATCH_ALIGN 256
static inline unsigned char *kvcap_cuda_align(void *p)
{
    uintptr_t u = (uintptr_t)p;
    return (unsigned char *)((u + KVCAP_CUDA_SCRATCH_ALIGN - 1) &
                             ~(uintptr_t)(KVCAP_CUDA_SCRATCH_ALIGN - 1));
}

// Appends `bytes` at the next 256-byte boundary of a layout of *total bytes and returns its
// offset; clears *ok on size_t overflow.
static inline size_t kvcap_cuda_reserve(size_t *total, size_t bytes, int *ok)
{
    size_t off = (*total + KVCAP_CUDA_SCRATCH_ALIGN - 1) / KVCAP_CUDA_SCRATCH_ALIGN *
                 KVCAP_CUDA_SCRATCH_ALIGN;
    if (off < *total || !kvcap_add_size(off, bytes, total))
        *ok = 0;
    return off;
}

#endif
