/* test_freekv.c — FreeKV against brute force: page digests and the group-consistent selection
 * vs kvcap_freekv_select_ref, outputs vs plain attention (_ref) over exactly the pages chosen
 * with the current (τ = 1) or the previous step's queries (τ = −1), for a store that grows every
 * step and for one that does not, a full budget vs attention over every token, worker vs inline
 * (heads attended from two threads), hand-counted stats on a scripted case, named errors for
 * bad parameters; and through a cache, both layouts (FreeKV holding only the vision span, or
 * the generated tokens too): τ = ±1 give different outputs, unchanging queries are served by a
 * speculation completed in the background, and the counts in kvcap_cache_stats say so. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kernels/attention.h"
#include "kernels/freekv.h"
#include "runtime/freekv.h"
#include "kvcap.h"
#include "common/rng.h"
#include "common/dtype.h"
#include "tests/test_numeric.h"

/* FreeKV output vs kvcap_attend_rows_ref over the pages it should have attended: the fast
 * kernel sums in f32 blocks (pages visited one call at a time, merged by log-sum-exp), the
 * oracle in double, a few ulps × sqrt(terms). F16 storage needs no looser bound: the expectation
 * is built from the f16-rounded stored values, so both sides see the same numbers. */
#define OUT_REL_TOL 1e-5
/* A fast selection may differ from the oracle's only between pages whose oracle scores are this
 * close (relative): the fast page scores are f32 dot products of d ≤ 128 terms of size ~1
 * (raw scores ~1e2, absolute error ~1e-5) taken through a log-space softmax. */
#define SELECT_TIE_REL_TOL 1e-4

/* ---- helpers -------------------------------------------------------------------------------- */


/* What the test knows the state holds: every appended row as stored, back in f32. */
struct seq {
    int kvh, G, d, ps, n, cap;
    enum kvcap_dtype dt;
    float *k, *v; /* [kvh][cap][d] */
    float *bias;  /* [kvh][d]: key mean of each head's current page, so pages differ */
};

static struct seq seq_new(int kvh, int G, int d, int ps, enum kvcap_dtype dt)
{
    struct seq s = {kvh, G, d, ps, 0, 0, dt, NULL, NULL, alloc_f((size_t)kvh * d)};
    return s;
}

static void seq_free(struct seq *s)
{
    free(s->k);
    free(s->v);
    free(s->bias);
}

static int seq_pages(const struct seq *s)
{
    return (s->n + s->ps - 1) / s->ps;
}

/* Appends k, v [kvh][n][d] to the state and their stored values to s. */
static void seq_append(struct seq *s, struct kvcap_freekv *f, const float *k, const float *v,
                       int n)
{
    if (s->n + n > s->cap) {
        int cap = s->cap * 2 > s->n + n ? s->cap * 2 : s->n + n;
        size_t all = (size_t)s->kvh * cap * s->d;
        float *nk = alloc_f(all), *nv = alloc_f(all);
        for (int h = 0; s->n > 0 && h < s->kvh; h++) {
            memcpy(nk + (size_t)h * cap * s->d, s->k + (size_t)h * s->cap * s->d,
                   sizeof(float) * (size_t)s->n * s->d);
            memcpy(nv + (size_t)h * cap * s->d, s->v + (size_t)h * s->cap * s->d,
                   sizeof(float) * (size_t)s->n * s->d);
        }
        free(s->k);
        free(s->v);
        s->k = nk;
        s->v = nv;
        s->cap = cap;
    }
    size_t m = (size_t)n * s->d;
    void *tmp = malloc(sizeof(float) * m);
    assert_non_null(tmp);
    for (int h = 0; h < s->kvh; h++) {
        size_t at = ((size_t)h * s->cap + s->n) * s->d;
        assert_int_equal(kvcap_convert_from_f32(s->dt, k + (size_t)h * m, m, tmp), KVCAP_OK);
        assert_int_equal(kvcap_convert_to_f32(s->dt, tmp, m, s->k + at), KVCAP_OK);
        assert_int_equal(kvcap_convert_from_f32(s->dt, v + (size_t)h * m, m, tmp), KVCAP_OK);
        assert_int_equal(kvcap_convert_to_f32(s->dt, tmp, m, s->v + at), KVCAP_OK);
    }
    free(tmp);
    assert_int_equal(kvcap_freekv_append(f, k, v, n), KVCAP_OK);
    s->n += n;
    assert_int_equal(kvcap_freekv_tokens(f), s->n);
}

/* n random tokens: keys = the page's mean + noise (a new mean at each page start), so pages
 * have distinct digests and the selection has something to choose; values with mean 0.5 so
 * outputs are not cancellation-dominated. The same data goes to every state in `fs`. */
static void seq_append_random(struct kvcap_rng *r, struct seq *s, struct kvcap_freekv **fs,
                              int n_states, int n)
{
    int d = s->d;
    float *k = alloc_f((size_t)s->kvh * n * d), *v = alloc_f((size_t)s->kvh * n * d);
    for (int h = 0; h < s->kvh; h++)
        for (int i = 0; i < n; i++) {
            float *kr = k + ((size_t)h * n + i) * d;
            if ((s->n + i) % s->ps == 0)
                fill_random(r, s->bias + (size_t)h * d, (size_t)d, 0.0, 0.7);
            fill_random(r, kr, (size_t)d, 0.0, 0.5);
            for (int c = 0; c < d; c++)
                kr[c] += s->bias[(size_t)h * d + c];
        }
    fill_random(r, v, (size_t)s->kvh * n * d, 0.5, 1.0);
    /* seq_append counts tokens once: the extra states only get the same append */
    for (int i = 1; i < n_states; i++)
        assert_int_equal(kvcap_freekv_append(fs[i], k, v, n), KVCAP_OK);
    seq_append(s, fs[0], k, v, n);
    free(k);
    free(v);
}

/* Brute-force digests of head h: kmax, kmin [pages][d] over the filled rows. */
static void brute_digests(const struct seq *s, int h, float *kmax, float *kmin)
{
    int d = s->d;
    for (int t = 0; t < s->n; t++) {
        const float *row = s->k + ((size_t)h * s->cap + t) * d;
        float *hi = kmax + (size_t)(t / s->ps) * d, *lo = kmin + (size_t)(t / s->ps) * d;
        for (int c = 0; c < d; c++) {
            if (t % s->ps == 0 || row[c] > hi[c])
                hi[c] = row[c];
            if (t % s->ps == 0 || row[c] < lo[c])
                lo[c] = row[c];
        }
    }
}

