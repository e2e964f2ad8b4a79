/* test_safetensors.c — the container layer (formats/SPEC.md §1): writer/reader round trips, alignment, atomic commits, the handcrafted bad-file corpus in
 * tests/data/bad/ (one file per failure class, see make_bad_files.py) and a mutation sweep. */
#include <dirent.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "formats/safetensors.h"
#include "tests/test_status.h"

/* ---- Helpers ---------------------------------------------------------------------------- */

/* A fresh directory under $TMPDIR (or /tmp) for one test; removed by rm_tree. */
static char *make_tmpdir(void)
{
    const char *base = getenv("TMPDIR");
    if (!base || !*base)
        base = "/tmp";
    char *dir = malloc(strlen(base) + 32);
    assert_non_null(dir);
    sprintf(dir, "%s/kvst_test_XXXXXX", base);
    assert_non_null(mkdtemp(dir));
    return dir;
}

static char *path_join(const char *dir, const char *name)
{
    char *p = malloc(strlen(dir) + strlen(name) + 2);
    assert_non_null(p);
    sprintf(p, "%s/%s", dir, name);
    return p;
}

/* Removes a directory of plain files and (one level of) subdirectories. */
static void rm_tree(char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                continue;
            char *p = path_join(dir, e->d_name);
            if (unlink(p) != 0)
                rmdir(p);
            free(p);
        }
        closedir(d);
    }
    rmdir(dir);
    free(dir);
}

/* Number of entries in `dir` (besides . and ..); the names are joined into `names`. */
static int list_dir(const char *dir, char *names, size_t cap)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    names[0] = '\0';
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        n++;
        size_t used = strlen(names);
        snprintf(names + used, cap - used, "%s%s", used ? " " : "", e->d_name);
    }
    closedir(d);
    return n;
}

static unsigned char *read_whole(const char *path, size_t *size)
{
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, 0, SEEK_END), 0);
    long n = ftell(fp);
    assert_true(n >= 0);
    rewind(fp);
    unsigned char *buf = malloc(n ? (size_t)n : 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, fp), (size_t)n);
    fclose(fp);
    *size = (size_t)n;
    return buf;
}

static void write_whole(const char *path, const void *buf, size_t n)
{
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(buf, 1, n, fp), n);
    assert_int_equal(fclose(fp), 0);
}

static int contains(const unsigned char *hay, size_t n, const char *needle)
{
    size_t m = strlen(needle);
    for (size_t i = 0; i + m <= n; i++)
        if (memcmp(hay + i, needle, m) == 0)
            return 1;
    return 0;
}

/* ---- Round trip ------------------------------------------------------------------------- */

struct spec {
    const char *name;
    enum kvcap_dtype dtype;
    int ndim;
    int64_t shape[KVST_MAX_DIMS];
    size_t n_elements;
};

/* Every dtype, a scalar, empty tensors and rank 8; sizes chosen so that a naive layout would
 * misalign (the U8 tensor has an odd length, F16 a length not a multiple of 4). */
static const struct spec round_specs[] = {
    {"f32", KVCAP_DTYPE_F32, 2, {2, 3}, 6},
    {"f16", KVCAP_DTYPE_F16, 1, {5}, 5},
    {"bf16", KVCAP_DTYPE_BF16, 1, {3}, 3},
    {"f64", KVCAP_DTYPE_F64, 2, {2, 2}, 4},
    {"i32", KVCAP_DTYPE_I32, 1, {4}, 4},
    {"u8", KVCAP_DTYPE_U8, 1, {7}, 7},
    {"scalar.f64", KVCAP_DTYPE_F64, 0, {0}, 1},
    {"scalar.u8", KVCAP_DTYPE_U8, 0, {0}, 1},
    {"empty.f32", KVCAP_DTYPE_F32, 2, {0, 3}, 0},
    {"empty.u8", KVCAP_DTYPE_U8, 1, {0}, 0},
    {"rank8", KVCAP_DTYPE_I32, 8, {1, 2, 1, 2, 1, 1, 2, 1}, 8},
    {"z.last", KVCAP_DTYPE_F16, 3, {1, 1, 3}, 3},
};
#define N_ROUND (sizeof round_specs / sizeof round_specs[0])

