/* test_runtime.c — libkvcap's cache through its public API: `full` equals naive attention; the
 * fused KVCapsule path equals materialise-then-attend (K̂, V̂ built explicitly) for dense and
 * tiled maps, linear and GELU units, several G and d, spans at different p0, batch > 1 with
 * mixed buckets and text/generated tokens in the same softmax; strided and paged inputs; bytes
 * held; invalid calls leave the cache usable; record → calibrate → convert → decode. FlashCache
 * and VL-Cache inside the cache keep exactly the rows a brute-force reference picks (budgets to
 * the global target, a planted outlier kept, evicted rows freed), and a cache composing four
 * policies equals each span's policy alone, merged by hand through the returned lse. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>

#include <cmocka.h>

#include "kernels/activation.h"
#include "runtime/artifact.h"
#include "runtime/cache_internal.h"
#include "calibrate/calibrate.h"
#include "convert/convert.h"
#include "formats/dataset.h"
#include "kernels/flashcache.h"
#include "common/internal.h"
#include "common/rng.h"
#include "kernels/rope.h"
#include "formats/schema.h"
#include "kernels/select.h"
#include "tests/test_artifact.h"
#include "tests/test_util.h"
#include "kernels/vlcache.h"
#include "kernels/kvzip.h"
#include "kernels/expected.h"

/* fp32 storage: the fused and the materialised paths sum in different orders; both are fp32
 * with fp32/double accumulation, so they agree to a few ulps of the output's norm. */
#define FUSED_REL_TOL 1e-5

static struct kvcap_model_geometry geometry(int layers, int q_heads, int kv_heads, int d)
{
    struct kvcap_model_geometry g = {.name = "test", .n_layers = layers, .n_q_heads = q_heads,
                                     .n_kv_heads = kv_heads, .head_dim = d,
                                     .rope_type = KVCAP_ROPE_ROPE,
                                     .rope_pairing = KVCAP_ROPE_PAIRING_HALF, .rope_theta = 1e4};
    return g;
}

/* ---- The references ------------------------------------------------------------------------- */

/* Softmax attention of q over rows k, v (n x d). */
static void naive_attention(const float *q, const float *k, const float *v, int n, int d,
                            double *o)
{
    double mx = -INFINITY, sum = 0;
    double *s = malloc(sizeof(double) * (size_t)n);
    for (int j = 0; j < n; j++) {
        double dot = 0;
        for (int c = 0; c < d; c++)
            dot += (double)q[c] * k[(size_t)j * d + c];
        s[j] = dot / sqrt((double)d);
        mx = s[j] > mx ? s[j] : mx;
    }
    for (int c = 0; c < d; c++)
        o[c] = 0;
    for (int j = 0; j < n; j++) {
        double e = exp(s[j] - mx);
        sum += e;
        for (int c = 0; c < d; c++)
            o[c] += e * v[(size_t)j * d + c];
    }
    for (int c = 0; c < d; c++)
        o[c] /= sum;
    free(s);
}

/* K̂' and V̂ of one head of one span, built explicitly from the artifact's maps. */
static void materialise(const struct kvcap_artifact *a, const struct kvcap_model_geometry *g,
                        int layer, int head, int b, int p0, const float *k, const float *v, int n,
                        float *khat, float *vhat)
{
    (void)g;
    const struct kvcap_unit_maps *u = kvcap_artifact_unit(a, layer, head, b);
    const struct kvcap_bucket *bk = &a->buckets[b];
    int d = g->head_dim, m = u->m;
    float *kf = malloc(sizeof(float) * (size_t)n * d);
    memcpy(kf, k, sizeof(float) * (size_t)n * d);
    kvcap_rope_rotate_ref(g, kf, (size_t)n, (size_t)d, -(double)p0);
    double *mu = calloc((size_t)d, sizeof *mu);
    for (int j = 0; j < n; j++)
        for (int c = 0; c < d; c++)
            mu[c] += v[(size_t)j * d + c] / n;
    float *hid = malloc(sizeof(float) * (size_t)u->h * d);
    double *vt = malloc(sizeof(double) * (size_t)u->rv * d);
    for (int t = 0; t < n / m; t++) {
        for (int a2 = 0; a2 < u->h; a2++)
            for (int c = 0; c < d; c++) {
                double z = u->b1[a2];
                for (int r = 0; r < u->rk; r++)
                    z += (double)u->w1[(size_t)r * u->h + a2] *
                         kf[kvcap_bucket_token(bk, t, u->mask[r]) * (size_t)d + (size_t)c];
                hid[(size_t)a2 * d + c] = u->gelu ? kvcap_gelu((float)z) : (float)z;
            }
        for (int p = 0; p < m; p++) {
            size_t tok = kvcap_bucket_token(bk, t, p);
            for (int c = 0; c < d; c++) {
                double s = u->b2[p];
                for (int a2 = 0; a2 < u->h; a2++)
                    s += (double)u->w2[(size_t)a2 * m + p] * hid[(size_t)a2 * d + c];
                khat[tok * (size_t)d + (size_t)c] = (float)s;
            }
        }
        for (int i = 0; i < u->rv; i++)
            for (int c = 0; c < d; c++) {
                double s = 0;
                for (int p = 0; p < m; p++)
                    s += (double)u->u[(size_t)i * m + p] *
                         (v[kvcap_bucket_token(bk, t, p) * (size_t)d + (size_t)c] - mu[c]);
                vt[(size_t)i * d + c] = s;
            }
        for (int p = 0; p < m; p++) {
            size_t tok = kvcap_bucket_token(bk, t, p);
            for (int c = 0; c < d; c++) {
                double s = mu[c];
                for (int i = 0; i < u->rv; i++)
                    s += (double)u->u[(size_t)i * m + p] * vt[(size_t)i * d + c];
                vhat[tok * (size_t)d + (size_t)c] = (float)s;
            }
        }
    }
    free(kf), free(mu), free(hid), free(vt);
}

static double rel_err(const float *got, const double *want, int n)
{
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) {
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static void tmp_path(char *out, size_t cap, const char *name)
{
    const char *t = getenv("TMPDIR");
    snprintf(out, cap, "%s/%s-%d", t ? t : "/tmp", name, (int)getpid());
}

static struct kvcap_tensor_view hnd(const float *x, int n, int d)
{
    struct kvcap_tensor_view v = {x, NULL, 0, KVCAP_DTYPE_F32, (int64_t)n * d, d};
    return v;
}

/* ---- A scenario: spans and generated tokens of a batch, kept to build the reference ------ */

enum { MAX_LAYERS = 2, MAX_SEQS = 3, MAX_SPANS = 3, MAX_GEN = 4 };

struct scen_span {
    enum kvcap_span_kind kind;
    int rows, cols, p0, n;
    float *kv[MAX_LAYERS]; /* [2][kv_heads][n][d]: keys then values, HND */
};

struct scenario {
    struct kvcap_model_geometry g;
    int n_seqs, n_spans[MAX_SEQS], n_gen[MAX_SEQS];
    int exact_tiles; /* the cache's kvcapsule.exact_tiles */
    struct scen_span spans[MAX_SEQS][MAX_SPANS];
    float *gen[MAX_LAYERS][MAX_SEQS]; /* [n_gen][2][kv_heads][d] */
};

static void scenario_add(struct scenario *sc, int seq, enum kvcap_span_kind kind, int rows,
                         int cols, int p0, struct kvcap_rng *r)
{
    struct scen_span *x = &sc->spans[seq][sc->n_spans[seq]++];
    x->kind = kind;
    x->rows = kind == KVCAP_SPAN_VISION ? rows : 0;
    x->cols = kind == KVCAP_SPAN_VISION ? cols : 0;
    x->n = rows * cols;
    x->p0 = p0;
    size_t count = 2 * (size_t)sc->g.n_kv_heads * x->n * sc->g.head_dim;
    for (int l = 0; l < sc->g.n_layers; l++) {
        x->kv[l] = malloc(sizeof(float) * count);
        fill(r, x->kv[l], count, 1.0);
    }
}

static void scenario_gen(struct scenario *sc, int seq, int n, struct kvcap_rng *r)
{
    sc->n_gen[seq] = n;
    size_t count = (size_t)n * 2 * sc->g.n_kv_heads * sc->g.head_dim;
    for (int l = 0; l < sc->g.n_layers; l++) {
        sc->gen[l][seq] = malloc(sizeof(float) * (count ? count : 1));
        fill(r, sc->gen[l][seq], count, 1.0);
    }
}

static void scenario_free(struct scenario *sc)
{
    for (int s = 0; s < sc->n_seqs; s++) {
        for (int i = 0; i < sc->n_spans[s]; i++)
            for (int l = 0; l < sc->g.n_layers; l++)
                free(sc->spans[s][i].kv[l]);
        for (int l = 0; l < sc->g.n_layers; l++)
            free(sc->gen[l][s]);
    }
}

/* Hands the scenario to the cache as an engine would: the prefill layer by layer, then the
 * generated tokens step by step (appending ends a sequence's prefill, so every layer has its
 * spans by then). */
static void scenario_load(const struct scenario *sc, struct kvcap_cache *c)
{
    int H = sc->g.n_kv_heads, d = sc->g.head_dim;
    for (int l = 0; l < sc->g.n_layers; l++)
        for (int s = 0; s < sc->n_seqs; s++)
            for (int i = 0; i < sc->n_spans[s]; i++) {
                const struct scen_span *x = &sc->spans[s][i];
                struct kvcap_span_desc desc = {x->kind, x->n, x->rows, x->cols, x->p0};
                struct kvcap_tensor_view kv = hnd(x->kv[l], x->n, d);
                struct kvcap_tensor_view vv = hnd(x->kv[l] + (size_t)H * x->n * d, x->n, d);
                if (kvcap_cache_add_span(c, s, l, &desc, &kv, &vv) != KVCAP_OK)
                    fail_msg("add_span: %s", kvcap_last_error());
            }
    int steps = 0;
    for (int s = 0; s < sc->n_seqs; s++)
        steps = sc->n_gen[s] > steps ? sc->n_gen[s] : steps;
    for (int t = 0; t < steps; t++)
        for (int l = 0; l < sc->g.n_layers; l++)
            for (int s = 0; s < sc->n_seqs; s++) {
                if (t >= sc->n_gen[s])
                    continue;
                const float *tok = sc->gen[l][s] + (size_t)t * 2 * H * d;
                struct kvcap_tensor_view gk = {tok, NULL, 0, KVCAP_DTYPE_F32, d, 0};
                struct kvcap_tensor_view gv = {tok + (size_t)H * d, NULL, 0, KVCAP_DTYPE_F32, d, 0};
                if (kvcap_cache_append(c, s, l, &gk, &gv) != KVCAP_OK)
                    fail_msg("append: %s", kvcap_last_error());
            }
}

/* kvcap's exact tiles in the reference: the `exact` tiles (at most all but one) whose worst
 * token has the largest ‖k̂' − k'‖²/k2 + ‖v̂ − v‖²/v2 (k2, v2: the span's mean ‖k'‖² and
 * ‖v − μ‖²) get their exact keys and values back. khat holds K̂' (offset-free) on entry. */
static void exact_tiles_back(const struct kvcap_artifact *a, const struct kvcap_model_geometry *g,
                             int b, int p0, const float *k, const float *v, int n, int exact,
                             float *khat, float *vhat)
{
    const struct kvcap_bucket *bk = &a->buckets[b];
    int d = g->head_dim, m = bk->structure == KVCAP_STRUCTURE_TILED ? bk->tile_rows * bk->tile_cols
                                                                    : n;
    int tiles = n / m;
    exact = exact < tiles ? exact : tiles - 1;
    float *kr = malloc(sizeof(float) * (size_t)n * d);
    memcpy(kr, k, sizeof(float) * (size_t)n * d);
    kvcap_rope_rotate_ref(g, kr, (size_t)n, (size_t)d, -(double)p0);
    double k2 = 0, v2 = 0, *err = calloc((size_t)tiles, sizeof *err);
    for (int c = 0; c < d; c++) {
        double mu = 0;
        for (int j = 0; j < n; j++)
            mu += v[(size_t)j * d + c] / n;
        for (int j = 0; j < n; j++) {
            k2 += (double)kr[(size_t)j * d + c] * kr[(size_t)j * d + c] / n;
            v2 += (v[(size_t)j * d + c] - mu) * (v[(size_t)j * d + c] - mu) / n;
        }
    }
    for (int t = 0; t < tiles; t++)
        for (int p = 0; p < m; p++) {
            size_t j = kvcap_bucket_token(bk, t, p);
            double ke = 0, ve = 0;
            for (int c = 0; c < d; c++) {
                double x = (double)khat[j * d + c] - kr[j * d + c];
                double y = (double)vhat[j * d + c] - v[j * d + c];
                ke += x * x, ve += y * y;
            }
            err[t] = fmax(err[t], ke / k2 + ve / v2);
        }
    for (int e = 0; e < exact; e++) {
        int worst = 0;
        for (int t = 1; t < tiles; t++)
            worst = err[t] > err[worst] ? t : worst;
        for (int p = 0; p < m; p++) {
            size_t j = kvcap_bucket_token(bk, worst, p);
            memcpy(khat + j * d, kr + j * d, sizeof(float) * (size_t)d);
            memcpy(vhat + j * d, v + j * d, sizeof(float) * (size_t)d);
        }
        err[worst] = -1;
    }
    free(kr), free(err);
}

/* The reference output of query head hq of sequence s at layer l: naive softmax attention
 * over every token, vision spans with a bucket replaced by their materialised K̂, V̂ (but for
 * their exact tiles). */
static void scenario_expect(const struct scenario *sc, const struct kvcap_artifact *a, int l,
                            int s, int hq, const float *q, double *o)
{
    int H = sc->g.n_kv_heads, d = sc->g.head_dim, hk = hq / (sc->g.n_q_heads / H);
    int total = sc->n_gen[s];
    for (int i = 0; i < sc->n_spans[s]; i++)
        total += sc->spans[s][i].n;
    float *K = malloc(sizeof(float) * (size_t)total * d), *V = malloc(sizeof(float) * (size_t)total * d);
    int at = 0;
    for (int i = 0; i < sc->n_spans[s]; i++) {
        const struct scen_span *x = &sc->spans[s][i];
        const float *xk = x->kv[l] + (size_t)hk * x->n * d;
        const float *xv = x->kv[l] + ((size_t)H + hk) * x->n * d;
        int b = x->kind == KVCAP_SPAN_VISION && a ? kvcap_artifact_find_bucket(a, x->rows, x->cols) : -1;
        if (b >= 0) {
            materialise(a, &sc->g, l, hk, b, x->p0, xk, xv, x->n, K + (size_t)at * d, V + (size_t)at * d);
            if (sc->exact_tiles > 0)
                exact_tiles_back(a, &sc->g, b, x->p0, xk, xv, x->n, sc->exact_tiles,
                                 K + (size_t)at * d, V + (size_t)at * d);
            /* q·R(p0)K̂' = R(-p0)q·K̂': put the offset back on the materialised keys */
            kvcap_rope_rotate_ref(&sc->g, K + (size_t)at * d, (size_t)x->n, (size_t)d, (double)x->p0);
        } else {
            memcpy(K + (size_t)at * d, xk, sizeof(float) * (size_t)x->n * d);
            memcpy(V + (size_t)at * d, xv, sizeof(float) * (size_t)x->n * d);
        }
        at += x->n;
    }
    for (int t = 0; t < sc->n_gen[s]; t++, at++) {
        const float *tok = sc->gen[l][s] + (size_t)t * 2 * H * d;
        memcpy(K + (size_t)at * d, tok + (size_t)hk * d, sizeof(float) * (size_t)d);
        memcpy(V + (size_t)at * d, tok + ((size_t)H + hk) * d, sizeof(float) * (size_t)d);
    }
    naive_attention(q, K, V, at, d, o);
    free(K), free(V);
}

/* Attends every layer and compares every head of every sequence with the reference. */
static void scenario_check(const struct scenario *sc, const struct kvcap_artifact *a,
                           struct kvcap_cache *c, double tol, struct kvcap_rng *r)
{
    int Hq = sc->g.n_q_heads, d = sc->g.head_dim;
    float *q = malloc(sizeof(float) * (size_t)sc->n_seqs * Hq * d);
    float *out = malloc(sizeof(float) * (size_t)sc->n_seqs * Hq * d);
    double o[256];
    for (int l = 0; l < sc->g.n_layers; l++) {
        fill(r, q, (size_t)sc->n_seqs * Hq * d, 1.0);
        if (kvcap_cache_attend(c, l, q, out) != KVCAP_OK)
            fail_msg("attend: %s", kvcap_last_error());
        for (int s = 0; s < sc->n_seqs; s++)
            for (int hq = 0; hq < Hq; hq++) {
                scenario_expect(sc, a, l, s, hq, q + ((size_t)s * Hq + hq) * d, o);
                double e = rel_err(out + ((size_t)s * Hq + hq) * d, o, d);
                if (!(e <= tol))
                    fail_msg("G %d, d %d, layer %d, seq %d, head %d: relative error %g > %g",
                             Hq / sc->g.n_kv_heads, d, l, s, hq, e, tol);
            }
    }
    free(q), free(out);
}

/* An artifact with random maps (test_artifact.h) for g and the nb buckets of tb, opened from a
 * temporary file `name`.kvcap that is removed again. */
static struct kvcap_artifact *test_artifact(const struct kvcap_model_geometry *g,
                                            const struct test_bucket *tb, int nb, uint64_t seed,
                                            const char *name)
{
    char path[512], file[64];
    snprintf(file, sizeof file, "%s.kvcap", name);
    tmp_path(path, sizeof path, file);
    write_artifact(path, g, tb, nb, seed);
    struct kvcap_artifact *a = NULL;
    if (kvcap_artifact_open(path, &a) != KVCAP_OK)
        fail_msg("%s: %s", path, kvcap_last_error());
    unlink(path);
    return a;
}

/* An engine's thread pool for params.parallel_for, as the contract asks: `threads` threads,
 * started for each call, claim tasks through one counter and pass their own index. It counts
 * calls and tasks, and flags a thread index out of range. */
struct engine_pool {
    int threads;
    atomic_int calls, tasks, bad_thread;
};

struct engine_call {
    struct engine_pool *pool;
    kvcap_task_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next;
};

struct engine_thread {
    struct engine_call *call;
    int index;
};

static void *engine_thread_main(void *arg)
{
    struct engine_thread *t = arg;
    struct engine_call *call = t->call;
    for (int k; (k = atomic_fetch_add(&call->next, 1)) < call->n_tasks;) {
        call->fn(call->ctx, k, t->index);
        atomic_fetch_add(&call->pool->tasks, 1);
    }
    return NULL;
}

static void engine_parallel_for(void *user, int n_tasks, kvcap_task_fn fn, void *ctx)
{
    struct engine_pool *pool = user;
    struct engine_call call = {pool, fn, ctx, n_tasks, 0};
    struct engine_thread t[8];
    pthread_t tid[8];
    atomic_fetch_add(&pool->calls, 1);
    if (pool->threads > 8)
        atomic_store(&pool->bad_thread, 1);
    int n = pool->threads < 8 ? pool->threads : 8;
    for (int i = 1; i < n; i++) {
        t[i] = (struct engine_thread){&call, i};
        if (pthread_create(&tid[i], NULL, engine_thread_main, &t[i]) != 0)
            n = i; /* fewer threads: the others run the tasks */
    }
    t[0] = (struct engine_thread){&call, 0};
    engine_thread_main(&t[0]); /* the calling thread is thread 0 */
    for (int i = 1; i < n; i++)
        pthread_join(tid[i], NULL);
}

/* A cache on `threads` threads (0: all cores), the engine's when `engine` is not NULL; `yaml`
 * (runtime config text) NULL: the defaults. */
static struct kvcap_cache *make_cache_on(const struct kvcap_model_geometry *g, int n_seqs,
                                         enum kvcap_dtype storage, const struct kvcap_artifact *a,
                                         const char *yaml, int threads, struct engine_pool *engine)
{
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.n_threads = threads;
    if (engine) {
        p.parallel_for = engine_parallel_for;
        p.parallel_user = engine;
    }
    p.model = *g;
    p.n_seqs = n_seqs;
    p.storage = storage;
    p.artifact = a;
    p.config_yaml = yaml; /* the runtime YAML in memory (config_path: see test_cache_params) */
    struct kvcap_cache *c = NULL;
    enum kvcap_status st = kvcap_cache_create(&p, &c);
    if (st != KVCAP_OK)
        fail_msg("create: %s", kvcap_last_error());
    return c;
}

static struct kvcap_cache *make_cache_threads(const struct kvcap_model_geometry *g, int n_seqs,
                                              enum kvcap_dtype storage,
                                              const struct kvcap_artifact *a, const char *yaml,
                                              int threads)
{
    return make_cache_on(g, n_seqs, storage, a, yaml, threads, NULL);
}

static struct kvcap_cache *make_cache(const struct kvcap_model_geometry *g, int n_seqs,
                                      enum kvcap_dtype storage, const struct kvcap_artifact *a,
                                      const char *yaml)
{
    return make_cache_threads(g, n_seqs, storage, a, yaml, 0);
}

/* Every span kind kept in full (without an artifact vision spans default to flashcache). */
#define ALL_FULL "policies: {vision: full, text: full, generated: full}\n"

/* ---- Tests ------------------------------------------------------------------------------------ */

static void test_full_matches_naive(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 1);
    struct scenario sc = {.g = geometry(2, 6, 2, 96), .n_seqs = 2};
    scenario_add(&sc, 0, KVCAP_SPAN_TEXT, 1, 37, 0, &r);
    scenario_add(&sc, 0, KVCAP_SPAN_VISION, 5, 7, 37, &r);
    scenario_add(&sc, 1, KVCAP_SPAN_VISION, 3, 3, 2, &r);
    scenario_gen(&sc, 0, 4, &r);
    scenario_gen(&sc, 1, 1, &r);
    struct kvcap_cache *c = make_cache(&sc.g, 2, KVCAP_DTYPE_F32, NULL, ALL_FULL);
    scenario_load(&sc, c);
    scenario_check(&sc, NULL, c, FUSED_REL_TOL, &r);
    struct kvcap_cache_stats st;
    assert_int_equal(kvcap_cache_stats(c, &st), KVCAP_OK);
    assert_int_equal(st.tokens_by_kind[KVCAP_SPAN_VISION], 35 + 9);
    assert_int_equal(st.tokens_by_kind[KVCAP_SPAN_GENERATED], 5);
    assert_true(st.bytes_read_last_attend > 0);
    kvcap_cache_free(c);
    scenario_free(&sc);
}

