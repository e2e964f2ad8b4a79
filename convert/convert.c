/* convert.c — kvcap_convert(): merge calibration states, pick bases and key maps for the
 * artifact's schedule, store them in the chosen precision and write the artifact. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "convert.h"
#include "internal.h"
#include "state.h"

void kvcap_convert_default_options(struct kvcap_convert_options *o)
{
    memset(o, 0, sizeof *o);
    o->storage = KVCAP_DTYPE_F16;
    o->fallback = KVCAP_POLICY_FLASHCACHE;
}

/* Owned tensor buffers that must live until the writer commits. */
struct buffers {
    void **items;
    size_t n, cap;
};

static void *keep(struct buffers *b, size_t bytes)
{
    if (b->n == b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 256;
        void **grown = realloc(b->items, cap * sizeof *grown);
        if (!grown)
            return NULL;
        b->items = grown;
        b->cap = cap;
    }
    void *p = malloc(bytes ? bytes : 1);
    if (p)
        b->items[b->n++] = p;
    return p;
}

static void release(struct buffers *b)
{
    for (size_t i = 0; i < b->n; i++)
        free(b->items[i]);
    free(b->items);
}

/* Adds rows x cols floats as a tensor in `dtype`. */
static enum kvcap_status add_floats(struct kvst_writer *w, struct buffers *keep_list,
                                    const char *name, enum kvcap_dtype dtype, int ndim,
                                    const int64_t *shape, const float *src, size_t count)
{
    void *dst = keep(keep_list, count * kvcap_dtype_size(dtype));
    KVCAP_RETURN_IF(!dst, KVCAP_ERR_OUT_OF_MEMORY, "convert: out of memory");
    KVCAP_TRY(kvcap_convert_from_f32(dtype, src, count, dst));
    return kvst_writer_add(w, name, dtype, ndim, shape, dst);
}

static double mean(const double *r, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += r[i];
    return s / n;
}

