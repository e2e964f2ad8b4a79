/* test_runtime_cuda.c — the cache kept in device memory (params.memory = KVCAP_MEMORY_CUDA)
 * through the public API, against a host cache fed the same spans and decode steps: full,
 * streaming (the generated ring wrapping), KVCapsule with tiled and dense maps, the fallback
 * for a grid without a bucket, a batch of three with mixed buckets; NHD, HND and paged views
 * in F32, F16 and BF16; F32, F16 and BF16 storage; G 1, 4 and 7; d 64 and 128. Device outputs
 * are poisoned with NaN before every call, lse is compared with the output, and the stats must
 * be equal. A whole decode step captured into a CUDA graph on a non-default stream and
 * replayed equals direct calls on a twin cache bit for bit, and kvcap_cache_sync brings the
 * host's counts up to date after the replays.
 * The host-side checks (a device cache refused without a device or CUDA, unsupported policies,
 * record mode, kernel limits, named fields) run in every build; without a device the test then
 * reports itself skipped (exit 77). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kernels/capsule_prefill.h"
#include "kernels/cuda/capsule_prefill_cuda.h"
#include "kernels/rope.h"
#include "runtime/artifact.h"
#include "runtime/cache_internal.h"
#include "common/internal.h"
#include "common/rng.h"
#include "formats/safetensors.h"
#include "formats/schema.h"
#include "tests/test_artifact.h"
#include "tests/test_cuda.h"

/* Plain rows (full, streaming, fallback) are stored with the same bits by both caches (the
 * same f32 → storage rounding, to nearest even); the two attentions differ only in summation
 * order, both in f32 (host: blocked online softmax; device: flash-decoding chunks merged by
 * log-sum-exp, then per-unit partials merged), a few ulps of f32 times the square root of the
 * terms: ~1e-6 at these sizes. KVCapsule with F32 storage adds H, Ṽ, μ computed on the device
 * in another order than the host's sgemm: again f32 rounding of O(1)-conditioned sums. */
#define REL_TOL_F32 1e-5
/* With 16-bit storage the KVCapsule state H, Ṽ is rounded to the storage type after being
 * computed in f32 in a different order on each side: where the f32 values differ by an ulp
 * across a rounding boundary the stored element differs by one storage ulp (2^-11 relative for
 * F16, 2^-8 for BF16). Few elements flip and the output averages them; four unit roundoffs of
 * the storage type bound the effect on the output with margin. */
#define REL_TOL_F16 (4.0 / 2048.0)
#define REL_TOL_BF16 (4.0 / 256.0)

static struct kvcap_model_geometry geometry(int layers, int q_heads, int kv_heads, int d,
                                            enum kvcap_rope_pairing pairing)
{
    struct kvcap_model_geometry g = {.name = "test", .n_layers = layers, .n_q_heads = q_heads,
                                     .n_kv_heads = kv_heads, .head_dim = d,
                                     .rope_type = KVCAP_ROPE_ROPE, .rope_pairing = pairing,
                                     .rope_theta = 1e4};
    return g;
}

static void tmp_path(char *out, size_t cap, const char *name)
{
    const char *t = getenv("TMPDIR");
    snprintf(out, cap, "%s/%s-%d", t ? t : "/tmp", name, (int)getpid());
}

