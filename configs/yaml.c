/* yaml.c — the strict YAML node reader under both configs (yaml.h), the names of the
 * config-only enums, the model geometry both configs share, and the loader. */
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

#include "configs/yaml.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))
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

KVCAP_YAML_NAME_SET(rope_type, enum kvcap_rope_type, kvcap_rope_type, 0)
KVCAP_YAML_NAME_SET(pairing, enum kvcap_rope_pairing, kvcap_rope_pairing, 0)

/* ---- Parse context and error reporting --------------------------------------------------- */
enum kvcap_status kvcap_yaml_fail_at(const struct kvcap_yaml *c, yaml_mark_t m, const char *fmt,
                                     ...)
{
    char msg[MSG_CAP];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvcap_fail(KVCAP_ERR_CONFIG, "%s:%zu:%zu: %s", c->label, m.line + 1, m.column + 1,
                      msg);
}

static void kvcap_yaml_record(struct kvcap_yaml *c, const char *field, yaml_mark_t m)
{
    if (c->n_marks >= KVCAP_YAML_MAX_MARKS)
        return; /* only placement precision is lost: the parent's mark is used */
    snprintf(c->marks[c->n_marks].field, KVCAP_YAML_FIELD_CAP, "%s", field);
    c->marks[c->n_marks].mark = m;
    c->n_marks++;
}

/* Re-issues the message a validator (kvcap_geometry_check, kvcap_bucket_check) just
 * set, "field.path: problem", prefixed with the position of that field's node; when the field
 * was not written in the file (a default) its nearest written parent is used. */
enum kvcap_status kvcap_yaml_relocate(struct kvcap_yaml *c, yaml_mark_t fallback)
{
    char msg[MSG_CAP], field[KVCAP_YAML_FIELD_CAP];
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
    return kvcap_yaml_fail_at(c, m, "%s", msg);
}

void kvcap_yaml_join(char *out, const char *parent, const char *key)
{
    if (parent && parent[0])
        snprintf(out, KVCAP_YAML_FIELD_CAP, "%.90s.%.30s", parent, key);
    else
        snprintf(out, KVCAP_YAML_FIELD_CAP, "%.30s", key);
}

yaml_node_t *kvcap_yaml_node_at(struct kvcap_yaml *c, int i)
{
    return yaml_document_get_node(&c->doc, i);
}

const char *kvcap_yaml_scalar(const yaml_node_t *n)
{
    return (const char *)n->data.scalar.value;
}

static int kvcap_yaml_is_plain(const yaml_node_t *n)
{
    return n->type == YAML_SCALAR_NODE && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
}

int kvcap_yaml_is_null(const yaml_node_t *n)
{
    if (!kvcap_yaml_is_plain(n))
        return 0;
    const char *s = kvcap_yaml_scalar(n);
    return s[0] == '\0' || strcmp(s, "~") == 0 || strcmp(s, "null") == 0 ||
           strcmp(s, "Null") == 0 || strcmp(s, "NULL") == 0;
}

/* "a mapping", "a list", "an empty value", "'12abc'", "the string \"28\"". */
static const char *kvcap_yaml_describe(const yaml_node_t *n, char *buf, size_t cap)
{
    switch (n->type) {
    case YAML_MAPPING_NODE: return "a mapping";
    case YAML_SEQUENCE_NODE: return "a list";
    case YAML_SCALAR_NODE:
        if (kvcap_yaml_is_null(n))
            return "an empty value";
        if (kvcap_yaml_is_plain(n))
            snprintf(buf, cap, "'%.40s%s'", kvcap_yaml_scalar(n),
                     n->data.scalar.length > 40 ? "..." : "");
        else
            snprintf(buf, cap, "the string \"%.40s%s\"", kvcap_yaml_scalar(n),
                     n->data.scalar.length > 40 ? "..." : "");
        return buf;
    case YAML_NO_NODE: break;
    }
    return "nothing";
}

