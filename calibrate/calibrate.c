/* calibrate.c — kvcap_calibrate(): stream the dataset once, accumulating per (layer, KV head,
 * bucket) the Grams of centred values and offset-free keys over the training split (batched
 * dsyrk in double, on the CPU or a CUDA device), fit value bases and key maps, optionally train
 * the key maps (on the same device), and measure the fit on the validation split. */
#include <cblas.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "calibrate/calibrate.h"
#include "common/internal.h"
#include "common/rng.h"
#include "kernels/rope.h"

void kvcap_calibrate_default_options(struct kvcap_calibrate_options *o)
{
    memset(o, 0, sizeof *o);
    o->max_train_spans = 64;
    o->max_val_spans = 32;
}

int kvcap_span_is_validation(const struct kvcap_span_view *span, double fraction, uint64_t seed)
{
    if (!(fraction > 0))
        return 0;
    /* Keyed by what rounding cannot change: the grid, p0 and, for the first rows of layer 0,
     * head 0, which channel has the largest magnitude. The bytes themselves differ between
     * machines (the engine's BLAS kernels round differently), and hashing them moved spans
     * across the split, which changed the fit more than any rounding in the Grams did. */
    uint64_t h = 0xcbf29ce484222325ull ^ seed; /* FNV-1a */
    const struct kvst_tensor *k = span->k[0];
    const int d = k->ndim == 3 ? (int)k->shape[2] : 0;
    const int rows = span->n < 32 ? span->n : 32;
    int32_t key[3 + 32] = {span->rows, span->cols, span->p0};
    float row[512]; /* head_dim is at most 256 (DESIGN §9) */
    for (int r = 0; d > 0 && d <= 512 && r < rows; r++) {
        const size_t es = kvcap_dtype_size(k->dtype);
        int best = 0;
        if (kvcap_convert_to_f32(k->dtype, (const char *)k->data + (size_t)r * d * es, (size_t)d,
                                 row) == KVCAP_OK)
            for (int c = 1; c < d; c++)
                best = fabsf(row[c]) > fabsf(row[best]) ? c : best;
        key[3 + r] = best;
    }
    const unsigned char *p = (const unsigned char *)key;
    for (size_t i = 0; i < sizeof(int32_t) * (3 + (size_t)rows); i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    uint64_t x = h;
    return (double)(kvcap_splitmix64(&x) >> 11) * 0x1.0p-53 < fraction;
}

/* ---- Loading one head of one span --------------------------------------------------------- */

/* Converts head h of a [heads][rows][d] tensor to f32, refusing NaN/Inf with a named error. */
static enum kvcap_status load_rows(const struct kvcap_span_view *s, const struct kvst_tensor *t,
                                   int h, size_t rows, size_t d, float *out)
{
    size_t count = rows * d, esize = kvcap_dtype_size(t->dtype);
    const unsigned char *src = (const unsigned char *)t->data + (size_t)h * count * esize;
    KVCAP_TRY(kvcap_convert_to_f32(t->dtype, src, count, out));
    for (size_t i = 0; i < count; i++)
        KVCAP_RETURN_IF(!isfinite(out[i]), KVCAP_ERR_NUMERIC,
                        "%s: tensor '%s': non-finite value %g at head %d, row %zu, channel %zu",
                        s->shard, t->name, out[i], h, i / d, i % d);
    return KVCAP_OK;
}

/* Offset-free keys K' = R(-p0) K and centred values Vc = V - 1 mu^T of KV head h, layer l. */
static enum kvcap_status load_head(const struct kvcap_span_view *s,
                                   const struct kvcap_model_geometry *g, int l, int h, float *kf,
                                   float *vc, float *mu)
{
    size_t n = (size_t)s->n, d = (size_t)g->head_dim;
    KVCAP_TRY(load_rows(s, s->k[l], h, n, d, kf));
    kvcap_rope_rotate(g, kf, n, d, -(double)s->p0);
    KVCAP_TRY(load_rows(s, s->v[l], h, n, d, vc));
    for (size_t c = 0; c < d; c++) {
        double sum = 0.0;
        for (size_t j = 0; j < n; j++)
            sum += vc[j * d + c];
        mu[c] = (float)(sum / (double)n);
    }
    for (size_t j = 0; j < n; j++)
        for (size_t c = 0; c < d; c++)
            vc[j * d + c] -= mu[c];
    return KVCAP_OK;
}

/* Columns one span contributes to a unit: d for dense, d per tile for tiled. */
static int span_columns(const struct kvcap_bucket *b, int d)
{
    return d * (b->rows * b->cols / kvcap_bucket_points(b));
}

/* Lays an n x d token-major head out as the unit's m x (tiles·d) sample matrix, starting at
 * column col0 of a buffer with leading dimension ld (double or float destination). */
#define DEFINE_PLACE(fn, T)                                                                  \
    static void fn(const struct kvcap_bucket *b, const float *x, int d, T *buf, size_t ld,   \
                   size_t col0)                                                              \
    {                                                                                        \
        int m = kvcap_bucket_points(b), tiles = b->rows * b->cols / m;                       \
        for (int t = 0; t < tiles; t++)                                                      \
            for (int p = 0; p < m; p++) {                                                    \
                const float *src = x + kvcap_bucket_token(b, t, p) * (size_t)d;                        \
                T *dst = buf + (size_t)p * ld + col0 + (size_t)t * d;                        \
                for (int c = 0; c < d; c++)                                                  \
                    dst[c] = (T)src[c];                                                      \
            }                                                                                \
    }
DEFINE_PLACE(place_double, double)
DEFINE_PLACE(place_float, float)

/* The inverse of place_float for one span (columns 0..tiles·d). */
static void unplace(const struct kvcap_bucket *b, const float *buf, size_t ld, int d, float *x)
{
    int m = kvcap_bucket_points(b), tiles = b->rows * b->cols / m;
    for (int t = 0; t < tiles; t++)
        for (int p = 0; p < m; p++)
            memcpy(x + kvcap_bucket_token(b, t, p) * (size_t)d, buf + (size_t)p * ld + (size_t)t * d,
                   sizeof(float) * (size_t)d);
}

/* ---- Accumulation ------------------------------------------------------------------------- */

struct accumulator {
    double *kbuf, *vbuf; /* [m][cap] pending columns (pinned and owned by the GPU accumulator
                          * on the CUDA path, else malloc'd) */
    size_t cols, cap;
    float *train;        /* trained path: [m][train_cap] offset-free key columns */
    size_t train_cols, train_cap;
    int train_spans;
};

static int omp_thread(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static int omp_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Adds unit i's pending columns to its Grams: the only step that differs between the CPU and
 * the CUDA path (gpu non-NULL), which fill the same batch buffers the same way. */
static enum kvcap_status flush(struct kvcap_calib_cuda_gram *gpu, size_t i,
                               struct kvcap_calib_unit *u, struct accumulator *a, double *flops)
{
    if (a->cols == 0)
        return KVCAP_OK;
    if (gpu) {
        KVCAP_TRY(kvcap_calib_cuda_gram_flush(gpu, omp_thread(), i, a->cols));
    } else {
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, u->m, (int)a->cols, 1.0, a->kbuf,
                    (int)a->cap, 1.0, u->k_gram, u->m);
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, u->m, (int)a->cols, 1.0, a->vbuf,
                    (int)a->cap, 1.0, u->v_gram, u->m);
    }
    *flops += 2.0 * (double)u->m * (double)(u->m + 1) * (double)a->cols;
    a->cols = 0;
    return KVCAP_OK;
}

