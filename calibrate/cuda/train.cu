// train.cu — the trained key maps' optimisation on a CUDA device (calibrate/calib_cuda.h): the
// loss and gradient of kvcap_train_loss_grad (train.c) with cuBLAS SGEMMs and small kernels, the
// Adam update as a kernel, and the MSEs the checkpoints compare, on device-resident data.
// train.c drives it (kvcap_calib_cuda_keys_train); the CPU code in train.c is the readable spec,
// and the comments below name the CPU step each kernel or product mirrors.
//
// Layout: every matrix is stored row-major exactly as on the host (a row per point or hidden
// unit, a column per sample channel), and each product is the CPU's cblas_sgemm call passed
// through gemm_rm: a row-major matrix read column-major is its transpose, so row-major
// C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ — cuBLAS with the same operation flags,
// the operands swapped and M, N swapped.
//
// Determinism: one stream and one cuBLAS handle per run, SGEMMs in pedantic FP32 with atomics
// not allowed (cuBLAS is then bit-reproducible on one GPU model and toolkit), and every sum is
// either a GEMM or a fixed-order block reduction in double (a tree over thread indices of a
// fixed block size, blocks written to separate slots and summed by one block): no atomics, so
// two runs with one seed give the same bits.
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

extern "C" {
#include "calibrate/calib_cuda.h"
#include "common/internal.h"
#include "calibrate/train_internal.h"
}
#include "kernels/cuda/common.cuh"

// ---- Kernels ---------------------------------------------------------------------------------

// Internal linkage: the names below are private to this file.
namespace {

// Threads per block everywhere; a power of two, so the reduction tree depends on it alone.
enum { THREADS = 256 };

// What a step or a score leaves for the host: the one copy that comes back per step.
struct step_out {
    double loss;
    int bad; // the Adam update produced a non-finite parameter
};

// The sum of one double per thread over the block, in a fixed order (pairwise over thread
// indices), so it depends on the data and THREADS only, never on scheduling. Every thread of
// the block must call it; every thread gets the sum.
__device__ double block_sum(double v)
{
    __shared__ double sh[THREADS];
    __syncthreads(); // a previous call's readers of sh[0] are done
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s)
            sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    return sh[0];
}

#define GRID_STRIDE(i, n)                                                                   \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                 \
         i += (size_t)gridDim.x * blockDim.x)

