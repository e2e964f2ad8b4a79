// rope.cuh — RoPE's device form (the twin of kernels/rope.h): one channel of a row rotated
// by a span's offset table, as kvcap_rope_rotate computes it on the host. Used by KVCapsule's
// prefill (keys, kernels/cuda/capsule_prefill.cu) and the device store's query preparation
// (runtime/cache_cuda.cu); the oracle and its test are kernels/rope.h and tests/test_rope.c,
// the device form is checked through tests/test_runtime_cuda.c against the host store.
#ifndef KVCAP_ROPE_CUH
#define KVCAP_ROPE_CUH

#include "kernels/cuda/capsule_prefill_cuda.h" /* struct kvcap_cuda_rope */
#include "kernels/cuda/common.cuh"

// Channel c of a row rotated by the table rr (row[a] = cos, row[b] = sin of pair (a, b)), with
// the products and the sum rounded one by one as kvcap_rope_rotate does on the host.
static __device__ __forceinline__ float kvcap_cuda_rope_rotated(const void *row, int dtype, int c,
                                                                const struct kvcap_cuda_rope &r,
                                                                const float *rr)
{
    if (!r.on || c >= r.rope_dim)
        return kvcap_cuda_load_any(row, (size_t)c, dtype);
    int a, b;
    bool first;
    if (r.adjacent) {
        a = c & ~1;
        b = a + 1;
        first = (c & 1) == 0;
    } else {
        const int half = r.rope_dim / 2;
        first = c < half;
        a = first ? c : c - half;
        b = a + half;
    }
    const float xa = kvcap_cuda_load_any(row, (size_t)a, dtype),
                xb = kvcap_cuda_load_any(row, (size_t)b, dtype);
    const float cs = rr[a], sn = rr[b];
    return first ? __fsub_rn(__fmul_rn(xa, cs), __fmul_rn(xb, sn))
                 : __fadd_rn(__fmul_rn(xa, sn), __fmul_rn(xb, cs));
}

#endif /* KVCAP_ROPE_CUH */
