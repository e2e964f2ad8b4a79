/* test_gguf.c — the GGUF v3 reader (engine/gguf.h): images built in memory by a small writer
 * below, metadata round trips and typed getters, tensor layout and alignment, dequantisation of
 * every supported type against hand-packed blocks, a bad-file corpus (one image per failure
 * class), truncation and byte-mutation sweeps, and the real SmolLM2 file when it is present. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine/gguf.h"
#include "tests/test_util.h"
#include "tests/test_status.h"

/* ---- Helpers ---------------------------------------------------------------------------- */

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

/* ---- A GGUF writer ---------------------------------------------------------------------- */

struct buf {
    unsigned char *p;
    size_t n, cap;
};

static void put(struct buf *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n)
            cap *= 2;
        b->p = realloc(b->p, cap);
        assert_non_null(b->p);
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put_u8(struct buf *b, uint8_t v)
{
    put(b, &v, 1);
}

static void put_le(struct buf *b, uint64_t v, int bytes)
{
    unsigned char t[8];
    for (int i = 0; i < bytes; i++)
        t[i] = (unsigned char)(v >> (8 * i));
    put(b, t, (size_t)bytes);
}

static void put_u16(struct buf *b, uint16_t v) { put_le(b, v, 2); }
static void put_u32(struct buf *b, uint32_t v) { put_le(b, v, 4); }
static void put_u64(struct buf *b, uint64_t v) { put_le(b, v, 8); }

static void put_f32(struct buf *b, float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    put_u32(b, u);
}

static void put_f64(struct buf *b, double d)
{
    uint64_t u;
    memcpy(&u, &d, 8);
    put_u64(b, u);
}

static void put_strn(struct buf *b, const char *s, size_t n)
{
    put_u64(b, n);
    put(b, s, n);
}

static void put_str(struct buf *b, const char *s)
{
    put_strn(b, s, strlen(s));
}

static void pad_to(struct buf *b, uint32_t align)
{
    while (b->n % align)
        put_u8(b, 0);
}

/* An image under construction: key/values, tensor infos and the data section apart, joined
 * by gg_image with the header counts taken from what was added. */
struct gg {
    struct buf kv, ti, data;
    uint64_t n_kv, n_tensors;
    uint32_t align; /* where gg_tensor places data; set general.alignment with gg_align */
};

static void gg_init(struct gg *g)
{
    memset(g, 0, sizeof *g);
    g->align = 32;
}

static void gg_free(struct gg *g)
{
    free(g->kv.p);
    free(g->ti.p);
    free(g->data.p);
}

/* Writes a key and its type; the caller appends the value. */
static struct buf *kv_begin(struct gg *g, const char *key, uint32_t type)
{
    g->n_kv++;
    put_str(&g->kv, key);
    put_u32(&g->kv, type);
    return &g->kv;
}

/* An array key: element type and count; the caller appends the elements. */
static struct buf *kv_array(struct gg *g, const char *key, uint32_t elem_type, uint64_t n)
{
    struct buf *b = kv_begin(g, key, KVGGUF_ARRAY);
    put_u32(b, elem_type);
    put_u64(b, n);
    return b;
}

static void kv_u32(struct gg *g, const char *key, uint32_t v)
{
    put_u32(kv_begin(g, key, KVGGUF_UINT32), v);
}

static void kv_str(struct gg *g, const char *key, const char *s)
{
    put_str(kv_begin(g, key, KVGGUF_STRING), s);
}

static void gg_align(struct gg *g, uint32_t align)
{
    kv_u32(g, "general.alignment", align);
    g->align = align;
}

/* A tensor info as given (n_dims dims of ne, type, offset), no data. */
static void gg_info(struct gg *g, const char *name, uint32_t n_dims, const uint64_t *ne,
                    uint32_t type, uint64_t offset)
{
    g->n_tensors++;
    put_str(&g->ti, name);
    put_u32(&g->ti, n_dims);
    for (uint32_t d = 0; d < n_dims; d++)
        put_u64(&g->ti, ne[d]);
    put_u32(&g->ti, type);
    put_u64(&g->ti, offset);
}

/* A tensor with its bytes at the next aligned offset of the data section; returns the offset. */
static uint64_t gg_tensor(struct gg *g, const char *name, uint32_t type, uint32_t n_dims,
                          const uint64_t *ne, const void *bytes, size_t nbytes)
{
    pad_to(&g->data, g->align);
    uint64_t off = g->data.n;
    put(&g->data, bytes, nbytes);
    gg_info(g, name, n_dims, ne, type, off);
    return off;
}

/* Header, key/values, tensor infos, padding to the alignment (when there is data), data. */
static unsigned char *gg_image(const struct gg *g, size_t *size, size_t *data_offset)
{
    struct buf b = {0};
    put(&b, "GGUF", 4);
    put_u32(&b, 3);
    put_u64(&b, g->n_tensors);
    put_u64(&b, g->n_kv);
    put(&b, g->kv.p, g->kv.n);
    put(&b, g->ti.p, g->ti.n);
    if (g->data.n)
        pad_to(&b, g->align);
    if (data_offset)
        *data_offset = b.n;
    put(&b, g->data.p, g->data.n);
    *size = b.n;
    return b.p ? b.p : xmalloc(1);
}

