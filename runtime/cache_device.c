/* cache_device.c — the CUDA device store (store.h; params.memory = KVCAP_MEMORY_CUDA): the
 * same segments as a host cache (plain rows [kv_heads][cap][d], KVCapsule H, Ṽ, μ) allocated on
 * the device and filled there, and decode steps that only enqueue work on the cache's stream.
 *
 * Decode state, per layer, in one device table built on the host and uploaded when the layer's
 * structure changes (spans added, generated rows grown): the kvcap_cuda_rows_problem of every
 * plain segment and KV head of the batch, the KVCapsule span descriptors per (bucket, KV head),
 * the rotation tables of the spans' offsets, and a counter of generated tokens per sequence.
 * Every plain segment and KVCapsule span (a "unit") folds into partials of its own, so one
 * launch serves all plain rows of the batch and one all spans of a (bucket, KV head) with no
 * two entries sharing an accumulator; a last kernel merges a sequence's units into `out`.
 * The append kernel writes its row where the device counter says and sets the row count in
 * the descriptors, so the launches of consecutive steps have the same parameters: a step is
 * capturable until storage must grow or the table be rebuilt. The host keeps the same counts
 * (it enqueued every append) for growth, stats and rebuilds; kvcap_cache_sync reads them back
 * after graph replays. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/cache_cuda.h"
#include "runtime/cache_internal.h"
#include "kernels/cuda/attention_cuda.h"
#include "kernels/rope.h"

#define DEV_ALIGN 256

struct dev_layer {
    void *table; /* device: the descriptors below, one allocation */
    size_t table_cap;
    int built, dirty;
    int n_problems, max_n, n_units, n_rot;
    struct kvcap_cuda_rows_problem *problems; /* [n_problems]: unit-major, KV head minor */
    struct kvcap_cuda_capsule_span *spans;    /* per bucket b: [kv_heads][bucket_spans[b]] */
    int *unit_begin;                          /* [n_seqs + 1] */
    int *rot_seq;                             /* [n_rot] */
    float *rot_rows;                          /* [n_rot][d] */
    int64_t *seen;                            /* [n_seqs] generated tokens */
    int *gen_problem; /* host [n_seqs]: first problem of the generated rows, -1 when none */
    int bucket_spans[KVCAP_MAX_BUCKETS], bucket_tiles[KVCAP_MAX_BUCKETS];
    size_t bucket_first[KVCAP_MAX_BUCKETS];
};

struct kvcap_device {
    struct kvcap_cache_cuda_ctx ctx;
    struct kvcap_cuda_rope rope;
    void *maps;                   /* device: every unit's maps, one allocation */
    struct kvcap_cuda_capsule_unit
        *units;               /* host table [layers][kv_heads][buckets] of device pointers */
    int *overflow;            /* device flag of kvcap_cache_cuda_append_token */
    struct dev_layer *layers; /* [n_layers] */
    int *gen_problem;         /* [n_layers][n_seqs], the layers' arrays */
    /* Shared by every layer (their work is ordered on the one stream): per-unit partials,
     * the copied and the rotated queries, the attention calls' scratch. */
    void *work;
    size_t slot_rows, q_rows, rot_rows, scratch_bytes;
    float *mx, *sum, *o, *q_copy, *qrot;
    void *scratch;
    void *staging; /* pinned host memory for descriptor uploads */
    size_t staging_cap;
};

static size_t align_up(size_t x)
{
    return (x + DEV_ALIGN - 1) / DEV_ALIGN * DEV_ALIGN;
}

/* Offset of a new section of `bytes` in a layout of *total bytes. */
static size_t section(size_t *total, size_t bytes)
{
    size_t off = align_up(*total);
    *total = off + bytes;
    return off;
}

static const struct kvcap_cuda_capsule_unit *dev_unit(const struct kvcap_cache *c, int l, int h,
                                                    int b)
{
    return &c->dev->units[((size_t)l * c->g.n_kv_heads + (size_t)h) * c->artifact->n_buckets +
                          (size_t)b];
}

/* The rotation table of position `pos` (struct kvcap_cuda_rope): kvcap_rope_rotate applied
 * to a row holding 1 in the first channel of every pair and 0 in the second leaves cos there and
 * sin in the second, exactly as it rotates any row. */
static void rope_row(const struct kvcap_model_geometry *g, double pos, float *row)
{
    int d = g->head_dim, rd = g->rope_dim ? g->rope_dim : d;
    memset(row, 0, sizeof(float) * (size_t)d);
    for (int i = 0; i < rd / 2; i++)
        row[g->rope_pairing == KVCAP_ROPE_PAIRING_ADJACENT ? 2 * i : i] = 1.0f;
    kvcap_rope_rotate(g, row, 1, (size_t)d, pos);
}

/* ---- Creation ----------------------------------------------------------------------------- */

static enum kvcap_status upload_maps(struct kvcap_cache *c)
{
    struct kvcap_device *dv = c->dev;
    const struct kvcap_artifact *a = c->artifact;
    size_t n_units = (size_t)c->g.n_layers * c->g.n_kv_heads * a->n_buckets, total = 0;
    dv->units = calloc(n_units ? n_units : 1, sizeof *dv->units);
    KVCAP_RETURN_IF(!dv->units, KVCAP_ERR_OUT_OF_MEMORY, "device cache: out of memory");
    size_t *off = malloc(sizeof(size_t) * 6 * (n_units ? n_units : 1));
    KVCAP_RETURN_IF(!off, KVCAP_ERR_OUT_OF_MEMORY, "device cache: out of memory");
    for (size_t i = 0; i < n_units; i++) {
        const struct kvcap_unit_maps *u = &a->units[i];
        off[6 * i + 0] = section(&total, sizeof(int32_t) * (size_t)u->rk);
        off[6 * i + 1] = section(&total, sizeof(float) * (size_t)u->rk * u->h);
        off[6 * i + 2] = section(&total, sizeof(float) * (size_t)u->h);
        off[6 * i + 3] = section(&total, sizeof(float) * (size_t)u->h * u->m);
        off[6 * i + 4] = section(&total, sizeof(float) * (size_t)u->m);
        off[6 * i + 5] = section(&total, sizeof(float) * (size_t)u->rv * u->m);
    }
    char *image = calloc(total ? total : 1, 1);
    enum kvcap_status st = image ? KVCAP_OK
                                 : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "device cache: out of "
                                              "memory staging %zu bytes of maps", total);
    if (st == KVCAP_OK)
        st = kvcap_cache_cuda_malloc(&dv->ctx, total, &dv->maps);
    for (size_t i = 0; st == KVCAP_OK && i < n_units; i++) {
        const struct kvcap_unit_maps *u = &a->units[i];
        const void *src[6] = {u->mask, u->w1, u->b1, u->w2, u->b2, u->u};
        size_t bytes[6] = {sizeof(int32_t) * (size_t)u->rk, sizeof(float) * (size_t)u->rk * u->h,
                           sizeof(float) * (size_t)u->h, sizeof(float) * (size_t)u->h * u->m,
                           sizeof(float) * (size_t)u->m, sizeof(float) * (size_t)u->rv * u->m};
        for (int j = 0; j < 6; j++)
            if (bytes[j])
                memcpy(image + off[6 * i + j], src[j], bytes[j]);
        char *base = dv->maps;
        struct kvcap_cuda_capsule_unit du = {(const int32_t *)(base + off[6 * i]),
                                           (const float *)(base + off[6 * i + 1]),
                                           (const float *)(base + off[6 * i + 2]),
                                           (const float *)(base + off[6 * i + 3]),
                                           (const float *)(base + off[6 * i + 4]),
                                           (const float *)(base + off[6 * i + 5]),
                                           u->m,
                                           u->rk,
                                           u->h,
                                           u->rv,
                                           u->gelu};
        dv->units[i] = du;
    }
    if (st == KVCAP_OK)
        st = kvcap_cache_cuda_upload_sync(&dv->ctx, dv->maps, image, total);
    free(image);
    free(off);
    return st;
}

