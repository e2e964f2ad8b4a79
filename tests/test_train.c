/* test_train.c — the trained key maps (calibrate/train.c): the sgemm gradient against the
 * double reference and the reference against finite differences, the start reproducing the
 * closed form (linear, and embedded in GELU by the bias shift), training recovering from a bad
 * mask without ever returning worse than the init, determinism, the shared minibatch order,
 * and named argument errors. */
#include <lapacke.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "configs/config.h"
#include "common/internal.h"
#include "calibrate/keys.h"
#include "common/rng.h"
#include "tests/test_train_util.h"
#include "calibrate/train_internal.h"

/* Finite differences of the double reference: central differences with step FD_STEP have a
 * truncation error ~ FD_STEP²·|f'''| ≈ 1e-7 of the gradient on these O(1) problems, and the
 * loss is summed in double, so 1e-4 of the largest entry of each block is a wide margin that
 * still catches any wrong term (those are O(1) relative). */
#define FD_STEP 1e-3
#define FD_TOL 1e-4
/* The sgemm gradient in float against the double reference: float products summed over at
 * most m·n = 63 terms differ by ~1e-6 relative; 1e-4 of the block's largest entry. */
#define FAST_TOL 1e-4
/* The GELU network shifted into GELU's identity range against the linear init it embeds:
 * exact up to rounding the shift in and out (~1e-6), required to 1e-3 relative. */
#define GELU_EMBED_TOL 1e-3

/* ---- helpers -------------------------------------------------------------------------- */

static double *random_mixing(int m, int k, struct kvcap_rng *rng)
{
    double *a = calloc((size_t)m * k, sizeof *a);
    assert_non_null(a);
    for (size_t i = 0; i < (size_t)m * k; i++)
        a[i] = kvcap_rng_normal(rng);
    return a;
}

static double *gram_of(const float *x, int m, size_t n)
{
    double *g = calloc((size_t)m * m, sizeof *g);
    assert_non_null(g);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < m; j++) {
            double s = 0;
            for (size_t c = 0; c < n; c++)
                s += (double)x[(size_t)i * n + c] * x[(size_t)j * n + c];
            g[(size_t)i * m + j] = s;
        }
    return g;
}

/* Reconstruction of all n columns of x by maps k (m x n). */
static float *reconstruct(const struct kvcap_key_maps *k, const float *x, size_t n)
{
    float *xk = alloc_f((size_t)k->rk * n), *hid = alloc_f((size_t)k->h * n);
    float *out = alloc_f((size_t)k->m * n);
    for (int r = 0; r < k->rk; r++)
        memcpy(xk + (size_t)r * n, x + (size_t)k->mask[r] * n, sizeof *xk * n);
    kvcap_key_maps_apply_ref(k, xk, n, n, hid, out, n);
    free(xk);
    free(hid);
    return out;
}

static struct kvcap_train_config default_cfg(void)
{
    struct kvcap_train_config c = {.steps = 300, .lr = 1e-3, .tau_start = 1.0, .tau_end = 0.05,
                                   .lambda_bce = 0.01, .lambda_r = 1.0, .finetune_steps = 100,
                                   .seed = 0};
    return c;
}

/* ---- (a) gradients -------------------------------------------------------------------- */

/* Largest |v| over each parameter block, so tolerances scale with the block they test. */
static void block_of(const struct kvcap_train_net *net, size_t i, size_t *lo, size_t *hi)
{
    size_t m = (size_t)net->m, p = (size_t)net->p, h = (size_t)net->h;
    size_t ends[5], nb = 0, start = 0;
    if (!net->rows)
        ends[nb++] = m;
    ends[nb] = (nb ? ends[nb - 1] : 0) + p * h, nb++;
    ends[nb] = ends[nb - 1] + h, nb++;
    ends[nb] = ends[nb - 1] + h * m, nb++;
    ends[nb] = ends[nb - 1] + m, nb++;
    for (size_t b = 0; b < nb; b++) {
        if (i < ends[b]) {
            *lo = start;
            *hi = ends[b];
            return;
        }
        start = ends[b];
    }
    fail();
}

static double block_max(const struct kvcap_train_net *net, const float *g, size_t i)
{
    size_t lo = 0, hi = 0;
    block_of(net, i, &lo, &hi);
    double mx = 0;
    for (size_t t = lo; t < hi; t++)
        mx = fmax(mx, fabs(g[t]));
    return mx;
}

