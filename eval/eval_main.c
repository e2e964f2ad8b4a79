/* eval_main.c — kvcap-eval: runs a real model (a Llama-family GGUF, SmolLM2-135M-Instruct by
 * default) through libkvcap on real text.
 *
 *   kvcap-eval record  tokenises documents, prefills fixed-length chunks and records their K/V
 *                      and queries through the runtime's record mode (a calibration dataset);
 *   kvcap-eval run     evaluates every policy × retention against `full` in one batched run:
 *                      greedy generation agreement, teacher-forced log-likelihood, attention
 *                      fidelity on recorded held-out queries, bytes held/read and decode time;
 *                      writes metrics.json, metrics.csv and report.html.
 *
 * Text is cut into chunks laid out like a vision-language prompt: HEAD tokens kept in full (the
 * system text before an image, which holds the attention sinks), SPAN tokens handed to the
 * cache as one compressible span (kind vision, a 1 x SPAN grid, so every policy, KVCapsule
 * included, applies to it), then TAIL tokens kept in full (the question after the image, whose
 * queries VL-Cache scores with), then the continuation. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "artifact.h"
#include "cli.h"
#include "dataset.h"
#include "internal.h"
#include "llama.h"
#include "report.h"
#include "tokenizer.h"

#define DEFAULT_MODEL_FILE "SmolLM2-135M-Instruct.Q4_1.gguf"
#define DEFAULT_CORPUS "/usr/share/common-licenses"
#define DEFAULT_CALIB_DOCS "GPL-3,GPL-2,LGPL-2.1,LGPL-3,GFDL-1.3,MPL-1.1,GPL-1"
#define DEFAULT_HELDOUT_DOCS "Apache-2.0,MPL-2.0,Artistic,CC0-1.0"
#define MAX_DOCS 64
#define MAX_RUNS 64
#define MAX_ARTIFACTS 16

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvcap-eval record --out DIR [options]\n"
            "       kvcap-eval run --out DIR --heldout-data DIR [--kvcapsule V:R:FILE ...] "
            "[options]\n"
            "\n"
            "Runs a Llama-family model from a GGUF file (default: SmolLM2-135M-Instruct) with\n"
            "every decode-step attention computed by libkvcap, on real English text.\n"
            "\n"
            "Text is cut into chunks laid out like a vision-language prompt: HEAD tokens kept in\n"
            "full (as the system text before an image; it holds the attention sinks), SPAN\n"
            "tokens handed to the cache as one compressible span (a 1 x SPAN grid of kind\n"
            "vision, so every policy applies to it), then TAIL tokens kept in full (as the\n"
            "question after an image; their queries are VL-Cache's post-span queries).\n"
            "\n"
            "record: prefills chunks of the documents and records span K/V, tail queries and\n"
            "        DECODE teacher-forced decode queries per chunk as dataset shards in DIR\n"
            "        (the format kvcap-calibrate reads).\n"
            "run:    evaluates full, streaming, kvcapsule (per --kvcapsule artifact), flashcache,\n"
            "        vlcache, freekv and a composition at each retention, batched in one decode\n"
            "        loop: greedy generation vs full (token agreement, first divergence),\n"
            "        teacher-forced NLL of the true continuation, attention-output fidelity per\n"
            "        layer on the held-out recorded queries, bytes held and read, decode time.\n"
            "        Writes DIR/metrics.json, DIR/metrics.csv and DIR/report.html.\n"
            "\n"
            "options:\n"
            "  -m, --model FILE         GGUF model (default: $KVCAP_MODEL, else\n"
            "                           $HOME/.cache/kvcap/models/" DEFAULT_MODEL_FILE ")\n"
            "  -C, --corpus DIR         folder of plain-text documents (default " DEFAULT_CORPUS
            ",\n"
            "                           the license texts Debian's base-files ships)\n"
            "  -D, --docs LIST          comma-separated document names inside the corpus\n"
            "                           (record default: " DEFAULT_CALIB_DOCS ";\n"
            "                           run default: " DEFAULT_HELDOUT_DOCS ")\n"
            "  -o, --out DIR            output folder (created)\n"
            "      --head N             tokens before the span, kept in full (default 16)\n"
            "      --span N             tokens of the compressible span (default 256)\n"
            "      --tail N             tokens after it, kept in full (default 16)\n"
            "      --decode N           record: teacher-forced decode steps per chunk (default 16)\n"
            "      --max-chunks N       record: at most N chunks (default: all)\n"
            "      --heldout-data DIR   run: recorded held-out dataset (kvcap-eval record on the\n"
            "                           held-out documents) for the attention-fidelity metrics\n"
            "      --kvcapsule V:R:FILE run: a KVCapsule artifact, variant V (e.g. dense, tiled) at\n"
            "                           retention R (repeatable); the composition uses the last\n"
            "                           variant given\n"
            "      --retentions LIST    run: retentions for the other policies (default\n"
            "                           0.2,0.4,0.6; also the retention of each curve point)\n"
            "      --prompts N          run: held-out prompts (default 8)\n"
            "      --generate N         run: greedy tokens generated per prompt (default 256)\n"
            "      --storage T          cache storage f32, f16 or bf16 (default f16)\n"
            "      --threads N          threads per cache (default: all cores)\n"
            "      --command TEXT       run: the command recorded in the report as reproducing it\n"
            "                           (default: this command line)\n"
            "      --calibration-docs L run: the documents the artifacts were calibrated on, for\n"
            "                           the report\n"
            "  -q, --quiet              no progress\n"
            "  -V, --version            print the kvcap version\n"
            "  -h, --help               show this help\n");
}

/* ---- Options --------------------------------------------------------------------------- */
struct artifact_arg {
    char variant[32];
    double retention;
    const char *path;
};

struct options {
    int record;
    const char *model, *corpus, *docs, *calib_docs, *out, *heldout_data, *command;
    int head, span, tail, decode, max_chunks, prompts, generate, threads, quiet;
    enum kvcap_dtype storage;
    double retentions[8];
    int n_retentions;
    struct artifact_arg artifacts[MAX_ARTIFACTS];
    int n_artifacts;
    char model_default[4096];
};

static int parse_int(const char *arg, const char *name, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(arg, &end, 10);
    if (errno || *end || end == arg || v < lo || v > hi)
        return cli_usage_error("%s: '%s' is not an integer in [%ld, %ld]", name, arg, lo, hi);
    *out = (int)v;
    return 0;
}

static int parse_retentions(const char *arg, struct options *o)
{
    o->n_retentions = 0;
    const char *p = arg;
    while (*p) {
        char *end;
        double r = strtod(p, &end);
        if (end == p || !(r > 0.0 && r <= 1.0) || o->n_retentions == 8)
            return cli_usage_error("--retentions: '%s' is not a list of up to 8 values in (0, 1]",
                                   arg);
        o->retentions[o->n_retentions++] = r;
        if (*end == ',')
            end++;
        else if (*end)
            return cli_usage_error("--retentions: '%s' is not a comma-separated list", arg);
        p = end;
    }
    return o->n_retentions ? 0 : cli_usage_error("--retentions: empty list");
}

