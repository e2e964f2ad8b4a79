/* attention.c — decode attention on one KV head (see attention.h): plain rows, fused KVCapsule
 * spans (DESIGN §4) and the log-sum-exp merge. The _ref functions are the readable oracles
 * (double accumulation, libm exp); the fast ones share one blocked design:
 *
 *  - rows stream in blocks of B = min(64, 4096/d) rows (any row stride);
 *  - queries go in groups of up to 8, one query per lane of an 8-float vector: a block's scores
 *    are [B][8], so the online softmax (max, rescale, exp, sum) is one vector op per row, and
 *    K and V are read once per block whatever the group size;
 *  - two kernel sets, chosen per call with __builtin_cpu_supports: AVX2+FMA+F16C intrinsics
 *    (target attribute, no -march flags) that convert F16/BF16 in registers as they load, and
 *    portable C that converts each block into a 16 KiB stack buffer (kernels/load.h) and
 *    lets the compiler vectorise at the default target; kernels/load.c probes the CPU.
 *
 * Limits: d in 1..ATTN_MAX_D (4096). Every entry point returns a status: outside the limits,
 * with NULL inputs or with too little scratch (capsule) it is KVCAP_ERR_INVALID_ARGUMENT; the
 * _ref functions, and kvcap_attend_rows past 4096 floats of queries (nq × d rounded up to 8),
 * allocate working memory and return KVCAP_ERR_OUT_OF_MEMORY when that fails. On any error
 * nothing is read, the partials are untouched and *bytes is 0, so a caller can never mistake
 * dropped work for an empty span (zero rows or tiles: KVCAP_OK, 0 bytes).
 * No function here starts threads; BLAS is called for the dense capsule maps' two products only.
 *
 * In this file: the partials and their merge; the CPU code reference (the _ref oracles, read
 * them first: they are the spec); element helpers and the exp approximations; the kernel
 * bodies, portable then AVX2; the run-time dispatch; the fast entry points. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "kernels/attention.h"
#include "kernels/load.h"
#include "common/internal.h"
#include "common/dtype.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#  define ATTN_X86 1
#  include <immintrin.h>
#else
#  define ATTN_X86 0
#endif

#if defined(__GNUC__)
#  define ATTN_INLINE static inline __attribute__((always_inline))
#else
#  define ATTN_INLINE static inline
#endif

#define ATTN_MAX_D 4096
#define ATTN_BLOCK_FLOATS 4096 /* floats per portable conversion buffer: 16 KiB, in L1 */
#define ATTN_MAX_B 64          /* rows per block */
#define ATTN_LANES 8           /* queries per group, one per lane */
#define ATTN_PACKED_STACK 4096 /* packed query floats kept on the stack (16 queries at d 256) */

static int block_rows(int d)
{
    int b = ATTN_BLOCK_FLOATS / d;
    return b < ATTN_MAX_B ? b : ATTN_MAX_B;
}

/* ---- Partial results ---------------------------------------------------------------------- */

void kvcap_partial_reset(struct kvcap_partial p, int nq, int d)
{
    for (int q = 0; q < nq; q++) {
        p.mx[q] = -INFINITY;
        p.sum[q] = 0.0f;
    }
    if (nq > 0 && d > 0)
        memset(p.o, 0, sizeof(float) * (size_t)nq * (size_t)d);
}

/* A partial has seen no keys when its sum is 0 (or its max is still -inf): merging it must not
 * touch the other side, and exp(-inf - -inf) must never be evaluated. */
static int partial_empty(float mx, float sum)
{
    return !(sum > 0.0f) || mx == -INFINITY;
}

void kvcap_partial_merge(struct kvcap_partial into, struct kvcap_partial from, int nq, int d)
{
    for (int q = 0; q < nq; q++) {
        float fm = from.mx[q], fs = from.sum[q];
        if (partial_empty(fm, fs))
            continue;
        float *io = into.o + (size_t)q * d;
        const float *fo = from.o + (size_t)q * d;
        float im = into.mx[q], is = into.sum[q];
        if (partial_empty(im, is)) {
            into.mx[q] = fm;
            into.sum[q] = fs;
            memcpy(io, fo, sizeof(float) * (size_t)d);
            continue;
        }
        float mx = im > fm ? im : fm;
        float a = expf(im - mx), b = expf(fm - mx); /* one of them is exactly 1 */
        for (int c = 0; c < d; c++)
            io[c] = a * io[c] + b * fo[c];
        into.sum[q] = a * is + b * fs;
        into.mx[q] = mx;
    }
}

void kvcap_partial_finish(struct kvcap_partial p, int nq, int d, float *out, size_t out_stride)
{
    for (int q = 0; q < nq; q++) {
        float s = p.sum[q];
        const float *o = p.o + (size_t)q * d;
        float *dst = out + (size_t)q * out_stride;
        for (int c = 0; c < d; c++)
            dst[c] = s > 0.0f ? o[c] / s : 0.0f;
    }
}

/* Folds a one-query partial (mx, sum, o[d]) into query q of `acc`. */
static void merge_one(struct kvcap_partial acc, int q, int d, float mx, float sum, float *o)
{
    struct kvcap_partial into = {acc.mx + q, acc.sum + q, acc.o + (size_t)q * d};
    struct kvcap_partial from = {&mx, &sum, o};
    kvcap_partial_merge(into, from, 1, d);
}

/* ---- CPU code reference: the readable oracles ------------------------------------------------
 * Plain loops in double with libm's exp, one query and one row at a time: the specification the
 * fast kernels below (and the CUDA twins, kernels/cuda/attention_cuda.h) are tested against. */

static uint64_t rows_bytes(const struct kvcap_rows *rows, int d)
{
    return 2u * (uint64_t)rows->n * (uint64_t)d * kvcap_dtype_size(rows->dtype);
}

/* The argument check both row kernels share; *nothing is set when there is no work (no rows or
 * no queries). */
static enum kvcap_status rows_check(const struct kvcap_rows *rows, const float *q, int nq, int d,
                                    int max_d, uint64_t *bytes, int *nothing)
{
    if (bytes)
        *bytes = 0;
    KVCAP_RETURN_IF(!rows || !q || rows->n < 0 || nq < 0 || d <= 0 || d > max_d ||
                        !kvcap_dtype_is_storage(rows->dtype),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "attend_rows: %s", !rows ? "NULL rows" : !q ? "NULL queries"
                    : rows->n < 0 || nq < 0 ? "negative row or query count"
                    : d <= 0 || d > max_d ? "head_dim out of range"
                    : "rows are not F32, F16 or BF16");
    *nothing = rows->n == 0 || nq == 0;
    return KVCAP_OK;
}

enum kvcap_status kvcap_attend_rows_ref(const struct kvcap_rows *rows, const float *q, int nq,
                                        int d, float scale, struct kvcap_partial acc,
                                        uint64_t *bytes)
{
    int nothing;
    KVCAP_TRY(rows_check(rows, q, nq, d, INT_MAX, bytes, &nothing));
    if (nothing)
        return KVCAP_OK;
    double *o = malloc(sizeof(double) * (size_t)d);
    float *of = malloc(sizeof(float) * (size_t)d);
    if (!o || !of) {
        free(o);
        free(of);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "attend_rows_ref: %d floats of working memory",
                          3 * d);
    }
    for (int qi = 0; qi < nq; qi++) {
        const float *qv = q + (size_t)qi * d;
        /* pass 1: the max score; pass 2: weights and the weighted sum of values */
        double mx = -INFINITY;
        for (int j = 0; j < rows->n; j++) {
            double s = 0;
            for (int c = 0; c < d; c++)
                s += (double)qv[c] *
                     kvcap_load_elem(rows->dtype, rows->k, (size_t)j * rows->row_stride + c);
            s *= scale;
            mx = s > mx ? s : mx;
        }
        /* Shift by the float max the partial will carry, so its weights are exactly
         * exp(s - partial.mx) even when |mx| is large. */
        float fmx = (float)mx;
        double sum = 0;
        for (int c = 0; c < d; c++)
            o[c] = 0;
        for (int j = 0; j < rows->n; j++) {
            double s = 0;
            for (int c = 0; c < d; c++)
                s += (double)qv[c] *
                     kvcap_load_elem(rows->dtype, rows->k, (size_t)j * rows->row_stride + c);
            double p = exp(s * scale - (double)fmx);
            sum += p;
            for (int c = 0; c < d; c++)
                o[c] += p * kvcap_load_elem(rows->dtype, rows->v, (size_t)j * rows->row_stride + c);
        }
        for (int c = 0; c < d; c++)
            of[c] = (float)o[c];
        merge_one(acc, qi, d, fmx, (float)sum, of);
    }
    free(o);
    free(of);
    if (bytes)
        *bytes = rows_bytes(rows, d);
    return KVCAP_OK;
}

static uint64_t capsule_bytes(const struct kvcap_capsule_maps *maps,
                              const struct kvcap_capsule_span *spans, int n_spans, int d)
{
    uint64_t b = 4u * ((uint64_t)maps->h * maps->m + (uint64_t)maps->m +
                       (uint64_t)maps->rv * maps->m);
    for (int i = 0; i < n_spans; i++)
        if (spans[i].tiles > 0)
            b += kvcap_dtype_size(spans[i].dtype) *
                 ((uint64_t)spans[i].tiles * ((uint64_t)maps->h + maps->rv) * d + (uint64_t)d);
    return b;
}

/* The argument check both capsule kernels share: *cols is the number of columns (Σ tiles × nq),
 * 0 when there is nothing to do. */
static enum kvcap_status capsule_check(const struct kvcap_capsule_maps *maps,
                                       const struct kvcap_capsule_span *spans, int n_spans,
                                       int nq, int d, int max_d, size_t *cols, uint64_t *bytes)
{
    *cols = 0;
    if (bytes)
        *bytes = 0;
    KVCAP_RETURN_IF(!maps || !spans || n_spans < 0 || nq < 0 || d <= 0 || d > max_d,
                    KVCAP_ERR_INVALID_ARGUMENT, "capsule_attend: %s",
                    !maps ? "NULL maps" : !spans ? "NULL spans"
                    : n_spans < 0 || nq < 0 ? "negative span or query count"
                    : "head_dim out of range");
    KVCAP_RETURN_IF(maps->m <= 0 || maps->h < 0 || maps->rv < 0 || (maps->h && !maps->w2) ||
                        !maps->b2 || (maps->rv && !maps->u),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "capsule_attend: maps (m %d, h %d, rv %d) incomplete or out of range",
                    maps->m, maps->h, maps->rv);
    size_t n = 0;
    for (int i = 0; i < n_spans; i++) {
        const struct kvcap_capsule_span *s = &spans[i];
        KVCAP_RETURN_IF(s->tiles < 0 || !kvcap_dtype_is_storage(s->dtype), KVCAP_ERR_INVALID_ARGUMENT,
                        "capsule_attend: span %d: %s", i,
                        s->tiles < 0 ? "negative tile count" : "not F32, F16 or BF16");
        if (s->tiles == 0)
            continue;
        KVCAP_RETURN_IF(!s->q || !s->mu || (maps->h && !s->hs) || (maps->rv && !s->vt),
                        KVCAP_ERR_INVALID_ARGUMENT, "capsule_attend: span %d: NULL %s", i,
                        !s->q ? "queries" : !s->mu ? "mu" : !s->vt ? "values" : "keys");
        n += (size_t)s->tiles * (size_t)nq;
    }
    KVCAP_RETURN_IF(n > INT_MAX, KVCAP_ERR_INVALID_ARGUMENT,
                    "capsule_attend: %zu columns (tiles × queries) exceed %d", n, INT_MAX);
    *cols = n;
    return KVCAP_OK;
}

