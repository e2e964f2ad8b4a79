/* yaml.h — the strict YAML node reader under both configs (configs/yaml.c): a parse context
 * that remembers where each field was written, typed getters that name the field and its
 * FILE:LINE:COL in every message, the model geometry both configs share, and the loader (a
 * depth check before the document is built, the "C" locale, one document only). Internal to
 * configs/: runtime_config.c (in libkvcap) and calib_config.c (in the calibration tools) read
 * their keys through it. */
#ifndef KVCAP_CONFIGS_YAML_H
#define KVCAP_CONFIGS_YAML_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <yaml.h>

#include "configs/config.h"
#include "common/internal.h"

#define KVCAP_YAML_FIELD_CAP 128  /* a dotted field path: "schedule.keys.ratios[1023]" */
#define KVCAP_YAML_MAX_MARKS 256  /* field -> mark records kept to place validator messages */

struct mark_entry {
    char field[KVCAP_YAML_FIELD_CAP];
    yaml_mark_t mark;
};

/* One load: the document and where each field was written. */
struct kvcap_yaml {
    const char *label;   /* file name or caller's label, prefixes every message */
    const char *dir;     /* directory of the file (relative artifact paths), NULL for strings */
    size_t dir_len;
    yaml_document_t doc; /* the loaded document */
    int n_marks;
    struct mark_entry marks[KVCAP_YAML_MAX_MARKS];
};

/* An interval for a double: [lo, hi] with either end open; hi = HUGE_VAL for "no upper". */
struct kvcap_yaml_range {
    double lo, hi;
    int lo_open, hi_open;
};
static const struct kvcap_yaml_range KVCAP_YAML_RATIO = {0.0, 1.0, 1, 0};         /* (0, 1] */
static const struct kvcap_yaml_range KVCAP_YAML_POSITIVE = {0.0, HUGE_VAL, 1, 0}; /* > 0 */
static const struct kvcap_yaml_range KVCAP_YAML_NONNEG = {0.0, HUGE_VAL, 0, 0};   /* >= 0 */
static const struct kvcap_yaml_range KVCAP_YAML_ANY = {-HUGE_VAL, HUGE_VAL, 0, 0};

/* A set of names seen through int: the parser, the value -> name map and the number of values
 * accepted (0..count-1; 0 = every value the name table knows, so a policy added to names.c is
 * accepted here without an edit), so one routine reads and reports every enum field. */
struct kvcap_yaml_names {
    int (*parse)(const char *s, int *out);
    const char *(*name)(int v);
    int count;
};

