/* expected.c — Expected Attention's scoring (see expected.h). The fast version forms each query
 * head's covariance with one sgemm over its centred queries, rotates it by the pairs' mean
 * rotations in place (rows, then columns: R̄ is block-diagonal, 2x2 per pair), and scores the
 * keys with one sgemm (K Σ') and a row-wise dot; the oracle does every sum in double. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "common/internal.h"
#include "kernels/expected.h"
#include "kernels/rope.h"

enum kvcap_status kvcap_expected_rotation(const struct kvcap_model_geometry *g, int64_t p,
                                          int n_future, double *cs)
{
    const char *fn = "kvcap_expected_rotation";
    KVCAP_RETURN_IF(!g || !cs, KVCAP_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    KVCAP_RETURN_IF(n_future < 1 || p < 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: n_future = %d, p = %lld (need n_future >= 1, p >= 0)", fn, n_future,
                    (long long)p);
    KVCAP_RETURN_IF(g->rope_type == KVCAP_ROPE_MROPE, KVCAP_ERR_UNSUPPORTED,
                    "%s: M-RoPE (future positions are not one scalar per token)", fn);
    const int half = kvcap_rope_dim(g) / 2;
    for (int i = 0; i < half; i++) {
        double c = 0, s = 0;
        const double w = pow(g->rope_theta, -2.0 * i / (double)kvcap_rope_dim(g));
        for (int t = 0; t < n_future; t++) {
            c += cos((double)(p + t) * w);
            s += sin((double)(p + t) * w);
        }
        cs[2 * i] = g->rope_type == KVCAP_ROPE_NONE ? 1.0 : c / n_future;
        cs[2 * i + 1] = g->rope_type == KVCAP_ROPE_NONE ? 0.0 : s / n_future;
    }
    return KVCAP_OK;
}

static enum kvcap_status check_args(const char *fn, const struct kvcap_model_geometry *g,
                                    const float *q, int n, int G, const double *cs,
                                    const float *k, const float *v, int m, float scale,
                                    const float *score)
{
    KVCAP_RETURN_IF(!g || !q || !cs || !k || !v || !score, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: NULL argument", fn);
    KVCAP_RETURN_IF(n < 1 || m < 1 || G < 1 || g->head_dim < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: n = %d, m = %d, G = %d, d = %d (each must be >= 1)", fn, n, m, G,
                    g->head_dim);
    KVCAP_RETURN_IF(!isfinite(scale), KVCAP_ERR_INVALID_ARGUMENT, "%s: scale = %g is not finite",
                    fn, (double)scale);
    return KVCAP_OK;
}

/* ---- Oracle -------------------------------------------------------------------------------- */

/* R̄ as a dense d x d matrix: the pairs' 2x2 mean rotations, identity elsewhere. */
static void rotation_matrix(const struct kvcap_model_geometry *g, const double *cs, double *R)
{
    const int d = g->head_dim;
    memset(R, 0, sizeof(double) * (size_t)d * d);
    for (int c = 0; c < d; c++)
        R[(size_t)c * d + c] = 1.0;
    for (int i = 0; i < kvcap_rope_dim(g) / 2; i++) {
        int a, b;
        kvcap_rope_pair(g, i, &a, &b);
        R[(size_t)a * d + a] = cs[2 * i], R[(size_t)a * d + b] = -cs[2 * i + 1];
        R[(size_t)b * d + a] = cs[2 * i + 1], R[(size_t)b * d + b] = cs[2 * i];
    }
}

enum kvcap_status kvcap_expected_head_ref(const struct kvcap_model_geometry *g, const float *q,
                                          size_t q_stride, int n, int G, const double *cs,
                                          const float *k, const float *v, int m, float scale,
                                          float *score)
{
    const char *fn = "kvcap_expected_head_ref";
    KVCAP_TRY(check_args(fn, g, q, n, G, cs, k, v, m, scale, score));
    const int d = g->head_dim;
    const size_t dd = (size_t)d * d;
    double *R = malloc(sizeof(double) * dd * 3 + sizeof(double) * (size_t)d * 2 +
                       sizeof(double) * (size_t)m * 2);
    KVCAP_RETURN_IF(!R, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
    double *S = R + dd, *S2 = S + dd, *mu = S2 + dd, *mu2 = mu + d, *z = mu2 + d, *acc = z + m;
    rotation_matrix(g, cs, R);
    for (int j = 0; j < m; j++)
        acc[j] = 0;
    for (int gq = 0; gq < G; gq++) {
        for (int c = 0; c < d; c++) {
            double s = 0;
            for (int i = 0; i < n; i++)
                s += q[(size_t)i * q_stride + (size_t)gq * d + c];
            mu[c] = s / n;
        }
        for (int a = 0; a < d; a++)
            for (int b = 0; b < d; b++) {
                double s = 0;
                for (int i = 0; i < n; i++) {
                    const float *qi = q + (size_t)i * q_stride + (size_t)gq * d;
                    s += (qi[a] - mu[a]) * (qi[b] - mu[b]);
                }
                S[(size_t)a * d + b] = s / n;
            }
        /* μ' = R μ, Σ' = R Σ Rᵀ */
        for (int a = 0; a < d; a++) {
            double s = 0;
            for (int c = 0; c < d; c++)
                s += R[(size_t)a * d + c] * mu[c];
            mu2[a] = s;
        }
        for (int a = 0; a < d; a++)
            for (int b = 0; b < d; b++) {
                double s = 0;
                for (int c = 0; c < d; c++)
                    for (int e = 0; e < d; e++)
                        s += R[(size_t)a * d + c] * S[(size_t)c * d + e] * R[(size_t)b * d + e];
                S2[(size_t)a * d + b] = s;
            }
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < m; j++) {
            const float *kj = k + (size_t)j * d;
            double lin = 0, quad = 0;
            for (int a = 0; a < d; a++) {
                lin += mu2[a] * kj[a];
                for (int b = 0; b < d; b++)
                    quad += kj[a] * S2[(size_t)a * d + b] * kj[b];
            }
            z[j] = scale * lin + 0.5 * (double)scale * scale * quad;
            mx = z[j] > mx ? z[j] : mx;
        }
        for (int j = 0; j < m; j++)
            sum += exp(z[j] - mx);
        for (int j = 0; j < m; j++)
            acc[j] += exp(z[j] - mx) / sum / G;
    }
    for (int j = 0; j < m; j++) {
        double nn = 0;
        for (int c = 0; c < d; c++)
            nn += (double)v[(size_t)j * d + c] * v[(size_t)j * d + c];
        score[j] = (float)(acc[j] * sqrt(nn));
    }
    free(R);
    return KVCAP_OK;
}

