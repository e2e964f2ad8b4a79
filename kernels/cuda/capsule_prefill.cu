// capsule_prefill.cu — KVCapsule's prefill on a CUDA device (capsule_prefill_cuda.h), the twin
// of kernels/capsule_prefill.c: per KV head, μ (one thread per channel, summed in double in
// token order as the host does), H = φ(W1ᵀ K'[M] + b1 1ᵀ) per tile with the keys rotated by the
// span's offset on the fly (rope.cuh), and Ṽ = U (V − 1μᵀ), each output element by one thread.
#include <math.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/capsule_prefill_cuda.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rope.cuh"


namespace {

// kvcap_bucket_token: token of point p of tile t.
static __device__ __forceinline__ int grid_token(const kvcap_cuda_grid &g, int t, int p)
{
    if (!g.tiled)
        return p;
    const int per_row = g.cols / g.tile_cols, ti = t / per_row, tj = t - ti * per_row;
    const int a = p / g.tile_cols, c = p - a * g.tile_cols;
    return (ti * g.tile_rows + a) * g.cols + tj * g.tile_cols + c;
}

// kvcap_gelu (kernels/activation.c): the tanh form.
static __device__ __forceinline__ float gelu(float x)
{
    const float c = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

// μ of one head: one thread per channel summing in double in token order, as the host does.
template <typename T>
__global__ void capsule_mu_kernel(kvcap_cuda_view v, int head, int n, int d, T *mu,
                                  float *mu_f32)
{
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d)
        return;
    double sum = 0;
    for (int j = 0; j < n; j++)
        sum += kvcap_cuda_load_any(kvcap_cuda_view_row(v, head, j), (size_t)c, v.dtype);
    const float m = (float)(sum / n);
    mu_f32[c] = m;
    kvcap_cuda_store(mu, (size_t)c, m);
}

// H_t[i][c] = φ(b1[i] + Σ_r W1[r][i] K'[M_r of tile t][c]).
template <typename T>
__global__ void capsule_hidden_kernel(kvcap_cuda_view k, int head, int d,
                                      kvcap_cuda_rope rope, const float *rr,
                                      kvcap_cuda_grid grid, kvcap_cuda_capsule_unit u,
                                      int tiles, T *hs)
{
    const size_t total = (size_t)tiles * u.h * d;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        const int c = (int)(e % d);
        const size_t ti = e / d;
        const int i = (int)(ti % u.h), t = (int)(ti / u.h);
        float z = u.b1[i];
        for (int r = 0; r < u.rk; r++) {
            const int tok = grid_token(grid, t, u.mask[r]);
            z = fmaf(
                u.w1[(size_t)r * u.h + i],
                kvcap_cuda_rope_rotated(kvcap_cuda_view_row(k, head, tok), k.dtype, c, rope, rr),
                z);
        }
        kvcap_cuda_store(hs, e, u.gelu ? gelu(z) : z);
    }
}

// Ṽ_t[i][c] = Σ_p U[i][p] (V[point p of tile t][c] − μ[c]).
template <typename T>
__global__ void capsule_values_kernel(kvcap_cuda_view v, int head, int d,
                                      kvcap_cuda_grid grid, kvcap_cuda_capsule_unit u,
                                      int tiles, const float *mu_f32, T *vt)
{
    const size_t total = (size_t)tiles * u.rv * d;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        const int c = (int)(e % d);
        const size_t ti = e / d;
        const int i = (int)(ti % u.rv), t = (int)(ti / u.rv);
        const float m = mu_f32[c];
        float s = 0.0f;
        for (int p = 0; p < u.m; p++) {
            const int tok = grid_token(grid, t, p);
            const float x =
                kvcap_cuda_load_any(kvcap_cuda_view_row(v, head, tok), (size_t)c, v.dtype) - m;
            s = fmaf(u.u[(size_t)i * u.m + p], x, s);
        }
        kvcap_cuda_store(vt, e, s);
    }
}


