/* synth.c — the synthetic dataset generator described in synth.h. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/dataset.h"
#include "common/internal.h"
#include "common/rng.h"
#include "kernels/rope.h"
#include "calibrate/synth.h"

void kvcap_synth_default_params(struct kvcap_synth_params *p)
{
    memset(p, 0, sizeof *p);
    p->n_spans = 16;
    p->rank_k = 8;
    p->rank_v = 8;
    p->noise = 0.01;
    p->outliers = 2;
    p->outlier_scale = 6.0;
    p->post_queries = 8;
    p->decode_queries = 8;
    p->score_scale = 2.0;
    p->p0_max = 4096;
    p->seed = 1;
    p->dtype = KVCAP_DTYPE_F16;
    p->shard_bytes = 256ull << 20;
}

/* A generator seeded by the tuple, so any span/layer/head is reproducible on its own. */
static void seed_for(struct kvcap_rng *r, uint64_t seed, int64_t span, int layer, int head,
                     uint64_t stream)
{
    uint64_t x = seed;
    uint64_t h = kvcap_splitmix64(&x);
    h ^= (uint64_t)span * 0x9e3779b97f4a7c15ull;
    h ^= ((uint64_t)(uint32_t)layer << 32 | (uint32_t)head) * 0xc2b2ae3d27d4eb4full;
    h ^= stream * 0x165667b19e3779f9ull;
    kvcap_rng_seed(r, h);
}

void kvcap_synth_span_layout(const struct kvcap_synth_params *p, int64_t span, int *rows,
                             int *cols, int *p0)
{
    int g = p->n_grids > 0 ? (int)(span % p->n_grids) : -1;
    *rows = g >= 0 ? p->grid_rows[g] : 16;
    *cols = g >= 0 ? p->grid_cols[g] : 16;
    struct kvcap_rng r;
    seed_for(&r, p->seed, span, -1, -1, 0);
    *p0 = (int)kvcap_rng_below(&r, (uint64_t)p->p0_max + 1);
}

/* Column `index` of the low-frequency 2-D DCT basis (frequencies ordered by u+v, then u), with
 * rms 1 over the grid. skip_dc drops the constant function. */
static void dct_basis(int rows, int cols, int index, int skip_dc, float *out)
{
    int k = skip_dc ? index + 1 : index, u = 0, v = 0;
    for (int s = 0;; s++) { /* walk the anti-diagonals u + v = s */
        int first = s - (cols - 1) > 0 ? s - (cols - 1) : 0;
        int last = s < rows - 1 ? s : rows - 1;
        int count = last >= first ? last - first + 1 : 0;
        if (k < count) {
            u = first + k;
            v = s - u;
            break;
        }
        k -= count;
    }
    double sum = 0.0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            double x = cos(M_PI * (r + 0.5) * u / rows) * cos(M_PI * (c + 0.5) * v / cols);
            out[r * cols + c] = (float)x;
            sum += x * x;
        }
    float scale = (float)sqrt((double)rows * cols / sum);
    for (int i = 0; i < rows * cols; i++)
        out[i] *= scale;
}

/* X (n x d) = sum_r A_r B_r^T with B_r ~ N(0, scale_r^2); returns the per-entry signal std. */
static double low_rank(struct kvcap_rng *r, int rows, int cols, int d, int rank, int skip_dc,
                       double first_scale, float *basis, float *x)
{
    int n = rows * cols;
    double var = 0.0;
    memset(x, 0, sizeof(float) * (size_t)n * (size_t)d);
    float *b = basis + n; /* scratch after the basis column */
    for (int k = 0; k < rank; k++) {
        double s = (k == 0 ? first_scale : 1.0) / sqrt(1.0 + k);
        var += s * s;
        dct_basis(rows, cols, k, skip_dc, basis);
        for (int c = 0; c < d; c++)
            b[c] = (float)(s * kvcap_rng_normal(r));
        for (int j = 0; j < n; j++)
            for (int c = 0; c < d; c++)
                x[(size_t)j * d + c] += basis[j] * b[c];
    }
    return sqrt(var);
}

static void add_noise_and_outliers(struct kvcap_rng *r, const struct kvcap_synth_params *p,
                                   const int *outlier_rows, int n, int d, double sigma, float *x)
{
    if (p->noise > 0)
        for (size_t i = 0; i < (size_t)n * d; i++)
            x[i] += (float)(p->noise * sigma * kvcap_rng_normal(r));
    for (int o = 0; o < p->outliers && o < n; o++)
        for (int c = 0; c < d; c++)
            x[(size_t)outlier_rows[o] * d + c] +=
                (float)(p->outlier_scale * sigma * kvcap_rng_normal(r));
}

/* G * count queries q' in the row space of K' (q'.K'_j is spatially structured), scaled to the
 * requested score spread, then rotated by p0. */
