/* flashcache.c — FlashCache's numbers (DESIGN §5): per-token deviation from the DCT low-pass
 * Base (brute-force oracle first, then the FFT version), layer weights from the high-frequency
 * energy, and water-filled integer layer budgets. Never looks at a query. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels/flashcache.h"
#include "common/internal.h"
#include "kernels/select.h"

int kvcap_flashcache_omega(double gamma, int n)
{
    if (n < 1)
        return 0;
    double g = gamma * n;
    if (!(g > 1)) /* NaN too */
        return 1;
    if (g >= n)
        return n;
    /* γ is a decimal in a config: 0.07·100 is 7.000000000000001 in double and means 7. */
    double r = round(g);
    return (int)(fabs(g - r) <= 1e-9 * r ? r : ceil(g));
}

double kvcap_flashcache_layer_weight(const struct kvcap_energy *e)
{
    if (!e)
        return NAN; /* surfaces as an invalid weight in kvcap_budget_allocate */
    double r[2], low[2] = {e->k_low, e->v_low}, total[2] = {e->k_total, e->v_total};
    for (int i = 0; i < 2; i++) {
        r[i] = total[i] == 0 ? 0.0 : 1.0 - low[i] / total[i];
        r[i] = r[i] < 0 ? 0.0 : r[i] > 1 ? 1.0 : r[i]; /* NaN passes through */
    }
    return r[0] + r[1];
}

/* ---- deviation: reference --------------------------------------------------------------------- */

void kvcap_flashcache_deviation_ref(int n, const float *k, const float *v, int d, int omega,
                                    float *dev, struct kvcap_energy *e)
{
    omega = omega < 0 ? 0 : omega > n ? n : omega;
    double *basis = malloc(sizeof(double) * ((size_t)omega * n + 2 * (size_t)n + (size_t)omega + 1));
    if (!basis) {
        for (int j = 0; j < n; j++)
            dev[j] = NAN;
        return;
    }
    double *acc = basis + (size_t)omega * n, *col = acc + n, *coef = col + n;
    for (int q = 0; q < omega; q++)
        for (int j = 0; j < n; j++)
            basis[(size_t)q * n + j] = kvcap_dct_basis(n, q, j);
    for (int j = 0; j < n; j++)
        acc[j] = 0;
    double total[2] = {0, 0}, low[2] = {0, 0};
    const float *mats[2] = {k, v};
    for (int t = 0; t < 2; t++)
        for (int c = 0; c < d; c++) {
            for (int j = 0; j < n; j++) {
                col[j] = mats[t][(size_t)j * d + c];
                total[t] += col[j] * col[j];
            }
            for (int q = 0; q < omega; q++) {
                double s = 0;
                for (int j = 0; j < n; j++)
                    s += basis[(size_t)q * n + j] * col[j];
                coef[q] = s;
                low[t] += s * s;
            }
            for (int j = 0; j < n; j++) {
                double base = 0;
                for (int q = 0; q < omega; q++)
                    base += basis[(size_t)q * n + j] * coef[q];
                acc[j] += (col[j] - base) * (col[j] - base);
            }
        }
    for (int j = 0; j < n; j++)
        dev[j] = (float)(acc[j] / d);
    if (e) {
        e->k_total += total[0];
        e->k_low += low[0];
        e->v_total += total[1];
        e->v_low += low[1];
    }
    free(basis);
}

/* ---- deviation: fast -------------------------------------------------------------------------- */

/* Channels transformed per pass: the block of coefficients (n × 32 floats) stays in cache
 * between the forward transform, the energy sum, the inverse and the deviation. */
#define FC_BLOCK 32

static int block_cols(int d)
{
    return d < FC_BLOCK ? d : FC_BLOCK;
}

size_t kvcap_flashcache_scratch_floats(const struct kvcap_dct *plan, int d)
{
    if (!plan || d < 1)
        return 0;
    return (size_t)kvcap_dct_length(plan) * (size_t)block_cols(d) + kvcap_dct_scratch_floats(plan);
}

