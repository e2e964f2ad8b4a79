/* rows_block.h — key rows gathered block by block across chunks of rows (kvcap_rows), as f32:
 * how the scoring kernels (vlcache.c, kvzip.c) stream a prompt's keys through one sgemm per
 * block without holding them all. Internal to kernels/. */
#ifndef KVCAP_ROWS_BLOCK_H
#define KVCAP_ROWS_BLOCK_H

#include <limits.h>
#include <math.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/internal.h"
#include "kernels/attention.h"
#include "kernels/load.h"

/* The checks of n_chunks chunks of key rows of d channels (an empty chunk may have k NULL);
 * *m receives the number of keys. Errors name the function `fn` and the chunk. */
static inline enum kvcap_status kvcap_rows_check(const char *fn, const struct kvcap_rows *keys,
                                                 int n_chunks, int d, int *m_out)
{
    int64_t m = 0;
    for (int c = 0; c < n_chunks; c++) {
        const struct kvcap_rows *k = &keys[c];
        KVCAP_RETURN_IF(k->n < 0, KVCAP_ERR_INVALID_ARGUMENT, "%s: keys[%d].n = %d is negative",
                        fn, c, k->n);
        if (k->n == 0)
            continue;
        KVCAP_RETURN_IF(!kvcap_dtype_is_storage(k->dtype), KVCAP_ERR_INVALID_ARGUMENT,
                        "%s: keys[%d].dtype = %s is not F32, F16 or BF16", fn, c,
                        kvcap_dtype_name(k->dtype));
        KVCAP_RETURN_IF(!k->k, KVCAP_ERR_INVALID_ARGUMENT, "%s: keys[%d].k is NULL", fn, c);
        KVCAP_RETURN_IF(k->row_stride < (size_t)d, KVCAP_ERR_INVALID_ARGUMENT,
                        "%s: keys[%d].row_stride = %zu is less than d = %d", fn, c,
                        k->row_stride, d);
        m += k->n;
        KVCAP_RETURN_IF(m > INT_MAX, KVCAP_ERR_INVALID_ARGUMENT,
                        "%s: keys hold more than INT_MAX tokens", fn);
    }
    *m_out = (int)m;
    return KVCAP_OK;
}

/* Where the next key row comes from: row `row` of chunk `chunk`. */
struct kvcap_rows_cursor {
    int chunk, row;
};

/* Up to `block` next key rows as f32 into kb [nb][d] (chunk boundaries do not end a block, so
 * many small chunks still make full-width sgemms); returns nb. */
static inline int kvcap_rows_load_block(const struct kvcap_rows *keys, int n_chunks,
                                        struct kvcap_rows_cursor *cur, int d, int block,
                                        float *kb)
{
    int nb = 0;
    while (nb < block && cur->chunk < n_chunks) {
        const struct kvcap_rows *k = &keys[cur->chunk];
        int take = k->n - cur->row < block - nb ? k->n - cur->row : block - nb;
        if (take <= 0) {
            cur->chunk++;
            cur->row = 0;
            continue;
        }
        size_t es = kvcap_dtype_size(k->dtype);
        const unsigned char *src =
            (const unsigned char *)k->k + (size_t)cur->row * k->row_stride * es;
        if (k->row_stride == (size_t)d)
            kvcap_load_f32(k->dtype, src, (size_t)take * d, kb + (size_t)nb * d);
        else
            for (int t = 0; t < take; t++)
                kvcap_load_f32(k->dtype, src + (size_t)t * k->row_stride * es, (size_t)d,
                               kb + (size_t)(nb + t) * d);
        nb += take;
        cur->row += take;
    }
    return nb;
}

/* The scratch both scoring kernels lay out for nq = n·G query rows and key blocks of `block`
 * rows (qs [nq][d], sc [nq][block], mx [nq], sum [nq], kb [block][d]), plus `extra` floats; 0
 * for n, G or d < 1, SIZE_MAX on overflow. */
static inline size_t kvcap_rows_scratch_floats(int n, int G, int d, int block, size_t extra)
{
    if (n < 1 || G < 1 || d < 1)
        return 0;
    size_t nq, qd, sb, kb, total;
    if (!kvcap_mul_size((size_t)n, (size_t)G, &nq) || !kvcap_mul_size(nq, (size_t)d, &qd) ||
        !kvcap_mul_size(nq, (size_t)block + 2, &sb) ||
        !kvcap_mul_size((size_t)block, (size_t)d, &kb) || !kvcap_add_size(qd, sb, &total) ||
        !kvcap_add_size(total, kb, &total) || !kvcap_add_size(total, extra, &total))
        return SIZE_MAX;
    return total;
}

/* The n·G query rows (row i·G + g: query g of token i at q + i*q_stride + g*d) times scale into
 * qs [n·G][d], and each row's online softmax started: mx = −inf, sum = 0. */
static inline void kvcap_rows_scaled_queries(const float *q, size_t q_stride, int n, int G, int d,
                                             float scale, float *qs, float *mx, float *sum)
{
    for (int i = 0; i < n; i++)
        for (int g = 0; g < G; g++) {
            const float *src = q + (size_t)i * q_stride + (size_t)g * d;
            float *dst = qs + ((size_t)i * G + g) * d;
            for (int e = 0; e < d; e++)
                dst[e] = src[e] * scale;
        }
    for (int r = 0; r < n * G; r++) {
        mx[r] = -INFINITY;
        sum[r] = 0.0f;
    }
}

/* One online-softmax step of a row: scores s[0..n) join its running max *mx and Σ exp(s − max)
 * *sum (a row that had seen nothing has sum 0, and exp(−inf) = 0 keeps it so). */
static inline void kvcap_rows_softmax_add(const float *s, int n, float *mx, float *sum)
{
    float bm = *mx, add = 0.0f;
    for (int j = 0; j < n; j++)
        bm = s[j] > bm ? s[j] : bm;
    for (int j = 0; j < n; j++)
        add += expf(s[j] - bm);
    *sum = *sum * expf(*mx - bm) + add;
    *mx = bm;
}

#endif
