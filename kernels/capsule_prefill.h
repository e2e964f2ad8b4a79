/* capsule_prefill.h — KVCapsule at prefill (DESIGN §4), one KV head of one span: the keys are
 * made offset-free (K' = R(−p0) K), the retained rows of each tile go through the first
 * reconstructor layer, H_t = φ(W1ᵀ K'[M_t] + b1 1ᵀ), and the centred values through the basis,
 * Ṽ_t = U (V_t − 1μᵀ), μ the values' mean over the span. Only H, Ṽ and μ are kept: decode
 * attends over them (kvcap_capsule_attend, kernels/attention.h). The device twin is
 * kernels/cuda/capsule_prefill.cu; the test, tests/test_capsule_prefill.c. */
#ifndef KVCAP_CAPSULE_PREFILL_H
#define KVCAP_CAPSULE_PREFILL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/attention.h"
#include "kvcap.h"

/* The prefill half of one (layer, KV head, bucket)'s maps, in f32: m points per tile (m = n for
 * a dense bucket), the rk retained points `mask` of a tile (point indices 0..m−1), the first
 * reconstructor layer W1 [rk][h] and b1 [h] with φ = GELU (gelu != 0) or the identity, and the
 * value basis U [rv][m]. */
struct kvcap_capsule_prefill_maps {
    int m, rk, h, rv, gelu;
    const int32_t *mask;
    const float *w1, *b1, *u;
};

/* One KV head of a span of n tokens laid on `bucket` (tiles = n / m, token order of
 * kvcap_bucket_token), head_dim d, starting at position p0 (RoPE by g). k, v: [n][d] f32.
 * Writes, in `storage` (F32, F16 or BF16): hs [tiles][h][d], vt [tiles][rv][d], mu [d].
 * KVCAP_ERR_INVALID_ARGUMENT for NULL pointers, sizes that do not fit (n not a multiple of m,
 * m not the bucket's tile size, a mask point out of range) or a non-storage dtype;
 * KVCAP_ERR_OUT_OF_MEMORY (the oracle's working memory). Nothing is written on an error. */
enum kvcap_status kvcap_capsule_prefill_ref(const struct kvcap_model_geometry *g,
                                            const struct kvcap_bucket *bucket,
                                            const struct kvcap_capsule_prefill_maps *maps, int n,
                                            int d, int64_t p0, const float *k, const float *v,
                                            enum kvcap_dtype storage, void *hs, void *vt,
                                            void *mu);

/* The same, fast: sgemm per tile, RoPE through kvcap_rope_rotate. `k` is rotated in place
 * (it holds K' afterwards) and `scratch` holds kvcap_capsule_prefill_scratch_floats() floats. */
enum kvcap_status kvcap_capsule_prefill(const struct kvcap_model_geometry *g,
                                        const struct kvcap_bucket *bucket,
                                        const struct kvcap_capsule_prefill_maps *maps, int n,
                                        int d, int64_t p0, float *k, const float *v,
                                        enum kvcap_dtype storage, void *hs, void *vt, void *mu,
                                        float *scratch);

/* Floats of scratch kvcap_capsule_prefill needs: (m + max(h, rv) + 1) · d. */
size_t kvcap_capsule_prefill_scratch_floats(const struct kvcap_capsule_prefill_maps *maps, int d);

/* The value half of kvcap_capsule_prefill alone (kvzip's value basis, runtime/policy_kvzip.c):
 * μ, the mean of v ([n][d] f32) over the span, and Ṽ_t = U (V_t − 1μᵀ) of every tile through the
 * basis u ([rv][m] f32, rank 0 allowed: only μ), written in `storage` to vt [tiles][rv][d] and
 * mu [d]. scratch: kvcap_capsule_prefill_values_scratch_floats() floats, (m + rv + 1) · d.
 * KVCAP_ERR_INVALID_ARGUMENT for NULL pointers, sizes that do not fit the bucket or a
 * non-storage dtype; nothing is written then. */
enum kvcap_status kvcap_capsule_prefill_values(const struct kvcap_bucket *bucket, int m, int rv,
                                               const float *u, int n, int d, const float *v,
                                               enum kvcap_dtype storage, void *vt, void *mu,
                                               float *scratch);
size_t kvcap_capsule_prefill_values_scratch_floats(int m, int rv, int d);

