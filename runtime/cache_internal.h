/* cache_internal.h — the policy interface and the helpers policies and stores share (views:
 * view.c; segments: segment.c). A policy turns one prefill span of one layer (all KV heads)
 * into a segment, and may finish it once every layer of the span is in (cross-layer budgets).
 * At decode the store attends over three shapes of state: plain rows (full, streaming,
 * flashcache, vlcache), KVCapsule compressed state, and the FreeKV paged store of the
 * sequence-layer. New policies plug in here (one file each: policy_<name>.c); the data model is
 * cache_state.h, the stores' interface store.h. */
#ifndef KVCAP_CACHE_INTERNAL_H
#define KVCAP_CACHE_INTERNAL_H

#include <stdint.h>

#include "runtime/cache_state.h"
#include "runtime/record.h"

/* What a policy does with a prefill span. */
struct kvcap_policy_impl {
    enum kvcap_policy id;
    /* Fill `seg` (kind, geometry and policy already set) from the engine's K/V of one layer.
     * A policy with a finish step keeps all rows and sets seg->pending. */
    enum kvcap_status (*prefill)(struct kvcap_cache *c, int seq, int layer,
                                 struct kvcap_segment *seg, const struct kvcap_tensor_view *k,
                                 const struct kvcap_tensor_view *v);
    /* Optional: compress span `span` of `seq` with every layer's segment in view (called by
     * kvcap_cache_end_prefill while the segments are pending; clears pending). On failure the
     * segments stay pending and intact. */
    enum kvcap_status (*finish)(struct kvcap_cache *c, int seq, int span);
};

extern const struct kvcap_policy_impl kvcap_policy_full_impl;
extern const struct kvcap_policy_impl kvcap_policy_streaming_impl;
extern const struct kvcap_policy_impl kvcap_policy_kvcapsule_impl;
extern const struct kvcap_policy_impl kvcap_policy_flashcache_impl;
extern const struct kvcap_policy_impl kvcap_policy_vlcache_impl;
extern const struct kvcap_policy_impl kvcap_policy_freekv_impl;
extern const struct kvcap_policy_impl kvcap_policy_kvzip_impl;
extern const struct kvcap_policy_impl kvcap_policy_random_impl;
extern const struct kvcap_policy_impl kvcap_policy_expected_impl;

/* ---- Helpers shared by the policies ----------------------------------------------------- */

/* Reads tokens [t0, t0+n) of head h of a view as f32 rows into dst ([n][d]). */
void kvcap_view_read(const struct kvcap_tensor_view *v, int head, int t0, int n, int d,
                     float *dst);

/* Checks a view's dtype and strides for n tokens of `heads` heads of d channels. */
enum kvcap_status kvcap_view_check(const struct kvcap_tensor_view *v, const char *what, int heads,
                                   int n, int d);

/* KVCAP_ERR_NUMERIC naming `what` and where, for a NaN or Inf among n tokens of a host view. */
enum kvcap_status kvcap_view_check_finite(const struct kvcap_tensor_view *v, const char *what,
                                          int heads, int n, int d);

/* Plain-row storage of a segment: (re)allocates room for `cap` rows per head, keeping rows. */
enum kvcap_status kvcap_segment_reserve(struct kvcap_cache *c, struct kvcap_segment *seg, int cap);
/* Copies tokens of the view into rows: every token in tokens[0..n) of the span (NULL: 0..n-1). */
enum kvcap_status kvcap_segment_fill(struct kvcap_cache *c, struct kvcap_segment *seg,
                                     const struct kvcap_tensor_view *k,
                                     const struct kvcap_tensor_view *v, const int *tokens, int n);

/* kvcap's exact tiles (capsule_exact.c). How many of a span's `tiles` each KV head keeps as
 * rows: kvcapsule.exact_tiles, at most all but one. */
int kvcap_capsule_exact_count(const struct kvcap_cache *c, int tiles);
/* One KV head of a KVCapsule span with `exact` (>= 1) tiles kept as rows: the state of every
 * tile and its reconstruction error (kvcap_capsule_tile_error) in f32, then, in `storage`, the
 * other tiles' state, in tile order, to hs [tiles − exact][h][d] and vt [tiles − exact][rv][d],
 * μ to mu [d], and the worst tiles' tokens to k_rows and v_rows [exact · m][d] (each tile's m
 * points in order; keys as given, not offset-free). k, v: the head's n keys and values, f32
 * [n][d], as the engine gave them. work: kvcap_capsule_exact_work_floats() floats. Errors are
 * the kernels' (kernels/capsule_prefill.h); what was written is then meaningless. */
enum kvcap_status kvcap_capsule_exact_head(const struct kvcap_model_geometry *g,
                                           const struct kvcap_bucket *bk,
                                           const struct kvcap_unit_maps *u, int n, int d,
                                           int64_t p0, int exact, const float *k, const float *v,
                                           enum kvcap_dtype storage, void *hs, void *vt,
                                           void *mu, void *k_rows, void *v_rows, float *work);
size_t kvcap_capsule_exact_work_floats(const struct kvcap_unit_maps *u, int n, int d);
/* The device store's half of the same choice: the tile errors from per-point sums
 * (kvcap_capsule_tile_error_points: points [tiles·m][4] as kvcap_cuda_capsule_point_errors
 * writes them) to err [tiles], and the `exact` worst marked in pick [tiles] (ties: the lower
 * tile), as kvcap_capsule_exact_head picks them. */
void kvcap_capsule_exact_pick(const double *points, int tiles, int m, int exact, float *err,
                              unsigned char *pick);

