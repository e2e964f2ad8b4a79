// gram.cu — the CUDA side of calibration (calibrate/calib_cuda.h): Gram accumulation with cuBLAS
// DSYRK on device-resident double Grams fed by pinned, double-buffered batches; batched symmetric
// eigen-decompositions with cuSOLVER; and the ceilings the benchmark compares them with.
//
// Layout: the host code is row-major, cuBLAS and cuSOLVER are column-major. A row-major m x c
// batch A (row p = point p, one column per sample channel) copied with pitch c is, read
// column-major, the c x m matrix X = Aᵀ, so A Aᵀ = Xᵀ X is DSYRK with trans = T. The row-major
// upper triangle (row p <= col q, at p·m + q) is the column-major lower triangle, so the device
// fills CUBLAS_FILL_MODE_LOWER and the host sees exactly the triangle the CPU path fills.
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

extern "C" {
#include "calibrate/calib_cuda.h"
#include "common/internal.h"
}
#include "kernels/cuda/common.cuh"

// ---- Errors ------------------------------------------------------------------------------------

static const char *cusolver_status_name(cusolverStatus_t e)
{
    switch (e) {
    case CUSOLVER_STATUS_NOT_INITIALIZED: return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED: return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE: return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH: return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_EXECUTION_FAILED: return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR: return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_NOT_SUPPORTED: return "CUSOLVER_STATUS_NOT_SUPPORTED";
    case CUSOLVER_STATUS_INVALID_WORKSPACE: return "CUSOLVER_STATUS_INVALID_WORKSPACE";
    default: return "cuSOLVER error";
    }
}

static enum kvcap_status cusolver_error(cusolverStatus_t e, const char *stmt, const char *what,
                                        const char *file, int line)
{
    char error[64];
    snprintf(error, sizeof error, "%s (%d)", cusolver_status_name(e), (int)e);
    return kvcap_cuda_report(e == CUSOLVER_STATUS_ALLOC_FAILED, stmt, what, error, file, line);
}

