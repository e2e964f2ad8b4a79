/* convert.h — kvcap_convert(): calibration states in, a deployable artifact out. */
#ifndef KVCAP_CONVERT_H
#define KVCAP_CONVERT_H

#include "configs/config.h"
#include "formats/schema.h"
#include "kvcap.h"

struct kvcap_convert_options {
    const char *const *states; /* one or more .kvcs files of the same model and buckets */
    int n_states;
    const char *out;           /* the artifact to write */
    int storage_set;           /* else the calibration's storage */
    enum kvcap_dtype storage;  /* F32, F16 or BF16 */
    int keys_set, values_set;  /* else the schedules the states were fitted with */
    struct kvcap_schedule keys, values; /* borrowed */
    enum kvcap_policy fallback; /* for spans without a bucket, default flashcache */
    int dct_values;             /* value bases: the 2-D DCT low-pass of each bucket's grid (its
                                 * tile for tiled maps) instead of the calibrated eigenvectors */
};

void kvcap_convert_default_options(struct kvcap_convert_options *o);

/* Below this share of the variance that a value basis can add over random directions,
 * (kept − chance) / (1 − chance), kvcap-convert warns that the spans hold little for it. In
 * kvcap-eval's demo, at rank 6 of 16 (retention 0.4, random directions keep 37.5 %), the
 * calibrated tiled basis keeps 49.7 % of the text spans' values, where KVCapsule loses to
 * random eviction (0.20 of what it could add), and 82.6 % of the photos' (0.72). */
#define KVCAP_VALUE_STRUCTURE_WARN (1.0 / 3.0)

struct kvcap_convert_report {
    int keys_refit;        /* key maps refitted in closed form (merge or new key schedule) */
    int trained_discarded; /* trained key maps could not be kept */
    double mean_r_keys, mean_r_values;
    uint64_t artifact_bytes;
    /* Per bucket, the mean over layers and KV heads of the share of the calibration values'
     * (centred) variance the artifact's value basis keeps at its ranks, and of the share R_v/m
     * that as many random directions would keep on average. Measured on the training spans'
     * Gram: a calibrated basis fitted to few spans keeps more of them than of new ones. */
    int n_buckets;
    struct kvcap_bucket buckets[KVCAP_MAX_BUCKETS];
    double value_kept[KVCAP_MAX_BUCKETS], value_chance[KVCAP_MAX_BUCKETS];
};

/* Merges the states (Gram sums and counts, then a refit), applies the schedules and storage,
 * writes the artifact atomically and validates it by reading it back. On failure nothing is
 * left at o->out. */
enum kvcap_status kvcap_convert(const struct kvcap_convert_options *o,
                                struct kvcap_convert_report *report);

#endif
