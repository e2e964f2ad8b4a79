/* config.h — the two YAML configurations of kvcap (libyaml): what kvcap-calibrate fits and what
 * the runtime does with each span kind. Internal to the library and its tools (not installed);
 * the shipped examples next to this file document every key.
 *
 * Ownership: both config structs are plain values the caller allocates (stack or heap). A
 * calibration config owns heap memory only for `list` schedules (kvcap_schedule.ratios); release
 * it with kvcap_calib_config_free(). Copying a config by value shares those arrays, so free only
 * one of the copies. A runtime config holds no heap memory today; call kvcap_runtime_config_free()
 * anyway so a later version may add some. Every free accepts NULL and leaves the config safe to
 * free again.
 *
 * Loading: *_load_file() reads a path, *_load_string() a NUL-terminated text with a `label` used
 * in place of the file name in messages (tools embed default configs this way). The output
 * struct need not be initialised (it is overwritten, not freed: free a loaded calibration config
 * before loading into it again); on success it is complete (defaults filled in, geometry and
 * buckets validated), on failure it holds the defaults and no heap memory. Errors:
 *   KVCAP_ERR_CONFIG  "FILE:LINE:COL: field.path: problem" (1-based, from the offending node:
 *                     the value for bad values, the key for unknown or duplicated keys, the
 *                     mapping for missing required keys), also for YAML syntax errors;
 *   KVCAP_ERR_IO      the file cannot be opened or read;
 *   KVCAP_ERR_OUT_OF_MEMORY, KVCAP_ERR_INVALID_ARGUMENT (NULL pointers).
 * Unknown and duplicated keys are errors; numbers are parsed strictly (no trailing garbage, no
 * inf/nan, no overflow, quoted scalars are strings, not numbers) in the "C" locale whatever the
 * host process set. Loading is thread-safe; messages go through kvcap_fail() (kvcap.h). */
#ifndef KVCAP_CONFIG_H
#define KVCAP_CONFIG_H

#include <stdint.h>

#include "kvcap.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVCAP_CONFIG_MAX_BUCKETS 16
#define KVCAP_CONFIG_MAX_PATH 4096           /* bytes of a path, NUL included */
#define KVCAP_CONFIG_MAX_BYTES (1024 * 1024) /* a config file larger than this is rejected */
/* Every token count of the runtime config (sinks, window, budgets), and every sum of them that
 * sizes one segment (sinks + window), is at most this: such sums and the doubling of a
 * segment's rows then stay far inside an int (configs/runtime.yaml states each bound). */
#define KVCAP_CONFIG_MAX_TOKENS (1 << 30)

/* ---- Retention schedules (DESIGN §4) -------------------------------------------------- */
enum kvcap_schedule_kind {
    KVCAP_SCHEDULE_PYRAMID = 0, /* r_l linear in depth: first at layer 0, last at layer L-1 */
    KVCAP_SCHEDULE_UNIFORM = 1, /* r_l = ratio */
    KVCAP_SCHEDULE_LIST = 2     /* r_l = ratios[l], one entry per layer */
};

/* Every ratio is in (0, 1]. */
struct kvcap_schedule {
    enum kvcap_schedule_kind kind;
    double first, last; /* PYRAMID */
    double ratio;       /* UNIFORM */
    int n_ratios;       /* LIST: == model layers */
    double *ratios;     /* LIST: heap, owned by the enclosing config; NULL otherwise */
};

/* Writes the per-layer ratios of `s` for a model of `n_layers` layers into out[0..n_layers).
 * A one-layer pyramid is `first`. KVCAP_ERR_INVALID_ARGUMENT for a NULL pointer, n_layers < 1,
 * or a list whose length differs from n_layers. */
enum kvcap_status kvcap_schedule_expand(const struct kvcap_schedule *s, int n_layers,
                                        double *out);

/* ---- Calibration config (kvcap-calibrate) --------------------------------------------- */
enum kvcap_key_method {
    KVCAP_KEY_METHOD_CLOSED_FORM = 0, /* pivoted-Cholesky mask + ridge-regularised linear map */
    KVCAP_KEY_METHOD_TRAINED = 1      /* relaxed mask + Adam, initialised from the closed form */
};

enum kvcap_activation {
    KVCAP_ACTIVATION_GELU = 0,  /* phi of the reconstructor's hidden layer (the paper's) */
    KVCAP_ACTIVATION_LINEAR = 1 /* identity: the "linear" variant */
};

/* Names as written in YAML and in kvcap.config JSON ("closed_form", "gelu", "pyramid", ...).
 * Parsers return 1 on success, 0 for an unknown name; *_name return "?" for unknown values. */