/* The fused kernel's limits, checked once for every (layer, KV head, bucket) instead of at the
 * first attend: a map too large for its shared-memory plan is reported at creation. */
static enum kvcap_status check_capsule_limits(const struct kvcap_cache *c)
{
    int G = c->g.n_q_heads / c->g.n_kv_heads;
    const struct kvcap_artifact *a = c->artifact;
    for (size_t i = 0; i < (size_t)c->g.n_layers * c->g.n_kv_heads * a->n_buckets; i++) {
        const struct kvcap_unit_maps *u = &a->units[i];
        struct kvcap_capsule_maps m = {u->m, u->h, u->rv, NULL, NULL, NULL};
        size_t bytes;
        int b = (int)(i % (size_t)a->n_buckets);
        int tiles = a->buckets[b].rows * a->buckets[b].cols / u->m;
        kvcap_quiet_push();
        enum kvcap_status st = kvcap_cuda_capsule_scratch_bytes(&m, 1, tiles, G, c->g.head_dim,
                                                                &bytes);
        kvcap_quiet_pop();
        KVCAP_RETURN_IF(st != KVCAP_OK, st, "params.artifact: bucket %dx%d is outside the device "
                        "kernels' limits: %s", a->buckets[b].rows, a->buckets[b].cols,
                        kvcap_last_error());
    }
    return KVCAP_OK;
}

static enum kvcap_status device_create(struct kvcap_cache *c, int device)
{
    struct kvcap_device *dv = calloc(1, sizeof *dv);
    KVCAP_RETURN_IF(!dv, KVCAP_ERR_OUT_OF_MEMORY, "device cache: out of memory");
    c->dev = dv;
    dv->ctx.device = device;
    dv->ctx.stream = NULL;
    dv->rope.on = c->g.rope_type != KVCAP_ROPE_NONE;
    dv->rope.adjacent = c->g.rope_pairing == KVCAP_ROPE_PAIRING_ADJACENT;
    dv->rope.rope_dim = c->g.rope_dim ? c->g.rope_dim : c->g.head_dim;
    dv->layers = calloc((size_t)c->g.n_layers, sizeof *dv->layers);
    dv->gen_problem = malloc(sizeof(int) * (size_t)c->g.n_layers * (size_t)c->n_seqs);
    KVCAP_RETURN_IF(!dv->layers || !dv->gen_problem, KVCAP_ERR_OUT_OF_MEMORY,
                    "device cache: out of memory");
    for (int l = 0; l < c->g.n_layers; l++) {
        dv->layers[l].dirty = 1;
        dv->layers[l].gen_problem = dv->gen_problem + (size_t)l * c->n_seqs;
    }
    if (c->artifact) {
        KVCAP_TRY(check_capsule_limits(c));
        KVCAP_TRY(upload_maps(c));
    }
    KVCAP_TRY(kvcap_cache_cuda_malloc(&dv->ctx, sizeof(int), (void **)&dv->overflow));
    static const int zero = 0;
    return kvcap_cache_cuda_upload_sync(&dv->ctx, dv->overflow, &zero, sizeof zero);
}

static void device_free(struct kvcap_cache *c)
{
    struct kvcap_device *dv = c->dev;
    if (!dv)
        return;
    int dev = dv->ctx.device;
    for (int l = 0; dv->layers && l < c->g.n_layers; l++)
        kvcap_cache_cuda_free(dev, dv->layers[l].table);
    kvcap_cache_cuda_free(dev, dv->work);
    kvcap_cache_cuda_free(dev, dv->maps);
    kvcap_cache_cuda_free(dev, dv->overflow);
    kvcap_cache_cuda_host_free(dv->staging);
    free(dv->layers);
    free(dv->gen_problem);
    free(dv->units);
    free(dv);
    c->dev = NULL;
}

static void device_set_stream(struct kvcap_cache *c, void *stream)
{
    c->dev->ctx.stream = stream;
}

static void device_layer_changed(struct kvcap_cache *c, int layer)
{
    c->dev->layers[layer].dirty = 1;
}

static void device_segment_free(struct kvcap_segment *seg)
{
    int dev = seg->dev - 1;
    kvcap_cache_cuda_free(dev, seg->k), kvcap_cache_cuda_free(dev, seg->v),
        kvcap_cache_cuda_free(dev, seg->hs);
    kvcap_cache_cuda_free(dev, seg->vt), kvcap_cache_cuda_free(dev, seg->mu);
}

/* ---- Prefill ------------------------------------------------------------------------------ */

/* Temporary device memory of one prefill call: the views' page tables, then `extra` bytes. */
struct prefill_temp {
    void *mem;
    struct kvcap_cuda_view k, v;
    char *extra;
};

static size_t table_bytes(const struct kvcap_tensor_view *t, int n)
{
    return t->pages ? sizeof(void *) * (size_t)((n + t->page_size - 1) / t->page_size) : 0;
}

