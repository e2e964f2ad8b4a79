/* decode.c — kvcap-bench: replays prefill + N decode steps for each policy (the policies
 * taking turns step by step) and prints, per policy, time per decode step, bytes read per step,
 * achieved GB/s against this machine's read bandwidth measured in the same run, bytes held, and
 * the same against `full` as ratios; and
 * (--flashcache-overhead) FlashCache's compression time per prefill at 2K/4K/8K tokens. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include "runtime/artifact.h"
#include "kernels/attention.h"
#include "cli/cli.h"
#include "common/internal.h"
#include "common/rng.h"
#include "formats/schema.h"
#include "calibrate/synth.h"
#include "bench/common.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvcap-bench [options]\n"
            "\n"
            "Replays prefill of vision spans plus decode steps through libkvcap for each policy\n"
            "and prints time and bytes per decode step next to the machine's read bandwidth and\n"
            "to `full`, measured in the same run. Without --artifact the KVCapsule maps are random\n"
            "(timing and bytes only; fidelity is what kvcap-calibrate reports).\n"
            "\n"
            "options:\n"
            "  -g, --grid RxC       vision span grid (default 64x128 = 8192 tokens)\n"
            "  -t, --tile RxC       tiled maps with this tile (default 4x4); 'dense' for dense maps\n"
            "  -r, --ratio R        retention of the random maps (default 0.4)\n"
            "  -l, --layers L       layers (default 4; q/kv heads and head_dim as Qwen2.5-VL-7B)\n"
            "      --heads Q/KV     query and KV heads per layer (default 28/4, G = 7); e.g.\n"
            "                       32/32 for an MHA model such as LLaVA-1.5-7B (G = 1)\n"
            "  -b, --batch B        sequences (default 1)\n"
            "  -s, --steps N        decode steps timed (default 20)\n"
            "  -a, --artifact FILE  use this artifact (its geometry and buckets) instead\n"
            "      --storage T      f32, f16 (default) or bf16\n"
            "      --threads N      threads (default: all cores)\n"
            "      --engine-threads attend's tasks run on the bench's own OpenMP threads, which\n"
            "                       also do the eviction between calls, as an engine's thread\n"
            "                       pool would (params.parallel_for); default: the cache's pool,\n"
            "                       whose sleeping workers each call must wake\n"
            "  -p, --policy P       run only full and P (streaming, kvcapsule, flashcache,\n"
            "                       vlcache or freekv), e.g. to profile\n"
            "      --freekv-static  freekv holds only the vision span, the generated tokens\n"
            "                       stay in full (the evaluation's layout); default: freekv\n"
            "                       takes the generated tokens too (its store grows every step)\n"
            "      --post N         post-vision queries given to vlcache (default 32)\n"
            "      --warm           leave the caches warm between attention calls (default:\n"
            "                       read a buffer 8x the last-level cache before each call,\n"
            "                       untimed, as a model's weights would between two layers)\n"
            "      --row-kernels    instead: the plain-attention row kernels and (tiled maps)\n"
            "                       fused KVCapsule attention on one thread, on data that stays\n"
            "                       in L2 (compute rate) and on cold data, next to the read\n"
            "                       bandwidth: where the decode time goes\n"
            "      --flashcache-overhead\n"
            "                       instead: FlashCache compression time of one span over all\n"
            "                       layers at 2K, 4K and 8K tokens (--layers default 28 here)\n"
            "  -h, --help           show this help\n"
            "\n"
            "Policies compress the vision span (freekv also takes the generated tokens unless\n"
            "--freekv-static); each decode step appends one generated token per layer, then\n"
            "attends. Policy parameters are the runtime defaults (configs/runtime.yaml).\n");
}

/* Evicts the CPU caches, as a model's other work between two attention calls of the same layer
 * does: it reads hundreds of MB of weights and writes only a few activations per token. */
struct evictor {
    float *buf;
    size_t n;
    int threads; /* > 1: read by that many OpenMP threads, as an engine's pool reads weights */
};

static size_t last_level_cache_bytes(void)
{
    /* sysfs first: inside a VM sysconf may report the host's cache */
    size_t kib = 0;
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    if (f) {
        if (fscanf(f, "%zuK", &kib) != 1)
            kib = 0;
        fclose(f);
    }
    if (kib > 0)
        return kib << 10;
    long l3 = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
    l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    return l3 > 0 ? (size_t)l3 : (size_t)32 << 20;
}

/* A model's weights between two layers: read, never written, so the caches hold clean lines
 * (evicting dirty ones would add write-backs to the attention that follows). */
static volatile float evict_sink;
static void evict_caches(struct evictor *e)
{
    if (!e->buf)
        return;
    float s = 0;
    long n = (long)(e->n / 16); /* one touch per 64-byte line */
#pragma omp parallel for num_threads(e->threads) reduction(+ : s) if (e->threads > 1)
    for (long i = 0; i < n; i++)
        s += e->buf[16 * (size_t)i];
    evict_sink = s;
}

/* An evictor of `bytes` whose pages are written once (untouched pages would all read the one
 * shared zero page and evict nothing); buf NULL when out of memory. */
static struct evictor evictor_make(size_t bytes)
{
    struct evictor e = {malloc(bytes), bytes / sizeof(float), 1};
    for (size_t i = 0; e.buf && i < e.n; i++)
        e.buf[i] = (float)(i & 255);
    return e;
}

