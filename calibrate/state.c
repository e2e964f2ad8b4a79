/* state.c — calibration states: create, fit, merge, and their .kvcs file form. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/internal.h"
#include "calibrate/linalg.h"
#include "calibrate/state.h"

#define NAME_CAP 96

static const char *const metric_names[KVCAP_METRIC_COUNT] = {
    "v_explained", "v_cos", "v_rel", "k_cos", "k_rel", "attn_cos", "attn_rel"};

const char *kvcap_metric_name(enum kvcap_metric m)
{
    return (unsigned)m < KVCAP_METRIC_COUNT ? metric_names[m] : "?";
}

int kvcap_retained(double r, int m)
{
    int v = (int)lround(r * m);
    return v < 1 ? 1 : v > m ? m : v;
}

enum kvcap_status kvcap_calib_state_check_ratios(const struct kvcap_calib_state *s)
{
    for (int which = 0; which < 2; which++) {
        const double *r = which ? s->r_values : s->r_keys;
        for (int l = 0; l < s->model.n_layers; l++)
            for (int b = 0; b < s->n_buckets; b++) {
                const struct kvcap_bucket *bk = &s->buckets[b];
                int m = kvcap_bucket_points(bk);
                KVCAP_RETURN_IF(lround(r[l] * m) < 1, KVCAP_ERR_INVALID_ARGUMENT,
                                "%s: layer %d's ratio %g keeps none of the %d points of bucket "
                                "%d (%dx%d%s): round(%g x %d) = 0; the smallest ratio that "
                                "keeps one is %g",
                                which ? "values" : "keys", l, r[l], m, b, bk->rows, bk->cols,
                                bk->structure == KVCAP_STRUCTURE_TILED ? ", per tile" : "",
                                r[l], m, 0.5 / m);
            }
    }
    return KVCAP_OK;
}

static size_t unit_count(const struct kvcap_calib_state *s)
{
    return (size_t)s->model.n_layers * (size_t)s->model.n_kv_heads * (size_t)s->n_buckets;
}

static void unit_drop_fit(struct kvcap_calib_unit *u)
{
    free(u->v_eigval);
    free(u->v_eigvec);
    u->v_eigval = NULL;
    u->v_eigvec = NULL;
    kvcap_key_maps_free(&u->keys);
    u->has_keys = 0;
    for (int i = 0; i < KVCAP_METRIC_COUNT; i++)
        u->metrics[i] = NAN;
}

/* Allocates the state's arrays for its model and buckets (Grams zeroed). */
static enum kvcap_status state_alloc(struct kvcap_calib_state *s)
{
    size_t n = unit_count(s), L = (size_t)s->model.n_layers;
    s->units = calloc(n, sizeof *s->units);
    s->r_keys = calloc(L, sizeof *s->r_keys);
    s->r_values = calloc(L, sizeof *s->r_values);
    KVCAP_RETURN_IF(!s->units || !s->r_keys || !s->r_values, KVCAP_ERR_OUT_OF_MEMORY,
                    "calibration state: out of memory");
    for (size_t i = 0; i < n; i++) {
        struct kvcap_calib_unit *u = &s->units[i];
        int b = (int)(i % (size_t)s->n_buckets);
        u->m = kvcap_bucket_points(&s->buckets[b]);
        size_t mm = (size_t)u->m * (size_t)u->m;
        u->v_gram = calloc(mm, sizeof(double));
        u->k_gram = calloc(mm, sizeof(double));
        KVCAP_RETURN_IF(!u->v_gram || !u->k_gram, KVCAP_ERR_OUT_OF_MEMORY,
                        "calibration state: out of memory for %zu Grams of %dx%d", 2 * n, u->m,
                        u->m);
        unit_drop_fit(u);
    }
    return KVCAP_OK;
}

