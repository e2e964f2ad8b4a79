/* html_tables.c — the HTML page's headline table (one row per run) and kvpress's rows beside
 * kvcap's best, paired over the prompts. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "report/report.h"
#include "report/report_internal.h"

/* ---- HTML: the headline table -------------------------------------------------------------- */

/* A fraction as a percentage, coloured green from 99 %, amber from 95 %, red below. */
static void agreement_cell(struct buf *b, double a)
{
    if (!isfinite(a)) {
        rpt_na_cell(b);
        return;
    }
    bprintf(b, "<td class=\"%s\">%.1f&nbsp;%%</td>",
            a >= 0.99 ? "ag-good" : a >= 0.95 ? "ag-warn" : "ag-bad", 100 * a);
}

static void render_notes(struct buf *b, const struct report *r)
{
    const cJSON *e;
    if (!r->notes || cJSON_GetArraySize(r->notes) == 0)
        return;
    bputs(b, "<ul class=\"notes\">\n");
    cJSON_ArrayForEach(e, r->notes)
    {
        bputs(b, "<li>");
        besc(b, e->valuestring);
        bputs(b, "</li>\n");
    }
    bputs(b, "</ul>\n");
}

/* A task accuracy coloured by how much of full's it keeps: green from 95 %, amber from 75 %. */
static void task_cell(struct buf *b, double a, double ceiling)
{
    if (!isfinite(a)) {
        rpt_na_cell(b);
        return;
    }
    double kept = ceiling > 0 ? a / ceiling : isfinite(ceiling) ? 1 : NAN;
    const char *cls = !isfinite(kept)  ? "plain"
                      : kept >= 0.95 ? "ag-good"
                      : kept >= 0.75 ? "ag-warn"
                                     : "ag-bad";
    bprintf(b, "<td class=\"%s\">%.1f&nbsp;%%</td>", cls, 100 * a);
}

static void share_cell(struct buf *b, double v)
{
    if (isfinite(v))
        bprintf(b, "<td>%.1f&nbsp;%%</td>", 100 * v);
    else
        rpt_na_cell(b);
}

enum { TABLE_COLUMNS = 13 };

