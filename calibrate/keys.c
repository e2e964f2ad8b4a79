/* keys.c — key compression maps: storage, the reference reconstruction, a BLAS-backed error
 * measure, and the closed-form fit (pivoted-Cholesky mask + ridge least squares + rank-h
 * factorisation). The trained fit lives in train.c. */
#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "keys.h"
#include "linalg.h"

enum kvcap_status kvcap_key_maps_alloc(struct kvcap_key_maps *k, int m, int rk, int h, int gelu)
{
    KVCAP_RETURN_IF(!k || m < 1 || rk < 1 || rk > m || h < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "key maps: sizes m %d, rk %d, h %d (need 1 <= rk <= m, h >= 1)", m, rk, h);
    memset(k, 0, sizeof *k);
    k->m = m;
    k->rk = rk;
    k->h = h;
    k->gelu = gelu;
    k->mask = calloc((size_t)rk, sizeof *k->mask);
    k->w1 = calloc((size_t)rk * h, sizeof *k->w1);
    k->b1 = calloc((size_t)h, sizeof *k->b1);
    k->w2 = calloc((size_t)h * m, sizeof *k->w2);
    k->b2 = calloc((size_t)m, sizeof *k->b2);
    if (!k->mask || !k->w1 || !k->b1 || !k->w2 || !k->b2) {
        kvcap_key_maps_free(k);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "key maps: out of memory (m %d, rk %d, h %d)",
                          m, rk, h);
    }
    return KVCAP_OK;
}

void kvcap_key_maps_free(struct kvcap_key_maps *k)
{
    if (!k)
        return;
    free(k->mask);
    free(k->w1);
    free(k->b1);
    free(k->w2);
    free(k->b2);
    memset(k, 0, sizeof *k);
}

enum kvcap_status kvcap_key_maps_copy(struct kvcap_key_maps *dst, const struct kvcap_key_maps *src)
{
    KVCAP_TRY(kvcap_key_maps_alloc(dst, src->m, src->rk, src->h, src->gelu));
    memcpy(dst->mask, src->mask, sizeof *dst->mask * (size_t)src->rk);
    memcpy(dst->w1, src->w1, sizeof *dst->w1 * (size_t)src->rk * src->h);
    memcpy(dst->b1, src->b1, sizeof *dst->b1 * (size_t)src->h);
    memcpy(dst->w2, src->w2, sizeof *dst->w2 * (size_t)src->h * src->m);
    memcpy(dst->b2, src->b2, sizeof *dst->b2 * (size_t)src->m);
    return KVCAP_OK;
}

void kvcap_key_maps_apply_ref(const struct kvcap_key_maps *k, const float *xk, size_t ldk,
                              size_t ncols, float *hidden, float *out, size_t ldo)
{
    for (int a = 0; a < k->h; a++)
        for (size_t c = 0; c < ncols; c++) {
            double z = k->b1[a];
            for (int r = 0; r < k->rk; r++)
                z += (double)k->w1[(size_t)r * k->h + a] * xk[(size_t)r * ldk + c];
            hidden[(size_t)a * ncols + c] = k->gelu ? kvcap_gelu((float)z) : (float)z;
        }
    for (int i = 0; i < k->m; i++)
        for (size_t c = 0; c < ncols; c++) {
            double y = k->b2[i];
            for (int a = 0; a < k->h; a++)
                y += (double)k->w2[(size_t)a * k->m + i] * hidden[(size_t)a * ncols + c];
            out[(size_t)i * ldo + c] = (float)y;
        }
}

void kvcap_key_maps_apply(const struct kvcap_key_maps *k, const float *xk, size_t ldk,
                          size_t ncols, float *hidden, float *out, size_t ldo)
{
    for (int a = 0; a < k->h; a++)
        for (size_t c = 0; c < ncols; c++)
            hidden[(size_t)a * ncols + c] = k->b1[a];
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, k->h, (int)ncols, k->rk, 1.0f, k->w1,
                k->h, xk, (int)ldk, 1.0f, hidden, (int)ncols);
    if (k->gelu)
        for (size_t i = 0; i < (size_t)k->h * ncols; i++)
            hidden[i] = kvcap_gelu(hidden[i]);
    for (int i = 0; i < k->m; i++)
        for (size_t c = 0; c < ncols; c++)
            out[(size_t)i * ldo + c] = k->b2[i];
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, k->m, (int)ncols, k->h, 1.0f, k->w2,
                k->m, hidden, (int)ncols, 1.0f, out, (int)ldo);
}