/* The value state fitted to a subset of the tokens (kvzip's value basis, runtime/policy_kvzip.c:
 * decode reads a value only through a kept key, so only the kept tokens' values matter). With
 * F the tokens where fit[j] != 0 ([n], token order): μ = the mean of v over F (0 if F is
 * empty), and per tile t, with P its points in F,
 *   Ṽ_t = argmin_X Σ_{p∈P} ‖v_p − μ − Σ_r U[r][p] X[r]‖² + λ ‖X‖²,   λ = KVCAP_FIT_RIDGE,
 * solved as (U_P U_Pᵀ + λI) X = U_P (V_P − 1μᵀ) in double. With every token in F this is
 * kvcap_capsule_prefill_values' projection (U's rows are orthonormal) up to the factor
 * 1/(1 + λ); a tile with at most rv points in F reconstructs them almost exactly, and a token
 * outside F, an outlier included, moves nothing. Same sizes, storage and outputs as
 * kvcap_capsule_prefill_values; scratch: kvcap_capsule_fit_values_scratch_doubles() doubles.
 * KVCAP_ERR_INVALID_ARGUMENT as there; KVCAP_ERR_NUMERIC if a solve fails (it cannot for
 * finite input: the system is positive definite; vt may then hold some tiles). Nothing is
 * written on an invalid argument. */
#define KVCAP_FIT_RIDGE 1e-6
enum kvcap_status kvcap_capsule_fit_values(const struct kvcap_bucket *bucket, int m, int rv,
                                           const float *u, int n, int d, const float *v,
                                           const unsigned char *fit, enum kvcap_dtype storage,
                                           void *vt, void *mu, double *scratch);
size_t kvcap_capsule_fit_values_scratch_doubles(int m, int rv, int d);

/* How badly KVCapsule reconstructs each tile of one KV head of a span (kvcap's exact tiles): for
 * tile t, the largest over its points p of
 *   ‖k̂'_p − k'_p‖² / k2 + ‖v̂_p − v_p‖² / v2,
 *   k̂'_p = Σ_a W2[a][p] H_t[a] + b2[p]   (the key decode attends over, kvcap_capsule_attend)
 *   v̂_p  = Σ_r U[r][p] Ṽ_t[r] + μ
 * with k2 and v2 the span's mean ‖k'‖² and ‖v − μ‖² (1 where 0). One token the maps cannot
 * predict is enough to mark its tile: an image's attention-sink patches, whose keys and values
 * no neighbour resembles, are what it finds. kr: the offset-free keys K' [n][d]; v [n][d];
 * hs [tiles][h][d], vt [tiles][rv][d] and mu [d] in f32, as kvcap_capsule_prefill writes them
 * with storage F32. Writes err [tiles]. KVCAP_ERR_INVALID_ARGUMENT for NULL pointers or sizes
 * that do not fit (n not a multiple of m, m not the bucket's tile size). */
enum kvcap_status kvcap_capsule_tile_error_ref(const struct kvcap_bucket *bucket,
                                               const struct kvcap_capsule_maps *maps, int n,
                                               int d, const float *kr, const float *v,
                                               const float *hs, const float *vt,
                                               const float *mu, float *err);
/* The same, fast: two sgemms per tile; `scratch` holds
 * kvcap_capsule_tile_error_scratch_floats() floats. */
enum kvcap_status kvcap_capsule_tile_error(const struct kvcap_bucket *bucket,
                                           const struct kvcap_capsule_maps *maps, int n, int d,
                                           const float *kr, const float *v, const float *hs,
                                           const float *vt, const float *mu, float *err,
                                           float *scratch);
size_t kvcap_capsule_tile_error_scratch_floats(const struct kvcap_capsule_maps *maps, int d);
/* The same errors from per-point sums over the channels, points [tiles·m][4] (point p of tile t
 * at t·m + p): ‖k'_p‖², ‖v_p − μ‖², ‖k̂'_p − k'_p‖², ‖v̂_p − v_p‖², as the device computes them
 * (kvcap_cuda_capsule_point_errors); err [tiles]. */
void kvcap_capsule_tile_error_points(const double *points, int tiles, int m, float *err);

#endif /* KVCAP_CAPSULE_PREFILL_H */
