/* report_internal.h — what kvcap-report's files share (not installed): the validated metrics,
 * the output buffer the CSV and the HTML are written into, and each file's functions another
 * file calls. */
#ifndef KVCAP_REPORT_INTERNAL_H
#define KVCAP_REPORT_INTERNAL_H

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/internal.h"

/* ---- The metrics, validated (metrics.c) ---------------------------------------------------- */

/* Every optional number is NaN when absent or null. Strings point into the cJSON tree. */
struct run {
    const char *id, *policy, *label;
    const char *sample; /* generated text of prompt 0, or NULL */
    int extension;      /* kvcap's own variant, not a paper's method */
    double retention;   /* the target */
    double nominal, realised, kl;
    double compression, token_agreement, next_token_agreement, first_divergence_mean;
    double nll, nll_full, nll_delta, cos_mean, rel_mean;
    double bytes_held, bytes_held_full, bytes_held_span, bytes_read, bytes_read_full;
    double step_ms, step_ms_full;
    double prefill_cost;                  /* compression work over the prefill; NaN: absent */
    double task_accuracy, task_agreement; /* NaN without "task" */
    double *task_depth;                   /* accuracy per depth bin (NaN: none), or NULL */
    int n_task_depth;
    int has_freekv;
    double fk_head_steps, fk_corrected, fk_reselected, fk_hidden, fk_pages;
    double *rel; /* per layer, n_layers entries, or NULL */
    int curve;   /* index into report.curves */
    double *pp_dnll, *pp_kl; /* per prompt (the paired intervals), n_pp entries, or NULL */
    int n_pp;
    int shipped;             /* the row chosen in advance (kvcap-eval --shipped) */
    double held;             /* span bytes held over full's (FreeKV: more than it reads) */
    int n_seeds;             /* random eviction: its row is the mean of this many seeds */
    double seed_kl_min, seed_kl_max; /* their mean KLs' range */
};

/* Runs sharing a label form one curve; a curve holding a "full" run is the reference. Papers'
 * methods come before kvcap's extensions; an extension drawn as a variant of a paper's curve
 * (the only extension of that policy, e.g. flashcache+protect) shares its colour and shape with
 * hollow markers. */
struct curve {
    const char *label, *policy;
    int reference, extension;
    const char *color;
    int marker;
};

/* The kept tokens as the file lists them, without repeats within one (layer, head): layer l's
 * are tok[layer_at[l] .. layer_at[l + 1]), head after head, so a token kept by k heads of a
 * layer is there k times. Held sparse, the mask costs memory and drawing time in proportion to
 * what the file lists, not to the layers x tokens it declares (a 500-byte mask may declare
 * 2^20 tokens). */
struct mask {
    const char *bucket;
    int n_tokens, heads;
    int *tok;
    size_t *layer_at; /* n_layers + 1 entries */
    size_t n_kept;    /* layer_at[n_layers]: the (layer, head, token) triples kept */
    int rows, cols;    /* the image's grid (rows * cols == n_tokens), 0 without a thumbnail */
    const char *thumb; /* data:image/bmp;base64,... of a held-out photo crop, or NULL */
};

struct goal {
    const char *text;
    int met;
};

/* An outside reference measured on the same prompts (scripts/kvpress-reference.sh writes
 * kvpress.json beside metrics.json): one row per press and retention. */
struct outside_row {
    const char *press;
    double retention, realised, dnll, kl, agreement;
    double *pp_dnll, *pp_kl; /* per prompt, n_pp entries, or NULL */
    int n_pp;
};

struct outside {
    const char *version, *transformers; /* kvpress's and transformers' versions */
    struct outside_row *rows;
    int n_rows;
    const char *mismatch; /* why the file's rows are not shown (another run's), or NULL */
    char why[768];        /* the mismatch, when it names values */
    const char *hash;     /* shown: its prompts_sha256, this run's too */
    double full_nll, full_nll_here; /* shown: its full-cache NLL, this run's */
};

