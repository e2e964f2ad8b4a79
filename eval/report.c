/* report.c — validates kvcap-eval's metrics.json (format 1, see report.h) and renders it as a
 * CSV table and a self-contained HTML page whose figures are inline SVG drawn here. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "internal.h"
#include "report.h"

/* Bounds that keep a hostile file from asking for absurd allocations or drawings. */
enum {
    MAX_FILE_BYTES = 1 << 30,
    MAX_LAYERS = 4096,
    MAX_MASK_TOKENS = 1 << 20,
    MAX_MASK_HEADS = 4096,
    MAX_MASK_CELLS = 1 << 26 /* layers * tokens of one bucket */
};

/* ---- The metrics, validated ---------------------------------------------------------------- */

/* Every optional number is NaN when absent or null. Strings point into the cJSON tree. */
struct run {
    const char *id, *policy, *label;
    const char *sample; /* generated text of prompt 0, or NULL */
    double retention, compression, token_agreement, next_token_agreement, first_divergence_mean;
    double nll, nll_full, nll_delta, cos_mean, rel_mean;
    double bytes_held, bytes_held_full, bytes_read, bytes_read_full, step_ms, step_ms_full;
    double *rel; /* per layer, n_layers entries, or NULL */
    int curve;   /* index into report.curves */
};

/* Runs sharing a label form one curve; a curve holding a "full" run is the reference. */
struct curve {
    const char *label;
    int reference;
    const char *color;
    int marker;
};

/* count[layer * n_tokens + token]: how many heads' key masks keep that token. */
struct mask {
    const char *bucket;
    int n_tokens, heads;
    uint16_t *count;
};

struct goal {
    const char *text;
    int met;
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
    double span_tokens, tail_tokens, generate_tokens, continuation_tokens, prompts, threads;
    double read_bandwidth_gbs;
    struct run *runs;
    const struct run **sorted; /* reference curves first, then by label, then by retention */
    int n_runs;
    struct curve *curves;
    int n_curves;
    struct mask *masks;
    int n_masks;
    struct goal *goals;
    int n_goals;
};

static const char *const POLICIES[] = {"full",    "streaming", "kvcapsule",  "flashcache",
                                       "vlcache", "freekv",    "composition"};

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