static enum kvcap_status write_artifact(const struct kvcap_calib_state *s,
                                        const struct kvcap_convert_options *o,
                                        enum kvcap_dtype storage, const char *path)
{
    struct kvst_writer *w = NULL;
    KVCAP_TRY(kvst_writer_create(&w));
    struct buffers bufs = {0};
    enum kvcap_status st = KVCAP_OK;
    char name[96];
    const struct kvcap_model_geometry *g = &s->model;
    for (int l = 0; st == KVCAP_OK && l < g->n_layers; l++)
        for (int h = 0; st == KVCAP_OK && h < g->n_kv_heads; h++)
            for (int b = 0; st == KVCAP_OK && b < s->n_buckets; b++) {
                const struct kvcap_calib_unit *u = kvcap_state_unit(s, l, h, b);
                const struct kvcap_key_maps *k = &u->keys;
                int rv = kvcap_retained(s->r_values[l], u->m);
                const int64_t ushape[2] = {rv, u->m}, mask[1] = {k->rk}, w1[2] = {k->rk, k->h};
                const int64_t b1[1] = {k->h}, w2[2] = {k->h, k->m}, b2[1] = {k->m};
                snprintf(name, sizeof name, "l%d.h%d.b%d.U", l, h, b);
                st = add_floats(w, &bufs, name, storage, 2, ushape, u->v_eigvec,
                                (size_t)rv * (size_t)u->m);
                snprintf(name, sizeof name, "l%d.h%d.b%d.k_mask", l, h, b);
                if (st == KVCAP_OK)
                    st = kvst_writer_add(w, name, KVCAP_DTYPE_I32, 1, mask, k->mask);
#define MAP(suffix, nd, shape, data, count)                                          \
    snprintf(name, sizeof name, "l%d.h%d.b%d." suffix, l, h, b);                     \
    if (st == KVCAP_OK)                                                              \
        st = add_floats(w, &bufs, name, storage, nd, shape, data, count);
                MAP("k_w1", 2, w1, k->w1, (size_t)k->rk * (size_t)k->h)
                MAP("k_b1", 1, b1, k->b1, (size_t)k->h)
                MAP("k_w2", 2, w2, k->w2, (size_t)k->h * (size_t)k->m)
                MAP("k_b2", 1, b2, k->b2, (size_t)k->m)
#undef MAP
                static const uint8_t act[2] = {0, 1};
                const int64_t one[1] = {1};
                snprintf(name, sizeof name, "l%d.h%d.b%d.k_act", l, h, b);
                if (st == KVCAP_OK)
                    st = kvst_writer_add(w, name, KVCAP_DTYPE_U8, 1, one, &act[k->gelu ? 1 : 0]);
            }
    cJSON *config = cJSON_CreateObject();
    if (st == KVCAP_OK && config) {
        cJSON_AddItemToObject(config, "model", kvcap_geometry_to_json(g));
        cJSON_AddItemToObject(config, "buckets", kvcap_buckets_to_json(s->buckets, s->n_buckets));
        cJSON *art = cJSON_AddObjectToObject(config, "artifact");
        char storage_name[8];
        snprintf(storage_name, sizeof storage_name, "%s", kvcap_dtype_name(storage));
        for (char *p = storage_name; *p; p++)
            *p = (char)(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
        cJSON_AddStringToObject(art, "storage", storage_name);
        cJSON_AddStringToObject(art, "activation", kvcap_activation_name(s->activation));
        cJSON *sched = cJSON_AddObjectToObject(art, "schedule");
        cJSON_AddItemToObject(sched, "keys", cJSON_CreateDoubleArray(s->r_keys, g->n_layers));
        cJSON_AddItemToObject(sched, "values", cJSON_CreateDoubleArray(s->r_values, g->n_layers));
        cJSON_AddStringToObject(art, "fallback", kvcap_policy_name(o->fallback));
        cJSON *spans = cJSON_AddArrayToObject(art, "calibration_spans");
        for (int b = 0; b < s->n_buckets; b++) {
            double pair[2] = {(double)s->train_spans[b], (double)s->val_spans[b]};
            cJSON_AddItemToArray(spans, cJSON_CreateDoubleArray(pair, 2));
        }
        cJSON *prov = cJSON_AddObjectToObject(config, "provenance");
        char tool[48];
        snprintf(tool, sizeof tool, "kvcap-convert %s", kvcap_version());
        cJSON_AddStringToObject(prov, "tool", tool);
        cJSON *from = cJSON_AddArrayToObject(prov, "states");
        for (int i = 0; i < o->n_states; i++)
            cJSON_AddItemToArray(from, cJSON_CreateString(o->states[i]));
        st = kvcap_schema_set_meta(w, KVCAP_KIND_ARTIFACT, config);
    } else if (st == KVCAP_OK) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "convert: out of memory");
    }
    if (st == KVCAP_OK)
        st = kvst_writer_commit(w, path);
    cJSON_Delete(config);
    kvst_writer_free(w);
    release(&bufs);
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
        if (st == KVCAP_OK)
            for (int l = 0; l < L; l++)
                keys_changed |= r[l] != s.r_keys[l];
        if (st == KVCAP_OK)
            memcpy(s.r_keys, r, sizeof(double) * (size_t)L);
        free(r);
    }
    if (st == KVCAP_OK && o->values_set)
        st = kvcap_schedule_expand(&o->values, L, s.r_values);
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
        st = kvcap_calib_state_fit(&s, report->keys_refit, NULL, NULL, NULL);
    if (st == KVCAP_OK && report->trained_discarded)
        kvcap_log(KVCAP_LOG_WARN,
                  "trained key maps were replaced by closed-form ones (%s); recalibrate with the "
                  "new schedule to train them",
                  merged ? "states were merged" : "the key schedule changed");
    enum kvcap_dtype storage = o->storage_set ? o->storage : s.storage;
    if (st == KVCAP_OK)
        st = write_artifact(&s, o, storage, o->out);
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
    report->mean_r_keys = mean(s.r_keys, L);
    report->mean_r_values = mean(s.r_values, L);
    kvcap_calib_state_free(&s);
    return st;
}
