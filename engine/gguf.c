/* gguf.c — GGUF v3 reader (llama.cpp's model container): one pass over the header with every
 * count and length checked against the bytes that remain, an index of the key/values and the
 * tensor infos, zero-copy views into a read-only mapping, and f32 dequantisation of the float
 * and legacy 4/5/8-bit block types, bit for bit as ggml's dequantize_row_*.
 *
 * Policies beyond the spec's letter (each rejection names the key, tensor or field):
 *  - Arrays of arrays are refused, as llama.cpp's own reader refuses them: no GGUF writer emits
 *    them and they would be the only recursive structure in the format.
 *  - Strings are length-checked but not UTF-8-checked (vocabularies hold token fragments);
 *    keys and tensor names must be non-empty and free of NUL bytes, since they are handed out
 *    as C strings. Bools must be 0 or 1, as the spec says.
 *  - Tensor types: the full ggml size table (types 0..41) is known, so every tensor's extent is
 *    checked; numbers ggml has retired (4, 5, 31..33, 36..38) or never assigned are refused.
 *  - Tensors need 1..4 dims, each >= 1; data may lie in any order but never overlap. */
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "common/internal.h"
#include "formats/safetensors.h" /* kvcap_convert_to_f32, kvcap_f16_to_f32 */

#define GGUF_VERSION 3u
#define GGUF_DEFAULT_ALIGNMENT 32u
#define ALIGNMENT_KEY "general.alignment"

/* The smallest encodings, used to bound header counts by the bytes left: a key/value is a
 * one-byte key (8 + 1), its type (4) and a uint8 value (1); a tensor info is a one-byte name
 * (8 + 1), n_dims (4), one dim (8), the type (4) and the offset (8). */
#define MIN_KV_BYTES 14u
#define MIN_TENSOR_INFO_BYTES 33u

/* Longest name or key quoted in a message; the rest is cut. */
#define NAME_IN_MESSAGE 200

/* ---- Type tables ------------------------------------------------------------------------ */

#define N_VALUE_TYPES 13u

static const char *const value_type_names[N_VALUE_TYPES] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
    "bool", "string", "array", "uint64", "int64", "float64"};

/* Bytes of one scalar of each value type; 0 for string and array (variable length). */
static const uint8_t value_type_size[N_VALUE_TYPES] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

static const char *value_type_name(uint32_t t)
{
    return t < N_VALUE_TYPES ? value_type_names[t] : "?";
}

static int is_integer_type(uint32_t t)
{
    return t <= KVGGUF_INT32 || t == KVGGUF_UINT64 || t == KVGGUF_INT64;
}

/* ggml's type traits: elements per block and bytes per block (ggml-common.h). A zero block
 * marks a number that is retired or unassigned. */
struct ggml_type_info {
    const char *name;
    uint32_t block;
    uint32_t bytes;
};

static const struct ggml_type_info ggml_types[] = {
    [0] = {"F32", 1, 4},         [1] = {"F16", 1, 2},          [2] = {"Q4_0", 32, 18},
    [3] = {"Q4_1", 32, 20},      [6] = {"Q5_0", 32, 22},       [7] = {"Q5_1", 32, 24},
    [8] = {"Q8_0", 32, 34},      [9] = {"Q8_1", 32, 36},       [10] = {"Q2_K", 256, 84},
    [11] = {"Q3_K", 256, 110},   [12] = {"Q4_K", 256, 144},    [13] = {"Q5_K", 256, 176},
    [14] = {"Q6_K", 256, 210},   [15] = {"Q8_K", 256, 292},    [16] = {"IQ2_XXS", 256, 66},
    [17] = {"IQ2_XS", 256, 74},  [18] = {"IQ3_XXS", 256, 98},  [19] = {"IQ1_S", 256, 50},
    [20] = {"IQ4_NL", 32, 18},   [21] = {"IQ3_S", 256, 110},   [22] = {"IQ2_S", 256, 82},
    [23] = {"IQ4_XS", 256, 136}, [24] = {"I8", 1, 1},          [25] = {"I16", 1, 2},
    [26] = {"I32", 1, 4},        [27] = {"I64", 1, 8},         [28] = {"F64", 1, 8},
    [29] = {"IQ1_M", 256, 56},   [30] = {"BF16", 1, 2},        [34] = {"TQ1_0", 256, 54},
    [35] = {"TQ2_0", 256, 66},   [39] = {"MXFP4", 32, 17},     [40] = {"NVFP4", 64, 36},
    [41] = {"Q1_0", 128, 18},
};
#define N_GGML_TYPES (sizeof ggml_types / sizeof ggml_types[0])

static const struct ggml_type_info *ggml_type(uint32_t t)
{
    return t < N_GGML_TYPES && ggml_types[t].block ? &ggml_types[t] : NULL;
}

const char *kvgguf_type_name(uint32_t type)
{
    const struct ggml_type_info *ti = ggml_type(type);
    return ti ? ti->name : "?";
}

/* ---- Little-endian reads (any alignment) ------------------------------------------------ */

static uint16_t rd16(const unsigned char *p)
{
    return (uint16_t)(p[0] | (unsigned)p[1] << 8);
}

static uint32_t rd32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t rd64(const unsigned char *p)
{
    return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32;
}

/* ---- The file --------------------------------------------------------------------------- */

struct kv {
    const char *key;          /* NUL-terminated, in f->key_text */
    uint32_t type;            /* enum kvgguf_type */
    uint32_t elem_type;       /* arrays: the element type */
    uint64_t n;               /* arrays: element count; strings: byte length */
    const unsigned char *val; /* scalar value, string bytes, or the first array element */
    size_t first_str;         /* string arrays: index of element 0 in f->strs */
    size_t key_at;            /* offset of the key in f->key_text (it moves while growing) */
};

/* What a tensor info holds until the names stop moving and the data section is known. */
struct pending {
    size_t name_at;           /* offset of the name in f->name_text */
    uint64_t offset;          /* relative to the data section */
};

/* NUL-terminated strings packed one after another. */
struct text {
    char *p;
    size_t n, cap;
};

struct kvgguf_file {
    char *path;
    const unsigned char *base; /* whole file: mapping or caller buffer */
    uint64_t size;
    void *map;                 /* non-NULL when we own a mapping of map_size bytes */
    size_t map_size;
    uint32_t alignment;
    uint64_t data_offset;      /* start of the data section */

    size_t n_kv, cap_kv;
    struct kv *kvs;            /* file order */
    const struct kv **kv_by_key;
    struct text key_text;