enum kvcap_status kvcap_yaml_expect(struct kvcap_yaml *c, const yaml_node_t *n, const char *field,
                                    yaml_node_type_t type)
{
    if (n->type == type)
        return KVCAP_OK;
    char buf[80];
    const char *what = type == YAML_MAPPING_NODE    ? "a mapping"
                       : type == YAML_SEQUENCE_NODE ? "a list"
                                                    : "a scalar";
    return kvcap_yaml_fail_at(c, n->start_mark, "%s: expected %s, got %s",
                              field[0] ? field : "top level", what,
                              kvcap_yaml_describe(n, buf, sizeof buf));
}

/* ---- Mappings ---------------------------------------------------------------------------- */
static void kvcap_yaml_list_names(char *buf, size_t cap, const char *const *names)
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
 * and records the positions of the mapping and of its values for kvcap_yaml_relocate(). */
enum kvcap_status kvcap_yaml_check_mapping(struct kvcap_yaml *c, yaml_node_t *map,
                                           const char *field, const char *const *allowed,
                                           const char *kind)
{
    KVCAP_TRY(kvcap_yaml_expect(c, map, field, YAML_MAPPING_NODE));
    kvcap_yaml_record(c, field, map->start_mark);
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        yaml_node_t *key = kvcap_yaml_node_at(c, p->key);
        if (key->type != YAML_SCALAR_NODE)
            return kvcap_yaml_fail_at(c, key->start_mark, "%s: keys must be scalars, got %s",
                                      field[0] ? field : "top level",
                                      key->type == YAML_MAPPING_NODE ? "a mapping" : "a list");
        const char *k = kvcap_yaml_scalar(key);
        char sub[KVCAP_YAML_FIELD_CAP];
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
            kvcap_yaml_list_names(names, sizeof names, allowed);
            if (!allowed[0])
                return kvcap_yaml_fail_at(c, key->start_mark, "%s: unknown key (%s takes no keys)",
                                          sub, field);
            return kvcap_yaml_fail_at(c, key->start_mark, "%s: unknown key%s%s (expected %s)", sub,
                                      kind ? " for kind " : "", kind ? kind : "", names);
        }
        /* Earlier keys are all distinct known keys, so this loop is short. */
        for (yaml_node_pair_t *q = map->data.mapping.pairs.start; q < p; q++) {
            yaml_node_t *prev = kvcap_yaml_node_at(c, q->key);
            if (strcmp(kvcap_yaml_scalar(prev), k) == 0)
                return kvcap_yaml_fail_at(c, key->start_mark,
                                          "%s: duplicate key (first at %zu:%zu)", sub,
                                          prev->start_mark.line + 1, prev->start_mark.column + 1);
        }
        kvcap_yaml_record(c, sub, kvcap_yaml_node_at(c, p->value)->start_mark);
    }
    return KVCAP_OK;
}

/* The value of `key` in a checked mapping, NULL when absent. */
yaml_node_t *kvcap_yaml_lookup(struct kvcap_yaml *c, yaml_node_t *map, const char *key)
{
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        yaml_node_t *k = kvcap_yaml_node_at(c, p->key);
        if (k->type == YAML_SCALAR_NODE && strcmp(kvcap_yaml_scalar(k), key) == 0)
            return kvcap_yaml_node_at(c, p->value);
    }
    return NULL;
}

/* Fails on the first key of NULL-terminated `keys` absent from `map`. */
enum kvcap_status kvcap_yaml_require(struct kvcap_yaml *c, yaml_node_t *map, const char *field,
                                     const char *const *keys)
{
    for (int i = 0; keys[i]; i++) {
        if (!kvcap_yaml_lookup(c, map, keys[i])) {
            if (field[0])
                return kvcap_yaml_fail_at(c, map->start_mark, "%s: missing required key '%s'",
                                          field, keys[i]);
            return kvcap_yaml_fail_at(c, map->start_mark, "missing required key '%s'", keys[i]);
        }
    }
    return KVCAP_OK;
}

