/* capsule_exact.c — kvcap's exact tiles (runtime config kvcapsule.exact_tiles): one KV head of a
 * KVCapsule span keeps the tiles KVCapsule reconstructs worst as plain rows and the others
 * compressed. The host store computes it all here (kvcap_capsule_exact_head); the device store
 * computes the state and the per-point errors on the device and picks the tiles here
 * (kvcap_capsule_exact_pick), by the same rule. */
#include <string.h>

#include "kernels/capsule_prefill.h"
#include "runtime/cache_internal.h"

int kvcap_capsule_exact_count(const struct kvcap_cache *c, int tiles)
{
    int want = c->cfg.kvcapsule.exact_tiles;
    return want < tiles ? want : tiles - 1; /* at least one tile stays compressed */
}

/* The `exact` tiles of largest err (ties: the lower tile), marked in pick [tiles]. */
static void pick_worst_tiles(const float *err, int tiles, int exact, unsigned char *pick)
{
    memset(pick, 0, (size_t)tiles);
    for (int e = 0; e < exact; e++) {
        int best = -1;
        for (int t = 0; t < tiles; t++)
            if (!pick[t] && (best < 0 || err[t] > err[best]))
                best = t;
        pick[best] = 1;
    }
}

void kvcap_capsule_exact_pick(const double *points, int tiles, int m, int exact, float *err,
                              unsigned char *pick)
{
    kvcap_capsule_tile_error_points(points, tiles, m, err);
    pick_worst_tiles(err, tiles, exact, pick);
}

/* The working memory of one head, in this order: K' [n][d] (the keys, then made offset-free),
 * the f32 state of every tile (H [all][h][d], Ṽ [all][rv][d], μ [d]), the tiles' errors [all],
 * the kernels' scratch (the prefill's, then the tile errors': the larger of the two) and a
 * pick byte per tile. The one layout both the size and the head use. */
struct exact_work {
    float *kr, *hf, *vtf, *muf, *err, *scratch;
    unsigned char *pick;
};

static size_t kernel_scratch(const struct kvcap_unit_maps *u, int d)
{
    struct kvcap_capsule_prefill_maps pm = {u->m, u->rk, u->h, u->rv, u->gelu, NULL, NULL, NULL,
                                            NULL};
    struct kvcap_capsule_maps dm = {u->m, u->h, u->rv, NULL, NULL, NULL};
    size_t a = kvcap_capsule_prefill_scratch_floats(&pm, d);
    size_t b = kvcap_capsule_tile_error_scratch_floats(&dm, d);
    return a > b ? a : b;
}

size_t kvcap_capsule_exact_work_floats(const struct kvcap_unit_maps *u, int n, int d)
{
    size_t all = (size_t)(n / u->m);
    return (size_t)n * d + all * (size_t)(u->h + u->rv) * d + (size_t)d + all +
           kernel_scratch(u, d) + (all + sizeof(float) - 1) / sizeof(float);
}

static struct exact_work work_at(float *w, const struct kvcap_unit_maps *u, int n, int d)
{
    size_t all = (size_t)(n / u->m);
    struct exact_work x;
    x.kr = w;
    x.hf = x.kr + (size_t)n * d;
    x.vtf = x.hf + all * u->h * d;
    x.muf = x.vtf + all * u->rv * d;
    x.err = x.muf + d;
    x.scratch = x.err + all;
    x.pick = (unsigned char *)(x.scratch + kernel_scratch(u, d));
    return x;
}

enum kvcap_status kvcap_capsule_exact_head(const struct kvcap_model_geometry *g,
                                           const struct kvcap_bucket *bk,
                                           const struct kvcap_unit_maps *u, int n, int d,
                                           int64_t p0, int exact, const float *k, const float *v,
                                           enum kvcap_dtype storage, void *hs, void *vt,
                                           void *mu, void *k_rows, void *v_rows, float *work)
{
    const int m = u->m, all = n / m;
    const size_t es = kvcap_dtype_size(storage);
    struct kvcap_capsule_prefill_maps pm = {u->m, u->rk, u->h, u->rv, u->gelu,
                                            u->mask, u->w1, u->b1, u->u};
    struct kvcap_capsule_maps dm = {u->m, u->h, u->rv, u->w2, u->b2, u->u};
    const struct exact_work w = work_at(work, u, n, d);
    memcpy(w.kr, k, sizeof(float) * (size_t)n * d);
    KVCAP_TRY(kvcap_capsule_prefill(g, bk, &pm, n, d, p0, w.kr, v, KVCAP_DTYPE_F32, w.hf, w.vtf,
                                    w.muf, w.scratch));
    KVCAP_TRY(kvcap_capsule_tile_error(bk, &dm, n, d, w.kr, v, w.hf, w.vtf, w.muf, w.err,
                                       w.scratch));
    pick_worst_tiles(w.err, all, exact, w.pick);
    for (int t = 0, kept = 0, row = 0; t < all; t++) {
        if (!w.pick[t]) {
            kvcap_convert_from_f32(storage, w.hf + (size_t)t * u->h * d, (size_t)u->h * d,
                                   (char *)hs + (size_t)kept * u->h * d * es);
            kvcap_convert_from_f32(storage, w.vtf + (size_t)t * u->rv * d, (size_t)u->rv * d,
                                   (char *)vt + (size_t)kept * u->rv * d * es);
            kept++;
            continue;
        }
        for (int p = 0; p < m; p++, row++) { /* the key as the engine gave it, not K' */
            size_t j = kvcap_bucket_token(bk, t, p);
            kvcap_convert_from_f32(storage, k + j * d, (size_t)d,
                                   (char *)k_rows + (size_t)row * d * es);
            kvcap_convert_from_f32(storage, v + j * d, (size_t)d,
                                   (char *)v_rows + (size_t)row * d * es);
        }
    }
    kvcap_convert_from_f32(storage, w.muf, (size_t)d, mu);
    return KVCAP_OK;
}
