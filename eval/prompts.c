/* prompts.c — the corpus, the model, prompts prefilled and handed to a cache, the photos. */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/internal.h"
#include "engine/llama.h"
#include "engine/tokenizer.h"
#include "engine/vision.h"
#include "eval/eval.h"

/* ---- Corpus -------------------------------------------------------------------------------- */
void corpus_free(struct corpus *c)
{
    for (int i = 0; i < c->n_docs; i++)
        free(c->names[i]), free(c->tokens[i]);
    free(c->chunks);
    memset(c, 0, sizeof *c);
}

/* Tokenises every document of the comma-separated list and cuts it into chunks of
 * chunk_len tokens (the remainder of a document is dropped). */
enum kvcap_status corpus_load(const struct kvtok *tok, const char *dir, const char *list,
                              int chunk_len, struct corpus *c)
{
    memset(c, 0, sizeof *c);
    const char *p = list;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n == 0 || c->n_docs == MAX_DOCS)
            return kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "--docs: '%s' is not a list of up to "
                              "%d names", list, MAX_DOCS);
        char *name = malloc(n + 1);
        if (!name)
            return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
        memcpy(name, p, n), name[n] = '\0';
        c->names[c->n_docs++] = name;
        p += n + (e ? 1 : 0);
    }
    size_t total_chunks = 0;
    for (int i = 0; i < c->n_docs; i++) {
        char path[4096], *text = NULL;
        size_t len = 0;
        snprintf(path, sizeof path, "%s/%s", dir, c->names[i]);
        KVCAP_TRY(kvcap_read_file(path, (size_t)1 << 30, KVCAP_ERR_INVALID_ARGUMENT,
                                  " (a document for --docs)", &text, &len));
        enum kvcap_status s = kvtok_encode(tok, text, len, 0, &c->tokens[i], &c->n_tokens[i]);
        free(text);
        KVCAP_TRY(s);
        c->total_tokens += (int64_t)c->n_tokens[i];
        total_chunks += c->n_tokens[i] / (size_t)chunk_len;
    }
    c->chunks = calloc(total_chunks ? total_chunks : 1, sizeof *c->chunks);
    if (!c->chunks)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for chunks");
    /* Round-robin over documents, so the first chunks cover every document. */
    for (size_t k = 0; c->n_chunks < (int)total_chunks; k++)
        for (int i = 0; i < c->n_docs; i++)
            if ((k + 1) * (size_t)chunk_len <= c->n_tokens[i])
                c->chunks[c->n_chunks++] = (struct chunk){
                    c->tokens[i] + k * chunk_len, chunk_len, i, (int)(k * chunk_len)};
    return KVCAP_OK;
}

/* ---- Model, prompts and caches ------------------------------------------------------------- */
void model_close(struct model_ctx *mc)
{
    kvllama_free(mc->model);
    kvtok_free(mc->tok);
}

enum kvcap_status model_open(const char *path, struct model_ctx *mc, int quiet)
{
    memset(mc, 0, sizeof *mc);
    double t0 = kvcap_seconds();
    struct kvgguf_file *f = NULL;
    KVCAP_TRY(kvgguf_open(path, &f));
    enum kvcap_status s = kvtok_create_gguf(f, &mc->tok);
    if (s == KVCAP_OK)
        s = kvllama_load_gguf(f, &mc->model);
    kvgguf_close(f);
    if (s != KVCAP_OK) {
        model_close(mc);
        return s;
    }
    kvllama_geometry(mc->model, &mc->g);
    mc->hp = kvllama_hparams(mc->model);
    if (!quiet) {
        char b[32];
        fprintf(stderr, "kvcap-eval: %s: %s, %d layers, %d/%d heads x %d, %s of f32 weights "
                "(%.1f s)\n", path, mc->g.name, mc->hp->n_layers, mc->hp->n_heads,
                mc->hp->n_kv_heads, mc->hp->head_dim,
                cli_bytes(kvllama_weight_bytes(mc->model), b, sizeof b), kvcap_seconds() - t0);
    }
    return KVCAP_OK;
}