static void check_gradient(int gelu, int hard)
{
    enum { M = 7, P = 3, H = 5, N = 9, LD = N + 3 };
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 1234 + 2 * gelu + hard);
    float x[M * LD];
    for (int i = 0; i < M * LD; i++)
        x[i] = (float)kvcap_rng_normal(&rng);
    static const int32_t rows[P] = {1, 3, 4};
    struct kvcap_train_net net;
    assert_int_equal(kvcap_train_net_alloc(&net, M, hard ? P : M, H, gelu, hard ? rows : NULL),
                     KVCAP_OK);
    net.tau = 0.7;
    net.lambda_bce = 0.3; /* large enough that the mask terms weigh in the check */
    net.lambda_r = 0.8;
    net.ratio = (double)P / M;
    for (size_t i = 0; i < net.n_params; i++)
        net.theta[i] = (float)(0.5 * kvcap_rng_normal(&rng));
    struct kvcap_train_view v = kvcap_train_split(&net, net.theta);
    if (v.alpha)
        for (int j = 0; j < M; j++)
            v.alpha[j] = (float)(net.tau * 1.5 * kvcap_rng_normal(&rng));

    float *g_ref = alloc_f(net.n_params), *g_fast = alloc_f(net.n_params);
    double l_ref = kvcap_train_loss_grad_ref(&net, x, LD, N, g_ref);
    struct kvcap_train_work w;
    assert_int_equal(kvcap_train_work_alloc(&w, M, H, N), KVCAP_OK);
    double l_fast = kvcap_train_loss_grad(&net, x, LD, N, &w, g_fast);
    assert_true(fabs(l_fast - l_ref) <= 1e-5 * l_ref);
    assert_true(fabs(kvcap_train_loss_grad(&net, x, LD, N, &w, NULL) - l_fast) <= 1e-12 * l_ref);

    for (size_t i = 0; i < net.n_params; i++) {
        double scale = block_max(&net, g_ref, i);
        assert_true(scale > 0);
        if (fabs(g_fast[i] - g_ref[i]) > FAST_TOL * scale)
            fail_msg("gelu %d hard %d param %zu: fast %g, ref %g", gelu, hard, i, g_fast[i],
                     g_ref[i]);
        float keep = net.theta[i];
        float up = (float)(keep + FD_STEP), down = (float)(keep - FD_STEP);
        net.theta[i] = up;
        double lu = kvcap_train_loss_grad_ref(&net, x, LD, N, NULL);
        net.theta[i] = down;
        double ld = kvcap_train_loss_grad_ref(&net, x, LD, N, NULL);
        net.theta[i] = keep;
        double fd = (lu - ld) / ((double)up - (double)down);
        if (fabs(fd - g_ref[i]) > FD_TOL * scale)
            fail_msg("gelu %d hard %d param %zu: finite difference %g, ref %g", gelu, hard, i, fd,
                     g_ref[i]);
    }
    kvcap_train_work_free(&w);
    kvcap_train_net_free(&net);
    free(g_ref);
    free(g_fast);
}

static void test_gradient_linear_relaxed(void **state)
{
    (void)state;
    check_gradient(0, 0);
}

static void test_gradient_linear_hard(void **state)
{
    (void)state;
    check_gradient(0, 1);
}

static void test_gradient_gelu_relaxed(void **state)
{
    (void)state;
    check_gradient(1, 0);
}

static void test_gradient_gelu_hard(void **state)
{
    (void)state;
    check_gradient(1, 1);
}

/* ---- (b) the start is the init -------------------------------------------------------- */

struct problem {
    int m, rk, h;
    size_t n_train, n_val;
    float *train, *val;
    struct kvcap_key_maps init; /* closed form on train */
};

static void problem_make(struct problem *p, int m, int k, int rk, int h, size_t n_train,
                         size_t n_val, double scale, uint64_t seed)
{
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, seed);
    double *a = random_mixing(m, k, &rng);
    for (size_t i = 0; i < (size_t)m * k; i++)
        a[i] *= scale;
    p->m = m;
    p->rk = rk;
    p->h = h;
    p->n_train = n_train;
    p->n_val = n_val;
    p->train = low_rank_data(a, m, k, n_train, n_train, 0.05 * scale, &rng);
    p->val = low_rank_data(a, m, k, n_val, n_val, 0.05 * scale, &rng);
    double *g = gram_of(p->train, m, n_train);
    assert_int_equal(kvcap_keys_closed_form(g, m, rk, h, 1e-3, &p->init), KVCAP_OK);
    free(g);
    free(a);
}

static void problem_free(struct problem *p)
{
    free(p->train);
    free(p->val);
    kvcap_key_maps_free(&p->init);
}

static void test_start_reproduces_linear_init(void **state)
{
    (void)state;
    struct problem p;
    problem_make(&p, 16, 5, 6, 4, 400, 200, 1.0, 11);
    struct kvcap_train_config cfg = default_cfg();
    cfg.steps = 0;
    cfg.finetune_steps = 0;
    struct kvcap_key_maps out;
    struct kvcap_train_report rep;
    assert_int_equal(kvcap_keys_train(p.train, p.n_train, p.n_train, p.val, p.n_val, p.n_val,
                                      &cfg, 0, &p.init, &out, &rep),
                     KVCAP_OK);
    assert_int_equal(rep.steps_run, 0);
    assert_int_equal(out.rk, p.rk);
    assert_int_equal(out.h, p.h);
    assert_int_equal(out.gelu, 0);
    assert_memory_equal(out.mask, p.init.mask, sizeof *out.mask * (size_t)p.rk);
    /* the hardened start differs from the init by one rounding of W1 (÷ then × the mask) */
    assert_true(rep.kept_init || fabs(rep.final_val_mse - rep.init_val_mse) <=
                                     1e-5 * rep.init_val_mse);
    assert_true(rep.final_val_mse <= rep.init_val_mse);
    float *y0 = reconstruct(&p.init, p.val, p.n_val), *y1 = reconstruct(&out, p.val, p.n_val);
    assert_true(rel_diff(y1, y0, (size_t)p.m * p.n_val) <= 1e-5);
    free(y0);
    free(y1);
    kvcap_key_maps_free(&out);
    problem_free(&p);
}

