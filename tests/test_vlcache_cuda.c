/* test_vlcache_cuda.c — VL-Cache's device scoring (kernels/cuda/vlcache_cuda.h) against the CPU
 * oracle kvcap_vlcache_head_ref. First the argument checks, which need no device; then, with a
 * device: token scores, sparsity counts and layer sparsities of (layer, KV head) batches over
 * dtypes, G, d (64 to 256, and 80), τ and m (1 to 4096, m = τ, tiles cut by causality), more
 * layers than one launch takes, strided buffers with NaN in every gap, outputs and scratch
 * poisoned, data whose scores sit on an exact grid (counts must match exactly), and
 * bit-identical reruns. Without a device (or CUDA in the build) it reports itself skipped (77). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/cuda/vlcache_cuda.h"
#include "common/rng.h"
#include "common/dtype.h"
#include "kernels/vlcache.h"
#include "tests/test_cuda.h"
#include "tests/test_numeric.h"

#ifdef KVCAP_WITH_CUDA
#define ARG_STATUS KVCAP_ERR_INVALID_ARGUMENT /* caught before anything touches a device */
#else
#define ARG_STATUS KVCAP_ERR_UNSUPPORTED      /* the stub answers every call so */
#endif

/* ---- Tolerances, and why ----------------------------------------------------------------------
 * Token scores, ‖device − oracle‖ / ‖oracle‖ per pair: the device rounds the scaled queries, the
 * dot products and the exps to f32 like the CPU's fast path (measured ≤ 8.5e-7 against the same
 * oracle, tests/test_vlcache.c, bound 4e-6) but sums the 32-key tiles' normalisers and the column
 * sums in another order (per lane, then over 8 warps, then over tiles); 1e-5 leaves room for that
 * and stays 100× below what a wrong causal mask or normaliser moves (>= 1e-3). */
#define SCORE_REL_TOL 1e-5
/* Scores of magnitude ~30 (scale 1, d = 128, unit keys and queries): their f32 rounding
 * (~2e-6 absolute) enters the exps; the CPU bound for this regime is 2e-5. */
#define SCORE_LARGE_REL_TOL 5e-5
/* On random data the device and the double oracle may disagree on entries within rounding of
 * the threshold: the device count must lie between the oracle's counts at p·(1 ∓ this), a window
 * 100× wider than the device's error in exp(s − max) (~1e-6 relative). */
#define COUNT_BRACKET_REL 1e-4

static const float P = 0.01f; /* DESIGN §6 */

/* ---- Argument checks (no device) ------------------------------------------------------------- */

static struct kvcap_cuda_vl valid_vl(const float *const *q, const void *const *k)
{
    struct kvcap_cuda_vl vl = {q, 2 * 4 * 64, k, KVCAP_DTYPE_F32, 64, 64 * 100, 1, 2, 4, 64, 5,
                               100};
    return vl;
}

