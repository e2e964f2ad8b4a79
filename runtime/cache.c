/* cache.c — libkvcap's cache, the API front: argument checks, the policy chosen per span kind,
 * span routing, the end of prefill (cross-layer compression), stats and record mode. What
 * touches the stored K/V goes through the cache's store (store.h): host memory
 * (cache_host.c) or a CUDA device (cache_device.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/cache_internal.h"
#include "runtime/pool.h"

static const struct kvcap_policy_impl *policy_impl(enum kvcap_policy p)
{
    switch (p) {
    case KVCAP_POLICY_FULL: return &kvcap_policy_full_impl;
    case KVCAP_POLICY_STREAMING: return &kvcap_policy_streaming_impl;
    case KVCAP_POLICY_KVCAPSULE: return &kvcap_policy_kvcapsule_impl;
    case KVCAP_POLICY_FLASHCACHE: return &kvcap_policy_flashcache_impl;
    case KVCAP_POLICY_VLCACHE: return &kvcap_policy_vlcache_impl;
    case KVCAP_POLICY_FREEKV: return &kvcap_policy_freekv_impl;
    case KVCAP_POLICY_KVZIP: return &kvcap_policy_kvzip_impl;
    case KVCAP_POLICY_RANDOM: return &kvcap_policy_random_impl;
    case KVCAP_POLICY_EXPECTED_ATTENTION: return &kvcap_policy_expected_impl;
    default: return NULL;
    }
}

/* The store for params.memory; NULL for a store this build lacks. */
static const struct kvcap_store_i *store_for(enum kvcap_memory m)
{
    if (m == KVCAP_MEMORY_HOST)
        return &kvcap_store_host;
#ifdef KVCAP_WITH_CUDA
    return &kvcap_store_cuda;
#else
    return NULL;
#endif
}

void kvcap_cache_default_params(struct kvcap_cache_params *p)
{
    if (!p)
        return;
    memset(p, 0, sizeof *p);
    p->n_seqs = 1;
    p->storage = KVCAP_DTYPE_F16;
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
    KVCAP_RETURN_IF(p->config_path && p->config_yaml, KVCAP_ERR_INVALID_ARGUMENT,
                    "params.config_yaml: set together with params.config_path; give one");
    KVCAP_RETURN_IF(p->record_dir && !*p->record_dir, KVCAP_ERR_INVALID_ARGUMENT,
                    "params.record_dir: empty string (NULL means no record mode)");
    const struct kvcap_store_i *store = store_for(p->memory);
    KVCAP_RETURN_IF(!store, KVCAP_ERR_UNSUPPORTED,
                    "params.memory: KVCAP_MEMORY_CUDA needs a CUDA device and this build has no "
                    "CUDA support");
    KVCAP_RETURN_IF(!store->host_memory && p->record_dir, KVCAP_ERR_UNSUPPORTED,
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
    c->store = store;
    c->g = p->model;
    c->n_seqs = p->n_seqs;
    c->storage = p->storage;
    c->artifact = p->artifact;
    kvcap_artifact_hold(c->artifact); /* let go in kvcap_cache_free */
    c->reserve_tokens = p->reserve_tokens;
    const int configured = p->config_path || p->config_yaml;
    enum kvcap_status st =
        p->config_path   ? kvcap_runtime_config_load_file(p->config_path, &c->cfg)
        : p->config_yaml ? kvcap_runtime_config_load_string(p->config_yaml, "params.config_yaml",
                                                            &c->cfg)
                         : (kvcap_runtime_config_default(&c->cfg), KVCAP_OK);
    /* Defaults: vision spans go to kvcapsule when an artifact is given (flashcache else; a
     * store without flashcache, the device's, keeps them in full and falls back to full). */
    if (st == KVCAP_OK && !configured && p->artifact)
        c->cfg.policy[KVCAP_SPAN_VISION] = KVCAP_POLICY_KVCAPSULE;
    if (st == KVCAP_OK && !configured && !store->offers(KVCAP_POLICY_FLASHCACHE)) {
        if (!p->artifact)
            c->cfg.policy[KVCAP_SPAN_VISION] = KVCAP_POLICY_FULL;
        c->cfg.fallback = KVCAP_POLICY_FULL;
    }
    if (st == KVCAP_OK && c->cfg.policy[KVCAP_SPAN_VISION] == KVCAP_POLICY_KVCAPSULE &&
        !p->artifact)
        st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                        "params.artifact: the runtime config compresses vision spans with "
                        "kvcapsule, which needs an artifact");
    if (st == KVCAP_OK && c->cfg.kvzip.value_basis && !p->artifact)
        for (int k = 0; st == KVCAP_OK && k < 3; k++)
            if (c->cfg.policy[k] == KVCAP_POLICY_KVZIP)
                st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                                "params.artifact: the runtime config has kvzip.values: basis, "
                                "which keeps values in the artifact's value bases; there is none");
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
    if (st == KVCAP_OK && store->supports)
        st = store->supports(c, p);
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
    if (st == KVCAP_OK && store->create)
        st = store->create(c, p);
    if (st != KVCAP_OK) {
        kvcap_cache_free(c);
        return st;
    }
    *out = c;
    return KVCAP_OK;
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
            kvcap_segment_release(c, &sl->segs[s]);
        free(sl->segs);
        kvcap_segment_release(c, &sl->gen);
        free(sl->post_q), free(sl->post_lse);
        kvcap_freekv_free(sl->freekv);
    }
    kvcap_freekv_worker_free(c->freekv_worker);
    if (c->store->free)
        c->store->free(c);
    for (int t = 0; c->scratch && t < c->threads; t++) {
        struct kvcap_thread_scratch *s = &c->scratch[t];
        free(s->qrot), free(s->spans), free(s->work);
    }
    free(c->scratch);
    free(c->parts);
    free(c->layers);
    kvcap_runtime_config_free(&c->cfg);
    kvcap_artifact_let_go(c->artifact);
    free(c);
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

