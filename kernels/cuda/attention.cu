// attention.cu — decode attention on the device (attention_cuda.h): flash-decoding over plain
// K/V rows and the fused KVCapsule kernel, both split across thread blocks whose partials
// (max, sum, o) are merged by log-sum-exp into the caller's partials (attention.h layout). The
// CPU _ref functions in kernels/attention.c are the oracles (tests/test_attention_cuda.c).
//
// Design (math in f32 everywhere; storage F32/F16/BF16 converted as loaded):
//  - rows: grid (C chunks, B problems), 128 threads. A chunk is >= 64 tokens, more when max_n
//    would need more than 128 chunks or the call more than ROWS_TARGET_BLOCKS blocks (enough to
//    fill a large GPU several times over; more only adds partial traffic). The block keeps its
//    nq queries in shared memory and walks its chunk in tiles of 32 tokens (16 when nq·d is
//    large, to stay within 48 KiB): K tile loaded coalesced into shared memory as f32 (rows
//    padded to d+1 floats so that threads on consecutive tokens hit different banks), one
//    thread per (query, token) score, one warp per query for the online softmax, then a thread
//    per column c accumulates o[g][c] for every query g in registers, reading each V element
//    once (coalesced along the row). Loads are issued ROWS_BATCH at a time before they are
//    used: decode attention is latency-bound unless each thread keeps several loads in flight.
//    Each block writes its partial to scratch.
//  - capsule: grid (C chunks, spans), 256 threads. A span's work is cut into pieces (tile t,
//    a range of <= 256 of the tile's m points; dense maps have one tile of m = n points, so a
//    dense span becomes ceil(m/256) pieces), consecutive pieces grouped into chunks. The block
//    copies the maps into shared memory when they fit beside its working set (tiled maps:
//    always), then for each group of queries and each piece: z = H_t q' (a warp per row of
//    H_t), scores over the piece's points, online softmax, y = U p, o += Ṽ_tᵀ y + (Σp) μ. The
//    μ term is added per piece: it is linear in the weights, so the merge scales it correctly.
//  - merge: grid (nq, B), one block per (problem, query) folds the C chunk partials and the
//    caller's partial with one shared max (an empty partial contributes nothing and its o is
//    never read), like kvcap_partial_merge.
// No kernel uses atomics: results are deterministic for a given launch configuration, which
// depends only on the sizes passed in (so a graph replays bit-identical results).
//
// Bytes per step (DESIGN §4), the performance model, es = bytes per stored element:
//  - rows, per problem: 2·n·d·es of K and V read once from DRAM; plus nq·d·4 (queries) and the
//    split's partials: 2·C·nq·(d+2)·4 written and read back, and 2·nq·(d+2)·4 for the caller's
//    partial. The partials are nq·(d+2)·4 bytes per chunk against 2·chunk·d·es of K/V: for a
//    64-token chunk of F16 that is ~nq/64 written and as much read back (mostly from L2); the
//    chunk grows with max_n and the batch (ROWS_TARGET_BLOCKS), which shrinks that share.
//  - capsule, per call: the maps (h·m + m + rv·m)·4 once from DRAM (every block reads what it
//    needs; after the first read they are L2-resident: tiled maps are a few KiB, dense ones a
//    few MiB); per span (h + rv)·d·es per tile + d·es (H_t, Ṽ_t, μ) once from DRAM — a dense
//    tile split into P point ranges is read P times, the repeats from L2 — plus nq·d·4 and the
//    partial traffic as above. Against 2·n·d·es for plain rows, the fused path wins when
//    (h + rv)·d·es per tile of m tokens < 2·m·d·es, i.e. (h + rv) < 2m, plus the maps' share,
//    which tiled maps make negligible.
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "common/internal.h"
}
#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/common.cuh"

#define MAX_NQ KVCAP_CUDA_ATTN_MAX_NQ
#define MIN_D KVCAP_CUDA_ATTN_MIN_D
#define MAX_D KVCAP_CUDA_ATTN_MAX_D

// Static launch limits. 48 KiB is the dynamic shared memory a kernel may use without an opt-in
// (cudaFuncSetAttribute), which keeps every launch a plain one.
#define SMEM_BUDGET (48 * 1024)
#define MAX_SPLIT 128 // chunks per problem or span: bounds the merge's work and scratch
#define ROWS_THREADS 128
#define ROWS_MIN_CHUNK 64 // tokens; see the bytes-per-step note above
#define ROWS_TARGET_BLOCKS 1024 // blocks per call beyond which chunks grow instead
#define ROWS_COLS (MAX_D / ROWS_THREADS) // output columns per thread (each for every query)
#define ROWS_BATCH 8 // independent global loads a thread issues before using them
#define CAPS_THREADS 256
#define CAPS_POINTS 256 // points per piece, and per chunk for small tiles
#define MERGE_THREADS 128
#define ELEM_THREADS 256
#define MAX_GRID_Y 65535

