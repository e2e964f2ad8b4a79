/* activation.h — φ of the key reconstructor: GELU in the tanh form used by GPT-2-style models,
 * shared by calibration (training) and the runtime (prefill). */
#ifndef KVCAP_ACTIVATION_H
#define KVCAP_ACTIVATION_H

float kvcap_gelu(float x);
float kvcap_gelu_grad(float x); /* d GELU / dx */

#endif
