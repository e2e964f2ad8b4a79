/* cache.c — libkvcap's cache: sequences × layers of segments (one per prefill span, plus the
 * generated tail and the FreeKV store), the policy chosen per span kind, the end of prefill
 * (cross-layer compression), and decode attention that merges every segment's partial softmax.
 * KVCapsule segments of one bucket are attended together across the whole batch so the maps
 * are read once per step. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/cache_internal.h"
#include "kernels/cuda/attention_cuda.h"
#include "runtime/pool.h"
#include "kernels/rope.h"
#include "kernels/select.h"

static const struct kvcap_policy_impl *policy_impl(enum kvcap_policy p)
{
    switch (p) {
    case KVCAP_POLICY_FULL: return &kvcap_policy_full_impl;
    case KVCAP_POLICY_STREAMING: return &kvcap_policy_streaming_impl;
    case KVCAP_POLICY_KVCAPSULE: return &kvcap_policy_kvcapsule_impl;
    case KVCAP_POLICY_FLASHCACHE: return &kvcap_policy_flashcache_impl;
    case KVCAP_POLICY_VLCACHE: return &kvcap_policy_vlcache_impl;
    case KVCAP_POLICY_FREEKV: return &kvcap_policy_freekv_impl;
    default: return NULL;
    }
}

void kvcap_cache_default_params(struct kvcap_cache_params *p)
{
    if (!p)
        return;
    memset(p, 0, sizeof *p);
    p->n_seqs = 1;
    p->storage = KVCAP_DTYPE_F16;
}

/* What a device cache (params.memory = KVCAP_MEMORY_CUDA) can serve, checked once the runtime
 * config is loaded; the device itself last, so every other error is reported without one. */
static enum kvcap_status device_check(const struct kvcap_cache *c,
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
#ifdef KVCAP_WITH_CUDA
    KVCAP_RETURN_IF(n == 0, KVCAP_ERR_UNSUPPORTED,
                    "params.memory: KVCAP_MEMORY_CUDA needs a CUDA device and none is visible");
#else
    KVCAP_RETURN_IF(n == 0, KVCAP_ERR_UNSUPPORTED,
                    "params.memory: KVCAP_MEMORY_CUDA needs a CUDA device and this build has no "
                    "CUDA support");
#endif
    KVCAP_RETURN_IF(p->cuda_device < 0 || p->cuda_device >= n, KVCAP_ERR_INVALID_ARGUMENT,
                    "params.cuda_device: %d is outside 0..%d", p->cuda_device, n - 1);
    return KVCAP_OK;
}

