/* test_common.c — the public conventions: version agreement between header and library, status
 * strings, per-thread last error, the log callback (also set while other threads log), geometry
 * and bucket validation, names; SHA-256 against the standard's vectors; and the runtime's thread
 * pool. */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/internal.h"
#include "common/sha256.h"
#include "runtime/pool.h"

static void test_version_agrees(void **state)
{
    (void)state;
    assert_int_equal(kvcap_version_number(), KVCAP_VERSION_NUMBER);
    assert_string_equal(kvcap_version(), KVCAP_VERSION_STRING);
    char expect[32];
    snprintf(expect, sizeof expect, "%d.%d.%d", KVCAP_VERSION_MAJOR, KVCAP_VERSION_MINOR,
             KVCAP_VERSION_PATCH);
    assert_string_equal(kvcap_version(), expect);
}

static void test_status_strings(void **state)
{
    (void)state;
    /* Values are pinned (part of the ABI). */
    assert_int_equal(KVCAP_OK, 0);
    assert_int_equal(KVCAP_ERR_FORMAT, 4);
    assert_int_equal(KVCAP_ERR_INTERNAL, 13);
    for (int s = KVCAP_OK; s <= KVCAP_ERR_INTERNAL; s++) {
        const char *text = kvcap_status_str((enum kvcap_status)s);
        assert_non_null(text);
        assert_string_not_equal(text, "unknown status");
        for (int t = KVCAP_OK; t < s; t++)
            assert_string_not_equal(text, kvcap_status_str((enum kvcap_status)t));
    }
    assert_string_equal(kvcap_status_str((enum kvcap_status)999), "unknown status");
}

struct captured {
    int calls;
    enum kvcap_log_level level;
    char message[256];
};

static void capture(enum kvcap_log_level level, const char *message, void *user)
{
    struct captured *c = user;
    c->calls++;
    c->level = level;
    snprintf(c->message, sizeof c->message, "%s", message);
}

static void test_log_and_last_error(void **state)
{
    (void)state;
    struct captured c = {0};
    kvcap_log_set(capture, &c, KVCAP_LOG_WARN);
    kvcap_log(KVCAP_LOG_INFO, "filtered %d", 1);
    assert_int_equal(c.calls, 0);
    kvcap_log(KVCAP_LOG_WARN, "kept %d", 2);
    assert_int_equal(c.calls, 1);
    assert_string_equal(c.message, "kept 2");

    assert_int_equal(kvcap_fail(KVCAP_ERR_IO, "x.bin: %s", "gone"), KVCAP_ERR_IO);
    assert_string_equal(kvcap_last_error(), "x.bin: gone");
    assert_int_equal(c.calls, 2);
    /* re-raising the last error with more context is safe (no aliasing) */
    kvcap_fail(KVCAP_ERR_IO, "outer: %s", kvcap_last_error());
    assert_string_equal(kvcap_last_error(), "outer: x.bin: gone");
    assert_int_equal(c.calls, 3);
    /* quiet sections record without logging */
    kvcap_quiet_push();
    kvcap_fail(KVCAP_ERR_IO, "quiet");
    kvcap_quiet_pop();
    assert_string_equal(kvcap_last_error(), "quiet");
    assert_int_equal(c.calls, 3);
    assert_int_equal(c.level, KVCAP_LOG_ERROR);
    assert_string_equal(c.message, "outer: x.bin: gone");

    /* a level past ERROR is clamped: errors still arrive, nothing below them does */
    kvcap_log_set(capture, &c, (enum kvcap_log_level)42);
    kvcap_log(KVCAP_LOG_WARN, "filtered");
    assert_int_equal(c.calls, 3);
    kvcap_log(KVCAP_LOG_ERROR, "error %d", 4);
    assert_int_equal(c.calls, 4);
    assert_string_equal(c.message, "error 4");

    kvcap_log_set(NULL, NULL, KVCAP_LOG_DEBUG);
    kvcap_log(KVCAP_LOG_ERROR, "silent");
    assert_int_equal(c.calls, 4);
    kvcap_clear_error();
    assert_string_equal(kvcap_last_error(), "");
}

