// flashcache.cu — FlashCache's scoring on a CUDA device (flashcache_cuda.h, DESIGN §5): the
// DCT-II of every K and V column along the tokens through cuFFT, the low-pass Base, per-token
// deviations and per-(layer, head) energies. The top-k that evicts on them is select.cu.
//
// One call scores all B = layers × KV heads pairs of a span: W = 2·B·d real columns of n tokens.
// Launches per call (all layers, up to 128 of them; one more gather and deviation launch per
// further 128 layers):
//   1 gather     K/V (any dtype, strided) → X [n][W] f32, tokens in Makhoul's even/odd order,
//                and Σx² per (pair, 32-token tile)
//   2 cuFFT R2C  X → Z [n/2+1][W] complex, batched over the W columns (istride W, idist 1)
//   3 twiddle    Z[k] → DCT rows k and n−k, their low-band energy, and the inverse's input for
//                the first ω coefficients only (the rest zeroed), in place
//   4 cuFFT C2R  Z → X: the low-pass Base of every column, in Makhoul's order
//   5 deviation  per token and pair: Σ_c (x − base)² / d from the original rows and X, and the
//                pair's energies from the partial sums of 1 and 3 (fixed order: deterministic)
// cuFFT runs each execution as 1–3 kernels of its own depending on n; nothing else is enqueued
// (no memset, no copy). n = 1 skips 2–4.
//
// Expected cost: the pipeline is bandwidth-bound. Per element of K and V (e bytes each) it moves
// about e + 4 (gather) + 8 (R2C) + 4 + 8γ (twiddle) + 8 (C2R) + 4 + e (deviation) = 2e + 28 + 8γ
// bytes (γ = 0.1: ≈ 33 bytes in BF16). 8192 tokens × 28 layers × d = 128 is 58.7 M elements per
// KV head, so ≈ 1.9 GB per KV head of the model: ≈ 0.65 ms per KV head at ~3 TB/s on an H100
// SXM (2 KV heads ≈ 1.3 ms, 4 ≈ 2.6 ms). The 1 ms goal therefore holds up to ~1.5 KV heads ×
// 28 layers at 8K with this design; reaching it for more needs the gather fused into cuFFT's load
// callback and the deviation into the C2R store callback (−16 bytes per element), or a
// shared-memory DCT for power-of-two n with the deviation fused (≈ 2e bytes per element).
// Scratch is ≈ 8·n·W bytes (1.9 GB for 4 KV heads) plus cuFFT's work area.
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include <cufft.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/flashcache_cuda.h"

static const char OP[] = "flashcache";

// ---- cuFFT, loaded on first use ----------------------------------------------------------------
// libkvcap links the static CUDA runtime so that it loads where no CUDA libraries are installed;
// linking libcufft would undo that. It is opened once per process and never closed.

struct cufft_api {
    decltype(&cufftCreate) create;
    decltype(&cufftSetAutoAllocation) set_auto_allocation;
    decltype(&cufftMakePlanMany64) make_plan_many64;
    decltype(&cufftSetWorkArea) set_work_area;
    decltype(&cufftSetStream) set_stream;
    decltype(&cufftExecR2C) exec_r2c;
    decltype(&cufftExecC2R) exec_c2r;
    decltype(&cufftDestroy) destroy;
};

static struct cufft_api g_cufft;
static int g_cufft_loaded;
static char g_cufft_error[512];
static pthread_once_t g_cufft_once = PTHREAD_ONCE_INIT;

template <typename F>
static int resolve(void *lib, const char *name, F *fn)
{
    void *sym = dlsym(lib, name);
    if (!sym) {
        snprintf(g_cufft_error, sizeof g_cufft_error, "libcufft has no symbol %s", name);
        return 0;
    }
    *fn = reinterpret_cast<F>(sym);
    return 1;
}

