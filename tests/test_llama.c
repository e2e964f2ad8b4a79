/* test_llama.c — the reference engine (engine/llama.c):
 *  - on a tiny random Llama written as a GGUF file here: prefill logits equal a naive scalar
 *    forward pass written from the GGUF conventions (raw, permuted Q/K rows rotated in adjacent
 *    pairs, as llama.cpp does), and decode steps through libkvcap caches (two caches of
 *    different batch sizes in one step) equal the same reference;
 *  - on SmolLM2-135M-Instruct when it is present: logits and greedy tokens equal llama.cpp's
 *    on the same file and on its F32 requantisation (tests/data/smollm2_reference.json, made by
 *    engine/reference/make_reference.py), decode steps going through a libkvcap cache. */
#define _GNU_SOURCE /* memmem */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cjson/cJSON.h>

#include "engine/gguf.h"
#include "engine/llama.h"
#include "common/rng.h"
#include "tests/test_numeric.h"
#include "tests/test_util.h"
#include "engine/tokenizer.h"

/* Tolerances. The engine runs in fp32 with fp32 accumulation (BLAS, libkvcap); the reference
 * accumulates in double. A wrong position, head or layout gives errors of order 1. */
#define TOL_TINY_REL 1e-4
/* Against llama.cpp on the F32 requantisation of the file (same weights, fp32 products; its
 * KV cache holds f16): measured max 0.0065 on the top 32 (0.025 over the whole vocabulary),
 * with logits of std 3-4. */
#define TOL_LLAMACPP_F32_ABS 0.05
/* Against llama.cpp on the Q4_1 file itself, whose products quantise activations to 8 bits
 * (Q8_1): logits differ by that noise (measured max 0.56 on the top 32, 1.6 over the whole
 * vocabulary; correlation 0.998), argmax and greedy tokens still agree. */
#define TOL_LLAMACPP_Q4_ABS 1.0

/* ---- A tiny GGUF writer ------------------------------------------------------------------- */
struct buf {
    unsigned char *p;
    size_t n, cap;
};