enum kvcap_status kvcap_calib_state_init(struct kvcap_calib_state *s,
                                         const struct kvcap_calib_config *cfg)
{
    memset(s, 0, sizeof *s);
    s->model = cfg->model;
    s->n_buckets = cfg->n_buckets;
    memcpy(s->buckets, cfg->buckets, sizeof cfg->buckets[0] * (size_t)cfg->n_buckets);
    s->key_method = cfg->keys.method;
    s->activation = cfg->keys.method == KVCAP_KEY_METHOD_TRAINED ? cfg->keys.activation
                                                                 : KVCAP_ACTIVATION_LINEAR;
    s->hidden = cfg->keys.hidden;
    s->ridge = cfg->keys.ridge;
    s->storage = cfg->storage;
    enum kvcap_status st = state_alloc(s);
    if (st == KVCAP_OK)
        st = kvcap_schedule_expand(&cfg->schedule_keys, s->model.n_layers, s->r_keys);
    if (st == KVCAP_OK)
        st = kvcap_schedule_expand(&cfg->schedule_values, s->model.n_layers, s->r_values);
    if (st == KVCAP_OK)
        st = kvcap_calib_state_check_ratios(s);
    if (st != KVCAP_OK)
        kvcap_calib_state_free(s);
    return st;
}

void kvcap_calib_state_free(struct kvcap_calib_state *s)
{
    if (!s)
        return;
    if (s->units)
        for (size_t i = 0; i < unit_count(s); i++) {
            unit_drop_fit(&s->units[i]);
            free(s->units[i].v_gram);
            free(s->units[i].k_gram);
        }
    free(s->units);
    free(s->r_keys);
    free(s->r_values);
    free(s->data_note);
    memset(s, 0, sizeof *s);
}

static int unit_key_size(const struct kvcap_calib_state *s, int l, int m, int *h)
{
    int rk = kvcap_retained(s->r_keys[l], m);
    *h = s->hidden > 0 && s->hidden < rk ? s->hidden : rk;
    return rk;
}

/* Layer, KV head and bucket of unit i. */
static void unit_position(const struct kvcap_calib_state *s, size_t i, int *l, int *h, int *b)
{
    int H = s->model.n_kv_heads, B = s->n_buckets;
    *l = (int)(i / ((size_t)H * B));
    *h = (int)(i / (size_t)B % (size_t)H);
    *b = (int)(i % (size_t)B);
}

/* Value PCA and closed-form keys of one unit (whichever are missing or stale). */
static enum kvcap_status fit_unit(struct kvcap_calib_state *s, size_t i, int keys, int refit_keys)
{
    struct kvcap_calib_unit *u = &s->units[i];
    int l, h, b;
    unit_position(s, i, &l, &h, &b);
    if (!keys) {
        if (u->v_eigval)
            return KVCAP_OK;
        u->v_eigval = malloc(sizeof(double) * (size_t)u->m);
        u->v_eigvec = malloc(sizeof(float) * (size_t)u->m * (size_t)u->m);
        KVCAP_RETURN_IF(!u->v_eigval || !u->v_eigvec, KVCAP_ERR_OUT_OF_MEMORY,
                        "l%d.h%d.b%d: value PCA: out of memory", l, h, b);
        enum kvcap_status st = kvcap_values_fit(u->v_gram, u->m, u->v_eigval, u->v_eigvec);
        KVCAP_RETURN_IF(st != KVCAP_OK, st, "l%d.h%d.b%d: %s", l, h, b, kvcap_last_error());
        return KVCAP_OK;
    }
    int hw, rk = unit_key_size(s, l, u->m, &hw);
    if (u->has_keys && !refit_keys && u->keys.rk == rk && u->keys.h == hw)
        return KVCAP_OK;
    kvcap_key_maps_free(&u->keys);
    u->has_keys = 0;
    enum kvcap_status st = kvcap_keys_closed_form(u->k_gram, u->m, rk, hw, s->ridge, &u->keys);
    KVCAP_RETURN_IF(st != KVCAP_OK, st, "l%d.h%d.b%d: %s", l, h, b, kvcap_last_error());
    u->has_keys = 1;
    return KVCAP_OK;
}

/* The CUDA value PCA: hands each eigen-decomposition's host copy to the shared
 * post-processing of kvcap_values_fit. */
struct gpu_values {
    struct kvcap_calib_state *s;
    const size_t *units; /* batch index -> unit index */
};

static enum kvcap_status gpu_values_consume(int i, const double *a, const double *w, void *user)
{
    struct gpu_values *g = user;
    struct kvcap_calib_unit *u = &g->s->units[g->units[i]];
    kvcap_values_from_eigen(a, w, u->m, u->v_eigval, u->v_eigvec);
    return KVCAP_OK;
}

/* Value PCA of every unit still without one, on the CUDA device. *on_gpu = 0 (and nothing is
 * changed) when `fallback` is set and the device could not be set up: the caller runs the CPU
 * path instead. */