static void test_arguments(void **state)
{
    (void)state;
    float x = 0, s = 0;
    int64_t below = 0;
    double gamma = 0;
    const float *qp[1] = {&x};
    const void *kp[1] = {&x};
    const struct kvcap_cuda_vl ok = valid_vl(qp, kp);
    const size_t bytes = kvcap_cuda_vlcache_scratch_bytes(&ok);
    assert_int_equal(kvcap_cuda_vlcache_scratch_bytes(NULL), 0);
#ifdef KVCAP_WITH_CUDA
    /* 2 pairs × 20 query rows × (4 tiles + 1) float2, plus the alignment margin */
    assert_true(bytes >= 2 * 20 * 5 * 8);
#endif
    struct kvcap_cuda_vl bad;
#define EXPECT_BAD(field_edit, status)                                                             \
    do {                                                                                           \
        bad = ok;                                                                                  \
        field_edit;                                                                                \
        assert_int_equal(kvcap_cuda_vlcache_scores(&bad, 0.125f, P, &s, &below, &gamma, &x,        \
                                                   bytes, NULL),                                   \
                         (status));                                                                \
    } while (0)
    EXPECT_BAD(bad.n_layers = 0, ARG_STATUS);
    EXPECT_BAD(bad.n_heads = 0, ARG_STATUS);
    EXPECT_BAD(bad.G = 0, ARG_STATUS);
    EXPECT_BAD(bad.d = 0, ARG_STATUS);
    EXPECT_BAD(bad.tau = 0, ARG_STATUS);
    EXPECT_BAD(bad.m = 4, ARG_STATUS); /* fewer keys than post-vision tokens */
#ifdef KVCAP_WITH_CUDA
    assert_non_null(strstr(kvcap_last_error(), "vl->m = 4"));
#endif
    EXPECT_BAD(bad.dtype = KVCAP_DTYPE_I32, ARG_STATUS);
    EXPECT_BAD(bad.row_stride = 63, ARG_STATUS);
    EXPECT_BAD(bad.q_stride = 2 * 4 * 64 - 1, ARG_STATUS);
    EXPECT_BAD(bad.q = NULL, ARG_STATUS);
    const float *no_q[1] = {NULL};
    EXPECT_BAD(bad.q = no_q, ARG_STATUS);
#ifdef KVCAP_WITH_CUDA
    assert_non_null(strstr(kvcap_last_error(), "vl->q[0]"));
#endif
    /* d past what the device path stages in shared memory: valid, but not served here */
    EXPECT_BAD((bad.d = 300, bad.row_stride = 300, bad.q_stride = 2 * 4 * 300),
               KVCAP_ERR_UNSUPPORTED);
#undef EXPECT_BAD
    assert_int_equal(kvcap_cuda_vlcache_scores(NULL, 0.125f, P, &s, &below, &gamma, &x, bytes,
                                               NULL),
                     ARG_STATUS);
    assert_int_equal(kvcap_cuda_vlcache_scores(&ok, INFINITY, P, &s, &below, &gamma, &x, bytes,
                                               NULL),
                     ARG_STATUS);
    assert_int_equal(kvcap_cuda_vlcache_scores(&ok, 0.125f, NAN, &s, &below, &gamma, &x, bytes,
                                               NULL),
                     ARG_STATUS);
    assert_int_equal(kvcap_cuda_vlcache_scores(&ok, 0.125f, P, NULL, &below, &gamma, &x, bytes,
                                               NULL),
                     ARG_STATUS);
    assert_int_equal(kvcap_cuda_vlcache_scores(&ok, 0.125f, P, &s, NULL, &gamma, &x, bytes, NULL),
                     ARG_STATUS);
    assert_int_equal(kvcap_cuda_vlcache_scores(&ok, 0.125f, P, &s, &below, NULL, &x, bytes, NULL),
                     ARG_STATUS);
    assert_int_equal(kvcap_cuda_vlcache_scores(&ok, 0.125f, P, &s, &below, &gamma, NULL, bytes,
                                               NULL),
                     ARG_STATUS);
    assert_int_equal(kvcap_cuda_vlcache_scores(&ok, 0.125f, P, &s, &below, &gamma, &x,
                                               bytes ? bytes - 1 : 0, NULL),
                     ARG_STATUS);
#ifdef KVCAP_WITH_CUDA
    assert_non_null(strstr(kvcap_last_error(), "scratch_bytes"));
#endif
    assert_int_equal(below, 0); /* nothing was written */
}

#ifdef KVCAP_WITH_CUDA

/* ---- Prompts --------------------------------------------------------------------------------- */

enum data {
    RANDOM, /* uniform queries and keys, unit variance */
    GRID    /* integer keys in [-2, 2], queries with four ±1 entries, scale 0.5: every score is a
             * multiple of 0.5 in every dtype and s − max never comes near ln p, so device and
             * oracle must count exactly the same entries */
};

/* Queries [L][tau][H·G·d] (row stride q_stride = H·G·d + 7, NaN in the gap) and keys of L
 * layers, one device buffer each with a NaN row before key 0, NaN padding per row and between
 * heads; kf holds the stored keys back in f32 per pair ([L·H][m][d]) for the oracle. */
struct prompt {
    int L, H, G, d, tau, m;
    enum kvcap_dtype dt;
    size_t q_stride, row_stride, head_stride;
    float *qf, *kf;
    void **buf;       /* [2L]: queries of each layer, then keys */
    const float **q;  /* [L] */
    const void **k;   /* [L] */
};

