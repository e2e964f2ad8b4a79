/* dataset.c — writing recorded spans into size-bounded shards and streaming them back
 * (formats/SPEC.md §4.1). */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "formats/dataset.h"
#include "common/internal.h"
#include "formats/schema.h"

#define TENSOR_NAME_CAP 48
#define PATH_CAP 4096

/* ---- Writer ----------------------------------------------------------------------------- */

struct pending {
    char name[TENSOR_NAME_CAP];
    enum kvcap_dtype dtype;
    int ndim;
    int64_t shape[3];
    void *data;
};

struct query_buf {
    float *data; /* [count][q_heads][head_dim], token-major so appending is a copy */
    int count, cap;
};

struct kvcap_dataset_writer {
    struct kvcap_model_geometry g;
    char dir[PATH_CAP];
    char prefix[64];
    char *source;
    enum kvcap_dtype dtype;
    uint64_t shard_bytes;
    /* the open span */
    int open, rows, cols, p0, n;
    float **k, **v;             /* [n_layers], NULL until set */
    struct query_buf *q[2];     /* [n_layers] per query kind */
    /* spans queued for the next shard */
    struct pending *queue;
    size_t n_queue, cap_queue;
    uint64_t queued_bytes;
    int queued_spans;
    int first_shard, next_shard, shards_written; /* this writer's shards: first..next-1 */
    int64_t spans_written;
};

void kvcap_dataset_writer_default_params(struct kvcap_dataset_writer_params *p)
{
    memset(p, 0, sizeof *p);
    p->prefix = "shard";
    p->dtype = KVCAP_DTYPE_F16;
    p->shard_bytes = 256ull << 20;
}

/* The number N of DIR/PREFIX-N.safetensors, or -1 for any other name. */
static long shard_number(const char *name, const char *prefix)
{
    size_t lp = strlen(prefix);
    if (strncmp(name, prefix, lp) != 0 || name[lp] != '-')
        return -1;
    char *end;
    const char *digits = name + lp + 1;
    if (*digits < '0' || *digits > '9')
        return -1;
    long n = strtol(digits, &end, 10);
    return strcmp(end, ".safetensors") == 0 ? n : -1;
}

static void free_span(struct kvcap_dataset_writer *w)
{
    for (int l = 0; l < w->g.n_layers; l++) {
        free(w->k[l]);
        free(w->v[l]);
        w->k[l] = w->v[l] = NULL;
        for (int q = 0; q < 2; q++) {
            free(w->q[q][l].data);
            memset(&w->q[q][l], 0, sizeof w->q[q][l]);
        }
    }
    w->open = 0;
}

static void free_queue(struct kvcap_dataset_writer *w)
{
    for (size_t i = 0; i < w->n_queue; i++)
        free(w->queue[i].data);
    w->n_queue = 0;
    w->queued_bytes = 0;
    w->queued_spans = 0;
}

enum kvcap_status kvcap_dataset_writer_create(const struct kvcap_model_geometry *g,
                                              const struct kvcap_dataset_writer_params *p,
                                              struct kvcap_dataset_writer **out)
{
    KVCAP_RETURN_IF(!g || !p || !out || !p->dir, KVCAP_ERR_INVALID_ARGUMENT,
                    "dataset writer: geometry, params, params.dir and out are required");
    *out = NULL;
    KVCAP_TRY(kvcap_geometry_validate(g));
    KVCAP_RETURN_IF(p->dtype != KVCAP_DTYPE_F32 && p->dtype != KVCAP_DTYPE_F16 &&
                        p->dtype != KVCAP_DTYPE_BF16,
                    KVCAP_ERR_INVALID_ARGUMENT, "dataset writer: dtype %s is not F32, F16 or BF16",
                    kvcap_dtype_name(p->dtype));
    const char *prefix = p->prefix ? p->prefix : "shard";
    KVCAP_RETURN_IF(strlen(prefix) < 1 || strlen(prefix) >= 64 || strchr(prefix, '/'),
                    KVCAP_ERR_INVALID_ARGUMENT, "dataset writer: prefix '%s' is not a plain name",
                    prefix);
    KVCAP_TRY(kvcap_make_dirs(p->dir));

