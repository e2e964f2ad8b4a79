/* fuzz_safetensors.c — the safetensors container reader (formats/safetensors.c) over hostile
 * bytes, in memory: every view of a file that opens is read end to end and converted, names and
 * metadata are found again, the writer writes it again and the file reader reads back the same,
 * and the kvcap schema check (formats/schema.c) runs on it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz_common.h"
#include "formats/safetensors.h"
#include "common/dtype.h"
#include "formats/schema.h"

/* Float tensors up to this many elements are converted (bigger ones are only read). */
#define CONVERT_MAX 4096

static int is_float(enum kvcap_dtype t)
{
    return t == KVCAP_DTYPE_F32 || t == KVCAP_DTYPE_F16 || t == KVCAP_DTYPE_BF16 ||
           t == KVCAP_DTYPE_F64;
}

static void check_tensors(const struct kvst_file *f, size_t size)
{
    static float converted[CONVERT_MAX];
    size_t n = kvst_count(f);
    const char *previous = NULL;
    uint64_t total = 0;
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < n; i++) {
        const struct kvst_tensor *t = kvst_at(f, i);
        FUZZ_ASSERT(t && t->name, "tensor %zu missing", i);
        size_t len = strlen(t->name);
        FUZZ_ASSERT(len >= 1 && len <= KVST_MAX_NAME, "tensor name of %zu bytes", len);
        FUZZ_ASSERT(!previous || strcmp(previous, t->name) < 0, "names out of order at %zu", i);
        previous = t->name;
        FUZZ_ASSERT(kvst_find(f, t->name) == t, "'%s' not found again", t->name);
        FUZZ_ASSERT(t->ndim >= 0 && t->ndim <= KVST_MAX_DIMS, "rank %d", t->ndim);
        size_t elements = 1;
        for (int d = 0; d < t->ndim; d++) {
            FUZZ_ASSERT(t->shape[d] >= 0, "negative dim");
            elements *= (size_t)t->shape[d];
        }
        size_t esize = kvcap_dtype_size(t->dtype);
        FUZZ_ASSERT(esize > 0, "unknown dtype %d accepted", (int)t->dtype);
        FUZZ_ASSERT(elements == t->n_elements && t->nbytes == elements * esize,
                    "'%s': %zu elements, %zu bytes", t->name, t->n_elements, t->nbytes);
        FUZZ_ASSERT(t->nbytes == 0 || (uintptr_t)t->data % esize == 0, "'%s' misaligned",
                    t->name);
        total += t->nbytes;
        /* Every byte of the view must be readable (ASan watches the input buffer's edges). */
        const uint8_t *bytes = t->data;
        for (size_t k = 0; k < t->nbytes; k++)
            sink ^= bytes[k];
        if (is_float(t->dtype) && t->n_elements <= CONVERT_MAX) {
            kvcap_clear_error();
            enum kvcap_status st =
                kvcap_convert_to_f32(t->dtype, t->data, t->n_elements, converted);
            FUZZ_ASSERT(st == KVCAP_OK, "converting '%s': %s", t->name, kvcap_last_error());
        }
    }
    /* The ranges tile the data buffer exactly (SPEC §1), so they cannot add up past the file. */
    FUZZ_ASSERT(total <= size, "tensors hold %llu bytes of a %zu-byte file",
                (unsigned long long)total, size);
    FUZZ_ASSERT(kvst_file_size(f) == size, "file size %llu != %zu",
                (unsigned long long)kvst_file_size(f), size);
    FUZZ_ASSERT(8 + kvst_header_size(f) + total == size, "header + data != file size");
    (void)sink;
}

static void check_metadata(const struct kvst_file *f)
{
    const char *previous = NULL;
    for (size_t i = 0; i < kvst_meta_count(f); i++) {
        const char *key = NULL, *value = NULL;
        kvst_meta_at(f, i, &key, &value);
        FUZZ_ASSERT(key && value, "metadata entry %zu missing", i);
        FUZZ_ASSERT(!previous || strcmp(previous, key) < 0, "metadata keys out of order");
        previous = key;
        FUZZ_ASSERT(kvst_meta(f, key) == value, "metadata '%s' not found again", key);
    }
}

