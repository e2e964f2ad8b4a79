/* cache_cuda_stub.c — the device primitives of a cache (cache_cuda.h) in a build without CUDA:
 * kvcap_cache_create refuses device caches there, so nothing reaches these; each answers
 * KVCAP_ERR_UNSUPPORTED and touches nothing. */
#include "runtime/cache_cuda.h"
#include "common/internal.h"

static enum kvcap_status no_cuda(const char *op)
{
    return kvcap_fail(KVCAP_ERR_UNSUPPORTED, "cuda %s: this build has no CUDA support", op);
}

enum kvcap_status kvcap_dev_malloc(const struct kvcap_dev_ctx *x, size_t bytes, void **out)
{
    *out = NULL;
    return no_cuda("malloc");
}

void kvcap_dev_free(int device, void *p)
{
    (void)device, (void)p; /* nothing can have been allocated */
}

enum kvcap_status kvcap_dev_host_malloc(const struct kvcap_dev_ctx *x, size_t bytes, void **out)
{
    *out = NULL;
    return no_cuda("host malloc");
}

void kvcap_dev_host_free(void *p)
{
    (void)p;
}

enum kvcap_status kvcap_dev_upload_sync(const struct kvcap_dev_ctx *x, void *dst, const void *src,
                                        size_t bytes)
{
    return no_cuda("upload");
}

enum kvcap_status kvcap_dev_upload(const struct kvcap_dev_ctx *x, void *dst, const void *src,
                                   size_t bytes)
{
    return no_cuda("upload");
}

enum kvcap_status kvcap_dev_download_sync(const struct kvcap_dev_ctx *x, void *dst,
                                          const void *src, size_t bytes)
{
    return no_cuda("download");
}

enum kvcap_status kvcap_dev_copy_2d(const struct kvcap_dev_ctx *x, void *dst, size_t dpitch,
                                    const void *src, size_t spitch, size_t width, size_t height)
{
    return no_cuda("copy");
}

enum kvcap_status kvcap_dev_sync(const struct kvcap_dev_ctx *x)
{
    return no_cuda("stream synchronize");
}

int kvcap_dev_capturing(const struct kvcap_dev_ctx *x)
{
    return 0;
}

enum kvcap_status kvcap_dev_fill_rows(const struct kvcap_dev_ctx *x, const struct kvcap_dev_view *src,
                                      const int *tokens, int n, int heads, int d, void *dst,
                                      int cap, enum kvcap_dtype storage)
{
    return no_cuda("fill rows");
}

enum kvcap_status kvcap_dev_capsule_prefill(const struct kvcap_dev_ctx *x,
                                            const struct kvcap_dev_view *k,
                                            const struct kvcap_dev_view *v, int head, int n, int d,
                                            const struct kvcap_dev_rope *rope,
                                            const float *rope_row, const struct kvcap_dev_grid *grid,
                                            const struct kvcap_dev_unit *unit, int tiles,
                                            enum kvcap_dtype storage, void *hs, void *vt, void *mu,
                                            float *mu_f32)
{
    return no_cuda("kvcapsule prefill");
}

enum kvcap_status kvcap_dev_append_token(const struct kvcap_dev_ctx *x,
                                         const struct kvcap_dev_append *a, int heads, int d,
                                         enum kvcap_dtype storage)
{
    return no_cuda("append");
}

enum kvcap_status kvcap_dev_prepare_queries(const struct kvcap_dev_ctx *x, const float *q,
                                            int n_seqs, int q_heads, int d, float *q_copy,
                                            int n_rot, const int *rot_seq, const float *rot_rows,
                                            const struct kvcap_dev_rope *rope, float *qrot)
{
    return no_cuda("prepare queries");
}

enum kvcap_status kvcap_dev_merge_finish(const struct kvcap_dev_ctx *x, const float *mx,
                                         const float *sum, const float *o, int n_units,
                                         const int *unit_begin, int n_seqs, int kv_heads, int G,
                                         int d, float *out, float *lse)
{
    return no_cuda("merge");
}
