/* llama.c — the Llama-family reference engine of llama.h. Straightforward fp32 code: every
 * product of activations and weights is one sgemm over all tokens (prefill) or all rows of the
 * batch (decode), so the weights are read once per step whatever the batch size. */
#include "engine/llama.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "common/internal.h"
#include "kernels/rope.h"

struct llama_layer {
    float *attn_norm, *wq, *wk, *wv, *wo; /* w*: [out][in] row-major */
    float *ffn_norm, *w_gate, *w_up, *w_down;
};

struct kvllama_model {
    struct kvllama_hparams hp;
    struct kvcap_model_geometry geometry;
    float *tok_embd;   /* [n_vocab][n_embd] */
    float *out_norm;   /* [n_embd] */
    float *output;     /* [n_vocab][n_embd]; == tok_embd when tied */
    struct llama_layer *layers;
    uint64_t weight_bytes;
};

/* ---- Loading ------------------------------------------------------------------------------ */
static enum kvcap_status get_int(const struct kvgguf_file *f, const char *key, int lo, int hi,
                                 int *out)
{
    int64_t v;
    KVCAP_TRY(kvgguf_get_i64(f, key, &v));
    if (v < lo || v > hi)
        return kvcap_fail(KVCAP_ERR_FORMAT, "%s: %s = %lld is outside [%d, %d]", kvgguf_path(f),
                          key, (long long)v, lo, hi);
    *out = (int)v;
    return KVCAP_OK;
}

/* Dequantises tensor `name`, checking its shape is [ne0, ne1] (ggml order: ne0 contiguous). */
static enum kvcap_status load_tensor(struct kvllama_model *m, const struct kvgguf_file *f,
                                     const char *name, int64_t ne0, int64_t ne1, float **out)
{
    const struct kvgguf_tensor *t = kvgguf_tensor_find(f, name);
    if (!t)
        return kvcap_fail(KVCAP_ERR_NOT_FOUND, "%s: tensor '%s' is missing", kvgguf_path(f),
                          name);
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != 1 || t->ne[3] != 1)
        return kvcap_fail(KVCAP_ERR_FORMAT,
                          "%s: tensor '%s' has shape [%lld, %lld, %lld, %lld], expected "
                          "[%lld, %lld]", kvgguf_path(f), name, (long long)t->ne[0],
                          (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
                          (long long)ne0, (long long)ne1);
    float *w = malloc((size_t)t->n_elements * sizeof *w);
    if (!w)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: no memory for tensor '%s'",
                          kvgguf_path(f), name);
    enum kvcap_status s = kvgguf_dequantize(t, w);
    if (s != KVCAP_OK) {
        free(w);
        return s;
    }
    m->weight_bytes += t->n_elements * sizeof *w;
    *out = w;
    return KVCAP_OK;
}

/* Undoes the GGUF converter's row permutation of a Q or K projection: within each head, file
 * row 2i + s holds Hugging Face row s * d/2 + i. */
static enum kvcap_status unpermute_rows(float *w, int heads, int d, int in)
{
    float *tmp = malloc((size_t)d * in * sizeof *tmp);
    if (!tmp)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "llama: no memory to reorder a projection");
    for (int h = 0; h < heads; h++) {
        float *head = w + (size_t)h * d * in;
        memcpy(tmp, head, (size_t)d * in * sizeof *tmp);
        for (int i = 0; i < d / 2; i++)
            for (int s = 0; s < 2; s++)
                memcpy(head + (size_t)(s * d / 2 + i) * in, tmp + (size_t)(2 * i + s) * in,
                       (size_t)in * sizeof *tmp);
    }
    free(tmp);
    return KVCAP_OK;
}

