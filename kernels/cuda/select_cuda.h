/* select_cuda.h — top-k selection on a CUDA device (kernels/cuda/select.cu), the twin of
 * kernels/select.h. Tests: tests/test_select_cuda.c. *
 * The conventions of kernels/cuda/flashcache_cuda.h hold here (device pointers, streams,
 * scratch, deterministic outputs, statuses, the batch index). */
#ifndef KVCAP_SELECT_CUDA_H
#define KVCAP_SELECT_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Top-k selection --------------------------------------------------------------------------
 * kvcap_topk_indices for `batch` rows at once: row r has n scores at score + r·ld_score and
 * keeps keep_r = clamp(keep_per_row ? keep_per_row[r] : keep, 0, n) of them; their indices
 * (into the row) go to idx + r·ld_idx in ascending order, exactly the CPU's selection: larger
 * score first, ties to the lower index, NaN below every number, −0 equal to +0. Entries
 * keep_r.. of an idx row are not written. score, keep_per_row (optional, [batch]) and idx are
 * device memory; no scratch. A radix select (four histogram passes over the row's 32-bit
 * order keys) and a compaction pass, one block per row: no shared-memory limit on n (any
 * n <= INT_MAX), ~5 reads of the row. Rows may be any part of a longer buffer, e.g. the
 * compressible tokens of kvcap_cuda_flashcache_deviation's dev (score = dev + lo − a,
 * ld_score = n). KVCAP_ERR_INVALID_ARGUMENT for NULL score or idx, n < 0, batch < 1 or
 * ld_score < n, or ld_idx smaller than the largest possible keep (n when keep_per_row is set,
 * else min(keep, n)). */
enum kvcap_status kvcap_cuda_topk(const float *score, size_t ld_score, int n, int batch, int keep,
                                  const int *keep_per_row, int *idx, size_t ld_idx,
                                  void *stream);

#ifdef __cplusplus
}
#endif

#endif /* KVCAP_SELECT_CUDA_H */
