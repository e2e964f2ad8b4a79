/* policy_kvzip.c — KVzip (arXiv 2505.23416) on a span. Prefill keeps the rows; the
 * engine runs the context-reconstruction pass ("repeat the previous context", then the prompt
 * again) after the prompt and hands its queries to the cache through
 * kvcap_cache_add_post_queries. At the end of prefill, per layer and KV head, each of the
 * span's tokens is scored by the largest attention a reconstruction query of the group pays
 * it (softmax over the prompt held in rows, kernels/kvzip.h); then one budget, retention × the
 * span's tokens × layers × KV heads, goes to the largest scores of all layers and heads
 * together, so layers and heads keep different numbers of rows (the rows of a head are packed,
 * cache_state.h). The first `sinks` and last `window` tokens of every head are always kept
 * and counted in the budget, so bytes held = retention × full for the span. With
 * `safeguard` > 0 (kvcap's variant, Ada-KV's safeguard, arXiv 2407.11550) every head first
 * keeps its largest scores up to that share of an even split, then the rest is shared.
 * With `values: basis` (kvcap's variant) a span with a bucket in the artifact keeps, besides the
 * chosen keys, only KVCapsule's value state per layer and KV head (Ṽ and μ through the bucket's
 * value basis, fitted to the kept tokens' values alone, kernels/basis_rows.h): the budget is
 * then the span's bytes, retention × full's, of which the value state takes its fixed share and
 * the keys (each with its point in the basis) the rest. With `exact_values` E, the E kept
 * tokens of each layer and KV head whose values the state reconstructs worst keep their value
 * rows too (counted in the state) and leave the fit. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/cache_internal.h"
#include "common/dtype.h"
#include "common/internal.h"
#include "kernels/capsule_prefill.h"
#include "kernels/kvzip.h"
#include "kernels/select.h"

struct layer_job {
    const struct kvcap_cache *c;
    const struct kvcap_seq_layer *sl;
    int span, lo, hi; /* the span's segment and its compressible tokens [lo, hi) */
    float *out;       /* [heads][hi - lo] */
    float **scratch;  /* [threads]: the kernel's scratch */
    struct kvcap_parallel_error err;
};

#define MAX_PROMPT_SEGMENTS 256

static void layer_head(void *ctx, int h, int thread)
{
    struct layer_job *j = ctx;
    const struct kvcap_model_geometry *g = &j->c->g;
    const struct kvcap_seq_layer *sl = j->sl;
    const int G = g->n_q_heads / g->n_kv_heads, d = g->head_dim;
    const size_t es = kvcap_dtype_size(j->c->storage);
    struct kvcap_rows chunks[MAX_PROMPT_SEGMENTS];
    int n_chunks = 0, m = 0, offset = 0;
    for (int i = 0; i <= sl->n_segs; i++) {
        const struct kvcap_segment *s = i < sl->n_segs ? &sl->segs[i] : &sl->gen;
        if (!kvcap_segment_is_prompt_rows(s) || n_chunks == MAX_PROMPT_SEGMENTS)
            continue; /* kvzip_finish refused more segments before any head ran */
        size_t at;
        int n;
        kvcap_segment_head_rows(s, h, &at, &n);
        if (i == j->span)
            offset = m;
        chunks[n_chunks++] = (struct kvcap_rows){(const char *)s->k + at * d * es, NULL,
                                                 j->c->storage, (size_t)d, n};
        m += n;
    }
    float *score = calloc((size_t)m, sizeof(float)); /* the whole prompt's, for this head */
    enum kvcap_status st =
        score ? KVCAP_OK : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvzip: out of memory");
    if (st == KVCAP_OK) {
        kvcap_quiet_push();
        st = kvcap_kvzip_head(sl->post_q + (size_t)h * G * d, (size_t)g->n_q_heads * d,
                              sl->post_lse ? sl->post_lse + (size_t)h * G : NULL,
                              (size_t)g->n_q_heads, sl->n_post, G, d, 1.0f / sqrtf((float)d),
                              chunks, n_chunks, score, j->scratch[thread]);
        kvcap_quiet_pop();
    }
    if (st == KVCAP_OK)
        memcpy(j->out + (size_t)h * (j->hi - j->lo), score + offset + j->lo,
               sizeof(float) * (size_t)(j->hi - j->lo));
    free(score);
    if (st != KVCAP_OK)
        kvcap_parallel_fail(&j->err, st);
}

