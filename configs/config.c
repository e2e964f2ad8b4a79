/* config.c — loads the calibration and runtime YAML configs (libyaml's document API) into plain
 * structs, with every error pointing at the offending node: FILE:LINE:COL: field.path: problem. */
#include <errno.h>
#include <limits.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

#include "configs/config.h"
#include "common/internal.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))
#define FIELD_CAP 128  /* a dotted field path: "schedule.keys.ratios[1023]" */
#define MAX_MARKS 256  /* field -> mark records kept to place validator messages */
#define MSG_CAP 1024   /* one message, as kvcap_last_error() holds it */
#define MAX_DEPTH 16   /* nesting levels; the deepest config path (model.rope.sections) has 4 */

/* ---- Names of the config-only enums ----------------------------------------------------- */
static const char *const key_method_names[] = {"closed_form", "trained"};
static const char *const activation_names[] = {"gelu", "linear"};
static const char *const schedule_kind_names[] = {"pyramid", "uniform", "list"};

static int parse_in(const char *const *names, int n, const char *s, int *out)
{
    if (!s)
        return 0;
    for (int i = 0; i < n; i++) {
        if (strcasecmp(names[i], s) == 0) {
            *out = i;
            return 1;
        }
    }
    return 0;
}

#define DEFINE_LOCAL_NAMES(fn, type, table)                                  \
    int fn##_parse(const char *s, type *out)                                 \
    {                                                                        \
        int v;                                                               \
        if (!parse_in(table, (int)COUNT(table), s, &v))                      \
            return 0;                                                        \
        *out = (type)v;                                                      \
        return 1;                                                            \
    }                                                                        \
    const char *fn##_name(type value)                                        \
    {                                                                        \
        int v = (int)value;                                                  \
        return v >= 0 && v < (int)COUNT(table) ? table[v] : "?";             \
    }

DEFINE_LOCAL_NAMES(kvcap_key_method, enum kvcap_key_method, key_method_names)
DEFINE_LOCAL_NAMES(kvcap_activation, enum kvcap_activation, activation_names)
DEFINE_LOCAL_NAMES(kvcap_schedule_kind, enum kvcap_schedule_kind, schedule_kind_names)

/* A set of names seen through int: the parser, the value -> name map and the number of values
 * accepted (0..count-1; 0 = every value the name table knows, so a policy added to names.c is
 * accepted here without an edit), so one routine reads and reports every enum field. */
struct name_set {
    int (*parse)(const char *s, int *out);
    const char *(*name)(int v);
    int count;
};

#define NAME_SET(tag, type, prefix, n)                                               \
    static int tag##_parse_i(const char *s, int *out)                               \
    {                                                                                \
        type t;                                                                      \
        if (!prefix##_parse(s, &t) || (int)t < 0 || ((n) > 0 && (int)t >= (n)))      \
            return 0;                                                                \
        *out = (int)t;                                                               \
        return 1;                                                                    \
    }                                                                                \
    static const char *tag##_name_i(int v) { return prefix##_name((type)v); }       \
    static const struct name_set tag##_set = {tag##_parse_i, tag##_name_i, (n)};

NAME_SET(rope_type, enum kvcap_rope_type, kvcap_rope_type, 0)
NAME_SET(pairing, enum kvcap_rope_pairing, kvcap_rope_pairing, 0)
NAME_SET(policy, enum kvcap_policy, kvcap_policy, 0)
NAME_SET(structure, enum kvcap_structure, kvcap_structure, 0)
NAME_SET(key_method, enum kvcap_key_method, kvcap_key_method, 0)
NAME_SET(activation, enum kvcap_activation, kvcap_activation, 0)
NAME_SET(schedule_kind, enum kvcap_schedule_kind, kvcap_schedule_kind, 0)
/* Storage: only F32, F16 and BF16, the dtype values 0..2 (kvcap.h pins them). */
NAME_SET(storage, enum kvcap_dtype, kvcap_dtype, 3)

/* ---- Schedules --------------------------------------------------------------------------- */
enum kvcap_status kvcap_schedule_expand(const struct kvcap_schedule *s, int n_layers,
                                        double *out)
{
    KVCAP_RETURN_IF(!s || !out, KVCAP_ERR_INVALID_ARGUMENT, "schedule: NULL pointer");
    KVCAP_RETURN_IF(n_layers < 1, KVCAP_ERR_INVALID_ARGUMENT, "schedule: %d layers", n_layers);
    switch (s->kind) {
    case KVCAP_SCHEDULE_PYRAMID:
        for (int l = 0; l < n_layers; l++) {
            /* Written as a convex combination so both endpoints are exact. */
            double t = n_layers > 1 ? (double)l / (double)(n_layers - 1) : 0.0;
            out[l] = (1.0 - t) * s->first + t * s->last;
        }
        return KVCAP_OK;
    case KVCAP_SCHEDULE_UNIFORM:
        for (int l = 0; l < n_layers; l++)
            out[l] = s->ratio;
        return KVCAP_OK;
    case KVCAP_SCHEDULE_LIST:
        KVCAP_RETURN_IF(!s->ratios || s->n_ratios != n_layers, KVCAP_ERR_INVALID_ARGUMENT,
                        "schedule: list of %d ratios for %d layers", s->n_ratios, n_layers);
        memcpy(out, s->ratios, (size_t)n_layers * sizeof *out);
        return KVCAP_OK;
    }
    return kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "schedule: unknown kind %d", (int)s->kind);
}

static void schedule_free(struct kvcap_schedule *s)
{
    free(s->ratios);
    s->ratios = NULL;
    s->n_ratios = 0;
}

/* ---- Defaults ---------------------------------------------------------------------------- */
void kvcap_calib_config_default(struct kvcap_calib_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    struct kvcap_schedule uniform = {.kind = KVCAP_SCHEDULE_UNIFORM, .ratio = 0.4};
    cfg->schedule_keys = uniform;
    cfg->schedule_values = uniform;
    cfg->keys.method = KVCAP_KEY_METHOD_CLOSED_FORM;
    cfg->keys.activation = KVCAP_ACTIVATION_GELU;
    cfg->keys.hidden = 0;
    cfg->keys.ridge = 1e-3;
    cfg->keys.train = (struct kvcap_train_config){.steps = 300,
                                                  .lr = 1e-3,
                                                  .tau_start = 1.0,
                                                  .tau_end = 0.05,
                                                  .lambda_bce = 0.01,
                                                  .lambda_r = 1.0,
                                                  .finetune_steps = 100,
                                                  .seed = 0};
    cfg->validation_fraction = 0.1;
    cfg->validation_seed = 0;
    cfg->storage = KVCAP_DTYPE_F16;
}

void kvcap_calib_config_free(struct kvcap_calib_config *cfg)
{
    if (!cfg)
        return;
    schedule_free(&cfg->schedule_keys);
    schedule_free(&cfg->schedule_values);
}