/* Whatever the reader accepts, the writer writes again (names and metadata escaped as JSON
 * needs) and the reader reads back the same tensors and metadata. */
static void check_round_trip(const struct kvst_file *f)
{
    struct kvst_writer *w = NULL;
    kvcap_clear_error();
    FUZZ_ASSERT(kvst_writer_create(&w) == KVCAP_OK, "writer: %s", kvcap_last_error());
    size_t n = kvst_count(f);
    for (size_t i = 0; i < n; i++) {
        const struct kvst_tensor *t = kvst_at(f, i);
        kvcap_clear_error();
        enum kvcap_status st = kvst_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data);
        FUZZ_ASSERT(st == KVCAP_OK, "the writer refuses tensor %zu the reader accepted: %s", i,
                    kvcap_last_error());
    }
    for (size_t i = 0; i < kvst_meta_count(f); i++) {
        const char *key, *value;
        kvst_meta_at(f, i, &key, &value);
        kvcap_clear_error();
        enum kvcap_status st = kvst_writer_set_meta(w, key, value);
        FUZZ_ASSERT(st == KVCAP_OK, "the writer refuses metadata '%s' the reader accepted: %s",
                    key, kvcap_last_error());
    }
    char path[4400];
    fuzz_path(path, sizeof path, "again.safetensors");
    kvcap_clear_error();
    enum kvcap_status st = kvst_writer_commit(w, path);
    FUZZ_ASSERT(st == KVCAP_OK, "commit: %s", kvcap_last_error());
    kvst_writer_free(w);

    struct kvst_file *g = NULL;
    kvcap_clear_error();
    st = kvst_open(path, &g);
    FUZZ_ASSERT(st == KVCAP_OK, "the reader refuses what the writer wrote: %s",
                kvcap_last_error());
    FUZZ_ASSERT(kvst_count(g) == n && kvst_meta_count(g) == kvst_meta_count(f),
                "%zu tensors and %zu metadata entries came back as %zu and %zu", n,
                kvst_meta_count(f), kvst_count(g), kvst_meta_count(g));
    for (size_t i = 0; i < n; i++) {
        const struct kvst_tensor *a = kvst_at(f, i), *b = kvst_at(g, i);
        FUZZ_ASSERT(strcmp(a->name, b->name) == 0 && a->dtype == b->dtype &&
                        a->ndim == b->ndim &&
                        memcmp(a->shape, b->shape, sizeof a->shape[0] * (size_t)a->ndim) == 0 &&
                        a->nbytes == b->nbytes &&
                        (a->nbytes == 0 || memcmp(a->data, b->data, a->nbytes) == 0),
                    "tensor %zu ('%s') came back different", i, a->name);
    }
    for (size_t i = 0; i < kvst_meta_count(f); i++) {
        const char *ka, *va, *kb, *vb;
        kvst_meta_at(f, i, &ka, &va);
        kvst_meta_at(g, i, &kb, &vb);
        FUZZ_ASSERT(strcmp(ka, kb) == 0 && strcmp(va, vb) == 0,
                    "metadata '%s' came back different", ka);
    }
    kvst_close(g);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvst_file *f = NULL;
    kvcap_clear_error();
    enum kvcap_status st = kvst_open_memory(data, size, "fuzz.safetensors", &f);
    fuzz_check_status(st, "kvst_open_memory");
    if (st != KVCAP_OK) {
        FUZZ_ASSERT(f == NULL, "a failed open left a handle");
        return 0;
    }
    check_tensors(f, size);
    check_metadata(f);
    check_round_trip(f);

    struct kvcap_file_info info;
    kvcap_clear_error();
    st = kvcap_schema_check(f, KVCAP_KIND_ANY, &info);
    fuzz_check_status(st, "kvcap_schema_check");
    if (st == KVCAP_OK) {
        FUZZ_ASSERT(kvcap_geometry_validate(&info.model) == KVCAP_OK,
                    "schema accepted an invalid model: %s", kvcap_last_error());
        FUZZ_ASSERT(info.n_buckets >= 0 && info.n_buckets <= KVCAP_MAX_BUCKETS, "%d buckets",
                    info.n_buckets);
    }
    kvcap_file_info_free(&info);
    kvst_close(f);
    return 0;
}
