/* test_task.c — kvcap-eval's retrieval task and RULER's variants of it (--task-keys,
 * --task-values): how an answer is read and scored (one value: exact match; several: every true
 * code among the answer's runs of digits, in any order), kvcap-report reading the variant
 * (strictly) and naming it where the task accuracy is described, and on the real model
 * (skipped, exit 77, without SmolLM2-135M): the prompts task_build lays out, full's answers
 * scored by the multi-value rule, and `kvcap-eval run --task-keys 4 --task-values 2` end to end. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "cli/cli.h"
#include "common/internal.h"
#include "eval/eval.h"
#include "report/report.h"
#include "tests/test_json.h"
#include "tests/test_util.h"

#define SAMPLE KVCAP_TEST_DATA "/eval/metrics-sample.json"

/* ---- Helpers ------------------------------------------------------------------------------- */

/* Member `key` of obj, which must be there. */
static const cJSON *item(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v)
        fail_msg("metrics.json: no %s", key);
    return v;
}

/* Whether `needle` is in the text between `from` and the next `to` after it. */
static int between(const char *text, const char *from, const char *to, const char *needle)
{
    const char *a = strstr(text, from);
    if (!a)
        return 0;
    const char *b = strstr(a, to), *n = strstr(a, needle);
    return n && (!b || n < b);
}

/* The test's own reading of a multi-value answer, written apart from task.c's: right when every
 * true code is a whole run of digits of the text. */
static int holds_every_code(const char *text, const char (*truth)[8], int values)
{
    for (int v = 0; v < values; v++) {
        int found = 0;
        for (const char *p = text; *p;) {
            size_t l = strspn(p, "0123456789");
            if (l == 0) {
                p++;
                continue;
            }
            found |= l == strlen(truth[v]) && !strncmp(p, truth[v], l);
            p += l;
        }
        if (!found)
            return 0;
    }
    return 1;
}

/* ---- Reading and scoring an answer ----------------------------------------------------------- */

static void parse(const char *text, int values, char *out)
{
    task_parse_answer(text, values, out, TASK_ANSWER_CHARS);
}

static void test_one_value_exact(void **state)
{
    (void)state;
    const char truth[1][8] = {"4821"};
    char a[TASK_ANSWER_CHARS];
    parse(" 4821.<|im_end|>", 1, a);
    assert_string_equal(a, "4821");
    assert_true(task_answer_correct(a, truth, 1));
    parse(" 4821 and 1234", 1, a); /* the first run only */
    assert_string_equal(a, "4821");
    parse(" code 4821", 1, a); /* digits must come first */
    assert_string_equal(a, "");
    assert_false(task_answer_correct(a, truth, 1));
    parse(" 48210", 1, a);
    assert_false(task_answer_correct(a, truth, 1));
}

static void test_values_order_free(void **state)
{
    (void)state;
    const char two[2][8] = {"4821", "1234"}, swapped[2][8] = {"1234", "4821"};
    char a[TASK_ANSWER_CHARS];
    parse(" 4821 and 1234.<|im_end|>", 2, a);
    assert_string_equal(a, "1234 4821"); /* every run, sorted: agreement is order free too */
    assert_true(task_answer_correct(a, two, 2));
    assert_true(task_answer_correct(a, swapped, 2));
    char b[TASK_ANSWER_CHARS];
    parse(" 1234, 4821", 2, b);
    assert_string_equal(a, b);
    parse(" 1234, 9999 and 4821.", 2, a); /* other runs besides do not hurt */
    assert_true(task_answer_correct(a, two, 2));
    const char four[4][8] = {"1000", "2000", "3000", "4000"};
    parse(" 4000, 3000, 2000 and 1000.", 4, a);
    assert_true(task_answer_correct(a, four, 4));
}