static void put(struct buf *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void put_u32(struct buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(struct buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(struct buf *b, const char *s)
{
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}
static void kv_u32(struct buf *b, const char *k, uint32_t v)
{
    put_str(b, k), put_u32(b, KVGGUF_UINT32), put_u32(b, v);
}
static void kv_f32(struct buf *b, const char *k, float v)
{
    put_str(b, k), put_u32(b, KVGGUF_FLOAT32), put(b, &v, 4);
}

enum { T_L = 2, T_E = 256, T_H = 4, T_KV = 2, T_D = 64, T_F = 96, T_V = 50 };
#define T_THETA 10000.0f
#define T_EPS 1e-5f

struct tiny_tensor {
    char name[48];
    int64_t ne0, ne1;
    float *data;
};

struct tiny {
    struct tiny_tensor t[4 + 9 * T_L];
    int n;
    char path[4200], dir[4096];
};

static float *tiny_add(struct tiny *m, struct kvcap_rng *r, const char *name, int64_t ne0,
                       int64_t ne1, double mean, double sd)
{
    struct tiny_tensor *t = &m->t[m->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ne0 = ne0, t->ne1 = ne1;
    t->data = alloc_f((size_t)(ne0 * ne1));
    fill_random(r, t->data, (size_t)(ne0 * ne1), mean, sd);
    return t->data;
}

static const float *tiny_get(const struct tiny *m, const char *name)
{
    for (int i = 0; i < m->n; i++)
        if (!strcmp(m->t[i].name, name))
            return m->t[i].data;
    fail_msg("no tensor %s", name);
    return NULL;
}

static void tiny_make(struct tiny *m)
{
    memset(m, 0, sizeof *m);
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 42);
    tiny_add(m, &r, "token_embd.weight", T_E, T_V, 0.0, 1.0);
    tiny_add(m, &r, "output_norm.weight", T_E, 1, 1.0, 0.2);
    for (int l = 0; l < T_L; l++) {
        char n[48];
#define ADD(suffix, ne0, ne1, mean, sd) \
        snprintf(n, sizeof n, "blk.%d.%s", l, suffix), tiny_add(m, &r, n, ne0, ne1, mean, sd)
        ADD("attn_norm.weight", T_E, 1, 1.0, 0.2);
        ADD("attn_q.weight", T_E, T_H * T_D, 0.0, 0.3);
        ADD("attn_k.weight", T_E, T_KV * T_D, 0.0, 0.3);
        ADD("attn_v.weight", T_E, T_KV * T_D, 0.0, 0.3);
        ADD("attn_output.weight", T_H * T_D, T_E, 0.0, 0.2);
        ADD("ffn_norm.weight", T_E, 1, 1.0, 0.2);
        ADD("ffn_gate.weight", T_E, T_F, 0.0, 0.2);
        ADD("ffn_up.weight", T_E, T_F, 0.0, 0.2);
        ADD("ffn_down.weight", T_F, T_E, 0.0, 0.2);
#undef ADD
    }
    struct buf b = {0};
    put(&b, "GGUF", 4);
    put_u32(&b, 3);
    put_u64(&b, (uint64_t)m->n);
    put_u64(&b, 8);
    put_str(&b, "general.architecture"), put_u32(&b, KVGGUF_STRING), put_str(&b, "llama");
    kv_u32(&b, "llama.block_count", T_L);
    kv_u32(&b, "llama.embedding_length", T_E);
    kv_u32(&b, "llama.feed_forward_length", T_F);
    kv_u32(&b, "llama.attention.head_count", T_H);
    kv_u32(&b, "llama.attention.head_count_kv", T_KV);
    kv_f32(&b, "llama.rope.freq_base", T_THETA);
    kv_f32(&b, "llama.attention.layer_norm_rms_epsilon", T_EPS);
    uint64_t off = 0;
    for (int i = 0; i < m->n; i++) {
        put_str(&b, m->t[i].name);
        put_u32(&b, 2);
        put_u64(&b, (uint64_t)m->t[i].ne0), put_u64(&b, (uint64_t)m->t[i].ne1);
        put_u32(&b, KVGGUF_T_F32);
        put_u64(&b, off);
        off += ((uint64_t)(m->t[i].ne0 * m->t[i].ne1) * 4 + 31) / 32 * 32;
    }
    static const unsigned char zeros[32];
    put(&b, zeros, (32 - b.n % 32) % 32);
    for (int i = 0; i < m->n; i++) {
        size_t bytes = (size_t)(m->t[i].ne0 * m->t[i].ne1) * 4;
        put(&b, m->t[i].data, bytes);
        put(&b, zeros, (32 - bytes % 32) % 32);
    }
    assert_true(test_tmpdir(m->dir, sizeof m->dir, "llama"));
    snprintf(m->path, sizeof m->path, "%.4000s/tiny.gguf", m->dir);
    FILE *f = fopen(m->path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b.p, 1, b.n, f), b.n);
    fclose(f);
    free(b.p);
}

static void tiny_free(struct tiny *m)
{
    for (int i = 0; i < m->n; i++)
        free(m->t[i].data);
    test_rm_tree(m->dir);
}

/* ---- The naive reference forward pass ----------------------------------------------------- */
static void naive_rms(const float *x, const float *w, float *y, int n)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    double s = 1.0 / sqrt(ss / n + T_EPS);
    for (int i = 0; i < n; i++)
        y[i] = (float)(x[i] * s * w[i]);
}

/* y[out] = W[out][in] x */
static void naive_matvec(const float *w, const float *x, float *y, int in, int out)
{
    for (int o = 0; o < out; o++) {
        double s = 0;
        for (int i = 0; i < in; i++)
            s += (double)w[(size_t)o * in + i] * x[i];
        y[o] = (float)s;
    }
}

/* llama.cpp's normal RoPE: channels 2i and 2i+1 rotate by pos * theta^(-2i/d). */
static void naive_rope_adjacent(float *x, int heads, int pos)
{
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < T_D / 2; i++) {
            double a = pos * pow(T_THETA, -2.0 * i / T_D);
            float *p = x + h * T_D + 2 * i;
            double x0 = p[0], x1 = p[1];
            p[0] = (float)(x0 * cos(a) - x1 * sin(a));
            p[1] = (float)(x0 * sin(a) + x1 * cos(a));
        }
}

