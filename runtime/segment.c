/* segment.c — a segment's plain rows (reserve, store, fill through the cache's store), the
 * eviction FlashCache and VL-Cache share (keep the top rows, commit), the generated tail's next
 * row, release and bytes. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/select.h"
#include "runtime/cache_internal.h"

enum kvcap_status kvcap_segment_reserve(struct kvcap_cache *c, struct kvcap_segment *seg, int cap)
{
    if (cap <= seg->cap)
        return KVCAP_OK;
    return c->store->reserve(c, seg, cap);
}


enum kvcap_status kvcap_segment_fill_pending(struct kvcap_cache *c, int seq, int layer,
                                             struct kvcap_segment *seg,
                                             const struct kvcap_tensor_view *k,
                                             const struct kvcap_tensor_view *v)
{
    (void)seq, (void)layer;
    KVCAP_TRY(kvcap_segment_fill(c, seg, k, v, NULL, seg->n_tokens));
    seg->pending = 1;
    return KVCAP_OK;
}

enum kvcap_status kvcap_segment_fill(struct kvcap_cache *c, struct kvcap_segment *seg,
                                     const struct kvcap_tensor_view *k,
                                     const struct kvcap_tensor_view *v, const int *tokens, int n)
{
    return c->store->fill(c, seg, k, v, tokens, n);
}

/* Copies, for each head h, the rows keep[h][0..n_keep) (ascending) of seg into a new allocation
 * of exactly n_keep rows (keys only, out->v NULL, when keys_only). keep: [kv_heads][n_keep]. */
static enum kvcap_status copy_kept(const struct kvcap_cache *c, const struct kvcap_segment *seg,
                                   const int *keep, int n_keep, int keys_only,
                                   struct kvcap_kept_rows *out)
{
    size_t d = (size_t)c->g.head_dim, H = (size_t)c->g.n_kv_heads;
    size_t es = kvcap_dtype_size(c->storage), row = d * es;
    size_t cap = n_keep > 0 ? (size_t)n_keep : 1;
    char *k = malloc(H * cap * row), *v = keys_only ? NULL : malloc(H * cap * row);
    if (!k || (!keys_only && !v)) {
        free(k), free(v);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory compacting a span");
    }
    for (size_t h = 0; h < H; h++)
        for (int i = 0; i < n_keep; i++) {
            size_t from = (h * (size_t)seg->cap + (size_t)keep[h * (size_t)n_keep + i]) * row;
            memcpy(k + (h * cap + (size_t)i) * row, (const char *)seg->k + from, row);
            if (v)
                memcpy(v + (h * cap + (size_t)i) * row, (const char *)seg->v + from, row);
        }
    *out = (struct kvcap_kept_rows){.k = k, .v = v, .n_keep = n_keep, .cap = (int)cap};
    return KVCAP_OK;
}

enum kvcap_status kvcap_segment_keep_marked(const struct kvcap_cache *c,
                                            const struct kvcap_segment *seg,
                                            const unsigned char *mark, int keys_only,
                                            struct kvcap_kept_rows *out)
{
    const int H = c->g.n_kv_heads, n = seg->n_rows;
    int64_t *at = malloc(sizeof(int64_t) * (size_t)(H + 1));
    KVCAP_RETURN_IF(!at, KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory evicting a span");
    int most = 0, ragged = 0;
    at[0] = 0;
    for (int h = 0; h < H; h++) {
        int kept = 0;
        for (int j = 0; j < n; j++)
            kept += mark[(size_t)h * n + j] != 0;
        at[h + 1] = at[h] + kept;
        ragged |= h > 0 && kept != at[1];
        most = kept > most ? kept : most;
    }
    int *keep = malloc(sizeof(int) * (size_t)(at[H] > 0 ? at[H] : 1));
    enum kvcap_status st = keep ? KVCAP_OK
                                : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY,
                                             "cache: out of memory evicting a span");
    for (int h = 0, i = 0; st == KVCAP_OK && h < H; h++)
        for (int j = 0; j < n; j++)
            if (mark[(size_t)h * n + j])
                keep[i++] = j;
    if (st == KVCAP_OK && !ragged) {
        st = copy_kept(c, seg, keep, most, keys_only, out);
        free(at);
        at = NULL;
    } else if (st == KVCAP_OK) {
        size_t row = (size_t)c->g.head_dim * kvcap_dtype_size(c->storage);
        size_t total = at[H] > 0 ? (size_t)at[H] : 1;
        char *k = malloc(total * row), *v = keys_only ? NULL : malloc(total * row);
        if (!k || (!keys_only && !v)) {
            free(k), free(v);
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory compacting a span");
        } else {
            for (int h = 0; h < H; h++)
                for (int64_t i = at[h]; i < at[h + 1]; i++) {
                    size_t from = ((size_t)h * seg->cap + (size_t)keep[i]) * row;
                    memcpy(k + (size_t)i * row, (const char *)seg->k + from, row);
                    if (v)
                        memcpy(v + (size_t)i * row, (const char *)seg->v + from, row);
                }
            *out = (struct kvcap_kept_rows){.k = k, .v = v, .n_keep = most, .head_at = at};
            at = NULL;
        }
    }
    free(at);
    free(keep);
    return st;
}

