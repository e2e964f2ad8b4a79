/* test_select_cuda.c — the device top-k (kernels/cuda/select_cuda.h) against the CPU's
 * kvcap_topk_indices (kernels/select.h): argument checks first, which need no device; then,
 * with a device, indices identical to the CPU's for rows of 1 to 40000 scores (ties, NaN, ±0,
 * ±inf, all-equal rows, per-row keep, keeps past n), and nothing written past a row's kept
 * count. Without a device it reports itself skipped (exit 77). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/cuda/select_cuda.h"
#include "kernels/select.h"
#include "common/rng.h"
#include "tests/test_cuda.h"
#include "tests/test_numeric.h"

/* ---- Argument checks (no device) ------------------------------------------------------------- */

#define ARG KVCAP_ERR_INVALID_ARGUMENT

static void test_arguments(void **state)
{
    (void)state;
    float x = 0;
    int i = 0;
    assert_int_equal(kvcap_cuda_topk(NULL, 8, 8, 1, 2, NULL, &i, 2, NULL), ARG);
    assert_non_null(strstr(kvcap_last_error(), "score is NULL"));
    assert_int_equal(kvcap_cuda_topk(&x, 8, 8, 1, 2, NULL, NULL, 2, NULL), ARG);
    assert_int_equal(kvcap_cuda_topk(&x, 8, -1, 1, 2, NULL, &i, 2, NULL), ARG);
    assert_int_equal(kvcap_cuda_topk(&x, 8, 8, 0, 2, NULL, &i, 2, NULL), ARG);
    assert_int_equal(kvcap_cuda_topk(&x, 7, 8, 2, 2, NULL, &i, 2, NULL), ARG); /* ld_score */
    assert_int_equal(kvcap_cuda_topk(&x, 8, 8, 2, 3, NULL, &i, 2, NULL), ARG); /* ld_idx */
    assert_non_null(strstr(kvcap_last_error(), "ld_idx"));
    /* nothing to keep: valid, and nothing is enqueued (so no device is needed) */
    assert_int_equal(kvcap_cuda_topk(&x, 8, 0, 3, 5, NULL, &i, 0, NULL), KVCAP_OK);
    assert_int_equal(kvcap_cuda_topk(&x, 8, 8, 3, 0, NULL, &i, 0, NULL), KVCAP_OK);
}

/* ---- Top-k ----------------------------------------------------------------------------------- */

enum score_kind {
    UNIFORM, /* distinct almost surely */
    TIES,    /* four values, 10% NaN, 10% ±0 */
    FLAT,    /* all equal: every choice is a tie */
    RAMP     /* ascending with ±inf at the ends: the top is at the highest indices */
};

static float score_value(struct kvcap_rng *r, enum score_kind kind, int i, int n)
{
    switch (kind) {
    case UNIFORM:
        return (float)kvcap_rng_uniform(r);
    case TIES: {
        uint64_t u = kvcap_rng_below(r, 10);
        if (u == 0)
            return NAN;
        if (u == 1)
            return kvcap_rng_below(r, 2) ? 0.0f : -0.0f;
        return (float)kvcap_rng_below(r, 4) - 1.5f;
    }
    case FLAT:
        return 0.25f;
    case RAMP:
    default:
        return i == 0 ? -INFINITY : i == n - 1 ? INFINITY : (float)i;
    }
}

/* `batch` rows of n scores (row stride n + 3) on the device; keep_per_row used when keeps is
 * set. Every row must equal kvcap_topk_indices, and idx past the kept count stay untouched. */
static void topk_case(struct kvcap_rng *r, int n, int batch, enum score_kind kind, int keep,
                      const int *keeps)
{
    const size_t ld = (size_t)n + 3, ld_idx = (size_t)n + 1;
    float *sc = alloc_f(ld * batch);
    int *got = malloc(sizeof(int) * ld_idx * batch), *want = malloc(sizeof(int) * (n + 1));
    int *work = malloc(sizeof(int) * (n + 1));
    assert_true(got && want && work);
    for (int b = 0; b < batch; b++)
        for (size_t i = 0; i < ld; i++)
            sc[b * ld + i] = i < (size_t)n ? score_value(r, kind, (int)i, n) : NAN;
    float *dsc = dalloc(sizeof(float) * ld * batch);
    int *didx = dalloc(sizeof(int) * ld_idx * batch), *dkeep = NULL;
    upload(dsc, sc, sizeof(float) * ld * batch);
    poison(didx, sizeof(int) * ld_idx * batch);
    if (keeps) {
        dkeep = dalloc(sizeof(int) * batch);
        upload(dkeep, keeps, sizeof(int) * batch);
    }
    assert_int_equal(kvcap_cuda_topk(dsc, ld, n, batch, keep, dkeep, didx, ld_idx, NULL),
                     KVCAP_OK);
    sync_ok(NULL);
    download(got, didx, sizeof(int) * ld_idx * batch);
    for (int b = 0; b < batch; b++) {
        int k = keeps ? keeps[b] : keep;
        int cnt = kvcap_topk_indices(sc + b * ld, n, k, want, work);
        const int *g = got + b * ld_idx;
        for (int i = 0; i < cnt; i++)
            if (g[i] != want[i])
                fail_msg("n = %d, kind %d, row %d, keep %d: idx[%d] = %d, CPU %d", n, (int)kind, b,
                         k, i, g[i], want[i]);
        for (size_t i = (size_t)cnt; i < ld_idx; i++)
            if (g[i] != -1)
                fail_msg("n = %d, row %d, keep %d: idx[%zu] = %d written past the kept count", n,
                         b, k, i, g[i]);
    }
    cudaFree(dsc), cudaFree(didx), cudaFree(dkeep);
    free(sc), free(got), free(want), free(work);
}

static void test_topk(void **state)
{
    (void)state;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 11);
    static const int ns[] = {1, 2, 100, 513, 2048, 8192, 40000};
    for (size_t a = 0; a < sizeof ns / sizeof *ns; a++) {
        const int n = ns[a];
        const int keeps[] = {0, 1, n / 3, n - 1, n, n + 5};
        for (int kind = UNIFORM; kind <= RAMP; kind++)
            for (size_t t = 0; t < sizeof keeps / sizeof *keeps; t++)
                topk_case(&r, n, 3, (enum score_kind)kind, keeps[t], NULL);
        int per_row[6] = {n / 2, 0, n, -3, 1, n + 9};
        for (int kind = UNIFORM; kind <= RAMP; kind++)
            topk_case(&r, n, 6, (enum score_kind)kind, 0, per_row);
    }
}

int main(void)
{
    const struct CMUnitTest host_tests[] = {
        cmocka_unit_test(test_arguments),
    };
    int status = RUN_WITHOUT_DEVICE(host_tests);
    if (status >= 0)
        return status;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arguments),
        cmocka_unit_test(test_topk),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
