/* policy_freekv.c — FreeKV (DESIGN §7) on a span: its tokens join the sequence-layer's FreeKV
 * store (runtime/freekv.c), which holds every token routed to FreeKV (spans and, when so
 * configured, generated tokens) and serves decode attention by paged retrieval. Nothing is
 * evicted: the saving is in bytes read per step (and, on a GPU, device memory). Paging the span
 * into that store (with its page digests) is the policy's compression work. */
#include <stdlib.h>

#include "runtime/cache_internal.h"

enum { CHUNK = 256 }; /* tokens converted to f32 per append */

static enum kvcap_status freekv_prefill(struct kvcap_cache *c, int seq, int layer,
                                        struct kvcap_segment *seg,
                                        const struct kvcap_tensor_view *k,
                                        const struct kvcap_tensor_view *v)
{
    const double start = kvcap_seconds();
    struct kvcap_seq_layer *sl = kvcap_cache_seq_layer(c, seq, layer);
    struct kvcap_freekv *f;
    KVCAP_TRY(kvcap_cache_freekv(c, sl, &f));
    int H = c->g.n_kv_heads, d = c->g.head_dim, n = seg->n_tokens;
    float *buf = malloc(sizeof(float) * 2 * (size_t)H * CHUNK * d);
    KVCAP_RETURN_IF(!buf, KVCAP_ERR_OUT_OF_MEMORY, "freekv: out of memory");
    float *vb = buf + (size_t)H * CHUNK * d;
    enum kvcap_status st = KVCAP_OK;
    for (int t0 = 0; st == KVCAP_OK && t0 < n; t0 += CHUNK) {
        int m = n - t0 < CHUNK ? n - t0 : CHUNK;
        for (int h = 0; h < H; h++) {
            kvcap_view_read(k, h, t0, m, d, buf + (size_t)h * m * d);
            kvcap_view_read(v, h, t0, m, d, vb + (size_t)h * m * d);
        }
        st = kvcap_freekv_append(f, buf, vb, m);
    }
    free(buf);
    if (st == KVCAP_OK)
        sl->freekv_tokens_by_kind[seg->kind] += n;
    c->compress_seconds += kvcap_seconds() - start;
    return st;
}

const struct kvcap_policy_impl kvcap_policy_freekv_impl = {KVCAP_POLICY_FREEKV, freekv_prefill,
                                                           NULL};
