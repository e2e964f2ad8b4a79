/* calib_cuda.h — calibration on a CUDA device: the Gram accumulator (cuBLAS DSYRK on
 * device-resident double Grams, fed from pinned host batches), batched symmetric
 * eigen-decompositions
 * (cuSOLVER) and the trained key maps' optimisation (cuBLAS SGEMM + small kernels).
 * calibrate/cuda/gram.cu and calibrate/cuda/train.cu implement it; calibrate/calib_cuda_stub.c, in
 * builds without CUDA, answers KVCAP_ERR_UNSUPPORTED. Only the products, the eigensolver and
 * the training steps move to the device: every preprocessing step, the closed-form start, the
 * hardening of the mask and the batch order stay the CPU code, shared by both paths. */
#ifndef KVCAP_CALIB_GPU_H
#define KVCAP_CALIB_GPU_H

#include <stddef.h>

#include "kvcap.h"

/* Where kvcap_calibrate accumulates Grams and runs the value PCA. */
enum kvcap_calib_device {
    KVCAP_CALIB_DEVICE_AUTO = 0, /* CUDA when kvcap_cuda_device_count() > 0, else the CPU */
    KVCAP_CALIB_DEVICE_CPU = 1,
    KVCAP_CALIB_DEVICE_CUDA = 2,
};

/* "auto" / "cpu" / "cuda": 1 on success, 0 for an unknown name; name: "?" if unknown. */
int kvcap_calib_device_parse(const char *s, enum kvcap_calib_device *out);
const char *kvcap_calib_device_name(enum kvcap_calib_device d);

/* Why CUDA cannot be used here ("this build has no CUDA support", "no CUDA device is
 * visible"), or NULL when it can. */
const char *kvcap_calib_cuda_unavailable(void);

/* AUTO becomes CUDA or CPU (never an error); CUDA without a usable device fails with
 * KVCAP_ERR_UNSUPPORTED "device cuda: <reason>". */
enum kvcap_status kvcap_calib_device_resolve(enum kvcap_calib_device want,
                                             enum kvcap_calib_device *out);

/* 1 if this build has the CUDA calibration paths (0 for the stub). */
int kvcap_calib_cuda_built(void);

/* The name of the current CUDA device ("NVIDIA H100 80GB HBM3") into buf. */
enum kvcap_status kvcap_calib_cuda_device_name(char *buf, size_t cap);

/* ---- Gram accumulation --------------------------------------------------------------------
 * Per unit i, two m_i x m_i double Grams live on the device for the whole pass (uploaded from
 * k_gram[i] / v_gram[i] at create, so accumulation continues from their contents). The unit's
 * pending columns are staged on the host in pinned memory owned by the accumulator: kbuf and
 * vbuf are m_i x cap_i row-major, exactly the layout of the CPU path's batch buffers, so the
 * same code fills them. kvcap_calib_cuda_gram_flush enqueues the product of the first `cols`
 * columns: on the lane's copy stream an async copy into one of two device slots, then on its
 * compute stream C += X Xᵀ (cublasDsyrk), so the copy of one batch overlaps the product of the
 * previous. Lanes are independent (one per host thread: its own streams and cuBLAS handle);
 * a unit may be flushed from different lanes over time (its products are ordered by an event
 * per unit), but never from two lanes at once.
 *
 * Device memory: all Grams stay resident. kvcap_calib_cuda_gram_create checks the total (Grams, two
 * slots per lane and a reserve for cuBLAS) against cudaMemGetInfo and fails with
 * KVCAP_ERR_OUT_OF_MEMORY naming the sizes when it does not fit; kvcap_calibrate then falls
 * back to the CPU under device AUTO and fails under device CUDA. Resident Grams keep the
 * traffic one-way (columns up, Grams down once); streaming Grams per batch would move m² per
 * batch instead of m·cols. */
struct kvcap_calib_cuda_gram;

struct kvcap_calib_cuda_gram_params {
    size_t n_units;
    const int *m;              /* [n_units] Gram sizes */
    const size_t *cap;         /* [n_units] batch capacity in columns */
    double *const *k_gram;     /* [n_units] host Grams (m x m row-major): initial contents */
    double *const *v_gram;
    int lanes;                 /* host threads that flush concurrently (>= 1) */
};

enum kvcap_status kvcap_calib_cuda_gram_create(const struct kvcap_calib_cuda_gram_params *p,
                                               struct kvcap_calib_cuda_gram **out);