static void check_fused(int q_heads, int kv_heads, int d)
{
    struct kvcap_model_geometry g = geometry(2, q_heads, kv_heads, d);
    const struct test_bucket tb[2] = {{4, 6, 0, 0, 8, 6, 7}, {8, 8, 4, 4, 5, 4, 6}};
    struct kvcap_artifact *a = test_artifact(&g, tb, 2, (uint64_t)(q_heads * 1000 + d), "fused");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, (uint64_t)d);
    struct scenario sc = {.g = g, .n_seqs = 3};
    scenario_add(&sc, 0, KVCAP_SPAN_TEXT, 1, 5, 0, &r);
    scenario_add(&sc, 0, KVCAP_SPAN_VISION, 4, 6, 5, &r);   /* dense bucket */
    scenario_add(&sc, 1, KVCAP_SPAN_VISION, 8, 8, 17, &r);  /* tiled bucket */
    scenario_add(&sc, 1, KVCAP_SPAN_VISION, 4, 6, 801, &r); /* dense again, other p0 */
    scenario_add(&sc, 2, KVCAP_SPAN_VISION, 3, 5, 9, &r);   /* no bucket: fallback full */
    scenario_add(&sc, 2, KVCAP_SPAN_VISION, 8, 8, 3000, &r);
    scenario_gen(&sc, 0, 3, &r);
    scenario_gen(&sc, 2, 2, &r);
    struct kvcap_cache *c = make_cache(&g, 3, KVCAP_DTYPE_F32, a,
                                       "policies: {vision: kvcapsule}\nfallback: full\n");
    scenario_load(&sc, c);
    scenario_check(&sc, a, c, FUSED_REL_TOL, &r);
    struct kvcap_cache_stats st;
    assert_int_equal(kvcap_cache_stats(c, &st), KVCAP_OK);
    assert_int_equal(st.spans_fallback, 1);
    assert_true(st.map_bytes_read_last_attend > 0);
    assert_true(st.bytes_by_policy[KVCAP_POLICY_KVCAPSULE] > 0);
    kvcap_cache_free(c);
    scenario_free(&sc);
    kvcap_artifact_free(a);
}

/* An artifact freed by its opener while caches use it stays alive until the last of them is
 * freed: the caches decode as before, checked against a second copy of the same maps (ASan
 * reports any read of freed maps). */
static void test_artifact_outlives_its_opener(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    const struct test_bucket tb[1] = {{8, 8, 4, 4, 5, 4, 6}};
    struct kvcap_artifact *a = test_artifact(&g, tb, 1, 4242, "held");
    struct kvcap_artifact *oracle = test_artifact(&g, tb, 1, 4242, "oracle");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 9);
    struct scenario sc = {.g = g, .n_seqs = 1};
    scenario_add(&sc, 0, KVCAP_SPAN_TEXT, 1, 5, 0, &r);
    scenario_add(&sc, 0, KVCAP_SPAN_VISION, 8, 8, 5, &r);
    scenario_gen(&sc, 0, 2, &r);
    const char *yaml = "policies: {vision: kvcapsule}\n";
    struct kvcap_cache *c1 = make_cache(&g, 1, KVCAP_DTYPE_F32, a, yaml);
    struct kvcap_cache *c2 = make_cache(&g, 1, KVCAP_DTYPE_F32, a, yaml);
    kvcap_artifact_free(a); /* the opener lets go first */
    scenario_load(&sc, c1);
    scenario_check(&sc, oracle, c1, FUSED_REL_TOL, &r);
    kvcap_cache_free(c1);
    scenario_load(&sc, c2); /* still held by c2 */
    scenario_check(&sc, oracle, c2, FUSED_REL_TOL, &r);
    kvcap_cache_free(c2);   /* the maps go here */
    scenario_free(&sc);
    kvcap_artifact_free(oracle);
}

static void test_fused_matches_materialised(void **state)
{
    (void)state;
    check_fused(4, 2, 64);
    check_fused(7, 1, 128);
    check_fused(8, 8, 80);
    check_fused(2, 1, 256);
}

/* With several threads a KV head's rows and tiles are cut into slices whose partials are merged:
 * spans long enough to be cut give the reference's outputs and the same bytes-read figures on
 * 1, 3 and 4 threads of the cache's pool (more threads than cores is allowed) and on 3 threads
 * of an engine's own pool (params.parallel_for), which then runs every parallel loop. */
static void test_sliced_attend_matches(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 8, 2, 64);
    const struct test_bucket tb[1] = {{32, 32, 4, 4, 6, 6, 6}};
    struct kvcap_artifact *a = test_artifact(&g, tb, 1, 77, "sliced");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 12);
    struct scenario sc = {.g = g, .n_seqs = 2};
    scenario_add(&sc, 0, KVCAP_SPAN_TEXT, 1, 1100, 0, &r);    /* plain rows: 4 slices */
    scenario_add(&sc, 0, KVCAP_SPAN_VISION, 32, 32, 1100, &r); /* 64 tiles: 4 slices */
    scenario_add(&sc, 1, KVCAP_SPAN_VISION, 32, 32, 7, &r);
    scenario_add(&sc, 1, KVCAP_SPAN_TEXT, 1, 300, 1031, &r);   /* too short to cut */
    scenario_gen(&sc, 0, 3, &r);
    const int threads[4] = {1, 3, 4, 3};
    struct engine_pool engine = {3, 0, 0, 0};
    struct kvcap_cache_stats first;
    for (int i = 0; i < 4; i++) {
        struct kvcap_cache *c = make_cache_on(&g, 2, KVCAP_DTYPE_F32, a, NULL, threads[i],
                                              i == 3 ? &engine : NULL);
        scenario_load(&sc, c);
        scenario_check(&sc, a, c, FUSED_REL_TOL, &r);
        if (i == 3) { /* every attend went through the engine, at least a task per KV head */
            int calls = atomic_load(&engine.calls), tasks = atomic_load(&engine.tasks);
            assert_true(calls >= g.n_layers);
            assert_true(tasks >= calls * g.n_kv_heads && tasks % calls == 0);
            assert_int_equal(atomic_load(&engine.bad_thread), 0);
        }
        struct kvcap_cache_stats st;
        assert_int_equal(kvcap_cache_stats(c, &st), KVCAP_OK);
        assert_true(st.bytes_by_policy[KVCAP_POLICY_KVCAPSULE] > 0);
        if (i == 0)
            first = st;
        else if (st.bytes_read_last_attend != first.bytes_read_last_attend ||
                 st.map_bytes_read_last_attend != first.map_bytes_read_last_attend)
            fail_msg("%d threads: read %llu (maps %llu), 1 thread: %llu (maps %llu)", threads[i],
                     (unsigned long long)st.bytes_read_last_attend,
                     (unsigned long long)st.map_bytes_read_last_attend,
                     (unsigned long long)first.bytes_read_last_attend,
                     (unsigned long long)first.map_bytes_read_last_attend);
        kvcap_cache_free(c);
    }
    scenario_free(&sc);
    kvcap_artifact_free(a);
}

/* NHD, HND and paged views of the same data give the same cache. */
static void test_strided_and_paged_views(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(1, 4, 2, 64);
    enum { N = 40, D = 64, H = 2, PAGE = 16 };
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 5);
    static float hndk[H * N * D], hndv[H * N * D], nhdk[N * H * D], nhdv[N * H * D];
    fill(&r, hndk, sizeof hndk / 4, 1.0);
    fill(&r, hndv, sizeof hndv / 4, 1.0);
    for (int h = 0; h < H; h++)
        for (int j = 0; j < N; j++)
            for (int c = 0; c < D; c++) {
                nhdk[(j * H + h) * D + c] = hndk[(h * N + j) * D + c];
                nhdv[(j * H + h) * D + c] = hndv[(h * N + j) * D + c];
            }
    /* pages of 16 tokens in NHD, scattered in reverse order */
    static float pool_k[3][PAGE * H * D], pool_v[3][PAGE * H * D];
    const void *pk[3], *pv[3];
    for (int pg = 0; pg < 3; pg++) {
        int slot = 2 - pg;
        for (int j = 0; j < PAGE && pg * PAGE + j < N; j++) {
            memcpy(&pool_k[slot][j * H * D], &nhdk[(pg * PAGE + j) * H * D], sizeof(float) * H * D);
            memcpy(&pool_v[slot][j * H * D], &nhdv[(pg * PAGE + j) * H * D], sizeof(float) * H * D);
        }
        pk[pg] = pool_k[slot];
        pv[pg] = pool_v[slot];
    }
    struct kvcap_tensor_view views[3][2] = {
        {{hndk, NULL, 0, KVCAP_DTYPE_F32, N * D, D}, {hndv, NULL, 0, KVCAP_DTYPE_F32, N * D, D}},
        {{nhdk, NULL, 0, KVCAP_DTYPE_F32, D, H * D}, {nhdv, NULL, 0, KVCAP_DTYPE_F32, D, H * D}},
        {{NULL, pk, PAGE, KVCAP_DTYPE_F32, D, H * D}, {NULL, pv, PAGE, KVCAP_DTYPE_F32, D, H * D}}};
    float q[4 * D], out[3][4 * D];
    fill(&r, q, 4 * D, 1.0);
    for (int i = 0; i < 3; i++) {
        struct kvcap_cache *c = make_cache(&g, 1, KVCAP_DTYPE_F32, NULL, ALL_FULL);
        struct kvcap_span_desc desc = {KVCAP_SPAN_TEXT, N, 0, 0, 0};
        assert_int_equal(kvcap_cache_add_span(c, 0, 0, &desc, &views[i][0], &views[i][1]), KVCAP_OK);
        assert_int_equal(kvcap_cache_attend(c, 0, q, out[i]), KVCAP_OK);
        kvcap_cache_free(c);
    }
    assert_memory_equal(out[0], out[1], sizeof out[0]);
    assert_memory_equal(out[0], out[2], sizeof out[0]);
}

