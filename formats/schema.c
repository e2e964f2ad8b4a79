/* schema.c — checks that a safetensors file is a well-formed kvcap dataset, calibration state
 * or artifact (formats/SPEC.md §2–6), and converts the shared config JSON to and from structs. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/internal.h"
#include "formats/schema.h"

#define NAME_CAP 96

const char *kvcap_file_kind_name(enum kvcap_file_kind kind)
{
    switch (kind) {
    case KVCAP_KIND_DATASET: return "dataset";
    case KVCAP_KIND_CALIB: return "calib";
    case KVCAP_KIND_ARTIFACT: return "artifact";
    case KVCAP_KIND_ANY: return "any";
    }
    return "?";
}

static int newest_version(enum kvcap_file_kind kind)
{
    switch (kind) {
    case KVCAP_KIND_DATASET: return KVCAP_FORMAT_VERSION_DATASET;
    case KVCAP_KIND_CALIB: return KVCAP_FORMAT_VERSION_CALIB;
    case KVCAP_KIND_ARTIFACT: return KVCAP_FORMAT_VERSION_ARTIFACT;
    case KVCAP_KIND_ANY: break;
    }
    return 0;
}

int kvcap_bucket_points(const struct kvcap_bucket *b)
{
    return b->structure == KVCAP_STRUCTURE_TILED ? b->tile_rows * b->tile_cols
                                                 : b->rows * b->cols;
}

/* ---- JSON field readers: every failure names `where` and the dotted field ---------------- */

static enum kvcap_status json_int(const cJSON *obj, const char *key, int required, long lo,
                                  long hi, const char *where, const char *field, int *out)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!it) {
        KVCAP_RETURN_IF(required, KVCAP_ERR_FORMAT, "%s: %s.%s: missing", where, field, key);
        return KVCAP_OK;
    }
    KVCAP_RETURN_IF(!cJSON_IsNumber(it), KVCAP_ERR_FORMAT, "%s: %s.%s: expected an integer",
                    where, field, key);
    KVCAP_RETURN_IF(!kvcap_int_from_double(it->valuedouble, lo, hi, out), KVCAP_ERR_FORMAT,
                    "%s: %s.%s: %g is not an integer in %ld..%ld", where, field, key,
                    it->valuedouble, lo, hi);
    return KVCAP_OK;
}

static const char *json_str(const cJSON *obj, const char *key)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsString(it) ? it->valuestring : NULL;
}

static const cJSON *json_obj(const cJSON *obj, const char *key)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsObject(it) ? it : NULL;
}

cJSON *kvcap_geometry_to_json(const struct kvcap_model_geometry *g)
{
    cJSON *m = cJSON_CreateObject();
    cJSON *rope = cJSON_CreateObject();
    if (!m || !rope) {
        cJSON_Delete(m);
        cJSON_Delete(rope);
        return NULL;
    }
    cJSON_AddStringToObject(m, "name", g->name);
    cJSON_AddNumberToObject(m, "layers", g->n_layers);
    cJSON_AddNumberToObject(m, "q_heads", g->n_q_heads);
    cJSON_AddNumberToObject(m, "kv_heads", g->n_kv_heads);
    cJSON_AddNumberToObject(m, "head_dim", g->head_dim);
    cJSON_AddStringToObject(rope, "type", kvcap_rope_type_name(g->rope_type));
    if (g->rope_type != KVCAP_ROPE_NONE) {
        cJSON_AddStringToObject(rope, "pairing", kvcap_rope_pairing_name(g->rope_pairing));
        cJSON_AddNumberToObject(rope, "theta", g->rope_theta);
        cJSON_AddNumberToObject(rope, "dim", g->rope_dim ? g->rope_dim : g->head_dim);
        if (g->rope_type == KVCAP_ROPE_MROPE)
            cJSON_AddItemToObject(rope, "sections",
                                  cJSON_CreateIntArray(g->rope_sections, g->n_rope_sections));
    }
    cJSON_AddItemToObject(m, "rope", rope);
    return m;
}

