/* artifact.h — a loaded compressor artifact: per (layer, KV head, bucket) the KVCapsule maps in
 * f32, ready for prefill (mask, W1, b1, U) and decode (W2, b2, U). */
#ifndef KVCAP_ARTIFACT_H
#define KVCAP_ARTIFACT_H

#include <stdatomic.h>

#include "kvcap.h"
#include "formats/schema.h"

struct kvcap_unit_maps {
    int m, rk, h, rv, gelu;
    int32_t *mask; /* [rk] */
    float *w1;     /* [rk][h] */
    float *b1;     /* [h] */
    float *w2;     /* [h][m] */
    float *b2;     /* [m] */
    float *u;      /* [rv][m] */
};

struct kvcap_artifact {
    /* Holders: the opener (until kvcap_artifact_free) and every cache created with it (until
     * kvcap_cache_free). The maps go with the last. The only field that changes after open,
     * so a `const struct kvcap_artifact *` may still be held and let go. */
    atomic_int holders;
    struct kvcap_model_geometry model;
    int n_buckets;
    struct kvcap_bucket buckets[KVCAP_MAX_BUCKETS];
    enum kvcap_policy fallback;
    struct kvcap_unit_maps *units; /* [layers][kv_heads][buckets] */
    uint64_t map_bytes;            /* f32 bytes of all maps */
};

static inline const struct kvcap_unit_maps *kvcap_artifact_unit(const struct kvcap_artifact *a,
                                                               int l, int h, int b)
{
    return &a->units[((size_t)l * a->model.n_kv_heads + (size_t)h) * a->n_buckets + (size_t)b];
}

/* A cache holds the artifact it was created with (kvcap_cache_create), and lets it go when it
 * is freed: the artifact outlives every cache that uses it, whenever its opener frees it. */
void kvcap_artifact_hold(const struct kvcap_artifact *a);
void kvcap_artifact_let_go(const struct kvcap_artifact *a);

/* Everything of an artifact besides its maps (formats/SPEC.md §4.3). */
struct kvcap_artifact_desc {
    struct kvcap_model_geometry model;
    int n_buckets;
    const struct kvcap_bucket *buckets;
    enum kvcap_dtype storage;          /* F32, F16 or BF16 */
    int activation_gelu;               /* default φ; each unit also records its own (k_act) */
    enum kvcap_policy fallback;
    const double *r_keys, *r_values;   /* [layers] */
    const int64_t (*calibration_spans)[2]; /* optional: [train, validation] per bucket */
    const cJSON *provenance;           /* optional, copied */
};

/* Writes an artifact atomically: units [layers][kv_heads][buckets] hold the maps in f32 (the
 * arrays are only read; u may have more than rv rows), stored in desc->storage. */
enum kvcap_status kvcap_artifact_write(const char *path, const struct kvcap_artifact_desc *desc,
                                       const struct kvcap_unit_maps *units);

/* Index of the bucket for a grid, or -1. With several buckets of that grid (dense and tiled),
 * the one with the fewest map bytes per step is preferred: tiled. */
int kvcap_artifact_find_bucket(const struct kvcap_artifact *a, int rows, int cols);

#endif