/* ---- Fast version -------------------------------------------------------------------------- */

size_t kvcap_expected_scratch_floats(int n, int m, int d)
{
    if (n < 1 || m < 1 || d < 1)
        return 0;
    size_t a, b, c, total;
    if (!kvcap_mul_size((size_t)n, (size_t)d, &a) || !kvcap_mul_size((size_t)m, (size_t)d, &b) ||
        !kvcap_mul_size((size_t)d, (size_t)d, &c) || !kvcap_add_size(a, b, &total) ||
        !kvcap_add_size(total, c, &total) || !kvcap_add_size(total, 3 * (size_t)d, &total) ||
        !kvcap_add_size(total, 2 * (size_t)m, &total))
        return SIZE_MAX;
    return total;
}

/* x = R̄ x along one axis of a d x d row-major matrix (rows: stride d, step 1; columns: stride
 * 1, step d) or of a vector (count 1). */
static void rotate_axis(const struct kvcap_model_geometry *g, const double *cs, float *x,
                        int count, size_t along, size_t across)
{
    for (int i = 0; i < kvcap_rope_dim(g) / 2; i++) {
        int a, b;
        kvcap_rope_pair(g, i, &a, &b);
        const float c = (float)cs[2 * i], s = (float)cs[2 * i + 1];
        for (int r = 0; r < count; r++) {
            float *xa = x + (size_t)a * along + (size_t)r * across;
            float *xb = x + (size_t)b * along + (size_t)r * across;
            const float va = *xa, vb = *xb;
            *xa = c * va - s * vb;
            *xb = s * va + c * vb;
        }
    }
}

/* Scratch (floats): X [n][d] centred queries, KS [m][d], S [d][d], mu [d], z [m], acc [m]. */
enum kvcap_status kvcap_expected_head(const struct kvcap_model_geometry *g, const float *q,
                                      size_t q_stride, int n, int G, const double *cs,
                                      const float *k, const float *v, int m, float scale,
                                      float *score, float *scratch)
{
    const char *fn = "kvcap_expected_head";
    KVCAP_TRY(check_args(fn, g, q, n, G, cs, k, v, m, scale, score));
    KVCAP_RETURN_IF(!scratch, KVCAP_ERR_INVALID_ARGUMENT, "%s: scratch is NULL", fn);
    const int d = g->head_dim;
    float *X = scratch, *KS = X + (size_t)n * d, *S = KS + (size_t)m * d, *mu = S + (size_t)d * d;
    float *z = mu + 3 * (size_t)d, *acc = z + m;
    memset(acc, 0, sizeof(float) * (size_t)m);
    for (int gq = 0; gq < G; gq++) {
        for (int c = 0; c < d; c++) {
            double s = 0;
            for (int i = 0; i < n; i++)
                s += q[(size_t)i * q_stride + (size_t)gq * d + c];
            mu[c] = (float)(s / n);
        }
        for (int i = 0; i < n; i++)
            for (int c = 0; c < d; c++)
                X[(size_t)i * d + c] = q[(size_t)i * q_stride + (size_t)gq * d + c] - mu[c];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, d, d, n, 1.0f / (float)n, X, d, X,
                    d, 0.0f, S, d);
        rotate_axis(g, cs, mu, 1, 1, 0);          /* μ' = R̄ μ */
        rotate_axis(g, cs, S, d, (size_t)d, 1);   /* R̄ Σ: rows a, b of every column */
        rotate_axis(g, cs, S, d, 1, (size_t)d);   /* (R̄ Σ) R̄ᵀ: columns a, b of every row */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, d, d, 1.0f, k, d, S, d, 0.0f,
                    KS, d);
        float mx = -INFINITY;
        for (int j = 0; j < m; j++) {
            const float *kj = k + (size_t)j * d, *ks = KS + (size_t)j * d;
            float lin = 0, quad = 0;
            for (int c = 0; c < d; c++) {
                lin += mu[c] * kj[c];
                quad += ks[c] * kj[c];
            }
            z[j] = scale * lin + 0.5f * scale * scale * quad;
            mx = z[j] > mx ? z[j] : mx;
        }
        double sum = 0;
        for (int j = 0; j < m; j++)
            sum += exp((double)(z[j] - mx));
        const float inv = (float)(1.0 / (sum * G));
        for (int j = 0; j < m; j++)
            acc[j] += expf(z[j] - mx) * inv;
    }
    for (int j = 0; j < m; j++) {
        float nn = 0;
        for (int c = 0; c < d; c++)
            nn += v[(size_t)j * d + c] * v[(size_t)j * d + c];
        score[j] = acc[j] * sqrtf(nn);
    }
    return KVCAP_OK;
}