void kvcap_runtime_config_default(struct kvcap_runtime_config *cfg)
{
    if (!cfg)
        return;
    memset(cfg, 0, sizeof *cfg);
    cfg->policy[KVCAP_SPAN_VISION] = KVCAP_POLICY_FLASHCACHE; /* no artifact configured */
    cfg->policy[KVCAP_SPAN_TEXT] = KVCAP_POLICY_FULL;
    cfg->policy[KVCAP_SPAN_GENERATED] = KVCAP_POLICY_FULL;
    cfg->fallback = KVCAP_POLICY_FLASHCACHE;
    cfg->flashcache = (struct kvcap_flashcache_config){
        .gamma = 0.2, .retention = 0.4, .min_tokens = 0, .sinks = 0, .window = 0};
    cfg->vlcache = (struct kvcap_vlcache_config){
        .p = 0.01, .budget = 0.4, .min_fraction = 0.01, .recent_fraction = 0.1, .sinks = 0,
        .window = 0};
    cfg->freekv = (struct kvcap_freekv_config){
        .page_size = 32, .budget = 2048, .tau = 0.9, .sink_pages = 1, .window_pages = 2};
    cfg->streaming = (struct kvcap_streaming_config){.sinks = 4, .window = 1024};
    cfg->has_model = 0;
}

void kvcap_runtime_config_free(struct kvcap_runtime_config *cfg)
{
    (void)cfg; /* no heap today; see config.h */
}

/* ---- Parse context and error reporting --------------------------------------------------- */
struct mark_entry {
    char field[FIELD_CAP];
    yaml_mark_t mark;
};

struct ctx {
    const char *label;   /* file name or caller's label, prefixes every message */
    const char *dir;     /* directory of the file (relative artifact paths), NULL for strings */
    size_t dir_len;
    yaml_document_t doc; /* the loaded document */
    int n_marks;
    struct mark_entry marks[MAX_MARKS];
};

static enum kvcap_status fail_at(const struct ctx *c, yaml_mark_t m, const char *fmt, ...)
    KVCAP_PRINTF(3, 4);

static enum kvcap_status fail_at(const struct ctx *c, yaml_mark_t m, const char *fmt, ...)
{
    char msg[MSG_CAP];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvcap_fail(KVCAP_ERR_CONFIG, "%s:%zu:%zu: %s", c->label, m.line + 1, m.column + 1,
                      msg);
}

static void record(struct ctx *c, const char *field, yaml_mark_t m)
{
    if (c->n_marks >= MAX_MARKS)
        return; /* only placement precision is lost: the parent's mark is used */
    snprintf(c->marks[c->n_marks].field, FIELD_CAP, "%s", field);
    c->marks[c->n_marks].mark = m;
    c->n_marks++;
}

/* Re-issues the message a validator (kvcap_geometry_check, kvcap_bucket_check) just
 * set, "field.path: problem", prefixed with the position of that field's node; when the field
 * was not written in the file (a default) its nearest written parent is used. */
static enum kvcap_status relocate(struct ctx *c, yaml_mark_t fallback)
{
    char msg[MSG_CAP], field[FIELD_CAP];
    snprintf(msg, sizeof msg, "%s", kvcap_last_error());
    size_t n = strcspn(msg, ":");
    if (n >= sizeof field)
        n = sizeof field - 1;
    memcpy(field, msg, n);
    field[n] = '\0';
    yaml_mark_t m = fallback;
    while (field[0]) {
        int found = 0;
        for (int i = c->n_marks - 1; i >= 0; i--) {
            if (strcmp(c->marks[i].field, field) == 0) {
                m = c->marks[i].mark;
                found = 1;
                break;
            }
        }
        if (found)
            break;
        char *cut = strrchr(field, field[strlen(field) - 1] == ']' ? '[' : '.');
        if (!cut)
            break;
        *cut = '\0';
    }
    return fail_at(c, m, "%s", msg);
}

static void join(char *out, const char *parent, const char *key)
{
    if (parent && parent[0])
        snprintf(out, FIELD_CAP, "%.90s.%.30s", parent, key);
    else
        snprintf(out, FIELD_CAP, "%.30s", key);
}

static yaml_node_t *node_at(struct ctx *c, int i)
{
    return yaml_document_get_node(&c->doc, i);
}

static const char *scalar(const yaml_node_t *n)
{
    return (const char *)n->data.scalar.value;
}

static int is_plain(const yaml_node_t *n)
{
    return n->type == YAML_SCALAR_NODE && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
}

static int is_null(const yaml_node_t *n)
{
    if (!is_plain(n))
        return 0;
    const char *s = scalar(n);
    return s[0] == '\0' || strcmp(s, "~") == 0 || strcmp(s, "null") == 0 ||
           strcmp(s, "Null") == 0 || strcmp(s, "NULL") == 0;
}

/* "a mapping", "a list", "an empty value", "'12abc'", "the string \"28\"". */
static const char *describe(const yaml_node_t *n, char *buf, size_t cap)
{
    switch (n->type) {
    case YAML_MAPPING_NODE: return "a mapping";
    case YAML_SEQUENCE_NODE: return "a list";
    case YAML_SCALAR_NODE:
        if (is_null(n))
            return "an empty value";
        if (is_plain(n))
            snprintf(buf, cap, "'%.40s%s'", scalar(n), n->data.scalar.length > 40 ? "..." : "");
        else
            snprintf(buf, cap, "the string \"%.40s%s\"", scalar(n),
                     n->data.scalar.length > 40 ? "..." : "");
        return buf;
    case YAML_NO_NODE: break;
    }
    return "nothing";
}

static enum kvcap_status expect(struct ctx *c, const yaml_node_t *n, const char *field,
                                yaml_node_type_t type)
{
    if (n->type == type)
        return KVCAP_OK;
    char buf[80];
    const char *what = type == YAML_MAPPING_NODE    ? "a mapping"
                       : type == YAML_SEQUENCE_NODE ? "a list"
                                                    : "a scalar";
    return fail_at(c, n->start_mark, "%s: expected %s, got %s", field[0] ? field : "top level",
                   what, describe(n, buf, sizeof buf));
}

/* ---- Mappings ---------------------------------------------------------------------------- */
static void list_names(char *buf, size_t cap, const char *const *names)
{
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; names[i] && used < cap; i++) {
        int w = snprintf(buf + used, cap - used, "%s%s", i ? ", " : "", names[i]);
        if (w < 0)
            break;
        used += (size_t)w;
    }
}

/* Checks that `map` is a mapping whose keys are scalars drawn from `allowed` (NULL-terminated;
 * `kind` names the variant for the message when the set depends on one), each present once,
 * and records the positions of the mapping and of its values for relocate(). */