static void symmetrize(double *g, int m)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < i; j++)
            g[(size_t)i * m + j] = g[(size_t)j * m + i];
}

/* Frees the accumulators; the batch buffers of a CUDA run belong to *gpu, freed with it. */
static void free_accumulators(struct accumulator *acc, size_t n, struct kvcap_calib_cuda_gram **gpu)
{
    for (size_t i = 0; acc && i < n; i++) {
        if (!*gpu) {
            free(acc[i].kbuf);
            free(acc[i].vbuf);
        }
        acc[i].kbuf = acc[i].vbuf = NULL;
        free(acc[i].train);
        acc[i].train = NULL;
    }
    free(acc);
    kvcap_calib_cuda_gram_free(*gpu);
    *gpu = NULL;
}

/* Which buckets a grid belongs to: a bit per bucket. */
static unsigned matching_buckets(const struct kvcap_calib_state *s, int rows, int cols)
{
    unsigned bits = 0;
    for (int b = 0; b < s->n_buckets; b++)
        if (s->buckets[b].rows == rows && s->buckets[b].cols == cols)
            bits |= 1u << b;
    return bits;
}

static enum kvcap_status unmatched(const struct kvcap_calib_state *s,
                                   const struct kvcap_span_view *span)
{
    char grids[256] = "";
    size_t used = 0;
    for (int b = 0; b < s->n_buckets && used < sizeof grids; b++)
        used += (size_t)snprintf(grids + used, sizeof grids - used, "%s%dx%d", b ? ", " : "",
                                 s->buckets[b].rows, s->buckets[b].cols);
    return kvcap_fail(KVCAP_ERR_GEOMETRY,
                      "%s: span s%d has a %dx%d grid (n = %d), which matches no bucket of the "
                      "config (%s); add a bucket or pass --skip-unmatched",
                      span->shard, span->index, span->rows, span->cols, span->n, grids);
}

static enum kvcap_status open_dataset(const struct kvcap_calib_config *cfg,
                                      const struct kvcap_calibrate_options *o,
                                      struct kvcap_dataset **ds)
{
    KVCAP_TRY(kvcap_dataset_open(o->data, o->n_data, ds));
    const char *diff = kvcap_geometry_difference(kvcap_dataset_geometry(*ds), &cfg->model);
    if (diff) {
        kvcap_dataset_close(*ds);
        *ds = NULL;
        return kvcap_fail(KVCAP_ERR_GEOMETRY,
                          "%s: the dataset's %s does not match the calibration config's (the data "
                          "was recorded from another model)",
                          o->data[0], diff);
    }
    return KVCAP_OK;
}

