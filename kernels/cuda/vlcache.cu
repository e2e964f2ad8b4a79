// vlcache.cu — VL-Cache's scoring on a CUDA device (vlcache_cuda.h, DESIGN §6): the causal
// softmax of the tau·G post-vision query rows of each KV head over the m prompt keys, its
// column sums (token scores) and sparsity counts, for every (layer, KV head) pair in one call.
//
// Like the CPU version (kernels/vlcache.c) it never stores the tau·G × m score matrix: keys go
// through in tiles of 32 and the scores of a tile are computed twice, once per pass.
//   1 pass 1    block (key tile, pair): keys of the tile in shared memory, each warp one query
//               row at a time; the row's max and Σ exp(s − max) over the tile's visible keys →
//               part[pair][row][tile]
//   2 rowstat   one warp per query row merges its tiles' partials (max, 1/Σ) in tile order
//   3 pass 2    the same tiles again: A' = exp(s − max)/Σ summed over the rows into the tile's
//               32 token scores, and the entries with exp(s − max) < p counted (A' < p·rowmax,
//               as the row max of A' is exp(0)/Σ)
//   4 gamma     Σ_h below / Σ_h entries per layer
// Launches: 4 for up to 128 layers (passes 1 and 3 once more per further 128 layers).
// Work: 2·tau·G·m·d multiply-adds per pair, from shared memory; the keys are read from device
// memory twice. Everything is summed in a fixed order and the counts are integers, so the
// results do not depend on scheduling.
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/vlcache_cuda.h"

static const char OP[] = "vlcache";

#define VL_KEYS 32      // keys per tile: one per lane
#define VL_WARPS 8      // query rows in flight per block
#define VL_THREADS (32 * VL_WARPS)
#define VL_MAX_D 256    // keys [32][d+1] and queries [8][d] f32 stay under 48 KiB of shared memory

// Causality: query row r = i·G + g belongs to post-vision token i = r / G, which sees the keys
// 0 .. m − tau + i.
__device__ __forceinline__ int last_key(int r, int G, int tau, int m)
{
    return m - tau + r / G;
}

// Passes 1 and 2 share this kernel so that both compute every score with the same instructions
// in the same order (the max found in pass 1 is then exactly a score of pass 2: exp(0) = 1).
// Shared memory: keys [VL_KEYS][d + 1] (padded: lane j reads row j, conflict-free) and the
// scaled queries of the block's current rows [VL_WARPS][d].
template <typename T>
__global__ void __launch_bounds__(VL_THREADS)
    vl_pass(kvcap_cuda_layer_ptrs ptrs, int layer0, int H, int G, int d, int tau, int m,
            size_t q_stride, size_t row_stride, size_t head_stride, float scale, float p,
            int second, int tiles, float2 *__restrict__ part, const float2 *__restrict__ rowstat,
            float *__restrict__ score, unsigned long long *__restrict__ below)
{
    extern __shared__ float smem[];
    __shared__ float colsum[VL_WARPS][VL_KEYS];
    float *ks = smem, *qs = smem + VL_KEYS * (d + 1);
    const int bl = blockIdx.y, l = bl / H, h = bl - l * H;
    const size_t b = (size_t)(layer0 + l) * H + h;
    const float *Q = (const float *)ptrs.a[l] + (size_t)h * G * d;
    const T *K = (const T *)ptrs.b[l] + (size_t)h * head_stride;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nq = tau * G;
    const int j0 = blockIdx.x * VL_KEYS;

    if (!second && blockIdx.x == 0 && threadIdx.x == 0)
        below[b] = 0; // pass 2, later on the stream, adds to it
    for (int e = threadIdx.x; e < VL_KEYS * d; e += blockDim.x) {
        const int kk = e / d, c = e - kk * d, j = j0 + kk;
        ks[kk * (d + 1) + c] = j < m ? kvcap_cuda_load(K + (size_t)j * row_stride + c) : 0.0f;
    }
    float col = 0.0f;
    unsigned nbelow = 0;
    for (int r0 = 0; r0 < nq; r0 += VL_WARPS) {
        __syncthreads(); // keys stored; the previous rows' queries consumed
        for (int e = threadIdx.x; e < VL_WARPS * d; e += blockDim.x) {
            const int rr = e / d, c = e - rr * d, r = r0 + rr;
            qs[e] = r < nq ? Q[(size_t)(r / G) * q_stride + (size_t)(r % G) * d + c] * scale : 0.0f;
        }
        __syncthreads();
        const int r = r0 + warp;
        if (r >= nq)
            continue;
        const int visible = min(last_key(r, G, tau, m) - j0 + 1, VL_KEYS);
        if (visible <= 0) { // the whole tile is in this row's future
            if (!second && lane == 0)
                part[(b * nq + r) * tiles + blockIdx.x] = make_float2(-INFINITY, 0.0f);
            continue;
        }
        float sc = -INFINITY;
        if (lane < visible) {
            const float *kr = ks + lane * (d + 1), *qr = qs + warp * d;
            float a = 0.0f;
            for (int c = 0; c < d; c++)
                a = fmaf(qr[c], kr[c], a);
            sc = a;
        }
        if (!second) {
            const float mx = kvcap_warp_max(sc);
            const float sum = kvcap_warp_sum(lane < visible ? expf(sc - mx) : 0.0f);
            if (lane == 0)
                part[(b * nq + r) * tiles + blockIdx.x] = make_float2(mx, sum);
        } else if (lane < visible) {
            const float2 st = rowstat[b * nq + r]; // (row max, 1 / Σ exp(s − max))
            const float e = expf(sc - st.x);
            nbelow += e < p;
            col += e * st.y;
        }
    }
    if (!second)
        return;
    colsum[warp][lane] = col;
    nbelow = kvcap_warp_sum(nbelow);
    if (lane == 0 && nbelow)
        atomicAdd(below + b, (unsigned long long)nbelow); // integers: the order cannot matter
    __syncthreads();
    if (warp == 0 && j0 + lane < m) {
        float t = 0.0f;
        for (int w = 0; w < VL_WARPS; w++)
            t += colsum[w][lane];
        score[b * m + j0 + lane] = t;
    }
}