static enum kvcap_status check_mapping(struct ctx *c, yaml_node_t *map, const char *field,
                                       const char *const *allowed, const char *kind)
{
    KVCAP_TRY(expect(c, map, field, YAML_MAPPING_NODE));
    record(c, field, map->start_mark);
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        yaml_node_t *key = node_at(c, p->key);
        if (key->type != YAML_SCALAR_NODE)
            return fail_at(c, key->start_mark, "%s: keys must be scalars, got %s",
                           field[0] ? field : "top level", key->type == YAML_MAPPING_NODE
                                                               ? "a mapping"
                                                               : "a list");
        const char *k = scalar(key);
        char sub[FIELD_CAP];
        if (field[0])
            snprintf(sub, sizeof sub, "%s.%.60s", field, k);
        else
            snprintf(sub, sizeof sub, "%.60s", k);
        int known = 0;
        for (int i = 0; allowed[i]; i++)
            known |= strcmp(allowed[i], k) == 0;
        known &= strlen(k) == key->data.scalar.length; /* "layers\0x" is not "layers" */
        if (!known) {
            char names[256];
            list_names(names, sizeof names, allowed);
            if (!allowed[0])
                return fail_at(c, key->start_mark, "%s: unknown key (%s takes no keys)", sub,
                               field);
            return fail_at(c, key->start_mark, "%s: unknown key%s%s (expected %s)", sub,
                           kind ? " for kind " : "", kind ? kind : "", names);
        }
        /* Earlier keys are all distinct known keys, so this loop is short. */
        for (yaml_node_pair_t *q = map->data.mapping.pairs.start; q < p; q++) {
            yaml_node_t *prev = node_at(c, q->key);
            if (strcmp(scalar(prev), k) == 0)
                return fail_at(c, key->start_mark, "%s: duplicate key (first at %zu:%zu)", sub,
                               prev->start_mark.line + 1, prev->start_mark.column + 1);
        }
        record(c, sub, node_at(c, p->value)->start_mark);
    }
    return KVCAP_OK;
}

/* The value of `key` in a checked mapping, NULL when absent. */
static yaml_node_t *lookup(struct ctx *c, yaml_node_t *map, const char *key)
{
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        yaml_node_t *k = node_at(c, p->key);
        if (k->type == YAML_SCALAR_NODE && strcmp(scalar(k), key) == 0)
            return node_at(c, p->value);
    }
    return NULL;
}

/* Fails on the first key of NULL-terminated `keys` absent from `map`. */
static enum kvcap_status require(struct ctx *c, yaml_node_t *map, const char *field,
                                 const char *const *keys)
{
    for (int i = 0; keys[i]; i++) {
        if (!lookup(c, map, keys[i])) {
            if (field[0])
                return fail_at(c, map->start_mark, "%s: missing required key '%s'", field,
                               keys[i]);
            return fail_at(c, map->start_mark, "missing required key '%s'", keys[i]);
        }
    }
    return KVCAP_OK;
}

/* ---- Scalars ----------------------------------------------------------------------------- */
static enum kvcap_status number_text(struct ctx *c, const yaml_node_t *n, const char *field,
                                     const char *what, const char *allowed_chars)
{
    char buf[80];
    if (n->type != YAML_SCALAR_NODE || !is_plain(n) || is_null(n))
        return fail_at(c, n->start_mark, "%s: expected %s, got %s", field, what,
                       describe(n, buf, sizeof buf));
    const char *s = scalar(n);
    int digits = 0, other = 0;
    for (const char *p = s; *p; p++) {
        if (*p >= '0' && *p <= '9')
            digits = 1;
        else if (!strchr(allowed_chars, *p))
            other = 1;
    }
    if (!digits || other || strlen(s) != n->data.scalar.length)
        return fail_at(c, n->start_mark, "%s: expected %s, got %s", field, what,
                       describe(n, buf, sizeof buf));
    return KVCAP_OK;
}

static enum kvcap_status as_int(struct ctx *c, const yaml_node_t *n, const char *field,
                                long long lo, long long hi, long long *out)
{
    KVCAP_TRY(number_text(c, n, field, "an integer", "+-"));
    const char *s = scalar(n);
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (*end != '\0' || end == s)
        return fail_at(c, n->start_mark, "%s: expected an integer, got '%.40s'", field, s);
    if (errno == ERANGE || v < lo || v > hi) {
        if (lo == INT_MIN && hi == INT_MAX)
            return fail_at(c, n->start_mark, "%s: %.40s is out of range", field, s);
        return fail_at(c, n->start_mark, "%s: %.40s is outside %lld..%lld", field, s, lo, hi);
    }
    *out = v;
    return KVCAP_OK;
}

static enum kvcap_status as_u64(struct ctx *c, const yaml_node_t *n, const char *field,
                                uint64_t *out)
{
    KVCAP_TRY(number_text(c, n, field, "an integer", "+-"));
    const char *s = scalar(n);
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end != '\0' || end == s)
        return fail_at(c, n->start_mark, "%s: expected an integer, got '%.40s'", field, s);
    if (s[0] == '-' || errno == ERANGE)
        return fail_at(c, n->start_mark, "%s: %.40s is outside 0..%llu", field, s,
                       (unsigned long long)UINT64_MAX);
    *out = (uint64_t)v;
    return KVCAP_OK;
}

/* An interval for a double: [lo, hi] with either end open; hi = HUGE_VAL for "no upper". */
struct drange {
    double lo, hi;
    int lo_open, hi_open;
};
static const struct drange RATIO = {0.0, 1.0, 1, 0};         /* (0, 1] */
static const struct drange POSITIVE = {0.0, HUGE_VAL, 1, 0}; /* > 0 */
static const struct drange NONNEG = {0.0, HUGE_VAL, 0, 0};   /* >= 0 */
static const struct drange ANY = {-HUGE_VAL, HUGE_VAL, 0, 0};

static enum kvcap_status as_double(struct ctx *c, const yaml_node_t *n, const char *field,
                                   struct drange r, double *out)
{
    /* Only decimal notation: this excludes inf, nan, .inf, hex floats and "1_000". */
    KVCAP_TRY(number_text(c, n, field, "a number", "+-.eE"));
    const char *s = scalar(n);
    char *end;
    errno = 0;
    double v = strtod(s, &end); /* the "C" locale is in effect (see load()) */
    if (*end != '\0' || end == s)
        return fail_at(c, n->start_mark, "%s: expected a number, got '%.40s'", field, s);
    if (errno == ERANGE || !isfinite(v))
        return fail_at(c, n->start_mark, "%s: %.40s is out of range for a double", field, s);
    int below = r.lo_open ? !(v > r.lo) : !(v >= r.lo);
    int above = r.hi_open ? !(v < r.hi) : !(v <= r.hi);
    if (below || above) {
        if (r.hi == HUGE_VAL)
            return fail_at(c, n->start_mark, "%s: %.40s must be %s %g", field, s,
                           r.lo_open ? ">" : ">=", r.lo);
        return fail_at(c, n->start_mark, "%s: %.40s is outside %c%g, %g%c", field, s,
                       r.lo_open ? '(' : '[', r.lo, r.hi, r.hi_open ? ')' : ']');
    }
    *out = v;
    return KVCAP_OK;
}

