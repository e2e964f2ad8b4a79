/* seeds.c — kvcap-fuzz-seeds: writes the starting corpora of the fuzz harnesses from the
 * library's own writers (safetensors, artifacts, calibration states, dataset shards), a small
 * GGUF writer, shrunken copies of the sample metrics.json, parameter bytes for fuzz_cache and
 * runtime YAML for every policy (fuzz_runtime_config, fuzz_runtime_decode).
 * scripts/fuzz.sh adds the repository's own test files (tests/data, configs) next to them.
 *
 * Usage: kvcap-fuzz-seeds OUT_DIR METRICS_SAMPLE_JSON
 * Writes OUT_DIR/<harness>/<name> for every harness; exits non-zero if a writer fails. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "runtime/artifact.h"
#include "configs/config.h"
#include "formats/dataset.h"
#include "report/report.h"
#include "common/rng.h"
#include "formats/safetensors.h"
#include "common/dtype.h"
#include "calibrate/state.h"

static const char *out_dir;
static int failures;

static void check(enum kvcap_status st, const char *what)
{
    if (st != KVCAP_OK) {
        fprintf(stderr, "kvcap-fuzz-seeds: %s: %s\n", what, kvcap_last_error());
        failures++;
    }
}

/* OUT_DIR/harness/name, the folder made if needed. */
static const char *seed_path(const char *harness, const char *name)
{
    static char path[4096];
    snprintf(path, sizeof path, "%s/%s", out_dir, harness);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "kvcap-fuzz-seeds: cannot make %s: %s\n", path, strerror(errno));
        exit(1);
    }
    snprintf(path, sizeof path, "%s/%s/%s", out_dir, harness, name);
    return path;
}

static void write_bytes(const char *harness, const char *name, const void *data, size_t n)
{
    const char *path = seed_path(harness, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) {
        fprintf(stderr, "kvcap-fuzz-seeds: cannot write %s\n", path);
        exit(1);
    }
}

/* Copies a seed written for one harness into another's corpus (the safetensors harness reads
 * every kvcap file). */
static void copy_seed(const char *from, const char *to, const char *name)
{
    char src[4096];
    snprintf(src, sizeof src, "%s", seed_path(from, name));
    FILE *f = fopen(src, "rb");
    if (!f)
        return;
    char *buf = NULL;
    size_t n = 0, cap = 0, got;
    do {
        if (n == cap) {
            cap = cap ? 2 * cap : 65536;
            buf = realloc(buf, cap);
            if (!buf)
                exit(1);
        }
        got = fread(buf + n, 1, cap - n, f);
        n += got;
    } while (got > 0);
    fclose(f);
    write_bytes(to, name, buf, n);
    free(buf);
}

static void fill(struct kvcap_rng *r, float *x, size_t n, double scale)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(scale * kvcap_rng_normal(r));
}

static struct kvcap_model_geometry tiny(int layers, int q_heads, int kv_heads,
                                        enum kvcap_rope_type rope)
{
    struct kvcap_model_geometry g = {.name = "seed", .n_layers = layers, .n_q_heads = q_heads,
                                     .n_kv_heads = kv_heads, .head_dim = 64, .rope_type = rope,
                                     .rope_pairing = KVCAP_ROPE_PAIRING_HALF,
                                     .rope_theta = rope ? 1e4 : 0};
    if (rope == KVCAP_ROPE_MROPE) {
        g.n_rope_sections = 3;
        g.rope_sections[0] = 8, g.rope_sections[1] = 12, g.rope_sections[2] = 12;
    }
    return g;
}

/* ---- safetensors ------------------------------------------------------------------------- */

