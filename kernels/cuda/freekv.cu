// freekv.cu — FreeKV on the device (freekv_cuda.h): append with digests, group-consistent page
// selection, the pool's two buffers filled by a speculative recall (staged host→device copies
// on two streams) or, for the heads a device-side check flags, by a zero-copy gather from the
// mapped pinned store, and attention over each head's pages through kvcap_cuda_attend_rows.
// runtime/freekv.c is the oracle (tests/test_freekv_cuda.c).
//
// Kernels (one launch each per call, none uses more than 48 KiB of shared memory):
//  - append: grid (n, kv_heads), d threads: storage-dtype rows into a device staging copy of
//    the touched pages (HND, the store's layout) and into the pages' device slots (sinks, and
//    window pages still in the window after the append: tokens of pages that leave the window
//    within the same append never reach the ring, so ring slots are written by one page only).
//  - digest: grid (touched pages, kv_heads), d threads: per-channel max/min over the page's new
//    rows, folded into the page's digest when the page already had rows (exact: max and min).
//  - check: grid kv_heads: adopts the bookkeeping the speculative recall wrote, flips cur to the
//    speculative buffer, and flags the head (resync, tau, or group-mean cosine < tau in double).
//  - score: grid kv_heads, 256 threads: for flagged heads, per query g the raw page scores
//    Σ_c max(q_c·kmax_c, q_c·kmin_c) in double (channel order as the oracle), their softmax over
//    the candidates, the mean over g, stored as (float)log(mean), the oracle's key. Then
//    kvcap_cuda_topk ranks the keys (larger first, ties to the lower index, as the oracle).
//  - fill: grid kv_heads, 256 threads, flagged heads only: the CPU's fill rule (fill_step: pages
//    already in place stay, the others take the freed slots), one pick after the other, pages
//    not in a pool buffer read from the mapped store.
//  - move / scatter: the speculative recall planned on the host: moves in slot order by one
//    block, then per staging chunk a scatter of HND page-heads into NHD slots.
//  - describe + kvcap_cuda_attend_rows + merge: one rows problem per attended page with its own
//    partial, merged per (head, query) into the caller's partial by log-sum-exp.
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/common.cuh"

#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/select_cuda.h"
#include "kernels/cuda/freekv_cuda.h"

#define FKV_OPS 64          // ops per by-value list in a launch's parameters (~0.8 KiB)
#define FKV_STAGE_PAGES 64  // page-heads per staging buffer
#define FKV_THREADS 256
#define FKV_MAX_GRID_Y 65535
#define FKV_CNT 9 // device counters: totals [3], last step [3], this step [3]

namespace {

// ---- Shared by the host plan and the device gather ---------------------------------------------

// The CPU's fill rule (runtime/freekv.c fill), one pick at a time, shared by the host plan and
// the device gather. Pages of the picks (pick[j] + base, j < n) already in a slot < n of this
// buffer stay where they are; the others take, in pick order, the slots < n that are freed
// (holding no pick, or a page an earlier slot holds too), lowest first, copied from a slot of
// the other buffer that holds them, else from a slot >= n of this buffer (never a destination),
// else recalled from the store. No copy reads a slot a copy writes, so they may run in any
// order. Returns pick i's destination slot, -1 when it stays, or n when no slot is free (the
// picks repeat a page); *kind and *src say where it comes from. *next_free is the cursor over
// the freed slots (0 before the first pick); the caller sets slot_b[slot] to the page before
// the next pick.
__host__ __device__ inline int fill_step(const int *pick, int base, int n, const int *slot_b,
                                         const int *slot_o, int slots, int i, int *next_free,
                                         int *kind, int *src)
{
    const int p = pick[i] + base;
    *kind = 0;
    *src = -1;
    for (int s = 0; s < n; s++)
        if (slot_b[s] == p)
            return -1; // in place
    int s = *next_free;
    for (; s < n; s++) {
        const int q = slot_b[s];
        bool kept = q >= 0;
        if (kept) {
            bool picked = false;
            for (int j = 0; j < n && !picked; j++)
                picked = pick[j] + base == q;
            kept = picked;
        }
        for (int t = 0; t < s && kept; t++)
            kept = slot_b[t] != q;
        if (!kept)
            break;
    }
    if (s >= n)
        return n;
    *next_free = s + 1;
    for (int o = 0; o < slots; o++)
        if (slot_o[o] == p) {
            *kind = KVCAP_CUDA_FREEKV_OTHER;
            *src = o;
            return s;
        }
    for (int o = n; o < slots; o++)
        if (slot_b[o] == p) {
            *kind = KVCAP_CUDA_FREEKV_SAME;
            *src = o;
            return s;
        }
    *kind = KVCAP_CUDA_FREEKV_STORE;
    return s;
}

// ---- Element conversion -------------------------------------------------------------------------

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x)
{
    return x;
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x)
{
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x)
{
    return __float2bfloat16_rn(x);
}

// Bookkeeping of one head in device memory (ints): slot[2][slots], nsel[2], cur.
__host__ __device__ inline int meta_ints(int slots)
{
    return 2 * slots + 3;
}

// Copies one page of one head, rows of `words` uint4 (row_bytes / 16), between NHD slots or
// from an HND page (src_stride: uint4 between rows of the source).
__device__ inline void copy_page(uint4 *dk, uint4 *dv, size_t dst_stride, const uint4 *sk,
                                 const uint4 *sv, size_t src_stride, int ps, int words)
{
    for (int e = threadIdx.x; e < ps * words; e += blockDim.x) {
        int r = e / words, w = e - r * words;
        dk[(size_t)r * dst_stride + w] = sk[(size_t)r * src_stride + w];
        dv[(size_t)r * dst_stride + w] = sv[(size_t)r * src_stride + w];
    }
}

// Block-wide double sum (blockDim.x a multiple of 32); every thread gets the total.
__device__ double block_sum(double v, double *red)
{
    v = kvcap_warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads(); // red may still be read by a previous call
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    double t = 0;
    for (int i = 0; i < nw; i++)
        t += red[i];
    return t;
}

__device__ double block_max(double v, double *red)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    double t = -INFINITY;
    for (int i = 0; i < nw; i++)
        t = fmax(t, red[i]);
    return t;
}

// ---- Kernels ------------------------------------------------------------------------------------

struct geom {
    int kvh, G, d, ps, S, W, slots, cap; // cap: store pages
};

// Row r of slot s, head h in an NHD pool of element size es (bytes offset).
__host__ __device__ inline size_t pool_off(const geom &g, int s, int r, int h, size_t row_bytes)
{
    return (((size_t)s * g.ps + r) * g.kvh + h) * row_bytes;
}

template <typename Tin, typename T>
__global__ void append_kernel(geom g, const Tin *k, const Tin *v, int n, int64_t t0, int p0,
                              int np_after, T *pool_k, T *pool_v, T *stage)
{
    const int i = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
    const int64_t t = t0 + i;
    const int p = (int)(t / g.ps), r = (int)(t % g.ps), pl = p - p0;
    const size_t src = ((size_t)h * n + i) * g.d + c;
    const T kx = from_f32<T>(kvcap_cuda_load(k + src)), vx = from_f32<T>(kvcap_cuda_load(v + src));
    const size_t st = (((size_t)pl * g.kvh + h) * 2 * g.ps + r) * g.d + c;
    stage[st] = kx;
    stage[st + (size_t)g.ps * g.d] = vx;
    int slot = p < g.S ? p : p >= np_after - g.W ? g.S + p % g.W : -1;
    if (slot >= 0) {
        const size_t o = (((size_t)slot * g.ps + r) * g.kvh + h) * g.d + c;
        pool_k[o] = kx;
        pool_v[o] = vx;
    }
}

template <typename T>
__global__ void digest_kernel(geom g, const T *stage, int p0, int r0, int n, float *dig)
{
    const int pl = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
    const int rb = pl == 0 ? r0 : 0;
    const int re = r0 + n - pl * g.ps < g.ps ? r0 + n - pl * g.ps : g.ps;
    float *kmax = dig + (((size_t)h * g.cap + p0 + pl) * 2) * g.d, *kmin = kmax + g.d;
    float mx = rb > 0 ? kmax[c] : 0.0f, mn = rb > 0 ? kmin[c] : 0.0f;
    const T *kr = stage + (((size_t)pl * g.kvh + h) * 2 * g.ps) * g.d + c;
    for (int r = rb; r < re; r++) {
        float x = kvcap_cuda_load(kr + (size_t)r * g.d);
        if (r == 0 || x > mx)
            mx = x;
        if (r == 0 || x < mn)
            mn = x;
    }
    kmax[c] = mx;
    kmin[c] = mn;
}

