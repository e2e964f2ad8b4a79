/* generate.c — `kvcap-eval generate`: the reference engine on one prompt given as token ids,
 * its spans handed to a libkvcap cache under a runtime config, then greedy decoding and the
 * teacher-forced log-likelihood of a given continuation, as JSON on stdout. Other engines (the
 * Python/Hugging Face integration) compare themselves with it on the same ids, spans, config
 * and artifact. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/dtype.h"
#include "common/internal.h"
#include "eval/generate.h"
#include "engine/llama.h"
#include "kvcap.h"

#define GEN_MAX_SPANS 64

struct gen_span {
    enum kvcap_span_kind kind;
    int n, rows, cols;
};

struct gen_options {
    const char *model, *config, *artifact;
    int32_t *ids, *cont, *replay;
    int n_ids, n_cont, n_generate, n_spans, n_replay, prompt_queries;
    struct gen_span spans[GEN_MAX_SPANS];
    enum kvcap_dtype storage;
};

static void gen_usage(FILE *out)
{
    fprintf(out,
            "usage: kvcap-eval generate --ids LIST [options]\n"
            "\n"
            "The reference engine on one prompt: its spans go to a libkvcap cache under the\n"
            "runtime config, then greedy decoding and teacher forcing of a continuation. Prints\n"
            "JSON: the generated ids, the continuation's mean negative log-likelihood (nats per\n"
            "token) and next-token agreement, and the bytes the cache holds.\n"
            "\n"
            "options:\n"
            "  -m, --model FILE         GGUF model (default: $KVCAP_MODEL, else\n"
            "                           $HOME/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
            "      --ids LIST           prompt token ids, comma-separated\n"
            "      --spans LIST         the prompt's spans in order: text:N or vision:RxC, comma-\n"
            "                           separated, covering every id (default: one text span)\n"
            "  -c, --config FILE        runtime YAML (configs/runtime.yaml's keys)\n"
            "  -a, --artifact FILE      KVCapsule artifact\n"
            "      --storage T          f32 (default), f16 or bf16\n"
            "      --generate N         greedy tokens (default 32)\n"
            "      --continuation LIST  token ids to teacher-force after the prompt\n"
            "      --replay LIST        run KVzip's context-reconstruction pass (the prompt, these\n"
            "                           ids: the instruction to repeat it and the chat turn, the\n"
            "                           prompt again) and hand its queries to the cache (kvzip)\n"
            "                           instead of those after the last vision span\n"
            "      --prompt-queries     hand the cache every prompt token's query\n"
            "                           (expected_attention) instead\n"
            "  -h, --help               show this help\n");
}

/* A comma-separated list of token ids into a new array. */
static int parse_ids(const char *arg, const char *name, int32_t **out, int *n)
{
    int cap = 1;
    for (const char *p = arg; *p; p++)
        cap += *p == ',';
    int32_t *v = malloc(sizeof *v * (size_t)cap);
    if (!v)
        return cli_usage_error("%s: out of memory", name);
    int k = 0;
    const char *p = arg;
    while (*p) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (errno || end == p || x < 0 || x > INT32_MAX || (*end && *end != ',')) {
            free(v);
            return cli_usage_error("%s: '%s' is not a list of token ids", name, arg);
        }
        v[k++] = (int32_t)x;
        p = *end ? end + 1 : end;
    }
    if (k == 0) {
        free(v);
        return cli_usage_error("%s: no ids", name);
    }
    *out = v;
    *n = k;
    return 0;
}

static int parse_spans(const char *arg, struct gen_options *o)
{
    const char *p = arg;
    o->n_spans = 0;
    while (*p) {
        if (o->n_spans == GEN_MAX_SPANS)
            return cli_usage_error("--spans: at most %d spans", GEN_MAX_SPANS);
        struct gen_span *s = &o->spans[o->n_spans++];
        int used = 0;
        if (sscanf(p, "text:%d%n", &s->n, &used) == 1 && s->n > 0) {
            s->kind = KVCAP_SPAN_TEXT, s->rows = s->cols = 0;
        } else if (sscanf(p, "vision:%dx%d%n", &s->rows, &s->cols, &used) == 2 && s->rows > 0 &&
                   s->cols > 0) {
            s->kind = KVCAP_SPAN_VISION, s->n = s->rows * s->cols;
        } else {
            return cli_usage_error("--spans: '%s': expected text:N or vision:RxC", p);
        }
        p += used;
        if (*p && *p != ',')
            return cli_usage_error("--spans: '%s': expected text:N or vision:RxC", arg);
        p += *p == ',';
    }
    return 0;
}