/* The state's digests equal the brute-force ones exactly (max/min of the same stored values). */
static void check_digests(const struct seq *s, const struct kvcap_freekv *f)
{
    int np = seq_pages(s), d = s->d;
    float *kmax = alloc_f((size_t)np * d), *kmin = alloc_f((size_t)np * d);
    float *gmax = alloc_f((size_t)d), *gmin = alloc_f((size_t)d);
    for (int h = 0; h < s->kvh; h++) {
        brute_digests(s, h, kmax, kmin);
        for (int p = 0; p < np; p++) {
            assert_int_equal(kvcap_freekv_digest(f, h, p, gmax, gmin), KVCAP_OK);
            for (int c = 0; c < d; c++)
                if (gmax[c] != kmax[(size_t)p * d + c] || gmin[c] != kmin[(size_t)p * d + c])
                    fail_msg("digest h=%d page=%d c=%d: got [%g, %g] want [%g, %g]", h, p, c,
                             (double)gmin[c], (double)gmax[c], (double)kmin[(size_t)p * d + c],
                             (double)kmax[(size_t)p * d + c]);
        }
    }
    assert_int_equal(kvcap_freekv_digest(f, 0, np, gmax, gmin), KVCAP_ERR_INVALID_ARGUMENT);
    free(kmax);
    free(kmin);
    free(gmax);
    free(gmin);
}

/* Sinks, then sel (top-k, ascending), then the window from page ws on: the pages attended out
 * of np. */
static int attended_pages(int np, int sink, int ws, const int *sel, int nsel, int *out)
{
    int n = 0, lo = sink < np ? sink : np, hi = ws > lo ? ws : lo;
    for (int p = 0; p < lo; p++)
        out[n++] = p;
    for (int i = 0; i < nsel; i++)
        out[n++] = sel[i];
    for (int p = hi; p < np; p++)
        out[n++] = p;
    return n;
}

/* Plain attention of head h's G queries over the listed pages' stored rows, by the double _ref
 * kernel; returns the K/V bytes those rows are in storage. */
static uint64_t expected_output(const struct seq *s, int h, const int *pages, int npages,
                                const float *q, float scale, float *out)
{
    int d = s->d, rows = 0;
    float *k = alloc_f((size_t)npages * s->ps * d), *v = alloc_f((size_t)npages * s->ps * d);
    for (int i = 0; i < npages; i++)
        for (int t = pages[i] * s->ps; t < (pages[i] + 1) * s->ps && t < s->n; t++, rows++) {
            memcpy(k + (size_t)rows * d, s->k + ((size_t)h * s->cap + t) * d, sizeof(float) * d);
            memcpy(v + (size_t)rows * d, s->v + ((size_t)h * s->cap + t) * d, sizeof(float) * d);
        }
    struct kvcap_rows kr = {k, v, KVCAP_DTYPE_F32, (size_t)d, rows};
    struct part p = part_new(s->G, d);
    assert_int_equal(kvcap_attend_rows_ref(&kr, q, s->G, d, scale, p.p, NULL), KVCAP_OK);
    kvcap_partial_finish(p.p, s->G, d, out, (size_t)d);
    free(p.buf);
    free(k);
    free(v);
    return 2u * (uint64_t)rows * d * kvcap_dtype_size(s->dt);
}

/* The state's attention of head h, finished to [G][d]; returns the bytes attend reported. */
static uint64_t attend(struct kvcap_freekv *f, int h, const float *q, int G, int d, float scale,
                       float *out)
{
    struct part p = part_new(G, d);
    uint64_t bytes = UINT64_MAX;
    assert_int_equal(kvcap_freekv_attend(f, h, q, scale, p.p, &bytes), KVCAP_OK);
    kvcap_partial_finish(p.p, G, d, out, (size_t)d);
    free(p.buf);
    return bytes;
}

static int same_set(const int *a, int na, const int *b, int nb)
{
    return na == nb && (na == 0 || memcmp(a, b, sizeof(int) * (size_t)na) == 0);
}

/* got (ascending) is a top-k by the oracle's scores: the oracle's pick `want`, or one that trades
 * pages for others within SELECT_TIE_REL_TOL of them. */
static void check_selection(const int *got, int ngot, const int *want, int nwant,
                            const double *score, const char *what)
{
    if (ngot != nwant)
        fail_msg("%s: %d pages selected, the oracle %d", what, ngot, nwant);
    double worst_in = INFINITY, best_out = -INFINITY;
    for (int i = 0; i < ngot; i++) {
        int in_want = 0, in_got = 0;
        for (int j = 0; j < nwant; j++) {
            in_want |= want[j] == got[i];
            in_got |= got[j] == want[i];
        }
        if (!in_want)
            worst_in = fmin(worst_in, score[got[i]]);
        if (!in_got)
            best_out = fmax(best_out, score[want[i]]);
    }
    if (best_out > -INFINITY && !(best_out - worst_in <= SELECT_TIE_REL_TOL * best_out))
        fail_msg("%s: selected a page of score %.9g over one of %.9g", what, worst_in, best_out);
}

/* ---- sweeps against brute force ------------------------------------------------------------- */

enum mode {
    CURRENT,  /* τ = 1: every step corrects, so it attends the current queries' pick */
    PREVIOUS, /* τ = −1: never corrects, so it attends the previous step's pick */
    FULL      /* budget above every token: plain attention */
};

/* One configuration, 5 decode steps after a prefill; returns how many (step, head) pairs had
 * different picks by the current and the previous queries (the check must be able to tell).
 * static_store: no token is appended after the prefill (FreeKV holding only a span, the
 * generated tokens kept by another policy); the speculation must serve it all the same. */
static int run_mode(struct kvcap_rng *r, int G, int d, int ps, enum kvcap_dtype dt,
                    enum mode mode, int static_store)
{
    const int kvh = 2, steps = 5, sink = 1, window = 2;
    int n0 = ps == 1 ? 40 : 9 * ps + ps / 2;
    int cands = (n0 + ps - 1) / ps - sink - window, k = cands / 3 > 1 ? cands / 3 : 1;
    struct kvcap_freekv_params p = {ps, (sink + window + k) * ps, sink, window,
                                    mode == CURRENT ? 1.0f : mode == PREVIOUS ? -1.0f : 0.9f};
    if (mode == FULL)
        p.budget_tokens = 1 << 20;
    struct kvcap_freekv *f = NULL;
    assert_int_equal(kvcap_freekv_create(&p, kvh, G, d, dt, NULL, &f), KVCAP_OK);
    struct seq s = seq_new(kvh, G, d, ps, dt);
    seq_append_random(r, &s, &f, 1, n0);
    check_digests(&s, f);