#define KVCAP_YAML_NAME_SET(tag, type, prefix, n)                               \
    static int tag##_parse_i(const char *s, int *out)                           \
    {                                                                           \
        type t;                                                                 \
        if (!prefix##_parse(s, &t) || (int)t < 0 || ((n) > 0 && (int)t >= (n))) \
            return 0;                                                           \
        *out = (int)t;                                                          \
        return 1;                                                               \
    }                                                                           \
    static const char *tag##_name_i(int v)                                      \
    {                                                                           \
        return prefix##_name((type)v);                                          \
    }                                                                           \
    static const struct kvcap_yaml_names tag##_set = {tag##_parse_i, tag##_name_i, (n)};

/* Every call below fails with KVCAP_ERR_CONFIG and "LABEL:LINE:COL: field: problem". */
enum kvcap_status kvcap_yaml_fail_at(const struct kvcap_yaml *c, yaml_mark_t m, const char *fmt,
                                     ...) KVCAP_PRINTF(3, 4);
/* Re-issues the message a validator (kvcap_geometry_check, kvcap_bucket_check) just set,
 * "field.path: problem", prefixed with the position of that field's node. */
enum kvcap_status kvcap_yaml_relocate(struct kvcap_yaml *c, yaml_mark_t fallback);
/* out (KVCAP_YAML_FIELD_CAP bytes) = "parent.key", or "key" at the top level. */
void kvcap_yaml_join(char *out, const char *parent, const char *key);
yaml_node_t *kvcap_yaml_node_at(struct kvcap_yaml *c, int i);
const char *kvcap_yaml_scalar(const yaml_node_t *n);
int kvcap_yaml_is_null(const yaml_node_t *n); /* empty, ~, null, Null or NULL, unquoted */
enum kvcap_status kvcap_yaml_expect(struct kvcap_yaml *c, const yaml_node_t *n, const char *field,
                                    yaml_node_type_t type);
/* Checks that `map` is a mapping whose keys are scalars drawn from `allowed` (NULL-terminated;
 * `kind` names the variant for the message when the set depends on one), each present once,
 * and records the positions of the mapping and of its values for kvcap_yaml_relocate(). */
enum kvcap_status kvcap_yaml_check_mapping(struct kvcap_yaml *c, yaml_node_t *map,
                                           const char *field, const char *const *allowed,
                                           const char *kind);
/* The value of `key` in a checked mapping, NULL when absent. */
yaml_node_t *kvcap_yaml_lookup(struct kvcap_yaml *c, yaml_node_t *map, const char *key);
/* Fails on the first key of NULL-terminated `keys` absent from `map`. */
enum kvcap_status kvcap_yaml_require(struct kvcap_yaml *c, yaml_node_t *map, const char *field,
                                     const char *const *keys);
enum kvcap_status kvcap_yaml_as_double(struct kvcap_yaml *c, const yaml_node_t *n,
                                       const char *field, struct kvcap_yaml_range r, double *out);
enum kvcap_status kvcap_yaml_as_string(struct kvcap_yaml *c, const yaml_node_t *n,
                                       const char *field, char *out, size_t cap);
enum kvcap_status kvcap_yaml_as_named(struct kvcap_yaml *c, const yaml_node_t *n, const char *field,
                                      const struct kvcap_yaml_names *set, int *out);
/* Optional fields of a checked mapping: absent keys leave *out (the default) untouched. */
enum kvcap_status kvcap_yaml_get_int(struct kvcap_yaml *c, yaml_node_t *map, const char *parent,
                                     const char *key, long long lo, long long hi, int *out);
enum kvcap_status kvcap_yaml_get_u64(struct kvcap_yaml *c, yaml_node_t *map, const char *parent,
                                     const char *key, uint64_t *out);
enum kvcap_status kvcap_yaml_get_double(struct kvcap_yaml *c, yaml_node_t *map, const char *parent,
                                        const char *key, struct kvcap_yaml_range r, double *out);
/* A list of `want_min..want_max` integers into out[]; records each element's position. */
enum kvcap_status kvcap_yaml_get_int_list(struct kvcap_yaml *c, yaml_node_t *n, const char *field,
                                          int want_min, int want_max, int *out, int *count);
/* Reads an enum field into *out of any enum type (the value is stored through an int). */
#define KVCAP_YAML_GET_NAMED(c, map, parent, key, set, out)                       \
    do {                                                                          \
        yaml_node_t *gn_node = kvcap_yaml_lookup((c), (map), (key));              \
        if (gn_node) {                                                            \
            char gn_field[KVCAP_YAML_FIELD_CAP];                                  \
            int gn_v = 0;                                                         \
            kvcap_yaml_join(gn_field, (parent), (key));                           \
            KVCAP_TRY(kvcap_yaml_as_named((c), gn_node, gn_field, (set), &gn_v)); \
            *(out) = gn_v;                                                        \
        }                                                                         \
    } while (0)

/* The `model` mapping both configs share, validated by kvcap_geometry_check. */
enum kvcap_status kvcap_yaml_parse_model(struct kvcap_yaml *c, yaml_node_t *n,
                                         struct kvcap_model_geometry *g);

/* Reads the whole text as one YAML document and hands its root to `parse`; `label` prefixes
 * messages, `dir` (dir_len bytes, may be NULL) is the directory relative paths resolve from.
 * _load_file reads `path` (at most KVCAP_CONFIG_MAX_BYTES) and uses it as label and dir. */
typedef enum kvcap_status (*kvcap_yaml_parse_fn)(struct kvcap_yaml *c, yaml_node_t *root,
                                                 void *out);
enum kvcap_status kvcap_yaml_load(const char *text, size_t len, const char *label, const char *dir,
                                  size_t dir_len, kvcap_yaml_parse_fn parse, void *out);
enum kvcap_status kvcap_yaml_load_file(const char *path, kvcap_yaml_parse_fn parse, void *out);

#endif /* KVCAP_CONFIGS_YAML_H */