static void *fail_in_thread(void *arg)
{
    (void)arg;
    kvcap_fail(KVCAP_ERR_STATE, "from the other thread");
    return NULL;
}

static void test_last_error_is_per_thread(void **state)
{
    (void)state;
    kvcap_fail(KVCAP_ERR_IO, "from this thread");
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, fail_in_thread, NULL), 0);
    pthread_join(t, NULL);
    assert_string_equal(kvcap_last_error(), "from this thread");
}

/* kvcap_log_set while other threads log: sink i is (sink_fns[i], &sinks[i], level i), and each
 * callback checks that it got the user pointer and a level of the filter installed with it. */
enum { LOG_SINKS = 4, LOG_THREADS = 3, LOG_SETS = 20000, LOG_MIN_CALLS = 2000 };
struct sink_check {
    atomic_int calls, wrong_user, wrong_level;
};
static struct sink_check sinks[LOG_SINKS];
static atomic_int logging_done;

static void sink_called(int i, enum kvcap_log_level level, void *user)
{
    atomic_fetch_add(&sinks[i].calls, 1);
    if (user != &sinks[i])
        atomic_fetch_add(&sinks[i].wrong_user, 1);
    if ((int)level < i)
        atomic_fetch_add(&sinks[i].wrong_level, 1);
}

#define SINK(i)                                                                        \
    static void sink##i(enum kvcap_log_level level, const char *message, void *user)  \
    {                                                                                  \
        (void)message;                                                                 \
        sink_called(i, level, user);                                                   \
    }
SINK(0)
SINK(1)
SINK(2)
SINK(3)
static const kvcap_log_fn sink_fns[LOG_SINKS] = {sink0, sink1, sink2, sink3};

static void *log_until_done(void *arg)
{
    unsigned n = 0;
    while (!atomic_load(&logging_done)) {
        kvcap_log((enum kvcap_log_level)(n % 4), "thread %d message %u", (int)(intptr_t)arg, n);
        n++;
    }
    return NULL;
}

static void test_log_set_while_logging(void **state)
{
    (void)state;
    for (int i = 0; i < LOG_SINKS; i++) {
        atomic_store(&sinks[i].calls, 0);
        atomic_store(&sinks[i].wrong_user, 0);
        atomic_store(&sinks[i].wrong_level, 0);
    }
    atomic_store(&logging_done, 0);
    pthread_t threads[LOG_THREADS];
    for (int t = 0; t < LOG_THREADS; t++)
        assert_int_equal(pthread_create(&threads[t], NULL, log_until_done, (void *)(intptr_t)t),
                         0);
    /* At least LOG_SETS settings, and on until the loggers have delivered LOG_MIN_CALLS messages
     * (a slow start on a busy machine must not leave nothing checked), within bounds. */
    int calls = 0;
    for (int i = 0; i < LOG_SETS || (calls < LOG_MIN_CALLS && i < 1000 * LOG_SETS); i++) {
        int k = i % (LOG_SINKS + 1);
        if (k == LOG_SINKS)
            kvcap_log_set(NULL, NULL, KVCAP_LOG_DEBUG);
        else
            kvcap_log_set(sink_fns[k], &sinks[k], (enum kvcap_log_level)k);
        calls = 0;
        for (int j = 0; j < LOG_SINKS; j++)
            calls += atomic_load(&sinks[j].calls);
    }
    atomic_store(&logging_done, 1);
    for (int t = 0; t < LOG_THREADS; t++)
        pthread_join(threads[t], NULL);
    kvcap_log_set(NULL, NULL, KVCAP_LOG_DEBUG);
    calls = 0;
    for (int i = 0; i < LOG_SINKS; i++) {
        assert_int_equal(atomic_load(&sinks[i].wrong_user), 0);
        assert_int_equal(atomic_load(&sinks[i].wrong_level), 0);
        calls += atomic_load(&sinks[i].calls);
    }
    assert_true(calls >= LOG_MIN_CALLS);
}

