/* keys.c — key compression maps: storage, the reference reconstruction, a BLAS-backed error
 * measure, and the closed-form fit (pivoted-Cholesky mask + ridge least squares + rank-h
 * factorisation). The trained fit lives in train.c. */
#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/internal.h"
#include "calibrate/keys.h"
#include "calibrate/linalg.h"

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

/* ---- The mask ------------------------------------------------------------------------------
 *
 * Why the selection is built this way (the fit must not depend on the CPU it ran on):
 * the recorded K/V of the same text differ between machines (the engine's BLAS kernels round
 * differently and 30 layers amplify it: on SmolLM2-135M, Haswell vs SkylakeX OpenBLAS kernels
 * change the 16-point tile Grams by up to 4 %), and Grams accumulated by different dsyrk kernels
 * differ at double rounding. The old rule, pure greedy pivoted Cholesky by largest residual
 * diagonal, is path dependent: a near-tie between two pivots is decided by that noise and one
 * different early pick changes every later pick. On stationary data (all tile positions alike)
 * the diagonal is an exact tie, so even rounding-level noise (1e-15) moved the held-out key
 * error of a tile by ±4 %; on the recorded text tiles the Haswell/SkylakeX data moved it by up
 * to 5 % per unit. Three changes make the outcome a function of the objective, not of the path:
 *  1. Pivots are scored by what they explain, ‖S[:,i]‖² / S[i][i] with S the residual Gram
 *     (the drop of the reconstruction error tr S if i is added), not by S[i][i] alone.
 *  2. Scores (and, below, errors) within a band of KEYS_TIE_TOL · tr C of the best count as
 *     tied and go to the smallest index: rounding noise of C is a few ulps of tr C, so ties are
 *     decided the same way on every machine (and a later perturbation of the band's edge only
 *     ever swaps candidates that are equal to within the band).
 *  3. The greedy mask is refined by best-improvement swaps (one point out, one in) on the
 *     least-squares error tr S itself until no swap gains more than the band: different
 *     greedy paths end at the same or an equally good local optimum. On the recorded tiles this
 *     also lowers the held-out key error by ~2 %; the worst unit's change between the two
 *     machines' data fell from 5 % to 1.6 %. The swaps are costed by rank-one identities (one
 *     dgemm per accepted swap) and capped by KEYS_SWAP_FLOPS per unit so large dense buckets
 *     stay cheap; the cap is a fixed count, not a timer, so it is deterministic too.
 * The Gram is symmetrised before use ((C + Cᵀ)/2): the accumulators fill one triangle and
 * copy it, but a caller's Gram may carry asymmetric rounding. */
#define KEYS_TIE_TOL 1e-6
#define KEYS_SWAP_FLOPS 2e9