/* Uniform with unit variance. */
static float unit_uniform(struct kvcap_rng *r)
{
    return (float)(1.7320508075688772 * (2 * kvcap_rng_uniform(r) - 1));
}

static void prompt_make(struct prompt *p, struct kvcap_rng *r, int L, int H, int G, int d, int tau,
                        int m, enum kvcap_dtype dt, enum data data)
{
    p->L = L, p->H = H, p->G = G, p->d = d, p->tau = tau, p->m = m, p->dt = dt;
    p->q_stride = (size_t)H * G * d + 7;
    p->row_stride = (size_t)d + 2;
    p->head_stride = (size_t)m * p->row_stride + 3;
    const size_t es = kvcap_dtype_size(dt), q_layer = (size_t)tau * p->q_stride;
    const size_t k_layer = p->row_stride + (size_t)H * p->head_stride; /* one lead row */
    p->qf = alloc_f((size_t)L * q_layer);
    p->kf = alloc_f((size_t)L * H * m * d);
    p->buf = calloc(2 * (size_t)L, sizeof *p->buf);
    p->q = calloc((size_t)L, sizeof *p->q);
    p->k = calloc((size_t)L, sizeof *p->k);
    float *stage = malloc(sizeof(float) * k_layer);
    unsigned char *raw = malloc(es * k_layer);
    assert_true(p->buf && p->q && p->k && stage && raw);
    for (int l = 0; l < L; l++) {
        float *ql = p->qf + (size_t)l * q_layer;
        for (int i = 0; i < tau; i++)
            for (size_t c = 0; c < p->q_stride; c++) {
                float x = NAN;
                if (c < (size_t)H * G * d)
                    x = data == RANDOM ? unit_uniform(r) : 0.0f;
                ql[(size_t)i * p->q_stride + c] = x;
            }
        if (data == GRID)
            for (int i = 0; i < tau; i++)
                for (int hg = 0; hg < H * G; hg++)
                    for (int t = 0; t < 4; t++) {
                        size_t c = (size_t)hg * d + kvcap_rng_below(r, (uint64_t)d);
                        ql[(size_t)i * p->q_stride + c] = kvcap_rng_below(r, 2) ? 1.0f : -1.0f;
                    }
        p->buf[l] = dalloc(sizeof(float) * q_layer);
        upload(p->buf[l], ql, sizeof(float) * q_layer);
        p->q[l] = p->buf[l];

        for (size_t i = 0; i < k_layer; i++)
            stage[i] = NAN;
        for (int h = 0; h < H; h++)
            for (int j = 0; j < m; j++)
                for (int c = 0; c < d; c++)
                    stage[p->row_stride + h * p->head_stride + j * p->row_stride + c] =
                        data == RANDOM ? unit_uniform(r) : (float)((int)kvcap_rng_below(r, 5) - 2);
        assert_int_equal(kvcap_convert_from_f32(dt, stage, k_layer, raw), KVCAP_OK);
        assert_int_equal(kvcap_convert_to_f32(dt, raw, k_layer, stage), KVCAP_OK);
        for (int h = 0; h < H; h++)
            for (int j = 0; j < m; j++)
                memcpy(p->kf + (((size_t)l * H + h) * m + j) * d,
                       stage + p->row_stride + h * p->head_stride + j * p->row_stride,
                       sizeof(float) * d);
        p->buf[L + l] = dalloc(es * k_layer);
        upload(p->buf[L + l], raw, es * k_layer);
        p->k[l] = (const unsigned char *)p->buf[L + l] + p->row_stride * es;
    }
    free(stage);
    free(raw);
}

static void prompt_free(struct prompt *p)
{
    for (int i = 0; i < 2 * p->L; i++)
        cudaFree(p->buf[i]);
    free(p->buf), free(p->q), free(p->k), free(p->qf), free(p->kf);
}

static struct kvcap_cuda_vl prompt_vl(const struct prompt *p)
{
    struct kvcap_cuda_vl vl = {p->q,          p->q_stride, p->k,   p->dt, p->row_stride,
                               p->head_stride, p->L,       p->H,   p->G,  p->d,
                               p->tau,         p->m};
    return vl;
}

struct vl_out {
    float *score;   /* [batch][m] */
    int64_t *below; /* [batch] */
    double *gamma;  /* [L] */
};