// kvcap_gelu and kvcap_gelu_grad (kernels/activation.c), the same formulas in float.
__device__ float gelu(float x)
{
    const float c = 0.7978845608028654f; // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

__device__ float gelu_grad(float x)
{
    const float c = 0.7978845608028654f;
    float t = tanhf(c * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * x * x);
}

__device__ double sigmoid(double s)
{
    return 1.0 / (1.0 + exp(-s));
}

// out[j][c] = x[j][pick[c]]: the batch's columns, gathered by index (rows x cols, ld cols).
__global__ void gather_cols(const float *x, size_t ldx, const size_t *pick, int rows, size_t cols,
                            float *out)
{
    GRID_STRIDE(i, (size_t)rows * cols)
    {
        size_t r = i / cols, c = i % cols;
        out[i] = x[r * ldx + pick[c]];
    }
}

// out[r][c] = x[rows[r]][c]: the retained points, the input of a hard network's W1.
__global__ void gather_rows(const float *x, size_t ldx, const int32_t *rows, int p, size_t cols,
                            float *out)
{
    GRID_STRIDE(i, (size_t)p * cols)
    {
        size_t r = i / cols, c = i % cols;
        out[i] = x[(size_t)rows[r] * ldx + c];
    }
}

// out[j][c] = mask[j]·x[j][c]: diag(mask) X, the input of a relaxed network's W1.
__global__ void scale_rows(const float *x, size_t ldx, const float *mask, int m, size_t cols,
                           float *out)
{
    GRID_STRIDE(i, (size_t)m * cols)
    {
        size_t j = i / cols, c = i % cols;
        out[i] = mask[j] * x[j * ldx + c];
    }
}

// dst[r][c] = v[r]: a bias along the columns, added by the SGEMM that follows (beta 1), as on
// the CPU.
__global__ void fill_rows(const float *v, int rows, size_t cols, float *dst)
{
    GRID_STRIDE(i, (size_t)rows * cols)
    dst[i] = v[i / cols];
}

__global__ void gelu_forward(const float *z, size_t n, float *hid)
{
    GRID_STRIDE(i, n)
    hid[i] = gelu(z[i]);
}

// The relaxed mask and its two terms, one block: mask_j = σ(α_j/τ) rounded to float (mask_of),
// terms[0] = Σ σ, terms[1] = Σ H(σ) with H from the logit (entropy_of_logit), both in double.
__global__ void mask_terms(const float *alpha, int m, double tau, float *mask, double *terms)
{
    double sum = 0.0, ent = 0.0;
    for (int j = threadIdx.x; j < m; j += THREADS) {
        double s = alpha[j] / tau, sg = sigmoid(s);
        mask[j] = (float)sg;
        sum += sg;
        ent += (s > 0 ? s : 0.0) + log1p(exp(-fabs(s))) - s * sg;
    }
    sum = block_sum(sum);
    ent = block_sum(ent);
    if (threadIdx.x == 0) {
        terms[0] = sum;
        terms[1] = ent;
    }
}

// One block per output row j: d = y − x, row_sse[j] = Σ d² (double); y := scale·d (= dL/dY)
// and db2[j] = Σ_c y (the CPU's double sum of the same floats).
__global__ void output_rows(float *y, const float *x, size_t ldx, size_t cols, float scale,
                            double *row_sse, float *db2)
{
    const size_t j = blockIdx.x;
    float *yr = y + j * cols;
    const float *xr = x + j * ldx;
    double sse = 0.0, sum = 0.0;
    for (size_t c = threadIdx.x; c < cols; c += THREADS) {
        float d = yr[c] - xr[c];
        sse += (double)d * d;
        float g = scale * d;
        yr[c] = g;
        sum += g;
    }
    sse = block_sum(sse);
    sum = block_sum(sum);
    if (threadIdx.x == 0) {
        row_sse[j] = sse;
        db2[j] = (float)sum;
    }
}

// One block per row j: acc[j] += Σ_c (y − x)², a score accumulated over column chunks (in
// stream order, so in a fixed order).
__global__ void error_rows(const float *y, const float *x, size_t ldx, size_t cols, double *acc)
{
    const size_t j = blockIdx.x;
    double sse = 0.0;
    for (size_t c = threadIdx.x; c < cols; c += THREADS) {
        double d = (double)y[j * cols + c] - x[j * ldx + c];
        sse += d * d;
    }
    sse = block_sum(sse);
    if (threadIdx.x == 0)
        acc[j] += sse;
}

// One block per hidden unit i: dz := dz ⊙ φ'(z) (GELU only), db1[i] = Σ_c dz.
__global__ void hidden_rows(float *dz, const float *z, size_t cols, int use_gelu, float *db1)
{
    const size_t i = blockIdx.x;
    double sum = 0.0;
    for (size_t c = threadIdx.x; c < cols; c += THREADS) {
        float v = dz[i * cols + c];
        if (use_gelu) {
            v *= gelu_grad(z[i * cols + c]);
            dz[i * cols + c] = v;
        }
        sum += v;
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0)
        db1[i] = (float)sum;
}

struct mask_scalars {
    int m;
    double tau, lambda_bce, lambda_r, ratio;
};

// One block per point j: dmask_j = Σ_c du[j][c]·x[j][c] (double), then through
// mask = σ(α/τ) together with the two mask terms, as the last loop of kvcap_train_loss_grad.
__global__ void alpha_grad(const float *du, const float *x, size_t ldx, size_t cols,
                           const float *alpha, const double *terms, struct mask_scalars k,
                           float *g_alpha)
{
    const size_t j = blockIdx.x;
    double dmask = 0.0;
    for (size_t c = threadIdx.x; c < cols; c += THREADS)
        dmask += (double)du[j * cols + c] * x[j * ldx + c];
    dmask = block_sum(dmask);
    if (threadIdx.x == 0) {
        double mean = terms[0] / k.m, d_ratio = 2.0 * k.lambda_r * (mean - k.ratio) / k.m;
        double s = alpha[j] / k.tau, mk = sigmoid(s), dsig = mk * (1.0 - mk);
        g_alpha[j] = (float)(((dmask + d_ratio) * dsig - k.lambda_bce / k.m * s * dsig) / k.tau);
    }
}

// One block: the loss from the per-row sums, Σ_j row[j] / count, plus the mask terms of a
// relaxed network; clears the step's non-finite flag.
__global__ void finish_loss(const double *row, int rows, double count, int relaxed,
                            const double *terms, struct mask_scalars k, struct step_out *out)
{
    double s = 0.0;
    for (int j = threadIdx.x; j < rows; j += THREADS)
        s += row[j];
    s = block_sum(s);
    if (threadIdx.x == 0) {
        double loss = s / count;
        if (relaxed) {
            double mean = terms[0] / k.m;
            loss += k.lambda_bce * terms[1] / k.m + k.lambda_r * (mean - k.ratio) * (mean - k.ratio);
        }
        out->loss = loss;
        out->bad = 0;
    }
}

// adam_step (train.c) element by element, skipped when the step's loss is not finite (the CPU
// then stops before updating). Rounded operations (__fmul_rn, ...) keep nvcc from fusing
// multiply-adds, so from the same gradient the update is bit-identical to the CPU's: the two
// paths then differ only by the rounding of the gradients. Any non-finite result sets
// out->bad; all writers store the same 1, so no atomic is needed.
__global__ void adam_update(float *theta, float *m1, float *m2, const float *g, size_t n,
                            struct kvcap_train_adam_step s, struct step_out *out)
{
    if (!isfinite(out->loss))
        return;
    const float one_b1 = __fsub_rn(1.0f, s.beta1), one_b2 = __fsub_rn(1.0f, s.beta2);
    GRID_STRIDE(i, n)
    {
        float a = __fadd_rn(__fmul_rn(s.beta1, m1[i]), __fmul_rn(one_b1, g[i]));
        float b = __fadd_rn(__fmul_rn(s.beta2, m2[i]), __fmul_rn(__fmul_rn(one_b2, g[i]), g[i]));
        float den = __fadd_rn(__fsqrt_rn(__fdiv_rn(b, s.c2)), s.eps);
        float t = __fsub_rn(theta[i], __fdiv_rn(__fmul_rn(s.rate, __fdiv_rn(a, s.c1)), den));
        m1[i] = a;
        m2[i] = b;
        theta[i] = t;
        if (!isfinite(t))
            out->bad = 1;
    }
}

} // namespace

