/* test_flashcache_cuda.c — FlashCache's device scoring (kernels/cuda/flashcache_cuda.h) against the
 * CPU. First the argument checks, which need no device; then, with a device: deviations and
 * energies of (layer, head) batches in F32, F16 and BF16 against kvcap_flashcache_deviation_ref
 * (n from 1 to 8192: powers of two, primes, 100; ω at both band edges; strided per-layer
 * buffers with NaN in every gap; outputs and scratch poisoned with NaN; more layers and heads
 * than one launch takes), bit-identical reruns, and planted outliers found end to end through
 * the device top-k (tests/test_select_cuda.c tests that op on its own).
 * Without a device (or without CUDA in the build) it reports itself skipped (exit 77). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/cuda/flashcache_cuda.h"
#include "kernels/cuda/select_cuda.h"
#include "kernels/flashcache.h"
#include "common/rng.h"
#include "common/dtype.h"
#include "kernels/select.h"
#include "tests/test_cuda.h"
#include "tests/test_numeric.h"

/* Argument errors are caught before anything touches a device; the build without CUDA answers
 * every call with "unsupported" instead. */
#ifdef KVCAP_WITH_CUDA
#define ARG_STATUS KVCAP_ERR_INVALID_ARGUMENT
#else
#define ARG_STATUS KVCAP_ERR_UNSUPPORTED
#endif

/* ---- Tolerances, and why ----------------------------------------------------------------------
 * Deviation per token, as a fraction of that token's scale s_j = (mean over the pair of
 * (k² + v²)/d) + (its own (k² + v²)/d): cuFFT works in f32 like the CPU's KissFFT path, whose
 * deviations are within 7e-7 of the double oracle for n <= 1009 (tests/test_flashcache.c); the
 * rounding of an f32 FFT grows like log2 n (×1.3 from 1009 to 8192), and an error of the Base is
 * spread over the column, so a token's error scales with √(its energy × the column's): s_j bounds
 * both. A wrong twiddle, scale, band edge or Makhoul order moves deviations by O(s_j). */
#define DEV_TOL 1e-5
/* Low-band energy, as a fraction of the pair's total energy (so it bounds the error of
 * R = 1 − low/total directly): twice the f32 coefficients' relative error (CPU measured ≤ 2.5e-7),
 * with the log2 n growth above. A wrong s_k (1/n vs 2/n) or a coefficient counted twice moves
 * it by >= 1e-3 on this data. */
#define ENERGY_TOL 1e-5
/* Total energy: the same f32 values squared and summed in double, in another order. */
#define TOTAL_REL_TOL 1e-12

#define PI 3.14159265358979323846

/* ---- Argument checks (no device) ------------------------------------------------------------- */

static void test_arguments(void **state)
{
    (void)state;
    struct kvcap_cuda_dct *plan = (struct kvcap_cuda_dct *)&plan; /* must come back NULL */
    assert_int_equal(kvcap_cuda_dct_create(0, 64, 1, &plan), ARG_STATUS);
    assert_null(plan);
#ifdef KVCAP_WITH_CUDA
    assert_non_null(strstr(kvcap_last_error(), "n = 0"));
#endif
    assert_int_equal(kvcap_cuda_dct_create(64, 0, 1, &plan), ARG_STATUS);
    assert_int_equal(kvcap_cuda_dct_create(64, 64, 0, &plan), ARG_STATUS);
    assert_int_equal(kvcap_cuda_dct_create(64, 64, 1, NULL), ARG_STATUS);
    assert_int_equal(kvcap_cuda_dct_create(1 << 30, 1 << 30, 1 << 30, &plan), ARG_STATUS);
    kvcap_cuda_dct_free(NULL);
    assert_int_equal(kvcap_cuda_flashcache_scratch_bytes(NULL), 0);

    float x = 0;
    struct kvcap_energy e;
    const void *ptr[1] = {&x};
    struct kvcap_cuda_kv kv = {ptr, ptr, KVCAP_DTYPE_F32, 64, 64 * 64, 1, 1};
    assert_int_equal(kvcap_cuda_flashcache_deviation(NULL, &kv, 1, &x, &e, &x, 1 << 20, NULL),
                     ARG_STATUS);
#ifdef KVCAP_WITH_CUDA
    assert_non_null(strstr(kvcap_last_error(), "plan is NULL"));
#endif
}