static void report_progress(const struct kvcap_calibrate_options *o, const char *phase,
                            int64_t done, int64_t total)
{
    if (o->progress)
        o->progress(phase, done, total, o->user);
}

struct scratch {
    float *kf, *vc, *mu, *x, *y, *z, *t;
    float *khat, *vhat, *q, *s1, *s2;
};

static void free_scratch(struct scratch *s)
{
    free(s->kf), free(s->vc), free(s->mu), free(s->x), free(s->y), free(s->z), free(s->t);
    free(s->khat), free(s->vhat), free(s->q), free(s->s1), free(s->s2);
}

static enum kvcap_status alloc_scratch(struct scratch *s, const struct kvcap_calib_state *st)
{
    memset(s, 0, sizeof *s);
    size_t d = (size_t)st->model.head_dim, nmax = 1;
    for (int b = 0; b < st->n_buckets; b++) {
        size_t n = (size_t)st->buckets[b].rows * (size_t)st->buckets[b].cols;
        nmax = n > nmax ? n : nmax;
    }
    size_t nd = nmax * d;
    s->kf = malloc(sizeof(float) * nd);
    s->vc = malloc(sizeof(float) * nd);
    s->mu = malloc(sizeof(float) * d);
    s->x = malloc(sizeof(float) * nd);
    s->y = malloc(sizeof(float) * nd);
    s->z = malloc(sizeof(float) * nd);
    s->t = malloc(sizeof(float) * nd);
    s->khat = malloc(sizeof(float) * nd);
    s->vhat = malloc(sizeof(float) * nd);
    s->q = malloc(sizeof(float) * d);
    s->s1 = malloc(sizeof(float) * nmax);
    s->s2 = malloc(sizeof(float) * nmax);
    if (!s->kf || !s->vc || !s->mu || !s->x || !s->y || !s->z || !s->t || !s->khat ||
        !s->vhat || !s->q || !s->s1 || !s->s2) {
        free_scratch(s);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "calibrate: out of memory for scratch");
    }
    return KVCAP_OK;
}

/* Appends one span's offset-free keys to a float sample matrix (trained path). */
static enum kvcap_status append_samples(float **buf, size_t *cols, size_t *cap, int m,
                                        const struct kvcap_bucket *b, const float *kf, int d,
                                        size_t want_cap)
{
    size_t add = (size_t)span_columns(b, d);
    if (!*buf) {
        *buf = malloc(sizeof(float) * (size_t)m * want_cap);
        KVCAP_RETURN_IF(!*buf, KVCAP_ERR_OUT_OF_MEMORY,
                        "calibrate: out of memory for %zu training columns", want_cap);
        *cap = want_cap;
    }
    if (*cols + add > *cap)
        return KVCAP_OK;
    place_float(b, kf, d, *buf, *cap, *cols);
    *cols += add;
    return KVCAP_OK;
}

/* One (layer, head) of one training span into the accumulators of its matching buckets. */
static enum kvcap_status accumulate_head(struct kvcap_calib_state *state, struct accumulator *acc,
                                         struct kvcap_calib_cuda_gram *gpu,
                                         const struct kvcap_calibrate_options *o,
                                         const struct kvcap_span_view *span, int l, int h,
                                         unsigned bits, int trained, struct scratch *sc,
                                         double *flops)
{
    int H = state->model.n_kv_heads, B = state->n_buckets, d = state->model.head_dim;
    KVCAP_TRY(load_head(span, &state->model, l, h, sc->kf, sc->vc, sc->mu));
    for (int b = 0; b < B; b++) {
        if (!(bits & (1u << b)))
            continue;
        size_t i = ((size_t)l * H + (size_t)h) * B + (size_t)b;
        struct kvcap_calib_unit *u = &state->units[i];
        struct accumulator *a = &acc[i];
        const struct kvcap_bucket *bk = &state->buckets[b];
        size_t add = (size_t)span_columns(bk, d);
        if (a->cols + add > a->cap)
            KVCAP_TRY(flush(gpu, i, u, a, flops));
        place_double(bk, sc->kf, d, a->kbuf, a->cap, a->cols);
        place_double(bk, sc->vc, d, a->vbuf, a->cap, a->cols);
        a->cols += add;
        if (trained && a->train_spans < o->max_train_spans) {
            KVCAP_TRY(append_samples(&a->train, &a->train_cols, &a->train_cap, u->m, bk, sc->kf,
                                     d, add * (size_t)o->max_train_spans));
            a->train_spans++;
        }
    }
    return KVCAP_OK;
}

/* Sets up the device-resident Grams of every unit, one lane per host thread. With `fallback`
 * (device AUTO) a setup failure is a warning and *device becomes the CPU. */