static struct kvcap_artifact *make_artifact(const struct kvcap_model_geometry *g,
                                            const struct test_bucket *tb, int nb, uint64_t seed)
{
    char path[512];
    tmp_path(path, sizeof path, "runtime-cuda.kvcap");
    write_artifact(path, g, tb, nb, seed);
    struct kvcap_artifact *a = NULL;
    if (kvcap_artifact_open(path, &a) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    unlink(path);
    return a;
}

/* A cache; `yaml` (runtime config text) NULL: the defaults. Returns the status of create. */
static enum kvcap_status try_cache(const struct kvcap_model_geometry *g, int n_seqs,
                                   enum kvcap_dtype storage, const struct kvcap_artifact *a,
                                   const char *yaml, enum kvcap_memory memory,
                                   const char *record_dir, struct kvcap_cache **out)
{
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = *g;
    p.n_seqs = n_seqs;
    p.storage = storage;
    p.artifact = a;
    p.memory = memory;
    p.record_dir = record_dir;
    p.n_threads = 2;
    char path[512];
    if (yaml) {
        tmp_path(path, sizeof path, "runtime-cuda.yaml");
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs(yaml, f);
        fclose(f);
        p.config_path = path;
    }
    *out = NULL;
    enum kvcap_status st = kvcap_cache_create(&p, out);
    if (yaml)
        unlink(path);
    return st;
}

static void expect_refused(enum kvcap_status got, enum kvcap_status want, const char *field,
                           const char *what)
{
    const char *msg = kvcap_last_error();
    if (got != want)
        fail_msg("%s: status %s, want %s ('%s')", what, kvcap_status_str(got),
                 kvcap_status_str(want), msg);
    if (!strstr(msg, field))
        fail_msg("%s: message '%s' does not name '%s'", what, msg, field);
}

/* ---- Host-side checks: no device needed ---------------------------------------------------- */

static void test_create_checks(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(1, 4, 2, 64, KVCAP_ROPE_PAIRING_HALF);
    struct kvcap_cache *c = NULL;

    /* Unsupported policies and record mode are refused before any device is looked for. */
    static const struct {
        const char *yaml, *field, *policy;
    } bad[] = {
        {"policies: {vision: flashcache, text: full, generated: full}\n", "policies.vision",
         "flashcache"},
        {"policies: {vision: full, text: vlcache, generated: full}\n", "policies.text", "vlcache"},
        {"policies: {vision: full, text: full, generated: freekv}\n", "policies.generated",
         "freekv"},
        {"policies: {vision: kvcapsule, text: full, generated: full}\nfallback: vlcache\n",
         "fallback", "vlcache"},
        /* with kvcapsule the fallback serves spans without a bucket: its default is refused */
        {"policies: {vision: kvcapsule, text: full, generated: full}\n", "fallback",
         "flashcache"},
    };
    const struct test_bucket tb = {4, 6, 0, 0, 8, 6, 7};
    struct kvcap_artifact *a = make_artifact(&g, &tb, 1, 3);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        enum kvcap_status st = try_cache(&g, 1, KVCAP_DTYPE_F16, a, bad[i].yaml,
                                         KVCAP_MEMORY_CUDA, NULL, &c);
        expect_refused(st, KVCAP_ERR_UNSUPPORTED, bad[i].field, bad[i].yaml);
        assert_non_null(strstr(kvcap_last_error(), bad[i].policy));
        assert_null(c);
    }
    /* The host defaults compress vision spans with flashcache; a device cache's do not. */
    char dir[512];
    tmp_path(dir, sizeof dir, "record-cuda");
    expect_refused(try_cache(&g, 1, KVCAP_DTYPE_F16, NULL, NULL, KVCAP_MEMORY_CUDA, dir, &c),
                   KVCAP_ERR_UNSUPPORTED, "params.record_dir", "record mode");
    assert_null(c);
    assert_int_equal(access(dir, F_OK), -1); /* nothing was created */

    /* Kernel limits: G <= 16. */
    struct kvcap_model_geometry wide = geometry(1, 32, 1, 64, KVCAP_ROPE_PAIRING_HALF);
    expect_refused(try_cache(&wide, 1, KVCAP_DTYPE_F16, NULL, NULL, KVCAP_MEMORY_CUDA, NULL, &c),
                   KVCAP_ERR_UNSUPPORTED, "params.model", "G = 32");
    assert_null(c);

    /* Field values. */
    expect_refused(try_cache(&g, 1, KVCAP_DTYPE_F16, NULL, NULL, (enum kvcap_memory)7, NULL, &c),
                   KVCAP_ERR_INVALID_ARGUMENT, "params.memory", "memory 7");
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    assert_int_equal(p.memory, KVCAP_MEMORY_HOST);
    assert_int_equal(p.cuda_device, 0);
    assert_int_equal(p.reserve_tokens, 0);
    p.model = g;
    p.reserve_tokens = -1;
    expect_refused(kvcap_cache_create(&p, &c), KVCAP_ERR_INVALID_ARGUMENT,
                   "params.reserve_tokens", "reserve -1");

    /* Valid device caches (the defaults; a config without kvcapsule, whose fallback is not
     * used; kvcapsule with a supported fallback): refused naming `memory` without a device,
     * created with one. */
    static const char *const good[] = {
        NULL,
        "policies: {vision: full, text: streaming, generated: streaming}\n",
        "policies: {vision: kvcapsule, text: full, generated: full}\nfallback: streaming\n",
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        enum kvcap_status st =
            try_cache(&g, 1, KVCAP_DTYPE_F16, a, good[i], KVCAP_MEMORY_CUDA, NULL, &c);
        if (kvcap_cuda_device_count() == 0) {
            expect_refused(st, KVCAP_ERR_UNSUPPORTED, "params.memory", "no device");
            assert_non_null(strstr(kvcap_last_error(),
                                   BUILT_WITH_CUDA ? "none is visible" : "no CUDA support"));
            assert_null(c);
        } else if (st != KVCAP_OK) {
            fail_msg("device cache %zu: %s", i, kvcap_last_error());
        }
        kvcap_cache_free(c);
    }
    kvcap_artifact_free(a);
    if (kvcap_cuda_device_count() > 0) {
        p.memory = KVCAP_MEMORY_CUDA;
        p.reserve_tokens = 0;
        p.cuda_device = kvcap_cuda_device_count();
        expect_refused(kvcap_cache_create(&p, &c), KVCAP_ERR_INVALID_ARGUMENT,
                       "params.cuda_device", "ordinal past the last device");
    }

    /* On a host cache: set_stream is a state error, sync a no-op; reserve_tokens is the first
     * room of the generated rows (bytes held count it). */
    assert_int_equal(try_cache(&g, 1, KVCAP_DTYPE_F32, NULL,
                               "policies: {vision: full, text: full, generated: full}\n",
                               KVCAP_MEMORY_HOST, NULL, &c),
                     KVCAP_OK);
    expect_refused(kvcap_cache_set_stream(c, NULL), KVCAP_ERR_STATE, "set_stream", "host stream");
    assert_int_equal(kvcap_cache_sync(c), KVCAP_OK);
    kvcap_cache_free(c);
    kvcap_cache_default_params(&p);
    p.model = g;
    p.storage = KVCAP_DTYPE_F32;
    p.reserve_tokens = 100;
    assert_int_equal(kvcap_cache_create(&p, &c), KVCAP_OK);
    float tok[2 * 2 * 64] = {0};
    struct kvcap_tensor_view tk = {tok, NULL, 0, KVCAP_DTYPE_F32, 64, 0};
    struct kvcap_tensor_view tv = {tok + 128, NULL, 0, KVCAP_DTYPE_F32, 64, 0};
    assert_int_equal(kvcap_cache_append(c, 0, 0, &tk, &tv), KVCAP_OK);
    struct kvcap_cache_stats s;
    assert_int_equal(kvcap_cache_stats(c, &s), KVCAP_OK);
    assert_int_equal(s.bytes_held, 2u * 2 * 100 * 64 * 4);
    kvcap_cache_free(c);
}

#ifdef KVCAP_WITH_CUDA

/* ---- Device helpers ------------------------------------------------------------------------ */