static int parse_artifact(const char *arg, struct options *o)
{
    const char *c1 = strchr(arg, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c1 || !c2 || c1 == arg || (size_t)(c1 - arg) >= sizeof o->artifacts[0].variant ||
        !c2[1] || o->n_artifacts == MAX_ARTIFACTS)
        return cli_usage_error("--kvcapsule: '%s' is not VARIANT:RETENTION:FILE", arg);
    struct artifact_arg *a = &o->artifacts[o->n_artifacts];
    memcpy(a->variant, arg, (size_t)(c1 - arg));
    a->variant[c1 - arg] = '\0';
    char *end;
    a->retention = strtod(c1 + 1, &end);
    if (end != c2 || !(a->retention > 0.0 && a->retention <= 1.0))
        return cli_usage_error("--kvcapsule: '%s': retention must be in (0, 1]", arg);
    a->path = c2 + 1;
    o->n_artifacts++;
    return 0;
}

static int parse_options(int argc, char **argv, struct options *o)
{
    memset(o, 0, sizeof *o);
    o->head = 16, o->span = 256, o->tail = 16, o->decode = 16, o->prompts = 8, o->generate = 256;
    o->storage = KVCAP_DTYPE_F16;
    o->corpus = DEFAULT_CORPUS;
    o->retentions[0] = 0.2, o->retentions[1] = 0.4, o->retentions[2] = 0.6;
    o->n_retentions = 3;
    if (argc >= 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        usage(stdout);
        exit(0);
    }
    if (argc >= 2 && (!strcmp(argv[1], "-V") || !strcmp(argv[1], "--version"))) {
        printf("kvcap-eval %s\n", kvcap_version());
        exit(0);
    }
    if (argc < 2 || (strcmp(argv[1], "record") && strcmp(argv[1], "run")))
        return cli_usage_error("expected a command, record or run (see --help)");
    o->record = !strcmp(argv[1], "record");
    enum { O_SPAN = 256, O_HEAD, O_TAIL, O_DECODE, O_MAXCH, O_HELD, O_ART, O_RET, O_PROMPTS, O_GEN,
           O_STORAGE, O_THREADS, O_COMMAND, O_CALIB_DOCS };
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},   {"corpus", required_argument, 0, 'C'},
        {"docs", required_argument, 0, 'D'},    {"out", required_argument, 0, 'o'},
        {"span", required_argument, 0, O_SPAN}, {"head", required_argument, 0, O_HEAD}, {"tail", required_argument, 0, O_TAIL},
        {"decode", required_argument, 0, O_DECODE},
        {"max-chunks", required_argument, 0, O_MAXCH},
        {"heldout-data", required_argument, 0, O_HELD},
        {"kvcapsule", required_argument, 0, O_ART},
        {"retentions", required_argument, 0, O_RET},
        {"prompts", required_argument, 0, O_PROMPTS},
        {"generate", required_argument, 0, O_GEN},
        {"storage", required_argument, 0, O_STORAGE},
        {"threads", required_argument, 0, O_THREADS},
        {"command", required_argument, 0, O_COMMAND},
        {"calibration-docs", required_argument, 0, O_CALIB_DOCS},
        {"quiet", no_argument, 0, 'q'},         {"version", no_argument, 0, 'V'},
        {"help", no_argument, 0, 'h'},          {0, 0, 0, 0}};
    int c, rc = 0;
    optind = 2;
    while (!rc && (c = getopt_long(argc, argv, "m:C:D:o:qVh", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'C': o->corpus = optarg; break;
        case 'D': o->docs = optarg; break;
        case 'o': o->out = optarg; break;
        case O_SPAN: rc = parse_int(optarg, "--span", 2, 8192, &o->span); break;
        case O_HEAD: rc = parse_int(optarg, "--head", 0, 1024, &o->head); break;
        case O_TAIL: rc = parse_int(optarg, "--tail", 1, 1024, &o->tail); break;
        case O_DECODE: rc = parse_int(optarg, "--decode", 0, 4096, &o->decode); break;
        case O_MAXCH: rc = parse_int(optarg, "--max-chunks", 1, 1 << 20, &o->max_chunks); break;
        case O_HELD: o->heldout_data = optarg; break;
        case O_ART: rc = parse_artifact(optarg, o); break;
        case O_RET: rc = parse_retentions(optarg, o); break;
        case O_PROMPTS: rc = parse_int(optarg, "--prompts", 1, 256, &o->prompts); break;
        case O_GEN: rc = parse_int(optarg, "--generate", 1, 8192, &o->generate); break;
        case O_THREADS: rc = parse_int(optarg, "--threads", 0, 1024, &o->threads); break;
        case O_COMMAND: o->command = optarg; break;
        case O_CALIB_DOCS: o->calib_docs = optarg; break;
        case O_STORAGE:
            if (!strcmp(optarg, "f32")) o->storage = KVCAP_DTYPE_F32;
            else if (!strcmp(optarg, "f16")) o->storage = KVCAP_DTYPE_F16;
            else if (!strcmp(optarg, "bf16")) o->storage = KVCAP_DTYPE_BF16;
            else rc = cli_usage_error("--storage: '%s' is not f32, f16 or bf16", optarg);
            break;
        case 'q': o->quiet = 1; break;
        case 'V': printf("kvcap-eval %s\n", kvcap_version()); exit(0);
        case 'h': usage(stdout); exit(0);
        default: return 2;
        }
    }
    if (rc)
        return rc;
    if (optind < argc)
        return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (!o->out)
        return cli_usage_error("--out is required");
    if (!o->record && !o->heldout_data)
        return cli_usage_error("run: --heldout-data is required (record the held-out documents "
                               "first)");
    if (!o->docs)
        o->docs = o->record ? DEFAULT_CALIB_DOCS : DEFAULT_HELDOUT_DOCS;
    if (!o->model) {
        const char *env = getenv("KVCAP_MODEL"), *home = getenv("HOME");
        if (env && *env)
            o->model = env;
        else {
            snprintf(o->model_default, sizeof o->model_default, "%s/.cache/kvcap/models/%s",
                     home ? home : ".", DEFAULT_MODEL_FILE);
            o->model = o->model_default;
        }
    }
    return 0;
}

/* ---- Corpus -------------------------------------------------------------------------------- */
struct chunk {
    const int32_t *ids; /* into the document's tokens */
    int n;
    int doc;            /* index into the document list */
    int offset;         /* token offset inside the document */
};

