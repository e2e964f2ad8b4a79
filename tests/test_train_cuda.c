/* test_train_cuda.c — key training on a CUDA device (calibrate/cuda/train.cu) against the CPU:
 * one loss + gradient evaluation against the double reference (relaxed and hard, linear and
 * GELU, whole set and gathered batches), MSEs against kvcap_key_maps_mse, whole runs against
 * kvcap_keys_train, and two runs with one seed bit for bit. First, on every machine, what
 * needs no device: kvcap_calib_cuda_keys_train's argument errors, and its fallback to (or refusal
 * of) the CPU when no device can be used. Then, without a CUDA device, it reports itself
 * skipped (exit 77). */
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
#include "calibrate/calib_cuda.h"
#include "common/internal.h"
#include "calibrate/keys.h"
#include "common/rng.h"
#include "tests/test_train_util.h"
#include "calibrate/train_internal.h"

/* Tolerances, and why:
 * One loss + gradient evaluation: float products summed in another order (cuBLAS tiles and
 * FMA, block reductions) than the double reference. Each entry sums up to 700 columns of
 * float products; the rounding error grows like √terms times the sum of |terms|, at most a
 * few 1e-6 of the entry's block maximum here (the same sequence of float products on the CPU
 * measured 3e-7 at 700 columns). 1e-4 of the block maximum, as test_train.c asks of the CPU's
 * sgemm version, is still far below any wrong term (those are O(1) relative). */
#define GRAD_TOL 1e-4
/* The loss: a double sum of float squared errors, ~1e-7 relative. */
#define LOSS_TOL 1e-5
/* A forward pass (the MSE of fixed maps): float products and the same double sums. */
#define MSE_TOL 1e-5
/* Whole runs, device against CPU: the gradients differ by ~1e-6 of their largest entry
 * (above) and Adam applies them as m1/√m2, which rounding moves by about as much while the
 * gradients are large against that noise — a short run from a far-off init, as here. Measured
 * on the CPU by adding noise of 1e-6 (1e-5) of the largest entry to every gradient of these
 * runs: final MSEs and reconstructed keys moved by < 2e-5 (< 2e-4). 1e-3 relative leaves a
 * fiftyfold margin. (Near convergence Adam amplifies much more: 300 steps at lr 1e-2 with
 * 1e-6 noise moved a validation MSE by 1.4 %, which is why the runs here are short.) The
 * checkpoints compare MSEs far apart from one to the next, so both paths keep the same one;
 * masks and step counts must match exactly. */
#define RUN_REL_TOL 1e-3

/* ---- helpers -------------------------------------------------------------------------- */

static void fill_nan(float *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = NAN;
}

static double rel(double a, double b)
{
    return fabs(a - b) / fabs(b);
}

/* A keys problem and its closed-form init; ridge 10 shrinks the init far from the optimum,
 * so training moves a long way with large gradients (see RUN_REL_TOL). */
struct problem {
    int m, rk, h;
    size_t n_train, n_val, ld_train, ld_val;
    float *train, *val;
    struct kvcap_key_maps init;
};

static void problem_make(struct problem *p, size_t n_train, size_t n_val, double ridge,
                         uint64_t seed)
{
    enum { M = 16, K = 4, RK = 6, H = 6 };
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, seed);
    double a[M * K];
    for (int i = 0; i < M * K; i++)
        a[i] = kvcap_rng_normal(&rng);
    p->m = M, p->rk = RK, p->h = H;
    p->n_train = n_train, p->n_val = n_val;
    p->ld_train = n_train + 5, p->ld_val = n_val + 3; /* strided, as calibrate.c passes them */
    p->train = low_rank_data(a, M, K, n_train, p->ld_train, 0.02, &rng);
    p->val = low_rank_data(a, M, K, n_val, p->ld_val, 0.02, &rng);
    double *g = calloc((size_t)M * M, sizeof *g);
    assert_non_null(g);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < M; j++) {
            double s = 0;
            for (size_t c = 0; c < n_train; c++)
                s += (double)p->train[(size_t)i * p->ld_train + c] *
                     p->train[(size_t)j * p->ld_train + c];
            g[(size_t)i * M + j] = s;
        }
    assert_int_equal(kvcap_keys_closed_form(g, M, RK, H, ridge, &p->init), KVCAP_OK);
    free(g);
}