static void test_values_one_missing(void **state)
{
    (void)state;
    const char two[2][8] = {"4821", "1234"};
    char a[TASK_ANSWER_CHARS];
    parse(" 4821 and 1235.", 2, a);
    assert_false(task_answer_correct(a, two, 2));
    parse(" 4821.<|im_end|>", 2, a); /* one of two */
    assert_false(task_answer_correct(a, two, 2));
    parse(" 4821 and 4821", 2, a); /* the same one twice */
    assert_false(task_answer_correct(a, two, 2));
    parse(" 48211234", 2, a); /* both inside one run: not a code */
    assert_false(task_answer_correct(a, two, 2));
    parse(" 14821 and 1234", 2, a);
    assert_false(task_answer_correct(a, two, 2));
    parse("", 2, a);
    assert_string_equal(a, "");
    assert_false(task_answer_correct(a, two, 2));
    const char four[4][8] = {"1000", "2000", "3000", "4000"};
    parse(" 1000, 2000, 3000.", 4, a);
    assert_false(task_answer_correct(a, four, 4));
}

/* ---- kvcap-report reads the variant --------------------------------------------------------- */

struct report_dirs {
    char in[512], out[512], metrics[600], html[600];
};

static void report_dirs_make(struct report_dirs *d)
{
    assert_true(test_tmpdir(d->in, sizeof d->in, "task-in"));
    assert_true(test_tmpdir(d->out, sizeof d->out, "task-out"));
    snprintf(d->metrics, sizeof d->metrics, "%s/metrics.json", d->in);
    snprintf(d->html, sizeof d->html, "%s/report.html", d->out);
}

static void report_dirs_remove(struct report_dirs *d)
{
    test_rm_tree(d->in);
    test_rm_tree(d->out);
}

/* The sample with task.keys and task.values set (NULL: left out). */
static void write_sample(const char *path, cJSON *keys, cJSON *values)
{
    cJSON *doc = test_load_json(SAMPLE);
    cJSON *task = cJSON_GetObjectItem(doc, "task");
    assert_non_null(task);
    cJSON_DeleteItemFromObject(task, "keys");
    cJSON_DeleteItemFromObject(task, "values");
    if (keys)
        cJSON_AddItemToObject(task, "keys", keys);
    if (values)
        cJSON_AddItemToObject(task, "values", values);
    test_write_json(path, doc);
    cJSON_Delete(doc);
}

static void test_report_shows_variant(void **state)
{
    (void)state;
    struct report_dirs d;
    report_dirs_make(&d);
    write_sample(d.metrics, cJSON_CreateNumber(4), cJSON_CreateNumber(2));
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_OK);
    char *html = test_slurp(d.html);
    assert_non_null(html);
    const char *phrase = "retrieval: 4 keys, 2 values per query";
    /* where the task accuracy is described: the summary, the ranking, the table, the setup */
    assert_true(between(html, "<header", "</header>", phrase));
    assert_true(between(html, "Which policy wins at each memory budget", "</section>", phrase));
    assert_true(between(html, "Ranked by task accuracy", "</p>", "holding every true value"));
    assert_true(between(html, "<h2>Headline results</h2>", "</section>",
                        "Task accuracy (retrieval: 4 keys, 2 values per query) is coloured"));
    assert_true(between(html, "<dt>Task</dt>", "</dd>", phrase));
    assert_true(between(html, "<dt>Task</dt>", "</dd>", "right when it holds every code"));
    free(html);

    /* One key, several values, and the plain task (the fields absent, as in files written
     * before the variants, or both 1): no phrase, the exact match said. */
    write_sample(d.metrics, cJSON_CreateNumber(1), cJSON_CreateNumber(3));
    assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_OK);
    html = test_slurp(d.html);
    assert_non_null(strstr(html, "retrieval: 1 key, 3 values per query"));
    free(html);
    for (int k = 0; k < 2; k++) {
        write_sample(d.metrics, k ? cJSON_CreateNumber(1) : NULL,
                     k ? cJSON_CreateNumber(1) : NULL);
        assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_OK);
        html = test_slurp(d.html);
        assert_null(strstr(html, "per query"));
        assert_null(strstr(html, "RULER"));
        assert_true(between(html, "<dt>Task</dt>", "</dd>", "exact-matched"));
        free(html);
    }
    report_dirs_remove(&d);
}

