/* keys.h — key compression maps (DESIGN §4): a retained subset M of the m points of a bucket
 * (all tokens, or the tokens of one tile) and a reconstructor along the point axis,
 *     K̂' = W2ᵀ φ(W1ᵀ K'[M] + b1 1ᵀ) + b2 1ᵀ,
 * fitted in closed form (pivoted-Cholesky mask + ridge least squares, factored to rank h) or
 * trained (relaxed mask, Adam). Every channel column of every sample is one training example,
 * so samples are passed as an m x N row-major matrix X (leading dimension ldx >= N): column j
 * is one channel of one span (or tile) of offset-free keys. */
#ifndef KVCAP_KEYS_H
#define KVCAP_KEYS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/activation.h"
#include "configs/config.h"
#include "kvcap.h"

struct kvcap_key_maps {
    int m;        /* points per sample (n for dense buckets, t for tiled) */
    int rk;       /* retained points |M| */
    int h;        /* reconstructor width */
    int gelu;     /* φ = GELU (tanh form) if nonzero, identity otherwise */
    int32_t *mask; /* [rk], strictly increasing, in [0, m) */
    float *w1;    /* [rk][h] */
    float *b1;    /* [h] */
    float *w2;    /* [h][m] */
    float *b2;    /* [m] */
};

/* Allocates the arrays (zeroed) for the given sizes; free with kvcap_key_maps_free. */
enum kvcap_status kvcap_key_maps_alloc(struct kvcap_key_maps *k, int m, int rk, int h, int gelu);
void kvcap_key_maps_free(struct kvcap_key_maps *k); /* NULL-safe, leaves k zeroed */
enum kvcap_status kvcap_key_maps_copy(struct kvcap_key_maps *dst, const struct kvcap_key_maps *src);


/* Reconstructs one sample: xk = K'[M] as [rk][ncols] (ld ldk), out = K̂' as [m][ncols]
 * (ld ldo), hidden scratch [h][ncols]. The readable reference, used by tests and metrics. */
void kvcap_key_maps_apply_ref(const struct kvcap_key_maps *k, const float *xk, size_t ldk,
                              size_t ncols, float *hidden, float *out, size_t ldo);

/* The same with sgemm: xk [rk][ncols] (ld ldk), hidden [h][ncols], out [m][ncols] (ld ldo). */
void kvcap_key_maps_apply(const struct kvcap_key_maps *k, const float *xk, size_t ldk,
                          size_t ncols, float *hidden, float *out, size_t ldo);

/* Mean squared reconstruction error over the N columns of X (m x N, ld ldx), and the
 * reference energy mean(X²) so callers can form relative errors. Uses sgemm. */
enum kvcap_status kvcap_key_maps_mse(const struct kvcap_key_maps *k, const float *x, size_t ldx,
                                     size_t n_cols, double *mse, double *energy);

/* Closed form from the uncentred Gram C = Σ X Xᵀ (m x m, row-major doubles):
 * M by greedy pivoted Cholesky of C (the point explaining the most residual energy first;
 * near-ties, within 1e-6·tr C, to the smallest index; then refined by swaps on the
 * least-squares error; keys.c says why: the mask must not depend on rounding), the ridge
 * least-squares map A = C[:,M] (C[M,M] + λ·mean(diag C[M,M]) I)⁻¹, then the optimal rank-h
 * factorisation A ≈ W2ᵀ W1ᵀ (reduced-rank regression; exact when h >= rk). Linear maps, zero
 * biases: out->gelu = 0. `ridge` is λ, relative to the mean retained diagonal. */
enum kvcap_status kvcap_keys_closed_form(const double *gram, int m, int rk, int h, double ridge,
                                         struct kvcap_key_maps *out);

/* The two halves of kvcap_keys_closed_form. kvcap_keys_select: the mask alone (rk points,
 * ascending). kvcap_keys_closed_form_mask: the maps for a given mask (strictly increasing,
 * in [0, m)). */
enum kvcap_status kvcap_keys_select(const double *gram, int m, int rk, int32_t *mask);
enum kvcap_status kvcap_keys_closed_form_mask(const double *gram, int m, const int32_t *mask,
                                              int rk, int h, double ridge,
                                              struct kvcap_key_maps *out);

/* What kvcap_keys_train did. */
struct kvcap_train_report {
    double init_train_mse, init_val_mse;   /* the closed-form initialisation */
    double final_train_mse, final_val_mse; /* the returned maps */
    int steps_run;
    int kept_init; /* 1 if the initialisation was better on validation and was returned */
    int on_device; /* 1 if the steps and MSEs ran on a CUDA device (kvcap_calib_cuda_keys_train) */
};

/* The trained path (the paper's Algorithm 2). Starting from `init` (a closed-form fit; if
 * cfg-> activation is GELU, the linear map is embedded in the GELU network by a bias shift so
 * the start reproduces it), optimise a relaxed mask m = σ(α/τ) over all m points together with
 * W1 (m x h while relaxed), b1, W2, b2 by Adam on
 *     MSE(K̂', K') + λ_bce·mean H(m) + λ_r·(mean(m) − rk/m)²,
 * annealing τ geometrically from tau_start to tau_end; then take the hard top-rk mask by α and
 * fine-tune W1[M], b1, W2, b2. Samples: x_train (m x n_train, ld), x_val (m x n_val, ld; may be
 * empty, then the training set decides). The returned maps are the best of the checkpoints on
 * validation MSE, the initialisation included, so the result is never worse than the closed
 * form on validation. Deterministic for a given cfg->seed. */
enum kvcap_status kvcap_keys_train(const float *x_train, size_t ld_train, size_t n_train,
                                   const float *x_val, size_t ld_val, size_t n_val,
                                   const struct kvcap_train_config *cfg, int gelu,
                                   const struct kvcap_key_maps *init, struct kvcap_key_maps *out,
                                   struct kvcap_train_report *report);

#endif
