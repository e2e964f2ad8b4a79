/* consumer.c — a minimal engine-side program built against the installed libkvcap only. */
#include <stdio.h>
#include <string.h>

#include <kvcap.h>

int main(void)
{
    if (kvcap_version_number() != KVCAP_VERSION_NUMBER) {
        fprintf(stderr, "header %s but library %s\n", KVCAP_VERSION_STRING, kvcap_version());
        return 1;
    }
    struct kvcap_model_geometry g = {.n_layers = 30, .n_q_heads = 9, .n_kv_heads = 3,
                                     .head_dim = 64, .rope_type = KVCAP_ROPE_ROPE,
                                     .rope_theta = 1e5};
    if (kvcap_geometry_validate(&g) != KVCAP_OK) {
        fprintf(stderr, "valid geometry rejected: %s\n", kvcap_last_error());
        return 1;
    }
    g.head_dim = 63;
    if (kvcap_geometry_validate(&g) != KVCAP_ERR_GEOMETRY || !strstr(kvcap_last_error(), "head_dim")) {
        fprintf(stderr, "invalid geometry accepted\n");
        return 1;
    }
    printf("linked libkvcap %s (%s), %d CUDA device(s)\n", kvcap_version(),
           kvcap_status_str(KVCAP_OK), kvcap_cuda_device_count());
    return 0;
}