    struct kvcap_dataset_writer *w = calloc(1, sizeof *w);
    int L = g->n_layers;
    if (w) {
        w->k = calloc((size_t)L, sizeof *w->k);
        w->v = calloc((size_t)L, sizeof *w->v);
        w->q[0] = calloc((size_t)L, sizeof *w->q[0]);
        w->q[1] = calloc((size_t)L, sizeof *w->q[1]);
        w->source = p->source ? strdup(p->source) : NULL;
    }
    if (!w || !w->k || !w->v || !w->q[0] || !w->q[1] || (p->source && !w->source)) {
        kvcap_dataset_writer_free(w);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "dataset writer: out of memory");
    }
    w->g = *g;
    snprintf(w->dir, sizeof w->dir, "%s", p->dir);
    snprintf(w->prefix, sizeof w->prefix, "%s", prefix);
    w->dtype = p->dtype;
    w->shard_bytes = p->shard_bytes ? p->shard_bytes : (256ull << 20);
    DIR *d = opendir(p->dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            long num = shard_number(e->d_name, w->prefix);
            if (num >= w->next_shard)
                w->next_shard = (int)num + 1;
        }
        closedir(d);
    }
    w->first_shard = w->next_shard;
    *out = w;
    return KVCAP_OK;
}

enum kvcap_status kvcap_dataset_check_grid(const char *what, int rows, int cols, int p0)
{
    KVCAP_RETURN_IF(rows < 1 || rows > KVCAP_DATASET_MAX_SIDE, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s.rows: %d is outside 1..%d, the grids a dataset shard can hold", what,
                    rows, KVCAP_DATASET_MAX_SIDE);
    KVCAP_RETURN_IF(cols < 1 || cols > KVCAP_DATASET_MAX_SIDE, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s.cols: %d is outside 1..%d, the grids a dataset shard can hold", what,
                    cols, KVCAP_DATASET_MAX_SIDE);
    KVCAP_RETURN_IF(p0 < 0, KVCAP_ERR_INVALID_ARGUMENT, "%s.p0: %d is negative", what, p0);
    return KVCAP_OK;
}

enum kvcap_status kvcap_dataset_writer_begin_span(struct kvcap_dataset_writer *w, int rows,
                                                  int cols, int p0)
{
    KVCAP_RETURN_IF(!w, KVCAP_ERR_INVALID_ARGUMENT, "dataset writer: NULL writer");
    KVCAP_RETURN_IF(w->open, KVCAP_ERR_STATE, "dataset writer: previous span not ended");
    KVCAP_TRY(kvcap_dataset_check_grid("dataset writer: span", rows, cols, p0));
    w->open = 1;
    w->rows = rows;
    w->cols = cols;
    w->p0 = p0;
    w->n = rows * cols;
    return KVCAP_OK;
}

static float *copy_floats(const float *src, size_t n)
{
    float *dst = malloc(n * sizeof *dst);
    if (dst)
        memcpy(dst, src, n * sizeof *dst);
    return dst;
}

enum kvcap_status kvcap_dataset_writer_set_kv(struct kvcap_dataset_writer *w, int layer,
                                              const float *k, const float *v)
{
    KVCAP_RETURN_IF(!w || !k || !v, KVCAP_ERR_INVALID_ARGUMENT, "dataset writer: NULL argument");
    KVCAP_RETURN_IF(!w->open, KVCAP_ERR_STATE, "dataset writer: set_kv outside a span");
    KVCAP_RETURN_IF(layer < 0 || layer >= w->g.n_layers, KVCAP_ERR_INVALID_ARGUMENT,
                    "dataset writer: layer %d outside 0..%d", layer, w->g.n_layers - 1);
    size_t elems = (size_t)w->g.n_kv_heads * (size_t)w->n * (size_t)w->g.head_dim;
    float *kc = copy_floats(k, elems), *vc = copy_floats(v, elems);
    if (!kc || !vc) {
        free(kc);
        free(vc);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "dataset writer: out of memory");
    }
    free(w->k[layer]);
    free(w->v[layer]);
    w->k[layer] = kc;
    w->v[layer] = vc;
    return KVCAP_OK;
}