static void cufft_load(void)
{
    static const char *const names[] = {"libcufft.so.12", "libcufft.so"};
    void *lib = NULL;
    const char *why = "";
    for (size_t i = 0; i < sizeof names / sizeof *names && !lib; i++) {
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            const char *e = dlerror();
            why = e ? e : "";
        }
    }
    if (!lib) {
        snprintf(g_cufft_error, sizeof g_cufft_error,
                 "cannot load libcufft.so.12 or libcufft.so (%s)", why);
        return;
    }
    struct cufft_api api;
    if (!resolve(lib, "cufftCreate", &api.create) ||
        !resolve(lib, "cufftSetAutoAllocation", &api.set_auto_allocation) ||
        !resolve(lib, "cufftMakePlanMany64", &api.make_plan_many64) ||
        !resolve(lib, "cufftSetWorkArea", &api.set_work_area) ||
        !resolve(lib, "cufftSetStream", &api.set_stream) ||
        !resolve(lib, "cufftExecR2C", &api.exec_r2c) ||
        !resolve(lib, "cufftExecC2R", &api.exec_c2r) ||
        !resolve(lib, "cufftDestroy", &api.destroy)) {
        dlclose(lib);
        return;
    }
    g_cufft = api;
    g_cufft_loaded = 1;
}

static enum kvcap_status cufft_available(void)
{
    pthread_once(&g_cufft_once, cufft_load);
    KVCAP_RETURN_IF(!g_cufft_loaded, KVCAP_ERR_UNSUPPORTED, "cuda %s: %s", OP, g_cufft_error);
    return KVCAP_OK;
}

static const char *cufft_result_name(cufftResult r)
{
    switch (r) {
    case CUFFT_INVALID_PLAN: return "CUFFT_INVALID_PLAN";
    case CUFFT_ALLOC_FAILED: return "CUFFT_ALLOC_FAILED";
    case CUFFT_INVALID_TYPE: return "CUFFT_INVALID_TYPE";
    case CUFFT_INVALID_VALUE: return "CUFFT_INVALID_VALUE";
    case CUFFT_INTERNAL_ERROR: return "CUFFT_INTERNAL_ERROR";
    case CUFFT_EXEC_FAILED: return "CUFFT_EXEC_FAILED";
    case CUFFT_SETUP_FAILED: return "CUFFT_SETUP_FAILED";
    case CUFFT_INVALID_SIZE: return "CUFFT_INVALID_SIZE";
    case CUFFT_UNALIGNED_DATA: return "CUFFT_UNALIGNED_DATA";
    case CUFFT_INVALID_DEVICE: return "CUFFT_INVALID_DEVICE";
    case CUFFT_NO_WORKSPACE: return "CUFFT_NO_WORKSPACE";
    case CUFFT_NOT_IMPLEMENTED: return "CUFFT_NOT_IMPLEMENTED";
    case CUFFT_NOT_SUPPORTED: return "CUFFT_NOT_SUPPORTED";
    default: return "cuFFT error";
    }
}

static enum kvcap_status cufft_fail(cufftResult r, const char *call, const char *file, int line)
{
    return kvcap_fail(r == CUFFT_ALLOC_FAILED ? KVCAP_ERR_OUT_OF_MEMORY : KVCAP_ERR_DEVICE,
                      "cuda %s: %s: error %d (%s) [%s:%d]", OP, call, (int)r, cufft_result_name(r),
                      kvcap_cuda_base_name(file), line);
}

// Evaluates a cuFFT call once; on failure returns a status naming it.
#define CUFFT_TRY(call_name, stmt)                                                                 \
    do {                                                                                           \
        cufftResult r_ = (stmt);                                                                   \
        if (r_ != CUFFT_SUCCESS)                                                                   \
            return cufft_fail(r_, (call_name), __FILE__, __LINE__);                                \
    } while (0)

// ---- Kernels ----------------------------------------------------------------------------------

#define FC_THREADS 256     // gather and deviation blocks: 8 warps
#define FC_TOKENS 32       // tokens per gather / deviation block
#define FC_CHUNK_ROWS 64   // spectral rows per twiddle block (8 row lanes × 8)

// Makhoul's order: even tokens ascending, then odd tokens descending; token j sits at position
// perm(j) of the sequence whose DFT gives the DCT (kernels/dct.c uses the same).
__device__ __forceinline__ int makhoul_pos(int n, int j)
{
    return (j & 1) ? n - 1 - j / 2 : j / 2;
}

