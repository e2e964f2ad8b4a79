/* test_cuda_device.c — device discovery: without a GPU (or without CUDA in the build) there are
 * zero devices and the test reports itself skipped (exit 77); with one, the count is sane. */
#include <stdio.h>

#include "kvcap.h"

int main(void)
{
    int n = kvcap_cuda_device_count();
    if (n < 0) {
        fprintf(stderr, "FAIL: kvcap_cuda_device_count returned %d\n", n);
        return 1;
    }
    if (n == 0) {
        printf("SKIP: no CUDA device (zero devices is not an error)\n");
        return 77;
    }
    printf("%d CUDA device(s)\n", n);
    return kvcap_cuda_device_count() == n ? 0 : 1;
}