// KVCAP_CUDA_TRY and KVCAP_CUBLAS_TRY are in kernels/cuda/common.cuh; this one is used here only.
#define CUSOLVER_TRY(stmt, what)                                                    \
    do {                                                                            \
        cusolverStatus_t e_ = (stmt);                                               \
        if (e_ != CUSOLVER_STATUS_SUCCESS)                                          \
            return cusolver_error(e_, #stmt, (what), __FILE__, __LINE__);           \
    } while (0)

static const double ONE = 1.0, ZERO = 0.0;

static double mib(size_t bytes)
{
    return (double)bytes / (1024.0 * 1024.0);
}

extern "C" int kvcap_calib_cuda_built(void)
{
    return 1;
}

extern "C" enum kvcap_status kvcap_calib_cuda_device_name(char *buf, size_t cap)
{
    int dev = 0;
    cudaDeviceProp prop;
    KVCAP_CUDA_TRY(cudaGetDevice(&dev), "device name");
    KVCAP_CUDA_TRY(cudaGetDeviceProperties(&prop, dev), "device name");
    snprintf(buf, cap, "%s", prop.name);
    return KVCAP_OK;
}

// cuBLAS computes doubles in IEEE FP64 unless a handle opts into fixed-point emulation; the
// Grams must match the CPU path to rounding, so the mode is set explicitly.
static enum kvcap_status blas_create(cublasHandle_t *h, cudaStream_t stream, const char *what)
{
    KVCAP_CUBLAS_TRY(cublasCreate(h), what);
    KVCAP_CUBLAS_TRY(cublasSetStream(*h, stream), what);
    KVCAP_CUBLAS_TRY(cublasSetMathMode(*h, CUBLAS_DEFAULT_MATH), what);
    return KVCAP_OK;
}

// ---- Gram accumulation ---------------------------------------------------------------------

// One of a lane's two device staging buffers. `copied` is recorded on the copy stream after
// the uploads into it, `consumed` on the compute stream after the products that read it.
struct slot {
    double *dk, *dv;
    cudaEvent_t copied, consumed;
};

struct lane {
    cudaStream_t copy, compute;
    cublasHandle_t blas;
    struct slot slot[2];
    int next;
};

struct kvcap_calib_cuda_gram {
    size_t n_units;
    int *m;
    size_t *cap;
    double **k_host, **v_host; // the caller's Grams: initial contents and results
    size_t *gram_off;          // unit i: K Gram at dgrams + gram_off[i], V Gram right after
    size_t *batch_off;         // unit i: kbuf at pinned + batch_off[i], vbuf right after
    double *dgrams;            // device: every unit's two Grams
    double *pinned;            // host, page-locked: every unit's two batch buffers
    cudaEvent_t *unit_done;    // [n_units] after the unit's last product (orders lanes)
    int lanes;
    struct lane *lane;
};

// Device memory kept free beyond the computed need: cuBLAS workspaces per handle and the
// allocator's rounding.
#define BLAS_RESERVE_PER_LANE ((size_t)64 << 20)
#define HEADROOM ((size_t)256 << 20)

extern "C" void kvcap_calib_cuda_gram_free(struct kvcap_calib_cuda_gram *g)
{
    if (!g)
        return;
    // Errors are ignored here: this runs on failure paths too, and frees what exists.
    for (int l = 0; g->lane && l < g->lanes; l++) {
        struct lane *ln = &g->lane[l];
        if (ln->copy)
            cudaStreamSynchronize(ln->copy);
        if (ln->compute)
            cudaStreamSynchronize(ln->compute);
        for (int s = 0; s < 2; s++) {
            cudaFree(ln->slot[s].dk);
            cudaFree(ln->slot[s].dv);
            if (ln->slot[s].copied)
                cudaEventDestroy(ln->slot[s].copied);
            if (ln->slot[s].consumed)
                cudaEventDestroy(ln->slot[s].consumed);
        }
        if (ln->blas)
            cublasDestroy(ln->blas);
        if (ln->copy)
            cudaStreamDestroy(ln->copy);
        if (ln->compute)
            cudaStreamDestroy(ln->compute);
    }
    for (size_t i = 0; g->unit_done && i < g->n_units; i++)
        if (g->unit_done[i])
            cudaEventDestroy(g->unit_done[i]);
    cudaFree(g->dgrams);
    if (g->pinned)
        cudaFreeHost(g->pinned);
    (void)cudaGetLastError();
    free(g->lane);
    free(g->unit_done);
    free(g->m);
    free(g->cap);
    free(g->k_host);
    free(g->v_host);
    free(g->gram_off);
    free(g->batch_off);
    free(g);
}

static enum kvcap_status gram_setup(struct kvcap_calib_cuda_gram *g,
                                    const struct kvcap_calib_cuda_gram_params *p)
{
    size_t n = p->n_units, grams = 0, batches = 0, slot = 0;
    for (size_t i = 0; i < n; i++) {
        KVCAP_RETURN_IF(p->m[i] < 1 || p->cap[i] < 1 || !p->k_gram[i] || !p->v_gram[i],
                        KVCAP_ERR_INVALID_ARGUMENT, "cuda Grams: unit %zu: m %d, cap %zu", i,
                        p->m[i], p->cap[i]);
        size_t m = (size_t)p->m[i], mm, mc;
        KVCAP_RETURN_IF(!kvcap_mul_size(m, m, &mm) || !kvcap_mul_size(m, p->cap[i], &mc) ||
                            !kvcap_mul_size(mm, 2, &mm) || !kvcap_mul_size(mc, 2, &mc),
                        KVCAP_ERR_INVALID_ARGUMENT, "cuda Grams: unit %zu: sizes overflow", i);
        g->m[i] = p->m[i];
        g->cap[i] = p->cap[i];
        g->k_host[i] = p->k_gram[i];
        g->v_host[i] = p->v_gram[i];
        g->gram_off[i] = grams;
        g->batch_off[i] = batches;
        KVCAP_RETURN_IF(!kvcap_add_size(grams, mm, &grams) ||
                            !kvcap_add_size(batches, mc, &batches),
                        KVCAP_ERR_INVALID_ARGUMENT, "cuda Grams: total size overflows");
        slot = mc / 2 > slot ? mc / 2 : slot;
    }
    size_t gram_bytes, batch_bytes, slot_bytes, need;
    KVCAP_RETURN_IF(!kvcap_mul_size(grams, sizeof(double), &gram_bytes) ||
                        !kvcap_mul_size(batches, sizeof(double), &batch_bytes) ||
                        !kvcap_mul_size(slot, 4 * sizeof(double), &slot_bytes) ||
                        !kvcap_mul_size(slot_bytes + BLAS_RESERVE_PER_LANE, (size_t)p->lanes,
                                        &need) ||
                        !kvcap_add_size(need, gram_bytes, &need),
                    KVCAP_ERR_INVALID_ARGUMENT, "cuda Grams: total size overflows");

    size_t free_b = 0, total_b = 0;
    KVCAP_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b), "device memory for the Grams");
    KVCAP_RETURN_IF(need + HEADROOM > free_b, KVCAP_ERR_OUT_OF_MEMORY,
                    "cuda: the Grams of %zu units need %.0f MiB of device memory (%.0f MiB of "
                    "K and V Grams kept resident, %.0f MiB of staging and cuBLAS reserve for %d "
                    "lanes) plus %.0f MiB headroom, but only %.0f of %.0f MiB are free; calibrate "
                    "on the CPU (device cpu) or with fewer buckets per run",
                    n, mib(need), mib(gram_bytes), mib(need - gram_bytes), p->lanes,
                    mib(HEADROOM), mib(free_b), mib(total_b));

    KVCAP_CUDA_TRY(cudaMalloc((void **)&g->dgrams, gram_bytes), "device Grams");
    KVCAP_CUDA_TRY(cudaMallocHost((void **)&g->pinned, batch_bytes), "pinned Gram batches");
    for (size_t i = 0; i < n; i++) {
        size_t mm = (size_t)g->m[i] * (size_t)g->m[i];
        KVCAP_CUDA_TRY(cudaEventCreateWithFlags(&g->unit_done[i], cudaEventDisableTiming),
                 "Gram unit event");
        // Pageable-source copies may return before the DMA lands; the device-wide
        // synchronisation below orders them before any product.
        KVCAP_CUDA_TRY(cudaMemcpy(g->dgrams + g->gram_off[i], g->k_host[i], mm * sizeof(double),
                            cudaMemcpyHostToDevice),
                 "upload K Gram");
        KVCAP_CUDA_TRY(cudaMemcpy(g->dgrams + g->gram_off[i] + mm, g->v_host[i], mm * sizeof(double),
                            cudaMemcpyHostToDevice),
                 "upload V Gram");
    }
    for (int l = 0; l < p->lanes; l++) {
        struct lane *ln = &g->lane[l];
        KVCAP_CUDA_TRY(cudaStreamCreateWithFlags(&ln->copy, cudaStreamNonBlocking), "copy stream");
        KVCAP_CUDA_TRY(cudaStreamCreateWithFlags(&ln->compute, cudaStreamNonBlocking),
                 "compute stream");
        KVCAP_TRY(blas_create(&ln->blas, ln->compute, "Gram lane handle"));
        for (int s = 0; s < 2; s++) {
            KVCAP_CUDA_TRY(cudaMalloc((void **)&ln->slot[s].dk, slot * sizeof(double)),
                     "device batch slot");
            KVCAP_CUDA_TRY(cudaMalloc((void **)&ln->slot[s].dv, slot * sizeof(double)),
                     "device batch slot");
            KVCAP_CUDA_TRY(cudaEventCreateWithFlags(&ln->slot[s].copied, cudaEventDisableTiming),
                     "batch slot event");
            KVCAP_CUDA_TRY(cudaEventCreateWithFlags(&ln->slot[s].consumed, cudaEventDisableTiming),
                     "batch slot event");
        }
    }
    KVCAP_CUDA_TRY(cudaDeviceSynchronize(), "upload Grams");
    return KVCAP_OK;
}

