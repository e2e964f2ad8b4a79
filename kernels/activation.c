/* activation.c — GELU (tanh form) and its derivative; see activation.h. */
#include <math.h>

#include "kernels/activation.h"

/* GELU with the tanh approximation used by GPT-2-style models. */
float kvcap_gelu(float x)
{
    const float c = 0.7978845608028654f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

float kvcap_gelu_grad(float x)
{
    const float c = 0.7978845608028654f;
    float u = c * (x + 0.044715f * x * x * x);
    float t = tanhf(u);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * x * x);
}
