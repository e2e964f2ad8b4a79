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

/* The photo splits, by photo, never by crop: calibration photos fit the projector and the
 * compressors; development photos are those designs were chosen on (called held-out before);
 * test photos are looked at once a design is frozen. */
enum kvvision_split { KVVISION_CALIBRATION, KVVISION_DEVELOPMENT, KVVISION_TEST };
enum { KVVISION_N_SPLITS = 3 };

/* "calibration", "development" or "test" (the names vision.splits and kvcap-eval use). */
const char *kvvision_split_name(enum kvvision_split s);
/* The split named `name`, also "heldout", the former name of development; 0 on success, -1
 * for any other name. */
int kvvision_split_parse(const char *name, enum kvvision_split *out);

struct kvvision_features {
    struct kvst_file *file;
    int n_crops, grid, n_tokens, dim; /* n_tokens = grid * grid, token order row-major */
    const uint16_t *features;         /* [n_crops][n_tokens][dim] F16 */
    const int32_t *photo;             /* [n_crops]: index of the source photo */
    int n_photos;                     /* 1 + the largest index */
    const uint8_t *thumbs;            /* [n_crops][thumb_size][thumb_size][3] RGB, or NULL */
    int thumb_size;                   /* thumbnail side in pixels, 0 without */
    uint8_t *split;                   /* [n_photos] enum kvvision_split per photo; owned */
    int splits_recorded;              /* 1: read from vision.splits; 0: a file written before
                                       * the test split, split by photo index (below) */
};

/* Opens a feature file; errors name the file and the tensor or metadata key at fault. Each
 * photo's split comes from the metadata key vision.splits (formats/SPEC.md section 7); a file
 * without it (written before the test split) is read as it always was: every fourth photo
 * (index % 4 == 3) development, the others calibration, none test. */
enum kvcap_status kvvision_open(const char *path, struct kvvision_features *out);
void kvvision_close(struct kvvision_features *f); /* NULL-safe, idempotent */

/* Crop c's features as f32, [n_tokens][dim]. */
void kvvision_crop(const struct kvvision_features *f, int crop, float *out);

/* The split of photo p (0 <= p < n_photos) and of crop c's photo. */
enum kvvision_split kvvision_photo_split(const struct kvvision_features *f, int photo);
enum kvvision_split kvvision_crop_split(const struct kvvision_features *f, int crop);

/* Whether crop c's photo is held out from calibration (development or test). */
int kvvision_heldout(const struct kvvision_features *f, int crop);

struct kvvision_projector {
    int dim, n_embd;
    float *mu_f; /* [dim] */
    float *mu_e; /* [n_embd] */
    float *a;    /* [n_embd][dim] */
};

/* Fits the projector from the features of the calibration photos' crops and the table
 * [n_vocab][n_embd] (see above). Deterministic: eigenvector signs are fixed by their largest
 * component. */
enum kvcap_status kvvision_projector_fit(const struct kvvision_features *f, const float *table,
                                         int n_vocab, int n_embd, struct kvvision_projector *out);
void kvvision_projector_free(struct kvvision_projector *p); /* NULL-safe */

/* The embeddings of crop c, [n_tokens][n_embd]. */
enum kvcap_status kvvision_embed(const struct kvvision_features *f,
                                 const struct kvvision_projector *p, int crop, float *out);

#endif
