/* test_faults.c — allocation failure on the decode path. Each decode step (end of prefill,
 * append, attend: every layer, every sequence) is run again and again on a freshly built
 * cache, the i-th allocation made during the step failing, for i = 1, 2, ... until a run makes
 * fewer than i allocations. Every run must end in one of two ways:
 *  - every call returned KVCAP_OK: the failure was absorbed, and the step's outputs equal, bit
 *    for bit, those of a cache that never saw a fault;
 *  - a call returned a status other than KVCAP_OK with a message: then that call, repeated
 *    without faults, and the rest of the step succeed and give those same outputs (the failed
 *    call changed nothing the cache relies on; the cache stays usable).
 * The allocator is replaced for the whole program (malloc and friends forward to glibc's), so
 * the test is skipped in sanitizer builds, whose runtime owns the allocator.
 * FAULTS_DEBUG=1 in the environment prints every injected failure and what it led to. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "runtime/artifact.h"
#include "common/internal.h"
#include "kvcap.h"
#include "common/rng.h"
#include "tests/test_artifact.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#  define FAULTS_SKIP 1
#elif defined(__has_feature)
#  if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
      __has_feature(memory_sanitizer)
#    define FAULTS_SKIP 1
#  endif
#endif
#ifndef FAULTS_SKIP
#  define FAULTS_SKIP 0
#endif

/* ---- The failing allocator ----------------------------------------------------------------- */

#if !FAULTS_SKIP
void *__libc_malloc(size_t n);
void *__libc_calloc(size_t n, size_t size);
void *__libc_realloc(void *p, size_t n);
void *__libc_memalign(size_t align, size_t n);

/* > 0: armed; every allocation takes one, the one that takes it to 0 fails. */
static atomic_long countdown;
static atomic_int injected;  /* the armed allocation has failed */
static atomic_long allocations; /* made while armed */

/* Whether code at `addr` belongs to a library whose own allocations are never failed: OpenBLAS
 * dereferences its working buffer without checking the allocation (it cannot survive one, and
 * nothing a caller does can change that), so faults are injected into the allocations of
 * kvcap (this program) and of the C library it calls only. */
static int foreign(void *addr)
{
    Dl_info info;
    return dladdr(addr, &info) && info.dli_fname && strstr(info.dli_fname, "openblas");
}

#define fail_now() fail_here(__builtin_return_address(0))

static int fail_here(void *caller)
{
    if (atomic_load(&countdown) <= 0 || foreign(caller))
        return 0;
    atomic_fetch_add(&allocations, 1);
    if (atomic_fetch_sub(&countdown, 1) == 1) {
        atomic_store(&injected, 1);
        return 1;
    }
    return 0;
}

void *malloc(size_t n)
{
    return fail_now() ? NULL : __libc_malloc(n);
}

void *calloc(size_t n, size_t size)
{
    return fail_now() ? NULL : __libc_calloc(n, size);
}

void *realloc(void *p, size_t n)
{
    return fail_now() ? NULL : __libc_realloc(p, n);
}

void *aligned_alloc(size_t align, size_t n)
{
    return fail_now() ? NULL : __libc_memalign(align, n);
}

int posix_memalign(void **out, size_t align, size_t n)
{
    if (fail_now())
        return ENOMEM;
    void *p = __libc_memalign(align, n);
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}
#endif

/* Fail the i-th allocation from now on (i >= 1). */
static void arm(long i)
{
#if !FAULTS_SKIP
    atomic_store(&injected, 0);
    atomic_store(&allocations, 0);
    atomic_store(&countdown, i);
#else
    (void)i;
#endif
}

/* Stops failing; returns whether the armed allocation was reached (and failed). */
static int disarm(void)
{
#if !FAULTS_SKIP
    atomic_store(&countdown, 0);
    return atomic_load(&injected);
#else
    return 0;
#endif
}

/* ---- Scenarios ------------------------------------------------------------------------------ */

enum { MAX_SPANS = 4, MAX_SEQS = 2, STEPS = 4 };

struct span {
    struct kvcap_span_desc desc;
    float *k, *v; /* [layer][token][kv_head][d] */
};