/* Logits of every position of ids[0..n) (teacher-forced), [n][T_V]. */
static void naive_forward(const struct tiny *m, const int32_t *ids, int n, float *logits)
{
    float *ks = alloc_f((size_t)T_L * n * T_KV * T_D), *vs = alloc_f((size_t)T_L * n * T_KV * T_D);
    for (int t = 0; t < n; t++) {
        float x[T_E], h[T_E], q[T_H * T_D], att[T_H * T_D], o[T_E], g[T_F], u[T_F];
        memcpy(x, tiny_get(m, "token_embd.weight") + (size_t)ids[t] * T_E, sizeof x);
        for (int l = 0; l < T_L; l++) {
            char n1[48];
#define W(suffix) (snprintf(n1, sizeof n1, "blk.%d.%s", l, suffix), tiny_get(m, n1))
            naive_rms(x, W("attn_norm.weight"), h, T_E);
            float *k = ks + ((size_t)l * n + t) * T_KV * T_D, *v = vs + ((size_t)l * n + t) * T_KV * T_D;
            naive_matvec(W("attn_q.weight"), h, q, T_E, T_H * T_D);
            naive_matvec(W("attn_k.weight"), h, k, T_E, T_KV * T_D);
            naive_matvec(W("attn_v.weight"), h, v, T_E, T_KV * T_D);
            naive_rope_adjacent(q, T_H, t);
            naive_rope_adjacent(k, T_KV, t);
            for (int hq = 0; hq < T_H; hq++) {
                const int hk = hq / (T_H / T_KV);
                double s[64], mx = -INFINITY, sum = 0;
                for (int j = 0; j <= t; j++) {
                    double dot = 0;
                    for (int c = 0; c < T_D; c++)
                        dot += (double)q[hq * T_D + c] *
                               ks[(((size_t)l * n + j) * T_KV + hk) * T_D + c];
                    s[j] = dot / sqrt((double)T_D);
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int j = 0; j <= t; j++)
                    sum += s[j] = exp(s[j] - mx);
                for (int c = 0; c < T_D; c++) {
                    double a = 0;
                    for (int j = 0; j <= t; j++)
                        a += s[j] / sum * vs[(((size_t)l * n + j) * T_KV + hk) * T_D + c];
                    att[hq * T_D + c] = (float)a;
                }
            }
            naive_matvec(W("attn_output.weight"), att, o, T_H * T_D, T_E);
            for (int i = 0; i < T_E; i++)
                x[i] += o[i];
            naive_rms(x, W("ffn_norm.weight"), h, T_E);
            naive_matvec(W("ffn_gate.weight"), h, g, T_E, T_F);
            naive_matvec(W("ffn_up.weight"), h, u, T_E, T_F);
            for (int i = 0; i < T_F; i++)
                g[i] = (float)(g[i] / (1.0 + exp(-g[i])) * u[i]);
            naive_matvec(W("ffn_down.weight"), g, o, T_F, T_E);
            for (int i = 0; i < T_E; i++)
                x[i] += o[i];
#undef W
        }
        naive_rms(x, tiny_get(m, "output_norm.weight"), h, T_E);
        naive_matvec(tiny_get(m, "token_embd.weight"), h, logits + (size_t)t * T_V, T_E, T_V);
    }
    free(ks), free(vs);
}

