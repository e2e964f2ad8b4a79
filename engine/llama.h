/* llama.h — a reference engine for Llama-family models read from GGUF files (RMSNorm, RoPE,
 * grouped-query attention, SwiGLU; weights dequantised to f32 at load, matrix products through
 * OpenBLAS). Prefill computes plain causal attention itself and hands each layer's K/V (and
 * queries) to the caller; every decode step's attention goes through libkvcap caches, so any
 * compression policy runs inside a real model. Internal to kvcap's evaluation tools.
 *
 * Layout: the GGUF converter permutes the rows of attn_q/attn_k so that llama.cpp can rotate
 * adjacent channel pairs; the loader undoes that permutation, so keys and queries come out in
 * the Hugging Face layout and rotate with the "half" pairing (the dot products are the same). */
#ifndef KVCAP_LLAMA_H
#define KVCAP_LLAMA_H

#include <stdint.h>

#include "engine/gguf.h"
#include "kvcap.h"

struct kvllama_hparams {
    int n_layers, n_embd, n_ff, n_heads, n_kv_heads, head_dim, n_vocab, n_ctx;
    float rope_theta, rms_eps;
};

struct kvllama_model;

/* The model the tools use without -m: $KVCAP_MODEL, else
 * $HOME/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf (written into buf). */
const char *kvllama_default_model(char *buf, size_t cap);

/* Loads a GGUF file of architecture "llama" (tied or separate output matrix). Errors name the
 * file and the key or tensor at fault. */
enum kvcap_status kvllama_load(const char *path, struct kvllama_model **out);
/* The same from a file already open (e.g. also read for its tokenizer); f may be closed after. */
enum kvcap_status kvllama_load_gguf(const struct kvgguf_file *f, struct kvllama_model **out);
void kvllama_free(struct kvllama_model *m); /* NULL is a no-op */

const struct kvllama_hparams *kvllama_hparams(const struct kvllama_model *m);
/* The geometry libkvcap needs for this model (name from general.name). */
void kvllama_geometry(const struct kvllama_model *m, struct kvcap_model_geometry *g);
/* Bytes of f32 weights held. */
uint64_t kvllama_weight_bytes(const struct kvllama_model *m);

/* ---- Prefill ----------------------------------------------------------------------------- */
/* What a prefill of n tokens hands back. Every pointer is optional (NULL: not wanted); the
 * caller allocates:
 *   k, v     [n_layers][n][n_kv_heads][head_dim]  rotated keys and values (NHD per layer)
 *   q_tail   [n_layers][n_heads][n_q_tail][head_dim] rotated queries of the last n_q_tail
 *            tokens (the layout kvcap_cache_add_post_queries takes)
 *   logits   [n_logits][n_vocab] of the last n_logits tokens */
struct kvllama_prefill_out {
    float *k, *v;
    float *q_tail;
    int n_q_tail;
    float *logits;
    int n_logits;
};

/* Runs tokens ids[0..n) at positions 0..n-1 with full causal attention. */
enum kvcap_status kvllama_prefill(const struct kvllama_model *m, const int32_t *ids, int n,
                                  struct kvllama_prefill_out *out);

/* Rows [at, at + n) of a prefill that enter as embeddings ([n][n_embd] f32, finite) instead of
 * token ids: an image span whose features were projected into the embedding space. */
struct kvllama_embd_span {
    int at, n;
    const float *embd;
};

/* kvllama_prefill with the rows of `span` (NULL: none) taken from its embeddings; the ids
 * there are not read. Given the token embeddings of those ids it equals kvllama_prefill. */
enum kvcap_status kvllama_prefill_embd(const struct kvllama_model *m, const int32_t *ids, int n,
                                       const struct kvllama_embd_span *span,
                                       struct kvllama_prefill_out *out);

/* The same with several embedding spans, in order and not overlapping (n_spans 0: token ids
 * only), e.g. an image and its repetition in a context-reconstruction pass. */
