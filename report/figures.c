/* figures.c — the HTML page's figures, inline SVG drawn here: fidelity vs realised retention,
 * task accuracy by depth, the per-layer heatmap, KVCapsule's masks, bytes and time bars. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "report/report_internal.h"

/* ---- SVG plotting helpers ------------------------------------------------------------------ */

struct axis {
    double lo, hi;     /* the range drawn */
    double t0, t1;     /* linear: first and last tick, inside [lo, hi] */
    double step;       /* linear: tick spacing */
    int log;           /* ticks at powers of ten instead */
    double p0, p1;     /* pixel positions of lo and hi */
};

static double nice_step(double raw)
{
    double mag = pow(10, floor(log10(raw))), f = raw / mag;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * mag;
}

/* Linear axis over [lo, hi] widened to whole ticks, about `target` intervals. */
static void axis_linear(struct axis *a, double lo, double hi, int target)
{
    if (!(hi > lo)) {
        double pad = lo != 0 ? fabs(lo) * 0.05 : 1;
        lo -= pad;
        hi += pad;
    }
    double s = nice_step((hi - lo) / target);
    a->lo = a->t0 = floor(lo / s + 1e-9) * s;
    a->hi = a->t1 = ceil(hi / s - 1e-9) * s;
    a->step = s;
    a->log = 0;
}

/* Linear axis hugging the data: [lo, hi] plus `pad` of the range on each side, ticks inside. */
static void axis_tight(struct axis *a, double lo, double hi, int target, double pad)
{
    axis_linear(a, lo, hi, target);
    if (hi > lo) {
        a->t0 = ceil(lo / a->step - 1e-9) * a->step;
        a->t1 = floor(hi / a->step + 1e-9) * a->step;
        a->lo = lo - pad * (hi - lo);
        a->hi = hi + pad * (hi - lo);
    }
}

/* Log axis a little wider than the data, widened to whole decades when fewer than two powers
 * of ten would fall inside. */
static void axis_log(struct axis *a, double lo, double hi)
{
    a->lo = lo / 1.6;
    a->hi = hi * 1.6;
    if (floor(log10(a->hi)) - ceil(log10(a->lo)) < 1) {
        a->lo = pow(10, floor(log10(lo) + 1e-9));
        a->hi = pow(10, ceil(log10(hi) - 1e-9));
        if (a->hi <= a->lo * 10)
            a->hi = a->lo * 100;
    }
    a->log = 1;
    a->step = 0;
}

static double axis_px(const struct axis *a, double v)
{
    double t = a->log ? (log10(v) - log10(a->lo)) / (log10(a->hi) - log10(a->lo))
                      : (v - a->lo) / (a->hi - a->lo);
    return a->p0 + t * (a->p1 - a->p0);
}

static int tick_decimals(double step)
{
    int d = 0;
    while (d < 8 && fabs(step * pow(10, d) - round(step * pow(10, d))) > 1e-6 * step * pow(10, d))
        d++;
    return d;
}

/* Number of linear ticks and the k-th tick value (snapped so that 0 prints as 0). */
static int tick_count(const struct axis *a)
{
    return (int)floor((a->t1 - a->t0) / a->step + 1e-6) + 1;
}

static double tick_value(const struct axis *a, int k)
{
    double v = a->t0 + k * a->step;
    return fabs(v) < a->step * 1e-6 ? 0 : v;
}

/* Tick label of a log axis: 10 with a superscript exponent. */
static void log_label(struct buf *b, int e)
{
    bprintf(b, "10<tspan dy=\"-6\" font-size=\"10\">%s%d</tspan>", e < 0 ? "&minus;" : "", abs(e));
}

/* Horizontal gridlines with labels on the left, for a vertical axis (p0 bottom, p1 top). */
static void y_grid(struct buf *b, const struct axis *a, double x, double w, const char *suffix)
{
    if (a->log) {
        int e0 = (int)floor(log10(a->lo) + 1e-9), e1 = (int)floor(log10(a->hi) + 1e-9);
        for (int e = e0; e <= e1; e++) {
            double v = pow(10, e), y = axis_px(a, v);
            if (v >= a->lo * (1 - 1e-9)) {
                bprintf(b, "<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" "
                           "y2=\"%.1f\"/>",
                        x, x + w, y, y);
                bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">",
                        x - 6, y + 4);
                log_label(b, e);
                bputs(b, "</text>\n");
            }
            for (int m = 2; m <= 9; m++) {
                if (v * m <= a->lo || v * m >= a->hi)
                    continue;
                double ym = axis_px(a, v * m);
                bprintf(b, "<line class=\"grid minor\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" "
                           "y2=\"%.1f\"/>",
                        x, x + w, ym, ym);
            }
        }
        return;
    }
    int dec = tick_decimals(a->step), n = tick_count(a);
    for (int k = 0; k < n; k++) {
        double v = tick_value(a, k), y = axis_px(a, v);
        bprintf(b, "<line class=\"grid%s\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>",
                v == 0 && a->lo < 0 ? " zero" : "", x, x + w, y, y);
        bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s%.*f%s</text>\n",
                x - 6, y + 4, v < 0 ? "&minus;" : "", dec, fabs(v), suffix);
    }
}

/* Vertical gridlines with labels below, for a horizontal linear axis. */
static void x_grid(struct buf *b, const struct axis *a, double y, double h, const char *suffix)
{
    int dec = tick_decimals(a->step), n = tick_count(a);
    for (int k = 0; k < n; k++) {
        double v = tick_value(a, k), x = axis_px(a, v);
        bprintf(b, "<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>", x, x,
                y, y + h);
        bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.*f%s</text>\n",
                x, y + h + 16, dec, v, suffix);
    }
}

/* One marker: circle, square, triangle, diamond or inverted triangle; `hollow` (kvcap's
 * extensions) draws the outline only. Leaves the element open for a <title>; close it with
 * marker_end(). */