/* ---- Scalars ----------------------------------------------------------------------------- */
static enum kvcap_status kvcap_yaml_number_text(struct kvcap_yaml *c, const yaml_node_t *n,
                                                const char *field, const char *what,
                                                const char *allowed_chars)
{
    char buf[80];
    if (n->type != YAML_SCALAR_NODE || !kvcap_yaml_is_plain(n) || kvcap_yaml_is_null(n))
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: expected %s, got %s", field, what,
                                  kvcap_yaml_describe(n, buf, sizeof buf));
    const char *s = kvcap_yaml_scalar(n);
    int digits = 0, other = 0;
    for (const char *p = s; *p; p++) {
        if (*p >= '0' && *p <= '9')
            digits = 1;
        else if (!strchr(allowed_chars, *p))
            other = 1;
    }
    if (!digits || other || strlen(s) != n->data.scalar.length)
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: expected %s, got %s", field, what,
                                  kvcap_yaml_describe(n, buf, sizeof buf));
    return KVCAP_OK;
}

static enum kvcap_status kvcap_yaml_as_int(struct kvcap_yaml *c, const yaml_node_t *n,
                                           const char *field, long long lo, long long hi,
                                           long long *out)
{
    KVCAP_TRY(kvcap_yaml_number_text(c, n, field, "an integer", "+-"));
    const char *s = kvcap_yaml_scalar(n);
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (*end != '\0' || end == s)
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: expected an integer, got '%.40s'", field,
                                  s);
    if (errno == ERANGE || v < lo || v > hi) {
        if (lo == INT_MIN && hi == INT_MAX)
            return kvcap_yaml_fail_at(c, n->start_mark, "%s: %.40s is out of range", field, s);
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: %.40s is outside %lld..%lld", field, s, lo,
                                  hi);
    }
    *out = v;
    return KVCAP_OK;
}

static enum kvcap_status kvcap_yaml_as_u64(struct kvcap_yaml *c, const yaml_node_t *n,
                                           const char *field, uint64_t *out)
{
    KVCAP_TRY(kvcap_yaml_number_text(c, n, field, "an integer", "+-"));
    const char *s = kvcap_yaml_scalar(n);
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end != '\0' || end == s)
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: expected an integer, got '%.40s'", field,
                                  s);
    if (s[0] == '-' || errno == ERANGE)
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: %.40s is outside 0..%llu", field, s,
                                  (unsigned long long)UINT64_MAX);
    *out = (uint64_t)v;
    return KVCAP_OK;
}

enum kvcap_status kvcap_yaml_as_double(struct kvcap_yaml *c, const yaml_node_t *n,
                                       const char *field, struct kvcap_yaml_range r, double *out)
{
    /* Only decimal notation: this excludes inf, nan, .inf, hex floats and "1_000". */
    KVCAP_TRY(kvcap_yaml_number_text(c, n, field, "a number", "+-.eE"));
    const char *s = kvcap_yaml_scalar(n);
    char *end;
    errno = 0;
    double v = strtod(s, &end); /* the "C" locale is in effect (see kvcap_yaml_load()) */
    if (*end != '\0' || end == s)
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: expected a number, got '%.40s'", field, s);
    if (errno == ERANGE || !isfinite(v))
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: %.40s is out of range for a double", field,
                                  s);
    int below = r.lo_open ? !(v > r.lo) : !(v >= r.lo);
    int above = r.hi_open ? !(v < r.hi) : !(v <= r.hi);
    if (below || above) {
        if (r.hi == HUGE_VAL)
            return kvcap_yaml_fail_at(c, n->start_mark, "%s: %.40s must be %s %g", field, s,
                                      r.lo_open ? ">" : ">=", r.lo);
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: %.40s is outside %c%g, %g%c", field, s,
                                  r.lo_open ? '(' : '[', r.lo, r.hi, r.hi_open ? ')' : ']');
    }
    *out = v;
    return KVCAP_OK;
}