static int gen_parse(int argc, char **argv, struct gen_options *o)
{
    memset(o, 0, sizeof *o);
    o->n_generate = 32;
    o->storage = KVCAP_DTYPE_F32;
    enum { O_IDS = 256, O_SPANS, O_STORAGE, O_GEN, O_CONT, O_REPLAY, O_PROMPTQ };
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},      {"ids", required_argument, 0, O_IDS},
        {"spans", required_argument, 0, O_SPANS},  {"config", required_argument, 0, 'c'},
        {"artifact", required_argument, 0, 'a'},   {"storage", required_argument, 0, O_STORAGE},
        {"generate", required_argument, 0, O_GEN}, {"continuation", required_argument, 0, O_CONT},
        {"replay", required_argument, 0, O_REPLAY}, {"help", no_argument, 0, 'h'},
        {"prompt-queries", no_argument, 0, O_PROMPTQ},
        {0, 0, 0, 0}};
    int c, rc = 0;
    const char *spans = NULL;
    optind = 2;
    while (!rc && (c = getopt_long(argc, argv, "m:c:a:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'c': o->config = optarg; break;
        case 'a': o->artifact = optarg; break;
        case O_IDS: /* given again: the last one counts */
            free(o->ids), o->ids = NULL;
            rc = parse_ids(optarg, "--ids", &o->ids, &o->n_ids);
            break;
        case O_CONT:
            free(o->cont), o->cont = NULL;
            rc = parse_ids(optarg, "--continuation", &o->cont, &o->n_cont);
            break;
        case O_REPLAY:
            free(o->replay), o->replay = NULL;
            rc = parse_ids(optarg, "--replay", &o->replay, &o->n_replay);
            break;
        case O_SPANS: spans = optarg; break;
        case O_PROMPTQ: o->prompt_queries = 1; break;
        case O_GEN: rc = cli_parse_int(optarg, "--generate", 0, 8192, &o->n_generate); break;
        case O_STORAGE:
            if (!kvcap_dtype_parse(optarg, &o->storage) ||
                !(o->storage == KVCAP_DTYPE_F32 || o->storage == KVCAP_DTYPE_F16 ||
                  o->storage == KVCAP_DTYPE_BF16))
                rc = cli_usage_error("--storage: '%s' is not f32, f16 or bf16", optarg);
            break;
        case 'h': gen_usage(stdout); exit(0);
        default: return 2;
        }
    }
    if (rc)
        return rc;
    if (optind < argc)
        return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (!o->ids)
        return cli_usage_error("--ids is required");
    if (o->replay && o->prompt_queries)
        return cli_usage_error("--replay and --prompt-queries: give one of them");
    if (spans) {
        rc = parse_spans(spans, o);
        if (rc)
            return rc;
    } else {
        o->n_spans = 1;
        o->spans[0] = (struct gen_span){KVCAP_SPAN_TEXT, o->n_ids, 0, 0};
    }
    int total = 0;
    for (int i = 0; i < o->n_spans; i++)
        total += o->spans[i].n;
    if (total != o->n_ids)
        return cli_usage_error("--spans: cover %d tokens, --ids has %d", total, o->n_ids);
    return 0;
}

/* A cache holding the prompt: every layer's spans (views into the prefill's NHD K/V), the
 * queries after the last vision span (VL-Cache's) or, with lse, the reconstruction pass's
 * (kvzip), the prefill ended. */