/* Compressed spans hold only H, Ṽ and μ: (h + rv)/(2n) of full plus μ. */
static void test_bytes_held(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    /* r = 0.4 on a 16x16 dense grid: rk = h = rv = round(0.4 * 256) = 102 */
    const struct test_bucket tb[1] = {{16, 16, 0, 0, 102, 102, 102}};
    struct kvcap_artifact *a = test_artifact(&g, tb, 1, 3, "bytes");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 8);
    struct scenario sc = {.g = g, .n_seqs = 2};
    scenario_add(&sc, 0, KVCAP_SPAN_VISION, 16, 16, 0, &r);
    scenario_add(&sc, 1, KVCAP_SPAN_VISION, 16, 16, 50, &r);
    for (int storage = 0; storage < 2; storage++) {
        struct kvcap_cache *c = make_cache(&g, 2, storage ? KVCAP_DTYPE_F16 : KVCAP_DTYPE_F32, a, NULL);
        scenario_load(&sc, c);
        struct kvcap_cache_stats st;
        assert_int_equal(kvcap_cache_stats(c, &st), KVCAP_OK);
        double ratio = (double)st.bytes_by_policy[KVCAP_POLICY_KVCAPSULE] /
                       (double)st.bytes_full_equivalent;
        double r_target = 102.0 / 256.0;
        if (!(ratio <= r_target + 0.01))
            fail_msg("kvcapsule holds %.4f of full, target r %.4f + 1%%", ratio, r_target);
        assert_int_equal(st.bytes_held, st.bytes_by_policy[KVCAP_POLICY_KVCAPSULE]);
        kvcap_cache_free(c);
    }
    scenario_free(&sc);
    kvcap_artifact_free(a);
}

/* kvcap's exact tiles: each KV head keeps its worst-reconstructed tiles as plain rows and the
 * rest compressed. Outputs match the reference (which picks the tiles by the same rule in
 * double), in one and in three threads; bytes are the compressed tiles' state plus the exact
 * tiles' rows; a count past the span's tiles keeps all but one; a planted outlier's tile is
 * among those kept. */
static void test_exact_tiles(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    const struct test_bucket tb[2] = {{8, 8, 4, 4, 5, 4, 6}, {4, 6, 0, 0, 8, 6, 7}};
    struct kvcap_artifact *a = test_artifact(&g, tb, 2, 91, "exact");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 93);
    for (int exact = 1; exact <= 9; exact += 8) {
        struct scenario sc = {.g = g, .n_seqs = 2, .exact_tiles = exact};
        scenario_add(&sc, 0, KVCAP_SPAN_TEXT, 1, 5, 0, &r);
        scenario_add(&sc, 0, KVCAP_SPAN_VISION, 8, 8, 5, &r);  /* 4 tiles */
        scenario_add(&sc, 1, KVCAP_SPAN_VISION, 4, 6, 40, &r); /* dense: one tile, none exact */
        scenario_add(&sc, 1, KVCAP_SPAN_VISION, 8, 8, 64, &r);
        /* an outlier token, key and value, in tile 3 of the first tiled span, every layer and
         * head: that tile is kept first */
        size_t j = kvcap_bucket_token(&a->buckets[0], 3, 6), n = 64;
        for (int l = 0; l < g.n_layers; l++)
            for (int h = 0; h < 2 * g.n_kv_heads; h++)
                for (int c = 0; c < g.head_dim; c++)
                    sc.spans[0][1].kv[l][((size_t)h * n + j) * g.head_dim + c] *= 6.0f;
        scenario_gen(&sc, 0, 2, &r);
        char yaml[160];
        snprintf(yaml, sizeof yaml,
                 "policies: {vision: kvcapsule}\nfallback: full\nkvcapsule: {exact_tiles: %d}\n",
                 exact);
        for (int threads = 1; threads <= 3; threads += 2) {
            struct kvcap_cache *c = make_cache_threads(&g, 2, KVCAP_DTYPE_F32, a, yaml, threads);
            scenario_load(&sc, c);
            scenario_check(&sc, a, c, FUSED_REL_TOL, &r);
            struct kvcap_cache_stats st;
            assert_int_equal(kvcap_cache_stats(c, &st), KVCAP_OK);
            /* per layer and KV head: the tiled spans' compressed tiles (h + rv rows each), the
             * exact tiles' K and V rows, μ per span; the dense span's one tile */
            int held = exact < 4 ? exact : 3, d = g.head_dim;
            uint64_t per_head = 2 * ((uint64_t)(4 - held) * (4 + 6) * d + 2 * 16 * held * d + d) +
                                (uint64_t)(6 + 7) * d + d;
            uint64_t want = per_head * g.n_kv_heads * g.n_layers * sizeof(float);
            if (st.bytes_by_policy[KVCAP_POLICY_KVCAPSULE] != want)
                fail_msg("exact_tiles %d: kvcapsule holds %llu bytes, expected %llu", exact,
                         (unsigned long long)st.bytes_by_policy[KVCAP_POLICY_KVCAPSULE],
                         (unsigned long long)want);
            kvcap_cache_free(c);
        }
        /* the rule keeps the outlier's tile first: its value rows come back exact */
        const float *xk = sc.spans[0][1].kv[0], *xv = xk + (size_t)g.n_kv_heads * n * g.head_dim;
        float *kh = malloc(sizeof(float) * n * g.head_dim), *vh = malloc(sizeof(float) * n * g.head_dim);
        materialise(a, &g, 0, 0, 0, 5, xk, xv, (int)n, kh, vh);
        assert_memory_not_equal(vh + j * g.head_dim, xv + j * g.head_dim, sizeof(float) * g.head_dim);
        exact_tiles_back(a, &g, 0, 5, xk, xv, (int)n, 1, kh, vh);
        assert_memory_equal(vh + j * g.head_dim, xv + j * g.head_dim, sizeof(float) * g.head_dim);
        free(kh), free(vh);
        scenario_free(&sc);
    }
    kvcap_artifact_free(a);
}

static void expect_status(enum kvcap_status got, enum kvcap_status want, const char *needle)
{
    if (got != want || !strstr(kvcap_last_error(), needle))
        fail_msg("status %s, message \"%s\"; expected %s naming \"%s\"", kvcap_status_str(got),
                 kvcap_last_error(), kvcap_status_str(want), needle);
}

static void test_invalid_calls_leave_cache_usable(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    const struct test_bucket tb[1] = {{4, 4, 0, 0, 4, 4, 4}};
    struct kvcap_artifact *a = test_artifact(&g, tb, 1, 4, "invalid");
    /* an artifact of another model */
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = geometry(2, 8, 2, 64);
    p.artifact = a;
    struct kvcap_cache *bad = NULL;
    expect_status(kvcap_cache_create(&p, &bad), KVCAP_ERR_GEOMETRY, "model.q_heads");
    assert_null(bad);

    /* the engine's threads without saying how many */
    struct engine_pool engine = {2, 0, 0, 0};
    kvcap_cache_default_params(&p);
    p.model = g;
    p.parallel_for = engine_parallel_for;
    p.parallel_user = &engine;
    expect_status(kvcap_cache_create(&p, &bad), KVCAP_ERR_INVALID_ARGUMENT, "params.n_threads");
    assert_null(bad);

    /* empty paths are named, not taken for a file in the current folder */
    kvcap_cache_default_params(&p);
    p.model = g;
    p.config_path = "";
    expect_status(kvcap_cache_create(&p, &bad), KVCAP_ERR_INVALID_ARGUMENT, "params.config_path");
    p.config_path = NULL;
    p.record_dir = "";
    expect_status(kvcap_cache_create(&p, &bad), KVCAP_ERR_INVALID_ARGUMENT, "params.record_dir");
    assert_null(bad);

    /* the runtime YAML given in memory: read like a file, its errors named by line and column,
     * and never together with a path */
    kvcap_cache_default_params(&p);
    p.model = g;
    p.config_yaml = "policies: {vision: streaming}\nstreaming: {sinks: 2, window: 8}\n";
    assert_int_equal(kvcap_cache_create(&p, &bad), KVCAP_OK);
    kvcap_cache_free(bad);
    bad = NULL;
    p.config_yaml = "policies: {vision: streaming}\nstreaming: {sinks: -1}\n";
    expect_status(kvcap_cache_create(&p, &bad), KVCAP_ERR_CONFIG, "params.config_yaml:2:");
    p.config_yaml = "policies: {generated: flashcache}\n"; /* valid YAML, refused at create */
    expect_status(kvcap_cache_create(&p, &bad), KVCAP_ERR_INVALID_ARGUMENT, "policies.generated");
    p.config_yaml = "policies: {vision: streaming}\n";
    p.config_path = "runtime.yaml";
    expect_status(kvcap_cache_create(&p, &bad), KVCAP_ERR_INVALID_ARGUMENT, "params.config_yaml");
    assert_null(bad);

    /* device memory where no device can serve it (a build without CUDA, or no device): refused,
     * naming params.memory */
    if (kvcap_cuda_device_count() == 0) {
        kvcap_cache_default_params(&p);
        p.model = g;
        p.memory = KVCAP_MEMORY_CUDA;
        expect_status(kvcap_cache_create(&p, &bad), KVCAP_ERR_UNSUPPORTED, "params.memory");
        assert_null(bad);
    }

    struct kvcap_cache *c = make_cache(&g, 1, KVCAP_DTYPE_F16, a, NULL);
    static float kv[2 * 2 * 16 * 64];
    struct kvcap_tensor_view k = hnd(kv, 16, 64), v = hnd(kv + 2 * 16 * 64, 16, 64);
    struct kvcap_span_desc ok = {KVCAP_SPAN_VISION, 16, 4, 4, 3};
    struct kvcap_span_desc wrong_grid = {KVCAP_SPAN_VISION, 16, 4, 5, 3};
    expect_status(kvcap_cache_add_span(c, 0, 2, &ok, &k, &v), KVCAP_ERR_INVALID_ARGUMENT, "layer: 2");
    expect_status(kvcap_cache_add_span(c, 1, 0, &ok, &k, &v), KVCAP_ERR_INVALID_ARGUMENT, "seq: 1");
    expect_status(kvcap_cache_add_span(c, 0, 0, &wrong_grid, &k, &v), KVCAP_ERR_INVALID_ARGUMENT,
                  "grid 4x5");
    /* 65536 * 65537 wraps to 65536 in int arithmetic: the grid must still be refused (before
     * anything reads 65536 tokens from 16-token views) */
    struct kvcap_span_desc wrapping_grid = {KVCAP_SPAN_VISION, 65536, 65536, 65537, 3};
    expect_status(kvcap_cache_add_span(c, 0, 0, &wrapping_grid, &k, &v),
                  KVCAP_ERR_INVALID_ARGUMENT, "grid 65536x65537 does not hold n_tokens 65536");
    struct kvcap_tensor_view k_i32 = k;
    k_i32.dtype = KVCAP_DTYPE_I32;
    expect_status(kvcap_cache_add_span(c, 0, 0, &ok, &k_i32, &v), KVCAP_ERR_INVALID_ARGUMENT,
                  "k.dtype: I32");
    expect_status(kvcap_cache_add_span(c, 0, 1, &ok, &k, &v), KVCAP_ERR_INVALID_ARGUMENT,
                  "not added at layer 0");
    float q[4 * 64] = {0}, out[4 * 64];
    expect_status(kvcap_cache_attend(c, 5, q, out), KVCAP_ERR_INVALID_ARGUMENT, "layer: 5");
    /* poison is refused, named, and stores nothing (it used to come back as finite outputs
     * with status OK) */
    kv[2 * 16 * 64 + 5 * 64 + 7] = NAN; /* v, head 0, token 5, channel 7 */
    expect_status(kvcap_cache_add_span(c, 0, 0, &ok, &k, &v), KVCAP_ERR_NUMERIC,
                  "add_span: v: non-finite value nan at head 0, token 5, channel 7");
    kv[2 * 16 * 64 + 5 * 64 + 7] = 0.0f;
    /* still usable */
    assert_int_equal(kvcap_cache_add_span(c, 0, 0, &ok, &k, &v), KVCAP_OK);
    assert_int_equal(kvcap_cache_add_span(c, 0, 1, &ok, &k, &v), KVCAP_OK);
    assert_int_equal(kvcap_cache_attend(c, 1, q, out), KVCAP_OK);
    q[64 + 3] = INFINITY;
    expect_status(kvcap_cache_attend(c, 1, q, out), KVCAP_ERR_NUMERIC,
                  "attend: q: non-finite value inf at seq 0, head 1, channel 3");
    q[64 + 3] = 0.0f;
    static float tok[2 * 2 * 64];
    struct kvcap_tensor_view tk = {tok, NULL, 0, KVCAP_DTYPE_F32, 64, 0};
    struct kvcap_tensor_view tv = {tok + 2 * 64, NULL, 0, KVCAP_DTYPE_F32, 64, 0};
    tok[2 * 64 + 64 + 9] = NAN;
    expect_status(kvcap_cache_append(c, 0, 1, &tk, &tv), KVCAP_ERR_NUMERIC,
                  "append: v: non-finite value nan at head 1, channel 9");
    struct kvcap_cache_stats st;
    assert_int_equal(kvcap_cache_stats(c, &st), KVCAP_OK);
    assert_int_equal(st.tokens_by_kind[KVCAP_SPAN_GENERATED], 0);
    tok[2 * 64 + 64 + 9] = 0.0f;
    assert_int_equal(kvcap_cache_append(c, 0, 1, &tk, &tv), KVCAP_OK);
    assert_int_equal(kvcap_cache_attend(c, 1, q, out), KVCAP_OK);
    kvcap_cache_free(c);

    /* a grid without bucket and no fallback */
    c = make_cache(&g, 1, KVCAP_DTYPE_F16, a, "policies: {vision: kvcapsule}\nfallback: none\n");
    static float big[2 * 2 * 25 * 64];
    struct kvcap_tensor_view bk = hnd(big, 25, 64), bv = hnd(big + 2 * 25 * 64, 25, 64);
    struct kvcap_span_desc nobucket = {KVCAP_SPAN_VISION, 25, 5, 5, 0};
    expect_status(kvcap_cache_add_span(c, 0, 0, &nobucket, &bk, &bv), KVCAP_ERR_NOT_FOUND,
                  "no bucket in the artifact");
    assert_int_equal(kvcap_cache_add_span(c, 0, 0, &ok, &k, &v), KVCAP_OK);
    kvcap_cache_free(c);
    /* vlcache without post-vision queries: named at the end of prefill, cache still usable */
    c = make_cache(&g, 1, KVCAP_DTYPE_F16, NULL, "policies: {vision: vlcache}\n");
    assert_int_equal(kvcap_cache_add_span(c, 0, 0, &ok, &k, &v), KVCAP_OK);
    expect_status(kvcap_cache_end_prefill(c, 0), KVCAP_ERR_STATE, "layer 1 has 0 spans");
    assert_int_equal(kvcap_cache_add_span(c, 0, 1, &ok, &k, &v), KVCAP_OK);
    expect_status(kvcap_cache_attend(c, 1, q, out), KVCAP_ERR_STATE, "post-vision queries");
    float post[4 * 2 * 64] = {0};
    for (int l = 0; l < 2; l++)
        assert_int_equal(kvcap_cache_add_post_queries(c, 0, l, post, 2), KVCAP_OK);
    assert_int_equal(kvcap_cache_attend(c, 1, q, out), KVCAP_OK);
    kvcap_cache_free(c);
    /* generated tokens only take token-by-token policies */
    kvcap_cache_default_params(&p);
    p.model = g;
    char cfg[512];
    tmp_path(cfg, sizeof cfg, "runtime.yaml");
    FILE *f = fopen(cfg, "w");
    fputs("policies: {generated: flashcache}\n", f);
    fclose(f);
    p.config_path = cfg;
    expect_status(kvcap_cache_create(&p, &c), KVCAP_ERR_INVALID_ARGUMENT, "policies.generated");
    unlink(cfg);
    /* kvcapsule without an artifact */
    kvcap_cache_default_params(&p);
    p.model = g;
    f = fopen(cfg, "w");
    fputs("policies: {vision: streaming}\n", f);
    fclose(f);
    p.config_path = cfg;
    assert_int_equal(kvcap_cache_create(&p, &c), KVCAP_OK);
    kvcap_cache_free(c);
    unlink(cfg);
    kvcap_artifact_free(a);
    kvcap_cache_free(NULL);
    kvcap_artifact_free(NULL);
}