static enum kvcap_status load_hparams(struct kvllama_model *m, const struct kvgguf_file *f)
{
    const char *path = kvgguf_path(f);
    struct kvgguf_str arch;
    KVCAP_TRY(kvgguf_get_str(f, "general.architecture", &arch));
    if (arch.n != 5 || memcmp(arch.s, "llama", 5) != 0)
        return kvcap_fail(KVCAP_ERR_UNSUPPORTED,
                          "%s: general.architecture is '%.*s'; only 'llama' is supported", path,
                          (int)(arch.n > 64 ? 64 : arch.n), arch.s);
    struct kvllama_hparams *hp = &m->hp;
    KVCAP_TRY(get_int(f, "llama.block_count", 1, 1024, &hp->n_layers));
    KVCAP_TRY(get_int(f, "llama.embedding_length", 1, 1 << 16, &hp->n_embd));
    KVCAP_TRY(get_int(f, "llama.feed_forward_length", 1, 1 << 18, &hp->n_ff));
    KVCAP_TRY(get_int(f, "llama.attention.head_count", 1, 1024, &hp->n_heads));
    hp->n_kv_heads = hp->n_heads;
    if (kvgguf_has(f, "llama.attention.head_count_kv"))
        KVCAP_TRY(get_int(f, "llama.attention.head_count_kv", 1, hp->n_heads, &hp->n_kv_heads));
    hp->n_ctx = 4096;
    if (kvgguf_has(f, "llama.context_length"))
        KVCAP_TRY(get_int(f, "llama.context_length", 1, 1 << 24, &hp->n_ctx));
    hp->rope_theta = 10000.0f;
    if (kvgguf_has(f, "llama.rope.freq_base"))
        KVCAP_TRY(kvgguf_get_f32(f, "llama.rope.freq_base", &hp->rope_theta));
    hp->rms_eps = 1e-5f;
    if (kvgguf_has(f, "llama.attention.layer_norm_rms_epsilon"))
        KVCAP_TRY(kvgguf_get_f32(f, "llama.attention.layer_norm_rms_epsilon", &hp->rms_eps));
    if (hp->n_embd % hp->n_heads != 0 || hp->n_heads % hp->n_kv_heads != 0)
        return kvcap_fail(KVCAP_ERR_FORMAT,
                          "%s: embedding_length %d, head_count %d, head_count_kv %d do not "
                          "divide", path, hp->n_embd, hp->n_heads, hp->n_kv_heads);
    hp->head_dim = hp->n_embd / hp->n_heads;
    if (kvgguf_has(f, "llama.rope.dimension_count")) {
        int rope_dim = 0;
        KVCAP_TRY(get_int(f, "llama.rope.dimension_count", 2, 1 << 16, &rope_dim));
        if (rope_dim != hp->head_dim)
            return kvcap_fail(KVCAP_ERR_UNSUPPORTED,
                              "%s: llama.rope.dimension_count %d != head dim %d (partial RoPE "
                              "is not supported)", path, rope_dim, hp->head_dim);
    }
    if (!(hp->rope_theta > 0.0f) || !(hp->rms_eps > 0.0f))
        return kvcap_fail(KVCAP_ERR_FORMAT, "%s: rope freq_base and rms epsilon must be > 0",
                          path);
    const struct kvgguf_tensor *emb = kvgguf_tensor_find(f, "token_embd.weight");
    if (!emb)
        return kvcap_fail(KVCAP_ERR_NOT_FOUND, "%s: tensor 'token_embd.weight' is missing",
                          path);
    if (emb->ne[1] < 1 || emb->ne[1] > (1 << 24))
        return kvcap_fail(KVCAP_ERR_FORMAT, "%s: token_embd.weight has %lld tokens", path,
                          (long long)emb->ne[1]);
    hp->n_vocab = (int)emb->ne[1];

    struct kvcap_model_geometry *g = &m->geometry;
    memset(g, 0, sizeof *g);
    struct kvgguf_str name = {"llama", 5};
    if (kvgguf_has(f, "general.name"))
        KVCAP_TRY(kvgguf_get_str(f, "general.name", &name));
    snprintf(g->name, sizeof g->name, "%.*s", (int)(name.n < 63 ? name.n : 63), name.s);
    g->n_layers = hp->n_layers;
    g->n_q_heads = hp->n_heads;
    g->n_kv_heads = hp->n_kv_heads;
    g->head_dim = hp->head_dim;
    g->rope_type = KVCAP_ROPE_ROPE;
    g->rope_pairing = KVCAP_ROPE_PAIRING_HALF;
    g->rope_dim = hp->head_dim;
    g->rope_theta = hp->rope_theta;
    if (kvcap_geometry_validate(g) != KVCAP_OK)
        return kvcap_fail(KVCAP_ERR_UNSUPPORTED, "%s: %s", path, kvcap_last_error());
    return KVCAP_OK;
}

