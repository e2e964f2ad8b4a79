/* dct.c — orthonormal DCT-II / low-pass DCT-III along the token axis for FlashCache: the O(n²)
 * double oracles first, then the O(n log n) version (Makhoul + KissFFT, Bluestein for lengths
 * KissFFT has no fast butterfly for), two real channels per complex FFT. */
#include <math.h>
#include <stdalign.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <kiss_fft.h>

#include "kernels/dct.h"
#include "common/internal.h"

#define PI 3.14159265358979323846

/* ---- reference (O(n²), double) ---------------------------------------------------------------- */

double kvcap_dct_basis(int n, int k, int j)
{
    /* cos(π m / 2n) has period 4n in m = (2j+1)k: reduce in integers so the angle stays in
     * [0, 2π) and keeps full double accuracy at any n. (2j+1)k < 2n² < 2^63. */
    uint64_t m = ((uint64_t)(2 * (int64_t)j + 1) * (uint64_t)k) % (4 * (uint64_t)n);
    double s = k == 0 ? sqrt(1.0 / n) : sqrt(2.0 / n);
    return s * cos(PI * (double)m / (2.0 * n));
}

/* Channels per pass of the oracles: one basis evaluation serves this many accumulators. */
#define REF_CHUNK 8

void kvcap_dct_forward_ref(int n, const float *x, size_t ld, int cols, float *out, size_t ld_out)
{
    for (int k = 0; k < n; k++)
        for (int c0 = 0; c0 < cols; c0 += REF_CHUNK) {
            int w = cols - c0 < REF_CHUNK ? cols - c0 : REF_CHUNK;
            double acc[REF_CHUNK] = {0};
            for (int j = 0; j < n; j++) {
                double b = kvcap_dct_basis(n, k, j);
                for (int c = 0; c < w; c++)
                    acc[c] += b * x[(size_t)j * ld + (size_t)(c0 + c)];
            }
            for (int c = 0; c < w; c++)
                out[(size_t)k * ld_out + (size_t)(c0 + c)] = (float)acc[c];
        }
}

void kvcap_dct_inverse_ref(int n, const float *c, size_t ld, int cols, int keep, float *out,
                           size_t ld_out)
{
    keep = keep < 0 ? 0 : keep > n ? n : keep;
    for (int j = 0; j < n; j++)
        for (int c0 = 0; c0 < cols; c0 += REF_CHUNK) {
            int w = cols - c0 < REF_CHUNK ? cols - c0 : REF_CHUNK;
            double acc[REF_CHUNK] = {0};
            for (int k = 0; k < keep; k++) {
                double b = kvcap_dct_basis(n, k, j);
                for (int i = 0; i < w; i++)
                    acc[i] += b * c[(size_t)k * ld + (size_t)(c0 + i)];
            }
            for (int i = 0; i < w; i++)
                out[(size_t)j * ld_out + (size_t)(c0 + i)] = (float)acc[i];
        }
}

/* ---- plan ------------------------------------------------------------------------------------- */

struct kvcap_dct {
    int n;
    int m;           /* FFT length: n, or Bluestein's m >= 2n − 1; 0 when n = 1 (no FFT) */
    double *fw;      /* [2n] (s_k / 2) e^{−iπk/2n}: forward post-twiddle, scale and the ½ of
                      * separating two packed channels folded in */
    double *iw;      /* [2n] e^{iπk/2n} / (n s_k): inverse pre-twiddle with both scales */
    double *chirp;   /* [2n] e^{−iπk²/n} (Bluestein only, else NULL) */
    kiss_fft_cpx *filt; /* [m] FFT of the conjugate chirp, divided by m (Bluestein only) */
    kiss_fft_cfg cfg;   /* forward FFT of length m, inside this allocation; inverses use
                         * IFFT(y) = conj(FFT(conj(y))), so one config serves both */
};

static int smooth235(int n)
{
    while (n % 2 == 0)
        n /= 2;
    while (n % 3 == 0)
        n /= 3;
    while (n % 5 == 0)
        n /= 5;
    return n == 1;
}

int kvcap_dct_fast_length(int n)
{
    return n >= 1 && smooth235(n);
}

/* Appends `bytes` at an offset aligned for any type to an allocation of *total bytes and
 * returns that offset; clears *ok on size_t overflow. */
static size_t reserve(size_t *total, size_t bytes, int *ok)
{
    const size_t a = alignof(max_align_t);
    size_t off = (*total + a - 1) / a * a;
    if (off < *total || !kvcap_add_size(off, bytes, total))
        *ok = 0;
    return off;
}

