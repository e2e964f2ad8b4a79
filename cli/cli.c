/* cli.c — shared helpers of the kvcap tools (see cli.h). */
#include <dirent.h>
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "common/internal.h"

static const char *tool_name = "kvcap";

static void log_to_stderr(enum kvcap_log_level level, const char *message, void *user)
{
    (void)user;
    if (level == KVCAP_LOG_ERROR)
        return; /* printed by cli_fail with the final status */
    const char *tag = level == KVCAP_LOG_WARN ? "warning: " : "";
    fprintf(stderr, "%s: %s%s\n", tool_name, tag, message);
}

/* Ctrl-C, kill, a closed terminal, a file-size limit or a closed pipe end the tool as they
 * would without a handler, after removing the temporary files of the outputs being written (an
 * interrupted 256 MiB shard would otherwise leave 256 MiB beside its destination). */
static void on_fatal_signal(int sig)
{
    kvcap_temp_remove_all();
    raise(sig); /* SA_RESETHAND: the default action, once this handler returns */
}

static void install_signal_cleanup(void)
{
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGXFSZ, SIGPIPE};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction old;
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN)
            continue; /* ignored by whoever started us (nohup, a shell's background job): keep */
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_fatal_signal;
        sa.sa_flags = SA_RESETHAND;
        sigemptyset(&sa.sa_mask);
        sigaction(sigs[i], &sa, NULL);
    }
}

void cli_init(const char *tool, int verbose)
{
    static int handlers;
    tool_name = tool;
    kvcap_log_set(log_to_stderr, NULL, verbose ? KVCAP_LOG_INFO : KVCAP_LOG_WARN);
    if (!handlers++)
        install_signal_cleanup();
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

int cli_parse_int(const char *arg, const char *name, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(arg, &end, 10);
    if (errno || *end || end == arg || v < lo || v > hi)
        return cli_usage_error("%s: '%s' is not an integer in [%ld, %ld]", name, arg, lo, hi);
    *out = (int)v;
    return 0;
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

/* ---- Outputs that would destroy inputs -------------------------------------------------- */

static int same_inode(const struct stat *a, const struct stat *b)
{
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

/* 1 if the existing output `o` is `in`, 2 if it is a regular file directly inside the folder
 * `in`, else 0. */
static int output_is_input(const struct stat *o, const char *in)
{
    struct stat si;
    if (stat(in, &si) != 0)
        return 0;
    if (!S_ISDIR(si.st_mode))
        return same_inode(o, &si);
    DIR *d = opendir(in);
    int hit = 0;
    for (struct dirent *e; d && !hit && (e = readdir(d));) {
        char p[PATH_MAX];
        struct stat se;
        if (snprintf(p, sizeof p, "%s/%s", in, e->d_name) < (int)sizeof p && stat(p, &se) == 0 &&
            S_ISREG(se.st_mode))
            hit = same_inode(o, &se) ? 2 : 0;
    }
    if (d)
        closedir(d);
    return hit;
}

/* The file an output path will name: its folder resolved, then its last component. */
static int resolved(const char *path, char *out, size_t cap)
{
    char a[PATH_MAX], b[PATH_MAX], dir[PATH_MAX];
    if (snprintf(a, sizeof a, "%s", path) >= (int)sizeof a ||
        snprintf(b, sizeof b, "%s", path) >= (int)sizeof b || !realpath(dirname(a), dir))
        return 0;
    return snprintf(out, cap, "%s/%s", dir, basename(b)) < (int)cap;
}

int cli_check_outputs(const struct cli_path *outputs, int n_out, const struct cli_path *inputs,
                      int n_in)
{
    for (int i = 0; i < n_out; i++) {
        if (!outputs[i].path)
            continue;
        struct stat so;
        const int exists = stat(outputs[i].path, &so) == 0;
        if (exists && !S_ISREG(so.st_mode))
            return cli_usage_error("%s %s exists and is not a regular file: refusing to replace "
                                   "it", outputs[i].option, outputs[i].path);
        for (int j = 0; exists && j < n_in; j++) {
            const int hit = inputs[j].path ? output_is_input(&so, inputs[j].path) : 0;
            if (hit)
                return cli_usage_error("%s %s is %s the input %s %s: refusing to overwrite it",
                                       outputs[i].option, outputs[i].path,
                                       hit == 1 ? "the same file as" : "a file inside",
                                       inputs[j].option, inputs[j].path);
        }
        for (int j = 0; j < i; j++) {
            if (!outputs[j].path)
                continue;
            struct stat sj;
            char ri[PATH_MAX], rj[PATH_MAX];
            int same = exists && stat(outputs[j].path, &sj) == 0
                           ? same_inode(&so, &sj)
                           : resolved(outputs[i].path, ri, sizeof ri) &&
                                 resolved(outputs[j].path, rj, sizeof rj) && !strcmp(ri, rj);
            if (same)
                return cli_usage_error("%s %s and %s %s name the same file", outputs[j].option,
                                       outputs[j].path, outputs[i].option, outputs[i].path);
        }
    }
    return 0;
}

int cli_check_output_dir(const char *option, const char *dir, const struct cli_path *inputs,
                         int n_in)
{
    struct stat sd;
    if (!dir || stat(dir, &sd) != 0)
        return 0; /* made by the tool: it holds no input */
    if (!S_ISDIR(sd.st_mode))
        return cli_usage_error("%s %s exists and is not a folder", option, dir);
    for (int j = 0; j < n_in; j++) {
        struct stat si;
        if (!inputs[j].path || stat(inputs[j].path, &si) != 0)
            continue;
        if (S_ISDIR(si.st_mode) && same_inode(&sd, &si))
            return cli_usage_error("%s %s is the input folder %s %s: refusing to write into it",
                                   option, dir, inputs[j].option, inputs[j].path);
        if (S_ISREG(si.st_mode) && output_is_input(&si, dir) == 2)
            return cli_usage_error("the input %s %s is a file inside the output folder %s %s: "
                                   "refusing to write beside it",
                                   inputs[j].option, inputs[j].path, option, dir);
    }
    return 0;
}

int cli_check_inputs(const struct cli_path *inputs, int n)
{
    for (int i = 0; i < n; i++) {
        struct stat si;
        if (!inputs[i].path || stat(inputs[i].path, &si) != 0)
            continue; /* a missing input is named by the tool when it opens it */
        for (int j = 0; j < n; j++) {
            struct stat sj;
            if (j == i || !inputs[j].path || stat(inputs[j].path, &sj) != 0)
                continue;
            if (j < i && same_inode(&si, &sj))
                return cli_usage_error("%s %s and %s %s name the same %s: it would be read "
                                       "twice and its statistics counted twice",
                                       inputs[j].option, inputs[j].path, inputs[i].option,
                                       inputs[i].path, S_ISDIR(si.st_mode) ? "folder" : "file");
            if (S_ISREG(si.st_mode) && S_ISDIR(sj.st_mode) &&
                output_is_input(&si, inputs[j].path) == 2)
                return cli_usage_error("%s %s is a file inside %s %s: it would be read twice and "
                                       "its statistics counted twice",
                                       inputs[i].option, inputs[i].path, inputs[j].option,
                                       inputs[j].path);
        }
    }
    return 0;
}