/* f32 values as elements of dtype (host memory, caller frees). */
static void *to_dtype(const float *x, size_t n, enum kvcap_dtype t)
{
    size_t es = kvcap_dtype_size(t);
    unsigned char *out = malloc(n * es);
    for (size_t i = 0; i < n; i++) {
        if (t == KVCAP_DTYPE_F32) {
            memcpy(out + 4 * i, &x[i], 4);
        } else {
            uint16_t h = t == KVCAP_DTYPE_F16 ? kvcap_f32_to_f16(x[i]) : kvcap_f32_to_bf16(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
    }
    return out;
}

/* ---- Scenarios ----------------------------------------------------------------------------- */

enum layout { NHD, HND, PAGED };
#  define PAGE 7 /* tokens per page of the paged views: spans end inside a page */

struct span_spec {
    enum kvcap_span_kind kind;
    int rows, cols, p0;
};

struct config {
    const char *name;
    int q_heads, kv_heads, d;
    enum kvcap_rope_pairing pairing;
    enum kvcap_dtype storage, input;
    enum layout layout;
    const char *yaml;
    int n_buckets;
    struct test_bucket buckets[2];
    int n_seqs;
    int n_spans[3];
    struct span_spec spans[3][4];
    int steps;
    double tol;
};

#  define LAYERS 2

/* One K or V of `n` tokens ([H][n][d] f32 values) in the chosen layout and dtype, once in host
 * memory and once on the device; each view's page table is a host array. */
struct twin_view {
    struct kvcap_tensor_view host, dev;
    void *hbuf;
    const void **hpages, **dpages;
};

static void twin_make(struct twin_view *t, const float *x, int H, int n, int d, enum layout lay,
                      enum kvcap_dtype dt)
{
    memset(t, 0, sizeof *t);
    size_t count = (size_t)H * n * d, es = kvcap_dtype_size(dt);
    float *arranged = malloc(sizeof(float) * count);
    int64_t hs, ts;
    if (lay == HND) {
        memcpy(arranged, x, sizeof(float) * count);
        hs = (int64_t)n * d, ts = d;
    } else { /* NHD, and paged NHD: [token][head][d] */
        for (int h = 0; h < H; h++)
            for (int j = 0; j < n; j++)
                memcpy(arranged + ((size_t)j * H + h) * d, x + ((size_t)h * n + j) * d,
                       sizeof(float) * (size_t)d);
        hs = d, ts = (int64_t)H * d;
    }
    t->hbuf = to_dtype(arranged, count, dt);
    free(arranged);
    void *dbuf = dev_upload(t->hbuf, count * es);
    struct kvcap_tensor_view hv = {t->hbuf, NULL, 0, dt, hs, ts};
    struct kvcap_tensor_view dv = {dbuf, NULL, 0, dt, hs, ts};
    if (lay == PAGED) {
        int pages = (n + PAGE - 1) / PAGE;
        t->hpages = malloc(sizeof(void *) * (size_t)pages);
        t->dpages = malloc(sizeof(void *) * (size_t)pages);
        size_t page_bytes = (size_t)PAGE * H * d * es;
        for (int p = 0; p < pages; p++) {
            /* each page its own allocation, as a paged engine's pool would hand them out */
            size_t used = (size_t)(p + 1 < pages ? PAGE : n - p * PAGE) * H * d * es;
            t->hpages[p] = (const char *)t->hbuf + (size_t)p * page_bytes;
            void *page = dev_poisoned(page_bytes);
            CUDA_OK(cudaMemcpy(page, t->hpages[p], used, cudaMemcpyHostToDevice));
            t->dpages[p] = page;
        }
        hv.base = dv.base = NULL;
        hv.pages = t->hpages, dv.pages = t->dpages;
        hv.page_size = dv.page_size = PAGE;
    }
    t->host = hv;
    t->dev = dv;
    /* The copies ran on the legacy stream, and a copy from pageable memory may return before
     * its data lands: a cache working on a non-blocking stream must find them done. */
    CUDA_OK(cudaDeviceSynchronize());
}

static void twin_free(struct twin_view *t)
{
    free(t->hbuf);
    free(t->hpages);
    free(t->dpages);
}

static double rel_diff(const float *got, const float *want, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!(got[i] == got[i]))
            return INFINITY; /* NaN: an element was never written */
        num += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
        den += (double)want[i] * want[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static void expect_stats_equal(const struct kvcap_cache *a, const struct kvcap_cache *b,
                               const char *where)
{
    struct kvcap_cache_stats x, y;
    KV_OK(kvcap_cache_stats(a, &x));
    KV_OK(kvcap_cache_stats(b, &y));
    if (x.bytes_held != y.bytes_held || x.bytes_full_equivalent != y.bytes_full_equivalent ||
        x.bytes_read_last_attend != y.bytes_read_last_attend ||
        x.map_bytes_read_last_attend != y.map_bytes_read_last_attend ||
        x.spans_fallback != y.spans_fallback ||
        memcmp(x.bytes_by_policy, y.bytes_by_policy, sizeof x.bytes_by_policy) != 0 ||
        memcmp(x.bytes_by_kind, y.bytes_by_kind, sizeof x.bytes_by_kind) != 0 ||
        memcmp(x.tokens_by_kind, y.tokens_by_kind, sizeof x.tokens_by_kind) != 0)
        fail_msg("%s: stats differ: held %llu/%llu, read %llu/%llu, maps %llu/%llu, generated "
                 "%lld/%lld",
                 where, (unsigned long long)x.bytes_held, (unsigned long long)y.bytes_held,
                 (unsigned long long)x.bytes_read_last_attend,
                 (unsigned long long)y.bytes_read_last_attend,
                 (unsigned long long)x.map_bytes_read_last_attend,
                 (unsigned long long)y.map_bytes_read_last_attend,
                 (long long)x.tokens_by_kind[2], (long long)y.tokens_by_kind[2]);
}

/* Adds every span of the config to both caches, layer by layer. */
static void load_spans(const struct config *cf, const struct kvcap_model_geometry *g,
                       struct kvcap_cache *host, struct kvcap_cache *dev, struct kvcap_cache *twin,
                       struct kvcap_rng *r)
{
    int H = g->n_kv_heads, d = g->head_dim;
    for (int l = 0; l < LAYERS; l++)
        for (int s = 0; s < cf->n_seqs; s++)
            for (int i = 0; i < cf->n_spans[s]; i++) {
                const struct span_spec *x = &cf->spans[s][i];
                int n = x->rows * x->cols;
                struct kvcap_span_desc desc = {x->kind, n, x->kind == KVCAP_SPAN_VISION ? x->rows : 0,
                                               x->kind == KVCAP_SPAN_VISION ? x->cols : 0, x->p0};
                float *kv = malloc(sizeof(float) * 2 * (size_t)H * n * d);
                fill(r, kv, 2 * (size_t)H * n * d, 1.0);
                for (size_t e = 0; e < (size_t)H * n * d; e++)
                    kv[e] += 0.5f; /* keys with a common direction: peaked softmax */
                struct twin_view tk, tv;
                twin_make(&tk, kv, H, n, d, cf->layout, cf->input);
                twin_make(&tv, kv + (size_t)H * n * d, H, n, d, cf->layout, cf->input);
                KV_OK(kvcap_cache_add_span(host, s, l, &desc, &tk.host, &tv.host));
                KV_OK(kvcap_cache_add_span(dev, s, l, &desc, &tk.dev, &tv.dev));
                if (twin)
                    KV_OK(kvcap_cache_add_span(twin, s, l, &desc, &tk.dev, &tv.dev));
                twin_free(&tk);
                twin_free(&tv);
                free(kv);
            }
}

static struct kvcap_model_geometry config_geometry(const struct config *cf)
{
    return geometry(LAYERS, cf->q_heads, cf->kv_heads, cf->d, cf->pairing);
}

/* Host and device caches through the same spans and decode steps. */
static void run_config(const struct config *cf)
{
    struct kvcap_model_geometry g = config_geometry(cf);
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 1000 + (uint64_t)cf->d * 7 + (uint64_t)cf->q_heads);
    struct kvcap_artifact *a = cf->n_buckets ? make_artifact(&g, cf->buckets, cf->n_buckets, 5) : NULL;
    struct kvcap_cache *host = NULL, *dev = NULL;
    if (try_cache(&g, cf->n_seqs, cf->storage, a, cf->yaml, KVCAP_MEMORY_HOST, NULL, &host) !=
            KVCAP_OK ||
        try_cache(&g, cf->n_seqs, cf->storage, a, cf->yaml, KVCAP_MEMORY_CUDA, NULL, &dev) !=
            KVCAP_OK)
        fail_msg("%s: create: %s", cf->name, kvcap_last_error());
    load_spans(cf, &g, host, dev, NULL, &r);
    expect_stats_equal(host, dev, cf->name);

    int H = g.n_kv_heads, Hq = g.n_q_heads, d = g.head_dim;
    size_t qn = (size_t)cf->n_seqs * Hq * d, tn = 2 * (size_t)H * d;
    float *q = malloc(sizeof(float) * qn), *out_h = malloc(sizeof(float) * qn);
    float *out_d = malloc(sizeof(float) * qn), *lse_h = malloc(sizeof(float) * cf->n_seqs * Hq);
    float *lse_d = malloc(sizeof(float) * cf->n_seqs * Hq), *tok = malloc(sizeof(float) * tn);
    float *dq = dev_poisoned(sizeof(float) * qn), *dout = dev_poisoned(sizeof(float) * qn);
    float *dlse = dev_poisoned(sizeof(float) * cf->n_seqs * Hq);
    void *dtok = dev_poisoned(tn * 4);
    for (int step = 0; step <= cf->steps; step++)
        for (int l = 0; l < LAYERS; l++) {
            /* step 0 attends over the prefill alone; later steps append first */
            for (int s = 0; step > 0 && s < cf->n_seqs; s++) {
                fill(&r, tok, tn, 1.0);
                void *cv = to_dtype(tok, tn, cf->input);
                size_t es = kvcap_dtype_size(cf->input);
                CUDA_OK(cudaMemcpy(dtok, cv, tn * es, cudaMemcpyHostToDevice));
                struct kvcap_tensor_view hk = {cv, NULL, 0, cf->input, d, 0};
                struct kvcap_tensor_view hv = {(char *)cv + (size_t)H * d * es, NULL, 0, cf->input, d, 0};
                struct kvcap_tensor_view dk = {dtok, NULL, 0, cf->input, d, 0};
                struct kvcap_tensor_view dv = {(char *)dtok + (size_t)H * d * es, NULL, 0, cf->input, d, 0};
                KV_OK(kvcap_cache_append(host, s, l, &hk, &hv));
                KV_OK(kvcap_cache_append(dev, s, l, &dk, &dv));
                free(cv);
            }
            fill(&r, q, qn, 1.0);
            CUDA_OK(cudaMemcpy(dq, q, sizeof(float) * qn, cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemset(dout, 0xff, sizeof(float) * qn)); /* NaN */
            CUDA_OK(cudaMemset(dlse, 0xff, sizeof(float) * cf->n_seqs * Hq));
            KV_OK(kvcap_cache_attend_lse(host, l, q, out_h, lse_h));
            KV_OK(kvcap_cache_attend_lse(dev, l, dq, dout, dlse));
            CUDA_OK(cudaMemcpy(out_d, dout, sizeof(float) * qn, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(lse_d, dlse, sizeof(float) * cf->n_seqs * Hq, cudaMemcpyDeviceToHost));
            for (int s = 0; s < cf->n_seqs; s++)
                for (int hq = 0; hq < Hq; hq++) {
                    size_t at = ((size_t)s * Hq + hq) * d;
                    double e = rel_diff(out_d + at, out_h + at, (size_t)d);
                    double le = fabs((double)lse_d[s * Hq + hq] - lse_h[s * Hq + hq]) /
                                fmax(1.0, fabs(lse_h[s * Hq + hq]));
                    if (!(e <= cf->tol) || !(le <= cf->tol))
                        fail_msg("%s: step %d layer %d seq %d head %d: relative difference of "
                                 "out %g, of lse %g (%g vs %g) > %g",
                                 cf->name, step, l, s, hq, e, le, lse_d[s * Hq + hq],
                                 lse_h[s * Hq + hq], cf->tol);
                }
            expect_stats_equal(host, dev, cf->name);
        }
    KV_OK(kvcap_cache_sync(dev)); /* nothing replayed: the counts stay */
    expect_stats_equal(host, dev, cf->name);
    kvcap_cache_free(host);
    kvcap_cache_free(dev);
    kvcap_artifact_free(a);
    free(q), free(out_h), free(out_d), free(lse_h), free(lse_d), free(tok);
    dev_free_all();
}

#  define FULL_YAML "policies: {vision: full, text: full, generated: full}\n"
#  define STREAM_YAML                                                                              \
      "policies: {vision: streaming, text: streaming, generated: streaming}\n"                     \
      "streaming: {sinks: 2, window: 5}\n"
#  define CAPSULE_YAML "policies: {vision: kvcapsule, text: full, generated: full}\nfallback: full\n"
#  define CAPSULE_STREAM_YAML                                                                      \
      "policies: {vision: kvcapsule, text: streaming, generated: streaming}\n"                     \
      "fallback: streaming\nstreaming: {sinks: 3, window: 4}\n"

/* kvcap's exact tiles: the 8x8 spans keep 1 (2) of their 4 tiles as rows; the 4x6 dense spans,
 * one tile, keep none. */
#  define EXACT_YAML(n)                                                                            \
      "policies: {vision: kvcapsule, text: full, generated: full}\nfallback: full\n"               \
      "kvcapsule: {exact_tiles: " #n "}\n"

/* Buckets: 4x6 dense, 8x8 tiled in 4x4 tiles; grids 3x5 have none (fallback). */
#  define BUCKETS 2, {{4, 6, 0, 0, 8, 6, 7}, {8, 8, 4, 4, 5, 4, 6}}

static const struct config configs[] = {
    {"full G1 d64 F32 NHD/F32", 2, 2, 64, KVCAP_ROPE_PAIRING_HALF, KVCAP_DTYPE_F32,
     KVCAP_DTYPE_F32, NHD, FULL_YAML, 0, {{0}}, 2, {2, 1},
     {{{KVCAP_SPAN_TEXT, 1, 37, 0}, {KVCAP_SPAN_VISION, 5, 7, 37}}, {{KVCAP_SPAN_VISION, 3, 3, 2}}},
     3, REL_TOL_F32},
    {"full G4 d128 BF16 HND/BF16", 8, 2, 128, KVCAP_ROPE_PAIRING_HALF, KVCAP_DTYPE_BF16,
     KVCAP_DTYPE_BF16, HND, FULL_YAML, 0, {{0}}, 1, {2},
     {{{KVCAP_SPAN_TEXT, 1, 300, 0}, {KVCAP_SPAN_VISION, 16, 20, 300}}}, 2, REL_TOL_F32},
    {"streaming G4 d128 F16 paged/F16", 8, 2, 128, KVCAP_ROPE_PAIRING_HALF, KVCAP_DTYPE_F16,
     KVCAP_DTYPE_F16, PAGED, STREAM_YAML, 0, {{0}}, 2, {2, 1},
     {{{KVCAP_SPAN_TEXT, 1, 20, 0}, {KVCAP_SPAN_VISION, 4, 6, 20}}, {{KVCAP_SPAN_TEXT, 1, 3, 0}}},
     9, REL_TOL_F32},
    {"kvcapsule G7 d128 F32 paged/F16 batch 3", 14, 2, 128, KVCAP_ROPE_PAIRING_HALF,
     KVCAP_DTYPE_F32, KVCAP_DTYPE_F16, PAGED, CAPSULE_YAML, BUCKETS, 3, {3, 2, 3},
     {{{KVCAP_SPAN_TEXT, 1, 11, 0}, {KVCAP_SPAN_VISION, 8, 8, 11}, {KVCAP_SPAN_VISION, 4, 6, 75}},
      {{KVCAP_SPAN_VISION, 4, 6, 5}, {KVCAP_SPAN_VISION, 3, 5, 29}},
      {{KVCAP_SPAN_VISION, 8, 8, 0}, {KVCAP_SPAN_VISION, 8, 8, 64}, {KVCAP_SPAN_TEXT, 1, 9, 128}}},
     3, REL_TOL_F32},
    {"kvcapsule G1 d64 F16 HND/F32 adjacent", 2, 2, 64, KVCAP_ROPE_PAIRING_ADJACENT,
     KVCAP_DTYPE_F16, KVCAP_DTYPE_F32, HND, CAPSULE_STREAM_YAML, BUCKETS, 2, {2, 2},
     {{{KVCAP_SPAN_VISION, 4, 6, 3}, {KVCAP_SPAN_TEXT, 1, 12, 27}},
      {{KVCAP_SPAN_VISION, 8, 8, 1}, {KVCAP_SPAN_VISION, 3, 5, 65}}},
     8, REL_TOL_F16},
    {"kvcapsule exact tiles 1 G4 d64 F32 NHD/F32 batch 2", 8, 2, 64, KVCAP_ROPE_PAIRING_HALF,
     KVCAP_DTYPE_F32, KVCAP_DTYPE_F32, NHD, EXACT_YAML(1), BUCKETS, 2, {3, 2},
     {{{KVCAP_SPAN_TEXT, 1, 11, 0}, {KVCAP_SPAN_VISION, 8, 8, 11}, {KVCAP_SPAN_VISION, 4, 6, 75}},
      {{KVCAP_SPAN_VISION, 8, 8, 5}, {KVCAP_SPAN_VISION, 3, 5, 69}}},
     3, REL_TOL_F32},
    {"kvcapsule exact tiles 2 G7 d128 F16 paged/BF16", 14, 2, 128, KVCAP_ROPE_PAIRING_HALF,
     KVCAP_DTYPE_F16, KVCAP_DTYPE_BF16, PAGED, EXACT_YAML(2), BUCKETS, 2, {2, 1},
     {{{KVCAP_SPAN_VISION, 8, 8, 0}, {KVCAP_SPAN_VISION, 8, 8, 64}},
      {{KVCAP_SPAN_VISION, 8, 8, 3}}},
     4, REL_TOL_F16},
    {"kvcapsule G4 d64 BF16 NHD/BF16", 8, 2, 64, KVCAP_ROPE_PAIRING_HALF, KVCAP_DTYPE_BF16,
     KVCAP_DTYPE_BF16, NHD, CAPSULE_YAML, BUCKETS, 2, {1, 2},
     {{{KVCAP_SPAN_VISION, 4, 6, 0}}, {{KVCAP_SPAN_VISION, 8, 8, 7}, {KVCAP_SPAN_VISION, 4, 6, 71}}},
     2, REL_TOL_BF16},
};

static void test_host_vs_device(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++)
        run_config(&configs[i]);
}

/* A whole decode step (appends of every sequence and layer, attention of every layer) captured
 * on a non-default stream and replayed, against a twin cache called directly with the same
 * buffers: bit for bit. */
static void test_graph(void **state)
{
    (void)state;
    const struct config *cf = &configs[3]; /* kvcapsule, fallback, text, batch 3 */
    struct kvcap_model_geometry g = config_geometry(cf);
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 77);
    struct kvcap_artifact *a = make_artifact(&g, cf->buckets, cf->n_buckets, 9);
    struct kvcap_cache *host = NULL, *graph = NULL, *direct = NULL;
    KV_OK(try_cache(&g, cf->n_seqs, cf->storage, a, cf->yaml, KVCAP_MEMORY_HOST, NULL, &host));
    KV_OK(try_cache(&g, cf->n_seqs, cf->storage, a, cf->yaml, KVCAP_MEMORY_CUDA, NULL, &graph));
    KV_OK(try_cache(&g, cf->n_seqs, cf->storage, a, cf->yaml, KVCAP_MEMORY_CUDA, NULL, &direct));
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    KV_OK(kvcap_cache_set_stream(graph, st));
    KV_OK(kvcap_cache_set_stream(direct, st));
    load_spans(cf, &g, host, graph, direct, &r);

    int H = g.n_kv_heads, Hq = g.n_q_heads, d = g.head_dim, S = cf->n_seqs;
    size_t qn = (size_t)S * Hq * d, tn = (size_t)S * LAYERS * 2 * H * d;
    /* static buffers a captured step reads and writes: tokens [layer][seq][2][H][d], q and out
     * [layer][seq][Hq][d], lse [layer][seq][Hq] */
    float *tok = dev_poisoned(sizeof(float) * tn), *q = dev_poisoned(sizeof(float) * LAYERS * qn);
    float *out_g = dev_poisoned(sizeof(float) * LAYERS * qn), *out_d = dev_poisoned(sizeof(float) * LAYERS * qn);
    float *lse_g = dev_poisoned(sizeof(float) * LAYERS * S * Hq), *lse_d = dev_poisoned(sizeof(float) * LAYERS * S * Hq);
    float *h_tok = malloc(sizeof(float) * tn), *h_q = malloc(sizeof(float) * LAYERS * qn);
    float *a_out = malloc(sizeof(float) * LAYERS * qn), *b_out = malloc(sizeof(float) * LAYERS * qn);
    float *a_lse = malloc(sizeof(float) * LAYERS * S * Hq), *b_lse = malloc(sizeof(float) * LAYERS * S * Hq);
    float *ref = malloc(sizeof(float) * qn);
    CUDA_OK(cudaDeviceSynchronize()); /* the poisoning memsets ran on the legacy stream, not st */

    /* One step of calls on cache c into out/lse. */
#  define STEP(c, out, lse)                                                                        \
      do {                                                                                         \
          for (int l_ = 0; l_ < LAYERS; l_++) {                                                    \
              for (int s_ = 0; s_ < S; s_++) {                                                     \
                  float *t_ = tok + ((size_t)l_ * S + s_) * 2 * H * d;                             \
                  struct kvcap_tensor_view k_ = {t_, NULL, 0, KVCAP_DTYPE_F32, d, 0};              \
                  struct kvcap_tensor_view v_ = {t_ + (size_t)H * d, NULL, 0, KVCAP_DTYPE_F32, d, 0}; \
                  KV_OK(kvcap_cache_append((c), s_, l_, &k_, &v_));                                \
              }                                                                                    \
              KV_OK(kvcap_cache_attend_lse((c), l_, q + (size_t)l_ * qn, (out) + (size_t)l_ * qn,  \
                                           (lse) + (size_t)l_ * S * Hq));                           \
          }                                                                                        \
      } while (0)

    const int replays = 5;
    cudaGraph_t cg = NULL;
    cudaGraphExec_t exec = NULL;
    for (int step = 0; step < 2 + replays; step++) {
        fill(&r, h_tok, tn, 1.0);
        fill(&r, h_q, LAYERS * qn, 1.0);
        CUDA_OK(cudaMemcpyAsync(tok, h_tok, sizeof(float) * tn, cudaMemcpyHostToDevice, st));
        CUDA_OK(cudaMemcpyAsync(q, h_q, sizeof(float) * LAYERS * qn, cudaMemcpyHostToDevice, st));
        CUDA_OK(cudaMemsetAsync(out_g, 0xff, sizeof(float) * LAYERS * qn, st));
        CUDA_OK(cudaMemsetAsync(out_d, 0xff, sizeof(float) * LAYERS * qn, st));
        CUDA_OK(cudaStreamSynchronize(st));
        if (step == 0) {
            STEP(graph, out_g, lse_g); /* the first step builds the descriptors: direct */
        } else {
            if (step == 1) {
                CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                STEP(graph, out_g, lse_g); /* counted by the cache now, run by the launches */
                CUDA_OK(cudaStreamEndCapture(st, &cg));
                CUDA_OK(cudaGraphInstantiate(&exec, cg, 0));
            }
            CUDA_OK(cudaGraphLaunch(exec, st));
        }
        STEP(direct, out_d, lse_d);
        /* the host cache, the same step, as a sanity reference */
        for (int l = 0; l < LAYERS; l++) {
            for (int s = 0; s < S; s++) {
                float *t = h_tok + ((size_t)l * S + s) * 2 * H * d;
                struct kvcap_tensor_view k = {t, NULL, 0, KVCAP_DTYPE_F32, d, 0};
                struct kvcap_tensor_view v = {t + (size_t)H * d, NULL, 0, KVCAP_DTYPE_F32, d, 0};
                KV_OK(kvcap_cache_append(host, s, l, &k, &v));
            }
        }
        CUDA_OK(cudaStreamSynchronize(st));
        CUDA_OK(cudaMemcpy(a_out, out_g, sizeof(float) * LAYERS * qn, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(b_out, out_d, sizeof(float) * LAYERS * qn, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(a_lse, lse_g, sizeof(float) * LAYERS * S * Hq, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(b_lse, lse_d, sizeof(float) * LAYERS * S * Hq, cudaMemcpyDeviceToHost));
        if (memcmp(a_out, b_out, sizeof(float) * LAYERS * qn) != 0 ||
            memcmp(a_lse, b_lse, sizeof(float) * LAYERS * S * Hq) != 0)
            fail_msg("step %d: graph replay and direct calls differ", step);
        for (int l = 0; l < LAYERS; l++) {
            KV_OK(kvcap_cache_attend(host, l, h_q + (size_t)l * qn, ref));
            double e = rel_diff(b_out + (size_t)l * qn, ref, qn);
            if (!(e <= cf->tol))
                fail_msg("step %d layer %d: device vs host relative difference %g > %g", step, l,
                         e, cf->tol);
        }
    }
    /* The graph cache's own count saw two steps; the device holds all of them. */
    struct kvcap_cache_stats x, y;
    KV_OK(kvcap_cache_stats(graph, &x));
    KV_OK(kvcap_cache_stats(direct, &y));
    assert_int_equal(x.tokens_by_kind[KVCAP_SPAN_GENERATED], 2 * S);
    assert_int_equal(y.tokens_by_kind[KVCAP_SPAN_GENERATED], (2 + replays) * S);
    KV_OK(kvcap_cache_sync(graph));
    KV_OK(kvcap_cache_stats(graph, &x));
    assert_int_equal(x.tokens_by_kind[KVCAP_SPAN_GENERATED], (2 + replays) * S);
    assert_int_equal(x.bytes_held, y.bytes_held);
    assert_int_equal(x.bytes_full_equivalent, y.bytes_full_equivalent);
    /* After the sync, direct calls go on from where the replays left. */
    CUDA_OK(cudaMemsetAsync(out_g, 0xff, sizeof(float) * LAYERS * qn, st));
    STEP(graph, out_g, lse_g);
    STEP(direct, out_d, lse_d);
    CUDA_OK(cudaStreamSynchronize(st));
    CUDA_OK(cudaMemcpy(a_out, out_g, sizeof(float) * LAYERS * qn, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(b_out, out_d, sizeof(float) * LAYERS * qn, cudaMemcpyDeviceToHost));
    assert_memory_equal(a_out, b_out, sizeof(float) * LAYERS * qn);
    expect_stats_equal(graph, direct, "after a direct step");
#  undef STEP

    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(cg));
    kvcap_cache_free(host);
    kvcap_cache_free(graph);
    kvcap_cache_free(direct);
    CUDA_OK(cudaStreamDestroy(st));
    kvcap_artifact_free(a);
    free(h_tok), free(h_q), free(a_out), free(b_out), free(a_lse), free(b_lse), free(ref);
    dev_free_all();
}

/* A step that must grow storage is refused while capturing, and replays past the reserved
 * room are reported by kvcap_cache_sync without writing out of bounds. */
static void test_capture_limits(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = geometry(1, 4, 2, 64, KVCAP_ROPE_PAIRING_HALF);
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = g;
    p.storage = KVCAP_DTYPE_F32;
    p.memory = KVCAP_MEMORY_CUDA;
    p.reserve_tokens = 2;
    struct kvcap_cache *c = NULL;
    KV_OK(kvcap_cache_create(&p, &c));
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    KV_OK(kvcap_cache_set_stream(c, st));
    float *tok = dev_poisoned(sizeof(float) * 2 * 2 * 64), *q = dev_poisoned(sizeof(float) * 4 * 64);
    float *out = dev_poisoned(sizeof(float) * 4 * 64);
    CUDA_OK(cudaMemset(tok, 0, sizeof(float) * 2 * 2 * 64));
    CUDA_OK(cudaMemset(q, 0, sizeof(float) * 4 * 64));
    CUDA_OK(cudaDeviceSynchronize()); /* the memsets ran on the legacy stream */
    struct kvcap_tensor_view k = {tok, NULL, 0, KVCAP_DTYPE_F32, 64, 0};
    struct kvcap_tensor_view v = {tok + 128, NULL, 0, KVCAP_DTYPE_F32, 64, 0};

    /* The first append allocates: refused in a capture, which is then still valid. */
    cudaGraph_t cg = NULL;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    enum kvcap_status s = kvcap_cache_append(c, 0, 0, &k, &v);
    CUDA_OK(cudaStreamEndCapture(st, &cg));
    CUDA_OK(cudaGraphDestroy(cg));
    expect_refused(s, KVCAP_ERR_STATE, "captured", "growth in capture");

    KV_OK(kvcap_cache_append(c, 0, 0, &k, &v)); /* row 0 of 2 */
    KV_OK(kvcap_cache_attend(c, 0, q, out));
    cudaGraphExec_t exec = NULL;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    KV_OK(kvcap_cache_append(c, 0, 0, &k, &v)); /* row 1 */
    KV_OK(kvcap_cache_attend(c, 0, q, out));
    CUDA_OK(cudaStreamEndCapture(st, &cg));
    CUDA_OK(cudaGraphInstantiate(&exec, cg, 0));
    for (int i = 0; i < 3; i++) /* rows 1, then 2 and 3: no room */
        CUDA_OK(cudaGraphLaunch(exec, st));
    expect_refused(kvcap_cache_sync(c), KVCAP_ERR_STATE, "reserve_tokens", "overflow");
    struct kvcap_cache_stats x;
    KV_OK(kvcap_cache_stats(c, &x));
    assert_int_equal(x.tokens_by_kind[KVCAP_SPAN_GENERATED], 2);
    KV_OK(kvcap_cache_sync(c)); /* reported once */
    KV_OK(kvcap_cache_append(c, 0, 0, &k, &v)); /* grows, directly */
    KV_OK(kvcap_cache_attend(c, 0, q, out));
    KV_OK(kvcap_cache_sync(c));
    KV_OK(kvcap_cache_stats(c, &x));
    assert_int_equal(x.tokens_by_kind[KVCAP_SPAN_GENERATED], 3);
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(cg));
    kvcap_cache_free(c);
    CUDA_OK(cudaStreamDestroy(st));
    dev_free_all();
}

/* kvcap's exact tiles on the device: the point sums of kvcap_cuda_capsule_point_errors, made
 * tile errors by kvcap_capsule_exact_pick, against kvcap_capsule_tile_error_ref from the same
 * f32 state. The sums are taken in double on both sides from f32 reconstructions computed in
 * different orders: 1e-4 relative is rounding with room. */
#  define TILE_ERROR_TOL 1e-4

static void test_point_errors(void **state)
{
    (void)state;
    enum { ROWS = 8, COLS = 12, N = ROWS * COLS, D = 64, M = 16, RK = 5, HID = 4, RV = 6 };
    const int tiles = N / M, p0 = 37, exact = 2;
    struct kvcap_model_geometry g = geometry(1, 4, 1, D, KVCAP_ROPE_PAIRING_HALF);
    struct kvcap_bucket bk = {ROWS, COLS, KVCAP_STRUCTURE_TILED, 4, 4};
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 77);
    static float k[N * D], v[N * D], kr[N * D], w1[RK * HID], b1[HID], w2[HID * M], b2[M],
        u[RV * M], hs[N / M * HID * D], vt[N / M * RV * D], mu[D], rr[D], err_ref[N / M],
        err[N / M];
    static double points[N * 4];
    fill(&r, k, N * D, 1.0);
    fill(&r, v, N * D, 1.0);
    fill(&r, w1, RK * HID, 0.5);
    fill(&r, b1, HID, 0.1);
    fill(&r, w2, HID * M, 0.5);
    fill(&r, b2, M, 0.1);
    fill(&r, u, RV * M, 0.3);
    for (int j = 0; j < D; j++) /* one token far from every reconstruction: a sink */
        k[(size_t)kvcap_bucket_token(&bk, 4, 9) * D + j] *= 6.0f;
    const int32_t mask[RK] = {0, 3, 6, 9, 12};
    struct kvcap_capsule_prefill_maps pm = {M, RK, HID, RV, 0, mask, w1, b1, u};
    struct kvcap_capsule_maps dm = {M, HID, RV, w2, b2, u};
    KV_OK(kvcap_capsule_prefill_ref(&g, &bk, &pm, N, D, p0, k, v, KVCAP_DTYPE_F32, hs, vt, mu));
    memcpy(kr, k, sizeof kr);
    kvcap_rope_rotate_ref(&g, kr, N, D, -(double)p0);
    KV_OK(kvcap_capsule_tile_error_ref(&bk, &dm, N, D, kr, v, hs, vt, mu, err_ref));

    for (int i = 0; i < D / 2; i++) { /* the rotation table of -p0, as the device store makes it */
        int a, b;
        kvcap_rope_pair(&g, i, &a, &b);
        double angle = -(double)p0 * pow(g.rope_theta, -2.0 * i / (double)kvcap_rope_dim(&g));
        rr[a] = (float)cos(angle);
        rr[b] = (float)sin(angle);
    }
    struct kvcap_cuda_view kv = {dev_upload(k, sizeof k), NULL, 0, KVCAP_DTYPE_F32, N * D, D};
    struct kvcap_cuda_view vv = {dev_upload(v, sizeof v), NULL, 0, KVCAP_DTYPE_F32, N * D, D};
    struct kvcap_cuda_rope rope = {1, 0, D};
    struct kvcap_cuda_grid grid = {1, COLS, 4, 4};
    struct kvcap_cuda_capsule_unit unit = {dev_upload(mask, sizeof mask), dev_upload(w1, sizeof w1),
                                           dev_upload(b1, sizeof b1), dev_upload(w2, sizeof w2),
                                           dev_upload(b2, sizeof b2), dev_upload(u, sizeof u),
                                           M, RK, HID, RV, 0};
    double *dpoints = dev_poisoned(sizeof points);
    KV_OK(kvcap_cuda_capsule_point_errors(&kv, &vv, 0, N, D, &rope, dev_upload(rr, sizeof rr),
                                          &grid, &unit, dev_upload(hs, sizeof hs),
                                          dev_upload(vt, sizeof vt), dev_upload(mu, sizeof mu),
                                          dpoints, NULL));
    sync_ok(NULL);
    download(points, dpoints, sizeof points);
    unsigned char pick[N / M];
    kvcap_capsule_exact_pick(points, tiles, M, exact, err, pick);
    int worst = 0;
    for (int t = 0; t < tiles; t++) {
        if (!(fabs((double)err[t] - err_ref[t]) <= TILE_ERROR_TOL * fabs(err_ref[t])))
            fail_msg("tile %d: error %.9g on the device, %.9g in the oracle", t, (double)err[t],
                     (double)err_ref[t]);
        worst = err_ref[t] > err_ref[worst] ? t : worst;
    }
    assert_int_equal(worst, 4); /* the planted token's tile, picked */
    assert_true(pick[4]);
    int picked = 0;
    for (int t = 0; t < tiles; t++)
        picked += pick[t];
    assert_int_equal(picked, exact);
    dev_free_all();
}

#endif /* KVCAP_WITH_CUDA */

int main(void)
{
    const struct CMUnitTest host_tests[] = {
        cmocka_unit_test(test_create_checks),
    };
    if (cmocka_run_group_tests_name("host checks", host_tests, NULL, NULL) != 0)
        return 1;
    if (kvcap_cuda_device_count() == 0) {
        printf("SKIP: no CUDA device\n");
        return 77;
    }
#ifdef KVCAP_WITH_CUDA
    const struct CMUnitTest device_tests[] = {
        cmocka_unit_test(test_point_errors),
        cmocka_unit_test(test_host_vs_device),
        cmocka_unit_test(test_graph),
        cmocka_unit_test(test_capture_limits),
    };
    return cmocka_run_group_tests_name("device", device_tests, NULL, NULL);
#else
    return 1; /* a build without CUDA reports no devices */
#endif
}