static void problem_free(struct problem *p)
{
    free(p->train);
    free(p->val);
    kvcap_key_maps_free(&p->init);
}

static struct kvcap_train_config run_cfg(void)
{
    struct kvcap_train_config c = {.steps = 40, .lr = 3e-3, .tau_start = 1.0, .tau_end = 0.05,
                                   .lambda_bce = 0.01, .lambda_r = 1.0, .finetune_steps = 40,
                                   .seed = 7};
    return c;
}

/* Reconstruction of the n columns of x (ld) by maps k, m x n. */
static float *reconstruct(const struct kvcap_key_maps *k, const float *x, size_t ld, size_t n)
{
    float *xk = alloc_f((size_t)k->rk * n), *hid = alloc_f((size_t)k->h * n);
    float *out = alloc_f((size_t)k->m * n);
    for (int r = 0; r < k->rk; r++)
        memcpy(xk + (size_t)r * n, x + (size_t)k->mask[r] * ld, sizeof *xk * n);
    kvcap_key_maps_apply_ref(k, xk, n, n, hid, out, n);
    free(xk);
    free(hid);
    return out;
}

/* Warnings the library logged. */
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

/* ---- (a) without a device -------------------------------------------------------------- */

/* Argument errors come first, named as by kvcap_keys_train, whether a device exists or not. */
static void test_arguments_before_device(void **state)
{
    (void)state;
    struct problem p;
    problem_make(&p, 200, 50, 1e-3, 1);
    struct kvcap_train_config cfg = run_cfg();
    for (int fallback = 0; fallback <= 1; fallback++) {
        struct kvcap_key_maps out;
        struct kvcap_train_report rep;
        memset(&out, 0xab, sizeof out);
        assert_int_equal(kvcap_calib_cuda_keys_train(NULL, p.ld_train, p.n_train, p.val, p.ld_val,
                                                     p.n_val, &cfg, 0, &p.init, &out, &rep,
                                                     fallback),
                         KVCAP_ERR_INVALID_ARGUMENT);
        assert_error_names("x_train");
        assert_null(out.w1); /* left zeroed */
        cfg.lr = -1;
        assert_int_equal(kvcap_calib_cuda_keys_train(p.train, p.ld_train, p.n_train, p.val,
                                                     p.ld_val, p.n_val, &cfg, 0, &p.init, &out,
                                                     &rep, fallback),
                         KVCAP_ERR_INVALID_ARGUMENT);
        assert_error_names("cfg->lr");
        cfg.lr = run_cfg().lr;
        assert_int_equal(kvcap_calib_cuda_keys_train(p.train, p.ld_train, p.n_train, p.val,
                                                     p.ld_val, p.n_val, &cfg, 0, &p.init, NULL,
                                                     &rep, fallback),
                         KVCAP_ERR_INVALID_ARGUMENT);
        assert_error_names("out is NULL");
    }
    problem_free(&p);
}

/* With no usable device: fallback trains on the CPU — exactly kvcap_keys_train, with one
 * warning — and no fallback is KVCAP_ERR_UNSUPPORTED naming the reason. */
