// cache_cuda.cu — the device primitives of a cache kept in CUDA memory (cache_cuda.h): memory
// and copies with the cache's device made current, row stores at prefill and append, the
// KVCapsule prefill state, query preparation and the merge of per-unit partials. Prefill
// kernels are simple (one span once); the decode kernels are a single small launch each whose
// parameters do not change from step to step, so a step can be captured into a graph.
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "common/internal.h"
}
#include "runtime/cache_cuda.h"
#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rope.cuh"

#define MERGE_THREADS 128
#define APPEND_THREADS 256

namespace {

// ---- Errors and the current device ----------------------------------------------------------

// Makes `device` current for a scope and puts the caller's device back at its end.
class DeviceScope {
  public:
    explicit DeviceScope(int device)
    {
        if (cudaGetDevice(&prev_) != cudaSuccess) {
            (void)cudaGetLastError();
            prev_ = -1;
        }
        if (prev_ != device) {
            err_ = cudaSetDevice(device);
            switched_ = err_ == cudaSuccess;
        }
    }
    ~DeviceScope()
    {
        if (switched_ && prev_ >= 0)
            (void)cudaSetDevice(prev_);
    }
    cudaError_t error() const { return err_; }
    DeviceScope(const DeviceScope &) = delete;
    DeviceScope &operator=(const DeviceScope &) = delete;

  private:
    int prev_ = -1;
    bool switched_ = false;
    cudaError_t err_ = cudaSuccess;
};

#define ENTER(ctx, op)                                                                             \
    DeviceScope scope_((ctx)->device);                                                             \
    if (scope_.error() != cudaSuccess)                                                             \
        return kvcap_cuda_fail(scope_.error(), (op), "cudaSetDevice", __FILE__, __LINE__)

cudaStream_t stream_of(const kvcap_cache_cuda_ctx *x)
{
    return static_cast<cudaStream_t>(x->stream);
}

__device__ __forceinline__ bool partial_empty(float mx, float sum)
{
    return !(sum > 0.0f) || mx == -INFINITY;
}

// ---- Kernels ----------------------------------------------------------------------------------

template <typename T>
__global__ void fill_rows_kernel(kvcap_cuda_view src, const int *tokens, int n, int heads,
                                 int d, T *dst, int cap)
{
    const size_t total = (size_t)heads * n * d;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        const int c = (int)(e % d);
        const size_t hj = e / d;
        const int j = (int)(hj % n), h = (int)(hj / n);
        const int tok = tokens ? tokens[j] : j;
        kvcap_cuda_store(
            dst, ((size_t)h * cap + j) * d + c,
            kvcap_cuda_load_any(kvcap_cuda_view_row(src, h, tok), (size_t)c, src.dtype));
    }
}

// One block: every thread reads the counter before the barrier, thread 0 advances it after.
template <typename T>
__global__ void __launch_bounds__(APPEND_THREADS)
    append_kernel(kvcap_cache_cuda_append a, int heads, int d)
{
    const int64_t seen = *a.seen;
    const int64_t ring = (int64_t)a.sinks + a.window;
    const int64_t row = a.window > 0 && seen >= ring ? a.sinks + (seen - a.sinks) % a.window : seen;
    const int64_t held = a.window > 0 && seen + 1 > ring ? ring : seen + 1;
    if (row >= a.cap) {
        if (threadIdx.x == 0)
            *a.overflow = 1;
        return;
    }
    T *dk = static_cast<T *>(a.dk), *dv = static_cast<T *>(a.dv);
    for (int e = threadIdx.x; e < heads * d; e += blockDim.x) {
        const int h = e / d, c = e - h * d;
        const size_t at = ((size_t)h * a.cap + (size_t)row) * d + c;
        kvcap_cuda_store(
            dk, at,
            kvcap_cuda_load_any(a.k, (size_t)((int64_t)h * a.k_head_stride + c), a.k_dtype));
        kvcap_cuda_store(
            dv, at,
            kvcap_cuda_load_any(a.v, (size_t)((int64_t)h * a.v_head_stride + c), a.v_dtype));
    }
    __syncthreads();
    if (threadIdx.x == 0)
        *a.seen = seen + 1;
    for (int h = threadIdx.x; h < heads; h += blockDim.x)
        a.problems[h].n = (int)held;
}