// ---- The run's state ---------------------------------------------------------------------------

struct kvcap_calib_cuda_train {
    int m, h;
    size_t n_train, n_val; // n_val == n_train when val aliases train
    size_t batch, width;   // columns per step; columns of the scratch (>= batch)
    size_t np_max;         // parameters of the relaxed network, the larger one
    cudaStream_t stream;
    cublasHandle_t blas;
    void *block;       // the one device allocation everything below is carved from
    float *train, *val; // m x n, packed (val may be train)
    float *theta, *grad, *m1, *m2; // [np_max]
    float *eval;                   // [np_max] maps being scored
    int32_t *rows, *eval_rows;     // [m] the loaded hard network's points; the scored maps'
    float *xb, *u, *z, *hid, *y, *dz; // [rows][width] one batch: gathered x, W1's input, ...
    float *mask;                      // [m]
    double *row_sum;                  // [m]
    double *terms;                    // [2]
    size_t *pick;                     // [batch]
    struct step_out *out;
    void *pinned; // host, page-locked: h_out then h_pick
    struct step_out *h_out;
    size_t *h_pick;
    // the loaded network
    int loaded, relaxed, p, gelu;
    size_t n_params;
    int adam_t;
};

// Headroom beyond the computed need: cuBLAS's workspace and the allocator's rounding.
#define BLAS_RESERVE ((size_t)64 << 20)
#define HEADROOM ((size_t)256 << 20)

static double mib(size_t bytes)
{
    return (double)bytes / (1024.0 * 1024.0);
}

// Carves count elements of T from a block at *off, 256-byte aligned; with base NULL it only
// measures. Returns 0 when the size overflows.
template <class T> static int carve(char *base, size_t *off, size_t count, T **out)
{
    size_t o = (*off + 255) & ~(size_t)255, bytes;
    if (o < *off || !kvcap_mul_size(count, sizeof(T), &bytes) || !kvcap_add_size(o, bytes, off))
        return 0;
    *out = base ? (T *)(base + o) : NULL;
    return 1;
}

// The device block's layout; returns its size in bytes, 0 on overflow.
static size_t layout(struct kvcap_calib_cuda_train *g, char *base, int val_is_train)
{
    size_t off = 0, m = (size_t)g->m, h = (size_t)g->h, w = g->width;
    size_t mn, mv, mw, hw;
    if (!kvcap_mul_size(m, g->n_train, &mn) || !kvcap_mul_size(m, g->n_val, &mv) ||
        !kvcap_mul_size(m, w, &mw) || !kvcap_mul_size(h, w, &hw))
        return 0;
    int ok = carve(base, &off, mn, &g->train);
    if (val_is_train)
        g->val = g->train;
    else
        ok = ok && carve(base, &off, mv, &g->val);
    ok = ok && carve(base, &off, g->np_max, &g->theta) && carve(base, &off, g->np_max, &g->grad) &&
         carve(base, &off, g->np_max, &g->m1) && carve(base, &off, g->np_max, &g->m2) &&
         carve(base, &off, g->np_max, &g->eval) && carve(base, &off, m, &g->rows) &&
         carve(base, &off, m, &g->eval_rows) && carve(base, &off, mw, &g->xb) &&
         carve(base, &off, mw, &g->u) && carve(base, &off, hw, &g->z) &&
         carve(base, &off, hw, &g->hid) && carve(base, &off, mw, &g->y) &&
         carve(base, &off, hw, &g->dz) && carve(base, &off, m, &g->mask) &&
         carve(base, &off, m, &g->row_sum) && carve(base, &off, (size_t)2, &g->terms) &&
         carve(base, &off, g->batch, &g->pick) && carve(base, &off, (size_t)1, &g->out);
    return ok ? off : 0;
}

