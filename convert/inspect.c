/* inspect.c — `kvcap-convert --inspect`: a human-readable account of any kvcap file (kind,
 * version, geometry, buckets, schedule, tensors) that also validates it, with the validator
 * the readers use (kvcap_schema_check), so a file it passes opens everywhere. */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "convert/inspect.h"
#include "common/internal.h"
#include "formats/schema.h"

static void print_model(const struct kvcap_model_geometry *g)
{
    printf("model      %s%s%d layers, %d query heads / %d KV heads (G=%d), head_dim %d\n",
           g->name, g->name[0] ? ": " : "", g->n_layers, g->n_q_heads, g->n_kv_heads,
           g->n_q_heads / g->n_kv_heads, g->head_dim);
    printf("rope       %s", kvcap_rope_type_name(g->rope_type));
    if (g->rope_type != KVCAP_ROPE_NONE) {
        printf(", %s pairing, theta %g, %d rotated channels", kvcap_rope_pairing_name(g->rope_pairing),
               g->rope_theta, g->rope_dim ? g->rope_dim : g->head_dim);
        for (int i = 0; i < g->n_rope_sections; i++)
            printf("%s%d", i ? "/" : ", sections ", g->rope_sections[i]);
    }
    printf("\n");
}

static void print_buckets(const struct kvcap_file_info *info)
{
    for (int b = 0; b < info->n_buckets; b++) {
        const struct kvcap_bucket *bk = &info->buckets[b];
        printf("%s%d: %dx%d %s", b ? "           " : "buckets    ", b, bk->rows, bk->cols,
               kvcap_structure_name(bk->structure));
        if (bk->structure == KVCAP_STRUCTURE_TILED)
            printf(" %dx%d (%d tiles of %d tokens)", bk->tile_rows, bk->tile_cols,
                   bk->rows * bk->cols / kvcap_bucket_points(bk), kvcap_bucket_points(bk));
        else
            printf(" (%d tokens)", bk->rows * bk->cols);
        printf("\n");
    }
}

static void schedule_summary(const char *what, const double *r, int n)
{
    double sum = 0.0, lo = r[0], hi = r[0];
    for (int i = 0; i < n; i++) {
        sum += r[i];
        lo = r[i] < lo ? r[i] : lo;
        hi = r[i] > hi ? r[i] : hi;
    }
    printf("%s mean r %.3f (first %.3f, last %.3f, min %.3f, max %.3f)\n", what, sum / n, r[0],
           r[n - 1], lo, hi);
}

static void print_dataset(const struct kvst_file *f, const struct kvcap_file_info *info)
{
    enum { MAX_GRIDS = 8 };
    int grids[MAX_GRIDS][3] = {{0}}, n_grids = 0, other = 0;
    int32_t p0_min = 0, p0_max = 0;
    int with_post = 0, with_dec = 0;
    char name[64];
    for (int s = 0; s < info->n_spans; s++) {
        snprintf(name, sizeof name, "s%d.grid", s);
        int32_t g[3];
        memcpy(g, kvst_find(f, name)->data, sizeof g);
        p0_min = s == 0 || g[2] < p0_min ? g[2] : p0_min;
        p0_max = s == 0 || g[2] > p0_max ? g[2] : p0_max;
        int i;
        for (i = 0; i < n_grids; i++)
            if (grids[i][0] == g[0] && grids[i][1] == g[1])
                break;
        if (i < n_grids)
            grids[i][2]++;
        else if (n_grids < MAX_GRIDS)
            grids[n_grids][0] = g[0], grids[n_grids][1] = g[1], grids[n_grids++][2] = 1;
        else
            other++;
        snprintf(name, sizeof name, "s%d.l0.q_post", s);
        with_post += kvst_find(f, name) != NULL;
        snprintf(name, sizeof name, "s%d.l0.q_dec", s);
        with_dec += kvst_find(f, name) != NULL;
    }
    printf("spans      %d", info->n_spans);
    if (info->n_spans) {
        const struct kvst_tensor *k = kvst_find(f, "s0.l0.k");
        printf(" (K/V %s, p0 %d..%d)", kvcap_dtype_name(k->dtype), p0_min, p0_max);
    }
    printf("\n");
    for (int i = 0; i < n_grids; i++)
        printf("%s%dx%d: %d span%s\n", i ? "           " : "grids      ", grids[i][0],
               grids[i][1], grids[i][2], grids[i][2] == 1 ? "" : "s");
    if (other)
        printf("           other grids: %d spans\n", other);
    printf("queries    post-vision in %d span%s, decode in %d span%s\n", with_post,
           with_post == 1 ? "" : "s", with_dec, with_dec == 1 ? "" : "s");
}

