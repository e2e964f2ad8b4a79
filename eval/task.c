/* task.c — the retrieval task: a key-value line inside the span, asked for in the tail. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/internal.h"
#include "common/rng.h"
#include "engine/tokenizer.h"
#include "eval/eval.h"

/* ---- The retrieval task ------------------------------------------------------------------- */
/* Key-value retrieval inside the compressed span: the span holds lines "The code of the <name>
 * is <4 digits>." with distinct names; the tail asks for one of them and the answer is read
 * from a few greedy tokens. The asked line sits at one of TASK_DEPTHS depths of the span.
 * Scored by exact match against the true code and against full's answer; greedy answers of a
 * few tokens do not cascade the way a long continuation does. RULER's variants (arXiv
 * 2404.06654): multi-key, --task-keys names in the span, one asked; multi-value, the asked
 * name has --task-values lines with different codes, all asked for at once, the answer right
 * when it holds every one of them. */
static const char *const k_task_names[] = {
    "tiger",  "apple",  "river", "candle", "pencil", "garden", "rocket", "violin", "forest",
    "castle", "mirror", "dragon", "island", "winter", "silver", "hammer", "pillow", "basket",
    "bridge", "monkey", "orange", "planet", "rabbit", "saddle", "tomato", "wallet", "anchor",
    "bottle", "carpet", "donkey", "engine", "falcon", "ginger", "helmet", "jacket", "kettle",
    "ladder", "magnet", "needle", "parrot"};
enum { TASK_NAMES = sizeof k_task_names / sizeof *k_task_names,
       TASK_LINES_MAX = TASK_KEYS_MAX + TASK_VALUES_MAX - 1 };
_Static_assert((int)TASK_KEYS_MAX <= (int)TASK_NAMES, "--task-keys needs as many names");

void task_free(struct task *t)
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

/* Whether a line of len tokens starting at p overlaps none of the n lines at at[], len_at[]. */
static int task_fits(int p, int len, const int *at, const size_t *len_at, int n)
{
    for (int j = 0; j < n; j++)
        if (p + len > at[j] && at[j] + (int)len_at[j] > p)
            return 0;
    return 1;
}

/* Where a line of len tokens goes inside the span: uniformly among the starts where it
 * overlaps none of the n lines placed (what drawing until one fits would give, without the
 * chance of drawing forever); -1 where none is left. */
static int task_place(struct kvcap_rng *rng, int span, int len, const int *at,
                      const size_t *len_at, int n)
{
    uint64_t starts = 0;
    for (int p = 0; p + len <= span; p++)
        starts += (uint64_t)task_fits(p, len, at, len_at, n);
    if (starts == 0)
        return -1;
    uint64_t pick = kvcap_rng_below(rng, starts);
    for (int p = 0;; p++)
        if (task_fits(p, len, at, len_at, n) && pick-- == 0)
            return p;
}

/* Builds query i: the head, then exactly `span` tokens of held-out text (`filler`, at least
 * span tokens) with the needle lines inside, then the question as the tail. The lines: the
 * asked name's t->values lines, the first at depth bin i % TASK_DEPTHS, and one line for each
 * of the t->keys - 1 other names; all but the first where they overlap no other line. */
