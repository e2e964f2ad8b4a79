/* cli.c — shared helpers of the kvcap tools (see cli.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "cli.h"
#include "internal.h"

static const char *tool_name = "kvcap";

static void log_to_stderr(enum kvcap_log_level level, const char *message, void *user)
{
    (void)user;
    if (level == KVCAP_LOG_ERROR)
        return; /* printed by cli_fail with the final status */
    const char *tag = level == KVCAP_LOG_WARN ? "warning: " : "";
    fprintf(stderr, "%s: %s%s\n", tool_name, tag, message);
}

void cli_init(const char *tool, int verbose)
{
    tool_name = tool;
    kvcap_log_set(log_to_stderr, NULL, verbose ? KVCAP_LOG_INFO : KVCAP_LOG_WARN);
}

int cli_fail(enum kvcap_status status)
{
    const char *detail = kvcap_last_error();
    fprintf(stderr, "%s: error: %s\n", tool_name, detail[0] ? detail : kvcap_status_str(status));
    return 1;
}

int cli_usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: error: ", tool_name);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see %s --help)\n", tool_name);
    va_end(ap);
    return 2;
}

const char *cli_bytes(uint64_t bytes, char *buf, size_t cap)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, cap, "%llu B", (unsigned long long)bytes);
    else
        snprintf(buf, cap, "%.1f %s", v, units[u]);
    return buf;
}

void cli_progress_begin(struct cli_progress *p, const char *label, int quiet)
{
    p->label = label;
    p->quiet = quiet;
    p->tty = isatty(STDERR_FILENO);
    p->last_decile = -1;
    p->start = kvcap_seconds();
}

void cli_progress_update(struct cli_progress *p, int64_t done, int64_t total)
{
    if (p->quiet || total <= 0)
        return;
    double frac = (double)done / (double)total, elapsed = kvcap_seconds() - p->start;
    double eta = done > 0 ? elapsed * (double)(total - done) / (double)done : 0.0;
    if (p->tty) {
        enum { WIDTH = 30 };
        char bar[WIDTH + 1];
        int filled = (int)(frac * WIDTH);
        for (int i = 0; i < WIDTH; i++)
            bar[i] = i < filled ? '#' : '.';
        bar[WIDTH] = '\0';
        fprintf(stderr, "\r%s: %s [%s] %3d%% %lld/%lld  %.1fs elapsed, %.1fs left ", tool_name,
                p->label, bar, (int)(100 * frac), (long long)done, (long long)total, elapsed, eta);
        if (done >= total)
            fprintf(stderr, "\n");
        fflush(stderr);
        return;
    }
    int decile = (int)(10 * frac);
    if (decile == p->last_decile)
        return;
    p->last_decile = decile;
    fprintf(stderr, "%s: %s %3d%% (%lld/%lld, %.1fs)\n", tool_name, p->label, (int)(100 * frac),
            (long long)done, (long long)total, elapsed);
}

int cli_progress_callback(int64_t done, int64_t total, void *user)
{
    cli_progress_update(user, done, total);
    return 0;
}

/* Ascending order of doubles for qsort. */
static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double cli_median(double *x, int n)
{
    qsort(x, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}
