/* test_report.c — kvcap-report's writer: the sample metrics render to HTML with every section
 * (the ranking per memory budget by task accuracy then KL, the headline table with realised
 * retention, KL, task and FreeKV columns and kvcap's extensions apart, plots, depths) and to CSV
 * with one row per run; strings from the JSON are escaped; each malformed input fails with
 * KVCAP_ERR_FORMAT naming the field and writes nothing; write failures are KVCAP_ERR_IO and
 * leave neither a temporary file nor a half-written report, and a termination signal never
 * leaves the HTML of one run beside the CSV of another; hostile mask sizes cost work in
 * proportion to the file, not to the sizes they declare. */
#include <dirent.h>
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "common/internal.h"
#include "report/report.h"
#include "tests/test_json.h"
#include "tests/test_util.h"

#define SAMPLE KVCAP_TEST_DATA "/eval/metrics-sample.json"

static const char CSV_HEADER[] =
    "id,policy,label,retention,compression,token_agreement,next_token_agreement,"
    "first_divergence_mean,nll,nll_full,nll_delta,attn_cosine_mean,attn_rel_err_mean,bytes_held,"
    "bytes_held_full,bytes_read_per_step,step_ms,step_ms_full,step_time_ratio,realised_retention,"
    "nominal,extension,kl,task_accuracy,task_agreement_full,freekv_corrected,freekv_reselected,"
    "freekv_hidden,kl_minus_random,kl_minus_random_half95";

/* CSV column indices (0-based) of the fields the tests read. */
enum { CSV_STEP_MS = 16, CSV_REALISED = 19, CSV_NOMINAL, CSV_EXTENSION, CSV_KL, CSV_TASK_ACCURACY,
       CSV_TASK_AGREEMENT, CSV_FREEKV_CORRECTED, CSV_FREEKV_RESELECTED, CSV_FREEKV_HIDDEN,
       CSV_KL_MINUS_RANDOM, CSV_KL_MINUS_RANDOM_HALF, CSV_COLUMNS };

/* ---- Helpers ------------------------------------------------------------------------------- */

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    assert_int_equal(fclose(f), 0);
}

static int count(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + strlen(needle), needle))
        n++;
    return n;
}

/* Entries in a folder other than . and .., hidden ones included. */
static int dir_entries(const char *dir)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

static cJSON *load_sample(void) { return test_load_json(SAMPLE); }

static cJSON *run_of(cJSON *doc, int i)
{
    cJSON *run = cJSON_GetArrayItem(cJSON_GetObjectItem(doc, "runs"), i);
    assert_non_null(run);
    return run;
}

/* The sample box of run `id` in the samples section, as a new string (caller frees). */
static char *sample_box_of(const char *html, const char *id)
{
    char open[128];
    snprintf(open, sizeof open, "<div class=\"sample\" title=\"%s\">", id);
    const char *start = strstr(html, open);
    if (!start)
        fail_msg("no sample box for %s", id);
    const char *end = strstr(start, "</div></div>\n");
    assert_non_null(end);
    size_t n = (size_t)(end - start);
    char *box = malloc(n + 1);
    assert_non_null(box);
    memcpy(box, start, n);
    box[n] = '\0';
    return box;
}

/* Field `col` of the CSV row whose id is `id`, into `out` (no quoted fields expected). */
static const char *csv_field(const char *csv, const char *id, int col, char *out, size_t cap)
{
    char start[128];
    snprintf(start, sizeof start, "\n%s,", id);
    const char *p = strstr(csv, start);
    if (!p)
        fail_msg("no CSV row for %s", id);
    p++;
    for (int c = 0; c < col; c++) {
        p = strpbrk(p, ",\n");
        if (!p || *p == '\n')
            fail_msg("CSV row %s has no column %d", id, col);
        p++;
    }
    size_t n = strcspn(p, ",\n");
    assert_true(n < cap);
    memcpy(out, p, n);
    out[n] = '\0';
    return out;
}

/* Where `needle` first occurs inside the HTML section whose heading is `h2` (NULL when not). */
static const char *in_section(const char *html, const char *h2, const char *needle)
{
    char head[128];
    snprintf(head, sizeof head, "<h2>%s</h2>", h2);
    const char *start = strstr(html, head);
    if (!start)
        return NULL;
    const char *end = strstr(start, "</section>"), *at = strstr(start, needle);
    return at && end && at < end ? at : NULL;
}

static void remove_from_runs(cJSON *doc, const char *key)
{
    cJSON *run;
    cJSON_ArrayForEach(run, cJSON_GetObjectItem(doc, "runs")) cJSON_DeleteItemFromObject(run, key);
}

static void assert_error_names(const char *path, const char *needle)
{
    const char *msg = kvcap_last_error();
    if (strncmp(msg, path, strlen(path)) != 0 || !strstr(msg, needle))
        fail_msg("error message mismatch\n  got:  %s\n  want: %s: ... %s ...", msg, path, needle);
}

/* Scratch folders: `in` for inputs, `out` for the report's outputs. */
struct dirs {
    char in[512], out[512], html[600], csv[600], metrics[600];
};

static void dirs_make(struct dirs *d)
{
    assert_true(test_tmpdir(d->in, sizeof d->in, "report-in"));
    assert_true(test_tmpdir(d->out, sizeof d->out, "report-out"));
    snprintf(d->html, sizeof d->html, "%s/report.html", d->out);
    snprintf(d->csv, sizeof d->csv, "%s/metrics.csv", d->out);
    snprintf(d->metrics, sizeof d->metrics, "%s/metrics.json", d->in);
}

static void dirs_remove(struct dirs *d)
{
    test_rm_tree(d->in);
    test_rm_tree(d->out);
}

/* ---- The sample renders --------------------------------------------------------------------- */