/* Best-of-3 read bandwidth (GB/s) of a buffer far larger than the caches, all threads. */
static double read_bandwidth(int threads)
{
    size_t n = (size_t)1 << 28; /* 1 GiB of floats */
    float *buf = malloc(n * sizeof(float));
    if (!buf)
        return 0.0;
#pragma omp parallel for num_threads(threads)
    for (size_t i = 0; i < n; i++)
        buf[i] = (float)(i & 1023);
    double best = 0.0;
    volatile float sink = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = kvcap_seconds(), total = 0.0;
#pragma omp parallel for num_threads(threads) reduction(+ : total)
        for (size_t b = 0; b < n; b += 4096) {
            float acc[16] = {0};
            for (size_t i = b; i < b + 4096; i += 16)
                for (int j = 0; j < 16; j++)
                    acc[j] += buf[i + j];
            for (int j = 0; j < 16; j++)
                total += acc[j];
        }
        double rate = (double)n * sizeof(float) / (kvcap_seconds() - t0) * 1e-9;
        sink += (float)total;
        best = rate > best ? rate : best;
    }
    (void)sink;
    free(buf);
    return best;
}

#if defined(__GNUC__) && defined(__x86_64__)
/* fp32 FMA throughput (GFLOP/s) of one thread: 12 independent 8-lane chains, enough to cover
 * the FMA latency on current x86 cores. */
__attribute__((target("avx2,fma"))) static double fma_rate_avx2(long iters)
{
    __m256 acc[12], x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++)
        acc[i] = _mm256_set1_ps((float)i);
    double t0 = kvcap_seconds();
    for (long it = 0; it < iters; it++)
        for (int i = 0; i < 12; i++)
            acc[i] = _mm256_fmadd_ps(acc[i], x, y);
    double dt = kvcap_seconds() - t0;
    float sink[8];
    __m256 s = acc[0];
    for (int i = 1; i < 12; i++)
        s = _mm256_add_ps(s, acc[i]);
    _mm256_storeu_ps(sink, s);
    volatile float keep = sink[0];
    (void)keep;
    return (double)iters * 12 * 8 * 2 / dt * 1e-9;
}
#endif

/* Best-of-3 fp32 FMA peak (GFLOP/s) over `threads` threads; 0 where it is not measured (no
 * AVX2+FMA). The compute roof of the decode kernels, which use the same instructions. */
static double fma_peak(int threads)
{
#if defined(__GNUC__) && defined(__x86_64__)
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return 0.0;
    double best = 0.0;
    for (int rep = 0; rep < 3; rep++) {
        double total = 0.0;
#pragma omp parallel for num_threads(threads) reduction(+ : total)
        for (int t = 0; t < threads; t++)
            total += fma_rate_avx2(20000000L);
        best = total > best ? total : best;
    }
    return best;
#else
    (void)threads;
    return 0.0;
#endif
}

/* One kernel of one KV head's G queries on one thread: plain attention over rows of K/V, or
 * (maps set) fused KVCapsule attention over tiles, with H and Ṽ in k and v. */
struct rate_job {
    const void *k, *v, *mu;
    enum kvcap_dtype dt;
    int d, nq;
    const float *q;
    struct kvcap_partial acc;
    const struct kvcap_capsule_maps *maps; /* NULL: plain rows */
    float *scratch;
    size_t scratch_floats;
};

/* One call over the first `rows` rows of k and v; returns the bytes it read, 0 when the kernel
 * failed (its status is in kvcap_last_error). */
static uint64_t rate_job_run(const struct rate_job *j, int rows)
{
    kvcap_partial_reset(j->acc, j->nq, j->d);
    uint64_t bytes = 0;
    enum kvcap_status st;
    if (!j->maps) {
        struct kvcap_rows r = {j->k, j->v, j->dt, (size_t)j->d, rows};
        st = kvcap_attend_rows(&r, j->q, j->nq, j->d, 0.088f, j->acc, &bytes);
    } else {
        int per_tile = j->maps->h > j->maps->rv ? j->maps->h : j->maps->rv;
        struct kvcap_capsule_span sp = {j->k, j->v, j->mu, j->dt, rows / per_tile, j->q, j->acc};
        st = kvcap_capsule_attend(j->maps, &sp, 1, j->nq, j->d, 0.088f, j->scratch,
                                  j->scratch_floats, &bytes);
    }
    return st == KVCAP_OK ? bytes : 0;
}

/* The best-of-15 rate in GB/s of bytes read, over `rows` rows that either stay in L2 between
 * calls (ev NULL: the kernel's compute rate) or are evicted before each call. */
static double kernel_rate(const struct rate_job *j, int rows, struct evictor *ev)
{
    int reps = ev ? 1 : 64;
    double best = 0;
    for (int rep = 0; rep < 15; rep++) {
        if (ev)
            evict_caches(ev);
        else
            rate_job_run(j, rows); /* load into L2 */
        double t0 = kvcap_seconds();
        uint64_t bytes = 0;
        for (int i = 0; i < reps; i++)
            bytes += rate_job_run(j, rows);
        double rate = (double)bytes / (kvcap_seconds() - t0) * 1e-9;
        best = rate > best ? rate : best;
    }
    return best;
}

/* FLOP per byte of fused KVCapsule decode with tiled maps of m points: per tile 2·G·d FLOP per
 * row of H and Ṽ (h + R_v rows of d elements) and 2·G·m per row for the two map products; the
 * exps are not counted. */
static double capsule_flop_per_byte(double G, double d, double m, enum kvcap_dtype dt)
{
    return 2 * G * (d + m) / (d * (double)kvcap_dtype_size(dt));
}