// mode: 0 compare the cosine with tau, 1 always correct (tau >= 1), 2 never (tau <= -1).
__global__ void check_kernel(geom g, const float *q, const float *qp, int prev_valid, int mode,
                             float tau, int adopt, int spec_valid, int npick, int *meta,
                             const int *meta_in, int *flag, int *keep, unsigned long long *cnt)
{
    __shared__ double red[FKV_THREADS / 32];
    const int h = blockIdx.x, mi = meta_ints(g.slots);
    int *m = meta + (size_t)h * mi;
    if (adopt)
        for (int e = threadIdx.x; e < mi; e += blockDim.x)
            m[e] = meta_in[(size_t)h * mi + e];
    int f = 1;
    if (spec_valid && mode == 2)
        f = 0;
    else if (spec_valid && mode == 0 && prev_valid) {
        double total = 0;
        for (int gi = 0; gi < g.G; gi++) {
            const float *a = q + ((size_t)h * g.G + gi) * g.d, *b = qp + ((size_t)h * g.G + gi) * g.d;
            double qq = 0, pp = 0, qb = 0;
            for (int c = threadIdx.x; c < g.d; c += blockDim.x) {
                qq += (double)a[c] * a[c];
                pp += (double)b[c] * b[c];
                qb += (double)a[c] * b[c];
            }
            qq = block_sum(qq, red);
            pp = block_sum(pp, red);
            qb = block_sum(qb, red);
            total += qq > 0 && pp > 0 ? qb / sqrt(qq * pp) : (qq == 0 && pp == 0 ? 1.0 : 0.0);
        }
        double cs = total / g.G;
        cs = cs > 1 ? 1 : cs < -1 ? -1 : cs;
        f = cs < (double)tau;
    }
    __syncthreads(); // every thread is past its reads of m before thread 0 writes
    if (threadIdx.x == 0) {
        if (spec_valid)
            m[2 * g.slots + 2] ^= 1;
        flag[h] = f;
        keep[h] = f ? npick : 0;
        if (spec_valid && f)
            atomicAdd(&cnt[6], 1ull);
        if (!spec_valid)
            atomicAdd(&cnt[7], 1ull);
    }
}

// key[h][i] for candidates lo + i, i < nc, of the heads with keep[h] != 0 (keep NULL: all).
__global__ void __launch_bounds__(FKV_THREADS)
    score_kernel(geom g, const float *dig, const float *q, const int *keep, int lo, int nc,
                 double *raw, double *mean, float *key)
{
    __shared__ double red[FKV_THREADS / 32];
    extern __shared__ float qs[];
    const int h = blockIdx.x;
    if (keep && keep[h] == 0)
        return;
    double *rw = raw + (size_t)h * g.cap, *mn = mean + (size_t)h * g.cap;
    for (int i = threadIdx.x; i < nc; i += blockDim.x)
        mn[i] = 0;
    for (int gi = 0; gi < g.G; gi++) {
        __syncthreads(); // qs of the previous query is no longer read
        for (int c = threadIdx.x; c < g.d; c += blockDim.x)
            qs[c] = q[((size_t)h * g.G + gi) * g.d + c];
        __syncthreads();
        double mx = -INFINITY;
        for (int i = threadIdx.x; i < nc; i += blockDim.x) {
            const float *kmax = dig + (((size_t)h * g.cap + lo + i) * 2) * g.d, *kmin = kmax + g.d;
            double r = 0;
            for (int c = 0; c < g.d; c++)
                r += fmax((double)qs[c] * kmax[c], (double)qs[c] * kmin[c]);
            rw[i] = r;
            mx = fmax(mx, r);
        }
        mx = block_max(mx, red);
        double s = 0;
        for (int i = threadIdx.x; i < nc; i += blockDim.x)
            s += exp(rw[i] - mx);
        s = block_sum(s, red);
        for (int i = threadIdx.x; i < nc; i += blockDim.x)
            mn[i] += exp(rw[i] - mx) / s / g.G;
    }
    for (int i = threadIdx.x; i < nc; i += blockDim.x)
        key[(size_t)h * g.cap + i] = (float)log(mn[i]);
}

// The corrective (and resync) fill of flagged heads: pick lo + sel[h][s], s < n, into the buffer
// other than cur, which then becomes cur. Pages in no pool buffer are read from the mapped store.
__global__ void __launch_bounds__(FKV_THREADS)
    fill_kernel(geom g, size_t row_bytes, const int *flag, const int *sel, int lo, int n,
                int *meta, uint4 *pool_k, uint4 *pool_v, const unsigned char *store,
                unsigned long long *cnt)
{
    __shared__ int s_kind, s_src, s_dst, s_next;
    const int h = blockIdx.x;
    if (!flag[h])
        return;
    int *m = meta + (size_t)h * meta_ints(g.slots);
    const int b = 1 - m[2 * g.slots + 2];
    int *slot_b = m + b * g.slots;
    const int *slot_o = m + (1 - b) * g.slots;
    const int *pick = sel + (size_t)h * g.cap;
    const int words = (int)(row_bytes / 16), base = g.S + g.W;
    const size_t stride = (size_t)g.kvh * words; // uint4 between rows of a slot
    int recalled = 0;
    if (threadIdx.x == 0)
        s_next = 0;
    for (int i = 0; i < n; i++) {
        const int p = pick[i] + lo;
        if (threadIdx.x == 0)
            s_dst = fill_step(pick, lo, n, slot_b, slot_o, g.slots, i, &s_next, &s_kind, &s_src);
        __syncthreads();
        const int kind = s_kind, src = s_src, s = s_dst;
        if (s < 0 || s >= n) { // in place (or picks that repeat a page: nothing to place)
            __syncthreads();
            continue;
        }
        const size_t dst = pool_off(g, base + b * g.slots + s, 0, h, row_bytes) / 16;
        if (kind == KVCAP_CUDA_FREEKV_OTHER || kind == KVCAP_CUDA_FREEKV_SAME) {
            const int ss = base + (kind == KVCAP_CUDA_FREEKV_OTHER ? 1 - b : b) * g.slots + src;
            const size_t so = pool_off(g, ss, 0, h, row_bytes) / 16;
            copy_page(pool_k + dst, pool_v + dst, stride, pool_k + so, pool_v + so, stride, g.ps,
                      words);
        } else {
            const uint4 *sk = reinterpret_cast<const uint4 *>(
                store + ((size_t)p * g.kvh + h) * 2 * g.ps * row_bytes);
            copy_page(pool_k + dst, pool_v + dst, stride, sk, sk + (size_t)g.ps * words, words,
                      g.ps, words);
            recalled++;
        }
        __syncthreads(); // every thread has read s_dst before thread 0 moves on
        if (threadIdx.x == 0)
            slot_b[s] = p;
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        m[2 * g.slots + b] = n;
        m[2 * g.slots + 2] = b;
        if (recalled)
            atomicAdd(&cnt[8], (unsigned long long)recalled);
    }
}

struct move_list {
    int n;
    int head[FKV_OPS], src[FKV_OPS], dst[FKV_OPS]; // pool slots
};

// One block: the moves in order (a move may read a slot a later move rewrites).
__global__ void __launch_bounds__(FKV_THREADS)
    move_kernel(geom g, size_t row_bytes, move_list ml, uint4 *pool_k, uint4 *pool_v)
{
    const int words = (int)(row_bytes / 16);
    const size_t stride = (size_t)g.kvh * words;
    for (int i = 0; i < ml.n; i++) {
        const size_t dst = pool_off(g, ml.dst[i], 0, ml.head[i], row_bytes) / 16;
        const size_t src = pool_off(g, ml.src[i], 0, ml.head[i], row_bytes) / 16;
        copy_page(pool_k + dst, pool_v + dst, stride, pool_k + src, pool_v + src, stride, g.ps,
                  words);
        __syncthreads();
    }
}

struct scatter_list {
    int n;
    int head[FKV_STAGE_PAGES], dst[FKV_STAGE_PAGES];
};

