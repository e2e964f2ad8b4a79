/* calib_cuda_stub.c — calibrate/calib_cuda.h in a build without CUDA: every device path is
 * unsupported, so kvcap_calibrate runs on the CPU (device auto) or fails by name (device
 * cuda). */
#include "calibrate/calib_cuda.h"
#include "common/internal.h"

#define UNSUPPORTED(what)                                                                    \
    kvcap_fail(KVCAP_ERR_UNSUPPORTED, "%s: this build of kvcap has no CUDA support", (what))

int kvcap_calib_cuda_built(void)
{
    return 0;
}

enum kvcap_status kvcap_calib_cuda_device_name(char *buf, size_t cap)
{
    if (cap)
        buf[0] = '\0';
    return UNSUPPORTED("cuda device name");
}

enum kvcap_status kvcap_calib_cuda_gram_create(const struct kvcap_calib_cuda_gram_params *p,
                                               struct kvcap_calib_cuda_gram **out)
{
    (void)p;
    if (out)
        *out = NULL;
    return UNSUPPORTED("cuda Grams");
}

void kvcap_calib_cuda_gram_buffers(struct kvcap_calib_cuda_gram *g, size_t unit, double **kbuf,
                                   double **vbuf)
{
    (void)g, (void)unit;
    *kbuf = *vbuf = NULL;
}

enum kvcap_status kvcap_calib_cuda_gram_flush(struct kvcap_calib_cuda_gram *g, int lane,
                                              size_t unit, size_t cols)
{
    (void)g, (void)lane, (void)unit, (void)cols;
    return UNSUPPORTED("cuda Grams");
}

enum kvcap_status kvcap_calib_cuda_gram_finish(struct kvcap_calib_cuda_gram *g)
{
    (void)g;
    return UNSUPPORTED("cuda Grams");
}

void kvcap_calib_cuda_gram_free(struct kvcap_calib_cuda_gram *g)
{
    (void)g;
}

enum kvcap_status kvcap_calib_cuda_eigen_create(int n_max, struct kvcap_calib_cuda_eigen **out)
{
    (void)n_max;
    if (out)
        *out = NULL;
    return UNSUPPORTED("cuda eigen");
}

void kvcap_calib_cuda_eigen_free(struct kvcap_calib_cuda_eigen *e)
{
    (void)e;
}

enum kvcap_status kvcap_calib_cuda_dsyevd_batch(
    struct kvcap_calib_cuda_eigen *e, int count, const double *const *mats, const int *n,
    enum kvcap_status (*consume)(int i, const double *a, const double *w, void *user), void *user,
    int *failed)
{
    (void)e, (void)count, (void)mats, (void)n, (void)consume, (void)user;
    if (failed)
        *failed = -1;
    return UNSUPPORTED("cuda eigen");
}

enum kvcap_status kvcap_calib_cuda_peak_measure(int m, struct kvcap_calib_cuda_peak *out)
{
    (void)m, (void)out;
    return UNSUPPORTED("cuda peak");
}

enum kvcap_status kvcap_calib_cuda_train_create(const struct kvcap_calib_cuda_train_params *p,
                                                struct kvcap_calib_cuda_train **out)
{
    (void)p;
    if (out)
        *out = NULL;
    return UNSUPPORTED("cuda key training");
}

void kvcap_calib_cuda_train_free(struct kvcap_calib_cuda_train *g)
{
    (void)g;
}

enum kvcap_status kvcap_calib_cuda_train_load(struct kvcap_calib_cuda_train *g,
                                              const struct kvcap_train_net *net)
{
    (void)g, (void)net;
    return UNSUPPORTED("cuda key training");
}

enum kvcap_status kvcap_calib_cuda_train_loss_grad(struct kvcap_calib_cuda_train *g,
                                                   const struct kvcap_train_net *net,
                                                   const size_t *pick, double *loss, float *grad)
{
    (void)g, (void)net, (void)pick, (void)grad;
    if (loss)
        *loss = 0.0;
    return UNSUPPORTED("cuda key training");
}

enum kvcap_status kvcap_calib_cuda_train_step(struct kvcap_calib_cuda_train *g,
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

enum kvcap_status kvcap_calib_cuda_train_fetch(struct kvcap_calib_cuda_train *g,
                                               struct kvcap_train_net *net)
{
    (void)g, (void)net;
    return UNSUPPORTED("cuda key training");
}

enum kvcap_status kvcap_calib_cuda_train_score(struct kvcap_calib_cuda_train *g,
                                               const struct kvcap_train_net *net, double *mse)
{
    (void)g, (void)net;
    if (mse)
        *mse = 0.0;
    return UNSUPPORTED("cuda key training");
}

enum kvcap_status kvcap_calib_cuda_train_maps_mse(struct kvcap_calib_cuda_train *g,
                                                  const struct kvcap_key_maps *k, int on_val,
                                                  double *mse)
{
    (void)g, (void)k, (void)on_val;
    if (mse)
        *mse = 0.0;
    return UNSUPPORTED("cuda key training");
}