enum kvcap_status kvcap_key_maps_mse(const struct kvcap_key_maps *k, const float *x, size_t ldx,
                                     size_t n_cols, double *mse, double *energy)
{
    KVCAP_RETURN_IF(!k || !x || !mse || !energy || ldx < n_cols, KVCAP_ERR_INVALID_ARGUMENT,
                    "key maps mse: bad arguments");
    enum { CHUNK = 2048 };
    size_t b = n_cols < CHUNK ? n_cols : CHUNK;
    float *xk = malloc(sizeof(float) * ((size_t)k->rk * b + (size_t)k->h * b + (size_t)k->m * b + 1));
    KVCAP_RETURN_IF(!xk, KVCAP_ERR_OUT_OF_MEMORY, "key maps mse: out of memory");
    float *z = xk + (size_t)k->rk * b, *y = z + (size_t)k->h * b;
    double err = 0.0, en = 0.0;
    for (size_t c0 = 0; c0 < n_cols; c0 += b) {
        size_t nb = n_cols - c0 < b ? n_cols - c0 : b;
        for (int r = 0; r < k->rk; r++)
            memcpy(xk + (size_t)r * nb, x + (size_t)k->mask[r] * ldx + c0, sizeof(float) * nb);
        kvcap_key_maps_apply(k, xk, nb, nb, z, y, nb);
        for (int i = 0; i < k->m; i++)
            for (size_t c = 0; c < nb; c++) {
                double t = x[(size_t)i * ldx + c0 + c], d = y[(size_t)i * nb + c] - t;
                err += d * d;
                en += t * t;
            }
    }
    free(xk);
    double count = (double)n_cols * k->m;
    *mse = count > 0 ? err / count : 0.0;
    *energy = count > 0 ? en / count : 0.0;
    return KVCAP_OK;
}

/* Greedy pivoted Cholesky: the rk points whose rows of C best explain the rest (largest
 * residual diagonal first). Returns the picks in selection order. */
static enum kvcap_status pivoted_cholesky(const double *c, int m, int rk, int32_t *picks)
{
    double *l = calloc((size_t)m * rk, sizeof *l), *d = malloc(sizeof *d * (size_t)m);
    char *used = calloc((size_t)m, 1);
    if (!l || !d || !used) {
        free(l), free(d), free(used);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "pivoted Cholesky: out of memory (m %d)", m);
    }
    double dmax = 0.0;
    for (int i = 0; i < m; i++) {
        d[i] = c[(size_t)i * m + i];
        dmax = d[i] > dmax ? d[i] : dmax;
    }
    for (int k = 0; k < rk; k++) {
        int p = -1;
        for (int i = 0; i < m; i++)
            if (!used[i] && (p < 0 || d[i] > d[p]))
                p = i;
        picks[k] = p;
        used[p] = 1;
        /* Once the residual is numerically zero the data has rank < rk: later picks carry
         * nothing new and get zero columns (the least-squares step gives them zero weight). */
        if (!(d[p] > 1e-12 * dmax))
            continue;
        double s = sqrt(d[p]);
        for (int i = 0; i < m; i++) {
            double v = c[(size_t)i * m + p];
            for (int j = 0; j < k; j++)
                v -= l[(size_t)i * rk + j] * l[(size_t)p * rk + j];
            l[(size_t)i * rk + k] = used[i] && i != p ? 0.0 : v / s;
        }
        for (int i = 0; i < m; i++)
            if (!used[i])
                d[i] -= l[(size_t)i * rk + k] * l[(size_t)i * rk + k];
    }
    free(l);
    free(d);
    free(used);
    return KVCAP_OK;
}

static int compare_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

enum kvcap_status kvcap_keys_closed_form(const double *gram, int m, int rk, int h, double ridge,
                                         struct kvcap_key_maps *out)
{
    KVCAP_RETURN_IF(!gram || !out || m < 1 || rk < 1 || rk > m || h < 1 || !(ridge >= 0),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "keys closed form: m %d, rk %d, h %d, ridge %g (need 1 <= rk <= m, h >= 1, "
                    "ridge >= 0)",
                    m, rk, h, ridge);
    if (h > rk)
        h = rk; /* a linear map of rank > rk does not exist */
    KVCAP_TRY(kvcap_key_maps_alloc(out, m, rk, h, 0));
    enum kvcap_status st = pivoted_cholesky(gram, m, rk, out->mask);
    if (st != KVCAP_OK) {
        kvcap_key_maps_free(out);
        return st;
    }
    qsort(out->mask, (size_t)rk, sizeof *out->mask, compare_i32);
    const int32_t *mk = out->mask;