extern "C" void kvcap_calib_cuda_train_free(struct kvcap_calib_cuda_train *g)
{
    if (!g)
        return;
    // Errors are ignored here: this runs on failure paths too, and frees what exists.
    if (g->stream)
        cudaStreamSynchronize(g->stream);
    if (g->blas)
        cublasDestroy(g->blas);
    cudaFree(g->block);
    if (g->pinned)
        cudaFreeHost(g->pinned);
    if (g->stream)
        cudaStreamDestroy(g->stream);
    (void)cudaGetLastError();
    free(g);
}

static enum kvcap_status upload_columns(float *dst, const float *src, size_t ld, int m, size_t n,
                                        cudaStream_t stream, const char *what)
{
    KVCAP_CUDA_TRY(cudaMemcpy2DAsync(dst, n * sizeof(float), src, ld * sizeof(float), n * sizeof(float),
                               (size_t)m, cudaMemcpyHostToDevice, stream),
             what);
    return KVCAP_OK;
}

static enum kvcap_status train_setup(struct kvcap_calib_cuda_train *g,
                                     const struct kvcap_calib_cuda_train_params *p)
{
    const int val_is_train = p->x_val == NULL;
    size_t bytes = layout(g, NULL, val_is_train);
    KVCAP_RETURN_IF(bytes == 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda keys train: sizes overflow (m %d, h %d, %zu + %zu columns)", g->m, g->h,
                    g->n_train, g->n_val);
    size_t free_b = 0, total_b = 0;
    KVCAP_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b), "device memory for key training");
    KVCAP_RETURN_IF(bytes + BLAS_RESERVE + HEADROOM > free_b, KVCAP_ERR_OUT_OF_MEMORY,
                    "cuda keys train: training m %d, h %d on %zu training and %zu validation "
                    "columns needs %.0f MiB of device memory plus %.0f MiB of cuBLAS reserve "
                    "and headroom, but only %.0f of %.0f MiB are free",
                    g->m, g->h, g->n_train, val_is_train ? (size_t)0 : g->n_val, mib(bytes),
                    mib(BLAS_RESERVE + HEADROOM), mib(free_b), mib(total_b));

    KVCAP_CUDA_TRY(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking), "key training stream");
    KVCAP_CUBLAS_TRY(cublasCreate(&g->blas), "key training handle");
    KVCAP_CUBLAS_TRY(cublasSetStream(g->blas, g->stream), "key training handle");
    // FP32 as prescribed (no TF32 or BF16x9 emulation, whatever NVIDIA_TF32_OVERRIDE or the
    // emulation variables say) and no atomics: reproducible products.
    KVCAP_CUBLAS_TRY(cublasSetMathMode(g->blas, CUBLAS_PEDANTIC_MATH), "key training handle");
    KVCAP_CUBLAS_TRY(cublasSetAtomicsMode(g->blas, CUBLAS_ATOMICS_NOT_ALLOWED), "key training handle");
    KVCAP_CUDA_TRY(cudaMalloc(&g->block, bytes), "key training buffers");
    layout(g, (char *)g->block, val_is_train);
    size_t pinned_bytes = sizeof(struct step_out) + 16 + g->batch * sizeof(size_t);
    KVCAP_CUDA_TRY(cudaMallocHost(&g->pinned, pinned_bytes), "key training staging");
    g->h_out = (struct step_out *)g->pinned;
    g->h_pick = (size_t *)((char *)g->pinned + ((sizeof(struct step_out) + 15) & ~(size_t)15));

    // Everything after the columns receives results: it starts as NaN (all bits set), so a
    // missed write shows.
    KVCAP_CUDA_TRY(cudaMemsetAsync(g->theta, 0xff, (char *)(g->out + 1) - (char *)g->theta, g->stream),
             "key training buffers");
    KVCAP_TRY(upload_columns(g->train, p->x_train, p->ld_train, g->m, g->n_train, g->stream,
                             "upload training columns"));
    if (!val_is_train)
        KVCAP_TRY(upload_columns(g->val, p->x_val, p->ld_val, g->m, g->n_val, g->stream,
                                 "upload validation columns"));
    KVCAP_CUDA_TRY(cudaStreamSynchronize(g->stream), "key training setup");
    return KVCAP_OK;
}