static enum kvcap_status gpu_setup(struct kvcap_calib_state *state, const struct accumulator *acc,
                                   size_t n_units, int lanes, int fallback,
                                   struct kvcap_calib_cuda_gram **gpu,
                                   enum kvcap_calib_device *device)
{
    int *m = malloc(sizeof *m * n_units);
    size_t *cap = malloc(sizeof *cap * n_units);
    double **k = malloc(sizeof *k * n_units), **v = malloc(sizeof *v * n_units);
    enum kvcap_status st = KVCAP_OK;
    if (!m || !cap || !k || !v)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "calibrate: out of memory (%zu units)", n_units);
    for (size_t i = 0; st == KVCAP_OK && i < n_units; i++) {
        m[i] = state->units[i].m;
        cap[i] = acc[i].cap;
        k[i] = state->units[i].k_gram;
        v[i] = state->units[i].v_gram;
    }
    if (st == KVCAP_OK) {
        struct kvcap_calib_cuda_gram_params p = {n_units, m, cap, k, v, lanes};
        if (fallback)
            kvcap_quiet_push();
        st = kvcap_calib_cuda_gram_create(&p, gpu);
        if (fallback)
            kvcap_quiet_pop();
        if (st != KVCAP_OK && fallback) {
            kvcap_log(KVCAP_LOG_WARN, "%s; calibrating on the CPU", kvcap_last_error());
            kvcap_clear_error();
            *device = KVCAP_CALIB_DEVICE_CPU;
            st = KVCAP_OK;
        }
    }
    free(m), free(cap), free(k), free(v);
    return st;
}

enum kvcap_status kvcap_calibrate(const struct kvcap_calib_config *cfg,
                                  const struct kvcap_calibrate_options *o,
                                  struct kvcap_calib_state *state,
                                  struct kvcap_calibrate_report *report)
{
    KVCAP_RETURN_IF(!cfg || !o || !state || !report, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_calibrate: NULL argument");
    memset(report, 0, sizeof *report);
    memset(state, 0, sizeof *state);
    enum kvcap_calib_device device;
    KVCAP_TRY(kvcap_calib_device_resolve(o->device, &device));
    struct kvcap_dataset *ds = NULL;
    KVCAP_TRY(open_dataset(cfg, o, &ds));
    enum kvcap_status st = kvcap_calib_state_init(state, cfg);
    if (st != KVCAP_OK) {
        kvcap_dataset_close(ds);
        return st;
    }
    const struct kvcap_model_geometry *g = &state->model;
    int L = g->n_layers, H = g->n_kv_heads, B = state->n_buckets, d = g->head_dim;
    size_t n_units = (size_t)L * H * B;
    int trained = cfg->keys.method == KVCAP_KEY_METHOD_TRAINED;
    struct accumulator *acc = calloc(n_units, sizeof *acc);
    int threads = omp_threads();
    struct scratch *sc = calloc((size_t)threads, sizeof *sc);
    if (!acc || !sc)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "calibrate: out of memory");
    for (int t = 0; st == KVCAP_OK && t < threads; t++)
        st = alloc_scratch(&sc[t], state);
    /* BLAS runs single-threaded inside the parallel loop; restored below. */
    int blas_threads = openblas_get_num_threads();
    openblas_set_num_threads(1);
    /* Batch buffers: at least 1024 columns per dsyrk so BLAS runs near its peak. */
    for (size_t i = 0; st == KVCAP_OK && i < n_units; i++) {
        size_t per_span = (size_t)span_columns(&state->buckets[i % (size_t)B], d);
        acc[i].cap = per_span * (per_span >= 1024 ? 1 : (1024 + per_span - 1) / per_span);
    }
    struct kvcap_calib_cuda_gram *gpu = NULL;
    if (st == KVCAP_OK && device == KVCAP_CALIB_DEVICE_CUDA)
        st = gpu_setup(state, acc, n_units, threads, o->device == KVCAP_CALIB_DEVICE_AUTO, &gpu,
                       &device);
    report->device = device;
    report->train_device = KVCAP_CALIB_DEVICE_CPU;
    if (st == KVCAP_OK && gpu)
        st = kvcap_calib_cuda_device_name(report->device_name, sizeof report->device_name);
    for (size_t i = 0; st == KVCAP_OK && i < n_units; i++) {
        size_t m = (size_t)state->units[i].m;
        if (gpu) {
            kvcap_calib_cuda_gram_buffers(gpu, i, &acc[i].kbuf, &acc[i].vbuf);
            continue;
        }
        acc[i].kbuf = malloc(sizeof(double) * m * acc[i].cap);
        acc[i].vbuf = malloc(sizeof(double) * m * acc[i].cap);
        if (!acc[i].kbuf || !acc[i].vbuf)
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY,
                            "calibrate: out of memory for Gram batches (%zu units)", n_units);
    }

    double t0 = kvcap_seconds();
    int64_t total = kvcap_dataset_span_count(ds);
    const struct kvcap_span_view *span;
    while (st == KVCAP_OK && (st = kvcap_dataset_next(ds, &span)) == KVCAP_OK && span) {
        report->spans_seen++;
        unsigned bits = matching_buckets(state, span->rows, span->cols);
        if (!bits) {
            if (!o->skip_unmatched) {
                st = unmatched(state, span);
                break;
            }
            report->spans_skipped++;
            continue;
        }
        int is_val = kvcap_span_is_validation(span, cfg->validation_fraction,
                                              cfg->validation_seed);
        for (int b = 0; b < B; b++)
            if (bits & (1u << b)) {
                if (is_val)
                    state->val_spans[b]++;
                else
                    state->train_spans[b]++;
            }
        if (is_val)
            continue;
        /* Units are independent: each thread takes whole (layer, head) pairs, preprocessing
         * and a single-threaded dsyrk, which on this class of machine beats one multi-threaded
         * dsyrk with the preprocessing serialised between calls. */
        double flops = 0.0;
        struct kvcap_parallel_error err = {0};
#pragma omp parallel for schedule(dynamic) reduction(+ : flops)
        for (int lh = 0; lh < L * H; lh++) {
            if (kvcap_parallel_failed(&err))
                continue;
            enum kvcap_status s2 = accumulate_head(state, acc, gpu, o, span, lh / H, lh % H,
                                                   bits, trained, &sc[omp_thread()], &flops);
            if (s2 != KVCAP_OK)
                kvcap_parallel_fail(&err, s2);
        }
        report->gram_flops += flops;
        if ((st = kvcap_parallel_status(&err)) != KVCAP_OK)
            break;
        report_progress(o, "accumulate", report->spans_seen, total);
    }
    double tail_flops = 0.0;
    struct kvcap_parallel_error tail_err = {0};
