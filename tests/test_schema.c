/* test_schema.c — the kvcap schema (formats/SPEC.md §2–6): handcrafted bad files are rejected
 * with the right status and a message naming the field; files written by kvcap validate. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/internal.h"
#include "formats/schema.h"

#define SCHEMA_DIR KVCAP_TEST_DATA "/schema/"

struct bad_case {
    const char *file;
    enum kvcap_file_kind expected_kind;
    enum kvcap_status status;
    const char *field; /* must appear in kvcap_last_error() */
};

static const struct bad_case bad_cases[] = {
    {"bad_no_metadata", KVCAP_KIND_ANY, KVCAP_ERR_FORMAT, "'kvcap.kind'"},
    {"bad_no_kind", KVCAP_KIND_ANY, KVCAP_ERR_FORMAT, "'kvcap.kind'"},
    {"bad_unknown_kind", KVCAP_KIND_ANY, KVCAP_ERR_FORMAT, "kvcap.kind: 'weights'"},
    {"good_dataset", KVCAP_KIND_ARTIFACT, KVCAP_ERR_FORMAT, "kvcap.kind: 'dataset', expected 'artifact'"},
    {"bad_version_newer", KVCAP_KIND_ANY, KVCAP_ERR_VERSION, "kvcap.format_version: 99"},
    {"bad_version_garbage", KVCAP_KIND_ANY, KVCAP_ERR_FORMAT, "kvcap.format_version: '1a'"},
    {"bad_no_config", KVCAP_KIND_ANY, KVCAP_ERR_FORMAT, "'kvcap.config'"},
    {"bad_config_json", KVCAP_KIND_ANY, KVCAP_ERR_FORMAT, "kvcap.config: not a JSON object"},
    {"bad_head_dim", KVCAP_KIND_ANY, KVCAP_ERR_GEOMETRY, "model.head_dim: 100"},
    {"bad_gqa", KVCAP_KIND_ANY, KVCAP_ERR_GEOMETRY, "model.q_heads: 3"},
    {"bad_missing_value", KVCAP_KIND_DATASET, KVCAP_ERR_FORMAT, "missing required tensor 's0.l1.v'"},
    {"bad_key_shape", KVCAP_KIND_DATASET, KVCAP_ERR_FORMAT, "tensor 's0.l0.k': shape [1, 2, 128], expected [1, 4, 64]"},
    {"bad_value_dtype", KVCAP_KIND_DATASET, KVCAP_ERR_FORMAT, "tensor 's0.l0.v': dtype F16, expected F32"},
    {"bad_span_count", KVCAP_KIND_DATASET, KVCAP_ERR_FORMAT, "missing required tensor 's1.grid'"},
    {"bad_queries_partial", KVCAP_KIND_DATASET, KVCAP_ERR_FORMAT, "missing required tensor 's0.l1.q_dec'"},
    {"bad_artifact_missing_w2", KVCAP_KIND_ARTIFACT, KVCAP_ERR_FORMAT, "missing required tensor 'l1.h0.b0.k_w2'"},
    {"bad_artifact_mask_order", KVCAP_KIND_ARTIFACT, KVCAP_ERR_FORMAT, "tensor 'l0.h0.b0.k_mask': entry 1 = 0"},
    {"bad_artifact_schedule", KVCAP_KIND_ARTIFACT, KVCAP_ERR_FORMAT, "artifact.schedule.keys"},
    {"bad_artifact_storage", KVCAP_KIND_ARTIFACT, KVCAP_ERR_FORMAT, "tensor 'l0.h0.b0.U': dtype F32, expected F16"},
    {"bad_artifact_tile", KVCAP_KIND_ARTIFACT, KVCAP_ERR_FORMAT, "buckets[0].tile: [3, 1]"},
    {"bad_calib_missing_gram", KVCAP_KIND_CALIB, KVCAP_ERR_FORMAT, "missing required tensor 'l1.h0.b0.k_gram'"},
    /* once accepted here and refused later (the runtime at prefill, kvcap-convert), or read
     * through an undefined double -> int conversion */
    {"bad_theta_inf", KVCAP_KIND_ANY, KVCAP_ERR_GEOMETRY, "model.rope.theta: inf must be > 0 and finite"},
    {"bad_artifact_head_h", KVCAP_KIND_ARTIFACT, KVCAP_ERR_FORMAT, "tensor 'l0.h1.b0.k_w1': h = 3 differs from 2 in 'l0.h0.b0.k_w1'"},
    {"bad_artifact_head_rv", KVCAP_KIND_ARTIFACT, KVCAP_ERR_FORMAT, "tensor 'l1.h1.b0.U': R_v = 1 differs from 2 in 'l1.h0.b0.U'"},
    {"bad_artifact_nan", KVCAP_KIND_ARTIFACT, KVCAP_ERR_NUMERIC, "tensor 'l1.h0.b0.k_b2': non-finite value nan at element 1"},
    {"bad_calib_no_fit", KVCAP_KIND_CALIB, KVCAP_ERR_FORMAT, "calib.fit: missing"},
    {"bad_calib_hidden", KVCAP_KIND_CALIB, KVCAP_ERR_FORMAT, "calib.fit.hidden: 2.5 is not an integer in 0..65536"},
    {"bad_calib_hidden_huge", KVCAP_KIND_ANY, KVCAP_ERR_FORMAT, "calib.fit.hidden: 1e+300 is not an integer"},
    {"bad_calib_ridge_inf", KVCAP_KIND_CALIB, KVCAP_ERR_FORMAT, "calib.fit.ridge"},
    {"bad_calib_storage", KVCAP_KIND_CALIB, KVCAP_ERR_FORMAT, "calib.fit.storage: 'I32'"},
    {"bad_calib_spans", KVCAP_KIND_CALIB, KVCAP_ERR_FORMAT, "calib.spans[0]"},
    {"bad_calib_gram_nan", KVCAP_KIND_ANY, KVCAP_ERR_NUMERIC, "tensor 'l0.h0.b0.v_gram': non-finite value nan at element 5"},
};