struct corpus {
    int n_docs;
    char *names[MAX_DOCS];
    int32_t *tokens[MAX_DOCS];
    size_t n_tokens[MAX_DOCS];
    int64_t total_tokens;
    struct chunk *chunks;
    int n_chunks;
};

static void corpus_free(struct corpus *c)
{
    for (int i = 0; i < c->n_docs; i++)
        free(c->names[i]), free(c->tokens[i]);
    free(c->chunks);
    memset(c, 0, sizeof *c);
}

/* Tokenises every document of the comma-separated list and cuts it into chunks of
 * chunk_len tokens (the remainder of a document is dropped). */
static enum kvcap_status corpus_load(const struct kvtok *tok, const char *dir, const char *list,
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

/* ---- Shared pieces ------------------------------------------------------------------------- */
struct model_ctx {
    struct kvllama_model *model;
    struct kvtok *tok;
    struct kvcap_model_geometry g;
    const struct kvllama_hparams *hp;
};

static void model_close(struct model_ctx *mc)
{
    kvllama_free(mc->model);
    kvtok_free(mc->tok);
}

static enum kvcap_status model_open(const char *path, struct model_ctx *mc, int quiet)
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

/* A prefilled prompt: K/V of every layer and the tail's queries. */
struct prompt {
    const struct chunk *chunk;
    float *k, *v, *q_tail; /* see struct kvllama_prefill_out */
    float *logits;         /* [n_vocab] of the last prompt token */
};

static void prompt_free(struct prompt *p)
{
    free(p->k), free(p->v), free(p->q_tail), free(p->logits);
}

/* Tokens of a prompt: head + span + tail. */
static int prompt_len(const struct options *o) { return o->head + o->span + o->tail; }

static enum kvcap_status prompt_prefill(const struct model_ctx *mc, const struct options *o,
                                        const struct chunk *ch, struct prompt *p)
{
    const struct kvllama_hparams *hp = mc->hp;
    const size_t n = (size_t)prompt_len(o), L = (size_t)hp->n_layers;
    const size_t kd = (size_t)hp->n_kv_heads * hp->head_dim;
    memset(p, 0, sizeof *p);
    p->chunk = ch;
    p->k = malloc(L * n * kd * sizeof(float));
    p->v = malloc(L * n * kd * sizeof(float));
    p->q_tail = malloc(L * hp->n_heads * (size_t)o->tail * hp->head_dim * sizeof(float));
    p->logits = malloc((size_t)hp->n_vocab * sizeof(float));
    if (!p->k || !p->v || !p->q_tail || !p->logits) {
        prompt_free(p);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for a prompt's K/V");
    }
    struct kvllama_prefill_out out = {p->k, p->v, p->q_tail, o->tail, p->logits, 1};
    enum kvcap_status s = kvllama_prefill(mc->model, ch->ids, (int)n, &out);
    if (s != KVCAP_OK)
        prompt_free(p);
    return s;
}

/* Hands a prefilled prompt to sequence `seq` of a cache: the head (text, if any), the span
 * (vision, a 1 x span grid), the tail (text), then the tail's queries. */
static enum kvcap_status prompt_to_cache(const struct model_ctx *mc, const struct options *o,
                                         const struct prompt *p, struct kvcap_cache *cache,
                                         int seq)
{
    const struct kvllama_hparams *hp = mc->hp;
    const size_t n = (size_t)prompt_len(o), kd = (size_t)hp->n_kv_heads * hp->head_dim;
    const struct kvcap_span_desc parts[3] = {
        {KVCAP_SPAN_TEXT, o->head, 0, 0, 0},
        {KVCAP_SPAN_VISION, o->span, 1, o->span, o->head},
        {KVCAP_SPAN_TEXT, o->tail, 0, 0, o->head + o->span}};
    for (int l = 0; l < hp->n_layers; l++) {
        const float *k = p->k + (size_t)l * n * kd, *v = p->v + (size_t)l * n * kd;
        for (int i = 0; i < 3; i++) {
            if (parts[i].n_tokens == 0)
                continue;
            struct kvcap_tensor_view kv = {.base = k + (size_t)parts[i].p0 * kd,
                                           .dtype = KVCAP_DTYPE_F32, .head_stride = hp->head_dim,
                                           .token_stride = (int64_t)kd};
            struct kvcap_tensor_view vv = kv;
            vv.base = v + (size_t)parts[i].p0 * kd;
            KVCAP_TRY(kvcap_cache_add_span(cache, seq, l, &parts[i], &kv, &vv));
        }
        KVCAP_TRY(kvcap_cache_add_post_queries(
            cache, seq, l, p->q_tail + (size_t)l * hp->n_heads * o->tail * hp->head_dim, o->tail));
    }
    return KVCAP_OK;
}

/* Writes a runtime config to a fresh temporary file; *path is malloc'ed. */
static enum kvcap_status write_temp_config(const char *text, char **path)
{
    const char *tmp = getenv("TMPDIR");
    char buf[4096];
    snprintf(buf, sizeof buf, "%s/kvcap-eval-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    int fd = mkstemp(buf);
    if (fd < 0)
        return kvcap_fail(KVCAP_ERR_IO, "%s: cannot create: %s", buf, strerror(errno));
    size_t len = strlen(text);
    ssize_t w = write(fd, text, len);
    close(fd);
    if (w != (ssize_t)len) {
        unlink(buf);
        return kvcap_fail(KVCAP_ERR_IO, "%s: cannot write", buf);
    }
    *path = strdup(buf);
    if (!*path) {
        unlink(buf);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    }
    return KVCAP_OK;
}

static enum kvcap_status create_cache(const struct model_ctx *mc, const char *yaml,
                                      const struct kvcap_artifact *art, int n_seqs,
                                      enum kvcap_dtype storage, int threads,
                                      const char *record_dir, struct kvcap_cache **out)
{
    char *cfg = NULL;
    KVCAP_TRY(write_temp_config(yaml, &cfg));
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    p.model = mc->g;
    p.n_seqs = n_seqs;
    p.storage = storage;
    p.artifact = art;
    p.config_path = cfg;
    p.record_dir = record_dir;
    p.n_threads = threads;
    enum kvcap_status s = kvcap_cache_create(&p, out);
    unlink(cfg);
    free(cfg);
    return s;
}

/* ---- record ------------------------------------------------------------------------------ */
static const char *const k_full_yaml =
    "policies: {vision: full, text: full, generated: full}\nfallback: none\n";

static int cmd_record(const struct options *o)
{
    struct model_ctx mc;
    enum kvcap_status s = model_open(o->model, &mc, o->quiet);
    if (s != KVCAP_OK)
        return cli_fail(s);
    struct corpus corpus;
    const int chunk_len = prompt_len(o) + o->decode;
    s = corpus_load(mc.tok, o->corpus, o->docs, chunk_len, &corpus);
    if (s != KVCAP_OK) {
        model_close(&mc);
        return cli_fail(s);
    }
    int n_chunks = corpus.n_chunks;
    if (o->max_chunks && o->max_chunks < n_chunks)
        n_chunks = o->max_chunks;
    if (n_chunks == 0) {
        corpus_free(&corpus), model_close(&mc);
        return cli_usage_error("%s: the documents (%lld tokens) hold no chunk of %d tokens",
                               o->docs, (long long)corpus.total_tokens, chunk_len);
    }
    s = kvcap_make_dirs(o->out);
    if (s != KVCAP_OK) {
        corpus_free(&corpus), model_close(&mc);
        return cli_fail(s);
    }
    if (!o->quiet)
        fprintf(stderr, "kvcap-eval: record: %d documents, %lld tokens -> %d chunks of %d + %d "
                "+ %d tokens (+%d decode steps)\n", corpus.n_docs,
                (long long)corpus.total_tokens, n_chunks, o->head, o->span, o->tail, o->decode);
    const int batch = 8;
    struct kvllama_decoder *dec = NULL;
    float *logits = NULL;
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
            s = prompt_prefill(&mc, o, &corpus.chunks[first + i], &p);
            if (s == KVCAP_OK) {
                s = prompt_to_cache(&mc, o, &p, cache, i);
                prompt_free(&p);
            }
        }
        for (int t = 0; s == KVCAP_OK && t < o->decode; t++) {
            for (int i = 0; i < nb; i++) {
                ids[i] = corpus.chunks[first + i].ids[prompt_len(o) + t];
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
    free(logits);
    corpus_free(&corpus);
    model_close(&mc);
    if (s != KVCAP_OK)
        return cli_fail(s);
    if (!o->quiet)
        fprintf(stderr, "kvcap-eval: recorded %d spans into %s in %.1f s\n", n_chunks, o->out,
                kvcap_seconds() - t0);
    return 0;
}

/* ---- run --------------------------------------------------------------------------------- */
struct run {
    char id[48], label[48], yaml[1024];
    const char *policy;
    double retention;
    const struct kvcap_artifact *art;
    int freekv_budget;                /* tokens, freekv runs */
    struct kvcap_cache *cache;        /* the cache of the current phase */
    struct kvllama_group group;
    /* results */
    int32_t *generated;               /* [prompts][generate] */
    int32_t *forced_top1;             /* [prompts][generate]: argmax under teacher forcing */
    double nll_sum;
    int64_t nll_count;
    double bytes_held, bytes_held_span, bytes_read_step, step_ms;
    double *cos_sum, *err_sum;        /* [layers] */
    int64_t attn_count;
};

static void add_run(struct run *runs, int *n, const char *policy, const char *label,
                    double retention, const char *yaml_fmt, ...) KVCAP_PRINTF(6, 7);

static void add_run(struct run *runs, int *n, const char *policy, const char *label,
                    double retention, const char *yaml_fmt, ...)
{
    struct run *r = &runs[(*n)++];
    memset(r, 0, sizeof *r);
    r->policy = policy;
    snprintf(r->label, sizeof r->label, "%s", label);
    r->retention = retention;
    if (retention >= 1.0)
        snprintf(r->id, sizeof r->id, "%s", policy);
    else
        snprintf(r->id, sizeof r->id, "%s@%.2f", label, retention);
    for (char *c = r->id; *c; c++)
        if (*c == ' ' || *c == '(' || *c == ')')
            *c = '-';
    va_list ap;
    va_start(ap, yaml_fmt);
    vsnprintf(r->yaml, sizeof r->yaml, yaml_fmt, ap);
    va_end(ap);
}

/* The policies × retentions of one evaluation. FreeKV attends `budget` tokens of the span per
 * KV head and step (pages of 8: one sink page, two window pages, the rest chosen). */
static int build_runs(const struct options *o, struct kvcap_artifact **arts, struct run *runs)
{
    int n = 0;
    add_run(runs, &n, "full", "full", 1.0, "%s", k_full_yaml);
    for (int i = 0; i < o->n_retentions; i++) {
        const double r = o->retentions[i];
        const int keep = (int)lround(r * o->span);
        add_run(runs, &n, "streaming", "streaming", r,
                "policies: {vision: streaming, text: full, generated: full}\n"
                "streaming: {sinks: 4, window: %d}\n", keep > 8 ? keep - 4 : 4);
        add_run(runs, &n, "flashcache", "flashcache", r,
                "policies: {vision: flashcache, text: full, generated: full}\n"
                "flashcache: {retention: %.4f, min_tokens: 8, sinks: 4, window: 16}\n", r);
        add_run(runs, &n, "vlcache", "vlcache", r,
                "policies: {vision: vlcache, text: full, generated: full}\n"
                "vlcache: {budget: %.4f, sinks: 4, window: 16}\n", r);
        int budget = keep < 24 ? 24 : keep;
        add_run(runs, &n, "freekv", "freekv", r,
                "policies: {vision: freekv, text: full, generated: full}\n"
                "freekv: {page_size: 8, budget: %d, tau: 0.9, sink_pages: 1, window_pages: 2}\n",
                budget);
        runs[n - 1].freekv_budget = budget;
    }
    const char *last_variant = NULL;
    for (int a = 0; a < o->n_artifacts; a++) {
        char label[48];
        snprintf(label, sizeof label, "kvcapsule %s", o->artifacts[a].variant);
        add_run(runs, &n, "kvcapsule", label, o->artifacts[a].retention,
                "policies: {vision: kvcapsule, text: full, generated: full}\nfallback: none\n");
        runs[n - 1].art = arts[a];
        last_variant = o->artifacts[a].variant;
    }
    /* The composition: KVCapsule on the span, the text kept, generated tokens streamed. */
    for (int a = 0; a < o->n_artifacts; a++) {
        if (strcmp(o->artifacts[a].variant, last_variant))
            continue;
        add_run(runs, &n, "composition", "composition", o->artifacts[a].retention,
                "policies: {vision: kvcapsule, text: full, generated: streaming}\n"
                "fallback: none\nstreaming: {sinks: 4, window: 64}\n");
        runs[n - 1].art = arts[a];
    }
    return n;
}

/* Creates every run's cache for the prompts and hands each prompt over; measures bytes. */
static enum kvcap_status phase_setup(const struct options *o, const struct model_ctx *mc,
                                     struct run *runs, int n_runs, const struct prompt *prompts,
                                     int n_prompts, int measure)
{
    for (int r = 0; r < n_runs; r++) {
        struct run *run = &runs[r];
        KVCAP_TRY(create_cache(mc, run->yaml, run->art, n_prompts, o->storage, o->threads, NULL,
                               &run->cache));
        for (int p = 0; p < n_prompts; p++) {
            KVCAP_TRY(prompt_to_cache(mc, o, &prompts[p], run->cache, p));
            KVCAP_TRY(kvcap_cache_end_prefill(run->cache, p));
        }
        run->group = (struct kvllama_group){.cache = run->cache, .n_seqs = n_prompts};
        if (measure) {
            struct kvcap_cache_stats st;
            KVCAP_TRY(kvcap_cache_stats(run->cache, &st));
            run->bytes_held = (double)st.bytes_held / n_prompts;
            run->bytes_held_span = (double)st.bytes_by_kind[KVCAP_SPAN_VISION] / n_prompts;
        }
    }
    return KVCAP_OK;
}

static void phase_teardown(struct run *runs, int n_runs)
{
    for (int r = 0; r < n_runs; r++) {
        kvcap_cache_free(runs[r].cache);
        runs[r].cache = NULL;
    }
}

/* Greedy generation (phase 0) or teacher forcing (phase 1), all runs batched. */
static enum kvcap_status decode_phase(const struct options *o, const struct model_ctx *mc,
                                      struct run *runs, int n_runs,
                                      const struct prompt *prompts, int n_prompts, int forced)
{
    const int rows = n_runs * n_prompts, V = mc->hp->n_vocab, P = prompt_len(o);
    struct kvllama_decoder *dec = NULL;
    struct kvllama_group *groups = calloc((size_t)n_runs, sizeof *groups);
    float *logits = malloc((size_t)rows * V * sizeof *logits);
    int32_t *ids = malloc((size_t)rows * sizeof *ids);
    int *pos = malloc((size_t)rows * sizeof *pos);
    enum kvcap_status s = KVCAP_OK;
    if (!groups || !logits || !ids || !pos)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for %d decode rows", rows);
    if (s == KVCAP_OK)
        s = kvllama_decoder_create(mc->model, rows, &dec);
    /* The first token comes from the prefill, which every policy shares. */
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++)
        for (int p = 0; p < n_prompts; p++) {
            const int32_t first = forced ? prompts[p].chunk->ids[P]
                                         : kvllama_argmax(prompts[p].logits, V);
            ids[r * n_prompts + p] = first;
            if (forced) {
                runs[r].nll_sum -= kvllama_log_prob(prompts[p].logits, V, first);
                runs[r].nll_count++;
                runs[r].forced_top1[(size_t)p * o->generate] = kvllama_argmax(prompts[p].logits, V);
            } else {
                runs[r].generated[(size_t)p * o->generate] = first;
            }
        }
    for (int r = 0; r < n_runs; r++)
        groups[r] = runs[r].group;
    struct cli_progress bar;
    cli_progress_begin(&bar, forced ? "teacher-forced" : "generating", o->quiet);
    const int steps = o->generate - 1;
    for (int t = 0; s == KVCAP_OK && t < steps; t++) {
        for (int i = 0; i < rows; i++)
            pos[i] = P + t;
        for (int r = 0; r < n_runs; r++)
            groups[r].measure_bytes = !forced && t == steps - 1; /* the last step, all layers */
        s = kvllama_decode(dec, groups, n_runs, ids, pos, logits);
        for (int r = 0; s == KVCAP_OK && r < n_runs; r++)
            for (int p = 0; p < n_prompts; p++) {
                const int row = r * n_prompts + p;
                const float *lg = logits + (size_t)row * V;
                int32_t next;
                if (forced) {
                    next = prompts[p].chunk->ids[P + t + 1];
                    runs[r].nll_sum -= kvllama_log_prob(lg, V, next);
                    runs[r].nll_count++;
                    runs[r].forced_top1[(size_t)p * o->generate + t + 1] = kvllama_argmax(lg, V);
                } else {
                    next = kvllama_argmax(lg, V);
                    runs[r].generated[(size_t)p * o->generate + t + 1] = next;
                }
                ids[row] = next;
            }
        cli_progress_update(&bar, t + 1, steps);
    }
    if (s == KVCAP_OK && !forced) {
        for (int r = 0; r < n_runs; r++) {
            runs[r].step_ms = steps ? 1e3 * groups[r].attend_seconds / steps : 0.0;
            runs[r].bytes_read_step = (double)groups[r].bytes_read;
        }
    }
    kvllama_decoder_free(dec);
    free(groups), free(logits), free(ids), free(pos);
    return s;
}

/* Attention fidelity on recorded held-out spans: every run's cache holds the recorded spans;
 * each recorded decode query attends to it and to the full span; per layer, the mean cosine and
 * relative L2 error of the outputs. */
static enum kvcap_status attention_fidelity(const struct options *o, const struct model_ctx *mc,
                                            struct run *runs, int n_runs)
{
    const char *paths[1] = {o->heldout_data};
    struct kvcap_dataset *ds = NULL;
    KVCAP_TRY(kvcap_dataset_open(paths, 1, &ds));
    const struct kvcap_model_geometry *g = kvcap_dataset_geometry(ds);
    enum kvcap_status s = KVCAP_OK;
    if (g->n_layers != mc->g.n_layers || g->n_kv_heads != mc->g.n_kv_heads ||
        g->n_q_heads != mc->g.n_q_heads || g->head_dim != mc->g.head_dim)
        s = kvcap_fail(KVCAP_ERR_GEOMETRY, "%s: recorded with another model geometry",
                       o->heldout_data);
    const int L = g->n_layers, H = g->n_q_heads, KV = g->n_kv_heads, d = g->head_dim;
    const int max_spans = 16;
    /* Collect up to max_spans spans of the configured grid, converted to f32. */
    float *k[16] = {0}, *v[16] = {0}, *qp[16] = {0}, *qd[16] = {0};
    int n_spans = 0, n_dec = -1, n_post = -1, p0[16] = {0};
    const struct kvcap_span_view *sv = NULL;
    while (s == KVCAP_OK && n_spans < max_spans && (s = kvcap_dataset_next(ds, &sv)) == KVCAP_OK &&
           sv) {
        if (sv->rows != 1 || sv->cols != o->span || !sv->q_dec[0] || !sv->q_post[0])
            continue;
        const int nd = (int)sv->q_dec[0]->shape[1], np = (int)sv->q_post[0]->shape[1];
        if ((n_dec >= 0 && nd != n_dec) || (n_post >= 0 && np != n_post))
            continue;
        n_dec = nd, n_post = np;
        const size_t kvn = (size_t)KV * o->span * d, qpn = (size_t)H * np * d;
        const size_t qdn = (size_t)H * nd * d;
        int i = n_spans++;
        p0[i] = sv->p0;
        k[i] = malloc(L * kvn * sizeof(float)), v[i] = malloc(L * kvn * sizeof(float));
        qp[i] = malloc(L * qpn * sizeof(float)), qd[i] = malloc(L * qdn * sizeof(float));
        if (!k[i] || !v[i] || !qp[i] || !qd[i]) {
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for recorded spans");
            break;
        }
        for (int l = 0; s == KVCAP_OK && l < L; l++) {
            s = kvcap_convert_to_f32(sv->k[l]->dtype, sv->k[l]->data, kvn, k[i] + l * kvn);
            if (s == KVCAP_OK)
                s = kvcap_convert_to_f32(sv->v[l]->dtype, sv->v[l]->data, kvn, v[i] + l * kvn);
            if (s == KVCAP_OK)
                s = kvcap_convert_to_f32(sv->q_post[l]->dtype, sv->q_post[l]->data, qpn,
                                         qp[i] + l * qpn);
            if (s == KVCAP_OK)
                s = kvcap_convert_to_f32(sv->q_dec[l]->dtype, sv->q_dec[l]->data, qdn,
                                         qd[i] + l * qdn);
        }
    }
    kvcap_dataset_close(ds);
    if (s == KVCAP_OK && n_spans == 0)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                       "%s: no recorded 1 x %d span with post and decode queries",
                       o->heldout_data, o->span);
    const size_t qrow = (size_t)n_spans * H * d;
    float *q = malloc(qrow * sizeof *q), *ref = malloc(L * (size_t)n_dec * qrow * sizeof *ref);
    float *outp = malloc(qrow * sizeof *outp);
    if (s == KVCAP_OK && (!q || !ref || !outp))
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for fidelity outputs");
    /* runs[0] is full: its outputs are the reference. */
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++) {
        struct run *run = &runs[r];
        struct kvcap_cache *cache = NULL;
        s = create_cache(mc, run->yaml, run->art, n_spans, o->storage, o->threads, NULL, &cache);
        for (int i = 0; s == KVCAP_OK && i < n_spans; i++) {
            const struct kvcap_span_desc sd = {KVCAP_SPAN_VISION, o->span, 1, o->span, p0[i]};
            for (int l = 0; s == KVCAP_OK && l < L; l++) {
                const size_t kvn = (size_t)KV * o->span * d;
                struct kvcap_tensor_view kv = {.base = k[i] + l * kvn, .dtype = KVCAP_DTYPE_F32,
                                               .head_stride = (int64_t)o->span * d,
                                               .token_stride = d};
                struct kvcap_tensor_view vv = kv;
                vv.base = v[i] + l * kvn;
                s = kvcap_cache_add_span(cache, i, l, &sd, &kv, &vv);
                if (s == KVCAP_OK)
                    s = kvcap_cache_add_post_queries(cache, i, l,
                                                     qp[i] + (size_t)l * H * n_post * d, n_post);
            }
            if (s == KVCAP_OK)
                s = kvcap_cache_end_prefill(cache, i);
        }
        if (s == KVCAP_OK && !(run->cos_sum = calloc((size_t)L, sizeof(double))))
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
        if (s == KVCAP_OK && !(run->err_sum = calloc((size_t)L, sizeof(double))))
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
        for (int t = 0; s == KVCAP_OK && t < n_dec; t++)
            for (int l = 0; s == KVCAP_OK && l < L; l++) {
                for (int i = 0; i < n_spans; i++)
                    for (int h = 0; h < H; h++)
                        memcpy(q + ((size_t)i * H + h) * d,
                               qd[i] + (((size_t)l * H + h) * n_dec + t) * d, d * sizeof *q);
                float *dst = r == 0 ? ref + ((size_t)t * L + l) * qrow : outp;
                s = kvcap_cache_attend(cache, l, q, dst);
                if (s != KVCAP_OK)
                    break;
                const float *base = ref + ((size_t)t * L + l) * qrow;
                for (size_t row = 0; row < (size_t)n_spans * H; row++) {
                    double dot = 0, na = 0, nb = 0, de = 0;
                    for (int c = 0; c < d; c++) {
                        const double a = dst[row * d + c], b = base[row * d + c];
                        dot += a * b, na += a * a, nb += b * b, de += (a - b) * (a - b);
                    }
                    run->cos_sum[l] += na > 0 && nb > 0 ? dot / sqrt(na * nb) : 1.0;
                    run->err_sum[l] += nb > 0 ? sqrt(de / nb) : 0.0;
                }
            }
        run->attn_count = (int64_t)n_dec * n_spans * H;
        kvcap_cache_free(cache);
    }
    free(q), free(ref), free(outp);
    for (int i = 0; i < n_spans; i++)
        free(k[i]), free(v[i]), free(qp[i]), free(qd[i]);
    return s;
}

