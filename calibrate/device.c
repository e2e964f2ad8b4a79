/* device.c — choosing where calibration runs: the --device names, and what "auto" becomes. */
#include <string.h>

#include "calibrate/calib_cuda.h"
#include "common/internal.h"

static const char *const device_names[] = {"auto", "cpu", "cuda"};

int kvcap_calib_device_parse(const char *s, enum kvcap_calib_device *out)
{
    for (int i = 0; s && i < (int)(sizeof device_names / sizeof device_names[0]); i++)
        if (strcmp(s, device_names[i]) == 0) {
            *out = (enum kvcap_calib_device)i;
            return 1;
        }
    return 0;
}

const char *kvcap_calib_device_name(enum kvcap_calib_device d)
{
    return (unsigned)d < sizeof device_names / sizeof device_names[0] ? device_names[d] : "?";
}

const char *kvcap_calib_cuda_unavailable(void)
{
    if (!kvcap_calib_cuda_built())
        return "this build of kvcap has no CUDA support (configured with KVCAP_CUDA=OFF)";
    if (kvcap_cuda_device_count() == 0)
        return "no CUDA device is visible to this process";
    return NULL;
}

enum kvcap_status kvcap_calib_device_resolve(enum kvcap_calib_device want,
                                             enum kvcap_calib_device *out)
{
    const char *why = kvcap_calib_cuda_unavailable();
    switch (want) {
    case KVCAP_CALIB_DEVICE_AUTO:
        *out = why ? KVCAP_CALIB_DEVICE_CPU : KVCAP_CALIB_DEVICE_CUDA;
        return KVCAP_OK;
    case KVCAP_CALIB_DEVICE_CPU:
        *out = KVCAP_CALIB_DEVICE_CPU;
        return KVCAP_OK;
    case KVCAP_CALIB_DEVICE_CUDA:
        KVCAP_RETURN_IF(why, KVCAP_ERR_UNSUPPORTED, "device cuda: %s", why);
        *out = KVCAP_CALIB_DEVICE_CUDA;
        return KVCAP_OK;
    }
    return kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "device: unknown value %d", (int)want);
}
