/* vision.c — photo features and the closed-form projector (see vision.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <cjson/cJSON.h>
#include <lapacke.h>

#include "common/internal.h"
#include "formats/safetensors.h"
#include "engine/vision.h"

static const char *const k_split_names[KVVISION_N_SPLITS] = {"calibration", "development",
                                                              "test"};

const char *kvvision_split_name(enum kvvision_split s)
{
    return (unsigned)s < KVVISION_N_SPLITS ? k_split_names[s] : "unknown";
}

int kvvision_split_parse(const char *name, enum kvvision_split *out)
{
    for (int i = 0; name && i < KVVISION_N_SPLITS; i++)
        if (!strcmp(name, k_split_names[i])) {
            *out = (enum kvvision_split)i;
            return 0;
        }
    if (name && !strcmp(name, "heldout")) {
        *out = KVVISION_DEVELOPMENT;
        return 0;
    }
    return -1;
}

void kvvision_close(struct kvvision_features *f)
{
    if (!f)
        return;
    kvst_close(f->file);
    free(f->split);
    memset(f, 0, sizeof *f);
}

/* The tensor `name` of f with dtype `dt` and ndim dimensions, or a format error naming both. */
static enum kvcap_status tensor(const struct kvst_file *f, const char *name, enum kvcap_dtype dt,
                                int ndim, const struct kvst_tensor **out)
{
    const struct kvst_tensor *t = kvst_find(f, name);
    KVCAP_RETURN_IF(!t, KVCAP_ERR_FORMAT, "%s: missing tensor '%s' (not a feature file of "
                    "scripts/vision_features.py?)", kvst_path(f), name);
    KVCAP_RETURN_IF(t->dtype != dt || t->ndim != ndim, KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': %s with %d dimensions, expected %s with %d", kvst_path(f),
                    name, kvcap_dtype_name(t->dtype), t->ndim, kvcap_dtype_name(dt), ndim);
    *out = t;
    return KVCAP_OK;
}

/* f->split from the metadata key vision.splits, a JSON list of split names parallel to
 * vision.photos; without the key (a file from before the test split) by the rule such files
 * were always read with: every fourth photo development, the others calibration. */
static enum kvcap_status read_splits(struct kvvision_features *f)
{
    const char *path = kvst_path(f->file), *text = kvst_meta(f->file, "vision.splits");
    cJSON *list = text ? cJSON_Parse(text) : NULL;
    const int n = text && cJSON_IsArray(list) ? cJSON_GetArraySize(list) : 0;
    enum kvcap_status s = KVCAP_OK;
    if (text && !cJSON_IsArray(list))
        s = kvcap_fail(KVCAP_ERR_FORMAT, "%s: metadata 'vision.splits' is not a JSON list",
                       path);
    else if (text && n < f->n_photos)
        s = kvcap_fail(KVCAP_ERR_FORMAT, "%s: metadata 'vision.splits' names %d photos' splits, "
                       "but tensor 'photo' refers to photo %d", path, n, f->n_photos - 1);
    if (s == KVCAP_OK && text && kvst_meta(f->file, "vision.photos")) {
        cJSON *ids = cJSON_Parse(kvst_meta(f->file, "vision.photos"));
        if (!cJSON_IsArray(ids) || cJSON_GetArraySize(ids) != n)
            s = kvcap_fail(KVCAP_ERR_FORMAT, "%s: metadata 'vision.splits' has %d entries, "
                           "'vision.photos' %d", path, n,
                           cJSON_IsArray(ids) ? cJSON_GetArraySize(ids) : -1);
        cJSON_Delete(ids);
    }
    const int size = n > f->n_photos ? n : f->n_photos;
    if (s == KVCAP_OK && !(f->split = malloc((size_t)(size > 0 ? size : 1))))
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: no memory for %d photos' splits", path, size);
    f->splits_recorded = text != NULL;
    const cJSON *e = text ? list->child : NULL; /* entry p, walked (an index lookup walks too) */
    for (int p = 0; s == KVCAP_OK && p < size; p++, e = e ? e->next : NULL) {
        enum kvvision_split sp = p % 4 == 3 ? KVVISION_DEVELOPMENT : KVVISION_CALIBRATION;
        if (text) {
            const char *name = cJSON_GetStringValue(e);
            /* the file names splits canonically; "heldout" is only a command-line synonym */
            if (!name || !strcmp(name, "heldout") || kvvision_split_parse(name, &sp) != 0)
                s = kvcap_fail(KVCAP_ERR_FORMAT, "%s: metadata 'vision.splits': entry %d is not "
                               "\"calibration\", \"development\" or \"test\"", path, p);
        }
        if (s == KVCAP_OK)
            f->split[p] = (uint8_t)sp;
    }
    cJSON_Delete(list);
    return s;
}