static enum kvcap_status fit_values_gpu(struct kvcap_calib_state *s, int fallback, int *on_gpu)
{
    *on_gpu = 0;
    size_t n = unit_count(s), count = 0;
    size_t *todo = malloc(sizeof *todo * n);
    const double **mats = malloc(sizeof *mats * n);
    int *sizes = malloc(sizeof *sizes * n), m_max = 0;
    struct kvcap_calib_cuda_eigen *e = NULL;
    enum kvcap_status st = KVCAP_OK;
    if (!todo || !mats || !sizes)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "value PCA: out of memory (%zu units)", n);
    for (size_t i = 0; st == KVCAP_OK && i < n; i++) {
        const struct kvcap_calib_unit *u = &s->units[i];
        if (u->v_eigval)
            continue;
        todo[count] = i;
        mats[count] = u->v_gram;
        sizes[count++] = u->m;
        m_max = u->m > m_max ? u->m : m_max;
    }
    if (st == KVCAP_OK && count > 0) {
        if (fallback)
            kvcap_quiet_push();
        st = kvcap_calib_cuda_eigen_create(m_max, &e);
        if (fallback)
            kvcap_quiet_pop();
        if (st != KVCAP_OK && fallback) {
            kvcap_log(KVCAP_LOG_WARN, "%s; the value PCA runs on the CPU", kvcap_last_error());
            kvcap_clear_error();
            free(todo), free(mats), free(sizes);
            return KVCAP_OK;
        }
    }
    *on_gpu = 1;
    for (size_t k = 0; st == KVCAP_OK && k < count; k++) {
        struct kvcap_calib_unit *u = &s->units[todo[k]];
        u->v_eigval = malloc(sizeof(double) * (size_t)u->m);
        u->v_eigvec = malloc(sizeof(float) * (size_t)u->m * (size_t)u->m);
        if (!u->v_eigval || !u->v_eigvec) {
            int l, h, b;
            unit_position(s, todo[k], &l, &h, &b);
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "l%d.h%d.b%d: value PCA: out of memory", l,
                            h, b);
        }
    }
    if (st == KVCAP_OK && count > 0) {
        struct gpu_values g = {s, todo};
        int failed = -1;
        st = kvcap_calib_cuda_dsyevd_batch(e, (int)count, mats, sizes, gpu_values_consume, &g,
                                           &failed);
        if (st != KVCAP_OK && failed >= 0) {
            int l, h, b;
            unit_position(s, todo[failed], &l, &h, &b);
            st = kvcap_fail(st, "l%d.h%d.b%d: %s", l, h, b, kvcap_last_error());
        }
    }
    /* A failed batch leaves no half-fitted unit behind. */
    for (size_t k = 0; st != KVCAP_OK && todo && k < count; k++) {
        struct kvcap_calib_unit *u = &s->units[todo[k]];
        free(u->v_eigval);
        free(u->v_eigvec);
        u->v_eigval = NULL;
        u->v_eigvec = NULL;
    }
    kvcap_calib_cuda_eigen_free(e);
    free(todo), free(mats), free(sizes);
    return st;
}