static void test_sample_renders(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    assert_int_equal(kvcap_report_write(SAMPLE, d.html, d.csv), KVCAP_OK);
    assert_int_equal(dir_entries(d.out), 2); /* no temporary file left behind */

    cJSON *doc = load_sample();
    int n_runs = cJSON_GetArraySize(cJSON_GetObjectItem(doc, "runs"));
    int n_masks = cJSON_GetArraySize(cJSON_GetObjectItem(doc, "masks"));
    assert_true(n_runs >= 20);
    assert_int_equal(n_masks, 2);

    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_non_null(strstr(html, "<title>kvcap evaluation: SmolLM2-135M-Instruct</title>"));
    assert_non_null(strstr(html, "<h1>kvcap evaluation: SmolLM2-135M-Instruct</h1>"));
    assert_int_equal(count(html, "<tr class=\"run"), n_runs);
    assert_int_equal(count(html, "<figure class=\"mask-panel\">"), n_masks);
    /* Every figure holds an SVG: fidelity, heatmap, one per mask bucket, bars. */
    int figures = 0;
    for (const char *f = strstr(html, "<figure"); f; f = strstr(f + 1, "<figure")) {
        const char *end = strstr(f, "</figure>"), *svg = strstr(f, "<svg");
        assert_non_null(end);
        assert_true(svg && svg < end);
        figures++;
    }
    assert_int_equal(figures, 3 + n_masks);
    static const char *const sections[] = {"Which policy wins at each memory budget",
                                           "What was measured",
                                           "Headline results",
                                           "Fidelity vs realised retention",
                                           "Task accuracy by depth",
                                           "Per-layer attention error",
                                           "KVCapsule retained-token masks",
                                           "Sample continuations",
                                           "Memory and decode time"};
    const char *prev_section = html;
    for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++) {
        char h2[96];
        snprintf(h2, sizeof h2, "<h2>%s</h2>", sections[i]);
        const char *at = strstr(html, h2);
        if (!at || at < prev_section)
            fail_msg("section '%s' missing or out of order", sections[i]);
        prev_section = at;
    }
    /* The headline table: next-token agreement (teacher-forced, coloured) then greedy agreement,
     * the secondary column; realised retention, task accuracy (coloured by the share of full's
     * kept), task agreement with full and KL first. */
    assert_non_null(strstr(html, "<th>Next-token<br>agreement<br><span class=\"unit\">64 "
                                 "teacher-forced</span></th><th class=\"sec\">Greedy<br>"
                                 "agreement<br><span class=\"unit\">32 generated</span></th>"));
    const char *table = strstr(html, "<h2>Headline results</h2>");
    assert_non_null(table);
    const char *row = strstr(table, "title=\"flashcache@0.40\">");
    assert_non_null(row);
    const char *row_end = strstr(row, "</tr>"),
               *cells = strstr(row, "<td>0.40</td><td>40.0&nbsp;%</td><td class=\"ag-warn\">"
                                    "71.9&nbsp;%</td><td>74.4&nbsp;%</td><td>0.082</td><td>"
                                    "+0.0580</td><td class=\"ag-warn\">97.5&nbsp;%</td>"
                                    "<td class=\"sec\">94.1&nbsp;%</td>");
    assert_true(cells && cells < row_end);
    row = strstr(table, "title=\"kvcapsule-tiled@0.40\">");
    assert_non_null(row);
    row_end = strstr(row, "</tr>");
    cells = strstr(row, "<td class=\"ag-good\">99.6&nbsp;%</td>"
                        "<td class=\"sec\">99.1&nbsp;%</td>");
    assert_true(cells && cells < row_end);
    /* kvcap's extensions: tagged, and after the papers' methods under their own heading. */
    assert_true(strstr(row, "<span class=\"ext-tag\">kvcap extension</span>") < row_end);
    assert_int_equal(count(table, "<tr class=\"group\">"), 2);
    const char *papers = strstr(table, "The papers&rsquo; methods"),
               *extensions = strstr(table, "kvcap&rsquo;s extensions");
    assert_true(papers && extensions && papers < extensions);
    assert_true(strstr(table, "title=\"vlcache@0.60\">") < extensions);
    assert_true(strstr(table, "title=\"composition@0.20\">") > extensions);
    assert_int_equal(count(table, "<tr class=\"run ext\""), 5);
    assert_int_equal(count(table, "<tr class=\"run first ext\""), 1);
    /* VL-Cache's nominal alpha where it differs from the target; a realised retention off its
     * target flagged; FreeKV's corrected / re-selected / hidden shares. */
    row = strstr(table, "title=\"vlcache@0.20\">");
    assert_non_null(row);
    assert_true(strstr(row, "<td>0.20<br><span class=\"unit\">nominal 0.215</span></td>"
                            "<td>20.1&nbsp;%</td>") < strstr(row, "</tr>"));
    row = strstr(table, "title=\"vlcache@0.60\">");
    assert_true(strstr(row, "<td class=\"off\">55.0&nbsp;%</td>") < strstr(row, "</tr>"));
    row = strstr(table, "title=\"flashcache@0.20\">");
    assert_true(strstr(row, "<td>0.20</td><td>20.0&nbsp;%</td>") < strstr(row, "</tr>"));
    row = strstr(table, "title=\"freekv@0.40\">");
    assert_true(strstr(row, "<td class=\"fk\">1.1 / 0.2 / 95.0&nbsp;%</td></tr>") ==
                strstr(row, "</tr>") - strlen("<td class=\"fk\">1.1 / 0.2 / 95.0&nbsp;%</td>"));
    assert_int_equal(count(table, "<td class=\"fk\">"), 3);
    assert_non_null(strstr(html, "Next-token agreement is the share"));
    /* The notes: a bulleted list right under the table, escaped. */
    const char *notes = strstr(html, "</table></div>\n<ul class=\"notes\">\n<li>Timings are from");
    assert_non_null(notes);
    assert_int_equal(count(html, "<ul class=\"notes\">"), 1);
    assert_non_null(strstr(notes, "<li>Greedy agreement cascades &amp; understates fidelity"));
    assert_true(strstr(notes, "</ul>") < strstr(notes, "<p class=\"caption\">"));
    /* The ranking: per target, full (the ceiling) then the runs by task accuracy, ties by KL
     * (at 0.60 three runs answer 85.4 %: KL 0.00136, 0.00318, 0.00374). */
    const char *rank = strstr(html, "<h2>Which policy wins at each memory budget</h2>");
    assert_non_null(rank);
    assert_true(rank < table);
    assert_int_equal(count(html, "<div class=\"rank-card\">"), 3);
    const char *card = strstr(rank, "Keep 60&nbsp;% of the span");
    assert_non_null(card);
    static const char *const order[] = {"full@1.00", "kvcapsule-tiled@0.60", "composition@0.60",
                                        "kvcapsule-dense@0.60", "freekv@0.60", "vlcache@0.60",
                                        "flashcache@0.60", "streaming@0.60"};
    const char *prev_row = card;
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        char title[64];
        snprintf(title, sizeof title, "title=\"%s\">", order[i]);
        const char *at = strstr(prev_row, title);
        if (!at || at > strstr(card, "</table>"))
            fail_msg("ranking at 0.60: %s missing or out of order", order[i]);
        prev_row = at;
    }
    assert_non_null(strstr(card, "<tr class=\"win\" title=\"kvcapsule-tiled@0.60\">"));
    assert_non_null(strstr(card, "<tr class=\"ceiling\" title=\"full@1.00\">"));
    assert_non_null(strstr(html, "Best when keeping 20&nbsp;% of the span: <strong>KVCapsule "
                                 "(tiled)</strong> (a kvcap extension, 71.9&nbsp;% task "
                                 "accuracy; best paper method KVCapsule (dense), "
                                 "68.8&nbsp;%)"));
    assert_non_null(strstr(html, "Full, the ceiling, answers 93.8&nbsp;%."));
    /* Plots on realised retention; full's task accuracy is the reference line. */
    assert_non_null(strstr(html, ">Task accuracy (key-value retrieval)</text>"));
    assert_non_null(strstr(html, ">KL divergence from full (teacher-forced)</text>"));
    assert_non_null(strstr(html, ">Next-token agreement (teacher-forced)</text>"));
    assert_non_null(strstr(html, ">full 93.8%</text>"));
    assert_int_equal(count(html, ">realised retention (share of the span held)</text>"), 6);
    assert_null(strstr(html, ">retention (fraction"));
    /* Accuracy by depth at 0.40: full and one row per policy, 8 bins and the overall share;
     * the task is described. */
    assert_non_null(in_section(html, "Task accuracy by depth", "target retention 0.40"));
    assert_int_equal(count(html, "<table class=\"depth\">"), 1);
    const char *depth = strstr(html, "<table class=\"depth\">");
    assert_int_equal(count(depth, "<th>6&nbsp;%<br><span class=\"unit\">depth</span></th>"), 1);
    assert_non_null(in_section(html, "Task accuracy by depth", "title=\"streaming@0.40\">"));
    assert_null(in_section(html, "Task accuracy by depth", "title=\"streaming@0.20\">"));
    assert_non_null(in_section(html, "What was measured",
                               "<dt>Task</dt><dd>key-value retrieval"));
    assert_non_null(in_section(html, "What was measured",
                               "8 decode steps replayed for attention fidelity"));

    /* Samples: the prompt's tail, then full's and one run per policy (retention 0.40), the part
     * after the first difference from full's highlighted. */
    assert_non_null(strstr(html, "<div class=\"st\">&hellip;I wonder if I\xe2\x80\x99ve been "
                                 "changed in the night?"));
    assert_int_equal(count(html, "<div class=\"sample\" title="), 8);
    assert_int_equal(count(html, "<div class=\"sample\" title=\"full@1.00\">"), 1);
    assert_int_equal(count(html, "@0.40\"><div class=\"sh\">"), 7);
    char *box = sample_box_of(html, "full@1.00");
    assert_non_null(strstr(box, "the reference"));
    assert_null(strstr(box, "class=\"dv\""));
    free(box);
    box = sample_box_of(html, "kvcapsule-tiled@0.40");
    assert_non_null(strstr(box, "identical to full"));
    assert_null(strstr(box, "class=\"dv\""));
    free(box);
    /* Escaped, newlines kept, the highlight starting where the text leaves full's. */
    box = sample_box_of(html, "streaming@0.40");
    assert_non_null(strstr(box, "diverges after 47 characters"));
    assert_non_null(strstr(box, "<div class=\"st\"> \xe2\x80\x98Who in the world am "
                                "I?\xe2\x80\x99 Ah, that\xe2\x80\x99s the great <span "
                                "class=\"dv\">&lt;b&gt;&amp; puzzle, the puzzle, the "
                                "puzzle!\xe2\x80\x99\n\n\xe2\x80\x98I\xe2\x80\x99m sure"));
    assert_int_equal(count(box, "<span class=\"dv\">"), 1);
    free(box);
    assert_null(strstr(html, "<b>&"));
    /* Full has U+2019 where FlashCache has U+201D: the two share the bytes E2 80, but the
     * highlight starts at the whole character. */
    box = sample_box_of(html, "flashcache@0.40");
    assert_non_null(strstr(box, "great puzzle!<span class=\"dv\">\xe2\x80\x9d said Alice"));
    assert_non_null(strstr(box, "diverges after 54 characters"));
    free(box);
    /* Goals carry badges; the command is shown. */
    assert_int_equal(count(html, "class=\"badge met\""), 3);
    assert_int_equal(count(html, "class=\"badge unmet\""), 1);
    assert_non_null(strstr(html, "<pre>build/kvcap-eval "));
    /* Self-contained: nothing to run or fetch. */
    assert_null(strstr(html, "<script"));
    assert_null(strstr(html, "src="));
    assert_null(strstr(html, "http://"));
    free(html);

    char *csv = test_slurp(d.csv);
    assert_non_null(csv);
    assert_int_equal(count(csv, "\n"), n_runs + 1);
    assert_memory_equal(csv, CSV_HEADER, strlen(CSV_HEADER));
    assert_int_equal(csv[strlen(CSV_HEADER)], '\n');
    assert_non_null(strstr(csv, "\n" "full@1.00,full,Full cache,1,1,1,1,32,"));
    assert_non_null(strstr(csv, "\nkvcapsule-tiled@0.40,kvcapsule,KVCapsule (tiled),0.4,2.455,"
                                "0.991,0.996,"));
    /* The new columns: realised retention, nominal, extension, KL, task, FreeKV's shares. */
    char f[64];
    assert_string_equal(csv_field(csv, "kvcapsule-tiled@0.40", CSV_REALISED, f, sizeof f), "0.398");
    assert_string_equal(csv_field(csv, "kvcapsule-tiled@0.40", CSV_EXTENSION, f, sizeof f), "true");
    assert_string_equal(csv_field(csv, "kvcapsule-tiled@0.40", CSV_KL, f, sizeof f), "0.01072");
    assert_string_equal(csv_field(csv, "kvcapsule-tiled@0.40", CSV_TASK_ACCURACY, f, sizeof f),
                        "0.833333");
    assert_string_equal(csv_field(csv, "kvcapsule-tiled@0.40", CSV_TASK_AGREEMENT, f, sizeof f),
                        "0.862222");
    assert_string_equal(csv_field(csv, "kvcapsule-tiled@0.40", CSV_FREEKV_HIDDEN, f, sizeof f), "");
    assert_string_equal(csv_field(csv, "vlcache@0.20", CSV_NOMINAL, f, sizeof f), "0.215");
    assert_string_equal(csv_field(csv, "vlcache@0.20", CSV_EXTENSION, f, sizeof f), "false");
    assert_string_equal(csv_field(csv, "freekv@0.40", CSV_FREEKV_CORRECTED, f, sizeof f), "0.0105");
    assert_string_equal(csv_field(csv, "freekv@0.40", CSV_FREEKV_RESELECTED, f, sizeof f),
                        "0.0016");
    assert_string_equal(csv_field(csv, "freekv@0.40", CSV_FREEKV_HIDDEN, f, sizeof f), "0.95");
    assert_string_equal(csv_field(csv, "full@1.00", CSV_KL, f, sizeof f), "0");
    /* A label with a comma is quoted; nulls (VL-Cache has no timing) are empty fields. */
    assert_non_null(strstr(csv, ",\"Composition (KVCapsule, FreeKV)\",0.2,"));
    assert_string_equal(csv_field(csv, "vlcache@0.20", CSV_STEP_MS, f, sizeof f), "");
    /* Every row has every column. */
    for (const char *line = strchr(csv, '\n'); line && line[1]; line = strchr(line + 1, '\n')) {
        int fields = 1;
        int quoted = 0;
        for (const char *c = line + 1; *c && *c != '\n'; c++) {
            quoted ^= *c == '"';
            fields += *c == ',' && !quoted;
        }
        assert_int_equal(fields, CSV_COLUMNS);
    }
    free(csv);

    /* Either output alone. */
    assert_int_equal(unlink(d.html), 0);
    assert_int_equal(unlink(d.csv), 0);
    assert_int_equal(kvcap_report_write(SAMPLE, NULL, d.csv), KVCAP_OK);
    assert_int_equal(dir_entries(d.out), 1);
    assert_int_equal(kvcap_report_write(SAMPLE, d.html, NULL), KVCAP_OK);
    assert_int_equal(dir_entries(d.out), 2);
    cJSON_Delete(doc);
    dirs_remove(&d);
}

/* Only the required fields: the report still renders, with "not measured" where data lacks. */
static void test_minimal_metrics(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    write_text(d.metrics, "{\"format\": 1, \"title\": \"tiny\", \"runs\": ["
                          "{\"id\": \"full\", \"policy\": \"full\", \"label\": \"Full\", "
                          "\"extension\": false, \"retention\": 1, \"nominal\": 1, "
                          "\"realised_retention\": 1, \"kl\": 0},"
                          "{\"id\": \"s\", \"policy\": \"streaming\", \"label\": \"Streaming\", "
                          "\"extension\": false, \"retention\": 0.5, \"nominal\": 0.5, "
                          "\"realised_retention\": null, \"kl\": 0.1, \"token_agreement\": null, "
                          "\"next_token_agreement\": null, \"sample\": null, \"task\": null, "
                          "\"freekv\": null}], "
                          "\"notes\": null, \"prompt_sample\": null, \"task\": null}");
    assert_int_equal(kvcap_report_write(d.metrics, d.html, d.csv), KVCAP_OK);
    char *html = test_slurp(d.html), *csv = test_slurp(d.csv);
    assert_non_null(html);
    assert_non_null(csv);
    assert_int_equal(count(html, "<tr class=\"run"), 2);
    assert_non_null(strstr(html, "not measured"));
    /* Columns 4 to 19 (compression ... realised_retention) are null. */
    assert_non_null(strstr(csv, "\ns,streaming,Streaming,0.5,,,,,,,,,,,,,,,,,0.5,false,0.1,,,,,,,"
                                "\n"));
    assert_null(strstr(html, "Sample continuations"));
    assert_null(strstr(html, "Task accuracy by depth"));
    assert_null(strstr(html, "class=\"notes\""));
    /* No task: ranked by KL, said so. */
    assert_non_null(strstr(html, "No run measured the retrieval task: ranked by KL"));
    assert_non_null(strstr(html, "Best when keeping 50&nbsp;% of the span: <strong>Streaming"
                                 "</strong> (KL 0.100)."));
    free(html);
    free(csv);
    dirs_remove(&d);
}

/* Without the task the ranking goes by KL and says so; without next-token agreement the table
 * and the panel show it as not measured; samples are compared with full's only when full has
 * one, and the section goes when no run has one. */