/* At every data scale (the shift is in absolute units; GELU's curve is not scale-free). */
static void test_start_reproduces_init_in_gelu(void **state)
{
    (void)state;
    static const double scales[] = {0.01, 1.0, 100.0};
    for (size_t s = 0; s < sizeof scales / sizeof *scales; s++) {
        struct problem p;
        problem_make(&p, 16, 5, 6, 6, 400, 200, scales[s], 12 + s);
        struct kvcap_train_config cfg = default_cfg();
        struct kvcap_train_net relaxed, hard;
        assert_int_equal(kvcap_train_net_init_relaxed(&relaxed, &p.init, 1, &cfg, p.train,
                                                      p.n_train, p.n_train),
                         KVCAP_OK);
        assert_int_equal(relaxed.gelu, 1);
        assert_int_equal(kvcap_train_net_harden(&relaxed, p.rk, &hard), KVCAP_OK);
        struct kvcap_key_maps g;
        assert_int_equal(kvcap_key_maps_alloc(&g, p.m, p.rk, p.h, 1), KVCAP_OK);
        kvcap_train_net_to_maps(&hard, &g);
        assert_int_equal(g.gelu, 1);
        assert_memory_equal(g.mask, p.init.mask, sizeof *g.mask * (size_t)p.rk);
        /* the shift is what makes it work: some bias moved */
        double shift = 0;
        for (int i = 0; i < p.h; i++)
            shift = fmax(shift, fabs(g.b1[i] - p.init.b1[i]));
        assert_true(shift >= KVCAP_TRAIN_GELU_MARGIN);
        float *y0 = reconstruct(&p.init, p.val, p.n_val), *y1 = reconstruct(&g, p.val, p.n_val);
        double rd = rel_diff(y1, y0, (size_t)p.m * p.n_val);
        if (rd > GELU_EMBED_TOL)
            fail_msg("scale %g: GELU start differs from the linear init by %g", scales[s], rd);
        /* the relaxed network itself (with the 5 % leak of dropped points, whose W1 rows are
         * zero) has the init's training MSE */
        relaxed.lambda_bce = relaxed.lambda_r = 0;
        double mse0, energy;
        assert_int_equal(kvcap_key_maps_mse(&p.init, p.train, p.n_train, p.n_train, &mse0, &energy),
                         KVCAP_OK);
        double l = kvcap_train_loss_grad_ref(&relaxed, p.train, p.n_train, p.n_train, NULL);
        assert_true(fabs(l - mse0) <= 2 * GELU_EMBED_TOL * mse0);

        /* through the API: nothing trained, nothing worse */
        cfg.steps = cfg.finetune_steps = 0;
        struct kvcap_key_maps out;
        struct kvcap_train_report rep;
        assert_int_equal(kvcap_keys_train(p.train, p.n_train, p.n_train, p.val, p.n_val, p.n_val,
                                          &cfg, 1, &p.init, &out, &rep),
                         KVCAP_OK);
        assert_true(rep.final_val_mse <= rep.init_val_mse);
        assert_true(rep.final_val_mse >= (1 - GELU_EMBED_TOL) * rep.init_val_mse);
        assert_int_equal(out.gelu, rep.kept_init ? 0 : 1);
        kvcap_key_maps_free(&out);
        kvcap_key_maps_free(&g);
        kvcap_train_net_free(&hard);
        kvcap_train_net_free(&relaxed);
        free(y0);
        free(y1);
        problem_free(&p);
    }
}

/* ---- (c) training fixes a bad init ---------------------------------------------------- */

/* The ridge least-squares linear map for a given mask (h = rk, W1 = I, W2 = A_Mᵀ), as the
 * closed form computes it for its own mask. */
static void fixed_mask_init(const float *x, int m, size_t n, const int32_t *mask, int rk,
                            struct kvcap_key_maps *out)
{
    double *g = gram_of(x, m, n);
    double *cmm = calloc((size_t)rk * rk, sizeof *cmm), *cmx = calloc((size_t)rk * m, sizeof *cmx);
    assert_non_null(cmm);
    assert_non_null(cmx);
    double mean = 0;
    for (int r = 0; r < rk; r++)
        mean += g[(size_t)mask[r] * m + mask[r]] / rk;
    for (int r = 0; r < rk; r++) {
        for (int s = 0; s < rk; s++)
            cmm[(size_t)r * rk + s] = g[(size_t)mask[r] * m + mask[s]];
        cmm[(size_t)r * rk + r] += 1e-3 * mean;
        for (int j = 0; j < m; j++)
            cmx[(size_t)r * m + j] = g[(size_t)mask[r] * m + j];
    }
    /* (C[M,M] + λ I) W2 = C[M,:] */
    assert_int_equal(LAPACKE_dposv(LAPACK_ROW_MAJOR, 'U', rk, m, cmm, rk, cmx, m), 0);
    assert_int_equal(kvcap_key_maps_alloc(out, m, rk, rk, 0), KVCAP_OK);
    for (int r = 0; r < rk; r++) {
        out->mask[r] = mask[r];
        out->w1[(size_t)r * rk + r] = 1.0f;
        for (int j = 0; j < m; j++)
            out->w2[(size_t)r * m + j] = (float)cmx[(size_t)r * m + j];
    }
    free(g);
    free(cmm);
    free(cmx);
}

