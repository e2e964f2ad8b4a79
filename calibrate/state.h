/* state.h — a calibration state in memory (formats/SPEC.md §4.2): per (layer, KV head, bucket)
 * the raw Gram sums (mergeable across runs), the fitted value basis and key maps, and
 * validation metrics; plus the settings they were fitted with. Read, merged, refitted and
 * written by kvcap-calibrate and kvcap-convert. */
#ifndef KVCAP_STATE_H
#define KVCAP_STATE_H

#include <stdint.h>

#include "configs/config.h"
#include "calibrate/calib_cuda.h"
#include "calibrate/keys.h"
#include "formats/schema.h"

/* Validation metrics, in this order in the `metrics` tensor (names in calib.metrics). NaN
 * where not measurable (no validation span, no decode query). */
enum kvcap_metric {
    KVCAP_METRIC_V_EXPLAINED = 0, /* 1 − ‖Vc − UᵀU Vc‖² / ‖Vc‖² at R_v */
    KVCAP_METRIC_V_COS,           /* cosine of V̂ and V (flattened, per span, mean) */
    KVCAP_METRIC_V_REL,           /* ‖V̂ − V‖ / ‖V‖ over all validation spans */
    KVCAP_METRIC_K_COS,           /* cosine of K̂' and K' */
    KVCAP_METRIC_K_REL,           /* ‖K̂' − K'‖ / ‖K'‖ */
    KVCAP_METRIC_ATTN_COS,        /* cosine of the attention output (decode queries) vs full */
    KVCAP_METRIC_ATTN_REL,        /* ‖ô − o‖ / ‖o‖ */
    KVCAP_METRIC_COUNT
};
const char *kvcap_metric_name(enum kvcap_metric m);

struct kvcap_calib_unit {
    int m;                    /* points: n (dense) or tile size (tiled) */
    double *v_gram, *k_gram;  /* [m][m], raw sums over training samples */
    double *v_eigval;         /* [m] descending, NULL until fitted */
    float *v_eigvec;          /* [m][m], row i = eigenvector i, NULL until fitted */
    int has_keys;
    struct kvcap_key_maps keys; /* fitted for rk = R_k of the layer's key ratio */
    double metrics[KVCAP_METRIC_COUNT];
};

struct kvcap_calib_state {
    struct kvcap_model_geometry model;
    int n_buckets;
    struct kvcap_bucket buckets[KVCAP_MAX_BUCKETS];
    int64_t train_spans[KVCAP_MAX_BUCKETS], val_spans[KVCAP_MAX_BUCKETS];
    /* settings of the fit */
    double *r_keys, *r_values;   /* [n_layers] */
    enum kvcap_key_method key_method;
    enum kvcap_activation activation; /* of the fitted key maps */
    int hidden;                  /* configured h (0: h = R_k) */
    double ridge;
    enum kvcap_dtype storage;    /* default storage for kvcap-convert */
    struct kvcap_calib_unit *units; /* [n_layers][n_kv_heads][n_buckets] */
    char *data_note;             /* provenance: the inputs, free text (may be NULL) */
};

/* Index of unit (l, h, b). */
static inline struct kvcap_calib_unit *kvcap_state_unit(const struct kvcap_calib_state *s, int l,
                                                       int h, int b)
{
    return &s->units[((size_t)l * s->model.n_kv_heads + (size_t)h) * s->n_buckets + (size_t)b];
}

/* R for a ratio r over m points: round(r·m), at least 1, at most m. */
int kvcap_retained(double r, int m);
/* KVCAP_ERR_INVALID_ARGUMENT naming "keys" or "values", the layer and the bucket when a ratio
 * of the state's schedules keeps no point of some bucket (round(r·m) = 0): kvcap_retained
 * would keep one, and the retention reported would not be what the artifact holds. */
enum kvcap_status kvcap_calib_state_check_ratios(const struct kvcap_calib_state *s);

/* Creates an empty state (zero Grams, no fit) for cfg's model, buckets and settings. */
enum kvcap_status kvcap_calib_state_init(struct kvcap_calib_state *s,
                                         const struct kvcap_calib_config *cfg);
void kvcap_calib_state_free(struct kvcap_calib_state *s); /* NULL-safe */

/* Writes `s` atomically to `path` (kind calib). `config_echo` (may be NULL) is stored as the
 * calibration config used. */
enum kvcap_status kvcap_calib_state_write(const struct kvcap_calib_state *s, const char *path);
/* Reads a .kvcs (validated) into `s` (Grams copied, fitted parts when present). */
enum kvcap_status kvcap_calib_state_read(const char *path, struct kvcap_calib_state *s);

/* dst += src: same model and buckets required (KVCAP_ERR_GEOMETRY naming the difference);
 * Grams and span counts are added; fitted parts and metrics of dst are dropped (refit). */
enum kvcap_status kvcap_calib_state_merge(struct kvcap_calib_state *dst,
                                          const struct kvcap_calib_state *src,
                                          const char *src_label);

/* Fits every unit from its Grams: value eigen-decomposition, and closed-form key maps for the
 * state's key ratios (units whose key maps are present and of the right size are kept unless
 * `refit_keys`). `device` says where the value eigen-decompositions run: CPU (LAPACK, units in
 * parallel, one BLAS thread each) or CUDA (cuSOLVER, one handle and workspace for all units,
 * the host's post-processing of one unit overlapping the device's solve of the next); AUTO is
 * resolved by kvcap_calib_device_resolve, and falls back to the CPU with a warning if the
 * device cannot be set up; CUDA without a device is KVCAP_ERR_UNSUPPORTED. Closed-form keys
 * always run on the CPU, units in parallel (OpenMP). `progress` is called after each of the
 * two phases. */
struct kvcap_fit_timing {
    double values_seconds, keys_seconds; /* wall time of each phase (units run in parallel) */
    int value_fits, key_fits;            /* units visited by each phase */
    enum kvcap_calib_device values_device; /* where the value PCA ran: CPU or CUDA */
};
enum kvcap_status kvcap_calib_state_fit(struct kvcap_calib_state *s, int refit_keys,
                                        enum kvcap_calib_device device,
                                        struct kvcap_fit_timing *timing,
                                        int (*progress)(int64_t, int64_t, void *), void *user);

#endif