static void patch_le(unsigned char *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* Bytes of n elements of the ggml types the tests write (the test's own table). */
static size_t type_bytes(uint32_t type, uint64_t n)
{
    switch (type) {
    case KVGGUF_T_F32: return (size_t)n * 4;
    case KVGGUF_T_F16:
    case KVGGUF_T_BF16: return (size_t)n * 2;
    case KVGGUF_T_Q4_0: return (size_t)n / 32 * 18;
    case KVGGUF_T_Q4_1: return (size_t)n / 32 * 20;
    case KVGGUF_T_Q5_0: return (size_t)n / 32 * 22;
    case KVGGUF_T_Q5_1: return (size_t)n / 32 * 24;
    case KVGGUF_T_Q8_0: return (size_t)n / 32 * 34;
    case 12: return (size_t)n / 256 * 144; /* Q4_K */
    default: fail_msg("type_bytes: type %u", type); return 0;
    }
}

/* ---- Metadata round trip ---------------------------------------------------------------- */

static unsigned char *all_types_image(size_t *size)
{
    struct gg g;
    gg_init(&g);
    put_u8(kv_begin(&g, "t.u8", KVGGUF_UINT8), 200);
    put_u8(kv_begin(&g, "t.i8", KVGGUF_INT8), (uint8_t)(int8_t)-100);
    put_u16(kv_begin(&g, "t.u16", KVGGUF_UINT16), 60000);
    put_u16(kv_begin(&g, "t.i16", KVGGUF_INT16), (uint16_t)(int16_t)-30000);
    put_u32(kv_begin(&g, "t.u32", KVGGUF_UINT32), 4000000000u);
    put_u32(kv_begin(&g, "t.i32", KVGGUF_INT32), (uint32_t)(int32_t)-2000000000);
    put_f32(kv_begin(&g, "t.f32", KVGGUF_FLOAT32), 1.5f);
    put_u8(kv_begin(&g, "t.bool", KVGGUF_BOOL), 1);
    put_u8(kv_begin(&g, "t.false", KVGGUF_BOOL), 0);
    put_str(kv_begin(&g, "t.str", KVGGUF_STRING), "h\xc3\xa9llo");
    put_str(kv_begin(&g, "t.empty_str", KVGGUF_STRING), "");
    put_u64(kv_begin(&g, "t.u64", KVGGUF_UINT64), UINT64_C(1) << 40);
    put_u64(kv_begin(&g, "t.u64max", KVGGUF_UINT64), UINT64_MAX);
    put_u64(kv_begin(&g, "t.i64", KVGGUF_INT64), (uint64_t)-(INT64_C(1) << 40));
    put_u64(kv_begin(&g, "t.i64min", KVGGUF_INT64), (uint64_t)INT64_MIN);
    put_u64(kv_begin(&g, "t.i64small", KVGGUF_INT64), 7);
    put_f64(kv_begin(&g, "t.f64", KVGGUF_FLOAT64), 0.1);
    put_f64(kv_begin(&g, "t.f64huge", KVGGUF_FLOAT64), 1e300);

    struct buf *b = kv_array(&g, "a.str", KVGGUF_STRING, 4);
    put_str(b, "first");
    put_str(b, "");
    put_strn(b, "with\0nul", 8); /* NUL bytes are allowed inside values */
    put_str(b, "\xe2\x9c\x93 last");
    b = kv_array(&g, "a.i32", KVGGUF_INT32, 3);
    put_u32(b, 1);
    put_u32(b, (uint32_t)-2);
    put_u32(b, (uint32_t)INT32_MIN);
    b = kv_array(&g, "a.u8", KVGGUF_UINT8, 3);
    put_u8(b, 0);
    put_u8(b, 255);
    put_u8(b, 7);
    b = kv_array(&g, "a.u64", KVGGUF_UINT64, 2);
    put_u64(b, 5);
    put_u64(b, 2147483647);
    b = kv_array(&g, "a.u64big", KVGGUF_UINT64, 2);
    put_u64(b, 5);
    put_u64(b, 2147483648u);
    b = kv_array(&g, "a.i16", KVGGUF_INT16, 2);
    put_u16(b, (uint16_t)(int16_t)-32768);
    put_u16(b, 32767);
    b = kv_array(&g, "a.f32", KVGGUF_FLOAT32, 2);
    put_f32(b, -0.25f);
    put_f32(b, 3e38f);
    b = kv_array(&g, "a.f64", KVGGUF_FLOAT64, 2);
    put_f64(b, 0.1);
    put_f64(b, -2.5);
    b = kv_array(&g, "a.bool", KVGGUF_BOOL, 2);
    put_u8(b, 1);
    put_u8(b, 0);
    kv_array(&g, "a.empty", KVGGUF_INT32, 0);
    kv_array(&g, "a.empty_str", KVGGUF_STRING, 0);

    unsigned char *img = gg_image(&g, size, NULL);
    gg_free(&g);
    return img;
}

static void test_metadata(void **state)
{
    (void)state;
    size_t size;
    unsigned char *img = all_types_image(&size);
    struct kvgguf_file *f = NULL;
    expect_ok(kvgguf_open_memory(img, size, "meta.gguf", &f));
    assert_string_equal(kvgguf_path(f), "meta.gguf");
    assert_int_equal(kvgguf_tensor_count(f), 0);
    assert_int_equal(kvgguf_kv_count(f), 29);

    /* Keys in file order, with their types. */
    enum kvgguf_type ty;
    assert_string_equal(kvgguf_kv_key(f, 0, &ty), "t.u8");
    assert_int_equal(ty, KVGGUF_UINT8);
    assert_string_equal(kvgguf_kv_key(f, 9, &ty), "t.str");
    assert_int_equal(ty, KVGGUF_STRING);
    assert_string_equal(kvgguf_kv_key(f, 18, &ty), "a.str");
    assert_int_equal(ty, KVGGUF_ARRAY);
    assert_null(kvgguf_kv_key(f, 29, &ty));
    assert_true(kvgguf_has(f, "t.f64"));
    assert_false(kvgguf_has(f, "t.f6"));
    assert_false(kvgguf_has(f, "t.f64x"));

    /* Integer getters take any integer type whose value fits. */
    uint32_t u = 0;
    int64_t i64 = 0;
    expect_ok(kvgguf_get_u32(f, "t.u8", &u));
    assert_int_equal(u, 200);
    expect_ok(kvgguf_get_u32(f, "t.u16", &u));
    assert_int_equal(u, 60000);
    expect_ok(kvgguf_get_u32(f, "t.u32", &u));
    assert_int_equal(u, 4000000000u);
    expect_ok(kvgguf_get_u32(f, "t.i64small", &u));
    assert_int_equal(u, 7);
    expect_error(kvgguf_get_u32(f, "t.i8", &u), KVCAP_ERR_FORMAT, "meta.gguf: key 't.i8'",
                 "-100 does not fit in uint32");
    expect_error(kvgguf_get_u32(f, "t.i32", &u), KVCAP_ERR_FORMAT, "key 't.i32'",
                 "-2000000000 does not fit");
    expect_error(kvgguf_get_u32(f, "t.u64", &u), KVCAP_ERR_FORMAT, "key 't.u64'",
                 "1099511627776 does not fit in uint32");
    expect_error(kvgguf_get_u32(f, "t.f32", &u), KVCAP_ERR_FORMAT, "key 't.f32'",
                 "type is float32, expected an integer");
    expect_error(kvgguf_get_u32(f, "t.bool", &u), KVCAP_ERR_FORMAT, "key 't.bool'",
                 "type is bool");
    expect_error(kvgguf_get_u32(f, "a.u8", &u), KVCAP_ERR_FORMAT, "key 'a.u8'",
                 "type is array of uint8");
    expect_error(kvgguf_get_u32(f, "t.nope", &u), KVCAP_ERR_NOT_FOUND,
                 "meta.gguf: key 't.nope'", "absent");

    static const struct {
        const char *key;
        int64_t v;
    } ints[] = {{"t.u8", 200},        {"t.i8", -100},
                {"t.u16", 60000},     {"t.i16", -30000},
                {"t.u32", 4000000000}, {"t.i32", -2000000000},
                {"t.u64", INT64_C(1) << 40}, {"t.i64", -(INT64_C(1) << 40)},
                {"t.i64min", INT64_MIN}, {"t.i64small", 7}};
    for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++) {
        expect_ok(kvgguf_get_i64(f, ints[k].key, &i64));
        if (i64 != ints[k].v)
            fail_msg("%s = %lld, expected %lld", ints[k].key, (long long)i64,
                     (long long)ints[k].v);
    }
    expect_error(kvgguf_get_i64(f, "t.u64max", &i64), KVCAP_ERR_FORMAT, "key 't.u64max'",
                 "18446744073709551615 does not fit in int64");
    expect_error(kvgguf_get_i64(f, "t.str", &i64), KVCAP_ERR_FORMAT, "key 't.str'",
                 "type is string");

    float x = 0;
    expect_ok(kvgguf_get_f32(f, "t.f32", &x));
    assert_true(x == 1.5f);
    expect_ok(kvgguf_get_f32(f, "t.f64", &x));
    assert_true(x == 0.1f);
    expect_error(kvgguf_get_f32(f, "t.f64huge", &x), KVCAP_ERR_FORMAT, "key 't.f64huge'",
                 "does not fit in float32");
    expect_error(kvgguf_get_f32(f, "t.u32", &x), KVCAP_ERR_FORMAT, "key 't.u32'",
                 "expected float32 or float64");
    expect_error(kvgguf_get_f32(f, "nope", &x), KVCAP_ERR_NOT_FOUND, "key 'nope'", NULL);

    int bv = -1;
    expect_ok(kvgguf_get_bool(f, "t.bool", &bv));
    assert_int_equal(bv, 1);
    expect_ok(kvgguf_get_bool(f, "t.false", &bv));
    assert_int_equal(bv, 0);
    expect_error(kvgguf_get_bool(f, "t.u8", &bv), KVCAP_ERR_FORMAT, "key 't.u8'",
                 "type is uint8, expected bool");

    struct kvgguf_str s;
    expect_ok(kvgguf_get_str(f, "t.str", &s));
    assert_int_equal(s.n, 6);
    assert_memory_equal(s.s, "h\xc3\xa9llo", 6);
    assert_true((const unsigned char *)s.s > img && (const unsigned char *)s.s < img + size);
    expect_ok(kvgguf_get_str(f, "t.empty_str", &s));
    assert_int_equal(s.n, 0);
    expect_error(kvgguf_get_str(f, "a.str", &s), KVCAP_ERR_FORMAT, "key 'a.str'",
                 "type is array of string, expected string");
    expect_error(kvgguf_get_str(f, "t.u8", &s), KVCAP_ERR_FORMAT, "key 't.u8'", NULL);

    /* Arrays. */
    enum kvgguf_type et;
    uint64_t n = 0;
    expect_ok(kvgguf_get_array(f, "a.str", &et, &n));
    assert_int_equal(et, KVGGUF_STRING);
    assert_int_equal(n, 4);
    static const struct {
        const char *s;
        size_t n;
    } strs[] = {{"first", 5}, {"", 0}, {"with\0nul", 8}, {"\xe2\x9c\x93 last", 8}};
    for (uint64_t i = 0; i < 4; i++) {
        expect_ok(kvgguf_array_str(f, "a.str", i, &s));
        assert_int_equal(s.n, strs[i].n);
        assert_memory_equal(s.s, strs[i].s, strs[i].n);
    }
    expect_error(kvgguf_array_str(f, "a.str", 4, &s), KVCAP_ERR_INVALID_ARGUMENT, "key 'a.str'",
                 "index 4");
    expect_error(kvgguf_array_str(f, "a.i32", 0, &s), KVCAP_ERR_FORMAT, "key 'a.i32'",
                 "type is array of int32, expected array of string");
    expect_error(kvgguf_array_str(f, "t.str", 0, &s), KVCAP_ERR_FORMAT, "key 't.str'", NULL);
    expect_error(kvgguf_array_str(f, "a.none", 0, &s), KVCAP_ERR_NOT_FOUND, "key 'a.none'",
                 NULL);
    expect_error(kvgguf_get_array(f, "t.u8", &et, &n), KVCAP_ERR_FORMAT, "key 't.u8'",
                 "expected an array");
    expect_ok(kvgguf_get_array(f, "a.empty_str", &et, &n));
    assert_int_equal(n, 0);
    expect_error(kvgguf_array_str(f, "a.empty_str", 0, &s), KVCAP_ERR_INVALID_ARGUMENT,
                 "key 'a.empty_str'", NULL);

    int32_t iv[3];
    expect_ok(kvgguf_array_i32(f, "a.i32", iv, 3));
    assert_int_equal(iv[0], 1);
    assert_int_equal(iv[1], -2);
    assert_int_equal(iv[2], INT32_MIN);
    expect_ok(kvgguf_array_i32(f, "a.u8", iv, 3));
    assert_int_equal(iv[1], 255);
    expect_ok(kvgguf_array_i32(f, "a.u64", iv, 2));
    assert_int_equal(iv[1], INT32_MAX);
    expect_ok(kvgguf_array_i32(f, "a.i16", iv, 2));
    assert_int_equal(iv[0], -32768);
    expect_error(kvgguf_array_i32(f, "a.u64big", iv, 2), KVCAP_ERR_FORMAT, "key 'a.u64big'",
                 "element 1 (uint64 2147483648) does not fit in int32");
    expect_error(kvgguf_array_i32(f, "a.bool", iv, 2), KVCAP_ERR_FORMAT, "key 'a.bool'",
                 "array of bool");
    expect_error(kvgguf_array_i32(f, "a.f32", iv, 2), KVCAP_ERR_FORMAT, "key 'a.f32'", NULL);
    expect_error(kvgguf_array_i32(f, "a.i32", iv, 2), KVCAP_ERR_INVALID_ARGUMENT, "key 'a.i32'",
                 "has 3 elements");
    expect_error(kvgguf_array_i32(f, "t.i32", iv, 1), KVCAP_ERR_FORMAT, "key 't.i32'", NULL);
    expect_ok(kvgguf_array_i32(f, "a.empty", NULL, 0));

    float fv[2];
    expect_ok(kvgguf_array_f32(f, "a.f32", fv, 2));
    assert_true(fv[0] == -0.25f && fv[1] == 3e38f);
    expect_ok(kvgguf_array_f32(f, "a.f64", fv, 2));
    assert_true(fv[0] == 0.1f && fv[1] == -2.5f);
    expect_error(kvgguf_array_f32(f, "a.i32", fv, 3), KVCAP_ERR_FORMAT, "key 'a.i32'",
                 "expected array of float32 or float64");
    expect_error(kvgguf_array_f32(f, "a.f32", fv, 1), KVCAP_ERR_INVALID_ARGUMENT, "key 'a.f32'",
                 NULL);

    /* NULL handles are harmless. */
    assert_false(kvgguf_has(NULL, "x"));
    assert_int_equal(kvgguf_kv_count(NULL), 0);
    assert_null(kvgguf_tensor_find(f, "x"));
    assert_null(kvgguf_tensor_at(f, 0));
    assert_null(kvgguf_path(NULL));
    expect_error(kvgguf_get_u32(NULL, "x", &u), KVCAP_ERR_INVALID_ARGUMENT, NULL, NULL);
    kvgguf_close(f);
    kvgguf_close(NULL);
    free(img);
}

/* ---- Tensors and alignment -------------------------------------------------------------- */

struct tspec {
    const char *name;
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne[4];
};

static const struct tspec layout_specs[] = {
    {"token_embd.weight", KVGGUF_T_F16, 2, {5, 3}},
    {"blk.0.attn_norm.weight", KVGGUF_T_F32, 1, {7}},
    {"blk.0.attn_q.weight", KVGGUF_T_Q8_0, 2, {64, 2}},
    {"blk.0.ffn_down.weight", 12 /* Q4_K */, 2, {256, 1}},
    {"cube", KVGGUF_T_BF16, 3, {3, 1, 2}},
    {"four", KVGGUF_T_Q4_1, 4, {32, 1, 2, 1}},
};
#define N_LAYOUT (sizeof layout_specs / sizeof layout_specs[0])

static void check_layout(uint32_t align)
{
    struct gg g;
    gg_init(&g);
    kv_str(&g, "general.architecture", "llama");
    if (align != 32)
        gg_align(&g, align);
    uint64_t offs[N_LAYOUT];
    unsigned seed = 1;
    for (size_t i = 0; i < N_LAYOUT; i++) {
        const struct tspec *sp = &layout_specs[i];
        uint64_t count = 1;
        for (uint32_t d = 0; d < sp->n_dims; d++)
            count *= sp->ne[d];
        size_t nb = type_bytes(sp->type, count);
        unsigned char *bytes = xmalloc(nb);
        for (size_t k = 0; k < nb; k++)
            bytes[k] = (unsigned char)(seed++ * 37u);
        offs[i] = gg_tensor(&g, sp->name, sp->type, sp->n_dims, sp->ne, bytes, nb);
        free(bytes);
    }
    size_t size, data_offset;
    unsigned char *img = gg_image(&g, &size, &data_offset);
    assert_int_equal(data_offset % align, 0);

    struct kvgguf_file *f;
    expect_ok(kvgguf_open_memory(img, size, "layout.gguf", &f));
    assert_int_equal(kvgguf_tensor_count(f), N_LAYOUT);
    /* Keys stay valid after the tensor names were stored beside them. */
    struct kvgguf_str arch;
    expect_ok(kvgguf_get_str(f, "general.architecture", &arch));
    assert_true(arch.n == 5 && memcmp(arch.s, "llama", 5) == 0);
    uint32_t got_align = 0;
    if (align != 32) {
        expect_ok(kvgguf_get_u32(f, "general.alignment", &got_align));
        assert_int_equal(got_align, align);
    }
    seed = 1;
    for (size_t i = 0; i < N_LAYOUT; i++) {
        const struct tspec *sp = &layout_specs[i];
        const struct kvgguf_tensor *t = kvgguf_tensor_at(f, i); /* file order */
        assert_non_null(t);
        assert_string_equal(t->name, sp->name);
        assert_ptr_equal(kvgguf_tensor_find(f, sp->name), t);
        assert_int_equal(t->n_dims, (int)sp->n_dims);
        assert_int_equal(t->type, sp->type);
        uint64_t count = 1;
        for (int d = 0; d < KVGGUF_MAX_DIMS; d++) {
            int64_t want = d < (int)sp->n_dims ? (int64_t)sp->ne[d] : 1;
            assert_int_equal(t->ne[d], want);
            count *= (uint64_t)want;
        }
        assert_int_equal(t->n_elements, count);
        assert_int_equal(t->nbytes, type_bytes(sp->type, count));
        /* Where the writer put it, at a multiple of the alignment, with the bytes written. */
        const unsigned char *p = t->data;
        assert_ptr_equal(p, img + data_offset + offs[i]);
        assert_int_equal((size_t)(p - img) % align, 0);
        for (size_t k = 0; k < t->nbytes; k++)
            if (p[k] != (unsigned char)(seed++ * 37u))
                fail_msg("tensor %s: byte %zu differs", t->name, k);
    }
    assert_null(kvgguf_tensor_at(f, N_LAYOUT));
    assert_null(kvgguf_tensor_find(f, "blk.0"));
    assert_null(kvgguf_tensor_find(f, NULL));

    /* Known but not dequantisable: UNSUPPORTED naming the tensor and the type. */
    const struct kvgguf_tensor *qk = kvgguf_tensor_find(f, "blk.0.ffn_down.weight");
    float *out = xmalloc(256 * sizeof(float));
    expect_error(kvgguf_dequantize(qk, out), KVCAP_ERR_UNSUPPORTED,
                 "tensor 'blk.0.ffn_down.weight'", "Q4_K");
    free(out);
    assert_string_equal(kvgguf_type_name(KVGGUF_T_Q4_1), "Q4_1");
    assert_string_equal(kvgguf_type_name(12), "Q4_K");
    assert_string_equal(kvgguf_type_name(KVGGUF_T_BF16), "BF16");
    assert_string_equal(kvgguf_type_name(4), "?");
    assert_string_equal(kvgguf_type_name(1000), "?");
    kvgguf_close(f);
    free(img);
    gg_free(&g);
}

static void test_tensors_default_alignment(void **state)
{
    (void)state;
    check_layout(32);
}

static void test_tensors_alignment_64(void **state)
{
    (void)state;
    check_layout(64);
}

static void test_tensors_alignment_extremes(void **state)
{
    (void)state;
    check_layout(1);
    check_layout(4096);
}

/* kvgguf_open: the mapped file behaves as the memory image; I/O errors name the path. */
static void test_open_file(void **state)
{
    (void)state;
    char dir[512], path[600];
    assert_true(test_tmpdir(dir, sizeof dir, "gguf"));
    struct gg g;
    gg_init(&g);
    kv_str(&g, "general.architecture", "llama");
    float w[8] = {1, 2, 3, 4, 5, 6, 7, -8};
    gg_tensor(&g, "w", KVGGUF_T_F32, 1, (uint64_t[]){8}, w, sizeof w);
    size_t size;
    unsigned char *img = gg_image(&g, &size, NULL);
    snprintf(path, sizeof path, "%s/ok.gguf", dir);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(img, 1, size, fp), size);
    assert_int_equal(fclose(fp), 0);

    struct kvgguf_file *f;
    expect_ok(kvgguf_open(path, &f));
    assert_string_equal(kvgguf_path(f), path);
    float out[8];
    expect_ok(kvgguf_dequantize(kvgguf_tensor_find(f, "w"), out));
    assert_memory_equal(out, w, sizeof w);
    kvgguf_close(f);

    snprintf(path, sizeof path, "%s/missing.gguf", dir);
    f = (struct kvgguf_file *)&f;
    expect_error(kvgguf_open(path, &f), KVCAP_ERR_IO, path, "cannot open");
    assert_null(f);
    expect_error(kvgguf_open(dir, &f), KVCAP_ERR_IO, dir, "not a regular file");
    snprintf(path, sizeof path, "%s/short.gguf", dir);
    fp = fopen(path, "wb");
    assert_non_null(fp);
    fputs("GG", fp);
    fclose(fp);
    expect_error(kvgguf_open(path, &f), KVCAP_ERR_FORMAT, path, "too short for the magic");
    expect_error(kvgguf_open("", &f), KVCAP_ERR_INVALID_ARGUMENT, NULL, NULL);
    expect_error(kvgguf_open_memory(NULL, 5, "x", &f), KVCAP_ERR_INVALID_ARGUMENT, NULL, NULL);
    expect_error(kvgguf_open_memory(NULL, 0, NULL, &f), KVCAP_ERR_FORMAT, "(memory)", NULL);
    free(img);
    gg_free(&g);
    test_rm_tree(dir);
}

