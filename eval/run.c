/* run.c — `kvcap-eval run`: the policies × retentions, their budgets matched, and the run. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli/cli.h"
#include "common/internal.h"
#include "engine/llama.h"
#include "engine/vision.h"
#include "eval/eval.h"
#include "formats/safetensors.h"
#include "formats/schema.h"
#include "report/report.h"

/* ---- run --------------------------------------------------------------------------------- */
/* build_runs: full, then this many rows per retention, then one per --kvcapsule artifact */
#define RUNS_PER_RETENTION (10 + RANDOM_SEEDS_MAX)
#define MAX_RUNS (1 + MAX_RETENTIONS * RUNS_PER_RETENTION + MAX_ARTIFACTS)

static void add_run(struct run *runs, int *n, const char *policy, const char *label,
                    double retention, const char *yaml_fmt, ...) KVCAP_PRINTF(6, 7);

static void add_run(struct run *runs, int *n, const char *policy, const char *label,
                    double retention, const char *yaml_fmt, ...)
{
    struct run *r = &runs[(*n)++];
    memset(r, 0, sizeof *r);
    r->policy = policy;
    snprintf(r->label, sizeof r->label, "%s", label);
    r->retention = retention;
    r->nominal = retention;
    if (retention >= 1.0)
        snprintf(r->id, sizeof r->id, "%s", policy);
    else
        snprintf(r->id, sizeof r->id, "%s@%.2f", label, retention);
    for (char *c = r->id; *c; c++)
        if (*c == ' ' || *c == '(' || *c == ')')
            *c = '-';
    va_list ap;
    va_start(ap, yaml_fmt);
    vsnprintf(r->yaml, sizeof r->yaml, yaml_fmt, ap);
    va_end(ap);
}

/* The runtime YAML of a VL-Cache run at nominal budget alpha, with its variant's keys. */
static void vlcache_yaml(struct run *r, double alpha)
{
    snprintf(r->yaml, sizeof r->yaml,
             "policies: {vision: vlcache, text: full, generated: full}\n"
             "vlcache: {budget: %.6f%s}\n",
             alpha, r->vlcache_extra ? r->vlcache_extra : "");
    r->nominal = alpha;
}

/* A VL-Cache row at retention r: `extra`, kvcap's variant's keys, or NULL for the paper's. */
static void add_vlcache(struct run *runs, int *n, const char *label, double r,
                        const char *extra)
{
    add_run(runs, n, "vlcache", label, r, "%s", "");
    runs[*n - 1].extension = extra != NULL;
    runs[*n - 1].match_vlcache = 1;
    runs[*n - 1].vlcache_extra = extra;
    vlcache_yaml(&runs[*n - 1], r);
}

/* FreeKV: pages of 8 tokens, one sink page and two window pages always attended, so at least
 * FREEKV_MIN_PAGES pages a step. */
enum { FREEKV_PAGE = 8, FREEKV_MIN_PAGES = 4 };

/* The runtime YAML of a FreeKV run attending `pages` pages of the span a step. */
static void freekv_yaml(struct run *r, int pages, int span)
{
    pages = pages < FREEKV_MIN_PAGES ? FREEKV_MIN_PAGES : pages;
    snprintf(r->yaml, sizeof r->yaml,
             "policies: {vision: freekv, text: full, generated: full}\n"
             "freekv: {page_size: %d, budget: %d, tau: 0.9, sink_pages: 1, window_pages: 2}\n",
             FREEKV_PAGE, pages * FREEKV_PAGE);
    r->freekv_tokens = pages * FREEKV_PAGE < span ? pages * FREEKV_PAGE : span;
    r->nominal = (double)r->freekv_tokens / span;
}
/* kvzip+safeguard: every head first keeps its best tokens up to half an even split. Chosen on
 * the calibration documents (README). */
#define KVZIP_SAFEGUARD 0.5
/* kvzip+basis: the kept tokens per layer and KV head whose values the basis reconstructs worst
 * keep exact value rows. Chosen on the calibration photos (README). */
#define KVZIP_BASIS_EXACT 4

/* The policies × retentions of one evaluation. The papers' methods are the headline rows
 * (flashcache as its section 3.2 with gamma 0.2, vlcache with its recent-window rule and no
 * sinks); kvcap's extensions are labelled as such (+protect: sinks, a window and a floor
 * inside the span; vlcache+uniform: every layer keeps the budget; tiled/pyramid KVCapsule
 * maps, exact tiles). FreeKV attends the pages nearest the target (pages of 8: one sink page,
 * two window pages, the rest chosen). */
/* --rows headline: full, the papers' methods, random and the shipped row stay, in their order;
 * an artifact row that is one of kvcap's variants and not shipped was given for nothing, and is
 * refused by name rather than dropped in silence. */
