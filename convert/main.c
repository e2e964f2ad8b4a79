/* main.c — kvcap-convert: turns calibration states into a compressor artifact, and inspects
 * and validates any kvcap file. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "convert/convert.h"
#include "convert/inspect.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvcap-convert STATE.kvcs [STATE.kvcs...] --out ARTIFACT.kvcap [options]\n"
            "       kvcap-convert --inspect FILE [FILE...] [--all-tensors]\n"
            "\n"
            "Builds a compressor artifact for libkvcap from one or more calibration states of\n"
            "the same model and buckets: states are merged (Gram sums and span counts added,\n"
            "then refitted), value bases are cut to the schedule's ranks from the kept\n"
            "eigenvectors (no recalibration needed), key maps are kept when they fit the\n"
            "schedule and refitted in closed form otherwise, and the maps are stored in the\n"
            "chosen precision. The artifact is validated by reading it back. For each\n"
            "bucket it prints the share of the calibration values' variance the value basis\n"
            "keeps next to the share as many random directions keep, and warns when the\n"
            "basis adds under a third of what it could: such spans (text, in kvcap-eval)\n"
            "hold little for KVCapsule.\n"
            "\n"
            "With --inspect, prints kind, format version, model geometry, buckets, schedule and\n"
            "tensors of each FILE and validates it; the exit status is 0 only if all are valid.\n"
            "\n"
            "options:\n"
            "  -o, --out FILE        artifact to write\n"
            "  -s, --storage T       f32, f16 or bf16 (default: the calibration config's)\n"
            "  -k, --keys SCHED      key retention: uniform:R | pyramid:FIRST:LAST | list:R,R,...\n"
            "                        (default: the schedule the states were fitted with)\n"
            "  -r, --values SCHED    value retention, same forms\n"
            "      --fallback P      policy for spans with no bucket (default flashcache)\n"
            "      --value-basis B   calibrated (default): the value PCA of the states; dct: the\n"
            "                        2-D DCT low-pass of each bucket's grid (its tile when\n"
            "                        tiled, the constant first), a basis that needs no\n"
            "                        calibration\n"
            "  -i, --inspect         inspect FILEs instead of converting\n"
            "  -a, --all-tensors     with --inspect: list every tensor (default: the first 24)\n"
            "  -v, --verbose         also print informational library messages\n"
            "  -V, --version         print the kvcap version\n"
            "  -h, --help            show this help\n");
}

/* "uniform:R", "pyramid:A:B" or "list:R,R,...". Ratio arrays for lists go into *storage. */
static int parse_schedule(const char *arg, const char *option, struct kvcap_schedule *s,
                          double **storage)
{
    memset(s, 0, sizeof *s);
    char *end;
    if (strncmp(arg, "uniform:", 8) == 0) {
        s->kind = KVCAP_SCHEDULE_UNIFORM;
        s->ratio = strtod(arg + 8, &end);
        if (*end == '\0' && s->ratio > 0 && s->ratio <= 1)
            return 1;
    } else if (strncmp(arg, "pyramid:", 8) == 0) {
        s->kind = KVCAP_SCHEDULE_PYRAMID;
        s->first = strtod(arg + 8, &end);
        if (*end == ':') {
            s->last = strtod(end + 1, &end);
            if (*end == '\0' && s->first > 0 && s->first <= 1 && s->last > 0 && s->last <= 1)
                return 1;
        }
    } else if (strncmp(arg, "list:", 5) == 0) {
        s->kind = KVCAP_SCHEDULE_LIST;
        size_t cap = strlen(arg);
        *storage = malloc(sizeof(double) * cap);
        if (!*storage)
            return 0;
        const char *p = arg + 5;
        for (;;) {
            double r = strtod(p, &end);
            if (end == p || !(r > 0 && r <= 1))
                break;
            (*storage)[s->n_ratios++] = r;
            if (*end == '\0') {
                s->ratios = *storage;
                return 1;
            }
            if (*end != ',')
                break;
            p = end + 1;
        }
    }
    cli_usage_error("%s: '%s' is not uniform:R, pyramid:FIRST:LAST or list:R,R,... with ratios "
                    "in (0, 1]",
                    option, arg);
    return 0;
}