static enum kvcap_status open_checked(struct kvvision_features *f)
{
    const struct kvst_tensor *ft, *pt, *tt;
    const char *path = kvst_path(f->file);
    KVCAP_TRY(tensor(f->file, "features", KVCAP_DTYPE_F16, 3, &ft));
    KVCAP_TRY(tensor(f->file, "photo", KVCAP_DTYPE_I32, 1, &pt));
    KVCAP_RETURN_IF(ft->shape[0] < 1 || ft->shape[0] > (1 << 20) || ft->shape[2] < 1 ||
                        ft->shape[2] > 4096,
                    KVCAP_ERR_FORMAT, "%s: tensor 'features': shape [%lld, %lld, %lld] out of "
                    "range", path, (long long)ft->shape[0], (long long)ft->shape[1],
                    (long long)ft->shape[2]);
    f->n_crops = (int)ft->shape[0];
    f->n_tokens = (int)ft->shape[1];
    f->dim = (int)ft->shape[2];
    f->grid = (int)lround(sqrt((double)f->n_tokens));
    KVCAP_RETURN_IF(f->grid < 1 || f->grid > 128 || f->grid * f->grid != f->n_tokens,
                    KVCAP_ERR_FORMAT, "%s: tensor 'features': %d tokens per crop is not a "
                    "square grid of at most 128 x 128", path, f->n_tokens);
    KVCAP_RETURN_IF(pt->shape[0] != f->n_crops, KVCAP_ERR_FORMAT,
                    "%s: tensor 'photo': %lld entries for %d crops", path,
                    (long long)pt->shape[0], f->n_crops);
    f->features = ft->data;
    f->photo = pt->data;
    for (int c = 0; c < f->n_crops; c++) {
        KVCAP_RETURN_IF(f->photo[c] < 0 || f->photo[c] >= (1 << 20), KVCAP_ERR_FORMAT,
                        "%s: tensor 'photo': entry %d is %d", path, c, (int)f->photo[c]);
        f->n_photos = f->photo[c] + 1 > f->n_photos ? f->photo[c] + 1 : f->n_photos;
    }
    KVCAP_TRY(read_splits(f));
    if (kvst_find(f->file, "thumb")) {
        KVCAP_TRY(tensor(f->file, "thumb", KVCAP_DTYPE_U8, 4, &tt));
        KVCAP_RETURN_IF(tt->shape[0] != f->n_crops || tt->shape[1] != tt->shape[2] ||
                            tt->shape[3] != 3 || tt->shape[1] < 1 || tt->shape[1] > 512,
                        KVCAP_ERR_FORMAT, "%s: tensor 'thumb': expected [%d, S, S, 3]", path,
                        f->n_crops);
        f->thumb_size = (int)tt->shape[1];
        f->thumbs = tt->data;
    }
    /* poison never reaches the model: every feature must be finite */
    const size_t n = (size_t)f->n_crops * f->n_tokens * f->dim;
    for (size_t i = 0; i < n; i++)
        KVCAP_RETURN_IF((f->features[i] & 0x7c00) == 0x7c00, KVCAP_ERR_NUMERIC,
                        "%s: tensor 'features': non-finite value at crop %d, token %d, channel "
                        "%d", path, (int)(i / ((size_t)f->n_tokens * f->dim)),
                        (int)(i / f->dim % f->n_tokens), (int)(i % f->dim));
    return KVCAP_OK;
}

enum kvcap_status kvvision_open(const char *path, struct kvvision_features *out)
{
    KVCAP_RETURN_IF(!path || !out, KVCAP_ERR_INVALID_ARGUMENT, "kvvision_open: NULL argument");
    memset(out, 0, sizeof *out);
    KVCAP_TRY(kvst_open(path, &out->file));
    enum kvcap_status s = open_checked(out);
    if (s != KVCAP_OK)
        kvvision_close(out);
    return s;
}

void kvvision_crop(const struct kvvision_features *f, int crop, float *out)
{
    const size_t n = (size_t)f->n_tokens * f->dim;
    kvcap_convert_to_f32(KVCAP_DTYPE_F16, f->features + (size_t)crop * n, n, out);
}

enum kvvision_split kvvision_photo_split(const struct kvvision_features *f, int photo)
{
    return (enum kvvision_split)f->split[photo];
}

enum kvvision_split kvvision_crop_split(const struct kvvision_features *f, int crop)
{
    return kvvision_photo_split(f, f->photo[crop]);
}