int kvcap_key_method_parse(const char *s, enum kvcap_key_method *out);
const char *kvcap_key_method_name(enum kvcap_key_method m);
int kvcap_activation_parse(const char *s, enum kvcap_activation *out);
const char *kvcap_activation_name(enum kvcap_activation a);
int kvcap_schedule_kind_parse(const char *s, enum kvcap_schedule_kind *out);
const char *kvcap_schedule_kind_name(enum kvcap_schedule_kind k);

/* The trained method's optimiser (DESIGN §4, the paper's Algorithm 2). */
struct kvcap_train_config {
    int steps;          /* Adam steps on the relaxed mask, default 300 */
    double lr;          /* Adam learning rate, default 1e-3 */
    double tau_start;   /* mask temperature, annealed from tau_start ... default 1.0 */
    double tau_end;     /* ... to tau_end (0 < tau_end <= tau_start), default 0.05 */
    double lambda_bce;  /* weight of BCE(m), default 0.01 */
    double lambda_r;    /* weight of (mean(m) - r)^2, default 1.0 */
    int finetune_steps; /* steps on W1,b1,W2,b2 with the hard mask, default 100 */
    uint64_t seed;      /* default 0 */
};

struct kvcap_keys_config {
    enum kvcap_key_method method;     /* default closed_form */
    enum kvcap_activation activation; /* default gelu */
    int hidden;                       /* reconstructor width h; 0 (default) means h = R_k */
    double ridge;                     /* lambda regularising C[M,M]^-1, >= 0, default 1e-3 */
    struct kvcap_train_config train;
};

struct kvcap_calib_config {
    struct kvcap_model_geometry model; /* required; validated with kvcap_geometry_validate */
    int n_buckets;                     /* 1..KVCAP_CONFIG_MAX_BUCKETS, all distinct */
    struct kvcap_bucket buckets[KVCAP_CONFIG_MAX_BUCKETS];
    struct kvcap_schedule schedule_keys; /* required (YAML schedule.keys or bare schedule) */
    struct kvcap_schedule schedule_values;
    struct kvcap_keys_config keys;
    double validation_fraction; /* spans held out for validation, in [0, 1), default 0.1 */
    uint64_t validation_seed;   /* seed of the split by span, default 0 */
    enum kvcap_dtype storage;   /* F32, F16 (default) or BF16: dtype of the artifact's maps */
};

/* Defaults for every optional field; model zeroed, no buckets, both schedules uniform 0.4. */
void kvcap_calib_config_default(struct kvcap_calib_config *cfg);
enum kvcap_status kvcap_calib_config_load_file(const char *path, struct kvcap_calib_config *cfg);
enum kvcap_status kvcap_calib_config_load_string(const char *text, const char *label,
                                                 struct kvcap_calib_config *cfg);
void kvcap_calib_config_free(struct kvcap_calib_config *cfg);

/* ---- Runtime config (libkvcap, per-policy parameters) ---------------------------------- */
/* FlashCache (DESIGN §5). */
/* The defaults are the paper's section 3.2 (gamma 0.2, the best of its Table 5 ablation; no
 * protected tokens, no per-layer floor); sinks, window and min_tokens are kvcap's extension
 * (the `flashcache+protect` preset of configs/runtime-protected.yaml). */
struct kvcap_flashcache_config {
    double gamma;     /* low-pass fraction of DCT coefficients, (0, 1], default 0.2 */
    double retention; /* global retention rho (kept / span tokens, protected ones
                       * included), (0, 1], default 0.4 */
    int min_tokens;   /* per-layer budget floor in tokens, default 0 */
    int sinks;        /* first tokens always kept, default 0 */
    int window;       /* most recent tokens always kept, default 0 */
};

/* VL-Cache (DESIGN §6). */
struct kvcap_vlcache_config {
    double p;            /* sparsity threshold relative to the row max, (0, 1), default 0.01 */
    double budget;       /* global budget alpha (mean kept fraction of a span over
                          * layers, protected tokens included), (0, 1], default 0.4 */
    double min_fraction; /* lower clip of beta_l, (0, 1], default 0.01 */
    double recent_fraction; /* the paper's recent window (its section 5): this fraction of a
                             * layer's budget goes to the last tokens of the prompt, which
                             * may lie after the span; [0, 1], default 0.1 */
    int sinks;           /* first tokens of the span always kept (kvcap's extension),
                          * default 0 */
    int window;          /* last tokens of the span always kept (kvcap's extension),
                          * default 0 */
    int uniform_layers;  /* `layer_budgets: uniform` (1, kvcap's variant): every layer keeps
                          * alpha of the span; `sparsity` (0, default): Algorithm 1's budgets */
};

/* FreeKV (DESIGN §7). budget >= (sink_pages + window_pages + 1) * page_size. */
struct kvcap_freekv_config {
    int page_size;    /* tokens per page, 1..65536, default 32 */
    int budget;       /* device-side tokens per KV head, default 2048 */
    double tau;       /* correction threshold on the query cosine, [-1, 1], default 0.9;
                       * 1: every step corrects, -1: none does */
    int sink_pages;   /* default 1 */
    int window_pages; /* >= 1, default 2 */
};