/* A wrong type or value fails, naming the field, and writes nothing. */
static void test_report_rejects_bad_variant(void **state)
{
    (void)state;
    struct report_dirs d;
    report_dirs_make(&d);
    const struct {
        const char *field;
        cJSON *keys, *values;
    } bad[] = {
        {"task.keys", cJSON_CreateString("4"), cJSON_CreateNumber(2)},
        {"task.keys", cJSON_CreateNumber(0), NULL},
        {"task.keys", cJSON_CreateNumber(2.5), NULL},
        {"task.values", cJSON_CreateNumber(4), cJSON_CreateBool(1)},
        {"task.values", NULL, cJSON_CreateNumber(-1)},
        {"task.values", NULL, cJSON_CreateArray()},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        write_sample(d.metrics, bad[i].keys, bad[i].values);
        assert_int_equal(kvcap_report_write(d.metrics, d.html, NULL), KVCAP_ERR_FORMAT);
        const char *msg = kvcap_last_error();
        if (!strstr(msg, d.metrics) || !strstr(msg, bad[i].field))
            fail_msg("case %zu: error names not %s: %s", i, bad[i].field, msg);
        FILE *f = fopen(d.html, "rb");
        assert_null(f);
    }
    report_dirs_remove(&d);
}

/* ---- On the real model ---------------------------------------------------------------------- */

static char g_model[4096];

static int model_present(void)
{
    const char *env = getenv("KVCAP_SMOLLM2_GGUF"), *home = getenv("HOME");
    if (env && *env)
        snprintf(g_model, sizeof g_model, "%s", env);
    else
        snprintf(g_model, sizeof g_model,
                 "%s/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf", home ? home : ".");
    FILE *f = fopen(g_model, "rb");
    if (f)
        fclose(f);
    return f != NULL;
}

/* kvcap-eval run's options for the task (parse_options: the defaults the tool has). */
static void task_options(struct options *o, const char *keys, const char *values,
                         const char *span, const char *queries)
{
    char *argv[] = {"kvcap-eval", "run", "--out", "unused", "-q", "--threads", "1",
                    "--model", g_model, "--task-keys", (char *)keys, "--task-values",
                    (char *)values, "--span", (char *)span, "--task-queries", (char *)queries,
                    NULL};
    assert_int_equal(parse_options((int)(sizeof argv / sizeof *argv) - 1, argv, o), 0);
}

struct model_fixture {
    struct model_ctx mc;
    struct corpus corpus;
};

static int model_setup(void **state)
{
    static struct model_fixture fx;
    if (model_open(g_model, &fx.mc, 1) != KVCAP_OK)
        return -1;
    /* chunks longer than any span below: held-out text, as kvcap-eval run's */
    if (corpus_load(fx.mc.tok, "/usr/share/common-licenses", "Apache-2.0", 600, &fx.corpus) !=
            KVCAP_OK ||
        fx.corpus.n_chunks < 1)
        return -1;
    *state = &fx;
    return 0;
}

static int model_teardown(void **state)
{
    struct model_fixture *fx = *state;
    if (fx) {
        corpus_free(&fx->corpus);
        model_close(&fx->mc);
    }
    return 0;
}

/* One needle line found in a span's text. */
struct needle {
    char name[16], code[8];
    size_t at; /* its offset in the text */
};

/* Every "The code of the NAME is DDDD." of the text, at most cap. */
static int find_needles(const char *text, struct needle *out, int cap)
{
    int n = 0;
    const char *lead = "The code of the ";
    for (const char *p = strstr(text, lead); p && n < cap; p = strstr(p + 1, lead)) {
        struct needle *e = &out[n];
        if (sscanf(p + strlen(lead), "%15[a-z] is %4[0-9].", e->name, e->code) == 2) {
            e->at = (size_t)(p - text);
            n++;
        }
    }
    return n;
}