int kvvision_heldout(const struct kvvision_features *f, int crop)
{
    return kvvision_crop_split(f, crop) != KVVISION_CALIBRATION;
}

/* ---- Projector ----------------------------------------------------------------------------- */

/* Covariance eigenpairs of the rows seen by the accumulator, in descending order of variance. */
struct moments {
    int dim;
    double n;
    double *sum;  /* [dim] */
    double *gram; /* [dim][dim], upper triangle */
    double *buf;  /* [rows][dim] conversion block */
    int rows;
};

static enum kvcap_status moments_init(struct moments *m, int dim, int rows)
{
    memset(m, 0, sizeof *m);
    m->dim = dim, m->rows = rows;
    m->sum = calloc((size_t)dim, sizeof *m->sum);
    m->gram = calloc((size_t)dim * dim, sizeof *m->gram);
    m->buf = malloc(sizeof *m->buf * (size_t)rows * dim);
    KVCAP_RETURN_IF(!m->sum || !m->gram || !m->buf, KVCAP_ERR_OUT_OF_MEMORY,
                    "projector: no memory for %d x %d moments", dim, dim);
    return KVCAP_OK;
}

static void moments_free(struct moments *m)
{
    free(m->sum), free(m->gram), free(m->buf);
}

/* Adds n rows (n <= m->rows) of x [n][dim] f32. */
static void moments_add(struct moments *m, const float *x, int n)
{
    const size_t k = (size_t)n * m->dim;
    for (size_t i = 0; i < k; i++) {
        m->buf[i] = x[i];
        m->sum[i % m->dim] += x[i];
    }
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, m->dim, n, 1.0, m->buf, m->dim, 1.0,
                m->gram, m->dim);
    m->n += n;
}

/* mean[dim]; vec [dim][dim] with eigenvector i in column i, sd[i] its standard deviation,
 * descending. */
static enum kvcap_status moments_eigen(struct moments *m, const char *what, float *mean,
                                       double *vec, double *sd)
{
    const int D = m->dim;
    KVCAP_RETURN_IF(m->n < 2, KVCAP_ERR_INVALID_ARGUMENT, "projector: no %s rows to fit on",
                    what);
    for (int i = 0; i < D; i++)
        mean[i] = (float)(m->sum[i] / m->n);
    for (int i = 0; i < D; i++)
        for (int j = i; j < D; j++)
            vec[(size_t)i * D + j] = (m->gram[(size_t)i * D + j] -
                                      m->sum[i] * m->sum[j] / m->n) / m->n;
    double *w = malloc(sizeof *w * (size_t)D);
    KVCAP_RETURN_IF(!w, KVCAP_ERR_OUT_OF_MEMORY, "projector: no memory");
    lapack_int info = LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'U', D, vec, D, w);
    if (info != 0) {
        free(w);
        return kvcap_fail(KVCAP_ERR_NUMERIC, "projector: the %s covariance's eigen-decomposition "
                          "failed (LAPACK info %d)", what, (int)info);
    }
    /* ascending from LAPACK: reverse the columns; fix each sign by its largest component */
    for (int i = 0; i < D / 2; i++)
        for (int r = 0; r < D; r++) {
            double t = vec[(size_t)r * D + i];
            vec[(size_t)r * D + i] = vec[(size_t)r * D + (D - 1 - i)];
            vec[(size_t)r * D + (D - 1 - i)] = t;
        }
    for (int i = 0; i < D; i++) {
        sd[i] = sqrt(fmax(w[D - 1 - i], 0.0));
        int big = 0;
        for (int r = 1; r < D; r++)
            if (fabs(vec[(size_t)r * D + i]) > fabs(vec[(size_t)big * D + i]))
                big = r;
        if (vec[(size_t)big * D + i] < 0)
            for (int r = 0; r < D; r++)
                vec[(size_t)r * D + i] = -vec[(size_t)r * D + i];
    }
    free(w);
    return KVCAP_OK;
}

void kvvision_projector_free(struct kvvision_projector *p)
{
    if (!p)
        return;
    free(p->mu_f), free(p->mu_e), free(p->a);
    memset(p, 0, sizeof *p);
}

