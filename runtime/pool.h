/* pool.h — a small persistent thread pool for the cache's per-call parallel loops. Idle
 * workers block (they never spin), so a library call that returns leaves the host's cores to
 * the host; OpenMP's default active waiting cost several ms per decode call on 2 cores. */
#ifndef KVCAP_POOL_H
#define KVCAP_POOL_H

#include "kvcap.h"

struct kvcap_pool;

/* n_threads >= 1 threads in all: the calling thread plus n_threads - 1 workers. */
enum kvcap_status kvcap_pool_create(int n_threads, struct kvcap_pool **out);
void kvcap_pool_free(struct kvcap_pool *pool); /* NULL is a no-op */

/* Runs fn(ctx, task, thread) once for each task = 0..n_tasks-1 on the pool's threads (thread
 * in 0..n_threads-1, distinct per concurrently running call; the caller is thread 0) and
 * returns when all are done. The caller does not wait for workers that have not woken yet:
 * they find no task left. Not reentrant: one run at a time per pool. */
void kvcap_pool_run(struct kvcap_pool *pool, int n_tasks, kvcap_task_fn fn, void *ctx);

#endif