static void safetensors_seeds(void)
{
    static const float f32[6] = {1.0f, -2.5f, 0.0f, 3.25f, 1e-3f, -7.0f};
    static const double f64[3] = {1.0, -0.5, 1e300};
    static const int32_t i32[4] = {0, 1, -1, 2147483647};
    static const uint8_t u8[3] = {0, 1, 255};
    uint16_t f16[6], bf16[6];
    for (int i = 0; i < 6; i++)
        f16[i] = kvcap_f32_to_f16(f32[i]), bf16[i] = kvcap_f32_to_bf16(f32[i]);
    const int64_t s23[2] = {2, 3}, s3[1] = {3}, s4[1] = {4}, s6[1] = {6};
    struct kvst_writer *w = NULL;
    check(kvst_writer_create(&w), "safetensors writer");
    if (!w)
        return;
    check(kvst_writer_add(w, "a.f32", KVCAP_DTYPE_F32, 2, s23, f32), "add f32");
    check(kvst_writer_add(w, "b.f16", KVCAP_DTYPE_F16, 1, s6, f16), "add f16");
    check(kvst_writer_add(w, "c.bf16", KVCAP_DTYPE_BF16, 1, s6, bf16), "add bf16");
    check(kvst_writer_add(w, "d.f64", KVCAP_DTYPE_F64, 1, s3, f64), "add f64");
    check(kvst_writer_add(w, "e.i32", KVCAP_DTYPE_I32, 1, s4, i32), "add i32");
    check(kvst_writer_add(w, "f.u8", KVCAP_DTYPE_U8, 1, s3, u8), "add u8");
    check(kvst_writer_add(w, "g.scalar", KVCAP_DTYPE_F32, 0, NULL, f32), "add scalar");
    check(kvst_writer_add(w, "h.empty", KVCAP_DTYPE_F32, 1, (const int64_t[1]){0}, f32),
          "add empty");
    check(kvst_writer_set_meta(w, "note", "a seed"), "metadata");
    check(kvst_writer_commit(w, seed_path("safetensors", "dtypes.safetensors")), "commit");
    kvst_writer_free(w);

    w = NULL;
    check(kvst_writer_create(&w), "safetensors writer");
    if (!w)
        return;
    check(kvst_writer_commit(w, seed_path("safetensors", "empty.safetensors")), "commit empty");
    kvst_writer_free(w);
}

/* ---- Artifacts --------------------------------------------------------------------------- */

struct art_bucket {
    int rows, cols, tile_rows, tile_cols, rk, h, rv;
};

static void artifact_seed(const char *name, const struct kvcap_model_geometry *g,
                          const struct art_bucket *ab, int nb, enum kvcap_dtype storage,
                          uint64_t seed)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, seed);
    struct kvcap_bucket buckets[4];
    for (int b = 0; b < nb; b++)
        buckets[b] = (struct kvcap_bucket){ab[b].rows, ab[b].cols,
                                           ab[b].tile_rows ? KVCAP_STRUCTURE_TILED
                                                           : KVCAP_STRUCTURE_DENSE,
                                           ab[b].tile_rows, ab[b].tile_cols};
    size_t n = (size_t)g->n_layers * g->n_kv_heads * nb, i = 0;
    struct kvcap_unit_maps *units = calloc(n, sizeof *units);
    if (!units)
        exit(1);
    for (int l = 0; l < g->n_layers; l++)
        for (int h = 0; h < g->n_kv_heads; h++)
            for (int b = 0; b < nb; b++, i++) {
                struct kvcap_unit_maps *u = &units[i];
                int m = kvcap_bucket_points(&buckets[b]);
                u->m = m, u->rk = ab[b].rk, u->h = ab[b].h, u->rv = ab[b].rv;
                u->gelu = (l + h + b) % 2;
                size_t nf = (size_t)u->rv * m + (size_t)u->rk * u->h + u->h +
                            (size_t)u->h * m + m;
                u->u = malloc(sizeof(float) * nf);
                u->mask = malloc(sizeof(int32_t) * (size_t)u->rk);
                if (!u->u || !u->mask)
                    exit(1);
                fill(&r, u->u, nf, 1.0 / sqrt(m));
                u->w1 = u->u + (size_t)u->rv * m;
                u->b1 = u->w1 + (size_t)u->rk * u->h;
                u->w2 = u->b1 + u->h;
                u->b2 = u->w2 + (size_t)u->h * m;
                for (int k = 0; k < u->rk; k++)
                    u->mask[k] = (int32_t)(k * m / u->rk);
            }
    double ratios[8];
    for (int l = 0; l < g->n_layers; l++)
        ratios[l] = 0.5;
    const int64_t spans[4][2] = {{10, 2}, {5, 1}, {3, 0}, {1, 1}};
    cJSON *prov = cJSON_CreateObject();
    cJSON_AddStringToObject(prov, "tool", "kvcap-fuzz-seeds");
    struct kvcap_artifact_desc desc = {*g, nb, buckets, storage, 1, KVCAP_POLICY_STREAMING,
                                       ratios, ratios, spans, prov};
    check(kvcap_artifact_write(seed_path("artifact", name), &desc, units), name);
    cJSON_Delete(prov);
    for (i = 0; i < n; i++)
        free(units[i].u), free(units[i].mask);
    free(units);
    copy_seed("artifact", "safetensors", name);
}