void rpt_render_table(struct buf *b, const struct report *r)
{
    char n1[32], d[48];
    const struct run *full = rpt_full_run(r);
    double ceiling = full ? full->task_accuracy : NAN;
    bputs(b, "<section>\n<h2>Headline results</h2>\n<div class=\"table-wrap\">"
             "<table class=\"runs\">\n<thead><tr><th class=\"l\">Policy</th><th>Target<br>retention</th>"
             "<th>Realised<br>retention<br><span class=\"unit\">of full's span</span></th>"
             "<th>Task<br>accuracy<br><span class=\"unit\">true answer</span></th>"
             "<th>Task<br>agreement<br><span class=\"unit\">with full</span></th>"
             "<th>KL<br>vs full<br><span class=\"unit\">nats/token</span></th>"
             "<th>&Delta;NLL<br>vs full<br><span class=\"unit\">nats/token</span></th>"
             "<th>Next-token<br>agreement<br><span class=\"unit\">");
    if (isfinite(r->continuation_tokens))
        bprintf(b, "%s teacher-forced", rpt_fmt_count(n1, sizeof n1, r->continuation_tokens));
    else
        bputs(b, "teacher-forced");
    bputs(b, "</span></th><th class=\"sec\">Greedy<br>agreement<br><span class=\"unit\">");
    if (isfinite(r->generate_tokens))
        bprintf(b, "%s generated", rpt_fmt_count(n1, sizeof n1, r->generate_tokens));
    else
        bputs(b, "generated tokens");
    bputs(b, "</span></th>"
             "<th>Bytes held<br><span class=\"unit\">% of full</span></th>"
             "<th>Step time<br><span class=\"unit\">vs full</span></th>"
             "<th>Prefill<br>cost<br><span class=\"unit\">vs prefill</span></th>"
             "<th>FreeKV<br>corrected /<br>re-selected /<br>hidden <span class=\"unit\">%</span>"
             "</th>"
             "</tr></thead>\n<tbody>\n");
    int group = -1; /* 0: full, 1: papers' methods, 2: kvcap's extensions */
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        const struct curve *cv = &r->curves[u->curve];
        int g = cv->reference ? 0 : cv->extension ? 2 : 1;
        if (g != group && g > 0)
            bprintf(b, "<tr class=\"group\"><td class=\"l\" colspan=\"%d\">%s</td></tr>\n",
                    TABLE_COLUMNS,
                    g == 1 ? "The papers&rsquo; methods"
                           : "kvcap&rsquo;s extensions &mdash; its own variants, not the "
                             "papers&rsquo; methods");
        int first = i > 0 && g == group && r->sorted[i - 1]->curve != u->curve;
        group = g;
        bprintf(b, "<tr class=\"run%s%s\" title=\"", first ? " first" : "",
                u->extension ? " ext" : "");
        besc(b, u->id);
        bputs(b, "\"><td class=\"l\">");
        rpt_policy_name(b, r, u);
        bprintf(b, "</td><td>%.2f", u->retention);
        if (isfinite(u->nominal) && fabs(u->nominal - u->retention) > 5e-4)
            bprintf(b, "<br><span class=\"unit\">nominal %.5g</span>", u->nominal);
        bputs(b, "</td>");
        if (isfinite(u->realised))
            bprintf(b, "<td%s>%.1f&nbsp;%%</td>", off_target(u) ? " class=\"off\"" : "",
                    100 * u->realised);
        else
            rpt_na_cell(b);
        task_cell(b, u->task_accuracy, ceiling);
        share_cell(b, u->task_agreement);
        if (isfinite(u->kl))
            bprintf(b, "<td>%s</td>", rpt_fmt_kl(n1, sizeof n1, u->kl));
        else
            rpt_na_cell(b);
        if (isfinite(u->nll_delta))
            bprintf(b, "<td>%s</td>", rpt_fmt_signed(d, sizeof d, u->nll_delta, 4));
        else
            rpt_na_cell(b);
        agreement_cell(b, u->next_token_agreement);
        if (isfinite(u->token_agreement))
            bprintf(b, "<td class=\"sec\">%.1f&nbsp;%%</td>", 100 * u->token_agreement);
        else
            rpt_na_cell(b);
        double held = ratio(u->bytes_held, u->bytes_held_full);
        if (isfinite(held))
            bprintf(b, "<td title=\"%.2f MiB\">%.1f&nbsp;%%</td>", u->bytes_held / 1048576.0,
                    100 * held);
        else
            rpt_na_cell(b);
        double step = ratio(u->step_ms, u->step_ms_full);
        if (isfinite(step))
            bprintf(b, "<td>%.2f&times;</td>", step);
        else
            rpt_na_cell(b);
        if (isfinite(u->prefill_cost) && u->prefill_cost > 0)
            bprintf(b, "<td>+%.*f&times;</td>", u->prefill_cost < 0.01 ? 4 : 2, u->prefill_cost);
        else
            rpt_na_cell(b);
        if (u->has_freekv) {
            bputs(b, "<td class=\"fk\">");
            const double fk[3] = {u->fk_corrected, u->fk_reselected, u->fk_hidden};
            for (int k = 0; k < 3; k++) {
                if (isfinite(fk[k]))
                    bprintf(b, "%s%.1f", k ? " / " : "", 100 * fk[k]);
                else
                    bprintf(b, "%s&mdash;", k ? " / " : "");
            }
            bputs(b, "&nbsp;%</td>");
        } else {
            rpt_na_cell(b);
        }
        bputs(b, "</tr>\n");
    }
    bputs(b, "</tbody></table></div>\n");
    render_notes(b, r);
    bputs(b, "<p class=\"caption\">One row per run, grouped by policy: full, then the papers' "
             "methods, then kvcap's extensions. The target is the share of the span a run was "
             "asked to keep; where the policy's own parameter differs (VL-Cache's alpha, searched "
             "because its Algorithm&nbsp;1 under-fills the budget) it is shown as nominal. The "
             "realised retention is what it holds (span bytes over full's; for eviction the "
             "share of span tokens kept; for FreeKV the share attended per step), "
             "<span class=\"key off\">amber</span> when more than 2&nbsp;% off the target. ");
    char variant[96];
    if (rpt_task_variant(variant, sizeof variant, r))
        bprintf(b, "Task accuracy (%s) is coloured", variant);
    else
        bputs(b, "Task accuracy is coloured");
    bputs(b, " by the share of full's accuracy it keeps: "
             "<span class=\"key ag-good\">&ge;&nbsp;95&nbsp;%</span> "
             "<span class=\"key ag-warn\">&ge;&nbsp;75&nbsp;%</span> "
             "<span class=\"key ag-bad\">below</span>. KL and &Delta;NLL are per held-out token, "
             "teacher-forced (both caches see the same text, no cascade); &Delta;NLL above zero "
             "predicts the text worse. Next-token agreement is the share of those positions "
             "whose most likely next token is full's, coloured "
             "<span class=\"key ag-good\">&ge;&nbsp;99&nbsp;%</span> "
             "<span class=\"key ag-warn\">&ge;&nbsp;95&nbsp;%</span> "
             "<span class=\"key ag-bad\">below</span>. Greedy agreement (grey, secondary) "
             "cascades: once one generated token differs the continuations part. Bytes held "
             "are all layers after prefill over full's (FreeKV keeps the whole span in host "
             "memory). Prefill cost is the compression work per prompt (scoring and eviction, "
             "KVCapsule's projection onto its bases, FreeKV's paging of the span; for kvzip "
             "also its context-reconstruction pass, the model run after the prompt's cache; not "
             "the storing of rows every policy does) over the model's prefill of the prompt. "
             "FreeKV's column holds the shares of (step, KV head) pairs whose "
             "speculative selection was corrected, re-selected synchronously, or fully hidden. "
             "Attention fidelity is in the plots and the per-layer heatmap below. &mdash; means "
             "not measured or not applicable.</p>\n</section>\n");
}