/* The compressible tokens [lo, hi) of an n-token span whose first `sinks` and last `window`
 * tokens are protected (clamped: sinks first, then the window from what is left). */
static inline void kvcap_protected_range(int n, int sinks, int window, int *lo, int *hi)
{
    *lo = sinks < n ? sinks : n;
    *hi = n - (window < n - *lo ? window : n - *lo);
}

/* Whether a segment's plain rows belong to the prompt a scoring pass attends over (VL-Cache's
 * post-vision queries, KVzip's reconstruction queries): rows held, not KVCapsule's state. */
static inline int kvcap_segment_is_prompt_rows(const struct kvcap_segment *s)
{
    return s->k && s->n_rows > 0 && s->policy != KVCAP_POLICY_KVCAPSULE;
}

/* Prefill of a policy that scores once every layer is in (vlcache, kvzip): every row kept,
 * the segment pending until its finish. */
enum kvcap_status kvcap_segment_fill_pending(struct kvcap_cache *c, int seq, int layer,
                                             struct kvcap_segment *seg,
                                             const struct kvcap_tensor_view *k,
                                             const struct kvcap_tensor_view *v);

/* Head h's plain rows of a segment: the first row's index into k and v (rows of head_dim
 * elements) and how many, for either layout (cache_state.h). */
static inline void kvcap_segment_head_rows(const struct kvcap_segment *s, int h, size_t *at,
                                           int *n)
{
    if (s->head_at) {
        *at = (size_t)s->head_at[h];
        *n = (int)(s->head_at[h + 1] - s->head_at[h]);
    } else {
        *at = (size_t)h * (size_t)s->cap;
        *n = s->n_rows;
    }
}

/* A span's rows after eviction, built aside while the span is unchanged: a cross-layer policy
 * builds every layer's before it changes any (kvcap_segment_commit cannot fail), so a failure
 * leaves all layers as they were and end_prefill can be repeated with the same outcome. */
struct kvcap_kept_rows {
    void *k, *v;      /* [kv_heads][cap][head_dim], storage dtype; packed when head_at is set */
    int n_keep, cap;  /* packed: n_keep the most rows a head keeps, cap unused */
    int64_t *head_at; /* NULL, or the packed layout's kv_heads + 1 row offsets */
    /* Values in a value basis instead of v (NULL then): kvcap_segment.row_point, vt, mu, vx */
    int32_t *point;
    void *vt, *mu, *vx;
    int tiles, rv, n_vx;
};

/* Eviction by score, the step FlashCache and VL-Cache share: each head h keeps the protected
 * rows [0, lo) and [hi, n_rows), plus the `budget` rows of [lo, hi) with the largest scores
 * (score + h * head_stride, hi − lo floats, token lo first), copied in token order into a new
 * allocation of exactly the rows kept (*out); `seg` is not changed. budget is clamped to
 * [0, hi − lo]. */
enum kvcap_status kvcap_segment_keep_top(const struct kvcap_cache *c,
                                         const struct kvcap_segment *seg, const float *score,
                                         size_t head_stride, int lo, int hi, int budget,
                                         struct kvcap_kept_rows *out);

/* Eviction by mark: each head h keeps the rows j of seg with mark[h * seg->n_rows + j] != 0, in
 * token order, packed (kvcap_kept_rows.head_at) when the heads keep different numbers of rows;
 * with keys_only their keys alone (out->v NULL: the caller holds the values otherwise). `seg`
 * (plain rows, not packed) is not changed. */
enum kvcap_status kvcap_segment_keep_marked(const struct kvcap_cache *c,
                                            const struct kvcap_segment *seg,
                                            const unsigned char *mark, int keys_only,
                                            struct kvcap_kept_rows *out);

/* Replaces seg's rows (and, when kept has them, its value state) by `kept` (taking ownership)
 * and frees the evicted ones for real. */
void kvcap_segment_commit(struct kvcap_segment *seg, struct kvcap_kept_rows *kept);

/* The end of a cross-layer finish of span `span` of `seq`, with kept[l] built for every pending
 * layer l: when st is KVCAP_OK every pending layer's rows are replaced by kept[l], its score
 * freed and the segment no longer pending (all layers or none, so a failed finish leaves the
 * span as it was); then whatever kept still holds is freed. Returns st. */
enum kvcap_status kvcap_span_commit(struct kvcap_cache *c, int seq, int span,
                                    struct kvcap_kept_rows *kept, enum kvcap_status st);

/* Frees rows built by kvcap_segment_keep_top that were not committed (NULL-safe, idempotent). */
void kvcap_kept_rows_free(struct kvcap_kept_rows *kept);

/* The FreeKV state of a sequence-layer, created on first use with the config's parameters. */
enum kvcap_status kvcap_cache_freekv(struct kvcap_cache *c, struct kvcap_seq_layer *sl,
                                     struct kvcap_freekv **out);

/* Runs fn(ctx, task, thread) for every task on the engine's threads (params.parallel_for) or
 * on the cache's pool; returns when all are done. The host store's (cache_host.c), used by it
 * and by the policies that score on the host. */
void kvcap_cache_parallel(struct kvcap_cache *c, int n_tasks, kvcap_task_fn fn, void *ctx);
/* Frees a segment's stored state through the cache's store (not the struct). */
void kvcap_segment_release(const struct kvcap_cache *c, struct kvcap_segment *seg);

/* Row of the next generated token; *grow_to > 0 when the rows must first grow to that many. */
int kvcap_segment_gen_row(const struct kvcap_cache *c, const struct kvcap_segment *gen,
                          int *grow_to);
uint64_t kvcap_segment_bytes(const struct kvcap_cache *c, const struct kvcap_segment *seg);

#endif