static enum kvcap_status gen_cache(const struct gen_options *o, const struct kvllama_model *m,
                                   const struct kvcap_artifact *art, const float *k,
                                   const float *v, const float *q_tail, const float *lse,
                                   int n_tail, struct kvcap_cache **out)
{
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    kvllama_geometry(m, &p.model);
    p.n_seqs = 1;
    p.storage = o->storage;
    p.artifact = art;
    p.config_path = o->config;
    p.reserve_tokens = o->n_generate > o->n_cont ? o->n_generate : o->n_cont;
    KVCAP_TRY(kvcap_cache_create(&p, out));
    const struct kvcap_model_geometry *g = &p.model;
    const int n = o->n_ids, H = g->n_kv_heads, d = g->head_dim;
    enum kvcap_status st = KVCAP_OK;
    for (int l = 0; l < g->n_layers && st == KVCAP_OK; l++) {
        int at = 0;
        for (int i = 0; i < o->n_spans && st == KVCAP_OK; i++) {
            const struct gen_span *s = &o->spans[i];
            const size_t off = ((size_t)l * n + at) * H * d;
            struct kvcap_tensor_view kv = {k + off, NULL, 0, KVCAP_DTYPE_F32, d, (int64_t)H * d};
            struct kvcap_tensor_view vv = {v + off, NULL, 0, KVCAP_DTYPE_F32, d, (int64_t)H * d};
            struct kvcap_span_desc desc = {s->kind, s->n, s->rows, s->cols, at};
            st = kvcap_cache_add_span(*out, 0, l, &desc, &kv, &vv);
            at += s->n;
        }
        if (st == KVCAP_OK && n_tail > 0)
            st = kvcap_cache_add_post_queries_lse(
                *out, 0, l, q_tail + (size_t)l * g->n_q_heads * n_tail * d,
                lse ? lse + (size_t)l * g->n_q_heads * n_tail : NULL, n_tail);
    }
    if (st == KVCAP_OK)
        st = kvcap_cache_end_prefill(*out, 0);
    if (st != KVCAP_OK) {
        kvcap_cache_free(*out);
        *out = NULL;
    }
    return st;
}

static void print_ids(const char *name, const int32_t *ids, int n)
{
    printf("  \"%s\": [", name);
    for (int i = 0; i < n; i++)
        printf("%s%d", i ? ", " : "", ids[i]);
    printf("]");
}

