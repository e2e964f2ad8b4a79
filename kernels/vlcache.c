/* vlcache.c — VL-Cache's numerical core (see vlcache.h, DESIGN §6): post-vision attention
 * column sums and sparsity per KV head, and the layer budgets of the paper's Algorithm 1.
 *
 * The fast version never holds more than one block of keys: keys stream in blocks of
 * VL_BLOCK rows (gathered across chunks, converted to f32), one sgemm gives the scores of all
 * τ·G queries for the block, and two passes over the keys replace the τ×m score matrix:
 *   pass 1  per query row, the running max and the sum of exp(s − max), rescaled when the max
 *           grows (online softmax);
 *   pass 2  the scores again; A' = exp(s − max) / sum goes into the block's column sums, and
 *           entries with exp(s − max) < p are counted: the row max of A' is exp(0)/sum, so
 *           "A' < p · rowmax" is the same test without the division.
 * Recomputing the block's sgemm costs as much as pass 1 did, which is cheaper than keeping
 * τ·m scores (the point of the method is that m is large). */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "common/internal.h"
#include "common/dtype.h"
#include "kernels/rows_block.h"
#include "kernels/vlcache.h"

#define VL_BLOCK 256 /* key rows per block: τ·G × 256 scores stay in L2 for typical τ·G */