namespace {

// ---- Device functions -------------------------------------------------------------------------

// The CPU's partial_empty: a partial that has seen no keys is skipped by a merge.
__device__ __forceinline__ bool partial_empty(float mx, float sum)
{
    return !(sum > 0.0f) || mx == -INFINITY;
}

// One online-softmax step for one query, by one whole warp (nv >= 1): scores s[0..nv) become
// probabilities in place against the new running max; mrun/lrun are the running max and sum,
// alpha receives exp(old max - new max) by which the caller rescales its o (0 when the query
// had seen nothing: exp(-inf)), psum the step's Σp.
__device__ __forceinline__ void softmax_step(float *s, int nv, float *mrun, float *lrun,
                                             float *alpha, float *psum, int lane)
{
    float tmax = -INFINITY;
    for (int j = lane; j < nv; j += 32)
        tmax = fmaxf(tmax, s[j]);
    tmax = kvcap_warp_max(tmax);
    float mold = *mrun, mnew = fmaxf(mold, tmax), part = 0.0f;
    for (int j = lane; j < nv; j += 32) {
        float p = expf(s[j] - mnew);
        s[j] = p;
        part += p;
    }
    part = kvcap_warp_sum(part);
    __syncwarp();
    if (lane == 0) {
        float a = expf(mold - mnew);
        *alpha = a;
        *psum = part;
        *lrun = *lrun * a + part;
        *mrun = mnew;
    }
}

// ---- Plain rows ---------------------------------------------------------------------------------

// Shared memory (floats): qs [nq][d], ks [tok][d+1], ps [nq][tok], mrun/lrun/alpha/psum [nq].
size_t rows_smem_floats(int nq, int d, int tok)
{
    return (size_t)nq * d + (size_t)tok * (d + 1) + (size_t)nq * tok + 4 * (size_t)nq;
}

template <typename T>
__global__ void __launch_bounds__(ROWS_THREADS)
    rows_chunk_kernel(const kvcap_cuda_rows_problem *problems, int nq, int d, int chunk,
                      int n_chunks, int tok, float scale, float *scratch)
{
    extern __shared__ float smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const kvcap_cuda_rows_problem pr = problems[blockIdx.y];
    const int ld = d + 1, nqd = nq * d;
    float *qs = smem;
    float *ks = qs + (size_t)nq * d;
    float *ps = ks + (size_t)tok * ld;
    float *mrun = ps + (size_t)nq * tok, *lrun = mrun + nq, *alpha = lrun + nq, *psum = alpha + nq;

    for (int e = tid; e < nqd; e += blockDim.x)
        qs[e] = pr.q[e];
    for (int g = tid; g < nq; g += blockDim.x) {
        mrun[g] = -INFINITY;
        lrun[g] = 0.0f;
    }
    // o[g][c] for this thread's columns c = tid + k·ROWS_THREADS (k < ROWS_COLS), every query.
    float acc[ROWS_COLS][MAX_NQ];
#pragma unroll
    for (int k = 0; k < ROWS_COLS; k++)
#pragma unroll
        for (int g = 0; g < MAX_NQ; g++)
            acc[k][g] = 0.0f;

    const T *K = static_cast<const T *>(pr.k), *V = static_cast<const T *>(pr.v);
    const size_t stride = (size_t)pr.row_stride;
    const int j_begin = blockIdx.x * chunk;
    const int j_end = pr.n - j_begin < chunk ? pr.n : j_begin + chunk; // no int overflow
    __syncthreads();

    for (int j0 = j_begin; j0 < j_end; j0 += tok) {
        const int nv = min(tok, j_end - j0), nvd = nv * d;
        // K tile into shared memory, ROWS_BATCH independent loads in flight per thread.
        for (int e0 = tid; e0 < nvd; e0 += ROWS_BATCH * ROWS_THREADS) {
            float x[ROWS_BATCH];
#pragma unroll
            for (int u = 0; u < ROWS_BATCH; u++) {
                int e = e0 + u * ROWS_THREADS, t = e / d, c = e - t * d;
                x[u] = e < nvd ? kvcap_cuda_load(&K[(size_t)(j0 + t) * stride + c]) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < ROWS_BATCH; u++) {
                int e = e0 + u * ROWS_THREADS, t = e / d, c = e - t * d;
                if (e < nvd)
                    ks[t * ld + c] = x[u];
            }
        }
        __syncthreads();
        for (int e = tid; e < nq * tok; e += blockDim.x) {
            int g = e / tok, t = e - g * tok;
            if (t < nv) {
                const float *kr = ks + t * ld, *qr = qs + g * d;
                float s = 0.0f;
                for (int c = 0; c < d; c++)
                    s += kr[c] * qr[c];
                ps[e] = s * scale;
            }
        }
        __syncthreads();
        for (int g = warp; g < nq; g += nwarps)
            softmax_step(ps + g * tok, nv, mrun + g, lrun + g, alpha + g, psum + g, lane);
        __syncthreads();
        // o = alpha o + Σ_t p[g][t] V[t]: a thread per column (coalesced rows of V), each V
        // element loaded once for all queries, ROWS_BATCH tokens' loads in flight.
#pragma unroll
        for (int k = 0; k < ROWS_COLS; k++) {
            const int c = tid + k * ROWS_THREADS;
            if (c < d) {
#pragma unroll
                for (int g = 0; g < MAX_NQ; g++)
                    if (g < nq)
                        acc[k][g] *= alpha[g];
                for (int t0 = 0; t0 < nv; t0 += ROWS_BATCH) {
                    float v[ROWS_BATCH];
#pragma unroll
                    for (int u = 0; u < ROWS_BATCH; u++)
                        v[u] = t0 + u < nv
                                   ? kvcap_cuda_load(&V[(size_t)(j0 + t0 + u) * stride + c])
                                   : 0.0f;
#pragma unroll
                    for (int u = 0; u < ROWS_BATCH; u++)
                        if (t0 + u < nv)
#pragma unroll
                            for (int g = 0; g < MAX_NQ; g++)
                                if (g < nq)
                                    acc[k][g] += ps[g * tok + t0 + u] * v[u];
                }
            }
        }
        __syncthreads(); // ks and ps are rewritten by the next tile
    }

    // Partial of this chunk: mx[nq], sum[nq], o[nq][d]; a chunk past the problem's end writes
    // an empty partial (the merge skips it).
    float *out = scratch + ((size_t)blockIdx.y * n_chunks + blockIdx.x) * (size_t)nq * (d + 2);
    for (int g = tid; g < nq; g += blockDim.x) {
        out[g] = mrun[g];
        out[nq + g] = lrun[g];
    }
#pragma unroll
    for (int k = 0; k < ROWS_COLS; k++) {
        const int c = tid + k * ROWS_THREADS;
        if (c < d)
#pragma unroll
            for (int g = 0; g < MAX_NQ; g++)
                if (g < nq)
                    out[2 * nq + g * d + c] = acc[k][g];
    }
}

// ---- Merge of chunk partials -----------------------------------------------------------------

// Folds the n_chunks partials at parts (each nq·(d+2) floats: mx, sum, o) for query g into acc.
// Every thread computes the same max, so the early return is uniform across the block.
__device__ void merge_chunks(const float *parts, int n_chunks, int nq, int d, int g,
                             kvcap_partial acc)
{
    __shared__ float w[MAX_SPLIT];
    const size_t ps = (size_t)nq * (d + 2);
    const float am = acc.mx[g], as = acc.sum[g];
    const bool live = !partial_empty(am, as);
    float mx = live ? am : -INFINITY;
    for (int i = 0; i < n_chunks; i++) {
        float m = parts[i * ps + g], s = parts[i * ps + nq + g];
        if (!partial_empty(m, s))
            mx = fmaxf(mx, m);
    }
    if (mx == -INFINITY)
        return; // nothing seen anywhere: acc stays as it is
    for (int i = threadIdx.x; i < n_chunks; i += blockDim.x) {
        float m = parts[i * ps + g], s = parts[i * ps + nq + g];
        w[i] = partial_empty(m, s) ? 0.0f : expf(m - mx);
    }
    __syncthreads(); // w is complete, and every thread has read acc.mx/acc.sum
    const float a = live ? expf(am - mx) : 0.0f;
    float *o = acc.o + (size_t)g * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float v = live ? a * o[c] : 0.0f; // an empty partial's o is never read
        for (int i = 0; i < n_chunks; i++)
            if (w[i] != 0.0f)
                v += w[i] * parts[i * ps + 2 * nq + (size_t)g * d + c];
        o[c] = v;
    }
    if (threadIdx.x == 0) {
        float s = live ? a * as : 0.0f;
        for (int i = 0; i < n_chunks; i++)
            if (w[i] != 0.0f)
                s += w[i] * parts[i * ps + nq + g];
        acc.mx[g] = mx;
        acc.sum[g] = s;
    }
}