static enum kvcap_status load_weights(struct kvllama_model *m, const struct kvgguf_file *f)
{
    const struct kvllama_hparams *hp = &m->hp;
    const int E = hp->n_embd, F = hp->n_ff, d = hp->head_dim;
    const int QD = hp->n_heads * d, KD = hp->n_kv_heads * d;
    KVCAP_TRY(load_tensor(m, f, "token_embd.weight", E, hp->n_vocab, &m->tok_embd));
    KVCAP_TRY(load_tensor(m, f, "output_norm.weight", E, 1, &m->out_norm));
    if (kvgguf_tensor_find(f, "output.weight"))
        KVCAP_TRY(load_tensor(m, f, "output.weight", E, hp->n_vocab, &m->output));
    else
        m->output = m->tok_embd;
    m->layers = calloc((size_t)hp->n_layers, sizeof *m->layers);
    if (!m->layers)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "llama: no memory for layers");
    for (int l = 0; l < hp->n_layers; l++) {
        struct llama_layer *ly = &m->layers[l];
        char name[96];
#define LOAD(field, suffix, ne0, ne1)                                    \
        snprintf(name, sizeof name, "blk.%d.%s", l, suffix);             \
        KVCAP_TRY(load_tensor(m, f, name, ne0, ne1, &ly->field))
        LOAD(attn_norm, "attn_norm.weight", E, 1);
        LOAD(wq, "attn_q.weight", E, QD);
        LOAD(wk, "attn_k.weight", E, KD);
        LOAD(wv, "attn_v.weight", E, KD);
        LOAD(wo, "attn_output.weight", QD, E);
        LOAD(ffn_norm, "ffn_norm.weight", E, 1);
        LOAD(w_gate, "ffn_gate.weight", E, F);
        LOAD(w_up, "ffn_up.weight", E, F);
        LOAD(w_down, "ffn_down.weight", F, E);
#undef LOAD
        KVCAP_TRY(unpermute_rows(ly->wq, hp->n_heads, d, E));
        KVCAP_TRY(unpermute_rows(ly->wk, hp->n_kv_heads, d, E));
    }
    return KVCAP_OK;
}

enum kvcap_status kvllama_load_gguf(const struct kvgguf_file *f, struct kvllama_model **out)
{
    KVCAP_RETURN_IF(!f || !out, KVCAP_ERR_INVALID_ARGUMENT, "kvllama_load_gguf: NULL argument");
    *out = NULL;
    struct kvllama_model *m = calloc(1, sizeof *m);
    if (!m)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "llama: no memory");
    enum kvcap_status s = load_hparams(m, f);
    if (s == KVCAP_OK)
        s = load_weights(m, f);
    if (s != KVCAP_OK) {
        kvllama_free(m);
        return s;
    }
    *out = m;
    return KVCAP_OK;
}

enum kvcap_status kvllama_load(const char *path, struct kvllama_model **out)
{
    KVCAP_RETURN_IF(!path || !out, KVCAP_ERR_INVALID_ARGUMENT, "kvllama_load: NULL argument");
    *out = NULL;
    struct kvgguf_file *f = NULL;
    KVCAP_TRY(kvgguf_open(path, &f));
    enum kvcap_status s = kvllama_load_gguf(f, out);
    kvgguf_close(f);
    return s;
}

void kvllama_free(struct kvllama_model *m)
{
    if (!m)
        return;
    if (m->layers) {
        for (int l = 0; l < m->hp.n_layers; l++) {
            struct llama_layer *ly = &m->layers[l];
            free(ly->attn_norm); free(ly->wq); free(ly->wk); free(ly->wv); free(ly->wo);
            free(ly->ffn_norm); free(ly->w_gate); free(ly->w_up); free(ly->w_down);
        }
        free(m->layers);
    }
    if (m->output != m->tok_embd)
        free(m->output);
    free(m->tok_embd);
    free(m->out_norm);
    free(m);
}

const struct kvllama_hparams *kvllama_hparams(const struct kvllama_model *m) { return &m->hp; }

void kvllama_geometry(const struct kvllama_model *m, struct kvcap_model_geometry *g)
{
    *g = m->geometry;
}

uint64_t kvllama_weight_bytes(const struct kvllama_model *m) { return m->weight_bytes; }