enum kvcap_status kvcap_calib_state_fit(struct kvcap_calib_state *s, int refit_keys,
                                        enum kvcap_calib_device device,
                                        struct kvcap_fit_timing *timing,
                                        int (*progress)(int64_t, int64_t, void *), void *user)
{
    struct kvcap_fit_timing local;
    if (!timing)
        timing = &local;
    memset(timing, 0, sizeof *timing);
    enum kvcap_calib_device dev;
    KVCAP_TRY(kvcap_calib_device_resolve(device, &dev));
    timing->values_device = KVCAP_CALIB_DEVICE_CPU;
    long n = (long)unit_count(s);
    /* Units are independent: two single-threaded LAPACK calls at a time use two cores better
     * than one call with two BLAS threads (the tridiagonal reduction scales poorly). */
    int blas_threads = openblas_get_num_threads();
    openblas_set_num_threads(1);
    enum kvcap_status st = KVCAP_OK;
    for (int keys = 0; keys < 2 && st == KVCAP_OK; keys++) {
        struct kvcap_parallel_error err = {0};
        int fits = 0, on_gpu = 0;
        double t0 = kvcap_seconds();
        if (!keys && dev == KVCAP_CALIB_DEVICE_CUDA) {
            st = fit_values_gpu(s, device == KVCAP_CALIB_DEVICE_AUTO, &on_gpu);
            if (on_gpu) {
                fits = (int)n;
                timing->values_device = KVCAP_CALIB_DEVICE_CUDA;
            }
        }
        if (st != KVCAP_OK)
            break;
        if (!on_gpu) {
#pragma omp parallel for schedule(dynamic) reduction(+ : fits)
            for (long i = 0; i < n; i++) {
                if (kvcap_parallel_failed(&err))
                    continue;
                enum kvcap_status s2 = fit_unit(s, (size_t)i, keys, refit_keys);
                if (s2 != KVCAP_OK)
                    kvcap_parallel_fail(&err, s2);
                fits++;
            }
        }
        *(keys ? &timing->keys_seconds : &timing->values_seconds) = kvcap_seconds() - t0;
        *(keys ? &timing->key_fits : &timing->value_fits) = fits;
        st = kvcap_parallel_status(&err);
        if (st == KVCAP_OK && progress && progress(keys + 1, 2, user))
            st = kvcap_fail(KVCAP_ERR_STATE, "fit: stopped by the caller");
    }
    openblas_set_num_threads(blas_threads);
    return st;
}

enum kvcap_status kvcap_calib_state_merge(struct kvcap_calib_state *dst,
                                          const struct kvcap_calib_state *src,
                                          const char *src_label)
{
    const char *diff = kvcap_geometry_difference(&dst->model, &src->model);
    KVCAP_RETURN_IF(diff, KVCAP_ERR_GEOMETRY, "%s: %s differs from the first state's", src_label,
                    diff);
    KVCAP_RETURN_IF(dst->n_buckets != src->n_buckets, KVCAP_ERR_GEOMETRY,
                    "%s: %d buckets, the first state has %d", src_label, src->n_buckets,
                    dst->n_buckets);
    for (int b = 0; b < dst->n_buckets; b++) {
        const struct kvcap_bucket *x = &dst->buckets[b], *y = &src->buckets[b];
        KVCAP_RETURN_IF(x->rows != y->rows || x->cols != y->cols || x->structure != y->structure ||
                            x->tile_rows != y->tile_rows || x->tile_cols != y->tile_cols,
                        KVCAP_ERR_GEOMETRY, "%s: buckets[%d] differs from the first state's",
                        src_label, b);
        dst->train_spans[b] += src->train_spans[b];
        dst->val_spans[b] += src->val_spans[b];
    }
    for (size_t i = 0; i < unit_count(dst); i++) {
        struct kvcap_calib_unit *u = &dst->units[i];
        const struct kvcap_calib_unit *v = &src->units[i];
        for (size_t j = 0; j < (size_t)u->m * (size_t)u->m; j++) {
            u->v_gram[j] += v->v_gram[j];
            u->k_gram[j] += v->k_gram[j];
        }
        unit_drop_fit(u);
    }
    /* Trained key maps cannot be merged; the merged state is refitted in closed form. */
    dst->key_method = KVCAP_KEY_METHOD_CLOSED_FORM;
    dst->activation = KVCAP_ACTIVATION_LINEAR;
    return KVCAP_OK;
}

/* ---- .kvcs ------------------------------------------------------------------------------ */

static cJSON *ratios_json(const double *r, int n)
{
    return cJSON_CreateDoubleArray(r, n);
}