// kvcap's exact tiles: for point p of tile t (block t·m + p), the four sums the tile error of
// kvcap_capsule_tile_error is made of, over the channels, in double:
//   ‖k'‖², ‖v − μ‖², ‖k̂' − k'‖², ‖v̂ − v‖²
// with k' = R(−p0) k, k̂' = Σ_a W2[a][p] H_t[a] + b2[p] and v̂ = Σ_r U[r][p] Ṽ_t[r] + μ, from the
// f32 state of every tile (hs [tiles][h][d], vt [tiles][rv][d], mu [d]).
__global__ void capsule_point_error_kernel(kvcap_cuda_view k, kvcap_cuda_view v, int head, int d,
                                           kvcap_cuda_rope rope, const float *rr,
                                           kvcap_cuda_grid grid, kvcap_cuda_capsule_unit u,
                                           const float *hs, const float *vt, const float *mu,
                                           double *out)
{
    const int t = blockIdx.x / u.m, p = blockIdx.x - t * u.m;
    const int tok = grid_token(grid, t, p);
    const void *krow = kvcap_cuda_view_row(k, head, tok), *vrow = kvcap_cuda_view_row(v, head, tok);
    const float *ht = hs + (size_t)t * u.h * d, *vtt = vt + (size_t)t * u.rv * d;
    double s[4] = {0, 0, 0, 0};
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const float kr = kvcap_cuda_rope_rotated(krow, k.dtype, c, rope, rr);
        const float x = kvcap_cuda_load_any(vrow, (size_t)c, v.dtype);
        float kh = u.b2[p], vh = mu[c];
        for (int a = 0; a < u.h; a++)
            kh = fmaf(u.w2[(size_t)a * u.m + p], ht[(size_t)a * d + c], kh);
        for (int r = 0; r < u.rv; r++)
            vh = fmaf(u.u[(size_t)r * u.m + p], vtt[(size_t)r * d + c], vh);
        const double dv = (double)x - mu[c], ek = (double)kh - kr, ev = (double)vh - x;
        s[0] += (double)kr * kr;
        s[1] += dv * dv;
        s[2] += ek * ek;
        s[3] += ev * ev;
    }
    kvcap_block_sum<4>(s);
    if (threadIdx.x == 0)
        for (int i = 0; i < 4; i++)
            out[(size_t)blockIdx.x * 4 + i] = s[i];
}

template <typename T>
void capsule_launch(cudaStream_t st, const kvcap_cuda_view &k, const kvcap_cuda_view &v,
                    int head, int n, int d, const kvcap_cuda_rope &rope, const float *rr,
                    const kvcap_cuda_grid &grid, const kvcap_cuda_capsule_unit &u, int tiles,
                    void *hs, void *vt, void *mu, float *mu_f32)
{
    capsule_mu_kernel<T><<<(d + 127) / 128, 128, 0, st>>>(v, head, n, d, static_cast<T *>(mu),
                                                          mu_f32);
    const size_t nh = (size_t)tiles * u.h * d, nv = (size_t)tiles * u.rv * d;
    if (nh)
        capsule_hidden_kernel<T><<<kvcap_cuda_elem_blocks(nh), KVCAP_CUDA_ELEM_THREADS, 0, st>>>(
            k, head, d, rope, rr, grid, u, tiles, static_cast<T *>(hs));
    if (nv)
        capsule_values_kernel<T><<<kvcap_cuda_elem_blocks(nv), KVCAP_CUDA_ELEM_THREADS, 0, st>>>(
            v, head, d, grid, u, tiles, mu_f32, static_cast<T *>(vt));
}

} // namespace

extern "C" enum kvcap_status kvcap_cuda_capsule_prefill(
    const kvcap_cuda_view *k, const kvcap_cuda_view *v, int head, int n, int d,
    const kvcap_cuda_rope *rope, const float *rope_row, const kvcap_cuda_grid *grid,
    const kvcap_cuda_capsule_unit *unit, int tiles, enum kvcap_dtype storage, void *hs, void *vt,
    void *mu, float *mu_f32, void *stream)
{
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    switch (storage) {
    case KVCAP_DTYPE_F16:
        capsule_launch<__half>(st, *k, *v, head, n, d, *rope, rope_row, *grid, *unit, tiles, hs,
                               vt, mu, mu_f32);
        break;
    case KVCAP_DTYPE_BF16:
        capsule_launch<__nv_bfloat16>(st, *k, *v, head, n, d, *rope, rope_row, *grid, *unit,
                                      tiles, hs, vt, mu, mu_f32);
        break;
    default:
        capsule_launch<float>(st, *k, *v, head, n, d, *rope, rope_row, *grid, *unit, tiles, hs,
                              vt, mu, mu_f32);
        break;
    }
    KVCAP_CUDA_CHECK_LAUNCH("kvcapsule prefill", "capsule kernels");
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_cuda_capsule_point_errors(
    const kvcap_cuda_view *k, const kvcap_cuda_view *v, int head, int n, int d,
    const kvcap_cuda_rope *rope, const float *rope_row, const kvcap_cuda_grid *grid,
    const kvcap_cuda_capsule_unit *unit, const float *hs, const float *vt, const float *mu,
    double *points, void *stream)
{
    if (n > 0)
        capsule_point_error_kernel<<<n, 128, 0, static_cast<cudaStream_t>(stream)>>>(
            *k, *v, head, d, *rope, rope_row, *grid, *unit, hs, vt, mu, points);
    KVCAP_CUDA_CHECK_LAUNCH("kvcapsule exact tiles", "capsule_point_error_kernel");
    return KVCAP_OK;
}
