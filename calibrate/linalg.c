/* linalg.c — eigen-decompositions for value PCA and the closed-form key fit. */
#include <lapacke.h>
#include <stdlib.h>
#include <string.h>

#include "common/internal.h"
#include "calibrate/linalg.h"

enum kvcap_status kvcap_dsyevd(int n, double *a, double *w)
{
    KVCAP_RETURN_IF(n < 1 || !a || !w, KVCAP_ERR_INVALID_ARGUMENT, "dsyevd: n %d", n);
    size_t nn = (size_t)n;
    lapack_int lwork = (lapack_int)(1 + 6 * nn + 2 * nn * nn), liwork = (lapack_int)(3 + 5 * nn);
    double *work = malloc(sizeof(double) * (size_t)lwork);
    lapack_int *iwork = malloc(sizeof(lapack_int) * (size_t)liwork);
    if (!work || !iwork) {
        free(work);
        free(iwork);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "dsyevd: no workspace for n = %d", n);
    }
    lapack_int info = LAPACKE_dsyevd_work(LAPACK_ROW_MAJOR, 'V', 'U', n, a, n, w, work, lwork,
                                          iwork, liwork);
    free(work);
    free(iwork);
    KVCAP_RETURN_IF(info != 0, KVCAP_ERR_NUMERIC,
                    "dsyevd: eigen-decomposition of a %dx%d Gram failed (info %d)", n, n,
                    (int)info);
    return KVCAP_OK;
}

enum kvcap_status kvcap_values_fit(const double *gram, int m, double *eigval, float *eigvec)
{
    size_t mm = (size_t)m * (size_t)m;
    double *a = malloc(sizeof(double) * mm), *w = malloc(sizeof(double) * (size_t)m);
    if (!a || !w) {
        free(a);
        free(w);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "value PCA: out of memory (m %d)", m);
    }
    memcpy(a, gram, sizeof(double) * mm);
    enum kvcap_status st = kvcap_dsyevd(m, a, w);
    if (st == KVCAP_OK)
        kvcap_values_from_eigen(a, w, m, eigval, eigvec);
    free(a);
    free(w);
    return st;
}

void kvcap_values_from_eigen(const double *a, const double *w, int m, double *eigval,
                             float *eigvec)
{
    for (int i = 0; i < m; i++) /* i-th largest = column m-1-i; a Gram is PSD: clip noise */
        eigval[i] = w[m - 1 - i] > 0 ? w[m - 1 - i] : 0.0;
    enum { TILE = 32 }; /* transpose in tiles so both sides stay in cache */
    for (int j0 = 0; j0 < m; j0 += TILE)
        for (int i0 = 0; i0 < m; i0 += TILE)
            for (int j = j0; j < j0 + TILE && j < m; j++)
                for (int i = i0; i < i0 + TILE && i < m; i++)
                    eigvec[(size_t)i * m + j] = (float)a[(size_t)j * m + (m - 1 - i)];
}
