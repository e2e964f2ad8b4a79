/* cuda.c — kvcap-bench-cuda: the GPU benchmark. Decode attention time of plain
 * flash-decoding and fused KVCapsule (tiled maps) over 8K–128K tokens at batch 1 and 8, with the
 * bytes each reads and the bandwidth it achieves next to a device-to-device copy measured in the
 * same run; FlashCache's compression time; FreeKV's decode step over every layer with the share
 * of page recalls hidden behind it, next to the pinned host-to-device bandwidth; a device
 * cache's KVCapsule prefill with exact tiles, next to the same without. Every decode,
 * FlashCache and FreeKV shape is checked against the CPU code before it is timed (the
 * prefill's results are test_runtime_cuda's to check). Sections are entries of one table
 * (SECTIONS below). */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "kernels/attention.h"
#include "bench/cuda.h"
#include "bench/common.h"
#include "cli/cli.h"
#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/freekv_cuda.h"
#include "kernels/cuda/flashcache_cuda.h"
#include "kernels/cuda/select_cuda.h"
#include "kernels/cuda/vlcache_cuda.h"
#include "kernels/dct.h"
#include "kernels/flashcache.h"
#include "runtime/artifact.h"
#include "runtime/freekv.h"
#include "common/internal.h"
#include "common/rng.h"
#include "formats/safetensors.h" /* kvcap_convert_to_f32 */

#define TOOL "kvcap-bench-cuda"
#define EXIT_SKIP 77
#define MAX_LIST 16
/* GPU and CPU compute in f32 in different orders (chunks, pieces, merges); on these data
 * (values of non-zero mean, so no cancellation in the outputs) they agree to ~1e-6. 1e-3
 * relative to the largest output separates rounding from a wrong result by orders. */
#define CHECK_REL_TOL 1e-3
/* FlashCache (configs/runtime.yaml defaults): DCT coefficients kept, global retention, floor. */
#define FC_GAMMA 0.1
#define FC_RETENTION 0.4
#define FC_MIN_TOKENS 16

static void usage(FILE *out)
{
    fprintf(out,
            "usage: " TOOL " [options]\n"
            "\n"
            "GPU benchmark of libkvcap's CUDA kernels, ratios measured in one run:\n"
            "  bandwidth   device-to-device copy (the ceiling) and pinned host-to-device copy\n"
            "  decode      plain flash-decoding vs fused KVCapsule (tiled, random maps) per\n"
            "              context and batch: time, bytes read, GB/s and %% of the copy\n"
            "  flashcache  FlashCache compression (DCT scoring, budgets, top-k) at 2K/4K/8K\n"
            "              tokens x --layers (default 28 here) x KV heads\n"
            "  freekv      FreeKV decode steps over --layers (default 28 here) layers, one\n"
            "              state each, per context of --freekv-contexts: share of the page\n"
            "              recalls hidden, corrections, pages and bytes recalled and time per\n"
            "              step, and the recall's time at the pinned host-to-device bandwidth\n"
            "  prefill     a device cache's KVCapsule prefill of one --prefill-grid span at\n"
            "              --layers (default 28 here) layers, random tiled maps, with one\n"
            "              exact tile per span and KV head next to the same without\n"
            "Each decode shape is first checked against the CPU kernels (kvcap_attend_rows,\n"
            "kvcap_capsule_attend), FreeKV's layer 0 against the CPU state (runtime/freekv.h)\n"
            "during its warm-up steps; a disagreement above 1e-3 relative withholds the\n"
            "timings and exits 1. Without a CUDA device it exits 77.\n"
            "\n"
            "options:\n"
            "      --dtype T          K/V storage: f16 (default), bf16 or f32\n"
            "  -l, --layers L         layers per decode step (default 1), per FlashCache\n"
            "                         span, FreeKV step and prefill (default 28 for these)\n"
            "      --heads QxKV       query x KV heads (default 28x4, Qwen2.5-VL-7B)\n"
            "  -d, --head-dim D       head dim (default 128)\n"
            "  -n, --contexts LIST    tokens per sequence (default 8192,16384,32768,65536,131072)\n"
            "  -b, --batches LIST     sequences (default 1,8)\n"
            "  -t, --tile RxC         KVCapsule tile (default 4x4); contexts must be multiples\n"
            "  -r, --ratio R          KVCapsule retention: h = R_v = round(R * tile points)\n"
            "                         (default 0.4)\n"
            "      --fc-tokens LIST   FlashCache span lengths (default 2048,4096,8192)\n"
            "      --reps N           timed repetitions, median reported (default 20)\n"
            "      --warmup N         untimed runs first (default 3; FreeKV: warm-up steps,\n"
            "                         at least 2)\n"
            "      --warm             leave the L2 cache warm (default: read a buffer of twice\n"
            "                         the L2 size before every timed run, untimed)\n"
            "      --no-graph         enqueue each run's calls directly instead of replaying a\n"
            "                         CUDA graph of them\n"
            "      --prefill-grid RxC the prefill section's image span (default 32x32)\n"
            "      --sections LIST    bandwidth,decode,flashcache,freekv,prefill (default:\n"
            "                         all; bandwidth, every other one's reference, always\n"
            "                         runs)\n"
            "      --freekv           run the FreeKV section even if --sections leaves it out\n"
            "      --freekv-contexts LIST\n"
            "                         FreeKV context tokens (default 32768; e.g.\n"
            "                         8192,32768,131072)\n"
            "      --freekv-steps S   timed FreeKV decode steps per context (default 64)\n"
            "      --freekv-layer-us U\n"
            "                         a spin kernel of U microseconds on every SM after each\n"
            "                         layer's FreeKV calls, standing for the rest of the layer\n"
            "                         (default 0: none, so a layer's recall can only overlap\n"
            "                         the other layers' FreeKV calls)\n"
            "      --tsv FILE         also write the results as tab-separated lines\n"
            "      --device N         CUDA device (default 0)\n"
            "      --probe            print the device and exit (77 when there is none)\n"
            "  -h, --help             show this help\n");
}

/* ---- Errors: a CLI, so a failed call prints what failed and exits ------------------------- */

static void cu_check(cudaError_t e, const char *what, int line)
{
    if (e == cudaSuccess)
        return;
    fprintf(stderr, TOOL ": error: %s: %s (bench/cuda.c:%d)\n", what, cudaGetErrorString(e), line);
    exit(1);
}
#define CU(call) cu_check((call), #call, __LINE__)

static void kv_check(enum kvcap_status st, const char *what, int line)
{
    if (st == KVCAP_OK)
        return;
    const char *msg = kvcap_last_error();
    fprintf(stderr, TOOL ": error: %s: %s (bench/cuda.c:%d)\n", what,
            msg[0] ? msg : kvcap_status_str(st), line);
    exit(1);
}
#define KV(call) kv_check((call), #call, __LINE__)

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, TOOL ": error: out of host memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

/* ---- Options and the run's shared state ---------------------------------------------------- */

struct opts {
    enum kvcap_dtype dtype;
    int layers, layers_set, q_heads, kv_heads, d;
    int tr, tc;
    double ratio;
    int contexts[MAX_LIST], n_contexts;
    int batches[MAX_LIST], n_batches;
    int fc_tokens[MAX_LIST], n_fc_tokens;
    int fkv_contexts[MAX_LIST], n_fkv_contexts, fkv_steps;
    double fkv_layer_us;
    int reps, warmup, warm, graph, freekv, device;
    int pf_rows, pf_cols; /* the prefill section's span grid */
    const char *tsv;
    unsigned sections; /* bit i: SECTIONS[i] */
};

struct bench {
    struct opts o;
    struct cudaDeviceProp prop;
    cudaStream_t s;     /* main stream */
    cudaStream_t *side; /* one per KV head: the fused calls of a layer run side by side */
    cudaEvent_t fork, *join;
    void *flush;        /* read before every cold run */
    size_t flush_bytes;
    unsigned *sink;
    double copy_gbs, h2d_gbs; /* bytes copied / time; 0 when not measured */
    FILE *tsv;
};

