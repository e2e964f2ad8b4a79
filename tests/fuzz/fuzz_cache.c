/* fuzz_cache.c — the runtime end to end from parameters the fuzzer chooses: an artifact written
 * by the library's own writer (geometry, buckets, map sizes, storage; sometimes a unit of
 * invalid sizes), a runtime config (a policy per span kind and each policy's parameters), then
 * a cache, sometimes in record mode, driven through prefill and decode on small random K/V/Q in
 * every view layout, with an occasional invalid call in between. Checked: writer and reader
 * agree (a valid artifact opens with the maps that were written, an invalid one is refused as
 * malformed; what record mode wrote streams back), every call returns a valid status, calls
 * that must fail do, and an OK attend returns finite outputs. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/artifact.h"
#include "formats/dataset.h"
#include "tests/fuzz/fuzz_common.h"
#include "common/rng.h"
#include "common/dtype.h"

/* Kept small: every input writes an artifact and runs a whole prefill and decode. */
enum { MAX_LAYERS = 2, MAX_BUCKETS = 3, MAX_SPANS = 3, MAX_SEQS = 2, MAX_STEPS = 6,
       MAX_SPAN_TOKENS = 32, MAX_HIDDEN = 8 };

/* How a unit is written: valid, or broken in one of the ways SPEC §4.3 forbids (the last two
 * are valid sizes that differ from the other KV heads of the layer, which must share h and
 * R_v). */
enum unit_fault { FAULT_NONE, FAULT_MASK_ORDER, FAULT_MASK_RANGE, FAULT_RK_ZERO, FAULT_RK_BIG,
                  FAULT_H_ZERO, FAULT_RV_ZERO, FAULT_RV_BIG, FAULT_H_OTHER, FAULT_RV_OTHER,
                  FAULT_COUNT };

struct plan {
    struct kvcap_model_geometry g;
    int nb;
    struct kvcap_bucket buckets[MAX_BUCKETS];
    int rk[MAX_BUCKETS], h[MAX_BUCKETS], rv[MAX_BUCKETS];
    int vary_rk;           /* each unit draws its own R_k (SPEC §4.3 allows it) */
    enum unit_fault fault; /* applied to one unit (fault_unit) */
    size_t fault_unit;
    enum kvcap_dtype map_storage;
    int activation_gelu;
    double map_scale;
};

/* ---- Parameters ----------------------------------------------------------------------------- */

static void plan_geometry(struct fuzz_bytes *in, struct kvcap_model_geometry *g)
{
    static const int dims[] = {64, 64, 80, 96, 128, 256};
    static const int groups[] = {1, 2, 3, 4, 7, 8};
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "fuzz");
    g->n_layers = fuzz_int(in, 1, MAX_LAYERS);
    g->n_kv_heads = fuzz_int(in, 1, 2);
    g->n_q_heads = g->n_kv_heads * groups[fuzz_pick(in, 6)];
    g->head_dim = dims[fuzz_pick(in, 6)];
    g->rope_type = (enum kvcap_rope_type)fuzz_pick(in, 3);
    if (g->rope_type == KVCAP_ROPE_NONE)
        return;
    g->rope_pairing = (enum kvcap_rope_pairing)fuzz_pick(in, 2);
    g->rope_dim = fuzz_pick(in, 2) ? g->head_dim / 2 : 0; /* partial rotary or all channels */
    g->rope_theta = fuzz_pick(in, 2) ? 1e6 : 1e4;
    if (g->rope_type == KVCAP_ROPE_MROPE) {
        int pairs = (g->rope_dim ? g->rope_dim : g->head_dim) / 2;
        g->n_rope_sections = 3;
        g->rope_sections[0] = fuzz_int(in, 0, pairs);
        g->rope_sections[1] = fuzz_int(in, 0, pairs - g->rope_sections[0]);
        g->rope_sections[2] = pairs - g->rope_sections[0] - g->rope_sections[1];
    }
}

/* A divisor of n picked by the fuzzer. */
static int pick_divisor(struct fuzz_bytes *in, int n)
{
    int divs[16], k = 0;
    for (int i = 1; i <= n && k < 16; i++)
        if (n % i == 0)
            divs[k++] = i;
    return divs[fuzz_pick(in, k)];
}