// grid (nq, batch): Desc is kvcap_cuda_rows_problem or kvcap_cuda_capsule_span (both carry acc).
template <typename Desc>
__global__ void __launch_bounds__(MERGE_THREADS)
    merge_kernel(const Desc *descs, const float *scratch, int n_chunks, int nq, int d)
{
    const float *parts = scratch + (size_t)blockIdx.y * n_chunks * (size_t)nq * (d + 2);
    merge_chunks(parts, n_chunks, nq, d, blockIdx.x, descs[blockIdx.y].acc);
}

// ---- KVCapsule --------------------------------------------------------------------------------

// Shared memory per query slot (floats): q' and o [d] each, z [h], p [mp], y [rv], and the
// scalars sum(q'), running max, running sum, alpha, piece Σp.
size_t caps_slot_floats(int d, int h, int rv, int mp)
{
    return 2 * (size_t)d + (size_t)h + (size_t)mp + (size_t)rv + 5;
}

template <typename T>
__global__ void __launch_bounds__(CAPS_THREADS)
    capsule_chunk_kernel(const float *w2g, const float *b2g, const float *ug, int m, int h, int rv,
                         int parts, int mp, int ppb, int n_chunks, int group, int maps_in_smem,
                         const kvcap_cuda_capsule_span *spans, int nq, int d, float scale,
                         float *scratch)
{
    extern __shared__ float smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const kvcap_cuda_capsule_span sp = spans[blockIdx.y];
    const T *H = static_cast<const T *>(sp.hs), *Vt = static_cast<const T *>(sp.vt);
    const T *mu = static_cast<const T *>(sp.mu);

    float *sm = smem;
    const float *w2 = w2g, *b2 = b2g, *u = ug;
    if (maps_in_smem) { // read once per block, then used for every piece and query
        float *w2s = sm, *b2s = w2s + (size_t)h * m, *us = b2s + m;
        for (int e = tid; e < h * m; e += blockDim.x)
            w2s[e] = w2g[e];
        for (int e = tid; e < m; e += blockDim.x)
            b2s[e] = b2g[e];
        for (int e = tid; e < rv * m; e += blockDim.x)
            us[e] = ug[e];
        w2 = w2s;
        b2 = b2s;
        u = us;
        sm = us + (size_t)rv * m;
    }
    float *qs = sm, *os = qs + (size_t)group * d, *zs = os + (size_t)group * d;
    float *ps = zs + (size_t)group * h, *ys = ps + (size_t)group * mp;
    float *sq = ys + (size_t)group * rv, *mrun = sq + group, *lrun = mrun + group;
    float *alpha = lrun + group, *psum = alpha + group;

    const int n_pieces = sp.tiles * parts;
    const int p_begin = blockIdx.x * ppb;
    const int p_end = n_pieces - p_begin < ppb ? n_pieces : p_begin + ppb;
    float *out = scratch + ((size_t)blockIdx.y * n_chunks + blockIdx.x) * (size_t)nq * (d + 2);

    for (int g0 = 0; g0 < nq; g0 += group) {
        const int gn = min(group, nq - g0);
        __syncthreads(); // the previous group is done with every buffer (and the maps are in)
        for (int e = tid; e < gn * d; e += blockDim.x) {
            qs[e] = sp.q[(size_t)g0 * d + e];
            os[e] = 0.0f;
        }
        for (int g = tid; g < gn; g += blockDim.x) {
            mrun[g] = -INFINITY;
            lrun[g] = 0.0f;
        }
        __syncthreads();
        for (int g = warp; g < gn; g += nwarps) {
            float s = 0.0f;
            for (int c = lane; c < d; c += 32)
                s += qs[g * d + c];
            s = kvcap_warp_sum(s);
            if (lane == 0)
                sq[g] = s;
        }

        for (int pc = p_begin; pc < p_end; pc++) {
            const int t = pc / parts, j0 = (pc - t * parts) * mp, jn = min(mp, m - j0);
            // z[g][a] = H_t[a] · q'_g: a warp per row of H_t, lanes along d (coalesced).
            for (int a = warp; a < h; a += nwarps) {
                const T *row = H + ((size_t)t * h + a) * d;
                float dot[MAX_NQ];
#pragma unroll
                for (int g = 0; g < MAX_NQ; g++)
                    dot[g] = 0.0f;
                for (int c = lane; c < d; c += 32) {
                    float x = kvcap_cuda_load(&row[c]);
#pragma unroll
                    for (int g = 0; g < MAX_NQ; g++)
                        if (g < gn)
                            dot[g] += x * qs[g * d + c];
                }
#pragma unroll
                for (int g = 0; g < MAX_NQ; g++)
                    if (g < gn) {
                        float v = kvcap_warp_sum(dot[g]);
                        if (lane == 0)
                            zs[g * h + a] = v;
                    }
            }
            __syncthreads();
            // s_j = scale (W2[:, j] · z + b2_j sum(q')) for the piece's points j0 .. j0+jn.
            for (int e = tid; e < gn * jn; e += blockDim.x) {
                int g = e / jn, jj = e - g * jn, j = j0 + jj;
                const float *zg = zs + g * h;
                float s = b2[j] * sq[g];
                for (int a = 0; a < h; a++)
                    s += w2[(size_t)a * m + j] * zg[a];
                ps[g * mp + jj] = s * scale;
            }
            __syncthreads();
            for (int g = warp; g < gn; g += nwarps)
                softmax_step(ps + g * mp, jn, mrun + g, lrun + g, alpha + g, psum + g, lane);
            __syncthreads();
            // y[g][r] = Σ_j U[r][j] p[g][j] over the piece's points.
            for (int e = tid; e < gn * rv; e += blockDim.x) {
                int g = e / rv, r = e - g * rv;
                const float *pg = ps + g * mp, *ur = u + (size_t)r * m + j0;
                float y = 0.0f;
                for (int jj = 0; jj < jn; jj++)
                    y += ur[jj] * pg[jj];
                ys[e] = y;
            }
            __syncthreads();
            // o = alpha o + Ṽ_tᵀ y + (Σp) μ, threads along d (coalesced rows of Ṽ_t).
            for (int e = tid; e < gn * d; e += blockDim.x) {
                int g = e / d, c = e - g * d;
                const float *yg = ys + g * rv;
                float o = os[e] * alpha[g] + psum[g] * kvcap_cuda_load(&mu[c]);
                for (int r = 0; r < rv; r++)
                    o += yg[r] * kvcap_cuda_load(&Vt[((size_t)t * rv + r) * d + c]);
                os[e] = o;
            }
            __syncthreads();
        }

        for (int g = tid; g < gn; g += blockDim.x) {
            out[g0 + g] = mrun[g];
            out[nq + g0 + g] = lrun[g];
        }
        for (int e = tid; e < gn * d; e += blockDim.x)
            out[2 * nq + (size_t)g0 * d + e] = os[e];
    }
}