/* The table rows of one kernel: compute rate, cold rate, and the two overlap models. */
static void print_rates(const char *what, double hot, double cold, double bw, double flops,
                        double flop_per_byte)
{
    double both = hot < bw ? hot : bw, serial = 1.0 / (1.0 / hot + 1.0 / bw);
    printf("%s\n", what);
    printf("  %-50s %7.1f %7.0f%%\n", "in L2 (the kernel's compute rate)", hot, 100 * hot / bw);
    printf("  %-50s %7.1f %7.0f%%\n", "cold (caches evicted before each call)", cold,
           100 * cold / bw);
    printf("  %-50s %7.1f %7.0f%%\n", "model, reads overlap compute: min(compute, bw)", both,
           100 * both / bw);
    printf("  %-50s %7.1f %7.0f%%\n", "model, no overlap: 1 / (1/compute + 1/bw)", serial,
           100 * serial / bw);
    if (flops > 0)
        printf("  compute rate = %.0f%% of the FMA peak (%.1f FLOP per byte)\n",
               100 * hot * flop_per_byte / flops, flop_per_byte);
}

/* --row-kernels: compute rate (data in L2) and cold rate of the plain-attention row kernels
 * and, for tiled maps, of fused KVCapsule attention, next to the read bandwidth of one thread.
 * The KVCapsule maps are layer 0 / KV head 0 of bucket 0. */
static enum kvcap_status row_kernels_report(const struct kvcap_model_geometry *g,
                                            const struct kvcap_artifact *a, enum kvcap_dtype dt,
                                            struct evictor *ev)
{
    int d = g->head_dim, nq = g->n_q_heads / g->n_kv_heads;
    size_t es = kvcap_dtype_size(dt);
    int n_hot = (int)((128u << 10) / (d * es)), n_cold = (int)((8u << 20) / (d * es));
    const struct kvcap_unit_maps *u = kvcap_artifact_unit(a, 0, 0, 0);
    struct kvcap_capsule_maps maps = {u->m, u->h, u->rv, u->w2, u->b2, u->u};
    int tiled = a->buckets[0].structure == KVCAP_STRUCTURE_TILED && u->h > 0 && u->rv > 0;
    int per_tile = u->h > u->rv ? u->h : u->rv;
    size_t sf = tiled ? kvcap_capsule_scratch_floats(&maps, 1, n_cold / per_tile, nq, d) : 0;
    void *k = malloc((size_t)n_cold * d * es), *v = malloc((size_t)n_cold * d * es);
    float *q = malloc(sizeof(float) * (size_t)nq * d),
          *pbuf = malloc(sizeof(float) * (size_t)nq * (d + 2)), *tmp = malloc(sizeof(float) * d);
    float *scratch = tiled && sf != SIZE_MAX ? malloc(sizeof(float) * sf) : NULL;
    enum kvcap_status st = k && v && q && pbuf && tmp && (!tiled || scratch)
                               ? KVCAP_OK
                               : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "bench: out of memory");
    if (st == KVCAP_OK) {
        struct kvcap_rng r;
        kvcap_rng_seed(&r, 3);
        for (int i = 0; i < nq * d; i++)
            q[i] = (float)kvcap_rng_normal(&r);
        for (int j = 0; j < n_cold && st == KVCAP_OK; j++) {
            for (int c = 0; c < d; c++)
                tmp[c] = (float)kvcap_rng_normal(&r);
            st = kvcap_convert_from_f32(dt, tmp, (size_t)d, (char *)k + (size_t)j * d * es);
            if (st == KVCAP_OK)
                st = kvcap_convert_from_f32(dt, tmp, (size_t)d, (char *)v + (size_t)j * d * es);
        }
    }
    if (st == KVCAP_OK) {
        struct kvcap_partial acc = {pbuf, pbuf + nq, pbuf + 2 * nq};
        struct rate_job job = {k, v, NULL, dt, d, nq, q, acc, NULL, NULL, 0};
        double bw = read_bandwidth(1), flops = fma_peak(1);
        printf("decode kernels on one thread, G = %d, d %d, %s storage\n"
               "read bandwidth, measured now: %.1f GB/s; fp32 FMA peak: %.1f GFLOP/s\n\n"
               "%-52s %7s %8s\n",
               nq, d, kvcap_dtype_name(dt), bw, flops, "", "GB/s", "% bw");
        /* 4·G·d FLOP (scores, values) per 2·d elements */
        print_rates("plain-attention row kernels (full; KVCapsule's rows too)",
                    kernel_rate(&job, n_hot, NULL), kernel_rate(&job, n_cold, ev), bw, flops,
                    2.0 * nq / (double)es);
        printf("\n");
        if (tiled) {
            char what[160];
            job.mu = k; /* any d-vector */
            job.maps = &maps;
            job.scratch = scratch;
            job.scratch_floats = sf;
            snprintf(what, sizeof what, "fused KVCapsule, tiled maps of %d points, h %d, R_v %d",
                     u->m, u->h, u->rv);
            print_rates(what, kernel_rate(&job, n_hot, NULL), kernel_rate(&job, n_cold, ev), bw,
                        flops, capsule_flop_per_byte(nq, d, u->m, dt));
        } else {
            printf("fused KVCapsule: dense maps, not measured here (use --tile)\n");
        }
    }
    free(k);
    free(v);
    free(q);
    free(pbuf);
    free(tmp);
    free(scratch);
    return st;
}