/* One device call on a fresh stream with every output and the scratch poisoned, the scratch
 * handed at an odd offset. */
static struct vl_out run_device(const struct prompt *p, float scale)
{
    struct kvcap_cuda_vl vl = prompt_vl(p);
    const size_t batch = (size_t)p->L * p->H, bytes = kvcap_cuda_vlcache_scratch_bytes(&vl);
    assert_true(bytes > 0 && bytes != SIZE_MAX);
    unsigned char *scratch = dalloc(bytes + 4);
    float *dscore = dalloc(sizeof(float) * batch * p->m);
    int64_t *dbelow = dalloc(sizeof(int64_t) * batch);
    double *dgamma = dalloc(sizeof(double) * p->L);
    poison(scratch, bytes + 4);
    poison(dscore, sizeof(float) * batch * p->m);
    poison(dbelow, sizeof(int64_t) * batch);
    poison(dgamma, sizeof(double) * p->L);
    cudaStream_t st;
    assert_int_equal(cudaStreamCreate(&st), cudaSuccess);
    assert_int_equal(kvcap_cuda_vlcache_scores(&vl, scale, P, dscore, dbelow, dgamma, scratch + 4,
                                               bytes, st),
                     KVCAP_OK);
    cudaError_t e = cudaStreamSynchronize(st);
    if (e != cudaSuccess)
        fail_msg("stream: %s", cudaGetErrorString(e));
    struct vl_out o = {alloc_f(batch * p->m), malloc(sizeof(int64_t) * batch),
                       malloc(sizeof(double) * p->L)};
    assert_true(o.below && o.gamma);
    download(o.score, dscore, sizeof(float) * batch * p->m);
    download(o.below, dbelow, sizeof(int64_t) * batch);
    download(o.gamma, dgamma, sizeof(double) * p->L);
    cudaStreamDestroy(st);
    cudaFree(scratch), cudaFree(dscore), cudaFree(dbelow), cudaFree(dgamma);
    return o;
}

static void vl_out_free(struct vl_out *o)
{
    free(o->score), free(o->below), free(o->gamma);
}

/* The oracle on pair (l, h) at threshold p: scores into score (zeroed here), counts returned. */
static void oracle(const struct prompt *pr, int l, int h, float scale, float p, float *score,
                   int64_t *below, int64_t *entries)
{
    const float *q = pr->qf + (size_t)l * pr->tau * pr->q_stride + (size_t)h * pr->G * pr->d;
    struct kvcap_rows rows = {pr->kf + ((size_t)l * pr->H + h) * pr->m * pr->d, NULL,
                              KVCAP_DTYPE_F32, (size_t)pr->d, pr->m};
    for (int j = 0; j < pr->m; j++)
        score[j] = 0.0f;
    *below = *entries = 0;
    assert_int_equal(kvcap_vlcache_head_ref(q, pr->q_stride, pr->tau, pr->G, pr->d, scale, &rows, 1,
                                            p, score, below, entries),
                     KVCAP_OK);
}

struct vl_case {
    int L, H, G, d, tau, m;
    enum kvcap_dtype dt;
    enum data data;
    float scale; /* 0: 1/√d */
    double tol;
};