enum kvcap_status kvcap_capsule_attend_ref(const struct kvcap_capsule_maps *maps,
                                           const struct kvcap_capsule_span *spans, int n_spans,
                                           int nq, int d, float scale, uint64_t *bytes)
{
    size_t cols;
    KVCAP_TRY(capsule_check(maps, spans, n_spans, nq, d, INT_MAX, &cols, bytes));
    if (cols == 0)
        return KVCAP_OK;
    int m = maps->m, h = maps->h, rv = maps->rv, max_tiles = 0;
    for (int i = 0; i < n_spans; i++)
        max_tiles = spans[i].tiles > max_tiles ? spans[i].tiles : max_tiles;
    double *s = malloc(sizeof(double) * (size_t)max_tiles * m);
    double *z = malloc(sizeof(double) * (size_t)(h + 1));
    double *o = malloc(sizeof(double) * (size_t)d);
    float *of = malloc(sizeof(float) * (size_t)d);
    if (!s || !z || !o || !of) {
        free(s);
        free(z);
        free(o);
        free(of);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "capsule_attend_ref: working memory for %d "
                          "tiles of %d points", max_tiles, m);
    }
    for (int i = 0; i < n_spans; i++) {
        const struct kvcap_capsule_span *sp = &spans[i];
        int T = sp->tiles;
        if (T == 0)
            continue;
        for (int qi = 0; qi < nq; qi++) {
            const float *qv = sp->q + (size_t)qi * d;
            double sumq = 0;
            for (int c = 0; c < d; c++)
                sumq += qv[c];
            /* scores s_t = W2ᵀ (H_t q') + b2 sum(q'), scaled */
            double mx = -INFINITY;
            for (int t = 0; t < T; t++) {
                for (int a = 0; a < h; a++) {
                    z[a] = 0;
                    for (int c = 0; c < d; c++)
                        z[a] += kvcap_load_elem(sp->dtype, sp->hs, ((size_t)t * h + a) * d + c) *
                                qv[c];
                }
                for (int j = 0; j < m; j++) {
                    double v = (double)maps->b2[j] * sumq;
                    for (int a = 0; a < h; a++)
                        v += (double)maps->w2[(size_t)a * m + j] * z[a];
                    v *= scale;
                    s[(size_t)t * m + j] = v;
                    mx = v > mx ? v : mx;
                }
            }
            float fmx = (float)mx; /* see kvcap_attend_rows_ref */
            double sum = 0;
            for (size_t j = 0; j < (size_t)T * m; j++) {
                s[j] = exp(s[j] - (double)fmx);
                sum += s[j];
            }
            /* o = Σ_t Ṽ_tᵀ (U p_t) + (Σ p) μ */
            for (int c = 0; c < d; c++)
                o[c] = sum * kvcap_load_elem(sp->dtype, sp->mu, (size_t)c);
            for (int t = 0; t < T; t++)
                for (int r = 0; r < rv; r++) {
                    double y = 0;
                    for (int j = 0; j < m; j++)
                        y += (double)maps->u[(size_t)r * m + j] * s[(size_t)t * m + j];
                    for (int c = 0; c < d; c++)
                        o[c] +=
                            y * kvcap_load_elem(sp->dtype, sp->vt, ((size_t)t * rv + r) * d + c);
                }
            for (int c = 0; c < d; c++)
                of[c] = (float)o[c];
            merge_one(sp->acc, qi, d, fmx, (float)sum, of);
        }
    }
    free(s);
    free(z);
    free(o);
    free(of);
    if (bytes)
        *bytes = capsule_bytes(maps, spans, n_spans, d);
    return KVCAP_OK;
}

/* ---- Element helpers ---------------------------------------------------------------------- */

/* exp(x) for the softmax, Cephes expf's polynomial on r = x - n ln2 (about 1 ulp), with n
 * rounded by the 1.5·2^23 trick. Written without branches, float-to-int conversions or libm so
 * that loops over it vectorise under the default -ftrapping-math. Valid for x <= 88; x below
 * -87 (incl. -inf) and NaN give exactly 0, which is what a softmax weight should be. */
#define ATTN_EXP_LO -87.0f
#define ATTN_EXP_MAGIC 12582912.0f /* 1.5 * 2^23: adding it rounds to an integer */
#define ATTN_EXP_MAGIC_BITS 0x4B400000u
#define ATTN_LN2_HI 0.693359375f
#define ATTN_LN2_LO -2.12194440e-4f
#define ATTN_LOG2E 1.44269504088896341f
#define ATTN_P0 1.9875691500e-4f
#define ATTN_P1 1.3981999507e-3f
#define ATTN_P2 8.3334519073e-3f
#define ATTN_P3 4.1665795894e-2f
#define ATTN_P4 1.6666665459e-1f
#define ATTN_P5 5.0000001201e-1f

ATTN_INLINE float exp_approx(float x)
{
    float t = x * ATTN_LOG2E + ATTN_EXP_MAGIC;
    float n = t - ATTN_EXP_MAGIC;
    uint32_t e = (kvcap_f32_bits(t) - ATTN_EXP_MAGIC_BITS + 127u) << 23; /* 2^n */
    float r = x - n * ATTN_LN2_HI;
    r = r - n * ATTN_LN2_LO;
    float y = ATTN_P0;
    y = y * r + ATTN_P1;
    y = y * r + ATTN_P2;
    y = y * r + ATTN_P3;
    y = y * r + ATTN_P4;
    y = y * r + ATTN_P5;
    y = y * r * r + r + 1.0f;
    uint32_t keep = 0u - (uint32_t)(x >= ATTN_EXP_LO);
    return kvcap_bits_f32(kvcap_f32_bits(y * kvcap_bits_f32(e)) & keep);
}

/* 2^x for the tiled capsule maps, whose scores are kept in log2 units (log2 e folded into the
 * score scale), so the range reduction is one rounding: n = round(x), r = x - n (exact), 2^r
 * by a degree-5 polynomial fitted for relative error on [-1/2, 1/2] (2.4e-7 in float, about
 * 2 ulp), 2^n added to the exponent field. x is clamped at -126 (2^-126, a weight of ~1e-38
 * rather than 0); x must be <= 0 (a softmax shift), and is never -inf or NaN there. */
#define ATTN_EXP2_LO -126.0f
#define ATTN_LN2 0.693147180559945f
#define ATTN_E2_C0 1.000000119e+00f
#define ATTN_E2_C1 6.931469440e-01f
#define ATTN_E2_C2 2.402212024e-01f
#define ATTN_E2_C3 5.550713092e-02f
#define ATTN_E2_C4 9.675541893e-03f
#define ATTN_E2_C5 1.327647245e-03f

ATTN_INLINE float exp2_approx(float x)
{
    x = x > ATTN_EXP2_LO ? x : ATTN_EXP2_LO;
    float t = x + ATTN_EXP_MAGIC;
    float r = x - (t - ATTN_EXP_MAGIC);
    float y = ATTN_E2_C5;
    y = y * r + ATTN_E2_C4;
    y = y * r + ATTN_E2_C3;
    y = y * r + ATTN_E2_C2;
    y = y * r + ATTN_E2_C1;
    y = y * r + ATTN_E2_C0;
    return kvcap_bits_f32(kvcap_f32_bits(y) + (kvcap_f32_bits(t) << 23)); /* the low bits of t are n */
}

/* ---- Kernel bodies in portable C (also inlined into the AVX2 set for loads and tails) ------ */

/* Block softmax for one query group: sc [nr][8] raw dot products -> sc = scaled scores ->
 * probabilities exp(s - m_new); m8/s8 (running max and sum per lane) are updated and alpha8
 * receives the factor exp(m_old - m_new) by which the caller must rescale its o (0 when the
 * lane had seen nothing). */
ATTN_INLINE void softmax_body(float *sc, int nr, float scale, float *m8, float *s8,
                              float *alpha8)
{
    float bm[ATTN_LANES], add[ATTN_LANES];
    for (int l = 0; l < ATTN_LANES; l++) {
        bm[l] = m8[l];
        add[l] = 0.0f;
    }
    for (int j = 0; j < nr; j++)
        for (int l = 0; l < ATTN_LANES; l++) {
            float x = sc[j * ATTN_LANES + l] * scale;
            sc[j * ATTN_LANES + l] = x;
            bm[l] = x > bm[l] ? x : bm[l];
        }
    for (int l = 0; l < ATTN_LANES; l++) /* 0 for a lane that had seen nothing: -inf -> 0 */
        alpha8[l] = exp_approx(m8[l] - bm[l]);
    for (int j = 0; j < nr; j++)
        for (int l = 0; l < ATTN_LANES; l++) {
            float p = exp_approx(sc[j * ATTN_LANES + l] - bm[l]);
            sc[j * ATTN_LANES + l] = p;
            add[l] += p;
        }
    for (int l = 0; l < ATTN_LANES; l++) {
        s8[l] = s8[l] * alpha8[l] + add[l];
        m8[l] = bm[l];
    }
}

/* Capsule scores, one row j of S [m][cols]: s = scale (s + b2_j sum(q')), column max. */
ATTN_INLINE void bias_max_body(float *s, float b, const float *sq, float *cmax, size_t n,
                               float scale)
{
    for (size_t i = 0; i < n; i++) {
        float x = scale * (s[i] + b * sq[i]);
        s[i] = x;
        cmax[i] = x > cmax[i] ? x : cmax[i];
    }
}

/* Capsule probabilities, one row of S: p = exp(s - max of its (span, query)), column sums. */
ATTN_INLINE void exp_cols_body(float *s, const float *cmax, float *csum, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float p = exp_approx(s[i] - cmax[i]);
        s[i] = p;
        csum[i] += p;
    }
}

/* Small capsule maps (tiled: h, rv <= ATTN_SMALL_MAP) skip BLAS, whose packing and beta pass
 * cost more than the product itself at these sizes, and keep a query group's 8 queries in the
 * 8 lanes, the layout the row kernels produce and consume: no transposes between the steps. */
#define ATTN_SMALL_MAP 16

/* Tiles whose scores the fast tile_maps keeps at once: [chunk][m][8] floats, 8 KiB at most
 * unless one tile alone is larger. */
static int tile_chunk(int m)
{
    return m >= 256 ? 1 : 256 / m;
}

/* The maps of T tiles for one query group, each tile on its own shift (merged by the caller):
 *   s_j = scale log2(e) (W2[:, j]ᵀ z_t + b2_j cv), mt = max_j s_j, p_j = 2^(s_j - mt),
 *   st = Σ_j p_j, y_t = U p  (p is never stored; s and mt in log2 units).
 * z [T][h][8], y [T][rv][8], mt and st [T][8], sbuf [tile_chunk(m) + 1][m][8] (scores, and
 * the fast kernel's per-point bias). */
