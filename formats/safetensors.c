/* safetensors.c — the container layer of formats/SPEC.md §1: a reader that treats every file as
 * hostile (each rule checked, the field at fault named) and hands out zero-copy views into a
 * read-only mapping, and a writer that lays tensors out aligned and replaces files atomically. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/internal.h"
#include "formats/safetensors.h"

/* JSON numbers reach us as doubles: every integer up to 2^53 - 1 is exact, larger ones may
 * have been rounded, so both the reader and the writer refuse them. */
#define KVST_MAX_JSON_INT 9007199254740991.0 /* 2^53 - 1 */
#define KVST_MAX_JSON_INT_U64 UINT64_C(9007199254740991)

#define META_KEY "__metadata__"

/* ---- Shared helpers --------------------------------------------------------------------- */

/* Strict, case-sensitive: the safetensors names only ("f32" is not a dtype in a file). */
static int dtype_from_file_name(const char *s, enum kvcap_dtype *out)
{
    static const enum kvcap_dtype all[] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16, KVCAP_DTYPE_BF16,
                                           KVCAP_DTYPE_F64, KVCAP_DTYPE_I32, KVCAP_DTYPE_U8};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        if (strcmp(s, kvcap_dtype_name(all[i])) == 0) {
            *out = all[i];
            return 1;
        }
    }
    return 0;
}

static int utf8_valid(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        size_t l = kvcap_utf8_seq_len(p + i, n - i);
        if (!l)
            return 0;
        i += l;
    }
    return 1;
}

