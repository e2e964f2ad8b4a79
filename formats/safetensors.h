/* safetensors.h — the container layer of formats/SPEC.md §1: a hostile-file-proof reader that
 * maps a file read-only and hands out zero-copy tensor views, and an atomic writer. Internal to
 * kvcap (not installed); the kvcap schema on top lives in schema.h. */
#ifndef KVCAP_SAFETENSORS_H
#define KVCAP_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"

#define KVST_MAX_DIMS 8
#define KVST_MAX_NAME 255
#define KVST_MAX_HEADER 100000000ull

struct kvst_tensor {
    const char *name;         /* NUL-terminated, owned by the file */
    enum kvcap_dtype dtype;
    int ndim;                 /* 0..KVST_MAX_DIMS; 0 is a scalar */
    int64_t shape[KVST_MAX_DIMS];
    size_t n_elements;        /* product of shape (1 for a scalar) */
    size_t nbytes;            /* n_elements * dtype size */
    uint64_t offset;          /* BEGIN of data_offsets, relative to the data buffer */
    const void *data;         /* aligned to the element size; valid until kvst_close */
};

struct kvst_file;

/* Opens and validates `path` (every rule of SPEC.md §1). On failure *out is NULL and the
 * error message (kvcap_last_error) starts with the path and names the field at fault. The file
 * is mapped, not read: tensor views cost no memory, but a file truncated by someone else while
 * it is open ends the process with SIGBUS on the next read of a lost page (as with every
 * memory-mapped reader). kvcap's own writers never do that (they replace a file by renaming
 * a new one over it, which leaves open mappings intact); formats/SPEC.md §1 tells users of the
 * tools that read datasets and states this way (kvcap-calibrate, kvcap-convert, kvcap-eval). */
enum kvcap_status kvst_open(const char *path, struct kvst_file **out);

/* Same rules over a caller-owned buffer (kept, not copied, until kvst_close); `label` is used
 * in error messages instead of a path. */
enum kvcap_status kvst_open_memory(const void *bytes, size_t size, const char *label,
                                   struct kvst_file **out);

void kvst_close(struct kvst_file *f); /* NULL is a no-op */

const char *kvst_path(const struct kvst_file *f);       /* path or label given at open */
uint64_t kvst_file_size(const struct kvst_file *f);
uint64_t kvst_header_size(const struct kvst_file *f);   /* N of SPEC §1 */

/* Tensors in name order (strcmp). */
size_t kvst_count(const struct kvst_file *f);
const struct kvst_tensor *kvst_at(const struct kvst_file *f, size_t i);
/* NULL when absent (no error is recorded: absence is often legitimate). */
const struct kvst_tensor *kvst_find(const struct kvst_file *f, const char *name);

/* __metadata__ entries in key order; kvst_meta returns NULL when the key is absent. */
size_t kvst_meta_count(const struct kvst_file *f);
void kvst_meta_at(const struct kvst_file *f, size_t i, const char **key, const char **value);
const char *kvst_meta(const struct kvst_file *f, const char *key);

/* ---- Writer --------------------------------------------------------------------------- */
struct kvst_writer;

enum kvcap_status kvst_writer_create(struct kvst_writer **out);
void kvst_writer_free(struct kvst_writer *w); /* NULL is a no-op; discards uncommitted state */

/* Adds a tensor. `data` (nbytes = elements × dtype size) is BORROWED: it must stay valid and
 * unchanged until kvst_writer_commit returns. `name` and `shape` are copied. Duplicate or
 * invalid names, ranks above KVST_MAX_DIMS and negative dims fail with INVALID_ARGUMENT. */
enum kvcap_status kvst_writer_add(struct kvst_writer *w, const char *name, enum kvcap_dtype dtype,
                                  int ndim, const int64_t *shape, const void *data);

/* Same, but the writer copies the data now (for small or temporary tensors). */
enum kvcap_status kvst_writer_add_copy(struct kvst_writer *w, const char *name,
                                       enum kvcap_dtype dtype, int ndim, const int64_t *shape,
                                       const void *data);

/* Sets (or replaces) a __metadata__ entry; both strings are copied. */
enum kvcap_status kvst_writer_set_meta(struct kvst_writer *w, const char *key, const char *value);

/* Writes the file atomically (SPEC §1: temporary file, fsync, rename, fsync of the directory).
 * On any failure nothing exists under `path` that was not there before, and the temporary file
 * is removed. The writer may be committed again (e.g. to a second path). */
enum kvcap_status kvst_writer_commit(struct kvst_writer *w, const char *path);

#endif /* KVCAP_SAFETENSORS_H */