/* ---- Dequantisation --------------------------------------------------------------------- */

/* f16 scales with their exact values, chosen to cover negative, fractional and subnormal. */
static const struct {
    uint16_t bits;
    double v;
} f16s[] = {
    {0x3800, 0.5},           {0xbc00, -1.0},     {0x2e66, 0.0999755859375},
    {0xc500, -5.0},          {0x0001, 0x1p-24},  {0x1400, 0.0009765625},
    {0xb400, -0.25},         {0xb266, -0.199951171875}, {0x0000, 0.0},
    {0x3c00, 1.0},           {0xc000, -2.0},     {0x7bff, 65504.0},
};
#define N_F16S (sizeof f16s / sizeof f16s[0])

static uint32_t lcg(uint32_t *s)
{
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

/* Codes for one block: random in [0, levels) with the extremes pinned at fixed places
 * (0 and levels-1 in both halves; for 5-bit codes also 15 and 16 around the high bit). */
static void block_codes(uint32_t *s, int levels, int *q)
{
    for (int j = 0; j < 32; j++)
        q[j] = (int)(lcg(s) % (uint32_t)levels);
    q[0] = 0;
    q[1] = levels - 1;
    q[16] = levels - 1;
    q[31] = 0;
    if (levels == 32) {
        q[2] = 15;
        q[3] = 16;
        q[17] = 16;
        q[18] = 15;
    }
}

/* Builds `nb` blocks of `type` and the floats they must decode to; returns the packed bytes. */
static unsigned char *pack_blocks(uint32_t type, size_t nb, float *expect)
{
    size_t bs = type_bytes(type, 32);
    unsigned char *out = xmalloc(nb * bs);
    uint32_t seed = 1234u + type;
    for (size_t b = 0; b < nb; b++) {
        unsigned char *blk = out + b * bs;
        float *e = expect + 32 * b;
        size_t di = b % N_F16S, mi = (b * 5 + 3) % N_F16S;
        double d = f16s[di].v, m = f16s[mi].v;
        int q[32];
        switch (type) {
        case KVGGUF_T_Q4_0:
            block_codes(&seed, 16, q);
            patch_le(blk, f16s[di].bits, 2);
            for (int j = 0; j < 16; j++)
                blk[2 + j] = (unsigned char)(q[j] | q[j + 16] << 4);
            for (int j = 0; j < 32; j++)
                e[j] = (float)((q[j] - 8) * d);
            break;
        case KVGGUF_T_Q4_1:
            block_codes(&seed, 16, q);
            patch_le(blk, f16s[di].bits, 2);
            patch_le(blk + 2, f16s[mi].bits, 2);
            for (int j = 0; j < 16; j++)
                blk[4 + j] = (unsigned char)(q[j] | q[j + 16] << 4);
            for (int j = 0; j < 32; j++)
                e[j] = (float)(q[j] * d + m);
            break;
        case KVGGUF_T_Q5_0:
        case KVGGUF_T_Q5_1: {
            int has_m = type == KVGGUF_T_Q5_1;
            block_codes(&seed, 32, q);
            patch_le(blk, f16s[di].bits, 2);
            if (has_m)
                patch_le(blk + 2, f16s[mi].bits, 2);
            unsigned char *qh = blk + (has_m ? 4 : 2), *qs = qh + 4;
            uint32_t hb = 0; /* bit j: the fifth bit of weight j */
            for (int j = 0; j < 32; j++)
                hb |= (uint32_t)(q[j] >> 4) << j;
            patch_le(qh, hb, 4);
            for (int j = 0; j < 16; j++)
                qs[j] = (unsigned char)((q[j] & 15) | (q[j + 16] & 15) << 4);
            for (int j = 0; j < 32; j++)
                e[j] = has_m ? (float)(q[j] * d + m) : (float)((q[j] - 16) * d);
            break;
        }
        case KVGGUF_T_Q8_0:
            patch_le(blk, f16s[di].bits, 2);
            for (int j = 0; j < 32; j++) {
                int v = (int)(lcg(&seed) % 256u) - 128;
                if (j == 0)
                    v = -128;
                if (j == 1)
                    v = 127;
                blk[2 + j] = (unsigned char)(int8_t)v;
                e[j] = (float)(v * d);
            }
            break;
        default:
            fail_msg("pack_blocks: type %u", type);
        }
    }
    return out;
}

static void check_dequant(const struct kvgguf_tensor *t, const float *expect)
{
    float *out = xmalloc((size_t)t->n_elements * sizeof(float));
    expect_ok(kvgguf_dequantize(t, out));
    for (size_t i = 0; i < t->n_elements; i++)
        if (!(out[i] == expect[i]))
            fail_msg("tensor %s (%s): element %zu = %.9g, expected %.9g", t->name,
                     kvgguf_type_name(t->type), i, (double)out[i], (double)expect[i]);
    free(out);
}

static void test_dequantize(void **state)
{
    (void)state;
    static const uint32_t qtypes[] = {KVGGUF_T_Q4_0, KVGGUF_T_Q4_1, KVGGUF_T_Q5_0,
                                      KVGGUF_T_Q5_1, KVGGUF_T_Q8_0};
    enum { NQ = sizeof qtypes / sizeof qtypes[0], NB = 24 }; /* 24 blocks: every scale twice */
    float *expect[NQ + 3];
    struct gg g;
    gg_init(&g);
    for (int k = 0; k < NQ; k++) {
        expect[k] = xmalloc(NB * 32 * sizeof(float));
        unsigned char *blocks = pack_blocks(qtypes[k], NB, expect[k]);
        char name[32];
        snprintf(name, sizeof name, "q.%s", kvgguf_type_name(qtypes[k]));
        gg_tensor(&g, name, qtypes[k], 3, (uint64_t[]){64, 3, 4}, blocks,
                  type_bytes(qtypes[k], NB * 32));
        free(blocks);
    }
    /* Float types: patterns with known values. */
    static const struct {
        uint16_t bits;
        float v;
    } h[] = {{0x3c00, 1.0f},      {0xc100, -2.5f},    {0x7bff, 65504.0f}, {0x0001, 0x1p-24f},
             {0x8000, -0.0f},     {0x03ff, 0x3ffp-24f}, {0x7c00, INFINITY}, {0x3555, 0x1.554p-2f}};
    static const struct {
        uint16_t bits;
        float v;
    } bf[] = {{0x3f80, 1.0f}, {0xc020, -2.5f}, {0x4049, 3.140625f}, {0x0001, 0x1p-133f},
              {0xff80, -INFINITY}, {0x7f7f, 0x1.fep127f}};
    unsigned char hb[16], bb[12];
    float *eh = expect[NQ] = xmalloc(sizeof h / sizeof h[0] * sizeof(float));
    float *eb = expect[NQ + 1] = xmalloc(sizeof bf / sizeof bf[0] * sizeof(float));
    for (size_t i = 0; i < 8; i++) {
        patch_le(hb + 2 * i, h[i].bits, 2);
        eh[i] = h[i].v;
    }
    for (size_t i = 0; i < 6; i++) {
        patch_le(bb + 2 * i, bf[i].bits, 2);
        eb[i] = bf[i].v;
    }
    gg_tensor(&g, "f16", KVGGUF_T_F16, 2, (uint64_t[]){4, 2}, hb, sizeof hb);
    gg_tensor(&g, "bf16", KVGGUF_T_BF16, 1, (uint64_t[]){6}, bb, sizeof bb);
    float f32v[5] = {1.5f, -0.0f, 3e-40f, -1e30f, 7.0f};
    expect[NQ + 2] = xmalloc(sizeof f32v);
    memcpy(expect[NQ + 2], f32v, sizeof f32v);
    gg_tensor(&g, "f32", KVGGUF_T_F32, 1, (uint64_t[]){5}, f32v, sizeof f32v);

    size_t size;
    unsigned char *img = gg_image(&g, &size, NULL);
    /* Once from the image as built and once shifted by one byte: nothing may assume the
     * caller's buffer is aligned. */
    unsigned char *shifted = xmalloc(size + 1);
    memcpy(shifted + 1, img, size);
    const unsigned char *images[2] = {img, shifted + 1};
    for (int r = 0; r < 2; r++) {
        struct kvgguf_file *f;
        expect_ok(kvgguf_open_memory(images[r], size, "dq.gguf", &f));
        assert_int_equal(kvgguf_tensor_count(f), NQ + 3);
        for (size_t k = 0; k < NQ + 3; k++)
            check_dequant(kvgguf_tensor_at(f, k), expect[k]);
        /* -0 stays -0 (F16 0x8000) and F16 inf stays inf: compare bits where == cannot. */
        float o[8];
        expect_ok(kvgguf_dequantize(kvgguf_tensor_find(f, "f16"), o));
        assert_true(signbit(o[4]) && isinf(o[6]));
        kvgguf_close(f);
    }
    free(shifted);
    free(img);
    for (int k = 0; k < NQ + 3; k++)
        free(expect[k]);
    gg_free(&g);

    /* A hand-made tensor of an unknown type number, and NULLs. */
    struct kvgguf_tensor t = {.name = "odd", .n_dims = 1, .ne = {32, 1, 1, 1}, .type = 1000,
                              .n_elements = 32, .nbytes = 0, .data = hb};
    float o[32];
    expect_error(kvgguf_dequantize(&t, o), KVCAP_ERR_UNSUPPORTED, "tensor 'odd'", "(1000)");
    expect_error(kvgguf_dequantize(NULL, o), KVCAP_ERR_INVALID_ARGUMENT, NULL, NULL);
}

/* ---- Bad-file corpus -------------------------------------------------------------------- */

/* The valid image most bad cases start from: two keys, then tensor 'a' (F32 [8]) and tensor
 * 'b' (Q8_0 [32, 2]) at data offsets 0 and 32. */
static void base_kvs(struct gg *g)
{
    kv_str(g, "general.architecture", "llama");
    kv_u32(g, "llama.block_count", 2);
}

static void base_tensors(struct gg *g)
{
    unsigned char zeros[68] = {0};
    gg_tensor(g, "a", KVGGUF_T_F32, 1, (uint64_t[]){8}, zeros, 32);
    gg_tensor(g, "b", KVGGUF_T_Q8_0, 2, (uint64_t[]){32, 2}, zeros, 68);
}

static unsigned char *finish(struct gg *g, size_t *size)
{
    unsigned char *img = gg_image(g, size, NULL);
    gg_free(g);
    return img;
}

static unsigned char *base_image(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    base_tensors(&g);
    return finish(&g, size);
}

static unsigned char *bad_magic(size_t *size)
{
    unsigned char *img = base_image(size);
    memcpy(img, "GGML", 4);
    return img;
}

static unsigned char *bad_version(size_t *size, uint32_t v)
{
    unsigned char *img = base_image(size);
    patch_le(img + 4, v, 4);
    return img;
}

static unsigned char *bad_version2(size_t *size) { return bad_version(size, 2); }
static unsigned char *bad_version4(size_t *size) { return bad_version(size, 4); }
static unsigned char *bad_version_be(size_t *size) { return bad_version(size, 0x03000000); }

static unsigned char *bad_n_kv_huge(size_t *size)
{
    unsigned char *img = base_image(size);
    patch_le(img + 16, 1000, 8);
    return img;
}

static unsigned char *bad_n_tensors_huge(size_t *size)
{
    unsigned char *img = base_image(size);
    patch_le(img + 8, UINT64_C(1) << 60, 8);
    return img;
}

/* n_kv one more than present, in a file without tensors: the next key is past the end. */
static unsigned char *bad_n_kv_past_end(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    kv_str(&g, "c", "a longer string value that pads the file so the count cap passes");
    unsigned char *img = finish(&g, size);
    patch_le(img + 16, 4, 8);
    return img;
}

static unsigned char *bad_string_past_end(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    struct buf *b = kv_begin(&g, "general.name", KVGGUF_STRING);
    put_u64(b, 1000);
    put(b, "short", 5);
    return finish(&g, size);
}

static unsigned char *bad_string_huge(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    struct buf *b = kv_begin(&g, "general.name", KVGGUF_STRING);
    put_u64(b, UINT64_C(1) << 63);
    put(b, "short", 5);
    return finish(&g, size);
}

static unsigned char *bad_key_past_end(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    g.n_kv++;
    put_u64(&g.kv, UINT64_MAX);
    put(&g.kv, "general.x", 9);
    return finish(&g, size);
}

static unsigned char *bad_value_type(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    put_u32(kv_begin(&g, "odd.type", 13), 0);
    base_tensors(&g);
    return finish(&g, size);
}

static unsigned char *bad_elem_type(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    put_u32(kv_array(&g, "odd.array", 77, 1), 0);
    base_tensors(&g);
    return finish(&g, size);
}

static unsigned char *bad_nested_array(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    struct buf *b = kv_array(&g, "nested", KVGGUF_ARRAY, 1);
    put_u32(b, KVGGUF_UINT8);
    put_u64(b, 1);
    put_u8(b, 5);
    base_tensors(&g);
    return finish(&g, size);
}

static unsigned char *bad_array_count(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    put_u32(kv_array(&g, "tokenizer.ggml.token_type", KVGGUF_INT32, UINT64_C(1) << 62), 1);
    base_tensors(&g);
    return finish(&g, size);
}

static unsigned char *bad_string_array_count(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    put_str(kv_array(&g, "tokenizer.ggml.tokens", KVGGUF_STRING, UINT64_MAX), "a");
    base_tensors(&g);
    return finish(&g, size);
}

static unsigned char *bad_string_array_elem(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    struct buf *b = kv_array(&g, "tokenizer.ggml.merges", KVGGUF_STRING, 3);
    put_str(b, "a b");
    put_str(b, "c d");
    put_u64(b, 500);
    put(b, "e f", 3);
    return finish(&g, size);
}

static unsigned char *bad_bool(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    put_u8(kv_begin(&g, "tokenizer.ggml.add_bos_token", KVGGUF_BOOL), 2);
    base_tensors(&g);
    return finish(&g, size);
}

static unsigned char *bad_dup_key(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    kv_u32(&g, "llama.block_count", 3);
    base_tensors(&g);
    return finish(&g, size);
}

static unsigned char *bad_empty_key(size_t *size)
{
    struct gg g;
    gg_init(&g);
    kv_u32(&g, "", 3);
    base_kvs(&g);
    return finish(&g, size);
}

static unsigned char *bad_nul_key(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    g.n_kv++;
    put_strn(&g.kv, "general.a\0b", 11);
    put_u32(&g.kv, KVGGUF_UINT8);
    put_u8(&g.kv, 1);
    return finish(&g, size);
}

static unsigned char *bad_align(size_t *size, uint32_t a)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    kv_u32(&g, "general.alignment", a);
    base_tensors(&g);
    return finish(&g, size);
}