static enum kvcap_status keep_headline(struct run *runs, int *n_runs)
{
    int n = 0;
    for (int r = 0; r < *n_runs; r++) {
        if (runs[r].extension && !runs[r].shipped) {
            if (runs[r].art)
                return kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                                  "--rows headline: '%s' is one of kvcap's variants and not the "
                                  "--shipped row; leave its artifact out, or use --rows all",
                                  runs[r].label);
            continue;
        }
        runs[n++] = runs[r];
    }
    *n_runs = n;
    return KVCAP_OK;
}

static int build_runs(const struct options *o, struct kvcap_artifact **arts, struct run *runs)
{
    int n = 0;
    add_run(runs, &n, "full", "full", 1.0, "%s", k_full_yaml);
    for (int i = 0; i < o->n_retentions; i++) {
        const double r = o->retentions[i];
        const int keep = (int)lround(r * o->span);
        add_run(runs, &n, "streaming", "streaming", r,
                "policies: {vision: streaming, text: full, generated: full}\n"
                "streaming: {sinks: 4, window: %d}\n", keep > 8 ? keep - 4 : 4);
        add_run(runs, &n, "flashcache", "flashcache", r,
                "policies: {vision: flashcache, text: full, generated: full}\n"
                "flashcache: {retention: %.6f}\n", r);
        add_run(runs, &n, "flashcache", "flashcache+protect", r,
                "policies: {vision: flashcache, text: full, generated: full}\n"
                "flashcache: {retention: %.6f, min_tokens: 8, sinks: 4, window: 16}\n", r);
        runs[n - 1].extension = 1;
        add_vlcache(runs, &n, "vlcache", r, NULL);
        add_vlcache(runs, &n, "vlcache+protect", r,
                    ", recent_fraction: 0.1, sinks: 4, window: 16");
        add_vlcache(runs, &n, "vlcache+uniform", r, ", layer_budgets: uniform");
        add_run(runs, &n, "freekv", "freekv", r, "%s", "");
        freekv_yaml(&runs[n - 1], (int)lround((double)keep / FREEKV_PAGE), o->span);
        runs[n - 1].match_freekv = 1;
        add_run(runs, &n, "kvzip", "kvzip", r,
                "policies: {vision: kvzip, text: full, generated: full}\n"
                "kvzip: {retention: %.6f}\n", r);
        runs[n - 1].post = POST_REPLAY;
        add_run(runs, &n, "kvzip", "kvzip+safeguard", r,
                "policies: {vision: kvzip, text: full, generated: full}\n"
                "kvzip: {retention: %.6f, safeguard: %g}\n", r, KVZIP_SAFEGUARD);
        runs[n - 1].post = POST_REPLAY;
        runs[n - 1].extension = 1;
        add_run(runs, &n, "expected_attention", "expected_attention", r,
                "policies: {vision: expected_attention, text: full, generated: full}\n"
                "expected_attention: {retention: %.6f}\n", r);
        runs[n - 1].post = POST_PROMPT;
        for (int seed = 0; seed < o->random_seeds; seed++) {
            add_run(runs, &n, "random", "random", r,
                    "policies: {vision: random, text: full, generated: full}\n"
                    "random: {retention: %.6f, seed: %d}\n", r, seed);
            runs[n - 1].seed = seed;
            runs[n - 1].n_seeds = seed == 0 ? o->random_seeds : 0;
            if (seed > 0) /* ids stay unique; only seed 0's is written */
                snprintf(runs[n - 1].id + strlen(runs[n - 1].id),
                         sizeof runs[n - 1].id - strlen(runs[n - 1].id), "-seed%d", seed);
        }
        if (n > 1 + (i + 1) * RUNS_PER_RETENTION) /* runs[] is sized by it: a row added */
            return -1;                             /* above needs RUNS_PER_RETENTION raised */
    }
    for (int a = 0; a < o->n_artifacts; a++) {
        const struct artifact_arg *aa = &o->artifacts[a];
        char label[80];
        if (aa->use == USE_KVZIP_BASIS) { /* KVzip's keys, the values in the artifact's basis */
            snprintf(label, sizeof label, "kvzip+basis %s", aa->variant);
            add_run(runs, &n, "kvzip", label, aa->retention,
                    "policies: {vision: kvzip, text: full, generated: full}\nfallback: none\n"
                    "kvzip: {retention: %.6f, values: basis, exact_values: %d}\n",
                    aa->retention, KVZIP_BASIS_EXACT);
            runs[n - 1].post = POST_REPLAY;
            runs[n - 1].extension = 1;
        } else {
            const int exact = aa->use == USE_EXACT;
            snprintf(label, sizeof label, "kvcapsule %s%s (%s keys)", aa->variant,
                     exact ? "+exact" : "", o->artifact_keys[a] ? "trained" : "closed-form");
            add_run(runs, &n, "kvcapsule", label, aa->retention,
                    "policies: {vision: kvcapsule, text: full, generated: full}\nfallback: none\n"
                    "kvcapsule: {exact_tiles: %d}\n",
                    exact ? (o->exact_tiles > 0 ? o->exact_tiles : 1) : 0); /* default 1 */
            /* the paper's method: its dense maps with its trained keys; any other structure,
             * closed-form keys or exact tiles are kvcap's */
            runs[n - 1].extension = exact || strncmp(aa->variant, "dense", 5) != 0 ||
                                    !o->artifact_keys[a];
            /* the id without the key method: the same row keeps its id across runs */
            snprintf(runs[n - 1].id, sizeof runs[n - 1].id, "kvcapsule-%s%s@%.2f", aa->variant,
                     exact ? "+exact" : "", aa->retention);
        }
        runs[n - 1].art = arts[a];
    }
    return n;
}