/* Query i's span and tail as text. */
static void query_text(const struct model_ctx *mc, const struct task *t, int i, char *span,
                       size_t span_cap, char *tail, size_t tail_cap)
{
    const struct prompt *p = &t->prompts[i];
    generated_text(mc, p->ids + p->lay.head, p->lay.span, span, span_cap);
    generated_text(mc, p->ids + p->lay.head + p->lay.span, p->lay.tail, tail, tail_cap);
}

/* task_build lays out the variant: four names, the asked one twice with two codes, the first
 * of them at the query's depth; the question asks for both. */
static void test_build_variant(void **state)
{
    struct model_fixture *fx = *state;
    struct options o;
    task_options(&o, "4", "2", "256", "8");
    struct task t;
    assert_int_equal(task_build(&o, &fx->mc, &fx->corpus, &t), KVCAP_OK);
    assert_int_equal(t.keys, 4);
    assert_int_equal(t.values, 2);
    assert_int_equal(t.answer_tokens, 2 * TASK_ANSWER_TOKENS);
    for (int i = 0; i < t.n; i++) {
        char span[8192], tail[512], asked[16] = "", want[128];
        query_text(&fx->mc, &t, i, span, sizeof span, tail, sizeof tail);
        assert_int_equal(t.prompts[i].lay.span, 256);
        assert_int_equal(sscanf(tail, "\nWhat are the codes of the %15[a-z]?", asked), 1);
        snprintf(want, sizeof want, "<|im_start|>assistant\nThe codes of the %s are", asked);
        assert_non_null(strstr(tail, want));
        assert_string_equal(tail + strlen(tail) - strlen(want), want);
        struct needle nd[32];
        const int n = find_needles(span, nd, 32);
        assert_int_equal(n, 4 + 2 - 1);
        int mine = 0, seen_truth[2] = {0, 0};
        for (int k = 0; k < n; k++) {
            for (int j = 0; j < k; j++) /* the others: distinct names, each once */
                if (strcmp(nd[k].name, asked) != 0)
                    assert_string_not_equal(nd[k].name, nd[j].name);
            if (strcmp(nd[k].name, asked) != 0)
                continue;
            mine++;
            for (int v = 0; v < 2; v++)
                seen_truth[v] += !strcmp(nd[k].code, t.truth[i][v]);
        }
        assert_int_equal(mine, 2);
        assert_int_equal(seen_truth[0], 1);
        assert_int_equal(seen_truth[1], 1);
        assert_string_not_equal(t.truth[i][0], t.truth[i][1]);
        /* the first code's line starts at the query's depth, in its bin */
        char at_depth[512];
        const int tok = (int)lround(t.depth[i] * 256);
        generated_text(&fx->mc, t.prompts[i].ids + t.prompts[i].lay.head + tok, 16, at_depth,
                       sizeof at_depth);
        snprintf(want, sizeof want, "\nThe code of the %s is %s.", asked, t.truth[i][0]);
        assert_memory_equal(at_depth, want, strlen(want));
        assert_int_equal(t.bin[i], i % TASK_DEPTHS);
        assert_true(t.depth[i] >= (double)t.bin[i] / TASK_DEPTHS - 0.05 &&
                    t.depth[i] <= (double)(t.bin[i] + 1) / TASK_DEPTHS);
    }
    task_free(&t);

    /* The plain task: one line, today's question and answer length. */
    task_options(&o, "1", "1", "256", "2");
    assert_int_equal(task_build(&o, &fx->mc, &fx->corpus, &t), KVCAP_OK);
    assert_int_equal(t.answer_tokens, TASK_ANSWER_TOKENS);
    for (int i = 0; i < t.n; i++) {
        char span[8192], tail[512], asked[16] = "", want[128];
        query_text(&fx->mc, &t, i, span, sizeof span, tail, sizeof tail);
        assert_int_equal(sscanf(tail, "\nWhat is the code of the %15[a-z]?", asked), 1);
        snprintf(want, sizeof want, "<|im_start|>assistant\nThe code of the %s is", asked);
        assert_string_equal(tail + strlen(tail) - strlen(want), want);
        struct needle nd[4];
        assert_int_equal(find_needles(span, nd, 4), 1);
        assert_string_equal(nd[0].name, asked);
        assert_string_equal(nd[0].code, t.truth[i][0]);
    }
    task_free(&t);
}