/* Loads a model, printing the library's message when it fails. */
static struct kvllama_model *load_ok(const char *path)
{
    struct kvllama_model *model = NULL;
    enum kvcap_status st = kvllama_load(path, &model);
    if (st != KVCAP_OK)
        fail_msg("kvllama_load: %s", kvcap_last_error());
    return model;
}

static void test_tiny_prefill_matches_naive(void **state)
{
    (void)state;
    struct tiny m;
    tiny_make(&m);
    struct kvllama_model *model = load_ok(m.path);
    const struct kvllama_hparams *hp = kvllama_hparams(model);
    assert_int_equal(hp->n_layers, T_L);
    assert_int_equal(hp->head_dim, T_D);
    assert_int_equal(hp->n_vocab, T_V);
    enum { N = 23 };
    int32_t ids[N];
    for (int i = 0; i < N; i++)
        ids[i] = (i * 17 + 3) % T_V;
    float *ref = alloc_f((size_t)N * T_V), *got = alloc_f((size_t)N * T_V);
    naive_forward(&m, ids, N, ref);
    struct kvllama_prefill_out out = {.logits = got, .n_logits = N};
    assert_int_equal(kvllama_prefill(model, ids, N, &out), KVCAP_OK);
    double e = rel_err(got, ref, (size_t)N * T_V);
    assert_true(e < TOL_TINY_REL);
    free(ref), free(got);
    kvllama_free(model);
    tiny_free(&m);
}

/* A prefill whose middle rows enter as embeddings equals the token prefill, to the bit, when
 * those embeddings are the tokens' own; the ids under the span are not read. */
static void test_embedding_span_prefill(void **state)
{
    (void)state;
    struct tiny m;
    tiny_make(&m);
    struct kvllama_model *model = load_ok(m.path);
    enum { N = 19, AT = 5, SPAN = 9 };
    int32_t ids[N], masked[N];
    for (int i = 0; i < N; i++)
        ids[i] = masked[i] = (i * 7 + 1) % T_V;
    const float *table = kvllama_token_embeddings(model);
    assert_non_null(table);
    float *embd = alloc_f((size_t)SPAN * T_E);
    for (int i = 0; i < SPAN; i++) {
        memcpy(embd + (size_t)i * T_E, table + (size_t)ids[AT + i] * T_E, sizeof(float) * T_E);
        masked[AT + i] = -1; /* never read */
    }
    size_t kv = (size_t)T_L * N * T_KV * T_D;
    float *k0 = alloc_f(kv), *v0 = alloc_f(kv), *l0 = alloc_f((size_t)N * T_V);
    float *k1 = alloc_f(kv), *v1 = alloc_f(kv), *l1 = alloc_f((size_t)N * T_V);
    struct kvllama_prefill_out a = {.k = k0, .v = v0, .logits = l0, .n_logits = N};
    struct kvllama_prefill_out b = {.k = k1, .v = v1, .logits = l1, .n_logits = N};
    assert_int_equal(kvllama_prefill(model, ids, N, &a), KVCAP_OK);
    struct kvllama_embd_span span = {AT, SPAN, embd};
    assert_int_equal(kvllama_prefill_embd(model, masked, N, &span, &b), KVCAP_OK);
    assert_memory_equal(k0, k1, sizeof(float) * kv);
    assert_memory_equal(v0, v1, sizeof(float) * kv);
    assert_memory_equal(l0, l1, sizeof(float) * N * T_V);
    /* a span past the end, or a poisoned embedding, is refused */
    struct kvllama_embd_span past = {N - 2, 3, embd};
    assert_int_equal(kvllama_prefill_embd(model, masked, N, &past, &b),
                     KVCAP_ERR_INVALID_ARGUMENT);
    embd[T_E + 2] = NAN;
    assert_int_equal(kvllama_prefill_embd(model, masked, N, &span, &b), KVCAP_ERR_NUMERIC);
    assert_non_null(strstr(kvcap_last_error(), "token 1, channel 2"));
    free(embd), free(k0), free(v0), free(l0), free(k1), free(v1), free(l1);
    kvllama_free(model);
    tiny_free(&m);
}

