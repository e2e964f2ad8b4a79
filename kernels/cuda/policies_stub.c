/* policies_stub.c — the device FlashCache / VL-Cache entry points (cuda/policies_cuda.h) of a
 * build without CUDA: every call answers KVCAP_ERR_UNSUPPORTED and writes nothing. */
#include "kernels/cuda/flashcache_cuda.h"
#include "kernels/cuda/select_cuda.h"
#include "kernels/cuda/vlcache_cuda.h"
#include "common/internal.h"

static enum kvcap_status no_cuda(const char *fn)
{
    return kvcap_fail(KVCAP_ERR_UNSUPPORTED, "%s: this build has no CUDA support", fn);
}

enum kvcap_status kvcap_cuda_dct_create(int n, int d, int batch, struct kvcap_cuda_dct **out)
{
    if (out)
        *out = NULL;
    return no_cuda("kvcap_cuda_dct_create");
}

void kvcap_cuda_dct_free(struct kvcap_cuda_dct *plan)
{
    (void)plan; /* no plan can exist */
}

size_t kvcap_cuda_flashcache_scratch_bytes(const struct kvcap_cuda_dct *plan)
{
    return 0;
}

enum kvcap_status kvcap_cuda_flashcache_deviation(struct kvcap_cuda_dct *plan,
                                                  const struct kvcap_cuda_kv *kv, int omega,
                                                  float *dev, struct kvcap_energy *energy,
                                                  void *scratch, size_t scratch_bytes,
                                                  void *stream)
{
    return no_cuda("kvcap_cuda_flashcache_deviation");
}

enum kvcap_status kvcap_cuda_topk(const float *score, size_t ld_score, int n, int batch, int keep,
                                  const int *keep_per_row, int *idx, size_t ld_idx, void *stream)
{
    return no_cuda("kvcap_cuda_topk");
}

size_t kvcap_cuda_vlcache_scratch_bytes(const struct kvcap_cuda_vl *vl)
{
    return 0;
}

enum kvcap_status kvcap_cuda_vlcache_scores(const struct kvcap_cuda_vl *vl, float scale, float p,
                                            float *score, int64_t *below, double *gamma,
                                            void *scratch, size_t scratch_bytes, void *stream)
{
    return no_cuda("kvcap_cuda_vlcache_scores");
}
