/* test_capsule_prefill.c — KVCapsule's prefill (kernels/capsule_prefill.h): the fast form (an
 * sgemm per tile, RoPE once per call) against the double oracle on random spans — dense and
 * tiled buckets, RoPE off, either pairing, a partial rotary dimension and M-RoPE, offsets from
 * 0 to 4000, GELU and linear φ, every storage dtype — and named errors that write nothing. Then
 * the reconstruction error per tile (kvcap's exact tiles): fast against the oracle, exactly 0
 * where the maps reconstruct a tile exactly, and the value a planted outlier token must give.
 * Last, kvzip's value basis fitted to the kept tokens alone. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/capsule_prefill.h"
#include "common/dtype.h"
#include "common/internal.h"
#include "common/rng.h"
#include "tests/test_numeric.h"
#include "tests/test_status.h"

/* ‖fast − ref‖ / ‖ref‖ per output tensor. F32: the fast sums run in f32 over at most m = 64
 * terms of size ~1 (a few ulps × sqrt(terms), ~1e-6) after a rotation whose f32 angles cost
 * ~1e-6 relative at positions up to ~5000 (tests/test_rope.c), and GELU of an argument off by
 * that much moves by as much. F16 and BF16 store the results: where the two f32 values
 * straddle a rounding boundary they land one storage ulp apart (2^-10 and 2^-7 relative), a
 * bound the norm-wise error cannot exceed. */
#define PREFILL_F32_TOL 1e-5
#define PREFILL_F16_TOL 1e-3
#define PREFILL_BF16_TOL 8e-3
/* Tile errors, fast vs oracle, relative: K̂ and V̂ come from f32 sgemms over h, rv <= 16 terms
 * of size ~1 (~1e-6 relative each), and an error is a sum of squared differences of size ~1,
 * so it moves by about twice that; 1e-4 leaves a wide margin and still fails a wrong index. */
#define TILE_ERROR_TOL 1e-4

static struct kvcap_model_geometry geometry(enum kvcap_rope_type type,
                                            enum kvcap_rope_pairing pairing, int d, int rope_dim)
{
    struct kvcap_model_geometry g = {.name = "prefill", .n_layers = 1, .n_q_heads = 2,
                                     .n_kv_heads = 1, .head_dim = d, .rope_type = type,
                                     .rope_pairing = pairing, .rope_theta = 10000.0,
                                     .rope_dim = rope_dim};
    if (type == KVCAP_ROPE_MROPE) {
        g.n_rope_sections = 3;
        g.rope_sections[0] = d / 8, g.rope_sections[1] = d / 8;
        g.rope_sections[2] = d / 2 - d / 4;
    }
    return g;
}

struct maps {
    struct kvcap_capsule_prefill_maps m;
    int32_t *mask;
    float *w1, *b1, *u;
};

/* Random maps: rk distinct mask points, W1 and U scaled so outputs stay ~1. */
static struct maps maps_new(struct kvcap_rng *r, int m, int rk, int h, int rv, int gelu)
{
    struct maps s;
    s.mask = malloc(sizeof(int32_t) * (size_t)rk);
    s.w1 = alloc_f((size_t)rk * h);
    s.b1 = alloc_f((size_t)h);
    s.u = alloc_f((size_t)rv * m);
    int *perm = malloc(sizeof(int) * (size_t)m);
    for (int p = 0; p < m; p++)
        perm[p] = p;
    for (int p = m - 1; p > 0; p--) {
        int q = (int)kvcap_rng_below(r, (uint64_t)p + 1), t = perm[p];
        perm[p] = perm[q], perm[q] = t;
    }
    for (int i = 0; i < rk; i++)
        s.mask[i] = perm[i];
    free(perm);
    fill_random(r, s.w1, (size_t)rk * h, 0.0, 1.0 / sqrt((double)rk));
    fill_random(r, s.b1, (size_t)h, 0.0, 0.3);
    fill_random(r, s.u, (size_t)rv * m, 0.0, 1.0 / sqrt((double)m));
    s.m = (struct kvcap_capsule_prefill_maps){m, rk, h, rv, gelu, s.mask, s.w1, s.b1, s.u};
    return s;
}