enum kvcap_status kvcap_dataset_writer_add_queries(struct kvcap_dataset_writer *w, int layer,
                                                   enum kvcap_query_kind kind, const float *q,
                                                   int count)
{
    KVCAP_RETURN_IF(!w || !q, KVCAP_ERR_INVALID_ARGUMENT, "dataset writer: NULL argument");
    KVCAP_RETURN_IF(!w->open, KVCAP_ERR_STATE, "dataset writer: add_queries outside a span");
    KVCAP_RETURN_IF(layer < 0 || layer >= w->g.n_layers || (kind != KVCAP_QUERIES_POST &&
                                                            kind != KVCAP_QUERIES_DECODE) ||
                        count < 1 || count > 1000000,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "dataset writer: add_queries(layer %d, kind %d, count %d) out of range",
                    layer, (int)kind, count);
    struct query_buf *b = &w->q[kind][layer];
    size_t row = (size_t)w->g.n_q_heads * (size_t)w->g.head_dim;
    if (b->count + count > b->cap) {
        int cap = b->cap ? b->cap : 16;
        while (cap < b->count + count)
            cap *= 2;
        float *grown = realloc(b->data, (size_t)cap * row * sizeof *grown);
        KVCAP_RETURN_IF(!grown, KVCAP_ERR_OUT_OF_MEMORY, "dataset writer: out of memory");
        b->data = grown;
        b->cap = cap;
    }
    size_t d = (size_t)w->g.head_dim;
    for (int t = 0; t < count; t++)
        for (int h = 0; h < w->g.n_q_heads; h++)
            memcpy(b->data + (size_t)(b->count + t) * row + (size_t)h * d,
                   q + ((size_t)h * (size_t)count + (size_t)t) * d, d * sizeof(float));
    b->count += count;
    return KVCAP_OK;
}

/* Converts `src` (f32) into a newly queued tensor of the writer's dtype. */
static enum kvcap_status queue_tensor(struct kvcap_dataset_writer *w, const char *name,
                                      enum kvcap_dtype dtype, int ndim, const int64_t *shape,
                                      const void *src)
{
    if (w->n_queue == w->cap_queue) {
        size_t cap = w->cap_queue ? 2 * w->cap_queue : 64;
        struct pending *grown = realloc(w->queue, cap * sizeof *grown);
        KVCAP_RETURN_IF(!grown, KVCAP_ERR_OUT_OF_MEMORY, "dataset writer: out of memory");
        w->queue = grown;
        w->cap_queue = cap;
    }
    size_t elems = 1;
    for (int i = 0; i < ndim; i++)
        elems *= (size_t)shape[i];
    size_t bytes = elems * kvcap_dtype_size(dtype);
    struct pending *p = &w->queue[w->n_queue];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    p->dtype = dtype;
    p->ndim = ndim;
    memcpy(p->shape, shape, (size_t)ndim * sizeof *shape);
    p->data = malloc(bytes ? bytes : 1);
    KVCAP_RETURN_IF(!p->data, KVCAP_ERR_OUT_OF_MEMORY, "dataset writer: out of memory");
    if (dtype == KVCAP_DTYPE_I32) {
        memcpy(p->data, src, bytes);
    } else {
        enum kvcap_status st = kvcap_convert_from_f32(dtype, src, elems, p->data);
        if (st != KVCAP_OK) {
            free(p->data);
            return st;
        }
    }
    w->n_queue++;
    w->queued_bytes += bytes;
    return KVCAP_OK;
}

