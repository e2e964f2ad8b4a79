/* test_calibrate.c — calibration with known answers: exact recovery at the true rank, invariance
 * to the span's start position, exact merging of states, trained keys never worse than the
 * closed form, named errors for bad inputs, the device option, the row/column-major
 * contract the CUDA path relies on (checked here with column-major BLAS/LAPACK), a fit that
 * does not move when its Grams are perturbed at rounding level, and one that survives Grams no
 * data can produce. */
#include <dirent.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include <omp.h>

#include <cblas.h>
#include <lapacke.h>

#include "runtime/artifact.h"
#include "calibrate/calibrate.h"
#include "convert/convert.h"
#include "common/internal.h"
#include "calibrate/linalg.h"
#include "common/rng.h"
#include "tests/test_util.h"

/* Data are stored in f32: exact-rank structure survives storage up to float rounding. */
/* DCT basis rows stored in the artifact's storage dtype (F16 by default): orthonormal to
 * about 1e-3 (f16 rounding of m values each). */
#define DCT_TOL 4e-3
#define EXACT_REL_TOL 1e-4
/* Grams summed in a different order: double rounding only. */
#define MERGE_REL_TOL 1e-12
/* Offset normalisation rotates in float: angles up to ~5000 rad lose ~1e-6 relative. */
#define P0_REL_TOL 2e-5

static const char *base_yaml =
    "model:\n"
    "  name: tiny\n"
    "  layers: 2\n"
    "  q_heads: 4\n"
    "  kv_heads: 2\n"
    "  head_dim: 64\n"
    "  rope: {type: rope, pairing: half, theta: 10000}\n"
    "buckets:\n"
    "  - {rows: 8, cols: 8}\n"
    "  - {rows: 8, cols: 8, structure: tiled, tile: [4, 4]}\n"
    "schedule:\n"
    "  keys: {kind: uniform, ratio: 0.125}\n"   /* R_k = 8 of 64 (2 of 16 per tile) */
    "  values: {kind: uniform, ratio: 0.078125}\n" /* R_v = 5 of 64 */
    "keys: {method: %s, activation: %s, ridge: 0, train: {steps: 60, finetune_steps: 40, lr: 0.003}}\n"
    "validation: {fraction: %s, seed: 3}\n"
    "storage: f32\n";