static void maps_free(struct maps *s)
{
    free(s->mask), free(s->w1), free(s->b1), free(s->u);
}

static void compare(enum kvcap_dtype dt, const void *got, const void *want, size_t n,
                    const char *what)
{
    float *a = alloc_f(n), *b = alloc_f(n);
    expect_ok(kvcap_convert_to_f32(dt, got, n, a));
    expect_ok(kvcap_convert_to_f32(dt, want, n, b));
    double tol = dt == KVCAP_DTYPE_F32 ? PREFILL_F32_TOL
                 : dt == KVCAP_DTYPE_F16 ? PREFILL_F16_TOL
                                         : PREFILL_BF16_TOL;
    assert_close(a, b, n, tol, what);
    free(a), free(b);
}

struct shape {
    int rows, cols, tile_rows, tile_cols; /* tile 0 x 0: dense */
    int d, rk, h, rv;
};

static void run_case(struct kvcap_rng *r, const struct shape *sh,
                     const struct kvcap_model_geometry *g, int64_t p0, int gelu,
                     enum kvcap_dtype dt)
{
    struct kvcap_bucket b = {sh->rows, sh->cols,
                             sh->tile_rows ? KVCAP_STRUCTURE_TILED : KVCAP_STRUCTURE_DENSE,
                             sh->tile_rows, sh->tile_cols};
    const int n = sh->rows * sh->cols, d = sh->d;
    const int m = sh->tile_rows ? sh->tile_rows * sh->tile_cols : n, tiles = n / m;
    struct maps mp = maps_new(r, m, sh->rk, sh->h, sh->rv, gelu);
    float *k = alloc_f((size_t)n * d), *v = alloc_f((size_t)n * d), *kw = alloc_f((size_t)n * d);
    fill_random(r, k, (size_t)n * d, 0.0, 1.0);
    fill_random(r, v, (size_t)n * d, 0.5, 1.0); /* a non-zero mean: μ matters */
    memcpy(kw, k, sizeof(float) * (size_t)n * d);
    size_t es = kvcap_dtype_size(dt);
    size_t nh = (size_t)tiles * sh->h * d, nv = (size_t)tiles * sh->rv * d;
    unsigned char *hs[2], *vt[2], *mu[2];
    for (int i = 0; i < 2; i++) {
        hs[i] = malloc(nh * es), vt[i] = malloc(nv * es), mu[i] = malloc((size_t)d * es);
    }
    size_t ns = kvcap_capsule_prefill_scratch_floats(&mp.m, d);
    float *scratch = alloc_f(ns);
    expect_ok(kvcap_capsule_prefill_ref(g, &b, &mp.m, n, d, p0, k, v, dt, hs[0], vt[0], mu[0]));
    expect_ok(kvcap_capsule_prefill(g, &b, &mp.m, n, d, p0, kw, v, dt, hs[1], vt[1], mu[1],
                                    scratch));
    char what[160];
    snprintf(what, sizeof what, "%dx%d tile %dx%d, d %d, rope %d/%d, p0 %lld, gelu %d, %s",
             sh->rows, sh->cols, sh->tile_rows, sh->tile_cols, d, (int)g->rope_type,
             (int)g->rope_pairing, (long long)p0, gelu, kvcap_dtype_name(dt));
    compare(dt, hs[1], hs[0], nh, what);
    compare(dt, vt[1], vt[0], nv, what);
    compare(dt, mu[1], mu[0], (size_t)d, what);
    for (int i = 0; i < 2; i++)
        free(hs[i]), free(vt[i]), free(mu[i]);
    free(k), free(v), free(kw), free(scratch);
    maps_free(&mp);
}

