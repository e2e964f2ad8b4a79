/* metrics.c — kvcap-eval's metrics.json (format 1, see report.h) and the kvpress.json beside it,
 * read and validated into struct report: every field checked, errors naming the one at fault. */
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/internal.h"
#include "report/report_internal.h"

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

static const char *const POLICIES[] = {"full",   "streaming",   "kvcapsule", "flashcache",
                                       "vlcache", "freekv",      "kvzip",     "random",
                                       "expected_attention", "composition"};

/* Okabe–Ito first (distinguishable with the common colour-vision deficiencies), then Tableau;
 * the reference curve is drawn in near-black (REFERENCE_COLOR). */
static const char *const PALETTE[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00",
                                      "#56B4E9", "#8C6D31", "#7F7F7F", "#B07AA1", "#F0A3B1"};
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

void report_free(struct report *r)
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

enum kvcap_status report_load(struct report *r, const char *path)
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
    double images, gap; /* optional: several images per prompt, gap_tokens of text apart */
    KVCAP_TRY(get_number(r, o, "setup", "images", 0, NUM_POS_COUNT, &images));
    KVCAP_TRY(get_number(r, o, "setup", "gap_tokens", 0, NUM_COUNT, &gap));
    r->images = isfinite(images) ? images : 1;
    r->gap_tokens = gap;
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
    r->task_keys = r->task_values = 1;
    if (o) {
        r->has_task = 1;
        KVCAP_TRY(get_string(r, o, "task", "name", 0, &r->task_name));
        KVCAP_TRY(get_string(r, o, "task", "line", 0, &r->task_line));
        KVCAP_TRY(get_string(r, o, "task", "question", 0, &r->task_question));
        KVCAP_TRY(get_string(r, o, "task", "haystack", 0, &r->task_haystack));
        KVCAP_TRY(get_number(r, o, "task", "queries", 0, NUM_COUNT, &r->task_queries));
        KVCAP_TRY(get_number(r, o, "task", "answer_tokens", 0, NUM_COUNT,
                             &r->task_answer_tokens));
        /* RULER's variants; files written before them have neither: one key, one value */
        double keys, values;
        KVCAP_TRY(get_number(r, o, "task", "keys", 0, NUM_POS_COUNT, &keys));
        KVCAP_TRY(get_number(r, o, "task", "values", 0, NUM_POS_COUNT, &values));
        r->task_keys = isfinite(keys) ? keys : 1;
        r->task_values = isfinite(values) ? values : 1;
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