    size_t n_tensors, cap_tensors, cap_pending;
    struct kvgguf_tensor *tensors; /* file order */
    struct pending *pending;       /* parallel to tensors, freed once open */
    const struct kvgguf_tensor **tensor_by_name;
    struct text name_text;

    size_t n_strs, cap_strs;
    struct kvgguf_str *strs;   /* elements of every string array, views into the file */
};

/* Grows *p (of *cap elements of `size` bytes) to hold at least `need`; 0 on failure. Arrays
 * grow as entries are parsed, never to a count the header claims, so memory stays in
 * proportion to the bytes actually present. */
static int grow(void **p, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap)
        return 1;
    size_t c = *cap ? *cap : 16;
    while (c < need) {
        if (c > SIZE_MAX / 2)
            return 0;
        c *= 2;
    }
    size_t bytes;
    if (!kvcap_mul_size(c, size, &bytes))
        return 0;
    void *q = realloc(*p, bytes);
    if (!q)
        return 0;
    *p = q;
    *cap = c;
    return 1;
}

/* ---- Parsing ---------------------------------------------------------------------------- */

struct cursor {
    const unsigned char *base;
    uint64_t size;
    uint64_t pos;
    const char *label;
    char where[NAME_IN_MESSAGE + 64]; /* "key 'general.name'", "tensor 3 (of 9)", ... */
};

static uint64_t left(const struct cursor *c)
{
    return c->size - c->pos;
}

static enum kvcap_status cut_off(const struct cursor *c, const char *field, uint64_t need)
{
    return kvcap_fail(KVCAP_ERR_FORMAT,
                      "%s: %s: %s needs %llu bytes at offset %llu, past the end of the file "
                      "(%llu bytes; truncated?)",
                      c->label, c->where, field, (unsigned long long)need,
                      (unsigned long long)c->pos, (unsigned long long)c->size);
}

static enum kvcap_status take_u32(struct cursor *c, const char *field, uint32_t *out)
{
    if (left(c) < 4)
        return cut_off(c, field, 4);
    *out = rd32(c->base + c->pos);
    c->pos += 4;
    return KVCAP_OK;
}

static enum kvcap_status take_u64(struct cursor *c, const char *field, uint64_t *out)
{
    if (left(c) < 8)
        return cut_off(c, field, 8);
    *out = rd64(c->base + c->pos);
    c->pos += 8;
    return KVCAP_OK;
}

/* A gguf_string: uint64 length, then the bytes (no terminator). */
static enum kvcap_status take_string(struct cursor *c, const char *field, struct kvgguf_str *out)
{
    uint64_t n = 0;
    KVCAP_TRY(take_u64(c, field, &n));
    if (n > left(c))
        return kvcap_fail(KVCAP_ERR_FORMAT,
                          "%s: %s: %s length %llu at offset %llu runs past the end of the file "
                          "(%llu bytes left)",
                          c->label, c->where, field, (unsigned long long)n,
                          (unsigned long long)(c->pos - 8), (unsigned long long)left(c));
    out->s = (const char *)c->base + c->pos;
    out->n = n;
    c->pos += n;
    return KVCAP_OK;
}

/* Reads a key or tensor name (`what` in messages) and appends a NUL-terminated copy to t;
 * *at is where it starts. */
static enum kvcap_status take_name(struct cursor *c, const char *what, struct text *t,
                                   size_t *at)
{
    struct kvgguf_str s = {0};
    KVCAP_TRY(take_string(c, what, &s));
    KVCAP_RETURN_IF(s.n == 0, KVCAP_ERR_FORMAT, "%s: %s: %s is empty", c->label, c->where,
                    what);
    KVCAP_RETURN_IF(memchr(s.s, '\0', (size_t)s.n) != NULL, KVCAP_ERR_FORMAT,
                    "%s: %s: %s '%.*s' contains a NUL byte", c->label, c->where, what,
                    NAME_IN_MESSAGE, s.s);
    size_t need; /* s.n <= the file size, so it fits size_t */
    KVCAP_RETURN_IF(!kvcap_add_size(t->n, (size_t)s.n + 1, &need) ||
                        !grow((void **)&t->p, &t->cap, need, 1),
                    KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory reading %s", c->label,
                    c->where);
    memcpy(t->p + t->n, s.s, (size_t)s.n);
    t->p[t->n + s.n] = '\0';
    *at = t->n;
    t->n = need;
    return KVCAP_OK;
}

/* Magic, version and the two counts, each count bounded by the smallest encoding of what it
 * counts so that no later loop runs on a number the file cannot hold. */
static enum kvcap_status parse_preamble(struct cursor *c, uint64_t *n_tensors, uint64_t *n_kv)
{
    snprintf(c->where, sizeof c->where, "header");
    KVCAP_RETURN_IF(c->size < 4, KVCAP_ERR_FORMAT,
                    "%s: header: file is %llu bytes, too short for the magic (not a GGUF file)",
                    c->label, (unsigned long long)c->size);
    const unsigned char *m = c->base;
    KVCAP_RETURN_IF(memcmp(m, "GGUF", 4) != 0, KVCAP_ERR_FORMAT,
                    "%s: header: bad magic %02x %02x %02x %02x (expected 'GGUF': not a GGUF "
                    "file)",
                    c->label, m[0], m[1], m[2], m[3]);
    c->pos = 4;
    uint32_t version = 0;
    KVCAP_TRY(take_u32(c, "version", &version));
    KVCAP_RETURN_IF(version == 1 || version == 2, KVCAP_ERR_VERSION,
                    "%s: header: version %u is not supported (kvcap reads GGUF version 3; "
                    "convert the file with a current llama.cpp)",
                    c->label, version);
    KVCAP_RETURN_IF(version != GGUF_VERSION && (version & 0xffffu) == 0, KVCAP_ERR_VERSION,
                    "%s: header: version 0x%08x: a big-endian GGUF file? (kvcap reads "
                    "little-endian GGUF version 3)",
                    c->label, version);
    KVCAP_RETURN_IF(version != GGUF_VERSION, KVCAP_ERR_VERSION,
                    "%s: header: version %u is not supported (kvcap reads GGUF version 3)",
                    c->label, version);
    KVCAP_TRY(take_u64(c, "n_tensors", n_tensors));
    KVCAP_TRY(take_u64(c, "n_kv", n_kv));
    uint64_t rest = left(c);
    KVCAP_RETURN_IF(*n_kv > rest / MIN_KV_BYTES, KVCAP_ERR_FORMAT,
                    "%s: header: n_kv %llu cannot fit in the %llu bytes after the header (each "
                    "key/value takes at least %u)",
                    c->label, (unsigned long long)*n_kv, (unsigned long long)rest, MIN_KV_BYTES);
    rest -= *n_kv * MIN_KV_BYTES;
    KVCAP_RETURN_IF(*n_tensors > rest / MIN_TENSOR_INFO_BYTES, KVCAP_ERR_FORMAT,
                    "%s: header: n_tensors %llu cannot fit in the %llu bytes after the header "
                    "and %llu key/values (each tensor info takes at least %u)",
                    c->label, (unsigned long long)*n_tensors, (unsigned long long)left(c),
                    (unsigned long long)*n_kv, MIN_TENSOR_INFO_BYTES);
    return KVCAP_OK;
}

