/* cache_cuda.h — the device primitives of a cache kept in CUDA memory (params.memory =
 * KVCAP_MEMORY_CUDA): memory and copies, the kernels that store rows at prefill and append,
 * the KVCapsule state computed from device K/V, and the two small decode kernels around the
 * attention calls of kernels/cuda/attention_cuda.h (query preparation, merge of per-unit
 * partials into the output). runtime/cache_device.c (the device store) drives them;
 * runtime/cache_cuda.cu implements them. Built only with CUDA.
 *
 * Every call makes ctx->device current for its duration (restoring the caller's device) and
 * enqueues on ctx->stream (a cudaStream_t; NULL: the legacy default stream). Only the calls
 * named *_sync, kvcap_cache_cuda_free and kvcap_cache_cuda_host_free wait; kernels never allocate.
 * CUDA failures are KVCAP_ERR_DEVICE (KVCAP_ERR_OUT_OF_MEMORY for allocations) naming the call. */
#ifndef KVCAP_CACHE_CUDA_H
#define KVCAP_CACHE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"
#include "kernels/cuda/capsule_prefill_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kvcap_cuda_rows_problem; /* kernels/cuda/attention_cuda.h */

struct kvcap_cache_cuda_ctx {
    int device;
    void *stream;
};

/* ---- Memory and copies -------------------------------------------------------------------- */

enum kvcap_status kvcap_cache_cuda_malloc(const struct kvcap_cache_cuda_ctx *x, size_t bytes,
                                          void **out);
/* Waits for the device's work (cudaFree); NULL is a no-op. */
void kvcap_cache_cuda_free(int device, void *p);
/* Pinned host memory, for copies enqueued inside a decode step. */
enum kvcap_status kvcap_cache_cuda_host_malloc(const struct kvcap_cache_cuda_ctx *x, size_t bytes,
                                               void **out);
void kvcap_cache_cuda_host_free(void *p);

/* Host → device from any host memory, waiting until done (creation and prefill). */
enum kvcap_status kvcap_cache_cuda_upload_sync(const struct kvcap_cache_cuda_ctx *x, void *dst,
                                               const void *src, size_t bytes);
/* Host → device, enqueued: src must be pinned and stay unchanged until the stream is past it. */
enum kvcap_status kvcap_cache_cuda_upload(const struct kvcap_cache_cuda_ctx *x, void *dst,
                                          const void *src, size_t bytes);
/* Device → host after the stream's work, waiting. */
enum kvcap_status kvcap_cache_cuda_download_sync(const struct kvcap_cache_cuda_ctx *x, void *dst,
                                                 const void *src, size_t bytes);
/* Device → device, enqueued: `height` rows of `width` bytes, pitches in bytes. */
enum kvcap_status kvcap_cache_cuda_copy_2d(const struct kvcap_cache_cuda_ctx *x, void *dst,
                                           size_t dpitch, const void *src, size_t spitch,
                                           size_t width, size_t height);
/* Waits until the stream's work is done; reports an earlier asynchronous failure. */
enum kvcap_status kvcap_cache_cuda_sync(const struct kvcap_cache_cuda_ctx *x);
/* 1 when the stream is being captured into a graph (nothing may allocate or wait then). */
int kvcap_cache_cuda_capturing(const struct kvcap_cache_cuda_ctx *x);

/* ---- Prefill ------------------------------------------------------------------------------ */

/* Rows [0, n) of each of `heads` heads of dst ([heads][cap][d] in `storage`) = tokens
 * tokens[0..n) (device array; NULL: 0..n-1) of the view, converted through f32 as the host
 * cache does (round to nearest even). */
enum kvcap_status kvcap_cache_cuda_fill_rows(const struct kvcap_cache_cuda_ctx *x,
                                             const struct kvcap_cuda_view *src,
                                             const int *tokens, int n, int heads, int d, void *dst,
                                             int cap, enum kvcap_dtype storage);

/* KVCapsule state of one span for KV head `head` on the cache's device and stream: the kernel
 * kvcap_cuda_capsule_prefill (kernels/cuda/capsule_prefill_cuda.h). */