static struct kvcap_model_geometry qwen(void)
{
    struct kvcap_model_geometry g = {
        .name = "qwen", .n_layers = 28, .n_q_heads = 28, .n_kv_heads = 4, .head_dim = 128,
        .rope_type = KVCAP_ROPE_MROPE, .rope_pairing = KVCAP_ROPE_PAIRING_HALF,
        .rope_theta = 1e6, .n_rope_sections = 3, .rope_sections = {16, 24, 24}};
    return g;
}

static void expect_geometry_error(struct kvcap_model_geometry g, const char *field)
{
    assert_int_equal(kvcap_geometry_validate(&g), KVCAP_ERR_GEOMETRY);
    if (!strstr(kvcap_last_error(), field))
        fail_msg("message \"%s\" does not name %s", kvcap_last_error(), field);
}

static void test_geometry_validate(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = qwen();
    assert_int_equal(kvcap_geometry_validate(&g), KVCAP_OK);
    g = qwen(); g.head_dim = 100; expect_geometry_error(g, "model.head_dim");
    g = qwen(); g.n_q_heads = 30; expect_geometry_error(g, "model.q_heads");
    g = qwen(); g.n_layers = 0; expect_geometry_error(g, "model.layers");
    g = qwen(); g.rope_sections[2] = 23; expect_geometry_error(g, "model.rope.sections");
    g = qwen(); g.rope_theta = 0; expect_geometry_error(g, "model.rope.theta");
    /* what YAML cannot spell must not pass through the API or a file header either */
    g = qwen(); g.rope_theta = INFINITY; expect_geometry_error(g, "model.rope.theta: inf");
    g = qwen(); g.rope_theta = -INFINITY; expect_geometry_error(g, "model.rope.theta");
    g = qwen(); g.rope_theta = NAN; expect_geometry_error(g, "model.rope.theta");
    g = qwen(); g.rope_theta = -1e6; expect_geometry_error(g, "model.rope.theta");
    /* sections whose int sum wraps around to rope_dim / 2 = 64 */
    g = qwen(); g.rope_sections[0] = INT_MAX; g.rope_sections[1] = INT_MAX; g.rope_sections[2] = 66;
    expect_geometry_error(g, "model.rope.sections: sum 4294967360 != rotated pairs 64");
    g = qwen(); g.rope_dim = 127; expect_geometry_error(g, "model.rope.dim");
    g = qwen(); g.rope_type = KVCAP_ROPE_ROPE; expect_geometry_error(g, "model.rope.sections");
    g = qwen(); g.rope_type = KVCAP_ROPE_NONE;
    assert_int_equal(kvcap_geometry_validate(&g), KVCAP_OK);
    for (int d = 64; d <= 256; d += 16) {
        g = qwen(); g.head_dim = d; g.rope_dim = 64; g.rope_sections[0] = 8; g.rope_sections[1] = 12;
        g.rope_sections[2] = 12;
        int ok = d == 64 || d == 80 || d == 96 || d == 128 || d == 256;
        assert_int_equal(kvcap_geometry_validate(&g), ok ? KVCAP_OK : KVCAP_ERR_GEOMETRY);
    }
    assert_int_equal(kvcap_geometry_validate(NULL), KVCAP_ERR_INVALID_ARGUMENT);
}

/* The one conversion of JSON/YAML numbers to integers: whole numbers in range only, never an
 * undefined cast (NaN, infinities, values past the type), never a silent truncation. */