extern "C" enum kvcap_status
kvcap_calib_cuda_gram_create(const struct kvcap_calib_cuda_gram_params *p,
                             struct kvcap_calib_cuda_gram **out)
{
    KVCAP_RETURN_IF(!p || !out || p->n_units < 1 || p->lanes < 1 || !p->m || !p->cap ||
                        !p->k_gram || !p->v_gram,
                    KVCAP_ERR_INVALID_ARGUMENT, "cuda Grams: bad parameters");
    *out = NULL;
    struct kvcap_calib_cuda_gram *g = (struct kvcap_calib_cuda_gram *)calloc(1, sizeof *g);
    KVCAP_RETURN_IF(!g, KVCAP_ERR_OUT_OF_MEMORY, "cuda Grams: out of memory");
    size_t n = p->n_units;
    g->n_units = n;
    g->lanes = p->lanes;
    g->m = (int *)calloc(n, sizeof *g->m);
    g->cap = (size_t *)calloc(n, sizeof *g->cap);
    g->k_host = (double **)calloc(n, sizeof *g->k_host);
    g->v_host = (double **)calloc(n, sizeof *g->v_host);
    g->gram_off = (size_t *)calloc(n, sizeof *g->gram_off);
    g->batch_off = (size_t *)calloc(n, sizeof *g->batch_off);
    g->unit_done = (cudaEvent_t *)calloc(n, sizeof *g->unit_done);
    g->lane = (struct lane *)calloc((size_t)p->lanes, sizeof *g->lane);
    enum kvcap_status st = KVCAP_OK;
    if (!g->m || !g->cap || !g->k_host || !g->v_host || !g->gram_off || !g->batch_off ||
        !g->unit_done || !g->lane)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "cuda Grams: out of memory (%zu units)", n);
    if (st == KVCAP_OK)
        st = gram_setup(g, p);
    if (st != KVCAP_OK) {
        kvcap_calib_cuda_gram_free(g);
        return st;
    }
    *out = g;
    return KVCAP_OK;
}

