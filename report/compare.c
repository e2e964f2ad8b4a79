/* compare.c — runs set against each other: full's run, random eviction's at a target, and
 * differences paired over the prompts with their 95 % t-intervals (kvcap_report_paired). */
#include <math.h>
#include <string.h>

#include "report/report.h"
#include "report/report_internal.h"

/* Student's t quantile t(0.975, df): from the table for df <= 30 (3 decimals), a Cornish-Fisher
 * expansion in 1/df beyond (within 0.001 there). */
static double t975(int df)
{
    static const double t[31] = {NAN,   12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365,
                                 2.306, 2.262,  2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
                                 2.120, 2.110,  2.101, 2.093, 2.086, 2.080, 2.074, 2.069,
                                 2.064, 2.060,  2.056, 2.052, 2.048, 2.045, 2.042};
    if (df < 1)
        return NAN;
    if (df <= 30)
        return t[df];
    const double z = 1.959964, z3 = z * z * z, z5 = z3 * z * z;
    return z + (z3 + z) / (4.0 * df) + (5 * z5 + 16 * z3 + 3 * z) / (96.0 * df * df);
}

/* Paired over n prompts: the mean of f(a[i]) - f(b[i]) (f = |x| when `absolute`) and the
 * half-width of its 95 % t-interval; NaN for both when n < 2. */
static double paired_diff(double a, double b, int absolute)
{
    return absolute ? fabs(a) - fabs(b) : a - b;
}

void kvcap_report_paired(const double *a, const double *b, int n, int absolute, double *mean,
                         double *half)
{
    *mean = *half = NAN;
    if (n < 2)
        return;
    double sum = 0, sq = 0;
    for (int i = 0; i < n; i++)
        sum += paired_diff(a[i], b[i], absolute);
    const double m = sum / n;
    for (int i = 0; i < n; i++) {
        const double d = paired_diff(a[i], b[i], absolute) - m;
        sq += d * d;
    }
    *mean = m;
    *half = t975(n - 1) * sqrt(sq / (n - 1) / n);
}

/* Where the interval mean ± half lies: below 0, above 0, or across it. */
enum versus rpt_paired_verdict(double mean, double half)
{
    return mean + half < 0 ? VS_CLOSER : mean - half > 0 ? VS_FARTHER : VS_TIED;
}

/* The full-cache run (the first of the reference curve), or NULL. */
const struct run *rpt_full_run(const struct report *r)
{
    for (int i = 0; i < r->n_runs; i++)
        if (is_reference(r, r->sorted[i]))
            return r->sorted[i];
    return NULL;
}

/* The random-eviction run at target `t` (the floor every policy must clear), or NULL. */
const struct run *rpt_random_at(const struct report *r, double t)
{
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = &r->runs[i];
        if (!is_reference(r, u) && !strcmp(u->policy, "random") && fabs(u->retention - t) < 1e-9)
            return u;
    }
    return NULL;
}

/* Run u against random eviction at its target, paired over the prompts: *mean is u's KL minus
 * random's (mean over prompts), *half the half-width of its 95 % t-interval, and the verdict
 * rpt_paired_verdict's; VS_NONE when there is nothing to pair (u is random or full, no random run
 * at u's target, or either lacks per-prompt KL for the same prompts). */
enum versus rpt_versus_random(const struct report *r, const struct run *u, double *mean,
                              double *half)
{
    *mean = *half = NAN;
    const struct run *rnd = is_reference(r, u) ? NULL : rpt_random_at(r, u->retention);
    if (!rnd || rnd == u || !u->pp_kl || !rnd->pp_kl || u->n_pp != rnd->n_pp)
        return VS_NONE;
    kvcap_report_paired(u->pp_kl, rnd->pp_kl, u->n_pp, 0, mean, half);
    return isfinite(*mean) && isfinite(*half) ? rpt_paired_verdict(*mean, *half) : VS_NONE;
}