__global__ void prepare_queries_kernel(const float *q, int n_seqs, int q_heads, int d,
                                       float *q_copy, int n_rot, const int *rot_seq,
                                       const float *rot_rows, kvcap_cuda_rope rope,
                                       float *qrot)
{
    const size_t per = (size_t)q_heads * d, total = (size_t)(n_seqs + n_rot) * per;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / per, in = e - r * per;
        if (r < (size_t)n_seqs) {
            q_copy[e] = q[e];
            continue;
        }
        const size_t k = r - (size_t)n_seqs;
        const int c = (int)(in % d);
        const float *row = q + (size_t)rot_seq[k] * per + (in - c);
        qrot[k * per + in] =
            kvcap_cuda_rope_rotated(row, KVCAP_DTYPE_F32, c, rope, rot_rows + k * d);
    }
}

// grid (q_heads, n_seqs): one block per output row.
__global__ void __launch_bounds__(MERGE_THREADS)
    merge_finish_kernel(const float *mx, const float *sum, const float *o, int n_units,
                        const int *unit_begin, int G, int d, float *out, float *lse)
{
    const int s = blockIdx.y, hq = blockIdx.x, q_heads = gridDim.x;
    const int h = hq / G, g = hq - h * G;
    const int ub = unit_begin[s], ue = unit_begin[s + 1];
    float top = -INFINITY;
    for (int u = ub; u < ue; u++) {
        const size_t row = ((size_t)h * n_units + u) * G + g;
        if (!partial_empty(mx[row], sum[row]))
            top = fmaxf(top, mx[row]);
    }
    float total = 0.0f;
    if (top != -INFINITY)
        for (int u = ub; u < ue; u++) {
            const size_t row = ((size_t)h * n_units + u) * G + g;
            if (!partial_empty(mx[row], sum[row]))
                total += expf(mx[row] - top) * sum[row];
        }
    float *dst = out + ((size_t)s * q_heads + hq) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        if (total > 0.0f)
            for (int u = ub; u < ue; u++) {
                const size_t row = ((size_t)h * n_units + u) * G + g;
                if (!partial_empty(mx[row], sum[row]))
                    acc += expf(mx[row] - top) * o[row * d + c];
            }
        dst[c] = total > 0.0f ? acc / total : 0.0f;
    }
    if (lse && threadIdx.x == 0)
        lse[(size_t)s * q_heads + hq] = total > 0.0f ? top + logf(total) : -INFINITY;
}

} // namespace

// ---- Memory and copies ------------------------------------------------------------------------

extern "C" enum kvcap_status kvcap_cache_cuda_malloc(const kvcap_cache_cuda_ctx *x, size_t bytes,
                                                     void **out)
{
    ENTER(x, "malloc");
    *out = NULL;
    KVCAP_CUDA_TRY(cudaMalloc(out, bytes ? bytes : 1), "malloc");
    return KVCAP_OK;
}

extern "C" void kvcap_cache_cuda_free(int device, void *p)
{
    if (!p)
        return;
    DeviceScope scope(device);
    if (cudaFree(p) != cudaSuccess)
        (void)cudaGetLastError();
}

extern "C" enum kvcap_status kvcap_cache_cuda_host_malloc(const kvcap_cache_cuda_ctx *x,
                                                          size_t bytes, void **out)
{
    ENTER(x, "host malloc");
    *out = NULL;
    KVCAP_CUDA_TRY(cudaMallocHost(out, bytes ? bytes : 1), "host malloc");
    return KVCAP_OK;
}

