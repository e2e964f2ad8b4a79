/* basis_rows.c — attention over kept keys whose values live in a value basis (basis_rows.h):
 * the readable oracle, which builds every v̂_j, and the fast form through the coefficients. */
#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/basis_rows.h"
#include "kernels/load.h"
#include "common/dtype.h"
#include "common/internal.h"

#define KEY_BLOCK 64 /* keys converted to f32 at a time by the fast form */

static uint64_t basis_bytes(const struct kvcap_basis_rows *r, int d)
{
    uint64_t es = kvcap_dtype_size(r->dtype);
    return (uint64_t)r->n * ((uint64_t)d * es + sizeof(int32_t)) +
           ((uint64_t)r->tiles * r->rv + 1 + (uint64_t)r->n_vx) * (uint64_t)d * es +
           (uint64_t)r->rv * r->m * sizeof(float);
}

/* The checks both forms share; *nothing is set when there is no work. */
static enum kvcap_status basis_check(const struct kvcap_basis_rows *r, const float *q, int nq,
                                     int d, uint64_t *bytes, int *nothing)
{
    if (bytes)
        *bytes = 0;
    KVCAP_RETURN_IF(!r || !q || r->n < 0 || nq < 0 || d <= 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "attend_basis_rows: %s", !r ? "NULL rows" : !q ? "NULL queries"
                    : d <= 0 ? "head_dim out of range" : "negative row or query count");
    *nothing = r->n == 0 || nq == 0;
    if (*nothing)
        return KVCAP_OK;
    KVCAP_RETURN_IF(!r->k || !r->point || !r->u || !r->vt || !r->mu || r->n_vx < 0 ||
                        (r->n_vx > 0 && !r->vx) || !kvcap_dtype_is_storage(r->dtype) ||
                        r->m < 1 || r->rv < 0 ||
                        r->tiles < 1 || (int64_t)r->tiles * r->m > INT_MAX,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "attend_basis_rows: %s",
                    !kvcap_dtype_is_storage(r->dtype) ? "rows are not F32, F16 or BF16"
                    : r->m < 1 || r->rv < 0 || r->tiles < 1 || r->n_vx < 0
                        ? "basis sizes out of range"
                    : (int64_t)r->tiles * r->m > INT_MAX ? "too many points"
                                                        : "NULL keys, points, basis or state");
    for (int j = 0; j < r->n; j++)
        KVCAP_RETURN_IF(r->point[j] < -r->n_vx || r->point[j] >= r->tiles * r->m,
                        KVCAP_ERR_INVALID_ARGUMENT,
                        "attend_basis_rows: row %d's point %d is outside [%d, %d)", j,
                        (int)r->point[j], -r->n_vx, r->tiles * r->m);
    return KVCAP_OK;
}

/* ---- The oracle: every kept row's value rebuilt, then the plain rows' oracle -------------- */

enum kvcap_status kvcap_attend_basis_rows_ref(const struct kvcap_basis_rows *r, const float *q,
                                              int nq, int d, float scale,
                                              struct kvcap_partial acc, uint64_t *bytes)
{
    int nothing;
    KVCAP_TRY(basis_check(r, q, nq, d, bytes, &nothing));
    if (nothing)
        return KVCAP_OK;
    /* the keys as f32 (exact for every storage dtype), each v̂_j summed in double */
    float *k = malloc(sizeof(float) * (size_t)r->n * d);
    float *v = malloc(sizeof(float) * (size_t)r->n * d);
    if (!k || !v) {
        free(k), free(v);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "attend_basis_rows_ref: out of memory for %d "
                          "rows", r->n);
    }
    for (int j = 0; j < r->n; j++) { /* v̂_j = Σ_r U[r][p_j] Ṽ_{t_j}[r] + μ, or vx exactly */
        const int t = r->point[j] / r->m, p = r->point[j] % r->m, x_at = -1 - r->point[j];
        for (int c = 0; c < d; c++) {
            k[(size_t)j * d + c] =
                (float)kvcap_load_elem(r->dtype, r->k, (size_t)j * r->row_stride + c);
            if (r->point[j] < 0) {
                v[(size_t)j * d + c] =
                    (float)kvcap_load_elem(r->dtype, r->vx, (size_t)x_at * d + c);
                continue;
            }
            double x = kvcap_load_elem(r->dtype, r->mu, (size_t)c);
            for (int a = 0; a < r->rv; a++)
                x += (double)r->u[(size_t)a * r->m + p] *
                     kvcap_load_elem(r->dtype, r->vt, ((size_t)t * r->rv + a) * d + c);
            v[(size_t)j * d + c] = (float)x;
        }
    }
    const struct kvcap_rows rows = {k, v, KVCAP_DTYPE_F32, (size_t)d, r->n};
    const enum kvcap_status st = kvcap_attend_rows_ref(&rows, q, nq, d, scale, acc, NULL);
    free(k), free(v);
    if (st == KVCAP_OK && bytes)
        *bytes = basis_bytes(r, d);
    return st;
}

