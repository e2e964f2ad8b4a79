/* html.c — the self-contained HTML page: its text helpers, the header and summary, the ranking,
 * the tracks and facts, the sample continuations, the page's assembly and the entry points that
 * write the report (kvcap_report_write). */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/internal.h"
#include "report/report.h"
#include "report/report_internal.h"

/* ---- HTML: text helpers -------------------------------------------------------------------- */

/* 412672 -> "412,672". */
const char *rpt_fmt_count(char *out, size_t cap, double v)
{
    char digits[32];
    snprintf(digits, sizeof digits, "%.0f", v);
    size_t n = strlen(digits), o = 0;
    for (size_t i = 0; i < n && o + 2 < cap; i++) {
        if (i > 0 && digits[i - 1] != '-' && (n - i) % 3 == 0)
            out[o++] = ',';
        out[o++] = digits[i];
    }
    out[o] = '\0';
    return out;
}

/* Signed with a typographic minus: "+0.0068", "&minus;0.0004". */
const char *rpt_fmt_signed(char *out, size_t cap, double v, int decimals)
{
    if (v == 0) {
        snprintf(out, cap, "0");
        return out;
    }
    snprintf(out, cap, "%s%.*f", v < 0 ? "&minus;" : "+", decimals, fabs(v));
    return out;
}

void rpt_na_cell(struct buf *b)
{
    bputs(b, "<td class=\"na\">&mdash;</td>");
}

/* A paired difference's cell: the mean over prompts and ± the half-width of its 95 % interval,
 * green ("win") where the interval lies below 0, red ("lose") where above. */
void rpt_paired_cell(struct buf *b, double mean, double half)
{
    static const char *const cls[] = {[VS_CLOSER] = "win", [VS_TIED] = "tie",
                                      [VS_FARTHER] = "lose"};
    char v[48];
    bprintf(b, "<td class=\"%s\">%s<br><span class=\"unit\">&plusmn;%.4f</span></td>",
            cls[rpt_paired_verdict(mean, half)], rpt_fmt_signed(v, sizeof v, mean, 4), half);
}

/* A run's name in figures: "KVCapsule (tiled) @ 0.40". */
void rpt_run_name(struct buf *b, const struct run *u)
{
    besc(b, u->label);
    bprintf(b, " @ %.2f", u->retention);
}

const char *rpt_task_variant(char *out, size_t cap, const struct report *r)
{
    if (!r->has_task || (r->task_keys == 1 && r->task_values == 1))
        return NULL;
    snprintf(out, cap, "retrieval: %.0f key%s, %.0f value%s per query", r->task_keys,
             r->task_keys == 1 ? "" : "s", r->task_values, r->task_values == 1 ? "" : "s");
    return out;
}

static int any_task(const struct report *r)
{
    for (int i = 0; i < r->n_runs; i++)
        if (isfinite(r->runs[i].task_accuracy))
            return 1;
    return 0;
}

/* -1 when `a` ranks first: larger first (or smaller first with `ascending`), NaN last. */
static int cmp_measure(double a, double b, int ascending)
{
    if (isnan(a) || isnan(b))
        return isnan(a) == isnan(b) ? 0 : isnan(a) ? 1 : -1;
    if (a == b)
        return 0;
    return (a > b) != ascending ? -1 : 1;
}

/* The summary's order: task accuracy high to low, then KL low to high, then id. */
static int cmp_rank(const void *pa, const void *pb)
{
    const struct run *a = *(const struct run *const *)pa, *b = *(const struct run *const *)pb;
    int c = cmp_measure(a->task_accuracy, b->task_accuracy, 0);
    if (!c)
        c = cmp_measure(a->kl, b->kl, 1);
    return c ? c : strcmp(a->id, b->id);
}

/* The distinct targets of the compressed runs, ascending, into `out` (room for n_runs). */
static int targets_of(const struct report *r, double *out)
{
    int n = 0;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        int seen = 0;
        for (int k = 0; k < n; k++)
            seen |= out[k] == u->retention;
        if (!is_reference(r, u) && !seen)
            out[n++] = u->retention;
    }
    for (int i = 1; i < n; i++)
        for (int k = i; k > 0 && out[k - 1] > out[k]; k--) {
            double t = out[k];
            out[k] = out[k - 1];
            out[k - 1] = t;
        }
    return n;
}

/* The compressed runs at target `t`, ranked, into `out`; their count. */
static int ranked_at(const struct report *r, double t, const struct run **out)
{
    int n = 0;
    for (int i = 0; i < r->n_runs; i++)
        if (!is_reference(r, r->sorted[i]) && r->sorted[i]->retention == t)
            out[n++] = r->sorted[i];
    qsort(out, (size_t)n, sizeof *out, cmp_rank);
    return n;
}

static void swatch(struct buf *b, const struct curve *c)
{
    bprintf(b, "<span class=\"sw%s\" style=\"%s:%s\"></span>", c->extension ? " ext" : "",
            c->extension ? "border-color" : "background", c->color);
}

/* "kvcapsule tiled" plus a tag when it is kvcap's own variant. */
void rpt_policy_name(struct buf *b, const struct report *r, const struct run *u)
{
    swatch(b, &r->curves[u->curve]);
    besc(b, u->label);
    if (u->extension)
        bputs(b, " <span class=\"ext-tag\">kvcap extension</span>");
    if (u->shipped)
        bputs(b, " <span class=\"ship-tag\" title=\"chosen on calibration and development data "
                 "before this split was run\">shipped</span>");
}

/* KL in nats with enough digits for small values: "0.273", "0.0155", "4.2e-05". */
const char *rpt_fmt_kl(char *out, size_t cap, double v)
{
    if (v == 0)
        snprintf(out, cap, "0");
    else if (v >= 0.1)
        snprintf(out, cap, "%.3f", v);
    else
        snprintf(out, cap, "%.2g", v);
    return out;
}

/* ---- HTML: header, ranking, what was measured ---------------------------------------------- */

/* Whether the prompts come from the data the compressors were fitted on: the image track's
 * calibration photos (--photos calibration), or text documents that are all calibration
 * documents. Such a run is for choosing a setting, not for judging one. */
static int on_calibration_data(const struct report *r)
{
    if (r->image)
        return r->calibration_photos;
    if (!r->heldout_files || !r->calibration_files || !r->heldout_files->child)
        return 0;
    const cJSON *h, *c;
    cJSON_ArrayForEach(h, r->heldout_files)
    {
        int found = 0;
        cJSON_ArrayForEach(c, r->calibration_files) found |= !strcmp(h->valuestring, c->valuestring);
        if (!found)
            return 0;
    }
    return 1;
}

/* 0-based place of u among the ranked rows. */
static int rank_of(const struct run **ranked, int n, const struct run *u)
{
    for (int i = 0; i < n; i++)
        if (ranked[i] == u)
            return i;
    return n;
}

/* The summary's sentence on the floor: how many compressed rows are closer to full than random
 * eviction at the same budget (paired over the prompts, 95 %), naming the others. Nothing when
 * no row can be paired with a random run. */