enum kvcap_status kvcap_dataset_writer_end_span(struct kvcap_dataset_writer *w)
{
    KVCAP_RETURN_IF(!w, KVCAP_ERR_INVALID_ARGUMENT, "dataset writer: NULL writer");
    KVCAP_RETURN_IF(!w->open, KVCAP_ERR_STATE, "dataset writer: end_span without begin_span");
    const struct kvcap_model_geometry *g = &w->g;
    static const char *const qnames[2] = {"q_post", "q_dec"};
    for (int l = 0; l < g->n_layers; l++) {
        KVCAP_RETURN_IF(!w->k[l], KVCAP_ERR_STATE, "dataset writer: span has no K/V for layer %d",
                        l);
        for (int q = 0; q < 2; q++)
            KVCAP_RETURN_IF(w->q[q][l].count != w->q[q][0].count, KVCAP_ERR_STATE,
                            "dataset writer: %s: layer %d has %d queries, layer 0 has %d",
                            qnames[q], l, w->q[q][l].count, w->q[q][0].count);
    }
    int s = w->queued_spans;
    size_t first = w->n_queue;
    uint64_t first_bytes = w->queued_bytes;
    char name[TENSOR_NAME_CAP];
    enum kvcap_status st;
    int32_t grid[3] = {w->rows, w->cols, w->p0};
    const int64_t grid_shape[1] = {3};
    snprintf(name, sizeof name, "s%d.grid", s);
    st = queue_tensor(w, name, KVCAP_DTYPE_I32, 1, grid_shape, grid);
    const int64_t kv_shape[3] = {g->n_kv_heads, w->n, g->head_dim};
    float *tmp = NULL;
    for (int l = 0; st == KVCAP_OK && l < g->n_layers; l++) {
        snprintf(name, sizeof name, "s%d.l%d.k", s, l);
        st = queue_tensor(w, name, w->dtype, 3, kv_shape, w->k[l]);
        snprintf(name, sizeof name, "s%d.l%d.v", s, l);
        if (st == KVCAP_OK)
            st = queue_tensor(w, name, w->dtype, 3, kv_shape, w->v[l]);
        for (int q = 0; st == KVCAP_OK && q < 2; q++) {
            const struct query_buf *b = &w->q[q][l];
            if (b->count == 0)
                continue;
            size_t d = (size_t)g->head_dim, total = (size_t)b->count * (size_t)g->n_q_heads * d;
            float *grown = realloc(tmp, total * sizeof *tmp);
            if (!grown) {
                st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "dataset writer: out of memory");
                break;
            }
            tmp = grown;
            /* token-major [count][heads][d] back to the file's [heads][count][d] */
            for (int t = 0; t < b->count; t++)
                for (int h = 0; h < g->n_q_heads; h++)
                    memcpy(tmp + ((size_t)h * (size_t)b->count + (size_t)t) * d,
                           b->data + ((size_t)t * (size_t)g->n_q_heads + (size_t)h) * d,
                           d * sizeof(float));
            const int64_t q_shape[3] = {g->n_q_heads, b->count, g->head_dim};
            snprintf(name, sizeof name, "s%d.l%d.%s", s, l, qnames[q]);
            st = queue_tensor(w, name, w->dtype, 3, q_shape, tmp);
        }
    }
    free(tmp);
    if (st != KVCAP_OK) { /* drop this span's partial tensors; the span stays open */
        while (w->n_queue > first)
            free(w->queue[--w->n_queue].data);
        w->queued_bytes = first_bytes;
        return st;
    }
    free_span(w);
    w->queued_spans++;
    if (w->queued_bytes >= w->shard_bytes)
        return kvcap_dataset_writer_flush(w);
    return KVCAP_OK;
}

void kvcap_dataset_writer_cancel_span(struct kvcap_dataset_writer *w)
{
    if (w && w->open)
        free_span(w);
}

