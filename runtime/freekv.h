/* freekv.h — FreeKV (DESIGN §7) for one (sequence, layer): every token the cache routes to
 * FreeKV lives in a paged host store (HND pages: [kv_heads][2][page_size][d], so one page of
 * one head is one contiguous copy); each step attends, per KV head, over its sink pages, its
 * recent window pages and its top-k pages by group-consistent digest score, held in a page
 * pool (on a CPU per head: [kv_heads][slot][page_size][d] for K and for V) within a token
 * budget. Selection is speculative: step t uses the pages selected with q_{t−1}; selection
 * with q_t and the recall of missing pages for step t+1 run off the critical path (a worker
 * thread, two pool buffers alternating), whether the store grows every step (generated tokens
 * in FreeKV) or not (only a span in FreeKV). A KV head whose group-mean query cosine between
 * steps is below τ is corrected: selected and recalled before its attention. On CPU "device"
 * and "host" are both host memory. The device state (kernels/cuda/freekv_cuda.h) follows the
 * same rules except that it still resyncs every head on a step not preceded by exactly one
 * appended token, and keeps its slots in ascending page order. */
#ifndef KVCAP_FREEKV_H
#define KVCAP_FREEKV_H

#include <stdint.h>

#include "kernels/attention.h"
#include "kernels/freekv.h"

/* One background thread shared by every FreeKV state of a cache; runs queued next-step
 * selections in submission order. On Linux it runs under SCHED_BATCH, so waking it never
 * preempts the thread running the decode step. Free it after the states that use it. */
struct kvcap_freekv_worker;
enum kvcap_status kvcap_freekv_worker_create(struct kvcap_freekv_worker **out);
void kvcap_freekv_worker_free(struct kvcap_freekv_worker *w); /* drains its queue first */

struct kvcap_freekv;

/* A state for kv_heads KV heads of G query heads each, head_dim d (1..4096), rows stored in
 * `storage` (F32/F16/BF16). worker NULL: the next-step selection runs inline in step_done
 * (tests). The worker is borrowed and must outlive the state. Every call on a state other than
 * attend (which may run concurrently for different heads) must not overlap another call on it. */
enum kvcap_status kvcap_freekv_create(const struct kvcap_freekv_params *p, int kv_heads, int G,
                                      int d, enum kvcap_dtype storage,
                                      struct kvcap_freekv_worker *worker,
                                      struct kvcap_freekv **out);
void kvcap_freekv_free(struct kvcap_freekv *f); /* waits for its background work; NULL ok */

/* Appends n tokens after those held: k, v [kv_heads][n][d] f32. Waits for this state's
 * background work first (the store may grow). */
enum kvcap_status kvcap_freekv_append(struct kvcap_freekv *f, const float *k, const float *v,
                                      int n);
int64_t kvcap_freekv_tokens(const struct kvcap_freekv *f);

/* Decode attention of KV head h: its G queries q [G][d] f32 (rotated at their position),
 * scores (q·k)·scale, folded into acc: over the sink pages, the top-k pages of a selection, and
 * the window. The selection is the speculative one (made with the previous step's queries by
 * step_done) unless the head must correct (group-mean cosine with the previous step's queries
 * below τ) or has none usable (a resync, see the stats); then it selects with q here. A
 * speculative selection made for a smaller store than the current one is completed by
 * attending the pages it did not rank as window pages: the window starts at the end of the
 * candidates it was made among (kvcap_freekv_window_start). With budget >= all tokens, every
 * token is attended (equal to `full`). May be called concurrently for different h of the same
 * state, never twice for one h in a step. *read (may be NULL): the bytes of K/V read by
 * attention plus those of the digests read by a selection made here (recall copies are counted
 * in the stats); 0 with nothing stored. A bad argument or a kernel's failure (working memory)
 * is a status; `acc` is then incomplete and must not be used. */
enum kvcap_status kvcap_freekv_attend(struct kvcap_freekv *f, int h, const float *q,
                                      float scale, struct kvcap_partial acc, uint64_t *read);

/* After every KV head of this step attended: selection with this step's queries for the next
 * step and recall of its missing pages into the other pool buffer, queued on the worker (or
 * run inline). The selection is made for the store the next step is expected to have: one
 * token more when the store grew since the previous step_done, the same size when it did not
 * (a store holding only a span). */
enum kvcap_status kvcap_freekv_step_done(struct kvcap_freekv *f);

/* Bytes allocated: store + pool buffers + digests. The pool grows with the store, up to the
 * k = budget/page_size − sinks − window pages per head and buffer it can ever need. */
uint64_t kvcap_freekv_bytes_held(const struct kvcap_freekv *f);
/* Waits for the state's background work, so the counts include the last queued recall. */
void kvcap_freekv_stats(const struct kvcap_freekv *f, struct kvcap_freekv_stats *out);

/* Inspection (tests, reports); wait for background work, not concurrent with attend. The
 * digest of `page` for KV head h (kmax, kmin [d]: per-channel max and min of its stored keys,
 * the filled rows only); the top-k pages, ascending, that head h attended from the pool at
 * its latest attend (sinks and window not included), at most `cap` of them written, returns
 * their count (-1 on a bad argument); and the first page of the window that attend read from
 * the store (pages_for(tokens) − window_pages unless a speculation for a smaller store
 * extended it; -1 on a bad argument). */
enum kvcap_status kvcap_freekv_digest(const struct kvcap_freekv *f, int h, int page, float *kmax,
                                      float *kmin);
int kvcap_freekv_selection(const struct kvcap_freekv *f, int h, int *pages, int cap);
int kvcap_freekv_window_start(const struct kvcap_freekv *f, int h);

#endif
