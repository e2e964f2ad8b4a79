/* synth_main.c — kvcap-synth: writes a synthetic dataset with known low-rank structure, RoPE
 * offsets and queries, for tests, benchmarks and the demo. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "common/internal.h"
#include "configs/config.h"
#include "calibrate/synth.h"

extern const char kvcap_default_calib_yaml[];

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvcap-synth --out DIR [options]\n"
            "\n"
            "Writes a synthetic K/V dataset (formats/SPEC.md, kind 'dataset') whose structure is\n"
            "known: per layer and KV head, offset-free keys and values of exact low rank along\n"
            "the token axis (smooth 2-D patterns over the image grid), a few high-norm outlier\n"
            "tokens, small noise, RoPE applied at a random start position p0, and post-vision\n"
            "and decode queries. Model geometry and grids come from a calibration config.\n"
            "\n"
            "options:\n"
            "  -c, --config FILE     calibration config (model + buckets); default: the embedded\n"
            "                        SmolLM2-135M config (configs/smollm2-135m.calib.yaml)\n"
            "  -o, --out DIR         output folder (created; shards are added after existing ones)\n"
            "  -n, --spans N         number of spans (default 16)\n"
            "  -g, --grid RxC        grid of the spans, repeatable, cycled (default: the config's\n"
            "                        bucket grids)\n"
            "      --rank-k R        rank of the offset-free keys (default 8)\n"
            "      --rank-v R        rank of the centred values (default 8)\n"
            "      --noise X         noise std relative to the signal (default 0.01)\n"
            "      --outliers N      outlier tokens per span (default 2)\n"
            "      --post-queries N  post-vision queries per span (default 8)\n"
            "      --decode-queries N decode queries per span (default 8)\n"
            "      --p0-max P        start positions drawn from 0..P (default 4096)\n"
            "      --dtype T         f32, f16 or bf16 (default f16)\n"
            "      --shard-mb M      target shard size in MiB (default 256)\n"
            "  -s, --seed S          random seed (default 1)\n"
            "  -q, --quiet           no progress output\n"
            "  -V, --version         print the kvcap version\n"
            "  -h, --help            show this help\n");
}

static int parse_long(const char *arg, const char *name, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(arg, &end, 10);
    if (errno || end == arg || *end || v < lo || v > hi)
        return cli_usage_error("%s: '%s' is not an integer in %ld..%ld", name, arg, lo, hi), 0;
    *out = v;
    return 1;
}

static int parse_double(const char *arg, const char *name, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(arg, &end);
    if (errno || end == arg || *end || !(v >= lo && v <= hi))
        return cli_usage_error("%s: '%s' is not a number in %g..%g", name, arg, lo, hi), 0;
    *out = v;
    return 1;
}

/* The folders a run may create: made[i] is 1 when the prefix dir[0..i) that ends at a '/' or
 * at the end of `dir` does not exist yet (NULL when out of memory). */
static char *missing_dirs(const char *dir)
{
    size_t n = strlen(dir);
    char *made = calloc(n + 1, 1), *path = strdup(dir);
    for (size_t i = 1; made && path && i <= n; i++)
        if (path[i] == '/' || path[i] == '\0') {
            struct stat st;
            char saved = path[i];
            path[i] = '\0';
            made[i] = stat(path, &st) != 0;
            path[i] = saved;
        }
    free(path);
    return made;
}

/* After a failed run: removes the folders in `made` (missing_dirs, taken before the run),
 * deepest first. rmdir leaves a folder that is not empty, and one that existed before the run
 * is never in `made`, so only empty folders this run created go. */
static void remove_made_dirs(const char *dir, const char *made)
{
    char *path = made ? strdup(dir) : NULL;
    for (size_t i = path ? strlen(path) : 0; i >= 1; i--)
        if (made[i]) {
            path[i] = '\0';
            rmdir(path);
        }
    free(path);
}

/* The progress bar, and whether a line of it is left open on a terminal (the bar ends its line
 * only at 100 %): a failure half-way must end that line before printing its error. */
struct span_progress {
    struct cli_progress bar;
    int64_t done, total;
};

static int on_span(int64_t done, int64_t total, void *user)
{
    struct span_progress *p = user;
    p->done = done;
    p->total = total;
    cli_progress_update(&p->bar, done, total);
    return 0;
}