/* Formats a shape as "[2, 3]" into buf (truncated safely). */
static const char *shape_str(char *buf, size_t cap, int ndim, const int64_t *shape)
{
    size_t used = 0;
    int w = snprintf(buf, cap, "[");
    used = w > 0 ? (size_t)w : 0;
    for (int i = 0; i < ndim && used < cap; i++) {
        w = snprintf(buf + used, cap - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
        if (w < 0)
            break;
        used += (size_t)w;
    }
    if (used < cap)
        snprintf(buf + used, cap - used, "]");
    return buf;
}

/* ---- Reader ----------------------------------------------------------------------------- */

struct kvst_meta_entry {
    const char *key;
    const char *value;
};

struct kvst_file {
    const char *path;          /* in the same block */
    const unsigned char *base; /* whole file: mapping or caller buffer */
    uint64_t size;
    void *map;                 /* non-NULL when we own a mapping of map_size bytes */
    size_t map_size;
    uint64_t header_size;
    size_t n_tensors;
    struct kvst_tensor *tensors; /* in the same block, sorted by name */
    size_t n_meta;
    struct kvst_meta_entry *meta; /* in the same block, sorted by key */
    void *copies;                 /* aligned private copies of misaligned tensors, or NULL */
};

/* A zero-byte tensor whose place in the file is misaligned points here instead. */
static const uint64_t empty_anchor[1];

/* Checks the header bytes before cJSON sees them, because cJSON is lenient where the
 * reference implementation is not: it accepts any byte <= 0x20 as whitespace, raw control
 * characters inside strings, invalid UTF-8, and "\u0000" (which would silently truncate a
 * name). Only the lexical level is checked here; the structure is cJSON's job. */
static enum kvcap_status check_header_text(const char *label, const unsigned char *h, size_t n)
{
    int in_string = 0;
    for (size_t i = 0; i < n;) {
        unsigned c = h[i];
        if (c >= 0x80) {
            size_t l = kvcap_utf8_seq_len(h + i, n - i);
            KVCAP_RETURN_IF(!l, KVCAP_ERR_FORMAT,
                            "%s: header: byte %zu (0x%02x) is not valid UTF-8", label, i, c);
            i += l;
            continue;
        }
        if (in_string) {
            KVCAP_RETURN_IF(c < 0x20, KVCAP_ERR_FORMAT,
                            "%s: header: raw control character 0x%02x inside a string at byte %zu "
                            "(JSON requires it escaped)",
                            label, c, i);
            if (c == '\\') {
                KVCAP_RETURN_IF(i + 1 >= n, KVCAP_ERR_FORMAT,
                                "%s: header: invalid JSON: string escape cut off at byte %zu",
                                label, i);
                if (h[i + 1] == 'u' && i + 5 < n && memcmp(h + i + 2, "0000", 4) == 0)
                    return kvcap_fail(KVCAP_ERR_FORMAT,
                                      "%s: header: \\u0000 in a string at byte %zu (NUL is not "
                                      "allowed in names or metadata)",
                                      label, i);
                i += 2;
                continue;
            }
            if (c == '"')
                in_string = 0;
        } else {
            KVCAP_RETURN_IF(c < 0x20 && c != '\t' && c != '\n' && c != '\r', KVCAP_ERR_FORMAT,
                            "%s: header: invalid JSON: control character 0x%02x at byte %zu",
                            label, c, i);
            if (c == '"')
                in_string = 1;
        }
        i++;
    }
    return KVCAP_OK;
}

/* A JSON number that must be a non-negative integer exactly representable. */
static int json_uint(const cJSON *item, uint64_t *out)
{
    if (!cJSON_IsNumber(item))
        return 0;
    double v = item->valuedouble;
    if (!isfinite(v) || signbit(v) || v != floor(v) || v > KVST_MAX_JSON_INT)
        return 0;
    *out = (uint64_t)v;
    return 1;
}

/* Describes a JSON value briefly for error messages: "-3", "1.5", "a string", ... */
static const char *json_desc(const cJSON *item, char *buf, size_t cap)
{
    if (!item)
        return "missing";
    if (cJSON_IsNumber(item)) {
        snprintf(buf, cap, "%.17g", item->valuedouble);
        return buf;
    }
    if (cJSON_IsString(item))
        return "a string";
    if (cJSON_IsArray(item))
        return "an array";
    if (cJSON_IsObject(item))
        return "an object";
    if (cJSON_IsBool(item))
        return "a boolean";
    if (cJSON_IsNull(item))
        return "null";
    return "an invalid value";
}

/* What parsing one tensor entry produces before the final block exists. */
struct pending {
    const char *name; /* points into the cJSON tree */
    enum kvcap_dtype dtype;
    int ndim;
    int64_t shape[KVST_MAX_DIMS];
    size_t n_elements;
    size_t nbytes;
    uint64_t begin, end;
};

static enum kvcap_status check_name(const char *label, const char *name)
{
    size_t len = strlen(name);
    KVCAP_RETURN_IF(len == 0, KVCAP_ERR_FORMAT, "%s: tensor name is empty", label);
    KVCAP_RETURN_IF(len > KVST_MAX_NAME, KVCAP_ERR_FORMAT,
                    "%s: tensor name '%.40s...' is %zu bytes, longer than %d", label, name, len,
                    KVST_MAX_NAME);
    return KVCAP_OK;
}

static enum kvcap_status parse_tensor(const char *label, const cJSON *entry, struct pending *p,
                                      uint64_t data_size)
{
    const char *name = entry->string;
    char dbuf[64];
    KVCAP_TRY(check_name(label, name));
    KVCAP_RETURN_IF(!cJSON_IsObject(entry), KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': value is %s, not an object", label, name,
                    json_desc(entry, dbuf, sizeof dbuf));

    const cJSON *jd = NULL, *js = NULL, *jo = NULL;
    for (const cJSON *c = entry->child; c; c = c->next) {
        const cJSON **slot = NULL;
        if (strcmp(c->string, "dtype") == 0)
            slot = &jd;
        else if (strcmp(c->string, "shape") == 0)
            slot = &js;
        else if (strcmp(c->string, "data_offsets") == 0)
            slot = &jo;
        if (!slot)
            continue; /* unknown keys are ignored, like the reference implementation */
        KVCAP_RETURN_IF(*slot, KVCAP_ERR_FORMAT, "%s: tensor '%s': duplicate key '%s'", label,
                        name, c->string);
        *slot = c;
    }

    /* dtype */
    KVCAP_RETURN_IF(!jd, KVCAP_ERR_FORMAT, "%s: tensor '%s': dtype is missing", label, name);
    KVCAP_RETURN_IF(!cJSON_IsString(jd), KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': dtype is %s, not a string", label, name,
                    json_desc(jd, dbuf, sizeof dbuf));
    KVCAP_RETURN_IF(!dtype_from_file_name(jd->valuestring, &p->dtype), KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': unknown dtype '%.32s' (kvcap reads F32 F16 BF16 F64 I32 U8)",
                    label, name, jd->valuestring);
    size_t esize = kvcap_dtype_size(p->dtype);

    /* shape */
    KVCAP_RETURN_IF(!js, KVCAP_ERR_FORMAT, "%s: tensor '%s': shape is missing", label, name);
    KVCAP_RETURN_IF(!cJSON_IsArray(js), KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': shape is %s, not an array", label, name,
                    json_desc(js, dbuf, sizeof dbuf));
    int rank = cJSON_GetArraySize(js);
    KVCAP_RETURN_IF(rank > KVST_MAX_DIMS, KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': shape has rank %d, more than %d", label, name, rank,
                    KVST_MAX_DIMS);
    p->ndim = rank;
    int has_zero = 0;
    int i = 0;
    for (const cJSON *d = js->child; d; d = d->next, i++) {
        uint64_t v;
        KVCAP_RETURN_IF(!json_uint(d, &v), KVCAP_ERR_FORMAT,
                        "%s: tensor '%s': shape[%d] is %s, not a non-negative integer "
                        "(at most 2^53 - 1)",
                        label, name, i, json_desc(d, dbuf, sizeof dbuf));
        p->shape[i] = (int64_t)v;
        has_zero |= v == 0;
    }
    /* Elements and bytes, checked against 64 bits and size_t (the same on LP64). A zero dim
     * makes the tensor empty whatever the other dims are. */
    uint64_t count = 1;
    if (has_zero) {
        count = 0;
    } else {
        for (int k = 0; k < rank; k++) {
            KVCAP_RETURN_IF(__builtin_mul_overflow(count, (uint64_t)p->shape[k], &count),
                            KVCAP_ERR_FORMAT,
                            "%s: tensor '%s': shape %s has more than 2^64 elements", label, name,
                            shape_str(dbuf, sizeof dbuf, rank, p->shape));
        }
    }
    uint64_t bytes;
    KVCAP_RETURN_IF(__builtin_mul_overflow(count, (uint64_t)esize, &bytes) || count > SIZE_MAX ||
                        bytes > SIZE_MAX,
                    KVCAP_ERR_FORMAT, "%s: tensor '%s': shape %s x %s overflows 64 bits", label,
                    name, shape_str(dbuf, sizeof dbuf, rank, p->shape),
                    kvcap_dtype_name(p->dtype));
    p->n_elements = (size_t)count;
    p->nbytes = (size_t)bytes;

    /* data_offsets */
    KVCAP_RETURN_IF(!jo, KVCAP_ERR_FORMAT, "%s: tensor '%s': data_offsets is missing", label,
                    name);
    KVCAP_RETURN_IF(!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2, KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': data_offsets is not an array of two integers", label,
                    name);
    KVCAP_RETURN_IF(!json_uint(jo->child, &p->begin), KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': data_offsets[0] is %s, not a non-negative integer", label,
                    name, json_desc(jo->child, dbuf, sizeof dbuf));
    KVCAP_RETURN_IF(!json_uint(jo->child->next, &p->end), KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': data_offsets[1] is %s, not a non-negative integer", label,
                    name, json_desc(jo->child->next, dbuf, sizeof dbuf));
    KVCAP_RETURN_IF(p->begin > p->end, KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': data_offsets [%llu, %llu]: begin is after end", label,
                    name, (unsigned long long)p->begin, (unsigned long long)p->end);
    KVCAP_RETURN_IF(p->end > data_size, KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': data_offsets [%llu, %llu] end past the data buffer "
                    "(%llu bytes)",
                    label, name, (unsigned long long)p->begin, (unsigned long long)p->end,
                    (unsigned long long)data_size);
    KVCAP_RETURN_IF(p->end - p->begin != bytes, KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, shape %s x %s "
                    "needs %llu",
                    label, name, (unsigned long long)p->begin, (unsigned long long)p->end,
                    (unsigned long long)(p->end - p->begin),
                    shape_str(dbuf, sizeof dbuf, rank, p->shape), kvcap_dtype_name(p->dtype),
                    (unsigned long long)bytes);
    p->name = name;
    return KVCAP_OK;
}

static int cmp_pending_name(const void *a, const void *b)
{
    return strcmp(((const struct pending *)a)->name, ((const struct pending *)b)->name);
}

static int cmp_pending_range(const void *a, const void *b)
{
    const struct pending *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_meta_key(const void *a, const void *b)
{
    return strcmp(((const struct kvst_meta_entry *)a)->key,
                  ((const struct kvst_meta_entry *)b)->key);
}

/* The ranges, sorted by (begin, end), must tile [0, data_size) exactly. */
static enum kvcap_status check_tiling(const char *label, const struct pending *t, size_t n,
                                      uint64_t data_size)
{
    uint64_t cursor = 0;
    const char *prev = NULL;
    uint64_t prev_begin = 0;
    for (size_t i = 0; i < n; i++) {
        if (t[i].begin < cursor)
            return kvcap_fail(KVCAP_ERR_FORMAT,
                              "%s: tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s' "
                              "[%llu, %llu]",
                              label, t[i].name, (unsigned long long)t[i].begin,
                              (unsigned long long)t[i].end, prev, (unsigned long long)prev_begin,
                              (unsigned long long)cursor);
        if (t[i].begin > cursor) {
            if (prev)
                return kvcap_fail(KVCAP_ERR_FORMAT,
                                  "%s: tensor '%s': data_offsets [%llu, %llu] leave a hole of "
                                  "%llu bytes [%llu, %llu) after tensor '%s'",
                                  label, t[i].name, (unsigned long long)t[i].begin,
                                  (unsigned long long)t[i].end,
                                  (unsigned long long)(t[i].begin - cursor),
                                  (unsigned long long)cursor, (unsigned long long)t[i].begin,
                                  prev);
            return kvcap_fail(KVCAP_ERR_FORMAT,
                              "%s: tensor '%s': data_offsets [%llu, %llu] leave a hole of %llu "
                              "bytes at the start of the data buffer",
                              label, t[i].name, (unsigned long long)t[i].begin,
                              (unsigned long long)t[i].end, (unsigned long long)t[i].begin);
        }
        /* A zero-size tensor at the cursor does not move it; keep the last non-empty one as
         * the neighbour named in messages. */
        if (t[i].end > cursor || !prev) {
            prev = t[i].name;
            prev_begin = t[i].begin;
        }
        cursor = t[i].end;
    }
    if (cursor != data_size) {
        if (prev)
            return kvcap_fail(KVCAP_ERR_FORMAT,
                              "%s: data buffer: %llu trailing bytes [%llu, %llu) after the last "
                              "tensor '%s'",
                              label, (unsigned long long)(data_size - cursor),
                              (unsigned long long)cursor, (unsigned long long)data_size, prev);
        return kvcap_fail(KVCAP_ERR_FORMAT,
                          "%s: data buffer: %llu trailing bytes but the header lists no tensors",
                          label, (unsigned long long)data_size);
    }
    return KVCAP_OK;
}

/* Validates and indexes `size` bytes at `base`. On success *out owns everything except the
 * bytes (the caller sets map/map_size when it owns a mapping). */
static enum kvcap_status parse_file(const unsigned char *base, uint64_t size, const char *label,
                                    struct kvst_file **out)
{
    *out = NULL;
    KVCAP_RETURN_IF(size < 8, KVCAP_ERR_FORMAT,
                    "%s: file is %llu bytes, shorter than the 8-byte header length (truncated)",
                    label, (unsigned long long)size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | base[i];
    KVCAP_RETURN_IF(n > KVST_MAX_HEADER, KVCAP_ERR_FORMAT,
                    "%s: header length %llu exceeds the limit of %llu bytes", label,
                    (unsigned long long)n, (unsigned long long)KVST_MAX_HEADER);
    KVCAP_RETURN_IF(n > size - 8, KVCAP_ERR_FORMAT,
                    "%s: header length %llu runs past the end of the file (%llu bytes after the "
                    "length field)",
                    label, (unsigned long long)n, (unsigned long long)(size - 8));
    KVCAP_RETURN_IF(n < 2, KVCAP_ERR_FORMAT,
                    "%s: header length %llu is too small for a JSON object", label,
                    (unsigned long long)n);
    const char *hdr = (const char *)base + 8;
    uint64_t data_size = size - 8 - n;

    KVCAP_TRY(check_header_text(label, (const unsigned char *)hdr, (size_t)n));
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, (size_t)n, &end, 0);
    if (!root) {
        /* On failure cJSON still sets `end` to where it stopped (avoid cJSON_GetErrorPtr: it
         * reads a process-wide global). */
        if (end && end >= hdr && end <= hdr + n)
            return kvcap_fail(KVCAP_ERR_FORMAT, "%s: header: invalid JSON near byte %zu", label,
                              (size_t)(end - hdr));
        return kvcap_fail(KVCAP_ERR_FORMAT, "%s: header: invalid JSON", label);
    }
    enum kvcap_status st = KVCAP_OK;
    struct pending *pend = NULL;
    struct kvst_file *f = NULL;
    char dbuf[64];

    if (!cJSON_IsObject(root)) {
        st = kvcap_fail(KVCAP_ERR_FORMAT, "%s: header: JSON is %s, not an object", label,
                        json_desc(root, dbuf, sizeof dbuf));
        goto done;
    }
    for (const char *q = end; q < hdr + n; q++) {
        if (*q != ' ') {
            st = kvcap_fail(KVCAP_ERR_FORMAT,
                            "%s: header: trailing bytes after the JSON object at byte %zu (only "
                            "spaces may follow it)",
                            label, (size_t)(q - hdr));
            goto done;
        }
    }

    /* Count entries and the bytes of strings the final block holds. */
    size_t n_t = 0, n_m = 0, strbytes = strlen(label) + 1;
    const cJSON *meta = NULL;
    for (const cJSON *c = root->child; c; c = c->next) {
        if (strcmp(c->string, META_KEY) == 0) {
            if (meta) {
                st = kvcap_fail(KVCAP_ERR_FORMAT, "%s: __metadata__ appears more than once",
                                label);
                goto done;
            }
            meta = c;
            continue;
        }
        n_t++;
        strbytes += strlen(c->string) + 1;
    }
    if (meta) {
        if (!cJSON_IsObject(meta)) {
            st = kvcap_fail(KVCAP_ERR_FORMAT, "%s: __metadata__ is %s, not an object", label,
                            json_desc(meta, dbuf, sizeof dbuf));
            goto done;
        }
        for (const cJSON *c = meta->child; c; c = c->next) {
            if (!cJSON_IsString(c)) {
                st = kvcap_fail(KVCAP_ERR_FORMAT,
                                "%s: __metadata__['%s']: value is %s, not a string", label,
                                c->string, json_desc(c, dbuf, sizeof dbuf));
                goto done;
            }
            n_m++;
            strbytes += strlen(c->string) + strlen(c->valuestring) + 2;
        }
    }

    /* Per-tensor rules, in the order the header lists them. */
    pend = calloc(n_t ? n_t : 1, sizeof *pend);
    if (!pend) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory indexing %zu tensors", label,
                        n_t);
        goto done;
    }
    size_t k = 0;
    for (const cJSON *c = root->child; c; c = c->next) {
        if (c == meta)
            continue;
        st = parse_tensor(label, c, &pend[k++], data_size);
        if (st != KVCAP_OK)
            goto done;
    }

    qsort(pend, n_t, sizeof *pend, cmp_pending_name);
    for (size_t i = 1; i < n_t; i++) {
        if (strcmp(pend[i - 1].name, pend[i].name) == 0) {
            st = kvcap_fail(KVCAP_ERR_FORMAT,
                            "%s: tensor '%s': duplicate tensor name (the key appears more than "
                            "once in the header)",
                            label, pend[i].name);
            goto done;
        }
    }
    qsort(pend, n_t, sizeof *pend, cmp_pending_range);
    st = check_tiling(label, pend, n_t, data_size);
    if (st != KVCAP_OK)
        goto done;
    qsort(pend, n_t, sizeof *pend, cmp_pending_name);

    /* One block: the file struct, tensors, metadata entries, then all strings. Arrays come
     * first so they are naturally aligned. */
    size_t copy_bytes = 0;
    const unsigned char *data = base + 8 + n;
    for (size_t i = 0; i < n_t; i++) {
        size_t es = kvcap_dtype_size(pend[i].dtype);
        if (pend[i].nbytes && (uintptr_t)(data + pend[i].begin) % es != 0)
            copy_bytes += (pend[i].nbytes + 7) & ~(size_t)7; /* <= data_size + 7n: no overflow */
    }
    size_t block = sizeof *f + n_t * sizeof *f->tensors + n_m * sizeof *f->meta + strbytes;
    f = calloc(1, block);
    if (!f) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory (%zu bytes of index)", label,
                        block);
        goto done;
    }
    if (copy_bytes) {
        f->copies = malloc(copy_bytes); /* malloc alignment covers every element size */
        if (!f->copies) {
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY,
                            "%s: out of memory copying %zu bytes of misaligned tensors", label,
                            copy_bytes);
            goto done;
        }
    }
    f->tensors = (struct kvst_tensor *)(f + 1);
    f->meta = (struct kvst_meta_entry *)(f->tensors + n_t);
    char *strings = (char *)(f->meta + n_m);
    f->base = base;
    f->size = size;
    f->header_size = n;
    f->n_tensors = n_t;
    f->n_meta = n_m;

    size_t len = strlen(label) + 1;
    memcpy(strings, label, len);
    f->path = strings;
    strings += len;

    unsigned char *copy_at = f->copies;
    for (size_t i = 0; i < n_t; i++) {
        struct kvst_tensor *t = &f->tensors[i];
        const struct pending *p = &pend[i];
        len = strlen(p->name) + 1;
        memcpy(strings, p->name, len);
        t->name = strings;
        strings += len;
        t->dtype = p->dtype;
        t->ndim = p->ndim;
        memcpy(t->shape, p->shape, sizeof t->shape);
        t->n_elements = p->n_elements;
        t->nbytes = p->nbytes;
        t->offset = p->begin;
        const unsigned char *src = data + p->begin;
        size_t es = kvcap_dtype_size(p->dtype);
        if ((uintptr_t)src % es == 0) {
            t->data = src;
        } else if (p->nbytes == 0) {
            t->data = empty_anchor;
        } else {
            memcpy(copy_at, src, p->nbytes);
            t->data = copy_at;
            copy_at += (p->nbytes + 7) & ~(size_t)7;
        }
    }
    k = 0;
    if (meta) {
        for (const cJSON *c = meta->child; c; c = c->next, k++) {
            len = strlen(c->string) + 1;
            memcpy(strings, c->string, len);
            f->meta[k].key = strings;
            strings += len;
            len = strlen(c->valuestring) + 1;
            memcpy(strings, c->valuestring, len);
            f->meta[k].value = strings;
            strings += len;
        }
        qsort(f->meta, n_m, sizeof *f->meta, cmp_meta_key);
        for (size_t i = 1; i < n_m; i++) {
            if (strcmp(f->meta[i - 1].key, f->meta[i].key) == 0) {
                st = kvcap_fail(KVCAP_ERR_FORMAT,
                                "%s: __metadata__['%s']: duplicate key", label, f->meta[i].key);
                goto done;
            }
        }
    }

