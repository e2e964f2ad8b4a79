/* names.c — the one table of names for enums shared by YAML configs, file headers and CLIs. */
#include <strings.h>

#include "common/internal.h"

struct name_entry {
    const char *name;
    int value;
};

static int lookup(const struct name_entry *t, size_t n, const char *s, int *out)
{
    if (!s)
        return 0;
    for (size_t i = 0; i < n; i++) {
        if (strcasecmp(t[i].name, s) == 0) {
            *out = t[i].value;
            return 1;
        }
    }
    return 0;
}

static const char *name_of(const struct name_entry *t, size_t n, int v)
{
    for (size_t i = 0; i < n; i++)
        if (t[i].value == v)
            return t[i].name;
    return "?";
}

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* The first entry of each value is its canonical (written) name. */
static const struct name_entry rope_types[] = {
    {"none", KVCAP_ROPE_NONE}, {"rope", KVCAP_ROPE_ROPE}, {"mrope", KVCAP_ROPE_MROPE}};
static const struct name_entry rope_pairings[] = {{"half", KVCAP_ROPE_PAIRING_HALF},
                                                  {"adjacent", KVCAP_ROPE_PAIRING_ADJACENT},
                                                  {"neox", KVCAP_ROPE_PAIRING_HALF},
                                                  {"normal", KVCAP_ROPE_PAIRING_ADJACENT}};
static const struct name_entry policies[] = {
    {"full", KVCAP_POLICY_FULL},         {"kvcapsule", KVCAP_POLICY_KVCAPSULE},
    {"flashcache", KVCAP_POLICY_FLASHCACHE}, {"vlcache", KVCAP_POLICY_VLCACHE},
    {"freekv", KVCAP_POLICY_FREEKV},     {"streaming", KVCAP_POLICY_STREAMING},
    {"kvzip", KVCAP_POLICY_KVZIP},       {"random", KVCAP_POLICY_RANDOM},
    {"expected_attention", KVCAP_POLICY_EXPECTED_ATTENTION}};
static const struct name_entry structures[] = {{"dense", KVCAP_STRUCTURE_DENSE},
                                               {"tiled", KVCAP_STRUCTURE_TILED}};
static const struct name_entry dtypes[] = {
    {"F32", KVCAP_DTYPE_F32}, {"F16", KVCAP_DTYPE_F16}, {"BF16", KVCAP_DTYPE_BF16},
    {"F64", KVCAP_DTYPE_F64}, {"I32", KVCAP_DTYPE_I32}, {"U8", KVCAP_DTYPE_U8}};

#define DEFINE_NAMES(fn, type, table)                                   \
    int fn##_parse(const char *s, type *out)                            \
    {                                                                   \
        int v;                                                          \
        if (!lookup(table, COUNT(table), s, &v))                        \
            return 0;                                                   \
        *out = (type)v;                                                 \
        return 1;                                                       \
    }                                                                   \
    const char *fn##_name(type value) { return name_of(table, COUNT(table), (int)value); }

DEFINE_NAMES(kvcap_rope_type, enum kvcap_rope_type, rope_types)
DEFINE_NAMES(kvcap_rope_pairing, enum kvcap_rope_pairing, rope_pairings)
DEFINE_NAMES(kvcap_policy, enum kvcap_policy, policies)
DEFINE_NAMES(kvcap_structure, enum kvcap_structure, structures)
DEFINE_NAMES(kvcap_dtype, enum kvcap_dtype, dtypes)