/* KVzip's reconstruction pass over a prompt with two embedding spans (two images) equals the
 * pass over the tokens, to the bit, when the embeddings are the tokens' own: each span enters
 * at its place in both copies of the prompt (a span left at the first copy's place, or only the
 * first span, would put other rows there). */
static void test_reconstruct_two_spans(void **state)
{
    (void)state;
    struct tiny m;
    tiny_make(&m);
    struct kvllama_model *model = load_ok(m.path);
    enum { P = 21, NP = 3, R = NP + P };
    const struct kvllama_embd_span at[2] = {{3, 5, NULL}, {11, 6, NULL}};
    int32_t ids[P], masked[P], prefix[NP] = {1, 4, 9};
    for (int i = 0; i < P; i++)
        ids[i] = masked[i] = (i * 11 + 2) % T_V;
    const float *table = kvllama_token_embeddings(model);
    float *embd[2];
    struct kvllama_embd_span spans[2];
    for (int s = 0; s < 2; s++) {
        embd[s] = alloc_f((size_t)at[s].n * T_E);
        for (int i = 0; i < at[s].n; i++) {
            memcpy(embd[s] + (size_t)i * T_E, table + (size_t)ids[at[s].at + i] * T_E,
                   sizeof(float) * T_E);
            masked[at[s].at + i] = -1; /* never read */
        }
        spans[s] = (struct kvllama_embd_span){at[s].at, at[s].n, embd[s]};
    }
    const size_t kv = (size_t)T_L * P * T_KV * T_D, nq = (size_t)T_L * T_H * R * T_D;
    float *k = alloc_f(kv), *v = alloc_f(kv);
    float *q0 = alloc_f(nq), *q1 = alloc_f(nq);
    float *lse0 = alloc_f((size_t)T_L * T_H * R), *lse1 = alloc_f((size_t)T_L * T_H * R);
    struct kvllama_prefill_out out = {.k = k, .v = v};
    assert_int_equal(kvllama_prefill(model, ids, P, &out), KVCAP_OK);
    const struct kvllama_past past = {k, v, P, P};
    assert_int_equal(kvllama_reconstruct(model, ids, P, prefix, NP, NULL, 0, &past, q0, lse0),
                     KVCAP_OK);
    assert_int_equal(kvllama_reconstruct(model, masked, P, prefix, NP, spans, 2, &past, q1, lse1),
                     KVCAP_OK);
    assert_memory_equal(q0, q1, sizeof(float) * nq);
    assert_memory_equal(lse0, lse1, sizeof(float) * T_L * T_H * R);
    free(embd[0]), free(embd[1]), free(k), free(v), free(q0), free(q1), free(lse0), free(lse1);
    kvllama_free(model);
    tiny_free(&m);
}

/* Prefill a prompt into caches, then decode teacher-forced through them: every step's logits
 * equal the naive forward pass at that position. Two caches (2 and 1 sequences) share a step. */