static enum kvcap_status task_build_one(const struct options *o, const struct model_ctx *mc,
                                        const int32_t *filler, struct task *t, int i, int *head,
                                        int *tail)
{
    struct kvcap_rng rng;
    kvcap_rng_seed(&rng, 0x6b76636170ull + (uint64_t)i);
    const int n_lines = t->keys + t->values - 1;
    int name[TASK_KEYS_MAX];
    for (int k = 0; k < t->keys; k++) {
        int fresh;
        do {
            name[k] = (int)kvcap_rng_below(&rng, TASK_NAMES);
            fresh = 1;
            for (int j = 0; j < k; j++)
                fresh &= name[j] != name[k];
        } while (!fresh);
    }
    int32_t *line[TASK_LINES_MAX] = {0};
    size_t len[TASK_LINES_MAX] = {0};
    int code[TASK_LINES_MAX], at[TASK_LINES_MAX], total = 0;
    enum kvcap_status s = KVCAP_OK;
    for (int k = 0; s == KVCAP_OK && k < n_lines; k++) {
        /* lines 0 .. values - 1 are the asked name's (name[0]), each with its own code */
        const int who = k < t->values ? 0 : k - t->values + 1;
        int fresh;
        do {
            code[k] = 1000 + (int)kvcap_rng_below(&rng, 9000);
            fresh = 1;
            for (int j = 0; j < k && k < t->values; j++)
                fresh &= code[j] != code[k];
        } while (!fresh);
        char text[96];
        snprintf(text, sizeof text, "\nThe code of the %s is %04d.\n", k_task_names[name[who]],
                 code[k]);
        s = kvtok_encode(mc->tok, text, strlen(text), 0, &line[k], &len[k]);
        total += (int)len[k];
    }
    if (s == KVCAP_OK && total * 2 > o->span)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "--span %d: too short for the retrieval task "
                       "(%d needle tokens in %d lines)", o->span, total, n_lines);
    /* Line 0 is asked: its start at the bin's depth; the others where they do not overlap,
     * each uniformly among the starts still free. */
    t->bin[i] = i % TASK_DEPTHS;
    at[0] = (int)lround((t->bin[i] + 0.5) / TASK_DEPTHS * (o->span - (int)len[0]));
    for (int k = 1; s == KVCAP_OK && k < n_lines; k++)
        if ((at[k] = task_place(&rng, o->span, (int)len[k], at, len, k)) < 0)
            s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "--span %d: too short to place the "
                           "retrieval task's %d needle lines apart", o->span, n_lines);
    int32_t *ids = t->ids + (size_t)i * t->max_len;
    int n = 0, got = 0;
    if (s == KVCAP_OK)
        s = append_text(mc, "<|im_start|>user\nRead the text, then answer the question.\n\n", ids,
                        &n, t->max_len, &got);
    *head = n;
    for (int pos = 0, f = 0; s == KVCAP_OK && pos < o->span;) {
        int k = 0;
        while (k < n_lines && at[k] != pos)
            k++;
        if (k < n_lines) {
            memcpy(ids + n, line[k], len[k] * sizeof *ids);
            n += (int)len[k], pos += (int)len[k];
        } else {
            ids[n++] = filler[f++], pos++;
        }
    }
    for (int k = 0; k < n_lines; k++)
        free(line[k]);
    KVCAP_TRY(s);
    t->depth[i] = (double)at[0] / o->span;
    for (int v = 0; v < t->values; v++)
        snprintf(t->truth[i][v], sizeof t->truth[i][v], "%04d", code[v]);
    char q[256];
    const char *asked = k_task_names[name[0]];
    if (t->values == 1)
        snprintf(q, sizeof q, "\nWhat is the code of the %s?<|im_end|>\n<|im_start|>assistant\n"
                 "The code of the %s is", asked, asked);
    else
        snprintf(q, sizeof q, "\nWhat are the codes of the %s?<|im_end|>\n"
                 "<|im_start|>assistant\nThe codes of the %s are", asked, asked);
    KVCAP_TRY(append_text(mc, q, ids, &n, t->max_len, &got));
    KVCAP_RETURN_IF(n >= t->max_len, KVCAP_ERR_INTERNAL, "task prompt too long");
    *tail = n - *head - o->span;
    return KVCAP_OK;
}

enum kvcap_status task_build(const struct options *o, const struct model_ctx *mc,
                             const struct corpus *corpus, struct task *t)
{
    memset(t, 0, sizeof *t);
    KVCAP_RETURN_IF(o->task_keys < 1 || o->task_keys > TASK_KEYS_MAX || o->task_values < 1 ||
                        o->task_values > TASK_VALUES_MAX,
                    KVCAP_ERR_INVALID_ARGUMENT, "retrieval task: %d keys, %d values (1..%d, "
                    "1..%d)", o->task_keys, o->task_values, TASK_KEYS_MAX, TASK_VALUES_MAX);
    t->n = o->task_queries;
    t->keys = o->task_keys, t->values = o->task_values;
    t->answer_tokens = TASK_ANSWER_TOKENS * t->values;
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
        t->prompts[i] = (struct prompt){
            .ids = t->ids + (size_t)i * t->max_len,
            .lay = {.head = head, .span = o->span, .tail = tail, .images = 1, .rows = 1}};
    }
    return KVCAP_OK;
}

/* Sorts runs of digits (pointers and lengths together) by their text. */
static void sort_runs(const char **run, size_t *len, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0; j--) {
            const size_t m = len[j - 1] < len[j] ? len[j - 1] : len[j];
            int c = memcmp(run[j - 1], run[j], m);
            if (c < 0 || (c == 0 && len[j - 1] <= len[j]))
                break;
            const char *r = run[j - 1];
            const size_t l = len[j - 1];
            run[j - 1] = run[j], len[j - 1] = len[j];
            run[j] = r, len[j] = l;
        }
}