static void test_bad_files_named(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const struct bad_case *c = &bad_cases[i];
        char path[512];
        snprintf(path, sizeof path, SCHEMA_DIR "%s.safetensors", c->file);
        struct kvst_file *f = NULL;
        assert_int_equal(kvst_open(path, &f), KVCAP_OK); /* the container is valid */
        struct kvcap_file_info info;
        enum kvcap_status st = kvcap_schema_check(f, c->expected_kind, &info);
        if (st != c->status || !strstr(kvcap_last_error(), c->field) ||
            !strstr(kvcap_last_error(), c->file))
            fail_msg("%s: status %s, message \"%s\"; expected %s naming \"%s\"", c->file,
                     kvcap_status_str(st), kvcap_last_error(), kvcap_status_str(c->status),
                     c->field);
        kvcap_file_info_free(&info);
        kvst_close(f);
    }
}

static void test_good_files(void **state)
{
    (void)state;
    static const struct {
        const char *file;
        enum kvcap_file_kind kind;
    } good[] = {{"good_dataset", KVCAP_KIND_DATASET},
                {"good_artifact", KVCAP_KIND_ARTIFACT},
                {"good_calib", KVCAP_KIND_CALIB}};
    for (size_t i = 0; i < 3; i++) {
        char path[512];
        snprintf(path, sizeof path, SCHEMA_DIR "%s.safetensors", good[i].file);
        struct kvst_file *f = NULL;
        assert_int_equal(kvst_open(path, &f), KVCAP_OK);
        struct kvcap_file_info info;
        enum kvcap_status st = kvcap_schema_check(f, good[i].kind, &info);
        if (st != KVCAP_OK)
            fail_msg("%s: %s", good[i].file, kvcap_last_error());
        assert_int_equal(info.kind, good[i].kind);
        assert_int_equal(info.format_version, 1);
        assert_int_equal(info.model.n_layers, 2);
        assert_int_equal(info.model.head_dim, 64);
        assert_int_equal(info.model.rope_type, KVCAP_ROPE_ROPE);
        if (good[i].kind == KVCAP_KIND_DATASET)
            assert_int_equal(info.n_spans, 1);
        if (good[i].kind == KVCAP_KIND_ARTIFACT) {
            assert_int_equal(info.storage, KVCAP_DTYPE_F32);
            assert_int_equal(info.activation_gelu, 1);
            assert_int_equal(info.fallback, KVCAP_POLICY_FLASHCACHE);
            assert_true(info.schedule_keys[1] == 0.5);
        }
        if (good[i].kind == KVCAP_KIND_CALIB) { /* calib.spans and calib.fit, as converted */
            assert_int_equal(info.calib_spans[0][0], 9);
            assert_int_equal(info.calib_spans[0][1], 1);
            assert_int_equal(info.fit.key_method, KVCAP_KEY_METHOD_CLOSED_FORM);
            assert_int_equal(info.fit.activation, KVCAP_ACTIVATION_LINEAR);
            assert_int_equal(info.fit.hidden, 0);
            assert_true(info.fit.ridge == 0.001);
            assert_int_equal(info.storage, KVCAP_DTYPE_F16);
            assert_true(info.schedule_values[0] == 0.5);
        }
        kvcap_file_info_free(&info);
        kvst_close(f);
    }
}

