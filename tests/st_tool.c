/* st_tool.c — a small CLI over the safetensors container layer, used by the interop test
 * (tests/interop.py) against the reference Python implementation:
 *   st_tool write-reference OUT.safetensors   writes a fixed set of tensors of every dtype
 *   st_tool dump FILE                         prints the file as canonical JSON on stdout:
 *     {"metadata":{...},"tensors":{"name":{"dtype":"F32","shape":[...],"offset":B,"hex":"..."}}}
 *   with the raw little-endian bytes of each tensor in lowercase hex (files are tiny). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/safetensors.h"

/* ---- write-reference -------------------------------------------------------------------- */
/* Keep in step with reference_tensors() in interop.py, which computes the same values
 * independently (from decimal literals, numpy and bit patterns). */

static const float ref_f32[8] = {0.0f, -0.0f, 1.5f, -2.25f, 0.1f, 3.4028234663852886e38f,
                                 1.1754943508222875e-38f, -1.401298464324817e-45f};
static const double ref_f64[5] = {0.1, -1e300, 4.9406564584124654e-324, -0.0, 12345.678};
/* 1.0, -2.5, 65504 (max), 2^-24 (min subnormal), -0, 0.333251953125, +inf, 2^-14 */
static const uint16_t ref_f16[8] = {0x3c00, 0xc100, 0x7bff, 0x0001,
                                    0x8000, 0x3555, 0x7c00, 0x0400};
/* 1.0, -2.5, max finite, min subnormal, -0, 0.333984375 */
static const uint16_t ref_bf16[6] = {0x3f80, 0xc020, 0x7f7f, 0x0001, 0x8000, 0x3eab};
static const int32_t ref_i32[5] = {0, -1, 2147483647, -2147483647 - 1, 42};
static const uint8_t ref_u8[6] = {0, 1, 127, 128, 254, 255};
static const float ref_scalar = 3.25f;
static const int32_t ref_i32_scalar = -7;

static int write_reference(const char *path)
{
    struct kvst_writer *w = NULL;
    enum kvcap_status st = kvst_writer_create(&w);
    const int64_t s_f32[2] = {2, 4}, s_f64[1] = {5}, s_f16[1] = {8}, s_bf16[2] = {2, 3},
                  s_i32[1] = {5}, s_u8[2] = {3, 2}, s_empty[2] = {0, 4}, s_empty_u8[1] = {0};
#define ADD(name, dt, nd, shape, data) \
    if (st == KVCAP_OK)                \
    st = kvst_writer_add(w, name, dt, nd, shape, data)
    ADD("f32", KVCAP_DTYPE_F32, 2, s_f32, ref_f32);
    ADD("f64", KVCAP_DTYPE_F64, 1, s_f64, ref_f64);
    ADD("f16", KVCAP_DTYPE_F16, 1, s_f16, ref_f16);
    ADD("bf16", KVCAP_DTYPE_BF16, 2, s_bf16, ref_bf16);
    ADD("i32", KVCAP_DTYPE_I32, 1, s_i32, ref_i32);
    ADD("u8", KVCAP_DTYPE_U8, 2, s_u8, ref_u8);
    ADD("layer.0.scalar", KVCAP_DTYPE_F32, 0, NULL, &ref_scalar);
    ADD("layer.0.i32_scalar", KVCAP_DTYPE_I32, 0, NULL, &ref_i32_scalar);
    ADD("empty", KVCAP_DTYPE_F32, 2, s_empty, NULL);
    ADD("empty.u8", KVCAP_DTYPE_U8, 1, s_empty_u8, NULL);
#undef ADD
    if (st == KVCAP_OK)
        st = kvst_writer_set_meta(w, "kvcap.kind", "dataset");
    if (st == KVCAP_OK)
        st = kvst_writer_set_meta(w, "note", "h\xc3\xa9llo \"q\"");
    if (st == KVCAP_OK)
        st = kvst_writer_commit(w, path);
    kvst_writer_free(w);
    if (st != KVCAP_OK) {
        fprintf(stderr, "st_tool: %s\n", kvcap_last_error());
        return 1;
    }
    return 0;
}

/* ---- dump ------------------------------------------------------------------------------- */

static void json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static int dump(const char *path)
{
    struct kvst_file *f;
    if (kvst_open(path, &f) != KVCAP_OK) {
        fprintf(stderr, "st_tool: %s\n", kvcap_last_error());
        return 1;
    }
    printf("{\"metadata\":{");
    for (size_t i = 0; i < kvst_meta_count(f); i++) {
        const char *k, *v;
        kvst_meta_at(f, i, &k, &v);
        if (i)
            putchar(',');
        json_string(k);
        putchar(':');
        json_string(v);
    }
    printf("},\"header_size\":%llu,\"tensors\":{", (unsigned long long)kvst_header_size(f));
    for (size_t i = 0; i < kvst_count(f); i++) {
        const struct kvst_tensor *t = kvst_at(f, i);
        if (i)
            putchar(',');
        json_string(t->name);
        printf(":{\"dtype\":\"%s\",\"shape\":[", kvcap_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++)
            printf("%s%lld", d ? "," : "", (long long)t->shape[d]);
        printf("],\"offset\":%llu,\"hex\":\"", (unsigned long long)t->offset);
        const unsigned char *b = t->data;
        for (size_t k = 0; k < t->nbytes; k++)
            printf("%02x", b[k]);
        printf("\"}");
    }
    printf("}}\n");
    kvst_close(f);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "st_tool: write error on stdout\n");
        return 1;
    }
    return 0;
}

static int usage(void)
{
    fprintf(stderr, "usage: st_tool write-reference OUT.safetensors\n"
                    "       st_tool dump FILE.safetensors\n");
    return 2;
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return usage();
    if (strcmp(argv[1], "write-reference") == 0)
        return write_reference(argv[2]);
    if (strcmp(argv[1], "dump") == 0)
        return dump(argv[2]);
    return usage();
}