static void test_fast_matches_ref(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 31);
    static const struct shape shapes[] = {
        {4, 6, 0, 0, 32, 6, 5, 4},     /* dense: one tile of 24 points */
        {8, 8, 4, 4, 64, 6, 6, 6},     /* tiled 4x4: 4 tiles of 16 points */
        {6, 4, 2, 2, 24, 2, 3, 1},     /* tiny tiles, h > rk */
        {8, 8, 0, 0, 16, 16, 16, 16},  /* dense 64 points, every map as wide as allowed */
    };
    static const enum kvcap_dtype dts[] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16, KVCAP_DTYPE_BF16};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int d = shapes[s].d;
        const struct kvcap_model_geometry gs[] = {
            geometry(KVCAP_ROPE_NONE, KVCAP_ROPE_PAIRING_HALF, d, 0),
            geometry(KVCAP_ROPE_ROPE, KVCAP_ROPE_PAIRING_HALF, d, 0),
            geometry(KVCAP_ROPE_ROPE, KVCAP_ROPE_PAIRING_ADJACENT, d, d / 2), /* partial */
            geometry(KVCAP_ROPE_MROPE, KVCAP_ROPE_PAIRING_HALF, d, 0),
        };
        for (size_t gi = 0; gi < sizeof gs / sizeof gs[0]; gi++)
            for (size_t t = 0; t < 3; t++) {
                static const int64_t p0s[] = {0, 37, 4000};
                run_case(&r, &shapes[s], &gs[gi], p0s[(gi + t) % 3], (int)((s + t) % 2),
                         dts[t]);
            }
    }
}

/* Bad arguments are named and nothing is written. */
static void test_errors(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 5);
    struct kvcap_model_geometry g = geometry(KVCAP_ROPE_ROPE, KVCAP_ROPE_PAIRING_HALF, 8, 0);
    struct kvcap_bucket b = {4, 4, KVCAP_STRUCTURE_TILED, 2, 2};
    struct maps mp = maps_new(&r, 4, 2, 3, 2, 1);
    float k[16 * 8], v[16 * 8], out[64], scratch[128];
    fill_random(&r, k, 16 * 8, 0, 1);
    fill_random(&r, v, 16 * 8, 0, 1);
    for (int i = 0; i < 64; i++)
        out[i] = NAN;
    struct kvcap_capsule_prefill_maps bad = mp.m;
    expect_error(kvcap_capsule_prefill_ref(&g, &b, &mp.m, 15, 8, 0, k, v, KVCAP_DTYPE_F32, out,
                                           out, out),
                 KVCAP_ERR_INVALID_ARGUMENT, "15 tokens", "4x4 grid");
    bad.m = 16;
    expect_error(kvcap_capsule_prefill(&g, &b, &bad, 16, 8, 0, k, v, KVCAP_DTYPE_F32, out, out,
                                       out, scratch),
                 KVCAP_ERR_INVALID_ARGUMENT, "maps of 16 points", "tiles of 4");
    int32_t far[2] = {1, 4};
    bad = mp.m;
    bad.mask = far;
    expect_error(kvcap_capsule_prefill_ref(&g, &b, &bad, 16, 8, 0, k, v, KVCAP_DTYPE_F16, out,
                                           out, out),
                 KVCAP_ERR_INVALID_ARGUMENT, "mask[1] = 4", NULL);
    expect_error(kvcap_capsule_prefill(&g, &b, &mp.m, 16, 8, 0, k, v, KVCAP_DTYPE_F64, out, out,
                                       out, scratch),
                 KVCAP_ERR_INVALID_ARGUMENT, "F64", NULL);
    expect_error(kvcap_capsule_prefill(&g, &b, &mp.m, 16, 8, 0, k, v, KVCAP_DTYPE_F32, out, out,
                                       out, NULL),
                 KVCAP_ERR_INVALID_ARGUMENT, "scratch", NULL);
    expect_error(kvcap_capsule_prefill_ref(&g, &b, NULL, 16, 8, 0, k, v, KVCAP_DTYPE_F32, out,
                                           out, out),
                 KVCAP_ERR_INVALID_ARGUMENT, "NULL", NULL);
    for (int i = 0; i < 64; i++)
        assert_true(isnan(out[i]));
    maps_free(&mp);
}

/* Random decode maps and state of one head: W2 [h][m], b2 [m], U [rv][m], H, Ṽ, μ. */
struct state {
    struct kvcap_capsule_maps m;
    float *w2, *b2, *u, *hs, *vt, *mu;
};