extern "C" enum kvcap_status
kvcap_calib_cuda_train_create(const struct kvcap_calib_cuda_train_params *p,
                              struct kvcap_calib_cuda_train **out)
{
    KVCAP_RETURN_IF(!p || !out, KVCAP_ERR_INVALID_ARGUMENT, "cuda keys train: NULL argument");
    *out = NULL;
    KVCAP_RETURN_IF(p->m < 1 || p->h < 1 || !p->x_train || p->n_train < 1 ||
                        p->ld_train < p->n_train || p->batch < 1 || p->batch > p->n_train ||
                        (p->x_val && (p->n_val < 1 || p->ld_val < p->n_val)),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda keys train: bad parameters (m %d, h %d, %zu training columns (ld %zu), "
                    "%zu validation columns (ld %zu), batch %zu)",
                    p->m, p->h, p->n_train, p->ld_train, p->x_val ? p->n_val : (size_t)0,
                    p->ld_val, p->batch);
    struct kvcap_calib_cuda_train *g = (struct kvcap_calib_cuda_train *)calloc(1, sizeof *g);
    KVCAP_RETURN_IF(!g, KVCAP_ERR_OUT_OF_MEMORY, "cuda keys train: out of memory");
    g->m = p->m;
    g->h = p->h;
    g->n_train = p->n_train;
    g->n_val = p->x_val ? p->n_val : p->n_train;
    g->batch = p->batch;
    // Scores run in chunks of the scratch's width: at least a batch, at most the larger set
    // or KVCAP_TRAIN_BATCH columns.
    size_t most = g->n_train > g->n_val ? g->n_train : g->n_val;
    g->width = most < KVCAP_TRAIN_BATCH ? most : KVCAP_TRAIN_BATCH;
    g->width = g->width > g->batch ? g->width : g->batch;
    // relaxed θ: alpha [m] | w1 [m][h] | b1 [h] | w2 [h][m] | b2 [m]
    size_t mh, np;
    int sizes_ok = kvcap_mul_size((size_t)p->m, (size_t)p->h, &mh) &&
                   kvcap_mul_size(mh, 2, &np) &&
                   kvcap_add_size(np, 2 * (size_t)p->m + (size_t)p->h, &np) &&
                   g->width <= (size_t)INT32_MAX; // cuBLAS sizes are int
    g->np_max = np;
    enum kvcap_status st =
        sizes_ok ? train_setup(g, p)
                 : kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                              "cuda keys train: sizes overflow (m %d, h %d, batch %zu)", p->m,
                              p->h, p->batch);
    if (st != KVCAP_OK) {
        kvcap_calib_cuda_train_free(g);
        return st;
    }
    *out = g;
    return KVCAP_OK;
}

// ---- Steps -------------------------------------------------------------------------------------

#define LAUNCHED(what) KVCAP_CUDA_TRY(cudaGetLastError(), what)

static unsigned grid_for(size_t n)
{
    size_t b = (n + THREADS - 1) / THREADS;
    return (unsigned)(b < 1 ? 1 : b > 4096 ? 4096 : b);
}

// The CPU's row-major cblas_sgemm(ta, tb, M, N, K, 1, A, lda, B, ldb, beta, C, ldc) on the
// device (see the top of the file).
static enum kvcap_status gemm_rm(cublasHandle_t blas, bool ta, bool tb, int M, int N, int K,
                                 const float *A, int lda, const float *B, int ldb, float beta,
                                 float *C, int ldc, const char *what)
{
    const float one = 1.0f;
    KVCAP_CUBLAS_TRY(cublasSgemm(blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                           N, M, K, &one, B, ldb, A, lda, &beta, C, ldc),
               what);
    return KVCAP_OK;
}

static struct mask_scalars scalars_of(const struct kvcap_train_net *net)
{
    struct mask_scalars k = {net->m, net->tau, net->lambda_bce, net->lambda_r, net->ratio};
    return k;
}

// `net` must be the loaded network (its scalars may change between calls, its shape not).
static enum kvcap_status check_loaded(const struct kvcap_calib_cuda_train *g,
                                      const struct kvcap_train_net *net, int want_hard)
{
    KVCAP_RETURN_IF(!net || !g->loaded || net->m != g->m || net->h != g->h || net->p != g->p ||
                        (net->rows == NULL) != g->relaxed || (net->gelu != 0) != g->gelu ||
                        net->n_params != g->n_params || (want_hard && g->relaxed),
                    KVCAP_ERR_INTERNAL,
                    "cuda keys train: the network passed is not the loaded %s one (m %d, p %d, "
                    "h %d)",
                    g->loaded ? (g->relaxed ? "relaxed" : "hard") : "(none)", g->m, g->p, g->h);
    return KVCAP_OK;
}

// Waits for the stream and copies the step's result back.
static enum kvcap_status fetch_out(struct kvcap_calib_cuda_train *g, const char *what)
{
    KVCAP_CUDA_TRY(cudaMemcpyAsync(g->h_out, g->out, sizeof *g->out, cudaMemcpyDeviceToHost, g->stream),
             what);
    KVCAP_CUDA_TRY(cudaStreamSynchronize(g->stream), what);
    return KVCAP_OK;
}

