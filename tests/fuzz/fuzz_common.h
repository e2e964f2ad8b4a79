/* fuzz_common.h — what the libFuzzer harnesses share: the checks every call's status must pass,
 * a per-process scratch folder for readers that only take a path, and a reader of fuzzer bytes
 * for the harnesses that derive parameters from their input. */
#ifndef KVCAP_FUZZ_COMMON_H
#define KVCAP_FUZZ_COMMON_H

#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/internal.h"
#include "kvcap.h"

/* A broken invariant: say which and stop, so libFuzzer keeps the input as a crash. */
#define FUZZ_ASSERT(cond, ...)                                                           \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);     \
            fprintf(stderr, __VA_ARGS__);                                                \
            fprintf(stderr, "\n");                                                       \
            abort();                                                                     \
        }                                                                                \
    } while (0)

/* The library's contract for every fallible call (kvcap.h): the status is one of the pinned
 * values, and a failure leaves a message saying what was wrong. Call kvcap_clear_error() before
 * the call so an older message cannot stand in for a missing one. */
static inline void fuzz_check_status(enum kvcap_status st, const char *call)
{
    FUZZ_ASSERT((int)st >= KVCAP_OK && (int)st <= KVCAP_ERR_INTERNAL, "%s returned %d", call,
                (int)st);
    FUZZ_ASSERT(st != KVCAP_ERR_INTERNAL, "%s: internal error: %s", call, kvcap_last_error());
    FUZZ_ASSERT(st == KVCAP_OK || kvcap_last_error()[0] != '\0',
                "%s failed with %s and no message", call, kvcap_status_str(st));
}

/* ---- Scratch files --------------------------------------------------------------------- */

static char fuzz_dir_[4096];

/* Removes the files of folder `dir`, and with `self` the folders in it and `dir` itself (the
 * scratch folder holds files and folders of files, nothing deeper). */
static inline void fuzz_empty_dir(const char *dir, int self)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[4096 + 256 + 2];
    while (d && (e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            if (unlink(path) != 0 && self)
                fuzz_empty_dir(path, 1);
        }
    if (d)
        closedir(d);
    if (self)
        rmdir(dir);
}

static void fuzz_remove_dir_(void)
{
    fuzz_empty_dir(fuzz_dir_, 1);
}

/* A folder of this process's own under $TMPDIR (scripts/fuzz.sh points it at a RAM disk when
 * there is one), made on first use and removed at exit. */
static inline const char *fuzz_tmpdir(void)
{
    if (!fuzz_dir_[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(fuzz_dir_, sizeof fuzz_dir_, "%s/kvcap-fuzz-%d-XXXXXX", t && *t ? t : "/tmp",
                 (int)getpid());
        FUZZ_ASSERT(mkdtemp(fuzz_dir_) != NULL, "cannot make a scratch folder %s", fuzz_dir_);
        atexit(fuzz_remove_dir_);
    }
    return fuzz_dir_;
}

/* The path of scratch file `name` in out[cap]. */
static inline void fuzz_path(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", fuzz_tmpdir(), name);
}

/* Writes `size` bytes to scratch file `name`; its path goes to out[cap]. */
static inline void fuzz_write_file(char *out, size_t cap, const char *name, const void *data,
                                   size_t size)
{
    fuzz_path(out, cap, name);
    FILE *f = fopen(out, "wb");
    FUZZ_ASSERT(f != NULL, "cannot create %s", out);
    FUZZ_ASSERT(size == 0 || fwrite(data, 1, size, f) == size, "cannot write %s", out);
    FUZZ_ASSERT(fclose(f) == 0, "cannot close %s", out);
}

/* ---- Parameters from fuzzer bytes ------------------------------------------------------- */

/* Consumes the input from the front; an exhausted input reads as zeros, so every prefix of an
 * input is itself a complete set of parameters (libFuzzer's shrinking keeps working). */
struct fuzz_bytes {
    const uint8_t *p;
    size_t n;
};

static inline unsigned fuzz_u8(struct fuzz_bytes *b)
{
    if (!b->n)
        return 0;
    b->n--;
    return *b->p++;
}

static inline uint32_t fuzz_u32(struct fuzz_bytes *b)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)fuzz_u8(b) << (8 * i);
    return v;
}

/* An integer in lo..hi (inclusive, hi - lo < 65536); lo when the input is exhausted. */
static inline int fuzz_int(struct fuzz_bytes *b, int lo, int hi)
{
    unsigned span = (unsigned)(hi - lo) + 1;
    unsigned v = fuzz_u8(b);
    if (span > 256)
        v |= fuzz_u8(b) << 8;
    return lo + (int)(v % span);
}

/* One of n choices. */
static inline int fuzz_pick(struct fuzz_bytes *b, int n)
{
    return fuzz_int(b, 0, n - 1);
}

/* A number in (0, 1] on a grid of 1/256. */
static inline double fuzz_unit(struct fuzz_bytes *b)
{
    return (fuzz_u8(b) + 1) / 256.0;
}

/* Every element finite (what an OK status promises of an output). */
static inline int fuzz_all_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return 0;
    return 1;
}

#endif