#ifdef KVCAP_WITH_CUDA

/* Without a device a plan cannot be made: "unsupported", naming why (cuFFT missing or no device),
 * never a crash. */
static void test_no_device(void **state)
{
    (void)state;
    struct kvcap_cuda_dct *plan = NULL;
    assert_int_equal(kvcap_cuda_dct_create(64, 64, 2, &plan), KVCAP_ERR_UNSUPPORTED);
    assert_null(plan);
    const char *msg = kvcap_last_error();
    assert_true(strstr(msg, "libcufft") || strstr(msg, "no CUDA device"));
    assert_int_equal(kvcap_cuda_dct_create(1, 64, 2, &plan), KVCAP_ERR_UNSUPPORTED);
}

/* ---- Spans ----------------------------------------------------------------------------------- */

enum fill {
    RANDOM,  /* normal, K with a mean offset (a DC term) */
    OUTLIERS /* a few low DCT modes plus small noise; P tokens per pair get large spikes */
};

#define N_OUTLIERS 10

/* L layers × H heads of n tokens × d channels stored as dt, one device buffer per layer with
 * `lead` NaN rows before token 0, NaN in the row padding and between heads; k, v hold the
 * stored values back in f32 ([L][H][n][d]), which is what the oracle sees. */
struct span {
    int L, H, n, d;
    enum kvcap_dtype dt;
    size_t row_stride, head_stride;
    float *k, *v;
    void **buf;        /* [2L] device buffers: K of each layer, then V */
    const void **ptr;  /* [2L] pointers to token 0 of head 0: K of each layer, then V */
    int *outlier;      /* [L·H][N_OUTLIERS] sorted, OUTLIERS only */
};

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

static void fill_pair(struct kvcap_rng *r, enum fill f, int n, int d, float *k, float *v,
                      int *outlier)
{
    if (f == RANDOM) {
        for (size_t i = 0; i < (size_t)n * d; i++) {
            k[i] = (float)(0.3 + kvcap_rng_normal(r));
            v[i] = (float)kvcap_rng_normal(r);
        }
        return;
    }
    float *m[2] = {k, v};
    for (int t = 0; t < 2; t++)
        for (int c = 0; c < d; c++) {
            double a[4];
            for (int q = 0; q < 4; q++)
                a[q] = kvcap_rng_normal(r);
            for (int j = 0; j < n; j++) {
                double x = 0.02 * kvcap_rng_normal(r);
                for (int q = 0; q < 4; q++)
                    x += a[q] * cos(PI * (2 * j + 1) * q / (2.0 * n));
                m[t][(size_t)j * d + c] = (float)x;
            }
        }
    /* distinct tokens, spiked in every channel of K and V */
    for (int o = 0; o < N_OUTLIERS; o++) {
        int j, dup;
        do {
            j = (int)kvcap_rng_below(r, (uint64_t)n);
            dup = 0;
            for (int p = 0; p < o; p++)
                dup |= outlier[p] == j;
        } while (dup);
        outlier[o] = j;
        for (int c = 0; c < d; c++) {
            k[(size_t)j * d + c] += kvcap_rng_below(r, 2) ? 4.0f : -4.0f;
            v[(size_t)j * d + c] += kvcap_rng_below(r, 2) ? 4.0f : -4.0f;
        }
    }
    qsort(outlier, N_OUTLIERS, sizeof *outlier, cmp_int);
}