/* Bytes a cache holds for the span kind (vision) over all its sequences. */
enum kvcap_status span_bytes(const struct kvcap_cache *c, double *bytes)
{
    struct kvcap_cache_stats st;
    KVCAP_TRY(kvcap_cache_stats(c, &st));
    *bytes = (double)st.bytes_by_kind[KVCAP_SPAN_VISION];
    return KVCAP_OK;
}

/* Whether any run's cache takes the queries `post` names: what a prompt's prefill keeps
 * (every prompt token's) or what runs after it (KVzip's reconstruction pass), once for all
 * runs. */
int runs_take(const struct run *runs, int n_runs, enum post_queries post)
{
    for (int r = 0; r < n_runs; r++)
        if (runs[r].post == post)
            return 1;
    return 0;
}

/* A cache of one run holding every prompt, prefill ended. */
enum kvcap_status run_cache(const struct options *o, const struct model_ctx *mc,
                            const struct run *run, const struct prompt *prompts,
                            int n_prompts, struct kvcap_cache **out)
{
    *out = NULL;
    struct kvcap_cache *c = NULL;
    KVCAP_TRY(create_cache(mc, run->yaml, run->art, n_prompts, o->storage, o->threads, NULL, &c));
    enum kvcap_status s = KVCAP_OK;
    for (int p = 0; s == KVCAP_OK && p < n_prompts; p++) {
        s = prompt_to_cache(mc, &prompts[p], c, p, run->post);
        if (s == KVCAP_OK)
            s = kvcap_cache_end_prefill(c, p);
    }
    if (s != KVCAP_OK)
        kvcap_cache_free(c);
    else
        *out = c;
    return s;
}

/* fn(run, ctx) for every run, two runs (or as many as OpenMP has threads) at a time: each
 * run's cache is its own and the model and prompts are only read. Each cache's own parallel
 * loops then run on the thread that calls it, so nothing measured in time may run here. The
 * first failure's status and message (kvcap_last_error is per thread) are returned. */
static enum kvcap_status each_run(struct run *runs, int n_runs,
                                  enum kvcap_status (*fn)(struct run *run, void *ctx), void *ctx)
{
    enum kvcap_status first = KVCAP_OK;
    char message[512] = "";
#pragma omp parallel for schedule(dynamic, 1)
    for (int r = 0; r < n_runs; r++) {
        int failed;
#pragma omp atomic read
        failed = first;
        if (failed)
            continue;
        const enum kvcap_status s = fn(&runs[r], ctx);
        if (s != KVCAP_OK) {
#pragma omp critical(each_run_error)
            if (first == KVCAP_OK) {
                snprintf(message, sizeof message, "%s", kvcap_last_error());
#pragma omp atomic write
                first = s;
            }
        }
    }
    return first == KVCAP_OK ? KVCAP_OK : kvcap_fail(first, "%s", message);
}

struct setup_ctx {
    const struct options *o;
    const struct model_ctx *mc;
    const struct prompt *prompts;
    int n_prompts;
    double full_span;
};

/* VL-Cache's Algorithm 1 clips layer budgets at 1 without redistributing, so it holds fewer
 * tokens than its nominal alpha. For an equal-budget comparison, bisect alpha until the span
 * bytes held on the evaluation's prompts are the target's within 1 %. */