/* Frees what a prefill holds; the layout stays. */
void prompt_free(struct prompt *p)
{
    free(p->k), free(p->v), free(p->q_post), free(p->q_dec), free(p->logits), free(p->q_replay);
    free(p->lse_replay), free(p->q_prompt);
    p->k = p->v = p->q_post = p->q_dec = p->logits = p->q_replay = p->lse_replay = NULL;
    p->q_prompt = NULL;
}

/* The prompt's embedding spans (its images; none for text) into spans[MAX_IMAGES]; their
 * number. */
static int prompt_embd_spans(const struct model_ctx *mc, const struct prompt *p,
                             struct kvllama_embd_span *spans)
{
    if (!p->embd)
        return 0;
    const struct layout *ly = &p->lay;
    for (int i = 0; i < ly->images; i++)
        spans[i] = (struct kvllama_embd_span){prompt_span_at(p, i), ly->span,
                                              p->embd + (size_t)i * ly->span * mc->hp->n_embd};
    return ly->images;
}

/* Prefills the prompt ids in its layout, then n_fid more tokens, with the model; with `embd`
 * ([images][span][n_embd]) each span enters as its embeddings (an image on a rows x span/rows
 * grid) instead of its token ids. The tail's queries go to q_post, the fidelity tokens' to q_dec
 * and, with `all_queries`, every prompt token's to q_prompt (expected_attention's statistics). */
enum kvcap_status prompt_prefill_image(const struct model_ctx *mc, const int32_t *ids,
                                       const struct layout *lay, int n_fid, const float *embd,
                                       int all_queries, struct prompt *p)
{
    const struct kvllama_hparams *hp = mc->hp;
    *p = (struct prompt){.ids = ids, .lay = *lay, .embd = embd, .n_fid = n_fid};
    const int P = prompt_tokens(p), n = P + n_fid, tail = lay->tail;
    const int q0 = all_queries ? 0 : P - tail, nq = n - q0; /* the queries kept: q0 .. n */
    const size_t L = (size_t)hp->n_layers, H = (size_t)hp->n_heads, d = (size_t)hp->head_dim;
    const size_t kd = (size_t)hp->n_kv_heads * d, V = (size_t)hp->n_vocab;
    KVCAP_RETURN_IF(lay->images < 1 || lay->images > MAX_IMAGES || lay->span < 1 ||
                        lay->gap < 0 || lay->rows < 1 || lay->span % lay->rows,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "prompt layout: %d spans of %d tokens on %d rows, %d apart (1..%d spans)",
                    lay->images, lay->span, lay->rows, lay->gap, MAX_IMAGES);
    p->k = malloc(L * n * kd * sizeof(float));
    p->v = malloc(L * n * kd * sizeof(float));
    p->q_post = malloc(L * H * (size_t)tail * d * sizeof(float));
    p->q_dec = malloc(L * H * (size_t)(n_fid ? n_fid : 1) * d * sizeof(float));
    p->logits = malloc(V * sizeof(float));
    p->q_prompt = all_queries ? malloc(L * H * (size_t)P * d * sizeof(float)) : NULL;
    float *q = malloc(L * H * nq * d * sizeof(float));
    float *logits = malloc((size_t)(n_fid + 1) * V * sizeof(float));
    enum kvcap_status s = KVCAP_OK;
    if (!p->k || !p->v || !p->q_post || !p->q_dec || !p->logits || !q || !logits ||
        (all_queries && !p->q_prompt))
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for a prompt's K/V");
    struct kvllama_prefill_out out = {p->k, p->v, q, nq, logits, n_fid + 1};
    struct kvllama_embd_span spans[MAX_IMAGES];
    const int n_spans = prompt_embd_spans(mc, p, spans);
    const double t0 = kvcap_seconds();
    if (s == KVCAP_OK)
        s = kvllama_prefill_spans(mc->model, ids, n, spans, n_spans, &out);
    p->prefill_s = kvcap_seconds() - t0;
    if (s == KVCAP_OK) {
        memcpy(p->logits, logits, V * sizeof(float)); /* the first of the last n_fid + 1 */
        for (size_t lh = 0; lh < L * H; lh++) {
            const float *ql = q + lh * nq * d;
            memcpy(p->q_post + lh * tail * d, ql + (size_t)(P - tail - q0) * d,
                   (size_t)tail * d * sizeof(float));
            memcpy(p->q_dec + lh * n_fid * d, ql + (size_t)(P - q0) * d,
                   (size_t)n_fid * d * sizeof(float));
            if (all_queries)
                memcpy(p->q_prompt + lh * P * d, ql, (size_t)P * d * sizeof(float));
        }
    }
    free(q), free(logits);
    if (s != KVCAP_OK)
        prompt_free(p);
    return s;
}