static void artifact_seeds(void)
{
    struct kvcap_model_geometry g1 = tiny(1, 1, 1, KVCAP_ROPE_ROPE);
    const struct art_bucket dense[] = {{1, 4, 0, 0, 2, 2, 2}};
    artifact_seed("dense-f32.kvcap", &g1, dense, 1, KVCAP_DTYPE_F32, 1);

    struct kvcap_model_geometry g2 = tiny(2, 4, 2, KVCAP_ROPE_MROPE);
    const struct art_bucket mixed[] = {{2, 4, 1, 2, 1, 1, 2}, {2, 4, 0, 0, 3, 2, 4},
                                       {1, 2, 0, 0, 2, 1, 1}};
    artifact_seed("mixed-f16.kvcap", &g2, mixed, 3, KVCAP_DTYPE_F16, 2);

    struct kvcap_model_geometry g3 = tiny(1, 2, 1, KVCAP_ROPE_NONE);
    const struct art_bucket tiled[] = {{4, 4, 2, 2, 2, 3, 3}};
    artifact_seed("tiled-bf16.kvcap", &g3, tiled, 1, KVCAP_DTYPE_BF16, 3);
}

/* ---- Calibration states ------------------------------------------------------------------ */

static const char CALIB_YAML[] =
    "model:\n"
    "  name: seed\n"
    "  layers: 1\n"
    "  q_heads: 2\n"
    "  kv_heads: 1\n"
    "  head_dim: 64\n"
    "  rope: {type: rope, pairing: half, theta: 10000}\n"
    "buckets:\n"
    "  - {rows: 1, cols: 4, structure: dense}\n"
    "  - {rows: 2, cols: 4, structure: tiled, tile: [1, 2]}\n"
    "schedule:\n"
    "  keys: {kind: uniform, ratio: 0.5}\n"
    "  values: {kind: list, ratios: [0.5]}\n"
    "keys: {method: closed_form, activation: gelu, hidden: 0, ridge: 1.0e-3}\n"
    "storage: f16\n";

/* G += X Xᵀ for `samples` random m-vectors: a positive definite Gram as calibration sums. */
static void random_gram(struct kvcap_rng *r, double *g, int m, int samples)
{
    double x[16];
    for (int s = 0; s < samples; s++) {
        for (int i = 0; i < m; i++)
            x[i] = kvcap_rng_normal(r);
        for (int i = 0; i < m; i++)
            for (int j = 0; j < m; j++)
                g[(size_t)i * m + j] += x[i] * x[j];
    }
}

static void calib_seeds(void)
{
    struct kvcap_calib_config cfg;
    check(kvcap_calib_config_load_string(CALIB_YAML, "seed.calib.yaml", &cfg), "calib config");
    struct kvcap_calib_state s;
    enum kvcap_status st = kvcap_calib_state_init(&s, &cfg);
    check(st, "calib state");
    kvcap_calib_config_free(&cfg);
    if (st != KVCAP_OK)
        return;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 4);
    for (int b = 0; b < s.n_buckets; b++) {
        s.train_spans[b] = 12, s.val_spans[b] = 3;
        for (int h = 0; h < s.model.n_kv_heads; h++) {
            struct kvcap_calib_unit *u = kvcap_state_unit(&s, 0, h, b);
            random_gram(&r, u->v_gram, u->m, 24);
            random_gram(&r, u->k_gram, u->m, 24);
        }
    }
    check(kvcap_calib_state_write(&s, seed_path("calib_state", "sums.kvcs")), "write sums");
    check(kvcap_calib_state_fit(&s, 0, KVCAP_CALIB_DEVICE_CPU, NULL, NULL, NULL), "fit");
    check(kvcap_calib_state_write(&s, seed_path("calib_state", "fitted.kvcs")), "write fit");
    kvcap_calib_state_free(&s);
    copy_seed("calib_state", "safetensors", "sums.kvcs");
    copy_seed("calib_state", "safetensors", "fitted.kvcs");
}

/* ---- Dataset shards ---------------------------------------------------------------------- */

