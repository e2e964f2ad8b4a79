/* report.c — validates kvcap-eval's metrics.json (format 1, see report.h) and renders it as a
 * CSV table and a self-contained HTML page whose figures are inline SVG drawn here. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/internal.h"
#include "report/report.h"

/* Bounds that keep a hostile file from asking for absurd allocations or drawings. */
enum {
    MAX_FILE_BYTES = 1 << 30,
    MAX_LAYERS = 4096,
    MAX_MASK_TOKENS = 1 << 20,
    MAX_MASK_HEADS = 4096,
    MAX_MASK_CELLS = 1 << 26, /* layers * tokens of one bucket */
    MAX_DEPTHS = 64          /* task depth bins */
};

/* ---- The metrics, validated ---------------------------------------------------------------- */

/* Every optional number is NaN when absent or null. Strings point into the cJSON tree. */
struct run {
    const char *id, *policy, *label;
    const char *sample; /* generated text of prompt 0, or NULL */
    int extension;      /* kvcap's own variant, not a paper's method */
    double retention;   /* the target */
    double nominal, realised, kl;
    double compression, token_agreement, next_token_agreement, first_divergence_mean;
    double nll, nll_full, nll_delta, cos_mean, rel_mean;
    double bytes_held, bytes_held_full, bytes_held_span, bytes_read, bytes_read_full;
    double step_ms, step_ms_full;
    double prefill_cost;                  /* compression work over the prefill; NaN: absent */
    double task_accuracy, task_agreement; /* NaN without "task" */
    double *task_depth;                   /* accuracy per depth bin (NaN: none), or NULL */
    int n_task_depth;
    int has_freekv;
    double fk_head_steps, fk_corrected, fk_reselected, fk_hidden, fk_pages;
    double *rel; /* per layer, n_layers entries, or NULL */
    int curve;   /* index into report.curves */
    double *pp_dnll, *pp_kl; /* per prompt (the paired intervals), n_pp entries, or NULL */
    int n_pp;
    int shipped;             /* the row chosen in advance (kvcap-eval --shipped) */
    double held;             /* span bytes held over full's (FreeKV: more than it reads) */
    int n_seeds;             /* random eviction: its row is the mean of this many seeds */
    double seed_kl_min, seed_kl_max; /* their mean KLs' range */
};

/* Runs sharing a label form one curve; a curve holding a "full" run is the reference. Papers'
 * methods come before kvcap's extensions; an extension drawn as a variant of a paper's curve
 * (the only extension of that policy, e.g. flashcache+protect) shares its colour and shape with
 * hollow markers. */
struct curve {
    const char *label, *policy;
    int reference, extension;
    const char *color;
    int marker;
};

/* The kept tokens as the file lists them, without repeats within one (layer, head): layer l's
 * are tok[layer_at[l] .. layer_at[l + 1]), head after head, so a token kept by k heads of a
 * layer is there k times. Held sparse, the mask costs memory and drawing time in proportion to
 * what the file lists, not to the layers x tokens it declares (a 500-byte mask may declare
 * 2^20 tokens). */
struct mask {
    const char *bucket;
    int n_tokens, heads;
    int *tok;
    size_t *layer_at; /* n_layers + 1 entries */
    size_t n_kept;    /* layer_at[n_layers]: the (layer, head, token) triples kept */
    int rows, cols;    /* the image's grid (rows * cols == n_tokens), 0 without a thumbnail */
    const char *thumb; /* data:image/bmp;base64,... of a held-out photo crop, or NULL */
};

struct goal {
    const char *text;
    int met;
};

/* An outside reference measured on the same prompts (scripts/kvpress-reference.sh writes
 * kvpress.json beside metrics.json): one row per press and retention. */
struct outside_row {
    const char *press;
    double retention, realised, dnll, kl, agreement;
    double *pp_dnll, *pp_kl; /* per prompt, n_pp entries, or NULL */
    int n_pp;
};

struct outside {
    const char *version, *transformers; /* kvpress's and transformers' versions */
    struct outside_row *rows;
    int n_rows;
    const char *mismatch; /* why the file's rows are not shown (another run's), or NULL */
    char why[768];        /* the mismatch, when it names values */
    const char *hash;     /* shown: its prompts_sha256, this run's too */
    double full_nll, full_nll_here; /* shown: its full-cache NLL, this run's */
};

struct report {
    const char *path; /* the metrics file, first in every message */
    cJSON *root;
    const char *title, *command, *created;
    const char *model_name, *model_file;
    double q_heads, kv_heads, head_dim;
    int n_layers; /* model.layers, 0 when absent */
    const char *corpus_source, *storage;
    const char *prompt_sample; /* the tail of prompt 0's text, or NULL */
    const cJSON *calibration_files, *heldout_files;
    const cJSON *notes; /* array of strings, or NULL */
    double calibration_tokens, heldout_tokens;
    double head_tokens, span_tokens, tail_tokens, generate_tokens, continuation_tokens;
    double fidelity_steps, prompts, threads;
    double read_bandwidth_gbs;
    int has_task; /* the top-level "task" object is present */
    const char *task_name, *task_line, *task_question, *task_haystack;
    double task_queries, task_answer_tokens;
    double *task_depths; /* mean depth per bin, or NULL */
    int n_depths;
    struct run *runs;
    const struct run **sorted; /* reference curves first, then papers' methods, then kvcap's
                                * extensions, each by label, then by retention */
    int n_runs;
    struct curve *curves;
    int n_curves;
    struct mask *masks;
    int n_masks;
    struct goal *goals;
    int n_goals;
    cJSON *outside_root; /* kvpress.json beside the metrics, parsed; NULL when absent */
    char outside_path[4200];
    struct outside outside;
    /* "track": what the span holds; image is a photo crop's features on its grid */
    int image;
    int calibration_photos; /* track.photos_split "calibration": the prompts show those photos */
    const char *split;      /* setup.split: calibration, development or test; NULL: unsaid */
    const char *shipped;    /* setup.shipped: the label of the row chosen in advance, or NULL */
    const cJSON *unreached; /* targets a policy could not be run at, or NULL */
    double grid_rows, grid_cols, photos, heldout_photos, heldout_crops, calibration_crops;
    const char *features;
    /* other tracks shown side by side (kvcap_report_write_tracks), NULL-terminated */
    const struct report *const *others;
};

static const char *const POLICIES[] = {"full",   "streaming",   "kvcapsule", "flashcache",
                                       "vlcache", "freekv",      "kvzip",     "random",
                                       "expected_attention", "composition"};

/* Okabe–Ito first (distinguishable with the common colour-vision deficiencies), then Tableau;
 * the reference curve is drawn in near-black. */
static const char *const PALETTE[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00",
                                      "#56B4E9", "#8C6D31", "#7F7F7F", "#B07AA1", "#F0A3B1"};
static const char REFERENCE_COLOR[] = "#222222";
enum { N_PALETTE = sizeof PALETTE / sizeof PALETTE[0], N_MARKERS = 5 };

static const char *type_name(const cJSON *v)
{
    if (!v)
        return "nothing";
    if (cJSON_IsNull(v))
        return "null";
    if (cJSON_IsBool(v))
        return "a boolean";
    if (cJSON_IsNumber(v))
        return "a number";
    if (cJSON_IsString(v))
        return "a string";
    if (cJSON_IsArray(v))
        return "an array";
    return "an object";
}

/* "runs[3]" + "token_agreement" -> "runs[3].token_agreement". */
static const char *field_name(char *buf, size_t cap, const char *where, const char *key)
{
    if (where && *where)
        snprintf(buf, cap, "%s.%s", where, key);
    else
        snprintf(buf, cap, "%s", key);
    return buf;
}

