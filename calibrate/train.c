/* train.c — the trained key maps (DESIGN §4, the paper's Algorithm 2): a relaxed mask
 * σ(α/τ) over all m points and the reconstructor, optimised together by Adam while τ anneals,
 * then the hard top-rk mask and a fine-tune; the best validation checkpoint is returned. */
#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "calibrate/calib_cuda.h"
#include "common/internal.h"
#include "calibrate/keys.h"
#include "common/rng.h"
#include "calibrate/train_internal.h"

/* The relaxed mask starts at 0.95 on the retained points and 0.05 elsewhere: decided enough
 * that the start is the closed form, soft enough that the gradient still reaches α. */
#define INIT_MASK 0.95

/* Ridge of the least-squares readout (kvcap_train_net_fit_readout), relative to the mean
 * variance of the hidden units: only there to keep the solve defined when two hidden units
 * coincide; training sets have far more columns than hidden units, so no more is needed. */
#define READOUT_RIDGE 1e-6

/* What the relaxed mask can and cannot do. The data term sees mask_j and W1 row j only through
 * their product, so ∂L/∂mask_j = ⟨W1[j], ∂L/∂W1[j]⟩ / mask_j: zero for the dropped points at
 * the start (their W1 rows are zero) and zero again wherever W1 has adapted. The mask moves
 * only while W1 is catching up, and the two mask terms favour the current assignment, so in
 * practice the hard mask stays near the initial one (on a deliberately bad start mask it does
 * not escape: tests/test_train.c); the gains come from the reconstructor and the fine-tune,
 * and the checkpoints make sure nothing is lost.
 *
 * What the fine-tune can reach from a linear init. The GELU start sits in GELU's identity
 * range (exactly: φ(z) == z in float there, so the network is linear and no gradient points
 * out of that range), and the closed form is already the least-squares map for its mask, so
 * the only gains left are the ridge and b2 (the closed form has none) and whatever a moved
 * first layer buys. Minibatch Adam at a constant rate only circled that optimum (on the
 * recorded SmolLM2 keys +0.05–0.3 % MSE: every unit kept its closed form). Hence the
 * fine-tune's rate decays to zero, and W2, b2 are re-solved by least squares after hardening
 * and after the last step (kvcap_train_net_fit_readout). Starting the GELU off the identity
 * range instead (pre-activations standardised to scale 0.1–1, readout solved) began 2–100 %
 * worse on those keys and 3000 steps did not get back to the linear fit: with h <= rk hidden
 * units every unit that bends gives up a direction the linear map needs. */

/* ---- The network ---------------------------------------------------------------------- */

struct kvcap_train_view kvcap_train_split(const struct kvcap_train_net *net, float *base)
{
    struct kvcap_train_view v;
    size_t o = 0, m = (size_t)net->m, p = (size_t)net->p, h = (size_t)net->h;
    v.alpha = net->rows ? NULL : base;
    o += net->rows ? 0 : m;
    v.w1 = base + o;
    o += p * h;
    v.b1 = base + o;
    o += h;
    v.w2 = base + o;
    o += h * m;
    v.b2 = base + o;
    return v;
}

enum kvcap_status kvcap_train_net_alloc(struct kvcap_train_net *net, int m, int p, int h,
                                        int gelu, const int32_t *rows)
{
    KVCAP_RETURN_IF(!net || m < 1 || p < 1 || p > m || h < 1 || (!rows && p != m),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "train net: sizes m %d, p %d, h %d (need 1 <= p <= m, p == m when relaxed, "
                    "h >= 1)",
                    m, p, h);
    memset(net, 0, sizeof *net);
    size_t ph, hm, n;
    if (!kvcap_mul_size((size_t)p, (size_t)h, &ph) || !kvcap_mul_size((size_t)h, (size_t)m, &hm) ||
        !kvcap_add_size(ph, hm, &n) || !kvcap_add_size(n, (size_t)h + 2 * (size_t)m, &n))
        return kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "train net: m %d, h %d overflow", m, h);
    if (rows)
        n -= (size_t)m; /* no α once the mask is hard */
    net->m = m;
    net->p = p;
    net->h = h;
    net->gelu = gelu != 0;
    net->n_params = n;
    net->theta = calloc(n, sizeof *net->theta);
    if (rows) {
        net->rows = malloc(sizeof *net->rows * (size_t)p);
        if (net->rows)
            memcpy(net->rows, rows, sizeof *net->rows * (size_t)p);
    }
    if (!net->theta || (rows && !net->rows)) {
        kvcap_train_net_free(net);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "train net: out of memory (m %d, h %d)", m, h);
    }
    return KVCAP_OK;
}

void kvcap_train_net_free(struct kvcap_train_net *net)
{
    if (!net)
        return;
    free(net->rows);
    free(net->theta);
    memset(net, 0, sizeof *net);
}

/* The mask value of one point. Every user (forward, init, hardening) goes through here so the
 * init's division by the mask and the hardening's multiplication use the same float. */
static double sigmoid(double s)
{
    return 1.0 / (1.0 + exp(-s));
}

static float mask_of(float alpha, double tau)
{
    return (float)sigmoid(alpha / tau);
}

static int all_finite_d(const double *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(v[i]))
            return 0;
    return 1;
}

/* Per hidden unit, the range [zmin, zmax] over the columns of x of init's pre-activation
 * W1ᵀ x[M] + b1. */
static enum kvcap_status preact_range(const struct kvcap_key_maps *init, const float *x,
                                      size_t ldx, size_t n_cols, float *zmin, float *zmax)
{
    const int rk = init->rk, h = init->h;
    size_t b = n_cols < KVCAP_TRAIN_BATCH ? n_cols : KVCAP_TRAIN_BATCH;
    float *u = malloc(sizeof *u * (size_t)(rk + h) * b);
    KVCAP_RETURN_IF(!u, KVCAP_ERR_OUT_OF_MEMORY, "train init: out of memory (rk %d, h %d)", rk, h);
    float *z = u + (size_t)rk * b;
    for (int i = 0; i < h; i++) {
        zmin[i] = INFINITY;
        zmax[i] = -INFINITY;
    }
    for (size_t c0 = 0; c0 < n_cols; c0 += b) {
        size_t nb = n_cols - c0 < b ? n_cols - c0 : b;
        for (int r = 0; r < rk; r++)
            memcpy(u + (size_t)r * nb, x + (size_t)init->mask[r] * ldx + c0, sizeof *u * nb);
        for (int i = 0; i < h; i++)
            for (size_t c = 0; c < nb; c++)
                z[(size_t)i * nb + c] = init->b1[i];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, h, (int)nb, rk, 1.0f, init->w1, h, u,
                    (int)nb, 1.0f, z, (int)nb);
        for (int i = 0; i < h; i++)
            for (size_t c = 0; c < nb; c++) {
                float v = z[(size_t)i * nb + c];
                zmin[i] = v < zmin[i] ? v : zmin[i];
                zmax[i] = v > zmax[i] ? v : zmax[i];
            }
    }
    free(u);
    return KVCAP_OK;
}