static void marker(struct buf *b, int shape, double x, double y, const char *color, int hollow)
{
    const double s = hollow ? 4.0 : 4.6;
    const char *fill = hollow ? "#fff" : color;
    switch (shape) {
    case 0:
        bprintf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"%.1f\" fill=\"%s\"", x, y, s, fill);
        break;
    case 1:
        bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"",
                x - s * 0.85, y - s * 0.85, s * 1.7, s * 1.7, fill);
        break;
    case 2:
        bprintf(b, "<path d=\"M%.1f %.1fl%.1f %.1fh%.1fz\" fill=\"%s\"", x, y - s * 1.1, s * 1.1,
                s * 1.9, -s * 2.2, fill);
        break;
    case 3:
        bprintf(b, "<path d=\"M%.1f %.1fl%.1f %.1fl%.1f %.1fl%.1f %.1fz\" fill=\"%s\"", x,
                y - s * 1.2, s * 1.2, s * 1.2, -s * 1.2, s * 1.2, -s * 1.2, -s * 1.2, fill);
        break;
    default:
        bprintf(b, "<path d=\"M%.1f %.1fl%.1f %.1fh%.1fz\" fill=\"%s\"", x, y + s * 1.1, s * 1.1,
                -s * 1.9, -s * 2.2, fill);
        break;
    }
    if (hollow)
        bprintf(b, " stroke=\"%s\" stroke-width=\"2\">", color);
    else
        bputs(b, " stroke=\"#fff\" stroke-width=\"1\">");
}

static void marker_end(struct buf *b, int shape)
{
    bputs(b, shape == 0 ? "</circle>" : shape == 1 ? "</rect>" : "</path>");
}

static double approx_text_width(const char *s, double font_px)
{
    size_t chars = 0;
    for (; *s; s++)
        chars += ((unsigned char)*s & 0xC0) != 0x80; /* UTF-8 lead bytes */
    return (double)chars * font_px * 0.58;
}

/* ---- HTML: fidelity vs realised retention -------------------------------------------------- */

enum metric { M_TASK, M_KL, M_NLL_DELTA, M_NEXT_TOKEN, M_AGREEMENT, M_COS_GAP };

/* Where a run sits on the memory axis: its realised retention, or its target when the metrics
 * have none. Plots use it for x, the summary shows it. */
static double realised_or_target(const struct run *u)
{
    return isfinite(u->realised) ? u->realised : u->retention;
}

static double metric_value(const struct run *u, enum metric m)
{
    switch (m) {
    case M_TASK: return 100 * u->task_accuracy;
    case M_KL: return u->kl > 0 ? u->kl : NAN; /* not on a log axis */
    case M_NLL_DELTA: return u->nll_delta;
    case M_NEXT_TOKEN: return 100 * u->next_token_agreement;
    case M_AGREEMENT: return 100 * u->token_agreement;
    case M_COS_GAP: {
        double g = 1 - u->cos_mean;
        return g > 0 ? g : NAN;
    }
    }
    return NAN;
}

struct panel_spec {
    enum metric m;
    const char *title, *ylabel, *better;
};

/* One plot at (px, py) of outer size pw x ph: title, axes, full's reference line where it has a
 * value on the axis, a polyline and markers per curve, x at realised retention. */
static void fidelity_panel(struct buf *b, const struct report *r, const struct panel_spec *ps,
                           const struct axis *xa_in, double px, double py, double pw, double ph)
{
    const double ml = 64, mr = 16, mt = 34, mb = 50;
    double x = px + ml, y = py + mt, w = pw - ml - mr, h = ph - mt - mb;
    bprintf(b, "<text class=\"ptitle\" x=\"%.1f\" y=\"%.1f\">", x, py + 14);
    besc(b, ps->title);
    bprintf(b, "</text><text class=\"better\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">",
            x + w, py + 14);
    besc(b, ps->better);
    bputs(b, "</text>\n");

    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = &r->runs[i];
        double v = metric_value(u, ps->m);
        if (!is_reference(r, u) && isfinite(v)) {
            lo = fmin(lo, v);
            hi = fmax(hi, v);
        }
    }
    if (!(hi >= lo)) {
        bprintf(b, "<rect class=\"frame\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/>"
                   "<text class=\"nodata\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">"
                   "not measured</text>\n",
                x, y, w, h, x + w / 2, y + h / 2);
        return;
    }
    const struct run *full = rpt_full_run(r);
    struct axis ya, xa = *xa_in;
    double ref = NAN;
    if (ps->m == M_TASK) {
        ref = full ? 100 * full->task_accuracy : NAN;
        axis_linear(&ya, 0, 100, 5);
    } else if (ps->m == M_AGREEMENT || ps->m == M_NEXT_TOKEN) {
        ref = full ? 100 : NAN;
        axis_tight(&ya, fmin(lo, 95), 100, 5, 0.04); /* at least 5 points, none above 100 */
    } else if (ps->m == M_NLL_DELTA) {
        ref = full ? 0 : NAN;
        axis_tight(&ya, fmin(lo, 0), fmax(hi, 0), 5, 0.04);
    } else {
        axis_log(&ya, lo, hi);
    }
    ya.p0 = y + h;
    ya.p1 = y;
    xa.p0 = x;
    xa.p1 = x + w;

    y_grid(b, &ya, x, w, "");
    x_grid(b, &xa, y, h, "");
    bprintf(b, "<rect class=\"frame\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/>\n", x,
            y, w, h);
    bprintf(b, "<text class=\"alabel\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">"
               "realised retention (share of the span held)</text>\n",
            x + w / 2, y + h + 38);
    bprintf(b, "<text class=\"alabel\" transform=\"translate(%.1f %.1f) rotate(-90)\" "
               "text-anchor=\"middle\">",
            px + 16, y + h / 2);
    besc(b, ps->ylabel);
    bputs(b, "</text>\n");

    if (isfinite(ref)) {
        double yr = axis_px(&ya, ref);
        bprintf(b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                   "stroke-width=\"1.6\" stroke-dasharray=\"6 4\"/>"
                   "<text class=\"reflabel\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">full",
                x, x + w, yr, yr, REFERENCE_COLOR, x + w - 4, yr + (yr - y < 16 ? 14 : -5));
        if (ps->m == M_TASK)
            bprintf(b, " %.1f%%", ref);
        bputs(b, "</text>\n");
    }
    for (int c = 0; c < r->n_curves; c++) {
        const struct curve *cv = &r->curves[c];
        if (cv->reference)
            continue;
        int n = 0;
        bprintf(b, "<g><polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%s\"%s points=\"",
                cv->color, cv->extension ? "1.8" : "2.2",
                cv->extension ? " stroke-dasharray=\"5 3\"" : "");
        for (int i = 0; i < r->n_runs; i++) {
            const struct run *u = r->sorted[i];
            double v = metric_value(u, ps->m);
            if (u->curve != c || !isfinite(v))
                continue;
            bprintf(b, "%s%.1f,%.1f", n++ ? " " : "", axis_px(&xa, realised_or_target(u)),
                    axis_px(&ya, v));
        }
        bputs(b, "\"/>");
        for (int i = 0; i < r->n_runs; i++) {
            const struct run *u = r->sorted[i];
            double v = metric_value(u, ps->m);
            if (u->curve != c || !isfinite(v))
                continue;
            marker(b, cv->marker, axis_px(&xa, realised_or_target(u)), axis_px(&ya, v),
                   cv->color, cv->extension);
            bputs(b, "<title>");
            rpt_run_name(b, u);
            bprintf(b, " (realised %.3f): %.4g</title>", realised_or_target(u), v);
            marker_end(b, cv->marker);
        }
        bputs(b, "</g>\n");
    }
}

