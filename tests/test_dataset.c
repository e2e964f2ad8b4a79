/* test_dataset.c — the synthetic generator's known answers (RoPE offsets included), and dataset
 * shards: write, split by size, continue numbering, stream back, reject bad inputs. */
#include <dirent.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <lapacke.h>

#include "formats/dataset.h"
#include "common/internal.h"
#include "kernels/rope.h"
#include "calibrate/synth.h"
#include "tests/test_util.h"

/* f32 rotations by positions up to ~5000: angle rounding in float costs ~1e-6 relative. */
#define ROPE_TOL 2e-5
/* f16 storage keeps 11 significant bits. */
#define F16_REL_TOL 1e-3

static void make_tmpdir(char *out, size_t cap, const char *tag)
{
    assert_true(test_tmpdir(out, cap, tag));
}

/* Rank of the centred Gram of n x d data, counting eigenvalues above tol * largest. */
static int centred_rank(const float *x, int n, int d, double tol)
{
    double *c = calloc((size_t)n * d, sizeof *c), *gram = calloc((size_t)n * n, sizeof *gram);
    double *w = calloc((size_t)n, sizeof *w);
    for (int ch = 0; ch < d; ch++) {
        double mu = 0;
        for (int j = 0; j < n; j++)
            mu += x[(size_t)j * d + ch];
        mu /= n;
        for (int j = 0; j < n; j++)
            c[(size_t)j * d + ch] = x[(size_t)j * d + ch] - mu;
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int ch = 0; ch < d; ch++)
                s += c[(size_t)i * d + ch] * c[(size_t)j * d + ch];
            gram[(size_t)i * n + j] = s;
        }
    assert_int_equal(LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'N', 'U', n, gram, n, w), 0);
    int rank = 0;
    for (int i = 0; i < n; i++)
        rank += w[i] > tol * w[n - 1];
    free(c);
    free(gram);
    free(w);
    return rank;
}

static void test_synth_known_structure(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = test_tiny_geometry(KVCAP_ROPE_PAIRING_HALF);
    struct kvcap_synth_params p;
    kvcap_synth_default_params(&p);
    p.noise = 0;
    p.outliers = 0;
    p.rank_k = 5;
    p.rank_v = 7;
    enum { ROWS = 6, COLS = 8, N = ROWS * COLS, D = 64 };
    static float kf[N * D], k[N * D], v[N * D], qp[2 * 8 * D], qd[2 * 8 * D], kf2[N * D];
    assert_int_equal(kvcap_synth_head(&g, &p, 3, ROWS, COLS, 777, 1, 1, kf, k, v, qp, qd),
                     KVCAP_OK);
    /* Exact ranks after centring: values rank_v; keys rank_k - 1, because the keys' first
     * basis function is the constant one and every other DCT function has zero mean. */
    assert_int_equal(centred_rank(v, N, D, 1e-9), 7);
    assert_int_equal(centred_rank(kf, N, D, 1e-9), 4);
    /* K = R(p0) K': undoing the offset recovers the offset-free keys. */
    memcpy(kf2, k, sizeof k);
    kvcap_rope_rotate(&g, kf2, N, D, -777.0);
    for (int i = 0; i < N * D; i++)
        assert_true(fabsf(kf2[i] - kf[i]) <= ROPE_TOL * (1.0f + fabsf(kf[i])));
    /* The same span index at another p0 has the same offset-free keys (only the rotation
     * depends on p0). */
    assert_int_equal(kvcap_synth_head(&g, &p, 3, ROWS, COLS, 5, 1, 1, kf2, k, v, NULL, NULL),
                     KVCAP_OK);
    assert_memory_equal(kf, kf2, sizeof kf);
    /* Scores of the queries have the requested spread. */
    double sum = 0, sq = 0;
    float q[D];
    memcpy(q, qd, sizeof q);
    kvcap_rope_rotate(&g, q, 1, D, -777.0);
    for (int j = 0; j < N; j++) {
        double s = 0;
        for (int c = 0; c < D; c++)
            s += (double)q[c] * kf[j * D + c];
        s /= sqrt((double)D);
        sum += s;
        sq += s * s;
    }
    double sd = sqrt(sq / N - (sum / N) * (sum / N));
    assert_true(fabs(sd - p.score_scale) < 0.05 * p.score_scale);
    /* Ranks beyond the grid are refused with a message naming them. */
    p.rank_v = N;
    assert_int_equal(kvcap_synth_head(&g, &p, 0, ROWS, COLS, 0, 0, 0, kf, k, v, NULL, NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "rank_v"));
}

static int count_files(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        n += e->d_name[0] != '.';
    if (d)
        closedir(d);
    return n;
}

