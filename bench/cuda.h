/* cuda.h — the device helpers of kvcap-bench-cuda (bench/cuda_util.cu) that the
 * CUDA runtime has no call for: filling a buffer with reproducible random values in a storage
 * dtype, reading a buffer without writing it (to push a benchmark's data out of the L2 cache
 * without leaving dirty lines whose write-back would land in the next timed call), and keeping
 * the device busy for a set time (the rest of a model layer's work around the measured calls).
 * All only enqueue work on `stream` (a cudaStream_t) and return the launch's error. */
#ifndef KVCAP_BENCH_CUDA_H
#define KVCAP_BENCH_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "kvcap.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dst[i] = lo + (hi - lo) * u_i, u_i uniform in [0, 1) from a hash of (seed, i), stored as
 * dtype (F32, F16 or BF16; anything else is cudaErrorInvalidValue). dst: device, n elements. */
cudaError_t kvcap_bench_fill(void *dst, enum kvcap_dtype dtype, size_t n, uint64_t seed, float lo,
                             float hi, cudaStream_t stream);

/* Reads bytes (a multiple of 16) at buf (device, 16-byte aligned) and writes nothing but, in
 * practice never, one word to *sink (device): the loads cannot be optimised away. */
cudaError_t kvcap_bench_read(const void *buf, size_t bytes, unsigned *sink, cudaStream_t stream);

/* `blocks` blocks of 256 threads, each spinning on the device's global nanosecond timer until
 * `us` microseconds have passed since it started (us <= 0: nothing is launched). With one block
 * per SM every SM is busy for that long, with room left for other streams' kernels beside it. */
cudaError_t kvcap_bench_busy(double us, int blocks, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
