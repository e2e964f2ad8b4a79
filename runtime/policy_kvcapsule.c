/* policy_kvcapsule.c — the KVCapsule policy: a span with a bucket becomes its compressed
 * state, H, Ṽ and μ per KV head (the math is kernels/capsule_prefill.h), computed by the
 * cache's store where the K/V live; the span's K and V are never stored. That computation is
 * the policy's compression work (kvcap_cache_stats' compress_seconds). */
#include "runtime/cache_internal.h"

static enum kvcap_status capsule_prefill(struct kvcap_cache *c, int seq, int layer,
                                         struct kvcap_segment *seg,
                                         const struct kvcap_tensor_view *k,
                                         const struct kvcap_tensor_view *v)
{
    (void)seq;
    const double t0 = kvcap_seconds();
    const enum kvcap_status st = c->store->capsule_prefill(c, layer, seg, k, v);
    c->compress_seconds += kvcap_seconds() - t0;
    return st;
}

const struct kvcap_policy_impl kvcap_policy_kvcapsule_impl = {KVCAP_POLICY_KVCAPSULE,
                                                              capsule_prefill, NULL};