struct scenario {
    const char *name;
    struct kvcap_model_geometry g;
    int n_seqs, n_spans[MAX_SEQS];
    struct span spans[MAX_SEQS][MAX_SPANS];
    const char *yaml;
    struct kvcap_artifact *artifact;
    float *gen;  /* [step][layer][seq][2][kv_head][d]: generated K then V */
    float *q;    /* [step][layer][seq][q_head][d] */
    float *want; /* [step][layer][seq][q_head][d]: a fault-free cache's outputs */
    char config[512];
};

static size_t q_floats(const struct scenario *s)
{
    return (size_t)s->n_seqs * s->g.n_q_heads * s->g.head_dim;
}

static size_t tok_floats(const struct scenario *s)
{
    return 2 * (size_t)s->g.n_kv_heads * s->g.head_dim;
}

static void add_span(struct scenario *s, struct kvcap_rng *r, int seq, enum kvcap_span_kind kind,
                     int rows, int cols, int n, int p0)
{
    struct span *sp = &s->spans[seq][s->n_spans[seq]++];
    sp->desc = (struct kvcap_span_desc){kind, n, rows, cols, p0};
    size_t floats = (size_t)s->g.n_layers * n * s->g.n_kv_heads * s->g.head_dim;
    sp->k = malloc(sizeof(float) * floats);
    sp->v = malloc(sizeof(float) * floats);
    assert_non_null(sp->k);
    assert_non_null(sp->v);
    fill(r, sp->k, floats, 1.0);
    fill(r, sp->v, floats, 1.0);
}

static void scenario_init(struct scenario *s, const char *name, struct kvcap_model_geometry g,
                          int n_seqs, const char *yaml)
{
    memset(s, 0, sizeof *s);
    s->name = name;
    s->g = g;
    s->n_seqs = n_seqs;
    s->yaml = yaml;
    const char *tmp = getenv("TMPDIR");
    snprintf(s->config, sizeof s->config, "%s/faults-%s-%d.yaml", tmp && *tmp ? tmp : "/tmp",
             name, (int)getpid());
    FILE *f = fopen(s->config, "w");
    assert_non_null(f);
    fputs(yaml, f);
    fclose(f);
}

static void scenario_tokens(struct scenario *s, struct kvcap_rng *r)
{
    size_t per_step = (size_t)s->g.n_layers * s->n_seqs;
    s->gen = malloc(sizeof(float) * STEPS * per_step * tok_floats(s));
    s->q = malloc(sizeof(float) * STEPS * s->g.n_layers * q_floats(s));
    s->want = malloc(sizeof(float) * STEPS * s->g.n_layers * q_floats(s));
    assert_non_null(s->gen);
    assert_non_null(s->q);
    assert_non_null(s->want);
    fill(r, s->gen, STEPS * per_step * tok_floats(s), 1.0);
    fill(r, s->q, STEPS * (size_t)s->g.n_layers * q_floats(s), 1.0);
}

static void scenario_free(struct scenario *s)
{
    for (int q = 0; q < s->n_seqs; q++)
        for (int i = 0; i < s->n_spans[q]; i++)
            free(s->spans[q][i].k), free(s->spans[q][i].v);
    free(s->gen), free(s->q), free(s->want);
    kvcap_artifact_free(s->artifact);
    unlink(s->config);
}

/* A cache holding the scenario's prefill (not ended), built without faults. */
static struct kvcap_cache *build(const struct scenario *s)
{
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = s->g;
    p.n_seqs = s->n_seqs;
    p.storage = KVCAP_DTYPE_F16;
    p.artifact = s->artifact;
    p.config_path = s->config;
    p.n_threads = 2;       /* the cache's own pool: failures on worker threads too */
    p.reserve_tokens = 2;  /* the generated rows grow at step 2 */
    struct kvcap_cache *c = NULL;
    if (kvcap_cache_create(&p, &c) != KVCAP_OK)
        fail_msg("%s: create: %s", s->name, kvcap_last_error());
    int H = s->g.n_kv_heads, d = s->g.head_dim;
    for (int l = 0; l < s->g.n_layers; l++)
        for (int q = 0; q < s->n_seqs; q++)
            for (int i = 0; i < s->n_spans[q]; i++) {
                const struct span *sp = &s->spans[q][i];
                size_t at = (size_t)l * sp->desc.n_tokens * H * d;
                struct kvcap_tensor_view k = {sp->k + at, NULL, 0, KVCAP_DTYPE_F32, d,
                                              (int64_t)H * d};
                struct kvcap_tensor_view v = {sp->v + at, NULL, 0, KVCAP_DTYPE_F32, d,
                                              (int64_t)H * d};
                if (kvcap_cache_add_span(c, q, l, &sp->desc, &k, &v) != KVCAP_OK)
                    fail_msg("%s: add_span: %s", s->name, kvcap_last_error());
            }
    return c;
}

