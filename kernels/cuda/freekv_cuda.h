/* freekv_cuda.h — FreeKV (DESIGN §7) on a CUDA device for one (sequence, layer): the host
 * store in pinned memory, the page pool, the digests, the selection, the recall and the
 * attention over the selected pages (kernels/cuda/freekv.cu). The selection's oracle is
 * kernels/freekv.h (kvcap_freekv_select_ref) and the CPU state of runtime/freekv.h is the
 * state's: same parameters, same selection rule, same fill rule for the pool buffers, same
 * statistics. Built only with CUDA.
 *
 * Memory (all allocated at create, sized for `max_tokens`; nothing is allocated per step):
 *  - store, pinned host memory (cudaHostAlloc, mapped): pages of page_size tokens, HND within a
 *    page ([kv_heads][2][page_size][d] in the storage dtype), so one page of one head is one
 *    contiguous copy. Every appended token is written here.
 *  - pool, device, NHD ([slot][page_size][kv_heads][d] for K and for V): sink_pages slots for
 *    the sink pages, window_pages slots used as a ring for the window (page p >= sink_pages
 *    lives in ring slot p mod window_pages while it is in the window), then two buffers of
 *    `slots` top-k slots (slots = min(k, the candidates max_tokens + 1 tokens can have), where
 *    k = budget_tokens / page_size − sink_pages − window_pages). Per KV head, buffer cur[h]
 *    serves this step; the other receives the next step's speculative selection.
 *  - digests, device: kmax, kmin [kv_heads][pages][d] f32 of the keys as stored, updated by a
 *    kernel on append.
 *
 * One decode step, per state (every call enqueues on the caller's `stream`, a cudaStream_t as
 * void *; no call of the step synchronises the host or allocates):
 *  1. kvcap_cuda_freekv_attend(q for every KV head): a check kernel computes, per KV head, the
 *     group-mean cosine of q_t and q_{t−1} in double (as the CPU does) and sets a device flag
 *     when it is below tau (or tau >= 1, or the speculation is invalid: a resync). Selection
 *     (scores + kvcap_cuda_topk) and recall then run for the flagged heads only: the kernels
 *     read the flag, so the decision never goes through the host. The corrective recall is a
 *     device-side gather: a kernel reads the missing pages straight from the mapped pinned
 *     store (zero-copy over PCIe) into the pool, for corrected heads only. Then flash-decoding
 *     over each head's sinks, top-k slots and window (kvcap_cuda_attend_rows with one problem
 *     per page, merged into the caller's partials by log-sum-exp).
 *  2. kvcap_cuda_freekv_step_done: on an internal stream, after the step's corrections,
 *     selection with q_t for one token more, and an asynchronous copy of the picks and of the
 *     pool bookkeeping to pinned host memory.
 *  3. The next kvcap_cuda_freekv_append (which may synchronise: it is not part of a step) waits
 *     for that copy, plans the fill of each head's other buffer on the host
 *     (kvcap_cuda_freekv_plan_fill, the CPU's rule) and enqueues the speculative recall: pages
 *     already in a pool buffer move device-to-device (one kernel, in slot order), the others
 *     are copied host→device with cudaMemcpyAsync from the pinned HND pages into two staging
 *     buffers used alternately on two streams, each followed by a scatter kernel HND → NHD
 *     slots. The next attend's stream waits for it with an event. The host learns the
 *     speculative picks only here, because cudaMemcpyAsync needs its addresses on the host;
 *     putting the wait in append keeps it out of the decode step, and the copies overlap
 *     whatever the device still runs of the previous step (the rest of its layers).
 *  A step whose attend was not preceded by exactly one appended token (or whose previous step
 *  planned nothing) resyncs: every head selects and gathers on the critical path. A speculative
 *  recall still pending at such an attend is dropped (neither run nor counted). Here the device
 *  differs from the CPU state, which keeps its speculation when the store grew by up to
 *  window_pages candidate pages or did not grow (it attends the grown pages whole from its
 *  store; the device's ring holds only the window): the outputs are the same, exact over the
 *  pages picked, but such a step counts resyncs here where the CPU counts corrections or hidden
 *  head-steps, and a store that does not grow between steps never keeps a speculation.
 *
 * Threads: a state is used by one host thread at a time; calls on it must be serialised.
 * Streams: every call of a step may get a different `stream`; the state orders its internal
 * streams after the caller's work with events. The device current at create must be current at
 * every call. */