enum kvcap_status kvcap_dct_create(int n, struct kvcap_dct **out)
{
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "kvcap_dct_create: out is NULL");
    *out = NULL;
    /* INT_MAX / 4 keeps 2n − 1 and the smooth size search inside int. */
    KVCAP_RETURN_IF(n < 1 || n > INT32_MAX / 4, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_dct_create: n = %d must be in [1, %d]", n, INT32_MAX / 4);
    int m = n == 1 ? 0 : smooth235(n) ? n : kiss_fft_next_fast_size(2 * n - 1);
    int blue = m > n;

    int ok = 1;
    size_t total = sizeof(struct kvcap_dct), tw = 0, cfg_len = 0, bf = 0;
    ok = kvcap_mul_size((size_t)n, 2 * sizeof(double), &tw);
    size_t o_fw = reserve(&total, tw, &ok), o_iw = reserve(&total, tw, &ok);
    size_t o_chirp = 0, o_filt = 0, o_cfg = 0;
    if (blue) {
        ok = ok && kvcap_mul_size((size_t)m, sizeof(kiss_fft_cpx), &bf);
        o_chirp = reserve(&total, tw, &ok);
        o_filt = reserve(&total, bf, &ok);
    }
    if (m > 0) {
        kiss_fft_alloc(m, 0, NULL, &cfg_len); /* asks for the size only */
        o_cfg = reserve(&total, cfg_len, &ok);
    }
    KVCAP_RETURN_IF(!ok, KVCAP_ERR_OUT_OF_MEMORY, "kvcap_dct_create: n = %d is too large", n);
    unsigned char *mem = malloc(total);
    KVCAP_RETURN_IF(!mem, KVCAP_ERR_OUT_OF_MEMORY, "kvcap_dct_create: %zu bytes for n = %d",
                    total, n);

    struct kvcap_dct *p = (struct kvcap_dct *)mem;
    p->n = n;
    p->m = m;
    p->fw = (double *)(mem + o_fw);
    p->iw = (double *)(mem + o_iw);
    p->chirp = blue ? (double *)(mem + o_chirp) : NULL;
    p->filt = blue ? (kiss_fft_cpx *)(mem + o_filt) : NULL;
    p->cfg = NULL;
    for (int k = 0; k < n; k++) {
        double a = PI * k / (2.0 * n), ca = cos(a), sa = sin(a);
        double s = k == 0 ? sqrt(1.0 / n) : sqrt(2.0 / n);
        p->fw[2 * k] = 0.5 * s * ca;
        p->fw[2 * k + 1] = -0.5 * s * sa;
        p->iw[2 * k] = ca / (n * s);
        p->iw[2 * k + 1] = sa / (n * s);
    }
    if (m > 0) {
        size_t len = cfg_len;
        p->cfg = kiss_fft_alloc(m, 0, mem + o_cfg, &len);
        if (!p->cfg) {
            free(mem);
            return kvcap_fail(KVCAP_ERR_INTERNAL, "kvcap_dct_create: kiss_fft_alloc(%d) failed", m);
        }
    }
    if (blue) {
        for (int k = 0; k < n; k++) {
            /* e^{−iπk²/n} has period 2n in k²: reduce exactly before the angle is formed. */
            uint64_t r = ((uint64_t)k * (uint64_t)k) % (2 * (uint64_t)n);
            p->chirp[2 * k] = cos(PI * (double)r / n);
            p->chirp[2 * k + 1] = -sin(PI * (double)r / n);
        }
        /* b[t] = conj(chirp[|t|]) for |t| < n, wrapped mod m; its spectrum is the filter. */
        kiss_fft_cpx *b = calloc((size_t)m, sizeof *b);
        if (!b) {
            free(mem);
            return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "kvcap_dct_create: %zu bytes for n = %d",
                              bf, n);
        }
        for (int t = 0; t < n; t++) {
            kiss_fft_cpx v = {(float)p->chirp[2 * t], (float)-p->chirp[2 * t + 1]};
            b[t] = v;
            if (t > 0)
                b[m - t] = v;
        }
        kiss_fft(p->cfg, b, p->filt);
        for (int k = 0; k < m; k++) {
            p->filt[k].r /= (float)m;
            p->filt[k].i /= (float)m;
        }
        free(b);
    }
    *out = p;
    return KVCAP_OK;
}

void kvcap_dct_free(struct kvcap_dct *p)
{
    free(p); /* the KissFFT config lives inside the same allocation */
}

int kvcap_dct_length(const struct kvcap_dct *p)
{
    return p ? p->n : 0;
}

size_t kvcap_dct_scratch_floats(const struct kvcap_dct *p)
{
    if (!p)
        return 0;
    return 4 * (size_t)p->n + (p->m > p->n ? 4 * (size_t)p->m : 0);
}

/* ---- fast path -------------------------------------------------------------------------------- */

/* out = DFT_n(in) (e^{−2πijk/n}); in and out distinct, n entries each; work: 2m entries for a
 * Bluestein plan. KissFFT is never called in place (it would malloc a temporary). */