/* The shipped row (chosen in advance) at a target retention, else the best run of this report
 * there by KL from full (full excluded, picked after the fact), or NULL.
 * KL, not ΔNLL: a cache can predict the held-out text better than full (ΔNLL below zero, as
 * on the image track, where the span means little to the model) while departing from it. */
static const struct run *best_at(const struct report *r, double retention)
{
    for (int i = 0; i < r->n_runs; i++) /* kvcap's configuration chosen in advance, first */
        if (r->runs[i].shipped && fabs(r->runs[i].retention - retention) < 1e-9)
            return &r->runs[i];
    const struct run *best = NULL;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = &r->runs[i];
        if (is_reference(r, u) || fabs(u->retention - retention) > 1e-9 || !isfinite(u->kl))
            continue;
        if (!best || u->kl < best->kl)
            best = u;
    }
    return best;
}

/* Two cells: kvcap's best row minus another, paired over the prompts, for KL and |ΔNLL|:
 * the mean and its 95 % interval, green where the interval is below 0 (kvcap's best closer to
 * full), red where above; a dash without per-prompt values on both sides. */
static void paired_cells(struct buf *b, const struct run *best, const double *kl,
                         const double *dnll, int n)
{
    const double *ours[2] = {best ? best->pp_kl : NULL, best ? best->pp_dnll : NULL};
    const double *theirs[2] = {kl, dnll};
    for (int k = 0; k < 2; k++) {
        double m = NAN, h = NAN;
        if (ours[k] && theirs[k] && best->n_pp == n)
            kvcap_report_paired(ours[k], theirs[k], n, k == 1, &m, &h);
        if (!isfinite(m) || !isfinite(h))
            bputs(b, "<td>&mdash;</td>");
        else
            rpt_paired_cell(b, m, h);
    }
}