static enum kvcap_status match_vlcache(const struct options *o, const struct model_ctx *mc,
                                       struct run *run, const struct prompt *prompts,
                                       int n_prompts, double full_span_bytes)
{
    const double target = run->retention;
    double lo = target, hi = 1.0, best = target, best_err = HUGE_VAL;
    for (int it = 0; it < 24; it++) {
        const double alpha = it == 0 ? target : 0.5 * (lo + hi);
        vlcache_yaml(run, alpha);
        struct kvcap_cache *c = NULL;
        double bytes = 0;
        KVCAP_TRY(run_cache(o, mc, run, prompts, n_prompts, &c));
        enum kvcap_status s = span_bytes(c, &bytes);
        kvcap_cache_free(c);
        KVCAP_TRY(s);
        const double realised = bytes / full_span_bytes, err = realised / target - 1.0;
        if (fabs(err) < best_err)
            best_err = fabs(err), best = alpha;
        if (fabs(err) <= 0.005)
            break;
        if (err < 0)
            lo = alpha;
        else
            hi = alpha;
    }
    vlcache_yaml(run, best);
    return KVCAP_OK;
}

static enum kvcap_status match_vlcache_one(struct run *run, void *ctx)
{
    const struct setup_ctx *c = ctx;
    return run->match_vlcache
               ? match_vlcache(c->o, c->mc, run, c->prompts, c->n_prompts, c->full_span)
               : KVCAP_OK;
}

/* Bytes one decode step reads, all layers and prompts: the first held-out token appended (its
 * K/V from full's prefill, the same in every run) and attended with its queries. FreeKV selects
 * on that step synchronously, reading its page digests and the pages it attends. */
static enum kvcap_status step_read_bytes(const struct options *o, const struct model_ctx *mc,
                                         const struct run *run, const struct prompt *prompts,
                                         int n_prompts, double *bytes)
{
    const int L = mc->g.n_layers, H = mc->g.n_q_heads, d = mc->g.head_dim;
    const size_t qrow = (size_t)n_prompts * H * d;
    *bytes = 0;
    struct kvcap_cache *cache = NULL;
    KVCAP_TRY(run_cache(o, mc, run, prompts, n_prompts, &cache));
    float *q = malloc(qrow * sizeof *q), *out = malloc(qrow * sizeof *out);
    enum kvcap_status s = q && out ? KVCAP_OK
                                   : kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for a step");
    for (int l = 0; s == KVCAP_OK && l < L; l++) {
        s = fidelity_step(mc, cache, prompts, n_prompts, l, 0, q);
        struct kvcap_cache_stats st;
        if (s == KVCAP_OK)
            s = kvcap_cache_attend(cache, l, q, out);
        if (s == KVCAP_OK)
            s = kvcap_cache_stats(cache, &st);
        if (s == KVCAP_OK)
            *bytes += (double)st.bytes_read_last_attend;
    }
    kvcap_cache_free(cache);
    free(q), free(out);
    return s;
}

static int runs_matching_freekv(const struct run *runs, int n_runs)
{
    for (int r = 0; r < n_runs; r++)
        if (runs[r].match_freekv)
            return 1;
    return 0;
}

/* FreeKV keeps the whole span (and page digests) and attends a budget of its pages, so what it
 * holds says nothing of its budget; what it reads per step does. For an equal-budget comparison
 * its pages are chosen so that the span bytes a step reads (digests, selected pages) over
 * full's are the target's, nearest among whole pages: the span's share of a step's reads is the
 * step's bytes less those of the text and generated rows, which every run holds in full (full's
 * step less full's span). *reachable is 0 when even the fewest pages read more than 5 % above
 * the target (the digests alone cost that much). */
static enum kvcap_status match_freekv(const struct options *o, const struct model_ctx *mc,
                                      struct run *run, const struct prompt *prompts,
                                      int n_prompts, double full_step, double full_span,
                                      int *reachable)
{
    const double target = run->retention;
    const int max_pages = (o->span + FREEKV_PAGE - 1) / FREEKV_PAGE;
    double share[2] = {0, 0};
    int lo = FREEKV_MIN_PAGES, hi = max_pages; /* the fewest pages reading at least target */
    double bytes = 0;
    freekv_yaml(run, lo, o->span);
    KVCAP_TRY(step_read_bytes(o, mc, run, prompts, n_prompts, &bytes));
    share[0] = (bytes - full_step + full_span) / full_span;
    if (share[0] >= target) {
        *reachable = share[0] <= 1.05 * target;
        run->realised = share[0];
        return KVCAP_OK;
    }
    while (hi - lo > 1) { /* share(lo) < target; hi: at least target, or every page */
        const int mid = (lo + hi) / 2;
        freekv_yaml(run, mid, o->span);
        KVCAP_TRY(step_read_bytes(o, mc, run, prompts, n_prompts, &bytes));
        const double sh = (bytes - full_step + full_span) / full_span;
        if (sh < target)
            lo = mid, share[0] = sh;
        else
            hi = mid;
    }
    freekv_yaml(run, hi, o->span);
    KVCAP_TRY(step_read_bytes(o, mc, run, prompts, n_prompts, &bytes));
    share[1] = (bytes - full_step + full_span) / full_span;
    const int nearer_lo = target - share[0] < share[1] - target;
    freekv_yaml(run, nearer_lo ? lo : hi, o->span);
    run->realised = nearer_lo ? share[0] : share[1];
    *reachable = 1;
    return KVCAP_OK;
}

