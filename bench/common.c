/* common.c — see common.h. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/internal.h"
#include "common/rng.h"
#include "bench/common.h"
#include "runtime/artifact.h"

static enum kvcap_status random_artifact(const char *path, const struct kvcap_model_geometry *g,
                                         const struct kvcap_bucket *b, double ratio)
{
    int m = kvcap_bucket_points(b), rk = (int)(ratio * m + 0.5);
    rk = rk < 1 ? 1 : rk > m ? m : rk;
    int h = rk, rv = rk;
    size_t count = (size_t)rv * m + (size_t)rk * h + (size_t)h + (size_t)h * m + (size_t)m;
    size_t n_units = (size_t)g->n_layers * g->n_kv_heads;
    float *buf = malloc(sizeof(float) * count);
    int32_t *mask = malloc(sizeof(int32_t) * (size_t)rk);
    double *rs = malloc(sizeof(double) * (size_t)g->n_layers);
    struct kvcap_unit_maps *units = malloc(sizeof *units * n_units);
    enum kvcap_status st = buf && mask && rs && units
                               ? KVCAP_OK
                               : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "bench: out of memory");
    if (st == KVCAP_OK) {
        struct kvcap_rng r;
        kvcap_rng_seed(&r, 1);
        for (size_t i = 0; i < count; i++)
            buf[i] = (float)(0.1 * kvcap_rng_normal(&r));
        for (int i = 0; i < rk; i++)
            mask[i] = i * m / rk;
        for (int l = 0; l < g->n_layers; l++)
            rs[l] = (double)rk / m;
        float *u = buf, *w1 = u + (size_t)rv * m, *b1 = w1 + (size_t)rk * h, *w2 = b1 + h,
              *b2 = w2 + (size_t)h * m;
        for (size_t i = 0; i < n_units; i++)
            units[i] = (struct kvcap_unit_maps){m, rk, h, rv, 0, mask, w1, b1, w2, b2, u};
        struct kvcap_artifact_desc desc = {*g, 1, b, KVCAP_DTYPE_F32, 0, KVCAP_POLICY_FLASHCACHE,
                                           rs, rs, NULL, NULL};
        st = kvcap_artifact_write(path, &desc, units);
    }
    free(buf), free(mask), free(rs), free(units);
    return st;
}

enum kvcap_status kvcap_bench_random_artifact(const struct kvcap_model_geometry *g,
                                              const struct kvcap_bucket *b, double ratio,
                                              struct kvcap_artifact **out)
{
    char path[4200];
    const char *tmp = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/kvcap-bench-%d.kvcap", tmp ? tmp : "/tmp", (int)getpid());
    enum kvcap_status st = random_artifact(path, g, b, ratio);
    if (st == KVCAP_OK)
        st = kvcap_artifact_open(path, out);
    remove(path);
    return st;
}