static unsigned char *bad_align_zero(size_t *size) { return bad_align(size, 0); }
static unsigned char *bad_align_48(size_t *size) { return bad_align(size, 48); }

static unsigned char *bad_align_type(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    put_u64(kv_begin(&g, "general.alignment", KVGGUF_UINT64), 32);
    base_tensors(&g);
    return finish(&g, size);
}

/* Tensor 'a' valid, then a second info built from the arguments, data for both. */
static unsigned char *with_info(size_t *size, const char *name, uint32_t n_dims,
                                const uint64_t *ne, uint32_t type, uint64_t offset)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    unsigned char zeros[96] = {0};
    gg_tensor(&g, "a", KVGGUF_T_F32, 1, (uint64_t[]){8}, zeros, 32);
    pad_to(&g.data, 32);
    put(&g.data, zeros, 96);
    gg_info(&g, name, n_dims, ne, type, offset);
    return finish(&g, size);
}

static unsigned char *bad_dup_tensor(size_t *size)
{
    return with_info(size, "a", 1, (uint64_t[]){8}, KVGGUF_T_F32, 32);
}

static unsigned char *bad_empty_name(size_t *size)
{
    return with_info(size, "", 1, (uint64_t[]){8}, KVGGUF_T_F32, 32);
}

static unsigned char *bad_n_dims_0(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 0, NULL, KVGGUF_T_F32, 32);
}

