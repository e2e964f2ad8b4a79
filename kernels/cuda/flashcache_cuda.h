/* flashcache_cuda.h — FlashCache's scoring on a CUDA device (kernels/cuda/flashcache.cu):
 * the numbers kernels/flashcache.h computes per KV head, for every (layer, KV head) of a span
 * in a handful of launches, and the DCT plan they run on. Tests: tests/test_flashcache_cuda.c.
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
 *    enqueued (nothing is written then); KVCAP_ERR_UNSUPPORTED for no device, or libcufft
 *    missing; KVCAP_ERR_DEVICE naming the CUDA or cuFFT call that failed
 *    (KVCAP_ERR_OUT_OF_MEMORY when that failure was an allocation). A launch error is caught at
 *    the launch; a fault inside a kernel surfaces at the caller's next synchronisation, as for
 *    any asynchronous CUDA work. Nothing here prints or exits.
 *  - Threads: calls without a plan are reentrant. A plan serves one call at a time (its cuFFT
 *    handles are bound to the call's stream and scratch while it enqueues).
 *  - Batch index: the (layer ℓ, KV head h) pair of a call is b = ℓ·n_heads + h in every output. */
#ifndef KVCAP_FLASHCACHE_CUDA_H
#define KVCAP_FLASHCACHE_CUDA_H

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

#ifdef __cplusplus
}
#endif

#endif /* KVCAP_FLASHCACHE_CUDA_H */
