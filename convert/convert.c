/* convert.c — kvcap_convert(): merge calibration states, pick bases and key maps for the
 * artifact's schedule, store them in the chosen precision and write the artifact. */
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "runtime/artifact.h"
#include "convert/convert.h"
#include "common/internal.h"
#include "calibrate/state.h"

void kvcap_convert_default_options(struct kvcap_convert_options *o)
{
    memset(o, 0, sizeof *o);
    o->storage = KVCAP_DTYPE_F16;
    o->fallback = KVCAP_POLICY_FLASHCACHE;
}

static double mean(const double *r, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += r[i];
    return s / n;
}

#define DCT_PI 3.14159265358979323846

/* The orthonormal 2-D DCT-II basis of an R x C grid of points (row-major), [R*C][R*C], lowest
 * frequencies first (by (u/R)^2 + (v/C)^2, then u): a value basis that needs no calibration.
 * The constant vector (u = v = 0) leads a tile's basis, since the mean μ stored apart is the
 * span's, not the tile's: on kvcap-eval's photos a 4 x 4 tile's own mean carries 46 % of its
 * centred values' variance. On a dense grid μ is the grid's mean, the centred values have no
 * constant part, and the constant vector comes last (`constant_last`). */
/* A frequency (u, v) = (k / C, k % C) of an R x C grid, with its rank key: (u/R)^2 + (v/C)^2,
 * the constant first or last. */
struct dct_freq {
    double key;
    int k;
};

static int dct_freq_cmp(const void *a, const void *b)
{
    const struct dct_freq *x = a, *y = b;
    return x->key < y->key ? -1 : x->key > y->key ? 1 : (x->k > y->k) - (x->k < y->k);
}

static float *dct_basis(int R, int C, int constant_last)
{
    const int m = R * C;
    float *b = malloc(sizeof *b * (size_t)m * m);
    struct dct_freq *order = malloc(sizeof *order * (size_t)m);
    if (!b || !order) {
        free(b), free(order);
        return NULL;
    }
    for (int k = 0; k < m; k++) {
        const double u = (double)(k / C) / R, v = (double)(k % C) / C;
        order[k] = (struct dct_freq){k == 0 && constant_last ? INFINITY : u * u + v * v, k};
    }
    qsort(order, (size_t)m, sizeof *order, dct_freq_cmp);
    for (int i = 0; i < m; i++) {
        const int u = order[i].k / C, v = order[i].k % C;
        const double cu = sqrt((u ? 2.0 : 1.0) / R), cv = sqrt((v ? 2.0 : 1.0) / C);
        for (int x = 0; x < R; x++)
            for (int y = 0; y < C; y++)
                b[(size_t)i * m + (size_t)x * C + y] =
                    (float)(cu * cv * cos(DCT_PI * (2 * x + 1) * u / (2.0 * R)) *
                            cos(DCT_PI * (2 * y + 1) * v / (2.0 * C)));
    }
    free(order);
    return b;
}

/* The share of the variance in the Gram G ([m][m], a sum of centred value columns) that the
 * first rv rows of `basis` (orthonormal, [.][m]) keep: Σ_r b_rᵀ G b_r / tr G; -1 when G is
 * empty. */
static double basis_share(const double *G, int m, const float *basis, int rv)
{
    double trace = 0, kept = 0;
    for (int a = 0; a < m; a++)
        trace += G[(size_t)a * m + a];
    if (!(trace > 0))
        return -1;
    for (int r = 0; r < rv; r++) {
        const float *b = basis + (size_t)r * m;
        for (int a = 0; a < m; a++) {
            double row = 0;
            for (int c = 0; c < m; c++)
                row += G[(size_t)a * m + c] * b[c];
            kept += b[a] * row;
        }
    }
    return kept / trace;
}

/* What each bucket's value basis (units: the artifact's, [layers][kv_heads][buckets]) keeps of
 * the calibration values, next to chance, into report (NaN for a bucket without data). */
static void measure_value_bases(const struct kvcap_calib_state *s,
                                const struct kvcap_unit_maps *units,
                                struct kvcap_convert_report *report)
{
    const size_t n = (size_t)s->model.n_layers * s->model.n_kv_heads * s->n_buckets;
    int counted[KVCAP_MAX_BUCKETS] = {0};
    report->n_buckets = s->n_buckets;
    memcpy(report->buckets, s->buckets, sizeof s->buckets);
    for (size_t i = 0; i < n; i++) {
        const int b = (int)(i % s->n_buckets);
        const double kept = basis_share(s->units[i].v_gram, units[i].m, units[i].u, units[i].rv);
        if (kept < 0)
            continue;
        report->value_kept[b] += kept;
        report->value_chance[b] += (double)units[i].rv / units[i].m;
        counted[b]++;
    }
    for (int b = 0; b < s->n_buckets; b++)
        if (counted[b]) {
            report->value_kept[b] /= counted[b];
            report->value_chance[b] /= counted[b];
        } else {
            report->value_kept[b] = report->value_chance[b] = NAN;
        }
}