/* One synthetic span (all layers) into the cache of sequence `seq`, as an engine would. */
static void add_synth_span(struct kvcap_cache *c, const struct kvcap_model_geometry *g,
                           const struct kvcap_synth_params *sp, int64_t index, int seq,
                           float *qdec /* [layers][q_heads][t][d] out */)
{
    int rows, cols, p0, d = g->head_dim, H = g->n_kv_heads, G = g->n_q_heads / H;
    kvcap_synth_span_layout(sp, index, &rows, &cols, &p0);
    int n = rows * cols;
    float *kf = malloc(sizeof(float) * (size_t)n * d);
    float *k = malloc(sizeof(float) * (size_t)H * n * d), *v = malloc(sizeof(float) * (size_t)H * n * d);
    for (int l = 0; l < g->n_layers; l++) {
        for (int h = 0; h < H; h++)
            assert_int_equal(kvcap_synth_head(g, sp, index, rows, cols, p0, l, h, kf,
                                              k + (size_t)h * n * d, v + (size_t)h * n * d, NULL,
                                              qdec + (((size_t)l * g->n_q_heads + (size_t)h * G) *
                                                      (size_t)sp->decode_queries) * d),
                             KVCAP_OK);
        struct kvcap_span_desc desc = {KVCAP_SPAN_VISION, n, rows, cols, p0};
        struct kvcap_tensor_view kv = hnd(k, n, d), vv = hnd(v, n, d);
        if (kvcap_cache_add_span(c, seq, l, &desc, &kv, &vv) != KVCAP_OK)
            fail_msg("%s", kvcap_last_error());
    }
    free(kf), free(k), free(v);
}

/* Decode query t of every sequence at layer l, [seqs][q_heads][d] from per-seq [L][Hq][T][d]. */
static void gather_queries(const struct kvcap_model_geometry *g, float *const *qdec, int n_seqs,
                           int T, int l, int t, float *q)
{
    int d = g->head_dim;
    for (int s = 0; s < n_seqs; s++)
        for (int hq = 0; hq < g->n_q_heads; hq++)
            memcpy(q + ((size_t)s * g->n_q_heads + hq) * d,
                   qdec[s] + (((size_t)l * g->n_q_heads + hq) * T + t) * d, sizeof(float) * d);
}

static void test_record_calibrate_convert_decode(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    struct kvcap_synth_params sp;
    kvcap_synth_default_params(&sp);
    sp.n_grids = 1;
    sp.grid_rows[0] = sp.grid_cols[0] = 8;
    sp.rank_k = 10;
    sp.rank_v = 10;
    sp.noise = 0.02;
    sp.outliers = 0;
    sp.decode_queries = 3;
    int T = sp.decode_queries, d = g.head_dim, Hq = g.n_q_heads;
    char dir[512], state_path[600], art_path[600];
    tmp_path(dir, sizeof dir, "record");
    snprintf(state_path, sizeof state_path, "%s.kvcs", dir);
    snprintf(art_path, sizeof art_path, "%s.kvcap", dir);

    /* 1. record: 2 sequences, 12 rounds of (a new image span each, then T decode steps) */
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = g;
    p.n_seqs = 2;
    p.record_dir = dir;
    struct kvcap_cache *c = NULL;
    if (kvcap_cache_create(&p, &c) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    float *qdec[2], *q = malloc(sizeof(float) * 2 * Hq * d), *out = malloc(sizeof(float) * 2 * Hq * d);
    for (int s = 0; s < 2; s++)
        qdec[s] = malloc(sizeof(float) * (size_t)g.n_layers * Hq * T * d);
    for (int round = 0; round < 12; round++) {
        for (int s = 0; s < 2; s++)
            add_synth_span(c, &g, &sp, 2 * round + s, s, qdec[s]);
        for (int t = 0; t < T; t++)
            for (int l = 0; l < g.n_layers; l++) {
                gather_queries(&g, qdec, 2, T, l, t, q);
                assert_int_equal(kvcap_cache_attend(c, l, q, out), KVCAP_OK);
            }
    }
    assert_int_equal(kvcap_cache_record_flush(c), KVCAP_OK);
    kvcap_cache_free(c);

    /* 2. calibrate on the recording, 3. convert */
    struct kvcap_calib_config cfg;
    const char *yaml = "model: {name: test, layers: 2, q_heads: 4, kv_heads: 2, head_dim: 64,"
                       " rope: {type: rope, pairing: half, theta: 10000}}\n"
                       "buckets: [{rows: 8, cols: 8}]\n"
                       "schedule: {kind: uniform, ratio: 0.5}\n"
                       "validation: {fraction: 0.25}\nstorage: f32\n";
    assert_int_equal(kvcap_calib_config_load_string(yaml, "roundtrip.yaml", &cfg), KVCAP_OK);
    struct kvcap_calibrate_options o;
    kvcap_calibrate_default_options(&o);
    const char *paths[1] = {dir};
    o.data = paths;
    o.n_data = 1;
    struct kvcap_calib_state st;
    struct kvcap_calibrate_report rep;
    if (kvcap_calibrate(&cfg, &o, &st, &rep) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_int_equal(rep.spans_seen, 24);
    assert_true(st.val_spans[0] > 0);
    double promised = 0; /* the report's attention error, worst unit */
    for (int i = 0; i < g.n_layers * g.n_kv_heads; i++)
        promised = fmax(promised, st.units[i].metrics[KVCAP_METRIC_ATTN_REL]);
    assert_true(promised > 0 && promised < 0.2);
    assert_int_equal(kvcap_calib_state_write(&st, state_path), KVCAP_OK);
    kvcap_calib_state_free(&st);
    kvcap_calib_config_free(&cfg);
    struct kvcap_convert_options co;
    kvcap_convert_default_options(&co);
    const char *states[1] = {state_path};
    co.states = states;
    co.n_states = 1;
    co.out = art_path;
    co.storage = KVCAP_DTYPE_F32;
    co.storage_set = 1;
    struct kvcap_convert_report crep;
    if (kvcap_convert(&co, &crep) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());

    /* 4. decode on new spans through the artifact, against full attention on the same data */
    struct kvcap_artifact *a = NULL;
    assert_int_equal(kvcap_artifact_open(art_path, &a), KVCAP_OK);
    struct kvcap_cache *full = make_cache(&g, 2, KVCAP_DTYPE_F32, NULL, ALL_FULL);
    struct kvcap_cache *comp = make_cache(&g, 2, KVCAP_DTYPE_F32, a, NULL);
    for (int s = 0; s < 2; s++) {
        add_synth_span(full, &g, &sp, 1000 + s, s, qdec[s]);
        add_synth_span(comp, &g, &sp, 1000 + s, s, qdec[s]);
    }
    float *out_full = malloc(sizeof(float) * 2 * Hq * d);
    double err = 0, energy = 0;
    for (int t = 0; t < T; t++)
        for (int l = 0; l < g.n_layers; l++) {
            gather_queries(&g, qdec, 2, T, l, t, q);
            assert_int_equal(kvcap_cache_attend(full, l, q, out_full), KVCAP_OK);
            assert_int_equal(kvcap_cache_attend(comp, l, q, out), KVCAP_OK);
            for (int i = 0; i < 2 * Hq * d; i++) {
                err += (double)(out[i] - out_full[i]) * (out[i] - out_full[i]);
                energy += (double)out_full[i] * out_full[i];
            }
        }
    double rel = sqrt(err / energy);
    /* fresh spans and queries, same distribution: within 2x the worst promised unit */
    if (!(rel <= 2 * promised))
        fail_msg("decode relative error %g, calibration promised <= %g", rel, promised);
    struct kvcap_cache_stats cs;
    assert_int_equal(kvcap_cache_stats(comp, &cs), KVCAP_OK);
    assert_true(cs.bytes_by_policy[KVCAP_POLICY_KVCAPSULE] < cs.bytes_full_equivalent * 0.52);
    kvcap_cache_free(full);
    kvcap_cache_free(comp);
    kvcap_artifact_free(a);
    free(out_full), free(q), free(out), free(qdec[0]), free(qdec[1]);
    unlink(state_path);
    unlink(art_path);
    test_rm_tree(dir);
}


/* The spans of the dataset recorded in `dir`, in order, as "ROWSxCOLS@P0" (+"+q" when the span
 * has post-vision queries) joined by spaces; "" when nothing was written yet. */
static void recorded(const char *dir, char *out, size_t cap)
{
    const char *paths[1] = {dir};
    struct kvcap_dataset *ds = NULL;
    out[0] = '\0';
    if (kvcap_dataset_open(paths, 1, &ds) != KVCAP_OK)
        return;
    const struct kvcap_span_view *sv;
    size_t used = 0;
    while (kvcap_dataset_next(ds, &sv) == KVCAP_OK && sv && used < cap)
        used += (size_t)snprintf(out + used, cap - used, "%s%dx%d@%d%s", used ? " " : "",
                                 sv->rows, sv->cols, sv->p0, sv->q_post[0] ? "+q" : "");
    kvcap_dataset_close(ds);
}

static void expect_recorded(const char *dir, const char *want)
{
    char got[512];
    recorded(dir, got, sizeof got);
    if (strcmp(got, want) != 0)
        fail_msg("recorded \"%s\", expected \"%s\"", got, want);
}

static struct kvcap_cache *record_cache(const struct kvcap_model_geometry *g, int n_seqs,
                                        const char *dir)
{
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = *g;
    p.n_seqs = n_seqs;
    p.record_dir = dir;
    struct kvcap_cache *c = NULL;
    if (kvcap_cache_create(&p, &c) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    return c;
}

/* Record mode keeps what it cannot write yet. A flush while another sequence is in the middle
 * of its prefill writes the spans of the sequence whose prefill ended and keeps the other's for
 * a later flush (it used to drop them: every call OK, no span written), also once all its
 * layers are in but its post-vision queries may still come. A prompt with two images added
 * layer by layer records both (the first used to be dropped when the second started). */
static void test_record_flush_keeps_prefill(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    char dir[512];
    tmp_path(dir, sizeof dir, "record-keep");
    static float kv[2 * 2 * 16 * 64];
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        kv[i] = (float)sin(0.37 * (double)i);
    struct kvcap_tensor_view k = hnd(kv, 16, 64), v = hnd(kv + 2 * 16 * 64, 16, 64);
    const struct kvcap_span_desc a = {KVCAP_SPAN_VISION, 16, 4, 4, 3},
                                 text = {KVCAP_SPAN_TEXT, 16, 0, 0, 19},
                                 b = {KVCAP_SPAN_VISION, 16, 2, 8, 35},
                                 c1 = {KVCAP_SPAN_VISION, 16, 8, 2, 7};
    struct kvcap_cache *c = record_cache(&g, 2, dir);
    /* seq 0: image, text, image, layer by layer; seq 1: its image at layer 0 only */
    for (int l = 0; l < g.n_layers; l++) {
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &a, &k, &v), KVCAP_OK);
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &text, &k, &v), KVCAP_OK);
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &b, &k, &v), KVCAP_OK);
    }
    assert_int_equal(kvcap_cache_add_span(c, 1, 0, &c1, &k, &v), KVCAP_OK);
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_OK);
    assert_int_equal(kvcap_cache_record_flush(c), KVCAP_OK);
    expect_recorded(dir, "4x4@3 2x8@35");
    /* seq 1 completes its layers and adds post-vision queries: still in prefill, kept */
    assert_int_equal(kvcap_cache_add_span(c, 1, 1, &c1, &k, &v), KVCAP_OK);
    assert_int_equal(kvcap_cache_record_flush(c), KVCAP_OK);
    static const float post[4 * 2 * 64];
    for (int l = 0; l < g.n_layers; l++)
        assert_int_equal(kvcap_cache_add_post_queries(c, 1, l, post, 2), KVCAP_OK);
    assert_int_equal(kvcap_cache_record_flush(c), KVCAP_OK);
    expect_recorded(dir, "4x4@3 2x8@35");
    /* its prefill ends: the next flush writes it, queries included */
    assert_int_equal(kvcap_cache_end_prefill(c, 1), KVCAP_OK);
    assert_int_equal(kvcap_cache_record_flush(c), KVCAP_OK);
    expect_recorded(dir, "4x4@3 2x8@35 8x2@7+q");
    /* what was written is what the engine handed over (f16 shards: to f16 rounding) */
    const char *paths[1] = {dir};
    struct kvcap_dataset *ds = NULL;
    assert_int_equal(kvcap_dataset_open(paths, 1, &ds), KVCAP_OK);
    const struct kvcap_span_view *sv = NULL;
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvcap_dataset_next(ds, &sv), KVCAP_OK);
    float *got = malloc(sizeof(float) * 2 * 16 * 64);
    assert_int_equal(kvcap_convert_to_f32(sv->k[1]->dtype, sv->k[1]->data, 2 * 16 * 64, got),
                     KVCAP_OK);
    for (int i = 0; i < 2 * 16 * 64; i++)
        assert_true(fabsf(got[i] - kv[i]) <= 1e-3f);
    free(got);
    kvcap_dataset_close(ds);
    kvcap_cache_free(c);
    test_rm_tree(dir);
}

/* Record mode refuses, when the engine adds it, a vision span whose grid the dataset format
 * cannot hold, naming the argument (it used to take the span and lose it when the shard was
 * written); the cache stays usable. Without record mode the same span is fine. */
static void test_record_refuses_unrecordable_grid(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    enum { WIDE = 5000 }; /* 1 x 5000: 5000 tokens are fine, a side over 4096 is not */
    float *kv = calloc((size_t)2 * 2 * WIDE * 64, sizeof *kv);
    struct kvcap_tensor_view wk = hnd(kv, WIDE, 64), wv = hnd(kv + 2 * WIDE * 64, WIDE, 64);
    struct kvcap_tensor_view k = hnd(kv, 16, 64), v = hnd(kv + 2 * 16 * 64, 16, 64);
    const struct kvcap_span_desc wide = {KVCAP_SPAN_VISION, WIDE, 1, WIDE, 0},
                                 ok = {KVCAP_SPAN_VISION, 16, 4, 4, 0};
    char dir[512];
    tmp_path(dir, sizeof dir, "record-grid");
    struct kvcap_cache *c = record_cache(&g, 1, dir);
    expect_status(kvcap_cache_add_span(c, 0, 0, &wide, &wk, &wv), KVCAP_ERR_INVALID_ARGUMENT,
                  "span.cols: 5000 is outside 1..4096");
    struct kvcap_cache_stats st;
    assert_int_equal(kvcap_cache_stats(c, &st), KVCAP_OK);
    assert_int_equal(st.tokens_by_kind[KVCAP_SPAN_VISION], 0); /* nothing stored */
    for (int l = 0; l < g.n_layers; l++)
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &ok, &k, &v), KVCAP_OK);
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_OK);
    assert_int_equal(kvcap_cache_record_flush(c), KVCAP_OK);
    expect_recorded(dir, "4x4@0");
    kvcap_cache_free(c);
    test_rm_tree(dir);

    c = make_cache(&g, 1, KVCAP_DTYPE_F32, NULL, ALL_FULL);
    for (int l = 0; l < g.n_layers; l++)
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &wide, &wk, &wv), KVCAP_OK);
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_OK);
    kvcap_cache_free(c);
    free(kv);
}

