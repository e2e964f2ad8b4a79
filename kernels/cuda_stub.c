/* cuda_stub.c — device queries of a build without CUDA: there are simply no devices. */
#include "kvcap.h"

int kvcap_cuda_device_count(void)
{
    return 0;
}
