/* test_cuda.h — what the GPU tests share: the check of calls whose host-side argument checks
 * run with or without CUDA built in, and, with CUDA, error checks and device allocations that
 * are freed together at the end of a test. Include after <cmocka.h>. */
#ifndef KVCAP_TEST_CUDA_H
#define KVCAP_TEST_CUDA_H

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "kvcap.h"

#ifdef KVCAP_WITH_CUDA
#  define BUILT_WITH_CUDA 1
#  include <cuda_runtime.h>
#else
#  define BUILT_WITH_CUDA 0
#endif

/* With CUDA built in, `got` must be `want` and the message must name `what`; without, every
 * call is KVCAP_ERR_UNSUPPORTED saying the build has no CUDA. */
static inline void expect_status(enum kvcap_status got, enum kvcap_status want, const char *what,
                                 const char *call)
{
    const char *msg = kvcap_last_error();
    if (!BUILT_WITH_CUDA) {
        if (got != KVCAP_ERR_UNSUPPORTED || !strstr(msg, "no CUDA"))
            fail_msg("%s: status %d, message '%s' (want unsupported, no CUDA)", call, (int)got,
                     msg);
        return;
    }
    if (got != want)
        fail_msg("%s: status %s, want %s ('%s')", call, kvcap_status_str(got),
                 kvcap_status_str(want), msg);
    if (want != KVCAP_OK && !strstr(msg, what))
        fail_msg("%s: message '%s' does not name '%s'", call, msg, what);
}

#define EXPECT(call, want, what) expect_status((call), (want), (what), #call)

/* Without a CUDA device: runs the host-side tests (argument checks touch no device) and returns
 * the program's exit status, 1 when one failed, else 77 (skipped). With a device: returns -1,
 * and main goes on to its device tests. */
static inline int run_without_device(const struct CMUnitTest *host_tests, size_t n)
{
    if (kvcap_cuda_device_count() > 0)
        return -1;
    if (_cmocka_run_group_tests("no device", host_tests, n, NULL, NULL))
        return 1;
    printf("SKIP: no CUDA device\n");
    return 77;
}
#define RUN_WITHOUT_DEVICE(tests) run_without_device((tests), sizeof(tests) / sizeof((tests)[0]))

#ifdef KVCAP_WITH_CUDA

#  define CUDA_OK(call)                                                                        \
      do {                                                                                     \
          cudaError_t e_ = (call);                                                             \
          if (e_ != cudaSuccess)                                                               \
              fail_msg("%s: %s", #call, cudaGetErrorString(e_));                               \
      } while (0)

#  define KV_OK(call)                                                                          \
      do {                                                                                     \
          enum kvcap_status kv_st_ = (call);                                                   \
          if (kv_st_ != KVCAP_OK)                                                              \
              fail_msg("%s: %s (%s)", #call, kvcap_status_str(kv_st_), kvcap_last_error());    \
      } while (0)

/* Untracked device memory, for tests that free their buffers themselves, and copies both ways. */
static inline void *dalloc(size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

static inline void upload(void *dst, const void *src, size_t bytes)
{
    CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

static inline void download(void *dst, const void *src, size_t bytes)
{
    CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

/* All bits set: NaN as a float or a double, -1 as an integer. */
static inline void poison(void *p, size_t bytes)
{
    CUDA_OK(cudaMemset(p, 0xFF, bytes));
}

/* Device allocations of the running test, freed together by dev_free_all. */
enum { MAX_DEV_PTRS = 4096 };
static void *dev_ptrs[MAX_DEV_PTRS] __attribute__((unused));
static int n_dev_ptrs __attribute__((unused));

/* Device memory filled with 0xFF bytes: NaN as f32, so unwritten elements show. */
static inline void *dev_poisoned(size_t bytes)
{
    assert_true(n_dev_ptrs < MAX_DEV_PTRS);
    void *p = dalloc(bytes);
    poison(p, bytes ? bytes : 1);
    dev_ptrs[n_dev_ptrs++] = p;
    return p;
}

/* A device copy of `bytes` of host memory. */
static inline void *dev_upload(const void *src, size_t bytes)
{
    void *p = dev_poisoned(bytes);
    if (bytes)
        upload(p, src, bytes);
    return p;
}

/* Waits for stream s; a fault in its kernels, or a pending launch error, fails the test. */
static inline void sync_ok(cudaStream_t s)
{
    cudaError_t e = cudaStreamSynchronize(s);
    if (e != cudaSuccess)
        fail_msg("stream: %s", cudaGetErrorString(e));
    assert_int_equal(cudaGetLastError(), cudaSuccess);
}

static inline void dev_free_all(void)
{
    for (int i = 0; i < n_dev_ptrs; i++)
        CUDA_OK(cudaFree(dev_ptrs[i]));
    n_dev_ptrs = 0;
}

#endif /* KVCAP_WITH_CUDA */

#endif
