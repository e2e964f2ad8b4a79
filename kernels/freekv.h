/* freekv.h — FreeKV's page selection (DESIGN §7), the op under the paged store of
 * runtime/freekv.h and its device twin kernels/cuda/freekv.cu: each page of a KV head keeps a
 * digest (per-channel max and min of its keys); a page's score for a query group is the mean
 * over the group of the softmax over pages of Σ_c max(q_c·kmax_c, q_c·kmin_c); the top k
 * pages among those that are neither sinks nor window are attended. Also the parameters and
 * counts the store and its device form share, and the group-mean query cosine that decides a
 * correction. The readable oracle comes first. */
#ifndef KVCAP_KERNELS_FREEKV_H
#define KVCAP_KERNELS_FREEKV_H

#include <stdint.h>

struct kvcap_freekv_params {
    int page_size;     /* tokens per page, >= 1 (32) */
    int budget_tokens; /* tokens attended per KV head per step, sinks + window + top-k (2048);
                        * at least (sink_pages + window_pages + 1) pages */
    int sink_pages;    /* first pages, always attended, >= 0 (1) */
    int window_pages;  /* last pages (the newest, partial one included), always attended, >= 1:
                        * the page being written is never a top-k candidate (2) */
    float tau;         /* correction threshold on the group-mean query cosine (0.9);
                        * tau >= 1: every step corrects; tau <= -1: no step does */
};

/* The defaults written in parentheses above. */
struct kvcap_freekv_params kvcap_freekv_default_params(void);

/* Counts over (step, KV head) pairs since creation; last_*: the most recent step only (its
 * attends and the recall its step_done queued). Every head-step of a non-empty store is exactly
 * one of: hidden, waited, a correction, a resync.
 *  - hidden: served by the speculative selection (and its recall) made with the previous
 *    step's queries, which had completed before the attend came. A state without a worker runs
 *    it inside step_done, so there it is always complete (tests).
 *  - waited: served by the speculative selection, but attend had to wait for the worker to
 *    finish it (the wait is on the critical path, the selection's work partly too).
 *  - correction: a speculative selection existed, but the head's group-mean query cosine was
 *    below τ: selected and recalled with the current queries on the critical path.
 *  - resync (a re-selection): no usable speculative selection — the head's first step, a step
 *    after one it skipped, or a store that grew by more than window_pages candidate pages since
 *    the selection (see attend) — selected with the current queries on the critical path, like
 *    a correction, but not counted as one. A store that grew less (one token per step, or a
 *    store that does not grow at all) keeps its speculation. */
struct kvcap_freekv_stats {
    int64_t steps;          /* kvcap_freekv_step_done calls */
    int64_t corrections;    /* head-steps corrected on the critical path */
    int64_t pages_recalled; /* pages copied store → pool (speculative, corrective, resync);
                             * pages found in a pool buffer are moved there, not counted */
    uint64_t bytes_recalled;
    int last_corrections, last_pages_recalled;
    uint64_t last_bytes_recalled;
    int64_t resyncs;
    int last_resyncs;
    int64_t hidden, waited;
    int last_hidden, last_waited;
};

/* ---- Selection ------------------------------------------------------------------------- */

/* Oracle of the selection for one KV head over `n_pages` pages: digests kmax, kmin
 * [n_pages][d]; q [G][d]. Page score = mean over g of softmax over pages of
 * Σ_c max(q_gc·kmax_c, q_gc·kmin_c); the top `k` pages among those that are neither sinks
 * (the first sink_pages) nor window (the last window_pages) go to sel (ascending), returns
 * their count (all candidates when there are at most k; -1 when out of memory). Double
 * precision, no shortcuts. score (NULL: not wanted) receives [n_pages] the page scores, NaN for
 * sinks and window: tests use them to accept a different pick between near-equal pages. */
int kvcap_freekv_select_ref(const float *kmax, const float *kmin, int n_pages, const float *q,
                            int G, int d, int sink_pages, int window_pages, int k, int *sel,
                            double *score);

/* The fast selection over the candidate pages [lo, hi) of one KV head: digests `dig`
 * [pages][2][d] (kmax then kmin of each page), queries q [G][d]. Writes the top k candidates,
 * ascending, to sel and returns their count (every candidate, unscored, when there are at most
 * k). Ranks by the log of the mean over g of the per-g softmax (the oracle's order), accumulated
 * in log space so that far-below pages keep their order instead of underflowing to equal zeros.
 * Scratch: `score` 3·(hi − lo) floats, `qsplit` 2·d floats, `work` (hi − lo) ints. *bytes (may
 * be NULL) grows by the digest bytes read. */
int kvcap_freekv_select(const float *dig, int lo, int hi, const float *q, int G, int d, int k,
                        float *score, float *qsplit, int *work, int *sel, uint64_t *bytes);

/* Mean over g of cos(q_g, p_g) for two query groups [G][d], clamped to [-1, 1]; a zero vector
 * is at cosine 0 from anything but another zero vector (a head whose query vanished has moved). */
double kvcap_freekv_group_cosine(const float *q, const float *p, int G, int d);

#endif /* KVCAP_KERNELS_FREEKV_H */