static enum kvcap_status setup_one(struct run *run, void *ctx)
{
    const struct setup_ctx *c = ctx;
    KVCAP_TRY(run_cache(c->o, c->mc, run, c->prompts, c->n_prompts, &run->cache));
    run->group = (struct kvllama_group){.cache = run->cache, .n_seqs = c->n_prompts};
    return KVCAP_OK;
}

/* Creates every run's cache for the prompts and hands each prompt over; measures bytes and
 * the realised retention: the span's bytes held over full's (for eviction policies the share
 * of span tokens kept; FreeKV holds every token in its store and attends a budget of them). */
enum kvcap_status phase_setup(const struct options *o, const struct model_ctx *mc,
                              struct run *runs, int n_runs, const struct prompt *prompts,
                              int n_prompts, int measure)
{
    if (!measure) { /* nothing timed: the runs' caches side by side */
        struct setup_ctx c = {o, mc, prompts, n_prompts, 0};
        return each_run(runs, n_runs, setup_one, &c);
    }
    for (int r = 0; r < n_runs; r++) {
        struct run *run = &runs[r];
        KVCAP_TRY(run_cache(o, mc, run, prompts, n_prompts, &run->cache));
        run->group = (struct kvllama_group){.cache = run->cache, .n_seqs = n_prompts};
        if (measure) {
            struct kvcap_cache_stats st;
            KVCAP_TRY(kvcap_cache_stats(run->cache, &st));
            double replay_s = 0, prefill_s = 0;
            for (int p = 0; p < n_prompts; p++) {
                prefill_s += prompts[p].prefill_s;
                if (run->post == POST_REPLAY)
                    replay_s += prompts[p].replay_s; /* NaN when not measurable */
            }
            run->compress_ms = 1e3 * (st.compress_seconds + replay_s) / n_prompts;
            run->prefill_ms = 1e3 * prefill_s / n_prompts;
            run->bytes_held = (double)st.bytes_held / n_prompts;
            run->bytes_held_span = (double)st.bytes_by_kind[KVCAP_SPAN_VISION] / n_prompts;
            run->held = run->bytes_held_span / runs[0].bytes_held_span;
            if (!run->freekv_tokens) /* FreeKV's: what it reads, from match_freekv */
                run->realised = run->held;
        }
    }
    return KVCAP_OK;
}

void phase_teardown(struct run *runs, int n_runs)
{
    for (int r = 0; r < n_runs; r++) {
        kvcap_cache_free(runs[r].cache);
        runs[r].cache = NULL;
    }
}

/* Random eviction's seeds into one row per retention: each seed's mean KL and dNLL are kept
 * (the spread the report shows), then every accumulator of the seed-0 run becomes the mean over
 * the seeds, prompt by prompt, so that the row and its paired intervals are random eviction's in
 * expectation rather than one mask's. The seeds follow their seed-0 run in runs[]. */
static void fold_seeds(struct run *runs, int n_runs, int n_prompts, int layers)
{
    const struct run *full = &runs[0];
    for (int r = 0; r < n_runs; r++) {
        struct run *u = &runs[r];
        const int n = u->n_seeds;
        if (n < 2 || r + n > n_runs)
            continue;
        for (int k = 0; k < n; k++) {
            const struct run *v = u + k;
            u->seed_kl[k] = v->kl_sum / (double)v->nll_count;
            u->seed_dnll[k] = (v->nll_sum - full->nll_sum) / (double)v->nll_count;
        }
        for (int k = 1; k < n; k++) {
            const struct run *v = u + k;
            u->nll_sum += v->nll_sum, u->kl_sum += v->kl_sum;
            for (int p = 0; p < n_prompts; p++)
                u->prompt_nll[p] += v->prompt_nll[p], u->prompt_kl[p] += v->prompt_kl[p];
            for (int l = 0; u->cos_sum && v->cos_sum && l < layers; l++)
                u->cos_sum[l] += v->cos_sum[l], u->err_sum[l] += v->err_sum[l];
            u->task_correct += v->task_correct, u->task_same += v->task_same;
            u->task_span_bytes += v->task_span_bytes;
            for (int b = 0; u->task_correct_depth && v->task_correct_depth && b < TASK_DEPTHS; b++)
                u->task_correct_depth[b] += v->task_correct_depth[b];
            u->compress_ms += v->compress_ms, u->step_ms += v->step_ms;
            u->bytes_read_step += v->bytes_read_step;
        }
        u->nll_sum /= n, u->kl_sum /= n;
        for (int p = 0; p < n_prompts; p++)
            u->prompt_nll[p] /= n, u->prompt_kl[p] /= n;
        for (int l = 0; u->cos_sum && l < layers; l++)
            u->cos_sum[l] /= n, u->err_sum[l] /= n;
        u->task_correct /= n, u->task_same /= n, u->task_span_bytes /= n;
        for (int b = 0; u->task_correct_depth && b < TASK_DEPTHS; b++)
            u->task_correct_depth[b] /= n;
        u->compress_ms /= n, u->step_ms /= n, u->bytes_read_step /= n;
    }
}