static void test_tiny_decode_through_cache(void **state)
{
    (void)state;
    struct tiny m;
    tiny_make(&m);
    struct kvllama_model *model = load_ok(m.path);
    enum { P = 9, STEPS = 12, N = P + STEPS, ROWS = 3 };
    int32_t ids[ROWS][N];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < N; i++)
            ids[r][i] = (i * (7 + 2 * r) + 5 * r + 1) % T_V;
    struct kvcap_model_geometry g;
    kvllama_geometry(model, &g);
    struct kvcap_cache *caches[2];
    const int seqs[2] = {2, 1};
    for (int c = 0; c < 2; c++) {
        struct kvcap_cache_params p;
        kvcap_cache_default_params(&p);
        p.model = g;
        p.n_seqs = seqs[c];
        p.storage = KVCAP_DTYPE_F32;
        p.n_threads = 2;
        assert_int_equal(kvcap_cache_create(&p, &caches[c]), KVCAP_OK);
    }
    const size_t kd = (size_t)T_KV * T_D;
    float *k = alloc_f((size_t)T_L * P * kd), *v = alloc_f((size_t)T_L * P * kd);
    float *logits = alloc_f((size_t)ROWS * T_V);
    for (int r = 0; r < ROWS; r++) {
        struct kvllama_prefill_out out = {.k = k, .v = v};
        assert_int_equal(kvllama_prefill(model, ids[r], P, &out), KVCAP_OK);
        struct kvcap_cache *cache = caches[r < 2 ? 0 : 1];
        const int seq = r < 2 ? r : 0;
        const struct kvcap_span_desc sd = {KVCAP_SPAN_TEXT, P, 0, 0, 0};
        for (int l = 0; l < T_L; l++) {
            struct kvcap_tensor_view kv = {.base = k + (size_t)l * P * kd,
                                           .dtype = KVCAP_DTYPE_F32, .head_stride = T_D,
                                           .token_stride = (int64_t)kd};
            struct kvcap_tensor_view vv = kv;
            vv.base = v + (size_t)l * P * kd;
            assert_int_equal(kvcap_cache_add_span(cache, seq, l, &sd, &kv, &vv), KVCAP_OK);
        }
    }
    struct kvllama_decoder *dec = NULL;
    assert_int_equal(kvllama_decoder_create(model, ROWS, &dec), KVCAP_OK);
    struct kvllama_group groups[2] = {{.cache = caches[0], .n_seqs = 2},
                                     {.cache = caches[1], .n_seqs = 1}};
    double worst = 0;
    float *refs = alloc_f((size_t)ROWS * N * T_V);
    for (int r = 0; r < ROWS; r++)
        naive_forward(&m, ids[r], N, refs + (size_t)r * N * T_V);
    for (int t = P; t < N; t++) {
        int32_t step_ids[ROWS];
        int pos[ROWS];
        for (int r = 0; r < ROWS; r++)
            step_ids[r] = ids[r][t], pos[r] = t;
        groups[0].measure_bytes = groups[1].measure_bytes = t == N - 1;
        assert_int_equal(kvllama_decode(dec, groups, 2, step_ids, pos, logits), KVCAP_OK);
        for (int r = 0; r < ROWS; r++) {
            double e = rel_err(logits + (size_t)r * T_V, refs + ((size_t)r * N + t) * T_V, T_V);
            worst = e > worst ? e : worst;
        }
    }
    printf("decode through caches vs naive: worst relative error %.2e\n", worst);
    assert_true(worst < TOL_TINY_REL);
    assert_true(groups[0].attend_seconds > 0.0);
    /* The last step read, per layer, every row of K and V (f32) of its sequences: N tokens. */
    assert_int_equal(groups[0].bytes_read, (uint64_t)T_L * 2 * N * 2 * T_KV * T_D * 4);
    assert_int_equal(groups[1].bytes_read, (uint64_t)T_L * 1 * N * 2 * T_KV * T_D * 4);
    /* Bad calls are named and leave the decoder usable. */
    int32_t bad[ROWS] = {T_V, 0, 0};
    int pos0[ROWS] = {N, N, N};
    assert_int_equal(kvllama_decode(dec, groups, 2, bad, pos0, logits), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "outside the vocabulary"));
    free(refs);
    kvllama_decoder_free(dec);
    for (int c = 0; c < 2; c++)
        kvcap_cache_free(caches[c]);
    free(k), free(v), free(logits);
    kvllama_free(model);
    tiny_free(&m);
}