static const struct kvcap_model_geometry qwen = {
    .name = "Qwen2.5-VL-7B-Instruct", .n_layers = 2, .n_q_heads = 28, .n_kv_heads = 4,
    .head_dim = 128, .rope_type = KVCAP_ROPE_MROPE, .rope_pairing = KVCAP_ROPE_PAIRING_HALF,
    .rope_dim = 128, .rope_theta = 1e6, .n_rope_sections = 3, .rope_sections = {16, 24, 24}};

static void test_geometry_json_round_trip(void **state)
{
    (void)state;
    cJSON *j = kvcap_geometry_to_json(&qwen);
    assert_non_null(j);
    struct kvcap_model_geometry back;
    assert_int_equal(kvcap_geometry_from_json(j, "test", &back), KVCAP_OK);
    assert_memory_equal(&back, &qwen, sizeof qwen);
    cJSON_Delete(j);

    struct kvcap_bucket b[2] = {{16, 16, KVCAP_STRUCTURE_DENSE, 0, 0},
                                {32, 32, KVCAP_STRUCTURE_TILED, 4, 8}};
    j = kvcap_buckets_to_json(b, 2);
    struct kvcap_bucket bb[KVCAP_MAX_BUCKETS];
    int n = 0;
    assert_int_equal(kvcap_buckets_from_json(j, "test", bb, &n), KVCAP_OK);
    assert_int_equal(n, 2);
    assert_memory_equal(bb, b, sizeof b);
    assert_int_equal(kvcap_bucket_points(&bb[1]), 32);
    /* the same bucket twice is ambiguous */
    cJSON_AddItemToArray(j, cJSON_Duplicate(cJSON_GetArrayItem(j, 0), 1));
    assert_int_equal(kvcap_buckets_from_json(j, "test", bb, &n), KVCAP_ERR_FORMAT);
    assert_non_null(strstr(kvcap_last_error(), "buckets[2]: same grid"));
    cJSON_Delete(j);
}

/* A dataset written through the writer + schema helpers validates, with the dtype kept. */
static void test_written_dataset_validates(void **state)
{
    (void)state;
    struct kvcap_model_geometry g = qwen;
    const int rows = 2, cols = 3, n = rows * cols;
    size_t kv_elems = (size_t)g.n_kv_heads * n * g.head_dim;
    uint16_t *kv = calloc(kv_elems, sizeof *kv);
    assert_non_null(kv);
    struct kvst_writer *w = NULL;
    assert_int_equal(kvst_writer_create(&w), KVCAP_OK);
    const int32_t grid[3] = {rows, cols, 17};
    const int64_t grid_shape[1] = {3}, kv_shape[3] = {g.n_kv_heads, n, g.head_dim};
    assert_int_equal(kvst_writer_add(w, "s0.grid", KVCAP_DTYPE_I32, 1, grid_shape, grid), KVCAP_OK);
    char name[64];
    for (int l = 0; l < g.n_layers; l++) {
        snprintf(name, sizeof name, "s0.l%d.k", l);
        assert_int_equal(kvst_writer_add(w, name, KVCAP_DTYPE_BF16, 3, kv_shape, kv), KVCAP_OK);
        snprintf(name, sizeof name, "s0.l%d.v", l);
        assert_int_equal(kvst_writer_add(w, name, KVCAP_DTYPE_BF16, 3, kv_shape, kv), KVCAP_OK);
    }
    cJSON *config = cJSON_CreateObject();
    cJSON_AddItemToObject(config, "model", kvcap_geometry_to_json(&g));
    cJSON *ds = cJSON_AddObjectToObject(config, "dataset");
    cJSON_AddNumberToObject(ds, "spans", 1);
    assert_int_equal(kvcap_schema_set_meta(w, KVCAP_KIND_DATASET, config), KVCAP_OK);
    char path[512];
    const char *tmp = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/test_schema_%d.safetensors", tmp ? tmp : "/tmp", (int)getpid());
    assert_int_equal(kvst_writer_commit(w, path), KVCAP_OK);
    kvst_writer_free(w);
    cJSON_Delete(config);
    free(kv);

    struct kvst_file *f = NULL;
    assert_int_equal(kvst_open(path, &f), KVCAP_OK);
    struct kvcap_file_info info;
    enum kvcap_status st = kvcap_schema_check(f, KVCAP_KIND_DATASET, &info);
    if (st != KVCAP_OK)
        fail_msg("%s", kvcap_last_error());
    assert_int_equal(info.n_spans, 1);
    assert_memory_equal(&info.model, &g, sizeof g);
    assert_int_equal(kvst_find(f, "s0.l1.v")->dtype, KVCAP_DTYPE_BF16);
    kvcap_file_info_free(&info);
    kvst_close(f);
    unlink(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_files_named),
        cmocka_unit_test(test_good_files),
        cmocka_unit_test(test_geometry_json_round_trip),
        cmocka_unit_test(test_written_dataset_validates),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