static void versus_summary(struct buf *b, const struct report *r)
{
    int count[4] = {0};
    for (int i = 0; i < r->n_runs; i++) {
        double m, h;
        count[rpt_versus_random(r, r->sorted[i], &m, &h)]++;
    }
    const int paired = count[VS_CLOSER] + count[VS_TIED] + count[VS_FARTHER];
    if (!paired)
        return;
    bputs(b, " Against random eviction at the same budget (KL, paired over the prompts, "
             "95&nbsp;% interval): ");
    if (count[VS_CLOSER] == paired) {
        bprintf(b, "all %d compressed rows are closer to full.", paired);
        return;
    }
    bprintf(b, "%d of %d compressed rows are closer to full", count[VS_CLOSER], paired);
    static const enum versus others[2] = {VS_TIED, VS_FARTHER};
    static const char *const what[2] = {"not separated from it", "farther"};
    for (int k = 0; k < 2; k++) {
        if (!count[others[k]])
            continue;
        bprintf(b, "; %s: ", what[k]);
        const struct run *prev = NULL; /* a label's runs in a row: "vlcache @ 0.40, 0.60" */
        for (int i = 0; i < r->n_runs; i++) {
            const struct run *u = r->sorted[i];
            double m, h;
            if (rpt_versus_random(r, u, &m, &h) != others[k])
                continue;
            if (prev && !strcmp(prev->label, u->label))
                bprintf(b, ", %.2f", u->retention);
            else {
                bputs(b, prev ? "; " : "");
                rpt_run_name(b, u);
            }
            prev = u;
        }
    }
    bputs(b, ".");
}

/* The split the prompts come from, as the summary names it. */
static const char *split_word(const struct report *r)
{
    if (on_calibration_data(r))
        return "calibration";
    return r->split && strcmp(r->split, "calibration") != 0 ? r->split : "held-out";
}

static int any_shipped(const struct report *r)
{
    for (int i = 0; i < r->n_runs; i++)
        if (r->runs[i].shipped)
            return 1;
    return 0;
}

/* One row's score in the summary: task accuracy when the run measured the task, else KL. */
static void headline_score(struct buf *b, const struct run *u, int task)
{
    char n1[32];
    if (task && isfinite(u->task_accuracy))
        bprintf(b, "%.1f&nbsp;%% task accuracy, KL %s", 100 * u->task_accuracy,
                isfinite(u->kl) ? rpt_fmt_kl(n1, sizeof n1, u->kl) : "not measured");
    else
        bprintf(b, "KL %s", isfinite(u->kl) ? rpt_fmt_kl(n1, sizeof n1, u->kl) : "not measured");
}

/* The headline when a row was chosen in advance (kvcap-eval --shipped): at each budget, that
 * row against the best of the papers' methods, paired over the prompts; then the best row of
 * this report, said to be chosen after the fact. */
static void headline_shipped(struct buf *b, const struct report *r, const double *targets,
                             int n_targets, const struct run **ranked)
{
    const int task = any_task(r);
    bprintf(b, " kvcap&rsquo;s shipped configuration, <strong>");
    besc(b, r->shipped ? r->shipped : "");
    bputs(b, "</strong>, was chosen on calibration and development data before this run");
    for (int k = 0; k < n_targets; k++) {
        const int n = ranked_at(r, targets[k], ranked);
        const struct run *ship = NULL, *paper = NULL;
        for (int i = 0; i < n; i++) {
            if (ranked[i]->shipped && !ship)
                ship = ranked[i];
            if (!ranked[i]->extension && strcmp(ranked[i]->policy, "random") != 0 && !paper)
                paper = ranked[i];
        }
        bprintf(b, "%s %.0f&nbsp;%% of the span, ", k ? "; keeping" : ". Keeping", 100 * targets[k]);
        if (!ship) {
            bputs(b, "it has no row");
        } else {
            bprintf(b, "it ranks %d of %d (", 1 + rank_of(ranked, n, ship),
                    n);
            headline_score(b, ship, task);
            bputs(b, ")");
        }
        if (paper) {
            bputs(b, ", the best paper method ");
            besc(b, paper->label);
            bputs(b, " (");
            headline_score(b, paper, task);
            bputs(b, ")");
        }
        double m, h;
        if (ship && paper && ship->pp_kl && paper->pp_kl && ship->n_pp == paper->n_pp) {
            kvcap_report_paired(ship->pp_kl, paper->pp_kl, ship->n_pp, 0, &m, &h);
            if (isfinite(m) && isfinite(h)) {
                static const char *const verdict[] = {[VS_NONE] = "", [VS_CLOSER] = "closer to "
                                                      "full", [VS_TIED] = "not separated from it",
                                                      [VS_FARTHER] = "farther from full"};
                char n1[32], n2[32];
                bprintf(b, ": shipped minus it, KL %s&nbsp;&plusmn;&nbsp;%s (paired, 95&nbsp;%%), %s",
                        rpt_fmt_kl(n1, sizeof n1, m),
                        rpt_fmt_kl(n2, sizeof n2, h), verdict[rpt_paired_verdict(m, h)]);
            }
        }
        if (n > 0 && ranked[0] != ship && ranked[0] != paper) {
            bputs(b, "; best row here, picked after the fact: ");
            besc(b, ranked[0]->label);
            bputs(b, " (");
            headline_score(b, ranked[0], task);
            bputs(b, ")");
        }
    }
    bputs(b, ".");
}