// grid n: staged page-head e (HND [2][ps][d]) into its pool slot.
__global__ void __launch_bounds__(FKV_THREADS)
    scatter_kernel(geom g, size_t row_bytes, scatter_list sl, const uint4 *stage, uint4 *pool_k,
                   uint4 *pool_v)
{
    const int e = blockIdx.x, words = (int)(row_bytes / 16);
    const uint4 *sk = stage + (size_t)e * 2 * g.ps * words;
    const size_t dst = pool_off(g, sl.dst[e], 0, sl.head[e], row_bytes) / 16;
    copy_page(pool_k + dst, pool_v + dst, (size_t)g.kvh * words, sk, sk + (size_t)g.ps * words,
              words, g.ps, words);
}

// One rows problem per (head, attended page): sinks [0, lo), the top-k slots of buffer cur, the
// window [hi, np); entries past those have n = 0. Their partials start empty.
__global__ void describe_kernel(geom g, size_t row_bytes, int64_t tokens, int np, int lo, int hi,
                                const int *meta, const unsigned char *pool_k,
                                const unsigned char *pool_v, const float *q, float *parts,
                                int P, kvcap_cuda_rows_problem *probs)
{
    const int h = blockIdx.x;
    const int *m = meta + (size_t)h * meta_ints(g.slots);
    const int cur = m[2 * g.slots + 2], nsel = m[2 * g.slots + cur];
    const size_t rows = (size_t)g.kvh * P * g.G;
    for (int j = threadIdx.x; j < P; j += blockDim.x) {
        int slot = -1, page = -1;
        if (j < lo) {
            slot = page = j;
        } else if (j < lo + nsel) {
            slot = g.S + g.W + cur * g.slots + (j - lo);
        } else if (j < lo + nsel + (np - hi)) {
            page = hi + (j - lo - nsel);
            slot = g.S + page % g.W;
        }
        int n = 0;
        if (slot >= 0) {
            int64_t left = page >= 0 ? tokens - (int64_t)page * g.ps : g.ps;
            n = left < g.ps ? (int)left : g.ps;
        }
        const size_t i = (size_t)h * P + j;
        kvcap_cuda_rows_problem pr;
        const size_t off = pool_off(g, slot < 0 ? 0 : slot, 0, h, row_bytes);
        pr.k = pool_k + off;
        pr.v = pool_v + off;
        pr.q = q + (size_t)h * g.G * g.d;
        pr.acc.mx = parts + i * g.G;
        pr.acc.sum = parts + rows + i * g.G;
        pr.acc.o = parts + 2 * rows + i * g.G * g.d;
        pr.row_stride = (int64_t)g.kvh * g.d;
        pr.n = n;
        pr.reserved = 0;
        probs[i] = pr;
        for (int gi = 0; gi < g.G; gi++) {
            pr.acc.mx[gi] = -INFINITY;
            pr.acc.sum[gi] = 0.0f;
        }
    }
}

// grid (G, kv_heads): folds head h's P page partials for query g into acc row h·G + g, with one
// shared max (empty partials, and an empty acc, contribute nothing and their o is not read).
__global__ void merge_pages_kernel(geom g, const float *parts, int P, kvcap_partial acc)
{
    const int gi = blockIdx.x, h = blockIdx.y, row = h * g.G + gi;
    const size_t rows = (size_t)g.kvh * P * g.G;
    const float *pm = parts, *psum = parts + rows, *po = parts + 2 * rows;
    const float am = acc.mx[row], as = acc.sum[row];
    const bool live = as > 0.0f && am != -INFINITY;
    float mx = live ? am : -INFINITY;
    for (int j = 0; j < P; j++) {
        const size_t i = ((size_t)h * P + j) * g.G + gi;
        if (psum[i] > 0.0f && pm[i] != -INFINITY)
            mx = fmaxf(mx, pm[i]);
    }
    if (mx == -INFINITY)
        return;
    __syncthreads(); // every thread has read acc.mx / acc.sum
    const float a = live ? expf(am - mx) : 0.0f;
    float *o = acc.o + (size_t)row * g.d;
    for (int c = threadIdx.x; c < g.d; c += blockDim.x) {
        float v = live ? a * o[c] : 0.0f;
        for (int j = 0; j < P; j++) {
            const size_t i = ((size_t)h * P + j) * g.G + gi;
            if (psum[i] > 0.0f && pm[i] != -INFINITY)
                v += expf(pm[i] - mx) * po[i * g.d + c];
        }
        o[c] = v;
    }
    if (threadIdx.x == 0) {
        float s = live ? a * as : 0.0f;
        for (int j = 0; j < P; j++) {
            const size_t i = ((size_t)h * P + j) * g.G + gi;
            if (psum[i] > 0.0f && pm[i] != -INFINITY)
                s += expf(pm[i] - mx) * psum[i];
        }
        acc.mx[row] = mx;
        acc.sum[row] = s;
    }
}

// The step's counts become the last step's and are added to the totals.
__global__ void close_step_kernel(unsigned long long *cnt)
{
    for (int i = 0; i < 3; i++) {
        cnt[3 + i] = cnt[6 + i];
        cnt[i] += cnt[6 + i];
        cnt[6 + i] = 0;
    }
}

// ---- Host: layout ------------------------------------------------------------------------------

// Offsets of the device block (one cudaMalloc); *total receives its size.
struct dev_offsets {
    size_t pool_k, pool_v, dig, meta, meta_in, q0, q1, flag, keep, key_c, key_s, raw_c, mean_c,
        raw_s, mean_s, sel_c, sel_s, cnt, probs, parts, attn, stage0, stage1, total;
    size_t attn_bytes;
};

int64_t pages_for(int64_t tokens, int ps)
{
    return (tokens + ps - 1) / ps;
}

// Candidates [*lo, *hi) of a store of np pages; sinks win over the window where they overlap.
void candidates(int S, int W, int np, int *lo, int *hi)
{
    *lo = S < np ? S : np;
    *hi = np - W > *lo ? np - W : *lo;
}

enum kvcap_status dev_layout(const struct kvcap_cuda_freekv_layout &L, int kvh, int G, int d,
                             dev_offsets *o)
{
    const char *op = "freekv";
    const int ps = (int)(L.page_head_bytes / (2 * L.row_bytes));
    size_t t = 0, pool_b = 0, x = 0;
    int ok = kvcap_mul_size((size_t)L.pool_slots * ps, L.row_bytes, &pool_b) &&
             kvcap_mul_size(pool_b, (size_t)kvh, &pool_b);
    const size_t hc = (size_t)kvh * L.cap_pages, P = (size_t)L.attend_pages;
    o->pool_k = kvcap_cuda_reserve(&t, pool_b, &ok);
    o->pool_v = kvcap_cuda_reserve(&t, pool_b, &ok);
    ok = ok && kvcap_mul_size(hc, 2 * (size_t)d * sizeof(float), &x);
    o->dig = kvcap_cuda_reserve(&t, x, &ok);
    const size_t mi = (size_t)kvh * (2 * (size_t)L.slots + 3) * sizeof(int);
    o->meta = kvcap_cuda_reserve(&t, mi, &ok);
    o->meta_in = kvcap_cuda_reserve(&t, mi, &ok);
    const size_t qb = (size_t)kvh * G * d * sizeof(float);
    o->q0 = kvcap_cuda_reserve(&t, qb, &ok);
    o->q1 = kvcap_cuda_reserve(&t, qb, &ok);
    o->flag = kvcap_cuda_reserve(&t, (size_t)kvh * sizeof(int), &ok);
    o->keep = kvcap_cuda_reserve(&t, (size_t)kvh * sizeof(int), &ok);
    o->key_c = kvcap_cuda_reserve(&t, hc * sizeof(float), &ok);
    o->key_s = kvcap_cuda_reserve(&t, hc * sizeof(float), &ok);
    o->raw_c = kvcap_cuda_reserve(&t, hc * sizeof(double), &ok);
    o->mean_c = kvcap_cuda_reserve(&t, hc * sizeof(double), &ok);
    o->raw_s = kvcap_cuda_reserve(&t, hc * sizeof(double), &ok);
    o->mean_s = kvcap_cuda_reserve(&t, hc * sizeof(double), &ok);
    o->sel_c = kvcap_cuda_reserve(&t, hc * sizeof(int), &ok);
    o->sel_s = kvcap_cuda_reserve(&t, hc * sizeof(int), &ok);
    o->cnt = kvcap_cuda_reserve(&t, FKV_CNT * sizeof(unsigned long long), &ok);
    o->probs = kvcap_cuda_reserve(&t, (size_t)kvh * P * sizeof(kvcap_cuda_rows_problem), &ok);
    o->parts = kvcap_cuda_reserve(&t, (size_t)kvh * P * G * (d + 2) * sizeof(float), &ok);
    KVCAP_TRY(kvcap_cuda_attend_rows_scratch_bytes(kvh * L.attend_pages, ps, G, d, &o->attn_bytes));
    o->attn = kvcap_cuda_reserve(&t, o->attn_bytes, &ok);
    o->stage0 = kvcap_cuda_reserve(&t, FKV_STAGE_PAGES * L.page_head_bytes, &ok);
    o->stage1 = kvcap_cuda_reserve(&t, FKV_STAGE_PAGES * L.page_head_bytes, &ok);
    KVCAP_RETURN_IF(!ok, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: device layout overflows", op);
    o->total = t;
    return KVCAP_OK;
}

} // namespace