static unsigned char *bad_n_dims_5(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 5, (uint64_t[]){1, 1, 1, 1, 1}, KVGGUF_T_F32,
                     32);
}

static unsigned char *bad_zero_dim(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 2, (uint64_t[]){8, 0}, KVGGUF_T_F32, 32);
}

static unsigned char *bad_dim_huge(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 1, (uint64_t[]){UINT64_C(1) << 63},
                     KVGGUF_T_F32, 32);
}

static unsigned char *bad_dims_overflow(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 3,
                     (uint64_t[]){UINT64_C(1) << 32, UINT64_C(1) << 20, UINT64_C(1) << 20},
                     KVGGUF_T_F32, 32);
}

static unsigned char *bad_bytes_overflow(size_t *size)
{
    /* 2^62 elements is a valid count, but 2^62 F32 values are 2^64 bytes. */
    return with_info(size, "blk.0.attn_q.weight", 2,
                     (uint64_t[]){UINT64_C(1) << 31, UINT64_C(1) << 31}, KVGGUF_T_F32, 32);
}

static unsigned char *bad_row(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 2, (uint64_t[]){33, 1}, KVGGUF_T_Q4_0, 32);
}

static unsigned char *bad_type_1000(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 1, (uint64_t[]){8}, 1000, 32);
}

static unsigned char *bad_type_retired(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 1, (uint64_t[]){32}, 31, 32);
}

static unsigned char *bad_offset_unaligned(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 1, (uint64_t[]){8}, KVGGUF_T_F32, 48);
}

static unsigned char *bad_data_past_end(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 1, (uint64_t[]){32}, KVGGUF_T_F32, 32);
}

static unsigned char *bad_offset_huge(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 1, (uint64_t[]){8}, KVGGUF_T_F32,
                     UINT64_MAX - 31);
}

static unsigned char *bad_overlap(size_t *size)
{
    return with_info(size, "blk.0.attn_q.weight", 1, (uint64_t[]){8}, KVGGUF_T_F32, 0);
}