static enum kvcap_status as_named(struct ctx *c, const yaml_node_t *n, const char *field,
                                  const struct name_set *set, int *out)
{
    char buf[80];
    if (n->type != YAML_SCALAR_NODE || is_null(n))
        return fail_at(c, n->start_mark, "%s: expected a name, got %s", field,
                       describe(n, buf, sizeof buf));
    if (strlen(scalar(n)) == n->data.scalar.length && set->parse(scalar(n), out))
        return KVCAP_OK;
    char names[256];
    size_t used = 0;
    names[0] = '\0';
    for (int v = 0; used < sizeof names; v++) {
        const char *name = set->name(v);
        if ((set->count > 0 && v >= set->count) || strcmp(name, "?") == 0)
            break;
        int w = snprintf(names + used, sizeof names - used, "%s%s", v ? ", " : "", name);
        if (w < 0)
            break;
        used += (size_t)w;
    }
    return fail_at(c, n->start_mark, "%s: '%.40s' is not one of %s", field, scalar(n), names);
}

static enum kvcap_status as_string(struct ctx *c, const yaml_node_t *n, const char *field,
                                   char *out, size_t cap)
{
    char buf[80];
    if (n->type != YAML_SCALAR_NODE || is_null(n))
        return fail_at(c, n->start_mark, "%s: expected a string, got %s", field,
                       describe(n, buf, sizeof buf));
    if (strlen(scalar(n)) != n->data.scalar.length)
        return fail_at(c, n->start_mark, "%s: contains a NUL character", field);
    if (n->data.scalar.length >= cap)
        return fail_at(c, n->start_mark, "%s: longer than %zu bytes", field, cap - 1);
    memcpy(out, scalar(n), n->data.scalar.length + 1);
    return KVCAP_OK;
}

/* Optional fields of a checked mapping: absent keys leave *out (the default) untouched. */
static enum kvcap_status get_int(struct ctx *c, yaml_node_t *map, const char *parent,
                                 const char *key, long long lo, long long hi, int *out)
{
    yaml_node_t *n = lookup(c, map, key);
    if (!n)
        return KVCAP_OK;
    char field[FIELD_CAP];
    join(field, parent, key);
    long long v;
    KVCAP_TRY(as_int(c, n, field, lo, hi, &v));
    *out = (int)v;
    return KVCAP_OK;
}

static enum kvcap_status get_u64(struct ctx *c, yaml_node_t *map, const char *parent,
                                 const char *key, uint64_t *out)
{
    yaml_node_t *n = lookup(c, map, key);
    if (!n)
        return KVCAP_OK;
    char field[FIELD_CAP];
    join(field, parent, key);
    return as_u64(c, n, field, out);
}

static enum kvcap_status get_double(struct ctx *c, yaml_node_t *map, const char *parent,
                                    const char *key, struct drange r, double *out)
{
    yaml_node_t *n = lookup(c, map, key);
    if (!n)
        return KVCAP_OK;
    char field[FIELD_CAP];
    join(field, parent, key);
    return as_double(c, n, field, r, out);
}

/* Reads an enum field into *out of any enum type (the value is stored through an int). */
#define GET_NAMED(c, map, parent, key, set, out)                        \
    do {                                                                \
        yaml_node_t *gn_node = lookup((c), (map), (key));               \
        if (gn_node) {                                                  \
            char gn_field[FIELD_CAP];                                   \
            int gn_v = 0;                                               \
            join(gn_field, (parent), (key));                            \
            KVCAP_TRY(as_named((c), gn_node, gn_field, (set), &gn_v));  \
            *(out) = gn_v;                                              \
        }                                                               \
    } while (0)

/* A list of `want_min..want_max` integers into out[]; records each element's position. */
static enum kvcap_status get_int_list(struct ctx *c, yaml_node_t *n, const char *field,
                                      int want_min, int want_max, int *out, int *count)
{
    KVCAP_TRY(expect(c, n, field, YAML_SEQUENCE_NODE));
    ptrdiff_t len = n->data.sequence.items.top - n->data.sequence.items.start;
    if (len < want_min || len > want_max) {
        if (want_min == want_max)
            return fail_at(c, n->start_mark, "%s: %td entries, expected %d", field, len,
                           want_min);
        return fail_at(c, n->start_mark, "%s: %td entries, expected %d..%d", field, len,
                       want_min, want_max);
    }
    for (ptrdiff_t i = 0; i < len; i++) {
        yaml_node_t *item = node_at(c, n->data.sequence.items.start[i]);
        char sub[FIELD_CAP];
        snprintf(sub, sizeof sub, "%.100s[%td]", field, i);
        record(c, sub, item->start_mark);
        long long v;
        KVCAP_TRY(as_int(c, item, sub, INT_MIN, INT_MAX, &v));
        out[i] = (int)v;
    }
    *count = (int)len;
    return KVCAP_OK;
}

/* ---- Model geometry (shared by both kinds) ------------------------------------------------ */
static enum kvcap_status parse_model(struct ctx *c, yaml_node_t *n,
                                     struct kvcap_model_geometry *g)
{
    static const char *const keys[] = {"name",     "layers",   "q_heads", "kv_heads",
                                       "head_dim", "rope",     NULL};
    static const char *const required[] = {"layers", "q_heads", "kv_heads", "head_dim", "rope",
                                           NULL};
    static const char *const rope_keys[] = {"type", "pairing", "theta", "dim", "sections", NULL};
    const char *f = "model";
    memset(g, 0, sizeof *g);
    KVCAP_TRY(check_mapping(c, n, f, keys, NULL));
    KVCAP_TRY(require(c, n, f, required));
    yaml_node_t *name = lookup(c, n, "name");
    if (name)
        KVCAP_TRY(as_string(c, name, "model.name", g->name, sizeof g->name));
    KVCAP_TRY(get_int(c, n, f, "layers", INT_MIN, INT_MAX, &g->n_layers));
    KVCAP_TRY(get_int(c, n, f, "q_heads", INT_MIN, INT_MAX, &g->n_q_heads));
    KVCAP_TRY(get_int(c, n, f, "kv_heads", INT_MIN, INT_MAX, &g->n_kv_heads));
    KVCAP_TRY(get_int(c, n, f, "head_dim", INT_MIN, INT_MAX, &g->head_dim));