/* A text prompt: the span is a 1 x span grid of the text's own tokens. */
enum kvcap_status prompt_prefill(const struct model_ctx *mc, const int32_t *ids, int head,
                                 int span, int tail, int n_fid, int all_queries,
                                 struct prompt *p)
{
    const struct layout lay = {.head = head, .span = span, .tail = tail, .images = 1, .rows = 1};
    return prompt_prefill_image(mc, ids, &lay, n_fid, NULL, all_queries, p);
}

/* KVzip's context-reconstruction pass (arXiv 2505.23416, as kvpress runs it): after the prompt,
 * the instruction to repeat it, the chat template's turn to the assistant, and the prompt again
 * (an image span as its embeddings again). The model runs it continuing from the prompt's K/V,
 * as an engine continues from its cache, with full attention over the prompt; replay_s is what
 * it costs. The pass's queries go to p->q_replay. */
static const char *const k_replay_text = "\n\nRepeat the previous context exactly.";
static const char *const k_replay_turn = "<|im_end|>\n<|im_start|>assistant\n";

/* Timings of the reconstruction pass, of which the least counts. */
enum { REPLAY_TIMINGS = 2 };

enum kvcap_status prompt_replay(const struct model_ctx *mc, struct prompt *p, int timed)
{
    const struct kvllama_hparams *hp = mc->hp;
    const int P = prompt_tokens(p);
    int32_t *a = NULL, *b = NULL, *prefix = NULL;
    size_t na = 0, nb = 0;
    KVCAP_TRY(kvtok_encode(mc->tok, k_replay_text, strlen(k_replay_text), 0, &a, &na));
    enum kvcap_status s = kvtok_encode(mc->tok, k_replay_turn, strlen(k_replay_turn), 1, &b, &nb);
    const int R = (int)(na + nb) + P;
    const size_t L = (size_t)hp->n_layers, H = (size_t)hp->n_heads, d = (size_t)hp->head_dim;
    float *q = s == KVCAP_OK ? malloc(sizeof *q * L * H * (size_t)R * d) : NULL;
    float *lse = s == KVCAP_OK ? malloc(sizeof *lse * L * H * (size_t)R) : NULL;
    prefix = s == KVCAP_OK ? malloc(sizeof *prefix * (na + nb + 1)) : NULL;
    if (s == KVCAP_OK && (!q || !lse || !prefix))
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for the reconstruction pass");
    if (s == KVCAP_OK && (!p->k || !p->v))
        s = kvcap_fail(KVCAP_ERR_INTERNAL, "the reconstruction pass needs the prompt's K/V");
    if (s == KVCAP_OK) {
        memcpy(prefix, a, sizeof *prefix * na);
        memcpy(prefix + na, b, sizeof *prefix * nb);
        struct kvllama_embd_span spans[MAX_IMAGES];
        const int n_spans = prompt_embd_spans(mc, p, spans);
        const struct kvllama_past past = {p->k, p->v, P, P + p->n_fid};
        /* timed: warm (the prompt's own prefill, the first of the run, may include start-up
         * costs), the least of REPLAY_TIMINGS (a busy machine only ever adds time); the
         * queries are the same every time */
        double pass = HUGE_VAL;
        for (int i = 0; s == KVCAP_OK && i < (timed ? REPLAY_TIMINGS : 1); i++) {
            const double t0 = kvcap_seconds();
            s = kvllama_reconstruct(mc->model, p->ids, P, prefix, (int)(na + nb), spans,
                                    n_spans, &past, q, lse);
            pass = fmin(pass, kvcap_seconds() - t0);
        }
        p->replay_s = timed ? pass : NAN;
    }
    if (s == KVCAP_OK) {
        free(p->q_replay), free(p->lse_replay);
        p->q_replay = q, p->lse_replay = lse, p->n_replay = R;
        q = lse = NULL;
    }
    free(a), free(b), free(prefix), free(q), free(lse);
    return s;
}

