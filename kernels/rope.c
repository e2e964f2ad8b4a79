/* rope.c — rotary position embedding by a scalar position (see rope.h). The _ref version
 * computes every angle per row; the fast one computes cos/sin once per call and applies them to
 * all rows (the position is shared), which is what offset normalisation needs. */
#include <math.h>
#include <stdlib.h>

#include "kernels/rope.h"

int kvcap_rope_dim(const struct kvcap_model_geometry *g)
{
    return g->rope_dim ? g->rope_dim : g->head_dim;
}

void kvcap_rope_pair(const struct kvcap_model_geometry *g, int i, int *a, int *b)
{
    if (g->rope_pairing == KVCAP_ROPE_PAIRING_ADJACENT) {
        *a = 2 * i;
        *b = 2 * i + 1;
    } else {
        *a = i;
        *b = i + kvcap_rope_dim(g) / 2;
    }
}

void kvcap_rope_rotate_ref(const struct kvcap_model_geometry *g, float *x, size_t rows,
                           size_t row_stride, double pos)
{
    if (g->rope_type == KVCAP_ROPE_NONE)
        return;
    int half = kvcap_rope_dim(g) / 2;
    for (size_t r = 0; r < rows; r++) {
        float *row = x + r * row_stride;
        for (int i = 0; i < half; i++) {
            double inv_freq = pow(g->rope_theta, -2.0 * i / (double)kvcap_rope_dim(g));
            double angle = pos * inv_freq;
            int a, b;
            kvcap_rope_pair(g, i, &a, &b);
            double xa = row[a], xb = row[b];
            row[a] = (float)(xa * cos(angle) - xb * sin(angle));
            row[b] = (float)(xa * sin(angle) + xb * cos(angle));
        }
    }
}

void kvcap_rope_rotate(const struct kvcap_model_geometry *g, float *x, size_t rows,
                       size_t row_stride, double pos)
{
    if (g->rope_type == KVCAP_ROPE_NONE || rows == 0)
        return;
    int half = kvcap_rope_dim(g) / 2;
    float cs[2 * 128]; /* head_dim <= 256, so at most 128 pairs */
    for (int i = 0; i < half; i++) {
        double angle = pos * pow(g->rope_theta, -2.0 * i / (double)kvcap_rope_dim(g));
        cs[2 * i] = (float)cos(angle);
        cs[2 * i + 1] = (float)sin(angle);
    }
    for (size_t r = 0; r < rows; r++) {
        float *row = x + r * row_stride;
        if (g->rope_pairing == KVCAP_ROPE_PAIRING_ADJACENT) {
            for (int i = 0; i < half; i++) {
                float xa = row[2 * i], xb = row[2 * i + 1];
                row[2 * i] = xa * cs[2 * i] - xb * cs[2 * i + 1];
                row[2 * i + 1] = xa * cs[2 * i + 1] + xb * cs[2 * i];
            }
        } else {
            float *lo = row, *hi = row + half;
            for (int i = 0; i < half; i++) {
                float xa = lo[i], xb = hi[i];
                lo[i] = xa * cs[2 * i] - xb * cs[2 * i + 1];
                hi[i] = xa * cs[2 * i + 1] + xb * cs[2 * i];
            }
        }
    }
}