/* ---- The fast form: scores by sgemm, coefficients per tile, Ṽᵀc by sgemm ---------------- */

size_t kvcap_attend_basis_rows_scratch_floats(int n, int tiles, int rv, int n_vx, int nq, int d)
{
    const size_t tr = (size_t)tiles * (size_t)rv, nx = n_vx > 0 ? (size_t)n_vx : 0;
    /* key block, scores, coefficients, Ṽ and μ in f32, outputs, max and two sums, the exact
     * values' weights and the exact values in f32 */
    return (size_t)KEY_BLOCK * d + (size_t)nq * n + (size_t)nq * tr + tr * d + (size_t)d +
           (size_t)nq * d + 3 * (size_t)nq + (size_t)nq * nx + nx * d;
}

enum kvcap_status kvcap_attend_basis_rows(const struct kvcap_basis_rows *r, const float *q,
                                          int nq, int d, float scale, struct kvcap_partial acc,
                                          float *scratch, size_t scratch_floats, uint64_t *bytes)
{
    int nothing;
    KVCAP_TRY(basis_check(r, q, nq, d, bytes, &nothing));
    if (nothing)
        return KVCAP_OK;
    const int tr = r->tiles * r->rv, n = r->n;
    KVCAP_RETURN_IF(!scratch || scratch_floats < kvcap_attend_basis_rows_scratch_floats(
                                                     n, r->tiles, r->rv, r->n_vx, nq, d),
                    KVCAP_ERR_INVALID_ARGUMENT, "attend_basis_rows: scratch of %zu floats is "
                    "too small", scratch_floats);
    const size_t es = kvcap_dtype_size(r->dtype);
    float *kf = scratch, *sc = kf + (size_t)KEY_BLOCK * d, *coef = sc + (size_t)nq * n;
    float *vtf = coef + (size_t)nq * tr, *muf = vtf + (size_t)tr * d, *o = muf + d;
    float *mx = o + (size_t)nq * d, *sum = mx + nq, *bsum = sum + nq; /* bsum: basis rows' */
    float *w = bsum + nq, *vxf = w + (size_t)nq * r->n_vx; /* exact values: weights, rows */
    for (int j0 = 0; j0 < n; j0 += KEY_BLOCK) { /* sc[q][j] = scale · q · k_j */
        const int nr = n - j0 < KEY_BLOCK ? n - j0 : KEY_BLOCK;
        for (int i = 0; i < nr; i++)
            kvcap_load_f32(r->dtype, (const char *)r->k + (size_t)(j0 + i) * r->row_stride * es,
                           (size_t)d, kf + (size_t)i * d);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nr, d, scale, q, d, kf, d, 0.0f,
                    sc + j0, n);
    }
    memset(coef, 0, sizeof(float) * (size_t)nq * tr);
    memset(w, 0, sizeof(float) * (size_t)nq * r->n_vx);
    for (int qi = 0; qi < nq; qi++) { /* p = exp(s − mx); c_t[r] += p_j U[r][p_j] */
        float *s = sc + (size_t)qi * n, *cq = coef + (size_t)qi * tr, m = -INFINITY, total = 0;
        float basis_total = 0;
        for (int j = 0; j < n; j++)
            m = s[j] > m ? s[j] : m;
        for (int j = 0; j < n; j++) {
            const float p = expf(s[j] - m);
            total += p;
            if (r->point[j] < 0) { /* an exact value */
                w[(size_t)qi * r->n_vx + (-1 - r->point[j])] += p;
                continue;
            }
            const int t = r->point[j] / r->m, pt = r->point[j] % r->m;
            basis_total += p;
            for (int a = 0; a < r->rv; a++)
                cq[t * r->rv + a] += p * r->u[(size_t)a * r->m + pt];
        }
        mx[qi] = m, sum[qi] = total, bsum[qi] = basis_total;
    }
    kvcap_load_f32(r->dtype, r->vt, (size_t)tr * d, vtf);
    kvcap_load_f32(r->dtype, r->mu, (size_t)d, muf);
    if (tr > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, d, tr, 1.0f, coef, tr, vtf, d,
                    0.0f, o, d);
    else
        memset(o, 0, sizeof(float) * (size_t)nq * d);
    if (r->n_vx > 0) {
        kvcap_load_f32(r->dtype, r->vx, (size_t)r->n_vx * d, vxf);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, d, r->n_vx, 1.0f, w, r->n_vx,
                    vxf, d, 1.0f, o, d);
    }
    for (int qi = 0; qi < nq; qi++) {
        for (int c = 0; c < d; c++)
            o[(size_t)qi * d + c] += bsum[qi] * muf[c];
        struct kvcap_partial from = {mx + qi, sum + qi, o + (size_t)qi * d};
        struct kvcap_partial into = {acc.mx + qi, acc.sum + qi, acc.o + (size_t)qi * d};
        kvcap_partial_merge(into, from, 1, d);
    }
    if (bytes)
        *bytes = basis_bytes(r, d);
    return KVCAP_OK;
}
