/* test_calibrate_cuda.c — the CUDA calibration paths against the CPU oracle on the same data:
 * the Gram accumulator and the batched eigensolver directly, then whole calibrations (Grams,
 * eigenvalues, value subspaces, key maps, validation metrics, merged states, trained keys).
 * Without a CUDA device (or without CUDA in the build) it reports itself skipped (exit 77). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <cblas.h>

#include "calibrate/calibrate.h"
#include "common/internal.h"
#include "calibrate/linalg.h"
#include "common/rng.h"
#include "tests/test_util.h"

/* Tolerances, and why:
 * Grams: the same double products summed in another order (cuBLAS blocking, FMA): a few ulps
 * per sum, far below 1e-12 of the Frobenius norm for the sizes here. */
#define GRAM_REL_TOL 1e-12
/* Eigenvalues: Weyl's bound, |Δλ| <= ‖ΔG‖₂ (1e-12 relative, above) plus each solver's backward
 * error (~m·eps·‖G‖, m <= 256): 1e-10 of the largest eigenvalue has a wide margin. */
#define EIG_REL_TOL 1e-10
/* Value subspaces: stored as float rows, so each basis is orthonormal only to ~1e-7; the
 * largest principal angle between the top-R subspaces (well separated eigenvalues at R in this
 * data) stays far below 1e-6 rad. Raw eigenvectors are never compared (signs flip). */
#define ANGLE_TOL 1e-6
/* Key maps: fitted on the CPU from Grams that agree to 1e-12 (ridge keeps the solve well
 * conditioned) and stored in float: entries move by an ulp or two (~1e-7 relative). */
#define MAP_REL_TOL 1e-5
/* Validation metrics are ratios of small differences (k_rel ~ 0.05 turns a 1e-7 change of a map
 * into ~2e-6 of the metric); a wrong basis or mask would move them by O(1). */
#define METRIC_REL_TOL 1e-4
/* Trained keys: Adam from the closed form, in float, on the CPU in one run and on the device in
 * the other. Gradients that differ in rounding end a little apart: noise of 1e-6 of the largest
 * gradient entry moved k_rel by up to 3.2e-4 over this test's units on the CPU, so 3e-3 keeps a
 * 10x margin while a wrong mask or reconstructor moves k_rel by O(1). */
#define TRAINED_REL_TOL 3e-3

static const char *yaml =
    "model:\n"
    "  name: tiny\n"
    "  layers: 3\n"
    "  q_heads: 8\n"
    "  kv_heads: 4\n"
    "  head_dim: 64\n"
    "  rope: {type: rope, pairing: half, theta: 10000}\n"
    "buckets:\n"
    "  - {rows: 16, cols: 16}\n"                            /* m = 256: several batches/unit */
    "  - {rows: 16, cols: 16, structure: tiled, tile: [4, 4]}\n" /* m = 16, 1024 columns/span */
    "schedule:\n"
    "  keys: {kind: uniform, ratio: 0.125}\n"
    "  values: {kind: uniform, ratio: 0.03125}\n" /* R_v = 8 of 256: the data's value rank */
    "keys: {method: %s, activation: %s, ridge: 0.001, train: {steps: 60, finetune_steps: 40, "
    "lr: 0.003}}\n"
    "validation: {fraction: 0.2, seed: 3}\n"
    "storage: f32\n";