enum kvcap_status kvcap_yaml_as_named(struct kvcap_yaml *c, const yaml_node_t *n, const char *field,
                                      const struct kvcap_yaml_names *set, int *out)
{
    char buf[80];
    if (n->type != YAML_SCALAR_NODE || kvcap_yaml_is_null(n))
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: expected a name, got %s", field,
                                  kvcap_yaml_describe(n, buf, sizeof buf));
    if (strlen(kvcap_yaml_scalar(n)) == n->data.scalar.length &&
        set->parse(kvcap_yaml_scalar(n), out))
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
    return kvcap_yaml_fail_at(c, n->start_mark, "%s: '%.40s' is not one of %s", field,
                              kvcap_yaml_scalar(n), names);
}

enum kvcap_status kvcap_yaml_as_string(struct kvcap_yaml *c, const yaml_node_t *n,
                                       const char *field, char *out, size_t cap)
{
    char buf[80];
    if (n->type != YAML_SCALAR_NODE || kvcap_yaml_is_null(n))
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: expected a string, got %s", field,
                                  kvcap_yaml_describe(n, buf, sizeof buf));
    if (strlen(kvcap_yaml_scalar(n)) != n->data.scalar.length)
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: contains a NUL character", field);
    if (n->data.scalar.length >= cap)
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: longer than %zu bytes", field, cap - 1);
    memcpy(out, kvcap_yaml_scalar(n), n->data.scalar.length + 1);
    return KVCAP_OK;
}

/* Optional fields of a checked mapping: absent keys leave *out (the default) untouched. */
enum kvcap_status kvcap_yaml_get_int(struct kvcap_yaml *c, yaml_node_t *map, const char *parent,
                                     const char *key, long long lo, long long hi, int *out)
{
    yaml_node_t *n = kvcap_yaml_lookup(c, map, key);
    if (!n)
        return KVCAP_OK;
    char field[KVCAP_YAML_FIELD_CAP];
    kvcap_yaml_join(field, parent, key);
    long long v;
    KVCAP_TRY(kvcap_yaml_as_int(c, n, field, lo, hi, &v));
    *out = (int)v;
    return KVCAP_OK;
}

enum kvcap_status kvcap_yaml_get_u64(struct kvcap_yaml *c, yaml_node_t *map, const char *parent,
                                     const char *key, uint64_t *out)
{
    yaml_node_t *n = kvcap_yaml_lookup(c, map, key);
    if (!n)
        return KVCAP_OK;
    char field[KVCAP_YAML_FIELD_CAP];
    kvcap_yaml_join(field, parent, key);
    return kvcap_yaml_as_u64(c, n, field, out);
}

enum kvcap_status kvcap_yaml_get_double(struct kvcap_yaml *c, yaml_node_t *map, const char *parent,
                                        const char *key, struct kvcap_yaml_range r, double *out)
{
    yaml_node_t *n = kvcap_yaml_lookup(c, map, key);
    if (!n)
        return KVCAP_OK;
    char field[KVCAP_YAML_FIELD_CAP];
    kvcap_yaml_join(field, parent, key);
    return kvcap_yaml_as_double(c, n, field, r, out);
}

/* A list of `want_min..want_max` integers into out[]; records each element's position. */
enum kvcap_status kvcap_yaml_get_int_list(struct kvcap_yaml *c, yaml_node_t *n, const char *field,
                                          int want_min, int want_max, int *out, int *count)
{
    KVCAP_TRY(kvcap_yaml_expect(c, n, field, YAML_SEQUENCE_NODE));
    ptrdiff_t len = n->data.sequence.items.top - n->data.sequence.items.start;
    if (len < want_min || len > want_max) {
        if (want_min == want_max)
            return kvcap_yaml_fail_at(c, n->start_mark, "%s: %td entries, expected %d", field, len,
                                      want_min);
        return kvcap_yaml_fail_at(c, n->start_mark, "%s: %td entries, expected %d..%d", field, len,
                                  want_min, want_max);
    }
    for (ptrdiff_t i = 0; i < len; i++) {
        yaml_node_t *item = kvcap_yaml_node_at(c, n->data.sequence.items.start[i]);
        char sub[KVCAP_YAML_FIELD_CAP];
        snprintf(sub, sizeof sub, "%.100s[%td]", field, i);
        kvcap_yaml_record(c, sub, item->start_mark);
        long long v;
        KVCAP_TRY(kvcap_yaml_as_int(c, item, sub, INT_MIN, INT_MAX, &v));
        out[i] = (int)v;
    }
    *count = (int)len;
    return KVCAP_OK;
}

