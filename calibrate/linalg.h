/* linalg.h — the dense linear algebra calibration needs, over LAPACK with explicit workspaces. */
#ifndef KVCAP_LINALG_H
#define KVCAP_LINALG_H

#include "kvcap.h"

/* Symmetric eigen-decomposition of the n x n row-major matrix a, in place: on return column j
 * of a is the eigenvector of w[j], eigenvalues ascending. Calls LAPACKE_dsyevd_work with
 * lwork = 1 + 6n + 2n², liwork = 3 + 5n: the workspace query of LAPACKE_dsyevd overflows for
 * n above ~2900. KVCAP_ERR_NUMERIC if LAPACK does not converge. */
enum kvcap_status kvcap_dsyevd(int n, double *a, double *w);

/* Value PCA from the Gram G (m x m): eigenvalues descending into eigval[m] and the matching
 * eigenvectors as the ROWS of eigvec (m x m floats), so the top-R basis U is its first R rows. */
enum kvcap_status kvcap_values_fit(const double *gram, int m, double *eigval, float *eigvec);

/* The second half of kvcap_values_fit, shared with the CUDA path: from a decomposition in the
 * kvcap_dsyevd contract (a: m x m row-major, eigenvector of w[j] in column j, w ascending) to
 * eigval descending (clipped at 0: a Gram is PSD) and eigvec rows. */
void kvcap_values_from_eigen(const double *a, const double *w, int m, double *eigval,
                             float *eigvec);

#endif