static void load_config(struct kvcap_calib_config *cfg, const char *method, const char *act)
{
    char text[2048];
    snprintf(text, sizeof text, yaml, method, act);
    if (kvcap_calib_config_load_string(text, "test.yaml", cfg) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
}

/* Noisy, full-rank data: the key masks are decided by the data, not by rounding. */
static void synth(const struct kvcap_calib_config *cfg, const char *dir, int spans, uint64_t seed)
{
    struct kvcap_synth_params p;
    kvcap_synth_default_params(&p);
    p.n_spans = spans;
    p.n_grids = 1;
    p.grid_rows[0] = 16;
    p.grid_cols[0] = 16;
    p.rank_k = 10;
    p.rank_v = 8;
    p.noise = 0.05;
    p.outliers = 2;
    p.post_queries = 0;
    p.decode_queries = 2;
    p.dtype = KVCAP_DTYPE_F32;
    p.seed = seed;
    p.p0_max = 3000;
    assert_int_equal(kvcap_synth(&cfg->model, &p, dir, NULL, NULL), KVCAP_OK);
}

static void calibrate(const struct kvcap_calib_config *cfg, const char *const *dirs, int n,
                      enum kvcap_calib_device device, struct kvcap_calib_state *s,
                      struct kvcap_calibrate_report *r)
{
    struct kvcap_calibrate_options o;
    kvcap_calibrate_default_options(&o);
    o.data = dirs;
    o.n_data = n;
    o.device = device;
    if (kvcap_calibrate(cfg, &o, s, r) != KVCAP_OK)
        fail_msg("%s calibration: %s", kvcap_calib_device_name(device), kvcap_last_error());
    assert_int_equal(r->device, device);
    assert_int_equal(r->fit.values_device, device);
}

static double rel_diff(const double *a, const double *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += a[i] * a[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static double rel_diff_f(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)a[i] * a[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

/* Largest principal angle between the row spaces of two r x m matrices with orthonormal rows:
 * sin θ = ‖(I − QaᵀQa) Qbᵀ‖₂, the square root of the largest eigenvalue of EᵀE. */
static double max_principal_angle(const float *qa, const float *qb, int r, int m)
{
    double *p = calloc((size_t)r * r, sizeof *p), *e = calloc((size_t)m * r, sizeof *e);
    double *s = calloc((size_t)r * r, sizeof *s), *w = calloc((size_t)r, sizeof *w);
    assert_true(p && e && s && w);
    for (int i = 0; i < r; i++) /* P = Qa Qbᵀ */
        for (int j = 0; j < r; j++) {
            double v = 0;
            for (int k = 0; k < m; k++)
                v += (double)qa[(size_t)i * m + k] * qb[(size_t)j * m + k];
            p[(size_t)i * r + j] = v;
        }
    for (int k = 0; k < m; k++) /* E = Qbᵀ − Qaᵀ P */
        for (int j = 0; j < r; j++) {
            double v = qb[(size_t)j * m + k];
            for (int i = 0; i < r; i++)
                v -= (double)qa[(size_t)i * m + k] * p[(size_t)i * r + j];
            e[(size_t)k * r + j] = v;
        }
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r, r, m, 1.0, e, r, e, r, 0.0, s, r);
    assert_int_equal(kvcap_dsyevd(r, s, w), KVCAP_OK);
    double top = w[r - 1] > 0 ? w[r - 1] : 0;
    free(p), free(e), free(s), free(w);
    return asin(fmin(1.0, sqrt(top)));
}

/* Every unit's Grams, eigenvalues and top-R_v value subspace agree. */
static void expect_same_values(const struct kvcap_calib_state *a, const struct kvcap_calib_state *b)
{
    int L = a->model.n_layers;
    for (int l = 0; l < L; l++)
        for (int h = 0; h < a->model.n_kv_heads; h++)
            for (int bk = 0; bk < a->n_buckets; bk++) {
                const struct kvcap_calib_unit *u = kvcap_state_unit(a, l, h, bk);
                const struct kvcap_calib_unit *v = kvcap_state_unit(b, l, h, bk);
                int m = u->m;
                size_t mm = (size_t)m * m;
                double dk = rel_diff(u->k_gram, v->k_gram, mm);
                double dv = rel_diff(u->v_gram, v->v_gram, mm);
                if (!(dk <= GRAM_REL_TOL && dv <= GRAM_REL_TOL))
                    fail_msg("l%d.h%d.b%d: Grams differ: K %g, V %g (relative)", l, h, bk, dk, dv);
                for (int i = 0; i < m; i++)
                    for (int j = 0; j < i; j++) /* symmetrised like the CPU path */
                        assert_true(v->k_gram[(size_t)i * m + j] == v->k_gram[(size_t)j * m + i] &&
                                    v->v_gram[(size_t)i * m + j] == v->v_gram[(size_t)j * m + i]);
                assert_non_null(u->v_eigval);
                assert_non_null(v->v_eigval);
                for (int i = 0; i < m; i++)
                    if (!(fabs(u->v_eigval[i] - v->v_eigval[i]) <= EIG_REL_TOL * u->v_eigval[0]))
                        fail_msg("l%d.h%d.b%d: eigenvalue %d: %.17g vs %.17g", l, h, bk, i,
                                 u->v_eigval[i], v->v_eigval[i]);
                int r = kvcap_retained(a->r_values[l], m);
                double angle = max_principal_angle(u->v_eigvec, v->v_eigvec, r, m);
                if (!(angle <= ANGLE_TOL))
                    fail_msg("l%d.h%d.b%d: top-%d value subspaces %g rad apart", l, h, bk, r,
                             angle);
            }
}

static void expect_close(double a, double b, double tol, const char *what, int unit)
{
    if (isnan(a) && isnan(b))
        return;
    if (!(fabs(a - b) <= tol * fmax(fabs(a), 1e-3)))
        fail_msg("unit %d: %s: cpu %.9g, cuda %.9g", unit, what, a, b);
}

/* ---- The accumulator and the eigensolver, directly ----------------------------------------- */

static void test_gram_accumulator(void **state)
{
    (void)state;
    /* Three units of different sizes, Grams that start non-zero (accumulation continues), two
     * lanes taking turns, full and partial batches. */
    enum { UNITS = 3, LANES = 2, ROUNDS = 7 };
    const int m[UNITS] = {1, 37, 130};
    const size_t cap[UNITS] = {5, 64, 200};
    double *k[UNITS], *v[UNITS], *k_ref[UNITS], *v_ref[UNITS];
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 4);
    for (int i = 0; i < UNITS; i++) {
        size_t mm = (size_t)m[i] * m[i];
        k[i] = malloc(sizeof(double) * mm), v[i] = malloc(sizeof(double) * mm);
        k_ref[i] = malloc(sizeof(double) * mm), v_ref[i] = malloc(sizeof(double) * mm);
        assert_true(k[i] && v[i] && k_ref[i] && v_ref[i]);
        for (size_t j = 0; j < mm; j++) {
            k[i][j] = k_ref[i][j] = kvcap_rng_normal(&rng);
            v[i][j] = v_ref[i][j] = kvcap_rng_normal(&rng);
        }
    }
    struct kvcap_calib_cuda_gram_params p = {UNITS, m, cap, k, v, LANES};
    struct kvcap_calib_cuda_gram *g = NULL;
    if (kvcap_calib_cuda_gram_create(&p, &g) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    for (int round = 0; round < ROUNDS; round++)
        for (int i = 0; i < UNITS; i++) {
            size_t cols = round % 3 == 2 ? cap[i] / 2 + 1 : cap[i];
            double *kb, *vb;
            kvcap_calib_cuda_gram_buffers(g, (size_t)i, &kb, &vb);
            for (size_t r = 0; r < (size_t)m[i]; r++)
                for (size_t c = 0; c < cap[i]; c++) { /* junk beyond cols must be ignored */
                    kb[r * cap[i] + c] = c < cols ? kvcap_rng_normal(&rng) : NAN;
                    vb[r * cap[i] + c] = c < cols ? kvcap_rng_normal(&rng) : NAN;
                }
            cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, m[i], (int)cols, 1.0, kb,
                        (int)cap[i], 1.0, k_ref[i], m[i]);
            cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, m[i], (int)cols, 1.0, vb,
                        (int)cap[i], 1.0, v_ref[i], m[i]);
            if (kvcap_calib_cuda_gram_flush(g, (round + i) % LANES, (size_t)i, cols) != KVCAP_OK)
                fail_msg("%s", kvcap_last_error());
        }
    assert_int_equal(kvcap_calib_cuda_gram_flush(g, LANES, 0, 1),
                     KVCAP_ERR_INTERNAL); /* no such lane */
    if (kvcap_calib_cuda_gram_finish(g) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    kvcap_calib_cuda_gram_free(g);
    for (int i = 0; i < UNITS; i++) {
        size_t mm = (size_t)m[i] * m[i];
        assert_true(rel_diff(k_ref[i], k[i], mm) <= GRAM_REL_TOL);
        assert_true(rel_diff(v_ref[i], v[i], mm) <= GRAM_REL_TOL);
        for (int r = 0; r < m[i]; r++) /* the other triangle is untouched, as on the CPU */
            for (int c = 0; c < r; c++)
                assert_true(k[i][(size_t)r * m[i] + c] == k_ref[i][(size_t)r * m[i] + c] &&
                            v[i][(size_t)r * m[i] + c] == v_ref[i][(size_t)r * m[i] + c]);
        free(k[i]), free(v[i]), free(k_ref[i]), free(v_ref[i]);
    }
    kvcap_calib_cuda_gram_free(NULL);
}

struct eigen_check {
    const double *const *mats;
    const int *n;
    int seen;
};

/* Checks one result against kvcap_dsyevd: eigenvalues, and each column of `a` an eigenvector
 * of the input for its eigenvalue (residual), orthonormal columns. */
static enum kvcap_status check_eigen(int i, const double *a, const double *w, void *user)
{
    struct eigen_check *c = user;
    assert_int_equal(i, c->seen++);
    int n = c->n[i];
    size_t nn = (size_t)n * n;
    const double *g = c->mats[i];
    double *ref = malloc(sizeof(double) * nn), *wr = malloc(sizeof(double) * (size_t)n);
    assert_true(ref && wr);
    memcpy(ref, g, sizeof(double) * nn);
    assert_int_equal(kvcap_dsyevd(n, ref, wr), KVCAP_OK);
    double scale = fmax(fabs(wr[0]), fabs(wr[n - 1]));
    for (int j = 0; j < n; j++) {
        assert_true(fabs(w[j] - wr[j]) <= EIG_REL_TOL * scale);
        if (j > 0)
            assert_true(w[j] >= w[j - 1]); /* ascending */
        for (int r = 0; r < n; r++) {
            double gv = 0.0;
            for (int k = 0; k < n; k++)
                gv += g[(size_t)r * n + k] * a[(size_t)k * n + j];
            assert_true(fabs(gv - w[j] * a[(size_t)r * n + j]) <= 1e-10 * scale);
        }
        for (int j2 = 0; j2 <= j; j2++) {
            double d = 0.0;
            for (int r = 0; r < n; r++)
                d += a[(size_t)r * n + j] * a[(size_t)r * n + j2];
            assert_true(fabs(d - (j == j2 ? 1.0 : 0.0)) <= 1e-10);
        }
    }
    free(ref), free(wr);
    return KVCAP_OK;
}

static enum kvcap_status stop_at_one(int i, const double *a, const double *w, void *user)
{
    (void)a, (void)w, (void)user;
    return i == 1 ? kvcap_fail(KVCAP_ERR_STATE, "stopped") : KVCAP_OK;
}

static void test_eigen_batch(void **state)
{
    (void)state;
    /* sizes in an order that makes the workspace grow mid-batch, including n = 1 */
    enum { COUNT = 5 };
    const int n[COUNT] = {64, 1, 200, 7, 256};
    double *mats[COUNT];
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 9);
    for (int i = 0; i < COUNT; i++) {
        size_t nn = (size_t)n[i] * n[i];
        double *x = malloc(sizeof(double) * nn);
        mats[i] = malloc(sizeof(double) * nn);
        assert_true(x && mats[i]);
        for (size_t j = 0; j < nn; j++)
            x[j] = kvcap_rng_normal(&rng);
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n[i], n[i], n[i], 1.0, x, n[i], x,
                    n[i], 0.0, mats[i], n[i]); /* a full symmetric Gram */
        for (int r = 0; r < n[i]; r++)
            for (int c = 0; c < r; c++)
                mats[i][(size_t)r * n[i] + c] = mats[i][(size_t)c * n[i] + r];
        free(x);
    }
    struct kvcap_calib_cuda_eigen *e = NULL;
    if (kvcap_calib_cuda_eigen_create(64, &e) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    int failed = 0;
    /* n_max is 64 here: a larger matrix is refused before any work */
    assert_int_equal(kvcap_calib_cuda_dsyevd_batch(e, COUNT, (const double *const *)mats, n,
                                                   check_eigen, NULL, &failed),
                     KVCAP_ERR_INVALID_ARGUMENT);
    kvcap_calib_cuda_eigen_free(e);
    if (kvcap_calib_cuda_eigen_create(256, &e) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    struct eigen_check c = {(const double *const *)mats, n, 0};
    if (kvcap_calib_cuda_dsyevd_batch(e, COUNT, (const double *const *)mats, n, check_eigen, &c,
                                      &failed) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_int_equal(c.seen, COUNT);
    assert_int_equal(failed, -1);
    /* a consumer's failure stops the batch, names the matrix, and leaves the handle usable */
    assert_int_equal(kvcap_calib_cuda_dsyevd_batch(e, COUNT, (const double *const *)mats, n,
                                                   stop_at_one, NULL, &failed),
                     KVCAP_ERR_STATE);
    assert_int_equal(failed, 1);
    c.seen = 0;
    assert_int_equal(kvcap_calib_cuda_dsyevd_batch(e, COUNT, (const double *const *)mats, n,
                                                   check_eigen, &c, &failed),
                     KVCAP_OK);
    kvcap_calib_cuda_eigen_free(e);
    for (int i = 0; i < COUNT; i++)
        free(mats[i]);
}

/* ---- Whole calibrations -------------------------------------------------------------------- */

static void test_closed_form_matches_cpu(void **state)
{
    (void)state;
    struct kvcap_calib_config cfg;
    load_config(&cfg, "closed_form", "linear");
    char dir[512];
    assert_true(test_tmpdir(dir, sizeof dir, "calcuda-cf"));
    synth(&cfg, dir, 40, 17); /* ~32 training spans: several batches per dense unit */
    const char *dirs[1] = {dir};
    struct kvcap_calib_state sc, sg;
    struct kvcap_calibrate_report rc, rg;
    calibrate(&cfg, dirs, 1, KVCAP_CALIB_DEVICE_CPU, &sc, &rc);
    calibrate(&cfg, dirs, 1, KVCAP_CALIB_DEVICE_CUDA, &sg, &rg);
    assert_true(rg.device_name[0] != '\0');
    assert_true(rg.gram_flops == rc.gram_flops);
    for (int b = 0; b < cfg.n_buckets; b++) {
        assert_int_equal(sc.train_spans[b], sg.train_spans[b]);
        assert_int_equal(sc.val_spans[b], sg.val_spans[b]);
    }
    expect_same_values(&sc, &sg);
    size_t n = (size_t)cfg.model.n_layers * cfg.model.n_kv_heads * cfg.n_buckets;
    for (size_t i = 0; i < n; i++) {
        const struct kvcap_key_maps *a = &sc.units[i].keys, *b = &sg.units[i].keys;
        assert_int_equal(a->rk, b->rk);
        assert_int_equal(a->h, b->h);
        assert_memory_equal(a->mask, b->mask, sizeof(int32_t) * (size_t)a->rk);
        double dw = rel_diff_f(a->w2, b->w2, (size_t)a->h * a->m);
        if (!(dw <= MAP_REL_TOL))
            fail_msg("unit %zu: key maps differ by %g (relative)", i, dw);
        for (int k = 0; k < KVCAP_METRIC_COUNT; k++)
            expect_close(sc.units[i].metrics[k], sg.units[i].metrics[k], METRIC_REL_TOL,
                         kvcap_metric_name(k), (int)i);
    }
    kvcap_calib_state_free(&sc);
    kvcap_calib_state_free(&sg);
    kvcap_calib_config_free(&cfg);
    test_rm_tree(dir);
}

static void test_merged_states_match(void **state)
{
    (void)state;
    struct kvcap_calib_config cfg;
    load_config(&cfg, "closed_form", "linear");
    char da[512], db[512];
    assert_true(test_tmpdir(da, sizeof da, "calcuda-ma"));
    assert_true(test_tmpdir(db, sizeof db, "calcuda-mb"));
    synth(&cfg, da, 12, 21);
    synth(&cfg, db, 14, 22);
    const char *a[1] = {da}, *b[1] = {db}, *ab[2] = {da, db};
    struct kvcap_calib_state a_cpu, b_gpu, ab_cpu, ab_gpu;
    struct kvcap_calibrate_report r;
    calibrate(&cfg, a, 1, KVCAP_CALIB_DEVICE_CPU, &a_cpu, &r);
    calibrate(&cfg, b, 1, KVCAP_CALIB_DEVICE_CUDA, &b_gpu, &r);
    calibrate(&cfg, ab, 2, KVCAP_CALIB_DEVICE_CPU, &ab_cpu, &r);
    calibrate(&cfg, ab, 2, KVCAP_CALIB_DEVICE_CUDA, &ab_gpu, &r);
    /* a state from the CPU and one from the device merge into what one run gives on either */
    assert_int_equal(kvcap_calib_state_merge(&a_cpu, &b_gpu, "b"), KVCAP_OK);
    struct kvcap_fit_timing t;
    if (kvcap_calib_state_fit(&a_cpu, 1, KVCAP_CALIB_DEVICE_CUDA, &t, NULL, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_int_equal(t.values_device, KVCAP_CALIB_DEVICE_CUDA);
    expect_same_values(&ab_cpu, &a_cpu);
    expect_same_values(&ab_gpu, &a_cpu);
    for (int bk = 0; bk < cfg.n_buckets; bk++)
        assert_int_equal(a_cpu.train_spans[bk], ab_gpu.train_spans[bk]);
    kvcap_calib_state_free(&a_cpu);
    kvcap_calib_state_free(&b_gpu);
    kvcap_calib_state_free(&ab_cpu);
    kvcap_calib_state_free(&ab_gpu);
    kvcap_calib_config_free(&cfg);
    test_rm_tree(da);
    test_rm_tree(db);
}

static void test_trained_keys(void **state)
{
    (void)state;
    struct kvcap_calib_config cfg;
    load_config(&cfg, "trained", "gelu");
    char dir[512];
    assert_true(test_tmpdir(dir, sizeof dir, "calcuda-tr"));
    synth(&cfg, dir, 12, 5);
    const char *dirs[1] = {dir};
    struct kvcap_calib_state sc, sg;
    struct kvcap_calibrate_report rc, rg;
    calibrate(&cfg, dirs, 1, KVCAP_CALIB_DEVICE_CPU, &sc, &rc);
    calibrate(&cfg, dirs, 1, KVCAP_CALIB_DEVICE_CUDA, &sg, &rg);
    assert_true(rg.seconds_train > 0);
    assert_int_equal(rg.train_device, KVCAP_CALIB_DEVICE_CUDA);
    assert_int_equal(sg.activation, KVCAP_ACTIVATION_GELU);
    expect_same_values(&sc, &sg);
    size_t n = (size_t)cfg.model.n_layers * cfg.model.n_kv_heads * cfg.n_buckets;
    for (size_t i = 0; i < n; i++)
        expect_close(sc.units[i].metrics[KVCAP_METRIC_K_REL],
                     sg.units[i].metrics[KVCAP_METRIC_K_REL], TRAINED_REL_TOL, "trained k_rel",
                     (int)i);
    kvcap_calib_state_free(&sc);
    kvcap_calib_state_free(&sg);
    kvcap_calib_config_free(&cfg);
    test_rm_tree(dir);
}

int main(void)
{
    const char *why = kvcap_calib_cuda_unavailable();
    if (why) {
        printf("SKIP: %s\n", why);
        return 77;
    }
    char name[128];
    if (kvcap_calib_cuda_device_name(name, sizeof name) == KVCAP_OK)
        printf("device: %s\n", name);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gram_accumulator),
        cmocka_unit_test(test_eigen_batch),
        cmocka_unit_test(test_closed_form_matches_cpu),
        cmocka_unit_test(test_merged_states_match),
        cmocka_unit_test(test_trained_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