/* A closed form with a ridge far too large (λ = 10 × the mean retained diagonal) shrinks every
 * prediction towards zero; training must get close to the properly regularised fit. */
static void test_training_improves_a_shrunk_init(void **state)
{
    (void)state;
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 5);
    enum { M = 16, K = 4, RK = 6 };
    const size_t n_train = 600, n_val = 300;
    double *a = random_mixing(M, K, &rng);
    float *train = low_rank_data(a, M, K, n_train, n_train, 0.02, &rng);
    float *val = low_rank_data(a, M, K, n_val, n_val, 0.02, &rng);
    double *g = gram_of(train, M, n_train);
    struct kvcap_key_maps shrunk, good, out;
    assert_int_equal(kvcap_keys_closed_form(g, M, RK, RK, 10.0, &shrunk), KVCAP_OK);
    assert_int_equal(kvcap_keys_closed_form(g, M, RK, RK, 1e-3, &good), KVCAP_OK);
    double good_val, energy;
    assert_int_equal(kvcap_key_maps_mse(&good, val, n_val, n_val, &good_val, &energy), KVCAP_OK);

    for (int gelu = 0; gelu <= 1; gelu++) {
        struct kvcap_train_config cfg = default_cfg();
        cfg.lr = 1e-2;
        cfg.steps = 100;
        cfg.finetune_steps = 100;
        struct kvcap_train_report rep;
        assert_int_equal(kvcap_keys_train(train, n_train, n_train, val, n_val, n_val, &cfg, gelu,
                                          &shrunk, &out, &rep),
                         KVCAP_OK);
        print_message("shrunk init, gelu %d: val mse %.4g -> %.4g (closed form %.4g)\n", gelu,
                      rep.init_val_mse, rep.final_val_mse, good_val);
        assert_int_equal(rep.steps_run, cfg.steps + cfg.finetune_steps);
        assert_int_equal(rep.kept_init, 0);
        assert_int_equal(out.gelu, gelu);
        assert_true(rep.final_val_mse < 0.01 * rep.init_val_mse);
        assert_true(rep.final_val_mse < 2.0 * good_val);
        assert_true(rep.final_train_mse < 0.01 * rep.init_train_mse);
        double mse;
        assert_int_equal(kvcap_key_maps_mse(&out, val, n_val, n_val, &mse, &energy), KVCAP_OK);
        assert_true(mse == rep.final_val_mse);
        kvcap_key_maps_free(&out);
    }
    kvcap_key_maps_free(&shrunk);
    kvcap_key_maps_free(&good);
    free(g);
    free(a);
    free(train);
    free(val);
}

/* The readout solve alone: a hard linear network with the closed form's first layer and a
 * scrambled W2, b2 gets back the least-squares readout: the closed form's MSE (ridge 1e-9)
 * or a little less, as the readout also fits b2 (the closed form has no biases); 1e-5 covers
 * the float rounding of the weights. */
static void test_readout_is_least_squares(void **state)
{
    (void)state;
    struct problem p;
    problem_make(&p, 16, 5, 6, 6, 3000, 10, 1.0, 21);
    double *g = gram_of(p.train, p.m, p.n_train);
    struct kvcap_key_maps lsq;
    assert_int_equal(kvcap_keys_closed_form(g, p.m, p.rk, p.h, 1e-9, &lsq), KVCAP_OK);
    struct kvcap_train_net net;
    assert_int_equal(kvcap_train_net_alloc(&net, p.m, p.rk, p.h, 0, lsq.mask), KVCAP_OK);
    struct kvcap_train_view v = kvcap_train_split(&net, net.theta);
    memcpy(v.w1, lsq.w1, sizeof *v.w1 * (size_t)p.rk * p.h);
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 3);
    for (size_t i = 0; i < (size_t)p.h * p.m; i++)
        v.w2[i] = (float)kvcap_rng_normal(&rng);
    for (int j = 0; j < p.m; j++)
        v.b2[j] = (float)kvcap_rng_normal(&rng);
    int solved = 0;
    assert_int_equal(kvcap_train_net_fit_readout(&net, p.train, p.n_train, p.n_train, 1e-9,
                                                 &solved),
                     KVCAP_OK);
    assert_int_equal(solved, 1);
    struct kvcap_key_maps out;
    assert_int_equal(kvcap_key_maps_alloc(&out, p.m, p.rk, p.h, 0), KVCAP_OK);
    kvcap_train_net_to_maps(&net, &out);
    double mse, mse_lsq, energy;
    assert_int_equal(kvcap_key_maps_mse(&out, p.train, p.n_train, p.n_train, &mse, &energy),
                     KVCAP_OK);
    assert_int_equal(kvcap_key_maps_mse(&lsq, p.train, p.n_train, p.n_train, &mse_lsq, &energy),
                     KVCAP_OK);
    print_message("readout: mse %.8g, least squares %.8g\n", mse, mse_lsq);
    assert_true(mse <= (1 + 1e-5) * mse_lsq);
    assert_true(mse >= 0.99 * mse_lsq); /* the bias is worth little on centred data */
    kvcap_key_maps_free(&out);
    kvcap_key_maps_free(&lsq);
    kvcap_train_net_free(&net);
    free(g);
    problem_free(&p);
}