enum kvcap_status kvcap_cache_create(const struct kvcap_cache_params *p, struct kvcap_cache **out)
{
    KVCAP_RETURN_IF(!p || !out, KVCAP_ERR_INVALID_ARGUMENT, "kvcap_cache_create: NULL argument");
    *out = NULL;
    KVCAP_TRY(kvcap_geometry_validate(&p->model));
    KVCAP_RETURN_IF(p->n_seqs < 1 || p->n_seqs > 65536, KVCAP_ERR_INVALID_ARGUMENT,
                    "params.n_seqs: %d is outside 1..65536", p->n_seqs);
    KVCAP_RETURN_IF(!kvcap_dtype_is_storage(p->storage), KVCAP_ERR_INVALID_ARGUMENT,
                    "params.storage: %s is not F32, F16 or BF16", kvcap_dtype_name(p->storage));
    KVCAP_RETURN_IF(p->n_threads < 0 || p->n_threads > 64, KVCAP_ERR_INVALID_ARGUMENT,
                    "params.n_threads: %d is outside 0..64", p->n_threads);
    KVCAP_RETURN_IF(p->parallel_for && p->n_threads == 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "params.n_threads: 0 (all cores) with params.parallel_for; set the number "
                    "of engine threads it runs tasks on (1..64)");
    KVCAP_RETURN_IF(p->memory != KVCAP_MEMORY_HOST && p->memory != KVCAP_MEMORY_CUDA,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "params.memory: %d is not KVCAP_MEMORY_HOST or KVCAP_MEMORY_CUDA",
                    (int)p->memory);
    KVCAP_RETURN_IF(p->reserve_tokens < 0 || p->reserve_tokens > (1 << 24),
                    KVCAP_ERR_INVALID_ARGUMENT, "params.reserve_tokens: %d is outside 0..2^24",
                    p->reserve_tokens);
    KVCAP_RETURN_IF(p->config_path && !*p->config_path, KVCAP_ERR_INVALID_ARGUMENT,
                    "params.config_path: empty string (NULL means the defaults)");
    KVCAP_RETURN_IF(p->record_dir && !*p->record_dir, KVCAP_ERR_INVALID_ARGUMENT,
                    "params.record_dir: empty string (NULL means no record mode)");
    int device = p->memory == KVCAP_MEMORY_CUDA;
    KVCAP_RETURN_IF(device && p->record_dir, KVCAP_ERR_UNSUPPORTED,
                    "params.record_dir: record mode is not available with params.memory = "
                    "KVCAP_MEMORY_CUDA (it records from host memory)");
    if (p->artifact) {
        const char *diff = kvcap_geometry_difference(&p->artifact->model, &p->model);
        KVCAP_RETURN_IF(diff, KVCAP_ERR_GEOMETRY,
                        "params.artifact: its %s differs from params.model (the artifact was "
                        "calibrated for another model)",
                        diff);
    }
    struct kvcap_cache *c = calloc(1, sizeof *c);
    KVCAP_RETURN_IF(!c, KVCAP_ERR_OUT_OF_MEMORY, "kvcap_cache_create: out of memory");
    c->g = p->model;
    c->n_seqs = p->n_seqs;
    c->storage = p->storage;
    c->artifact = p->artifact;
    c->reserve_tokens = p->reserve_tokens;
    enum kvcap_status st =
        p->config_path ? kvcap_runtime_config_load_file(p->config_path, &c->cfg)
                       : (kvcap_runtime_config_default(&c->cfg), KVCAP_OK);
    /* Defaults: vision spans go to kvcapsule when an artifact is given (flashcache else; a
     * device cache, which has no flashcache, keeps them in full and falls back to full). */
    if (st == KVCAP_OK && !p->config_path && p->artifact)
        c->cfg.policy[KVCAP_SPAN_VISION] = KVCAP_POLICY_KVCAPSULE;
    if (st == KVCAP_OK && !p->config_path && device) {
        if (!p->artifact)
            c->cfg.policy[KVCAP_SPAN_VISION] = KVCAP_POLICY_FULL;
        c->cfg.fallback = KVCAP_POLICY_FULL;
    }
    if (st == KVCAP_OK && c->cfg.policy[KVCAP_SPAN_VISION] == KVCAP_POLICY_KVCAPSULE &&
        !p->artifact)
        st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                        "params.artifact: the runtime config compresses vision spans with "
                        "kvcapsule, which needs an artifact");
    for (int k = 0; st == KVCAP_OK && k < 3; k++) {
        enum kvcap_policy pol = c->cfg.policy[k];
        if (!policy_impl(pol))
            st = kvcap_fail(KVCAP_ERR_CONFIG, "runtime config: policy %d is unknown",
                            (int)pol);
    }
    /* Generated tokens arrive one at a time: only policies that work token by token. */
    enum kvcap_policy gen = c->cfg.policy[KVCAP_SPAN_GENERATED];
    if (st == KVCAP_OK && gen != KVCAP_POLICY_FULL && gen != KVCAP_POLICY_STREAMING &&
        gen != KVCAP_POLICY_FREEKV)
        st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                        "runtime config: policies.generated is '%s'; generated tokens take full, "
                        "streaming or freekv (the others compress a whole span after prefill)",
                        kvcap_policy_name(gen));
    if (st == KVCAP_OK && c->cfg.fallback != KVCAP_FALLBACK_NONE &&
        (!policy_impl(c->cfg.fallback) || c->cfg.fallback == KVCAP_POLICY_KVCAPSULE))
        st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "runtime config: fallback '%s' is not a "
                        "policy for spans without a bucket", kvcap_policy_name(c->cfg.fallback));
    if (st == KVCAP_OK && device)
        st = device_check(c, p);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    c->threads = p->n_threads ? p->n_threads : (int)(cores > 0 ? (cores < 64 ? cores : 64) : 1);
    c->parallel_for = p->parallel_for;
    c->parallel_user = p->parallel_user;
    if (st == KVCAP_OK && !c->parallel_for)
        st = kvcap_pool_create(c->threads, &c->pool);
    if (st == KVCAP_OK) {
        c->layers = calloc((size_t)c->n_seqs * c->g.n_layers, sizeof *c->layers);
        c->scratch = calloc((size_t)c->threads, sizeof *c->scratch);
        if (!c->layers || !c->scratch)
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvcap_cache_create: out of memory");
    }
    for (size_t i = 0; st == KVCAP_OK && i < (size_t)c->n_seqs * c->g.n_layers; i++) {
        c->layers[i].gen.kind = KVCAP_SPAN_GENERATED;
        c->layers[i].gen.policy = c->cfg.policy[KVCAP_SPAN_GENERATED];
    }
    if (st == KVCAP_OK && p->record_dir)
        st = kvcap_recorder_create(&c->g, c->n_seqs, p->record_dir, &c->recorder);
    if (st == KVCAP_OK && device)
        st = kvcap_device_create(c, p->cuda_device);
    if (st != KVCAP_OK) {
        kvcap_cache_free(c);
        return st;
    }
    *out = c;
    return KVCAP_OK;
}

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