// Block (tile, pair): the pair's FC_TOKENS tokens from blockIdx.x·FC_TOKENS, all 2d channels
// (K then V), converted to f32 into row makhoul_pos(j) of X, columns b·2d .. b·2d + 2d; the
// block's Σk², Σv² go to tot_part[(b·tiles + tile)·2 + {0, 1}].
template <typename T>
__global__ void __launch_bounds__(FC_THREADS)
    fc_gather(kvcap_cuda_layer_ptrs ptrs, int layer0, int H, int n, int d, size_t row_stride,
              size_t head_stride, int tiles, size_t W, float *__restrict__ X,
              double *__restrict__ tot_part)
{
    const int bl = blockIdx.y, l = bl / H, h = bl - l * H;
    const size_t b = (size_t)(layer0 + l) * H + h;
    const T *K = (const T *)ptrs.a[l] + (size_t)h * head_stride;
    const T *V = (const T *)ptrs.b[l] + (size_t)h * head_stride;
    const int two_d = 2 * d, j0 = blockIdx.x * FC_TOKENS;
    const int count = min(FC_TOKENS, n - j0) * two_d;
    float *Xb = X + b * two_d;
    double s[2] = {0.0, 0.0};
    for (int e = threadIdx.x; e < count; e += blockDim.x) {
        const int jj = e / two_d, c = e - jj * two_d, j = j0 + jj;
        const int is_v = c >= d;
        const T *row = (is_v ? V : K) + (size_t)j * row_stride;
        const float x = kvcap_cuda_load(row + (c - is_v * d));
        Xb[(size_t)makhoul_pos(n, j) * W + c] = x;
        if (is_v)
            s[1] += (double)x * x;
        else
            s[0] += (double)x * x;
    }
    kvcap_block_sum(s);
    if (threadIdx.x == 0) {
        tot_part[(b * tiles + blockIdx.x) * 2] = s[0];
        tot_part[(b * tiles + blockIdx.x) * 2 + 1] = s[1];
    }
}

// Block (32 columns, rows k0 .. k0 + chunk_rows of the half spectrum), 32 × 8 threads.
// With θ = πk/2n and z = Z[k] the DFT of one column in Makhoul's order, the unnormalised DCT is
//   X[k] = Re(e^{−iθ} z) = c·zr + s·zi,   X[n−k] = Re(e^{−iπ(n−k)/2n} conj z) = s·zr − c·zi,
// the orthonormal coefficients are s_q·X[q] (s_0² = 1/n, else 2/n), and the inverse of the
// first ω rows is v = IDFT(V) with V[k] = e^{iθ}(X̃[k] − i·X̃[n−k]) (X̃ zero from ω on, X̃[n] = 0):
// cuFFT's C2R sums without the 1/n, so it is folded in here. One thread per (k, column): both
// coefficient rows k and n−k come from Z[k], so each coefficient is met exactly once (k = n/2
// of an even n is both, counted once). Rows whose V is zero are written without being read.
__global__ void __launch_bounds__(256)
    fc_twiddle(float2 *__restrict__ Z, size_t W, int n, int rows, int omega, int chunk_rows,
               double *__restrict__ low_part)
{
    __shared__ double red[8][32];
    const size_t col = (size_t)blockIdx.x * 32 + threadIdx.x;
    const int k0 = blockIdx.y * chunk_rows, k1 = min(k0 + chunk_rows, rows);
    const double inv_n = 1.0 / n, s2 = 2.0 / n;
    double low = 0.0;
    if (col < W)
        for (int k = k0 + threadIdx.y; k < k1; k += 8) {
            float2 *p = Z + (size_t)k * W + col;
            const bool keep_k = k < omega, keep_nk = k >= 1 && n - k < omega;
            if (!keep_k && !keep_nk) {
                *p = make_float2(0.0f, 0.0f);
                continue;
            }
            const float2 z = *p;
            double s, c;
            sincospi((double)k / (2.0 * n), &s, &c);
            const double xk = c * z.x + s * z.y, xnk = s * z.x - c * z.y;
            const double a = keep_k ? xk : 0.0, bn = keep_nk ? xnk : 0.0;
            if (keep_k)
                low += (k == 0 ? inv_n : s2) * xk * xk;
            if (keep_nk && n - k != k)
                low += s2 * xnk * xnk;
            *p = make_float2((float)((c * a + s * bn) * inv_n), (float)((s * a - c * bn) * inv_n));
        }
    red[threadIdx.y][threadIdx.x] = low;
    __syncthreads();
    if (threadIdx.y == 0 && col < W) {
        double t = 0.0;
        for (int i = 0; i < 8; i++)
            t += red[i][threadIdx.x];
        low_part[(size_t)blockIdx.y * W + col] = t;
    }
}

