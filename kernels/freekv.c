/* freekv.c — FreeKV's page selection (kernels/freekv.h): the readable oracle, then the fast
 * selection the paged store runs per KV head, and the group-mean query cosine. */
#include <math.h>
#include <stdlib.h>

#include "kernels/freekv.h"
#include "kernels/select.h"

struct kvcap_freekv_params kvcap_freekv_default_params(void)
{
    struct kvcap_freekv_params p = {32, 2048, 1, 2, 0.9f};
    return p;
}

/* ---- The oracle ----------------------------------------------------------------------------- */

int kvcap_freekv_select_ref(const float *kmax, const float *kmin, int n_pages, const float *q,
                            int G, int d, int sink_pages, int window_pages, int k, int *sel,
                            double *score)
{
    if (n_pages <= 0 || G <= 0 || d <= 0)
        return 0;
    for (int p = 0; score && p < n_pages; p++)
        score[p] = NAN;
    int lo = sink_pages < n_pages ? (sink_pages > 0 ? sink_pages : 0) : n_pages;
    int hi = n_pages - (window_pages > 0 ? window_pages : 0);
    if (hi < lo)
        hi = lo;
    int nc = hi - lo;
    if (nc == 0 || k <= 0)
        return 0;
    double *raw = malloc(sizeof(double) * 2 * (size_t)nc);
    float *key = malloc(sizeof(float) * (size_t)nc);
    if (!raw || !key) {
        free(raw);
        free(key);
        return -1;
    }
    double *mean = raw + nc;
    for (int i = 0; i < nc; i++)
        mean[i] = 0;
    for (int g = 0; g < G; g++) {
        const float *qg = q + (size_t)g * d;
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < nc; i++) {
            const float *hi_k = kmax + (size_t)(lo + i) * d, *lo_k = kmin + (size_t)(lo + i) * d;
            double r = 0;
            for (int c = 0; c < d; c++)
                r += fmax((double)qg[c] * hi_k[c], (double)qg[c] * lo_k[c]);
            raw[i] = r;
            mx = r > mx ? r : mx;
        }
        for (int i = 0; i < nc; i++)
            sum += exp(raw[i] - mx);
        for (int i = 0; i < nc; i++)
            mean[i] += exp(raw[i] - mx) / sum / G;
    }
    /* The shared top-k ranks floats: the log keeps pages far below the best apart instead of
     * rounding their tiny scores to equal floats. */
    for (int i = 0; i < nc; i++) {
        key[i] = (float)log(mean[i]);
        if (score)
            score[lo + i] = mean[i];
    }
    int n = kvcap_topk_indices_ref(key, nc, k, sel);
    for (int i = 0; i < n; i++)
        sel[i] += lo;
    free(raw);
    free(key);
    return n;
}

/* ---- The fast selection -------------------------------------------------------------------- */

/* Σ_c max(q_c·kmax_c, q_c·kmin_c) = qpos·kmax + qneg·kmin (qpos = max(q, 0), qneg = min(q, 0),
 * as kmax >= kmin): two plain dot products, eight partial sums so the compiler can vectorise. */
static float digest_score(const float *qpos, const float *qneg, const float *kmax,
                          const float *kmin, int d)
{
    float acc[8] = {0};
    int c = 0;
    for (; c + 8 <= d; c += 8)
        for (int j = 0; j < 8; j++)
            acc[j] += qpos[c + j] * kmax[c + j] + qneg[c + j] * kmin[c + j];
    for (; c < d; c++)
        acc[0] += qpos[c] * kmax[c] + qneg[c] * kmin[c];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

int kvcap_freekv_select(const float *dig, int lo, int hi, const float *q, int G, int d, int k,
                        float *score, float *qsplit, int *work, int *sel, uint64_t *bytes)
{
    int nc = hi - lo;
    if (nc <= k) { /* everything fits: no scores needed */
        for (int i = 0; i < nc; i++)
            sel[i] = lo + i;
        return nc;
    }
    size_t cap = (size_t)nc;
    float *raw = score, *m = raw + cap, *s = m + cap;
    float *qpos = qsplit, *qneg = qpos + d;
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < d; c++) {
            float x = q[(size_t)g * d + c];
            qpos[c] = x > 0 ? x : 0;
            qneg[c] = x < 0 ? x : 0;
        }
        float mx = -INFINITY;
        for (int i = 0; i < nc; i++) {
            const float *kmax = dig + (size_t)(lo + i) * 2 * d;
            raw[i] = digest_score(qpos, qneg, kmax, kmax + d, d);
            mx = raw[i] > mx ? raw[i] : mx;
        }
        float sum = 0;
        for (int i = 0; i < nc; i++)
            sum += expf(raw[i] - mx);
        float lse = mx + logf(sum);
        for (int i = 0; i < nc; i++) {
            float lp = raw[i] - lse; /* log softmax of page i for query g */
            if (g == 0) {
                m[i] = lp;
                s[i] = 1;
            } else if (lp > m[i]) {
                s[i] = s[i] * expf(m[i] - lp) + 1;
                m[i] = lp;
            } else {
                s[i] += expf(lp - m[i]);
            }
        }
    }
    for (int i = 0; i < nc; i++)
        raw[i] = m[i] + logf(s[i]); /* log Σ_g softmax: the mean up to the constant log G */
    int n = kvcap_topk_indices(raw, nc, k, sel, work);
    for (int i = 0; i < n; i++)
        sel[i] += lo;
    if (bytes)
        *bytes += (uint64_t)nc * 2 * d * sizeof(float);
    return n;
}

/* Mean over g of cos(q_g, p_g), clamped to [-1, 1]; a zero vector is at cosine 0 from anything
 * but another zero vector (a head whose query vanished has moved). */
double kvcap_freekv_group_cosine(const float *q, const float *p, int G, int d)
{
    double total = 0;
    for (int g = 0; g < G; g++) {
        double qq = 0, pp = 0, qp = 0;
        for (int c = 0; c < d; c++) {
            double a = q[(size_t)g * d + c], b = p[(size_t)g * d + c];
            qq += a * a;
            pp += b * b;
            qp += a * b;
        }
        total += qq > 0 && pp > 0 ? qp / sqrt(qq * pp) : (qq == 0 && pp == 0 ? 1.0 : 0.0);
    }
    double c = total / G;
    return c > 1 ? 1 : c < -1 ? -1 : c;
}