enum kvcap_status kvcap_train_net_init_relaxed(struct kvcap_train_net *net,
                                               const struct kvcap_key_maps *init, int gelu,
                                               const struct kvcap_train_config *cfg,
                                               const float *x, size_t ldx, size_t n_cols)
{
    KVCAP_RETURN_IF(init->gelu && !gelu, KVCAP_ERR_INVALID_ARGUMENT,
                    "train init: init is a GELU network but a linear one was asked for (gelu 0)");
    const int m = init->m, rk = init->rk, h = init->h;
    KVCAP_TRY(kvcap_train_net_alloc(net, m, m, h, gelu, NULL));
    net->tau = cfg->tau_start;
    net->lambda_bce = cfg->lambda_bce;
    net->lambda_r = cfg->lambda_r;
    net->ratio = (double)rk / m;
    struct kvcap_train_view v = kvcap_train_split(net, net->theta);

    float a = (float)(cfg->tau_start * log(INIT_MASK / (1.0 - INIT_MASK)));
    for (int j = 0; j < m; j++)
        v.alpha[j] = -a;
    for (int r = 0; r < rk; r++) {
        int j = init->mask[r];
        v.alpha[j] = a;
        float mk = mask_of(a, net->tau);
        for (int i = 0; i < h; i++)
            v.w1[(size_t)j * h + i] = init->w1[(size_t)r * h + i] / mk;
    }
    memcpy(v.b1, init->b1, sizeof *v.b1 * (size_t)h);
    memcpy(v.w2, init->w2, sizeof *v.w2 * (size_t)h * m);
    memcpy(v.b2, init->b2, sizeof *v.b2 * (size_t)m);
    if (!net->gelu || init->gelu)
        return KVCAP_OK;

    /* Embed the linear map in the GELU network: lift every hidden unit into GELU's identity
     * range on the training data, and take the lift back out through b2. */
    float *c = malloc(sizeof *c * 2 * (size_t)h), *zmax = c ? c + h : NULL;
    enum kvcap_status st = c ? preact_range(init, x, ldx, n_cols, c, zmax)
                             : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "train init: out of memory");
    if (st != KVCAP_OK) {
        free(c);
        kvcap_train_net_free(net);
        return st;
    }
    for (int i = 0; i < h; i++) {
        c[i] = KVCAP_TRAIN_GELU_MARGIN - c[i] + KVCAP_TRAIN_GELU_SLACK * (zmax[i] - c[i]);
        c[i] = c[i] > 0.0f ? c[i] : 0.0f;
        v.b1[i] += c[i];
    }
    for (int j = 0; j < m; j++) {
        double s = 0.0;
        for (int i = 0; i < h; i++)
            s += (double)v.w2[(size_t)i * m + j] * c[i];
        v.b2[j] = (float)(v.b2[j] - s);
    }
    free(c);
    return KVCAP_OK;
}

struct ranked {
    float alpha;
    int32_t index;
};

/* α descending, then index ascending; NaN last (only a diverged run has one). */
static int compare_ranked(const void *pa, const void *pb)
{
    const struct ranked *a = pa, *b = pb;
    int na = isnan(a->alpha), nb = isnan(b->alpha);
    if (na != nb)
        return na - nb;
    if (!na && a->alpha != b->alpha)
        return a->alpha > b->alpha ? -1 : 1;
    return (a->index > b->index) - (a->index < b->index);
}

static int compare_i32(const void *pa, const void *pb)
{
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    return (a > b) - (a < b);
}

enum kvcap_status kvcap_train_net_harden(const struct kvcap_train_net *relaxed, int rk,
                                         struct kvcap_train_net *hard)
{
    KVCAP_RETURN_IF(relaxed->rows || rk < 1 || rk > relaxed->m, KVCAP_ERR_INVALID_ARGUMENT,
                    "train harden: rk %d for m %d (need a relaxed network, 1 <= rk <= m)", rk,
                    relaxed->m);
    const int m = relaxed->m, h = relaxed->h;
    struct kvcap_train_view v = kvcap_train_split(relaxed, relaxed->theta);
    struct ranked *order = malloc(sizeof *order * (size_t)m);
    int32_t *rows = malloc(sizeof *rows * (size_t)rk);
    if (!order || !rows) {
        free(order);
        free(rows);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "train harden: out of memory (m %d)", m);
    }
    for (int j = 0; j < m; j++)
        order[j] = (struct ranked){v.alpha[j], j};
    qsort(order, (size_t)m, sizeof *order, compare_ranked);
    for (int r = 0; r < rk; r++)
        rows[r] = order[r].index;
    qsort(rows, (size_t)rk, sizeof *rows, compare_i32);
    free(order);
    enum kvcap_status st = kvcap_train_net_alloc(hard, m, rk, h, relaxed->gelu, rows);
    free(rows);
    KVCAP_TRY(st);
    hard->tau = relaxed->tau;
    struct kvcap_train_view w = kvcap_train_split(hard, hard->theta);
    for (int r = 0; r < rk; r++) {
        int j = hard->rows[r];
        float mk = mask_of(v.alpha[j], relaxed->tau);
        for (int i = 0; i < h; i++)
            w.w1[(size_t)r * h + i] = v.w1[(size_t)j * h + i] * mk;
    }
    memcpy(w.b1, v.b1, sizeof *w.b1 * (size_t)h);
    memcpy(w.w2, v.w2, sizeof *w.w2 * (size_t)h * m);
    memcpy(w.b2, v.b2, sizeof *w.b2 * (size_t)m);
    return KVCAP_OK;
}

void kvcap_train_net_to_maps(const struct kvcap_train_net *hard, struct kvcap_key_maps *maps)
{
    struct kvcap_train_view v = kvcap_train_split(hard, hard->theta);
    size_t p = (size_t)hard->p, h = (size_t)hard->h, m = (size_t)hard->m;
    maps->gelu = hard->gelu;
    memcpy(maps->mask, hard->rows, sizeof *maps->mask * p);
    memcpy(maps->w1, v.w1, sizeof *maps->w1 * p * h);
    memcpy(maps->b1, v.b1, sizeof *maps->b1 * h);
    memcpy(maps->w2, v.w2, sizeof *maps->w2 * h * m);
    memcpy(maps->b2, v.b2, sizeof *maps->b2 * m);
}