static void dataset_seed(const char *prefix, enum kvcap_dtype dtype, int with_queries)
{
    struct kvcap_model_geometry g = tiny(2, 2, 1, KVCAP_ROPE_ROPE);
    struct kvcap_dataset_writer_params p;
    kvcap_dataset_writer_default_params(&p);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/dataset", out_dir);
    p.dir = dir;
    p.prefix = prefix;
    p.dtype = dtype;
    p.source = "kvcap-fuzz-seeds";
    struct kvcap_dataset_writer *w = NULL;
    check(kvcap_dataset_writer_create(&g, &p, &w), "dataset writer");
    if (!w)
        return;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 5);
    static const int grids[2][3] = {{1, 3, 0}, {2, 2, 7}};
    float k[4 * 64], v[4 * 64], q[2 * 2 * 64];
    for (int s = 0; s < 2; s++) {
        int n = grids[s][0] * grids[s][1];
        check(kvcap_dataset_writer_begin_span(w, grids[s][0], grids[s][1], grids[s][2]), "span");
        for (int l = 0; l < g.n_layers; l++) {
            fill(&r, k, (size_t)n * 64, 1.0), fill(&r, v, (size_t)n * 64, 1.0);
            check(kvcap_dataset_writer_set_kv(w, l, k, v), "set_kv");
            if (!with_queries)
                continue;
            fill(&r, q, sizeof q / sizeof q[0], 1.0);
            check(kvcap_dataset_writer_add_queries(w, l, KVCAP_QUERIES_POST, q, 1), "q_post");
            check(kvcap_dataset_writer_add_queries(w, l, KVCAP_QUERIES_DECODE, q, 2), "q_dec");
        }
        check(kvcap_dataset_writer_end_span(w), "end_span");
    }
    check(kvcap_dataset_writer_flush(w), "flush");
    kvcap_dataset_writer_free(w);
    char name[256];
    snprintf(name, sizeof name, "%s-00000.safetensors", prefix);
    copy_seed("dataset", "safetensors", name);
}

/* ---- GGUF -------------------------------------------------------------------------------- */

struct buf {
    unsigned char *p;
    size_t n, cap;
};

