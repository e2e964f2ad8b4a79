/* csv.c — the CSV table: a header row, then one row per run in the report's order. */
#include <math.h>
#include <string.h>

#include "report/report_internal.h"

/* ---- CSV ----------------------------------------------------------------------------------- */

/* A text cell. One that starts like a formula (=, +, -, @, tab, CR) gets a leading ' so a
 * spreadsheet shows it as text instead of evaluating it (labels come from the command line). */
static void csv_text(struct buf *b, const char *s)
{
    const int formula = *s && strchr("=+-@\t\r", *s);
    if (!formula && !strpbrk(s, ",\"\r\n")) {
        bputs(b, s);
        return;
    }
    bputs(b, formula ? "\"'" : "\"");
    for (; *s; s++)
        bput(b, *s == '"' ? "\"\"" : s, *s == '"' ? 2 : 1);
    bputs(b, "\"");
}

static void csv_number(struct buf *b, double v)
{
    bputs(b, ",");
    if (isfinite(v))
        bprintf(b, "%.10g", v);
}

void rpt_render_csv(struct buf *b, const struct report *r)
{
    bputs(b, "id,policy,label,retention,compression,token_agreement,next_token_agreement,"
             "first_divergence_mean,nll,nll_full,nll_delta,attn_cosine_mean,attn_rel_err_mean,"
             "bytes_held,bytes_held_full,bytes_read_per_step,step_ms,step_ms_full,"
             "step_time_ratio,realised_retention,nominal,extension,kl,task_accuracy,"
             "task_agreement_full,freekv_corrected,freekv_reselected,freekv_hidden,"
             "kl_minus_random,kl_minus_random_half95\n");
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        csv_text(b, u->id);
        bputs(b, ",");
        csv_text(b, u->policy);
        bputs(b, ",");
        csv_text(b, u->label);
        const double v[] = {u->retention,
                            u->compression,
                            u->token_agreement,
                            u->next_token_agreement,
                            u->first_divergence_mean,
                            u->nll,
                            u->nll_full,
                            u->nll_delta,
                            u->cos_mean,
                            u->rel_mean,
                            u->bytes_held,
                            u->bytes_held_full,
                            u->bytes_read,
                            u->step_ms,
                            u->step_ms_full,
                            ratio(u->step_ms, u->step_ms_full),
                            u->realised,
                            u->nominal};
        for (size_t k = 0; k < sizeof v / sizeof v[0]; k++)
            csv_number(b, v[k]);
        bputs(b, u->extension ? ",true" : ",false");
        const double w[] = {u->kl,           u->task_accuracy, u->task_agreement,
                            u->fk_corrected, u->fk_reselected, u->fk_hidden};
        for (size_t k = 0; k < sizeof w / sizeof w[0]; k++)
            csv_number(b, w[k]);
        double m, h; /* empty where there is nothing to pair */
        rpt_versus_random(r, u, &m, &h);
        csv_number(b, m);
        csv_number(b, h);
        bputs(b, "\n");
    }
}