static void test_agreement_fallback_and_samples(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    cJSON *doc = load_sample();
    remove_from_runs(doc, "next_token_agreement");
    remove_from_runs(doc, "task");
    cJSON_DeleteItemFromObject(doc, "task");
    cJSON_DeleteItemFromObject(run_of(doc, 0), "sample");
    cJSON_ReplaceItemInObject(run_of(doc, 8), "sample", cJSON_CreateString("a\x1b" "b\tc"));
    test_write_json(d.metrics, doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, d.csv), KVCAP_OK);
    char *html = test_slurp(d.html), *csv = test_slurp(d.csv);
    assert_non_null(html);
    assert_non_null(csv);
    assert_non_null(strstr(html, "No run measured the retrieval task: ranked by KL"));
    assert_non_null(strstr(html, "40&nbsp;% of the span: <strong>KVCapsule (tiled)</strong> "
                                 "(a kvcap extension, KL 0.011; best paper method KVCapsule "
                                 "(dense), KL 0.014)"));
    const char *card = strstr(html, "Keep 40&nbsp;% of the span");
    assert_non_null(card);
    const char *first = strstr(card, "title=\"kvcapsule-tiled@0.40\""),
               *second = strstr(card, "title=\"composition@0.40\""),
               *last = strstr(card, "title=\"streaming@0.40\"");
    assert_true(first && second && last && first < second && second < last);
    assert_null(strstr(html, "Task accuracy by depth"));
    /* The panels stay, empty; the table shows the columns as not measured. */
    assert_non_null(strstr(html, ">Next-token agreement (teacher-forced)</text>"));
    assert_non_null(strstr(html, ">not measured</text>"));
    const char *row = strstr(strstr(html, "<h2>Headline results</h2>"),
                             "title=\"kvcapsule-tiled@0.40\">");
    assert_non_null(row);
    const char *cells = strstr(row, "<td class=\"na\">&mdash;</td>"
                                    "<td class=\"sec\">99.1&nbsp;%</td>");
    assert_true(cells && cells < strstr(row, "</tr>"));
    assert_non_null(strstr(csv, "\nkvcapsule-tiled@0.40,kvcapsule,KVCapsule (tiled),0.4,2.455,"
                                "0.991,,"));
    /* No full sample: 7 boxes, nothing highlighted; a control character is replaced. */
    assert_int_equal(count(html, "<div class=\"sample\" title="), 7);
    assert_int_equal(count(html, "no full-cache sample to compare with"), 7);
    assert_null(strstr(html, "<span class=\"dv\">&lt;"));
    assert_null(strstr(html, "\x1b"));
    char *box = sample_box_of(html, "kvcapsule-tiled@0.40");
    assert_non_null(strstr(box, "<div class=\"st\">a\xef\xbf\xbd" "b\tc"));
    free(box);
    free(html);
    free(csv);

    /* A sample that is a prefix of full's. */
    cJSON_Delete(doc);
    doc = load_sample();
    cJSON_ReplaceItemInObject(run_of(doc, 5), "sample",
                              cJSON_CreateString(" \xe2\x80\x98Who in the world"));
    test_write_json(d.metrics, doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_OK);
    html = test_slurp(d.html);
    assert_non_null(html);
    box = sample_box_of(html, "kvcapsule-dense@0.40");
    assert_non_null(strstr(box, "as full, but ends after 18 characters"));
    assert_null(strstr(box, "class=\"dv\""));
    free(box);
    free(html);

    /* No samples at all: no section, even with the prompt's tail. */
    remove_from_runs(doc, "sample");
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_OK);
    html = test_slurp(d.html);
    assert_non_null(html);
    assert_null(strstr(html, "Sample continuations"));
    assert_null(strstr(html, "class=\"sample"));
    free(html);
    dirs_remove(&d);
}

/* The ranking on a small file: task accuracy high to low, ties by KL low to high, runs without
 * the task last; full heads each card as the ceiling; targets each get a card. */
static void test_ranking_order(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
#define RUN(id, label, ext, ret, kl, task)                                                      \
    "{\"id\": \"" id "\", \"policy\": \"streaming\", \"label\": \"" label "\", "                   \
    "\"extension\": " ext ", \"retention\": " ret ", \"nominal\": " ret ", "                       \
    "\"realised_retention\": " ret ", \"kl\": " kl ", \"task\": " task "}"
    write_text(d.metrics,
               "{\"format\": 1, \"title\": \"ranking\", \"runs\": ["
               "{\"id\": \"full\", \"policy\": \"full\", \"label\": \"full\", "
               "\"extension\": false, \"retention\": 1, \"nominal\": 1, \"realised_retention\": 1, \"kl\": 0, "
               "\"task\": {\"accuracy\": 0.875}},"
               RUN("a", "A", "false", "0.3", "0.2", "{\"accuracy\": 0.5}") ","
               RUN("b", "B", "false", "0.3", "0.3", "{\"accuracy\": 0.75}") ","
               RUN("c", "C", "true", "0.3", "0.1", "{\"accuracy\": 0.5}") ","
               RUN("d", "D", "false", "0.3", "0.01", "null") ","
               RUN("e", "E", "false", "0.7", "0.05", "{\"accuracy\": 0.25}") ","
               RUN("f", "F", "true", "0.7", "0.04", "{\"accuracy\": 0.25}") "]}");
#undef RUN
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_OK);
    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_int_equal(count(html, "<div class=\"rank-card\">"), 2);
    const char *card = strstr(html, "Keep 30&nbsp;% of the span"),
               *card2 = strstr(html, "Keep 70&nbsp;% of the span");
    assert_true(card && card2 && card < card2);
    static const char *const order[] = {"<tr class=\"ceiling\" title=\"full\">",
                                        "<tr class=\"win\" title=\"b\"><td>1</td>",
                                        "<tr class=\"rk\" title=\"c\"><td>2</td>",
                                        "<tr class=\"rk\" title=\"a\"><td>3</td>",
                                        "<tr class=\"rk\" title=\"d\"><td>4</td>",
                                        "<tr class=\"ceiling\" title=\"full\">",
                                        "<tr class=\"win\" title=\"f\"><td>1</td>",
                                        "<tr class=\"rk\" title=\"e\"><td>2</td>"};
    const char *at = card;
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        const char *next = strstr(at, order[i]);
        if (!next || (i < 5 && next > card2))
            fail_msg("ranking: '%s' missing or out of order", order[i]);
        at = next + 1;
    }
    /* The extension is tagged where it ranks; full's accuracy is the ceiling of each bar. */
    const char *c = strstr(card, "title=\"c\">");
    assert_true(strstr(c, "kvcap extension") < strstr(c, "</tr>"));
    assert_int_equal(count(html, "<b style=\"left:87.5%\"></b>"), 4 + 3);
    assert_non_null(strstr(html, "Best when keeping 30&nbsp;% of the span: <strong>B</strong> "
                                 "(75.0&nbsp;% task accuracy); 70&nbsp;% of the span: "
                                 "<strong>F</strong> (a kvcap extension, 25.0&nbsp;% task "
                                 "accuracy; best paper method E, 25.0&nbsp;%). Full, the "
                                 "ceiling, answers 87.5&nbsp;%."));
    free(html);
    dirs_remove(&d);
}

/* ---- Escaping ------------------------------------------------------------------------------- */

static void test_html_escaping(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    cJSON *doc = load_sample();
    const char *label = "<script>alert('x')</script> & \"co\"";
    cJSON_ReplaceItemInObject(run_of(doc, 4), "label", cJSON_CreateString(label));
    cJSON_ReplaceItemInObject(doc, "title", cJSON_CreateString("A & B <i>"));
    cJSON_AddItemToArray(cJSON_GetObjectItem(doc, "notes"),
                         cJSON_CreateString("<script>x</script> & <i>note</i>"));
    cJSON_ReplaceItemInObject(doc, "prompt_sample", cJSON_CreateString("\"<i>\" & 'q'"));
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, d.csv), KVCAP_OK);

    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_null(strstr(html, "<script"));
    assert_null(strstr(html, "<i>"));
    assert_non_null(strstr(html, "<h1>A &amp; B &lt;i&gt;</h1>"));
    const char *escaped = "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;co&quot;";
    /* In the table, the legend, the heatmap, the samples and the bars. */
    assert_true(count(html, escaped) >= 5);
    assert_non_null(strstr(html, "<li>&lt;script&gt;x&lt;/script&gt; &amp; &lt;i&gt;note&lt;/i&gt;"
                                 "</li>"));
    assert_non_null(strstr(html, "&hellip;&quot;&lt;i&gt;&quot; &amp; &#39;q&#39;</div>"));
    free(html);

    char *csv = test_slurp(d.csv);
    assert_non_null(csv);
    assert_non_null(strstr(csv, ",\"<script>alert('x')</script> & \"\"co\"\"\","));
    free(csv);

    /* A label that starts like a spreadsheet formula stays text in the CSV. */
    doc = load_sample();
    cJSON_ReplaceItemInObject(run_of(doc, 4), "label",
                              cJSON_CreateString("=HYPERLINK(\"http://x\",\"y\")"));
    cJSON_ReplaceItemInObject(run_of(doc, 5), "label", cJSON_CreateString("@SUM(A1)"));
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, d.csv), KVCAP_OK);
    csv = test_slurp(d.csv);
    assert_non_null(csv);
    assert_non_null(strstr(csv, ",\"'=HYPERLINK(\"\"http://x\"\",\"\"y\"\")\","));
    assert_non_null(strstr(csv, ",\"'@SUM(A1)\""));
    assert_null(strstr(csv, ",=HYPERLINK"));
    free(csv);
    dirs_remove(&d);
}

/* ---- Malformed inputs ------------------------------------------------------------------------- */

struct bad_case {
    const char *name, *needle;
    void (*edit)(cJSON *doc); /* NULL: `text` is the whole file */
    const char *text;
};

static void no_runs(cJSON *doc) { cJSON_DeleteItemFromObject(doc, "runs"); }
static void empty_runs(cJSON *doc) { cJSON_ReplaceItemInObject(doc, "runs", cJSON_CreateArray()); }
static void run_without_id(cJSON *doc) { cJSON_DeleteItemFromObject(run_of(doc, 3), "id"); }
static void agreement_string(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 3), "token_agreement", cJSON_CreateString("high"));
}
static void agreement_range(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 3), "token_agreement", cJSON_CreateNumber(1.5));
}
static void cosine_short(cJSON *doc)
{
    cJSON *a = cJSON_GetObjectItem(run_of(doc, 2), "attn_cosine");
    cJSON_DeleteItemFromArray(a, cJSON_GetArraySize(a) - 1);
}
static void rel_err_element(cJSON *doc)
{
    cJSON *a = cJSON_GetObjectItem(run_of(doc, 5), "attn_rel_err");
    cJSON_ReplaceItemInArray(a, 4, cJSON_CreateString("0.1"));
}
static void format_2(cJSON *doc) { cJSON_ReplaceItemInObject(doc, "format", cJSON_CreateNumber(2)); }
static void no_format(cJSON *doc) { cJSON_DeleteItemFromObject(doc, "format"); }
static void no_title(cJSON *doc) { cJSON_DeleteItemFromObject(doc, "title"); }
static void no_layers(cJSON *doc)
{
    cJSON_DeleteItemFromObject(cJSON_GetObjectItem(doc, "model"), "layers");
}
static void duplicate_id(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 4), "id", cJSON_CreateString("full@1.00"));
}
static void unknown_policy(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 0), "policy", cJSON_CreateString("h2o"));
}
static void retention_zero(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 1), "retention", cJSON_CreateNumber(0));
}
static void mask_index(cJSON *doc)
{
    cJSON *mask = cJSON_GetArrayItem(cJSON_GetObjectItem(doc, "masks"), 1);
    cJSON *head = cJSON_GetArrayItem(cJSON_GetArrayItem(cJSON_GetObjectItem(mask, "kept"), 0), 2);
    cJSON_ReplaceItemInArray(head, 0, cJSON_CreateNumber(256));
}
static void mask_heads(cJSON *doc)
{
    cJSON *mask = cJSON_GetArrayItem(cJSON_GetObjectItem(doc, "masks"), 0);
    cJSON_DeleteItemFromArray(cJSON_GetArrayItem(cJSON_GetObjectItem(mask, "kept"), 7), 0);
}
static void goal_met(cJSON *doc)
{
    cJSON *goal = cJSON_GetArrayItem(cJSON_GetObjectItem(doc, "goals"), 0);
    cJSON_ReplaceItemInObject(goal, "met", cJSON_CreateString("yes"));
}
static void next_token_string(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 2), "next_token_agreement", cJSON_CreateString("99%"));
}
static void next_token_range(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 2), "next_token_agreement", cJSON_CreateNumber(1.2));
}
static void sample_number(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 4), "sample", cJSON_CreateNumber(3));
}
static void notes_string(cJSON *doc)
{
    cJSON_ReplaceItemInObject(doc, "notes", cJSON_CreateString("one note"));
}
static void notes_element(cJSON *doc)
{
    cJSON_ReplaceItemInArray(cJSON_GetObjectItem(doc, "notes"), 1, cJSON_CreateNumber(7));
}
static void prompt_sample_object(cJSON *doc)
{
    cJSON_ReplaceItemInObject(doc, "prompt_sample", cJSON_CreateObject());
}
static void model_string(cJSON *doc)
{
    cJSON_ReplaceItemInObject(doc, "model", cJSON_CreateString("SmolLM2"));
}

