/* dct.h — orthonormal DCT-II along the token axis and its (low-pass) inverse, in O(n log n)
 * through KissFFT (Makhoul's even/odd reordering + a twiddle), for FlashCache (DESIGN §5).
 * Never builds an n×n matrix; the _ref versions (O(n²), double) are the test oracles. */
#ifndef KVCAP_DCT_H
#define KVCAP_DCT_H

#include <stddef.h>

#include "kvcap.h"

/* A plan for one length n >= 1. Read-only after creation: threads may share one plan, each
 * with its own scratch. Lengths whose prime factors are all 2, 3 or 5 use one KissFFT of
 * length n; any other length (a prime, 7·k, ...) goes through Bluestein's chirp-z with a
 * 2,3,5-smooth FFT of length m >= 2n − 1, so every n costs O(n log n) and KissFFT's generic
 * butterfly (O(n·p) for a prime factor p, and a malloc per call) is never reached. */
struct kvcap_dct;

/* KVCAP_ERR_INVALID_ARGUMENT for n < 1 or out == NULL, KVCAP_ERR_OUT_OF_MEMORY. One
 * allocation; *out is owned by the caller and released with kvcap_dct_free. */
enum kvcap_status kvcap_dct_create(int n, struct kvcap_dct **out);
void kvcap_dct_free(struct kvcap_dct *p); /* NULL is a no-op */
int kvcap_dct_length(const struct kvcap_dct *p); /* 0 for NULL */
/* 1 when n >= 1 has no prime factor above 5 (one plain FFT; ~4x cheaper than Bluestein). */
int kvcap_dct_fast_length(int n);

/* Floats of scratch one call of kvcap_dct_forward / kvcap_dct_inverse needs (4n, plus 4m
 * for a Bluestein length). Float alignment suffices. */
size_t kvcap_dct_scratch_floats(const struct kvcap_dct *p);

/* x: n rows (tokens) of `cols` channels, row stride ld floats. out (row stride ld_out):
 *   C[k][c] = s_k Σ_j x[j][c] cos(π (2j+1) k / 2n),  s_0 = √(1/n), s_k = √(2/n) (k > 0).
 * out may be x itself (same stride): each pair of channels is read whole before it is
 * written. Columns cols..ld_out-1 of out are not touched. */
void kvcap_dct_forward(const struct kvcap_dct *p, const float *x, size_t ld, int cols, float *out,
                       size_t ld_out, float *scratch);

/* The inverse of kvcap_dct_forward (orthonormal DCT-III) from the first `keep` coefficient rows
 * of c (rows keep..n-1 are taken as zero and not read; keep is clamped to [0, n]): keep = n is
 * the exact inverse, keep = ω the low-pass Base. out may be c itself (same stride). */
void kvcap_dct_inverse(const struct kvcap_dct *p, const float *c, size_t ld, int cols, int keep,
                       float *out, size_t ld_out, float *scratch);

/* The basis the formulas above share, in double: s_k cos(π (2j+1) k / 2n) for 0 <= k, j < n,
 * with the angle reduced exactly in integers first (accurate for large n). */
double kvcap_dct_basis(int n, int k, int j);

/* The formulas written out (O(n²·cols), sums in double); out must not overlap the input. */
void kvcap_dct_forward_ref(int n, const float *x, size_t ld, int cols, float *out, size_t ld_out);
void kvcap_dct_inverse_ref(int n, const float *c, size_t ld, int cols, int keep, float *out,
                           size_t ld_out);

#endif