/* The calls of decode step t in order: at step 0 end_prefill of every sequence, then per layer
 * the append of every sequence and one attend. Call `from` onwards are made (earlier ones have
 * succeeded already); returns the index of the first call that failed (its status in *st), or
 * the number of calls when all succeeded. Outputs go to out [layer][seq][q_head][d]. */
static int run_step(const struct scenario *s, struct kvcap_cache *c, int t, int from, float *out,
                    enum kvcap_status *st)
{
    int L = s->g.n_layers, H = s->g.n_kv_heads, d = s->g.head_dim, call = 0;
    *st = KVCAP_OK;
    for (int q = 0; t == 0 && q < s->n_seqs; q++, call++)
        if (call >= from && (*st = kvcap_cache_end_prefill(c, q)) != KVCAP_OK)
            return call;
    for (int l = 0; l < L; l++) {
        for (int q = 0; q < s->n_seqs; q++, call++) {
            if (call < from)
                continue;
            const float *tok = s->gen + (((size_t)t * L + l) * s->n_seqs + q) * tok_floats(s);
            struct kvcap_tensor_view k = {tok, NULL, 0, KVCAP_DTYPE_F32, d, 0};
            struct kvcap_tensor_view v = {tok + (size_t)H * d, NULL, 0, KVCAP_DTYPE_F32, d, 0};
            if ((*st = kvcap_cache_append(c, q, l, &k, &v)) != KVCAP_OK)
                return call;
        }
        if (call++ < from)
            continue;
        const float *q = s->q + ((size_t)t * L + l) * q_floats(s);
        if ((*st = kvcap_cache_attend(c, l, q, out + (size_t)l * q_floats(s))) != KVCAP_OK)
            return call - 1;
    }
    return call;
}

static void expect_outputs(const struct scenario *s, int t, const float *out, long fault)
{
    size_t n = (size_t)s->g.n_layers * q_floats(s);
    const float *want = s->want + (size_t)t * n;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&out[i], &want[i], sizeof(float)) != 0)
            fail_msg("%s: step %d, allocation %ld failed: output %zu is %.9g, a cache without "
                     "faults gives %.9g",
                     s->name, t, fault, i, (double)out[i], (double)want[i]);
}

/* Every allocation of every decode step made to fail once, in turn (see the file comment). */
static void check_scenario(struct scenario *s)
{
    size_t n_out = (size_t)s->g.n_layers * q_floats(s);
    float *out = malloc(sizeof(float) * n_out);
    assert_non_null(out);
    enum kvcap_status st;
    struct kvcap_cache *ref = build(s);
    for (int t = 0; t < STEPS; t++) {
        run_step(s, ref, t, 0, s->want + (size_t)t * n_out, &st);
        if (st != KVCAP_OK)
            fail_msg("%s: step %d without faults: %s", s->name, t, kvcap_last_error());
    }
    kvcap_cache_free(ref);

    long refused = 0, absorbed = 0;
    for (int t = 0; t < STEPS; t++) {
        long i = 1;
        for (;; i++) {
            struct kvcap_cache *c = build(s);
            for (int u = 0; u < t; u++) {
                run_step(s, c, u, 0, out, &st);
                assert_int_equal(st, KVCAP_OK);
            }
            for (size_t j = 0; j < n_out; j++)
                out[j] = NAN;
            kvcap_clear_error();
            arm(i);
            int failed = run_step(s, c, t, 0, out, &st);
            int hit = disarm();
            if (!hit) { /* the step made fewer than i allocations: all have been tried */
                assert_int_equal(st, KVCAP_OK);
                expect_outputs(s, t, out, 0);
                kvcap_cache_free(c);
                break;
            }
            if (getenv("FAULTS_DEBUG"))
                fprintf(stderr, "step %d alloc %ld: call %d: %s: %s\n", t, i, failed,
                        kvcap_status_str(st), kvcap_last_error());
            if (st == KVCAP_OK) {
                absorbed++;
            } else {
                refused++;
                if (kvcap_last_error()[0] == '\0')
                    fail_msg("%s: step %d, allocation %ld failed: status %s without a message",
                             s->name, t, i, kvcap_status_str(st));
                run_step(s, c, t, failed, out, &st); /* the same call again, no faults */
                if (st != KVCAP_OK)
                    fail_msg("%s: step %d, allocation %ld failed: the cache is not usable "
                             "after it: %s", s->name, t, i, kvcap_last_error());
            }
            expect_outputs(s, t, out, i);
            kvcap_cache_free(c);
        }
        print_message("%s: step %d: %ld allocations, each failed once\n", s->name, t, i - 1);
    }
    print_message("%s: %ld failures returned a status, %ld were absorbed with exact outputs\n",
                  s->name, refused, absorbed);
    assert_true(refused > 0); /* the step allocates: some failure must have been reported */
    free(out);
}