enum kvcap_status kvcap_geometry_from_json(const cJSON *model, const char *where,
                                           struct kvcap_model_geometry *g)
{
    memset(g, 0, sizeof *g);
    KVCAP_RETURN_IF(!cJSON_IsObject(model), KVCAP_ERR_FORMAT,
                    "%s: kvcap.config: 'model' missing or not an object", where);
    const char *name = json_str(model, "name");
    if (name)
        snprintf(g->name, sizeof g->name, "%s", name);
    KVCAP_TRY(json_int(model, "layers", 1, 1, 1024, where, "model", &g->n_layers));
    KVCAP_TRY(json_int(model, "q_heads", 1, 1, 4096, where, "model", &g->n_q_heads));
    KVCAP_TRY(json_int(model, "kv_heads", 1, 1, 4096, where, "model", &g->n_kv_heads));
    KVCAP_TRY(json_int(model, "head_dim", 1, 1, 4096, where, "model", &g->head_dim));
    const cJSON *rope = json_obj(model, "rope");
    KVCAP_RETURN_IF(!rope, KVCAP_ERR_FORMAT, "%s: model.rope: missing or not an object", where);
    const char *type = json_str(rope, "type");
    KVCAP_RETURN_IF(!type || !kvcap_rope_type_parse(type, &g->rope_type), KVCAP_ERR_FORMAT,
                    "%s: model.rope.type: '%s' is not none, rope or mrope", where,
                    type ? type : "(missing)");
    if (g->rope_type != KVCAP_ROPE_NONE) {
        const char *pairing = json_str(rope, "pairing");
        KVCAP_RETURN_IF(!pairing || !kvcap_rope_pairing_parse(pairing, &g->rope_pairing),
                        KVCAP_ERR_FORMAT, "%s: model.rope.pairing: '%s' is not half or adjacent",
                        where, pairing ? pairing : "(missing)");
        const cJSON *theta = cJSON_GetObjectItemCaseSensitive(rope, "theta");
        KVCAP_RETURN_IF(!cJSON_IsNumber(theta), KVCAP_ERR_FORMAT,
                        "%s: model.rope.theta: missing or not a number", where);
        g->rope_theta = theta->valuedouble;
        KVCAP_TRY(json_int(rope, "dim", 0, 0, 4096, where, "model.rope", &g->rope_dim));
        const cJSON *sections = cJSON_GetObjectItemCaseSensitive(rope, "sections");
        if (sections) {
            KVCAP_RETURN_IF(!cJSON_IsArray(sections) ||
                                cJSON_GetArraySize(sections) > KVCAP_MAX_ROPE_SECTIONS,
                            KVCAP_ERR_FORMAT,
                            "%s: model.rope.sections: expected an array of at most %d integers",
                            where, KVCAP_MAX_ROPE_SECTIONS);
            const cJSON *s;
            cJSON_ArrayForEach(s, sections)
            {
                KVCAP_RETURN_IF(!cJSON_IsNumber(s) ||
                                    !kvcap_int_from_double(s->valuedouble, -4096, 4096,
                                                           &g->rope_sections[g->n_rope_sections]),
                                KVCAP_ERR_FORMAT,
                                "%s: model.rope.sections[%d]: expected a small integer", where,
                                g->n_rope_sections);
                g->n_rope_sections++;
            }
        }
    }
    enum kvcap_status st = kvcap_geometry_check(g);
    KVCAP_RETURN_IF(st != KVCAP_OK, st, "%s: %s", where, kvcap_last_error());
    return KVCAP_OK;
}

cJSON *kvcap_buckets_to_json(const struct kvcap_bucket *b, int n)
{
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; arr && i < n; i++) {
        cJSON *o = cJSON_CreateObject();
        if (!o) {
            cJSON_Delete(arr);
            return NULL;
        }
        cJSON_AddNumberToObject(o, "rows", b[i].rows);
        cJSON_AddNumberToObject(o, "cols", b[i].cols);
        cJSON_AddStringToObject(o, "structure", kvcap_structure_name(b[i].structure));
        if (b[i].structure == KVCAP_STRUCTURE_TILED) {
            int tile[2] = {b[i].tile_rows, b[i].tile_cols};
            cJSON_AddItemToObject(o, "tile", cJSON_CreateIntArray(tile, 2));
        }
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}

static int same_bucket(const struct kvcap_bucket *a, const struct kvcap_bucket *b)
{
    return a->rows == b->rows && a->cols == b->cols && a->structure == b->structure &&
           a->tile_rows == b->tile_rows && a->tile_cols == b->tile_cols;
}