/* A member, or NULL when it is absent or null. */
static const cJSON *member(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

enum num_kind { NUM_ANY, NUM_NONNEG, NUM_POSITIVE, NUM_FRACTION, NUM_RETENTION, NUM_COUNT, NUM_POS_COUNT };

static const char *const NUM_TEXT[] = {"a number", "a number >= 0", "a number > 0",
                                       "a fraction in [0, 1]", "a fraction in (0, 1]",
                                       "a whole number >= 0", "a whole number >= 1"};

static int num_ok(double v, enum num_kind k)
{
    if (!isfinite(v))
        return 0;
    switch (k) {
    case NUM_ANY: return 1;
    case NUM_NONNEG: return v >= 0;
    case NUM_POSITIVE: return v > 0;
    case NUM_FRACTION: return v >= 0 && v <= 1;
    case NUM_RETENTION: return v > 0 && v <= 1;
    case NUM_COUNT: return v >= 0 && v <= 9007199254740992.0 && v == floor(v);
    case NUM_POS_COUNT: return v >= 1 && v <= 9007199254740992.0 && v == floor(v);
    }
    return 0;
}

/* How much of a member get_number() insists on. */
enum need { OPTIONAL = 0, REQUIRED = 1, PRESENT = 2 /* the key must be there, null allowed */ };

/* Number member `key` of `obj` into *out (NaN when absent or null and not REQUIRED). */
static enum kvcap_status get_number(const struct report *r, const cJSON *obj, const char *where,
                                    const char *key, enum need need, enum num_kind kind,
                                    double *out)
{
    char f[256];
    const cJSON *v = member(obj, key);
    int required = need == REQUIRED;
    *out = NAN;
    if (!v) {
        KVCAP_RETURN_IF(required, KVCAP_ERR_FORMAT, "%s: %s: missing (expected %s)", r->path,
                        field_name(f, sizeof f, where, key), NUM_TEXT[kind]);
        KVCAP_RETURN_IF(need == PRESENT && !cJSON_GetObjectItemCaseSensitive(obj, key),
                        KVCAP_ERR_FORMAT, "%s: %s: missing (expected %s or null)", r->path,
                        field_name(f, sizeof f, where, key), NUM_TEXT[kind]);
        return KVCAP_OK;
    }
    KVCAP_RETURN_IF(!cJSON_IsNumber(v), KVCAP_ERR_FORMAT, "%s: %s: expected %s%s, got %s",
                    r->path, field_name(f, sizeof f, where, key), NUM_TEXT[kind],
                    required ? "" : " or null", type_name(v));
    KVCAP_RETURN_IF(!num_ok(v->valuedouble, kind), KVCAP_ERR_FORMAT, "%s: %s: expected %s, got %g",
                    r->path, field_name(f, sizeof f, where, key), NUM_TEXT[kind], v->valuedouble);
    *out = v->valuedouble;
    return KVCAP_OK;
}

/* String member into *out (NULL when absent or null and not required); required strings must
 * not be empty. */
static enum kvcap_status get_string(const struct report *r, const cJSON *obj, const char *where,
                                    const char *key, int required, const char **out)
{
    char f[256];
    const cJSON *v = member(obj, key);
    *out = NULL;
    if (!v) {
        KVCAP_RETURN_IF(required, KVCAP_ERR_FORMAT, "%s: %s: missing (expected a string)",
                        r->path, field_name(f, sizeof f, where, key));
        return KVCAP_OK;
    }
    KVCAP_RETURN_IF(!cJSON_IsString(v) || !v->valuestring, KVCAP_ERR_FORMAT,
                    "%s: %s: expected a string%s, got %s", r->path,
                    field_name(f, sizeof f, where, key), required ? "" : " or null",
                    type_name(v));
    KVCAP_RETURN_IF(required && !v->valuestring[0], KVCAP_ERR_FORMAT,
                    "%s: %s: expected a non-empty string", r->path,
                    field_name(f, sizeof f, where, key));
    *out = v->valuestring;
    return KVCAP_OK;
}

/* Object member into *out (NULL when absent or null). */
static enum kvcap_status get_object(const struct report *r, const cJSON *obj, const char *where,
                                    const char *key, const cJSON **out)
{
    char f[256];
    const cJSON *v = member(obj, key);
    *out = NULL;
    if (!v)
        return KVCAP_OK;
    KVCAP_RETURN_IF(!cJSON_IsObject(v), KVCAP_ERR_FORMAT, "%s: %s: expected an object, got %s",
                    r->path, field_name(f, sizeof f, where, key), type_name(v));
    *out = v;
    return KVCAP_OK;
}

/* Array of strings (corpus file lists, notes), absent or null allowed. */
static enum kvcap_status get_strings(const struct report *r, const cJSON *obj, const char *where,
                                     const char *key, const cJSON **out)
{
    char f[256];
    const cJSON *v = member(obj, key), *e;
    *out = NULL;
    if (!v)
        return KVCAP_OK;
    field_name(f, sizeof f, where, key);
    KVCAP_RETURN_IF(!cJSON_IsArray(v), KVCAP_ERR_FORMAT,
                    "%s: %s: expected an array of strings, got %s", r->path, f, type_name(v));
    int i = 0;
    cJSON_ArrayForEach(e, v)
    {
        KVCAP_RETURN_IF(!cJSON_IsString(e), KVCAP_ERR_FORMAT, "%s: %s[%d]: expected a string, got %s",
                        r->path, f, i, type_name(e));
        i++;
    }
    *out = v;
    return KVCAP_OK;
}

/* Array of numbers into a new array *out (caller frees; NULL when absent or null). `expect` > 0
 * is the required length, named by `expect_what` in messages; with `nulls`, null elements are
 * allowed and read as NaN. */
static enum kvcap_status get_numbers_n(const struct report *r, const cJSON *obj,
                                       const char *where, const char *key, enum num_kind kind,
                                       int expect, const char *expect_what, int nulls,
                                       double **out, int *n_out)
{
    char f[256];
    const cJSON *v = member(obj, key), *e;
    *out = NULL;
    *n_out = 0;
    if (!v)
        return KVCAP_OK;
    field_name(f, sizeof f, where, key);
    KVCAP_RETURN_IF(!cJSON_IsArray(v), KVCAP_ERR_FORMAT, "%s: %s: expected an array, got %s",
                    r->path, f, type_name(v));
    int n = cJSON_GetArraySize(v);
    KVCAP_RETURN_IF(expect > 0 && n != expect, KVCAP_ERR_FORMAT,
                    "%s: %s: %d entries, expected %d (%s)", r->path, f, n, expect, expect_what);
    double *a = malloc(sizeof *a * (size_t)(n ? n : 1));
    KVCAP_RETURN_IF(!a, KVCAP_ERR_OUT_OF_MEMORY, "%s: %s: out of memory", r->path, f);
    int i = 0;
    cJSON_ArrayForEach(e, v)
    {
        if (nulls && cJSON_IsNull(e)) {
            a[i++] = NAN;
            continue;
        }
        if (!cJSON_IsNumber(e) || !num_ok(e->valuedouble, kind)) {
            free(a);
            if (!cJSON_IsNumber(e))
                return kvcap_fail(KVCAP_ERR_FORMAT, "%s: %s[%d]: expected %s%s, got %s", r->path,
                                  f, i, NUM_TEXT[kind], nulls ? " or null" : "", type_name(e));
            return kvcap_fail(KVCAP_ERR_FORMAT, "%s: %s[%d]: expected %s, got %g", r->path, f, i,
                              NUM_TEXT[kind], e->valuedouble);
        }
        a[i++] = e->valuedouble;
    }
    *out = a;
    *n_out = n;
    return KVCAP_OK;
}

static enum kvcap_status get_numbers(const struct report *r, const cJSON *obj, const char *where,
                                     const char *key, enum num_kind kind, int expect,
                                     const char *expect_what, double **out, int *n_out)
{
    return get_numbers_n(r, obj, where, key, kind, expect, expect_what, 0, out, n_out);
}

/* A required true or false. */
static enum kvcap_status get_bool(const struct report *r, const cJSON *obj, const char *where,
                                  const char *key, int *out)
{
    char f[256];
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    KVCAP_RETURN_IF(!cJSON_IsBool(v), KVCAP_ERR_FORMAT, "%s: %s: %s (expected true or false%s%s)",
                    r->path, field_name(f, sizeof f, where, key), v ? "wrong type" : "missing",
                    v ? ", got " : "", v ? type_name(v) : "");
    *out = cJSON_IsTrue(v);
    return KVCAP_OK;
}

static double mean_of(const double *a, int n)
{
    if (!a || n <= 0)
        return NAN;
    double s = 0;
    for (int i = 0; i < n; i++)
        s += a[i];
    return s / n;
}

/* A per-layer array: its length must be model.layers. */
static enum kvcap_status get_layer_numbers(const struct report *r, const cJSON *obj,
                                           const char *where, const char *key,
                                           enum num_kind kind, double **out)
{
    char f[256];
    int n;
    KVCAP_RETURN_IF(member(obj, key) && r->n_layers == 0, KVCAP_ERR_FORMAT,
                    "%s: model.layers: missing (needed to check the length of %s)", r->path,
                    field_name(f, sizeof f, where, key));
    return get_numbers(r, obj, where, key, kind, r->n_layers, "model.layers", out, &n);
}

/* "per_prompt": {DNLL_KEY: [...], "kl": [...]}, optional; both arrays or neither, with `expect`
 * entries each (the prompts), in the prompts' order. */
static enum kvcap_status get_per_prompt(const struct report *r, const cJSON *o,
                                        const char *where, const char *dnll_key, double expect,
                                        double **dnll, double **kl, int *n)
{
    const cJSON *pp;
    char sub[64];
    int nd, nk;
    *dnll = *kl = NULL;
    *n = 0;
    KVCAP_TRY(get_object(r, o, where, "per_prompt", &pp));
    if (!pp)
        return KVCAP_OK;
    snprintf(sub, sizeof sub, "%s.per_prompt", where);
    const int want = isfinite(expect) ? (int)expect : 0;
    KVCAP_TRY(get_numbers(r, pp, sub, dnll_key, NUM_ANY, want, "the prompts", dnll, &nd));
    enum kvcap_status st = get_numbers(r, pp, sub, "kl", NUM_NONNEG, want, "the prompts", kl, &nk);
    if (st == KVCAP_OK && (!*dnll || !*kl || nd != nk || nd < 1))
        st = kvcap_fail(KVCAP_ERR_FORMAT, "%s: %s: expected arrays %s and kl of the same "
                        "non-zero length", r->path, sub, dnll_key);
    if (st != KVCAP_OK) {
        free(*dnll), free(*kl);
        *dnll = *kl = NULL;
        return st;
    }
    *n = nd;
    return KVCAP_OK;
}

static enum kvcap_status parse_run(struct report *r, const cJSON *o, int i)
{
    char where[32];
    snprintf(where, sizeof where, "runs[%d]", i);
    struct run *u = &r->runs[i];
    KVCAP_RETURN_IF(!cJSON_IsObject(o), KVCAP_ERR_FORMAT, "%s: %s: expected an object, got %s",
                    r->path, where, type_name(o));
    KVCAP_TRY(get_string(r, o, where, "id", 1, &u->id));
    KVCAP_TRY(get_string(r, o, where, "policy", 1, &u->policy));
    int known = 0;
    for (size_t k = 0; k < sizeof POLICIES / sizeof POLICIES[0]; k++)
        known |= strcmp(u->policy, POLICIES[k]) == 0;
    KVCAP_RETURN_IF(!known, KVCAP_ERR_FORMAT,
                    "%s: %s.policy: '%s' is not one of full, streaming, kvcapsule, flashcache, "
                    "vlcache, freekv, kvzip, random, expected_attention, composition",
                    r->path, where, u->policy);
    KVCAP_TRY(get_string(r, o, where, "label", 1, &u->label));
    KVCAP_TRY(get_number(r, o, where, "retention", REQUIRED, NUM_RETENTION, &u->retention));
    KVCAP_TRY(get_bool(r, o, where, "extension", &u->extension));
    KVCAP_TRY(get_number(r, o, where, "nominal", REQUIRED, NUM_NONNEG, &u->nominal));
    KVCAP_TRY(get_number(r, o, where, "realised_retention", PRESENT, NUM_NONNEG, &u->realised));
    KVCAP_TRY(get_number(r, o, where, "prefill_cost", OPTIONAL, NUM_NONNEG, &u->prefill_cost));
    KVCAP_TRY(get_number(r, o, where, "kl", REQUIRED, NUM_NONNEG, &u->kl));

    static const struct {
        const char *key;
        size_t offset;
        enum num_kind kind;
    } fields[] = {
        {"compression", offsetof(struct run, compression), NUM_POSITIVE},
        {"token_agreement", offsetof(struct run, token_agreement), NUM_FRACTION},
        {"next_token_agreement", offsetof(struct run, next_token_agreement), NUM_FRACTION},
        {"nll", offsetof(struct run, nll), NUM_ANY},
        {"nll_full", offsetof(struct run, nll_full), NUM_ANY},
        {"nll_delta", offsetof(struct run, nll_delta), NUM_ANY},
        {"bytes_held", offsetof(struct run, bytes_held), NUM_NONNEG},
        {"bytes_held_full", offsetof(struct run, bytes_held_full), NUM_NONNEG},
        {"bytes_held_span", offsetof(struct run, bytes_held_span), NUM_NONNEG},
        {"bytes_read_per_step", offsetof(struct run, bytes_read), NUM_NONNEG},
        {"bytes_read_per_step_full", offsetof(struct run, bytes_read_full), NUM_NONNEG},
        {"step_ms", offsetof(struct run, step_ms), NUM_NONNEG},
        {"step_ms_full", offsetof(struct run, step_ms_full), NUM_NONNEG},
    };
    for (size_t k = 0; k < sizeof fields / sizeof fields[0]; k++)
        KVCAP_TRY(get_number(r, o, where, fields[k].key, 0, fields[k].kind,
                             (double *)((char *)u + fields[k].offset)));
    KVCAP_TRY(get_string(r, o, where, "sample", 0, &u->sample));

    double *a;
    int n;
    KVCAP_TRY(get_numbers(r, o, where, "first_divergence", NUM_COUNT, 0, NULL, &a, &n));
    u->first_divergence_mean = mean_of(a, n);
    free(a);
    KVCAP_TRY(get_layer_numbers(r, o, where, "attn_cosine", NUM_ANY, &a));
    u->cos_mean = mean_of(a, r->n_layers);
    free(a);
    KVCAP_TRY(get_layer_numbers(r, o, where, "attn_rel_err", NUM_NONNEG, &u->rel));
    u->rel_mean = mean_of(u->rel, r->n_layers);

    char sub[48];
    const cJSON *t;
    u->task_accuracy = u->task_agreement = NAN;
    KVCAP_TRY(get_object(r, o, where, "task", &t));
    if (t) {
        snprintf(sub, sizeof sub, "%s.task", where);
        KVCAP_TRY(get_number(r, t, sub, "accuracy", REQUIRED, NUM_FRACTION, &u->task_accuracy));
        KVCAP_TRY(get_number(r, t, sub, "agreement_full", 0, NUM_FRACTION, &u->task_agreement));
        KVCAP_TRY(get_numbers_n(r, t, sub, "accuracy_by_depth", NUM_FRACTION, r->n_depths,
                                "task.depths", 1, &u->task_depth, &u->n_task_depth));
        KVCAP_RETURN_IF(u->n_task_depth > MAX_DEPTHS, KVCAP_ERR_FORMAT,
                        "%s: %s.accuracy_by_depth: %d entries exceed the limit of %d", r->path,
                        sub, u->n_task_depth, MAX_DEPTHS);
    }
    KVCAP_TRY(get_per_prompt(r, o, where, "nll_delta", r->prompts, &u->pp_dnll, &u->pp_kl,
                             &u->n_pp));
    u->shipped = 0;
    if (cJSON_GetObjectItemCaseSensitive(o, "shipped"))
        KVCAP_TRY(get_bool(r, o, where, "shipped", &u->shipped));
    KVCAP_TRY(get_number(r, o, where, "held_retention", 0, NUM_NONNEG, &u->held));
    u->n_seeds = 0;
    u->seed_kl_min = u->seed_kl_max = NAN;
    KVCAP_TRY(get_object(r, o, where, "seeds", &t));
    if (t) {
        snprintf(sub, sizeof sub, "%s.seeds", where);
        double count;
        KVCAP_TRY(get_number(r, t, sub, "count", REQUIRED, NUM_POS_COUNT, &count));
        KVCAP_TRY(get_numbers(r, t, sub, "kl", NUM_NONNEG, (int)fmin(count, 1 << 20),
                              "seeds.count", &a, &n));
        u->n_seeds = n;
        for (int k = 0; k < n; k++) {
            u->seed_kl_min = k ? fmin(u->seed_kl_min, a[k]) : a[k];
            u->seed_kl_max = k ? fmax(u->seed_kl_max, a[k]) : a[k];
        }
        free(a);
    }
    u->fk_head_steps = u->fk_corrected = u->fk_reselected = u->fk_hidden = u->fk_pages = NAN;
    KVCAP_TRY(get_object(r, o, where, "freekv", &t));
    if (t) {
        snprintf(sub, sizeof sub, "%s.freekv", where);
        u->has_freekv = 1;
        KVCAP_TRY(get_number(r, t, sub, "head_steps", 0, NUM_NONNEG, &u->fk_head_steps));
        KVCAP_TRY(get_number(r, t, sub, "corrected", 0, NUM_FRACTION, &u->fk_corrected));
        KVCAP_TRY(get_number(r, t, sub, "reselected", 0, NUM_FRACTION, &u->fk_reselected));
        KVCAP_TRY(get_number(r, t, sub, "hidden", 0, NUM_FRACTION, &u->fk_hidden));
        KVCAP_TRY(get_number(r, t, sub, "pages_recalled_per_step", 0, NUM_NONNEG, &u->fk_pages));
    }

    for (int j = 0; j < i; j++)
        KVCAP_RETURN_IF(strcmp(r->runs[j].id, u->id) == 0, KVCAP_ERR_FORMAT,
                        "%s: %s.id: '%s' repeats runs[%d].id", r->path, where, u->id, j);
    return KVCAP_OK;
}

static int cmp_int(const void *pa, const void *pb)
{
    const int a = *(const int *)pa, b = *(const int *)pb;
    return (a > b) - (a < b);
}

static enum kvcap_status parse_mask(struct report *r, const cJSON *o, int i)
{
    char where[32];
    snprintf(where, sizeof where, "masks[%d]", i);
    struct mask *m = &r->masks[i];
    KVCAP_RETURN_IF(!cJSON_IsObject(o), KVCAP_ERR_FORMAT, "%s: %s: expected an object, got %s",
                    r->path, where, type_name(o));
    double n_tokens, heads;
    KVCAP_TRY(get_string(r, o, where, "bucket", 1, &m->bucket));
    KVCAP_TRY(get_number(r, o, where, "n_tokens", 1, NUM_POS_COUNT, &n_tokens));
    KVCAP_TRY(get_number(r, o, where, "heads", 1, NUM_POS_COUNT, &heads));
    KVCAP_RETURN_IF(n_tokens > MAX_MASK_TOKENS, KVCAP_ERR_FORMAT,
                    "%s: %s.n_tokens: %g exceeds the limit of %d", r->path, where, n_tokens,
                    MAX_MASK_TOKENS);
    KVCAP_RETURN_IF(heads > MAX_MASK_HEADS, KVCAP_ERR_FORMAT,
                    "%s: %s.heads: %g exceeds the limit of %d", r->path, where, heads,
                    MAX_MASK_HEADS);
    m->n_tokens = (int)n_tokens;
    m->heads = (int)heads;
    KVCAP_TRY(get_string(r, o, where, "thumb", 0, &m->thumb));
    if (m->thumb) {
        double rows, cols;
        static const char prefix[] = "data:image/bmp;base64,";
        const size_t len = strlen(m->thumb);
        KVCAP_RETURN_IF(strncmp(m->thumb, prefix, sizeof prefix - 1) != 0 || len > (1u << 20) ||
                            strspn(m->thumb + sizeof prefix - 1,
                                   "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                   "0123456789+/=") != len - (sizeof prefix - 1),
                        KVCAP_ERR_FORMAT, "%s: %s.thumb: not a base64 BMP data URI of at most 1 MiB",
                        r->path, where);
        KVCAP_TRY(get_number(r, o, where, "rows", 1, NUM_POS_COUNT, &rows));
        KVCAP_TRY(get_number(r, o, where, "cols", 1, NUM_POS_COUNT, &cols));
        KVCAP_RETURN_IF(rows * cols != n_tokens, KVCAP_ERR_FORMAT,
                        "%s: %s: rows x cols (%g x %g) is not n_tokens (%g)", r->path, where,
                        rows, cols, n_tokens);
        m->rows = (int)rows;
        m->cols = (int)cols;
    }

    const cJSON *kept = member(o, "kept");
    KVCAP_RETURN_IF(!kept, KVCAP_ERR_FORMAT, "%s: %s.kept: missing (expected an array per layer)",
                    r->path, where);
    KVCAP_RETURN_IF(!cJSON_IsArray(kept), KVCAP_ERR_FORMAT,
                    "%s: %s.kept: expected an array per layer, got %s", r->path, where,
                    type_name(kept));
    KVCAP_RETURN_IF(r->n_layers == 0, KVCAP_ERR_FORMAT,
                    "%s: model.layers: missing (needed to check the length of %s.kept)", r->path,
                    where);
    int n_kept = cJSON_GetArraySize(kept);
    KVCAP_RETURN_IF(n_kept != r->n_layers, KVCAP_ERR_FORMAT,
                    "%s: %s.kept: %d entries, expected %d (model.layers)", r->path, where, n_kept,
                    r->n_layers);
    size_t cells = (size_t)r->n_layers * (size_t)m->n_tokens;
    KVCAP_RETURN_IF(cells > MAX_MASK_CELLS, KVCAP_ERR_FORMAT,
                    "%s: %s: %d layers x %d tokens is too large to draw", r->path, where,
                    r->n_layers, m->n_tokens);
    size_t cap = 1024;
    m->layer_at = calloc((size_t)r->n_layers + 1, sizeof *m->layer_at);
    m->tok = malloc(cap * sizeof *m->tok);
    KVCAP_RETURN_IF(!m->layer_at || !m->tok, KVCAP_ERR_OUT_OF_MEMORY, "%s: %s: out of memory",
                    r->path, where);
    int layer = 0;
    const cJSON *per_layer, *per_head, *e;
    cJSON_ArrayForEach(per_layer, kept)
    {
        m->layer_at[layer] = m->n_kept;
        int n_heads = cJSON_IsArray(per_layer) ? cJSON_GetArraySize(per_layer) : -1;
        if (n_heads != m->heads)
            return n_heads < 0 ? kvcap_fail(KVCAP_ERR_FORMAT,
                                            "%s: %s.kept[%d]: expected an array per head, got %s",
                                            r->path, where, layer, type_name(per_layer))
                               : kvcap_fail(KVCAP_ERR_FORMAT,
                                            "%s: %s.kept[%d]: %d entries, expected %d (%s.heads)",
                                            r->path, where, layer, n_heads, m->heads, where);
        int head = 0;
        cJSON_ArrayForEach(per_head, per_layer)
        {
            KVCAP_RETURN_IF(!cJSON_IsArray(per_head), KVCAP_ERR_FORMAT,
                            "%s: %s.kept[%d][%d]: expected an array of token indices, got %s",
                            r->path, where, layer, head, type_name(per_head));
            const size_t first = m->n_kept;
            int k = 0, ascending = 1;
            cJSON_ArrayForEach(e, per_head)
            {
                double t = cJSON_IsNumber(e) ? e->valuedouble : -1;
                if (!(t >= 0 && t < m->n_tokens && t == floor(t))) {
                    if (cJSON_IsNumber(e))
                        return kvcap_fail(KVCAP_ERR_FORMAT,
                                          "%s: %s.kept[%d][%d][%d]: expected a token index in "
                                          "[0, %d), got %g",
                                          r->path, where, layer, head, k, m->n_tokens, t);
                    return kvcap_fail(KVCAP_ERR_FORMAT,
                                      "%s: %s.kept[%d][%d][%d]: expected a token index, got %s",
                                      r->path, where, layer, head, k, type_name(e));
                }
                if (m->n_kept == cap) {
                    int *grown = cap <= SIZE_MAX / 2 / sizeof *grown
                                     ? realloc(m->tok, 2 * cap * sizeof *grown)
                                     : NULL;
                    KVCAP_RETURN_IF(!grown, KVCAP_ERR_OUT_OF_MEMORY, "%s: %s: out of memory",
                                    r->path, where);
                    m->tok = grown;
                    cap *= 2;
                }
                ascending &= m->n_kept == first || m->tok[m->n_kept - 1] < (int)t;
                m->tok[m->n_kept++] = (int)t;
                k++;
            }
            /* a token listed twice by one head is kept once; kvcap-eval lists them ascending,
             * so the sort is only for other writers */
            if (!ascending) {
                qsort(m->tok + first, m->n_kept - first, sizeof *m->tok, cmp_int);
                size_t u = first;
                for (size_t j = first; j < m->n_kept; j++)
                    if (j == first || m->tok[j] != m->tok[u - 1])
                        m->tok[u++] = m->tok[j];
                m->n_kept = u;
            }
            head++;
        }
        layer++;
    }
    m->layer_at[layer] = m->n_kept;
    return KVCAP_OK;
}

static enum kvcap_status parse_goal(struct report *r, const cJSON *o, int i)
{
    char where[32];
    snprintf(where, sizeof where, "goals[%d]", i);
    KVCAP_RETURN_IF(!cJSON_IsObject(o), KVCAP_ERR_FORMAT, "%s: %s: expected an object, got %s",
                    r->path, where, type_name(o));
    KVCAP_TRY(get_string(r, o, where, "text", 1, &r->goals[i].text));
    const cJSON *met = cJSON_GetObjectItemCaseSensitive(o, "met");
    KVCAP_RETURN_IF(!cJSON_IsBool(met), KVCAP_ERR_FORMAT,
                    "%s: %s.met: expected true or false, got %s", r->path, where, type_name(met));
    r->goals[i].met = cJSON_IsTrue(met);
    return KVCAP_OK;
}

/* An optional array member: its size in *n (0 when absent or null). */
static enum kvcap_status get_array(const struct report *r, const cJSON *obj, const char *key,
                                   const cJSON **out, int *n)
{
    const cJSON *v = member(obj, key);
    *out = NULL;
    *n = 0;
    if (!v)
        return KVCAP_OK;
    KVCAP_RETURN_IF(!cJSON_IsArray(v), KVCAP_ERR_FORMAT, "%s: %s: expected an array, got %s",
                    r->path, key, type_name(v));
    *out = v;
    *n = cJSON_GetArraySize(v);
    return KVCAP_OK;
}

static int cmp_run(const void *pa, const void *pb)
{
    const struct run *a = *(const struct run *const *)pa, *b = *(const struct run *const *)pb;
    if (a->curve != b->curve)
        return a->curve < b->curve ? -1 : 1;
    if (a->retention != b->retention)
        return a->retention < b->retention ? -1 : 1;
    return strcmp(a->id, b->id);
}

static int cmp_curve(const void *pa, const void *pb)
{
    const struct curve *a = pa, *b = pb;
    if (a->reference != b->reference)
        return a->reference ? -1 : 1;
    if (a->extension != b->extension)
        return a->extension ? 1 : -1;
    return strcmp(a->label, b->label);
}

/* The papers' curve an extension curve is drawn as a variant of: the one papers' curve of its
 * policy, when the extension is that policy's only one (flashcache+protect of flashcache);
 * -1 otherwise (three tiled KVCapsule variants get colours of their own). */
static int variant_of(const struct report *r, int c)
{
    const struct curve *cv = &r->curves[c];
    int base = -1, papers = 0, extensions = 0;
    for (int k = 0; k < r->n_curves; k++) {
        const struct curve *o = &r->curves[k];
        if (o->reference || strcmp(o->policy, cv->policy) != 0)
            continue;
        if (o->extension) {
            extensions++;
        } else {
            papers++;
            base = k;
        }
    }
    return cv->extension && papers == 1 && extensions == 1 ? base : -1;
}

/* Groups runs into curves by label, gives each a colour and marker, and sorts the runs. */
static enum kvcap_status build_curves(struct report *r)
{
    r->curves = calloc((size_t)r->n_runs, sizeof *r->curves);
    r->sorted = malloc(sizeof *r->sorted * (size_t)r->n_runs);
    KVCAP_RETURN_IF(!r->curves || !r->sorted, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory",
                    r->path);
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = &r->runs[i];
        int c = 0;
        while (c < r->n_curves && strcmp(r->curves[c].label, u->label) != 0)
            c++;
        if (c == r->n_curves) {
            r->curves[r->n_curves].label = u->label;
            r->curves[r->n_curves++].policy = u->policy;
        }
        r->curves[c].reference |= strcmp(u->policy, "full") == 0;
        r->curves[c].extension |= u->extension;
    }
    qsort(r->curves, (size_t)r->n_curves, sizeof *r->curves, cmp_curve);
    int colored = 0;
    for (int c = 0; c < r->n_curves; c++) {
        struct curve *cv = &r->curves[c];
        int base = variant_of(r, c);
        if (cv->reference) {
            cv->color = REFERENCE_COLOR;
            cv->marker = 0;
        } else if (base >= 0) {
            cv->color = r->curves[base].color;
            cv->marker = r->curves[base].marker;
        } else {
            cv->color = PALETTE[colored % N_PALETTE];
            cv->marker = colored % N_MARKERS;
            colored++;
        }
    }
    for (int i = 0; i < r->n_runs; i++) {
        struct run *u = &r->runs[i];
        for (int c = 0; c < r->n_curves; c++)
            if (strcmp(r->curves[c].label, u->label) == 0)
                u->curve = c;
        r->sorted[i] = u;
    }
    qsort(r->sorted, (size_t)r->n_runs, sizeof *r->sorted, cmp_run);
    return KVCAP_OK;
}

static void report_free(struct report *r)
{
    for (int i = 0; r->runs && i < r->n_runs; i++) {
        free(r->runs[i].rel);
        free(r->runs[i].task_depth);
        free(r->runs[i].pp_dnll), free(r->runs[i].pp_kl);
    }
    for (int i = 0; r->outside.rows && i < r->outside.n_rows; i++)
        free(r->outside.rows[i].pp_dnll), free(r->outside.rows[i].pp_kl);
    free(r->task_depths);
    for (int i = 0; r->masks && i < r->n_masks; i++)
        free(r->masks[i].tok), free(r->masks[i].layer_at);
    free(r->runs);
    free(r->sorted);
    free(r->curves);
    free(r->masks);
    free(r->goals);
    cJSON_Delete(r->root);
    free(r->outside.rows);
    cJSON_Delete(r->outside_root);
}

/* The metrics file as NUL-terminated text (it must not contain a NUL itself). */
static enum kvcap_status read_all(const char *path, char **out)
{
    size_t n = 0;
    KVCAP_TRY(kvcap_read_file(path, MAX_FILE_BYTES, KVCAP_ERR_FORMAT, "", out, &n));
    if (memchr(*out, '\0', n)) {
        free(*out);
        *out = NULL;
        return kvcap_fail(KVCAP_ERR_FORMAT, "%s: not JSON text (contains a NUL byte)", path);
    }
    return KVCAP_OK;
}

/* The two engines' full-cache NLL (per token, as the full run's "nll") may differ by this much
 * on the same weights and prompts: transformers computes in f32 throughout, kvcap's engine
 * holds K/V in setup.storage (f16 by default) and sums in another order. Measured on 4 text
 * prompts x 64 tokens (transformers 5.24): 4.0e-5 nats/token with f16 storage, 2.9e-4 with
 * bf16; on the image track 1e-4 (3.2460 against 3.2461). The bound leaves 17 times the bf16
 * figure, for fewer prompts or other text; another model, or the same prompts cut elsewhere,
 * moves it by tenths of a nat. */
#define OUTSIDE_FULL_NLL_TOL 5e-3

/* Says why kvpress.json's rows are kept out of the report (r->outside.mismatch). */
static void outside_refuse(struct report *r, const char *fmt, ...) KVCAP_PRINTF(2, 3);
static void outside_refuse(struct report *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->outside.why, sizeof r->outside.why, fmt, ap);
    va_end(ap);
    r->outside.mismatch = r->outside.why;
}

/* Whether kvpress.json was measured on this run, field by field, from what the script wrote
 * about its own run: the track, the hash of what it fed transformers (prompts_sha256, as
 * metrics.json's), the retentions it ran and the full cache's NLL it measured. The first field
 * that differs is named with both values; a file without them (an older script) is refused
 * too. */
static void outside_bind(struct report *r, const char *ours, double prompts,
                         const double layout[4], const char *track, const char *hash,
                         const double *rets, int n_rets, double full_nll)
{
    static const char rerun[] = "rerun scripts/kvpress-reference.sh on this folder";
    char lacks[96] = "";
    const char *missing[4] = {hash ? NULL : "prompts_sha256", track ? NULL : "track",
                              rets ? NULL : "retentions", isnan(full_nll) ? "full_nll" : NULL};
    int n_missing = 0, k = 0;
    for (int i = 0; i < 4; i++)
        n_missing += missing[i] != NULL;
    for (int i = 0; i < 4; i++) {
        if (!missing[i])
            continue;
        size_t at = strlen(lacks);
        snprintf(lacks + at, sizeof lacks - at, "%s%s", k == 0 ? "" : k + 1 < n_missing ? ", "
                                                                                : " and ",
                 missing[i]);
        k++;
    }
    if (n_missing) {
        outside_refuse(r, "it was written by an older kvpress-reference.sh and lacks %s; %s",
                       lacks, rerun);
        return;
    }
    if (!ours) {
        outside_refuse(r, "this run's metrics.json has no prompts_sha256 (an older kvcap-eval "
                          "wrote it), so the prompts kvpress.json was measured on cannot be "
                          "checked; rerun kvcap-eval run");
        return;
    }
    const double here[4] = {r->head_tokens, r->span_tokens, r->tail_tokens,
                            r->continuation_tokens};
    int same = prompts == r->prompts;
    for (int i = 0; i < 4; i++)
        same &= layout[i] == here[i];
    if (!same) {
        outside_refuse(r, "it was measured on %g prompts of %g + %g + %g tokens, %g continued, "
                          "this run on %g of %g + %g + %g, %g continued; %s",
                       prompts, layout[0], layout[1], layout[2], layout[3], r->prompts, here[0],
                       here[1], here[2], here[3], rerun);
        return;
    }
    const char *kind = r->image ? "image" : "text";
    if (strcmp(track, kind) != 0) {
        outside_refuse(r, "its track %.32s%s is not this run's %s; %s", track,
                       strlen(track) > 32 ? "..." : "", kind, rerun);
        return;
    }
    if (strcmp(hash, ours) != 0) {
        outside_refuse(r, "its prompts_sha256 %.64s%s is not this run's %.64s; %s", hash,
                       strlen(hash) > 64 ? "..." : "", ours, rerun);
        return;
    }
    /* this run's targets and its full run */
    const struct run *full = NULL;
    char evaluated[256] = "";
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = &r->runs[i];
        if (!strcmp(u->policy, "full")) {
            full = full ? full : u;
            continue;
        }
        int seen = 0;
        for (int j = 0; j < i; j++)
            seen |= strcmp(r->runs[j].policy, "full") != 0 &&
                    fabs(r->runs[j].retention - u->retention) < 1e-9;
        size_t at = strlen(evaluated);
        if (!seen)
            snprintf(evaluated + at, sizeof evaluated - at, "%s%g", at ? ", " : "", u->retention);
    }
    for (int i = 0; i < n_rets + r->outside.n_rows; i++) {
        const double t = i < n_rets ? rets[i] : r->outside.rows[i - n_rets].retention;
        int found = 0;
        for (int j = 0; j < r->n_runs && !found; j++)
            found = strcmp(r->runs[j].policy, "full") != 0 &&
                    fabs(r->runs[j].retention - t) < 1e-9;
        if (!found) {
            outside_refuse(r, "its retention %g is not one this run evaluated (%s); %s", t,
                           evaluated[0] ? evaluated : "none", rerun);
            return;
        }
    }
    if (!full || !isfinite(full->nll)) {
        outside_refuse(r, "this run has no full-cache nll to check its full_nll %.4f against",
                       full_nll);
        return;
    }
    if (!(fabs(full_nll - full->nll) <= OUTSIDE_FULL_NLL_TOL)) {
        outside_refuse(r, "its full_nll %.4f is not this run's full-cache nll %.4f (the two "
                          "engines agree to within %g nats/token on the same weights and "
                          "prompts); %s",
                       full_nll, full->nll, OUTSIDE_FULL_NLL_TOL, rerun);
        return;
    }
    r->outside.hash = hash;
    r->outside.full_nll = full_nll;
    r->outside.full_nll_here = full->nll;
}

/* kvpress.json beside the metrics file, when there is one: its rows, checked field by field
 * (errors name that file). Rows measured on another run (outside_bind) are not comparable:
 * they are kept out of the report, which says why. */