static void put(struct buf *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 256;
        b->p = realloc(b->p, b->cap);
        if (!b->p)
            exit(1);
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put_le(struct buf *b, uint64_t v, int bytes)
{
    unsigned char x[8];
    for (int i = 0; i < bytes; i++)
        x[i] = (unsigned char)(v >> (8 * i));
    put(b, x, (size_t)bytes);
}

static void put_str(struct buf *b, const char *s)
{
    put_le(b, strlen(s), 8);
    put(b, s, strlen(s));
}

static void put_key(struct buf *b, const char *key, uint32_t type)
{
    put_str(b, key);
    put_le(b, type, 4);
}

static void put_f32(struct buf *b, float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    put_le(b, u, 4);
}

/* A GGUF v3 image under construction: key/values, tensor infos and data apart, joined by
 * gguf_write. */
struct gguf {
    struct buf kv, info, data;
    uint64_t n_kv, n_tensors;
    uint32_t alignment;
    struct kvcap_rng rng;
};

static void kv_str(struct gguf *g, const char *key, const char *value)
{
    put_key(&g->kv, key, 8), put_str(&g->kv, value), g->n_kv++;
}

static void kv_u32(struct gguf *g, const char *key, uint32_t value)
{
    put_key(&g->kv, key, 4), put_le(&g->kv, value, 4), g->n_kv++;
}

static void kv_f32(struct gguf *g, const char *key, float value)
{
    put_key(&g->kv, key, 6), put_f32(&g->kv, value), g->n_kv++;
}

/* A string array key. */
static void kv_strs(struct gguf *g, const char *key, const char *const *v, int n)
{
    put_key(&g->kv, key, 9), put_le(&g->kv, 8, 4), put_le(&g->kv, (uint64_t)n, 8), g->n_kv++;
    for (int i = 0; i < n; i++)
        put_str(&g->kv, v[i]);
}

/* A 2-D tensor [ne0, ne1] (ggml order) of ggml type `type` with random contents; the f16 scales
 * that open each quantised block (two for the _1 types) are set to small finite values. */
static void gguf_tensor(struct gguf *g, const char *name, uint32_t type, uint64_t ne0,
                        uint64_t ne1)
{
    static const struct {
        uint32_t type, block, bytes; /* elements per block, bytes per block (ggml's) */
    } types[] = {{0, 1, 4}, {1, 1, 2}, {2, 32, 18}, {3, 32, 20}, {6, 32, 22}, {7, 32, 24},
                 {8, 32, 34}, {30, 1, 2}};
    int t = 0;
    while (types[t].type != type)
        t++;
    while (g->data.n % g->alignment)
        put_le(&g->data, 0, 1);
    put_str(&g->info, name);
    put_le(&g->info, 2, 4), put_le(&g->info, ne0, 8), put_le(&g->info, ne1, 8);
    put_le(&g->info, type, 4), put_le(&g->info, g->data.n, 8);
    g->n_tensors++;
    size_t blocks = (size_t)(ne0 * ne1 / types[t].block), at = g->data.n;
    for (size_t i = 0; i < blocks * types[t].bytes; i++)
        put_le(&g->data, kvcap_rng_below(&g->rng, 256), 1);
    for (size_t b = 0; b < blocks; b++) {
        unsigned char *p = g->data.p + at + b * types[t].bytes;
        if (type == 0) { /* finite f32 */
            float x = (float)(0.1 * kvcap_rng_normal(&g->rng));
            memcpy(p, &x, 4);
        } else if (type == 1 || type == 30) {
            uint16_t x = type == 1 ? kvcap_f32_to_f16(0.1f * (float)(b % 7))
                                   : kvcap_f32_to_bf16(0.1f * (float)(b % 7));
            memcpy(p, &x, 2);
        } else {
            uint16_t x = kvcap_f32_to_f16(0.01f * (float)(b % 5 + 1));
            memcpy(p, &x, 2);
            if (type == 3 || type == 7)
                memcpy(p + 2, &x, 2);
        }
    }
}

static void gguf_write(struct gguf *g, const char *name)
{
    struct buf out = {0};
    put(&out, "GGUF", 4);
    put_le(&out, 3, 4);
    put_le(&out, g->n_tensors, 8);
    put_le(&out, g->n_kv, 8);
    put(&out, g->kv.p, g->kv.n);
    put(&out, g->info.p, g->info.n);
    while (out.n % g->alignment)
        put_le(&out, 0, 1);
    put(&out, g->data.p, g->data.n);
    write_bytes("gguf", name, out.p, out.n);
    free(out.p), free(g->kv.p), free(g->info.p), free(g->data.p);
}

static void gguf_init(struct gguf *g, uint32_t alignment, uint64_t seed)
{
    memset(g, 0, sizeof *g);
    g->alignment = alignment;
    kvcap_rng_seed(&g->rng, seed);
}

/* A key of every value type, arrays, and a tensor of each type the reader dequantises. */
static void gguf_types_seed(const char *name, uint32_t alignment)
{
    struct gguf g;
    gguf_init(&g, alignment, 6);
    kv_str(&g, "general.architecture", "seed");
    if (alignment != 32)
        kv_u32(&g, "general.alignment", alignment);
    put_key(&g.kv, "k.u8", 0), put_le(&g.kv, 200, 1);
    put_key(&g.kv, "k.i8", 1), put_le(&g.kv, (uint8_t)-5, 1);
    put_key(&g.kv, "k.u16", 2), put_le(&g.kv, 60000, 2);
    put_key(&g.kv, "k.i16", 3), put_le(&g.kv, (uint16_t)-300, 2);
    put_key(&g.kv, "k.i32", 5), put_le(&g.kv, (uint32_t)-70000, 4);
    put_key(&g.kv, "k.bool", 7), put_le(&g.kv, 1, 1);
    put_key(&g.kv, "k.u64", 10), put_le(&g.kv, UINT64_C(1) << 40, 8);
    put_key(&g.kv, "k.i64", 11), put_le(&g.kv, (uint64_t)INT64_C(-7), 8);
    double d = 0.125;
    uint64_t du;
    memcpy(&du, &d, 8);
    put_key(&g.kv, "k.f64", 12), put_le(&g.kv, du, 8);
    put_key(&g.kv, "k.i32s", 9), put_le(&g.kv, 5, 4), put_le(&g.kv, 3, 8);
    put_le(&g.kv, 3, 4), put_le(&g.kv, 1, 4), put_le(&g.kv, (uint32_t)-1, 4);
    put_key(&g.kv, "k.f32s", 9), put_le(&g.kv, 6, 4), put_le(&g.kv, 2, 8);
    put_f32(&g.kv, -1.0f), put_f32(&g.kv, 0.5f);
    put_key(&g.kv, "k.empty", 9), put_le(&g.kv, 0, 4), put_le(&g.kv, 0, 8);
    put_key(&g.kv, "k.i8s", 9), put_le(&g.kv, 1, 4), put_le(&g.kv, 2, 8);
    put_le(&g.kv, 1, 1), put_le(&g.kv, 0x80, 1);
    g.n_kv += 13;
    kv_f32(&g, "k.f32", 10000.0f);
    const char *const strs[] = {"<s>", "a", "\xc4\xa0the", ""};
    kv_strs(&g, "k.strs", strs, 4);
    static const uint32_t types[] = {0, 1, 2, 3, 6, 7, 8, 30};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        char tname[32];
        snprintf(tname, sizeof tname, "t.%u", types[t]);
        gguf_tensor(&g, tname, types[t], types[t] == 0 || types[t] == 1 || types[t] == 30 ? 3 : 32,
                    2);
    }
    gguf_write(&g, name);
}