enum kvcap_status kvcap_buckets_from_json(const cJSON *arr, const char *where,
                                          struct kvcap_bucket *b, int *n)
{
    *n = 0;
    KVCAP_RETURN_IF(!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) < 1 ||
                        cJSON_GetArraySize(arr) > KVCAP_MAX_BUCKETS,
                    KVCAP_ERR_FORMAT, "%s: buckets: expected an array of 1..%d buckets", where,
                    KVCAP_MAX_BUCKETS);
    const cJSON *o;
    cJSON_ArrayForEach(o, arr)
    {
        int i = *n;
        char field[32];
        snprintf(field, sizeof field, "buckets[%d]", i);
        struct kvcap_bucket *bk = &b[i];
        memset(bk, 0, sizeof *bk);
        KVCAP_RETURN_IF(!cJSON_IsObject(o), KVCAP_ERR_FORMAT, "%s: %s: expected an object",
                        where, field);
        KVCAP_TRY(json_int(o, "rows", 1, 1, 4096, where, field, &bk->rows));
        KVCAP_TRY(json_int(o, "cols", 1, 1, 4096, where, field, &bk->cols));
        const char *structure = json_str(o, "structure");
        KVCAP_RETURN_IF(!structure || !kvcap_structure_parse(structure, &bk->structure),
                        KVCAP_ERR_FORMAT, "%s: %s.structure: '%s' is not dense or tiled", where,
                        field, structure ? structure : "(missing)");
        if (bk->structure == KVCAP_STRUCTURE_TILED) {
            const cJSON *tile = cJSON_GetObjectItemCaseSensitive(o, "tile");
            KVCAP_RETURN_IF(!cJSON_IsArray(tile) || cJSON_GetArraySize(tile) != 2 ||
                                !cJSON_IsNumber(cJSON_GetArrayItem(tile, 0)) ||
                                !cJSON_IsNumber(cJSON_GetArrayItem(tile, 1)),
                            KVCAP_ERR_FORMAT, "%s: %s.tile: expected [rows, cols]", where, field);
            KVCAP_RETURN_IF(
                !kvcap_int_from_double(cJSON_GetArrayItem(tile, 0)->valuedouble, 1, 4096,
                                       &bk->tile_rows) ||
                    !kvcap_int_from_double(cJSON_GetArrayItem(tile, 1)->valuedouble, 1, 4096,
                                           &bk->tile_cols),
                KVCAP_ERR_FORMAT, "%s: %s.tile: expected two integers in 1..4096", where, field);
        }
        enum kvcap_status st = kvcap_bucket_check(bk, field);
        KVCAP_RETURN_IF(st != KVCAP_OK, KVCAP_ERR_FORMAT, "%s: %s", where, kvcap_last_error());
        for (int j = 0; j < i; j++)
            KVCAP_RETURN_IF(same_bucket(&b[j], bk), KVCAP_ERR_FORMAT,
                            "%s: %s: same grid and structure as buckets[%d]", where, field, j);
        (*n)++;
    }
    return KVCAP_OK;
}

enum kvcap_status kvcap_schema_set_meta(struct kvst_writer *w, enum kvcap_file_kind kind,
                                        const cJSON *config)
{
    KVCAP_RETURN_IF(kind == KVCAP_KIND_ANY || !config, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_schema_set_meta: a concrete kind and a config are required");
    char version[16];
    snprintf(version, sizeof version, "%d", newest_version(kind));
    char *text = cJSON_PrintUnformatted(config);
    KVCAP_RETURN_IF(!text, KVCAP_ERR_OUT_OF_MEMORY, "kvcap.config: cannot print JSON");
    enum kvcap_status st = kvst_writer_set_meta(w, "kvcap.kind", kvcap_file_kind_name(kind));
    if (st == KVCAP_OK)
        st = kvst_writer_set_meta(w, "kvcap.format_version", version);
    if (st == KVCAP_OK)
        st = kvst_writer_set_meta(w, "kvcap.config", text);
    cJSON_free(text);
    return st;
}

/* ---- Tensor expectations ------------------------------------------------------------------ */

static void shape_str(char *buf, size_t cap, int ndim, const int64_t *shape)
{
    size_t used = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && used < cap; i++)
        used += (size_t)snprintf(buf + used, cap - used, "%s%lld", i ? ", " : "",
                                 (long long)shape[i]);
    if (used < cap)
        snprintf(buf + used, cap - used, "]");
}

/* Finds `name`; checks its dtype (any float if `dtype` < 0) and, where expected[i] >= 0, its
 * dims. A missing tensor is an error when `required`; *out is NULL then for optional ones. */
static enum kvcap_status expect(const struct kvst_file *f, const char *name, int required,
                                int dtype, int ndim, const int64_t *expected,
                                const struct kvst_tensor **out)
{
    const struct kvst_tensor *t = kvst_find(f, name);
    *out = t;
    if (!t) {
        KVCAP_RETURN_IF(required, KVCAP_ERR_FORMAT, "%s: missing required tensor '%s'",
                        kvst_path(f), name);
        return KVCAP_OK;
    }
    if (dtype < 0) {
        KVCAP_RETURN_IF(!kvcap_dtype_is_storage(t->dtype), KVCAP_ERR_FORMAT,
                        "%s: tensor '%s': dtype %s, expected F32, F16 or BF16", kvst_path(f),
                        name, kvcap_dtype_name(t->dtype));
    } else {
        KVCAP_RETURN_IF(t->dtype != (enum kvcap_dtype)dtype, KVCAP_ERR_FORMAT,
                        "%s: tensor '%s': dtype %s, expected %s", kvst_path(f), name,
                        kvcap_dtype_name(t->dtype), kvcap_dtype_name((enum kvcap_dtype)dtype));
    }
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        ok = expected[i] < 0 ? t->shape[i] >= 1 : t->shape[i] == expected[i];
    if (!ok) {
        char got[128], want[128];
        shape_str(got, sizeof got, t->ndim, t->shape);
        shape_str(want, sizeof want, ndim, expected);
        for (char *p = strstr(want, "-1"); p; p = strstr(p, "-1"))
            memcpy(p, " *", 2); /* show free dims as '*' */
        return kvcap_fail(KVCAP_ERR_FORMAT, "%s: tensor '%s': shape %s, expected %s",
                          kvst_path(f), name, got, want);
    }
    return KVCAP_OK;
}

