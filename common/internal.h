/* internal.h — helpers shared by every libkvcap source file (not installed): error reporting,
 * logging and checked arithmetic. Public conventions live in include/kvcap.h. */
#ifndef KVCAP_INTERNAL_H
#define KVCAP_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"
#include "common/dtype.h"

#if defined(__GNUC__)
#  define KVCAP_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#  define KVCAP_PRINTF(a, b)
#endif

/* Records `fmt` as this thread's last error (see kvcap_last_error), forwards it to the log
 * callback at KVCAP_LOG_ERROR, and returns `status` so callers can `return kvcap_fail(...)`. */
enum kvcap_status kvcap_fail(enum kvcap_status status, const char *fmt, ...) KVCAP_PRINTF(2, 3);

/* Sends one message to the log callback if one is installed and `level` passes its filter. */
void kvcap_log(enum kvcap_log_level level, const char *fmt, ...) KVCAP_PRINTF(2, 3);

/* Between push and pop (nestable, per thread) kvcap_fail records the last error without
 * logging it: for callers that re-raise a callee's error with more context (a file position),
 * so the log shows one line per failure. */
void kvcap_quiet_push(void);
void kvcap_quiet_pop(void);

/* The first failure among worker threads (OpenMP loops): workers record it with
 * kvcap_parallel_fail (the first one wins, with its message); after the loop the caller
 * re-raises it on its own thread with kvcap_parallel_status. */
struct kvcap_parallel_error {
    int failed; /* read with kvcap_parallel_failed */
    enum kvcap_status status;
    char message[1024];
};
void kvcap_parallel_fail(struct kvcap_parallel_error *e, enum kvcap_status status);
int kvcap_parallel_failed(const struct kvcap_parallel_error *e);
enum kvcap_status kvcap_parallel_status(const struct kvcap_parallel_error *e);

/* Seconds on a monotonic clock (timings in reports and benchmarks). */
double kvcap_seconds(void);

/* KVCAP_OK when `path` does not exist or is a regular file; a device, FIFO, socket or folder
 * is refused (KVCAP_ERR_INVALID_ARGUMENT naming it) rather than replaced by a rename. The
 * atomic writers call it first. */
enum kvcap_status kvcap_check_replaceable(const char *path);

/* Maps the regular file `path` read-only (file readers: safetensors, GGUF). Open, stat, mmap
 * failures and non-regular files are KVCAP_ERR_IO (a FIFO is refused without waiting for a
 * writer, as kvcap_read_file does); a file shorter than min_size is
 * KVCAP_ERR_FORMAT "PATH: file is N bytes, <too_short>". Unmap with munmap(*map, *size). */
enum kvcap_status kvcap_map_file(const char *path, size_t min_size, const char *too_short,
                                 void **map, size_t *size);

/* fsync of the directory holding `path`, so a rename into it is durable; filesystems that
 * cannot sync a directory (EINVAL, ENOTSUP) count as success. 0 or -1 with errno. */
int kvcap_fsync_parent(const char *path);

/* Writes `len` bytes to PATH.tmp-XXXXXX (mode 0644), syncs it and renames it over `path`, then
 * syncs the directory: on failure (KVCAP_ERR_IO naming the call) the temporary file is removed
 * and `path` is untouched. */
enum kvcap_status kvcap_write_file_atomic(const char *path, const void *data, size_t len);

/* kvcap_write_file_atomic for n (<= 8) outputs that belong together (a report's HTML and CSV):
 * every destination is checked and every temporary file written and synced before the first
 * rename, so a failure to write any of them leaves all n destinations untouched. */
enum kvcap_status kvcap_write_files_atomic(int n, const char *const *paths,
                                           const void *const *data, const size_t *lens);

/* Temporary files being written, for the tools' signal handlers: the writers enter each one
 * (kvcap_temp_register returns its slot, -1 when the table of 64 is full: then it is not
 * removed on a signal) and take it out once renamed or removed. kvcap_temp_remove_all unlinks
 * every one entered and is async-signal-safe; the library never installs a handler itself. */
int kvcap_temp_register(const char *path);
void kvcap_temp_unregister(int slot);
void kvcap_temp_remove_all(void);

/* Reads the whole file `path` into a heap buffer with a NUL after its *len bytes. Open and
 * read failures are KVCAP_ERR_IO; a file of more than max_bytes fails with `too_big` and
 * "PATH: larger than MAX bytes<too_big_suffix>". */
enum kvcap_status kvcap_read_file(const char *path, size_t max_bytes, enum kvcap_status too_big,
                                  const char *too_big_suffix, char **out, size_t *len);

