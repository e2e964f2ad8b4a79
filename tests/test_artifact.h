/* test_artifact.h — a random KVCapsule artifact written through the real writer, for the
 * runtime tests (host and device caches) that need maps of known shapes. Include after
 * <cmocka.h>. */
#ifndef KVCAP_TEST_ARTIFACT_H
#define KVCAP_TEST_ARTIFACT_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "runtime/artifact.h"
#include "common/rng.h"

/* n normal values of standard deviation `scale`. */
static inline void fill(struct kvcap_rng *r, float *x, size_t n, double scale)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(scale * kvcap_rng_normal(r));
}

/* A bucket and its map sizes. */
struct test_bucket {
    int rows, cols, tile_rows, tile_cols; /* tile 0: dense */
    int rk, h, rv;
};

/* Writes to `path` an F32 artifact for geometry g with the nb buckets of tb: every (layer,
 * KV head, bucket) gets random maps from `seed`, mixed GELU and linear reconstructors. */
static inline void write_artifact(const char *path, const struct kvcap_model_geometry *g,
                                  const struct test_bucket *tb, int nb, uint64_t seed)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, seed);
    struct kvcap_bucket buckets[8];
    for (int b = 0; b < nb; b++) {
        buckets[b].rows = tb[b].rows;
        buckets[b].cols = tb[b].cols;
        buckets[b].structure = tb[b].tile_rows ? KVCAP_STRUCTURE_TILED : KVCAP_STRUCTURE_DENSE;
        buckets[b].tile_rows = tb[b].tile_rows;
        buckets[b].tile_cols = tb[b].tile_cols;
    }
    size_t n_units = (size_t)g->n_layers * g->n_kv_heads * nb;
    struct kvcap_unit_maps *units = calloc(n_units, sizeof *units);
    size_t i = 0;
    for (int l = 0; l < g->n_layers; l++)
        for (int h = 0; h < g->n_kv_heads; h++)
            for (int b = 0; b < nb; b++, i++) {
                int m = kvcap_bucket_points(&buckets[b]), rk = tb[b].rk, hh = tb[b].h, rv = tb[b].rv;
                struct kvcap_unit_maps *u = &units[i];
                u->m = m, u->rk = rk, u->h = hh, u->rv = rv;
                u->gelu = (l + h + b) % 2; /* mixed φ */
                u->u = malloc(sizeof(float) * ((size_t)rv * m + (size_t)rk * hh + hh +
                                                (size_t)hh * m + m));
                u->w1 = u->u + (size_t)rv * m;
                u->b1 = u->w1 + (size_t)rk * hh;
                u->w2 = u->b1 + hh;
                u->b2 = u->w2 + (size_t)hh * m;
                fill(&r, u->u, (size_t)rv * m, 1.0 / sqrt(m));
                fill(&r, u->w1, (size_t)rk * hh, 1.0 / sqrt(rk));
                fill(&r, u->b1, (size_t)hh, 0.1);
                fill(&r, u->w2, (size_t)hh * m, 1.0 / sqrt(hh));
                fill(&r, u->b2, (size_t)m, 0.1);
                u->mask = malloc(sizeof(int32_t) * (size_t)rk);
                for (int k = 0; k < rk; k++)
                    u->mask[k] = (int32_t)(k * m / rk);
            }
    double *ratios = malloc(sizeof(double) * (size_t)g->n_layers);
    for (int l = 0; l < g->n_layers; l++)
        ratios[l] = 0.5;
    struct kvcap_artifact_desc desc = {*g, nb, buckets, KVCAP_DTYPE_F32, 1, KVCAP_POLICY_FULL,
                                       ratios, ratios, NULL, NULL};
    if (kvcap_artifact_write(path, &desc, units) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    for (i = 0; i < n_units; i++)
        free(units[i].u), free(units[i].mask);
    free(units);
    free(ratios);
}

#endif