struct result {
    const char *name;
    double ms_per_step, ms_best, compress_ms; /* median and fastest of the timed steps */
    double time_full;                         /* median of step time / full's same step */
    uint64_t bytes_per_step, map_bytes_per_step, held;
    double recalled_per_step, corrected; /* FreeKV: pages per step; share of head-steps */
    double hidden, reselected, waited;    /* FreeKV: shares of head-steps */
};

/* Random K/V rows of one layer (timing only), [heads][n][d]. */
static void random_rows(struct kvcap_rng *r, float *x, size_t count)
{
    for (size_t i = 0; i < count; i++)
        x[i] = (float)(2.0 * kvcap_rng_uniform(r) - 1.0);
}

/* --engine-threads: the cache's parallel loops on the bench's OpenMP threads, the ones that
 * also evict the caches between calls, as an engine's thread pool runs its layers; between two
 * parallel regions OpenMP's threads wait actively for a while, so they are awake at attend. */
static void omp_parallel_for(void *user, int n_tasks, kvcap_task_fn fn, void *ctx)
{
    int threads = *(const int *)user;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int t = 0; t < n_tasks; t++)
        fn(ctx, t, omp_get_thread_num());
}

/* One policy's cache after prefill, stepped one decode step at a time so that the policies'
 * steps can interleave: a slow phase of a noisy machine then hits every policy alike. */
struct policy_run {
    const char *policy;
    const struct kvcap_model_geometry *g;
    int batch;
    struct kvcap_cache *c;
    struct kvcap_rng r;
    float *q, *out, *gen;
    double *step_ms; /* [steps] */
    uint64_t bytes, map_bytes;
    struct kvcap_cache_stats cs0; /* FreeKV counters from the first timed step on */
};

static void policy_run_free(struct policy_run *pr)
{
    free(pr->q), free(pr->out), free(pr->gen), free(pr->step_ms);
    kvcap_cache_free(pr->c);
    memset(pr, 0, sizeof *pr);
}

/* Creates the policy's cache and prefills one synthetic vision span per sequence. */
static enum kvcap_status policy_run_prepare(struct policy_run *pr, const struct kvcap_model_geometry *g,
                                            int batch, int rows, int cols, enum kvcap_dtype storage,
                                            int threads, int *engine_threads, int steps,
                                            const struct kvcap_artifact *a, const char *policy,
                                            int post, int freekv_static)
{
    memset(pr, 0, sizeof *pr);
    pr->policy = policy;
    pr->g = g;
    pr->batch = batch;
    char yaml[256];
    snprintf(yaml, sizeof yaml, "policies: {vision: %s, text: full, generated: %s}\nfallback: full\n",
             policy, strcmp(policy, "freekv") == 0 && !freekv_static ? "freekv" : "full");
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = *g;
    p.n_seqs = batch;
    p.storage = storage;
    p.artifact = strcmp(policy, "kvcapsule") == 0 ? a : NULL;
    p.config_yaml = yaml;
    p.n_threads = threads;
    if (engine_threads) {
        p.parallel_for = omp_parallel_for;
        p.parallel_user = engine_threads;
    }
    enum kvcap_status st = kvcap_cache_create(&p, &pr->c);
    KVCAP_TRY(st);
    int n = rows * cols, d = g->head_dim, H = g->n_kv_heads, Hq = g->n_q_heads;
    struct kvcap_synth_params sp;
    kvcap_synth_default_params(&sp);
    sp.post_queries = sp.decode_queries = 0;
    sp.rank_k = sp.rank_v = 16;
    float *kf = malloc(sizeof(float) * (size_t)n * d);
    float *k = malloc(sizeof(float) * (size_t)H * n * d), *v = malloc(sizeof(float) * (size_t)H * n * d);
    float *pq = malloc(sizeof(float) * (size_t)Hq * (post > 0 ? post : 1) * d);
    pr->q = malloc(sizeof(float) * (size_t)batch * Hq * d);
    pr->out = malloc(sizeof(float) * (size_t)batch * Hq * d);
    pr->gen = malloc(sizeof(float) * 2 * (size_t)H * d);
    pr->step_ms = malloc(sizeof(double) * (size_t)steps);
    if (!kf || !k || !v || !pq || !pr->q || !pr->out || !pr->gen || !pr->step_ms)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "bench: out of memory");
    struct kvcap_rng *r = &pr->r;
    kvcap_rng_seed(r, 3);
    for (int s = 0; st == KVCAP_OK && s < batch; s++)
        for (int l = 0; st == KVCAP_OK && l < g->n_layers; l++) {
            for (int h = 0; st == KVCAP_OK && h < H; h++)
                st = kvcap_synth_head(g, &sp, s, rows, cols, 100 + s, l, h, kf, k + (size_t)h * n * d,
                                      v + (size_t)h * n * d, NULL, NULL);
            struct kvcap_span_desc desc = {KVCAP_SPAN_VISION, n, rows, cols, 100 + s};
            struct kvcap_tensor_view kv = {k, NULL, 0, KVCAP_DTYPE_F32, (int64_t)n * d, d};
            struct kvcap_tensor_view vv = {v, NULL, 0, KVCAP_DTYPE_F32, (int64_t)n * d, d};
            if (st == KVCAP_OK)
                st = kvcap_cache_add_span(pr->c, s, l, &desc, &kv, &vv);
            /* post-vision queries: what vlcache scores with (random, timing only) */
            if (st == KVCAP_OK && post > 0) {
                for (size_t i = 0; i < (size_t)Hq * post * d; i++)
                    pq[i] = (float)kvcap_rng_normal(r);
                st = kvcap_cache_add_post_queries(pr->c, s, l, pq, post);
            }
        }
    for (int s = 0; st == KVCAP_OK && s < batch; s++)
        st = kvcap_cache_end_prefill(pr->c, s);
    for (size_t i = 0; st == KVCAP_OK && i < (size_t)batch * Hq * d; i++)
        pr->q[i] = (float)kvcap_rng_normal(r);
    free(kf), free(k), free(v), free(pq);
    if (st != KVCAP_OK)
        policy_run_free(pr);
    return st;
}

