/* artifact.c — opening a compressor artifact: validation (formats/schema.c, the same check
 * `kvcap-convert --inspect` runs), then every map converted once to f32 so decode never
 * converts parameters. */
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/artifact.h"
#include "common/internal.h"

static void free_units(struct kvcap_artifact *a)
{
    size_t n = (size_t)a->model.n_layers * a->model.n_kv_heads * a->n_buckets;
    for (size_t i = 0; a->units && i < n; i++) {
        struct kvcap_unit_maps *u = &a->units[i];
        free(u->mask), free(u->w1), free(u->b1), free(u->w2), free(u->b2), free(u->u);
    }
    free(a->units);
}

void kvcap_artifact_hold(const struct kvcap_artifact *a)
{
    if (a) /* holders is the one mutable field (artifact.h) */
        atomic_fetch_add_explicit(&((struct kvcap_artifact *)a)->holders, 1,
                                  memory_order_relaxed);
}

void kvcap_artifact_let_go(const struct kvcap_artifact *a)
{
    struct kvcap_artifact *m = (struct kvcap_artifact *)a;
    /* acq_rel: every use of the maps by a holder happens before the last one frees them */
    if (!m || atomic_fetch_sub_explicit(&m->holders, 1, memory_order_acq_rel) != 1)
        return;
    free_units(m);
    free(m);
}

void kvcap_artifact_free(struct kvcap_artifact *a)
{
    kvcap_artifact_let_go(a);
}

const struct kvcap_model_geometry *kvcap_artifact_geometry(const struct kvcap_artifact *a)
{
    return a ? &a->model : NULL;
}

/* Copies tensor `suffix` of unit (l, h, b) as f32 into a new array. The schema check has
 * refused non-finite values, and F16/BF16 widen to F32 exactly. */
static enum kvcap_status load_floats(const struct kvst_file *f, const char *prefix,
                                     const char *suffix, float **out, size_t *count)
{
    char name[96];
    snprintf(name, sizeof name, "%s.%s", prefix, suffix);
    const struct kvst_tensor *t = kvst_find(f, name);
    KVCAP_RETURN_IF(!t, KVCAP_ERR_FORMAT, "%s: missing tensor '%s'", kvst_path(f), name);
    *out = malloc(sizeof(float) * (t->n_elements ? t->n_elements : 1));
    KVCAP_RETURN_IF(!*out, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory for '%s'", kvst_path(f),
                    name);
    *count = t->n_elements;
    return kvcap_convert_to_f32(t->dtype, t->data, t->n_elements, *out);
}

