/* policy_vlcache.c — VL-Cache (DESIGN §6) on a span. Prefill keeps the rows; at the end of
 * prefill, per layer, the post-vision queries (kvcap_cache_add_post_queries) attend causally
 * over the prompt held in rows (O(τ·m)), giving the layer's sparsity and per-KV-head token
 * scores (column sums over the query group); layer budgets follow Algorithm 1 and each KV head
 * keeps its top tokens plus the protected ones. As in the paper (its section 5), the protected
 * ones are a recent window of `recent_fraction` of the layer's budget at the end of the prompt
 * (only the part that falls inside the span costs span tokens) and the post-vision tokens;
 * sinks and a window at the end of the span are kvcap's extension (`vlcache+protect`), and so
 * are `layer_budgets: uniform`, every layer keeping the global budget α (the scores still
 * choose the tokens; `vlcache+uniform`). The post-vision tokens are the last τ tokens of the
 * prompt; the prompt is every span of the sequence held as rows when prefill ends, in order
 * (KVCapsule and FreeKV spans hold none).
 * The budget counts every kept token of the span, so bytes held ≈ β × full per layer. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/cache_internal.h"
#include "kernels/vlcache.h"

/* One layer of one sequence: keys as row chunks per head, scores of span `span`'s tokens. */
struct layer_job {
    const struct kvcap_cache *c;
    const struct kvcap_seq_layer *sl;
    int n_chunks, m, offset, n; /* offset, n: the span's tokens inside the prompt */
    struct kvcap_rows *chunks;  /* [heads][n_chunks] */
    float *score;               /* [heads][m] */
    int64_t *below, *entries;   /* [heads] */
    float **scratch;            /* [threads] */
    struct kvcap_parallel_error err;
};

static void layer_head(void *ctx, int h, int thread)
{
    struct layer_job *j = ctx;
    const struct kvcap_model_geometry *g = &j->c->g;
    int G = g->n_q_heads / g->n_kv_heads, d = g->head_dim;
    float *score = j->score + (size_t)h * j->m;
    memset(score, 0, sizeof(float) * (size_t)j->m);
    j->below[h] = j->entries[h] = 0;
    kvcap_quiet_push();
    enum kvcap_status st = kvcap_vlcache_head(
        j->sl->post_q + (size_t)h * G * d, (size_t)g->n_q_heads * d, j->sl->n_post, G, d,
        1.0f / sqrtf((float)d), j->chunks + (size_t)h * j->n_chunks, j->n_chunks,
        (float)j->c->cfg.vlcache.p, score, &j->below[h], &j->entries[h], j->scratch[thread]);
    kvcap_quiet_pop();
    if (st != KVCAP_OK)
        kvcap_parallel_fail(&j->err, st);
}

/* Scores of span `span` at `layer` into seg->score ([heads][n]); returns the layer sparsity
 * in *gamma, the number of the span's tokens that are post-vision in *post and the number of
 * prompt tokens after the span in *after. */