/* Width of one legend item. */
static double legend_item(const struct curve *cv)
{
    return 34 + approx_text_width(cv->label, 13) + (cv->reference ? 80 : 0) + 26;
}

/* Legend items left to right, wrapping at `width`: the papers' methods on one line (or more),
 * kvcap's extensions on the next; returns the height used. */
static double curve_legend(struct buf *b, const struct report *r, double x0, double y0,
                           double width, int emit)
{
    const double head = 150;
    double x = x0 + head, y = y0 + 12;
    int group = -1;
    for (int c = 0; c < r->n_curves; c++) {
        const struct curve *cv = &r->curves[c];
        int g = cv->extension ? 1 : 0;
        if (g != group) {
            if (group >= 0)
                y += 24;
            x = x0 + head;
            group = g;
            if (emit)
                bprintf(b, "<text class=\"legend lhead\" x=\"%.1f\" y=\"%.1f\">%s</text>\n", x0,
                        y + 4.5, g ? "kvcap&#8217;s extensions" : "papers&#8217; methods");
        }
        double item = legend_item(cv);
        if (x > x0 + head && x + item > x0 + width) {
            x = x0 + head;
            y += 24;
        }
        if (emit) {
            bprintf(b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                       "stroke-width=\"%s\"%s/>",
                    x, x + 28, y, y, cv->color,
                    cv->reference ? "1.6" : cv->extension ? "1.8" : "2.2",
                    cv->reference   ? " stroke-dasharray=\"6 4\""
                    : cv->extension ? " stroke-dasharray=\"5 3\""
                                    : "");
            if (!cv->reference) {
                marker(b, cv->marker, x + 14, y, cv->color, cv->extension);
                marker_end(b, cv->marker);
            }
            bprintf(b, "<text class=\"legend\" x=\"%.1f\" y=\"%.1f\">", x + 34, y + 4.5);
            besc(b, cv->label);
            bprintf(b, "%s</text>\n", cv->reference ? " (reference)" : "");
        }
        x += item;
    }
    return y - y0 + 14;
}

void rpt_render_fidelity(struct buf *b, const struct report *r)
{
    static const struct panel_spec panels[] = {
        {M_TASK, "Task accuracy (key-value retrieval)", "task accuracy (%)", "higher is better"},
        {M_KL, "KL divergence from full (teacher-forced)", "KL (nats/token, log scale)",
         "lower is better"},
        {M_NLL_DELTA, "NLL change vs full", "\xce\x94NLL (nats/token)", "lower is better"},
        {M_NEXT_TOKEN, "Next-token agreement (teacher-forced)", "next-token agreement (%)",
         "higher is better"},
        {M_AGREEMENT, "Greedy agreement with full (secondary)", "greedy token agreement (%)",
         "higher is better"},
        {M_COS_GAP, "Attention output drift (replayed decode steps)",
         "1 \xe2\x88\x92 cosine (mean over layers)", "lower is better"},
    };
    enum { N_PANELS = sizeof panels / sizeof panels[0] };
    /* A 2-column grid: task accuracy and KL first, the per-token measures next, greedy
     * agreement and attention drift last. */
    const double W = 1256, PH = 330, ROW = PH + 16;
    double rlo = INFINITY, rhi = -INFINITY;
    for (int i = 0; i < r->n_runs; i++)
        if (!is_reference(r, &r->runs[i])) {
            rlo = fmin(rlo, realised_or_target(&r->runs[i]));
            rhi = fmax(rhi, realised_or_target(&r->runs[i]));
        }
    bputs(b, "<section>\n<h2>Fidelity vs realised retention</h2>\n");
    if (!(rhi >= rlo)) {
        bputs(b, "<p class=\"caption\">No compressed runs to plot.</p>\n</section>\n");
        return;
    }
    /* A little room past the first and last tick so that markers clear the frame. */
    struct axis xa;
    axis_linear(&xa, rlo, rhi, 5);
    double pad = (xa.hi - xa.lo) * 0.06;
    xa.lo -= pad;
    xa.hi += pad;

    double lh = curve_legend(b, r, 0, 0, W - 20, 0);
    int rows = (N_PANELS + 1) / 2;
    double H = lh + 8 + (rows - 1) * ROW + PH;
    bprintf(b, "<figure>\n<svg class=\"fig\" width=\"%.0f\" "
               "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" "
               "aria-label=\"fidelity vs realised retention\">\n",
            W, H, W, H);
    curve_legend(b, r, 10, 0, W - 20, 1);
    for (int k = 0; k < N_PANELS; k++)
        fidelity_panel(b, r, &panels[k], &xa, (k % 2) * W / 2, lh + 8 + (k / 2) * ROW, W / 2,
                       PH);
    bputs(b, "</svg>\n<figcaption>One line per policy across its budgets, each point at the "
             "share of the span the run really held (hover a marker for its value); kvcap's "
             "extensions are dashed with hollow markers, and one that varies a single paper's "
             "method shares its colour. The dashed black line is full: its task accuracy (the "
             "ceiling), &Delta;NLL 0, 100&nbsp;% agreement; KL is on a log scale (full's is 0). "
             "Task accuracy: answers equal to the true value. KL and &Delta;NLL: per held-out "
             "token, teacher-forced. Next-token agreement: share of those positions whose most "
             "likely token is full's. Greedy agreement cascades after the first differing token. "
             "Attention drift: 1 &minus; cosine of attention outputs against full's on replayed "
             "decode steps (full's own queries and K/V). Runs without a measurement are left out "
             "of that panel.</figcaption>\n</figure>\n</section>\n");
}