/* ---- Loss and gradient ---------------------------------------------------------------- */

enum kvcap_status kvcap_train_work_alloc(struct kvcap_train_work *w, int m, int h, size_t cols)
{
    memset(w, 0, sizeof *w);
    size_t mc, hc;
    KVCAP_RETURN_IF(!kvcap_mul_size((size_t)m, cols, &mc) || !kvcap_mul_size((size_t)h, cols, &hc),
                    KVCAP_ERR_INVALID_ARGUMENT, "train work: m %d, h %d, %zu columns overflow", m,
                    h, cols);
    w->cols = cols;
    w->u = malloc(sizeof(float) * mc);
    w->y = malloc(sizeof(float) * mc);
    w->z = malloc(sizeof(float) * hc);
    w->hid = malloc(sizeof(float) * hc);
    w->dh = malloc(sizeof(float) * hc);
    w->mask = malloc(sizeof(float) * (size_t)m);
    if (!w->u || !w->y || !w->z || !w->hid || !w->dh || !w->mask) {
        kvcap_train_work_free(w);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "train work: out of memory (m %d, h %d, %zu "
                          "columns)", m, h, cols);
    }
    return KVCAP_OK;
}

void kvcap_train_work_free(struct kvcap_train_work *w)
{
    if (!w)
        return;
    free(w->u);
    free(w->y);
    free(w->z);
    free(w->hid);
    free(w->dh);
    free(w->mask);
    memset(w, 0, sizeof *w);
}

/* Binary entropy of σ(s) from the logit, stable for any s: H = softplus(s) − s·σ(s). */
static double entropy_of_logit(double s)
{
    double softplus = (s > 0 ? s : 0.0) + log1p(exp(-fabs(s)));
    return softplus - s * sigmoid(s);
}

/* The first layer on n_cols columns of x: w->u = the input of W1 (diag(mask) X relaxed, with
 * w->mask; X[rows] hard), w->z = W1ᵀ u + b1 1ᵀ and the hidden activations φ(z), returned
 * (w->hid, or w->z itself when φ is the identity); all p or h x n_cols, packed. */
static float *forward_hidden(const struct kvcap_train_net *net, const float *x, size_t ldx,
                             size_t n_cols, struct kvcap_train_work *w)
{
    const int m = net->m, p = net->p, h = net->h, n = (int)n_cols;
    const size_t nc = n_cols;
    const struct kvcap_train_view P = kvcap_train_split(net, net->theta);
    float *u = w->u, *z = w->z, *hid = net->gelu ? w->hid : w->z;

    /* u = diag(mask) X (relaxed) or X[rows] (hard): the input of W1, p x n */
    if (P.alpha) {
        for (int j = 0; j < m; j++) {
            float mk = w->mask[j] = mask_of(P.alpha[j], net->tau);
            const float *xr = x + (size_t)j * ldx;
            float *ur = u + (size_t)j * nc;
            for (size_t c = 0; c < nc; c++)
                ur[c] = mk * xr[c];
        }
    } else {
        for (int r = 0; r < p; r++)
            memcpy(u + (size_t)r * nc, x + (size_t)net->rows[r] * ldx, sizeof *u * nc);
    }
    /* z = W1ᵀ u + b1 1ᵀ, hid = φ(z) */
    for (int i = 0; i < h; i++)
        for (size_t c = 0; c < nc; c++)
            z[(size_t)i * nc + c] = P.b1[i];
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, h, n, p, 1.0f, P.w1, h, u, n, 1.0f, z, n);
    if (net->gelu)
        for (size_t i = 0; i < (size_t)h * nc; i++)
            hid[i] = kvcap_gelu(z[i]);
    return hid;
}

double kvcap_train_loss_grad(const struct kvcap_train_net *net, const float *x, size_t ldx,
                             size_t n_cols, struct kvcap_train_work *w, float *grad)
{
    const int m = net->m, p = net->p, h = net->h, n = (int)n_cols;
    const size_t nc = n_cols;
    const struct kvcap_train_view P = kvcap_train_split(net, net->theta);
    float *u = w->u, *z = w->z, *y = w->y, *dz = w->dh;
    float *hid = forward_hidden(net, x, ldx, n_cols, w);
    /* y = W2ᵀ hid + b2 1ᵀ, then y := dL/dY = 2 (Y − X) / (m n) */
    for (int j = 0; j < m; j++)
        for (size_t c = 0; c < nc; c++)
            y[(size_t)j * nc + c] = P.b2[j];
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, n, h, 1.0f, P.w2, m, hid, n, 1.0f, y,
                n);
    const double count = (double)m * (double)nc;
    const float scale = (float)(2.0 / count);
    double sse = 0.0;
    for (int j = 0; j < m; j++) {
        const float *xr = x + (size_t)j * ldx;
        float *yr = y + (size_t)j * nc;
        for (size_t c = 0; c < nc; c++) {
            float d = yr[c] - xr[c];
            sse += (double)d * d;
            yr[c] = scale * d;
        }
    }
    double loss = sse / count, mean_mask = 0.0;
    if (P.alpha) {
        double ent = 0.0;
        for (int j = 0; j < m; j++) {
            double s = P.alpha[j] / net->tau;
            mean_mask += sigmoid(s);
            ent += entropy_of_logit(s);
        }
        mean_mask /= m;
        loss += net->lambda_bce * ent / m +
                net->lambda_r * (mean_mask - net->ratio) * (mean_mask - net->ratio);
    }
    if (!grad)
        return loss;

    const struct kvcap_train_view G = kvcap_train_split(net, grad);
    /* dW2 = hid dYᵀ, db2 = dY 1, d(hid) = W2 dY, dz = d(hid) ⊙ φ'(z) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, h, m, n, 1.0f, hid, n, y, n, 0.0f, G.w2,
                m);
    for (int j = 0; j < m; j++) {
        double s = 0.0;
        for (size_t c = 0; c < nc; c++)
            s += y[(size_t)j * nc + c];
        G.b2[j] = (float)s;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, h, n, m, 1.0f, P.w2, m, y, n, 0.0f, dz,
                n);
    if (net->gelu)
        for (size_t i = 0; i < (size_t)h * nc; i++)
            dz[i] *= kvcap_gelu_grad(z[i]);
    /* dW1 = u dzᵀ, db1 = dz 1 */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p, h, n, 1.0f, u, n, dz, n, 0.0f, G.w1,
                h);
    for (int i = 0; i < h; i++) {
        double s = 0.0;
        for (size_t c = 0; c < nc; c++)
            s += dz[(size_t)i * nc + c];
        G.b1[i] = (float)s;
    }
    if (!P.alpha)
        return loss;
    /* du = W1 dz (into y, dY is spent); dmask_j = Σ_c du[j,c] x[j,c]; then through
     * mask = σ(α/τ) together with the two mask terms (dH/ds = −s·σ'(s) for s = α/τ). */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, h, 1.0f, P.w1, h, dz, n, 0.0f, y,
                n);
    const double d_ratio = 2.0 * net->lambda_r * (mean_mask - net->ratio) / m;
    for (int j = 0; j < m; j++) {
        const float *xr = x + (size_t)j * ldx, *dur = y + (size_t)j * nc;
        double dmask = 0.0;
        for (size_t c = 0; c < nc; c++)
            dmask += (double)dur[c] * xr[c];
        double s = P.alpha[j] / net->tau, mk = sigmoid(s), dsig = mk * (1.0 - mk);
        G.alpha[j] = (float)(((dmask + d_ratio) * dsig - net->lambda_bce / m * s * dsig) /
                             net->tau);
    }
    return loss;
}