/* ---- Shared blocks ------------------------------------------------------------------------ */
static void rms_norm(const float *x, const float *w, float *y, int rows, int n, float eps)
{
#pragma omp parallel for schedule(static) if (rows >= 32)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        float *yr = y + (size_t)r * n;
        double ss = 0.0;
        for (int i = 0; i < n; i++)
            ss += (double)xr[i] * xr[i];
        float scale = (float)(1.0 / sqrt(ss / n + eps));
        for (int i = 0; i < n; i++)
            yr[i] = xr[i] * scale * w[i];
    }
}

/* y[rows][out] (+)= x[rows][in] · W[out][in]^T */
static void linear(const float *x, const float *w, float *y, int rows, int in, int out,
                   int accumulate)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out, in, 1.0f, x, in, w, in,
                accumulate ? 1.0f : 0.0f, y, out);
}

static void swiglu(float *gate, const float *up, size_t n)
{
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

/* The feed-forward half of a layer, in place on x[rows][E]. */
static void ffn_block(const struct kvllama_model *m, const struct llama_layer *ly, float *x,
                      float *h, float *gate, float *up, int rows)
{
    const int E = m->hp.n_embd, F = m->hp.n_ff;
    rms_norm(x, ly->ffn_norm, h, rows, E, m->hp.rms_eps);
    linear(h, ly->w_gate, gate, rows, E, F, 0);
    linear(h, ly->w_up, up, rows, E, F, 0);
    swiglu(gate, up, (size_t)rows * F);
    linear(gate, ly->w_down, x, rows, F, E, 1);
}

static void embed(const struct kvllama_model *m, const int32_t *ids, int rows, float *x)
{
    const int E = m->hp.n_embd;
    for (int r = 0; r < rows; r++)
        memcpy(x + (size_t)r * E, m->tok_embd + (size_t)ids[r] * E, (size_t)E * sizeof *x);
}

static void output_logits(const struct kvllama_model *m, const float *x, float *h, int rows,
                          float *logits)
{
    rms_norm(x, m->out_norm, h, rows, m->hp.n_embd, m->hp.rms_eps);
    linear(h, m->output, logits, rows, m->hp.n_embd, m->hp.n_vocab, 0);
}

static enum kvcap_status check_ids(const struct kvllama_model *m, const int32_t *ids, int n)
{
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->hp.n_vocab)
            return kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                              "llama: token %d has id %d, outside the vocabulary [0, %d)", i,
                              (int)ids[i], m->hp.n_vocab);
    return KVCAP_OK;
}

/* ---- Prefill ------------------------------------------------------------------------------ */
/* Causal attention of n new tokens after n_past earlier ones, all heads: att[n][H*d] from
 * q[n][H*d] and k,v[n_past + n][KV*d] (the earlier tokens' rows first); new token i attends
 * rows 0 .. n_past + i. scores holds n x (n_past + n). */
static void causal_attention(const struct kvllama_hparams *hp, const float *q, const float *k,
                             const float *v, float *scores, float *att, int n, int n_past)
{
    const int d = hp->head_dim, H = hp->n_heads, KV = hp->n_kv_heads, G = H / KV;
    const int T = n_past + n;
    const float scale = 1.0f / sqrtf((float)d);
    for (int hq = 0; hq < H; hq++) {
        const int hk = hq / G;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, T, d, scale, q + hq * d, H * d,
                    k + hk * d, KV * d, 0.0f, scores, T);
#pragma omp parallel for schedule(static) if (n >= 64)
        for (int i = 0; i < n; i++) {
            float *row = scores + (size_t)i * T;
            const int last = n_past + i;
            float mx = row[0];
            for (int j = 1; j <= last; j++)
                mx = row[j] > mx ? row[j] : mx;
            double sum = 0.0;
            for (int j = 0; j <= last; j++) {
                row[j] = expf(row[j] - mx);
                sum += row[j];
            }
            float inv = (float)(1.0 / sum);
            for (int j = 0; j <= last; j++)
                row[j] *= inv;
            for (int j = last + 1; j < T; j++)
                row[j] = 0.0f;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, T, 1.0f, scores, T,
                    v + hk * d, KV * d, 0.0f, att + hq * d, H * d);
    }
}

enum kvcap_status kvllama_prefill(const struct kvllama_model *m, const int32_t *ids, int n,
                                  struct kvllama_prefill_out *out)
{
    return kvllama_prefill_embd(m, ids, n, NULL, out);
}

