/* record.c — record mode: the vision spans an engine hands the cache at prefill, and the decode
 * queries that attend to them, written as dataset shards (formats/SPEC.md §4.1) in the format
 * kvcap-calibrate reads. A batch interleaves sequences and a prompt may hold several images,
 * while the shard writer takes one whole span at a time, so spans are collected per sequence
 * until the sequence's prefill has ended (kvcap_cache_end_prefill) and are then written on
 * kvcap_cache_record_flush, when the sequence starts a new prefill with a vision span, or when
 * the cache is freed. A span is never dropped while its sequence may still complete it. */
#include <stdlib.h>
#include <string.h>

#include "runtime/cache_internal.h"
#include "formats/dataset.h"

struct query_list {
    float *data; /* [count][q_heads][d] */
    int count, cap;
};

/* One vision span of one sequence, collected until it is written. One allocation: the struct,
 * then k[layers], v[layers], post[layers], dec[layers]. */
struct rec_span {
    int index; /* the span's position among its sequence's spans (text spans included) */
    int rows, cols, p0, n;
    float **k, **v;                /* [layers] -> [kv_heads][n][d], NULL until that layer came */
    struct query_list *post, *dec; /* [layers] */
};

struct rec_seq {
    struct rec_span **spans; /* not yet written, in the order the engine added them */
    int n_spans, cap_spans;
    int prefill_ended; /* kvcap_cache_end_prefill succeeded since the last vision span came */
};

struct kvcap_recorder {
    struct kvcap_model_geometry g;
    int n_seqs;
    struct rec_seq *seqs;
    struct kvcap_dataset_writer *writer;
};

/* Frees what the span collected and describes it as `span` (NULL: keeps its description). */
static void span_clear(const struct kvcap_recorder *r, struct rec_span *sp,
                       const struct kvcap_span_desc *span)
{
    for (int l = 0; l < r->g.n_layers; l++) {
        free(sp->k[l]), free(sp->v[l]);
        free(sp->post[l].data), free(sp->dec[l].data);
        sp->k[l] = sp->v[l] = NULL;
        memset(&sp->post[l], 0, sizeof sp->post[l]);
        memset(&sp->dec[l], 0, sizeof sp->dec[l]);
    }
    if (span) {
        sp->rows = span->rows;
        sp->cols = span->cols;
        sp->p0 = span->p0;
        sp->n = span->n_tokens;
    }
}

static void span_free(const struct kvcap_recorder *r, struct rec_span *sp)
{
    if (!sp)
        return;
    span_clear(r, sp, NULL);
    free(sp);
}

static enum kvcap_status span_new(struct kvcap_recorder *r, struct rec_seq *s, int index,
                                  const struct kvcap_span_desc *span, struct rec_span **out)
{
    if (s->n_spans == s->cap_spans) {
        int cap = s->cap_spans ? 2 * s->cap_spans : 4;
        struct rec_span **grown = realloc(s->spans, sizeof *grown * (size_t)cap);
        KVCAP_RETURN_IF(!grown, KVCAP_ERR_OUT_OF_MEMORY, "record: out of memory");
        s->spans = grown;
        s->cap_spans = cap;
    }
    size_t L = (size_t)r->g.n_layers;
    struct rec_span *sp =
        calloc(1, sizeof *sp + L * (2 * sizeof(float *) + 2 * sizeof(struct query_list)));
    KVCAP_RETURN_IF(!sp, KVCAP_ERR_OUT_OF_MEMORY, "record: out of memory");
    sp->k = (float **)(sp + 1);
    sp->v = sp->k + L;
    sp->post = (struct query_list *)(sp->v + L);
    sp->dec = sp->post + L;
    sp->index = index;
    span_clear(r, sp, span);
    s->spans[s->n_spans++] = sp;
    *out = sp;
    return KVCAP_OK;
}

/* The first layer the span has not received, or -1 when every layer has it. */
static int missing_layer(const struct kvcap_recorder *r, const struct rec_span *sp)
{
    for (int l = 0; l < r->g.n_layers; l++)
        if (!sp->k[l])
            return l;
    return -1;
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
        kvcap_recorder_free(r);
        return st;
    }
    *out = r;
    return KVCAP_OK;
}

/* Hands one complete span to the shard writer. On failure the writer holds nothing of it and
 * the span stays with the caller, so a later flush can try again. */