/* The value of a key/value, after its type field. */
static enum kvcap_status parse_value(struct kvgguf_file *f, struct cursor *c, struct kv *kv)
{
    KVCAP_RETURN_IF(kv->type >= N_VALUE_TYPES, KVCAP_ERR_FORMAT,
                    "%s: %s: invalid value type %u (GGUF has 0..12)", c->label, c->where,
                    kv->type);
    if (kv->type == KVGGUF_STRING) {
        struct kvgguf_str s = {0};
        KVCAP_TRY(take_string(c, "string value", &s));
        kv->val = (const unsigned char *)s.s;
        kv->n = s.n;
        return KVCAP_OK;
    }
    uint32_t et = kv->type;
    uint64_t n = 1;
    if (kv->type == KVGGUF_ARRAY) {
        KVCAP_TRY(take_u32(c, "array element type", &et));
        KVCAP_RETURN_IF(et == KVGGUF_ARRAY, KVCAP_ERR_FORMAT,
                        "%s: %s: array of arrays (nested arrays are not supported)", c->label,
                        c->where);
        KVCAP_RETURN_IF(et >= N_VALUE_TYPES, KVCAP_ERR_FORMAT,
                        "%s: %s: invalid array element type %u (GGUF has 0..12)", c->label,
                        c->where, et);
        KVCAP_TRY(take_u64(c, "array count", &n));
        kv->elem_type = et;
        kv->n = n;
    }
    kv->val = c->base + c->pos;

    if (et == KVGGUF_STRING) {
        /* Each element is at least its 8-byte length: bound the count before indexing. */
        KVCAP_RETURN_IF(n > left(c) / 8, KVCAP_ERR_FORMAT,
                        "%s: %s: array of %llu strings cannot fit in the %llu bytes left at "
                        "offset %llu",
                        c->label, c->where, (unsigned long long)n, (unsigned long long)left(c),
                        (unsigned long long)c->pos);
        size_t need;
        KVCAP_RETURN_IF(!kvcap_add_size(f->n_strs, (size_t)n, &need) ||
                            !grow((void **)&f->strs, &f->cap_strs, need, sizeof *f->strs),
                        KVCAP_ERR_OUT_OF_MEMORY, "%s: %s: out of memory indexing %llu strings",
                        c->label, c->where, (unsigned long long)n);
        kv->first_str = f->n_strs;
        char field[48];
        for (uint64_t i = 0; i < n; i++) {
            snprintf(field, sizeof field, "string [%llu]", (unsigned long long)i);
            KVCAP_TRY(take_string(c, field, &f->strs[f->n_strs + i]));
        }
        f->n_strs = need;
        return KVCAP_OK;
    }

    uint64_t es = value_type_size[et];
    if (n > left(c) / es) {
        if (kv->type != KVGGUF_ARRAY)
            return cut_off(c, "value", es);
        return kvcap_fail(KVCAP_ERR_FORMAT,
                          "%s: %s: array of %llu %s values (%u bytes each) runs past the end of "
                          "the file (%llu bytes left at offset %llu)",
                          c->label, c->where, (unsigned long long)n, value_type_name(et),
                          (unsigned)es, (unsigned long long)left(c), (unsigned long long)c->pos);
    }
    for (uint64_t i = 0; et == KVGGUF_BOOL && i < n; i++) {
        unsigned b = c->base[c->pos + i];
        KVCAP_RETURN_IF(b > 1, KVCAP_ERR_FORMAT, "%s: %s: bool%s value %u is neither 0 nor 1",
                        c->label, c->where, kv->type == KVGGUF_ARRAY ? " array element" : "",
                        b);
    }
    c->pos += n * es;
    return KVCAP_OK;
}

static enum kvcap_status parse_kv(struct kvgguf_file *f, struct cursor *c, uint64_t i,
                                  uint64_t n_kv)
{
    snprintf(c->where, sizeof c->where, "key/value %llu (of %llu)", (unsigned long long)i,
             (unsigned long long)n_kv);
    KVCAP_RETURN_IF(!grow((void **)&f->kvs, &f->cap_kv, f->n_kv + 1, sizeof *f->kvs),
                    KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory reading %s", c->label, c->where);
    struct kv *kv = &f->kvs[f->n_kv];
    memset(kv, 0, sizeof *kv);
    KVCAP_TRY(take_name(c, "key", &f->key_text, &kv->key_at));
    snprintf(c->where, sizeof c->where, "key '%.*s'", NAME_IN_MESSAGE,
             f->key_text.p + kv->key_at);
    KVCAP_TRY(take_u32(c, "value type", &kv->type));
    KVCAP_TRY(parse_value(f, c, kv));
    f->n_kv++;
    return KVCAP_OK;
}

static int cmp_kv_key(const void *a, const void *b)
{
    return strcmp((*(const struct kv *const *)a)->key, (*(const struct kv *const *)b)->key);
}

static const struct kv *find_kv(const struct kvgguf_file *f, const char *key)
{
    if (!f || !key || f->n_kv == 0)
        return NULL;
    struct kv probe = {.key = key};
    const struct kv *pp = &probe, *const *hit =
        bsearch(&pp, f->kv_by_key, f->n_kv, sizeof *f->kv_by_key, cmp_kv_key);
    return hit ? *hit : NULL;
}

/* Once every key is read: the key index (sorted, unique) and the alignment it sets. */
static enum kvcap_status index_keys(struct kvgguf_file *f, const struct cursor *c)
{
    f->kv_by_key = malloc((f->n_kv ? f->n_kv : 1) * sizeof *f->kv_by_key);
    KVCAP_RETURN_IF(!f->kv_by_key, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory indexing keys",
                    c->label);
    for (size_t i = 0; i < f->n_kv; i++) {
        f->kvs[i].key = f->key_text.p + f->kvs[i].key_at;
        f->kv_by_key[i] = &f->kvs[i];
    }
    qsort(f->kv_by_key, f->n_kv, sizeof *f->kv_by_key, cmp_kv_key);
    for (size_t i = 1; i < f->n_kv; i++)
        KVCAP_RETURN_IF(strcmp(f->kv_by_key[i - 1]->key, f->kv_by_key[i]->key) == 0,
                        KVCAP_ERR_FORMAT, "%s: key '%.*s': duplicate key", c->label,
                        NAME_IN_MESSAGE, f->kv_by_key[i]->key);

    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const struct kv *al = find_kv(f, ALIGNMENT_KEY);
    if (al) {
        KVCAP_RETURN_IF(al->type != KVGGUF_UINT32, KVCAP_ERR_FORMAT,
                        "%s: key '" ALIGNMENT_KEY "': type is %s, must be uint32", c->label,
                        value_type_name(al->type));
        uint32_t a = rd32(al->val);
        KVCAP_RETURN_IF(a == 0 || (a & (a - 1)) != 0, KVCAP_ERR_FORMAT,
                        "%s: key '" ALIGNMENT_KEY "': %u is not a power of two", c->label, a);
        f->alignment = a;
    }
    return KVCAP_OK;
}

/* Formats ne as "[576, 49152]" into buf. */
static const char *ne_str(char *buf, size_t cap, int n_dims, const int64_t *ne)
{
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < n_dims && used < cap; i++) {
        int w = snprintf(buf + used, cap - used, "%s%lld", i ? ", " : "[", (long long)ne[i]);
        if (w < 0)
            break;
        used += (size_t)w;
    }
    if (used < cap)
        snprintf(buf + used, cap - used, "]");
    return buf;
}

