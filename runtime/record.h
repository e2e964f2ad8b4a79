/* record.h — record mode (record.c): a cache created with params.record_dir writes the vision
 * spans it sees, with the post-vision and decode queries, as calibration datasets
 * (formats/dataset.h) once each sequence's prefill has ended. */
#ifndef KVCAP_RECORD_H
#define KVCAP_RECORD_H

#include "kvcap.h"

struct kvcap_recorder;

enum kvcap_status kvcap_recorder_create(const struct kvcap_model_geometry *g, int n_seqs,
                                        const char *dir, struct kvcap_recorder **out);
void kvcap_recorder_free(struct kvcap_recorder *r); /* writes pending spans first */
/* Span number `index` of `seq` (its position among the sequence's spans, as the cache counts
 * them) at `layer`. Refuses a grid the dataset format cannot hold (kvcap_dataset_check_grid). */
enum kvcap_status kvcap_recorder_span(struct kvcap_recorder *r, int seq, int layer, int index,
                                      const struct kvcap_span_desc *span,
                                      const struct kvcap_tensor_view *k,
                                      const struct kvcap_tensor_view *v);
enum kvcap_status kvcap_recorder_post_queries(struct kvcap_recorder *r, int seq, int layer,
                                              const float *q, int n);
enum kvcap_status kvcap_recorder_decode_queries(struct kvcap_recorder *r, int layer,
                                                const float *q);
/* The prefill of `seq` ended (kvcap_cache_end_prefill succeeded): its spans are complete and
 * may be written. */
void kvcap_recorder_end_prefill(struct kvcap_recorder *r, int seq);
/* Writes the spans of every sequence whose prefill has ended; keeps the others. */
enum kvcap_status kvcap_recorder_flush(struct kvcap_recorder *r);

#endif /* KVCAP_RECORD_H */