/* Read bandwidth of this machine now: the best of a few passes over 256 MiB. */
static double measure_bandwidth_gbs(void)
{
    const size_t n = (size_t)64 << 20; /* floats */
    float *a = malloc(n * sizeof *a);
    if (!a)
        return NAN;
    for (size_t i = 0; i < n; i++)
        a[i] = (float)(i & 1023);
    double best = 0.0;
    volatile float sink = 0.0f;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = kvcap_seconds();
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp parallel for reduction(+ : s0, s1, s2, s3)
        for (size_t i = 0; i < n; i += 4) {
            s0 += a[i], s1 += a[i + 1], s2 += a[i + 2], s3 += a[i + 3];
        }
        double dt = kvcap_seconds() - t0;
        sink += s0 + s1 + s2 + s3;
        double gbs = n * sizeof *a / dt / 1e9;
        best = gbs > best ? gbs : best;
    }
    free(a);
    return best;
}

/* Whether an artifact's key maps were trained (kvcap-convert records key_maps in its
 * provenance; an artifact without it was converted before it did: closed form, the default). */
static enum kvcap_status artifact_keys(const char *path, int *trained)
{
    *trained = 0;
    struct kvst_file *f = NULL;
    struct kvcap_file_info info;
    memset(&info, 0, sizeof info);
    enum kvcap_status s = kvst_open(path, &f);
    if (s == KVCAP_OK)
        s = kvcap_schema_check(f, KVCAP_KIND_ARTIFACT, &info);
    if (s == KVCAP_OK) {
        const cJSON *prov = cJSON_GetObjectItemCaseSensitive(info.config, "provenance");
        const cJSON *keys = cJSON_GetObjectItemCaseSensitive(prov, "key_maps");
        *trained = cJSON_IsString(keys) && !strcmp(keys->valuestring, "trained");
    }
    kvcap_file_info_free(&info);
    kvst_close(f);
    return s;
}