/* Every value of float tensor `t` (F32, F16, BF16 or F64) is finite: one NaN in a map or a
 * sum would turn every output it touches into NaN with status OK. KVCAP_ERR_NUMERIC naming
 * the tensor and the first bad element. */
static enum kvcap_status expect_finite(const struct kvst_file *f, const struct kvst_tensor *t)
{
    enum { CHUNK = 1024 };
    const unsigned char *data = t->data;
    size_t es = kvcap_dtype_size(t->dtype);
    double v[CHUNK];
    float x[CHUNK];
    for (size_t i0 = 0; i0 < t->n_elements; i0 += CHUNK) {
        size_t n = t->n_elements - i0 < CHUNK ? t->n_elements - i0 : CHUNK;
        if (t->dtype == KVCAP_DTYPE_F64) { /* as doubles: a large finite F64 is no F32 */
            memcpy(v, data + i0 * es, n * es);
        } else {
            KVCAP_TRY(kvcap_convert_to_f32(t->dtype, data + i0 * es, n, x));
            for (size_t i = 0; i < n; i++)
                v[i] = x[i];
        }
        for (size_t i = 0; i < n; i++)
            KVCAP_RETURN_IF(!isfinite(v[i]), KVCAP_ERR_NUMERIC,
                            "%s: tensor '%s': non-finite value %g at element %zu", kvst_path(f),
                            t->name, v[i], i0 + i);
    }
    return KVCAP_OK;
}

/* expect() for a float tensor whose values must also be finite. */
static enum kvcap_status expect_values(const struct kvst_file *f, const char *name, int required,
                                       int dtype, int ndim, const int64_t *expected,
                                       const struct kvst_tensor **out)
{
    KVCAP_TRY(expect(f, name, required, dtype, ndim, expected, out));
    return *out ? expect_finite(f, *out) : KVCAP_OK;
}

/* Parses a leading "s<digits>." span index; -1 if the name does not start like that. */
static long span_index(const char *name)
{
    if (name[0] != 's' || name[1] < '0' || name[1] > '9')
        return -1;
    char *end;
    long i = strtol(name + 1, &end, 10);
    return *end == '.' ? i : -1;
}

static enum kvcap_status check_dataset(const struct kvst_file *f, struct kvcap_file_info *info)
{
    const char *path = kvst_path(f);
    const struct kvcap_model_geometry *g = &info->model;
    const cJSON *ds = json_obj(info->config, "dataset");
    KVCAP_RETURN_IF(!ds, KVCAP_ERR_FORMAT, "%s: kvcap.config: 'dataset' missing", path);
    KVCAP_TRY(json_int(ds, "spans", 1, 0, 100000000, path, "dataset", &info->n_spans));
    for (size_t i = 0; i < kvst_count(f); i++) {
        const char *name = kvst_at(f, i)->name;
        long s = span_index(name);
        KVCAP_RETURN_IF(s >= info->n_spans, KVCAP_ERR_FORMAT,
                        "%s: tensor '%s': span index %ld >= dataset.spans (%d)", path, name, s,
                        info->n_spans);
    }
    char name[NAME_CAP];
    for (int s = 0; s < info->n_spans; s++) {
        const struct kvst_tensor *t;
        snprintf(name, sizeof name, "s%d.grid", s);
        const int64_t grid_shape[1] = {3};
        KVCAP_TRY(expect(f, name, 1, KVCAP_DTYPE_I32, 1, grid_shape, &t));
        int32_t grid[3];
        memcpy(grid, t->data, sizeof grid);
        KVCAP_RETURN_IF(grid[0] < 1 || grid[1] < 1 || grid[0] > 4096 || grid[1] > 4096 ||
                            grid[2] < 0,
                        KVCAP_ERR_FORMAT,
                        "%s: tensor '%s': rows %d, cols %d, p0 %d (need rows, cols in 1..4096, "
                        "p0 >= 0)",
                        path, name, grid[0], grid[1], grid[2]);
        int64_t n = (int64_t)grid[0] * grid[1];
        int has_queries[2] = {-1, -1};
        int64_t query_len[2] = {-1, -1};
        for (int l = 0; l < g->n_layers; l++) {
            const int64_t kv_shape[3] = {g->n_kv_heads, n, g->head_dim};
            const struct kvst_tensor *k, *v;
            snprintf(name, sizeof name, "s%d.l%d.k", s, l);
            KVCAP_TRY(expect(f, name, 1, -1, 3, kv_shape, &k));
            snprintf(name, sizeof name, "s%d.l%d.v", s, l);
            KVCAP_TRY(expect(f, name, 1, k->dtype, 3, kv_shape, &v));
            static const char *const qnames[2] = {"q_post", "q_dec"};
            for (int q = 0; q < 2; q++) {
                const int64_t q_shape[3] = {g->n_q_heads, query_len[q], g->head_dim};
                snprintf(name, sizeof name, "s%d.l%d.%s", s, l, qnames[q]);
                KVCAP_TRY(expect(f, name, has_queries[q] == 1, -1, 3, q_shape, &t));
                KVCAP_RETURN_IF(has_queries[q] == 0 && t, KVCAP_ERR_FORMAT,
                                "%s: tensor '%s': %s present for layer %d but not layer 0",
                                path, name, qnames[q], l);
                if (has_queries[q] < 0) {
                    has_queries[q] = t != NULL;
                    query_len[q] = t ? t->shape[1] : -1;
                }
            }
        }
    }
    return KVCAP_OK;
}