/* ---- HTML: task accuracy by depth ---------------------------------------------------------- */

/* The depth table shows, per policy, the run whose target is nearest this. */
static const double DEPTH_RETENTION = 0.4;

/* Pale red (0) through pale yellow to green (1), dark text stays readable on each. */
static void accuracy_color(double t, char out[8])
{
    static const unsigned char stops[3][3] = {{244, 199, 195}, {252, 232, 178}, {140, 205, 160}};
    t = t < 0 ? 0 : t > 1 ? 1 : t;
    int i = t < 0.5 ? 0 : 1;
    double f = (t - 0.5 * i) * 2;
    int c[3];
    for (int k = 0; k < 3; k++)
        c[k] = (int)lround(stops[i][k] + f * (stops[i + 1][k] - stops[i][k]));
    snprintf(out, 8, "#%02x%02x%02x", c[0], c[1], c[2]);
}

static void depth_cell(struct buf *b, double v)
{
    char col[8];
    if (!isfinite(v)) {
        rpt_na_cell(b);
        return;
    }
    accuracy_color(v, col);
    bprintf(b, "<td style=\"background:%s\">%.0f&nbsp;%%</td>", col, 100 * v);
}

void rpt_render_depths(struct buf *b, const struct report *r)
{
    int n_bins = r->n_depths;
    for (int i = 0; i < r->n_runs; i++)
        if (r->runs[i].n_task_depth > n_bins)
            n_bins = r->runs[i].n_task_depth;
    if (!n_bins)
        return;
    /* The target nearest DEPTH_RETENTION (the lower one on a tie). */
    double t = NAN;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (is_reference(r, u) || !u->task_depth)
            continue;
        double dt = fabs(u->retention - DEPTH_RETENTION), dc = fabs(t - DEPTH_RETENTION);
        if (isnan(t) || dt < dc - 1e-12 || (fabs(dt - dc) <= 1e-12 && u->retention < t))
            t = u->retention;
    }
    const struct run *full = rpt_full_run(r);
    bprintf(b, "<section>\n<h2>Task accuracy by depth</h2>\n<p class=\"caption\">Retrieval "
               "accuracy by where the asked line sits in the span (0&nbsp;%% = its start), for "
               "each policy's run at target retention %.2f",
            t);
    bputs(b, " and for full; each cell is the share of the queries in that depth bin answered "
             "correctly");
    if (isfinite(r->task_queries) && r->n_depths)
        bprintf(b, " (about %.3g queries per bin: read small differences with care)",
                r->task_queries / r->n_depths);
    bputs(b, ". A policy that keeps only recent tokens fails at shallow depths; one "
             "that keeps the wrong tokens fails everywhere.</p>\n<div class=\"table-wrap\">"
             "<table class=\"depth\">\n<thead><tr><th class=\"l\">Policy</th>"
             "<th>Realised<br>retention</th>");
    for (int k = 0; k < n_bins; k++) {
        if (k < r->n_depths)
            bprintf(b, "<th>%.0f&nbsp;%%<br><span class=\"unit\">depth</span></th>",
                    100 * r->task_depths[k]);
        else
            bprintf(b, "<th>bin %d</th>", k + 1);
    }
    bputs(b, "<th>All<br><span class=\"unit\">depths</span></th></tr></thead>\n<tbody>\n");
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (!u->task_depth || (u != full && (is_reference(r, u) || u->retention != t)))
            continue;
        bprintf(b, "<tr class=\"%s\" title=\"", u == full ? "ceiling" : "rk");
        besc(b, u->id);
        bputs(b, "\"><td class=\"l\">");
        rpt_policy_name(b, r, u);
        if (isfinite(u->realised))
            bprintf(b, "</td><td%s>%.1f&nbsp;%%</td>", off_target(u) ? " class=\"off\"" : "",
                    100 * u->realised);
        else
            bputs(b, "</td><td class=\"na\">&mdash;</td>");
        for (int k = 0; k < n_bins; k++)
            depth_cell(b, k < u->n_task_depth ? u->task_depth[k] : NAN);
        depth_cell(b, u->task_accuracy);
        bputs(b, "</tr>\n");
    }
    bputs(b, "</tbody></table></div>\n</section>\n");
}

/* ---- HTML: per-layer heatmap --------------------------------------------------------------- */

/* ColorBrewer YlOrRd: light = small error, dark red = large. */
static void ramp_color(double t, char out[8])
{
    static const unsigned char stops[9][3] = {
        {255, 255, 204}, {255, 237, 160}, {254, 217, 118}, {254, 178, 76}, {253, 141, 60},
        {252, 78, 42},   {227, 26, 28},   {189, 0, 38},    {128, 0, 38}};
    t = t < 0 ? 0 : t > 1 ? 1 : t;
    double pos = t * 8;
    int i = (int)floor(pos);
    if (i >= 8)
        i = 7;
    double f = pos - i;
    int c[3];
    for (int k = 0; k < 3; k++)
        c[k] = (int)lround(stops[i][k] + f * (stops[i + 1][k] - stops[i][k]));
    snprintf(out, 8, "#%02x%02x%02x", c[0], c[1], c[2]);
}