static unsigned char *bad_overlap_inside(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    g.align = 1;
    kv_u32(&g, "general.alignment", 1);
    unsigned char zeros[64] = {0};
    gg_tensor(&g, "big", KVGGUF_T_F32, 1, (uint64_t[]){16}, zeros, 64);
    put(&g.data, zeros, 16);
    gg_info(&g, "small", 1, (uint64_t[]){2}, KVGGUF_T_F32, 60);
    return finish(&g, size);
}

/* Cut inside tensor 'b''s info: the last 10 bytes are 2 of its type and its offset. */
static unsigned char *bad_truncated_infos(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    base_tensors(&g);
    size_t full;
    unsigned char *img = gg_image(&g, &full, NULL);
    *size = 24 + g.kv.n + g.ti.n - 10;
    gg_free(&g);
    return img;
}

/* Infos end, then the file ends before the padding that starts the data section. */
static unsigned char *bad_no_data_section(size_t *size)
{
    struct gg g;
    gg_init(&g);
    base_kvs(&g);
    base_tensors(&g);
    size_t full;
    unsigned char *img = gg_image(&g, &full, NULL);
    *size = 24 + g.kv.n + g.ti.n;
    assert_true(*size % 32 != 0);
    gg_free(&g);
    return img;
}

static const struct bad_case {
    const char *name;
    unsigned char *(*build)(size_t *size);
    enum kvcap_status status;
    const char *sub1, *sub2;
} bad_cases[] = {
    {"bad_magic", bad_magic, KVCAP_ERR_FORMAT, "header: bad magic 47 47 4d 4c", "not a GGUF"},
    {"version_2", bad_version2, KVCAP_ERR_VERSION, "header: version 2 is not supported", NULL},
    {"version_4", bad_version4, KVCAP_ERR_VERSION, "header: version 4 is not supported", NULL},
    {"version_big_endian", bad_version_be, KVCAP_ERR_VERSION, "version 0x03000000",
     "big-endian"},
    {"n_kv_huge", bad_n_kv_huge, KVCAP_ERR_FORMAT, "header: n_kv 1000 cannot fit", NULL},
    {"n_tensors_huge", bad_n_tensors_huge, KVCAP_ERR_FORMAT,
     "header: n_tensors 1152921504606846976 cannot fit", NULL},
    {"n_kv_past_end", bad_n_kv_past_end, KVCAP_ERR_FORMAT, "key/value 3 (of 4): key needs 8",
     "past the end of the file"},
    {"string_past_end", bad_string_past_end, KVCAP_ERR_FORMAT,
     "key 'general.name': string value length 1000", "runs past the end"},
    {"string_huge", bad_string_huge, KVCAP_ERR_FORMAT,
     "key 'general.name': string value length 9223372036854775808", "runs past the end"},
    {"key_length_huge", bad_key_past_end, KVCAP_ERR_FORMAT,
     "key/value 2 (of 3): key length 18446744073709551615", NULL},
    {"value_type", bad_value_type, KVCAP_ERR_FORMAT, "key 'odd.type': invalid value type 13",
     NULL},
    {"array_elem_type", bad_elem_type, KVCAP_ERR_FORMAT,
     "key 'odd.array': invalid array element type 77", NULL},
    {"nested_array", bad_nested_array, KVCAP_ERR_FORMAT, "key 'nested': array of arrays", NULL},
    {"array_count_huge", bad_array_count, KVCAP_ERR_FORMAT,
     "key 'tokenizer.ggml.token_type': array of 4611686018427387904 int32 values",
     "runs past the end"},
    {"string_array_count_huge", bad_string_array_count, KVCAP_ERR_FORMAT,
     "key 'tokenizer.ggml.tokens': array of 18446744073709551615 strings cannot fit", NULL},
    {"string_array_element", bad_string_array_elem, KVCAP_ERR_FORMAT,
     "key 'tokenizer.ggml.merges': string [2] length 500", NULL},
    {"bool_value", bad_bool, KVCAP_ERR_FORMAT,
     "key 'tokenizer.ggml.add_bos_token': bool value 2 is neither 0 nor 1", NULL},
    {"duplicate_key", bad_dup_key, KVCAP_ERR_FORMAT, "key 'llama.block_count': duplicate key",
     NULL},
    {"empty_key", bad_empty_key, KVCAP_ERR_FORMAT, "key/value 0 (of 3): key is empty", NULL},
    {"nul_in_key", bad_nul_key, KVCAP_ERR_FORMAT, "key 'general.a' contains a NUL byte", NULL},
    {"alignment_zero", bad_align_zero, KVCAP_ERR_FORMAT,
     "key 'general.alignment': 0 is not a power of two", NULL},
    {"alignment_48", bad_align_48, KVCAP_ERR_FORMAT,
     "key 'general.alignment': 48 is not a power of two", NULL},
    {"alignment_type", bad_align_type, KVCAP_ERR_FORMAT,
     "key 'general.alignment': type is uint64, must be uint32", NULL},
    {"duplicate_tensor", bad_dup_tensor, KVCAP_ERR_FORMAT, "tensor 'a': duplicate tensor name",
     NULL},
    {"empty_tensor_name", bad_empty_name, KVCAP_ERR_FORMAT, "tensor 1 (of 2): name is empty",
     NULL},
    {"n_dims_0", bad_n_dims_0, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': n_dims 0 is not in 1..4", NULL},
    {"n_dims_5", bad_n_dims_5, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': n_dims 5 is not in 1..4", NULL},
    {"zero_dim", bad_zero_dim, KVCAP_ERR_FORMAT, "tensor 'blk.0.attn_q.weight': ne[1] = 0",
     NULL},
    {"dim_huge", bad_dim_huge, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': ne[0] = 9223372036854775808 is not in 1..2^63-1", NULL},
    {"dims_overflow", bad_dims_overflow, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': ne [4294967296, 1048576, 1048576] has 2^63", NULL},
    {"bytes_overflow", bad_bytes_overflow, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': ne [2147483648, 2147483648] of F32 overflows", NULL},
    {"row_not_block_multiple", bad_row, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': ne[0] = 33 is not a multiple of the Q4_0 block size 32",
     NULL},
    {"type_unknown", bad_type_1000, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': unknown ggml type 1000", NULL},
    {"type_retired", bad_type_retired, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': unknown ggml type 31", NULL},
    {"offset_unaligned", bad_offset_unaligned, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': offset 48 is not a multiple of the alignment 32", NULL},
    {"data_past_end", bad_data_past_end, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': data at offset 32 + 128 bytes extends past the end",
     "(the data section holds 128 bytes)"},
    {"offset_huge", bad_offset_huge, KVCAP_ERR_FORMAT,
     "tensor 'blk.0.attn_q.weight': data at offset 18446744073709551584", "past the end"},
    {"overlap", bad_overlap, KVCAP_ERR_FORMAT,
     "data [0, 32) overlaps tensor", NULL},
    {"overlap_inside", bad_overlap_inside, KVCAP_ERR_FORMAT,
     "tensor 'small': data [60, 68) overlaps tensor 'big' [0, 64)", NULL},
    {"truncated_in_infos", bad_truncated_infos, KVCAP_ERR_FORMAT,
     "tensor 'b': type needs 4 bytes", "truncated"},
    {"data_section_missing", bad_no_data_section, KVCAP_ERR_FORMAT,
     "data section: starts at offset", "past the end of the file"},
};
#define N_BAD (sizeof bad_cases / sizeof bad_cases[0])

static void test_bad_corpus(void **state)
{
    (void)state;
    char dir[512];
    assert_true(test_tmpdir(dir, sizeof dir, "gguf-bad"));
    int failures = 0;
    for (size_t i = 0; i < N_BAD; i++) {
        const struct bad_case *bc = &bad_cases[i];
        size_t size;
        unsigned char *img = bc->build(&size);
        /* Exact-size copy so AddressSanitizer sees any read past the end. */
        unsigned char *copy = xmalloc(size);
        memcpy(copy, img, size);
        free(img);
        char label[64];
        snprintf(label, sizeof label, "%s.gguf", bc->name);
        struct kvgguf_file *f = (struct kvgguf_file *)&f;
        enum kvcap_status st = kvgguf_open_memory(copy, size, label, &f);
        const char *msg = kvcap_last_error();
        if (st != bc->status || f != NULL || strncmp(msg, label, strlen(label)) != 0 ||
            !strstr(msg, bc->sub1) || (bc->sub2 && !strstr(msg, bc->sub2))) {
            print_error("%s: status %d, message '%s'; expected %d and '%s'\n", bc->name, (int)st,
                        msg, (int)bc->status, bc->sub1);
            failures++;
            if (st == KVCAP_OK)
                kvgguf_close(f);
        }
        /* The same bytes through a mapped file fail the same way, the path first. */
        char path[700];
        snprintf(path, sizeof path, "%s/%s", dir, label);
        FILE *fp = fopen(path, "wb");
        assert_non_null(fp);
        assert_int_equal(fwrite(copy, 1, size, fp), size);
        assert_int_equal(fclose(fp), 0);
        st = kvgguf_open(path, &f);
        msg = kvcap_last_error();
        if (st != bc->status || strncmp(msg, path, strlen(path)) != 0 || !strstr(msg, bc->sub1)) {
            print_error("%s (file): status %d, message '%s'\n", bc->name, (int)st, msg);
            failures++;
            if (st == KVCAP_OK)
                kvgguf_close(f);
        }
        free(copy);
    }
    print_message("bad-file corpus: %zu classes\n", N_BAD);
    test_rm_tree(dir);

    /* The base image itself is valid (so each case fails for its own reason). */
    size_t size;
    unsigned char *img = base_image(&size);
    struct kvgguf_file *f;
    expect_ok(kvgguf_open_memory(img, size, "base", &f));
    assert_int_equal(kvgguf_tensor_count(f), 2);
    kvgguf_close(f);
    free(img);
    assert_int_equal(failures, 0);
}

/* ---- Truncation and mutation sweeps ----------------------------------------------------- */

/* Opens an exact-size heap copy; on success reads every view the API gives, on failure wants
 * FORMAT (or VERSION) and the label first. Returns 1 when it opened. */
static int try_open(const unsigned char *bytes, size_t size, int must_fail)
{
    unsigned char *copy = xmalloc(size);
    memcpy(copy, bytes, size);
    struct kvgguf_file *f;
    enum kvcap_status st = kvgguf_open_memory(copy, size, "fuzz", &f);
    if (st != KVCAP_OK) {
        if ((st != KVCAP_ERR_FORMAT && st != KVCAP_ERR_VERSION) ||
            strncmp(kvcap_last_error(), "fuzz: ", 6) != 0)
            fail_msg("status %d, message '%s'", (int)st, kvcap_last_error());
        free(copy);
        return 0;
    }
    if (must_fail)
        fail_msg("a truncated image of %zu bytes opened", size);
    unsigned sum = 0;
    for (size_t i = 0; i < kvgguf_kv_count(f); i++) {
        enum kvgguf_type ty;
        const char *key = kvgguf_kv_key(f, i, &ty);
        sum += (unsigned)strlen(key);
        uint32_t u;
        int64_t v;
        float x;
        int b;
        struct kvgguf_str s;
        enum kvgguf_type et;
        uint64_t n = 0;
        (void)kvgguf_get_u32(f, key, &u);
        (void)kvgguf_get_i64(f, key, &v);
        (void)kvgguf_get_f32(f, key, &x);
        (void)kvgguf_get_bool(f, key, &b);
        if (kvgguf_get_str(f, key, &s) == KVCAP_OK)
            for (uint64_t k = 0; k < s.n; k++)
                sum += (unsigned char)s.s[k];
        if (kvgguf_get_array(f, key, &et, &n) == KVCAP_OK) {
            for (uint64_t k = 0; et == KVGGUF_STRING && k < n; k++) {
                expect_ok(kvgguf_array_str(f, key, k, &s));
                for (uint64_t c = 0; c < s.n; c++)
                    sum += (unsigned char)s.s[c];
            }
            if (n < 4096) {
                int32_t iv[4096];
                float fv[4096];
                (void)kvgguf_array_i32(f, key, iv, n);
                (void)kvgguf_array_f32(f, key, fv, n);
            }
        }
    }
    for (size_t i = 0; i < kvgguf_tensor_count(f); i++) {
        const struct kvgguf_tensor *t = kvgguf_tensor_at(f, i);
        const unsigned char *p = t->data;
        assert_true(p >= copy && t->nbytes <= (size_t)(copy + size - p));
        for (size_t k = 0; k < t->nbytes; k++)
            sum += p[k];
        assert_ptr_equal(kvgguf_tensor_find(f, t->name), t);
        if (t->n_elements <= (1u << 16)) {
            float *out = xmalloc((size_t)t->n_elements * sizeof(float));
            enum kvcap_status ds = kvgguf_dequantize(t, out);
            assert_true(ds == KVCAP_OK || ds == KVCAP_ERR_UNSUPPORTED);
            free(out);
        }
    }
    (void)sum;
    kvgguf_close(f);
    free(copy);
    return 1;
}

/* A small valid image with every structure the parser walks. */
static unsigned char *sweep_image(size_t *size, size_t *header_end)
{
    struct gg g;
    gg_init(&g);
    kv_str(&g, "general.architecture", "llama");
    kv_u32(&g, "general.alignment", 16);
    g.align = 16;
    put_u8(kv_begin(&g, "b", KVGGUF_BOOL), 1);
    put_f64(kv_begin(&g, "f", KVGGUF_FLOAT64), 2.5);
    struct buf *b = kv_array(&g, "tok", KVGGUF_STRING, 3);
    put_str(b, "x");
    put_str(b, "yy");
    put_str(b, "");
    b = kv_array(&g, "ty", KVGGUF_INT8, 3);
    put_u8(b, 1);
    put_u8(b, 0xff);
    put_u8(b, 3);
    unsigned char data[34] = {0x00, 0x3c, 1, 2, 3, 0xff, 0x80};
    gg_tensor(&g, "q", KVGGUF_T_Q8_0, 1, (uint64_t[]){32}, data, 34);
    gg_tensor(&g, "h", KVGGUF_T_F16, 2, (uint64_t[]){2, 2}, data, 8);
    gg_tensor(&g, "k", 12 /* Q4_K */, 1, (uint64_t[]){256}, (unsigned char[144]){0}, 144);
    size_t data_offset;
    unsigned char *img = gg_image(&g, size, &data_offset);
    *header_end = data_offset;
    gg_free(&g);
    return img;
}

static void test_truncation_sweep(void **state)
{
    (void)state;
    size_t size, header_end;
    unsigned char *img = sweep_image(&size, &header_end);
    assert_int_equal(try_open(img, size, 0), 1);
    for (size_t len = 0; len < size; len++)
        try_open(img, len, 1);
    print_message("truncation sweep: %zu prefixes of a %zu-byte image all refused\n", size, size);
    free(img);
}

static void test_mutation_sweep(void **state)
{
    (void)state;
    size_t size, header_end;
    unsigned char *img = sweep_image(&size, &header_end);
    unsigned char *m = xmalloc(size);
    clock_t t0 = clock();
    size_t cases = 0, opened = 0;
    /* Every value at every header byte (where all parsing happens); two per data byte. */
    for (size_t i = 0; i < size; i++) {
        memcpy(m, img, size);
        for (unsigned v = 0; v < 256; v++) {
            if (v == img[i] || (i >= header_end && v != 0 && v != (img[i] ^ 0xffu)))
                continue;
            m[i] = (unsigned char)v;
            opened += (size_t)try_open(m, size, 0);
            cases++;
        }
    }
    /* Counts and lengths set to values near the limits, at every 8-byte field start. */
    static const uint64_t big[] = {UINT64_MAX, UINT64_MAX / 2, UINT64_C(1) << 32, 0x10000};
    for (size_t i = 0; i + 8 <= header_end; i++) {
        for (size_t k = 0; k < sizeof big / sizeof big[0]; k++) {
            memcpy(m, img, size);
            patch_le(m + i, big[k], 8);
            opened += (size_t)try_open(m, size, 0);
            cases++;
        }
    }
    double secs = (double)(clock() - t0) / CLOCKS_PER_SEC;
    print_message("mutation sweep: %zu-byte image (%zu of header), %zu cases, %zu opened, "
                  "%.2f s CPU\n",
                  size, header_end, cases, opened, secs);
    free(m);
    free(img);
}

/* ---- The real model --------------------------------------------------------------------- */

/* From tests/data/gguf/make_reference.py with the PyPI gguf package 0.19.0 (numpy 2.4.6):
 * GGUFReader + gguf.quants.dequantize, independent of engine/gguf.c. */
static const struct real_ref {
    const char *name;
    uint32_t type;
    int64_t ne[2];
    uint64_t n;
    double sum, sum_abs, sum_sq;
    float first[8], last[8];
} real_refs[] = {
    {"token_embd.weight", 8, {576, 49152}, 28311552,
     -15353.044494152069, 2802153.6198058128, 520415.71544763993,
     {-0.106544495f, 0.0329780579f, 0.0481987f, -0.0228309631f,
      -0.0684928894f, -0.0456619263f, 0.0202941895f, -0.121765137f},
     {0.0278015137f, 0.0347518921f, 0.185922623f, -0.100780487f,
      0.0781917572f, 0.128582001f, -0.119894028f, -0.0417022705f}},
    {"blk.0.attn_q.weight", 3, {576, 576}, 331776,
     59.223220825195312, 63395.398727416992, 26749.573275085306,
     {-0.0963134766f, 0.157348633f, -0.0963134766f, -0.73046875f,
      1.17199707f, -0.0963134766f, 0.0305175781f, 0.664672852f},
     {-0.0438232422f, 0.00918579102f, 0.00918579102f, 0.539276123f,
      0.00918579102f, -0.0968322754f, -0.149841309f, -0.255859375f}},
    {"blk.29.ffn_down.weight", 3, {1536, 576}, 884736,
     49.835708618164062, 126250.91435241699, 29667.074891592143,
     {-0.27331543f, 0.186279297f, 0.186279297f, 0.0484008789f,
      0.186279297f, 0.186279297f, -0.319274902f, -0.181396484f},
     {-0.08984375f, -0.138671875f, -0.08984375f, 0.0078125f,
      0.056640625f, 0.203125f, -0.08984375f, 0.056640625f}},
    {"output_norm.weight", 0, {576, 1}, 576,
     1038.33203125, 1045.09765625, 1921.7355499267578,
     {1.7578125f, 1.8203125f, 1.78125f, 1.6015625f,
      1.7421875f, 1.71875f, 1.828125f, 1.75f},
     {1.7578125f, 1.7421875f, 1.71875f, 2.28125f,
      1.9140625f, 1.8828125f, 1.921875f, 1.984375f}},
    {"blk.7.attn_k.weight", 3, {576, 192}, 110592,
     -47.496780395507812, 16738.010009765625, 4539.7198533404153,
     {-0.00253295898f, 0.321746826f, -0.272766113f, 0.0515136719f,
      0.267700195f, -0.218719482f, 0.0515136719f, -0.272766113f},
     {0.187683105f, 0.268432617f, 0.510681152f, 0.187683105f,
      -0.296813965f, 0.026184082f, -0.216064453f, -0.0545654297f}},
};

/* Values: relative 1e-6 (the dequantised floats should agree exactly; the margin allows a
 * fused multiply-add in either implementation). Sums: accumulated in double in a different
 * order than numpy's pairwise sum, so 1e-9 of the sum of |x| (the sum itself may cancel). */
#define REAL_VALUE_RTOL 1e-6
#define REAL_SUM_RTOL 1e-9

static int close_rel(double a, double b, double rtol)
{
    return fabs(a - b) <= rtol * fmax(fabs(b), 1e-30);
}

static void check_str(const struct kvgguf_str *s, const char *want)
{
    if (s->n != strlen(want) || memcmp(s->s, want, s->n) != 0)
        fail_msg("string '%.*s', expected '%s'", (int)s->n, s->s, want);
}

static void test_real_model(void **state)
{
    (void)state;
    char path[4096];
    const char *env = getenv("KVCAP_SMOLLM2_GGUF");
    const char *home = getenv("HOME");
    if (env && *env)
        snprintf(path, sizeof path, "%s", env);
    else
        snprintf(path, sizeof path, "%s/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                 home ? home : "");
    if (access(path, R_OK) != 0) {
        print_message("SKIP: real-model checks (%s not found; set KVCAP_SMOLLM2_GGUF)\n", path);
        skip();
    }
    struct kvgguf_file *f;
    clock_t t0 = clock();
    expect_ok(kvgguf_open(path, &f));
    double open_s = (double)(clock() - t0) / CLOCKS_PER_SEC;
    assert_int_equal(kvgguf_tensor_count(f), 272);
    assert_int_equal(kvgguf_kv_count(f), 33);

    struct kvgguf_str s;
    expect_ok(kvgguf_get_str(f, "general.architecture", &s));
    check_str(&s, "llama");
    expect_ok(kvgguf_get_str(f, "tokenizer.ggml.model", &s));
    check_str(&s, "gpt2");
    expect_ok(kvgguf_get_str(f, "tokenizer.ggml.pre", &s));
    check_str(&s, "smollm");
    static const struct {
        const char *key;
        uint32_t v;
    } u32s[] = {{"llama.block_count", 30},        {"llama.embedding_length", 576},
                {"llama.attention.head_count", 9}, {"llama.attention.head_count_kv", 3},
                {"llama.feed_forward_length", 1536}, {"llama.context_length", 8192},
                {"llama.rope.dimension_count", 64}, {"tokenizer.ggml.bos_token_id", 1},
                {"tokenizer.ggml.eos_token_id", 2},  {"general.file_type", 3}};
    for (size_t i = 0; i < sizeof u32s / sizeof u32s[0]; i++) {
        uint32_t u = 0;
        expect_ok(kvgguf_get_u32(f, u32s[i].key, &u));
        if (u != u32s[i].v)
            fail_msg("%s = %u, expected %u", u32s[i].key, u, u32s[i].v);
    }
    float x = 0;
    expect_ok(kvgguf_get_f32(f, "llama.rope.freq_base", &x));
    assert_true(x == 100000.0f);
    expect_ok(kvgguf_get_f32(f, "llama.attention.layer_norm_rms_epsilon", &x));
    assert_true(x == 1e-5f);
    int b = -1;
    expect_ok(kvgguf_get_bool(f, "tokenizer.ggml.add_bos_token", &b));
    assert_int_equal(b, 0);
    assert_false(kvgguf_has(f, "general.alignment"));

    enum kvgguf_type et;
    uint64_t n = 0;
    expect_ok(kvgguf_get_array(f, "tokenizer.ggml.tokens", &et, &n));
    assert_int_equal(et, KVGGUF_STRING);
    assert_int_equal(n, 49152);
    expect_ok(kvgguf_array_str(f, "tokenizer.ggml.tokens", 0, &s));
    check_str(&s, "<|endoftext|>");
    expect_ok(kvgguf_array_str(f, "tokenizer.ggml.tokens", 49151, &s));
    check_str(&s, "ectable");
    expect_ok(kvgguf_get_array(f, "tokenizer.ggml.merges", &et, &n));
    assert_int_equal(n, 48900);
    expect_ok(kvgguf_array_str(f, "tokenizer.ggml.merges", 0, &s));
    check_str(&s, "\xc4\xa0 t");
    expect_ok(kvgguf_array_str(f, "tokenizer.ggml.merges", 48899, &s));
    check_str(&s, "ect able");
    expect_ok(kvgguf_get_array(f, "tokenizer.ggml.token_type", &et, &n));
    assert_int_equal(et, KVGGUF_INT32);
    int32_t *types = xmalloc((size_t)n * sizeof *types);
    expect_ok(kvgguf_array_i32(f, "tokenizer.ggml.token_type", types, n));
    assert_int_equal(types[0], 3);
    assert_int_equal(types[n - 1], 1);
    free(types);

    /* Tensor types and shapes; tied embeddings. */
    int n_q41 = 0, n_f32 = 0, n_q80 = 0;
    for (size_t i = 0; i < kvgguf_tensor_count(f); i++) {
        const struct kvgguf_tensor *t = kvgguf_tensor_at(f, i);
        n_q41 += t->type == KVGGUF_T_Q4_1;
        n_f32 += t->type == KVGGUF_T_F32;
        n_q80 += t->type == KVGGUF_T_Q8_0;
        if (strstr(t->name, "_norm.weight"))
            assert_int_equal(t->type, KVGGUF_T_F32);
    }
    assert_int_equal(n_q41, 210);
    assert_int_equal(n_f32, 61);
    assert_int_equal(n_q80, 1);
    assert_null(kvgguf_tensor_find(f, "output.weight"));
    const struct kvgguf_tensor *q = kvgguf_tensor_find(f, "blk.12.attn_v.weight");
    assert_non_null(q);
    assert_int_equal(q->ne[0], 576);
    assert_int_equal(q->ne[1], 192);
    assert_int_equal(q->type, KVGGUF_T_Q4_1);

    /* Dequantised values against the reference. */
    t0 = clock();
    for (size_t r = 0; r < sizeof real_refs / sizeof real_refs[0]; r++) {
        const struct real_ref *ref = &real_refs[r];
        const struct kvgguf_tensor *t = kvgguf_tensor_find(f, ref->name);
        assert_non_null(t);
        assert_int_equal(t->type, ref->type);
        assert_int_equal(t->ne[0], ref->ne[0]);
        assert_int_equal(t->ne[1], ref->ne[1]);
        assert_int_equal(t->n_elements, ref->n);
        float *out = xmalloc((size_t)t->n_elements * sizeof(float));
        expect_ok(kvgguf_dequantize(t, out));
        double sum = 0, sum_abs = 0, sum_sq = 0;
        for (size_t i = 0; i < t->n_elements; i++) {
            double v = out[i];
            sum += v;
            sum_abs += fabs(v);
            sum_sq += v * v;
        }
        for (int i = 0; i < 8; i++) {
            float a = out[i], z = out[t->n_elements - 8 + (size_t)i];
            if (!close_rel(a, ref->first[i], REAL_VALUE_RTOL) ||
                !close_rel(z, ref->last[i], REAL_VALUE_RTOL))
                fail_msg("%s: value %d: %.9g / %.9g, reference %.9g / %.9g", ref->name, i,
                         (double)a, (double)z, (double)ref->first[i], (double)ref->last[i]);
        }
        if (fabs(sum - ref->sum) > REAL_SUM_RTOL * ref->sum_abs ||
            !close_rel(sum_abs, ref->sum_abs, REAL_SUM_RTOL) ||
            !close_rel(sum_sq, ref->sum_sq, REAL_SUM_RTOL))
            fail_msg("%s: sums %.17g %.17g %.17g, reference %.17g %.17g %.17g", ref->name, sum,
                     sum_abs, sum_sq, ref->sum, ref->sum_abs, ref->sum_sq);
        free(out);
    }
    double dq_s = (double)(clock() - t0) / CLOCKS_PER_SEC;
    print_message("real model: open %.3f s CPU, %zu reference tensors dequantised in %.2f s\n",
                  open_s, sizeof real_refs / sizeof real_refs[0], dq_s);
    kvgguf_close(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_metadata),
        cmocka_unit_test(test_tensors_default_alignment),
        cmocka_unit_test(test_tensors_alignment_64),
        cmocka_unit_test(test_tensors_alignment_extremes),
        cmocka_unit_test(test_open_file),
        cmocka_unit_test(test_dequantize),
        cmocka_unit_test(test_bad_corpus),
        cmocka_unit_test(test_truncation_sweep),
        cmocka_unit_test(test_mutation_sweep),
        cmocka_unit_test(test_real_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