static void test_int_from_double(void **state)
{
    (void)state;
    int v = -7;
    assert_true(kvcap_int_from_double(12.0, 1, 1024, &v) && v == 12);
    assert_true(kvcap_int_from_double(-3.0, -4096, 4096, &v) && v == -3);
    assert_true(kvcap_int_from_double(-0.0, 0, 1, &v) && v == 0);
    v = -7;
    static const double bad[] = {2.5, -0.5, 1e-300, 0.0, 1025.0, NAN, INFINITY, -INFINITY,
                                 1e300, -1e300, 4294967297.0};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (kvcap_int_from_double(bad[i], 1, 1024, &v) || v != -7)
            fail_msg("%g accepted for 1..1024 (out %d)", bad[i], v);
    /* a range wider than int is clamped to int */
    assert_false(kvcap_int_from_double(2147483648.0, 0, LONG_MAX, &v));
    assert_true(kvcap_int_from_double(2147483647.0, 0, LONG_MAX, &v) && v == INT_MAX);
    assert_true(kvcap_int_from_double(-2147483648.0, LONG_MIN, 0, &v) && v == INT_MIN);
    int64_t w = 0;
    assert_true(kvcap_int64_from_double(9007199254740992.0, 0, INT64_C(1) << 53, &w) &&
                w == INT64_C(1) << 53);
    assert_false(kvcap_int64_from_double(9007199254740994.0, 0, INT64_C(1) << 53, &w));
    /* 2^63 is past INT64_MAX although (double)INT64_MAX compares equal to it */
    assert_false(kvcap_int64_from_double(0x1p63, 0, INT64_MAX, &w));
    assert_true(kvcap_int64_from_double(-0x1p63, INT64_MIN, 0, &w) && w == INT64_MIN);
    assert_false(kvcap_int64_from_double(NAN, INT64_MIN, INT64_MAX, &w));
}

static void test_bucket_validate(void **state)
{
    (void)state;
    struct kvcap_bucket dense = {16, 16, KVCAP_STRUCTURE_DENSE, 0, 0};
    struct kvcap_bucket tiled = {32, 24, KVCAP_STRUCTURE_TILED, 4, 8};
    struct kvcap_bucket bad_tile = {32, 24, KVCAP_STRUCTURE_TILED, 5, 8};
    struct kvcap_bucket bad_grid = {0, 24, KVCAP_STRUCTURE_DENSE, 0, 0};
    assert_int_equal(kvcap_bucket_check(&dense, "buckets[0]"), KVCAP_OK);
    assert_int_equal(kvcap_bucket_check(&tiled, "buckets[1]"), KVCAP_OK);
    assert_int_equal(kvcap_bucket_check(&bad_tile, "buckets[2]"), KVCAP_ERR_GEOMETRY);
    assert_non_null(strstr(kvcap_last_error(), "buckets[2].tile: [5, 8]"));
    assert_int_equal(kvcap_bucket_check(&bad_grid, "buckets[3]"), KVCAP_ERR_GEOMETRY);
    assert_non_null(strstr(kvcap_last_error(), "buckets[3]"));
}

static void test_names_round_trip(void **state)
{
    (void)state;
    for (int p = KVCAP_POLICY_FULL; p < KVCAP_POLICY_COUNT; p++) {
        enum kvcap_policy back;
        assert_true(kvcap_policy_parse(kvcap_policy_name((enum kvcap_policy)p), &back));
        assert_int_equal(back, p);
    }
    for (int d = KVCAP_DTYPE_F32; d <= KVCAP_DTYPE_U8; d++) {
        enum kvcap_dtype back;
        assert_true(kvcap_dtype_parse(kvcap_dtype_name((enum kvcap_dtype)d), &back));
        assert_int_equal(back, d);
        assert_true(kvcap_dtype_size((enum kvcap_dtype)d) > 0);
    }
    enum kvcap_rope_pairing pairing;
    assert_true(kvcap_rope_pairing_parse("neox", &pairing));
    assert_int_equal(pairing, KVCAP_ROPE_PAIRING_HALF);
    enum kvcap_policy p;
    assert_false(kvcap_policy_parse("h2o", &p));
    assert_false(kvcap_policy_parse(NULL, &p));
    assert_string_equal(kvcap_policy_name((enum kvcap_policy)77), "?");
    assert_int_equal(kvcap_dtype_size((enum kvcap_dtype)77), 0);
}

/* ---- Thread pool ---------------------------------------------------------------------------- */

#define POOL_MAX_TASKS 64
#define POOL_THREADS 4

struct pool_probe {
    atomic_int runs[POOL_MAX_TASKS];
    atomic_int bad_thread, busy[POOL_THREADS];
    atomic_int overlap; /* a thread index used by two tasks at once */
    int spin;           /* busy work per task, varied so workers join early or late */
};