    /* A = C[:,M] (C[M,M] + λ' I)^+ via the eigen-decomposition of C[M,M]: directions with no
     * energy are dropped (minimum-norm solution), so exact-rank data is reproduced exactly. */
    size_t r = (size_t)rk;
    double *q = malloc(sizeof(double) * r * r), *w = malloc(sizeof(double) * r);
    double *cm = malloc(sizeof(double) * (size_t)m * r), *a = malloc(sizeof(double) * (size_t)m * r);
    double *t = malloc(sizeof(double) * (size_t)m * r), *z = malloc(sizeof(double) * (size_t)m * r);
    double *s = malloc(sizeof(double) * r * r), *sw = malloc(sizeof(double) * r);
    if (!q || !w || !cm || !a || !t || !z || !s || !sw) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "keys closed form: out of memory (m %d, rk %d)",
                        m, rk);
        goto done;
    }
    double mean_diag = 0.0;
    for (size_t i = 0; i < r; i++) {
        for (size_t j = 0; j < r; j++)
            q[i * r + j] = gram[(size_t)mk[i] * m + mk[j]];
        mean_diag += q[i * r + i];
    }
    mean_diag /= (double)r;
    for (int i = 0; i < m; i++)
        for (size_t j = 0; j < r; j++)
            cm[(size_t)i * r + j] = gram[(size_t)i * m + mk[j]];
    if ((st = kvcap_dsyevd(rk, q, w)) != KVCAP_OK)
        goto done;
    double lambda = ridge * mean_diag, wmax = w[r - 1] > 0 ? w[r - 1] : 0.0;
    /* t = C[:,M] Q, then scale column j by 1/(w_j + λ') (or 0), then A = t Qᵀ */
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, rk, rk, 1.0, cm, rk, q, rk, 0.0, t,
                rk);
    for (size_t j = 0; j < r; j++) {
        double inv = w[j] > 1e-10 * wmax && w[j] + lambda > 0 ? 1.0 / (w[j] + lambda) : 0.0;
        for (int i = 0; i < m; i++)
            t[(size_t)i * r + j] *= inv;
    }
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, rk, rk, 1.0, t, rk, q, rk, 0.0, a, rk);

    if (h == rk) { /* W1 = I, W2 = Aᵀ */
        for (size_t i = 0; i < r; i++)
            out->w1[i * r + i] = 1.0f;
        for (size_t j = 0; j < r; j++)
            for (int i = 0; i < m; i++)
                out->w2[j * (size_t)m + (size_t)i] = (float)a[(size_t)i * r + j];
        goto done;
    }
    /* Reduced-rank regression: project A onto the top-h eigenvectors U_h of the fitted
     * covariance A C[M,M] Aᵀ = Z Zᵀ with Z = A Q W^½; U = Z V S^-1 from ZᵀZ = V S² Vᵀ. */
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, rk, rk, 1.0, a, rk, q, rk, 0.0, z,
                rk);
    for (size_t j = 0; j < r; j++) {
        double sq = w[j] > 0 ? sqrt(w[j]) : 0.0;
        for (int i = 0; i < m; i++)
            z[(size_t)i * r + j] *= sq;
    }
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, rk, rk, m, 1.0, z, rk, z, rk, 0.0, s, rk);
    if ((st = kvcap_dsyevd(rk, s, sw)) != KVCAP_OK)
        goto done;
    /* U_h columns: the h largest eigenvalues are the last h columns of s */
    for (int c = 0; c < h; c++) {
        size_t col = r - 1 - (size_t)c;
        double sv = sw[col] > 0 ? sqrt(sw[col]) : 0.0;
        for (int i = 0; i < m; i++) {
            double u = 0.0;
            if (sv > 1e-12 * (sw[r - 1] > 0 ? sqrt(sw[r - 1]) : 1.0))
                for (size_t j = 0; j < r; j++)
                    u += z[(size_t)i * r + j] * s[j * r + col];
            out->w2[(size_t)c * m + (size_t)i] = sv > 0 ? (float)(u / sv) : 0.0f;
        }
    }
    /* W1 = Aᵀ U_h: [rk][h] */
    for (size_t j = 0; j < r; j++)
        for (int c = 0; c < h; c++) {
            double v = 0.0;
            for (int i = 0; i < m; i++)
                v += a[(size_t)i * r + j] * out->w2[(size_t)c * m + (size_t)i];
            out->w1[j * (size_t)h + (size_t)c] = (float)v;
        }
done:
    free(q), free(w), free(cm), free(a), free(t), free(z), free(s), free(sw);
    if (st != KVCAP_OK)
        kvcap_key_maps_free(out);
    return st;
}