/* A one-layer Llama that kvcap-eval's engine and tokenizer load: head_dim 64, a byte-level
 * BPE vocabulary of 16 tokens, Q4_0 matrices. */
static void gguf_llama_seed(void)
{
    enum { E = 64, F = 32, V = 16 };
    struct gguf g;
    gguf_init(&g, 32, 8);
    kv_str(&g, "general.architecture", "llama");
    kv_str(&g, "general.name", "seed-llama");
    kv_u32(&g, "llama.block_count", 1);
    kv_u32(&g, "llama.context_length", 64);
    kv_u32(&g, "llama.embedding_length", E);
    kv_u32(&g, "llama.feed_forward_length", F);
    kv_u32(&g, "llama.attention.head_count", 1);
    kv_u32(&g, "llama.attention.head_count_kv", 1);
    kv_u32(&g, "llama.rope.dimension_count", E);
    kv_f32(&g, "llama.rope.freq_base", 10000.0f);
    kv_f32(&g, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    kv_str(&g, "tokenizer.ggml.model", "gpt2");
    kv_str(&g, "tokenizer.ggml.pre", "smollm");
    const char *const tokens[V] = {"<|endoftext|>", "<s>", "H", "e", "l", "o", ",", "\xc4\xa0",
                                   "w", "r", "d", "!", "He", "ll", "llo", "\xc4\xa0w"};
    kv_strs(&g, "tokenizer.ggml.tokens", tokens, V);
    const char *const merges[] = {"H e", "l l", "ll o", "\xc4\xa0 w"};
    kv_strs(&g, "tokenizer.ggml.merges", merges, 4);
    put_key(&g.kv, "tokenizer.ggml.token_type", 9), put_le(&g.kv, 5, 4), put_le(&g.kv, V, 8);
    for (int i = 0; i < V; i++)
        put_le(&g.kv, i < 2 ? 3 : 1, 4);
    g.n_kv++;
    kv_u32(&g, "tokenizer.ggml.bos_token_id", 1);
    kv_u32(&g, "tokenizer.ggml.eos_token_id", 0);
    gguf_tensor(&g, "token_embd.weight", 2, E, V);
    gguf_tensor(&g, "output_norm.weight", 0, E, 1);
    gguf_tensor(&g, "blk.0.attn_norm.weight", 0, E, 1);
    gguf_tensor(&g, "blk.0.attn_q.weight", 2, E, E);
    gguf_tensor(&g, "blk.0.attn_k.weight", 2, E, E);
    gguf_tensor(&g, "blk.0.attn_v.weight", 2, E, E);
    gguf_tensor(&g, "blk.0.attn_output.weight", 2, E, E);
    gguf_tensor(&g, "blk.0.ffn_norm.weight", 0, E, 1);
    gguf_tensor(&g, "blk.0.ffn_gate.weight", 2, E, F);
    gguf_tensor(&g, "blk.0.ffn_up.weight", 2, E, F);
    gguf_tensor(&g, "blk.0.ffn_down.weight", 2, F, E);
    gguf_write(&g, "llama.gguf");
}

/* ---- metrics.json ------------------------------------------------------------------------ */

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0, got;
    char *p = malloc(cap);
    while (p && (got = fread(p + n, 1, cap - n - 1, f)) > 0) {
        n += got;
        if (n + 1 == cap)
            p = realloc(p, cap *= 2);
    }
    fclose(f);
    if (p)
        p[n] = '\0';
    return p;
}

/* Keeps the first `keep` entries of array `key` of `obj`. */
static void truncate_array(cJSON *obj, const char *key, int keep)
{
    cJSON *a = cJSON_GetObjectItemCaseSensitive(obj, key);
    while (cJSON_IsArray(a) && cJSON_GetArraySize(a) > keep)
        cJSON_DeleteItemFromArray(a, cJSON_GetArraySize(a) - 1);
}