/* Hands a prefilled prompt to sequence `seq` of a cache: the head (text, if any), each span
 * (vision: an image's grid, or a 1 x span grid of text) with the gaps between them (text), the
 * tail (text), then the queries `post` names. */
enum kvcap_status prompt_to_cache(const struct model_ctx *mc, const struct prompt *p,
                                  struct kvcap_cache *cache, int seq,
                                  enum post_queries post)
{
    const struct kvllama_hparams *hp = mc->hp;
    const size_t n = (size_t)prompt_tokens(p) + p->n_fid;
    const size_t kd = (size_t)hp->n_kv_heads * hp->head_dim;
    struct kvcap_span_desc parts[2 * MAX_IMAGES + 1];
    int n_parts = 0;
    const struct layout *ly = &p->lay;
    parts[n_parts++] = (struct kvcap_span_desc){KVCAP_SPAN_TEXT, ly->head, 0, 0, 0};
    for (int i = 0; i < ly->images; i++) {
        const int at = prompt_span_at(p, i);
        if (i > 0)
            parts[n_parts++] = (struct kvcap_span_desc){KVCAP_SPAN_TEXT, ly->gap, 0, 0,
                                                        at - ly->gap};
        parts[n_parts++] = (struct kvcap_span_desc){KVCAP_SPAN_VISION, ly->span, ly->rows,
                                                    ly->span / ly->rows, at};
    }
    parts[n_parts++] = (struct kvcap_span_desc){KVCAP_SPAN_TEXT, ly->tail, 0, 0,
                                                prompt_tokens(p) - ly->tail};
    for (int l = 0; l < hp->n_layers; l++) {
        const float *k = p->k + (size_t)l * n * kd, *v = p->v + (size_t)l * n * kd;
        for (int i = 0; i < n_parts; i++) {
            if (parts[i].n_tokens == 0)
                continue;
            struct kvcap_tensor_view kv = {.base = k + (size_t)parts[i].p0 * kd,
                                           .dtype = KVCAP_DTYPE_F32, .head_stride = hp->head_dim,
                                           .token_stride = (int64_t)kd};
            struct kvcap_tensor_view vv = kv;
            vv.base = v + (size_t)parts[i].p0 * kd;
            KVCAP_TRY(kvcap_cache_add_span(cache, seq, l, &parts[i], &kv, &vv));
        }
        if (post == POST_PROMPT) {
            KVCAP_RETURN_IF(!p->q_prompt, KVCAP_ERR_STATE,
                            "prompt %d: its queries were not kept (all_queries)", seq);
            const int P = prompt_tokens(p);
            KVCAP_TRY(kvcap_cache_add_post_queries(
                cache, seq, l, p->q_prompt + (size_t)l * hp->n_heads * P * hp->head_dim, P));
        } else if (post == POST_REPLAY) {
            KVCAP_RETURN_IF(!p->q_replay, KVCAP_ERR_STATE,
                            "prompt %d: no reconstruction pass ran (prompt_replay)", seq);
            KVCAP_TRY(kvcap_cache_add_post_queries_lse(
                cache, seq, l,
                p->q_replay + (size_t)l * hp->n_heads * p->n_replay * hp->head_dim,
                p->lse_replay + (size_t)l * hp->n_heads * p->n_replay, p->n_replay));
        } else {
            KVCAP_TRY(kvcap_cache_add_post_queries(
                cache, seq, l, p->q_post + (size_t)l * hp->n_heads * ly->tail * hp->head_dim,
                ly->tail));
        }
    }
    return KVCAP_OK;
}

