/* gguf.h — a hostile-file-proof reader for GGUF v3 model files (llama.cpp's container): header,
 * metadata key/values, tensor infos, and the tensor data mapped read-only. Weights are
 * dequantised to f32 on request. Internal to kvcap's evaluation tools (not part of libkvcap).
 *
 * Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 3, little-endian). */
#ifndef KVCAP_GGUF_H
#define KVCAP_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"

#define KVGGUF_MAX_DIMS 4

/* Metadata value types, numbered as in the spec. */
enum kvgguf_type {
    KVGGUF_UINT8 = 0, KVGGUF_INT8 = 1, KVGGUF_UINT16 = 2, KVGGUF_INT16 = 3,
    KVGGUF_UINT32 = 4, KVGGUF_INT32 = 5, KVGGUF_FLOAT32 = 6, KVGGUF_BOOL = 7,
    KVGGUF_STRING = 8, KVGGUF_ARRAY = 9, KVGGUF_UINT64 = 10, KVGGUF_INT64 = 11,
    KVGGUF_FLOAT64 = 12
};

/* Tensor types (ggml_type numbering) this reader can dequantise. Others are listed by
 * kvgguf_tensor_at with their number but kvgguf_dequantize fails on them, naming the tensor. */
enum kvgguf_tensor_type {
    KVGGUF_T_F32 = 0, KVGGUF_T_F16 = 1, KVGGUF_T_Q4_0 = 2, KVGGUF_T_Q4_1 = 3,
    KVGGUF_T_Q5_0 = 6, KVGGUF_T_Q5_1 = 7, KVGGUF_T_Q8_0 = 8, KVGGUF_T_BF16 = 30
};

/* A string inside the file: NOT NUL-terminated (GGUF strings are length-prefixed). */
struct kvgguf_str {
    const char *s;
    uint64_t n;
};

struct kvgguf_tensor {
    const char *name;              /* NUL-terminated copy, owned by the file */
    int n_dims;                    /* 1..KVGGUF_MAX_DIMS */
    int64_t ne[KVGGUF_MAX_DIMS];   /* ggml order: ne[0] is the contiguous (fastest) axis;
                                    * unused dims are 1 */
    uint32_t type;                 /* enum kvgguf_tensor_type value (or another ggml type) */
    uint64_t n_elements;
    uint64_t nbytes;               /* bytes in the file (every ggml type's size is known:
                                    * files with other type numbers are refused at open) */
    const void *data;              /* in the mapping, valid until kvgguf_close */
};

struct kvgguf_file;

/* Opens, maps and validates `path`: magic, version 3, counts and lengths against the file size,
 * every string UTF-8 length within bounds, key uniqueness, value types, array element types,
 * tensor names unique, dims >= 1 and their product without overflow, row size a multiple of the
 * block size, alignment (general.alignment, default 32, a power of two), every tensor's data
 * inside the file and aligned, no two tensors overlapping. On failure *out is NULL and
 * kvcap_last_error() starts with the path and names the key, tensor or field at fault.
 * Arrays of arrays are refused (as llama.cpp does); strings are not checked for UTF-8. */
enum kvcap_status kvgguf_open(const char *path, struct kvgguf_file **out);
/* The same over a caller-owned buffer (kept until close); `label` replaces the path in errors. */
enum kvcap_status kvgguf_open_memory(const void *bytes, size_t size, const char *label,
                                     struct kvgguf_file **out);
void kvgguf_close(struct kvgguf_file *f); /* NULL is a no-op */
const char *kvgguf_path(const struct kvgguf_file *f);

/* ---- Metadata --------------------------------------------------------------------------- */
/* Typed getters. Absent key: KVCAP_ERR_NOT_FOUND; wrong type: KVCAP_ERR_FORMAT; both name the
 * path and the key. Integer getters accept any integer type whose value fits. */
enum kvcap_status kvgguf_get_u32(const struct kvgguf_file *f, const char *key, uint32_t *out);
enum kvcap_status kvgguf_get_i64(const struct kvgguf_file *f, const char *key, int64_t *out);
enum kvcap_status kvgguf_get_f32(const struct kvgguf_file *f, const char *key, float *out);
enum kvcap_status kvgguf_get_bool(const struct kvgguf_file *f, const char *key, int *out);
enum kvcap_status kvgguf_get_str(const struct kvgguf_file *f, const char *key,
                                 struct kvgguf_str *out);
/* 1 when present (no error is recorded either way). */
int kvgguf_has(const struct kvgguf_file *f, const char *key);
/* Key/values in file order: the i-th key (NULL past the end) and its type (may be NULL). */
size_t kvgguf_kv_count(const struct kvgguf_file *f);
const char *kvgguf_kv_key(const struct kvgguf_file *f, size_t i, enum kvgguf_type *type);

/* Arrays: element type and count; then elements by index. */
enum kvcap_status kvgguf_get_array(const struct kvgguf_file *f, const char *key,
                                   enum kvgguf_type *elem_type, uint64_t *n);
/* The i-th string of a string array (KVCAP_ERR_FORMAT if not one). */
enum kvcap_status kvgguf_array_str(const struct kvgguf_file *f, const char *key, uint64_t i,
                                   struct kvgguf_str *out);
/* Integer arrays of any integer element type, converted to int32 (values must fit). For both
 * conversions n must be the array's element count (KVCAP_ERR_INVALID_ARGUMENT otherwise). */
enum kvcap_status kvgguf_array_i32(const struct kvgguf_file *f, const char *key, int32_t *out,
                                   uint64_t n);
/* Float arrays (FLOAT32/FLOAT64) converted to float. */
enum kvcap_status kvgguf_array_f32(const struct kvgguf_file *f, const char *key, float *out,
                                   uint64_t n);

/* ---- Tensors ---------------------------------------------------------------------------- */
size_t kvgguf_tensor_count(const struct kvgguf_file *f);
const struct kvgguf_tensor *kvgguf_tensor_at(const struct kvgguf_file *f, size_t i);
/* NULL when absent (no error recorded). */
const struct kvgguf_tensor *kvgguf_tensor_find(const struct kvgguf_file *f, const char *name);

/* Dequantises the whole tensor to f32 in ggml order (n_elements floats). Unsupported type:
 * KVCAP_ERR_UNSUPPORTED naming the tensor and the type (the message starts with the tensor,
 * since a tensor does not know its file's path). */
enum kvcap_status kvgguf_dequantize(const struct kvgguf_tensor *t, float *out);
/* Name of a tensor type ("Q4_1"), "?" if unknown. */
const char *kvgguf_type_name(uint32_t type);

#endif /* KVCAP_GGUF_H */