/* A prefill that some layers never got is an error naming the sequence and the layer under
 * every policy, from end_prefill and from the append and attend that end it implicitly (it
 * passed unnoticed unless a cross-layer policy had a span pending, and attention at the layers
 * without the span ignored the image). Adding the missing spans makes the cache whole again. */
static void test_incomplete_prefill_named(void **state)
{
    (void)state;
    static const char *const configs[] = {
        ALL_FULL, "policies: {vision: streaming, text: full, generated: full}\n",
        "policies: {vision: full, text: full, generated: freekv}\n",
        NULL /* host defaults: vision spans to flashcache */};
    struct kvcap_model_geometry g = geometry(3, 4, 2, 64);
    static float kv[2 * 2 * 16 * 64], tok[2 * 2 * 64];
    struct kvcap_tensor_view k = hnd(kv, 16, 64), v = hnd(kv + 2 * 16 * 64, 16, 64);
    struct kvcap_tensor_view tk = {tok, NULL, 0, KVCAP_DTYPE_F32, 64, 0};
    struct kvcap_tensor_view tv = {tok + 2 * 64, NULL, 0, KVCAP_DTYPE_F32, 64, 0};
    const struct kvcap_span_desc img = {KVCAP_SPAN_VISION, 16, 4, 4, 2},
                                 text = {KVCAP_SPAN_TEXT, 16, 0, 0, 18};
    float q[2 * 4 * 64] = {0}, out[2 * 4 * 64];
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        struct kvcap_cache *c = make_cache(&g, 2, KVCAP_DTYPE_F32, NULL, configs[i]);
        for (int l = 0; l < g.n_layers; l++)
            assert_int_equal(kvcap_cache_add_span(c, 0, l, &img, &k, &v), KVCAP_OK);
        /* seq 1: the image reached layer 0 only */
        assert_int_equal(kvcap_cache_add_span(c, 1, 0, &img, &k, &v), KVCAP_OK);
        expect_status(kvcap_cache_end_prefill(c, 1), KVCAP_ERR_STATE,
                      "seq 1: prefill is incomplete: layer 1 has 0 spans, layer 0 has 1 (span 0 "
                      "never reached layer 1)");
        expect_status(kvcap_cache_attend(c, 0, q, out), KVCAP_ERR_STATE, "seq 1: prefill");
        expect_status(kvcap_cache_append(c, 1, 0, &tk, &tv), KVCAP_ERR_STATE, "seq 1: prefill");
        assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_OK);
        /* the missing layers come; then a second span misses the last layer */
        for (int l = 1; l < g.n_layers; l++)
            assert_int_equal(kvcap_cache_add_span(c, 1, l, &img, &k, &v), KVCAP_OK);
        for (int l = 0; l < 2; l++)
            assert_int_equal(kvcap_cache_add_span(c, 1, l, &text, &k, &v), KVCAP_OK);
        expect_status(kvcap_cache_end_prefill(c, 1), KVCAP_ERR_STATE,
                      "layer 2 has 1 spans, layer 0 has 2 (span 1 never reached layer 2)");
        assert_int_equal(kvcap_cache_add_span(c, 1, 2, &text, &k, &v), KVCAP_OK);
        assert_int_equal(kvcap_cache_end_prefill(c, 1), KVCAP_OK);
        for (int l = 0; l < g.n_layers; l++) {
            assert_int_equal(kvcap_cache_append(c, 1, l, &tk, &tv), KVCAP_OK);
            assert_int_equal(kvcap_cache_attend(c, l, q, out), KVCAP_OK);
        }
        kvcap_cache_free(c);
    }
}

/* kvcap_cache_uses_policy answers from the config the cache was created with: every span
 * kind, and the fallback only while vision spans go to kvcapsule (it serves those alone). */
static void test_uses_policy(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(1, 2, 1, 64);
    const struct test_bucket tb[1] = {{4, 4, 0, 0, 4, 3, 3}};
    struct kvcap_artifact *a = test_artifact(&g, tb, 1, 5, "uses");
    struct kvcap_cache *c = make_cache(&g, 1, KVCAP_DTYPE_F32, NULL,
                                       "policies: {vision: vlcache, text: kvzip}\n"
                                       "fallback: expected_attention\n");
    assert_int_equal(kvcap_cache_uses_policy(c, KVCAP_POLICY_VLCACHE), 1);
    assert_int_equal(kvcap_cache_uses_policy(c, KVCAP_POLICY_KVZIP), 1);
    assert_int_equal(kvcap_cache_uses_policy(c, KVCAP_POLICY_FULL), 1); /* generated */
    assert_int_equal(kvcap_cache_uses_policy(c, KVCAP_POLICY_EXPECTED_ATTENTION), 0);
    assert_int_equal(kvcap_cache_uses_policy(c, KVCAP_POLICY_FLASHCACHE), 0);
    kvcap_cache_free(c);
    c = make_cache(&g, 1, KVCAP_DTYPE_F32, a, "policies: {vision: kvcapsule}\n"
                                              "fallback: expected_attention\n");
    assert_int_equal(kvcap_cache_uses_policy(c, KVCAP_POLICY_KVCAPSULE), 1);
    assert_int_equal(kvcap_cache_uses_policy(c, KVCAP_POLICY_EXPECTED_ATTENTION), 1);
    assert_int_equal(kvcap_cache_uses_policy(c, KVCAP_POLICY_KVZIP), 0);
    assert_int_equal(kvcap_cache_uses_policy(NULL, KVCAP_POLICY_FULL), 0);
    kvcap_cache_free(c);
    kvcap_artifact_free(a);
}

/* StreamingLLM's sinks and window each reach 2^30 in the runtime YAML; their sum sizes the ring
 * of generated tokens. A sum past KVCAP_CONFIG_MAX_TOKENS is refused by name (it overflowed an
 * int and the first generated token was written far past the buffer); one at the bound decodes
 * like a full cache, since the ring is never reached. */
static void test_streaming_bounds(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = g;
    p.storage = KVCAP_DTYPE_F32;
    struct kvcap_cache *c = NULL;
    p.config_yaml = "policies: {generated: streaming}\n"
                    "streaming: {sinks: 1073741824, window: 1073741824}\n";
    expect_status(kvcap_cache_create(&p, &c), KVCAP_ERR_CONFIG,
                  "streaming.sinks + streaming.window: 1073741824 + 1073741824 = 2147483648 "
                  "tokens, at most 1073741824");
    assert_null(c);
    static const char *const at_bound[] = {
        "policies: {text: streaming, generated: streaming}\n"
        "streaming: {sinks: 536870912, window: 536870912}\n",
        "policies: {text: streaming, generated: streaming}\n"
        "streaming: {sinks: 0, window: 1073741824}\n",
        ALL_FULL};
    static float kv[2 * 2 * 8 * 64], tok[2 * 2 * 64];
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        kv[i] = (float)sin(0.37 * (double)i);
    struct kvcap_tensor_view k = hnd(kv, 8, 64), v = hnd(kv + 2 * 8 * 64, 8, 64);
    struct kvcap_tensor_view tk = {tok, NULL, 0, KVCAP_DTYPE_F32, 64, 0};
    struct kvcap_tensor_view tv = {tok + 2 * 64, NULL, 0, KVCAP_DTYPE_F32, 64, 0};
    const struct kvcap_span_desc text = {KVCAP_SPAN_TEXT, 8, 0, 0, 0};
    float q[4 * 64], out[3][4 * 64];
    for (int i = 0; i < 4 * 64; i++)
        q[i] = (float)cos(0.11 * i);
    for (int cfg = 0; cfg < 3; cfg++) {
        c = make_cache(&g, 1, KVCAP_DTYPE_F32, NULL, at_bound[cfg]);
        for (int l = 0; l < g.n_layers; l++)
            assert_int_equal(kvcap_cache_add_span(c, 0, l, &text, &k, &v), KVCAP_OK);
        assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_OK);
        for (int step = 0; step < 70; step++) /* past the first growth (64 rows) */
            for (int l = 0; l < g.n_layers; l++) {
                for (int i = 0; i < 2 * 2 * 64; i++)
                    tok[i] = (float)sin(0.05 * (step * 7 + l + i));
                assert_int_equal(kvcap_cache_append(c, 0, l, &tk, &tv), KVCAP_OK);
                assert_int_equal(kvcap_cache_attend(c, l, q, out[cfg]), KVCAP_OK);
            }
        struct kvcap_cache_stats st;
        assert_int_equal(kvcap_cache_stats(c, &st), KVCAP_OK);
        assert_int_equal(st.tokens_by_kind[KVCAP_SPAN_GENERATED], 70);
        kvcap_cache_free(c);
    }
    for (int i = 0; i < 4 * 64; i++) { /* the same rows as a full cache: the same sums */
        assert_float_equal(out[0][i], out[2][i], 0.0f);
        assert_float_equal(out[1][i], out[2][i], 0.0f);
    }
}

/* ---- Eviction policies in the cache against brute force ------------------------------------ */

/* Head h's rows of segment `seg` (f32 storage) equal the original rows keep[0..n) of x. */
static void expect_rows(const struct kvcap_segment *seg, const struct kvcap_model_geometry *g,
                        int h, const float *xk, const float *xv, const int *keep, int n)
{
    int d = g->head_dim, held;
    size_t at;
    kvcap_segment_head_rows(seg, h, &at, &held); /* either layout: per head or packed */
    assert_int_equal(held, n);
    const float *k = (const float *)seg->k + at * d;
    const float *v = xv ? (const float *)seg->v + at * d : NULL;
    if (!xv) /* values not held as rows (kvzip with values: basis) */
        assert_null(seg->v);
    for (int i = 0; i < n; i++) {
        assert_memory_equal(k + (size_t)i * d, xk + (size_t)keep[i] * d, sizeof(float) * d);
        if (xv)
            assert_memory_equal(v + (size_t)i * d, xv + (size_t)keep[i] * d, sizeof(float) * d);
    }
}

/* Smooth K/V (a few low DCT frequencies along tokens) plus noise and one planted outlier. */
static void smooth_span(struct kvcap_rng *r, float *x, int heads, int n, int d, int outlier)
{
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < d; c++) {
            double a = kvcap_rng_normal(r), b = kvcap_rng_normal(r), ph = kvcap_rng_uniform(r);
            for (int j = 0; j < n; j++)
                x[((size_t)h * n + j) * d + c] =
                    (float)(a * cos(M_PI * (j + ph) / n) + b * cos(2 * M_PI * j / n) +
                            0.05 * kvcap_rng_normal(r) + (j == outlier ? 6.0 : 0.0));
        }
}

static void test_flashcache_in_cache(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(3, 4, 2, 64);
    int L = g.n_layers, H = g.n_kv_heads, d = g.head_dim, n = 90, outlier = 41;
    const int sinks = 3, window = 5, min_tokens = 4;
    const double gamma = 0.1, retention = 0.3;
    struct kvcap_cache *c = make_cache(&g, 1, KVCAP_DTYPE_F32, NULL,
                                       "policies: {vision: flashcache}\n"
                                       "flashcache: {gamma: 0.1, retention: 0.3, min_tokens: 4, "
                                       "sinks: 3, window: 5}\n");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 21);
    float *kv[3];
    for (int l = 0; l < L; l++) {
        kv[l] = malloc(sizeof(float) * 2 * (size_t)H * n * d);
        smooth_span(&r, kv[l], 2 * H, n, d, outlier);
        struct kvcap_span_desc desc = {KVCAP_SPAN_VISION, n, 9, 10, 7};
        struct kvcap_tensor_view kk = hnd(kv[l], n, d), vv = hnd(kv[l] + (size_t)H * n * d, n, d);
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &desc, &kk, &vv), KVCAP_OK);
    }
    struct kvcap_cache_stats before, after;
    assert_int_equal(kvcap_cache_stats(c, &before), KVCAP_OK);
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_OK);
    assert_int_equal(kvcap_cache_stats(c, &after), KVCAP_OK);

    /* brute force: O(N²) DCT deviations, layer weights, budgets, top-k by full selection */
    int N = n - sinks - window, wa, wb;
    kvcap_flashcache_window(n, sinks, n - window, &wa, &wb);
    assert_true(wa < sinks && wb - wa == 90); /* 82 = 2·41 is slow; 90 = 2·3²·5 is not */
    int omega = kvcap_flashcache_omega(gamma, wb - wa);
    double w[3];
    int cap[3] = {N, N, N}, budget[3];
    float *dev = malloc(sizeof(float) * (size_t)L * H * N), *win = malloc(sizeof(float) * n);
    for (int l = 0; l < L; l++) {
        struct kvcap_energy e = {0, 0, 0, 0};
        for (int h = 0; h < H; h++) {
            kvcap_flashcache_deviation_ref(wb - wa, kv[l] + ((size_t)h * n + wa) * d,
                                           kv[l] + ((size_t)(H + h) * n + wa) * d, d, omega,
                                           win, &e);
            memcpy(dev + ((size_t)l * H + h) * N, win + (sinks - wa), sizeof(float) * N);
        }
        w[l] = kvcap_flashcache_layer_weight(&e);
    }
    int64_t total = llround(retention * n * L) - (int64_t)L * (sinks + window);
    assert_int_equal(kvcap_budget_allocate(w, cap, L, min_tokens, total, budget), KVCAP_OK);
    assert_int_equal(budget[0] + budget[1] + budget[2], total); /* the global target, exactly */
    int kept_all = 0, keep[128];
    for (int l = 0; l < L; l++) {
        const struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, 0, l)->segs[0];
        assert_false(seg->pending);
        for (int h = 0; h < H; h++) {
            int m = 0;
            for (int j = 0; j < sinks; j++)
                keep[m++] = j;
            int got = kvcap_topk_indices_ref(dev + ((size_t)l * H + h) * N, N, budget[l], keep + m);
            for (int i = 0; i < got; i++)
                keep[m + i] += sinks;
            m += got;
            for (int j = n - window; j < n; j++)
                keep[m++] = j;
            expect_rows(seg, &g, h, kv[l] + (size_t)h * n * d, kv[l] + (size_t)(H + h) * n * d,
                        keep, m);
            int has_outlier = 0;
            for (int i = 0; i < m; i++)
                has_outlier |= keep[i] == outlier;
            assert_true(has_outlier); /* the planted token survives in every head and layer */
            kept_all += h == 0 ? m : 0;
        }
    }
    assert_int_equal(kept_all, llround(retention * n * L));
    /* the evicted rows are freed: bytes held = kept rows exactly */
    uint64_t row_pair = 2 * (uint64_t)H * d * sizeof(float);
    assert_int_equal(after.bytes_held, (uint64_t)kept_all * row_pair);
    assert_int_equal(before.bytes_held, (uint64_t)n * L * row_pair);
    assert_true(after.compress_seconds > 0);
    free(dev), free(win);
    for (int l = 0; l < L; l++)
        free(kv[l]);
    kvcap_cache_free(c);
}

/* VL-Cache in a cache: a vision span, then nt text tokens (the last tau of them post-vision).
 * Kept per layer: `sinks` first tokens, the top of the rest by column sums, and at the end of
 * the span the larger of `window` and the part of the prompt's recent window (recent_fraction
 * of the layer's budget, counted from the end of the prompt) that reaches into the span. With
 * `uniform` (layer_budgets: uniform, kvcap's variant) every layer's budget is alpha instead of
 * Algorithm 1's. */