/* One of K, V: dev[j] += mean_c (x − base)², *total += Σ x², *low += Σ_{k<ω} C². */
static void deviation_one(const struct kvcap_dct *plan, const float *x, int d, int omega,
                          float *dev, double *total, double *low, float *scratch)
{
    const int n = kvcap_dct_length(plan), bw = block_cols(d);
    float *buf = scratch, *dct_scratch = scratch + (size_t)n * bw;
    for (int c0 = 0; c0 < d; c0 += bw) {
        const int w = d - c0 < bw ? d - c0 : bw;
        kvcap_dct_forward(plan, x + c0, (size_t)d, w, buf, (size_t)w, dct_scratch);
        double lo = 0;
        for (size_t i = 0; i < (size_t)omega * w; i++)
            lo += (double)buf[i] * buf[i];
        *low += lo;
        kvcap_dct_inverse(plan, buf, (size_t)w, w, omega, buf, (size_t)w, dct_scratch);
        double tot = 0;
        for (int j = 0; j < n; j++) {
            const float *xr = x + (size_t)j * d + c0, *br = buf + (size_t)j * w;
            double s = 0;
            for (int c = 0; c < w; c++) {
                double r = (double)xr[c] - br[c];
                s += r * r;
                tot += (double)xr[c] * xr[c];
            }
            dev[j] += (float)(s / d);
        }
        *total += tot;
    }
}

void kvcap_flashcache_deviation(const struct kvcap_dct *plan, const float *k, const float *v,
                                int d, int omega, float *dev, struct kvcap_energy *e,
                                float *scratch)
{
    const int n = kvcap_dct_length(plan);
    omega = omega < 0 ? 0 : omega > n ? n : omega;
    for (int j = 0; j < n; j++)
        dev[j] = 0.0f;
    double kt = 0, kl = 0, vt = 0, vl = 0;
    deviation_one(plan, k, d, omega, dev, &kt, &kl, scratch);
    deviation_one(plan, v, d, omega, dev, &vt, &vl, scratch);
    if (e) {
        e->k_total += kt;
        e->k_low += kl;
        e->v_total += vt;
        e->v_low += vl;
    }
}

/* ---- layer budgets ---------------------------------------------------------------------------- */

static int floor_of(const int *cap, int lo, int l)
{
    return lo < cap[l] ? lo : cap[l];
}

/* Water-filling over the layers with active[l] set: finds x = clip(t·wt, floor, cap) with
 * Σ_all x = T, where the inactive layers keep their x. Each round spreads the rest in
 * proportion to wt; if clipping the violators would add tokens, the true t is smaller, so the
 * layers under their floor at this t are under it at the true t too and are frozen there
 * (symmetrically for caps); each round freezes at least one layer. On return every layer is
 * inactive; if the active layers all reach their caps the rest stays unassigned (the caller's
 * next stage takes it). */
static void water_fill(double T, const double *wt, const int *cap, int lo, int L,
                       unsigned char *active, double *x)
{
    for (;;) {
        double rest = T, wsum = 0;
        int nact = 0;
        for (int l = 0; l < L; l++) {
            if (active[l]) {
                wsum += wt[l];
                nact++;
            } else {
                rest -= x[l];
            }
        }
        if (nact == 0)
            return;
        double t = rest / wsum, push = 0;
        for (int l = 0; l < L; l++) {
            if (!active[l])
                continue;
            double y = t * wt[l];
            if (y < floor_of(cap, lo, l))
                push += floor_of(cap, lo, l) - y;
            else if (y > cap[l])
                push += cap[l] - y;
        }
        for (int l = 0; l < L; l++) {
            if (!active[l])
                continue;
            double y = t * wt[l], f = floor_of(cap, lo, l);
            if (y < f && push >= 0) {
                x[l] = f;
                active[l] = 0;
            } else if (y > cap[l] && push <= 0) {
                x[l] = cap[l];
                active[l] = 0;
            } else if (push == 0) { /* no violator at all, or they cancel: t is the answer */
                x[l] = y;
                active[l] = 0;
            }
        }
    }
}