/* A span too short for every needle line is refused, naming --span. */
static void test_build_span_too_short(void **state)
{
    struct model_fixture *fx = *state;
    struct options o;
    struct task t;
    task_options(&o, "16", "4", "256", "1");
    assert_int_equal(task_build(&o, &fx->mc, &fx->corpus, &t), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "--span 256"));
    task_free(&t);
    task_options(&o, "4", "4", "128", "1"); /* fits one line, not seven */
    assert_int_equal(task_build(&o, &fx->mc, &fx->corpus, &t), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "--span 128"));
    task_free(&t);
    task_options(&o, "16", "4", "600", "1"); /* every line, apart */
    assert_int_equal(task_build(&o, &fx->mc, &fx->corpus, &t), KVCAP_OK);
    char span[16384], tail[512];
    struct needle nd[32];
    query_text(&fx->mc, &t, 0, span, sizeof span, tail, sizeof tail);
    assert_int_equal(find_needles(span, nd, 32), 16 + 4 - 1);
    task_free(&t);
}

/* Full answers the variant; task_run scores its answers by the multi-value rule: its accuracy
 * is the share of answers that hold both codes, read here apart from task.c. */
static void test_full_scored_by_values(void **state)
{
    struct model_fixture *fx = *state;
    struct options o;
    task_options(&o, "4", "2", "256", "8");
    struct task t;
    assert_int_equal(task_build(&o, &fx->mc, &fx->corpus, &t), KVCAP_OK);
    struct run full = {.policy = "full", .retention = 1.0, .nominal = 1.0};
    snprintf(full.id, sizeof full.id, "full");
    snprintf(full.yaml, sizeof full.yaml, "%s", k_full_yaml);
    assert_int_equal(task_run(&o, &fx->mc, &full, 1, &t), KVCAP_OK);
    int right = 0;
    for (int i = 0; i < t.n; i++) {
        char text[256];
        generated_text(&fx->mc, full.answers + (size_t)i * t.answer_tokens, t.answer_tokens,
                       text, sizeof text);
        const int ok = holds_every_code(text, t.truth[i], 2);
        right += ok;
        printf("query %d: truth %s %s, full answered \"%s\" -> %s\n", i, t.truth[i][0],
               t.truth[i][1], text, ok ? "right" : "wrong");
    }
    /* the check must be able to tell: full gets some right (the rule scores them right) */
    assert_true(right > 0);
    assert_int_equal((int)full.task_correct, right);
    assert_int_equal((int)full.task_same, t.n);
    free(full.answers), free(full.task_correct_depth);
    task_free(&t);
}

/* `kvcap-eval run --task-keys 4 --task-values 2` end to end: metrics.json records the variant,
 * the report names it; the options are range-checked by name. 8 queries, one per depth bin: a
 * bin without a query is written as null in task.depths, which kvcap-report refuses. */
