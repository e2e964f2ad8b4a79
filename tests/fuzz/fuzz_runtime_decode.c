/* fuzz_runtime_decode.c — the runtime YAML (hostile text) through a cache that decodes: every
 * config that parses becomes params.config_yaml of a small host cache (2 layers, 4 query and 2
 * KV heads, head_dim 64; RoPE kind, storage, batch and grids from a hash of the input) with an
 * artifact written once at start-up, which then takes a text span, a vision span and a short
 * text span on every layer, the queries its policies ask for, six decode steps of append and
 * attend on every layer, and kvcap_cache_stats. Checked: every call returns a valid status (a
 * failure with a message; creation may fail, with both), an OK attend gives finite outputs, and
 * the stats count exactly the tokens the cache accepted. fuzz_runtime_config checks the parser
 * itself; this one what the values it lets through do downstream. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "configs/config.h"
#include "runtime/artifact.h"
#include "tests/fuzz/fuzz_common.h"

enum { LAYERS = 2, Q_HEADS = 4, KV_HEADS = 2, HEAD_DIM = 64, MAX_SEQS = 2, STEPS = 6,
       MAX_SPAN = 16, MAX_PROMPT = 8 + MAX_SPAN + 4 };

/* What a config may cost before this harness stops after parsing it. Token counts (sinks,
 * windows, min_tokens, budgets, exact_tiles, ...) cost nothing in proportion: past a span's
 * length they keep the whole span, so they reach the decode whatever their value (2^30
 * included: the streaming ring's sinks + window once overflowed an int there). One value sets
 * work the tokens do not bound: expected_attention.n_future, the terms of the mean rotation
 * summed per frequency pair, layer and span (kernels/expected.c). 2^20 takes 20 s per input at
 * -O0 with the sanitizers and 2^24 (its bound) minutes, past libFuzzer's timeout; 4096 takes
 * milliseconds, and a config above it is only parsed. FreeKV's memory was measured rather than
 * bounded: freekv.budget 2^30 runs in 50 MB (the pool grows with the pages stored, at most the
 * budget, not with the budget), and page_size 2^16 allocates a 64 MiB page per (sequence,
 * layer), under libFuzzer's per-allocation limit and, untouched past the rows stored, not in
 * its RSS (80 MB). */
#define MAX_N_FUTURE 4096

/* The artifact's buckets, a tiled grid and a dense one; NO_BUCKET's grid has none (the
 * fallback policy, or KVCAP_ERR_NOT_FOUND with `fallback: none`). */
static const struct kvcap_bucket BUCKETS[] = {{4, 4, KVCAP_STRUCTURE_TILED, 2, 2},
                                              {2, 3, KVCAP_STRUCTURE_DENSE, 0, 0}};
#define N_BUCKETS ((int)(sizeof BUCKETS / sizeof *BUCKETS))
static const int NO_BUCKET[2] = {3, 5};

/* Per RoPE kind (none, rope, mrope) the geometry and an artifact calibrated for it, whose maps
 * are stored in F32, F16 and BF16 respectively; written and opened once per process. */
static struct kvcap_model_geometry geometry[3];
static struct kvcap_artifact *artifact[3];

/* Normal values drawn once per process: K, V and queries are runs of them from a random start
 * (keeps the instrumented generator out of the profile, as in fuzz_cache). */
enum { NORMALS = 1 << 14 };
static float normals[NORMALS];

static void fill(struct kvcap_rng *r, float *x, size_t n)
{
    size_t start = (size_t)kvcap_rng_below(r, NORMALS);
    for (size_t i = 0; i < n; i++)
        x[i] = normals[(start + i) & (NORMALS - 1)];
}

static void make_geometry(enum kvcap_rope_type rope, struct kvcap_model_geometry *g)
{
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "fuzz-decode");
    g->n_layers = LAYERS;
    g->n_q_heads = Q_HEADS;
    g->n_kv_heads = KV_HEADS;
    g->head_dim = HEAD_DIM;
    g->rope_type = rope;
    if (rope != KVCAP_ROPE_NONE)
        g->rope_theta = 1e4;
    if (rope == KVCAP_ROPE_MROPE) { /* Qwen2-VL's split of the 32 pairs, scaled down */
        g->n_rope_sections = 3;
        g->rope_sections[0] = 8, g->rope_sections[1] = 12, g->rope_sections[2] = 12;
    }
    FUZZ_ASSERT(kvcap_geometry_validate(g) == KVCAP_OK, "%s", kvcap_last_error());
}