static void test_load_errors(void **state)
{
    (void)state;
    struct kvllama_model *model = (void *)1;
    assert_int_not_equal(kvllama_load("/nonexistent/model.gguf", &model), KVCAP_OK);
    assert_null(model);
    assert_non_null(strstr(kvcap_last_error(), "/nonexistent/model.gguf"));
    /* A file without the weights a llama needs names the missing tensor. */
    struct tiny m;
    tiny_make(&m);
    FILE *f = fopen(m.path, "r+b");
    assert_non_null(f);
    /* Rename the first layer's attn_q tensor in place ("blk.0.attn_q" -> "blk.0.attn_X"). */
    char *data = malloc(1 << 20);
    size_t n = fread(data, 1, 1 << 20, f);
    char *hit = memmem(data, n, "blk.0.attn_q.weight", 19);
    assert_non_null(hit);
    hit[11] = 'X';
    fseek(f, 0, SEEK_SET);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
    free(data);
    assert_int_equal(kvllama_load(m.path, &model), KVCAP_ERR_NOT_FOUND);
    assert_non_null(strstr(kvcap_last_error(), "blk.0.attn_q.weight"));
    tiny_free(&m);
}

/* ---- SmolLM2 against llama.cpp -------------------------------------------------------------- */
static int smollm2_path(char *out, size_t cap)
{
    const char *env = getenv("KVCAP_SMOLLM2_GGUF"), *home = getenv("HOME");
    if (env && *env)
        snprintf(out, cap, "%s", env);
    else
        snprintf(out, cap, "%s/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                 home ? home : ".");
    FILE *f = fopen(out, "rb");
    if (!f) {
        printf("SKIP: SmolLM2 checks against llama.cpp (%s not found; bash scripts/fetch-model.sh "
               "gets it)\n", out);
        return 0;
    }
    fclose(f);
    return 1;
}

static cJSON *load_fixture(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/smollm2_reference.json", KVCAP_TEST_DATA);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    assert_int_equal(fread(text, 1, (size_t)n, f), (size_t)n);
    text[n] = '\0';
    fclose(f);
    cJSON *j = cJSON_Parse(text);
    free(text);
    assert_non_null(j);
    return j;
}

/* Largest |logit - reference| over a fixture row summary's top ids. */
static double top_diff(const float *logits, const cJSON *summary)
{
    const cJSON *ids = cJSON_GetObjectItem(summary, "top_ids");
    const cJSON *vals = cJSON_GetObjectItem(summary, "top_logits");
    assert_true(cJSON_IsArray(ids) && cJSON_GetArraySize(ids) == cJSON_GetArraySize(vals));
    double worst = 0;
    for (int i = 0; i < cJSON_GetArraySize(ids); i++) {
        const double e = fabs(logits[cJSON_GetArrayItem(ids, i)->valueint] -
                              cJSON_GetArrayItem(vals, i)->valuedouble);
        worst = e > worst ? e : worst;
    }
    return worst;
}

/* Prefill + greedy decode through a libkvcap cache (policy full) of one fixture prompt, against
 * one llama.cpp reference (logits_first, logits_last, greedy). Returns the largest top-logit
 * difference; argmax and greedy tokens must be equal. */
static double check_prompt(const struct kvllama_model *model, const cJSON *ids_j,
                           const cJSON *ref)
{
    const struct kvllama_hparams *hp = kvllama_hparams(model);
    struct kvcap_model_geometry g;
    kvllama_geometry(model, &g);
    const int n = cJSON_GetArraySize(ids_j), V = hp->n_vocab;
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)cJSON_GetArrayItem(ids_j, i)->valueint;
    const size_t kd = (size_t)hp->n_kv_heads * hp->head_dim;
    float *logits = alloc_f((size_t)n * V);
    float *k = alloc_f((size_t)hp->n_layers * n * kd), *v = alloc_f((size_t)hp->n_layers * n * kd);
    struct kvllama_prefill_out out = {.k = k, .v = v, .logits = logits, .n_logits = n};
    assert_int_equal(kvllama_prefill(model, ids, n, &out), KVCAP_OK);
    const float *first = logits, *last = logits + (size_t)(n - 1) * V;
    const cJSON *rf = cJSON_GetObjectItem(ref, "logits_first");
    const cJSON *rl = cJSON_GetObjectItem(ref, "logits_last");
    assert_int_equal(kvllama_argmax(first, V),
                     cJSON_GetArrayItem(cJSON_GetObjectItem(rf, "top_ids"), 0)->valueint);
    assert_int_equal(kvllama_argmax(last, V),
                     cJSON_GetArrayItem(cJSON_GetObjectItem(rl, "top_ids"), 0)->valueint);
    double worst = top_diff(first, rf), d = top_diff(last, rl);
    worst = d > worst ? d : worst;
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = g;
    p.n_seqs = 1;
    p.storage = KVCAP_DTYPE_F32;
    struct kvcap_cache *cache = NULL;
    assert_int_equal(kvcap_cache_create(&p, &cache), KVCAP_OK);
    const struct kvcap_span_desc sd = {KVCAP_SPAN_TEXT, n, 0, 0, 0};
    for (int l = 0; l < hp->n_layers; l++) {
        struct kvcap_tensor_view kv = {.base = k + (size_t)l * n * kd, .dtype = KVCAP_DTYPE_F32,
                                       .head_stride = hp->head_dim, .token_stride = (int64_t)kd};
        struct kvcap_tensor_view vv = kv;
        vv.base = v + (size_t)l * n * kd;
        assert_int_equal(kvcap_cache_add_span(cache, 0, l, &sd, &kv, &vv), KVCAP_OK);
    }
    struct kvllama_decoder *dec = NULL;
    assert_int_equal(kvllama_decoder_create(model, 1, &dec), KVCAP_OK);
    struct kvllama_group grp = {.cache = cache, .n_seqs = 1};
    const cJSON *greedy = cJSON_GetObjectItem(ref, "greedy");
    int32_t tok = kvllama_argmax(last, V);
    for (int t = 0; t < cJSON_GetArraySize(greedy); t++) {
        assert_int_equal(tok, cJSON_GetArrayItem(greedy, t)->valueint);
        int pos = n + t;
        assert_int_equal(kvllama_decode(dec, &grp, 1, &tok, &pos, logits), KVCAP_OK);
        tok = kvllama_argmax(logits, V);
    }
    kvllama_decoder_free(dec);
    kvcap_cache_free(cache);
    free(ids), free(logits), free(k), free(v);
    return worst;
}