static void span_make(struct span *s, struct kvcap_rng *r, int L, int H, int n, int d,
                      enum kvcap_dtype dt, enum fill f)
{
    const size_t lead = 2, es = kvcap_dtype_size(dt);
    s->L = L, s->H = H, s->n = n, s->d = d, s->dt = dt;
    s->row_stride = (size_t)d + 3;
    s->head_stride = (size_t)n * s->row_stride + 5;
    const size_t per_layer = lead * s->row_stride + (size_t)H * s->head_stride;
    const size_t pair = (size_t)n * d;
    s->k = alloc_f((size_t)L * H * pair);
    s->v = alloc_f((size_t)L * H * pair);
    s->buf = calloc(2 * (size_t)L, sizeof *s->buf);
    s->ptr = calloc(2 * (size_t)L, sizeof *s->ptr);
    s->outlier = calloc((size_t)L * H * N_OUTLIERS, sizeof *s->outlier);
    float *stage = malloc(sizeof(float) * per_layer);
    unsigned char *raw = malloc(es * per_layer);
    assert_true(s->buf && s->ptr && s->outlier && stage && raw);
    for (int l = 0; l < L; l++) {
        for (int h = 0; h < H; h++) {
            size_t b = (size_t)l * H + h;
            fill_pair(r, f, n, d, s->k + b * pair, s->v + b * pair, s->outlier + b * N_OUTLIERS);
        }
        for (int t = 0; t < 2; t++) {
            float *src = t ? s->v : s->k;
            for (size_t i = 0; i < per_layer; i++)
                stage[i] = NAN;
            for (int h = 0; h < H; h++)
                for (int j = 0; j < n; j++)
                    memcpy(stage + lead * s->row_stride + h * s->head_stride + j * s->row_stride,
                           src + (((size_t)l * H + h) * n + j) * d, sizeof(float) * d);
            assert_int_equal(kvcap_convert_from_f32(dt, stage, per_layer, raw), KVCAP_OK);
            assert_int_equal(kvcap_convert_to_f32(dt, raw, per_layer, stage), KVCAP_OK);
            for (int h = 0; h < H; h++) /* what the device will read, in f32 */
                for (int j = 0; j < n; j++)
                    memcpy(src + (((size_t)l * H + h) * n + j) * d,
                           stage + lead * s->row_stride + h * s->head_stride + j * s->row_stride,
                           sizeof(float) * d);
            void *dbuf = dalloc(es * per_layer);
            upload(dbuf, raw, es * per_layer);
            s->buf[t * L + l] = dbuf;
            s->ptr[t * L + l] = (const unsigned char *)dbuf + lead * s->row_stride * es;
        }
    }
    free(stage);
    free(raw);
}

static void span_free(struct span *s)
{
    for (int i = 0; i < 2 * s->L; i++)
        cudaFree(s->buf[i]);
    free(s->buf), free(s->ptr), free(s->k), free(s->v), free(s->outlier);
}

static struct kvcap_cuda_kv span_kv(const struct span *s)
{
    struct kvcap_cuda_kv kv = {s->ptr, s->ptr + s->L, s->dt, s->row_stride, s->head_stride,
                               s->L, s->H};
    return kv;
}

/* ---- Deviation ------------------------------------------------------------------------------- */

struct dev_out {
    float *dev;                  /* host [batch][n] */
    struct kvcap_energy *energy; /* host [batch] */
};

/* One device call on a fresh stream, with dev, energy and scratch poisoned and the scratch
 * handed at an odd offset (the layout must align itself). */