// One warp per query row (rows of all pairs in sequence): merges the row's per-tile (max, Σ)
// in tile order into (max, 1/Σ). Every row sees key 0, so Σ >= 1.
__global__ void __launch_bounds__(VL_THREADS)
    vl_rowstat(const float2 *__restrict__ part, size_t rows, int tiles,
               float2 *__restrict__ rowstat)
{
    const size_t r = (size_t)blockIdx.x * VL_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows)
        return;
    float mx = -INFINITY, sum = 0.0f;
    for (int t = lane; t < tiles; t += 32) {
        const float2 q = part[r * tiles + t];
        if (q.x == -INFINITY)
            continue;
        const float M = fmaxf(mx, q.x);
        sum = sum * expf(mx - M) + q.y * expf(q.x - M); // exp(−inf) = 0 for the first one
        mx = M;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float om = __shfl_xor_sync(0xffffffffu, mx, o);
        const float os = __shfl_xor_sync(0xffffffffu, sum, o);
        const float M = fmaxf(mx, om);
        if (M != -INFINITY) {
            sum = (mx == -INFINITY ? 0.0f : sum * expf(mx - M)) +
                  (om == -INFINITY ? 0.0f : os * expf(om - M));
            mx = M;
        }
    }
    if (lane == 0)
        rowstat[r] = make_float2(mx, 1.0f / sum);
}

__global__ void vl_gamma(const unsigned long long *__restrict__ below, int L, int H,
                         double entries_per_head, double *__restrict__ gamma)
{
    const int l = blockIdx.x * blockDim.x + threadIdx.x;
    if (l >= L)
        return;
    unsigned long long s = 0;
    for (int h = 0; h < H; h++)
        s += below[(size_t)l * H + h];
    gamma[l] = (double)s / ((double)H * entries_per_head);
}

// ---- Host side --------------------------------------------------------------------------------

// Scratch layout: part [batch][tau·G][tiles] float2, then rowstat [batch][tau·G] float2.
struct vl_layout {
    size_t nq_total, part_off, rowstat_off, bytes;
    int tiles;
};

