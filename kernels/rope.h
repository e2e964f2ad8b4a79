/* rope.h — rotary position embedding applied to rows of head_dim channels, as the engine does
 * (DESIGN §4): used to undo a span's start offset (K' = R(-p0) K, q' = R(-p0) q) and, in the
 * synthetic data generator, to apply it. */
#ifndef KVCAP_ROPE_H
#define KVCAP_ROPE_H

#include <stddef.h>

#include "kvcap.h"

/* Rotates `rows` rows of x (row i at x + i*row_stride, head_dim floats each) by the scalar
 * position `pos` (may be negative), using g's pairing, rope_dim and theta. A uniform offset on
 * all M-RoPE sections is the same rotation, so MROPE takes this path too. ROPE_NONE: no-op.
 * Angles are computed in double so that R(-p) R(p) = I to float rounding for p up to 2^24. */
void kvcap_rope_rotate_ref(const struct kvcap_model_geometry *g, float *x, size_t rows,
                           size_t row_stride, double pos);
void kvcap_rope_rotate(const struct kvcap_model_geometry *g, float *x, size_t rows,
                       size_t row_stride, double pos);

/* The rotated channels (g->rope_dim, or head_dim when 0) and the channel indices a, b of
 * rotation pair i (i < rope_dim / 2), by g's pairing; pair i turns at inverse frequency
 * theta^(-2i / rope_dim). */
int kvcap_rope_dim(const struct kvcap_model_geometry *g);
void kvcap_rope_pair(const struct kvcap_model_geometry *g, int i, int *a, int *b);

#endif