#ifndef KVCAP_FREEKV_CUDA_H
#define KVCAP_FREEKV_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvcap.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "kernels/attention.h" /* struct kvcap_partial */
#include "kernels/freekv.h"    /* struct kvcap_freekv_params, struct kvcap_freekv_stats */

/* ---- Host-side layout and bookkeeping (no device touched; testable anywhere) ---------------- */

/* The sizes a state with these arguments has. */
struct kvcap_cuda_freekv_layout {
    int k;            /* top-k pages per head by the budget (may exceed what the store can fill) */
    int slots;        /* top-k slots per head and buffer actually allocated */
    int cap_pages;    /* store pages: ceil(max_tokens / page_size) */
    int pool_slots;   /* sink_pages + window_pages + 2 · slots */
    int attend_pages; /* pages one head attends at most: sink_pages + slots + window_pages */
    size_t row_bytes, page_head_bytes; /* d · es; one page of one head, K and V: 2·ps·row */
    uint64_t host_bytes;   /* pinned: the store and the bookkeeping mirror */
    uint64_t device_bytes; /* pool, digests, selection scratch, attention scratch, staging */
};

/* Checks the arguments of kvcap_cuda_freekv_create and computes the layout. The same checks as
 * kvcap_freekv_create (KVCAP_ERR_INVALID_ARGUMENT naming the parameter), then the device
 * kernels' limits (KVCAP_ERR_UNSUPPORTED naming them: G <= 16, d a multiple of 8 in 64..256,
 * kv_heads · attend_pages <= 65535), max_tokens >= 1 and a layout that does not overflow. */
enum kvcap_status kvcap_cuda_freekv_layout(const struct kvcap_freekv_params *p, int kv_heads,
                                           int G, int d, enum kvcap_dtype storage, int max_tokens,
                                           struct kvcap_cuda_freekv_layout *out);

/* What happens to one top-k slot when a buffer is filled. */
enum kvcap_cuda_freekv_op_kind {
    KVCAP_CUDA_FREEKV_OTHER = 1, /* copy from slot `src` of the other buffer (device to device) */
    KVCAP_CUDA_FREEKV_SAME = 2,  /* copy from slot `src` >= n of this buffer */
    KVCAP_CUDA_FREEKV_STORE = 3  /* recall `page` from the host store */
};

struct kvcap_cuda_freekv_op {
    int kind; /* enum kvcap_cuda_freekv_op_kind */
    int slot; /* destination slot in the buffer being filled */
    int src;  /* source slot (OTHER, SAME), -1 for STORE */
    int page;
};

/* The fill rule of the CPU state (runtime/freekv.c, fill) for one head: the pages pick[0..n)
 * go to slots 0..n−1 of the buffer being filled, in any order. A page already in one of those
 * slots stays there; the others take, in pick order, the slots freed (lowest first), each
 * copied from a slot of the other buffer holding it, else from a slot >= n of this buffer
 * holding it, else recalled from the store. So a fill costs the pages that changed, and no op
 * reads a slot an op writes: the ops may run in any order. slot_b [slots] (the buffer's pages,
 * -1 = empty) is updated to the result; slot_o [slots] is the other buffer. The ops (at most n)
 * go to ops; *n_ops receives their count, *recalled the STORE ones. KVCAP_ERR_INVALID_ARGUMENT
 * for NULL arrays, n outside 0..slots, a pick out of 0..max_page or two equal picks. */
enum kvcap_status kvcap_cuda_freekv_plan_fill(const int *pick, int n, int *slot_b,
                                              const int *slot_o, int slots, int max_page,
                                              struct kvcap_cuda_freekv_op *ops, int *n_ops,
                                              int *recalled);

/* ---- The device state ----------------------------------------------------------------------- */

/* The CPU's counts (struct kvcap_freekv_stats, same meanings) plus the overlap of the
 * speculative recall with the decode step:
 *  - spec_recalls: steps whose attend used a speculative recall enqueued by append;
 *  - spec_hidden: those of them whose recall was complete before the step needed it. Measured
 *    with two timed CUDA events: one recorded on the recall stream after its last copy and
 *    scatter (the recall's completion), one recorded on the attend's stream just before that
 *    stream waits for the recall (the moment every earlier piece of work on it — the engine's
 *    previous layers, the append — had finished, i.e. when the attention could have started).
 *    Hidden means cudaEventElapsedTime(recall done → attention ready) >= 0: the wait cost
 *    nothing. The events' resolution is about half a microsecond.
 * last_* are those of the most recent step, as on the CPU; the speculative recall that a
 * step_done planned counts into that step once it was enqueued (by the next append or by the
 * stats call itself). */