static int vl_layout_of(const struct kvcap_cuda_vl *vl, struct vl_layout *o)
{
    o->tiles = (vl->m + VL_KEYS - 1) / VL_KEYS;
    size_t pairs, part_bytes, rs_bytes, total = 0;
    int ok = kvcap_mul_size((size_t)vl->n_layers, (size_t)vl->n_heads, &pairs) &&
             kvcap_mul_size(pairs, (size_t)vl->tau * (size_t)vl->G, &o->nq_total) &&
             kvcap_mul_size(o->nq_total, (size_t)o->tiles * sizeof(float2), &part_bytes) &&
             kvcap_mul_size(o->nq_total, sizeof(float2), &rs_bytes);
    if (!ok)
        return 0;
    o->part_off = kvcap_cuda_reserve(&total, part_bytes, &ok);
    o->rowstat_off = kvcap_cuda_reserve(&total, rs_bytes, &ok);
    return ok && kvcap_add_size(total, KVCAP_CUDA_SCRATCH_ALIGN, &o->bytes);
}

static enum kvcap_status check_vl(const char *fn, const struct kvcap_cuda_vl *vl)
{
    KVCAP_RETURN_IF(!vl, KVCAP_ERR_INVALID_ARGUMENT, "%s: vl is NULL", fn);
    KVCAP_RETURN_IF(vl->n_layers < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: vl->n_layers = %d, must be >= 1", fn, vl->n_layers);
    KVCAP_RETURN_IF(vl->n_heads < 1 || vl->n_heads > 65535, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: vl->n_heads = %d, must be in [1, 65535]", fn, vl->n_heads);
    KVCAP_RETURN_IF(vl->G < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: vl->G = %d, must be >= 1", fn,
                    vl->G);
    KVCAP_RETURN_IF(vl->d < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: vl->d = %d, must be >= 1", fn,
                    vl->d);
    KVCAP_RETURN_IF(vl->tau < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: vl->tau = %d, must be >= 1", fn,
                    vl->tau);
    KVCAP_RETURN_IF(vl->m < vl->tau, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: vl->m = %d is less than vl->tau = %d", fn, vl->m, vl->tau);
    KVCAP_RETURN_IF((int64_t)vl->tau * vl->G > INT32_MAX ||
                        (int64_t)vl->n_heads * vl->G * vl->d > INT32_MAX,
                    KVCAP_ERR_INVALID_ARGUMENT, "%s: vl->tau, G, n_heads or d is too large", fn);
    KVCAP_RETURN_IF(!kvcap_dtype_is_storage(vl->dtype), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: vl->dtype = %s is not F32, F16 or BF16", fn, kvcap_dtype_name(vl->dtype));
    KVCAP_RETURN_IF(vl->row_stride < (size_t)vl->d, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: vl->row_stride = %zu is less than d = %d", fn, vl->row_stride, vl->d);
    KVCAP_RETURN_IF(vl->q_stride < (size_t)vl->n_heads * vl->G * vl->d,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: vl->q_stride = %zu is less than n_heads * G * d = %lld", fn, vl->q_stride,
                    (long long)vl->n_heads * vl->G * vl->d);
    KVCAP_RETURN_IF(!vl->q || !vl->k, KVCAP_ERR_INVALID_ARGUMENT, "%s: vl->%s is NULL", fn,
                    vl->q ? "k" : "q");
    for (int l = 0; l < vl->n_layers; l++)
        KVCAP_RETURN_IF(!vl->q[l] || !vl->k[l], KVCAP_ERR_INVALID_ARGUMENT,
                        "%s: vl->%s[%d] is NULL", fn, vl->q[l] ? "k" : "q", l);
    return KVCAP_OK;
}

extern "C" size_t kvcap_cuda_vlcache_scratch_bytes(const struct kvcap_cuda_vl *vl)
{
    if (!vl || vl->n_layers < 1 || vl->n_heads < 1 || vl->G < 1 || vl->tau < 1 || vl->m < vl->tau)
        return 0;
    struct vl_layout lay;
    return vl_layout_of(vl, &lay) ? lay.bytes : SIZE_MAX;
}

extern "C" enum kvcap_status kvcap_cuda_vlcache_scores(const struct kvcap_cuda_vl *vl, float scale,
                                                       float p, float *score, int64_t *below,
                                                       double *gamma, void *scratch,
                                                       size_t scratch_bytes, void *stream)
{
    const char *fn = "kvcap_cuda_vlcache_scores";
    KVCAP_TRY(check_vl(fn, vl));
    KVCAP_RETURN_IF(vl->d > VL_MAX_D, KVCAP_ERR_UNSUPPORTED,
                    "%s: vl->d = %d; the device path takes head dims up to %d", fn, vl->d,
                    VL_MAX_D);
    // the builtin, not std::isfinite: a debug build would export that inline from libkvcap
    KVCAP_RETURN_IF(!__builtin_isfinite(scale), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: scale = %g is not finite", fn, (double)scale);
    KVCAP_RETURN_IF(!__builtin_isfinite(p), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: p = %g is not finite", fn, (double)p);
    KVCAP_RETURN_IF(!score, KVCAP_ERR_INVALID_ARGUMENT, "%s: score is NULL", fn);
    KVCAP_RETURN_IF(!below, KVCAP_ERR_INVALID_ARGUMENT, "%s: below is NULL", fn);
    KVCAP_RETURN_IF(!gamma, KVCAP_ERR_INVALID_ARGUMENT, "%s: gamma is NULL", fn);
    struct vl_layout lay;
    KVCAP_RETURN_IF(!vl_layout_of(vl, &lay), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: the scratch size overflows", fn);
    KVCAP_RETURN_IF(!scratch, KVCAP_ERR_INVALID_ARGUMENT, "%s: scratch is NULL", fn);
    KVCAP_RETURN_IF(scratch_bytes < lay.bytes, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: scratch_bytes = %zu, %zu needed", fn, scratch_bytes, lay.bytes);
    const size_t row_blocks = (lay.nq_total + VL_WARPS - 1) / VL_WARPS;
    KVCAP_RETURN_IF(row_blocks > 0x7fffffffu, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: too many query rows (%zu)", fn, lay.nq_total);

    const int L = vl->n_layers, H = vl->n_heads, G = vl->G, d = vl->d, tau = vl->tau, m = vl->m;
    unsigned char *base = kvcap_cuda_align(scratch);
    float2 *part = (float2 *)(base + lay.part_off);
    float2 *rowstat = (float2 *)(base + lay.rowstat_off);
    unsigned long long *cnt = (unsigned long long *)below; // same width; counts are >= 0
    cudaStream_t s = (cudaStream_t)stream;
    const size_t smem = sizeof(float) * ((size_t)VL_KEYS * (d + 1) + (size_t)VL_WARPS * d);
    int group = 65535 / H;
    group = group < KVCAP_CUDA_LAYERS_PER_LAUNCH ? group : KVCAP_CUDA_LAYERS_PER_LAUNCH;
    kvcap_cuda_layer_ptrs ptrs;

    for (int second = 0; second <= 1; second++) {
        for (int l0 = 0; l0 < L; l0 += group) {
            const int count = L - l0 < group ? L - l0 : group;
            memset(&ptrs, 0, sizeof ptrs);
            for (int i = 0; i < count; i++) {
                ptrs.a[i] = vl->q[l0 + i];
                ptrs.b[i] = vl->k[l0 + i];
            }
            dim3 grid((unsigned)lay.tiles, (unsigned)(count * H));
            KVCAP_CUDA_DTYPE_DISPATCH(vl->dtype, T,
                                      vl_pass<T><<<grid, VL_THREADS, smem, s>>>(
                                          ptrs, l0, H, G, d, tau, m, vl->q_stride,
                                          vl->row_stride, vl->head_stride, scale, p, second,
                                          lay.tiles, part, rowstat, score, cnt));
            KVCAP_CUDA_CHECK_LAUNCH(OP, second ? "pass 2 kernel" : "pass 1 kernel");
        }
        if (!second) {
            vl_rowstat<<<(unsigned)row_blocks, VL_THREADS, 0, s>>>(part, lay.nq_total, lay.tiles,
                                                                   rowstat);
            KVCAP_CUDA_CHECK_LAUNCH(OP, "row statistics kernel");
        }
    }
    // causal entries of one head, as kvcap_vlcache_head counts them (τ(τ−1) is even)
    const int64_t entries =
        (int64_t)G * ((int64_t)tau * (m - tau + 1) + (int64_t)tau * (tau - 1) / 2);
    vl_gamma<<<(unsigned)((L + 127) / 128), 128, 0, s>>>(cnt, L, H, (double)entries, gamma);
    KVCAP_CUDA_CHECK_LAUNCH(OP, "sparsity kernel");
    return KVCAP_OK;
}