extern "C" void kvcap_cache_cuda_host_free(void *p)
{
    if (p && cudaFreeHost(p) != cudaSuccess)
        (void)cudaGetLastError();
}

extern "C" enum kvcap_status kvcap_cache_cuda_upload_sync(const kvcap_cache_cuda_ctx *x, void *dst,
                                                          const void *src, size_t bytes)
{
    ENTER(x, "upload");
    if (bytes == 0)
        return KVCAP_OK;
    KVCAP_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_of(x)),
                   "upload");
    KVCAP_CUDA_TRY(cudaStreamSynchronize(stream_of(x)), "upload");
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_cache_cuda_upload(const kvcap_cache_cuda_ctx *x, void *dst,
                                                     const void *src, size_t bytes)
{
    ENTER(x, "upload");
    if (bytes == 0)
        return KVCAP_OK;
    KVCAP_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_of(x)),
                   "upload");
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_cache_cuda_download_sync(const kvcap_cache_cuda_ctx *x,
                                                            void *dst, const void *src,
                                                            size_t bytes)
{
    ENTER(x, "download");
    if (bytes == 0)
        return KVCAP_OK;
    KVCAP_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(x)),
                   "download");
    KVCAP_CUDA_TRY(cudaStreamSynchronize(stream_of(x)), "download");
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_cache_cuda_copy_2d(const kvcap_cache_cuda_ctx *x, void *dst,
                                                      size_t dpitch, const void *src, size_t spitch,
                                                      size_t width, size_t height)
{
    ENTER(x, "copy");
    if (width == 0 || height == 0)
        return KVCAP_OK;
    KVCAP_CUDA_TRY(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                     cudaMemcpyDeviceToDevice, stream_of(x)),
                   "copy");
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_cache_cuda_sync(const kvcap_cache_cuda_ctx *x)
{
    ENTER(x, "stream synchronize");
    KVCAP_CUDA_TRY(cudaStreamSynchronize(stream_of(x)), "stream synchronize");
    return KVCAP_OK;
}

extern "C" int kvcap_cache_cuda_capturing(const kvcap_cache_cuda_ctx *x)
{
    DeviceScope scope(x->device);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_of(x), &status) != cudaSuccess) {
        (void)cudaGetLastError();
        return 1; // e.g. the legacy stream while another stream captures: treat as capturing
    }
    return status != cudaStreamCaptureStatusNone;
}

// ---- Prefill ----------------------------------------------------------------------------------