/* One tensor info: name, dims, type (with its extent) and offset. */
static enum kvcap_status parse_tensor_info(struct kvgguf_file *f, struct cursor *c, uint64_t i,
                                           uint64_t n_tensors)
{
    snprintf(c->where, sizeof c->where, "tensor %llu (of %llu)", (unsigned long long)i,
             (unsigned long long)n_tensors);
    KVCAP_RETURN_IF(
        !grow((void **)&f->tensors, &f->cap_tensors, f->n_tensors + 1, sizeof *f->tensors) ||
            !grow((void **)&f->pending, &f->cap_pending, f->n_tensors + 1, sizeof *f->pending),
        KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory reading %s", c->label, c->where);
    struct kvgguf_tensor *t = &f->tensors[f->n_tensors];
    struct pending *p = &f->pending[f->n_tensors];
    memset(t, 0, sizeof *t);
    memset(p, 0, sizeof *p);
    KVCAP_TRY(take_name(c, "name", &f->name_text, &p->name_at));
    f->n_tensors++;
    snprintf(c->where, sizeof c->where, "tensor '%.*s'", NAME_IN_MESSAGE,
             f->name_text.p + p->name_at);

    uint32_t n_dims = 0;
    KVCAP_TRY(take_u32(c, "n_dims", &n_dims));
    KVCAP_RETURN_IF(n_dims < 1 || n_dims > KVGGUF_MAX_DIMS, KVCAP_ERR_FORMAT,
                    "%s: %s: n_dims %u is not in 1..%d", c->label, c->where, n_dims,
                    KVGGUF_MAX_DIMS);
    t->n_dims = (int)n_dims;
    for (int d = 0; d < KVGGUF_MAX_DIMS; d++)
        t->ne[d] = 1;
    uint64_t count = 1;
    char buf[128];
    for (int d = 0; d < t->n_dims; d++) {
        char field[16];
        snprintf(field, sizeof field, "ne[%d]", d);
        uint64_t v = 0;
        KVCAP_TRY(take_u64(c, field, &v));
        KVCAP_RETURN_IF(v == 0 || v > INT64_MAX, KVCAP_ERR_FORMAT,
                        "%s: %s: ne[%d] = %llu is not in 1..2^63-1", c->label, c->where, d,
                        (unsigned long long)v);
        t->ne[d] = (int64_t)v;
        KVCAP_RETURN_IF(__builtin_mul_overflow(count, v, &count) || count > INT64_MAX,
                        KVCAP_ERR_FORMAT, "%s: %s: ne %s has 2^63 or more elements", c->label,
                        c->where, ne_str(buf, sizeof buf, d + 1, t->ne));
    }
    t->n_elements = count;

    KVCAP_TRY(take_u32(c, "type", &t->type));
    const struct ggml_type_info *ti = ggml_type(t->type);
    KVCAP_RETURN_IF(!ti, KVCAP_ERR_FORMAT,
                    "%s: %s: unknown ggml type %u (retired or not assigned)", c->label,
                    c->where, t->type);
    KVCAP_RETURN_IF((uint64_t)t->ne[0] % ti->block != 0, KVCAP_ERR_FORMAT,
                    "%s: %s: ne[0] = %lld is not a multiple of the %s block size %u", c->label,
                    c->where, (long long)t->ne[0], ti->name, ti->block);
    /* Whole blocks, since ne[0] is a multiple of the block. */
    KVCAP_RETURN_IF(__builtin_mul_overflow(count / ti->block, (uint64_t)ti->bytes, &t->nbytes),
                    KVCAP_ERR_FORMAT, "%s: %s: ne %s of %s overflows 64 bits of bytes",
                    c->label, c->where, ne_str(buf, sizeof buf, t->n_dims, t->ne), ti->name);

    KVCAP_TRY(take_u64(c, "offset", &p->offset));
    KVCAP_RETURN_IF(p->offset % f->alignment != 0, KVCAP_ERR_FORMAT,
                    "%s: %s: offset %llu is not a multiple of the alignment %u", c->label,
                    c->where, (unsigned long long)p->offset, f->alignment);
    return KVCAP_OK;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp((*(const struct kvgguf_tensor *const *)a)->name,
                  (*(const struct kvgguf_tensor *const *)b)->name);
}

static int cmp_tensor_data(const void *a, const void *b)
{
    const struct kvgguf_tensor *x = *(const struct kvgguf_tensor *const *)a;
    const struct kvgguf_tensor *y = *(const struct kvgguf_tensor *const *)b;
    if (x->data != y->data)
        return (const unsigned char *)x->data < (const unsigned char *)y->data ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* After the last info: names and data pointers, every tensor inside the file, none sharing
 * a byte with another, names unique; leaves tensor_by_name sorted by name. */
static enum kvcap_status place_tensors(struct kvgguf_file *f, const struct cursor *c)
{
    /* The data section starts at the next multiple of the alignment (pos <= size < 2^63). */
    f->data_offset = (c->pos + f->alignment - 1) / f->alignment * f->alignment;
    KVCAP_RETURN_IF(f->n_tensors && f->data_offset > c->size, KVCAP_ERR_FORMAT,
                    "%s: data section: starts at offset %llu (after padding to %u), past the "
                    "end of the file (%llu bytes)",
                    c->label, (unsigned long long)f->data_offset, f->alignment,
                    (unsigned long long)c->size);
    uint64_t data_size = f->n_tensors ? c->size - f->data_offset : 0;
    for (size_t i = 0; i < f->n_tensors; i++) {
        struct kvgguf_tensor *t = &f->tensors[i];
        uint64_t off = f->pending[i].offset;
        t->name = f->name_text.p + f->pending[i].name_at;
        KVCAP_RETURN_IF(off > data_size || t->nbytes > data_size - off, KVCAP_ERR_FORMAT,
                        "%s: tensor '%.*s': data at offset %llu + %llu bytes extends past the "
                        "end of the file (the data section holds %llu bytes)",
                        c->label, NAME_IN_MESSAGE, t->name, (unsigned long long)off,
                        (unsigned long long)t->nbytes, (unsigned long long)data_size);
        t->data = c->base + f->data_offset + off;
    }

    f->tensor_by_name = malloc((f->n_tensors ? f->n_tensors : 1) * sizeof *f->tensor_by_name);
    KVCAP_RETURN_IF(!f->tensor_by_name, KVCAP_ERR_OUT_OF_MEMORY,
                    "%s: out of memory indexing tensors", c->label);
    for (size_t i = 0; i < f->n_tensors; i++)
        f->tensor_by_name[i] = &f->tensors[i];

    /* Sorted by start, each tensor must end at or before the next one's start. */
    qsort(f->tensor_by_name, f->n_tensors, sizeof *f->tensor_by_name, cmp_tensor_data);
    const unsigned char *data = c->base + f->data_offset;
    for (size_t i = 1; i < f->n_tensors; i++) {
        const struct kvgguf_tensor *a = f->tensor_by_name[i - 1], *b = f->tensor_by_name[i];
        uint64_t a_begin = (uint64_t)((const unsigned char *)a->data - data);
        uint64_t b_begin = (uint64_t)((const unsigned char *)b->data - data);
        KVCAP_RETURN_IF(a_begin + a->nbytes > b_begin, KVCAP_ERR_FORMAT,
                        "%s: tensor '%.*s': data [%llu, %llu) overlaps tensor '%.*s' [%llu, "
                        "%llu)",
                        c->label, NAME_IN_MESSAGE, b->name, (unsigned long long)b_begin,
                        (unsigned long long)(b_begin + b->nbytes), NAME_IN_MESSAGE, a->name,
                        (unsigned long long)a_begin, (unsigned long long)(a_begin + a->nbytes));
    }
    qsort(f->tensor_by_name, f->n_tensors, sizeof *f->tensor_by_name, cmp_tensor_name);
    for (size_t i = 1; i < f->n_tensors; i++)
        KVCAP_RETURN_IF(strcmp(f->tensor_by_name[i - 1]->name, f->tensor_by_name[i]->name) == 0,
                        KVCAP_ERR_FORMAT, "%s: tensor '%.*s': duplicate tensor name", c->label,
                        NAME_IN_MESSAGE, f->tensor_by_name[i]->name);
    return KVCAP_OK;
}

static enum kvcap_status parse_header(struct kvgguf_file *f, struct cursor *c)
{
    uint64_t n_tensors = 0, n_kv = 0;
    KVCAP_TRY(parse_preamble(c, &n_tensors, &n_kv));
    for (uint64_t i = 0; i < n_kv; i++)
        KVCAP_TRY(parse_kv(f, c, i, n_kv));
    KVCAP_TRY(index_keys(f, c)); /* the alignment is needed for the tensor offsets */
    for (uint64_t i = 0; i < n_tensors; i++)
        KVCAP_TRY(parse_tensor_info(f, c, i, n_tensors));
    return place_tensors(f, c);
}

static void free_index(struct kvgguf_file *f)
{
    free(f->path);
    free(f->kvs);
    free(f->kv_by_key);
    free(f->key_text.p);
    free(f->tensors);
    free(f->pending);
    free(f->tensor_by_name);
    free(f->name_text.p);
    free(f->strs);
    free(f);
}

/* Validates and indexes `size` bytes at `base`. On success *out owns everything except the
 * bytes (the caller sets map/map_size when it owns a mapping). */
static enum kvcap_status parse_file(const unsigned char *base, uint64_t size, const char *label,
                                    struct kvgguf_file **out)
{
    *out = NULL;
    struct kvgguf_file *f = calloc(1, sizeof *f);
    size_t len = strlen(label) + 1;
    char *path = malloc(len);
    if (!f || !path) {
        free(f);
        free(path);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", label);
    }
    memcpy(path, label, len);
    f->path = path;
    f->base = base;
    f->size = size;
    struct cursor c = {.base = base, .size = size, .pos = 0, .label = label};
    enum kvcap_status st = parse_header(f, &c);
    if (st != KVCAP_OK) {
        free_index(f);
        return st;
    }
    free(f->pending);
    f->pending = NULL;
    *out = f;
    return KVCAP_OK;
}

enum kvcap_status kvgguf_open_memory(const void *bytes, size_t size, const char *label,
                                     struct kvgguf_file **out)
{
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "kvgguf_open_memory: out is NULL");
    *out = NULL;
    if (!label)
        label = "(memory)";
    KVCAP_RETURN_IF(!bytes && size, KVCAP_ERR_INVALID_ARGUMENT, "%s: NULL buffer of %zu bytes",
                    label, size);
    static const unsigned char nothing[1];
    return parse_file(bytes ? bytes : nothing, size, label, out);
}

enum kvcap_status kvgguf_open(const char *path, struct kvgguf_file **out)
{
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "kvgguf_open: out is NULL");
    *out = NULL;
    KVCAP_RETURN_IF(!path || !*path, KVCAP_ERR_INVALID_ARGUMENT, "kvgguf_open: empty path");
    void *map;
    size_t size;
    KVCAP_TRY(kvcap_map_file(path, 4, "too short for the magic (not a GGUF file)", &map, &size));
    struct kvgguf_file *f;
    enum kvcap_status st = parse_file(map, size, path, &f);
    if (st != KVCAP_OK) {
        munmap(map, size);
        return st;
    }
    f->map = map;
    f->map_size = size;
    *out = f;
    return KVCAP_OK;
}

