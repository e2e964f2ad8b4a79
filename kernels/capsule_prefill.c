/* capsule_prefill.c — KVCapsule at prefill for one KV head (capsule_prefill.h): the readable
 * oracle first (plain loops in double, the spec), then the fast form (an sgemm per tile). */
#include <cblas.h>
#include <lapacke.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/capsule_prefill.h"
#include "kernels/activation.h"
#include "kernels/rope.h"
#include "common/internal.h"

/* The argument check both forms share. */
static enum kvcap_status check(const char *fn, const struct kvcap_model_geometry *g,
                               const struct kvcap_bucket *b,
                               const struct kvcap_capsule_prefill_maps *mp, int n, int d,
                               const float *k, const float *v, enum kvcap_dtype storage,
                               const void *hs, const void *vt, const void *mu)
{
    KVCAP_RETURN_IF(!g || !b || !mp || !k || !v || !hs || !vt || !mu, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: NULL argument", fn);
    KVCAP_RETURN_IF(d < 1 || n < 1 || (int64_t)b->rows * b->cols != n, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: %d tokens of head_dim %d on a %dx%d grid", fn, n, d, b->rows, b->cols);
    int m = b->structure == KVCAP_STRUCTURE_TILED ? b->tile_rows * b->tile_cols : n;
    KVCAP_RETURN_IF(mp->m != m || m < 1 || n % m != 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: maps of %d points for tiles of %d", fn, mp->m, m);
    KVCAP_RETURN_IF(mp->rk < 1 || mp->rk > m || mp->h < 1 || mp->rv < 1 || mp->rv > m ||
                        !mp->mask || !mp->w1 || !mp->b1 || !mp->u,
                    KVCAP_ERR_INVALID_ARGUMENT, "%s: maps with rk %d, h %d, rv %d of %d points",
                    fn, mp->rk, mp->h, mp->rv, m);
    for (int r = 0; r < mp->rk; r++)
        KVCAP_RETURN_IF(mp->mask[r] < 0 || mp->mask[r] >= m, KVCAP_ERR_INVALID_ARGUMENT,
                        "%s: mask[%d] = %d is not a point of a %d-point tile", fn, r,
                        (int)mp->mask[r], m);
    KVCAP_RETURN_IF(!kvcap_dtype_is_storage(storage), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: storage %s is not F32, F16 or BF16", fn, kvcap_dtype_name(storage));
    return KVCAP_OK;
}

/* ---- The oracle ------------------------------------------------------------------------------ */

enum kvcap_status kvcap_capsule_prefill_ref(const struct kvcap_model_geometry *g,
                                            const struct kvcap_bucket *bucket,
                                            const struct kvcap_capsule_prefill_maps *maps, int n,
                                            int d, int64_t p0, const float *k, const float *v,
                                            enum kvcap_dtype storage, void *hs, void *vt, void *mu)
{
    KVCAP_TRY(check("kvcap_capsule_prefill_ref", g, bucket, maps, n, d, k, v, storage, hs, vt,
                    mu));
    const int m = maps->m, tiles = n / m, h = maps->h, rv = maps->rv;
    float *kr = malloc(sizeof(float) * (size_t)n * d); /* K' = R(-p0) K */
    float *hf = malloc(sizeof(float) * (size_t)tiles * h * d);
    float *vf = malloc(sizeof(float) * (size_t)tiles * rv * d);
    float *muf = malloc(sizeof(float) * (size_t)d);
    double *mean = malloc(sizeof(double) * (size_t)d);
    if (!kr || !hf || !vf || !muf || !mean) {
        free(kr), free(hf), free(vf), free(muf), free(mean);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvcap_capsule_prefill_ref: out of memory");
    }
    memcpy(kr, k, sizeof(float) * (size_t)n * d);
    kvcap_rope_rotate_ref(g, kr, (size_t)n, (size_t)d, -(double)p0);

    /* μ: the mean of the span's values, per channel. */
    for (int c = 0; c < d; c++) {
        double s = 0;
        for (int j = 0; j < n; j++)
            s += v[(size_t)j * d + c];
        mean[c] = s / n;
        muf[c] = (float)mean[c];
    }
    for (int t = 0; t < tiles; t++) {
        /* H_t[i][c] = φ(b1[i] + Σ_r W1[r][i] · K'[token of mask point r][c]) */
        for (int i = 0; i < h; i++)
            for (int c = 0; c < d; c++) {
                double s = maps->b1[i];
                for (int r = 0; r < maps->rk; r++) {
                    size_t j = kvcap_bucket_token(bucket, t, maps->mask[r]);
                    s += (double)maps->w1[(size_t)r * h + i] * kr[j * d + c];
                }
                float x = (float)s;
                hf[((size_t)t * h + i) * d + c] = maps->gelu ? kvcap_gelu(x) : x;
            }
        /* Ṽ_t[r][c] = Σ_p U[r][p] · (V[token of point p][c] − μ[c]) */
        for (int r = 0; r < rv; r++)
            for (int c = 0; c < d; c++) {
                double s = 0;
                for (int p = 0; p < m; p++) {
                    size_t j = kvcap_bucket_token(bucket, t, p);
                    s += (double)maps->u[(size_t)r * m + p] * (v[j * d + c] - mean[c]);
                }
                vf[((size_t)t * rv + r) * d + c] = (float)s;
            }
    }
    kvcap_convert_from_f32(storage, hf, (size_t)tiles * h * d, hs);
    kvcap_convert_from_f32(storage, vf, (size_t)tiles * rv * d, vt);
    kvcap_convert_from_f32(storage, muf, (size_t)d, mu);
    free(kr), free(hf), free(vf), free(muf), free(mean);
    return KVCAP_OK;
}

/* ---- The fast form --------------------------------------------------------------------------- */

size_t kvcap_capsule_prefill_scratch_floats(const struct kvcap_capsule_prefill_maps *maps, int d)
{
    if (!maps || d < 1)
        return 0;
    int wide = maps->h > maps->rv ? maps->h : maps->rv;
    return ((size_t)maps->m + (size_t)wide + 1) * (size_t)d;
}

enum kvcap_status kvcap_capsule_prefill(const struct kvcap_model_geometry *g,
                                        const struct kvcap_bucket *bucket,
                                        const struct kvcap_capsule_prefill_maps *maps, int n,
                                        int d, int64_t p0, float *k, const float *v,
                                        enum kvcap_dtype storage, void *hs, void *vt, void *mu,
                                        float *scratch)
{
    KVCAP_TRY(check("kvcap_capsule_prefill", g, bucket, maps, n, d, k, v, storage, hs, vt, mu));
    KVCAP_RETURN_IF(!scratch, KVCAP_ERR_INVALID_ARGUMENT, "kvcap_capsule_prefill: NULL scratch");
    const struct kvcap_capsule_prefill_maps *u = maps;
    const int m = u->m, tiles = n / m;
    const size_t es = kvcap_dtype_size(storage);
    float *tile = scratch;                 /* [m][d] */
    float *out = tile + (size_t)m * d;     /* [max(h, rv)][d] */
    kvcap_rope_rotate(g, k, (size_t)n, (size_t)d, -(double)p0);
    for (int t = 0; t < tiles; t++) {
        /* H_t = φ(W1ᵀ K'[M] + b1 1ᵀ): [h][d] */
        for (int r = 0; r < u->rk; r++)
            memcpy(tile + (size_t)r * d, k + kvcap_bucket_token(bucket, t, u->mask[r]) * (size_t)d,
                   sizeof(float) * (size_t)d);
        for (int i = 0; i < u->h; i++)
            for (int ch = 0; ch < d; ch++)
                out[(size_t)i * d + ch] = u->b1[i];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, u->h, d, u->rk, 1.0f, u->w1, u->h,
                    tile, d, 1.0f, out, d);
        if (u->gelu)
            for (size_t i = 0; i < (size_t)u->h * d; i++)
                out[i] = kvcap_gelu(out[i]);
        kvcap_convert_from_f32(storage, out, (size_t)u->h * d,
                               (char *)hs + (size_t)t * u->h * d * es);
    }
    return kvcap_capsule_prefill_values(bucket, m, u->rv, u->u, n, d, v, storage, vt, mu,
                                        scratch);
}

size_t kvcap_capsule_prefill_values_scratch_floats(int m, int rv, int d)
{
    return m < 1 || rv < 0 || d < 1 ? 0 : ((size_t)m + (size_t)rv + 1) * (size_t)d;
}

/* The argument check of the value state's two forms: a basis of rank rv over m points that fits
 * the bucket's tiles, a storage dtype, no NULL. */
static enum kvcap_status check_values(const char *fn, const struct kvcap_bucket *bucket, int m,
                                      int rv, const float *u, int n, int d, const float *v,
                                      enum kvcap_dtype storage, const void *vt, const void *mu,
                                      const void *scratch)
{
    KVCAP_RETURN_IF(!bucket || !u || !v || !vt || !mu || !scratch, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: NULL argument", fn);
    KVCAP_RETURN_IF(m < 1 || rv < 0 || rv > m || d < 1 || n < m || n % m != 0 ||
                        (int64_t)bucket->rows * bucket->cols != n ||
                        (bucket->structure == KVCAP_STRUCTURE_TILED
                             ? bucket->tile_rows * bucket->tile_cols
                             : n) != m,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: a basis of rank %d over %d points for %d tokens of head_dim %d on a "
                    "%dx%d grid",
                    fn, rv, m, n, d, bucket->rows, bucket->cols);
    KVCAP_RETURN_IF(!kvcap_dtype_is_storage(storage), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: storage %s is not F32, F16 or BF16", fn, kvcap_dtype_name(storage));
    return KVCAP_OK;
}

enum kvcap_status kvcap_capsule_prefill_values(const struct kvcap_bucket *bucket, int m, int rv,
                                               const float *u, int n, int d, const float *v,
                                               enum kvcap_dtype storage, void *vt, void *mu,
                                               float *scratch)
{
    KVCAP_TRY(check_values("kvcap_capsule_prefill_values", bucket, m, rv, u, n, d, v, storage,
                           vt, mu, scratch));
    const int tiles = n / m;
    const size_t es = kvcap_dtype_size(storage);
    float *tile = scratch, *out = tile + (size_t)m * d, *muf = out + (size_t)rv * d;
    for (int ch = 0; ch < d; ch++) {
        double sum = 0;
        for (int j = 0; j < n; j++)
            sum += v[(size_t)j * d + ch];
        muf[ch] = (float)(sum / n);
    }
    for (int t = 0; t < tiles && rv > 0; t++) {
        /* Ṽ_t = U (V_t − 1μᵀ): [rv][d] */
        for (int p = 0; p < m; p++) {
            const float *row = v + kvcap_bucket_token(bucket, t, p) * (size_t)d;
            for (int ch = 0; ch < d; ch++)
                tile[(size_t)p * d + ch] = row[ch] - muf[ch];
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rv, d, m, 1.0f, u, m, tile, d,
                    0.0f, out, d);
        kvcap_convert_from_f32(storage, out, (size_t)rv * d, (char *)vt + (size_t)t * rv * d * es);
    }
    kvcap_convert_from_f32(storage, muf, (size_t)d, mu);
    return KVCAP_OK;
}

size_t kvcap_capsule_fit_values_scratch_doubles(int m, int rv, int d)
{
    (void)m;
    return rv < 0 || d < 1 ? 0 : (size_t)rv * rv + (size_t)rv * d + (size_t)d;
}

enum kvcap_status kvcap_capsule_fit_values(const struct kvcap_bucket *bucket, int m, int rv,
                                           const float *u, int n, int d, const float *v,
                                           const unsigned char *fit, enum kvcap_dtype storage,
                                           void *vt, void *mu, double *scratch)
{
    KVCAP_TRY(check_values("kvcap_capsule_fit_values", bucket, m, rv, u, n, d, v, storage, vt,
                           mu, scratch));
    KVCAP_RETURN_IF(!fit, KVCAP_ERR_INVALID_ARGUMENT, "kvcap_capsule_fit_values: NULL argument");
    const int tiles = n / m;
    const size_t es = kvcap_dtype_size(storage);
    double *a = scratch, *x = a + (size_t)rv * rv, *mud = x + (size_t)rv * d;
    int count = 0;
    memset(mud, 0, sizeof(double) * (size_t)d);
    for (int j = 0; j < n; j++)
        if (fit[j]) {
            count++;
            for (int ch = 0; ch < d; ch++)
                mud[ch] += v[(size_t)j * d + ch];
        }
    for (int ch = 0; ch < d; ch++)
        mud[ch] = count ? mud[ch] / count : 0.0;
    for (int t = 0; t < tiles && rv > 0; t++) {
        /* normal equations: a = Σ_p u_p u_pᵀ + λI, x = Σ_p u_p (v_p − μ)ᵀ over the tile's points
         * in F; then a x = b in place */
        memset(a, 0, sizeof(double) * (size_t)rv * rv);
        memset(x, 0, sizeof(double) * (size_t)rv * d);
        for (int r = 0; r < rv; r++)
            a[(size_t)r * rv + r] = KVCAP_FIT_RIDGE;
        int points = 0;
        for (int p = 0; p < m; p++) {
            const int64_t j = kvcap_bucket_token(bucket, t, p);
            if (!fit[j])
                continue;
            points++;
            const float *row = v + (size_t)j * d;
            for (int r = 0; r < rv; r++) {
                const double ur = u[(size_t)r * m + p];
                for (int s = 0; s < rv; s++)
                    a[(size_t)r * rv + s] += ur * u[(size_t)s * m + p];
                for (int ch = 0; ch < d; ch++)
                    x[(size_t)r * d + ch] += ur * (row[ch] - mud[ch]);
            }
        }
        if (points > 0 && LAPACKE_dposv(LAPACK_ROW_MAJOR, 'U', rv, d, a, rv, x, d) != 0)
            return kvcap_fail(KVCAP_ERR_NUMERIC, "kvcap_capsule_fit_values: the normal equations "
                              "of tile %d are not positive definite (non-finite values?)", t);
        char *dst = (char *)vt + (size_t)t * rv * d * es;
        for (size_t i = 0; i < (size_t)rv * d; i++) { /* x is 0 for a tile with no point in F */
            float f = (float)x[i];
            kvcap_convert_from_f32(storage, &f, 1, dst + i * es);
        }
    }
    for (int ch = 0; ch < d; ch++) {
        float f = (float)mud[ch];
        kvcap_convert_from_f32(storage, &f, 1, (char *)mu + (size_t)ch * es);
    }
    return KVCAP_OK;
}

/* ---- Reconstruction error per tile (kvcap's exact tiles) ----------------------------------- */

static enum kvcap_status check_error(const char *fn, const struct kvcap_bucket *b,
                                     const struct kvcap_capsule_maps *mp, int n, int d,
                                     const float *kr, const float *v, const float *hs,
                                     const float *vt, const float *mu, const float *err)
{
    KVCAP_RETURN_IF(!b || !mp || !kr || !v || !hs || !vt || !mu || !err || !mp->w2 || !mp->b2 ||
                        !mp->u,
                    KVCAP_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
    KVCAP_RETURN_IF(d < 1 || n < 1 || (int64_t)b->rows * b->cols != n, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: %d tokens of head_dim %d on a %dx%d grid", fn, n, d, b->rows, b->cols);
    int m = b->structure == KVCAP_STRUCTURE_TILED ? b->tile_rows * b->tile_cols : n;
    KVCAP_RETURN_IF(mp->m != m || m < 1 || n % m != 0 || mp->h < 0 || mp->rv < 0,
                    KVCAP_ERR_INVALID_ARGUMENT, "%s: maps of %d points (h %d, rv %d) for tiles "
                    "of %d", fn, mp->m, mp->h, mp->rv, m);
    return KVCAP_OK;
}

/* A span's mean energy from its sum over n tokens, 1 where 0 (a span of zeros is reconstructed
 * exactly). */
static double mean_energy(double sum, size_t n)
{
    return sum > 0 ? sum / (double)n : 1.0;
}

/* The span's mean ‖k'‖² and ‖v − μ‖². */
static void span_energies(int n, int d, const float *kr, const float *v, const float *mu,
                          double *k2, double *v2)
{
    double ks = 0, vs = 0;
    for (size_t i = 0; i < (size_t)n * d; i++) {
        double dv = (double)v[i] - mu[i % (size_t)d];
        ks += (double)kr[i] * kr[i];
        vs += dv * dv;
    }
    *k2 = mean_energy(ks, (size_t)n);
    *v2 = mean_energy(vs, (size_t)n);
}

enum kvcap_status kvcap_capsule_tile_error_ref(const struct kvcap_bucket *bucket,
                                               const struct kvcap_capsule_maps *maps, int n,
                                               int d, const float *kr, const float *v,
                                               const float *hs, const float *vt,
                                               const float *mu, float *err)
{
    KVCAP_TRY(check_error("kvcap_capsule_tile_error_ref", bucket, maps, n, d, kr, v, hs, vt, mu,
                          err));
    const int m = maps->m, h = maps->h, rv = maps->rv, tiles = n / m;
    double k2, v2;
    span_energies(n, d, kr, v, mu, &k2, &v2);
    for (int t = 0; t < tiles; t++) {
        double worst = 0;
        for (int p = 0; p < m; p++) {
            size_t j = kvcap_bucket_token(bucket, t, p);
            double ke = 0, ve = 0;
            for (int c = 0; c < d; c++) {
                double khat = maps->b2[p], vhat = mu[c];
                for (int a = 0; a < h; a++)
                    khat += (double)maps->w2[(size_t)a * m + p] * hs[((size_t)t * h + a) * d + c];
                for (int r = 0; r < rv; r++)
                    vhat += (double)maps->u[(size_t)r * m + p] * vt[((size_t)t * rv + r) * d + c];
                ke += (khat - kr[j * d + c]) * (khat - kr[j * d + c]);
                ve += (vhat - v[j * d + c]) * (vhat - v[j * d + c]);
            }
            double e = ke / k2 + ve / v2;
            worst = e > worst ? e : worst;
        }
        err[t] = (float)worst;
    }
    return KVCAP_OK;
}

size_t kvcap_capsule_tile_error_scratch_floats(const struct kvcap_capsule_maps *maps, int d)
{
    return maps && d > 0 ? 2 * (size_t)maps->m * (size_t)d : 0;
}

enum kvcap_status kvcap_capsule_tile_error(const struct kvcap_bucket *bucket,
                                           const struct kvcap_capsule_maps *maps, int n, int d,
                                           const float *kr, const float *v, const float *hs,
                                           const float *vt, const float *mu, float *err,
                                           float *scratch)
{
    KVCAP_TRY(check_error("kvcap_capsule_tile_error", bucket, maps, n, d, kr, v, hs, vt, mu,
                          err));
    KVCAP_RETURN_IF(!scratch, KVCAP_ERR_INVALID_ARGUMENT, "kvcap_capsule_tile_error: NULL scratch");
    const int m = maps->m, h = maps->h, rv = maps->rv, tiles = n / m;
    float *khat = scratch, *vhat = scratch + (size_t)m * d; /* [m][d] each */
    double k2, v2;
    span_energies(n, d, kr, v, mu, &k2, &v2);
    for (int t = 0; t < tiles; t++) {
        /* K̂'_t = W2ᵀ H_t + b2 1ᵀ, V̂_t = Uᵀ Ṽ_t + 1 μᵀ: [m][d] */
        for (int p = 0; p < m; p++)
            for (int c = 0; c < d; c++) {
                khat[(size_t)p * d + c] = maps->b2[p];
                vhat[(size_t)p * d + c] = mu[c];
            }
        if (h > 0)
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, d, h, 1.0f, maps->w2, m,
                        hs + (size_t)t * h * d, d, 1.0f, khat, d);
        if (rv > 0)
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, d, rv, 1.0f, maps->u, m,
                        vt + (size_t)t * rv * d, d, 1.0f, vhat, d);
        double worst = 0;
        for (int p = 0; p < m; p++) {
            size_t j = kvcap_bucket_token(bucket, t, p);
            const float *kp = khat + (size_t)p * d, *vp = vhat + (size_t)p * d;
            double ke = 0, ve = 0;
            for (int c = 0; c < d; c++) {
                double dk = (double)kp[c] - kr[j * d + c], dv = (double)vp[c] - v[j * d + c];
                ke += dk * dk;
                ve += dv * dv;
            }
            double e = ke / k2 + ve / v2;
            worst = e > worst ? e : worst;
        }
        err[t] = (float)worst;
    }
    return KVCAP_OK;
}

void kvcap_capsule_tile_error_points(const double *points, int tiles, int m, float *err)
{
    const size_t n = (size_t)tiles * m;
    double ks = 0, vs = 0;
    for (size_t i = 0; i < n; i++) {
        ks += points[4 * i];
        vs += points[4 * i + 1];
    }
    const double k2 = mean_energy(ks, n), v2 = mean_energy(vs, n);
    for (int t = 0; t < tiles; t++) {
        double worst = 0;
        for (int p = 0; p < m; p++) {
            const double *x = points + 4 * ((size_t)t * m + p);
            double e = x[2] / k2 + x[3] / v2;
            worst = e > worst ? e : worst;
        }
        err[t] = (float)worst;
    }
}