struct kvcap_cuda_freekv_stats {
    struct kvcap_freekv_stats base;
    int64_t spec_recalls, spec_hidden;
};

struct kvcap_cuda_freekv;

/* A state for kv_heads KV heads of G query heads, head_dim d, storage F32/F16/BF16, holding at
 * most max_tokens tokens. Allocates the pinned store (mapped), one device block, the staging
 * buffers, four streams and the events; synchronises nothing else. Checks as
 * kvcap_cuda_freekv_layout; KVCAP_ERR_UNSUPPORTED without a device; KVCAP_ERR_OUT_OF_MEMORY /
 * KVCAP_ERR_DEVICE naming the CUDA call. *out is owned by the caller (NULL on failure). */
enum kvcap_status kvcap_cuda_freekv_create(const struct kvcap_freekv_params *p, int kv_heads,
                                           int G, int d, enum kvcap_dtype storage, int max_tokens,
                                           struct kvcap_cuda_freekv **out);

/* Waits for every piece of work of the state, then frees it. NULL is a no-op. */
void kvcap_cuda_freekv_free(struct kvcap_cuda_freekv *f);

/* Appends n tokens: k, v device [kv_heads][n][d] in `dtype` (F32 or the storage dtype). Enqueued
 * on `stream` after the caller's work: conversion to the storage dtype into the device sink or
 * window slots (tokens of pages that stay on the device) and a device staging copy, the digest
 * update, then a device→host copy of the new rows into the store on an internal copy stream.
 * Before that it synchronises with the state's earlier internal work and enqueues the
 * speculative recall the last step_done planned (see above). k and v may be reused once
 * `stream` has passed the call. KVCAP_ERR_INVALID_ARGUMENT for NULL arguments, n < 0, a dtype
 * other than F32 or the storage dtype, or more than max_tokens tokens in all. */
enum kvcap_status kvcap_cuda_freekv_append(struct kvcap_cuda_freekv *f, const void *k,
                                           const void *v, enum kvcap_dtype dtype, int n,
                                           void *stream);
int64_t kvcap_cuda_freekv_tokens(const struct kvcap_cuda_freekv *f);

/* Decode attention of every KV head: q device [kv_heads][G][d] f32 (rotated at its position),
 * scores (q·k)·scale, folded into acc (device partials of kv_heads·G rows, [kv_heads][G]: mx,
 * sum, o [..][d]) like kvcap_cuda_attend_rows. Selection, correction and recall as described
 * above; with a budget covering every token it is plain attention over all of them. Once per
 * step (a second call before step_done is KVCAP_ERR_INVALID_ARGUMENT). With nothing stored,
 * acc is left as it is. q may be reused once `stream` has passed the call. */
enum kvcap_status kvcap_cuda_freekv_attend(struct kvcap_cuda_freekv *f, const float *q,
                                           float scale, struct kvcap_partial acc, void *stream);

/* Closes the step: enqueues the next step's selection (with this step's queries) on an internal
 * stream that first waits for this step's corrections on `stream`. Nothing to plan when the
 * step had no attend. */
enum kvcap_status kvcap_cuda_freekv_step_done(struct kvcap_cuda_freekv *f, void *stream);

/* Synchronises (the state's streams and the work it enqueued on the callers' streams),
 * enqueues a pending speculative recall first so that its pages are counted as on the CPU,
 * and reads the device counters. */
enum kvcap_status kvcap_cuda_freekv_stats(struct kvcap_cuda_freekv *f,
                                          struct kvcap_cuda_freekv_stats *out);

/* Bytes held: pinned host memory and device memory (the layout's, plus append's staging). */
void kvcap_cuda_freekv_bytes_held(const struct kvcap_cuda_freekv *f, uint64_t *host,
                                  uint64_t *device);

/* Inspection (tests, reports); they synchronise. The digest of `page` for KV head h (kmax,
 * kmin host [d]); and the top-k pages, ascending, that head h attended from the pool at the
 * latest attend (sinks and window not included), at most `cap` written to host `pages`;
 * returns their count (-1 on a bad argument or a device error, recorded for
 * kvcap_last_error). */
enum kvcap_status kvcap_cuda_freekv_digest(struct kvcap_cuda_freekv *f, int h, int page,
                                           float *kmax, float *kmin);
int kvcap_cuda_freekv_selection(struct kvcap_cuda_freekv *f, int h, int *pages, int cap);

#ifdef __cplusplus
}
#endif

#endif
