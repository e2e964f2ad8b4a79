/* record.c — `kvcap-eval record`: span K/V, tail and decode queries as dataset shards. */
#include <stdio.h>
#include <stdlib.h>

#include "cli/cli.h"
#include "common/internal.h"
#include "engine/llama.h"
#include "engine/vision.h"
#include "eval/eval.h"

/* ---- record ------------------------------------------------------------------------------ */
/* Prefills chunks of the documents (image track: one span per calibration crop, on its grid,
 * in the text's place) a batch at a time into a record-mode cache, then teacher-forces --decode
 * steps; the cache writes the span K/V, the tail's queries and the decode queries into --out. */
int cmd_record(const struct options *opt)
{
    struct model_ctx mc;
    enum kvcap_status s = model_open(opt->model, &mc, opt->quiet);
    if (s != KVCAP_OK)
        return cli_fail(s);
    /* the image track: one span per calibration crop, on its grid, in the text's place */
    struct options eo = *opt;
    const struct options *o = &eo;
    struct image_set im = {0};
    if (opt->track == TRACK_IMAGE) {
        s = image_set_open(opt, &mc, KVVISION_CALIBRATION, &im);
        if (s != KVCAP_OK) {
            model_close(&mc);
            return cli_fail(s);
        }
        eo.span = im.f.n_tokens;
    }
    struct corpus corpus;
    const int chunk_len = prompt_len(o) + o->decode;
    s = corpus_load(mc.tok, o->corpus, o->docs, chunk_len, &corpus);
    if (s != KVCAP_OK) {
        image_set_free(&im);
        model_close(&mc);
        return cli_fail(s);
    }
    int n_chunks = opt->track == TRACK_IMAGE && corpus.n_chunks > 0 ? im.n : corpus.n_chunks;
    if (o->max_chunks && o->max_chunks < n_chunks)
        n_chunks = o->max_chunks;
    if (n_chunks == 0) {
        long long tokens = (long long)corpus.total_tokens; /* named after the corpus is freed */
        corpus_free(&corpus), model_close(&mc), image_set_free(&im);
        return cli_usage_error("%s: the documents (%lld tokens) hold no chunk of %d tokens",
                               o->docs, tokens, chunk_len);
    }
    s = kvcap_make_dirs(o->out);
    if (s != KVCAP_OK) {
        corpus_free(&corpus), model_close(&mc), image_set_free(&im);
        return cli_fail(s);
    }
    if (!o->quiet)
        fprintf(stderr, "kvcap-eval: record: %d documents, %lld tokens -> %d chunks of %d + %d "
                "+ %d tokens (+%d decode steps)\n", corpus.n_docs,
                (long long)corpus.total_tokens, n_chunks, o->head, o->span, o->tail, o->decode);
    struct layout lay = options_layout(o); /* --images is refused for record: one span */
    lay.rows = opt->track == TRACK_IMAGE ? im.f.grid : 1;
    const int batch = 8;
    struct kvllama_decoder *dec = NULL;
    float *logits = NULL, *embd = NULL;
    if (opt->track == TRACK_IMAGE &&
        !(embd = malloc(sizeof *embd * (size_t)im.f.n_tokens * mc.hp->n_embd)))
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for an image's embeddings");
    int32_t ids[8];
    int pos[8];
    s = kvllama_decoder_create(mc.model, batch, &dec);
    if (s == KVCAP_OK && !(logits = malloc((size_t)batch * mc.hp->n_vocab * sizeof *logits)))
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for logits");
    struct cli_progress bar;
    cli_progress_begin(&bar, "recording", o->quiet);
    double t0 = kvcap_seconds();
    for (int first = 0; s == KVCAP_OK && first < n_chunks; first += batch) {
        const int nb = n_chunks - first < batch ? n_chunks - first : batch;
        struct kvcap_cache *cache = NULL;
        s = create_cache(&mc, k_full_yaml, NULL, nb, o->storage, o->threads, o->out, &cache);
        for (int i = 0; s == KVCAP_OK && i < nb; i++) {
            struct prompt p;
            const int32_t *text = corpus.chunks[(first + i) % corpus.n_chunks].ids;
            if (embd)
                s = kvvision_embed(&im.f, &im.proj, im.crops[first + i], embd);
            if (s == KVCAP_OK)
                s = prompt_prefill_image(&mc, text, &lay, 0, embd, 0, &p);
            if (s == KVCAP_OK) {
                s = prompt_to_cache(&mc, &p, cache, i, POST_TAIL);
                prompt_free(&p);
            }
            if (s == KVCAP_OK) /* the span is complete: a flush may write it */
                s = kvcap_cache_end_prefill(cache, i);
        }
        for (int t = 0; s == KVCAP_OK && t < o->decode; t++) {
            for (int i = 0; i < nb; i++) {
                ids[i] = corpus.chunks[(first + i) % corpus.n_chunks].ids[prompt_len(o) + t];
                pos[i] = prompt_len(o) + t;
            }
            struct kvllama_group grp = {.cache = cache, .n_seqs = nb};
            s = kvllama_decode(dec, &grp, 1, ids, pos, logits);
        }
        if (s == KVCAP_OK)
            s = kvcap_cache_record_flush(cache);
        kvcap_cache_free(cache);
        cli_progress_update(&bar, first + nb, n_chunks);
    }
    kvllama_decoder_free(dec);
    free(logits), free(embd);
    corpus_free(&corpus);
    model_close(&mc);
    image_set_free(&im);
    if (s != KVCAP_OK)
        return cli_fail(s);
    if (!o->quiet)
        fprintf(stderr, "kvcap-eval: recorded %d %s spans into %s in %.1f s\n", n_chunks,
                opt->track == TRACK_IMAGE ? "image" : "text", o->out, kvcap_seconds() - t0);
    return 0;
}