static void load_config(struct kvcap_calib_config *cfg, const char *method,
                        const char *activation, const char *fraction)
{
    char text[2048];
    snprintf(text, sizeof text, base_yaml, method, activation, fraction);
    enum kvcap_status st = kvcap_calib_config_load_string(text, "test.yaml", cfg);
    if (st != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
}

static void tmpdir(char *out, size_t cap, const char *tag)
{
    assert_true(test_tmpdir(out, cap, tag));
}

static void synth_noisy(const struct kvcap_calib_config *cfg, const char *dir, int spans,
                        uint64_t seed, int p0_max, double noise)
{
    struct kvcap_synth_params p;
    kvcap_synth_default_params(&p);
    p.n_spans = spans;
    p.n_grids = 1;
    p.grid_rows[0] = 8;
    p.grid_cols[0] = 8;
    p.rank_k = 6;
    p.rank_v = 5;
    p.noise = noise;
    p.outliers = noise > 0 ? 2 : 0;
    p.post_queries = 0;
    p.decode_queries = 4;
    p.dtype = KVCAP_DTYPE_F32;
    p.seed = seed;
    p.p0_max = p0_max;
    assert_int_equal(kvcap_synth(&cfg->model, &p, dir, NULL, NULL), KVCAP_OK);
}

static void synth(const struct kvcap_calib_config *cfg, const char *dir, int spans,
                  uint64_t seed, int p0_max)
{
    synth_noisy(cfg, dir, spans, seed, p0_max, 0.0);
}

static void calibrate(const struct kvcap_calib_config *cfg, const char *const *dirs, int n,
                      struct kvcap_calib_state *s)
{
    struct kvcap_calibrate_options o;
    kvcap_calibrate_default_options(&o);
    o.data = dirs;
    o.n_data = n;
    struct kvcap_calibrate_report r;
    enum kvcap_status st = kvcap_calibrate(cfg, &o, s, &r);
    if (st != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
}

static void test_exact_recovery(void **state)
{
    (void)state;
    struct kvcap_calib_config cfg;
    load_config(&cfg, "closed_form", "linear", "0.3");
    char dir[512];
    tmpdir(dir, sizeof dir, "cal-exact");
    synth(&cfg, dir, 12, 7, 3000);
    const char *dirs[1] = {dir};
    struct kvcap_calib_state s;
    calibrate(&cfg, dirs, 1, &s);
    assert_true(s.val_spans[0] > 0 && s.train_spans[0] > 0);
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 2; h++) {
            const struct kvcap_calib_unit *u = kvcap_state_unit(&s, l, h, 0);
            /* explained variance is 1 at the true rank 5, and the 6th eigenvalue is noise */
            double top = 0, all = 0;
            for (int i = 0; i < u->m; i++) {
                all += u->v_eigval[i];
                top += i < 5 ? u->v_eigval[i] : 0;
            }
            assert_true(top / all > 1 - 1e-9);
            assert_true(u->v_eigval[5] < 1e-9 * u->v_eigval[0]);
            /* held-out spans: values and linear keys reconstruct exactly (float storage) */
            const double *m = u->metrics;
            if (!(m[KVCAP_METRIC_V_EXPLAINED] > 1 - 1e-8 && m[KVCAP_METRIC_V_REL] < EXACT_REL_TOL &&
                  m[KVCAP_METRIC_K_REL] < EXACT_REL_TOL && m[KVCAP_METRIC_ATTN_REL] < EXACT_REL_TOL &&
                  m[KVCAP_METRIC_ATTN_COS] > 1 - 1e-8))
                fail_msg("l%d.h%d: v_expl %.12f v_rel %g k_rel %g attn_rel %g attn_cos %.12f", l, h,
                         m[KVCAP_METRIC_V_EXPLAINED], m[KVCAP_METRIC_V_REL],
                         m[KVCAP_METRIC_K_REL], m[KVCAP_METRIC_ATTN_REL],
                         m[KVCAP_METRIC_ATTN_COS]);
            assert_int_equal(u->keys.rk, 8);
        }
    /* the state survives a write/read round trip */
    char path[600];
    snprintf(path, sizeof path, "%s/state.kvcs", dir);
    assert_int_equal(kvcap_calib_state_write(&s, path), KVCAP_OK);
    struct kvcap_calib_state back;
    assert_int_equal(kvcap_calib_state_read(path, &back), KVCAP_OK);
    const struct kvcap_calib_unit *a = kvcap_state_unit(&s, 1, 1, 1), *b = kvcap_state_unit(&back, 1, 1, 1);
    assert_memory_equal(a->v_gram, b->v_gram, sizeof(double) * (size_t)a->m * a->m);
    assert_memory_equal(a->keys.w2, b->keys.w2, sizeof(float) * (size_t)a->keys.h * a->m);
    assert_memory_equal(a->metrics, b->metrics, sizeof a->metrics);
    assert_int_equal(back.train_spans[1], s.train_spans[1]);
    kvcap_calib_state_free(&back);
    kvcap_calib_state_free(&s);
    kvcap_calib_config_free(&cfg);
    test_rm_tree(dir);
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

static void test_start_position_invariance(void **state)
{
    (void)state;
    struct kvcap_calib_config cfg;
    load_config(&cfg, "closed_form", "linear", "0");
    char d0[512], d1[512];
    tmpdir(d0, sizeof d0, "cal-p0a");
    tmpdir(d1, sizeof d1, "cal-p0b");
    /* Noisy (full-rank) data: with exact-rank data the mask picks beyond the rank are decided
     * by rounding, which is not a property of the data. */
    synth_noisy(&cfg, d0, 6, 11, 0, 0.05);    /* every span at p0 = 0 */
    synth_noisy(&cfg, d1, 6, 11, 5000, 0.05); /* the same spans at random p0 up to 5000 */
    struct kvcap_calib_state s0, s1;
    const char *a[1] = {d0}, *b[1] = {d1};
    calibrate(&cfg, a, 1, &s0);
    calibrate(&cfg, b, 1, &s1);
    for (int i = 0; i < 2 * 2 * 2; i++) {
        const struct kvcap_calib_unit *u = &s0.units[i], *v = &s1.units[i];
        size_t mm = (size_t)u->m * u->m;
        assert_true(rel_diff(u->k_gram, v->k_gram, mm) < P0_REL_TOL);
        assert_true(rel_diff(u->v_gram, v->v_gram, mm) < MERGE_REL_TOL);
        assert_memory_equal(u->keys.mask, v->keys.mask, sizeof(int32_t) * (size_t)u->keys.rk);
    }
    kvcap_calib_state_free(&s0);
    kvcap_calib_state_free(&s1);
    kvcap_calib_config_free(&cfg);
    test_rm_tree(d0);
    test_rm_tree(d1);
}

static void test_merge_equals_one_run(void **state)
{
    (void)state;
    struct kvcap_calib_config cfg;
    load_config(&cfg, "closed_form", "linear", "0.25");
    char da[512], db[512];
    tmpdir(da, sizeof da, "cal-ma");
    tmpdir(db, sizeof db, "cal-mb");
    synth(&cfg, da, 7, 21, 4000);
    synth(&cfg, db, 9, 22, 4000);
    struct kvcap_calib_state sa, sb, sab;
    const char *a[1] = {da}, *b[1] = {db}, *ab[2] = {da, db};
    calibrate(&cfg, a, 1, &sa);
    calibrate(&cfg, b, 1, &sb);
    calibrate(&cfg, ab, 2, &sab);
    assert_int_equal(kvcap_calib_state_merge(&sa, &sb, "b"), KVCAP_OK);
    for (int bk = 0; bk < 2; bk++) {
        assert_int_equal(sa.train_spans[bk], sab.train_spans[bk]);
        assert_int_equal(sa.val_spans[bk], sab.val_spans[bk]);
    }
    for (int i = 0; i < 8; i++) {
        size_t mm = (size_t)sa.units[i].m * sa.units[i].m;
        assert_true(rel_diff(sab.units[i].v_gram, sa.units[i].v_gram, mm) <= MERGE_REL_TOL);
        assert_true(rel_diff(sab.units[i].k_gram, sa.units[i].k_gram, mm) <= MERGE_REL_TOL);
    }
    /* through the files and kvcap_convert: two states -> one artifact */
    char pa[600], pb[600], out[600];
    snprintf(pa, sizeof pa, "%s/a.kvcs", da);
    snprintf(pb, sizeof pb, "%s/b.kvcs", db);
    snprintf(out, sizeof out, "%s/merged.kvcap", da);
    assert_int_equal(kvcap_calib_state_write(&sab, pa), KVCAP_OK); /* any valid state */
    assert_int_equal(kvcap_calib_state_write(&sb, pb), KVCAP_OK);
    struct kvcap_convert_options o;
    kvcap_convert_default_options(&o);
    const char *states[2] = {pa, pb};
    o.states = states;
    o.n_states = 2;
    o.out = out;
    struct kvcap_convert_report rep;
    if (kvcap_convert(&o, &rep) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_true(rep.keys_refit);
    assert_true(access(out, F_OK) == 0);
    /* the calibration-free value basis: each unit's R_v rows are orthonormal DCT vectors of
     * its grid; a dense grid's are none of them the constant (the span mean is stored apart), a
     * tile's start with it (the span mean is not the tile's) */
    o.dct_values = 1;
    snprintf(out, sizeof out, "%s/dct.kvcap", da);
    if (kvcap_convert(&o, &rep) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    struct kvcap_artifact *art = NULL;
    if (kvcap_artifact_open(out, &art) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    for (int l = 0; l < art->model.n_layers; l++)
        for (int bi = 0; bi < art->n_buckets; bi++) {
            const struct kvcap_unit_maps *u = kvcap_artifact_unit(art, l, 0, bi);
            const int tiled = art->buckets[bi].structure == KVCAP_STRUCTURE_TILED;
            assert_true(u->rv >= 1);
            for (int i = 0; i < u->rv; i++) {
                double sum = 0;
                for (int j = 0; j < u->m; j++)
                    sum += u->u[(size_t)i * u->m + j];
                if (tiled && i == 0) /* the constant, 1/√m at every point */
                    assert_true(fabs(sum - sqrt((double)u->m)) < DCT_TOL * u->m);
                else /* orthogonal to the constant */
                    assert_true(fabs(sum) < DCT_TOL);
                for (int k = 0; k <= i; k++) {
                    double dot = 0;
                    for (int j = 0; j < u->m; j++)
                        dot += (double)u->u[(size_t)i * u->m + j] * u->u[(size_t)k * u->m + j];
                    assert_true(fabs(dot - (i == k)) < DCT_TOL);
                }
            }
        }
    kvcap_artifact_free(art);
    /* a state of another model does not merge */
    struct kvcap_calib_state other;
    struct kvcap_calib_config cfg2 = cfg;
    cfg2.model.n_layers = 3;
    cfg2.schedule_keys.kind = cfg2.schedule_values.kind = KVCAP_SCHEDULE_UNIFORM;
    assert_int_equal(kvcap_calib_state_init(&other, &cfg2), KVCAP_OK);
    assert_int_equal(kvcap_calib_state_merge(&sab, &other, "other.kvcs"), KVCAP_ERR_GEOMETRY);
    assert_non_null(strstr(kvcap_last_error(), "model.layers"));
    kvcap_calib_state_free(&other);
    kvcap_calib_state_free(&sa);
    kvcap_calib_state_free(&sb);
    kvcap_calib_state_free(&sab);
    kvcap_calib_config_free(&cfg);
    test_rm_tree(da);
    test_rm_tree(db);
}

static void test_trained_never_worse(void **state)
{
    (void)state;
    char dir[512];
    tmpdir(dir, sizeof dir, "cal-train");
    struct kvcap_calib_config closed, trained;
    load_config(&closed, "closed_form", "linear", "0.3");
    load_config(&trained, "trained", "gelu", "0.3");
    /* noisy, outlier-laden data so the closed form is not already perfect */
    struct kvcap_synth_params p;
    kvcap_synth_default_params(&p);
    p.n_spans = 10;
    p.n_grids = 1;
    p.grid_rows[0] = p.grid_cols[0] = 8;
    p.rank_k = 12;
    p.noise = 0.05;
    p.dtype = KVCAP_DTYPE_F32;
    p.decode_queries = 2;
    assert_int_equal(kvcap_synth(&closed.model, &p, dir, NULL, NULL), KVCAP_OK);
    const char *dirs[1] = {dir};
    struct kvcap_calib_state sc, st;
    calibrate(&closed, dirs, 1, &sc);
    calibrate(&trained, dirs, 1, &st);
    assert_int_equal(st.activation, KVCAP_ACTIVATION_GELU);
    for (int i = 0; i < 8; i++) {
        double kc = sc.units[i].metrics[KVCAP_METRIC_K_REL];
        double kt = st.units[i].metrics[KVCAP_METRIC_K_REL];
        if (!(kt <= kc * (1 + 1e-4) + 1e-7))
            fail_msg("unit %d: trained k_rel %g worse than closed form %g", i, kt, kc);
    }
    /* Units train side by side, one per thread, each to the bits it would reach alone: one
     * thread gives the same maps as two. */
    const int threads = omp_get_max_threads();
    omp_set_num_threads(threads > 1 ? 1 : 2);
    struct kvcap_calib_state s1;
    calibrate(&trained, dirs, 1, &s1);
    omp_set_num_threads(threads);
    for (int i = 0; i < 8; i++) {
        const struct kvcap_key_maps *a = &st.units[i].keys, *b = &s1.units[i].keys;
        assert_int_equal(a->rk, b->rk);
        assert_int_equal(a->h, b->h);
        assert_memory_equal(a->mask, b->mask, sizeof *a->mask * (size_t)a->rk);
        assert_memory_equal(a->w1, b->w1, sizeof *a->w1 * (size_t)a->rk * a->h);
        assert_memory_equal(a->b1, b->b1, sizeof *a->b1 * (size_t)a->h);
        assert_memory_equal(a->w2, b->w2, sizeof *a->w2 * (size_t)a->h * a->m);
        assert_memory_equal(a->b2, b->b2, sizeof *a->b2 * (size_t)a->m);
    }
    kvcap_calib_state_free(&s1);
    kvcap_calib_state_free(&sc);
    kvcap_calib_state_free(&st);
    kvcap_calib_config_free(&closed);
    kvcap_calib_config_free(&trained);
    test_rm_tree(dir);
}

static void expect_failure(const struct kvcap_calib_config *cfg, const char *const *dirs, int n,
                           enum kvcap_status status, const char *needle)
{
    struct kvcap_calibrate_options o;
    kvcap_calibrate_default_options(&o);
    o.data = dirs;
    o.n_data = n;
    struct kvcap_calib_state s;
    struct kvcap_calibrate_report r;
    enum kvcap_status st = kvcap_calibrate(cfg, &o, &s, &r);
    if (st != status || !strstr(kvcap_last_error(), needle))
        fail_msg("status %s, message \"%s\"; expected %s naming \"%s\"", kvcap_status_str(st),
                 kvcap_last_error(), kvcap_status_str(status), needle);
}

static void test_bad_inputs_named(void **state)
{
    (void)state;
    struct kvcap_calib_config cfg;
    load_config(&cfg, "closed_form", "linear", "0.2");
    char dir[512];
    tmpdir(dir, sizeof dir, "cal-bad");
    const char *dirs[1] = {dir};
    /* empty dataset */
    expect_failure(&cfg, dirs, 1, KVCAP_ERR_INVALID_ARGUMENT, "empty");
    /* a grid that matches no bucket */
    struct kvcap_synth_params p;
    kvcap_synth_default_params(&p);
    p.n_spans = 2;
    p.n_grids = 1;
    p.grid_rows[0] = 5;
    p.grid_cols[0] = 7;
    p.rank_k = p.rank_v = 4;
    assert_int_equal(kvcap_synth(&cfg.model, &p, dir, NULL, NULL), KVCAP_OK);
    expect_failure(&cfg, dirs, 1, KVCAP_ERR_GEOMETRY, "5x7 grid (n = 35), which matches no bucket");
    test_rm_tree(dir);
    /* data recorded from another model */
    tmpdir(dir, sizeof dir, "cal-bad2");
    struct kvcap_model_geometry other = cfg.model;
    other.n_kv_heads = 1;
    other.n_q_heads = 2;
    p.grid_rows[0] = p.grid_cols[0] = 8;
    assert_int_equal(kvcap_synth(&other, &p, dir, NULL, NULL), KVCAP_OK);
    expect_failure(&cfg, dirs, 1, KVCAP_ERR_GEOMETRY, "model.q_heads");
    test_rm_tree(dir);
    /* NaN in the data */
    tmpdir(dir, sizeof dir, "cal-bad3");
    struct kvcap_dataset_writer_params wp;
    kvcap_dataset_writer_default_params(&wp);
    wp.dir = dir;
    wp.dtype = KVCAP_DTYPE_F32;
    struct kvcap_dataset_writer *w = NULL;
    assert_int_equal(kvcap_dataset_writer_create(&cfg.model, &wp, &w), KVCAP_OK);
    static float kv[2 * 64 * 64];
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        kv[i] = (float)((i * 7919) % 13) - 6.0f;
    assert_int_equal(kvcap_dataset_writer_begin_span(w, 8, 8, 3), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_set_kv(w, 0, kv, kv), KVCAP_OK);
    kv[64 * 64 + 5] = NAN; /* head 1, token 0, channel 5 of layer 1 */
    assert_int_equal(kvcap_dataset_writer_set_kv(w, 1, kv, kv), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_end_span(w), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_flush(w), KVCAP_OK);
    kvcap_dataset_writer_free(w);
    cfg.validation_fraction = 0;
    expect_failure(&cfg, dirs, 1, KVCAP_ERR_NUMERIC, "tensor 's0.l1.k': non-finite value");
    test_rm_tree(dir);
    /* a shard with a missing tensor (handcrafted: tests/data/schema) */
    struct kvcap_calib_config tiny;
    const char *tiny_yaml = "model: {name: tiny, layers: 2, q_heads: 2, kv_heads: 1, head_dim: 64,"
                            " rope: {type: rope, pairing: half, theta: 10000}}\n"
                            "buckets: [{rows: 2, cols: 2}]\n"
                            "schedule: {kind: uniform, ratio: 0.5}\n";
    assert_int_equal(kvcap_calib_config_load_string(tiny_yaml, "tiny.yaml", &tiny), KVCAP_OK);
    const char *bad[1] = {KVCAP_TEST_DATA "/schema/bad_missing_value.safetensors"};
    expect_failure(&tiny, bad, 1, KVCAP_ERR_FORMAT, "missing required tensor 's0.l1.v'");
    const char *bad_shape[1] = {KVCAP_TEST_DATA "/schema/bad_key_shape.safetensors"};
    expect_failure(&tiny, bad_shape, 1, KVCAP_ERR_FORMAT, "tensor 's0.l0.k': shape");
    kvcap_calib_config_free(&tiny);
    kvcap_calib_config_free(&cfg);
}

static void test_device_option(void **state)
{
    (void)state;
    struct kvcap_calibrate_options o;
    kvcap_calibrate_default_options(&o);
    assert_int_equal(o.device, KVCAP_CALIB_DEVICE_AUTO);
    static const char *const names[] = {"auto", "cpu", "cuda"};
    for (int i = 0; i < 3; i++) {
        enum kvcap_calib_device d;
        assert_true(kvcap_calib_device_parse(names[i], &d));
        assert_string_equal(kvcap_calib_device_name(d), names[i]);
    }
    enum kvcap_calib_device d = KVCAP_CALIB_DEVICE_CPU;
    assert_false(kvcap_calib_device_parse("gpu", &d));
    assert_false(kvcap_calib_device_parse("CUDA", &d));
    assert_int_equal(d, KVCAP_CALIB_DEVICE_CPU);
    int have_cuda = kvcap_calib_cuda_unavailable() == NULL;
    assert_int_equal(have_cuda, kvcap_calib_cuda_built() && kvcap_cuda_device_count() > 0);
    assert_int_equal(kvcap_calib_device_resolve(KVCAP_CALIB_DEVICE_AUTO, &d), KVCAP_OK);
    assert_int_equal(d, have_cuda ? KVCAP_CALIB_DEVICE_CUDA : KVCAP_CALIB_DEVICE_CPU);

    struct kvcap_calib_config cfg;
    load_config(&cfg, "closed_form", "linear", "0.25");
    char dir[512];
    tmpdir(dir, sizeof dir, "cal-device");
    synth_noisy(&cfg, dir, 6, 31, 100, 0.05);
    const char *dirs[1] = {dir};
    kvcap_calibrate_default_options(&o);
    o.data = dirs;
    o.n_data = 1;
    struct kvcap_calib_state s_cpu, s_auto;
    struct kvcap_calibrate_report r;
    o.device = KVCAP_CALIB_DEVICE_CPU;
    assert_int_equal(kvcap_calibrate(&cfg, &o, &s_cpu, &r), KVCAP_OK);
    assert_int_equal(r.device, KVCAP_CALIB_DEVICE_CPU);
    assert_int_equal(r.fit.values_device, KVCAP_CALIB_DEVICE_CPU);
    assert_string_equal(r.device_name, "");
    o.device = KVCAP_CALIB_DEVICE_AUTO;
    assert_int_equal(kvcap_calibrate(&cfg, &o, &s_auto, &r), KVCAP_OK);
    if (!have_cuda) {
        /* auto is the CPU here: the same computation, bit for bit */
        assert_int_equal(r.device, KVCAP_CALIB_DEVICE_CPU);
        for (int i = 0; i < 8; i++) {
            const struct kvcap_calib_unit *a = &s_cpu.units[i], *b = &s_auto.units[i];
            size_t mm = (size_t)a->m * a->m;
            assert_memory_equal(a->k_gram, b->k_gram, sizeof(double) * mm);
            assert_memory_equal(a->v_gram, b->v_gram, sizeof(double) * mm);
            assert_memory_equal(a->v_eigvec, b->v_eigvec, sizeof(float) * mm);
        }
        /* cuda without a device (or without CUDA in the build) is a named error */
        struct kvcap_calib_state s_cuda;
        o.device = KVCAP_CALIB_DEVICE_CUDA;
        assert_int_equal(kvcap_calibrate(&cfg, &o, &s_cuda, &r), KVCAP_ERR_UNSUPPORTED);
        assert_non_null(strstr(kvcap_last_error(), "device cuda: "));
        assert_int_equal(kvcap_calib_state_fit(&s_cpu, 1, KVCAP_CALIB_DEVICE_CUDA, NULL, NULL,
                                               NULL),
                         KVCAP_ERR_UNSUPPORTED);
    } else {
        assert_int_equal(r.device, KVCAP_CALIB_DEVICE_CUDA);
    }
    kvcap_calib_state_free(&s_cpu);
    kvcap_calib_state_free(&s_auto);
    kvcap_calib_config_free(&cfg);
    test_rm_tree(dir);
}

/* The CUDA path (calibrate/cuda/gram.cu) computes in column-major: it copies the first `cols`
 * columns of a row-major m x cap batch with pitch cols, runs DSYRK (lower, trans) on it, and
 * solves eigenproblems with SYEVD (lower) followed by a transpose. The same calls through
 * column-major CBLAS/LAPACKE (the semantics cuBLAS and cuSOLVER follow) must give what the
 * row-major CPU path gives: the same triangle, the same eigenpairs in the same places. */
#define LAYOUT_REL_TOL 1e-13 /* same sums in another order: double rounding only */

static void test_cuda_layout_contract(void **state)
{
    (void)state;
    enum { M = 23, CAP = 40, COLS = 33 };
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 77);
    static double batch[M * CAP], packed[M * COLS], c_cpu[M * M], c_dev[M * M], init[M * M];
    for (int i = 0; i < M * CAP; i++)
        batch[i] = kvcap_rng_normal(&rng);
    for (int i = 0; i < M * M; i++)
        init[i] = kvcap_rng_normal(&rng);
    memcpy(c_cpu, init, sizeof init);
    memcpy(c_dev, init, sizeof init);
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, M, COLS, 1.0, batch, CAP, 1.0, c_cpu, M);
    /* cudaMemcpy2DAsync(dst, dpitch = COLS, src, spitch = CAP, width = COLS, height = M) */
    for (int p = 0; p < M; p++)
        memcpy(packed + (size_t)p * COLS, batch + (size_t)p * CAP, sizeof(double) * COLS);
    /* cublasDsyrk(LOWER, OP_T, n = M, k = COLS, A = packed, lda = COLS, C, ldc = M) */
    cblas_dsyrk(CblasColMajor, CblasLower, CblasTrans, M, COLS, 1.0, packed, COLS, 1.0, c_dev, M);
    double scale = 0.0;
    for (int i = 0; i < M * M; i++)
        scale = fmax(scale, fabs(c_cpu[i]));
    for (int i = 0; i < M; i++)
        for (int j = 0; j < M; j++) {
            size_t at = (size_t)i * M + j;
            if (j >= i) /* the accumulated triangle */
                assert_true(fabs(c_cpu[at] - c_dev[at]) <= LAYOUT_REL_TOL * scale);
            else /* the other one is left as it was on both paths */
                assert_true(c_cpu[at] == init[at] && c_dev[at] == init[at]);
        }

    /* eigen: kvcap_dsyevd vs cusolverDnXsyevd(LOWER) + cublasDgeam(OP_T) */
    static double g[M * M], a_cpu[M * M], a_dev[M * M], t[M * M], w_cpu[M], w_dev[M];
    for (int i = 0; i < M; i++)
        for (int j = 0; j < M; j++)
            g[(size_t)i * M + j] = c_cpu[(size_t)(i < j ? i : j) * M + (i < j ? j : i)];
    memcpy(a_cpu, g, sizeof g);
    memcpy(a_dev, g, sizeof g);
    assert_int_equal(kvcap_dsyevd(M, a_cpu, w_cpu), KVCAP_OK);
    assert_int_equal(LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'V', 'L', M, a_dev, M, w_dev), 0);
    for (int r = 0; r < M; r++) /* column-major t = a_devᵀ: t(r, c) = a_dev(c, r) */
        for (int c = 0; c < M; c++)
            t[(size_t)c * M + r] = a_dev[(size_t)r * M + c];
    /* both in the kvcap_dsyevd contract now: compare eigenvalues, and check each column of t
     * is an eigenvector of g for its eigenvalue (vectors themselves may differ in sign) */
    double wmax = fmax(fabs(w_cpu[0]), fabs(w_cpu[M - 1]));
    for (int j = 0; j < M; j++) {
        assert_true(fabs(w_cpu[j] - w_dev[j]) <= 1e-12 * wmax);
        double res = 0.0, dot = 0.0;
        for (int i = 0; i < M; i++) {
            double gv = 0.0;
            for (int k = 0; k < M; k++)
                gv += g[(size_t)i * M + k] * t[(size_t)k * M + j];
            res = fmax(res, fabs(gv - w_dev[j] * t[(size_t)i * M + j]));
            dot += t[(size_t)i * M + j] * a_cpu[(size_t)i * M + j];
        }
        assert_true(res <= 1e-12 * wmax);
        assert_true(fabs(fabs(dot) - 1.0) <= 1e-10); /* distinct eigenvalues: same line */
    }
}

/* ---- Rounding-level perturbations of the Grams ---------------------------------------------- */

/* Fidelity may move by at most this much (relative) when the Grams move by rounding: the same
 * data recorded or accumulated on another machine must calibrate to the same quality. */
#define ROUNDING_FIDELITY_TOL 0.02

/* Held-out relative key error ‖(I − W P_M) X‖² / ‖X‖² of maps k, from the held-out Gram c. */
static double heldout_key_error(const struct kvcap_key_maps *k, const double *c)
{
    int m = k->m;
    double *b = calloc((size_t)m * m, sizeof *b), err = 0.0, tr = 0.0;
    assert_non_null(b);
    for (int i = 0; i < m; i++) {
        b[(size_t)i * m + i] = 1.0;
        for (int r = 0; r < k->rk; r++) {
            double w = 0.0;
            for (int a = 0; a < k->h; a++)
                w += (double)k->w2[(size_t)a * m + i] * k->w1[(size_t)r * k->h + a];
            b[(size_t)i * m + k->mask[r]] -= w;
        }
    }
    for (int i = 0; i < m; i++) {
        tr += c[(size_t)i * m + i];
        for (int j = 0; j < m; j++) {
            double t = 0.0;
            for (int l = 0; l < m; l++)
                t += c[(size_t)j * m + l] * b[(size_t)i * m + l];
            err += b[(size_t)i * m + j] * t;
        }
    }
    free(b);
    return err / tr;
}

/* Share of the held-out energy tr(U c Uᵀ)/tr(c) kept by the top-rv value basis of gram g. */
static double heldout_value_energy(const double *g, const double *c, int m, int rv)
{
    double *w = malloc(sizeof(double) * (size_t)m);
    float *u = malloc(sizeof(float) * (size_t)m * m);
    assert_non_null(w);
    assert_non_null(u);
    assert_int_equal(kvcap_values_fit(g, m, w, u), KVCAP_OK);
    double kept = 0.0, tr = 0.0;
    for (int i = 0; i < m; i++)
        tr += c[(size_t)i * m + i];
    for (int r = 0; r < rv; r++)
        for (int i = 0; i < m; i++)
            for (int j = 0; j < m; j++)
                kept += (double)u[(size_t)r * m + i] * c[(size_t)i * m + j] * u[(size_t)r * m + j];
    free(w), free(u);
    return kept / tr;
}

/* g' = g ∘ (1 + eps·u), u uniform in [-1, 1), symmetric: rounding of the Gram's entries. */
static void perturb_gram(const double *g, double *out, int m, double eps, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < m; i++)
        for (int j = i; j < m; j++) {
            double u = (double)(kvcap_splitmix64(&x) >> 11) * 0x1.0p-52 - 1.0;
            out[(size_t)i * m + j] = out[(size_t)j * m + i] = g[(size_t)i * m + j] * (1.0 + eps * u);
        }
}

/* A 16-point tile of stationary keys (the 1x16 text tiles of the SmolLM2 demo: every position
 * alike): a shared mean direction, correlation decaying with distance, a little noise. As the
 * population Gram (`sampled` 0) the diagonal is an exact tie, the case where the greedy rule
 * used to let rounding pick the first pivot and the held-out error moved by ±4 %; sampled in
 * float from an AR(1) sequence (`sampled` 1, train and held-out halves) it is the realistic case
 * of near-ties at the statistical level. */
static void stationary_tile_grams(int m, int sampled, double *train, double *heldout)
{
    const double mean = 1.0, rho = 0.9, noise = 0.01;
    if (!sampled) {
        for (int i = 0; i < m; i++)
            for (int j = 0; j < m; j++)
                train[(size_t)i * m + j] = heldout[(size_t)i * m + j] =
                    mean + pow(rho, abs(i - j)) + (i == j ? noise : 0.0);
        return;
    }
    enum { COLS = 4096 };
    float *x = malloc(sizeof(float) * (size_t)m * COLS);
    assert_non_null(x);
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 11);
    for (int half = 0; half < 2; half++) {
        double *g = half ? heldout : train;
        for (int c = 0; c < COLS; c++) {
            double a = kvcap_rng_normal(&rng) * sqrt(mean), s = kvcap_rng_normal(&rng);
            for (int i = 0; i < m; i++) {
                if (i > 0)
                    s = rho * s + sqrt(1 - rho * rho) * kvcap_rng_normal(&rng);
                x[(size_t)i * COLS + c] =
                    (float)(a + s + sqrt(noise) * kvcap_rng_normal(&rng));
            }
        }
        for (int i = 0; i < m; i++)
            for (int j = 0; j < m; j++) {
                double t = 0.0;
                for (int c = 0; c < COLS; c++)
                    t += (double)x[(size_t)i * COLS + c] * x[(size_t)j * COLS + c];
                g[(size_t)i * m + j] = t;
            }
    }
    free(x);
}