// Block (tile, pair), one warp per token: dev[b·n + j] = Σ_c (x − base_scale·Y)² / d over K
// and V, x read again from the caller's rows, Y = X after the C2R (the Base in Makhoul's order),
// or the gathered rows themselves when n = 1 (base_scale = 1 if ω >= 1, else 0). Block 0 of
// each pair then sums the pair's energy partials into energy[b]; with spectral = 0 (n = 1) the
// low band is all or nothing of the total.
template <typename T>
__global__ void __launch_bounds__(FC_THREADS)
    fc_deviation(kvcap_cuda_layer_ptrs ptrs, int layer0, int H, int n, int d, size_t row_stride,
                 size_t head_stride, int tiles, size_t W, const float *__restrict__ Y,
                 float base_scale, int spectral, int chunks, const double *__restrict__ tot_part,
                 const double *__restrict__ low_part, float *__restrict__ dev,
                 struct kvcap_energy *__restrict__ energy)
{
    const int bl = blockIdx.y, l = bl / H, h = bl - l * H;
    const size_t b = (size_t)(layer0 + l) * H + h;
    const T *K = (const T *)ptrs.a[l] + (size_t)h * head_stride;
    const T *V = (const T *)ptrs.b[l] + (size_t)h * head_stride;
    const int two_d = 2 * d, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j0 = blockIdx.x * FC_TOKENS, j1 = min(j0 + FC_TOKENS, n);
    const float *Yb = Y + b * two_d;
    const float inv_d = 1.0f / (float)d;
    for (int j = j0 + warp; j < j1; j += FC_THREADS / 32) {
        const float *y = Yb + (size_t)makhoul_pos(n, j) * W;
        const T *kr = K + (size_t)j * row_stride, *vr = V + (size_t)j * row_stride;
        float acc = 0.0f;
        for (int c = lane; c < d; c += 32) {
            const float r = kvcap_cuda_load(kr + c) - base_scale * y[c];
            acc = fmaf(r, r, acc);
        }
        for (int c = lane; c < d; c += 32) {
            const float r = kvcap_cuda_load(vr + c) - base_scale * y[d + c];
            acc = fmaf(r, r, acc);
        }
        acc = kvcap_warp_sum(acc);
        if (lane == 0)
            dev[b * n + j] = acc * inv_d;
    }
    if (blockIdx.x != 0)
        return;
    double e[4] = {0.0, 0.0, 0.0, 0.0}; // k_total, v_total, k_low, v_low
    for (int t = threadIdx.x; t < tiles; t += blockDim.x) {
        e[0] += tot_part[(b * tiles + t) * 2];
        e[1] += tot_part[(b * tiles + t) * 2 + 1];
    }
    if (spectral)
        for (int i = threadIdx.x; i < chunks * two_d; i += blockDim.x) {
            const int ch = i / two_d, c = i - ch * two_d;
            const double x = low_part[(size_t)ch * W + b * two_d + c];
            if (c < d)
                e[2] += x;
            else
                e[3] += x;
        }
    kvcap_block_sum(e);
    if (threadIdx.x == 0) {
        struct kvcap_energy out;
        out.k_total = e[0];
        out.v_total = e[1];
        out.k_low = spectral ? e[2] : base_scale * e[0];
        out.v_low = spectral ? e[3] : base_scale * e[1];
        energy[b] = out;
    }
}

// ---- Plan -------------------------------------------------------------------------------------

struct kvcap_cuda_dct {
    int n, d, batch;
    int rows;              // n/2 + 1 spectral rows
    int tiles;             // FC_TOKENS-token tiles
    int chunk_rows, chunks; // twiddle row chunks (gridDim.y <= 65535)
    size_t W;              // 2·batch·d columns
    cufftHandle r2c, c2r;  // CUFFT_PLAN_NULL when n = 1
    // Scratch layout, offsets from the 256-aligned start
    size_t off_x, off_z, off_tot, off_low, off_work, bytes;
};

