/* train_internal.h — the pieces of kvcap_keys_train (train.c) that tests check on their own:
 * the network of either phase as one flat parameter vector, its loss + gradient (the sgemm
 * version and the readable reference), and the two conversions (closed-form init → relaxed
 * network, relaxed → hard). Internal to the calibration tools; keys.h is the interface. */
#ifndef KVCAP_TRAIN_INTERNAL_H
#define KVCAP_TRAIN_INTERNAL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "calibrate/keys.h"
#include "common/rng.h"

/* Pre-activations of the GELU network that reproduces a linear init are shifted to at least
 * MARGIN + SLACK·(their range) on the training data. tanhf saturates to 1.0f for arguments
 * above ~9, i.e. GELU inputs above ~5.2, so from 6 on kvcap_gelu(z) == z in float and the
 * shifted network equals the linear one up to the rounding of adding and subtracting the
 * shift. The slack covers held-out columns: they may undershoot the training minimum by half
 * the training range (at any data scale) before the start departs from the linear init. */
#define KVCAP_TRAIN_GELU_MARGIN 6.0f
#define KVCAP_TRAIN_GELU_SLACK 0.5f

/* Columns per minibatch; training sets up to this size are used whole (full batch). */
#define KVCAP_TRAIN_BATCH 1024

/* Validation checkpoints during the fine-tune (and always after its last step). */
#define KVCAP_TRAIN_CHECK_EVERY 25

/* Adam, as the CPU loop (train.c) and the CUDA kernel (cuda/train.cu) both apply it, in float:
 *     m1 = β1·m1 + (1 − β1)·g,   m2 = β2·m2 + (1 − β2)·g·g,
 *     θ −= rate·(m1 / c1) / (√(m2 / c2) + eps),   c1 = 1 − β1^t, c2 = 1 − β2^t (step t from 1).
 * The scalars are computed once here, so both paths use the same floats. */
#define KVCAP_TRAIN_ADAM_BETA1 0.9
#define KVCAP_TRAIN_ADAM_BETA2 0.999
#define KVCAP_TRAIN_ADAM_EPS 1e-8

struct kvcap_train_adam_step {
    float beta1, beta2, eps, c1, c2, rate;
};

static inline struct kvcap_train_adam_step kvcap_train_adam_scalars(int t, double lr)
{
    struct kvcap_train_adam_step s;
    s.beta1 = (float)KVCAP_TRAIN_ADAM_BETA1;
    s.beta2 = (float)KVCAP_TRAIN_ADAM_BETA2;
    s.eps = (float)KVCAP_TRAIN_ADAM_EPS;
    s.c1 = (float)(1.0 - pow(KVCAP_TRAIN_ADAM_BETA1, t));
    s.c2 = (float)(1.0 - pow(KVCAP_TRAIN_ADAM_BETA2, t));
    s.rate = (float)lr;
    return s;
}

/* The minibatch order, one definition for both paths so the CPU and the CUDA device see the
 * same columns in the same order for a seed: consecutive slices of b columns of a seeded
 * Fisher–Yates permutation of the n training columns (kvcap_rng_below from the last position
 * down), reshuffled when the rest of it is shorter than a batch; each slice is sorted
 * ascending so gathering it walks memory in order. A set of at most KVCAP_TRAIN_BATCH columns
 * is used whole at every step. */
struct kvcap_train_order {
    size_t n, b;   /* training columns; columns per batch, min(n, KVCAP_TRAIN_BATCH) */
    size_t *perm;  /* [n] the current permutation; NULL when the whole set is the batch */
    size_t *pick;  /* [b] the last batch, increasing */
    size_t pos;    /* batches taken from perm so far, times b */
    struct kvcap_rng rng;
};

enum kvcap_status kvcap_train_order_init(struct kvcap_train_order *o, size_t n, uint64_t seed);
void kvcap_train_order_free(struct kvcap_train_order *o); /* NULL-safe, leaves o zeroed */

/* The next batch: o->b column indices, increasing, valid until the next call; NULL when the
 * whole set is the batch (n <= KVCAP_TRAIN_BATCH). */
const size_t *kvcap_train_order_next(struct kvcap_train_order *o);

/* The network of one phase. Relaxed (rows == NULL, p == m): the input of W1 is diag(mask) X
 * with mask_j = σ(α_j/τ), and the loss adds the two mask terms. Hard (rows != NULL): the input
 * is X[rows], the loss is the plain MSE. Owns rows and theta (kvcap_train_net_free). */