enum kvcap_status kvcap_cache_add_span(struct kvcap_cache *c, int seq, int layer,
                                       const struct kvcap_span_desc *span,
                                       const struct kvcap_tensor_view *k,
                                       const struct kvcap_tensor_view *v)
{
    KVCAP_TRY(check_seq_layer(c, seq, layer));
    KVCAP_TRY(check_span(c, seq, layer, span));
    KVCAP_TRY(kvcap_view_check(k, "k", c->g.n_kv_heads, span->n_tokens, c->g.head_dim));
    KVCAP_TRY(kvcap_view_check(v, "v", c->g.n_kv_heads, span->n_tokens, c->g.head_dim));
    if (c->store->host_memory) {
        KVCAP_TRY(kvcap_view_check_finite(k, "add_span: k", c->g.n_kv_heads, span->n_tokens,
                                          c->g.head_dim));
        KVCAP_TRY(kvcap_view_check_finite(v, "add_span: v", c->g.n_kv_heads, span->n_tokens,
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
    /* kvzip with values: basis keeps the values of a vision span that has a bucket in the
     * artifact's value basis; any other span keeps them as rows */
    if (seg.policy == KVCAP_POLICY_KVZIP && c->cfg.kvzip.value_basis &&
        span->kind == KVCAP_SPAN_VISION)
        seg.bucket = kvcap_artifact_find_bucket(c->artifact, seg.rows, seg.cols);
    if (c->recorder && span->kind == KVCAP_SPAN_VISION)
        KVCAP_TRY(kvcap_recorder_span(c->recorder, seq, layer, sl->n_segs, span, k, v));
    enum kvcap_status st = policy_impl(seg.policy)->prefill(c, seq, layer, &seg, k, v);
    if (st != KVCAP_OK) {
        kvcap_segment_release(c, &seg);
        return st;
    }
    sl->segs[sl->n_segs++] = seg;
    if (c->store->layer_changed)
        c->store->layer_changed(c, layer);
    if (layer == 0) {
        c->tokens_by_kind[span->kind] += span->n_tokens;
        c->spans_fallback += fallback;
    }
    return KVCAP_OK;
}

enum kvcap_status kvcap_cache_add_post_queries(struct kvcap_cache *c, int seq, int layer,
                                               const float *q, int n)
{
    return kvcap_cache_add_post_queries_lse(c, seq, layer, q, NULL, n);
}

/* Grows sl->post_lse to n_post + n rows ([n][q_heads]), -inf for the earlier queries that came
 * without one, then copies lse ([q_heads][n]) or -inf. */
static enum kvcap_status store_post_lse(struct kvcap_cache *c, struct kvcap_seq_layer *sl,
                                        const float *lse, int n)
{
    const int Hq = c->g.n_q_heads;
    if (!lse && !sl->post_lse)
        return KVCAP_OK;
    const int had = sl->post_lse ? sl->n_post : 0;
    float *grown = realloc(sl->post_lse, sizeof(float) * (size_t)Hq * (size_t)(sl->n_post + n));
    KVCAP_RETURN_IF(!grown, KVCAP_ERR_OUT_OF_MEMORY, "post queries: out of memory");
    sl->post_lse = grown;
    for (size_t i = (size_t)had * Hq; i < (size_t)sl->n_post * Hq; i++)
        grown[i] = -INFINITY;
    for (int i = 0; i < n; i++)
        for (int hq = 0; hq < Hq; hq++)
            grown[(size_t)(sl->n_post + i) * Hq + hq] = lse ? lse[(size_t)hq * n + i] : -INFINITY;
    return KVCAP_OK;
}

enum kvcap_status kvcap_cache_add_post_queries_lse(struct kvcap_cache *c, int seq, int layer,
                                                   const float *q, const float *lse, int n)
{
    KVCAP_TRY(check_seq_layer(c, seq, layer));
    KVCAP_RETURN_IF(!q || n < 1 || n > (1 << 20), KVCAP_ERR_INVALID_ARGUMENT,
                    "post queries: q NULL or n %d outside 1..2^20", n);
    struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, layer);
    KVCAP_RETURN_IF(sl->gen.seen > 0,
                    KVCAP_ERR_STATE, "seq %d layer %d: post-vision queries come before decoding",
                    seq, layer);
    if (!c->store->host_memory)
        return KVCAP_OK; /* not readable here, and no policy the store offers reads them */
    for (size_t i = 0; i < (size_t)n * c->g.n_q_heads * c->g.head_dim; i++)
        KVCAP_RETURN_IF(!isfinite(q[i]), KVCAP_ERR_NUMERIC,
                        "post queries: q: non-finite value %g at head %d, query %d, channel %d",
                        (double)q[i], (int)(i / ((size_t)n * c->g.head_dim)),
                        (int)(i / (size_t)c->g.head_dim % (size_t)n),
                        (int)(i % (size_t)c->g.head_dim));
    for (size_t i = 0; lse && i < (size_t)n * c->g.n_q_heads; i++)
        KVCAP_RETURN_IF(isnan(lse[i]) || lse[i] == INFINITY, KVCAP_ERR_NUMERIC,
                        "post queries: lse: %g at head %d, query %d (finite or -inf)",
                        (double)lse[i], (int)(i / (size_t)n), (int)(i % (size_t)n));
    KVCAP_TRY(store_post_lse(c, sl, lse, n));
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
        free(sl->post_q), free(sl->post_lse);
        sl->post_q = sl->post_lse = NULL;
        sl->n_post = 0;
    }
    if (c->recorder)
        kvcap_recorder_end_prefill(c->recorder, seq);
    return KVCAP_OK;
}

/* ---- Decode ------------------------------------------------------------------------------- */

enum kvcap_status kvcap_cache_append(struct kvcap_cache *c, int seq, int layer,
                                     const struct kvcap_tensor_view *k,
                                     const struct kvcap_tensor_view *v)
{
    KVCAP_TRY(check_seq_layer(c, seq, layer));
    KVCAP_TRY(kvcap_view_check(k, "k", c->g.n_kv_heads, 1, c->g.head_dim));
    KVCAP_TRY(kvcap_view_check(v, "v", c->g.n_kv_heads, 1, c->g.head_dim));
    KVCAP_TRY(kvcap_cache_end_prefill(c, seq));
    KVCAP_TRY(c->store->append(c, seq, layer, k, v));
    kvcap_cache_seq_layer(c, seq, layer)->gen.seen++;
    if (layer == 0)
        c->tokens_by_kind[KVCAP_SPAN_GENERATED]++;
    return KVCAP_OK;
}

enum kvcap_status kvcap_cache_attend_lse(struct kvcap_cache *c, int layer, const float *q,
                                         float *out, float *lse)
{
    KVCAP_TRY(check_seq_layer(c, 0, layer));
    KVCAP_RETURN_IF(!q || !out, KVCAP_ERR_INVALID_ARGUMENT, "attend: q and out are required");
    for (int s = 0; s < c->n_seqs; s++)
        KVCAP_TRY(kvcap_cache_end_prefill(c, s));
    return c->store->attend(c, layer, q, out, lse);
}

enum kvcap_status kvcap_cache_attend(struct kvcap_cache *c, int layer, const float *q, float *out)
{
    return kvcap_cache_attend_lse(c, layer, q, out, NULL);
}

enum kvcap_status kvcap_cache_set_stream(struct kvcap_cache *c, void *stream)
{
    KVCAP_RETURN_IF(!c, KVCAP_ERR_INVALID_ARGUMENT, "set_stream: NULL cache");
    return c->store->set_stream(c, stream);
}

enum kvcap_status kvcap_cache_sync(struct kvcap_cache *c)
{
    KVCAP_RETURN_IF(!c, KVCAP_ERR_INVALID_ARGUMENT, "sync: NULL cache");
    return c->store->sync(c);
}

int kvcap_cache_uses_policy(const struct kvcap_cache *c, enum kvcap_policy policy)
{
    if (!c)
        return 0;
    for (int k = 0; k < 3; k++)
        if (c->cfg.policy[k] == policy)
            return 1;
    /* the fallback serves vision spans that kvcapsule has no bucket for */
    return c->cfg.policy[KVCAP_SPAN_VISION] == KVCAP_POLICY_KVCAPSULE &&
           c->cfg.fallback == policy;
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