ATTN_INLINE void tile_maps_body(const float *w2, const float *b2, const float *u, int m, int h,
                                int rv, const float *z, const float *cv, float scale, int T,
                                float *y, float *mt, float *st, float *sbuf)
{
    scale *= ATTN_LOG2E;
    for (int t = 0; t < T; t++) {
        const float *zt = z + (size_t)t * h * ATTN_LANES;
        float mx[ATTN_LANES], sum[ATTN_LANES], acc[ATTN_SMALL_MAP][ATTN_LANES];
        for (int l = 0; l < ATTN_LANES; l++)
            mx[l] = -INFINITY;
        for (int j = 0; j < m; j++)
            for (int l = 0; l < ATTN_LANES; l++) {
                float a = b2[j] * cv[l];
                for (int k = 0; k < h; k++)
                    a += w2[(size_t)k * m + j] * zt[k * ATTN_LANES + l];
                a *= scale;
                sbuf[j * ATTN_LANES + l] = a;
                mx[l] = a > mx[l] ? a : mx[l];
            }
        for (int l = 0; l < ATTN_LANES; l++) {
            sum[l] = 0.0f;
            for (int r = 0; r < rv; r++)
                acc[r][l] = 0.0f;
        }
        for (int j = 0; j < m; j++)
            for (int l = 0; l < ATTN_LANES; l++) {
                float p = exp2_approx(sbuf[j * ATTN_LANES + l] - mx[l]);
                sum[l] += p;
                for (int r = 0; r < rv; r++)
                    acc[r][l] += u[(size_t)r * m + j] * p;
            }
        for (int l = 0; l < ATTN_LANES; l++) {
            for (int r = 0; r < rv; r++)
                y[((size_t)t * rv + r) * ATTN_LANES + l] = acc[r][l];
            mt[(size_t)t * ATTN_LANES + l] = mx[l];
            st[(size_t)t * ATTN_LANES + l] = sum[l];
        }
    }
}

/* One shift for a query group's T tiles: mx = max_t mt_t, then mt_t becomes the tile's factor
 * f_t = 2^(mt_t - mx) and sum = Σ_t f_t st_t (all per lane; mt in log2 units). */
ATTN_INLINE void tile_factors_body(float *mt, const float *st, int T, float *mx, float *sum)
{
    for (int l = 0; l < ATTN_LANES; l++) {
        mx[l] = -INFINITY;
        sum[l] = 0.0f;
    }
    for (int t = 0; t < T; t++)
        for (int l = 0; l < ATTN_LANES; l++)
            mx[l] = mt[t * ATTN_LANES + l] > mx[l] ? mt[t * ATTN_LANES + l] : mx[l];
    for (int t = 0; t < T; t++)
        for (int l = 0; l < ATTN_LANES; l++) {
            float f = exp2_approx(mt[t * ATTN_LANES + l] - mx[l]);
            mt[t * ATTN_LANES + l] = f;
            sum[l] += f * st[t * ATTN_LANES + l];
        }
}

/* y_t *= f_t w for the T tiles' y [T][rv][8]: the tile factors and the merge factors w [8]
 * folded into the value weights. */
ATTN_INLINE void tile_scale_body(float *y, const float *f, const float *w, int T, int rv)
{
    for (int t = 0; t < T; t++)
        for (int r = 0; r < rv; r++)
            for (int l = 0; l < ATTN_LANES; l++)
                y[((size_t)t * rv + r) * ATTN_LANES + l] *= f[t * ATTN_LANES + l] * w[l];
}

/* ---- Portable kernels --------------------------------------------------------------------- */

static size_t elem_size(enum kvcap_dtype t)
{
    return t == KVCAP_DTYPE_F32 ? 4 : 2; /* F16, BF16 (callers validate the dtype) */
}

/* nr rows (d elements each, `stride` elements apart, storage dtype) as f32: the data itself for
 * F32, else converted into buf (nr * d <= ATTN_BLOCK_FLOATS). *ld receives the row stride. */
static const float *block_f32(enum kvcap_dtype dt, const void *rows, size_t stride, int nr, int d,
                              float *buf, size_t *ld)
{
    if (dt == KVCAP_DTYPE_F32) {
        *ld = stride;
        return rows;
    }
    const unsigned char *b = rows;
    if (stride == (size_t)d) /* contiguous rows: one conversion for the block */
        kvcap_load_f32_portable(dt, b, (size_t)nr * d, buf);
    else
        for (int j = 0; j < nr; j++)
            kvcap_load_f32_portable(dt, b + (size_t)j * stride * 2, (size_t)d, buf + (size_t)j * d);
    *ld = (size_t)d;
    return buf;
}

/* Queries packed for the score kernels: d rounded up to 8 (dp), each group of up to 8
 * queries as [dp/8][ng][8], so the ng vectors one 8-column step needs are adjacent and the
 * FMAs take them straight from L1 through one pointer (from ng separate rows, GCC ran out of
 * registers and copied query vectors to the stack in the inner loop, at 45 % of the FMA peak
 * where the packed loop runs at 70-80 %). Group g starts at g * 8 * dp; past d, zeros. */
static int packed_dim(int d)
{
    return (d + 7) & ~7;
}

static size_t packed_floats(int nq, int d)
{
    return (size_t)nq * (size_t)packed_dim(d);
}

static void pack_queries(const float *q, int nq, int d, float *qp)
{
    int dp = packed_dim(d);
    for (int g = 0; g < nq; g += ATTN_LANES) {
        int ng = nq - g < ATTN_LANES ? nq - g : ATTN_LANES;
        float *dst = qp + (size_t)g * dp;
        for (int c = 0; c < dp; c += 8)
            for (int l = 0; l < ng; l++)
                for (int u = 0; u < 8; u++)
                    *dst++ = c + u < d ? q[(size_t)(g + l) * d + c + u] : 0.0f;
    }
}

/* The packed group that starts at query g. */
static const float *packed_group(const float *qp, int g, int d)
{
    return qp + (size_t)g * (size_t)packed_dim(d);
}

/* Element c of query l in a group packed with ng queries. */
ATTN_INLINE float packed_at(const float *qp, int ng, int l, int c)
{
    return qp[(size_t)(c & ~7) * ng + (size_t)l * 8 + (c & 7)];
}

/* out[j][l] = k_j · q_l for l < nq; nr rows from `k` (storage dtype, `ks` elements apart); qp
 * is one group packed by pack_queries. Rows of out are `ls` floats apart: ATTN_LANES (the lane
 * layout, lanes >= nq set to 0) or nq (compact). */
static void scores_generic(enum kvcap_dtype dt, const void *k, size_t ks, int nr, const float *qp,
                           int nq, int d, float *out, int ls)
{
    float buf[ATTN_BLOCK_FLOATS];
    size_t ld;
    const float *kf = block_f32(dt, k, ks, nr, d, buf, &ld);
    for (int j = 0; j < nr; j++) {
        const float *kr = kf + (size_t)j * ld;
        for (int l = 0; l < ls; l++) {
            float v = 0.0f;
            if (l < nq) {
                float a[8] = {0};
                int c = 0;
                for (; c + 8 <= d; c += 8)
                    for (int u = 0; u < 8; u++)
                        a[u] += packed_at(qp, nq, l, c + u) * kr[c + u];
                for (; c < d; c++)
                    a[0] += packed_at(qp, nq, l, c) * kr[c];
                v = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
            }
            out[(size_t)j * ls + l] = v;
        }
    }
}

/* o[l][:] += Σ_j w[j][l] v_j for l < nq; rows of w are `ls` floats apart (as in the scores). */
static void accum_generic(enum kvcap_dtype dt, const void *v, size_t vs, int nr, const float *w,
                          int nq, int d, float *o, int ls)
{
    float buf[ATTN_BLOCK_FLOATS];
    size_t ld;
    const float *vf = block_f32(dt, v, vs, nr, d, buf, &ld);
    for (int l = 0; l < nq; l++) {
        float *ol = o + (size_t)l * d;
        int c = 0;
        for (; c + 16 <= d; c += 16) { /* 16 accumulators the compiler keeps in registers */
            float a[16];
            for (int u = 0; u < 16; u++)
                a[u] = ol[c + u];
            for (int j = 0; j < nr; j++) {
                float wl = w[(size_t)j * ls + l];
                const float *vr = vf + (size_t)j * ld + c;
                for (int u = 0; u < 16; u++)
                    a[u] += wl * vr[u];
            }
            for (int u = 0; u < 16; u++)
                ol[c + u] = a[u];
        }
        for (; c < d; c++) {
            float a = ol[c];
            for (int j = 0; j < nr; j++)
                a += w[(size_t)j * ls + l] * vf[(size_t)j * ld + c];
            ol[c] = a;
        }
    }
}

static void softmax_generic(float *sc, int nr, float scale, float *m8, float *s8, float *a8)
{
    softmax_body(sc, nr, scale, m8, s8, a8);
}

static void bias_max_generic(float *s, float b, const float *sq, float *cmax, size_t n,
                             float scale)
{
    bias_max_body(s, b, sq, cmax, n, scale);
}

static void exp_cols_generic(float *s, const float *cmax, float *csum, size_t n)
{
    exp_cols_body(s, cmax, csum, n);
}

static void tile_factors_generic(float *mt, const float *st, int T, float *mx, float *sum)
{
    tile_factors_body(mt, st, T, mx, sum);
}

static void tile_scale_generic(float *y, const float *f, const float *w, int T, int rv)
{
    tile_scale_body(y, f, w, T, rv);
}

static void tile_maps_generic(const float *w2, const float *b2, const float *u, int m, int h,
                              int rv, const float *z, const float *cv, float scale, int T, int nq,
                              float *y, float *mt, float *st, float *sbuf)
{
    (void)nq;
    tile_maps_body(w2, b2, u, m, h, rv, z, cv, scale, T, y, mt, st, sbuf);
}

/* ---- AVX2 + FMA + F16C kernels (x86, chosen at run time) ---------------------------------- */
#if ATTN_X86
#  define ATTN_AVX2 __attribute__((target("avx2,fma,f16c")))
#  define ATTN_AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* Eight 8-lane accumulators -> one vector of their eight horizontal sums. */
ATTN_AVX2_INLINE __m256 hsum8_avx2(const __m256 *a)
{
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8 elements (from element c) of a row in storage dtype DT (0 F32, 1 F16, 2 BF16) as f32:
 * the conversion happens in registers, so 16-bit rows are read once, never expanded in memory. */
ATTN_AVX2_INLINE __m256 load8_avx2(const unsigned char *row, int c, const int DT)
{
    if (DT == 1)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(row + 2 * (size_t)c)));
    if (DT == 2)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(row + 2 * (size_t)c))),
            16));
    return _mm256_loadu_ps((const float *)(const void *)(row + 4 * (size_t)c));
}

ATTN_INLINE float load1(const unsigned char *row, int c, const int DT)
{
    uint16_t h;
    float f;
    if (DT == 1) {
        memcpy(&h, row + 2 * (size_t)c, 2);
        return kvcap_f16_to_f32_fast(h);
    }
    if (DT == 2) {
        memcpy(&h, row + 2 * (size_t)c, 2);
        return kvcap_bits_f32((uint32_t)h << 16);
    }
    memcpy(&f, row + 4 * (size_t)c, 4);
    return f;
}