// Enqueues kvcap_train_loss_grad of the loaded network: the loss into g->out, the gradient
// into g->grad. Same steps, same order; comments name the CPU's.
static enum kvcap_status loss_grad(struct kvcap_calib_cuda_train *g,
                                   const struct kvcap_train_net *net, const size_t *pick)
{
    KVCAP_TRY(check_loaded(g, net, 0));
    const int m = g->m, p = g->p, h = g->h;
    const cudaStream_t s = g->stream;
    const float *x;
    size_t ldx, nc;
    if (pick) {
        for (size_t c = 0; c < g->batch; c++)
            KVCAP_RETURN_IF(pick[c] >= g->n_train, KVCAP_ERR_INVALID_ARGUMENT,
                            "cuda keys train: batch column %zu is %zu, beyond the %zu training "
                            "columns",
                            c, pick[c], g->n_train);
        // Every entry point leaves the stream idle, so the staging is free to refill.
        memcpy(g->h_pick, pick, g->batch * sizeof *pick);
        KVCAP_CUDA_TRY(cudaMemcpyAsync(g->pick, g->h_pick, g->batch * sizeof *pick,
                                 cudaMemcpyHostToDevice, s),
                 "batch indices");
        gather_cols<<<grid_for((size_t)m * g->batch), THREADS, 0, s>>>(g->train, g->n_train,
                                                                         g->pick, m, g->batch,
                                                                         g->xb);
        LAUNCHED("gather batch");
        x = g->xb;
        ldx = nc = g->batch;
    } else {
        KVCAP_RETURN_IF(g->n_train > g->batch, KVCAP_ERR_INVALID_ARGUMENT,
                        "cuda keys train: no batch given, and the %zu training columns exceed "
                        "the batch of %zu",
                        g->n_train, g->batch);
        x = g->train;
        ldx = nc = g->n_train;
    }
    const int n = (int)nc;
    const struct kvcap_train_view P = kvcap_train_split(net, g->theta); // device pointers
    const struct kvcap_train_view G = kvcap_train_split(net, g->grad);
    const struct mask_scalars k = scalars_of(net);
    float *u = g->u, *z = g->z, *hid = g->gelu ? g->hid : g->z, *y = g->y, *dz = g->dz;

    // u = diag(mask) X (relaxed) or X[rows] (hard)
    if (g->relaxed) {
        mask_terms<<<1, THREADS, 0, s>>>(P.alpha, m, net->tau, g->mask, g->terms);
        LAUNCHED("mask");
        scale_rows<<<grid_for((size_t)m * nc), THREADS, 0, s>>>(x, ldx, g->mask, m, nc, u);
        LAUNCHED("masked input");
    } else {
        gather_rows<<<grid_for((size_t)p * nc), THREADS, 0, s>>>(x, ldx, g->rows, p, nc, u);
        LAUNCHED("retained input");
    }
    // z = W1ᵀ u + b1 1ᵀ, hid = φ(z)
    fill_rows<<<grid_for((size_t)h * nc), THREADS, 0, s>>>(P.b1, h, nc, z);
    LAUNCHED("b1");
    KVCAP_TRY(gemm_rm(g->blas, true, false, h, n, p, P.w1, h, u, n, 1.0f, z, n, "W1ᵀ u"));
    if (g->gelu) {
        gelu_forward<<<grid_for((size_t)h * nc), THREADS, 0, s>>>(z, (size_t)h * nc, hid);
        LAUNCHED("GELU");
    }
    // y = W2ᵀ hid + b2 1ᵀ, then y := dL/dY = 2 (Y − X) / (m n), with the loss
    fill_rows<<<grid_for((size_t)m * nc), THREADS, 0, s>>>(P.b2, m, nc, y);
    LAUNCHED("b2");
    KVCAP_TRY(gemm_rm(g->blas, true, false, m, n, h, P.w2, m, hid, n, 1.0f, y, n, "W2ᵀ hid"));
    const double count = (double)m * (double)nc;
    output_rows<<<m, THREADS, 0, s>>>(y, x, ldx, nc, (float)(2.0 / count), g->row_sum, G.b2);
    LAUNCHED("output error");
    finish_loss<<<1, THREADS, 0, s>>>(g->row_sum, m, count, g->relaxed, g->terms, k, g->out);
    LAUNCHED("loss");
    // dW2 = hid dYᵀ, d(hid) = W2 dY, dz = d(hid) ⊙ φ'(z), db1 = dz 1
    KVCAP_TRY(gemm_rm(g->blas, false, true, h, m, n, hid, n, y, n, 0.0f, G.w2, m, "dW2"));
    KVCAP_TRY(gemm_rm(g->blas, false, false, h, n, m, P.w2, m, y, n, 0.0f, dz, n, "W2 dY"));
    hidden_rows<<<h, THREADS, 0, s>>>(dz, z, nc, g->gelu, G.b1);
    LAUNCHED("hidden gradient");
    // dW1 = u dzᵀ
    KVCAP_TRY(gemm_rm(g->blas, false, true, p, h, n, u, n, dz, n, 0.0f, G.w1, h, "dW1"));
    if (!g->relaxed)
        return KVCAP_OK;
    // du = W1 dz (into y, dY is spent); dα through the mask with its two terms
    KVCAP_TRY(gemm_rm(g->blas, false, false, m, n, h, P.w1, h, dz, n, 0.0f, y, n, "W1 dz"));
    alpha_grad<<<m, THREADS, 0, s>>>(y, x, ldx, nc, P.alpha, g->terms, k, G.alpha);
    LAUNCHED("mask gradient");
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_calib_cuda_train_load(struct kvcap_calib_cuda_train *g,
                                                         const struct kvcap_train_net *net)
{
    KVCAP_RETURN_IF(!g || !net || !net->theta || net->m != g->m || net->h != g->h ||
                        net->p < 1 || net->p > net->m || (!net->rows && net->p != net->m) ||
                        net->n_params > g->np_max,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda keys train: cannot load a network of m %d, p %d, h %d into a run of "
                    "m %d, h %d",
                    net ? net->m : 0, net ? net->p : 0, net ? net->h : 0, g ? g->m : 0,
                    g ? g->h : 0);
    g->loaded = 0;
    const size_t np = net->n_params;
    KVCAP_CUDA_TRY(cudaMemcpyAsync(g->theta, net->theta, np * sizeof(float), cudaMemcpyHostToDevice,
                             g->stream),
             "upload parameters");
    if (net->rows)
        KVCAP_CUDA_TRY(cudaMemcpyAsync(g->rows, net->rows, (size_t)net->p * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, g->stream),
                 "upload retained points");
    KVCAP_CUDA_TRY(cudaMemsetAsync(g->m1, 0, np * sizeof(float), g->stream), "Adam moments");
    KVCAP_CUDA_TRY(cudaMemsetAsync(g->m2, 0, np * sizeof(float), g->stream), "Adam moments");
    KVCAP_CUDA_TRY(cudaMemsetAsync(g->grad, 0xff, np * sizeof(float), g->stream), "gradient");
    KVCAP_CUDA_TRY(cudaStreamSynchronize(g->stream), "load parameters");
    g->loaded = 1;
    g->relaxed = net->rows == NULL;
    g->p = net->p;
    g->gelu = net->gelu != 0;
    g->n_params = np;
    g->adam_t = 0;
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_calib_cuda_train_loss_grad(struct kvcap_calib_cuda_train *g,
                                                              const struct kvcap_train_net *net,
                                                              const size_t *pick, double *loss,
                                                              float *grad)
{
    KVCAP_RETURN_IF(!g || !loss, KVCAP_ERR_INVALID_ARGUMENT, "cuda keys train: NULL argument");
    KVCAP_TRY(loss_grad(g, net, pick));
    if (grad)
        KVCAP_CUDA_TRY(cudaMemcpyAsync(grad, g->grad, g->n_params * sizeof(float),
                                 cudaMemcpyDeviceToHost, g->stream),
                 "download gradient");
    KVCAP_TRY(fetch_out(g, "loss"));
    *loss = g->h_out->loss;
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_calib_cuda_train_step(struct kvcap_calib_cuda_train *g,
                                                         const struct kvcap_train_net *net,
                                                         const size_t *pick, double lr,
                                                         double *loss, int *finite)
{
    KVCAP_RETURN_IF(!g || !loss || !finite, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda keys train: NULL argument");
    KVCAP_TRY(loss_grad(g, net, pick));
    const struct kvcap_train_adam_step a = kvcap_train_adam_scalars(g->adam_t + 1, lr);
    adam_update<<<grid_for(g->n_params), THREADS, 0, g->stream>>>(g->theta, g->m1, g->m2, g->grad,
                                                                  g->n_params, a, g->out);
    LAUNCHED("Adam update");
    KVCAP_TRY(fetch_out(g, "training step"));
    *loss = g->h_out->loss;
    *finite = isfinite(*loss) && !g->h_out->bad;
    if (isfinite(*loss))
        g->adam_t++;
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_calib_cuda_train_fetch(struct kvcap_calib_cuda_train *g,
                                                          struct kvcap_train_net *net)
{
    KVCAP_RETURN_IF(!g, KVCAP_ERR_INVALID_ARGUMENT, "cuda keys train: NULL argument");
    KVCAP_TRY(check_loaded(g, net, 0));
    KVCAP_CUDA_TRY(cudaMemcpyAsync(net->theta, g->theta, g->n_params * sizeof(float),
                             cudaMemcpyDeviceToHost, g->stream),
             "download parameters");
    KVCAP_CUDA_TRY(cudaStreamSynchronize(g->stream), "download parameters");
    return KVCAP_OK;
}

// The MSE of a hard network (θ laid out w1 [p][h] | b1 | w2 [h][m] | b2, points `rows`, both
// on the device) on the validation or training columns: kvcap_key_maps_mse in chunks of the
// scratch's width.
static enum kvcap_status score(struct kvcap_calib_cuda_train *g, const float *theta,
                               const int32_t *rows, int p, int use_gelu, int on_val, double *mse)
{
    const int m = g->m, h = g->h;
    const cudaStream_t s = g->stream;
    const float *x = on_val ? g->val : g->train;
    const size_t n = on_val ? g->n_val : g->n_train;
    const float *w1 = theta, *b1 = w1 + (size_t)p * h, *w2 = b1 + h, *b2 = w2 + (size_t)h * m;
    float *hid = use_gelu ? g->hid : g->z;
    KVCAP_CUDA_TRY(cudaMemsetAsync(g->row_sum, 0, (size_t)m * sizeof(double), s), "score");
    for (size_t c0 = 0; c0 < n; c0 += g->width) {
        const size_t nb = n - c0 < g->width ? n - c0 : g->width;
        const int nbi = (int)nb;
        gather_rows<<<grid_for((size_t)p * nb), THREADS, 0, s>>>(x + c0, n, rows, p, nb, g->u);
        LAUNCHED("score input");
        fill_rows<<<grid_for((size_t)h * nb), THREADS, 0, s>>>(b1, h, nb, g->z);
        LAUNCHED("score b1");
        KVCAP_TRY(gemm_rm(g->blas, true, false, h, nbi, p, w1, h, g->u, nbi, 1.0f, g->z, nbi,
                          "score W1ᵀ u"));
        if (use_gelu) {
            gelu_forward<<<grid_for((size_t)h * nb), THREADS, 0, s>>>(g->z, (size_t)h * nb, hid);
            LAUNCHED("score GELU");
        }
        fill_rows<<<grid_for((size_t)m * nb), THREADS, 0, s>>>(b2, m, nb, g->y);
        LAUNCHED("score b2");
        KVCAP_TRY(gemm_rm(g->blas, true, false, m, nbi, h, w2, m, hid, nbi, 1.0f, g->y, nbi,
                          "score W2ᵀ hid"));
        error_rows<<<m, THREADS, 0, s>>>(g->y, x + c0, n, nb, g->row_sum);
        LAUNCHED("score error");
    }
    struct mask_scalars none = {m, 1.0, 0.0, 0.0, 0.0};
    finish_loss<<<1, THREADS, 0, s>>>(g->row_sum, m, (double)m * (double)n, 0, g->terms, none,
                                      g->out);
    LAUNCHED("score sum");
    KVCAP_TRY(fetch_out(g, "score"));
    *mse = g->h_out->loss;
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_calib_cuda_train_score(struct kvcap_calib_cuda_train *g,
                                                          const struct kvcap_train_net *net,
                                                          double *mse)
{
    KVCAP_RETURN_IF(!g || !mse, KVCAP_ERR_INVALID_ARGUMENT, "cuda keys train: NULL argument");
    KVCAP_TRY(check_loaded(g, net, 1));
    return score(g, g->theta, g->rows, g->p, g->gelu, 1, mse);
}

extern "C" enum kvcap_status kvcap_calib_cuda_train_maps_mse(struct kvcap_calib_cuda_train *g,
                                                             const struct kvcap_key_maps *k,
                                                             int on_val, double *mse)
{
    KVCAP_RETURN_IF(!g || !k || !mse || k->m != g->m || k->h != g->h || k->rk < 1 ||
                        k->rk > k->m || !k->mask || !k->w1 || !k->b1 || !k->w2 || !k->b2,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda keys train: maps of m %d, rk %d, h %d cannot be scored in a run of "
                    "m %d, h %d",
                    k ? k->m : 0, k ? k->rk : 0, k ? k->h : 0, g ? g->m : 0, g ? g->h : 0);
    const size_t m = (size_t)k->m, rk = (size_t)k->rk, h = (size_t)k->h;
    const cudaStream_t s = g->stream;
    float *w1 = g->eval, *b1 = w1 + rk * h, *w2 = b1 + h, *b2 = w2 + h * m;
    KVCAP_CUDA_TRY(cudaMemcpyAsync(w1, k->w1, rk * h * sizeof(float), cudaMemcpyHostToDevice, s),
             "upload maps");
    KVCAP_CUDA_TRY(cudaMemcpyAsync(b1, k->b1, h * sizeof(float), cudaMemcpyHostToDevice, s),
             "upload maps");
    KVCAP_CUDA_TRY(cudaMemcpyAsync(w2, k->w2, h * m * sizeof(float), cudaMemcpyHostToDevice, s),
             "upload maps");
    KVCAP_CUDA_TRY(cudaMemcpyAsync(b2, k->b2, m * sizeof(float), cudaMemcpyHostToDevice, s),
             "upload maps");
    KVCAP_CUDA_TRY(cudaMemcpyAsync(g->eval_rows, k->mask, rk * sizeof(int32_t), cudaMemcpyHostToDevice,
                             s),
             "upload maps");
    return score(g, g->eval, g->eval_rows, k->rk, k->gelu != 0, on_val, mse);
}