int kvcap_eval_generate(int argc, char **argv)
{
    struct gen_options o;
    int rc = gen_parse(argc, argv, &o);
    if (rc) {
        free(o.ids), free(o.cont), free(o.replay);
        return rc;
    }
    char model_default[4096];
    if (!o.model)
        o.model = kvllama_default_model(model_default, sizeof model_default);
    struct kvllama_model *m = NULL;
    struct kvcap_artifact *art = NULL;
    struct kvllama_decoder *dec = NULL;
    struct kvcap_cache *gen = NULL, *tf = NULL;
    float *k = NULL, *v = NULL, *q_tail = NULL, *lse = NULL, *logits = NULL, *last = NULL;
    int32_t *out_ids = NULL;
    enum kvcap_status st = kvllama_load(o.model, &m);
    if (st == KVCAP_OK && o.artifact)
        st = kvcap_artifact_open(o.artifact, &art);
    struct kvcap_model_geometry g;
    int vocab = 0, n = o.n_ids, n_tail = 0;
    if (st == KVCAP_OK) {
        kvllama_geometry(m, &g);
        vocab = kvllama_hparams(m)->n_vocab;
        int end = 0, at = 0; /* the end of the last vision span */
        for (int i = 0; i < o.n_spans; i++) {
            at += o.spans[i].n;
            if (o.spans[i].kind == KVCAP_SPAN_VISION)
                end = at;
        }
        n_tail = end > 0 ? n - end : 0;
        if (o.replay) /* the reconstruction pass's queries instead */
            n_tail = o.n_replay + n;
        else if (o.prompt_queries) /* every prompt token's */
            n_tail = n;
        size_t kv = (size_t)g.n_layers * n * g.n_kv_heads * g.head_dim;
        k = malloc(sizeof(float) * kv);
        v = malloc(sizeof(float) * kv);
        q_tail = malloc(sizeof(float) * ((size_t)g.n_layers * g.n_q_heads * n_tail * g.head_dim + 1));
        logits = malloc(sizeof(float) * (size_t)vocab);
        last = malloc(sizeof(float) * (size_t)vocab);
        out_ids = malloc(sizeof(int32_t) * ((size_t)o.n_generate + 1));
        if (o.replay)
            lse = malloc(sizeof(float) * (size_t)g.n_layers * g.n_q_heads * n_tail);
        if (!k || !v || !q_tail || !logits || !last || !out_ids || (o.replay && !lse))
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "generate: out of memory");
    }
    if (st == KVCAP_OK) {
        struct kvllama_prefill_out po = {k, v, n_tail && !o.replay ? q_tail : NULL, n_tail,
                                         last, 1};
        st = kvllama_prefill(m, o.ids, n, &po);
    }
    if (st == KVCAP_OK && o.replay) {
        const struct kvllama_past past = {k, v, n, n}; /* continuing from the prompt's K/V */
        st = kvllama_reconstruct(m, o.ids, n, o.replay, o.n_replay, NULL, 0, &past, q_tail,
                                     lse);
    }
    if (st == KVCAP_OK)
        st = kvllama_decoder_create(m, 1, &dec);
    /* Greedy decoding. */
    if (st == KVCAP_OK)
        st = gen_cache(&o, m, art, k, v, q_tail, lse, n_tail, &gen);
    int n_out = 0;
    if (st == KVCAP_OK && o.n_generate > 0) {
        struct kvllama_group grp = {gen, 1, 0.0, 0, 0};
        int32_t t = kvllama_argmax(last, vocab);
        for (int i = 0; i < o.n_generate && st == KVCAP_OK; i++) {
            out_ids[n_out++] = t;
            if (i + 1 == o.n_generate)
                break;
            int pos = n + i;
            st = kvllama_decode(dec, &grp, 1, &t, &pos, logits);
            t = kvllama_argmax(logits, vocab);
        }
    }
    /* Teacher forcing on a second cache with the same prompt. */
    double nll = 0.0;
    int agree = 0;
    if (st == KVCAP_OK && o.n_cont > 0)
        st = gen_cache(&o, m, art, k, v, q_tail, lse, n_tail, &tf);
    if (st == KVCAP_OK && o.n_cont > 0) {
        struct kvllama_group grp = {tf, 1, 0.0, 0, 0};
        memcpy(logits, last, sizeof(float) * (size_t)vocab);
        for (int i = 0; i < o.n_cont && st == KVCAP_OK; i++) {
            nll -= kvllama_log_prob(logits, vocab, o.cont[i]);
            agree += kvllama_argmax(logits, vocab) == o.cont[i];
            if (i + 1 == o.n_cont)
                break;
            int pos = n + i;
            st = kvllama_decode(dec, &grp, 1, &o.cont[i], &pos, logits);
        }
    }
    struct kvcap_cache_stats s;
    if (st == KVCAP_OK)
        st = kvcap_cache_stats(gen, &s);
    if (st == KVCAP_OK) {
        printf("{\n");
        print_ids("generated", out_ids, n_out);
        printf(",\n  \"continuation_nll\": %.9g,\n  \"continuation_agreement\": %.9g,\n",
               o.n_cont ? nll / o.n_cont : 0.0, o.n_cont ? (double)agree / o.n_cont : 0.0);
        printf("  \"bytes_held\": %llu,\n  \"bytes_full_equivalent\": %llu\n}\n",
               (unsigned long long)s.bytes_held, (unsigned long long)s.bytes_full_equivalent);
    }
    kvcap_cache_free(gen);
    kvcap_cache_free(tf);
    kvllama_decoder_free(dec);
    kvcap_artifact_free(art);
    kvllama_free(m);
    free(k), free(v), free(q_tail), free(lse), free(logits), free(last), free(out_ids);
    free(o.ids), free(o.cont), free(o.replay);
    return st == KVCAP_OK ? 0 : cli_fail(st);
}