static void render_header(struct buf *b, const struct report *r)
{
    char n1[32], n2[32];
    bputs(b, "<header>\n<h1>");
    besc(b, r->title);
    bputs(b, "</h1>\n<p class=\"meta\">");
    if (r->created) {
        bputs(b, "Created ");
        besc(b, r->created);
        bputs(b, " &middot; ");
    }
    bputs(b, "kvcap-report from <code>");
    const char *base = strrchr(r->path, '/');
    besc(b, base ? base + 1 : r->path);
    bputs(b, "</code></p>\n");

    /* What was measured, then the answer to "which policy should I use at this budget". */
    bputs(b, "<p class=\"summary\">");
    if (r->model_name) {
        bputs(b, "<strong>");
        besc(b, r->model_name);
        bputs(b, "</strong>");
    } else {
        bputs(b, "The model");
    }
    const int calibration = on_calibration_data(r);
    const char *split = split_word(r);
    bputs(b, " was evaluated");
    if (isfinite(r->prompts))
        bprintf(b, " on %s %s prompt%s", rpt_fmt_count(n1, sizeof n1, r->prompts), split,
                r->prompts == 1 ? "" : "s");
    bputs(b, ": each policy compressed the cache of ");
    if (r->image && isfinite(r->grid_rows) && isfinite(r->grid_cols) && r->images > 1)
        bprintf(b, "%.0f image spans of %.0f&thinsp;&times;&thinsp;%.0f tokens, %.0f text tokens "
                   "apart (different %s photos' crops, their patch features projected into the "
                   "embedding space in closed form: not a trained connector)", r->images,
                r->grid_rows, r->grid_cols, r->gap_tokens, split);
    else if (r->image && isfinite(r->grid_rows) && isfinite(r->grid_cols))
        bprintf(b, "an image span of %.0f&thinsp;&times;&thinsp;%.0f tokens (a %s photo's "
                   "patch features, projected into the embedding space in closed form: not a "
                   "trained connector)", r->grid_rows, r->grid_cols, split);
    else if (isfinite(r->span_tokens))
        bprintf(b, "a %s-token %sspan", rpt_fmt_count(n1, sizeof n1, r->span_tokens),
                r->image ? "image " : "text ");
    else
        bputs(b, "the prompt's compressible span");
    bputs(b, " to a target share (the memory budget)");
    if (r->has_task && isfinite(r->task_queries)) {
        char variant[96];
        bprintf(b, ", then answered %s retrieval question%s about lines inside the span",
                rpt_fmt_count(n1, sizeof n1, r->task_queries), r->task_queries == 1 ? "" : "s");
        if (rpt_task_variant(variant, sizeof variant, r))
            bprintf(b, " (RULER&rsquo;s variant, %s)", variant);
    }
    if (isfinite(r->continuation_tokens))
        bprintf(b, "; %s held-out tokens were scored teacher-forced against full's (KL, NLL)",
                rpt_fmt_count(n2, sizeof n2, r->continuation_tokens));
    bputs(b, ".");
    if (calibration)
        bprintf(b, " <strong>These prompts come from the %s the compressors were fitted on: the "
                   "run is for choosing a setting, not for judging one.</strong>",
                r->image ? "photos" : "documents");
    else if (r->split && !strcmp(r->split, "development"))
        bprintf(b, " <strong>Development split: kvcap&rsquo;s designs and settings were chosen "
                   "looking at these %s, so its rows here are optimistic; the test split judges "
                   "them.</strong>", r->image ? "photos" : "documents");
    else if (r->split && !strcmp(r->split, "test"))
        bprintf(b, " <strong>Test split: %s never looked at before kvcap&rsquo;s shipped "
                   "configuration was fixed on calibration and development data.</strong>",
                r->image ? "photos" : "documents");

    const struct run *full = rpt_full_run(r);
    double *targets = malloc(sizeof *targets * (size_t)r->n_runs);
    const struct run **ranked = malloc(sizeof *ranked * (size_t)r->n_runs);
    if (!targets || !ranked) {
        b->failed = 1;
        free(targets);
        free(ranked);
        return;
    }
    int n_targets = targets_of(r, targets), task = any_task(r);
    if (any_shipped(r)) {
        headline_shipped(b, r, targets, n_targets, ranked);
        n_targets = 0; /* the post-hoc best is said there, labelled */
    }
    for (int k = 0; k < n_targets; k++) {
        int n = ranked_at(r, targets[k], ranked); /* n >= 1: a target is some run's */
        const struct run *u = ranked[0];
        bprintf(b, "%s %.0f&nbsp;%% of the span: <strong>", k ? ";" : " Best when keeping",
                100 * targets[k]);
        besc(b, u->label);
        bputs(b, "</strong> (");
        if (u->extension)
            bputs(b, "a kvcap extension, ");
        if (task && isfinite(u->task_accuracy))
            bprintf(b, "%.1f&nbsp;%% task accuracy", 100 * u->task_accuracy);
        else
            bprintf(b, "KL %s",
                    isfinite(u->kl) ? rpt_fmt_kl(n1, sizeof n1, u->kl) : "not measured");
        /* When kvcap's own variant wins, the best of the papers' methods too. */
        for (int i = 1; u->extension && i < n; i++) {
            const struct run *p = ranked[i];
            if (p->extension)
                continue;
            bputs(b, "; best paper method ");
            besc(b, p->label);
            if (task && isfinite(p->task_accuracy))
                bprintf(b, ", %.1f&nbsp;%%", 100 * p->task_accuracy);
            else if (isfinite(p->kl))
                bprintf(b, ", KL %s", rpt_fmt_kl(n1, sizeof n1, p->kl));
            break;
        }
        bputs(b, ")");
    }
    if (n_targets)
        bputs(b, ".");
    if (n_targets && full && task && isfinite(full->task_accuracy))
        bprintf(b, " Full, the ceiling, answers %.1f&nbsp;%%.", 100 * full->task_accuracy);
    versus_summary(b, r);
    bputs(b, "</p>\n");
    bputs(b, "</header>\n");
    free(targets);
    free(ranked);
}

/* A task accuracy as a bar out of 100 % with full's accuracy as a tick, then the number. */
static void accuracy_bar(struct buf *b, double a, double ceiling)
{
    bprintf(b, "<span class=\"ab\"><i style=\"width:%.1f%%\"></i>", 100 * a);
    if (isfinite(ceiling))
        bprintf(b, "<b style=\"left:%.1f%%\"></b>", 100 * ceiling);
    bprintf(b, "</span>%.1f&nbsp;%%", 100 * a);
}

/* One row of a ranking card; `rank` 0 for full's; `versus` adds the cell against random. */
static void rank_row(struct buf *b, const struct report *r, const struct run *u, int rank,
                     double ceiling, int versus)
{
    char n1[32];
    bprintf(b, "<tr class=\"%s\" title=\"", rank == 0 ? "ceiling" : rank == 1 ? "win" : "rk");
    besc(b, u->id);
    bputs(b, "\">");
    if (rank)
        bprintf(b, "<td>%d</td><td class=\"l\">", rank);
    else
        bputs(b, "<td></td><td class=\"l\">");
    rpt_policy_name(b, r, u);
    if (!rank)
        bputs(b, " <span class=\"unit\">(ceiling)</span>");
    if (isfinite(u->realised)) {
        bprintf(b, "</td><td%s>%.1f&nbsp;%%", off_target(u) ? " class=\"off\"" : "",
                100 * u->realised);
        if (isfinite(u->held) && fabs(u->held - u->realised) > 0.01) /* FreeKV: reads, holds */
            bprintf(b, "<br><span class=\"unit\">read; holds %.0f&nbsp;%%</span>", 100 * u->held);
        bputs(b, "</td>");
    } else {
        bputs(b, "</td><td class=\"na\">&mdash;</td>");
    }
    if (!any_task(r)) /* no task: the attention output's fidelity in its place */
        if (isfinite(u->cos_mean))
            bprintf(b, "<td>%.4f</td>", u->cos_mean);
        else
            bputs(b, "<td class=\"na\">&mdash;</td>");
    else if (isfinite(u->task_accuracy)) {
        bputs(b, "<td class=\"acc\">");
        accuracy_bar(b, u->task_accuracy, ceiling);
        bputs(b, "</td>");
    } else {
        bputs(b, "<td class=\"na\">&mdash;</td>");
    }
    if (isfinite(u->kl) && u->n_seeds > 1 && isfinite(u->seed_kl_min)) {
        char n2[32], n3[32];
        bprintf(b, "<td>%s<br><span class=\"unit\" title=\"the mean KL of each of %d seeds\">"
                   "seeds %s&ndash;%s</span></td>", rpt_fmt_kl(n1, sizeof n1, u->kl), u->n_seeds,
                rpt_fmt_kl(n2, sizeof n2, u->seed_kl_min),
                rpt_fmt_kl(n3, sizeof n3, u->seed_kl_max));
    } else if (isfinite(u->kl)) {
        bprintf(b, "<td>%s</td>", rpt_fmt_kl(n1, sizeof n1, u->kl));
    } else {
        bputs(b, "<td class=\"na\">&mdash;</td>");
    }
    if (isfinite(u->token_agreement))
        bprintf(b, "<td class=\"sec\">%.1f&nbsp;%%</td>", 100 * u->token_agreement);
    else
        bputs(b, "<td class=\"na\">&mdash;</td>");
    double m, h;
    if (versus && rank && !strcmp(u->policy, "random"))
        bputs(b, "<td class=\"unit\">the floor</td>");
    else if (versus && rpt_versus_random(r, u, &m, &h) != VS_NONE)
        rpt_paired_cell(b, m, h);
    else if (versus)
        bputs(b, "<td class=\"na\">&mdash;</td>");
    bputs(b, "</tr>\n");
}