/* Number member `key` of `obj` into *out (NaN when absent or null and not required). */
static enum kvcap_status get_number(const struct report *r, const cJSON *obj, const char *where,
                                    const char *key, int required, enum num_kind kind,
                                    double *out)
{
    char f[256];
    const cJSON *v = member(obj, key);
    *out = NAN;
    if (!v) {
        KVCAP_RETURN_IF(required, KVCAP_ERR_FORMAT, "%s: %s: missing (expected %s)", r->path,
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
static enum kvcap_status get_object(const struct report *r, const cJSON *obj, const char *key,
                                    const cJSON **out)
{
    const cJSON *v = member(obj, key);
    *out = NULL;
    if (!v)
        return KVCAP_OK;
    KVCAP_RETURN_IF(!cJSON_IsObject(v), KVCAP_ERR_FORMAT, "%s: %s: expected an object, got %s",
                    r->path, key, type_name(v));
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
 * is the required length, named by `expect_what` in messages. */
static enum kvcap_status get_numbers(const struct report *r, const cJSON *obj, const char *where,
                                     const char *key, enum num_kind kind, int expect,
                                     const char *expect_what, double **out, int *n_out)
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
        if (!cJSON_IsNumber(e) || !num_ok(e->valuedouble, kind)) {
            free(a);
            if (!cJSON_IsNumber(e))
                return kvcap_fail(KVCAP_ERR_FORMAT, "%s: %s[%d]: expected %s, got %s", r->path, f,
                                  i, NUM_TEXT[kind], type_name(e));
            return kvcap_fail(KVCAP_ERR_FORMAT, "%s: %s[%d]: expected %s, got %g", r->path, f, i,
                              NUM_TEXT[kind], e->valuedouble);
        }
        a[i++] = e->valuedouble;
    }
    *out = a;
    *n_out = n;
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
                    "vlcache, freekv, composition",
                    r->path, where, u->policy);
    KVCAP_TRY(get_string(r, o, where, "label", 1, &u->label));
    KVCAP_TRY(get_number(r, o, where, "retention", 1, NUM_RETENTION, &u->retention));

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

    for (int j = 0; j < i; j++)
        KVCAP_RETURN_IF(strcmp(r->runs[j].id, u->id) == 0, KVCAP_ERR_FORMAT,
                        "%s: %s.id: '%s' repeats runs[%d].id", r->path, where, u->id, j);
    return KVCAP_OK;
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
    m->count = calloc(cells, sizeof *m->count);
    /* seen[t] == tag when the current (layer, head) already listed token t. */
    int *seen = calloc((size_t)m->n_tokens, sizeof *seen);
    if (!m->count || !seen) {
        free(seen);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: %s: out of memory", r->path, where);
    }
    enum kvcap_status st = KVCAP_OK;
    int layer = 0, tag = 0;
    const cJSON *per_layer, *per_head, *e;
    cJSON_ArrayForEach(per_layer, kept)
    {
        int n_heads = cJSON_IsArray(per_layer) ? cJSON_GetArraySize(per_layer) : -1;
        if (n_heads != m->heads) {
            st = n_heads < 0 ? kvcap_fail(KVCAP_ERR_FORMAT,
                                          "%s: %s.kept[%d]: expected an array per head, got %s",
                                          r->path, where, layer, type_name(per_layer))
                             : kvcap_fail(KVCAP_ERR_FORMAT,
                                          "%s: %s.kept[%d]: %d entries, expected %d (%s.heads)",
                                          r->path, where, layer, n_heads, m->heads, where);
            goto out;
        }
        int head = 0;
        cJSON_ArrayForEach(per_head, per_layer)
        {
            tag++;
            if (!cJSON_IsArray(per_head)) {
                st = kvcap_fail(KVCAP_ERR_FORMAT,
                                "%s: %s.kept[%d][%d]: expected an array of token indices, got %s",
                                r->path, where, layer, head, type_name(per_head));
                goto out;
            }
            int k = 0;
            cJSON_ArrayForEach(e, per_head)
            {
                double t = cJSON_IsNumber(e) ? e->valuedouble : -1;
                if (!(t >= 0 && t < m->n_tokens && t == floor(t))) {
                    if (cJSON_IsNumber(e))
                        st = kvcap_fail(KVCAP_ERR_FORMAT,
                                        "%s: %s.kept[%d][%d][%d]: expected a token index in "
                                        "[0, %d), got %g",
                                        r->path, where, layer, head, k, m->n_tokens, t);
                    else
                        st = kvcap_fail(KVCAP_ERR_FORMAT,
                                        "%s: %s.kept[%d][%d][%d]: expected a token index, got %s",
                                        r->path, where, layer, head, k, type_name(e));
                    goto out;
                }
                int ti = (int)t;
                if (seen[ti] != tag) {
                    seen[ti] = tag;
                    m->count[(size_t)layer * (size_t)m->n_tokens + (size_t)ti]++;
                }
                k++;
            }
            head++;
        }
        layer++;
    }
out:
    free(seen);
    return st;
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
    return strcmp(a->label, b->label);
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
        if (c == r->n_curves)
            r->curves[r->n_curves++].label = u->label;
        r->curves[c].reference |= strcmp(u->policy, "full") == 0;
    }
    qsort(r->curves, (size_t)r->n_curves, sizeof *r->curves, cmp_curve);
    int colored = 0;
    for (int c = 0; c < r->n_curves; c++) {
        struct curve *cv = &r->curves[c];
        if (cv->reference) {
            cv->color = REFERENCE_COLOR;
            cv->marker = 0;
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
    for (int i = 0; r->runs && i < r->n_runs; i++)
        free(r->runs[i].rel);
    for (int i = 0; r->masks && i < r->n_masks; i++)
        free(r->masks[i].count);
    free(r->runs);
    free(r->sorted);
    free(r->curves);
    free(r->masks);
    free(r->goals);
    cJSON_Delete(r->root);
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
    KVCAP_TRY(get_object(r, root, "model", &o));
    KVCAP_TRY(get_string(r, o, "model", "name", 0, &r->model_name));
    KVCAP_TRY(get_string(r, o, "model", "file", 0, &r->model_file));
    KVCAP_TRY(get_number(r, o, "model", "layers", 0, NUM_POS_COUNT, &layers));
    KVCAP_TRY(get_number(r, o, "model", "q_heads", 0, NUM_POS_COUNT, &r->q_heads));
    KVCAP_TRY(get_number(r, o, "model", "kv_heads", 0, NUM_POS_COUNT, &r->kv_heads));
    KVCAP_TRY(get_number(r, o, "model", "head_dim", 0, NUM_POS_COUNT, &r->head_dim));
    KVCAP_RETURN_IF(layers > MAX_LAYERS, KVCAP_ERR_FORMAT,
                    "%s: model.layers: %g exceeds the limit of %d", path, layers, MAX_LAYERS);
    r->n_layers = isnan(layers) ? 0 : (int)layers;

    KVCAP_TRY(get_object(r, root, "corpus", &o));
    KVCAP_TRY(get_string(r, o, "corpus", "source", 0, &r->corpus_source));
    KVCAP_TRY(get_strings(r, o, "corpus", "calibration", &r->calibration_files));
    KVCAP_TRY(get_strings(r, o, "corpus", "heldout", &r->heldout_files));
    KVCAP_TRY(get_number(r, o, "corpus", "calibration_tokens", 0, NUM_COUNT,
                         &r->calibration_tokens));
    KVCAP_TRY(get_number(r, o, "corpus", "heldout_tokens", 0, NUM_COUNT, &r->heldout_tokens));

    KVCAP_TRY(get_object(r, root, "setup", &o));
    KVCAP_TRY(get_number(r, o, "setup", "span_tokens", 0, NUM_COUNT, &r->span_tokens));
    KVCAP_TRY(get_number(r, o, "setup", "tail_tokens", 0, NUM_COUNT, &r->tail_tokens));
    KVCAP_TRY(get_number(r, o, "setup", "generate_tokens", 0, NUM_COUNT, &r->generate_tokens));
    KVCAP_TRY(get_number(r, o, "setup", "continuation_tokens", 0, NUM_COUNT,
                         &r->continuation_tokens));
    KVCAP_TRY(get_number(r, o, "setup", "prompts", 0, NUM_COUNT, &r->prompts));
    KVCAP_TRY(get_number(r, o, "setup", "threads", 0, NUM_COUNT, &r->threads));
    KVCAP_TRY(get_string(r, o, "setup", "storage", 0, &r->storage));
    KVCAP_TRY(get_number(r, o, "setup", "read_bandwidth_gbs", 0, NUM_NONNEG,
                         &r->read_bandwidth_gbs));

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

static void csv_text(struct buf *b, const char *s)
{
    if (!strpbrk(s, ",\"\r\n")) {
        bputs(b, s);
        return;
    }
    bputs(b, "\"");
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

static void render_csv(struct buf *b, const struct report *r)
{
    bputs(b, "id,policy,label,retention,compression,token_agreement,next_token_agreement,"
             "first_divergence_mean,nll,nll_full,nll_delta,attn_cosine_mean,attn_rel_err_mean,"
             "bytes_held,bytes_held_full,bytes_read_per_step,step_ms,step_ms_full,"
             "step_time_ratio\n");
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
                            ratio(u->step_ms, u->step_ms_full)};
        for (size_t k = 0; k < sizeof v / sizeof v[0]; k++)
            csv_number(b, v[k]);
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

/* Whether the summary ranks runs by next-token agreement (some compressed run has it) rather
 * than by greedy token agreement. */
static int rank_by_next_token(const struct report *r)
{
    for (int i = 0; i < r->n_runs; i++)
        if (!is_reference(r, &r->runs[i]) && isfinite(r->runs[i].next_token_agreement))
            return 1;
    return 0;
}

static double rank_value(const struct run *u, int next_token)
{
    return next_token ? u->next_token_agreement : u->token_agreement;
}

/* The non-reference run with the highest agreement (next-token or greedy, per `next_token`)
 * whose compression is within 25 % of `target`; ties go to the higher compression. */
static const struct run *best_near(const struct report *r, double target, int next_token)
{
    const struct run *best = NULL;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = &r->runs[i];
        double v = rank_value(u, next_token);
        if (is_reference(r, u) || isnan(u->compression) || isnan(v) ||
            u->compression < target / 1.25 || u->compression > target * 1.25)
            continue;
        double bv = best ? rank_value(best, next_token) : 0;
        if (!best || v > bv || (v == bv && u->compression > best->compression))
            best = u;
    }
    return best;
}

static void swatch(struct buf *b, const struct curve *c)
{
    bprintf(b, "<span class=\"sw\" style=\"background:%s\"></span>", c->color);
}

/* ---- HTML: header, summary, goals ---------------------------------------------------------- */

/* "<strong>label</strong> at retention 0.40 (2.46x, 99.6 % next-token agreement, 99.1 % greedy
 * agreement, dNLL ...)". */
static void best_clause(struct buf *b, const struct report *r, double target, int next_token)
{
    const struct run *u = best_near(r, target, next_token);
    char d[48];
    if (!u) {
        bprintf(b, "no run with a measured %s agreement comes near that compression",
                next_token ? "next-token" : "greedy token");
        return;
    }
    bputs(b, "<strong>");
    besc(b, u->label);
    bprintf(b, "</strong> at retention %.2f (%.2f&times;", u->retention, u->compression);
    if (isfinite(u->next_token_agreement))
        bprintf(b, ", %.1f&nbsp;%% next-token agreement", 100 * u->next_token_agreement);
    if (isfinite(u->token_agreement))
        bprintf(b, ", %.1f&nbsp;%% greedy agreement", 100 * u->token_agreement);
    if (isfinite(u->nll_delta))
        bprintf(b, ", &Delta;NLL %s nats/token", fmt_signed(d, sizeof d, u->nll_delta, 4));
    bputs(b, ")");
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

    /* The summary: what was measured, then the answer to "which policy should I use". */
    bputs(b, "<p class=\"summary\">");
    if (r->model_name) {
        bputs(b, "<strong>");
        besc(b, r->model_name);
        bputs(b, "</strong>");
    } else {
        bputs(b, "The model");
    }
    bputs(b, " was evaluated");
    if (isfinite(r->prompts))
        bprintf(b, " on %s held-out prompt%s", fmt_count(n1, sizeof n1, r->prompts),
                r->prompts == 1 ? "" : "s");
    if (r->corpus_source) {
        bputs(b, " from ");
        besc(b, r->corpus_source);
    }
    if (isfinite(r->heldout_tokens))
        bprintf(b, " (%s held-out tokens)", fmt_count(n1, sizeof n1, r->heldout_tokens));
    bputs(b, ": each policy compressed the cache of ");
    if (isfinite(r->span_tokens))
        bprintf(b, "a %s-token span", fmt_count(n1, sizeof n1, r->span_tokens));
    else
        bputs(b, "the prompt's compressible span");
    if (isfinite(r->generate_tokens))
        bprintf(b, ", then %s tokens were generated greedily and compared with the full cache's",
                fmt_count(n2, sizeof n2, r->generate_tokens));
    if (isfinite(r->continuation_tokens))
        bprintf(b, ", and %s held-out continuation tokens were scored teacher-forced",
                fmt_count(n2, sizeof n2, r->continuation_tokens));
    int next_token = rank_by_next_token(r);
    bprintf(b, ". Best by %s at about 2.5&times; compression: ",
            next_token ? "next-token agreement (teacher-forced, the per-step measure)"
                       : "greedy token agreement");
    best_clause(b, r, 2.5, next_token);
    bputs(b, "; at about 5&times;: ");
    best_clause(b, r, 5.0, next_token);
    bputs(b, ".</p>\n");

    /* Facts a reader checks before trusting the numbers. */
    bputs(b, "<dl class=\"facts\">\n");
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
                     {"held out", r->heldout_files, r->heldout_tokens}};
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
    const struct {
        const char *fmt;
        double v;
    } setup[] = {{"span %s tokens", r->span_tokens},
                 {"tail %s tokens", r->tail_tokens},
                 {"%s generated", r->generate_tokens},
                 {"%s continuation tokens scored", r->continuation_tokens},
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
    bputs(b, "</header>\n");
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

static void render_table(struct buf *b, const struct report *r)
{
    char n1[32], d[48];
    bputs(b, "<section>\n<h2>Headline results</h2>\n<div class=\"table-wrap\"><table>\n<thead><tr>"
             "<th class=\"l\">Policy</th><th>Retention</th><th>Compression</th>"
             "<th>Greedy<br>agreement<br><span class=\"unit\">");
    if (isfinite(r->generate_tokens))
        bprintf(b, "%s generated", fmt_count(n1, sizeof n1, r->generate_tokens));
    else
        bputs(b, "generated tokens");
    bputs(b, "</span></th><th>Next-token<br>agreement<br><span class=\"unit\">");
    if (isfinite(r->continuation_tokens))
        bprintf(b, "%s teacher-forced", fmt_count(n1, sizeof n1, r->continuation_tokens));
    else
        bputs(b, "teacher-forced");
    bputs(b, "</span></th>");
    bputs(b, "<th>First<br>divergence<br><span class=\"unit\">mean token");
    if (isfinite(r->generate_tokens))
        bprintf(b, " of %s", fmt_count(n1, sizeof n1, r->generate_tokens));
    bputs(b, "</span></th>"
             "<th>&Delta;NLL<br>vs full<br><span class=\"unit\">nats/token</span></th>"
             "<th>Attn.<br>cosine<br><span class=\"unit\">mean of layers</span></th>"
             "<th>Bytes held<br><span class=\"unit\">MiB</span></th>"
             "<th>Bytes held<br><span class=\"unit\">% of full</span></th>"
             "<th>Step time<br><span class=\"unit\">vs full</span></th></tr></thead>\n<tbody>\n");
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        int first = i == 0 || r->sorted[i - 1]->curve != u->curve;
        bprintf(b, "<tr class=\"run%s\" title=\"", first && i ? " first" : "");
        besc(b, u->id);
        bputs(b, "\"><td class=\"l\">");
        swatch(b, &r->curves[u->curve]);
        besc(b, u->label);
        bprintf(b, "</td><td>%.2f</td>", u->retention);
        if (isfinite(u->compression))
            bprintf(b, "<td>%.2f&times;</td>", u->compression);
        else
            na_cell(b);
        agreement_cell(b, u->token_agreement);
        agreement_cell(b, u->next_token_agreement);
        if (isfinite(u->first_divergence_mean))
            bprintf(b, "<td>%.1f</td>", u->first_divergence_mean);
        else
            na_cell(b);
        if (isfinite(u->nll_delta))
            bprintf(b, "<td>%s</td>", fmt_signed(d, sizeof d, u->nll_delta, 4));
        else
            na_cell(b);
        if (isfinite(u->cos_mean))
            bprintf(b, "<td>%.4f</td>", u->cos_mean);
        else
            na_cell(b);
        if (isfinite(u->bytes_held))
            bprintf(b, "<td>%.2f</td>", u->bytes_held / 1048576.0);
        else
            na_cell(b);
        double held = ratio(u->bytes_held, u->bytes_held_full);
        if (isfinite(held))
            bprintf(b, "<td>%.1f&nbsp;%%</td>", 100 * held);
        else
            na_cell(b);
        double step = ratio(u->step_ms, u->step_ms_full);
        if (isfinite(step))
            bprintf(b, "<td>%.2f&times;</td>", step);
        else
            na_cell(b);
        bputs(b, "</tr>\n");
    }
    bputs(b, "</tbody></table></div>\n");
    render_notes(b, r);
    bputs(b, "<p class=\"caption\">One row per run, grouped by policy. Greedy agreement is the "
             "share of greedily generated tokens equal to the full cache's; it cascades: once one "
             "token differs, the two continuations go separate ways and every later token tends "
             "to differ too. Next-token agreement does not cascade: on the held-out continuation, "
             "teacher-forced (both caches see the same true text), it is the share of positions "
             "where the run's most likely next token is full's. Both are coloured "
             "<span class=\"key ag-good\">&ge;&nbsp;99&nbsp;%</span> "
             "<span class=\"key ag-warn\">&ge;&nbsp;95&nbsp;%</span> "
             "<span class=\"key ag-bad\">below</span>; &Delta;NLL above zero means the "
             "compressed cache predicts the held-out text worse. &mdash; means not measured.</p>\n"
             "</section>\n");
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

/* One marker: circle, square, triangle, diamond or inverted triangle. */
static void marker(struct buf *b, int shape, double x, double y, const char *color)
{
    const double s = 4.6;
    switch (shape) {
    case 0:
        bprintf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"%.1f\" fill=\"%s\"", x, y, s, color);
        break;
    case 1:
        bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"",
                x - s * 0.85, y - s * 0.85, s * 1.7, s * 1.7, color);
        break;
    case 2:
        bprintf(b, "<path d=\"M%.1f %.1fl%.1f %.1fh%.1fz\" fill=\"%s\"", x, y - s * 1.1, s * 1.1,
                s * 1.9, -s * 2.2, color);
        break;
    case 3:
        bprintf(b, "<path d=\"M%.1f %.1fl%.1f %.1fl%.1f %.1fl%.1f %.1fz\" fill=\"%s\"", x,
                y - s * 1.2, s * 1.2, s * 1.2, -s * 1.2, s * 1.2, -s * 1.2, -s * 1.2, color);
        break;
    default:
        bprintf(b, "<path d=\"M%.1f %.1fl%.1f %.1fh%.1fz\" fill=\"%s\"", x, y + s * 1.1, s * 1.1,
                -s * 1.9, -s * 2.2, color);
        break;
    }
    bputs(b, " stroke=\"#fff\" stroke-width=\"1\">");
}

/* ---- HTML: fidelity vs retention ----------------------------------------------------------- */

enum metric { M_AGREEMENT, M_NEXT_TOKEN, M_NLL_DELTA, M_COS_GAP };

static double metric_value(const struct run *u, enum metric m)
{
    switch (m) {
    case M_AGREEMENT: return 100 * u->token_agreement;
    case M_NEXT_TOKEN: return 100 * u->next_token_agreement;
    case M_NLL_DELTA: return u->nll_delta;
    case M_COS_GAP: {
        double g = 1 - u->cos_mean;
        return g > 0 ? g : NAN; /* not on a log axis */
    }
    }
    return NAN;
}

struct panel_spec {
    enum metric m;
    const char *title, *ylabel, *better;
};

/* One plot at (px, py) of outer size pw x ph: title, axes, the reference line, a polyline and
 * markers per curve. */
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
    int have_reference = 0;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = &r->runs[i];
        if (is_reference(r, u)) {
            have_reference = 1;
            continue;
        }
        double v = metric_value(u, ps->m);
        if (isfinite(v)) {
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
    struct axis ya, xa = *xa_in;
    double ref = NAN;
    if (ps->m == M_AGREEMENT || ps->m == M_NEXT_TOKEN) {
        ref = 100;
        axis_tight(&ya, lo, 100, 5, 0.04);
    } else if (ps->m == M_NLL_DELTA) {
        ref = 0;
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
               "retention (fraction of the span kept)</text>\n",
            x + w / 2, y + h + 38);
    bprintf(b, "<text class=\"alabel\" transform=\"translate(%.1f %.1f) rotate(-90)\" "
               "text-anchor=\"middle\">",
            px + 16, y + h / 2);
    besc(b, ps->ylabel);
    bputs(b, "</text>\n");

    if (have_reference && isfinite(ref)) {
        double yr = axis_px(&ya, ref);
        bprintf(b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                   "stroke-width=\"1.6\" stroke-dasharray=\"6 4\"/>\n",
                x, x + w, yr, yr, REFERENCE_COLOR);
    }
    for (int c = 0; c < r->n_curves; c++) {
        const struct curve *cv = &r->curves[c];
        if (cv->reference)
            continue;
        int n = 0;
        bprintf(b, "<g><polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2.2\" points=\"",
                cv->color);
        for (int i = 0; i < r->n_runs; i++) {
            const struct run *u = r->sorted[i];
            double v = metric_value(u, ps->m);
            if (u->curve != c || !isfinite(v))
                continue;
            bprintf(b, "%s%.1f,%.1f", n++ ? " " : "", axis_px(&xa, u->retention),
                    axis_px(&ya, v));
        }
        bputs(b, "\"/>");
        for (int i = 0; i < r->n_runs; i++) {
            const struct run *u = r->sorted[i];
            double v = metric_value(u, ps->m);
            if (u->curve != c || !isfinite(v))
                continue;
            marker(b, cv->marker, axis_px(&xa, u->retention), axis_px(&ya, v), cv->color);
            bputs(b, "<title>");
            run_name(b, u);
            bprintf(b, ": %.4g</title>", v);
            bputs(b, cv->marker == 0 ? "</circle>" : cv->marker == 1 ? "</rect>" : "</path>");
        }
        bputs(b, "</g>\n");
    }
}

/* Legend items left to right, wrapping at `width`; returns the height used. */
static double curve_legend(struct buf *b, const struct report *r, double x0, double y0,
                           double width, int emit)
{
    double x = x0, y = y0 + 12;
    for (int c = 0; c < r->n_curves; c++) {
        const struct curve *cv = &r->curves[c];
        double item = 34 + approx_text_width(cv->label, 13) + (cv->reference ? 80 : 0) + 26;
        if (x > x0 && x + item > x0 + width) {
            x = x0;
            y += 24;
        }
        if (emit) {
            bprintf(b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                       "stroke-width=\"2.2\"%s/>",
                    x, x + 28, y, y, cv->color,
                    cv->reference ? " stroke-dasharray=\"6 4\" stroke-width=\"1.6\"" : "");
            if (!cv->reference) {
                marker(b, cv->marker, x + 14, y, cv->color);
                bputs(b, cv->marker == 0 ? "</circle>" : cv->marker == 1 ? "</rect>" : "</path>");
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
        {M_AGREEMENT, "Greedy agreement with full", "greedy token agreement (%)",
         "higher is better"},
        {M_NEXT_TOKEN, "Next-token agreement (teacher-forced)", "next-token agreement (%)",
         "higher is better"},
        {M_NLL_DELTA, "NLL change vs full", "\xce\x94NLL (nats/token)", "lower is better"},
        {M_COS_GAP, "Attention output drift", "1 \xe2\x88\x92 cosine (mean over layers)",
         "lower is better"},
    };
    /* A 2 x 2 grid: the two agreements on top, NLL and attention drift below. */
    const double W = 1256, PH = 350, ROW = PH + 16;
    double rlo = INFINITY, rhi = -INFINITY;
    for (int i = 0; i < r->n_runs; i++)
        if (!is_reference(r, &r->runs[i])) {
            rlo = fmin(rlo, r->runs[i].retention);
            rhi = fmax(rhi, r->runs[i].retention);
        }
    bputs(b, "<section>\n<h2>Fidelity vs retention</h2>\n");
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
    bprintf(b, "<figure>\n<svg class=\"fig\" width=\"%.0f\" "
               "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" "
               "aria-label=\"fidelity vs retention\">\n",
            W, lh + 8 + ROW + PH, W, lh + 8 + ROW + PH);
    curve_legend(b, r, 10, 0, W - 20, 1);
    for (int k = 0; k < 4; k++)
        fidelity_panel(b, r, &panels[k], &xa, (k % 2) * W / 2, lh + 8 + (k / 2) * ROW, W / 2,
                       PH);
    bputs(b, "</svg>\n<figcaption>One line per policy across its retention settings (hover a "
             "marker for its value). Top left: share of greedily generated tokens equal to the "
             "full cache's (one early difference changes the rest of the continuation, so this "
             "falls fast); top right: share of held-out positions, teacher-forced, where the "
             "most likely next token is full's (each step judged on its own); bottom left: "
             "change in held-out NLL; bottom right: how far attention outputs drift from full's, "
             "on a log scale so that small errors stay apart. The dashed line is the full cache "
             "(100&nbsp;% agreement, &Delta;NLL 0); runs without a measurement are left out of "
             "that panel.</figcaption>\n</figure>\n</section>\n");
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
             "layer's attention output against full's on held-out queries. Look for rows that "
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

static void render_mask(struct buf *b, const struct report *r, const struct mask *m)
{
    const double W = 1256, lm = 64, top = 40, rh = 7;
    int n = m->n_tokens, L = r->n_layers;
    double cw = fmin(8, (W - lm - 20) / n);
    if (cw >= 1)
        cw = floor(cw * 4) / 4; /* whole quarter pixels keep the columns crisp */
    double gw = cw * n, gh = rh * L;
    double H = top + gh + 62;
    double kept = 0;
    for (size_t i = 0; i < (size_t)L * (size_t)n; i++)
        kept += m->count[i];
    double per_head = kept / ((double)L * m->heads);

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
    int step = 1;
    while (n / step > 16 || step * cw < 28)
        step *= 2;
    for (int t = 0; t <= n; t += step)
        bprintf(b, "<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>"
                   "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>",
                lm + t * cw, lm + t * cw, top - 4, top + gh, lm + t * cw, top - 8, t);
    bprintf(b, "\n<text class=\"alabel\" transform=\"translate(14 %.1f) rotate(-90)\" "
               "text-anchor=\"middle\">layer</text>\n",
            top + gh / 2);
    for (int l = 0; l < L; l += 5)
        bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%d</text>",
                lm - 6, top + (l + 0.5) * rh + 4, l);
    bprintf(b, "\n<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#fff\" "
               "stroke=\"#9aa3b0\" stroke-width=\"0.8\"/>\n",
            lm, top, gw, gh);
    /* One path per shade; a run of equal shades along a layer is one rectangle. */
    for (int k = 1; k <= m->heads; k++) {
        char col[8];
        shade_color(k, m->heads, col);
        bprintf(b, "<path fill=\"%s\" d=\"", col);
        for (int l = 0; l < L; l++) {
            const uint16_t *row = m->count + (size_t)l * (size_t)n;
            for (int t = 0; t < n;) {
                if (row[t] != k) {
                    t++;
                    continue;
                }
                int e = t;
                while (e < n && row[e] == k)
                    e++;
                bprintf(b, "M%.2f %.1fh%.2fv%.1fh%.2fz", lm + t * cw, top + l * rh, (e - t) * cw,
                        rh - 1, -(e - t) * cw);
                t = e;
            }
        }
        bputs(b, "\"/>\n");
    }
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
            shade_color(k, m->heads, col);
        bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"16\" height=\"14\" fill=\"%s\" "
                   "stroke=\"#9aa3b0\" stroke-width=\"0.8\"/><text class=\"tick\" x=\"%.1f\" "
                   "y=\"%.1f\">%d of %d head%s</text>",
                kx, ky, col, kx + 22, ky + 11, k, m->heads,
                m->heads == 1 ? "" : "s");
        kx += 130;
    }
    bprintf(b, "\n</svg>\n<figcaption>Rows are layers, columns the %d token positions of the "
               "bucket in order (row-major over the grid); the shade is the fraction of the %d "
               "KV heads whose learned key mask keeps that token &mdash; white: dropped by every "
               "head, darkest: kept by all. Vertical stripes are tokens every layer "
               "keeps.</figcaption>\n</figure>\n",
            n, m->heads);
}

static void render_masks(struct buf *b, const struct report *r)
{
    if (!r->n_masks)
        return;
    bputs(b, "<section>\n<h2>KVCapsule retained-token masks</h2>\n<p class=\"caption\">Which "
             "tokens of a span KVCapsule's key masks keep, per bucket: each panel overlays the "
             "heads of every layer, so a reader can see whether retention follows the image "
             "structure or is spread evenly.</p>\n");
    for (int i = 0; i < r->n_masks; i++)
        render_mask(b, r, &r->masks[i]);
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
    render_table(b, r);
    render_fidelity(b, r);
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
    struct report r;
    enum kvcap_status st = report_load(&r, metrics_path);
    struct buf html = {0}, csv = {0};
    if (st == KVCAP_OK && csv_path)
        render_csv(&csv, &r);
    if (st == KVCAP_OK && html_path)
        render_html(&html, &r);
    if (st == KVCAP_OK && (html.failed || csv.failed))
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory rendering the report",
                        metrics_path);
    if (st == KVCAP_OK && csv_path)
        st = kvcap_write_file_atomic(csv_path, csv.p ? csv.p : "", csv.len);
    if (st == KVCAP_OK && html_path)
        st = kvcap_write_file_atomic(html_path, html.p ? html.p : "", html.len);
    free(html.p);
    free(csv.p);
    report_free(&r);
    return st;
}