static void print_kind_details(const struct kvst_file *f, const struct kvcap_file_info *info)
{
    switch (info->kind) {
    case KVCAP_KIND_DATASET:
        print_dataset(f, info);
        break;
    case KVCAP_KIND_CALIB:
        print_buckets(info);
        for (int b = 0; b < info->n_buckets; b++)
            printf("%sbucket %d: %lld training, %lld validation spans\n",
                   b ? "           " : "samples    ", b, (long long)info->calib_spans[b][0],
                   (long long)info->calib_spans[b][1]);
        printf("fit        keys %s, activation %s, hidden %d, ridge %g, storage %s\n",
               kvcap_key_method_name(info->fit.key_method),
               kvcap_activation_name(info->fit.activation), info->fit.hidden, info->fit.ridge,
               kvcap_dtype_name(info->storage));
        schedule_summary("keys      ", info->schedule_keys, info->model.n_layers);
        schedule_summary("values    ", info->schedule_values, info->model.n_layers);
        break;
    case KVCAP_KIND_ARTIFACT:
        print_buckets(info);
        printf("maps       storage %s, activation %s, fallback %s\n",
               kvcap_dtype_name(info->storage), info->activation_gelu ? "gelu" : "linear",
               kvcap_policy_name(info->fallback));
        schedule_summary("keys      ", info->schedule_keys, info->model.n_layers);
        schedule_summary("values    ", info->schedule_values, info->model.n_layers);
        break;
    case KVCAP_KIND_ANY:
        break;
    }
}

static void print_tensors(const struct kvst_file *f, size_t limit)
{
    size_t n = kvst_count(f);
    uint64_t total = 0;
    size_t width = 4;
    for (size_t i = 0; i < n; i++) {
        total += kvst_at(f, i)->nbytes;
        size_t len = strlen(kvst_at(f, i)->name);
        if (i < limit && len > width)
            width = len;
    }
    char buf[32];
    printf("tensors    %zu, %s of data\n", n, cli_bytes(total, buf, sizeof buf));
    if (n == 0 || limit == 0)
        return;
    printf("  %-*s  %-5s  %-22s  %s\n", (int)width, "name", "dtype", "shape", "bytes");
    for (size_t i = 0; i < n && i < limit; i++) {
        const struct kvst_tensor *t = kvst_at(f, i);
        char shape[64];
        size_t used = (size_t)snprintf(shape, sizeof shape, "[");
        for (int d = 0; d < t->ndim && used < sizeof shape; d++)
            used += (size_t)snprintf(shape + used, sizeof shape - used, "%s%lld", d ? ", " : "",
                                     (long long)t->shape[d]);
        if (used < sizeof shape)
            snprintf(shape + used, sizeof shape - used, "]");
        printf("  %-*s  %-5s  %-22s  %zu\n", (int)width, t->name, kvcap_dtype_name(t->dtype),
               shape, t->nbytes);
    }
    if (n > limit)
        printf("  ... %zu more (--all-tensors lists every tensor)\n", n - limit);
}

int kvcap_cli_inspect(const char *path, int all_tensors)
{
    struct kvst_file *f = NULL;
    enum kvcap_status st = kvst_open(path, &f);
    if (st != KVCAP_OK)
        return cli_fail(st);
    char size[32], hsize[32];
    printf("file       %s (%s, header %s)\n", path, cli_bytes(kvst_file_size(f), size, sizeof size),
           cli_bytes(kvst_header_size(f), hsize, sizeof hsize));
    struct kvcap_file_info info;
    st = kvcap_schema_check(f, KVCAP_KIND_ANY, &info);
    if (st == KVCAP_OK) {
        printf("kind       %s, format version %d\n", kvcap_file_kind_name(info.kind),
               info.format_version);
        print_model(&info.model);
        print_kind_details(f, &info);
        const cJSON *prov = cJSON_GetObjectItemCaseSensitive(info.config, "provenance");
        if (cJSON_IsObject(prov)) {
            char *text = cJSON_PrintUnformatted(prov);
            if (text)
                printf("provenance %s\n", text);
            cJSON_free(text);
        }
    } else {
        printf("kind       %s\n", kvst_meta(f, "kvcap.kind") ? kvst_meta(f, "kvcap.kind")
                                                             : "none (not a kvcap file)");
    }
    print_tensors(f, all_tensors ? (size_t)-1 : 24);
    int rc = st == KVCAP_OK ? 0 : cli_fail(st);
    kvcap_file_info_free(&info);
    kvst_close(f);
    return rc;
}