static void plan_artifact(struct fuzz_bytes *in, struct plan *p)
{
    plan_geometry(in, &p->g);
    int want = fuzz_int(in, 1, MAX_BUCKETS);
    p->nb = 0;
    for (int i = 0; i < want; i++) {
        struct kvcap_bucket b = {fuzz_int(in, 1, 4), fuzz_int(in, 1, 8), KVCAP_STRUCTURE_DENSE,
                                 0, 0};
        if (fuzz_pick(in, 2)) {
            b.structure = KVCAP_STRUCTURE_TILED;
            b.tile_rows = pick_divisor(in, b.rows);
            b.tile_cols = pick_divisor(in, b.cols);
        }
        int dup = 0; /* buckets are distinct */
        for (int o = 0; o < p->nb; o++)
            dup |= memcmp(&p->buckets[o], &b, sizeof b) == 0;
        if (dup)
            continue;
        int m = kvcap_bucket_points(&b);
        p->buckets[p->nb] = b;
        p->rk[p->nb] = fuzz_int(in, 1, m);
        p->h[p->nb] = fuzz_int(in, 1, MAX_HIDDEN);
        p->rv[p->nb] = fuzz_int(in, 1, m);
        p->nb++;
    }
    static const enum kvcap_dtype storages[] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16,
                                                KVCAP_DTYPE_BF16};
    p->map_storage = storages[fuzz_pick(in, 3)];
    p->activation_gelu = fuzz_pick(in, 2);
    static const double scales[] = {1.0, 0.01, 10.0};
    p->map_scale = scales[fuzz_pick(in, 3)];
    p->vary_rk = fuzz_pick(in, 2);
    /* One input in eight writes a broken unit. */
    p->fault = fuzz_pick(in, 8) == 0 ? (enum unit_fault)fuzz_int(in, 1, FAULT_COUNT - 1)
                                     : FAULT_NONE;
    p->fault_unit = (size_t)fuzz_u8(in) % ((size_t)p->g.n_layers * p->g.n_kv_heads * p->nb);
    /* Sizes that differ from nothing are no fault: one KV head, or no other R_v to take. */
    int m = kvcap_bucket_points(&p->buckets[p->fault_unit % (size_t)p->nb]);
    if ((p->fault == FAULT_H_OTHER || p->fault == FAULT_RV_OTHER) &&
        (p->g.n_kv_heads == 1 || (p->fault == FAULT_RV_OTHER && m == 1)))
        p->fault = FAULT_NONE;
}

/* ---- The artifact ------------------------------------------------------------------------- */

/* Normal values drawn once per process: `fill` copies a run of them from a random start, which
 * keeps the data generator (instrumented like everything in this file) out of the profile. */
enum { NORMALS = 1 << 16 };
static float normals[NORMALS];

static void fill(struct kvcap_rng *r, float *x, size_t n, double scale)
{
    static int ready;
    if (!ready) {
        ready = 1;
        struct kvcap_rng t;
        kvcap_rng_seed(&t, 1);
        for (size_t i = 0; i < NORMALS; i++)
            normals[i] = (float)kvcap_rng_normal(&t);
    }
    size_t start = (size_t)kvcap_rng_below(r, NORMALS);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)scale * normals[(start + i) & (NORMALS - 1)];
}

/* rk distinct sorted points of 0..m-1 (rk <= m). */
static void pick_mask(struct kvcap_rng *r, int32_t *mask, int rk, int m)
{
    int k = 0;
    for (int i = 0; i < m && k < rk; i++)
        if (kvcap_rng_below(r, (uint64_t)(m - i)) < (uint64_t)(rk - k))
            mask[k++] = i;
}