enum kvcap_status kvllama_reconstruct(const struct kvllama_model *m, const int32_t *ids, int P,
                                      const int32_t *prefix, int n_prefix,
                                      const struct kvllama_embd_span *spans, int n_spans,
                                      const struct kvllama_past *past, float *q, float *lse)
{
    KVCAP_RETURN_IF(!m || !ids || !q || !lse || P < 1 || n_prefix < 0 || (n_prefix && !prefix) ||
                        n_spans < 0 || (n_spans && !spans),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "kvllama_reconstruct: NULL argument, P < 1, n_prefix < 0 or n_spans < 0");
    KVCAP_RETURN_IF(!past || past->n != P, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvllama_reconstruct: the past holds %d tokens, the prompt %d",
                    past ? past->n : 0, P);
    const struct kvllama_hparams *hp = &m->hp;
    const int R = n_prefix + P; /* the pass, prefilled after the prompt's K/V */
    const size_t L = (size_t)hp->n_layers, H = (size_t)hp->n_heads, d = (size_t)hp->head_dim;
    const size_t kd = (size_t)hp->n_kv_heads * d;
    int32_t *all = malloc(sizeof *all * (size_t)R);
    float *k = malloc(sizeof *k * L * (size_t)R * kd);
    float *scores = malloc(sizeof *scores * (size_t)R * R);
    struct kvllama_embd_span *again = malloc(sizeof *again * (size_t)(n_spans ? n_spans : 1));
    enum kvcap_status s = KVCAP_OK;
    if (!all || !k || !scores || !again)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "llama: no memory for the reconstruction pass");
    if (s == KVCAP_OK) {
        memcpy(all, prefix, sizeof *all * (size_t)n_prefix);
        memcpy(all + n_prefix, ids, sizeof *all * (size_t)P);
        for (int i = 0; i < n_spans; i++) { /* the prompt's spans, in its second copy */
            again[i] = spans[i];
            again[i].at += n_prefix;
        }
        struct kvllama_prefill_out out = {k, NULL, q, R, NULL, 0};
        s = kvllama_prefill_after(m, past, all, R, again, n_spans, &out);
    }
    /* Each pass query's log-sum-exp over the pass's keys up to itself (positions P .. P+i). */
    const int G = (int)(H / (size_t)hp->n_kv_heads);
    const float scale = 1.0f / sqrtf((float)d);
    for (size_t lh = 0; s == KVCAP_OK && lh < L * H; lh++) {
        const size_t l = lh / H, kvh = lh % H / (size_t)G;
        const float *keys = k + l * (size_t)R * kd + kvh * d;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, R, (int)d, scale,
                    q + lh * (size_t)R * d, (int)d, keys, (int)kd, 0.0f, scores, R);
#pragma omp parallel for schedule(static) if (R >= 64)
        for (int i = 0; i < R; i++) {
            const float *row = scores + (size_t)i * R;
            float mx = -INFINITY;
            for (int j = 0; j <= i; j++)
                mx = row[j] > mx ? row[j] : mx;
            double z = 0;
            for (int j = 0; j <= i; j++)
                z += exp((double)(row[j] - mx));
            lse[lh * (size_t)R + (size_t)i] = mx + (float)log(z);
        }
    }
    free(all), free(k), free(scores), free(again);
    return s;
}

const float *kvllama_token_embeddings(const struct kvllama_model *m)
{
    return m ? m->tok_embd : NULL;
}

enum kvcap_status kvllama_prefill_embd(const struct kvllama_model *m, const int32_t *ids, int n,
                                       const struct kvllama_embd_span *span,
                                       struct kvllama_prefill_out *out)
{
    return kvllama_prefill_spans(m, ids, n, span, span ? 1 : 0, out);
}

enum kvcap_status kvllama_prefill_spans(const struct kvllama_model *m, const int32_t *ids, int n,
                                        const struct kvllama_embd_span *spans, int n_spans,
                                        struct kvllama_prefill_out *out)
{
    return kvllama_prefill_after(m, NULL, ids, n, spans, n_spans, out);
}