static enum kvcap_status outside_load(struct report *r)
{
    const char *slash = strrchr(r->path, '/');
    int dir = slash ? (int)(slash - r->path) + 1 : 0;
    snprintf(r->outside_path, sizeof r->outside_path, "%.*skvpress.json", dir, r->path);
    if (access(r->outside_path, F_OK) != 0)
        return KVCAP_OK;
    struct report kp; /* only its path: the reader's messages name kvpress.json */
    memset(&kp, 0, sizeof kp);
    kp.path = r->outside_path;
    char *text = NULL;
    KVCAP_TRY(read_all(kp.path, &text));
    r->outside_root = cJSON_Parse(text);
    free(text);
    KVCAP_RETURN_IF(!r->outside_root || !cJSON_IsObject(r->outside_root), KVCAP_ERR_FORMAT,
                    "%s: not a JSON object", kp.path);
    const cJSON *root = r->outside_root, *layout, *rows, *e;
    const char *source;
    KVCAP_TRY(get_string(&kp, root, "", "source", 1, &source));
    KVCAP_RETURN_IF(strcmp(source, "kvpress") != 0, KVCAP_ERR_FORMAT,
                    "%s: source: '%s' is not kvpress", kp.path, source);
    KVCAP_TRY(get_string(&kp, root, "", "kvpress_version", 1, &r->outside.version));
    KVCAP_TRY(get_string(&kp, root, "", "transformers_version", 1, &r->outside.transformers));
    double prompts, head, span, tail, cont;
    KVCAP_TRY(get_number(&kp, root, "", "prompts", REQUIRED, NUM_POS_COUNT, &prompts));
    KVCAP_TRY(get_object(&kp, root, "", "layout", &layout));
    KVCAP_RETURN_IF(!layout, KVCAP_ERR_FORMAT, "%s: layout: missing (expected an object)",
                    kp.path);
    KVCAP_TRY(get_number(&kp, layout, "layout", "head", REQUIRED, NUM_COUNT, &head));
    KVCAP_TRY(get_number(&kp, layout, "layout", "span", REQUIRED, NUM_POS_COUNT, &span));
    KVCAP_TRY(get_number(&kp, layout, "layout", "tail", REQUIRED, NUM_COUNT, &tail));
    KVCAP_TRY(get_number(&kp, layout, "layout", "continuation", REQUIRED, NUM_POS_COUNT, &cont));
    KVCAP_TRY(get_array(&kp, root, "rows", &rows, &r->outside.n_rows));
    KVCAP_RETURN_IF(!rows, KVCAP_ERR_FORMAT, "%s: rows: missing (expected an array)", kp.path);
    r->outside.rows = calloc((size_t)r->outside.n_rows + 1, sizeof *r->outside.rows);
    KVCAP_RETURN_IF(!r->outside.rows, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", kp.path);
    int i = 0;
    cJSON_ArrayForEach(e, rows)
    {
        char where[32];
        struct outside_row *o = &r->outside.rows[i];
        snprintf(where, sizeof where, "rows[%d]", i++);
        KVCAP_RETURN_IF(!cJSON_IsObject(e), KVCAP_ERR_FORMAT, "%s: %s: expected an object",
                        kp.path, where);
        KVCAP_TRY(get_string(&kp, e, where, "press", 1, &o->press));
        KVCAP_TRY(get_number(&kp, e, where, "retention", REQUIRED, NUM_RETENTION, &o->retention));
        KVCAP_TRY(get_number(&kp, e, where, "realised_retention", REQUIRED, NUM_NONNEG,
                             &o->realised));
        KVCAP_TRY(get_number(&kp, e, where, "dnll", REQUIRED, NUM_ANY, &o->dnll));
        KVCAP_TRY(get_number(&kp, e, where, "kl", REQUIRED, NUM_NONNEG, &o->kl));
        KVCAP_TRY(get_number(&kp, e, where, "next_token_agreement", REQUIRED, NUM_FRACTION,
                             &o->agreement));
        KVCAP_TRY(get_per_prompt(&kp, e, where, "dnll", prompts, &o->pp_dnll, &o->pp_kl,
                                 &o->n_pp));
    }
    const char *track, *hash, *ours;
    double full_nll, *rets;
    int n_rets;
    KVCAP_TRY(get_string(r, r->root, "", "prompts_sha256", 0, &ours)); /* metrics.json's */
    KVCAP_TRY(get_string(&kp, root, "", "track", 0, &track));
    KVCAP_TRY(get_string(&kp, root, "", "prompts_sha256", 0, &hash));
    KVCAP_TRY(get_number(&kp, root, "", "full_nll", OPTIONAL, NUM_ANY, &full_nll));
    KVCAP_TRY(get_numbers(&kp, root, "", "retentions", NUM_RETENTION, 0, NULL, &rets, &n_rets));
    const double layout_of[4] = {head, span, tail, cont};
    outside_bind(r, ours, prompts, layout_of, track, hash, rets, n_rets, full_nll);
    free(rets);
    return KVCAP_OK;
}

static enum kvcap_status report_load(struct report *r, const char *path)
{
    memset(r, 0, sizeof *r);
    r->path = path;
    char *text = NULL;
    KVCAP_TRY(read_all(path, &text));
    const char *end = NULL;
    r->root = cJSON_ParseWithOpts(text, &end, 1);
    if (!r->root) {
        size_t at = end && end >= text ? (size_t)(end - text) : 0;
        int line = 1;
        for (size_t i = 0; i < at && text[i]; i++)
            line += text[i] == '\n';
        free(text);
        return kvcap_fail(KVCAP_ERR_FORMAT, "%s: not valid JSON (syntax error at line %d, byte %zu)",
                          path, line, at);
    }
    free(text);
    const cJSON *root = r->root, *o, *e;
    KVCAP_RETURN_IF(!cJSON_IsObject(root), KVCAP_ERR_FORMAT,
                    "%s: expected a JSON object at the top level, got %s", path, type_name(root));

    double format;
    KVCAP_TRY(get_number(r, root, "", "format", 1, NUM_ANY, &format));
    KVCAP_RETURN_IF(format != 1, KVCAP_ERR_FORMAT,
                    "%s: format: %g is not supported (this kvcap-report reads format 1)", path,
                    format);
    KVCAP_TRY(get_string(r, root, "", "title", 1, &r->title));
    KVCAP_TRY(get_string(r, root, "", "command", 0, &r->command));
    KVCAP_TRY(get_string(r, root, "", "created", 0, &r->created));
    KVCAP_TRY(get_strings(r, root, "", "notes", &r->notes));
    KVCAP_TRY(get_string(r, root, "", "prompt_sample", 0, &r->prompt_sample));

    double layers;
    KVCAP_TRY(get_object(r, root, "", "model", &o));
    KVCAP_TRY(get_string(r, o, "model", "name", 0, &r->model_name));
    KVCAP_TRY(get_string(r, o, "model", "file", 0, &r->model_file));
    KVCAP_TRY(get_number(r, o, "model", "layers", 0, NUM_POS_COUNT, &layers));
    KVCAP_TRY(get_number(r, o, "model", "q_heads", 0, NUM_POS_COUNT, &r->q_heads));
    KVCAP_TRY(get_number(r, o, "model", "kv_heads", 0, NUM_POS_COUNT, &r->kv_heads));
    KVCAP_TRY(get_number(r, o, "model", "head_dim", 0, NUM_POS_COUNT, &r->head_dim));
    KVCAP_RETURN_IF(layers > MAX_LAYERS, KVCAP_ERR_FORMAT,
                    "%s: model.layers: %g exceeds the limit of %d", path, layers, MAX_LAYERS);
    r->n_layers = isnan(layers) ? 0 : (int)layers;

    KVCAP_TRY(get_object(r, root, "", "corpus", &o));
    KVCAP_TRY(get_string(r, o, "corpus", "source", 0, &r->corpus_source));
    KVCAP_TRY(get_strings(r, o, "corpus", "calibration", &r->calibration_files));
    KVCAP_TRY(get_strings(r, o, "corpus", "heldout", &r->heldout_files));
    KVCAP_TRY(get_number(r, o, "corpus", "calibration_tokens", 0, NUM_COUNT,
                         &r->calibration_tokens));
    KVCAP_TRY(get_number(r, o, "corpus", "heldout_tokens", 0, NUM_COUNT, &r->heldout_tokens));

    KVCAP_TRY(get_object(r, root, "", "track", &o));
    r->grid_rows = r->grid_cols = r->photos = r->heldout_photos = NAN;
    r->heldout_crops = r->calibration_crops = NAN;
    if (o) {
        const char *kind = NULL;
        KVCAP_TRY(get_string(r, o, "track", "kind", 1, &kind));
        KVCAP_RETURN_IF(strcmp(kind, "text") != 0 && strcmp(kind, "image") != 0,
                        KVCAP_ERR_FORMAT, "%s: track.kind: '%s' is not text or image", path,
                        kind);
        r->image = !strcmp(kind, "image");
        KVCAP_TRY(get_string(r, o, "track", "features", 0, &r->features));
        KVCAP_TRY(get_number(r, o, "track", "rows", 0, NUM_POS_COUNT, &r->grid_rows));
        KVCAP_TRY(get_number(r, o, "track", "cols", 0, NUM_POS_COUNT, &r->grid_cols));
        KVCAP_TRY(get_number(r, o, "track", "photos", 0, NUM_COUNT, &r->photos));
        KVCAP_TRY(get_number(r, o, "track", "heldout_photos", 0, NUM_COUNT,
                             &r->heldout_photos));
        KVCAP_TRY(get_number(r, o, "track", "heldout_crops", 0, NUM_COUNT, &r->heldout_crops));
        KVCAP_TRY(get_number(r, o, "track", "calibration_crops", 0, NUM_COUNT,
                             &r->calibration_crops));
        const char *split = NULL;
        KVCAP_TRY(get_string(r, o, "track", "photos_split", 0, &split));
        /* calibration, development or test (kvcap-eval --photos); heldout in files written
         * before the test split, the name development had then */
        KVCAP_RETURN_IF(split && strcmp(split, "calibration") != 0 &&
                            strcmp(split, "development") != 0 && strcmp(split, "test") != 0 &&
                            strcmp(split, "heldout") != 0,
                        KVCAP_ERR_FORMAT,
                        "%s: track.photos_split: '%s' is not calibration, development or test",
                        r->path, split);
        r->calibration_photos = split && !strcmp(split, "calibration");
    }

    KVCAP_TRY(get_object(r, root, "", "setup", &o));
    KVCAP_TRY(get_number(r, o, "setup", "head_tokens", 0, NUM_COUNT, &r->head_tokens));
    KVCAP_TRY(get_number(r, o, "setup", "span_tokens", 0, NUM_COUNT, &r->span_tokens));
    KVCAP_TRY(get_number(r, o, "setup", "tail_tokens", 0, NUM_COUNT, &r->tail_tokens));
    KVCAP_TRY(get_number(r, o, "setup", "generate_tokens", 0, NUM_COUNT, &r->generate_tokens));
    KVCAP_TRY(get_number(r, o, "setup", "continuation_tokens", 0, NUM_COUNT,
                         &r->continuation_tokens));
    KVCAP_TRY(get_number(r, o, "setup", "fidelity_steps", 0, NUM_COUNT, &r->fidelity_steps));
    KVCAP_TRY(get_number(r, o, "setup", "prompts", 0, NUM_COUNT, &r->prompts));
    KVCAP_TRY(get_number(r, o, "setup", "threads", 0, NUM_COUNT, &r->threads));
    KVCAP_TRY(get_string(r, o, "setup", "storage", 0, &r->storage));
    KVCAP_TRY(get_string(r, o, "setup", "split", 0, &r->split));
    KVCAP_RETURN_IF(r->split && strcmp(r->split, "calibration") != 0 &&
                        strcmp(r->split, "development") != 0 && strcmp(r->split, "test") != 0,
                    KVCAP_ERR_FORMAT,
                    "%s: setup.split: '%s' is not calibration, development or test", r->path,
                    r->split);
    KVCAP_TRY(get_string(r, o, "setup", "shipped", 0, &r->shipped));
    int n_unreached = 0;
    KVCAP_TRY(get_array(r, root, "unreached", &r->unreached, &n_unreached));
    for (int i = 0; i < n_unreached; i++) {
        char where[32];
        snprintf(where, sizeof where, "unreached[%d]", i);
        const cJSON *ur = cJSON_GetArrayItem(r->unreached, i);
        const char *policy;
        double t, floor_;
        KVCAP_RETURN_IF(!cJSON_IsObject(ur), KVCAP_ERR_FORMAT, "%s: %s: expected an object",
                        r->path, where);
        KVCAP_TRY(get_string(r, ur, where, "policy", 1, &policy));
        KVCAP_TRY(get_number(r, ur, where, "retention", REQUIRED, NUM_RETENTION, &t));
        KVCAP_TRY(get_number(r, ur, where, "floor", REQUIRED, NUM_NONNEG, &floor_));
    }
    KVCAP_TRY(get_number(r, o, "setup", "read_bandwidth_gbs", 0, NUM_NONNEG,
                         &r->read_bandwidth_gbs));

    /* Before the runs: their task.accuracy_by_depth must match task.depths. */
    KVCAP_TRY(get_object(r, root, "", "task", &o));
    r->task_queries = r->task_answer_tokens = NAN;
    if (o) {
        r->has_task = 1;
        KVCAP_TRY(get_string(r, o, "task", "name", 0, &r->task_name));
        KVCAP_TRY(get_string(r, o, "task", "line", 0, &r->task_line));
        KVCAP_TRY(get_string(r, o, "task", "question", 0, &r->task_question));
        KVCAP_TRY(get_string(r, o, "task", "haystack", 0, &r->task_haystack));
        KVCAP_TRY(get_number(r, o, "task", "queries", 0, NUM_COUNT, &r->task_queries));
        KVCAP_TRY(get_number(r, o, "task", "answer_tokens", 0, NUM_COUNT,
                             &r->task_answer_tokens));
        KVCAP_TRY(get_numbers(r, o, "task", "depths", NUM_FRACTION, 0, NULL, &r->task_depths,
                              &r->n_depths));
        KVCAP_RETURN_IF(r->n_depths > MAX_DEPTHS, KVCAP_ERR_FORMAT,
                        "%s: task.depths: %d entries exceed the limit of %d", path, r->n_depths,
                        MAX_DEPTHS);
    }

