/* test_vision.c — photo feature files and the closed-form projector (engine/vision.c): the split
 * by photo (read from vision.splits, or by index in older files), the reader's refusals, and
 * the projector's defining properties. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include <lapacke.h>

#include "common/rng.h"
#include "formats/safetensors.h"
#include "common/dtype.h"
#include "tests/test_util.h"
#include "engine/vision.h"

enum { CROPS = 12, GRID = 4, TOKENS = GRID * GRID, DIM = 6, VOCAB = 300, EMBD = 8 };

/* Projected statistics vs the table's, in double over 12 x 16 rows: the fitted maps are exact
 * up to f32 rounding of the features (F16) and of the map itself. */
#define MOMENT_REL_TOL 1e-3

/* Writes a feature file of CROPS crops from photos 0..5 (two crops each): features with one
 * dominant direction per channel scale, so the covariance has distinct eigenvalues, times
 * `spread`, plus `offset` x the channel; element 5 is `poison`. `photos` and `splits` (JSON,
 * or NULL to leave the key out) become vision.photos and vision.splits; the crops of photos
 * whose index is in `scaled` (a bit set) have their features times 8. */
static void write_features_meta(const char *path, float poison, double spread, double offset,
                                const char *photos, const char *splits, unsigned scaled)
{
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 3);
    uint16_t *f = malloc(sizeof *f * CROPS * TOKENS * DIM);
    float *x = malloc(sizeof *x * CROPS * TOKENS * DIM);
    int32_t photo[CROPS];
    for (int c = 0; c < CROPS; c++) {
        photo[c] = c / 2;
        for (int t = 0; t < TOKENS; t++)
            for (int j = 0; j < DIM; j++)
                x[((size_t)c * TOKENS + t) * DIM + j] =
                    (float)((spread * (j + 1) * kvcap_rng_normal(&r) + offset * j) *
                            (scaled >> photo[c] & 1 ? 8 : 1));
    }
    x[5] = poison;
    assert_int_equal(kvcap_convert_from_f32(KVCAP_DTYPE_F16, x, (size_t)CROPS * TOKENS * DIM, f),
                     KVCAP_OK);
    struct kvst_writer *w = NULL;
    assert_int_equal(kvst_writer_create(&w), KVCAP_OK);
    const int64_t fs[3] = {CROPS, TOKENS, DIM}, ps[1] = {CROPS};
    assert_int_equal(kvst_writer_add(w, "features", KVCAP_DTYPE_F16, 3, fs, f), KVCAP_OK);
    assert_int_equal(kvst_writer_add(w, "photo", KVCAP_DTYPE_I32, 1, ps, photo), KVCAP_OK);
    if (photos)
        assert_int_equal(kvst_writer_set_meta(w, "vision.photos", photos), KVCAP_OK);
    if (splits)
        assert_int_equal(kvst_writer_set_meta(w, "vision.splits", splits), KVCAP_OK);
    assert_int_equal(kvst_writer_commit(w, path), KVCAP_OK);
    kvst_writer_free(w);
    free(f), free(x);
}

static void write_features_as(const char *path, float poison, double spread, double offset)
{
    write_features_meta(path, poison, spread, offset, NULL, NULL, 0);
}

static void write_features(const char *path, float poison)
{
    write_features_as(path, poison, 1.0, 0.5);
}