enum kvcap_status kvllama_prefill_spans(const struct kvllama_model *m, const int32_t *ids, int n,
                                        const struct kvllama_embd_span *spans, int n_spans,
                                        struct kvllama_prefill_out *out);

/* K/V a prefill continues from: the n tokens at positions 0 .. n-1 in kvllama_prefill_out's
 * layout with layer_stride tokens per layer (layer l's rows at k + l * layer_stride *
 * n_kv_heads * head_dim), e.g. a prompt's prefill that also holds later tokens. */
struct kvllama_past {
    const float *k, *v;
    int n, layer_stride;
};

/* The prefill of n more tokens (at positions past->n ..) attending the past's K/V as well as
 * each other causally; past NULL: kvllama_prefill_spans. What it hands back (k, v, q_tail,
 * logits) is the new tokens'; the spans' positions count from the first new token. */
enum kvcap_status kvllama_prefill_after(const struct kvllama_model *m,
                                        const struct kvllama_past *past, const int32_t *ids,
                                        int n, const struct kvllama_embd_span *spans,
                                        int n_spans, struct kvllama_prefill_out *out);

/* KVzip's context-reconstruction pass (arXiv 2505.23416): the P prompt tokens `ids`, then the
 * n_prefix tokens `prefix` (the instruction to repeat the context and the chat turn to the
 * assistant), then the prompt again, R = n_prefix + P tokens after the prompt. `spans` (n_spans
 * of them, in order; 0: none) are the prompt's embedding spans (its images), used in both
 * copies. Writes, for the R pass tokens,
 * their rotated queries q: [n_layers][n_heads][R][head_dim] and each query's log-sum-exp of
 * its scores (scaled by 1/sqrt(head_dim)) over the pass's keys up to itself, lse:
 * [n_layers][n_heads][R] (what a cache holding only the prompt lacks of the query's softmax;
 * kvcap_cache_add_post_queries_lse's layout). The pass continues from `past`, the prompt's K/V
 * (past->n == P), as an engine continues from its cache. */
enum kvcap_status kvllama_reconstruct(const struct kvllama_model *m, const int32_t *ids, int P,
                                      const int32_t *prefix, int n_prefix,
                                      const struct kvllama_embd_span *spans, int n_spans,
                                      const struct kvllama_past *past, float *q, float *lse);

/* The token-embedding table, [n_vocab][n_embd] f32 (dequantised). */
const float *kvllama_token_embeddings(const struct kvllama_model *m);

/* ---- Decode -------------------------------------------------------------------------------- */
/* Decode rows are grouped by cache: group g owns rows [first, first + cache's n_seqs) of the
 * batch, row first + s being sequence s of that cache. */
struct kvllama_group {
    struct kvcap_cache *cache;
    int n_seqs;
    double attend_seconds; /* accumulated by kvllama_decode: append + attend of this cache */
    int measure_bytes;     /* nonzero: kvllama_decode adds the bytes each layer's attend read */
    uint64_t bytes_read;   /* (kvcap_cache_stats after every attend, outside the timing) */
};

struct kvllama_decoder;

/* Scratch for batches of up to max_rows rows. */
enum kvcap_status kvllama_decoder_create(const struct kvllama_model *m, int max_rows,
                                         struct kvllama_decoder **out);
void kvllama_decoder_free(struct kvllama_decoder *d);

/* One decode step: row r feeds token ids[r] at position pos[r]; every layer appends the row's
 * K/V to its cache and attends through it. logits: [rows][n_vocab] (rows = sum of n_seqs). */
enum kvcap_status kvllama_decode(struct kvllama_decoder *d, struct kvllama_group *groups,
                                 int n_groups, const int32_t *ids, const int *pos,
                                 float *logits);

/* Index of the largest logit (lowest index among ties). */
int32_t kvllama_argmax(const float *logits, int n);
/* log Σ exp(logits): softmax's normaliser. */
double kvllama_log_sum_exp(const float *logits, int n);
/* log softmax(logits)[id]. */
double kvllama_log_prob(const float *logits, int n, int32_t id);

#endif /* KVCAP_LLAMA_H */