static void pool_probe_task(void *ctx, int task, int thread)
{
    struct pool_probe *p = ctx;
    if (thread < 0 || thread >= POOL_THREADS) {
        atomic_fetch_add(&p->bad_thread, 1);
        return;
    }
    if (atomic_fetch_add(&p->busy[thread], 1) != 0)
        atomic_fetch_add(&p->overlap, 1);
    volatile unsigned x = (unsigned)task;
    for (int i = 0; i < p->spin * (task % 5 + 1); i++)
        x = x * 1664525u + 1013904223u;
    atomic_fetch_add(&p->runs[task], 1);
    atomic_fetch_sub(&p->busy[thread], 1);
}

/* Every task runs exactly once per run, on a valid and exclusive thread index, whatever the task
 * count and however late the workers wake; back-to-back runs never mix. */
static void test_pool_runs_each_task_once(void **state)
{
    (void)state;
    struct kvcap_pool *pool = NULL;
    assert_int_equal(kvcap_pool_create(POOL_THREADS, &pool), KVCAP_OK);
    static struct pool_probe probe;
    for (int run = 0; run < 3000; run++) {
        int n = 1 + (run * 7) % POOL_MAX_TASKS;
        for (int t = 0; t < POOL_MAX_TASKS; t++)
            atomic_store(&probe.runs[t], 0);
        probe.spin = run % 3 == 0 ? 0 : run % 3 == 1 ? 200 : 5000;
        kvcap_pool_run(pool, n, pool_probe_task, &probe);
        for (int t = 0; t < POOL_MAX_TASKS; t++)
            if (atomic_load(&probe.runs[t]) != (t < n))
                fail_msg("run %d (%d tasks): task %d ran %d times", run, n, t,
                         atomic_load(&probe.runs[t]));
    }
    assert_int_equal(atomic_load(&probe.bad_thread), 0);
    assert_int_equal(atomic_load(&probe.overlap), 0);
    kvcap_pool_run(pool, 0, pool_probe_task, &probe); /* no tasks: returns at once */
    kvcap_pool_free(pool);
    kvcap_pool_free(NULL);
    assert_int_equal(kvcap_pool_create(0, &pool), KVCAP_ERR_INVALID_ARGUMENT);
}

/* The table the tools' signal handlers empty: entered files are removed, files taken out are
 * not, and a full table says so instead of dropping an entry silently. */
static void test_temp_files(void **state)
{
    (void)state;
    const char *dir = getenv("TMPDIR");
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/temp-a-%d", dir && *dir ? dir : "/tmp", (int)getpid());
    snprintf(b, sizeof b, "%s/temp-b-%d", dir && *dir ? dir : "/tmp", (int)getpid());
    FILE *f = fopen(a, "w");
    assert_non_null(f);
    fclose(f);
    assert_non_null(f = fopen(b, "w"));
    fclose(f);
    int sa = kvcap_temp_register(a), sb = kvcap_temp_register(b);
    assert_true(sa >= 0 && sb >= 0 && sa != sb);
    kvcap_temp_unregister(sb); /* renamed into place: no longer temporary */
    kvcap_temp_remove_all();
    assert_int_equal(access(a, F_OK), -1);
    assert_int_equal(access(b, F_OK), 0);
    kvcap_temp_unregister(sa);
    unlink(b);
    int slots[65], n = 0;
    while (n < 65 && (slots[n] = kvcap_temp_register("/nonexistent/x")) >= 0)
        n++;
    assert_int_equal(n, 64);
    while (n > 0)
        kvcap_temp_unregister(slots[--n]);
    assert_true((slots[0] = kvcap_temp_register("/nonexistent/x")) >= 0);
    kvcap_temp_unregister(slots[0]);
}

static void sha256_of(const void *data, size_t len, char hex[65])
{
    struct kvcap_sha256 s;
    kvcap_sha256_init(&s);
    kvcap_sha256_update(&s, data, len);
    kvcap_sha256_hex(&s, hex);
}

/* SHA-256: FIPS 180-2's examples (one block, two blocks, a million a's), the padding's edges
 * (55 to 65 bytes: the length fits in the last block or needs one more; hashlib's digests), the
 * same digest whatever pieces the message comes in, and the little-endian words metrics.json's
 * prompts_sha256 is made of (a known answer that tests/python/test_kvpress_reference.py gives
 * scripts/kvpress_reference.py too). */
