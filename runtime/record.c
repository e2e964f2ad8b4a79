/* record.c — record mode: the vision spans an engine hands the cache at prefill, and the decode
 * queries that attend to them, written as dataset shards (formats/SPEC.md §4.1) in the format
 * kvcap-calibrate reads. Spans are buffered per sequence (a batch interleaves sequences, while
 * the shard writer takes one span at a time) and written when the sequence starts its next
 * vision span, on kvcap_cache_record_flush, or when the cache is freed. */
#include <stdlib.h>
#include <string.h>

#include "cache_internal.h"
#include "dataset.h"

struct query_list {
    float *data; /* [count][q_heads][d] */
    int count, cap;
};

struct pending {
    int active, rows, cols, p0, n;
    float **k, **v;             /* [layers] -> [kv_heads][n][d], NULL until that layer came */
    struct query_list *post, *dec; /* [layers] */
};

struct kvcap_recorder {
    struct kvcap_model_geometry g;
    int n_seqs;
    struct pending *seqs;
    struct kvcap_dataset_writer *writer;
};

static void clear(struct kvcap_recorder *r, struct pending *p)
{
    for (int l = 0; l < r->g.n_layers; l++) {
        free(p->k[l]), free(p->v[l]);
        p->k[l] = p->v[l] = NULL;
        free(p->post[l].data), free(p->dec[l].data);
        memset(&p->post[l], 0, sizeof p->post[l]);
        memset(&p->dec[l], 0, sizeof p->dec[l]);
    }
    p->active = 0;
}

enum kvcap_status kvcap_recorder_create(const struct kvcap_model_geometry *g, int n_seqs,
                                        const char *dir, struct kvcap_recorder **out)
{
    struct kvcap_recorder *r = calloc(1, sizeof *r);
    KVCAP_RETURN_IF(!r, KVCAP_ERR_OUT_OF_MEMORY, "record: out of memory");
    r->g = *g;
    r->n_seqs = n_seqs;
    r->seqs = calloc((size_t)n_seqs, sizeof *r->seqs);
    enum kvcap_status st = r->seqs ? KVCAP_OK : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "record: OOM");
    for (int s = 0; st == KVCAP_OK && s < n_seqs; s++) {
        struct pending *p = &r->seqs[s];
        p->k = calloc((size_t)g->n_layers, sizeof *p->k);
        p->v = calloc((size_t)g->n_layers, sizeof *p->v);
        p->post = calloc((size_t)g->n_layers, sizeof *p->post);
        p->dec = calloc((size_t)g->n_layers, sizeof *p->dec);
        if (!p->k || !p->v || !p->post || !p->dec)
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "record: out of memory");
    }
    if (st == KVCAP_OK) {
        struct kvcap_dataset_writer_params wp;
        kvcap_dataset_writer_default_params(&wp);
        wp.dir = dir;
        wp.prefix = "record";
        wp.dtype = KVCAP_DTYPE_F16;
        wp.source = "libkvcap record mode";
        st = kvcap_dataset_writer_create(g, &wp, &r->writer);
    }
    if (st != KVCAP_OK) {
        r->n_seqs = r->seqs ? n_seqs : 0;
        kvcap_recorder_free(r);
        return st;
    }
    *out = r;
    return KVCAP_OK;
}

/* Writes one sequence's pending span to the shard writer (if it is complete). */
static enum kvcap_status finish(struct kvcap_recorder *r, int seq)
{
    struct pending *p = &r->seqs[seq];
    if (!p->active)
        return KVCAP_OK;
    int L = r->g.n_layers, complete = 1, n_post = 1 << 30, n_dec = 1 << 30;
    for (int l = 0; l < L; l++) {
        complete &= p->k[l] != NULL;
        n_post = p->post[l].count < n_post ? p->post[l].count : n_post;
        n_dec = p->dec[l].count < n_dec ? p->dec[l].count : n_dec;
    }
    enum kvcap_status st = KVCAP_OK;
    if (!complete) {
        kvcap_log(KVCAP_LOG_WARN, "record: seq %d: a span missing some layers was not recorded",
                  seq);
    } else {
        st = kvcap_dataset_writer_begin_span(r->writer, p->rows, p->cols, p->p0);
        size_t row = (size_t)r->g.n_q_heads * (size_t)r->g.head_dim;
        for (int l = 0; st == KVCAP_OK && l < L; l++) {
            st = kvcap_dataset_writer_set_kv(r->writer, l, p->k[l], p->v[l]);
            /* a step's queries [q_heads][d] are [q_heads][1][d]: one query per call */
            for (int i = 0; st == KVCAP_OK && i < n_post; i++)
                st = kvcap_dataset_writer_add_queries(r->writer, l, KVCAP_QUERIES_POST,
                                                      p->post[l].data + (size_t)i * row, 1);
            for (int i = 0; st == KVCAP_OK && i < n_dec; i++)
                st = kvcap_dataset_writer_add_queries(r->writer, l, KVCAP_QUERIES_DECODE,
                                                      p->dec[l].data + (size_t)i * row, 1);
        }
        if (st == KVCAP_OK)
            st = kvcap_dataset_writer_end_span(r->writer);
    }
    clear(r, p);
    return st;
}