enum kvcap_status kvcap_train_net_fit_readout(struct kvcap_train_net *net, const float *x,
                                              size_t ldx, size_t n_cols, double ridge,
                                              int *solved)
{
    const int m = net->m, h = net->h;
    *solved = 0;
    KVCAP_RETURN_IF(n_cols == 0, KVCAP_ERR_INVALID_ARGUMENT, "train readout: no columns");
    size_t b = n_cols < KVCAP_TRAIN_BATCH ? n_cols : KVCAP_TRAIN_BATCH;
    struct kvcap_train_work w;
    KVCAP_TRY(kvcap_train_work_alloc(&w, m, h, b));
    size_t hb = (size_t)h * b, mb = (size_t)m * b, hh = (size_t)h * h, hm = (size_t)h * m;
    double *buf = calloc(hb + mb + hh + hm + (size_t)h + (size_t)m, sizeof *buf);
    if (!buf) {
        kvcap_train_work_free(&w);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "train readout: out of memory (m %d, h %d)",
                          m, h);
    }
    double *a = buf, *xd = a + hb, *g = xd + mb, *r = g + hh, *sa = r + hm, *sx = sa + h;
    for (size_t c0 = 0; c0 < n_cols; c0 += b) {
        size_t nb = n_cols - c0 < b ? n_cols - c0 : b;
        const float *hid = forward_hidden(net, x + c0, ldx, nb, &w);
        for (int i = 0; i < h; i++)
            for (size_t c = 0; c < nb; c++) {
                double v = hid[(size_t)i * nb + c];
                a[(size_t)i * nb + c] = v;
                sa[i] += v;
            }
        for (int j = 0; j < m; j++)
            for (size_t c = 0; c < nb; c++) {
                double v = x[(size_t)j * ldx + c0 + c];
                xd[(size_t)j * nb + c] = v;
                sx[j] += v;
            }
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, h, (int)nb, 1.0, a, (int)nb, 1.0, g,
                    h);
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, h, m, (int)nb, 1.0, a, (int)nb, xd,
                    (int)nb, 1.0, r, m);
    }
    kvcap_train_work_free(&w);
    /* centred second moments: the bias takes the means, the ridge acts on W2 alone */
    const double inv = 1.0 / (double)n_cols;
    double tr = 0.0;
    for (int i = 0; i < h; i++) {
        for (int k = i; k < h; k++)
            g[(size_t)i * h + k] = g[(size_t)i * h + k] * inv - sa[i] * inv * sa[k] * inv;
        for (int j = 0; j < m; j++)
            r[(size_t)i * m + j] = r[(size_t)i * m + j] * inv - sa[i] * inv * sx[j] * inv;
        tr += g[(size_t)i * h + i];
    }
    double lam = ridge * tr / h + 1e-30;
    for (int i = 0; i < h; i++)
        g[(size_t)i * h + i] += lam;
    if (tr > 0 && LAPACKE_dposv(LAPACK_ROW_MAJOR, 'U', h, m, g, h, r, m) == 0 &&
        all_finite_d(r, hm)) {
        struct kvcap_train_view v = kvcap_train_split(net, net->theta);
        for (int j = 0; j < m; j++) {
            double bj = sx[j] * inv;
            for (int i = 0; i < h; i++) {
                v.w2[(size_t)i * m + j] = (float)r[(size_t)i * m + j];
                bj -= r[(size_t)i * m + j] * sa[i] * inv;
            }
            v.b2[j] = (float)bj;
        }
        *solved = 1;
    }
    free(buf);
    return KVCAP_OK;
}

/* GELU (tanh form, as kvcap_gelu) and its derivative in double, for the reference. */
static double gelu_d(double x)
{
    const double c = 0.7978845608028654;
    return 0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)));
}