enum kvcap_status kvcap_dataset_writer_flush(struct kvcap_dataset_writer *w)
{
    KVCAP_RETURN_IF(!w, KVCAP_ERR_INVALID_ARGUMENT, "dataset writer: NULL writer");
    if (w->queued_spans == 0)
        return KVCAP_OK;
    struct kvst_writer *out = NULL;
    cJSON *config = cJSON_CreateObject();
    enum kvcap_status st = config ? kvst_writer_create(&out)
                                  : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "dataset writer: OOM");
    for (size_t i = 0; st == KVCAP_OK && i < w->n_queue; i++) {
        const struct pending *p = &w->queue[i];
        st = kvst_writer_add(out, p->name, p->dtype, p->ndim, p->shape, p->data);
    }
    if (st == KVCAP_OK) {
        cJSON_AddItemToObject(config, "model", kvcap_geometry_to_json(&w->g));
        cJSON *ds = cJSON_AddObjectToObject(config, "dataset");
        cJSON_AddNumberToObject(ds, "spans", w->queued_spans);
        if (w->source)
            cJSON_AddStringToObject(ds, "source", w->source);
        cJSON *prov = cJSON_AddObjectToObject(config, "provenance");
        char tool[48];
        snprintf(tool, sizeof tool, "kvcap %s", kvcap_version());
        cJSON_AddStringToObject(prov, "tool", tool);
        st = kvcap_schema_set_meta(out, KVCAP_KIND_DATASET, config);
    }
    char path[PATH_CAP + 96];
    snprintf(path, sizeof path, "%s/%s-%05d.safetensors", w->dir, w->prefix, w->next_shard);
    if (st == KVCAP_OK)
        st = kvst_writer_commit(out, path);
    kvst_writer_free(out);
    cJSON_Delete(config);
    if (st != KVCAP_OK)
        return st;
    w->spans_written += w->queued_spans;
    w->shards_written++;
    w->next_shard++;
    free_queue(w);
    return KVCAP_OK;
}

void kvcap_dataset_writer_discard(struct kvcap_dataset_writer *w)
{
    if (!w)
        return;
    kvcap_dataset_writer_cancel_span(w);
    free_queue(w);
    for (int i = w->first_shard; i < w->next_shard; i++) {
        char path[PATH_CAP + 96];
        snprintf(path, sizeof path, "%s/%s-%05d.safetensors", w->dir, w->prefix, i);
        if (unlink(path) != 0 && errno != ENOENT)
            kvcap_log(KVCAP_LOG_WARN, "%s: cannot remove this partial output: %s", path,
                      strerror(errno));
    }
    w->first_shard = w->next_shard;
    w->spans_written = 0;
    w->shards_written = 0;
}

void kvcap_dataset_writer_counts(const struct kvcap_dataset_writer *w, int64_t *spans,
                                 int *shards)
{
    if (spans)
        *spans = w ? w->spans_written : 0;
    if (shards)
        *shards = w ? w->shards_written : 0;
}

void kvcap_dataset_writer_free(struct kvcap_dataset_writer *w)
{
    if (!w)
        return;
    if (w->k && w->v && w->q[0] && w->q[1])
        free_span(w);
    free_queue(w);
    free(w->queue);
    free(w->k);
    free(w->v);
    free(w->q[0]);
    free(w->q[1]);
    free(w->source);
    free(w);
}

/* ---- Reader ----------------------------------------------------------------------------- */

struct shard {
    char *path;
    int spans;
};

struct kvcap_dataset {
    struct kvcap_model_geometry g;
    struct shard *shards;
    int n_shards, cap_shards;
    int64_t total;
    /* iteration */
    int cur_shard, cur_index;
    int64_t ordinal;
    struct kvst_file *file;
    struct kvcap_span_view view;
    const struct kvst_tensor **views; /* 4 * n_layers */
};