/* What the recorded keys showed: from a closed form a little off the least-squares optimum
 * (ridge 0.05 instead of ~0), on more columns than one minibatch, the shipped settings (lr
 * 1e-3, 100 fine-tune steps) must end at that optimum, linear or GELU. The GELU start is the
 * linear map in GELU's identity range, where the network is linear, so the optimum is the
 * linear one; minibatch Adam at a constant rate only circled it, 0.05–0.3 % above, and every
 * unit kept its closed form. Training MSE within 1e-4 of the optimum (the readout solve is
 * exact up to float weights; the shrink being undone is worth ~10x); validation within 1e-3
 * (the fitted b2, which the closed form lacks, moves it by ~2e-4 either way). */
static void test_finetune_reaches_least_squares(void **state)
{
    (void)state;
    struct problem p;
    problem_make(&p, 16, 5, 6, 6, 8 * KVCAP_TRAIN_BATCH, 2048, 1.0, 23);
    double *g = gram_of(p.train, p.m, p.n_train);
    struct kvcap_key_maps shrunk, lsq;
    assert_int_equal(kvcap_keys_closed_form(g, p.m, p.rk, p.h, 0.05, &shrunk), KVCAP_OK);
    assert_int_equal(kvcap_keys_closed_form(g, p.m, p.rk, p.h, 1e-9, &lsq), KVCAP_OK);
    double lsq_train, lsq_val, energy;
    assert_int_equal(kvcap_key_maps_mse(&lsq, p.train, p.n_train, p.n_train, &lsq_train, &energy),
                     KVCAP_OK);
    assert_int_equal(kvcap_key_maps_mse(&lsq, p.val, p.n_val, p.n_val, &lsq_val, &energy),
                     KVCAP_OK);
    for (int gelu = 0; gelu <= 1; gelu++) {
        struct kvcap_train_config cfg = default_cfg();
        struct kvcap_key_maps out;
        struct kvcap_train_report rep;
        assert_int_equal(kvcap_keys_train(p.train, p.n_train, p.n_train, p.val, p.n_val, p.n_val,
                                          &cfg, gelu, &shrunk, &out, &rep),
                         KVCAP_OK);
        print_message("gelu %d: train mse %.6g -> %.6g (least squares %.6g), val %.6g -> %.6g "
                      "(%.6g)\n",
                      gelu, rep.init_train_mse, rep.final_train_mse, lsq_train, rep.init_val_mse,
                      rep.final_val_mse, lsq_val);
        assert_true(rep.init_train_mse > (1 + 1e-3) * lsq_train); /* there is something to gain */
        assert_int_equal(rep.kept_init, 0);
        assert_true(rep.final_train_mse <= (1 + 1e-4) * lsq_train);
        assert_true(rep.final_val_mse <= (1 + 1e-3) * lsq_val);
        kvcap_key_maps_free(&out);
    }
    kvcap_key_maps_free(&shrunk);
    kvcap_key_maps_free(&lsq);
    free(g);
    problem_free(&p);
}

/* Rank-4 keys over 24 points whose first 6 are near-copies of one direction: a mask on them
 * sees one factor of four. (The relaxed mask does not escape it — see train.c — but the
 * result must still be no worse than the init.) */
static void bad_mask_problem(float **train, float **val, size_t n_train, size_t n_val,
                             struct kvcap_key_maps *init)
{
    enum { M = 24, K = 4, RK = 6 };
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 99);
    double *a = random_mixing(M, K, &rng);
    for (int j = 0; j < RK; j++)
        for (int t = 0; t < K; t++)
            a[(size_t)j * K + t] = (t == 0 ? 1.0 : 0.0) + 0.02 * kvcap_rng_normal(&rng);
    *train = low_rank_data(a, M, K, n_train, n_train, 0.02, &rng);
    *val = low_rank_data(a, M, K, n_val, n_val, 0.02, &rng);
    static const int32_t bad[RK] = {0, 1, 2, 3, 4, 5};
    fixed_mask_init(*train, M, n_train, bad, RK, init);
    free(a);
}

/* Warnings the library logged, for the divergence case. */
static int n_warnings;
static char last_warning[512];

static void capture_log(enum kvcap_log_level level, const char *message, void *user)
{
    (void)user;
    if (level != KVCAP_LOG_WARN)
        return;
    n_warnings++;
    snprintf(last_warning, sizeof last_warning, "%s", message);
}

/* Started from the closed form on ordinary data, the result is never worse on validation: with
 * a sane learning rate, with one that throws the parameters far away (1e6: finite but useless)
 * and with one that overflows them (1e30: the run stops, warns, and keeps the init); and from
 * a bad mask. */