static enum kvcap_status read_buckets(const struct kvst_file *f, struct kvcap_file_info *info)
{
    return kvcap_buckets_from_json(cJSON_GetObjectItemCaseSensitive(info->config, "buckets"),
                                   kvst_path(f), info->buckets, &info->n_buckets);
}

/* The six maps of SPEC §4.3 under `prefix`; `dtype` is the float storage type. Their values
 * must be finite. sizes[0] = R_v and sizes[1] = h, 0 for a map that is absent (only where
 * `required` is 0). */
static enum kvcap_status check_maps(const struct kvst_file *f, const char *prefix, int m,
                                    int dtype, int required, int64_t sizes[2])
{
    char name[NAME_CAP];
    const struct kvst_tensor *u, *mask, *w1, *t;
    const int64_t u_shape[2] = {-1, m};
    sizes[0] = sizes[1] = 0;
    snprintf(name, sizeof name, "%s.U", prefix);
    KVCAP_TRY(expect_values(f, name, required, dtype, 2, u_shape, &u));
    if (u)
        sizes[0] = u->shape[0];
    KVCAP_RETURN_IF(u && u->shape[0] > m, KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': R_v = %lld exceeds the %d points of the bucket",
                    kvst_path(f), name, (long long)u->shape[0], m);
    const int64_t mask_shape[1] = {-1};
    snprintf(name, sizeof name, "%s.k_mask", prefix);
    KVCAP_TRY(expect(f, name, required, KVCAP_DTYPE_I32, 1, mask_shape, &mask));
    if (!mask)
        return KVCAP_OK;
    int64_t rk = mask->shape[0];
    KVCAP_RETURN_IF(rk > m, KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': R_k = %lld exceeds the %d points of the bucket",
                    kvst_path(f), name, (long long)rk, m);
    const int32_t *idx = mask->data;
    for (int64_t i = 0; i < rk; i++)
        KVCAP_RETURN_IF(idx[i] < 0 || idx[i] >= m || (i > 0 && idx[i] <= idx[i - 1]),
                        KVCAP_ERR_FORMAT,
                        "%s: tensor '%s': entry %lld = %d (need strictly increasing in [0, %d))",
                        kvst_path(f), name, (long long)i, idx[i], m);
    const int64_t w1_shape[2] = {rk, -1};
    snprintf(name, sizeof name, "%s.k_w1", prefix);
    KVCAP_TRY(expect_values(f, name, 1, dtype, 2, w1_shape, &w1));
    int64_t h = w1->shape[1];
    sizes[1] = h;
    const int64_t b1_shape[1] = {h}, w2_shape[2] = {h, m}, b2_shape[1] = {m};
    snprintf(name, sizeof name, "%s.k_b1", prefix);
    KVCAP_TRY(expect_values(f, name, 1, dtype, 1, b1_shape, &t));
    snprintf(name, sizeof name, "%s.k_w2", prefix);
    KVCAP_TRY(expect_values(f, name, 1, dtype, 2, w2_shape, &t));
    snprintf(name, sizeof name, "%s.k_b2", prefix);
    KVCAP_TRY(expect_values(f, name, 1, dtype, 1, b2_shape, &t));
    const int64_t act_shape[1] = {1};
    snprintf(name, sizeof name, "%s.k_act", prefix);
    KVCAP_TRY(expect(f, name, 0, KVCAP_DTYPE_U8, 1, act_shape, &t));
    KVCAP_RETURN_IF(t && *(const uint8_t *)t->data > 1, KVCAP_ERR_FORMAT,
                    "%s: tensor '%s': %u is not 0 (identity) or 1 (GELU)", kvst_path(f), name,
                    (unsigned)*(const uint8_t *)t->data);
    return KVCAP_OK;
}