/* All-ones in lanes [0, n), zero after: a mask for the first n lanes. */
ATTN_AVX2_INLINE __m256i lane_prefix_avx2(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Stores the scores of P rows from r0, lane p*NQ + l of `sum` (lanes past P*NQ are 0), as
 * rows `ls` floats apart: the lane layout (ls = ATTN_LANES, lanes >= NQ zero) or compact
 * (ls = NQ, so the P rows are P*NQ consecutive floats). */
ATTN_AVX2_INLINE void store_scores_avx2(__m256 sum, float *out, int r0, const int P,
                                        const int NQ, int ls)
{
    if (ls != ATTN_LANES) {
        if (P * NQ == ATTN_LANES) {
            _mm256_storeu_ps(out + (size_t)r0 * NQ, sum);
        } else {
            _mm256_maskstore_ps(out + (size_t)r0 * NQ, lane_prefix_avx2(P * NQ), sum);
        }
        return;
    }
    if (P == 1) {
        _mm256_storeu_ps(out + (size_t)r0 * ATTN_LANES, sum);
        return;
    }
    float t[ATTN_LANES];
    _mm256_storeu_ps(t, sum);
#  pragma GCC unroll 8
    for (int p = 0; p < P; p++) {
        _mm256_storeu_ps(out + (size_t)(r0 + p) * ATTN_LANES, _mm256_setzero_ps());
#  pragma GCC unroll 8
        for (int l = 0; l < NQ; l++)
            out[(size_t)(r0 + p) * ATTN_LANES + l] = t[p * NQ + l];
    }
}

/* Scores of R rows (kb bytes apart) against NQ queries (one packed group, pack_queries) with
 * R * NQ <= 16 accumulators, one FMA chain each: enough independent chains to hide the FMA
 * latency whatever NQ is. P rows share one horizontal sum (lane p*NQ + l). */
ATTN_AVX2_INLINE void scores_tile_avx2(const unsigned char *k, size_t kb, const float *q, int d,
                                       float *out, int ls, const int R, const int NQ,
                                       const int DT)
{
    const int P = 8 / NQ < R ? 8 / NQ : R; /* R is 1 or a multiple of 8 / NQ */
    __m256 acc[16], qv[8];
#  pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        acc[i] = _mm256_setzero_ps();
    int c = 0;
    for (; c + 8 <= d; c += 8) {
#  pragma GCC unroll 8
        for (int l = 0; l < NQ; l++) /* adjacent: the compiler folds them into the FMAs */
            qv[l] = _mm256_loadu_ps(q + (size_t)c * NQ + 8 * l);
#  pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m256 kv = load8_avx2(k + (size_t)r * kb, c, DT);
#  pragma GCC unroll 8
            for (int l = 0; l < NQ; l++)
                acc[r * NQ + l] = _mm256_fmadd_ps(qv[l], kv, acc[r * NQ + l]);
        }
    }
#  pragma GCC unroll 8
    for (int r0 = 0; r0 < R; r0 += P) {
        __m256 part[8];
#  pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            part[i] = i < P * NQ ? acc[r0 * NQ + i] : _mm256_setzero_ps();
        __m256 sum = hsum8_avx2(part); /* lanes past P*NQ are 0 */
        float t[8];
        if (c < d) { /* d not a multiple of 8 */
            _mm256_storeu_ps(t, sum);
            for (int p = 0; p < P; p++)
                for (int l = 0; l < NQ; l++)
                    for (int cc = c; cc < d; cc++)
                        t[p * NQ + l] += packed_at(q, NQ, l, cc) *
                                         load1(k + (size_t)(r0 + p) * kb, cc, DT);
            sum = _mm256_loadu_ps(t);
        }
        store_scores_avx2(sum, out, r0, P, NQ, ls);
    }
}

/* One query, 8 rows: each row's dot product runs to its end before the next row starts, so the
 * rows are read in address order (on cold rows the hardware prefetchers keep up better than
 * with the column order above); two FMA chains per row, and the out-of-order core overlaps
 * consecutive rows. One horizontal sum for the 8 rows. */
ATTN_AVX2_INLINE void scores_rows1_avx2(const unsigned char *k, size_t kb, const float *q, int d,
                                        float *out, int r0, int ls, const int DT)
{
    __m256 acc[8];
#  pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
        const unsigned char *kr = k + (size_t)r * kb;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int c = 0;
        for (; c + 16 <= d; c += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8_avx2(kr, c, DT), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), load8_avx2(kr, c + 8, DT), a1);
        }
        for (; c + 8 <= d; c += 8)
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8_avx2(kr, c, DT), a0);
        acc[r] = _mm256_add_ps(a0, a1);
    }
    store_scores_avx2(hsum8_avx2(acc), out, r0, 8, 1, ls);
}

/* Four accumulators -> their four horizontal sums, in order, in one 128-bit vector (the same
 * additions, in the same order, as hsum8_avx2 makes for each of its eight). */
ATTN_AVX2_INLINE __m128 hsum4_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* The dot products of 3 rows with N <= 4 queries into acc[r*N + l]; q is the pass's first
 * query within a packed group of QN (pack_queries: 8 columns of each of the QN queries, then
 * the next 8), so a second pass starts at the group's q + 8 * (its first query). Each 8
 * columns of a query are loaded once into a register and serve the 3 rows: 3N accumulators +
 * 3 rows + 1 query fit the 16 registers, so this makes 3 + N loads per 3N FMAs, where
 * scores_tile_avx2 at NQ > 4 (too many accumulators to keep the queries in registers) loads a
 * query operand for every FMA and the load ports, not the FMAs, set its pace. */
ATTN_AVX2_INLINE void scores_pass3_avx2(const unsigned char *k, size_t kb, const float *q, int d,
                                        __m256 *acc, const int N, const int QN, const int DT)
{
#  pragma GCC unroll 12
    for (int i = 0; i < 3 * N; i++)
        acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
        __m256 kv[3];
#  pragma GCC unroll 3
        for (int r = 0; r < 3; r++)
            kv[r] = load8_avx2(k + (size_t)r * kb, c, DT);
#  pragma GCC unroll 4
        for (int l = 0; l < N; l++) {
            __m256 qv = _mm256_loadu_ps(q + (size_t)c * QN + 8 * l);
#  pragma GCC unroll 3
            for (int r = 0; r < 3; r++)
                acc[r * N + l] = _mm256_fmadd_ps(qv, kv[r], acc[r * N + l]);
        }
    }
}

/* Stores the sums of scores_pass3_avx2's accumulators at out + r*ls (4 lanes, zero past N). */
ATTN_AVX2_INLINE void scores_store3_avx2(const __m256 *a, float *out, int ls, const int N)
{
    const __m256 z = _mm256_setzero_ps();
#  pragma GCC unroll 3
    for (int r = 0; r < 3; r++)
        _mm_storeu_ps(out + (size_t)r * ls,
                      hsum4_avx2(a[r * N], N > 1 ? a[r * N + 1] : z, N > 2 ? a[r * N + 2] : z,
                                 N > 3 ? a[r * N + 3] : z));
}

/* Scores of 3 rows against NQ in [4, 8] queries: queries 0..3, then 4..NQ-1, as two passes over
 * the rows (the second reads them from L1). Lane layout (ls = ATTN_LANES) or, for NQ = 4,
 * compact. */
ATTN_AVX2_INLINE void scores_rows3_avx2(const unsigned char *k, size_t kb, const float *q, int d,
                                        float *out, int ls, const int NQ, const int DT)
{
    __m256 acc[12];
    scores_pass3_avx2(k, kb, q, d, acc, 4, NQ, DT);
    scores_store3_avx2(acc, out, ls, 4);
    if (NQ > 4) {
        scores_pass3_avx2(k, kb, q + 32, d, acc, NQ - 4, NQ, DT);
        scores_store3_avx2(acc, out + 4, ls, NQ - 4);
    } else if (ls == ATTN_LANES) {
#  pragma GCC unroll 3
        for (int r = 0; r < 3; r++)
            _mm_storeu_ps(out + (size_t)r * ls + 4, _mm_setzero_ps());
    }
}

ATTN_AVX2_INLINE void scores_nq_avx2(const unsigned char *k, size_t kb, int nr, const float *q,
                                     int d, float *out, int ls, const int NQ, const int DT)
{
    const int R = NQ == 1 ? 8 : NQ <= 3 ? 4 : NQ <= 7 ? 2 : 1; /* R*NQ <= 16, R multiple of P */
    int j = 0;
    if (NQ == 1 && d % 8 == 0) /* packed_group: one query is its d floats, in order */
        for (; j + 8 <= nr; j += 8)
            scores_rows1_avx2(k + (size_t)j * kb, kb, q, d, out, j, ls, DT);
    if (NQ >= 4 && d % 8 == 0 && (ls == ATTN_LANES || (NQ == 4 && ls == 4)))
        for (; j + 3 <= nr; j += 3)
            scores_rows3_avx2(k + (size_t)j * kb, kb, q, d, out + (size_t)j * ls, ls, NQ, DT);
    for (; j + R <= nr; j += R)
        scores_tile_avx2(k + (size_t)j * kb, kb, q, d, out + (size_t)j * ls, ls, R, NQ, DT);
    for (; j < nr; j++)
        scores_tile_avx2(k + (size_t)j * kb, kb, q, d, out + (size_t)j * ls, ls, 1, NQ, DT);
}

/* o[l][c0 : c0+8*CH] += Σ_j w[j][l] v_j[...] for NQ <= 4 queries; NQ * CH accumulators (8 or
 * 9 FMA chains in flight) stay in registers over the whole block, next to the CH converted
 * columns of a row and the NQ broadcast weights.
 * With `ahead`, each row also prefetches the lines this sweep is the first to touch, of the row
 * `ahead` bytes further on (the next block's). The sweeps go down the block's rows a few columns
 * at a time, so a row's lines are first touched sweeps apart: on cold rows each such sweep would
 * wait for a burst of misses that the hardware prefetchers, which follow address order, do not
 * foresee; prefetched one block ahead, they arrive while this block computes. */
ATTN_AVX2_INLINE void accum_tile_avx2(const unsigned char *v, size_t vb, int nr, const float *w,
                                      int ls, float *o, int d, int c0, const int CH,
                                      const int NQ, const int DT, size_t ahead)
{
    const int ES = DT == 0 ? 4 : 2, NL = (8 * CH * ES + 63) / 64; /* lines a sweep can start */
    const int first = (c0 * ES + 63) / 64 * 64, end = (c0 + 8 * CH) * ES;
    const int npf = !ahead ? 0 : end > first ? (end - first + 63) / 64 : 0;
    __m256 acc[16], vv[8], wb[4];
#  pragma GCC unroll 4
    for (int l = 0; l < NQ; l++)
#  pragma GCC unroll 8
        for (int hh = 0; hh < CH; hh++)
            acc[l * CH + hh] = _mm256_loadu_ps(o + (size_t)l * d + c0 + 8 * hh);
    for (int j = 0; j < nr; j++) {
        const unsigned char *vr = v + (size_t)j * vb;
#  pragma GCC unroll 4
        for (int i = 0; i < NL; i++)
            if (i < npf)
                _mm_prefetch((const char *)(vr + ahead + first + 64 * i), _MM_HINT_T0);
#  pragma GCC unroll 4
        for (int l = 0; l < NQ; l++)
            wb[l] = _mm256_broadcast_ss(w + (size_t)j * ls + l);
#  pragma GCC unroll 8
        for (int hh = 0; hh < CH; hh++) {
            vv[hh] = load8_avx2(vr, c0 + 8 * hh, DT);
#  pragma GCC unroll 4
            for (int l = 0; l < NQ; l++)
                acc[l * CH + hh] = _mm256_fmadd_ps(wb[l], vv[hh], acc[l * CH + hh]);
        }
    }
#  pragma GCC unroll 4
    for (int l = 0; l < NQ; l++)
#  pragma GCC unroll 8
        for (int hh = 0; hh < CH; hh++)
            _mm256_storeu_ps(o + (size_t)l * d + c0 + 8 * hh, acc[l * CH + hh]);
}