    yaml_node_t *rope = lookup(c, n, "rope");
    const char *rf = "model.rope";
    KVCAP_TRY(check_mapping(c, rope, rf, rope_keys, NULL));
    KVCAP_TRY(require(c, rope, rf, (const char *const[]){"type", NULL}));
    GET_NAMED(c, rope, rf, "type", &rope_type_set, &g->rope_type);
    if (g->rope_type == KVCAP_ROPE_NONE) {
        for (int i = 1; rope_keys[i]; i++) {
            yaml_node_t *extra = lookup(c, rope, rope_keys[i]);
            if (extra)
                return fail_at(c, extra->start_mark,
                               "model.rope.%s: only valid with type rope or mrope",
                               rope_keys[i]);
        }
    } else {
        KVCAP_TRY(require(c, rope, rf, (const char *const[]){"pairing", "theta", NULL}));
        if (g->rope_type == KVCAP_ROPE_MROPE)
            KVCAP_TRY(require(c, rope, rf, (const char *const[]){"sections", NULL}));
        GET_NAMED(c, rope, rf, "pairing", &pairing_set, &g->rope_pairing);
        KVCAP_TRY(get_double(c, rope, rf, "theta", ANY, &g->rope_theta));
        KVCAP_TRY(get_int(c, rope, rf, "dim", INT_MIN, INT_MAX, &g->rope_dim));
        yaml_node_t *sections = lookup(c, rope, "sections");
        if (sections)
            KVCAP_TRY(get_int_list(c, sections, "model.rope.sections", 0,
                                   KVCAP_MAX_ROPE_SECTIONS, g->rope_sections,
                                   &g->n_rope_sections));
    }
    /* One validator for configs, file headers and caches; its message names the field and
     * relocate() puts that field's line:col in front. */
    if (kvcap_geometry_check(g) != KVCAP_OK)
        return relocate(c, n->start_mark);
    return KVCAP_OK;
}

/* ---- Calibration config ------------------------------------------------------------------ */
static enum kvcap_status parse_buckets(struct ctx *c, yaml_node_t *n,
                                       struct kvcap_calib_config *cfg)
{
    static const char *const keys[] = {"rows", "cols", "structure", "tile", NULL};
    static const char *const required[] = {"rows", "cols", NULL};
    KVCAP_TRY(expect(c, n, "buckets", YAML_SEQUENCE_NODE));
    ptrdiff_t len = n->data.sequence.items.top - n->data.sequence.items.start;
    if (len < 1 || len > KVCAP_CONFIG_MAX_BUCKETS)
        return fail_at(c, n->start_mark, "buckets: %td buckets, expected 1..%d", len,
                       KVCAP_CONFIG_MAX_BUCKETS);
    for (int i = 0; i < (int)len; i++) {
        yaml_node_t *m = node_at(c, n->data.sequence.items.start[i]);
        char f[FIELD_CAP];
        snprintf(f, sizeof f, "buckets[%d]", i);
        KVCAP_TRY(check_mapping(c, m, f, keys, NULL));
        KVCAP_TRY(require(c, m, f, required));
        struct kvcap_bucket b = {0};
        KVCAP_TRY(get_int(c, m, f, "rows", INT_MIN, INT_MAX, &b.rows));
        KVCAP_TRY(get_int(c, m, f, "cols", INT_MIN, INT_MAX, &b.cols));
        b.structure = KVCAP_STRUCTURE_DENSE;
        GET_NAMED(c, m, f, "structure", &structure_set, &b.structure);
        yaml_node_t *tile = lookup(c, m, "tile");
        char tf[FIELD_CAP];
        join(tf, f, "tile");
        if (b.structure == KVCAP_STRUCTURE_TILED) {
            KVCAP_TRY(require(c, m, f, (const char *const[]){"tile", NULL}));
            int t[2], nt;
            KVCAP_TRY(get_int_list(c, tile, tf, 2, 2, t, &nt));
            b.tile_rows = t[0];
            b.tile_cols = t[1];
        } else if (tile) {
            return fail_at(c, tile->start_mark, "%s: only valid with structure tiled", tf);
        }
        if (kvcap_bucket_check(&b, f) != KVCAP_OK)
            return relocate(c, m->start_mark);
        for (int j = 0; j < i; j++) {
            const struct kvcap_bucket *o = &cfg->buckets[j];
            if (o->rows == b.rows && o->cols == b.cols && o->structure == b.structure &&
                o->tile_rows == b.tile_rows && o->tile_cols == b.tile_cols)
                return fail_at(c, m->start_mark, "%s: same grid, structure and tile as buckets[%d]",
                               f, j);
        }
        cfg->buckets[i] = b;
        cfg->n_buckets = i + 1;
    }
    return KVCAP_OK;
}

/* One schedule mapping {kind: ..., ...} at `f`; a list must have `n_layers` ratios. */
static enum kvcap_status parse_schedule_one(struct ctx *c, yaml_node_t *n, const char *f,
                                            int n_layers, struct kvcap_schedule *s)
{
    static const char *const pyramid[] = {"kind", "first", "last", NULL};
    static const char *const uniform[] = {"kind", "ratio", NULL};
    static const char *const list[] = {"kind", "ratios", NULL};
    static const char *const *const keys_of[] = {pyramid, uniform, list};
    KVCAP_TRY(expect(c, n, f, YAML_MAPPING_NODE));
    KVCAP_TRY(require(c, n, f, (const char *const[]){"kind", NULL}));
    int kind = 0;
    GET_NAMED(c, n, f, "kind", &schedule_kind_set, &kind);
    const char *const *keys = keys_of[kind];
    KVCAP_TRY(check_mapping(c, n, f, keys, schedule_kind_names[kind]));
    KVCAP_TRY(require(c, n, f, keys + 1));
    memset(s, 0, sizeof *s);
    s->kind = (enum kvcap_schedule_kind)kind;
    if (kind == KVCAP_SCHEDULE_PYRAMID) {
        KVCAP_TRY(get_double(c, n, f, "first", RATIO, &s->first));
        return get_double(c, n, f, "last", RATIO, &s->last);
    }
    if (kind == KVCAP_SCHEDULE_UNIFORM)
        return get_double(c, n, f, "ratio", RATIO, &s->ratio);

    char lf[FIELD_CAP];
    join(lf, f, "ratios");
    yaml_node_t *l = lookup(c, n, "ratios");
    KVCAP_TRY(expect(c, l, lf, YAML_SEQUENCE_NODE));
    ptrdiff_t len = l->data.sequence.items.top - l->data.sequence.items.start;
    if (len != n_layers)
        return fail_at(c, l->start_mark,
                       "%s: %td ratios, expected one per layer (model.layers = %d)", lf, len,
                       n_layers);
    double *r = malloc((size_t)len * sizeof *r);
    if (!r)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory for %td ratios", c->label,
                          len);
    for (ptrdiff_t i = 0; i < len; i++) {
        char sub[FIELD_CAP];
        snprintf(sub, sizeof sub, "%.100s[%td]", lf, i);
        enum kvcap_status st =
            as_double(c, node_at(c, l->data.sequence.items.start[i]), sub, RATIO, &r[i]);
        if (st != KVCAP_OK) {
            free(r);
            return st;
        }
    }
    s->ratios = r;
    s->n_ratios = (int)len;
    return KVCAP_OK;
}

static enum kvcap_status copy_schedule(struct kvcap_schedule *dst, const struct kvcap_schedule *src,
                                       const char *label)
{
    *dst = *src;
    if (src->kind != KVCAP_SCHEDULE_LIST)
        return KVCAP_OK;
    dst->ratios = malloc((size_t)src->n_ratios * sizeof *dst->ratios);
    if (!dst->ratios) {
        dst->n_ratios = 0;
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory for schedule", label);
    }
    memcpy(dst->ratios, src->ratios, (size_t)src->n_ratios * sizeof *dst->ratios);
    return KVCAP_OK;
}

