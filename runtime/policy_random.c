/* policy_random.c — uniform random eviction on a span, the baseline every scoring policy must
 * beat at equal bytes: each KV head of each layer keeps its first `sinks` and last `window`
 * tokens and a uniform draw of the others, retention × the span's tokens in all, from a
 * generator seeded by (seed, layer, head). No cross-layer step. The draws and the eviction,
 * after the rows are stored as any policy stores them, are its compression work. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "runtime/cache_internal.h"

static enum kvcap_status random_prefill(struct kvcap_cache *c, int seq, int layer,
                                        struct kvcap_segment *seg,
                                        const struct kvcap_tensor_view *k,
                                        const struct kvcap_tensor_view *v)
{
    (void)seq;
    const struct kvcap_random_config *cfg = &c->cfg.random;
    const int n = seg->n_tokens, H = c->g.n_kv_heads;
    int lo, hi;
    kvcap_protected_range(n, cfg->sinks, cfg->window, &lo, &hi);
    const int nc = hi - lo;
    int draw = (int)llround(cfg->retention * n) - (n - nc);
    draw = draw < 0 ? 0 : draw > nc ? nc : draw;
    KVCAP_TRY(kvcap_segment_fill(c, seg, k, v, NULL, n));
    if (draw == nc)
        return KVCAP_OK; /* everything kept */
    const double t0 = kvcap_seconds();
    unsigned char *mark = malloc((size_t)H * n);
    int *pool = malloc(sizeof(int) * (size_t)(nc > 0 ? nc : 1));
    struct kvcap_kept_rows kept = {0};
    enum kvcap_status st = KVCAP_OK;
    if (!mark || !pool)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "random: out of memory at layer %d", layer);
    for (int h = 0; st == KVCAP_OK && h < H; h++) {
        unsigned char *mh = mark + (size_t)h * n;
        memset(mh, 1, (size_t)lo);
        memset(mh + lo, 0, (size_t)nc);
        memset(mh + hi, 1, (size_t)(n - hi));
        struct kvcap_rng r;
        kvcap_rng_seed(&r, (uint64_t)cfg->seed * 0x9E3779B97F4A7C15ull ^
                               ((uint64_t)layer << 32 | (uint64_t)h));
        for (int j = 0; j < nc; j++)
            pool[j] = lo + j;
        for (int i = 0; i < draw; i++) { /* the first `draw` of a Fisher-Yates shuffle */
            int t = i + (int)kvcap_rng_below(&r, (uint64_t)(nc - i));
            int x = pool[t];
            pool[t] = pool[i];
            pool[i] = x;
            mh[x] = 1;
        }
    }
    if (st == KVCAP_OK)
        st = kvcap_segment_keep_marked(c, seg, mark, 0, &kept);
    if (st == KVCAP_OK)
        kvcap_segment_commit(seg, &kept);
    kvcap_kept_rows_free(&kept);
    free(mark), free(pool);
    c->compress_seconds += kvcap_seconds() - t0;
    return st;
}

const struct kvcap_policy_impl kvcap_policy_random_impl = {KVCAP_POLICY_RANDOM, random_prefill,
                                                           NULL};