/* Allocates and fills unit i; a faulty unit gets the sizes or mask of its fault. */
static void make_unit(struct kvcap_rng *r, const struct plan *p, int b, int fault,
                      struct kvcap_unit_maps *u)
{
    int m = kvcap_bucket_points(&p->buckets[b]);
    u->m = m, u->rk = p->rk[b], u->h = p->h[b], u->rv = p->rv[b];
    if (p->vary_rk)
        u->rk = 1 + (int)kvcap_rng_below(r, (uint64_t)m);
    u->gelu = (int)kvcap_rng_below(r, 2);
    switch (fault) {
    case FAULT_H_OTHER: u->h++; break;
    case FAULT_RV_OTHER: u->rv += u->rv < m ? 1 : -1; break;
    case FAULT_RK_ZERO: u->rk = 0; break;
    case FAULT_RK_BIG: u->rk = m + 1; break;
    case FAULT_H_ZERO: u->h = 0; break;
    case FAULT_RV_ZERO: u->rv = 0; break;
    case FAULT_RV_BIG: u->rv = m + 1; break;
    default: break;
    }
    size_t nf = (size_t)u->rv * m + (size_t)u->rk * u->h + u->h + (size_t)u->h * m + m;
    u->u = malloc(sizeof(float) * nf);
    u->mask = malloc(sizeof(int32_t) * (size_t)(u->rk + 1));
    FUZZ_ASSERT(u->u && u->mask, "out of memory");
    u->w1 = u->u + (size_t)u->rv * m;
    u->b1 = u->w1 + (size_t)u->rk * u->h;
    u->w2 = u->b1 + u->h;
    u->b2 = u->w2 + (size_t)u->h * m;
    fill(r, u->u, nf, p->map_scale / sqrt((double)m));
    if (u->rk <= m)
        pick_mask(r, u->mask, u->rk, m);
    else
        for (int k = 0; k < u->rk; k++)
            u->mask[k] = k < m ? k : m - 1;
    if (fault == FAULT_MASK_ORDER && u->rk >= 2) {
        int32_t t = u->mask[0];
        u->mask[0] = u->mask[1], u->mask[1] = t;
    } else if (fault == FAULT_MASK_ORDER || fault == FAULT_MASK_RANGE) {
        u->mask[u->rk - 1] = fault == FAULT_MASK_RANGE ? m : -1;
    }
}

/* What storing x in `dtype` and reading it back gives: the maps a reader must return. */
static float stored(enum kvcap_dtype dtype, float x)
{
    if (dtype == KVCAP_DTYPE_F16)
        return kvcap_f16_to_f32(kvcap_f32_to_f16(x));
    if (dtype == KVCAP_DTYPE_BF16)
        return kvcap_bf16_to_f32(kvcap_f32_to_bf16(x));
    return x;
}

static void check_floats(enum kvcap_dtype dtype, const float *want, const float *got, size_t n,
                         size_t unit, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        float w = stored(dtype, want[i]);
        FUZZ_ASSERT(memcmp(&w, &got[i], sizeof w) == 0, "unit %zu: %s[%zu] = %g, wrote %g",
                    unit, what, i, (double)got[i], (double)w);
    }
}

/* The maps that were written come back (SPEC §4.3 round trip). */
static void check_read_back(const struct plan *p, const struct kvcap_unit_maps *units,
                            const struct kvcap_artifact *a)
{
    FUZZ_ASSERT(!kvcap_geometry_difference(&p->g, &a->model), "model %s differs",
                kvcap_geometry_difference(&p->g, &a->model));
    FUZZ_ASSERT(a->n_buckets == p->nb &&
                    memcmp(a->buckets, p->buckets, sizeof p->buckets[0] * (size_t)p->nb) == 0,
                "buckets differ");
    size_t n = (size_t)p->g.n_layers * p->g.n_kv_heads * p->nb;
    for (size_t i = 0; i < n; i++) {
        const struct kvcap_unit_maps *w = &units[i], *r = &a->units[i];
        FUZZ_ASSERT(w->m == r->m && w->rk == r->rk && w->h == r->h && w->rv == r->rv &&
                        (w->gelu != 0) == (r->gelu != 0),
                    "unit %zu: m %d/%d rk %d/%d h %d/%d rv %d/%d gelu %d/%d", i, w->m, r->m,
                    w->rk, r->rk, w->h, r->h, w->rv, r->rv, w->gelu, r->gelu);
        FUZZ_ASSERT(memcmp(w->mask, r->mask, sizeof(int32_t) * (size_t)w->rk) == 0,
                    "unit %zu: mask differs", i);
        enum kvcap_dtype s = p->map_storage;
        size_t m = (size_t)w->m;
        check_floats(s, w->u, r->u, (size_t)w->rv * m, i, "U");
        check_floats(s, w->w1, r->w1, (size_t)w->rk * w->h, i, "k_w1");
        check_floats(s, w->b1, r->b1, (size_t)w->h, i, "k_b1");
        check_floats(s, w->w2, r->w2, (size_t)w->h * m, i, "k_w2");
        check_floats(s, w->b2, r->b2, m, i, "k_b2");
    }
}

