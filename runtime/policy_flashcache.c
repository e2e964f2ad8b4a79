/* policy_flashcache.c — FlashCache (DESIGN §5) on a span. At prefill each layer keeps its rows
 * and scores the compressible tokens (all but the first `sinks` and the last `window`) by
 * their deviation from the DCT low-pass Base KV (fitted over the smallest window of a fast
 * DCT length around them, kvcap_flashcache_window), recording the layer's energy ratio; once
 * every layer is in (kvcap_cache_end_prefill) the layer budgets are allocated under the global
 * retention and each KV head keeps its own top tokens, the rest freed. It never computes an
 * attention score. Retention counts every token of the span, protected ones included, so
 * bytes held ≈ retention × full. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/cache_internal.h"
#include "kernels/flashcache.h"

/* The compressible tokens [lo, hi) of an n-token span. */
static void compressible(const struct kvcap_flashcache_config *f, int n, int *lo, int *hi)
{
    kvcap_protected_range(n, f->sinks, f->window, lo, hi);
}

struct score_job {
    const struct kvcap_cache *c;
    const struct kvcap_tensor_view *k, *v;
    const struct kvcap_dct *plan;
    int a, n, omega;             /* transform window [a, a + n) */
    int lo, n_score;             /* compressible tokens [lo, lo + n_score) */
    float *score;                /* [heads][n_score] */
    struct kvcap_energy *energy; /* [heads] */
    float **buf;                 /* [threads]: k, v rows and the deviation's scratch */
};

static void score_head(void *ctx, int h, int thread)
{
    struct score_job *j = ctx;
    int d = j->c->g.head_dim;
    float *kf = j->buf[thread], *vf = kf + (size_t)j->n * d, *dev = vf + (size_t)j->n * d;
    float *scratch = dev + j->n;
    kvcap_view_read(j->k, h, j->a, j->n, d, kf);
    kvcap_view_read(j->v, h, j->a, j->n, d, vf);
    memset(&j->energy[h], 0, sizeof j->energy[h]);
    kvcap_flashcache_deviation(j->plan, kf, vf, d, j->omega, dev, &j->energy[h], scratch);
    memcpy(j->score + (size_t)h * j->n_score, dev + (j->lo - j->a),
           sizeof(float) * (size_t)j->n_score);
}

static enum kvcap_status flashcache_prefill(struct kvcap_cache *c, int seq, int layer,
                                            struct kvcap_segment *seg,
                                            const struct kvcap_tensor_view *k,
                                            const struct kvcap_tensor_view *v)
{
    KVCAP_TRY(kvcap_segment_fill(c, seg, k, v, NULL, seg->n_tokens));
    int lo, hi, H = c->g.n_kv_heads, d = c->g.head_dim;
    compressible(&c->cfg.flashcache, seg->n_tokens, &lo, &hi);
    if (hi <= lo)
        return KVCAP_OK; /* everything is protected: nothing to compress */
    double t0 = kvcap_seconds();
    struct score_job job = {c, k, v, NULL, 0, 0, 0, lo, hi - lo, NULL, NULL, NULL};
    int a, b;
    kvcap_flashcache_window(seg->n_tokens, lo, hi, &a, &b);
    job.a = a;
    job.n = b - a;
    job.omega = kvcap_flashcache_omega(c->cfg.flashcache.gamma, job.n);
    struct kvcap_dct *plan = NULL;
    enum kvcap_status st = kvcap_dct_create(job.n, &plan);
    job.plan = plan;
    if (st == KVCAP_OK) {
        job.score = malloc(sizeof(float) * (size_t)H * job.n_score);
        job.energy = malloc(sizeof *job.energy * (size_t)H);
        job.buf = calloc((size_t)c->threads, sizeof *job.buf);
        size_t per = (2 * (size_t)d + 1) * job.n + kvcap_flashcache_scratch_floats(plan, d);
        int ok = job.score && job.energy && job.buf;
        for (int t = 0; ok && t < c->threads; t++)
            ok = (job.buf[t] = malloc(sizeof(float) * per)) != NULL;
        if (!ok)
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY,
                            "flashcache: out of memory scoring a %d-token span at layer %d",
                            seg->n_tokens, layer);
    }
    if (st == KVCAP_OK) {
        kvcap_cache_parallel(c, H, score_head, &job);
        struct kvcap_energy e = {0, 0, 0, 0};
        for (int h = 0; h < H; h++) {
            e.k_total += job.energy[h].k_total, e.k_low += job.energy[h].k_low;
            e.v_total += job.energy[h].v_total, e.v_low += job.energy[h].v_low;
        }
        seg->score = job.score;
        job.score = NULL;
        seg->weight = kvcap_flashcache_layer_weight(&e);
        seg->pending = 1;
    }
    for (int t = 0; job.buf && t < c->threads; t++)
        free(job.buf[t]);
    free(job.buf), free(job.energy), free(job.score);
    kvcap_dct_free(plan);
    c->compress_seconds += kvcap_seconds() - t0;
    return st;
}

static enum kvcap_status flashcache_finish(struct kvcap_cache *c, int seq, int span)
{
    int L = c->g.n_layers;
    const struct kvcap_segment *s0 = &kvcap_cache_seq_layer(c, seq, 0)->segs[span];
    int n = s0->n_tokens, lo, hi;
    compressible(&c->cfg.flashcache, n, &lo, &hi);
    double t0 = kvcap_seconds();
    double *w = malloc(sizeof(double) * (size_t)L);
    int *cap = malloc(sizeof(int) * (size_t)L), *budget = malloc(sizeof(int) * (size_t)L);
    struct kvcap_kept_rows *kept = calloc((size_t)L, sizeof *kept);
    enum kvcap_status st = KVCAP_OK;
    if (!w || !cap || !budget || !kept)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "flashcache: out of memory");
    for (int l = 0; st == KVCAP_OK && l < L; l++) {
        const struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, seq, l)->segs[span];
        w[l] = seg->pending ? seg->weight : 0.0;
        cap[l] = seg->pending ? hi - lo : 0;
    }
    if (st == KVCAP_OK) {
        /* Every layer keeps its protected tokens; the rest of the global retention is shared
         * by the compressible ones in proportion to the layers' energy ratios. */
        int64_t total = llround(c->cfg.flashcache.retention * (double)n * L) -
                        (int64_t)L * (n - (hi - lo));
        st = kvcap_budget_allocate(w, cap, L, c->cfg.flashcache.min_tokens,
                                   total > 0 ? total : 0, budget);
    }
    /* each KV head keeps sinks, its own top budget[l] tokens and the window: every layer's
     * rows are built first, then all committed, so a failure changes no layer */
    for (int l = 0; st == KVCAP_OK && l < L; l++) {
        const struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, seq, l)->segs[span];
        if (seg->pending)
            st = kvcap_segment_keep_top(c, seg, seg->score, (size_t)(hi - lo), lo, hi,
                                        budget[l], &kept[l]);
    }
    st = kvcap_span_commit(c, seq, span, kept, st);
    free(w), free(cap), free(budget), free(kept);
    c->compress_seconds += kvcap_seconds() - t0;
    return st;
}

const struct kvcap_policy_impl kvcap_policy_flashcache_impl = {
    KVCAP_POLICY_FLASHCACHE, flashcache_prefill, flashcache_finish};
