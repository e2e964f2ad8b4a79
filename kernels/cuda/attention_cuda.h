/* attention_cuda.h — decode attention on a CUDA device (kernels/cuda/attention.cu): plain K/V
 * rows by flash-decoding and the fused KVCapsule path (DESIGN §4), with partial results in the
 * layout of struct kvcap_partial, so CPU and GPU partials mean the same and merge the same way.
 * Built only with CUDA; the CPU oracles are kernels/attention.h.
 *
 * Conventions of every function here:
 *  - Pointers marked "device" are CUDA device (or managed) memory; everything else is host
 *    memory read during the call only. Descriptor arrays live in device memory so that a batch
 *    can be described once (e.g. before a CUDA graph is captured) and replayed.
 *  - `stream` is a cudaStream_t passed as void * (NULL: the legacy default stream). Work is
 *    enqueued on it and the call returns without waiting: no host synchronisation, no blocking
 *    copy, no device allocation. The caller provides device scratch of at least the size the
 *    matching *_scratch_bytes function reports and must not reuse it before the work is done
 *    (calls on one stream may share one scratch). So the calls may be captured into a CUDA
 *    graph.
 *  - Arguments are checked on the host before anything is enqueued: KVCAP_ERR_INVALID_ARGUMENT
 *    names the argument at fault, KVCAP_ERR_UNSUPPORTED a valid request outside the kernels'
 *    limits (head_dim not a multiple of 8 in 64..256, more than 16 queries, a dtype other than
 *    F32/F16/BF16). Contents of device memory (descriptors, token counts) cannot be checked:
 *    they must respect the limits stated here.
 *  - A failed launch is KVCAP_ERR_DEVICE naming the operation and the CUDA error. Launches are
 *    checked with cudaGetLastError, which does not wait: an error of earlier asynchronous work
 *    on the device may be reported by a later call, and faults inside a kernel only at the next
 *    synchronisation the caller makes.
 *  - Partials (mx, sum, o) are those of attention.h, in device memory: for each query
 *    mx = running max score, sum = Σ exp(s − mx), o[d] = Σ exp(s − mx) v. The calls fold their
 *    keys into the partials they are given (log-sum-exp merge, an empty partial — sum 0 or
 *    mx −inf — is overwritten without its o being read), exactly as kvcap_attend_rows and
 *    kvcap_capsule_attend do on the CPU. Within one call every problem or span must have its
 *    own partial: two entries folding into the same partial race. Spans sharing an accumulator
 *    go into separate calls on the same stream. */
#ifndef KVCAP_ATTENTION_CUDA_H
#define KVCAP_ATTENTION_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"

#ifdef __cplusplus
extern "C" {
#endif

/* struct kvcap_partial, struct kvcap_capsule_maps: plain C structs of pointers and ints. */
#include "kernels/attention.h"

#define KVCAP_CUDA_ATTN_MAX_NQ 16 /* queries per KV head (GQA group) */
#define KVCAP_CUDA_ATTN_MIN_D 64  /* head_dim: a multiple of 8 in MIN_D..MAX_D */
#define KVCAP_CUDA_ATTN_MAX_D 256

/* One plain-attention problem: one (sequence, KV head) with its group of nq queries. The array
 * of `batch` descriptors is built on the host with these device pointers and copied to the
 * device. Row j of K is at k + j * row_stride elements of the call's dtype (any stride >= d,
 * so NHD and HND caches are both read in place); same for V. */
struct kvcap_cuda_rows_problem {
    const void *k, *v;        /* device: n rows each */
    const float *q;           /* device: [nq][d] f32, contiguous */
    struct kvcap_partial acc; /* device: mx[nq], sum[nq], o[nq][d], folded into */
    int64_t row_stride;       /* elements between consecutive tokens */
    int n;                    /* tokens, 0..max_n (0: acc is left as it is) */
    int reserved;             /* 0 */
};

/* Bytes of device scratch kvcap_cuda_attend_rows needs for these sizes (0 when max_n is 0). */
enum kvcap_status kvcap_cuda_attend_rows_scratch_bytes(int batch, int max_n, int nq, int d,
                                                       size_t *bytes);

/* Plain attention for `batch` problems (device array `problems`) in one launch, split over
 * tokens: every problem's rows are cut into the same chunks (their count fixed by max_n),
 * each chunk handled by its own thread block, and a second kernel merges the chunks' partials
 * into each problem's acc. max_n must be >= every problem's n; rows past max_n are not read.
 * Scores are (q · k_j) * scale; math in f32 whatever the storage dtype. */
enum kvcap_status kvcap_cuda_attend_rows(const struct kvcap_cuda_rows_problem *problems,
                                         int batch, int max_n, enum kvcap_dtype dtype, int nq,
                                         int d, float scale, void *scratch, size_t scratch_bytes,
                                         void *stream);

/* One compressed span for one KV head, as struct kvcap_capsule_span but with device pointers
 * and the dtype given per call: per tile t, H_t [h][d] at hs + t*h*d and Ṽ_t [rv][d] at
 * vt + t*rv*d elements; mu [d]; q' [nq][d] f32 (already rotated back by the span's p0). */
struct kvcap_cuda_capsule_span {
    const void *hs, *vt, *mu; /* device, in the call's dtype */
    const float *q;           /* device: [nq][d] offset-free queries */
    struct kvcap_partial acc; /* device: where this span's contribution is folded in */
    int tiles;                /* 0..max_tiles (0: acc is left as it is) */
    int reserved;             /* 0 */
};

/* Bytes of device scratch kvcap_cuda_capsule_attend needs (0 when max_tiles is 0). `maps` is
 * read for its sizes only. */
enum kvcap_status kvcap_cuda_capsule_scratch_bytes(const struct kvcap_capsule_maps *maps,
                                                   int n_spans, int max_tiles, int nq, int d,
                                                   size_t *bytes);

/* Fused KVCapsule attention for `n_spans` spans (device array) of one bucket:
 *   s_t = scale · (W2ᵀ (H_t q') + b2 (1ᵀ q')),  o += Σ_t (U p_t)ᵀ Ṽ_t + (Σ p) μ
 * with one softmax over all tiles of a span. `maps` is a host struct whose w2, b2, u point to
 * device memory (f32), shared by every span of the call: each thread block reads them once,
 * into shared memory when they fit. Work is split over (tile, point range) pieces across
 * blocks and merged by log-sum-exp into each span's acc. max_tiles must be >= every span's
 * tiles. */
enum kvcap_status kvcap_cuda_capsule_attend(const struct kvcap_capsule_maps *maps,
                                            const struct kvcap_cuda_capsule_span *spans,
                                            int n_spans, int max_tiles, enum kvcap_dtype dtype,
                                            int nq, int d, float scale, void *scratch,
                                            size_t scratch_bytes, void *stream);

/* Sets `rows` partials (device: mx[rows], sum[rows], o[rows][d]) to empty. */
enum kvcap_status kvcap_cuda_partial_reset(struct kvcap_partial p, int rows, int d,
                                           void *stream);

/* out[r * out_stride + c] = o[r][c] / sum[r] (0 where sum is 0) for `rows` partials (device:
 * p and out). Partials of a batch laid out contiguously ([batch][nq]) finish in one call. */
enum kvcap_status kvcap_cuda_partial_finish(struct kvcap_partial p, int rows, int d, float *out,
                                            size_t out_stride, void *stream);

#ifdef __cplusplus
}
#endif

#endif