void kvgguf_close(struct kvgguf_file *f)
{
    if (!f)
        return;
    if (f->map)
        munmap(f->map, f->map_size);
    free_index(f);
}

const char *kvgguf_path(const struct kvgguf_file *f)
{
    return f ? f->path : NULL;
}

/* ---- Metadata --------------------------------------------------------------------------- */

int kvgguf_has(const struct kvgguf_file *f, const char *key)
{
    return find_kv(f, key) != NULL;
}

size_t kvgguf_kv_count(const struct kvgguf_file *f)
{
    return f ? f->n_kv : 0;
}

const char *kvgguf_kv_key(const struct kvgguf_file *f, size_t i, enum kvgguf_type *type)
{
    if (!f || i >= f->n_kv)
        return NULL;
    if (type)
        *type = (enum kvgguf_type)f->kvs[i].type;
    return f->kvs[i].key;
}

/* The key/value a getter asks for: NOT_FOUND naming the key when absent. */
static enum kvcap_status lookup(const struct kvgguf_file *f, const char *key, const char *fn,
                                const struct kv **out)
{
    KVCAP_RETURN_IF(!f || !key, KVCAP_ERR_INVALID_ARGUMENT, "%s: NULL %s", fn,
                    !f ? "file" : "key");
    *out = find_kv(f, key);
    KVCAP_RETURN_IF(!*out, KVCAP_ERR_NOT_FOUND, "%s: key '%.*s' is absent", f->path,
                    NAME_IN_MESSAGE, key);
    return KVCAP_OK;
}