void kvcap_cache_free(struct kvcap_cache *c)
{
    if (!c)
        return;
    kvcap_recorder_free(c->recorder);
    kvcap_pool_free(c->pool);
    for (size_t i = 0; c->layers && i < (size_t)c->n_seqs * c->g.n_layers; i++) {
        struct kvcap_seq_layer *sl = &c->layers[i];
        for (int s = 0; s < sl->n_segs; s++)
            kvcap_segment_release(&sl->segs[s]);
        free(sl->segs);
        kvcap_segment_release(&sl->gen);
        free(sl->post_q);
        kvcap_freekv_free(sl->freekv);
    }
    kvcap_freekv_worker_free(c->freekv_worker);
    kvcap_device_free(c);
    for (int t = 0; c->scratch && t < c->threads; t++) {
        struct kvcap_thread_scratch *s = &c->scratch[t];
        free(s->qrot), free(s->spans), free(s->work);
    }
    free(c->scratch);
    free(c->parts);
    free(c->layers);
    kvcap_runtime_config_free(&c->cfg);
    free(c);
}

/* ---- Views and plain rows --------------------------------------------------------------- */

static const void *view_row(const struct kvcap_tensor_view *v, int head, int token)
{
    size_t esize = kvcap_dtype_size(v->dtype);
    if (v->pages) {
        const char *page = v->pages[token / v->page_size];
        return page + ((int64_t)head * v->head_stride +
                       (int64_t)(token % v->page_size) * v->token_stride) * (int64_t)esize;
    }
    return (const char *)v->base +
           ((int64_t)head * v->head_stride + (int64_t)token * v->token_stride) * (int64_t)esize;
}

void kvcap_view_read(const struct kvcap_tensor_view *v, int head, int t0, int n, int d, float *dst)
{
    for (int j = 0; j < n; j++)
        kvcap_load_f32(v->dtype, view_row(v, head, t0 + j), (size_t)d, dst + (size_t)j * d);
}