static void test_split_and_projector(void **state)
{
    (void)state;
    char dir[512], path[600];
    assert_true(test_tmpdir(dir, sizeof dir, "vision"));
    snprintf(path, sizeof path, "%s/features.safetensors", dir);
    write_features(path, 0.25f);
    struct kvvision_features f;
    if (kvvision_open(path, &f) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_int_equal(f.n_crops, CROPS);
    assert_int_equal(f.grid, GRID);
    assert_int_equal(f.n_photos, 6);
    /* a file without vision.splits (written before the test split): photo 3's crops (6, 7)
     * are development, every other photo's calibration, none test */
    assert_int_equal(f.splits_recorded, 0);
    for (int c = 0; c < CROPS; c++) {
        assert_int_equal(kvvision_heldout(&f, c), c == 6 || c == 7);
        assert_int_equal(kvvision_crop_split(&f, c),
                         c == 6 || c == 7 ? KVVISION_DEVELOPMENT : KVVISION_CALIBRATION);
    }

    /* a table with distinct variances along random directions */
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 4);
    float *table = malloc(sizeof *table * VOCAB * EMBD);
    for (int v = 0; v < VOCAB; v++)
        for (int e = 0; e < EMBD; e++)
            table[(size_t)v * EMBD + e] = (float)((e + 1) * 0.1 * kvcap_rng_normal(&r) - 0.2);
    struct kvvision_projector p;
    if (kvvision_projector_fit(&f, table, VOCAB, EMBD, &p) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    /* the calibration crops' projections have the table's mean and, along the table's
     * principal directions, its top-DIM variances: compare total variance (trace) */
    double mean_e[EMBD] = {0}, var_e = 0, mean_p[EMBD] = {0}, var_p = 0;
    for (int v = 0; v < VOCAB; v++)
        for (int e = 0; e < EMBD; e++)
            mean_e[e] += table[(size_t)v * EMBD + e] / (double)VOCAB;
    float *out = malloc(sizeof *out * TOKENS * EMBD);
    int rows = 0;
    double *all = malloc(sizeof *all * CROPS * TOKENS * EMBD);
    for (int c = 0; c < CROPS; c++) {
        if (kvvision_heldout(&f, c))
            continue;
        assert_int_equal(kvvision_embed(&f, &p, c, out), KVCAP_OK);
        for (int i = 0; i < TOKENS * EMBD; i++)
            all[(size_t)rows * EMBD + i] = out[i];
        rows += TOKENS;
    }
    for (int i = 0; i < rows; i++)
        for (int e = 0; e < EMBD; e++)
            mean_p[e] += all[(size_t)i * EMBD + e] / rows;
    for (int e = 0; e < EMBD; e++)
        assert_true(fabs(mean_p[e] - mean_e[e]) < MOMENT_REL_TOL);
    for (int i = 0; i < rows; i++)
        for (int e = 0; e < EMBD; e++)
            var_p += pow(all[(size_t)i * EMBD + e] - mean_p[e], 2) / rows;
    /* the table's variance in its top DIM directions: all but its two smallest */
    double cov[EMBD][EMBD] = {{0}};
    for (int v = 0; v < VOCAB; v++)
        for (int a = 0; a < EMBD; a++)
            for (int b = 0; b < EMBD; b++)
                cov[a][b] += (table[(size_t)v * EMBD + a] - mean_e[a]) *
                             (table[(size_t)v * EMBD + b] - mean_e[b]) / VOCAB;
    double w[EMBD];
    assert_int_equal(LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'N', 'U', EMBD, &cov[0][0], EMBD, w), 0);
    for (int e = EMBD - DIM; e < EMBD; e++) /* ascending: the DIM largest */
        var_e += w[e];
    if (!(fabs(var_p - var_e) <= MOMENT_REL_TOL * var_e))
        fail_msg("projected variance %g, the table's top %d directions hold %g", var_p, DIM,
                 var_e);
    /* projecting twice gives the same bits (no hidden state) */
    float *again = malloc(sizeof *again * TOKENS * EMBD);
    assert_int_equal(kvvision_embed(&f, &p, 0, out), KVCAP_OK);
    assert_int_equal(kvvision_embed(&f, &p, 0, again), KVCAP_OK);
    assert_memory_equal(out, again, sizeof *out * TOKENS * EMBD);
    kvvision_projector_free(&p);
    kvvision_close(&f);

    /* a non-finite feature is refused, naming where */
    write_features(path, INFINITY);
    assert_int_equal(kvvision_open(path, &f), KVCAP_ERR_NUMERIC);
    assert_non_null(strstr(kvcap_last_error(), "crop 0, token 0, channel 5"));
    free(table), free(out), free(all), free(again);
    test_rm_tree(dir);
}