static void test_fit_robust_to_rounding(void **state)
{
    (void)state;
    enum { M = 16, RK = 6, SEEDS = 6 };
    /* relative 1e-7: float-origin data (K/V recorded on another machine's kernels);
     * 1e-15: double rounding (another BLAS's dsyrk summing the Gram in another order) */
    const double eps[] = {1e-7, 1e-15};
    const int widths[] = {RK, 3}; /* h = rk, and the rank-h truncation */
    double *train = malloc(sizeof(double) * M * M), *heldout = malloc(sizeof(double) * M * M);
    double *g = malloc(sizeof(double) * M * M);
    assert_non_null(train);
    assert_non_null(heldout);
    assert_non_null(g);
    for (int sampled = 0; sampled < 2; sampled++) {
        stationary_tile_grams(M, sampled, train, heldout);
        double v0 = heldout_value_energy(train, heldout, M, RK);
        for (size_t wi = 0; wi < sizeof widths / sizeof *widths; wi++) {
            struct kvcap_key_maps k0;
            assert_int_equal(kvcap_keys_closed_form(train, M, RK, widths[wi], 1e-3, &k0), KVCAP_OK);
            double e0 = heldout_key_error(&k0, heldout);
            assert_true(e0 > 0 && e0 < 0.5);
            for (size_t ei = 0; ei < sizeof eps / sizeof *eps; ei++)
                for (int seed = 1; seed <= SEEDS; seed++) {
                    perturb_gram(train, g, M, eps[ei], (uint64_t)seed);
                    struct kvcap_key_maps k1;
                    assert_int_equal(kvcap_keys_closed_form(g, M, RK, widths[wi], 1e-3, &k1),
                                     KVCAP_OK);
                    double e1 = heldout_key_error(&k1, heldout);
                    if (fabs(e1 - e0) > ROUNDING_FIDELITY_TOL * e0)
                        print_message("%s Gram, h %d, eps %g, seed %d: held-out key error "
                                      "%.5f -> %.5f\n",
                                      sampled ? "sampled" : "population", widths[wi], eps[ei],
                                      seed, e0, e1);
                    assert_true(fabs(e1 - e0) <= ROUNDING_FIDELITY_TOL * e0);
                    kvcap_key_maps_free(&k1);
                    if (wi == 0) {
                        double v1 = heldout_value_energy(g, heldout, M, RK);
                        assert_true(fabs(v1 - v0) <= ROUNDING_FIDELITY_TOL * v0);
                    }
                }
            kvcap_key_maps_free(&k0);
        }
    }
    free(train), free(heldout), free(g);
}