/* The checks both versions share; *m_out receives the number of keys. */
static enum kvcap_status check_args(const char *fn, const float *q, int tau, int G, int d,
                                    float scale, const struct kvcap_rows *keys, int n_chunks,
                                    float p, const float *score, const int64_t *below,
                                    const int64_t *entries, int *m_out)
{
    KVCAP_RETURN_IF(!q, KVCAP_ERR_INVALID_ARGUMENT, "%s: q is NULL", fn);
    KVCAP_RETURN_IF(!keys, KVCAP_ERR_INVALID_ARGUMENT, "%s: keys is NULL", fn);
    KVCAP_RETURN_IF(!score, KVCAP_ERR_INVALID_ARGUMENT, "%s: score is NULL", fn);
    KVCAP_RETURN_IF(!below, KVCAP_ERR_INVALID_ARGUMENT, "%s: below is NULL", fn);
    KVCAP_RETURN_IF(!entries, KVCAP_ERR_INVALID_ARGUMENT, "%s: entries is NULL", fn);
    KVCAP_RETURN_IF(tau < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: tau = %d, must be >= 1", fn, tau);
    KVCAP_RETURN_IF(G < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: G = %d, must be >= 1", fn, G);
    KVCAP_RETURN_IF(d < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: d = %d, must be >= 1", fn, d);
    KVCAP_RETURN_IF((int64_t)tau * G > INT_MAX || (int64_t)tau * G * d > INT_MAX,
                    KVCAP_ERR_INVALID_ARGUMENT, "%s: tau * G * d = %d * %d * %d is too large",
                    fn, tau, G, d);
    KVCAP_RETURN_IF(!isfinite(scale), KVCAP_ERR_INVALID_ARGUMENT, "%s: scale = %g is not finite",
                    fn, (double)scale);
    KVCAP_RETURN_IF(!isfinite(p), KVCAP_ERR_INVALID_ARGUMENT, "%s: p = %g is not finite", fn,
                    (double)p);
    KVCAP_RETURN_IF(n_chunks < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: n_chunks = %d, must be >= 1",
                    fn, n_chunks);
    int m = 0;
    KVCAP_TRY(kvcap_rows_check(fn, keys, n_chunks, d, &m));
    KVCAP_RETURN_IF(m < tau, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: keys hold %d tokens, fewer than tau = %d", fn, (int)m, tau);
    *m_out = (int)m;
    return KVCAP_OK;
}

/* ---- Oracle -------------------------------------------------------------------------------- */

/* Element c of row r of a chunk, in double. */
static double key_elem(const struct kvcap_rows *k, int r, int c)
{
    return kvcap_load_elem(k->dtype, k->k, (size_t)r * k->row_stride + (size_t)c);
}

enum kvcap_status kvcap_vlcache_head_ref(const float *q, size_t q_stride, int tau, int G, int d,
                                         float scale, const struct kvcap_rows *keys,
                                         int n_chunks, float p, float *score, int64_t *below,
                                         int64_t *entries)
{
    const char *fn = "kvcap_vlcache_head_ref";
    int m;
    KVCAP_TRY(check_args(fn, q, tau, G, d, scale, keys, n_chunks, p, score, below, entries, &m));
    double *s = malloc(sizeof(double) * (size_t)m);
    double *col = calloc((size_t)m, sizeof(double));
    if (!s || !col) {
        free(s);
        free(col);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory for %d keys", fn, m);
    }
    int64_t nb = 0, ne = 0;
    for (int i = 0; i < tau; i++) {
        int n = m - tau + i + 1; /* keys 0 .. m−τ+i are visible to post-vision token i */
        for (int g = 0; g < G; g++) {
            const float *qv = q + (size_t)i * q_stride + (size_t)g * d;
            int j = 0;
            for (int c = 0; c < n_chunks && j < n; c++)
                for (int r = 0; r < keys[c].n && j < n; r++, j++) {
                    double a = 0;
                    for (int e = 0; e < d; e++)
                        a += (double)qv[e] * key_elem(&keys[c], r, e);
                    s[j] = a * scale;
                }
            double mx = -INFINITY, z = 0;
            for (j = 0; j < n; j++)
                mx = s[j] > mx ? s[j] : mx;
            for (j = 0; j < n; j++)
                z += exp(s[j] - mx);
            double rowmax = 0;
            for (j = 0; j < n; j++) {
                s[j] = exp(s[j] - mx) / z; /* A'_g[i][j] */
                rowmax = s[j] > rowmax ? s[j] : rowmax;
            }
            for (j = 0; j < n; j++) {
                col[j] += s[j];
                nb += s[j] < (double)p * rowmax;
                ne++;
            }
        }
    }
    for (int j = 0; j < m; j++)
        score[j] += (float)col[j];
    *below += nb;
    *entries += ne;
    free(s);
    free(col);
    return KVCAP_OK;
}

/* ---- Fast version -------------------------------------------------------------------------- */

size_t kvcap_vlcache_scratch_floats(int tau, int G, int d)
{
    return kvcap_rows_scratch_floats(tau, G, d, VL_BLOCK, VL_BLOCK); /* and col [VL_BLOCK] */
}

/* Scratch layout (floats), nq = τ·G query rows, row r = i·G + g:
 *   qs  [nq][d]          queries times scale
 *   sc  [nq][VL_BLOCK]   one block's scores
 *   mx  [nq], sum [nq]   running row max and Σ exp(s − mx); after pass 1 sum holds 1/sum
 *   kb  [VL_BLOCK][d]    one block of keys in f32
 *   col [VL_BLOCK]       the block's column sums of A' */
enum kvcap_status kvcap_vlcache_head(const float *q, size_t q_stride, int tau, int G, int d,
                                     float scale, const struct kvcap_rows *keys, int n_chunks,
                                     float p, float *score, int64_t *below, int64_t *entries,
                                     float *scratch)
{
    const char *fn = "kvcap_vlcache_head";
    int m;
    KVCAP_TRY(check_args(fn, q, tau, G, d, scale, keys, n_chunks, p, score, below, entries, &m));
    KVCAP_RETURN_IF(!scratch, KVCAP_ERR_INVALID_ARGUMENT, "%s: scratch is NULL", fn);
    int nq = tau * G;
    float *qs = scratch, *sc = qs + (size_t)nq * d, *mx = sc + (size_t)nq * VL_BLOCK;
    float *sum = mx + nq, *kb = sum + nq, *col = kb + (size_t)VL_BLOCK * d;

    kvcap_rows_scaled_queries(q, q_stride, tau, G, d, scale, qs, mx, sum);

    /* Row r = (i, g) sees keys j <= m − τ + i: only blocks holding one of the last τ keys are
     * cut short, by `visible`. */
    int64_t nbelow = 0;
    for (int pass = 1; pass <= 2; pass++) {
        struct kvcap_rows_cursor cur = {0, 0};
        for (int j0 = 0; j0 < m;) {
            int nb = kvcap_rows_load_block(keys, n_chunks, &cur, d, VL_BLOCK, kb);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nb, d, 1.0f, qs, d, kb, d,
                        0.0f, sc, VL_BLOCK);
            if (pass == 2)
                memset(col, 0, sizeof(float) * (size_t)nb);
            for (int r = 0; r < nq; r++) {
                int last = m - tau + r / G; /* the last key row r sees */
                int visible = last - j0 + 1 < nb ? last - j0 + 1 : nb;
                const float *s = sc + (size_t)r * VL_BLOCK;
                if (visible <= 0)
                    continue;
                if (pass == 1) {
                    kvcap_rows_softmax_add(s, visible, &mx[r], &sum[r]);
                } else {
                    float rm = mx[r], inv = sum[r];
                    int nbr = 0;
                    for (int jj = 0; jj < visible; jj++) {
                        float e = expf(s[jj] - rm);
                        nbr += e < p;
                        col[jj] += e * inv;
                    }
                    nbelow += nbr;
                }
            }
            if (pass == 2)
                for (int jj = 0; jj < nb; jj++)
                    score[j0 + jj] += col[jj];
            j0 += nb;
        }
        if (pass == 1)
            for (int r = 0; r < nq; r++)
                sum[r] = 1.0f / sum[r]; /* sum >= 1: the max term is exp(0) */
    }
    *below += nbelow;
    /* Row i has m − τ + i + 1 causal entries, for each of the G heads. */
    *entries += (int64_t)G * ((int64_t)tau * (m - tau + 1) + (int64_t)tau * (tau - 1) / 2);
    return KVCAP_OK;
}

/* ---- Layer budgets (Algorithm 1) ----------------------------------------------------------- */

static double clip(double x, double lo, double hi)
{
    return x < lo ? lo : x > hi ? hi : x;
}

enum kvcap_status kvcap_vlcache_budgets(const double *gamma, int L, double alpha, double lo,
                                        double *beta)
{
    const char *fn = "kvcap_vlcache_budgets";
    KVCAP_RETURN_IF(!gamma, KVCAP_ERR_INVALID_ARGUMENT, "%s: gamma is NULL", fn);
    KVCAP_RETURN_IF(!beta, KVCAP_ERR_INVALID_ARGUMENT, "%s: beta is NULL", fn);
    KVCAP_RETURN_IF(L < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: L = %d, must be >= 1", fn, L);
    KVCAP_RETURN_IF(!(alpha >= 0) || !isfinite(alpha), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: alpha = %g, must be finite and >= 0", fn, alpha);
    KVCAP_RETURN_IF(!(lo >= 0 && lo <= 1), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: lo = %g is outside [0, 1]", fn, lo);
    double dense = 0; /* Σ (1 − γ) */
    for (int l = 0; l < L; l++) {
        KVCAP_RETURN_IF(!(gamma[l] >= 0 && gamma[l] <= 1), KVCAP_ERR_INVALID_ARGUMENT,
                        "%s: gamma[%d] = %g is outside [0, 1]", fn, l, gamma[l]);
        dense += 1.0 - gamma[l];
    }
    for (int l = 0; l < L; l++)
        beta[l] = clip(dense > 0 ? (1.0 - gamma[l]) / dense * alpha * L : alpha, lo, 1.0);
    return KVCAP_OK;
}