static enum kvcap_status add_shard(struct kvcap_dataset *ds, const char *path)
{
    struct kvst_file *f = NULL;
    KVCAP_TRY(kvst_open(path, &f));
    struct kvcap_file_info info;
    enum kvcap_status st = kvcap_schema_check(f, KVCAP_KIND_DATASET, &info);
    const char *diff = st == KVCAP_OK && ds->n_shards > 0
                           ? kvcap_geometry_difference(&ds->g, &info.model)
                           : NULL;
    if (diff)
        st = kvcap_fail(KVCAP_ERR_GEOMETRY,
                        "%s: model geometry differs from the first shard %s in %s (every shard of "
                        "a dataset must come from the same model)",
                        path, ds->shards[0].path, diff);
    if (st == KVCAP_OK && ds->n_shards == ds->cap_shards) {
        int cap = ds->cap_shards ? 2 * ds->cap_shards : 16;
        struct shard *grown = realloc(ds->shards, (size_t)cap * sizeof *grown);
        if (!grown)
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "dataset: out of memory");
        else {
            ds->shards = grown;
            ds->cap_shards = cap;
        }
    }
    if (st == KVCAP_OK) {
        char *copy = strdup(path);
        if (!copy)
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "dataset: out of memory");
        else {
            if (ds->n_shards == 0)
                ds->g = info.model;
            ds->shards[ds->n_shards++] = (struct shard){copy, info.n_spans};
            ds->total += info.n_spans;
        }
    }
    kvcap_file_info_free(&info);
    kvst_close(f);
    return st;
}

static int compare_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static enum kvcap_status add_folder(struct kvcap_dataset *ds, const char *dir)
{
    DIR *d = opendir(dir);
    KVCAP_RETURN_IF(!d, KVCAP_ERR_IO, "%s: cannot open folder: %s", dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    enum kvcap_status st = KVCAP_OK;
    struct dirent *e;
    while (st == KVCAP_OK && (e = readdir(d)) != NULL) {
        size_t len = strlen(e->d_name);
        if (len <= 12 || strcmp(e->d_name + len - 12, ".safetensors") != 0)
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            char **grown = realloc(names, cap * sizeof *grown);
            if (!grown) {
                st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "dataset: out of memory");
                break;
            }
            names = grown;
        }
        names[n] = malloc(strlen(dir) + len + 2);
        if (!names[n]) {
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "dataset: out of memory");
            break;
        }
        sprintf(names[n++], "%s/%s", dir, e->d_name);
    }
    closedir(d);
    if (names)
        qsort(names, n, sizeof *names, compare_names);
    for (size_t i = 0; i < n; i++) {
        if (st == KVCAP_OK)
            st = add_shard(ds, names[i]);
        free(names[i]);
    }
    free(names);
    return st;
}

enum kvcap_status kvcap_dataset_open(const char *const *paths, int n_paths,
                                     struct kvcap_dataset **out)
{
    KVCAP_RETURN_IF(!out || (!paths && n_paths > 0) || n_paths < 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "dataset: NULL argument");
    *out = NULL;
    KVCAP_RETURN_IF(n_paths == 0, KVCAP_ERR_INVALID_ARGUMENT, "dataset: no input path given");
    struct kvcap_dataset *ds = calloc(1, sizeof *ds);
    KVCAP_RETURN_IF(!ds, KVCAP_ERR_OUT_OF_MEMORY, "dataset: out of memory");
    enum kvcap_status st = KVCAP_OK;
    for (int i = 0; st == KVCAP_OK && i < n_paths; i++) {
        struct stat sb;
        if (stat(paths[i], &sb) != 0)
            st = kvcap_fail(KVCAP_ERR_IO, "%s: %s", paths[i], strerror(errno));
        else if (S_ISDIR(sb.st_mode))
            st = add_folder(ds, paths[i]);
        else
            st = add_shard(ds, paths[i]);
    }
    if (st == KVCAP_OK && ds->total == 0)
        st = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                        "dataset: empty (%d shard%s, no span) under %s%s", ds->n_shards,
                        ds->n_shards == 1 ? "" : "s", paths[0], n_paths > 1 ? " ..." : "");
    if (st == KVCAP_OK) {
        ds->views = calloc(4 * (size_t)ds->g.n_layers, sizeof *ds->views);
        if (!ds->views)
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "dataset: out of memory");
    }
    if (st != KVCAP_OK) {
        kvcap_dataset_close(ds);
        return st;
    }
    int L = ds->g.n_layers;
    ds->view.k = ds->views;
    ds->view.v = ds->views + L;
    ds->view.q_post = ds->views + 2 * L;
    ds->view.q_dec = ds->views + 3 * L;
    *out = ds;
    return KVCAP_OK;
}