static const char *const k_photos6 = "[\"a\",\"b\",\"c\",\"d\",\"e\",\"f\"]";

/* The splits a file records (vision.splits) are each photo's, and every crop gets its photo's:
 * the three splits' crops partition the file and no photo has crops in two; only the
 * calibration photos shape the projector; malformed metadata is refused, naming the key. */
static void test_recorded_splits(void **state)
{
    (void)state;
    char dir[512], path[600];
    assert_true(test_tmpdir(dir, sizeof dir, "vision-splits"));
    snprintf(path, sizeof path, "%s/features.safetensors", dir);
    static const enum kvvision_split want[6] = {KVVISION_CALIBRATION, KVVISION_DEVELOPMENT,
                                                KVVISION_CALIBRATION, KVVISION_TEST,
                                                KVVISION_CALIBRATION, KVVISION_TEST};
    static const char *const splits = "[\"calibration\",\"development\",\"calibration\","
                                      "\"test\",\"calibration\",\"test\"]";
    write_features_meta(path, 0.25f, 1.0, 0.5, k_photos6, splits, 0);
    struct kvvision_features f;
    if (kvvision_open(path, &f) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_int_equal(f.splits_recorded, 1);
    int crops_in[KVVISION_N_SPLITS] = {0}, photo_in[6] = {-1, -1, -1, -1, -1, -1};
    for (int p = 0; p < f.n_photos; p++)
        assert_int_equal(kvvision_photo_split(&f, p), want[p]);
    for (int c = 0; c < f.n_crops; c++) {
        const enum kvvision_split sp = kvvision_crop_split(&f, c);
        assert_true((unsigned)sp < KVVISION_N_SPLITS);
        crops_in[sp]++;
        /* disjoint: a photo's crops all lie in one split */
        if (photo_in[f.photo[c]] >= 0)
            assert_int_equal(photo_in[f.photo[c]], sp);
        photo_in[f.photo[c]] = (int)sp;
        assert_int_equal(kvvision_heldout(&f, c), sp != KVVISION_CALIBRATION);
    }
    assert_int_equal(crops_in[KVVISION_CALIBRATION], 6);
    assert_int_equal(crops_in[KVVISION_DEVELOPMENT], 2);
    assert_int_equal(crops_in[KVVISION_TEST], 4);
    assert_int_equal(crops_in[0] + crops_in[1] + crops_in[2], f.n_crops);

    /* the projector sees the calibration photos only: scaling every development and test
     * crop's features leaves it bit for bit the same, scaling a calibration crop does not */
    float table[VOCAB * EMBD];
    for (int i = 0; i < VOCAB * EMBD; i++)
        table[i] = (float)(sin(0.37 * i) * (1 + i % EMBD));
    struct kvvision_projector p0, p1;
    if (kvvision_projector_fit(&f, table, VOCAB, EMBD, &p0) != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    kvvision_close(&f);
    const unsigned held = 1u << 1 | 1u << 3 | 1u << 5;
    for (int k = 0; k < 2; k++) {
        write_features_meta(path, 0.25f, 1.0, 0.5, k_photos6, splits, k == 0 ? held : 1u << 2);
        assert_int_equal(kvvision_open(path, &f), KVCAP_OK);
        assert_int_equal(kvvision_projector_fit(&f, table, VOCAB, EMBD, &p1), KVCAP_OK);
        const int same = !memcmp(p0.a, p1.a, sizeof *p0.a * EMBD * DIM) &&
                         !memcmp(p0.mu_f, p1.mu_f, sizeof *p0.mu_f * DIM);
        assert_int_equal(same, k == 0);
        kvvision_projector_free(&p1);
        kvvision_close(&f);
    }
    kvvision_projector_free(&p0);

    /* no calibration photo: nothing to fit the projector on, said so */
    write_features_meta(path, 0.25f, 1.0, 0.5, k_photos6,
                        "[\"test\",\"test\",\"development\",\"test\",\"test\",\"test\"]", 0);
    assert_int_equal(kvvision_open(path, &f), KVCAP_OK);
    assert_int_equal(kvvision_projector_fit(&f, table, VOCAB, EMBD, &p1),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(kvcap_last_error(), "no crop of a calibration photo"));
    kvvision_close(&f);

    /* refusals, each naming the key: not a list, an unknown or non-canonical name, fewer
     * entries than the crops' photos, a list that does not match vision.photos */
    static const struct {
        const char *photos, *splits, *says;
    } bad[] = {
        {NULL, "{\"a\": 1}", "'vision.splits' is not a JSON list"},
        {NULL, "[\"calibration\",\"train\",\"test\",\"test\",\"test\",\"test\"]",
         "'vision.splits': entry 1 is not"},
        {NULL, "[\"calibration\",\"heldout\",\"test\",\"test\",\"test\",\"test\"]",
         "'vision.splits': entry 1 is not"},
        {NULL, "[\"calibration\",\"test\",\"test\",\"test\",\"test\",7]",
         "'vision.splits': entry 5 is not"},
        {NULL, "[\"calibration\",\"test\"]", "names 2 photos' splits, but tensor 'photo' "
                                              "refers to photo 5"},
        {"[\"a\"]", splits, "'vision.splits' has 6 entries, 'vision.photos' 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_features_meta(path, 0.25f, 1.0, 0.5, bad[i].photos, bad[i].splits, 0);
        assert_int_equal(kvvision_open(path, &f), KVCAP_ERR_FORMAT);
        if (!strstr(kvcap_last_error(), bad[i].says))
            fail_msg("case %zu: '%s' does not say '%s'", i, kvcap_last_error(), bad[i].says);
        assert_null(f.file);
        assert_null(f.split);
    }
    test_rm_tree(dir);
}

/* The names kvcap-eval's --photos takes: the three splits, and heldout for development. */
static void test_split_names(void **state)
{
    (void)state;
    enum kvvision_split sp;
    for (int i = 0; i < KVVISION_N_SPLITS; i++) {
        assert_int_equal(kvvision_split_parse(kvvision_split_name((enum kvvision_split)i), &sp), 0);
        assert_int_equal(sp, i);
    }
    assert_string_equal(kvvision_split_name(KVVISION_TEST), "test");
    assert_int_equal(kvvision_split_parse("heldout", &sp), 0);
    assert_int_equal(sp, KVVISION_DEVELOPMENT);
    assert_int_equal(kvvision_split_parse("train", &sp), -1);
    assert_int_equal(kvvision_split_parse("", &sp), -1);
    assert_int_equal(kvvision_split_parse(NULL, &sp), -1);
}

/* Features that do not vary (all zero, or one vector everywhere) carry no image: the projector
 * refuses them, naming the file, instead of mapping every crop to the same embedding. */
static void test_constant_features_refused(void **state)
{
    (void)state;
    char dir[512], path[600];
    assert_true(test_tmpdir(dir, sizeof dir, "vision-constant"));
    snprintf(path, sizeof path, "%s/features.safetensors", dir);
    float table[VOCAB * EMBD];
    for (int i = 0; i < VOCAB * EMBD; i++)
        table[i] = (float)sin(0.1 * i);
    for (int offset = 0; offset < 2; offset++) {
        write_features_as(path, offset ? 2.5f : 0.0f, 0.0, offset ? 0.5 : 0.0);
        struct kvvision_features f;
        if (kvvision_open(path, &f) != KVCAP_OK)
            fail_msg("%s", kvcap_last_error());
        struct kvvision_projector p;
        assert_int_equal(kvvision_projector_fit(&f, table, VOCAB, EMBD, &p), KVCAP_ERR_NUMERIC);
        assert_non_null(strstr(kvcap_last_error(), "features.safetensors: tensor 'features': the "
                                                   "calibration crops' features do not vary"));
        kvvision_close(&f);
    }
    test_rm_tree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_split_and_projector),
                                       cmocka_unit_test(test_recorded_splits),
                                       cmocka_unit_test(test_split_names),
                                       cmocka_unit_test(test_constant_features_refused)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