/* Writes the planned artifact and opens it; NULL when the plan broke a unit (and the reader
 * refused it, as it must). */
static struct kvcap_artifact *build_artifact(const struct plan *p, uint64_t seed)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, seed);
    size_t n = (size_t)p->g.n_layers * p->g.n_kv_heads * p->nb;
    struct kvcap_unit_maps *units = calloc(n, sizeof *units);
    FUZZ_ASSERT(units, "out of memory");
    for (size_t i = 0; i < n; i++)
        make_unit(&r, p, (int)(i % (size_t)p->nb), i == p->fault_unit ? (int)p->fault : 0,
                  &units[i]);
    double ratios[MAX_LAYERS];
    for (int l = 0; l < p->g.n_layers; l++)
        ratios[l] = 0.25 + 0.5 * kvcap_rng_uniform(&r);
    struct kvcap_artifact_desc desc = {p->g,      p->nb,  p->buckets, p->map_storage,
                                       p->activation_gelu, KVCAP_POLICY_FLASHCACHE, ratios,
                                       ratios,    NULL,   NULL};
    char path[4400];
    fuzz_path(path, sizeof path, "fuzz.kvcap");
    kvcap_clear_error();
    enum kvcap_status st = kvcap_artifact_write(path, &desc, units);
    FUZZ_ASSERT(st == KVCAP_OK, "kvcap_artifact_write: %s", kvcap_last_error());
    struct kvcap_artifact *a = NULL;
    kvcap_clear_error();
    st = kvcap_artifact_open(path, &a);
    fuzz_check_status(st, "kvcap_artifact_open");
    if (p->fault != FAULT_NONE) {
        FUZZ_ASSERT(st == KVCAP_ERR_FORMAT && !a, "fault %d in unit %zu: open gave %s",
                    (int)p->fault, p->fault_unit, kvcap_status_str(st));
    } else {
        FUZZ_ASSERT(st == KVCAP_OK, "a valid artifact was refused: %s", kvcap_last_error());
        check_read_back(p, units, a);
    }
    for (size_t i = 0; i < n; i++)
        free(units[i].u), free(units[i].mask);
    free(units);
    return a;
}

/* ---- The runtime config ------------------------------------------------------------------- */

static const char *const POLICY_NAMES[] = {"full",      "kvcapsule", "flashcache", "vlcache",
                                           "freekv",    "streaming", "kvzip",      "random",
                                           "expected_attention"};
#define N_POLICIES ((int)(sizeof POLICY_NAMES / sizeof *POLICY_NAMES))

/* Writes a runtime YAML from the fuzzer's choices (mostly valid values; some the parser or the
 * cache must refuse) and returns its vision policy. */
