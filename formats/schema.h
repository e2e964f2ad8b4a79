/* schema.h — the kvcap schema on top of safetensors (formats/SPEC.md §2–6): what a dataset, a
 * calibration state and an artifact must contain, checked on open; and the helpers writers use
 * to emit the same metadata. Internal to kvcap. */
#ifndef KVCAP_SCHEMA_H
#define KVCAP_SCHEMA_H

#include <cjson/cJSON.h>

#include "configs/config.h"
#include "kvcap.h"
#include "formats/safetensors.h"

/* Newest layout of each kind this build reads and writes (SPEC §6). */
#define KVCAP_FORMAT_VERSION_DATASET 1
#define KVCAP_FORMAT_VERSION_CALIB 1
#define KVCAP_FORMAT_VERSION_ARTIFACT 1

#define KVCAP_MAX_BUCKETS 16

enum kvcap_file_kind {
    KVCAP_KIND_DATASET = 0,
    KVCAP_KIND_CALIB = 1,
    KVCAP_KIND_ARTIFACT = 2,
    KVCAP_KIND_ANY = 3 /* as an expectation: accept whichever kind the file declares */
};

const char *kvcap_file_kind_name(enum kvcap_file_kind kind); /* "dataset", ... */

/* calib.fit of a calibration state (SPEC §4.2): how its key maps were fitted. */
struct kvcap_calib_fit_info {
    enum kvcap_key_method key_method;
    enum kvcap_activation activation;
    int hidden;   /* reconstructor width h, 0..65536; 0 means h = R_k */
    double ridge; /* finite, >= 0 */
};

/* What the schema check learnt about a file. Owns `config` and the schedule arrays; release
 * with kvcap_file_info_free. */
struct kvcap_file_info {
    enum kvcap_file_kind kind;
    int format_version;
    struct kvcap_model_geometry model;
    cJSON *config;            /* the parsed kvcap.config document */
    int n_buckets;            /* calib, artifact */
    struct kvcap_bucket buckets[KVCAP_MAX_BUCKETS];
    int n_spans;              /* dataset: spans in this shard */
    enum kvcap_dtype storage; /* artifact: dtype of the float maps; calib: calib.fit.storage,
                               * the dtype kvcap-convert stores them in by default */
    int activation_gelu;      /* artifact: 1 = GELU, 0 = linear */
    enum kvcap_policy fallback;
    double *schedule_keys;    /* artifact: n_layers ratios; calib: calib.fit.schedule.keys */
    double *schedule_values;  /* artifact: n_layers ratios; calib: calib.fit.schedule.values */
    int64_t calib_spans[KVCAP_MAX_BUCKETS][2]; /* calib: [training, validation] per bucket */
    struct kvcap_calib_fit_info fit;           /* calib */
};

/* Validates `f` against the schema of `expected` (or of the kind it declares, for
 * KVCAP_KIND_ANY) and fills `info` (zeroed first; freed by the caller also on failure).
 * This is the one validator of kvcap files: everything a later consumer of the file (the
 * runtime, kvcap-convert) would refuse is refused here, so kvcap_artifact_open, the state
 * reader and `kvcap-convert --inspect` accept exactly the same files.
 * Errors: KVCAP_ERR_FORMAT / KVCAP_ERR_VERSION / KVCAP_ERR_GEOMETRY naming file and field;
 * KVCAP_ERR_NUMERIC naming the tensor and element for a NaN or infinity in an artifact's maps
 * or a calibration state's sums and fitted maps. */
enum kvcap_status kvcap_schema_check(const struct kvst_file *f, enum kvcap_file_kind expected,
                                     struct kvcap_file_info *info);

void kvcap_file_info_free(struct kvcap_file_info *info); /* NULL is a no-op */

/* Points of a kvcap tensor: the m of SPEC §4.2/4.3 (n for dense, tile size for tiled). */
int kvcap_bucket_points(const struct kvcap_bucket *b);

/* ---- JSON <-> structs, shared by every writer and reader -------------------------------- */
cJSON *kvcap_geometry_to_json(const struct kvcap_model_geometry *g);
/* `where` prefixes error messages (usually the file name). */
enum kvcap_status kvcap_geometry_from_json(const cJSON *model, const char *where,
                                           struct kvcap_model_geometry *g);
cJSON *kvcap_buckets_to_json(const struct kvcap_bucket *b, int n);
enum kvcap_status kvcap_buckets_from_json(const cJSON *arr, const char *where,
                                          struct kvcap_bucket *b, int *n);

/* Sets kvcap.kind, kvcap.format_version (the newest) and kvcap.config (printed from
 * `config`, which stays owned by the caller) on a writer. */
enum kvcap_status kvcap_schema_set_meta(struct kvst_writer *w, enum kvcap_file_kind kind,
                                        const cJSON *config);

#endif /* KVCAP_SCHEMA_H */