static void dft(const struct kvcap_dct *p, const kiss_fft_cpx *in, kiss_fft_cpx *out,
                kiss_fft_cpx *work)
{
    const int n = p->n, m = p->m;
    if (m == n) {
        kiss_fft(p->cfg, in, out);
        return;
    }
    /* Bluestein: jk = (j² + k² − (k−j)²)/2 turns the DFT into a convolution with the chirp,
     * done cyclically at the smooth length m >= 2n − 1. */
    kiss_fft_cpx *a = work, *b = work + m;
    const double *w = p->chirp;
    for (int k = 0; k < n; k++) {
        double wr = w[2 * k], wi = w[2 * k + 1];
        a[k].r = (float)(in[k].r * wr - in[k].i * wi);
        a[k].i = (float)(in[k].r * wi + in[k].i * wr);
    }
    for (int k = n; k < m; k++)
        a[k].r = a[k].i = 0.0f;
    kiss_fft(p->cfg, a, b);
    for (int k = 0; k < m; k++) {
        float yr = b[k].r * p->filt[k].r - b[k].i * p->filt[k].i;
        float yi = b[k].r * p->filt[k].i + b[k].i * p->filt[k].r;
        b[k].r = yr;
        b[k].i = -yi; /* conj: the inverse FFT as conj(FFT(conj(y))) */
    }
    kiss_fft(p->cfg, b, a);
    for (int k = 0; k < n; k++) {
        double wr = w[2 * k], wi = w[2 * k + 1], zr = a[k].r, zi = -a[k].i;
        out[k].r = (float)(zr * wr - zi * wi);
        out[k].i = (float)(zr * wi + zi * wr);
    }
}

/* Makhoul's order: even samples ascending, then odd samples descending; sample j sits at
 * position perm(j) of the length-n sequence whose DFT gives the DCT. */
static inline int perm(int n, int j)
{
    return (j & 1) ? n - 1 - j / 2 : j / 2;
}

void kvcap_dct_forward(const struct kvcap_dct *p, const float *x, size_t ld, int cols, float *out,
                       size_t ld_out, float *scratch)
{
    const int n = p->n;
    if (n == 1) {
        for (int c = 0; c < cols; c++)
            out[c] = x[c];
        return;
    }
    kiss_fft_cpx *z = (kiss_fft_cpx *)scratch, *zf = z + n, *work = zf + n;
    for (int a = 0; a < cols; a += 2) {
        /* Channel a rides in the real part, a+1 in the imaginary part: both are real, so
         * their spectra separate through Z[n−k] = conj of the real one's Z[k]. */
        const int two = a + 1 < cols;
        for (int j = 0; j < n; j++) {
            const float *row = x + (size_t)j * ld + a;
            z[perm(n, j)].r = row[0];
            z[perm(n, j)].i = two ? row[1] : 0.0f;
        }
        dft(p, z, zf, work);
        for (int k = 0; k < n; k++) {
            double pr = zf[k].r, qi = zf[k].i;
            double rr = zf[k ? n - k : 0].r, si = zf[k ? n - k : 0].i;
            double c = p->fw[2 * k], d = p->fw[2 * k + 1];
            float *o = out + (size_t)k * ld_out + a;
            o[0] = (float)(c * (pr + rr) - d * (qi - si));
            if (two)
                o[1] = (float)(c * (qi + si) - d * (rr - pr));
        }
    }
}

void kvcap_dct_inverse(const struct kvcap_dct *p, const float *c, size_t ld, int cols, int keep,
                       float *out, size_t ld_out, float *scratch)
{
    const int n = p->n;
    keep = keep < 0 ? 0 : keep > n ? n : keep;
    if (n == 1) {
        for (int i = 0; i < cols; i++)
            out[i] = keep ? c[i] : 0.0f;
        return;
    }
    kiss_fft_cpx *zf = (kiss_fft_cpx *)scratch, *z = zf + n, *work = z + n;
    for (int a = 0; a < cols; a += 2) {
        const int two = a + 1 < cols;
        /* V[k] = e^{iπk/2n} (X[k] − i X[n−k]) per channel, X[n] = 0; the two channels' V are
         * packed as Va + i·Vb so one inverse FFT returns va + i·vb (both real). */
        for (int k = 0; k < n; k++) {
            double A = 0, B = 0, A2 = 0, B2 = 0;
            if (k < keep) {
                const float *row = c + (size_t)k * ld + a;
                A = row[0];
                B = two ? row[1] : 0.0;
            }
            if (k > 0 && n - k < keep) {
                const float *row = c + (size_t)(n - k) * ld + a;
                A2 = row[0];
                B2 = two ? row[1] : 0.0;
            }
            double cw = p->iw[2 * k], dw = p->iw[2 * k + 1];
            zf[k].r = (float)(cw * A + dw * A2 - dw * B + cw * B2);
            zf[k].i = (float)-(dw * A - cw * A2 + cw * B + dw * B2); /* conj for IFFT via FFT */
        }
        dft(p, zf, z, work);
        for (int j = 0; j < n; j++) {
            float *o = out + (size_t)j * ld_out + a;
            o[0] = z[perm(n, j)].r;
            if (two)
                o[1] = -z[perm(n, j)].i;
        }
    }
}