void task_parse_answer(const char *text, int values, char *out, size_t cap)
{
    size_t n = 0;
    if (values == 1) {
        const char *p = text;
        while (*p == ' ')
            p++;
        while (p[n] >= '0' && p[n] <= '9' && n + 1 < cap)
            n++;
        memcpy(out, p, n);
        out[n] = '\0';
        return;
    }
    enum { MAX_RUNS = TASK_ANSWER_CHARS / 2 };
    const char *run[MAX_RUNS];
    size_t len[MAX_RUNS];
    int m = 0;
    for (const char *p = text; *p && m < MAX_RUNS;) {
        size_t l = 0;
        while (p[l] >= '0' && p[l] <= '9')
            l++;
        if (l)
            run[m] = p, len[m++] = l, p += l;
        else
            p++;
    }
    sort_runs(run, len, m);
    /* whole runs only: one that does not fit ends the answer */
    for (int k = 0; k < m && n + (n > 0) + len[k] < cap; k++) {
        if (n)
            out[n++] = ' ';
        memcpy(out + n, run[k], len[k]);
        n += len[k];
    }
    out[n] = '\0';
}

int task_answer_correct(const char *answer, const char (*truth)[8], int values)
{
    if (values == 1)
        return !strcmp(answer, truth[0]);
    for (int v = 0; v < values; v++) {
        const size_t l = strlen(truth[v]);
        int found = 0;
        for (const char *p = answer; *p && !found;) { /* its runs, space-separated */
            const size_t w = strcspn(p, " ");
            found = w == l && !memcmp(p, truth[v], l);
            p += w + (p[w] == ' ');
        }
        if (!found)
            return 0;
    }
    return 1;
}

/* The answer in n greedy tokens, as it is scored (task_parse_answer). */
static void task_answer(const struct model_ctx *mc, const int32_t *tokens, int n, int values,
                        char *out, size_t cap)
{
    char text[256];
    generated_text(mc, tokens, n, text, sizeof text);
    task_parse_answer(text, values, out, cap);
}

/* Every run answers every query (in batches of prompts, all runs batched together). */
enum kvcap_status task_run(const struct options *o, const struct model_ctx *mc,
                           struct run *runs, int n_runs, struct task *t)
{
    const int batch = 16;
    int32_t **out = calloc((size_t)n_runs, sizeof *out);
    enum kvcap_status s = out ? KVCAP_OK : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++) {
        runs[r].answers = calloc((size_t)t->n * t->answer_tokens, sizeof(int32_t));
        runs[r].task_correct_depth = calloc(TASK_DEPTHS, sizeof(double));
        if (!runs[r].answers || !runs[r].task_correct_depth)
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    }
    for (int first = 0; s == KVCAP_OK && first < t->n; first += batch) {
        const int nb = t->n - first < batch ? t->n - first : batch;
        for (int r = 0; r < n_runs; r++)
            out[r] = runs[r].answers + (size_t)first * t->answer_tokens;
        struct prompt *pr = t->prompts + first;
        struct cli_progress bar;
        cli_progress_begin(&bar, "retrieval task, prefill", o->quiet);
        for (int i = 0; s == KVCAP_OK && i < nb; i++) {
            s = prompt_prefill(mc, pr[i].ids, pr[i].lay.head, pr[i].lay.span, pr[i].lay.tail,
                               0, runs_take(runs, n_runs, POST_PROMPT), &pr[i]);
            if (s == KVCAP_OK && runs_take(runs, n_runs, POST_REPLAY))
                s = prompt_replay(mc, &pr[i], 0); /* timed on the prompts only */
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
                             t->answer_tokens, out, 0, what);
        phase_teardown(runs, n_runs);
        for (int i = 0; i < nb; i++) /* K/V of 64 prompts would hold ~0.9 GB at once */
            prompt_free(&pr[i]);
    }
    for (int i = 0; s == KVCAP_OK && i < t->n; i++)
        task_answer(mc, runs[0].answers + (size_t)i * t->answer_tokens, t->answer_tokens,
                    t->values, t->full_answer[i], sizeof t->full_answer[i]);
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++)
        for (int i = 0; i < t->n; i++) {
            char a[TASK_ANSWER_CHARS];
            task_answer(mc, runs[r].answers + (size_t)i * t->answer_tokens, t->answer_tokens,
                        t->values, a, sizeof a);
            const int ok = task_answer_correct(a, t->truth[i], t->values);
            runs[r].task_correct += ok;
            runs[r].task_correct_depth[t->bin[i]] += ok;
            runs[r].task_same += !strcmp(a, t->full_answer[i]);
        }
    free(out);
    return s;
}