/* Creates the folder `dir` and its missing parents (mkdir -p); KVCAP_ERR_IO naming the part
 * that could not be made, or `dir` when it exists but is not a folder. */
enum kvcap_status kvcap_make_dirs(const char *dir);

/* Length of the valid UTF-8 sequence at s[0] (n >= 1 bytes available), 0 when it is not one:
 * overlong forms, surrogates and code points above U+10FFFF are invalid. */
size_t kvcap_utf8_seq_len(const unsigned char *s, size_t n);

/* Clears this thread's last error (done by API entry points that succeed partially). */
void kvcap_clear_error(void);

/* Propagate a non-OK status unchanged (the callee already set the message). */
#define KVCAP_TRY(expr)                              \
    do {                                             \
        enum kvcap_status kvcap_try_s_ = (expr);     \
        if (kvcap_try_s_ != KVCAP_OK)                \
            return kvcap_try_s_;                     \
    } while (0)

/* Fail with `status` and a formatted message when `cond` holds. */
#define KVCAP_RETURN_IF(cond, status, ...)           \
    do {                                             \
        if (cond)                                    \
            return kvcap_fail((status), __VA_ARGS__); \
    } while (0)

/* Names used in YAML configs and in kvcap.config JSON, one table for both. Parsers return 1
 * on success, 0 for an unknown name; *_name return "?" for an unknown value. */
int kvcap_rope_type_parse(const char *s, enum kvcap_rope_type *out);
const char *kvcap_rope_type_name(enum kvcap_rope_type t);
int kvcap_rope_pairing_parse(const char *s, enum kvcap_rope_pairing *out);
const char *kvcap_rope_pairing_name(enum kvcap_rope_pairing p);
int kvcap_policy_parse(const char *s, enum kvcap_policy *out);
const char *kvcap_policy_name(enum kvcap_policy p);
int kvcap_structure_parse(const char *s, enum kvcap_structure *out);
const char *kvcap_structure_name(enum kvcap_structure s);

/* Checks a bucket (positive grid, tile divides grid); `field` prefixes the message,
 * e.g. "buckets[1]". KVCAP_ERR_GEOMETRY on failure. Does not log: callers re-raise the
 * message with their context. */
enum kvcap_status kvcap_bucket_check(const struct kvcap_bucket *b, const char *field);

/* Token index (row-major over the grid) of point p of tile t, tiles numbered row-major over
 * the grid and points row-major inside a tile (SPEC §3); dense buckets: t = 0, p = token. */
size_t kvcap_bucket_token(const struct kvcap_bucket *b, int t, int p);

/* The first field ("model.kv_heads", ...) in which two geometries differ (the name is
 * ignored), or NULL when they describe the same model. */
const char *kvcap_geometry_difference(const struct kvcap_model_geometry *a,
                                      const struct kvcap_model_geometry *b);

/* kvcap_geometry_validate without logging, for callers that re-raise (see kvcap_quiet_push). */
enum kvcap_status kvcap_geometry_check(const struct kvcap_model_geometry *g);

/* A number read from JSON or YAML as a double (cJSON keeps every number as one) that must be a
 * whole number in [lo, hi]: returns 1 and sets *out, or returns 0 and leaves *out untouched for
 * NaN, an infinity, a fraction (2.5 is not 2) or a value outside the range. Readers convert
 * through these instead of casting, which is undefined for NaN and out-of-range values; the
 * caller names the field in its message. The int form clamps [lo, hi] to the range of int. */
int kvcap_int_from_double(double v, long lo, long hi, int *out);
int kvcap_int64_from_double(double v, int64_t lo, int64_t hi, int64_t *out);

/* Overflow-checked size arithmetic: returns 0 (and leaves *out untouched) on overflow. */
static inline int kvcap_mul_size(size_t a, size_t b, size_t *out)
{
    if (a != 0 && b > SIZE_MAX / a)
        return 0;
    *out = a * b;
    return 1;
}

static inline int kvcap_add_size(size_t a, size_t b, size_t *out)
{
    if (b > SIZE_MAX - a)
        return 0;
    *out = a + b;
    return 1;
}

/* Inserts x into a[0..n) kept ascending, of which at most cap entries are stored (a list
 * longer than cap keeps its cap smallest): how selections are listed for inspection. Returns
 * n + 1, the count with x. */
static inline int kvcap_insert_ascending(int *a, int n, int cap, int x)
{
    int i = n < cap ? n : cap;
    while (i > 0 && a[i - 1] > x) {
        if (i < cap)
            a[i] = a[i - 1];
        i--;
    }
    if (i < cap)
        a[i] = x;
    return n + 1;
}

#endif /* KVCAP_INTERNAL_H */
