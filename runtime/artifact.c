/* artifact.c — opening a compressor artifact: validation (formats/schema.c), then every map
 * converted once to f32 so decode never converts parameters. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "artifact.h"
#include "internal.h"

static void free_units(struct kvcap_artifact *a)
{
    size_t n = (size_t)a->model.n_layers * a->model.n_kv_heads * a->n_buckets;
    for (size_t i = 0; a->units && i < n; i++) {
        struct kvcap_unit_maps *u = &a->units[i];
        free(u->mask), free(u->w1), free(u->b1), free(u->w2), free(u->b2), free(u->u);
    }
    free(a->units);
}

void kvcap_artifact_free(struct kvcap_artifact *a)
{
    if (!a)
        return;
    free_units(a);
    free(a);
}

const struct kvcap_model_geometry *kvcap_artifact_geometry(const struct kvcap_artifact *a)
{
    return a ? &a->model : NULL;
}

/* Copies tensor `suffix` of unit (l, h, b) as f32 into a new array. */
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
    enum kvcap_status st = kvcap_schema_check(f, KVCAP_KIND_ARTIFACT, &info);
    struct kvcap_artifact *a = calloc(1, sizeof *a);
    if (st == KVCAP_OK && !a)
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    size_t n = 0;
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