/* Decode step `rep` (-1 warms up, untimed): per layer one generated token per sequence, the
 * caches evicted (untimed), then the layer's attention (timed). */
static enum kvcap_status policy_run_step(struct policy_run *pr, int rep, struct evictor *ev)
{
    const struct kvcap_model_geometry *g = pr->g;
    int d = g->head_dim, H = g->n_kv_heads, Hq = g->n_q_heads;
    enum kvcap_status st = KVCAP_OK;
    struct kvcap_cache_stats cs;
    /* consecutive decode queries are similar, not equal: cosine ~0.95 step to step */
    for (size_t i = 0; i < (size_t)pr->batch * Hq * d; i++)
        pr->q[i] = (float)(0.95 * pr->q[i] + 0.31 * kvcap_rng_normal(&pr->r));
    double t = 0;
    uint64_t b = 0, mb = 0;
    for (int l = 0; st == KVCAP_OK && l < g->n_layers; l++) {
        random_rows(&pr->r, pr->gen, 2 * (size_t)H * d);
        struct kvcap_tensor_view gk = {pr->gen, NULL, 0, KVCAP_DTYPE_F32, d, 0};
        struct kvcap_tensor_view gv = {pr->gen + (size_t)H * d, NULL, 0, KVCAP_DTYPE_F32, d, 0};
        for (int s = 0; st == KVCAP_OK && s < pr->batch; s++)
            st = kvcap_cache_append(pr->c, s, l, &gk, &gv);
        evict_caches(ev);
        double t0 = kvcap_seconds();
        if (st == KVCAP_OK)
            st = kvcap_cache_attend(pr->c, l, pr->q, pr->out);
        t += kvcap_seconds() - t0;
        /* also waits for FreeKV's background work, so none of it runs in another's timing */
        if (st == KVCAP_OK)
            st = kvcap_cache_stats(pr->c, &cs);
        if (st == KVCAP_OK) {
            b += cs.bytes_read_last_attend;
            mb += cs.map_bytes_read_last_attend;
        }
    }
    if (st != KVCAP_OK)
        return st;
    if (rep < 0)
        pr->cs0 = cs;
    else
        pr->step_ms[rep] = t * 1e3;
    pr->bytes = b;
    pr->map_bytes = mb;
    return KVCAP_OK;
}

/* The policy's figures over its `steps` timed steps; frees the run. */
static enum kvcap_status policy_run_finish(struct policy_run *pr, int steps, struct result *res)
{
    struct kvcap_cache_stats cs;
    enum kvcap_status st = kvcap_cache_stats(pr->c, &cs);
    if (st == KVCAP_OK) {
        res->name = pr->policy;
        res->ms_per_step = cli_median(pr->step_ms, steps);
        res->ms_best = pr->step_ms[0]; /* sorted by cli_median */
        res->compress_ms = cs.compress_seconds * 1e3;
        res->bytes_per_step = pr->bytes + pr->map_bytes;
        res->map_bytes_per_step = pr->map_bytes;
        res->held = cs.bytes_held;
        const struct kvcap_cache_stats *c0 = &pr->cs0;
        res->recalled_per_step = (double)(cs.freekv_pages_recalled - c0->freekv_pages_recalled) / steps;
        int64_t hs = cs.freekv_head_steps - c0->freekv_head_steps;
        res->corrected = hs > 0 ? (double)(cs.freekv_corrections - c0->freekv_corrections) / hs : 0;
        res->hidden = hs > 0 ? (double)(cs.freekv_hidden - c0->freekv_hidden) / hs : 0;
        res->reselected =
            hs > 0 ? (double)(cs.freekv_reselections - c0->freekv_reselections) / hs : 0;
        res->waited = hs > 0 ? (double)(cs.freekv_waited - c0->freekv_waited) / hs : 0;
    }
    policy_run_free(pr);
    return st;
}

/* FlashCache's compression time: one span of n tokens per layer, random rows (the DCT's cost
 * does not depend on the data), prefill + end of prefill; best of 3. */
static enum kvcap_status flashcache_overhead(const struct kvcap_model_geometry *g, int n,
                                             enum kvcap_dtype storage, int threads, double *ms)
{
    int H = g->n_kv_heads, d = g->head_dim;
    float *kv = malloc(sizeof(float) * 2 * (size_t)H * n * d);
    KVCAP_RETURN_IF(!kv, KVCAP_ERR_OUT_OF_MEMORY, "bench: out of memory");
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 5);
    random_rows(&r, kv, 2 * (size_t)H * n * d);
    enum kvcap_status st = KVCAP_OK;
    *ms = 1e30;
    for (int rep = 0; st == KVCAP_OK && rep < 3; rep++) {
        struct kvcap_cache_params p;
        kvcap_cache_default_params(&p);
        p.model = *g;
        p.storage = storage;
        p.config_yaml = "policies: {vision: flashcache}\n";
        p.n_threads = threads;
        struct kvcap_cache *c = NULL;
        st = kvcap_cache_create(&p, &c);
        struct kvcap_span_desc desc = {KVCAP_SPAN_VISION, n, 1, n, 0};
        struct kvcap_tensor_view kk = {kv, NULL, 0, KVCAP_DTYPE_F32, (int64_t)n * d, d};
        struct kvcap_tensor_view vv = {kv + (size_t)H * n * d, NULL, 0, KVCAP_DTYPE_F32,
                                       (int64_t)n * d, d};
        for (int l = 0; st == KVCAP_OK && l < g->n_layers; l++)
            st = kvcap_cache_add_span(c, 0, l, &desc, &kk, &vv);
        if (st == KVCAP_OK)
            st = kvcap_cache_end_prefill(c, 0);
        struct kvcap_cache_stats cs;
        if (st == KVCAP_OK && kvcap_cache_stats(c, &cs) == KVCAP_OK)
            *ms = cs.compress_seconds * 1e3 < *ms ? cs.compress_seconds * 1e3 : *ms;
        kvcap_cache_free(c);
    }
    free(kv);
    return st;
}