static struct state state_new(struct kvcap_rng *r, int m, int h, int rv, int tiles, int d)
{
    struct state s;
    s.w2 = alloc_f((size_t)h * m), s.b2 = alloc_f((size_t)m), s.u = alloc_f((size_t)rv * m);
    s.hs = alloc_f((size_t)tiles * h * d), s.vt = alloc_f((size_t)tiles * rv * d);
    s.mu = alloc_f((size_t)d);
    fill_random(r, s.w2, (size_t)h * m, 0.0, 1.0 / sqrt((double)h));
    fill_random(r, s.b2, (size_t)m, 0.0, 0.3);
    fill_random(r, s.u, (size_t)rv * m, 0.0, 1.0 / sqrt((double)m));
    fill_random(r, s.hs, (size_t)tiles * h * d, 0.0, 1.0);
    fill_random(r, s.vt, (size_t)tiles * rv * d, 0.0, 1.0);
    fill_random(r, s.mu, (size_t)d, 0.5, 0.2);
    s.m = (struct kvcap_capsule_maps){m, h, rv, s.w2, s.b2, s.u};
    return s;
}

static void state_free(struct state *s)
{
    free(s->w2), free(s->b2), free(s->u), free(s->hs), free(s->vt), free(s->mu);
}

/* The per-point sums kvcap_capsule_tile_error_points takes (the device computes them), naively
 * from the same inputs: points [n][4] of ‖k'‖², ‖v − μ‖², ‖k̂' − k'‖², ‖v̂ − v‖². */
static void point_sums(const struct kvcap_bucket *b, const struct kvcap_capsule_maps *mp, int n,
                       int d, const float *kr, const float *v, const float *hs, const float *vt,
                       const float *mu, double *points)
{
    const int m = mp->m, tiles = n / m;
    for (int t = 0; t < tiles; t++)
        for (int p = 0; p < m; p++) {
            size_t j = kvcap_bucket_token(b, t, p);
            double *x = points + 4 * ((size_t)t * m + p);
            x[0] = x[1] = x[2] = x[3] = 0;
            for (int c = 0; c < d; c++) {
                double kh = mp->b2[p], vh = mu[c];
                for (int a = 0; a < mp->h; a++)
                    kh += (double)mp->w2[(size_t)a * m + p] * hs[((size_t)t * mp->h + a) * d + c];
                for (int r = 0; r < mp->rv; r++)
                    vh += (double)mp->u[(size_t)r * m + p] * vt[((size_t)t * mp->rv + r) * d + c];
                double k = kr[j * d + c], x_v = v[j * d + c];
                x[0] += k * k;
                x[1] += (x_v - mu[c]) * (x_v - mu[c]);
                x[2] += (kh - k) * (kh - k);
                x[3] += (vh - x_v) * (vh - x_v);
            }
        }
}

static void test_tile_error_fast_matches_ref(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 41);
    static const struct shape shapes[] = {
        {8, 8, 4, 4, 64, 0, 6, 6},   /* tiled 4x4: 4 tiles of 16 points */
        {1, 48, 1, 16, 32, 0, 3, 5}, /* a text-like row of 3 tiles */
        {4, 6, 0, 0, 16, 0, 7, 9},   /* dense: one tile of 24 points */
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const struct shape *sh = &shapes[i];
        struct kvcap_bucket b = {sh->rows, sh->cols,
                                 sh->tile_rows ? KVCAP_STRUCTURE_TILED : KVCAP_STRUCTURE_DENSE,
                                 sh->tile_rows, sh->tile_cols};
        const int n = sh->rows * sh->cols, d = sh->d;
        const int m = sh->tile_rows ? sh->tile_rows * sh->tile_cols : n, tiles = n / m;
        struct state st = state_new(&r, m, sh->h, sh->rv, tiles, d);
        float *k = alloc_f((size_t)n * d), *v = alloc_f((size_t)n * d);
        fill_random(&r, k, (size_t)n * d, 0.0, 1.0);
        fill_random(&r, v, (size_t)n * d, 0.5, 1.0);
        float *want = alloc_f((size_t)tiles), *got = alloc_f((size_t)tiles);
        float *scratch = alloc_f(kvcap_capsule_tile_error_scratch_floats(&st.m, d));
        expect_ok(kvcap_capsule_tile_error_ref(&b, &st.m, n, d, k, v, st.hs, st.vt, st.mu, want));
        expect_ok(kvcap_capsule_tile_error(&b, &st.m, n, d, k, v, st.hs, st.vt, st.mu, got,
                                           scratch));
        /* and from per-point sums, as the device store makes them */
        double *points = malloc(sizeof(double) * 4 * (size_t)n);
        float *from_points = alloc_f((size_t)tiles);
        assert_non_null(points);
        point_sums(&b, &st.m, n, d, k, v, st.hs, st.vt, st.mu, points);
        kvcap_capsule_tile_error_points(points, tiles, m, from_points);
        for (int t = 0; t < tiles; t++) {
            if (!(want[t] > 0))
                fail_msg("shape %zu, tile %d: error %g of random maps", i, t, (double)want[t]);
            if (!(fabs(got[t] - want[t]) <= TILE_ERROR_TOL * want[t]))
                fail_msg("shape %zu, tile %d: fast %.9g, oracle %.9g", i, t, (double)got[t],
                         (double)want[t]);
            if (!(fabs(from_points[t] - want[t]) <= TILE_ERROR_TOL * want[t]))
                fail_msg("shape %zu, tile %d: from point sums %.9g, oracle %.9g", i, t,
                         (double)from_points[t], (double)want[t]);
        }
        free(k), free(v), free(want), free(got), free(scratch), free(points), free(from_points);
        state_free(&st);
    }
}

