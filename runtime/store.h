/* store.h — where a cache's K/V live and how decode attends over them: the store interface,
 * in the shape of ggml's backend table. The cache's front (cache.c) checks arguments, routes
 * spans to policies, ends prefill and counts; everything that touches the stored state goes
 * through the table of the cache's store, and the front never asks which store it is. Each
 * store answers what it supports. Two stores exist: host memory (cache_host.c, every build)
 * and CUDA device memory (cache_device.c, CUDA builds). */
#ifndef KVCAP_STORE_H
#define KVCAP_STORE_H

#include <stdint.h>

#include "kvcap.h"

struct kvcap_cache;
struct kvcap_segment;

struct kvcap_store_i {
    const char *name; /* "host", "cuda" */
    /* The engine's K/V and queries are host memory: the front may read them (value checks,
     * the post-vision queries policies keep, record mode). */
    int host_memory;
    /* 1 when segments of policy p can be held and attended here. */
    int (*offers)(enum kvcap_policy p);
    /* (optional) Whether the store can serve this cache (its runtime config is loaded and
     * checked): KVCAP_ERR_UNSUPPORTED naming the config field or parameter it cannot serve. */
    enum kvcap_status (*supports)(const struct kvcap_cache *c,
                                  const struct kvcap_cache_params *p);
    /* (optional) The store's own state, once the cache is built; freed by `free` also on
     * failure. */
    enum kvcap_status (*create)(struct kvcap_cache *c, const struct kvcap_cache_params *p);
    void (*free)(struct kvcap_cache *c); /* (optional) */

    /* Plain rows: room for `cap` rows per head (cap > seg->cap), keeping the rows held. */
    enum kvcap_status (*reserve)(struct kvcap_cache *c, struct kvcap_segment *seg, int cap);
    /* Copies tokens[0..n) of the span's views (NULL: 0..n-1) into rows 0..n-1. */
    enum kvcap_status (*fill)(struct kvcap_cache *c, struct kvcap_segment *seg,
                              const struct kvcap_tensor_view *k,
                              const struct kvcap_tensor_view *v, const int *tokens, int n);
    /* KVCapsule's compressed state of a span with a bucket (seg->bucket set). */
    enum kvcap_status (*capsule_prefill)(struct kvcap_cache *c, int layer,
                                         struct kvcap_segment *seg,
                                         const struct kvcap_tensor_view *k,
                                         const struct kvcap_tensor_view *v);
    /* Frees a segment's stored state (not the struct). */
    void (*segment_free)(struct kvcap_segment *seg);
    /* (optional) The segments of `layer` changed (a span was added). */
    void (*layer_changed)(struct kvcap_cache *c, int layer);

    /* One generated token of (seq, layer), prefill of seq ended, views checked. */
    enum kvcap_status (*append)(struct kvcap_cache *c, int seq, int layer,
                                const struct kvcap_tensor_view *k,
                                const struct kvcap_tensor_view *v);
    /* Decode attention of `layer` for every sequence (kvcap_cache_attend_lse's contract once
     * its arguments are checked and prefill has ended); sets c->last_read, c->last_map_read. */
    enum kvcap_status (*attend)(struct kvcap_cache *c, int layer, const float *q, float *out,
                                float *lse);
    /* kvcap_cache_set_stream and kvcap_cache_sync. */
    enum kvcap_status (*set_stream)(struct kvcap_cache *c, void *stream);
    enum kvcap_status (*sync)(struct kvcap_cache *c);
};

extern const struct kvcap_store_i kvcap_store_host;
#ifdef KVCAP_WITH_CUDA
extern const struct kvcap_store_i kvcap_store_cuda;
#endif

#endif /* KVCAP_STORE_H */
