/* cache_internal.h — the cache's data structures and the policy interface. A policy turns one
 * prefill span of one layer (all KV heads) into a segment, and may finish it once every layer
 * of the span is in (cross-layer budgets). At decode the cache attends over three shapes of
 * state: plain rows (full, streaming, flashcache, vlcache), KVCapsule compressed state, and
 * the FreeKV paged store of the sequence-layer. New policies plug in here (one file each:
 * policy_<name>.c). */
#ifndef KVCAP_CACHE_INTERNAL_H
#define KVCAP_CACHE_INTERNAL_H

#include <stdint.h>

#include "runtime/artifact.h"
#include "kernels/attention.h"
#include "configs/config.h"
#include "runtime/freekv.h"
#include "common/internal.h"

/* The stored state of one span at one layer, all KV heads. */
struct kvcap_segment {
    enum kvcap_span_kind kind;
    enum kvcap_policy policy;
    int n_tokens, rows, cols, p0; /* the span as the engine described it */
    /* plain rows: [kv_heads][cap][head_dim] in the storage dtype, n_rows kept */
    void *k, *v;
    int n_rows, cap;
    /* Prefill done, finish (cross-layer compression) not yet: the rows are all n_tokens,
     * and `score` ([kv_heads][n_tokens] f32, policy-defined, may be NULL) and `weight` (the
     * layer's share) wait for kvcap_cache_end_prefill. */
    int pending;
    float *score;
    double weight;
    int64_t seen; /* generated tail: tokens appended so far (streaming keeps a ring) */
    /* KVCapsule: [kv_heads][tiles][h][d], [kv_heads][tiles][rv][d], [kv_heads][d] */
    int bucket, tiles, h, rv;
    void *hs, *vt, *mu;
    int dev; /* 1 + the CUDA device holding k, v, hs, vt, mu; 0: host memory */
};

struct kvcap_seq_layer {
    struct kvcap_segment *segs;
    int n_segs, cap_segs;
    struct kvcap_segment gen; /* generated tokens (no rows when their policy is freekv) */
    /* Post-vision queries (kvcap_cache_add_post_queries), token-major [n_post][q_heads][d]. */
    float *post_q;
    int n_post;
    /* Every token routed to FreeKV (spans and generated), in order; NULL when none. */
    struct kvcap_freekv *freekv;
    int64_t freekv_tokens_by_kind[3];
};

struct kvcap_recorder;
struct kvcap_pool;

/* Per-thread scratch of attend, grown before each parallel region. */
struct kvcap_thread_scratch {
    float *qrot;    /* offset-free queries of the spans of one bucket: [spans][G][d] */
    struct kvcap_capsule_span *spans;
    float *work;    /* kvcap_capsule_attend scratch */
    size_t qrot_cap, spans_cap, work_cap;
};

struct kvcap_cache {
    struct kvcap_model_geometry g;
    int n_seqs, threads;
    enum kvcap_dtype storage;
    const struct kvcap_artifact *artifact;
    struct kvcap_runtime_config cfg;
    struct kvcap_seq_layer *layers; /* [n_seqs][n_layers] */
    struct kvcap_thread_scratch *scratch; /* [threads] */
    /* attend's partial results, [KV head][part][sequence] of (mx[G], sum[G], o[G][d]): each KV
     * head's rows are cut into `parts` slices so that all threads have work at batch 1 */
    float *parts;
    size_t parts_cap;
    int n_parts;
    struct kvcap_recorder *recorder;      /* record mode, else NULL */
    struct kvcap_pool *pool;              /* threads of attend, unless the engine's: */
    kvcap_parallel_for_fn parallel_for;
    void *parallel_user;
    struct kvcap_freekv_worker *freekv_worker; /* started with the first FreeKV state */
    int64_t tokens_by_kind[3], spans_fallback;
    uint64_t last_read, last_map_read;
    double compress_seconds;
    int reserve_tokens;       /* params.reserve_tokens */
    struct kvcap_device *dev; /* device caches (cache_device.c), else NULL */
};

static inline struct kvcap_seq_layer *kvcap_cache_seq_layer(const struct kvcap_cache *c, int seq,
                                                            int layer)
{
    return &c->layers[(size_t)seq * c->g.n_layers + (size_t)layer];
}

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

/* ---- Helpers shared by the policies ----------------------------------------------------- */

/* Reads tokens [t0, t0+n) of head h of a view as f32 rows into dst ([n][d]). */
void kvcap_view_read(const struct kvcap_tensor_view *v, int head, int t0, int n, int d,
                     float *dst);

/* Checks a view's dtype and strides for n tokens of `heads` heads of d channels. */
enum kvcap_status kvcap_view_check(const struct kvcap_tensor_view *v, const char *what, int heads,
                                   int n, int d);

/* Plain-row storage of a segment: (re)allocates room for `cap` rows per head, keeping rows. */
enum kvcap_status kvcap_segment_reserve(const struct kvcap_cache *c, struct kvcap_segment *seg,
                                        int cap);
/* Stores f32 rows ([n][d]) as rows [r0, r0+n) of head h. */
void kvcap_segment_store(const struct kvcap_cache *c, struct kvcap_segment *seg, int head, int r0,
                         int n, const float *k, const float *v);