extern "C" void kvcap_calib_cuda_gram_buffers(struct kvcap_calib_cuda_gram *g, size_t unit,
                                              double **kbuf, double **vbuf)
{
    double *k = g->pinned + g->batch_off[unit];
    *kbuf = k;
    *vbuf = k + (size_t)g->m[unit] * g->cap[unit];
}

extern "C" enum kvcap_status kvcap_calib_cuda_gram_flush(struct kvcap_calib_cuda_gram *g, int lane,
                                                         size_t unit, size_t cols)
{
    KVCAP_RETURN_IF(lane < 0 || lane >= g->lanes || unit >= g->n_units || cols > g->cap[unit],
                    KVCAP_ERR_INTERNAL, "cuda Grams: flush of unit %zu (%zu columns) on lane %d",
                    unit, cols, lane);
    if (cols == 0)
        return KVCAP_OK;
    struct lane *ln = &g->lane[lane];
    struct slot *s = &ln->slot[ln->next];
    ln->next ^= 1;
    int m = g->m[unit];
    size_t mm = (size_t)m * (size_t)m, pitch = g->cap[unit] * sizeof(double);
    size_t width = cols * sizeof(double);
    double *kbuf, *vbuf;
    kvcap_calib_cuda_gram_buffers(g, unit, &kbuf, &vbuf);
    double *dk_gram = g->dgrams + g->gram_off[unit], *dv_gram = dk_gram + mm;

    // The slot's device buffers are free once the products that read them last are done.
    KVCAP_CUDA_TRY(cudaStreamWaitEvent(ln->copy, s->consumed, 0), "gram batch");
    // The first `cols` columns of each of the m rows, packed with pitch cols (X = Aᵀ, ld cols).
    KVCAP_CUDA_TRY(cudaMemcpy2DAsync(s->dk, width, kbuf, pitch, width, (size_t)m,
                               cudaMemcpyHostToDevice, ln->copy),
             "gram batch K");
    KVCAP_CUDA_TRY(cudaMemcpy2DAsync(s->dv, width, vbuf, pitch, width, (size_t)m,
                               cudaMemcpyHostToDevice, ln->copy),
             "gram batch V");
    KVCAP_CUDA_TRY(cudaEventRecord(s->copied, ln->copy), "gram batch");
    KVCAP_CUDA_TRY(cudaStreamWaitEvent(ln->compute, s->copied, 0), "gram batch");
    // Another lane may have updated this unit last: its product comes first.
    KVCAP_CUDA_TRY(cudaStreamWaitEvent(ln->compute, g->unit_done[unit], 0), "gram batch");
    KVCAP_CUBLAS_TRY(cublasDsyrk(ln->blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_T, m, (int)cols, &ONE,
                           s->dk, (int)cols, &ONE, dk_gram, m),
               "K Gram update");
    KVCAP_CUBLAS_TRY(cublasDsyrk(ln->blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_T, m, (int)cols, &ONE,
                           s->dv, (int)cols, &ONE, dv_gram, m),
               "V Gram update");
    KVCAP_CUDA_TRY(cudaEventRecord(s->consumed, ln->compute), "gram batch");
    KVCAP_CUDA_TRY(cudaEventRecord(g->unit_done[unit], ln->compute), "gram batch");
    // The caller refills kbuf/vbuf next: wait for the uploads only (the product runs on).
    KVCAP_CUDA_TRY(cudaEventSynchronize(s->copied), "gram batch");
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_calib_cuda_gram_finish(struct kvcap_calib_cuda_gram *g)
{
    for (int l = 0; l < g->lanes; l++) {
        KVCAP_CUDA_TRY(cudaStreamSynchronize(g->lane[l].copy), "finish Grams");
        KVCAP_CUDA_TRY(cudaStreamSynchronize(g->lane[l].compute), "finish Grams");
    }
    for (size_t i = 0; i < g->n_units; i++) {
        size_t mm = (size_t)g->m[i] * (size_t)g->m[i];
        const double *dk = g->dgrams + g->gram_off[i];
        KVCAP_CUDA_TRY(cudaMemcpy(g->k_host[i], dk, mm * sizeof(double), cudaMemcpyDeviceToHost),
                 "download K Gram");
        KVCAP_CUDA_TRY(cudaMemcpy(g->v_host[i], dk + mm, mm * sizeof(double), cudaMemcpyDeviceToHost),
                 "download V Gram");
    }
    return KVCAP_OK;
}

// ---- Eigen-decompositions ------------------------------------------------------------------
//
// cusolverDnXsyevd (the 64-bit generic API) rather than cusolverDnDsyevd: its workspace is
// sized in bytes as size_t, where the legacy API's int lwork (2n² + ... doubles) overflows
// for n above ~30000, the same class of failure DESIGN §4 records for LAPACKE_ssyevd's
// workspace query; and it is the interface cuSOLVER keeps extending.

struct kvcap_calib_cuda_eigen {
    int n_max;
    cudaStream_t stream;
    cusolverDnHandle_t solver;
    cusolverDnParams_t params;
    cublasHandle_t blas; // the transpose to the CPU contract (cublasDgeam)
    double *d_a, *d_t, *d_w;
    int *d_info;
    void *d_work, *h_work;
    size_t d_work_bytes, h_work_bytes;
    double *pinned;       // h_a[2], h_w[2], then h_info[2]
    double *h_a[2], *h_w[2];
    int *h_info;
    cudaEvent_t ready[2]; // results of the matrix in slot s are on the host
};

extern "C" void kvcap_calib_cuda_eigen_free(struct kvcap_calib_cuda_eigen *e)
{
    if (!e)
        return;
    if (e->stream)
        cudaStreamSynchronize(e->stream);
    for (int s = 0; s < 2; s++)
        if (e->ready[s])
            cudaEventDestroy(e->ready[s]);
    if (e->params)
        cusolverDnDestroyParams(e->params);
    if (e->solver)
        cusolverDnDestroy(e->solver);
    if (e->blas)
        cublasDestroy(e->blas);
    cudaFree(e->d_a);
    cudaFree(e->d_t);
    cudaFree(e->d_w);
    cudaFree(e->d_info);
    cudaFree(e->d_work);
    if (e->pinned)
        cudaFreeHost(e->pinned);
    if (e->stream)
        cudaStreamDestroy(e->stream);
    (void)cudaGetLastError();
    free(e->h_work);
    free(e);
}

// Grows the workspaces to what Xsyevd needs for order n (queried per size: the need is not
// documented as monotone in n).
static enum kvcap_status eigen_workspace(struct kvcap_calib_cuda_eigen *e, int n)
{
    size_t d_bytes = 0, h_bytes = 0;
    CUSOLVER_TRY(cusolverDnXsyevd_bufferSize(e->solver, e->params, CUSOLVER_EIG_MODE_VECTOR,
                                             CUBLAS_FILL_MODE_LOWER, n, CUDA_R_64F, e->d_a, n,
                                             CUDA_R_64F, e->d_w, CUDA_R_64F, &d_bytes, &h_bytes),
                 "eigen workspace size");
    if (d_bytes > e->d_work_bytes) {
        KVCAP_CUDA_TRY(cudaStreamSynchronize(e->stream), "eigen workspace");
        KVCAP_CUDA_TRY(cudaFree(e->d_work), "eigen workspace");
        e->d_work = NULL;
        e->d_work_bytes = 0;
        KVCAP_CUDA_TRY(cudaMalloc(&e->d_work, d_bytes), "eigen workspace");
        e->d_work_bytes = d_bytes;
    }
    if (h_bytes > e->h_work_bytes) {
        KVCAP_CUDA_TRY(cudaStreamSynchronize(e->stream), "eigen workspace");
        free(e->h_work);
        e->h_work = malloc(h_bytes);
        e->h_work_bytes = e->h_work ? h_bytes : 0;
        KVCAP_RETURN_IF(!e->h_work, KVCAP_ERR_OUT_OF_MEMORY,
                        "cuda eigen: out of memory for %zu bytes of host workspace", h_bytes);
    }
    return KVCAP_OK;
}

static enum kvcap_status eigen_setup(struct kvcap_calib_cuda_eigen *e, int n)
{
    size_t nn = (size_t)n * (size_t)n;
    KVCAP_CUDA_TRY(cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking), "eigen stream");
    CUSOLVER_TRY(cusolverDnCreate(&e->solver), "eigen handle");
    CUSOLVER_TRY(cusolverDnSetStream(e->solver, e->stream), "eigen handle");
    // Reproducible runs: the same Gram gives the same basis, run after run.
    CUSOLVER_TRY(cusolverDnSetDeterministicMode(e->solver, CUSOLVER_DETERMINISTIC_RESULTS),
                 "eigen handle");
    CUSOLVER_TRY(cusolverDnCreateParams(&e->params), "eigen handle");
    KVCAP_TRY(blas_create(&e->blas, e->stream, "eigen transpose handle"));
    KVCAP_CUDA_TRY(cudaMalloc((void **)&e->d_a, nn * sizeof(double)), "eigen matrix");
    KVCAP_CUDA_TRY(cudaMalloc((void **)&e->d_t, nn * sizeof(double)), "eigen vectors");
    KVCAP_CUDA_TRY(cudaMalloc((void **)&e->d_w, (size_t)n * sizeof(double)), "eigen values");
    KVCAP_CUDA_TRY(cudaMalloc((void **)&e->d_info, sizeof(int)), "eigen info");
    // Pinned: two slots of (matrix, eigenvalues), then two info words.
    size_t per = nn + (size_t)n;
    KVCAP_CUDA_TRY(cudaMallocHost((void **)&e->pinned, (2 * per + 1) * sizeof(double)),
             "pinned eigen staging");
    for (int s = 0; s < 2; s++) {
        e->h_a[s] = e->pinned + (size_t)s * per;
        e->h_w[s] = e->h_a[s] + nn;
        KVCAP_CUDA_TRY(cudaEventCreateWithFlags(&e->ready[s], cudaEventDisableTiming), "eigen event");
    }
    e->h_info = (int *)(e->pinned + 2 * per);
    return eigen_workspace(e, n);
}

