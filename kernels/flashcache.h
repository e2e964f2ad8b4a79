/* flashcache.h — FlashCache's scoring (DESIGN §5): per-token deviation of K and V from their
 * DCT low-pass Base, the layer's energy ratio, and the layer budgets under a global total.
 * Attention-score free: nothing here ever touches a query. */
#ifndef KVCAP_FLASHCACHE_H
#define KVCAP_FLASHCACHE_H

#include <stdint.h>

#include "kernels/dct.h"

/* Energies of one layer, summed over its KV heads and channels: ‖X‖² and ‖C_X[:ω]‖². */
struct kvcap_energy {
    double k_total, k_low, v_total, v_low;
};

/* The transform window [*a, *b) of an n-token span whose compressible tokens are [lo, hi):
 * [lo, hi) itself when its length is a fast DCT length, else the shortest window of a fast
 * length inside [0, n) that contains it (the protected neighbours join the low-pass fit, which
 * costs nothing in fidelity and saves Bluestein's ~4x), else [lo, hi). */
void kvcap_flashcache_window(int n, int lo, int hi, int *a, int *b);

/* ω = ⌈γ n⌉, clamped to [1, n] (NaN γ gives 1, n < 1 gives 0). A γn within 1e-9 relative of
 * an integer counts as that integer, so that 0.07·100 (7.000000000000001 in double) is 7. */
int kvcap_flashcache_omega(double gamma, int n);

/* One KV head: k, v [n][d] f32 contiguous (n = kvcap_dct_length(plan), the compressible
 * tokens; d >= 1). dev[j] = mean_c (K[j,c] − K_base[j,c])² + mean_c (V[j,c] − V_base[j,c])²,
 * with Base the inverse DCT of the first ω coefficients (omega clamped to [0, n]); adds this
 * head's energies to *e (skipped when e is NULL): totals as Σ x² in double, low parts from
 * the first ω coefficients only (Parseval). scratch: kvcap_flashcache_scratch_floats floats,
 * caller-owned, one per thread. */
void kvcap_flashcache_deviation(const struct kvcap_dct *plan, const float *k, const float *v,
                                int d, int omega, float *dev, struct kvcap_energy *e,
                                float *scratch);
size_t kvcap_flashcache_scratch_floats(const struct kvcap_dct *plan, int d);
/* Brute force: the first ω DCT rows and the Base from the basis formula, O(n·ω·d) in double.
 * The oracle of the tests; if its scratch cannot be allocated dev is filled with NaN and *e
 * is left as it was. */
void kvcap_flashcache_deviation_ref(int n, const float *k, const float *v, int d, int omega,
                                    float *dev, struct kvcap_energy *e);

/* R_ℓ = R_k + R_v with R_x = 1 − low/total (0 when total is 0), each clamped to [0, 1] so
 * that rounding (low a few ulps above total) never yields a negative weight. NaN for a NULL
 * e or NaN energies, which kvcap_budget_allocate then rejects. */
double kvcap_flashcache_layer_weight(const struct kvcap_energy *e);

/* Integer budgets proportional to w[ℓ] (≥ 0; all zero: proportional to cap) with
 * Σ budget = total exactly, each clipped to [min(lo, cap[ℓ]), cap[ℓ]] and the excess or
 * shortfall redistributed over the unclipped layers (water-filling); the rounding gives the
 * leftover units to the largest remainders (ties: lower ℓ), so every budget is within one
 * token of the exact proportional share. total is first clamped to [Σ min(lo, cap), Σ cap].
 * Zero-weight layers stay at their floor unless every positive-weight layer is at its cap;
 * then they share the rest in proportion to cap.
 * KVCAP_ERR_INVALID_ARGUMENT for NULL pointers, L < 1, lo < 0, negative or non-finite
 * weights, negative caps; KVCAP_ERR_OUT_OF_MEMORY. */
enum kvcap_status kvcap_budget_allocate(const double *w, const int *cap, int L, int lo,
                                        int64_t total, int *budget);

#endif
