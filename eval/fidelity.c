/* fidelity.c — the batched decode phases (greedy, teacher-forced) and attention fidelity. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/internal.h"
#include "engine/llama.h"
#include "eval/eval.h"

/* KL(p || q) of two softmaxes, p given as its log-probabilities lp and probabilities pp (full's
 * row, shared by every run's row of the same prompt: worked out once), q as logits and their
 * log-normaliser. */
static double kl_logits(const double *lp, const double *pp, const float *q, double lse_q, int n)
{
    double kl = 0;
    for (int i = 0; i < n; i++)
        kl += pp[i] * (lp[i] - (q[i] - lse_q));
    return kl > 0 ? kl : 0.0;
}

/* Decodes `steps` tokens after every prompt, all runs batched; runs[0] is full. Greedy:
 * out[r] receives run r's tokens ([prompts][steps], the first from the shared prefill). Forced:
 * prompts' ids continue with the true text. `time` records step time and bytes. */
enum kvcap_status decode_phase(const struct options *o, const struct model_ctx *mc,
                               struct run *runs, int n_runs,
                               const struct prompt *prompts, int n_prompts,
                               enum decode_mode mode, int steps, int32_t **out, int time,
                               const char *what)
{
    const int rows = n_runs * n_prompts, V = mc->hp->n_vocab;
    const int forced = mode == DECODE_FORCED;
    struct kvllama_decoder *dec = NULL;
    struct kvllama_group *groups = calloc((size_t)n_runs, sizeof *groups);
    float *logits = malloc((size_t)rows * V * sizeof *logits);
    int32_t *ids = malloc((size_t)rows * sizeof *ids), *top = malloc((size_t)rows * sizeof *top);
    int *pos = malloc((size_t)rows * sizeof *pos);
    /* forced: each row's log-normaliser and its KL from full's row of the same prompt */
    double *lse = forced ? malloc((size_t)rows * 2 * sizeof *lse) : NULL;
    double *kl = lse ? lse + rows : NULL;
    /* forced: full's log-probabilities and probabilities, prompt by prompt */
    double *ref = forced ? malloc((size_t)n_prompts * V * 2 * sizeof *ref) : NULL;
    enum kvcap_status s = KVCAP_OK;
    if (!groups || !logits || !ids || !top || !pos || (forced && (!lse || !ref)))
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for %d decode rows", rows);
    if (s == KVCAP_OK)
        s = kvllama_decoder_create(mc->model, rows, &dec);
    /* The first token comes from the prefill, which every policy shares. */
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++)
        for (int p = 0; p < n_prompts; p++) {
            const struct prompt *pr = &prompts[p];
            const int32_t best = kvllama_argmax(pr->logits, V);
            const int32_t first = forced ? pr->ids[prompt_tokens(pr)] : best;
            ids[r * n_prompts + p] = first;
            if (forced) {
                const double nll = -kvllama_log_prob(pr->logits, V, first);
                runs[r].nll_sum += nll;
                runs[r].prompt_nll[p] += nll;
                runs[r].nll_count++;
                runs[r].forced_top1[(size_t)p * steps] = best;
            } else {
                out[r][(size_t)p * steps] = first;
            }
        }
    for (int r = 0; r < n_runs; r++)
        groups[r] = runs[r].group;
    struct cli_progress bar;
    cli_progress_begin(&bar, what, o->quiet);
    for (int t = 0; s == KVCAP_OK && t < steps - 1; t++) {
        for (int r = 0; r < n_runs; r++)
            for (int p = 0; p < n_prompts; p++)
                pos[r * n_prompts + p] = prompt_tokens(&prompts[p]) + t;
        for (int r = 0; r < n_runs; r++)
            groups[r].measure_bytes = time && t == steps - 2; /* the last step, all layers */
        s = kvllama_decode(dec, groups, n_runs, ids, pos, logits);
        /* The slow part: passes over the vocabulary, so rows in parallel (full's rows, the
         * first n_prompts, before the KL that reads them). */
        if (s == KVCAP_OK) {
#pragma omp parallel for schedule(dynamic, 4)
            for (int row = 0; row < rows; row++) {
                top[row] = kvllama_argmax(logits + (size_t)row * V, V);
                if (forced)
                    lse[row] = kvllama_log_sum_exp(logits + (size_t)row * V, V);
            }
        }
        if (s == KVCAP_OK && forced) {
#pragma omp parallel for schedule(static)
            for (int p = 0; p < n_prompts; p++) {
                const float *lg = logits + (size_t)p * V;
                double *lp = ref + (size_t)p * V * 2, *pp = lp + V;
                for (int i = 0; i < V; i++) {
                    lp[i] = lg[i] - lse[p];
                    pp[i] = exp(lp[i]);
                }
            }
#pragma omp parallel for schedule(dynamic, 4)
            for (int row = 0; row < rows; row++) {
                const double *lp = ref + (size_t)(row % n_prompts) * V * 2;
                kl[row] = row < n_prompts
                              ? 0.0
                              : kl_logits(lp, lp + V, logits + (size_t)row * V, lse[row], V);
            }
        }
        for (int r = 0; s == KVCAP_OK && r < n_runs; r++)
            for (int p = 0; p < n_prompts; p++) {
                const int row = r * n_prompts + p;
                const float *lg = logits + (size_t)row * V;
                const struct prompt *pr = &prompts[p];
                int32_t next;
                if (forced) {
                    next = pr->ids[prompt_tokens(pr) + t + 1];
                    const double nll = lse[row] - (double)lg[next];
                    runs[r].nll_sum += nll;
                    runs[r].prompt_nll[p] += nll;
                    runs[r].kl_sum += kl[row];
                    runs[r].prompt_kl[p] += kl[row];
                    runs[r].nll_count++;
                    runs[r].forced_top1[(size_t)p * steps + t + 1] = top[row];
                } else {
                    next = top[row];
                    out[r][(size_t)p * steps + t + 1] = next;
                }
                ids[row] = next;
            }
        cli_progress_update(&bar, t + 1, steps - 1);
    }
    if (s == KVCAP_OK && time) {
        for (int r = 0; r < n_runs; r++) {
            runs[r].step_ms = steps > 1 ? 1e3 * groups[r].attend_seconds / (steps - 1) : 0.0;
            runs[r].bytes_read_step = (double)groups[r].bytes_read;
        }
    }
    /* FreeKV's counters over this phase. */
    for (int r = 0; s == KVCAP_OK && time && r < n_runs; r++) {
        if (!runs[r].freekv_tokens)
            continue;
        struct kvcap_cache_stats st;
        s = kvcap_cache_stats(runs[r].cache, &st);
        runs[r].fkv = (struct freekv_counts){st.freekv_head_steps, st.freekv_corrections,
                                             st.freekv_reselections, st.freekv_hidden,
                                             st.freekv_pages_recalled, steps - 1};
    }
    kvllama_decoder_free(dec);
    free(groups), free(logits), free(ids), free(top), free(pos), free(lse), free(ref);
    return s;
}