static struct dev_out run_device(struct kvcap_cuda_dct *plan, const struct span *s, int omega)
{
    const size_t batch = (size_t)s->L * s->H, bytes = kvcap_cuda_flashcache_scratch_bytes(plan);
    assert_true(bytes > 0);
    unsigned char *scratch = dalloc(bytes + 8);
    float *ddev = dalloc(sizeof(float) * batch * s->n);
    struct kvcap_energy *den = dalloc(sizeof *den * batch);
    poison(scratch, bytes + 8);
    poison(ddev, sizeof(float) * batch * s->n);
    poison(den, sizeof *den * batch);
    cudaStream_t st;
    assert_int_equal(cudaStreamCreate(&st), cudaSuccess);
    struct kvcap_cuda_kv kv = span_kv(s);
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, &kv, omega, ddev, den, scratch + 8,
                                                     bytes, st),
                     KVCAP_OK);
    sync_ok(st);
    struct dev_out o = {alloc_f(batch * s->n), malloc(sizeof *o.energy * batch)};
    assert_non_null(o.energy);
    download(o.dev, ddev, sizeof(float) * batch * s->n);
    download(o.energy, den, sizeof *den * batch);
    cudaStreamDestroy(st);
    cudaFree(scratch), cudaFree(ddev), cudaFree(den);
    return o;
}

static void dev_out_free(struct dev_out *o)
{
    free(o->dev), free(o->energy);
}

static void compare_pair(const struct span *s, size_t b, int omega, const float *dev,
                         const struct kvcap_energy *e)
{
    const int n = s->n, d = s->d;
    const size_t pair = (size_t)n * d;
    const float *k = s->k + b * pair, *v = s->v + b * pair;
    float *want = alloc_f((size_t)n);
    struct kvcap_energy w = {0, 0, 0, 0};
    kvcap_flashcache_deviation_ref(n, k, v, d, omega, want, &w);
    double mean = 0;
    for (size_t i = 0; i < pair; i++)
        mean += (double)k[i] * k[i] + (double)v[i] * v[i];
    mean /= (double)pair;
    for (int j = 0; j < n; j++) {
        double own = 0;
        for (int c = 0; c < d; c++)
            own += (double)k[(size_t)j * d + c] * k[(size_t)j * d + c] +
                   (double)v[(size_t)j * d + c] * v[(size_t)j * d + c];
        double scale = mean + own / d;
        if (!isfinite(dev[j]) || fabs((double)dev[j] - want[j]) > DEV_TOL * scale)
            fail_msg("n = %d, omega = %d, pair %zu, token %d: dev %.9g, oracle %.9g (scale %.3g)",
                     n, omega, b, j, (double)dev[j], (double)want[j], scale);
    }
    double tk = fabs(e->k_total - w.k_total) / w.k_total;
    double tv = fabs(e->v_total - w.v_total) / w.v_total;
    if (!(tk <= TOTAL_REL_TOL && tv <= TOTAL_REL_TOL))
        fail_msg("n = %d, pair %zu: totals %.17g %.17g, oracle %.17g %.17g", n, b, e->k_total,
                 e->v_total, w.k_total, w.v_total);
    double lk = fabs(e->k_low - w.k_low) / w.k_total, lv = fabs(e->v_low - w.v_low) / w.v_total;
    if (!(lk <= ENERGY_TOL && lv <= ENERGY_TOL))
        fail_msg("n = %d, omega = %d, pair %zu: low %.9g %.9g, oracle %.9g %.9g", n, omega, b,
                 e->k_low, e->v_low, w.k_low, w.v_low);
    free(want);
}

struct dev_case {
    int n, d, L, H;
    enum kvcap_dtype dt;
    int omega; /* < 0: ⌈0.1 n⌉, the default γ */
};

static void run_case(const struct dev_case *c, uint64_t seed)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, seed);
    struct span s;
    span_make(&s, &r, c->L, c->H, c->n, c->d, c->dt, RANDOM);
    const int omega = c->omega < 0 ? kvcap_flashcache_omega(0.1, c->n) : c->omega;
    struct kvcap_cuda_dct *plan = NULL;
    assert_int_equal(kvcap_cuda_dct_create(c->n, c->d, c->L * c->H, &plan), KVCAP_OK);
    struct dev_out a = run_device(plan, &s, omega);
    for (size_t b = 0; b < (size_t)c->L * c->H; b++)
        compare_pair(&s, b, omega, a.dev + b * c->n, &a.energy[b]);
    /* deterministic: a second run gives the same bits */
    struct dev_out again = run_device(plan, &s, omega);
    assert_memory_equal(a.dev, again.dev, sizeof(float) * (size_t)c->L * c->H * c->n);
    assert_memory_equal(a.energy, again.energy, sizeof *a.energy * (size_t)c->L * c->H);
    dev_out_free(&a), dev_out_free(&again);
    kvcap_cuda_dct_free(plan);
    span_free(&s);
}