/* The state's fitted maps as the artifact writer's units (views, nothing copied): the value
 * basis is the first R_v eigenvectors, which are the first rows of v_eigvec (or, with
 * dct_values, the first R_v rows of the grid's DCT basis). Measures what the value bases keep
 * into report. */
static enum kvcap_status write_artifact(struct kvcap_calib_state *s,
                                        const struct kvcap_convert_options *o,
                                        enum kvcap_dtype storage, const char *path,
                                        struct kvcap_convert_report *report)
{
    size_t n = (size_t)s->model.n_layers * s->model.n_kv_heads * s->n_buckets;
    struct kvcap_unit_maps *units = calloc(n, sizeof *units);
    cJSON *prov = cJSON_CreateObject();
    if (!units || !prov) {
        free(units);
        cJSON_Delete(prov);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "convert: out of memory");
    }
    float *dct[KVCAP_MAX_BUCKETS] = {NULL};
    enum kvcap_status st = KVCAP_OK;
    for (int b = 0; o->dct_values && st == KVCAP_OK && b < s->n_buckets; b++) {
        const struct kvcap_bucket *bk = &s->buckets[b];
        const int tiled = bk->structure == KVCAP_STRUCTURE_TILED;
        if (!(dct[b] = tiled ? dct_basis(bk->tile_rows, bk->tile_cols, 0)
                             : dct_basis(bk->rows, bk->cols, 1)))
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "convert: out of memory for a DCT basis");
    }
    for (size_t i = 0; i < n; i++) {
        struct kvcap_calib_unit *u = &s->units[i];
        struct kvcap_key_maps *k = &u->keys;
        int l = (int)(i / ((size_t)s->model.n_kv_heads * s->n_buckets));
        units[i] = (struct kvcap_unit_maps){u->m, k->rk, k->h, kvcap_retained(s->r_values[l], u->m),
                                            k->gelu, k->mask, k->w1, k->b1, k->w2, k->b2,
                                            o->dct_values ? dct[i % s->n_buckets] : u->v_eigvec};
    }
    if (st == KVCAP_OK)
        measure_value_bases(s, units, report);
    char tool[48];
    snprintf(tool, sizeof tool, "kvcap-convert %s", kvcap_version());
    cJSON_AddStringToObject(prov, "tool", tool);
    cJSON_AddStringToObject(prov, "value_basis", o->dct_values ? "dct" : "calibrated");
    /* how the key maps were made: what an evaluation labels a KVCapsule row with */
    cJSON_AddStringToObject(prov, "key_maps",
                            s->key_method == KVCAP_KEY_METHOD_TRAINED ? "trained" : "closed_form");
    cJSON *from = cJSON_AddArrayToObject(prov, "states");
    for (int i = 0; i < o->n_states; i++)
        cJSON_AddItemToArray(from, cJSON_CreateString(o->states[i]));
    int64_t spans[KVCAP_MAX_BUCKETS][2];
    for (int b = 0; b < s->n_buckets; b++) {
        spans[b][0] = s->train_spans[b];
        spans[b][1] = s->val_spans[b];
    }
    struct kvcap_artifact_desc desc = {s->model, s->n_buckets, s->buckets, storage,
                                       s->activation == KVCAP_ACTIVATION_GELU, o->fallback,
                                       s->r_keys, s->r_values, (const int64_t(*)[2])spans, prov};
    if (st == KVCAP_OK)
        st = kvcap_artifact_write(path, &desc, units);
    cJSON_Delete(prov);
    free(units);
    for (int b = 0; b < s->n_buckets; b++)
        free(dct[b]);
    return st;
}