static enum kvcap_policy write_config(struct fuzz_bytes *in, char *path, size_t cap)
{
    char yaml[2048];
    int vision = fuzz_pick(in, N_POLICIES), text = fuzz_pick(in, N_POLICIES);
    int gen = fuzz_pick(in, N_POLICIES);
    int fallback = fuzz_pick(in, N_POLICIES + 1); /* N_POLICIES: none */
    int page = fuzz_int(in, 1, 8), sink_pages = fuzz_int(in, 0, 2),
        window_pages = fuzz_int(in, 1, 2);
    int budget = (sink_pages + window_pages + 1) * page + fuzz_int(in, -2, 24);
    snprintf(yaml, sizeof yaml,
             "policies: {vision: %s, text: %s, generated: %s}\n"
             "fallback: %s\n"
             "flashcache: {gamma: %g, retention: %g, min_tokens: %d, sinks: %d, window: %d}\n"
             "vlcache: {p: %g, budget: %g, min_fraction: %g, recent_fraction: %g, sinks: %d, "
             "window: %d}\n"
             "freekv: {page_size: %d, budget: %d, tau: %g, sink_pages: %d, window_pages: %d}\n"
             "streaming: {sinks: %d, window: %d}\n"
             "kvzip: {retention: %g, sinks: %d, window: %d, safeguard: %g}\n"
             "random: {retention: %g, sinks: %d, window: %d, seed: %d}\n"
             "expected_attention: {retention: %g, n_future: %d, query_sinks: %d}\n",
             POLICY_NAMES[vision], POLICY_NAMES[text], POLICY_NAMES[gen],
             fallback == N_POLICIES ? "none" : POLICY_NAMES[fallback], fuzz_unit(in),
             fuzz_unit(in),
             fuzz_int(in, 0, 4), fuzz_int(in, 0, 3), fuzz_int(in, 0, 3), fuzz_u8(in) / 256.0,
             fuzz_unit(in), fuzz_unit(in), fuzz_u8(in) / 255.0, fuzz_int(in, 0, 3),
             fuzz_int(in, 0, 3), page, budget, fuzz_int(in, -4, 4) / 4.0, sink_pages,
             window_pages, fuzz_int(in, 0, 4), fuzz_int(in, 1, 8), fuzz_unit(in),
             fuzz_int(in, 0, 3), fuzz_int(in, 0, 3), fuzz_u8(in) / 255.0, fuzz_unit(in),
             fuzz_int(in, 0, 3),
             fuzz_int(in, 0, 3), fuzz_int(in, 0, 9), fuzz_unit(in), fuzz_int(in, 1, 64),
             fuzz_int(in, 0, 8));
    fuzz_write_file(path, cap, "runtime.yaml", yaml, strlen(yaml));
    return (enum kvcap_policy)vision;
}

/* ---- Driving the cache -------------------------------------------------------------------- */

/* The engine's threads, simulated: tasks run one after another on this thread, in order or
 * backwards, each under the thread index a real pool might give it. */
struct serial_pool {
    int n_threads, backwards;
};

static void serial_for(void *user, int n_tasks, kvcap_task_fn fn, void *ctx)
{
    const struct serial_pool *sp = user;
    for (int i = 0; i < n_tasks; i++) {
        int t = sp->backwards ? n_tasks - 1 - i : i;
        fn(ctx, t, t % sp->n_threads);
    }
}

/* A K or V view over `x` for `heads` heads of n tokens in the layout the fuzzer picks: NHD,
 * HND or paged NHD, in F32, F16 or BF16 (the data is converted into `buf`). `pages` holds room
 * for n page pointers. */
static struct kvcap_tensor_view make_view(struct fuzz_bytes *in, const float *x, int heads,
                                          int n, int d, void *buf, const void **pages)
{
    static const enum kvcap_dtype dtypes[] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16,
                                              KVCAP_DTYPE_BF16};
    struct kvcap_tensor_view v = {buf, NULL, 0, dtypes[fuzz_pick(in, 3)], 0, 0};
    size_t es = kvcap_dtype_size(v.dtype);
    int layout = fuzz_pick(in, 3);
    /* x is [token][head][d]; HND needs [head][token][d]. */
    for (int j = 0; j < n; j++)
        for (int h = 0; h < heads; h++)
            for (int c = 0; c < d; c++) {
                size_t src = ((size_t)j * heads + h) * d + c;
                size_t dst = layout == 1 ? ((size_t)h * n + j) * d + c : src;
                float f = x[src];
                char *o = (char *)buf + dst * es;
                if (v.dtype == KVCAP_DTYPE_F32) {
                    memcpy(o, &f, 4);
                } else {
                    uint16_t hv = v.dtype == KVCAP_DTYPE_F16 ? kvcap_f32_to_f16(f)
                                                             : kvcap_f32_to_bf16(f);
                    memcpy(o, &hv, 2);
                }
            }
    if (layout == 1) {
        v.head_stride = (int64_t)n * d;
        v.token_stride = d;
    } else {
        v.head_stride = d;
        v.token_stride = (int64_t)heads * d;
    }
    if (layout == 2) {
        v.page_size = fuzz_int(in, 1, 4);
        for (int pg = 0; pg * v.page_size < n; pg++)
            pages[pg] = (const char *)buf + (size_t)pg * v.page_size * heads * d * es;
        v.pages = pages;
    }
    return v;
}

struct driver {
    struct kvcap_cache *cache;
    const struct plan *p;
    int n_seqs;
    struct kvcap_rng rng;
    double kv_scale;
    float *x, *q, *out, *lse;
    int vision_spans; /* vision spans stored on every layer */
    void *buf_k, *buf_v;
    const void **pages;
};