static void test_never_worse_than_init(void **state)
{
    (void)state;
    struct problem p;
    problem_make(&p, 16, 5, 6, 6, 400, 200, 1.0, 21);
    static const double lrs[] = {1e-3, 1e6, 1e30};
    for (size_t i = 0; i < sizeof lrs / sizeof *lrs; i++) {
        struct kvcap_train_config cfg = default_cfg();
        cfg.lr = lrs[i];
        cfg.steps = 60;
        cfg.finetune_steps = 30;
        struct kvcap_key_maps out;
        struct kvcap_train_report rep;
        n_warnings = 0;
        kvcap_log_set(capture_log, NULL, KVCAP_LOG_WARN);
        assert_int_equal(kvcap_keys_train(p.train, p.n_train, p.n_train, p.val, p.n_val, p.n_val,
                                          &cfg, 1, &p.init, &out, &rep),
                         KVCAP_OK);
        kvcap_log_set(NULL, NULL, KVCAP_LOG_WARN);
        assert_true(rep.final_val_mse <= rep.init_val_mse);
        assert_true(isfinite(rep.final_train_mse));
        for (size_t t = 0; t < (size_t)out.h * out.m; t++)
            assert_true(isfinite(out.w2[t]));
        if (lrs[i] > 1e20) {
            assert_true(rep.steps_run < cfg.steps);
            assert_int_equal(rep.kept_init, 1);
            assert_int_equal(n_warnings, 1);
            assert_non_null(strstr(last_warning, "diverged"));
        } else {
            assert_int_equal(rep.steps_run, cfg.steps + cfg.finetune_steps);
            assert_int_equal(n_warnings, 0);
        }
        kvcap_key_maps_free(&out);
    }

    /* a bad mask */
    float *bt, *bv;
    struct kvcap_key_maps bad;
    bad_mask_problem(&bt, &bv, 400, 200, &bad);
    for (int gelu = 0; gelu <= 1; gelu++) {
        struct kvcap_train_config cfg = default_cfg();
        cfg.lr = 0.05;
        cfg.steps = 100;
        cfg.finetune_steps = 50;
        struct kvcap_key_maps out;
        struct kvcap_train_report rep;
        assert_int_equal(kvcap_keys_train(bt, 400, 400, bv, 200, 200, &cfg, gelu, &bad, &out, &rep),
                         KVCAP_OK);
        assert_true(rep.final_val_mse <= rep.init_val_mse);
        kvcap_key_maps_free(&out);
    }
    kvcap_key_maps_free(&bad);
    free(bt);
    free(bv);

    /* no validation set: the training set decides and is reported as validation */
    struct kvcap_train_config cfg = default_cfg();
    cfg.steps = 30;
    cfg.finetune_steps = 30;
    struct kvcap_key_maps out;
    struct kvcap_train_report rep;
    assert_int_equal(kvcap_keys_train(p.train, p.n_train, p.n_train, NULL, 0, 0, &cfg, 0, &p.init,
                                      &out, &rep),
                     KVCAP_OK);
    assert_true(rep.init_val_mse == rep.init_train_mse);
    assert_true(rep.final_val_mse == rep.final_train_mse);
    assert_true(rep.final_train_mse <= rep.init_train_mse);
    kvcap_key_maps_free(&out);
    problem_free(&p);
}

/* ---- (d) determinism ------------------------------------------------------------------ */

static void test_same_seed_same_maps(void **state)
{
    (void)state;
    struct problem p; /* 1500 training columns: minibatches through the seeded permutation */
    problem_make(&p, 16, 5, 6, 6, 1500, 200, 1.0, 31);
    struct kvcap_train_config cfg = default_cfg();
    cfg.steps = 40;
    cfg.finetune_steps = 30;
    cfg.lr = 1e-2;
    cfg.seed = 7;
    struct kvcap_key_maps a, b;
    struct kvcap_train_report ra, rb;
    assert_int_equal(kvcap_keys_train(p.train, p.n_train, p.n_train, p.val, p.n_val, p.n_val,
                                      &cfg, 1, &p.init, &a, &ra),
                     KVCAP_OK);
    assert_int_equal(kvcap_keys_train(p.train, p.n_train, p.n_train, p.val, p.n_val, p.n_val,
                                      &cfg, 1, &p.init, &b, &rb),
                     KVCAP_OK);
    assert_int_equal(ra.kept_init, rb.kept_init);
    assert_int_equal(a.gelu, b.gelu);
    assert_int_equal(a.rk, b.rk);
    assert_memory_equal(a.mask, b.mask, sizeof *a.mask * (size_t)a.rk);
    assert_memory_equal(a.w1, b.w1, sizeof *a.w1 * (size_t)a.rk * a.h);
    assert_memory_equal(a.b1, b.b1, sizeof *a.b1 * (size_t)a.h);
    assert_memory_equal(a.w2, b.w2, sizeof *a.w2 * (size_t)a.h * a.m);
    assert_memory_equal(a.b2, b.b2, sizeof *a.b2 * (size_t)a.m);
    assert_memory_equal(&ra, &rb, sizeof ra);
    kvcap_key_maps_free(&a);
    kvcap_key_maps_free(&b);
    problem_free(&p);
}