    float scale = 1.0f / sqrtf((float)d);
    size_t qn = (size_t)G * d;
    float *q = alloc_f(qn * kvh), *qprev = alloc_f(qn * kvh);
    float *got = alloc_f(qn), *want = alloc_f(qn);
    int *pages = malloc(sizeof(int) * 4096), *sel = malloc(sizeof(int) * 4096),
        *alt = malloc(sizeof(int) * 4096), *ref = malloc(sizeof(int) * 4096);
    double *score = malloc(sizeof(double) * 4096);
    assert_true(pages && sel && alt && ref && score);
    int differing = 0;
    char what[160];
    /* the store a speculation is made for: the size at step_done, one token more if it grew
     * since the step_done before (at the first, since creation) */
    int64_t done_tokens = 0, spec_tokens = 0;
    for (int step = 0; step < steps; step++) {
        /* FULL: 3 tokens at once before step 3: the speculation (made for one) still serves,
         * its window extended over the candidates it did not see */
        int grown = step == 0 || static_store ? 0 : mode == FULL && step == 3 ? 3 : 1;
        if (grown)
            seq_append_random(r, &s, &f, 1, grown);
        int np = seq_pages(&s);
        check_digests(&s, f);
        memcpy(qprev, q, sizeof(float) * qn * kvh);
        fill_random(r, q, qn * kvh, 0.0, 1.0);
        /* one page more: a speculation made for one token more may see it (as window) */
        float *kmax = alloc_f((size_t)(np + 1) * d), *kmin = alloc_f((size_t)(np + 1) * d);
        for (int h = 0; h < kvh; h++) {
            const float *qh = q + qn * h;
            snprintf(what, sizeof what, "%s G=%d d=%d ps=%d mode=%d static=%d step=%d h=%d",
                     kvcap_dtype_name(dt), G, d, ps, (int)mode, static_store, step, h);
            uint64_t bytes = attend(f, h, qh, G, d, scale, got);
            int nsel = kvcap_freekv_selection(f, h, sel, 4096);
            int ws = kvcap_freekv_window_start(f, h);
            uint64_t want_bytes;
            if (mode == FULL) {
                for (int i = 0; i < np; i++)
                    pages[i] = i;
                want_bytes = expected_output(&s, h, pages, np, qh, scale, want);
                /* every candidate is a pick or (after the 3 tokens) in the extended window */
                assert_int_equal(nsel, ws - sink);
                assert_true(ws <= np - window && ws >= np - window - (grown > 1));
            } else {
                /* one token per step, the speculation made for one more: no extension */
                assert_int_equal(ws, np - window);
                /* the pick the state should have used, by the oracle on brute-force digests */
                brute_digests(&s, h, kmax, kmin);
                int now = mode == CURRENT || step == 0; /* selected here, for this store */
                const float *qsel = now ? qh : qprev + qn * h;
                int sel_np = now ? np : (int)((spec_tokens + ps - 1) / ps);
                int nref = kvcap_freekv_select_ref(kmax, kmin, sel_np, qsel, G, d, sink, window,
                                                   k, ref, score);
                /* picks the store has meanwhile put in the window are attended as window */
                int kept = 0;
                for (int i = 0; i < nref; i++)
                    if (ref[i] < ws)
                        ref[kept++] = ref[i];
                nref = kept;
                check_selection(sel, nsel, ref, nref, score, what);
                if (step > 0) {
                    const float *qother = mode == CURRENT ? qprev + qn * h : qh;
                    int nalt = kvcap_freekv_select_ref(kmax, kmin, np, qother, G, d, sink, window,
                                                       k, alt, NULL);
                    differing += !same_set(ref, nref, alt, nalt);
                }
                /* the output is attention over the pick the state made (checked just above) */
                int npg = attended_pages(np, sink, ws, sel, nsel, pages);
                want_bytes = expected_output(&s, h, pages, npg, qh, scale, want);
                if (mode == CURRENT || step == 0) /* selected here: the digests were read */
                    want_bytes += (uint64_t)(np - sink - window) * 2 * d * sizeof(float);
            }
            assert_close(got, want, qn, OUT_REL_TOL, what);
            assert_int_equal(bytes, want_bytes);
        }
        free(kmax);
        free(kmin);
        assert_int_equal(kvcap_freekv_step_done(f), KVCAP_OK);
        spec_tokens = s.n + (s.n > done_tokens);
        done_tokens = s.n;
        struct kvcap_freekv_stats st;
        kvcap_freekv_stats(f, &st);
        assert_int_equal(st.steps, step + 1);
        int resync = step == 0;
        assert_int_equal(st.last_resyncs, resync ? kvh : 0);
        if (mode == CURRENT)
            assert_int_equal(st.last_corrections, resync ? 0 : kvh);
        if (mode == PREVIOUS) {
            assert_int_equal(st.last_corrections, 0);
            assert_int_equal(st.last_hidden, resync ? 0 : kvh); /* inline: always complete */
        }
        assert_int_equal(st.last_waited, 0);
        assert_int_equal(st.last_hidden + st.last_corrections + st.last_resyncs, kvh);
        assert_true(st.last_bytes_recalled ==
                    (uint64_t)st.last_pages_recalled * 2 * ps * d * kvcap_dtype_size(dt));
    }
    struct kvcap_freekv_stats st;
    kvcap_freekv_stats(f, &st);
    if (mode == CURRENT)
        assert_int_equal(st.corrections, (int64_t)kvh * (steps - 1));
    if (mode == PREVIOUS)
        assert_int_equal(st.corrections, 0);
    assert_int_equal(st.resyncs, kvh);
    /* store + two pools + digests: at least the pages and digests the data needs */
    uint64_t es = kvcap_dtype_size(dt);
    int np = seq_pages(&s);
    assert_true(kvcap_freekv_bytes_held(f) >=
                (uint64_t)np * kvh * 2 * ps * d * es + (uint64_t)np * kvh * 2 * d * sizeof(float));
    kvcap_freekv_free(f);
    seq_free(&s);
    free(q);
    free(qprev);
    free(got);
    free(want);
    free(pages);
    free(sel);
    free(alt);
    free(ref);
    free(score);
    return differing;
}

static void sweep(enum mode mode)
{
    static const int Gs[] = {1, 4, 7}, ds[] = {64, 128}, pss[] = {1, 16, 32};
    static const enum kvcap_dtype dts[] = {KVCAP_DTYPE_F32, KVCAP_DTYPE_F16};
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 100 + (uint64_t)mode);
    for (size_t a = 0; a < 3; a++)
        for (size_t b = 0; b < 2; b++)
            for (size_t c = 0; c < 3; c++)
                for (size_t t = 0; t < 2; t++)
                    for (int st = 0; st < 2; st++) {
                        int differing = run_mode(&r, Gs[a], ds[b], pss[c], dts[t], mode, st);
                        /* with fresh random queries each step the two picks must differ
                         * somewhere, else following q_t rather than q_{t-1} is untested */
                        if (mode != FULL && differing == 0)
                            fail_msg("G=%d d=%d ps=%d %s static=%d: the current and previous "
                                     "picks never differ",
                                     Gs[a], ds[b], pss[c], kvcap_dtype_name(dts[t]), st);
                    }
}

static void test_tau_one_follows_current_queries(void **state)
{
    (void)state;
    sweep(CURRENT);
}

