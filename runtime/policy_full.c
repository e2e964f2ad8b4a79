/* policy_full.c — `full`: the span's K/V rows stored as they are (in the storage dtype); the
 * reference every other policy is measured against. */
#include "runtime/cache_internal.h"

static enum kvcap_status full_prefill(struct kvcap_cache *c, int seq, int layer,
                                      struct kvcap_segment *seg, const struct kvcap_tensor_view *k,
                                      const struct kvcap_tensor_view *v)
{
    return kvcap_segment_fill(c, seg, k, v, NULL, seg->n_tokens);
}

const struct kvcap_policy_impl kvcap_policy_full_impl = {KVCAP_POLICY_FULL, full_prefill, NULL};