extern "C" enum kvcap_status kvcap_cache_cuda_fill_rows(const kvcap_cache_cuda_ctx *x,
                                                        const kvcap_cuda_view *src,
                                                        const int *tokens, int n, int heads, int d,
                                                        void *dst, int cap,
                                                        enum kvcap_dtype storage)
{
    ENTER(x, "fill rows");
    const size_t total = (size_t)heads * n * d;
    if (total == 0)
        return KVCAP_OK;
    const unsigned blocks = kvcap_cuda_elem_blocks(total);
    cudaStream_t st = stream_of(x);
    switch (storage) {
    case KVCAP_DTYPE_F16:
        fill_rows_kernel<<<blocks, KVCAP_CUDA_ELEM_THREADS, 0, st>>>(
            *src, tokens, n, heads, d, static_cast<__half *>(dst), cap);
        break;
    case KVCAP_DTYPE_BF16:
        fill_rows_kernel<<<blocks, KVCAP_CUDA_ELEM_THREADS, 0, st>>>(
            *src, tokens, n, heads, d, static_cast<__nv_bfloat16 *>(dst), cap);
        break;
    default:
        fill_rows_kernel<<<blocks, KVCAP_CUDA_ELEM_THREADS, 0, st>>>(
            *src, tokens, n, heads, d, static_cast<float *>(dst), cap);
        break;
    }
    KVCAP_CUDA_CHECK_LAUNCH("fill rows", "kernel launch");
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_cache_cuda_capsule_prefill(
    const kvcap_cache_cuda_ctx *x, const kvcap_cuda_view *k, const kvcap_cuda_view *v, int head,
    int n, int d, const kvcap_cuda_rope *rope, const float *rope_row, const kvcap_cuda_grid *grid,
    const kvcap_cuda_capsule_unit *unit, int tiles, enum kvcap_dtype storage, void *hs, void *vt,
    void *mu, float *mu_f32)
{
    ENTER(x, "kvcapsule prefill");
    return kvcap_cuda_capsule_prefill(k, v, head, n, d, rope, rope_row, grid, unit, tiles,
                                      storage, hs, vt, mu, mu_f32, x->stream);
}

extern "C" enum kvcap_status kvcap_cache_cuda_capsule_point_errors(
    const kvcap_cache_cuda_ctx *x, const kvcap_cuda_view *k, const kvcap_cuda_view *v, int head,
    int n, int d, const kvcap_cuda_rope *rope, const float *rope_row, const kvcap_cuda_grid *grid,
    const kvcap_cuda_capsule_unit *unit, const float *hs, const float *vt, const float *mu,
    double *points)
{
    ENTER(x, "kvcapsule exact tiles");
    return kvcap_cuda_capsule_point_errors(k, v, head, n, d, rope, rope_row, grid, unit, hs, vt,
                                           mu, points, x->stream);
}

// ---- Decode -----------------------------------------------------------------------------------

extern "C" enum kvcap_status kvcap_cache_cuda_append_token(const kvcap_cache_cuda_ctx *x,
                                                           const kvcap_cache_cuda_append *a,
                                                           int heads, int d,
                                                           enum kvcap_dtype storage)
{
    ENTER(x, "append");
    cudaStream_t st = stream_of(x);
    switch (storage) {
    case KVCAP_DTYPE_F16:
        append_kernel<__half><<<1, APPEND_THREADS, 0, st>>>(*a, heads, d);
        break;
    case KVCAP_DTYPE_BF16:
        append_kernel<__nv_bfloat16><<<1, APPEND_THREADS, 0, st>>>(*a, heads, d);
        break;
    default:
        append_kernel<float><<<1, APPEND_THREADS, 0, st>>>(*a, heads, d);
        break;
    }
    KVCAP_CUDA_CHECK_LAUNCH("append", "kernel launch");
    return KVCAP_OK;
}

extern "C" enum kvcap_status
kvcap_cache_cuda_prepare_queries(const kvcap_cache_cuda_ctx *x, const float *q, int n_seqs,
                                 int q_heads, int d, float *q_copy, int n_rot, const int *rot_seq,
                                 const float *rot_rows, const kvcap_cuda_rope *rope,
                                 float *qrot)
{
    ENTER(x, "prepare queries");
    const size_t total = (size_t)(n_seqs + n_rot) * q_heads * d;
    prepare_queries_kernel<<<kvcap_cuda_elem_blocks(total), KVCAP_CUDA_ELEM_THREADS, 0,
                             stream_of(x)>>>(q, n_seqs, q_heads, d, q_copy, n_rot, rot_seq,
                                             rot_rows, *rope, qrot);
    KVCAP_CUDA_CHECK_LAUNCH("prepare queries", "kernel launch");
    return KVCAP_OK;
}

extern "C" enum kvcap_status
kvcap_cache_cuda_merge_finish(const kvcap_cache_cuda_ctx *x, const float *mx, const float *sum,
                              const float *o, int n_units, const int *unit_begin, int n_seqs,
                              int kv_heads, int G, int d, float *out, float *lse)
{
    ENTER(x, "merge");
    dim3 grid((unsigned)(kv_heads * G), (unsigned)n_seqs);
    merge_finish_kernel<<<grid, MERGE_THREADS, 0, stream_of(x)>>>(mx, sum, o, n_units, unit_begin,
                                                                  G, d, out, lse);
    KVCAP_CUDA_CHECK_LAUNCH("merge", "kernel launch");
    return KVCAP_OK;
}