const char *const k_full_yaml =
    "policies: {vision: full, text: full, generated: full}\nfallback: none\n";

/* The cache's parallel loops on the OpenMP threads the engine's own loops and OpenBLAS (its
 * OpenMP build, scripts/setup.sh) already use: one pool of awake threads, none spinning while
 * another pool works. */
static void omp_parallel_for(void *user, int n_tasks, kvcap_task_fn fn, void *ctx)
{
    (void)user;
#pragma omp parallel for schedule(dynamic, 1)
    for (int t = 0; t < n_tasks; t++)
        fn(ctx, t, omp_get_thread_num());
}

enum kvcap_status create_cache(const struct model_ctx *mc, const char *yaml,
                               const struct kvcap_artifact *art, int n_seqs,
                               enum kvcap_dtype storage, int threads,
                               const char *record_dir, struct kvcap_cache **out)
{
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = mc->g;
    p.n_seqs = n_seqs;
    p.storage = storage;
    p.artifact = art;
    p.config_yaml = yaml;
    p.record_dir = record_dir;
    p.n_threads = threads;
    if (threads == 0 || threads == omp_get_max_threads()) {
        p.n_threads = omp_get_max_threads();
        p.parallel_for = omp_parallel_for;
    }
    return kvcap_cache_create(&p, out);
}

/* The text of the first n generated tokens (control tokens as written). */
void generated_text(const struct model_ctx *mc, const int32_t *ids, int n, char *out,
                    size_t cap)
{
    size_t len = 0;
    out[0] = '\0';
    for (int i = 0; i < n && len + 1 < cap; i++) {
        long got = kvtok_decode_token(mc->tok, ids[i], out + len, cap - 1 - len);
        if (got < 0 || (size_t)got > cap - 1 - len)
            break;
        len += (size_t)got;
    }
    out[len] = '\0';
    /* A token may end inside a UTF-8 sequence: replace what is not valid UTF-8 by '?'. */
    for (size_t i = 0; i < len;) {
        size_t w = kvcap_utf8_seq_len((const unsigned char *)out + i, len - i);
        if (w == 0)
            out[i++] = '?';
        else
            i += w;
    }
}

/* ---- Image track ------------------------------------------------------------------------- */
void image_set_free(struct image_set *im)
{
    kvvision_close(&im->f);
    kvvision_projector_free(&im->proj);
    free(im->crops);
    memset(im, 0, sizeof *im);
}

/* Opens --features, fits the projector (on the calibration photos) and lists the crops of the
 * photos of `split`. */
enum kvcap_status image_set_open(const struct options *o, const struct model_ctx *mc,
                                 enum kvvision_split split, struct image_set *im)
{
    memset(im, 0, sizeof *im);
    KVCAP_TRY(kvvision_open(o->features, &im->f));
    enum kvcap_status s = kvvision_projector_fit(&im->f, kvllama_token_embeddings(mc->model),
                                                 mc->hp->n_vocab, mc->hp->n_embd, &im->proj);
    if (s == KVCAP_OK && !(im->crops = malloc(sizeof *im->crops * (size_t)im->f.n_crops)))
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    for (int c = 0; s == KVCAP_OK && c < im->f.n_crops; c++)
        if (kvvision_crop_split(&im->f, c) == split)
            im->crops[im->n++] = c;
    if (s == KVCAP_OK && im->n == 0)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "%s: no crop of a %s photo%s", o->features,
                       kvvision_split_name(split),
                       im->f.splits_recorded ? ""
                                             : " (the file records no splits: remake it with "
                                               "scripts/vision_features.py)");
    if (s != KVCAP_OK)
        image_set_free(im);
    return s;
}
