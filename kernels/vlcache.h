/* vlcache.h — VL-Cache's scoring (DESIGN §6): the causal post-vision attention A' of the τ
 * prompt tokens after the last image over the prompt, its sparsity and column sums, in
 * O(τ·m) per head (never m²), and the layer budgets of Algorithm 1. */
#ifndef KVCAP_VLCACHE_H
#define KVCAP_VLCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/attention.h"

/* One KV head. q: the G query heads of this KV head for each of the τ post-vision tokens, f32,
 * query g of token i at q + i*q_stride + g*d (already rotated at its own position). keys: the
 * prompt's keys in prompt order as n_chunks chunks of rows (kvcap_rows; v is not read; a chunk
 * may be empty), m tokens in all; the post-vision tokens are the last τ of them, and token i
 * sees keys 0 .. m−τ+i (causal). scores are (q·k)·scale and A' is their softmax per row.
 *   score[j] += Σ_g Σ_i A'_g[i][j]             (m floats)
 *   *below   += entries of A' (causal part, every g) strictly below p · rowmax
 *   *entries += entries of A' (causal part, every g) = G·(τ·(m−τ+1) + τ·(τ−1)/2)
 * so Σ below / Σ entries over heads is the layer sparsity γ_ℓ. scratch: at least
 * kvcap_vlcache_scratch_floats(tau, G, d) floats, caller-owned (its size does not depend on m).
 * Returns KVCAP_OK, or KVCAP_ERR_INVALID_ARGUMENT naming the argument (NULL pointer, τ, G or d
 * < 1, m < τ, a chunk with a non-float dtype, negative n or row_stride < d, non-finite scale
 * or p); on error nothing is written. Single-threaded apart from what BLAS does. */
enum kvcap_status kvcap_vlcache_head(const float *q, size_t q_stride, int tau, int G, int d,
                                     float scale, const struct kvcap_rows *keys, int n_chunks,
                                     float p, float *score, int64_t *below, int64_t *entries,
                                     float *scratch);
/* 0 for τ, G or d < 1; SIZE_MAX on overflow. */
size_t kvcap_vlcache_scratch_floats(int tau, int G, int d);
/* Naive double-precision oracle with the same contract (it allocates O(m) doubles:
 * KVCAP_ERR_OUT_OF_MEMORY when that fails). */
enum kvcap_status kvcap_vlcache_head_ref(const float *q, size_t q_stride, int tau, int G, int d,
                                         float scale, const struct kvcap_rows *keys,
                                         int n_chunks, float p, float *score, int64_t *below,
                                         int64_t *entries);

/* β_ℓ = clip((1 − γ_ℓ) / Σ_j (1 − γ_j) · α·L, lo, 1) for ℓ < L; when every γ = 1 there is
 * nothing to be proportional to and β_ℓ = clip(α, lo, 1). No redistribution after clipping
 * (Algorithm 1 of the paper), so Σ β = α·L only when nothing clips.
 * KVCAP_ERR_INVALID_ARGUMENT for NULL pointers, L < 1, a γ outside [0, 1], α < 0 or lo outside
 * [0, 1] (non-finite included). */
enum kvcap_status kvcap_vlcache_budgets(const double *gamma, int L, double alpha, double lo,
                                        double *beta);

#endif
