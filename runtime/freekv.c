/* freekv.c — FreeKV (DESIGN §7): a paged store with per-page key digests, a two-buffer page
 * pool filled by a speculative top-k selection on a worker thread, and a correction on the
 * critical path for the KV heads whose queries moved. The selection itself is a kernel
 * (kernels/freekv.h). */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/freekv.h"
#include "kernels/load.h"
#include "common/internal.h"
#include "common/dtype.h"

#define FREEKV_MAX_D 4096 /* the attention kernels' limit */

/* ---- state ---------------------------------------------------------------------------------- */

struct kvcap_freekv_worker {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake; /* a job was queued, or stopping */
    pthread_cond_t done; /* a job finished */
    struct kvcap_freekv *first, *last; /* FIFO of states with a queued job (intrusive) */
    int stopping;
};

/* Everything one KV head owns. attend(h) touches only its head (and reads the shared store),
 * which is what lets the runtime attend different heads from different threads. */
struct head {
    float *dig;    /* [cap_pages][2][d]: per-channel max then min of each page's stored keys */
    int *where[2]; /* [cap_pages]: a slot of pool buffer b holding page p, or -1 */
    int *slot[2];  /* [pool_slots]: the page slot s of buffer b holds, or -1 */
    int n_sel[2];  /* slots 0..n_sel[b)-1 of buffer b hold the selection made for it (any order) */
    int sel_hi[2]; /* the end of the candidate pages that selection was made among */
    int cur;       /* the buffer the latest attend used */
    int spec_valid; /* buffer 1-cur holds a speculative selection made after the latest attend */
    int att_lo, att_ws; /* the latest attend: sinks [0, att_lo), window [att_ws, pages) */
    float *q_cur, *q_prev;        /* [G][d] the queries of two consecutive steps */
    int64_t q_step, prev_step;    /* the steps they came from (-1: none) */
    int todo;                     /* attended in the step being closed: select for the next */
    /* scratch of the selection, sized at append */
    float *score;   /* [3][cap_pages] */
    int *work;      /* [cap_pages] */
    int *mark;      /* [cap_pages]: fill's marks, all zero between fills */
    int *pick;      /* [pool_slots] */
    int *free_slot; /* [pool_slots] */
    float *qsplit;  /* [2][d] */
    /* this step's critical-path counts, folded into the stats by step_done */
    int corrections, resyncs, recalled, hidden, waited;
};

struct kvcap_freekv {
    struct kvcap_freekv_params p;
    int kvh, G, d, k;
    enum kvcap_dtype dt;
    size_t es, page_bytes, row_bytes;
    struct kvcap_freekv_worker *worker;
    struct kvcap_freekv *next_job; /* the worker's queue link */
    atomic_int pending;            /* a job of this state is queued or running */
    int64_t tokens, step;
    int64_t done_tokens; /* the store's size at the latest step_done */
    int predict;         /* tokens the next step's store is expected to have more (0 or 1) */
    /* store: pages allocated one by one (never moved once written), HND within a page */
    unsigned char **pages;
    int n_alloc, cap_pages; /* pages allocated; capacity of `pages` and of per-head arrays */
    /* pool, HND per buffer: [kvh][pool_slots][page_size][d] for K and V, two buffers. A CPU
     * attends one head on one thread: its slots are one contiguous run of rows (one call, a
     * streaming read). A device pool is NHD instead (kernels/cuda/freekv_cuda.h), where the
     * heads of one token side by side coalesce. */
    unsigned char *pool_k[2], *pool_v[2];
    int pool_slots;
    struct head *heads;
    float *row; /* [d] append's scratch */
    struct kvcap_freekv_stats stats;
};

static int64_t pages_for(const struct kvcap_freekv *f, int64_t tokens)
{
    return (tokens + f->p.page_size - 1) / f->p.page_size;
}

/* Candidates of a store of np pages: [*lo, *hi). Sinks win over the window when they overlap. */
static void candidates(const struct kvcap_freekv *f, int np, int *lo, int *hi)
{
    *lo = f->p.sink_pages < np ? f->p.sink_pages : np;
    *hi = np - f->p.window_pages > *lo ? np - f->p.window_pages : *lo;
}

/* Top-k slots a store of np pages (and the next step's, np + 1) can need. */
static int slots_needed(const struct kvcap_freekv *f, int np)
{
    int lo, hi;
    candidates(f, np + 1, &lo, &hi);
    return hi - lo < f->k ? hi - lo : f->k;
}

