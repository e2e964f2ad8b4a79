/* common.c — version, status strings, per-thread last error and the log callback: the
 * conventions every libkvcap call relies on. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "internal.h"

#define KVCAP_ERROR_CAP 1024

static _Thread_local char last_error[KVCAP_ERROR_CAP];
static _Thread_local int quiet_depth; /* > 0: kvcap_fail records but does not log */

/* The callback triple is read without a lock: a torn read is avoided by publishing one
 * immutable struct through an atomic pointer. */
struct log_sink {
    kvcap_log_fn fn;
    void *user;
    enum kvcap_log_level min_level;
};
static struct log_sink log_sinks[2];
static _Atomic(struct log_sink *) log_current = NULL;
static atomic_int log_slot = 0;

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
    if (!fn) {
        atomic_store(&log_current, NULL);
        return;
    }
    /* Two slots alternate so a reader holding the previous sink never sees it rewritten
     * by the very next call; callers set the callback rarely (see the header). */
    int slot = atomic_fetch_xor(&log_slot, 1);
    log_sinks[slot] = (struct log_sink){fn, user, min_level};
    atomic_store(&log_current, &log_sinks[slot]);
}

static void log_v(enum kvcap_log_level level, const char *fmt, va_list ap)
{
    struct log_sink *sink = atomic_load(&log_current);
    if (!sink || level < sink->min_level)
        return;
    char line[KVCAP_ERROR_CAP];
    vsnprintf(line, sizeof line, fmt, ap);
    sink->fn(level, line, sink->user);
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

size_t kvcap_dtype_size(enum kvcap_dtype dtype)
{
    switch (dtype) {
    case KVCAP_DTYPE_F32: return 4;
    case KVCAP_DTYPE_F16: return 2;
    case KVCAP_DTYPE_BF16: return 2;
    case KVCAP_DTYPE_F64: return 8;
    case KVCAP_DTYPE_I32: return 4;
    case KVCAP_DTYPE_U8: return 1;
    }
    return 0;
}

const char *kvcap_dtype_name(enum kvcap_dtype dtype)
{
    switch (dtype) {
    case KVCAP_DTYPE_F32: return "F32";
    case KVCAP_DTYPE_F16: return "F16";
    case KVCAP_DTYPE_BF16: return "BF16";
    case KVCAP_DTYPE_F64: return "F64";
    case KVCAP_DTYPE_I32: return "I32";
    case KVCAP_DTYPE_U8: return "U8";
    }
    return "?";
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
