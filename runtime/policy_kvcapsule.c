/* policy_kvcapsule.c — KVCapsule at prefill (DESIGN §4): per KV head and tile, keys are made
 * offset-free (K' = R(-p0) K), the retained rows K'[M] go through the first reconstructor layer,
 * H = φ(W1ᵀ K'[M] + b1 1ᵀ), and the centred values through the basis, Ṽ = U (V − 1μᵀ). Only H,
 * Ṽ and μ are kept: the span's K and V are never stored. */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/activation.h"
#include "runtime/cache_internal.h"
#include "kernels/rope.h"

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
    int tiles = n / m;
    seg->tiles = tiles;
    seg->h = u0->h;
    seg->rv = u0->rv;
    size_t es = kvcap_dtype_size(c->storage);
    size_t per_h = (size_t)tiles * seg->h * d, per_v = (size_t)tiles * seg->rv * d;
    seg->hs = malloc((size_t)H * per_h * es);
    seg->vt = malloc((size_t)H * per_v * es);
    seg->mu = malloc((size_t)H * d * es);
    float *kf = malloc(sizeof(float) * (size_t)n * d * 2);
    float *tile = malloc(sizeof(float) * (size_t)m * d);
    float *out = malloc(sizeof(float) * (size_t)(seg->h > seg->rv ? seg->h : seg->rv) * d);
    float *mu = malloc(sizeof(float) * (size_t)d);
    enum kvcap_status st = KVCAP_OK;
    if (!seg->hs || !seg->vt || !seg->mu || !kf || !tile || !out || !mu)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvcapsule: out of memory for a %d-token span", n);
    float *vf = kf ? kf + (size_t)n * d : NULL;
    for (int h = 0; st == KVCAP_OK && h < H; h++) {
        const struct kvcap_unit_maps *u = kvcap_artifact_unit(a, layer, h, seg->bucket);
        kvcap_view_read(k, h, 0, n, d, kf);
        kvcap_view_read(v, h, 0, n, d, vf);
        kvcap_rope_rotate(g, kf, (size_t)n, (size_t)d, -(double)seg->p0);
        for (int ch = 0; ch < d; ch++) {
            double sum = 0;
            for (int j = 0; j < n; j++)
                sum += vf[(size_t)j * d + ch];
            mu[ch] = (float)(sum / n);
        }
        for (int t = 0; t < tiles; t++) {
            /* H_t = φ(W1ᵀ K'[M] + b1 1ᵀ): [h][d] */
            for (int r = 0; r < u->rk; r++)
                memcpy(tile + (size_t)r * d,
                       kf + kvcap_bucket_token(bk, t, u->mask[r]) * (size_t)d,
                       sizeof(float) * (size_t)d);
            for (int i = 0; i < u->h; i++)
                for (int ch = 0; ch < d; ch++)
                    out[(size_t)i * d + ch] = u->b1[i];
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, u->h, d, u->rk, 1.0f, u->w1,
                        u->h, tile, d, 1.0f, out, d);
            if (u->gelu)
                for (size_t i = 0; i < (size_t)u->h * d; i++)
                    out[i] = kvcap_gelu(out[i]);
            kvcap_convert_from_f32(c->storage, out, (size_t)u->h * d,
                                   (char *)seg->hs + ((size_t)h * per_h + (size_t)t * u->h * d) * es);
            /* Ṽ_t = U (V_t − 1μᵀ): [rv][d] */
            for (int p = 0; p < m; p++) {
                const float *row = vf + kvcap_bucket_token(bk, t, p) * (size_t)d;
                for (int ch = 0; ch < d; ch++)
                    tile[(size_t)p * d + ch] = row[ch] - mu[ch];
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, u->rv, d, m, 1.0f, u->u, m,
                        tile, d, 0.0f, out, d);
            kvcap_convert_from_f32(c->storage, out, (size_t)u->rv * d,
                                   (char *)seg->vt + ((size_t)h * per_v + (size_t)t * u->rv * d) * es);
        }
        kvcap_convert_from_f32(c->storage, mu, (size_t)d, (char *)seg->mu + (size_t)h * d * es);
    }
    free(kf), free(tile), free(out), free(mu);
    return st;
}

const struct kvcap_policy_impl kvcap_policy_kvcapsule_impl = {KVCAP_POLICY_KVCAPSULE,
                                                              capsule_prefill, NULL};