static void kl_string(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 2), "kl", cJSON_CreateString("low"));
}
static void kl_negative(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 3), "kl", cJSON_CreateNumber(-0.1));
}
static void kl_null(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 3), "kl", cJSON_CreateNull());
}
static void no_kl(cJSON *doc) { cJSON_DeleteItemFromObject(run_of(doc, 1), "kl"); }
static void no_extension(cJSON *doc) { cJSON_DeleteItemFromObject(run_of(doc, 2), "extension"); }
static void extension_string(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 2), "extension", cJSON_CreateString("yes"));
}
static void no_nominal(cJSON *doc) { cJSON_DeleteItemFromObject(run_of(doc, 4), "nominal"); }
static void no_realised(cJSON *doc)
{
    cJSON_DeleteItemFromObject(run_of(doc, 5), "realised_retention");
}
static void realised_string(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 5), "realised_retention", cJSON_CreateString("0.4"));
}
static void task_accuracy_range(cJSON *doc)
{
    cJSON_ReplaceItemInObject(cJSON_GetObjectItem(run_of(doc, 6), "task"), "accuracy",
                              cJSON_CreateNumber(1.5));
}
static void task_depths_short(cJSON *doc)
{
    cJSON *task = cJSON_GetObjectItem(run_of(doc, 6), "task");
    cJSON *a = cJSON_GetObjectItem(task, "accuracy_by_depth");
    cJSON_DeleteItemFromArray(a, 0);
}
static void task_number(cJSON *doc)
{
    cJSON_ReplaceItemInObject(run_of(doc, 1), "task", cJSON_CreateNumber(3));
}
static void freekv_hidden_range(cJSON *doc)
{
    cJSON_ReplaceItemInObject(cJSON_GetObjectItem(run_of(doc, 17), "freekv"), "hidden",
                              cJSON_CreateNumber(2));
}
static void depths_string(cJSON *doc)
{
    cJSON_ReplaceItemInObject(cJSON_GetObjectItem(doc, "task"), "depths", cJSON_CreateString("8"));
}
static void depth_range(cJSON *doc)
{
    cJSON_ReplaceItemInArray(cJSON_GetObjectItem(cJSON_GetObjectItem(doc, "task"), "depths"), 3,
                             cJSON_CreateNumber(1.5));
}

/* Several images per prompt (setup.images, gap_tokens): read, and said in the setup line; a
 * prompt with one image writes neither and reads as one. */
static void test_several_images(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    cJSON *doc = load_sample();
    cJSON *setup = cJSON_GetObjectItem(doc, "setup");
    cJSON_AddNumberToObject(setup, "images", 3);
    cJSON_AddNumberToObject(setup, "gap_tokens", 16);
    test_write_json(d.metrics, doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, d.csv), KVCAP_OK);
    char *html = test_slurp(d.html);
    assert_non_null(strstr(html, "3 images &middot; each span 256 tokens &middot; 16 text tokens "
                                 "between two"));
    free(html);
    assert_int_equal(kvcap_report_write(SAMPLE, d.html, d.csv), KVCAP_OK);
    html = test_slurp(d.html);
    assert_null(strstr(html, "text tokens between two"));
    assert_non_null(strstr(html, "span 256 tokens"));
    free(html);
    cJSON_Delete(doc);
    dirs_remove(&d);
}

static void images_string(cJSON *doc)
{
    cJSON_AddStringToObject(cJSON_GetObjectItem(doc, "setup"), "images", "two");
}

static void test_malformed_inputs(void **state)
{
    (void)state;
    static const struct bad_case cases[] = {
        {"missing runs", "runs: missing", no_runs, NULL},
        {"empty runs", "runs: empty", empty_runs, NULL},
        {"run without id", "runs[3].id: missing", run_without_id, NULL},
        {"token_agreement of the wrong type",
         "runs[3].token_agreement: expected a fraction in [0, 1] or null, got a string",
         agreement_string, NULL},
        {"token_agreement out of range", "runs[3].token_agreement: expected a fraction",
         agreement_range, NULL},
        {"attn_cosine of the wrong length", "runs[2].attn_cosine: 29 entries, expected 30",
         cosine_short, NULL},
        {"attn_rel_err element", "runs[5].attn_rel_err[4]: expected", rel_err_element, NULL},
        {"format 2", "format: 2 is not supported", format_2, NULL},
        {"no format", "format: missing", no_format, NULL},
        {"no title", "title: missing", no_title, NULL},
        {"per-layer arrays without model.layers", "model.layers: missing", no_layers, NULL},
        {"duplicate id", "runs[4].id: 'full@1.00' repeats runs[0].id", duplicate_id, NULL},
        {"unknown policy", "runs[0].policy: 'h2o'", unknown_policy, NULL},
        {"retention 0", "runs[1].retention", retention_zero, NULL},
        {"mask token index", "masks[1].kept[0][2][0]: expected a token index in [0, 256)",
         mask_index, NULL},
        {"mask head count", "masks[0].kept[7]: 2 entries, expected 3", mask_heads, NULL},
        {"goal met", "goals[0].met: expected true or false", goal_met, NULL},
        {"model not an object", "model: expected an object", model_string, NULL},
        {"next_token_agreement of the wrong type",
         "runs[2].next_token_agreement: expected a fraction in [0, 1] or null, got a string",
         next_token_string, NULL},
        {"next_token_agreement out of range",
         "runs[2].next_token_agreement: expected a fraction in [0, 1], got 1.2", next_token_range,
         NULL},
        {"sample not a string", "runs[4].sample: expected a string or null, got a number",
         sample_number, NULL},
        {"notes not an array", "notes: expected an array of strings, got a string", notes_string,
         NULL},
        {"notes element", "notes[1]: expected a string, got a number", notes_element, NULL},
        {"prompt_sample not a string", "prompt_sample: expected a string or null, got an object",
         prompt_sample_object, NULL},
        {"kl of the wrong type", "runs[2].kl: expected a number >= 0, got a string", kl_string,
         NULL},
        {"kl negative", "runs[3].kl: expected a number >= 0, got -0.1", kl_negative, NULL},
        {"kl null", "runs[3].kl: missing (expected a number >= 0)", kl_null, NULL},
        {"no kl", "runs[1].kl: missing", no_kl, NULL},
        {"no extension", "runs[2].extension: missing (expected true or false)", no_extension,
         NULL},
        {"extension not a boolean",
         "runs[2].extension: wrong type (expected true or false, got a string)", extension_string,
         NULL},
        {"no nominal", "runs[4].nominal: missing", no_nominal, NULL},
        {"no realised_retention",
         "runs[5].realised_retention: missing (expected a number >= 0 or null)", no_realised,
         NULL},
        {"realised_retention of the wrong type",
         "runs[5].realised_retention: expected a number >= 0 or null, got a string",
         realised_string,
         NULL},
        {"task accuracy out of range",
         "runs[6].task.accuracy: expected a fraction in [0, 1], got 1.5", task_accuracy_range,
         NULL},
        {"accuracy_by_depth of the wrong length",
         "runs[6].task.accuracy_by_depth: 7 entries, expected 8 (task.depths)", task_depths_short,
         NULL},
        {"task not an object", "runs[1].task: expected an object, got a number", task_number,
         NULL},
        {"freekv share out of range",
         "runs[17].freekv.hidden: expected a fraction in [0, 1], got 2", freekv_hidden_range,
         NULL},
        {"task depths not an array", "task.depths: expected an array, got a string",
         depths_string, NULL},
        {"images not a number", "setup.images: expected a whole number >= 1 or null, got a string",
         images_string, NULL},
        {"task depth out of range", "task.depths[3]: expected a fraction in [0, 1], got 1.5",
         depth_range, NULL},
        {"not JSON at all", "not valid JSON", NULL, "kvcap metrics, honest\n"},
        {"truncated JSON", "not valid JSON (syntax error at line 4, byte 29)", NULL,
         "{\n  \"format\": 1,\n  \"runs\": [\n"},
        {"trailing garbage", "not valid JSON", NULL, "{\"format\": 1} x"},
        {"top-level array", "expected a JSON object at the top level", NULL, "[1, 2]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const struct bad_case *c = &cases[i];
        struct dirs d;
        dirs_make(&d);
        if (c->edit) {
            cJSON *doc = load_sample();
            c->edit(doc);
            test_write_json(d.metrics, doc);
            cJSON_Delete(doc);
        } else {
            write_text(d.metrics, c->text);
        }
        enum kvcap_status st = kvcap_report_write(d.metrics, d.html, d.csv);
        if (st != KVCAP_ERR_FORMAT)
            fail_msg("%s: got status %d (%s), want KVCAP_ERR_FORMAT", c->name, (int)st,
                     kvcap_last_error());
        assert_error_names(d.metrics, c->needle);
        if (dir_entries(d.out) != 0)
            fail_msg("%s: the failed report left files in %s", c->name, d.out);
        dirs_remove(&d);
    }
}

static void test_missing_input(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, d.csv), KVCAP_ERR_IO);
    assert_error_names(d.metrics, "cannot open");
    assert_int_equal(dir_entries(d.out), 0);
    dirs_remove(&d);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    assert_int_equal(kvcap_report_write(NULL, d.html, d.csv), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_report_write(SAMPLE, SAMPLE, d.csv), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_report_write(SAMPLE, d.html, d.html), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_report_write(SAMPLE, "", NULL), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(dir_entries(d.out), 0);
    dirs_remove(&d);
}

/* Other tracks beside the first: each run next to the run of the same id; an image track's
 * grid names its columns and the ranking shows the attention cosine where no task ran. */
/* The sample as an image track: a 16 x 16 grid, 40 photos of which 10 held out; its "track"
 * object, owned by doc. */
static cJSON *add_image_track(cJSON *doc)
{
    cJSON *track = cJSON_CreateObject();
    cJSON_AddStringToObject(track, "kind", "image");
    cJSON_AddNumberToObject(track, "rows", 16);
    cJSON_AddNumberToObject(track, "cols", 16);
    cJSON_AddNumberToObject(track, "photos", 40);
    cJSON_AddNumberToObject(track, "heldout_photos", 10);
    cJSON_AddItemToObject(doc, "track", track);
    return track;
}

/* The sample's first mask drawn over a photo crop (a 16 x 16 grid and a thumbnail); the mask. */
static cJSON *add_mask_thumb(cJSON *doc)
{
    cJSON *mask = cJSON_GetArrayItem(cJSON_GetObjectItem(doc, "masks"), 0);
    cJSON_AddNumberToObject(mask, "rows", 16);
    cJSON_AddNumberToObject(mask, "cols", 16);
    cJSON_AddStringToObject(mask, "thumb", "data:image/bmp;base64,Qk0A");
    return mask;
}