enum kvcap_status kvcap_view_check(const struct kvcap_tensor_view *v, const char *what, int heads,
                                   int n, int d)
{
    KVCAP_RETURN_IF(!v, KVCAP_ERR_INVALID_ARGUMENT, "%s: NULL view", what);
    KVCAP_RETURN_IF(!kvcap_dtype_is_storage(v->dtype), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s.dtype: %s is not F32, F16 or BF16", what, kvcap_dtype_name(v->dtype));
    KVCAP_RETURN_IF(!v->base && !v->pages, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: neither base nor pages given", what);
    KVCAP_RETURN_IF(v->pages && v->page_size < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s.page_size: %d, need >= 1 with pages", what, v->page_size);
    KVCAP_RETURN_IF(v->head_stride < 0 || v->token_stride < 0 ||
                        (heads > 1 && v->head_stride < d && v->token_stride < d) ||
                        (n > 1 && v->token_stride == 0) || (heads > 1 && v->head_stride == 0),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: strides (head %lld, token %lld) overlap rows of %d channels", what,
                    (long long)v->head_stride, (long long)v->token_stride, d);
    return KVCAP_OK;
}

enum kvcap_status kvcap_segment_reserve(const struct kvcap_cache *c, struct kvcap_segment *seg,
                                        int cap)
{
    if (cap <= seg->cap)
        return KVCAP_OK;
    if (c->dev)
        return kvcap_device_reserve((struct kvcap_cache *)c, seg, cap);
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

void kvcap_segment_store(const struct kvcap_cache *c, struct kvcap_segment *seg, int head, int r0,
                         int n, const float *k, const float *v)
{
    size_t d = (size_t)c->g.head_dim, es = kvcap_dtype_size(c->storage);
    size_t off = ((size_t)head * (size_t)seg->cap + (size_t)r0) * d * es;
    kvcap_convert_from_f32(c->storage, k, (size_t)n * d, (char *)seg->k + off);
    kvcap_convert_from_f32(c->storage, v, (size_t)n * d, (char *)seg->v + off);
}

enum kvcap_status kvcap_segment_fill(struct kvcap_cache *c, struct kvcap_segment *seg,
                                     const struct kvcap_tensor_view *k,
                                     const struct kvcap_tensor_view *v, const int *tokens, int n)
{
    if (c->dev)
        return kvcap_device_fill(c, seg, k, v, tokens, n);
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
            kvcap_segment_store(c, seg, h, j, 1, kr, vr);
        }
    free(kr);
    seg->n_rows = n;
    return KVCAP_OK;
}

/* Copies, for each head h, the rows keep[h][0..n_keep) (ascending) of seg into a new allocation
 * of exactly n_keep rows. keep: [kv_heads][n_keep]. */
static enum kvcap_status copy_kept(const struct kvcap_cache *c, const struct kvcap_segment *seg,
                                   const int *keep, int n_keep, struct kvcap_kept_rows *out)
{
    size_t d = (size_t)c->g.head_dim, H = (size_t)c->g.n_kv_heads;
    size_t es = kvcap_dtype_size(c->storage), row = d * es;
    size_t cap = n_keep > 0 ? (size_t)n_keep : 1;
    char *k = malloc(H * cap * row), *v = malloc(H * cap * row);
    if (!k || !v) {
        free(k), free(v);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory compacting a span");
    }
    for (size_t h = 0; h < H; h++)
        for (int i = 0; i < n_keep; i++) {
            size_t from = (h * (size_t)seg->cap + (size_t)keep[h * (size_t)n_keep + i]) * row;
            memcpy(k + (h * cap + (size_t)i) * row, (const char *)seg->k + from, row);
            memcpy(v + (h * cap + (size_t)i) * row, (const char *)seg->v + from, row);
        }
    *out = (struct kvcap_kept_rows){k, v, n_keep, (int)cap};
    return KVCAP_OK;
}

void kvcap_segment_commit(struct kvcap_segment *seg, struct kvcap_kept_rows *kept)
{
    free(seg->k), free(seg->v);
    seg->k = kept->k;
    seg->v = kept->v;
    seg->cap = kept->cap;
    seg->n_rows = kept->n_keep;
    *kept = (struct kvcap_kept_rows){0};
}

void kvcap_kept_rows_free(struct kvcap_kept_rows *kept)
{
    if (!kept)
        return;
    free(kept->k), free(kept->v);
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
    enum kvcap_status st = copy_kept(c, seg, keep, kept, out);
    free(keep);
    return st;
}

enum kvcap_status kvcap_cache_freekv(struct kvcap_cache *c, struct kvcap_seq_layer *sl,
                                     struct kvcap_freekv **out)
{
    if (!sl->freekv) {
        if (!c->freekv_worker)
            KVCAP_TRY(kvcap_freekv_worker_create(&c->freekv_worker));
        const struct kvcap_freekv_config *f = &c->cfg.freekv;
        struct kvcap_freekv_params p = {f->page_size, f->budget, f->sink_pages,
                                        f->window_pages, (float)f->tau};
        KVCAP_TRY(kvcap_freekv_create(&p, c->g.n_kv_heads, c->g.n_q_heads / c->g.n_kv_heads,
                                      c->g.head_dim, c->storage, c->freekv_worker,
                                      &sl->freekv));
    }
    *out = sl->freekv;
    return KVCAP_OK;
}

void kvcap_segment_release(struct kvcap_segment *seg)
{
    if (seg->dev)
        kvcap_device_segment_free(seg);
    else
        free(seg->k), free(seg->v), free(seg->hs), free(seg->vt), free(seg->mu);
    free(seg->score);
    seg->k = seg->v = seg->hs = seg->vt = seg->mu = NULL;
    seg->score = NULL;
    seg->n_rows = seg->cap = 0;
}

uint64_t kvcap_segment_bytes(const struct kvcap_cache *c, const struct kvcap_segment *seg)
{
    uint64_t H = (uint64_t)c->g.n_kv_heads, d = (uint64_t)c->g.head_dim;
    uint64_t es = kvcap_dtype_size(c->storage);
    if (seg->policy == KVCAP_POLICY_KVCAPSULE && seg->hs)
        return H * ((uint64_t)seg->tiles * (uint64_t)(seg->h + seg->rv) * d + d) * es;
    return H * 2 * (uint64_t)seg->cap * d * es; /* what is allocated, not only used */
}

/* ---- Prefill ------------------------------------------------------------------------------ */

static enum kvcap_status check_seq_layer(const struct kvcap_cache *c, int seq, int layer)
{
    KVCAP_RETURN_IF(!c, KVCAP_ERR_INVALID_ARGUMENT, "cache: NULL cache");
    KVCAP_RETURN_IF(seq < 0 || seq >= c->n_seqs, KVCAP_ERR_INVALID_ARGUMENT,
                    "seq: %d is outside 0..%d", seq, c->n_seqs - 1);
    KVCAP_RETURN_IF(layer < 0 || layer >= c->g.n_layers, KVCAP_ERR_INVALID_ARGUMENT,
                    "layer: %d is outside 0..%d", layer, c->g.n_layers - 1);
    return KVCAP_OK;
}

static enum kvcap_status check_span(const struct kvcap_cache *c, int seq, int layer,
                                    const struct kvcap_span_desc *s)
{
    KVCAP_RETURN_IF(!s, KVCAP_ERR_INVALID_ARGUMENT, "span: NULL");
    KVCAP_RETURN_IF(s->kind != KVCAP_SPAN_VISION && s->kind != KVCAP_SPAN_TEXT,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "span.kind: %d is not VISION or TEXT (generated tokens use append)",
                    (int)s->kind);
    KVCAP_RETURN_IF(s->n_tokens < 1 || s->n_tokens > (1 << 24) || s->p0 < 0,
                    KVCAP_ERR_INVALID_ARGUMENT, "span: n_tokens %d, p0 %d out of range",
                    s->n_tokens, s->p0);
    /* rows * cols in 64 bits: an int product could wrap around to n_tokens */
    KVCAP_RETURN_IF(s->kind == KVCAP_SPAN_VISION &&
                        (s->rows < 1 || s->cols < 1 || (int64_t)s->rows * s->cols != s->n_tokens),
                    KVCAP_ERR_INVALID_ARGUMENT, "span: grid %dx%d does not hold n_tokens %d",
                    s->rows, s->cols, s->n_tokens);
    /* layer l > 0 must follow layer 0's sequence of spans */
    const struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, layer);
    if (layer > 0) {
        const struct kvcap_seq_layer *first = kvcap_cache_seq_layer(c, seq, 0);
        KVCAP_RETURN_IF(sl->n_segs >= first->n_segs, KVCAP_ERR_INVALID_ARGUMENT,
                        "layer %d: span %d of seq %d was not added at layer 0 first", layer,
                        sl->n_segs, seq);
        const struct kvcap_segment *ref = &first->segs[sl->n_segs];
        KVCAP_RETURN_IF(ref->kind != s->kind || ref->n_tokens != s->n_tokens || ref->p0 != s->p0 ||
                            ref->rows != (s->kind == KVCAP_SPAN_VISION ? s->rows : 0),
                        KVCAP_ERR_INVALID_ARGUMENT,
                        "layer %d: span %d of seq %d differs from layer 0's (kind, size, grid or "
                        "p0)",
                        layer, sl->n_segs, seq);
    }
    KVCAP_RETURN_IF(sl->gen.n_rows > 0, KVCAP_ERR_STATE,
                    "seq %d layer %d: spans cannot be added after generated tokens", seq, layer);
    return KVCAP_OK;
}

/* NaN or Inf in what an engine hands over would flow through every policy and come back as
 * finite-looking outputs with status OK (a softmax drops it, or zeros it): refuse it here,
 * naming the argument and where. Host views only (a device cache's views are device memory). */
static enum kvcap_status check_view_finite(const struct kvcap_tensor_view *v, const char *what,
                                           int heads, int n, int d)
{
    enum { ROWS = 64 };
    float *buf = malloc(sizeof(float) * ROWS * (size_t)d);
    KVCAP_RETURN_IF(!buf, KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory");
    for (int h = 0; h < heads; h++)
        for (int t0 = 0; t0 < n; t0 += ROWS) {
            const int rows = n - t0 < ROWS ? n - t0 : ROWS;
            kvcap_view_read(v, h, t0, rows, d, buf);
            for (size_t i = 0; i < (size_t)rows * d; i++)
                if (!isfinite(buf[i])) {
                    const int t = t0 + (int)(i / (size_t)d), ch = (int)(i % (size_t)d);
                    const double x = buf[i];
                    free(buf);
                    return kvcap_fail(KVCAP_ERR_NUMERIC,
                                      "%s: non-finite value %g at head %d, token %d, channel %d",
                                      what, x, h, t, ch);
                }
        }
    free(buf);
    return KVCAP_OK;
}

enum kvcap_status kvcap_cache_add_span(struct kvcap_cache *c, int seq, int layer,
                                       const struct kvcap_span_desc *span,
                                       const struct kvcap_tensor_view *k,
                                       const struct kvcap_tensor_view *v)
{
    KVCAP_TRY(check_seq_layer(c, seq, layer));
    KVCAP_TRY(check_span(c, seq, layer, span));
    KVCAP_TRY(kvcap_view_check(k, "k", c->g.n_kv_heads, span->n_tokens, c->g.head_dim));
    KVCAP_TRY(kvcap_view_check(v, "v", c->g.n_kv_heads, span->n_tokens, c->g.head_dim));
    if (!c->dev) {
        KVCAP_TRY(check_view_finite(k, "add_span: k", c->g.n_kv_heads, span->n_tokens,
                                    c->g.head_dim));
        KVCAP_TRY(check_view_finite(v, "add_span: v", c->g.n_kv_heads, span->n_tokens,
                                    c->g.head_dim));
    }
    struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, layer);
    if (sl->n_segs == sl->cap_segs) {
        int cap = sl->cap_segs ? 2 * sl->cap_segs : 4;
        struct kvcap_segment *grown = realloc(sl->segs, sizeof *grown * (size_t)cap);
        KVCAP_RETURN_IF(!grown, KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory");
        sl->segs = grown;
        sl->cap_segs = cap;
    }
    struct kvcap_segment seg;
    memset(&seg, 0, sizeof seg);
    seg.kind = span->kind;
    seg.n_tokens = span->n_tokens;
    seg.rows = span->kind == KVCAP_SPAN_VISION ? span->rows : 0;
    seg.cols = span->kind == KVCAP_SPAN_VISION ? span->cols : 0;
    seg.p0 = span->p0;
    seg.bucket = -1;
    seg.policy = c->cfg.policy[span->kind];
    int fallback = 0;
    if (seg.policy == KVCAP_POLICY_KVCAPSULE) {
        seg.bucket = kvcap_artifact_find_bucket(c->artifact, seg.rows, seg.cols);
        if (seg.bucket < 0) {
            KVCAP_RETURN_IF(c->cfg.fallback == KVCAP_FALLBACK_NONE, KVCAP_ERR_NOT_FOUND,
                            "seq %d: vision span %dx%d has no bucket in the artifact and the "
                            "runtime config has fallback: none",
                            seq, seg.rows, seg.cols);
            seg.policy = c->cfg.fallback;
            fallback = 1;
        }
    }
    if (c->recorder && span->kind == KVCAP_SPAN_VISION)
        KVCAP_TRY(kvcap_recorder_span(c->recorder, seq, layer, sl->n_segs, span, k, v));
    enum kvcap_status st = policy_impl(seg.policy)->prefill(c, seq, layer, &seg, k, v);
    if (st != KVCAP_OK) {
        kvcap_segment_release(&seg);
        return st;
    }
    sl->segs[sl->n_segs++] = seg;
    if (c->dev)
        kvcap_device_layer_changed(c, layer);
    if (layer == 0) {
        c->tokens_by_kind[span->kind] += span->n_tokens;
        c->spans_fallback += fallback;
    }
    return KVCAP_OK;
}

enum kvcap_status kvcap_cache_add_post_queries(struct kvcap_cache *c, int seq, int layer,
                                               const float *q, int n)
{
    KVCAP_TRY(check_seq_layer(c, seq, layer));
    KVCAP_RETURN_IF(!q || n < 1 || n > (1 << 20), KVCAP_ERR_INVALID_ARGUMENT,
                    "post queries: q NULL or n %d outside 1..2^20", n);
    struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, layer);
    KVCAP_RETURN_IF(sl->gen.seen > 0,
                    KVCAP_ERR_STATE, "seq %d layer %d: post-vision queries come before decoding",
                    seq, layer);
    if (c->dev)
        return KVCAP_OK; /* device memory; no policy of a device cache reads them */
    for (size_t i = 0; i < (size_t)n * c->g.n_q_heads * c->g.head_dim; i++)
        KVCAP_RETURN_IF(!isfinite(q[i]), KVCAP_ERR_NUMERIC,
                        "post queries: q: non-finite value %g at head %d, query %d, channel %d",
                        (double)q[i], (int)(i / ((size_t)n * c->g.head_dim)),
                        (int)(i / (size_t)c->g.head_dim % (size_t)n),
                        (int)(i % (size_t)c->g.head_dim));
    /* Kept token-major ([n][q_heads][d]) so later calls extend the same block. */
    size_t qd = (size_t)c->g.n_q_heads * c->g.head_dim;
    float *grown = realloc(sl->post_q, sizeof(float) * qd * (size_t)(sl->n_post + n));
    KVCAP_RETURN_IF(!grown, KVCAP_ERR_OUT_OF_MEMORY, "post queries: out of memory");
    sl->post_q = grown;
    for (int i = 0; i < n; i++)
        for (int hq = 0; hq < c->g.n_q_heads; hq++)
            memcpy(grown + (size_t)(sl->n_post + i) * qd + (size_t)hq * c->g.head_dim,
                   q + ((size_t)hq * n + (size_t)i) * c->g.head_dim,
                   sizeof(float) * (size_t)c->g.head_dim);
    if (c->recorder) {
        enum kvcap_status st = kvcap_recorder_post_queries(c->recorder, seq, layer, q, n);
        if (st != KVCAP_OK)
            return st; /* the copy above stays: the next call would extend it */
    }
    sl->n_post += n;
    return KVCAP_OK;
}

/* ---- End of prefill ----------------------------------------------------------------------- */

static int seq_pending(const struct kvcap_cache *c, int seq)
{
    for (int l = 0; l < c->g.n_layers; l++) {
        const struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, l);
        for (int i = 0; i < sl->n_segs; i++)
            if (sl->segs[i].pending)
                return 1;
    }
    return 0;
}

/* Every layer of `seq` must hold the spans layer 0 holds (add_span keeps the others from
 * getting ahead of it). Checked for every policy: a layer without a span would attend as if the
 * image were not there, and record mode could not write the span. */
static enum kvcap_status check_prefill_complete(const struct kvcap_cache *c, int seq)
{
    const int n_spans = kvcap_cache_seq_layer(c, seq, 0)->n_segs;
    for (int l = 1; l < c->g.n_layers; l++) {
        const int got = kvcap_cache_seq_layer(c, seq, l)->n_segs;
        KVCAP_RETURN_IF(got != n_spans, KVCAP_ERR_STATE,
                        "seq %d: prefill is incomplete: layer %d has %d spans, layer 0 has %d "
                        "(span %d never reached layer %d)",
                        seq, l, got, n_spans, got, l);
    }
    return KVCAP_OK;
}

enum kvcap_status kvcap_cache_end_prefill(struct kvcap_cache *c, int seq)
{
    KVCAP_TRY(check_seq_layer(c, seq, 0));
    KVCAP_TRY(check_prefill_complete(c, seq));
    if (!seq_pending(c, seq)) {
        if (c->recorder)
            kvcap_recorder_end_prefill(c->recorder, seq);
        return KVCAP_OK;
    }
    int n_spans = kvcap_cache_seq_layer(c, seq, 0)->n_segs;
    for (int i = 0; i < n_spans; i++) {
        int pending = 0;
        for (int l = 0; l < c->g.n_layers; l++)
            pending |= kvcap_cache_seq_layer(c, seq, l)->segs[i].pending;
        const struct kvcap_policy_impl *impl =
            policy_impl(kvcap_cache_seq_layer(c, seq, 0)->segs[i].policy);
        if (pending && impl->finish)
            KVCAP_TRY(impl->finish(c, seq, i));
    }
    for (int l = 0; l < c->g.n_layers; l++) { /* consumed */
        struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, l);
        free(sl->post_q);
        sl->post_q = NULL;
        sl->n_post = 0;
    }
    if (c->recorder)
        kvcap_recorder_end_prefill(c->recorder, seq);
    return KVCAP_OK;
}

