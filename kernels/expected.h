/* expected.h — Expected Attention's scoring (arXiv 2510.00636, as kvpress 0.5.5's
 * ExpectedAttentionPress computes it): no extra pass; the prompt's queries give their mean and
 * covariance before RoPE, the rotation of the next n_future positions is averaged onto them,
 * and each key is scored by the attention such a Gaussian query pays it in expectation,
 * E[exp(q·k·s)] = exp(s μ'·k + s²/2 kᵀΣ'k), softmaxed over the keys, averaged over the KV head's
 * query heads and weighted by the value's norm. */
#ifndef KVCAP_EXPECTED_H
#define KVCAP_EXPECTED_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"

/* The average rotation of positions p .. p + n_future − 1 under g's RoPE: for each rotation
 * pair i (rope_dim / 2 of them), cs[2i] = mean cos(t ω_i) and cs[2i + 1] = mean sin(t ω_i), in
 * double. KVCAP_ERR_INVALID_ARGUMENT for NULL, n_future < 1 or p < 0; KVCAP_ERR_UNSUPPORTED for
 * M-RoPE (its future positions are not one scalar per token). ROPE_NONE gives cos 1, sin 0. */
enum kvcap_status kvcap_expected_rotation(const struct kvcap_model_geometry *g, int64_t p,
                                          int n_future, double *cs);

/* One KV head. q: n ≥ 1 queries of the G query heads before RoPE (query g of token i at
 * q + i*q_stride + g*d); cs: kvcap_expected_rotation's. k, v: the m ≥ 1 scored tokens' keys
 * (rotated, as stored) and values, f32 rows of d. For each g: μ_g, Σ_g the mean and covariance
 * (divided by n) of its queries, μ'_g = R̄ μ_g, Σ'_g = R̄ Σ_g R̄ᵀ (R̄: the pairs' mean rotations,
 * identity beyond rope_dim), z_gj = scale μ'_g·k_j + scale²/2 k_jᵀΣ'_g k_j, A_g = softmax_j z_g;
 *   score[j] = (1/G Σ_g A_gj) · ||v_j||                       (m floats)
 * scratch: kvcap_expected_scratch_floats(n, m, d) floats. KVCAP_ERR_INVALID_ARGUMENT naming the
 * argument (NULL, n, m, G or d < 1, non-finite scale); nothing written then. */
enum kvcap_status kvcap_expected_head(const struct kvcap_model_geometry *g, const float *q,
                                      size_t q_stride, int n, int G, const double *cs,
                                      const float *k, const float *v, int m, float scale,
                                      float *score, float *scratch);
size_t kvcap_expected_scratch_floats(int n, int m, int d);
/* Naive double-precision oracle with the same contract (allocates its working memory:
 * KVCAP_ERR_OUT_OF_MEMORY when that fails). */
enum kvcap_status kvcap_expected_head_ref(const struct kvcap_model_geometry *g, const float *q,
                                          size_t q_stride, int n, int G, const double *cs,
                                          const float *k, const float *v, int m, float scale,
                                          float *score);

#endif