/* Grams no data can produce, as a hostile state file may hold them (kvcap-convert refits
 * what it reads): a negative diagonal, whose negative trace made the tie band negative and left
 * the greedy selection without a pick (it then wrote before its arrays), and sums so large that
 * the trace and the residual overflow. The closed form answers with a status and any mask it
 * returns is valid. */
static void test_closed_form_not_a_gram(void **state)
{
    (void)state;
    enum { M = 4, RK = 2, CASES = 3 };
    double g[CASES][M * M];
    for (int c = 0; c < CASES; c++)
        for (int i = 0; i < M * M; i++)
            g[c][i] = i % (M + 1) == 0 ? 2.0 : 0.5;
    g[0][1 * M + 1] = -6.8e38; /* one negative diagonal entry */
    for (int i = 0; i < M; i++)
        g[1][i * M + i] = -1.0; /* all of them */
    for (int i = 0; i < M * M; i++)
        g[2][i] = 1e300; /* the trace overflows to inf */
    for (int c = 0; c < CASES; c++) {
        struct kvcap_key_maps k;
        memset(&k, 0, sizeof k);
        enum kvcap_status st = kvcap_keys_closed_form(g[c], M, RK, RK, 1e-3, &k);
        assert_true(st == KVCAP_OK || st == KVCAP_ERR_NUMERIC);
        for (int i = 0; st == KVCAP_OK && i < RK; i++)
            assert_true(k.mask[i] >= 0 && k.mask[i] < M && (i == 0 || k.mask[i] > k.mask[i - 1]));
        kvcap_key_maps_free(&k);
    }
}