static enum kvcap_status add_span(struct driver *dv, struct fuzz_bytes *in, int seq, int layer,
                                  const struct kvcap_span_desc *span)
{
    const struct kvcap_model_geometry *g = &dv->p->g;
    int n = span->n_tokens, H = g->n_kv_heads, d = g->head_dim;
    fill(&dv->rng, dv->x, (size_t)n * H * d, dv->kv_scale);
    struct kvcap_tensor_view k = make_view(in, dv->x, H, n, d, dv->buf_k, dv->pages);
    fill(&dv->rng, dv->x, (size_t)n * H * d, dv->kv_scale);
    struct kvcap_tensor_view v = make_view(in, dv->x, H, n, d, dv->buf_v, dv->pages + n);
    kvcap_clear_error();
    enum kvcap_status st = kvcap_cache_add_span(dv->cache, seq, layer, span, &k, &v);
    fuzz_check_status(st, "kvcap_cache_add_span");
    return st;
}

static void attend(struct driver *dv, struct fuzz_bytes *in, int layer)
{
    const struct kvcap_model_geometry *g = &dv->p->g;
    size_t nq = (size_t)dv->n_seqs * g->n_q_heads, n = nq * g->head_dim;
    fill(&dv->rng, dv->q, n, 1.0);
    int with_lse = fuzz_pick(in, 2);
    kvcap_clear_error();
    enum kvcap_status st = with_lse ? kvcap_cache_attend_lse(dv->cache, layer, dv->q, dv->out,
                                                             dv->lse)
                                    : kvcap_cache_attend(dv->cache, layer, dv->q, dv->out);
    fuzz_check_status(st, "kvcap_cache_attend");
    if (st != KVCAP_OK)
        return;
    FUZZ_ASSERT(fuzz_all_finite(dv->out, n), "layer %d: non-finite attention output", layer);
    for (size_t i = 0; with_lse && i < nq; i++)
        FUZZ_ASSERT(!isnan(dv->lse[i]) && dv->lse[i] != INFINITY, "layer %d: lse[%zu] = %g",
                    layer, i, (double)dv->lse[i]);
}

/* One call the cache must refuse, leaving itself usable. */
static void invalid_call(struct driver *dv, struct fuzz_bytes *in)
{
    const struct kvcap_model_geometry *g = &dv->p->g;
    struct kvcap_span_desc text = {KVCAP_SPAN_TEXT, 1, 0, 0, 0};
    enum kvcap_status st = KVCAP_OK;
    const char *what = "";
    switch (fuzz_pick(in, 5)) {
    case 0:
        st = add_span(dv, in, dv->n_seqs, 0, &text), what = "a span of a sequence past the batch";
        break;
    case 1:
        st = add_span(dv, in, 0, g->n_layers, &text), what = "a span of a layer past the model";
        break;
    case 2: {
        struct kvcap_span_desc bad = {KVCAP_SPAN_VISION, 3, 2, 2, 0}; /* 2 x 2 != 3 tokens */
        st = add_span(dv, in, 0, 0, &bad), what = "a vision span whose grid is not its size";
        break;
    }
    case 3:
        kvcap_clear_error();
        st = kvcap_cache_attend(dv->cache, -1, dv->q, dv->out), what = "attention at layer -1";
        fuzz_check_status(st, "kvcap_cache_attend");
        break;
    default:
        kvcap_clear_error();
        st = kvcap_cache_end_prefill(dv->cache, -1), what = "end_prefill of sequence -1";
        fuzz_check_status(st, "kvcap_cache_end_prefill");
        break;
    }
    FUZZ_ASSERT(st != KVCAP_OK, "%s was accepted", what);
}