done:
    cJSON_Delete(root);
    free(pend);
    if (st != KVCAP_OK) {
        if (f)
            free(f->copies);
        free(f);
        return st;
    }
    *out = f;
    return KVCAP_OK;
}

enum kvcap_status kvst_open_memory(const void *bytes, size_t size, const char *label,
                                   struct kvst_file **out)
{
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "kvst_open_memory: out is NULL");
    *out = NULL;
    if (!label)
        label = "(memory)";
    KVCAP_RETURN_IF(!bytes && size, KVCAP_ERR_INVALID_ARGUMENT, "%s: NULL buffer of %zu bytes",
                    label, size);
    static const unsigned char nothing[1];
    return parse_file(bytes ? bytes : nothing, size, label, out);
}

enum kvcap_status kvst_open(const char *path, struct kvst_file **out)
{
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "kvst_open: out is NULL");
    *out = NULL;
    KVCAP_RETURN_IF(!path || !*path, KVCAP_ERR_INVALID_ARGUMENT, "kvst_open: empty path");
    void *map;
    size_t size;
    KVCAP_TRY(kvcap_map_file(path, 8, "shorter than the 8-byte header length (truncated)", &map,
                             &size));
    struct kvst_file *f;
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

void kvst_close(struct kvst_file *f)
{
    if (!f)
        return;
    if (f->map)
        munmap(f->map, f->map_size);
    free(f->copies);
    free(f);
}

