/* cache_host.c — the host store (store.h): K/V rows and KVCapsule state in host memory, and
 * decode attention on the CPU kernels, every KV head cut into slices the cache's threads (or
 * the engine's) share, KVCapsule spans of one bucket attended together across the batch so the
 * maps are read once per step. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/basis_rows.h"
#include "kernels/capsule_prefill.h"
#include "kernels/load.h"
#include "kernels/rope.h"
#include "runtime/cache_internal.h"
#include "runtime/pool.h"

/* ---- Work sharing and row stores ---------------------------------------------------------- */

void kvcap_cache_parallel(struct kvcap_cache *c, int n_tasks, kvcap_task_fn fn, void *ctx)
{
    if (c->parallel_for && n_tasks > 1)
        c->parallel_for(c->parallel_user, n_tasks, fn, ctx);
    else if (c->parallel_for) /* one task: nothing to share, no engine round trip */
        for (int t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
    else
        kvcap_pool_run(c->pool, n_tasks, fn, ctx);
}

/* Stores f32 rows ([n][d]) as rows [r0, r0+n) of head h. */
static void segment_store(const struct kvcap_cache *c, struct kvcap_segment *seg, int head, int r0,
                          int n, const float *k, const float *v)
{
    size_t d = (size_t)c->g.head_dim, es = kvcap_dtype_size(c->storage);
    size_t off = ((size_t)head * (size_t)seg->cap + (size_t)r0) * d * es;
    kvcap_store_f32(c->storage, k, (size_t)n * d, (char *)seg->k + off);
    kvcap_store_f32(c->storage, v, (size_t)n * d, (char *)seg->v + off);
}

/* ---- Prefill ------------------------------------------------------------------------------ */

/* Plain rows in host memory, [kv_heads][cap][head_dim] in the storage dtype. */
static enum kvcap_status host_reserve(struct kvcap_cache *c, struct kvcap_segment *seg, int cap)
{
    size_t d = (size_t)c->g.head_dim, H = (size_t)c->g.n_kv_heads;
    size_t es = kvcap_dtype_size(c->storage);
    void *k = malloc(H * (size_t)cap * d * es), *v = malloc(H * (size_t)cap * d * es);
    if (!k || !v) {
        free(k), free(v);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory for %d rows", cap);
    }
    for (size_t h = 0; seg->n_rows > 0 && h < H; h++) {
        memcpy((char *)k + h * (size_t)cap * d * es, (char *)seg->k + h * (size_t)seg->cap * d * es,
               (size_t)seg->n_rows * d * es);
        memcpy((char *)v + h * (size_t)cap * d * es, (char *)seg->v + h * (size_t)seg->cap * d * es,
               (size_t)seg->n_rows * d * es);
    }
    free(seg->k), free(seg->v);
    seg->k = k;
    seg->v = v;
    seg->cap = cap;
    return KVCAP_OK;
}

static enum kvcap_status host_fill(struct kvcap_cache *c, struct kvcap_segment *seg,
                                 const struct kvcap_tensor_view *k,
                                 const struct kvcap_tensor_view *v, const int *tokens, int n)
{
    int d = c->g.head_dim;
    KVCAP_TRY(kvcap_segment_reserve(c, seg, n > 0 ? n : 1));
    float *kr = malloc(sizeof(float) * (size_t)d * 2);
    KVCAP_RETURN_IF(!kr, KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory");
    float *vr = kr + d;
    for (int h = 0; h < c->g.n_kv_heads; h++)
        for (int j = 0; j < n; j++) {
            int t = tokens ? tokens[j] : j;
            kvcap_view_read(k, h, t, 1, d, kr);
            kvcap_view_read(v, h, t, 1, d, vr);
            segment_store(c, seg, h, j, 1, kr, vr);
        }
    free(kr);
    seg->n_rows = n;
    return KVCAP_OK;
}

/* KVCapsule's state of one span, every KV head through kvcap_capsule_prefill (the maps of
 * the span's bucket; the views read as f32 one head at a time). With kvcapsule.exact_tiles,
 * each head keeps that many of its tiles (at most all but one) as plain rows instead
 * (kvcap_capsule_exact_head). */
static enum kvcap_status host_capsule_prefill(struct kvcap_cache *c, int layer,
                                              struct kvcap_segment *seg,
                                              const struct kvcap_tensor_view *k,
                                              const struct kvcap_tensor_view *v)
{
    const struct kvcap_model_geometry *g = &c->g;
    const struct kvcap_artifact *a = c->artifact;
    const struct kvcap_bucket *bk = &a->buckets[seg->bucket];
    /* Every KV head of a layer and bucket has head 0's h and R_v (kvcap_artifact_open). */
    const struct kvcap_unit_maps *u0 = kvcap_artifact_unit(a, layer, 0, seg->bucket);
    int n = seg->n_tokens, d = g->head_dim, H = g->n_kv_heads, m = u0->m, all = n / m;
    int exact = kvcap_capsule_exact_count(c, all);
    seg->tiles = all - exact;
    seg->h = u0->h;
    seg->rv = u0->rv;
    size_t es = kvcap_dtype_size(c->storage);
    size_t per_h = (size_t)seg->tiles * seg->h * d, per_v = (size_t)seg->tiles * seg->rv * d;
    seg->hs = malloc((size_t)H * per_h * es);
    seg->vt = malloc((size_t)H * per_v * es);
    seg->mu = malloc((size_t)H * d * es);
    struct kvcap_capsule_prefill_maps maps = {m, u0->rk, u0->h, u0->rv, u0->gelu, NULL,
                                              NULL, NULL, NULL};
    size_t scratch = exact > 0 ? kvcap_capsule_exact_work_floats(u0, n, d)
                               : kvcap_capsule_prefill_scratch_floats(&maps, d);
    float *kf = malloc(sizeof(float) * ((size_t)n * d * 2 + scratch));
    enum kvcap_status st = KVCAP_OK;
    if (!seg->hs || !seg->vt || !seg->mu || !kf)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvcapsule: out of memory for a %d-token span", n);
    if (st == KVCAP_OK && exact > 0 && (st = kvcap_segment_reserve(c, seg, exact * m)) == KVCAP_OK)
        seg->n_rows = exact * m;
    float *vf = kf ? kf + (size_t)n * d : NULL;
    for (int h = 0; st == KVCAP_OK && h < H; h++) {
        const struct kvcap_unit_maps *u = kvcap_artifact_unit(a, layer, h, seg->bucket);
        maps = (struct kvcap_capsule_prefill_maps){u->m, u->rk, u->h, u->rv, u->gelu,
                                                   u->mask, u->w1, u->b1, u->u};
        kvcap_view_read(k, h, 0, n, d, kf);
        kvcap_view_read(v, h, 0, n, d, vf);
        char *hs = (char *)seg->hs + (size_t)h * per_h * es;
        char *vt = (char *)seg->vt + (size_t)h * per_v * es;
        char *mu = (char *)seg->mu + (size_t)h * d * es;
        if (exact > 0) {
            size_t rows = (size_t)h * seg->cap * d * es; /* the head's rows: [heads][cap][d] */
            st = kvcap_capsule_exact_head(g, bk, u, n, d, seg->p0, exact, kf, vf, c->storage, hs,
                                          vt, mu, (char *)seg->k + rows, (char *)seg->v + rows,
                                          vf + (size_t)n * d);
        } else {
            st = kvcap_capsule_prefill(g, bk, &maps, n, d, seg->p0, kf, vf, c->storage, hs, vt, mu,
                                       vf + (size_t)n * d);
        }
    }
    free(kf);
    return st;
}

/* ---- Decode ------------------------------------------------------------------------------- */

/* One generated token: read as f32 and checked, then into the FreeKV store or the generated
 * rows (a ring for streaming). */
static enum kvcap_status host_append(struct kvcap_cache *c, int seq, int layer,
                                     const struct kvcap_tensor_view *k,
                                     const struct kvcap_tensor_view *v)
{
    struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, layer);
    struct kvcap_segment *gen = &sl->gen;
    int d = c->g.head_dim, H = c->g.n_kv_heads;
    /* the token as f32, [2][heads][d]: keys then values */
    float *buf = malloc(sizeof(float) * 2 * (size_t)H * d);
    KVCAP_RETURN_IF(!buf, KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory");
    float *vb = buf + (size_t)H * d;
    for (int h = 0; h < H; h++) {
        kvcap_view_read(k, h, 0, 1, d, buf + (size_t)h * d);
        kvcap_view_read(v, h, 0, 1, d, vb + (size_t)h * d);
    }
    enum kvcap_status st = KVCAP_OK;
    for (size_t i = 0; st == KVCAP_OK && i < 2 * (size_t)H * d; i++)
        if (!isfinite(buf[i]))
            st = kvcap_fail(KVCAP_ERR_NUMERIC,
                            "append: %s: non-finite value %g at head %d, channel %d",
                            i < (size_t)H * d ? "k" : "v", (double)buf[i],
                            (int)(i % ((size_t)H * d) / (size_t)d), (int)(i % (size_t)d));
    if (st != KVCAP_OK) {
        /* refused above: nothing stored */
    } else if (gen->policy == KVCAP_POLICY_FREEKV) {
        struct kvcap_freekv *f;
        st = kvcap_cache_freekv(c, sl, &f);
        if (st == KVCAP_OK)
            st = kvcap_freekv_append(f, buf, vb, 1);
        if (st == KVCAP_OK)
            sl->freekv_tokens_by_kind[KVCAP_SPAN_GENERATED]++;
    } else {
        int grow_to, row = kvcap_segment_gen_row(c, gen, &grow_to);
        if (grow_to > 0)
            st = kvcap_segment_reserve(c, gen, grow_to);
        for (int h = 0; st == KVCAP_OK && h < H; h++)
            segment_store(c, gen, h, row, 1, buf + (size_t)h * d, vb + (size_t)h * d);
        if (st == KVCAP_OK && row == gen->n_rows)
            gen->n_rows++;
    }
    free(buf);
    return st;
}

static enum kvcap_status grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return KVCAP_OK;
    void *q = realloc(*p, need * elem);
    KVCAP_RETURN_IF(!q, KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory for attention scratch");
    *p = q;
    *cap = need;
    return KVCAP_OK;
}

/* Spans of bucket b at `layer` across the batch, and the most tiles any has. */
static int bucket_spans(const struct kvcap_cache *c, int layer, int b, int *max_tiles)
{
    int n = 0;
    *max_tiles = 1;
    for (int s = 0; s < c->n_seqs; s++) {
        const struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, s, layer);
        for (int i = 0; i < sl->n_segs; i++)
            if (sl->segs[i].policy == KVCAP_POLICY_KVCAPSULE && sl->segs[i].bucket == b) {
                n++;
                *max_tiles = sl->segs[i].tiles > *max_tiles ? sl->segs[i].tiles : *max_tiles;
            }
    }
    return n;
}

static struct kvcap_capsule_maps unit_maps(const struct kvcap_unit_maps *u)
{
    struct kvcap_capsule_maps m = {u->m, u->h, u->rv, u->w2, u->b2, u->u};
    return m;
}

/* Slices of one KV head's work per attend call: enough tasks for every thread to stay busy when
 * a worker wakes late or the heads are few (4 KV heads on 16 threads), never slices smaller than
 * ATTEND_MIN_TOKENS tokens, whose fixed costs would show. */
#define ATTEND_TASKS_PER_THREAD 4
#define ATTEND_MAX_PARTS 16
#define ATTEND_MIN_TOKENS 256

static int attend_parts(const struct kvcap_cache *c)
{
    if (c->threads < 2)
        return 1;
    int want = (ATTEND_TASKS_PER_THREAD * c->threads + c->g.n_kv_heads - 1) / c->g.n_kv_heads;
    return want < 1 ? 1 : want > ATTEND_MAX_PARTS ? ATTEND_MAX_PARTS : want;
}

/* Slice k of n items cut into at most n_parts slices of at least `min` items: [*lo, *hi), which
 * is empty when k is past the last slice. Whole to slice 0 when n is too small to cut. */
static void part_range(int n, int k, int n_parts, int min, int *lo, int *hi)
{
    int cuts = n / (min > 0 ? min : 1);
    cuts = cuts < 1 ? 1 : cuts > n_parts ? n_parts : cuts;
    *lo = *hi = 0;
    if (k < cuts) {
        *lo = (int)((int64_t)n * k / cuts);
        *hi = (int)((int64_t)n * (k + 1) / cuts);
    }
}

static enum kvcap_status prepare_scratch(struct kvcap_cache *c, int layer)
{
    int G = c->g.n_q_heads / c->g.n_kv_heads, d = c->g.head_dim;
    c->n_parts = attend_parts(c);
    size_t part = (size_t)c->g.n_kv_heads * c->n_parts * c->n_seqs * (size_t)G * (size_t)(d + 2);
    KVCAP_TRY(grow((void **)&c->parts, &c->parts_cap, part, sizeof(float)));
    size_t spans = 1, work = 1;
    for (int b = 0; c->artifact && b < c->artifact->n_buckets; b++) {
        int max_tiles, n = bucket_spans(c, layer, b, &max_tiles);
        if (n == 0)
            continue;
        spans = (size_t)n > spans ? (size_t)n : spans;
        for (int h = 0; h < c->g.n_kv_heads; h++) {
            struct kvcap_capsule_maps m = unit_maps(kvcap_artifact_unit(c->artifact, layer, h, b));
            size_t need = kvcap_capsule_scratch_floats(&m, n, max_tiles, G, d);
            work = need > work ? need : work;
        }
    }
    for (int s = 0; s < c->n_seqs; s++) { /* kvzip's kept keys with values in a basis */
        const struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, s, layer);
        for (int i = 0; i < sl->n_segs; i++) {
            const struct kvcap_segment *seg = &sl->segs[i];
            if (!seg->row_point)
                continue;
            size_t need = kvcap_attend_basis_rows_scratch_floats(seg->n_rows, seg->tiles,
                                                                 seg->rv, seg->n_vx, G, d);
            work = need > work ? need : work;
        }
    }
    for (int t = 0; t < c->threads; t++) {
        struct kvcap_thread_scratch *s = &c->scratch[t];
        KVCAP_TRY(grow((void **)&s->qrot, &s->qrot_cap, spans * (size_t)G * d, sizeof(float)));
        KVCAP_TRY(grow((void **)&s->spans, &s->spans_cap, spans, sizeof(struct kvcap_capsule_span)));
        KVCAP_TRY(grow((void **)&s->work, &s->work_cap, work, sizeof(float)));
    }
    return KVCAP_OK;
}