static void test_deviation_small(void **state)
{
    (void)state;
    static const struct dev_case cases[] = {
        {1, 64, 2, 2, KVCAP_DTYPE_F32, 1},    /* no transform: Base = x */
        {1, 64, 1, 1, KVCAP_DTYPE_BF16, 0},   /* no transform, empty band: Base = 0 */
        {2, 64, 1, 2, KVCAP_DTYPE_F16, -1},
        {7, 64, 2, 3, KVCAP_DTYPE_BF16, -1},  /* prime */
        {100, 64, 3, 2, KVCAP_DTYPE_F32, -1},
        {100, 64, 3, 2, KVCAP_DTYPE_F16, -1},
        {100, 64, 3, 2, KVCAP_DTYPE_BF16, -1},
        {100, 128, 1, 1, KVCAP_DTYPE_F32, 0}, /* Base = 0: dev = mean of squares */
        {100, 128, 1, 1, KVCAP_DTYPE_F32, 100}, /* Base = x: dev ≈ 0 */
        {101, 128, 1, 2, KVCAP_DTYPE_F32, 51},  /* odd n, ω past n/2: rows n−k kept too */
        {128, 80, 2, 1, KVCAP_DTYPE_BF16, 64},  /* even n, ω = n/2 */
        {128, 80, 2, 1, KVCAP_DTYPE_F16, 65},   /* ω = n/2 + 1: the self-paired row k = n/2 */
        {16, 8, 130, 1, KVCAP_DTYPE_F32, -1},   /* more layers than one launch takes */
        {3, 1, 2, 40000, KVCAP_DTYPE_BF16, 2},  /* more pairs than gridDim.y: a launch per layer */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        run_case(&cases[i], 100 + i);
}

static void test_deviation_large(void **state)
{
    (void)state;
    static const struct dev_case cases[] = {
        {2048, 128, 2, 2, KVCAP_DTYPE_BF16, -1},
        {2048, 64, 1, 1, KVCAP_DTYPE_F32, 1024},
        {2048, 64, 1, 1, KVCAP_DTYPE_F32, 1025},
        {4096, 64, 2, 1, KVCAP_DTYPE_F16, -1},
        {6000, 128, 1, 1, KVCAP_DTYPE_F32, -1},  /* not a power of two */
        {8191, 64, 1, 1, KVCAP_DTYPE_F16, -1},   /* prime: cuFFT's own Bluestein path */
        {8192, 128, 1, 1, KVCAP_DTYPE_BF16, -1}, /* the target size */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        run_case(&cases[i], 200 + i);
}

static void test_deviation_arguments(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 7);
    struct span s;
    span_make(&s, &r, 2, 2, 64, 64, KVCAP_DTYPE_F32, RANDOM);
    struct kvcap_cuda_dct *plan = NULL;
    assert_int_equal(kvcap_cuda_dct_create(64, 64, 4, &plan), KVCAP_OK);
    const size_t bytes = kvcap_cuda_flashcache_scratch_bytes(plan);
    void *scratch = dalloc(bytes);
    float *dev = dalloc(sizeof(float) * 4 * 64);
    struct kvcap_energy *en = dalloc(sizeof *en * 4);
    struct kvcap_cuda_kv kv = span_kv(&s);
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, NULL, 6, dev, en, scratch, bytes, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    struct kvcap_cuda_kv bad = kv;
    bad.n_heads = 1; /* 2 × 1 pairs for a plan of 4 */
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, &bad, 6, dev, en, scratch, bytes, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "batch = 4"));
    bad = kv;
    bad.dtype = KVCAP_DTYPE_I32;
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, &bad, 6, dev, en, scratch, bytes, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    bad = kv;
    bad.row_stride = 63;
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, &bad, 6, dev, en, scratch, bytes, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    const void *holes[4] = {s.ptr[0], NULL, s.ptr[2], s.ptr[3]};
    bad = kv;
    bad.k = holes;
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, &bad, 6, dev, en, scratch, bytes, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "kv->k[1]"));
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, &kv, 6, NULL, en, scratch, bytes, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, &kv, 6, dev, NULL, scratch, bytes, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, &kv, 6, dev, en, NULL, bytes, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, &kv, 6, dev, en, scratch, bytes - 1,
                                                     NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "scratch_bytes"));
    assert_int_equal(kvcap_cuda_flashcache_deviation(plan, &kv, 6, dev, en, scratch, bytes, NULL),
                     KVCAP_OK);
    sync_ok(NULL);
    kvcap_cuda_dct_free(plan);
    cudaFree(scratch), cudaFree(dev), cudaFree(en);
    span_free(&s);
}

