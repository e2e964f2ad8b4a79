/* pool.c — the blocking thread pool of pool.h: a generation counter wakes the workers, tasks
 * are handed out through an atomic counter, and the caller works too. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "internal.h"
#include "pool.h"

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
    unsigned generation; /* bumped per run */
    int stopping, active;
    /* the current run */
    void (*fn)(void *, int, int);
    void *ctx;
    int n_tasks;
    atomic_int next;
};

static void work(struct kvcap_pool *p, int thread)
{
    for (;;) {
        int t = atomic_fetch_add(&p->next, 1);
        if (t >= p->n_tasks)
            return;
        p->fn(p->ctx, t, thread);
    }
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct kvcap_pool *p = w->pool;
    unsigned seen = 0;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (!p->stopping && p->generation == seen)
            pthread_cond_wait(&p->wake, &p->lock);
        if (p->stopping)
            break;
        seen = p->generation;
        pthread_mutex_unlock(&p->lock);
        work(p, w->index);
        pthread_mutex_lock(&p->lock);
        if (--p->active == 0)
            pthread_cond_signal(&p->done);
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

void kvcap_pool_run(struct kvcap_pool *p, int n_tasks, void (*fn)(void *, int, int), void *ctx)
{
    if (n_tasks <= 0)
        return;
    int helpers = p->n_threads - 1 < n_tasks - 1 ? p->n_threads - 1 : n_tasks - 1;
    if (helpers <= 0) { /* nothing to share */
        for (int t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    pthread_mutex_lock(&p->lock);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    p->active = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    work(p, 0);
    pthread_mutex_lock(&p->lock);
    while (p->active > 0)
        pthread_cond_wait(&p->done, &p->lock);
    pthread_mutex_unlock(&p->lock);
}