extern "C" void kvcap_cuda_dct_free(struct kvcap_cuda_dct *p)
{
    if (!p)
        return;
    if (g_cufft_loaded) { // handles exist only once cuFFT is loaded
        if (p->r2c != CUFFT_PLAN_NULL)
            g_cufft.destroy(p->r2c);
        if (p->c2r != CUFFT_PLAN_NULL)
            g_cufft.destroy(p->c2r);
    }
    free(p);
}

// Both cuFFT plans on the columns of X and Z: column t of X is X[t + j·W] for j < n, its half
// spectrum Z[t + k·W] for k <= n/2. Auto-allocation is off so that the work area, shared by
// the two plans (they never run at once), lives in the caller's scratch.
static enum kvcap_status make_plans(struct kvcap_cuda_dct *p, size_t *work)
{
    long long len = p->n, real_embed = p->n, half_embed = p->rows;
    long long W = (long long)p->W;
    size_t w1 = 0, w2 = 0;
    CUFFT_TRY("cufftCreate", g_cufft.create(&p->r2c));
    CUFFT_TRY("cufftSetAutoAllocation", g_cufft.set_auto_allocation(p->r2c, 0));
    CUFFT_TRY("cufftMakePlanMany64", g_cufft.make_plan_many64(p->r2c, 1, &len, &real_embed, W, 1,
                                                              &half_embed, W, 1, CUFFT_R2C, W,
                                                              &w1));
    CUFFT_TRY("cufftCreate", g_cufft.create(&p->c2r));
    CUFFT_TRY("cufftSetAutoAllocation", g_cufft.set_auto_allocation(p->c2r, 0));
    CUFFT_TRY("cufftMakePlanMany64", g_cufft.make_plan_many64(p->c2r, 1, &len, &half_embed, W, 1,
                                                              &real_embed, W, 1, CUFFT_C2R, W,
                                                              &w2));
    *work = w1 > w2 ? w1 : w2;
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_cuda_dct_create(int n, int d, int batch,
                                                   struct kvcap_cuda_dct **out)
{
    const char *fn = "kvcap_cuda_dct_create";
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    *out = NULL;
    KVCAP_RETURN_IF(n < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: n = %d, must be >= 1", fn, n);
    KVCAP_RETURN_IF(d < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: d = %d, must be >= 1", fn, d);
    KVCAP_RETURN_IF(batch < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: batch = %d, must be >= 1", fn,
                    batch);

    struct kvcap_cuda_dct geo;
    memset(&geo, 0, sizeof geo);
    geo.n = n, geo.d = d, geo.batch = batch;
    geo.rows = n / 2 + 1;
    geo.tiles = (n + FC_TOKENS - 1) / FC_TOKENS;
    geo.chunk_rows = FC_CHUNK_ROWS;
    if ((geo.rows + geo.chunk_rows - 1) / geo.chunk_rows > 65535)
        geo.chunk_rows = (geo.rows + 65534) / 65535;
    geo.chunks = (geo.rows + geo.chunk_rows - 1) / geo.chunk_rows;
    geo.r2c = geo.c2r = CUFFT_PLAN_NULL;
    int ok = kvcap_mul_size(2 * (size_t)batch, (size_t)d, &geo.W);
    size_t x_bytes = 0, z_bytes = 0, tot_bytes = 0, low_bytes = 0;
    ok = ok && kvcap_mul_size(geo.W, (size_t)n * sizeof(float), &x_bytes);
    ok = ok && kvcap_mul_size(geo.W, (size_t)geo.rows * sizeof(float2), &z_bytes);
    ok = ok && kvcap_mul_size((size_t)batch * geo.tiles, 2 * sizeof(double), &tot_bytes);
    ok = ok && kvcap_mul_size(geo.W, (size_t)geo.chunks * sizeof(double), &low_bytes);
    ok = ok && geo.W <= (size_t)LLONG_MAX / (size_t)n; // cuFFT's 64-bit layout
    KVCAP_RETURN_IF(!ok, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: n = %d, d = %d, batch = %d: the scratch size overflows", fn, n, d, batch);

    if (n > 1)
        KVCAP_TRY(cufft_available());
    KVCAP_TRY(kvcap_cuda_need_device(OP));
    struct kvcap_cuda_dct *p = (struct kvcap_cuda_dct *)malloc(sizeof *p);
    KVCAP_RETURN_IF(!p, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    *p = geo;
    size_t work = 0;
    if (n > 1) {
        enum kvcap_status st = make_plans(p, &work);
        if (st != KVCAP_OK) {
            kvcap_cuda_dct_free(p);
            return st;
        }
    }
    size_t total = 0;
    p->off_x = kvcap_cuda_reserve(&total, x_bytes, &ok);
    p->off_z = kvcap_cuda_reserve(&total, n > 1 ? z_bytes : 0, &ok);
    p->off_tot = kvcap_cuda_reserve(&total, tot_bytes, &ok);
    p->off_low = kvcap_cuda_reserve(&total, n > 1 ? low_bytes : 0, &ok);
    p->off_work = kvcap_cuda_reserve(&total, work, &ok);
    ok = ok && kvcap_add_size(total, KVCAP_CUDA_SCRATCH_ALIGN, &p->bytes); // for aligning the start
    if (!ok) {
        kvcap_cuda_dct_free(p);
        return kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                          "%s: n = %d, d = %d, batch = %d: the scratch size overflows", fn, n, d,
                          batch);
    }
    *out = p;
    return KVCAP_OK;
}

extern "C" size_t kvcap_cuda_flashcache_scratch_bytes(const struct kvcap_cuda_dct *plan)
{
    return plan ? plan->bytes : 0;
}

// ---- Deviation --------------------------------------------------------------------------------

static enum kvcap_status check_kv(const char *fn, const struct kvcap_cuda_dct *p,
                                  const struct kvcap_cuda_kv *kv)
{
    KVCAP_RETURN_IF(!kv, KVCAP_ERR_INVALID_ARGUMENT, "%s: kv is NULL", fn);
    KVCAP_RETURN_IF(kv->n_layers < 1 || kv->n_heads < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: kv->n_layers = %d and kv->n_heads = %d must be >= 1", fn, kv->n_layers,
                    kv->n_heads);
    KVCAP_RETURN_IF((int64_t)kv->n_layers * kv->n_heads != p->batch, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: kv->n_layers * kv->n_heads = %d * %d, the plan was made for batch = %d",
                    fn, kv->n_layers, kv->n_heads, p->batch);
    KVCAP_RETURN_IF(kv->n_heads > 65535, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: kv->n_heads = %d > 65535", fn, kv->n_heads);
    KVCAP_RETURN_IF(!kvcap_dtype_is_storage(kv->dtype), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: kv->dtype = %s is not F32, F16 or BF16", fn, kvcap_dtype_name(kv->dtype));
    KVCAP_RETURN_IF(kv->row_stride < (size_t)p->d, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: kv->row_stride = %zu is less than d = %d", fn, kv->row_stride, p->d);
    KVCAP_RETURN_IF(!kv->k || !kv->v, KVCAP_ERR_INVALID_ARGUMENT, "%s: kv->%s is NULL", fn,
                    kv->k ? "v" : "k");
    for (int l = 0; l < kv->n_layers; l++)
        KVCAP_RETURN_IF(!kv->k[l] || !kv->v[l], KVCAP_ERR_INVALID_ARGUMENT,
                        "%s: kv->%s[%d] is NULL", fn, kv->k[l] ? "v" : "k", l);
    return KVCAP_OK;
}

// Layers per launch: the pointer table's size, and at most 65535 pairs in gridDim.y.
static int layers_per_launch(int H)
{
    int g = 65535 / H;
    return g < KVCAP_CUDA_LAYERS_PER_LAUNCH ? g : KVCAP_CUDA_LAYERS_PER_LAUNCH;
}

static void fill_ptrs(kvcap_cuda_layer_ptrs *t, const void *const *a, const void *const *b,
                      int layer0, int count)
{
    memset(t, 0, sizeof *t);
    for (int i = 0; i < count; i++) {
        t->a[i] = a[layer0 + i];
        t->b[i] = b[layer0 + i];
    }
}

extern "C" enum kvcap_status kvcap_cuda_flashcache_deviation(struct kvcap_cuda_dct *p,
                                                             const struct kvcap_cuda_kv *kv,
                                                             int omega, float *dev,
                                                             struct kvcap_energy *energy,
                                                             void *scratch, size_t scratch_bytes,
                                                             void *stream)
{
    const char *fn = "kvcap_cuda_flashcache_deviation";
    KVCAP_RETURN_IF(!p, KVCAP_ERR_INVALID_ARGUMENT, "%s: plan is NULL", fn);
    KVCAP_TRY(check_kv(fn, p, kv));
    KVCAP_RETURN_IF(!dev, KVCAP_ERR_INVALID_ARGUMENT, "%s: dev is NULL", fn);
    KVCAP_RETURN_IF(!energy, KVCAP_ERR_INVALID_ARGUMENT, "%s: energy is NULL", fn);
    KVCAP_RETURN_IF(!scratch, KVCAP_ERR_INVALID_ARGUMENT, "%s: scratch is NULL", fn);
    KVCAP_RETURN_IF(scratch_bytes < p->bytes, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: scratch_bytes = %zu, the plan needs %zu", fn, scratch_bytes, p->bytes);
    const int n = p->n, d = p->d, H = kv->n_heads, L = kv->n_layers;
    omega = omega < 0 ? 0 : omega > n ? n : omega;
    const int spectral = n > 1;
    const float base_scale = spectral || omega >= 1 ? 1.0f : 0.0f;

    unsigned char *base = kvcap_cuda_align(scratch);
    float *X = (float *)(base + p->off_x);
    float2 *Z = (float2 *)(base + p->off_z);
    double *tot_part = (double *)(base + p->off_tot);
    double *low_part = (double *)(base + p->off_low);
    void *work = base + p->off_work;
    cudaStream_t s = (cudaStream_t)stream;
    const int group = layers_per_launch(H);
    kvcap_cuda_layer_ptrs ptrs;

    for (int l0 = 0; l0 < L; l0 += group) {
        const int count = L - l0 < group ? L - l0 : group;
        fill_ptrs(&ptrs, kv->k, kv->v, l0, count);
        dim3 grid((unsigned)p->tiles, (unsigned)(count * H));
        KVCAP_CUDA_DTYPE_DISPATCH(kv->dtype, T,
                                  fc_gather<T><<<grid, FC_THREADS, 0, s>>>(
                                      ptrs, l0, H, n, d, kv->row_stride, kv->head_stride,
                                      p->tiles, p->W, X, tot_part));
        KVCAP_CUDA_CHECK_LAUNCH(OP, "gather kernel");
    }
    if (spectral) {
        CUFFT_TRY("cufftSetWorkArea", g_cufft.set_work_area(p->r2c, work));
        CUFFT_TRY("cufftSetStream", g_cufft.set_stream(p->r2c, s));
        CUFFT_TRY("cufftExecR2C", g_cufft.exec_r2c(p->r2c, X, (cufftComplex *)Z));
        dim3 grid((unsigned)((p->W + 31) / 32), (unsigned)p->chunks);
        fc_twiddle<<<grid, dim3(32, 8), 0, s>>>(Z, p->W, n, p->rows, omega, p->chunk_rows,
                                                 low_part);
        KVCAP_CUDA_CHECK_LAUNCH(OP, "twiddle kernel");
        CUFFT_TRY("cufftSetWorkArea", g_cufft.set_work_area(p->c2r, work));
        CUFFT_TRY("cufftSetStream", g_cufft.set_stream(p->c2r, s));
        CUFFT_TRY("cufftExecC2R", g_cufft.exec_c2r(p->c2r, (cufftComplex *)Z, X));
    }
    for (int l0 = 0; l0 < L; l0 += group) {
        const int count = L - l0 < group ? L - l0 : group;
        fill_ptrs(&ptrs, kv->k, kv->v, l0, count);
        dim3 grid((unsigned)p->tiles, (unsigned)(count * H));
        KVCAP_CUDA_DTYPE_DISPATCH(kv->dtype, T,
                                  fc_deviation<T><<<grid, FC_THREADS, 0, s>>>(
                                      ptrs, l0, H, n, d, kv->row_stride, kv->head_stride,
                                      p->tiles, p->W, X, base_scale, spectral, p->chunks,
                                      tot_part, low_part, dev, energy));
        KVCAP_CUDA_CHECK_LAUNCH(OP, "deviation kernel");
    }
    return KVCAP_OK;
}