/* The sample cut to `layers` layers, the runs whose index is in `runs` (-1 ends the list), one
 * small mask, and written as `name` once kvcap-report accepts it. */
static void metrics_seed(const cJSON *sample, const char *name, int layers, const int *runs,
                         int minify)
{
    cJSON *doc = cJSON_Duplicate(sample, 1);
    cJSON_SetNumberValue(cJSON_GetObjectItemCaseSensitive(
                             cJSON_GetObjectItemCaseSensitive(doc, "model"), "layers"),
                         layers);
    cJSON *all = cJSON_GetObjectItemCaseSensitive(doc, "runs"), *kept = cJSON_CreateArray();
    for (int i = 0; runs[i] >= 0; i++) {
        cJSON *run = cJSON_Duplicate(cJSON_GetArrayItem(all, runs[i]), 1);
        truncate_array(run, "attn_cosine", layers);
        truncate_array(run, "attn_rel_err", layers);
        cJSON_AddItemToArray(kept, run);
    }
    cJSON_ReplaceItemInObjectCaseSensitive(doc, "runs", kept);
    cJSON *masks = cJSON_GetObjectItemCaseSensitive(doc, "masks");
    truncate_array(doc, "masks", 1);
    cJSON *mask = cJSON_GetArrayItem(masks, 0);
    if (mask) {
        cJSON_SetNumberValue(cJSON_GetObjectItemCaseSensitive(mask, "n_tokens"), 16);
        cJSON *per_layer = cJSON_CreateArray();
        int heads = (int)cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(mask, "heads"));
        for (int l = 0; l < layers; l++) {
            cJSON *per_head = cJSON_CreateArray();
            for (int h = 0; h < heads; h++) {
                const int idx[4] = {l, 3 + h, 8, 15};
                cJSON_AddItemToArray(per_head, cJSON_CreateIntArray(idx, 4));
            }
            cJSON_AddItemToArray(per_layer, per_head);
        }
        cJSON_ReplaceItemInObjectCaseSensitive(mask, "kept", per_layer);
    }
    char *text = minify ? cJSON_PrintUnformatted(doc) : cJSON_Print(doc);
    cJSON_Delete(doc);
    const char *path = seed_path("metrics", name);
    write_bytes("metrics", name, text, strlen(text));
    free(text);
    char html[4200], csv[4200];
    snprintf(html, sizeof html, "%s.html", path);
    snprintf(csv, sizeof csv, "%s.csv", path);
    enum kvcap_status st = kvcap_report_write(path, html, csv);
    remove(html);
    remove(csv);
    if (st != KVCAP_OK) { /* a seed refused early explores little: say so and drop it */
        fprintf(stderr, "kvcap-fuzz-seeds: warning: metrics seed %s refused: %s\n", name,
                kvcap_last_error());
        remove(path);
    }
}

static void metrics_seeds(const char *sample_path)
{
    char *text = read_text(sample_path);
    cJSON *sample = text ? cJSON_Parse(text) : NULL;
    free(text);
    if (!sample) {
        fprintf(stderr, "kvcap-fuzz-seeds: cannot read %s as JSON\n", sample_path);
        failures++;
        return;
    }
    /* Indices into the sample's runs: full, one of each policy at 0.4, composition. */
    const int full_only[] = {0, -1};
    const int policies[] = {0, 2, 5, 8, 11, 14, 17, 20, -1};
    const int curves[] = {0, 7, 8, 9, 10, 11, 12, -1};
    metrics_seed(sample, "full.json", 1, full_only, 1);
    metrics_seed(sample, "policies.json", 2, policies, 1);
    metrics_seed(sample, "curves.json", 3, curves, 0);
    cJSON_Delete(sample);
}

/* ---- fuzz_cache parameters --------------------------------------------------------------- */

/* Random parameter bytes: fuzz_cache reads any bytes as a plan, so these only give the
 * fuzzer a spread of geometries and policies to start from. */
static void cache_seeds(void)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 7);
    unsigned char bytes[160];
    for (int s = 0; s < 24; s++) {
        size_t n = 48 + (size_t)kvcap_rng_below(&r, sizeof bytes - 48);
        for (size_t i = 0; i < n; i++)
            bytes[i] = (unsigned char)kvcap_rng_below(&r, 256);
        char name[32];
        snprintf(name, sizeof name, "random-%02d", s);
        write_bytes("cache", name, bytes, n);
    }
    write_bytes("cache", "zeros", (const unsigned char[64]){0}, 64);
}