static const char *const meta_keys[] = {"kvcap.kind", "note", "quotes", "empty", "ctl"};
static const char *const meta_values[] = {
    "dataset", "h\xc3\xa9llo \xe2\x9c\x93 \xe6\x97\xa5\xe6\x9c\xac",
    "say \"hi\" \\ back\\\\slash /", "", "tab\there\nnew\x01line"};
#define N_META (sizeof meta_keys / sizeof meta_keys[0])

static void fill_pattern(unsigned char *buf, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        buf[i] = (unsigned char)(seed * 31u + i * 7u + 1u);
}

static void check_round_file(struct kvst_file *f, unsigned char *const *data)
{
    assert_int_equal(kvst_count(f), N_ROUND);
    assert_int_equal((8 + kvst_header_size(f)) % 8, 0);
    for (size_t i = 1; i < kvst_count(f); i++)
        assert_true(strcmp(kvst_at(f, i - 1)->name, kvst_at(f, i)->name) < 0);
    assert_null(kvst_at(f, N_ROUND));
    for (size_t s = 0; s < N_ROUND; s++) {
        const struct spec *sp = &round_specs[s];
        const struct kvst_tensor *t = kvst_find(f, sp->name);
        assert_non_null(t);
        assert_string_equal(t->name, sp->name);
        assert_int_equal(t->dtype, sp->dtype);
        assert_int_equal(t->ndim, sp->ndim);
        for (int d = 0; d < sp->ndim; d++)
            assert_int_equal(t->shape[d], sp->shape[d]);
        assert_int_equal(t->n_elements, sp->n_elements);
        size_t es = kvcap_dtype_size(sp->dtype);
        assert_int_equal(t->nbytes, sp->n_elements * es);
        assert_int_equal((uintptr_t)t->data % es, 0);
        assert_int_equal(t->offset % es, 0); /* the writer's layout, not just the copy */
        if (t->nbytes)
            assert_memory_equal(t->data, data[s], t->nbytes);
    }
    assert_null(kvst_find(f, "absent"));
    assert_null(kvst_find(f, ""));
    assert_null(kvst_find(f, "f3"));

    assert_int_equal(kvst_meta_count(f), N_META);
    for (size_t i = 0; i < N_META; i++) {
        const char *v = kvst_meta(f, meta_keys[i]);
        assert_non_null(v);
        assert_string_equal(v, meta_values[i]);
    }
    for (size_t i = 1; i < N_META; i++) {
        const char *k0, *k1, *v;
        kvst_meta_at(f, i - 1, &k0, &v);
        kvst_meta_at(f, i, &k1, &v);
        assert_true(strcmp(k0, k1) < 0);
    }
    const char *k = "x", *v = "x";
    kvst_meta_at(f, N_META, &k, &v);
    assert_null(k);
    assert_null(v);
    assert_null(kvst_meta(f, "absent"));
}