/* ---- the worker ----------------------------------------------------------------------------- */

static void run_job(struct kvcap_freekv *f);

/* The worker must not take a core from the engine's threads. Woken at the end of an attend, a
 * normal thread may preempt the one that woke it (the one running the decode step), and the
 * selection it exists to take off the critical path lands back on it. SCHED_BATCH (Linux)
 * keeps the thread's fair share of the CPU but never preempts on wake-up; elsewhere, or if
 * refused, the thread keeps the default policy. */
static void worker_yield_on_wakeup(void)
{
#if defined(__linux__)
    struct sched_param sp;
    memset(&sp, 0, sizeof sp);
    (void)pthread_setschedparam(pthread_self(), 3 /* SCHED_BATCH: <sched.h> hides it without
                                                    * _GNU_SOURCE */, &sp);
#endif
}

static void *worker_main(void *arg)
{
    struct kvcap_freekv_worker *w = arg;
    worker_yield_on_wakeup();
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!w->first && !w->stopping)
            pthread_cond_wait(&w->wake, &w->lock);
        if (!w->first) /* stopping with the queue drained */
            break;
        struct kvcap_freekv *f = w->first;
        w->first = f->next_job;
        if (!w->first)
            w->last = NULL;
        pthread_mutex_unlock(&w->lock);
        run_job(f);
        pthread_mutex_lock(&w->lock);
        atomic_store(&f->pending, 0);
        pthread_cond_broadcast(&w->done);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

enum kvcap_status kvcap_freekv_worker_create(struct kvcap_freekv_worker **out)
{
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "freekv worker: NULL out");
    struct kvcap_freekv_worker *w = calloc(1, sizeof *w);
    KVCAP_RETURN_IF(!w, KVCAP_ERR_OUT_OF_MEMORY, "freekv worker: out of memory");
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->wake, NULL);
    pthread_cond_init(&w->done, NULL);
    if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
        pthread_cond_destroy(&w->wake);
        pthread_cond_destroy(&w->done);
        pthread_mutex_destroy(&w->lock);
        free(w);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "freekv worker: cannot start its thread");
    }
    *out = w;
    return KVCAP_OK;
}

void kvcap_freekv_worker_free(struct kvcap_freekv_worker *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->lock);
    w->stopping = 1;
    pthread_cond_broadcast(&w->wake);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->wake);
    pthread_cond_destroy(&w->done);
    pthread_mutex_destroy(&w->lock);
    free(w);
}

/* Returns once no job of f is queued or running. The unlocked check keeps attend lock-free in
 * the common case (the job finished long ago); the atomic orders the job's writes before it. */
static void wait_idle(struct kvcap_freekv *f)
{
    if (!f->worker || !atomic_load(&f->pending))
        return;
    pthread_mutex_lock(&f->worker->lock);
    while (atomic_load(&f->pending))
        pthread_cond_wait(&f->worker->done, &f->worker->lock);
    pthread_mutex_unlock(&f->worker->lock);
}

static void enqueue(struct kvcap_freekv *f)
{
    struct kvcap_freekv_worker *w = f->worker;
    pthread_mutex_lock(&w->lock);
    atomic_store(&f->pending, 1);
    f->next_job = NULL;
    if (w->last)
        w->last->next_job = f;
    else
        w->first = f;
    w->last = f;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
}

/* ---- create / free / grow ------------------------------------------------------------------- */

void kvcap_freekv_free(struct kvcap_freekv *f)
{
    if (!f)
        return;
    wait_idle(f);
    for (int i = 0; i < f->n_alloc; i++)
        free(f->pages[i]);
    free(f->pages);
    for (int b = 0; b < 2; b++) {
        free(f->pool_k[b]);
        free(f->pool_v[b]);
    }
    for (int h = 0; f->heads && h < f->kvh; h++) {
        struct head *hd = &f->heads[h];
        free(hd->dig);
        for (int b = 0; b < 2; b++) {
            free(hd->where[b]);
            free(hd->slot[b]);
        }
        free(hd->q_cur);
        free(hd->q_prev);
        free(hd->score);
        free(hd->work);
        free(hd->pick);
        free(hd->mark);
        free(hd->free_slot);
        free(hd->qsplit);
    }
    free(f->heads);
    free(f->row);
    free(f);
}