static void test_sha256(void **state)
{
    (void)state;
    static const struct {
        const char *msg;
        const char *hex;
    } vectors[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
        {"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqr"
         "lmnopqrsmnopqrstnopqrstu",
         "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
    };
    char hex[65];
    for (size_t i = 0; i < sizeof vectors / sizeof vectors[0]; i++) {
        sha256_of(vectors[i].msg, strlen(vectors[i].msg), hex);
        assert_string_equal(hex, vectors[i].hex);
    }
    static const struct {
        int len;
        const char *hex;
    } edges[] = {{55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
                 {56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
                 {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
                 {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
                 {65, "635361c48bb9eab14198e76ea8ab7f1a41685d6ad62aa9146d301d4f17eb0ae0"}};
    char a[1000];
    memset(a, 'a', sizeof a);
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++) {
        sha256_of(a, (size_t)edges[i].len, hex);
        assert_string_equal(hex, edges[i].hex);
    }
    struct kvcap_sha256 s;
    kvcap_sha256_init(&s);
    for (int i = 0; i < 1000; i++)
        kvcap_sha256_update(&s, a, sizeof a);
    kvcap_sha256_hex(&s, hex);
    assert_string_equal(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    /* in pieces: every split of the 112-byte vector into a head and two tails */
    const char *m = vectors[3].msg;
    for (size_t i = 0; i <= 112; i++)
        for (size_t j = i; j <= 112; j += 7) {
            kvcap_sha256_init(&s);
            kvcap_sha256_update(&s, m, i);
            kvcap_sha256_update(&s, m + i, j - i);
            kvcap_sha256_update(&s, m + j, 112 - j);
            kvcap_sha256_hex(&s, hex);
            if (strcmp(hex, vectors[3].hex) != 0)
                fail_msg("split at %zu and %zu: %s", i, j, hex);
        }
    /* int32 then float32 words, little-endian: hashlib.sha256(struct.pack("<5i", 1, 2, 300, -1,
     * 49151)) and then struct.pack("<3f", 1.0, -0.5, 3.25) */
    const int32_t ids[5] = {1, 2, 300, -1, 49151};
    const float embd[3] = {1.0f, -0.5f, 3.25f};
    kvcap_sha256_init(&s);
    kvcap_sha256_update_i32le(&s, ids, 5);
    kvcap_sha256_hex(&s, hex);
    assert_string_equal(hex, "d0355cd94aa8d26d3af2643b161d8dfcc76e7220f85299ceedcc9fa5197244f3");
    kvcap_sha256_init(&s);
    kvcap_sha256_update_i32le(&s, ids, 5);
    kvcap_sha256_update_f32le(&s, embd, 3);
    kvcap_sha256_hex(&s, hex);
    assert_string_equal(hex, "64b65f46b9c88c9cbddd2678dc05d01672cc1fc56d83343d2b9cae53343f0655");
    /* longer than the word buffer (64 words):
     * hashlib.sha256(struct.pack("<1000i", *range(-500, 500))) */
    int32_t many[1000];
    for (int i = 0; i < 1000; i++)
        many[i] = i - 500;
    kvcap_sha256_init(&s);
    kvcap_sha256_update_i32le(&s, many, 1000);
    kvcap_sha256_hex(&s, hex);
    assert_string_equal(hex, "f96a54b81d1bef1b112117738ef48e0f9664d986acf8c0004c3e79bf550f2df1");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_version_agrees),
        cmocka_unit_test(test_status_strings),
        cmocka_unit_test(test_log_and_last_error),
        cmocka_unit_test(test_last_error_is_per_thread),
        cmocka_unit_test(test_log_set_while_logging),
        cmocka_unit_test(test_geometry_validate),
        cmocka_unit_test(test_int_from_double),
        cmocka_unit_test(test_bucket_validate),
        cmocka_unit_test(test_names_round_trip),
        cmocka_unit_test(test_pool_runs_each_task_once),
        cmocka_unit_test(test_temp_files),
        cmocka_unit_test(test_sha256),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