static void test_no_device_fallback(void **state)
{
    (void)state;
    const char *why = kvcap_calib_cuda_unavailable();
    if (!why)
        skip(); /* a device is visible: (c) covers the device path */
    struct problem p;
    problem_make(&p, 1500, 200, 10.0, 2);
    struct kvcap_train_config cfg = run_cfg();
    struct kvcap_key_maps cpu, dev;
    struct kvcap_train_report rc, rd;
    assert_int_equal(kvcap_keys_train(p.train, p.ld_train, p.n_train, p.val, p.ld_val, p.n_val,
                                      &cfg, 1, &p.init, &cpu, &rc),
                     KVCAP_OK);
    assert_int_equal(rc.on_device, 0);

    n_warnings = 0;
    kvcap_log_set(capture_log, NULL, KVCAP_LOG_WARN);
    enum kvcap_status st = kvcap_calib_cuda_keys_train(
        p.train, p.ld_train, p.n_train, p.val, p.ld_val, p.n_val, &cfg, 1, &p.init, &dev, &rd, 1);
    kvcap_log_set(NULL, NULL, KVCAP_LOG_WARN);
    assert_int_equal(st, KVCAP_OK);
    assert_int_equal(n_warnings, 1);
    assert_non_null(strstr(last_warning, "training the keys on the CPU"));
    assert_non_null(strstr(last_warning, why));
    assert_int_equal(rd.on_device, 0);
    assert_memory_equal(&rc, &rd, sizeof rc);
    assert_int_equal(cpu.gelu, dev.gelu);
    assert_memory_equal(cpu.mask, dev.mask, sizeof *cpu.mask * (size_t)cpu.rk);
    assert_memory_equal(cpu.w1, dev.w1, sizeof *cpu.w1 * (size_t)cpu.rk * cpu.h);
    assert_memory_equal(cpu.b1, dev.b1, sizeof *cpu.b1 * (size_t)cpu.h);
    assert_memory_equal(cpu.w2, dev.w2, sizeof *cpu.w2 * (size_t)cpu.h * cpu.m);
    assert_memory_equal(cpu.b2, dev.b2, sizeof *cpu.b2 * (size_t)cpu.m);
    kvcap_key_maps_free(&dev);

    memset(&dev, 0xab, sizeof dev);
    kvcap_log_set(capture_log, NULL, KVCAP_LOG_WARN);
    n_warnings = 0;
    st = kvcap_calib_cuda_keys_train(p.train, p.ld_train, p.n_train, p.val, p.ld_val, p.n_val, &cfg,
                                     1, &p.init, &dev, &rd, 0);
    kvcap_log_set(NULL, NULL, KVCAP_LOG_WARN);
    assert_int_equal(st, KVCAP_ERR_UNSUPPORTED);
    assert_error_names("device cuda");
    assert_error_names(why);
    assert_int_equal(n_warnings, 0);
    assert_null(dev.w1);
    kvcap_key_maps_free(&dev);
    kvcap_key_maps_free(&cpu);
    problem_free(&p);
}

/* ---- (b) one loss + gradient evaluation --------------------------------------------------- */

/* Largest |g| over the parameter block (alpha, w1, b1, w2, b2) that holds entry i. */
static double block_max(const struct kvcap_train_net *net, const float *g, size_t i)
{
    size_t m = (size_t)net->m, p = (size_t)net->p, h = (size_t)net->h;
    size_t ends[5], nb = 0, lo = 0;
    if (!net->rows)
        ends[nb++] = m;
    ends[nb] = (nb ? ends[nb - 1] : 0) + p * h, nb++;
    ends[nb] = ends[nb - 1] + h, nb++;
    ends[nb] = ends[nb - 1] + h * m, nb++;
    ends[nb] = ends[nb - 1] + m, nb++;
    for (size_t b = 0; b < nb; lo = ends[b], b++)
        if (i < ends[b]) {
            double mx = 0;
            for (size_t t = lo; t < ends[b]; t++)
                mx = fmax(mx, fabs(g[t]));
            return mx;
        }
    fail();
    return 0;
}

/* m points, p retained (hard), h hidden; n_train columns (ld n_train + 3); batches of `batch`
 * columns: the whole set when batch == n_train, else a random sorted pick. */
