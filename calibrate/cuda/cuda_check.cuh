// cuda_check.cuh — CUDA and cuBLAS errors as kvcap statuses for calibration's device code:
// CUDA_TRY / CUBLAS_TRY return a status naming the call, what it was for, the library's error
// text, and where. Out-of-memory errors become KVCAP_ERR_OUT_OF_MEMORY (so callers can fall
// back to the CPU), everything else KVCAP_ERR_DEVICE.
#ifndef KVCAP_CALIB_CUDA_CHECK_CUH
#define KVCAP_CALIB_CUDA_CHECK_CUH

#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

extern "C" {
#include "common/internal.h"
}

// "cudaMemcpy2DAsync(...)" -> length of "cudaMemcpy2DAsync", for messages naming the call.
static inline int call_name_len(const char *stmt)
{
    return (int)strcspn(stmt, "( ");
}

static inline const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static inline enum kvcap_status cuda_error(cudaError_t e, const char *stmt, const char *what,
                                           const char *file, int line)
{
    (void)cudaGetLastError(); // a non-sticky error must not be reported again by a later call
    return kvcap_fail(e == cudaErrorMemoryAllocation ? KVCAP_ERR_OUT_OF_MEMORY : KVCAP_ERR_DEVICE,
                      "cuda: %.*s (%s): %s [%s:%d]", call_name_len(stmt), stmt, what,
                      cudaGetErrorString(e), base_name(file), line);
}

static inline enum kvcap_status cublas_error(cublasStatus_t e, const char *stmt, const char *what,
                                             const char *file, int line)
{
    return kvcap_fail(e == CUBLAS_STATUS_ALLOC_FAILED ? KVCAP_ERR_OUT_OF_MEMORY : KVCAP_ERR_DEVICE,
                      "cuda: %.*s (%s): %s [%s:%d]", call_name_len(stmt), stmt, what,
                      cublasGetStatusString(e), base_name(file), line);
}

// Each evaluates `stmt` once and returns a status naming the call, `what` it was for, the
// library's error text, and where.
#define CUDA_TRY(stmt, what)                                                        \
    do {                                                                            \
        cudaError_t e_ = (stmt);                                                    \
        if (e_ != cudaSuccess)                                                      \
            return cuda_error(e_, #stmt, (what), __FILE__, __LINE__);               \
    } while (0)
#define CUBLAS_TRY(stmt, what)                                                      \
    do {                                                                            \
        cublasStatus_t e_ = (stmt);                                                 \
        if (e_ != CUBLAS_STATUS_SUCCESS)                                            \
            return cublas_error(e_, #stmt, (what), __FILE__, __LINE__);             \
    } while (0)

#endif