/* Per target retention, a card ranking the policies by task accuracy, then KL. */
static void render_ranking(struct buf *b, const struct report *r)
{
    double *targets = malloc(sizeof *targets * (size_t)r->n_runs);
    const struct run **ranked = malloc(sizeof *ranked * (size_t)r->n_runs);
    if (!targets || !ranked) {
        b->failed = 1;
        free(targets);
        free(ranked);
        return;
    }
    const struct run *full = rpt_full_run(r);
    int n_targets = targets_of(r, targets), task = any_task(r);
    double ceiling = full ? full->task_accuracy : NAN;
    bputs(b, "<section class=\"ranking\">\n<h2>Which policy wins at each memory budget</h2>\n");
    if (!n_targets)
        bputs(b, "<p class=\"caption\">No compressed runs to rank.</p>\n");
    bputs(b, "<div class=\"rank-grid\">\n");
    int any_versus = 0;
    for (int k = 0; k < n_targets; k++) {
        int n = ranked_at(r, targets[k], ranked);
        const struct run *rnd = rpt_random_at(r, targets[k]);
        const int versus = rnd && rnd->pp_kl;
        any_versus |= versus;
        bprintf(b, "<div class=\"rank-card\"><div class=\"rank-head\">Keep %.0f&nbsp;%% of the span"
                   " <span class=\"unit\">&middot; %.3g&times; smaller</span></div>\n"
                   "<table class=\"rank\"><thead><tr><th>#</th><th class=\"l\">Policy</th>"
                   "<th>Realised<br>retention</th>%s"
                   "<th>KL<br><span class=\"unit\">nats</span></th>"
                   "<th class=\"sec\">Greedy<br>agreement</th>%s</tr></thead>\n<tbody>\n",
                100 * targets[k], 1 / targets[k],
                task ? "<th class=\"l\">Task accuracy</th>"
                     : "<th>Attention<br><span class=\"unit\">cosine</span></th>",
                versus ? "<th>KL&nbsp;&minus;<br>random&rsquo;s</th>" : "");
        if (full)
            rank_row(b, r, full, 0, ceiling, versus);
        for (int i = 0; i < n; i++)
            rank_row(b, r, ranked[i], i + 1, ceiling, versus);
        bputs(b, "</tbody></table>");
        const cJSON *ur;
        cJSON_ArrayForEach(ur, r->unreached)
        {
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(ur, "retention");
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(ur, "floor");
            const cJSON *pol = cJSON_GetObjectItemCaseSensitive(ur, "policy");
            if (fabs(t->valuedouble - targets[k]) > 1e-9)
                continue;
            bputs(b, "<p class=\"caption\"><b>");
            besc(b, pol->valuestring);
            bprintf(b, "</b> has no row here: at its fewest pages it reads %.0f&nbsp;%% of the "
                       "span per step (its page digests and the pages it must attend).</p>",
                    100 * f->valuedouble);
        }
        bputs(b, "</div>\n");
    }
    bputs(b, "</div>\n<p class=\"caption\">");
    char variant[96];
    if (task && rpt_task_variant(variant, sizeof variant, r))
        bprintf(b, "Ranked by task accuracy (%s; answers %s; the bar's black tick is full's "
                   "accuracy, the ceiling), then by KL divergence from full's next-token "
                   "distribution (lower is better). ", variant,
                r->task_values > 1 ? "holding every true value, in any order"
                                   : "equal to the true value");
    else if (task)
        bputs(b, "Ranked by task accuracy (answers equal to the true value; the bar's black tick "
                 "is full's accuracy, the ceiling), then by KL divergence from full's next-token "
                 "distribution (lower is better). ");
    else
        bputs(b, "No run measured the retrieval task: ranked by KL divergence from full's "
                 "next-token distribution (lower is better); the attention cosine is the mean "
                 "over layers of the attention output's cosine with full's on replayed decode "
                 "steps. ");
    bputs(b, "Rows at one budget hold the same share of the span: the realised retention (span "
             "bytes held over full's; for eviction the share of span tokens kept; for FreeKV, "
             "which holds the whole span and its page digests, the span bytes a decode step "
             "reads, measured, its pages chosen to match the target) is within about 2&nbsp;% of "
             "the target, and shown <span class=\"key off\">amber</span> where it is not. "
             "Random eviction&rsquo;s row is the mean of its seeds, prompt by prompt; under its "
             "KL, the range of the seeds&rsquo; own means. Greedy agreement (share of "
             "generated tokens equal to full's) is secondary: it cascades after the first "
             "difference. Rows tagged <span class=\"ext-tag\">kvcap extension</span> are kvcap's "
             "own variants, not the papers' methods.");
    if (any_versus)
        bputs(b, " The last column pairs each row with random eviction at the same budget, the "
                 "floor every policy must clear: its KL minus random&rsquo;s, the mean over the "
                 "prompts &plusmn; the half-width of a 95&nbsp;% t-interval; <span class=\"win\">"
                 "green</span>: closer to full than random beyond that interval, <span "
                 "class=\"lose\">red</span>: farther, otherwise the prompts do not separate "
                 "them.");
    bputs(b, "</p>\n</section>\n");
    free(targets);
    free(ranked);
}

/* The track a report measured, for headings: "image 16 × 16" or "text 1 × 256". */
static void track_name(struct buf *b, const struct report *r)
{
    if (r->image && isfinite(r->grid_rows) && isfinite(r->grid_cols) && r->images > 1)
        bprintf(b, "%.0f images %.0f&thinsp;&times;&thinsp;%.0f", r->images, r->grid_rows,
                r->grid_cols);
    else if (r->image && isfinite(r->grid_rows) && isfinite(r->grid_cols))
        bprintf(b, "image %.0f&thinsp;&times;&thinsp;%.0f", r->grid_rows, r->grid_cols);
    else if (r->image)
        bputs(b, "image");
    else if (isfinite(r->span_tokens))
        bprintf(b, "text 1&thinsp;&times;&thinsp;%.0f", r->span_tokens);
    else
        bputs(b, "text");
    if (r->split) /* the same track on two splits: which is which */
        bprintf(b, "<br><span class=\"unit\">%s</span>", split_word(r));
}

