/* dataset.h — recorded K/V datasets (formats/SPEC.md §4.1): a writer that turns spans into
 * shards of bounded size (used by kvcap-synth and the runtime's record mode) and a reader that
 * streams spans from many shards while mapping one shard at a time. Internal to kvcap. */
#ifndef KVCAP_DATASET_H
#define KVCAP_DATASET_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"
#include "formats/safetensors.h"

/* ---- Writer ----------------------------------------------------------------------------- */

/* The longest grid side a shard's s{i}.grid may hold (SPEC §4.1). */
#define KVCAP_DATASET_MAX_SIDE 4096

/* The rules SPEC §4.1 sets for a span's grid: rows and cols in 1..KVCAP_DATASET_MAX_SIDE,
 * p0 >= 0. KVCAP_ERR_INVALID_ARGUMENT naming `what`.rows, .cols or .p0 otherwise. The writer
 * checks every span with it, and record mode checks a span with it when the engine adds it,
 * so a span the format cannot hold is refused then, not lost when the shard is written. */
enum kvcap_status kvcap_dataset_check_grid(const char *what, int rows, int cols, int p0);

struct kvcap_dataset_writer_params {
    const char *dir;      /* output folder, created if missing */
    const char *prefix;   /* shards are DIR/PREFIX-NNNNN.safetensors; default "shard" */
    enum kvcap_dtype dtype; /* storage of K/V/queries: F32, F16 (default) or BF16 */
    uint64_t shard_bytes; /* a shard is written once it holds this much; default 256 MiB */
    const char *source;   /* free text stored as dataset.source (copied); may be NULL */
};

enum kvcap_query_kind {
    KVCAP_QUERIES_POST = 0, /* post-vision prompt queries (q_post) */
    KVCAP_QUERIES_DECODE = 1 /* decode queries (q_dec) */
};

struct kvcap_dataset_writer;

void kvcap_dataset_writer_default_params(struct kvcap_dataset_writer_params *p);

/* Numbering continues after the highest existing PREFIX-NNNNN shard in the folder, so repeated
 * recordings into one folder add to the dataset. */
enum kvcap_status kvcap_dataset_writer_create(const struct kvcap_model_geometry *g,
                                              const struct kvcap_dataset_writer_params *p,
                                              struct kvcap_dataset_writer **out);

/* A span is built by begin, set_kv for every layer, any number of add_queries, then end. */
enum kvcap_status kvcap_dataset_writer_begin_span(struct kvcap_dataset_writer *w, int rows,
                                                  int cols, int p0);
/* k, v: [kv_heads][rows*cols][head_dim] f32, copied. */
enum kvcap_status kvcap_dataset_writer_set_kv(struct kvcap_dataset_writer *w, int layer,
                                              const float *k, const float *v);
/* q: [q_heads][count][head_dim] f32, appended after earlier queries of the same kind/layer. */
enum kvcap_status kvcap_dataset_writer_add_queries(struct kvcap_dataset_writer *w, int layer,
                                                   enum kvcap_query_kind kind, const float *q,
                                                   int count);
/* Checks the span is complete (all layers; queries on all layers alike or on none) and queues
 * it; writes a shard when the queue reaches shard_bytes. */
enum kvcap_status kvcap_dataset_writer_end_span(struct kvcap_dataset_writer *w);
/* Drops the open span, if any (a caller that failed half-way through building it). */
void kvcap_dataset_writer_cancel_span(struct kvcap_dataset_writer *w);
/* Writes the queued spans (if any) as a last shard. The writer stays usable. */
enum kvcap_status kvcap_dataset_writer_flush(struct kvcap_dataset_writer *w);
/* Removes the shards this writer has written and drops what it holds, for a run that failed
 * and must leave no partial dataset behind; shards that were in the folder before stay. A shard
 * that cannot be removed is logged as a warning naming it (the caller's error stays the one
 * kvcap_last_error reports). NULL is a no-op. */
void kvcap_dataset_writer_discard(struct kvcap_dataset_writer *w);
/* Spans and shards written so far. */
void kvcap_dataset_writer_counts(const struct kvcap_dataset_writer *w, int64_t *spans,
                                 int *shards);
/* NULL is a no-op. Queued spans that were not flushed are discarded (nothing half-written). */
void kvcap_dataset_writer_free(struct kvcap_dataset_writer *w);

/* ---- Reader ----------------------------------------------------------------------------- */
struct kvcap_dataset;

/* One span, valid until the next kvcap_dataset_next call or kvcap_dataset_close. Tensors are
 * zero-copy views in the shard's dtype; q_post/q_dec entries are NULL when absent. */
struct kvcap_span_view {
    const char *shard;   /* path of the shard it comes from */
    int index;           /* index inside the shard */
    int64_t ordinal;     /* 0-based position in the whole dataset */
    int rows, cols, p0, n;
    const struct kvst_tensor **k, **v, **q_post, **q_dec; /* [n_layers] each */
};

/* Each path is a shard file or a folder (its *.safetensors files, sorted by name). Every shard
 * is validated up front (schema, geometry agreeing across shards); only one shard is mapped at
 * a time while iterating. An empty dataset (no shard or no span) is KVCAP_ERR_INVALID_ARGUMENT. */
enum kvcap_status kvcap_dataset_open(const char *const *paths, int n_paths,
                                     struct kvcap_dataset **out);
void kvcap_dataset_close(struct kvcap_dataset *ds); /* NULL is a no-op */

const struct kvcap_model_geometry *kvcap_dataset_geometry(const struct kvcap_dataset *ds);
int64_t kvcap_dataset_span_count(const struct kvcap_dataset *ds);
int kvcap_dataset_shard_count(const struct kvcap_dataset *ds);

/* Restarts iteration at the first span. */
void kvcap_dataset_rewind(struct kvcap_dataset *ds);
/* Next span in *span, or *span = NULL at the end (status KVCAP_OK). */
enum kvcap_status kvcap_dataset_next(struct kvcap_dataset *ds, const struct kvcap_span_view **span);

#endif