    const cJSON *runs, *masks, *goals;
    KVCAP_TRY(get_array(r, root, "runs", &runs, &r->n_runs));
    KVCAP_RETURN_IF(!runs, KVCAP_ERR_FORMAT, "%s: runs: missing (expected an array of runs)",
                    path);
    KVCAP_RETURN_IF(r->n_runs == 0, KVCAP_ERR_FORMAT, "%s: runs: empty (expected at least one run)",
                    path);
    r->runs = calloc((size_t)r->n_runs, sizeof *r->runs);
    KVCAP_RETURN_IF(!r->runs, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    int i = 0;
    cJSON_ArrayForEach(e, runs) KVCAP_TRY(parse_run(r, e, i++));

    KVCAP_TRY(get_array(r, root, "masks", &masks, &r->n_masks));
    r->masks = calloc((size_t)r->n_masks + 1, sizeof *r->masks);
    KVCAP_RETURN_IF(!r->masks, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    i = 0;
    cJSON_ArrayForEach(e, masks) KVCAP_TRY(parse_mask(r, e, i++));

    KVCAP_TRY(get_array(r, root, "goals", &goals, &r->n_goals));
    r->goals = calloc((size_t)r->n_goals + 1, sizeof *r->goals);
    KVCAP_RETURN_IF(!r->goals, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    i = 0;
    cJSON_ArrayForEach(e, goals) KVCAP_TRY(parse_goal(r, e, i++));

    KVCAP_TRY(outside_load(r));
    return build_curves(r);
}

/* ---- Output buffer ------------------------------------------------------------------------- */

struct buf {
    char *p;
    size_t len, cap;
    int failed; /* an allocation failed: the content is incomplete */
};

static int buf_reserve(struct buf *b, size_t extra)
{
    if (b->failed)
        return 0;
    if (b->len + extra + 1 <= b->cap)
        return 1;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + extra + 1) {
        if (cap > SIZE_MAX / 2) {
            b->failed = 1;
            return 0;
        }
        cap *= 2;
    }
    char *p = realloc(b->p, cap);
    if (!p) {
        b->failed = 1;
        return 0;
    }
    b->p = p;
    b->cap = cap;
    return 1;
}

static void bput(struct buf *b, const char *s, size_t n)
{
    if (!buf_reserve(b, n))
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void bputs(struct buf *b, const char *s)
{
    bput(b, s, strlen(s));
}

static void bprintf(struct buf *b, const char *fmt, ...) KVCAP_PRINTF(2, 3);
static void bprintf(struct buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->failed = 1;
        return;
    }
    if (!buf_reserve(b, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* `n` bytes of text from the JSON, escaped for HTML and SVG text and attribute values. With
 * `controls`, control characters other than tab, newline and carriage return (not allowed in
 * HTML text) become U+FFFD. */
static void besc_n(struct buf *b, const char *s, size_t n, int controls)
{
    const char *run = s, *end = s + n;
    for (; s < end; s++) {
        unsigned char c = (unsigned char)*s;
        const char *rep = c == '&'    ? "&amp;"
                          : c == '<'  ? "&lt;"
                          : c == '>'  ? "&gt;"
                          : c == '"'  ? "&quot;"
                          : c == '\'' ? "&#39;"
                                      : NULL;
        if (!rep && controls && (c < 0x20 || c == 0x7F) && c != '\t' && c != '\n' && c != '\r')
            rep = "\xef\xbf\xbd";
        if (rep) {
            bput(b, run, (size_t)(s - run));
            bputs(b, rep);
            run = s + 1;
        }
    }
    bput(b, run, (size_t)(s - run));
}

/* Text from the JSON, escaped for HTML and SVG text and attribute values. */
static void besc(struct buf *b, const char *s)
{
    besc_n(b, s, strlen(s), 0);
}

/* ---- Atomic file writes -------------------------------------------------------------------- */

/* ---- CSV ----------------------------------------------------------------------------------- */

/* A text cell. One that starts like a formula (=, +, -, @, tab, CR) gets a leading ' so a
 * spreadsheet shows it as text instead of evaluating it (labels come from the command line). */
static void csv_text(struct buf *b, const char *s)
{
    const int formula = *s && strchr("=+-@\t\r", *s);
    if (!formula && !strpbrk(s, ",\"\r\n")) {
        bputs(b, s);
        return;
    }
    bputs(b, formula ? "\"'" : "\"");
    for (; *s; s++)
        bput(b, *s == '"' ? "\"\"" : s, *s == '"' ? 2 : 1);
    bputs(b, "\"");
}

static void csv_number(struct buf *b, double v)
{
    bputs(b, ",");
    if (isfinite(v))
        bprintf(b, "%.10g", v);
}

static double ratio(double a, double b)
{
    return b > 0 ? a / b : NAN;
}

/* A paired difference a − b (KL or |ΔNLL|, over the prompts) read against its 95 % interval:
 * VS_CLOSER, a is closer to full than b beyond it; VS_FARTHER, farther; VS_TIED, the prompts
 * do not separate them; VS_NONE, nothing to pair. */
enum versus { VS_NONE, VS_CLOSER, VS_TIED, VS_FARTHER };
static enum versus versus_random(const struct report *r, const struct run *u, double *mean,
                                 double *half);

static void render_csv(struct buf *b, const struct report *r)
{
    bputs(b, "id,policy,label,retention,compression,token_agreement,next_token_agreement,"
             "first_divergence_mean,nll,nll_full,nll_delta,attn_cosine_mean,attn_rel_err_mean,"
             "bytes_held,bytes_held_full,bytes_read_per_step,step_ms,step_ms_full,"
             "step_time_ratio,realised_retention,nominal,extension,kl,task_accuracy,"
             "task_agreement_full,freekv_corrected,freekv_reselected,freekv_hidden,"
             "kl_minus_random,kl_minus_random_half95\n");
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        csv_text(b, u->id);
        bputs(b, ",");
        csv_text(b, u->policy);
        bputs(b, ",");
        csv_text(b, u->label);
        const double v[] = {u->retention,
                            u->compression,
                            u->token_agreement,
                            u->next_token_agreement,
                            u->first_divergence_mean,
                            u->nll,
                            u->nll_full,
                            u->nll_delta,
                            u->cos_mean,
                            u->rel_mean,
                            u->bytes_held,
                            u->bytes_held_full,
                            u->bytes_read,
                            u->step_ms,
                            u->step_ms_full,
                            ratio(u->step_ms, u->step_ms_full),
                            u->realised,
                            u->nominal};
        for (size_t k = 0; k < sizeof v / sizeof v[0]; k++)
            csv_number(b, v[k]);
        bputs(b, u->extension ? ",true" : ",false");
        const double w[] = {u->kl,           u->task_accuracy, u->task_agreement,
                            u->fk_corrected, u->fk_reselected, u->fk_hidden};
        for (size_t k = 0; k < sizeof w / sizeof w[0]; k++)
            csv_number(b, w[k]);
        double m, h; /* empty where there is nothing to pair */
        versus_random(r, u, &m, &h);
        csv_number(b, m);
        csv_number(b, h);
        bputs(b, "\n");
    }
}

/* ---- HTML: text helpers -------------------------------------------------------------------- */

/* 412672 -> "412,672". */
static const char *fmt_count(char *out, size_t cap, double v)
{
    char digits[32];
    snprintf(digits, sizeof digits, "%.0f", v);
    size_t n = strlen(digits), o = 0;
    for (size_t i = 0; i < n && o + 2 < cap; i++) {
        if (i > 0 && digits[i - 1] != '-' && (n - i) % 3 == 0)
            out[o++] = ',';
        out[o++] = digits[i];
    }
    out[o] = '\0';
    return out;
}

/* Signed with a typographic minus: "+0.0068", "&minus;0.0004". */
static const char *fmt_signed(char *out, size_t cap, double v, int decimals)
{
    if (v == 0) {
        snprintf(out, cap, "0");
        return out;
    }
    snprintf(out, cap, "%s%.*f", v < 0 ? "&minus;" : "+", decimals, fabs(v));
    return out;
}

/* Student's t quantile t(0.975, df): from the table for df <= 30 (3 decimals), a Cornish-Fisher
 * expansion in 1/df beyond (within 0.001 there). */
static double t975(int df)
{
    static const double t[31] = {NAN,   12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365,
                                 2.306, 2.262,  2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
                                 2.120, 2.110,  2.101, 2.093, 2.086, 2.080, 2.074, 2.069,
                                 2.064, 2.060,  2.056, 2.052, 2.048, 2.045, 2.042};
    if (df < 1)
        return NAN;
    if (df <= 30)
        return t[df];
    const double z = 1.959964, z3 = z * z * z, z5 = z3 * z * z;
    return z + (z3 + z) / (4.0 * df) + (5 * z5 + 16 * z3 + 3 * z) / (96.0 * df * df);
}

/* Paired over n prompts: the mean of f(a[i]) - f(b[i]) (f = |x| when `absolute`) and the
 * half-width of its 95 % t-interval; NaN for both when n < 2. */
static double paired_diff(double a, double b, int absolute)
{
    return absolute ? fabs(a) - fabs(b) : a - b;
}

void kvcap_report_paired(const double *a, const double *b, int n, int absolute, double *mean,
                         double *half)
{
    *mean = *half = NAN;
    if (n < 2)
        return;
    double sum = 0, sq = 0;
    for (int i = 0; i < n; i++)
        sum += paired_diff(a[i], b[i], absolute);
    const double m = sum / n;
    for (int i = 0; i < n; i++) {
        const double d = paired_diff(a[i], b[i], absolute) - m;
        sq += d * d;
    }
    *mean = m;
    *half = t975(n - 1) * sqrt(sq / (n - 1) / n);
}

/* Where the interval mean ± half lies: below 0, above 0, or across it. */
static enum versus paired_verdict(double mean, double half)
{
    return mean + half < 0 ? VS_CLOSER : mean - half > 0 ? VS_FARTHER : VS_TIED;
}

/* A paired difference's cell: the mean over prompts and ± the half-width of its 95 % interval,
 * green ("win") where the interval lies below 0, red ("lose") where above. */
static void paired_cell(struct buf *b, double mean, double half)
{
    static const char *const cls[] = {[VS_CLOSER] = "win", [VS_TIED] = "tie",
                                      [VS_FARTHER] = "lose"};
    char v[48];
    bprintf(b, "<td class=\"%s\">%s<br><span class=\"unit\">&plusmn;%.4f</span></td>",
            cls[paired_verdict(mean, half)], fmt_signed(v, sizeof v, mean, 4), half);
}

static double approx_text_width(const char *s, double font_px)
{
    size_t chars = 0;
    for (; *s; s++)
        chars += ((unsigned char)*s & 0xC0) != 0x80; /* UTF-8 lead bytes */
    return (double)chars * font_px * 0.58;
}

/* A run's name in figures: "KVCapsule (tiled) @ 0.40". */
static void run_name(struct buf *b, const struct run *u)
{
    besc(b, u->label);
    bprintf(b, " @ %.2f", u->retention);
}

static int is_reference(const struct report *r, const struct run *u)
{
    return r->curves[u->curve].reference;
}

/* Where a run sits on the memory axis: its realised retention, or its target when the metrics
 * have none. Plots use it for x, the summary shows it. */
static double realised_or_target(const struct run *u)
{
    return isfinite(u->realised) ? u->realised : u->retention;
}

/* Whether the realised retention is more than 2 % (relative) away from the target: such a row
 * is not at an equal budget with its neighbours and is flagged. */
static int off_target(const struct run *u)
{
    return isfinite(u->realised) && fabs(u->realised / u->retention - 1) > 0.02;
}

/* The full-cache run (the first of the reference curve), or NULL. */
static const struct run *full_run(const struct report *r)
{
    for (int i = 0; i < r->n_runs; i++)
        if (is_reference(r, r->sorted[i]))
            return r->sorted[i];
    return NULL;
}

static int any_task(const struct report *r)
{
    for (int i = 0; i < r->n_runs; i++)
        if (isfinite(r->runs[i].task_accuracy))
            return 1;
    return 0;
}

/* -1 when `a` ranks first: larger first (or smaller first with `ascending`), NaN last. */
static int cmp_measure(double a, double b, int ascending)
{
    if (isnan(a) || isnan(b))
        return isnan(a) == isnan(b) ? 0 : isnan(a) ? 1 : -1;
    if (a == b)
        return 0;
    return (a > b) != ascending ? -1 : 1;
}

/* The summary's order: task accuracy high to low, then KL low to high, then id. */
static int cmp_rank(const void *pa, const void *pb)
{
    const struct run *a = *(const struct run *const *)pa, *b = *(const struct run *const *)pb;
    int c = cmp_measure(a->task_accuracy, b->task_accuracy, 0);
    if (!c)
        c = cmp_measure(a->kl, b->kl, 1);
    return c ? c : strcmp(a->id, b->id);
}

/* The distinct targets of the compressed runs, ascending, into `out` (room for n_runs). */
static int targets_of(const struct report *r, double *out)
{
    int n = 0;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        int seen = 0;
        for (int k = 0; k < n; k++)
            seen |= out[k] == u->retention;
        if (!is_reference(r, u) && !seen)
            out[n++] = u->retention;
    }
    for (int i = 1; i < n; i++)
        for (int k = i; k > 0 && out[k - 1] > out[k]; k--) {
            double t = out[k];
            out[k] = out[k - 1];
            out[k - 1] = t;
        }
    return n;
}

/* The compressed runs at target `t`, ranked, into `out`; their count. */
static int ranked_at(const struct report *r, double t, const struct run **out)
{
    int n = 0;
    for (int i = 0; i < r->n_runs; i++)
        if (!is_reference(r, r->sorted[i]) && r->sorted[i]->retention == t)
            out[n++] = r->sorted[i];
    qsort(out, (size_t)n, sizeof *out, cmp_rank);
    return n;
}

/* The random-eviction run at target `t` (the floor every policy must clear), or NULL. */
static const struct run *random_at(const struct report *r, double t)
{
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = &r->runs[i];
        if (!is_reference(r, u) && !strcmp(u->policy, "random") && fabs(u->retention - t) < 1e-9)
            return u;
    }
    return NULL;
}

/* Run u against random eviction at its target, paired over the prompts: *mean is u's KL minus
 * random's (mean over prompts), *half the half-width of its 95 % t-interval, and the verdict
 * paired_verdict's; VS_NONE when there is nothing to pair (u is random or full, no random run
 * at u's target, or either lacks per-prompt KL for the same prompts). */
static enum versus versus_random(const struct report *r, const struct run *u, double *mean,
                                 double *half)
{
    *mean = *half = NAN;
    const struct run *rnd = is_reference(r, u) ? NULL : random_at(r, u->retention);
    if (!rnd || rnd == u || !u->pp_kl || !rnd->pp_kl || u->n_pp != rnd->n_pp)
        return VS_NONE;
    kvcap_report_paired(u->pp_kl, rnd->pp_kl, u->n_pp, 0, mean, half);
    return isfinite(*mean) && isfinite(*half) ? paired_verdict(*mean, *half) : VS_NONE;
}

static void swatch(struct buf *b, const struct curve *c)
{
    bprintf(b, "<span class=\"sw%s\" style=\"%s:%s\"></span>", c->extension ? " ext" : "",
            c->extension ? "border-color" : "background", c->color);
}

/* "kvcapsule tiled" plus a tag when it is kvcap's own variant. */
static void policy_name(struct buf *b, const struct report *r, const struct run *u)
{
    swatch(b, &r->curves[u->curve]);
    besc(b, u->label);
    if (u->extension)
        bputs(b, " <span class=\"ext-tag\">kvcap extension</span>");
    if (u->shipped)
        bputs(b, " <span class=\"ship-tag\" title=\"chosen on calibration and development data "
                 "before this split was run\">shipped</span>");
}

/* KL in nats with enough digits for small values: "0.273", "0.0155", "4.2e-05". */
static const char *fmt_kl(char *out, size_t cap, double v)
{
    if (v == 0)
        snprintf(out, cap, "0");
    else if (v >= 0.1)
        snprintf(out, cap, "%.3f", v);
    else
        snprintf(out, cap, "%.2g", v);
    return out;
}

/* ---- HTML: header, ranking, what was measured ---------------------------------------------- */

/* Whether the prompts come from the data the compressors were fitted on: the image track's
 * calibration photos (--photos calibration), or text documents that are all calibration
 * documents. Such a run is for choosing a setting, not for judging one. */
static int on_calibration_data(const struct report *r)
{
    if (r->image)
        return r->calibration_photos;
    if (!r->heldout_files || !r->calibration_files || !r->heldout_files->child)
        return 0;
    const cJSON *h, *c;
    cJSON_ArrayForEach(h, r->heldout_files)
    {
        int found = 0;
        cJSON_ArrayForEach(c, r->calibration_files) found |= !strcmp(h->valuestring, c->valuestring);
        if (!found)
            return 0;
    }
    return 1;
}

/* 0-based place of u among the ranked rows. */
static int rank_of(const struct run **ranked, int n, const struct run *u)
{
    for (int i = 0; i < n; i++)
        if (ranked[i] == u)
            return i;
    return n;
}

/* The summary's sentence on the floor: how many compressed rows are closer to full than random
 * eviction at the same budget (paired over the prompts, 95 %), naming the others. Nothing when
 * no row can be paired with a random run. */
static void versus_summary(struct buf *b, const struct report *r)
{
    int count[4] = {0};
    for (int i = 0; i < r->n_runs; i++) {
        double m, h;
        count[versus_random(r, r->sorted[i], &m, &h)]++;
    }
    const int paired = count[VS_CLOSER] + count[VS_TIED] + count[VS_FARTHER];
    if (!paired)
        return;
    bputs(b, " Against random eviction at the same budget (KL, paired over the prompts, "
             "95&nbsp;% interval): ");
    if (count[VS_CLOSER] == paired) {
        bprintf(b, "all %d compressed rows are closer to full.", paired);
        return;
    }
    bprintf(b, "%d of %d compressed rows are closer to full", count[VS_CLOSER], paired);
    static const enum versus others[2] = {VS_TIED, VS_FARTHER};
    static const char *const what[2] = {"not separated from it", "farther"};
    for (int k = 0; k < 2; k++) {
        if (!count[others[k]])
            continue;
        bprintf(b, "; %s: ", what[k]);
        const struct run *prev = NULL; /* a label's runs in a row: "vlcache @ 0.40, 0.60" */
        for (int i = 0; i < r->n_runs; i++) {
            const struct run *u = r->sorted[i];
            double m, h;
            if (versus_random(r, u, &m, &h) != others[k])
                continue;
            if (prev && !strcmp(prev->label, u->label))
                bprintf(b, ", %.2f", u->retention);
            else {
                bputs(b, prev ? "; " : "");
                run_name(b, u);
            }
            prev = u;
        }
    }
    bputs(b, ".");
}

/* The split the prompts come from, as the summary names it. */
static const char *split_word(const struct report *r)
{
    if (on_calibration_data(r))
        return "calibration";
    return r->split && strcmp(r->split, "calibration") != 0 ? r->split : "held-out";
}

static int any_shipped(const struct report *r)
{
    for (int i = 0; i < r->n_runs; i++)
        if (r->runs[i].shipped)
            return 1;
    return 0;
}

/* One row's score in the summary: task accuracy when the run measured the task, else KL. */
static void headline_score(struct buf *b, const struct run *u, int task)
{
    char n1[32];
    if (task && isfinite(u->task_accuracy))
        bprintf(b, "%.1f&nbsp;%% task accuracy, KL %s", 100 * u->task_accuracy,
                isfinite(u->kl) ? fmt_kl(n1, sizeof n1, u->kl) : "not measured");
    else
        bprintf(b, "KL %s", isfinite(u->kl) ? fmt_kl(n1, sizeof n1, u->kl) : "not measured");
}

/* The headline when a row was chosen in advance (kvcap-eval --shipped): at each budget, that
 * row against the best of the papers' methods, paired over the prompts; then the best row of
 * this report, said to be chosen after the fact. */
static void headline_shipped(struct buf *b, const struct report *r, const double *targets,
                             int n_targets, const struct run **ranked)
{
    const int task = any_task(r);
    bprintf(b, " kvcap&rsquo;s shipped configuration, <strong>");
    besc(b, r->shipped ? r->shipped : "");
    bputs(b, "</strong>, was chosen on calibration and development data before this run");
    for (int k = 0; k < n_targets; k++) {
        const int n = ranked_at(r, targets[k], ranked);
        const struct run *ship = NULL, *paper = NULL;
        for (int i = 0; i < n; i++) {
            if (ranked[i]->shipped && !ship)
                ship = ranked[i];
            if (!ranked[i]->extension && strcmp(ranked[i]->policy, "random") != 0 && !paper)
                paper = ranked[i];
        }
        bprintf(b, "%s %.0f&nbsp;%% of the span, ", k ? "; keeping" : ". Keeping", 100 * targets[k]);
        if (!ship) {
            bputs(b, "it has no row");
        } else {
            bprintf(b, "it ranks %d of %d (", 1 + rank_of(ranked, n, ship),
                    n);
            headline_score(b, ship, task);
            bputs(b, ")");
        }
        if (paper) {
            bputs(b, ", the best paper method ");
            besc(b, paper->label);
            bputs(b, " (");
            headline_score(b, paper, task);
            bputs(b, ")");
        }
        double m, h;
        if (ship && paper && ship->pp_kl && paper->pp_kl && ship->n_pp == paper->n_pp) {
            kvcap_report_paired(ship->pp_kl, paper->pp_kl, ship->n_pp, 0, &m, &h);
            if (isfinite(m) && isfinite(h)) {
                static const char *const verdict[] = {[VS_NONE] = "", [VS_CLOSER] = "closer to "
                                                      "full", [VS_TIED] = "not separated from it",
                                                      [VS_FARTHER] = "farther from full"};
                char n1[32], n2[32];
                bprintf(b, ": shipped minus it, KL %s&nbsp;&plusmn;&nbsp;%s (paired, 95&nbsp;%%), %s",
                        fmt_kl(n1, sizeof n1, m),
                        fmt_kl(n2, sizeof n2, h), verdict[paired_verdict(m, h)]);
            }
        }
        if (n > 0 && ranked[0] != ship && ranked[0] != paper) {
            bputs(b, "; best row here, picked after the fact: ");
            besc(b, ranked[0]->label);
            bputs(b, " (");
            headline_score(b, ranked[0], task);
            bputs(b, ")");
        }
    }
    bputs(b, ".");
}

static void render_header(struct buf *b, const struct report *r)
{
    char n1[32], n2[32];
    bputs(b, "<header>\n<h1>");
    besc(b, r->title);
    bputs(b, "</h1>\n<p class=\"meta\">");
    if (r->created) {
        bputs(b, "Created ");
        besc(b, r->created);
        bputs(b, " &middot; ");
    }
    bputs(b, "kvcap-report from <code>");
    const char *base = strrchr(r->path, '/');
    besc(b, base ? base + 1 : r->path);
    bputs(b, "</code></p>\n");

    /* What was measured, then the answer to "which policy should I use at this budget". */
    bputs(b, "<p class=\"summary\">");
    if (r->model_name) {
        bputs(b, "<strong>");
        besc(b, r->model_name);
        bputs(b, "</strong>");
    } else {
        bputs(b, "The model");
    }
    const int calibration = on_calibration_data(r);
    const char *split = split_word(r);
    bputs(b, " was evaluated");
    if (isfinite(r->prompts))
        bprintf(b, " on %s %s prompt%s", fmt_count(n1, sizeof n1, r->prompts), split,
                r->prompts == 1 ? "" : "s");
    bputs(b, ": each policy compressed the cache of ");
    if (r->image && isfinite(r->grid_rows) && isfinite(r->grid_cols))
        bprintf(b, "an image span of %.0f&thinsp;&times;&thinsp;%.0f tokens (a %s photo's "
                   "patch features, projected into the embedding space in closed form: not a "
                   "trained connector)", r->grid_rows, r->grid_cols, split);
    else if (isfinite(r->span_tokens))
        bprintf(b, "a %s-token %sspan", fmt_count(n1, sizeof n1, r->span_tokens),
                r->image ? "image " : "text ");
    else
        bputs(b, "the prompt's compressible span");
    bputs(b, " to a target share (the memory budget)");
    if (r->has_task && isfinite(r->task_queries))
        bprintf(b, ", then answered %s retrieval question%s about lines inside the span",
                fmt_count(n1, sizeof n1, r->task_queries), r->task_queries == 1 ? "" : "s");
    if (isfinite(r->continuation_tokens))
        bprintf(b, "; %s held-out tokens were scored teacher-forced against full's (KL, NLL)",
                fmt_count(n2, sizeof n2, r->continuation_tokens));
    bputs(b, ".");
    if (calibration)
        bprintf(b, " <strong>These prompts come from the %s the compressors were fitted on: the "
                   "run is for choosing a setting, not for judging one.</strong>",
                r->image ? "photos" : "documents");
    else if (r->split && !strcmp(r->split, "development"))
        bprintf(b, " <strong>Development split: kvcap&rsquo;s designs and settings were chosen "
                   "looking at these %s, so its rows here are optimistic; the test split judges "
                   "them.</strong>", r->image ? "photos" : "documents");
    else if (r->split && !strcmp(r->split, "test"))
        bprintf(b, " <strong>Test split: %s never looked at before kvcap&rsquo;s shipped "
                   "configuration was fixed on calibration and development data.</strong>",
                r->image ? "photos" : "documents");

    const struct run *full = full_run(r);
    double *targets = malloc(sizeof *targets * (size_t)r->n_runs);
    const struct run **ranked = malloc(sizeof *ranked * (size_t)r->n_runs);
    if (!targets || !ranked) {
        b->failed = 1;
        free(targets);
        free(ranked);
        return;
    }
    int n_targets = targets_of(r, targets), task = any_task(r);
    if (any_shipped(r)) {
        headline_shipped(b, r, targets, n_targets, ranked);
        n_targets = 0; /* the post-hoc best is said there, labelled */
    }
    for (int k = 0; k < n_targets; k++) {
        int n = ranked_at(r, targets[k], ranked); /* n >= 1: a target is some run's */
        const struct run *u = ranked[0];
        bprintf(b, "%s %.0f&nbsp;%% of the span: <strong>", k ? ";" : " Best when keeping",
                100 * targets[k]);
        besc(b, u->label);
        bputs(b, "</strong> (");
        if (u->extension)
            bputs(b, "a kvcap extension, ");
        if (task && isfinite(u->task_accuracy))
            bprintf(b, "%.1f&nbsp;%% task accuracy", 100 * u->task_accuracy);
        else
            bprintf(b, "KL %s", isfinite(u->kl) ? fmt_kl(n1, sizeof n1, u->kl) : "not measured");
        /* When kvcap's own variant wins, the best of the papers' methods too. */
        for (int i = 1; u->extension && i < n; i++) {
            const struct run *p = ranked[i];
            if (p->extension)
                continue;
            bputs(b, "; best paper method ");
            besc(b, p->label);
            if (task && isfinite(p->task_accuracy))
                bprintf(b, ", %.1f&nbsp;%%", 100 * p->task_accuracy);
            else if (isfinite(p->kl))
                bprintf(b, ", KL %s", fmt_kl(n1, sizeof n1, p->kl));
            break;
        }
        bputs(b, ")");
    }
    if (n_targets)
        bputs(b, ".");
    if (n_targets && full && task && isfinite(full->task_accuracy))
        bprintf(b, " Full, the ceiling, answers %.1f&nbsp;%%.", 100 * full->task_accuracy);
    versus_summary(b, r);
    bputs(b, "</p>\n");
    bputs(b, "</header>\n");
    free(targets);
    free(ranked);
}

/* A task accuracy as a bar out of 100 % with full's accuracy as a tick, then the number. */
static void accuracy_bar(struct buf *b, double a, double ceiling)
{
    bprintf(b, "<span class=\"ab\"><i style=\"width:%.1f%%\"></i>", 100 * a);
    if (isfinite(ceiling))
        bprintf(b, "<b style=\"left:%.1f%%\"></b>", 100 * ceiling);
    bprintf(b, "</span>%.1f&nbsp;%%", 100 * a);
}

/* One row of a ranking card; `rank` 0 for full's; `versus` adds the cell against random. */
static void rank_row(struct buf *b, const struct report *r, const struct run *u, int rank,
                     double ceiling, int versus)
{
    char n1[32];
    bprintf(b, "<tr class=\"%s\" title=\"", rank == 0 ? "ceiling" : rank == 1 ? "win" : "rk");
    besc(b, u->id);
    bputs(b, "\">");
    if (rank)
        bprintf(b, "<td>%d</td><td class=\"l\">", rank);
    else
        bputs(b, "<td></td><td class=\"l\">");
    policy_name(b, r, u);
    if (!rank)
        bputs(b, " <span class=\"unit\">(ceiling)</span>");
    if (isfinite(u->realised)) {
        bprintf(b, "</td><td%s>%.1f&nbsp;%%", off_target(u) ? " class=\"off\"" : "",
                100 * u->realised);
        if (isfinite(u->held) && fabs(u->held - u->realised) > 0.01) /* FreeKV: reads, holds */
            bprintf(b, "<br><span class=\"unit\">read; holds %.0f&nbsp;%%</span>", 100 * u->held);
        bputs(b, "</td>");
    } else {
        bputs(b, "</td><td class=\"na\">&mdash;</td>");
    }
    if (!any_task(r)) /* no task: the attention output's fidelity in its place */
        if (isfinite(u->cos_mean))
            bprintf(b, "<td>%.4f</td>", u->cos_mean);
        else
            bputs(b, "<td class=\"na\">&mdash;</td>");
    else if (isfinite(u->task_accuracy)) {
        bputs(b, "<td class=\"acc\">");
        accuracy_bar(b, u->task_accuracy, ceiling);
        bputs(b, "</td>");
    } else {
        bputs(b, "<td class=\"na\">&mdash;</td>");
    }
    if (isfinite(u->kl) && u->n_seeds > 1 && isfinite(u->seed_kl_min)) {
        char n2[32], n3[32];
        bprintf(b, "<td>%s<br><span class=\"unit\" title=\"the mean KL of each of %d seeds\">"
                   "seeds %s&ndash;%s</span></td>", fmt_kl(n1, sizeof n1, u->kl), u->n_seeds,
                fmt_kl(n2, sizeof n2, u->seed_kl_min), fmt_kl(n3, sizeof n3, u->seed_kl_max));
    } else if (isfinite(u->kl)) {
        bprintf(b, "<td>%s</td>", fmt_kl(n1, sizeof n1, u->kl));
    } else {
        bputs(b, "<td class=\"na\">&mdash;</td>");
    }
    if (isfinite(u->token_agreement))
        bprintf(b, "<td class=\"sec\">%.1f&nbsp;%%</td>", 100 * u->token_agreement);
    else
        bputs(b, "<td class=\"na\">&mdash;</td>");
    double m, h;
    if (versus && rank && !strcmp(u->policy, "random"))
        bputs(b, "<td class=\"unit\">the floor</td>");
    else if (versus && versus_random(r, u, &m, &h) != VS_NONE)
        paired_cell(b, m, h);
    else if (versus)
        bputs(b, "<td class=\"na\">&mdash;</td>");
    bputs(b, "</tr>\n");
}

/* Per target retention, a card ranking the policies by task accuracy, then KL. */
static void render_ranking(struct buf *b, const struct report *r)
{
    double *targets = malloc(sizeof *targets * (size_t)r->n_runs);
    const struct run **ranked = malloc(sizeof *ranked * (size_t)r->n_runs);
    if (!targets || !ranked) {
        b->failed = 1;
        free(targets);
        free(ranked);
        return;
    }
    const struct run *full = full_run(r);
    int n_targets = targets_of(r, targets), task = any_task(r);
    double ceiling = full ? full->task_accuracy : NAN;
    bputs(b, "<section class=\"ranking\">\n<h2>Which policy wins at each memory budget</h2>\n");
    if (!n_targets)
        bputs(b, "<p class=\"caption\">No compressed runs to rank.</p>\n");
    bputs(b, "<div class=\"rank-grid\">\n");
    int any_versus = 0;
    for (int k = 0; k < n_targets; k++) {
        int n = ranked_at(r, targets[k], ranked);
        const struct run *rnd = random_at(r, targets[k]);
        const int versus = rnd && rnd->pp_kl;
        any_versus |= versus;
        bprintf(b, "<div class=\"rank-card\"><div class=\"rank-head\">Keep %.0f&nbsp;%% of the span"
                   " <span class=\"unit\">&middot; %.3g&times; smaller</span></div>\n"
                   "<table class=\"rank\"><thead><tr><th>#</th><th class=\"l\">Policy</th>"
                   "<th>Realised<br>retention</th>%s"
                   "<th>KL<br><span class=\"unit\">nats</span></th>"
                   "<th class=\"sec\">Greedy<br>agreement</th>%s</tr></thead>\n<tbody>\n",
                100 * targets[k], 1 / targets[k],
                task ? "<th class=\"l\">Task accuracy</th>"
                     : "<th>Attention<br><span class=\"unit\">cosine</span></th>",
                versus ? "<th>KL&nbsp;&minus;<br>random&rsquo;s</th>" : "");
        if (full)
            rank_row(b, r, full, 0, ceiling, versus);
        for (int i = 0; i < n; i++)
            rank_row(b, r, ranked[i], i + 1, ceiling, versus);
        bputs(b, "</tbody></table>");
        const cJSON *ur;
        cJSON_ArrayForEach(ur, r->unreached)
        {
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(ur, "retention");
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(ur, "floor");
            const cJSON *pol = cJSON_GetObjectItemCaseSensitive(ur, "policy");
            if (fabs(t->valuedouble - targets[k]) > 1e-9)
                continue;
            bputs(b, "<p class=\"caption\"><b>");
            besc(b, pol->valuestring);
            bprintf(b, "</b> has no row here: at its fewest pages it reads %.0f&nbsp;%% of the "
                       "span per step (its page digests and the pages it must attend).</p>",
                    100 * f->valuedouble);
        }
        bputs(b, "</div>\n");
    }
    bputs(b, "</div>\n<p class=\"caption\">");
    if (task)
        bputs(b, "Ranked by task accuracy (answers equal to the true value; the bar's black tick "
                 "is full's accuracy, the ceiling), then by KL divergence from full's next-token "
                 "distribution (lower is better). ");
    else
        bputs(b, "No run measured the retrieval task: ranked by KL divergence from full's "
                 "next-token distribution (lower is better); the attention cosine is the mean "
                 "over layers of the attention output's cosine with full's on replayed decode "
                 "steps. ");
    bputs(b, "Rows at one budget hold the same share of the span: the realised retention (span "
             "bytes held over full's; for eviction the share of span tokens kept; for FreeKV, "
             "which holds the whole span and its page digests, the span bytes a decode step "
             "reads, measured, its pages chosen to match the target) is within about 2&nbsp;% of "
             "the target, and shown <span class=\"key off\">amber</span> where it is not. "
             "Random eviction&rsquo;s row is the mean of its seeds, prompt by prompt; under its "
             "KL, the range of the seeds&rsquo; own means. Greedy agreement (share of "
             "generated tokens equal to full's) is secondary: it cascades after the first "
             "difference. Rows tagged <span class=\"ext-tag\">kvcap extension</span> are kvcap's "
             "own variants, not the papers' methods.");
    if (any_versus)
        bputs(b, " The last column pairs each row with random eviction at the same budget, the "
                 "floor every policy must clear: its KL minus random&rsquo;s, the mean over the "
                 "prompts &plusmn; the half-width of a 95&nbsp;% t-interval; <span class=\"win\">"
                 "green</span>: closer to full than random beyond that interval, <span "
                 "class=\"lose\">red</span>: farther, otherwise the prompts do not separate "
                 "them.");
    bputs(b, "</p>\n</section>\n");
    free(targets);
    free(ranked);
}

/* The track a report measured, for headings: "image 16 × 16" or "text 1 × 256". */
static void track_name(struct buf *b, const struct report *r)
{
    if (r->image && isfinite(r->grid_rows) && isfinite(r->grid_cols))
        bprintf(b, "image %.0f&thinsp;&times;&thinsp;%.0f", r->grid_rows, r->grid_cols);
    else if (r->image)
        bputs(b, "image");
    else if (isfinite(r->span_tokens))
        bprintf(b, "text 1&thinsp;&times;&thinsp;%.0f", r->span_tokens);
    else
        bputs(b, "text");
    if (r->split) /* the same track on two splits: which is which */
        bprintf(b, "<br><span class=\"unit\">%s</span>", split_word(r));
}

static const struct run *run_by_id(const struct report *r, const char *id)
{
    for (int i = 0; i < r->n_runs; i++)
        if (!strcmp(r->runs[i].id, id))
            return &r->runs[i];
    return NULL;
}

/* With other tracks given (kvcap_report_write_tracks): every run of this report beside the run
 * of the same id in each other track, realised retention, KL and attention cosine. */
static void render_tracks(struct buf *b, const struct report *r)
{
    if (!r->others || !r->others[0])
        return;
    int n_tracks = 1;
    while (r->others[n_tracks - 1])
        n_tracks++;
    bputs(b, "<section>\n<h2>Tracks side by side</h2>\n<table class=\"tracks\">\n<thead><tr>"
             "<th class=\"l\" rowspan=\"2\">Run</th>");
    for (int t = 0; t < n_tracks; t++) {
        const struct report *x = t ? r->others[t - 1] : r;
        bputs(b, "<th colspan=\"3\" class=\"grp\">");
        track_name(b, x);
        bputs(b, "</th>");
    }
    bputs(b, "</tr>\n<tr>");
    for (int t = 0; t < n_tracks; t++)
        bputs(b, "<th class=\"grp\">Realised<br>retention</th><th>KL<br><span class=\"unit\">"
                 "nats</span></th><th>Attention<br><span class=\"unit\">cosine</span></th>");
    bputs(b, "</tr></thead>\n<tbody>\n");
    char n1[32];
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        bputs(b, "<tr><td class=\"l\">");
        policy_name(b, r, u);
        if (!is_reference(r, u))
            bprintf(b, " <span class=\"unit\">@%.2f</span>", u->retention);
        bputs(b, "</td>");
        for (int t = 0; t < n_tracks; t++) {
            const struct run *v = t ? run_by_id(r->others[t - 1], u->id) : u;
            if (!v) {
                bputs(b, "<td class=\"na grp\">&mdash;</td><td class=\"na\">&mdash;</td>"
                         "<td class=\"na\">&mdash;</td>");
                continue;
            }
            if (isfinite(v->realised))
                bprintf(b, "<td class=\"grp\">%.1f&nbsp;%%</td>", 100 * v->realised);
            else
                bputs(b, "<td class=\"na grp\">&mdash;</td>");
            if (isfinite(v->kl))
                bprintf(b, "<td>%s</td>", fmt_kl(n1, sizeof n1, v->kl));
            else
                bputs(b, "<td class=\"na\">&mdash;</td>");
            if (isfinite(v->cos_mean))
                bprintf(b, "<td>%.4f</td>", v->cos_mean);
            else
                bputs(b, "<td class=\"na\">&mdash;</td>");
        }
        bputs(b, "</tr>\n");
    }
    bputs(b, "</tbody></table>\n<p class=\"caption\">The same policies and retentions on each "
             "track: what the span holds changes which compression keeps the model's answers. "
             "KL: mean divergence of the teacher-forced next-token distribution from full's on "
             "the held-out continuations (lower is better); attention cosine: the attention "
             "output's cosine with full's on replayed decode steps, mean over layers (higher is "
             "better). Each track's own report has its full table.</p>\n</section>\n");
}

/* Model, corpus, setup, the task, goals and the command: what a reader checks before trusting
 * the numbers. */
static void render_facts(struct buf *b, const struct report *r)
{
    char n1[32];
    bputs(b, "<section>\n<h2>What was measured</h2>\n<dl class=\"facts\">\n");
    if (r->model_name || r->model_file || r->n_layers) {
        bputs(b, "<dt>Model</dt><dd>");
        if (r->model_name)
            besc(b, r->model_name);
        if (r->model_file) {
            bputs(b, " <code>");
            besc(b, r->model_file);
            bputs(b, "</code>");
        }
        if (r->n_layers)
            bprintf(b, " &middot; %d layers", r->n_layers);
        if (isfinite(r->q_heads) && isfinite(r->kv_heads))
            bprintf(b, " &middot; %.0f query / %.0f KV heads", r->q_heads, r->kv_heads);
        if (isfinite(r->head_dim))
            bprintf(b, " &middot; head dim %.0f", r->head_dim);
        bputs(b, "</dd>\n");
    }
    if (r->corpus_source || r->calibration_files || r->heldout_files) {
        const cJSON *e;
        bputs(b, "<dt>Corpus</dt><dd>");
        if (r->corpus_source)
            besc(b, r->corpus_source);
        const struct {
            const char *name;
            const cJSON *files;
            double tokens;
        } parts[] = {{"calibration", r->calibration_files, r->calibration_tokens},
                     {r->split ? r->split : "held out", r->heldout_files, r->heldout_tokens}};
        for (int k = 0; k < 2; k++) {
            if (!parts[k].files && !isfinite(parts[k].tokens))
                continue;
            bprintf(b, " &middot; %s:", parts[k].name);
            int first = 1;
            cJSON_ArrayForEach(e, parts[k].files)
            {
                bputs(b, first ? " " : ", ");
                besc(b, e->valuestring);
                first = 0;
            }
            if (isfinite(parts[k].tokens))
                bprintf(b, " (%s tokens)", fmt_count(n1, sizeof n1, parts[k].tokens));
        }
        bputs(b, "</dd>\n");
    }
    if (r->image) {
        bputs(b, "<dt>Images</dt><dd>");
        if (isfinite(r->photos))
            bprintf(b, "%.0f photos", r->photos);
        if (isfinite(r->heldout_photos))
            bprintf(b, " (%.0f held out, never calibrated on)", r->heldout_photos);
        if (r->calibration_photos)
            bputs(b, " &middot; these prompts show the calibration photos");
        if (isfinite(r->calibration_crops) && isfinite(r->heldout_crops))
            bprintf(b, " &middot; %.0f calibration and %.0f held-out crops", r->calibration_crops,
                    r->heldout_crops);
        if (isfinite(r->grid_rows) && isfinite(r->grid_cols))
            bprintf(b, " &middot; %.0f&thinsp;&times;&thinsp;%.0f patch grid", r->grid_rows,
                    r->grid_cols);
        if (r->features) {
            bputs(b, " <code>");
            besc(b, r->features);
            bputs(b, "</code>");
        }
        bputs(b, "</dd>\n");
    }
    if (r->has_task) {
        bputs(b, "<dt>Task</dt><dd>");
        besc(b, r->task_name ? r->task_name : "retrieval");
        if (r->task_haystack) {
            bputs(b, " &middot; ");
            besc(b, r->task_haystack);
        }
        if (r->task_line) {
            bputs(b, " &middot; a line: <q>");
            besc(b, r->task_line);
            bputs(b, "</q>");
        }
        if (r->task_question) {
            bputs(b, " &middot; asked: <q>");
            besc(b, r->task_question);
            bputs(b, "</q>");
        }
        if (isfinite(r->task_queries))
            bprintf(b, " &middot; %s queries", fmt_count(n1, sizeof n1, r->task_queries));
        if (isfinite(r->task_answer_tokens))
            bprintf(b, ", each answered in %s greedy tokens and exact-matched",
                    fmt_count(n1, sizeof n1, r->task_answer_tokens));
        if (r->n_depths)
            bprintf(b, " &middot; the asked line at %d depths of the span", r->n_depths);
        bputs(b, "</dd>\n");
    }
    const struct {
        const char *fmt;
        double v;
    } setup[] = {{"head %s tokens", r->head_tokens},
                 {"span %s tokens", r->span_tokens},
                 {"tail %s tokens", r->tail_tokens},
                 {"%s generated greedily", r->generate_tokens},
                 {"%s continuation tokens scored teacher-forced", r->continuation_tokens},
                 {"%s decode steps replayed for attention fidelity", r->fidelity_steps},
                 {"%s prompts", r->prompts},
                 {"%s threads", r->threads}};
    int any = r->storage || isfinite(r->read_bandwidth_gbs);
    for (size_t k = 0; k < sizeof setup / sizeof setup[0]; k++)
        any |= isfinite(setup[k].v);
    if (any) {
        bputs(b, "<dt>Setup</dt><dd>");
        const char *sep = "";
        for (size_t k = 0; k < sizeof setup / sizeof setup[0]; k++) {
            if (!isfinite(setup[k].v))
                continue;
            bputs(b, sep);
            bprintf(b, setup[k].fmt, fmt_count(n1, sizeof n1, setup[k].v));
            sep = " &middot; ";
        }
        if (r->storage) {
            bprintf(b, "%sstorage ", sep);
            besc(b, r->storage);
            sep = " &middot; ";
        }
        if (isfinite(r->read_bandwidth_gbs))
            bprintf(b, "%sread bandwidth %.1f GB/s", sep, r->read_bandwidth_gbs);
        bputs(b, "</dd>\n");
    }
    bputs(b, "</dl>\n");

    if (r->n_goals) {
        int met = 0;
        for (int i = 0; i < r->n_goals; i++)
            met += r->goals[i].met;
        bprintf(b, "<h3>Goals: %d of %d met</h3>\n<ul class=\"goals\">\n", met, r->n_goals);
        for (int i = 0; i < r->n_goals; i++) {
            bprintf(b, "<li><span class=\"badge %s\">%s</span>",
                    r->goals[i].met ? "met" : "unmet", r->goals[i].met ? "met" : "not met");
            besc(b, r->goals[i].text);
            bputs(b, "</li>\n");
        }
        bputs(b, "</ul>\n");
    }
    if (r->command) {
        bputs(b, "<h3>Reproduce</h3>\n<pre>");
        besc(b, r->command);
        bputs(b, "</pre>\n");
    }
    bputs(b, "</section>\n");
}

/* ---- HTML: the headline table -------------------------------------------------------------- */

static void na_cell(struct buf *b)
{
    bputs(b, "<td class=\"na\">&mdash;</td>");
}

/* A fraction as a percentage, coloured green from 99 %, amber from 95 %, red below. */
static void agreement_cell(struct buf *b, double a)
{
    if (!isfinite(a)) {
        na_cell(b);
        return;
    }
    bprintf(b, "<td class=\"%s\">%.1f&nbsp;%%</td>",
            a >= 0.99 ? "ag-good" : a >= 0.95 ? "ag-warn" : "ag-bad", 100 * a);
}

static void render_notes(struct buf *b, const struct report *r)
{
    const cJSON *e;
    if (!r->notes || cJSON_GetArraySize(r->notes) == 0)
        return;
    bputs(b, "<ul class=\"notes\">\n");
    cJSON_ArrayForEach(e, r->notes)
    {
        bputs(b, "<li>");
        besc(b, e->valuestring);
        bputs(b, "</li>\n");
    }
    bputs(b, "</ul>\n");
}

/* A task accuracy coloured by how much of full's it keeps: green from 95 %, amber from 75 %. */
static void task_cell(struct buf *b, double a, double ceiling)
{
    if (!isfinite(a)) {
        na_cell(b);
        return;
    }
    double kept = ceiling > 0 ? a / ceiling : isfinite(ceiling) ? 1 : NAN;
    const char *cls = !isfinite(kept)  ? "plain"
                      : kept >= 0.95 ? "ag-good"
                      : kept >= 0.75 ? "ag-warn"
                                     : "ag-bad";
    bprintf(b, "<td class=\"%s\">%.1f&nbsp;%%</td>", cls, 100 * a);
}

static void share_cell(struct buf *b, double v)
{
    if (isfinite(v))
        bprintf(b, "<td>%.1f&nbsp;%%</td>", 100 * v);
    else
        na_cell(b);
}

enum { TABLE_COLUMNS = 13 };

static void render_table(struct buf *b, const struct report *r)
{
    char n1[32], d[48];
    const struct run *full = full_run(r);
    double ceiling = full ? full->task_accuracy : NAN;
    bputs(b, "<section>\n<h2>Headline results</h2>\n<div class=\"table-wrap\">"
             "<table class=\"runs\">\n<thead><tr><th class=\"l\">Policy</th><th>Target<br>retention</th>"
             "<th>Realised<br>retention<br><span class=\"unit\">of full's span</span></th>"
             "<th>Task<br>accuracy<br><span class=\"unit\">true answer</span></th>"
             "<th>Task<br>agreement<br><span class=\"unit\">with full</span></th>"
             "<th>KL<br>vs full<br><span class=\"unit\">nats/token</span></th>"
             "<th>&Delta;NLL<br>vs full<br><span class=\"unit\">nats/token</span></th>"
             "<th>Next-token<br>agreement<br><span class=\"unit\">");
    if (isfinite(r->continuation_tokens))
        bprintf(b, "%s teacher-forced", fmt_count(n1, sizeof n1, r->continuation_tokens));
    else
        bputs(b, "teacher-forced");
    bputs(b, "</span></th><th class=\"sec\">Greedy<br>agreement<br><span class=\"unit\">");
    if (isfinite(r->generate_tokens))
        bprintf(b, "%s generated", fmt_count(n1, sizeof n1, r->generate_tokens));
    else
        bputs(b, "generated tokens");
    bputs(b, "</span></th>"
             "<th>Bytes held<br><span class=\"unit\">% of full</span></th>"
             "<th>Step time<br><span class=\"unit\">vs full</span></th>"
             "<th>Prefill<br>cost<br><span class=\"unit\">vs prefill</span></th>"
             "<th>FreeKV<br>corrected /<br>re-selected /<br>hidden <span class=\"unit\">%</span>"
             "</th>"
             "</tr></thead>\n<tbody>\n");
    int group = -1; /* 0: full, 1: papers' methods, 2: kvcap's extensions */
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        const struct curve *cv = &r->curves[u->curve];
        int g = cv->reference ? 0 : cv->extension ? 2 : 1;
        if (g != group && g > 0)
            bprintf(b, "<tr class=\"group\"><td class=\"l\" colspan=\"%d\">%s</td></tr>\n",
                    TABLE_COLUMNS,
                    g == 1 ? "The papers&rsquo; methods"
                           : "kvcap&rsquo;s extensions &mdash; its own variants, not the "
                             "papers&rsquo; methods");
        int first = i > 0 && g == group && r->sorted[i - 1]->curve != u->curve;
        group = g;
        bprintf(b, "<tr class=\"run%s%s\" title=\"", first ? " first" : "",
                u->extension ? " ext" : "");
        besc(b, u->id);
        bputs(b, "\"><td class=\"l\">");
        policy_name(b, r, u);
        bprintf(b, "</td><td>%.2f", u->retention);
        if (isfinite(u->nominal) && fabs(u->nominal - u->retention) > 5e-4)
            bprintf(b, "<br><span class=\"unit\">nominal %.5g</span>", u->nominal);
        bputs(b, "</td>");
        if (isfinite(u->realised))
            bprintf(b, "<td%s>%.1f&nbsp;%%</td>", off_target(u) ? " class=\"off\"" : "",
                    100 * u->realised);
        else
            na_cell(b);
        task_cell(b, u->task_accuracy, ceiling);
        share_cell(b, u->task_agreement);
        if (isfinite(u->kl))
            bprintf(b, "<td>%s</td>", fmt_kl(n1, sizeof n1, u->kl));
        else
            na_cell(b);
        if (isfinite(u->nll_delta))
            bprintf(b, "<td>%s</td>", fmt_signed(d, sizeof d, u->nll_delta, 4));
        else
            na_cell(b);
        agreement_cell(b, u->next_token_agreement);
        if (isfinite(u->token_agreement))
            bprintf(b, "<td class=\"sec\">%.1f&nbsp;%%</td>", 100 * u->token_agreement);
        else
            na_cell(b);
        double held = ratio(u->bytes_held, u->bytes_held_full);
        if (isfinite(held))
            bprintf(b, "<td title=\"%.2f MiB\">%.1f&nbsp;%%</td>", u->bytes_held / 1048576.0,
                    100 * held);
        else
            na_cell(b);
        double step = ratio(u->step_ms, u->step_ms_full);
        if (isfinite(step))
            bprintf(b, "<td>%.2f&times;</td>", step);
        else
            na_cell(b);
        if (isfinite(u->prefill_cost) && u->prefill_cost > 0)
            bprintf(b, "<td>+%.*f&times;</td>", u->prefill_cost < 0.01 ? 4 : 2, u->prefill_cost);
        else
            na_cell(b);
        if (u->has_freekv) {
            bputs(b, "<td class=\"fk\">");
            const double fk[3] = {u->fk_corrected, u->fk_reselected, u->fk_hidden};
            for (int k = 0; k < 3; k++) {
                if (isfinite(fk[k]))
                    bprintf(b, "%s%.1f", k ? " / " : "", 100 * fk[k]);
                else
                    bprintf(b, "%s&mdash;", k ? " / " : "");
            }
            bputs(b, "&nbsp;%</td>");
        } else {
            na_cell(b);
        }
        bputs(b, "</tr>\n");
    }
    bputs(b, "</tbody></table></div>\n");
    render_notes(b, r);
    bputs(b, "<p class=\"caption\">One row per run, grouped by policy: full, then the papers' "
             "methods, then kvcap's extensions. The target is the share of the span a run was "
             "asked to keep; where the policy's own parameter differs (VL-Cache's alpha, searched "
             "because its Algorithm&nbsp;1 under-fills the budget) it is shown as nominal. The "
             "realised retention is what it holds (span bytes over full's; for eviction the "
             "share of span tokens kept; for FreeKV the share attended per step), "
             "<span class=\"key off\">amber</span> when more than 2&nbsp;% off the target. "
             "Task accuracy is coloured by the share of full's accuracy it keeps: "
             "<span class=\"key ag-good\">&ge;&nbsp;95&nbsp;%</span> "
             "<span class=\"key ag-warn\">&ge;&nbsp;75&nbsp;%</span> "
             "<span class=\"key ag-bad\">below</span>. KL and &Delta;NLL are per held-out token, "
             "teacher-forced (both caches see the same text, no cascade); &Delta;NLL above zero "
             "predicts the text worse. Next-token agreement is the share of those positions "
             "whose most likely next token is full's, coloured "
             "<span class=\"key ag-good\">&ge;&nbsp;99&nbsp;%</span> "
             "<span class=\"key ag-warn\">&ge;&nbsp;95&nbsp;%</span> "
             "<span class=\"key ag-bad\">below</span>. Greedy agreement (grey, secondary) "
             "cascades: once one generated token differs the continuations part. Bytes held "
             "are all layers after prefill over full's (FreeKV keeps the whole span in host "
             "memory). Prefill cost is the compression work per prompt (scoring and eviction, "
             "KVCapsule's projection onto its bases, FreeKV's paging of the span; for kvzip "
             "also its context-reconstruction pass, the model run over the prompt again; not "
             "the storing of rows every policy does) over the model's prefill of the prompt. "
             "FreeKV's column holds the shares of (step, KV head) pairs whose "
             "speculative selection was corrected, re-selected synchronously, or fully hidden. "
             "Attention fidelity is in the plots and the per-layer heatmap below. &mdash; means "
             "not measured or not applicable.</p>\n</section>\n");
}

/* The shipped row (chosen in advance) at a target retention, else the best run of this report
 * there by KL from full (full excluded, picked after the fact), or NULL.
 * KL, not ΔNLL: a cache can predict the held-out text better than full (ΔNLL below zero, as
 * on the image track, where the span means little to the model) while departing from it. */
static const struct run *best_at(const struct report *r, double retention)
{
    for (int i = 0; i < r->n_runs; i++) /* kvcap's configuration chosen in advance, first */
        if (r->runs[i].shipped && fabs(r->runs[i].retention - retention) < 1e-9)
            return &r->runs[i];
    const struct run *best = NULL;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = &r->runs[i];
        if (is_reference(r, u) || fabs(u->retention - retention) > 1e-9 || !isfinite(u->kl))
            continue;
        if (!best || u->kl < best->kl)
            best = u;
    }
    return best;
}