void kvcap_dataset_close(struct kvcap_dataset *ds)
{
    if (!ds)
        return;
    kvst_close(ds->file);
    for (int i = 0; i < ds->n_shards; i++)
        free(ds->shards[i].path);
    free(ds->shards);
    free(ds->views);
    free(ds);
}

const struct kvcap_model_geometry *kvcap_dataset_geometry(const struct kvcap_dataset *ds)
{
    return &ds->g;
}

int64_t kvcap_dataset_span_count(const struct kvcap_dataset *ds)
{
    return ds->total;
}

int kvcap_dataset_shard_count(const struct kvcap_dataset *ds)
{
    return ds->n_shards;
}

void kvcap_dataset_rewind(struct kvcap_dataset *ds)
{
    kvst_close(ds->file);
    ds->file = NULL;
    ds->cur_shard = 0;
    ds->cur_index = 0;
    ds->ordinal = 0;
}

enum kvcap_status kvcap_dataset_next(struct kvcap_dataset *ds, const struct kvcap_span_view **span)
{
    KVCAP_RETURN_IF(!ds || !span, KVCAP_ERR_INVALID_ARGUMENT, "dataset: NULL argument");
    *span = NULL;
    while (!ds->file || ds->cur_index >= ds->shards[ds->cur_shard].spans) {
        if (ds->file) {
            kvst_close(ds->file);
            ds->file = NULL;
            ds->cur_shard++;
            ds->cur_index = 0;
        }
        if (ds->cur_shard >= ds->n_shards)
            return KVCAP_OK;
        /* Re-validate: the file may have changed since kvcap_dataset_open. */
        const struct shard *sh = &ds->shards[ds->cur_shard];
        KVCAP_TRY(kvst_open(sh->path, &ds->file));
        struct kvcap_file_info info;
        enum kvcap_status st = kvcap_schema_check(ds->file, KVCAP_KIND_DATASET, &info);
        if (st == KVCAP_OK && (info.n_spans != sh->spans || kvcap_geometry_difference(&info.model, &ds->g)))
            st = kvcap_fail(KVCAP_ERR_FORMAT, "%s: changed while the dataset was open", sh->path);
        kvcap_file_info_free(&info);
        if (st != KVCAP_OK) {
            kvst_close(ds->file);
            ds->file = NULL;
            return st;
        }
    }
    int s = ds->cur_index++;
    char name[TENSOR_NAME_CAP];
    snprintf(name, sizeof name, "s%d.grid", s);
    int32_t grid[3];
    memcpy(grid, kvst_find(ds->file, name)->data, sizeof grid);
    struct kvcap_span_view *v = &ds->view;
    v->shard = ds->shards[ds->cur_shard].path;
    v->index = s;
    v->ordinal = ds->ordinal++;
    v->rows = grid[0];
    v->cols = grid[1];
    v->p0 = grid[2];
    v->n = grid[0] * grid[1];
    for (int l = 0; l < ds->g.n_layers; l++) {
        snprintf(name, sizeof name, "s%d.l%d.k", s, l);
        v->k[l] = kvst_find(ds->file, name);
        snprintf(name, sizeof name, "s%d.l%d.v", s, l);
        v->v[l] = kvst_find(ds->file, name);
        snprintf(name, sizeof name, "s%d.l%d.q_post", s, l);
        v->q_post[l] = kvst_find(ds->file, name);
        snprintf(name, sizeof name, "s%d.l%d.q_dec", s, l);
        v->q_dec[l] = kvst_find(ds->file, name);
    }
    *span = v;
    return KVCAP_OK;
}