static enum kvcap_status temp_make(struct kvcap_cache *c, const struct kvcap_tensor_view *k,
                                   const struct kvcap_tensor_view *v, int n, const void *extra,
                                   size_t extra_bytes, size_t extra_room, struct prefill_temp *t)
{
    size_t total = 0, ok = section(&total, table_bytes(k, n)), ov = section(&total, table_bytes(v, n));
    size_t oe = section(&total, extra_room);
    char *image = calloc(total ? total : 1, 1);
    KVCAP_RETURN_IF(!image, KVCAP_ERR_OUT_OF_MEMORY, "device cache: out of memory");
    if (k->pages)
        memcpy(image + ok, (const void *)k->pages, table_bytes(k, n));
    if (v->pages)
        memcpy(image + ov, (const void *)v->pages, table_bytes(v, n));
    if (extra_bytes)
        memcpy(image + oe, extra, extra_bytes);
    enum kvcap_status st = kvcap_cache_cuda_malloc(&c->dev->ctx, total, &t->mem);
    if (st == KVCAP_OK)
        st = kvcap_cache_cuda_upload_sync(&c->dev->ctx, t->mem, image, total);
    free(image);
    if (st != KVCAP_OK) {
        kvcap_cache_cuda_free(c->dev->ctx.device, t->mem);
        t->mem = NULL;
        return st;
    }
    char *base = t->mem;
    struct kvcap_cuda_view kv = {
        k->base,        k->pages ? (const void *const *)(base + ok) : NULL,
        k->page_size,   k->dtype,
        k->head_stride, k->token_stride};
    struct kvcap_cuda_view vv = {
        v->base,        v->pages ? (const void *const *)(base + ov) : NULL,
        v->page_size,   v->dtype,
        v->head_stride, v->token_stride};
    t->k = kv;
    t->v = vv;
    t->extra = base + oe;
    return KVCAP_OK;
}

/* Waits for the prefill kernels (add_span returns with the span stored), then frees. */
static enum kvcap_status temp_done(struct kvcap_cache *c, struct prefill_temp *t,
                                   enum kvcap_status st)
{
    enum kvcap_status sync = kvcap_cache_cuda_sync(&c->dev->ctx);
    kvcap_cache_cuda_free(c->dev->ctx.device, t->mem);
    t->mem = NULL;
    return st != KVCAP_OK ? st : sync;
}

static enum kvcap_status alloc_rows(struct kvcap_cache *c, int cap, void **k, void **v)
{
    size_t bytes = (size_t)c->g.n_kv_heads * (size_t)cap * (size_t)c->g.head_dim *
                   kvcap_dtype_size(c->storage);
    *k = *v = NULL;
    enum kvcap_status st = kvcap_cache_cuda_malloc(&c->dev->ctx, bytes, k);
    if (st == KVCAP_OK)
        st = kvcap_cache_cuda_malloc(&c->dev->ctx, bytes, v);
    if (st != KVCAP_OK) {
        kvcap_cache_cuda_free(c->dev->ctx.device, *k);
        kvcap_cache_cuda_free(c->dev->ctx.device, *v);
        *k = *v = NULL;
    }
    return st;
}

static enum kvcap_status device_fill(struct kvcap_cache *c, struct kvcap_segment *seg,
                                     const struct kvcap_tensor_view *k,
                                     const struct kvcap_tensor_view *v, const int *tokens, int n)
{
    int cap = n > 0 ? n : 1;
    seg->dev = 1 + c->dev->ctx.device;
    KVCAP_TRY(alloc_rows(c, cap, &seg->k, &seg->v));
    seg->cap = cap;
    struct prefill_temp t;
    KVCAP_TRY(temp_make(c, k, v, seg->n_tokens, tokens, tokens ? sizeof(int) * (size_t)n : 0,
                        tokens ? sizeof(int) * (size_t)n : 0, &t));
    const int *dtok = tokens ? (const int *)t.extra : NULL;
    int H = c->g.n_kv_heads, d = c->g.head_dim;
    enum kvcap_status st =
        kvcap_cache_cuda_fill_rows(&c->dev->ctx, &t.k, dtok, n, H, d, seg->k, cap, c->storage);
    if (st == KVCAP_OK)
        st = kvcap_cache_cuda_fill_rows(&c->dev->ctx, &t.v, dtok, n, H, d, seg->v, cap, c->storage);
    KVCAP_TRY(temp_done(c, &t, st));
    seg->n_rows = n;
    return KVCAP_OK;
}

/* KVCapsule with kvcap's exact tiles. Per KV head, on the device: the state of every tile in
 * f32 and each point's error sums (kvcap_cuda_capsule_point_errors), which come to the host,
 * where kvcap_capsule_exact_pick picks the tiles by the host store's rule; then, by fill_rows,
 * the kept tiles' state and μ converted into the segment's storage (the bits a storage-dtype
 * prefill would write) and the picked tiles' tokens into its rows. */
