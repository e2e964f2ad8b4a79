/* calibrate.h — kvcap_calibrate(): the library function under kvcap-calibrate. */
#ifndef KVCAP_CALIBRATE_H
#define KVCAP_CALIBRATE_H

#include <stdint.h>

#include "configs/config.h"
#include "formats/dataset.h"
#include "calibrate/state.h"
#include "calibrate/synth.h" /* kvcap_progress_fn */

struct kvcap_calibrate_options {
    const char *const *data; /* dataset shards or folders */
    int n_data;
    int skip_unmatched;      /* spans whose grid matches no bucket: skip instead of failing */
    int max_train_spans;     /* trained path: training spans kept in memory per bucket (64) */
    int max_val_spans;       /* trained path: validation spans used for checkpoints (32) */
    /* Progress: phase names "accumulate", "fit", "train", "validate"; called often. */
    void (*progress)(const char *phase, int64_t done, int64_t total, void *user);
    void *user;
    /* Where the Grams are accumulated, the value PCA runs and the key maps are trained
     * (keys.method trained; calib_cuda.h). AUTO (the default): CUDA when a device is visible, else
     * the CPU, and the CPU with a warning if the device cannot be set up (e.g. the Grams, or
     * a unit's training columns, do not fit in its memory); CUDA: the device or
     * KVCAP_ERR_UNSUPPORTED / the setup's error. Loading and preprocessing the spans,
     * closed-form keys and validation run on the CPU either way. */
    enum kvcap_calib_device device;
};

void kvcap_calibrate_default_options(struct kvcap_calibrate_options *o);

/* What a run saw, for the tools' summaries. */
struct kvcap_calibrate_report {
    int64_t spans_seen, spans_skipped;
    double seconds_accumulate, seconds_fit, seconds_train, seconds_validate;
    struct kvcap_fit_timing fit;  /* the fit phase split into value PCA and closed-form keys */
    double gram_flops; /* flops of the Gram accumulation (2 · m² · columns per Gram, syrk) */
    enum kvcap_calib_device device; /* where the Grams were accumulated: CPU or CUDA (the value
                                     * PCA's device is fit.values_device) */
    char device_name[128];          /* the CUDA device's name; "" on the CPU */
    enum kvcap_calib_device train_device; /* where the key maps were trained (keys.method
                                           * trained): CUDA if every unit trained there, else
                                           * CPU; CPU when nothing was trained */
};

/* Streams the dataset, accumulates Grams over the training split, fits value bases and key
 * maps (closed form, then trained if configured), measures validation metrics, and fills
 * `state` (initialised here; the caller frees it). Nothing is written to disk. On CUDA the
 * Grams and the value PCA agree with the CPU's to rounding (double precision throughout); the
 * trained key maps (float, Adam) agree to rounding amplified by the optimiser
 * (tests/test_train_cuda.c states by how much). */
enum kvcap_status kvcap_calibrate(const struct kvcap_calib_config *cfg,
                                  const struct kvcap_calibrate_options *o,
                                  struct kvcap_calib_state *state,
                                  struct kvcap_calibrate_report *report);

/* Validation metrics of a fitted state on the validation split of the dataset (the same
 * content-keyed split as kvcap_calibrate): fills every unit's metrics. */
enum kvcap_status kvcap_calibrate_validate(struct kvcap_calib_state *state,
                                           const struct kvcap_calib_config *cfg,
                                           const struct kvcap_calibrate_options *o);

/* The split: 1 if the span belongs to the validation set. Keyed by the span's content (grid,
 * p0 and the largest-magnitude channel of each of the first 32 rows of its layer-0 keys, head
 * 0: what rounding differences between machines do not change) and the seed, so the same span
 * lands on the same side however the dataset is split into shards or runs, and on whichever
 * machine it was recorded. */
int kvcap_span_is_validation(const struct kvcap_span_view *span, double fraction, uint64_t seed);

#endif