/* ---- Model geometry (shared by both kinds) ------------------------------------------------ */
enum kvcap_status kvcap_yaml_parse_model(struct kvcap_yaml *c, yaml_node_t *n,
                                         struct kvcap_model_geometry *g)
{
    static const char *const keys[] = {"name",     "layers",   "q_heads", "kv_heads",
                                       "head_dim", "rope",     NULL};
    static const char *const required[] = {"layers", "q_heads", "kv_heads", "head_dim", "rope",
                                           NULL};
    static const char *const rope_keys[] = {"type", "pairing", "theta", "dim", "sections", NULL};
    const char *f = "model";
    memset(g, 0, sizeof *g);
    KVCAP_TRY(kvcap_yaml_check_mapping(c, n, f, keys, NULL));
    KVCAP_TRY(kvcap_yaml_require(c, n, f, required));
    yaml_node_t *name = kvcap_yaml_lookup(c, n, "name");
    if (name)
        KVCAP_TRY(kvcap_yaml_as_string(c, name, "model.name", g->name, sizeof g->name));
    KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "layers", INT_MIN, INT_MAX, &g->n_layers));
    KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "q_heads", INT_MIN, INT_MAX, &g->n_q_heads));
    KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "kv_heads", INT_MIN, INT_MAX, &g->n_kv_heads));
    KVCAP_TRY(kvcap_yaml_get_int(c, n, f, "head_dim", INT_MIN, INT_MAX, &g->head_dim));

    yaml_node_t *rope = kvcap_yaml_lookup(c, n, "rope");
    const char *rf = "model.rope";
    KVCAP_TRY(kvcap_yaml_check_mapping(c, rope, rf, rope_keys, NULL));
    KVCAP_TRY(kvcap_yaml_require(c, rope, rf, (const char *const[]){"type", NULL}));
    KVCAP_YAML_GET_NAMED(c, rope, rf, "type", &rope_type_set, &g->rope_type);
    if (g->rope_type == KVCAP_ROPE_NONE) {
        for (int i = 1; rope_keys[i]; i++) {
            yaml_node_t *extra = kvcap_yaml_lookup(c, rope, rope_keys[i]);
            if (extra)
                return kvcap_yaml_fail_at(c, extra->start_mark,
                                          "model.rope.%s: only valid with type rope or mrope",
                                          rope_keys[i]);
        }
    } else {
        KVCAP_TRY(kvcap_yaml_require(c, rope, rf, (const char *const[]){"pairing", "theta", NULL}));
        if (g->rope_type == KVCAP_ROPE_MROPE)
            KVCAP_TRY(kvcap_yaml_require(c, rope, rf, (const char *const[]){"sections", NULL}));
        KVCAP_YAML_GET_NAMED(c, rope, rf, "pairing", &pairing_set, &g->rope_pairing);
        KVCAP_TRY(kvcap_yaml_get_double(c, rope, rf, "theta", KVCAP_YAML_ANY, &g->rope_theta));
        KVCAP_TRY(kvcap_yaml_get_int(c, rope, rf, "dim", INT_MIN, INT_MAX, &g->rope_dim));
        yaml_node_t *sections = kvcap_yaml_lookup(c, rope, "sections");
        if (sections)
            KVCAP_TRY(kvcap_yaml_get_int_list(c, sections, "model.rope.sections", 0,
                                              KVCAP_MAX_ROPE_SECTIONS, g->rope_sections,
                                              &g->n_rope_sections));
    }
    /* One validator for configs, file headers and caches; its message names the field and
     * kvcap_yaml_relocate() puts that field's line:col in front. */
    if (kvcap_geometry_check(g) != KVCAP_OK)
        return kvcap_yaml_relocate(c, n->start_mark);
    return KVCAP_OK;
}