/* Maps that reconstruct every tile exactly (W2 = I on H = K', U = I on Ṽ = V − μ) give 0; a
 * token moved by δ in its key and ε in its value gives its tile ‖δ‖²/k2 + ‖ε‖²/v2 and leaves
 * every other tile at 0, k2 and v2 being the span's mean ‖k'‖² and ‖v − μ‖². */
static void test_tile_error_finds_outlier(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 43);
    enum { ROWS = 8, COLS = 8, M = 16, N = ROWS * COLS, T = N / M, D = 8 };
    struct kvcap_bucket b = {ROWS, COLS, KVCAP_STRUCTURE_TILED, 4, 4};
    float w2[M * M] = {0}, b2[M] = {0}, u[M * M] = {0};
    for (int p = 0; p < M; p++)
        w2[p * M + p] = u[p * M + p] = 1.0f;
    struct kvcap_capsule_maps maps = {M, M, M, w2, b2, u};
    static float k[N * D], v[N * D], hs[T * M * D], vt[T * M * D], mu[D];
    fill_random(&r, k, N * D, 0.0, 1.0);
    fill_random(&r, v, N * D, 0.5, 1.0);
    for (int c = 0; c < D; c++) {
        double s = 0;
        for (int j = 0; j < N; j++)
            s += v[j * D + c];
        mu[c] = (float)(s / N);
    }
    for (int t = 0; t < T; t++)
        for (int p = 0; p < M; p++) {
            size_t j = kvcap_bucket_token(&b, t, p);
            for (int c = 0; c < D; c++) {
                hs[(t * M + p) * D + c] = k[j * D + c];
                vt[(t * M + p) * D + c] = v[j * D + c] - mu[c];
            }
        }
    float err[T], scratch[2 * M * D];
    expect_ok(kvcap_capsule_tile_error(&b, &maps, N, D, k, v, hs, vt, mu, err, scratch));
    for (int t = 0; t < T; t++)
        if (!(err[t] < 1e-10f))
            fail_msg("exact maps: tile %d has error %g", t, (double)err[t]);
    /* the true key and value of point 5 of tile 2 move; the state stays as it was */
    size_t j = kvcap_bucket_token(&b, 2, 5);
    double dk = 0, dv = 0, k2 = 0, v2 = 0;
    for (int c = 0; c < D; c++) {
        float a = 0.5f * (float)(c + 1), e = c % 2 ? -1.0f : 2.0f;
        k[j * D + c] += a, v[j * D + c] += e;
        dk += (double)a * a, dv += (double)e * e;
    }
    for (int i = 0; i < N * D; i++) {
        k2 += (double)k[i] * k[i];
        v2 += ((double)v[i] - mu[i % D]) * ((double)v[i] - mu[i % D]);
    }
    double want = dk / (k2 / N) + dv / (v2 / N);
    float ref[T];
    expect_ok(kvcap_capsule_tile_error(&b, &maps, N, D, k, v, hs, vt, mu, err, scratch));
    expect_ok(kvcap_capsule_tile_error_ref(&b, &maps, N, D, k, v, hs, vt, mu, ref));
    for (int t = 0; t < T; t++) {
        double w = t == 2 ? want : 0.0;
        if (!(fabs(err[t] - w) <= TILE_ERROR_TOL * want && fabs(ref[t] - w) <= 1e-6 * want))
            fail_msg("tile %d: fast %g, oracle %g, expected %g", t, (double)err[t],
                     (double)ref[t], w);
    }
}

