/* capsule_prefill_cuda.h — KVCapsule's prefill on a CUDA device
 * (kernels/cuda/capsule_prefill.cu), the twin of kernels/capsule_prefill.h, and the device descriptors it reads: a view of the
 * engine's K/V in device memory, the rotation that undoes a span's offset (its device form is
 * kernels/cuda/rope.cuh), a bucket's grid order and a unit's maps. The device store
 * (runtime/cache_device.c) drives it; tested through tests/test_runtime_cuda.c against the CPU
 * store. Built only with CUDA. Conventions of kernels/cuda/attention_cuda.h: the device current
 * on the calling thread, `stream` a cudaStream_t (NULL: the legacy default stream), work only
 * enqueued. */
#ifndef KVCAP_CAPSULE_PREFILL_CUDA_H
#define KVCAP_CAPSULE_PREFILL_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A K or V view of device memory (struct kvcap_tensor_view) whose page table, if any, has been
 * copied to the device. */
struct kvcap_cuda_view {
    const void *base;
    const void *const *pages; /* device array of device pointers, or NULL */
    int page_size;
    enum kvcap_dtype dtype;   /* F32, F16 or BF16 */
    int64_t head_stride, token_stride;
};

/* The rotation that undoes a span's start offset (K' = R(-p0) K, rope.h): for each rotation
 * pair (a, b), row[a] = cos and row[b] = sin of its angle, as kvcap_rope_rotate computes them;
 * channels past rope_dim are not rotated. */
#define KVCAP_CUDA_ROPE_MAX_D 256
struct kvcap_cuda_rope {
    int on;       /* 0: ROPE_NONE, keys and queries are used as they are */
    int adjacent; /* pairing: 1 adjacent (2i, 2i+1), 0 half (i, i + rope_dim/2) */
    int rope_dim;
};

/* Maps of one (layer, KV head, bucket) in device memory, f32 (artifact.h). */
struct kvcap_cuda_capsule_unit {
    const int32_t *mask; /* [rk] */
    const float *w1;     /* [rk][h] */
    const float *b1;     /* [h] */
    const float *w2;     /* [h][m] */
    const float *b2;     /* [m] */
    const float *u;      /* [rv][m] */
    int m, rk, h, rv, gelu;
};

/* Grid order of a bucket (kvcap_bucket_token). */
struct kvcap_cuda_grid {
    int tiled, cols, tile_rows, tile_cols;
};

/* KVCapsule state of one span for KV head `head`, from n tokens of device views k and v:
 * mu [d] = mean of V, hs [tiles][h][d] = φ(W1ᵀ K'[M] + b1 1ᵀ) per tile with K' = R(-p0) K,
 * vt [tiles][rv][d] = U (V_t − 1μᵀ), written in `storage` (kvcap_capsule_prefill_ref's math).
 * rope_row: device [d] floats (struct kvcap_cuda_rope's table for -p0); mu_f32: device [d]
 * floats of scratch. A launch failure is KVCAP_ERR_DEVICE naming it. */
enum kvcap_status kvcap_cuda_capsule_prefill(const struct kvcap_cuda_view *k,
                                             const struct kvcap_cuda_view *v, int head, int n,
                                             int d, const struct kvcap_cuda_rope *rope,
                                             const float *rope_row,
                                             const struct kvcap_cuda_grid *grid,
                                             const struct kvcap_cuda_capsule_unit *unit, int tiles,
                                             enum kvcap_dtype storage, void *hs, void *vt,
                                             void *mu, float *mu_f32, void *stream);

/* kvcap's exact tiles, the device half of kvcap_capsule_tile_error: for point p of tile t of
 * KV head `head`, points[(t·m + p)·4 + i] (device, n·4 doubles) = ‖k'‖², ‖v − μ‖², ‖k̂' − k'‖²,
 * ‖v̂ − v‖² over the channels, with k' = R(−p0) k (rope_row as above), k̂' = Σ_a W2[a][p] H_t[a]
 * + b2[p] and v̂ = Σ_r U[r][p] Ṽ_t[r] + μ, from the f32 state of every tile (hs [tiles][h][d],
 * vt [tiles][rv][d], mu [d], device; kvcap_cuda_capsule_prefill with storage F32). The tile
 * errors follow on the host (kvcap_capsule_tile_error_points, kernels/capsule_prefill.h). A launch
 * failure is KVCAP_ERR_DEVICE naming it. */
enum kvcap_status kvcap_cuda_capsule_point_errors(const struct kvcap_cuda_view *k,
                                                  const struct kvcap_cuda_view *v, int head, int n,
                                                  int d, const struct kvcap_cuda_rope *rope,
                                                  const float *rope_row,
                                                  const struct kvcap_cuda_grid *grid,
                                                  const struct kvcap_cuda_capsule_unit *unit,
                                                  const float *hs, const float *vt,
                                                  const float *mu, double *points, void *stream);

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
// Start of the row of (head, token) of a view, as runtime/view.c reads a host view.
static __device__ __forceinline__ const void *kvcap_cuda_view_row(const struct kvcap_cuda_view &v,
                                                                  int head, int token)
{
    const int64_t es = v.dtype == KVCAP_DTYPE_F32 ? 4 : 2;
    if (v.pages) {
        const char *page = static_cast<const char *>(v.pages[token / v.page_size]);
        const int64_t row = (int64_t)head * v.head_stride +
                            (int64_t)(token % v.page_size) * v.token_stride;
        return page + row * es;
    }
    return static_cast<const char *>(v.base) +
           ((int64_t)head * v.head_stride + (int64_t)token * v.token_stride) * es;
}
#endif

#endif /* KVCAP_CAPSULE_PREFILL_CUDA_H */