static enum kvcap_status device_capsule_exact(struct kvcap_cache *c, int layer,
                                              struct kvcap_segment *seg,
                                              const struct kvcap_tensor_view *k,
                                              const struct kvcap_tensor_view *v, int exact)
{
    const struct kvcap_bucket *bk = &c->artifact->buckets[seg->bucket];
    const struct kvcap_cuda_capsule_unit *u0 = dev_unit(c, layer, 0, seg->bucket);
    const int n = seg->n_tokens, d = c->g.head_dim, H = c->g.n_kv_heads, m = u0->m;
    const int all = n / m, rows = exact * m;
    seg->tiles = all - exact;
    seg->h = u0->h;
    seg->rv = u0->rv;
    const size_t es = kvcap_dtype_size(c->storage);
    const int kept_h = seg->tiles * seg->h, kept_v = seg->tiles * seg->rv; /* state rows kept */
    const size_t per_h = (size_t)kept_h * d, per_v = (size_t)kept_v * d;
    const int n_idx = kept_h + kept_v + rows; /* those rows' indices, then the picked tokens */
    seg->dev = 1 + c->dev->ctx.device;
    KVCAP_TRY(kvcap_cache_cuda_malloc(&c->dev->ctx, (size_t)H * per_h * es, &seg->hs));
    KVCAP_TRY(kvcap_cache_cuda_malloc(&c->dev->ctx, (size_t)H * per_v * es, &seg->vt));
    KVCAP_TRY(kvcap_cache_cuda_malloc(&c->dev->ctx, (size_t)H * d * es, &seg->mu));
    KVCAP_TRY(kvcap_segment_reserve(c, seg, rows)); /* exactly: [heads][exact·m][d] */
    /* Device scratch: every tile's state in f32 with its μ and the prefill's μ scratch, the
     * points' sums, the indices, and the picked tokens' rows of every head. */
    size_t total = 0;
    const size_t o_hf = section(&total, sizeof(float) * (size_t)all * seg->h * d);
    const size_t o_vf = section(&total, sizeof(float) * (size_t)all * seg->rv * d);
    const size_t o_mf = section(&total, sizeof(float) * (size_t)d);
    const size_t o_ms = section(&total, sizeof(float) * (size_t)d);
    const size_t o_pt = section(&total, sizeof(double) * 4 * (size_t)n);
    const size_t o_ix = section(&total, sizeof(int) * (size_t)n_idx);
    const size_t o_rk = section(&total, es * (size_t)H * rows * d);
    const size_t o_rv = section(&total, es * (size_t)H * rows * d);
    /* host: the points' sums, the tile errors, the indices, the picks */
    double *pts = malloc(sizeof(double) * 4 * (size_t)n + sizeof(float) * all +
                         sizeof(int) * (size_t)n_idx + (size_t)all);
    KVCAP_RETURN_IF(!pts, KVCAP_ERR_OUT_OF_MEMORY, "kvcapsule: out of memory for a %d-token span",
                    n);
    float *err = (float *)(pts + 4 * (size_t)n);
    int *idx = (int *)(err + all);
    unsigned char *pick = (unsigned char *)(idx + n_idx);
    char *w = NULL;
    enum kvcap_status st = kvcap_cache_cuda_malloc(&c->dev->ctx, total, (void **)&w);
    float row[KVCAP_CUDA_ROPE_MAX_D];
    rope_row(&c->g, -(double)seg->p0, row);
    struct prefill_temp t = {0};
    if (st == KVCAP_OK)
        st = temp_make(c, k, v, n, row, sizeof(float) * (size_t)d, sizeof(float) * (size_t)d, &t);
    const float *rr = (const float *)t.extra;
    struct kvcap_cuda_grid grid = {bk->structure == KVCAP_STRUCTURE_TILED, bk->cols,
                                   bk->tile_rows, bk->tile_cols};
    float *hf = (float *)(w + o_hf), *vf = (float *)(w + o_vf), *mf = (float *)(w + o_mf);
    float *ms = (float *)(w + o_ms);
    char *rk = w + o_rk, *rv = w + o_rv;
    int *didx = (int *)(w + o_ix);
    /* the f32 state as one-head views of rows of d channels */
    const struct kvcap_cuda_view hview = {hf, NULL, 0, KVCAP_DTYPE_F32, 0, d};
    const struct kvcap_cuda_view vview = {vf, NULL, 0, KVCAP_DTYPE_F32, 0, d};
    const struct kvcap_cuda_view mview = {mf, NULL, 0, KVCAP_DTYPE_F32, 0, d};
    for (int h = 0; st == KVCAP_OK && t.mem && h < H; h++) {
        const struct kvcap_cuda_capsule_unit *u = dev_unit(c, layer, h, seg->bucket);
        const struct kvcap_cache_cuda_ctx *x = &c->dev->ctx;
        st = kvcap_cache_cuda_capsule_prefill(x, &t.k, &t.v, h, n, d, &c->dev->rope, rr, &grid, u,
                                              all, KVCAP_DTYPE_F32, hf, vf, mf, ms);
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_capsule_point_errors(x, &t.k, &t.v, h, n, d, &c->dev->rope, rr,
                                                       &grid, u, hf, vf, mf,
                                                       (double *)(w + o_pt));
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_download_sync(x, pts, w + o_pt, sizeof(double) * 4 * (size_t)n);
        if (st != KVCAP_OK)
            break;
        kvcap_capsule_exact_pick(pts, all, m, exact, err, pick);
        int *ih = idx, *iv = idx + kept_h, *it = iv + kept_v;
        for (int tt = 0; tt < all; tt++)
            if (pick[tt]) {
                for (int p = 0; p < m; p++)
                    *it++ = (int)kvcap_bucket_token(bk, tt, p);
            } else {
                for (int i = 0; i < seg->h; i++)
                    *ih++ = tt * seg->h + i;
                for (int i = 0; i < seg->rv; i++)
                    *iv++ = tt * seg->rv + i;
            }
        st = kvcap_cache_cuda_upload_sync(x, didx, idx, sizeof(int) * (size_t)n_idx);
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_fill_rows(x, &hview, didx, kept_h, 1, d,
                                            (char *)seg->hs + (size_t)h * per_h * es, kept_h,
                                            c->storage);
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_fill_rows(x, &vview, didx + kept_h, kept_v, 1, d,
                                            (char *)seg->vt + (size_t)h * per_v * es, kept_v,
                                            c->storage);
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_fill_rows(x, &mview, NULL, 1, 1, d,
                                            (char *)seg->mu + (size_t)h * d * es, 1, c->storage);
        /* the picked tokens' rows of every head, of which head h's are kept */
        const int *dtok = didx + kept_h + kept_v;
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_fill_rows(x, &t.k, dtok, rows, H, d, rk, rows, c->storage);
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_fill_rows(x, &t.v, dtok, rows, H, d, rv, rows, c->storage);
        const size_t head_rows = (size_t)rows * d * es;
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_copy_2d(x, (char *)seg->k + h * head_rows, head_rows,
                                          rk + h * head_rows, head_rows, head_rows, 1);
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_copy_2d(x, (char *)seg->v + h * head_rows, head_rows,
                                          rv + h * head_rows, head_rows, head_rows, 1);
    }
    if (t.mem)
        st = temp_done(c, &t, st); /* waits for the stream */
    else if (st == KVCAP_OK)
        st = kvcap_cache_cuda_sync(&c->dev->ctx);
    kvcap_cache_cuda_free(c->dev->ctx.device, w);
    free(pts);
    if (st == KVCAP_OK)
        seg->n_rows = rows;
    return st;
}

static enum kvcap_status device_capsule_prefill(struct kvcap_cache *c, int layer,
                                                struct kvcap_segment *seg,
                                                const struct kvcap_tensor_view *k,
                                                const struct kvcap_tensor_view *v)
{
    const struct kvcap_artifact *a = c->artifact;
    const struct kvcap_bucket *bk = &a->buckets[seg->bucket];
    /* Every KV head of a layer and bucket has head 0's h and R_v (kvcap_artifact_open). */
    const struct kvcap_cuda_capsule_unit *u0 = dev_unit(c, layer, 0, seg->bucket);
    int n = seg->n_tokens, d = c->g.head_dim, H = c->g.n_kv_heads;
    int exact = kvcap_capsule_exact_count(c, n / u0->m);
    if (exact > 0)
        return device_capsule_exact(c, layer, seg, k, v, exact);
    seg->tiles = n / u0->m;
    seg->h = u0->h;
    seg->rv = u0->rv;
    size_t es = kvcap_dtype_size(c->storage);
    size_t per_h = (size_t)seg->tiles * seg->h * d, per_v = (size_t)seg->tiles * seg->rv * d;
    seg->dev = 1 + c->dev->ctx.device;
    KVCAP_TRY(kvcap_cache_cuda_malloc(&c->dev->ctx, (size_t)H * per_h * es, &seg->hs));
    KVCAP_TRY(kvcap_cache_cuda_malloc(&c->dev->ctx, (size_t)H * per_v * es, &seg->vt));
    KVCAP_TRY(kvcap_cache_cuda_malloc(&c->dev->ctx, (size_t)H * d * es, &seg->mu));
    float row[KVCAP_CUDA_ROPE_MAX_D];
    rope_row(&c->g, -(double)seg->p0, row);
    struct prefill_temp t;
    /* extra: the rotation table [d], then μ in f32 [d] */
    KVCAP_TRY(temp_make(c, k, v, n, row, sizeof(float) * (size_t)d, 2 * sizeof(float) * (size_t)d,
                        &t));
    const float *rr = (const float *)t.extra;
    float *mu_f32 = (float *)t.extra + d;
    struct kvcap_cuda_grid grid = {bk->structure == KVCAP_STRUCTURE_TILED, bk->cols,
                                         bk->tile_rows, bk->tile_cols};
    enum kvcap_status st = KVCAP_OK;
    /* heads one after the other on the stream: μ's f32 scratch is reused */
    for (int h = 0; st == KVCAP_OK && h < H; h++)
        st = kvcap_cache_cuda_capsule_prefill(&c->dev->ctx, &t.k, &t.v, h, n, d, &c->dev->rope, rr,
                                              &grid, dev_unit(c, layer, h, seg->bucket), seg->tiles,
                                              c->storage, (char *)seg->hs + (size_t)h * per_h * es,
                                              (char *)seg->vt + (size_t)h * per_v * es,
                                              (char *)seg->mu + (size_t)h * d * es, mu_f32);
    return temp_done(c, &t, st);
}

