/* attention.h — decode-attention kernels on one KV head: plain attention over stored K/V rows,
 * fused KVCapsule attention on compressed spans (DESIGN §4), and the log-sum-exp merge that
 * lets every span kind share one softmax. Each has a readable _ref oracle and a fast version.
 *
 * Partial results: for each query, (mx, sum, o[d]) with o = Σ_j exp(s_j − mx) v_j and
 * sum = Σ_j exp(s_j − mx) over the keys seen so far; an empty partial has mx = -INFINITY,
 * sum = 0, o = 0. The final output is o / sum. Scores are s_j = (q · k_j) * scale. */
#ifndef KVCAP_ATTENTION_H
#define KVCAP_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"

struct kvcap_partial {
    float *mx;  /* [nq] */
    float *sum; /* [nq] */
    float *o;   /* [nq][d] */
};

/* Sets nq partials to empty. */
void kvcap_partial_reset(struct kvcap_partial p, int nq, int d);

/* into ⊕= from, query by query (log-sum-exp merge). */
void kvcap_partial_merge(struct kvcap_partial into, struct kvcap_partial from, int nq, int d);

/* out[q][:] = o / sum (0 where sum == 0). */
void kvcap_partial_finish(struct kvcap_partial p, int nq, int d, float *out, size_t out_stride);

/* Rows of one KV head in the cache's storage dtype: row j at base + j * row_stride elements. */
struct kvcap_rows {
    const void *k, *v;
    enum kvcap_dtype dtype; /* F32, F16 or BF16 */
    size_t row_stride;      /* elements between consecutive tokens */
    int n;                  /* tokens */
};

/* Every kernel below returns a status and, through `bytes` (may be NULL), the bytes it read.
 * On an error (unusable arguments: KVCAP_ERR_INVALID_ARGUMENT; working memory: _OUT_OF_MEMORY)
 * nothing is folded into the partials and *bytes is 0; no rows, no queries or no tiles is
 * KVCAP_OK with 0 bytes. */

/* Plain attention of nq queries (q: [nq][d] f32, contiguous) over `rows`, folded into `acc`;
 * *bytes: the bytes of K/V read. */
enum kvcap_status kvcap_attend_rows_ref(const struct kvcap_rows *rows, const float *q, int nq,
                                        int d, float scale, struct kvcap_partial acc,
                                        uint64_t *bytes);
enum kvcap_status kvcap_attend_rows(const struct kvcap_rows *rows, const float *q, int nq, int d,
                                    float scale, struct kvcap_partial acc, uint64_t *bytes);

/* KVCapsule maps of one (layer, KV head, bucket), in f32, shared by all spans of the bucket:
 * m points per tile (m = n for dense buckets), reconstructor width h, value rank rv. */
struct kvcap_capsule_maps {
    int m, h, rv;
    const float *w2; /* [h][m] */
    const float *b2; /* [m] */
    const float *u;  /* [rv][m] */
};

/* The compressed state of one span for one KV head (storage dtype): per tile t (tiles = n / m)
 * H_t [h][d] at hs + t*h*d, Ṽ_t [rv][d] at vt + t*rv*d; mu [d]. Queries q' are already
 * rotated back by the span's p0 (q' = R(-p0) q), [nq][d] f32 contiguous. Token j of tile t is
 * point j of that tile; the kernel does not need token order (softmax is order-free). */
struct kvcap_capsule_span {
    const void *hs, *vt, *mu;
    enum kvcap_dtype dtype;
    int tiles;
    const float *q;           /* [nq][d] offset-free queries for this span */
    struct kvcap_partial acc; /* where this span's contribution is folded in */
};

/* Fused attention for `n_spans` spans of the same bucket and KV head, nq queries each:
 *   s_t = W2ᵀ (H_t q') + b2 (1ᵀ q')   (m scores per tile, times scale)
 *   o  += Σ_t (U p_t)ᵀ Ṽ_t + (Σ p) μ
 * without materialising K̂ or V̂. The fast version reads the maps from memory once for all
 * spans: dense maps through two sgemms over spans × queries; small (tiled) maps, which stay in
 * L1, tile by tile with the queries in vector lanes. *bytes: maps once + each span's H, Ṽ, μ. */
enum kvcap_status kvcap_capsule_attend_ref(const struct kvcap_capsule_maps *maps,
                                           const struct kvcap_capsule_span *spans, int n_spans,
                                           int nq, int d, float scale, uint64_t *bytes);
enum kvcap_status kvcap_capsule_attend(const struct kvcap_capsule_maps *maps,
                                       const struct kvcap_capsule_span *spans, int n_spans,
                                       int nq, int d, float scale, float *scratch,
                                       size_t scratch_floats, uint64_t *bytes);

/* Floats of scratch kvcap_capsule_attend needs for these sizes. */
size_t kvcap_capsule_scratch_floats(const struct kvcap_capsule_maps *maps, int n_spans,
                                    int max_tiles, int nq, int d);

#endif