enum kvcap_status kvcap_budget_allocate(const double *w, const int *cap, int L, int lo,
                                        int64_t total, int *budget)
{
    KVCAP_RETURN_IF(!w || !cap || !budget, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_budget_allocate: w, cap and budget must not be NULL");
    KVCAP_RETURN_IF(L < 1, KVCAP_ERR_INVALID_ARGUMENT, "kvcap_budget_allocate: L = %d < 1", L);
    KVCAP_RETURN_IF(lo < 0, KVCAP_ERR_INVALID_ARGUMENT, "kvcap_budget_allocate: lo = %d < 0", lo);
    int64_t sum_floor = 0, sum_cap = 0;
    double wmax = 0;
    for (int l = 0; l < L; l++) {
        KVCAP_RETURN_IF(!isfinite(w[l]) || w[l] < 0, KVCAP_ERR_INVALID_ARGUMENT,
                        "kvcap_budget_allocate: w[%d] = %g is not a finite weight >= 0", l, w[l]);
        KVCAP_RETURN_IF(cap[l] < 0, KVCAP_ERR_INVALID_ARGUMENT,
                        "kvcap_budget_allocate: cap[%d] = %d < 0", l, cap[l]);
        sum_floor += floor_of(cap, lo, l);
        sum_cap += cap[l];
        wmax = w[l] > wmax ? w[l] : wmax;
    }
    int64_t T = total < sum_floor ? sum_floor : total > sum_cap ? sum_cap : total;

    double *x = malloc((size_t)L * (sizeof(double) * 3 + sizeof(float) + 2 * sizeof(int) + 1));
    KVCAP_RETURN_IF(!x, KVCAP_ERR_OUT_OF_MEMORY, "kvcap_budget_allocate: L = %d", L);
    double *wn = x + L, *capw = wn + L;
    float *score = (float *)(capw + L);
    int *idx = (int *)(score + L), *work = idx + L;
    unsigned char *active = (unsigned char *)(work + L);

    /* Stage 1: the positive weights share T, zero-weight layers at their floor. Stage 2 (only
     * when every positive-weight layer is at its cap, or no weight is positive): the
     * zero-weight layers share the rest in proportion to cap.
     * Weights are scaled by the largest so that their sum cannot overflow; one that underflows
     * to 0 counts as zero. */
    int positive = 0;
    for (int l = 0; l < L; l++) {
        wn[l] = wmax > 0 ? w[l] / wmax : 0;
        active[l] = wn[l] > 0;
        positive |= active[l];
        x[l] = floor_of(cap, lo, l);
        capw[l] = cap[l];
    }
    if (positive)
        water_fill((double)T, wn, cap, lo, L, active, x);
    double assigned = 0;
    for (int l = 0; l < L; l++)
        assigned += x[l];
    if (assigned < (double)T - 0.5 || !positive) {
        for (int l = 0; l < L; l++)
            active[l] = wn[l] == 0 && cap[l] > 0;
        water_fill((double)T, capw, cap, lo, L, active, x);
    }

    /* Largest remainder: floors first, then one unit each to the largest fractional parts
     * (taking back from the smallest if rounding in the sums overshot). */
    int64_t left = T;
    for (int l = 0; l < L; l++) {
        double f = floor(x[l]);
        int fl = floor_of(cap, lo, l);
        int b = !(f >= fl) ? fl : f > cap[l] ? cap[l] : (int)f; /* NaN would land on fl */
        budget[l] = b;
        left -= b;
    }
    while (left != 0) {
        int eligible = 0;
        for (int l = 0; l < L; l++) {
            int ok = left > 0 ? budget[l] < cap[l] : budget[l] > floor_of(cap, lo, l);
            score[l] = ok ? (float)(left > 0 ? x[l] - budget[l] : budget[l] - x[l]) : NAN;
            eligible += ok;
        }
        if (eligible == 0)
            break;
        int64_t want = left > 0 ? left : -left;
        int got = kvcap_topk_indices(score, L, want < eligible ? (int)want : eligible, idx, work);
        for (int i = 0; i < got; i++)
            budget[idx[i]] += left > 0 ? 1 : -1;
        left += left > 0 ? -got : got;
    }
    free(x);
    KVCAP_RETURN_IF(left != 0, KVCAP_ERR_INTERNAL,
                    "kvcap_budget_allocate: %lld tokens left after rounding", (long long)left);
    return KVCAP_OK;
}

void kvcap_flashcache_window(int n, int lo, int hi, int *a, int *b)
{
    *a = lo, *b = hi;
    for (int len = hi - lo; len <= n && !kvcap_dct_fast_length(hi - lo); len++)
        if (kvcap_dct_fast_length(len)) {
            *a = lo < n - len ? lo : n - len; /* ≤ lo, and a + len ≥ hi */
            *b = *a + len;
            return;
        }
}