static void run_case(const struct vl_case *c, uint64_t seed)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, seed);
    struct prompt pr;
    prompt_make(&pr, &r, c->L, c->H, c->G, c->d, c->tau, c->m, c->dt, c->data);
    const float scale = c->scale > 0 ? c->scale : 1.0f / sqrtf((float)c->d);
    struct vl_out o = run_device(&pr, scale);
    float *want = alloc_f((size_t)c->m), *tmp = alloc_f((size_t)c->m);
    for (int l = 0; l < c->L; l++) {
        int64_t layer_below = 0, layer_entries = 0;
        for (int h = 0; h < c->H; h++) {
            const size_t b = (size_t)l * c->H + h;
            int64_t nb, ne, lo, hi, e2;
            oracle(&pr, l, h, scale, P, want, &nb, &ne);
            char what[160];
            snprintf(what, sizeof what, "L %d H %d G %d d %d tau %d m %d dtype %s: pair (%d, %d)",
                     c->L, c->H, c->G, c->d, c->tau, c->m, kvcap_dtype_name(c->dt), l, h);
            assert_close(o.score + b * c->m, want, (size_t)c->m, c->tol, what);
            if (c->data == GRID) {
                if (o.below[b] != nb)
                    fail_msg("%s: below %lld, oracle %lld", what, (long long)o.below[b],
                             (long long)nb);
            } else {
                oracle(&pr, l, h, scale, P * (float)(1 - COUNT_BRACKET_REL), tmp, &lo, &e2);
                oracle(&pr, l, h, scale, P * (float)(1 + COUNT_BRACKET_REL), tmp, &hi, &e2);
                if (o.below[b] < lo || o.below[b] > hi)
                    fail_msg("%s: below %lld outside the oracle's [%lld, %lld]", what,
                             (long long)o.below[b], (long long)lo, (long long)hi);
            }
            layer_below += o.below[b];
            layer_entries += ne;
        }
        /* the layer sparsity from the device's own counts, exactly as the device divides */
        const double entries_per_head = (double)(layer_entries / c->H);
        const double want_gamma = (double)layer_below / ((double)c->H * entries_per_head);
        if (o.gamma[l] != want_gamma)
            fail_msg("layer %d: gamma %.17g, expected %.17g", l, o.gamma[l], want_gamma);
    }
    /* deterministic: a second run gives the same bits */
    struct vl_out again = run_device(&pr, scale);
    const size_t batch = (size_t)c->L * c->H;
    assert_memory_equal(o.score, again.score, sizeof(float) * batch * c->m);
    assert_memory_equal(o.below, again.below, sizeof(int64_t) * batch);
    assert_memory_equal(o.gamma, again.gamma, sizeof(double) * c->L);
    vl_out_free(&o), vl_out_free(&again);
    free(want), free(tmp);
    prompt_free(&pr);
}

static void test_scores(void **state)
{
    (void)state;
    static const struct vl_case cases[] = {
        {1, 1, 1, 64, 1, 1, KVCAP_DTYPE_F32, RANDOM, 0, SCORE_REL_TOL},   /* one key */
        {2, 2, 4, 64, 5, 100, KVCAP_DTYPE_F16, RANDOM, 0, SCORE_REL_TOL},
        {1, 2, 4, 64, 40, 40, KVCAP_DTYPE_F32, RANDOM, 0, SCORE_REL_TOL}, /* m = τ */
        {1, 1, 2, 64, 33, 70, KVCAP_DTYPE_BF16, RANDOM, 0, SCORE_REL_TOL}, /* causal cut, 2 tiles */
        {1, 1, 3, 80, 11, 129, KVCAP_DTYPE_F16, RANDOM, 0, SCORE_REL_TOL}, /* d not 32·k */
        {1, 1, 2, 256, 9, 300, KVCAP_DTYPE_BF16, RANDOM, 0, SCORE_REL_TOL}, /* the largest d */
        {1, 3, 2, 128, 37, 2048, KVCAP_DTYPE_BF16, RANDOM, 0, SCORE_REL_TOL},
        {2, 1, 7, 128, 16, 4096, KVCAP_DTYPE_F32, RANDOM, 0, SCORE_REL_TOL},
        {1, 2, 4, 128, 8, 1000, KVCAP_DTYPE_F32, RANDOM, 1.0f, SCORE_LARGE_REL_TOL},
        {2, 2, 4, 64, 8, 500, KVCAP_DTYPE_BF16, GRID, 0.5f, SCORE_REL_TOL}, /* exact counts */
        {2, 1, 3, 64, 20, 777, KVCAP_DTYPE_F16, GRID, 0.5f, SCORE_REL_TOL},
        {130, 1, 1, 16, 2, 40, KVCAP_DTYPE_F32, RANDOM, 0, SCORE_REL_TOL}, /* two launches */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        run_case(&cases[i], 300 + i);
}

#endif /* KVCAP_WITH_CUDA */

int main(void)
{
    const struct CMUnitTest host_tests[] = {
        cmocka_unit_test(test_arguments),
    };
    int status = RUN_WITHOUT_DEVICE(host_tests);
    if (status >= 0)
        return status;
#ifdef KVCAP_WITH_CUDA
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arguments),
        cmocka_unit_test(test_scores),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#else
    return 1; /* a build without CUDA reports no device */
#endif
}