/* Allocation that may fail (large shapes): NULL and the error cleared. */
static void *dev_try(size_t bytes)
{
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void dev_free(void **p)
{
    if (*p)
        CU(cudaFree(*p));
    *p = NULL;
}

static void fill(struct bench *b, void *dst, enum kvcap_dtype dt, size_t n, uint64_t seed,
                 float lo, float hi)
{
    CU(kvcap_bench_fill(dst, dt, n, seed, lo, hi, b->s));
}

/* ---- Timing ---------------------------------------------------------------------------------
 * A run is whatever `enqueue` puts on the main stream (it may fork to the side streams and
 * join back). By default it is captured once into a CUDA graph and each run is one graph
 * launch, so the GPU executes the calls back to back whatever the host's launch cost; CUDA
 * events on the main stream bracket every run. Cold runs (the default) are preceded by a
 * read of twice the L2 size, outside the events. Reported: the median over reps runs. */

typedef void (*enqueue_fn)(struct bench *b, void *ctx);

struct runner {
    struct bench *b;
    enqueue_fn enqueue;
    void *ctx;
    cudaGraphExec_t exec;
};

static void runner_init(struct runner *r, struct bench *b, enqueue_fn enqueue, void *ctx)
{
    r->b = b, r->enqueue = enqueue, r->ctx = ctx, r->exec = NULL;
    if (!b->o.graph)
        return;
    cudaGraph_t g;
    CU(cudaStreamBeginCapture(b->s, cudaStreamCaptureModeThreadLocal));
    enqueue(b, ctx);
    CU(cudaStreamEndCapture(b->s, &g));
    CU(cudaGraphInstantiate(&r->exec, g, 0));
    CU(cudaGraphDestroy(g));
    CU(cudaGraphUpload(r->exec, b->s));
}

static void runner_run(struct runner *r)
{
    if (r->exec)
        CU(cudaGraphLaunch(r->exec, r->b->s));
    else
        r->enqueue(r->b, r->ctx);
}

static void runner_free(struct runner *r)
{
    if (r->exec)
        CU(cudaGraphExecDestroy(r->exec));
    r->exec = NULL;
}

static void flush_l2(struct bench *b)
{
    if (!b->o.warm)
        CU(kvcap_bench_read(b->flush, b->flush_bytes, b->sink, b->s));
}

/* Median milliseconds per run (and the best in *best). Warm runs are timed 10 to a pair of
 * events, so the host's launch of one run never shows in the next. */
static double runner_time(struct runner *r, double *best)
{
    struct bench *b = r->b;
    const int reps = b->o.reps, inner = b->o.warm ? 10 : 1;
    for (int w = 0; w < b->o.warmup; w++) {
        flush_l2(b);
        runner_run(r);
    }
    cudaEvent_t *ev = xmalloc(sizeof *ev * 2 * (size_t)reps);
    for (int i = 0; i < 2 * reps; i++)
        CU(cudaEventCreate(&ev[i]));
    for (int i = 0; i < reps; i++) {
        flush_l2(b);
        CU(cudaEventRecord(ev[2 * i], b->s));
        for (int k = 0; k < inner; k++)
            runner_run(r);
        CU(cudaEventRecord(ev[2 * i + 1], b->s));
    }
    CU(cudaStreamSynchronize(b->s));
    double *ms = xmalloc(sizeof *ms * (size_t)reps);
    for (int i = 0; i < reps; i++) {
        float t = 0;
        CU(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
        ms[i] = (double)t / inner;
    }
    for (int i = 0; i < 2 * reps; i++)
        CU(cudaEventDestroy(ev[i]));
    double med = cli_median(ms, reps);
    if (best)
        *best = ms[0]; /* sorted by cli_median */
    free(ev);
    free(ms);
    return med;
}

/* ---- Section: copy bandwidth --------------------------------------------------------------- */

struct copy_job {
    void *dst;
    const void *src;
    size_t bytes;
    enum cudaMemcpyKind kind;
};

static void enqueue_copy(struct bench *b, void *ctx)
{
    struct copy_job *j = ctx;
    CU(cudaMemcpyAsync(j->dst, j->src, j->bytes, j->kind, b->s));
}

static double time_copy(struct bench *b, struct copy_job *j)
{
    struct runner r;
    runner_init(&r, b, enqueue_copy, j);
    double best, ms = runner_time(&r, &best);
    runner_free(&r);
    return (double)j->bytes / (ms * 1e-3) * 1e-9;
}

static int section_bandwidth(struct bench *b)
{
    size_t free_b = 0, total_b = 0;
    CU(cudaMemGetInfo(&free_b, &total_b));
    size_t bytes = (size_t)1 << 30;
    while (bytes > ((size_t)64 << 20) && 2 * bytes > free_b / 2)
        bytes /= 2;
    void *src = dev_try(bytes), *dst = dev_try(bytes);
    if (!src || !dst) {
        fprintf(stderr, TOOL ": error: cannot allocate 2 x %zu MiB for the copy\n", bytes >> 20);
        return 1;
    }
    fill(b, src, KVCAP_DTYPE_F32, bytes / 4, 11, -1.0f, 1.0f);
    struct copy_job j = {dst, src, bytes, cudaMemcpyDeviceToDevice};
    b->copy_gbs = time_copy(b, &j);
    dev_free(&src);
    dev_free(&dst);
    printf("device-to-device copy, cudaMemcpyAsync of %zu MiB: %.1f GB/s of bytes copied "
           "(= read; %.1f GB/s read + write)\n",
           bytes >> 20, b->copy_gbs, 2 * b->copy_gbs);

    size_t hbytes = (size_t)256 << 20;
    void *host = NULL, *dev = dev_try(hbytes);
    if (cudaHostAlloc(&host, hbytes, cudaHostAllocDefault) != cudaSuccess || !dev) {
        (void)cudaGetLastError();
        printf("pinned host-to-device copy: not measured (cannot allocate %zu MiB)\n",
               hbytes >> 20);
    } else {
        memset(host, 0x3c, hbytes);
        struct copy_job h = {dev, host, hbytes, cudaMemcpyHostToDevice};
        b->h2d_gbs = time_copy(b, &h);
        printf("pinned host-to-device copy, cudaMemcpyAsync from cudaHostAlloc memory, %zu MiB: "
               "%.1f GB/s\n",
               hbytes >> 20, b->h2d_gbs);
    }
    if (host)
        CU(cudaFreeHost(host));
    dev_free(&dev);
    if (b->tsv)
        fprintf(b->tsv, "bandwidth\td2d_copy_gbs\t%.3f\nbandwidth\th2d_pinned_gbs\t%.3f\n",
                b->copy_gbs, b->h2d_gbs);
    printf("\n");
    return 0;
}

/* ---- Section: decode attention ---------------------------------------------------------------
 * One step = L layers; per layer and sequence, H KV heads with G = Hq / H queries each (one
 * problem or span per (sequence, KV head)). Plain: reset the partials, one
 * kvcap_cuda_attend_rows over all B·H problems, finish. Fused: reset, one
 * kvcap_cuda_capsule_attend per KV head (its own maps, B spans; the H calls on H streams),
 * finish. Buffers hold every layer separately, so nothing of layer l is in L2 for layer l + 1. */

struct decode {
    int n, B, L, H, G, d, m, h, rv, tiles, P; /* P = B·H problems per layer */
    enum kvcap_dtype dt;
    size_t es;
    float scale;
    void *k, *v;          /* [L][P][n][d] */
    void *hs, *vt, *mu;   /* [L][P][tiles][h][d], [L][P][tiles][rv][d], [L][P][d] */
    float *maps;          /* [L][H] × (w2 [h][m], b2 [m], u [rv][m]) */
    float *q;             /* [P][G][d] */
    float *mx, *sum, *o;  /* partials [P·G], [P·G], [P·G][d] */
    float *out;           /* [P·G][d] */
    struct kvcap_cuda_rows_problem *rows;   /* device [L][P] */
    struct kvcap_cuda_capsule_span *spans;  /* device [L][H][B] */
    void *rows_scratch, **caps_scratch;     /* one capsule scratch per side stream */
    size_t rows_scratch_bytes, caps_scratch_bytes;
};

static size_t maps_floats(const struct decode *x)
{
    return (size_t)x->h * x->m + x->m + (size_t)x->rv * x->m;
}

static struct kvcap_capsule_maps maps_at(const struct decode *x, const float *base, int l, int h)
{
    const float *w2 = base + ((size_t)l * x->H + h) * maps_floats(x);
    return (struct kvcap_capsule_maps){x->m, x->h, x->rv, w2, w2 + (size_t)x->h * x->m,
                                       w2 + (size_t)x->h * x->m + x->m};
}

static struct kvcap_partial partial_rows(const struct decode *x, size_t row0)
{
    return (struct kvcap_partial){x->mx + row0, x->sum + row0, x->o + row0 * x->d};
}

static void enqueue_plain(struct bench *b, void *ctx)
{
    struct decode *x = ctx;
    const int rows = x->P * x->G;
    for (int l = 0; l < x->L; l++) {
        KV(kvcap_cuda_partial_reset(partial_rows(x, 0), rows, x->d, b->s));
        KV(kvcap_cuda_attend_rows(x->rows + (size_t)l * x->P, x->P, x->n, x->dt, x->G, x->d,
                                  x->scale, x->rows_scratch, x->rows_scratch_bytes, b->s));
        KV(kvcap_cuda_partial_finish(partial_rows(x, 0), rows, x->d, x->out, (size_t)x->d,
                                     b->s));
    }
}

static void enqueue_fused(struct bench *b, void *ctx)
{
    struct decode *x = ctx;
    const int rows = x->P * x->G;
    for (int l = 0; l < x->L; l++) {
        KV(kvcap_cuda_partial_reset(partial_rows(x, 0), rows, x->d, b->s));
        CU(cudaEventRecord(b->fork, b->s));
        for (int h = 0; h < x->H; h++) {
            cudaStream_t s = b->side[h];
            CU(cudaStreamWaitEvent(s, b->fork, 0));
            struct kvcap_capsule_maps mp = maps_at(x, x->maps, l, h);
            KV(kvcap_cuda_capsule_attend(&mp, x->spans + ((size_t)l * x->H + h) * x->B, x->B,
                                         x->tiles, x->dt, x->G, x->d, x->scale,
                                         x->caps_scratch[h], x->caps_scratch_bytes, s));
            CU(cudaEventRecord(b->join[h], s));
            CU(cudaStreamWaitEvent(b->s, b->join[h], 0));
        }
        KV(kvcap_cuda_partial_finish(partial_rows(x, 0), rows, x->d, x->out, (size_t)x->d,
                                     b->s));
    }
}

static void decode_free(struct decode *x)
{
    void **ptrs[] = {&x->k, &x->v, &x->hs, &x->vt, &x->mu, (void **)&x->maps, (void **)&x->q,
                     (void **)&x->mx, (void **)&x->sum, (void **)&x->o, (void **)&x->out,
                     (void **)&x->rows, (void **)&x->spans, &x->rows_scratch};
    for (size_t i = 0; i < sizeof ptrs / sizeof *ptrs; i++)
        dev_free(ptrs[i]);
    if (x->caps_scratch)
        for (int h = 0; h < x->H; h++)
            dev_free(&x->caps_scratch[h]);
    free(x->caps_scratch);
    x->caps_scratch = NULL;
}

/* Allocates and fills one shape; 0 (everything freed) when the device memory does not suffice,
 * with the bytes needed in *need. */
static int decode_setup(struct bench *b, struct decode *x, size_t *need)
{
    const size_t L = (size_t)x->L, P = (size_t)x->P, d = (size_t)x->d, n = (size_t)x->n;
    const size_t T = (size_t)x->tiles, kv_elems = L * P * n * d;
    const size_t hs_elems = L * P * T * x->h * d, vt_elems = L * P * T * x->rv * d;
    const size_t rows = P * x->G;
    struct kvcap_capsule_maps probe = {x->m, x->h, x->rv, NULL, NULL, NULL};
    KV(kvcap_cuda_attend_rows_scratch_bytes(x->P, x->n, x->G, x->d, &x->rows_scratch_bytes));
    KV(kvcap_cuda_capsule_scratch_bytes(&probe, x->B, x->tiles, x->G, x->d,
                                        &x->caps_scratch_bytes));
    *need = 2 * kv_elems * x->es + (hs_elems + vt_elems + L * P * d) * x->es +
            L * x->H * maps_floats(x) * 4 + rows * d * 4 * 3 + rows * 8 +
            x->rows_scratch_bytes + (size_t)x->H * x->caps_scratch_bytes;
    x->caps_scratch = calloc((size_t)x->H, sizeof *x->caps_scratch);
    int ok = x->caps_scratch != NULL;
    ok = ok && (x->k = dev_try(kv_elems * x->es)) && (x->v = dev_try(kv_elems * x->es));
    ok = ok && (x->hs = dev_try(hs_elems * x->es)) && (x->vt = dev_try(vt_elems * x->es));
    ok = ok && (x->mu = dev_try(L * P * d * x->es));
    ok = ok && (x->maps = dev_try(L * x->H * maps_floats(x) * 4));
    ok = ok && (x->q = dev_try(rows * d * 4)) && (x->o = dev_try(rows * d * 4));
    ok = ok && (x->out = dev_try(rows * d * 4));
    ok = ok && (x->mx = dev_try(rows * 4)) && (x->sum = dev_try(rows * 4));
    ok = ok && (x->rows = dev_try(L * P * sizeof *x->rows));
    ok = ok && (x->spans = dev_try(L * P * sizeof *x->spans));
    ok = ok && (x->rows_scratch = dev_try(x->rows_scratch_bytes));
    for (int h = 0; ok && h < x->H; h++)
        ok = (x->caps_scratch[h] = dev_try(x->caps_scratch_bytes)) != NULL;
    if (!ok) {
        decode_free(x);
        return 0;
    }
    /* Scores of a few units spread over the keys, values of non-zero mean (see CHECK_REL_TOL),
     * KVCapsule's basis and compressed values positive so its value path is not swamped by μ. */
    const size_t mf = L * x->H * maps_floats(x);
    fill(b, x->k, x->dt, kv_elems, 1, -1.0f, 1.0f);
    fill(b, x->v, x->dt, kv_elems, 2, 0.0f, 1.0f);
    fill(b, x->hs, x->dt, hs_elems, 3, -1.0f, 1.0f);
    fill(b, x->vt, x->dt, vt_elems, 4, 0.0f, 1.0f);
    fill(b, x->mu, x->dt, L * P * d, 5, 0.0f, 1.0f);
    fill(b, x->maps, KVCAP_DTYPE_F32, mf, 6, -1.0f, 1.0f);
    fill(b, x->q, KVCAP_DTYPE_F32, rows * d, 7, -3.0f, 3.0f);
    for (size_t l = 0; l < L; l++)
        for (int h = 0; h < x->H; h++) { /* b2 small, u positive */
            struct kvcap_capsule_maps mp = maps_at(x, x->maps, (int)l, h);
            fill(b, (void *)mp.b2, KVCAP_DTYPE_F32, (size_t)x->m, 8 + l * x->H + h, -0.1f, 0.1f);
            fill(b, (void *)mp.u, KVCAP_DTYPE_F32, (size_t)x->rv * x->m, 1000 + l * x->H + h,
                 0.0f, 0.2f);
        }
    struct kvcap_cuda_rows_problem *hr = xmalloc(L * P * sizeof *hr);
    struct kvcap_cuda_capsule_span *hsp = xmalloc(L * P * sizeof *hsp);
    const unsigned char *kb = x->k, *vb = x->v, *hb = x->hs, *tb = x->vt, *mb = x->mu;
    for (size_t l = 0; l < L; l++)
        for (size_t p = 0; p < P; p++) {
            const size_t u = l * P + p, seq = p / x->H, h = p % x->H;
            struct kvcap_partial acc = partial_rows(x, p * x->G);
            const float *q = x->q + p * x->G * d;
            hr[u] = (struct kvcap_cuda_rows_problem){kb + u * n * d * x->es, vb + u * n * d * x->es,
                                                      q, acc, (int64_t)d, x->n, 0};
            /* spans grouped by (layer, KV head): the B spans of one fused call are adjacent */
            hsp[(l * x->H + h) * x->B + seq] = (struct kvcap_cuda_capsule_span){
                hb + u * T * x->h * d * x->es, tb + u * T * x->rv * d * x->es,
                mb + u * d * x->es, q, acc, x->tiles, 0};
        }
    CU(cudaMemcpyAsync(x->rows, hr, L * P * sizeof *hr, cudaMemcpyHostToDevice, b->s));
    CU(cudaMemcpyAsync(x->spans, hsp, L * P * sizeof *hsp, cudaMemcpyHostToDevice, b->s));
    CU(cudaStreamSynchronize(b->s));
    free(hr);
    free(hsp);
    return 1;
}

static void *to_host(const void *dev, size_t bytes)
{
    void *h = xmalloc(bytes);
    CU(cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost));
    return h;
}

/* max |gpu − cpu| / max |cpu| over one problem's G·d outputs. */
static double rel_err(const float *gpu, const float *cpu, size_t count)
{
    double diff = 0, scale = 0;
    for (size_t i = 0; i < count; i++) {
        double e = fabs((double)gpu[i] - cpu[i]), c = fabs((double)cpu[i]);
        if (!(e <= diff)) /* NaN counts as the largest error */
            diff = isnan(e) ? INFINITY : e;
        scale = c > scale ? c : scale;
    }
    return scale > 0 ? diff / scale : diff;
}

/* One run's output of the last layer for a few problems (sequences 0 and B−1 × KV heads 0 and
 * H−1) against the CPU kernels on the same stored values read back. Returns the largest
 * relative error; *bytes_ok says whether the CPU's count of bytes read equals the model's. */
static double decode_check(const struct decode *x, int fused, int *bytes_ok)
{
    const size_t d = (size_t)x->d, n = (size_t)x->n, G = (size_t)x->G, T = (size_t)x->tiles;
    const size_t l = (size_t)x->L - 1, rows = (size_t)x->P * G;
    float *out = to_host(x->out, rows * d * 4), *q = to_host(x->q, rows * d * 4);
    float *mx = xmalloc(G * 4), *sum = xmalloc(G * 4), *o = xmalloc(G * d * 4);
    float *ref = xmalloc(G * d * 4);
    double worst = 0;
    *bytes_ok = 1;
    int seqs[2] = {0, x->B - 1}, heads[2] = {0, x->H - 1};
    for (int si = 0; si < 2; si++)
        for (int hi = 0; hi < 2; hi++) {
            const size_t p = (size_t)seqs[si] * x->H + heads[hi], u = l * x->P + p;
            struct kvcap_partial acc = {mx, sum, o};
            kvcap_partial_reset(acc, x->G, x->d);
            uint64_t got, want;
            if (!fused) {
                void *k = to_host((const char *)x->k + u * n * d * x->es, n * d * x->es);
                void *v = to_host((const char *)x->v + u * n * d * x->es, n * d * x->es);
                struct kvcap_rows r = {k, v, x->dt, d, x->n};
                kv_check(kvcap_attend_rows(&r, q + p * G * d, x->G, x->d, x->scale, acc, &got),
                         "kvcap_attend_rows", __LINE__);
                want = 2 * (uint64_t)n * d * x->es;
                free(k);
                free(v);
            } else {
                float *maps = to_host(x->maps, (size_t)x->L * x->H * maps_floats(x) * 4);
                void *hs = to_host((const char *)x->hs + u * T * x->h * d * x->es,
                                   T * x->h * d * x->es);
                void *vt = to_host((const char *)x->vt + u * T * x->rv * d * x->es,
                                   T * x->rv * d * x->es);
                void *mu = to_host((const char *)x->mu + u * d * x->es, d * x->es);
                struct kvcap_capsule_maps mp = maps_at(x, maps, (int)l, heads[hi]);
                struct kvcap_capsule_span sp = {hs, vt, mu, x->dt, x->tiles, q + p * G * d, acc};
                size_t sf = kvcap_capsule_scratch_floats(&mp, 1, x->tiles, x->G, x->d);
                float *scratch = xmalloc(sf * 4);
                kv_check(kvcap_capsule_attend(&mp, &sp, 1, x->G, x->d, x->scale, scratch, sf,
                                              &got),
                         "kvcap_capsule_attend", __LINE__);
                want = maps_floats(x) * 4 + (T * (x->h + x->rv) * d + d) * x->es;
                free(scratch), free(maps), free(hs), free(vt), free(mu);
            }
            *bytes_ok = *bytes_ok && got == want;
            kvcap_partial_finish(acc, x->G, x->d, ref, d);
            double e = rel_err(out + p * G * d, ref, G * d);
            worst = e > worst || isnan(e) ? e : worst;
        }
    free(out), free(q), free(mx), free(sum), free(o), free(ref);
    return worst;
}

struct decode_row {
    int n, B, skipped;
    double plain_ms, fused_ms;
    uint64_t plain_bytes, fused_bytes;
};

static double pct_copy(const struct bench *b, uint64_t bytes, double ms)
{
    return b->copy_gbs > 0 ? 100.0 * (bytes / (ms * 1e-3) * 1e-9) / b->copy_gbs : 0.0;
}

static int section_decode(struct bench *b)
{
    const struct opts *o = &b->o;
    const int H = o->kv_heads, G = o->q_heads / o->kv_heads, m = o->tr * o->tc;
    int hk = (int)lround(o->ratio * m);
    hk = hk < 1 ? 1 : hk > m ? m : hk;
    printf("decode attention: %d q / %d kv heads (G = %d), d %d, %d layer%s per step, %s K/V\n",
           o->q_heads, H, G, o->d, o->layers, o->layers == 1 ? "" : "s",
           kvcap_dtype_name(o->dtype));
    printf("  plain: kvcap_cuda_attend_rows over all B x %d (sequence, KV head) problems of a "
           "layer\n", H);
    printf("  fused: kvcap_cuda_capsule_attend, tiled %dx%d maps (m = %d points), h = R_v = %d "
           "(r = %g), tiles = n / %d; one call per KV head (own maps, B spans), the %d calls on "
           "%d streams; random maps and states (timing only)\n",
           o->tr, o->tc, m, hk, o->ratio, m, H, H);
    printf("  both: partials reset + attention + finish per layer; bytes read = K/V (plain), or "
           "maps once per call + H, V~, mu per span (fused), as the CPU kernels count them\n");
    printf("  check: before timing each shape, outputs of sequences 0 and B-1 x KV heads 0 and "
           "%d (last layer) against the CPU kernels kvcap_attend_rows / kvcap_capsule_attend on "
           "the same values; > %.0e relative to the largest output withholds the timings "
           "(exit 1)\n\n",
           H - 1, CHECK_REL_TOL);
    printf("%8s %3s %11s %11s %7s %10s %10s %10s %10s %7s %7s %9s\n", "context", "B", "plain us",
           "fused us", "f/p", "plain rd", "fused rd", "plain GB/s", "fused GB/s", "p %copy",
           "f %copy", "check err");
    struct decode_row *res = xmalloc(sizeof *res * (size_t)o->n_batches * o->n_contexts);
    int n_res = 0;
    for (int bi = 0; bi < o->n_batches; bi++)
        for (int ci = 0; ci < o->n_contexts; ci++) {
            struct decode x;
            memset(&x, 0, sizeof x);
            x.n = o->contexts[ci], x.B = o->batches[bi], x.L = o->layers, x.H = H, x.G = G;
            x.d = o->d, x.m = m, x.h = hk, x.rv = hk, x.tiles = x.n / m, x.P = x.B * H;
            x.dt = o->dtype, x.es = kvcap_dtype_size(o->dtype);
            x.scale = (float)(1.0 / sqrt((double)o->d));
            struct decode_row *r = &res[n_res++];
            memset(r, 0, sizeof *r);
            r->n = x.n, r->B = x.B;
            size_t need = 0;
            if (!decode_setup(b, &x, &need)) {
                size_t fr = 0, tot = 0;
                CU(cudaMemGetInfo(&fr, &tot));
                r->skipped = 1;
                printf("%8d %3d  skipped: needs %.1f GiB of device memory, %.1f GiB free\n", x.n,
                       x.B, need / 1073741824.0, fr / 1073741824.0);
                fflush(stdout);
                continue;
            }
            struct runner plain, fused;
            runner_init(&plain, b, enqueue_plain, &x);
            runner_init(&fused, b, enqueue_fused, &x);
            int bytes_ok_p, bytes_ok_f;
            runner_run(&plain);
            CU(cudaStreamSynchronize(b->s));
            double err_p = decode_check(&x, 0, &bytes_ok_p);
            runner_run(&fused);
            CU(cudaStreamSynchronize(b->s));
            double err_f = decode_check(&x, 1, &bytes_ok_f);
            if (!(err_p <= CHECK_REL_TOL) || !(err_f <= CHECK_REL_TOL)) {
                printf("%8d %3d  CHECK FAILED: max relative error plain %.3g, fused %.3g "
                       "(tolerance %.0e) against the CPU kernels: timings withheld\n",
                       x.n, x.B, err_p, err_f, CHECK_REL_TOL);
                fflush(stdout);
                fprintf(stderr, TOOL ": error: GPU and CPU decode outputs disagree at context %d, "
                                "batch %d: no timings are reported\n", x.n, x.B);
                exit(1);
            }
            if (!bytes_ok_p || !bytes_ok_f)
                fprintf(stderr, TOOL ": warning: the CPU kernels count other bytes read than "
                                "this benchmark's model at context %d\n", x.n);
            r->plain_ms = runner_time(&plain, NULL);
            r->fused_ms = runner_time(&fused, NULL);
            runner_free(&plain);
            runner_free(&fused);
            r->plain_bytes = (uint64_t)x.L * x.P * 2 * (uint64_t)x.n * x.d * x.es;
            r->fused_bytes = (uint64_t)x.L * x.H * maps_floats(&x) * 4 +
                             (uint64_t)x.L * x.P *
                                 (((uint64_t)x.tiles * (x.h + x.rv) + 1) * x.d * x.es);
            decode_free(&x);
            char pb[32], fb[32];
            double pg = r->plain_bytes / (r->plain_ms * 1e-3) * 1e-9;
            double fg = r->fused_bytes / (r->fused_ms * 1e-3) * 1e-9;
            printf("%8d %3d %11.1f %11.1f %7.3f %10s %10s %10.1f %10.1f %6.0f%% %6.0f%% %9.1e\n",
                   r->n, r->B, r->plain_ms * 1e3, r->fused_ms * 1e3, r->fused_ms / r->plain_ms,
                   cli_bytes(r->plain_bytes, pb, sizeof pb),
                   cli_bytes(r->fused_bytes, fb, sizeof fb), pg, fg,
                   pct_copy(b, r->plain_bytes, r->plain_ms),
                   pct_copy(b, r->fused_bytes, r->fused_ms), err_p > err_f ? err_p : err_f);
            fflush(stdout);
            if (b->tsv)
                fprintf(b->tsv, "decode\t%s\t%d\t%d\t%d\t%.3f\t%.3f\t%llu\t%llu\t%.3f\n",
                        kvcap_dtype_name(o->dtype), o->layers, r->n, r->B, r->plain_ms * 1e3,
                        r->fused_ms * 1e3, (unsigned long long)r->plain_bytes,
                        (unsigned long long)r->fused_bytes, b->copy_gbs);
        }
    printf("  us: microseconds per step (%d layer%s); f/p: fused / plain time; rd: bytes read "
           "per step; %%copy: achieved GB/s (bytes read / time) over the copy's GB/s (bytes "
           "copied / time), so a kernel that only reads may exceed 100%%\n",
           o->layers, o->layers == 1 ? "" : "s");

    /* Goals: fused <= 0.5x plain at batch 1 with >= 8K tokens; >= 80% of the copy at B >= 8. */
    double worst_ratio = 0, worst_p = 1e30, worst_f = 1e30;
    int n1 = 0, n8 = 0, ratio_at = 0, p_at = 0, f_at = 0;
    for (int i = 0; i < n_res; i++) {
        const struct decode_row *r = &res[i];
        if (r->skipped)
            continue;
        if (r->B == 1 && r->n >= 8192) {
            n1++;
            if (r->fused_ms / r->plain_ms > worst_ratio)
                worst_ratio = r->fused_ms / r->plain_ms, ratio_at = r->n;
        }
        if (r->B >= 8) {
            n8++;
            double pp = pct_copy(b, r->plain_bytes, r->plain_ms);
            double fp = pct_copy(b, r->fused_bytes, r->fused_ms);
            if (pp < worst_p)
                worst_p = pp, p_at = r->n;
            if (fp < worst_f)
                worst_f = fp, f_at = r->n;
        }
    }
    if (n1)
        printf("goal fused <= 0.5x plain at batch 1, >= 8K tokens: %s (worst %.3fx at %d "
               "tokens)\n", worst_ratio <= 0.5 ? "MET" : "NOT MET", worst_ratio, ratio_at);
    else
        printf("goal fused <= 0.5x plain at batch 1, >= 8K tokens: not measured\n");
    if (n8 && b->copy_gbs > 0)
        printf("goal >= 80%% of copy bandwidth at batch >= 8: plain %s (worst %.0f%% at %d), "
               "fused %s (worst %.0f%% at %d)\n",
               worst_p >= 80 ? "MET" : "NOT MET", worst_p, p_at,
               worst_f >= 80 ? "MET" : "NOT MET", worst_f, f_at);
    else
        printf("goal >= 80%% of copy bandwidth at batch >= 8: not measured\n");
    printf("\n");
    free(res);
    return 0;
}

/* ---- Section: FlashCache compression ---------------------------------------------------------
 * One span of n tokens per layer, all of them compressible (no sinks or window: the paper's
 * setting). Timed per run: scoring of every (layer, KV head) (kvcap_cuda_flashcache_deviation),
 * the energies copied to the host, the layer budgets (kvcap_budget_allocate, on the host: the
 * stream waits for it), the budgets copied back, and the top-k of every head (kvcap_cuda_topk). */

struct fc_job {
    struct kvcap_cuda_dct *plan;
    struct kvcap_cuda_kv kv;
    int n, L, H, omega;
    float *dev;
    struct kvcap_energy *energy, *energy_host; /* device, pinned host [L·H] */
    int *keep, *keep_host, *idx;               /* device, pinned host [L·H]; device [L·H][n] */
    void *scratch;
    size_t scratch_bytes;
    double *w;
    int *cap, *budget;
    cudaEvent_t t_scored, t_budgets;
};

static void enqueue_fc(struct bench *b, void *ctx)
{
    struct fc_job *j = ctx;
    const int pairs = j->L * j->H;
    KV(kvcap_cuda_flashcache_deviation(j->plan, &j->kv, j->omega, j->dev, j->energy, j->scratch,
                                       j->scratch_bytes, b->s));
    CU(cudaEventRecord(j->t_scored, b->s));
    CU(cudaMemcpyAsync(j->energy_host, j->energy, sizeof *j->energy * (size_t)pairs,
                       cudaMemcpyDeviceToHost, b->s));
    CU(cudaStreamSynchronize(b->s));
    for (int l = 0; l < j->L; l++) {
        struct kvcap_energy e = {0, 0, 0, 0};
        for (int h = 0; h < j->H; h++) {
            const struct kvcap_energy *x = &j->energy_host[l * j->H + h];
            e.k_total += x->k_total, e.k_low += x->k_low;
            e.v_total += x->v_total, e.v_low += x->v_low;
        }
        j->w[l] = kvcap_flashcache_layer_weight(&e);
        j->cap[l] = j->n;
    }
    KV(kvcap_budget_allocate(j->w, j->cap, j->L, FC_MIN_TOKENS,
                             llround(FC_RETENTION * (double)j->n * j->L), j->budget));
    for (int p = 0; p < pairs; p++)
        j->keep_host[p] = j->budget[p / j->H];
    CU(cudaMemcpyAsync(j->keep, j->keep_host, sizeof(int) * (size_t)pairs,
                       cudaMemcpyHostToDevice, b->s));
    CU(cudaEventRecord(j->t_budgets, b->s));
    KV(kvcap_cuda_topk(j->dev, (size_t)j->n, j->n, pairs, 0, j->keep, j->idx, (size_t)j->n,
                       b->s));
}

/* Deviations of two pairs against the CPU's kvcap_flashcache_deviation. */
static double fc_check(struct fc_job *j, const struct opts *o, const void *k, const void *v)
{
    const size_t n = (size_t)j->n, d = (size_t)o->d, es = kvcap_dtype_size(o->dtype);
    struct kvcap_dct *plan = NULL;
    KV(kvcap_dct_create(j->n, &plan));
    float *kf = xmalloc(n * d * 4), *vf = xmalloc(n * d * 4), *dev = xmalloc(n * 4);
    float *scratch = xmalloc(kvcap_flashcache_scratch_floats(plan, o->d) * 4);
    float *gpu = to_host(j->dev, (size_t)j->L * j->H * n * 4);
    double worst = 0;
    const int pairs[2] = {0, j->L * j->H - 1};
    for (int i = 0; i < 2; i++) {
        const size_t off = (size_t)pairs[i] * n * d * es; /* [L][H][n][d] */
        void *kh = to_host((const char *)k + off, n * d * es);
        void *vh = to_host((const char *)v + off, n * d * es);
        KV(kvcap_convert_to_f32(o->dtype, kh, n * d, kf));
        KV(kvcap_convert_to_f32(o->dtype, vh, n * d, vf));
        kvcap_flashcache_deviation(plan, kf, vf, o->d, j->omega, dev, NULL, scratch);
        double e = rel_err(gpu + (size_t)pairs[i] * n, dev, n);
        worst = e > worst || isnan(e) ? e : worst;
        free(kh), free(vh);
    }
    free(kf), free(vf), free(dev), free(scratch), free(gpu);
    kvcap_dct_free(plan);
    return worst;
}

static int section_flashcache(struct bench *b)
{
    const struct opts *o = &b->o;
    const int L = o->layers_set ? o->layers : 28, H = o->kv_heads, pairs = L * H;
    const size_t es = kvcap_dtype_size(o->dtype), d = (size_t)o->d;
    static const double paper_ms[] = {1.66, 3.86, 6.77}; /* 2K, 4K, 8K tokens x 28 layers */
    printf("FlashCache compression of one span: %d layers x %d kv heads, d %d, %s; gamma %g, "
           "retention %g, all tokens compressible\n",
           L, H, o->d, kvcap_dtype_name(o->dtype), FC_GAMMA, FC_RETENTION);
    printf("  timed (events, median of %d): DCT scoring of every head (cuFFT), energies to the "
           "host, layer budgets on the host, top-k of every head; paper: 1.66/3.86/6.77 ms at "
           "2K/4K/8K x 28 layers; goal <= 1 ms at 8K on an H100\n",
           o->reps);
    printf("  check: deviations of the first and last (layer, head) against the CPU's "
           "kvcap_flashcache_deviation (> %.0e relative withholds the timings)\n\n",
           CHECK_REL_TOL);
    printf("%8s %11s %11s %11s %10s %10s %9s\n", "tokens", "scoring ms", "top-k ms", "total ms",
           "paper ms", "check err", "goal");
    for (int i = 0; i < o->n_fc_tokens; i++) {
        const int n = o->fc_tokens[i];
        struct fc_job j;
        memset(&j, 0, sizeof j);
        j.n = n, j.L = L, j.H = H, j.omega = kvcap_flashcache_omega(FC_GAMMA, n);
        enum kvcap_status st = kvcap_cuda_dct_create(n, o->d, pairs, &j.plan);
        if (st == KVCAP_ERR_UNSUPPORTED) {
            printf("%8d  skipped: %s\n", n, kvcap_last_error());
            continue;
        }
        KV(st);
        j.scratch_bytes = kvcap_cuda_flashcache_scratch_bytes(j.plan);
        const size_t elems = (size_t)pairs * n * d;
        void *k = dev_try(elems * es), *v = dev_try(elems * es);
        j.scratch = dev_try(j.scratch_bytes);
        j.dev = dev_try((size_t)pairs * n * 4);
        j.idx = dev_try((size_t)pairs * n * sizeof(int));
        j.energy = dev_try(sizeof *j.energy * (size_t)pairs);
        j.keep = dev_try(sizeof(int) * (size_t)pairs);
        if (!k || !v || !j.scratch || !j.dev || !j.idx || !j.energy || !j.keep) {
            printf("%8d  skipped: needs %.1f GiB of device memory\n", n,
                   (2 * elems * es + j.scratch_bytes + (size_t)pairs * n * 8) / 1073741824.0);
        } else {
            fill(b, k, o->dtype, elems, 21, -1.0f, 1.0f);
            fill(b, v, o->dtype, elems, 22, -1.0f, 1.0f);
            const void **kp = xmalloc(sizeof *kp * (size_t)L), **vp = xmalloc(sizeof *vp * (size_t)L);
            for (int l = 0; l < L; l++) {
                kp[l] = (const char *)k + (size_t)l * H * n * d * es;
                vp[l] = (const char *)v + (size_t)l * H * n * d * es;
            }
            j.kv = (struct kvcap_cuda_kv){(const void *const *)kp, (const void *const *)vp,
                                          o->dtype, d, (size_t)n * d, L, H};
            CU(cudaHostAlloc((void **)&j.energy_host, sizeof *j.energy * (size_t)pairs, 0));
            CU(cudaHostAlloc((void **)&j.keep_host, sizeof(int) * (size_t)pairs, 0));
            j.w = xmalloc(sizeof *j.w * (size_t)L);
            j.cap = xmalloc(sizeof *j.cap * (size_t)L);
            j.budget = xmalloc(sizeof *j.budget * (size_t)L);
            CU(cudaEventCreate(&j.t_scored));
            CU(cudaEventCreate(&j.t_budgets));
            /* Not a graph: the host computes the budgets between the two GPU halves. */
            struct bench direct = *b;
            direct.o.graph = 0;
            struct runner r;
            runner_init(&r, &direct, enqueue_fc, &j);
            runner_run(&r);
            CU(cudaStreamSynchronize(b->s));
            double err = fc_check(&j, o, k, v);
            if (!(err <= CHECK_REL_TOL)) {
                printf("%8d  CHECK FAILED: deviations differ from the CPU's by %.3g relative: "
                       "timings withheld\n", n, err);
                fflush(stdout);
                fprintf(stderr, TOOL ": error: GPU and CPU FlashCache deviations disagree at %d "
                                "tokens: no timings are reported\n", n);
                exit(1);
            }
            /* Median of each part over the same runs. */
            const int reps = o->reps;
            double *tot = xmalloc(sizeof(double) * reps), *sc = xmalloc(sizeof(double) * reps);
            double *tk = xmalloc(sizeof(double) * reps);
            cudaEvent_t e0, e1;
            CU(cudaEventCreate(&e0));
            CU(cudaEventCreate(&e1));
            for (int w = 0; w < o->warmup; w++) {
                flush_l2(b);
                runner_run(&r);
            }
            for (int rep = 0; rep < reps; rep++) {
                flush_l2(b);
                CU(cudaEventRecord(e0, b->s));
                runner_run(&r);
                CU(cudaEventRecord(e1, b->s));
                CU(cudaEventSynchronize(e1));
                float a = 0, s = 0, t = 0;
                CU(cudaEventElapsedTime(&a, e0, e1));
                CU(cudaEventElapsedTime(&s, e0, j.t_scored));
                CU(cudaEventElapsedTime(&t, j.t_budgets, e1));
                tot[rep] = a, sc[rep] = s, tk[rep] = t;
            }
            double mt = cli_median(tot, reps), ms = cli_median(sc, reps);
            double mk = cli_median(tk, reps);
            char paper[16] = "-", goal[16] = "";
            if (L == 28 && H == 4 && o->d == 128 && (n == 2048 || n == 4096 || n == 8192))
                snprintf(paper, sizeof paper, "%.2f", paper_ms[n == 2048 ? 0 : n == 4096 ? 1 : 2]);
            if (n == 8192)
                snprintf(goal, sizeof goal, "%s", mt <= 1.0 ? "MET" : "NOT MET");
            printf("%8d %11.3f %11.3f %11.3f %10s %10.1e %9s\n", n, ms, mk, mt, paper, err, goal);
            fflush(stdout);
            if (b->tsv)
                fprintf(b->tsv, "flashcache\t%s\t%d\t%d\t%d\t%.4f\t%.4f\t%.4f\n",
                        kvcap_dtype_name(o->dtype), L, H, n, ms, mk, mt);
            runner_free(&r);
            CU(cudaEventDestroy(e0));
            CU(cudaEventDestroy(e1));
            CU(cudaEventDestroy(j.t_scored));
            CU(cudaEventDestroy(j.t_budgets));
            CU(cudaFreeHost(j.energy_host));
            CU(cudaFreeHost(j.keep_host));
            free(tot), free(sc), free(tk), free(kp), free(vp), free(j.w), free(j.cap),
                free(j.budget);
        }
        dev_free(&k), dev_free(&v), dev_free(&j.scratch), dev_free((void **)&j.dev);
        dev_free((void **)&j.idx), dev_free((void **)&j.energy), dev_free((void **)&j.keep);
        kvcap_cuda_dct_free(j.plan);
    }
    printf("  scoring: deviations and energies; top-k: from the budgets' arrival on the device "
           "to the selected indices; total: all of it, the host's budgets included\n\n");
    return 0;
}

/* ---- Section: FreeKV -------------------------------------------------------------------------
 * L layers, one kvcap_cuda_freekv state each (kernels/cuda/freekv_cuda.h), N tokens appended at
 * prefill, then decode steps as an engine runs them: per step, for each layer in order on the
 * main stream, append one token, reset the partials, attend, finish, step_done and, with
 * --freekv-layer-us, a spin kernel standing for the rest of the layer. Layer l's speculative
 * recall for step t + 1 is planned by its step_done of step t and issued by its append of step
 * t + 1, so it overlaps layers l + 1 .. L − 1 of step t; without a spin kernel that is only
 * their FreeKV calls. Queries follow q_t = 0.95 q_{t−1} + 0.31 ε with unit normals (step-to-step
 * cosine ≈ 0.95, above tau 0.9: corrections are rare), made on the host and uploaded before the
 * steps; K/V are random, made on the device. Not a CUDA graph: append waits on the host for the
 * selection it plans the recall from.
 * The statistics are cumulative; they are read after the warm-up steps (which makes the device
 * idle and issues every layer's pending recall) and after the S + 1 steps that follow. The
 * first of those is not timed and its recalls, complete before it started, are left out of the
 * hidden share; its counts stay in the per-step averages (each step's recall is the one its
 * step_done planned, so S + 1 steps planned exactly the recalls counted in between). */

#define FKV_RHO 0.95   /* query step-to-step correlation */
#define FKV_NOISE 0.31 /* ≈ sqrt(1 − 0.95²): the queries stay of unit variance */
#define FKV_CHUNK 2048 /* prefill tokens per append */
#define FKV_MIN_WARMUP 2 /* a resync step, then at least one speculative step is checked */
/* Share of layer 0's (step, head) selections that must equal the CPU's: the device ranks pages
 * by double scores, the CPU by f32 ones, so a near-tie may pick another page (then the two
 * attend different pages and the outputs are not compared). */
#define FKV_AGREE 0.9

struct fkv {
    int n, L, H, G, d, warm, steps, T; /* T = warm + 1 + steps decode tokens per layer */
    enum kvcap_dtype dt;
    size_t es;
    float scale;
    double layer_us;
    int busy_blocks;
    struct kvcap_freekv_params p;
    struct kvcap_cuda_freekv **f; /* [L] */
    void *tk, *tv;                /* device decode tokens [L][T][H][d] in dt */
    float *q, *qh;                /* queries [L][T][H][G][d]: device, host */
    struct kvcap_partial acc;     /* device, H·G rows */
    float *out;                   /* device [H·G][d] */
};

/* Layer 0 on the CPU (runtime/freekv.h, worker NULL): its buffers and the comparison so far. */
struct fkv_check {
    struct kvcap_freekv *c;
    void *raw;                        /* host [FKV_CHUNK][H][d] in dt: K/V read back */
    float *k, *v, *out, *ref, *mx, *sum, *o;
    int *got, *want, cap;
    int compared, differ;             /* (step, head) pairs */
    int stats_differ;                 /* steps whose statistics differed from the CPU's */
    double err;
};

static size_t fkv_qn(const struct fkv *x)
{
    return (size_t)x->H * x->G * x->d;
}

static const void *fkv_tok(const struct fkv *x, const void *base, int l, int t)
{
    return (const char *)base + ((size_t)l * x->T + t) * x->H * x->d * x->es;
}

/* The same n tokens (device [H][n][d] in dt) to the CPU state. */
static void fkv_check_append(struct bench *b, const struct fkv *x, struct fkv_check *c,
                             const void *k, const void *v, int n)
{
    const size_t m = (size_t)x->H * n * x->d;
    CU(cudaStreamSynchronize(b->s));
    CU(cudaMemcpy(c->raw, k, m * x->es, cudaMemcpyDeviceToHost));
    KV(kvcap_convert_to_f32(x->dt, c->raw, m, c->k));
    CU(cudaMemcpy(c->raw, v, m * x->es, cudaMemcpyDeviceToHost));
    KV(kvcap_convert_to_f32(x->dt, c->raw, m, c->v));
    KV(kvcap_freekv_append(c->c, c->k, c->v, n));
}

/* Layer 0 at step t, after its attention: the CPU appends and attends the same, then outputs
 * are compared head by head where both attended the same pages. */
static void fkv_check_step(struct bench *b, struct fkv *x, struct fkv_check *c, int t)
{
    const size_t gd = (size_t)x->G * x->d, qn = fkv_qn(x);
    fkv_check_append(b, x, c, fkv_tok(x, x->tk, 0, t), fkv_tok(x, x->tv, 0, t), 1);
    CU(cudaMemcpy(c->out, x->out, qn * sizeof(float), cudaMemcpyDeviceToHost));
    const float *q = x->qh + (size_t)t * qn; /* layer 0 */
    for (int h = 0; h < x->H; h++) {
        struct kvcap_partial acc = {c->mx, c->sum, c->o};
        kvcap_partial_reset(acc, x->G, x->d);
        kv_check(kvcap_freekv_attend(c->c, h, q + h * gd, x->scale, acc, NULL),
                 "kvcap_freekv_attend", __LINE__);
        kvcap_partial_finish(acc, x->G, x->d, c->ref + h * gd, (size_t)x->d);
        const int ng = kvcap_cuda_freekv_selection(x->f[0], h, c->got, c->cap);
        const int nw = kvcap_freekv_selection(c->c, h, c->want, c->cap);
        if (ng < 0 || nw < 0)
            kv_check(KVCAP_ERR_INTERNAL, "kvcap_*freekv_selection", __LINE__);
        if (ng != nw || memcmp(c->got, c->want, sizeof(int) * (size_t)ng) != 0) {
            c->differ++;
            continue;
        }
        c->compared++;
        const double e = rel_err(c->out + h * gd, c->ref + h * gd, gd);
        c->err = e > c->err || isnan(e) ? e : c->err;
    }
    /* The counts the table reports, while every pick so far was the CPU's: read before
     * step_done, they cover the recalls whose picks were compared (at this step or before). */
    if (c->differ == 0) {
        struct kvcap_cuda_freekv_stats g;
        struct kvcap_freekv_stats w;
        KV(kvcap_cuda_freekv_stats(x->f[0], &g));
        kvcap_freekv_stats(c->c, &w);
        c->stats_differ += g.base.steps != w.steps || g.base.corrections != w.corrections ||
                           g.base.resyncs != w.resyncs ||
                           g.base.pages_recalled != w.pages_recalled ||
                           g.base.bytes_recalled != w.bytes_recalled;
    }
}

/* Layer l's calls of decode step t on the main stream; with c, layer 0 is also checked (which
 * synchronises). */
static void fkv_layer(struct bench *b, struct fkv *x, int l, int t, struct fkv_check *c)
{
    const int rows = x->H * x->G;
    KV(kvcap_cuda_freekv_append(x->f[l], fkv_tok(x, x->tk, l, t), fkv_tok(x, x->tv, l, t), x->dt,
                                1, b->s));
    KV(kvcap_cuda_partial_reset(x->acc, rows, x->d, b->s));
    KV(kvcap_cuda_freekv_attend(x->f[l], x->q + ((size_t)l * x->T + t) * fkv_qn(x), x->scale,
                                x->acc, b->s));
    KV(kvcap_cuda_partial_finish(x->acc, rows, x->d, x->out, (size_t)x->d, b->s));
    if (c && l == 0)
        fkv_check_step(b, x, c, t);
    KV(kvcap_cuda_freekv_step_done(x->f[l], b->s));
    if (c && l == 0)
        KV(kvcap_freekv_step_done(c->c));
    if (x->layer_us > 0)
        CU(kvcap_bench_busy(x->layer_us, x->busy_blocks, b->s));
}

static void fkv_check_free(struct fkv_check *c)
{
    kvcap_freekv_free(c->c);
    free(c->raw), free(c->k), free(c->v), free(c->out), free(c->ref), free(c->mx), free(c->sum);
    free(c->o), free(c->got), free(c->want);
    memset(c, 0, sizeof *c);
}

static void fkv_states_free(struct fkv *x)
{
    for (int l = 0; l < x->L; l++) {
        kvcap_cuda_freekv_free(x->f[l]);
        x->f[l] = NULL;
    }
}

/* One context: prefill, checked warm-up, timed steps; prints its row. */
static void fkv_context(struct bench *b, struct fkv *x, void *kc, void *vc)
{
    const struct opts *o = &b->o;
    const int L = x->L, S = x->steps;
    const size_t qn = fkv_qn(x), gd = (size_t)x->G * x->d;
    for (int l = 0; l < L; l++) {
        enum kvcap_status st = kvcap_cuda_freekv_create(&x->p, x->H, x->G, x->d, x->dt,
                                                        x->n + x->T + 1, &x->f[l]);
        if (st != KVCAP_OK) {
            printf("%8d  skipped: layer %d: %s\n", x->n, l,
                   kvcap_last_error()[0] ? kvcap_last_error() : kvcap_status_str(st));
            fflush(stdout);
            fkv_states_free(x);
            return;
        }
    }
    struct fkv_check c;
    memset(&c, 0, sizeof c);
    const size_t chunk = (size_t)FKV_CHUNK * x->H * x->d;
    KV(kvcap_freekv_create(&x->p, x->H, x->G, x->d, x->dt, NULL, &c.c));
    c.raw = xmalloc(chunk * x->es);
    c.k = xmalloc(chunk * 4), c.v = xmalloc(chunk * 4);
    c.out = xmalloc(qn * 4), c.ref = xmalloc(qn * 4);
    c.mx = xmalloc((size_t)x->G * 4), c.sum = xmalloc((size_t)x->G * 4), c.o = xmalloc(gd * 4);
    c.cap = x->p.budget_tokens / x->p.page_size + 1;
    c.got = xmalloc(sizeof(int) * (size_t)c.cap), c.want = xmalloc(sizeof(int) * (size_t)c.cap);

    /* Prefill: random K in [-1, 1], V in [0, 1] (non-zero mean, see CHECK_REL_TOL). */
    for (int l = 0; l < L; l++)
        for (int t0 = 0, ci = 0; t0 < x->n; t0 += FKV_CHUNK, ci++) {
            const int m = x->n - t0 < FKV_CHUNK ? x->n - t0 : FKV_CHUNK;
            const size_t elems = (size_t)x->H * m * x->d;
            const uint64_t seed = ((uint64_t)(l + 1) << 32) + 2 * (uint64_t)ci;
            fill(b, kc, x->dt, elems, seed, -1.0f, 1.0f);
            fill(b, vc, x->dt, elems, seed + 1, 0.0f, 1.0f);
            KV(kvcap_cuda_freekv_append(x->f[l], kc, vc, x->dt, m, b->s));
            if (l == 0)
                fkv_check_append(b, x, &c, kc, vc, m);
        }
    for (int t = 0; t < x->warm; t++)
        for (int l = 0; l < L; l++)
            fkv_layer(b, x, l, t, &c);

    const int pairs = c.compared + c.differ, differ = c.differ, stats_ok = !c.stats_differ;
    const double err = c.err;
    if (!(err <= CHECK_REL_TOL) || differ > (1.0 - FKV_AGREE) * pairs || !stats_ok) {
        printf("%8d  CHECK FAILED: layer 0 against the CPU state: max relative error %.3g "
               "(tolerance %.0e) over %d head-steps, %d of %d selections differ, statistics "
               "%s: timings withheld\n",
               x->n, err, CHECK_REL_TOL, c.compared, differ, pairs,
               stats_ok ? "equal" : "differ");
        fflush(stdout);
        fprintf(stderr, TOOL ": error: GPU and CPU FreeKV disagree at context %d: no timings are "
                        "reported\n", x->n);
        exit(1);
    }
    fkv_check_free(&c);
    struct kvcap_cuda_freekv_stats *a = xmalloc(sizeof *a * 2 * (size_t)L), *z = a + L;
    for (int l = 0; l < L; l++)
        KV(kvcap_cuda_freekv_stats(x->f[l], &a[l]));

    /* Events before each of the S + 1 steps and after the last; step 0 is not timed. */
    cudaEvent_t *ev = xmalloc(sizeof *ev * (size_t)(S + 2));
    for (int i = 0; i < S + 2; i++)
        CU(cudaEventCreate(&ev[i]));
    for (int i = 0; i <= S; i++) {
        CU(cudaEventRecord(ev[i], b->s));
        for (int l = 0; l < L; l++)
            fkv_layer(b, x, l, x->warm + i, NULL);
    }
    CU(cudaEventRecord(ev[S + 1], b->s));
    CU(cudaEventSynchronize(ev[S + 1]));
    for (int l = 0; l < L; l++)
        KV(kvcap_cuda_freekv_stats(x->f[l], &z[l]));
    double *ms = xmalloc(sizeof *ms * (size_t)S);
    for (int i = 0; i < S; i++) {
        float t = 0;
        CU(cudaEventElapsedTime(&t, ev[i + 1], ev[i + 2]));
        ms[i] = t;
    }
    float total = 0;
    CU(cudaEventElapsedTime(&total, ev[1], ev[S + 1]));
    const double mean_us = 1e3 * total / S;
    const double med_us = 1e3 * cli_median(ms, S);

    int64_t steps = 0, corr = 0, resync = 0, pages = 0, rec = 0, hid = 0;
    uint64_t bytes = 0;
    for (int l = 0; l < L; l++) {
        steps += z[l].base.steps - a[l].base.steps;
        corr += z[l].base.corrections - a[l].base.corrections;
        resync += z[l].base.resyncs - a[l].base.resyncs;
        pages += z[l].base.pages_recalled - a[l].base.pages_recalled;
        bytes += z[l].base.bytes_recalled - a[l].base.bytes_recalled;
        rec += z[l].spec_recalls - a[l].spec_recalls;
        hid += z[l].spec_hidden - a[l].spec_hidden;
    }
    /* per layer, the untimed step's recall: complete before that step, so counted hidden */
    rec -= L, hid -= L;
    const double per = (double)steps / L; /* steps after the warm-up: S + 1 */
    const double corr_s = corr / per, pages_s = pages / per, bytes_s = bytes / per;
    const double share = rec > 0 && hid >= 0 ? (double)hid / rec : NAN;
    const double need_us = b->h2d_gbs > 0 ? bytes_s / (b->h2d_gbs * 1e3) : NAN;
    char rb[32], sh[16] = "-", h2d[16] = "-", nd[16] = "-";
    if (!isnan(share))
        snprintf(sh, sizeof sh, "%.1f%%", 100 * share);
    if (b->h2d_gbs > 0) {
        snprintf(h2d, sizeof h2d, "%.1f", b->h2d_gbs);
        snprintf(nd, sizeof nd, "%.1f", need_us);
    }
    printf("%8d %6d %8s %10.2f %10.1f %11s %10.1f %10.1f %9s %13s %9.1e\n", x->n, S, sh, corr_s,
           pages_s, cli_bytes((uint64_t)llround(bytes_s), rb, sizeof rb), mean_us, med_us, h2d,
           nd, err);
    if (differ > 0)
        printf("%8s  (%d of %d layer-0 selections differ from the CPU's by a page of near-equal "
               "score; their outputs were not compared)\n", "", differ, pairs);
    if (resync != 0 || rec != (int64_t)S * L)
        printf("%8s  (warning: %lld resyncs and %lld judged recalls in the timed steps, expected "
               "0 and %d)\n", "", (long long)resync, (long long)rec, S * L);
    fflush(stdout);
    if (b->tsv)
        fprintf(b->tsv, "freekv\t%s\t%d\t%d\t%g\t%d\t%.4f\t%.3f\t%.2f\t%.0f\t%.3f\t%.3f\t%.3f\t"
                        "%.3f\n",
                kvcap_dtype_name(o->dtype), L, x->n, x->layer_us, S, share, corr_s, pages_s,
                bytes_s, mean_us, med_us, b->h2d_gbs, need_us);
    for (int i = 0; i < S + 2; i++)
        CU(cudaEventDestroy(ev[i]));
    free(ev), free(ms), free(a);
    fkv_states_free(x);
}

static int section_freekv(struct bench *b)
{
    const struct opts *o = &b->o;
    struct fkv x;
    memset(&x, 0, sizeof x);
    x.L = o->layers_set ? o->layers : 28, x.H = o->kv_heads, x.G = o->q_heads / o->kv_heads;
    x.d = o->d, x.dt = o->dtype, x.es = kvcap_dtype_size(o->dtype);
    x.warm = o->warmup > FKV_MIN_WARMUP ? o->warmup : FKV_MIN_WARMUP;
    x.steps = o->fkv_steps, x.T = x.warm + 1 + x.steps;
    x.scale = (float)(1.0 / sqrt((double)o->d));
    x.layer_us = o->fkv_layer_us, x.busy_blocks = b->prop.multiProcessorCount;
    x.p = kvcap_freekv_default_params();
    const int L = x.L, H = x.H, G = x.G, rows = H * G;
    const size_t qn = fkv_qn(&x), toks = (size_t)L * x.T * H * x.d;
    printf("FreeKV decode: %d q / %d kv heads (G = %d), d %d, %s K/V, %d layer%s (one "
           "kvcap_cuda_freekv state each); page %d, budget %d tokens, %d sink and %d window "
           "pages, tau %g (kvcap_freekv_default_params)\n",
           o->q_heads, H, G, o->d, kvcap_dtype_name(o->dtype), L, L == 1 ? "" : "s",
           x.p.page_size, x.p.budget_tokens, x.p.sink_pages, x.p.window_pages, (double)x.p.tau);
    printf("  per step, each layer in order on one stream: append 1 token (device K/V), "
           "partials reset, kvcap_cuda_freekv_attend, finish, step_done; layer l's speculative "
           "recall for the next step is issued by its next append and overlaps layers l+1..L-1 "
           "of the step\n");
    if (x.layer_us > 0)
        printf("  rest of a layer: a %g us spin kernel (%d blocks of 256 threads, one per SM) "
               "after each layer's calls (--freekv-layer-us)\n", x.layer_us, x.busy_blocks);
    else
        printf("  rest of a layer: none (--freekv-layer-us 0): a layer's recall can only overlap "
               "the other layers' FreeKV calls, a model's projections and MLP would add to "
               "that\n");
    printf("  data: the context appended at prefill in chunks of %d tokens, then 1 token per "
           "step and layer (random: K uniform in [-1, 1], V in [0, 1]); queries q_t = %.2f q_t-1 + %.2f noise (unit normals: "
           "step-to-step cosine ~%.2f), uploaded before the steps; %d warm-up steps, 1 untimed, "
           "then %d timed; not a CUDA graph (append waits on the host for the selection it "
           "plans the recall from)\n",
           FKV_CHUNK, FKV_RHO, FKV_NOISE, FKV_RHO, x.warm, x.steps);
    printf("  check: layer 0's output at every warm-up step (a resync, then speculative steps) "
           "against the CPU state (runtime/freekv.h, worker NULL) fed the same tokens and "
           "queries, for each head whose pages equal the CPU's (>= %.0f%% must), and its "
           "statistics; > %.0e relative to the largest output withholds the timings (exit "
           "1)\n\n",
           100 * FKV_AGREE, CHECK_REL_TOL);

    x.f = calloc((size_t)L, sizeof *x.f);
    x.qh = xmalloc((size_t)L * x.T * qn * sizeof(float));
    const size_t chunk = (size_t)FKV_CHUNK * H * x.d;
    void *kc = dev_try(chunk * x.es), *vc = dev_try(chunk * x.es);
    x.tk = dev_try(toks * x.es), x.tv = dev_try(toks * x.es);
    x.q = dev_try((size_t)L * x.T * qn * sizeof(float));
    x.out = dev_try(qn * sizeof(float));
    float *part = dev_try((size_t)rows * (x.d + 2) * sizeof(float));
    if (!x.f || !kc || !vc || !x.tk || !x.tv || !x.q || !x.out || !part) {
        printf("  skipped: cannot allocate the tokens and queries\n\n");
    } else {
        x.acc = (struct kvcap_partial){part, part + rows, part + 2 * rows};
        struct kvcap_rng r;
        kvcap_rng_seed(&r, 0xf4ee);
        for (int l = 0; l < L; l++)
            for (int t = 0; t < x.T; t++) {
                float *q = x.qh + ((size_t)l * x.T + t) * qn;
                const float *prev = t > 0 ? q - qn : q; /* the layer's previous step */
                for (size_t i = 0; i < qn; i++)
                    q[i] = t == 0 ? (float)kvcap_rng_normal(&r)
                                  : (float)(FKV_RHO * prev[i] + FKV_NOISE * kvcap_rng_normal(&r));
            }
        CU(cudaMemcpyAsync(x.q, x.qh, (size_t)L * x.T * qn * sizeof(float),
                           cudaMemcpyHostToDevice, b->s));
        fill(b, x.tk, x.dt, toks, 31, -1.0f, 1.0f);
        fill(b, x.tv, x.dt, toks, 32, 0.0f, 1.0f);
        CU(cudaStreamSynchronize(b->s));
        printf("%8s %6s %8s %10s %10s %11s %10s %10s %9s %13s %9s\n", "context", "steps",
               "hidden", "corr/step", "pages/step", "recall/step", "step us", "median us",
               "H2D GB/s", "recall us@H2D", "check err");
        for (int ci = 0; ci < o->n_fkv_contexts; ci++) {
            x.n = o->fkv_contexts[ci];
            fkv_context(b, &x, kc, vc);
        }
        printf("  hidden: share of the (step, layer) speculative recalls complete before the "
               "attention needed them (spec_hidden / spec_recalls of kvcap_cuda_freekv_stats, "
               "all layers, timed steps); corr/step: KV heads corrected per step (of %d); "
               "pages, recall: pages and bytes copied host to device per step, all layers, "
               "speculative and corrective (averaged over the timed steps and the untimed "
               "one)\n", L * H);
        printf("  step us: CUDA events on the stream around each timed step, all %d layers and "
               "the host's waits in append included, mean and median; recall us@H2D: recall "
               "bytes per step / the pinned H2D bandwidth measured above, the time the recall "
               "needs if nothing overlaps it; check err: layer 0's largest relative error "
               "against the CPU state\n\n", L);
    }
    void *ptrs[] = {kc, vc, x.tk, x.tv, x.q, x.out, part};
    for (size_t i = 0; i < sizeof ptrs / sizeof *ptrs; i++)
        dev_free(&ptrs[i]);
    free(x.f);
    free(x.qh);
    return 0;
}

/* ---- Section: a device cache's KVCapsule prefill, with and without exact tiles ------------
 * kvcap_cache_add_span of one vision span at every layer, timed on the host (add_span returns
 * once the span is stored), on a fresh device cache per run, exact_tiles 0 and 1 taking turns.
 * With exact tiles each KV head's state is computed on the device in f32, with its points'
 * error sums; the sums come to the host, which picks the tiles, and the kept tiles' state
 * (converted into the storage dtype) and the picked tiles' rows are copied into the cache. */

struct prefill_job {
    const struct kvcap_model_geometry *g;
    const struct kvcap_artifact *a;
    int rows, cols;
    const void *k, *v; /* [kv_heads][n][d] in the benchmark's dtype, on the device */
    enum kvcap_dtype dtype;
};

/* Milliseconds to add the span at every layer of a new device cache with this config. */
static double prefill_once(const struct prefill_job *j, const char *config_yaml)
{
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = *j->g;
    p.storage = j->dtype;
    p.artifact = j->a;
    p.config_yaml = config_yaml;
    p.memory = KVCAP_MEMORY_CUDA;
    struct kvcap_cache *c = NULL;
    KV(kvcap_cache_create(&p, &c));
    int n = j->rows * j->cols, d = j->g->head_dim;
    struct kvcap_span_desc desc = {KVCAP_SPAN_VISION, n, j->rows, j->cols, 0};
    struct kvcap_tensor_view kv = {j->k, NULL, 0, j->dtype, (int64_t)n * d, d};
    struct kvcap_tensor_view vv = {j->v, NULL, 0, j->dtype, (int64_t)n * d, d};
    double t0 = kvcap_seconds();
    for (int l = 0; l < j->g->n_layers; l++)
        KV(kvcap_cache_add_span(c, 0, l, &desc, &kv, &vv));
    double ms = (kvcap_seconds() - t0) * 1e3;
    kvcap_cache_free(c);
    return ms;
}

static int section_prefill(struct bench *b)
{
    const struct opts *o = &b->o;
    const int L = o->layers_set ? o->layers : 28, H = o->kv_heads, d = o->d;
    const int rows = o->pf_rows, cols = o->pf_cols, n = rows * cols;
    struct kvcap_model_geometry g = {.name = "Qwen2.5-VL-7B (attention shape)", .n_layers = L,
                                     .n_q_heads = o->q_heads, .n_kv_heads = H, .head_dim = d,
                                     .rope_type = KVCAP_ROPE_ROPE,
                                     .rope_pairing = KVCAP_ROPE_PAIRING_HALF, .rope_theta = 1e6};
    struct kvcap_bucket bk = {rows, cols, KVCAP_STRUCTURE_TILED, o->tr, o->tc};
    if (rows % o->tr || cols % o->tc) {
        printf("KVCapsule prefill: skipped: the %dx%d grid is not a multiple of the %dx%d tile\n\n",
               rows, cols, o->tr, o->tc);
        return 0;
    }
    struct kvcap_artifact *a = NULL;
    KV(kvcap_bench_random_artifact(&g, &bk, o->ratio, &a));
    char cfg[2][160];
    for (int e = 0; e < 2; e++)
        snprintf(cfg[e], sizeof cfg[e],
                 "policies: {vision: kvcapsule, text: full, generated: full}\nfallback: full\n"
                 "kvcapsule: {exact_tiles: %d}\n", e);
    const size_t elems = (size_t)H * n * d, es = kvcap_dtype_size(o->dtype);
    void *k = dev_try(elems * es), *v = dev_try(elems * es);
    if (!k || !v) {
        fprintf(stderr, TOOL ": error: out of device memory for a %d-token span\n", n);
        return 1;
    }
    fill(b, k, o->dtype, elems, 11, -1.0f, 1.0f);
    fill(b, v, o->dtype, elems, 12, -1.0f, 1.0f);
    CU(cudaStreamSynchronize(b->s));
    struct prefill_job j = {&g, a, rows, cols, k, v, o->dtype};
    const int reps = o->reps;
    double *ms = xmalloc(sizeof *ms * 2 * (size_t)reps);
    for (int r = -o->warmup; r < reps; r++)
        for (int e = 0; e < 2; e++) { /* exact 0, exact 1: taking turns */
            double t = prefill_once(&j, cfg[e]);
            if (r >= 0)
                ms[(size_t)e * reps + r] = t;
        }
    double med[2];
    for (int e = 0; e < 2; e++)
        med[e] = cli_median(ms + (size_t)e * reps, reps);
    printf("KVCapsule prefill of a device cache: one %dx%d span (%d tokens) at each of %d layers, "
           "%d kv heads, d %d, %s, %dx%d tiles, random maps of rank %d\n",
           rows, cols, n, L, H, d, kvcap_dtype_name(o->dtype), o->tr, o->tc,
           kvcap_artifact_unit(a, 0, 0, 0)->rk);
    printf("  timed on the host (add_span returns with the span stored), a new cache per run, "
           "median of %d runs after %d warm-up, the two taking turns\n\n", reps, o->warmup);
    printf("  %-30s %10s %14s\n", "", "ms", "x no exact");
    printf("  %-30s %10.2f %14.2f\n", "exact_tiles 0", med[0], 1.0);
    printf("  %-30s %10.2f %14.2f\n\n", "exact_tiles 1", med[1], med[1] / med[0]);
    if (b->tsv)
        fprintf(b->tsv, "prefill\t%d\t%d\t%s\t%.4f\t%.4f\n", n, L, kvcap_dtype_name(o->dtype),
                med[0], med[1]);
    free(ms);
    void *ptrs[] = {k, v};
    for (size_t i = 0; i < sizeof ptrs / sizeof *ptrs; i++)
        dev_free(&ptrs[i]);
    kvcap_artifact_free(a);
    return 0;
}

/* ---- Sections, options, main ---------------------------------------------------------------- */

struct section {
    const char *name;
    int (*run)(struct bench *b);
};

static const struct section SECTIONS[] = {
    {"bandwidth", section_bandwidth},
    {"decode", section_decode},
    {"flashcache", section_flashcache},
    {"freekv", section_freekv},
    {"prefill", section_prefill},
};
#define N_SECTIONS ((int)(sizeof SECTIONS / sizeof *SECTIONS))

/* Comma-separated positive integers into out[0..*count). */
static int parse_list(const char *s, int *out, int *count)
{
    *count = 0;
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > (1L << 30) || *count == MAX_LIST)
            return 0;
        out[(*count)++] = (int)v;
        s = end;
        if (*s == ',')
            s++;
        else if (*s)
            return 0;
    }
    return *count > 0;
}