/* Generated rows: room for `cap` rows, keeping the rows held. Waits for the stream (the old
 * rows are copied on it, then freed). */
static enum kvcap_status device_reserve(struct kvcap_cache *c, struct kvcap_segment *seg, int cap)
{
    if (cap <= seg->cap)
        return KVCAP_OK;
    void *k, *v;
    KVCAP_TRY(alloc_rows(c, cap, &k, &v));
    size_t row = (size_t)c->g.head_dim * kvcap_dtype_size(c->storage);
    enum kvcap_status st = KVCAP_OK;
    if (seg->n_rows > 0) {
        st = kvcap_cache_cuda_copy_2d(&c->dev->ctx, k, (size_t)cap * row, seg->k,
                                      (size_t)seg->cap * row, (size_t)seg->n_rows * row,
                                      (size_t)c->g.n_kv_heads);
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_copy_2d(&c->dev->ctx, v, (size_t)cap * row, seg->v,
                                          (size_t)seg->cap * row, (size_t)seg->n_rows * row,
                                          (size_t)c->g.n_kv_heads);
        if (st == KVCAP_OK)
            st = kvcap_cache_cuda_sync(&c->dev->ctx);
    }
    if (st != KVCAP_OK) {
        kvcap_cache_cuda_free(c->dev->ctx.device, k);
        kvcap_cache_cuda_free(c->dev->ctx.device, v);
        return st;
    }
    kvcap_cache_cuda_free(c->dev->ctx.device, seg->k);
    kvcap_cache_cuda_free(c->dev->ctx.device, seg->v);
    seg->k = k;
    seg->v = v;
    seg->cap = cap;
    seg->dev = 1 + c->dev->ctx.device;
    return KVCAP_OK;
}

/* ---- Decode tables ------------------------------------------------------------------------ */

static enum kvcap_status refuse_in_capture(const struct kvcap_cache *c, const char *what, int layer)
{
    KVCAP_RETURN_IF(kvcap_cache_cuda_capturing(&c->dev->ctx), KVCAP_ERR_STATE,
                    "layer %d: %s while the cache's stream is being captured (this step allocates "
                    "and uploads; run it directly, then capture; params.reserve_tokens avoids "
                    "growth)",
                    layer, what);
    return KVCAP_OK;
}

/* A segment with rows to attend as rows: every policy's, KVCapsule's exact tiles included. */
static int is_plain(const struct kvcap_segment *seg)
{
    return seg->cap > 0;
}

/* Grows the shared work memory to these sizes (all layers' tables point into it: they are
 * rebuilt when it moves). */
static enum kvcap_status work_reserve(struct kvcap_cache *c, size_t slot_rows, size_t q_rows,
                                      size_t rot_rows, size_t scratch_bytes)
{
    struct kvcap_device *dv = c->dev;
    if (dv->work && slot_rows <= dv->slot_rows && q_rows <= dv->q_rows &&
        rot_rows <= dv->rot_rows && scratch_bytes <= dv->scratch_bytes)
        return KVCAP_OK;
    slot_rows = slot_rows > dv->slot_rows ? slot_rows : dv->slot_rows;
    q_rows = q_rows > dv->q_rows ? q_rows : dv->q_rows;
    rot_rows = rot_rows > dv->rot_rows ? rot_rows : dv->rot_rows;
    scratch_bytes = scratch_bytes > dv->scratch_bytes ? scratch_bytes : dv->scratch_bytes;
    size_t d = (size_t)c->g.head_dim, qd = (size_t)c->g.n_q_heads * d, total = 0;
    size_t o_mx = section(&total, sizeof(float) * slot_rows);
    size_t o_sum = section(&total, sizeof(float) * slot_rows);
    size_t o_o = section(&total, sizeof(float) * slot_rows * d);
    size_t o_q = section(&total, sizeof(float) * q_rows * qd);
    size_t o_r = section(&total, sizeof(float) * (rot_rows ? rot_rows : 1) * qd);
    size_t o_s = section(&total, scratch_bytes);
    kvcap_cache_cuda_free(dv->ctx.device, dv->work); /* waits for the work that used it */
    dv->work = NULL;
    dv->slot_rows = dv->q_rows = dv->rot_rows = dv->scratch_bytes = 0;
    KVCAP_TRY(kvcap_cache_cuda_malloc(&dv->ctx, total, &dv->work));
    char *w = dv->work;
    dv->mx = (float *)(w + o_mx);
    dv->sum = (float *)(w + o_sum);
    dv->o = (float *)(w + o_o);
    dv->q_copy = (float *)(w + o_q);
    dv->qrot = (float *)(w + o_r);
    dv->scratch = w + o_s;
    dv->slot_rows = slot_rows;
    dv->q_rows = q_rows;
    dv->rot_rows = rot_rows;
    dv->scratch_bytes = scratch_bytes;
    for (int l = 0; l < c->g.n_layers; l++)
        dv->layers[l].dirty = 1;
    return KVCAP_OK;
}

static struct kvcap_partial slot(const struct kvcap_device *dv, int G, int d, int n_units, int h,
                                 int u)
{
    size_t row = ((size_t)h * n_units + (size_t)u) * (size_t)G;
    struct kvcap_partial p = {dv->mx + row, dv->sum + row, dv->o + row * (size_t)d};
    return p;
}

/* Rebuilds and uploads the decode table of `layer` from the segments as they are now. Waits
 * for the stream first: the old table and the staging memory may still be read. */
static enum kvcap_status rebuild(struct kvcap_cache *c, int layer)
{
    struct kvcap_device *dv = c->dev;
    struct dev_layer *L = &dv->layers[layer];
    const struct kvcap_model_geometry *g = &c->g;
    int H = g->n_kv_heads, G = g->n_q_heads / H, d = g->head_dim, B = c->artifact ? c->artifact->n_buckets : 0;
    size_t es = kvcap_dtype_size(c->storage);
    KVCAP_TRY(kvcap_cache_cuda_sync(&dv->ctx));

