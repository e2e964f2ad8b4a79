// device.cu — device discovery for CUDA builds: no driver or no GPU means zero devices.
#include <cuda_runtime.h>

#include "kvcap.h"

extern "C" int kvcap_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); // clear the sticky error so later calls start clean
        return 0;
    }
    return n;
}