/* Two cells: kvcap's best row minus another, paired over the prompts, for KL and |ΔNLL|:
 * the mean and its 95 % interval, green where the interval is below 0 (kvcap's best closer to
 * full), red where above; a dash without per-prompt values on both sides. */
static void paired_cells(struct buf *b, const struct run *best, const double *kl,
                         const double *dnll, int n)
{
    const double *ours[2] = {best ? best->pp_kl : NULL, best ? best->pp_dnll : NULL};
    const double *theirs[2] = {kl, dnll};
    for (int k = 0; k < 2; k++) {
        double m = NAN, h = NAN;
        if (ours[k] && theirs[k] && best->n_pp == n)
            kvcap_report_paired(ours[k], theirs[k], n, k == 1, &m, &h);
        if (!isfinite(m) || !isfinite(h))
            bputs(b, "<td>&mdash;</td>");
        else
            paired_cell(b, m, h);
    }
}

/* kvpress's presses beside kvcap's best policy and random eviction, retention by retention. */
static void render_outside(struct buf *b, const struct report *r)
{
    const struct outside *x = &r->outside;
    if (!x->rows && !x->mismatch)
        return;
    char n1[32], d[48];
    bputs(b, "<section>\n<h2>Outside reference: kvpress</h2>\n");
    if (x->mismatch) {
        bputs(b, "<p class=\"caption\">kvpress.json beside this report is not shown: ");
        besc(b, x->mismatch);
        bputs(b, ".</p>\n</section>\n");
        return;
    }
    bputs(b, "<div class=\"table-wrap\"><table class=\"runs\">\n<thead><tr><th class=\"l\">Method"
             "</th><th>Target<br>retention</th><th>Realised<br>retention</th>"
             "<th>KL<br>vs full<br><span class=\"unit\">nats/token</span></th>"
             "<th>&Delta;NLL<br>vs full<br><span class=\"unit\">nats/token</span></th>"
             "<th>Next-token<br>agreement</th>"
             "<th>kvcap&rsquo;s<br>&minus; this: KL<br><span class=\"unit\">95&nbsp;% "
             "interval</span></th>"
             "<th>kvcap&rsquo;s<br>&minus; this: |&Delta;NLL|<br><span class=\"unit\">"
             "95&nbsp;% interval</span></th></tr></thead>\n<tbody>\n");
    /* retentions in the order kvpress.json first lists them */
    for (int i = 0; i < x->n_rows; i++) {
        const double t = x->rows[i].retention;
        int seen = 0;
        for (int j = 0; j < i; j++)
            seen |= x->rows[j].retention == t;
        if (seen)
            continue;
        bprintf(b, "<tr class=\"group\"><td class=\"l\" colspan=\"8\">%.0f&nbsp;%% of the span "
                   "kept</td></tr>\n", 100 * t);
        const struct run *best = best_at(r, t), *rnd = random_at(r, t);
        const struct run *ours[2] = {best, rnd != best ? rnd : NULL};
        for (int k = 0; k < 2; k++) {
            const struct run *u = ours[k];
            if (!u)
                continue;
            bputs(b, "<tr class=\"run\"><td class=\"l\">");
            policy_name(b, r, u);
            if (k == 0)
                bputs(b, u->shipped ? " <span class=\"unit\">kvcap&rsquo;s, chosen in advance</span>"
                                    : " <span class=\"unit\">kvcap&rsquo;s best by KL, picked "
                                      "after the fact</span>");
            bprintf(b, "</td><td>%.2f</td><td>%.1f&nbsp;%%</td><td>%s</td><td>%s</td>",
                    u->retention, 100 * u->realised, fmt_kl(n1, sizeof n1, u->kl),
                    fmt_signed(d, sizeof d, u->nll_delta, 4));
            agreement_cell(b, u->next_token_agreement);
            if (k == 0)
                bputs(b, "<td>&mdash;</td><td>&mdash;</td>");
            else
                paired_cells(b, best, u->pp_kl, u->pp_dnll, u->n_pp);
            bputs(b, "</tr>\n");
        }
        for (int j = 0; j < x->n_rows; j++) {
            const struct outside_row *o = &x->rows[j];
            if (o->retention != t)
                continue;
            bputs(b, "<tr class=\"run ext\"><td class=\"l\">kvpress ");
            besc(b, o->press);
            bprintf(b, "</td><td>%.2f</td><td>%.1f&nbsp;%%</td><td>%s</td><td>%s</td>",
                    o->retention, 100 * o->realised, fmt_kl(n1, sizeof n1, o->kl),
                    fmt_signed(d, sizeof d, o->dnll, 4));
            agreement_cell(b, o->agreement);
            paired_cells(b, best, o->pp_kl, o->pp_dnll, o->n_pp);
            bputs(b, "</tr>\n");
        }
    }
    bputs(b, "</tbody></table></div>\n<p class=\"caption\">kvpress ");
    besc(b, x->version);
    bputs(b, " on transformers ");
    besc(b, x->transformers);
    bputs(b, ", run by <code>scripts/kvpress-reference.sh</code> on the same model weights "
             "(transformers reading the same GGUF, in f32), the same prompts and the same span; "
             "tokens outside the span are always kept, and each press keeps the same share of "
             "the span as kvcap's rows. KVzip shares its budget across layers and heads, as in "
             "its paper; the other presses keep the same number per head. Metrics as above, "
             "measured by the script on its own engine: compare rows within a retention. The "
             "last two columns pair each row with kvcap&rsquo;s row (its shipped configuration "
             "when one was chosen in advance, else its best by KL) on the same prompts: the "
             "mean over prompts of kvcap&rsquo;s minus the row, for the KL and for each "
             "prompt&rsquo;s |&Delta;NLL| (on the image track every compressed cache&rsquo;s "
             "&Delta;NLL is negative, so closeness to full is its size), &plusmn; the half-width "
             "of a 95&nbsp;% t-interval; <span class=\"win\">green</span>: kvcap&rsquo;s row "
             "is closer to full beyond that interval, <span class=\"lose\">red</span>: the row "
             "is, otherwise the prompts do not separate them.");
    /* what outside_bind checked, so that a reader sees the file belongs to this run */
    char hash[13];
    snprintf(hash, sizeof hash, "%.12s", x->hash);
    bputs(b, " Checked against this run: the same track, prompts (<code>prompts_sha256</code> ");
    besc(b, hash);
    bprintf(b, "&hellip;) and retentions; its full-cache NLL, %.4f nats/token, is within %g of "
               "this run&rsquo;s %.4f.", x->full_nll, OUTSIDE_FULL_NLL_TOL, x->full_nll_here);
    int whole = 0;
    for (int j = 0; j < x->n_rows; j++)
        whole |= !strcmp(x->rows[j].press, "kvzip_whole_prompt");
    if (whole)
        bputs(b, " <b>kvzip</b> is kvpress&rsquo;s KVzip press as shipped: it starts its replay "
                 "after as many tokens as the chat template puts before a user&rsquo;s text (24 "
                 "for SmolLM2; these prompts are not in chat form, and where the head is shorter "
                 "the first tokens of the span go unscored and are evicted first). <b>kvzip_whole_prompt</b> is the same "
                 "press replaying the whole prompt, as the paper does: the row kvcap&rsquo;s "
                 "kvzip is checked against.");
    bputs(b, "</p>\n</section>\n");
}

