/* freekv_stub.c — the device FreeKV API (cuda/freekv_cuda.h) in a build without CUDA: every
 * call answers KVCAP_ERR_UNSUPPORTED and touches nothing. */
#include "kernels/cuda/freekv_cuda.h"
#include "common/internal.h"

static enum kvcap_status no_cuda(const char *op)
{
    return kvcap_fail(KVCAP_ERR_UNSUPPORTED, "cuda %s: this build has no CUDA support", op);
}

enum kvcap_status kvcap_cuda_freekv_layout(const struct kvcap_freekv_params *p, int kv_heads,
                                           int G, int d, enum kvcap_dtype storage, int max_tokens,
                                           struct kvcap_cuda_freekv_layout *out)
{
    return no_cuda("freekv_layout");
}

enum kvcap_status kvcap_cuda_freekv_plan_fill(const int *pick, int n, int *slot_b,
                                              const int *slot_o, int slots, int max_page,
                                              struct kvcap_cuda_freekv_op *ops, int *n_ops,
                                              int *recalled)
{
    return no_cuda("freekv_plan_fill");
}

enum kvcap_status kvcap_cuda_freekv_create(const struct kvcap_freekv_params *p, int kv_heads,
                                           int G, int d, enum kvcap_dtype storage, int max_tokens,
                                           struct kvcap_cuda_freekv **out)
{
    if (out)
        *out = NULL;
    return no_cuda("freekv create");
}

void kvcap_cuda_freekv_free(struct kvcap_cuda_freekv *f)
{
    (void)f; /* no state can exist */
}

enum kvcap_status kvcap_cuda_freekv_append(struct kvcap_cuda_freekv *f, const void *k,
                                           const void *v, enum kvcap_dtype dtype, int n,
                                           void *stream)
{
    return no_cuda("freekv append");
}

int64_t kvcap_cuda_freekv_tokens(const struct kvcap_cuda_freekv *f)
{
    return 0;
}

enum kvcap_status kvcap_cuda_freekv_attend(struct kvcap_cuda_freekv *f, const float *q,
                                           float scale, struct kvcap_partial acc, void *stream)
{
    return no_cuda("freekv attend");
}

enum kvcap_status kvcap_cuda_freekv_step_done(struct kvcap_cuda_freekv *f, void *stream)
{
    return no_cuda("freekv step_done");
}

enum kvcap_status kvcap_cuda_freekv_stats(struct kvcap_cuda_freekv *f,
                                          struct kvcap_cuda_freekv_stats *out)
{
    return no_cuda("freekv stats");
}

void kvcap_cuda_freekv_bytes_held(const struct kvcap_cuda_freekv *f, uint64_t *host,
                                  uint64_t *device)
{
    if (host)
        *host = 0;
    if (device)
        *device = 0;
}

enum kvcap_status kvcap_cuda_freekv_digest(struct kvcap_cuda_freekv *f, int h, int page,
                                           float *kmax, float *kmin)
{
    return no_cuda("freekv digest");
}

int kvcap_cuda_freekv_selection(struct kvcap_cuda_freekv *f, int h, int *pages, int cap)
{
    no_cuda("freekv selection");
    return -1;
}