static void make_queries(struct kvcap_rng *r, const struct kvcap_model_geometry *g,
                         const struct kvcap_synth_params *p, const float *k_free, int n, int p0,
                         int count, float *q)
{
    int d = g->head_dim, G = g->n_q_heads / g->n_kv_heads;
    for (int i = 0; i < G * count; i++) {
        float *qi = q + (size_t)i * d;
        memset(qi, 0, sizeof(float) * (size_t)d);
        for (int t = 0; t < 4; t++) { /* a mix of a few keys' directions plus noise */
            const float *kj = k_free + kvcap_rng_below(r, (uint64_t)n) * (size_t)d;
            double w = kvcap_rng_normal(r);
            for (int c = 0; c < d; c++)
                qi[c] += (float)(w * kj[c]);
        }
        for (int c = 0; c < d; c++)
            qi[c] += (float)(0.1 * kvcap_rng_normal(r));
        double mean = 0.0, sq = 0.0;
        for (int j = 0; j < n; j++) {
            double s = 0.0;
            for (int c = 0; c < d; c++)
                s += (double)qi[c] * k_free[(size_t)j * d + c];
            s /= sqrt((double)d);
            mean += s;
            sq += s * s;
        }
        mean /= n;
        double sd = sqrt(fmax(sq / n - mean * mean, 1e-30));
        float scale = (float)(p->score_scale / sd);
        for (int c = 0; c < d; c++)
            qi[c] *= scale;
    }
    kvcap_rope_rotate(g, q, (size_t)G * count, (size_t)d, p0);
}

enum kvcap_status kvcap_synth_head(const struct kvcap_model_geometry *g,
                                   const struct kvcap_synth_params *p, int64_t span, int rows,
                                   int cols, int p0, int layer, int kv_head, float *k_offset_free,
                                   float *k, float *v, float *q_post, float *q_dec)
{
    int n = rows * cols, d = g->head_dim;
    KVCAP_RETURN_IF(p->rank_k < 1 || p->rank_k > n || p->rank_v < 1 || p->rank_v > n - 1,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "synth: rank_k %d / rank_v %d must be in 1..%d / 1..%d for a %dx%d grid",
                    p->rank_k, p->rank_v, n, n - 1, rows, cols);
    float *basis = malloc(sizeof(float) * ((size_t)n + (size_t)d));
    KVCAP_RETURN_IF(!basis, KVCAP_ERR_OUT_OF_MEMORY, "synth: out of memory");
    struct kvcap_rng r;
    seed_for(&r, p->seed, span, -1, -1, 1); /* outlier positions: shared by layers and heads */
    int outlier_rows[64];
    for (int o = 0; o < p->outliers && o < 64; o++)
        outlier_rows[o] = (int)kvcap_rng_below(&r, (uint64_t)n);

    seed_for(&r, p->seed, span, layer, kv_head, 2);
    double sk = low_rank(&r, rows, cols, d, p->rank_k, 0, 2.0, basis, k_offset_free);
    add_noise_and_outliers(&r, p, outlier_rows, n, d, sk, k_offset_free);
    memcpy(k, k_offset_free, sizeof(float) * (size_t)n * d);
    kvcap_rope_rotate(g, k, (size_t)n, (size_t)d, p0);

    seed_for(&r, p->seed, span, layer, kv_head, 3);
    double sv = low_rank(&r, rows, cols, d, p->rank_v, 1, 1.0, basis, v);
    for (int c = 0; c < d; c++) {
        float mu = (float)kvcap_rng_normal(&r);
        for (int j = 0; j < n; j++)
            v[(size_t)j * d + c] += mu;
    }
    add_noise_and_outliers(&r, p, outlier_rows, n, d, sv, v);
    free(basis);

    seed_for(&r, p->seed, span, layer, kv_head, 4);
    if (q_post && p->post_queries > 0)
        make_queries(&r, g, p, k_offset_free, n, p0, p->post_queries, q_post);
    if (q_dec && p->decode_queries > 0)
        make_queries(&r, g, p, k_offset_free, n, p0, p->decode_queries, q_dec);
    return KVCAP_OK;
}

/* Copies [G][count][d] of one KV head into rows h*G.. of a [q_heads][count][d] block. */
static void place_queries(const float *src, float *dst, int kv_head, int G, int count, int d)
{
    memcpy(dst + (size_t)kv_head * G * count * d, src, sizeof(float) * (size_t)G * count * d);
}