static void test_tracks_side_by_side(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    cJSON *doc = load_sample();
    add_image_track(doc);
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    const char *paths[2] = {d.metrics, SAMPLE};
    if (kvcap_report_write_tracks(paths, 2, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_non_null(strstr(html, "<h2>Tracks side by side</h2>"));
    assert_non_null(strstr(html, "image 16&thinsp;&times;&thinsp;16</th>"));
    assert_non_null(strstr(html, "text 1&thinsp;&times;&thinsp;256</th>"));
    assert_non_null(strstr(html, "an image span of 16&thinsp;&times;&thinsp;16 tokens"));
    assert_non_null(strstr(html, "<dt>Images</dt><dd>40 photos (10 held out"));
    free(html);
    /* a mask drawn over its photo: only a base64 BMP data URI on a grid of n_tokens */
    doc = load_sample();
    cJSON *mask = add_mask_thumb(doc);
    test_write_json(d.metrics, doc);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_non_null(html = test_slurp(d.html));
    assert_non_null(strstr(html, "href=\"data:image/bmp;base64,Qk0A\"/>"));
    assert_non_null(strstr(html, "The 16&thinsp;&times;&thinsp;16 tokens of a held-out photo"));
    free(html);
    cJSON_ReplaceItemInObject(mask, "thumb", cJSON_CreateString("javascript:alert(1)"));
    test_write_json(d.metrics, doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_ERR_FORMAT);
    assert_error_names(d.metrics, "masks[0].thumb: not a base64 BMP data URI");
    cJSON_ReplaceItemInObject(mask, "thumb", cJSON_CreateString("data:image/bmp;base64,Qk0A"));
    cJSON_ReplaceItemInObject(mask, "cols", cJSON_CreateNumber(15));
    test_write_json(d.metrics, doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_ERR_FORMAT);
    assert_error_names(d.metrics, "rows x cols (16 x 15) is not n_tokens (256)");
    /* the same file as a second track: refused by name, and what was read of it freed (the
     * sanitizer build's leak check) */
    const char *bad_second[2] = {SAMPLE, d.metrics};
    assert_int_equal(kvcap_report_write_tracks(bad_second, 2, d.html, NULL), KVCAP_ERR_FORMAT);
    assert_error_names(d.metrics, "rows x cols (16 x 15) is not n_tokens (256)");
    cJSON_Delete(doc);

    /* one track: no such section; a bad kind is named */
    if (kvcap_report_write(SAMPLE, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_non_null(html = test_slurp(d.html));
    assert_null(strstr(html, "Tracks side by side"));
    free(html);
    doc = load_sample();
    cJSON *track = cJSON_CreateObject();
    cJSON_AddStringToObject(track, "kind", "audio");
    cJSON_AddItemToObject(doc, "track", track);
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_ERR_FORMAT);
    assert_error_names(d.metrics, "track.kind: 'audio' is not text or image");
    dirs_remove(&d);
}

/* A run on the data the compressors were fitted on (kvcap-eval run --photos calibration, or
 * --docs naming calibration documents) says so, in bold, where held-out prompts are claimed
 * otherwise; an unknown split is named. */
static void test_calibration_split(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    static const char *const claim = "These prompts come from the";
    cJSON *doc = load_sample();
    cJSON *track = add_image_track(doc);
    cJSON_AddStringToObject(track, "photos_split", "calibration");
    add_mask_thumb(doc);
    test_write_json(d.metrics, doc);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_non_null(strstr(html, " was evaluated on 24 calibration prompts: "));
    assert_non_null(strstr(html, "tokens (a calibration photo's patch features"));
    assert_non_null(strstr(html, "<strong>These prompts come from the photos the compressors were "
                                 "fitted on: the run is for choosing a setting, not for judging "
                                 "one.</strong>"));
    assert_non_null(strstr(html, "(10 held out, never calibrated on) &middot; these prompts show "
                                 "the calibration photos"));
    assert_non_null(strstr(html, "The 16&thinsp;&times;&thinsp;16 tokens of a calibration photo"));
    free(html);
    /* the held-out splits (development, test, or heldout as files before the test split
     * named development), or none said: as before */
    static const char *const held_splits[] = {"heldout", "development", "test", NULL};
    for (int k = 0; k < 4; k++) {
        if (held_splits[k])
            cJSON_ReplaceItemInObject(track, "photos_split", cJSON_CreateString(held_splits[k]));
        else
            cJSON_DeleteItemFromObject(track, "photos_split");
        test_write_json(d.metrics, doc);
        assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_OK);
        assert_non_null(html = test_slurp(d.html));
        assert_non_null(strstr(html, " was evaluated on 24 held-out prompts: "));
        assert_non_null(strstr(html, "tokens (a held-out photo's patch features"));
        assert_non_null(strstr(html, "tokens of a held-out photo"));
        assert_null(strstr(html, claim));
        free(html);
    }
    cJSON_AddStringToObject(track, "photos_split", "train");
    test_write_json(d.metrics, doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_ERR_FORMAT);
    assert_error_names(d.metrics,
                       "track.photos_split: 'train' is not calibration, development or test");
    cJSON_Delete(doc);
    /* text: prompts from documents that are all calibration documents */
    doc = load_sample();
    cJSON *corpus = cJSON_GetObjectItem(doc, "corpus");
    cJSON_ReplaceItemInObject(corpus, "heldout", cJSON_Duplicate(cJSON_GetObjectItem(corpus,
                                                                                      "calibration"),
                                                                 1));
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_OK);
    assert_non_null(html = test_slurp(d.html));
    assert_non_null(strstr(html, " was evaluated on 24 calibration prompts: "));
    assert_non_null(strstr(html, "<strong>These prompts come from the documents the compressors"));
    free(html);
    /* one held-out document among them: held-out prompts */
    assert_int_equal(kvcap_report_write(SAMPLE, d.html, NULL), KVCAP_OK);
    assert_non_null(html = test_slurp(d.html));
    assert_non_null(strstr(html, " was evaluated on 24 held-out prompts: "));
    assert_null(strstr(html, claim));
    free(html);
    dirs_remove(&d);
}

/* kvpress.json beside the metrics (scripts/kvpress-reference.sh): its presses beside kvcap's best
 * row and random eviction at each retention; another setup's file is named and not shown; a
 * malformed one is refused naming the file and the field. */

/* What binds a kvpress.json to its run: the sample given the prompts_sha256 kvcap-eval writes
 * (any 64 hex digits: the report compares, it does not recompute), and the fields
 * kvpress_reference.py writes about its own run, as JSON text (NULL: left out, as an older
 * script did). */
#define SAMPLE_PROMPTS_SHA256 "bb1413116c3646a41fde9c9e2823f7f4e1651fb98edee55ed9f4a127e7b01b89"
#define OTHER_PROMPTS_SHA256 "9a9b184c11fe3ecd25b8f33a65e42deffee721aaf49ad9876084f1c28bcf1779"
struct kvpress_binding {
    const char *track, *prompts_sha256, *retentions, *full_nll;
};
/* the sample's: a text run, full's nll 2.8473, retentions 0.2, 0.4, 0.6 */
static const struct kvpress_binding BOUND = {"\"text\"", "\"" SAMPLE_PROMPTS_SHA256 "\"",
                                             "[0.2]", "2.8481"};

static cJSON *load_bound_sample(void)
{
    cJSON *doc = load_sample();
    cJSON_AddStringToObject(doc, "prompts_sha256", SAMPLE_PROMPTS_SHA256);
    return doc;
}

static void write_kvpress_bound(const char *dir, int prompts, const char *row0,
                                const struct kvpress_binding *b)
{
    char path[700], text[8192], bind[1024] = "";
    const char *key[4] = {"track", "prompts_sha256", "retentions", "full_nll"};
    const char *value[4] = {b->track, b->prompts_sha256, b->retentions, b->full_nll};
    for (int i = 0; i < 4; i++)
        if (value[i])
            snprintf(bind + strlen(bind), sizeof bind - strlen(bind), "\"%s\": %s, ", key[i],
                     value[i]);
    snprintf(path, sizeof path, "%s/kvpress.json", dir);
    snprintf(text, sizeof text,
             "{\"source\": \"kvpress\", \"kvpress_version\": \"0.5.5\", "
             "\"transformers_version\": \"5.2.0\", \"prompts\": %d, %s"
             "\"layout\": {\"head\": 16, \"span\": 256, \"tail\": 64, \"continuation\": 64}, "
             "\"rows\": [%s, {\"press\": \"snapkv\", \"retention\": 0.2, \"dnll\": 0.14, "
             "\"kl\": 0.13, \"next_token_agreement\": 0.84, \"realised_retention\": 0.199}]}",
             prompts, bind, row0);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void write_kvpress(const char *dir, int prompts, const char *row0)
{
    write_kvpress_bound(dir, prompts, row0, &BOUND);
}

static void test_outside_reference(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    cJSON *doc = load_bound_sample();
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    const char *good = "{\"press\": \"kvzip\", \"retention\": 0.2, \"dnll\": 0.0181, "
                       "\"kl\": 0.0291, \"next_token_agreement\": 0.917, "
                       "\"realised_retention\": 0.2}";
    write_kvpress(d.in, 24, good);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_non_null(strstr(html, "<h2>Outside reference: kvpress</h2>"));
    assert_non_null(strstr(html, "kvpress kvzip</td><td>0.20</td><td>20.0&nbsp;%</td>"));
    assert_non_null(strstr(html, "kvpress snapkv"));
    assert_non_null(strstr(html, "kvcap&rsquo;s best by KL"));
    assert_non_null(strstr(html, "kvpress 0.5.5 on transformers 5.2.0"));
    assert_null(strstr(html, "kvzip_whole_prompt")); /* explained only where it is a row */
    free(html);
    /* KVzip replaying the whole prompt beside the press as shipped: both rows, and why */
    char two[1024];
    snprintf(two, sizeof two, "%s, {\"press\": \"kvzip_whole_prompt\", \"retention\": 0.2, "
             "\"dnll\": 0.0259, \"kl\": 0.0286, \"next_token_agreement\": 0.915, "
             "\"realised_retention\": 0.2}", good);
    write_kvpress(d.in, 24, two);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_non_null(html = test_slurp(d.html));
    assert_non_null(strstr(html, "kvpress kvzip_whole_prompt</td><td>0.20</td>"));
    assert_non_null(strstr(html, "<b>kvzip_whole_prompt</b> is the same press replaying the "
                                 "whole prompt"));
    free(html);
    /* measured on another number of prompts: said, not shown */
    write_kvpress(d.in, 8, good);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_non_null(html = test_slurp(d.html));
    assert_non_null(strstr(html, "kvpress.json beside this report is not shown: it was measured "
                                 "on 8 prompts of 16 + 256 + 64 tokens, 64 continued, this run "
                                 "on 24 of 16 + 256 + 64, 64 continued; rerun "
                                 "scripts/kvpress-reference.sh on this folder.</p>"));
    assert_null(strstr(html, "kvpress kvzip</td>"));
    free(html);
    /* Per-prompt values on both sides: kvcap's best against each row, paired over the 24
     * prompts. kvcap's best is 0.02 nats of KL below the press on every prompt (a win beyond
     * any interval) and its |dNLL| 0.0105 above (a loss); the press's dNLL is negative on every
     * prompt, so only its size counts. */
    doc = load_bound_sample();
    cJSON *run;
    cJSON_ArrayForEach(run, cJSON_GetObjectItem(doc, "runs"))
    {
        if (fabs(cJSON_GetObjectItem(run, "retention")->valuedouble - 0.2) > 1e-9)
            continue;
        cJSON *pp = cJSON_AddObjectToObject(run, "per_prompt");
        cJSON *pd = cJSON_AddArrayToObject(pp, "nll_delta"), *pk = cJSON_AddArrayToObject(pp, "kl");
        for (int i = 0; i < 24; i++) {
            cJSON_AddItemToArray(pd, cJSON_CreateNumber(0.020 + 0.001 * (i % 3)));
            cJSON_AddItemToArray(pk, cJSON_CreateNumber(0.010 + 0.001 * (i % 4)));
        }
    }
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    char rows[4096], dn[1024] = "", kl[1024] = "";
    for (int i = 0; i < 24; i++) {
        size_t a = strlen(dn), k = strlen(kl);
        snprintf(dn + a, sizeof dn - a, "%s%.4f", i ? ", " : "", -(0.010 + 0.001 * (i % 2)));
        snprintf(kl + k, sizeof kl - k, "%s%.4f", i ? ", " : "", 0.030 + 0.001 * (i % 4));
    }
    snprintf(rows, sizeof rows, "{\"press\": \"kvzip\", \"retention\": 0.2, \"dnll\": -0.0105, "
             "\"kl\": 0.0315, \"next_token_agreement\": 0.9, \"realised_retention\": 0.2, "
             "\"per_prompt\": {\"dnll\": [%s], \"kl\": [%s]}}", dn, kl);
    write_kvpress(d.in, 24, rows);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_non_null(html = test_slurp(d.html));
    const char *at = strstr(html, "kvpress kvzip</td>");
    assert_non_null(at);
    const char *win = strstr(at, "<td class=\"win\">&minus;0.0200<br>"),
               *lose = strstr(at, "<td class=\"lose\">+0.0105<br>"), *end = strstr(at, "</tr>");
    assert_true(win && win < end && lose && lose < end && win < lose);
    /* snapkv's row has no per-prompt values: dashes */
    at = strstr(html, "kvpress snapkv</td>");
    assert_non_null(at);
    assert_non_null(strstr(at, "<td>&mdash;</td><td>&mdash;</td></tr>"));
    free(html);
    /* per-prompt values of another length than the prompts */
    write_kvpress(d.in, 24, "{\"press\": \"kvzip\", \"retention\": 0.2, \"dnll\": 0.01, "
                            "\"kl\": 0.02, \"next_token_agreement\": 0.9, "
                            "\"realised_retention\": 0.2, \"per_prompt\": {\"dnll\": [0.01, 0.02], "
                            "\"kl\": [0.02, 0.02]}}");
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_ERR_FORMAT);
    assert_non_null(strstr(kvcap_last_error(), "kvpress.json"));
    assert_non_null(strstr(kvcap_last_error(), "rows[0].per_prompt.dnll: 2 entries, expected 24"));
    /* a row without its dnll */
    write_kvpress(d.in, 24, "{\"press\": \"kvzip\", \"retention\": 0.2, \"kl\": 0.02, "
                            "\"next_token_agreement\": 0.9, \"realised_retention\": 0.2}");
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_ERR_FORMAT);
    assert_non_null(strstr(kvcap_last_error(), "kvpress.json"));
    assert_non_null(strstr(kvcap_last_error(), "rows[0].dnll"));
    dirs_remove(&d);
}