/* Every policy composed in one batch: KVCapsule (tiled and dense maps), FlashCache (a vision
 * span without a bucket), streaming text, FreeKV for generated tokens. */
static void test_composed(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = {.name = "faults", .n_layers = 2, .n_q_heads = 8,
                                     .n_kv_heads = 2, .head_dim = 64,
                                     .rope_type = KVCAP_ROPE_ROPE,
                                     .rope_pairing = KVCAP_ROPE_PAIRING_HALF, .rope_theta = 1e4};
    struct scenario s;
    /* tau 1: FreeKV selects with each step's own queries, so a step repeated after a failure
     * selects what an undisturbed cache does */
    scenario_init(&s, "composed", g, 2,
                  "policies: {vision: kvcapsule, text: streaming, generated: freekv}\n"
                  "fallback: flashcache\n"
                  "flashcache: {retention: 0.5, sinks: 2, window: 4, min_tokens: 2}\n"
                  "streaming: {sinks: 2, window: 8}\n"
                  "freekv: {page_size: 2, budget: 8, sink_pages: 1, window_pages: 1, tau: 1}\n");
    const struct test_bucket tb[2] = {{4, 4, 2, 2, 2, 3, 2}, {6, 6, 0, 0, 12, 20, 18}};
    char path[600];
    snprintf(path, sizeof path, "%s.kvcap", s.config);
    write_artifact(path, &g, tb, 2, 41);
    if (kvcap_artifact_open(path, &s.artifact) != KVCAP_OK)
        fail_msg("%s: %s", path, kvcap_last_error());
    unlink(path);
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 40);
    add_span(&s, &r, 0, KVCAP_SPAN_VISION, 4, 4, 16, 0);  /* kvcapsule, tiled maps */
    add_span(&s, &r, 0, KVCAP_SPAN_VISION, 6, 6, 36, 16); /* kvcapsule, dense maps */
    add_span(&s, &r, 0, KVCAP_SPAN_VISION, 5, 5, 25, 52); /* no bucket: flashcache */
    add_span(&s, &r, 0, KVCAP_SPAN_TEXT, 0, 0, 30, 77);   /* streaming */
    add_span(&s, &r, 1, KVCAP_SPAN_TEXT, 0, 0, 20, 0);
    add_span(&s, &r, 1, KVCAP_SPAN_VISION, 4, 4, 16, 20);
    scenario_tokens(&s, &r);
    check_scenario(&s);
    scenario_free(&s);
}

/* Query groups of G·d = 6144 > 4096 floats: the row kernel packs them in memory it allocates. */
static void test_wide_groups(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = {.name = "faults-wide", .n_layers = 1, .n_q_heads = 24,
                                     .n_kv_heads = 1, .head_dim = 256,
                                     .rope_type = KVCAP_ROPE_ROPE,
                                     .rope_pairing = KVCAP_ROPE_PAIRING_HALF, .rope_theta = 1e4};
    struct scenario s;
    scenario_init(&s, "wide", g, 1, "policies: {vision: full, text: full, generated: full}\n");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 42);
    add_span(&s, &r, 0, KVCAP_SPAN_TEXT, 0, 0, 40, 0);
    scenario_tokens(&s, &r);
    check_scenario(&s);
    scenario_free(&s);
}

int main(void)
{
    if (FAULTS_SKIP) {
        printf("skipped: a sanitizer owns the allocator in this build\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_composed),
        cmocka_unit_test(test_wide_groups),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
