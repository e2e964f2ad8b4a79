/* policy_kvcapsule.c — the KVCapsule policy: a span with a bucket becomes its compressed
 * state, H, Ṽ and μ per KV head (the math is kernels/capsule_prefill.h); the span's K and V
 * are never stored. */
#include <stdlib.h>

#include "kernels/capsule_prefill.h"
#include "runtime/cache_internal.h"

static enum kvcap_status capsule_prefill(struct kvcap_cache *c, int seq, int layer,
                                         struct kvcap_segment *seg,
                                         const struct kvcap_tensor_view *k,
                                         const struct kvcap_tensor_view *v)
{
    if (c->dev) /* the same state computed on the device from device K/V (cache_device.c) */
        return kvcap_device_capsule_prefill(c, layer, seg, k, v);
    const struct kvcap_model_geometry *g = &c->g;
    const struct kvcap_artifact *a = c->artifact;
    const struct kvcap_bucket *bk = &a->buckets[seg->bucket];
    /* Every KV head of a layer and bucket has head 0's h and R_v (kvcap_artifact_open). */
    const struct kvcap_unit_maps *u0 = kvcap_artifact_unit(a, layer, 0, seg->bucket);
    int n = seg->n_tokens, d = g->head_dim, H = g->n_kv_heads, m = u0->m;
    seg->tiles = n / m;
    seg->h = u0->h;
    seg->rv = u0->rv;
    size_t es = kvcap_dtype_size(c->storage);
    size_t per_h = (size_t)seg->tiles * seg->h * d, per_v = (size_t)seg->tiles * seg->rv * d;
    seg->hs = malloc((size_t)H * per_h * es);
    seg->vt = malloc((size_t)H * per_v * es);
    seg->mu = malloc((size_t)H * d * es);
    struct kvcap_capsule_prefill_maps maps = {m, u0->rk, u0->h, u0->rv, u0->gelu, NULL,
                                              NULL, NULL, NULL};
    size_t scratch = kvcap_capsule_prefill_scratch_floats(&maps, d);
    float *kf = malloc(sizeof(float) * ((size_t)n * d * 2 + scratch));
    enum kvcap_status st = KVCAP_OK;
    if (!seg->hs || !seg->vt || !seg->mu || !kf)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvcapsule: out of memory for a %d-token span", n);
    float *vf = kf ? kf + (size_t)n * d : NULL;
    for (int h = 0; st == KVCAP_OK && h < H; h++) {
        const struct kvcap_unit_maps *u = kvcap_artifact_unit(a, layer, h, seg->bucket);
        maps = (struct kvcap_capsule_prefill_maps){u->m, u->rk, u->h, u->rv, u->gelu,
                                                   u->mask, u->w1, u->b1, u->u};
        kvcap_view_read(k, h, 0, n, d, kf);
        kvcap_view_read(v, h, 0, n, d, vf);
        st = kvcap_capsule_prefill(g, bk, &maps, n, d, seg->p0, kf, vf, c->storage,
                                   (char *)seg->hs + (size_t)h * per_h * es,
                                   (char *)seg->vt + (size_t)h * per_v * es,
                                   (char *)seg->mu + (size_t)h * d * es, vf + (size_t)n * d);
    }
    free(kf);
    return st;
}

const struct kvcap_policy_impl kvcap_policy_kvcapsule_impl = {KVCAP_POLICY_KVCAPSULE,
                                                              capsule_prefill, NULL};