/* ---- SVG plotting helpers ------------------------------------------------------------------ */

struct axis {
    double lo, hi;     /* the range drawn */
    double t0, t1;     /* linear: first and last tick, inside [lo, hi] */
    double step;       /* linear: tick spacing */
    int log;           /* ticks at powers of ten instead */
    double p0, p1;     /* pixel positions of lo and hi */
};

static double nice_step(double raw)
{
    double mag = pow(10, floor(log10(raw))), f = raw / mag;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * mag;
}

/* Linear axis over [lo, hi] widened to whole ticks, about `target` intervals. */
static void axis_linear(struct axis *a, double lo, double hi, int target)
{
    if (!(hi > lo)) {
        double pad = lo != 0 ? fabs(lo) * 0.05 : 1;
        lo -= pad;
        hi += pad;
    }
    double s = nice_step((hi - lo) / target);
    a->lo = a->t0 = floor(lo / s + 1e-9) * s;
    a->hi = a->t1 = ceil(hi / s - 1e-9) * s;
    a->step = s;
    a->log = 0;
}

/* Linear axis hugging the data: [lo, hi] plus `pad` of the range on each side, ticks inside. */
static void axis_tight(struct axis *a, double lo, double hi, int target, double pad)
{
    axis_linear(a, lo, hi, target);
    if (hi > lo) {
        a->t0 = ceil(lo / a->step - 1e-9) * a->step;
        a->t1 = floor(hi / a->step + 1e-9) * a->step;
        a->lo = lo - pad * (hi - lo);
        a->hi = hi + pad * (hi - lo);
    }
}

/* Log axis a little wider than the data, widened to whole decades when fewer than two powers
 * of ten would fall inside. */
static void axis_log(struct axis *a, double lo, double hi)
{
    a->lo = lo / 1.6;
    a->hi = hi * 1.6;
    if (floor(log10(a->hi)) - ceil(log10(a->lo)) < 1) {
        a->lo = pow(10, floor(log10(lo) + 1e-9));
        a->hi = pow(10, ceil(log10(hi) - 1e-9));
        if (a->hi <= a->lo * 10)
            a->hi = a->lo * 100;
    }
    a->log = 1;
    a->step = 0;
}

static double axis_px(const struct axis *a, double v)
{
    double t = a->log ? (log10(v) - log10(a->lo)) / (log10(a->hi) - log10(a->lo))
                      : (v - a->lo) / (a->hi - a->lo);
    return a->p0 + t * (a->p1 - a->p0);
}

static int tick_decimals(double step)
{
    int d = 0;
    while (d < 8 && fabs(step * pow(10, d) - round(step * pow(10, d))) > 1e-6 * step * pow(10, d))
        d++;
    return d;
}

/* Number of linear ticks and the k-th tick value (snapped so that 0 prints as 0). */
static int tick_count(const struct axis *a)
{
    return (int)floor((a->t1 - a->t0) / a->step + 1e-6) + 1;
}

static double tick_value(const struct axis *a, int k)
{
    double v = a->t0 + k * a->step;
    return fabs(v) < a->step * 1e-6 ? 0 : v;
}

/* Tick label of a log axis: 10 with a superscript exponent. */
static void log_label(struct buf *b, int e)
{
    bprintf(b, "10<tspan dy=\"-6\" font-size=\"10\">%s%d</tspan>", e < 0 ? "&minus;" : "", abs(e));
}

/* Horizontal gridlines with labels on the left, for a vertical axis (p0 bottom, p1 top). */
static void y_grid(struct buf *b, const struct axis *a, double x, double w, const char *suffix)
{
    if (a->log) {
        int e0 = (int)floor(log10(a->lo) + 1e-9), e1 = (int)floor(log10(a->hi) + 1e-9);
        for (int e = e0; e <= e1; e++) {
            double v = pow(10, e), y = axis_px(a, v);
            if (v >= a->lo * (1 - 1e-9)) {
                bprintf(b, "<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" "
                           "y2=\"%.1f\"/>",
                        x, x + w, y, y);
                bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">",
                        x - 6, y + 4);
                log_label(b, e);
                bputs(b, "</text>\n");
            }
            for (int m = 2; m <= 9; m++) {
                if (v * m <= a->lo || v * m >= a->hi)
                    continue;
                double ym = axis_px(a, v * m);
                bprintf(b, "<line class=\"grid minor\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" "
                           "y2=\"%.1f\"/>",
                        x, x + w, ym, ym);
            }
        }
        return;
    }
    int dec = tick_decimals(a->step), n = tick_count(a);
    for (int k = 0; k < n; k++) {
        double v = tick_value(a, k), y = axis_px(a, v);
        bprintf(b, "<line class=\"grid%s\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>",
                v == 0 && a->lo < 0 ? " zero" : "", x, x + w, y, y);
        bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s%.*f%s</text>\n",
                x - 6, y + 4, v < 0 ? "&minus;" : "", dec, fabs(v), suffix);
    }
}

/* Vertical gridlines with labels below, for a horizontal linear axis. */
static void x_grid(struct buf *b, const struct axis *a, double y, double h, const char *suffix)
{
    int dec = tick_decimals(a->step), n = tick_count(a);
    for (int k = 0; k < n; k++) {
        double v = tick_value(a, k), x = axis_px(a, v);
        bprintf(b, "<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>", x, x,
                y, y + h);
        bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.*f%s</text>\n",
                x, y + h + 16, dec, v, suffix);
    }
}

/* One marker: circle, square, triangle, diamond or inverted triangle; `hollow` (kvcap's
 * extensions) draws the outline only. Leaves the element open for a <title>; close it with
 * marker_end(). */
static void marker(struct buf *b, int shape, double x, double y, const char *color, int hollow)
{
    const double s = hollow ? 4.0 : 4.6;
    const char *fill = hollow ? "#fff" : color;
    switch (shape) {
    case 0:
        bprintf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"%.1f\" fill=\"%s\"", x, y, s, fill);
        break;
    case 1:
        bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"",
                x - s * 0.85, y - s * 0.85, s * 1.7, s * 1.7, fill);
        break;
    case 2:
        bprintf(b, "<path d=\"M%.1f %.1fl%.1f %.1fh%.1fz\" fill=\"%s\"", x, y - s * 1.1, s * 1.1,
                s * 1.9, -s * 2.2, fill);
        break;
    case 3:
        bprintf(b, "<path d=\"M%.1f %.1fl%.1f %.1fl%.1f %.1fl%.1f %.1fz\" fill=\"%s\"", x,
                y - s * 1.2, s * 1.2, s * 1.2, -s * 1.2, s * 1.2, -s * 1.2, -s * 1.2, fill);
        break;
    default:
        bprintf(b, "<path d=\"M%.1f %.1fl%.1f %.1fh%.1fz\" fill=\"%s\"", x, y + s * 1.1, s * 1.1,
                -s * 1.9, -s * 2.2, fill);
        break;
    }
    if (hollow)
        bprintf(b, " stroke=\"%s\" stroke-width=\"2\">", color);
    else
        bputs(b, " stroke=\"#fff\" stroke-width=\"1\">");
}

static void marker_end(struct buf *b, int shape)
{
    bputs(b, shape == 0 ? "</circle>" : shape == 1 ? "</rect>" : "</path>");
}

/* ---- HTML: fidelity vs realised retention -------------------------------------------------- */

enum metric { M_TASK, M_KL, M_NLL_DELTA, M_NEXT_TOKEN, M_AGREEMENT, M_COS_GAP };

static double metric_value(const struct run *u, enum metric m)
{
    switch (m) {
    case M_TASK: return 100 * u->task_accuracy;
    case M_KL: return u->kl > 0 ? u->kl : NAN; /* not on a log axis */
    case M_NLL_DELTA: return u->nll_delta;
    case M_NEXT_TOKEN: return 100 * u->next_token_agreement;
    case M_AGREEMENT: return 100 * u->token_agreement;
    case M_COS_GAP: {
        double g = 1 - u->cos_mean;
        return g > 0 ? g : NAN;
    }
    }
    return NAN;
}

struct panel_spec {
    enum metric m;
    const char *title, *ylabel, *better;
};

/* One plot at (px, py) of outer size pw x ph: title, axes, full's reference line where it has a
 * value on the axis, a polyline and markers per curve, x at realised retention. */
static void fidelity_panel(struct buf *b, const struct report *r, const struct panel_spec *ps,
                           const struct axis *xa_in, double px, double py, double pw, double ph)
{
    const double ml = 64, mr = 16, mt = 34, mb = 50;
    double x = px + ml, y = py + mt, w = pw - ml - mr, h = ph - mt - mb;
    bprintf(b, "<text class=\"ptitle\" x=\"%.1f\" y=\"%.1f\">", x, py + 14);
    besc(b, ps->title);
    bprintf(b, "</text><text class=\"better\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">",
            x + w, py + 14);
    besc(b, ps->better);
    bputs(b, "</text>\n");

    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = &r->runs[i];
        double v = metric_value(u, ps->m);
        if (!is_reference(r, u) && isfinite(v)) {
            lo = fmin(lo, v);
            hi = fmax(hi, v);
        }
    }
    if (!(hi >= lo)) {
        bprintf(b, "<rect class=\"frame\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/>"
                   "<text class=\"nodata\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">"
                   "not measured</text>\n",
                x, y, w, h, x + w / 2, y + h / 2);
        return;
    }
    const struct run *full = full_run(r);
    struct axis ya, xa = *xa_in;
    double ref = NAN;
    if (ps->m == M_TASK) {
        ref = full ? 100 * full->task_accuracy : NAN;
        axis_linear(&ya, 0, 100, 5);
    } else if (ps->m == M_AGREEMENT || ps->m == M_NEXT_TOKEN) {
        ref = full ? 100 : NAN;
        axis_tight(&ya, fmin(lo, 95), 100, 5, 0.04); /* at least 5 points, none above 100 */
    } else if (ps->m == M_NLL_DELTA) {
        ref = full ? 0 : NAN;
        axis_tight(&ya, fmin(lo, 0), fmax(hi, 0), 5, 0.04);
    } else {
        axis_log(&ya, lo, hi);
    }
    ya.p0 = y + h;
    ya.p1 = y;
    xa.p0 = x;
    xa.p1 = x + w;

    y_grid(b, &ya, x, w, "");
    x_grid(b, &xa, y, h, "");
    bprintf(b, "<rect class=\"frame\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/>\n", x,
            y, w, h);
    bprintf(b, "<text class=\"alabel\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">"
               "realised retention (share of the span held)</text>\n",
            x + w / 2, y + h + 38);
    bprintf(b, "<text class=\"alabel\" transform=\"translate(%.1f %.1f) rotate(-90)\" "
               "text-anchor=\"middle\">",
            px + 16, y + h / 2);
    besc(b, ps->ylabel);
    bputs(b, "</text>\n");

    if (isfinite(ref)) {
        double yr = axis_px(&ya, ref);
        bprintf(b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                   "stroke-width=\"1.6\" stroke-dasharray=\"6 4\"/>"
                   "<text class=\"reflabel\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">full",
                x, x + w, yr, yr, REFERENCE_COLOR, x + w - 4, yr + (yr - y < 16 ? 14 : -5));
        if (ps->m == M_TASK)
            bprintf(b, " %.1f%%", ref);
        bputs(b, "</text>\n");
    }
    for (int c = 0; c < r->n_curves; c++) {
        const struct curve *cv = &r->curves[c];
        if (cv->reference)
            continue;
        int n = 0;
        bprintf(b, "<g><polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%s\"%s points=\"",
                cv->color, cv->extension ? "1.8" : "2.2",
                cv->extension ? " stroke-dasharray=\"5 3\"" : "");
        for (int i = 0; i < r->n_runs; i++) {
            const struct run *u = r->sorted[i];
            double v = metric_value(u, ps->m);
            if (u->curve != c || !isfinite(v))
                continue;
            bprintf(b, "%s%.1f,%.1f", n++ ? " " : "", axis_px(&xa, realised_or_target(u)),
                    axis_px(&ya, v));
        }
        bputs(b, "\"/>");
        for (int i = 0; i < r->n_runs; i++) {
            const struct run *u = r->sorted[i];
            double v = metric_value(u, ps->m);
            if (u->curve != c || !isfinite(v))
                continue;
            marker(b, cv->marker, axis_px(&xa, realised_or_target(u)), axis_px(&ya, v),
                   cv->color, cv->extension);
            bputs(b, "<title>");
            run_name(b, u);
            bprintf(b, " (realised %.3f): %.4g</title>", realised_or_target(u), v);
            marker_end(b, cv->marker);
        }
        bputs(b, "</g>\n");
    }
}

/* Width of one legend item. */
static double legend_item(const struct curve *cv)
{
    return 34 + approx_text_width(cv->label, 13) + (cv->reference ? 80 : 0) + 26;
}

/* Legend items left to right, wrapping at `width`: the papers' methods on one line (or more),
 * kvcap's extensions on the next; returns the height used. */
static double curve_legend(struct buf *b, const struct report *r, double x0, double y0,
                           double width, int emit)
{
    const double head = 150;
    double x = x0 + head, y = y0 + 12;
    int group = -1;
    for (int c = 0; c < r->n_curves; c++) {
        const struct curve *cv = &r->curves[c];
        int g = cv->extension ? 1 : 0;
        if (g != group) {
            if (group >= 0)
                y += 24;
            x = x0 + head;
            group = g;
            if (emit)
                bprintf(b, "<text class=\"legend lhead\" x=\"%.1f\" y=\"%.1f\">%s</text>\n", x0,
                        y + 4.5, g ? "kvcap&#8217;s extensions" : "papers&#8217; methods");
        }
        double item = legend_item(cv);
        if (x > x0 + head && x + item > x0 + width) {
            x = x0 + head;
            y += 24;
        }
        if (emit) {
            bprintf(b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                       "stroke-width=\"%s\"%s/>",
                    x, x + 28, y, y, cv->color,
                    cv->reference ? "1.6" : cv->extension ? "1.8" : "2.2",
                    cv->reference   ? " stroke-dasharray=\"6 4\""
                    : cv->extension ? " stroke-dasharray=\"5 3\""
                                    : "");
            if (!cv->reference) {
                marker(b, cv->marker, x + 14, y, cv->color, cv->extension);
                marker_end(b, cv->marker);
            }
            bprintf(b, "<text class=\"legend\" x=\"%.1f\" y=\"%.1f\">", x + 34, y + 4.5);
            besc(b, cv->label);
            bprintf(b, "%s</text>\n", cv->reference ? " (reference)" : "");
        }
        x += item;
    }
    return y - y0 + 14;
}

static void render_fidelity(struct buf *b, const struct report *r)
{
    static const struct panel_spec panels[] = {
        {M_TASK, "Task accuracy (key-value retrieval)", "task accuracy (%)", "higher is better"},
        {M_KL, "KL divergence from full (teacher-forced)", "KL (nats/token, log scale)",
         "lower is better"},
        {M_NLL_DELTA, "NLL change vs full", "\xce\x94NLL (nats/token)", "lower is better"},
        {M_NEXT_TOKEN, "Next-token agreement (teacher-forced)", "next-token agreement (%)",
         "higher is better"},
        {M_AGREEMENT, "Greedy agreement with full (secondary)", "greedy token agreement (%)",
         "higher is better"},
        {M_COS_GAP, "Attention output drift (replayed decode steps)",
         "1 \xe2\x88\x92 cosine (mean over layers)", "lower is better"},
    };
    enum { N_PANELS = sizeof panels / sizeof panels[0] };
    /* A 2-column grid: task accuracy and KL first, the per-token measures next, greedy
     * agreement and attention drift last. */
    const double W = 1256, PH = 330, ROW = PH + 16;
    double rlo = INFINITY, rhi = -INFINITY;
    for (int i = 0; i < r->n_runs; i++)
        if (!is_reference(r, &r->runs[i])) {
            rlo = fmin(rlo, realised_or_target(&r->runs[i]));
            rhi = fmax(rhi, realised_or_target(&r->runs[i]));
        }
    bputs(b, "<section>\n<h2>Fidelity vs realised retention</h2>\n");
    if (!(rhi >= rlo)) {
        bputs(b, "<p class=\"caption\">No compressed runs to plot.</p>\n</section>\n");
        return;
    }
    /* A little room past the first and last tick so that markers clear the frame. */
    struct axis xa;
    axis_linear(&xa, rlo, rhi, 5);
    double pad = (xa.hi - xa.lo) * 0.06;
    xa.lo -= pad;
    xa.hi += pad;

    double lh = curve_legend(b, r, 0, 0, W - 20, 0);
    int rows = (N_PANELS + 1) / 2;
    double H = lh + 8 + (rows - 1) * ROW + PH;
    bprintf(b, "<figure>\n<svg class=\"fig\" width=\"%.0f\" "
               "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" "
               "aria-label=\"fidelity vs realised retention\">\n",
            W, H, W, H);
    curve_legend(b, r, 10, 0, W - 20, 1);
    for (int k = 0; k < N_PANELS; k++)
        fidelity_panel(b, r, &panels[k], &xa, (k % 2) * W / 2, lh + 8 + (k / 2) * ROW, W / 2,
                       PH);
    bputs(b, "</svg>\n<figcaption>One line per policy across its budgets, each point at the "
             "share of the span the run really held (hover a marker for its value); kvcap's "
             "extensions are dashed with hollow markers, and one that varies a single paper's "
             "method shares its colour. The dashed black line is full: its task accuracy (the "
             "ceiling), &Delta;NLL 0, 100&nbsp;% agreement; KL is on a log scale (full's is 0). "
             "Task accuracy: answers equal to the true value. KL and &Delta;NLL: per held-out "
             "token, teacher-forced. Next-token agreement: share of those positions whose most "
             "likely token is full's. Greedy agreement cascades after the first differing token. "
             "Attention drift: 1 &minus; cosine of attention outputs against full's on replayed "
             "decode steps (full's own queries and K/V). Runs without a measurement are left out "
             "of that panel.</figcaption>\n</figure>\n</section>\n");
}