    /* Sizes: units, problems, spans per bucket. */
    int n_plain = 0, n_rot = 0, max_n = 0;
    int spans[KVCAP_MAX_BUCKETS] = {0}, tiles[KVCAP_MAX_BUCKETS] = {0};
    for (int s = 0; s < c->n_seqs; s++) {
        const struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, s, layer);
        for (int i = 0; i <= sl->n_segs; i++) {
            const struct kvcap_segment *seg = i < sl->n_segs ? &sl->segs[i] : &sl->gen;
            if (is_plain(seg)) {
                n_plain++;
                max_n = seg->cap > max_n ? seg->cap : max_n;
            }
            if (seg->policy == KVCAP_POLICY_KVCAPSULE && seg->hs) {
                n_rot++;
                spans[seg->bucket]++;
                tiles[seg->bucket] = seg->tiles;
            }
        }
    }
    int n_units = n_plain + n_rot, n_problems = n_plain * H;
    size_t scratch = 0, need;
    if (n_problems > 0) {
        KVCAP_TRY(kvcap_cuda_attend_rows_scratch_bytes(n_problems, max_n, G, d, &need));
        scratch = need;
    }
    for (int b = 0; b < B; b++)
        for (int h = 0; spans[b] > 0 && h < H; h++) {
            const struct kvcap_cuda_capsule_unit *u = dev_unit(c, layer, h, b);
            struct kvcap_capsule_maps m = {u->m, u->h, u->rv, u->w2, u->b2, u->u};
            KVCAP_TRY(kvcap_cuda_capsule_scratch_bytes(&m, spans[b], tiles[b], G, d, &need));
            scratch = need > scratch ? need : scratch;
        }
    KVCAP_TRY(work_reserve(c, (size_t)H * n_units * G, (size_t)c->n_seqs, (size_t)n_rot, scratch));

    /* Layout of the table. */
    size_t total = 0;
    size_t o_pr = section(&total, sizeof(struct kvcap_cuda_rows_problem) * (size_t)n_problems);
    size_t o_sp = section(&total, sizeof(struct kvcap_cuda_capsule_span) * (size_t)n_rot * H);
    size_t o_ub = section(&total, sizeof(int) * (size_t)(c->n_seqs + 1));
    size_t o_rs = section(&total, sizeof(int) * (size_t)n_rot);
    size_t o_rr = section(&total, sizeof(float) * (size_t)n_rot * d);
    size_t o_se = section(&total, sizeof(int64_t) * (size_t)c->n_seqs);
    if (total > L->table_cap) {
        kvcap_cache_cuda_free(dv->ctx.device, L->table);
        L->table = NULL;
        L->table_cap = 0;
        L->built = 0;
        KVCAP_TRY(kvcap_cache_cuda_malloc(&dv->ctx, total, &L->table));
        L->table_cap = total;
    }
    if (total > dv->staging_cap) {
        kvcap_cache_cuda_host_free(dv->staging);
        dv->staging = NULL;
        dv->staging_cap = 0;
        KVCAP_TRY(kvcap_cache_cuda_host_malloc(&dv->ctx, total, &dv->staging));
        dv->staging_cap = total;
    }
    char *img = dv->staging, *dev = L->table;
    memset(img, 0, total);
    struct kvcap_cuda_rows_problem *pr = (void *)(img + o_pr);
    struct kvcap_cuda_capsule_span *sp = (void *)(img + o_sp);
    int *ub = (int *)(img + o_ub), *rs = (int *)(img + o_rs);
    float *rr = (float *)(img + o_rr);
    int64_t *seen = (int64_t *)(img + o_se);
    size_t first[KVCAP_MAX_BUCKETS], at_b[KVCAP_MAX_BUCKETS];
    for (int b = 0, acc = 0; b < B; acc += spans[b] * H, b++) {
        first[b] = (size_t)acc;
        at_b[b] = 0;
    }
    int u = 0, pu = 0, k = 0;
    for (int s = 0; s < c->n_seqs; s++) {
        const struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, s, layer);
        ub[s] = u;
        seen[s] = sl->gen.seen;
        L->gen_problem[s] = -1;
        const float *qs = dv->q_copy + (size_t)s * g->n_q_heads * d;
        for (int i = 0; i <= sl->n_segs; i++) { /* plain units first: the generated rows last */
            const struct kvcap_segment *seg = i < sl->n_segs ? &sl->segs[i] : &sl->gen;
            if (!is_plain(seg))
                continue;
            if (i == sl->n_segs)
                L->gen_problem[s] = pu * H;
            for (int h = 0; h < H; h++) {
                struct kvcap_cuda_rows_problem p = {
                    (const char *)seg->k + (size_t)h * seg->cap * d * es,
                    (const char *)seg->v + (size_t)h * seg->cap * d * es,
                    qs + (size_t)h * G * d, slot(dv, G, d, n_units, h, u), d, seg->n_rows, 0};
                pr[(size_t)pu * H + h] = p;
            }
            pu++, u++;
        }
        for (int i = 0; i < sl->n_segs; i++) {
            const struct kvcap_segment *seg = &sl->segs[i];
            if (seg->policy != KVCAP_POLICY_KVCAPSULE || !seg->hs)
                continue;
            rs[k] = s;
            rope_row(g, -(double)seg->p0, rr + (size_t)k * d);
            size_t per_h = (size_t)seg->tiles * seg->h * d, per_v = (size_t)seg->tiles * seg->rv * d;
            const float *qr = dv->qrot + (size_t)k * g->n_q_heads * d;
            for (int h = 0; h < H; h++) {
                struct kvcap_cuda_capsule_span x = {
                    (const char *)seg->hs + (size_t)h * per_h * es,
                    (const char *)seg->vt + (size_t)h * per_v * es,
                    (const char *)seg->mu + (size_t)h * d * es, qr + (size_t)h * G * d,
                    slot(dv, G, d, n_units, h, u), seg->tiles, 0};
                sp[first[seg->bucket] + (size_t)h * spans[seg->bucket] + at_b[seg->bucket]] = x;
            }
            at_b[seg->bucket]++;
            k++, u++;
        }
    }
    ub[c->n_seqs] = u;
    KVCAP_TRY(kvcap_cache_cuda_upload(&dv->ctx, L->table, img, total));
    L->problems = (void *)(dev + o_pr);
    L->spans = (void *)(dev + o_sp);
    L->unit_begin = (int *)(dev + o_ub);
    L->rot_seq = (int *)(dev + o_rs);
    L->rot_rows = (float *)(dev + o_rr);
    L->seen = (int64_t *)(dev + o_se);
    L->n_problems = n_problems;
    L->max_n = max_n;
    L->n_units = n_units;
    L->n_rot = n_rot;
    for (int b = 0; b < B; b++) {
        L->bucket_spans[b] = spans[b];
        L->bucket_tiles[b] = tiles[b];
        L->bucket_first[b] = first[b];
    }
    L->built = 1;
    L->dirty = 0;
    return KVCAP_OK;
}