/* Writes an artifact for g through the library's writer (random maps, mixed GELU and linear
 * reconstructors, value bases of rank 1 + points / 4: small enough that kvzip's values: basis
 * leaves room for keys) and opens it. */
static struct kvcap_artifact *write_artifact(const struct kvcap_model_geometry *g,
                                             enum kvcap_dtype storage, const char *name)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 7 + (uint64_t)storage);
    struct kvcap_unit_maps units[LAYERS * KV_HEADS * N_BUCKETS];
    memset(units, 0, sizeof units);
    for (int i = 0; i < LAYERS * KV_HEADS * N_BUCKETS; i++) {
        struct kvcap_unit_maps *u = &units[i];
        int m = kvcap_bucket_points(&BUCKETS[i % N_BUCKETS]);
        u->m = m, u->rk = (m + 1) / 2, u->h = 4, u->rv = 1 + m / 4, u->gelu = i % 2;
        size_t nf = (size_t)u->rv * m + (size_t)u->rk * u->h + u->h + (size_t)u->h * m + m;
        u->u = malloc(sizeof(float) * nf);
        u->mask = malloc(sizeof(int32_t) * (size_t)u->rk);
        FUZZ_ASSERT(u->u && u->mask, "out of memory");
        u->w1 = u->u + (size_t)u->rv * m;
        u->b1 = u->w1 + (size_t)u->rk * u->h;
        u->w2 = u->b1 + u->h;
        u->b2 = u->w2 + (size_t)u->h * m;
        for (size_t j = 0; j < nf; j++)
            u->u[j] = (float)(kvcap_rng_normal(&r) / sqrt((double)m));
        for (int k = 0; k < u->rk; k++)
            u->mask[k] = k * m / u->rk;
    }
    double ratios[LAYERS] = {0.5, 0.5};
    struct kvcap_artifact_desc desc = {*g,     N_BUCKETS, BUCKETS, storage, 1, KVCAP_POLICY_FULL,
                                       ratios, ratios,    NULL,    NULL};
    char path[4400];
    fuzz_path(path, sizeof path, name);
    FUZZ_ASSERT(kvcap_artifact_write(path, &desc, units) == KVCAP_OK, "artifact write: %s",
                kvcap_last_error());
    struct kvcap_artifact *a = NULL;
    FUZZ_ASSERT(kvcap_artifact_open(path, &a) == KVCAP_OK, "artifact open: %s",
                kvcap_last_error());
    for (int i = 0; i < LAYERS * KV_HEADS * N_BUCKETS; i++)
        free(units[i].u), free(units[i].mask);
    return a;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 1);
    for (int i = 0; i < NORMALS; i++)
        normals[i] = (float)kvcap_rng_normal(&r);
    static const enum kvcap_dtype maps[3] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16, KVCAP_DTYPE_BF16};
    static const char *const names[3] = {"none.kvcap", "rope.kvcap", "mrope.kvcap"};
    for (int k = 0; k < 3; k++) {
        make_geometry((enum kvcap_rope_type)k, &geometry[k]);
        artifact[k] = write_artifact(&geometry[k], maps[k], names[k]);
    }
    return 0;
}

/* ---- Choices from the input's hash ------------------------------------------------------- */

