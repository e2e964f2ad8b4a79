/* gpu_stub.c — calibrate/gpu.h in a build without CUDA: every device path is unsupported, so
 * kvcap_calibrate runs on the CPU (device auto) or fails by name (device cuda). */
#include "gpu.h"
#include "internal.h"

#define UNSUPPORTED(what)                                                                    \
    kvcap_fail(KVCAP_ERR_UNSUPPORTED, "%s: this build of kvcap has no CUDA support", (what))

int kvcap_gpu_built(void)
{
    return 0;
}

enum kvcap_status kvcap_gpu_device_name(char *buf, size_t cap)
{
    if (cap)
        buf[0] = '\0';
    return UNSUPPORTED("cuda device name");
}

enum kvcap_status kvcap_gpu_gram_create(const struct kvcap_gpu_gram_params *p,
                                        struct kvcap_gpu_gram **out)
{
    (void)p;
    if (out)
        *out = NULL;
    return UNSUPPORTED("cuda Grams");
}

void kvcap_gpu_gram_buffers(struct kvcap_gpu_gram *g, size_t unit, double **kbuf, double **vbuf)
{
    (void)g, (void)unit;
    *kbuf = *vbuf = NULL;
}

enum kvcap_status kvcap_gpu_gram_flush(struct kvcap_gpu_gram *g, int lane, size_t unit,
                                       size_t cols)
{
    (void)g, (void)lane, (void)unit, (void)cols;
    return UNSUPPORTED("cuda Grams");
}

enum kvcap_status kvcap_gpu_gram_finish(struct kvcap_gpu_gram *g)
{
    (void)g;
    return UNSUPPORTED("cuda Grams");
}

void kvcap_gpu_gram_free(struct kvcap_gpu_gram *g)
{
    (void)g;
}

enum kvcap_status kvcap_gpu_eigen_create(int n_max, struct kvcap_gpu_eigen **out)
{
    (void)n_max;
    if (out)
        *out = NULL;
    return UNSUPPORTED("cuda eigen");
}

void kvcap_gpu_eigen_free(struct kvcap_gpu_eigen *e)
{
    (void)e;
}

enum kvcap_status kvcap_gpu_dsyevd_batch(struct kvcap_gpu_eigen *e, int count,
                                         const double *const *mats, const int *n,
                                         enum kvcap_status (*consume)(int i, const double *a,
                                                                      const double *w,
                                                                      void *user),
                                         void *user, int *failed)
{
    (void)e, (void)count, (void)mats, (void)n, (void)consume, (void)user;
    if (failed)
        *failed = -1;
    return UNSUPPORTED("cuda eigen");
}

enum kvcap_status kvcap_gpu_peak_measure(int m, struct kvcap_gpu_peak *out)
{
    (void)m, (void)out;
    return UNSUPPORTED("cuda peak");
}