/* kvpress.json is bound to its run: what kvpress_reference.py writes about the run it measured
 * (track, the hash of the prompts it fed transformers, its retentions, its full-cache NLL) must
 * be this run's, or its rows are left out and the page names the field and both values. A
 * fabricated file naming another run's folder and a full-cache NLL of 99 was shown as "the same
 * prompts" before. */
static const char KVPRESS_ROW[] = "{\"press\": \"kvzip\", \"retention\": 0.2, \"dnll\": 0.0181, "
                                  "\"kl\": 0.0291, \"next_token_agreement\": 0.917, "
                                  "\"realised_retention\": 0.2}";

/* The report of the bound sample (`doc`: NULL for it as is) beside a kvpress.json with binding
 * `b`: no kvpress row, and the caption says `why` (its apostrophes as the page escapes them). */
static void assert_kvpress_refused(cJSON *doc, const struct kvpress_binding *b, const char *why)
{
    struct dirs d;
    dirs_make(&d);
    cJSON *own = doc ? NULL : (doc = load_bound_sample());
    test_write_json(d.metrics, doc);
    cJSON_Delete(own);
    write_kvpress_bound(d.in, 24, KVPRESS_ROW, b);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    char *html = test_slurp(d.html);
    assert_non_null(html);
    const char *caption = in_section(html, "Outside reference: kvpress",
                                     "kvpress.json beside this report is not shown: ");
    char esc[1024] = "";
    for (const char *c = why; *c; c++)
        snprintf(esc + strlen(esc), sizeof esc - strlen(esc), *c == '\'' ? "&#39;" : "%c", *c);
    if (!caption || !strstr(caption, esc))
        fail_msg("no caption saying: %s", esc);
    assert_null(strstr(html, "kvpress kvzip</td>"));
    assert_null(strstr(html, "kvpress snapkv</td>"));
    assert_null(strstr(html, "Checked against this run"));
    free(html);
    dirs_remove(&d);
}

static void test_outside_accepted(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    cJSON *doc = load_bound_sample();
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    /* full_nll 0.0049 above full's 2.8473: within the engines' tolerance */
    struct kvpress_binding b = BOUND;
    b.full_nll = "2.8522";
    b.retentions = "[0.2, 0.6]";
    write_kvpress_bound(d.in, 24, KVPRESS_ROW, &b);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_non_null(strstr(html, "kvpress kvzip</td><td>0.20</td>"));
    assert_non_null(strstr(html, "kvpress snapkv</td>"));
    assert_null(strstr(html, "kvpress.json beside this report is not shown"));
    assert_non_null(strstr(html, "Checked against this run: the same track, prompts "
                                 "(<code>prompts_sha256</code> bb1413116c36&hellip;) and "
                                 "retentions; its full-cache NLL, 2.8522 nats/token, is within "
                                 "0.005 of this run&rsquo;s 2.8473."));
    free(html);
    dirs_remove(&d);
}

static void test_outside_refused_track(void **state)
{
    (void)state;
    struct kvpress_binding b = BOUND;
    b.track = "\"image\"";
    assert_kvpress_refused(NULL, &b, "its track image is not this run's text; rerun "
                                     "scripts/kvpress-reference.sh on this folder");
    /* an image-track run beside a text-track file */
    cJSON *doc = load_bound_sample();
    add_image_track(doc);
    assert_kvpress_refused(doc, &BOUND, "its track text is not this run's image");
    cJSON_Delete(doc);
}

static void test_outside_refused_hash(void **state)
{
    (void)state;
    struct kvpress_binding b = BOUND;
    b.prompts_sha256 = "\"" OTHER_PROMPTS_SHA256 "\"";
    assert_kvpress_refused(NULL, &b, "its prompts_sha256 " OTHER_PROMPTS_SHA256 " is not this "
                                     "run's " SAMPLE_PROMPTS_SHA256 "; rerun "
                                     "scripts/kvpress-reference.sh on this folder");
    /* HTML in a hostile hash is escaped */
    b.prompts_sha256 = "\"<b>x</b>\"";
    assert_kvpress_refused(NULL, &b, "its prompts_sha256 &lt;b&gt;x&lt;/b&gt; is not this run's");
    /* this run's metrics.json without a hash (an older kvcap-eval): nothing to check against */
    cJSON *doc = load_sample();
    assert_kvpress_refused(doc, &BOUND, "this run's metrics.json has no prompts_sha256 (an older "
                                        "kvcap-eval wrote it)");
    cJSON_Delete(doc);
}

static void test_outside_refused_retention(void **state)
{
    (void)state;
    struct kvpress_binding b = BOUND;
    b.retentions = "[0.2, 0.3]"; /* the sample evaluated 0.2, 0.4 and 0.6 */
    assert_kvpress_refused(NULL, &b, "its retention 0.3 is not one this run evaluated (0.2, 0.4, "
                                     "0.6); rerun scripts/kvpress-reference.sh on this folder");
    /* a row at a retention its own list does not name is checked too */
    struct dirs d;
    dirs_make(&d);
    cJSON *doc = load_bound_sample();
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    write_kvpress_bound(d.in, 24, "{\"press\": \"kvzip\", \"retention\": 0.5, \"dnll\": 0.01, "
                                  "\"kl\": 0.02, \"next_token_agreement\": 0.9, "
                                  "\"realised_retention\": 0.5}", &BOUND);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_non_null(strstr(html, "its retention 0.5 is not one this run evaluated"));
    assert_null(strstr(html, "kvpress snapkv</td>"));
    free(html);
    dirs_remove(&d);
}

static void test_outside_refused_nll(void **state)
{
    (void)state;
    struct kvpress_binding b = BOUND;
    b.full_nll = "99"; /* the fabricated file's */
    assert_kvpress_refused(NULL, &b, "its full_nll 99.0000 is not this run's full-cache nll "
                                     "2.8473 (the two engines agree to within 0.005 nats/token "
                                     "on the same weights and prompts); rerun "
                                     "scripts/kvpress-reference.sh on this folder");
    b.full_nll = "2.8422"; /* just beyond the tolerance, below */
    assert_kvpress_refused(NULL, &b, "its full_nll 2.8422 is not this run's full-cache nll 2.8473");
}

static void test_outside_refused_older_file(void **state)
{
    (void)state;
    /* as kvpress_reference.py wrote it before it bound its file to the run */
    const struct kvpress_binding older = {NULL, NULL, NULL, "2.8473"};
    assert_kvpress_refused(NULL, &older, "it was written by an older kvpress-reference.sh and "
                                         "lacks prompts_sha256, track and retentions; rerun "
                                         "scripts/kvpress-reference.sh on this folder");
    struct kvpress_binding b = BOUND;
    b.prompts_sha256 = NULL;
    assert_kvpress_refused(NULL, &b, "it was written by an older kvpress-reference.sh and lacks "
                                     "prompts_sha256;");
    b = BOUND;
    b.full_nll = NULL;
    assert_kvpress_refused(NULL, &b, "lacks full_nll;");
    /* present but malformed: an error naming the file and the field, nothing written */
    struct dirs d;
    dirs_make(&d);
    cJSON *doc = load_bound_sample();
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    b = BOUND;
    b.prompts_sha256 = "42";
    write_kvpress_bound(d.in, 24, KVPRESS_ROW, &b);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_ERR_FORMAT);
    assert_non_null(strstr(kvcap_last_error(), "kvpress.json: prompts_sha256: expected a string"));
    b = BOUND;
    b.retentions = "[0.2, 1.5]";
    write_kvpress_bound(d.in, 24, KVPRESS_ROW, &b);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_ERR_FORMAT);
    assert_non_null(strstr(kvcap_last_error(), "kvpress.json: retentions[1]: expected a fraction"));
    assert_int_equal(access(d.html, F_OK), -1);
    dirs_remove(&d);
}

/* Per-prompt KL of run `id` (nll_delta alongside, as the schema wants both): random's plus
 * `shift` plus `wobble` on odd prompts, minus it on even ones. */
static void set_per_prompt(cJSON *doc, const char *id, double shift, double wobble)
{
    cJSON *run;
    cJSON_ArrayForEach(run, cJSON_GetObjectItem(doc, "runs"))
    {
        if (strcmp(cJSON_GetObjectItem(run, "id")->valuestring, id) != 0)
            continue;
        cJSON *pp = cJSON_AddObjectToObject(run, "per_prompt");
        cJSON *pd = cJSON_AddArrayToObject(pp, "nll_delta"), *pk = cJSON_AddArrayToObject(pp, "kl");
        for (int i = 0; i < 24; i++) {
            double random_kl = 0.050 + 0.001 * (i % 4);
            cJSON_AddItemToArray(pd, cJSON_CreateNumber(0.01));
            cJSON_AddItemToArray(pk, cJSON_CreateNumber(random_kl + shift +
                                                        (i % 2 ? wobble : -wobble)));
        }
        return;
    }
    fail_msg("no run %s", id);
}

/* Random eviction is the floor: at a target with a random run holding per-prompt KL, the ranking
 * card pairs every row with it (closer, not separated, farther), the summary counts them and
 * names the rows that do not clear it, and the CSV carries the difference and its interval. */