static double gelu_grad_d(double x)
{
    const double c = 0.7978845608028654;
    double t = tanh(c * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}

double kvcap_train_loss_grad_ref(const struct kvcap_train_net *net, const float *x, size_t ldx,
                                 size_t n_cols, float *grad)
{
    const int m = net->m, p = net->p, h = net->h, relaxed = net->rows == NULL;
    const struct kvcap_train_view P = kvcap_train_split(net, net->theta);
    size_t np = net->n_params;
    /* per column: u[p] z[h] a[h] dz[h] dy[m]; over the batch: mask[m] dmask[m] g[np] */
    double *buf = calloc((size_t)p + 3 * (size_t)h + 3 * (size_t)m + np, sizeof *buf);
    if (!buf)
        return NAN;
    double *u = buf, *z = u + p, *a = z + h, *dz = a + h, *dy = dz + h, *mk = dy + m,
           *dmk = mk + m, *g = dmk + m;
    /* gradient blocks inside g, laid out like theta */
    double *g_alpha = g, *g_w1 = g + (relaxed ? m : 0), *g_b1 = g_w1 + (size_t)p * h,
           *g_w2 = g_b1 + h, *g_b2 = g_w2 + (size_t)h * m;
    if (relaxed)
        for (int j = 0; j < m; j++)
            mk[j] = sigmoid(P.alpha[j] / net->tau);

    const double count = (double)m * (double)n_cols;
    double sse = 0.0;
    for (size_t c = 0; c < n_cols; c++) {
        for (int r = 0; r < p; r++)
            u[r] = relaxed ? mk[r] * x[(size_t)r * ldx + c] : x[(size_t)net->rows[r] * ldx + c];
        for (int i = 0; i < h; i++) {
            z[i] = P.b1[i];
            for (int r = 0; r < p; r++)
                z[i] += (double)P.w1[(size_t)r * h + i] * u[r];
            a[i] = net->gelu ? gelu_d(z[i]) : z[i];
        }
        for (int j = 0; j < m; j++) {
            double yj = P.b2[j];
            for (int i = 0; i < h; i++)
                yj += (double)P.w2[(size_t)i * m + j] * a[i];
            double d = yj - x[(size_t)j * ldx + c];
            sse += d * d;
            dy[j] = 2.0 * d / count;
        }
        if (!grad)
            continue;
        for (int i = 0; i < h; i++) {
            double dh = 0.0;
            for (int j = 0; j < m; j++) {
                g_w2[(size_t)i * m + j] += a[i] * dy[j];
                dh += (double)P.w2[(size_t)i * m + j] * dy[j];
            }
            dz[i] = net->gelu ? dh * gelu_grad_d(z[i]) : dh;
            g_b1[i] += dz[i];
        }
        for (int j = 0; j < m; j++)
            g_b2[j] += dy[j];
        for (int r = 0; r < p; r++) {
            double du = 0.0;
            for (int i = 0; i < h; i++) {
                g_w1[(size_t)r * h + i] += u[r] * dz[i];
                du += (double)P.w1[(size_t)r * h + i] * dz[i];
            }
            if (relaxed)
                dmk[r] += du * x[(size_t)r * ldx + c];
        }
    }
    double loss = sse / count;
    if (relaxed) {
        /* mean binary entropy H(mk) = −[mk log mk + (1 − mk) log(1 − mk)], clamped for the
         * logs, and (mean(mk) − ratio)², then everything through dmk/dα = mk(1 − mk)/τ */
        double mean = 0.0, ent = 0.0;
        for (int j = 0; j < m; j++) {
            double q = fmin(fmax(mk[j], 1e-12), 1.0 - 1e-12);
            ent += -(q * log(q) + (1.0 - q) * log(1.0 - q));
            mean += mk[j];
        }
        mean /= m;
        double gap = mean - net->ratio;
        loss += net->lambda_bce * ent / m + net->lambda_r * gap * gap;
        for (int j = 0; j < m; j++) {
            double q = fmin(fmax(mk[j], 1e-12), 1.0 - 1e-12);
            double d = dmk[j] + net->lambda_bce / m * log((1.0 - q) / q) +
                       2.0 * net->lambda_r * (mean - net->ratio) / m;
            g_alpha[j] = d * mk[j] * (1.0 - mk[j]) / net->tau;
        }
    }
    if (grad)
        for (size_t i = 0; i < np; i++)
            grad[i] = (float)g[i];
    free(buf);
    return loss;
}



/* ---- Training ------------------------------------------------------------------------- */

struct adam {
    float *m1, *m2;
    size_t n;
    int t;
};

static void adam_reset(struct adam *a, size_t n)
{
    memset(a->m1, 0, sizeof *a->m1 * n);
    memset(a->m2, 0, sizeof *a->m2 * n);
    a->n = n;
    a->t = 0;
}

static void adam_step(struct adam *a, float *theta, const float *g, double lr)
{
    a->t++;
    const struct kvcap_train_adam_step s = kvcap_train_adam_scalars(a->t, lr);
    const float b1 = s.beta1, b2 = s.beta2, eps = s.eps, c1 = s.c1, c2 = s.c2, rate = s.rate;
    for (size_t i = 0; i < a->n; i++) {
        a->m1[i] = b1 * a->m1[i] + (1.0f - b1) * g[i];
        a->m2[i] = b2 * a->m2[i] + (1.0f - b2) * g[i] * g[i];
        theta[i] -= rate * (a->m1[i] / c1) / (sqrtf(a->m2[i] / c2) + eps);
    }
}

static void shuffle(struct kvcap_train_order *o)
{
    for (size_t i = o->n; i > 1; i--) {
        size_t j = (size_t)kvcap_rng_below(&o->rng, i), t = o->perm[i - 1];
        o->perm[i - 1] = o->perm[j];
        o->perm[j] = t;
    }
    o->pos = 0;
}

static int compare_size(const void *pa, const void *pb)
{
    size_t a = *(const size_t *)pa, b = *(const size_t *)pb;
    return (a > b) - (a < b);
}

enum kvcap_status kvcap_train_order_init(struct kvcap_train_order *o, size_t n, uint64_t seed)
{
    memset(o, 0, sizeof *o);
    o->n = n;
    o->b = n < KVCAP_TRAIN_BATCH ? n : KVCAP_TRAIN_BATCH;
    kvcap_rng_seed(&o->rng, seed);
    if (n <= o->b)
        return KVCAP_OK;
    o->perm = malloc(sizeof *o->perm * n);
    o->pick = malloc(sizeof *o->pick * o->b);
    if (!o->perm || !o->pick) {
        kvcap_train_order_free(o);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY,
                          "keys train: out of memory for the order of %zu columns", n);
    }
    for (size_t i = 0; i < n; i++)
        o->perm[i] = i;
    shuffle(o);
    return KVCAP_OK;
}

void kvcap_train_order_free(struct kvcap_train_order *o)
{
    if (!o)
        return;
    free(o->perm);
    free(o->pick);
    memset(o, 0, sizeof *o);
}

const size_t *kvcap_train_order_next(struct kvcap_train_order *o)
{
    if (!o->perm)
        return NULL;
    if (o->n - o->pos < o->b)
        shuffle(o);
    memcpy(o->pick, o->perm + o->pos, sizeof *o->pick * o->b);
    o->pos += o->b;
    qsort(o->pick, o->b, sizeof *o->pick, compare_size);
    return o->pick;
}

/* The CPU's minibatches: the shared order, gathered into a buffer of b columns. */
struct batcher {
    struct kvcap_train_order order;
    const float *x;
    size_t ld;
    float *buf; /* m x b */
};

static enum kvcap_status batcher_init(struct batcher *bt, const float *x, size_t ld, size_t n,
                                      int m, uint64_t seed)
{
    bt->x = x;
    bt->ld = ld;
    KVCAP_TRY(kvcap_train_order_init(&bt->order, n, seed));
    if (!bt->order.perm)
        return KVCAP_OK;
    bt->buf = malloc(sizeof *bt->buf * bt->order.b * (size_t)m);
    KVCAP_RETURN_IF(!bt->buf, KVCAP_ERR_OUT_OF_MEMORY,
                    "keys train: out of memory for batches of %zu columns (m %d)", bt->order.b, m);
    return KVCAP_OK;
}

static const float *next_batch(struct batcher *bt, int m, size_t *ld)
{
    const size_t *pick = kvcap_train_order_next(&bt->order), b = bt->order.b;
    if (!pick) {
        *ld = bt->ld;
        return bt->x;
    }
    for (int j = 0; j < m; j++) {
        const float *row = bt->x + (size_t)j * bt->ld;
        float *dst = bt->buf + (size_t)j * b;
        for (size_t c = 0; c < b; c++)
            dst[c] = row[pick[c]];
    }
    *ld = b;
    return bt->buf;
}

