// select.cu — top-k selection on a CUDA device (select_cuda.h): the twin of
// kernels/select.h's kvcap_topk_indices, for a batch of rows at once. A radix select over
// order keys that rank scores exactly as the CPU does, then a compaction in index order.
#include <math.h>

#include <cub/block/block_scan.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/select_cuda.h"

// ---- Top-k ------------------------------------------------------------------------------------

#define TOPK_THREADS 512

// An unsigned key whose order is the CPU's ranking of scores: NaN lowest (key 0, which no
// number maps to: only a NaN has all bits set), −0 folded onto +0 (the CPU compares them
// equal), then the usual sign-magnitude flip. Equal keys are ties, broken by index later.
__device__ __forceinline__ unsigned order_key(float s)
{
    if (isnan(s))
        return 0u;
    if (s == 0.0f)
        s = 0.0f;
    const unsigned u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One block per row. Radix select, 8 bits at a time from the top, finds the key T of the k-th
// ranked score and how many scores equal to T are kept (`need`: those with the lowest indices,
// as the CPU breaks ties); the compaction pass then walks the row in index order and writes
// every kept index at its rank among the kept ones, so the output is ascending.
__global__ void __launch_bounds__(TOPK_THREADS)
    topk_kernel(const float *__restrict__ score, size_t ld_score, int n, int keep,
                const int *__restrict__ keep_per_row, int *__restrict__ idx, size_t ld_idx)
{
    typedef cub::BlockScan<int, TOPK_THREADS> Scan;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ unsigned hist[256];
    __shared__ unsigned s_prefix;
    __shared__ int s_rem;
    const size_t row = blockIdx.x;
    const float *s = score + row * ld_score;
    int *out = idx + row * ld_idx;
    int k = keep_per_row ? keep_per_row[row] : keep;
    k = k < 0 ? 0 : k > n ? n : k;
    if (k == 0)
        return;
    if (k == n) {
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            out[i] = i;
        return;
    }
    unsigned prefix = 0, mask = 0;
    int rem = k; // scores still to take among those whose key starts with `prefix`
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x)
            hist[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned u = order_key(s[i]);
            if ((u & mask) == prefix)
                atomicAdd(&hist[(u >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // from the top digit down, skip whole bins while they hold fewer than rem
            int above = 0, digit = 255;
            for (; digit > 0; digit--) {
                if (above + (int)hist[digit] >= rem)
                    break;
                above += (int)hist[digit];
            }
            s_prefix = prefix | ((unsigned)digit << shift);
            s_rem = rem - above;
        }
        __syncthreads();
        prefix = s_prefix;
        rem = s_rem;
        mask |= 0xFFu << shift;
        __syncthreads(); // s_prefix and hist are rewritten in the next round
    }
    const unsigned T = prefix;
    const int need = rem;
    int carry_eq = 0, carry_sel = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const unsigned u = i < n ? order_key(s[i]) : 0u;
        const int eq = i < n && u == T, gt = i < n && u > T;
        int eq_before, eq_total, pos, sel_total;
        Scan(scan_tmp).ExclusiveSum(eq, eq_before, eq_total);
        __syncthreads();
        const int sel = gt || (eq && carry_eq + eq_before < need);
        Scan(scan_tmp).ExclusiveSum(sel, pos, sel_total);
        __syncthreads();
        if (sel)
            out[carry_sel + pos] = i;
        carry_eq += eq_total;
        carry_sel += sel_total;
        if (carry_sel >= k) // block-uniform: totals are the same in every thread
            break;
    }
}

extern "C" enum kvcap_status kvcap_cuda_topk(const float *score, size_t ld_score, int n, int batch,
                                             int keep, const int *keep_per_row, int *idx,
                                             size_t ld_idx, void *stream)
{
    const char *fn = "kvcap_cuda_topk";
    KVCAP_RETURN_IF(!score, KVCAP_ERR_INVALID_ARGUMENT, "%s: score is NULL", fn);
    KVCAP_RETURN_IF(!idx, KVCAP_ERR_INVALID_ARGUMENT, "%s: idx is NULL", fn);
    KVCAP_RETURN_IF(n < 0, KVCAP_ERR_INVALID_ARGUMENT, "%s: n = %d is negative", fn, n);
    KVCAP_RETURN_IF(batch < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: batch = %d, must be >= 1", fn,
                    batch);
    const size_t widest = keep_per_row ? (size_t)n : (size_t)(keep < 0 ? 0 : keep < n ? keep : n);
    KVCAP_RETURN_IF(batch > 1 && ld_score < (size_t)n, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: ld_score = %zu is less than n = %d", fn, ld_score, n);
    KVCAP_RETURN_IF(batch > 1 && ld_idx < widest, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: ld_idx = %zu is less than the %zu indices a row may keep", fn, ld_idx,
                    widest);
    if (n == 0 || (!keep_per_row && keep <= 0))
        return KVCAP_OK; // nothing is kept: nothing to enqueue
    topk_kernel<<<(unsigned)batch, TOPK_THREADS, 0, (cudaStream_t)stream>>>(
        score, ld_score, n, keep, keep_per_row, idx, ld_idx);
    KVCAP_CUDA_CHECK_LAUNCH("topk", "select kernel");
    return KVCAP_OK;
}
