/* policy_streaming.c — StreamingLLM on a span: its first `sinks` tokens and its last `window`
 * tokens are kept, the rest is dropped (and freed). For generated tokens the cache keeps the
 * first `sinks` and a ring of the last `window` (segment.c, kvcap_segment_gen_row). */
#include <stdlib.h>

#include "runtime/cache_internal.h"

static enum kvcap_status streaming_prefill(struct kvcap_cache *c, int seq, int layer,
                                           struct kvcap_segment *seg,
                                           const struct kvcap_tensor_view *k,
                                           const struct kvcap_tensor_view *v)
{
    int n = seg->n_tokens, sinks = c->cfg.streaming.sinks, window = c->cfg.streaming.window;
    if ((int64_t)sinks + window >= n) /* in 64 bits: each may be up to 2^30 */
        return kvcap_segment_fill(c, seg, k, v, NULL, n);
    int *keep = malloc(sizeof(int) * ((size_t)sinks + (size_t)window));
    KVCAP_RETURN_IF(!keep, KVCAP_ERR_OUT_OF_MEMORY, "streaming: out of memory");
    int kept = 0;
    for (int j = 0; j < sinks; j++)
        keep[kept++] = j;
    for (int j = n - window; j < n; j++)
        keep[kept++] = j;
    enum kvcap_status st = kvcap_segment_fill(c, seg, k, v, keep, kept);
    free(keep);
    return st;
}

const struct kvcap_policy_impl kvcap_policy_streaming_impl = {KVCAP_POLICY_STREAMING,
                                                              streaming_prefill, NULL};
