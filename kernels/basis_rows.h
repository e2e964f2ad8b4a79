/* basis_rows.h — decode attention over kept keys whose values live in a KVCapsule value basis
 * (kvzip with `values: basis`, runtime/policy_kvzip.c), one KV head of one span. The span keeps
 * some of its keys as plain rows and, for its values, KVCapsule's value state: per tile t the
 * coefficients Ṽ_t = U (V_t − 1μᵀ) (rv × d) and the span's mean μ (d). Kept row j is point p_j
 * of tile t_j, and its value is
 *   v̂_j = Σ_r U[r][p_j] Ṽ_{t_j}[r] + μ.
 * Attention over the kept rows, s_j = (q · k_j) · scale and p = exp(s − mx), then needs no v̂:
 *   o = Σ_t Ṽ_tᵀ c_t + (Σ_j p_j) μ,   c_t[r] = Σ_{j in tile t} p_j U[r][p_j],
 * so a step reads the kept keys, their points, Ṽ and μ. A row may instead hold its value exactly
 * (point −1 − x: row x of `vx`), for the few tokens the basis reconstructs worst (an image's
 * attention-sink patches): it adds p_j vx_x and no μ. Partials and their merge are
 * kernels/attention.h's. The test is tests/test_basis_rows.c. */
#ifndef KVCAP_BASIS_ROWS_H
#define KVCAP_BASIS_ROWS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/attention.h"

struct kvcap_basis_rows {
    const void *k;          /* [n] rows of d channels, row j at k + j · row_stride elements */
    enum kvcap_dtype dtype; /* of k, vt and mu: F32, F16 or BF16 */
    size_t row_stride;
    int n;                  /* kept rows */
    const int32_t *point;   /* [n]: t_j · m + p_j in [0, tiles · m), or −1 − x: value vx[x] */
    int m, rv, tiles;       /* points per tile, basis rank, tiles */
    const float *u;         /* [rv][m] f32: the unit's value basis */
    const void *vt;         /* [tiles][rv][d] */
    const void *mu;         /* [d] */
    const void *vx;         /* [n_vx][d]: exact values (NULL when n_vx is 0) */
    int n_vx;
};

/* Attention of nq queries (q: [nq][d] f32, contiguous) over `rows`, folded into `acc`; *bytes
 * (may be NULL): the bytes read (keys, points, Ṽ, μ, exact values and the basis). The oracle rebuilds each
 * v̂_j (summed in double) and runs kvcap_attend_rows_ref over the keys and those rows.
 * KVCAP_ERR_INVALID_ARGUMENT for NULL pointers, a point out of range or a dtype that is not a
 * storage one; KVCAP_ERR_OUT_OF_MEMORY (the oracle's working memory).
 * Nothing is folded on an error; no rows or no queries is KVCAP_OK with 0 bytes. */
enum kvcap_status kvcap_attend_basis_rows_ref(const struct kvcap_basis_rows *rows, const float *q,
                                              int nq, int d, float scale,
                                              struct kvcap_partial acc, uint64_t *bytes);
/* The same through the coefficients c_t (no v̂), with sgemms for the scores and for Ṽᵀc;
 * `scratch` holds kvcap_attend_basis_rows_scratch_floats() floats. */
enum kvcap_status kvcap_attend_basis_rows(const struct kvcap_basis_rows *rows, const float *q,
                                          int nq, int d, float scale, struct kvcap_partial acc,
                                          float *scratch, size_t scratch_floats,
                                          uint64_t *bytes);
size_t kvcap_attend_basis_rows_scratch_floats(int n, int tiles, int rv, int n_vx, int nq, int d);

#endif /* KVCAP_BASIS_ROWS_H */