/* ---- Runtime YAML for fuzz_runtime_config and fuzz_runtime_decode ------------------------ */

/* The shipped configs (configs/, added by scripts/fuzz.sh) choose flashcache and full only: one
 * small config per policy and span kind, and the keys that reach other code at decode time
 * (values: basis, exact tiles, fallback: none, the largest rings the parser accepts). */
static void runtime_seeds(void)
{
    static const char *const policies[] = {"full",   "kvcapsule", "flashcache",
                                           "vlcache", "freekv",   "streaming",
                                           "kvzip",  "random",    "expected_attention"};
    static const char *const extra[][2] = {
        {"kvzip-basis", "policies: {vision: kvzip, text: kvzip}\n"
                        "kvzip: {retention: 0.7, sinks: 1, window: 2, safeguard: 0.5, "
                        "values: basis, exact_values: 2}\n"},
        {"kvcapsule-exact", "policies: {vision: kvcapsule, generated: streaming}\n"
                            "fallback: none\nkvcapsule: {exact_tiles: 3}\n"
                            "streaming: {sinks: 2, window: 3}\n"},
        {"freekv-all", "policies: {vision: freekv, text: freekv, generated: freekv}\n"
                       "freekv: {page_size: 2, budget: 8, tau: 0.5, sink_pages: 1, "
                       "window_pages: 1}\n"},
        {"vlcache-uniform", "policies: {vision: vlcache, text: random}\n"
                            "vlcache: {budget: 0.3, sinks: 1, window: 1, layer_budgets: uniform}\n"
                            "random: {retention: 0.5, seed: 3}\n"},
        {"expected", "policies: {vision: expected_attention, text: expected_attention}\n"
                     "expected_attention: {retention: 0.5, n_future: 16, query_sinks: 1}\n"},
        /* sinks + window at their bound: the generated ring's arithmetic at its largest */
        {"streaming-max", "policies: {generated: streaming}\n"
                          "streaming: {sinks: 536870912, window: 536870912}\n"},
        {"streaming-sinks-max", "policies: {generated: streaming}\n"
                                "streaming: {sinks: 1073741823, window: 1}\n"},
        {"freekv-max", "policies: {vision: freekv, text: freekv, generated: freekv}\n"
                       "freekv: {page_size: 65536, budget: 1073741824, sink_pages: 1, "
                       "window_pages: 1}\n"},
        {"protect-max", "policies: {vision: flashcache, text: flashcache}\n"
                        "flashcache: {min_tokens: 1073741824, sinks: 1073741823, window: 1}\n"},
    };
    char name[64], text[256];
    for (int k = 0; k < 3; k++)
        for (size_t p = 0; p < sizeof policies / sizeof *policies; p++) {
            static const char *const kinds[] = {"vision", "text", "generated"};
            snprintf(name, sizeof name, "%s-%s.yaml", kinds[k], policies[p]);
            snprintf(text, sizeof text, "policies: {%s: %s}\n", kinds[k], policies[p]);
            write_bytes("runtime_config", name, text, strlen(text));
            write_bytes("runtime_decode", name, text, strlen(text));
        }
    for (size_t i = 0; i < sizeof extra / sizeof *extra; i++) {
        snprintf(name, sizeof name, "%s.yaml", extra[i][0]);
        write_bytes("runtime_config", name, extra[i][1], strlen(extra[i][1]));
        write_bytes("runtime_decode", name, extra[i][1], strlen(extra[i][1]));
    }
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s OUT_DIR METRICS_SAMPLE_JSON\n", argv[0]);
        return 2;
    }
    out_dir = argv[1];
    if (mkdir(out_dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "kvcap-fuzz-seeds: cannot make %s: %s\n", out_dir, strerror(errno));
        return 1;
    }
    safetensors_seeds();
    artifact_seeds();
    calib_seeds();
    dataset_seed("f16", KVCAP_DTYPE_F16, 1);
    dataset_seed("f32", KVCAP_DTYPE_F32, 0);
    gguf_types_seed("types.gguf", 32);
    gguf_types_seed("types-alignment-64.gguf", 64);
    gguf_llama_seed();
    metrics_seeds(argv[2]);
    cache_seeds();
    runtime_seeds();
    return failures ? 1 : 0;
}