const char *kvst_path(const struct kvst_file *f)
{
    return f ? f->path : NULL;
}

uint64_t kvst_file_size(const struct kvst_file *f)
{
    return f ? f->size : 0;
}

uint64_t kvst_header_size(const struct kvst_file *f)
{
    return f ? f->header_size : 0;
}

size_t kvst_count(const struct kvst_file *f)
{
    return f ? f->n_tensors : 0;
}

const struct kvst_tensor *kvst_at(const struct kvst_file *f, size_t i)
{
    return f && i < f->n_tensors ? &f->tensors[i] : NULL;
}

const struct kvst_tensor *kvst_find(const struct kvst_file *f, const char *name)
{
    if (!f || !name)
        return NULL;
    size_t lo = 0, hi = f->n_tensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, f->tensors[mid].name);
        if (c == 0)
            return &f->tensors[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

size_t kvst_meta_count(const struct kvst_file *f)
{
    return f ? f->n_meta : 0;
}

void kvst_meta_at(const struct kvst_file *f, size_t i, const char **key, const char **value)
{
    const struct kvst_meta_entry *m = f && i < f->n_meta ? &f->meta[i] : NULL;
    if (key)
        *key = m ? m->key : NULL;
    if (value)
        *value = m ? m->value : NULL;
}

const char *kvst_meta(const struct kvst_file *f, const char *key)
{
    if (!f || !key)
        return NULL;
    size_t lo = 0, hi = f->n_meta;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(key, f->meta[mid].key);
        if (c == 0)
            return f->meta[mid].value;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

/* ---- Writer ----------------------------------------------------------------------------- */

struct wtensor {
    char *name;    /* owns one allocation: the name, then the copied data when `owned` */
    enum kvcap_dtype dtype;
    int ndim;
    int64_t shape[KVST_MAX_DIMS];
    size_t nbytes;
    const void *data; /* borrowed, or inside `name`'s allocation */
};

struct wmeta {
    char *key; /* one allocation: key then value */
    char *value;
};

struct kvst_writer {
    struct wtensor *t; /* sorted by name */
    size_t n, cap;
    struct wmeta *m;   /* sorted by key */
    size_t nm, capm;
};

static atomic_uint tmp_counter;

enum kvcap_status kvst_writer_create(struct kvst_writer **out)
{
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "kvst_writer_create: out is NULL");
    *out = calloc(1, sizeof **out);
    KVCAP_RETURN_IF(!*out, KVCAP_ERR_OUT_OF_MEMORY, "kvst_writer_create: out of memory");
    return KVCAP_OK;
}

void kvst_writer_free(struct kvst_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n; i++)
        free(w->t[i].name);
    for (size_t i = 0; i < w->nm; i++)
        free(w->m[i].key);
    free(w->t);
    free(w->m);
    free(w);
}

