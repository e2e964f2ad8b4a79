/* common.c — version, status strings, per-thread last error and the log callback: the
 * conventions every libkvcap call relies on. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/internal.h"

#define KVCAP_ERROR_CAP 1024

static _Thread_local char last_error[KVCAP_ERROR_CAP];
static _Thread_local int quiet_depth; /* > 0: kvcap_fail records but does not log */

/* The log sink: callback, its user pointer and level, set and read together under one lock, so
 * a message goes to a callback with the user pointer and filter it was installed with. The lock
 * is held while the three are copied, never during the callback (which may log, or set another
 * sink). Logging is rare (failures and a few notices): one uncontended lock costs nothing next to
 * formatting the message. */
struct log_sink {
    kvcap_log_fn fn;
    void *user;
    enum kvcap_log_level min_level;
};
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static struct log_sink log_sink; /* fn NULL: silent */

const char *kvcap_version(void)
{
    return KVCAP_VERSION_STRING;
}

unsigned kvcap_version_number(void)
{
    return KVCAP_VERSION_NUMBER;
}

const char *kvcap_status_str(enum kvcap_status status)
{
    switch (status) {
    case KVCAP_OK: return "ok";
    case KVCAP_ERR_INVALID_ARGUMENT: return "invalid argument";
    case KVCAP_ERR_OUT_OF_MEMORY: return "out of memory";
    case KVCAP_ERR_IO: return "input/output error";
    case KVCAP_ERR_FORMAT: return "malformed file";
    case KVCAP_ERR_VERSION: return "unsupported format version";
    case KVCAP_ERR_CONFIG: return "invalid configuration";
    case KVCAP_ERR_GEOMETRY: return "geometry mismatch";
    case KVCAP_ERR_UNSUPPORTED: return "not supported by this build";
    case KVCAP_ERR_NUMERIC: return "numerical failure";
    case KVCAP_ERR_DEVICE: return "device error";
    case KVCAP_ERR_STATE: return "invalid state";
    case KVCAP_ERR_NOT_FOUND: return "not found";
    case KVCAP_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

const char *kvcap_last_error(void)
{
    return last_error;
}

void kvcap_clear_error(void)
{
    last_error[0] = '\0';
}

void kvcap_log_set(kvcap_log_fn fn, void *user, enum kvcap_log_level min_level)
{
    /* Out of range: below DEBUG shows everything, above ERROR still shows errors (a level
     * past every message would silently drop them all). */
    if ((int)min_level < KVCAP_LOG_DEBUG)
        min_level = KVCAP_LOG_DEBUG;
    if ((int)min_level > KVCAP_LOG_ERROR)
        min_level = KVCAP_LOG_ERROR;
    pthread_mutex_lock(&log_lock);
    log_sink = (struct log_sink){fn, fn ? user : NULL, min_level};
    pthread_mutex_unlock(&log_lock);
}

static void log_v(enum kvcap_log_level level, const char *fmt, va_list ap)
{
    pthread_mutex_lock(&log_lock);
    struct log_sink sink = log_sink;
    pthread_mutex_unlock(&log_lock);
    if (!sink.fn || level < sink.min_level)
        return;
    char line[KVCAP_ERROR_CAP];
    vsnprintf(line, sizeof line, fmt, ap);
    sink.fn(level, line, sink.user);
}

void kvcap_log(enum kvcap_log_level level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_v(level, fmt, ap);
    va_end(ap);
}

enum kvcap_status kvcap_fail(enum kvcap_status status, const char *fmt, ...)
{
    /* Format into a local buffer first: callers may pass kvcap_last_error() itself as an
     * argument to re-raise it with more context. */
    char message[KVCAP_ERROR_CAP];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    memcpy(last_error, message, sizeof last_error);
    if (quiet_depth == 0)
        kvcap_log(KVCAP_LOG_ERROR, "%s", last_error);
    return status;
}

void kvcap_quiet_push(void)
{
    quiet_depth++;
}

void kvcap_quiet_pop(void)
{
    if (quiet_depth > 0)
        quiet_depth--;
}

void kvcap_parallel_fail(struct kvcap_parallel_error *e, enum kvcap_status status)
{
    int expected = 0;
    if (!__atomic_compare_exchange_n(&e->failed, &expected, 2, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return; /* another worker failed first */
    e->status = status;
    snprintf(e->message, sizeof e->message, "%s", last_error);
    __atomic_store_n(&e->failed, 1, __ATOMIC_RELEASE);
}

int kvcap_parallel_failed(const struct kvcap_parallel_error *e)
{
    return __atomic_load_n(&e->failed, __ATOMIC_ACQUIRE) != 0;
}

enum kvcap_status kvcap_parallel_status(const struct kvcap_parallel_error *e)
{
    if (__atomic_load_n(&e->failed, __ATOMIC_ACQUIRE) == 0)
        return KVCAP_OK;
    return kvcap_fail(e->status, "%s", e->message);
}

double kvcap_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* What a file that is not a regular one is, for messages. */
static const char *file_kind(mode_t mode)
{
    return S_ISDIR(mode)                    ? "folder"
           : S_ISFIFO(mode)                 ? "FIFO"
           : S_ISCHR(mode) || S_ISBLK(mode) ? "device"
                                            : "socket or other";
}

/* Opens an input for reading only if it is a regular file. O_NONBLOCK keeps the open itself
 * from waiting for a writer when the path is a FIFO (it is cleared once the type is known); a
 * device, FIFO, socket or folder is refused before anything is read from it. */
static enum kvcap_status open_regular(const char *path, int *fd_out, struct stat *sb)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    KVCAP_RETURN_IF(fd < 0, KVCAP_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (fstat(fd, sb) != 0) {
        int e = errno;
        close(fd);
        return kvcap_fail(KVCAP_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb->st_mode)) {
        close(fd);
        return kvcap_fail(KVCAP_ERR_IO, "%s: not a regular file (a %s)", path,
                          file_kind(sb->st_mode));
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        int e = errno;
        close(fd);
        return kvcap_fail(KVCAP_ERR_IO, "%s: fcntl: %s", path, strerror(e));
    }
    *fd_out = fd;
    return KVCAP_OK;
}

enum kvcap_status kvcap_check_replaceable(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return KVCAP_OK; /* nothing there (or nothing we may look at: the write will say) */
    KVCAP_RETURN_IF(!S_ISREG(sb.st_mode), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: exists and is not a regular file (a %s); refusing to replace it", path,
                    file_kind(sb.st_mode));
    return KVCAP_OK;
}

enum kvcap_status kvcap_map_file(const char *path, size_t min_size, const char *too_short,
                                 void **map, size_t *size)
{
    int fd = -1;
    struct stat sb;
    KVCAP_TRY(open_regular(path, &fd, &sb));
    if ((uint64_t)sb.st_size < min_size) {
        close(fd);
        return kvcap_fail(KVCAP_ERR_FORMAT, "%s: file is %lld bytes, %s", path,
                          (long long)sb.st_size, too_short);
    }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        close(fd);
        return kvcap_fail(KVCAP_ERR_IO, "%s: file of %lld bytes cannot be mapped", path,
                          (long long)sb.st_size);
    }
    *size = (size_t)sb.st_size;
    *map = mmap(NULL, *size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file referenced */
    KVCAP_RETURN_IF(*map == MAP_FAILED, KVCAP_ERR_IO, "%s: cannot map %zu bytes: %s", path,
                    *size, strerror(e));
    return KVCAP_OK;
}

int kvcap_fsync_parent(const char *path)
{
    const char *slash = strrchr(path, '/');
    char *dir = !slash ? strdup(".") : slash == path ? strdup("/")
                                                     : strndup(path, (size_t)(slash - path));
    if (!dir) {
        errno = ENOMEM;
        return -1;
    }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    free(dir);
    if (fd < 0)
        return -1;
    int rc = fsync(fd), e = errno;
    close(fd);
    if (rc != 0 && (e == EINVAL || e == ENOTSUP))
        rc = 0;
    errno = e;
    return rc;
}

/* ---- Temporary files in progress ------------------------------------------------------------
 * A fixed table, so that a signal handler can walk it: a slot is claimed (FREE -> CLAIMED) by
 * compare-and-swap, its path copied, then published (LIVE); kvcap_temp_remove_all reads LIVE
 * slots only. Lock-free atomics and unlink are async-signal-safe. */
enum { TEMP_SLOTS = 64, TEMP_FREE = 0, TEMP_CLAIMED = 1, TEMP_LIVE = 2 };
static struct {
    atomic_int state;
    char path[4096];
} temps[TEMP_SLOTS];

int kvcap_temp_register(const char *path)
{
    size_t n = strlen(path);
    if (n >= sizeof temps[0].path)
        return -1;
    for (int i = 0; i < TEMP_SLOTS; i++) {
        int expected = TEMP_FREE;
        if (atomic_compare_exchange_strong(&temps[i].state, &expected, TEMP_CLAIMED)) {
            memcpy(temps[i].path, path, n + 1);
            atomic_store(&temps[i].state, TEMP_LIVE);
            return i;
        }
    }
    return -1;
}

void kvcap_temp_unregister(int slot)
{
    if (slot >= 0 && slot < TEMP_SLOTS)
        atomic_store(&temps[slot].state, TEMP_FREE);
}

void kvcap_temp_remove_all(void)
{
    for (int i = 0; i < TEMP_SLOTS; i++)
        if (atomic_load(&temps[i].state) == TEMP_LIVE)
            unlink(temps[i].path);
}

/* One output of kvcap_write_files_atomic on its way: PATH.tmp-XXXXXX written and synced. */
struct pending_file {
    char *tmp;
    int slot; /* in the temporary-file table, -1 when it could not be entered */
};

static void pending_drop(struct pending_file *f)
{
    if (!f->tmp)
        return;
    unlink(f->tmp);
    kvcap_temp_unregister(f->slot);
    free(f->tmp);
    f->tmp = NULL;
}

/* Writes data to a new temporary file beside `path` and syncs it; on failure nothing is left. */
static enum kvcap_status pending_write(const char *path, const void *data, size_t len,
                                       struct pending_file *f)
{
    size_t n = strlen(path) + sizeof ".tmp-XXXXXX";
    f->tmp = malloc(n);
    f->slot = -1;
    KVCAP_RETURN_IF(!f->tmp, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    snprintf(f->tmp, n, "%s.tmp-XXXXXX", path);
    int fd = mkstemp(f->tmp);
    if (fd < 0) {
        enum kvcap_status st = kvcap_fail(KVCAP_ERR_IO, "%s: cannot create a temporary file: %s",
                                          path, strerror(errno));
        free(f->tmp);
        f->tmp = NULL;
        return st;
    }
    f->slot = kvcap_temp_register(f->tmp);
    /* mkstemp makes the file private; outputs are for sharing. */
    const char *what = "fchmod";
    if (fchmod(fd, 0644) != 0)
        goto fail;
    what = "write";
    for (size_t off = 0; off < len;) {
        ssize_t w = write(fd, (const char *)data + off, len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            if (w == 0)
                errno = EIO;
            goto fail;
        }
        off += (size_t)w;
    }
    what = "fsync";
    if (fsync(fd) != 0)
        goto fail;
    what = "close";
    int rc = close(fd);
    fd = -1;
    if (rc != 0)
        goto fail;
    return KVCAP_OK;
fail:;
    int e = errno;
    if (fd >= 0)
        close(fd);
    enum kvcap_status st = kvcap_fail(KVCAP_ERR_IO, "%s: %s of temporary file %s failed: %s",
                                      path, what, f->tmp, strerror(e));
    pending_drop(f);
    return st;
}

enum kvcap_status kvcap_write_files_atomic(int n, const char *const *paths,
                                           const void *const *data, const size_t *lens)
{
    KVCAP_RETURN_IF(n < 0 || n > 8, KVCAP_ERR_INVALID_ARGUMENT,
                    "write_files_atomic: %d files (0..8)", n);
    for (int i = 0; i < n; i++)
        KVCAP_TRY(kvcap_check_replaceable(paths[i]));
    struct pending_file f[8] = {{0}};
    enum kvcap_status st = KVCAP_OK;
    for (int i = 0; st == KVCAP_OK && i < n; i++)
        st = pending_write(paths[i], data[i], lens[i], &f[i]);
    /* every file is written and synced: only renames remain, which fail for reasons (a folder
     * replaced meanwhile, a read-only remount) the files before would have hit too */
    for (int i = 0; st == KVCAP_OK && i < n; i++) {
        if (rename(f[i].tmp, paths[i]) != 0) {
            st = kvcap_fail(KVCAP_ERR_IO, "%s: rename of temporary file %s failed: %s%s",
                            paths[i], f[i].tmp, strerror(errno),
                            i > 0 ? " (the outputs before it were written)" : "");
            break;
        }
        kvcap_temp_unregister(f[i].slot);
        free(f[i].tmp);
        f[i].tmp = NULL;
        if (kvcap_fsync_parent(paths[i]) != 0)
            st = kvcap_fail(KVCAP_ERR_IO, "%s: written, but fsync of its directory failed: %s",
                            paths[i], strerror(errno));
    }
    for (int i = 0; i < n; i++)
        pending_drop(&f[i]);
    return st;
}

enum kvcap_status kvcap_write_file_atomic(const char *path, const void *data, size_t len)
{
    return kvcap_write_files_atomic(1, &path, &data, &len);
}

size_t kvcap_utf8_seq_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c < 0x80)
        return 1;
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0)
            lo = 0xA0;
        else if (c == 0xED)
            hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F;
    } else {
        return 0;
    }
    if (n < len || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF)
            return 0;
    return len;
}

enum kvcap_status kvcap_read_file(const char *path, size_t max_bytes, enum kvcap_status too_big,
                                  const char *too_big_suffix, char **out, size_t *len)
{
    int fd = -1;
    struct stat sb;
    KVCAP_TRY(open_regular(path, &fd, &sb));
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        int e = errno;
        close(fd);
        return kvcap_fail(KVCAP_ERR_IO, "%s: cannot open: %s", path, strerror(e));
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    enum kvcap_status st = KVCAP_OK;
    while (buf) {
        if (n == cap - 1) {
            if (n > max_bytes)
                break;
            char *bigger = realloc(buf, cap * 2);
            if (!bigger) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = bigger;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - 1 - n, f);
        n += got;
        if (got == 0) {
            if (ferror(f))
                st = kvcap_fail(KVCAP_ERR_IO, "%s: read failed: %s", path, strerror(errno));
            break;
        }
    }
    fclose(f);
    if (!buf)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory reading the file", path);
    if (st == KVCAP_OK && n > max_bytes)
        st = kvcap_fail(too_big, "%s: larger than %zu bytes%s", path, max_bytes, too_big_suffix);
    if (st != KVCAP_OK) {
        free(buf);
        return st;
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return KVCAP_OK;
}

enum kvcap_status kvcap_make_dirs(const char *dir)
{
    char path[4096];
    KVCAP_RETURN_IF(snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path,
                    KVCAP_ERR_INVALID_ARGUMENT, "%s: path too long", dir);
    for (char *p = path + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char saved = *p;
            *p = '\0';
            KVCAP_RETURN_IF(mkdir(path, 0777) != 0 && errno != EEXIST, KVCAP_ERR_IO,
                            "%s: cannot create folder: %s", path, strerror(errno));
            *p = saved;
            if (saved == '\0')
                break;
        }
    }
    struct stat st;
    KVCAP_RETURN_IF(stat(dir, &st) != 0 || !S_ISDIR(st.st_mode), KVCAP_ERR_IO,
                    "%s: not a folder", dir);
    return KVCAP_OK;
}

#ifndef KVCAP_WITH_CUDA
/* A build without CUDA has no devices (kernels/cuda/device.cu answers in a CUDA build). */
int kvcap_cuda_device_count(void)
{
    return 0;
}
#endif