static void test_tau_minus_one_follows_previous_queries(void **state)
{
    (void)state;
    sweep(PREVIOUS);
}

static void test_full_budget_is_plain_attention(void **state)
{
    (void)state;
    sweep(FULL);
}

/* ---- the oracle by hand --------------------------------------------------------------------- */

static void test_select_ref_by_hand(void **state)
{
    (void)state;
    int sel[8];
    double score[8];
    /* Group consistency: per-g softmax then the mean. g0 likes page 1, g1 page 2, page 3 is
     * middling for both; raw sums tie (10 each) but the softmax mean keeps pages 1 and 2. */
    {
        float kmax[5 * 2] = {0, 0, 10, 0, 0, 10, 5, 5, 0, 0};
        float q[2 * 2] = {1, 0, 0, 1};
        int n = kvcap_freekv_select_ref(kmax, kmax, 5, q, 2, 2, 1, 1, 2, sel, score);
        assert_int_equal(n, 2);
        assert_int_equal(sel[0], 1);
        assert_int_equal(sel[1], 2);
        assert_true(isnan(score[0]) && isnan(score[4])); /* sink, window */
        double e = exp(-5.0), z = 1 + e + exp(-10.0);
        assert_true(fabs(score[3] - e / z) < 1e-12);
        assert_true(fabs(score[1] - (1 / z + exp(-10.0) / z) / 2) < 1e-12);
    }
    /* max(q·kmax, q·kmin) per channel: a negative q takes the page's minimum. */
    {
        float kmax[4 * 2] = {0, 0, 1, 0, 2, 0, 0, 0};
        float kmin[4 * 2] = {0, 0, -3, 0, 2, 0, 0, 0};
        float q[2] = {-1, 0};
        assert_int_equal(kvcap_freekv_select_ref(kmax, kmin, 4, q, 1, 2, 1, 1, 1, sel, NULL), 1);
        assert_int_equal(sel[0], 1); /* raw 3 beats raw -2 */
    }
    /* At most k candidates: all of them; none at all: 0. */
    {
        float kd[6] = {1, 2, 3, 4, 5, 6}, q[1] = {1};
        assert_int_equal(kvcap_freekv_select_ref(kd, kd, 6, q, 1, 1, 2, 1, 3, sel, NULL), 3);
        assert_int_equal(sel[0], 2);
        assert_int_equal(sel[2], 4);
        assert_int_equal(kvcap_freekv_select_ref(kd, kd, 6, q, 1, 1, 4, 3, 3, sel, NULL), 0);
        assert_int_equal(kvcap_freekv_select_ref(kd, kd, 6, q, 1, 1, 0, 1, 2, sel, NULL), 2);
        assert_int_equal(sel[0], 3);
        assert_int_equal(sel[1], 4);
    }
}

/* The fast selection (kvcap_freekv_select) against the oracle on random digests: the same
 * pages, up to trades between pages whose oracle scores tie within SELECT_TIE_REL_TOL. */
static void test_select_matches_ref(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 7);
    const int shapes[][5] = {/* pages, G, d, sinks + window, k */
                             {40, 7, 64, 3, 8}, {9, 1, 3, 2, 4}, {200, 4, 128, 3, 16},
                             {6, 2, 8, 3, 5}};
    for (size_t t = 0; t < sizeof shapes / sizeof shapes[0]; t++) {
        int np = shapes[t][0], G = shapes[t][1], d = shapes[t][2], k = shapes[t][4];
        int sinks = 1, window = shapes[t][3] - 1;
        float *dig = malloc(sizeof(float) * (size_t)np * 2 * d);
        float *kmax = malloc(sizeof(float) * (size_t)np * d);
        float *kmin = malloc(sizeof(float) * (size_t)np * d);
        float *q = malloc(sizeof(float) * (size_t)G * d);
        float *score = malloc(sizeof(float) * 3 * (size_t)np), qsplit[2 * 128];
        int *work = malloc(sizeof(int) * (size_t)np), *got = malloc(sizeof(int) * (size_t)np);
        int *want = malloc(sizeof(int) * (size_t)np);
        double *ref_score = malloc(sizeof(double) * (size_t)np);
        fill_random(&r, kmin, (size_t)np * d, -0.5, 1.0);
        fill_random(&r, q, (size_t)G * d, 0.0, 1.0);
        for (int p = 0; p < np; p++)
            for (int c = 0; c < d; c++) {
                float spread = (float)fabs(kvcap_rng_normal(&r));
                kmax[(size_t)p * d + c] = kmin[(size_t)p * d + c] + spread;
                dig[((size_t)p * 2) * d + c] = kmax[(size_t)p * d + c];
                dig[((size_t)p * 2 + 1) * d + c] = kmin[(size_t)p * d + c];
            }
        int lo = sinks, hi = np - window;
        uint64_t bytes = 0;
        int ngot = kvcap_freekv_select(dig, lo, hi, q, G, d, k, score, qsplit, work, got, &bytes);
        int nwant = kvcap_freekv_select_ref(kmax, kmin, np, q, G, d, sinks, window, k, want,
                                            ref_score);
        char what[64];
        snprintf(what, sizeof what, "select %d pages, G %d, d %d, k %d", np, G, d, k);
        check_selection(got, ngot, want, nwant, ref_score, what);
        if (hi - lo > k)
            assert_int_equal(bytes, (uint64_t)(hi - lo) * 2 * d * sizeof(float));
        else
            assert_int_equal(bytes, 0);
        free(dig), free(kmax), free(kmin), free(q), free(score), free(work), free(got);
        free(want), free(ref_score);
    }
}

/* ---- scripted stats ------------------------------------------------------------------------- */

/* page_size 2, one head, G = 1, d = 4, 1 sink + 1 window page, k = 2, τ = 0.5. Page keys are
 * one vector each, so a page's score is q · that vector and every pick is known by hand:
 *   page: 0  1   2   3   4   5    6  7
 *   key : 0  e0  e1  e2  e3  2e3  0  0
 * Buffers: A is the first one filled, B the other; "moved" = copied within the pool. Slots keep
 * their page while it stays picked. The store grows every step, so each speculation is made for
 * one token more.
 *  step 1 (10 tokens, q=(3,2,0,0)): resync picks {1,2}, 2 recalled into A; speculation for 11
 *          tokens picks {1,2}, moved A → B.                                  recalled 2
 *  step 2 (11, same q): uses B (hidden); speculation for 12 picks {1,2}: in A already.
 *  step 3 (12, q=(0,0,2,3), cosine 0 < τ): corrected, picks {3,4}: 2 recalled into B;
 *          speculation for 13 picks {4,5}: 4 moved B → A, 5 recalled.  1 correction, 3 recalled
 *  step 4 (13, same q): uses A (hidden); speculation for 14: B keeps 4 in its slot, 5 moved
 *          A → B.                                                            recalled 0
 *  step 5 (15: two tokens, the speculation was for 14, among pages [1, 6)): still used
 *          (hidden), the window extended back to page 6: attends 0, {4,5}, 6, 7. recalled 0 */