/* The minibatch order both paths share (kvcap_train_order_*): pinned to its definition — a
 * Fisher–Yates permutation drawn with kvcap_rng_below from the seed, cut into slices of b,
 * reshuffled when fewer than b columns are left, each slice sorted — so the CPU's batches (and
 * with them its results) cannot change unnoticed, and the CUDA path's are the same. */
static int compare_sz(const void *pa, const void *pb)
{
    size_t a = *(const size_t *)pa, b = *(const size_t *)pb;
    return (a > b) - (a < b);
}

static void test_batch_order(void **state)
{
    (void)state;
    struct kvcap_train_order o;
    /* a set that fits in one batch is the batch, every time */
    assert_int_equal(kvcap_train_order_init(&o, 700, 3), KVCAP_OK);
    assert_int_equal(o.b, 700);
    for (int i = 0; i < 3; i++)
        assert_null(kvcap_train_order_next(&o));
    kvcap_train_order_free(&o);
    assert_int_equal(kvcap_train_order_init(&o, KVCAP_TRAIN_BATCH, 3), KVCAP_OK);
    assert_null(kvcap_train_order_next(&o));
    kvcap_train_order_free(&o);

    /* 2500 columns: two batches of 1024 per permutation, then a reshuffle */
    enum { N = 2500, B = KVCAP_TRAIN_BATCH, BATCHES = 7 };
    static size_t perm[N], want[B];
    static unsigned char seen[N];
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 7);
    size_t pos = N; /* forces the first shuffle */
    for (size_t i = 0; i < N; i++)
        perm[i] = i;
    assert_int_equal(kvcap_train_order_init(&o, N, 7), KVCAP_OK);
    assert_int_equal(o.b, B);
    for (int k = 0; k < BATCHES; k++) {
        if (N - pos < B) {
            for (size_t i = N; i > 1; i--) {
                size_t j = (size_t)kvcap_rng_below(&rng, i), s = perm[i - 1];
                perm[i - 1] = perm[j];
                perm[j] = s;
            }
            pos = 0;
            memset(seen, 0, sizeof seen);
        }
        memcpy(want, perm + pos, sizeof want);
        pos += B;
        qsort(want, B, sizeof *want, compare_sz);
        const size_t *got = kvcap_train_order_next(&o);
        assert_non_null(got);
        assert_memory_equal(got, want, sizeof want);
        for (size_t c = 0; c < B; c++) {
            assert_true(got[c] < N);
            assert_true(c == 0 || got[c] > got[c - 1]);
            assert_int_equal(seen[got[c]], 0); /* no column twice between reshuffles */
            seen[got[c]] = 1;
        }
    }
    kvcap_train_order_free(&o);
    assert_null(o.perm);
    kvcap_train_order_free(NULL);

    /* another seed, another order */
    struct kvcap_train_order a, b;
    assert_int_equal(kvcap_train_order_init(&a, N, 1), KVCAP_OK);
    assert_int_equal(kvcap_train_order_init(&b, N, 2), KVCAP_OK);
    const size_t *pa = kvcap_train_order_next(&a), *pb = kvcap_train_order_next(&b);
    assert_true(memcmp(pa, pb, sizeof *pa * B) != 0);
    kvcap_train_order_free(&a);
    kvcap_train_order_free(&b);
}

/* ---- (e) arguments -------------------------------------------------------------------- */