static void test_round_trip(void **state)
{
    (void)state;
    char *dir = make_tmpdir();
    char *path = path_join(dir, "rt.safetensors");
    unsigned char *data[N_ROUND];
    struct kvst_writer *w;
    expect_ok(kvst_writer_create(&w));
    /* Metadata set out of order, one key replaced. */
    expect_ok(kvst_writer_set_meta(w, "note", "to be replaced"));
    for (size_t i = N_META; i-- > 0;)
        expect_ok(kvst_writer_set_meta(w, meta_keys[i], meta_values[i]));
    /* Tensors added in reverse name order; half borrowed, half copied. */
    for (size_t s = N_ROUND; s-- > 0;) {
        const struct spec *sp = &round_specs[s];
        size_t nb = sp->n_elements * kvcap_dtype_size(sp->dtype);
        data[s] = malloc(nb ? nb : 1);
        assert_non_null(data[s]);
        fill_pattern(data[s], nb, (unsigned)s);
        if (s % 2)
            expect_ok(kvst_writer_add(w, sp->name, sp->dtype, sp->ndim, sp->shape, data[s]));
        else
            expect_ok(kvst_writer_add_copy(w, sp->name, sp->dtype, sp->ndim, sp->shape,
                                           data[s]));
    }
    expect_ok(kvst_writer_commit(w, path));

    struct kvst_file *f;
    expect_ok(kvst_open(path, &f));
    assert_string_equal(kvst_path(f), path);
    check_round_file(f, data);

    /* The header is exact JSON with integer numbers, metadata first. */
    size_t size;
    unsigned char *bytes = read_whole(path, &size);
    assert_int_equal(kvst_file_size(f), size);
    assert_memory_equal(bytes + 8, "{\"__metadata__\":{", 17);
    assert_true(contains(bytes, size, "\"shape\":[2,3]"));
    assert_true(contains(bytes, size, "\"shape\":[]"));
    assert_true(contains(bytes, size, "\"say \\\"hi\\\" \\\\ back\\\\\\\\slash /\""));
    /* Data laid out by descending element size: the F64 tensors come first. */
    assert_int_equal(kvst_find(f, "f64")->offset, 0);
    assert_int_equal(kvst_find(f, "scalar.f64")->offset, 32);
    /* Zero-copy: views point into the file's bytes. */
    kvst_close(f);

    /* Same file through the memory reader. */
    expect_ok(kvst_open_memory(bytes, size, "mem.safetensors", &f));
    assert_string_equal(kvst_path(f), "mem.safetensors");
    check_round_file(f, data);
    const struct kvst_tensor *t = kvst_find(f, "f32");
    assert_ptr_equal(t->data, bytes + 8 + kvst_header_size(f) + t->offset);
    kvst_close(f);

    /* A writer can be committed again, to a second path, with the same result. */
    char *path2 = path_join(dir, "rt2.safetensors");
    expect_ok(kvst_writer_commit(w, path2));
    size_t size2;
    unsigned char *bytes2 = read_whole(path2, &size2);
    assert_int_equal(size2, size);
    assert_memory_equal(bytes2, bytes, size);

    free(bytes2);
    free(bytes);
    free(path2);
    kvst_writer_free(w);
    for (size_t s = 0; s < N_ROUND; s++)
        free(data[s]);
    free(path);
    rm_tree(dir);
}

/* An empty writer produces "{}" padded, which reads back as zero tensors. */
static void test_empty_file(void **state)
{
    (void)state;
    char *dir = make_tmpdir();
    char *path = path_join(dir, "empty.safetensors");
    struct kvst_writer *w;
    expect_ok(kvst_writer_create(&w));
    expect_ok(kvst_writer_commit(w, path));
    kvst_writer_free(w);
    struct kvst_file *f;
    expect_ok(kvst_open(path, &f));
    assert_int_equal(kvst_count(f), 0);
    assert_int_equal(kvst_meta_count(f), 0);
    assert_int_equal(kvst_file_size(f), 16);
    assert_null(kvst_find(f, "a"));
    kvst_close(f);
    free(path);
    rm_tree(dir);
}

/* Files from other writers may be legal yet differ from ours: whitespace, unknown keys,
 * header order, misaligned tensors (copied), empty metadata. */
static void build_container(unsigned char *out, size_t *size, const char *header,
                            const void *data, size_t data_len)
{
    size_t n = strlen(header);
    for (int i = 0; i < 8; i++)
        out[i] = (unsigned char)((uint64_t)n >> (8 * i));
    memcpy(out + 8, header, n);
    if (data_len)
        memcpy(out + 8 + n, data, data_len);
    *size = 8 + n + data_len;
}

