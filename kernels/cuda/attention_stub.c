/* attention_stub.c — the device attention API (attention_cuda.h) in a build without CUDA:
 * every call answers KVCAP_ERR_UNSUPPORTED and touches nothing. */
#include "kernels/cuda/attention_cuda.h"
#include "common/internal.h"

static enum kvcap_status no_cuda(const char *op)
{
    return kvcap_fail(KVCAP_ERR_UNSUPPORTED, "cuda %s: this build has no CUDA support", op);
}

enum kvcap_status kvcap_cuda_attend_rows_scratch_bytes(int batch, int max_n, int nq, int d,
                                                       size_t *bytes)
{
    return no_cuda("attend_rows_scratch_bytes");
}

enum kvcap_status kvcap_cuda_attend_rows(const struct kvcap_cuda_rows_problem *problems,
                                         int batch, int max_n, enum kvcap_dtype dtype, int nq,
                                         int d, float scale, void *scratch, size_t scratch_bytes,
                                         void *stream)
{
    return no_cuda("attend_rows");
}

enum kvcap_status kvcap_cuda_capsule_scratch_bytes(const struct kvcap_capsule_maps *maps,
                                                   int n_spans, int max_tiles, int nq, int d,
                                                   size_t *bytes)
{
    return no_cuda("capsule_scratch_bytes");
}

enum kvcap_status kvcap_cuda_capsule_attend(const struct kvcap_capsule_maps *maps,
                                            const struct kvcap_cuda_capsule_span *spans,
                                            int n_spans, int max_tiles, enum kvcap_dtype dtype,
                                            int nq, int d, float scale, void *scratch,
                                            size_t scratch_bytes, void *stream)
{
    return no_cuda("capsule_attend");
}

enum kvcap_status kvcap_cuda_partial_reset(struct kvcap_partial p, int rows, int d, void *stream)
{
    return no_cuda("partial_reset");
}

enum kvcap_status kvcap_cuda_partial_finish(struct kvcap_partial p, int rows, int d, float *out,
                                            size_t out_stride, void *stream)
{
    return no_cuda("partial_finish");
}
