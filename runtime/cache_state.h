/* cache_state.h — the data model of a cache: per (sequence, layer) the segments of its prefill
 * spans, the generated tail and the FreeKV store; the cache with its config, store, scratch and
 * counts. Internal to runtime/: the front (cache.c), the stores and the policies share it. */
#ifndef KVCAP_CACHE_STATE_H
#define KVCAP_CACHE_STATE_H

#include <stdint.h>

#include "configs/config.h"
#include "kernels/attention.h"
#include "runtime/artifact.h"
#include "runtime/freekv.h"
#include "runtime/store.h"
#include "common/internal.h"

/* The stored state of one span at one layer, all KV heads. */
struct kvcap_segment {
    enum kvcap_span_kind kind;
    enum kvcap_policy policy;
    int n_tokens, rows, cols, p0; /* the span as the engine described it */
    /* plain rows: [kv_heads][cap][head_dim] in the storage dtype, n_rows kept; or, after an
     * eviction that keeps a different number of rows per head (kvzip), packed: head h's rows
     * are rows [head_at[h], head_at[h + 1]) of k and v (head_at: kv_heads + 1 entries), and
     * n_rows is the most any head holds (kvcap_segment_head_rows reads both layouts) */
    void *k, *v;
    int n_rows, cap;
    int64_t *head_at;
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
    /* kvzip with values: basis, after its finish: v is NULL, each kept row's value comes from
     * the value state vt and mu (as KVCapsule's, through the unit's basis U), and row_point
     * (laid out like the rows) holds each kept row's place in it, tile · m + point. */
    int32_t *row_point;
    /* and, with kvzip.exact_values, per KV head n_vx exact values [kv_heads][n_vx][d] (storage
     * dtype) of the rows whose point is −1 − x */
    void *vx;
    int n_vx;
    int dev; /* 1 + the CUDA device holding k, v, hs, vt, mu (the device store); 0: host memory */
};

struct kvcap_seq_layer {
    struct kvcap_segment *segs;
    int n_segs, cap_segs;
    struct kvcap_segment gen; /* generated tokens (no rows when their policy is freekv) */
    /* Post-vision queries (kvcap_cache_add_post_queries), token-major [n_post][q_heads][d], and
     * each one's log-sum-exp over keys the cache does not hold ([n_post][q_heads]; NULL: none
     * given, -inf everywhere). */
    float *post_q, *post_lse;
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
    const struct kvcap_store_i *store; /* where the K/V live (store.h) */
    struct kvcap_device *dev;          /* the device store's state (cache_device.c), else NULL */
};

static inline struct kvcap_seq_layer *kvcap_cache_seq_layer(const struct kvcap_cache *c, int seq,
                                                            int layer)
{
    return &c->layers[(size_t)seq * c->g.n_layers + (size_t)layer];
}

#endif /* KVCAP_CACHE_STATE_H */