static void test_reader_accepts_variants(void **state)
{
    (void)state;
    /* 8-aligned storage so the misalignment below is the file's, not the buffer's. */
    static uint64_t storage[64];
    unsigned char *buf = (unsigned char *)storage;
    size_t size;
    struct kvst_file *f;

    /* U8 [1] at [0,1], then F32 [2] at [1,9]: the header is padded so 8 + N is a multiple of
     * 8, so the F32 sits at an odd file offset and must come back aligned, by copy. */
    const char *hdr = "{ \"b\" : {\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[1,9]},\n"
                      "\t\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    char padded[256];
    snprintf(padded, sizeof padded, "%s", hdr);
    while ((8 + strlen(padded)) % 8)
        strcat(padded, " ");
    unsigned char data[9] = {0xAB};
    float vals[2] = {1.5f, -2.25f};
    memcpy(data + 1, vals, 8);
    build_container(buf, &size, padded, data, sizeof data);
    expect_ok(kvst_open_memory(buf, size, "variant", &f));
    assert_int_equal(kvst_count(f), 2);
    assert_string_equal(kvst_at(f, 0)->name, "a");
    const struct kvst_tensor *t = kvst_find(f, "b");
    assert_int_equal(t->offset, 1);
    assert_int_equal((uintptr_t)t->data % 4, 0);
    assert_ptr_not_equal(t->data, buf + 8 + kvst_header_size(f) + 1);
    assert_memory_equal(t->data, vals, 8);
    assert_int_equal(*(const unsigned char *)kvst_find(f, "a")->data, 0xAB);
    kvst_close(f);

    /* The same through a real file and the mapping. */
    char *dir = make_tmpdir();
    char *path = path_join(dir, "variant.safetensors");
    write_whole(path, buf, size);
    expect_ok(kvst_open(path, &f));
    t = kvst_find(f, "b");
    assert_int_equal((uintptr_t)t->data % 4, 0);
    assert_memory_equal(t->data, vals, 8);
    kvst_close(f);
    free(path);
    rm_tree(dir);

    /* Unknown keys inside an entry are ignored; empty metadata; zero-size tensor at the end
     * of the buffer; a misaligned zero-size tensor; unicode names. */
    const char *hdr2 = "{\"__metadata__\":{},\"x\":{\"dtype\":\"U8\",\"shape\":[3],"
                       "\"data_offsets\":[0,3],\"extra\":[1,{\"y\":null}]},"
                       "\"e\\u00e9\":{\"dtype\":\"F64\",\"shape\":[0,5],\"data_offsets\":[3,3]}}";
    build_container(buf, &size, hdr2, "xyz", 3);
    expect_ok(kvst_open_memory(buf, size, "variant2", &f));
    assert_int_equal(kvst_count(f), 2);
    assert_int_equal(kvst_meta_count(f), 0);
    t = kvst_find(f, "e\xc3\xa9");
    assert_non_null(t);
    assert_int_equal(t->nbytes, 0);
    assert_int_equal((uintptr_t)t->data % 8, 0);
    kvst_close(f);

    /* Only a header: "{}". */
    build_container(buf, &size, "{}      ", NULL, 0);
    expect_ok(kvst_open_memory(buf, size, "variant3", &f));
    assert_int_equal(kvst_count(f), 0);
    kvst_close(f);
}

/* ---- Writer validation ------------------------------------------------------------------ */