/* ---- End to end: planted outliers ------------------------------------------------------------ */

/* Smooth K/V with N_OUTLIERS spiked tokens per pair: the device deviations, then the device
 * top-k, must find exactly the planted tokens, and agree with the CPU top-k on the same scores. */
static void test_outliers(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 23);
    const int L = 2, H = 2, n = 1000, d = 128, batch = L * H;
    struct span s;
    span_make(&s, &r, L, H, n, d, KVCAP_DTYPE_BF16, OUTLIERS);
    struct kvcap_cuda_dct *plan = NULL;
    assert_int_equal(kvcap_cuda_dct_create(n, d, batch, &plan), KVCAP_OK);
    const int omega = kvcap_flashcache_omega(0.1, n);
    struct dev_out o = run_device(plan, &s, omega);
    for (int b = 0; b < batch; b++)
        compare_pair(&s, (size_t)b, omega, o.dev + (size_t)b * n, &o.energy[b]);

    float *ddev = dalloc(sizeof(float) * batch * n);
    int *didx = dalloc(sizeof(int) * batch * N_OUTLIERS);
    upload(ddev, o.dev, sizeof(float) * batch * n);
    assert_int_equal(kvcap_cuda_topk(ddev, (size_t)n, n, batch, N_OUTLIERS, NULL, didx, N_OUTLIERS,
                                     NULL),
                     KVCAP_OK);
    sync_ok(NULL);
    int got[4 * N_OUTLIERS], want[N_OUTLIERS], work[1000];
    download(got, didx, sizeof got);
    for (int b = 0; b < batch; b++) {
        assert_memory_equal(got + b * N_OUTLIERS, s.outlier + b * N_OUTLIERS, sizeof want);
        assert_int_equal(kvcap_topk_indices(o.dev + (size_t)b * n, n, N_OUTLIERS, want, work),
                         N_OUTLIERS);
        assert_memory_equal(got + b * N_OUTLIERS, want, sizeof want);
    }
    cudaFree(ddev), cudaFree(didx);
    dev_out_free(&o);
    kvcap_cuda_dct_free(plan);
    span_free(&s);
}

#endif /* KVCAP_WITH_CUDA */

int main(void)
{
    const struct CMUnitTest host_tests[] = {
        cmocka_unit_test(test_arguments),
#ifdef KVCAP_WITH_CUDA
        cmocka_unit_test(test_no_device),
#endif
    };
    int status = RUN_WITHOUT_DEVICE(host_tests); /* the no-device expectations hold only here */
    if (status >= 0)
        return status;
#ifdef KVCAP_WITH_CUDA
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arguments),
        cmocka_unit_test(test_deviation_arguments),
        cmocka_unit_test(test_deviation_small),
        cmocka_unit_test(test_outliers),
        cmocka_unit_test(test_deviation_large),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#else
    return 1; /* a build without CUDA reports no device */
#endif
}