static void check_vlcache_in_cache(int nt, int sinks, int window, double recent_fraction,
                                   int uniform)
{
    struct kvcap_model_geometry g = geometry(3, 6, 2, 64);
    int L = g.n_layers, H = g.n_kv_heads, Hq = g.n_q_heads, G = Hq / H, d = g.head_dim;
    const int nv = 120, tau = 6;
    const double alpha = 0.3, p = 0.02;
    char yaml[256];
    snprintf(yaml, sizeof yaml,
             "policies: {vision: vlcache, text: full}\n"
             "vlcache: {p: 0.02, budget: 0.3, min_fraction: 0.05, sinks: %d, window: %d, "
             "recent_fraction: %g, layer_budgets: %s}\n",
             sinks, window, recent_fraction, uniform ? "uniform" : "sparsity");
    struct kvcap_cache *c = make_cache(&g, 1, KVCAP_DTYPE_F32, NULL, yaml);
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 22);
    float *vis[3], *txt[3], *post[3];
    for (int l = 0; l < L; l++) {
        vis[l] = malloc(sizeof(float) * 2 * (size_t)H * nv * d);
        txt[l] = malloc(sizeof(float) * 2 * (size_t)H * nt * d);
        post[l] = malloc(sizeof(float) * (size_t)Hq * tau * d);
        fill(&r, vis[l], 2 * (size_t)H * nv * d, 1.0);
        fill(&r, txt[l], 2 * (size_t)H * nt * d, 1.0);
        fill(&r, post[l], (size_t)Hq * tau * d, 0.6 + 0.5 * l); /* layers differ in sparsity */
        struct kvcap_span_desc dv = {KVCAP_SPAN_VISION, nv, 10, 12, 3};
        struct kvcap_span_desc dt = {KVCAP_SPAN_TEXT, nt, 0, 0, 123};
        struct kvcap_tensor_view a = hnd(vis[l], nv, d), b = hnd(vis[l] + (size_t)H * nv * d, nv, d);
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &dv, &a, &b), KVCAP_OK);
        a = hnd(txt[l], nt, d), b = hnd(txt[l] + (size_t)H * nt * d, nt, d);
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &dt, &a, &b), KVCAP_OK);
        assert_int_equal(kvcap_cache_add_post_queries(c, 0, l, post[l], tau), KVCAP_OK);
    }
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_OK);

    /* brute force: naive A' over the prompt (vision then text), budgets, top-k */
    int m = nv + nt;
    double gam[3], beta[3];
    float *score = malloc(sizeof(float) * (size_t)L * H * m);
    float *qh = malloc(sizeof(float) * (size_t)tau * G * d);
    for (int l = 0; l < L; l++) {
        int64_t below = 0, entries = 0;
        for (int h = 0; h < H; h++) {
            for (int i = 0; i < tau; i++) /* [q_heads][tau][d] → this head's [tau][G][d] */
                for (int gg = 0; gg < G; gg++)
                    memcpy(qh + ((size_t)i * G + gg) * d,
                           post[l] + ((size_t)(h * G + gg) * tau + i) * d, sizeof(float) * d);
            struct kvcap_rows chunks[2] = {
                {vis[l] + (size_t)h * nv * d, NULL, KVCAP_DTYPE_F32, (size_t)d, nv},
                {txt[l] + (size_t)h * nt * d, NULL, KVCAP_DTYPE_F32, (size_t)d, nt}};
            float *sc = score + ((size_t)l * H + h) * m;
            memset(sc, 0, sizeof(float) * (size_t)m);
            assert_int_equal(kvcap_vlcache_head_ref(qh, (size_t)G * d, tau, G, d,
                                                    1.0f / sqrtf((float)d), chunks, 2, (float)p,
                                                    sc, &below, &entries),
                             KVCAP_OK);
        }
        gam[l] = (double)below / (double)entries;
    }
    assert_int_equal(kvcap_vlcache_budgets(gam, L, alpha, 0.05, beta), KVCAP_OK);
    assert_true(gam[0] != gam[2]);
    assert_true(fabs(beta[0] - beta[2]) * nv >= 1); /* the two rules keep different counts */
    for (int l = 0; uniform && l < L; l++)
        beta[l] = alpha;
    for (int l = 0; l < L; l++) {
        const struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, 0, l)->segs[0];
        int total = (int)llround(beta[l] * nv), keep[128];
        /* the recent window counts from the end of the prompt: the text span comes first */
        int recent = (int)ceil(recent_fraction * total - 1e-9) - nt;
        int tail = recent > window ? recent : window;
        if (recent_fraction > 0 && nt < 10)
            assert_true(recent > window); /* the case this variant is for */
        for (int h = 0; h < H; h++) {
            int k = 0;
            for (int j = 0; j < sinks; j++)
                keep[k++] = j;
            int got = kvcap_topk_indices_ref(score + ((size_t)l * H + h) * m + sinks,
                                             nv - sinks - tail, total - sinks - tail, keep + k);
            for (int i = 0; i < got; i++)
                keep[k + i] += sinks;
            k += got;
            for (int j = nv - tail; j < nv; j++)
                keep[k++] = j;
            expect_rows(seg, &g, h, vis[l] + (size_t)h * nv * d,
                        vis[l] + (size_t)(H + h) * nv * d, keep, k);
        }
        /* the text span holds the post-vision tokens and stays whole under `full` */
        assert_int_equal(kvcap_cache_seq_layer(c, 0, l)->segs[1].n_rows, nt);
    }
    free(score), free(qh);
    for (int l = 0; l < L; l++)
        free(vis[l]), free(txt[l]), free(post[l]);
    kvcap_cache_free(c);
}

static void test_vlcache_in_cache(void **state)
{
    (void)state;
    check_vlcache_in_cache(20, 2, 3, 0.1, 0); /* protected: sinks and a window (the extension) */
    check_vlcache_in_cache(6, 0, 0, 0.5, 0);  /* the paper's rule: the recent window reaches
                                               * back through the text into the span, no sinks */
    check_vlcache_in_cache(6, 0, 0, 0.5, 1);  /* kvcap's uniform layer budgets */
}


/* Layer l of a prompt of three spans: text (ns[0] tokens), vision (ns[1] on a rows x ns[1]/rows
 * grid), text (ns[2]), one after another from position 0; x[s] receives span s's K then V
 * ([2][kv_heads][n][d], random), which the caller frees. */
static void add_text_vision_text(struct kvcap_cache *c, const struct kvcap_model_geometry *g,
                                 int l, const int ns[3], int rows, float *x[3],
                                 struct kvcap_rng *r)
{
    const int H = g->n_kv_heads, d = g->head_dim;
    int p0 = 0;
    for (int s = 0; s < 3; s++) {
        x[s] = malloc(sizeof(float) * 2 * (size_t)H * ns[s] * d);
        fill(r, x[s], 2 * (size_t)H * ns[s] * d, 1.0);
        struct kvcap_span_desc ds = {s == 1 ? KVCAP_SPAN_VISION : KVCAP_SPAN_TEXT, ns[s],
                                     s == 1 ? rows : 0, s == 1 ? ns[1] / rows : 0, p0};
        struct kvcap_tensor_view a = hnd(x[s], ns[s], d);
        struct kvcap_tensor_view b = hnd(x[s] + (size_t)H * ns[s] * d, ns[s], d);
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &ds, &a, &b), KVCAP_OK);
        p0 += ns[s];
    }
}

/* check_kvzip_in_cache's value state, in double: the span's values vx [80][d] on an 8 x 10 grid
 * of 4 x 5 tiles (tiles and their points row-major), fitted to the tokens with in_fit[j] through
 * the basis u [rv][m]: μ their mean and per tile the ridge least squares
 * (U_F U_Fᵀ + λI) c = U_F (V_F − μ), solved by Gaussian elimination; v̂ = Uᵀ c + μ into out. */
static void fit_basis_values(const float *u, int m, int rv, const float *vx, int d,
                             const int *in_fit, float *out)
{
    const int nv = 80;
    for (int e = 0; e < d; e++) {
        double mu = 0;
        int count = 0;
        for (int j = 0; j < nv; j++)
            if (in_fit[j])
                mu += vx[(size_t)j * d + e], count++;
        mu = count ? mu / count : 0;
        double coef[4][4] = {{0}};
        for (int t = 0; t < 4; t++) {
            double A[4][5] = {{0}}; /* [rv][rv | b] */
            for (int q = 0; q < rv; q++)
                A[q][q] = 1e-6;
            for (int j = 0; j < nv; j++) {
                const int row = j / 10, col = j % 10, pt = row % 4 * 5 + col % 5;
                if (row / 4 * 2 + col / 5 != t || !in_fit[j])
                    continue;
                for (int q = 0; q < rv; q++) {
                    for (int s = 0; s < rv; s++)
                        A[q][s] += (double)u[q * m + pt] * u[s * m + pt];
                    A[q][rv] += u[q * m + pt] * (vx[(size_t)j * d + e] - mu);
                }
            }
            for (int q = 0; q < rv; q++) /* elimination without pivoting: A is SPD */
                for (int s = q + 1; s < rv; s++) {
                    double f = A[s][q] / A[q][q];
                    for (int c = q; c <= rv; c++)
                        A[s][c] -= f * A[q][c];
                }
            for (int q = rv - 1; q >= 0; q--) {
                double x = A[q][rv];
                for (int s = q + 1; s < rv; s++)
                    x -= A[q][s] * coef[t][s];
                coef[t][q] = x / A[q][q];
            }
        }
        for (int j = 0; j < nv; j++) {
            const int row = j / 10, col = j % 10, t = row / 4 * 2 + col / 5;
            const int pt = row % 4 * 5 + col % 5;
            double v = mu;
            for (int q = 0; q < rv; q++)
                v += u[q * m + pt] * coef[t][q];
            out[(size_t)j * d + e] = (float)v;
        }
    }
}

/* KVzip in a cache: a text head (full), the kvzip span, a text tail (full), and n_r
 * reconstruction queries per layer. The rows kept must be the brute force's: the oracle's
 * scores over the whole prompt, one budget over every layer and head (the readable selection),
 * sinks and window kept; heads keep different numbers of rows (packed), the bytes held are
 * exactly retention × the span's, and decode attention over the packed rows matches a naive
 * softmax over the rows the brute force keeps. With a safeguard, every head first keeps its
 * floor (the brute force's selection with that floor), which starves no head.
 * With `values: basis` (basis != 0) the span's bytes are the budget: the value state of every
 * layer and head (4 tiles of 4 x 5 points at rank 3, and μ) takes its share and the rest buys
 * keys, 206 where rows buy 144; the keys kept are the brute force's with that budget, no value
 * rows are held, and decode matches a naive softmax over values rebuilt in the test from the
 * artifact's basis, Ṽ_t = U (V_t − μ), v̂ = Uᵀ Ṽ_t + μ. With exact_values (exact > 0) each
 * layer and head also holds the exact values of the `exact` kept tokens whose v̂ is farthest
 * from v, which the budget pays for. */