int main(int argc, char **argv)
{
    enum { FALLBACK = 1000, VALUE_BASIS };
    static const struct option options[] = {
        {"out", required_argument, NULL, 'o'},      {"storage", required_argument, NULL, 's'},
        {"keys", required_argument, NULL, 'k'},     {"values", required_argument, NULL, 'r'},
        {"fallback", required_argument, NULL, FALLBACK},
        {"value-basis", required_argument, NULL, VALUE_BASIS},
        {"inspect", no_argument, NULL, 'i'},        {"all-tensors", no_argument, NULL, 'a'},
        {"verbose", no_argument, NULL, 'v'},        {"version", no_argument, NULL, 'V'},
        {"help", no_argument, NULL, 'h'},           {NULL, 0, NULL, 0}};
    int inspect = 0, all_tensors = 0, verbose = 0, c, rc = 0;
    struct kvcap_convert_options o;
    kvcap_convert_default_options(&o);
    double *key_list = NULL, *value_list = NULL;
    cli_init("kvcap-convert", 0);
    while ((c = getopt_long(argc, argv, "o:s:k:r:iavVh", options, NULL)) != -1 && rc == 0) {
        switch (c) {
        case 'o': o.out = optarg; break;
        case 's':
            o.storage_set = 1;
            if (strcmp(optarg, "f32") == 0) o.storage = KVCAP_DTYPE_F32;
            else if (strcmp(optarg, "f16") == 0) o.storage = KVCAP_DTYPE_F16;
            else if (strcmp(optarg, "bf16") == 0) o.storage = KVCAP_DTYPE_BF16;
            else rc = cli_usage_error("--storage: '%s' is not f32, f16 or bf16", optarg);
            break;
        case 'k': o.keys_set = 1; rc = parse_schedule(optarg, "--keys", &o.keys, &key_list) ? 0 : 2; break;
        case 'r': o.values_set = 1; rc = parse_schedule(optarg, "--values", &o.values, &value_list) ? 0 : 2; break;
        case FALLBACK: {
            static const char *const names[] = {"full", "flashcache", "vlcache", "freekv", "streaming"};
            static const enum kvcap_policy values[] = {KVCAP_POLICY_FULL, KVCAP_POLICY_FLASHCACHE,
                                                       KVCAP_POLICY_VLCACHE, KVCAP_POLICY_FREEKV,
                                                       KVCAP_POLICY_STREAMING};
            int found = 0;
            for (int i = 0; i < 5; i++)
                if (strcmp(optarg, names[i]) == 0)
                    o.fallback = values[i], found = 1;
            if (!found)
                rc = cli_usage_error("--fallback: '%s' is not full, flashcache, vlcache, freekv or "
                                     "streaming", optarg);
            break;
        }
        case VALUE_BASIS:
            if (strcmp(optarg, "dct") == 0) o.dct_values = 1;
            else if (strcmp(optarg, "calibrated") == 0) o.dct_values = 0;
            else rc = cli_usage_error("--value-basis: '%s' is not calibrated or dct", optarg);
            break;
        case 'i': inspect = 1; break;
        case 'a': all_tensors = 1; break;
        case 'v': verbose = 1; break;
        case 'V': printf("kvcap-convert %s\n", kvcap_version()); goto done;
        case 'h': usage(stdout); goto done;
        default: rc = cli_usage_error("unknown option"); break;
        }
    }
    if (rc)
        goto done;
    cli_init("kvcap-convert", verbose);
    if (inspect) {
        if (optind >= argc) {
            rc = cli_usage_error("--inspect needs at least one FILE");
            goto done;
        }
        for (int i = optind; i < argc; i++) {
            if (i > optind)
                printf("\n");
            int r = kvcap_cli_inspect(argv[i], all_tensors);
            rc = rc ? rc : r;
        }
        goto done;
    }
    if (optind >= argc) {
        rc = cli_usage_error("nothing to do: give STATE.kvcs files and --out, or --inspect FILE");
        goto done;
    }
    if (!o.out) {
        rc = cli_usage_error("--out ARTIFACT.kvcap is required");
        goto done;
    }
    o.states = (const char *const *)&argv[optind];
    o.n_states = argc - optind;
    {
        struct cli_path out = {"--out", o.out}, *ins = calloc((size_t)o.n_states, sizeof *ins);
        for (int i = 0; ins && i < o.n_states; i++)
            ins[i] = (struct cli_path){"STATE", o.states[i]};
        rc = ins ? cli_check_outputs(&out, 1, ins, o.n_states) : cli_usage_error("out of memory");
        if (rc == 0) /* a state merged with itself would count its spans twice */
            rc = cli_check_inputs(ins, o.n_states);
        free(ins);
        if (rc)
            goto done;
    }
    struct kvcap_convert_report report;
    enum kvcap_status st = kvcap_convert(&o, &report);
    if (st != KVCAP_OK) {
        rc = cli_fail(st);
        goto done;
    }
    char size[32];
    fprintf(stderr,
            "kvcap-convert: wrote %s (%s): mean retention keys %.3f, values %.3f; key maps %s\n",
            o.out, cli_bytes(report.artifact_bytes, size, sizeof size), report.mean_r_keys,
            report.mean_r_values, report.keys_refit ? "refitted in closed form" : "as calibrated");
    for (int b = 0; b < report.n_buckets; b++) {
        const struct kvcap_bucket *bk = &report.buckets[b];
        char tiles[48] = "";
        if (bk->structure == KVCAP_STRUCTURE_TILED)
            snprintf(tiles, sizeof tiles, ", tiles %dx%d", bk->tile_rows, bk->tile_cols);
        if (!isnan(report.value_kept[b])) /* the bucket had data */
            fprintf(stderr,
                    "  value basis, bucket %d (%dx%d%s): keeps %.0f %% of the calibration values' "
                    "variance (random directions: %.0f %%)\n",
                    b, bk->rows, bk->cols, tiles, 100 * report.value_kept[b],
                    100 * report.value_chance[b]);
    }
done:
    free(key_list);
    free(value_list);
    return rc;
}