static enum kvcap_status write_span(struct kvcap_recorder *r, int seq, const struct rec_span *sp)
{
    int L = r->g.n_layers, n_post = 1 << 30, n_dec = 1 << 30;
    /* the format needs as many queries on every layer: keep what all layers got */
    for (int l = 0; l < L; l++) {
        n_post = sp->post[l].count < n_post ? sp->post[l].count : n_post;
        n_dec = sp->dec[l].count < n_dec ? sp->dec[l].count : n_dec;
    }
    enum kvcap_status st = kvcap_dataset_writer_begin_span(r->writer, sp->rows, sp->cols, sp->p0);
    size_t row = (size_t)r->g.n_q_heads * (size_t)r->g.head_dim;
    for (int l = 0; st == KVCAP_OK && l < L; l++) {
        st = kvcap_dataset_writer_set_kv(r->writer, l, sp->k[l], sp->v[l]);
        /* a step's queries [q_heads][d] are [q_heads][1][d]: one query per call */
        for (int i = 0; st == KVCAP_OK && i < n_post; i++)
            st = kvcap_dataset_writer_add_queries(r->writer, l, KVCAP_QUERIES_POST,
                                                  sp->post[l].data + (size_t)i * row, 1);
        for (int i = 0; st == KVCAP_OK && i < n_dec; i++)
            st = kvcap_dataset_writer_add_queries(r->writer, l, KVCAP_QUERIES_DECODE,
                                                  sp->dec[l].data + (size_t)i * row, 1);
    }
    if (st == KVCAP_OK)
        st = kvcap_dataset_writer_end_span(r->writer);
    if (st != KVCAP_OK) {
        kvcap_dataset_writer_cancel_span(r->writer);
        kvcap_log(KVCAP_LOG_DEBUG, "record: seq %d: span %d kept for a later flush", seq,
                  sp->index);
    }
    return st;
}

/* Writes the spans of `seq`, oldest first; each written span is released. Called once the
 * sequence's prefill has ended, when the cache has checked that every layer got every span, or
 * when the cache is freed (`final`). A span missing a layer is then dropped: when `final` it
 * is one the engine never finished (a warning says so); otherwise its add_span failed at layer
 * 0 and the engine went on without it, so the cache does not hold it either. On failure the
 * span that failed and those after it stay. */
static enum kvcap_status write_seq(struct kvcap_recorder *r, int seq, int final)
{
    struct rec_seq *s = &r->seqs[seq];
    enum kvcap_status st = KVCAP_OK;
    int done = 0;
    for (; done < s->n_spans; done++) {
        struct rec_span *sp = s->spans[done];
        int l = missing_layer(r, sp);
        if (l >= 0 && final) {
            kvcap_log(KVCAP_LOG_WARN,
                      "record: seq %d: span %d (%dx%d at p0 %d) was not recorded: the cache was "
                      "freed before layer %d got it",
                      seq, sp->index, sp->rows, sp->cols, sp->p0, l);
        } else if (l >= 0) {
            kvcap_log(KVCAP_LOG_INFO,
                      "record: seq %d: span %d (%dx%d at p0 %d) is not recorded: adding it "
                      "failed and the sequence went on without it",
                      seq, sp->index, sp->rows, sp->cols, sp->p0);
        } else {
            st = write_span(r, seq, sp);
        }
        if (st != KVCAP_OK)
            break;
        span_free(r, sp);
    }
    if (done > 0) {
        memmove(s->spans, s->spans + done, sizeof *s->spans * (size_t)(s->n_spans - done));
        s->n_spans -= done;
    }
    return st;
}