/* `layers` retention ratios in (0, 1] from sched[key]; `field` names sched in messages. */
static enum kvcap_status read_schedule(const cJSON *sched, const char *field, const char *key,
                                       const char *path, int layers, double **out)
{
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(sched, key);
    KVCAP_RETURN_IF(!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) != layers, KVCAP_ERR_FORMAT,
                    "%s: %s.%s: expected %d ratios (one per layer)", path, field, key, layers);
    *out = malloc(sizeof(double) * (size_t)layers);
    KVCAP_RETURN_IF(!*out, KVCAP_ERR_OUT_OF_MEMORY, "%s: schedule: out of memory", path);
    int i = 0;
    const cJSON *r;
    cJSON_ArrayForEach(r, arr)
    {
        KVCAP_RETURN_IF(!cJSON_IsNumber(r) || !(r->valuedouble > 0.0 && r->valuedouble <= 1.0),
                        KVCAP_ERR_FORMAT, "%s: %s.%s[%d]: expected a ratio in (0, 1]", path,
                        field, key, i);
        (*out)[i++] = r->valuedouble;
    }
    return KVCAP_OK;
}

/* calib.spans: one [training, validation] pair of span counts per bucket. */
static enum kvcap_status read_calib_spans(const cJSON *calib, const char *path,
                                          struct kvcap_file_info *info)
{
    const cJSON *spans = cJSON_GetObjectItemCaseSensitive(calib, "spans");
    KVCAP_RETURN_IF(!cJSON_IsArray(spans) || cJSON_GetArraySize(spans) != info->n_buckets,
                    KVCAP_ERR_FORMAT,
                    "%s: calib.spans: expected one [train, validation] pair per bucket (%d)",
                    path, info->n_buckets);
    for (int b = 0; b < info->n_buckets; b++) {
        const cJSON *pair = cJSON_GetArrayItem(spans, b);
        const cJSON *tr = cJSON_GetArrayItem(pair, 0), *va = cJSON_GetArrayItem(pair, 1);
        /* counts are exact in a double up to 2^53 */
        KVCAP_RETURN_IF(!cJSON_IsArray(pair) || cJSON_GetArraySize(pair) != 2 ||
                            !cJSON_IsNumber(tr) || !cJSON_IsNumber(va) ||
                            !kvcap_int64_from_double(tr->valuedouble, 0, INT64_C(1) << 53,
                                                     &info->calib_spans[b][0]) ||
                            !kvcap_int64_from_double(va->valuedouble, 0, INT64_C(1) << 53,
                                                     &info->calib_spans[b][1]),
                        KVCAP_ERR_FORMAT,
                        "%s: calib.spans[%d]: expected [training, validation] as two whole "
                        "numbers >= 0",
                        path, b);
    }
    return KVCAP_OK;
}

/* calib.fit: how the state's key maps were fitted, and the schedule and storage of the
 * artifact kvcap-convert makes from it by default; the limits are the calibration config's. */
static enum kvcap_status read_calib_fit(const cJSON *calib, const char *path,
                                        struct kvcap_file_info *info)
{
    struct kvcap_calib_fit_info *fit = &info->fit;
    const cJSON *obj = json_obj(calib, "fit");
    KVCAP_RETURN_IF(!obj, KVCAP_ERR_FORMAT, "%s: calib.fit: missing or not an object", path);
    const char *method = json_str(obj, "keys_method");
    KVCAP_RETURN_IF(!method || !kvcap_key_method_parse(method, &fit->key_method),
                    KVCAP_ERR_FORMAT,
                    "%s: calib.fit.keys_method: '%s' is not closed_form or trained", path,
                    method ? method : "(missing)");
    const char *act = json_str(obj, "activation");
    KVCAP_RETURN_IF(!act || !kvcap_activation_parse(act, &fit->activation), KVCAP_ERR_FORMAT,
                    "%s: calib.fit.activation: '%s' is not gelu or linear", path,
                    act ? act : "(missing)");
    const char *storage = json_str(obj, "storage");
    KVCAP_RETURN_IF(!storage || !kvcap_dtype_parse(storage, &info->storage) ||
                        !kvcap_dtype_is_storage(info->storage),
                    KVCAP_ERR_FORMAT, "%s: calib.fit.storage: '%s' is not f32, f16 or bf16", path,
                    storage ? storage : "(missing)");
    KVCAP_TRY(json_int(obj, "hidden", 1, 0, 65536, path, "calib.fit", &fit->hidden));
    const cJSON *ridge = cJSON_GetObjectItemCaseSensitive(obj, "ridge");
    KVCAP_RETURN_IF(!cJSON_IsNumber(ridge) || !isfinite(ridge->valuedouble) ||
                        !(ridge->valuedouble >= 0.0),
                    KVCAP_ERR_FORMAT, "%s: calib.fit.ridge: expected a finite number >= 0",
                    path);
    fit->ridge = ridge->valuedouble;
    const cJSON *sched = json_obj(obj, "schedule");
    KVCAP_RETURN_IF(!sched, KVCAP_ERR_FORMAT, "%s: calib.fit.schedule: missing", path);
    KVCAP_TRY(read_schedule(sched, "calib.fit.schedule", "keys", path, info->model.n_layers,
                            &info->schedule_keys));
    return read_schedule(sched, "calib.fit.schedule", "values", path, info->model.n_layers,
                         &info->schedule_values);
}