static void check_kvzip_in_cache(double safeguard, int basis, int exact)
{
    struct kvcap_model_geometry g = geometry(3, 6, 2, 64);
    const int L = g.n_layers, H = g.n_kv_heads, Hq = g.n_q_heads, G = Hq / H, d = g.head_dim;
    const int nh = 9, nv = 80, nt = 7, n_r = 23, sinks = 2, window = 3;
    const double retention = 0.3;
    /* the span is 8 x 10: tiles of 4 x 5, four of them, 20 points each, rank 3 */
    const struct test_bucket tb[1] = {{8, 10, 4, 5, 5, 4, 3}};
    const int m = 20, tiles = 4, rv = 3;
    struct kvcap_artifact *a = basis ? test_artifact(&g, tb, 1, 67, "kvzip-basis") : NULL;
    char yaml[200];
    snprintf(yaml, sizeof yaml, "policies: {vision: kvzip, text: full}\n"
             "kvzip: {retention: 0.3, sinks: 2, window: 3, safeguard: %g, values: %s, "
             "exact_values: %d}\n",
             safeguard, basis ? "basis" : "rows", exact);
    struct kvcap_cache *c = make_cache(&g, 1, KVCAP_DTYPE_F32, a, yaml);
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 61);
    const int ns[3] = {nh, nv, nt};
    float *x[3][3], *rq[3], *rl[3];
    for (int l = 0; l < L; l++) {
        add_text_vision_text(c, &g, l, ns, 8, x[l], &r); /* the span: 8 x 10 */
        rq[l] = malloc(sizeof(float) * (size_t)n_r * Hq * d); /* token-major */
        fill(&r, rq[l], (size_t)n_r * Hq * d, 0.5 + 0.6 * l);  /* layers differ in sharpness */
        /* the pass's own keys: a log-sum-exp per query on layer 1 ([n_r][q_heads], -inf on
         * some), none on the others (plain add_post_queries) */
        rl[l] = malloc(sizeof(float) * (size_t)n_r * Hq);
        for (int i = 0; i < n_r * Hq; i++)
            rl[l][i] = l != 1 ? -INFINITY : i % 4 == 0 ? -INFINITY
                                                      : (float)(4.5 + kvcap_rng_normal(&r));
    }
    /* before the queries: the end of prefill names what is missing, and changes nothing */
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_ERR_STATE);
    assert_non_null(strstr(kvcap_last_error(), "reconstruction"));
    float bad[6 * 1 * 64] = {0}, bad_lse[6] = {0, 0, NAN, 0, 0, 0};
    assert_int_equal(kvcap_cache_add_post_queries_lse(c, 0, 0, bad, bad_lse, 1), KVCAP_ERR_NUMERIC);
    assert_non_null(strstr(kvcap_last_error(), "lse"));
    for (int l = 0; l < L; l++) {
        /* [n_r][q_heads][d] → the API's [q_heads][n_r][d], lse likewise */
        float *qh = malloc(sizeof(float) * (size_t)n_r * Hq * d);
        float *lh = malloc(sizeof(float) * (size_t)n_r * Hq);
        for (int i = 0; i < n_r; i++)
            for (int q = 0; q < Hq; q++) {
                memcpy(qh + ((size_t)q * n_r + i) * d, rq[l] + ((size_t)i * Hq + q) * d,
                       sizeof(float) * d);
                lh[(size_t)q * n_r + i] = rl[l][(size_t)i * Hq + q];
            }
        if (l == 1) { /* in two calls: 5 queries, then the rest */
            float *q2 = malloc(sizeof(float) * (size_t)n_r * Hq * d), *l2 = malloc(sizeof(float) * (size_t)n_r * Hq);
            for (int part = 0; part < 2; part++) {
                const int i0 = part ? 5 : 0, ni = part ? n_r - 5 : 5;
                for (int q = 0; q < Hq; q++)
                    for (int i = 0; i < ni; i++) {
                        memcpy(q2 + ((size_t)q * ni + i) * d, qh + ((size_t)q * n_r + i0 + i) * d,
                               sizeof(float) * d);
                        l2[(size_t)q * ni + i] = lh[(size_t)q * n_r + i0 + i];
                    }
                assert_int_equal(kvcap_cache_add_post_queries_lse(c, 0, l, q2, l2, ni), KVCAP_OK);
            }
            free(q2), free(l2);
        } else {
            assert_int_equal(kvcap_cache_add_post_queries(c, 0, l, qh, n_r), KVCAP_OK);
        }
        free(qh), free(lh);
    }
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_OK);

    /* brute force */
    const int lo = sinks, hi = nv - window, nc = hi - lo, np = nh + nv + nt;
    float *score = malloc(sizeof(float) * (size_t)L * H * nc), *full = malloc(sizeof(float) * np);
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++) {
            struct kvcap_rows ch[3];
            for (int s = 0; s < 3; s++)
                ch[s] = (struct kvcap_rows){x[l][s] + (size_t)h * ns[s] * d, NULL,
                                            KVCAP_DTYPE_F32, (size_t)d, ns[s]};
            memset(full, 0, sizeof(float) * np);
            assert_int_equal(kvcap_kvzip_head_ref(rq[l] + (size_t)h * G * d, (size_t)Hq * d,
                                                  rl[l] + (size_t)h * G, (size_t)Hq, n_r, G, d,
                                                  1.0f / sqrtf((float)d), ch, 3, full),
                             KVCAP_OK);
            memcpy(score + ((size_t)l * H + h) * nc, full + nh + lo, sizeof(float) * nc);
        }
    int keep_n[6];
    unsigned char *sel = malloc((size_t)L * H * nc);
    /* rows kept over all heads: retention of the tokens; with the basis, the span's bytes
     * less the value state, at a key and its point per kept row */
    const int64_t vec = (int64_t)d * sizeof(float);
    const int64_t values = (int64_t)L * H * (tiles * rv + 1 + exact) * vec;
    const int64_t keys = basis ? (2 * llround(retention * nv) * L * H * vec - values) / (vec + 4)
                               : llround(retention * nv) * (int64_t)L * H;
    assert_int_equal(keys, !basis ? 144 : exact ? 194 : 206);
    int64_t budget = keys - (int64_t)L * H * (nv - nc);
    /* the safeguard: each head's best up to that share of an even split, protected included */
    const int head_floor = (int)llround(safeguard * ((double)keys / (L * H))) - (nv - nc);
    assert_int_equal(kvcap_kvzip_select_ref(score, L * H, nc, budget,
                                            head_floor > 0 ? head_floor : 0, keep_n, sel),
                     budget);
    int differ = 0;
    for (int u = 1; u < L * H; u++)
        differ |= keep_n[u] != keep_n[0];
    assert_true(differ); /* the budget really moved between layers and heads */
    if (head_floor > 0) { /* and the floor bound: without it, some head keeps less */
        int keep_0[6], starved = 0;
        unsigned char *sel_0 = malloc((size_t)L * H * nc);
        assert_int_equal(kvcap_kvzip_select_ref(score, L * H, nc, budget, 0, keep_0, sel_0),
                         budget);
        for (int u = 0; u < L * H; u++) {
            assert_true(keep_n[u] >= head_floor);
            starved |= keep_0[u] < head_floor;
        }
        assert_true(starved);
        free(sel_0);
    }
    int64_t kept_rows = 0;
    for (int l = 0; l < L; l++) {
        const struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, 0, l)->segs[1];
        for (int h = 0; h < H; h++) {
            int keep[128], k = 0;
            for (int j = 0; j < nv; j++)
                if (j < lo || j >= hi || sel[((size_t)l * H + h) * nc + (j - lo)])
                    keep[k++] = j;
            kept_rows += k;
            expect_rows(seg, &g, h, x[l][1] + (size_t)h * nv * d,
                        basis ? NULL : x[l][1] + (size_t)(H + h) * nv * d, keep, k);
        }
    }
    assert_int_equal(kept_rows, keys);
    struct kvcap_cache_stats st;
    assert_int_equal(kvcap_cache_stats(c, &st), KVCAP_OK);
    assert_int_equal(st.bytes_by_policy[KVCAP_POLICY_KVZIP],
                     basis ? (uint64_t)kept_rows * (vec + 4) + (uint64_t)values
                           : (uint64_t)kept_rows * 2 * d * sizeof(float));
    assert_true(st.bytes_by_policy[KVCAP_POLICY_KVZIP] <= (uint64_t)(2 * 24 * L * H * vec));
    /* the values decode reads: the span's rows, or (basis) every span value rebuilt in double
     * from the artifact's basis fitted to the head's kept tokens F: μ their mean, per tile
     * Ṽ_t = (U_F U_Fᵀ + λI)⁻¹ U_F (V_F − μ), v̂ = Uᵀ Ṽ_t + μ (tiles of the 8 x 10 grid
     * row-major, points row-major inside a 4 x 5 tile); with exact values, the kept tokens whose
     * v̂ is farthest from v (ties to the lower) leave F, the fit is made again and they keep v */
    float *vspan[3];
    for (int l = 0; l < L; l++) {
        vspan[l] = malloc(sizeof(float) * (size_t)H * nv * d);
        memcpy(vspan[l], x[l][1] + (size_t)H * nv * d, sizeof(float) * (size_t)H * nv * d);
        for (int h = 0; basis && h < H; h++) {
            const float *vx = x[l][1] + (size_t)(H + h) * nv * d;
            const float *u = kvcap_artifact_unit(a, l, h, 0)->u;
            int in_fit[80], worst[8];
            for (int j = 0; j < nv; j++)
                in_fit[j] = j < lo || j >= hi || sel[((size_t)l * H + h) * nc + (j - lo)];
            fit_basis_values(u, m, rv, vx, d, in_fit, vspan[l] + (size_t)h * nv * d);
            if (exact) {
                float err[80];
                for (int j = 0; j < nv; j++) {
                    double e2 = 0;
                    for (int e = 0; e < d; e++) {
                        double dv = vspan[l][((size_t)h * nv + j) * d + e] - vx[(size_t)j * d + e];
                        e2 += dv * dv;
                    }
                    err[j] = in_fit[j] ? (float)e2 : -1.0f;
                }
                for (int i = 0; i < exact; i++) {
                    worst[i] = 0;
                    for (int j = 1; j < nv; j++)
                        worst[i] = err[j] > err[worst[i]] ? j : worst[i];
                    err[worst[i]] = -1.0f;
                }
                for (int i = 0; i < exact; i++)
                    in_fit[worst[i]] = 0;
                fit_basis_values(u, m, rv, vx, d, in_fit, vspan[l] + (size_t)h * nv * d);
            }
            for (int i = 0; i < exact; i++)
                memcpy(vspan[l] + ((size_t)h * nv + worst[i]) * d, vx + (size_t)worst[i] * d,
                       sizeof(float) * d);
        }
    }

    /* decode over the packed rows: head text + kept span rows + tail text, naive softmax */
    float *q = malloc(sizeof(float) * (size_t)Hq * d), *out = malloc(sizeof(float) * Hq * d);
    float *kk = malloc(sizeof(float) * (size_t)np * d);
    float *vv = malloc(sizeof(float) * (size_t)np * d);
    double o[64];
    for (int l = 0; l < L; l++) {
        fill(&r, q, (size_t)Hq * d, 1.0);
        assert_int_equal(kvcap_cache_attend(c, l, q, out), KVCAP_OK);
        for (int h = 0; h < H; h++) {
            int n = 0;
            for (int s = 0; s < 3; s++)
                for (int j = 0; j < ns[s]; j++) {
                    if (s == 1 && j >= lo && j < hi && !sel[((size_t)l * H + h) * nc + (j - lo)])
                        continue;
                    memcpy(kk + (size_t)n * d, x[l][s] + ((size_t)h * ns[s] + j) * d,
                           sizeof(float) * d);
                    memcpy(vv + (size_t)n * d,
                           s == 1 ? vspan[l] + ((size_t)h * nv + j) * d
                                  : x[l][s] + ((size_t)(H + h) * ns[s] + j) * d,
                           sizeof(float) * d);
                    n++;
                }
            for (int gq = 0; gq < G; gq++) {
                int qi = h * G + gq;
                naive_attention(q + (size_t)qi * d, kk, vv, n, d, o);
                for (int e = 0; e < d; e++)
                    assert_true(fabs(out[(size_t)qi * d + e] - o[e]) <= 1e-5 * (1 + fabs(o[e])));
            }
        }
    }
    free(q), free(out), free(kk), free(vv), free(score), free(full), free(sel);
    for (int l = 0; l < L; l++) {
        for (int s = 0; s < 3; s++)
            free(x[l][s]);
        free(rq[l]), free(rl[l]), free(vspan[l]);
    }
    kvcap_cache_free(c);
    kvcap_artifact_free(a);
}

static void test_kvzip_in_cache(void **state)
{
    (void)state;
    check_kvzip_in_cache(0, 0, 0);   /* KVzip's rule: one budget shared by every layer and head */
    check_kvzip_in_cache(0.7, 0, 0); /* kvcap's safeguard: every head first keeps 12 of its 75 */
    check_kvzip_in_cache(0, 1, 0);   /* kvcap's value basis: more keys for the same bytes */
    check_kvzip_in_cache(0.7, 1, 0);
    check_kvzip_in_cache(0, 1, 2);   /* and two exact values per layer and head */
}

/* kvzip's value basis is refused without an artifact (at create, naming the key) and, at the
 * end of prefill, when the value state alone takes more than the budget (rank 10 in tiles of
 * 20 points is half of the span's bytes, retention 0.2 a fifth). */
static void test_kvzip_basis_refusals(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = g;
    p.n_seqs = 1;
    p.storage = KVCAP_DTYPE_F32;
    p.config_yaml = "policies: {vision: kvzip, text: full}\nkvzip: {values: basis}\n";
    struct kvcap_cache *c = NULL;
    assert_int_equal(kvcap_cache_create(&p, &c), KVCAP_ERR_INVALID_ARGUMENT);
    assert_null(c);
    assert_non_null(strstr(kvcap_last_error(), "kvzip.values: basis"));

    const struct test_bucket tb[1] = {{8, 10, 4, 5, 5, 4, 10}};
    struct kvcap_artifact *a = test_artifact(&g, tb, 1, 71, "kvzip-basis-refused");
    c = make_cache(&g, 1, KVCAP_DTYPE_F32, a,
                   "policies: {vision: kvzip, text: full}\n"
                   "kvzip: {retention: 0.2, values: basis}\n");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 72);
    const int ns[3] = {4, 80, 3};
    float *x[2][3], q[4 * 2 * 64];
    fill(&r, q, sizeof q / sizeof q[0], 1.0);
    for (int l = 0; l < g.n_layers; l++) {
        add_text_vision_text(c, &g, l, ns, 8, x[l], &r);
        assert_int_equal(kvcap_cache_add_post_queries(c, 0, l, q, 2), KVCAP_OK);
    }
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "value state"));
    for (int l = 0; l < g.n_layers; l++)
        for (int s = 0; s < 3; s++)
            free(x[l][s]);
    kvcap_cache_free(c);
    kvcap_artifact_free(a);
}

/* Expected attention in a cache: a text head, the span, a text tail; the engine hands every
 * prompt token's query rotated at its position. The rows each head keeps must be the brute
 * force's: the oracle's scores from the pre-RoPE queries (the first query_sinks left out) and
 * the mean rotation after the prompt, each head's top tokens plus sinks and window. */
static void test_expected_in_cache(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 6, 2, 64);
    const int L = g.n_layers, H = g.n_kv_heads, Hq = g.n_q_heads, G = Hq / H, d = g.head_dim;
    const int nh = 6, nv = 50, nt = 5, P = nh + nv + nt, sinks = 1, window = 2;
    struct kvcap_cache *c = make_cache(&g, 1, KVCAP_DTYPE_F32, NULL,
                                       "policies: {vision: expected_attention, text: full}\n"
                                       "expected_attention: {retention: 0.3, n_future: 64, "
                                       "query_sinks: 3, sinks: 1, window: 2}\n");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 77);
    const int ns[3] = {nh, nv, nt};
    float *x[2][3], *qpre[2];
    for (int l = 0; l < L; l++) {
        add_text_vision_text(c, &g, l, ns, 5, x[l], &r); /* the span: 5 x 10 */
        /* pre-RoPE queries [P][Hq][d] with a mean away from 0; handed rotated, [Hq][P][d] */
        qpre[l] = malloc(sizeof(float) * (size_t)P * Hq * d);
        fill(&r, qpre[l], (size_t)P * Hq * d, 1.0);
        for (size_t i = 0; i < (size_t)P * Hq * d; i++)
            qpre[l][i] += 0.5f;
        float *qh = malloc(sizeof(float) * (size_t)P * Hq * d);
        for (int i = 0; i < P; i++)
            for (int q = 0; q < Hq; q++) {
                float *dst = qh + ((size_t)q * P + i) * d;
                memcpy(dst, qpre[l] + ((size_t)i * Hq + q) * d, sizeof(float) * d);
                kvcap_rope_rotate_ref(&g, dst, 1, (size_t)d, (double)i);
            }
        assert_int_equal(kvcap_cache_add_post_queries(c, 0, l, qh, P), KVCAP_OK);
        free(qh);
    }
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_OK);
    double cs[64];
    assert_int_equal(kvcap_expected_rotation(&g, P, 64, cs), KVCAP_OK);
    const int lo = sinks, hi = nv - window, nc = hi - lo;
    const int budget = (int)llround(0.3 * nv) - sinks - window;
    float *sc = malloc(sizeof(float) * nc);
    for (int l = 0; l < L; l++) {
        const struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, 0, l)->segs[1];
        for (int h = 0; h < H; h++) {
            const float *kx = x[l][1] + ((size_t)h * nv + lo) * d;
            const float *vx = x[l][1] + ((size_t)(H + h) * nv + lo) * d;
            assert_int_equal(kvcap_expected_head_ref(&g, qpre[l] + (size_t)3 * Hq * d +
                                                             (size_t)h * G * d,
                                                     (size_t)Hq * d, P - 3, G, cs, kx, vx, nc,
                                                     1.0f / sqrtf((float)d), sc),
                             KVCAP_OK);
            int keep[64], k = 0;
            keep[k++] = 0;
            int got = kvcap_topk_indices_ref(sc, nc, budget, keep + k);
            for (int i = 0; i < got; i++)
                keep[k + i] += lo;
            k += got;
            for (int j = hi; j < nv; j++)
                keep[k++] = j;
            expect_rows(seg, &g, h, x[l][1] + (size_t)h * nv * d,
                        x[l][1] + (size_t)(H + h) * nv * d, keep, k);
        }
    }
    free(sc);
    for (int l = 0; l < L; l++) {
        for (int s = 0; s < 3; s++)
            free(x[l][s]);
        free(qpre[l]);
    }
    kvcap_cache_free(c);
    /* without the prompt's queries the end of prefill says what is missing */
    c = make_cache(&g, 1, KVCAP_DTYPE_F32, NULL, "policies: {vision: expected_attention}\n");
    float *y = malloc(sizeof(float) * 2 * (size_t)H * nv * d);
    fill(&r, y, 2 * (size_t)H * nv * d, 1.0);
    for (int l = 0; l < L; l++) {
        struct kvcap_span_desc ds = {KVCAP_SPAN_VISION, nv, 5, 10, 0};
        struct kvcap_tensor_view a = hnd(y, nv, d), b = hnd(y + (size_t)H * nv * d, nv, d);
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &ds, &a, &b), KVCAP_OK);
    }
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_ERR_STATE);
    assert_non_null(strstr(kvcap_last_error(), "expected_attention needs the prompt's queries"));
    free(y);
    kvcap_cache_free(c);
}

/* A vlcache span after a kvzip span that evicted different numbers of rows per head: refused
 * by name, not scored over a prompt of the wrong length. */
static void test_kvzip_then_vlcache_refused(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    const int H = g.n_kv_heads, d = g.head_dim, n = 40;
    struct kvcap_cache *c = make_cache(&g, 1, KVCAP_DTYPE_F32, NULL,
                                       "policies: {vision: kvzip, text: vlcache}\n"
                                       "kvzip: {retention: 0.25}\n");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 5);
    float *x = malloc(sizeof(float) * 2 * (size_t)H * n * d), *q = malloc(sizeof(float) * 4 * 3 * d);
    for (int l = 0; l < g.n_layers; l++) {
        fill(&r, x, 2 * (size_t)H * n * d, 1.0);
        fill(&r, q, (size_t)4 * 3 * d, 1.0 + 2.0 * l); /* layers differ in sharpness */
        struct kvcap_span_desc dv = {KVCAP_SPAN_VISION, n, 5, 8, 0};
        struct kvcap_span_desc dt = {KVCAP_SPAN_TEXT, n, 0, 0, n};
        struct kvcap_tensor_view a = hnd(x, n, d), b = hnd(x + (size_t)H * n * d, n, d);
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &dv, &a, &b), KVCAP_OK);
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &dt, &a, &b), KVCAP_OK);
        assert_int_equal(kvcap_cache_add_post_queries(c, 0, l, q, 3), KVCAP_OK);
    }
    assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_ERR_UNSUPPORTED);
    assert_non_null(strstr(kvcap_last_error(), "vlcache"));
    assert_non_null(kvcap_cache_seq_layer(c, 0, 0)->segs[0].head_at); /* heads really differ */
    free(x), free(q);
    kvcap_cache_free(c);
}

/* Random eviction: each head keeps sinks, window and a draw of the rest, retention × n in all;
 * the same seed draws the same rows, another seed other rows, heads draw differently. */