enum kvcap_status kvcap_calib_state_write(const struct kvcap_calib_state *s, const char *path)
{
    struct kvst_writer *w = NULL;
    KVCAP_TRY(kvst_writer_create(&w));
    enum kvcap_status st = KVCAP_OK;
    char name[NAME_CAP];
    int L = s->model.n_layers, H = s->model.n_kv_heads;
    for (int l = 0; st == KVCAP_OK && l < L; l++)
        for (int h = 0; st == KVCAP_OK && h < H; h++)
            for (int b = 0; st == KVCAP_OK && b < s->n_buckets; b++) {
                const struct kvcap_calib_unit *u = kvcap_state_unit(s, l, h, b);
                const int64_t mm[2] = {u->m, u->m}, m1[1] = {u->m};
                const int64_t nm[1] = {KVCAP_METRIC_COUNT};
#define ADD(suffix, dtype, nd, shape, data)                                       \
    do {                                                                          \
        snprintf(name, sizeof name, "l%d.h%d.b%d." suffix, l, h, b);              \
        if (st == KVCAP_OK)                                                       \
            st = kvst_writer_add(w, name, dtype, nd, shape, data);               \
    } while (0)
                ADD("v_gram", KVCAP_DTYPE_F64, 2, mm, u->v_gram);
                ADD("k_gram", KVCAP_DTYPE_F64, 2, mm, u->k_gram);
                ADD("metrics", KVCAP_DTYPE_F64, 1, nm, u->metrics);
                if (u->v_eigval) {
                    ADD("v_eigval", KVCAP_DTYPE_F64, 1, m1, u->v_eigval);
                    ADD("v_eigvec", KVCAP_DTYPE_F32, 2, mm, u->v_eigvec);
                }
                if (u->has_keys) {
                    const struct kvcap_key_maps *k = &u->keys;
                    const int64_t rk[1] = {k->rk}, w1[2] = {k->rk, k->h}, b1[1] = {k->h};
                    const int64_t w2[2] = {k->h, k->m};
                    ADD("k_mask", KVCAP_DTYPE_I32, 1, rk, k->mask);
                    ADD("k_w1", KVCAP_DTYPE_F32, 2, w1, k->w1);
                    ADD("k_b1", KVCAP_DTYPE_F32, 1, b1, k->b1);
                    ADD("k_w2", KVCAP_DTYPE_F32, 2, w2, k->w2);
                    ADD("k_b2", KVCAP_DTYPE_F32, 1, m1, k->b2);
                    const int64_t one[1] = {1};
                    static const uint8_t act[2] = {0, 1};
                    ADD("k_act", KVCAP_DTYPE_U8, 1, one, &act[k->gelu ? 1 : 0]);
                }
#undef ADD
            }
    cJSON *config = cJSON_CreateObject();
    if (st == KVCAP_OK && config) {
        cJSON_AddItemToObject(config, "model", kvcap_geometry_to_json(&s->model));
        cJSON_AddItemToObject(config, "buckets", kvcap_buckets_to_json(s->buckets, s->n_buckets));
        cJSON *calib = cJSON_AddObjectToObject(config, "calib");
        cJSON *spans = cJSON_AddArrayToObject(calib, "spans");
        for (int b = 0; b < s->n_buckets; b++) {
            double pair[2] = {(double)s->train_spans[b], (double)s->val_spans[b]};
            cJSON_AddItemToArray(spans, cJSON_CreateDoubleArray(pair, 2));
        }
        cJSON_AddItemToObject(calib, "metrics",
                              cJSON_CreateStringArray(metric_names, KVCAP_METRIC_COUNT));
        cJSON *fit = cJSON_AddObjectToObject(calib, "fit");
        cJSON_AddStringToObject(fit, "keys_method", kvcap_key_method_name(s->key_method));
        cJSON_AddStringToObject(fit, "activation", kvcap_activation_name(s->activation));
        cJSON_AddNumberToObject(fit, "hidden", s->hidden);
        cJSON_AddNumberToObject(fit, "ridge", s->ridge);
        cJSON_AddStringToObject(fit, "storage", kvcap_dtype_name(s->storage));
        cJSON *sched = cJSON_AddObjectToObject(fit, "schedule");
        cJSON_AddItemToObject(sched, "keys", ratios_json(s->r_keys, L));
        cJSON_AddItemToObject(sched, "values", ratios_json(s->r_values, L));
        cJSON *prov = cJSON_AddObjectToObject(config, "provenance");
        char tool[48];
        snprintf(tool, sizeof tool, "kvcap %s", kvcap_version());
        cJSON_AddStringToObject(prov, "tool", tool);
        if (s->data_note)
            cJSON_AddStringToObject(prov, "data", s->data_note);
        st = kvcap_schema_set_meta(w, KVCAP_KIND_CALIB, config);
    } else if (st == KVCAP_OK) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    if (st == KVCAP_OK)
        st = kvst_writer_commit(w, path);
    cJSON_Delete(config);
    kvst_writer_free(w);
    return st;
}

static const struct kvst_tensor *find(const struct kvst_file *f, int l, int h, int b,
                                      const char *suffix)
{
    char name[NAME_CAP];
    snprintf(name, sizeof name, "l%d.h%d.b%d.%s", l, h, b, suffix);
    return kvst_find(f, name);
}