/* The partial of sequence s in slice k of KV head h. */
static struct kvcap_partial seq_partial(const struct kvcap_cache *c, int h, int k, int s)
{
    int G = c->g.n_q_heads / c->g.n_kv_heads, d = c->g.head_dim;
    float *base = c->parts + (((size_t)h * c->n_parts + k) * c->n_seqs + s) * G * (d + 2);
    struct kvcap_partial p = {base, base + G, base + 2 * G};
    return p;
}

/* Slice k of KV head h at `layer`, for every sequence: slice k of each plain segment's rows,
 * row by row, and slice k of each KVCapsule span's tiles, bucket by bucket across the batch
 * (FreeKV state: slice 0). Bytes count what one whole head reads: the maps and each span's μ,
 * which every slice reads, are counted by slice 0 only. */
/* Slice k of KV head h of one layer's attention, for every sequence: folds the slice's rows and
 * KVCapsule tiles into the sequences' partials k and adds the bytes it read to *bytes (the maps'
 * to *map_bytes, slice 0 only). A kernel's failure is returned as is: the partials are then
 * incomplete and the whole call fails. */
static enum kvcap_status attend_part(struct kvcap_cache *c, int layer, int h, int k,
                                     const float *q, struct kvcap_thread_scratch *sc,
                                     uint64_t *bytes_out, uint64_t *map_bytes)
{
    const struct kvcap_model_geometry *g = &c->g;
    int G = g->n_q_heads / g->n_kv_heads, d = g->head_dim, P = c->n_parts;
    float scale = 1.0f / sqrtf((float)d);
    size_t es = kvcap_dtype_size(c->storage);
    uint64_t bytes = 0;
    for (int s = 0; s < c->n_seqs; s++) {
        struct kvcap_partial acc = seq_partial(c, h, k, s);
        kvcap_partial_reset(acc, G, d);
        const float *qs = q + ((size_t)s * g->n_q_heads + (size_t)h * G) * d;
        const struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, s, layer);
        for (int i = 0; i <= sl->n_segs; i++) {
            const struct kvcap_segment *seg = i < sl->n_segs ? &sl->segs[i] : &sl->gen;
            int lo, hi;
            size_t first;
            int n_rows;
            if (seg->n_rows == 0) /* KVCapsule's exact tiles are rows too */
                continue;
            kvcap_segment_head_rows(seg, h, &first, &n_rows);
            part_range(n_rows, k, P, ATTEND_MIN_TOKENS, &lo, &hi);
            if (hi == lo)
                continue;
            size_t at = (first + (size_t)lo) * d * es;
            uint64_t got;
            if (seg->row_point) { /* kvzip's keys, values in the bucket's basis */
                const struct kvcap_unit_maps *u =
                    kvcap_artifact_unit(c->artifact, layer, h, seg->bucket);
                struct kvcap_basis_rows rows = {
                    (const char *)seg->k + at, c->storage, (size_t)d, hi - lo,
                    seg->row_point + first + lo, u->m, seg->rv, seg->tiles, u->u,
                    (const char *)seg->vt + (size_t)h * seg->tiles * seg->rv * d * es,
                    (const char *)seg->mu + (size_t)h * d * es,
                    seg->n_vx ? (const char *)seg->vx + (size_t)h * seg->n_vx * d * es : NULL,
                    seg->n_vx};
                KVCAP_TRY(kvcap_attend_basis_rows(&rows, qs, G, d, scale, acc, sc->work,
                                                  sc->work_cap, &got));
            } else {
                struct kvcap_rows rows = {(const char *)seg->k + at, (const char *)seg->v + at,
                                          c->storage, (size_t)d, hi - lo};
                KVCAP_TRY(kvcap_attend_rows(&rows, qs, G, d, scale, acc, &got));
            }
            bytes += got;
        }
        if (sl->freekv && k == 0) {
            uint64_t got;
            KVCAP_TRY(kvcap_freekv_attend(sl->freekv, h, qs, scale, acc, &got));
            bytes += got;
        }
    }
    for (int b = 0; c->artifact && b < c->artifact->n_buckets; b++) {
        const struct kvcap_unit_maps *u = kvcap_artifact_unit(c->artifact, layer, h, b);
        int n = 0, min_tiles = (ATTEND_MIN_TOKENS + u->m - 1) / u->m;
        for (int s = 0; s < c->n_seqs; s++) {
            const struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, s, layer);
            const float *qs = q + ((size_t)s * g->n_q_heads + (size_t)h * G) * d;
            for (int i = 0; i < sl->n_segs; i++) {
                const struct kvcap_segment *seg = &sl->segs[i];
                int lo, hi;
                if (seg->policy != KVCAP_POLICY_KVCAPSULE || seg->bucket != b)
                    continue;
                part_range(seg->tiles, k, P, min_tiles, &lo, &hi);
                if (hi == lo)
                    continue;
                float *qr = sc->qrot + (size_t)n * G * d;
                memcpy(qr, qs, sizeof(float) * (size_t)G * d);
                kvcap_rope_rotate(g, qr, (size_t)G, (size_t)d, -(double)seg->p0);
                size_t hs = ((size_t)h * seg->tiles + lo) * seg->h * d,
                       vt = ((size_t)h * seg->tiles + lo) * seg->rv * d;
                struct kvcap_capsule_span span = {
                    (const char *)seg->hs + hs * es, (const char *)seg->vt + vt * es,
                    (const char *)seg->mu + (size_t)h * d * es, c->storage, hi - lo, qr,
                    seq_partial(c, h, k, s)};
                sc->spans[n++] = span;
            }
        }
        if (n == 0)
            continue;
        struct kvcap_capsule_maps m = unit_maps(u);
        uint64_t got;
        KVCAP_TRY(kvcap_capsule_attend(&m, sc->spans, n, G, d, scale, sc->work, sc->work_cap,
                                       &got));
        uint64_t maps = ((uint64_t)u->h * u->m + (uint64_t)u->m + (uint64_t)u->rv * u->m) * 4;
        if (k == 0)
            *map_bytes += maps;
        else /* the maps and μ again: slice 0 counted them */
            got -= maps + (uint64_t)n * d * es;
        bytes += got;
    }
    *bytes_out += bytes;
    return KVCAP_OK;
}