/* Width of the run-name column of the heatmap and the bars. */
static double name_column(const struct report *r)
{
    double w = 120;
    for (int i = 0; i < r->n_runs; i++)
        w = fmax(w, approx_text_width(r->runs[i].label, 12.5) +
                        approx_text_width(" @ 0.00", 12.5) + 30);
    return fmin(w, 400);
}

void rpt_render_heatmap(struct buf *b, const struct report *r)
{
    bputs(b, "<section>\n<h2>Per-layer attention error</h2>\n");
    int rows = 0, groups = 0, prev = -1;
    double lo = INFINITY, hi = 0;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (!u->rel || is_reference(r, u))
            continue;
        rows++;
        groups += u->curve != prev;
        prev = u->curve;
        for (int l = 0; l < r->n_layers; l++) {
            if (u->rel[l] > 0)
                lo = fmin(lo, u->rel[l]);
            hi = fmax(hi, u->rel[l]);
        }
    }
    if (!rows) {
        bputs(b, "<p class=\"caption\">No compressed run has per-layer attention errors "
                 "(attn_rel_err).</p>\n</section>\n");
        return;
    }
    int log_scale = isfinite(lo) && hi / lo >= 10;
    if (!log_scale) {
        lo = 0;
        if (!(hi > 0))
            hi = 1;
    }
    const double W = 1256, RH = 19, GAP = 6, top = 44;
    double nc = name_column(r), cw = fmin(36, (W - nc - 20) / r->n_layers);
    double gw = cw * r->n_layers, H = top + rows * RH + (groups - 1) * GAP + 86;
    bprintf(b, "<figure>\n<svg class=\"fig\" width=\"%.0f\" "
               "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" "
               "aria-label=\"per-layer attention error\">\n",
            W, H, W, H);
    bprintf(b, "<text class=\"alabel\" x=\"%.1f\" y=\"14\" text-anchor=\"middle\">layer</text>\n",
            nc + gw / 2);
    int every = cw >= 16 ? 1 : cw >= 7 ? 5 : 10;
    for (int l = 0; l < r->n_layers; l++)
        if (l % every == 0 || l == r->n_layers - 1)
            bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>",
                    nc + (l + 0.5) * cw, top - 8, l);
    bputs(b, "\n");
    double y = top;
    prev = -1;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (!u->rel || is_reference(r, u))
            continue;
        if (prev >= 0 && u->curve != prev)
            y += GAP;
        prev = u->curve;
        bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"5\" height=\"%.1f\" fill=\"%s\"/>", nc - 10,
                y + 1, RH - 2, r->curves[u->curve].color);
        bprintf(b, "<text class=\"rlabel\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", nc - 16,
                y + RH / 2 + 4.5);
        rpt_run_name(b, u);
        bputs(b, "</text>\n");
        for (int l = 0; l < r->n_layers; l++) {
            double v = u->rel[l], t;
            if (log_scale)
                t = v > 0 ? (log(v) - log(lo)) / (log(hi) - log(lo)) : 0;
            else
                t = v / hi;
            char col[8];
            ramp_color(t, col);
            bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\">"
                       "<title>",
                    nc + l * cw, y, cw - 1, RH - 1, col);
            rpt_run_name(b, u);
            bprintf(b, ", layer %d: relative error %.4g</title></rect>", l, v);
        }
        bputs(b, "\n");
        y += RH;
    }
    /* Colour legend: a gradient bar with its end values (and the middle of the scale). */
    double ly = y + 30, lw = 360;
    bputs(b, "<defs><linearGradient id=\"ramp\" x1=\"0\" x2=\"1\" y1=\"0\" y2=\"0\">");
    for (int k = 0; k <= 8; k++) {
        char col[8];
        ramp_color(k / 8.0, col);
        bprintf(b, "<stop offset=\"%.3f\" stop-color=\"%s\"/>", k / 8.0, col);
    }
    bputs(b, "</linearGradient></defs>\n");
    /* The label right of the bar: left of it, a narrow name column would clip it. */
    bprintf(b, "<text class=\"alabel\" x=\"%.1f\" y=\"%.1f\">attention relative error%s</text>",
            nc + lw + 16, ly + 12, log_scale ? " (log colour scale)" : "");
    bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"16\" fill=\"url(#ramp)\" "
               "stroke=\"#999\" stroke-width=\"0.5\"/>",
            nc, ly, lw);
    double mid = log_scale ? sqrt(lo * hi) : (lo + hi) / 2;
    bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">min %.3g</text>", nc, ly + 32, lo);
    bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.3g</text>",
            nc + lw / 2, ly + 32, mid);
    bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">max %.3g</text>\n",
            nc + lw, ly + 32, hi);
    bputs(b, "</svg>\n<figcaption>Rows are compressed runs (the full cache is the reference and "
             "has no error), columns are layers; a cell is the mean relative L2 error of that "
             "layer's attention output against full's on replayed decode steps (full's own "
             "queries and K/V, so errors do not cascade). Look for rows that "
             "stay pale across every layer, and for layers that are dark in every row: those "
             "are where compression hurts.</figcaption>\n</figure>\n</section>\n");
}

/* ---- HTML: KVCapsule masks ----------------------------------------------------------------- */

/* Cell colour for `k` of `heads` heads keeping a token: white (none) to dark blue (all). */
static void shade_color(int k, int heads, char out[8])
{
    static const int lo[3] = {214, 226, 243}, hi[3] = {16, 52, 110};
    double t = heads > 1 ? (double)(k - 1) / (heads - 1) : 1;
    int c[3];
    for (int j = 0; j < 3; j++)
        c[j] = (int)lround(lo[j] + t * (hi[j] - lo[j]));
    snprintf(out, 8, "#%02x%02x%02x", c[0], c[1], c[2]);
}

/* A panel draws at most this many columns (one pixel each at the narrowest) and rows: longer
 * spans and deeper models are binned, each cell showing the mean over its tokens and layers.
 * Only cells holding a kept token are visited, so a panel costs O(kept · log kept) plus a few
 * kilobytes of axes and key, whatever n_tokens and layers the file declares. At most
 * MASK_MAX_PANELS buckets are drawn: a page of more is not read, and each adds fixed work. */