int main(int argc, char **argv)
{
    enum { STORAGE = 1000, THREADS, POST, OVERHEAD, WARM, HEADS, ROWKERNELS, ENGINE, FKVSTATIC };
    const char *only = NULL;
    static const struct option options[] = {
        {"grid", required_argument, NULL, 'g'},  {"tile", required_argument, NULL, 't'},
        {"ratio", required_argument, NULL, 'r'}, {"layers", required_argument, NULL, 'l'},
        {"batch", required_argument, NULL, 'b'}, {"steps", required_argument, NULL, 's'},
        {"artifact", required_argument, NULL, 'a'}, {"storage", required_argument, NULL, STORAGE},
        {"threads", required_argument, NULL, THREADS}, {"help", no_argument, NULL, 'h'},
        {"policy", required_argument, NULL, 'p'}, {"post", required_argument, NULL, POST},
        {"flashcache-overhead", no_argument, NULL, OVERHEAD}, {"warm", no_argument, NULL, WARM},
        {"heads", required_argument, NULL, HEADS}, {"row-kernels", no_argument, NULL, ROWKERNELS},
        {"engine-threads", no_argument, NULL, ENGINE},
        {"freekv-static", no_argument, NULL, FKVSTATIC},
        {NULL, 0, NULL, 0}};
    int rows = 64, cols = 128, tr = 4, tc = 4, layers = 4, batch = 1, steps = 20, threads = 0, c;
    int post = 32, overhead = 0, layers_set = 0, warm = 0, n_q = 28, n_kv = 4, row_kernels = 0;
    int engine = 0, freekv_static = 0;
    double ratio = 0.4;
    const char *artifact_path = NULL;
    enum kvcap_dtype storage = KVCAP_DTYPE_F16;
    cli_init("kvcap-bench", 0);
    while ((c = getopt_long(argc, argv, "g:t:r:l:b:s:a:p:h", options, NULL)) != -1) {
        switch (c) {
        case 'g':
            if (sscanf(optarg, "%dx%d", &rows, &cols) != 2 || rows < 1 || cols < 1)
                return cli_usage_error("--grid: '%s' is not ROWSxCOLS", optarg);
            break;
        case 't':
            if (strcmp(optarg, "dense") == 0)
                tr = tc = 0;
            else if (sscanf(optarg, "%dx%d", &tr, &tc) != 2 || tr < 1 || tc < 1)
                return cli_usage_error("--tile: '%s' is not ROWSxCOLS or dense", optarg);
            break;
        case 'r': ratio = atof(optarg); break;
        case 'l': layers = atoi(optarg), layers_set = 1; break;
        case POST: post = atoi(optarg); break;
        case OVERHEAD: overhead = 1; break;
        case WARM: warm = 1; break;
        case ROWKERNELS: row_kernels = 1; break;
        case ENGINE: engine = 1; break;
        case FKVSTATIC: freekv_static = 1; break;
        case HEADS:
            if (sscanf(optarg, "%d/%d", &n_q, &n_kv) != 2 || n_q < 1 || n_kv < 1 || n_q % n_kv)
                return cli_usage_error("--heads: '%s' is not Q/KV with KV dividing Q", optarg);
            break;
        case 'b': batch = atoi(optarg); break;
        case 's': steps = atoi(optarg); break;
        case 'a': artifact_path = optarg; break;
        case STORAGE:
            if (strcmp(optarg, "f32") == 0) storage = KVCAP_DTYPE_F32;
            else if (strcmp(optarg, "f16") == 0) storage = KVCAP_DTYPE_F16;
            else if (strcmp(optarg, "bf16") == 0) storage = KVCAP_DTYPE_BF16;
            else return cli_usage_error("--storage: '%s' is not f32, f16 or bf16", optarg);
            break;
        case THREADS: threads = atoi(optarg); break;
        case 'p':
            enum kvcap_policy pol;
            if (!kvcap_policy_parse(optarg, &pol) || pol == KVCAP_POLICY_FULL)
                return cli_usage_error("--policy: '%s' is not streaming, kvcapsule, flashcache, "
                                       "vlcache or freekv", optarg);
            only = optarg;
            break;
        case 'h': usage(stdout); return 0;
        default: return cli_usage_error("unknown option");
        }
    }
    if (!(ratio > 0 && ratio <= 1) || layers < 1 || batch < 1 || steps < 1 || post < 0)
        return cli_usage_error("--ratio in (0, 1], --layers, --batch and --steps >= 1, "
                               "--post >= 0");
    if (overhead && !layers_set)
        layers = 28;
    struct kvcap_model_geometry g = {.name = "Qwen2.5-VL-7B (attention shape)", .n_layers = layers,
                                     .n_q_heads = n_q, .n_kv_heads = n_kv, .head_dim = 128,
                                     .rope_type = KVCAP_ROPE_MROPE,
                                     .rope_pairing = KVCAP_ROPE_PAIRING_HALF, .rope_theta = 1e6,
                                     .n_rope_sections = 3, .rope_sections = {16, 24, 24}};
    if (n_q != 28 || n_kv != 4)
        snprintf(g.name, sizeof g.name, "Qwen2.5-VL-7B shape with %d q / %d kv heads", n_q, n_kv);
    struct kvcap_artifact *a = NULL;
    enum kvcap_status st;
    if (artifact_path) {
        if ((st = kvcap_artifact_open(artifact_path, &a)) != KVCAP_OK)
            return cli_fail(st);
        g = *kvcap_artifact_geometry(a);
        rows = a->buckets[0].rows;
        cols = a->buckets[0].cols;
    } else {
        struct kvcap_bucket b = {rows, cols, tr ? KVCAP_STRUCTURE_TILED : KVCAP_STRUCTURE_DENSE, tr, tc};
        if ((st = kvcap_bucket_check(&b, "--grid/--tile")) != KVCAP_OK)
            return cli_fail(st);
        if ((st = kvcap_bench_random_artifact(&g, &b, ratio, &a)) != KVCAP_OK)
            return cli_fail(st);
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int nthreads = threads ? threads : (int)(cores > 0 ? cores : 1);
    if (overhead) {
        static const int sizes[3] = {2048, 4096, 8192};
        printf("FlashCache compression (DCT, deviation, budgets, eviction) of one span, %d layers "
               "x %d kv heads x d %d, %d thread%s; best of 3\n\n%8s %14s %14s\n", g.n_layers,
               g.n_kv_heads, g.head_dim, nthreads, nthreads == 1 ? "" : "s", "tokens", "ms",
               "ms per layer");
        for (int i = 0; i < 3; i++) {
            double ms = 0;
            if ((st = flashcache_overhead(&g, sizes[i], storage, nthreads, &ms)) != KVCAP_OK)
                return cli_fail(st);
            printf("%8d %14.2f %14.3f\n", sizes[i], ms, ms / g.n_layers);
        }
        kvcap_artifact_free(a);
        return 0;
    }
    /* several times the last-level cache, as a 7B model's layer is hundreds of MB: a sweep
     * just over the cache's size leaves page-table entries and some lines cached */
    size_t ev_bytes = 8 * last_level_cache_bytes();
    /* --warm does not apply to --row-kernels: the cold row is the point */
    struct evictor ev = warm && !row_kernels ? (struct evictor){NULL, 0, 1} : evictor_make(ev_bytes);
    if (!ev.buf && (!warm || row_kernels))
        return cli_fail(kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "bench: out of memory"));
    if (row_kernels) {
        st = row_kernels_report(&g, a, storage, &ev);
        free(ev.buf);
        kvcap_artifact_free(a);
        return st == KVCAP_OK ? 0 : cli_fail(st);
    }
    if (engine)
        ev.threads = nthreads;
    double bw = read_bandwidth(nthreads), flops = fma_peak(nthreads);
    const char *policies[6] = {"full", "streaming", "kvcapsule", "flashcache", "vlcache", "freekv"};
    int n_policies = 6;
    if (only) {
        policies[1] = only;
        n_policies = 2;
    }
    struct result res[6];
    struct policy_run runs[6];
    struct cli_progress prog;
    cli_progress_begin(&prog, "prefill", 0);
    st = KVCAP_OK;
    int prepared = 0;
    for (; st == KVCAP_OK && prepared < n_policies; prepared++) {
        st = policy_run_prepare(&runs[prepared], &g, batch, rows, cols, storage, nthreads,
                                engine ? &nthreads : NULL, steps, a, policies[prepared], post,
                                freekv_static);
        if (st != KVCAP_OK)
            break;
        cli_progress_update(&prog, prepared + 1, n_policies);
    }
    /* Step by step, each step over all policies, each step starting one policy later: no
     * policy always follows the same one. */
    cli_progress_begin(&prog, "decode steps", 0);
    for (int rep = -1; st == KVCAP_OK && rep < steps; rep++) {
        for (int j = 0; st == KVCAP_OK && j < n_policies; j++)
            st = policy_run_step(&runs[(j + rep + 1) % n_policies], rep, &ev);
        cli_progress_update(&prog, rep + 2, steps + 1);
    }
    double *per_step = malloc(sizeof(double) * (size_t)steps);
    if (st == KVCAP_OK && !per_step)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "bench: out of memory");
    for (int i = 0; st == KVCAP_OK && i < prepared; i++) { /* step by step against full's */
        for (int rep = 0; rep < steps; rep++)
            per_step[rep] = runs[i].step_ms[rep] / runs[0].step_ms[rep];
        res[i].time_full = cli_median(per_step, steps);
    }
    free(per_step);
    for (int i = 0; i < prepared; i++) {
        enum kvcap_status fs = st == KVCAP_OK ? policy_run_finish(&runs[i], steps, &res[i])
                                              : (policy_run_free(&runs[i]), KVCAP_OK);
        st = st == KVCAP_OK ? fs : st;
    }
    if (st != KVCAP_OK) {
        free(ev.buf);
        kvcap_artifact_free(a);
        return cli_fail(st);
    }
    free(ev.buf);
    double bw2 = read_bandwidth(nthreads);
    bw = bw2 > bw ? bw2 : bw;
    char held[32], per[32];
    printf("\nkvcap decode benchmark: %s, %d layers, %d q / %d kv heads, d %d; batch %d; one %dx%d "
           "vision span (%d tokens) per sequence; %s storage; %d thread%s\n",
           g.name, g.n_layers, g.n_q_heads, g.n_kv_heads, g.head_dim, batch, rows, cols,
           rows * cols, kvcap_dtype_name(storage), nthreads, nthreads == 1 ? "" : "s");
    const struct kvcap_bucket *bk = &a->buckets[0];
    const struct kvcap_unit_maps *u = kvcap_artifact_unit(a, 0, 0, 0);
    printf("kvcapsule maps: %s%s, R_k = h = %d, R_v = %d of %d points%s\n",
           kvcap_structure_name(bk->structure),
           bk->structure == KVCAP_STRUCTURE_TILED ? " (tiles)" : "", u->h, u->rv, u->m,
           artifact_path ? "" : " (random: timing only)");
    if (n_policies > 1 && strcmp(policies[n_policies - 1], "freekv") == 0)
        printf("freekv layout: %s\n", freekv_static
                                          ? "the vision span only; generated tokens in full "
                                            "(a static store)"
                                          : "the vision span and the generated tokens (a store "
                                            "that grows every step)");
    if (warm)
        printf("caches: warm (left as the previous attention call left them)\n");
    else
        printf("caches: cold (%zu MiB read before every attention call by %s, untimed)\n",
               ev_bytes >> 20, engine ? "the engine threads" : "one thread");
    if (engine)
        printf("threads: the bench's %d OpenMP threads run attend's tasks (params.parallel_for), "
               "awake from the eviction\n", nthreads);
    else
        printf("threads: the cache's pool of %d (its idle workers sleep, so each call wakes "
               "them)\n", nthreads);
    printf("read bandwidth, measured now (%d thread%s): %.1f GB/s\n", nthreads,
           nthreads == 1 ? "" : "s", bw);
    if (flops > 0) {
        /* Plain attention: 2·G·d FLOP for the scores and 2·G·d for the values per token, over
         * 2·d elements read; KVCapsule's rows cost the same per byte and its maps add work. */
        double G = (double)g.n_q_heads / g.n_kv_heads, per_byte = 2 * G / kvcap_dtype_size(storage);
        printf("fp32 FMA peak, measured now (%d thread%s): %.1f GFLOP/s; decode at G = %g does "
               "%.1f FLOP per %s byte,\nso the compute roof of plain attention is %.1f GB/s = %.0f%% of "
               "the read bandwidth\n",
               nthreads, nthreads == 1 ? "" : "s", flops, G, per_byte, kvcap_dtype_name(storage),
               flops / per_byte,
               100 * flops / per_byte / bw);
    }
    printf("%d timed decode steps per policy, the policies taking turns step by step; ms per "
           "step: the median and the\nfastest (best) step; GB/s and %% bw: bytes over the best "
           "step; time/full: the median over steps of the\nstep's time over full's same step\n\n",
           steps);
    printf("%-10s %8s %8s %12s %9s %7s %12s %9s %9s %9s\n", "policy", "median", "best",
           "bytes/step", "GB/s", "% bw", "bytes held", "time/full", "read/full", "held/full");
    for (int i = 0; i < n_policies; i++) {
        double gbs = res[i].bytes_per_step / (res[i].ms_best * 1e-3) * 1e-9;
        printf("%-10s %8.3f %8.3f %12s %9.1f %6.0f%% %12s %9.3f %9.3f %9.3f\n", res[i].name,
               res[i].ms_per_step, res[i].ms_best,
               cli_bytes(res[i].bytes_per_step, per, sizeof per), gbs,
               100 * gbs / bw, cli_bytes(res[i].held, held, sizeof held),
               res[i].time_full,
               (double)res[i].bytes_per_step / (double)res[0].bytes_per_step,
               (double)res[i].held / (double)res[0].held);
    }
    for (int i = 0; i < n_policies; i++) {
        if (res[i].compress_ms > 0)
            printf("%s: compression after prefill %.1f ms (all layers, batch)\n", res[i].name,
                   res[i].compress_ms);
        if (strcmp(res[i].name, "freekv") == 0) {
            printf("freekv: step time %.3f of full's at %.3f of its bytes read; of the head-steps "
                   "(timed steps): %.1f%% hidden\n(speculative selection complete before the "
                   "step), %.1f%% waited for it, %.1f%% corrected, %.1f%% re-selected; %.1f "
                   "pages recalled per step\n",
                   res[i].time_full, (double)res[i].bytes_per_step / (double)res[0].bytes_per_step,
                   100 * res[i].hidden, 100 * res[i].waited, 100 * res[i].corrected,
                   100 * res[i].reselected, res[i].recalled_per_step);
        }
        if (res[i].map_bytes_per_step)
            printf("%s: bytes include the maps, %s per step\n", res[i].name,
                   cli_bytes(res[i].map_bytes_per_step, per, sizeof per));
        if (flops > 0 && strcmp(res[i].name, "kvcapsule") == 0) {
            double per_byte = capsule_flop_per_byte((double)g.n_q_heads / g.n_kv_heads,
                                                    g.head_dim, u->m, storage);
            printf("kvcapsule: at least %.1f FLOP per byte (rows and map products, exps not "
                   "counted),\nso its compute roof is at most %.1f GB/s = %.0f%% of the read "
                   "bandwidth\n",
                   per_byte, flops / per_byte, 100 * flops / per_byte / bw);
        }
    }
    kvcap_artifact_free(a);
    return 0;
}