static int compare_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Greedy selection on the residual Gram s (m x m, overwritten), in fixed loop order (no BLAS,
 * so the rounding does not depend on the machine's kernels). picks in selection order. */
static void greedy_select(double *s, int m, int rk, double band, double floor_, char *used,
                          double *l, int32_t *picks)
{
    memset(used, 0, (size_t)m);
    for (int k = 0; k < rk; k++) {
        double best = -1.0;
        for (int i = 0; i < m; i++) { /* score into l[i] (scratch until the update below) */
            if (used[i])
                continue;
            double d = s[(size_t)i * m + i], t = 0.0;
            if (d > floor_) {
                for (int j = 0; j < m; j++)
                    t += s[(size_t)i * m + j] * s[(size_t)i * m + j];
                t /= d;
            }
            l[i] = t;
            best = t > best ? t : best;
        }
        int p = -1;
        for (int i = 0; i < m && p < 0; i++)
            if (!used[i] && l[i] >= best - band)
                p = i;
        /* A Gram no data can produce (a negative diagonal, or sums overflowing to inf and NaN:
         * a hostile state file) may leave no candidate in the band: take the first unused. */
        for (int i = 0; i < m && p < 0; i++)
            if (!used[i])
                p = i;
        picks[k] = p;
        used[p] = 1;
        double dp = s[(size_t)p * m + p];
        /* Once the residual is numerically zero the data has rank < rk: later picks carry
         * nothing new (the least-squares step gives them zero weight). */
        if (!(dp > floor_))
            continue;
        double r = 1.0 / sqrt(dp);
        for (int i = 0; i < m; i++)
            l[i] = s[(size_t)i * m + p] * r;
        for (int i = 0; i < m; i++)
            for (int j = 0; j < m; j++)
                s[(size_t)i * m + j] -= l[i] * l[j];
    }
}

/* Swap refinement of mask (rk points, any order; sorted on return) on tr S, S the residual
 * Gram of c given the mask. Per round: P = C[M,M]⁻¹, B = C[:,M] P, S = C − B C[M,:] and
 * SB = S B. Taking r out gives S' = S + b bᵀ / P[r][r] (b = B[:,r]: the residual then carries
 * r's innovation, of energy 1/P[r][r], along b); adding j to that explains ‖S'[:,j]‖²/S'[j][j]
 * with ‖S'[:,j]‖² = ‖S[:,j]‖² + 2β SB[j][r] + β²‖b‖², S'[j][j] = S[j][j] + β b[j], β = b[j]/P[r][r].
 * So every (r, j) costs O(1) after the three products. Returns KVCAP_OK also when it stops
 * early (C[M,M] not positive definite: rank-deficient data keeps the greedy mask). */
static enum kvcap_status swap_refine(const double *c, int m, int rk, double band,
                                     double floor_, int32_t *mask)
{
    if (rk >= m) { /* every point kept: nothing to swap, the mask only needs its order */
        qsort(mask, (size_t)rk, sizeof *mask, compare_i32);
        return KVCAP_OK;
    }
    size_t mm = (size_t)m, r = (size_t)rk;
    double *p = malloc(sizeof(double) * r * r), *b = malloc(sizeof(double) * mm * r);
    double *cm = malloc(sizeof(double) * mm * r), *s = malloc(sizeof(double) * mm * mm);
    double *sb = malloc(sizeof(double) * mm * r), *cn = malloc(sizeof(double) * mm);
    double *bn = malloc(sizeof(double) * r);
    char *in = malloc(mm);
    if (!p || !b || !cm || !s || !sb || !cn || !bn || !in) {
        free(p), free(b), free(cm), free(s), free(sb), free(cn), free(bn), free(in);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "keys mask refinement: out of memory (m %d)",
                          m);
    }
    double round_flops = 4.0 * (double)m * m * rk + 2.0 * (double)m * rk * rk + 4.0 * (double)rk * rk * rk;
    int rounds = (int)(KEYS_SWAP_FLOPS / round_flops);
    rounds = rounds < 4 * rk ? rounds : 4 * rk; /* each accepted swap gains > band: finite anyway */
    for (int round = 0; round < rounds; round++) {
        qsort(mask, r, sizeof *mask, compare_i32);
        memset(in, 0, mm);
        double mean_diag = 0.0;
        for (size_t i = 0; i < r; i++) {
            in[mask[i]] = 1;
            for (size_t j = 0; j < r; j++)
                p[i * r + j] = c[(size_t)mask[i] * mm + (size_t)mask[j]];
            mean_diag += p[i * r + i] / (double)r;
        }
        for (size_t i = 0; i < r; i++) /* a whisker of jitter: P stays finite at rank ~ rk */
            p[i * r + i] += 1e-12 * mean_diag;
        if (LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'U', rk, p, rk) != 0 ||
            LAPACKE_dpotri(LAPACK_ROW_MAJOR, 'U', rk, p, rk) != 0)
            break;
        for (size_t i = 0; i < r; i++)
            for (size_t j = 0; j < i; j++)
                p[i * r + j] = p[j * r + i];
        for (size_t i = 0; i < mm; i++)
            for (size_t j = 0; j < r; j++)
                cm[i * r + j] = c[i * mm + (size_t)mask[j]];
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, rk, rk, 1.0, cm, rk, p, rk,
                    0.0, b, rk);
        memcpy(s, c, sizeof(double) * mm * mm);
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, m, rk, -1.0, b, rk, cm, rk, 1.0,
                    s, m);
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, rk, m, 1.0, s, m, b, rk, 0.0,
                    sb, rk);
        double err = 0.0;
        for (size_t j = 0; j < mm; j++) {
            err += in[j] ? 0.0 : s[j * mm + j];
            double t = 0.0;
            for (size_t i = 0; i < mm; i++)
                t += s[i * mm + j] * s[i * mm + j];
            cn[j] = t;
        }
        for (size_t q = 0; q < r; q++) {
            double t = 0.0;
            for (size_t i = 0; i < mm; i++)
                t += b[i * r + q] * b[i * r + q];
            bn[q] = t;
        }
        /* Best swap, then the first (r, j) in index order within the band of it. */
        double best = INFINITY;
        for (int pass = 0; pass < 2; pass++)
            for (size_t q = 0; q < r; q++) {
                double prr = p[q * r + q];
                if (!(prr > 0))
                    continue;
                for (size_t j = 0; j < mm; j++) {
                    if (in[j])
                        continue;
                    double beta = b[j * r + q] / prr, d = s[j * mm + j] + beta * b[j * r + q];
                    double e = err + bn[q] / prr;
                    if (d > floor_)
                        e -= (cn[j] + 2.0 * beta * sb[j * r + q] + beta * beta * bn[q]) / d;
                    if (pass == 0) {
                        best = e < best ? e : best;
                    } else if (e <= best + band) {
                        if (e < err - band) { /* a real gain, not rounding */
                            mask[q] = (int32_t)j;
                            goto swapped;
                        }
                        goto done;
                    }
                }
            }
        break; /* no finite candidate */
    swapped:;
    }