enum kvcap_status kvvision_projector_fit(const struct kvvision_features *f, const float *table,
                                         int n_vocab, int n_embd, struct kvvision_projector *out)
{
    KVCAP_RETURN_IF(!f || !table || !out || n_vocab < 2 || n_embd < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "projector: bad argument");
    memset(out, 0, sizeof *out);
    const int D = f->dim, E = n_embd, K = D < E ? D : E;
    enum { TABLE_BLOCK = 2048 };
    struct moments mf, me;
    float *crop = malloc(sizeof *crop * (size_t)f->n_tokens * D);
    double *vf = malloc(sizeof *vf * (size_t)D * D), *sf = malloc(sizeof *sf * (size_t)D);
    double *ve = malloc(sizeof *ve * (size_t)E * E), *se = malloc(sizeof *se * (size_t)E);
    out->dim = D, out->n_embd = E;
    out->mu_f = malloc(sizeof *out->mu_f * (size_t)D);
    out->mu_e = malloc(sizeof *out->mu_e * (size_t)E);
    out->a = calloc((size_t)E * D, sizeof *out->a);
    enum kvcap_status s = moments_init(&mf, D, f->n_tokens);
    if (s == KVCAP_OK)
        s = moments_init(&me, E, TABLE_BLOCK);
    else
        memset(&me, 0, sizeof me);
    if (s == KVCAP_OK && (!crop || !vf || !sf || !ve || !se || !out->mu_f || !out->mu_e || !out->a))
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "projector: no memory");
    /* the calibration photos only: development and test photos never shape the projector */
    for (int c = 0; s == KVCAP_OK && c < f->n_crops; c++)
        if (kvvision_crop_split(f, c) == KVVISION_CALIBRATION) {
            kvvision_crop(f, c, crop);
            moments_add(&mf, crop, f->n_tokens);
        }
    if (s == KVCAP_OK && mf.n == 0)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "%s: no crop of a calibration photo to fit the "
                       "projector on", kvst_path(f->file));
    for (int r = 0; s == KVCAP_OK && r < n_vocab; r += TABLE_BLOCK)
        moments_add(&me, table + (size_t)r * E, n_vocab - r < TABLE_BLOCK ? n_vocab - r : TABLE_BLOCK);
    if (s == KVCAP_OK)
        s = moments_eigen(&mf, "feature", out->mu_f, vf, sf);
    /* Features that do not vary (an all-zero file, say) carry no image: every crop would get
     * the same embedding and the image track would measure nothing. Refused, not warned of:
     * a report from them would look like a result. sf[0] is the largest standard deviation. */
    double mu_norm = 0;
    for (int j = 0; s == KVCAP_OK && j < D; j++)
        mu_norm += (double)out->mu_f[j] * out->mu_f[j];
    if (s == KVCAP_OK && !(sf[0] > 1e-6 * (1.0 + sqrt(mu_norm))))
        s = kvcap_fail(KVCAP_ERR_NUMERIC,
                       "%s: tensor 'features': the calibration crops' features do not vary "
                       "(largest standard deviation %g): they carry no image; remake the file "
                       "with scripts/vision_features.py",
                       kvst_path(f->file), sf[0]);
    if (s == KVCAP_OK)
        s = moments_eigen(&me, "embedding", out->mu_e, ve, se);
    /* a = Σ_i (τ_i / σ_i) w_i v_iᵀ over the directions the features vary along */
    for (int i = 0; s == KVCAP_OK && i < K; i++) {
        if (!(sf[i] > 1e-6 * sf[0]))
            break;
        const double g = se[i] / sf[i];
        for (int e = 0; e < E; e++) {
            const double we = g * ve[(size_t)e * E + i];
            float *row = out->a + (size_t)e * D;
            for (int j = 0; j < D; j++)
                row[j] += (float)(we * vf[(size_t)j * D + i]);
        }
    }
    moments_free(&mf), moments_free(&me);
    free(crop), free(vf), free(sf), free(ve), free(se);
    if (s != KVCAP_OK)
        kvvision_projector_free(out);
    return s;
}

enum kvcap_status kvvision_embed(const struct kvvision_features *f,
                                 const struct kvvision_projector *p, int crop, float *out)
{
    KVCAP_RETURN_IF(!f || !p || !out || crop < 0 || crop >= f->n_crops || p->dim != f->dim,
                    KVCAP_ERR_INVALID_ARGUMENT, "kvvision_embed: bad argument (crop %d of %d)",
                    crop, f ? f->n_crops : 0);
    const int T = f->n_tokens, D = f->dim, E = p->n_embd;
    float *x = malloc(sizeof *x * (size_t)T * D);
    KVCAP_RETURN_IF(!x, KVCAP_ERR_OUT_OF_MEMORY, "kvvision_embed: no memory");
    kvvision_crop(f, crop, x);
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < D; j++)
            x[(size_t)t * D + j] -= p->mu_f[j];
        memcpy(out + (size_t)t * E, p->mu_e, sizeof *out * (size_t)E);
    }
    /* out[T][E] += x[T][D] · aᵀ */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, E, D, 1.0f, x, D, p->a, D, 1.0f, out,
                E);
    free(x);
    return KVCAP_OK;
}