#pragma omp parallel for schedule(dynamic) reduction(+ : tail_flops)
    for (size_t i = 0; i < n_units; i++) {
        if (st != KVCAP_OK || kvcap_parallel_failed(&tail_err))
            continue;
        enum kvcap_status s2 = flush(gpu, i, &state->units[i], &acc[i], &tail_flops);
        if (s2 != KVCAP_OK)
            kvcap_parallel_fail(&tail_err, s2);
    }
    if (st == KVCAP_OK)
        st = kvcap_parallel_status(&tail_err);
    if (st == KVCAP_OK && gpu) /* the Grams come back in the layout the CPU path leaves */
        st = kvcap_calib_cuda_gram_finish(gpu);
#pragma omp parallel for schedule(dynamic)
    for (size_t i = 0; i < n_units; i++) {
        if (st != KVCAP_OK)
            continue;
        symmetrize(state->units[i].k_gram, state->units[i].m);
        symmetrize(state->units[i].v_gram, state->units[i].m);
    }
    report->gram_flops += tail_flops;
    openblas_set_num_threads(blas_threads);
    report->seconds_accumulate = kvcap_seconds() - t0;
    for (int b = 0; st == KVCAP_OK && b < B; b++)
        if (state->train_spans[b] == 0)
            st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                            "buckets[%d] (%dx%d %s): no training span in the dataset (%lld "
                            "validation spans)",
                            b, state->buckets[b].rows, state->buckets[b].cols,
                            kvcap_structure_name(state->buckets[b].structure),
                            (long long)state->val_spans[b]);
    kvcap_dataset_close(ds);
    ds = NULL;
    /* The device's memory goes to the eigensolver next; the batch buffers are not needed. */
    if (gpu) {
        for (size_t i = 0; i < n_units; i++)
            acc[i].kbuf = acc[i].vbuf = NULL;
        kvcap_calib_cuda_gram_free(gpu);
        gpu = NULL;
    }

    t0 = kvcap_seconds();
    /* The value PCA follows the Grams: on the device when they ran there (AUTO may still fall
     * back if the eigensolver cannot be set up), else on the CPU. */
    enum kvcap_calib_device fit_device =
        device == KVCAP_CALIB_DEVICE_CUDA ? o->device : KVCAP_CALIB_DEVICE_CPU;
    if (st == KVCAP_OK)
        st = kvcap_calib_state_fit(state, 1, fit_device, &report->fit, NULL, NULL);
    report_progress(o, "fit", 1, 1);
    report->seconds_fit = kvcap_seconds() - t0;

    if (st == KVCAP_OK && trained) {
        t0 = kvcap_seconds();
        /* Validation columns for the checkpoints: a second, cheap pass over validation spans. */
        float **val = calloc(n_units, sizeof *val);
        size_t *val_cols = calloc(n_units, sizeof *val_cols), *val_cap = calloc(n_units, sizeof *val_cap);
        int *val_spans = calloc(n_units, sizeof *val_spans);
        if (!val || !val_cols || !val_cap || !val_spans)
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "calibrate: out of memory");
        if (st == KVCAP_OK)
            st = open_dataset(cfg, o, &ds);
        while (st == KVCAP_OK && (st = kvcap_dataset_next(ds, &span)) == KVCAP_OK && span) {
            unsigned bits = matching_buckets(state, span->rows, span->cols);
            if (!bits || !kvcap_span_is_validation(span, cfg->validation_fraction,
                                                   cfg->validation_seed))
                continue;
            for (int l = 0; st == KVCAP_OK && l < L; l++)
                for (int h = 0; st == KVCAP_OK && h < H; h++) {
                    st = load_head(span, g, l, h, sc[0].kf, sc[0].vc, sc[0].mu);
                    for (int b = 0; st == KVCAP_OK && b < B; b++) {
                        size_t i = ((size_t)l * H + (size_t)h) * B + (size_t)b;
                        if (!(bits & (1u << b)) || val_spans[i] >= o->max_val_spans)
                            continue;
                        size_t add = (size_t)span_columns(&state->buckets[b], d);
                        st = append_samples(&val[i], &val_cols[i], &val_cap[i], state->units[i].m,
                                            &state->buckets[b], sc[0].kf, d,
                                            add * (size_t)o->max_val_spans);
                        val_spans[i]++;
                    }
                }
        }
        kvcap_dataset_close(ds);
        ds = NULL;
        /* Training runs where the Grams ran. Under AUTO a unit the device cannot take (e.g.
         * not enough memory) trains on the CPU with a warning, and so do the units after it. */
        enum kvcap_calib_device train_device = device;
        struct kvcap_key_maps *out = calloc(n_units, sizeof *out);
        struct kvcap_train_report *tr = calloc(n_units, sizeof *tr);
        if (st == KVCAP_OK && (!out || !tr))
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "calibrate: out of memory");
        const int gelu = cfg->keys.activation == KVCAP_ACTIVATION_GELU;
        size_t first_cpu = 0; /* units from here on train on the CPU */
        for (; st == KVCAP_OK && train_device == KVCAP_CALIB_DEVICE_CUDA && first_cpu < n_units;
             first_cpu++) {
            const size_t i = first_cpu;
            st = kvcap_calib_cuda_keys_train(acc[i].train, acc[i].train_cap, acc[i].train_cols,
                                             val[i], val_cap[i], val_cols[i], &cfg->keys.train,
                                             gelu, &state->units[i].keys, &out[i], &tr[i],
                                             o->device == KVCAP_CALIB_DEVICE_AUTO);
            if (st == KVCAP_OK && !tr[i].on_device) /* this unit fell back; the rest follow */
                train_device = KVCAP_CALIB_DEVICE_CPU;
            report_progress(o, "train", (int64_t)i + 1, (int64_t)n_units);
        }
        /* On the CPU the units train side by side, one per thread (each one's BLAS then runs on
         * its thread alone): each trains as it would alone, to the same bits. */
        enum kvcap_status first_error = st;
        char message[512] = "";
        int64_t done = (int64_t)first_cpu;
        if (st == KVCAP_OK) {
#pragma omp parallel for schedule(dynamic, 1)
            for (size_t i = first_cpu; i < n_units; i++) {
                enum kvcap_status failed;
#pragma omp atomic read
                failed = first_error;
                if (failed != KVCAP_OK)
                    continue;
                const enum kvcap_status s = kvcap_keys_train(
                    acc[i].train, acc[i].train_cap, acc[i].train_cols, val[i], val_cap[i],
                    val_cols[i], &cfg->keys.train, gelu, &state->units[i].keys, &out[i], &tr[i]);
#pragma omp critical(calibrate_train)
                {
                    if (s != KVCAP_OK && first_error == KVCAP_OK) {
                        snprintf(message, sizeof message, "%s", kvcap_last_error());
                        first_error = s;
                    }
                    report_progress(o, "train", ++done, (int64_t)n_units);
                }
            }
        }
        if (st == KVCAP_OK && first_error != KVCAP_OK)
            st = kvcap_fail(first_error, "%s", message);
        /* The trained maps replace the closed-form ones, logged in unit order. */
        for (size_t i = 0; st == KVCAP_OK && i < n_units; i++) {
            struct kvcap_calib_unit *u = &state->units[i];
            kvcap_key_maps_free(&u->keys);
            u->keys = out[i];
            memset(&out[i], 0, sizeof out[i]);
            int l = (int)(i / ((size_t)H * B)), h = (int)(i / (size_t)B % (size_t)H);
            kvcap_log(KVCAP_LOG_INFO,
                      "l%d.h%d.b%d: trained keys: validation MSE %.4g -> %.4g (closed form %s)",
                      l, h, (int)(i % (size_t)B), tr[i].init_val_mse, tr[i].final_val_mse,
                      tr[i].kept_init ? "kept" : "improved on");
        }
        for (size_t i = 0; out && i < n_units; i++)
            kvcap_key_maps_free(&out[i]);
        free(out), free(tr);
        for (size_t i = 0; val && i < n_units; i++)
            free(val[i]);
        free(val), free(val_cols), free(val_cap), free(val_spans);
        report->seconds_train = kvcap_seconds() - t0;
        report->train_device = train_device;
    }
    free_accumulators(acc, n_units, &gpu);
    for (int t = 0; sc && t < threads; t++)
        free_scratch(&sc[t]);
    free(sc);

    if (st == KVCAP_OK) {
        t0 = kvcap_seconds();
        st = kvcap_calibrate_validate(state, cfg, o);
        report->seconds_validate = kvcap_seconds() - t0;
    }
    if (st != KVCAP_OK)
        kvcap_calib_state_free(state);
    return st;
}