int cmd_run(const struct options *opt, int argc, char **argv)
{
    struct options eo = *opt;
    const struct options *o = &eo;
    char command[8192] = "";
    if (o->command)
        snprintf(command, sizeof command, "%s", o->command);
    else
        for (int i = 0; i < argc; i++) {
            size_t len = strlen(command);
            snprintf(command + len, sizeof command - len, "%s%s", i ? " " : "", argv[i]);
        }
    struct model_ctx mc;
    enum kvcap_status s = model_open(o->model, &mc, o->quiet);
    if (s != KVCAP_OK)
        return cli_fail(s);
    /* the image track: crops of the --photos split (development by default) on their grid in
     * the text span's place */
    struct image_set im = {0};
    if (opt->track == TRACK_IMAGE) {
        s = image_set_open(opt, &mc, o->photos, &im);
        if (s == KVCAP_OK)
            eo.span = im.f.n_tokens;
    }
    struct kvcap_artifact *arts[MAX_ARTIFACTS] = {0};
    for (int a = 0; s == KVCAP_OK && a < o->n_artifacts; a++) {
        s = kvcap_artifact_open(o->artifacts[a].path, &arts[a]);
        if (s == KVCAP_OK)
            s = artifact_keys(o->artifacts[a].path, &eo.artifact_keys[a]);
    }
    /* A chunk: the prompt, then the held-out text that continues it. */
    const int after = o->continuation > o->generate ? o->continuation : o->generate;
    const int n_fid = o->fidelity_steps < after ? o->fidelity_steps : after;
    struct corpus corpus = {0};
    if (s == KVCAP_OK)
        s = corpus_load(mc.tok, o->corpus, o->docs, prompt_len(o) + after, &corpus);
    if (s == KVCAP_OK && corpus.n_chunks < 1)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "%s: no chunk of %d tokens in the documents",
                       o->docs, prompt_len(o) + after);
    int n_prompts = s == KVCAP_OK && corpus.n_chunks < o->prompts ? corpus.n_chunks
                                                                    : o->prompts;
    if (opt->track == TRACK_IMAGE && im.n / o->images < n_prompts)
        n_prompts = im.n / o->images;
    if (s == KVCAP_OK && n_prompts < 1)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT, "--images %d: the split has %d crops",
                       o->images, im.n);
    /* image track: image i of prompt p shows crop crop_of[p * images + i] of the split, all
     * different, spread over its photos */
    const int n_crops = n_prompts * o->images;
    int *crop_of = calloc((size_t)(n_crops > 0 ? n_crops : 1), sizeof *crop_of);
    float *embd = NULL;
    if (s == KVCAP_OK && !crop_of)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    if (s == KVCAP_OK && opt->track == TRACK_IMAGE) {
        const size_t per = (size_t)im.f.n_tokens * mc.hp->n_embd;
        if (!(embd = malloc(sizeof *embd * per * (size_t)n_crops)))
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for the images' embeddings");
        for (int c = 0; s == KVCAP_OK && c < n_crops; c++) {
            crop_of[c] = im.crops[(size_t)c * im.n / n_crops];
            s = kvvision_embed(&im.f, &im.proj, crop_of[c], embd + per * c);
        }
    }
    static struct run runs[MAX_RUNS];
    const int built = build_runs(o, arts, runs);
    int n_runs = built > 0 ? built : 0;
    if (s == KVCAP_OK && built < 0)
        s = kvcap_fail(KVCAP_ERR_INTERNAL,
                       "a retention holds other than RUNS_PER_RETENTION = %d runs",
                       RUNS_PER_RETENTION);
    int n_shipped = 0;
    for (int r = 0; o->shipped && r < n_runs; r++)
        n_shipped += runs[r].shipped = !strcmp(runs[r].label, o->shipped);
    if (s == KVCAP_OK && o->headline) /* kvcap's variants leave, but the shipped one */
        s = keep_headline(runs, &n_runs);
    if (s == KVCAP_OK && o->shipped && !n_shipped)
        s = kvcap_fail(KVCAP_ERR_INVALID_ARGUMENT,
                       "--shipped: no row is labelled '%s' (a label such as kvzip+safeguard, "
                       "or kvcapsule VARIANT from --kvcapsule)", o->shipped);
    struct prompt *prompts = calloc((size_t)n_prompts, sizeof *prompts);
    struct task task = {0};
    if (s == KVCAP_OK && !prompts)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    if (s == KVCAP_OK)
        s = kvcap_make_dirs(o->out);
    double t0 = kvcap_seconds();
    if (s == KVCAP_OK && !o->quiet)
        fprintf(stderr, "kvcap-eval: run: %d runs x %d prompts of %d + %d x %d (%d apart) + %d "
                "tokens; %d teacher-forced, %d generated, %d retrieval queries\n", n_runs,
                n_prompts, o->head, o->images, o->span, o->gap, o->tail, o->continuation,
                o->generate, o->task_queries);
    struct layout lay = options_layout(o);
    lay.rows = embd ? im.f.grid : 1;
    for (int p = 0; s == KVCAP_OK && p < n_prompts; p++)
        s = prompt_prefill_image(
            &mc, corpus.chunks[p].ids, &lay, n_fid,
            embd ? embd + (size_t)p * o->images * im.f.n_tokens * mc.hp->n_embd : NULL,
            runs_take(runs, n_runs, POST_PROMPT), &prompts[p]);
    if (s == KVCAP_OK && runs_take(runs, n_runs, POST_REPLAY)) {
        struct cli_progress bar;
        cli_progress_begin(&bar, "reconstruction pass (kvzip)", o->quiet);
        for (int p = 0; s == KVCAP_OK && p < n_prompts; p++) {
            s = prompt_replay(&mc, &prompts[p], 1);
            cli_progress_update(&bar, p + 1, n_prompts);
        }
    }
    /* Equal budgets: VL-Cache's nominal budget is searched against full's span bytes. */
    double full_span = 0;
    if (s == KVCAP_OK) {
        struct kvcap_cache *c = NULL;
        s = run_cache(o, &mc, &runs[0], prompts, n_prompts, &c);
        if (s == KVCAP_OK)
            s = span_bytes(c, &full_span);
        kvcap_cache_free(c);
    }
    if (s == KVCAP_OK) {
        struct setup_ctx c = {o, &mc, prompts, n_prompts, full_span};
        s = each_run(runs, n_runs, match_vlcache_one, &c);
    }
    /* FreeKV by what it reads; a target it cannot read as little as has no row, and is named */
    struct unreached unreached[MAX_RETENTIONS];
    int n_unreached = 0;
    double full_step = 0;
    if (s == KVCAP_OK && runs_matching_freekv(runs, n_runs))
        s = step_read_bytes(o, &mc, &runs[0], prompts, n_prompts, &full_step);
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++) {
        int reachable = 1;
        if (runs[r].match_freekv)
            s = match_freekv(o, &mc, &runs[r], prompts, n_prompts, full_step, full_span,
                             &reachable);
        if (s == KVCAP_OK && !reachable && n_unreached < MAX_RETENTIONS) {
            unreached[n_unreached++] = (struct unreached){runs[r].policy, runs[r].retention,
                                                          runs[r].realised};
            memmove(&runs[r], &runs[r + 1], sizeof *runs * (size_t)(n_runs - r - 1));
            n_runs--, r--;
        }
    }
    int32_t **generated = s != KVCAP_OK ? NULL : calloc((size_t)n_runs, sizeof *generated);
    if (s == KVCAP_OK && !generated)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++) {
        runs[r].generated = calloc((size_t)n_prompts * o->generate, sizeof(int32_t));
        runs[r].forced_top1 = calloc((size_t)n_prompts * o->continuation, sizeof(int32_t));
        runs[r].prompt_nll = calloc((size_t)n_prompts * 2, sizeof(double));
        runs[r].prompt_kl = runs[r].prompt_nll ? runs[r].prompt_nll + n_prompts : NULL;
        if (!runs[r].generated || !runs[r].forced_top1 || !runs[r].prompt_nll)
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
        else
            generated[r] = runs[r].generated;
    }
    if (s == KVCAP_OK)
        s = phase_setup(o, &mc, runs, n_runs, prompts, n_prompts, 1);
    if (s == KVCAP_OK)
        s = decode_phase(o, &mc, runs, n_runs, prompts, n_prompts, DECODE_GREEDY, o->generate,
                         generated, 1, "generating");
    phase_teardown(runs, n_runs);
    if (s == KVCAP_OK)
        s = phase_setup(o, &mc, runs, n_runs, prompts, n_prompts, 0);
    if (s == KVCAP_OK)
        s = decode_phase(o, &mc, runs, n_runs, prompts, n_prompts, DECODE_FORCED,
                         o->continuation, NULL, 0, "teacher-forced");
    phase_teardown(runs, n_runs);
    if (s == KVCAP_OK)
        s = attention_fidelity(o, &mc, runs, n_runs, prompts, n_prompts);
    if (s == KVCAP_OK && o->task_queries > 0)
        s = task_build(o, &mc, &corpus, &task);
    if (s == KVCAP_OK && o->task_queries > 0)
        s = task_run(o, &mc, runs, n_runs, &task);
    if (s == KVCAP_OK)
        fold_seeds(runs, n_runs, n_prompts, mc.hp->n_layers);
    double bw = s == KVCAP_OK ? measure_bandwidth_gbs() : NAN;
    struct run_outputs files;
    run_output_paths(o, &files);
    const char *metrics = files.metrics, *html = files.html, *csv = files.csv;
    if (s == KVCAP_OK)
        s = write_metrics(o, &mc, &corpus, runs, n_runs, n_prompts, &task, bw, command,
                          opt->track == TRACK_IMAGE ? &im : NULL, embd, crop_of[0], unreached,
                          n_unreached, metrics);
    /* image track: the spans' embeddings, so that another engine can replay the same prompts
     * (scripts/kvpress_reference.py) */
    if (s == KVCAP_OK && embd) {
        struct kvst_writer *w = NULL;
        const int64_t shape[3] = {n_prompts, (int64_t)o->images * im.f.n_tokens,
                                  mc.hp->n_embd};
        s = kvst_writer_create(&w);
        if (s == KVCAP_OK)
            s = kvst_writer_add(w, "span_embeddings", KVCAP_DTYPE_F32, 3, shape, embd);
        if (s == KVCAP_OK)
            s = kvst_writer_commit(w, files.embd);
        kvst_writer_free(w);
    }
    const char *tracks[8] = {metrics};
    for (int i = 0; i < o->n_compare; i++)
        tracks[1 + i] = o->compare[i];
    if (s == KVCAP_OK)
        s = kvcap_report_write_tracks(tracks, 1 + o->n_compare, html, csv);
    for (int p = 0; prompts && p < n_prompts; p++)
        prompt_free(&prompts[p]);
    free(prompts), free(generated);
    task_free(&task);
    for (int r = 0; r < n_runs; r++)
        free(runs[r].generated), free(runs[r].forced_top1), free(runs[r].prompt_nll),
            free(runs[r].cos_sum), free(runs[r].answers), free(runs[r].task_correct_depth);
    for (int a = 0; a < o->n_artifacts; a++)
        kvcap_artifact_free(arts[a]);
    corpus_free(&corpus);
    model_close(&mc);
    image_set_free(&im);
    free(crop_of), free(embd);
    if (s != KVCAP_OK)
        return cli_fail(s);
    if (!o->quiet)
        fprintf(stderr, "kvcap-eval: done in %.1f s\n", kvcap_seconds() - t0);
    printf("%s\n", html);
    return 0;
}