static enum kvcap_status ensure_built(struct kvcap_cache *c, int layer, const char *what)
{
    if (!c->dev->layers[layer].dirty)
        return KVCAP_OK;
    KVCAP_TRY(refuse_in_capture(c, what, layer));
    return rebuild(c, layer);
}

/* ---- Decode ------------------------------------------------------------------------------- */

static enum kvcap_status device_append(struct kvcap_cache *c, int seq, int layer,
                                       const struct kvcap_tensor_view *k,
                                       const struct kvcap_tensor_view *v, int grow_to)
{
    struct kvcap_device *dv = c->dev;
    struct kvcap_segment *gen = &kvcap_cache_seq_layer(c, seq, layer)->gen;
    if (grow_to > 0) {
        KVCAP_TRY(refuse_in_capture(c, "the generated rows are full and must grow", layer));
        KVCAP_TRY(device_reserve(c, gen, grow_to));
        dv->layers[layer].dirty = 1;
    }
    KVCAP_TRY(ensure_built(c, layer, "the layer's descriptors must be rebuilt (spans added or "
                                     "storage moved)"));
    struct dev_layer *L = &dv->layers[layer];
    int streaming = gen->policy == KVCAP_POLICY_STREAMING;
    struct kvcap_cache_cuda_append a = {
        k->pages ? k->pages[0] : k->base, v->pages ? v->pages[0] : v->base, k->dtype, v->dtype,
        k->head_stride, v->head_stride, gen->k, gen->v, gen->cap,
        streaming ? c->cfg.streaming.sinks : 0, streaming ? c->cfg.streaming.window : 0,
        L->seen + seq, L->problems + L->gen_problem[seq], dv->overflow};
    return kvcap_cache_cuda_append_token(&dv->ctx, &a, c->g.n_kv_heads, c->g.head_dim, c->storage);
}

/* Bytes the launches read, as the host kernels count them (attention.c): K and V of every
 * plain row, and per (bucket, KV head) the maps once plus each span's H, Ṽ, μ. */
static void read_bytes(const struct kvcap_cache *c, int layer, uint64_t *bytes, uint64_t *maps)
{
    uint64_t H = (uint64_t)c->g.n_kv_heads, d = (uint64_t)c->g.head_dim;
    uint64_t es = kvcap_dtype_size(c->storage), b_all = 0, m_all = 0;
    for (int s = 0; s < c->n_seqs; s++) {
        const struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, s, layer);
        for (int i = 0; i <= sl->n_segs; i++) {
            const struct kvcap_segment *seg = i < sl->n_segs ? &sl->segs[i] : &sl->gen;
            if (seg->n_rows > 0) /* KVCapsule's exact tiles are rows too */
                b_all += H * 2u * (uint64_t)seg->n_rows * d * es;
            if (seg->policy == KVCAP_POLICY_KVCAPSULE && seg->hs)
                b_all += H * es * ((uint64_t)seg->tiles * (uint64_t)(seg->h + seg->rv) * d + d);
        }
    }
    const struct dev_layer *L = &c->dev->layers[layer];
    for (int b = 0; c->artifact && b < c->artifact->n_buckets; b++)
        for (int h = 0; L->bucket_spans[b] > 0 && h < (int)H; h++) {
            const struct kvcap_unit_maps *u = kvcap_artifact_unit(c->artifact, layer, h, b);
            uint64_t mb = ((uint64_t)u->h * u->m + (uint64_t)u->m + (uint64_t)u->rv * u->m) * 4;
            b_all += mb;
            m_all += mb;
        }
    *bytes = b_all;
    *maps = m_all;
}

static enum kvcap_status device_attend(struct kvcap_cache *c, int layer, const float *q, float *out,
                                       float *lse)
{
    struct kvcap_device *dv = c->dev;
    KVCAP_TRY(ensure_built(c, layer, "the layer's descriptors must be rebuilt (spans added or "
                                     "storage moved)"));
    const struct dev_layer *L = &dv->layers[layer];
    const struct kvcap_model_geometry *g = &c->g;
    int H = g->n_kv_heads, G = g->n_q_heads / H, d = g->head_dim;
    float scale = 1.0f / sqrtf((float)d);
    if (L->n_units > 0) {
        struct kvcap_partial all = {dv->mx, dv->sum, dv->o};
        KVCAP_TRY(kvcap_cuda_partial_reset(all, H * L->n_units * G, d, dv->ctx.stream));
    }
    KVCAP_TRY(kvcap_cache_cuda_prepare_queries(&dv->ctx, q, c->n_seqs, g->n_q_heads, d, dv->q_copy,
                                               L->n_rot, L->rot_seq, L->rot_rows, &dv->rope,
                                               dv->qrot));
    if (L->n_problems > 0)
        KVCAP_TRY(kvcap_cuda_attend_rows(L->problems, L->n_problems, L->max_n, c->storage, G, d,
                                         scale, dv->scratch, dv->scratch_bytes, dv->ctx.stream));
    for (int b = 0; c->artifact && b < c->artifact->n_buckets; b++)
        for (int h = 0; L->bucket_spans[b] > 0 && h < H; h++) {
            const struct kvcap_cuda_capsule_unit *u = dev_unit(c, layer, h, b);
            struct kvcap_capsule_maps m = {u->m, u->h, u->rv, u->w2, u->b2, u->u};
            KVCAP_TRY(kvcap_cuda_capsule_attend(
                &m, L->spans + L->bucket_first[b] + (size_t)h * L->bucket_spans[b],
                L->bucket_spans[b], L->bucket_tiles[b], c->storage, G, d, scale, dv->scratch,
                dv->scratch_bytes, dv->ctx.stream));
        }
    KVCAP_TRY(kvcap_cache_cuda_merge_finish(&dv->ctx, dv->mx, dv->sum, dv->o, L->n_units,
                                            L->unit_begin, c->n_seqs, H, G, d, out, lse));
    read_bytes(c, layer, &c->last_read, &c->last_map_read);
    return KVCAP_OK;
}

/* ---- Host bookkeeping after replays -------------------------------------------------------- */