struct kvcap_train_net {
    int m;          /* points per sample: rows of X and of the reconstruction */
    int p;          /* rows of W1: m while relaxed, rk once hard */
    int h;          /* hidden width */
    int gelu;       /* φ = GELU (tanh form) if nonzero, identity otherwise */
    int32_t *rows;  /* hard: [p] retained points, increasing; NULL while relaxed */
    double tau;     /* relaxed: mask temperature */
    double lambda_bce, lambda_r; /* relaxed: weights of mean H(mask) and (mean(mask) − ratio)² */
    double ratio;   /* relaxed: target mean of the mask, rk / m */
    size_t n_params;
    /* One flat vector, so Adam and finite differences see a single array:
     *   relaxed: alpha [m] | w1 [m][h] | b1 [h] | w2 [h][m] | b2 [m]
     *   hard:               w1 [p][h] | b1 [h] | w2 [h][m] | b2 [m] */
    float *theta;
};

/* Pointers into a flat vector laid out like net->theta (the parameters or a gradient);
 * alpha is NULL for a hard network. */
struct kvcap_train_view {
    float *alpha, *w1, *b1, *w2, *b2;
};
struct kvcap_train_view kvcap_train_split(const struct kvcap_train_net *net, float *base);

/* Allocates net->theta (zeroed) for the given shape; rows (hard) is copied. */
enum kvcap_status kvcap_train_net_alloc(struct kvcap_train_net *net, int m, int p, int h,
                                        int gelu, const int32_t *rows);
void kvcap_train_net_free(struct kvcap_train_net *net); /* NULL-safe, leaves net zeroed */

/* The relaxed network whose output at temperature cfg->tau_start equals `init`'s:
 * α_j = ±τ_start·logit(0.95) (+ for retained points), W1 row j = init row / mask_j (zero for the
 * others), b1, W2, b2 copied. If gelu && !init->gelu the linear init is embedded in the GELU
 * network: hidden unit i gets b1_i += c_i and b2 −= W2ᵀ c, with
 *     c_i = max(0, MARGIN − zmin_i + SLACK·(zmax_i − zmin_i))
 * over its pre-activations z_i on the columns of x, so φ acts as the identity there. Held-out
 * columns whose pre-activation falls further below the training minimum see a small, smooth
 * difference (GELU's curve). A GELU init with gelu == 0 is rejected. */
enum kvcap_status kvcap_train_net_init_relaxed(struct kvcap_train_net *net,
                                               const struct kvcap_key_maps *init, int gelu,
                                               const struct kvcap_train_config *cfg,
                                               const float *x, size_t ldx, size_t n_cols);

/* The hard network of `rk` points from a relaxed one: the top-rk α (ties to the lower index),
 * sorted ascending; W1 rows of those points scaled by their mask at relaxed->tau, so the hard
 * output is the relaxed one minus the leak of the dropped points. */
enum kvcap_status kvcap_train_net_harden(const struct kvcap_train_net *relaxed, int rk,
                                         struct kvcap_train_net *hard);

/* Copies a hard network into maps allocated with its shape (m, p, h); sets maps->gelu. */
void kvcap_train_net_to_maps(const struct kvcap_train_net *hard, struct kvcap_key_maps *maps);

/* Replaces W2, b2 of `net` (either phase) by the least-squares readout of its hidden
 * activations on the n_cols columns of x (m x n_cols, ld ldx): the W2, b2 minimising
 * mean((Y − X)²) for the current W1, b1 (and mask), from the centred normal equations in
 * double (b2 takes the means), with ridge·(mean variance of the hidden units) added to their
 * diagonal. *solved = 0 (θ untouched) when the system is singular or not finite. The fine-tune
 * applies it to the hardened network and to its own result (train.c says why). */
enum kvcap_status kvcap_train_net_fit_readout(struct kvcap_train_net *net, const float *x,
                                              size_t ldx, size_t n_cols, double ridge,
                                              int *solved);

/* Scratch of the fast loss for up to `cols` columns. */
struct kvcap_train_work {
    size_t cols;
    float *u, *z, *hid, *y, *dh, *mask;
};
enum kvcap_status kvcap_train_work_alloc(struct kvcap_train_work *w, int m, int h, size_t cols);
void kvcap_train_work_free(struct kvcap_train_work *w); /* NULL-safe, leaves w zeroed */

/* Loss of `net` on the n_cols columns of x (m x n_cols, ld ldx; n_cols <= w->cols), with its
 * gradient written to grad[net->n_params] (laid out like theta) unless grad is NULL:
 *   mean((Y − X)²) [+ λ_bce·mean_j H(mask_j) + λ_r·(mean_j mask_j − ratio)² when relaxed].
 * Float sgemm with double sums; the hot path of training. */
double kvcap_train_loss_grad(const struct kvcap_train_net *net, const float *x, size_t ldx,
                             size_t n_cols, struct kvcap_train_work *w, float *grad);

/* The same loss and gradient computed column by column in double from the formulas: the
 * oracle for kvcap_train_loss_grad and for finite differences. grad may be NULL. Returns NaN
 * if its scratch cannot be allocated (tests only). */
double kvcap_train_loss_grad_ref(const struct kvcap_train_net *net, const float *x, size_t ldx,
                                 size_t n_cols, float *grad);

#endif