/* Everything kvcap_keys_train owns, freed in one place whatever happened. On a CUDA device
 * (gpu non-NULL) the steps, the gradient, the Adam moments and every MSE live there
 * (calibrate/calib_cuda.h): the host keeps the network's shape and scalars, computes the start, the
 * hardening and the batch order, and holds θ only when it is fetched (after the relaxed phase,
 * at an improving checkpoint); work, the batch buffer, adam and grad stay unallocated. */
struct trainer {
    struct kvcap_train_net relaxed, hard;
    struct kvcap_train_work work;
    struct batcher batches;
    struct adam adam;
    float *grad;
    struct kvcap_calib_cuda_train *gpu;
    struct kvcap_key_maps best, cand;
    double best_val;
    /* where checkpoints are scored: x_val, or x_train when there is no validation set */
    const float *xt, *xv;
    size_t ldt, nt, ldv, nv;
};

static void trainer_free(struct trainer *tr)
{
    kvcap_train_net_free(&tr->relaxed);
    kvcap_train_net_free(&tr->hard);
    kvcap_train_work_free(&tr->work);
    kvcap_train_order_free(&tr->batches.order);
    free(tr->batches.buf);
    free(tr->adam.m1);
    free(tr->adam.m2);
    free(tr->grad);
    kvcap_calib_cuda_train_free(tr->gpu);
    kvcap_key_maps_free(&tr->best);
    kvcap_key_maps_free(&tr->cand);
}

/* MSE of maps on the validation (on_val) or training columns, where the run is. */
static enum kvcap_status maps_mse(struct trainer *tr, const struct kvcap_key_maps *k, int on_val,
                                  double *mse)
{
    if (tr->gpu)
        return kvcap_calib_cuda_train_maps_mse(tr->gpu, k, on_val, mse);
    double energy;
    return kvcap_key_maps_mse(k, on_val ? tr->xv : tr->xt, on_val ? tr->ldv : tr->ldt,
                              on_val ? tr->nv : tr->nt, mse, &energy);
}

/* Scores the hard network on the validation columns; keeps it if strictly better. A
 * non-finite score is never kept. */
static enum kvcap_status checkpoint(struct trainer *tr, int *kept_init)
{
    double mse;
    if (tr->gpu) {
        /* scored where θ is; fetched only when it is kept */
        KVCAP_TRY(kvcap_calib_cuda_train_score(tr->gpu, &tr->hard, &mse));
        if (!(mse < tr->best_val))
            return KVCAP_OK;
        KVCAP_TRY(kvcap_calib_cuda_train_fetch(tr->gpu, &tr->hard));
        kvcap_train_net_to_maps(&tr->hard, &tr->cand);
    } else {
        double energy;
        kvcap_train_net_to_maps(&tr->hard, &tr->cand);
        KVCAP_TRY(kvcap_key_maps_mse(&tr->cand, tr->xv, tr->ldv, tr->nv, &mse, &energy));
    }
    if (mse < tr->best_val) {
        struct kvcap_key_maps t = tr->best;
        tr->best = tr->cand;
        tr->cand = t; /* same shape: rk and h never change, only gelu may differ */
        tr->best_val = mse;
        *kept_init = 0;
    }
    return KVCAP_OK;
}

static int all_finite(const float *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(v[i]))
            return 0;
    return 1;
}

/* One Adam step of `net` on the next batch. *finite = 0 when the loss is not finite (no
 * update) or the updated parameters are not (the update was applied). */
static enum kvcap_status step(struct trainer *tr, struct kvcap_train_net *net,
                              const struct kvcap_train_config *cfg, int *finite)
{
    double loss;
    if (tr->gpu) {
        const size_t *pick = kvcap_train_order_next(&tr->batches.order);
        return kvcap_calib_cuda_train_step(tr->gpu, net, pick, cfg->lr, &loss, finite);
    }
    size_t ld;
    const float *xb = next_batch(&tr->batches, net->m, &ld);
    loss = kvcap_train_loss_grad(net, xb, ld, tr->batches.order.b, &tr->work, tr->grad);
    *finite = 0;
    if (!isfinite(loss))
        return KVCAP_OK;
    adam_step(&tr->adam, net->theta, tr->grad, cfg->lr);
    *finite = all_finite(net->theta, net->n_params);
    return KVCAP_OK;
}

/* Runs one phase: `steps` Adam steps of `net`, fresh Adam moments. *taken is the number of
 * steps done: fewer than asked when the loss or the parameters stop being finite (the caller
 * then stops training; the last finite-loss update may have been applied). If
 * `checkpoints`, scores the network at the start, every KVCAP_TRAIN_CHECK_EVERY steps and
 * after the last. */
static enum kvcap_status run_phase(struct trainer *tr, struct kvcap_train_net *net,
                                   const struct kvcap_train_config *cfg, int steps,
                                   int checkpoints, int *kept_init, int *taken)
{
    *taken = 0;
    if (tr->gpu)
        KVCAP_TRY(kvcap_calib_cuda_train_load(tr->gpu, net));
    else
        adam_reset(&tr->adam, net->n_params);
    if (checkpoints)
        KVCAP_TRY(checkpoint(tr, kept_init));
    for (int t = 0; t < steps; t++) {
        if (!net->rows && steps > 1) /* geometric annealing, tau_end at the last step */
            net->tau = cfg->tau_start * pow(cfg->tau_end / cfg->tau_start, (double)t / (steps - 1));
        /* the fine-tune's rate decays to zero (cosine): at a constant rate minibatch Adam
         * ends a noise floor above the minimum it circles (+0.05–0.3 % MSE on the recorded
         * keys, where the start is already that minimum) */
        struct kvcap_train_config at = *cfg;
        if (net->rows)
            at.lr = cfg->lr * 0.5 * (1.0 + cos(M_PI * t / steps));
        int finite;
        KVCAP_TRY(step(tr, net, &at, &finite));
        if (!finite)
            return KVCAP_OK;
        *taken = t + 1;
        if (checkpoints && ((t + 1) % KVCAP_TRAIN_CHECK_EVERY == 0 || t + 1 == steps))
            KVCAP_TRY(checkpoint(tr, kept_init));
    }
    /* the relaxed θ is hardened on the host */
    if (tr->gpu && !net->rows && steps > 0)
        KVCAP_TRY(kvcap_calib_cuda_train_fetch(tr->gpu, net));
    return KVCAP_OK;
}

/* Moves the run to a CUDA device: the columns are uploaded, θ and Adam follow per phase. With
 * `fallback`, a device that cannot be used (none, or not enough memory for this problem) is a
 * warning and the run stays on the CPU. */