extern "C" enum kvcap_status kvcap_calib_cuda_eigen_create(int n_max,
                                                           struct kvcap_calib_cuda_eigen **out)
{
    KVCAP_RETURN_IF(n_max < 1 || !out, KVCAP_ERR_INVALID_ARGUMENT, "cuda eigen: n_max %d", n_max);
    *out = NULL;
    struct kvcap_calib_cuda_eigen *e = (struct kvcap_calib_cuda_eigen *)calloc(1, sizeof *e);
    KVCAP_RETURN_IF(!e, KVCAP_ERR_OUT_OF_MEMORY, "cuda eigen: out of memory");
    e->n_max = n_max;
    enum kvcap_status st = eigen_setup(e, n_max);
    if (st != KVCAP_OK) {
        kvcap_calib_cuda_eigen_free(e);
        return st;
    }
    *out = e;
    return KVCAP_OK;
}

// Enqueues matrix `a` (n x n, full symmetric) into slot s: upload, solve, transpose, download.
static enum kvcap_status eigen_enqueue(struct kvcap_calib_cuda_eigen *e, int s, const double *a,
                                       int n)
{
    size_t nn = (size_t)n * (size_t)n;
    KVCAP_TRY(eigen_workspace(e, n));
    // Symmetric: the row-major matrix read column-major is itself.
    memcpy(e->h_a[s], a, nn * sizeof(double));
    KVCAP_CUDA_TRY(cudaMemcpyAsync(e->d_a, e->h_a[s], nn * sizeof(double), cudaMemcpyHostToDevice,
                             e->stream),
             "upload Gram for eigen");
    // Lower in column-major is the CPU path's 'U' in row-major: the same triangle is read.
    CUSOLVER_TRY(cusolverDnXsyevd(e->solver, e->params, CUSOLVER_EIG_MODE_VECTOR,
                                  CUBLAS_FILL_MODE_LOWER, n, CUDA_R_64F, e->d_a, n, CUDA_R_64F,
                                  e->d_w, CUDA_R_64F, e->d_work, e->d_work_bytes, e->h_work,
                                  e->h_work_bytes, e->d_info),
                 "eigen-decomposition");
    // Column j of d_a (column-major) is eigenvector j, i.e. ROW j read row-major; the CPU
    // contract wants it in column j of the row-major matrix: d_t = d_aᵀ. (B = d_a is not read
    // with beta = 0 but must be a valid matrix; C does not overlap A, so this is out of place.)
    KVCAP_CUBLAS_TRY(cublasDgeam(e->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, n, &ONE, e->d_a, n, &ZERO,
                           e->d_a, n, e->d_t, n),
               "eigenvector transpose");
    KVCAP_CUDA_TRY(cudaMemcpyAsync(e->h_a[s], e->d_t, nn * sizeof(double), cudaMemcpyDeviceToHost,
                             e->stream),
             "download eigenvectors");
    KVCAP_CUDA_TRY(cudaMemcpyAsync(e->h_w[s], e->d_w, (size_t)n * sizeof(double),
                             cudaMemcpyDeviceToHost, e->stream),
             "download eigenvalues");
    KVCAP_CUDA_TRY(cudaMemcpyAsync(&e->h_info[s], e->d_info, sizeof(int), cudaMemcpyDeviceToHost,
                             e->stream),
             "download eigen info");
    KVCAP_CUDA_TRY(cudaEventRecord(e->ready[s], e->stream), "eigen event");
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_calib_cuda_dsyevd_batch(
    struct kvcap_calib_cuda_eigen *e, int count, const double *const *mats, const int *n,
    enum kvcap_status (*consume)(int, const double *, const double *, void *), void *user,
    int *failed)
{
    if (failed)
        *failed = -1;
    KVCAP_RETURN_IF(!e || count < 0 || (count > 0 && (!mats || !n || !consume)),
                    KVCAP_ERR_INVALID_ARGUMENT, "cuda eigen: bad arguments");
    for (int i = 0; i < count; i++)
        KVCAP_RETURN_IF(n[i] < 1 || n[i] > e->n_max || !mats[i], KVCAP_ERR_INVALID_ARGUMENT,
                        "cuda eigen: matrix %d: n %d (at most %d)", i, n[i], e->n_max);
    // Matrix i is enqueued before the host consumes matrix i-1, so the device solves one
    // while the host post-processes the other; slot i % 2 is free again once i-2 is consumed.
    enum kvcap_status st = KVCAP_OK;
    for (int i = 0; i <= count && st == KVCAP_OK; i++) {
        if (i < count && (st = eigen_enqueue(e, i & 1, mats[i], n[i])) != KVCAP_OK) {
            if (failed)
                *failed = i;
            break;
        }
        if (i == 0)
            continue;
        int j = i - 1, s = j & 1;
        cudaError_t ce = cudaEventSynchronize(e->ready[s]);
        if (ce != cudaSuccess) {
            st = kvcap_cuda_fail(ce, "cudaEventSynchronize", "eigen results", __FILE__, __LINE__);
        } else if (e->h_info[s] != 0) {
            st = kvcap_fail(e->h_info[s] > 0 ? KVCAP_ERR_NUMERIC : KVCAP_ERR_INTERNAL,
                            "dsyevd (cuSOLVER): eigen-decomposition of a %dx%d Gram failed "
                            "(info %d)",
                            n[j], n[j], e->h_info[s]);
        } else {
            st = consume(j, e->h_a[s], e->h_w[s], user);
        }
        if (st != KVCAP_OK && failed)
            *failed = j;
    }
    // Leave no work in flight on failure (the staging may be reused or freed next).
    if (st != KVCAP_OK) {
        cudaStreamSynchronize(e->stream);
        (void)cudaGetLastError();
    }
    return st;
}

// ---- Ceilings for the benchmark ------------------------------------------------------------

struct peak_bufs {
    cudaStream_t stream;
    cublasHandle_t blas;
    cudaEvent_t t0, t1;
    double *a, *b, *c, *host;
};

static void peak_free(struct peak_bufs *p)
{
    if (p->stream)
        cudaStreamSynchronize(p->stream);
    if (p->blas)
        cublasDestroy(p->blas);
    if (p->t0)
        cudaEventDestroy(p->t0);
    if (p->t1)
        cudaEventDestroy(p->t1);
    cudaFree(p->a);
    cudaFree(p->b);
    cudaFree(p->c);
    if (p->host)
        cudaFreeHost(p->host);
    if (p->stream)
        cudaStreamDestroy(p->stream);
    (void)cudaGetLastError();
}

// Milliseconds between the two events (both recorded on the stream).
static enum kvcap_status elapsed_ms(struct peak_bufs *p, float *ms)
{
    KVCAP_CUDA_TRY(cudaEventSynchronize(p->t1), "peak timing");
    KVCAP_CUDA_TRY(cudaEventElapsedTime(ms, p->t0, p->t1), "peak timing");
    return KVCAP_OK;
}

static enum kvcap_status peak_run(struct peak_bufs *p, int m, struct kvcap_calib_cuda_peak *out)
{
    enum { KMAX = 4096, REPS = 10 };
    size_t mk = (size_t)m * KMAX, mm = (size_t)m * m;
    size_t host_n = mk > mm ? mk : mm;
    KVCAP_CUDA_TRY(cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking), "peak stream");
    KVCAP_TRY(blas_create(&p->blas, p->stream, "peak handle"));
    KVCAP_CUDA_TRY(cudaEventCreate(&p->t0), "peak timing");
    KVCAP_CUDA_TRY(cudaEventCreate(&p->t1), "peak timing");
    KVCAP_CUDA_TRY(cudaMalloc((void **)&p->a, mk * sizeof(double)), "peak operands");
    KVCAP_CUDA_TRY(cudaMalloc((void **)&p->b, mm * sizeof(double)), "peak operands");
    KVCAP_CUDA_TRY(cudaMalloc((void **)&p->c, mm * sizeof(double)), "peak operands");
    KVCAP_CUDA_TRY(cudaMallocHost((void **)&p->host, host_n * sizeof(double)), "peak staging");
    uint64_t x = 0x9e3779b97f4a7c15ull; // non-zero operands: zeros would flatter the clocks
    for (size_t i = 0; i < host_n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p->host[i] = (double)(x >> 11) * 0x1.0p-53 - 0.5;
    }
    KVCAP_CUDA_TRY(cudaMemcpyAsync(p->a, p->host, mk * sizeof(double), cudaMemcpyHostToDevice,
                             p->stream),
             "peak operands");
    KVCAP_CUDA_TRY(cudaMemcpyAsync(p->b, p->host, mm * sizeof(double), cudaMemcpyHostToDevice,
                             p->stream),
             "peak operands");
    KVCAP_CUDA_TRY(cudaMemsetAsync(p->c, 0, mm * sizeof(double), p->stream), "peak operands");
    float ms = 0.0f;
    out->dsyrk_gflops = 0.0;
    for (int k = 256; k <= KMAX; k *= 2) {
        KVCAP_CUBLAS_TRY(cublasDsyrk(p->blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_T, m, k, &ONE, p->a, k,
                               &ONE, p->c, m),
                   "peak DSYRK warm-up");
        KVCAP_CUDA_TRY(cudaEventRecord(p->t0, p->stream), "peak timing");
        for (int r = 0; r < REPS; r++)
            KVCAP_CUBLAS_TRY(cublasDsyrk(p->blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_T, m, k, &ONE, p->a,
                                   k, &ONE, p->c, m),
                       "peak DSYRK");
        KVCAP_CUDA_TRY(cudaEventRecord(p->t1, p->stream), "peak timing");
        KVCAP_TRY(elapsed_ms(p, &ms));
        double rate = REPS * (double)m * (m + 1) * k / (ms * 1e-3) * 1e-9;
        if (ms > 0 && rate > out->dsyrk_gflops)
            out->dsyrk_gflops = rate, out->dsyrk_k = k;
    }
    KVCAP_CUBLAS_TRY(cublasDgemm(p->blas, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, &ONE, p->b, m, p->b, m,
                           &ZERO, p->c, m),
               "peak DGEMM warm-up");
    KVCAP_CUDA_TRY(cudaEventRecord(p->t0, p->stream), "peak timing");
    for (int r = 0; r < REPS; r++)
        KVCAP_CUBLAS_TRY(cublasDgemm(p->blas, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, &ONE, p->b, m, p->b,
                               m, &ZERO, p->c, m),
                   "peak DGEMM");
    KVCAP_CUDA_TRY(cudaEventRecord(p->t1, p->stream), "peak timing");
    KVCAP_TRY(elapsed_ms(p, &ms));
    out->dgemm_gflops = ms > 0 ? REPS * 2.0 * (double)m * m * m / (ms * 1e-3) * 1e-9 : 0.0;
    // Host to device from pinned memory, the path the Gram batches take.
    KVCAP_CUDA_TRY(cudaEventRecord(p->t0, p->stream), "peak timing");
    for (int r = 0; r < REPS; r++)
        KVCAP_CUDA_TRY(cudaMemcpyAsync(p->a, p->host, mk * sizeof(double), cudaMemcpyHostToDevice,
                                 p->stream),
                 "peak host-to-device copy");
    KVCAP_CUDA_TRY(cudaEventRecord(p->t1, p->stream), "peak timing");
    KVCAP_TRY(elapsed_ms(p, &ms));
    out->h2d_gbps = ms > 0 ? REPS * (double)(mk * sizeof(double)) / (ms * 1e-3) * 1e-9 : 0.0;
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_calib_cuda_peak_measure(int m, struct kvcap_calib_cuda_peak *out)
{
    KVCAP_RETURN_IF(m < 1 || !out, KVCAP_ERR_INVALID_ARGUMENT, "cuda peak: m %d", m);
    memset(out, 0, sizeof *out);
    struct peak_bufs p;
    memset(&p, 0, sizeof p);
    enum kvcap_status st = peak_run(&p, m, out);
    peak_free(&p);
    return st;
}