struct attend_job {
    struct kvcap_cache *c;
    int layer;
    const float *q;
    uint64_t bytes[64], map_bytes[64]; /* per thread */
    struct kvcap_parallel_error error;  /* the first slice that failed */
};

static void attend_task(void *ctx, int task, int thread)
{
    struct attend_job *job = ctx;
    int P = job->c->n_parts;
    if (kvcap_parallel_failed(&job->error))
        return; /* the call fails anyway */
    kvcap_quiet_push(); /* re-raised once, on the caller's thread */
    enum kvcap_status st = attend_part(job->c, job->layer, task / P, task % P, job->q,
                                       &job->c->scratch[thread], &job->bytes[thread],
                                       &job->map_bytes[thread]);
    if (st != KVCAP_OK)
        kvcap_parallel_fail(&job->error, st);
    kvcap_quiet_pop();
}

/* Merges each (sequence, KV head)'s slices and writes its outputs (and log-sum-exps). */
static void attend_finish(struct kvcap_cache *c, float *out, float *lse)
{
    const struct kvcap_model_geometry *g = &c->g;
    int G = g->n_q_heads / g->n_kv_heads, d = g->head_dim;
    for (int s = 0; s < c->n_seqs; s++)
        for (int h = 0; h < g->n_kv_heads; h++) {
            struct kvcap_partial p = seq_partial(c, h, 0, s);
            for (int k = 1; k < c->n_parts; k++)
                kvcap_partial_merge(p, seq_partial(c, h, k, s), G, d);
            size_t at = (size_t)s * g->n_q_heads + (size_t)h * G;
            kvcap_partial_finish(p, G, d, out + at * d, (size_t)d);
            for (int i = 0; lse && i < G; i++)
                lse[at + i] = p.sum[i] > 0 ? p.mx[i] + logf(p.sum[i]) : -INFINITY;
        }
}