static int parse_sections(const char *s, unsigned *mask)
{
    *mask = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int found = 0;
        for (int i = 0; i < N_SECTIONS; i++)
            if (strcmp(tok, SECTIONS[i].name) == 0)
                *mask |= 1u << i, found = 1;
        if (!found)
            return 0;
    }
    return *mask != 0;
}

/* 0 with the device selected, or EXIT_SKIP with the reason printed. */
static int open_device(int device, struct cudaDeviceProp *prop)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        fprintf(stderr, TOOL ": no CUDA device (%s): nothing to measure\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0 devices");
        return EXIT_SKIP;
    }
    if (device >= count) {
        fprintf(stderr, TOOL ": error: --device %d, but there %s only %d CUDA device%s\n", device,
                count == 1 ? "is" : "are", count, count == 1 ? "" : "s");
        exit(2);
    }
    CU(cudaSetDevice(device));
    CU(cudaGetDeviceProperties(prop, device));
    return 0;
}

int main(int argc, char **argv)
{
    enum { DTYPE = 1000, HEADS, FC_TOKENS, REPS, WARMUP, WARM, NO_GRAPH, SECTIONS_OPT, FREEKV,
           FKV_CONTEXTS, FKV_STEPS, FKV_LAYER_US, TSV, DEVICE, PROBE, PF_GRID };
    static const struct option options[] = {
        {"dtype", required_argument, NULL, DTYPE},      {"layers", required_argument, NULL, 'l'},
        {"heads", required_argument, NULL, HEADS},      {"head-dim", required_argument, NULL, 'd'},
        {"contexts", required_argument, NULL, 'n'},     {"batches", required_argument, NULL, 'b'},
        {"tile", required_argument, NULL, 't'},         {"ratio", required_argument, NULL, 'r'},
        {"fc-tokens", required_argument, NULL, FC_TOKENS},
        {"reps", required_argument, NULL, REPS},        {"warmup", required_argument, NULL, WARMUP},
        {"warm", no_argument, NULL, WARM},              {"no-graph", no_argument, NULL, NO_GRAPH},
        {"sections", required_argument, NULL, SECTIONS_OPT},
        {"freekv", no_argument, NULL, FREEKV},          {"tsv", required_argument, NULL, TSV},
        {"freekv-contexts", required_argument, NULL, FKV_CONTEXTS},
        {"freekv-steps", required_argument, NULL, FKV_STEPS},
        {"freekv-layer-us", required_argument, NULL, FKV_LAYER_US},
        {"device", required_argument, NULL, DEVICE},    {"probe", no_argument, NULL, PROBE},
        {"prefill-grid", required_argument, NULL, PF_GRID},
        {"help", no_argument, NULL, 'h'},               {NULL, 0, NULL, 0}};
    struct bench b;
    memset(&b, 0, sizeof b);
    struct opts *o = &b.o;
    o->dtype = KVCAP_DTYPE_F16;
    o->layers = 1, o->q_heads = 28, o->kv_heads = 4, o->d = 128, o->tr = 4, o->tc = 4;
    o->ratio = 0.4, o->reps = 20, o->warmup = 3, o->graph = 1;
    o->sections = (1u << N_SECTIONS) - 1;
    parse_list("8192,16384,32768,65536,131072", o->contexts, &o->n_contexts);
    parse_list("1,8", o->batches, &o->n_batches);
    parse_list("2048,4096,8192", o->fc_tokens, &o->n_fc_tokens);
    parse_list("32768", o->fkv_contexts, &o->n_fkv_contexts);
    o->fkv_steps = 64;
    o->pf_rows = o->pf_cols = 32;
    int probe = 0, c;
    cli_init(TOOL, 0);
    while ((c = getopt_long(argc, argv, "l:d:n:b:t:r:h", options, NULL)) != -1) {
        switch (c) {
        case DTYPE:
            if (strcmp(optarg, "f16") == 0) o->dtype = KVCAP_DTYPE_F16;
            else if (strcmp(optarg, "bf16") == 0) o->dtype = KVCAP_DTYPE_BF16;
            else if (strcmp(optarg, "f32") == 0) o->dtype = KVCAP_DTYPE_F32;
            else return cli_usage_error("--dtype: '%s' is not f16, bf16 or f32", optarg);
            break;
        case 'l': o->layers = atoi(optarg), o->layers_set = 1; break;
        case HEADS:
            if (sscanf(optarg, "%dx%d", &o->q_heads, &o->kv_heads) != 2)
                return cli_usage_error("--heads: '%s' is not QxKV", optarg);
            break;
        case 'd': o->d = atoi(optarg); break;
        case 'n':
            if (!parse_list(optarg, o->contexts, &o->n_contexts))
                return cli_usage_error("--contexts: '%s' is not a list of positive integers",
                                       optarg);
            break;
        case 'b':
            if (!parse_list(optarg, o->batches, &o->n_batches))
                return cli_usage_error("--batches: '%s' is not a list of positive integers",
                                       optarg);
            break;
        case FC_TOKENS:
            if (!parse_list(optarg, o->fc_tokens, &o->n_fc_tokens))
                return cli_usage_error("--fc-tokens: '%s' is not a list of positive integers",
                                       optarg);
            break;
        case 't':
            if (sscanf(optarg, "%dx%d", &o->tr, &o->tc) != 2 || o->tr < 1 || o->tc < 1)
                return cli_usage_error("--tile: '%s' is not RxC", optarg);
            break;
        case PF_GRID:
            if (sscanf(optarg, "%dx%d", &o->pf_rows, &o->pf_cols) != 2 || o->pf_rows < 1 ||
                o->pf_cols < 1 || o->pf_rows > 4096 || o->pf_cols > 4096)
                return cli_usage_error("--prefill-grid: '%s' is not RxC (1..4096 each)", optarg);
            break;
        case 'r': o->ratio = atof(optarg); break;
        case REPS: o->reps = atoi(optarg); break;
        case WARMUP: o->warmup = atoi(optarg); break;
        case WARM: o->warm = 1; break;
        case NO_GRAPH: o->graph = 0; break;
        case SECTIONS_OPT:
            if (!parse_sections(optarg, &o->sections))
                return cli_usage_error("--sections: '%s' is not a list of bandwidth, decode, "
                                       "flashcache, freekv, prefill", optarg);
            break;
        case FREEKV: o->freekv = 1; break;
        case FKV_CONTEXTS:
            if (!parse_list(optarg, o->fkv_contexts, &o->n_fkv_contexts))
                return cli_usage_error("--freekv-contexts: '%s' is not a list of positive "
                                       "integers", optarg);
            break;
        case FKV_STEPS: o->fkv_steps = atoi(optarg); break;
        case FKV_LAYER_US: {
            char *end;
            o->fkv_layer_us = strtod(optarg, &end);
            if (end == optarg || *end || !(o->fkv_layer_us >= 0 && o->fkv_layer_us <= 1e6))
                return cli_usage_error("--freekv-layer-us: '%s' is not a number of microseconds "
                                       "in 0..1e6", optarg);
            break;
        }
        case TSV: o->tsv = optarg; break;
        case DEVICE: o->device = atoi(optarg); break;
        case PROBE: probe = 1; break;
        case 'h': usage(stdout); return 0;
        default: return cli_usage_error("unknown option");
        }
    }
    if (optind < argc)
        return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (o->layers < 1 || o->reps < 1 || o->warmup < 0 || o->device < 0 ||
        !(o->ratio > 0 && o->ratio <= 1) || o->fkv_steps < 1 || o->fkv_steps > 100000)
        return cli_usage_error("--layers and --reps >= 1, --warmup and --device >= 0, --ratio "
                               "in (0, 1], --freekv-steps in 1..100000");
    if (o->q_heads < 1 || o->kv_heads < 1 || o->q_heads % o->kv_heads != 0 ||
        o->q_heads / o->kv_heads > KVCAP_CUDA_ATTN_MAX_NQ)
        return cli_usage_error("--heads %dx%d: KV heads must divide query heads, at most %d "
                               "query heads per KV head", o->q_heads, o->kv_heads,
                               KVCAP_CUDA_ATTN_MAX_NQ);
    if (o->d % 8 != 0 || o->d < KVCAP_CUDA_ATTN_MIN_D || o->d > KVCAP_CUDA_ATTN_MAX_D)
        return cli_usage_error("--head-dim %d: a multiple of 8 in %d..%d", o->d,
                               KVCAP_CUDA_ATTN_MIN_D, KVCAP_CUDA_ATTN_MAX_D);
    for (int i = 0; i < o->n_contexts; i++)
        if (o->contexts[i] % (o->tr * o->tc) != 0)
            return cli_usage_error("--contexts: %d is not a multiple of the tile's %d points",
                                   o->contexts[i], o->tr * o->tc);

    for (int i = 0; o->freekv && i < N_SECTIONS; i++)
        if (strcmp(SECTIONS[i].name, "freekv") == 0)
            o->sections |= 1u << i;
    int rc = open_device(o->device, &b.prop);
    if (rc)
        return rc;
    int rt = 0, drv = 0;
    CU(cudaRuntimeGetVersion(&rt));
    CU(cudaDriverGetVersion(&drv));
    size_t free_b = 0, total_b = 0;
    CU(cudaMemGetInfo(&free_b, &total_b));
    printf("kvcap GPU benchmark on device %d: %s (sm_%d%d, %d SMs, %.1f GiB, %d MiB L2), CUDA "
           "runtime %d.%d, driver %d.%d\n",
           o->device, b.prop.name, b.prop.major, b.prop.minor, b.prop.multiProcessorCount,
           total_b / 1073741824.0, b.prop.l2CacheSize >> 20, rt / 1000, rt % 1000 / 10,
           drv / 1000, drv % 1000 / 10);
    if (probe)
        return 0;

    CU(cudaStreamCreateWithFlags(&b.s, cudaStreamNonBlocking));
    b.side = xmalloc(sizeof *b.side * (size_t)o->kv_heads);
    b.join = xmalloc(sizeof *b.join * (size_t)o->kv_heads);
    CU(cudaEventCreateWithFlags(&b.fork, cudaEventDisableTiming));
    for (int h = 0; h < o->kv_heads; h++) {
        CU(cudaStreamCreateWithFlags(&b.side[h], cudaStreamNonBlocking));
        CU(cudaEventCreateWithFlags(&b.join[h], cudaEventDisableTiming));
    }
    b.flush_bytes = 2 * (size_t)(b.prop.l2CacheSize > 0 ? b.prop.l2CacheSize : 64 << 20);
    b.flush_bytes = (b.flush_bytes + 15) / 16 * 16;
    b.flush = dev_try(b.flush_bytes);
    b.sink = dev_try(sizeof *b.sink);
    if (!b.flush || !b.sink) {
        fprintf(stderr, TOOL ": error: cannot allocate the %zu MiB L2 flush buffer\n",
                b.flush_bytes >> 20);
        return 1;
    }
    fill(&b, b.flush, KVCAP_DTYPE_F32, b.flush_bytes / 4, 99, 0.0f, 1.0f);
    if (o->tsv && !(b.tsv = fopen(o->tsv, "w"))) {
        fprintf(stderr, TOOL ": error: %s: cannot write\n", o->tsv);
        return 1;
    }
    printf("timing: CUDA events around each run (%s), median of %d runs after %d warm-up "
           "run%s; %s\n",
           o->graph ? "one CUDA graph launch of the run's calls" : "the calls enqueued directly",
           o->reps, o->warmup, o->warmup == 1 ? "" : "s",
           o->warm ? "L2 left warm (10 runs per event pair)"
                   : "L2 flushed before every run by an untimed read of twice its size");
    printf("bandwidth convention: GB/s = bytes READ / time (1 GB = 1e9 B); for the copy, the "
           "bytes copied (each read once, written once)\n\n");
    fflush(stdout);

    /* The copy bandwidth is every other section's reference: it always runs first. */
    rc = section_bandwidth(&b);
    for (int i = 1; rc == 0 && i < N_SECTIONS; i++)
        if (o->sections & (1u << i)) {
            fflush(stdout);
            rc = SECTIONS[i].run(&b);
        }
    if (b.tsv)
        fclose(b.tsv);
    return rc;
}