static enum kvcap_status gpu_setup(struct trainer *tr, int m, int h, size_t batch, int fallback)
{
    const char *why = kvcap_calib_cuda_unavailable();
    enum kvcap_status st = KVCAP_OK;
    if (fallback)
        kvcap_quiet_push();
    if (why) {
        st = kvcap_fail(KVCAP_ERR_UNSUPPORTED, "keys train: device cuda: %s", why);
    } else {
        /* no validation set: the training columns are scored, uploaded once */
        const int val_is_train = tr->xv == tr->xt && tr->ldv == tr->ldt && tr->nv == tr->nt;
        struct kvcap_calib_cuda_train_params p = {m,       h,
                                                  tr->xt,  tr->ldt,
                                                  tr->nt,  val_is_train ? NULL : tr->xv,
                                                  tr->ldv, val_is_train ? 0 : tr->nv,
                                                  batch};
        st = kvcap_calib_cuda_train_create(&p, &tr->gpu);
    }
    if (fallback)
        kvcap_quiet_pop();
    if (st != KVCAP_OK && fallback) {
        kvcap_log(KVCAP_LOG_WARN, "%s; training the keys on the CPU", kvcap_last_error());
        kvcap_clear_error();
        tr->gpu = NULL;
        st = KVCAP_OK;
    }
    return st;
}

static enum kvcap_status train_run(struct trainer *tr, const struct kvcap_train_config *cfg,
                                   int gelu, const struct kvcap_key_maps *init, int device,
                                   int fallback, struct kvcap_train_report *rep)
{
    const int m = init->m, rk = init->rk, h = init->h;

    if (device) {
        size_t batch = tr->nt < KVCAP_TRAIN_BATCH ? tr->nt : KVCAP_TRAIN_BATCH;
        KVCAP_TRY(gpu_setup(tr, m, h, batch, fallback));
        rep->on_device = tr->gpu != NULL;
    }
    if (tr->gpu)
        KVCAP_TRY(kvcap_train_order_init(&tr->batches.order, tr->nt, cfg->seed));
    else
        KVCAP_TRY(batcher_init(&tr->batches, tr->xt, tr->ldt, tr->nt, m, cfg->seed));

    /* The initialisation is the first checkpoint. */
    KVCAP_TRY(kvcap_key_maps_copy(&tr->best, init));
    KVCAP_TRY(maps_mse(tr, init, 0, &rep->init_train_mse));
    KVCAP_TRY(maps_mse(tr, init, 1, &rep->init_val_mse));
    tr->best_val = rep->init_val_mse;
    rep->kept_init = 1;

    KVCAP_TRY(kvcap_train_net_init_relaxed(&tr->relaxed, init, gelu, cfg, tr->xt, tr->ldt,
                                           tr->nt));
    if (!tr->gpu) {
        KVCAP_TRY(kvcap_train_work_alloc(&tr->work, m, h, tr->batches.order.b));
        size_t np = tr->relaxed.n_params; /* the relaxed network is the larger one */
        tr->grad = malloc(sizeof *tr->grad * np);
        tr->adam.m1 = malloc(sizeof *tr->adam.m1 * np);
        tr->adam.m2 = malloc(sizeof *tr->adam.m2 * np);
        KVCAP_RETURN_IF(!tr->grad || !tr->adam.m1 || !tr->adam.m2, KVCAP_ERR_OUT_OF_MEMORY,
                        "keys train: out of memory for %zu parameters", np);
    }

    int taken;
    KVCAP_TRY(run_phase(tr, &tr->relaxed, cfg, cfg->steps, 0, &rep->kept_init, &taken));
    rep->steps_run = taken;
    if (taken < cfg->steps) {
        kvcap_log(KVCAP_LOG_WARN,
                  "keys train: relaxed phase diverged at step %d of %d (lr %g too large?); "
                  "keeping the initialisation",
                  taken + 1, cfg->steps, cfg->lr);
        return KVCAP_OK;
    }
    KVCAP_TRY(kvcap_train_net_harden(&tr->relaxed, rk, &tr->hard));
    /* The readout the hardened first layer deserves: the dropped points' leak and the relaxed
     * phase's drift are in W2, b2, whose optimum for a fixed W1, b1 is a least-squares solve.
     * Part of the fine-tune: without fine-tune steps the hardened network is scored as is. */
    int solved = 0;
    if (cfg->finetune_steps > 0)
        KVCAP_TRY(kvcap_train_net_fit_readout(&tr->hard, tr->xt, tr->ldt, tr->nt, READOUT_RIDGE,
                                              &solved));
    KVCAP_TRY(kvcap_key_maps_alloc(&tr->cand, m, rk, h, tr->hard.gelu));
    KVCAP_TRY(run_phase(tr, &tr->hard, cfg, cfg->finetune_steps, 1, &rep->kept_init, &taken));
    rep->steps_run += taken;
    if (taken == cfg->finetune_steps && cfg->finetune_steps > 0) {
        /* and once more for the fine-tuned first layer: the last checkpoint */
        if (tr->gpu)
            KVCAP_TRY(kvcap_calib_cuda_train_fetch(tr->gpu, &tr->hard));
        KVCAP_TRY(kvcap_train_net_fit_readout(&tr->hard, tr->xt, tr->ldt, tr->nt, READOUT_RIDGE,
                                              &solved));
        if (solved && tr->gpu)
            KVCAP_TRY(kvcap_calib_cuda_train_load(tr->gpu, &tr->hard));
        if (solved)
            KVCAP_TRY(checkpoint(tr, &rep->kept_init));
    }
    if (taken < cfg->finetune_steps)
        kvcap_log(KVCAP_LOG_WARN,
                  "keys train: fine-tune diverged at step %d of %d (lr %g too large?); keeping "
                  "the best checkpoint before it",
                  taken + 1, cfg->finetune_steps, cfg->lr);
    return KVCAP_OK;
}

static enum kvcap_status check_finite(const float *x, size_t ld, int m, size_t n,
                                      const char *name)
{
    for (int j = 0; j < m; j++)
        for (size_t c = 0; c < n; c++)
            KVCAP_RETURN_IF(!isfinite(x[(size_t)j * ld + c]), KVCAP_ERR_NUMERIC,
                            "keys train: %s[%d][%zu] is not finite", name, j, c);
    return KVCAP_OK;
}