/* Unit i's pinned batch buffers (owned by g, valid until kvcap_calib_cuda_gram_free). */
void kvcap_calib_cuda_gram_buffers(struct kvcap_calib_cuda_gram *g, size_t unit, double **kbuf,
                                   double **vbuf);

/* Enqueues the Gram update of unit `unit` with its first `cols` pending columns, from lane
 * `lane` (0 <= lane < lanes). Returns once the batch buffers may be refilled. */
enum kvcap_status kvcap_calib_cuda_gram_flush(struct kvcap_calib_cuda_gram *g, int lane,
                                              size_t unit, size_t cols);

/* Waits for every lane and copies the Grams back into k_gram[i] / v_gram[i] (the pointers
 * given at create). As on the CPU path only the upper triangle (row-major) was accumulated;
 * the caller symmetrises. */
enum kvcap_status kvcap_calib_cuda_gram_finish(struct kvcap_calib_cuda_gram *g);

void kvcap_calib_cuda_gram_free(struct kvcap_calib_cuda_gram *g); /* NULL-safe */

/* ---- Eigen-decompositions -----------------------------------------------------------------
 * A cuSOLVER handle, one device workspace sized for n_max and pinned staging, reused for
 * every matrix of a batch. */
struct kvcap_calib_cuda_eigen;

enum kvcap_status kvcap_calib_cuda_eigen_create(int n_max, struct kvcap_calib_cuda_eigen **out);
void kvcap_calib_cuda_eigen_free(struct kvcap_calib_cuda_eigen *e); /* NULL-safe */

/* Decomposes `count` full symmetric row-major matrices mats[i] (n[i] x n[i], n[i] <= n_max).
 * For each, in order, calls consume(i, a, w, user) with the output contract of kvcap_dsyevd:
 * a (n x n row-major) holds the eigenvector of w[j] in its column j, w ascending; a and w are
 * valid during the call only. The host's consume of matrix i overlaps the device's work on
 * matrix i+1. Stops at the first failure: info > 0 (no convergence) is KVCAP_ERR_NUMERIC, and
 * *failed (if not NULL) is the index of the matrix at fault, else -1. A non-OK status from
 * consume stops the batch and is returned. */
enum kvcap_status kvcap_calib_cuda_dsyevd_batch(
    struct kvcap_calib_cuda_eigen *e, int count, const double *const *mats, const int *n,
    enum kvcap_status (*consume)(int i, const double *a, const double *w, void *user), void *user,
    int *failed);

/* ---- Key training -------------------------------------------------------------------------
 * kvcap_keys_train (keys.h) with its Adam steps, checkpoint scores and MSEs on the current CUDA
 * device; the start, the hardening and the minibatch order are the CPU code's, so for a seed
 * the device sees the same batches in the same order. Same arguments and contract, plus
 * `fallback`: if the device cannot be used for this problem (none visible, a build without
 * CUDA, not enough device memory), nonzero logs a warning and trains on the CPU
 * (report->on_device = 0), zero returns that error (KVCAP_ERR_UNSUPPORTED,
 * KVCAP_ERR_OUT_OF_MEMORY, KVCAP_ERR_DEVICE). Argument errors are reported as by
 * kvcap_keys_train, before any device is touched; a device failure after setup is an error
 * either way. Bit-identical from run to run on one GPU model and toolkit; agrees with the CPU
 * path to float rounding amplified by Adam (tests/test_train_cuda.c). Implemented in train.c
 * over the kvcap_calib_cuda_train object below. */
struct kvcap_train_config;
struct kvcap_key_maps;
struct kvcap_train_report;
struct kvcap_train_net;

enum kvcap_status kvcap_calib_cuda_keys_train(const float *x_train, size_t ld_train, size_t n_train,
                                              const float *x_val, size_t ld_val, size_t n_val,
                                              const struct kvcap_train_config *cfg, int gelu,
                                              const struct kvcap_key_maps *init,
                                              struct kvcap_key_maps *out,
                                              struct kvcap_train_report *report, int fallback);