/* ---- Loading ----------------------------------------------------------------------------- */
static enum kvcap_status kvcap_yaml_syntax_error(const struct kvcap_yaml *c, const yaml_parser_t *p,
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
            return kvcap_yaml_fail_at(c, m, "%s (byte 0x%02X)", problem,
                                      (unsigned)p->problem_value);
        return kvcap_yaml_fail_at(c, m, "%s", problem);
    }
    if (p->context)
        return kvcap_yaml_fail_at(c, p->problem_mark, "%s (%s at %zu:%zu)", problem, p->context,
                                  p->context_mark.line + 1, p->context_mark.column + 1);
    return kvcap_yaml_fail_at(c, p->problem_mark, "%s", problem);
}

/* libyaml's scanner revisits every open flow level for each token, so time grows with the
 * square of the nesting depth: a hostile 1 MiB "[[[[..." would take many minutes. A first pass
 * over the events refuses nesting deeper than any config needs (it stops as soon as it sees
 * it) before the loader builds a tree; it also reports syntax errors. */
static enum kvcap_status kvcap_yaml_check_depth(const struct kvcap_yaml *c, const char *text,
                                                size_t len)
{
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p))
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", c->label);
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    enum kvcap_status st = KVCAP_OK;
    for (int depth = 0;;) {
        yaml_event_t e;
        if (!yaml_parser_parse(&p, &e)) {
            st = kvcap_yaml_syntax_error(c, &p, text, len);
            break;
        }
        yaml_event_type_t type = e.type;
        yaml_mark_t mark = e.start_mark;
        yaml_event_delete(&e);
        if (type == YAML_SEQUENCE_START_EVENT || type == YAML_MAPPING_START_EVENT) {
            if (++depth > MAX_DEPTH) {
                st = kvcap_yaml_fail_at(c, mark, "nesting deeper than %d levels", MAX_DEPTH);
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

typedef enum kvcap_status (*kvcap_yaml_parse_fn)(struct kvcap_yaml *c, yaml_node_t *root,
                                                 void *out);

enum kvcap_status kvcap_yaml_load(const char *text, size_t len, const char *label, const char *dir,
                                  size_t dir_len, kvcap_yaml_parse_fn parse, void *out)
{
    struct kvcap_yaml *c = calloc(1, sizeof *c);
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

    enum kvcap_status st = kvcap_yaml_check_depth(c, text, len);
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
        st = kvcap_yaml_syntax_error(c, &parser, text, len);
        goto done;
    }
    have_doc = 1;
    yaml_node_t *root = yaml_document_get_root_node(&c->doc);
    if (!root) {
        st = kvcap_yaml_fail_at(c, c->doc.start_mark, "empty document, expected a mapping");
        goto done;
    }
    /* The whole stream is parsed before it is interpreted: a second document is a mistake
     * (a stray `---`), and a syntax error after the first should not go unnoticed. */
    yaml_document_t extra;
    if (!yaml_parser_load(&parser, &extra)) {
        st = kvcap_yaml_syntax_error(c, &parser, text, len);
        goto done;
    }
    yaml_node_t *extra_root = yaml_document_get_root_node(&extra);
    yaml_mark_t extra_mark = extra.start_mark;
    yaml_document_delete(&extra);
    if (extra_root) {
        st = kvcap_yaml_fail_at(c, extra_mark, "a second YAML document; a config is one document");
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

enum kvcap_status kvcap_yaml_load_file(const char *path, kvcap_yaml_parse_fn parse, void *out)
{
    char *text = NULL;
    size_t len = 0;
    KVCAP_TRY(kvcap_read_file(path, KVCAP_CONFIG_MAX_BYTES, KVCAP_ERR_CONFIG, ", not a config",
                              &text, &len));
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path) : 0;
    if (slash && dir_len == 0)
        dir_len = 1; /* a file in "/": keep the root */
    enum kvcap_status st =
        kvcap_yaml_load(text, len, path, slash ? path : NULL, dir_len, parse, out);
    free(text);
    return st;
}