static void test_cli_variant(void **state)
{
    (void)state;
    char dir[512], cmd[8192], path[700];
    assert_true(test_tmpdir(dir, sizeof dir, "task-cli"));
    const char *bad[][3] = {{"--task-keys", "0", "--task-keys"},
                            {"--task-keys", "17", "--task-keys"},
                            {"--task-values", "5", "--task-values"},
                            {"--task-values", "x", "--task-values"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        /* a missing model: were the value taken, the run would stop there (exit 1) */
        snprintf(cmd, sizeof cmd, "'%s' run --out '%s/x' --model '%s/none.gguf' %s %s "
                 ">'%s/bad.out' 2>&1", KVCAP_EVAL_BIN, dir, dir, bad[i][0], bad[i][1], dir);
        int rc = system(cmd);
        assert_true(WIFEXITED(rc));
        assert_int_equal(WEXITSTATUS(rc), 2);
        snprintf(path, sizeof path, "%s/bad.out", dir);
        char *out = test_slurp(path);
        assert_non_null(strstr(out, bad[i][2]));
        free(out);
    }
    snprintf(cmd, sizeof cmd, "'%s' --help | grep -q -- '--task-values N'", KVCAP_EVAL_BIN);
    assert_int_equal(system(cmd), 0);

    snprintf(cmd, sizeof cmd,
             "'%s' run -q --model '%s' --corpus /usr/share/common-licenses --docs Apache-2.0 "
             "--prompts 1 --continuation 8 --generate 4 --fidelity-steps 2 --task-queries 8 "
             "--retentions 0.4 --rows headline --random-seeds 1 --span 256 --threads 1 "
             "--task-keys 4 --task-values 2 --out '%s/run' >'%s/run.out' 2>&1",
             KVCAP_EVAL_BIN, g_model, dir, dir);
    int rc = system(cmd);
    if (!WIFEXITED(rc) || WEXITSTATUS(rc) != 0) {
        snprintf(path, sizeof path, "%s/run.out", dir);
        char *out = test_slurp(path);
        fail_msg("kvcap-eval run failed (%d): %s", rc, out ? out : "");
    }
    snprintf(path, sizeof path, "%s/run/metrics.json", dir);
    cJSON *m = test_load_json(path);
    const cJSON *task = item(m, "task");
    assert_int_equal(item(task, "keys")->valueint, 4);
    assert_int_equal(item(task, "values")->valueint, 2);
    assert_int_equal(item(task, "answer_tokens")->valueint, 2 * TASK_ANSWER_TOKENS);
    assert_int_equal(item(task, "queries")->valueint, 8);
    assert_non_null(strstr(item(task, "question")->valuestring, "What are the codes of the"));
    const cJSON *run = cJSON_GetArrayItem(item(m, "runs"), 0);
    assert_non_null(run);
    assert_string_equal(item(run, "id")->valuestring, "full");
    const cJSON *rt = item(run, "task");
    assert_true(item(rt, "agreement_full")->valuedouble == 1.0);
    const double acc = item(rt, "accuracy")->valuedouble;
    assert_true(acc >= 0 && acc <= 1);
    int ruler_note = 0;
    const cJSON *note;
    cJSON_ArrayForEach(note, item(m, "notes"))
        ruler_note += strstr(note->valuestring, "RULER") != NULL;
    assert_int_equal(ruler_note, 1);
    cJSON_Delete(m);
    snprintf(path, sizeof path, "%s/run/report.html", dir);
    char *html = test_slurp(path);
    assert_non_null(html);
    assert_non_null(strstr(html, "retrieval: 4 keys, 2 values per query"));
    free(html);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    cli_init("test_task", 0);
    const struct CMUnitTest pure[] = {
        cmocka_unit_test(test_one_value_exact),
        cmocka_unit_test(test_values_order_free),
        cmocka_unit_test(test_values_one_missing),
        cmocka_unit_test(test_report_shows_variant),
        cmocka_unit_test(test_report_rejects_bad_variant),
    };
    int failed = cmocka_run_group_tests_name("task: scoring and report", pure, NULL, NULL);
    if (!model_present()) {
        printf("SKIP: the real-model checks (%s not found; bash scripts/fetch-model.sh gets "
               "it)\n", g_model);
        return failed ? 1 : 77;
    }
    const struct CMUnitTest model[] = {
        cmocka_unit_test(test_build_variant),
        cmocka_unit_test(test_build_span_too_short),
        cmocka_unit_test(test_full_scored_by_values),
        cmocka_unit_test(test_cli_variant),
    };
    failed += cmocka_run_group_tests_name("task: on SmolLM2-135M", model, model_setup,
                                          model_teardown);
    return failed ? 1 : 0;
}