/* `schedule: {keys: S, values: S}` or a bare `schedule: S` for both. */
static enum kvcap_status parse_schedule(struct ctx *c, yaml_node_t *n,
                                        struct kvcap_calib_config *cfg)
{
    static const char *const keys[] = {"keys", "values", NULL};
    const char *f = "schedule";
    int n_layers = cfg->model.n_layers;
    schedule_free(&cfg->schedule_keys);
    schedule_free(&cfg->schedule_values);
    KVCAP_TRY(expect(c, n, f, YAML_MAPPING_NODE));
    if (lookup(c, n, "kind")) {
        KVCAP_TRY(parse_schedule_one(c, n, f, n_layers, &cfg->schedule_keys));
        return copy_schedule(&cfg->schedule_values, &cfg->schedule_keys, c->label);
    }
    KVCAP_TRY(check_mapping(c, n, f, keys, NULL));
    if (!lookup(c, n, "keys") && !lookup(c, n, "values"))
        return fail_at(c, n->start_mark,
                       "schedule: give 'kind' (one schedule for keys and values) or 'keys' "
                       "and 'values'");
    KVCAP_TRY(require(c, n, f, keys));
    KVCAP_TRY(parse_schedule_one(c, lookup(c, n, "keys"), "schedule.keys", n_layers,
                                 &cfg->schedule_keys));
    return parse_schedule_one(c, lookup(c, n, "values"), "schedule.values", n_layers,
                              &cfg->schedule_values);
}

static enum kvcap_status parse_keys(struct ctx *c, yaml_node_t *n, struct kvcap_keys_config *k)
{
    static const char *const keys[] = {"method", "activation", "hidden", "ridge", "train", NULL};
    static const char *const train_keys[] = {"steps",      "lr",       "tau_start",
                                             "tau_end",    "lambda_bce", "lambda_r",
                                             "finetune_steps", "seed", NULL};
    const char *f = "keys";
    KVCAP_TRY(check_mapping(c, n, f, keys, NULL));
    GET_NAMED(c, n, f, "method", &key_method_set, &k->method);
    GET_NAMED(c, n, f, "activation", &activation_set, &k->activation);
    KVCAP_TRY(get_int(c, n, f, "hidden", 0, 65536, &k->hidden));
    KVCAP_TRY(get_double(c, n, f, "ridge", NONNEG, &k->ridge));
    yaml_node_t *t = lookup(c, n, "train");
    if (!t)
        return KVCAP_OK;
    const char *tf = "keys.train";
    struct kvcap_train_config *tr = &k->train;
    KVCAP_TRY(check_mapping(c, t, tf, train_keys, NULL));
    KVCAP_TRY(get_int(c, t, tf, "steps", 0, 100000000, &tr->steps));
    KVCAP_TRY(get_double(c, t, tf, "lr", POSITIVE, &tr->lr));
    KVCAP_TRY(get_double(c, t, tf, "tau_start", POSITIVE, &tr->tau_start));
    KVCAP_TRY(get_double(c, t, tf, "tau_end", POSITIVE, &tr->tau_end));
    KVCAP_TRY(get_double(c, t, tf, "lambda_bce", NONNEG, &tr->lambda_bce));
    KVCAP_TRY(get_double(c, t, tf, "lambda_r", NONNEG, &tr->lambda_r));
    KVCAP_TRY(get_int(c, t, tf, "finetune_steps", 0, 100000000, &tr->finetune_steps));
    KVCAP_TRY(get_u64(c, t, tf, "seed", &tr->seed));
    if (tr->tau_end > tr->tau_start) {
        yaml_node_t *at = lookup(c, t, "tau_end");
        return fail_at(c, at ? at->start_mark : t->start_mark,
                       "keys.train.tau_end: %g exceeds tau_start %g (the temperature anneals "
                       "downwards)",
                       tr->tau_end, tr->tau_start);
    }
    return KVCAP_OK;
}

static enum kvcap_status parse_calib(struct ctx *c, yaml_node_t *root, void *out)
{
    static const char *const keys[] = {"model", "buckets", "schedule", "keys",
                                       "validation", "storage", NULL};
    static const char *const required[] = {"model", "buckets", "schedule", NULL};
    static const char *const validation_keys[] = {"fraction", "seed", NULL};
    struct kvcap_calib_config *cfg = out;
    KVCAP_TRY(check_mapping(c, root, "", keys, NULL));
    KVCAP_TRY(require(c, root, "", required));
    KVCAP_TRY(parse_model(c, lookup(c, root, "model"), &cfg->model));
    KVCAP_TRY(parse_buckets(c, lookup(c, root, "buckets"), cfg));
    KVCAP_TRY(parse_schedule(c, lookup(c, root, "schedule"), cfg));
    yaml_node_t *k = lookup(c, root, "keys");
    if (k)
        KVCAP_TRY(parse_keys(c, k, &cfg->keys));
    yaml_node_t *v = lookup(c, root, "validation");
    if (v) {
        KVCAP_TRY(check_mapping(c, v, "validation", validation_keys, NULL));
        KVCAP_TRY(get_double(c, v, "validation", "fraction", (struct drange){0.0, 1.0, 0, 1},
                             &cfg->validation_fraction));
        KVCAP_TRY(get_u64(c, v, "validation", "seed", &cfg->validation_seed));
    }
    GET_NAMED(c, root, "", "storage", &storage_set, &cfg->storage);
    return KVCAP_OK;
}

/* ---- Runtime config ---------------------------------------------------------------------- */
static enum kvcap_status parse_artifact(struct ctx *c, yaml_node_t *n, char *out)
{
    if (is_null(n)) {
        out[0] = '\0'; /* `artifact: null` says "none" explicitly */
        return KVCAP_OK;
    }
    char path[KVCAP_CONFIG_MAX_PATH];
    KVCAP_TRY(as_string(c, n, "artifact", path, sizeof path));
    if (path[0] == '/' || !c->dir || c->dir_len == 0) {
        memcpy(out, path, strlen(path) + 1);
        return KVCAP_OK;
    }
    const char *sep = c->dir[c->dir_len - 1] == '/' ? "" : "/";
    int w = snprintf(out, KVCAP_CONFIG_MAX_PATH, "%.*s%s%s", (int)c->dir_len, c->dir, sep, path);
    if (w < 0 || w >= KVCAP_CONFIG_MAX_PATH) {
        out[0] = '\0';
        return fail_at(c, n->start_mark, "artifact: path relative to %.*s is longer than %d bytes",
                       (int)c->dir_len, c->dir, KVCAP_CONFIG_MAX_PATH - 1);
    }
    return KVCAP_OK;
}