/* kvpress's presses beside kvcap's best policy and random eviction, retention by retention. */
void rpt_render_outside(struct buf *b, const struct report *r)
{
    const struct outside *x = &r->outside;
    if (!x->rows && !x->mismatch)
        return;
    char n1[32], d[48];
    bputs(b, "<section>\n<h2>Outside reference: kvpress</h2>\n");
    if (x->mismatch) {
        bputs(b, "<p class=\"caption\">kvpress.json beside this report is not shown: ");
        besc(b, x->mismatch);
        bputs(b, ".</p>\n</section>\n");
        return;
    }
    bputs(b, "<div class=\"table-wrap\"><table class=\"runs\">\n<thead><tr><th class=\"l\">Method"
             "</th><th>Target<br>retention</th><th>Realised<br>retention</th>"
             "<th>KL<br>vs full<br><span class=\"unit\">nats/token</span></th>"
             "<th>&Delta;NLL<br>vs full<br><span class=\"unit\">nats/token</span></th>"
             "<th>Next-token<br>agreement</th>"
             "<th>kvcap&rsquo;s<br>&minus; this: KL<br><span class=\"unit\">95&nbsp;% "
             "interval</span></th>"
             "<th>kvcap&rsquo;s<br>&minus; this: |&Delta;NLL|<br><span class=\"unit\">"
             "95&nbsp;% interval</span></th></tr></thead>\n<tbody>\n");
    /* retentions in the order kvpress.json first lists them */
    for (int i = 0; i < x->n_rows; i++) {
        const double t = x->rows[i].retention;
        int seen = 0;
        for (int j = 0; j < i; j++)
            seen |= x->rows[j].retention == t;
        if (seen)
            continue;
        bprintf(b, "<tr class=\"group\"><td class=\"l\" colspan=\"8\">%.0f&nbsp;%% of the span "
                   "kept</td></tr>\n", 100 * t);
        const struct run *best = best_at(r, t), *rnd = rpt_random_at(r, t);
        const struct run *ours[2] = {best, rnd != best ? rnd : NULL};
        for (int k = 0; k < 2; k++) {
            const struct run *u = ours[k];
            if (!u)
                continue;
            bputs(b, "<tr class=\"run\"><td class=\"l\">");
            rpt_policy_name(b, r, u);
            if (k == 0)
                bputs(b, u->shipped ? " <span class=\"unit\">kvcap&rsquo;s, chosen in advance</span>"
                                    : " <span class=\"unit\">kvcap&rsquo;s best by KL, picked "
                                      "after the fact</span>");
            bprintf(b, "</td><td>%.2f</td><td>%.1f&nbsp;%%</td><td>%s</td><td>%s</td>",
                    u->retention, 100 * u->realised, rpt_fmt_kl(n1, sizeof n1, u->kl),
                    rpt_fmt_signed(d, sizeof d, u->nll_delta, 4));
            agreement_cell(b, u->next_token_agreement);
            if (k == 0)
                bputs(b, "<td>&mdash;</td><td>&mdash;</td>");
            else
                paired_cells(b, best, u->pp_kl, u->pp_dnll, u->n_pp);
            bputs(b, "</tr>\n");
        }
        for (int j = 0; j < x->n_rows; j++) {
            const struct outside_row *o = &x->rows[j];
            if (o->retention != t)
                continue;
            bputs(b, "<tr class=\"run ext\"><td class=\"l\">kvpress ");
            besc(b, o->press);
            bprintf(b, "</td><td>%.2f</td><td>%.1f&nbsp;%%</td><td>%s</td><td>%s</td>",
                    o->retention, 100 * o->realised, rpt_fmt_kl(n1, sizeof n1, o->kl),
                    rpt_fmt_signed(d, sizeof d, o->dnll, 4));
            agreement_cell(b, o->agreement);
            paired_cells(b, best, o->pp_kl, o->pp_dnll, o->n_pp);
            bputs(b, "</tr>\n");
        }
    }
    bputs(b, "</tbody></table></div>\n<p class=\"caption\">kvpress ");
    besc(b, x->version);
    bputs(b, " on transformers ");
    besc(b, x->transformers);
    bputs(b, ", run by <code>scripts/kvpress-reference.sh</code> on the same model weights "
             "(transformers reading the same GGUF, in f32), the same prompts and the same span; "
             "tokens outside the span are always kept, and each press keeps the same share of "
             "the span as kvcap's rows. KVzip shares its budget across layers and heads, as in "
             "its paper; the other presses keep the same number per head. Metrics as above, "
             "measured by the script on its own engine: compare rows within a retention. The "
             "last two columns pair each row with kvcap&rsquo;s row (its shipped configuration "
             "when one was chosen in advance, else its best by KL) on the same prompts: the "
             "mean over prompts of kvcap&rsquo;s minus the row, for the KL and for each "
             "prompt&rsquo;s |&Delta;NLL| (on the image track every compressed cache&rsquo;s "
             "&Delta;NLL is negative, so closeness to full is its size), &plusmn; the half-width "
             "of a 95&nbsp;% t-interval; <span class=\"win\">green</span>: kvcap&rsquo;s row "
             "is closer to full beyond that interval, <span class=\"lose\">red</span>: the row "
             "is, otherwise the prompts do not separate them.");
    /* what outside_bind checked, so that a reader sees the file belongs to this run */
    char hash[13];
    snprintf(hash, sizeof hash, "%.12s", x->hash);
    bputs(b, " Checked against this run: the same track, prompts (<code>prompts_sha256</code> ");
    besc(b, hash);
    bprintf(b, "&hellip;) and retentions; its full-cache NLL, %.4f nats/token, is within %g of "
               "this run&rsquo;s %.4f.", x->full_nll, OUTSIDE_FULL_NLL_TOL, x->full_nll_here);
    int whole = 0;
    for (int j = 0; j < x->n_rows; j++)
        whole |= !strcmp(x->rows[j].press, "kvzip_whole_prompt");
    if (whole)
        bputs(b, " <b>kvzip</b> is kvpress&rsquo;s KVzip press as shipped: it starts its replay "
                 "after as many tokens as the chat template puts before a user&rsquo;s text (24 "
                 "for SmolLM2; these prompts are not in chat form, and where the head is shorter "
                 "the first tokens of the span go unscored and are evicted first). <b>kvzip_whole_prompt</b> is the same "
                 "press replaying the whole prompt, as the paper does: the row kvcap&rsquo;s "
                 "kvzip is checked against.");
    bputs(b, "</p>\n</section>\n");
}