static const struct run *run_by_id(const struct report *r, const char *id)
{
    for (int i = 0; i < r->n_runs; i++)
        if (!strcmp(r->runs[i].id, id))
            return &r->runs[i];
    return NULL;
}

/* With other tracks given (kvcap_report_write_tracks): every run of this report beside the run
 * of the same id in each other track, realised retention, KL and attention cosine. */
static void render_tracks(struct buf *b, const struct report *r)
{
    if (!r->others || !r->others[0])
        return;
    int n_tracks = 1;
    while (r->others[n_tracks - 1])
        n_tracks++;
    bputs(b, "<section>\n<h2>Tracks side by side</h2>\n<table class=\"tracks\">\n<thead><tr>"
             "<th class=\"l\" rowspan=\"2\">Run</th>");
    for (int t = 0; t < n_tracks; t++) {
        const struct report *x = t ? r->others[t - 1] : r;
        bputs(b, "<th colspan=\"3\" class=\"grp\">");
        track_name(b, x);
        bputs(b, "</th>");
    }
    bputs(b, "</tr>\n<tr>");
    for (int t = 0; t < n_tracks; t++)
        bputs(b, "<th class=\"grp\">Realised<br>retention</th><th>KL<br><span class=\"unit\">"
                 "nats</span></th><th>Attention<br><span class=\"unit\">cosine</span></th>");
    bputs(b, "</tr></thead>\n<tbody>\n");
    char n1[32];
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        bputs(b, "<tr><td class=\"l\">");
        rpt_policy_name(b, r, u);
        if (!is_reference(r, u))
            bprintf(b, " <span class=\"unit\">@%.2f</span>", u->retention);
        bputs(b, "</td>");
        for (int t = 0; t < n_tracks; t++) {
            const struct run *v = t ? run_by_id(r->others[t - 1], u->id) : u;
            if (!v) {
                bputs(b, "<td class=\"na grp\">&mdash;</td><td class=\"na\">&mdash;</td>"
                         "<td class=\"na\">&mdash;</td>");
                continue;
            }
            if (isfinite(v->realised))
                bprintf(b, "<td class=\"grp\">%.1f&nbsp;%%</td>", 100 * v->realised);
            else
                bputs(b, "<td class=\"na grp\">&mdash;</td>");
            if (isfinite(v->kl))
                bprintf(b, "<td>%s</td>", rpt_fmt_kl(n1, sizeof n1, v->kl));
            else
                bputs(b, "<td class=\"na\">&mdash;</td>");
            if (isfinite(v->cos_mean))
                bprintf(b, "<td>%.4f</td>", v->cos_mean);
            else
                bputs(b, "<td class=\"na\">&mdash;</td>");
        }
        bputs(b, "</tr>\n");
    }
    bputs(b, "</tbody></table>\n<p class=\"caption\">The same policies and retentions on each "
             "track: what the span holds changes which compression keeps the model's answers. "
             "KL: mean divergence of the teacher-forced next-token distribution from full's on "
             "the held-out continuations (lower is better); attention cosine: the attention "
             "output's cosine with full's on replayed decode steps, mean over layers (higher is "
             "better). Each track's own report has its full table.</p>\n</section>\n");
}

/* Model, corpus, setup, the task, goals and the command: what a reader checks before trusting
 * the numbers. */
static void render_facts(struct buf *b, const struct report *r)
{
    char n1[32];
    bputs(b, "<section>\n<h2>What was measured</h2>\n<dl class=\"facts\">\n");
    if (r->model_name || r->model_file || r->n_layers) {
        bputs(b, "<dt>Model</dt><dd>");
        if (r->model_name)
            besc(b, r->model_name);
        if (r->model_file) {
            bputs(b, " <code>");
            besc(b, r->model_file);
            bputs(b, "</code>");
        }
        if (r->n_layers)
            bprintf(b, " &middot; %d layers", r->n_layers);
        if (isfinite(r->q_heads) && isfinite(r->kv_heads))
            bprintf(b, " &middot; %.0f query / %.0f KV heads", r->q_heads, r->kv_heads);
        if (isfinite(r->head_dim))
            bprintf(b, " &middot; head dim %.0f", r->head_dim);
        bputs(b, "</dd>\n");
    }
    if (r->corpus_source || r->calibration_files || r->heldout_files) {
        const cJSON *e;
        bputs(b, "<dt>Corpus</dt><dd>");
        if (r->corpus_source)
            besc(b, r->corpus_source);
        const struct {
            const char *name;
            const cJSON *files;
            double tokens;
        } parts[] = {{"calibration", r->calibration_files, r->calibration_tokens},
                     {r->split ? r->split : "held out", r->heldout_files, r->heldout_tokens}};
        for (int k = 0; k < 2; k++) {
            if (!parts[k].files && !isfinite(parts[k].tokens))
                continue;
            bprintf(b, " &middot; %s:", parts[k].name);
            int first = 1;
            cJSON_ArrayForEach(e, parts[k].files)
            {
                bputs(b, first ? " " : ", ");
                besc(b, e->valuestring);
                first = 0;
            }
            if (isfinite(parts[k].tokens))
                bprintf(b, " (%s tokens)", rpt_fmt_count(n1, sizeof n1, parts[k].tokens));
        }
        bputs(b, "</dd>\n");
    }
    if (r->image) {
        bputs(b, "<dt>Images</dt><dd>");
        if (isfinite(r->photos))
            bprintf(b, "%.0f photos", r->photos);
        if (isfinite(r->heldout_photos))
            bprintf(b, " (%.0f held out, never calibrated on)", r->heldout_photos);
        if (r->calibration_photos)
            bputs(b, " &middot; these prompts show the calibration photos");
        if (isfinite(r->calibration_crops) && isfinite(r->heldout_crops))
            bprintf(b, " &middot; %.0f calibration and %.0f held-out crops", r->calibration_crops,
                    r->heldout_crops);
        if (isfinite(r->grid_rows) && isfinite(r->grid_cols))
            bprintf(b, " &middot; %.0f&thinsp;&times;&thinsp;%.0f patch grid", r->grid_rows,
                    r->grid_cols);
        if (r->features) {
            bputs(b, " <code>");
            besc(b, r->features);
            bputs(b, "</code>");
        }
        bputs(b, "</dd>\n");
    }
    if (r->has_task) {
        bputs(b, "<dt>Task</dt><dd>");
        besc(b, r->task_name ? r->task_name : "retrieval");
        if (r->task_haystack) {
            bputs(b, " &middot; ");
            besc(b, r->task_haystack);
        }
        if (r->task_line) {
            bputs(b, " &middot; a line: <q>");
            besc(b, r->task_line);
            bputs(b, "</q>");
        }
        if (r->task_question) {
            bputs(b, " &middot; asked: <q>");
            besc(b, r->task_question);
            bputs(b, "</q>");
        }
        char variant[96];
        if (rpt_task_variant(variant, sizeof variant, r))
            bprintf(b, " &middot; RULER&rsquo;s variant, %s", variant);
        if (isfinite(r->task_queries))
            bprintf(b, " &middot; %s queries", rpt_fmt_count(n1, sizeof n1, r->task_queries));
        if (isfinite(r->task_answer_tokens))
            bprintf(b, ", each answered in %s greedy tokens and %s",
                    rpt_fmt_count(n1, sizeof n1, r->task_answer_tokens),
                    r->task_values > 1 ? "right when it holds every code, in any order"
                                       : "exact-matched");
        if (r->n_depths)
            bprintf(b, " &middot; the asked line at %d depths of the span", r->n_depths);
        bputs(b, "</dd>\n");
    }
    const struct {
        const char *fmt;
        double v;
    } setup[] = {{"head %s tokens", r->head_tokens},
                 {r->images > 1 ? "%s images" : NULL, r->images},
                 {r->images > 1 ? "each span %s tokens" : "span %s tokens", r->span_tokens},
                 {r->images > 1 ? "%s text tokens between two" : NULL, r->gap_tokens},
                 {"tail %s tokens", r->tail_tokens},
                 {"%s generated greedily", r->generate_tokens},
                 {"%s continuation tokens scored teacher-forced", r->continuation_tokens},
                 {"%s decode steps replayed for attention fidelity", r->fidelity_steps},
                 {"%s prompts", r->prompts},
                 {"%s threads", r->threads}};
    int any = r->storage || isfinite(r->read_bandwidth_gbs);
    for (size_t k = 0; k < sizeof setup / sizeof setup[0]; k++)
        any |= setup[k].fmt && isfinite(setup[k].v);
    if (any) {
        bputs(b, "<dt>Setup</dt><dd>");
        const char *sep = "";
        for (size_t k = 0; k < sizeof setup / sizeof setup[0]; k++) {
            if (!setup[k].fmt || !isfinite(setup[k].v))
                continue;
            bputs(b, sep);
            bprintf(b, setup[k].fmt, rpt_fmt_count(n1, sizeof n1, setup[k].v));
            sep = " &middot; ";
        }
        if (r->storage) {
            bprintf(b, "%sstorage ", sep);
            besc(b, r->storage);
            sep = " &middot; ";
        }
        if (isfinite(r->read_bandwidth_gbs))
            bprintf(b, "%sread bandwidth %.1f GB/s", sep, r->read_bandwidth_gbs);
        bputs(b, "</dd>\n");
    }
    bputs(b, "</dl>\n");

    if (r->n_goals) {
        int met = 0;
        for (int i = 0; i < r->n_goals; i++)
            met += r->goals[i].met;
        bprintf(b, "<h3>Goals: %d of %d met</h3>\n<ul class=\"goals\">\n", met, r->n_goals);
        for (int i = 0; i < r->n_goals; i++) {
            bprintf(b, "<li><span class=\"badge %s\">%s</span>",
                    r->goals[i].met ? "met" : "unmet", r->goals[i].met ? "met" : "not met");
            besc(b, r->goals[i].text);
            bputs(b, "</li>\n");
        }
        bputs(b, "</ul>\n");
    }
    if (r->command) {
        bputs(b, "<h3>Reproduce</h3>\n<pre>");
        besc(b, r->command);
        bputs(b, "</pre>\n");
    }
    bputs(b, "</section>\n");
}