static enum kvcap_status score_layer(struct kvcap_cache *c, int seq, int layer, int span,
                                     double *gamma, int *post, int *after)
{
    const struct kvcap_model_geometry *g = &c->g;
    struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, layer);
    struct kvcap_segment *seg = &sl->segs[span];
    int H = g->n_kv_heads, d = g->head_dim, G = g->n_q_heads / H;
    KVCAP_RETURN_IF(sl->n_post < 1, KVCAP_ERR_STATE,
                    "seq %d layer %d: vlcache needs the post-vision queries "
                    "(kvcap_cache_add_post_queries) before the end of prefill",
                    seq, layer);
    struct layer_job j;
    memset(&j, 0, sizeof j);
    j.c = c;
    j.sl = sl;
    j.n = seg->n_tokens;
    for (int i = 0; i <= sl->n_segs; i++) {
        const struct kvcap_segment *s = i < sl->n_segs ? &sl->segs[i] : &sl->gen;
        KVCAP_RETURN_IF(kvcap_segment_is_prompt_rows(s) && s->head_at, KVCAP_ERR_UNSUPPORTED,
                        "seq %d layer %d: vlcache scores over the prompt's rows, and span %d "
                        "(%s) holds a different number per KV head; put vlcache spans before "
                        "it or use another policy for one of them",
                        seq, layer, i, kvcap_policy_name(s->policy));
        if (kvcap_segment_is_prompt_rows(s)) {
            if (i == span)
                j.offset = j.m;
            j.n_chunks++;
            j.m += s->n_rows;
        }
    }
    KVCAP_RETURN_IF(sl->n_post > j.m, KVCAP_ERR_STATE,
                    "seq %d layer %d: %d post-vision queries but the prompt holds %d tokens",
                    seq, layer, sl->n_post, j.m);
    size_t es = kvcap_dtype_size(c->storage);
    j.chunks = malloc(sizeof *j.chunks * (size_t)H * j.n_chunks);
    j.score = malloc(sizeof(float) * (size_t)H * j.m);
    j.below = malloc(sizeof(int64_t) * (size_t)H * 2);
    j.scratch = calloc((size_t)c->threads, sizeof *j.scratch);
    int ok = j.chunks && j.score && j.below && j.scratch;
    for (int t = 0; ok && t < c->threads; t++)
        ok = (j.scratch[t] = malloc(sizeof(float) *
                                    kvcap_vlcache_scratch_floats(sl->n_post, G, d))) != NULL;
    seg->score = ok ? malloc(sizeof(float) * (size_t)H * seg->n_tokens) : NULL;
    enum kvcap_status st = KVCAP_OK;
    if (!ok || !seg->score)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "vlcache: out of memory at layer %d", layer);
    if (st == KVCAP_OK) {
        j.entries = j.below + H;
        for (int h = 0; h < H; h++) {
            int ci = 0;
            for (int i = 0; i <= sl->n_segs; i++) {
                const struct kvcap_segment *s = i < sl->n_segs ? &sl->segs[i] : &sl->gen;
                if (!kvcap_segment_is_prompt_rows(s))
                    continue;
                struct kvcap_rows r = {(const char *)s->k + (size_t)h * s->cap * d * es, NULL,
                                       c->storage, (size_t)d, s->n_rows};
                j.chunks[(size_t)h * j.n_chunks + ci++] = r;
            }
        }
        kvcap_cache_parallel(c, H, layer_head, &j);
        if (kvcap_parallel_failed(&j.err))
            st = kvcap_parallel_status(&j.err);
    }
    if (st == KVCAP_OK) {
        int64_t below = 0, entries = 0;
        for (int h = 0; h < H; h++) {
            below += j.below[h], entries += j.entries[h];
            memcpy(seg->score + (size_t)h * seg->n_tokens, j.score + (size_t)h * j.m + j.offset,
                   sizeof(float) * (size_t)seg->n_tokens);
        }
        *gamma = entries ? (double)below / (double)entries : 0.0;
        int first_post = j.m - sl->n_post - j.offset; /* span-local index of the first one */
        *post = seg->n_tokens - (first_post > 0 ? first_post : 0);
        if (*post < 0)
            *post = 0;
        *after = j.m - j.offset - seg->n_tokens;
    }
    for (int t = 0; j.scratch && t < c->threads; t++)
        free(j.scratch[t]);
    free(j.scratch), free(j.chunks), free(j.score), free(j.below);
    return st;
}

static enum kvcap_status vlcache_finish(struct kvcap_cache *c, int seq, int span)
{
    int L = c->g.n_layers;
    int n = kvcap_cache_seq_layer(c, seq, 0)->segs[span].n_tokens;
    double t0 = kvcap_seconds();
    double *gamma = malloc(sizeof(double) * (size_t)L * 2);
    int *post = malloc(sizeof(int) * (size_t)L * 2), *after = post ? post + L : NULL;
    struct kvcap_kept_rows *kept = calloc((size_t)L, sizeof *kept);
    enum kvcap_status st = KVCAP_OK;
    if (!gamma || !post || !kept)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "vlcache: out of memory");
    for (int l = 0; st == KVCAP_OK && l < L; l++)
        st = score_layer(c, seq, l, span, &gamma[l], &post[l], &after[l]);
    if (st == KVCAP_OK) {
        double *beta = gamma + L;
        const struct kvcap_vlcache_config *vc = &c->cfg.vlcache;
        if (vc->uniform_layers) /* kvcap's variant: alpha in every layer */
            for (int l = 0; l < L; l++)
                beta[l] = vc->budget < vc->min_fraction ? vc->min_fraction : vc->budget;
        else
            st = kvcap_vlcache_budgets(gamma, L, vc->budget, vc->min_fraction, beta);
        for (int l = 0; st == KVCAP_OK && l < L; l++) {
            const struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, seq, l)->segs[span];
            /* protected: sinks, then at the end of the span its window, the post-vision tokens
             * and the part of the prompt's recent window that reaches into the span */
            const int keep = (int)llround(beta[l] * n);
            const int recent = (int)ceil(vc->recent_fraction * keep - 1e-9) - after[l];
            int sinks = vc->sinks < n ? vc->sinks : n;
            int tail = vc->window > post[l] ? vc->window : post[l];
            tail = recent > tail ? recent : tail;
            tail = tail < n - sinks ? tail : n - sinks;
            int budget = keep - sinks - tail;
            st = kvcap_segment_keep_top(c, seg, seg->score + sinks, (size_t)n, sinks, n - tail,
                                        budget, &kept[l]);
        }
    }
    st = kvcap_span_commit(c, seq, span, kept, st);
    for (int l = 0; l < L; l++) { /* its scores are made here: freed whatever the outcome */
        struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, seq, l)->segs[span];
        free(seg->score);
        seg->score = NULL;
    }
    free(gamma), free(post), free(kept);
    c->compress_seconds += kvcap_seconds() - t0;
    return st;
}

const struct kvcap_policy_impl kvcap_policy_vlcache_impl = {
    KVCAP_POLICY_VLCACHE, kvcap_segment_fill_pending, vlcache_finish};