static void test_tile_error_errors(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 47);
    struct kvcap_bucket b = {4, 4, KVCAP_STRUCTURE_TILED, 2, 2};
    struct state st = state_new(&r, 4, 2, 2, 4, 8);
    float k[16 * 8], v[16 * 8], err[4] = {NAN, NAN, NAN, NAN}, scratch[64];
    fill_random(&r, k, 16 * 8, 0, 1);
    fill_random(&r, v, 16 * 8, 0, 1);
    expect_error(kvcap_capsule_tile_error_ref(&b, &st.m, 15, 8, k, v, st.hs, st.vt, st.mu, err),
                 KVCAP_ERR_INVALID_ARGUMENT, "15 tokens", "4x4 grid");
    struct kvcap_capsule_maps bad = st.m;
    bad.m = 8;
    expect_error(kvcap_capsule_tile_error(&b, &bad, 16, 8, k, v, st.hs, st.vt, st.mu, err,
                                          scratch),
                 KVCAP_ERR_INVALID_ARGUMENT, "maps of 8 points", "tiles of 4");
    expect_error(kvcap_capsule_tile_error(&b, &st.m, 16, 8, k, v, st.hs, st.vt, st.mu, err,
                                          NULL),
                 KVCAP_ERR_INVALID_ARGUMENT, "scratch", NULL);
    expect_error(kvcap_capsule_tile_error_ref(&b, &st.m, 16, 8, k, NULL, st.hs, st.vt, st.mu,
                                              err),
                 KVCAP_ERR_INVALID_ARGUMENT, "NULL", NULL);
    for (int t = 0; t < 4; t++)
        assert_true(isnan(err[t]));
    state_free(&st);
}

/* kvzip's value basis fitted to the kept tokens (kvcap_capsule_fit_values), with an orthonormal
 * basis U: every token in F gives kvcap_capsule_prefill_values' projection (up to the ridge's
 * 1/(1 + λ)); a token outside F, made an outlier, changes nothing; a tile with at most rv
 * points in F reconstructs them (the least squares interpolate); an empty F gives zeros. */