enum kvcap_status kvllama_prefill_after(const struct kvllama_model *m,
                                        const struct kvllama_past *past, const int32_t *ids,
                                        int n, const struct kvllama_embd_span *spans,
                                        int n_spans, struct kvllama_prefill_out *out)
{
    KVCAP_RETURN_IF(!m || !ids || !out || n < 1 || n_spans < 0 || (n_spans > 0 && !spans),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "kvllama_prefill: NULL argument, n < 1 or n_spans < 0");
    KVCAP_RETURN_IF(past && (!past->k || !past->v || past->n < 1 ||
                             past->layer_stride < past->n),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "kvllama_prefill_after: the past K/V is NULL, empty or its layer stride is "
                    "below its %d tokens", past ? past->n : 0);
    const int n_past = past ? past->n : 0;
    for (int i = 0; i < n_spans; i++) {
        const struct kvllama_embd_span *sp = &spans[i];
        const int from = i ? spans[i - 1].at + spans[i - 1].n : 0;
        KVCAP_RETURN_IF(!sp->embd || sp->at < from || sp->n < 1 || sp->at > n - sp->n,
                        KVCAP_ERR_INVALID_ARGUMENT,
                        "kvllama_prefill: embedding span %d [%d, %d) not inside the %d tokens "
                        "after the previous span", i, sp->at, sp->at + sp->n, n);
    }
    const struct kvllama_hparams *hp = &m->hp;
    KVCAP_RETURN_IF(n_past + n > hp->n_ctx, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvllama_prefill: %d tokens exceed the context length %d", n_past + n,
                    hp->n_ctx);
    KVCAP_RETURN_IF(out->q_tail && (out->n_q_tail < 1 || out->n_q_tail > n),
                    KVCAP_ERR_INVALID_ARGUMENT, "kvllama_prefill: n_q_tail %d not in [1, %d]",
                    out->n_q_tail, n);
    KVCAP_RETURN_IF(out->logits && (out->n_logits < 1 || out->n_logits > n),
                    KVCAP_ERR_INVALID_ARGUMENT, "kvllama_prefill: n_logits %d not in [1, %d]",
                    out->n_logits, n);
    for (int i = 0, from = 0; i <= n_spans; i++) { /* the token ids between the spans */
        const int to = i < n_spans ? spans[i].at : n;
        KVCAP_TRY(check_ids(m, ids + from, to - from));
        from = i < n_spans ? spans[i].at + spans[i].n : n;
    }
    const int E = hp->n_embd, F = hp->n_ff, d = hp->head_dim, H = hp->n_heads;
    const int KV = hp->n_kv_heads, QD = H * d, KD = KV * d;
    const size_t N = (size_t)n, T = (size_t)n_past + N;
    float *x = malloc(N * E * sizeof *x), *h = malloc(N * E * sizeof *h);
    float *q = malloc(N * QD * sizeof *q), *att = malloc(N * QD * sizeof *att);
    /* every token's K/V, the past's rows first; the new ones' at k, v */
    float *kc = malloc(T * KD * sizeof *kc), *vc = malloc(T * KD * sizeof *vc);
    float *k = kc ? kc + (size_t)n_past * KD : NULL, *v = vc ? vc + (size_t)n_past * KD : NULL;
    float *gate = malloc(N * F * sizeof *gate), *up = malloc(N * F * sizeof *up);
    float *scores = malloc(N * T * sizeof *scores);
    enum kvcap_status s = KVCAP_OK;
    if (!x || !h || !q || !att || !kc || !vc || !gate || !up || !scores) {
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "llama: no memory to prefill %d tokens", n);
        goto done;
    }
    for (int i = 0, from = 0; i <= n_spans; i++) { /* tokens, a span's embeddings, ... */
        const int to = i < n_spans ? spans[i].at : n;
        embed(m, ids + from, to - from, x + (size_t)from * E);
        if (i == n_spans)
            break;
        const struct kvllama_embd_span *sp = &spans[i];
        memcpy(x + (size_t)sp->at * E, sp->embd, (size_t)sp->n * E * sizeof *x);
        for (size_t e = (size_t)sp->at * E; e < (size_t)(sp->at + sp->n) * E; e++)
            if (!isfinite(x[e])) {
                s = kvcap_fail(KVCAP_ERR_NUMERIC,
                               "kvllama_prefill: embedding span %d: non-finite value at token "
                               "%d, channel %d", i, (int)(e / E) - sp->at, (int)(e % E));
                goto done;
            }
        from = sp->at + sp->n;
    }
    for (int l = 0; l < hp->n_layers; l++) {
        const struct llama_layer *ly = &m->layers[l];
        if (past) {
            const size_t at = (size_t)l * past->layer_stride * KD;
            memcpy(kc, past->k + at, (size_t)n_past * KD * sizeof *kc);
            memcpy(vc, past->v + at, (size_t)n_past * KD * sizeof *vc);
        }
        rms_norm(x, ly->attn_norm, h, n, E, hp->rms_eps);
        linear(h, ly->wq, q, n, E, QD, 0);
        linear(h, ly->wk, k, n, E, KD, 0);
        linear(h, ly->wv, v, n, E, KD, 0);
#pragma omp parallel for schedule(static)
        for (int t = 0; t < n; t++) {
            kvcap_rope_rotate(&m->geometry, q + (size_t)t * QD, (size_t)H, (size_t)d, n_past + t);
            kvcap_rope_rotate(&m->geometry, k + (size_t)t * KD, (size_t)KV, (size_t)d, n_past + t);
        }
        if (out->k)
            memcpy(out->k + (size_t)l * N * KD, k, N * KD * sizeof *k);
        if (out->v)
            memcpy(out->v + (size_t)l * N * KD, v, N * KD * sizeof *v);
        if (out->q_tail) {
            const int nq = out->n_q_tail;
            float *dst = out->q_tail + (size_t)l * H * nq * d;
            for (int hq = 0; hq < H; hq++)
                for (int t = 0; t < nq; t++)
                    memcpy(dst + ((size_t)hq * nq + t) * d,
                           q + (size_t)(n - nq + t) * QD + (size_t)hq * d, d * sizeof *q);
        }
        causal_attention(hp, q, kc, vc, scores, att, n, n_past);
        linear(att, ly->wo, x, n, QD, E, 1);
        ffn_block(m, ly, x, h, gate, up, n);
    }
    if (out->logits) {
        const int nl = out->n_logits;
        output_logits(m, x + (size_t)(n - nl) * E, h, nl, out->logits);
    }