static void drive(struct driver *dv, struct fuzz_bytes *in, enum kvcap_policy vision)
{
    const struct plan *p = dv->p;
    const struct kvcap_model_geometry *g = &p->g;
    int L = g->n_layers, d = g->head_dim;
    int mischief = fuzz_int(in, 0, 15); /* the step of the invalid call, if any */
    int step = 0;
    for (int s = 0; s < dv->n_seqs; s++) {
        int n_spans = fuzz_int(in, 1, MAX_SPANS), p0 = 0;
        for (int i = 0; i < n_spans; i++, step++) {
            struct kvcap_span_desc span = {KVCAP_SPAN_TEXT, 0, 0, 0, p0};
            int choice = fuzz_pick(in, p->nb + 2);
            if (choice < p->nb) { /* a grid with a bucket */
                span.kind = KVCAP_SPAN_VISION;
                span.rows = p->buckets[choice].rows;
                span.cols = p->buckets[choice].cols;
            } else if (choice == p->nb) { /* a grid that may have none: the fallback */
                span.kind = KVCAP_SPAN_VISION;
                span.rows = fuzz_int(in, 1, 4);
                span.cols = fuzz_int(in, 1, 8);
            }
            span.n_tokens = span.kind == KVCAP_SPAN_VISION ? span.rows * span.cols
                                                            : fuzz_int(in, 1, 12);
            p0 += span.n_tokens + fuzz_int(in, 0, 3);
            for (int l = 0; l < L; l++)
                if (add_span(dv, in, s, l, &span) != KVCAP_OK)
                    return;
            dv->vision_spans += span.kind == KVCAP_SPAN_VISION;
            if (step == mischief)
                invalid_call(dv, in);
        }
        /* VL-Cache scores with the post-vision queries; other policies may be given them too. */
        if (vision == KVCAP_POLICY_VLCACHE || vision == KVCAP_POLICY_KVZIP ||
            vision == KVCAP_POLICY_EXPECTED_ATTENTION || fuzz_pick(in, 4) == 0) {
            int n_post = fuzz_int(in, 1, 4);
            for (int l = 0; l < L; l++) {
                fill(&dv->rng, dv->q, (size_t)g->n_q_heads * n_post * d, 1.0);
                kvcap_clear_error();
                enum kvcap_status st = kvcap_cache_add_post_queries(dv->cache, s, l, dv->q, n_post);
                fuzz_check_status(st, "kvcap_cache_add_post_queries");
            }
        }
        if (fuzz_pick(in, 4) != 0) { /* else append/attend end the prefill themselves */
            kvcap_clear_error();
            fuzz_check_status(kvcap_cache_end_prefill(dv->cache, s), "kvcap_cache_end_prefill");
        }
    }
    int steps = fuzz_int(in, 0, MAX_STEPS);
    for (int t = 0; t < steps; t++, step++) {
        for (int l = 0; l < L; l++) {
            for (int s = 0; s < dv->n_seqs; s++) {
                int H = g->n_kv_heads;
                fill(&dv->rng, dv->x, (size_t)H * d, dv->kv_scale);
                struct kvcap_tensor_view k = make_view(in, dv->x, H, 1, d, dv->buf_k, dv->pages);
                fill(&dv->rng, dv->x, (size_t)H * d, dv->kv_scale);
                struct kvcap_tensor_view v = make_view(in, dv->x, H, 1, d, dv->buf_v,
                                                       dv->pages + 1);
                kvcap_clear_error();
                fuzz_check_status(kvcap_cache_append(dv->cache, s, l, &k, &v),
                                  "kvcap_cache_append");
            }
            attend(dv, in, l);
        }
        if (step == mischief)
            invalid_call(dv, in);
    }
    struct kvcap_cache_stats stats;
    kvcap_clear_error();
    fuzz_check_status(kvcap_cache_stats(dv->cache, &stats), "kvcap_cache_stats");
}

/* What record mode wrote is a dataset the reader streams back (an empty one is refused as
 * such); `vision` says whether any vision span was stored on every layer. */
