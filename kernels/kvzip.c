/* kvzip.c — KVzip's scoring (see kvzip.h): the largest reconstruction attention each prompt
 * token receives per KV head, and the budget shared across layers and heads.
 *
 * The fast scoring never holds more than one block of keys: keys stream in blocks of
 * KZ_BLOCK rows (kvcap_rows_load_block), one sgemm gives the scores of all n_q·G queries for
 * the block, and two passes over the keys replace the (n_q·G)×m score matrix:
 *   pass 1  per query row, the running max and Σ exp(s − max) (online softmax);
 *   pass 2  the scores again; A = exp(s − max) / sum, the block's column maxima into score.
 * Recomputing a block's sgemm costs what pass 1 did and keeps the memory independent of m. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "common/internal.h"
#include "common/dtype.h"
#include "kernels/kvzip.h"
#include "kernels/rows_block.h"
#include "kernels/select.h"

#define KZ_BLOCK 256 /* key rows per block */

static enum kvcap_status check_args(const char *fn, const float *q, const float *lse,
                                    size_t lse_stride, int n_q, int G, int d, float scale,
                                    const struct kvcap_rows *keys, int n_chunks,
                                    const float *score, int *m_out)
{
    KVCAP_RETURN_IF(!q, KVCAP_ERR_INVALID_ARGUMENT, "%s: q is NULL", fn);
    KVCAP_RETURN_IF(!keys, KVCAP_ERR_INVALID_ARGUMENT, "%s: keys is NULL", fn);
    KVCAP_RETURN_IF(!score, KVCAP_ERR_INVALID_ARGUMENT, "%s: score is NULL", fn);
    KVCAP_RETURN_IF(n_q < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: n_q = %d, must be >= 1", fn, n_q);
    KVCAP_RETURN_IF(G < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: G = %d, must be >= 1", fn, G);
    KVCAP_RETURN_IF(d < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: d = %d, must be >= 1", fn, d);
    KVCAP_RETURN_IF((int64_t)n_q * G * d > INT_MAX, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: n_q * G * d = %d * %d * %d is too large", fn, n_q, G, d);
    KVCAP_RETURN_IF(!isfinite(scale), KVCAP_ERR_INVALID_ARGUMENT, "%s: scale = %g is not finite",
                    fn, (double)scale);
    KVCAP_RETURN_IF(n_chunks < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: n_chunks = %d, must be >= 1",
                    fn, n_chunks);
    for (int i = 0; lse && i < n_q; i++)
        for (int g = 0; g < G; g++) {
            const float x = lse[(size_t)i * lse_stride + (size_t)g];
            KVCAP_RETURN_IF(isnan(x) || x == INFINITY, KVCAP_ERR_INVALID_ARGUMENT,
                            "%s: lse of query %d, head %d is %g (finite or -inf)", fn, i, g,
                            (double)x);
        }
    int m = 0;
    KVCAP_TRY(kvcap_rows_check(fn, keys, n_chunks, d, &m));
    KVCAP_RETURN_IF(m < 1, KVCAP_ERR_INVALID_ARGUMENT, "%s: keys hold no token", fn);
    *m_out = (int)m;
    return KVCAP_OK;
}

/* ---- Oracle -------------------------------------------------------------------------------- */

enum kvcap_status kvcap_kvzip_head_ref(const float *q, size_t q_stride, const float *lse,
                                       size_t lse_stride, int n_q, int G, int d, float scale,
                                       const struct kvcap_rows *keys, int n_chunks, float *score)
{
    const char *fn = "kvcap_kvzip_head_ref";
    int m;
    KVCAP_TRY(check_args(fn, q, lse, lse_stride, n_q, G, d, scale, keys, n_chunks, score, &m));
    double *s = malloc(sizeof(double) * (size_t)m);
    KVCAP_RETURN_IF(!s, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory for %d keys", fn, m);
    for (int i = 0; i < n_q; i++)
        for (int g = 0; g < G; g++) {
            const float *qv = q + (size_t)i * q_stride + (size_t)g * d;
            int j = 0;
            for (int c = 0; c < n_chunks; c++)
                for (int r = 0; r < keys[c].n; r++, j++) {
                    double a = 0;
                    for (int e = 0; e < d; e++)
                        a += (double)qv[e] * kvcap_load_elem(keys[c].dtype, keys[c].k,
                                                             (size_t)r * keys[c].row_stride +
                                                                 (size_t)e);
                    s[j] = a * scale;
                }
            double mx = -INFINITY, z = 0;
            const double extra = lse ? lse[(size_t)i * lse_stride + (size_t)g] : -INFINITY;
            for (j = 0; j < m; j++)
                mx = s[j] > mx ? s[j] : mx;
            mx = extra > mx ? extra : mx;
            for (j = 0; j < m; j++)
                z += exp(s[j] - mx);
            z += exp(extra - mx); /* 0 for -inf */
            for (j = 0; j < m; j++) {
                float a = (float)(exp(s[j] - mx) / z);
                score[j] = a > score[j] ? a : score[j];
            }
        }
    free(s);
    return KVCAP_OK;
}

/* ---- Fast version -------------------------------------------------------------------------- */

size_t kvcap_kvzip_scratch_floats(int n_q, int G, int d)
{
    return kvcap_rows_scratch_floats(n_q, G, d, KZ_BLOCK, 0);
}

/* Scratch layout (floats), nq = n_q·G query rows, row r = i·G + g:
 *   qs  [nq][d]          queries times scale
 *   sc  [nq][KZ_BLOCK]   one block's scores
 *   mx  [nq], sum [nq]   running row max and Σ exp(s − mx); after pass 1 sum holds 1/sum
 *   kb  [KZ_BLOCK][d]    one block of keys in f32 */
enum kvcap_status kvcap_kvzip_head(const float *q, size_t q_stride, const float *lse,
                                   size_t lse_stride, int n_q, int G, int d, float scale,
                                   const struct kvcap_rows *keys, int n_chunks, float *score,
                                   float *scratch)
{
    const char *fn = "kvcap_kvzip_head";
    int m;
    KVCAP_TRY(check_args(fn, q, lse, lse_stride, n_q, G, d, scale, keys, n_chunks, score, &m));
    KVCAP_RETURN_IF(!scratch, KVCAP_ERR_INVALID_ARGUMENT, "%s: scratch is NULL", fn);
    const int nq = n_q * G;
    float *qs = scratch, *sc = qs + (size_t)nq * d, *mx = sc + (size_t)nq * KZ_BLOCK;
    float *sum = mx + nq, *kb = sum + nq;
    kvcap_rows_scaled_queries(q, q_stride, n_q, G, d, scale, qs, mx, sum);
    for (int pass = 1; pass <= 2; pass++) {
        struct kvcap_rows_cursor cur = {0, 0};
        for (int j0 = 0; j0 < m;) {
            const int nb = kvcap_rows_load_block(keys, n_chunks, &cur, d, KZ_BLOCK, kb);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nb, d, 1.0f, qs, d, kb, d,
                        0.0f, sc, KZ_BLOCK);
            for (int r = 0; r < nq; r++) {
                const float *s = sc + (size_t)r * KZ_BLOCK;
                if (pass == 1) {
                    kvcap_rows_softmax_add(s, nb, &mx[r], &sum[r]);
                } else {
                    const float rm = mx[r], inv = sum[r];
                    float *out = score + j0;
                    for (int jj = 0; jj < nb; jj++) {
                        float a = expf(s[jj] - rm) * inv;
                        out[jj] = a > out[jj] ? a : out[jj];
                    }
                }
            }
            j0 += nb;
        }
        if (pass == 1)
            for (int r = 0; r < nq; r++) {
                /* the keys not given: their log-sum-exp joins the normaliser as one term */
                const float extra =
                    lse ? lse[(size_t)(r / G) * lse_stride + (size_t)(r % G)] : -INFINITY;
                kvcap_rows_softmax_add(&extra, 1, &mx[r], &sum[r]);
                sum[r] = 1.0f / sum[r]; /* sum >= 1: the max term is exp(0) */
            }
    }
    return KVCAP_OK;
}

/* ---- The shared budget --------------------------------------------------------------------- */

static int select_args_bad(const float *score, int units, int n, const int *keep,
                           const unsigned char *sel)
{
    return !score || !keep || !sel || units < 0 || n < 0 || (int64_t)units * n > INT_MAX;
}

/* The budget clamped to [0, total] and the floor to [0, n] and to budget / units. */
static void select_counts(int units, int n, int64_t budget, int head_floor, int *k, int *f)
{
    const int total = units * n;
    *k = budget < 0 ? 0 : budget > total ? total : (int)budget;
    *f = head_floor < 0 ? 0 : head_floor > n ? n : head_floor;
    if (units > 0 && *f > *k / units)
        *f = *k / units;
}

int64_t kvcap_kvzip_select(const float *score, int units, int n, int64_t budget,
                           int head_floor, int *keep, unsigned char *sel)
{
    if (select_args_bad(score, units, n, keep, sel))
        return -1;
    const int total = units * n;
    int k, f;
    select_counts(units, n, budget, head_floor, &k, &f);
    const size_t cells = (size_t)(total > 0 ? total : 1);
    int *idx = malloc(sizeof(int) * cells), *work = malloc(sizeof(int) * cells);
    int *from = malloc(sizeof(int) * cells); /* the rest: their index among all scores */
    float *rest = malloc(sizeof(float) * cells);
    int64_t got = -1;
    if (idx && work && from && rest) {
        memset(sel, 0, (size_t)total);
        memset(keep, 0, sizeof(int) * (size_t)units);
        got = 0;
        for (int u = 0; u < units && f > 0; u++) { /* the safeguard: each row's own top f */
            int g = kvcap_topk_indices(score + (size_t)u * n, n, f, idx, work);
            for (int i = 0; i < g; i++)
                sel[(size_t)u * n + idx[i]] = 1;
            keep[u] += g;
            got += g;
        }
        int m = 0; /* the scores not kept yet, in index order (ties stay to the lower) */
        for (int i = 0; i < total; i++)
            if (!sel[i]) {
                rest[m] = score[i];
                from[m++] = i;
            }
        int g = kvcap_topk_indices(rest, m, k - (int)got, idx, work);
        for (int i = 0; i < g; i++) {
            sel[from[idx[i]]] = 1;
            keep[from[idx[i]] / n]++;
        }
        got += g;
    }
    free(idx), free(work), free(from), free(rest);
    return got;
}

struct ranked {
    float s;
    int i;
};

/* Descending score, NaN last, ties to the lower index. */
static int by_rank(const void *a, const void *b)
{
    const struct ranked *x = a, *y = b;
    int xn = isnan(x->s), yn = isnan(y->s);
    if (xn != yn)
        return xn - yn;
    if (!xn && x->s != y->s)
        return x->s > y->s ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

int64_t kvcap_kvzip_select_ref(const float *score, int units, int n, int64_t budget,
                               int head_floor, int *keep, unsigned char *sel)
{
    if (select_args_bad(score, units, n, keep, sel))
        return -1;
    const int total = units * n;
    int k, f;
    select_counts(units, n, budget, head_floor, &k, &f);
    struct ranked *r = malloc(sizeof *r * (size_t)(total > 0 ? total : 1));
    if (!r)
        return -1;
    memset(sel, 0, (size_t)total);
    memset(keep, 0, sizeof(int) * (size_t)units);
    int got = 0;
    for (int u = 0; u < units; u++) { /* each row ranked alone: its first f are kept */
        for (int j = 0; j < n; j++)
            r[j] = (struct ranked){score[(size_t)u * n + j], u * n + j};
        qsort(r, (size_t)n, sizeof *r, by_rank);
        for (int j = 0; j < f; j++, got++) {
            sel[r[j].i] = 1;
            keep[u]++;
        }
    }
    for (int i = 0; i < total; i++) /* then all rows ranked together, the kept skipped */
        r[i] = (struct ranked){score[i], i};
    qsort(r, (size_t)total, sizeof *r, by_rank);
    for (int i = 0; i < total && got < k; i++)
        if (!sel[r[i].i]) {
            sel[r[i].i] = 1;
            keep[r[i].i / n]++;
            got++;
        }
    free(r);
    return got;
}