enum kvcap_status kvcap_synth(const struct kvcap_model_geometry *g,
                              const struct kvcap_synth_params *p, const char *dir,
                              kvcap_progress_fn progress, void *user)
{
    KVCAP_RETURN_IF(!g || !p || !dir, KVCAP_ERR_INVALID_ARGUMENT, "synth: NULL argument");
    KVCAP_TRY(kvcap_geometry_validate(g));
    KVCAP_RETURN_IF(p->n_spans < 1 || p->n_grids < 0 || p->n_grids > KVCAP_SYNTH_MAX_GRIDS ||
                        p->p0_max < 0 || p->outliers < 0 || p->outliers > 64 ||
                        p->post_queries < 0 || p->decode_queries < 0 || !(p->noise >= 0),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "synth: spans %d, grids %d, p0_max %d, outliers %d (max 64), queries %d/%d, "
                    "noise %g out of range",
                    p->n_spans, p->n_grids, p->p0_max, p->outliers, p->post_queries,
                    p->decode_queries, p->noise);
    struct kvcap_dataset_writer_params wp;
    kvcap_dataset_writer_default_params(&wp);
    wp.dir = dir;
    wp.dtype = p->dtype;
    wp.shard_bytes = p->shard_bytes;
    char source[160];
    snprintf(source, sizeof source,
             "kvcap-synth seed=%llu rank_k=%d rank_v=%d noise=%g outliers=%d",
             (unsigned long long)p->seed, p->rank_k, p->rank_v, p->noise, p->outliers);
    wp.source = source;
    struct kvcap_dataset_writer *w = NULL;
    KVCAP_TRY(kvcap_dataset_writer_create(g, &wp, &w));

    int max_n = 16 * 16;
    for (int i = 0; i < p->n_grids; i++)
        max_n = p->grid_rows[i] * p->grid_cols[i] > max_n ? p->grid_rows[i] * p->grid_cols[i]
                                                          : max_n;
    int d = g->head_dim, Hkv = g->n_kv_heads, G = g->n_q_heads / Hkv;
    int nq = p->post_queries > p->decode_queries ? p->post_queries : p->decode_queries;
    size_t head = (size_t)max_n * d;
    float *kf = malloc(sizeof(float) * head);
    float *k = malloc(sizeof(float) * head * Hkv);
    float *v = malloc(sizeof(float) * head * Hkv);
    float *qh = malloc(sizeof(float) * ((size_t)G * nq * d + 1) * 2);
    float *qp = malloc(sizeof(float) * ((size_t)g->n_q_heads * p->post_queries * d + 1));
    float *qd = malloc(sizeof(float) * ((size_t)g->n_q_heads * p->decode_queries * d + 1));
    enum kvcap_status st = (kf && k && v && qh && qp && qd)
                               ? KVCAP_OK
                               : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "synth: out of memory");
    float *qh_dec = qh ? qh + (size_t)G * nq * d + 1 : NULL;
    for (int64_t s = 0; st == KVCAP_OK && s < p->n_spans; s++) {
        int rows, cols, p0;
        kvcap_synth_span_layout(p, s, &rows, &cols, &p0);
        int n = rows * cols;
        st = kvcap_dataset_writer_begin_span(w, rows, cols, p0);
        for (int l = 0; st == KVCAP_OK && l < g->n_layers; l++) {
            for (int h = 0; st == KVCAP_OK && h < Hkv; h++) {
                st = kvcap_synth_head(g, p, s, rows, cols, p0, l, h, kf, k + (size_t)h * n * d,
                                      v + (size_t)h * n * d, qh, qh_dec);
                if (st == KVCAP_OK && p->post_queries)
                    place_queries(qh, qp, h, G, p->post_queries, d);
                if (st == KVCAP_OK && p->decode_queries)
                    place_queries(qh_dec, qd, h, G, p->decode_queries, d);
            }
            if (st == KVCAP_OK)
                st = kvcap_dataset_writer_set_kv(w, l, k, v);
            if (st == KVCAP_OK && p->post_queries)
                st = kvcap_dataset_writer_add_queries(w, l, KVCAP_QUERIES_POST, qp,
                                                      p->post_queries);
            if (st == KVCAP_OK && p->decode_queries)
                st = kvcap_dataset_writer_add_queries(w, l, KVCAP_QUERIES_DECODE, qd,
                                                      p->decode_queries);
        }
        if (st == KVCAP_OK)
            st = kvcap_dataset_writer_end_span(w);
        if (st == KVCAP_OK && progress && progress(s + 1, p->n_spans, user))
            st = kvcap_fail(KVCAP_ERR_STATE, "synth: stopped by the caller after %lld spans",
                            (long long)(s + 1));
    }
    if (st == KVCAP_OK)
        st = kvcap_dataset_writer_flush(w);
    if (st != KVCAP_OK) /* a partial dataset would pass for the one asked for */
        kvcap_dataset_writer_discard(w);
    kvcap_dataset_writer_free(w);
    free(kf);
    free(k);
    free(v);
    free(qh);
    free(qp);
    free(qd);
    return st;
}