enum { MASK_MAX_COLUMNS = 1192, MASK_MAX_ROWS = 160, MASK_MAX_SHADES = 32, MASK_MAX_PANELS = 16 };

/* Binning i of [0, n) into `bins` (<= n) parts, part b being [b·n/bins, (b+1)·n/bins): the part
 * holding i, and where part b starts. */
static int bin_of(int i, int n, int bins)
{
    return (int)(((int64_t)(i + 1) * bins - 1) / n);
}

static int bin_start(int b, int n, int bins)
{
    return (int)((int64_t)b * n / bins);
}

/* Shade level of a cell whose tokens are kept by `mean` heads on average (of `heads`), in
 * 0 (no head keeps any of its tokens) .. levels. With one token per cell and at most
 * MASK_MAX_SHADES heads the level is the count itself. */
static int mask_level(double mean, int heads, int levels)
{
    if (mean <= 0)
        return 0;
    int k = (int)lround(mean / heads * levels);
    return k < 1 ? 1 : k > levels ? levels : k;
}

/* Columns [c, e) of panel row y share shade level k. */
struct shade_run {
    int y, c, e, k;
};

static void render_mask(struct buf *b, const struct report *r, const struct mask *m)
{
    const double W = 1256, lm = 64, top = 40;
    int n = m->n_tokens, L = r->n_layers;
    int cols = n < MASK_MAX_COLUMNS ? n : MASK_MAX_COLUMNS;
    int rows = L < MASK_MAX_ROWS ? L : MASK_MAX_ROWS;
    int levels = m->heads < MASK_MAX_SHADES ? m->heads : MASK_MAX_SHADES;
    double rh = rows == L ? 7 : fmax(2, 7.0 * MASK_MAX_ROWS / 2 / rows);
    double cw = fmin(8, (W - lm - 20) / cols);
    if (cw >= 1)
        cw = floor(cw * 4) / 4; /* whole quarter pixels keep the columns crisp */
    double gw = cw * cols, gh = rh * rows;
    double H = top + gh + 62;
    double per_head = (double)m->n_kept / ((double)L * m->heads);

    /* the cells: mean count over the tokens [c·n/cols, (c+1)·n/cols) of layers
     * [y·L/rows, (y+1)·L/rows); per row, its layers' kept tokens mapped to columns and sorted,
     * then the runs of equal shade along the row, left to right (at most one per kept token) */
    int *in_col = malloc((m->n_kept + 1) * sizeof *in_col);
    struct shade_run *run = malloc((m->n_kept + 1) * sizeof *run);
    if (!in_col || !run) {
        free(in_col), free(run);
        b->failed = 1;
        return;
    }
    size_t n_run = 0;
    for (int y = 0; y < rows; y++) {
        int l0 = bin_start(y, L, rows), l1 = bin_start(y + 1, L, rows);
        const size_t from = m->layer_at[l0], to = m->layer_at[l1];
        for (size_t j = from; j < to; j++)
            in_col[j - from] = bin_of(m->tok[j], n, cols);
        qsort(in_col, to - from, sizeof *in_col, cmp_int);
        const size_t row_start = n_run;
        for (size_t j = 0; j < to - from;) {
            const int c = in_col[j];
            size_t e = j;
            while (e < to - from && in_col[e] == c)
                e++;
            int t0 = bin_start(c, n, cols), t1 = bin_start(c + 1, n, cols);
            double cells = (double)(t1 - t0) * (l1 - l0);
            int k = mask_level((double)(e - j) / cells, m->heads, levels);
            if (n_run > row_start && run[n_run - 1].e == c && run[n_run - 1].k == k)
                run[n_run - 1].e = c + 1;
            else
                run[n_run++] = (struct shade_run){y, c, c + 1, k};
            j = e;
        }
    }
    free(in_col);

    bputs(b, "<figure class=\"mask-panel\">\n<h3>");
    besc(b, m->bucket);
    bprintf(b, " <span class=\"unit\">&middot; %d tokens &middot; %d head%s &middot; on average "
               "%.1f tokens (%.1f&nbsp;%%) kept per layer and head</span></h3>\n",
            n, m->heads, m->heads == 1 ? "" : "s", per_head, 100 * per_head / n);
    bprintf(b, "<svg class=\"fig\" width=\"%.0f\" "
               "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" aria-label=\"key masks of ",
            W, H, W, H);
    besc(b, m->bucket);
    bputs(b, "\">\n");
    bprintf(b, "<text class=\"alabel\" x=\"%.1f\" y=\"14\" text-anchor=\"middle\">token index"
               "</text>\n",
            lm + gw / 2);
    double tw = gw / n; /* width of one token */
    int step = 1;
    while (n / step > 16 || step * tw < 28)
        step *= 2;
    for (int t = 0; t <= n; t += step)
        bprintf(b, "<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>"
                   "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>",
                lm + t * tw, lm + t * tw, top - 4, top + gh, lm + t * tw, top - 8, t);
    bprintf(b, "\n<text class=\"alabel\" transform=\"translate(14 %.1f) rotate(-90)\" "
               "text-anchor=\"middle\">layer</text>\n",
            top + gh / 2);
    int lstep = 5;
    while (L / lstep > 32)
        lstep *= 2;
    for (int l = 0; l < L; l += lstep)
        bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%d</text>",
                lm - 6, top + ((double)l / L * rows + 0.5) * rh + 4, l);
    bprintf(b, "\n<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#fff\" "
               "stroke=\"#9aa3b0\" stroke-width=\"0.8\"/>\n",
            lm, top, gw, gh);
    /* One path per shade; a run of equal shades along a row is one rectangle. */
    double gap = rh > 3 ? 1 : 0;
    for (int k = 1; k <= levels; k++) {
        char col[8];
        shade_color(k, levels, col);
        bprintf(b, "<path fill=\"%s\" d=\"", col);
        for (size_t j = 0; j < n_run; j++)
            if (run[j].k == k)
                bprintf(b, "M%.2f %.1fh%.2fv%.1fh%.2fz", lm + run[j].c * cw, top + run[j].y * rh,
                        (run[j].e - run[j].c) * cw, rh - gap, -(run[j].e - run[j].c) * cw);
        bputs(b, "\"/>\n");
    }
    free(run);
    /* Shade key below the grid. */
    double kx = lm, ky = top + gh + 22;
    bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">kept by:</text>", kx, ky + 11);
    kx += 62;
    int keys = m->heads <= 8 ? m->heads : 1;
    for (int j = 0; j <= keys; j++) {
        int k = m->heads <= 8 ? j : j * m->heads;
        char col[8];
        if (k == 0)
            snprintf(col, sizeof col, "#ffffff");
        else
            shade_color(mask_level(k, m->heads, levels), levels, col);
        bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"16\" height=\"14\" fill=\"%s\" "
                   "stroke=\"#9aa3b0\" stroke-width=\"0.8\"/><text class=\"tick\" x=\"%.1f\" "
                   "y=\"%.1f\">%d of %d head%s</text>",
                kx, ky, col, kx + 22, ky + 11, k, m->heads,
                m->heads == 1 ? "" : "s");
        kx += m->heads < 100 ? 130 : 170; /* room for "4096 of 4096 heads" */
    }
    if (cols < n || rows < L)
        bprintf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">each cell: the mean over about "
                   "%.0f token%s &times; %.0f layer%s</text>",
                kx + 8, ky + 11, (double)n / cols, cols < n ? "s" : "", (double)L / rows,
                rows < L ? "s" : "");
    bprintf(b, "\n</svg>\n<figcaption>Rows are layers, columns the %d token positions of the "
               "bucket in order (row-major over the grid); the shade is the fraction of the %d "
               "KV heads whose learned key mask keeps that token &mdash; white: dropped by every "
               "head, darkest: kept by all. Vertical stripes are tokens every layer "
               "keeps.</figcaption>\n</figure>\n",
            n, m->heads);
}

