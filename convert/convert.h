/* convert.h — kvcap_convert(): calibration states in, a deployable artifact out. */
#ifndef KVCAP_CONVERT_H
#define KVCAP_CONVERT_H

#include "configs/config.h"
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

struct kvcap_convert_report {
    int keys_refit;        /* key maps refitted in closed form (merge or new key schedule) */
    int trained_discarded; /* trained key maps could not be kept */
    double mean_r_keys, mean_r_values;
    uint64_t artifact_bytes;
};

/* Merges the states (Gram sums and counts, then a refit), applies the schedules and storage,
 * writes the artifact atomically and validates it by reading it back. On failure nothing is
 * left at o->out. */
enum kvcap_status kvcap_convert(const struct kvcap_convert_options *o,
                                struct kvcap_convert_report *report);

#endif