/* StreamingLLM. */
struct kvcap_streaming_config {
    int sinks;  /* default 4 */
    int window; /* >= 1, default 1024 */
};

/* kvzip (arXiv 2505.23416): the span keeps `retention` of its tokens over all layers and KV heads
 * together, `sinks` first and `window` last tokens of every head always among them. With
 * `safeguard` > 0 (kvcap's variant: Ada-KV's safeguard, arXiv 2407.11550) every head first keeps
 * its best tokens up to that share of an even split (retention × the span's tokens), then the
 * rest of the budget is shared. With `values: basis` (kvcap's variant) a vision span with a
 * bucket in the artifact keeps its values as KVCapsule's value state (Ṽ and μ, through the
 * artifact's value basis) instead of one row per kept token, and spends the bytes this saves on
 * more keys: `retention` is then of the span's bytes, not of its tokens. */
struct kvcap_kvzip_config {
    double retention;  /* (0, 1], default 0.4 */
    int sinks, window; /* default 0 */
    double safeguard;  /* [0, 1], default 0: KVzip's rule */
    int value_basis;   /* `values: basis` (1) or `rows` (0, default: KVzip's) */
    int exact_values;  /* with values: basis, per layer and KV head, the kept tokens whose values
                        * the basis reconstructs worst that keep their value exactly (an image's
                        * attention-sink patches), counted in the budget; default 0 */
};

/* random: each KV head of each layer keeps `retention` of the span's tokens (sinks and window
 * included) drawn uniformly, from `seed`, the layer and the head. */
struct kvcap_random_config {
    double retention; /* (0, 1], default 0.4 */
    int sinks, window; /* default 0 */
    int64_t seed;      /* default 0 */
};

/* expected_attention (arXiv 2510.00636, kvpress's ExpectedAttentionPress): each KV head keeps
 * `retention` of the span's tokens (sinks and window included) by the expected attention of the
 * prompt's query statistics rotated over the next `n_future` positions, times value norms. */
struct kvcap_expected_config {
    double retention; /* (0, 1], default 0.4 */
    int n_future;     /* >= 1, default 512 */
    int query_sinks;  /* the first prompt tokens whose queries are left out of the statistics
                       * (attention-sink outliers), default 4 */
    int sinks, window; /* default 0 */
};

/* kvcapsule: the compressors live in the artifact; the runtime adds kvcap's exact tiles. */
struct kvcap_kvcapsule_config {
    int exact_tiles; /* tiles of every span and KV head kept as plain rows, not compressed: the
                      * ones KVCapsule reconstructs worst (kvcap_capsule_tile_error), e.g. the
                      * tiles holding an image's attention-sink patches; default 0 */
};

#define KVCAP_FALLBACK_NONE ((enum kvcap_policy)-1)

struct kvcap_runtime_config {
    /* Path of the compressor artifact, "" for none. A relative path in a file is resolved
     * against the directory of that file; from a string it is kept as written. */
    char artifact[KVCAP_CONFIG_MAX_PATH];
    /* Policy per span kind, indexed by enum kvcap_span_kind. Defaults: vision kvcapsule when
     * an artifact is configured and flashcache otherwise; text and generated full. kvcapsule
     * needs an artifact and applies to vision spans only. */
    enum kvcap_policy policy[3];
    /* Policy for vision spans whose grid has no bucket in the artifact; not kvcapsule.
     * Default flashcache (DESIGN §3). KVCAP_FALLBACK_NONE (`fallback: none`): such a span is
     * an error (KVCAP_ERR_NOT_FOUND). */
    enum kvcap_policy fallback;
    struct kvcap_flashcache_config flashcache;
    struct kvcap_vlcache_config vlcache;
    struct kvcap_freekv_config freekv;
    struct kvcap_streaming_config streaming;
    struct kvcap_kvzip_config kvzip;
    struct kvcap_random_config random;
    struct kvcap_expected_config expected;
    struct kvcap_kvcapsule_config kvcapsule;
    int has_model;                     /* 1 when the optional `model:` section was given */
    struct kvcap_model_geometry model; /* validated like the calibration config's */
};

void kvcap_runtime_config_default(struct kvcap_runtime_config *cfg);
enum kvcap_status kvcap_runtime_config_load_file(const char *path,
                                                 struct kvcap_runtime_config *cfg);
enum kvcap_status kvcap_runtime_config_load_string(const char *text, const char *label,
                                                   struct kvcap_runtime_config *cfg);
void kvcap_runtime_config_free(struct kvcap_runtime_config *cfg);

#ifdef __cplusplus
}
#endif

#endif /* KVCAP_CONFIG_H */