static void test_synth_round_trip_through_shards(void **state)
{
    (void)state;
    char dir[512];
    make_tmpdir(dir, sizeof dir, "kvcap-ds");
    struct kvcap_model_geometry g = test_tiny_geometry(KVCAP_ROPE_PAIRING_ADJACENT);
    struct kvcap_synth_params p;
    kvcap_synth_default_params(&p);
    p.n_spans = 5;
    p.n_grids = 2;
    p.grid_rows[0] = 4, p.grid_cols[0] = 4;
    p.grid_rows[1] = 3, p.grid_cols[1] = 5;
    p.shard_bytes = 40000; /* a few spans per shard */
    p.post_queries = 3;
    p.decode_queries = 0;
    assert_int_equal(kvcap_synth(&g, &p, dir, NULL, NULL), KVCAP_OK);
    int shards = count_files(dir);
    assert_true(shards >= 2);

    const char *paths[1] = {dir};
    struct kvcap_dataset *ds = NULL;
    assert_int_equal(kvcap_dataset_open(paths, 1, &ds), KVCAP_OK);
    assert_int_equal(kvcap_dataset_span_count(ds), 5);
    assert_int_equal(kvcap_dataset_shard_count(ds), shards);
    assert_int_equal(kvcap_dataset_geometry(ds)->rope_pairing, KVCAP_ROPE_PAIRING_ADJACENT);
    const struct kvcap_span_view *s;
    float kf[16 * 64], k[16 * 64], v[16 * 64], qp[2 * 3 * 64], got[16 * 64];
    int64_t seen = 0;
    while (kvcap_dataset_next(ds, &s) == KVCAP_OK && s) {
        int rows, cols, p0;
        kvcap_synth_span_layout(&p, s->ordinal, &rows, &cols, &p0);
        assert_int_equal(s->rows, rows);
        assert_int_equal(s->cols, cols);
        assert_int_equal(s->p0, p0);
        assert_null(s->q_dec[0]);
        assert_non_null(s->q_post[1]);
        assert_int_equal(s->q_post[1]->shape[1], 3);
        /* layer 1, KV head 1 as stored == the generator's output, to f16 precision */
        assert_int_equal(kvcap_synth_head(&g, &p, s->ordinal, rows, cols, p0, 1, 1, kf, k, v,
                                          qp, NULL), KVCAP_OK);
        size_t head = (size_t)s->n * 64;
        assert_int_equal(kvcap_convert_to_f32(s->v[1]->dtype,
                                              (const uint16_t *)s->v[1]->data + head, head, got),
                         KVCAP_OK);
        for (size_t i = 0; i < head; i++)
            assert_true(fabsf(got[i] - v[i]) <= F16_REL_TOL * (fabsf(v[i]) + 1e-3f));
        /* queries of KV head 1 are query heads 2 and 3 (GQA, G = 2) */
        assert_int_equal(kvcap_convert_to_f32(s->q_post[1]->dtype,
                                              (const uint16_t *)s->q_post[1]->data + 2 * 3 * 64,
                                              2 * 3 * 64, got),
                         KVCAP_OK);
        for (size_t i = 0; i < 2 * 3 * 64; i++)
            assert_true(fabsf(got[i] - qp[i]) <= F16_REL_TOL * (fabsf(qp[i]) + 1e-2f));
        seen++;
    }
    assert_int_equal(seen, 5);
    kvcap_dataset_rewind(ds);
    assert_int_equal(kvcap_dataset_next(ds, &s), KVCAP_OK);
    assert_int_equal(s->ordinal, 0);
    kvcap_dataset_close(ds);

    /* A second run into the same folder adds shards after the existing ones. */
    p.n_spans = 1;
    assert_int_equal(kvcap_synth(&g, &p, dir, NULL, NULL), KVCAP_OK);
    assert_int_equal(count_files(dir), shards + 1);
    assert_int_equal(kvcap_dataset_open(paths, 1, &ds), KVCAP_OK);
    assert_int_equal(kvcap_dataset_span_count(ds), 6);
    kvcap_dataset_close(ds);

    /* Shards of another model in the same dataset are refused. */
    struct kvcap_model_geometry other = g;
    other.n_layers = 1;
    assert_int_equal(kvcap_synth(&other, &p, dir, NULL, NULL), KVCAP_OK);
    assert_int_equal(kvcap_dataset_open(paths, 1, &ds), KVCAP_ERR_GEOMETRY);
    assert_null(ds);
    assert_non_null(strstr(kvcap_last_error(), "model geometry differs"));
    test_rm_tree(dir);
}

