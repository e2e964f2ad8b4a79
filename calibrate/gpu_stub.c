/* gpu_stub.c — calibrate/gpu.h in a build without CUDA: every device path is unsupported, so
 * kvcap_calibrate runs on the CPU (device auto) or fails by name (device cuda). */
#include "calibrate/gpu.h"
#include "common/internal.h"

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

enum kvcap_status kvcap_gpu_train_create(const struct kvcap_gpu_train_params *p,
                                         struct kvcap_gpu_train **out)
{
    (void)p;
    if (out)
        *out = NULL;
    return UNSUPPORTED("cuda key training");
}

void kvcap_gpu_train_free(struct kvcap_gpu_train *g)
{
    (void)g;
}

enum kvcap_status kvcap_gpu_train_load(struct kvcap_gpu_train *g,
                                       const struct kvcap_train_net *net)
{
    (void)g, (void)net;
    return UNSUPPORTED("cuda key training");
}

enum kvcap_status kvcap_gpu_train_loss_grad(struct kvcap_gpu_train *g,
                                            const struct kvcap_train_net *net,
                                            const size_t *pick, double *loss, float *grad)
{
    (void)g, (void)net, (void)pick, (void)grad;
    if (loss)
        *loss = 0.0;
    return UNSUPPORTED("cuda key training");
}

enum kvcap_status kvcap_gpu_train_step(struct kvcap_gpu_train *g,
                                       const struct kvcap_train_net *net, const size_t *pick,
                                       double lr, double *loss, int *finite)
{
    (void)g, (void)net, (void)pick, (void)lr;
    if (loss)
        *loss = 0.0;
    if (finite)
        *finite = 0;
    return UNSUPPORTED("cuda key training");
}

enum kvcap_status kvcap_gpu_train_fetch(struct kvcap_gpu_train *g, struct kvcap_train_net *net)
{
    (void)g, (void)net;
    return UNSUPPORTED("cuda key training");
}

enum kvcap_status kvcap_gpu_train_score(struct kvcap_gpu_train *g,
                                        const struct kvcap_train_net *net, double *mse)
{
    (void)g, (void)net;
    if (mse)
        *mse = 0.0;
    return UNSUPPORTED("cuda key training");
}

enum kvcap_status kvcap_gpu_train_maps_mse(struct kvcap_gpu_train *g,
                                           const struct kvcap_key_maps *k, int on_val,
                                           double *mse)
{
    (void)g, (void)k, (void)on_val;
    if (mse)
        *mse = 0.0;
    return UNSUPPORTED("cuda key training");
}