static enum kvcap_status device_sync(struct kvcap_cache *c)
{
    struct kvcap_device *dv = c->dev;
    KVCAP_TRY(kvcap_cache_cuda_sync(&dv->ctx));
    int64_t *seen = malloc(sizeof(int64_t) * (size_t)c->n_seqs);
    KVCAP_RETURN_IF(!seen, KVCAP_ERR_OUT_OF_MEMORY, "cache sync: out of memory");
    enum kvcap_status st = KVCAP_OK;
    const int64_t ring = (int64_t)c->cfg.streaming.sinks + c->cfg.streaming.window;
    for (int l = 0; st == KVCAP_OK && l < c->g.n_layers; l++) {
        const struct dev_layer *L = &dv->layers[l];
        if (!L->built)
            continue;
        st = kvcap_cache_cuda_download_sync(&dv->ctx, seen, L->seen,
                                            sizeof(int64_t) * (size_t)c->n_seqs);
        for (int s = 0; st == KVCAP_OK && s < c->n_seqs; s++) {
            struct kvcap_segment *gen = &kvcap_cache_seq_layer(c, s, l)->gen;
            if (L->gen_problem[s] < 0 || seen[s] <= gen->seen)
                continue;
            if (l == 0)
                c->tokens_by_kind[KVCAP_SPAN_GENERATED] += seen[s] - gen->seen;
            gen->seen = seen[s];
            int64_t held =
                gen->policy == KVCAP_POLICY_STREAMING && seen[s] > ring ? ring : seen[s];
            gen->n_rows = (int)held;
        }
    }
    free(seen);
    int flag = 0;
    if (st == KVCAP_OK)
        st = kvcap_cache_cuda_download_sync(&dv->ctx, &flag, dv->overflow, sizeof flag);
    if (st == KVCAP_OK && flag) {
        static const int zero = 0;
        st = kvcap_cache_cuda_upload_sync(&dv->ctx, dv->overflow, &zero, sizeof zero);
        if (st == KVCAP_OK)
            st = kvcap_fail(KVCAP_ERR_STATE,
                            "cache sync: an append found the generated rows full and did not "
                            "store its token (replayed past the room reserved; raise "
                            "params.reserve_tokens)");
    }
    return st;
}

/* ---- The store (store.h) ---------------------------------------------------------------------- */

/* What a device cache (params.memory = KVCAP_MEMORY_CUDA) can serve, checked once the runtime
 * config is loaded; the device itself last, so every other error is reported without one. */
static enum kvcap_status device_supports(const struct kvcap_cache *c,
                                         const struct kvcap_cache_params *p)
{
    static const char *const kinds[3] = {"vision", "text", "generated"};
    for (int k = 0; k < 3; k++) {
        enum kvcap_policy pol = c->cfg.policy[k];
        KVCAP_RETURN_IF(pol != KVCAP_POLICY_FULL && pol != KVCAP_POLICY_STREAMING &&
                            pol != KVCAP_POLICY_KVCAPSULE,
                        KVCAP_ERR_UNSUPPORTED,
                        "runtime config: policies.%s is '%s', which a device cache "
                        "(params.memory = KVCAP_MEMORY_CUDA) does not offer (full, streaming, "
                        "kvcapsule)",
                        kinds[k], kvcap_policy_name(pol));
    }
    /* The fallback serves kvcapsule's spans without a bucket: it matters only with kvcapsule
     * (its default, flashcache, must then be overridden in the config). */
    enum kvcap_policy fb = c->cfg.fallback;
    KVCAP_RETURN_IF(c->cfg.policy[KVCAP_SPAN_VISION] == KVCAP_POLICY_KVCAPSULE &&
                        fb != KVCAP_FALLBACK_NONE && fb != KVCAP_POLICY_FULL &&
                        fb != KVCAP_POLICY_STREAMING,
                    KVCAP_ERR_UNSUPPORTED,
                    "runtime config: fallback is '%s', which a device cache (params.memory = "
                    "KVCAP_MEMORY_CUDA) does not offer (full, streaming or none)",
                    kvcap_policy_name(fb));
    int G = c->g.n_q_heads / c->g.n_kv_heads, d = c->g.head_dim;
    KVCAP_RETURN_IF(G > KVCAP_CUDA_ATTN_MAX_NQ || d % 8 != 0 || d < KVCAP_CUDA_ATTN_MIN_D ||
                        d > KVCAP_CUDA_ATTN_MAX_D,
                    KVCAP_ERR_UNSUPPORTED,
                    "params.model: G = %d query heads per KV head and head_dim %d; the device "
                    "kernels serve G <= %d and head_dim a multiple of 8 in %d..%d",
                    G, d, KVCAP_CUDA_ATTN_MAX_NQ, KVCAP_CUDA_ATTN_MIN_D, KVCAP_CUDA_ATTN_MAX_D);
    KVCAP_RETURN_IF(c->n_seqs > 65535, KVCAP_ERR_UNSUPPORTED,
                    "params.n_seqs: %d; a device cache serves at most 65535 sequences", c->n_seqs);
    int n = kvcap_cuda_device_count();
    KVCAP_RETURN_IF(n == 0, KVCAP_ERR_UNSUPPORTED,
                    "params.memory: KVCAP_MEMORY_CUDA needs a CUDA device and none is visible");
    KVCAP_RETURN_IF(p->cuda_device < 0 || p->cuda_device >= n, KVCAP_ERR_INVALID_ARGUMENT,
                    "params.cuda_device: %d is outside 0..%d", p->cuda_device, n - 1);
    return KVCAP_OK;
}

static int device_offers(enum kvcap_policy p)
{
    return p == KVCAP_POLICY_FULL || p == KVCAP_POLICY_STREAMING || p == KVCAP_POLICY_KVCAPSULE;
}

static enum kvcap_status device_create_store(struct kvcap_cache *c,
                                             const struct kvcap_cache_params *p)
{
    return device_create(c, p->cuda_device);
}

/* One generated token of (seq, layer): enqueued; the host advances its count of rows. */
static enum kvcap_status device_append_token(struct kvcap_cache *c, int seq, int layer,
                                             const struct kvcap_tensor_view *k,
                                             const struct kvcap_tensor_view *v)
{
    struct kvcap_segment *gen = &kvcap_cache_seq_layer(c, seq, layer)->gen;
    int grow_to, row = kvcap_segment_gen_row(c, gen, &grow_to);
    KVCAP_TRY(device_append(c, seq, layer, k, v, grow_to));
    if (row == gen->n_rows)
        gen->n_rows++;
    return KVCAP_OK;
}

static enum kvcap_status device_stream(struct kvcap_cache *c, void *stream)
{
    device_set_stream(c, stream);
    return KVCAP_OK;
}

const struct kvcap_store_i kvcap_store_cuda = {
    .name = "cuda",
    .host_memory = 0,
    .offers = device_offers,
    .supports = device_supports,
    .create = device_create_store,
    .free = device_free,
    .reserve = device_reserve,
    .fill = device_fill,
    .capsule_prefill = device_capsule_prefill,
    .segment_free = device_segment_free,
    .layer_changed = device_layer_changed,
    .append = device_append_token,
    .attend = device_attend,
    .set_stream = device_stream,
    .sync = device_sync,
};