done:
    qsort(mask, r, sizeof *mask, compare_i32);
    free(p), free(b), free(cm), free(s), free(sb), free(cn), free(bn), free(in);
    return KVCAP_OK;
}

/* The mask for a symmetric Gram c: greedy by explained energy, then swap refinement. */
static enum kvcap_status select_mask(const double *c, int m, int rk, int32_t *mask)
{
    size_t mm = (size_t)m;
    double *s = malloc(sizeof(double) * mm * mm), *l = malloc(sizeof(double) * mm);
    char *used = malloc(mm);
    if (!s || !l || !used) {
        free(s), free(l), free(used);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "keys mask: out of memory (m %d)", m);
    }
    double trace = 0.0, dmax = 0.0;
    for (size_t i = 0; i < mm; i++) {
        trace += c[i * mm + i];
        dmax = c[i * mm + i] > dmax ? c[i * mm + i] : dmax;
    }
    double band = KEYS_TIE_TOL * trace, floor_ = 1e-12 * dmax;
    memcpy(s, c, sizeof(double) * mm * mm);
    greedy_select(s, m, rk, band, floor_, used, l, mask);
    free(s), free(l), free(used);
    return swap_refine(c, m, rk, band, floor_, mask);
}

/* (C + Cᵀ)/2 into a new array. */
static double *symmetrized(const double *g, int m)
{
    size_t mm = (size_t)m;
    double *c = malloc(sizeof(double) * mm * mm);
    if (c)
        for (size_t i = 0; i < mm; i++)
            for (size_t j = 0; j < mm; j++)
                c[i * mm + j] = 0.5 * (g[i * mm + j] + g[j * mm + i]);
    return c;
}

enum kvcap_status kvcap_keys_closed_form(const double *gram, int m, int rk, int h, double ridge,
                                         struct kvcap_key_maps *out)
{
    KVCAP_RETURN_IF(!gram || !out || m < 1 || rk < 1 || rk > m || h < 1 || !(ridge >= 0),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "keys closed form: m %d, rk %d, h %d, ridge %g (need 1 <= rk <= m, h >= 1, "
                    "ridge >= 0)",
                    m, rk, h, ridge);
    int32_t *mask = malloc(sizeof *mask * (size_t)rk);
    double *c = symmetrized(gram, m);
    enum kvcap_status st = KVCAP_OK;
    if (!mask || !c)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "keys closed form: out of memory (m %d)", m);
    if (st == KVCAP_OK)
        st = select_mask(c, m, rk, mask);
    if (st == KVCAP_OK)
        st = kvcap_keys_closed_form_mask(c, m, mask, rk, h, ridge, out);
    free(mask);
    free(c);
    return st;
}

enum kvcap_status kvcap_keys_select(const double *gram, int m, int rk, int32_t *mask)
{
    KVCAP_RETURN_IF(!gram || !mask || m < 1 || rk < 1 || rk > m, KVCAP_ERR_INVALID_ARGUMENT,
                    "keys select: m %d, rk %d (need 1 <= rk <= m)", m, rk);
    double *c = symmetrized(gram, m);
    KVCAP_RETURN_IF(!c, KVCAP_ERR_OUT_OF_MEMORY, "keys select: out of memory (m %d)", m);
    enum kvcap_status st = select_mask(c, m, rk, mask);
    free(c);
    return st;
}

enum kvcap_status kvcap_keys_closed_form_mask(const double *gram, int m, const int32_t *mask,
                                              int rk, int h, double ridge,
                                              struct kvcap_key_maps *out)
{
    KVCAP_RETURN_IF(!gram || !mask || !out || m < 1 || rk < 1 || rk > m || h < 1 ||
                        !(ridge >= 0),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "keys closed form: m %d, rk %d, h %d, ridge %g (need 1 <= rk <= m, h >= 1, "
                    "ridge >= 0)",
                    m, rk, h, ridge);
    for (int i = 0; i < rk; i++)
        KVCAP_RETURN_IF(mask[i] < 0 || mask[i] >= m || (i > 0 && mask[i] <= mask[i - 1]),
                        KVCAP_ERR_INVALID_ARGUMENT,
                        "keys closed form: mask[%d] = %d (need strictly increasing in [0, %d))",
                        i, (int)mask[i], m);
    if (h > rk)
        h = rk; /* a linear map of rank > rk does not exist */
    KVCAP_TRY(kvcap_key_maps_alloc(out, m, rk, h, 0));
    memcpy(out->mask, mask, sizeof *mask * (size_t)rk);
    enum kvcap_status st = KVCAP_OK;
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
