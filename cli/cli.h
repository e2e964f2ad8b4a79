/* cli.h — what every kvcap command-line tool shares: logging libkvcap messages to stderr,
 * reporting a failed call with its detailed message, human-readable sizes, medians of timings. */
#ifndef KVCAP_CLI_H
#define KVCAP_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"

/* Routes library log messages to stderr as "TOOL: warning: ...". Errors are not logged
 * here (they are printed once by cli_fail). `verbose` also shows info messages. The first call
 * also makes SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGXFSZ and SIGPIPE remove the temporary files of
 * outputs being written before the tool ends as the signal would end it. */
void cli_init(const char *tool, int verbose);

/* Prints "TOOL: error: <kvcap_last_error() or status text>" to stderr; returns exit code 1. */
int cli_fail(enum kvcap_status status);

/* Prints "TOOL: error: <formatted>" to stderr; returns exit code 2 (usage errors). */
int cli_usage_error(const char *fmt, ...);

/* An integer option: *out = the value of `arg` when it is a whole number in [lo, hi] and 0 is
 * returned; else a usage error naming `name` (exit code 2) and *out untouched. */
int cli_parse_int(const char *arg, const char *name, long lo, long hi, int *out);

/* "1.5 MiB"-style size into buf. */
const char *cli_bytes(uint64_t bytes, char *buf, size_t cap);

/* Median of x[0..n), n >= 1 (the mean of the middle two when n is even); sorts x. */
double cli_median(double *x, int n);

/* Progress of long work on stderr: a redrawn bar on a terminal, a line every 10 % otherwise,
 * nothing when quiet. Call with done == total to finish the line. */
struct cli_progress {
    const char *label;
    int quiet, tty, last_decile;
    double start;
};
void cli_progress_begin(struct cli_progress *p, const char *label, int quiet);
void cli_progress_update(struct cli_progress *p, int64_t done, int64_t total);

/* A file a tool reads or writes, named by the option that gave it ("--out", "--data", ...). */
struct cli_path {
    const char *option;
    const char *path;
};

/* Refuses a command line whose outputs would destroy what it reads or writes twice, before any
 * work: an output that exists and is not a regular file (a device, FIFO or folder), one
 * that is the same file (device and inode, so other spellings, symlinks and hard links count)
 * as an input or as a regular file directly inside an input folder, or two outputs naming one
 * file. Prints a usage error naming both and returns 2; 0 when every output is distinct. */
int cli_check_outputs(const struct cli_path *outputs, int n_out, const struct cli_path *inputs,
                      int n_in);

/* cli_check_outputs for a tool that writes files of its own naming into the folder `dir`
 * (created when missing): refuses a `dir` that exists and is not a folder, is an input folder,
 * or holds an input file directly. Prints a usage error naming both and returns 2, else 0. */
int cli_check_output_dir(const char *option, const char *dir, const struct cli_path *inputs,
                         int n_in);

/* Refuses, before any work, inputs whose statistics would be added twice: two naming the same
 * file or folder (device and inode, as above), or a file directly inside a folder also given.
 * Prints a usage error naming both and returns 2; 0 when every input is distinct. Inputs that
 * do not exist are left to the tool to name when it opens them. */
int cli_check_inputs(const struct cli_path *inputs, int n);

/* The same as a library progress callback (user = struct cli_progress *); never stops. */
int cli_progress_callback(int64_t done, int64_t total, void *user);

#endif /* KVCAP_CLI_H */