/* ---- metrics.json --------------------------------------------------------------------------- */
static cJSON *num_or_null(double x) { return isfinite(x) ? cJSON_CreateNumber(x) : cJSON_CreateNull(); }

static void add_masks(cJSON *root, const struct options *o)
{
    cJSON *masks = cJSON_AddArrayToObject(root, "masks");
    /* One panel per variant, at the retention closest to 0.4. */
    for (int a = 0; a < o->n_artifacts; a++) {
        int best = a;
        for (int b = 0; b < o->n_artifacts; b++)
            if (!strcmp(o->artifacts[b].variant, o->artifacts[a].variant) &&
                fabs(o->artifacts[b].retention - 0.4) < fabs(o->artifacts[best].retention - 0.4))
                best = b;
        if (best != a)
            continue;
        struct kvcap_artifact *art = NULL;
        if (kvcap_artifact_open(o->artifacts[a].path, &art) != KVCAP_OK)
            continue;
        int b = kvcap_artifact_find_bucket(art, 1, o->span);
        if (b >= 0) {
            const struct kvcap_bucket *bk = &art->buckets[b];
            cJSON *m = cJSON_CreateObject();
            char name[96];
            snprintf(name, sizeof name, "1x%d %s (retention %.2f)", o->span,
                     o->artifacts[a].variant, o->artifacts[a].retention);
            cJSON_AddStringToObject(m, "bucket", name);
            cJSON_AddNumberToObject(m, "n_tokens", o->span);
            cJSON_AddNumberToObject(m, "heads", art->model.n_kv_heads);
            cJSON *kept = cJSON_AddArrayToObject(m, "kept");
            for (int l = 0; l < art->model.n_layers; l++) {
                cJSON *layer = cJSON_CreateArray();
                for (int h = 0; h < art->model.n_kv_heads; h++) {
                    const struct kvcap_unit_maps *u = kvcap_artifact_unit(art, l, h, b);
                    cJSON *head = cJSON_CreateArray();
                    const int tile = bk->structure == KVCAP_STRUCTURE_TILED ? bk->tile_cols
                                                                            : o->span;
                    for (int j = 0; j < o->span; j++)
                        for (int i = 0; i < u->rk; i++)
                            if (u->mask[i] == j % tile) {
                                cJSON_AddItemToArray(head, cJSON_CreateNumber(j));
                                break;
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

/* The text of the first n generated tokens (control tokens as written). */
static void generated_text(const struct model_ctx *mc, const int32_t *ids, int n, char *out,
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

static enum kvcap_status write_metrics(const struct options *o, const struct model_ctx *mc,
                                       const struct corpus *corpus, struct run *runs,
                                       int n_runs, int n_prompts, double bandwidth_gbs,
                                       const char *command, const char *path)
{
    /* The end of the first prompt: what the samples continue. */
    char prompt_tail_text[1024] = "";
    if (corpus->n_chunks > 0) {
        const int n = prompt_len(o), k = n < 48 ? n : 48;
        generated_text(mc, corpus->chunks[0].ids + (n - k), k, prompt_tail_text,
                       sizeof prompt_tail_text);
    }
    const struct run *full = &runs[0];
    const int L = mc->hp->n_layers;
    cJSON *root = cJSON_CreateObject();
    cJSON_AddNumberToObject(root, "format", 1);
    char title[160];
    /* The file's stem names the model better than general.name (often a training-run tag). */
    const char *base = strrchr(o->model, '/');
    base = base ? base + 1 : o->model;
    char name[128];
    snprintf(name, sizeof name, "%s", base);
    char *ext = strstr(name, ".gguf");
    if (ext)
        *ext = '\0';
    snprintf(title, sizeof title, "kvcap evaluation: %s", name);
    cJSON_AddStringToObject(root, "title", title);
    cJSON_AddStringToObject(root, "command", command);
    char when[32];
    time_t now = time(NULL);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    cJSON_AddStringToObject(root, "created", when);
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "name", name);
    cJSON_AddStringToObject(model, "gguf_name", mc->g.name);
    cJSON_AddStringToObject(model, "file", o->model);
    cJSON_AddNumberToObject(model, "layers", L);
    cJSON_AddNumberToObject(model, "q_heads", mc->hp->n_heads);
    cJSON_AddNumberToObject(model, "kv_heads", mc->hp->n_kv_heads);
    cJSON_AddNumberToObject(model, "head_dim", mc->hp->head_dim);
    cJSON *cj = cJSON_AddObjectToObject(root, "corpus");
    char src[512];
    snprintf(src, sizeof src, "%s (Debian base-files license texts)", o->corpus);
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
    cJSON *setup = cJSON_AddObjectToObject(root, "setup");
    cJSON_AddNumberToObject(setup, "head_tokens", o->head);
    cJSON_AddNumberToObject(setup, "span_tokens", o->span);
    cJSON_AddNumberToObject(setup, "tail_tokens", o->tail);
    cJSON_AddNumberToObject(setup, "generate_tokens", o->generate);
    cJSON_AddNumberToObject(setup, "continuation_tokens", o->generate);
    cJSON_AddNumberToObject(setup, "prompts", n_prompts);
    cJSON_AddNumberToObject(setup, "threads", o->threads ? o->threads
                                                         : (int)sysconf(_SC_NPROCESSORS_ONLN));
    cJSON_AddStringToObject(setup, "storage", kvcap_dtype_name(o->storage));
    cJSON_AddItemToObject(setup, "read_bandwidth_gbs", num_or_null(bandwidth_gbs));
    cJSON *jr = cJSON_AddArrayToObject(root, "runs");
    for (int r = 0; r < n_runs; r++) {
        const struct run *run = &runs[r];
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "id", run->id);
        cJSON_AddStringToObject(j, "policy", run->policy);
        cJSON_AddStringToObject(j, "label", run->label);
        cJSON_AddNumberToObject(j, "retention", run->retention);
        double compression = run->bytes_held_span > 0 ? full->bytes_held_span / run->bytes_held_span
                                                      : NAN;
        if (run->freekv_budget)
            compression = (double)o->span / run->freekv_budget;
        cJSON_AddItemToObject(j, "compression", num_or_null(compression));
        int64_t agree = 0, total = 0;
        cJSON *fd = cJSON_AddArrayToObject(j, "first_divergence");
        for (int p = 0; p < n_prompts; p++) {
            int first = o->generate;
            for (int t = 0; t < o->generate; t++) {
                const size_t i = (size_t)p * o->generate + t;
                if (run->generated[i] == full->generated[i])
                    agree++;
                else if (first == o->generate)
                    first = t;
                total++;
            }
            cJSON_AddItemToArray(fd, cJSON_CreateNumber(first));
        }
        cJSON_AddNumberToObject(j, "token_agreement", (double)agree / (double)total);
        int64_t same = 0;
        for (size_t i = 0; i < (size_t)total; i++)
            same += run->forced_top1[i] == full->forced_top1[i];
        cJSON_AddNumberToObject(j, "next_token_agreement", (double)same / (double)total);
        char text[2048];
        generated_text(mc, run->generated, o->generate < 64 ? o->generate : 64, text, sizeof text);
        cJSON_AddStringToObject(j, "sample", text);
        const double nll = run->nll_sum / run->nll_count, nll_full = full->nll_sum / full->nll_count;
        cJSON_AddNumberToObject(j, "nll", nll);
        cJSON_AddNumberToObject(j, "nll_full", nll_full);
        cJSON_AddNumberToObject(j, "nll_delta", nll - nll_full);
        cJSON *cs = cJSON_AddArrayToObject(j, "attn_cosine");
        cJSON *es = cJSON_AddArrayToObject(j, "attn_rel_err");
        for (int l = 0; l < L; l++) {
            cJSON_AddItemToArray(cs, num_or_null(run->cos_sum[l] / (double)run->attn_count));
            cJSON_AddItemToArray(es, num_or_null(run->err_sum[l] / (double)run->attn_count));
        }
        cJSON_AddNumberToObject(j, "bytes_held", run->bytes_held);
        cJSON_AddNumberToObject(j, "bytes_held_full", full->bytes_held);
        cJSON_AddNumberToObject(j, "bytes_read_per_step", run->bytes_read_step / n_prompts);
        cJSON_AddNumberToObject(j, "bytes_read_per_step_full", full->bytes_read_step / n_prompts);
        cJSON_AddNumberToObject(j, "step_ms", run->step_ms);
        cJSON_AddNumberToObject(j, "step_ms_full", full->step_ms);
        cJSON_AddItemToArray(jr, j);
    }
    add_masks(root, o);
    cJSON *notes = cJSON_AddArrayToObject(root, "notes");
    static const char *const k_notes[] = {
        "Each prompt is HEAD text tokens kept in full, a SPAN-token compressible span (a 1 x SPAN "
        "grid: every policy compresses it) and TAIL text tokens kept in full, as system text, "
        "image and question are in a vision-language prompt; generated tokens are kept in full "
        "except by the composition, which streams them (4 sinks + 64 recent).",
        "Compression: the bytes full holds for the span over the bytes the policy holds for it. "
        "FreeKV keeps the whole span in host memory (bytes held above 100 %) and attends to a "
        "budget of pages per step: its compression is span tokens over tokens attended.",
        "Greedy agreement compares each generated position with full's: after the first "
        "different token the continuations diverge, so it mostly measures how long they stay "
        "identical (first divergence). Next-token agreement compares, teacher-forced on the "
        "held-out text, each step's most likely token with full's: a per-step decision "
        "agreement that does not cascade.",
        "Attention fidelity: recorded held-out spans (kvcap-eval record) attended alone by "
        "their recorded decode queries, compressed vs full, per layer.",
        "Step time: append + attention of one decode step for all prompts of a run, all layers, "
        "measured inside the batched run. Spans of 256 tokens leave fixed per-call costs "
        "visible; kvcap-bench measures 8K-token spans."};
    for (size_t i = 0; i < sizeof k_notes / sizeof *k_notes; i++)
        cJSON_AddItemToArray(notes, cJSON_CreateString(k_notes[i]));
    if (prompt_tail_text[0])
        cJSON_AddStringToObject(root, "prompt_sample", prompt_tail_text);
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    if (!text)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for metrics.json");
    enum kvcap_status s = kvcap_write_file_atomic(path, text, strlen(text));
    free(text);
    return s;
}

/* Read bandwidth of this machine now: the best of a few passes over 256 MiB. */
static double measure_bandwidth_gbs(void)
{
    const size_t n = (size_t)64 << 20; /* floats */
    float *a = malloc(n * sizeof *a);
    if (!a)
        return NAN;
    for (size_t i = 0; i < n; i++)
        a[i] = (float)(i & 1023);
    double best = 0.0;
    volatile float sink = 0.0f;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = kvcap_seconds();
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp parallel for reduction(+ : s0, s1, s2, s3)
        for (size_t i = 0; i < n; i += 4) {
            s0 += a[i], s1 += a[i + 1], s2 += a[i + 2], s3 += a[i + 3];
        }
        double dt = kvcap_seconds() - t0;
        sink += s0 + s1 + s2 + s3;
        double gbs = n * sizeof *a / dt / 1e9;
        best = gbs > best ? gbs : best;
    }
    free(a);
    return best;
}

static int cmd_run(const struct options *o, int argc, char **argv)
{
    char command[8192] = "";
    if (o->command)
        snprintf(command, sizeof command, "%s", o->command);
    else
        for (int i = 0; i < argc; i++) {
            size_t len = strlen(command);
            snprintf(command + len, sizeof command - len, "%s%s", i ? " " : "", argv[i]);
        }
    struct model_ctx mc;
    enum kvcap_status s = model_open(o->model, &mc, o->quiet);
    if (s != KVCAP_OK)
        return cli_fail(s);
    struct kvcap_artifact *arts[MAX_ARTIFACTS] = {0};
    for (int a = 0; s == KVCAP_OK && a < o->n_artifacts; a++)
        s = kvcap_artifact_open(o->artifacts[a].path, &arts[a]);
    struct corpus corpus = {0};
    if (s == KVCAP_OK)
        s = corpus_load(mc.tok, o->corpus, o->docs, prompt_len(o) + o->generate, &corpus);
    if (s == KVCAP_OK && corpus.n_chunks < 1)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "%s: no chunk of %d tokens in the documents",
                       o->docs, prompt_len(o) + o->generate);
    const int n_prompts = s == KVCAP_OK && corpus.n_chunks < o->prompts ? corpus.n_chunks
                                                                          : o->prompts;
    static struct run runs[MAX_RUNS];
    const int n_runs = build_runs(o, arts, runs);
    struct prompt *prompts = calloc((size_t)n_prompts, sizeof *prompts);
    if (s == KVCAP_OK && !prompts)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++)
        if (!(runs[r].generated = calloc((size_t)n_prompts * o->generate, sizeof(int32_t))) ||
            !(runs[r].forced_top1 = calloc((size_t)n_prompts * o->generate, sizeof(int32_t))))
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    if (s == KVCAP_OK)
        s = kvcap_make_dirs(o->out);
    double t0 = kvcap_seconds();
    if (s == KVCAP_OK && !o->quiet)
        fprintf(stderr, "kvcap-eval: run: %d runs x %d prompts of %d + %d + %d tokens, %d "
                "generated\n", n_runs, n_prompts, o->head, o->span, o->tail, o->generate);
    for (int p = 0; s == KVCAP_OK && p < n_prompts; p++)
        s = prompt_prefill(&mc, o, &corpus.chunks[p], &prompts[p]);
    if (s == KVCAP_OK)
        s = phase_setup(o, &mc, runs, n_runs, prompts, n_prompts, 1);
    if (s == KVCAP_OK)
        s = decode_phase(o, &mc, runs, n_runs, prompts, n_prompts, 0);
    phase_teardown(runs, n_runs);
    if (s == KVCAP_OK)
        s = phase_setup(o, &mc, runs, n_runs, prompts, n_prompts, 0);
    if (s == KVCAP_OK)
        s = decode_phase(o, &mc, runs, n_runs, prompts, n_prompts, 1);
    phase_teardown(runs, n_runs);
    if (s == KVCAP_OK)
        s = attention_fidelity(o, &mc, runs, n_runs);
    double bw = s == KVCAP_OK ? measure_bandwidth_gbs() : NAN;
    char metrics[4200], html[4200], csv[4200];
    snprintf(metrics, sizeof metrics, "%s/metrics.json", o->out);
    snprintf(html, sizeof html, "%s/report.html", o->out);
    snprintf(csv, sizeof csv, "%s/metrics.csv", o->out);
    if (s == KVCAP_OK)
        s = write_metrics(o, &mc, &corpus, runs, n_runs, n_prompts, bw, command, metrics);
    if (s == KVCAP_OK)
        s = kvcap_report_write(metrics, html, csv);
    for (int p = 0; prompts && p < n_prompts; p++)
        prompt_free(&prompts[p]);
    free(prompts);
    for (int r = 0; r < n_runs; r++)
        free(runs[r].generated), free(runs[r].forced_top1), free(runs[r].cos_sum),
            free(runs[r].err_sum);
    for (int a = 0; a < o->n_artifacts; a++)
        kvcap_artifact_free(arts[a]);
    corpus_free(&corpus);
    model_close(&mc);
    if (s != KVCAP_OK)
        return cli_fail(s);
    if (!o->quiet)
        fprintf(stderr, "kvcap-eval: done in %.1f s\n", kvcap_seconds() - t0);
    printf("%s\n", html);
    return 0;
}

int main(int argc, char **argv)
{
    struct options o;
    int rc = parse_options(argc, argv, &o);
    if (rc)
        return rc;
    cli_init("kvcap-eval", 0);
    return o.record ? cmd_record(&o) : cmd_run(&o, argc, argv);
}