/* ---- HTML: sample continuations ----------------------------------------------------------- */

/* Per policy, the samples section shows the run whose retention is nearest this. */
static const double SAMPLE_RETENTION = 0.4;

/* Length in bytes of the longest common prefix of `a` and `b`, moved back to the start of a
 * UTF-8 sequence when it would end inside one (in either string). */
static size_t common_prefix(const char *a, const char *b)
{
    size_t n = 0;
    while (a[n] && a[n] == b[n])
        n++;
    while (n > 0 && ((((unsigned char)a[n] & 0xC0) == 0x80) ||
                     (((unsigned char)b[n] & 0xC0) == 0x80)))
        n--;
    return n;
}

/* Characters (UTF-8 lead bytes) in the first `n` bytes of `s`. */
static size_t utf8_chars(const char *s, size_t n)
{
    size_t chars = 0;
    for (size_t i = 0; i < n; i++)
        chars += ((unsigned char)s[i] & 0xC0) != 0x80;
    return chars;
}

/* One sample in a box headed "label @ retention" and a note; the bytes from `same` on are
 * highlighted as differing from the reference sample. */
static void sample_box(struct buf *b, const struct report *r, const struct run *u,
                       const struct run *base)
{
    char n1[32];
    size_t len = strlen(u->sample), same = len;
    if (base && base != u)
        same = common_prefix(u->sample, base->sample);
    bprintf(b, "<div class=\"sample\" title=\"");
    besc(b, u->id);
    bputs(b, "\"><div class=\"sh\">");
    swatch(b, &r->curves[u->curve]);
    rpt_run_name(b, u);
    bputs(b, " <span class=\"unit\">&middot; ");
    if (!base)
        bputs(b, "no full-cache sample to compare with");
    else if (base == u)
        bputs(b, "the reference");
    else if (strcmp(u->sample, base->sample) == 0)
        bputs(b, "identical to full");
    else if (same == len)
        bprintf(b, "as full, but ends after %s character%s",
                rpt_fmt_count(n1, sizeof n1, (double)utf8_chars(u->sample, len)),
                utf8_chars(u->sample, len) == 1 ? "" : "s");
    else if (same == 0)
        bputs(b, "diverges at the first character");
    else
        bprintf(b, "diverges after %s character%s",
                rpt_fmt_count(n1, sizeof n1, (double)utf8_chars(u->sample, same)),
                utf8_chars(u->sample, same) == 1 ? "" : "s");
    bputs(b, "</span></div><div class=\"st\">");
    besc_n(b, u->sample, same, 1);
    if (same < len) {
        bputs(b, "<span class=\"dv\">");
        besc_n(b, u->sample + same, len - same, 1);
        bputs(b, "</span>");
    }
    bputs(b, "</div></div>\n");
}