static enum kvcap_status check_calib(const struct kvst_file *f, struct kvcap_file_info *info)
{
    const char *path = kvst_path(f);
    KVCAP_TRY(read_buckets(f, info));
    const cJSON *calib = json_obj(info->config, "calib");
    KVCAP_RETURN_IF(!calib, KVCAP_ERR_FORMAT, "%s: kvcap.config: 'calib' missing", path);
    KVCAP_TRY(read_calib_spans(calib, path, info));
    KVCAP_TRY(read_calib_fit(calib, path, info));
    const cJSON *metrics = cJSON_GetObjectItemCaseSensitive(calib, "metrics");
    int n_metrics = cJSON_IsArray(metrics) ? cJSON_GetArraySize(metrics) : 0;
    char prefix[NAME_CAP], name[NAME_CAP + 16];
    const struct kvcap_model_geometry *g = &info->model;
    for (int l = 0; l < g->n_layers; l++) {
        for (int h = 0; h < g->n_kv_heads; h++) {
            for (int b = 0; b < info->n_buckets; b++) {
                int m = kvcap_bucket_points(&info->buckets[b]);
                const struct kvst_tensor *t;
                const int64_t gram[2] = {m, m}, vec[1] = {m};
                int64_t sizes[2];
                snprintf(prefix, sizeof prefix, "l%d.h%d.b%d", l, h, b);
                snprintf(name, sizeof name, "%s.v_gram", prefix);
                KVCAP_TRY(expect_values(f, name, 1, KVCAP_DTYPE_F64, 2, gram, &t));
                snprintf(name, sizeof name, "%s.k_gram", prefix);
                KVCAP_TRY(expect_values(f, name, 1, KVCAP_DTYPE_F64, 2, gram, &t));
                snprintf(name, sizeof name, "%s.v_eigval", prefix);
                KVCAP_TRY(expect_values(f, name, 0, KVCAP_DTYPE_F64, 1, vec, &t));
                snprintf(name, sizeof name, "%s.v_eigvec", prefix);
                KVCAP_TRY(expect_values(f, name, 0, KVCAP_DTYPE_F32, 2, gram, &t));
                /* metrics of units never evaluated are NaN by design */
                const int64_t metric_shape[1] = {n_metrics};
                snprintf(name, sizeof name, "%s.metrics", prefix);
                KVCAP_TRY(expect(f, name, 0, KVCAP_DTYPE_F64, 1, metric_shape, &t));
                KVCAP_TRY(check_maps(f, prefix, m, KVCAP_DTYPE_F32, 0, sizes));
            }
        }
    }
    return KVCAP_OK;
}

static enum kvcap_status check_artifact(const struct kvst_file *f, struct kvcap_file_info *info)
{
    const char *path = kvst_path(f);
    KVCAP_TRY(read_buckets(f, info));
    const cJSON *art = json_obj(info->config, "artifact");
    KVCAP_RETURN_IF(!art, KVCAP_ERR_FORMAT, "%s: kvcap.config: 'artifact' missing", path);
    const char *storage = json_str(art, "storage");
    KVCAP_RETURN_IF(!storage || !kvcap_dtype_parse(storage, &info->storage) ||
                        !kvcap_dtype_is_storage(info->storage),
                    KVCAP_ERR_FORMAT, "%s: artifact.storage: '%s' is not f32, f16 or bf16", path,
                    storage ? storage : "(missing)");
    const char *act = json_str(art, "activation");
    KVCAP_RETURN_IF(!act || (strcmp(act, "gelu") != 0 && strcmp(act, "linear") != 0),
                    KVCAP_ERR_FORMAT, "%s: artifact.activation: '%s' is not gelu or linear",
                    path, act ? act : "(missing)");
    info->activation_gelu = strcmp(act, "gelu") == 0;
    const char *fallback = json_str(art, "fallback");
    info->fallback = KVCAP_POLICY_FLASHCACHE;
    KVCAP_RETURN_IF(fallback && (!kvcap_policy_parse(fallback, &info->fallback) ||
                                 info->fallback == KVCAP_POLICY_KVCAPSULE),
                    KVCAP_ERR_FORMAT,
                    "%s: artifact.fallback: '%s' is not a policy usable without a bucket", path,
                    fallback);
    const cJSON *sched = json_obj(art, "schedule");
    KVCAP_RETURN_IF(!sched, KVCAP_ERR_FORMAT, "%s: artifact.schedule: missing", path);
    KVCAP_TRY(read_schedule(sched, "artifact.schedule", "keys", path, info->model.n_layers,
                            &info->schedule_keys));
    KVCAP_TRY(read_schedule(sched, "artifact.schedule", "values", path, info->model.n_layers,
                            &info->schedule_values));
    char prefix[NAME_CAP];
    for (int l = 0; l < info->model.n_layers; l++)
        for (int b = 0; b < info->n_buckets; b++) {
            int64_t head0[2] = {0, 0};
            for (int h = 0; h < info->model.n_kv_heads; h++) {
                int64_t sizes[2];
                snprintf(prefix, sizeof prefix, "l%d.h%d.b%d", l, h, b);
                KVCAP_TRY(check_maps(f, prefix, kvcap_bucket_points(&info->buckets[b]),
                                     (int)info->storage, 1, sizes));
                if (h == 0) {
                    memcpy(head0, sizes, sizeof head0);
                    continue;
                }
                /* A span keeps one block of H (h x d) and Ṽ (R_v x d) per KV head, sized
                 * once for all heads of its layer: the heads of a layer and bucket share h
                 * and R_v (R_k may differ). */
                KVCAP_RETURN_IF(sizes[0] != head0[0], KVCAP_ERR_FORMAT,
                                "%s: tensor '%s.U': R_v = %lld differs from %lld in "
                                "'l%d.h0.b%d.U' (the KV heads of a layer share R_v)",
                                path, prefix, (long long)sizes[0], (long long)head0[0], l, b);
                KVCAP_RETURN_IF(sizes[1] != head0[1], KVCAP_ERR_FORMAT,
                                "%s: tensor '%s.k_w1': h = %lld differs from %lld in "
                                "'l%d.h0.b%d.k_w1' (the KV heads of a layer share h)",
                                path, prefix, (long long)sizes[1], (long long)head0[1], l, b);
            }
        }
    return KVCAP_OK;
}