void kvcap_segment_commit(struct kvcap_segment *seg, struct kvcap_kept_rows *kept)
{
    free(seg->k), free(seg->v), free(seg->head_at);
    seg->k = kept->k;
    seg->v = kept->v;
    seg->cap = kept->cap;
    seg->n_rows = kept->n_keep;
    seg->head_at = kept->head_at;
    if (kept->point) {
        free(seg->row_point), free(seg->vt), free(seg->mu);
        seg->row_point = kept->point;
        seg->vt = kept->vt;
        seg->mu = kept->mu;
        seg->tiles = kept->tiles;
        seg->rv = kept->rv;
        free(seg->vx);
        seg->vx = kept->vx;
        seg->n_vx = kept->n_vx;
    }
    *kept = (struct kvcap_kept_rows){0};
}

enum kvcap_status kvcap_span_commit(struct kvcap_cache *c, int seq, int span,
                                    struct kvcap_kept_rows *kept, enum kvcap_status st)
{
    for (int l = 0; kept && l < c->g.n_layers; l++) {
        struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, seq, l)->segs[span];
        if (st == KVCAP_OK && seg->pending) {
            kvcap_segment_commit(seg, &kept[l]);
            free(seg->score);
            seg->score = NULL;
            seg->pending = 0;
        }
        kvcap_kept_rows_free(&kept[l]);
    }
    return st;
}

void kvcap_kept_rows_free(struct kvcap_kept_rows *kept)
{
    if (!kept)
        return;
    free(kept->k), free(kept->v), free(kept->head_at);
    free(kept->point), free(kept->vt), free(kept->mu), free(kept->vx);
    *kept = (struct kvcap_kept_rows){0};
}

enum kvcap_status kvcap_segment_keep_top(const struct kvcap_cache *c,
                                         const struct kvcap_segment *seg, const float *score,
                                         size_t head_stride, int lo, int hi, int budget,
                                         struct kvcap_kept_rows *out)
{
    int H = c->g.n_kv_heads, n = seg->n_rows;
    budget = budget < 0 ? 0 : (budget > hi - lo ? hi - lo : budget);
    int kept = lo + budget + (n - hi);
    int *keep = malloc(sizeof(int) * ((size_t)H * kept + (size_t)(hi - lo) + 1));
    KVCAP_RETURN_IF(!keep, KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory evicting a span");
    int *work = keep + (size_t)H * kept;
    for (int h = 0; h < H; h++) {
        int *kh = keep + (size_t)h * kept, at = 0;
        for (int j = 0; j < lo; j++)
            kh[at++] = j;
        int got = kvcap_topk_indices(score + (size_t)h * head_stride, hi - lo, budget, kh + at,
                                     work);
        for (int i = 0; i < got; i++)
            kh[at + i] += lo;
        at += got;
        for (int j = hi; j < n; j++)
            kh[at++] = j;
    }
    enum kvcap_status st = copy_kept(c, seg, keep, kept, 0, out);
    free(keep);
    return st;
}

void kvcap_segment_release(const struct kvcap_cache *c, struct kvcap_segment *seg)
{
    c->store->segment_free(seg);
    free(seg->score), free(seg->head_at), free(seg->row_point), free(seg->vx);
    seg->k = seg->v = seg->hs = seg->vt = seg->mu = NULL;
    seg->score = NULL;
    seg->head_at = NULL;
    seg->row_point = NULL;
    seg->vx = NULL;
    seg->n_vx = 0;
    seg->n_rows = seg->cap = 0;
}

uint64_t kvcap_segment_bytes(const struct kvcap_cache *c, const struct kvcap_segment *seg)
{
    uint64_t H = (uint64_t)c->g.n_kv_heads, d = (uint64_t)c->g.head_dim;
    uint64_t es = kvcap_dtype_size(c->storage);
    if (seg->policy == KVCAP_POLICY_KVCAPSULE && seg->hs) /* its state, and its exact tiles */
        return H * ((uint64_t)seg->tiles * (uint64_t)(seg->h + seg->rv) * d + d +
                    2 * (uint64_t)seg->cap * d) * es;
    if (seg->row_point) { /* keys and their points; the value state */
        uint64_t rows = seg->head_at ? (uint64_t)seg->head_at[H] : H * (uint64_t)seg->cap;
        return rows * (d * es + sizeof(int32_t)) +
               H * ((uint64_t)seg->tiles * seg->rv + 1 + (uint64_t)seg->n_vx) * d * es;
    }
    if (seg->head_at) /* packed: exactly the rows kept */
        return 2 * (uint64_t)seg->head_at[H] * d * es;
    return H * 2 * (uint64_t)seg->cap * d * es; /* what is allocated, not only used */
}

/* Row of the next generated token; *grow_to > 0 when the rows must first grow to that many:
 * params.reserve_tokens (64 when 0; streaming needs no more than its ring) the first time, then
 * twice as many. Streaming keeps the first `sinks` generated tokens, then a ring of the last
 * `window`. Host and device caches grow alike. The runtime config bounds sinks + window by
 * KVCAP_CONFIG_MAX_TOKENS; the sums are taken in 64 bits all the same. */
int kvcap_segment_gen_row(const struct kvcap_cache *c, const struct kvcap_segment *gen,
                          int *grow_to)
{
    int64_t row = gen->n_rows;
    const int64_t sinks = c->cfg.streaming.sinks, window = c->cfg.streaming.window;
    const int64_t ring = sinks + window;
    int streaming = gen->policy == KVCAP_POLICY_STREAMING;
    if (streaming && gen->seen >= ring)
        row = sinks + (gen->seen - sinks) % window;
    int64_t first = c->reserve_tokens > 0 ? c->reserve_tokens : 64;
    if (c->reserve_tokens > 0 && streaming && first > ring)
        first = ring;
    int64_t grow = gen->cap ? 2 * (int64_t)gen->cap : first;
    *grow_to = row >= gen->cap ? (int)(grow < INT_MAX ? grow : INT_MAX) : 0;
    return (int)row;
}