static enum kvcap_status parse_runtime(struct ctx *c, yaml_node_t *root, void *out)
{
    static const char *const keys[] = {"artifact", "policies", "fallback",  "flashcache",
                                       "vlcache",  "freekv",   "streaming", "kvcapsule",
                                       "model",    NULL};
    static const char *const kinds[] = {"vision", "text", "generated", NULL};
    static const char *const flash_keys[] = {"gamma", "retention", "min_tokens", "sinks",
                                             "window", NULL};
    static const char *const vl_keys[] = {"p",     "budget", "min_fraction", "recent_fraction",
                                          "sinks", "window", NULL};
    static const char *const freekv_keys[] = {"page_size", "budget", "tau", "sink_pages",
                                              "window_pages", NULL};
    static const char *const streaming_keys[] = {"sinks", "window", NULL};
    static const char *const none[] = {NULL};
    struct kvcap_runtime_config *cfg = out;
    KVCAP_TRY(check_mapping(c, root, "", keys, NULL));

    yaml_node_t *n = lookup(c, root, "artifact");
    if (n)
        KVCAP_TRY(parse_artifact(c, n, cfg->artifact));
    if (cfg->artifact[0])
        cfg->policy[KVCAP_SPAN_VISION] = KVCAP_POLICY_KVCAPSULE;

    yaml_node_t *pol = lookup(c, root, "policies");
    if (pol) {
        KVCAP_TRY(check_mapping(c, pol, "policies", kinds, NULL));
        for (int k = 0; kinds[k]; k++) {
            GET_NAMED(c, pol, "policies", kinds[k], &policy_set, &cfg->policy[k]);
            yaml_node_t *v = lookup(c, pol, kinds[k]);
            if (!v || cfg->policy[k] != KVCAP_POLICY_KVCAPSULE)
                continue;
            /* kvcapsule's artifact may also come from the engine (kvcap_cache_params), so its
             * presence is checked where the cache is created, not here. */
            if (k != KVCAP_SPAN_VISION)
                return fail_at(c, v->start_mark,
                               "policies.%s: kvcapsule applies to vision spans only", kinds[k]);
        }
    }
    n = lookup(c, root, "fallback");
    if (n && n->type == YAML_SCALAR_NODE && strcmp(scalar(n), "none") == 0)
        cfg->fallback = KVCAP_FALLBACK_NONE;
    else if (n) {
        GET_NAMED(c, root, "", "fallback", &policy_set, &cfg->fallback);
        if (cfg->fallback == KVCAP_POLICY_KVCAPSULE)
            return fail_at(c, n->start_mark,
                           "fallback: cannot be kvcapsule (it serves the spans kvcapsule has "
                           "no bucket for)");
    }

    if ((n = lookup(c, root, "flashcache"))) {
        struct kvcap_flashcache_config *p = &cfg->flashcache;
        const char *f = "flashcache";
        KVCAP_TRY(check_mapping(c, n, f, flash_keys, NULL));
        KVCAP_TRY(get_double(c, n, f, "gamma", RATIO, &p->gamma));
        KVCAP_TRY(get_double(c, n, f, "retention", RATIO, &p->retention));
        KVCAP_TRY(get_int(c, n, f, "min_tokens", 0, 1 << 30, &p->min_tokens));
        KVCAP_TRY(get_int(c, n, f, "sinks", 0, 1 << 30, &p->sinks));
        KVCAP_TRY(get_int(c, n, f, "window", 0, 1 << 30, &p->window));
    }
    if ((n = lookup(c, root, "vlcache"))) {
        struct kvcap_vlcache_config *p = &cfg->vlcache;
        const char *f = "vlcache";
        KVCAP_TRY(check_mapping(c, n, f, vl_keys, NULL));
        KVCAP_TRY(get_double(c, n, f, "p", (struct drange){0.0, 1.0, 1, 1}, &p->p));
        KVCAP_TRY(get_double(c, n, f, "budget", RATIO, &p->budget));
        KVCAP_TRY(get_double(c, n, f, "min_fraction", RATIO, &p->min_fraction));
        KVCAP_TRY(get_double(c, n, f, "recent_fraction", (struct drange){0.0, 1.0, 0, 0},
                             &p->recent_fraction));
        KVCAP_TRY(get_int(c, n, f, "sinks", 0, 1 << 30, &p->sinks));
        KVCAP_TRY(get_int(c, n, f, "window", 0, 1 << 30, &p->window));
    }
    if ((n = lookup(c, root, "freekv"))) {
        struct kvcap_freekv_config *p = &cfg->freekv;
        const char *f = "freekv";
        KVCAP_TRY(check_mapping(c, n, f, freekv_keys, NULL));
        KVCAP_TRY(get_int(c, n, f, "page_size", 1, 65536, &p->page_size));
        KVCAP_TRY(get_int(c, n, f, "budget", 1, 1 << 30, &p->budget));
        KVCAP_TRY(get_double(c, n, f, "tau", (struct drange){-1.0, 1.0, 0, 0}, &p->tau));
        KVCAP_TRY(get_int(c, n, f, "sink_pages", 0, 1 << 20, &p->sink_pages));
        KVCAP_TRY(get_int(c, n, f, "window_pages", 1, 1 << 20, &p->window_pages));
        /* At least one page beyond sinks and window must be selectable, or FreeKV is
         * StreamingLLM. Products fit in 64 bits: pages < 2^21, page_size <= 2^16. */
        long long need = ((long long)p->sink_pages + p->window_pages + 1) * p->page_size;
        if (p->budget < need) {
            yaml_node_t *b = lookup(c, n, "budget");
            return fail_at(c, b ? b->start_mark : n->start_mark,
                           "freekv.budget: %d tokens leave no page to retrieve: need >= %lld "
                           "((sink_pages %d + window_pages %d + 1) x page_size %d)",
                           p->budget, need, p->sink_pages, p->window_pages, p->page_size);
        }
    }
    if ((n = lookup(c, root, "streaming"))) {
        const char *f = "streaming";
        KVCAP_TRY(check_mapping(c, n, f, streaming_keys, NULL));
        KVCAP_TRY(get_int(c, n, f, "sinks", 0, 1 << 30, &cfg->streaming.sinks));
        KVCAP_TRY(get_int(c, n, f, "window", 1, 1 << 30, &cfg->streaming.window));
    }
    if ((n = lookup(c, root, "kvcapsule")))
        KVCAP_TRY(check_mapping(c, n, "kvcapsule", none, NULL)); /* reserved */
    if ((n = lookup(c, root, "model"))) {
        KVCAP_TRY(parse_model(c, n, &cfg->model));
        cfg->has_model = 1;
    }
    return KVCAP_OK;
}