static void expect_bad(enum kvcap_status want, const char *needle, const float *xt, size_t ldt,
                       size_t nt, const float *xv, size_t ldv, size_t nv,
                       const struct kvcap_train_config *cfg, int gelu,
                       const struct kvcap_key_maps *init)
{
    struct kvcap_key_maps out;
    memset(&out, 0xab, sizeof out);
    struct kvcap_train_report rep;
    enum kvcap_status st = kvcap_keys_train(xt, ldt, nt, xv, ldv, nv, cfg, gelu, init, &out, &rep);
    if (st != want)
        fail_msg("%s: status %d, want %d (%s)", needle, st, want, kvcap_last_error());
    assert_error_names(needle);
    assert_null(out.mask); /* left zeroed: freeing it is safe */
    assert_null(out.w1);
    kvcap_key_maps_free(&out);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    struct problem p;
    problem_make(&p, 8, 3, 3, 3, 50, 20, 1.0, 41);
    const float *xt = p.train, *xv = p.val;
    const size_t nt = p.n_train, nv = p.n_val;
    const struct kvcap_key_maps *in = &p.init;
    const enum kvcap_status bad = KVCAP_ERR_INVALID_ARGUMENT;
    struct kvcap_train_config ok = default_cfg(), c;

    expect_bad(bad, "x_train", NULL, nt, nt, xv, nv, nv, &ok, 0, in);
    expect_bad(bad, "n_train", xt, nt, 0, xv, nv, nv, &ok, 0, in);
    expect_bad(bad, "ld_train", xt, nt - 1, nt, xv, nv, nv, &ok, 0, in);
    expect_bad(bad, "x_val", xt, nt, nt, NULL, nv, nv, &ok, 0, in);
    expect_bad(bad, "ld_val", xt, nt, nt, xv, nv - 1, nv, &ok, 0, in);
    expect_bad(bad, "cfg is NULL", xt, nt, nt, xv, nv, nv, NULL, 0, in);
    c = ok, c.steps = -1;
    expect_bad(bad, "cfg->steps", xt, nt, nt, xv, nv, nv, &c, 0, in);
    c = ok, c.finetune_steps = -1;
    expect_bad(bad, "cfg->finetune_steps", xt, nt, nt, xv, nv, nv, &c, 0, in);
    c = ok, c.lr = 0;
    expect_bad(bad, "cfg->lr", xt, nt, nt, xv, nv, nv, &c, 0, in);
    c = ok, c.lr = NAN;
    expect_bad(bad, "cfg->lr", xt, nt, nt, xv, nv, nv, &c, 0, in);
    c = ok, c.tau_start = 0;
    expect_bad(bad, "cfg->tau_start", xt, nt, nt, xv, nv, nv, &c, 0, in);
    c = ok, c.tau_end = 2 * c.tau_start;
    expect_bad(bad, "cfg->tau_end", xt, nt, nt, xv, nv, nv, &c, 0, in);
    c = ok, c.tau_end = 0;
    expect_bad(bad, "cfg->tau_end", xt, nt, nt, xv, nv, nv, &c, 0, in);
    c = ok, c.lambda_bce = -1;
    expect_bad(bad, "cfg->lambda_bce", xt, nt, nt, xv, nv, nv, &c, 0, in);
    c = ok, c.lambda_r = INFINITY;
    expect_bad(bad, "cfg->lambda_r", xt, nt, nt, xv, nv, nv, &c, 0, in);
    expect_bad(bad, "init is NULL", xt, nt, nt, xv, nv, nv, &ok, 0, NULL);

    struct kvcap_key_maps k = p.init;
    k.rk = k.m + 1;
    expect_bad(bad, "init sizes", xt, nt, nt, xv, nv, nv, &ok, 0, &k);
    k = p.init, k.h = 0;
    expect_bad(bad, "init sizes", xt, nt, nt, xv, nv, nv, &ok, 0, &k);
    k = p.init, k.w2 = NULL;
    expect_bad(bad, "init has a NULL array", xt, nt, nt, xv, nv, nv, &ok, 0, &k);
    int32_t mask[3] = {2, 1, 5};
    k = p.init, k.mask = mask;
    expect_bad(bad, "init->mask[1]", xt, nt, nt, xv, nv, nv, &ok, 0, &k);
    mask[0] = 0, mask[1] = 1, mask[2] = 8;
    expect_bad(bad, "init->mask[2]", xt, nt, nt, xv, nv, nv, &ok, 0, &k);
    k = p.init, k.gelu = 1;
    expect_bad(bad, "gelu is 0", xt, nt, nt, xv, nv, nv, &ok, 0, &k);

    struct kvcap_train_report rep;
    assert_int_equal(kvcap_keys_train(xt, nt, nt, xv, nv, nv, &ok, 0, in, NULL, &rep), bad);
    assert_error_names("out is NULL");
    struct kvcap_key_maps out;
    assert_int_equal(kvcap_keys_train(xt, nt, nt, xv, nv, nv, &ok, 0, in, &out, NULL), bad);
    assert_error_names("report is NULL");
    k = p.init;
    assert_int_equal(kvcap_keys_train(xt, nt, nt, xv, nv, nv, &ok, 0, &k, &k, &rep), bad);
    assert_error_names("out is init");

    /* data that is not finite is a numeric error naming the array and the entry */
    float *nan_train = alloc_f((size_t)p.m * nt);
    memcpy(nan_train, xt, sizeof *nan_train * (size_t)p.m * nt);
    nan_train[2 * nt + 7] = NAN;
    expect_bad(KVCAP_ERR_NUMERIC, "x_train[2][7]", nan_train, nt, nt, xv, nv, nv, &ok, 0, in);
    float *inf_val = alloc_f((size_t)p.m * nv);
    memcpy(inf_val, xv, sizeof *inf_val * (size_t)p.m * nv);
    inf_val[5 * nv + 3] = -INFINITY;
    expect_bad(KVCAP_ERR_NUMERIC, "x_val[5][3]", xt, nt, nt, inf_val, nv, nv, &ok, 0, in);
    free(nan_train);
    free(inf_val);
    problem_free(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gradient_linear_relaxed),
        cmocka_unit_test(test_gradient_linear_hard),
        cmocka_unit_test(test_gradient_gelu_relaxed),
        cmocka_unit_test(test_gradient_gelu_hard),
        cmocka_unit_test(test_start_reproduces_linear_init),
        cmocka_unit_test(test_start_reproduces_init_in_gelu),
        cmocka_unit_test(test_training_improves_a_shrunk_init),
        cmocka_unit_test(test_readout_is_least_squares),
        cmocka_unit_test(test_finetune_reaches_least_squares),
        cmocka_unit_test(test_never_worse_than_init),
        cmocka_unit_test(test_same_seed_same_maps),
        cmocka_unit_test(test_batch_order),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