static void check_loss_grad(int m, int p, int h, size_t n_train, size_t batch, int gelu,
                            int hard, uint64_t seed)
{
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, seed);
    const size_t ld = n_train + 3;
    float *x = alloc_f((size_t)m * ld);
    for (size_t i = 0; i < (size_t)m * ld; i++)
        x[i] = (float)kvcap_rng_normal(&rng);
    int32_t *rows = malloc(sizeof *rows * (size_t)p);
    assert_non_null(rows);
    for (int r = 0; r < p; r++) /* increasing, spread over [0, m) */
        rows[r] = (int32_t)((size_t)r * m / p + (size_t)(seed % 2));
    struct kvcap_train_net net;
    assert_int_equal(kvcap_train_net_alloc(&net, m, hard ? p : m, h, gelu, hard ? rows : NULL),
                     KVCAP_OK);
    net.tau = 0.7;
    net.lambda_bce = 0.3; /* large enough that the mask terms weigh in */
    net.lambda_r = 0.8;
    net.ratio = (double)p / m;
    for (size_t i = 0; i < net.n_params; i++)
        net.theta[i] = (float)(0.5 * kvcap_rng_normal(&rng) / sqrt((double)(m > h ? m : h) / 8));
    struct kvcap_train_view v = kvcap_train_split(&net, net.theta);
    if (v.alpha)
        for (int j = 0; j < m; j++)
            v.alpha[j] = (float)(net.tau * 1.5 * kvcap_rng_normal(&rng));

    /* the batch: all columns, or `batch` distinct ones, increasing */
    size_t *pick = NULL;
    float *xb = x;
    size_t ldb = ld;
    if (batch < n_train) {
        pick = malloc(sizeof *pick * batch);
        unsigned char *taken = calloc(n_train, 1);
        assert_true(pick && taken);
        for (size_t c = 0; c < batch; c++) {
            size_t j;
            do
                j = (size_t)kvcap_rng_below(&rng, n_train);
            while (taken[j]);
            taken[j] = 1;
        }
        for (size_t j = 0, c = 0; j < n_train; j++)
            if (taken[j])
                pick[c++] = j;
        free(taken);
        xb = alloc_f((size_t)m * batch);
        for (int j = 0; j < m; j++)
            for (size_t c = 0; c < batch; c++)
                xb[(size_t)j * batch + c] = x[(size_t)j * ld + pick[c]];
        ldb = batch;
    }
    float *g_ref = alloc_f(net.n_params), *g_dev = alloc_f(net.n_params);
    double l_ref = kvcap_train_loss_grad_ref(&net, xb, ldb, batch, g_ref);
    assert_true(isfinite(l_ref));

    struct kvcap_calib_cuda_train *dev = NULL;
    struct kvcap_calib_cuda_train_params gp = {m, h, x, ld, n_train, NULL, 0, 0, batch};
    if (kvcap_calib_cuda_train_create(&gp, &dev) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_int_equal(kvcap_calib_cuda_train_load(dev, &net), KVCAP_OK);
    fill_nan(g_dev, net.n_params);
    double l_dev = NAN;
    if (kvcap_calib_cuda_train_loss_grad(dev, &net, pick, &l_dev, g_dev) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    if (!(rel(l_dev, l_ref) <= LOSS_TOL))
        fail_msg("gelu %d hard %d n %zu: loss %.9g, reference %.9g", gelu, hard, batch, l_dev,
                 l_ref);
    for (size_t i = 0; i < net.n_params; i++) {
        double scale = block_max(&net, g_ref, i);
        if (!(fabs((double)g_dev[i] - g_ref[i]) <= GRAD_TOL * scale))
            fail_msg("gelu %d hard %d n %zu: gradient entry %zu: device %g, reference %g (block "
                     "max %g)",
                     gelu, hard, batch, i, g_dev[i], g_ref[i], scale);
    }
    /* θ is the device's, so fetching gives back what was loaded */
    float *keep = alloc_f(net.n_params);
    memcpy(keep, net.theta, sizeof *keep * net.n_params);
    fill_nan(net.theta, net.n_params);
    assert_int_equal(kvcap_calib_cuda_train_fetch(dev, &net), KVCAP_OK);
    assert_memory_equal(net.theta, keep, sizeof *keep * net.n_params);
    /* a batch index beyond the set is refused by name */
    if (pick) {
        size_t save = pick[batch - 1];
        pick[batch - 1] = n_train;
        assert_int_equal(kvcap_calib_cuda_train_loss_grad(dev, &net, pick, &l_dev, NULL),
                         KVCAP_ERR_INVALID_ARGUMENT);
        assert_error_names("batch column");
        pick[batch - 1] = save;
    }
    kvcap_calib_cuda_train_free(dev);
    kvcap_train_net_free(&net);
    if (xb != x)
        free(xb);
    free(x);
    free(rows);
    free(pick);
    free(keep);
    free(g_ref);
    free(g_dev);
}

static void test_loss_grad_matches_reference(void **state)
{
    (void)state;
    for (int gelu = 0; gelu <= 1; gelu++)
        for (int hard = 0; hard <= 1; hard++) {
            /* tiny, whole set (as test_train.c's CPU check) */
            check_loss_grad(7, 3, 5, 9, 9, gelu, hard, 1234 + 2 * gelu + hard);
            /* several blocks per reduction, the whole set */
            check_loss_grad(40, 12, 16, 700, 700, gelu, hard, 99 + 2 * gelu + hard);
            /* a batch gathered by index from a larger set */
            check_loss_grad(40, 12, 16, 1500, 300, gelu, hard, 555 + 2 * gelu + hard);
        }
}

/* The scores checkpoints compare: the device's MSE of fixed maps against kvcap_key_maps_mse,
 * on a validation set longer than the device's chunk (KVCAP_TRAIN_BATCH columns), and on the
 * training set. */
static void test_maps_mse_matches_cpu(void **state)
{
    (void)state;
    struct problem p;
    problem_make(&p, 1500, 2500, 1e-3, 3);
    struct kvcap_calib_cuda_train *dev = NULL;
    struct kvcap_calib_cuda_train_params gp = {
        p.m, p.h, p.train, p.ld_train, p.n_train, p.val, p.ld_val, p.n_val, KVCAP_TRAIN_BATCH};
    if (kvcap_calib_cuda_train_create(&gp, &dev) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    for (int gelu = 0; gelu <= 1; gelu++) {
        struct kvcap_key_maps k;
        assert_int_equal(kvcap_key_maps_copy(&k, &p.init), KVCAP_OK);
        k.gelu = gelu;
        for (int i = 0; i < k.h; i++) /* move the GELU off its linear range */
            k.b1[i] += 0.3f * (float)(i % 3);
        for (int on_val = 0; on_val <= 1; on_val++) {
            double want, energy, got = NAN;
            assert_int_equal(kvcap_key_maps_mse(&k, on_val ? p.val : p.train,
                                                on_val ? p.ld_val : p.ld_train,
                                                on_val ? p.n_val : p.n_train, &want, &energy),
                             KVCAP_OK);
            assert_int_equal(kvcap_calib_cuda_train_maps_mse(dev, &k, on_val, &got), KVCAP_OK);
            if (!(rel(got, want) <= MSE_TOL))
                fail_msg("gelu %d on_val %d: device MSE %.9g, CPU %.9g", gelu, on_val, got, want);
        }
        kvcap_key_maps_free(&k);
    }
    kvcap_calib_cuda_train_free(dev);
    problem_free(&p);
}

/* ---- (c) whole runs ----------------------------------------------------------------------- */

static void expect_run_matches(const struct problem *p, const struct kvcap_train_config *cfg,
                               int gelu, int with_val)
{
    const float *xv = with_val ? p->val : NULL;
    size_t nv = with_val ? p->n_val : 0;
    struct kvcap_key_maps cpu, dev;
    struct kvcap_train_report rc, rd;
    assert_int_equal(kvcap_keys_train(p->train, p->ld_train, p->n_train, xv, p->ld_val, nv, cfg,
                                      gelu, &p->init, &cpu, &rc),
                     KVCAP_OK);
    if (kvcap_calib_cuda_keys_train(p->train, p->ld_train, p->n_train, xv, p->ld_val, nv, cfg, gelu,
                                    &p->init, &dev, &rd, 0) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    print_message("gelu %d, %zu train / %zu val columns: val MSE %.6g -> CPU %.6g, device %.6g\n",
                  gelu, p->n_train, nv, rc.init_val_mse, rc.final_val_mse, rd.final_val_mse);
    assert_int_equal(rd.on_device, 1);
    assert_int_equal(rd.steps_run, rc.steps_run);
    assert_int_equal(rd.steps_run, cfg->steps + cfg->finetune_steps);
    assert_int_equal(rd.kept_init, rc.kept_init);
    assert_int_equal(rd.kept_init, 0); /* the run improved on the shrunk init */
    assert_int_equal(dev.gelu, cpu.gelu);
    assert_int_equal(dev.rk, cpu.rk);
    assert_memory_equal(dev.mask, cpu.mask, sizeof *dev.mask * (size_t)dev.rk);
    assert_true(rel(rd.init_train_mse, rc.init_train_mse) <= MSE_TOL);
    assert_true(rel(rd.init_val_mse, rc.init_val_mse) <= MSE_TOL);
    double dt = rel(rd.final_train_mse, rc.final_train_mse);
    double dv = rel(rd.final_val_mse, rc.final_val_mse);
    const float *x = with_val ? p->val : p->train;
    size_t ld = with_val ? p->ld_val : p->ld_train, n = with_val ? p->n_val : p->n_train;
    float *yc = reconstruct(&cpu, x, ld, n), *yd = reconstruct(&dev, x, ld, n);
    double dy = rel_diff(yd, yc, (size_t)p->m * n);
    print_message("  relative differences: train MSE %.2g, val MSE %.2g, keys %.2g\n", dt, dv,
                  dy);
    if (!(dt <= RUN_REL_TOL && dv <= RUN_REL_TOL && dy <= RUN_REL_TOL))
        fail_msg("device run differs from the CPU's: train MSE %g, val MSE %g, keys %g "
                 "(relative, tolerance %g)",
                 dt, dv, dy, RUN_REL_TOL);
    free(yc);
    free(yd);
    kvcap_key_maps_free(&cpu);
    kvcap_key_maps_free(&dev);
}

static void test_run_matches_cpu(void **state)
{
    (void)state;
    struct kvcap_train_config cfg = run_cfg();
    /* minibatches (1500 columns > KVCAP_TRAIN_BATCH) and a validation set */
    struct problem p;
    problem_make(&p, 1500, 300, 10.0, 4);
    for (int gelu = 0; gelu <= 1; gelu++)
        expect_run_matches(&p, &cfg, gelu, 1);
    problem_free(&p);
    /* the whole set every step, no validation set (the training columns decide) */
    problem_make(&p, 600, 1, 10.0, 5);
    expect_run_matches(&p, &cfg, 1, 0);
    problem_free(&p);
}

static void test_same_seed_bit_identical(void **state)
{
    (void)state;
    struct problem p;
    problem_make(&p, 1500, 300, 10.0, 6);
    struct kvcap_train_config cfg = run_cfg();
    struct kvcap_key_maps a, b;
    struct kvcap_train_report ra, rb;
    for (int gelu = 0; gelu <= 1; gelu++) {
        assert_int_equal(kvcap_calib_cuda_keys_train(p.train, p.ld_train, p.n_train, p.val,
                                                     p.ld_val, p.n_val, &cfg, gelu, &p.init, &a,
                                                     &ra, 0),
                         KVCAP_OK);
        assert_int_equal(kvcap_calib_cuda_keys_train(p.train, p.ld_train, p.n_train, p.val,
                                                     p.ld_val, p.n_val, &cfg, gelu, &p.init, &b,
                                                     &rb, 0),
                         KVCAP_OK);
        assert_int_equal(ra.on_device, 1);
        assert_memory_equal(&ra, &rb, sizeof ra);
        assert_int_equal(a.gelu, b.gelu);
        assert_memory_equal(a.mask, b.mask, sizeof *a.mask * (size_t)a.rk);
        assert_memory_equal(a.w1, b.w1, sizeof *a.w1 * (size_t)a.rk * a.h);
        assert_memory_equal(a.b1, b.b1, sizeof *a.b1 * (size_t)a.h);
        assert_memory_equal(a.w2, b.w2, sizeof *a.w2 * (size_t)a.h * a.m);
        assert_memory_equal(a.b2, b.b2, sizeof *a.b2 * (size_t)a.m);
        kvcap_key_maps_free(&a);
        kvcap_key_maps_free(&b);
    }
    problem_free(&p);
}

int main(void)
{
    const struct CMUnitTest host[] = {
        cmocka_unit_test(test_arguments_before_device),
        cmocka_unit_test(test_no_device_fallback),
    };
    int failed = cmocka_run_group_tests_name("without a device", host, NULL, NULL);
    if (failed)
        return failed;
    const char *why = kvcap_calib_cuda_unavailable();
    if (why) {
        printf("SKIP: no CUDA device: %s\n", why);
        return 77;
    }
    char name[128];
    if (kvcap_calib_cuda_device_name(name, sizeof name) == KVCAP_OK)
        printf("device: %s\n", name);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_loss_grad_matches_reference),
        cmocka_unit_test(test_maps_mse_matches_cpu),
        cmocka_unit_test(test_run_matches_cpu),
        cmocka_unit_test(test_same_seed_bit_identical),
    };
    return cmocka_run_group_tests_name("on the device", tests, NULL, NULL);
}