extern "C" enum kvcap_status kvcap_cuda_freekv_layout(const struct kvcap_freekv_params *p,
                                                      int kv_heads, int G, int d,
                                                      enum kvcap_dtype storage, int max_tokens,
                                                      struct kvcap_cuda_freekv_layout *out)
{
    const char *op = "freekv";
    KVCAP_RETURN_IF(!p || !out, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: NULL %s", op,
                    !p ? "params" : "out");
    KVCAP_RETURN_IF(p->page_size < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: page_size = %d, must be >= 1", op, p->page_size);
    KVCAP_RETURN_IF(p->sink_pages < 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: sink_pages = %d, must be >= 0", op, p->sink_pages);
    KVCAP_RETURN_IF(p->window_pages < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: window_pages = %d, must be >= 1 (the page being written)", op,
                    p->window_pages);
    const int64_t fixed = (int64_t)p->sink_pages + p->window_pages;
    KVCAP_RETURN_IF((int64_t)p->budget_tokens < (fixed + 1) * p->page_size,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: budget_tokens = %d is below (sink_pages + window_pages + 1) pages "
                    "= %lld tokens",
                    op, p->budget_tokens, (long long)((fixed + 1) * p->page_size));
    KVCAP_RETURN_IF(!(p->tau == p->tau), KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: tau is NaN", op);
    KVCAP_RETURN_IF(kv_heads < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: kv_heads = %d, must be >= 1", op, kv_heads);
    KVCAP_RETURN_IF(G < 1, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: G = %d, must be >= 1", op, G);
    KVCAP_RETURN_IF(d < 1, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: d = %d, must be >= 1", op, d);
    KVCAP_RETURN_IF(!kvcap_dtype_is_storage(storage), KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: storage %s, must be F32, F16 or BF16", op,
                    kvcap_dtype_name(storage));
    KVCAP_RETURN_IF(max_tokens < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: max_tokens = %d, must be >= 1", op, max_tokens);
    KVCAP_RETURN_IF(G > KVCAP_CUDA_ATTN_MAX_NQ, KVCAP_ERR_UNSUPPORTED,
                    "cuda %s: G = %d, the kernels serve at most %d queries per KV head", op, G,
                    KVCAP_CUDA_ATTN_MAX_NQ);
    KVCAP_RETURN_IF(d % 8 != 0 || d < KVCAP_CUDA_ATTN_MIN_D || d > KVCAP_CUDA_ATTN_MAX_D,
                    KVCAP_ERR_UNSUPPORTED, "cuda %s: d = %d, the kernels need a multiple of 8 in "
                    "%d..%d", op, d, KVCAP_CUDA_ATTN_MIN_D, KVCAP_CUDA_ATTN_MAX_D);

    struct kvcap_cuda_freekv_layout L;
    memset(&L, 0, sizeof L);
    L.k = (int)(p->budget_tokens / p->page_size - fixed);
    const int64_t cap = pages_for(max_tokens, p->page_size);
    int lo, hi; // the most candidates: a store of max_tokens + 1 tokens (the speculation's)
    candidates(p->sink_pages, p->window_pages, (int)pages_for((int64_t)max_tokens + 1,
                                                              p->page_size), &lo, &hi);
    L.slots = hi - lo < L.k ? hi - lo : L.k;
    L.cap_pages = (int)cap;
    const int64_t pool_slots = fixed + 2 * (int64_t)L.slots;
    const int64_t attend = fixed + L.slots;
    KVCAP_RETURN_IF(attend * kv_heads > FKV_MAX_GRID_Y, KVCAP_ERR_UNSUPPORTED,
                    "cuda %s: kv_heads = %d with %lld pages attended per head, at most %d "
                    "(page, head) pairs per step",
                    op, kv_heads, (long long)attend, FKV_MAX_GRID_Y);
    L.pool_slots = (int)pool_slots;
    L.attend_pages = (int)attend;
    L.row_bytes = (size_t)d * kvcap_dtype_size(storage);
    KVCAP_RETURN_IF(!kvcap_mul_size(L.row_bytes, 2 * (size_t)p->page_size, &L.page_head_bytes),
                    KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: page of %d tokens too large", op,
                    p->page_size);
    size_t store, mirror;
    KVCAP_RETURN_IF(!kvcap_mul_size(L.page_head_bytes, (size_t)kv_heads * (size_t)cap, &store),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: max_tokens = %d, the store's size overflows", op, max_tokens);
    mirror = (size_t)kv_heads * ((2 * (size_t)L.slots + 3) + (size_t)cap) * sizeof(int);
    L.host_bytes = (uint64_t)store + mirror;
    dev_offsets o;
    KVCAP_TRY(dev_layout(L, kv_heads, G, d, &o));
    L.device_bytes = o.total;
    *out = L;
    return KVCAP_OK;
}

extern "C" enum kvcap_status kvcap_cuda_freekv_plan_fill(const int *pick, int n, int *slot_b,
                                                         const int *slot_o, int slots,
                                                         int max_page,
                                                         struct kvcap_cuda_freekv_op *ops,
                                                         int *n_ops, int *recalled)
{
    const char *op = "freekv_plan_fill";
    KVCAP_RETURN_IF(!slot_b || !slot_o || !n_ops || !recalled, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: %s is NULL", op,
                    !slot_b ? "slot_b" : !slot_o ? "slot_o" : !n_ops ? "n_ops" : "recalled");
    KVCAP_RETURN_IF(n < 0 || n > slots, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: n = %d, must be in 0..slots = %d", op, n, slots);
    KVCAP_RETURN_IF(n > 0 && (!pick || !ops), KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: %s is NULL",
                    op, !pick ? "pick" : "ops");
    for (int s = 0; s < n; s++)
        KVCAP_RETURN_IF(pick[s] < 0 || pick[s] > max_page, KVCAP_ERR_INVALID_ARGUMENT,
                        "cuda %s: pick[%d] = %d, must be in 0..max_page = %d", op, s, pick[s],
                        max_page);
    for (int s = 0; s < n; s++)
        for (int t = 0; t < s; t++)
            KVCAP_RETURN_IF(pick[s] == pick[t], KVCAP_ERR_INVALID_ARGUMENT,
                            "cuda %s: pick[%d] = pick[%d] = %d, picks must differ", op, t, s,
                            pick[s]);
    int m = 0, r = 0, next_free = 0;
    for (int i = 0; i < n; i++) {
        int kind, src;
        const int s = fill_step(pick, 0, n, slot_b, slot_o, slots, i, &next_free, &kind, &src);
        if (s < 0)
            continue;
        kvcap_cuda_freekv_op o = {kind, s, src, pick[i]};
        ops[m++] = o;
        r += kind == KVCAP_CUDA_FREEKV_STORE;
        slot_b[s] = pick[i];
    }
    *n_ops = m;
    *recalled = r;
    return KVCAP_OK;
}

// ---- The state ---------------------------------------------------------------------------------

struct kvcap_cuda_freekv {
    kvcap_freekv_params p;
    geom g;
    struct kvcap_cuda_freekv_layout L;
    dev_offsets off;
    kvcap_dtype dt;
    int max_tokens;
    int64_t tokens, step;
    // pinned host memory
    unsigned char *store, *store_dev; // the store and its device alias
    int *mirror;                      // bookkeeping [kvh][meta_ints], then picks [kvh][cap]
    // device
    unsigned char *block;
    unsigned char *app_stage; // append's staging, grown by append
    int app_stage_pages;
    cudaStream_t rs, cs[2], ds; // selection, recall copies, store writes
    cudaEvent_t e_corr, e_plan, e_recall, e_need, e_moves, e_join, e_app, e_d2h, e_last;
    int last_recorded;
    // host side of a step
    int qcur;          // q buffer of the latest attend
    int64_t q_step;    // step of the latest attend (-1: none)
    int attended;      // attend was called in this step
    int plan_pending;  // step_done planned a recall not yet enqueued ...
    int64_t plan_tokens; // ... for a store of this many tokens,
    int plan_n, plan_lo; // with n picks per head, candidates from lo
    int recall_issued; // a recall was enqueued since the latest attend ...
    int64_t recall_tokens;
    int hidden_pending; // e_recall / e_need of a used speculative recall are to be compared
    int d2h_page;       // first store page the latest append's device→host copy writes (-1: none)
    kvcap_cuda_freekv_op *ops;
    int *pick;
    int64_t spec_recalls, spec_hidden, spec_pages, last_spec_pages;
};

namespace {

#define FKV_CUDA(call, what)                                                                       \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return kvcap_cuda_fail(e_, op, (what), __FILE__, __LINE__);                            \
    } while (0)

template <typename T> T *at(const kvcap_cuda_freekv *f, size_t off)
{
    return reinterpret_cast<T *>(f->block + off);
}

// Compares the events of the latest used speculative recall once both completed (wait: block).
void judge_hidden(kvcap_cuda_freekv *f, int wait)
{
    if (!f->hidden_pending)
        return;
    if (wait) {
        (void)cudaEventSynchronize(f->e_need);
        (void)cudaEventSynchronize(f->e_recall);
    }
    float ms = 0;
    if (cudaEventQuery(f->e_need) == cudaSuccess && cudaEventQuery(f->e_recall) == cudaSuccess &&
        cudaEventElapsedTime(&ms, f->e_recall, f->e_need) == cudaSuccess) {
        f->spec_recalls++;
        f->spec_hidden += ms >= 0.0f;
    }
    (void)cudaGetLastError();
    f->hidden_pending = 0;
}

// Enqueues the speculative recall step_done planned: waits for the plan (host), fills each
// head's other buffer by the CPU's rule — moves first, in slot order, on cs[0]; then the store
// pages in chunks through the two staging buffers, alternating cs[0] and cs[1] — and records
// e_recall when both streams are done. The updated bookkeeping goes to meta_in, adopted by the
// next attend's check kernel.
enum kvcap_status issue_recall(kvcap_cuda_freekv *f)
{
    const char *op = "freekv recall";
    if (!f->plan_pending)
        return KVCAP_OK;
    f->plan_pending = 0;
    FKV_CUDA(cudaEventSynchronize(f->e_plan), "wait for the speculative selection");
    FKV_CUDA(cudaStreamSynchronize(f->ds), "wait for the store writes");
    judge_hidden(f, 1);
    const geom &g = f->g;
    const int mi = meta_ints(g.slots), base = g.S + g.W;
    int *sel = f->mirror + (size_t)g.kvh * mi;
    move_list ml;
    ml.n = 0;
    int n_store = 0;
    // moves are launched as the plan goes; store ops are collected in f->ops order per head
    kvcap_cuda_freekv_op *stores = f->ops + g.slots; // [kvh · slots]
    int *store_head = f->pick + g.slots;              // [kvh · slots]
    const geom gg = g;
    const size_t rb = f->L.row_bytes;
    uint4 *pk = at<uint4>(f, f->off.pool_k), *pv = at<uint4>(f, f->off.pool_v);
    for (int h = 0; h < g.kvh; h++) {
        int *m = f->mirror + (size_t)h * mi;
        const int b = 1 - m[2 * g.slots + 2];
        for (int s = 0; s < f->plan_n; s++)
            f->pick[s] = sel[(size_t)h * g.cap + s] + f->plan_lo;
        int n_ops = 0, rec = 0;
        KVCAP_TRY(kvcap_cuda_freekv_plan_fill(f->pick, f->plan_n, m + b * g.slots,
                                              m + (1 - b) * g.slots, g.slots, g.cap - 1, f->ops,
                                              &n_ops, &rec));
        m[2 * g.slots + b] = f->plan_n;
        for (int i = 0; i < n_ops; i++) {
            const kvcap_cuda_freekv_op &o = f->ops[i];
            if (o.kind == KVCAP_CUDA_FREEKV_STORE) {
                stores[n_store] = o;
                stores[n_store].slot = base + b * g.slots + o.slot;
                store_head[n_store++] = h;
                continue;
            }
            ml.head[ml.n] = h;
            ml.src[ml.n] = base + (o.kind == KVCAP_CUDA_FREEKV_OTHER ? 1 - b : b) * g.slots + o.src;
            ml.dst[ml.n] = base + b * g.slots + o.slot;
            if (++ml.n == FKV_OPS) {
                move_kernel<<<1, FKV_THREADS, 0, f->cs[0]>>>(gg, rb, ml, pk, pv);
                KVCAP_CUDA_CHECK_LAUNCH(op, "move kernel");
                ml.n = 0;
            }
        }
    }
    if (ml.n > 0) {
        move_kernel<<<1, FKV_THREADS, 0, f->cs[0]>>>(gg, rb, ml, pk, pv);
        KVCAP_CUDA_CHECK_LAUNCH(op, "move kernel");
    }
    FKV_CUDA(cudaMemcpyAsync(at<int>(f, f->off.meta_in), f->mirror,
                             (size_t)g.kvh * mi * sizeof(int), cudaMemcpyHostToDevice, f->cs[0]),
             "bookkeeping upload");
    FKV_CUDA(cudaEventRecord(f->e_moves, f->cs[0]), "record moves");
    FKV_CUDA(cudaStreamWaitEvent(f->cs[1], f->e_moves, 0), "order stores after moves");
    for (int c0 = 0, chunk = 0; c0 < n_store; c0 += FKV_STAGE_PAGES, chunk++) {
        cudaStream_t st = f->cs[chunk & 1];
        unsigned char *stage = at<unsigned char>(f, chunk & 1 ? f->off.stage1 : f->off.stage0);
        scatter_list sl;
        sl.n = n_store - c0 < FKV_STAGE_PAGES ? n_store - c0 : FKV_STAGE_PAGES;
        for (int e = 0; e < sl.n; e++) {
            const kvcap_cuda_freekv_op &o = stores[c0 + e];
            const int h = store_head[c0 + e];
            sl.head[e] = h;
            sl.dst[e] = o.slot;
            FKV_CUDA(cudaMemcpyAsync(stage + (size_t)e * f->L.page_head_bytes,
                                     f->store + ((size_t)o.page * g.kvh + h) *
                                                    f->L.page_head_bytes,
                                     f->L.page_head_bytes, cudaMemcpyHostToDevice, st),
                     "host-to-device page copy");
        }
        scatter_kernel<<<(unsigned)sl.n, FKV_THREADS, 0, st>>>(
            gg, rb, sl, reinterpret_cast<const uint4 *>(stage), pk, pv);
        KVCAP_CUDA_CHECK_LAUNCH(op, "scatter kernel");
    }
    FKV_CUDA(cudaEventRecord(f->e_join, f->cs[1]), "record recall join");
    FKV_CUDA(cudaStreamWaitEvent(f->cs[0], f->e_join, 0), "join recall streams");
    FKV_CUDA(cudaEventRecord(f->e_recall, f->cs[0]), "record recall done");
    f->recall_issued = 1;
    f->recall_tokens = f->plan_tokens;
    f->spec_pages += n_store;
    f->last_spec_pages = n_store;
    return KVCAP_OK;
}

enum kvcap_status record_last(kvcap_cuda_freekv *f, cudaStream_t st, const char *op)
{
    FKV_CUDA(cudaEventRecord(f->e_last, st), "record the call's end");
    f->last_recorded = 1;
    return KVCAP_OK;
}

// Everything the state enqueued, on its streams and on the callers', is complete.
enum kvcap_status sync_all(kvcap_cuda_freekv *f, const char *op)
{
    if (f->last_recorded)
        FKV_CUDA(cudaEventSynchronize(f->e_last), "wait for the latest call");
    FKV_CUDA(cudaStreamSynchronize(f->rs), "wait for the selection stream");
    FKV_CUDA(cudaStreamSynchronize(f->cs[0]), "wait for recall stream 0");
    FKV_CUDA(cudaStreamSynchronize(f->cs[1]), "wait for recall stream 1");
    FKV_CUDA(cudaStreamSynchronize(f->ds), "wait for the store writes");
    return KVCAP_OK;
}

// Selection of every head (keep NULL) or of the flagged ones for a store of np pages with the
// queries q: scores and top-k into sel (indices relative to lo).
enum kvcap_status select_pages(kvcap_cuda_freekv *f, const float *q, const int *keep, int lo,
                               int nc, int npick, float *key, double *raw, double *mean, int *sel,
                               cudaStream_t st, const char *op)
{
    if (npick <= 0)
        return KVCAP_OK;
    if (nc > npick) {
        score_kernel<<<(unsigned)f->g.kvh, FKV_THREADS, (size_t)f->g.d * sizeof(float), st>>>(
            f->g, at<float>(f, f->off.dig), q, keep, lo, nc, raw, mean, key);
        KVCAP_CUDA_CHECK_LAUNCH(op, "score kernel");
    }
    return kvcap_cuda_topk(key, (size_t)f->g.cap, nc, f->g.kvh, npick, keep, sel,
                           (size_t)f->g.cap, st);
}

} // namespace

extern "C" void kvcap_cuda_freekv_free(struct kvcap_cuda_freekv *f)
{
    if (!f)
        return;
    if (f->rs) // created: wait for everything before freeing what it uses
        (void)sync_all(f, "freekv free");
    cudaStream_t streams[4] = {f->rs, f->cs[0], f->cs[1], f->ds};
    for (int i = 0; i < 4; i++)
        if (streams[i])
            (void)cudaStreamDestroy(streams[i]);
    cudaEvent_t ev[9] = {f->e_corr, f->e_plan, f->e_recall, f->e_need, f->e_moves,
                         f->e_join, f->e_app,  f->e_d2h,    f->e_last};
    for (int i = 0; i < 9; i++)
        if (ev[i])
            (void)cudaEventDestroy(ev[i]);
    if (f->store)
        (void)cudaFreeHost(f->store);
    if (f->mirror)
        (void)cudaFreeHost(f->mirror);
    if (f->block)
        (void)cudaFree(f->block);
    if (f->app_stage)
        (void)cudaFree(f->app_stage);
    (void)cudaGetLastError();
    free(f->ops);
    free(f->pick);
    free(f);
}

extern "C" enum kvcap_status kvcap_cuda_freekv_create(const struct kvcap_freekv_params *p,
                                                      int kv_heads, int G, int d,
                                                      enum kvcap_dtype storage, int max_tokens,
                                                      struct kvcap_cuda_freekv **out)
{
    const char *op = "freekv create";
    if (out)
        *out = NULL;
    struct kvcap_cuda_freekv_layout L;
    KVCAP_TRY(kvcap_cuda_freekv_layout(p, kv_heads, G, d, storage, max_tokens, &L));
    KVCAP_TRY(kvcap_cuda_need_device(op));
    kvcap_cuda_freekv *f = static_cast<kvcap_cuda_freekv *>(calloc(1, sizeof *f));
    KVCAP_RETURN_IF(!f, KVCAP_ERR_OUT_OF_MEMORY, "cuda %s: out of memory", op);
    f->p = *p;
    f->L = L;
    f->dt = storage;
    f->max_tokens = max_tokens;
    f->g = geom{kv_heads, G, d, p->page_size, p->sink_pages, p->window_pages, L.slots,
                L.cap_pages};
    f->q_step = -1;
    f->d2h_page = -1;
    f->ops = static_cast<kvcap_cuda_freekv_op *>(
        malloc(sizeof *f->ops * ((size_t)L.slots * (kv_heads + 1) + 1)));
    f->pick = static_cast<int *>(malloc(sizeof(int) * ((size_t)L.slots * (kv_heads + 1) + 1)));
    enum kvcap_status s = KVCAP_OK;
    const int mi = meta_ints(L.slots);
    if (!f->ops || !f->pick) {
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "cuda %s: out of memory", op);
        goto fail;
    }
    s = dev_layout(L, kv_heads, G, d, &f->off);
    if (s != KVCAP_OK)
        goto fail;
#define FKV_STEP(call, what)                                                                       \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            s = kvcap_cuda_fail(e_, op, (what), __FILE__, __LINE__);                               \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)
    FKV_STEP(cudaHostAlloc(reinterpret_cast<void **>(&f->store),
                           (size_t)L.cap_pages * kv_heads * L.page_head_bytes,
                           cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc store");
    FKV_STEP(cudaHostGetDevicePointer(reinterpret_cast<void **>(&f->store_dev), f->store, 0),
             "cudaHostGetDevicePointer store");
    FKV_STEP(cudaHostAlloc(reinterpret_cast<void **>(&f->mirror),
                           (size_t)kv_heads * (mi + (size_t)L.cap_pages) * sizeof(int),
                           cudaHostAllocDefault),
             "cudaHostAlloc bookkeeping");
    FKV_STEP(cudaMalloc(reinterpret_cast<void **>(&f->block), f->off.total), "cudaMalloc");
    FKV_STEP(cudaMemset(f->block, 0, f->off.total), "cudaMemset");
    for (int h = 0; h < kv_heads; h++) { // every slot empty, nothing selected, cur = 0
        int *m = f->mirror + (size_t)h * mi;
        for (int i = 0; i < 2 * L.slots; i++)
            m[i] = -1;
        m[2 * L.slots] = m[2 * L.slots + 1] = m[2 * L.slots + 2] = 0;
    }
    FKV_STEP(cudaMemcpy(at<int>(f, f->off.meta), f->mirror, (size_t)kv_heads * mi * sizeof(int),
                        cudaMemcpyHostToDevice),
             "bookkeeping init");
    FKV_STEP(cudaMemcpy(at<int>(f, f->off.meta_in), f->mirror,
                        (size_t)kv_heads * mi * sizeof(int), cudaMemcpyHostToDevice),
             "bookkeeping init");
    FKV_STEP(cudaStreamCreateWithFlags(&f->rs, cudaStreamNonBlocking), "cudaStreamCreate");
    FKV_STEP(cudaStreamCreateWithFlags(&f->cs[0], cudaStreamNonBlocking), "cudaStreamCreate");
    FKV_STEP(cudaStreamCreateWithFlags(&f->cs[1], cudaStreamNonBlocking), "cudaStreamCreate");
    FKV_STEP(cudaStreamCreateWithFlags(&f->ds, cudaStreamNonBlocking), "cudaStreamCreate");
    {
        cudaEvent_t *plain[7] = {&f->e_corr, &f->e_plan, &f->e_moves, &f->e_join,
                                 &f->e_app,  &f->e_d2h,  &f->e_last};
        for (int i = 0; i < 7; i++)
            FKV_STEP(cudaEventCreateWithFlags(plain[i], cudaEventDisableTiming),
                     "cudaEventCreate");
        FKV_STEP(cudaEventCreate(&f->e_recall), "cudaEventCreate (timed)");
        FKV_STEP(cudaEventCreate(&f->e_need), "cudaEventCreate (timed)");
    }
#undef FKV_STEP
    *out = f;
    return KVCAP_OK;
fail:
    kvcap_cuda_freekv_free(f);
    return s;
}

extern "C" int64_t kvcap_cuda_freekv_tokens(const struct kvcap_cuda_freekv *f)
{
    return f ? f->tokens : 0;
}

extern "C" enum kvcap_status kvcap_cuda_freekv_append(struct kvcap_cuda_freekv *f, const void *k,
                                                      const void *v, enum kvcap_dtype dtype, int n,
                                                      void *stream)
{
    const char *op = "freekv append";
    KVCAP_RETURN_IF(!f, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: state is NULL", op);
    KVCAP_RETURN_IF(n < 0, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: n = %d, must be >= 0", op, n);
    KVCAP_RETURN_IF(n > 0 && (!k || !v), KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: %s is NULL", op,
                    !k ? "k" : "v");
    KVCAP_RETURN_IF(dtype != KVCAP_DTYPE_F32 && dtype != f->dt, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: dtype %s, must be F32 or the storage dtype %s", op,
                    kvcap_dtype_name(dtype), kvcap_dtype_name(f->dt));
    KVCAP_RETURN_IF((int64_t)n > f->max_tokens - f->tokens, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: n = %d more tokens exceed max_tokens = %d (%lld held)", op, n,
                    f->max_tokens, (long long)f->tokens);
    KVCAP_TRY(issue_recall(f));
    if (n == 0)
        return KVCAP_OK;
    const geom &g = f->g;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    const int ps = g.ps, p0 = (int)(f->tokens / ps), r0 = (int)(f->tokens % ps);
    const int touched = (int)pages_for((int64_t)r0 + n, ps);
    const int np_after = (int)pages_for(f->tokens + n, ps);
    FKV_CUDA(cudaStreamSynchronize(f->ds), "wait for the store writes"); // app_stage is free
    if (touched > f->app_stage_pages) {
        if (f->app_stage)
            FKV_CUDA(cudaFree(f->app_stage), "cudaFree staging");
        f->app_stage = NULL;
        f->app_stage_pages = 0;
        FKV_CUDA(cudaMalloc(reinterpret_cast<void **>(&f->app_stage),
                            (size_t)touched * g.kvh * f->L.page_head_bytes),
                 "cudaMalloc staging");
        f->app_stage_pages = touched;
    }
    const dim3 grid((unsigned)n, (unsigned)g.kvh), dgrid((unsigned)touched, (unsigned)g.kvh);
    KVCAP_CUDA_DTYPE_DISPATCH(f->dt, T, {
        T *pk = at<T>(f, f->off.pool_k), *pv = at<T>(f, f->off.pool_v);
        T *stg = reinterpret_cast<T *>(f->app_stage);
        if (dtype == KVCAP_DTYPE_F32)
            append_kernel<float, T><<<grid, (unsigned)g.d, 0, st>>>(
                g, static_cast<const float *>(k), static_cast<const float *>(v), n, f->tokens,
                p0, np_after, pk, pv, stg);
        else
            append_kernel<T, T><<<grid, (unsigned)g.d, 0, st>>>(
                g, static_cast<const T *>(k), static_cast<const T *>(v), n, f->tokens, p0,
                np_after, pk, pv, stg);
        KVCAP_CUDA_CHECK_LAUNCH(op, "append kernel");
        digest_kernel<T><<<dgrid, (unsigned)g.d, 0, st>>>(g, stg, p0, r0, n,
                                                          at<float>(f, f->off.dig));
        KVCAP_CUDA_CHECK_LAUNCH(op, "digest kernel");
    });
    FKV_CUDA(cudaEventRecord(f->e_app, st), "record append");
    FKV_CUDA(cudaStreamWaitEvent(f->ds, f->e_app, 0), "order the store writes");
    const size_t rb = f->L.row_bytes, pitch = (size_t)ps * rb;
    for (int pl = 0; pl < touched; pl++) {
        const int rb0 = pl == 0 ? r0 : 0;
        const int re = r0 + n - pl * ps < ps ? r0 + n - pl * ps : ps;
        const size_t page = (size_t)g.kvh * f->L.page_head_bytes;
        FKV_CUDA(cudaMemcpy2DAsync(f->store + (size_t)(p0 + pl) * page + rb0 * rb, pitch,
                                   f->app_stage + (size_t)pl * page + rb0 * rb, pitch,
                                   (size_t)(re - rb0) * rb, 2 * (size_t)g.kvh,
                                   cudaMemcpyDeviceToHost, f->ds),
                 "device-to-host store write");
    }
    FKV_CUDA(cudaEventRecord(f->e_d2h, f->ds), "record store writes");
    f->d2h_page = p0;
    f->tokens += n;
    return record_last(f, st, op);
}

extern "C" enum kvcap_status kvcap_cuda_freekv_attend(struct kvcap_cuda_freekv *f, const float *q,
                                                      float scale, struct kvcap_partial acc,
                                                      void *stream)
{
    const char *op = "freekv attend";
    KVCAP_RETURN_IF(!f, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: state is NULL", op);
    KVCAP_RETURN_IF(!q, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: q is NULL", op);
    KVCAP_RETURN_IF(!acc.mx || !acc.sum || !acc.o, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: partial pointer acc.%s is NULL", op,
                    !acc.mx ? "mx" : !acc.sum ? "sum" : "o");
    KVCAP_RETURN_IF(f->attended, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: attend called twice in step %lld (step_done closes a step)", op,
                    (long long)f->step);
    const geom &g = f->g;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (f->plan_pending) { // no append since step_done: drop the plan, keep its reads ordered
        f->plan_pending = 0;
        FKV_CUDA(cudaStreamWaitEvent(st, f->e_plan, 0), "order after the dropped plan");
    }
    const int spec_valid = f->recall_issued && f->recall_tokens == f->tokens;
    const int adopt = f->recall_issued;
    if (f->recall_issued) {
        judge_hidden(f, 0); // the previous one, if it could not be compared yet
        if (spec_valid)
            FKV_CUDA(cudaEventRecord(f->e_need, st), "record attention ready");
        FKV_CUDA(cudaStreamWaitEvent(st, f->e_recall, 0), "wait for the speculative recall");
        f->hidden_pending = spec_valid;
        f->recall_issued = 0;
    }
    // the previous step's queries stay in q[1 - qcur]
    const int prev_valid = f->q_step >= 0 && f->q_step == f->step - 1;
    f->qcur = 1 - f->qcur;
    float *qc = at<float>(f, f->qcur ? f->off.q1 : f->off.q0);
    const float *qp = at<float>(f, f->qcur ? f->off.q0 : f->off.q1);
    FKV_CUDA(cudaMemcpyAsync(qc, q, (size_t)g.kvh * g.G * g.d * sizeof(float),
                             cudaMemcpyDeviceToDevice, st),
             "query copy");
    f->q_step = f->step;
    f->attended = 1;
    if (f->tokens == 0) { // nothing to attend; the recall's bookkeeping is still adopted
        if (adopt)
            FKV_CUDA(cudaMemcpyAsync(at<int>(f, f->off.meta), at<int>(f, f->off.meta_in),
                                     (size_t)g.kvh * meta_ints(g.slots) * sizeof(int),
                                     cudaMemcpyDeviceToDevice, st),
                     "bookkeeping adoption");
        FKV_CUDA(cudaEventRecord(f->e_corr, st), "record corrections");
        return record_last(f, st, op);
    }
    const int np = (int)pages_for(f->tokens, g.ps);
    int lo, hi;
    candidates(g.S, g.W, np, &lo, &hi);
    const int nc = hi - lo, npick = nc < f->L.k ? nc : f->L.k;
    if (f->d2h_page >= 0 && f->d2h_page < hi) // the gather may read pages still being written
        FKV_CUDA(cudaStreamWaitEvent(st, f->e_d2h, 0), "wait for the store writes");
    const int mode = f->p.tau >= 1 ? 1 : f->p.tau <= -1 ? 2 : 0;
    int *meta = at<int>(f, f->off.meta), *flag = at<int>(f, f->off.flag);
    int *keep = at<int>(f, f->off.keep), *sel = at<int>(f, f->off.sel_c);
    unsigned long long *cnt = at<unsigned long long>(f, f->off.cnt);
    check_kernel<<<(unsigned)g.kvh, FKV_THREADS, 0, st>>>(g, qc, qp, prev_valid, mode, f->p.tau,
                                                          adopt, spec_valid, npick, meta,
                                                          at<int>(f, f->off.meta_in), flag, keep,
                                                          cnt);
    KVCAP_CUDA_CHECK_LAUNCH(op, "check kernel");
    KVCAP_TRY(select_pages(f, qc, keep, lo, nc, npick, at<float>(f, f->off.key_c),
                           at<double>(f, f->off.raw_c), at<double>(f, f->off.mean_c), sel, st,
                           op));
    fill_kernel<<<(unsigned)g.kvh, FKV_THREADS, 0, st>>>(
        g, f->L.row_bytes, flag, sel, lo, npick, meta, at<uint4>(f, f->off.pool_k),
        at<uint4>(f, f->off.pool_v), f->store_dev, cnt);
    KVCAP_CUDA_CHECK_LAUNCH(op, "fill kernel");
    FKV_CUDA(cudaEventRecord(f->e_corr, st), "record corrections");

    const int P = f->L.attend_pages;
    float *parts = at<float>(f, f->off.parts);
    kvcap_cuda_rows_problem *probs = at<kvcap_cuda_rows_problem>(f, f->off.probs);
    describe_kernel<<<(unsigned)g.kvh, 128, 0, st>>>(
        g, f->L.row_bytes, f->tokens, np, lo, hi, meta, at<unsigned char>(f, f->off.pool_k),
        at<unsigned char>(f, f->off.pool_v), qc, parts, P, probs);
    KVCAP_CUDA_CHECK_LAUNCH(op, "describe kernel");
    KVCAP_TRY(kvcap_cuda_attend_rows(probs, g.kvh * P, g.ps, f->dt, g.G, g.d, scale,
                                     at<void>(f, f->off.attn), f->off.attn_bytes, st));
    merge_pages_kernel<<<dim3((unsigned)g.G, (unsigned)g.kvh), 128, 0, st>>>(g, parts, P, acc);
    KVCAP_CUDA_CHECK_LAUNCH(op, "merge kernel");
    return record_last(f, st, op);
}

extern "C" enum kvcap_status kvcap_cuda_freekv_step_done(struct kvcap_cuda_freekv *f,
                                                         void *stream)
{
    const char *op = "freekv step_done";
    KVCAP_RETURN_IF(!f, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: state is NULL", op);
    const geom &g = f->g;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    close_step_kernel<<<1, 1, 0, st>>>(at<unsigned long long>(f, f->off.cnt));
    KVCAP_CUDA_CHECK_LAUNCH(op, "close kernel");
    f->step++;
    f->last_spec_pages = 0;
    const int attended = f->attended;
    f->attended = 0;
    if (!attended || f->tokens + 1 > f->max_tokens)
        return record_last(f, st, op);
    // the next step's selection, for one token more, with this step's queries
    const int np = (int)pages_for(f->tokens + 1, g.ps);
    int lo, hi;
    candidates(g.S, g.W, np, &lo, &hi);
    const int nc = hi - lo, npick = nc < f->L.k ? nc : f->L.k;
    FKV_CUDA(cudaStreamWaitEvent(f->rs, f->e_corr, 0), "order after the corrections");
    const float *qc = at<float>(f, f->qcur ? f->off.q1 : f->off.q0);
    int *sel = at<int>(f, f->off.sel_s);
    KVCAP_TRY(select_pages(f, qc, NULL, lo, nc, npick, at<float>(f, f->off.key_s),
                           at<double>(f, f->off.raw_s), at<double>(f, f->off.mean_s), sel, f->rs,
                           op));
    const int mi = meta_ints(g.slots);
    FKV_CUDA(cudaMemcpyAsync(f->mirror, at<int>(f, f->off.meta),
                             (size_t)g.kvh * mi * sizeof(int), cudaMemcpyDeviceToHost, f->rs),
             "bookkeeping download");
    if (npick > 0)
        FKV_CUDA(cudaMemcpy2DAsync(f->mirror + (size_t)g.kvh * mi, (size_t)g.cap * sizeof(int),
                                   sel, (size_t)g.cap * sizeof(int), (size_t)npick * sizeof(int),
                                   (size_t)g.kvh, cudaMemcpyDeviceToHost, f->rs),
                 "selection download");
    FKV_CUDA(cudaEventRecord(f->e_plan, f->rs), "record the plan");
    f->plan_pending = 1;
    f->plan_tokens = f->tokens + 1;
    f->plan_n = npick;
    f->plan_lo = lo;
    return record_last(f, st, op);
}

extern "C" enum kvcap_status kvcap_cuda_freekv_stats(struct kvcap_cuda_freekv *f,
                                                     struct kvcap_cuda_freekv_stats *out)
{
    const char *op = "freekv stats";
    KVCAP_RETURN_IF(!f || !out, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: %s is NULL", op,
                    !f ? "state" : "out");
    memset(out, 0, sizeof *out);
    KVCAP_TRY(issue_recall(f));
    KVCAP_TRY(sync_all(f, op));
    judge_hidden(f, 1);
    unsigned long long c[FKV_CNT];
    FKV_CUDA(cudaMemcpy(c, at<unsigned long long>(f, f->off.cnt), sizeof c,
                        cudaMemcpyDeviceToHost),
             "counter download");
    const uint64_t phb = f->L.page_head_bytes;
    struct kvcap_freekv_stats &b = out->base;
    b.steps = f->step;
    b.corrections = (int64_t)c[0];
    b.resyncs = (int64_t)c[1];
    b.pages_recalled = (int64_t)c[2] + f->spec_pages;
    b.bytes_recalled = (uint64_t)b.pages_recalled * phb;
    b.last_corrections = (int)c[3];
    b.last_resyncs = (int)c[4];
    b.last_pages_recalled = (int)(c[5] + (unsigned long long)f->last_spec_pages);
    b.last_bytes_recalled = (uint64_t)b.last_pages_recalled * phb;
    out->spec_recalls = f->spec_recalls;
    out->spec_hidden = f->spec_hidden;
    return KVCAP_OK;
}

extern "C" void kvcap_cuda_freekv_bytes_held(const struct kvcap_cuda_freekv *f, uint64_t *host,
                                             uint64_t *device)
{
    if (host)
        *host = f ? f->L.host_bytes : 0;
    if (device)
        *device = f ? f->L.device_bytes +
                          (uint64_t)f->app_stage_pages * f->g.kvh * f->L.page_head_bytes
                    : 0;
}

extern "C" enum kvcap_status kvcap_cuda_freekv_digest(struct kvcap_cuda_freekv *f, int h, int page,
                                                      float *kmax, float *kmin)
{
    const char *op = "freekv digest";
    KVCAP_RETURN_IF(!f || !kmax || !kmin, KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: %s is NULL", op,
                    !f ? "state" : !kmax ? "kmax" : "kmin");
    KVCAP_RETURN_IF(h < 0 || h >= f->g.kvh, KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: h = %d out of range", op, h);
    KVCAP_RETURN_IF(page < 0 || page >= pages_for(f->tokens, f->g.ps), KVCAP_ERR_INVALID_ARGUMENT,
                    "cuda %s: page = %d out of range", op, page);
    KVCAP_TRY(sync_all(f, op));
    const float *dg = at<float>(f, f->off.dig) + (((size_t)h * f->g.cap + page) * 2) * f->g.d;
    FKV_CUDA(cudaMemcpy(kmax, dg, sizeof(float) * f->g.d, cudaMemcpyDeviceToHost), "digest copy");
    FKV_CUDA(cudaMemcpy(kmin, dg + f->g.d, sizeof(float) * f->g.d, cudaMemcpyDeviceToHost),
             "digest copy");
    return KVCAP_OK;
}

extern "C" int kvcap_cuda_freekv_selection(struct kvcap_cuda_freekv *f, int h, int *pages,
                                           int cap)
{
    const char *op = "freekv selection";
    if (!f || h < 0 || h >= f->g.kvh || (cap > 0 && !pages)) {
        kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "cuda %s: %s", op,
                   !f ? "state is NULL" : (cap > 0 && !pages) ? "pages is NULL"
                                                               : "h out of range");
        return -1;
    }
    if (sync_all(f, op) != KVCAP_OK)
        return -1;
    const int mi = meta_ints(f->g.slots);
    int *m = static_cast<int *>(malloc(sizeof(int) * (size_t)mi));
    if (!m) {
        kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "cuda %s: out of memory", op);
        return -1;
    }
    cudaError_t e = cudaMemcpy(m, at<int>(f, f->off.meta) + (size_t)h * mi, sizeof(int) * mi,
                               cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        free(m);
        kvcap_cuda_fail(e, op, "bookkeeping copy", __FILE__, __LINE__);
        return -1;
    }
    // Slots hold the picks in fill order (a page kept in place keeps its slot): ascending,
    // as documented, by insertion.
    const int cur = m[2 * f->g.slots + 2], n = m[2 * f->g.slots + cur];
    for (int s = 0; s < n; s++) {
        const int p = m[cur * f->g.slots + s];
        int i = s < cap ? s : cap;
        while (i > 0 && pages[i - 1] > p) {
            if (i < cap)
                pages[i] = pages[i - 1];
            i--;
        }
        if (i < cap)
            pages[i] = p;
    }
    free(m);
    return n;
}