enum kvcap_status kvcap_calib_state_read(const char *path, struct kvcap_calib_state *s)
{
    memset(s, 0, sizeof *s);
    struct kvst_file *f = NULL;
    KVCAP_TRY(kvst_open(path, &f));
    struct kvcap_file_info info;
    /* The schema check is the whole validation (kvcap-convert --inspect runs the same one):
     * below, values are only copied. */
    enum kvcap_status st = kvcap_schema_check(f, KVCAP_KIND_CALIB, &info);
    if (st == KVCAP_OK) {
        s->model = info.model;
        s->n_buckets = info.n_buckets;
        memcpy(s->buckets, info.buckets, sizeof info.buckets);
        st = state_alloc(s);
    }
    if (st == KVCAP_OK) {
        for (int b = 0; b < s->n_buckets; b++) {
            s->train_spans[b] = info.calib_spans[b][0];
            s->val_spans[b] = info.calib_spans[b][1];
        }
        s->key_method = info.fit.key_method;
        s->activation = info.fit.activation;
        s->hidden = info.fit.hidden;
        s->ridge = info.fit.ridge;
        s->storage = info.storage;
        memcpy(s->r_keys, info.schedule_keys, sizeof(double) * (size_t)s->model.n_layers);
        memcpy(s->r_values, info.schedule_values, sizeof(double) * (size_t)s->model.n_layers);
    }
    for (int l = 0; st == KVCAP_OK && l < s->model.n_layers; l++)
        for (int h = 0; st == KVCAP_OK && h < s->model.n_kv_heads; h++)
            for (int b = 0; st == KVCAP_OK && b < s->n_buckets; b++) {
                struct kvcap_calib_unit *u = kvcap_state_unit(s, l, h, b);
                size_t mm = (size_t)u->m * (size_t)u->m;
                memcpy(u->v_gram, find(f, l, h, b, "v_gram")->data, sizeof(double) * mm);
                memcpy(u->k_gram, find(f, l, h, b, "k_gram")->data, sizeof(double) * mm);
                const struct kvst_tensor *t = find(f, l, h, b, "metrics");
                if (t && t->n_elements == KVCAP_METRIC_COUNT)
                    memcpy(u->metrics, t->data, sizeof u->metrics);
                const struct kvst_tensor *ev = find(f, l, h, b, "v_eigval");
                const struct kvst_tensor *evec = find(f, l, h, b, "v_eigvec");
                if (ev && evec) {
                    u->v_eigval = malloc(sizeof(double) * (size_t)u->m);
                    u->v_eigvec = malloc(sizeof(float) * mm);
                    if (!u->v_eigval || !u->v_eigvec) {
                        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
                        break;
                    }
                    memcpy(u->v_eigval, ev->data, sizeof(double) * (size_t)u->m);
                    memcpy(u->v_eigvec, evec->data, sizeof(float) * mm);
                }
                const struct kvst_tensor *mask = find(f, l, h, b, "k_mask");
                if (mask) { /* shapes were checked by the schema */
                    const struct kvst_tensor *w1 = find(f, l, h, b, "k_w1");
                    const struct kvst_tensor *act = find(f, l, h, b, "k_act");
                    int gelu = act ? *(const uint8_t *)act->data == 1
                                   : s->activation == KVCAP_ACTIVATION_GELU;
                    st = kvcap_key_maps_alloc(&u->keys, u->m, (int)mask->shape[0],
                                              (int)w1->shape[1], gelu);
                    if (st != KVCAP_OK)
                        break;
                    struct kvcap_key_maps *k = &u->keys;
                    memcpy(k->mask, mask->data, mask->nbytes);
                    memcpy(k->w1, w1->data, w1->nbytes);
                    memcpy(k->b1, find(f, l, h, b, "k_b1")->data, sizeof(float) * (size_t)k->h);
                    memcpy(k->w2, find(f, l, h, b, "k_w2")->data,
                           sizeof(float) * (size_t)k->h * (size_t)k->m);
                    memcpy(k->b2, find(f, l, h, b, "k_b2")->data, sizeof(float) * (size_t)k->m);
                    u->has_keys = 1;
                }
            }
    kvcap_file_info_free(&info);
    kvst_close(f);
    if (st != KVCAP_OK)
        kvcap_calib_state_free(s);
    return st;
}
