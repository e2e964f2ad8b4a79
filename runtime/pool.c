/* pool.c — the blocking thread pool of pool.h. A run publishes its task list under a new
 * generation and wakes the workers; tasks are handed out through one atomic ticket that holds
 * (generation, next task), so a worker that wakes late, even after the run ended and the next
 * began, can only claim tasks of the run it read. The caller works too and then waits for the
 * tasks still running, not for workers that have not woken yet: in a VM, waking an idle core
 * can take longer than a decode call's whole share of work. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/internal.h"
#include "runtime/pool.h"

/* Polls of the caller for running tasks to finish before it blocks (a few µs to tens of µs;
 * the tasks it waits for are already running on other cores). */
#define POOL_SPIN 20000

struct worker {
    struct kvcap_pool *pool;
    int index;
    pthread_t thread;
};

struct kvcap_pool {
    int n_threads;
    struct worker *workers;
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    int stopping;
    /* the current run, written under the lock before generation changes */
    uint32_t generation;
    kvcap_task_fn fn;
    void *ctx;
    int n_tasks;
    _Atomic uint64_t ticket; /* generation << 32 | next task */
    atomic_int remaining;    /* tasks of the current run not finished */
};

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claims and runs tasks of run `gen` until none are left (or a newer run has begun). */
static void work(struct kvcap_pool *p, uint32_t gen, kvcap_task_fn fn, void *ctx, int n_tasks,
                 int thread)
{
    for (;;) {
        uint64_t t = atomic_load(&p->ticket);
        do {
            if ((uint32_t)(t >> 32) != gen || (int)(uint32_t)t >= n_tasks)
                return;
        } while (!atomic_compare_exchange_weak(&p->ticket, &t, t + 1));
        fn(ctx, (int)(uint32_t)t, thread);
        if (atomic_fetch_sub(&p->remaining, 1) == 1) {
            pthread_mutex_lock(&p->lock);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->lock);
        }
    }
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct kvcap_pool *p = w->pool;
    uint32_t seen = 0;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (!p->stopping && p->generation == seen)
            pthread_cond_wait(&p->wake, &p->lock);
        if (p->stopping)
            break;
        seen = p->generation;
        kvcap_task_fn fn = p->fn;
        void *ctx = p->ctx;
        int n_tasks = p->n_tasks;
        pthread_mutex_unlock(&p->lock);
        work(p, seen, fn, ctx, n_tasks, w->index);
        pthread_mutex_lock(&p->lock);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

enum kvcap_status kvcap_pool_create(int n_threads, struct kvcap_pool **out)
{
    KVCAP_RETURN_IF(n_threads < 1 || !out, KVCAP_ERR_INVALID_ARGUMENT, "pool: %d threads",
                    n_threads);
    struct kvcap_pool *p = calloc(1, sizeof *p);
    KVCAP_RETURN_IF(!p, KVCAP_ERR_OUT_OF_MEMORY, "pool: out of memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    p->workers = calloc((size_t)n_threads, sizeof *p->workers);
    if (!p->workers) {
        kvcap_pool_free(p);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "pool: out of memory");
    }
    for (int i = 1; i < n_threads; i++) {
        p->workers[i].pool = p;
        p->workers[i].index = i;
        if (pthread_create(&p->workers[i].thread, NULL, worker_main, &p->workers[i]) != 0) {
            p->n_threads = i; /* the ones started so far are joined by free */
            kvcap_pool_free(p);
            return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "pool: cannot start thread %d", i);
        }
    }
    *out = p;
    return KVCAP_OK;
}

void kvcap_pool_free(struct kvcap_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->lock);
    p->stopping = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; p->workers && i < p->n_threads; i++)
        pthread_join(p->workers[i].thread, NULL);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->lock);
    free(p->workers);
    free(p);
}

void kvcap_pool_run(struct kvcap_pool *p, int n_tasks, kvcap_task_fn fn, void *ctx)
{
    if (n_tasks <= 0)
        return;
    if (p->n_threads < 2 || n_tasks < 2) { /* nothing to share */
        for (int t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    pthread_mutex_lock(&p->lock);
    uint32_t gen = ++p->generation;
    if (gen == 0) /* 0 is the workers' "nothing seen yet" */
        gen = ++p->generation;
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->remaining, n_tasks);
    atomic_store(&p->ticket, (uint64_t)gen << 32);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    work(p, gen, fn, ctx, n_tasks, 0);
    for (int i = 0; i < POOL_SPIN && atomic_load(&p->remaining) > 0; i++)
        cpu_relax();
    if (atomic_load(&p->remaining) > 0) {
        pthread_mutex_lock(&p->lock);
        while (atomic_load(&p->remaining) > 0)
            pthread_cond_wait(&p->done, &p->lock);
        pthread_mutex_unlock(&p->lock);
    }
}
