/* options.c — kvcap-eval's command line: --help, parsing, and the checks before any work. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "engine/llama.h"
#include "engine/vision.h"
#include "eval/eval.h"

/* ---- Options --------------------------------------------------------------------------- */
/* The option of each artifact_use, as errors name it. */
static const char *const k_artifact_option[] = {"--kvcapsule", "--kvcapsule-exact",
                                                "--kvzip-basis"};

/* The calibration and development documents (scripts/eval-texts.tsv's test documents are none
 * of them: tests/splits.sh). */
#define DEFAULT_CALIB_DOCS "GPL-3,GPL-2,LGPL-2.1,LGPL-3,GFDL-1.3,MPL-1.1,GPL-1"
#define DEFAULT_HELDOUT_DOCS "Apache-2.0,MPL-2.0,Artistic,CC0-1.0"
const char eval_calib_docs[] = DEFAULT_CALIB_DOCS;
const char eval_heldout_docs[] = DEFAULT_HELDOUT_DOCS;

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
            "                           %s;\n"
            "                           run default, the development documents:\n"
            "                           %s)\n"
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
            "      --rows SET           run: all (default): every row, kvcap's variants included;\n"
            "                           headline: full, the papers' methods, random eviction\n"
            "                           and the --shipped row (a variant artifact is refused)\n"
            "      --random-seeds N     run: random eviction's seeds, 1..16 (default 8); its row\n"
            "                           is their mean, prompt by prompt\n"
            "      --compare FILE       run: another track's metrics.json (repeatable), shown\n"
            "                           beside this one in the report\n"
            "      --head N             tokens before the span, kept in full (default 16)\n"
            "      --span N             tokens of the compressible text span (default 256; the\n"
            "                           image track takes the grid's)\n"
            "      --tail N             tokens after it, kept in full (default 16)\n"
            "      --images N           run, image track: images per prompt, 1..%d, each a span\n"
            "                           on its grid, all different crops (default 1)\n"
            "      --gap N              text tokens between two images, kept in full\n"
            "                           (default 16)\n"
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
            "      --task-keys N        run: names in each retrieval query's span, one of them\n"
            "                           asked (RULER's multi-key needle in a haystack), 1..%d\n"
            "                           (default 1)\n"
            "      --task-values N      run: lines (codes) of the asked name, all asked for at\n"
            "                           once and all needed for a right answer (RULER's\n"
            "                           multi-value), 1..%d (default 1); the answer is read from\n"
            "                           %d greedy tokens per value\n"
            "      --storage T          cache storage f32, f16 or bf16 (default f16)\n"
            "      --threads N          threads per cache (default: all cores)\n"
            "      --command TEXT       run: the command recorded in the report as reproducing it\n"
            "                           (default: this command line)\n"
            "      --calibration-docs L run: the documents the artifacts were calibrated on, for\n"
            "                           the report\n"
            "  -q, --quiet              no progress\n"
            "  -V, --version            print the kvcap version\n"
            "  -h, --help               show this help\n",
            eval_calib_docs, eval_heldout_docs, MAX_IMAGES, TASK_DEPTHS, TASK_KEYS_MAX,
            TASK_VALUES_MAX, TASK_ANSWER_TOKENS);
}

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

int parse_options(int argc, char **argv, struct options *o)
{
    memset(o, 0, sizeof *o);
    o->head = 16, o->span = 256, o->tail = 16, o->decode = 16, o->prompts = 8, o->generate = 64;
    o->images = 1, o->gap = 16;
    o->continuation = 256, o->fidelity_steps = 32, o->task_queries = 64;
    o->task_keys = 1, o->task_values = 1;
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
           O_SEEDS, O_SHIPPED, O_SPLIT, O_ROWS, O_IMAGES, O_GAP, O_TASK_KEYS, O_TASK_VALUES };
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},   {"corpus", required_argument, 0, 'C'},
        {"docs", required_argument, 0, 'D'},    {"out", required_argument, 0, 'o'},
        {"span", required_argument, 0, O_SPAN}, {"head", required_argument, 0, O_HEAD},
        {"tail", required_argument, 0, O_TAIL},
        {"images", required_argument, 0, O_IMAGES},
        {"gap", required_argument, 0, O_GAP},
        {"decode", required_argument, 0, O_DECODE},
        {"max-chunks", required_argument, 0, O_MAXCH},
        {"kvcapsule", required_argument, 0, O_ART},
        {"retentions", required_argument, 0, O_RET},
        {"prompts", required_argument, 0, O_PROMPTS},
        {"generate", required_argument, 0, O_GEN},
        {"continuation", required_argument, 0, O_CONT},
        {"fidelity-steps", required_argument, 0, O_FID},
        {"task-queries", required_argument, 0, O_TASK},
        {"task-keys", required_argument, 0, O_TASK_KEYS},
        {"task-values", required_argument, 0, O_TASK_VALUES},
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
        {"rows", required_argument, 0, O_ROWS},
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
        case O_IMAGES: rc = cli_parse_int(optarg, "--images", 1, MAX_IMAGES, &o->images); break;
        case O_GAP: rc = cli_parse_int(optarg, "--gap", 1, 1024, &o->gap); break;
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
        case O_FID:
            rc = cli_parse_int(optarg, "--fidelity-steps", 1, 1024, &o->fidelity_steps);
            break;
        case O_TASK: rc = cli_parse_int(optarg, "--task-queries", 0, 4096, &o->task_queries); break;
        case O_TASK_KEYS:
            rc = cli_parse_int(optarg, "--task-keys", 1, TASK_KEYS_MAX, &o->task_keys);
            break;
        case O_TASK_VALUES:
            rc = cli_parse_int(optarg, "--task-values", 1, TASK_VALUES_MAX, &o->task_values);
            break;
        case O_SEEDS:
            rc = cli_parse_int(optarg, "--random-seeds", 1, RANDOM_SEEDS_MAX, &o->random_seeds);
            break;
        case O_SHIPPED: o->shipped = optarg; break;
        case O_ROWS:
            if (strcmp(optarg, "all") && strcmp(optarg, "headline"))
                rc = cli_usage_error("--rows: '%s' is not all or headline", optarg);
            o->headline = !strcmp(optarg, "headline");
            break;
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
        o->docs = o->record ? eval_calib_docs : eval_heldout_docs;
    if (o->features && o->track != TRACK_IMAGE)
        return cli_usage_error("--features is for --track image");
    if (o->images > 1 && (o->track != TRACK_IMAGE || o->record))
        return cli_usage_error("--images is for run --track image (text: one --span)");
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

void run_output_paths(const struct options *o, struct run_outputs *p)
{
    snprintf(p->metrics, sizeof p->metrics, "%s/metrics.json", o->out);
    snprintf(p->html, sizeof p->html, "%s/report.html", o->out);
    snprintf(p->csv, sizeof p->csv, "%s/metrics.csv", o->out);
    snprintf(p->embd, sizeof p->embd, "%s/span_embeddings.safetensors", o->out);
}

/* Refuses, before any work, an --out whose files would replace an input: `run` writes
 * metrics.json, report.html and metrics.csv there (artifacts may lie beside them), `record`
 * writes its shards into the folder, which must hold no input. */
int check_outputs(const struct options *o)
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