ATTN_AVX2_INLINE void accum_part_avx2(const unsigned char *v, size_t vb, int nr, const float *w,
                                      int ls, int d, float *o, const int NQ, const int DT,
                                      size_t ahead)
{
    const int CH = NQ == 1 ? 8 : NQ == 2 ? 4 : NQ == 3 ? 3 : 2;
    int c = 0;
    for (; c + 8 * CH <= d; c += 8 * CH)
        accum_tile_avx2(v, vb, nr, w, ls, o, d, c, CH, NQ, DT, ahead);
    for (; c + 8 <= d; c += 8)
        accum_tile_avx2(v, vb, nr, w, ls, o, d, c, 1, NQ, DT, ahead);
    for (; c < d; c++)
        for (int l = 0; l < NQ; l++) {
            float a = o[(size_t)l * d + c];
            for (int j = 0; j < nr; j++)
                a += w[(size_t)j * ls + l] * load1(v + (size_t)j * vb, c, DT);
            o[(size_t)l * d + c] = a;
        }
}

/* Groups of 5..8 queries go as 4 + the rest, each over the whole block (the second pass reads
 * the block from L1): one pass over 8 would hold 8 weights and 8 accumulators per column
 * vector, so it could keep only one column vector in flight and would load a weight per FMA. */
ATTN_AVX2_INLINE void accum_nq_avx2(const unsigned char *v, size_t vb, int nr, const float *w,
                                    int ls, int d, float *o, const int NQ, const int DT)
{
    if (NQ <= 4) { /* prefetching ahead: cold, 2-6 % slower at 1 and 2 queries, no faster at 4 */
        accum_part_avx2(v, vb, nr, w, ls, d, o, NQ, DT, 0);
        return;
    }
    /* the next block, where rows are contiguous: cold, 1-9 % faster at 7 queries, 11 % at 8 */
    accum_part_avx2(v, vb, nr, w, ls, d, o, 4, DT, (size_t)nr * vb);
    accum_part_avx2(v, vb, nr, w + 4, ls, d, o + (size_t)4 * d, NQ - 4, DT, 0);
}

/* One specialisation per (dtype, group size), so every loop above has constant bounds. */
#  define ATTN_NQ_CASES(CALL, DT)                                                            \
      switch (nq) {                                                                          \
      case 1: CALL(1, DT); break;                                                            \
      case 2: CALL(2, DT); break;                                                            \
      case 3: CALL(3, DT); break;                                                            \
      case 4: CALL(4, DT); break;                                                            \
      case 5: CALL(5, DT); break;                                                            \
      case 6: CALL(6, DT); break;                                                            \
      case 7: CALL(7, DT); break;                                                            \
      default: CALL(8, DT); break;                                                           \
      }
#  define ATTN_DT_NQ_CASES(CALL)                                                             \
      if (dt == KVCAP_DTYPE_F16)                                                             \
          ATTN_NQ_CASES(CALL, 1)                                                             \
      else if (dt == KVCAP_DTYPE_BF16)                                                       \
          ATTN_NQ_CASES(CALL, 2)                                                             \
      else                                                                                   \
          ATTN_NQ_CASES(CALL, 0)

static ATTN_AVX2 void scores_avx2(enum kvcap_dtype dt, const void *k, size_t ks, int nr,
                                  const float *q, int nq, int d, float *out, int ls)
{
    size_t kb = ks * elem_size(dt);
#  define ATTN_SCORES_CALL(N, DT) scores_nq_avx2(k, kb, nr, q, d, out, ls, N, DT)
    ATTN_DT_NQ_CASES(ATTN_SCORES_CALL)
#  undef ATTN_SCORES_CALL
}

static ATTN_AVX2 void accum_avx2(enum kvcap_dtype dt, const void *v, size_t vs, int nr,
                                 const float *w, int nq, int d, float *o, int ls)
{
    size_t vb = vs * elem_size(dt);
#  define ATTN_ACCUM_CALL(N, DT) accum_nq_avx2(v, vb, nr, w, ls, d, o, N, DT)
    ATTN_DT_NQ_CASES(ATTN_ACCUM_CALL)
#  undef ATTN_ACCUM_CALL
}

/* exp_approx on 8 lanes (with FMA; the same constants and the same 0 below -87). */
ATTN_AVX2_INLINE __m256 exp_avx2(__m256 x)
{
    const __m256 magic = _mm256_set1_ps(ATTN_EXP_MAGIC);
    __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(ATTN_LOG2E), magic);
    __m256 n = _mm256_sub_ps(t, magic);
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(_mm256_castps_si256(t),
                                          _mm256_set1_epi32((int)ATTN_EXP_MAGIC_BITS)),
                         _mm256_set1_epi32(127)),
        23);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ATTN_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ATTN_LN2_LO), r);
    __m256 y = _mm256_set1_ps(ATTN_P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ATTN_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ATTN_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ATTN_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ATTN_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ATTN_P5));
    y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(ATTN_EXP_LO), _CMP_GE_OQ);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

/* exp2_approx on 8 lanes. */
ATTN_AVX2_INLINE __m256 exp2_avx2(__m256 x)
{
    const __m256 magic = _mm256_set1_ps(ATTN_EXP_MAGIC);
    x = _mm256_max_ps(x, _mm256_set1_ps(ATTN_EXP2_LO));
    __m256 t = _mm256_add_ps(x, magic);
    __m256 r = _mm256_sub_ps(x, _mm256_sub_ps(t, magic));
    __m256 y = _mm256_set1_ps(ATTN_E2_C5);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ATTN_E2_C4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ATTN_E2_C3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ATTN_E2_C2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ATTN_E2_C1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(ATTN_E2_C0));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y),
                                                _mm256_slli_epi32(_mm256_castps_si256(t), 23)));
}

static ATTN_AVX2 void softmax_avx2(float *sc, int nr, float scale, float *m8, float *s8,
                                   float *a8)
{
    const __m256 vscale = _mm256_set1_ps(scale);
    __m256 m = _mm256_loadu_ps(m8), bm = m, add = _mm256_setzero_ps();
    for (int j = 0; j < nr; j++) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(sc + j * ATTN_LANES), vscale);
        _mm256_storeu_ps(sc + j * ATTN_LANES, x);
        bm = _mm256_max_ps(x, bm);
    }
    __m256 alpha = exp_avx2(_mm256_sub_ps(m, bm));
    for (int j = 0; j < nr; j++) {
        __m256 p = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(sc + j * ATTN_LANES), bm));
        _mm256_storeu_ps(sc + j * ATTN_LANES, p);
        add = _mm256_add_ps(add, p);
    }
    _mm256_storeu_ps(s8, _mm256_fmadd_ps(_mm256_loadu_ps(s8), alpha, add));
    _mm256_storeu_ps(m8, bm);
    _mm256_storeu_ps(a8, alpha);
}

static ATTN_AVX2 void bias_max_avx2(float *s, float b, const float *sq, float *cmax, size_t n,
                                    float scale)
{
    const __m256 vb = _mm256_set1_ps(b), vscale = _mm256_set1_ps(scale);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_fmadd_ps(vb, _mm256_loadu_ps(sq + i), _mm256_loadu_ps(s + i));
        x = _mm256_mul_ps(x, vscale);
        _mm256_storeu_ps(s + i, x);
        _mm256_storeu_ps(cmax + i, _mm256_max_ps(x, _mm256_loadu_ps(cmax + i)));
    }
    bias_max_body(s + i, b, sq + i, cmax + i, n - i, scale);
}

static ATTN_AVX2 void exp_cols_avx2(float *s, const float *cmax, float *csum, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 p = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_loadu_ps(cmax + i)));
        _mm256_storeu_ps(s + i, p);
        _mm256_storeu_ps(csum + i, _mm256_add_ps(_mm256_loadu_ps(csum + i), p));
    }
    exp_cols_body(s + i, cmax + i, csum + i, n - i);
}

/* The scores of one vector of columns (a query group's lanes, or packed tiles) over a tile's m
 * points, with a compile-time reconstructor width H: zc the scaled z per k, bias [m][8];
 * s [m][8] in log2 units; returns the max over the m points. */
ATTN_AVX2_INLINE __m256 map_scores_avx2(const float *w2, const float *bias, int m,
                                        const __m256 *zc, float *s, const int H)
{
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < m; j++) {
        __m256 a = _mm256_loadu_ps(bias + j * ATTN_LANES);
#  pragma GCC unroll 16
        for (int k = 0; k < H; k++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(w2[(size_t)k * m + j]), zc[k], a);
        _mm256_storeu_ps(s + j * ATTN_LANES, a);
        mx = _mm256_max_ps(a, mx);
    }
    return mx;
}

/* Scores of tiles [t0, t1) with a compile-time reconstructor width H (so the scaled z_t stay in
 * registers): s [t - t0][m][8] in log2 units and each tile's max into mt. */
ATTN_AVX2_INLINE void tile_scores_avx2(const float *w2, const float *bias, int m, const float *z,
                                       __m256 vscale, int t0, int t1, float *s, float *mt,
                                       const int H)
{
    for (int t = t0; t < t1; t++) {
        const float *zt = z + (size_t)t * H * ATTN_LANES;
        float *st = s + (size_t)(t - t0) * m * ATTN_LANES;
        __m256 zc[ATTN_SMALL_MAP + 1];
#  pragma GCC unroll 16
        for (int k = 0; k < H; k++) /* scale folded into z: s_j = W2[:, j]ᵀ (scale z) + ... */
            zc[k] = _mm256_mul_ps(_mm256_loadu_ps(zt + k * ATTN_LANES), vscale);
        _mm256_storeu_ps(mt + (size_t)t * ATTN_LANES, map_scores_avx2(w2, bias, m, zc, st, H));
    }
}

/* Probabilities, sums and y = U p of tiles [t0, t1) with a compile-time value rank RV (the
 * RV accumulators stay in registers). */
ATTN_AVX2_INLINE void tile_values_avx2(const float *u, int m, const float *s, int t0, int t1,
                                       float *y, const float *mt, float *st, const int RV)
{
    for (int t = t0; t < t1; t++) {
        const float *sc = s + (size_t)(t - t0) * m * ATTN_LANES;
        const __m256 mx = _mm256_loadu_ps(mt + (size_t)t * ATTN_LANES);
        __m256 acc[ATTN_SMALL_MAP + 1], sum = _mm256_setzero_ps();
#  pragma GCC unroll 16
        for (int r = 0; r < RV; r++)
            acc[r] = _mm256_setzero_ps();
        for (int j = 0; j < m; j++) {
            __m256 p = exp2_avx2(_mm256_sub_ps(_mm256_loadu_ps(sc + j * ATTN_LANES), mx));
            sum = _mm256_add_ps(sum, p);
#  pragma GCC unroll 16
            for (int r = 0; r < RV; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(u[(size_t)r * m + j]), p, acc[r]);
        }
#  pragma GCC unroll 16
        for (int r = 0; r < RV; r++)
            _mm256_storeu_ps(y + ((size_t)t * RV + r) * ATTN_LANES, acc[r]);
        _mm256_storeu_ps(st + (size_t)t * ATTN_LANES, sum);
    }
}