/* A photo panel draws at most this many cells a side (5 px each): a finer grid is binned, each
 * cell the mean over its tokens, so the panel stays a few thousand rectangles. */
enum { MASK_IMAGE_MAX_SIDE = 64 };

/* The share of (layer, head) pairs keeping each token, over the photo it came from: tokens
 * dropped by most heads are darkened, so the reader sees whether retention follows the image. */
static void render_mask_on_image(struct buf *b, const struct report *r, const struct mask *m)
{
    const int R = m->rows, C = m->cols, L = r->n_layers;
    const int BR = R < MASK_IMAGE_MAX_SIDE ? R : MASK_IMAGE_MAX_SIDE;
    const int BC = C < MASK_IMAGE_MAX_SIDE ? C : MASK_IMAGE_MAX_SIDE;
    const int binned = BR < R || BC < C;
    const double side = 320, cell = side / (C > R ? C : R); /* one token's side */
    /* each cell's mean share of the (layer, head) pairs keeping its tokens; the most-kept is
     * shown clear */
    double *share = calloc((size_t)BR * BC, sizeof *share), most = 0;
    if (!share) {
        b->failed = 1;
        return;
    }
    for (size_t j = 0; j < m->n_kept; j++)
        share[(size_t)bin_of(m->tok[j] / C, R, BR) * BC + bin_of(m->tok[j] % C, C, BC)] += 1;
    for (int by = 0; by < BR; by++)
        for (int bx = 0; bx < BC; bx++) {
            double tokens = (double)(bin_start(by + 1, R, BR) - bin_start(by, R, BR)) *
                            (bin_start(bx + 1, C, BC) - bin_start(bx, C, BC));
            double *v = &share[(size_t)by * BC + bx];
            *v = *v / ((double)L * m->heads * tokens);
            most = fmax(most, *v);
        }
    bputs(b, "<figure class=\"mask-image\">\n");
    bprintf(b, "<svg class=\"fig\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
               "role=\"img\" aria-label=\"key masks over the photo\">\n",
            cell * C, cell * R, cell * C, cell * R);
    bputs(b, "<image x=\"0\" y=\"0\" preserveAspectRatio=\"none\" ");
    bprintf(b, "width=\"%.1f\" height=\"%.1f\" href=\"", cell * C, cell * R);
    besc(b, m->thumb);
    bputs(b, "\"/>\n");
    for (int by = 0; by < BR; by++)
        for (int bx = 0; bx < BC; bx++) {
            const int y0 = bin_start(by, R, BR), y1 = bin_start(by + 1, R, BR);
            const int x0 = bin_start(bx, C, BC), x1 = bin_start(bx + 1, C, BC);
            const double kept = share[(size_t)by * BC + bx];
            bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                       "fill=\"#0b1a33\" fill-opacity=\"%.2f\" stroke=\"#ffffff\" "
                       "stroke-opacity=\"0.25\" stroke-width=\"0.5\"><title>",
                    x0 * cell, y0 * cell, (x1 - x0) * cell, (y1 - y0) * cell,
                    most > 0 ? 0.8 * (1 - kept / most) : 0.8);
            if (binned) {
                bprintf(b, "tokens in row%s %d", y1 - y0 > 1 ? "s" : "", y0);
                if (y1 - y0 > 1)
                    bprintf(b, "&ndash;%d", y1 - 1);
                bprintf(b, ", column%s %d", x1 - x0 > 1 ? "s" : "", x0);
                if (x1 - x0 > 1)
                    bprintf(b, "&ndash;%d", x1 - 1);
                bprintf(b, ": kept by %.0f%% of layer-heads on average", 100 * kept);
            } else
                bprintf(b, "token (%d, %d): kept by %.0f%% of layer-heads", y0, x0, 100 * kept);
            bputs(b, "</title></rect>");
        }
    free(share);
    bprintf(b, "\n</svg>\n<figcaption>The %d&thinsp;&times;&thinsp;%d tokens of a %s photo "
               "crop: the darker a cell, the fewer of the %d layers &times; %d KV heads keep that "
               "token's key (clear: the most-kept %s, %.0f&nbsp;%% of them).",
            R, C, r->calibration_photos ? "calibration" : "held-out", L, m->heads,
            binned ? "cell" : "token", 100 * most);
    if (binned)
        bprintf(b, " Each cell is the mean over about %.0f&thinsp;&times;&thinsp;%.0f tokens.",
                (double)R / BR, (double)C / BC);
    bputs(b, "</figcaption>\n</figure>\n");
}