/* ---- Validation metrics ------------------------------------------------------------------ */

struct metric_sums {
    double v_err, v_centred, v_full_err, v_full, v_cos;
    double k_err, k_energy, k_cos;
    double a_err, a_energy, a_cos;
    int64_t spans, queries;
};

static double dot(const float *a, const float *b, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)a[i] * b[i];
    return s;
}

static double cosine(const float *a, const float *b, size_t n)
{
    double na = dot(a, a, n), nb = dot(b, b, n);
    return na > 0 && nb > 0 ? dot(a, b, n) / sqrt(na * nb) : (na == nb ? 1.0 : 0.0);
}

/* Softmax attention of query q over n keys (n x d), values (n x d); probs scratch [n]. */
static void attend(const float *q, const float *k, const float *v, size_t n, size_t d,
                   float *probs, double *out)
{
    double mx = -INFINITY, sum = 0.0, scale = 1.0 / sqrt((double)d);
    for (size_t j = 0; j < n; j++) {
        probs[j] = (float)(dot(q, k + j * d, d) * scale);
        mx = probs[j] > mx ? probs[j] : mx;
    }
    for (size_t j = 0; j < n; j++) {
        double e = exp(probs[j] - mx);
        probs[j] = (float)e;
        sum += e;
    }
    for (size_t c = 0; c < d; c++)
        out[c] = 0.0;
    for (size_t j = 0; j < n; j++)
        for (size_t c = 0; c < d; c++)
            out[c] += probs[j] / sum * v[j * d + c];
}