/* Every point kept (rk = m, retention 1): the mask is all points in order and the keys come
 * back exactly. The greedy picks come in selection order, which must not leak out. */
static void test_closed_form_keeps_everything(void **state)
{
    (void)state;
    enum { M = 6, N = 40 };
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 5);
    double x[N * M], g[M * M] = {0};
    for (int i = 0; i < N * M; i++)
        x[i] = kvcap_rng_normal(&r) * (1.0 + (i % M)); /* unequal energies: picks out of order */
    for (int n = 0; n < N; n++)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < M; j++)
                g[i * M + j] += x[n * M + i] * x[n * M + j];
    struct kvcap_key_maps k;
    memset(&k, 0, sizeof k);
    assert_int_equal(kvcap_keys_closed_form(g, M, M, M, 1e-9, &k), KVCAP_OK);
    for (int i = 0; i < M; i++)
        assert_int_equal(k.mask[i], i);
    kvcap_key_maps_free(&k);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exact_recovery),
        cmocka_unit_test(test_start_position_invariance),
        cmocka_unit_test(test_merge_equals_one_run),
        cmocka_unit_test(test_trained_never_worse),
        cmocka_unit_test(test_bad_inputs_named),
        cmocka_unit_test(test_device_option),
        cmocka_unit_test(test_cuda_layout_contract),
        cmocka_unit_test(test_fit_robust_to_rounding),
        cmocka_unit_test(test_closed_form_not_a_gram),
        cmocka_unit_test(test_closed_form_keeps_everything),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
