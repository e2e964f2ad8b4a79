/* test_util.h — scratch folders for the test programs: made under $TMPDIR (ctest points it at
 * the build tree), removed with their files when a test is done; and the small RoPE model
 * geometry several tests share. */
#ifndef KVCAP_TEST_UTIL_H
#define KVCAP_TEST_UTIL_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kvcap.h"

/* A new empty folder TMPDIR/TAG-PID-XXXXXX in out[cap]; returns 0 if it could not be made. */
static inline int test_tmpdir(char *out, size_t cap, const char *tag)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(out, cap, "%s/%s-%d-XXXXXX", tmp && *tmp ? tmp : "/tmp", tag, (int)getpid());
    return mkdtemp(out) != NULL;
}

/* Removes a folder of plain files (hidden entries are not created by the tests). */
static inline void test_rm_tree(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[4096 + 256 + 2];
    while (d && (e = readdir(d)) != NULL)
        if (e->d_name[0] != '.') {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
    if (d)
        closedir(d);
    rmdir(dir);
}

/* A small valid RoPE geometry: 2 layers, 4 query heads on 2 KV heads, head_dim 64, θ 10000. */
static inline struct kvcap_model_geometry test_tiny_geometry(enum kvcap_rope_pairing pairing)
{
    struct kvcap_model_geometry g = {.name = "tiny", .n_layers = 2, .n_q_heads = 4,
                                     .n_kv_heads = 2, .head_dim = 64,
                                     .rope_type = KVCAP_ROPE_ROPE, .rope_pairing = pairing,
                                     .rope_theta = 10000.0};
    return g;
}

#endif