#define FIT_F32_TOL 1e-5  /* f32 inputs, double sums over 16 points: the projection's own f32 */
#define FIT_INTERP_TOL 1e-4 /* v ~1: the ridge moves an interpolated value by ~λ·|v| = 1e-6 */
static void test_fit_values(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 53);
    enum { ROWS = 8, COLS = 8, M = 16, N = ROWS * COLS, T = N / M, D = 8, RV = 3 };
    struct kvcap_bucket b = {ROWS, COLS, KVCAP_STRUCTURE_TILED, 4, 4};
    float u[RV * M], v[N * D];
    fill_random(&r, u, RV * M, 0.0, 1.0);
    for (int a = 0; a < RV; a++) { /* Gram-Schmidt: orthonormal rows */
        for (int c = 0; c < a; c++) {
            double dot = 0;
            for (int p = 0; p < M; p++)
                dot += (double)u[a * M + p] * u[c * M + p];
            for (int p = 0; p < M; p++)
                u[a * M + p] -= (float)(dot * u[c * M + p]);
        }
        double norm = 0;
        for (int p = 0; p < M; p++)
            norm += (double)u[a * M + p] * u[a * M + p];
        for (int p = 0; p < M; p++)
            u[a * M + p] = (float)(u[a * M + p] / sqrt(norm));
    }
    fill_random(&r, v, N * D, 0.5, 1.0);
    unsigned char fit[N];
    memset(fit, 1, sizeof fit);
    float vt[T * RV * D], mu[D], vt0[T * RV * D], mu0[D], fscratch[(M + RV + 1) * D];
    double scratch[RV * RV + RV * D + D];
    assert_int_equal(kvcap_capsule_fit_values_scratch_doubles(M, RV, D),
                     sizeof scratch / sizeof scratch[0]);
    expect_ok(kvcap_capsule_prefill_values(&b, M, RV, u, N, D, v, KVCAP_DTYPE_F32, vt0, mu0,
                                           fscratch));
    expect_ok(kvcap_capsule_fit_values(&b, M, RV, u, N, D, v, fit, KVCAP_DTYPE_F32, vt, mu,
                                       scratch));
    assert_close(vt, vt0, T * RV * D, FIT_F32_TOL, "every token fitted: the projection");
    assert_close(mu, mu0, D, FIT_F32_TOL, "every token fitted: the span's mean");

    /* F: tile 0 keeps 2 points (<= rv), the others all but their point 3; token (tile 1,
     * point 3) becomes an outlier */
    for (int t = 0; t < T; t++)
        for (int p = 0; p < M; p++)
            fit[kvcap_bucket_token(&b, t, p)] = t == 0 ? p == 4 || p == 9 : p != 3;
    expect_ok(kvcap_capsule_fit_values(&b, M, RV, u, N, D, v, fit, KVCAP_DTYPE_F32, vt0, mu0,
                                       scratch));
    const size_t out = kvcap_bucket_token(&b, 1, 3);
    for (int c = 0; c < D; c++)
        v[out * D + c] = 1000.0f * (float)(c + 1);
    expect_ok(kvcap_capsule_fit_values(&b, M, RV, u, N, D, v, fit, KVCAP_DTYPE_F32, vt, mu,
                                       scratch));
    assert_memory_equal(vt, vt0, sizeof vt);
    assert_memory_equal(mu, mu0, sizeof mu);
    double count = 0, mean[D] = {0};
    for (int j = 0; j < N; j++)
        for (int c = 0; fit[j] && c < D; c++)
            mean[c] += v[j * D + c], count += c == 0;
    for (int c = 0; c < D; c++)
        assert_true(fabs(mu[c] - mean[c] / count) <= FIT_F32_TOL);
    for (int p = 0; p < M; p++) {
        const size_t j = kvcap_bucket_token(&b, 0, p);
        for (int c = 0; fit[j] && c < D; c++) {
            double x = mu[c];
            for (int a = 0; a < RV; a++)
                x += (double)u[a * M + p] * vt[a * D + c];
            if (!(fabs(x - v[j * D + c]) <= FIT_INTERP_TOL))
                fail_msg("tile 0 point %d channel %d: %g rebuilt, %g stored", p, c, x,
                         (double)v[j * D + c]);
        }
    }

    memset(fit, 0, sizeof fit);
    expect_ok(kvcap_capsule_fit_values(&b, M, RV, u, N, D, v, fit, KVCAP_DTYPE_F32, vt, mu,
                                       scratch));
    for (int i = 0; i < T * RV * D; i++)
        assert_true(vt[i] == 0.0f);
    for (int c = 0; c < D; c++)
        assert_true(mu[c] == 0.0f);

    memset(vt0, 0x7f, sizeof vt0);
    expect_error(kvcap_capsule_fit_values(&b, M, RV, u, N, D, v, NULL, KVCAP_DTYPE_F32, vt0, mu,
                                          scratch),
                 KVCAP_ERR_INVALID_ARGUMENT, "NULL", NULL);
    expect_error(kvcap_capsule_fit_values(&b, M, M + 1, u, N, D, v, fit, KVCAP_DTYPE_F32, vt0,
                                          mu, scratch),
                 KVCAP_ERR_INVALID_ARGUMENT, "rank 17 over 16 points", "8x8 grid");
    for (size_t i = 0; i < sizeof vt0; i++)
        assert_int_equal(((unsigned char *)vt0)[i], 0x7f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fast_matches_ref),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_tile_error_fast_matches_ref),
        cmocka_unit_test(test_tile_error_finds_outlier),
        cmocka_unit_test(test_tile_error_errors),
        cmocka_unit_test(test_fit_values),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
