/* vlcache_cuda.h — VL-Cache's scoring on a CUDA device (kernels/cuda/vlcache.cu): the
 * numbers kernels/vlcache.h computes per KV head, for every (layer, KV head) of a span at once.
 * Tests: tests/test_vlcache_cuda.c. *
 * The conventions of kernels/cuda/flashcache_cuda.h hold here (device pointers, streams,
 * scratch, deterministic outputs, statuses, the batch index). */
#ifndef KVCAP_VLCACHE_CUDA_H
#define KVCAP_VLCACHE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- VL-Cache (DESIGN §6) ---------------------------------------------------------------------
 * The post-vision queries and prompt keys of n_layers × n_heads (layer, KV head) pairs. For
 * KV head h of layer ℓ, query head g (0 <= g < G) of post-vision token i (0 <= i < tau) is the
 * f32 d-vector at
 *     q[ℓ] + i·q_stride + (h·G + g)·d
 * (the engine's [tokens][q_heads][d] layout: q_stride = n_heads·G·d), and key j (0 <= j < m,
 * prompt order, the post-vision tokens being the last tau) is the d-vector at
 *     k[ℓ] + h·head_stride + j·row_stride              (elements of dtype)
 * Keys are one run of m rows per head (the CPU's chunk lists are not taken here). */
struct kvcap_cuda_vl {
    const float *const *q;  /* host array [n_layers] of device pointers (f32) */
    size_t q_stride;        /* floats between consecutive post-vision tokens, >= n_heads·G·d */
    const void *const *k;   /* host array [n_layers] of device pointers */
    enum kvcap_dtype dtype; /* of the keys: F32, F16 or BF16 */
    size_t row_stride;      /* elements between consecutive keys, >= d */
    size_t head_stride;     /* elements between consecutive KV heads' keys */
    int n_layers, n_heads;  /* >= 1 */
    int G;                  /* query heads per KV head, >= 1 */
    int d;                  /* head dim, 1..256 (keys are staged in shared memory) */
    int tau, m;             /* post-vision tokens and prompt length, 1 <= tau <= m */
};

/* Device scratch bytes of kvcap_cuda_vlcache_scores: 8·(⌈m/32⌉ + 1)·tau·G bytes per pair (a
 * partial softmax normaliser per 32 keys and query row); 0 for NULL or invalid geometry,
 * SIZE_MAX on overflow. */
size_t kvcap_cuda_vlcache_scratch_bytes(const struct kvcap_cuda_vl *vl);

/* kvcap_vlcache_head for every pair (scores are (q·k)·scale, A' their causal softmax per query
 * row, token i seeing keys 0 .. m−tau+i), written to device memory:
 *   score[b·m + j] = Σ_g Σ_i A'_g[i][j]                                    [batch][m]
 *   below[b]       = entries of A' (causal part, every g) below p · rowmax  [batch]
 *   gamma[ℓ]       = Σ_h below / Σ_h entries, entries = G·(tau·(m−tau+1) + tau·(tau−1)/2)
 *                    per head: the layer sparsity kvcap_vlcache_budgets takes   [n_layers]
 * KVCAP_ERR_INVALID_ARGUMENT for a NULL or inconsistent vl (named field), non-finite scale or
 * p, NULL outputs, or too little scratch; KVCAP_ERR_UNSUPPORTED for d > 256. */
enum kvcap_status kvcap_cuda_vlcache_scores(const struct kvcap_cuda_vl *vl, float scale, float p,
                                            float *score, int64_t *below, double *gamma,
                                            void *scratch, size_t scratch_bytes, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* KVCAP_VLCACHE_CUDA_H */