enum kvcap_status kvcap_artifact_open(const char *path, struct kvcap_artifact **out)
{
    KVCAP_RETURN_IF(!path || !out, KVCAP_ERR_INVALID_ARGUMENT, "kvcap_artifact_open: NULL argument");
    *out = NULL;
    struct kvst_file *f = NULL;
    KVCAP_TRY(kvst_open(path, &f));
    struct kvcap_file_info info;
    /* Everything the runtime relies on (shapes, masks, finite values, heads of a layer sharing
     * h and R_v) is checked here, naming the file; prefill and decode check nothing again. */
    enum kvcap_status st = kvcap_schema_check(f, KVCAP_KIND_ARTIFACT, &info);
    struct kvcap_artifact *a = calloc(1, sizeof *a);
    if (st == KVCAP_OK && !a)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    size_t n = 0;
    if (a)
        atomic_init(&a->holders, 1); /* the opener */
    if (st == KVCAP_OK) {
        a->model = info.model;
        a->n_buckets = info.n_buckets;
        memcpy(a->buckets, info.buckets, sizeof info.buckets);
        a->fallback = info.fallback;
        n = (size_t)a->model.n_layers * a->model.n_kv_heads * a->n_buckets;
        a->units = calloc(n, sizeof *a->units);
        if (!a->units)
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    for (size_t i = 0; st == KVCAP_OK && i < n; i++) {
        int B = a->n_buckets, H = a->model.n_kv_heads;
        int l = (int)(i / ((size_t)H * B)), h = (int)(i / (size_t)B % (size_t)H), b = (int)(i % (size_t)B);
        char prefix[64], name[96];
        snprintf(prefix, sizeof prefix, "l%d.h%d.b%d", l, h, b);
        struct kvcap_unit_maps *u = &a->units[i];
        size_t count;
        u->m = kvcap_bucket_points(&a->buckets[b]);
        snprintf(name, sizeof name, "%s.k_mask", prefix);
        const struct kvst_tensor *mask = kvst_find(f, name);
        u->rk = (int)mask->shape[0];
        u->mask = malloc(mask->nbytes);
        if (!u->mask) {
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
            break;
        }
        memcpy(u->mask, mask->data, mask->nbytes);
        snprintf(name, sizeof name, "%s.k_act", prefix);
        const struct kvst_tensor *act = kvst_find(f, name);
        u->gelu = act ? *(const uint8_t *)act->data == 1 : info.activation_gelu;
        st = load_floats(f, prefix, "k_w1", &u->w1, &count);
        if (st == KVCAP_OK)
            u->h = (int)(count / (size_t)u->rk), a->map_bytes += count * 4;
        if (st == KVCAP_OK)
            st = load_floats(f, prefix, "k_b1", &u->b1, &count), a->map_bytes += count * 4;
        if (st == KVCAP_OK)
            st = load_floats(f, prefix, "k_w2", &u->w2, &count), a->map_bytes += count * 4;
        if (st == KVCAP_OK)
            st = load_floats(f, prefix, "k_b2", &u->b2, &count), a->map_bytes += count * 4;
        if (st == KVCAP_OK)
            st = load_floats(f, prefix, "U", &u->u, &count), a->map_bytes += count * 4;
        if (st == KVCAP_OK)
            u->rv = (int)(count / (size_t)u->m);
    }
    kvcap_file_info_free(&info);
    kvst_close(f);
    if (st != KVCAP_OK) {
        kvcap_artifact_free(a);
        return st;
    }
    *out = a;
    return KVCAP_OK;
}

int kvcap_artifact_find_bucket(const struct kvcap_artifact *a, int rows, int cols)
{
    int best = -1;
    for (int b = 0; a && b < a->n_buckets; b++) {
        if (a->buckets[b].rows != rows || a->buckets[b].cols != cols)
            continue;
        if (best < 0 || (a->buckets[b].structure == KVCAP_STRUCTURE_TILED &&
                         a->buckets[best].structure == KVCAP_STRUCTURE_DENSE))
            best = b;
    }
    return best;
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

/* Adds `count` floats as tensor PREFIX.suffix in `dtype`. */
static enum kvcap_status add_floats(struct kvst_writer *w, struct buffers *bufs,
                                    const char *prefix, const char *suffix, enum kvcap_dtype dtype,
                                    int ndim, const int64_t *shape, const float *src, size_t count)
{
    char name[96];
    snprintf(name, sizeof name, "%s.%s", prefix, suffix);
    for (size_t i = 0; i < count; i++) /* never write a poisoned artifact (kvcap-convert) */
        KVCAP_RETURN_IF(!isfinite(src[i]), KVCAP_ERR_NUMERIC,
                        "artifact: tensor '%s': non-finite value %g at element %zu", name,
                        (double)src[i], i);
    void *dst = keep(bufs, count * kvcap_dtype_size(dtype));
    KVCAP_RETURN_IF(!dst, KVCAP_ERR_OUT_OF_MEMORY, "artifact: out of memory for '%s'", name);
    KVCAP_TRY(kvcap_convert_from_f32(dtype, src, count, dst));
    return kvst_writer_add(w, name, dtype, ndim, shape, dst);
}

static enum kvcap_status add_unit(struct kvst_writer *w, struct buffers *bufs, const char *prefix,
                                  enum kvcap_dtype dtype, const struct kvcap_unit_maps *u)
{
    static const uint8_t act[2] = {0, 1};
    const int64_t su[2] = {u->rv, u->m}, sm[1] = {u->rk}, sw1[2] = {u->rk, u->h};
    const int64_t sb1[1] = {u->h}, sw2[2] = {u->h, u->m}, sb2[1] = {u->m}, one[1] = {1};
    char name[96];
    KVCAP_TRY(add_floats(w, bufs, prefix, "U", dtype, 2, su, u->u, (size_t)u->rv * u->m));
    snprintf(name, sizeof name, "%s.k_mask", prefix);
    KVCAP_TRY(kvst_writer_add(w, name, KVCAP_DTYPE_I32, 1, sm, u->mask));
    KVCAP_TRY(add_floats(w, bufs, prefix, "k_w1", dtype, 2, sw1, u->w1, (size_t)u->rk * u->h));
    KVCAP_TRY(add_floats(w, bufs, prefix, "k_b1", dtype, 1, sb1, u->b1, (size_t)u->h));
    KVCAP_TRY(add_floats(w, bufs, prefix, "k_w2", dtype, 2, sw2, u->w2, (size_t)u->h * u->m));
    KVCAP_TRY(add_floats(w, bufs, prefix, "k_b2", dtype, 1, sb2, u->b2, (size_t)u->m));
    snprintf(name, sizeof name, "%s.k_act", prefix);
    return kvst_writer_add(w, name, KVCAP_DTYPE_U8, 1, one, &act[u->gelu ? 1 : 0]);
}

static cJSON *artifact_config(const struct kvcap_artifact_desc *d)
{
    cJSON *config = cJSON_CreateObject();
    if (!config)
        return NULL;
    cJSON_AddItemToObject(config, "model", kvcap_geometry_to_json(&d->model));
    cJSON_AddItemToObject(config, "buckets", kvcap_buckets_to_json(d->buckets, d->n_buckets));
    cJSON *art = cJSON_AddObjectToObject(config, "artifact");
    char storage[8];
    snprintf(storage, sizeof storage, "%s", kvcap_dtype_name(d->storage));
    for (char *p = storage; *p; p++)
        *p = (char)(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
    cJSON_AddStringToObject(art, "storage", storage);
    cJSON_AddStringToObject(art, "activation", d->activation_gelu ? "gelu" : "linear");
    cJSON *sched = cJSON_AddObjectToObject(art, "schedule");
    cJSON_AddItemToObject(sched, "keys", cJSON_CreateDoubleArray(d->r_keys, d->model.n_layers));
    cJSON_AddItemToObject(sched, "values", cJSON_CreateDoubleArray(d->r_values, d->model.n_layers));
    cJSON_AddStringToObject(art, "fallback", kvcap_policy_name(d->fallback));
    if (d->calibration_spans) {
        cJSON *spans = cJSON_AddArrayToObject(art, "calibration_spans");
        for (int b = 0; b < d->n_buckets; b++) {
            double pair[2] = {(double)d->calibration_spans[b][0],
                              (double)d->calibration_spans[b][1]};
            cJSON_AddItemToArray(spans, cJSON_CreateDoubleArray(pair, 2));
        }
    }
    if (d->provenance)
        cJSON_AddItemToObject(config, "provenance", cJSON_Duplicate(d->provenance, 1));
    return config;
}

enum kvcap_status kvcap_artifact_write(const char *path, const struct kvcap_artifact_desc *d,
                                       const struct kvcap_unit_maps *units)
{
    KVCAP_RETURN_IF(!path || !d || !units || d->n_buckets < 1 || !d->buckets || !d->r_keys ||
                        !d->r_values,
                    KVCAP_ERR_INVALID_ARGUMENT, "kvcap_artifact_write: missing argument");
    struct kvst_writer *w = NULL;
    KVCAP_TRY(kvst_writer_create(&w));
    struct buffers bufs = {0};
    enum kvcap_status st = KVCAP_OK;
    const struct kvcap_model_geometry *g = &d->model;
    size_t i = 0;
    for (int l = 0; st == KVCAP_OK && l < g->n_layers; l++)
        for (int h = 0; st == KVCAP_OK && h < g->n_kv_heads; h++)
            for (int b = 0; st == KVCAP_OK && b < d->n_buckets; b++, i++) {
                char prefix[64];
                snprintf(prefix, sizeof prefix, "l%d.h%d.b%d", l, h, b);
                st = add_unit(w, &bufs, prefix, d->storage, &units[i]);
            }
    cJSON *config = st == KVCAP_OK ? artifact_config(d) : NULL;
    if (st == KVCAP_OK && !config)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    if (st == KVCAP_OK)
        st = kvcap_schema_set_meta(w, KVCAP_KIND_ARTIFACT, config);
    if (st == KVCAP_OK)
        st = kvst_writer_commit(w, path);
    cJSON_Delete(config);
    kvst_writer_free(w);
    for (size_t k = 0; k < bufs.n; k++)
        free(bufs.items[k]);
    free(bufs.items);
    return st;
}