/* The device side of one training run. From create to free the training and validation
 * columns (packed m x n), θ, its gradient, the Adam moments and the scratch of one batch live
 * in device memory; per step the host sends the batch's column indices and gets back the loss
 * and a finiteness flag (one small copy each way and one stream synchronisation). θ comes back
 * only when asked (kvcap_calib_cuda_train_fetch). Products are cuBLAS SGEMMs in FP32 (pedantic
 * math: no TF32 or emulation, whatever the environment says; atomics not allowed), reductions are
 * fixed-order block reductions in double: no atomics anywhere, so the results are
 * bit-identical from run to run. Networks (train_internal.h) must have the given m and h. */
struct kvcap_calib_cuda_train;

struct kvcap_calib_cuda_train_params {
    int m, h;               /* points per sample, hidden width */
    const float *x_train;   /* m x n_train, leading dimension ld_train (host) */
    size_t ld_train, n_train;
    const float *x_val;     /* m x n_val (ld_val), or NULL: checkpoints score x_train */
    size_t ld_val, n_val;
    size_t batch;           /* columns per step (the order's b): 1 <= batch <= n_train */
};

/* Checks the device memory needed against what is free (KVCAP_ERR_OUT_OF_MEMORY naming the
 * sizes), allocates and uploads. Device buffers that receive results start as NaN, so an
 * entry a kernel fails to write shows. */
enum kvcap_status kvcap_calib_cuda_train_create(const struct kvcap_calib_cuda_train_params *p,
                                                struct kvcap_calib_cuda_train **out);
void kvcap_calib_cuda_train_free(struct kvcap_calib_cuda_train *g); /* NULL-safe */

/* Makes `net` (relaxed or hard) the device's network: uploads θ (and a hard network's rows),
 * zeroes the Adam moments and the step count, fills the gradient with NaN. The scalars (tau,
 * lambda_bce, lambda_r, ratio) are read from `net` by every call below, which must pass a
 * network of the loaded shape. */
enum kvcap_status kvcap_calib_cuda_train_load(struct kvcap_calib_cuda_train *g,
                                              const struct kvcap_train_net *net);

/* kvcap_train_loss_grad of the loaded network on the device, on the training columns `pick`
 * (`batch` increasing indices into x_train) or on the whole training set (pick NULL; then
 * n_train <= batch). The gradient is copied to grad[n_params] when grad is not NULL. */
enum kvcap_status kvcap_calib_cuda_train_loss_grad(struct kvcap_calib_cuda_train *g,
                                                   const struct kvcap_train_net *net,
                                                   const size_t *pick, double *loss, float *grad);

/* One Adam step (train_internal.h): the loss and gradient as above, then the update of θ,
 * skipped on the device when the loss is not finite. *finite = 0 when the loss or the updated
 * θ is not finite. */
enum kvcap_status kvcap_calib_cuda_train_step(struct kvcap_calib_cuda_train *g,
                                              const struct kvcap_train_net *net, const size_t *pick,
                                              double lr, double *loss, int *finite);

/* Copies the loaded θ into net->theta. */
enum kvcap_status kvcap_calib_cuda_train_fetch(struct kvcap_calib_cuda_train *g,
                                               struct kvcap_train_net *net);

/* The loaded hard network's MSE on the validation columns (kvcap_key_maps_mse's mse). */
enum kvcap_status kvcap_calib_cuda_train_score(struct kvcap_calib_cuda_train *g,
                                               const struct kvcap_train_net *net, double *mse);

/* The MSE of maps k (m and h as created, any rk and gelu) on the validation (on_val) or
 * training columns. */
enum kvcap_status kvcap_calib_cuda_train_maps_mse(struct kvcap_calib_cuda_train *g,
                                                  const struct kvcap_key_maps *k, int on_val,
                                                  double *mse);

/* ---- Ceilings for the benchmark ------------------------------------------------------------ */
struct kvcap_calib_cuda_peak {
    double dsyrk_gflops; /* best cublasDsyrk on device-resident data, m x k, k in 256..4096 */
    int dsyrk_k;         /* the k of the best rate */
    double dgemm_gflops; /* cublasDgemm m x m x m */
    double h2d_gbps;     /* pinned host -> device copy bandwidth, GB/s (1e9 bytes) */
};

/* Measures the ceilings the GPU Gram path is compared with, for Grams of size m. Counts
 * m(m+1)k flops per DSYRK and 2m³ per DGEMM. */
enum kvcap_status kvcap_calib_cuda_peak_measure(int m, struct kvcap_calib_cuda_peak *out);

#endif /* KVCAP_CALIB_GPU_H */