static void test_versus_random(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    cJSON *doc = load_sample();
    cJSON *runs = cJSON_GetObjectItem(doc, "runs"), *run, *rnd = NULL;
    cJSON_ArrayForEach(run, runs)
    {
        if (!strcmp(cJSON_GetObjectItem(run, "id")->valuestring, "streaming@0.40"))
            rnd = cJSON_Duplicate(run, 1);
    }
    assert_non_null(rnd);
    cJSON_ReplaceItemInObject(rnd, "id", cJSON_CreateString("random@0.40"));
    cJSON_ReplaceItemInObject(rnd, "policy", cJSON_CreateString("random"));
    cJSON_ReplaceItemInObject(rnd, "label", cJSON_CreateString("random"));
    cJSON_ReplaceItemInObject(rnd, "kl", cJSON_CreateNumber(0.0515));
    cJSON_AddItemToArray(runs, rnd);
    set_per_prompt(doc, "random@0.40", 0, 0);
    set_per_prompt(doc, "streaming@0.40", -0.02, 0.0005); /* closer on every prompt */
    set_per_prompt(doc, "flashcache@0.40", 0.0005, 0.004); /* within the prompts' spread */
    set_per_prompt(doc, "vlcache@0.40", 0.03, 0.0005);    /* farther on every prompt */
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    if (kvcap_report_write(d.metrics, d.html, d.csv) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    char *html = test_slurp(d.html);
    assert_non_null(html);
    /* the column only on the card whose target has a random run */
    assert_int_equal(count(html, "<th>KL&nbsp;&minus;<br>random&rsquo;s</th>"), 1);
    const char *card = strstr(html, "Keep 40&nbsp;% of the span"), *end = strstr(card, "</table>");
    assert_true(card && end);
    static const struct {
        const char *id, *cell;
    } cells[] = {{"random@0.40", "<td class=\"unit\">the floor</td></tr>"},
                 {"streaming@0.40", "<td class=\"win\">&minus;0.0200<br>"},
                 {"flashcache@0.40", "<td class=\"tie\">+0.0005<br>"},
                 {"vlcache@0.40", "<td class=\"lose\">+0.0300<br>"},
                 {"freekv@0.40", "<td class=\"na\">&mdash;</td></tr>"}, /* nothing to pair */
                 {"full@1.00", "<td class=\"na\">&mdash;</td></tr>"}};
    for (size_t i = 0; i < sizeof cells / sizeof cells[0]; i++) {
        char title[64];
        snprintf(title, sizeof title, "title=\"%s\">", cells[i].id);
        const char *row = strstr(card, title), *at = row ? strstr(row, cells[i].cell) : NULL;
        if (!row || row > end || !at || at > strstr(row, "</tr>") + 5)
            fail_msg("ranking at 0.40: %s lacks %s", cells[i].id, cells[i].cell);
    }
    assert_non_null(strstr(html, " Against random eviction at the same budget (KL, paired over "
                                 "the prompts, 95&nbsp;% interval): 1 of 3 compressed rows are "
                                 "closer to full; not separated from it: FlashCache @ 0.40; "
                                 "farther: VL-Cache @ 0.40.</p>"));
    assert_non_null(strstr(html, "The last column pairs each row with random eviction"));
    free(html);
    char *csv = test_slurp(d.csv), f[64];
    assert_non_null(csv);
    assert_memory_equal(csv, CSV_HEADER, strlen(CSV_HEADER));
    assert_string_equal(csv_field(csv, "streaming@0.40", CSV_KL_MINUS_RANDOM, f, sizeof f), "-0.02");
    assert_string_equal(csv_field(csv, "vlcache@0.40", CSV_KL_MINUS_RANDOM, f, sizeof f), "0.03");
    assert_string_equal(csv_field(csv, "random@0.40", CSV_KL_MINUS_RANDOM, f, sizeof f), "");
    assert_string_equal(csv_field(csv, "freekv@0.40", CSV_KL_MINUS_RANDOM, f, sizeof f), "");
    assert_string_equal(csv_field(csv, "freekv@0.40", CSV_KL_MINUS_RANDOM_HALF, f, sizeof f), "");
    double half = atof(csv_field(csv, "flashcache@0.40", CSV_KL_MINUS_RANDOM_HALF, f, sizeof f));
    /* ±0.004 over 24 prompts: sd 0.004·sqrt(24/23), half-width t(0.975, 23) = 2.069 times sd/√24 */
    assert_true(fabs(half - 2.069 * 0.004 * sqrt(24.0 / 23.0) / sqrt(24.0)) < 1e-6);
    free(csv);
    /* the sample has no random run: no column, no sentence */
    assert_int_equal(kvcap_report_write(SAMPLE, d.html, NULL), KVCAP_OK);
    assert_non_null(html = test_slurp(d.html));
    assert_null(strstr(html, "random&rsquo;s</th>"));
    assert_null(strstr(html, "Against random eviction"));
    free(html);
    dirs_remove(&d);
}

/* A run with a row chosen in advance (--shipped) on the test split, random eviction over seeds
 * and FreeKV measured by what it reads: the headline compares the shipped row with the best
 * paper method and names the best row as picked after the fact; the random row shows its
 * seeds' range; FreeKV's row what it holds beside what it reads; a target it could not reach is
 * said under its card; a split that is none of the three is refused by name. */
static void test_preregistered_rows(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    cJSON *doc = load_sample();
    cJSON *runs = cJSON_GetObjectItem(doc, "runs"), *run, *rnd = NULL;
    cJSON_ArrayForEach(run, runs)
    {
        const char *id = cJSON_GetObjectItem(run, "id")->valuestring;
        cJSON_AddBoolToObject(run, "shipped", !strcmp(cJSON_GetObjectItem(run, "label")->valuestring,
                                                      "VL-Cache"));
        if (!strcmp(id, "streaming@0.40"))
            rnd = cJSON_Duplicate(run, 1);
        if (!strcmp(id, "freekv@0.40"))
            cJSON_AddNumberToObject(run, "held_retention", 1.45);
    }
    assert_non_null(rnd);
    cJSON_ReplaceItemInObject(rnd, "id", cJSON_CreateString("random@0.40"));
    cJSON_ReplaceItemInObject(rnd, "policy", cJSON_CreateString("random"));
    cJSON_ReplaceItemInObject(rnd, "label", cJSON_CreateString("random"));
    cJSON_ReplaceItemInObject(rnd, "shipped", cJSON_CreateFalse());
    cJSON *seeds = cJSON_AddObjectToObject(rnd, "seeds");
    cJSON_AddNumberToObject(seeds, "count", 3);
    const double kl[3] = {0.0412, 0.0633, 0.0500}, dnll[3] = {0.01, 0.02, 0.015};
    cJSON_AddItemToObject(seeds, "kl", cJSON_CreateDoubleArray(kl, 3));
    cJSON_AddItemToObject(seeds, "nll_delta", cJSON_CreateDoubleArray(dnll, 3));
    cJSON_AddItemToArray(runs, rnd);
    cJSON *setup = cJSON_GetObjectItem(doc, "setup");
    cJSON_AddStringToObject(setup, "split", "test");
    cJSON_AddStringToObject(setup, "shipped", "VL-Cache");
    cJSON *unreached = cJSON_AddArrayToObject(doc, "unreached"), *u = cJSON_CreateObject();
    cJSON_AddStringToObject(u, "policy", "freekv");
    cJSON_AddNumberToObject(u, "retention", 0.2);
    cJSON_AddNumberToObject(u, "floor", 0.3515625);
    cJSON_AddItemToArray(unreached, u);
    set_per_prompt(doc, "kvcapsule-dense@0.40", 0, 0.0005); /* the best paper method at 0.4 */
    set_per_prompt(doc, "vlcache@0.40", 0.01, 0.0005);      /* farther than it on every prompt */
    test_write_json(d.metrics, doc);
    if (kvcap_report_write(d.metrics, d.html, d.csv) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    char *html = test_slurp(d.html);
    assert_non_null(html);
    const char *summary = strstr(html, "<p class=\"summary\">");
    assert_non_null(summary);
    assert_non_null(strstr(summary, "on 24 test prompts"));
    assert_non_null(strstr(summary, "<strong>Test split: documents never looked at before"));
    assert_non_null(strstr(summary, "kvcap&rsquo;s shipped configuration, <strong>VL-Cache"
                                    "</strong>, was chosen on calibration and development data "
                                    "before this run"));
    assert_non_null(strstr(summary, "best row here, picked after the fact"));
    assert_non_null(strstr(summary, "the best paper method KVCapsule (dense) (80.2&nbsp;% task "
                                    "accuracy, KL"));
    assert_non_null(strstr(summary, "shipped minus it, KL"));
    assert_non_null(strstr(summary, "farther from full"));
    assert_null(strstr(summary, "Best when keeping")); /* no unlabelled post-hoc winner */
    assert_non_null(strstr(html, "<span class=\"ship-tag\""));
    const char *r40 = strstr(html, "title=\"random@0.40\">");
    assert_non_null(r40);
    assert_non_null(strstr(r40, "seeds 0.041&ndash;0.063</span>"));
    const char *f40 = strstr(html, "title=\"freekv@0.40\">");
    assert_non_null(f40);
    assert_true(strstr(f40, "read; holds 145&nbsp;%") < strstr(f40, "</tr>"));
    assert_non_null(strstr(html, "<b>freekv</b> has no row here: at its fewest pages it reads "
                                 "35&nbsp;% of the span per step"));
    free(html);
    /* a split that is none of the three */
    cJSON_ReplaceItemInObject(setup, "split", cJSON_CreateString("train"));
    test_write_json(d.metrics, doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, d.csv), KVCAP_ERR_FORMAT);
    assert_non_null(strstr(kvcap_last_error(), "setup.split: 'train' is not calibration, "
                                               "development or test"));
    cJSON_Delete(doc);
    dirs_remove(&d);
}

/* The paired interval: the mean difference and Student's t half-width (t(0.975, 2) = 4.303),
 * on sizes when asked; nothing to say about one prompt. */
static void test_paired_interval(void **state)
{
    (void)state;
    const double a[3] = {1, 2, 3}, b[3] = {0, 0, 0}, neg[3] = {-1, -2, -3};
    double m, h;
    kvcap_report_paired(a, b, 3, 0, &m, &h);
    assert_float_equal(m, 2.0, 1e-12);
    assert_float_equal(h, 4.303 / sqrt(3.0), 1e-9);
    kvcap_report_paired(neg, b, 3, 1, &m, &h); /* |x|: the same */
    assert_float_equal(m, 2.0, 1e-12);
    kvcap_report_paired(neg, b, 3, 0, &m, &h);
    assert_float_equal(m, -2.0, 1e-12);
    double big_a[100], big_b[100];
    for (int i = 0; i < 100; i++)
        big_a[i] = i % 2, big_b[i] = 0; /* mean 0.5, sd 0.5025 */
    kvcap_report_paired(big_a, big_b, 100, 0, &m, &h);
    assert_float_equal(h, 1.9842 * sqrt(0.25 * 100 / 99) / 10, 2e-4); /* t(0.975, 99) */
    kvcap_report_paired(a, b, 1, 0, &m, &h);
    assert_true(isnan(m) && isnan(h));
}

/* ---- Cost of hostile inputs ------------------------------------------------------------------ */

/* A metrics file within every bound whose mask panel is as large as they allow (4096 heads and
 * 2^20 tokens on 30 layers: 0.4 MB of JSON) renders in one pass over its cells: the drawing is
 * binned to the panel's pixels and 32 shades, so the page stays small. Drawn cell by cell and
 * shade by shade it took hours (heads x layers x tokens) and a page of gigabytes. */
static void test_bounded_rendering(void **state)
{
    (void)state;
    enum { LAYERS = 30, HEADS = 4096, TOKENS = 1 << 20 }; /* the sample's 30 layers */
    cJSON *doc = load_sample();
    cJSON_ReplaceItemInObject(cJSON_GetObjectItem(doc, "model"), "layers",
                              cJSON_CreateNumber(LAYERS));
    cJSON *mask = cJSON_CreateObject(), *kept = cJSON_CreateArray();
    cJSON_AddStringToObject(mask, "bucket", "1x1048576 dense");
    cJSON_AddNumberToObject(mask, "n_tokens", TOKENS);
    cJSON_AddNumberToObject(mask, "heads", HEADS);
    for (int l = 0; l < LAYERS; l++) {
        cJSON *layer = cJSON_CreateArray();
        for (int h = 0; h < HEADS; h++) {
            cJSON *head = cJSON_CreateArray();
            if (l % 8 == 0)
                cJSON_AddItemToArray(head, cJSON_CreateNumber((double)h * (TOKENS / HEADS)));
            cJSON_AddItemToArray(layer, head);
        }
        cJSON_AddItemToArray(kept, layer);
    }
    cJSON_AddItemToObject(mask, "kept", kept);
    cJSON *masks = cJSON_CreateArray();
    cJSON_AddItemToArray(masks, mask);
    cJSON_ReplaceItemInObject(doc, "masks", masks);
    struct dirs d;
    dirs_make(&d);
    char *text = cJSON_PrintUnformatted(doc);
    assert_non_null(text);
    write_text(d.metrics, text);
    cJSON_free(text);
    cJSON_Delete(doc);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_true(strlen(html) < 8u << 20);
    assert_non_null(strstr(html, "each cell: the mean over about 880 tokens &times; 1 layer"));
    free(html);
    dirs_remove(&d);
}

/* The sample with its masks replaced by `n` buckets on its 30 layers, each declaring `tokens`
 * tokens (on a `grid` x tokens/grid photo with a thumbnail when grid > 0) and keeping one
 * token per layer: a few hundred bytes of JSON each. Written to `path`; its size. */
static size_t write_many_masks(const char *path, int n, int tokens, int grid)
{
    cJSON *doc = load_sample();
    const int layers = cJSON_GetObjectItem(cJSON_GetObjectItem(doc, "model"), "layers")->valueint;
    cJSON *masks = cJSON_CreateArray();
    for (int i = 0; i < n; i++) {
        cJSON *mask = cJSON_CreateObject(), *kept = cJSON_CreateArray();
        char name[32];
        snprintf(name, sizeof name, "bucket %d", i);
        cJSON_AddStringToObject(mask, "bucket", name);
        cJSON_AddNumberToObject(mask, "n_tokens", tokens);
        cJSON_AddNumberToObject(mask, "heads", 1);
        if (grid) {
            cJSON_AddNumberToObject(mask, "rows", grid);
            cJSON_AddNumberToObject(mask, "cols", tokens / grid);
            cJSON_AddStringToObject(mask, "thumb", "data:image/bmp;base64,Qk0A");
        }
        for (int l = 0; l < layers; l++) {
            cJSON *layer = cJSON_CreateArray(), *head = cJSON_CreateArray();
            cJSON_AddItemToArray(head, cJSON_CreateNumber((l * 7919 + i) % tokens));
            cJSON_AddItemToArray(layer, head);
            cJSON_AddItemToArray(kept, layer);
        }
        cJSON_AddItemToObject(mask, "kept", kept);
        cJSON_AddItemToArray(masks, mask);
    }
    cJSON_ReplaceItemInObject(doc, "masks", masks);
    char *text = cJSON_PrintUnformatted(doc);
    assert_non_null(text);
    write_text(path, text);
    size_t len = strlen(text);
    cJSON_free(text);
    cJSON_Delete(doc);
    return len;
}

/* CPU seconds kvcap_report_write(metrics, html, NULL) takes; it must succeed. */
static double render_seconds(const char *metrics, const char *html)
{
    clock_t t0 = clock();
    if (kvcap_report_write(metrics, html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    return (double)(clock() - t0) / CLOCKS_PER_SEC;
}

/* 100 masks of 2^20 tokens that keep one token per layer (the 60 KB file): the work
 * follows what the file lists, not the layers x tokens it declares (that took ~10 s: 100 panels
 * of 30 x 2^20 cells), and the page draws the first 16 buckets and says so. Time is the only
 * measure of the work from outside, so the bound is relative and loose: 10 times the sample's
 * render (+ 50 ms for the clock), where drawing every declared cell took ~250 times it. */
static void test_many_masks(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    double sample = render_seconds(SAMPLE, d.html);
    size_t size = write_many_masks(d.metrics, 100, 1 << 20, 0);
    assert_true(size < 80u << 10);
    double many = render_seconds(d.metrics, d.html);
    if (many > 10 * sample + 0.05)
        fail_msg("100 masks of %zu bytes took %.3f s, the sample %.3f s", size, many, sample);
    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_int_equal(count(html, "<figure class=\"mask-panel\">"), 16);
    assert_non_null(strstr(html, "<strong>The first 16 of the 100 buckets are drawn</strong>: "
                                 "the masks of the other 84 (masks[16] on in the metrics file) "
                                 "were checked"));
    assert_non_null(strstr(html, "bucket 15 <span"));
    assert_null(strstr(html, "bucket 16 <span"));
    free(html);
    /* every mask is still validated, drawn or not */
    char *text = test_slurp(d.metrics);
    assert_non_null(text);
    cJSON *doc = cJSON_Parse(text);
    free(text);
    assert_non_null(doc);
    cJSON *last = cJSON_GetArrayItem(cJSON_GetObjectItem(doc, "masks"), 99);
    cJSON *token = cJSON_GetArrayItem(cJSON_GetArrayItem(cJSON_GetArrayItem(
                                          cJSON_GetObjectItem(last, "kept"), 29), 0), 0);
    cJSON_SetNumberValue(token, -1);
    test_write_json(d.metrics, doc);
    cJSON_Delete(doc);
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_ERR_FORMAT);
    assert_error_names(d.metrics, "masks[99].kept[29][0][0]: expected a token index in "
                                  "[0, 1048576), got -1");
    dirs_remove(&d);
}

/* A photo grid finer than 64 cells a side is drawn binned (each cell the mean over its tokens):
 * a mask on a 128 x 128 grid draws one panel of 64 x 64 cells, where one rectangle per token
 * made the page grow with the declared grid (2^20 tokens: 250 MB from a few hundred bytes).
 * One mask: the cap of 16 panels is test_many_masks's, and 16 binned panels take minutes in
 * the unoptimised sanitizer build. */
static void test_fine_photo_grid(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    write_many_masks(d.metrics, 1, 128 * 128, 128);
    if (kvcap_report_write(d.metrics, d.html, NULL) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    char *html = test_slurp(d.html);
    assert_non_null(html);
    assert_int_equal(count(html, "<figure class=\"mask-image\">"), 1);
    assert_int_equal(count(html, "fill=\"#0b1a33\""), 64 * 64);
    assert_non_null(strstr(html, "(clear: the most-kept cell, "));
    assert_non_null(strstr(html, " Each cell is the mean over about 2&thinsp;&times;&thinsp;2 "
                                 "tokens.</figcaption>"));
    assert_non_null(strstr(html, "<title>tokens in rows 126&ndash;127, columns 126&ndash;127: "
                                 "kept by "));
    free(html);
    dirs_remove(&d);
}

/* ---- Write failures ------------------------------------------------------------------------- */

/* A minimal metrics file at `path` whose second run is `id`. */
static void write_minimal(const char *path, const char *id)
{
    char text[1024];
    snprintf(text, sizeof text,
             "{\"format\": 1, \"title\": \"pair\", \"runs\": ["
             "{\"id\": \"full\", \"policy\": \"full\", \"label\": \"Full\", "
             "\"extension\": false, \"retention\": 1, \"nominal\": 1, "
             "\"realised_retention\": 1, \"kl\": 0},"
             "{\"id\": \"%s\", \"policy\": \"streaming\", \"label\": \"Streaming\", "
             "\"extension\": false, \"retention\": 0.5, \"nominal\": 0.5, "
             "\"realised_retention\": 0.5, \"kl\": 0.1}]}",
             id);
    write_text(path, text);
}

/* Which of the two runs' outputs `path` holds: 'a', 'b', or '?' (neither or unreadable). */
static char written_by(const char *path)
{
    char *text = test_slurp(path);
    char who = !text ? '?' : strstr(text, "pair-a") ? 'a' : strstr(text, "pair-b") ? 'b' : '?';
    free(text);
    return who;
}

/* The cleanup the tools install (cli.c): temporaries removed, then the default action. */
static void remove_temps_and_die(int sig)
{
    kvcap_temp_remove_all();
    raise(sig);
}

/* A termination signal at any moment of a run leaves the HTML and the CSV from the same run and
 * no temporary file: a child rewrites the pair from two metrics files in turn until SIGTERM
 * comes, at times spread over a few runs. Whether a signal falls between the two renames is
 * luck (on a disk whose directory fsync takes a while, about one in several tries when nothing
 * blocks it); blocked there, no try can part the pair. The caller's signal mask comes back as it
 * was. */
static void test_signal_keeps_outputs_paired(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    char a[600], b[600];
    snprintf(a, sizeof a, "%s/a.json", d.in);
    snprintf(b, sizeof b, "%s/b.json", d.in);
    write_minimal(a, "pair-a");
    write_minimal(b, "pair-b");

    sigset_t before, after, term;
    sigemptyset(&term);
    sigaddset(&term, SIGINT);
    assert_int_equal(sigprocmask(SIG_BLOCK, &term, &before), 0);
    assert_int_equal(kvcap_report_write(a, d.html, d.csv), KVCAP_OK);
    assert_int_equal(sigprocmask(SIG_SETMASK, &before, &after), 0);
    assert_true(sigismember(&after, SIGINT)); /* still blocked, as the caller left it */
    assert_int_equal(sigismember(&after, SIGTERM), sigismember(&before, SIGTERM));
    assert_int_equal(kvcap_report_write(a, d.html, d.csv), KVCAP_OK);
    assert_int_equal(sigprocmask(SIG_SETMASK, NULL, &after), 0);
    assert_int_equal(sigismember(&after, SIGINT), sigismember(&before, SIGINT));
    assert_int_equal(sigismember(&after, SIGTERM), sigismember(&before, SIGTERM));

    enum { TRIES = 40 };
    /* one run's time, to spread the signals over a few of them */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(kvcap_report_write(i % 2 ? b : a, d.html, d.csv), KVCAP_OK);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    long run_us = ((t1.tv_sec - t0.tv_sec) * 1000000L + (t1.tv_nsec - t0.tv_nsec) / 1000) / 4;
    int parted = 0;
    for (int k = 0; k < TRIES; k++) {
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            struct sigaction sa;
            memset(&sa, 0, sizeof sa);
            sa.sa_handler = remove_temps_and_die;
            sa.sa_flags = SA_RESETHAND;
            sigemptyset(&sa.sa_mask);
            sigaction(SIGTERM, &sa, NULL);
            for (int i = 0;; i++)
                if (kvcap_report_write(i % 2 ? b : a, d.html, d.csv) != KVCAP_OK)
                    _exit(3);
        }
        usleep((useconds_t)(run_us / 2 + (long)(k * 7919 % 97) * run_us * 3 / 97));
        assert_int_equal(kill(pid, SIGTERM), 0);
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM);
        char html = written_by(d.html), csv = written_by(d.csv);
        assert_true(html != '?' && csv != '?');
        parted += html != csv;
        assert_int_equal(dir_entries(d.out), 2);
    }
    if (parted)
        fail_msg("%d of %d signals left the HTML of one run beside the CSV of the other", parted,
                 TRIES);
    dirs_remove(&d);
}

static void test_unwritable_output(void **state)
{
    (void)state;
    struct dirs d;
    dirs_make(&d);
    char path[700], sub[700];

    /* A folder that does not exist. */
    snprintf(path, sizeof path, "%s/missing/report.html", d.out);
    assert_int_equal(kvcap_report_write(SAMPLE, path, NULL), KVCAP_ERR_IO);
    assert_error_names(path, "temporary file");
    assert_int_equal(dir_entries(d.out), 0);

    /* Outputs that belong together: the HTML cannot be written, so the CSV is not either. */
    assert_int_equal(kvcap_report_write(SAMPLE, path, d.csv), KVCAP_ERR_IO);
    assert_error_names(path, "temporary file");
    assert_int_equal(dir_entries(d.out), 0);

    /* A folder (or device, FIFO) is never replaced: refused before a temporary file exists. */
    snprintf(sub, sizeof sub, "%s/report.html", d.out);
    assert_int_equal(mkdir(sub, 0755), 0);
    assert_int_equal(kvcap_report_write(SAMPLE, sub, NULL), KVCAP_ERR_INVALID_ARGUMENT);
    assert_error_names(sub, "not a regular file");
    assert_int_equal(dir_entries(d.out), 1);
    assert_int_equal(rmdir(sub), 0);

    /* An earlier report stays as it was when the run fails. */
    write_text(d.html, "old report");
    snprintf(path, sizeof path, "%s/missing/metrics.csv", d.out);
    assert_int_equal(kvcap_report_write(SAMPLE, d.html, path), KVCAP_ERR_IO);
    char *old = test_slurp(d.html);
    assert_non_null(old);
    assert_string_equal(old, "old report");
    free(old);
    assert_int_equal(dir_entries(d.out), 1);
    assert_int_equal(unlink(d.html), 0);

    /* A folder nobody may create files in: a read-only one, or for root (who writes there
     * anyway) /proc. */
    if (geteuid() != 0) {
        assert_int_equal(chmod(d.out, 0555), 0);
        assert_int_equal(kvcap_report_write(SAMPLE, d.html, d.csv), KVCAP_ERR_IO);
        assert_error_names(d.csv, "temporary file");
        assert_int_equal(chmod(d.out, 0755), 0);
        assert_int_equal(dir_entries(d.out), 0);
    } else if (access("/proc/self", F_OK) == 0) {
        assert_int_equal(kvcap_report_write(SAMPLE, "/proc/kvcap-report-test.html", NULL),
                         KVCAP_ERR_IO);
        assert_error_names("/proc/kvcap-report-test.html", "temporary file");
    }
    dirs_remove(&d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sample_renders),
        cmocka_unit_test(test_minimal_metrics),
        cmocka_unit_test(test_agreement_fallback_and_samples),
        cmocka_unit_test(test_ranking_order),
        cmocka_unit_test(test_html_escaping),     cmocka_unit_test(test_several_images),
        cmocka_unit_test(test_malformed_inputs),
        cmocka_unit_test(test_missing_input),     cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_unwritable_output),
        cmocka_unit_test(test_signal_keeps_outputs_paired),
        cmocka_unit_test(test_bounded_rendering),
        cmocka_unit_test(test_many_masks),
        cmocka_unit_test(test_fine_photo_grid),
        cmocka_unit_test(test_tracks_side_by_side),
        cmocka_unit_test(test_calibration_split),
        cmocka_unit_test(test_outside_reference),
        cmocka_unit_test(test_outside_accepted),
        cmocka_unit_test(test_outside_refused_track),
        cmocka_unit_test(test_outside_refused_hash),
        cmocka_unit_test(test_outside_refused_retention),
        cmocka_unit_test(test_outside_refused_nll),
        cmocka_unit_test(test_outside_refused_older_file),
        cmocka_unit_test(test_paired_interval),
        cmocka_unit_test(test_versus_random),
        cmocka_unit_test(test_preregistered_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