/* ---- Loading ----------------------------------------------------------------------------- */
static enum kvcap_status syntax_error(const struct ctx *c, const yaml_parser_t *p,
                                      const char *text, size_t len)
{
    if (p->error == YAML_MEMORY_ERROR)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory while parsing YAML",
                          c->label);
    const char *problem = p->problem ? p->problem : "invalid YAML";
    if (p->error == YAML_READER_ERROR) {
        /* The reader reports a byte offset only: count lines up to it. */
        yaml_mark_t m = {0, 0, 0};
        for (size_t i = 0; i < p->problem_offset && i < len; i++) {
            if (text[i] == '\n') {
                m.line++;
                m.column = 0;
            } else {
                m.column++;
            }
        }
        if (p->problem_value >= 0)
            return fail_at(c, m, "%s (byte 0x%02X)", problem, (unsigned)p->problem_value);
        return fail_at(c, m, "%s", problem);
    }
    if (p->context)
        return fail_at(c, p->problem_mark, "%s (%s at %zu:%zu)", problem, p->context,
                       p->context_mark.line + 1, p->context_mark.column + 1);
    return fail_at(c, p->problem_mark, "%s", problem);
}

/* libyaml's scanner revisits every open flow level for each token, so time grows with the
 * square of the nesting depth: a hostile 1 MiB "[[[[..." would take many minutes. A first pass
 * over the events refuses nesting deeper than any config needs (it stops as soon as it sees
 * it) before the loader builds a tree; it also reports syntax errors. */
static enum kvcap_status check_depth(const struct ctx *c, const char *text, size_t len)
{
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p))
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", c->label);
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    enum kvcap_status st = KVCAP_OK;
    for (int depth = 0;;) {
        yaml_event_t e;
        if (!yaml_parser_parse(&p, &e)) {
            st = syntax_error(c, &p, text, len);
            break;
        }
        yaml_event_type_t type = e.type;
        yaml_mark_t mark = e.start_mark;
        yaml_event_delete(&e);
        if (type == YAML_SEQUENCE_START_EVENT || type == YAML_MAPPING_START_EVENT) {
            if (++depth > MAX_DEPTH) {
                st = fail_at(c, mark, "nesting deeper than %d levels", MAX_DEPTH);
                break;
            }
        } else if (type == YAML_SEQUENCE_END_EVENT || type == YAML_MAPPING_END_EVENT) {
            depth--;
        } else if (type == YAML_STREAM_END_EVENT) {
            break;
        }
    }
    yaml_parser_delete(&p);
    return st;
}

typedef enum kvcap_status (*parse_fn)(struct ctx *c, yaml_node_t *root, void *out);

static enum kvcap_status load(const char *text, size_t len, const char *label, const char *dir,
                              size_t dir_len, parse_fn parse, void *out)
{
    struct ctx *c = calloc(1, sizeof *c);
    if (!c)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", label);
    c->label = label;
    c->dir = dir;
    c->dir_len = dir_len;

    /* strtod and %g follow LC_NUMERIC; the host may have set a locale with a decimal comma. */
    locale_t c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0);
    if (c_locale == (locale_t)0) {
        free(c);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: cannot create the C locale", label);
    }
    locale_t previous = uselocale(c_locale);

    enum kvcap_status st = check_depth(c, text, len);
    int have_doc = 0;
    yaml_parser_t parser;
    if (st != KVCAP_OK)
        goto done_locale;
    if (!yaml_parser_initialize(&parser)) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", label);
        goto done_locale;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, &c->doc)) {
        st = syntax_error(c, &parser, text, len);
        goto done;
    }
    have_doc = 1;
    yaml_node_t *root = yaml_document_get_root_node(&c->doc);
    if (!root) {
        st = fail_at(c, c->doc.start_mark, "empty document, expected a mapping");
        goto done;
    }
    /* The whole stream is parsed before it is interpreted: a second document is a mistake
     * (a stray `---`), and a syntax error after the first should not go unnoticed. */
    yaml_document_t extra;
    if (!yaml_parser_load(&parser, &extra)) {
        st = syntax_error(c, &parser, text, len);
        goto done;
    }
    yaml_node_t *extra_root = yaml_document_get_root_node(&extra);
    yaml_mark_t extra_mark = extra.start_mark;
    yaml_document_delete(&extra);
    if (extra_root) {
        st = fail_at(c, extra_mark, "a second YAML document; a config is one document");
        goto done;
    }
    st = parse(c, root, out);

done:
    if (have_doc)
        yaml_document_delete(&c->doc);
    yaml_parser_delete(&parser);
done_locale:
    uselocale(previous);
    freelocale(c_locale);
    free(c);
    return st;
}

static enum kvcap_status load_file(const char *path, parse_fn parse, void *out)
{
    char *text = NULL;
    size_t len = 0;
    KVCAP_TRY(kvcap_read_file(path, KVCAP_CONFIG_MAX_BYTES, KVCAP_ERR_CONFIG, ", not a config",
                              &text, &len));
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path) : 0;
    if (slash && dir_len == 0)
        dir_len = 1; /* a file in "/": keep the root */
    enum kvcap_status st = load(text, len, path, slash ? path : NULL, dir_len, parse, out);
    free(text);
    return st;
}

enum kvcap_status kvcap_calib_config_load_file(const char *path, struct kvcap_calib_config *cfg)
{
    KVCAP_RETURN_IF(!path || !cfg, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_calib_config_load_file: NULL argument");
    kvcap_calib_config_default(cfg);
    enum kvcap_status st = load_file(path, parse_calib, cfg);
    if (st != KVCAP_OK) {
        kvcap_calib_config_free(cfg);
        kvcap_calib_config_default(cfg);
    }
    return st;
}

enum kvcap_status kvcap_calib_config_load_string(const char *text, const char *label,
                                                 struct kvcap_calib_config *cfg)
{
    KVCAP_RETURN_IF(!text || !cfg, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_calib_config_load_string: NULL argument");
    kvcap_calib_config_default(cfg);
    enum kvcap_status st =
        load(text, strlen(text), label ? label : "<string>", NULL, 0, parse_calib, cfg);
    if (st != KVCAP_OK) {
        kvcap_calib_config_free(cfg);
        kvcap_calib_config_default(cfg);
    }
    return st;
}

enum kvcap_status kvcap_runtime_config_load_file(const char *path,
                                                 struct kvcap_runtime_config *cfg)
{
    KVCAP_RETURN_IF(!path || !cfg, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_runtime_config_load_file: NULL argument");
    kvcap_runtime_config_default(cfg);
    enum kvcap_status st = load_file(path, parse_runtime, cfg);
    if (st != KVCAP_OK)
        kvcap_runtime_config_default(cfg);
    return st;
}

enum kvcap_status kvcap_runtime_config_load_string(const char *text, const char *label,
                                                   struct kvcap_runtime_config *cfg)
{
    KVCAP_RETURN_IF(!text || !cfg, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_runtime_config_load_string: NULL argument");
    kvcap_runtime_config_default(cfg);
    enum kvcap_status st =
        load(text, strlen(text), label ? label : "<string>", NULL, 0, parse_runtime, cfg);
    if (st != KVCAP_OK)
        kvcap_runtime_config_default(cfg);
    return st;
}
