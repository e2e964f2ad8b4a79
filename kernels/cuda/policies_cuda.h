/* policies_cuda.h — FlashCache and VL-Cache scoring on a CUDA device: the numbers that
 * kernels/flashcache.h and kernels/vlcache.h compute per KV head, for every (layer, KV head) of
 * a span in a handful of launches, and the top-k token selection that evicts on their scores.
 * kernels/cuda/flashcache.cu and kernels/cuda/vlcache.cu implement it; in a build without CUDA
 * kernels/cuda/policies_stub.c answers every call with KVCAP_ERR_UNSUPPORTED.
 *
 * Conventions shared by every function below:
 *  - "device" pointers are memory of the device current on the calling thread. Fields marked
 *    "host array" are host arrays of device pointers, read during the call only.
 *  - stream is a cudaStream_t passed as void * (NULL: the legacy default stream). Calls only
 *    enqueue work and never synchronise the host: outputs are ready once the stream gets past
 *    the call, and the inputs must stay valid and unchanged until then.
 *  - scratch is caller-owned device memory of at least the matching *_scratch_bytes() (any
 *    alignment: the layout is aligned inside it). Only the work enqueued by the call uses it,
 *    so the next call on the same stream may reuse it. No call allocates device memory.
 *  - Outputs are written (not accumulated), every element of them, in a deterministic order:
 *    the same inputs give the same bits.
 *  - Statuses: KVCAP_ERR_INVALID_ARGUMENT naming the argument, checked before anything is
 *    enqueued (nothing is written then); KVCAP_ERR_UNSUPPORTED for a build without CUDA, no
 *    device, or libcufft missing; KVCAP_ERR_DEVICE naming the CUDA or cuFFT call that failed
 *    (KVCAP_ERR_OUT_OF_MEMORY when that failure was an allocation). A launch error is caught at
 *    the launch; a fault inside a kernel surfaces at the caller's next synchronisation, as for
 *    any asynchronous CUDA work. Nothing here prints or exits.
 *  - Threads: calls without a plan are reentrant. A plan serves one call at a time (its cuFFT
 *    handles are bound to the call's stream and scratch while it enqueues).
 *  - Batch index: the (layer ℓ, KV head h) pair of a call is b = ℓ·n_heads + h in every output. */
#ifndef KVCAP_POLICIES_CUDA_H
#define KVCAP_POLICIES_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/flashcache.h" /* struct kvcap_energy */
#include "kvcap.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- FlashCache (DESIGN §5) ------------------------------------------------------------------
 * The K and V rows of n_layers × n_heads (layer, KV head) pairs, n tokens × d channels each
 * (n and d are the plan's). Channel c of token j of head h of layer ℓ is element
 *     k[ℓ] + h·head_stride + j·row_stride + c        (in elements of dtype; the same for v)
 * so per-layer buffers, one buffer for all layers (k[ℓ] = base + ℓ·layer_stride), head-major
 * or token-major caches, and a window inside a longer span (pointers moved to its first token)
 * are all read in place. */
struct kvcap_cuda_kv {
    const void *const *k;   /* host array [n_layers] of device pointers */
    const void *const *v;   /* host array [n_layers] of device pointers */
    enum kvcap_dtype dtype; /* F32, F16 or BF16 */
    size_t row_stride;      /* elements between consecutive tokens, >= d */
    size_t head_stride;     /* elements between consecutive heads */
    int n_layers, n_heads;  /* >= 1 each; n_layers · n_heads must equal the plan's batch */
};

/* A plan for the deviations of `batch` (layer, head) pairs of n tokens × d channels: two cuFFT
 * plans (a real-to-complex DCT front end and its complex-to-real inverse), each batched over
 * all 2·batch·d columns of K and V at once. The first create loads libcufft.so.12 (then
 * libcufft.so) with dlopen, so libkvcap never needs cuFFT to load; a missing library is
 * KVCAP_ERR_UNSUPPORTED naming it. n = 1 needs no transform and no cuFFT.
 * The plan holds no device buffers: cuFFT's work area is part of the call's scratch. It belongs
 * to the device current at create; use it with that device current.
 * KVCAP_ERR_INVALID_ARGUMENT for out == NULL, n, d or batch < 1, or sizes that overflow;
 * KVCAP_ERR_UNSUPPORTED without a device or cuFFT; KVCAP_ERR_DEVICE / _OUT_OF_MEMORY from
 * cuFFT's planner. *out is owned by the caller (NULL on failure). */
struct kvcap_cuda_dct;
enum kvcap_status kvcap_cuda_dct_create(int n, int d, int batch, struct kvcap_cuda_dct **out);
/* NULL is a no-op. No call using the plan may still be running (synchronise its stream). */
void kvcap_cuda_dct_free(struct kvcap_cuda_dct *plan);

/* Device scratch bytes one kvcap_cuda_flashcache_deviation call with this plan needs: about
 * 8·n·d·batch bytes for the real columns, as much for their half spectra, and cuFFT's work
 * area (0 for NULL). Split the layers over several calls when it does not fit. */
size_t kvcap_cuda_flashcache_scratch_bytes(const struct kvcap_cuda_dct *plan);

/* kvcap_flashcache_deviation for every pair of kv at once (omega clamped to [0, n] as there):
 *   dev[b·n + j]  = mean_c (K[j,c] − K_base[j,c])² + mean_c (V[j,c] − V_base[j,c])²   [batch][n]
 *   energy[b]     = {Σ K², Σ_{q<ω} C_K[q]², Σ V², Σ_{q<ω} C_V[q]²} of pair b, in double  [batch]
 * with C the orthonormal DCT-II along the tokens and Base the inverse of its first ω rows.
 * (The CPU function adds the energies of one head into *e; here each pair gets its own, so a
 * layer's struct kvcap_energy is the sum over its heads.) dev and energy are device memory. */
enum kvcap_status kvcap_cuda_flashcache_deviation(struct kvcap_cuda_dct *plan,
                                                  const struct kvcap_cuda_kv *kv, int omega,
                                                  float *dev, struct kvcap_energy *energy,
                                                  void *scratch, size_t scratch_bytes,
                                                  void *stream);

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

#endif
