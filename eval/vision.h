/* vision.h — image spans for the evaluation: patch features of real photos (a ViT encoder's
 * final layer-norm output on square crops, written by scripts/vision_features.py; format in
 * formats/SPEC.md) and a closed-form projector into a language model's token-embedding space.
 *
 * The projector is not a trained connector: it maps the features' principal directions onto
 * the embedding table's, in order of variance, with the variances matched
 *     e = μ_e + Σ_i (τ_i / σ_i) w_i v_iᵀ (f − μ_f)
 * (v_i, σ_i²: the features' covariance eigenpairs; w_i, τ_i²: the table's), so projected patches
 * look, to the model, like embeddings of the right scale and spread whose spatial structure is
 * the image's. It gives a language model image spans with an image's statistics along the token
 * axis (what KV compression of vision tokens depends on), not an understanding of the image. */
#ifndef KVCAP_VISION_H
#define KVCAP_VISION_H

#include <stdint.h>

#include "kvcap.h"

struct kvst_file;

struct kvvision_features {
    struct kvst_file *file;
    int n_crops, grid, n_tokens, dim; /* n_tokens = grid * grid, token order row-major */
    const uint16_t *features;         /* [n_crops][n_tokens][dim] F16 */
    const int32_t *photo;             /* [n_crops]: index of the source photo */
    int n_photos;                     /* 1 + the largest index */
    const uint8_t *thumbs;            /* [n_crops][thumb_size][thumb_size][3] RGB, or NULL */
    int thumb_size;                   /* thumbnail side in pixels, 0 without */
};

/* Opens a feature file; errors name the file and the tensor at fault. */
enum kvcap_status kvvision_open(const char *path, struct kvvision_features *out);
void kvvision_close(struct kvvision_features *f); /* NULL-safe, idempotent */

/* Crop c's features as f32, [n_tokens][dim]. */
void kvvision_crop(const struct kvvision_features *f, int crop, float *out);

/* Whether photo p is held out for evaluation: every fourth one (p % 4 == 3), so calibration
 * and evaluation never share a photo (never split by crop). */
int kvvision_photo_heldout(int photo);

/* Whether crop c is a held-out photo's. */
int kvvision_heldout(const struct kvvision_features *f, int crop);

struct kvvision_projector {
    int dim, n_embd;
    float *mu_f; /* [dim] */
    float *mu_e; /* [n_embd] */
    float *a;    /* [n_embd][dim] */
};

/* Fits the projector from the features of the crops with heldout(crop) == 0 and the table
 * [n_vocab][n_embd] (see above). Deterministic: eigenvector signs are fixed by their largest
 * component. */
enum kvcap_status kvvision_projector_fit(const struct kvvision_features *f, const float *table,
                                         int n_vocab, int n_embd, struct kvvision_projector *out);
void kvvision_projector_free(struct kvvision_projector *p); /* NULL-safe */

/* The embeddings of crop c, [n_tokens][n_embd]. */
enum kvcap_status kvvision_embed(const struct kvvision_features *f,
                                 const struct kvvision_projector *p, int crop, float *out);

#endif