static void test_smollm2_matches_llamacpp(void **state)
{
    (void)state;
    char path[4096];
    if (!smollm2_path(path, sizeof path))
        skip();
    cJSON *fx = load_fixture();
    struct kvllama_model *model = load_ok(path);
    const cJSON *prompts = cJSON_GetObjectItem(fx, "prompts");
    assert_true(cJSON_IsArray(prompts));
    int checked = 0;
    double worst_q4 = 0, worst_f32 = 0;
    const cJSON *pr;
    cJSON_ArrayForEach(pr, prompts)
    {
        const cJSON *ids = cJSON_GetObjectItem(pr, "ids"), *f32 = cJSON_GetObjectItem(pr, "f32");
        if (!cJSON_GetObjectItem(pr, "greedy"))
            continue;
        assert_non_null(f32);
        const double q4 = check_prompt(model, ids, pr), f = check_prompt(model, ids, f32);
        worst_q4 = q4 > worst_q4 ? q4 : worst_q4;
        worst_f32 = f > worst_f32 ? f : worst_f32;
        checked++;
    }
    printf("SmolLM2 vs llama.cpp, %d prompts: top-32 logits max |diff| %.4f (F32 file), %.4f "
           "(Q4_1 file); argmax and 8 greedy tokens equal\n", checked, worst_f32, worst_q4);
    assert_true(checked >= 3);
    assert_true(worst_f32 < TOL_LLAMACPP_F32_ABS);
    assert_true(worst_q4 < TOL_LLAMACPP_Q4_ABS);
    cJSON_Delete(fx);
    kvllama_free(model);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_prefill_matches_naive),
        cmocka_unit_test(test_embedding_span_prefill),
        cmocka_unit_test(test_reconstruct_two_spans),
        cmocka_unit_test(test_tiny_decode_through_cache),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_smollm2_matches_llamacpp),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