enum kvcap_status kvcap_recorder_span(struct kvcap_recorder *r, int seq, int layer, int index,
                                      const struct kvcap_span_desc *span,
                                      const struct kvcap_tensor_view *k,
                                      const struct kvcap_tensor_view *v)
{
    /* Refused now, while the engine can still act on it, rather than when the shard is made. */
    KVCAP_TRY(kvcap_dataset_check_grid("span", span->rows, span->cols, span->p0));
    struct rec_seq *s = &r->seqs[seq];
    struct rec_span *sp = NULL;
    for (int i = s->n_spans - 1; i >= 0 && !sp; i--)
        if (s->spans[i]->index == index)
            sp = s->spans[i];
    if (!sp) {
        /* the cache adds span i at layer 0 first, and a span is only written once every layer
         * had it: a new span here is a bug, not an engine's mistake */
        KVCAP_RETURN_IF(layer != 0, KVCAP_ERR_INTERNAL,
                        "record: seq %d: span %d came at layer %d before layer 0", seq, index,
                        layer);
        if (s->prefill_ended) { /* a new turn: the spans of the last one are done */
            KVCAP_TRY(write_seq(r, seq, 0));
            s->prefill_ended = 0;
        }
        KVCAP_TRY(span_new(r, s, index, span, &sp));
    } else if (layer == 0 && (sp->rows != span->rows || sp->cols != span->cols ||
                              sp->p0 != span->p0 || sp->n != span->n_tokens)) {
        /* span `index` failed to be added at layer 0 and the engine adds another in its place */
        span_clear(r, sp, span);
    }
    /* A layer that came before came with an add_span that failed after recording it: the
     * engine's retry replaces it, as it replaces what the cache holds. */
    size_t per_head = (size_t)sp->n * (size_t)r->g.head_dim, H = (size_t)r->g.n_kv_heads;
    float *kc = malloc(sizeof(float) * per_head * H), *vc = malloc(sizeof(float) * per_head * H);
    if (!kc || !vc) {
        free(kc), free(vc);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "record: out of memory for a %d-token span",
                          sp->n);
    }
    for (size_t h = 0; h < H; h++) {
        kvcap_view_read(k, (int)h, 0, sp->n, r->g.head_dim, kc + h * per_head);
        kvcap_view_read(v, (int)h, 0, sp->n, r->g.head_dim, vc + h * per_head);
    }
    free(sp->k[layer]), free(sp->v[layer]);
    sp->k[layer] = kc;
    sp->v[layer] = vc;
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
    /* they follow the most recent vision span that has reached this layer */
    struct rec_seq *s = &r->seqs[seq];
    struct rec_span *sp = NULL;
    for (int i = s->n_spans - 1; i >= 0 && !sp; i--)
        if (s->spans[i]->k[layer])
            sp = s->spans[i];
    if (!sp)
        return KVCAP_OK; /* no vision span to go with */
    size_t d = (size_t)r->g.head_dim, row = (size_t)r->g.n_q_heads * d;
    float *one = malloc(sizeof(float) * row);
    KVCAP_RETURN_IF(!one, KVCAP_ERR_OUT_OF_MEMORY, "record: out of memory");
    enum kvcap_status st = KVCAP_OK;
    for (int t = 0; st == KVCAP_OK && t < n; t++) { /* [q_heads][n][d] -> one [q_heads][d] each */
        for (int h = 0; h < r->g.n_q_heads; h++)
            memcpy(one + (size_t)h * d, q + ((size_t)h * (size_t)n + (size_t)t) * d,
                   sizeof(float) * d);
        st = push(&sp->post[layer], one, row);
    }
    free(one);
    return st;
}

enum kvcap_status kvcap_recorder_decode_queries(struct kvcap_recorder *r, int layer, const float *q)
{
    /* a decode query attends to every span of its sequence */
    size_t row = (size_t)r->g.n_q_heads * (size_t)r->g.head_dim;
    for (int s = 0; s < r->n_seqs; s++)
        for (int i = 0; i < r->seqs[s].n_spans; i++)
            KVCAP_TRY(push(&r->seqs[s].spans[i]->dec[layer], q + (size_t)s * row, row));
    return KVCAP_OK;
}

void kvcap_recorder_end_prefill(struct kvcap_recorder *r, int seq)
{
    r->seqs[seq].prefill_ended = 1;
}

/* Flushing writes only the spans of sequences whose prefill has ended. A sequence still in
 * prefill may yet add the span's other layers and its post-vision queries: writing its span
 * now would cut it short or, missing layers, leave nothing to write, so it is kept for a later
 * flush. Keeping is what an engine that flushes between batches expects: every span it
 * completes is recorded, however its sequences interleave. */
enum kvcap_status kvcap_recorder_flush(struct kvcap_recorder *r)
{
    for (int s = 0; s < r->n_seqs; s++)
        if (r->seqs[s].prefill_ended)
            KVCAP_TRY(write_seq(r, s, 0));
    return kvcap_dataset_writer_flush(r->writer);
}

void kvcap_recorder_free(struct kvcap_recorder *r)
{
    if (!r)
        return;
    /* Nothing more can come: every complete span is written, whether or not its prefill was
     * ended. Errors can only be logged here. */
    enum kvcap_status st = KVCAP_OK;
    for (int s = 0; r->writer && s < r->n_seqs; s++) {
        enum kvcap_status one = write_seq(r, s, 1);
        st = st == KVCAP_OK ? one : st;
    }
    if (r->writer) { /* what was queued, also when a span failed */
        enum kvcap_status one = kvcap_dataset_writer_flush(r->writer);
        st = st == KVCAP_OK ? one : st;
    }
    if (st != KVCAP_OK)
        kvcap_log(KVCAP_LOG_ERROR, "record: pending spans could not be written: %s",
                  kvcap_last_error());
    for (int s = 0; r->seqs && s < r->n_seqs; s++) {
        for (int i = 0; i < r->seqs[s].n_spans; i++)
            span_free(r, r->seqs[s].spans[i]);
        free(r->seqs[s].spans);
    }
    free(r->seqs);
    kvcap_dataset_writer_free(r->writer);
    free(r);
}
