/* kvzip.h — KVzip's scoring (arXiv 2505.23416): the importance of a prompt token to
 * a KV head is the largest attention that any query of the context-reconstruction pass ("repeat
 * the previous context", run by the engine after the prompt) pays it, over the G query heads
 * of the group; one budget is then shared by every layer and KV head of the span. */
#ifndef KVCAP_KVZIP_H
#define KVCAP_KVZIP_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/attention.h"

/* One KV head. q: the G query heads of this KV head for each of the n_q reconstruction tokens,
 * f32, query g of token i at q + i*q_stride + g*d (rotated at its own position). keys: the
 * prompt's keys in prompt order as n_chunks chunks of rows (kvcap_rows; v is not read; a chunk
 * may be empty), m tokens in all; every query sees every key (the reconstruction follows the
 * prompt). Scores are (q·k)·scale and A its softmax per query over the m keys and, when lse is
 * given, the keys behind lse[i*lse_stride + g] (the log-sum-exp of query (i, g)'s scores over
 * keys not passed here: the reconstruction tokens' own, which KVzip's softmax includes; -inf
 * for none):
 *   score[j] = max(score[j], max over i, g of A_g[i][j])      (m floats)
 * Without lse a query's probabilities over the prompt sum to 1.
 * scratch: at least kvcap_kvzip_scratch_floats(n_q, G, d) floats (independent of m).
 * Returns KVCAP_OK, or KVCAP_ERR_INVALID_ARGUMENT naming the argument (NULL pointer, n_q, G or
 * d < 1, no keys, a chunk with a non-storage dtype, negative n or row_stride < d, non-finite
 * scale); on error nothing is written. Single-threaded apart from what BLAS does. */
enum kvcap_status kvcap_kvzip_head(const float *q, size_t q_stride, const float *lse,
                                   size_t lse_stride, int n_q, int G, int d, float scale,
                                   const struct kvcap_rows *keys, int n_chunks, float *score,
                                   float *scratch);
/* 0 for n_q, G or d < 1; SIZE_MAX on overflow. */
size_t kvcap_kvzip_scratch_floats(int n_q, int G, int d);
/* Naive double-precision oracle with the same contract (allocates O(m) doubles:
 * KVCAP_ERR_OUT_OF_MEMORY when that fails). */
enum kvcap_status kvcap_kvzip_head_ref(const float *q, size_t q_stride, const float *lse,
                                       size_t lse_stride, int n_q, int G, int d, float scale,
                                       const struct kvcap_rows *keys, int n_chunks, float *score);

/* The shared budget: `units` score rows of n floats each (one per layer and KV head, the
 * compressible tokens only) compete for `budget` places; keep[u] receives how many of row u's
 * tokens are kept and sel (units·n bytes) marks them: sel[u·n + j] = 1 for a kept token.
 * Every row first keeps its `head_floor` largest scores (Ada-KV's safeguard, arXiv 2407.11550:
 * no head is starved; head_floor is clamped to [0, n] and to budget / units), then the rest of
 * the budget goes to the largest remaining scores of all rows together (head_floor 0: KVzip's
 * rule).
 * Ties go to the lower (row, token) index; NaN ranks below every number. budget is clamped to
 * [0, units·n]. Returns the number kept, or -1 for a bad argument (NULL, units or n < 0,
 * units·n > INT_MAX) or when out of memory (it allocates O(units·n)). */
int64_t kvcap_kvzip_select(const float *score, int units, int n, int64_t budget,
                           int head_floor, int *keep, unsigned char *sel);
/* The same by sorting every (score, index) pair: the readable oracle. */
int64_t kvcap_kvzip_select_ref(const float *score, int units, int n, int64_t budget,
                               int head_floor, int *keep, unsigned char *sel);

#endif