struct report {
    const char *path; /* the metrics file, first in every message */
    cJSON *root;
    const char *title, *command, *created;
    const char *model_name, *model_file;
    double q_heads, kv_heads, head_dim;
    int n_layers; /* model.layers, 0 when absent */
    const char *corpus_source, *storage;
    const char *prompt_sample; /* the tail of prompt 0's text, or NULL */
    const cJSON *calibration_files, *heldout_files;
    const cJSON *notes; /* array of strings, or NULL */
    double calibration_tokens, heldout_tokens;
    double head_tokens, span_tokens, tail_tokens, generate_tokens, continuation_tokens;
    double images, gap_tokens; /* spans per prompt (1 unless setup says), text between two */
    double fidelity_steps, prompts, threads;
    double read_bandwidth_gbs;
    int has_task; /* the top-level "task" object is present */
    const char *task_name, *task_line, *task_question, *task_haystack;
    double task_queries, task_answer_tokens;
    double task_keys, task_values; /* RULER's variant: names in the span, codes of the asked
                                    * one (1 when absent) */
    double *task_depths; /* mean depth per bin, or NULL */
    int n_depths;
    struct run *runs;
    const struct run **sorted; /* reference curves first, then papers' methods, then kvcap's
                                * extensions, each by label, then by retention */
    int n_runs;
    struct curve *curves;
    int n_curves;
    struct mask *masks;
    int n_masks;
    struct goal *goals;
    int n_goals;
    cJSON *outside_root; /* kvpress.json beside the metrics, parsed; NULL when absent */
    char outside_path[4200];
    struct outside outside;
    /* "track": what the span holds; image is a photo crop's features on its grid */
    int image;
    int calibration_photos; /* track.photos_split "calibration": the prompts show those photos */
    const char *split;      /* setup.split: calibration, development or test; NULL: unsaid */
    const char *shipped;    /* setup.shipped: the label of the row chosen in advance, or NULL */
    const cJSON *unreached; /* targets a policy could not be run at, or NULL */
    double grid_rows, grid_cols, photos, heldout_photos, heldout_crops, calibration_crops;
    const char *features;
    /* other tracks shown side by side (kvcap_report_write_tracks), NULL-terminated */
    const struct report *const *others;
};

/* The reference curve's colour: near-black (metrics.c's palette colours the others). */
#define REFERENCE_COLOR "#222222"

/* The two engines' full-cache NLL (per token, as the full run's "nll") may differ by this much
 * on the same weights and prompts: transformers computes in f32 throughout, kvcap's engine
 * holds K/V in setup.storage (f16 by default) and sums in another order. Measured on 4 text
 * prompts x 64 tokens (transformers 5.24): 4.0e-5 nats/token with f16 storage, 2.9e-4 with
 * bf16; on the image track 1e-4 (3.2460 against 3.2461). The bound leaves 17 times the bf16
 * figure, for fewer prompts or other text; another model, or the same prompts cut elsewhere,
 * moves it by tenths of a nat. */
#define OUTSIDE_FULL_NLL_TOL 5e-3

/* The metrics file at `path` read and validated into *r (zeroed first), with kvpress.json beside
 * it when there is one. On failure *r holds what was read before the error: report_free() it in
 * both cases. */
enum kvcap_status report_load(struct report *r, const char *path);
void report_free(struct report *r);

/* qsort's comparison of ints (mask token indices). */
static inline int cmp_int(const void *pa, const void *pb)
{
    const int a = *(const int *)pa, b = *(const int *)pb;
    return (a > b) - (a < b);
}

/* ---- Output buffer ------------------------------------------------------------------------- */

struct buf {
    char *p;
    size_t len, cap;
    int failed; /* an allocation failed: the content is incomplete */
};

static inline int buf_reserve(struct buf *b, size_t extra)
{
    if (b->failed)
        return 0;
    if (b->len + extra + 1 <= b->cap)
        return 1;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + extra + 1) {
        if (cap > SIZE_MAX / 2) {
            b->failed = 1;
            return 0;
        }
        cap *= 2;
    }
    char *p = realloc(b->p, cap);
    if (!p) {
        b->failed = 1;
        return 0;
    }
    b->p = p;
    b->cap = cap;
    return 1;
}