/* Reconstructs one head of one span through unit u and adds its errors to m. */
static enum kvcap_status measure(const struct kvcap_calib_state *state, int l, int h, int b,
                                 const struct kvcap_span_view *span, struct scratch *sc,
                                 struct metric_sums *m)
{
    const struct kvcap_model_geometry *g = &state->model;
    const struct kvcap_bucket *bk = &state->buckets[b];
    const struct kvcap_calib_unit *u = kvcap_state_unit(state, l, h, b);
    size_t d = (size_t)g->head_dim, n = (size_t)span->n, cols = (size_t)span_columns(bk, (int)d);
    int rv = kvcap_retained(state->r_values[l], u->m);
    /* values: Vc -> U Vc -> Uᵀ(U Vc), per tile */
    place_float(bk, sc->vc, (int)d, sc->x, cols, 0);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rv, (int)cols, u->m, 1.0f,
                u->v_eigvec, u->m, sc->x, (int)cols, 0.0f, sc->t, (int)cols);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, u->m, (int)cols, rv, 1.0f, u->v_eigvec,
                u->m, sc->t, (int)cols, 0.0f, sc->y, (int)cols);
    unplace(bk, sc->y, cols, (int)d, sc->vhat);
    /* keys: K'[M] -> reconstructor */
    place_float(bk, sc->kf, (int)d, sc->x, cols, 0);
    const struct kvcap_key_maps *k = &u->keys;
    for (int r = 0; r < k->rk; r++)
        memcpy(sc->t + (size_t)r * cols, sc->x + (size_t)k->mask[r] * cols, sizeof(float) * cols);
    kvcap_key_maps_apply(k, sc->t, cols, cols, sc->z, sc->y, cols);
    unplace(bk, sc->y, cols, (int)d, sc->khat);

    double vc_energy = dot(sc->vc, sc->vc, n * d), err = 0.0, full = 0.0;
    for (size_t j = 0; j < n; j++)
        for (size_t c = 0; c < d; c++) {
            double e = (double)sc->vhat[j * d + c] - sc->vc[j * d + c];
            err += e * e;
            sc->vc[j * d + c] += sc->mu[c]; /* back to V */
            sc->vhat[j * d + c] += sc->mu[c];
            full += (double)sc->vc[j * d + c] * sc->vc[j * d + c];
        }
    m->v_err += err;
    m->v_centred += vc_energy;
    m->v_full_err += err; /* the mean is restored exactly */
    m->v_full += full;
    m->v_cos += cosine(sc->vhat, sc->vc, n * d);
    double kerr = 0.0;
    for (size_t i = 0; i < n * d; i++) {
        double e = (double)sc->khat[i] - sc->kf[i];
        kerr += e * e;
    }
    m->k_err += kerr;
    m->k_energy += dot(sc->kf, sc->kf, n * d);
    m->k_cos += cosine(sc->khat, sc->kf, n * d);
    m->spans++;

    const struct kvst_tensor *qt = span->q_dec[l];
    if (!qt)
        return KVCAP_OK;
    int G = g->n_q_heads / g->n_kv_heads;
    size_t tq = (size_t)qt->shape[1];
    double o_full[256], o_hat[256];
    for (int gi = 0; gi < G; gi++)
        for (size_t t = 0; t < tq; t++) {
            const struct kvst_tensor view = *qt;
            size_t esize = kvcap_dtype_size(view.dtype);
            const unsigned char *src = (const unsigned char *)view.data +
                                       (((size_t)(h * G + gi)) * tq + t) * d * esize;
            KVCAP_TRY(kvcap_convert_to_f32(view.dtype, src, d, sc->q));
            kvcap_rope_rotate(g, sc->q, 1, d, -(double)span->p0); /* q' = R(-p0) q */
            attend(sc->q, sc->kf, sc->vc, n, d, sc->s1, o_full);
            attend(sc->q, sc->khat, sc->vhat, n, d, sc->s2, o_hat);
            double e = 0.0, en = 0.0, ab = 0.0, bb = 0.0;
            for (size_t c = 0; c < d; c++) {
                e += (o_hat[c] - o_full[c]) * (o_hat[c] - o_full[c]);
                en += o_full[c] * o_full[c];
                ab += o_hat[c] * o_full[c];
                bb += o_hat[c] * o_hat[c];
            }
            m->a_err += e;
            m->a_energy += en;
            m->a_cos += en > 0 && bb > 0 ? ab / sqrt(en * bb) : 1.0;
            m->queries++;
        }
    return KVCAP_OK;
}