/* Decode attention: every KV head cut into slices over the threads (attend_part), then the
 * slices merged (attend_finish); FreeKV's next selection queued last. */
static enum kvcap_status host_attend(struct kvcap_cache *c, int layer, const float *q, float *out,
                                     float *lse)
{
    const size_t nq = (size_t)c->n_seqs * c->g.n_q_heads * c->g.head_dim;
    for (size_t i = 0; i < nq; i++)
        KVCAP_RETURN_IF(!isfinite(q[i]), KVCAP_ERR_NUMERIC,
                        "attend: q: non-finite value %g at seq %d, head %d, channel %d",
                        (double)q[i], (int)(i / ((size_t)c->g.n_q_heads * c->g.head_dim)),
                        (int)(i / (size_t)c->g.head_dim % (size_t)c->g.n_q_heads),
                        (int)(i % (size_t)c->g.head_dim));
    KVCAP_TRY(prepare_scratch(c, layer));
    if (c->recorder)
        KVCAP_TRY(kvcap_recorder_decode_queries(c->recorder, layer, q));
    struct attend_job job = {c, layer, q, {0}, {0}, {0}};
    /* KV heads are independent; BLAS runs single-threaded inside the parallel tasks. */
    int blas_threads = openblas_get_num_threads();
    if (c->threads > 1)
        openblas_set_num_threads(1);
    kvcap_cache_parallel(c, c->g.n_kv_heads * c->n_parts, attend_task, &job);
    if (c->threads > 1)
        openblas_set_num_threads(blas_threads);
    KVCAP_TRY(kvcap_parallel_status(&job.error));
    attend_finish(c, out, lse);
    uint64_t bytes = 0, map_bytes = 0;
    for (int t = 0; t < c->threads; t++)
        bytes += job.bytes[t], map_bytes += job.map_bytes[t];
    c->last_read = bytes;
    c->last_map_read = map_bytes;
    /* FreeKV: the next step's selection and recall go to the worker now, off the path of the
     * layers that follow. */
    for (int s = 0; s < c->n_seqs; s++) {
        struct kvcap_freekv *f = kvcap_cache_seq_layer(c, s, layer)->freekv;
        if (f)
            KVCAP_TRY(kvcap_freekv_step_done(f));
    }
    return KVCAP_OK;
}

static void host_segment_free(struct kvcap_segment *seg)
{
    free(seg->k), free(seg->v), free(seg->hs), free(seg->vt), free(seg->mu);
}

static int host_offers(enum kvcap_policy p)
{
    (void)p;
    return 1; /* every policy */
}

static enum kvcap_status host_set_stream(struct kvcap_cache *c, void *stream)
{
    (void)c, (void)stream;
    return kvcap_fail(KVCAP_ERR_STATE, "set_stream: the cache keeps host memory (params.memory is "
                                       "KVCAP_MEMORY_HOST)");
}

static enum kvcap_status host_sync(struct kvcap_cache *c)
{
    (void)c;
    return KVCAP_OK; /* every call has finished when it returns */
}

const struct kvcap_store_i kvcap_store_host = {
    .name = "host",
    .host_memory = 1,
    .offers = host_offers,
    .reserve = host_reserve,
    .fill = host_fill,
    .capsule_prefill = host_capsule_prefill,
    .segment_free = host_segment_free,
    .append = host_append,
    .attend = host_attend,
    .set_stream = host_set_stream,
    .sync = host_sync,
};