enum kvcap_status kvcap_recorder_span(struct kvcap_recorder *r, int seq, int layer,
                                      const struct kvcap_span_desc *span,
                                      const struct kvcap_tensor_view *k,
                                      const struct kvcap_tensor_view *v)
{
    struct pending *p = &r->seqs[seq];
    if (layer == 0) {
        KVCAP_TRY(finish(r, seq));
        p->active = 1;
        p->rows = span->rows;
        p->cols = span->cols;
        p->p0 = span->p0;
        p->n = span->n_tokens;
    }
    if (!p->active || p->k[layer])
        return KVCAP_OK; /* a span started before recording, or a repeated layer: skip */
    size_t per_head = (size_t)p->n * (size_t)r->g.head_dim, H = (size_t)r->g.n_kv_heads;
    p->k[layer] = malloc(sizeof(float) * per_head * H);
    p->v[layer] = malloc(sizeof(float) * per_head * H);
    KVCAP_RETURN_IF(!p->k[layer] || !p->v[layer], KVCAP_ERR_OUT_OF_MEMORY,
                    "record: out of memory for a %d-token span", p->n);
    for (size_t h = 0; h < H; h++) {
        kvcap_view_read(k, (int)h, 0, p->n, r->g.head_dim, p->k[layer] + h * per_head);
        kvcap_view_read(v, (int)h, 0, p->n, r->g.head_dim, p->v[layer] + h * per_head);
    }
    return KVCAP_OK;
}

static enum kvcap_status push(struct query_list *list, const float *q, size_t row)
{
    if (list->count == list->cap) {
        int cap = list->cap ? 2 * list->cap : 16;
        float *grown = realloc(list->data, sizeof(float) * row * (size_t)cap);
        KVCAP_RETURN_IF(!grown, KVCAP_ERR_OUT_OF_MEMORY, "record: out of memory for queries");
        list->data = grown;
        list->cap = cap;
    }
    memcpy(list->data + (size_t)list->count++ * row, q, sizeof(float) * row);
    return KVCAP_OK;
}

enum kvcap_status kvcap_recorder_post_queries(struct kvcap_recorder *r, int seq, int layer,
                                              const float *q, int n)
{
    struct pending *p = &r->seqs[seq];
    if (!p->active)
        return KVCAP_OK;
    size_t d = (size_t)r->g.head_dim, row = (size_t)r->g.n_q_heads * d;
    float *one = malloc(sizeof(float) * row);
    KVCAP_RETURN_IF(!one, KVCAP_ERR_OUT_OF_MEMORY, "record: out of memory");
    enum kvcap_status st = KVCAP_OK;
    for (int t = 0; st == KVCAP_OK && t < n; t++) { /* [q_heads][n][d] -> one [q_heads][d] each */
        for (int h = 0; h < r->g.n_q_heads; h++)
            memcpy(one + (size_t)h * d, q + ((size_t)h * (size_t)n + (size_t)t) * d,
                   sizeof(float) * d);
        st = push(&p->post[layer], one, row);
    }
    free(one);
    return st;
}

enum kvcap_status kvcap_recorder_decode_queries(struct kvcap_recorder *r, int layer, const float *q)
{
    size_t row = (size_t)r->g.n_q_heads * (size_t)r->g.head_dim;
    for (int s = 0; s < r->n_seqs; s++)
        if (r->seqs[s].active)
            KVCAP_TRY(push(&r->seqs[s].dec[layer], q + (size_t)s * row, row));
    return KVCAP_OK;
}

enum kvcap_status kvcap_recorder_flush(struct kvcap_recorder *r)
{
    for (int s = 0; s < r->n_seqs; s++)
        KVCAP_TRY(finish(r, s));
    return kvcap_dataset_writer_flush(r->writer);
}

void kvcap_recorder_free(struct kvcap_recorder *r)
{
    if (!r)
        return;
    if (r->writer && kvcap_recorder_flush(r) != KVCAP_OK)
        kvcap_log(KVCAP_LOG_ERROR, "record: pending spans could not be written: %s",
                  kvcap_last_error());
    for (int s = 0; r->seqs && s < r->n_seqs; s++) {
        struct pending *p = &r->seqs[s];
        if (p->k && p->v && p->post && p->dec)
            clear(r, p);
        free(p->k), free(p->v), free(p->post), free(p->dec);
    }
    free(r->seqs);
    kvcap_dataset_writer_free(r->writer);
    free(r);
}