static void scripted(struct kvcap_freekv_worker *w)
{
    const int d = 4, ps = 2;
    struct kvcap_freekv_params p = {ps, 8, 1, 1, 0.5f};
    struct kvcap_freekv *f = NULL;
    assert_int_equal(kvcap_freekv_create(&p, 1, 1, d, KVCAP_DTYPE_F32, w, &f), KVCAP_OK);
    struct seq s = seq_new(1, 1, d, ps, KVCAP_DTYPE_F32);
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 7);
    static const float page_key[8][4] = {{0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0},
                                         {0, 0, 0, 1}, {0, 0, 0, 2}, {0, 0, 0, 0}, {0, 0, 0, 0}};
    static const struct {
        int append;
        float q[4];
        int sel[2], ws;
        int corrections, resyncs, hidden, recalled;
    } script[] = {
        {10, {3, 2, 0, 0}, {1, 2}, 4, 0, 1, 0, 2}, {1, {3, 2, 0, 0}, {1, 2}, 5, 0, 0, 1, 0},
        {1, {0, 0, 2, 3}, {3, 4}, 5, 1, 0, 0, 3},  {1, {0, 0, 2, 3}, {4, 5}, 6, 0, 0, 1, 0},
        {2, {0, 0, 2, 3}, {4, 5}, 6, 0, 0, 1, 0},
    };
    const uint64_t page_bytes = 2 * ps * d * sizeof(float); /* K and V of one head */
    int64_t corrections = 0, resyncs = 0, hidden = 0, recalled = 0;
    float got[4], want[4], k[10 * 4], v[10 * 4];
    int sel[8], pages[8];
    for (int step = 0; step < 5; step++) {
        int n = script[step].append;
        for (int i = 0; i < n; i++)
            memcpy(k + i * d, page_key[(s.n + i) / ps], sizeof page_key[0]);
        fill_random(&r, v, (size_t)n * d, 0.5, 1.0);
        seq_append(&s, f, k, v, n);
        attend(f, 0, script[step].q, 1, d, 0.5f, got);
        assert_int_equal(kvcap_freekv_selection(f, 0, sel, 8), 2);
        assert_int_equal(sel[0], script[step].sel[0]);
        assert_int_equal(sel[1], script[step].sel[1]);
        assert_int_equal(kvcap_freekv_window_start(f, 0), script[step].ws);
        int npg = attended_pages(seq_pages(&s), 1, script[step].ws, sel, 2, pages);
        expected_output(&s, 0, pages, npg, script[step].q, 0.5f, want);
        assert_close(got, want, (size_t)d, OUT_REL_TOL, "scripted");
        assert_int_equal(kvcap_freekv_step_done(f), KVCAP_OK);
        struct kvcap_freekv_stats st;
        kvcap_freekv_stats(f, &st); /* waits for the worker: the next attend finds it done */
        corrections += script[step].corrections;
        resyncs += script[step].resyncs;
        hidden += script[step].hidden;
        recalled += script[step].recalled;
        assert_int_equal(st.steps, step + 1);
        assert_int_equal(st.last_corrections, script[step].corrections);
        assert_int_equal(st.last_resyncs, script[step].resyncs);
        assert_int_equal(st.last_hidden, script[step].hidden);
        assert_int_equal(st.last_waited, 0);
        assert_int_equal(st.last_pages_recalled, script[step].recalled);
        assert_int_equal(st.last_bytes_recalled, script[step].recalled * page_bytes);
        assert_int_equal(st.corrections, corrections);
        assert_int_equal(st.resyncs, resyncs);
        assert_int_equal(st.hidden, hidden);
        assert_int_equal(st.waited, 0);
        assert_int_equal(st.pages_recalled, recalled);
        assert_int_equal(st.bytes_recalled, recalled * page_bytes);
    }
    assert_int_equal(recalled, 5);
    kvcap_freekv_free(f);
    seq_free(&s);
}

static void test_scripted_stats(void **state)
{
    (void)state;
    scripted(NULL);
    struct kvcap_freekv_worker *w = NULL;
    assert_int_equal(kvcap_freekv_worker_create(&w), KVCAP_OK);
    scripted(w);
    kvcap_freekv_worker_free(w);
}

/* ---- worker vs inline ----------------------------------------------------------------------- */

struct attend_job {
    struct kvcap_freekv *f;
    int first, kvh, G, d;
    const float *q;
    float *out; /* [kvh][G][d] */
    int failed; /* heads whose attend did not return KVCAP_OK (checked after the join) */
};

/* Heads first, first + 2, ...: two of these run at once on one state. */
static void *attend_heads(void *arg)
{
    struct attend_job *j = arg;
    size_t qn = (size_t)j->G * j->d;
    for (int h = j->first; h < j->kvh; h += 2) {
        struct part p = part_new(j->G, j->d);
        j->failed += kvcap_freekv_attend(j->f, h, j->q + qn * h, 1.0f / sqrtf((float)j->d),
                                         p.p, NULL) != KVCAP_OK;
        kvcap_partial_finish(p.p, j->G, j->d, j->out + qn * h, (size_t)j->d);
        free(p.buf);
    }
    return NULL;
}

/* States 1 and 2 share one worker; state 1 attends its heads from two threads at once. Every
 * output, pick and count equals the inline state's bit for bit (the same code on the same data
 * in the same order). Queries drift slowly, with a jump every third step, so some head-steps
 * correct and some use the speculation. */