/* The scores of span `span`'s compressible tokens at `layer`, every KV head, into out. */
static enum kvcap_status score_layer(struct kvcap_cache *c, int seq, int layer, int span,
                                     int lo, int hi, float *out)
{
    struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, layer);
    const int G = c->g.n_q_heads / c->g.n_kv_heads, d = c->g.head_dim;
    KVCAP_RETURN_IF(sl->n_post < 1, KVCAP_ERR_STATE,
                    "seq %d layer %d: kvzip needs the queries of the context-reconstruction "
                    "pass (kvcap_cache_add_post_queries) before the end of prefill",
                    seq, layer);
    int n_prompt = 0;
    for (int i = 0; i <= sl->n_segs; i++)
        n_prompt += kvcap_segment_is_prompt_rows(i < sl->n_segs ? &sl->segs[i] : &sl->gen);
    KVCAP_RETURN_IF(n_prompt > MAX_PROMPT_SEGMENTS, KVCAP_ERR_UNSUPPORTED,
                    "seq %d layer %d: kvzip attends at most %d prompt spans, the prompt has %d",
                    seq, layer, MAX_PROMPT_SEGMENTS, n_prompt);
    struct layer_job j;
    memset(&j, 0, sizeof j);
    j.c = c, j.sl = sl, j.span = span, j.lo = lo, j.hi = hi, j.out = out;
    size_t floats = kvcap_kvzip_scratch_floats(sl->n_post, G, d);
    j.scratch = calloc((size_t)c->threads, sizeof *j.scratch);
    int ok = j.scratch != NULL && floats != SIZE_MAX;
    for (int t = 0; ok && t < c->threads; t++)
        ok = (j.scratch[t] = malloc(sizeof(float) * floats)) != NULL;
    enum kvcap_status st = KVCAP_OK;
    if (!ok)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvzip: out of memory at layer %d", layer);
    if (st == KVCAP_OK) {
        kvcap_cache_parallel(c, c->g.n_kv_heads, layer_head, &j);
        if (kvcap_parallel_failed(&j.err))
            st = kvcap_parallel_status(&j.err);
    }
    for (int t = 0; j.scratch && t < c->threads; t++)
        free(j.scratch[t]);
    free(j.scratch);
    return st;
}

/* The value state of a kvzip span with values: basis at `layer`, beside the keys `kept` (built
 * from `mark` [heads][n], token order): per KV head μ and each tile's Ṽ_t fitted to the values
 * of the head's kept tokens alone (kvcap_capsule_fit_values: decode reads no other), and each
 * kept row's point t · m + p; with kvzip.exact_values = E, the E kept tokens whose values that
 * state reconstructs worst (squared error) keep their value rows instead, point −1 − x for
 * slot x of vx (unused slots, when a head keeps fewer rows, are zero), and the state is fitted
 * again without them, so that an outlier (an attention-sink patch) does not pull its tile's
 * other tokens. `kept` holds keys only. */