static enum kvcap_status wrong_type(const struct kvgguf_file *f, const struct kv *kv,
                                    const char *want)
{
    if (kv->type == KVGGUF_ARRAY)
        return kvcap_fail(KVCAP_ERR_FORMAT, "%s: key '%.*s': type is array of %s, expected %s",
                          f->path, NAME_IN_MESSAGE, kv->key, value_type_name(kv->elem_type),
                          want);
    return kvcap_fail(KVCAP_ERR_FORMAT, "%s: key '%.*s': type is %s, expected %s", f->path,
                      NAME_IN_MESSAGE, kv->key, value_type_name(kv->type), want);
}

/* One integer element (type t at p) widened: *neg set for negative values, *mag the
 * magnitude as uint64 (exact for every integer type). */
static void read_int(uint32_t t, const unsigned char *p, int *neg, uint64_t *mag)
{
    int64_t s = 0;
    *neg = 0;
    switch (t) {
    case KVGGUF_UINT8: *mag = p[0]; return;
    case KVGGUF_UINT16: *mag = rd16(p); return;
    case KVGGUF_UINT32: *mag = rd32(p); return;
    case KVGGUF_UINT64: *mag = rd64(p); return;
    case KVGGUF_INT8: s = (int8_t)p[0]; break;
    case KVGGUF_INT16: s = (int16_t)rd16(p); break;
    case KVGGUF_INT32: s = (int32_t)rd32(p); break;
    default: s = (int64_t)rd64(p); break; /* INT64 */
    }
    *neg = s < 0;
    *mag = s < 0 ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
}

/* Fits (neg, mag) into [min, max] (min as a magnitude below zero); writes the value. */
static int fit_int(int neg, uint64_t mag, uint64_t neg_limit, uint64_t max, int64_t *v)
{
    if (neg) {
        if (mag > neg_limit)
            return 0;
        *v = mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)mag;
        return 1;
    }
    if (mag > max)
        return 0;
    *v = (int64_t)mag; /* max <= INT64_MAX for every caller */
    return 1;
}

static const char *int_str(char *buf, size_t cap, int neg, uint64_t mag)
{
    snprintf(buf, cap, "%s%llu", neg ? "-" : "", (unsigned long long)mag);
    return buf;
}

/* The integer value of `key` if it lies in [-neg_limit, max]; `op` and `target` (the C type)
 * name the getter in errors. */
static enum kvcap_status get_int(const struct kvgguf_file *f, const char *key, const char *op,
                                 uint64_t neg_limit, uint64_t max, const char *target,
                                 int64_t *out)
{
    const struct kv *kv;
    KVCAP_TRY(lookup(f, key, op, &kv));
    if (!is_integer_type(kv->type))
        return wrong_type(f, kv, "an integer");
    int neg;
    uint64_t mag;
    char buf[32];
    read_int(kv->type, kv->val, &neg, &mag);
    KVCAP_RETURN_IF(!fit_int(neg, mag, neg_limit, max, out), KVCAP_ERR_FORMAT,
                    "%s: key '%.*s': %s value %s does not fit in %s", f->path, NAME_IN_MESSAGE,
                    kv->key, value_type_name(kv->type), int_str(buf, sizeof buf, neg, mag),
                    target);
    return KVCAP_OK;
}

enum kvcap_status kvgguf_get_u32(const struct kvgguf_file *f, const char *key, uint32_t *out)
{
    int64_t v = 0;
    KVCAP_TRY(get_int(f, key, "kvgguf_get_u32", 0, UINT32_MAX, "uint32", &v));
    if (out)
        *out = (uint32_t)v;
    return KVCAP_OK;
}

enum kvcap_status kvgguf_get_i64(const struct kvgguf_file *f, const char *key, int64_t *out)
{
    int64_t v = 0;
    KVCAP_TRY(get_int(f, key, "kvgguf_get_i64", (uint64_t)INT64_MAX + 1, INT64_MAX, "int64", &v));
    if (out)
        *out = v;
    return KVCAP_OK;
}