static void test_dataset_rejects_empty_and_incomplete(void **state)
{
    (void)state;
    char dir[512];
    make_tmpdir(dir, sizeof dir, "kvcap-empty");
    const char *paths[1] = {dir};
    struct kvcap_dataset *ds = NULL;
    assert_int_equal(kvcap_dataset_open(paths, 1, &ds), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "empty"));

    struct kvcap_model_geometry g = test_tiny_geometry(KVCAP_ROPE_PAIRING_HALF);
    struct kvcap_dataset_writer_params wp;
    kvcap_dataset_writer_default_params(&wp);
    wp.dir = dir;
    struct kvcap_dataset_writer *w = NULL;
    assert_int_equal(kvcap_dataset_writer_create(&g, &wp, &w), KVCAP_OK);
    static float kv[2 * 4 * 64];
    assert_int_equal(kvcap_dataset_writer_end_span(w), KVCAP_ERR_STATE);
    assert_int_equal(kvcap_dataset_writer_begin_span(w, 2, 2, 0), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_set_kv(w, 0, kv, kv), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_set_kv(w, 2, kv, kv), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_dataset_writer_end_span(w), KVCAP_ERR_STATE); /* layer 1 missing */
    assert_non_null(strstr(kvcap_last_error(), "layer 1"));
    assert_int_equal(kvcap_dataset_writer_set_kv(w, 1, kv, kv), KVCAP_OK);
    static float q[4 * 2 * 64];
    assert_int_equal(kvcap_dataset_writer_add_queries(w, 0, KVCAP_QUERIES_DECODE, q, 2), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_end_span(w), KVCAP_ERR_STATE); /* queries on layer 0 only */
    assert_int_equal(kvcap_dataset_writer_add_queries(w, 1, KVCAP_QUERIES_DECODE, q, 1), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_add_queries(w, 1, KVCAP_QUERIES_DECODE, q, 1), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_end_span(w), KVCAP_OK);
    kvcap_dataset_writer_free(w); /* not flushed: nothing may appear on disk */
    assert_int_equal(count_files(dir), 0);
    test_rm_tree(dir);
}

/* One 2x2 span (all layers) written and flushed as a shard of its own. */
static void write_one(struct kvcap_dataset_writer *w)
{
    static float kv[2 * 4 * 64];
    assert_int_equal(kvcap_dataset_writer_begin_span(w, 2, 2, 0), KVCAP_OK);
    for (int l = 0; l < 2; l++)
        assert_int_equal(kvcap_dataset_writer_set_kv(w, l, kv, kv), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_end_span(w), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_flush(w), KVCAP_OK);
}

/* The writer refuses grids the format cannot hold with the check record mode shares, naming the
 * field; a failed run's writer removes the shards it wrote and nothing else. */
static void test_writer_grid_and_discard(void **state)
{
    (void)state;
    char dir[512], mine[600];
    make_tmpdir(dir, sizeof dir, "kvcap-discard");
    snprintf(mine, sizeof mine, "%s/mine.txt", dir);
    FILE *f = fopen(mine, "w");
    assert_non_null(f);
    fclose(f);
    struct kvcap_model_geometry g = test_tiny_geometry(KVCAP_ROPE_PAIRING_HALF);
    struct kvcap_dataset_writer_params wp;
    kvcap_dataset_writer_default_params(&wp);
    wp.dir = dir;
    struct kvcap_dataset_writer *w = NULL;
    assert_int_equal(kvcap_dataset_writer_create(&g, &wp, &w), KVCAP_OK);
    assert_int_equal(kvcap_dataset_writer_begin_span(w, 1, 5000, 0), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "span.cols: 5000 is outside 1..4096"));
    assert_int_equal(kvcap_dataset_writer_begin_span(w, 2, 2, -1), KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "span.p0: -1"));
    write_one(w); /* an earlier run's shard-00000 */
    kvcap_dataset_writer_free(w);
    assert_int_equal(kvcap_dataset_writer_create(&g, &wp, &w), KVCAP_OK);
    write_one(w);
    write_one(w);
    assert_int_equal(kvcap_dataset_writer_begin_span(w, 2, 2, 0), KVCAP_OK); /* half-built */
    assert_int_equal(count_files(dir), 4);
    kvcap_dataset_writer_discard(w);
    kvcap_dataset_writer_free(w);
    assert_int_equal(count_files(dir), 2); /* mine.txt and the earlier run's shard */
    const char *paths[1] = {dir};
    struct kvcap_dataset *ds = NULL;
    assert_int_equal(kvcap_dataset_open(paths, 1, &ds), KVCAP_OK);
    assert_int_equal(kvcap_dataset_span_count(ds), 1);
    kvcap_dataset_close(ds);
    kvcap_dataset_writer_discard(NULL);
    test_rm_tree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_synth_known_structure),
        cmocka_unit_test(test_synth_round_trip_through_shards),
        cmocka_unit_test(test_dataset_rejects_empty_and_incomplete),
        cmocka_unit_test(test_writer_grid_and_discard),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