void rpt_render_masks(struct buf *b, const struct report *r)
{
    if (!r->n_masks)
        return;
    bputs(b, "<section>\n<h2>KVCapsule retained-token masks</h2>\n<p class=\"caption\">Which "
             "tokens of a span KVCapsule's key masks keep, per bucket: each panel overlays the "
             "heads of every layer, so a reader can see whether retention follows the image "
             "structure or is spread evenly.</p>\n");
    const int shown = r->n_masks < MASK_MAX_PANELS ? r->n_masks : MASK_MAX_PANELS;
    if (shown < r->n_masks)
        bprintf(b, "<p class=\"caption\"><strong>The first %d of the %d buckets are "
                   "drawn</strong>: the masks of the other %d (masks[%d] on in the metrics file) "
                   "were checked but are left out to keep the page readable.</p>\n",
                shown, r->n_masks, r->n_masks - shown, shown);
    for (int i = 0; i < shown; i++) {
        render_mask(b, r, &r->masks[i]);
        if (r->masks[i].thumb)
            render_mask_on_image(b, r, &r->masks[i]);
    }
    bputs(b, "</section>\n");
}


/* ---- HTML: bytes and time bars ------------------------------------------------------------- */

static void bar_panel(struct buf *b, const struct report *r, int which, double x, double w,
                      double top, double rh, double gap, double h)
{
    const char *title = which == 0 ? "Bytes held after prefill (% of full)"
                                   : "Decode attention time per step (\xc3\x97 full)";
    double scale = which == 0 ? 100 : 1, hi = scale;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        double v = which == 0 ? ratio(u->bytes_held, u->bytes_held_full)
                              : ratio(u->step_ms, u->step_ms_full);
        if (isfinite(v))
            hi = fmax(hi, v * scale);
    }
    struct axis a;
    axis_linear(&a, 0, hi * 1.16, 5);
    a.p0 = x;
    a.p1 = x + w;
    bprintf(b, "<text class=\"ptitle\" x=\"%.1f\" y=\"%.1f\">%s</text>\n", x, top - 14, title);
    x_grid(b, &a, top, h, which == 0 ? "%" : "\xc3\x97");
    double xr = axis_px(&a, scale);
    bprintf(b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
               "stroke-width=\"1.4\" stroke-dasharray=\"5 4\"/>\n",
            xr, xr, top - 4, top + h, REFERENCE_COLOR);
    double y = top;
    int prev = -1;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (prev >= 0 && u->curve != prev)
            y += gap;
        prev = u->curve;
        double v = which == 0 ? ratio(u->bytes_held, u->bytes_held_full)
                              : ratio(u->step_ms, u->step_ms_full);
        if (isfinite(v)) {
            double bw = axis_px(&a, v * scale) - x;
            bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\">"
                       "<title>",
                    x, y + 3, bw, rh - 6, r->curves[u->curve].color);
            rpt_run_name(b, u);
            bputs(b, "</title></rect>");
            if (which == 0)
                bprintf(b, "<text class=\"val\" x=\"%.1f\" y=\"%.1f\">%.1f%%</text>\n",
                        x + bw + 5, y + rh / 2 + 4.5, 100 * v);
            else
                bprintf(b, "<text class=\"val\" x=\"%.1f\" y=\"%.1f\">%.2f&times;</text>\n",
                        x + bw + 5, y + rh / 2 + 4.5, v);
        } else {
            bprintf(b, "<text class=\"val na\" x=\"%.1f\" y=\"%.1f\">not measured</text>\n",
                    x + 5, y + rh / 2 + 4.5);
        }
        y += rh;
    }
}

void rpt_render_bars(struct buf *b, const struct report *r)
{
    const double W = 1256, RH = 21, GAP = 6, top = 40;
    double nc = name_column(r);
    int groups = 0, prev = -1;
    for (int i = 0; i < r->n_runs; i++) {
        groups += r->sorted[i]->curve != prev;
        prev = r->sorted[i]->curve;
    }
    double h = r->n_runs * RH + (groups - 1) * GAP, H = top + h + 30;
    double pw = (W - nc - 40) / 2;
    bputs(b, "<section>\n<h2>Memory and decode time</h2>\n");
    bprintf(b, "<figure>\n<svg class=\"fig\" width=\"%.0f\" "
               "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" "
               "aria-label=\"bytes held and step time\">\n",
            W, H, W, H);
    double y = top;
    prev = -1;
    for (int i = 0; i < r->n_runs; i++) {
        const struct run *u = r->sorted[i];
        if (prev >= 0 && u->curve != prev)
            y += GAP;
        prev = u->curve;
        bprintf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"5\" height=\"%.1f\" fill=\"%s\"/>", nc - 10,
                y + 3, RH - 6, r->curves[u->curve].color);
        bprintf(b, "<text class=\"rlabel\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", nc - 16,
                y + RH / 2 + 4.5);
        rpt_run_name(b, u);
        bputs(b, "</text>\n");
        y += RH;
    }
    bar_panel(b, r, 0, nc, pw - 30, top, RH, GAP, h);
    bar_panel(b, r, 1, nc + pw + 40, pw - 30, top, RH, GAP, h);
    bputs(b, "</svg>\n<figcaption>Left: memory each run holds after prefill (all layers, one "
             "sequence) as a share of the full cache; right: decode attention time per step "
             "relative to full. Bars short of the dashed line are savings.");
    if (r->tail_tokens > 0)
        bprintf(b, " The bytes include the %.0f uncompressed tokens after the span, so they "
                   "shrink less than the compression factor suggests.",
                r->tail_tokens);
    bputs(b, "</figcaption>\n</figure>\n</section>\n");
}