static void worker_case(struct kvcap_freekv_worker *w, int kvh, int G, int d, int ps,
                        enum kvcap_dtype dt)
{
    const int steps = 10;
    struct kvcap_freekv_params p = {ps, 6 * ps, 1, 2, 0.6f};
    struct kvcap_freekv *fs[3] = {NULL, NULL, NULL};
    assert_int_equal(kvcap_freekv_create(&p, kvh, G, d, dt, NULL, &fs[0]), KVCAP_OK);
    assert_int_equal(kvcap_freekv_create(&p, kvh, G, d, dt, w, &fs[1]), KVCAP_OK);
    assert_int_equal(kvcap_freekv_create(&p, kvh, G, d, dt, w, &fs[2]), KVCAP_OK);
    struct seq s = seq_new(kvh, G, d, ps, dt);
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 31);
    seq_append_random(&r, &s, fs, 3, 12 * ps + 5);
    size_t qn = (size_t)G * d, all = qn * kvh;
    float *q = alloc_f(all), *noise = alloc_f(all);
    float *out[3] = {alloc_f(all), alloc_f(all), alloc_f(all)};
    int sel[3][64];
    fill_random(&r, q, all, 0.0, 1.0);
    for (int step = 0; step < steps; step++) {
        /* two tokens before step 6, none before step 8: the speculation (made for one more
         * token) serves both, no resync */
        if (step > 0 && step != 8)
            seq_append_random(&r, &s, fs, 3, step == 6 ? 2 : 1);
        fill_random(&r, noise, all, 0.0, 1.0);
        for (size_t i = 0; i < all; i++)
            q[i] = step % 3 == 2 ? noise[i] : q[i] + 0.1f * noise[i];
        struct attend_job jobs[2];
        pthread_t th[2];
        for (int t = 0; t < 2; t++) {
            struct attend_job j = {fs[1], t, kvh, G, d, q, out[1], 0};
            jobs[t] = j;
            assert_int_equal(pthread_create(&th[t], NULL, attend_heads, &jobs[t]), 0);
        }
        for (int t = 0; t < 2; t++) {
            assert_int_equal(pthread_join(th[t], NULL), 0);
            assert_int_equal(jobs[t].failed, 0);
        }
        for (int i = 0; i < 3; i += 2) {
            struct attend_job j0 = {fs[i], 0, kvh, G, d, q, out[i], 0}, j1 = j0;
            j1.first = 1;
            attend_heads(&j0);
            attend_heads(&j1);
            assert_int_equal(j0.failed + j1.failed, 0);
        }
        for (int i = 1; i < 3; i++)
            assert_memory_equal(out[i], out[0], sizeof(float) * all);
        for (int h = 0; h < kvh; h++) {
            int n[3];
            for (int i = 0; i < 3; i++)
                n[i] = kvcap_freekv_selection(fs[i], h, sel[i], 64);
            for (int i = 1; i < 3; i++)
                assert_true(same_set(sel[i], n[i], sel[0], n[0]));
        }
        for (int i = 0; i < 3; i++)
            assert_int_equal(kvcap_freekv_step_done(fs[i]), KVCAP_OK);
    }
    struct kvcap_freekv_stats st[3];
    for (int i = 0; i < 3; i++)
        kvcap_freekv_stats(fs[i], &st[i]);
    for (int i = 1; i < 3; i++) {
        assert_int_equal(st[i].steps, st[0].steps);
        assert_int_equal(st[i].corrections, st[0].corrections);
        assert_int_equal(st[i].resyncs, st[0].resyncs);
        assert_int_equal(st[i].pages_recalled, st[0].pages_recalled);
        assert_int_equal(st[i].bytes_recalled, st[0].bytes_recalled);
        assert_int_equal(st[i].last_pages_recalled, st[0].last_pages_recalled);
        /* hidden or waited depends on the worker's timing, their sum does not */
        assert_int_equal(st[i].hidden + st[i].waited, st[0].hidden + st[0].waited);
    }
    /* both paths ran: speculation used on some head-steps, corrected on others; one resync per
     * head (the first step) */
    assert_true(st[0].corrections > 0 && st[0].corrections < (int64_t)kvh * (steps - 1));
    assert_int_equal(st[0].resyncs, kvh);
    assert_int_equal(st[0].waited, 0); /* inline */
    assert_int_equal(st[0].hidden + st[0].corrections + st[0].resyncs, (int64_t)kvh * steps);
    assert_true(st[0].pages_recalled > 0);
    /* queue one more job and free at once: free must wait for it */
    assert_int_equal(kvcap_freekv_step_done(fs[1]), KVCAP_OK);
    for (int i = 0; i < 3; i++) {
        kvcap_freekv_free(fs[i]);
        free(out[i]);
    }
    seq_free(&s);
    free(q);
    free(noise);
}

static void test_worker_matches_inline(void **state)
{
    (void)state;
    struct kvcap_freekv_worker *w = NULL;
    assert_int_equal(kvcap_freekv_worker_create(&w), KVCAP_OK);
    worker_case(w, 4, 4, 64, 16, KVCAP_DTYPE_F16);
    worker_case(w, 3, 7, 128, 32, KVCAP_DTYPE_F32);
    worker_case(w, 2, 1, 64, 1, KVCAP_DTYPE_BF16);
    kvcap_freekv_worker_free(w);
    kvcap_freekv_worker_free(NULL);
}

/* ---- in a cache: FreeKV holding a span, or the generated tokens too ---------------------- */

enum { CL = 2, CKV = 2, CG = 4, CD = 64, CSTEPS = 6, CROWS = 16, CCOLS = 16 };

struct cache_run {
    float out[CSTEPS][CL][CKV * CG * CD];
    struct kvcap_cache_stats st[CSTEPS]; /* after each step */
};

/* A cache (vision: freekv, text: full, generated: `generated`) with one 16x16 vision span per
 * layer in pages of 8 tokens, 1 sink and 1 window page, `budget` tokens (64: 6 ranked pages
 * of 30 candidates), threshold tau; CSTEPS decode steps, each appending one token per layer
 * and attending with queries that are fresh every step (moving) or the same every step. The
 * stats are read after every step, which waits for the background selections: the next step
 * finds them complete. The same seed gives every run the same data and queries. */