enum kvcap_status kvcap_freekv_create(const struct kvcap_freekv_params *p, int kv_heads, int G,
                                      int d, enum kvcap_dtype storage,
                                      struct kvcap_freekv_worker *worker,
                                      struct kvcap_freekv **out)
{
    if (out)
        *out = NULL;
    KVCAP_RETURN_IF(!p || !out, KVCAP_ERR_INVALID_ARGUMENT, "freekv: NULL %s",
                    !p ? "params" : "out");
    KVCAP_RETURN_IF(p->page_size < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv: page_size = %d, must be >= 1", p->page_size);
    KVCAP_RETURN_IF(p->sink_pages < 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv: sink_pages = %d, must be >= 0", p->sink_pages);
    KVCAP_RETURN_IF(p->window_pages < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv: window_pages = %d, must be >= 1 (the page being written)",
                    p->window_pages);
    int64_t fixed = (int64_t)p->sink_pages + p->window_pages;
    KVCAP_RETURN_IF((int64_t)p->budget_tokens < (fixed + 1) * p->page_size,
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv: budget_tokens = %d is below (sink_pages + window_pages + 1) pages "
                    "= %lld tokens",
                    p->budget_tokens, (long long)((fixed + 1) * p->page_size));
    KVCAP_RETURN_IF(!(p->tau == p->tau), KVCAP_ERR_INVALID_ARGUMENT, "freekv: tau is NaN");
    KVCAP_RETURN_IF(kv_heads < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv: kv_heads = %d, must be >= 1", kv_heads);
    KVCAP_RETURN_IF(G < 1, KVCAP_ERR_INVALID_ARGUMENT, "freekv: G = %d, must be >= 1", G);
    KVCAP_RETURN_IF(d < 1 || d > FREEKV_MAX_D, KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv: d = %d, must be in 1..%d", d, FREEKV_MAX_D);
    KVCAP_RETURN_IF(!kvcap_dtype_is_storage(storage), KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv: storage %s, must be F32, F16 or BF16", kvcap_dtype_name(storage));
    size_t row, page;
    KVCAP_RETURN_IF(!kvcap_mul_size((size_t)d, kvcap_dtype_size(storage), &row) ||
                        !kvcap_mul_size(row, (size_t)p->page_size, &page) ||
                        !kvcap_mul_size(page, 2 * (size_t)kv_heads, &page),
                    KVCAP_ERR_INVALID_ARGUMENT, "freekv: page of %d tokens too large",
                    p->page_size);

    struct kvcap_freekv *f = calloc(1, sizeof *f);
    KVCAP_RETURN_IF(!f, KVCAP_ERR_OUT_OF_MEMORY, "freekv: out of memory");
    f->p = *p;
    f->kvh = kv_heads;
    f->G = G;
    f->d = d;
    f->k = (int)(p->budget_tokens / p->page_size - fixed);
    f->dt = storage;
    f->es = kvcap_dtype_size(storage);
    f->row_bytes = row;
    f->page_bytes = page;
    f->worker = worker;
    atomic_init(&f->pending, 0);
    f->heads = calloc((size_t)kv_heads, sizeof *f->heads);
    f->row = malloc(sizeof(float) * (size_t)d);
    int ok = f->heads && f->row;
    for (int h = 0; ok && h < kv_heads; h++) {
        struct head *hd = &f->heads[h];
        hd->q_cur = malloc(sizeof(float) * (size_t)G * d);
        hd->q_prev = malloc(sizeof(float) * (size_t)G * d);
        hd->qsplit = malloc(sizeof(float) * 2 * (size_t)d);
        hd->q_step = hd->prev_step = -1;
        ok = hd->q_cur && hd->q_prev && hd->qsplit;
    }
    if (!ok) {
        kvcap_freekv_free(f);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "freekv: out of memory");
    }
    *out = f;
    return KVCAP_OK;
}

/* realloc that keeps p (and clears *ok) on failure, and does nothing once *ok is clear, so a
 * run of them needs one check at the end. */
static void *grow(void *p, size_t bytes, int *ok)
{
    if (!*ok)
        return p;
    void *n = realloc(p, bytes ? bytes : 1);
    if (!n) {
        *ok = 0;
        return p;
    }
    return n;
}

/* Room for np pages: page pointers, the pages themselves, per-head digests, maps and scratch
 * (np + 1 pages: the next step's selection may see one page more), and the pool slots the
 * selections can need. Called only from append, when nothing else runs on the state. */
static enum kvcap_status reserve(struct kvcap_freekv *f, int np)
{
    if (np + 1 > f->cap_pages) {
        int cap = f->cap_pages * 2 > np + 1 ? f->cap_pages * 2 : np + 1;
        if (f->cap_pages > INT_MAX / 2)
            cap = np + 1;
        size_t c = (size_t)cap, d = (size_t)f->d;
        int ok = 1;
        f->pages = grow(f->pages, sizeof *f->pages * c, &ok);
        for (int h = 0; h < f->kvh; h++) {
            struct head *hd = &f->heads[h];
            hd->dig = grow(hd->dig, sizeof(float) * 2 * d * c, &ok);
            hd->score = grow(hd->score, sizeof(float) * 3 * c, &ok);
            hd->work = grow(hd->work, sizeof(int) * c, &ok);
            hd->mark = grow(hd->mark, sizeof(int) * c, &ok);
            for (int i = f->cap_pages; ok && i < cap; i++)
                hd->mark[i] = 0;
            for (int b = 0; b < 2; b++) {
                hd->where[b] = grow(hd->where[b], sizeof(int) * c, &ok);
                for (int i = f->cap_pages; ok && i < cap; i++)
                    hd->where[b][i] = -1;
            }
        }
        /* what did grow stays grown; cap_pages only moves once every array did */
        KVCAP_RETURN_IF(!ok, KVCAP_ERR_OUT_OF_MEMORY, "freekv: out of memory for %d pages", cap);
        f->cap_pages = cap;
    }
    while (f->n_alloc < np) {
        f->pages[f->n_alloc] = malloc(f->page_bytes);
        KVCAP_RETURN_IF(!f->pages[f->n_alloc], KVCAP_ERR_OUT_OF_MEMORY,
                        "freekv: out of memory for page %d", f->n_alloc);
        f->n_alloc++;
    }
    int need = slots_needed(f, np);
    if (need > f->pool_slots) {
        int slots = f->pool_slots * 2 > need ? f->pool_slots * 2 : need;
        if (slots > f->k || f->pool_slots > INT_MAX / 2)
            slots = f->k > need ? f->k : need;
        /* per head contiguous: a larger pool is a new block, each head's filled slots copied */
        size_t head_bytes, bytes, ps_bytes = (size_t)f->p.page_size * f->row_bytes;
        KVCAP_RETURN_IF(!kvcap_mul_size((size_t)slots, ps_bytes, &head_bytes) ||
                            !kvcap_mul_size(head_bytes, (size_t)f->kvh, &bytes),
                        KVCAP_ERR_OUT_OF_MEMORY, "freekv: pool of %d pages too large", slots);
        unsigned char *nb[4] = {NULL, NULL, NULL, NULL};
        int ok = 1;
        for (int i = 0; i < 4; i++)
            ok = ok && (nb[i] = malloc(bytes ? bytes : 1)) != NULL;
        for (int h = 0; h < f->kvh; h++) {
            struct head *hd = &f->heads[h];
            hd->pick = grow(hd->pick, sizeof(int) * (size_t)slots, &ok);
            hd->free_slot = grow(hd->free_slot, sizeof(int) * (size_t)slots, &ok);
            for (int b = 0; b < 2; b++) {
                hd->slot[b] = grow(hd->slot[b], sizeof(int) * (size_t)slots, &ok);
                for (int s = f->pool_slots; ok && s < slots; s++)
                    hd->slot[b][s] = -1;
            }
        }
        if (!ok) {
            for (int i = 0; i < 4; i++)
                free(nb[i]);
            return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "freekv: out of memory for %d pool pages",
                              slots);
        }
        size_t old_head = (size_t)f->pool_slots * ps_bytes;
        for (int b = 0; b < 2; b++) {
            for (int h = 0; old_head > 0 && h < f->kvh; h++) {
                memcpy(nb[2 * b] + h * head_bytes, f->pool_k[b] + h * old_head, old_head);
                memcpy(nb[2 * b + 1] + h * head_bytes, f->pool_v[b] + h * old_head, old_head);
            }
            free(f->pool_k[b]);
            free(f->pool_v[b]);
            f->pool_k[b] = nb[2 * b];
            f->pool_v[b] = nb[2 * b + 1];
        }
        f->pool_slots = slots;
    }
    return KVCAP_OK;
}

/* ---- store ---------------------------------------------------------------------------------- */

/* Page p of head h: its K rows [page_size][d], its V rows right after. */
static unsigned char *store_k(const struct kvcap_freekv *f, int p, int h)
{
    return f->pages[p] + (size_t)h * 2 * f->p.page_size * f->row_bytes;
}

static unsigned char *store_v(const struct kvcap_freekv *f, int p, int h)
{
    return store_k(f, p, h) + (size_t)f->p.page_size * f->row_bytes;
}

enum kvcap_status kvcap_freekv_append(struct kvcap_freekv *f, const float *k, const float *v,
                                      int n)
{
    KVCAP_RETURN_IF(!f, KVCAP_ERR_INVALID_ARGUMENT, "freekv_append: NULL state");
    KVCAP_RETURN_IF(n < 0 || (n > 0 && (!k || !v)), KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv_append: n = %d with %s", n, !k ? "k NULL" : !v ? "v NULL" : "k, v");
    wait_idle(f);
    if (n == 0)
        return KVCAP_OK;
    int ps = f->p.page_size, d = f->d;
    int64_t total = f->tokens + n, np = pages_for(f, total);
    KVCAP_RETURN_IF(np > INT_MAX / 2, KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv_append: %lld tokens exceed the page count limit", (long long)total);
    KVCAP_TRY(reserve(f, (int)np));
    for (int h = 0; h < f->kvh; h++) {
        float *dig = f->heads[h].dig;
        for (int i = 0; i < n;) {
            int64_t t = f->tokens + i;
            int p = (int)(t / ps), r = (int)(t % ps), m = ps - r < n - i ? ps - r : n - i;
            size_t src = ((size_t)h * n + i) * d;
            unsigned char *kd = store_k(f, p, h) + (size_t)r * f->row_bytes;
            KVCAP_TRY(kvcap_convert_from_f32(f->dt, k + src, (size_t)m * d, kd));
            KVCAP_TRY(kvcap_convert_from_f32(f->dt, v + src, (size_t)m * d,
                                             store_v(f, p, h) + (size_t)r * f->row_bytes));
            /* the digest bounds the keys as stored, so it holds for what attention reads */
            float *kmax = dig + (size_t)p * 2 * d, *kmin = kmax + d;
            for (int j = 0; j < m; j++) {
                kvcap_load_f32(f->dt, kd + (size_t)j * f->row_bytes, (size_t)d, f->row);
                for (int c = 0; c < d; c++) {
                    float x = f->row[c];
                    if (r + j == 0 || x > kmax[c])
                        kmax[c] = x;
                    if (r + j == 0 || x < kmin[c])
                        kmin[c] = x;
                }
            }
            i += m;
        }
    }
    f->tokens = total;
    return KVCAP_OK;
}

int64_t kvcap_freekv_tokens(const struct kvcap_freekv *f)
{
    return f ? f->tokens : 0;
}

/* ---- selection and recall ------------------------------------------------------------------- */

/* The top-k pages of head h for a store of `tokens` tokens by the queries q [G][d], ascending,
 * into hd->pick; returns their count and adds the digest bytes read to *bytes. */
static int select_pages(const struct kvcap_freekv *f, struct head *hd, const float *q,
                        int64_t tokens, uint64_t *bytes)
{
    int lo, hi;
    candidates(f, (int)pages_for(f, tokens), &lo, &hi);
    return kvcap_freekv_select(hd->dig, lo, hi, q, f->G, f->d, f->k, hd->score, hd->qsplit,
                               hd->work, hd->pick, bytes);
}

/* Slot s of head h in pool buffer buf (K or V): page_size rows of d, one contiguous block. */
static unsigned char *pool_slot(const struct kvcap_freekv *f, unsigned char *buf, int h, int s)
{
    return buf + ((size_t)h * f->pool_slots + s) * f->p.page_size * f->row_bytes;
}

/* Puts head h's pages pick[0..n) into slots 0..n-1 of buffer b, in any order, touching only the
 * slots whose page changes: a page already in one of those slots stays where it is; the others
 * take the freed slots, copied from a slot of the other buffer (or from a slot >= n of this
 * one) that holds them — on a GPU, a device copy — else recalled from the store (one page of
 * one head is one contiguous copy of K and one of V), counted in *recalled. Candidate pages
 * are always full (the window holds the page being written). Keeping slots in place is what
 * makes a speculative fill cost the pages that changed, not every slot after the first change. */
static void fill(struct kvcap_freekv *f, int h, int b, int n, int *recalled)
{
    struct head *hd = &f->heads[h];
    size_t bytes = (size_t)f->p.page_size * f->row_bytes;
    int *mark = hd->mark, n_free = 0;
    for (int i = 0; i < n; i++)
        mark[hd->pick[i]] = 1; /* wanted */
    for (int s = 0; s < n; s++) {
        int p = hd->slot[b][s];
        if (p >= 0 && mark[p] == 1) {
            mark[p] = 2; /* in place */
            hd->where[b][p] = s;
        } else {
            hd->free_slot[n_free++] = s;
        }
    }
    /* Sources are slots of the other buffer or slots >= n of this one: never a destination. */
    for (int i = 0, j = 0; i < n; i++) {
        int p = hd->pick[i];
        if (mark[p] == 2)
            continue;
        int s = hd->free_slot[j++];
        unsigned char *dk = pool_slot(f, f->pool_k[b], h, s);
        unsigned char *dv = pool_slot(f, f->pool_v[b], h, s);
        int fb = hd->where[1 - b][p] >= 0 ? 1 - b : hd->where[b][p] >= n ? b : -1;
        if (fb >= 0) {
            int fs = hd->where[fb][p];
            memcpy(dk, pool_slot(f, f->pool_k[fb], h, fs), bytes);
            memcpy(dv, pool_slot(f, f->pool_v[fb], h, fs), bytes);
        } else {
            memcpy(dk, store_k(f, p, h), bytes);
            memcpy(dv, store_v(f, p, h), bytes);
            (*recalled)++;
        }
        int old = hd->slot[b][s];
        if (old >= 0 && hd->where[b][old] == s) /* another slot may hold a copy: keep that */
            hd->where[b][old] = -1;
        hd->slot[b][s] = p;
        hd->where[b][p] = s;
    }
    for (int i = 0; i < n; i++)
        mark[hd->pick[i]] = 0;
    hd->n_sel[b] = n;
}

static uint64_t recall_bytes(const struct kvcap_freekv *f, int pages)
{
    return (uint64_t)pages * 2 * f->p.page_size * f->row_bytes;
}

/* The end of the candidate pages of a store of `tokens` tokens. */
static int candidates_end(const struct kvcap_freekv *f, int64_t tokens)
{
    int lo, hi;
    candidates(f, (int)pages_for(f, tokens), &lo, &hi);
    return hi;
}

/* The next step's selection of every head that attended in the step just closed, with its
 * queries, into the buffer that step did not use. It is made for the store the next step is
 * expected to see: one token more if the store grew since the step before (generated tokens
 * go to FreeKV), the same size if it did not (FreeKV holds a span, the generated tokens live
 * elsewhere). With one token more the candidates may include the page that then leaves the
 * window; that page is full now (the store's size is then a multiple of page_size), so the
 * recall is exact. Either guess stays usable if it was wrong: see attend. */
static void run_job(struct kvcap_freekv *f)
{
    int recalled = 0;
    uint64_t digest_bytes = 0; /* read off the critical path: not reported by attend */
    int64_t tokens = f->tokens + f->predict;
    for (int h = 0; h < f->kvh; h++) {
        struct head *hd = &f->heads[h];
        if (!hd->todo)
            continue;
        hd->todo = 0;
        int n = select_pages(f, hd, hd->q_cur, tokens, &digest_bytes);
        fill(f, h, 1 - hd->cur, n, &recalled);
        hd->sel_hi[1 - hd->cur] = candidates_end(f, tokens);
        hd->spec_valid = 1;
    }
    f->stats.pages_recalled += recalled;
    f->stats.bytes_recalled += recall_bytes(f, recalled);
    f->stats.last_pages_recalled += recalled;
    f->stats.last_bytes_recalled += recall_bytes(f, recalled);
}

/* ---- decode --------------------------------------------------------------------------------- */

static int must_correct(const struct kvcap_freekv *f, const struct head *hd)
{
    if (f->p.tau >= 1)
        return 1;
    if (f->p.tau <= -1)
        return 0;
    if (hd->prev_step != f->step - 1 || hd->prev_step < 0) /* nothing to compare with */
        return 1;
    return kvcap_freekv_group_cosine(hd->q_cur, hd->q_prev, f->G, f->d) < f->p.tau;
}

/* The filled rows of page p of head h, straight from the store (sinks, window). */
static enum kvcap_status attend_store_page(const struct kvcap_freekv *f, int p, int h,
                                           const float *q, float scale,
                                           struct kvcap_partial acc, uint64_t *bytes)
{
    int64_t filled = f->tokens - (int64_t)p * f->p.page_size;
    struct kvcap_rows rows = {store_k(f, p, h), store_v(f, p, h), f->dt, (size_t)f->d,
                              filled < f->p.page_size ? (int)filled : f->p.page_size};
    uint64_t got;
    KVCAP_TRY(kvcap_attend_rows(&rows, q, f->G, f->d, scale, acc, &got));
    *bytes += got;
    return KVCAP_OK;
}

/* A speculative selection made among candidates [lo', sel_hi) stays exact for a store that has
 * grown since: the pages it did not see, [sel_hi, hi), are attended whole from the store as
 * part of the window (the window starts at min(sel_hi, hi)), so every page is either a sink, a
 * ranked pick or attended. That costs hi − sel_hi pages beyond the budget (with one token per
 * step and the one-token guess: none); up to window_pages of them it is accepted, beyond (a
 * span appended mid-decode) the head selects anew: a resync. Picks that have meanwhile become
 * sinks or window (a store that grew less than expected) are skipped: attended as such. */
enum kvcap_status kvcap_freekv_attend(struct kvcap_freekv *f, int h, const float *q,
                                      float scale, struct kvcap_partial acc, uint64_t *read)
{
    if (read)
        *read = 0;
    KVCAP_RETURN_IF(!f || h < 0 || h >= f->kvh || !q, KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv_attend: %s", !f ? "NULL state" : !q ? "NULL q" : "h out of range");
    /* the speculation was not ready yet: this head's step waits for it (not hidden) */
    int waited = f->worker && atomic_load(&f->pending);
    wait_idle(f);
    struct head *hd = &f->heads[h];
    size_t qn = (size_t)f->G * f->d;
    if (hd->q_step != f->step) { /* first attend of this step: this q becomes the previous */
        float *t = hd->q_prev;
        hd->q_prev = hd->q_cur;
        hd->q_cur = t;
        hd->prev_step = hd->q_step;
    }
    memcpy(hd->q_cur, q, sizeof(float) * qn);
    hd->q_step = f->step;
    if (f->tokens == 0)
        return KVCAP_OK;

    int np = (int)pages_for(f, f->tokens), lo, hi;
    candidates(f, np, &lo, &hi);
    uint64_t bytes = 0;
    int sync;
    if (hd->spec_valid && hi - hd->sel_hi[1 - hd->cur] <= f->p.window_pages) {
        hd->cur ^= 1; /* the speculative buffer becomes current */
        sync = must_correct(f, hd);
        hd->corrections += sync;
        if (!sync)
            *(waited ? &hd->waited : &hd->hidden) += 1;
    } else {
        sync = 1;
        hd->resyncs++;
    }
    hd->spec_valid = 0;
    if (sync) { /* on the critical path: select with this q, recall into the other buffer */
        int n = select_pages(f, hd, hd->q_cur, f->tokens, &bytes);
        fill(f, h, 1 - hd->cur, n, &hd->recalled);
        hd->cur ^= 1;
        hd->sel_hi[hd->cur] = hi;
    }

    /* Sinks and window come straight from the store: on a GPU they stay device-resident (the
     * window is where appends land), only top-k pages go through the pool. */
    int b = hd->cur, ws = hd->sel_hi[b] < hi ? hd->sel_hi[b] : hi;
    ws = ws > lo ? ws : lo;
    hd->att_lo = lo;
    hd->att_ws = ws;
    for (int p = 0; p < lo; p++)
        KVCAP_TRY(attend_store_page(f, p, h, q, scale, acc, &bytes));
    /* the pool's slots in runs of picks inside [lo, ws): one call per run (one in all unless
     * some picks became sinks or window) */
    size_t page_rows = (size_t)f->p.page_size;
    for (int s = 0; s < hd->n_sel[b];) {
        int p = hd->slot[b][s];
        if (p < lo || p >= ws) {
            s++;
            continue;
        }
        int e = s + 1;
        while (e < hd->n_sel[b] && hd->slot[b][e] >= lo && hd->slot[b][e] < ws)
            e++;
        struct kvcap_rows rows = {pool_slot(f, f->pool_k[b], h, s),
                                  pool_slot(f, f->pool_v[b], h, s), f->dt, (size_t)f->d,
                                  (int)((size_t)(e - s) * page_rows)};
        uint64_t got;
        KVCAP_TRY(kvcap_attend_rows(&rows, q, f->G, f->d, scale, acc, &got));
        bytes += got;
        s = e;
    }
    for (int p = ws; p < np; p++)
        KVCAP_TRY(attend_store_page(f, p, h, q, scale, acc, &bytes));
    if (read)
        *read = bytes;
    return KVCAP_OK;
}

enum kvcap_status kvcap_freekv_step_done(struct kvcap_freekv *f)
{
    KVCAP_RETURN_IF(!f, KVCAP_ERR_INVALID_ARGUMENT, "freekv_step_done: NULL state");
    wait_idle(f);
    struct kvcap_freekv_stats *st = &f->stats;
    st->steps++;
    st->last_corrections = st->last_resyncs = st->last_pages_recalled = 0;
    st->last_hidden = st->last_waited = 0;
    st->last_bytes_recalled = 0;
    for (int h = 0; h < f->kvh; h++) {
        struct head *hd = &f->heads[h];
        st->last_corrections += hd->corrections;
        st->last_resyncs += hd->resyncs;
        st->last_pages_recalled += hd->recalled;
        st->last_hidden += hd->hidden;
        st->last_waited += hd->waited;
        hd->corrections = hd->resyncs = hd->recalled = hd->hidden = hd->waited = 0;
        hd->todo = hd->q_step == f->step;
        if (!hd->todo) /* a head that skipped this step has no speculation for the next */
            hd->spec_valid = 0;
    }
    st->corrections += st->last_corrections;
    st->resyncs += st->last_resyncs;
    st->hidden += st->last_hidden;
    st->waited += st->last_waited;
    st->pages_recalled += st->last_pages_recalled;
    st->last_bytes_recalled = recall_bytes(f, st->last_pages_recalled);
    st->bytes_recalled += st->last_bytes_recalled;
    f->predict = f->tokens > f->done_tokens;
    f->done_tokens = f->tokens;
    f->step++;
    if (f->worker)
        enqueue(f);
    else
        run_job(f);
    return KVCAP_OK;
}

/* ---- accounting and inspection -------------------------------------------------------------- */

uint64_t kvcap_freekv_bytes_held(const struct kvcap_freekv *f)
{
    if (!f)
        return 0;
    uint64_t store = (uint64_t)f->n_alloc * f->page_bytes;
    uint64_t pool = 4 * (uint64_t)f->pool_slots * f->p.page_size * f->kvh * f->row_bytes;
    uint64_t digests = (uint64_t)f->kvh * f->cap_pages * 2 * f->d * sizeof(float);
    return store + pool + digests;
}

/* Waiting changes no observable state: the const is the caller's view, the object is not const. */
void kvcap_freekv_stats(const struct kvcap_freekv *f, struct kvcap_freekv_stats *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof *out);
    if (!f)
        return;
    wait_idle((struct kvcap_freekv *)f);
    *out = f->stats;
}

enum kvcap_status kvcap_freekv_digest(const struct kvcap_freekv *f, int h, int page, float *kmax,
                                      float *kmin)
{
    KVCAP_RETURN_IF(!f || !kmax || !kmin, KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv_digest: NULL argument");
    KVCAP_RETURN_IF(h < 0 || h >= f->kvh, KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv_digest: h = %d out of range", h);
    KVCAP_RETURN_IF(page < 0 || page >= pages_for(f, f->tokens), KVCAP_ERR_INVALID_ARGUMENT,
                    "freekv_digest: page = %d out of range", page);
    wait_idle((struct kvcap_freekv *)f);
    const float *dg = f->heads[h].dig + (size_t)page * 2 * f->d;
    memcpy(kmax, dg, sizeof(float) * (size_t)f->d);
    memcpy(kmin, dg + f->d, sizeof(float) * (size_t)f->d);
    return KVCAP_OK;
}

int kvcap_freekv_selection(const struct kvcap_freekv *f, int h, int *pages, int cap)
{
    if (!f || h < 0 || h >= f->kvh || (cap > 0 && !pages))
        return -1;
    wait_idle((struct kvcap_freekv *)f);
    const struct head *hd = &f->heads[h];
    int b = hd->cur, n = 0;
    for (int s = 0; s < hd->n_sel[b]; s++) { /* the picks it attended, by insertion, ascending */
        int p = hd->slot[b][s];
        if (p < hd->att_lo || p >= hd->att_ws)
            continue;
        n = kvcap_insert_ascending(pages, n, cap, p);
    }
    return n;
}

int kvcap_freekv_window_start(const struct kvcap_freekv *f, int h)
{
    if (!f || h < 0 || h >= f->kvh)
        return -1;
    wait_idle((struct kvcap_freekv *)f);
    return f->heads[h].att_ws;
}