enum kvcap_status kvcap_calibrate_validate(struct kvcap_calib_state *state,
                                           const struct kvcap_calib_config *cfg,
                                           const struct kvcap_calibrate_options *o)
{
    int L = state->model.n_layers, H = state->model.n_kv_heads, B = state->n_buckets;
    size_t n_units = (size_t)L * H * B;
    struct metric_sums *sums = calloc(n_units, sizeof *sums);
    KVCAP_RETURN_IF(!sums, KVCAP_ERR_OUT_OF_MEMORY, "validate: out of memory");
    struct scratch sc;
    struct kvcap_dataset *ds = NULL;
    enum kvcap_status st = alloc_scratch(&sc, state);
    if (st != KVCAP_OK) {
        free(sums);
        return st;
    }
    st = open_dataset(cfg, o, &ds);
    int64_t total = 0, done = 0;
    for (int b = 0; b < B; b++)
        total += state->val_spans[b];
    const struct kvcap_span_view *span;
    while (st == KVCAP_OK && (st = kvcap_dataset_next(ds, &span)) == KVCAP_OK && span) {
        unsigned bits = matching_buckets(state, span->rows, span->cols);
        if (!bits ||
            !kvcap_span_is_validation(span, cfg->validation_fraction, cfg->validation_seed))
            continue;
        for (int l = 0; st == KVCAP_OK && l < L; l++)
            for (int h = 0; st == KVCAP_OK && h < H; h++)
                for (int b = 0; st == KVCAP_OK && b < B; b++) {
                    if (!(bits & (1u << b)))
                        continue;
                    /* measure() turns vc into V in place: reload per bucket */
                    st = load_head(span, &state->model, l, h, sc.kf, sc.vc, sc.mu);
                    if (st == KVCAP_OK)
                        st = measure(state, l, h, b, span, &sc,
                                     &sums[((size_t)l * H + (size_t)h) * B + (size_t)b]);
                }
        report_progress(o, "validate", ++done, total);
    }
    kvcap_dataset_close(ds);
    for (size_t i = 0; st == KVCAP_OK && i < n_units; i++) {
        const struct metric_sums *m = &sums[i];
        double *out = state->units[i].metrics;
        for (int j = 0; j < KVCAP_METRIC_COUNT; j++)
            out[j] = NAN;
        if (m->spans == 0)
            continue;
        out[KVCAP_METRIC_V_EXPLAINED] = m->v_centred > 0 ? 1.0 - m->v_err / m->v_centred : 1.0;
        out[KVCAP_METRIC_V_COS] = m->v_cos / (double)m->spans;
        out[KVCAP_METRIC_V_REL] = m->v_full > 0 ? sqrt(m->v_full_err / m->v_full) : 0.0;
        out[KVCAP_METRIC_K_COS] = m->k_cos / (double)m->spans;
        out[KVCAP_METRIC_K_REL] = m->k_energy > 0 ? sqrt(m->k_err / m->k_energy) : 0.0;
        if (m->queries > 0) {
            out[KVCAP_METRIC_ATTN_COS] = m->a_cos / (double)m->queries;
            out[KVCAP_METRIC_ATTN_REL] = m->a_energy > 0 ? sqrt(m->a_err / m->a_energy) : 0.0;
        }
    }
    free_scratch(&sc);
    free(sums);
    return st;
}