int main(int argc, char **argv)
{
    enum { RANK_K = 1000, RANK_V, NOISE, OUTLIERS, POSTQ, DECQ, P0MAX, DTYPE, SHARD };
    static const struct option options[] = {
        {"config", required_argument, NULL, 'c'}, {"out", required_argument, NULL, 'o'},
        {"spans", required_argument, NULL, 'n'},  {"grid", required_argument, NULL, 'g'},
        {"rank-k", required_argument, NULL, RANK_K}, {"rank-v", required_argument, NULL, RANK_V},
        {"noise", required_argument, NULL, NOISE}, {"outliers", required_argument, NULL, OUTLIERS},
        {"post-queries", required_argument, NULL, POSTQ},
        {"decode-queries", required_argument, NULL, DECQ},
        {"p0-max", required_argument, NULL, P0MAX}, {"dtype", required_argument, NULL, DTYPE},
        {"shard-mb", required_argument, NULL, SHARD}, {"seed", required_argument, NULL, 's'},
        {"quiet", no_argument, NULL, 'q'},        {"version", no_argument, NULL, 'V'},
        {"help", no_argument, NULL, 'h'},         {NULL, 0, NULL, 0}};
    cli_init("kvcap-synth", 0);
    struct kvcap_synth_params p;
    kvcap_synth_default_params(&p);
    const char *config_path = NULL, *out = NULL;
    int quiet = 0, c;
    long lv;
    double dv;
    while ((c = getopt_long(argc, argv, "c:o:n:g:s:qVh", options, NULL)) != -1) {
        switch (c) {
        case 'c': config_path = optarg; break;
        case 'o': out = optarg; break;
        case 'n': if (!parse_long(optarg, "--spans", 1, 100000000, &lv)) return 2; p.n_spans = (int)lv; break;
        case 'g': {
            int r, cc;
            char tail;
            if (sscanf(optarg, "%dx%d%c", &r, &cc, &tail) != 2 || r < 1 || cc < 1 || r > 4096 ||
                cc > 4096)
                return cli_usage_error("--grid: '%s' is not ROWSxCOLS (e.g. 16x16)", optarg);
            if (p.n_grids == KVCAP_SYNTH_MAX_GRIDS)
                return cli_usage_error("--grid: at most %d grids", KVCAP_SYNTH_MAX_GRIDS);
            p.grid_rows[p.n_grids] = r;
            p.grid_cols[p.n_grids++] = cc;
            break;
        }
        case RANK_K: if (!parse_long(optarg, "--rank-k", 1, 1 << 20, &lv)) return 2; p.rank_k = (int)lv; break;
        case RANK_V: if (!parse_long(optarg, "--rank-v", 1, 1 << 20, &lv)) return 2; p.rank_v = (int)lv; break;
        case NOISE: if (!parse_double(optarg, "--noise", 0, 100, &dv)) return 2; p.noise = dv; break;
        case OUTLIERS: if (!parse_long(optarg, "--outliers", 0, 64, &lv)) return 2; p.outliers = (int)lv; break;
        case POSTQ: if (!parse_long(optarg, "--post-queries", 0, 4096, &lv)) return 2; p.post_queries = (int)lv; break;
        case DECQ: if (!parse_long(optarg, "--decode-queries", 0, 4096, &lv)) return 2; p.decode_queries = (int)lv; break;
        case P0MAX: if (!parse_long(optarg, "--p0-max", 0, 1 << 24, &lv)) return 2; p.p0_max = (int)lv; break;
        case SHARD: if (!parse_long(optarg, "--shard-mb", 1, 1 << 20, &lv)) return 2; p.shard_bytes = (uint64_t)lv << 20; break;
        case 's': if (!parse_long(optarg, "--seed", 0, 0x7fffffffL, &lv)) return 2; p.seed = (uint64_t)lv; break;
        case DTYPE:
            if (strcmp(optarg, "f32") == 0) p.dtype = KVCAP_DTYPE_F32;
            else if (strcmp(optarg, "f16") == 0) p.dtype = KVCAP_DTYPE_F16;
            else if (strcmp(optarg, "bf16") == 0) p.dtype = KVCAP_DTYPE_BF16;
            else return cli_usage_error("--dtype: '%s' is not f32, f16 or bf16", optarg);
            break;
        case 'q': quiet = 1; break;
        case 'V': printf("kvcap-synth %s\n", kvcap_version()); return 0;
        case 'h': usage(stdout); return 0;
        default: return cli_usage_error("unknown option");
        }
    }
    if (optind < argc)
        return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (!out)
        return cli_usage_error("--out DIR is required");

    struct kvcap_calib_config cfg;
    enum kvcap_status st =
        config_path ? kvcap_calib_config_load_file(config_path, &cfg)
                    : kvcap_calib_config_load_string(kvcap_default_calib_yaml,
                                                     "embedded:smollm2-135m.calib.yaml", &cfg);
    if (st != KVCAP_OK)
        return cli_fail(st);
    if (p.n_grids == 0) /* the grids of the config's buckets, each once */
        for (int b = 0; b < cfg.n_buckets; b++) {
            int seen = 0;
            for (int i = 0; i < p.n_grids; i++)
                seen |= p.grid_rows[i] == cfg.buckets[b].rows && p.grid_cols[i] == cfg.buckets[b].cols;
            if (!seen) {
                p.grid_rows[p.n_grids] = cfg.buckets[b].rows;
                p.grid_cols[p.n_grids++] = cfg.buckets[b].cols;
            }
        }
    struct span_progress progress = {.done = 0};
    cli_progress_begin(&progress.bar, "spans", quiet);
    char *made = missing_dirs(out);
    double t0 = kvcap_seconds();
    st = kvcap_synth(&cfg.model, &p, out, on_span, &progress);
    if (st == KVCAP_OK && !quiet)
        fprintf(stderr, "kvcap-synth: wrote %d spans for %s to %s in %.1fs\n", p.n_spans,
                cfg.model.name[0] ? cfg.model.name : "the model", out, kvcap_seconds() - t0);
    if (st != KVCAP_OK) {
        /* kvcap_synth removed its shards; the folders it made for them go too */
        remove_made_dirs(out, made);
        if (progress.bar.tty && !quiet && progress.done > 0 && progress.done < progress.total)
            fputc('\n', stderr);
    }
    free(made);
    kvcap_calib_config_free(&cfg);
    return st == KVCAP_OK ? 0 : cli_fail(st);
}