/* FNV-1a: every mutation of the text draws new choices, and a reproducer replays its own. */
static uint64_t hash_bytes(const uint8_t *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* The next digit of h in base n (the choices are the digits of a mixed-radix number). */
static int take(uint64_t *h, int n)
{
    int v = (int)(*h % (uint64_t)n);
    *h /= (uint64_t)n;
    return v;
}

/* Whether a cache with config c stores some span with `p` (kvcap_cache_uses_policy before the
 * cache exists). */
static int uses(const struct kvcap_runtime_config *c, enum kvcap_policy p)
{
    return c->policy[0] == p || c->policy[1] == p || c->policy[2] == p ||
           (c->policy[KVCAP_SPAN_VISION] == KVCAP_POLICY_KVCAPSULE && c->fallback == p);
}

/* ---- The cache's run ----------------------------------------------------------------------- */

struct run {
    struct kvcap_cache *cache;
    struct kvcap_rng rng;
    int n_seqs;
    int64_t accepted[3]; /* tokens of each kind the cache took (at layer 0) */
    float k[MAX_SPAN * KV_HEADS * HEAD_DIM], v[MAX_SPAN * KV_HEADS * HEAD_DIM];
    float q[MAX_PROMPT * Q_HEADS * HEAD_DIM]; /* post queries, or [n_seqs][q_heads][d] */
    float out[MAX_SEQS * Q_HEADS * HEAD_DIM], lse[MAX_SEQS * Q_HEADS];
};

/* n tokens of K and V in F32, NHD. */
static void views(struct run *r, int n, struct kvcap_tensor_view *k, struct kvcap_tensor_view *v)
{
    fill(&r->rng, r->k, (size_t)n * KV_HEADS * HEAD_DIM);
    fill(&r->rng, r->v, (size_t)n * KV_HEADS * HEAD_DIM);
    *k = (struct kvcap_tensor_view){r->k, NULL, 0, KVCAP_DTYPE_F32, HEAD_DIM, KV_HEADS * HEAD_DIM};
    *v = *k;
    v->base = r->v;
}

static void add_span(struct run *r, int seq, const struct kvcap_span_desc *span)
{
    for (int l = 0; l < LAYERS; l++) {
        struct kvcap_tensor_view k, v;
        views(r, span->n_tokens, &k, &v);
        kvcap_clear_error();
        enum kvcap_status st = kvcap_cache_add_span(r->cache, seq, l, span, &k, &v);
        fuzz_check_status(st, "kvcap_cache_add_span");
        if (st == KVCAP_OK && l == 0)
            r->accepted[span->kind] += span->n_tokens;
    }
}

static void attend(struct run *r, int layer, int with_lse)
{
    size_t nq = (size_t)r->n_seqs * Q_HEADS, n = nq * HEAD_DIM;
    fill(&r->rng, r->q, n);
    kvcap_clear_error();
    enum kvcap_status st = with_lse ? kvcap_cache_attend_lse(r->cache, layer, r->q, r->out, r->lse)
                                    : kvcap_cache_attend(r->cache, layer, r->q, r->out);
    fuzz_check_status(st, "kvcap_cache_attend");
    if (st != KVCAP_OK)
        return;
    FUZZ_ASSERT(fuzz_all_finite(r->out, n), "layer %d: non-finite attention output", layer);
    for (size_t i = 0; with_lse && i < nq; i++)
        FUZZ_ASSERT(!isnan(r->lse[i]) && r->lse[i] != INFINITY, "layer %d: lse[%zu] = %g", layer,
                    i, (double)r->lse[i]);
}

static void drive(struct run *r, const struct kvcap_runtime_config *cfg, uint64_t *h)
{
    /* The post-vision prompt's queries: VL-Cache needs them, kvzip takes its reconstruction
     * pass's and expected_attention every prompt token's (the same set serves all three). */
    const int expected = uses(cfg, KVCAP_POLICY_EXPECTED_ATTENTION);
    const int post = expected || uses(cfg, KVCAP_POLICY_VLCACHE) ||
                     uses(cfg, KVCAP_POLICY_KVZIP) || take(h, 4) == 0;
    for (int s = 0; s < r->n_seqs; s++) {
        struct kvcap_span_desc text = {KVCAP_SPAN_TEXT, 1 + take(h, 8), 0, 0, 0};
        struct kvcap_span_desc image = {KVCAP_SPAN_VISION, 0, 0, 0, text.n_tokens};
        int grid = take(h, N_BUCKETS + 1); /* N_BUCKETS: a grid without a bucket */
        image.rows = grid < N_BUCKETS ? BUCKETS[grid].rows : NO_BUCKET[0];
        image.cols = grid < N_BUCKETS ? BUCKETS[grid].cols : NO_BUCKET[1];
        image.n_tokens = image.rows * image.cols;
        struct kvcap_span_desc tail = {KVCAP_SPAN_TEXT, take(h, 5), 0, 0,
                                       image.p0 + image.n_tokens};
        add_span(r, s, &text);
        add_span(r, s, &image);
        if (tail.n_tokens)
            add_span(r, s, &tail);
        int prompt = text.n_tokens + image.n_tokens + tail.n_tokens;
        int n_post = expected ? prompt : tail.n_tokens ? tail.n_tokens : 1 + take(h, 4);
        for (int l = 0; post && l < LAYERS; l++) {
            fill(&r->rng, r->q, (size_t)Q_HEADS * n_post * HEAD_DIM);
            kvcap_clear_error();
            fuzz_check_status(kvcap_cache_add_post_queries(r->cache, s, l, r->q, n_post),
                              "kvcap_cache_add_post_queries");
        }
        kvcap_clear_error();
        fuzz_check_status(kvcap_cache_end_prefill(r->cache, s), "kvcap_cache_end_prefill");
    }
    const int with_lse = take(h, 2);
    for (int t = 0; t < STEPS; t++)
        for (int l = 0; l < LAYERS; l++) {
            for (int s = 0; s < r->n_seqs; s++) {
                struct kvcap_tensor_view k, v;
                views(r, 1, &k, &v);
                kvcap_clear_error();
                enum kvcap_status st = kvcap_cache_append(r->cache, s, l, &k, &v);
                fuzz_check_status(st, "kvcap_cache_append");
                if (st == KVCAP_OK && l == 0)
                    r->accepted[KVCAP_SPAN_GENERATED]++;
            }
            attend(r, l, with_lse);
        }
    struct kvcap_cache_stats stats;
    kvcap_clear_error();
    fuzz_check_status(kvcap_cache_stats(r->cache, &stats), "kvcap_cache_stats");
    for (int k = 0; k < 3; k++)
        FUZZ_ASSERT(stats.tokens_by_kind[k] == r->accepted[k],
                    "stats: %lld tokens of kind %d, the cache accepted %lld",
                    (long long)stats.tokens_by_kind[k], k, (long long)r->accepted[k]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > KVCAP_CONFIG_MAX_BYTES)
        return 0;
    char *text = malloc(size + 1);
    FUZZ_ASSERT(text != NULL, "out of memory");
    memcpy(text, data, size);
    text[size] = '\0';
    struct kvcap_runtime_config cfg;
    kvcap_clear_error();
    enum kvcap_status st = kvcap_runtime_config_load_string(text, "fuzz.yaml", &cfg);
    fuzz_check_status(st, "kvcap_runtime_config_load_string");
    if (st != KVCAP_OK ||
        (uses(&cfg, KVCAP_POLICY_EXPECTED_ATTENTION) && cfg.expected.n_future > MAX_N_FUTURE)) {
        kvcap_runtime_config_free(&cfg);
        free(text);
        return 0;
    }

    uint64_t h = hash_bytes(data, size);
    static const enum kvcap_dtype storages[3] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16,
                                                 KVCAP_DTYPE_BF16};
    int rope = take(&h, 3);
    struct kvcap_cache_params cp;
    kvcap_cache_default_params(&cp);
    cp.model = geometry[rope];
    cp.artifact = artifact[rope];
    cp.config_yaml = text;
    cp.storage = storages[take(&h, 3)];
    cp.n_seqs = 1 + take(&h, MAX_SEQS);
    cp.n_threads = 1 + take(&h, 2);      /* the cache's pool: the caller alone, or one worker */
    cp.reserve_tokens = take(&h, 4);     /* 0: 64 rows; 1..3: they grow while decoding */
    struct run *r = calloc(1, sizeof *r);
    FUZZ_ASSERT(r != NULL, "out of memory");
    r->n_seqs = cp.n_seqs;
    kvcap_rng_seed(&r->rng, h);
    kvcap_clear_error();
    st = kvcap_cache_create(&cp, &r->cache);
    fuzz_check_status(st, "kvcap_cache_create");
    FUZZ_ASSERT((st == KVCAP_OK) == (r->cache != NULL), "create: %s and cache %p",
                kvcap_status_str(st), (void *)r->cache);
    for (int p = 0; st == KVCAP_OK && p < KVCAP_POLICY_COUNT; p++)
        FUZZ_ASSERT(kvcap_cache_uses_policy(r->cache, (enum kvcap_policy)p) ==
                        uses(&cfg, (enum kvcap_policy)p),
                    "kvcap_cache_uses_policy(%s) disagrees with the config",
                    kvcap_policy_name((enum kvcap_policy)p));
    if (st == KVCAP_OK)
        drive(r, &cfg, &h);
    kvcap_cache_free(r->cache);
    free(r);
    kvcap_runtime_config_free(&cfg);
    free(text);
    return 0;
}