/* ---- HTML: task accuracy by depth ---------------------------------------------------------- */

/* The depth table shows, per policy, the run whose target is nearest this. */
static const double DEPTH_RETENTION = 0.4;

/* Pale red (0) through pale yellow to green (1), dark text stays readable on each. */
static void accuracy_color(double t, char out[8])
{
    static const unsigned char stops[3][3] = {{244, 199, 195}, {252, 232, 178}, {140, 205, 160}};
    t = t < 0 ? 0 : t > 1 ? 1 : t;
    int i = t < 0.5 ? 0 : 1;
    double f = (t - 0.5 * i) * 2;
    int c[3];
    for (int k = 0; k < 3; k++)
        c[k] = (int)lround(stops[i][k] + f * (stops[i + 1][k] - stops[i][k]));
    snprintf(out, 8, "#%02x%02x%02x", c[0], c[1], c[2]);
}

static void depth_cell(struct buf *b, double v)
{
    char col[8];
    if (!isfinite(v)) {
        na_cell(b);
        return;
    }
    accuracy_color(v, col);
    bprintf(b, "<td style=\"background:%s\">%.0f&nbsp;%%</td>", col, 100 * v);
}

static void render_depths(struct buf *b, const struct report *r)
{
    int n_bins = r->n_depths;
    for (int i = 0; i < r->n_runs; i++)
        if (r->runs[i].n_task_depth > n_bins)
            n_bins = r->runs[i].n_task_depth;
    if (!n_bins)
        return;
    /* The target nearest DEPTH_RETENTION (the lower one on a tie). */
    double t = NAN;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (is_reference(r, u) || !u->task_depth)
            continue;
        double dt = fabs(u->retention - DEPTH_RETENTION), dc = fabs(t - DEPTH_RETENTION);
        if (isnan(t) || dt < dc - 1e-12 || (fabs(dt - dc) <= 1e-12 && u->retention < t))
            t = u->retention;
    }
    const struct run *full = full_run(r);
    bprintf(b, "<section>\n<h2>Task accuracy by depth</h2>\n<p class=\"caption\">Retrieval "
               "accuracy by where the asked line sits in the span (0&nbsp;%% = its start), for "
               "each policy's run at target retention %.2f",
            t);
    bputs(b, " and for full; each cell is the share of the queries in that depth bin answered "
             "correctly");
    if (isfinite(r->task_queries) && r->n_depths)
        bprintf(b, " (about %.3g queries per bin: read small differences with care)",
                r->task_queries / r->n_depths);
    bputs(b, ". A policy that keeps only recent tokens fails at shallow depths; one "
             "that keeps the wrong tokens fails everywhere.</p>\n<div class=\"table-wrap\">"
             "<table class=\"depth\">\n<thead><tr><th class=\"l\">Policy</th>"
             "<th>Realised<br>retention</th>");
    for (int k = 0; k < n_bins; k++) {
        if (k < r->n_depths)
            bprintf(b, "<th>%.0f&nbsp;%%<br><span class=\"unit\">depth</span></th>",
                    100 * r->task_depths[k]);
        else
            bprintf(b, "<th>bin %d</th>", k + 1);
    }
    bputs(b, "<th>All<br><span class=\"unit\">depths</span></th></tr></thead>\n<tbody>\n");
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (!u->task_depth || (u != full && (is_reference(r, u) || u->retention != t)))
            continue;
        bprintf(b, "<tr class=\"%s\" title=\"", u == full ? "ceiling" : "rk");
        besc(b, u->id);
        bputs(b, "\"><td class=\"l\">");
        policy_name(b, r, u);
        if (isfinite(u->realised))
            bprintf(b, "</td><td%s>%.1f&nbsp;%%</td>", off_target(u) ? " class=\"off\"" : "",
                    100 * u->realised);
        else
            bputs(b, "</td><td class=\"na\">&mdash;</td>");
        for (int k = 0; k < n_bins; k++)
            depth_cell(b, k < u->n_task_depth ? u->task_depth[k] : NAN);
        depth_cell(b, u->task_accuracy);
        bputs(b, "</tr>\n");
    }
    bputs(b, "</tbody></table></div>\n</section>\n");
}

/* ---- HTML: per-layer heatmap --------------------------------------------------------------- */

/* ColorBrewer YlOrRd: light = small error, dark red = large. */
static void ramp_color(double t, char out[8])
{
    static const unsigned char stops[9][3] = {
        {255, 255, 204}, {255, 237, 160}, {254, 217, 118}, {254, 178, 76}, {253, 141, 60},
        {252, 78, 42},   {227, 26, 28},   {189, 0, 38},    {128, 0, 38}};
    t = t < 0 ? 0 : t > 1 ? 1 : t;
    double pos = t * 8;
    int i = (int)floor(pos);
    if (i >= 8)
        i = 7;
    double f = pos - i;
    int c[3];
    for (int k = 0; k < 3; k++)
        c[k] = (int)lround(stops[i][k] + f * (stops[i + 1][k] - stops[i][k]));
    snprintf(out, 8, "#%02x%02x%02x", c[0], c[1], c[2]);
}

/* Width of the run-name column of the heatmap and the bars. */
static double name_column(const struct report *r)
{
    double w = 120;
    for (int i = 0; i < r->n_runs; i++)
        w = fmax(w, approx_text_width(r->runs[i].label, 12.5) +
                        approx_text_width(" @ 0.00", 12.5) + 30);
    return fmin(w, 400);
}

static void render_heatmap(struct buf *b, const struct report *r)
{
    bputs(b, "<section>\n<h2>Per-layer attention error</h2>\n");
    int rows = 0, groups = 0, prev = -1;
    double lo = INFINITY, hi = 0;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (!u->rel || is_reference(r, u))
            continue;
        rows++;
        groups += u->curve != prev;
        prev = u->curve;
        for (int l = 0; l < r->n_layers; l++) {
            if (u->rel[l] > 0)
                lo = fmin(lo, u->rel[l]);
            hi = fmax(hi, u->rel[l]);
        }
    }
    if (!rows) {
        bputs(b, "<p class=\"caption\">No compressed run has per-layer attention errors "
                 "(attn_rel_err).</p>\n</section>\n");
        return;
    }
    int log_scale = isfinite(lo) && hi / lo >= 10;
    if (!log_scale) {
        lo = 0;
        if (!(hi > 0))
            hi = 1;
    }
    const double W = 1256, RH = 19, GAP = 6, top = 44;
    double nc = name_column(r), cw = fmin(36, (W - nc - 20) / r->n_layers);
    double gw = cw * r->n_layers, H = top + rows * RH + (groups - 1) * GAP + 86;
    bprintf(b, "<figure>\n<svg class=\"fig\" width=\"%.0f\" "
               "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" "
               "aria-label=\"per-layer attention error\">\n",
            W, H, W, H);
    bprintf(b, "<text class=\"alabel\" x=\"%.1f\" y=\"14\" text-anchor=\"middle\">layer</text>\n",
            nc + gw / 2);
    int every = cw >= 16 ? 1 : cw >= 7 ? 5 : 10;
    for (int l = 0; l < r->n_layers; l++)
        if (l % every == 0 || l == r->n_layers - 1)
            bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>",
                    nc + (l + 0.5) * cw, top - 8, l);
    bputs(b, "\n");
    double y = top;
    prev = -1;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (!u->rel || is_reference(r, u))
            continue;
        if (prev >= 0 && u->curve != prev)
            y += GAP;
        prev = u->curve;
        bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"5\" height=\"%.1f\" fill=\"%s\"/>", nc - 10,
                y + 1, RH - 2, r->curves[u->curve].color);
        bprintf(b, "<text class=\"rlabel\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", nc - 16,
                y + RH / 2 + 4.5);
        run_name(b, u);
        bputs(b, "</text>\n");
        for (int l = 0; l < r->n_layers; l++) {
            double v = u->rel[l], t;
            if (log_scale)
                t = v > 0 ? (log(v) - log(lo)) / (log(hi) - log(lo)) : 0;
            else
                t = v / hi;
            char col[8];
            ramp_color(t, col);
            bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\">"
                       "<title>",
                    nc + l * cw, y, cw - 1, RH - 1, col);
            run_name(b, u);
            bprintf(b, ", layer %d: relative error %.4g</title></rect>", l, v);
        }
        bputs(b, "\n");
        y += RH;
    }
    /* Colour legend: a gradient bar with its end values (and the middle of the scale). */
    double ly = y + 30, lw = 360;
    bputs(b, "<defs><linearGradient id=\"ramp\" x1=\"0\" x2=\"1\" y1=\"0\" y2=\"0\">");
    for (int k = 0; k <= 8; k++) {
        char col[8];
        ramp_color(k / 8.0, col);
        bprintf(b, "<stop offset=\"%.3f\" stop-color=\"%s\"/>", k / 8.0, col);
    }
    bputs(b, "</linearGradient></defs>\n");
    /* The label right of the bar: left of it, a narrow name column would clip it. */
    bprintf(b, "<text class=\"alabel\" x=\"%.1f\" y=\"%.1f\">attention relative error%s</text>",
            nc + lw + 16, ly + 12, log_scale ? " (log colour scale)" : "");
    bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"16\" fill=\"url(#ramp)\" "
               "stroke=\"#999\" stroke-width=\"0.5\"/>",
            nc, ly, lw);
    double mid = log_scale ? sqrt(lo * hi) : (lo + hi) / 2;
    bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">min %.3g</text>", nc, ly + 32, lo);
    bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.3g</text>",
            nc + lw / 2, ly + 32, mid);
    bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">max %.3g</text>\n",
            nc + lw, ly + 32, hi);
    bputs(b, "</svg>\n<figcaption>Rows are compressed runs (the full cache is the reference and "
             "has no error), columns are layers; a cell is the mean relative L2 error of that "
             "layer's attention output against full's on replayed decode steps (full's own "
             "queries and K/V, so errors do not cascade). Look for rows that "
             "stay pale across every layer, and for layers that are dark in every row: those "
             "are where compression hurts.</figcaption>\n</figure>\n</section>\n");
}

/* ---- HTML: KVCapsule masks ----------------------------------------------------------------- */

/* Cell colour for `k` of `heads` heads keeping a token: white (none) to dark blue (all). */
static void shade_color(int k, int heads, char out[8])
{
    static const int lo[3] = {214, 226, 243}, hi[3] = {16, 52, 110};
    double t = heads > 1 ? (double)(k - 1) / (heads - 1) : 1;
    int c[3];
    for (int j = 0; j < 3; j++)
        c[j] = (int)lround(lo[j] + t * (hi[j] - lo[j]));
    snprintf(out, 8, "#%02x%02x%02x", c[0], c[1], c[2]);
}

/* A panel draws at most this many columns (one pixel each at the narrowest) and rows: longer
 * spans and deeper models are binned, each cell showing the mean over its tokens and layers.
 * Only cells holding a kept token are visited, so a panel costs O(kept · log kept) plus a few
 * kilobytes of axes and key, whatever n_tokens and layers the file declares. At most
 * MASK_MAX_PANELS buckets are drawn: a page of more is not read, and each adds fixed work. */
enum { MASK_MAX_COLUMNS = 1192, MASK_MAX_ROWS = 160, MASK_MAX_SHADES = 32, MASK_MAX_PANELS = 16 };

/* Binning i of [0, n) into `bins` (<= n) parts, part b being [b·n/bins, (b+1)·n/bins): the part
 * holding i, and where part b starts. */
static int bin_of(int i, int n, int bins)
{
    return (int)(((int64_t)(i + 1) * bins - 1) / n);
}

static int bin_start(int b, int n, int bins)
{
    return (int)((int64_t)b * n / bins);
}

/* Shade level of a cell whose tokens are kept by `mean` heads on average (of `heads`), in
 * 0 (no head keeps any of its tokens) .. levels. With one token per cell and at most
 * MASK_MAX_SHADES heads the level is the count itself. */
static int mask_level(double mean, int heads, int levels)
{
    if (mean <= 0)
        return 0;
    int k = (int)lround(mean / heads * levels);
    return k < 1 ? 1 : k > levels ? levels : k;
}

/* Columns [c, e) of panel row y share shade level k. */
struct shade_run {
    int y, c, e, k;
};

static void render_mask(struct buf *b, const struct report *r, const struct mask *m)
{
    const double W = 1256, lm = 64, top = 40;
    int n = m->n_tokens, L = r->n_layers;
    int cols = n < MASK_MAX_COLUMNS ? n : MASK_MAX_COLUMNS;
    int rows = L < MASK_MAX_ROWS ? L : MASK_MAX_ROWS;
    int levels = m->heads < MASK_MAX_SHADES ? m->heads : MASK_MAX_SHADES;
    double rh = rows == L ? 7 : fmax(2, 7.0 * MASK_MAX_ROWS / 2 / rows);
    double cw = fmin(8, (W - lm - 20) / cols);
    if (cw >= 1)
        cw = floor(cw * 4) / 4; /* whole quarter pixels keep the columns crisp */
    double gw = cw * cols, gh = rh * rows;
    double H = top + gh + 62;
    double per_head = (double)m->n_kept / ((double)L * m->heads);

    /* the cells: mean count over the tokens [c·n/cols, (c+1)·n/cols) of layers
     * [y·L/rows, (y+1)·L/rows); per row, its layers' kept tokens mapped to columns and sorted,
     * then the runs of equal shade along the row, left to right (at most one per kept token) */
    int *in_col = malloc((m->n_kept + 1) * sizeof *in_col);
    struct shade_run *run = malloc((m->n_kept + 1) * sizeof *run);
    if (!in_col || !run) {
        free(in_col), free(run);
        b->failed = 1;
        return;
    }
    size_t n_run = 0;
    for (int y = 0; y < rows; y++) {
        int l0 = bin_start(y, L, rows), l1 = bin_start(y + 1, L, rows);
        const size_t from = m->layer_at[l0], to = m->layer_at[l1];
        for (size_t j = from; j < to; j++)
            in_col[j - from] = bin_of(m->tok[j], n, cols);
        qsort(in_col, to - from, sizeof *in_col, cmp_int);
        const size_t row_start = n_run;
        for (size_t j = 0; j < to - from;) {
            const int c = in_col[j];
            size_t e = j;
            while (e < to - from && in_col[e] == c)
                e++;
            int t0 = bin_start(c, n, cols), t1 = bin_start(c + 1, n, cols);
            double cells = (double)(t1 - t0) * (l1 - l0);
            int k = mask_level((double)(e - j) / cells, m->heads, levels);
            if (n_run > row_start && run[n_run - 1].e == c && run[n_run - 1].k == k)
                run[n_run - 1].e = c + 1;
            else
                run[n_run++] = (struct shade_run){y, c, c + 1, k};
            j = e;
        }
    }
    free(in_col);

    bputs(b, "<figure class=\"mask-panel\">\n<h3>");
    besc(b, m->bucket);
    bprintf(b, " <span class=\"unit\">&middot; %d tokens &middot; %d head%s &middot; on average "
               "%.1f tokens (%.1f&nbsp;%%) kept per layer and head</span></h3>\n",
            n, m->heads, m->heads == 1 ? "" : "s", per_head, 100 * per_head / n);
    bprintf(b, "<svg class=\"fig\" width=\"%.0f\" "
               "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" aria-label=\"key masks of ",
            W, H, W, H);
    besc(b, m->bucket);
    bputs(b, "\">\n");
    bprintf(b, "<text class=\"alabel\" x=\"%.1f\" y=\"14\" text-anchor=\"middle\">token index"
               "</text>\n",
            lm + gw / 2);
    double tw = gw / n; /* width of one token */
    int step = 1;
    while (n / step > 16 || step * tw < 28)
        step *= 2;
    for (int t = 0; t <= n; t += step)
        bprintf(b, "<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>"
                   "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>",
                lm + t * tw, lm + t * tw, top - 4, top + gh, lm + t * tw, top - 8, t);
    bprintf(b, "\n<text class=\"alabel\" transform=\"translate(14 %.1f) rotate(-90)\" "
               "text-anchor=\"middle\">layer</text>\n",
            top + gh / 2);
    int lstep = 5;
    while (L / lstep > 32)
        lstep *= 2;
    for (int l = 0; l < L; l += lstep)
        bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%d</text>",
                lm - 6, top + ((double)l / L * rows + 0.5) * rh + 4, l);
    bprintf(b, "\n<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#fff\" "
               "stroke=\"#9aa3b0\" stroke-width=\"0.8\"/>\n",
            lm, top, gw, gh);
    /* One path per shade; a run of equal shades along a row is one rectangle. */
    double gap = rh > 3 ? 1 : 0;
    for (int k = 1; k <= levels; k++) {
        char col[8];
        shade_color(k, levels, col);
        bprintf(b, "<path fill=\"%s\" d=\"", col);
        for (size_t j = 0; j < n_run; j++)
            if (run[j].k == k)
                bprintf(b, "M%.2f %.1fh%.2fv%.1fh%.2fz", lm + run[j].c * cw, top + run[j].y * rh,
                        (run[j].e - run[j].c) * cw, rh - gap, -(run[j].e - run[j].c) * cw);
        bputs(b, "\"/>\n");
    }
    free(run);
    /* Shade key below the grid. */
    double kx = lm, ky = top + gh + 22;
    bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">kept by:</text>", kx, ky + 11);
    kx += 62;
    int keys = m->heads <= 8 ? m->heads : 1;
    for (int j = 0; j <= keys; j++) {
        int k = m->heads <= 8 ? j : j * m->heads;
        char col[8];
        if (k == 0)
            snprintf(col, sizeof col, "#ffffff");
        else
            shade_color(mask_level(k, m->heads, levels), levels, col);
        bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"16\" height=\"14\" fill=\"%s\" "
                   "stroke=\"#9aa3b0\" stroke-width=\"0.8\"/><text class=\"tick\" x=\"%.1f\" "
                   "y=\"%.1f\">%d of %d head%s</text>",
                kx, ky, col, kx + 22, ky + 11, k, m->heads,
                m->heads == 1 ? "" : "s");
        kx += m->heads < 100 ? 130 : 170; /* room for "4096 of 4096 heads" */
    }
    if (cols < n || rows < L)
        bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">each cell: the mean over about "
                   "%.0f token%s &times; %.0f layer%s</text>",
                kx + 8, ky + 11, (double)n / cols, cols < n ? "s" : "", (double)L / rows,
                rows < L ? "s" : "");
    bprintf(b, "\n</svg>\n<figcaption>Rows are layers, columns the %d token positions of the "
               "bucket in order (row-major over the grid); the shade is the fraction of the %d "
               "KV heads whose learned key mask keeps that token &mdash; white: dropped by every "
               "head, darkest: kept by all. Vertical stripes are tokens every layer "
               "keeps.</figcaption>\n</figure>\n",
            n, m->heads);
}

/* A photo panel draws at most this many cells a side (5 px each): a finer grid is binned, each
 * cell the mean over its tokens, so the panel stays a few thousand rectangles. */
enum { MASK_IMAGE_MAX_SIDE = 64 };

/* The share of (layer, head) pairs keeping each token, over the photo it came from: tokens
 * dropped by most heads are darkened, so the reader sees whether retention follows the image. */
static void render_mask_on_image(struct buf *b, const struct report *r, const struct mask *m)
{
    const int R = m->rows, C = m->cols, L = r->n_layers;
    const int BR = R < MASK_IMAGE_MAX_SIDE ? R : MASK_IMAGE_MAX_SIDE;
    const int BC = C < MASK_IMAGE_MAX_SIDE ? C : MASK_IMAGE_MAX_SIDE;
    const int binned = BR < R || BC < C;
    const double side = 320, cell = side / (C > R ? C : R); /* one token's side */
    /* each cell's mean share of the (layer, head) pairs keeping its tokens; the most-kept is
     * shown clear */
    double *share = calloc((size_t)BR * BC, sizeof *share), most = 0;
    if (!share) {
        b->failed = 1;
        return;
    }
    for (size_t j = 0; j < m->n_kept; j++)
        share[(size_t)bin_of(m->tok[j] / C, R, BR) * BC + bin_of(m->tok[j] % C, C, BC)] += 1;
    for (int by = 0; by < BR; by++)
        for (int bx = 0; bx < BC; bx++) {
            double tokens = (double)(bin_start(by + 1, R, BR) - bin_start(by, R, BR)) *
                            (bin_start(bx + 1, C, BC) - bin_start(bx, C, BC));
            double *v = &share[(size_t)by * BC + bx];
            *v = *v / ((double)L * m->heads * tokens);
            most = fmax(most, *v);
        }
    bputs(b, "<figure class=\"mask-image\">\n");
    bprintf(b, "<svg class=\"fig\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
               "role=\"img\" aria-label=\"key masks over the photo\">\n",
            cell * C, cell * R, cell * C, cell * R);
    bputs(b, "<image x=\"0\" y=\"0\" preserveAspectRatio=\"none\" ");
    bprintf(b, "width=\"%.1f\" height=\"%.1f\" href=\"", cell * C, cell * R);
    besc(b, m->thumb);
    bputs(b, "\"/>\n");
    for (int by = 0; by < BR; by++)
        for (int bx = 0; bx < BC; bx++) {
            const int y0 = bin_start(by, R, BR), y1 = bin_start(by + 1, R, BR);
            const int x0 = bin_start(bx, C, BC), x1 = bin_start(bx + 1, C, BC);
            const double kept = share[(size_t)by * BC + bx];
            bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                       "fill=\"#0b1a33\" fill-opacity=\"%.2f\" stroke=\"#ffffff\" "
                       "stroke-opacity=\"0.25\" stroke-width=\"0.5\"><title>",
                    x0 * cell, y0 * cell, (x1 - x0) * cell, (y1 - y0) * cell,
                    most > 0 ? 0.8 * (1 - kept / most) : 0.8);
            if (binned) {
                bprintf(b, "tokens in row%s %d", y1 - y0 > 1 ? "s" : "", y0);
                if (y1 - y0 > 1)
                    bprintf(b, "&ndash;%d", y1 - 1);
                bprintf(b, ", column%s %d", x1 - x0 > 1 ? "s" : "", x0);
                if (x1 - x0 > 1)
                    bprintf(b, "&ndash;%d", x1 - 1);
                bprintf(b, ": kept by %.0f%% of layer-heads on average", 100 * kept);
            } else
                bprintf(b, "token (%d, %d): kept by %.0f%% of layer-heads", y0, x0, 100 * kept);
            bputs(b, "</title></rect>");
        }
    free(share);
    bprintf(b, "\n</svg>\n<figcaption>The %d&thinsp;&times;&thinsp;%d tokens of a %s photo "
               "crop: the darker a cell, the fewer of the %d layers &times; %d KV heads keep that "
               "token's key (clear: the most-kept %s, %.0f&nbsp;%% of them).",
            R, C, r->calibration_photos ? "calibration" : "held-out", L, m->heads,
            binned ? "cell" : "token", 100 * most);
    if (binned)
        bprintf(b, " Each cell is the mean over about %.0f&thinsp;&times;&thinsp;%.0f tokens.",
                (double)R / BR, (double)C / BC);
    bputs(b, "</figcaption>\n</figure>\n");
}