enum kvcap_status kvcap_cache_cuda_capsule_prefill(
    const struct kvcap_cache_cuda_ctx *x, const struct kvcap_cuda_view *k,
    const struct kvcap_cuda_view *v, int head, int n, int d, const struct kvcap_cuda_rope *rope,
    const float *rope_row, const struct kvcap_cuda_grid *grid,
    const struct kvcap_cuda_capsule_unit *unit, int tiles, enum kvcap_dtype storage, void *hs,
    void *vt, void *mu, float *mu_f32);

/* kvcap's exact tiles: the per-point error sums of one KV head on the cache's device and
 * stream: the kernel kvcap_cuda_capsule_point_errors (kernels/cuda/capsule_prefill_cuda.h). */
enum kvcap_status kvcap_cache_cuda_capsule_point_errors(
    const struct kvcap_cache_cuda_ctx *x, const struct kvcap_cuda_view *k,
    const struct kvcap_cuda_view *v, int head, int n, int d, const struct kvcap_cuda_rope *rope,
    const float *rope_row, const struct kvcap_cuda_grid *grid,
    const struct kvcap_cuda_capsule_unit *unit, const float *hs, const float *vt,
    const float *mu, double *points);

/* ---- Decode ------------------------------------------------------------------------------- */

/* One generated token into the generated rows of a sequence-layer. The row comes from the
 * device counter *seen: row = seen, or with a streaming ring (window > 0) the first `sinks`
 * rows then sinks + (seen − sinks) mod window. The kernel writes the row of every head,
 * sets problems[h].n for h < heads to the rows now held and increments *seen; a row at or past
 * cap is not written, *seen is left and *overflow set to 1. */
struct kvcap_cache_cuda_append {
    const void *k, *v;           /* device: the token's row of head 0 */
    enum kvcap_dtype k_dtype, v_dtype;
    int64_t k_head_stride, v_head_stride; /* elements between heads */
    void *dk, *dv;               /* device: generated rows [heads][cap][d] in the storage dtype */
    int cap, sinks, window;
    int64_t *seen;               /* device counter */
    struct kvcap_cuda_rows_problem *problems; /* device: one per head, consecutive */
    int *overflow;               /* device flag */
};
enum kvcap_status kvcap_cache_cuda_append_token(const struct kvcap_cache_cuda_ctx *x,
                                                const struct kvcap_cache_cuda_append *a, int heads,
                                                int d, enum kvcap_dtype storage);

/* q_copy = q ([n_seqs][q_heads][d]), and for each of n_rot KVCapsule spans r, qrot[r] =
 * R(-p0_r) q[rot_seq[r]] ([q_heads][d]) with rot_rows[r] ([d], the span's table). All device. */
enum kvcap_status kvcap_cache_cuda_prepare_queries(const struct kvcap_cache_cuda_ctx *x,
                                                   const float *q, int n_seqs, int q_heads, int d,
                                                   float *q_copy, int n_rot, const int *rot_seq,
                                                   const float *rot_rows,
                                                   const struct kvcap_cuda_rope *rope,
                                                   float *qrot);

/* Per-unit partials (mx, sum, o of attention.h) of a layer: unit u of KV head h, query g at
 * row (h * n_units + u) * G + g. For each sequence s (its units are unit_begin[s] ..
 * unit_begin[s+1] − 1, device array) and query head hq = h * G + g: merges the units by
 * log-sum-exp, writes out[s][hq][:] = o / sum (0 when nothing was attended) and, when lse is
 * not NULL, lse[s][hq] = mx + log(sum) (-inf when nothing was attended). */
enum kvcap_status kvcap_cache_cuda_merge_finish(const struct kvcap_cache_cuda_ctx *x,
                                                const float *mx, const float *sum, const float *o,
                                                int n_units, const int *unit_begin, int n_seqs,
                                                int kv_heads, int G, int d, float *out, float *lse);

#ifdef __cplusplus
}
#endif

#endif