static void test_writer_rejects(void **state)
{
    (void)state;
    struct kvst_writer *w;
    expect_ok(kvst_writer_create(&w));
    float x[4] = {0};
    int64_t shape[9] = {4, 1, 1, 1, 1, 1, 1, 1, 1};
    char name255[256], name256[257];
    memset(name255, 'n', 255);
    name255[255] = '\0';
    memset(name256, 'n', 256);
    name256[256] = '\0';

    expect_ok(kvst_writer_add(w, "a", KVCAP_DTYPE_F32, 1, shape, x));
    expect_error(kvst_writer_add(w, "a", KVCAP_DTYPE_F32, 1, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "'a'", "duplicate");
    expect_error(kvst_writer_add_copy(w, "a", KVCAP_DTYPE_F32, 1, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "'a'", "duplicate");
    expect_error(kvst_writer_add(w, "", KVCAP_DTYPE_F32, 1, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "empty", NULL);
    expect_error(kvst_writer_add(w, NULL, KVCAP_DTYPE_F32, 1, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "name", NULL);
    expect_error(kvst_writer_add(w, name256, KVCAP_DTYPE_F32, 1, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "256 bytes", "255");
    expect_ok(kvst_writer_add(w, name255, KVCAP_DTYPE_F32, 1, shape, x));
    expect_error(kvst_writer_add(w, "__metadata__", KVCAP_DTYPE_F32, 1, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "__metadata__", "reserved");
    expect_error(kvst_writer_add(w, "bad\xff", KVCAP_DTYPE_F32, 1, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "UTF-8", NULL);
    expect_error(kvst_writer_add(w, "b", (enum kvcap_dtype)99, 1, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "'b'", "dtype");
    expect_error(kvst_writer_add(w, "b", KVCAP_DTYPE_F32, 9, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "'b'", "rank 9");
    expect_error(kvst_writer_add(w, "b", KVCAP_DTYPE_F32, -1, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "'b'", "rank -1");
    int64_t neg[2] = {2, -1};
    expect_error(kvst_writer_add(w, "b", KVCAP_DTYPE_F32, 2, neg, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "'b'", "shape[1] = -1");
    int64_t huge[2] = {INT64_C(1) << 40, INT64_C(1) << 40};
    expect_error(kvst_writer_add(w, "b", KVCAP_DTYPE_F32, 2, huge, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "'b'", NULL);
    expect_error(kvst_writer_add(w, "b", KVCAP_DTYPE_F32, 1, shape, NULL),
                 KVCAP_ERR_INVALID_ARGUMENT, "'b'", "data is NULL");
    expect_error(kvst_writer_add(NULL, "b", KVCAP_DTYPE_F32, 1, shape, x),
                 KVCAP_ERR_INVALID_ARGUMENT, "writer", NULL);
    expect_error(kvst_writer_set_meta(w, "k", "bad\xc3"), KVCAP_ERR_INVALID_ARGUMENT, "UTF-8",
                 NULL);
    expect_error(kvst_writer_set_meta(w, NULL, "v"), KVCAP_ERR_INVALID_ARGUMENT, "key", NULL);
    expect_error(kvst_writer_commit(w, ""), KVCAP_ERR_INVALID_ARGUMENT, "path", NULL);
    /* An empty tensor needs no data; a NULL shape is fine for a scalar. */
    int64_t zero[1] = {0};
    expect_ok(kvst_writer_add(w, "empty", KVCAP_DTYPE_F32, 1, zero, NULL));
    expect_ok(kvst_writer_add_copy(w, "scalar", KVCAP_DTYPE_F32, 0, NULL, x));

    /* Rejections left the writer as it was: a, empty, scalar and the 255-byte name. */
    char *dir = make_tmpdir();
    char *path = path_join(dir, "w.safetensors");
    expect_ok(kvst_writer_commit(w, path));
    struct kvst_file *f;
    expect_ok(kvst_open(path, &f));
    assert_int_equal(kvst_count(f), 4);
    assert_non_null(kvst_find(f, name255));
    kvst_close(f);
    kvst_writer_free(w);
    free(path);
    rm_tree(dir);
}

/* ---- Atomic commits --------------------------------------------------------------------- */

static void test_commit_failures_leave_nothing(void **state)
{
    (void)state;
    char *dir = make_tmpdir();
    struct kvst_writer *w;
    expect_ok(kvst_writer_create(&w));
    float x[3] = {1, 2, 3};
    int64_t shape[1] = {3};
    expect_ok(kvst_writer_add(w, "x", KVCAP_DTYPE_F32, 1, shape, x));

    /* A directory that does not exist: the temporary file cannot even be created. */
    char *missing = path_join(dir, "no/such/dir/out.safetensors");
    expect_error(kvst_writer_commit(w, missing), KVCAP_ERR_IO, missing, strerror(ENOENT));
    char names[1024];
    assert_int_equal(list_dir(dir, names, sizeof names), 0);

    /* The target is a directory (or a device, a FIFO): refused before a temporary file is
     * made, so nothing is left behind and nothing is replaced. */
    char *sub = path_join(dir, "target.safetensors");
    assert_int_equal(mkdir(sub, 0755), 0);
    expect_error(kvst_writer_commit(w, sub), KVCAP_ERR_INVALID_ARGUMENT, sub,
                 "not a regular file (a folder)");
    int n = list_dir(dir, names, sizeof names);
    if (n != 1)
        fail_msg("expected only the directory, found: %s", names);
    assert_string_equal(names, "target.safetensors");

    kvst_writer_free(w);
    free(sub);
    free(missing);
    rm_tree(dir);
}

static void test_commit_replaces_atomically(void **state)
{
    (void)state;
    char *dir = make_tmpdir();
    char *path = path_join(dir, "same.safetensors");
    int64_t shape[1] = {2};
    float old_vals[2] = {1.0f, 2.0f};
    float new_vals[2] = {3.0f, 4.0f};

    struct kvst_writer *w;
    expect_ok(kvst_writer_create(&w));
    expect_ok(kvst_writer_add(w, "v", KVCAP_DTYPE_F32, 1, shape, old_vals));
    expect_ok(kvst_writer_set_meta(w, "gen", "old"));
    expect_ok(kvst_writer_commit(w, path));
    kvst_writer_free(w);

    struct kvst_file *old_f;
    expect_ok(kvst_open(path, &old_f));

    expect_ok(kvst_writer_create(&w));
    expect_ok(kvst_writer_add(w, "v", KVCAP_DTYPE_F32, 1, shape, new_vals));
    expect_ok(kvst_writer_add(w, "w", KVCAP_DTYPE_F32, 1, shape, new_vals));
    expect_ok(kvst_writer_set_meta(w, "gen", "new"));
    expect_ok(kvst_writer_commit(w, path));
    kvst_writer_free(w);

    /* The old mapping still sees the old file (rename replaced the name, not the bytes). */
    assert_memory_equal(kvst_find(old_f, "v")->data, old_vals, 8);
    assert_string_equal(kvst_meta(old_f, "gen"), "old");
    kvst_close(old_f);

    struct kvst_file *f;
    expect_ok(kvst_open(path, &f));
    assert_int_equal(kvst_count(f), 2);
    assert_memory_equal(kvst_find(f, "v")->data, new_vals, 8);
    assert_string_equal(kvst_meta(f, "gen"), "new");
    kvst_close(f);

    char names[1024];
    int n = list_dir(dir, names, sizeof names);
    if (n != 1)
        fail_msg("expected only same.safetensors, found: %s", names);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_true(S_ISREG(sb.st_mode));
    free(path);
    rm_tree(dir);
}

/* ---- Reader API edges ------------------------------------------------------------------- */

static void test_reader_api_edges(void **state)
{
    (void)state;
    kvst_close(NULL);
    kvst_writer_free(NULL);
    assert_int_equal(kvst_count(NULL), 0);
    assert_null(kvst_at(NULL, 0));
    assert_null(kvst_find(NULL, "a"));
    assert_null(kvst_meta(NULL, "a"));
    assert_int_equal(kvst_meta_count(NULL), 0);

    struct kvst_file *f = (struct kvst_file *)&f;
    expect_error(kvst_open("/nonexistent/kvst/x.safetensors", &f), KVCAP_ERR_IO,
                 "/nonexistent/kvst/x.safetensors", "cannot open");
    assert_null(f);
    expect_error(kvst_open(KVCAP_TEST_DATA, &f), KVCAP_ERR_IO, KVCAP_TEST_DATA,
                 "not a regular file");
    assert_null(f);
    expect_error(kvst_open_memory(NULL, 0, "nothing", &f), KVCAP_ERR_FORMAT, "nothing",
                 "shorter than the 8-byte");
    expect_error(kvst_open_memory(NULL, 5, "nullbuf", &f), KVCAP_ERR_INVALID_ARGUMENT,
                 "nullbuf", NULL);
}

/* ---- The bad-file corpus ---------------------------------------------------------------- */

/* File (in tests/data/bad/, from make_bad_files.py) -> substring the message must contain
 * besides the file name. Each names the field at fault. */
static const struct {
    const char *file;
    const char *expect;
} bad_files[] = {
    {"truncated", "file is 5 bytes, shorter than the 8-byte header length"},
    {"truncated_empty", "file is 0 bytes"},
    {"header_past_eof", "header length 1000 runs past the end of the file"},
    {"bad_header_length_huge", "header length 1099511627776 exceeds the limit"},
    {"bad_header_length_small", "header length 1 is too small"},
    {"bad_json", "header: invalid JSON"},
    {"bad_utf8", "header: byte 3 (0xff) is not valid UTF-8"},
    {"header_not_object", "header: JSON is an array, not an object"},
    {"header_trailing", "header: trailing bytes after the JSON object"},
    {"header_nul_padding", "control character 0x00"},
    {"json_nul_escape", "\\u0000"},
    {"tensor_not_object", "tensor 'a': value is 5, not an object"},
    {"missing_dtype", "tensor 'a': dtype is missing"},
    {"duplicate_field", "tensor 'a': duplicate key 'dtype'"},
    {"unknown_dtype", "tensor 'a': unknown dtype 'I64'"},
    {"unknown_dtype_lowercase", "tensor 'a': unknown dtype 'f32'"},
    {"bad_shape_negative", "tensor 'a': shape[0] is -2, not a non-negative integer"},
    {"bad_shape_fraction", "tensor 'a': shape[0] is 1.5, not a non-negative integer"},
    {"bad_shape_string", "tensor 'a': shape[0] is a string"},
    {"bad_shape_huge", "tensor 'a': shape[0] is 1.152921504606847e+18"},
    {"bad_rank", "tensor 'a': shape has rank 9, more than 8"},
    {"shape_overflow", "tensor 'a': shape [4503599627370496, 4096] has more than 2^64 elements"},
    {"shape_bytes_overflow", "tensor 'a': shape [2147483648, 2147483648] x F64 overflows"},
    {"bad_data_offsets", "tensor 'a': data_offsets is not an array of two integers"},
    {"bad_data_offsets_fraction", "tensor 'a': data_offsets[1] is 8.5"},
    {"begin_after_end", "tensor 'a': data_offsets [8, 0]: begin is after end"},
    {"offset_out_of_range", "tensor 'a': data_offsets [0, 8] end past the data buffer (4 bytes)"},
    {"size_mismatch", "tensor 'a.b': data_offsets [0, 12] hold 12 bytes, shape [4] x F16 needs 8"},
    {"overlap", "tensor 'b': data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
    {"hole", "tensor 'b': data_offsets [12, 20] leave a hole of 4 bytes [8, 12) after tensor 'a'"},
    {"hole_at_start", "tensor 'a': data_offsets [4, 12] leave a hole of 4 bytes at the start"},
    {"trailing_data", "data buffer: 4 trailing bytes [8, 12) after the last tensor 'a'"},
    {"duplicate_name", "tensor 'a': duplicate tensor name"},
    {"empty_name", "tensor name is empty"},
    {"long_name", "is 256 bytes, longer than 255"},
    {"bad_metadata", "__metadata__['k']: value is 1, not a string"},
    {"bad_metadata_not_object", "__metadata__ is a string, not an object"},
    {"duplicate_metadata", "__metadata__ appears more than once"},
};

static void test_bad_corpus(void **state)
{
    (void)state;
    size_t n = sizeof bad_files / sizeof bad_files[0];
    int failures = 0;
    for (size_t i = 0; i < n; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/bad/%s.safetensors", KVCAP_TEST_DATA, bad_files[i].file);
        struct kvst_file *f = (struct kvst_file *)&f;
        enum kvcap_status st = kvst_open(path, &f);
        const char *msg = kvcap_last_error();
        char fname[256];
        snprintf(fname, sizeof fname, "%s.safetensors", bad_files[i].file);
        if (st != KVCAP_ERR_FORMAT || f != NULL || strncmp(msg, path, strlen(path)) != 0 ||
            !strstr(msg, fname) || !strstr(msg, bad_files[i].expect)) {
            print_error("%s: status %d, message '%s'; expected FORMAT and '%s'\n",
                        bad_files[i].file, (int)st, msg, bad_files[i].expect);
            failures++;
            if (st == KVCAP_OK)
                kvst_close(f);
        }
        /* The same bytes through the memory reader fail the same way. */
        size_t size;
        unsigned char *bytes = read_whole(path, &size);
        st = kvst_open_memory(bytes, size, fname, &f);
        if (st != KVCAP_ERR_FORMAT || !strstr(kvcap_last_error(), bad_files[i].expect)) {
            print_error("%s (memory): status %d, message '%s'\n", bad_files[i].file, (int)st,
                        kvcap_last_error());
            failures++;
            if (st == KVCAP_OK)
                kvst_close(f);
        }
        free(bytes);
    }
    /* Every file of the corpus has a row above (a new class without one is an error). */
    DIR *d = opendir(KVCAP_TEST_DATA "/bad");
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        const char *ext = ".safetensors";
        if (len < strlen(ext) || strcmp(e->d_name + len - strlen(ext), ext) != 0)
            continue;
        int listed = 0;
        for (size_t i = 0; i < n; i++)
            listed |= strlen(bad_files[i].file) == len - strlen(ext) &&
                      strncmp(bad_files[i].file, e->d_name, len - strlen(ext)) == 0;
        if (!listed) {
            print_error("%s has no row in bad_files[]\n", e->d_name);
            failures++;
        }
    }
    closedir(d);
    assert_int_equal(failures, 0);
}

/* ---- Mutation sweep --------------------------------------------------------------------- */

/* Every single-byte mutation and every truncation of a valid file must either open (and then
 * every view must be readable) or fail with FORMAT and a labelled message. Each case gets an
 * exact-size heap copy so AddressSanitizer sees any read past the end. */
static void try_open(const unsigned char *bytes, size_t size, int must_fail)
{
    unsigned char *copy = malloc(size ? size : 1);
    assert_non_null(copy);
    memcpy(copy, bytes, size);
    struct kvst_file *f;
    enum kvcap_status st = kvst_open_memory(copy, size, "fuzz", &f);
    if (st == KVCAP_OK) {
        assert_false(must_fail);
        unsigned sum = 0;
        for (size_t i = 0; i < kvst_count(f); i++) {
            const struct kvst_tensor *t = kvst_at(f, i);
            assert_true(t->offset + t->nbytes <= size);
            assert_int_equal((uintptr_t)t->data % kvcap_dtype_size(t->dtype), 0);
            for (size_t b = 0; b < t->nbytes; b++)
                sum += ((const unsigned char *)t->data)[b];
            sum += (unsigned)strlen(t->name);
        }
        for (size_t i = 0; i < kvst_meta_count(f); i++) {
            const char *k, *v;
            kvst_meta_at(f, i, &k, &v);
            sum += (unsigned)(strlen(k) + strlen(v));
        }
        (void)sum;
        kvst_close(f);
    } else {
        if (st != KVCAP_ERR_FORMAT || strncmp(kvcap_last_error(), "fuzz: ", 6) != 0)
            fail_msg("status %d, message '%s'", (int)st, kvcap_last_error());
    }
    free(copy);
}

static void test_mutation_sweep(void **state)
{
    (void)state;
    char *dir = make_tmpdir();
    char *path = path_join(dir, "small.safetensors");
    struct kvst_writer *w;
    expect_ok(kvst_writer_create(&w));
    float a[3] = {1, -2, 3};
    uint16_t h[2] = {0x3c00, 0xc100};
    unsigned char u[3] = {1, 2, 3};
    int64_t s3[1] = {3}, s2[2] = {1, 2};
    expect_ok(kvst_writer_add(w, "a", KVCAP_DTYPE_F32, 1, s3, a));
    expect_ok(kvst_writer_add(w, "h", KVCAP_DTYPE_F16, 2, s2, h));
    expect_ok(kvst_writer_add(w, "u", KVCAP_DTYPE_U8, 1, s3, u));
    expect_ok(kvst_writer_add(w, "z", KVCAP_DTYPE_F64, 0, NULL, &(double){0.5}));
    expect_ok(kvst_writer_set_meta(w, "k", "v\"x"));
    expect_ok(kvst_writer_commit(w, path));
    kvst_writer_free(w);
    size_t size;
    unsigned char *bytes = read_whole(path, &size);
    unsigned char *m = malloc(size);
    assert_non_null(m);

    /* Every value at every byte of the length field and header (where all parsing
     * happens); two mutations per data byte (data is never interpreted). */
    clock_t t0 = clock();
    size_t cases = 0;
    size_t header_end = 8 + (size_t)bytes[0] + ((size_t)bytes[1] << 8);
    assert_true(header_end < size);
    for (size_t i = 0; i < size; i++) {
        memcpy(m, bytes, size);
        for (unsigned v = 0; v < 256; v++) {
            if (i >= header_end && v != 0 && v != (bytes[i] ^ 0xffu))
                continue;
            if (v == bytes[i])
                continue;
            m[i] = (unsigned char)v;
            try_open(m, size, 0);
            cases++;
        }
    }
    for (size_t len = 0; len < size; len++)
        try_open(bytes, len, 1);
    try_open(bytes, size, 0);
    cases += size + 1;
    double secs = (double)(clock() - t0) / CLOCKS_PER_SEC;
    print_message("mutation sweep: %zu-byte file, %zu cases, %.2f s CPU\n", size, cases, secs);

    free(m);
    free(bytes);
    free(path);
    rm_tree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_empty_file),
        cmocka_unit_test(test_reader_accepts_variants),
        cmocka_unit_test(test_writer_rejects),
        cmocka_unit_test(test_commit_failures_leave_nothing),
        cmocka_unit_test(test_commit_replaces_atomically),
        cmocka_unit_test(test_reader_api_edges),
        cmocka_unit_test(test_bad_corpus),
        cmocka_unit_test(test_mutation_sweep),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