/* Binary search: returns the index of `name` (found = 1) or where it would be inserted. */
static size_t writer_find(const struct kvst_writer *w, const char *name, int *found)
{
    size_t lo = 0, hi = w->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, w->t[mid].name);
        if (c == 0) {
            *found = 1;
            return mid;
        }
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    *found = 0;
    return lo;
}

static enum kvcap_status writer_add(struct kvst_writer *w, const char *name,
                                    enum kvcap_dtype dtype, int ndim, const int64_t *shape,
                                    const void *data, int copy)
{
    KVCAP_RETURN_IF(!w, KVCAP_ERR_INVALID_ARGUMENT, "kvst_writer_add: writer is NULL");
    KVCAP_RETURN_IF(!name, KVCAP_ERR_INVALID_ARGUMENT, "kvst_writer_add: name is NULL");
    size_t len = strlen(name);
    KVCAP_RETURN_IF(len == 0, KVCAP_ERR_INVALID_ARGUMENT, "kvst_writer_add: tensor name is empty");
    KVCAP_RETURN_IF(len > KVST_MAX_NAME, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_add: tensor name '%.40s...' is %zu bytes, longer than %d", name,
                    len, KVST_MAX_NAME);
    KVCAP_RETURN_IF(strcmp(name, META_KEY) == 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_add: '__metadata__' is reserved and cannot name a tensor");
    KVCAP_RETURN_IF(!utf8_valid(name), KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_add: tensor name '%.40s' is not valid UTF-8", name);
    size_t es = kvcap_dtype_size(dtype);
    KVCAP_RETURN_IF(es == 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_add: tensor '%s': unknown dtype %d", name, (int)dtype);
    KVCAP_RETURN_IF(ndim < 0 || ndim > KVST_MAX_DIMS, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_add: tensor '%s': rank %d is outside 0..%d", name, ndim,
                    KVST_MAX_DIMS);
    KVCAP_RETURN_IF(ndim > 0 && !shape, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_add: tensor '%s': shape is NULL", name);
    uint64_t count = 1;
    int has_zero = 0;
    for (int i = 0; i < ndim; i++) {
        KVCAP_RETURN_IF(shape[i] < 0 || (uint64_t)shape[i] > KVST_MAX_JSON_INT_U64,
                        KVCAP_ERR_INVALID_ARGUMENT,
                        "kvst_writer_add: tensor '%s': shape[%d] = %lld is outside 0..2^53-1",
                        name, i, (long long)shape[i]);
        has_zero |= shape[i] == 0;
    }
    uint64_t bytes = 0;
    if (!has_zero) {
        for (int i = 0; i < ndim; i++)
            KVCAP_RETURN_IF(__builtin_mul_overflow(count, (uint64_t)shape[i], &count),
                            KVCAP_ERR_INVALID_ARGUMENT,
                            "kvst_writer_add: tensor '%s': element count overflows 64 bits",
                            name);
        KVCAP_RETURN_IF(__builtin_mul_overflow(count, (uint64_t)es, &bytes) ||
                            bytes > KVST_MAX_JSON_INT_U64 || bytes > SIZE_MAX,
                        KVCAP_ERR_INVALID_ARGUMENT,
                        "kvst_writer_add: tensor '%s': %llu elements x %s exceed 2^53-1 bytes",
                        name, (unsigned long long)count, kvcap_dtype_name(dtype));
    }
    KVCAP_RETURN_IF(bytes && !data, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_add: tensor '%s': data is NULL", name);
    int found;
    size_t at = writer_find(w, name, &found);
    KVCAP_RETURN_IF(found, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_add: tensor '%s': duplicate name", name);

    if (w->n == w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 16;
        struct wtensor *t = realloc(w->t, cap * sizeof *t);
        KVCAP_RETURN_IF(!t, KVCAP_ERR_OUT_OF_MEMORY, "kvst_writer_add: out of memory");
        w->t = t;
        w->cap = cap;
    }
    size_t alloc = len + 1;
    size_t data_at = (alloc + 7) & ~(size_t)7;
    if (copy)
        KVCAP_RETURN_IF(!kvcap_add_size(data_at, (size_t)bytes, &alloc),
                        KVCAP_ERR_OUT_OF_MEMORY, "kvst_writer_add: tensor '%s': too large",
                        name);
    char *mem = malloc(alloc);
    KVCAP_RETURN_IF(!mem, KVCAP_ERR_OUT_OF_MEMORY,
                    "kvst_writer_add: tensor '%s': out of memory (%zu bytes)", name, alloc);
    memcpy(mem, name, len + 1);
    struct wtensor nt = {.name = mem, .dtype = dtype, .ndim = ndim, .nbytes = (size_t)bytes,
                         .data = data};
    for (int i = 0; i < ndim; i++)
        nt.shape[i] = shape[i];
    if (copy) {
        if (bytes)
            memcpy(mem + data_at, data, (size_t)bytes);
        nt.data = mem + data_at;
    }
    memmove(&w->t[at + 1], &w->t[at], (w->n - at) * sizeof *w->t);
    w->t[at] = nt;
    w->n++;
    return KVCAP_OK;
}

enum kvcap_status kvst_writer_add(struct kvst_writer *w, const char *name, enum kvcap_dtype dtype,
                                  int ndim, const int64_t *shape, const void *data)
{
    return writer_add(w, name, dtype, ndim, shape, data, 0);
}

enum kvcap_status kvst_writer_add_copy(struct kvst_writer *w, const char *name,
                                       enum kvcap_dtype dtype, int ndim, const int64_t *shape,
                                       const void *data)
{
    return writer_add(w, name, dtype, ndim, shape, data, 1);
}

enum kvcap_status kvst_writer_set_meta(struct kvst_writer *w, const char *key, const char *value)
{
    KVCAP_RETURN_IF(!w || !key || !value, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_set_meta: NULL %s", !w ? "writer" : !key ? "key" : "value");
    KVCAP_RETURN_IF(!utf8_valid(key), KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_set_meta: key '%.40s' is not valid UTF-8", key);
    KVCAP_RETURN_IF(!utf8_valid(value), KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_set_meta: value of '%s' is not valid UTF-8", key);
    size_t kl = strlen(key) + 1, vl = strlen(value) + 1, total;
    KVCAP_RETURN_IF(!kvcap_add_size(kl, vl, &total), KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_set_meta: '%s': value too large", key);
    char *mem = malloc(total);
    KVCAP_RETURN_IF(!mem, KVCAP_ERR_OUT_OF_MEMORY, "kvst_writer_set_meta: '%s': out of memory",
                    key);
    memcpy(mem, key, kl);
    memcpy(mem + kl, value, vl);

    size_t lo = 0, hi = w->nm;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(key, w->m[mid].key);
        if (c == 0) {
            free(w->m[mid].key);
            w->m[mid] = (struct wmeta){mem, mem + kl};
            return KVCAP_OK;
        }
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    if (w->nm == w->capm) {
        size_t cap = w->capm ? w->capm * 2 : 8;
        struct wmeta *m = realloc(w->m, cap * sizeof *m);
        if (!m) {
            free(mem);
            return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvst_writer_set_meta: out of memory");
        }
        w->m = m;
        w->capm = cap;
    }
    memmove(&w->m[lo + 1], &w->m[lo], (w->nm - lo) * sizeof *w->m);
    w->m[lo] = (struct wmeta){mem, mem + kl};
    w->nm++;
    return KVCAP_OK;
}

/* A growable byte buffer for the header. `failed` latches an allocation failure so the
 * builder code stays linear; the caller checks once. */
struct sbuf {
    char *p;
    size_t len, cap;
    int failed;
};

static void sb_put(struct sbuf *b, const char *s, size_t n)
{
    if (b->failed)
        return;
    if (n > b->cap - b->len) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->len < n) {
            if (cap > SIZE_MAX / 2) {
                b->failed = 1;
                return;
            }
            cap *= 2;
        }
        char *p = realloc(b->p, cap);
        if (!p) {
            b->failed = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

static void sb_str(struct sbuf *b, const char *s)
{
    sb_put(b, s, strlen(s));
}

static void sb_u64(struct sbuf *b, uint64_t v)
{
    char tmp[24];
    int n = snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
    sb_put(b, tmp, (size_t)n);
}

/* A JSON string: escapes what JSON requires (quote, backslash, control characters) and
 * passes UTF-8 through unchanged, as serde_json does. */
static void sb_json_string(struct sbuf *b, const char *s)
{
    sb_put(b, "\"", 1);
    const char *run = s;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c >= 0x20 && c != '"' && c != '\\')
            continue;
        sb_put(b, run, (size_t)(s - run));
        char esc[8];
        switch (c) {
        case '"': sb_str(b, "\\\""); break;
        case '\\': sb_str(b, "\\\\"); break;
        case '\n': sb_str(b, "\\n"); break;
        case '\r': sb_str(b, "\\r"); break;
        case '\t': sb_str(b, "\\t"); break;
        case '\b': sb_str(b, "\\b"); break;
        case '\f': sb_str(b, "\\f"); break;
        default:
            snprintf(esc, sizeof esc, "\\u%04x", c);
            sb_str(b, esc);
        }
        run = s + 1;
    }
    sb_put(b, run, (size_t)(s - run));
    sb_put(b, "\"", 1);
}

/* Layout order: descending element size, then name, so every tensor starts aligned. */
struct layout_ref {
    const struct wtensor *t;
    size_t index; /* in name order */
};

static int cmp_layout(const void *a, const void *b)
{
    const struct wtensor *x = ((const struct layout_ref *)a)->t;
    const struct wtensor *y = ((const struct layout_ref *)b)->t;
    size_t ex = kvcap_dtype_size(x->dtype), ey = kvcap_dtype_size(y->dtype);
    if (ex != ey)
        return ex > ey ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t w = write(fd, p, chunk);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

enum kvcap_status kvst_writer_commit(struct kvst_writer *w, const char *path)
{
    KVCAP_RETURN_IF(!w, KVCAP_ERR_INVALID_ARGUMENT, "kvst_writer_commit: writer is NULL");
    KVCAP_RETURN_IF(!path || !*path, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvst_writer_commit: empty path");
    KVCAP_TRY(kvcap_check_replaceable(path));

    struct layout_ref *order = malloc((w->n ? w->n : 1) * sizeof *order);
    uint64_t *begin = malloc((w->n ? w->n : 1) * sizeof *begin);
    struct sbuf hb = {0};
    char *tmp = NULL;
    int fd = -1, slot = -1;
    enum kvcap_status st = KVCAP_OK;
    if (!order || !begin) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory laying out %zu tensors",
                        path, w->n);
        goto out;
    }
    for (size_t i = 0; i < w->n; i++)
        order[i] = (struct layout_ref){&w->t[i], i};
    qsort(order, w->n, sizeof *order, cmp_layout);
    uint64_t pos = 0;
    for (size_t i = 0; i < w->n; i++) {
        begin[order[i].index] = pos;
        pos += order[i].t->nbytes; /* each <= 2^53 - 1: the sum cannot wrap before the check */
        if (pos > KVST_MAX_JSON_INT_U64) {
            st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                            "%s: data buffer would exceed 2^53-1 bytes (at tensor '%s')", path,
                            order[i].t->name);
            goto out;
        }
    }

    /* Header: reserve the 8-byte length, then the JSON: "__metadata__" first, then the
     * tensors in name order (the data is laid out in a different order, see cmp_layout). */
    sb_put(&hb, "\0\0\0\0\0\0\0\0", 8);
    sb_put(&hb, "{", 1);
    int first = 1;
    if (w->nm) {
        sb_str(&hb, "\"" META_KEY "\":{");
        for (size_t i = 0; i < w->nm; i++) {
            if (i)
                sb_put(&hb, ",", 1);
            sb_json_string(&hb, w->m[i].key);
            sb_put(&hb, ":", 1);
            sb_json_string(&hb, w->m[i].value);
        }
        sb_put(&hb, "}", 1);
        first = 0;
    }
    for (size_t i = 0; i < w->n; i++) {
        const struct wtensor *t = &w->t[i];
        if (!first)
            sb_put(&hb, ",", 1);
        first = 0;
        sb_json_string(&hb, t->name);
        sb_str(&hb, ":{\"dtype\":\"");
        sb_str(&hb, kvcap_dtype_name(t->dtype));
        sb_str(&hb, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            if (d)
                sb_put(&hb, ",", 1);
            sb_u64(&hb, (uint64_t)t->shape[d]);
        }
        sb_str(&hb, "],\"data_offsets\":[");
        sb_u64(&hb, begin[i]);
        sb_put(&hb, ",", 1);
        sb_u64(&hb, begin[i] + t->nbytes);
        sb_str(&hb, "]}");
    }
    sb_put(&hb, "}", 1);
    while (!hb.failed && hb.len % 8 != 0)
        sb_put(&hb, " ", 1);
    if (hb.failed) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory building the header", path);
        goto out;
    }
    uint64_t n = hb.len - 8;
    if (n > KVST_MAX_HEADER) {
        st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                        "%s: header of %llu bytes exceeds the limit of %llu", path,
                        (unsigned long long)n, (unsigned long long)KVST_MAX_HEADER);
        goto out;
    }
    for (int i = 0; i < 8; i++)
        hb.p[i] = (char)((n >> (8 * i)) & 0xff);

    /* Temporary file beside the target, then rename over it. */
    unsigned counter = atomic_fetch_add(&tmp_counter, 1u);
    int tl = snprintf(NULL, 0, "%s.tmp.%ld.%u", path, (long)getpid(), counter);
    tmp = malloc((size_t)tl + 1);
    if (!tmp) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
        goto out;
    }
    snprintf(tmp, (size_t)tl + 1, "%s.tmp.%ld.%u", path, (long)getpid(), counter);
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        st = kvcap_fail(KVCAP_ERR_IO, "%s: cannot create temporary file %s: %s", path, tmp,
                        strerror(errno));
        free(tmp);
        tmp = NULL; /* nothing to remove */
        goto out;
    }
    slot = kvcap_temp_register(tmp); /* removed by a tool's signal handler if one comes */
    const char *what = "write";
    if (write_all(fd, hb.p, hb.len) != 0)
        goto io_fail;
    for (size_t i = 0; i < w->n; i++) {
        const struct wtensor *t = order[i].t;
        if (t->nbytes && write_all(fd, t->data, t->nbytes) != 0)
            goto io_fail;
    }
    what = "fsync";
    if (fsync(fd) != 0)
        goto io_fail;
    what = "close";
    int rc = close(fd);
    fd = -1;
    if (rc != 0)
        goto io_fail;
    what = "rename";
    if (rename(tmp, path) != 0)
        goto io_fail;
    kvcap_temp_unregister(slot);
    free(tmp);
    tmp = NULL; /* renamed: it is the file now */
    if (kvcap_fsync_parent(path) != 0) {
        st = kvcap_fail(KVCAP_ERR_IO, "%s: written, but fsync of its directory failed: %s",
                        path, strerror(errno));
        goto out;
    }
    goto out;

io_fail:
    st = kvcap_fail(KVCAP_ERR_IO, "%s: %s of temporary file %s failed: %s", path, what, tmp,
                    strerror(errno));
out:
    if (fd >= 0)
        close(fd);
    if (tmp) {
        unlink(tmp);
        kvcap_temp_unregister(slot);
        free(tmp);
    }
    free(hb.p);
    free(order);
    free(begin);
    return st;
}