#  define ATTN_SMALL_CASES(CALL, v)                                                          \
      switch (v) {                                                                           \
      case 0: CALL(0); break;   case 1: CALL(1); break;   case 2: CALL(2); break;            \
      case 3: CALL(3); break;   case 4: CALL(4); break;   case 5: CALL(5); break;            \
      case 6: CALL(6); break;   case 7: CALL(7); break;   case 8: CALL(8); break;            \
      case 9: CALL(9); break;   case 10: CALL(10); break; case 11: CALL(11); break;          \
      case 12: CALL(12); break; case 13: CALL(13); break; case 14: CALL(14); break;          \
      case 15: CALL(15); break; default: CALL(16); break;                                    \
      }

static ATTN_AVX2 void tile_factors_avx2(float *mt, const float *st, int T, float *mx, float *sum)
{
    __m256 vmx = _mm256_set1_ps(-INFINITY), vsum = _mm256_setzero_ps();
    for (int t = 0; t < T; t++)
        vmx = _mm256_max_ps(_mm256_loadu_ps(mt + t * ATTN_LANES), vmx);
    for (int t = 0; t < T; t++) {
        __m256 f = exp2_avx2(_mm256_sub_ps(_mm256_loadu_ps(mt + t * ATTN_LANES), vmx));
        _mm256_storeu_ps(mt + t * ATTN_LANES, f);
        vsum = _mm256_fmadd_ps(f, _mm256_loadu_ps(st + t * ATTN_LANES), vsum);
    }
    _mm256_storeu_ps(mx, vmx);
    _mm256_storeu_ps(sum, vsum);
}

static ATTN_AVX2 void tile_scale_avx2(float *y, const float *f, const float *w, int T, int rv)
{
    const __m256 vw = _mm256_loadu_ps(w);
    for (int t = 0; t < T; t++) {
        __m256 fw = _mm256_mul_ps(_mm256_loadu_ps(f + t * ATTN_LANES), vw);
        float *yt = y + (size_t)t * rv * ATTN_LANES;
        for (int r = 0; r < rv; r++)
            _mm256_storeu_ps(yt + r * ATTN_LANES,
                             _mm256_mul_ps(_mm256_loadu_ps(yt + r * ATTN_LANES), fw));
    }
}

/* Small query groups (nq <= 4) leave most of the 8 lanes idle in the layout above, so their
 * maps run on packed vectors instead, lane p*nq + l = query l of tile t+p, P = 8 / nq tiles
 * per vector, over the whole span in two passes, so that one shift per query serves every tile
 * (no per-tile shifts, factors or rescaling pass):
 *   span_max_avx2: the scores of every tile, and each query's max (log2 units);
 *   span_values_avx2: the same scores again (the same operations, so the same values),
 *     p = 2^(s - shift) with the caller's shift per query, Σp per query and y = U p.
 * Z comes compact, [T][h][nq] (the score kernel with ls = nq), and Y goes out compact,
 * [T][rv][nq] (the accumulation kernel's weights with ls = nq): both stay in L1 for a span of
 * 8K tokens, where the lane layout would take 8 / nq times the room. */

/* The packed layout's set-up: bias [m][8] = scaled b2_j cv per lane, and the gather indices
 * of z (relative to the group's first tile) for a group of np tiles; missing tiles of a last,
 * short group repeat its last tile. */
ATTN_AVX2_INLINE __m256i packed_setup_avx2(const float *b2, int m, int h, const float *cv,
                                           int nq, __m256 vscale, int np, float *bias)
{
    const int P = ATTN_LANES / nq;
    float cvp[ATTN_LANES] = {0};
    int idx[ATTN_LANES] = {0};
    for (int p = 0; p < P; p++)
        for (int l = 0; l < nq; l++) {
            cvp[p * nq + l] = cv[l];
            idx[p * nq + l] = ((p < np ? p : np - 1) * h) * nq + l;
        }
    const __m256 vcv = _mm256_mul_ps(_mm256_loadu_ps(cvp), vscale);
    for (int j = 0; bias && j < m; j++)
        _mm256_storeu_ps(bias + j * ATTN_LANES, _mm256_mul_ps(_mm256_set1_ps(b2[j]), vcv));
    return _mm256_loadu_si256((const __m256i *)(const void *)idx);
}

/* The scores of the group of tiles from t into s [m][8]; returns their max per lane. */
ATTN_AVX2_INLINE __m256 packed_group_scores_avx2(const float *w2, const float *bias, int m,
                                                 int h, const float *z, int t, int nq,
                                                 __m256i vidx, __m256 vscale, float *s)
{
    __m256 zc[ATTN_SMALL_MAP + 1], mx;
    const float *zt = z + (size_t)t * h * nq;
    for (int k = 0; k < h; k++)
        zc[k] = _mm256_mul_ps(_mm256_i32gather_ps(zt + (size_t)k * nq, vidx, 4), vscale);
#  define ATTN_PACKED_SCORES(H) mx = map_scores_avx2(w2, bias, m, zc, s, H)
    ATTN_SMALL_CASES(ATTN_PACKED_SCORES, h)
#  undef ATTN_PACKED_SCORES
    return mx;
}

/* mx[l] = the max of the lanes of query l. Lanes past (8 / nq) * nq (nq = 3) belong to no
 * tile: their gathers and bias are placeholders, so they must not count. */
static void lanes_max(const float *lanes, int nq, float *mx)
{
    for (int l = 0; l < nq; l++) {
        mx[l] = -INFINITY;
        for (int i = l; i < ATTN_LANES / nq * nq; i += nq)
            mx[l] = lanes[i] > mx[l] ? lanes[i] : mx[l];
    }
}

static ATTN_AVX2 void span_max_avx2(const float *w2, const float *b2, int m, int h,
                                    const float *z, const float *cv, float scale, int T, int nq,
                                    float *sbuf, float *mx)
{
    const int P = ATTN_LANES / nq;
    const __m256 vscale = _mm256_set1_ps(scale * ATTN_LOG2E);
    float *bias = sbuf + (size_t)m * ATTN_LANES;
    __m256i vidx = packed_setup_avx2(b2, m, h, cv, nq, vscale, P, bias);
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (int t = 0; t < T; t += P) {
        if (T - t < P) /* repeated tiles do not change a max */
            vidx = packed_setup_avx2(b2, m, h, cv, nq, vscale, T - t, NULL);
        vmx = _mm256_max_ps(vmx, packed_group_scores_avx2(w2, bias, m, h, z, t, nq, vidx,
                                                          vscale, sbuf));
    }
    float lanes[ATTN_LANES];
    _mm256_storeu_ps(lanes, vmx);
    lanes_max(lanes, nq, mx);
}

/* p = 2^(s - shift) of one group's scores s [m][8] (lanes past `keep` masked out of the sum),
 * and y = U p for the group's np tiles into y [np][RV][NQ]; RV and NQ compile-time, so the RV
 * accumulators stay in registers and the compact stores are plain moves. */
ATTN_AVX2_INLINE __m256 packed_group_values_avx2(const float *u, int m, float *s, __m256 shift,
                                                 __m256 keep, int np, float *y, const int RV,
                                                 const int NQ)
{
    __m256 sum = _mm256_setzero_ps(), acc[ATTN_SMALL_MAP + 1];
    for (int j = 0; j < m; j++) {
        __m256 p = exp2_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j * ATTN_LANES), shift));
        sum = _mm256_add_ps(sum, _mm256_and_ps(p, keep));
        _mm256_storeu_ps(s + j * ATTN_LANES, p);
    }
#  pragma GCC unroll 16
    for (int r = 0; r < RV; r++)
        acc[r] = _mm256_setzero_ps();
    for (int j = 0; j < m; j++) { /* a separate loop: the exps' constants would spill acc */
        __m256 pj = _mm256_loadu_ps(s + j * ATTN_LANES);
#  pragma GCC unroll 16
        for (int r = 0; r < RV; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(u[(size_t)r * m + j]), pj, acc[r]);
    }
    float lanes[ATTN_SMALL_MAP + 1][ATTN_LANES];
#  pragma GCC unroll 16
    for (int r = 0; r < RV; r++)
        _mm256_storeu_ps(lanes[r], acc[r]);
    for (int p = 0; p < np; p++)
#  pragma GCC unroll 16
        for (int r = 0; r < RV; r++)
#  pragma GCC unroll 4
            for (int l = 0; l < NQ; l++)
                y[((size_t)p * RV + r) * NQ + l] = lanes[r][p * NQ + l];
    return sum;
}

static ATTN_AVX2 void span_values_avx2(const float *w2, const float *b2, const float *u, int m,
                                       int h, int rv, const float *z, const float *cv,
                                       float scale, int T, int nq, const float *shift,
                                       float *y, float *sum, float *sbuf)
{
    const int P = ATTN_LANES / nq;
    const __m256 vscale = _mm256_set1_ps(scale * ATTN_LOG2E);
    float *bias = sbuf + (size_t)m * ATTN_LANES, lane_shift[ATTN_LANES] = {0};
    __m256i vidx = packed_setup_avx2(b2, m, h, cv, nq, vscale, P, bias);
    for (int i = 0; i < ATTN_LANES; i++)
        lane_shift[i] = i < P * nq ? shift[i % nq] : 0.0f;
    const __m256 vshift = _mm256_loadu_ps(lane_shift);
    __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), vsum = _mm256_setzero_ps();
    for (int t = 0; t < T; t += P) {
        int np = T - t < P ? T - t : P;
        if (np < P) {
            keep = _mm256_castsi256_ps(lane_prefix_avx2(np * nq));
            vidx = packed_setup_avx2(b2, m, h, cv, nq, vscale, np, NULL);
        }
        packed_group_scores_avx2(w2, bias, m, h, z, t, nq, vidx, vscale, sbuf);
        float *yt = y + (size_t)t * rv * nq;
#  define ATTN_GROUP_VALUES_NQ(R, N)                                                          \
      vsum = _mm256_add_ps(vsum, packed_group_values_avx2(u, m, sbuf, vshift, keep, np, yt,   \
                                                          R, N))
#  define ATTN_GROUP_VALUES(R)                                                                \
      switch (nq) {                                                                          \
      case 1: ATTN_GROUP_VALUES_NQ(R, 1); break;                                             \
      case 2: ATTN_GROUP_VALUES_NQ(R, 2); break;                                             \
      case 3: ATTN_GROUP_VALUES_NQ(R, 3); break;                                             \
      default: ATTN_GROUP_VALUES_NQ(R, 4); break;                                            \
      }
        ATTN_SMALL_CASES(ATTN_GROUP_VALUES, rv)
#  undef ATTN_GROUP_VALUES
#  undef ATTN_GROUP_VALUES_NQ
    }
    float lanes[ATTN_LANES];
    _mm256_storeu_ps(lanes, vsum);
    for (int l = 0; l < nq; l++) {
        sum[l] = 0.0f;
        for (int i = l; i < P * nq; i += nq)
            sum[l] += lanes[i];
    }
}

/* Tiles in chunks whose scores stay in L1 (tile_chunk): scores, then values, per chunk. */
static ATTN_AVX2 void tile_maps_avx2(const float *w2, const float *b2, const float *u, int m,
                                     int h, int rv, const float *z, const float *cv, float scale,
                                     int T, int nq, float *y, float *mt, float *st, float *sbuf)
{
    const __m256 vscale = _mm256_set1_ps(scale * ATTN_LOG2E);
    const __m256 vcv = _mm256_mul_ps(_mm256_loadu_ps(cv), vscale);
    int chunk = tile_chunk(m);
    float *bias = sbuf + (size_t)chunk * m * ATTN_LANES; /* b2_j cv, scaled: the same every tile */
    for (int j = 0; j < m; j++)
        _mm256_storeu_ps(bias + j * ATTN_LANES, _mm256_mul_ps(_mm256_set1_ps(b2[j]), vcv));
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int t1 = T - t0 < chunk ? T : t0 + chunk;
#  define ATTN_SCORES_H(H) tile_scores_avx2(w2, bias, m, z, vscale, t0, t1, sbuf, mt, H)
#  define ATTN_VALUES_R(R) tile_values_avx2(u, m, sbuf, t0, t1, y, mt, st, R)
        ATTN_SMALL_CASES(ATTN_SCORES_H, h)
        ATTN_SMALL_CASES(ATTN_VALUES_R, rv)
#  undef ATTN_SCORES_H
#  undef ATTN_VALUES_R
    }
}
#endif /* ATTN_X86 */