static void render_samples(struct buf *b, const struct report *r)
{
    char n1[32];
    const struct run *base = NULL;
    int any = 0;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        any |= u->sample != NULL;
        if (!base && u->sample && strcmp(u->policy, "full") == 0)
            base = u;
    }
    if (!any)
        return;
    /* Per curve, the run with a sample nearest SAMPLE_RETENTION; the sorted order (ascending
     * retention within a curve) makes the lower retention win a tie. */
    const struct run **pick = calloc((size_t)r->n_curves, sizeof *pick);
    if (!pick) {
        b->failed = 1;
        return;
    }
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i], *p = pick[u->curve];
        if (u->sample && (!p || fabs(u->retention - SAMPLE_RETENTION) <
                                    fabs(p->retention - SAMPLE_RETENTION)))
            pick[u->curve] = u;
    }
    if (base)
        pick[base->curve] = base;

    bputs(b, "<section>\n<h2>Sample continuations</h2>\n<p class=\"caption\">The start of "
             "the greedy continuation of prompt 0");
    if (r->prompt_sample)
        bputs(b, ", whose last characters are shown first,");
    bprintf(b, " with the full cache and, per policy, with the run whose retention is nearest "
               "%.2f. Text equal to the full cache's is shown plainly; from the first difference "
               "on it is <span class=\"dv\">highlighted</span>.</p>\n",
            SAMPLE_RETENTION);
    if (r->prompt_sample) {
        size_t len = strlen(r->prompt_sample);
        bprintf(b, "<div class=\"sample prompt\"><div class=\"sh\">Prompt 0 <span "
                   "class=\"unit\">&middot; its last %s character%s</span></div>"
                   "<div class=\"st\">&hellip;",
                rpt_fmt_count(n1, sizeof n1, (double)utf8_chars(r->prompt_sample, len)),
                utf8_chars(r->prompt_sample, len) == 1 ? "" : "s");
        besc_n(b, r->prompt_sample, len, 1);
        bputs(b, "</div></div>\n");
    }
    bputs(b, "<div class=\"samples\">\n");
    for (int c = 0; c < r->n_curves; c++)
        if (pick[c])
            sample_box(b, r, pick[c], base);
    bputs(b, "</div>\n</section>\n");
    free(pick);
}


/* ---- HTML: the page ------------------------------------------------------------------------ */

static const char CSS[] =
    ":root{--ink:#1d2330;--muted:#5b6473;--line:#d9dee7;--panel:#f5f7fa}\n"
    "*{box-sizing:border-box}\n"
    "body{margin:0;background:#fff;color:var(--ink);font:15px/1.5 system-ui,-apple-system,"
    "\"Segoe UI\",Roboto,\"DejaVu Sans\",\"Liberation Sans\",Arial,sans-serif}\n"
    "main{max-width:1320px;margin:0 auto;padding:28px 32px 56px}\n"
    "h1{font-size:27px;margin:0 0 2px;letter-spacing:-.01em}\n"
    "h2{font-size:20px;margin:40px 0 10px;padding-bottom:5px;border-bottom:2px solid var(--line)}\n"
    "h3{font-size:15.5px;margin:18px 0 6px}\n"
    ".meta{color:var(--muted);font-size:13.5px;margin:0 0 14px}\n"
    ".summary{font-size:16.5px;line-height:1.6;max-width:1180px;margin:0 0 14px}\n"
    "dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:3px 14px;margin:0 0 6px;"
    "font-size:14px}\n"
    "dl.facts dt{color:var(--muted);font-weight:600}dl.facts dd{margin:0}\n"
    "ul.goals{list-style:none;padding:0;margin:4px 0 0}ul.goals li{margin:5px 0}\n"
    ".badge{display:inline-block;min-width:70px;text-align:center;font-size:12.5px;font-weight:700;"
    "padding:1px 9px;border-radius:11px;margin-right:10px}\n"
    ".badge.met{background:#dcf2e2;color:#11652b;border:1px solid #98d3a8}\n"
    ".badge.unmet{background:#fbe0e0;color:#9b1c1c;border:1px solid #eca8a8}\n"
    ".win{color:#11652b;font-weight:600}\n.lose{color:#9b1c1c;font-weight:600}\n"
    "code,pre{font-family:ui-monospace,\"DejaVu Sans Mono\",Menlo,Consolas,monospace}\n"
    "code{font-size:13px}\n"
    "pre{background:var(--panel);border:1px solid var(--line);border-radius:6px;padding:10px 14px;"
    "white-space:pre-wrap;word-break:break-all;font-size:13px;line-height:1.45;margin:4px 0}\n"
    ".table-wrap{overflow-x:auto}\n"
    "table{border-collapse:collapse;font-size:13.5px;font-variant-numeric:tabular-nums}\n"
    "th,td{padding:5px 6px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}\n"
    "th{background:var(--panel);font-weight:600;vertical-align:bottom;line-height:1.25}\n"
    "th .unit{font-weight:400;color:var(--muted);font-size:12px}\n"
    ".unit{font-weight:400;color:var(--muted);font-size:13.5px}\n"
    "th.l,td.l{text-align:left}\n"
    "tr.first td{border-top:2px solid #b9c1cd}\n"
    "td.na{color:#9aa3b0;text-align:center}\n"
    ".ag-good{background:#d5efdb}.ag-warn{background:#fde8bf}.ag-bad{background:#f8d0d0}\n"
    ".key{padding:0 6px;border-radius:3px}\n"
    "ul.notes{margin:10px 0 4px;padding-left:22px;font-size:14px;max-width:1180px}\n"
    "ul.notes li{margin:3px 0}\n"
    ".samples{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:12px 16px;"
    "margin:12px 0 0}\n"
    ".sample{border:1px solid var(--line);border-radius:6px;overflow:hidden}\n"
    ".sample .sh{background:var(--panel);border-bottom:1px solid var(--line);padding:5px 12px;"
    "font-weight:600;font-size:14px}\n"
    ".sample .st{padding:8px 12px;white-space:pre-wrap;overflow-wrap:anywhere;font-size:14px;"
    "line-height:1.55}\n"
    ".sample.prompt{margin:12px 0 0}.sample.prompt .st{color:var(--muted);background:#fafbfc}\n"
    ".dv{background:#fbdcdc;border-left:2px solid #c62828}\n"
    ".sw{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:8px;"
    "vertical-align:-1px}\n"
    ".sw.ext{background:#fff;border:2.5px solid;width:12px;height:12px}\n"
    ".ship-tag{display:inline-block;font-size:10.5px;font-weight:700;line-height:1.3;color:#fff;"
    "background:#1b5e20;border-radius:8px;padding:0 5px;margin-left:5px;vertical-align:1px;"
    "white-space:nowrap}\n"
    ".ext-tag{display:inline-block;font-size:10.5px;font-weight:600;line-height:1.3;color:#6a3d9a;"
    "background:#f1eaf8;border:1px solid #d4c2ea;border-radius:8px;padding:0 5px;margin-left:5px;"
    "vertical-align:1px;white-space:nowrap}\n"
    "tr.group td{background:#fff;border-bottom:1px solid #9aa3b0;font-weight:700;font-size:13px;"
    "color:#3a4250;padding-top:14px}\n"
    "table.runs{font-size:13px}table.runs th,table.runs td{padding:4px 5px}\n"
    "table.runs td.l{white-space:normal;min-width:170px}\n"
    "td.off,.key.off{background:#fde8bf;color:#8a4b00}\n"
    "th.sec,td.sec{color:#7a8392}\n"
    ".rank-grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(660px,1fr));gap:14px}\n"
    ".rank-card{border:1px solid var(--line);border-radius:8px;overflow:hidden}\n"
    ".rank-head{background:#1d2330;color:#fff;font-weight:700;padding:6px 12px;font-size:15px}\n"
    ".rank-head .unit{color:#c9d0db}\n"
    "table.rank{width:100%;font-size:13px}table.rank th,table.rank td{padding:3px 6px}\n"
    "table.rank td.l{white-space:normal}\n"
    "table.tracks{font-size:13px}table.tracks th,table.tracks td{padding:3px 8px}\n"
    "table.tracks .grp{border-left:2px solid #c9ced6}\n"
    "table.rank tr.win td{background:#e3f4e8;font-weight:700}\n"
    "tr.ceiling td{background:#f3f4f6;color:#4a5361;font-style:italic}\n"
    ".ab{display:inline-block;position:relative;width:52px;height:9px;background:#e6e9ef;"
    "margin-right:7px;vertical-align:0}\n"
    ".ab i{position:absolute;left:0;top:0;bottom:0;background:#3b6fb6}\n"
    "tr.ceiling .ab i{background:#8d96a5}\n"
    ".ab b{position:absolute;top:-3px;bottom:-3px;width:2px;margin-left:-1px;background:#111}\n"
    "table.depth td{min-width:58px;text-align:center}table.depth td.l{text-align:left}\n"
    "svg .reflabel{font-size:12px;fill:#222;font-weight:600}\n"
    "svg .legend.lhead{font-weight:700;fill:#5b6473}\n"
    "figure{margin:12px 0 6px}\n"
    "figcaption,.caption{color:var(--muted);font-size:14px;max-width:1180px;margin:6px 0 0}\n"
    "svg.fig{display:block;max-width:100%;height:auto}\n"
    "svg text{font-family:inherit;fill:#1d2330}\n"
    "svg .tick{font-size:12px;fill:#4a5361}\n"
    "svg .alabel{font-size:13px;fill:#3a4250}\n"
    "svg .ptitle{font-size:14.5px;font-weight:700}\n"
    "svg .better{font-size:12px;fill:#6b7482;font-style:italic}\n"
    "svg .legend{font-size:13px}\n"
    "svg .rlabel{font-size:12.5px}\n"
    "svg .val{font-size:12px;fill:#1d2330}svg .val.na{fill:#9aa3b0;font-style:italic}\n"
    "svg .nodata{font-size:13px;fill:#9aa3b0}\n"
    "svg .grid{stroke:#e3e7ee;stroke-width:1}svg .grid.minor{stroke:#f0f2f6}\n"
    "svg .grid.zero{stroke:#b9c1cd}\n"
    "svg .frame{fill:none;stroke:#aab2bf;stroke-width:1}\n";

