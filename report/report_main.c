/* report_main.c — kvcap-report: turns kvcap-eval's metrics.json into a self-contained HTML
 * report and a CSV table (one row per run). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "report/report.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvcap-report METRICS.json [OTHER.json ...] [--html OUT.html] [--csv OUT.csv]\n"
            "\n"
            "Reads the metrics.json written by kvcap-eval (format 1) and writes:\n"
            "  - an HTML report, self-contained (inline CSS and SVG, no scripts, fonts or other\n"
            "    files to fetch): a summary naming the best policy at each memory budget; per\n"
            "    target retention, the policies ranked by task accuracy then KL at equal\n"
            "    realised retention, full's accuracy as the ceiling and greedy agreement as a\n"
            "    secondary column; model, corpus, task, setup, goals and the command that\n"
            "    reproduces the numbers; the headline table (the papers' methods, then kvcap's\n"
            "    extensions, tagged: target and nominal, realised retention, task accuracy and\n"
            "    agreement with full, KL, NLL delta, next-token and greedy agreement, bytes held,\n"
            "    step time vs full, FreeKV's corrected / re-selected / hidden shares) and any\n"
            "    notes; fidelity plots against realised retention (task accuracy, KL, NLL delta,\n"
            "    next-token and greedy agreement, attention drift); task accuracy by depth; a\n"
            "    per-layer attention-error heatmap; KVCapsule's retained-token masks per bucket\n"
            "    (the first 16 buckets; the page says how many more the file holds);\n"
            "    sample continuations marking where each leaves full's; bytes-held and step-time\n"
            "    bars;\n"
            "  - a CSV table, a header row then one row per run with the columns id, policy,\n"
            "    label, retention, compression, token_agreement, next_token_agreement,\n"
            "    first_divergence_mean, nll, nll_full, nll_delta, attn_cosine_mean,\n"
            "    attn_rel_err_mean, bytes_held, bytes_held_full, bytes_read_per_step, step_ms,\n"
            "    step_ms_full, step_time_ratio, realised_retention, nominal, extension (true or\n"
            "    false), kl, task_accuracy, task_agreement_full, freekv_corrected,\n"
            "    freekv_reselected, freekv_hidden (empty where the metrics hold null; means are\n"
            "    over prompts or layers).\n"
            "\n"
            "More metrics files (other tracks of the same evaluation, e.g. the text track\n"
            "beside the image track) add a section showing every run of the first beside the\n"
            "run of the same id in each; the CSV is the first file's.\n"
            "\n"
            "The file is validated first: a malformed one is reported with the JSON field at\n"
            "fault (e.g. runs[3].token_agreement) and nothing is written. Each output is written\n"
            "to a temporary file beside it and renamed into place, so an existing report is\n"
            "never left half-written; both temporaries are written before either is renamed, and\n"
            "SIGINT, SIGTERM, SIGHUP and SIGQUIT wait until both are in place, so an interrupted\n"
            "run leaves the HTML and the CSV both old or both new (SIGKILL or a crash between\n"
            "the two renames can still part them).\n"
            "\n"
            "options:\n"
            "  -H, --html FILE     HTML report to write (default: report.html next to\n"
            "                      METRICS.json)\n"
            "  -c, --csv FILE      CSV table to write (default: metrics.csv next to\n"
            "                      METRICS.json)\n"
            "  -V, --version       print the kvcap version\n"
            "  -h, --help          show this help\n"
            "\n"
            "exit status: 0 on success, 1 when the metrics cannot be read or are malformed or an\n"
            "output cannot be written, 2 on a usage error.\n");
}

/* DIR/NAME where DIR is the directory of `beside` ("." when it has none); caller frees. */
static char *next_to(const char *beside, const char *name)
{
    const char *slash = strrchr(beside, '/');
    size_t dir = slash ? (size_t)(slash - beside) + 1 : 0;
    char *p = malloc(dir + strlen(name) + 1);
    if (!p)
        return NULL;
    memcpy(p, beside, dir);
    strcpy(p + dir, name);
    return p;
}

int main(int argc, char **argv)
{
    static const struct option options[] = {
        {"html", required_argument, NULL, 'H'}, {"csv", required_argument, NULL, 'c'},
        {"version", no_argument, NULL, 'V'},    {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    const char *html = NULL, *csv = NULL;
    char *html_default = NULL, *csv_default = NULL;
    int c, rc = 0;
    cli_init("kvcap-report", 0);
    while ((c = getopt_long(argc, argv, "H:c:Vh", options, NULL)) != -1 && rc == 0) {
        switch (c) {
        case 'H': html = optarg; break;
        case 'c': csv = optarg; break;
        case 'V': printf("kvcap-report %s\n", kvcap_version()); return 0;
        case 'h': usage(stdout); return 0;
        default: rc = cli_usage_error("unknown option"); break;
        }
    }
    if (rc)
        return rc;
    if (optind >= argc)
        return cli_usage_error("no METRICS.json given");
    if (argc - optind > 8)
        return cli_usage_error("at most 8 metrics files ('%s' is the ninth)", argv[optind + 8]);
    const char *metrics = argv[optind];
    const int n_metrics = argc - optind;
    if ((html && !*html) || (csv && !*csv))
        return cli_usage_error("%s: empty file name", html && !*html ? "--html" : "--csv");
    if (!html)
        html = html_default = next_to(metrics, "report.html");
    if (!csv)
        csv = csv_default = next_to(metrics, "metrics.csv");
    if (!html || !csv) {
        fprintf(stderr, "kvcap-report: error: out of memory\n");
        rc = 1;
        goto done;
    }
    const struct cli_path outs[2] = {{"--html", html}, {"--csv", csv}};
    struct cli_path in[8];
    for (int i = 0; i < n_metrics; i++)
        in[i] = (struct cli_path){"METRICS.json", argv[optind + i]};
    if ((rc = cli_check_outputs(outs, 2, in, n_metrics)) != 0)
        goto done;
    enum kvcap_status st =
        kvcap_report_write_tracks((const char *const *)argv + optind, n_metrics, html, csv);
    if (st != KVCAP_OK) {
        rc = cli_fail(st);
        goto done;
    }
    fprintf(stderr, "kvcap-report: wrote %s and %s\n", html, csv);
done:
    free(html_default);
    free(csv_default);
    return rc;
}