static void test_random_in_cache(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    const int H = g.n_kv_heads, d = g.head_dim, n = 64;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 9);
    float *x = malloc(sizeof(float) * 2 * (size_t)H * n * d);
    for (size_t i = 0; i < 2 * (size_t)H * n * d; i++)
        x[i] = (float)(i / d); /* row i holds its own index: rows kept are readable */
    int rows[3][2][2][16]; /* [cache][layer][head][row] → token */
    const char *yamls[3] = {
        "policies: {vision: random}\nrandom: {retention: 0.25, sinks: 2, window: 3, seed: 4}\n",
        "policies: {vision: random}\nrandom: {retention: 0.25, sinks: 2, window: 3, seed: 4}\n",
        "policies: {vision: random}\nrandom: {retention: 0.25, sinks: 2, window: 3, seed: 5}\n"};
    for (int ci = 0; ci < 3; ci++) {
        struct kvcap_cache *c = make_cache(&g, 1, KVCAP_DTYPE_F32, NULL, yamls[ci]);
        for (int l = 0; l < g.n_layers; l++) {
            struct kvcap_span_desc dv = {KVCAP_SPAN_VISION, n, 8, 8, 0};
            struct kvcap_tensor_view a = hnd(x, n, d), b = hnd(x + (size_t)H * n * d, n, d);
            assert_int_equal(kvcap_cache_add_span(c, 0, l, &dv, &a, &b), KVCAP_OK);
        }
        assert_int_equal(kvcap_cache_end_prefill(c, 0), KVCAP_OK);
        for (int l = 0; l < g.n_layers; l++) {
            const struct kvcap_segment *seg = &kvcap_cache_seq_layer(c, 0, l)->segs[0];
            for (int h = 0; h < H; h++) {
                size_t at;
                int held;
                kvcap_segment_head_rows(seg, h, &at, &held);
                assert_int_equal(held, 16);
                const float *k = (const float *)seg->k + at * d;
                for (int i = 0; i < held; i++) {
                    rows[ci][l][h][i] = (int)k[(size_t)i * d] - h * n; /* token index */
                    if (i > 0)
                        assert_true(rows[ci][l][h][i] > rows[ci][l][h][i - 1]);
                }
                assert_int_equal(rows[ci][l][h][0], 0);
                assert_int_equal(rows[ci][l][h][1], 1);
                assert_int_equal(rows[ci][l][h][13], n - 3);
                assert_int_equal(rows[ci][l][h][15], n - 1);
            }
        }
        struct kvcap_cache_stats st;
        assert_int_equal(kvcap_cache_stats(c, &st), KVCAP_OK);
        assert_int_equal(st.bytes_by_policy[KVCAP_POLICY_RANDOM],
                         (uint64_t)2 * 2 * H * 16 * d * sizeof(float));
        assert_true(st.compress_seconds > 0); /* the draws and the eviction */
        kvcap_cache_free(c);
    }
    assert_memory_equal(rows[0], rows[1], sizeof rows[0]);
    assert_true(memcmp(rows[0], rows[2], sizeof rows[0]) != 0);
    assert_true(memcmp(rows[0][0][0], rows[0][0][1], sizeof rows[0][0][0]) != 0);
    free(x);
}

/* A NaN in an artifact's maps is refused when it is opened (it used to turn every decode
 * output of its spans into NaN with status OK), and the writer never writes one. */
static void test_poisoned_artifact(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    const struct test_bucket tb[1] = {{4, 4, 0, 0, 8, 6, 7}};
    char path[512];
    tmp_path(path, sizeof path, "poisoned.kvcap");
    write_artifact(path, &g, tb, 1, 5);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    rewind(f);
    char *bytes = malloc((size_t)size);
    assert_int_equal(fread(bytes, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    struct kvst_file *sf = NULL;
    assert_int_equal(kvst_open_memory(bytes, (size_t)size, path, &sf), KVCAP_OK);
    const struct kvst_tensor *t = kvst_find(sf, "l1.h0.b0.k_w2");
    assert_non_null(t);
    assert_int_equal(t->dtype, KVCAP_DTYPE_F32);
    const float nan = NAN;
    memcpy((char *)bytes + ((const char *)t->data - bytes) + 3 * sizeof(float), &nan, sizeof nan);
    kvst_close(sf);
    f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(bytes, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    free(bytes);
    struct kvcap_artifact *a = NULL;
    expect_status(kvcap_artifact_open(path, &a), KVCAP_ERR_NUMERIC,
                  "tensor 'l1.h0.b0.k_w2': non-finite value nan at element 3");
    assert_null(a);
    unlink(path);

    /* the writer: a unit whose map holds Inf is refused and nothing is left on disk */
    struct kvcap_bucket bucket = {0};
    bucket.rows = 4, bucket.cols = 4, bucket.structure = KVCAP_STRUCTURE_DENSE;
    float maps[16 * 2 + 2 * 2 + 2 + 2 * 16 + 16] = {0};
    int32_t mask[2] = {0, 8};
    struct kvcap_unit_maps units[4];
    for (int i = 0; i < 4; i++)
        units[i] = (struct kvcap_unit_maps){.m = 16, .rk = 2, .h = 2, .rv = 2, .gelu = 0,
                                            .mask = mask, .u = maps, .w1 = maps + 32,
                                            .b1 = maps + 36, .w2 = maps + 38, .b2 = maps + 70};
    maps[40] = INFINITY;
    double ratios[2] = {0.125, 0.125};
    struct kvcap_artifact_desc desc = {g, 1, &bucket, KVCAP_DTYPE_F16, 1, KVCAP_POLICY_FULL,
                                       ratios, ratios, NULL, NULL};
    expect_status(kvcap_artifact_write(path, &desc, units), KVCAP_ERR_NUMERIC,
                  "'l0.h0.b0.k_w2': non-finite value inf at element 2");
    assert_int_equal(access(path, F_OK), -1);
}

/* An artifact whose KV heads disagree on a map size is refused when it is opened, naming the
 * file and the tensor (it used to open, pass `kvcap-convert --inspect`, and fail at the first
 * prefill of a span of that bucket without naming the file). */
static void test_inconsistent_artifact(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 4, 2, 64);
    struct kvcap_bucket bucket = {0};
    bucket.rows = 4, bucket.cols = 4, bucket.structure = KVCAP_STRUCTURE_DENSE;
    float maps[16 * 3 + 2 * 3 + 3 + 3 * 16 + 16] = {0};
    int32_t mask[2] = {0, 8};
    double ratios[2] = {0.125, 0.125};
    struct kvcap_artifact_desc desc = {g, 1, &bucket, KVCAP_DTYPE_F32, 1, KVCAP_POLICY_FULL,
                                       ratios, ratios, NULL, NULL};
    char path[512];
    tmp_path(path, sizeof path, "inconsistent.kvcap");
    /* unit 3 = layer 1, KV head 1: one size too large, h then R_v */
    for (int which = 0; which < 2; which++) {
        struct kvcap_unit_maps units[4];
        for (int i = 0; i < 4; i++) {
            int h = which == 0 && i == 3 ? 3 : 2, rv = which == 1 && i == 3 ? 3 : 2;
            units[i] = (struct kvcap_unit_maps){.m = 16, .rk = 2, .h = h, .rv = rv, .gelu = 0,
                                                .mask = mask, .u = maps, .w1 = maps + 48,
                                                .b1 = maps + 54, .w2 = maps + 57, .b2 = maps + 105};
        }
        assert_int_equal(kvcap_artifact_write(path, &desc, units), KVCAP_OK);
        struct kvcap_artifact *a = NULL;
        expect_status(kvcap_artifact_open(path, &a), KVCAP_ERR_FORMAT,
                      which == 0 ? "tensor 'l1.h1.b0.k_w1': h = 3 differs from 2 in 'l1.h0.b0.k_w1'"
                                 : "tensor 'l1.h1.b0.U': R_v = 3 differs from 2 in 'l1.h0.b0.U'");
        assert_non_null(strstr(kvcap_last_error(), path));
        assert_null(a);
    }
    unlink(path);
}

/* ---- Composition: one softmax over four policies equals each policy alone, merged by hand -- */

enum { COMP_SEQS = 2, COMP_STEPS = 14 };

static void test_composition(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(2, 8, 2, 64);
    int L = g.n_layers, H = g.n_kv_heads, Hq = g.n_q_heads, d = g.head_dim;
    const struct test_bucket tb[1] = {{4, 4, 0, 0, 6, 6, 6}};
    struct kvcap_artifact *a = test_artifact(&g, tb, 1, 31, "compose");
    /* vision with a bucket → kvcapsule, without → flashcache, text → streaming, generated →
     * freekv (small pages so selection really chooses) */
    const char *yaml = "policies: {vision: kvcapsule, text: streaming, generated: freekv}\n"
                       "fallback: flashcache\n"
                       "flashcache: {retention: 0.5, sinks: 2, window: 4, min_tokens: 2}\n"
                       "streaming: {sinks: 2, window: 8}\n"
                       "freekv: {page_size: 2, budget: 8, sink_pages: 1, window_pages: 1}\n";
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 30);
    struct scenario sc = {.g = g, .n_seqs = COMP_SEQS};
    scenario_add(&sc, 0, KVCAP_SPAN_VISION, 4, 4, 5, &r);  /* kvcapsule */
    scenario_add(&sc, 0, KVCAP_SPAN_VISION, 6, 7, 30, &r); /* no bucket: flashcache */
    scenario_add(&sc, 0, KVCAP_SPAN_TEXT, 1, 30, 80, &r);  /* streaming */
    scenario_add(&sc, 1, KVCAP_SPAN_TEXT, 1, 25, 0, &r);
    scenario_add(&sc, 1, KVCAP_SPAN_VISION, 6, 7, 25, &r);
    scenario_gen(&sc, 0, COMP_STEPS, &r);
    scenario_gen(&sc, 1, COMP_STEPS, &r);
    struct kvcap_cache *mixed = make_cache(&g, COMP_SEQS, KVCAP_DTYPE_F32, a, yaml);
    struct scenario prefill = sc; /* the spans; generated tokens come step by step below */
    prefill.n_gen[0] = prefill.n_gen[1] = 0;
    scenario_load(&prefill, mixed);
    /* alone: one cache per span, one per sequence's generated tokens */
    struct kvcap_cache *alone[COMP_SEQS][MAX_SPANS + 1];
    int n_alone[COMP_SEQS];
    for (int s = 0; s < COMP_SEQS; s++) {
        n_alone[s] = sc.n_spans[s] + 1;
        for (int i = 0; i < n_alone[s]; i++) {
            alone[s][i] = make_cache(&g, 1, KVCAP_DTYPE_F32, a, yaml);
            struct scenario one = {.g = g, .n_seqs = 1};
            if (i < sc.n_spans[s]) {
                one.n_spans[0] = 1;
                one.spans[0][0] = sc.spans[s][i];
            }
            scenario_load(&one, alone[s][i]);
        }
    }
    struct kvcap_cache_stats st;
    assert_int_equal(kvcap_cache_stats(alone[0][0], &st), KVCAP_OK); /* the KVCapsule span */
    assert_true(st.compress_seconds > 0); /* its projection is its compression work */
    assert_int_equal(kvcap_cache_stats(mixed, &st), KVCAP_OK);
    assert_int_equal(st.spans_fallback, 2);
    float *q = malloc(sizeof(float) * COMP_SEQS * Hq * d), *out = malloc(sizeof(float) * COMP_SEQS * Hq * d);
    float *lse = malloc(sizeof(float) * COMP_SEQS * Hq);
    float *ao = malloc(sizeof(float) * (MAX_SPANS + 1) * Hq * d), *al = malloc(sizeof(float) * (MAX_SPANS + 1) * Hq);
    for (int t = 0; t < COMP_STEPS; t++)
        for (int l = 0; l < L; l++) {
            for (int s = 0; s < COMP_SEQS; s++) {
                const float *tok = sc.gen[l][s] + (size_t)t * 2 * H * d;
                struct kvcap_tensor_view gk = {tok, NULL, 0, KVCAP_DTYPE_F32, d, 0};
                struct kvcap_tensor_view gv = {tok + (size_t)H * d, NULL, 0, KVCAP_DTYPE_F32, d, 0};
                assert_int_equal(kvcap_cache_append(mixed, s, l, &gk, &gv), KVCAP_OK);
                assert_int_equal(kvcap_cache_append(alone[s][n_alone[s] - 1], 0, l, &gk, &gv),
                                 KVCAP_OK);
            }
            fill(&r, q, (size_t)COMP_SEQS * Hq * d, 1.0);
            assert_int_equal(kvcap_cache_attend_lse(mixed, l, q, out, lse), KVCAP_OK);
            for (int s = 0; s < COMP_SEQS; s++) {
                const float *qs = q + (size_t)s * Hq * d;
                for (int i = 0; i < n_alone[s]; i++)
                    assert_int_equal(kvcap_cache_attend_lse(alone[s][i], l, qs,
                                                            ao + (size_t)i * Hq * d,
                                                            al + (size_t)i * Hq),
                                     KVCAP_OK);
                for (int hq = 0; hq < Hq; hq++) {
                    double mx = -INFINITY, sum = 0, o[64] = {0};
                    for (int i = 0; i < n_alone[s]; i++)
                        mx = fmax(mx, al[(size_t)i * Hq + hq]);
                    for (int i = 0; i < n_alone[s]; i++) {
                        double w = exp(al[(size_t)i * Hq + hq] - mx);
                        sum += w;
                        for (int ch = 0; ch < d; ch++)
                            o[ch] += w * ao[((size_t)i * Hq + hq) * d + ch];
                    }
                    for (int ch = 0; ch < d; ch++)
                        o[ch] /= sum;
                    double e = rel_err(out + ((size_t)s * Hq + hq) * d, o, d);
                    if (!(e <= FUSED_REL_TOL))
                        fail_msg("step %d layer %d seq %d head %d: mixed vs merged %g", t, l, s,
                                 hq, e);
                    assert_true(fabs(lse[(size_t)s * Hq + hq] - (mx + log(sum))) < 1e-4);
                }
            }
        }
    assert_int_equal(kvcap_cache_stats(mixed, &st), KVCAP_OK);
    assert_true(st.bytes_by_policy[KVCAP_POLICY_KVCAPSULE] > 0);
    assert_true(st.bytes_by_policy[KVCAP_POLICY_FLASHCACHE] > 0);
    assert_true(st.bytes_by_policy[KVCAP_POLICY_STREAMING] > 0);
    assert_true(st.bytes_by_policy[KVCAP_POLICY_FREEKV] > 0);
    assert_true(st.freekv_head_steps == (int64_t)COMP_STEPS * L * COMP_SEQS * H);
    assert_true(st.bytes_held < st.bytes_full_equivalent);
    for (int s = 0; s < COMP_SEQS; s++)
        for (int i = 0; i < n_alone[s]; i++)
            kvcap_cache_free(alone[s][i]);
    kvcap_cache_free(mixed);
    free(q), free(out), free(lse), free(ao), free(al);
    scenario_free(&sc);
    kvcap_artifact_free(a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_full_matches_naive),
        cmocka_unit_test(test_fused_matches_materialised),
        cmocka_unit_test(test_exact_tiles),
        cmocka_unit_test(test_sliced_attend_matches),
        cmocka_unit_test(test_strided_and_paged_views),
        cmocka_unit_test(test_bytes_held),
        cmocka_unit_test(test_invalid_calls_leave_cache_usable),
        cmocka_unit_test(test_record_calibrate_convert_decode),
        cmocka_unit_test(test_record_flush_keeps_prefill),
        cmocka_unit_test(test_record_refuses_unrecordable_grid),
        cmocka_unit_test(test_incomplete_prefill_named),
        cmocka_unit_test(test_uses_policy),
        cmocka_unit_test(test_streaming_bounds),
        cmocka_unit_test(test_artifact_outlives_its_opener),
        cmocka_unit_test(test_flashcache_in_cache),
        cmocka_unit_test(test_vlcache_in_cache),
        cmocka_unit_test(test_kvzip_in_cache),
        cmocka_unit_test(test_kvzip_basis_refusals),
        cmocka_unit_test(test_kvzip_then_vlcache_refused),
        cmocka_unit_test(test_random_in_cache),
        cmocka_unit_test(test_expected_in_cache),
        cmocka_unit_test(test_composition),
        cmocka_unit_test(test_poisoned_artifact),
        cmocka_unit_test(test_inconsistent_artifact),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