static enum kvcap_status value_state(const struct kvcap_cache *c, int layer,
                                     const struct kvcap_segment *seg, const unsigned char *mark,
                                     struct kvcap_kept_rows *kept)
{
    const struct kvcap_bucket *bk = &c->artifact->buckets[seg->bucket];
    const struct kvcap_unit_maps *u0 = kvcap_artifact_unit(c->artifact, layer, 0, seg->bucket);
    const int H = c->g.n_kv_heads, d = c->g.head_dim, n = seg->n_tokens, m = u0->m;
    const int tiles = n / m, rv = u0->rv, E = c->cfg.kvzip.exact_values;
    const size_t es = kvcap_dtype_size(c->storage), tr = (size_t)tiles * rv;
    const size_t rows = kept->head_at ? (size_t)kept->head_at[H] : (size_t)H * kept->cap;
    /* token -> its point t · m + p; then per head its kept tokens, their errors, the chosen */
    int32_t *inv = malloc(sizeof(int32_t) * (size_t)n);
    int *tok = malloc(sizeof(int) * 3 * (size_t)n);
    unsigned char *fit = malloc((size_t)n);
    float *vf = malloc(sizeof(float) * ((size_t)n * d + tr * d + d + (size_t)n));
    double *work = malloc(sizeof(double) * kvcap_capsule_fit_values_scratch_doubles(m, rv, d));
    kept->point = malloc(sizeof(int32_t) * (rows > 0 ? rows : 1));
    kept->vt = malloc((size_t)H * tr * d * es + 1);
    kept->mu = malloc((size_t)H * d * es);
    kept->vx = E > 0 ? calloc((size_t)H * E * d, es) : NULL;
    if (!inv || !tok || !fit || !vf || !work || !kept->point || !kept->vt || !kept->mu ||
        (E > 0 && !kept->vx)) {
        free(inv), free(tok), free(fit), free(vf), free(work); /* kept's own are freed with it */
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY,
                          "kvzip: out of memory for the value state of layer %d", layer);
    }
    kept->tiles = tiles, kept->rv = rv, kept->n_vx = E;
    float *vtf = vf + (size_t)n * d, *muf = vtf + tr * d, *err = muf + d;
    int *chosen = tok + n, *topk_work = chosen + n;
    for (int t = 0; t < tiles; t++)
        for (int p = 0; p < m; p++)
            inv[kvcap_bucket_token(bk, t, p)] = t * m + p;
    enum kvcap_status st = KVCAP_OK;
    for (int h = 0; st == KVCAP_OK && h < H; h++) {
        const struct kvcap_unit_maps *u = kvcap_artifact_unit(c->artifact, layer, h, seg->bucket);
        char *vt = (char *)kept->vt + (size_t)h * tr * d * es, *mu = (char *)kept->mu + h * d * es;
        kvcap_convert_to_f32(c->storage, (const char *)seg->v + (size_t)h * seg->cap * d * es,
                             (size_t)n * d, vf);
        int n_kept = 0;
        for (int j = 0; j < n; j++)
            if ((fit[j] = mark[(size_t)h * n + j]) != 0)
                tok[n_kept++] = j;
        st = kvcap_capsule_fit_values(bk, m, rv, u->u, n, d, vf, fit, c->storage, vt, mu, work);
        int n_exact = 0; /* the kept tokens the stored state reconstructs worst */
        if (st == KVCAP_OK && E > 0) {
            kvcap_convert_to_f32(c->storage, vt, tr * d, vtf);
            kvcap_convert_to_f32(c->storage, mu, (size_t)d, muf);
            for (int i = 0; i < n_kept; i++) {
                const int pt = inv[tok[i]], t = pt / m, p = pt % m;
                double e2 = 0;
                for (int ch = 0; ch < d; ch++) {
                    double x = muf[ch] - vf[(size_t)tok[i] * d + ch];
                    for (int a = 0; a < rv; a++)
                        x += (double)u->u[(size_t)a * m + p] * vtf[((size_t)t * rv + a) * d + ch];
                    e2 += x * x;
                }
                err[i] = (float)e2;
            }
            n_exact = kvcap_topk_indices(err, n_kept, E, chosen, topk_work);
            for (int x = 0; x < n_exact; x++)
                fit[tok[chosen[x]]] = 0;
            if (n_exact > 0)
                st = kvcap_capsule_fit_values(bk, m, rv, u->u, n, d, vf, fit, c->storage, vt,
                                              mu, work);
        }
        int64_t at = kept->head_at ? kept->head_at[h] : (int64_t)h * kept->cap;
        for (int i = 0, x = 0; i < n_kept; i++) {
            if (x < n_exact && chosen[x] == i) { /* ascending: a merge walk */
                memcpy((char *)kept->vx + ((size_t)h * E + x) * d * es,
                       (const char *)seg->v + ((size_t)h * seg->cap + tok[i]) * d * es, d * es);
                kept->point[at++] = -1 - x++;
            } else {
                kept->point[at++] = inv[tok[i]];
            }
        }
    }
    free(inv), free(tok), free(fit), free(vf), free(work);
    return st;
}

/* Bytes of the value state of a span with values: basis, every layer and KV head. */
static int64_t value_state_bytes(const struct kvcap_cache *c, const struct kvcap_segment *seg)
{
    int64_t total = 0;
    const int64_t vec = (int64_t)c->g.head_dim * (int64_t)kvcap_dtype_size(c->storage);
    for (int l = 0; l < c->g.n_layers; l++) {
        const struct kvcap_unit_maps *u = kvcap_artifact_unit(c->artifact, l, 0, seg->bucket);
        total += (int64_t)c->g.n_kv_heads *
                 ((int64_t)(seg->n_tokens / u->m) * u->rv + 1 + c->cfg.kvzip.exact_values) * vec;
    }
    return total;
}

