/* policy_expected.c — Expected Attention (arXiv 2510.00636, as kvpress's ExpectedAttentionPress)
 * on a span: no extra pass. Prefill keeps the rows; the engine hands the queries of every
 * prompt token (kvcap_cache_add_post_queries: the last n tokens of the prompt, n its length).
 * At the end of prefill, per layer and KV head, the group's queries are turned back to their
 * pre-RoPE form (each by its own position), the first `query_sinks` tokens' left out, and their
 * mean and covariance rotated by the average rotation of the next `n_future` positions; each of
 * the span's tokens is scored by the expected attention of that Gaussian query, softmaxed over
 * the span, averaged over the group and times its value's norm (kernels/expected.h). Each head
 * keeps sinks, window and its top tokens: retention × the span's tokens in all. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attention.h"
#include "kernels/load.h"
#include "kernels/expected.h"
#include "kernels/rope.h"
#include "runtime/cache_internal.h"

/* Scores of span `span`'s compressible tokens [lo, hi) at `layer`, [heads][hi - lo]. */
static enum kvcap_status score_layer(struct kvcap_cache *c, int seq, int layer, int span, int lo,
                                     int hi, float *out)
{
    const struct kvcap_model_geometry *g = &c->g;
    const struct kvcap_expected_config *cfg = &c->cfg.expected;
    struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, layer);
    const struct kvcap_segment *seg = &sl->segs[span];
    const int H = g->n_kv_heads, Hq = g->n_q_heads, G = Hq / H, d = g->head_dim, m = hi - lo;
    KVCAP_RETURN_IF(sl->n_post < 1, KVCAP_ERR_STATE,
                    "seq %d layer %d: expected_attention needs the prompt's queries "
                    "(kvcap_cache_add_post_queries) before the end of prefill",
                    seq, layer);
    int64_t P = 0; /* the prompt: every span added, in order */
    for (int i = 0; i < sl->n_segs; i++)
        P += sl->segs[i].n_tokens;
    KVCAP_RETURN_IF(sl->n_post > P, KVCAP_ERR_STATE,
                    "seq %d layer %d: %d prompt queries for a prompt of %lld tokens", seq, layer,
                    sl->n_post, (long long)P);
    /* the queries of tokens at positions >= query_sinks, back to their pre-RoPE form */
    const int64_t first = P - sl->n_post;
    const int skip = first >= cfg->query_sinks ? 0 : (int)(cfg->query_sinks - first);
    const int n = sl->n_post - skip < 1 ? sl->n_post : sl->n_post - skip;
    const int from = sl->n_post - n;
    const size_t qd = (size_t)Hq * d, es = kvcap_dtype_size(c->storage);
    double *cs = malloc(sizeof(double) * (size_t)d);
    float *qpre = malloc(sizeof(float) * (size_t)n * qd);
    float *kf = malloc(sizeof(float) * (size_t)(m > 0 ? m : 1) * d * 2), *vf = kf + (size_t)m * d;
    const size_t sf = kvcap_expected_scratch_floats(n, m > 0 ? m : 1, d);
    float *scratch = sf != SIZE_MAX ? malloc(sizeof(float) * sf) : NULL;
    enum kvcap_status st = KVCAP_OK;
    if (!cs || !qpre || !kf || !scratch)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "expected_attention: out of memory at layer %d",
                        layer);
    if (st == KVCAP_OK)
        st = kvcap_expected_rotation(g, P, cfg->n_future, cs);
    if (st == KVCAP_OK) {
        memcpy(qpre, sl->post_q + (size_t)from * qd, sizeof(float) * (size_t)n * qd);
        for (int i = 0; i < n; i++)
            kvcap_rope_rotate(g, qpre + (size_t)i * qd, (size_t)Hq, (size_t)d,
                              -(double)(first + from + i));
    }
    for (int h = 0; st == KVCAP_OK && h < H && m > 0; h++) {
        const char *kb = (const char *)seg->k + ((size_t)h * seg->cap + lo) * d * es;
        const char *vb = (const char *)seg->v + ((size_t)h * seg->cap + lo) * d * es;
        kvcap_load_f32(c->storage, kb, (size_t)m * d, kf);
        kvcap_load_f32(c->storage, vb, (size_t)m * d, vf);
        kvcap_quiet_push();
        st = kvcap_expected_head(g, qpre + (size_t)h * G * d, qd, n, G, cs, kf, vf, m,
                                 1.0f / sqrtf((float)d), out + (size_t)h * m, scratch);
        kvcap_quiet_pop();
    }
    free(cs), free(qpre), free(kf), free(scratch);
    return st;
}

static enum kvcap_status expected_finish(struct kvcap_cache *c, int seq, int span)
{
    const int L = c->g.n_layers, H = c->g.n_kv_heads;
    const struct kvcap_expected_config *cfg = &c->cfg.expected;
    const int n = kvcap_cache_seq_layer(c, seq, 0)->segs[span].n_tokens;
    int lo, hi;
    kvcap_protected_range(n, cfg->sinks, cfg->window, &lo, &hi);
    const int nc = hi - lo;
    const int budget = (int)llround(cfg->retention * n) - (n - nc);
    double t0 = kvcap_seconds();
    float *score = malloc(sizeof(float) * (size_t)H * (nc > 0 ? nc : 1));
    struct kvcap_kept_rows *kept = calloc((size_t)L, sizeof *kept);
    enum kvcap_status st = KVCAP_OK;
    if (!score || !kept)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "expected_attention: out of memory");
    for (int l = 0; st == KVCAP_OK && l < L; l++) {
        const struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, seq, l)->segs[span];
        st = score_layer(c, seq, l, span, lo, hi, score);
        if (st == KVCAP_OK)
            st = kvcap_segment_keep_top(c, seg, score, (size_t)nc, lo, hi, budget, &kept[l]);
    }
    st = kvcap_span_commit(c, seq, span, kept, st);
    free(score), free(kept);
    c->compress_seconds += kvcap_seconds() - t0;
    return st;
}

const struct kvcap_policy_impl kvcap_policy_expected_impl = {
    KVCAP_POLICY_EXPECTED_ATTENTION, kvcap_segment_fill_pending, expected_finish};