static void check_recorded(const char *dir, int vision)
{
    struct kvcap_dataset *ds = NULL;
    kvcap_clear_error();
    enum kvcap_status st = kvcap_dataset_open((const char *const[]){dir}, 1, &ds);
    fuzz_check_status(st, "kvcap_dataset_open");
    FUZZ_ASSERT(st == KVCAP_OK || (st == KVCAP_ERR_INVALID_ARGUMENT && !vision),
                "the recorded dataset does not open: %s", kvcap_last_error());
    const struct kvcap_span_view *sv = NULL;
    int64_t spans = 0;
    while (st == KVCAP_OK) {
        kvcap_clear_error();
        st = kvcap_dataset_next(ds, &sv);
        FUZZ_ASSERT(st == KVCAP_OK, "streaming the recorded dataset: %s", kvcap_last_error());
        if (!sv)
            break;
        spans++;
    }
    FUZZ_ASSERT(!ds || spans == kvcap_dataset_span_count(ds), "streamed %lld of %lld spans",
                (long long)spans, (long long)kvcap_dataset_span_count(ds));
    kvcap_dataset_close(ds);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_bytes in = {data, size};
    struct plan p;
    memset(&p, 0, sizeof p);
    plan_artifact(&in, &p);
    uint64_t seed = fuzz_u32(&in);
    struct kvcap_artifact *a = build_artifact(&p, seed);
    if (!a)
        return 0;

    char config[4400];
    enum kvcap_policy vision = write_config(&in, config, sizeof config);
    struct kvcap_cache_params cp;
    kvcap_cache_default_params(&cp);
    cp.model = p.g;
    cp.n_seqs = fuzz_int(&in, 1, MAX_SEQS);
    static const enum kvcap_dtype storages[] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16,
                                                KVCAP_DTYPE_BF16};
    cp.storage = storages[fuzz_pick(&in, 3)];
    cp.artifact = vision == KVCAP_POLICY_KVCAPSULE || fuzz_pick(&in, 2) ? a : NULL;
    cp.config_path = config;
    if (fuzz_pick(&in, 8) == 0) { /* the defaults: vision spans by the artifact, if any */
        cp.config_path = NULL;
        vision = cp.artifact ? KVCAP_POLICY_KVCAPSULE : KVCAP_POLICY_FLASHCACHE;
    }
    char record[4400];
    fuzz_path(record, sizeof record, "record");
    fuzz_empty_dir(record, 1);
    if (fuzz_pick(&in, 4) == 0)
        cp.record_dir = record;
    cp.reserve_tokens = fuzz_int(&in, 0, 3);
    struct serial_pool pool = {fuzz_int(&in, 1, 3), fuzz_pick(&in, 2)};
    if (fuzz_pick(&in, 2)) { /* the engine's threads, else the cache's own pool of one */
        cp.parallel_for = serial_for;
        cp.parallel_user = &pool;
        cp.n_threads = pool.n_threads;
    } else {
        cp.n_threads = 1;
    }
    struct driver dv = {0};
    dv.p = &p;
    dv.n_seqs = cp.n_seqs;
    kvcap_rng_seed(&dv.rng, seed ^ 0x5eedull);
    static const double kv_scales[] = {1.0, 0.01, 30.0};
    dv.kv_scale = kv_scales[fuzz_pick(&in, 3)];
    kvcap_clear_error();
    enum kvcap_status st = kvcap_cache_create(&cp, &dv.cache);
    fuzz_check_status(st, "kvcap_cache_create");
    if (st == KVCAP_OK) {
        const struct kvcap_model_geometry *g = &p.g;
        size_t span_floats = (size_t)MAX_SPAN_TOKENS * g->n_kv_heads * g->head_dim;
        size_t q_floats = (size_t)MAX_SEQS * g->n_q_heads * g->head_dim * 4;
        dv.x = malloc(sizeof(float) * span_floats);
        dv.buf_k = malloc(sizeof(float) * span_floats);
        dv.buf_v = malloc(sizeof(float) * span_floats);
        dv.pages = malloc(sizeof(void *) * 2 * (MAX_SPAN_TOKENS + 1));
        dv.q = malloc(sizeof(float) * q_floats);
        dv.out = malloc(sizeof(float) * q_floats);
        dv.lse = malloc(sizeof(float) * (size_t)MAX_SEQS * g->n_q_heads);
        FUZZ_ASSERT(dv.x && dv.buf_k && dv.buf_v && dv.pages && dv.q && dv.out && dv.lse,
                    "out of memory");
        drive(&dv, &in, vision);
        free(dv.x), free(dv.buf_k), free(dv.buf_v), free(dv.pages);
        free(dv.q), free(dv.out), free(dv.lse);
    }
    kvcap_cache_free(dv.cache); /* writes what record mode still holds */
    if (st == KVCAP_OK && cp.record_dir)
        check_recorded(record, dv.vision_spans > 0);
    kvcap_artifact_free(a);
    return 0;
}