static enum kvcap_status kvzip_finish(struct kvcap_cache *c, int seq, int span)
{
    const int L = c->g.n_layers, H = c->g.n_kv_heads;
    const struct kvcap_kvzip_config *cfg = &c->cfg.kvzip;
    const int n = kvcap_cache_seq_layer(c, seq, 0)->segs[span].n_tokens;
    int lo, hi;
    kvcap_protected_range(n, cfg->sinks, cfg->window, &lo, &hi);
    const int nc = hi - lo;
    double t0 = kvcap_seconds();
    const size_t units = (size_t)L * H;
    float *score = malloc(sizeof(float) * (units * nc > 0 ? units * nc : 1));
    int *keep = malloc(sizeof(int) * units);
    unsigned char *sel = malloc(units * nc > 0 ? units * nc : 1);
    unsigned char *mark = malloc((size_t)H * n > 0 ? (size_t)H * n : 1);
    struct kvcap_kept_rows *kept = calloc((size_t)L, sizeof *kept);
    enum kvcap_status st = KVCAP_OK;
    if (!score || !keep || !sel || !mark || !kept)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvzip: out of memory");
    for (int l = 0; st == KVCAP_OK && l < L && nc > 0; l++)
        st = score_layer(c, seq, l, span, lo, hi, score + (size_t)l * H * nc);
    const struct kvcap_segment *seg0 = &kvcap_cache_seq_layer(c, seq, 0)->segs[span];
    const int basis = seg0->bucket >= 0; /* values: basis, and the span has a bucket */
    if (st == KVCAP_OK) {
        /* every head keeps its protected tokens; the rest of the budget goes to the largest
         * scores of every layer and head together */
        const int64_t even = llround(cfg->retention * (double)n); /* a head's even share */
        int64_t keys = even * (int64_t)units;                     /* rows kept, all heads */
        if (basis) {
            /* the bytes of `even` rows per head, less the value state, buy keys (a key and its
             * point each) */
            const int64_t vec = (int64_t)c->g.head_dim * (int64_t)kvcap_dtype_size(c->storage);
            const int64_t bytes = 2 * keys * vec, values = value_state_bytes(c, seg0);
            keys = (bytes - values) / (vec + (int64_t)sizeof(int32_t));
            const int least = n - nc > 1 ? n - nc : 1; /* keys a head cannot go without */
            if (keys < (int64_t)units * least)
                st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                                "kvzip: retention %g of the %d-token span is %.3g MB; its value "
                                "state (values: basis, the artifact's value ranks) takes %.3g MB "
                                "and leaves fewer than %d keys per KV head",
                                cfg->retention, n, (double)bytes / 1e6, (double)values / 1e6,
                                least);
        }
        /* what the protected tokens leave (negative when they exceed it: the selection
         * clamps it to [0, units × nc], as it clamps the floor below) */
        const int64_t budget = keys - (int64_t)units * (n - nc);
        /* the safeguard: every head first keeps that share of its even share, protected
         * tokens included (in [-n, n]: the selection clamps it to [0, nc]) */
        const int head_floor =
            (int)(llround(cfg->safeguard * ((double)keys / (double)units)) - (n - nc));
        if (st != KVCAP_OK) {
            /* refused above */
        } else if ((int64_t)units * nc > INT_MAX)
            st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "kvzip: %zu x %d scores are too many",
                            units, nc);
        else if (kvcap_kvzip_select(score, (int)units, nc, budget, head_floor, keep, sel) < 0)
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvzip: out of memory selecting among "
                            "%zu x %d scores", units, nc);
    }
    for (int l = 0; st == KVCAP_OK && l < L; l++) {
        const struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, seq, l)->segs[span];
        for (int h = 0; h < H; h++) {
            unsigned char *mh = mark + (size_t)h * n;
            memset(mh, 1, (size_t)n);
            memcpy(mh + lo, sel + ((size_t)l * H + h) * nc, (size_t)nc);
        }
        st = kvcap_segment_keep_marked(c, seg, mark, basis, &kept[l]);
        if (st == KVCAP_OK && basis)
            st = value_state(c, l, seg, mark, &kept[l]);
    }
    st = kvcap_span_commit(c, seq, span, kept, st);
    free(score), free(keep), free(sel), free(mark), free(kept);
    c->compress_seconds += kvcap_seconds() - t0;
    return st;
}

const struct kvcap_policy_impl kvcap_policy_kvzip_impl = {
    KVCAP_POLICY_KVZIP, kvcap_segment_fill_pending, kvzip_finish};