/* ---- Dispatch ----------------------------------------------------------------------------- */

struct attn_isa {
    void (*scores)(enum kvcap_dtype dt, const void *k, size_t ks, int nr, const float *q, int nq,
                   int d, float *out, int ls);
    void (*accum)(enum kvcap_dtype dt, const void *v, size_t vs, int nr, const float *w, int nq,
                  int d, float *o, int ls);
    void (*softmax)(float *sc, int nr, float scale, float *m8, float *s8, float *a8);
    void (*bias_max)(float *s, float b, const float *sq, float *cmax, size_t n, float scale);
    void (*exp_cols)(float *s, const float *cmax, float *csum, size_t n);
    void (*tile_maps)(const float *w2, const float *b2, const float *u, int m, int h, int rv,
                      const float *z, const float *cv, float scale, int T, int nq, float *y,
                      float *mt, float *st, float *sbuf);
    void (*tile_factors)(float *mt, const float *st, int T, float *mx, float *sum);
    void (*tile_scale)(float *y, const float *f, const float *w, int T, int rv);
    /* whole-span packed maps for nq <= ATTN_LANES / 2 (NULL: tile_maps for every nq) */
    void (*span_max)(const float *w2, const float *b2, int m, int h, const float *z,
                     const float *cv, float scale, int T, int nq, float *sbuf, float *mx);
    void (*span_values)(const float *w2, const float *b2, const float *u, int m, int h, int rv,
                        const float *z, const float *cv, float scale, int T, int nq,
                        const float *shift, float *y, float *sum, float *sbuf);
};

static const struct attn_isa isa_generic = {
    scores_generic,   accum_generic,    softmax_generic,
    bias_max_generic, exp_cols_generic, tile_maps_generic, tile_factors_generic,
    tile_scale_generic, NULL,           NULL};
#if ATTN_X86
static const struct attn_isa isa_avx2 = {
    scores_avx2,   accum_avx2,        softmax_avx2, bias_max_avx2,
    exp_cols_avx2, tile_maps_avx2,    tile_factors_avx2, tile_scale_avx2, span_max_avx2,
    span_values_avx2};
#endif

static const struct attn_isa *attn_isa(void)
{
#if ATTN_X86
    if (kvcap_kernels_avx2())
        return &isa_avx2;
#endif
    return &isa_generic;
}

/* Row j of a row set in storage dtype. */
static const void *row_at(const void *base, enum kvcap_dtype dt, size_t stride, size_t j)
{
    return (const unsigned char *)base + j * stride * elem_size(dt);
}

/* o (d floats) *= a, with a == 0 clearing it (an empty partial's o is 0 anyway; this keeps a
 * stray non-finite value from surviving as NaN). */
static void rescale(float *o, int d, float a)
{
    if (a == 0.0f)
        memset(o, 0, sizeof(float) * (size_t)d);
    else if (a != 1.0f)
        for (int c = 0; c < d; c++)
            o[c] *= a;
}

/* ---- Plain rows --------------------------------------------------------------------------- */




enum kvcap_status kvcap_attend_rows(const struct kvcap_rows *rows, const float *q, int nq, int d,
                                    float scale, struct kvcap_partial acc, uint64_t *bytes)
{
    int nothing;
    KVCAP_TRY(rows_check(rows, q, nq, d, ATTN_MAX_D, bytes, &nothing));
    if (nothing)
        return KVCAP_OK;
    const struct attn_isa *isa = attn_isa();
    int B = block_rows(d);
    float sc[ATTN_MAX_B * ATTN_LANES], qstack[ATTN_PACKED_STACK];
    float *qp = qstack;
    size_t nqp = packed_floats(nq, d);
    if (nqp > ATTN_PACKED_STACK && !(qp = malloc(sizeof(float) * nqp)))
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "attend_rows: %zu floats of packed queries",
                          nqp);
    pack_queries(q, nq, d, qp);
    for (int j0 = 0; j0 < rows->n; j0 += B) {
        int nr = rows->n - j0 < B ? rows->n - j0 : B;
        const void *kb = row_at(rows->k, rows->dtype, rows->row_stride, (size_t)j0);
        const void *vb = row_at(rows->v, rows->dtype, rows->row_stride, (size_t)j0);
        for (int g = 0; g < nq; g += ATTN_LANES) {
            int ng = nq - g < ATTN_LANES ? nq - g : ATTN_LANES;
            float m8[ATTN_LANES], s8[ATTN_LANES], a8[ATTN_LANES];
            for (int l = 0; l < ATTN_LANES; l++) {
                m8[l] = l < ng ? acc.mx[g + l] : -INFINITY;
                s8[l] = l < ng ? acc.sum[g + l] : 0.0f;
            }
            isa->scores(rows->dtype, kb, rows->row_stride, nr, packed_group(qp, g, d), ng,
                        d, sc, ATTN_LANES);
            isa->softmax(sc, nr, scale, m8, s8, a8);
            for (int l = 0; l < ng; l++) {
                rescale(acc.o + (size_t)(g + l) * d, d, a8[l]);
                acc.mx[g + l] = m8[l];
                acc.sum[g + l] = s8[l];
            }
            isa->accum(rows->dtype, vb, rows->row_stride, nr, sc, ng, d, acc.o + (size_t)g * d,
                       ATTN_LANES);
        }
    }
    if (qp != qstack)
        free(qp);
    if (bytes)
        *bytes = rows_bytes(rows, d);
    return KVCAP_OK;
}

/* ---- KVCapsule spans ---------------------------------------------------------------------- */




size_t kvcap_capsule_scratch_floats(const struct kvcap_capsule_maps *maps, int n_spans,
                                    int max_tiles, int nq, int d)
{
    if (!maps || n_spans <= 0 || max_tiles <= 0 || nq <= 0 || d <= 0 || maps->m <= 0 ||
        maps->h < 0 || maps->rv < 0)
        return 0;
    size_t total, qp = packed_floats(nq, d); /* one span's queries, packed (last) */
    if (maps->h <= ATTN_SMALL_MAP && maps->rv <= ATTN_SMALL_MAP) { /* see capsule_attend_tiled */
        size_t per = (size_t)maps->h + (size_t)maps->rv + 2, tiles;
        size_t sbuf = ((size_t)tile_chunk(maps->m) + 1) * (size_t)maps->m; /* + bias [m][8] */
        if (!kvcap_mul_size(per, (size_t)max_tiles, &tiles) ||
            !kvcap_mul_size(tiles + sbuf, ATTN_LANES, &total))
            return SIZE_MAX;
    } else {
        size_t hv = (size_t)(maps->h > maps->rv ? maps->h : maps->rv);
        size_t per = hv + (size_t)maps->m + 2, cols;
        if (!kvcap_mul_size((size_t)n_spans, (size_t)max_tiles, &cols) ||
            !kvcap_mul_size(cols, (size_t)nq, &cols) || !kvcap_mul_size(per, cols, &total))
            return SIZE_MAX;
    }
    return total > SIZE_MAX - qp ? SIZE_MAX : total + qp;
}