/* Held-out token t of every prompt into the cache at layer l (its K/V from full's prefill,
 * the same in every run), and its queries into q [n_prompts][q_heads][head_dim]. */
enum kvcap_status fidelity_step(const struct model_ctx *mc, struct kvcap_cache *cache,
                                const struct prompt *prompts, int n_prompts, int l, int t,
                                float *q)
{
    const int H = mc->g.n_q_heads, d = mc->g.head_dim;
    const size_t kd = (size_t)mc->g.n_kv_heads * d;
    for (int p = 0; p < n_prompts; p++) {
        const struct prompt *pr = &prompts[p];
        const size_t n = (size_t)prompt_tokens(pr) + pr->n_fid;
        const size_t at = ((size_t)l * n + prompt_tokens(pr) + t) * kd;
        struct kvcap_tensor_view kv = {.base = pr->k + at, .dtype = KVCAP_DTYPE_F32,
                                       .head_stride = d, .token_stride = (int64_t)kd};
        struct kvcap_tensor_view vv = kv;
        vv.base = pr->v + at;
        KVCAP_TRY(kvcap_cache_append(cache, p, l, &kv, &vv));
        for (int h = 0; h < H; h++)
            memcpy(q + ((size_t)p * H + h) * d,
                   pr->q_dec + (((size_t)l * H + h) * pr->n_fid + t) * d, d * sizeof *q);
    }
    return KVCAP_OK;
}

/* Attention fidelity without cascade: every run's cache holds the prompts as in decoding; the
 * next n_fid tokens of the true text are appended one by one (their K/V from full's prefill)
 * and each step's queries — the same for every run, computed by the model with the full
 * cache — attend; per layer, the mean cosine and relative L2 error against full's outputs. */
enum kvcap_status attention_fidelity(const struct options *o, const struct model_ctx *mc,
                                     struct run *runs, int n_runs,
                                     const struct prompt *prompts, int n_prompts)
{
    const int L = mc->g.n_layers, H = mc->g.n_q_heads, d = mc->g.head_dim;
    const int n_fid = prompts[0].n_fid;
    const size_t qrow = (size_t)n_prompts * H * d;
    float *q = malloc(qrow * sizeof *q), *ref = malloc((size_t)L * n_fid * qrow * sizeof *ref);
    float *outp = malloc(qrow * sizeof *outp);
    enum kvcap_status s = KVCAP_OK;
    if (!q || !ref || !outp)
        s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory for fidelity outputs");
    struct cli_progress bar;
    cli_progress_begin(&bar, "attention fidelity", o->quiet);
    /* runs[0] is full: its outputs are the reference. */
    for (int r = 0; s == KVCAP_OK && r < n_runs; r++) {
        struct run *run = &runs[r];
        struct kvcap_cache *cache = NULL;
        s = run_cache(o, mc, run, prompts, n_prompts, &cache);
        if (s == KVCAP_OK && !(run->cos_sum = calloc((size_t)L * 2, sizeof(double))))
            s = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "no memory");
        if (s == KVCAP_OK)
            run->err_sum = run->cos_sum + L;
        for (int t = 0; s == KVCAP_OK && t < n_fid; t++)
            for (int l = 0; s == KVCAP_OK && l < L; l++) {
                s = fidelity_step(mc, cache, prompts, n_prompts, l, t, q);
                float *dst = r == 0 ? ref + ((size_t)t * L + l) * qrow : outp;
                if (s == KVCAP_OK)
                    s = kvcap_cache_attend(cache, l, q, dst);
                if (s != KVCAP_OK)
                    break;
                const float *base = ref + ((size_t)t * L + l) * qrow;
                for (size_t row = 0; row < (size_t)n_prompts * H; row++) {
                    double dot = 0, na = 0, nb = 0, de = 0;
                    for (int c = 0; c < d; c++) {
                        const double a = dst[row * d + c], b = base[row * d + c];
                        dot += a * b, na += a * a, nb += b * b, de += (a - b) * (a - b);
                    }
                    run->cos_sum[l] += na > 0 && nb > 0 ? dot / sqrt(na * nb) : 1.0;
                    run->err_sum[l] += nb > 0 ? sqrt(de / nb) : 0.0;
                }
            }
        run->attn_count = (int64_t)n_fid * n_prompts * H;
        kvcap_cache_free(cache);
        cli_progress_update(&bar, r + 1, n_runs);
    }
    free(q), free(ref), free(outp);
    return s;
}