static void render_masks(struct buf *b, const struct report *r)
{
    if (!r->n_masks)
        return;
    bputs(b, "<section>\n<h2>KVCapsule retained-token masks</h2>\n<p class=\"caption\">Which "
             "tokens of a span KVCapsule's key masks keep, per bucket: each panel overlays the "
             "heads of every layer, so a reader can see whether retention follows the image "
             "structure or is spread evenly.</p>\n");
    const int shown = r->n_masks < MASK_MAX_PANELS ? r->n_masks : MASK_MAX_PANELS;
    if (shown < r->n_masks)
        bprintf(b, "<p class=\"caption\"><strong>The first %d of the %d buckets are "
                   "drawn</strong>: the masks of the other %d (masks[%d] on in the metrics file) "
                   "were checked but are left out to keep the page readable.</p>\n",
                shown, r->n_masks, r->n_masks - shown, shown);
    for (int i = 0; i < shown; i++) {
        render_mask(b, r, &r->masks[i]);
        if (r->masks[i].thumb)
            render_mask_on_image(b, r, &r->masks[i]);
    }
    bputs(b, "</section>\n");
}

/* ---- HTML: sample continuations ----------------------------------------------------------- */

/* Per policy, the samples section shows the run whose retention is nearest this. */
static const double SAMPLE_RETENTION = 0.4;

/* Length in bytes of the longest common prefix of `a` and `b`, moved back to the start of a
 * UTF-8 sequence when it would end inside one (in either string). */
static size_t common_prefix(const char *a, const char *b)
{
    size_t n = 0;
    while (a[n] && a[n] == b[n])
        n++;
    while (n > 0 && ((((unsigned char)a[n] & 0xC0) == 0x80) ||
                     (((unsigned char)b[n] & 0xC0) == 0x80)))
        n--;
    return n;
}

/* Characters (UTF-8 lead bytes) in the first `n` bytes of `s`. */
static size_t utf8_chars(const char *s, size_t n)
{
    size_t chars = 0;
    for (size_t i = 0; i < n; i++)
        chars += ((unsigned char)s[i] & 0xC0) != 0x80;
    return chars;
}

/* One sample in a box headed "label @ retention" and a note; the bytes from `same` on are
 * highlighted as differing from the reference sample. */
static void sample_box(struct buf *b, const struct report *r, const struct run *u,
                       const struct run *base)
{
    char n1[32];
    size_t len = strlen(u->sample), same = len;
    if (base && base != u)
        same = common_prefix(u->sample, base->sample);
    bprintf(b, "<div class=\"sample\" title=\"");
    besc(b, u->id);
    bputs(b, "\"><div class=\"sh\">");
    swatch(b, &r->curves[u->curve]);
    run_name(b, u);
    bputs(b, " <span class=\"unit\">&middot; ");
    if (!base)
        bputs(b, "no full-cache sample to compare with");
    else if (base == u)
        bputs(b, "the reference");
    else if (strcmp(u->sample, base->sample) == 0)
        bputs(b, "identical to full");
    else if (same == len)
        bprintf(b, "as full, but ends after %s character%s",
                fmt_count(n1, sizeof n1, (double)utf8_chars(u->sample, len)),
                utf8_chars(u->sample, len) == 1 ? "" : "s");
    else if (same == 0)
        bputs(b, "diverges at the first character");
    else
        bprintf(b, "diverges after %s character%s",
                fmt_count(n1, sizeof n1, (double)utf8_chars(u->sample, same)),
                utf8_chars(u->sample, same) == 1 ? "" : "s");
    bputs(b, "</span></div><div class=\"st\">");
    besc_n(b, u->sample, same, 1);
    if (same < len) {
        bputs(b, "<span class=\"dv\">");
        besc_n(b, u->sample + same, len - same, 1);
        bputs(b, "</span>");
    }
    bputs(b, "</div></div>\n");
}

static void render_samples(struct buf *b, const struct report *r)
{
    char n1[32];
    const struct run *base = NULL;
    int any = 0;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        any |= u->sample != NULL;
        if (!base && u->sample && strcmp(u->policy, "full") == 0)
            base = u;
    }
    if (!any)
        return;
    /* Per curve, the run with a sample nearest SAMPLE_RETENTION; the sorted order (ascending
     * retention within a curve) makes the lower retention win a tie. */
    const struct run **pick = calloc((size_t)r->n_curves, sizeof *pick);
    if (!pick) {
        b->failed = 1;
        return;
    }
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i], *p = pick[u->curve];
        if (u->sample && (!p || fabs(u->retention - SAMPLE_RETENTION) <
                                    fabs(p->retention - SAMPLE_RETENTION)))
            pick[u->curve] = u;
    }
    if (base)
        pick[base->curve] = base;

    bputs(b, "<section>\n<h2>Sample continuations</h2>\n<p class=\"caption\">The start of "
             "the greedy continuation of prompt 0");
    if (r->prompt_sample)
        bputs(b, ", whose last characters are shown first,");
    bprintf(b, " with the full cache and, per policy, with the run whose retention is nearest "
               "%.2f. Text equal to the full cache's is shown plainly; from the first difference "
               "on it is <span class=\"dv\">highlighted</span>.</p>\n",
            SAMPLE_RETENTION);
    if (r->prompt_sample) {
        size_t len = strlen(r->prompt_sample);
        bprintf(b, "<div class=\"sample prompt\"><div class=\"sh\">Prompt 0 <span "
                   "class=\"unit\">&middot; its last %s character%s</span></div>"
                   "<div class=\"st\">&hellip;",
                fmt_count(n1, sizeof n1, (double)utf8_chars(r->prompt_sample, len)),
                utf8_chars(r->prompt_sample, len) == 1 ? "" : "s");
        besc_n(b, r->prompt_sample, len, 1);
        bputs(b, "</div></div>\n");
    }
    bputs(b, "<div class=\"samples\">\n");
    for (int c = 0; c < r->n_curves; c++)
        if (pick[c])
            sample_box(b, r, pick[c], base);
    bputs(b, "</div>\n</section>\n");
    free(pick);
}

/* ---- HTML: bytes and time bars ------------------------------------------------------------- */

static void bar_panel(struct buf *b, const struct report *r, int which, double x, double w,
                      double top, double rh, double gap, double h)
{
    const char *title = which == 0 ? "Bytes held after prefill (% of full)"
                                   : "Decode attention time per step (\xc3\x97 full)";
    double scale = which == 0 ? 100 : 1, hi = scale;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        double v = which == 0 ? ratio(u->bytes_held, u->bytes_held_full)
                              : ratio(u->step_ms, u->step_ms_full);
        if (isfinite(v))
            hi = fmax(hi, v * scale);
    }
    struct axis a;
    axis_linear(&a, 0, hi * 1.16, 5);
    a.p0 = x;
    a.p1 = x + w;
    bprintf(b, "<text class=\"ptitle\" x=\"%.1f\" y=\"%.1f\">%s</text>\n", x, top - 14, title);
    x_grid(b, &a, top, h, which == 0 ? "%" : "\xc3\x97");
    double xr = axis_px(&a, scale);
    bprintf(b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
               "stroke-width=\"1.4\" stroke-dasharray=\"5 4\"/>\n",
            xr, xr, top - 4, top + h, REFERENCE_COLOR);
    double y = top;
    int prev = -1;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (prev >= 0 && u->curve != prev)
            y += gap;
        prev = u->curve;
        double v = which == 0 ? ratio(u->bytes_held, u->bytes_held_full)
                              : ratio(u->step_ms, u->step_ms_full);
        if (isfinite(v)) {
            double bw = axis_px(&a, v * scale) - x;
            bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\">"
                       "<title>",
                    x, y + 3, bw, rh - 6, r->curves[u->curve].color);
            run_name(b, u);
            bputs(b, "</title></rect>");
            if (which == 0)
                bprintf(b, "<text class=\"val\" x=\"%.1f\" y=\"%.1f\">%.1f%%</text>\n",
                        x + bw + 5, y + rh / 2 + 4.5, 100 * v);
            else
                bprintf(b, "<text class=\"val\" x=\"%.1f\" y=\"%.1f\">%.2f&times;</text>\n",
                        x + bw + 5, y + rh / 2 + 4.5, v);
        } else {
            bprintf(b, "<text class=\"val na\" x=\"%.1f\" y=\"%.1f\">not measured</text>\n",
                    x + 5, y + rh / 2 + 4.5);
        }
        y += rh;
    }
}

static void render_bars(struct buf *b, const struct report *r)
{
    const double W = 1256, RH = 21, GAP = 6, top = 40;
    double nc = name_column(r);
    int groups = 0, prev = -1;
    for (int i = 0; i < r->n_runs; i++) {
        groups += r->sorted[i]->curve != prev;
        prev = r->sorted[i]->curve;
    }
    double h = r->n_runs * RH + (groups - 1) * GAP, H = top + h + 30;
    double pw = (W - nc - 40) / 2;
    bputs(b, "<section>\n<h2>Memory and decode time</h2>\n");
    bprintf(b, "<figure>\n<svg class=\"fig\" width=\"%.0f\" "
               "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" "
               "aria-label=\"bytes held and step time\">\n",
            W, H, W, H);
    double y = top;
    prev = -1;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (prev >= 0 && u->curve != prev)
            y += GAP;
        prev = u->curve;
        bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"5\" height=\"%.1f\" fill=\"%s\"/>", nc - 10,
                y + 3, RH - 6, r->curves[u->curve].color);
        bprintf(b, "<text class=\"rlabel\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", nc - 16,
                y + RH / 2 + 4.5);
        run_name(b, u);
        bputs(b, "</text>\n");
        y += RH;
    }
    bar_panel(b, r, 0, nc, pw - 30, top, RH, GAP, h);
    bar_panel(b, r, 1, nc + pw + 40, pw - 30, top, RH, GAP, h);
    bputs(b, "</svg>\n<figcaption>Left: memory each run holds after prefill (all layers, one "
             "sequence) as a share of the full cache; right: decode attention time per step "
             "relative to full. Bars short of the dashed line are savings.");
    if (r->tail_tokens > 0)
        bprintf(b, " The bytes include the %.0f uncompressed tokens after the span, so they "
                   "shrink less than the compression factor suggests.",
                r->tail_tokens);
    bputs(b, "</figcaption>\n</figure>\n</section>\n");
}

/* ---- HTML: the page ------------------------------------------------------------------------ */

static const char CSS[] =
    ":root{--ink:#1d2330;--muted:#5b6473;--line:#d9dee7;--panel:#f5f7fa}\n"
    "*{box-sizing:border-box}\n"
    "body{margin:0;background:#fff;color:var(--ink);font:15px/1.5 system-ui,-apple-system,"
    "\"Segoe UI\",Roboto,\"DejaVu Sans\",\"Liberation Sans\",Arial,sans-serif}\n"
    "main{max-width:1320px;margin:0 auto;padding:28px 32px 56px}\n"
    "h1{font-size:27px;margin:0 0 2px;letter-spacing:-.01em}\n"
    "h2{font-size:20px;margin:40px 0 10px;padding-bottom:5px;border-bottom:2px solid var(--line)}\n"
    "h3{font-size:15.5px;margin:18px 0 6px}\n"
    ".meta{color:var(--muted);font-size:13.5px;margin:0 0 14px}\n"
    ".summary{font-size:16.5px;line-height:1.6;max-width:1180px;margin:0 0 14px}\n"
    "dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:3px 14px;margin:0 0 6px;"
    "font-size:14px}\n"
    "dl.facts dt{color:var(--muted);font-weight:600}dl.facts dd{margin:0}\n"
    "ul.goals{list-style:none;padding:0;margin:4px 0 0}ul.goals li{margin:5px 0}\n"
    ".badge{display:inline-block;min-width:70px;text-align:center;font-size:12.5px;font-weight:700;"
    "padding:1px 9px;border-radius:11px;margin-right:10px}\n"
    ".badge.met{background:#dcf2e2;color:#11652b;border:1px solid #98d3a8}\n"
    ".badge.unmet{background:#fbe0e0;color:#9b1c1c;border:1px solid #eca8a8}\n"
    ".win{color:#11652b;font-weight:600}\n.lose{color:#9b1c1c;font-weight:600}\n"
    "code,pre{font-family:ui-monospace,\"DejaVu Sans Mono\",Menlo,Consolas,monospace}\n"
    "code{font-size:13px}\n"
    "pre{background:var(--panel);border:1px solid var(--line);border-radius:6px;padding:10px 14px;"
    "white-space:pre-wrap;word-break:break-all;font-size:13px;line-height:1.45;margin:4px 0}\n"
    ".table-wrap{overflow-x:auto}\n"
    "table{border-collapse:collapse;font-size:13.5px;font-variant-numeric:tabular-nums}\n"
    "th,td{padding:5px 6px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}\n"
    "th{background:var(--panel);font-weight:600;vertical-align:bottom;line-height:1.25}\n"
    "th .unit{font-weight:400;color:var(--muted);font-size:12px}\n"
    ".unit{font-weight:400;color:var(--muted);font-size:13.5px}\n"
    "th.l,td.l{text-align:left}\n"
    "tr.first td{border-top:2px solid #b9c1cd}\n"
    "td.na{color:#9aa3b0;text-align:center}\n"
    ".ag-good{background:#d5efdb}.ag-warn{background:#fde8bf}.ag-bad{background:#f8d0d0}\n"
    ".key{padding:0 6px;border-radius:3px}\n"
    "ul.notes{margin:10px 0 4px;padding-left:22px;font-size:14px;max-width:1180px}\n"
    "ul.notes li{margin:3px 0}\n"
    ".samples{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:12px 16px;"
    "margin:12px 0 0}\n"
    ".sample{border:1px solid var(--line);border-radius:6px;overflow:hidden}\n"
    ".sample .sh{background:var(--panel);border-bottom:1px solid var(--line);padding:5px 12px;"
    "font-weight:600;font-size:14px}\n"
    ".sample .st{padding:8px 12px;white-space:pre-wrap;overflow-wrap:anywhere;font-size:14px;"
    "line-height:1.55}\n"
    ".sample.prompt{margin:12px 0 0}.sample.prompt .st{color:var(--muted);background:#fafbfc}\n"
    ".dv{background:#fbdcdc;border-left:2px solid #c62828}\n"
    ".sw{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:8px;"
    "vertical-align:-1px}\n"
    ".sw.ext{background:#fff;border:2.5px solid;width:12px;height:12px}\n"
    ".ship-tag{display:inline-block;font-size:10.5px;font-weight:700;line-height:1.3;color:#fff;"
    "background:#1b5e20;border-radius:8px;padding:0 5px;margin-left:5px;vertical-align:1px;"
    "white-space:nowrap}\n"
    ".ext-tag{display:inline-block;font-size:10.5px;font-weight:600;line-height:1.3;color:#6a3d9a;"
    "background:#f1eaf8;border:1px solid #d4c2ea;border-radius:8px;padding:0 5px;margin-left:5px;"
    "vertical-align:1px;white-space:nowrap}\n"
    "tr.group td{background:#fff;border-bottom:1px solid #9aa3b0;font-weight:700;font-size:13px;"
    "color:#3a4250;padding-top:14px}\n"
    "table.runs{font-size:13px}table.runs th,table.runs td{padding:4px 5px}\n"
    "table.runs td.l{white-space:normal;min-width:170px}\n"
    "td.off,.key.off{background:#fde8bf;color:#8a4b00}\n"
    "th.sec,td.sec{color:#7a8392}\n"
    ".rank-grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:14px}\n"
    ".rank-card{border:1px solid var(--line);border-radius:8px;overflow:hidden}\n"
    ".rank-head{background:#1d2330;color:#fff;font-weight:700;padding:6px 12px;font-size:15px}\n"
    ".rank-head .unit{color:#c9d0db}\n"
    "table.rank{width:100%;font-size:13px}table.rank th,table.rank td{padding:3px 6px}\n"
    "table.rank td.l{white-space:normal}\n"
    "table.tracks{font-size:13px}table.tracks th,table.tracks td{padding:3px 8px}\n"
    "table.tracks .grp{border-left:2px solid #c9ced6}\n"
    "table.rank tr.win td{background:#e3f4e8;font-weight:700}\n"
    "tr.ceiling td{background:#f3f4f6;color:#4a5361;font-style:italic}\n"
    ".ab{display:inline-block;position:relative;width:52px;height:9px;background:#e6e9ef;"
    "margin-right:7px;vertical-align:0}\n"
    ".ab i{position:absolute;left:0;top:0;bottom:0;background:#3b6fb6}\n"
    "tr.ceiling .ab i{background:#8d96a5}\n"
    ".ab b{position:absolute;top:-3px;bottom:-3px;width:2px;margin-left:-1px;background:#111}\n"
    "table.depth td{min-width:58px;text-align:center}table.depth td.l{text-align:left}\n"
    "svg .reflabel{font-size:12px;fill:#222;font-weight:600}\n"
    "svg .legend.lhead{font-weight:700;fill:#5b6473}\n"
    "figure{margin:12px 0 6px}\n"
    "figcaption,.caption{color:var(--muted);font-size:14px;max-width:1180px;margin:6px 0 0}\n"
    "svg.fig{display:block;max-width:100%;height:auto}\n"
    "svg text{font-family:inherit;fill:#1d2330}\n"
    "svg .tick{font-size:12px;fill:#4a5361}\n"
    "svg .alabel{font-size:13px;fill:#3a4250}\n"
    "svg .ptitle{font-size:14.5px;font-weight:700}\n"
    "svg .better{font-size:12px;fill:#6b7482;font-style:italic}\n"
    "svg .legend{font-size:13px}\n"
    "svg .rlabel{font-size:12.5px}\n"
    "svg .val{font-size:12px;fill:#1d2330}svg .val.na{fill:#9aa3b0;font-style:italic}\n"
    "svg .nodata{font-size:13px;fill:#9aa3b0}\n"
    "svg .grid{stroke:#e3e7ee;stroke-width:1}svg .grid.minor{stroke:#f0f2f6}\n"
    "svg .grid.zero{stroke:#b9c1cd}\n"
    "svg .frame{fill:none;stroke:#aab2bf;stroke-width:1}\n";

static void render_html(struct buf *b, const struct report *r)
{
    bputs(b, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
             "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>");
    besc(b, r->title);
    bprintf(b, "</title>\n<style>\n%s</style>\n</head>\n<body>\n<main>\n", CSS);
    render_header(b, r);
    render_ranking(b, r);
    render_tracks(b, r);
    render_facts(b, r);
    render_table(b, r);
    render_outside(b, r);
    render_fidelity(b, r);
    render_depths(b, r);
    render_heatmap(b, r);
    render_masks(b, r);
    render_samples(b, r);
    render_bars(b, r);
    bputs(b, "</main>\n</body>\n</html>\n");
}

/* ---- Entry point --------------------------------------------------------------------------- */

enum kvcap_status kvcap_report_write(const char *metrics_path, const char *html_path,
                                     const char *csv_path)
{
    return kvcap_report_write_tracks(&metrics_path, 1, html_path, csv_path);
}

enum kvcap_status kvcap_report_write_tracks(const char *const *metrics_paths, int n_metrics,
                                            const char *html_path, const char *csv_path)
{
    KVCAP_RETURN_IF(!metrics_paths || n_metrics < 1 || n_metrics > 8, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_report_write: 1 to 8 metrics files, got %d", n_metrics);
    const char *metrics_path = metrics_paths[0];
    KVCAP_RETURN_IF(!metrics_path || !*metrics_path, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_report_write: no metrics file given");
    KVCAP_RETURN_IF((html_path && !*html_path) || (csv_path && !*csv_path),
                    KVCAP_ERR_INVALID_ARGUMENT, "kvcap_report_write: empty output path");
    KVCAP_RETURN_IF((html_path && strcmp(html_path, metrics_path) == 0) ||
                        (csv_path && strcmp(csv_path, metrics_path) == 0),
                    KVCAP_ERR_INVALID_ARGUMENT, "%s: an output would overwrite the metrics file",
                    metrics_path);
    KVCAP_RETURN_IF(html_path && csv_path && strcmp(html_path, csv_path) == 0,
                    KVCAP_ERR_INVALID_ARGUMENT, "%s: the HTML and the CSV output are the same file",
                    html_path);
    for (int i = 1; i < n_metrics; i++)
        KVCAP_RETURN_IF(!metrics_paths[i] || (html_path && !strcmp(html_path, metrics_paths[i])) ||
                            (csv_path && !strcmp(csv_path, metrics_paths[i])),
                        KVCAP_ERR_INVALID_ARGUMENT, "%s: an output would overwrite it",
                        metrics_paths[i] ? metrics_paths[i] : "(NULL)");
    struct report r, others[8];
    const struct report *other_ptrs[8] = {NULL};
    enum kvcap_status st = report_load(&r, metrics_path);
    int loaded = 0;
    for (int i = 1; st == KVCAP_OK && i < n_metrics; i++) {
        st = report_load(&others[i - 1], metrics_paths[i]);
        if (st == KVCAP_OK)
            other_ptrs[loaded++] = &others[i - 1];
    }
    if (st == KVCAP_OK && loaded)
        r.others = other_ptrs;
    struct buf html = {0}, csv = {0};
    if (st == KVCAP_OK && csv_path)
        render_csv(&csv, &r);
    if (st == KVCAP_OK && html_path)
        render_html(&html, &r);
    if (st == KVCAP_OK && (html.failed || csv.failed))
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory rendering the report",
                        metrics_path);
    /* both or neither: a report whose CSV was replaced while its HTML was not is two runs' */
    const char *paths[2];
    const void *data[2];
    size_t lens[2];
    int n = 0;
    if (csv_path)
        paths[n] = csv_path, data[n] = csv.p ? csv.p : "", lens[n++] = csv.len;
    if (html_path)
        paths[n] = html_path, data[n] = html.p ? html.p : "", lens[n++] = html.len;
    if (st == KVCAP_OK) {
        /* kvcap_write_files_atomic writes and syncs both temporaries before the first rename;
         * a termination signal between the two renames would still leave a new CSV beside an
         * old HTML, so those signals wait until the call returns (the cleanup handler then
         * finds no temporary file left). The wait is the writing and syncing of the two files,
         * not the rendering above. */
        sigset_t term, old;
        sigemptyset(&term);
        sigaddset(&term, SIGINT);
        sigaddset(&term, SIGTERM);
        sigaddset(&term, SIGHUP);
        sigaddset(&term, SIGQUIT);
        const int blocked = pthread_sigmask(SIG_BLOCK, &term, &old) == 0;
        st = kvcap_write_files_atomic(n, paths, data, lens);
        if (blocked)
            pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    free(html.p);
    free(csv.p);
    report_free(&r);
    for (int i = 0; i < loaded; i++)
        report_free(&others[i]);
    return st;
}