static float read_f32(const unsigned char *p)
{
    uint32_t u = rd32(p);
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static double read_f64(const unsigned char *p)
{
    uint64_t u = rd64(p);
    double x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* A float64 narrowed to float: 0 when finite but beyond the float range. */
static int narrow_f64(double d, float *out)
{
    if (isfinite(d) && fabs(d) > (double)FLT_MAX)
        return 0;
    *out = (float)d;
    return 1;
}

enum kvcap_status kvgguf_get_f32(const struct kvgguf_file *f, const char *key, float *out)
{
    const struct kv *kv;
    KVCAP_TRY(lookup(f, key, "kvgguf_get_f32", &kv));
    float v;
    if (kv->type == KVGGUF_FLOAT32) {
        v = read_f32(kv->val);
    } else if (kv->type == KVGGUF_FLOAT64) {
        double d = read_f64(kv->val);
        KVCAP_RETURN_IF(!narrow_f64(d, &v), KVCAP_ERR_FORMAT,
                        "%s: key '%.*s': float64 value %g does not fit in float32", f->path,
                        NAME_IN_MESSAGE, kv->key, d);
    } else {
        return wrong_type(f, kv, "float32 or float64");
    }
    if (out)
        *out = v;
    return KVCAP_OK;
}

enum kvcap_status kvgguf_get_bool(const struct kvgguf_file *f, const char *key, int *out)
{
    const struct kv *kv;
    KVCAP_TRY(lookup(f, key, "kvgguf_get_bool", &kv));
    if (kv->type != KVGGUF_BOOL)
        return wrong_type(f, kv, "bool");
    if (out)
        *out = kv->val[0]; /* 0 or 1, checked at open */
    return KVCAP_OK;
}

enum kvcap_status kvgguf_get_str(const struct kvgguf_file *f, const char *key,
                                 struct kvgguf_str *out)
{
    const struct kv *kv;
    KVCAP_TRY(lookup(f, key, "kvgguf_get_str", &kv));
    if (kv->type != KVGGUF_STRING)
        return wrong_type(f, kv, "string");
    if (out) {
        out->s = (const char *)kv->val;
        out->n = kv->n;
    }
    return KVCAP_OK;
}

enum kvcap_status kvgguf_get_array(const struct kvgguf_file *f, const char *key,
                                   enum kvgguf_type *elem_type, uint64_t *n)
{
    const struct kv *kv;
    KVCAP_TRY(lookup(f, key, "kvgguf_get_array", &kv));
    if (kv->type != KVGGUF_ARRAY)
        return wrong_type(f, kv, "an array");
    if (elem_type)
        *elem_type = (enum kvgguf_type)kv->elem_type;
    if (n)
        *n = kv->n;
    return KVCAP_OK;
}

/* An array whose elements the caller converts: wrong type unless `ok(elem_type)`. */
static enum kvcap_status lookup_array(const struct kvgguf_file *f, const char *key,
                                      const char *fn, int (*ok)(uint32_t), const char *want,
                                      const struct kv **out)
{
    KVCAP_TRY(lookup(f, key, fn, out));
    const struct kv *kv = *out;
    if (kv->type != KVGGUF_ARRAY || !ok(kv->elem_type))
        return wrong_type(f, kv, want);
    return KVCAP_OK;
}

static int is_string_type(uint32_t t)
{
    return t == KVGGUF_STRING;
}

static int is_float_type(uint32_t t)
{
    return t == KVGGUF_FLOAT32 || t == KVGGUF_FLOAT64;
}

enum kvcap_status kvgguf_array_str(const struct kvgguf_file *f, const char *key, uint64_t i,
                                   struct kvgguf_str *out)
{
    const struct kv *kv;
    KVCAP_TRY(lookup_array(f, key, "kvgguf_array_str", is_string_type, "array of string", &kv));
    KVCAP_RETURN_IF(i >= kv->n, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: key '%.*s': index %llu is past the %llu strings of the array", f->path,
                    NAME_IN_MESSAGE, kv->key, (unsigned long long)i, (unsigned long long)kv->n);
    if (out)
        *out = f->strs[kv->first_str + (size_t)i];
    return KVCAP_OK;
}

static enum kvcap_status check_count(const struct kvgguf_file *f, const struct kv *kv,
                                     uint64_t n, const void *out)
{
    KVCAP_RETURN_IF(n != kv->n, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: key '%.*s': the array has %llu elements, the caller asked for %llu",
                    f->path, NAME_IN_MESSAGE, kv->key, (unsigned long long)kv->n,
                    (unsigned long long)n);
    KVCAP_RETURN_IF(n && !out, KVCAP_ERR_INVALID_ARGUMENT, "%s: key '%.*s': NULL output",
                    f->path, NAME_IN_MESSAGE, kv->key);
    return KVCAP_OK;
}

enum kvcap_status kvgguf_array_i32(const struct kvgguf_file *f, const char *key, int32_t *out,
                                   uint64_t n)
{
    const struct kv *kv;
    KVCAP_TRY(lookup_array(f, key, "kvgguf_array_i32", is_integer_type,
                           "array of an integer type", &kv));
    KVCAP_TRY(check_count(f, kv, n, out));
    size_t es = value_type_size[kv->elem_type];
    for (uint64_t i = 0; i < n; i++) {
        int neg;
        uint64_t mag;
        int64_t v;
        char buf[32];
        read_int(kv->elem_type, kv->val + i * es, &neg, &mag);
        KVCAP_RETURN_IF(!fit_int(neg, mag, (uint64_t)INT32_MAX + 1, INT32_MAX, &v),
                        KVCAP_ERR_FORMAT,
                        "%s: key '%.*s': element %llu (%s %s) does not fit in int32", f->path,
                        NAME_IN_MESSAGE, kv->key, (unsigned long long)i,
                        value_type_name(kv->elem_type), int_str(buf, sizeof buf, neg, mag));
        out[i] = (int32_t)v;
    }
    return KVCAP_OK;
}

enum kvcap_status kvgguf_array_f32(const struct kvgguf_file *f, const char *key, float *out,
                                   uint64_t n)
{
    const struct kv *kv;
    KVCAP_TRY(lookup_array(f, key, "kvgguf_array_f32", is_float_type,
                           "array of float32 or float64", &kv));
    KVCAP_TRY(check_count(f, kv, n, out));
    for (uint64_t i = 0; i < n; i++) {
        if (kv->elem_type == KVGGUF_FLOAT32) {
            out[i] = read_f32(kv->val + 4 * i);
            continue;
        }
        double d = read_f64(kv->val + 8 * i);
        KVCAP_RETURN_IF(!narrow_f64(d, &out[i]), KVCAP_ERR_FORMAT,
                        "%s: key '%.*s': element %llu (float64 %g) does not fit in float32",
                        f->path, NAME_IN_MESSAGE, kv->key, (unsigned long long)i, d);
    }
    return KVCAP_OK;
}

/* ---- Tensors ---------------------------------------------------------------------------- */

size_t kvgguf_tensor_count(const struct kvgguf_file *f)
{
    return f ? f->n_tensors : 0;
}

const struct kvgguf_tensor *kvgguf_tensor_at(const struct kvgguf_file *f, size_t i)
{
    return f && i < f->n_tensors ? &f->tensors[i] : NULL;
}

const struct kvgguf_tensor *kvgguf_tensor_find(const struct kvgguf_file *f, const char *name)
{
    if (!f || !name || f->n_tensors == 0)
        return NULL;
    struct kvgguf_tensor probe = {.name = name};
    const struct kvgguf_tensor *pp = &probe, *const *hit =
        bsearch(&pp, f->tensor_by_name, f->n_tensors, sizeof *f->tensor_by_name, cmp_tensor_name);
    return hit ? *hit : NULL;
}

/* ---- Dequantisation (ggml-quants.c, dequantize_row_*) ----------------------------------- */

/* Q4_0: 32 weights = f16 d, 16 bytes of nibbles; low nibbles are weights 0..15, high 16..31. */
static void dequant_q4_0(const unsigned char *b, size_t n_blocks, float *y)
{
    for (size_t i = 0; i < n_blocks; i++, b += 18, y += 32) {
        const float d = kvcap_f16_to_f32(rd16(b));
        const unsigned char *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((qs[j] & 0x0F) - 8) * d;
            y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
        }
    }
}

/* Q4_1: f16 d, f16 m, 16 bytes of nibbles; x = q*d + m. */
static void dequant_q4_1(const unsigned char *b, size_t n_blocks, float *y)
{
    for (size_t i = 0; i < n_blocks; i++, b += 20, y += 32) {
        const float d = kvcap_f16_to_f32(rd16(b));
        const float m = kvcap_f16_to_f32(rd16(b + 2));
        const unsigned char *qs = b + 4;
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(qs[j] & 0x0F) * d + m;
            y[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
    }
}

/* Q5_0: f16 d, uint32 qh (bit j is the fifth bit of weight j), 16 bytes of nibbles. */
static void dequant_q5_0(const unsigned char *b, size_t n_blocks, float *y)
{
    for (size_t i = 0; i < n_blocks; i++, b += 22, y += 32) {
        const float d = kvcap_f16_to_f32(rd16(b));
        const uint32_t qh = rd32(b + 2);
        const unsigned char *qs = b + 6;
        for (int j = 0; j < 16; j++) {
            const int xh_0 = (int)(((qh >> j) << 4) & 0x10);
            const int xh_1 = (int)((qh >> (j + 12)) & 0x10);
            y[j] = (float)(((qs[j] & 0x0F) | xh_0) - 16) * d;
            y[j + 16] = (float)(((qs[j] >> 4) | xh_1) - 16) * d;
        }
    }
}

/* Q5_1: f16 d, f16 m, uint32 qh, 16 bytes of nibbles; x = q*d + m. */
static void dequant_q5_1(const unsigned char *b, size_t n_blocks, float *y)
{
    for (size_t i = 0; i < n_blocks; i++, b += 24, y += 32) {
        const float d = kvcap_f16_to_f32(rd16(b));
        const float m = kvcap_f16_to_f32(rd16(b + 2));
        const uint32_t qh = rd32(b + 4);
        const unsigned char *qs = b + 8;
        for (int j = 0; j < 16; j++) {
            const int xh_0 = (int)(((qh >> j) << 4) & 0x10);
            const int xh_1 = (int)((qh >> (j + 12)) & 0x10);
            y[j] = (float)((qs[j] & 0x0F) | xh_0) * d + m;
            y[j + 16] = (float)((qs[j] >> 4) | xh_1) * d + m;
        }
    }
}

/* Q8_0: f16 d, 32 int8. */
static void dequant_q8_0(const unsigned char *b, size_t n_blocks, float *y)
{
    for (size_t i = 0; i < n_blocks; i++, b += 34, y += 32) {
        const float d = kvcap_f16_to_f32(rd16(b));
        const signed char *qs = (const signed char *)(b + 2);
        for (int j = 0; j < 32; j++)
            y[j] = (float)qs[j] * d;
    }
}

enum kvcap_status kvgguf_dequantize(const struct kvgguf_tensor *t, float *out)
{
    KVCAP_RETURN_IF(!t, KVCAP_ERR_INVALID_ARGUMENT, "kvgguf_dequantize: NULL tensor");
    KVCAP_RETURN_IF(t->n_elements && (!out || !t->data), KVCAP_ERR_INVALID_ARGUMENT,
                    "tensor '%.*s': kvgguf_dequantize: NULL %s", NAME_IN_MESSAGE,
                    t->name ? t->name : "?", !out ? "output" : "data");
    const struct ggml_type_info *ti = ggml_type(t->type);
    KVCAP_RETURN_IF(t->n_elements > SIZE_MAX || (ti && t->n_elements % ti->block != 0),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "tensor '%.*s': %llu elements do not make whole %s blocks", NAME_IN_MESSAGE,
                    t->name ? t->name : "?", (unsigned long long)t->n_elements,
                    kvgguf_type_name(t->type));
    size_t n = (size_t)t->n_elements;
    const unsigned char *b = t->data;
    switch (t->type) {
    case KVGGUF_T_F32: return kvcap_convert_to_f32(KVCAP_DTYPE_F32, b, n, out);
    case KVGGUF_T_F16: return kvcap_convert_to_f32(KVCAP_DTYPE_F16, b, n, out);
    case KVGGUF_T_BF16: return kvcap_convert_to_f32(KVCAP_DTYPE_BF16, b, n, out);
    case KVGGUF_T_Q4_0: dequant_q4_0(b, n / 32, out); return KVCAP_OK;
    case KVGGUF_T_Q4_1: dequant_q4_1(b, n / 32, out); return KVCAP_OK;
    case KVGGUF_T_Q5_0: dequant_q5_0(b, n / 32, out); return KVCAP_OK;
    case KVGGUF_T_Q5_1: dequant_q5_1(b, n / 32, out); return KVCAP_OK;
    case KVGGUF_T_Q8_0: dequant_q8_0(b, n / 32, out); return KVCAP_OK;
    default:
        return kvcap_fail(KVCAP_ERR_UNSUPPORTED,
                          "tensor '%.*s': cannot dequantise type %s (%u); kvcap reads F32 F16 "
                          "BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0",
                          NAME_IN_MESSAGE, t->name ? t->name : "?", kvgguf_type_name(t->type),
                          t->type);
    }
}