/* Copies tokens of the view into rows: every token in tokens[0..n) of the span (NULL: 0..n-1). */
enum kvcap_status kvcap_segment_fill(struct kvcap_cache *c, struct kvcap_segment *seg,
                                     const struct kvcap_tensor_view *k,
                                     const struct kvcap_tensor_view *v, const int *tokens, int n);

/* A span's rows after eviction, built aside while the span is unchanged: a cross-layer policy
 * builds every layer's before it changes any (kvcap_segment_commit cannot fail), so a failure
 * leaves all layers as they were and end_prefill can be repeated with the same outcome. */
struct kvcap_kept_rows {
    void *k, *v; /* [kv_heads][cap][head_dim], storage dtype */
    int n_keep, cap;
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

/* Replaces seg's rows by `kept` (taking ownership) and frees the evicted ones for real. */
void kvcap_segment_commit(struct kvcap_segment *seg, struct kvcap_kept_rows *kept);

/* Frees rows built by kvcap_segment_keep_top that were not committed (NULL-safe, idempotent). */
void kvcap_kept_rows_free(struct kvcap_kept_rows *kept);

/* The FreeKV state of a sequence-layer, created on first use with the config's parameters. */
enum kvcap_status kvcap_cache_freekv(struct kvcap_cache *c, struct kvcap_seq_layer *sl,
                                     struct kvcap_freekv **out);

/* Runs fn(ctx, task, thread) for every task on the engine's threads (params.parallel_for) or
 * on the cache's pool; returns when all are done. */
void kvcap_cache_parallel(struct kvcap_cache *c, int n_tasks, kvcap_task_fn fn, void *ctx);
void kvcap_segment_release(struct kvcap_segment *seg);
uint64_t kvcap_segment_bytes(const struct kvcap_cache *c, const struct kvcap_segment *seg);

/* ---- Device caches (cache_device.c) ------------------------------------------------------ */
/* A cache with params.memory = KVCAP_MEMORY_CUDA: its segments hold device memory (seg->dev)
 * and cache.c hands the calls below the work a host cache does itself. */

struct kvcap_device;
/* Device state for `device` (validated): uploads the artifact's maps. Freed by
 * kvcap_device_free also on failure. */
enum kvcap_status kvcap_device_create(struct kvcap_cache *c, int device);
void kvcap_device_free(struct kvcap_cache *c);
void kvcap_device_set_stream(struct kvcap_cache *c, void *stream);
/* The segments of `layer` changed: its decode descriptors are rebuilt before the next step. */
void kvcap_device_layer_changed(struct kvcap_cache *c, int layer);
void kvcap_device_segment_free(struct kvcap_segment *seg);
/* kvcap_segment_fill, kvcap_segment_reserve and the KVCapsule prefill on the device. */
enum kvcap_status kvcap_device_fill(struct kvcap_cache *c, struct kvcap_segment *seg,
                                    const struct kvcap_tensor_view *k,
                                    const struct kvcap_tensor_view *v, const int *tokens, int n);
enum kvcap_status kvcap_device_reserve(struct kvcap_cache *c, struct kvcap_segment *seg, int cap);
enum kvcap_status kvcap_device_capsule_prefill(struct kvcap_cache *c, int layer,
                                               struct kvcap_segment *seg,
                                               const struct kvcap_tensor_view *k,
                                               const struct kvcap_tensor_view *v);
/* Enqueues one generated token of (seq, layer), growing the generated rows to `grow_to` rows
 * first when > 0; the caller advances the host's counts. */
enum kvcap_status kvcap_device_append(struct kvcap_cache *c, int seq, int layer,
                                      const struct kvcap_tensor_view *k,
                                      const struct kvcap_tensor_view *v, int grow_to);
/* Enqueues the attention of `layer` and sets c->last_read, c->last_map_read. */
enum kvcap_status kvcap_device_attend(struct kvcap_cache *c, int layer, const float *q, float *out,
                                      float *lse);
enum kvcap_status kvcap_device_sync(struct kvcap_cache *c);

/* ---- Record mode (record.c) -------------------------------------------------------------- */
enum kvcap_status kvcap_recorder_create(const struct kvcap_model_geometry *g, int n_seqs,
                                        const char *dir, struct kvcap_recorder **out);
void kvcap_recorder_free(struct kvcap_recorder *r); /* writes pending spans first */
/* Span number `index` of `seq` (its position among the sequence's spans, as the cache counts
 * them) at `layer`. Refuses a grid the dataset format cannot hold (kvcap_dataset_check_grid). */
enum kvcap_status kvcap_recorder_span(struct kvcap_recorder *r, int seq, int layer, int index,
                                      const struct kvcap_span_desc *span,
                                      const struct kvcap_tensor_view *k,
                                      const struct kvcap_tensor_view *v);
enum kvcap_status kvcap_recorder_post_queries(struct kvcap_recorder *r, int seq, int layer,
                                              const float *q, int n);
enum kvcap_status kvcap_recorder_decode_queries(struct kvcap_recorder *r, int layer,
                                                const float *q);
/* The prefill of `seq` ended (kvcap_cache_end_prefill succeeded): its spans are complete and
 * may be written. */
void kvcap_recorder_end_prefill(struct kvcap_recorder *r, int seq);
/* Writes the spans of every sequence whose prefill has ended; keeps the others. */
enum kvcap_status kvcap_recorder_flush(struct kvcap_recorder *r);

#endif