static void run_cache(const char *generated, int budget, float tau, int moving,
                      struct cache_run *res)
{
    const int n = CROWS * CCOLS, Hq = CKV * CG;
    char path[512], yaml[512];
    const char *t = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/test_freekv-%d.yaml", t ? t : "/tmp", (int)getpid());
    if (strcmp(generated, "all-full") == 0)
        snprintf(yaml, sizeof yaml, "policies: {vision: full, text: full, generated: full}\n");
    else
        snprintf(yaml, sizeof yaml,
                 "policies: {vision: freekv, text: full, generated: %s}\n"
                 "freekv: {page_size: 8, budget: %d, sink_pages: 1, window_pages: 1, tau: %g}\n",
                 generated, budget, (double)tau);
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fputs(yaml, fp);
    fclose(fp);
    struct kvcap_cache_params p;
    kvcap_cache_default_params(&p);
    struct kvcap_model_geometry g = {.name = "test", .n_layers = CL, .n_q_heads = Hq,
                                     .n_kv_heads = CKV, .head_dim = CD,
                                     .rope_type = KVCAP_ROPE_ROPE,
                                     .rope_pairing = KVCAP_ROPE_PAIRING_HALF, .rope_theta = 1e4};
    p.model = g;
    p.storage = KVCAP_DTYPE_F32;
    p.n_threads = 2; /* heads attended from two threads */
    p.config_path = path;
    struct kvcap_cache *c = NULL;
    enum kvcap_status cs = kvcap_cache_create(&p, &c);
    unlink(path);
    if (cs != KVCAP_OK)
        fail_msg("create: %s", kvcap_last_error());
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 77);
    /* keys: a new mean every page, so pages differ and the selection has something to rank */
    float *k = alloc_f((size_t)CKV * n * CD), *v = alloc_f((size_t)CKV * n * CD);
    float bias[CD];
    for (int l = 0; l < CL; l++) {
        for (int h = 0; h < CKV; h++)
            for (int i = 0; i < n; i++) {
                float *kr = k + ((size_t)h * n + i) * CD;
                if (i % 8 == 0)
                    fill_random(&r, bias, CD, 0.0, 1.0);
                fill_random(&r, kr, CD, 0.0, 0.3);
                for (int ch = 0; ch < CD; ch++)
                    kr[ch] += bias[ch];
            }
        fill_random(&r, v, (size_t)CKV * n * CD, 0.5, 1.0);
        struct kvcap_span_desc desc = {KVCAP_SPAN_VISION, n, CROWS, CCOLS, 0};
        struct kvcap_tensor_view kv = {k, NULL, 0, KVCAP_DTYPE_F32, (int64_t)n * CD, CD};
        struct kvcap_tensor_view vv = {v, NULL, 0, KVCAP_DTYPE_F32, (int64_t)n * CD, CD};
        assert_int_equal(kvcap_cache_add_span(c, 0, l, &desc, &kv, &vv), KVCAP_OK);
    }
    /* paging the span (f32 pages and their digests) is FreeKV's compression work; storing the
     * rows is not full's */
    struct kvcap_cache_stats st0;
    assert_int_equal(kvcap_cache_stats(c, &st0), KVCAP_OK);
    if (strcmp(generated, "all-full") == 0)
        assert_true(st0.compress_seconds == 0);
    else
        assert_true(st0.compress_seconds > 0);
    float q[CL][Hq * CD], tok[2 * CKV * CD];
    fill_random(&r, &q[0][0], (size_t)CL * Hq * CD, 0.0, 1.5);
    for (int step = 0; step < CSTEPS; step++) {
        for (int l = 0; l < CL; l++) {
            fill_random(&r, tok, 2 * CKV * CD, 0.0, 1.0);
            struct kvcap_tensor_view gk = {tok, NULL, 0, KVCAP_DTYPE_F32, CD, 0};
            struct kvcap_tensor_view gv = {tok + CKV * CD, NULL, 0, KVCAP_DTYPE_F32, CD, 0};
            assert_int_equal(kvcap_cache_append(c, 0, l, &gk, &gv), KVCAP_OK);
            if (moving && step > 0)
                fill_random(&r, q[l], (size_t)Hq * CD, 0.0, 1.5);
            assert_int_equal(kvcap_cache_attend(c, l, q[l], res->out[step][l]), KVCAP_OK);
        }
        assert_int_equal(kvcap_cache_stats(c, &res->st[step]), KVCAP_OK);
    }
    kvcap_cache_free(c);
    free(k);
    free(v);
}

static double max_abs_diff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

/* The counts of step `step` alone (differences of the cumulative stats). */
static void step_counts(const struct cache_run *x, int step, int64_t *hidden, int64_t *resel,
                        int64_t *corr, int64_t *waited)
{
    const struct kvcap_cache_stats *a = &x->st[step], *b = step > 0 ? &x->st[step - 1] : NULL;
    *hidden = a->freekv_hidden - (b ? b->freekv_hidden : 0);
    *resel = a->freekv_reselections - (b ? b->freekv_reselections : 0);
    *corr = a->freekv_corrections - (b ? b->freekv_corrections : 0);
    *waited = a->freekv_waited - (b ? b->freekv_waited : 0);
}

/* Static layout (only the vision span in FreeKV, generated tokens in full), queries that move:
 * τ = −1 attends the speculation (picked with the previous step's queries), τ = +1 corrects
 * every head-step (picks with the current ones). Outputs agree at the first step (both select
 * with the current queries) and differ after; the counts say which path served. */
static void test_static_layout_tau_decides(void **state)
{
    (void)state;
    static struct cache_run lo, hi;
    run_cache("full", 64, -1.0f, 1, &lo);
    run_cache("full", 64, 1.0f, 1, &hi);
    const int64_t HS = (int64_t)CL * CKV; /* head-steps per step */
    const size_t all = (size_t)CKV * CG * CD;
    int differ = 0;
    for (int step = 0; step < CSTEPS; step++) {
        double diff = 0;
        for (int l = 0; l < CL; l++)
            diff = fmax(diff, max_abs_diff(lo.out[step][l], hi.out[step][l], all));
        if (step == 0)
            assert_true(diff == 0); /* the same selection, the same code */
        else
            differ += diff > 1e-3;
        int64_t hid, res, cor, wai;
        step_counts(&lo, step, &hid, &res, &cor, &wai);
        assert_int_equal(res, step == 0 ? HS : 0); /* a static store keeps its speculation */
        assert_int_equal(cor, 0);
        assert_int_equal(hid, step == 0 ? 0 : HS);
        assert_int_equal(wai, 0);
        step_counts(&hi, step, &hid, &res, &cor, &wai);
        assert_int_equal(res, step == 0 ? HS : 0);
        assert_int_equal(cor, step == 0 ? 0 : HS);
        assert_int_equal(hid, 0);
        assert_int_equal(wai, 0);
    }
    /* at least most steps: a pick by fresh random queries differs from the previous one */
    if (differ < CSTEPS - 2)
        fail_msg("tau -1 and +1 differ at %d of %d steps", differ, CSTEPS - 1);
    assert_int_equal(lo.st[CSTEPS - 1].freekv_head_steps, HS * CSTEPS);
    assert_int_equal(hi.st[CSTEPS - 1].freekv_corrections, HS * (CSTEPS - 1));
    assert_int_equal(lo.st[CSTEPS - 1].freekv_corrections, 0);
    /* the speculation recalls what the moving queries pick anew */
    assert_true(lo.st[CSTEPS - 1].freekv_pages_recalled > lo.st[0].freekv_pages_recalled);
}

/* Queries that stay the same: after the first step every head-step is served by the
 * speculation, complete before it was needed, in both layouts; no re-selection, no correction
 * (cosine 1 >= τ = 0.9). */
static void test_same_queries_hidden(void **state)
{
    (void)state;
    static struct cache_run x;
    const char *layouts[2] = {"full", "freekv"};
    const int64_t HS = (int64_t)CL * CKV;
    for (int i = 0; i < 2; i++) {
        run_cache(layouts[i], 64, 0.9f, 0, &x);
        const struct kvcap_cache_stats *last = &x.st[CSTEPS - 1];
        assert_int_equal(last->freekv_head_steps, HS * CSTEPS);
        assert_int_equal(last->freekv_reselections, HS);
        assert_int_equal(last->freekv_hidden, HS * (CSTEPS - 1));
        assert_int_equal(last->freekv_hidden + last->freekv_reselections +
                             last->freekv_corrections + last->freekv_waited,
                         last->freekv_head_steps);
        assert_int_equal(last->freekv_corrections, 0);
        assert_int_equal(last->freekv_waited, 0);
        for (int step = 1; step < CSTEPS; step++) {
            int64_t hid, res, cor, wai;
            step_counts(&x, step, &hid, &res, &cor, &wai);
            assert_int_equal(hid, HS);
            assert_int_equal(res, 0);
        }
    }
}