static enum kvcap_status check_args(const float *x_train, size_t ld_train, size_t n_train,
                                    const float *x_val, size_t ld_val, size_t n_val,
                                    const struct kvcap_train_config *cfg, int gelu,
                                    const struct kvcap_key_maps *init)
{
    const enum kvcap_status bad = KVCAP_ERR_INVALID_ARGUMENT;
    KVCAP_RETURN_IF(!x_train, bad, "keys train: x_train is NULL");
    KVCAP_RETURN_IF(n_train == 0, bad, "keys train: n_train is 0 (no training columns)");
    KVCAP_RETURN_IF(ld_train < n_train, bad, "keys train: ld_train %zu < n_train %zu", ld_train,
                    n_train);
    KVCAP_RETURN_IF(n_val > 0 && !x_val, bad, "keys train: x_val is NULL with n_val %zu", n_val);
    KVCAP_RETURN_IF(n_val > 0 && ld_val < n_val, bad, "keys train: ld_val %zu < n_val %zu",
                    ld_val, n_val);
    KVCAP_RETURN_IF(!cfg, bad, "keys train: cfg is NULL");
    KVCAP_RETURN_IF(cfg->steps < 0, bad, "keys train: cfg->steps %d < 0", cfg->steps);
    KVCAP_RETURN_IF(cfg->finetune_steps < 0, bad, "keys train: cfg->finetune_steps %d < 0",
                    cfg->finetune_steps);
    KVCAP_RETURN_IF(!(cfg->lr > 0 && isfinite(cfg->lr)), bad,
                    "keys train: cfg->lr %g is not a positive finite number", cfg->lr);
    KVCAP_RETURN_IF(!(cfg->tau_start > 0 && isfinite(cfg->tau_start)), bad,
                    "keys train: cfg->tau_start %g is not a positive finite number",
                    cfg->tau_start);
    KVCAP_RETURN_IF(!(cfg->tau_end > 0 && cfg->tau_end <= cfg->tau_start), bad,
                    "keys train: cfg->tau_end %g is not in (0, tau_start %g]", cfg->tau_end,
                    cfg->tau_start);
    KVCAP_RETURN_IF(!(cfg->lambda_bce >= 0 && isfinite(cfg->lambda_bce)), bad,
                    "keys train: cfg->lambda_bce %g is not a finite number >= 0", cfg->lambda_bce);
    KVCAP_RETURN_IF(!(cfg->lambda_r >= 0 && isfinite(cfg->lambda_r)), bad,
                    "keys train: cfg->lambda_r %g is not a finite number >= 0", cfg->lambda_r);
    KVCAP_RETURN_IF(!init, bad, "keys train: init is NULL");
    KVCAP_RETURN_IF(init->m < 1 || init->rk < 1 || init->rk > init->m || init->h < 1, bad,
                    "keys train: init sizes m %d, rk %d, h %d (need 1 <= rk <= m, h >= 1)",
                    init->m, init->rk, init->h);
    KVCAP_RETURN_IF(!init->mask || !init->w1 || !init->b1 || !init->w2 || !init->b2, bad,
                    "keys train: init has a NULL array (mask, w1, b1, w2 or b2)");
    for (int r = 0; r < init->rk; r++)
        KVCAP_RETURN_IF(init->mask[r] < 0 || init->mask[r] >= init->m ||
                            (r > 0 && init->mask[r] <= init->mask[r - 1]),
                        bad, "keys train: init->mask[%d] = %d is not strictly increasing in "
                        "[0, m %d)", r, (int)init->mask[r], init->m);
    KVCAP_RETURN_IF(init->gelu && !gelu, bad,
                    "keys train: init is a GELU network but gelu is 0 (a linear fit was asked)");
    return KVCAP_OK;
}

/* kvcap_keys_train where `device` says: on the CPU (0) or a CUDA device (1, with `fallback`:
 * to the CPU with a warning if the device cannot be set up). */
static enum kvcap_status keys_train(const float *x_train, size_t ld_train, size_t n_train,
                                    const float *x_val, size_t ld_val, size_t n_val,
                                    const struct kvcap_train_config *cfg, int gelu,
                                    const struct kvcap_key_maps *init, struct kvcap_key_maps *out,
                                    struct kvcap_train_report *report, int device, int fallback)
{
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "keys train: out is NULL");
    KVCAP_RETURN_IF(out == init, KVCAP_ERR_INVALID_ARGUMENT, "keys train: out is init");
    memset(out, 0, sizeof *out);
    KVCAP_RETURN_IF(!report, KVCAP_ERR_INVALID_ARGUMENT, "keys train: report is NULL");
    memset(report, 0, sizeof *report);
    KVCAP_TRY(check_args(x_train, ld_train, n_train, x_val, ld_val, n_val, cfg, gelu, init));
    KVCAP_TRY(check_finite(x_train, ld_train, init->m, n_train, "x_train"));
    KVCAP_TRY(check_finite(x_val, ld_val, init->m, n_val, "x_val"));

    struct trainer tr;
    memset(&tr, 0, sizeof tr);
    tr.xt = x_train;
    tr.ldt = ld_train;
    tr.nt = n_train;
    tr.xv = n_val > 0 ? x_val : x_train;
    tr.ldv = n_val > 0 ? ld_val : ld_train;
    tr.nv = n_val > 0 ? n_val : n_train;
    struct kvcap_train_report rep;
    memset(&rep, 0, sizeof rep);
    enum kvcap_status st = train_run(&tr, cfg, gelu != 0, init, device, fallback, &rep);
    if (st == KVCAP_OK && !rep.kept_init)
        st = maps_mse(&tr, &tr.best, 0, &rep.final_train_mse);
    else if (st == KVCAP_OK)
        rep.final_train_mse = rep.init_train_mse;
    if (st == KVCAP_OK) {
        rep.final_val_mse = tr.best_val;
        *out = tr.best;
        memset(&tr.best, 0, sizeof tr.best);
        *report = rep;
    }
    trainer_free(&tr);
    return st;
}

enum kvcap_status kvcap_keys_train(const float *x_train, size_t ld_train, size_t n_train,
                                   const float *x_val, size_t ld_val, size_t n_val,
                                   const struct kvcap_train_config *cfg, int gelu,
                                   const struct kvcap_key_maps *init, struct kvcap_key_maps *out,
                                   struct kvcap_train_report *report)
{
    return keys_train(x_train, ld_train, n_train, x_val, ld_val, n_val, cfg, gelu, init, out,
                      report, 0, 0);
}

enum kvcap_status kvcap_calib_cuda_keys_train(const float *x_train, size_t ld_train, size_t n_train,
                                              const float *x_val, size_t ld_val, size_t n_val,
                                              const struct kvcap_train_config *cfg, int gelu,
                                              const struct kvcap_key_maps *init,
                                              struct kvcap_key_maps *out,
                                              struct kvcap_train_report *report, int fallback)
{
    return keys_train(x_train, ld_train, n_train, x_val, ld_val, n_val, cfg, gelu, init, out,
                      report, 1, fallback != 0);
}