static inline void bput(struct buf *b, const char *s, size_t n)
{
    if (!buf_reserve(b, n))
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static inline void bputs(struct buf *b, const char *s)
{
    bput(b, s, strlen(s));
}

static inline void bprintf(struct buf *b, const char *fmt, ...) KVCAP_PRINTF(2, 3);
static inline void bprintf(struct buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->failed = 1;
        return;
    }
    if (!buf_reserve(b, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* `n` bytes of text from the JSON, escaped for HTML and SVG text and attribute values. With
 * `controls`, control characters other than tab, newline and carriage return (not allowed in
 * HTML text) become U+FFFD. */
static inline void besc_n(struct buf *b, const char *s, size_t n, int controls)
{
    const char *run = s, *end = s + n;
    for (; s < end; s++) {
        unsigned char c = (unsigned char)*s;
        const char *rep = c == '&'    ? "&amp;"
                          : c == '<'  ? "&lt;"
                          : c == '>'  ? "&gt;"
                          : c == '"'  ? "&quot;"
                          : c == '\'' ? "&#39;"
                                      : NULL;
        if (!rep && controls && (c < 0x20 || c == 0x7F) && c != '\t' && c != '\n' && c != '\r')
            rep = "\xef\xbf\xbd";
        if (rep) {
            bput(b, run, (size_t)(s - run));
            bputs(b, rep);
            run = s + 1;
        }
    }
    bput(b, run, (size_t)(s - run));
}

/* Text from the JSON, escaped for HTML and SVG text and attribute values. */
static inline void besc(struct buf *b, const char *s)
{
    besc_n(b, s, strlen(s), 0);
}

/* ---- Runs compared (compare.c) ------------------------------------------------------------- */

/* A paired difference a − b (KL or |ΔNLL|, over the prompts) read against its 95 % interval:
 * VS_CLOSER, a is closer to full than b beyond it; VS_FARTHER, farther; VS_TIED, the prompts
 * do not separate them; VS_NONE, nothing to pair. */
enum versus { VS_NONE, VS_CLOSER, VS_TIED, VS_FARTHER };

/* a over b (a run's bytes or time over full's), NaN unless b > 0. */
static inline double ratio(double a, double b)
{
    return b > 0 ? a / b : NAN;
}

/* Whether u is on the reference curve: full's. */
static inline int is_reference(const struct report *r, const struct run *u)
{
    return r->curves[u->curve].reference;
}

/* Whether the realised retention is more than 2 % (relative) away from the target: such a row
 * is not at an equal budget with its neighbours and is flagged. */
static inline int off_target(const struct run *u)
{
    return isfinite(u->realised) && fabs(u->realised / u->retention - 1) > 0.02;
}

/* The full-cache run (the first of the reference curve), or NULL. */
const struct run *rpt_full_run(const struct report *r);
/* The random-eviction run at target `t` (the floor every policy must clear), or NULL. */
const struct run *rpt_random_at(const struct report *r, double t);
/* Where the interval mean ± half lies: below 0 (VS_CLOSER), above 0 (VS_FARTHER), or across
 * it (VS_TIED). */
enum versus rpt_paired_verdict(double mean, double half);
/* Run u's KL minus random eviction's at its target, paired over the prompts, and the verdict. */
enum versus rpt_versus_random(const struct report *r, const struct run *u, double *mean,
                              double *half);

/* ---- The renderers ------------------------------------------------------------------------- */

/* csv.c: a header row, then one row per run. */
void rpt_render_csv(struct buf *b, const struct report *r);

/* html.c: numbers, names and cells the page's sections share. */
const char *rpt_fmt_count(char *out, size_t cap, double v);
const char *rpt_fmt_signed(char *out, size_t cap, double v, int decimals);
const char *rpt_fmt_kl(char *out, size_t cap, double v);
void rpt_na_cell(struct buf *b);
void rpt_paired_cell(struct buf *b, double mean, double half);
void rpt_run_name(struct buf *b, const struct run *u);
void rpt_policy_name(struct buf *b, const struct report *r, const struct run *u);
/* RULER's variant of the retrieval task into out ("retrieval: 4 keys, 2 values per query"),
 * or NULL for the plain task (one key, one value) and without a task. */
const char *rpt_task_variant(char *out, size_t cap, const struct report *r);

/* html_tables.c: the headline table, and kvpress's rows beside kvcap's. */
void rpt_render_table(struct buf *b, const struct report *r);
void rpt_render_outside(struct buf *b, const struct report *r);

/* figures.c: the page's figures, each a <section>. */
void rpt_render_fidelity(struct buf *b, const struct report *r);
void rpt_render_depths(struct buf *b, const struct report *r);
void rpt_render_heatmap(struct buf *b, const struct report *r);
void rpt_render_masks(struct buf *b, const struct report *r);
void rpt_render_bars(struct buf *b, const struct report *r);

#endif /* KVCAP_REPORT_INTERNAL_H */