/* Σ x[0..n) in 8 independent partial sums (vectorisable; one chain would be latency-bound). */
static float sum_f32(const float *x, int n)
{
    float a[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int u = 0; u < 8; u++)
            a[u] += x[i + u];
    for (; i < n; i++)
        a[0] += x[i];
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* Folds a span's partial for query q (shift mx, sum) into its accumulator: rescales acc.o and
 * returns b = exp(mx - new max), the factor by which the caller must scale the span's own
 * output terms as it adds them. */
static float merge_factor(struct kvcap_partial acc, int q, int d, float mx, float sum)
{
    float im = acc.mx[q], is = acc.sum[q], b = 1.0f;
    if (partial_empty(im, is)) {
        rescale(acc.o + (size_t)q * d, d, 0.0f);
        acc.mx[q] = mx;
        acc.sum[q] = sum;
    } else {
        float nm = im > mx ? im : mx, a = expf(im - nm);
        b = expf(mx - nm);
        rescale(acc.o + (size_t)q * d, d, a);
        acc.mx[q] = nm;
        acc.sum[q] = a * is + b * sum;
    }
    return b;
}

/* Moves query q's partial to the shift max(its own, mx) before terms computed with that shift
 * are added to it (rescaling o and sum by exp(old - new)); returns the shift. That is merging
 * an empty partial with shift mx: its factor is not needed, no terms come with it. */
static float partial_shift_to(struct kvcap_partial acc, int q, int d, float mx)
{
    merge_factor(acc, q, d, mx, 0.0f);
    return acc.mx[q];
}

/* Dense maps. Scratch layout (floats), cols = Σ_i tiles_i × nq, column (i, t, q) =
 * off_i + t*nq + q:
 *   ZY   [max(h, rv)][cols]  Z = H q' per column, later Y = U P
 *   S    [m][cols]           scores, then probabilities
 *   cv   [cols]              sum(q') per column, later Σ_j p per column
 *   cmax [cols]              column max, then the max of the column's (span, query)
 *   qp   [packed_floats]     the span's queries, packed for the score kernel
 * Steps: Z (per span, streaming H) -> S = W2ᵀ Z (one sgemm: W2 read once) -> bias, scale, max
 * -> P = exp -> Y = U P (one sgemm) -> per span: merge factors, o += Ṽᵀ y (+ Σp μ). */
static void capsule_attend_dense(const struct kvcap_capsule_maps *maps,
                                 const struct kvcap_capsule_span *spans, int n_spans, int nq,
                                 int d, float scale, size_t cols, float *scratch)
{
    int m = maps->m, h = maps->h, rv = maps->rv;
    size_t hv = (size_t)(h > rv ? h : rv);
    float *ZY = scratch, *S = ZY + hv * cols, *cv = S + (size_t)m * cols, *cmax = cv + cols;
    float *qp = cmax + cols;
    const struct attn_isa *isa = attn_isa();
    int B = block_rows(d);
    float sc[ATTN_MAX_B * ATTN_LANES];

    /* Z[a][(i,t,q)] = H_{i,t}[a] · q'_{i,q}, and sum(q') per column. */
    size_t off = 0;
    for (int i = 0; i < n_spans; i++) {
        const struct kvcap_capsule_span *sp = &spans[i];
        int T = sp->tiles;
        if (T == 0)
            continue;
        for (int qi = 0; qi < nq; qi++) {
            float sq = 0.0f;
            for (int c = 0; c < d; c++)
                sq += sp->q[(size_t)qi * d + c];
            for (int t = 0; t < T; t++)
                cv[off + (size_t)t * nq + qi] = sq;
        }
        pack_queries(sp->q, nq, d, qp);
        size_t nrows = (size_t)T * h;
        for (size_t r0 = 0; r0 < nrows; r0 += (size_t)B) {
            int nr = nrows - r0 < (size_t)B ? (int)(nrows - r0) : B;
            const void *hb = row_at(sp->hs, sp->dtype, (size_t)d, r0);
            for (int g = 0; g < nq; g += ATTN_LANES) {
                int ng = nq - g < ATTN_LANES ? nq - g : ATTN_LANES;
                isa->scores(sp->dtype, hb, (size_t)d, nr, packed_group(qp, g, d), ng,
                            d, sc, ATTN_LANES);
                size_t t = r0 / (size_t)h, a = r0 % (size_t)h; /* row r0 + jj = (t, a) */
                for (int jj = 0; jj < nr; jj++) {
                    float *zc = ZY + a * cols + off + t * (size_t)nq + (size_t)g;
                    for (int l = 0; l < ng; l++)
                        zc[l] = sc[jj * ATTN_LANES + l];
                    if (++a == (size_t)h) {
                        a = 0;
                        t++;
                    }
                }
            }
        }
        off += (size_t)T * nq;
    }

    /* S = W2ᵀ Z: the map is read once for every span and query of the call. */
    if (h > 0)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, (int)cols, h, 1.0f, maps->w2, m,
                    ZY, (int)cols, 0.0f, S, (int)cols);
    else
        memset(S, 0, sizeof(float) * (size_t)m * cols);
    for (size_t c = 0; c < cols; c++)
        cmax[c] = -INFINITY;
    for (int j = 0; j < m; j++)
        isa->bias_max(S + (size_t)j * cols, maps->b2[j], cv, cmax, cols, scale);

    /* One softmax shift per (span, query): the max over its tiles' columns. */
    off = 0;
    for (int i = 0; i < n_spans; i++) {
        int T = spans[i].tiles;
        for (int qi = 0; qi < nq && T > 0; qi++) {
            float mx = -INFINITY;
            for (int t = 0; t < T; t++)
                mx = cmax[off + (size_t)t * nq + qi] > mx ? cmax[off + (size_t)t * nq + qi] : mx;
            for (int t = 0; t < T; t++)
                cmax[off + (size_t)t * nq + qi] = mx;
        }
        off += (size_t)T * nq;
    }
    /* P = exp(S - max), Σ_j p per column into cv, Y = U P: the value basis, also read once. */
    memset(cv, 0, sizeof(float) * cols);
    for (int j = 0; j < m; j++)
        isa->exp_cols(S + (size_t)j * cols, cmax, cv, cols);
    if (rv > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rv, (int)cols, m, 1.0f, maps->u,
                    m, S, (int)cols, 0.0f, ZY, (int)cols);

    /* Per span: merge the span's partial (max cmax, sum Σp, o = Ṽᵀy + Σp μ) into its acc,
     * scaling the new terms by b as they are accumulated. The factors b and b·Σp of query q
     * are kept in the span's first columns of cmax and cv, which are free once read. */
    off = 0;
    for (int i = 0; i < n_spans; i++) {
        const struct kvcap_capsule_span *sp = &spans[i];
        int T = sp->tiles;
        if (T == 0)
            continue;
        float *bq = cmax + off, *psum = cv + off;
        for (int qi = 0; qi < nq; qi++) {
            float sum = 0.0f;
            for (int t = 0; t < T; t++)
                sum += cv[off + (size_t)t * nq + qi];
            float b = merge_factor(sp->acc, qi, d, cmax[off + (size_t)qi], sum);
            bq[qi] = b;
            psum[qi] = b * sum;
        }
        size_t nrows = (size_t)T * rv;
        for (size_t r0 = 0; r0 < nrows; r0 += (size_t)B) {
            int nr = nrows - r0 < (size_t)B ? (int)(nrows - r0) : B;
            const void *vb = row_at(sp->vt, sp->dtype, (size_t)d, r0);
            for (int g = 0; g < nq; g += ATTN_LANES) {
                int ng = nq - g < ATTN_LANES ? nq - g : ATTN_LANES;
                size_t t = r0 / (size_t)rv, rr = r0 % (size_t)rv; /* row r0 + jj = (t, rr) */
                for (int jj = 0; jj < nr; jj++) {
                    const float *yc = ZY + rr * cols + off + t * (size_t)nq + (size_t)g;
                    for (int l = 0; l < ATTN_LANES; l++)
                        sc[jj * ATTN_LANES + l] = l < ng ? bq[g + l] * yc[l] : 0.0f;
                    if (++rr == (size_t)rv) {
                        rr = 0;
                        t++;
                    }
                }
                isa->accum(sp->dtype, vb, (size_t)d, nr, sc, ng, d, sp->acc.o + (size_t)g * d,
                           ATTN_LANES);
            }
        }
        for (int g = 0; g < nq; g += ATTN_LANES) {
            int ng = nq - g < ATTN_LANES ? nq - g : ATTN_LANES;
            for (int l = 0; l < ATTN_LANES; l++)
                sc[l] = l < ng ? psum[g + l] : 0.0f;
            isa->accum(sp->dtype, sp->mu, (size_t)d, 1, sc, ng, d, sp->acc.o + (size_t)g * d,
                       ATTN_LANES);
        }
        off += (size_t)T * nq;
    }
}

/* Small (tiled) maps, span by span and query group by query group, the queries in the lanes:
 *   Z [T][h][8]  = H q' (the row kernel's output layout, written in place)
 *   per tile: scores, own shift mt, Σp and y = U p (tile_maps; the maps stay in L1)
 *   one shift per query: f_t = 2^(mt - max_t mt), folded with the merge factor b into y
 *   o += Ṽᵀ y  (y [T][rv][8] is the row kernel's weight layout) + (Σp) μ.
 * Groups of nq <= 4 with the AVX2 kernels go compact and packed instead (span_max_avx2): Z
 * [T][h][nq]; the span's max per query, merged with the partial's shift first; then Σp and y
 * [T][rv][nq] with that shift, which needs neither tile factors nor a merge factor.
 * Scratch: Z [T][h][8], Y [T][rv][8], mt and st [T][8], sbuf [tile_chunk(m) + 1][m][8], T = the
 * most tiles, then the span's queries packed (packed_floats). */
static void capsule_attend_tiled(const struct kvcap_capsule_maps *maps,
                                 const struct kvcap_capsule_span *spans, int n_spans, int nq,
                                 int d, float scale, int max_tiles, float *scratch)
{
    int m = maps->m, h = maps->h, rv = maps->rv;
    float *Z = scratch, *Y = Z + (size_t)max_tiles * h * ATTN_LANES;
    float *mt = Y + (size_t)max_tiles * rv * ATTN_LANES, *st = mt + (size_t)max_tiles * ATTN_LANES;
    float *sbuf = st + (size_t)max_tiles * ATTN_LANES;
    float *qp = sbuf + ((size_t)tile_chunk(m) + 1) * (size_t)m * ATTN_LANES;
    const struct attn_isa *isa = attn_isa();
    int B = block_rows(d);
    for (int i = 0; i < n_spans; i++) {
        const struct kvcap_capsule_span *sp = &spans[i];
        int T = sp->tiles;
        if (T == 0)
            continue;
        pack_queries(sp->q, nq, d, qp);
        for (int g = 0; g < nq; g += ATTN_LANES) {
            int ng = nq - g < ATTN_LANES ? nq - g : ATTN_LANES;
            const float *q = sp->q + (size_t)g * d;
            float *o = sp->acc.o + (size_t)g * d;
            int packed = isa->span_max && ng <= ATTN_LANES / 2, ls = packed ? ng : ATTN_LANES;
            size_t nrows = (size_t)T * h;
            for (size_t r0 = 0; r0 < nrows; r0 += (size_t)B) {
                int nr = nrows - r0 < (size_t)B ? (int)(nrows - r0) : B;
                isa->scores(sp->dtype, row_at(sp->hs, sp->dtype, (size_t)d, r0), (size_t)d, nr,
                            packed_group(qp, g, d), ng, d, Z + r0 * ls, ls);
            }
            float cv[ATTN_LANES] = {0}, mx[ATTN_LANES], sum[ATTN_LANES];
            float w[ATTN_LANES] = {0}, psum[ATTN_LANES] = {0};
            for (int l = 0; l < ng; l++)
                cv[l] = sum_f32(q + (size_t)l * d, d);
            if (packed) {
                float shift[ATTN_LANES];
                isa->span_max(maps->w2, maps->b2, m, h, Z, cv, scale, T, ng, sbuf, mx);
                for (int l = 0; l < ng; l++) { /* log2 units; the span's own max kept exact */
                    float nat = mx[l] * ATTN_LN2;
                    float to = partial_shift_to(sp->acc, g + l, d, nat);
                    shift[l] = to == nat ? mx[l] : to * ATTN_LOG2E;
                }
                isa->span_values(maps->w2, maps->b2, maps->u, m, h, rv, Z, cv, scale, T, ng,
                                 shift, Y, psum, sbuf);
                for (int l = 0; l < ng; l++)
                    sp->acc.sum[g + l] += psum[l];
            } else {
                isa->tile_maps(maps->w2, maps->b2, maps->u, m, h, rv, Z, cv, scale, T, ng, Y,
                               mt, st, sbuf);
                isa->tile_factors(mt, st, T, mx, sum); /* mt becomes the tiles' factors f_t */
                for (int l = 0; l < ng; l++) {
                    w[l] = merge_factor(sp->acc, g + l, d, mx[l] * ATTN_LN2, sum[l]);
                    psum[l] = w[l] * sum[l];
                }
                isa->tile_scale(Y, mt, w, T, rv);
            }
            nrows = (size_t)T * rv;
            for (size_t r0 = 0; r0 < nrows; r0 += (size_t)B) {
                int nr = nrows - r0 < (size_t)B ? (int)(nrows - r0) : B;
                isa->accum(sp->dtype, row_at(sp->vt, sp->dtype, (size_t)d, r0), (size_t)d, nr,
                           Y + r0 * ls, ng, d, o, ls);
            }
            isa->accum(sp->dtype, sp->mu, (size_t)d, 1, psum, ng, d, o, ATTN_LANES);
        }
    }
}

enum kvcap_status kvcap_capsule_attend(const struct kvcap_capsule_maps *maps,
                                       const struct kvcap_capsule_span *spans, int n_spans,
                                       int nq, int d, float scale, float *scratch,
                                       size_t scratch_floats, uint64_t *bytes)
{
    size_t cols;
    KVCAP_TRY(capsule_check(maps, spans, n_spans, nq, d, ATTN_MAX_D, &cols, bytes));
    if (cols == 0)
        return KVCAP_OK;
    int max_tiles = 0;
    for (int i = 0; i < n_spans; i++)
        max_tiles = spans[i].tiles > max_tiles ? spans[i].tiles : max_tiles;
    size_t need = kvcap_capsule_scratch_floats(maps, n_spans, max_tiles, nq, d);
    KVCAP_RETURN_IF(!scratch || scratch_floats < need, KVCAP_ERR_INVALID_ARGUMENT,
                    "capsule_attend: %zu floats of scratch given, %zu needed",
                    scratch ? scratch_floats : 0, need);
    if (maps->h <= ATTN_SMALL_MAP && maps->rv <= ATTN_SMALL_MAP)
        capsule_attend_tiled(maps, spans, n_spans, nq, d, scale, max_tiles, scratch);
    else
        capsule_attend_dense(maps, spans, n_spans, nq, d, scale, cols, scratch);
    if (bytes)
        *bytes = capsule_bytes(maps, spans, n_spans, d);
    return KVCAP_OK;
}