done:
    free(x); free(h); free(q); free(att); free(kc); free(vc); free(gate); free(up); free(scores);
    return s;
}

/* ---- Decode -------------------------------------------------------------------------------- */
struct kvllama_decoder {
    const struct kvllama_model *m;
    int max_rows;
    float *x, *h, *q, *k, *v, *att, *gate, *up;
};

enum kvcap_status kvllama_decoder_create(const struct kvllama_model *m, int max_rows,
                                         struct kvllama_decoder **out)
{
    KVCAP_RETURN_IF(!m || !out || max_rows < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvllama_decoder_create: NULL argument or max_rows < 1");
    const struct kvllama_hparams *hp = &m->hp;
    const size_t R = (size_t)max_rows, QD = (size_t)hp->n_heads * hp->head_dim;
    const size_t KD = (size_t)hp->n_kv_heads * hp->head_dim;
    struct kvllama_decoder *d = calloc(1, sizeof *d);
    if (d) {
        d->m = m;
        d->max_rows = max_rows;
        d->x = malloc(R * hp->n_embd * sizeof(float));
        d->h = malloc(R * hp->n_embd * sizeof(float));
        d->q = malloc(R * QD * sizeof(float));
        d->att = malloc(R * QD * sizeof(float));
        d->k = malloc(R * KD * sizeof(float));
        d->v = malloc(R * KD * sizeof(float));
        d->gate = malloc(R * hp->n_ff * sizeof(float));
        d->up = malloc(R * hp->n_ff * sizeof(float));
    }
    if (!d || !d->x || !d->h || !d->q || !d->att || !d->k || !d->v || !d->gate || !d->up) {
        kvllama_decoder_free(d);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "llama: no memory for %d decode rows",
                          max_rows);
    }
    *out = d;
    return KVCAP_OK;
}

void kvllama_decoder_free(struct kvllama_decoder *d)
{
    if (!d)
        return;
    free(d->x); free(d->h); free(d->q); free(d->att); free(d->k); free(d->v);
    free(d->gate); free(d->up);
    free(d);
}