/* Growing layout (generated tokens in FreeKV too), moving queries: the speculation serves at
 * τ = −1, every step corrects at τ = +1; and with a budget above every token, both layouts
 * give what `full` gives (every page attended once, whatever served the selection). */
static void test_growing_layout_and_full_budget(void **state)
{
    (void)state;
    static struct cache_run lo, hi, ref, big;
    const int64_t HS = (int64_t)CL * CKV;
    const size_t all = (size_t)CKV * CG * CD;
    run_cache("freekv", 64, -1.0f, 1, &lo);
    run_cache("freekv", 64, 1.0f, 1, &hi);
    const struct kvcap_cache_stats *a = &lo.st[CSTEPS - 1], *b = &hi.st[CSTEPS - 1];
    assert_int_equal(a->freekv_reselections, HS);
    assert_int_equal(a->freekv_hidden, HS * (CSTEPS - 1));
    assert_int_equal(a->freekv_corrections, 0);
    assert_int_equal(b->freekv_reselections, HS);
    assert_int_equal(b->freekv_corrections, HS * (CSTEPS - 1));
    assert_int_equal(b->freekv_hidden, 0);
    int differ = 0;
    for (int step = 1; step < CSTEPS; step++)
        for (int l = 0; l < CL; l++)
            differ += max_abs_diff(lo.out[step][l], hi.out[step][l], all) > 1e-3;
    assert_true(differ > 0);
    run_cache("all-full", 0, 0.0f, 1, &ref);
    const char *layouts[2] = {"full", "freekv"};
    for (int i = 0; i < 2; i++) {
        run_cache(layouts[i], 1 << 20, -1.0f, 1, &big);
        for (int step = 0; step < CSTEPS; step++)
            for (int l = 0; l < CL; l++) {
                char what[96];
                snprintf(what, sizeof what, "full budget, generated: %s, step %d layer %d",
                         layouts[i], step, l);
                assert_close(big.out[step][l], ref.out[step][l], all, OUT_REL_TOL, what);
            }
        assert_int_equal(big.st[CSTEPS - 1].freekv_hidden, HS * (CSTEPS - 1));
    }
}

/* ---- arguments ------------------------------------------------------------------------------ */

static void check_bad(const struct kvcap_freekv_params *p, int kvh, int G, int d,
                      enum kvcap_dtype dt, const char *field)
{
    static char sentinel;
    struct kvcap_freekv *f = (struct kvcap_freekv *)(void *)&sentinel; /* must be cleared */
    assert_int_equal(kvcap_freekv_create(p, kvh, G, d, dt, NULL, &f), KVCAP_ERR_INVALID_ARGUMENT);
    assert_null(f);
    if (!strstr(kvcap_last_error(), field))
        fail_msg("error \"%s\" does not name %s", kvcap_last_error(), field);
}

static void test_bad_params(void **state)
{
    (void)state;
    struct kvcap_freekv_params def = kvcap_freekv_default_params(), p;
    assert_int_equal(def.page_size, 32);
    assert_int_equal(def.budget_tokens, 2048);
    assert_int_equal(def.sink_pages, 1);
    assert_int_equal(def.window_pages, 2);
    assert_true(def.tau == 0.9f);
    p = def, p.page_size = 0;
    check_bad(&p, 2, 4, 64, KVCAP_DTYPE_F16, "page_size");
    p = def, p.budget_tokens = 4 * 32 - 1; /* one token short of sink + window + 1 pages */
    check_bad(&p, 2, 4, 64, KVCAP_DTYPE_F16, "budget_tokens");
    p = def, p.sink_pages = -1;
    check_bad(&p, 2, 4, 64, KVCAP_DTYPE_F16, "sink_pages");
    p = def, p.window_pages = 0;
    check_bad(&p, 2, 4, 64, KVCAP_DTYPE_F16, "window_pages");
    p = def, p.tau = NAN;
    check_bad(&p, 2, 4, 64, KVCAP_DTYPE_F16, "tau");
    check_bad(&def, 0, 4, 64, KVCAP_DTYPE_F16, "kv_heads");
    check_bad(&def, 2, 0, 64, KVCAP_DTYPE_F16, "G =");
    check_bad(&def, 2, 4, 0, KVCAP_DTYPE_F16, "d =");
    check_bad(&def, 2, 4, 64, KVCAP_DTYPE_F64, "storage");
    check_bad(NULL, 2, 4, 64, KVCAP_DTYPE_F16, "params");

    /* the smallest budget is fine; calls on it check their arguments */
    p = def, p.budget_tokens = 4 * 32;
    struct kvcap_freekv *f = NULL;
    assert_int_equal(kvcap_freekv_create(&p, 2, 4, 64, KVCAP_DTYPE_F16, NULL, &f), KVCAP_OK);
    float x[2 * 64] = {0};
    assert_int_equal(kvcap_freekv_append(f, x, x, -1), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_freekv_append(f, NULL, x, 1), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_freekv_append(NULL, x, x, 1), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_freekv_append(f, NULL, NULL, 0), KVCAP_OK);
    assert_int_equal(kvcap_freekv_step_done(NULL), KVCAP_ERR_INVALID_ARGUMENT);
    struct part pt = part_new(4, 64);
    float q[4 * 64] = {0};
    uint64_t bytes = 1;
    assert_int_equal(kvcap_freekv_attend(f, 2, q, 1.0f, pt.p, &bytes), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(bytes, 0);
    assert_non_null(strstr(kvcap_last_error(), "h out of range"));
    bytes = 1;
    assert_int_equal(kvcap_freekv_attend(f, 0, q, 1.0f, pt.p, &bytes), KVCAP_OK);
    assert_int_equal(bytes, 0); /* nothing stored */
    assert_true(isinf(pt.p.mx[0]) && pt.p.sum[0] == 0);
    assert_int_equal(kvcap_freekv_selection(f, 5, NULL, 0), -1);
    kvcap_freekv_free(f);
    kvcap_freekv_free(NULL);
    free(pt.buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_params),
        cmocka_unit_test(test_select_ref_by_hand),
        cmocka_unit_test(test_select_matches_ref),
        cmocka_unit_test(test_scripted_stats),
        cmocka_unit_test(test_tau_one_follows_current_queries),
        cmocka_unit_test(test_tau_minus_one_follows_previous_queries),
        cmocka_unit_test(test_full_budget_is_plain_attention),
        cmocka_unit_test(test_worker_matches_inline),
        cmocka_unit_test(test_static_layout_tau_decides),
        cmocka_unit_test(test_same_queries_hidden),
        cmocka_unit_test(test_growing_layout_and_full_budget),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