static void render_html(struct buf *b, const struct report *r)
{
    bputs(b, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
             "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>");
    besc(b, r->title);
    bprintf(b, "</title>\n<style>\n%s</style>\n</head>\n<body>\n<main>\n", CSS);
    render_header(b, r);
    render_ranking(b, r);
    render_tracks(b, r);
    render_facts(b, r);
    rpt_render_table(b, r);
    rpt_render_outside(b, r);
    rpt_render_fidelity(b, r);
    rpt_render_depths(b, r);
    rpt_render_heatmap(b, r);
    rpt_render_masks(b, r);
    render_samples(b, r);
    rpt_render_bars(b, r);
    bputs(b, "</main>\n</body>\n</html>\n");
}

/* ---- Entry point --------------------------------------------------------------------------- */

enum kvcap_status kvcap_report_write(const char *metrics_path, const char *html_path,
                                     const char *csv_path)
{
    return kvcap_report_write_tracks(&metrics_path, 1, html_path, csv_path);
}

enum kvcap_status kvcap_report_write_tracks(const char *const *metrics_paths, int n_metrics,
                                            const char *html_path, const char *csv_path)
{
    KVCAP_RETURN_IF(!metrics_paths || n_metrics < 1 || n_metrics > 8, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_report_write: 1 to 8 metrics files, got %d", n_metrics);
    const char *metrics_path = metrics_paths[0];
    KVCAP_RETURN_IF(!metrics_path || !*metrics_path, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvcap_report_write: no metrics file given");
    KVCAP_RETURN_IF((html_path && !*html_path) || (csv_path && !*csv_path),
                    KVCAP_ERR_INVALID_ARGUMENT, "kvcap_report_write: empty output path");
    KVCAP_RETURN_IF((html_path && strcmp(html_path, metrics_path) == 0) ||
                        (csv_path && strcmp(csv_path, metrics_path) == 0),
                    KVCAP_ERR_INVALID_ARGUMENT, "%s: an output would overwrite the metrics file",
                    metrics_path);
    KVCAP_RETURN_IF(html_path && csv_path && strcmp(html_path, csv_path) == 0,
                    KVCAP_ERR_INVALID_ARGUMENT, "%s: the HTML and the CSV output are the same file",
                    html_path);
    for (int i = 1; i < n_metrics; i++)
        KVCAP_RETURN_IF(!metrics_paths[i] || (html_path && !strcmp(html_path, metrics_paths[i])) ||
                            (csv_path && !strcmp(csv_path, metrics_paths[i])),
                        KVCAP_ERR_INVALID_ARGUMENT, "%s: an output would overwrite it",
                        metrics_paths[i] ? metrics_paths[i] : "(NULL)");
    struct report r, others[8];
    const struct report *other_ptrs[8] = {NULL};
    enum kvcap_status st = report_load(&r, metrics_path);
    int loaded = 0;
    for (int i = 1; st == KVCAP_OK && i < n_metrics; i++) {
        st = report_load(&others[i - 1], metrics_paths[i]);
        if (st == KVCAP_OK)
            other_ptrs[loaded++] = &others[i - 1];
        else /* what it read before the error */
            report_free(&others[i - 1]);
    }
    if (st == KVCAP_OK && loaded)
        r.others = other_ptrs;
    struct buf html = {0}, csv = {0};
    if (st == KVCAP_OK && csv_path)
        rpt_render_csv(&csv, &r);
    if (st == KVCAP_OK && html_path)
        render_html(&html, &r);
    if (st == KVCAP_OK && (html.failed || csv.failed))
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory rendering the report",
                        metrics_path);
    /* both or neither: a report whose CSV was replaced while its HTML was not is two runs' */
    const char *paths[2];
    const void *data[2];
    size_t lens[2];
    int n = 0;
    if (csv_path)
        paths[n] = csv_path, data[n] = csv.p ? csv.p : "", lens[n++] = csv.len;
    if (html_path)
        paths[n] = html_path, data[n] = html.p ? html.p : "", lens[n++] = html.len;
    if (st == KVCAP_OK) {
        /* kvcap_write_files_atomic writes and syncs both temporaries before the first rename;
         * a termination signal between the two renames would still leave a new CSV beside an
         * old HTML, so those signals wait until the call returns (the cleanup handler then
         * finds no temporary file left). The wait is the writing and syncing of the two files,
         * not the rendering above. */
        sigset_t term, old;
        sigemptyset(&term);
        sigaddset(&term, SIGINT);
        sigaddset(&term, SIGTERM);
        sigaddset(&term, SIGHUP);
        sigaddset(&term, SIGQUIT);
        const int blocked = pthread_sigmask(SIG_BLOCK, &term, &old) == 0;
        st = kvcap_write_files_atomic(n, paths, data, lens);
        if (blocked)
            pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    free(html.p);
    free(csv.p);
    report_free(&r);
    for (int i = 0; i < loaded; i++)
        report_free(&others[i]);
    return st;
}