// ---- Elementwise partial kernels -------------------------------------------------------------

__global__ void partial_reset_kernel(kvcap_partial p, size_t rows, int d)
{
    size_t total = rows * (size_t)d;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        p.o[i] = 0.0f;
        if (i < rows) {
            p.mx[i] = -INFINITY;
            p.sum[i] = 0.0f;
        }
    }
}

__global__ void partial_finish_kernel(kvcap_partial p, size_t rows, int d, float *out,
                                      size_t out_stride)
{
    size_t total = rows * (size_t)d;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / (size_t)d, c = i - r * (size_t)d;
        float s = p.sum[r];
        out[r * out_stride + c] = s > 0.0f ? p.o[i] / s : 0.0f;
    }
}

// ---- Host side: argument checks, plans, launches ---------------------------------------------

enum kvcap_status launch_status(const char *op)
{
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? KVCAP_OK : kvcap_cuda_fail(e, op, "launch", __FILE__, __LINE__);
}

enum kvcap_status check_shape(const char *op, enum kvcap_dtype dtype, int nq, int d)
{
    KVCAP_RETURN_IF(nq <= 0, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: nq = %d, must be >= 1", op, nq);
    KVCAP_RETURN_IF(nq > MAX_NQ, KVCAP_ERR_UNSUPPORTED,
                    "cuda %s: nq = %d, the kernels serve at most %d queries per KV head", op, nq,
                    MAX_NQ);
    KVCAP_RETURN_IF(d <= 0, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: d = %d, must be >= 1", op, d);
    KVCAP_RETURN_IF(d % 8 != 0 || d < MIN_D || d > MAX_D, KVCAP_ERR_UNSUPPORTED,
                    "cuda %s: d = %d, the kernels need a multiple of 8 in %d..%d", op, d, MIN_D,
                    MAX_D);
    KVCAP_RETURN_IF(dtype != KVCAP_DTYPE_F32 && dtype != KVCAP_DTYPE_F16 &&
                        dtype != KVCAP_DTYPE_BF16,
                    KVCAP_ERR_UNSUPPORTED, "cuda %s: dtype %s, the kernels read F32, F16 or BF16",
                    op, kvcap_dtype_name(dtype));
    return KVCAP_OK;
}

enum kvcap_status check_scratch(const char *op, const void *scratch, size_t have,
                                size_t need)
{
    KVCAP_RETURN_IF(need > 0 && !scratch, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: scratch is NULL, %zu bytes needed", op, need);
    KVCAP_RETURN_IF(have < need, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: scratch_bytes = %zu, %zu needed", op, have, need);
    return KVCAP_OK;
}

// Scratch bytes for `units` problems or spans of n_chunks partials each.
enum kvcap_status partial_scratch(const char *op, int units, int n_chunks, int nq, int d,
                                  size_t *bytes)
{
    size_t n;
    if (!kvcap_mul_size((size_t)units, (size_t)n_chunks, &n) ||
        !kvcap_mul_size(n, (size_t)nq * (size_t)(d + 2) * sizeof(float), &n))
        return kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: scratch size overflows", op);
    *bytes = n;
    return KVCAP_OK;
}

struct rows_plan {
    int chunk, n_chunks, tok;
    size_t smem, scratch;
};

// The split depends on the sizes only, so *_scratch_bytes and the call always agree.
enum kvcap_status rows_plan_make(const char *op, int batch, int max_n, int nq, int d,
                                 rows_plan *pl)
{
    KVCAP_RETURN_IF(batch <= 0, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: batch = %d, must be >= 1",
                    op, batch);
    KVCAP_RETURN_IF(batch > MAX_GRID_Y, KVCAP_ERR_UNSUPPORTED,
                    "cuda %s: batch = %d, at most %d problems per call", op, batch, MAX_GRID_Y);
    KVCAP_RETURN_IF(max_n < 0, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: max_n = %d, must be >= 0",
                    op, max_n);
    int64_t per = ((int64_t)max_n + MAX_SPLIT - 1) / MAX_SPLIT;
    const int64_t fill = ((int64_t)max_n * batch + ROWS_TARGET_BLOCKS - 1) / ROWS_TARGET_BLOCKS;
    if (per < fill)
        per = fill;
    int64_t chunk = (per + 31) / 32 * 32;
    if (chunk < ROWS_MIN_CHUNK)
        chunk = ROWS_MIN_CHUNK;
    pl->chunk = (int)chunk;
    pl->n_chunks = (int)(((int64_t)max_n + chunk - 1) / chunk);
    pl->tok = 32;
    if (rows_smem_floats(nq, d, pl->tok) * sizeof(float) > SMEM_BUDGET)
        pl->tok = 16; // nq·d + 16·(d+1) + ... always fits for nq <= 16, d <= 256
    pl->smem = rows_smem_floats(nq, d, pl->tok) * sizeof(float);
    return partial_scratch(op, batch, pl->n_chunks, nq, d, &pl->scratch);
}

template <typename T>
void rows_launch(const kvcap_cuda_rows_problem *problems, int batch, const rows_plan &pl,
                 int nq, int d, float scale, float *scratch, cudaStream_t st)
{
    dim3 grid((unsigned)pl.n_chunks, (unsigned)batch);
    rows_chunk_kernel<T><<<grid, ROWS_THREADS, pl.smem, st>>>(problems, nq, d, pl.chunk,
                                                              pl.n_chunks, pl.tok, scale, scratch);
}

struct caps_plan {
    int parts, mp, ppb, n_chunks, group, maps_in_smem;
    size_t smem, scratch;
};

enum kvcap_status caps_plan_make(const char *op, const kvcap_capsule_maps *maps,
                                 int n_spans, int max_tiles, int nq, int d, caps_plan *pl)
{
    KVCAP_RETURN_IF(!maps, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: maps is NULL", op);
    const int m = maps->m, h = maps->h, rv = maps->rv;
    KVCAP_RETURN_IF(m <= 0 || h < 0 || rv < 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: maps sizes m = %d, h = %d, rv = %d (need m >= 1, h, rv >= 0)", op,
                    m, h, rv);
    KVCAP_RETURN_IF(n_spans <= 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: n_spans = %d, must be >= 1", op, n_spans);
    KVCAP_RETURN_IF(n_spans > MAX_GRID_Y, KVCAP_ERR_UNSUPPORTED,
                    "cuda %s: n_spans = %d, at most %d spans per call", op, n_spans, MAX_GRID_Y);
    KVCAP_RETURN_IF(max_tiles < 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: max_tiles = %d, must be >= 0", op, max_tiles);
    // Equal point ranges of at most CAPS_POINTS; recounting the parts from their size makes
    // every range non-empty (a softmax step over no scores would be exp(-inf - -inf)).
    pl->parts = (m + CAPS_POINTS - 1) / CAPS_POINTS;
    pl->mp = (m + pl->parts - 1) / pl->parts;
    pl->parts = (m + pl->mp - 1) / pl->mp;
    KVCAP_RETURN_IF((int64_t)max_tiles * pl->parts > INT32_MAX, KVCAP_ERR_UNSUPPORTED,
                    "cuda %s: max_tiles = %d with m = %d, too many pieces", op, max_tiles, m);
    const int64_t pieces = (int64_t)max_tiles * pl->parts;
    int64_t ppb = pl->mp >= CAPS_POINTS ? 1 : CAPS_POINTS / pl->mp;
    if ((pieces + ppb - 1) / ppb > MAX_SPLIT)
        ppb = (pieces + MAX_SPLIT - 1) / MAX_SPLIT;
    pl->ppb = (int)ppb;
    pl->n_chunks = (int)((pieces + ppb - 1) / ppb);

    // The maps go to shared memory only next to a full group of queries (tiled maps: always);
    // otherwise the block reads them through L1/L2 and takes as many queries as fit.
    const size_t slot = caps_slot_floats(d, h, rv, pl->mp) * sizeof(float);
    const size_t maps_bytes = ((size_t)h * m + m + (size_t)rv * m) * sizeof(float);
    if ((size_t)nq * slot + maps_bytes <= SMEM_BUDGET) {
        pl->maps_in_smem = 1;
        pl->group = nq;
        pl->smem = (size_t)nq * slot + maps_bytes;
    } else {
        pl->maps_in_smem = 0;
        pl->group = (int)(SMEM_BUDGET / slot < (size_t)nq ? SMEM_BUDGET / slot : (size_t)nq);
        pl->smem = (size_t)pl->group * slot;
    }
    KVCAP_RETURN_IF(pl->group < 1, KVCAP_ERR_UNSUPPORTED,
                    "cuda %s: h = %d, rv = %d, d = %d need %zu bytes of shared memory per query, "
                    "more than %d",
                    op, h, rv, d, slot, SMEM_BUDGET);
    return partial_scratch(op, n_spans, pl->n_chunks, nq, d, &pl->scratch);
}

template <typename T>
void caps_launch(const kvcap_capsule_maps *maps, const kvcap_cuda_capsule_span *spans,
                 int n_spans, const caps_plan &pl, int nq, int d, float scale,
                 float *scratch, cudaStream_t st)
{
    dim3 grid((unsigned)pl.n_chunks, (unsigned)n_spans);
    capsule_chunk_kernel<T><<<grid, CAPS_THREADS, pl.smem, st>>>(
        maps->w2, maps->b2, maps->u, maps->m, maps->h, maps->rv, pl.parts, pl.mp, pl.ppb,
        pl.n_chunks, pl.group, pl.maps_in_smem, spans, nq, d, scale, scratch);
}

// Blocks for an elementwise pass over `total` elements (grid-stride loops cover the rest).
unsigned elem_blocks(size_t total)
{
    size_t b = (total + ELEM_THREADS - 1) / ELEM_THREADS;
    return (unsigned)(b < 4096 ? (b ? b : 1) : 4096);
}

enum kvcap_status check_partial(const char *op, kvcap_partial p, int rows, int d)
{
    KVCAP_RETURN_IF(rows < 0, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: rows = %d, must be >= 0", op,
                    rows);
    KVCAP_RETURN_IF(d <= 0, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: d = %d, must be >= 1", op, d);
    KVCAP_RETURN_IF(rows > 0 && (!p.mx || !p.sum || !p.o), KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: partial pointer p.%s is NULL", op,
                    !p.mx ? "mx" : !p.sum ? "sum" : "o");
    return KVCAP_OK;
}

} // namespace

// ---- Entry points ----------------------------------------------------------------------------

extern "C" enum kvcap_status kvcap_cuda_attend_rows_scratch_bytes(int batch, int max_n, int nq,
                                                                  int d, size_t *bytes)
{
    const char *op = "attend_rows_scratch_bytes";
    KVCAP_RETURN_IF(!bytes, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: bytes is NULL", op);
    KVCAP_TRY(check_shape(op, KVCAP_DTYPE_F32, nq, d));
    rows_plan pl = {};
    KVCAP_TRY(rows_plan_make(op, batch, max_n, nq, d, &pl));
    *bytes = pl.scratch;
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_cuda_attend_rows(const kvcap_cuda_rows_problem *problems,
                                                    int batch, int max_n, enum kvcap_dtype dtype,
                                                    int nq, int d, float scale, void *scratch,
                                                    size_t scratch_bytes, void *stream)
{
    const char *op = "attend_rows";
    KVCAP_RETURN_IF(!problems, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: problems is NULL", op);
    KVCAP_TRY(check_shape(op, dtype, nq, d));
    rows_plan pl = {};
    KVCAP_TRY(rows_plan_make(op, batch, max_n, nq, d, &pl));
    KVCAP_TRY(check_scratch(op, scratch, scratch_bytes, pl.scratch));
    if (pl.n_chunks == 0)
        return KVCAP_OK; // max_n = 0: no rows anywhere, every acc stays as it is
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    float *sc = static_cast<float *>(scratch);
    switch (dtype) {
    case KVCAP_DTYPE_F16:
        rows_launch<__half>(problems, batch, pl, nq, d, scale, sc, st);
        break;
    case KVCAP_DTYPE_BF16:
        rows_launch<__nv_bfloat16>(problems, batch, pl, nq, d, scale, sc, st);
        break;
    default:
        rows_launch<float>(problems, batch, pl, nq, d, scale, sc, st);
        break;
    }
    KVCAP_TRY(launch_status("attend_rows"));
    merge_kernel<kvcap_cuda_rows_problem>
        <<<dim3((unsigned)nq, (unsigned)batch), MERGE_THREADS, 0, st>>>(problems, sc, pl.n_chunks,
                                                                        nq, d);
    return launch_status("attend_rows merge");
}

extern "C" enum kvcap_status kvcap_cuda_capsule_scratch_bytes(const kvcap_capsule_maps *maps,
                                                              int n_spans, int max_tiles, int nq,
                                                              int d, size_t *bytes)
{
    const char *op = "capsule_scratch_bytes";
    KVCAP_RETURN_IF(!bytes, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: bytes is NULL", op);
    KVCAP_TRY(check_shape(op, KVCAP_DTYPE_F32, nq, d));
    caps_plan pl = {};
    KVCAP_TRY(caps_plan_make(op, maps, n_spans, max_tiles, nq, d, &pl));
    *bytes = pl.scratch;
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_cuda_capsule_attend(const kvcap_capsule_maps *maps,
                                                       const kvcap_cuda_capsule_span *spans,
                                                       int n_spans, int max_tiles,
                                                       enum kvcap_dtype dtype, int nq, int d,
                                                       float scale, void *scratch,
                                                       size_t scratch_bytes, void *stream)
{
    const char *op = "capsule_attend";
    KVCAP_RETURN_IF(!spans, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: spans is NULL", op);
    KVCAP_TRY(check_shape(op, dtype, nq, d));
    caps_plan pl = {};
    KVCAP_TRY(caps_plan_make(op, maps, n_spans, max_tiles, nq, d, &pl));
    KVCAP_RETURN_IF((maps->h > 0 && !maps->w2) || !maps->b2 || (maps->rv > 0 && !maps->u),
                    KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: maps->%s is NULL", op,
                    !maps->b2 ? "b2" : (maps->h > 0 && !maps->w2) ? "w2" : "u");
    KVCAP_TRY(check_scratch(op, scratch, scratch_bytes, pl.scratch));
    if (pl.n_chunks == 0)
        return KVCAP_OK; // max_tiles = 0: no span has a tile, every acc stays as it is
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    float *sc = static_cast<float *>(scratch);
    switch (dtype) {
    case KVCAP_DTYPE_F16:
        caps_launch<__half>(maps, spans, n_spans, pl, nq, d, scale, sc, st);
        break;
    case KVCAP_DTYPE_BF16:
        caps_launch<__nv_bfloat16>(maps, spans, n_spans, pl, nq, d, scale, sc, st);
        break;
    default:
        caps_launch<float>(maps, spans, n_spans, pl, nq, d, scale, sc, st);
        break;
    }
    KVCAP_TRY(launch_status("capsule_attend"));
    merge_kernel<kvcap_cuda_capsule_span>
        <<<dim3((unsigned)nq, (unsigned)n_spans), MERGE_THREADS, 0, st>>>(spans, sc, pl.n_chunks,
                                                                          nq, d);
    return launch_status("capsule_attend merge");
}

extern "C" enum kvcap_status kvcap_cuda_partial_reset(kvcap_partial p, int rows, int d,
                                                      void *stream)
{
    const char *op = "partial_reset";
    KVCAP_TRY(check_partial(op, p, rows, d));
    if (rows == 0)
        return KVCAP_OK;
    size_t total = (size_t)rows * (size_t)d;
    partial_reset_kernel<<<elem_blocks(total), ELEM_THREADS, 0,
                           static_cast<cudaStream_t>(stream)>>>(p, (size_t)rows, d);
    return launch_status(op);
}

extern "C" enum kvcap_status kvcap_cuda_partial_finish(kvcap_partial p, int rows, int d,
                                                       float *out, size_t out_stride, void *stream)
{
    const char *op = "partial_finish";
    KVCAP_TRY(check_partial(op, p, rows, d));
    KVCAP_RETURN_IF(rows > 0 && !out, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: out is NULL", op);
    KVCAP_RETURN_IF(out_stride < (size_t)d, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: out_stride = %zu, less than d = %d", op, out_stride, d);
    if (rows == 0)
        return KVCAP_OK;
    size_t total = (size_t)rows * (size_t)d;
    partial_finish_kernel<<<elem_blocks(total), ELEM_THREADS, 0,
                            static_cast<cudaStream_t>(stream)>>>(p, (size_t)rows, d, out,
                                                                 out_stride);
    return launch_status(op);
}