/* ---- Decode ------------------------------------------------------------------------------- */

/* Row of the next generated token; *grow_to > 0 when the rows must first grow to that many:
 * params.reserve_tokens (64 when 0; streaming needs no more than its ring) the first time, then
 * twice as many. Streaming keeps the first `sinks` generated tokens, then a ring of the last
 * `window`. Host and device caches grow alike. */
static int gen_row(const struct kvcap_cache *c, const struct kvcap_segment *gen, int *grow_to)
{
    int row = gen->n_rows;
    int sinks = c->cfg.streaming.sinks, window = c->cfg.streaming.window;
    int streaming = gen->policy == KVCAP_POLICY_STREAMING;
    if (streaming && gen->seen >= sinks + window)
        row = sinks + (int)((gen->seen - sinks) % window);
    int first = c->reserve_tokens > 0 ? c->reserve_tokens : 64;
    if (c->reserve_tokens > 0 && streaming && first > sinks + window)
        first = sinks + window;
    *grow_to = row >= gen->cap ? (gen->cap ? 2 * gen->cap : first) : 0;
    return row;
}

enum kvcap_status kvcap_cache_append(struct kvcap_cache *c, int seq, int layer,
                                     const struct kvcap_tensor_view *k,
                                     const struct kvcap_tensor_view *v)
{
    KVCAP_TRY(check_seq_layer(c, seq, layer));
    KVCAP_TRY(kvcap_view_check(k, "k", c->g.n_kv_heads, 1, c->g.head_dim));
    KVCAP_TRY(kvcap_view_check(v, "v", c->g.n_kv_heads, 1, c->g.head_dim));
    KVCAP_TRY(kvcap_cache_end_prefill(c, seq));
    struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, layer);
    struct kvcap_segment *gen = &sl->gen;
    if (c->dev) {
        int grow_to, row = gen_row(c, gen, &grow_to);
        KVCAP_TRY(kvcap_device_append(c, seq, layer, k, v, grow_to));
        if (row == gen->n_rows)
            gen->n_rows++;
        gen->seen++;
        if (layer == 0)
            c->tokens_by_kind[KVCAP_SPAN_GENERATED]++;
        return KVCAP_OK;
    }
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
        int grow_to, row = gen_row(c, gen, &grow_to);
        if (grow_to > 0)
            st = kvcap_segment_reserve(c, gen, grow_to);
        for (int h = 0; st == KVCAP_OK && h < H; h++)
            kvcap_segment_store(c, gen, h, row, 1, buf + (size_t)h * d, vb + (size_t)h * d);
        if (st == KVCAP_OK && row == gen->n_rows)
            gen->n_rows++;
    }
    free(buf);
    KVCAP_TRY(st);
    gen->seen++;
    if (layer == 0)
        c->tokens_by_kind[KVCAP_SPAN_GENERATED]++;
    return KVCAP_OK;
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
            if (seg->policy == KVCAP_POLICY_KVCAPSULE || seg->n_rows == 0)
                continue;
            part_range(seg->n_rows, k, P, ATTEND_MIN_TOKENS, &lo, &hi);
            if (hi == lo)
                continue;
            size_t at = ((size_t)h * seg->cap + lo) * d * es;
            struct kvcap_rows rows = {(const char *)seg->k + at, (const char *)seg->v + at,
                                      c->storage, (size_t)d, hi - lo};
            uint64_t got;
            KVCAP_TRY(kvcap_attend_rows(&rows, qs, G, d, scale, acc, &got));
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