enum kvcap_status kvcap_convert(const struct kvcap_convert_options *o,
                                struct kvcap_convert_report *report)
{
    KVCAP_RETURN_IF(!o || !report || !o->out || o->n_states < 1 || !o->states,
                    KVCAP_ERR_INVALID_ARGUMENT, "convert: states and an output path are required");
    KVCAP_RETURN_IF(o->storage_set && o->storage != KVCAP_DTYPE_F32 &&
                        o->storage != KVCAP_DTYPE_F16 && o->storage != KVCAP_DTYPE_BF16,
                    KVCAP_ERR_INVALID_ARGUMENT, "convert: storage %s is not f32, f16 or bf16",
                    kvcap_dtype_name(o->storage));
    KVCAP_RETURN_IF(o->fallback == KVCAP_POLICY_KVCAPSULE, KVCAP_ERR_INVALID_ARGUMENT,
                    "convert: the fallback policy cannot be kvcapsule");
    memset(report, 0, sizeof *report);
    struct kvcap_calib_state s;
    KVCAP_TRY(kvcap_calib_state_read(o->states[0], &s));
    enum kvcap_status st = KVCAP_OK;
    int merged = 0;
    for (int i = 1; st == KVCAP_OK && i < o->n_states; i++) {
        struct kvcap_calib_state other;
        st = kvcap_calib_state_read(o->states[i], &other);
        if (st == KVCAP_OK)
            st = kvcap_calib_state_merge(&s, &other, o->states[i]);
        kvcap_calib_state_free(&other);
        merged = 1;
    }
    int L = s.model.n_layers;
    int was_trained = s.key_method == KVCAP_KEY_METHOD_TRAINED;
    int keys_changed = 0;
    if (st == KVCAP_OK && o->keys_set) {
        double *r = malloc(sizeof(double) * (size_t)L);
        st = r ? kvcap_schedule_expand(&o->keys, L, r)
               : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "convert: out of memory");
        /* The state's ratios went through its JSON header, which keeps 15 significant digits:
         * a schedule is the same one when every layer agrees to well within that. */
        if (st == KVCAP_OK)
            for (int l = 0; l < L; l++)
                keys_changed |= fabs(r[l] - s.r_keys[l]) > 1e-12;
        if (st == KVCAP_OK && keys_changed)
            memcpy(s.r_keys, r, sizeof(double) * (size_t)L);
        free(r);
    }
    if (st == KVCAP_OK && o->values_set)
        st = kvcap_schedule_expand(&o->values, L, s.r_values);
    if (st == KVCAP_OK)
        st = kvcap_calib_state_check_ratios(&s);
    /* Trained maps are kept only when they fit the artifact's key schedule unchanged;
     * otherwise every unit is refitted in closed form so the artifact has one activation. */
    if (st == KVCAP_OK && keys_changed) {
        report->trained_discarded = was_trained;
        s.key_method = KVCAP_KEY_METHOD_CLOSED_FORM;
        s.activation = KVCAP_ACTIVATION_LINEAR;
    }
    report->trained_discarded |= merged && was_trained;
    report->keys_refit = merged || keys_changed;
    if (st == KVCAP_OK)
        st = kvcap_calib_state_fit(&s, report->keys_refit, KVCAP_CALIB_DEVICE_CPU, NULL, NULL,
                                   NULL);
    if (st == KVCAP_OK && report->trained_discarded)
        kvcap_log(KVCAP_LOG_WARN,
                  "trained key maps were replaced by closed-form ones (%s); recalibrate with the "
                  "new schedule to train them",
                  merged ? "states were merged" : "the key schedule changed");
    enum kvcap_dtype storage = o->storage_set ? o->storage : s.storage;
    if (st == KVCAP_OK)
        st = write_artifact(&s, o, storage, o->out, report);
    if (st == KVCAP_OK) { /* read back: what we wrote must pass the reader's checks */
        struct kvst_file *f = NULL;
        struct kvcap_file_info info;
        st = kvst_open(o->out, &f);
        if (st == KVCAP_OK) {
            st = kvcap_schema_check(f, KVCAP_KIND_ARTIFACT, &info);
            report->artifact_bytes = kvst_file_size(f);
            kvcap_file_info_free(&info);
        }
        kvst_close(f);
        if (st != KVCAP_OK)
            remove(o->out);
    }
    for (int b = 0; st == KVCAP_OK && b < report->n_buckets; b++) {
        const double kept = report->value_kept[b], chance = report->value_chance[b];
        if (chance < 1 && (kept - chance) / (1 - chance) < KVCAP_VALUE_STRUCTURE_WARN)
            kvcap_log(KVCAP_LOG_WARN,
                      "bucket %d (%dx%d): the value basis keeps %.0f %% of the calibration "
                      "values' variance at these ranks, random directions %.0f %%: these spans "
                      "hold little for it, and KVCapsule may keep the model further from full "
                      "than evicting tokens (kvcap-eval compares them)",
                      b, report->buckets[b].rows, report->buckets[b].cols, 100 * kept,
                      100 * chance);
    }
    report->mean_r_keys = mean(s.r_keys, L);
    report->mean_r_values = mean(s.r_values, L);
    kvcap_calib_state_free(&s);
    return st;
}