enum kvcap_status kvllama_decode(struct kvllama_decoder *dec, struct kvllama_group *groups,
                                 int n_groups, const int32_t *ids, const int *pos,
                                 float *logits)
{
    KVCAP_RETURN_IF(!dec || !groups || n_groups < 1 || !ids || !pos || !logits,
                    KVCAP_ERR_INVALID_ARGUMENT, "kvllama_decode: NULL argument");
    const struct kvllama_model *m = dec->m;
    const struct kvllama_hparams *hp = &m->hp;
    int rows = 0;
    for (int g = 0; g < n_groups; g++) {
        KVCAP_RETURN_IF(!groups[g].cache || groups[g].n_seqs < 1, KVCAP_ERR_INVALID_ARGUMENT,
                        "kvllama_decode: group %d has no cache or no sequences", g);
        rows += groups[g].n_seqs;
    }
    KVCAP_RETURN_IF(rows > dec->max_rows, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvllama_decode: %d rows exceed the decoder's %d", rows, dec->max_rows);
    KVCAP_TRY(check_ids(m, ids, rows));
    for (int r = 0; r < rows; r++)
        KVCAP_RETURN_IF(pos[r] < 0 || pos[r] >= hp->n_ctx, KVCAP_ERR_INVALID_ARGUMENT,
                        "kvllama_decode: row %d position %d outside [0, %d)", r, pos[r],
                        hp->n_ctx);
    const int E = hp->n_embd, d = hp->head_dim, H = hp->n_heads, KV = hp->n_kv_heads;
    const int QD = H * d, KD = KV * d;
    embed(m, ids, rows, dec->x);
    for (int l = 0; l < hp->n_layers; l++) {
        const struct llama_layer *ly = &m->layers[l];
        rms_norm(dec->x, ly->attn_norm, dec->h, rows, E, hp->rms_eps);
        linear(dec->h, ly->wq, dec->q, rows, E, QD, 0);
        linear(dec->h, ly->wk, dec->k, rows, E, KD, 0);
        linear(dec->h, ly->wv, dec->v, rows, E, KD, 0);
#pragma omp parallel for schedule(static) if (rows >= 8)
        for (int r = 0; r < rows; r++) {
            kvcap_rope_rotate(&m->geometry, dec->q + (size_t)r * QD, (size_t)H, (size_t)d, pos[r]);
            kvcap_rope_rotate(&m->geometry, dec->k + (size_t)r * KD, (size_t)KV, (size_t)d,
                              pos[r]);
        }
        int first = 0;
        for (int g = 0; g < n_groups; g++) {
            struct kvllama_group *grp = &groups[g];
            double t0 = kvcap_seconds();
            for (int s = 0; s < grp->n_seqs; s++) {
                const size_t r = (size_t)(first + s);
                struct kvcap_tensor_view kv = {.base = dec->k + r * KD, .dtype = KVCAP_DTYPE_F32,
                                               .head_stride = d, .token_stride = KD};
                struct kvcap_tensor_view vv = kv;
                vv.base = dec->v + r * KD;
                KVCAP_TRY(kvcap_cache_append(grp->cache, s, l, &kv, &vv));
            }
            KVCAP_TRY(kvcap_cache_attend(grp->cache, l, dec->q + (size_t)first * QD,
                                         dec->att + (size_t)first * QD));
            grp->attend_seconds += kvcap_seconds() - t0;
            if (grp->measure_bytes) {
                struct kvcap_cache_stats st;
                KVCAP_TRY(kvcap_cache_stats(grp->cache, &st));
                grp->bytes_read += st.bytes_read_last_attend;
            }
            first += grp->n_seqs;
        }
        linear(dec->att, ly->wo, dec->x, rows, QD, E, 1);
        ffn_block(m, ly, dec->x, dec->h, dec->gate, dec->up, rows);
    }
    output_logits(m, dec->x, dec->h, rows, logits);
    return KVCAP_OK;
}

int32_t kvllama_argmax(const float *logits, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best])
            best = i;
    return best;
}

double kvllama_log_sum_exp(const float *logits, int n)
{
    float mx = logits[0];
    for (int i = 1; i < n; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0.0;
    for (int i = 0; i < n; i++)
        sum += exp((double)logits[i] - mx);
    return mx + log(sum);
}

double kvllama_log_prob(const float *logits, int n, int32_t id)
{
    return (double)logits[id] - kvllama_log_sum_exp(logits, n);
}

const char *kvllama_default_model(char *buf, size_t cap)
{
    const char *env = getenv("KVCAP_MODEL"), *home = getenv("HOME");
    if (env && *env)
        return env;
    snprintf(buf, cap, "%s/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf",
             home ? home : ".");
    return buf;
}