enum kvcap_status kvcap_cache_attend_lse(struct kvcap_cache *c, int layer, const float *q,
                                         float *out, float *lse)
{
    KVCAP_TRY(check_seq_layer(c, 0, layer));
    KVCAP_RETURN_IF(!q || !out, KVCAP_ERR_INVALID_ARGUMENT, "attend: q and out are required");
    for (int s = 0; s < c->n_seqs; s++)
        KVCAP_TRY(kvcap_cache_end_prefill(c, s));
    if (c->dev)
        return kvcap_device_attend(c, layer, q, out, lse);
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

enum kvcap_status kvcap_cache_attend(struct kvcap_cache *c, int layer, const float *q, float *out)
{
    return kvcap_cache_attend_lse(c, layer, q, out, NULL);
}

enum kvcap_status kvcap_cache_set_stream(struct kvcap_cache *c, void *stream)
{
    KVCAP_RETURN_IF(!c, KVCAP_ERR_INVALID_ARGUMENT, "set_stream: NULL cache");
    KVCAP_RETURN_IF(!c->dev, KVCAP_ERR_STATE,
                    "set_stream: the cache keeps host memory (params.memory is "
                    "KVCAP_MEMORY_HOST)");
    kvcap_device_set_stream(c, stream);
    return KVCAP_OK;
}

enum kvcap_status kvcap_cache_sync(struct kvcap_cache *c)
{
    KVCAP_RETURN_IF(!c, KVCAP_ERR_INVALID_ARGUMENT, "sync: NULL cache");
    return c->dev ? kvcap_device_sync(c) : KVCAP_OK;
}

enum kvcap_status kvcap_cache_stats(const struct kvcap_cache *c, struct kvcap_cache_stats *st)
{
    KVCAP_RETURN_IF(!c || !st, KVCAP_ERR_INVALID_ARGUMENT, "stats: NULL argument");
    memset(st, 0, sizeof *st);
    uint64_t es = kvcap_dtype_size(c->storage);
    uint64_t row_pair = 2 * (uint64_t)c->g.n_kv_heads * (uint64_t)c->g.head_dim * es;
    for (size_t i = 0; i < (size_t)c->n_seqs * c->g.n_layers; i++) {
        const struct kvcap_seq_layer *sl = &c->layers[i];
        if (sl->freekv) {
            /* the store's bytes, shared out over span kinds by their tokens */
            uint64_t b = kvcap_freekv_bytes_held(sl->freekv);
            int64_t n = kvcap_freekv_tokens(sl->freekv);
            st->bytes_held += b;
            st->bytes_by_policy[KVCAP_POLICY_FREEKV] += b;
            for (int k = 0; k < 3 && n > 0; k++)
                st->bytes_by_kind[k] +=
                    (uint64_t)((double)b * (double)sl->freekv_tokens_by_kind[k] / (double)n);
            st->bytes_full_equivalent += row_pair * (uint64_t)n;
            struct kvcap_freekv_stats fs;
            kvcap_freekv_stats(sl->freekv, &fs);
            st->freekv_corrections += fs.corrections;
            st->freekv_pages_recalled += fs.pages_recalled;
            st->freekv_bytes_recalled += fs.bytes_recalled;
            st->freekv_head_steps += fs.steps * c->g.n_kv_heads;
            st->freekv_reselections += fs.resyncs;
            st->freekv_hidden += fs.hidden;
            st->freekv_waited += fs.waited;
        }
        for (int s = 0; s <= sl->n_segs; s++) {
            const struct kvcap_segment *seg = s < sl->n_segs ? &sl->segs[s] : &sl->gen;
            uint64_t b = kvcap_segment_bytes(c, seg);
            st->bytes_held += b;
            st->bytes_by_policy[seg->policy] += b;
            st->bytes_by_kind[seg->kind] += b;
            if (seg->policy != KVCAP_POLICY_FREEKV)
                st->bytes_full_equivalent +=
                    row_pair * (uint64_t)(s < sl->n_segs ? seg->n_tokens : seg->seen);
        }
    }
    memcpy(st->tokens_by_kind, c->tokens_by_kind, sizeof st->tokens_by_kind);
    st->bytes_read_last_attend = c->last_read;
    st->map_bytes_read_last_attend = c->last_map_read;
    st->spans_fallback = c->spans_fallback;
    st->compress_seconds = c->compress_seconds;
    return KVCAP_OK;
}

enum kvcap_status kvcap_cache_record_flush(struct kvcap_cache *c)
{
    KVCAP_RETURN_IF(!c, KVCAP_ERR_INVALID_ARGUMENT, "record flush: NULL cache");
    KVCAP_RETURN_IF(!c->recorder, KVCAP_ERR_STATE, "record flush: the cache is not in record mode");
    return kvcap_recorder_flush(c->recorder);
}