enum kvcap_status kvcap_schema_check(const struct kvst_file *f, enum kvcap_file_kind expected,
                                     struct kvcap_file_info *info)
{
    KVCAP_RETURN_IF(!f || !info, KVCAP_ERR_INVALID_ARGUMENT, "kvcap_schema_check: NULL argument");
    memset(info, 0, sizeof *info);
    const char *path = kvst_path(f);
    const char *kind = kvst_meta(f, "kvcap.kind");
    KVCAP_RETURN_IF(!kind, KVCAP_ERR_FORMAT,
                    "%s: __metadata__: missing key 'kvcap.kind' (not a kvcap file)", path);
    int k;
    for (k = 0; k < KVCAP_KIND_ANY; k++)
        if (strcmp(kind, kvcap_file_kind_name((enum kvcap_file_kind)k)) == 0)
            break;
    KVCAP_RETURN_IF(k == KVCAP_KIND_ANY, KVCAP_ERR_FORMAT,
                    "%s: kvcap.kind: '%s' is not dataset, calib or artifact", path, kind);
    info->kind = (enum kvcap_file_kind)k;
    KVCAP_RETURN_IF(expected != KVCAP_KIND_ANY && info->kind != expected, KVCAP_ERR_FORMAT,
                    "%s: kvcap.kind: '%s', expected '%s'", path, kind,
                    kvcap_file_kind_name(expected));
    const char *version = kvst_meta(f, "kvcap.format_version");
    KVCAP_RETURN_IF(!version, KVCAP_ERR_FORMAT, "%s: __metadata__: missing key "
                    "'kvcap.format_version'", path);
    char *end;
    long v = strtol(version, &end, 10);
    KVCAP_RETURN_IF(end == version || *end != '\0' || v < 1 || v > 1000000, KVCAP_ERR_FORMAT,
                    "%s: kvcap.format_version: '%s' is not an integer >= 1", path, version);
    int newest = newest_version(info->kind);
    KVCAP_RETURN_IF(v > newest, KVCAP_ERR_VERSION,
                    "%s: kvcap.format_version: %ld is newer than this kvcap reads for kind '%s' "
                    "(%d); upgrade kvcap",
                    path, v, kind, newest);
    info->format_version = (int)v;
    const char *config = kvst_meta(f, "kvcap.config");
    KVCAP_RETURN_IF(!config, KVCAP_ERR_FORMAT, "%s: __metadata__: missing key 'kvcap.config'",
                    path);
    info->config = cJSON_Parse(config);
    KVCAP_RETURN_IF(!cJSON_IsObject(info->config), KVCAP_ERR_FORMAT,
                    "%s: kvcap.config: not a JSON object", path);
    KVCAP_TRY(kvcap_geometry_from_json(cJSON_GetObjectItemCaseSensitive(info->config, "model"),
                                       path, &info->model));
    switch (info->kind) {
    case KVCAP_KIND_DATASET: return check_dataset(f, info);
    case KVCAP_KIND_CALIB: return check_calib(f, info);
    case KVCAP_KIND_ARTIFACT: return check_artifact(f, info);
    case KVCAP_KIND_ANY: break;
    }
    return kvcap_fail(KVCAP_ERR_INTERNAL, "%s: unreachable kind", path);
}

void kvcap_file_info_free(struct kvcap_file_info *info)
{
    if (!info)
        return;
    cJSON_Delete(info->config);
    free(info->schedule_keys);
    free(info->schedule_values);
    memset(info, 0, sizeof *info);
}
