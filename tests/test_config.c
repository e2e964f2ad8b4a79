/* test_config.c — the YAML configs: every shipped config parses to the numbers its comments
 * state, defaults fill in, schedules expand, and each bad config in data/configs/bad fails with
 * KVCAP_ERR_CONFIG at the exact file:line:col of the offending node, naming the field. */
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

#include "configs/config.h"
#include "common/internal.h"

#define SHIPPED KVCAP_SOURCE_DIR "/configs/"
#define BAD_DIR KVCAP_TEST_DATA "/configs/bad/"
#define GOOD_DIR KVCAP_TEST_DATA "/configs/good/"

/* A small valid calibration config; cases below edit one piece of it. */
static const char TINY[] = "model:\n"
                           "  name: tiny\n"
                           "  layers: 4\n"
                           "  q_heads: 8\n"
                           "  kv_heads: 2\n"
                           "  head_dim: 64\n"
                           "  rope: {type: rope, pairing: half, theta: 10000}\n"
                           "buckets:\n"
                           "  - {rows: 16, cols: 16}\n"
                           "schedule: {kind: uniform, ratio: 0.5}\n";

/* TINY with the single occurrence of `from` replaced by `to` (static buffer). */
static const char *tiny_with(const char *from, const char *to)
{
    static char buf[4096];
    const char *at = strstr(TINY, from);
    assert_non_null(at);
    assert_null(strstr(at + 1, from));
    snprintf(buf, sizeof buf, "%.*s%s%s", (int)(at - TINY), TINY, to, at + strlen(from));
    return buf;
}

/* Asserts that the last error is "<label>:<where>: ..." and contains `needle` after that. */
static void assert_error_at(const char *label, const char *where, const char *needle)
{
    char prefix[1024];
    snprintf(prefix, sizeof prefix, "%.900s:%.20s: ", label, where);
    const char *msg = kvcap_last_error();
    if (strncmp(msg, prefix, strlen(prefix)) != 0 || !strstr(msg + strlen(prefix), needle))
        fail_msg("error message mismatch\n  got:  %s\n  want: %s... %s", msg, prefix, needle);
}

static void assert_calib_is_default(const struct kvcap_calib_config *c)
{
    struct kvcap_calib_config d;
    kvcap_calib_config_default(&d);
    assert_int_equal(c->n_buckets, 0);
    assert_int_equal(c->model.n_layers, 0);
    assert_null(c->schedule_keys.ratios);
    assert_null(c->schedule_values.ratios);
    assert_int_equal(c->schedule_keys.kind, d.schedule_keys.kind);
    assert_int_equal(c->storage, d.storage);
}

static void expect_pyramid(const struct kvcap_schedule *s, double first, double last)
{
    assert_int_equal(s->kind, KVCAP_SCHEDULE_PYRAMID);
    assert_true(s->first == first);
    assert_true(s->last == last);
    assert_null(s->ratios);
}

static void expect_uniform(const struct kvcap_schedule *s, double ratio)
{
    assert_int_equal(s->kind, KVCAP_SCHEDULE_UNIFORM);
    assert_true(s->ratio == ratio);
    assert_null(s->ratios);
}

static void expect_default_train(const struct kvcap_train_config *t)
{
    assert_int_equal(t->steps, 300);
    assert_true(t->lr == 1e-3);
    assert_true(t->tau_start == 1.0);
    assert_true(t->tau_end == 0.05);
    assert_true(t->lambda_bce == 0.01);
    assert_true(t->lambda_r == 1.0);
    assert_int_equal(t->finetune_steps, 100);
    assert_int_equal(t->seed, 0);
}

/* ---- Shipped configs ------------------------------------------------------------------- */
static void test_shipped_qwen(void **state)
{
    (void)state;
    struct kvcap_calib_config c;
    assert_int_equal(kvcap_calib_config_load_file(SHIPPED "qwen2.5-vl-7b.calib.yaml", &c),
                     KVCAP_OK);
    const struct kvcap_model_geometry *g = &c.model;
    assert_string_equal(g->name, "Qwen2.5-VL-7B-Instruct");
    assert_int_equal(g->n_layers, 28);
    assert_int_equal(g->n_q_heads, 28);
    assert_int_equal(g->n_kv_heads, 4);
    assert_int_equal(g->head_dim, 128);
    assert_int_equal(g->rope_type, KVCAP_ROPE_MROPE);
    assert_int_equal(g->rope_pairing, KVCAP_ROPE_PAIRING_HALF);
    assert_true(g->rope_theta == 1e6);
    assert_int_equal(g->rope_dim, 0); /* = head_dim */
    assert_int_equal(g->n_rope_sections, 3);
    assert_int_equal(g->rope_sections[0], 16);
    assert_int_equal(g->rope_sections[1], 24);
    assert_int_equal(g->rope_sections[2], 24);

    assert_int_equal(c.n_buckets, 2);
    assert_int_equal(c.buckets[0].rows, 16);
    assert_int_equal(c.buckets[0].cols, 16);
    assert_int_equal(c.buckets[0].structure, KVCAP_STRUCTURE_DENSE);
    assert_int_equal(c.buckets[0].tile_rows, 0);
    assert_int_equal(c.buckets[1].rows, 32);
    assert_int_equal(c.buckets[1].cols, 32);
    assert_int_equal(c.buckets[1].structure, KVCAP_STRUCTURE_TILED);
    assert_int_equal(c.buckets[1].tile_rows, 4);
    assert_int_equal(c.buckets[1].tile_cols, 4);

    /* A bare schedule applies to keys and values. */
    expect_pyramid(&c.schedule_keys, 0.6, 0.2);
    expect_pyramid(&c.schedule_values, 0.6, 0.2);
    assert_int_equal(c.keys.method, KVCAP_KEY_METHOD_CLOSED_FORM);
    assert_int_equal(c.keys.activation, KVCAP_ACTIVATION_GELU);
    assert_int_equal(c.keys.hidden, 0);
    assert_true(c.keys.ridge == 1e-3);
    expect_default_train(&c.keys.train);
    assert_true(c.validation_fraction == 0.1);
    assert_int_equal(c.validation_seed, 0);
    assert_int_equal(c.storage, KVCAP_DTYPE_F16);
    kvcap_calib_config_free(&c);
}

static void test_shipped_llava(void **state)
{
    (void)state;
    struct kvcap_calib_config c;
    assert_int_equal(
        kvcap_calib_config_load_file(SHIPPED "llava-1.6-mistral-7b.calib.yaml", &c), KVCAP_OK);
    const struct kvcap_model_geometry *g = &c.model;
    assert_string_equal(g->name, "llava-v1.6-mistral-7b-hf");
    assert_int_equal(g->n_layers, 32);
    assert_int_equal(g->n_q_heads, 32);
    assert_int_equal(g->n_kv_heads, 8);
    assert_int_equal(g->head_dim, 128);
    assert_int_equal(g->rope_type, KVCAP_ROPE_ROPE);
    assert_int_equal(g->rope_pairing, KVCAP_ROPE_PAIRING_HALF);
    assert_true(g->rope_theta == 1e6);
    assert_int_equal(g->n_rope_sections, 0);

    assert_int_equal(c.n_buckets, 2);
    assert_int_equal(c.buckets[0].rows * c.buckets[0].cols, 576);
    assert_int_equal(c.buckets[0].structure, KVCAP_STRUCTURE_DENSE);
    assert_int_equal(c.buckets[1].rows, 24);
    assert_int_equal(c.buckets[1].structure, KVCAP_STRUCTURE_TILED);
    assert_int_equal(c.buckets[1].tile_rows, 4);

    expect_pyramid(&c.schedule_keys, 0.6, 0.2);
    expect_uniform(&c.schedule_values, 0.4);
    assert_int_equal(c.keys.method, KVCAP_KEY_METHOD_TRAINED);
    expect_default_train(&c.keys.train); /* written out explicitly, equal to the defaults */
    assert_int_equal(c.storage, KVCAP_DTYPE_F16);
    kvcap_calib_config_free(&c);
}

static void test_shipped_smollm2(void **state)
{
    (void)state;
    struct kvcap_calib_config c;
    assert_int_equal(kvcap_calib_config_load_file(SHIPPED "smollm2-135m.calib.yaml", &c),
                     KVCAP_OK);
    const struct kvcap_model_geometry *g = &c.model;
    assert_string_equal(g->name, "SmolLM2-135M");
    assert_int_equal(g->n_layers, 30);
    assert_int_equal(g->n_q_heads, 9);
    assert_int_equal(g->n_kv_heads, 3);
    assert_int_equal(g->head_dim, 64);
    assert_int_equal(g->rope_type, KVCAP_ROPE_ROPE);
    assert_int_equal(g->rope_pairing, KVCAP_ROPE_PAIRING_HALF);
    assert_true(g->rope_theta == 1e5);

    assert_int_equal(c.n_buckets, 2);
    assert_int_equal(c.buckets[0].rows, 16);
    assert_int_equal(c.buckets[0].structure, KVCAP_STRUCTURE_DENSE);
    assert_int_equal(c.buckets[1].rows, 16);
    assert_int_equal(c.buckets[1].structure, KVCAP_STRUCTURE_TILED);
    assert_int_equal(c.buckets[1].tile_cols, 4);

    expect_pyramid(&c.schedule_keys, 0.5, 0.25);
    expect_uniform(&c.schedule_values, 0.4);
    /* Given train keys override, the others keep their defaults. */
    assert_int_equal(c.keys.train.steps, 50);
    assert_int_equal(c.keys.train.finetune_steps, 20);
    assert_int_equal(c.keys.train.seed, 1);
    assert_true(c.keys.train.lr == 1e-3);
    assert_true(c.keys.train.tau_end == 0.05);
    assert_true(c.validation_fraction == 0.2);
    assert_int_equal(c.validation_seed, 7);
    assert_int_equal(c.storage, KVCAP_DTYPE_F32);
    kvcap_calib_config_free(&c);
}

/* Every calibration config the demo runs loads, and the one that runs KVCapsule as its paper
 * does asks for what the paper uses: dense maps, the pyramid schedule and trained keys. */
static void test_demo_calib_configs(void **state)
{
    (void)state;
    static const char *const files[] = {
        "smollm2-135m-text-dense.calib.yaml",  "smollm2-135m-text-tiled.calib.yaml",
        "smollm2-135m-text-tiled-trained.calib.yaml", "smollm2-135m-image-dense.calib.yaml",
        "smollm2-135m-image-tiled.calib.yaml", "smollm2-135m-image-dense-paper.calib.yaml"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[512];
        snprintf(path, sizeof path, SHIPPED "%s", files[i]);
        struct kvcap_calib_config c;
        assert_int_equal(kvcap_calib_config_load_file(path, &c), KVCAP_OK);
        if (strstr(files[i], "paper")) {
            assert_int_equal(c.buckets[0].structure, KVCAP_STRUCTURE_DENSE);
            expect_pyramid(&c.schedule_keys, 0.6, 0.2);
            expect_pyramid(&c.schedule_values, 0.6, 0.2);
            assert_int_equal(c.keys.method, KVCAP_KEY_METHOD_TRAINED);
        }
        kvcap_calib_config_free(&c);
    }
}

/* The shipped configurations (chosen in advance per span kind, configs/shipped-*.yaml) load,
 * name the evaluation row they are, and set what that row runs. */
static void test_shipped_runtime_configs(void **state)
{
    (void)state;
    struct kvcap_runtime_config r;
    assert_int_equal(kvcap_runtime_config_load_file(SHIPPED "shipped-text.yaml", &r), KVCAP_OK);
    assert_int_equal(r.policy[KVCAP_SPAN_TEXT], KVCAP_POLICY_KVZIP);
    assert_true(r.kvzip.safeguard == 0.5); /* kvzip+safeguard */
    kvcap_runtime_config_free(&r);
    FILE *f = fopen(SHIPPED "shipped-text.yaml", "r");
    assert_non_null(f);
    char line[256];
    int named = 0;
    while (fgets(line, sizeof line, f))
        named |= !strcmp(line, "# kvcap-eval row: kvzip+safeguard\n");
    fclose(f);
    assert_true(named);
    /* image spans: KVCapsule with its worst tile exact (the artifact is the user's) */
    struct kvcap_runtime_config i;
    assert_int_equal(kvcap_runtime_config_load_file(SHIPPED "shipped-image.yaml", &i), KVCAP_OK);
    assert_int_equal(i.policy[KVCAP_SPAN_VISION], KVCAP_POLICY_KVCAPSULE);
    assert_int_equal(i.kvcapsule.exact_tiles, 1);
    assert_non_null(strstr(i.artifact, "image-tiled.kvcap"));
    kvcap_runtime_config_free(&i);
    f = fopen(SHIPPED "shipped-image.yaml", "r");
    assert_non_null(f);
    named = 0;
    while (fgets(line, sizeof line, f))
        named |= !strcmp(line, "# kvcap-eval row: kvcapsule tiled+exact (closed-form keys)\n");
    fclose(f);
    assert_true(named);
}

/* runtime.yaml spells out every default: loading it must give exactly the defaults. */
static void assert_runtime_equal(const struct kvcap_runtime_config *a,
                                 const struct kvcap_runtime_config *b)
{
    assert_string_equal(a->artifact, b->artifact);
    for (int k = 0; k < 3; k++)
        assert_int_equal(a->policy[k], b->policy[k]);
    assert_int_equal(a->fallback, b->fallback);
    assert_true(a->flashcache.gamma == b->flashcache.gamma);
    assert_true(a->flashcache.retention == b->flashcache.retention);
    assert_int_equal(a->flashcache.min_tokens, b->flashcache.min_tokens);
    assert_int_equal(a->flashcache.sinks, b->flashcache.sinks);
    assert_int_equal(a->flashcache.window, b->flashcache.window);
    assert_true(a->vlcache.p == b->vlcache.p);
    assert_true(a->vlcache.budget == b->vlcache.budget);
    assert_true(a->vlcache.min_fraction == b->vlcache.min_fraction);
    assert_true(a->vlcache.recent_fraction == b->vlcache.recent_fraction);
    assert_int_equal(a->vlcache.sinks, b->vlcache.sinks);
    assert_int_equal(a->vlcache.window, b->vlcache.window);
    assert_int_equal(a->vlcache.uniform_layers, b->vlcache.uniform_layers);
    assert_int_equal(a->freekv.page_size, b->freekv.page_size);
    assert_int_equal(a->freekv.budget, b->freekv.budget);
    assert_true(a->freekv.tau == b->freekv.tau);
    assert_int_equal(a->freekv.sink_pages, b->freekv.sink_pages);
    assert_int_equal(a->freekv.window_pages, b->freekv.window_pages);
    assert_int_equal(a->streaming.sinks, b->streaming.sinks);
    assert_int_equal(a->streaming.window, b->streaming.window);
    assert_true(a->kvzip.retention == b->kvzip.retention);
    assert_int_equal(a->kvzip.sinks, b->kvzip.sinks);
    assert_int_equal(a->kvzip.window, b->kvzip.window);
    assert_true(a->kvzip.safeguard == b->kvzip.safeguard);
    assert_int_equal(a->kvzip.value_basis, b->kvzip.value_basis);
    assert_int_equal(a->kvzip.exact_values, b->kvzip.exact_values);
    assert_true(a->random.retention == b->random.retention);
    assert_int_equal(a->random.sinks, b->random.sinks);
    assert_int_equal(a->random.window, b->random.window);
    assert_int_equal(a->random.seed, b->random.seed);
    assert_true(a->expected.retention == b->expected.retention);
    assert_int_equal(a->expected.n_future, b->expected.n_future);
    assert_int_equal(a->kvcapsule.exact_tiles, b->kvcapsule.exact_tiles);
    assert_int_equal(a->expected.query_sinks, b->expected.query_sinks);
    assert_int_equal(a->expected.sinks, b->expected.sinks);
    assert_int_equal(a->expected.window, b->expected.window);
    assert_int_equal(a->has_model, b->has_model);
}

static void test_shipped_runtime(void **state)
{
    (void)state;
    struct kvcap_runtime_config r, d;
    assert_int_equal(kvcap_runtime_config_load_file(SHIPPED "runtime.yaml", &r), KVCAP_OK);
    kvcap_runtime_config_default(&d);
    assert_runtime_equal(&r, &d);
    /* The documented defaults (DESIGN §3, §5-7 and config.h). */
    assert_string_equal(d.artifact, "");
    assert_int_equal(d.policy[KVCAP_SPAN_VISION], KVCAP_POLICY_FLASHCACHE);
    assert_int_equal(d.policy[KVCAP_SPAN_TEXT], KVCAP_POLICY_FULL);
    assert_int_equal(d.policy[KVCAP_SPAN_GENERATED], KVCAP_POLICY_FULL);
    assert_int_equal(d.fallback, KVCAP_POLICY_FLASHCACHE);
    /* FlashCache and VL-Cache default to their papers: no protected tokens, no floor. */
    assert_true(d.flashcache.gamma == 0.2);
    assert_int_equal(d.flashcache.sinks + d.flashcache.window + d.flashcache.min_tokens, 0);
    assert_true(d.vlcache.p == 0.01);
    assert_true(d.vlcache.recent_fraction == 0.1);
    assert_int_equal(d.vlcache.sinks + d.vlcache.window + d.vlcache.uniform_layers, 0);
    assert_int_equal(d.freekv.page_size, 32);
    assert_int_equal(d.freekv.budget, 2048);
    assert_true(d.freekv.tau == 0.9);
    kvcap_runtime_config_free(&r);
    kvcap_runtime_config_free(&d);
    /* The protected presets' file. */
    assert_int_equal(kvcap_runtime_config_load_file(SHIPPED "runtime-protected.yaml", &r),
                     KVCAP_OK);
    assert_int_equal(r.flashcache.sinks, 4);
    assert_int_equal(r.flashcache.window, 16);
    assert_int_equal(r.flashcache.min_tokens, 8);
    assert_int_equal(r.vlcache.sinks, 4);
    assert_int_equal(r.vlcache.window, 16);
    kvcap_runtime_config_free(&r);
}

/* ---- Defaults and forms ------------------------------------------------------------------ */
static void test_calib_defaults(void **state)
{
    (void)state;
    struct kvcap_calib_config c;
    assert_int_equal(kvcap_calib_config_load_string(TINY, "tiny", &c), KVCAP_OK);
    assert_string_equal(c.model.name, "tiny");
    assert_int_equal(c.model.n_layers, 4);
    assert_int_equal(c.n_buckets, 1);
    assert_int_equal(c.buckets[0].structure, KVCAP_STRUCTURE_DENSE);
    assert_int_equal(c.buckets[0].tile_rows, 0);
    assert_int_equal(c.buckets[0].tile_cols, 0);
    expect_uniform(&c.schedule_keys, 0.5);
    expect_uniform(&c.schedule_values, 0.5);
    assert_int_equal(c.keys.method, KVCAP_KEY_METHOD_CLOSED_FORM);
    assert_int_equal(c.keys.activation, KVCAP_ACTIVATION_GELU);
    assert_int_equal(c.keys.hidden, 0);
    assert_true(c.keys.ridge == 1e-3);
    expect_default_train(&c.keys.train);
    assert_true(c.validation_fraction == 0.1);
    assert_int_equal(c.validation_seed, 0);
    assert_int_equal(c.storage, KVCAP_DTYPE_F16);
    kvcap_calib_config_free(&c);

    /* The name is optional; the struct is filled even when it was garbage before. */
    memset(&c, 0xA5, sizeof c);
    assert_int_equal(kvcap_calib_config_load_string(tiny_with("  name: tiny\n", ""), "x", &c),
                     KVCAP_OK);
    assert_string_equal(c.model.name, "");
    assert_true(c.validation_fraction == 0.1);
    kvcap_calib_config_free(&c);
}

static void test_schedule_expand(void **state)
{
    (void)state;
    double r[64];
    /* Pyramid: exact endpoints, constant step (linear in depth). */
    struct kvcap_schedule p = {.kind = KVCAP_SCHEDULE_PYRAMID, .first = 0.6, .last = 0.2};
    assert_int_equal(kvcap_schedule_expand(&p, 28, r), KVCAP_OK);
    assert_true(r[0] == 0.6);
    assert_true(r[27] == 0.2);
    double step = (0.2 - 0.6) / 27.0, mean = 0.0;
    for (int l = 0; l < 28; l++) {
        assert_true(fabs(r[l] - (0.6 + step * l)) < 1e-12);
        mean += r[l] / 28.0;
    }
    assert_true(fabs(mean - 0.4) < 1e-12); /* the headline ratio */
    /* An increasing pyramid and a one-layer model. */
    struct kvcap_schedule up = {.kind = KVCAP_SCHEDULE_PYRAMID, .first = 0.25, .last = 1.0};
    assert_int_equal(kvcap_schedule_expand(&up, 4, r), KVCAP_OK);
    assert_true(r[0] == 0.25 && r[1] == 0.5 && r[2] == 0.75 && r[3] == 1.0);
    assert_int_equal(kvcap_schedule_expand(&p, 1, r), KVCAP_OK);
    assert_true(r[0] == 0.6);

    struct kvcap_schedule u = {.kind = KVCAP_SCHEDULE_UNIFORM, .ratio = 0.3};
    assert_int_equal(kvcap_schedule_expand(&u, 5, r), KVCAP_OK);
    for (int l = 0; l < 5; l++)
        assert_true(r[l] == 0.3);

    /* A list comes from a config: one entry per layer, in order. */
    struct kvcap_calib_config c;
    assert_int_equal(
        kvcap_calib_config_load_string(
            tiny_with("schedule: {kind: uniform, ratio: 0.5}",
                      "schedule:\n  keys: {kind: list, ratios: [0.9, 0.7, .5, 1]}\n"
                      "  values: {kind: pyramid, first: 0.8, last: 0.2}"),
            "list", &c),
        KVCAP_OK);
    assert_int_equal(c.schedule_keys.kind, KVCAP_SCHEDULE_LIST);
    assert_int_equal(c.schedule_keys.n_ratios, 4);
    assert_int_equal(kvcap_schedule_expand(&c.schedule_keys, 4, r), KVCAP_OK);
    assert_true(r[0] == 0.9 && r[1] == 0.7 && r[2] == 0.5 && r[3] == 1.0);
    assert_int_equal(kvcap_schedule_expand(&c.schedule_values, 4, r), KVCAP_OK);
    assert_true(r[0] == 0.8 && r[3] == 0.2 && fabs(r[1] - 0.6) < 1e-12);
    /* Wrong length, NULL and no layers are argument errors. */
    assert_int_equal(kvcap_schedule_expand(&c.schedule_keys, 5, r), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_schedule_expand(NULL, 4, r), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_schedule_expand(&u, 0, r), KVCAP_ERR_INVALID_ARGUMENT);
    kvcap_calib_config_free(&c);
    kvcap_calib_config_free(&c); /* safe twice */
    assert_null(c.schedule_keys.ratios);

    /* A bare list schedule gives keys and values their own copies. */
    assert_int_equal(kvcap_calib_config_load_string(
                         tiny_with("{kind: uniform, ratio: 0.5}",
                                   "{kind: list, ratios: [0.4, 0.3, 0.2, 0.1]}"),
                         "bare-list", &c),
                     KVCAP_OK);
    assert_int_equal(c.schedule_values.kind, KVCAP_SCHEDULE_LIST);
    assert_int_equal(c.schedule_values.n_ratios, 4);
    assert_ptr_not_equal(c.schedule_keys.ratios, c.schedule_values.ratios);
    assert_memory_equal(c.schedule_keys.ratios, c.schedule_values.ratios, 4 * sizeof(double));
    kvcap_calib_config_free(&c);
}

/* Number spellings that are accepted, and the values they give. */
static void test_numbers_accepted(void **state)
{
    (void)state;
    struct kvcap_calib_config c;
    assert_int_equal(kvcap_calib_config_load_string(
                         tiny_with("theta: 10000}", "theta: 1.0e+6, dim: +32}"), "n", &c),
                     KVCAP_OK);
    assert_true(c.model.rope_theta == 1e6);
    assert_int_equal(c.model.rope_dim, 32);
    kvcap_calib_config_free(&c);

    char text[2048];
    snprintf(text, sizeof text,
             "%skeys: {hidden: 12, ridge: 0, train: {lr: 5E-4, seed: 18446744073709551615}}\n"
             "validation: {fraction: 0, seed: 42}\nstorage: BF16\n",
             TINY);
    assert_int_equal(kvcap_calib_config_load_string(text, "n", &c), KVCAP_OK);
    assert_int_equal(c.keys.hidden, 12);
    assert_true(c.keys.ridge == 0.0);
    assert_true(c.keys.train.lr == 5e-4);
    assert_true(c.keys.train.seed == UINT64_MAX);
    assert_true(c.validation_fraction == 0.0);
    assert_int_equal(c.validation_seed, 42);
    assert_int_equal(c.storage, KVCAP_DTYPE_BF16);
    kvcap_calib_config_free(&c);
}

/* Inline bad strings: the label replaces the file name in the message. */
static void test_load_string_errors(void **state)
{
    (void)state;
    static const struct {
        const char *from, *to, *where, *needle;
    } cases[] = {
        {"layers: 4", "layers: 0x10", "3:11", "model.layers: expected an integer, got '0x10'"},
        {"layers: 4", "layers: 1_000", "3:11", "model.layers: expected an integer"},
        {"layers: 4", "layers: 4.0", "3:11", "model.layers: expected an integer, got '4.0'"},
        {"layers: 4", "layers: -4", "3:11", "model.layers: -4 is outside 1..1024"},
        {"layers: 4", "layers:", "3:10", "model.layers: expected an integer, got an empty value"},
        {"theta: 10000", "theta: 0x1p3", "7:44", "model.rope.theta: expected a number"},
        {"theta: 10000", "theta: inf", "7:44", "model.rope.theta: expected a number, got 'inf'"},
        {"theta: 10000", "theta: -.inf", "7:44", "model.rope.theta: expected a number"},
        {"theta: 10000", "theta: -5", "7:44", "model.rope.theta: -5 must be > 0"},
        {"theta: 10000", "theta: 1e-400", "7:44", "model.rope.theta: 1e-400 is out of range"},
        /* sections whose int sum wraps around to rope dim / 2 = 32 */
        {"type: rope, pairing: half, theta: 10000",
         "type: mrope, pairing: half, theta: 10000, sections: [2147483647, 2147483647, 34]",
         "7:62", "model.rope.sections: sum 4294967328 != rotated pairs 32"},
        {"theta: 10000}", "theta: 10000, dim: 33}", "7:56", "model.rope.dim: 33 must be even"},
        {"theta: 10000}", "theta: 10000, dim: 128}", "7:56", "model.rope.dim: 128 must be even"},
        {"pairing: half", "pairing: diagonal", "7:31", "model.rope.pairing: 'diagonal' is not "
                                                       "one of half, adjacent"},
        {"head_dim: 64", "head_dim: {a: 1}", "6:13", "model.head_dim: expected an integer, got "
                                                     "a mapping"},
        {"name: tiny", "name: [a]", "2:9", "model.name: expected a string, got a list"},
        {"name: tiny", "name: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
         "2:9", "model.name: longer than 63 bytes"},
        {"name: tiny", "name: \"a\\0b\"", "2:9", "model.name: contains a NUL character"},
        {"{rows: 16, cols: 16}", "{rows: 16, cols: 16, structure: sparse}", "9:37",
         "buckets[0].structure: 'sparse' is not one of dense, tiled"},
        {"{rows: 16, cols: 16}", "{rows: 16, cols: 16, structure: tiled, tile: [4]}", "9:50",
         "buckets[0].tile: 1 entries, expected 2"},
        {"{rows: 16, cols: 16}", "{rows: 16, cols: 4097}", "9:5",
         "buckets[0]: grid 16x4097 must be within 1..4096"},
        {"buckets:\n  - {rows: 16, cols: 16}", "buckets: {rows: 16}", "8:10",
         "buckets: expected a list, got a mapping"},
        {"{kind: uniform, ratio: 0.5}", "{kind: pyramid, first: 0.5}", "10:11",
         "schedule: missing required key 'last'"},
        {"{kind: uniform, ratio: 0.5}", "{kind: uniform, first: 0.5}", "10:27",
         "schedule.first: unknown key for kind uniform (expected kind, ratio)"},
        {"{kind: uniform, ratio: 0.5}", "{}", "10:11",
         "schedule: give 'kind' (one schedule for keys and values) or 'keys' and 'values'"},
        {"{kind: uniform, ratio: 0.5}", "{kind: list, ratios: [0.5, 0.5, 0.5, 0.5, 0.5]}",
         "10:32", "schedule.ratios: 5 ratios, expected one per layer (model.layers = 4)"},
        {"model:\n", "model:\n  model: x\n", "2:3", "model.model: unknown key"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct kvcap_calib_config c;
        enum kvcap_status st =
            kvcap_calib_config_load_string(tiny_with(cases[i].from, cases[i].to), "inline", &c);
        if (st != KVCAP_ERR_CONFIG)
            fail_msg("case %zu (%s): status %d, message: %s", i, cases[i].to, (int)st,
                     kvcap_last_error());
        assert_error_at("inline", cases[i].where, cases[i].needle);
        assert_calib_is_default(&c);
        kvcap_calib_config_free(&c);
    }
    /* No label: "<string>". */
    struct kvcap_calib_config c;
    assert_int_equal(kvcap_calib_config_load_string("model: [", NULL, &c), KVCAP_ERR_CONFIG);
    assert_error_at("<string>", "2:1", "did not find expected node content");
    /* A label that is not a file name, as a tool embedding its default config would pass. */
    assert_int_equal(kvcap_calib_config_load_string(tiny_with("layers: 4", "layers: 4x"),
                                                    "kvcap-calibrate:builtin", &c),
                     KVCAP_ERR_CONFIG);
    assert_error_at("kvcap-calibrate:builtin", "3:11", "model.layers");
}

static void test_runtime_forms(void **state)
{
    (void)state;
    struct kvcap_runtime_config r;
    /* An artifact switches the vision default to kvcapsule; a string keeps a relative path. */
    assert_int_equal(kvcap_runtime_config_load_string("artifact: out/q.kvcap\n", "s", &r),
                     KVCAP_OK);
    assert_string_equal(r.artifact, "out/q.kvcap");
    assert_int_equal(r.policy[KVCAP_SPAN_VISION], KVCAP_POLICY_KVCAPSULE);
    assert_int_equal(r.policy[KVCAP_SPAN_TEXT], KVCAP_POLICY_FULL);
    assert_int_equal(r.fallback, KVCAP_POLICY_FLASHCACHE);
    /* ... unless the vision policy is given. */
    assert_int_equal(kvcap_runtime_config_load_string(
                         "artifact: /abs/q.kvcap\npolicies: {vision: vlcache}\n", "s", &r),
                     KVCAP_OK);
    assert_string_equal(r.artifact, "/abs/q.kvcap");
    assert_int_equal(r.policy[KVCAP_SPAN_VISION], KVCAP_POLICY_VLCACHE);
    /* artifact: null means none; {} is all defaults. */
    assert_int_equal(kvcap_runtime_config_load_string("artifact: ~\n", "s", &r), KVCAP_OK);
    assert_string_equal(r.artifact, "");
    assert_int_equal(r.policy[KVCAP_SPAN_VISION], KVCAP_POLICY_FLASHCACHE);
    struct kvcap_runtime_config d;
    kvcap_runtime_config_default(&d);
    assert_int_equal(kvcap_runtime_config_load_string("{}", "s", &r), KVCAP_OK);
    assert_runtime_equal(&r, &d);

    /* From a file: the relative artifact path resolves against the file's directory, the
     * optional model goes through the same geometry parser as the calibration config. */
    assert_int_equal(kvcap_runtime_config_load_file(GOOD_DIR "runtime-artifact.yaml", &r),
                     KVCAP_OK);
    assert_string_equal(r.artifact,
                        KVCAP_TEST_DATA "/configs/good/../artifacts/qwen2.5-vl-7b.kvcap");
    assert_int_equal(r.policy[KVCAP_SPAN_VISION], KVCAP_POLICY_KVCAPSULE);
    assert_int_equal(r.policy[KVCAP_SPAN_TEXT], KVCAP_POLICY_STREAMING);
    assert_int_equal(r.policy[KVCAP_SPAN_GENERATED], KVCAP_POLICY_FULL);
    assert_int_equal(r.fallback, KVCAP_POLICY_VLCACHE);
    assert_true(r.vlcache.p == 0.02);
    assert_true(r.vlcache.budget == 0.3);
    assert_true(r.vlcache.min_fraction == 0.01); /* default kept */
    assert_int_equal(r.vlcache.uniform_layers, 1);
    assert_int_equal(r.freekv.page_size, 16);
    assert_int_equal(r.freekv.budget, 512);
    assert_true(r.freekv.tau == 0.8);
    assert_int_equal(r.freekv.sink_pages, 2);
    assert_int_equal(r.freekv.window_pages, 4);
    assert_int_equal(r.streaming.sinks, 8);
    assert_int_equal(r.streaming.window, 256);
    assert_true(r.kvzip.retention == 0.25);
    assert_int_equal(r.kvzip.sinks, 4);
    assert_int_equal(r.kvzip.window, 0); /* default kept */
    assert_true(r.kvzip.safeguard == 0.5);
    assert_int_equal(r.kvzip.value_basis, 1);
    assert_int_equal(r.kvzip.exact_values, 3);
    assert_true(r.random.retention == 0.5);
    assert_int_equal(r.random.seed, 17);
    assert_int_equal(r.expected.n_future, 256);
    assert_int_equal(r.expected.query_sinks, 4); /* default kept */
    assert_int_equal(r.kvcapsule.exact_tiles, 2);
    assert_int_equal(r.has_model, 1);
    assert_int_equal(r.model.n_layers, 30);
    assert_int_equal(r.model.rope_pairing, KVCAP_ROPE_PAIRING_ADJACENT);
    assert_int_equal(r.model.rope_dim, 32);
    kvcap_runtime_config_free(&r);
    kvcap_runtime_config_free(NULL);
}

/* ---- The bad corpus ------------------------------------------------------------------------ */
struct bad_case {
    const char *file;  /* in data/configs/bad */
    const char *where; /* "line:col", 1-based */
    const char *needle;
};

static const struct bad_case bad_cases[] = {
    /* YAML itself */
    {"calib-syntax.yaml", "9:8", "did not find expected ',' or '}' (while parsing a flow "
                                 "mapping at 8:9)"},
    {"calib-tab.yaml", "4:1", "found a tab character that violates indentation"},
    {"calib-invalid-utf8.yaml", "3:11", "invalid leading UTF-8 octet (byte 0xFF)"},
    {"calib-undefined-alias.yaml", "7:13", "found undefined alias"},
    {"calib-two-docs.yaml", "12:1", "a second YAML document"},
    {"runtime-empty.yaml", "1:1", "empty document, expected a mapping"},
    /* node types and numbers */
    {"calib-root-list.yaml", "2:1", "top level: expected a mapping, got a list"},
    {"calib-not-mapping.yaml", "2:8", "model: expected a mapping, got '28'"},
    {"calib-layers-list.yaml", "4:11", "model.layers: expected an integer, got a list"},
    {"calib-theta-word.yaml", "8:44", "model.rope.theta: expected a number, got 'fast'"},
    {"calib-bad-number.yaml", "4:11", "model.layers: expected an integer, got '12abc'"},
    {"calib-quoted-number.yaml", "4:11", "model.layers: expected an integer, got the string"},
    {"calib-nan.yaml", "8:44", "model.rope.theta: expected a number, got '.nan'"},
    {"calib-inf.yaml", "8:44", "model.rope.theta: 1e999 is out of range for a double"},
    {"calib-int-overflow.yaml", "4:11", "model.layers: 99999999999999999999 is out of range"},
    {"calib-negative-seed.yaml", "12:35", "validation.seed: -1 is outside 0.."},
    {"calib-key-not-scalar.yaml", "8:10", "model.rope: keys must be scalars, got a list"},
    /* keys */
    {"calib-unknown-key.yaml", "12:5", "model.rope.typo: unknown key (expected type, pairing"},
    {"calib-unknown-top.yaml", "9:1", "bucket: unknown key (expected model, buckets"},
    {"calib-duplicate-key.yaml", "8:3", "model.layers: duplicate key (first at 4:3)"},
    {"calib-missing-required.yaml", "3:3", "model: missing required key 'layers'"},
    {"calib-missing-top.yaml", "2:1", "missing required key 'schedule'"},
    {"calib-mrope-no-sections.yaml", "8:9", "model.rope: missing required key 'sections'"},
    /* geometry (kvcap_geometry_validate, placed at the field's node) */
    {"calib-layers-range.yaml", "4:11", "model.layers: 2000 is outside 1..1024"},
    {"calib-head-dim.yaml", "7:13", "model.head_dim: 100 is not one of 64, 80, 96, 128, 256"},
    {"calib-q-heads.yaml", "5:12", "model.q_heads: 7 is not a positive multiple of kv_heads"},
    {"calib-mrope-sum.yaml", "8:64", "model.rope.sections: sum 60 != rotated pairs 64"},
    {"calib-sections-with-rope.yaml", "8:61", "model.rope.sections: only valid with type mrope"},
    {"calib-rope-none-theta.yaml", "8:29", "model.rope.theta: only valid with type rope or "
                                           "mrope"},
    {"calib-rope-type.yaml", "8:16", "model.rope.type: 'yarn' is not one of none, rope, mrope"},
    /* buckets */
    {"calib-tile-divide.yaml", "14:11", "buckets[1].tile: [3, 4] does not divide the grid "
                                        "16x16"},
    {"calib-tile-dense.yaml", "10:32", "buckets[0].tile: only valid with structure tiled"},
    {"calib-tiled-no-tile.yaml", "10:5", "buckets[0]: missing required key 'tile'"},
    {"calib-bucket-grid.yaml", "10:5", "buckets[0]: grid 0x16 must be within 1..4096"},
    {"calib-bucket-duplicate.yaml", "11:5", "buckets[1]: same grid, structure and tile as "
                                            "buckets[0]"},
    {"calib-too-many-buckets.yaml", "10:3", "buckets: 17 buckets, expected 1..16"},
    {"calib-no-buckets.yaml", "9:10", "buckets: 0 buckets, expected 1..16"},
    /* schedules */
    {"calib-list-length.yaml", "12:30", "schedule.keys.ratios: 3 ratios, expected one per "
                                        "layer (model.layers = 4)"},
    {"calib-list-ratio.yaml", "13:43", "schedule.values.ratios[2]: 1.3 is outside (0, 1]"},
    {"calib-ratio-range.yaml", "11:34", "schedule.ratio: 1.5 is outside (0, 1]"},
    {"calib-ratio-zero.yaml", "11:45", "schedule.last: 0 is outside (0, 1]"},
    {"calib-schedule-kind.yaml", "11:18", "schedule.kind: 'linear' is not one of pyramid, "
                                          "uniform, list"},
    {"calib-schedule-mixed.yaml", "11:39", "schedule.keys: unknown key for kind uniform"},
    {"calib-schedule-values-missing.yaml", "12:3", "schedule: missing required key 'values'"},
    /* key fitting, validation, storage */
    {"calib-method.yaml", "12:16", "keys.method: 'sgd' is not one of closed_form, trained"},
    {"calib-tau.yaml", "16:14", "keys.train.tau_end: 2 exceeds tau_start 0.5"},
    {"calib-validation-fraction.yaml", "12:24", "validation.fraction: 1.0 is outside [0, 1)"},
    {"calib-storage.yaml", "12:10", "storage: 'f64' is not one of F32, F16, BF16"},
    /* runtime */
    {"runtime-policy-name.yaml", "3:11", "policies.vision: 'fastcache' is not one of full, "
                                         "kvcapsule, flashcache, vlcache, freekv, streaming, "
                                         "kvzip, random, expected_attention"},
    {"runtime-fallback-kvcapsule.yaml", "3:11", "fallback: cannot be kvcapsule"},
    {"runtime-kvcapsule-text.yaml", "4:9", "policies.text: kvcapsule applies to vision spans "
                                           "only"},
    {"runtime-freekv-budget.yaml", "4:11", "freekv.budget: 96 tokens leave no page to "
                                           "retrieve: need >= 128"},
    {"runtime-model-kv-heads.yaml", "6:13", "model.kv_heads: 0 is outside 1..1024"},
    {"runtime-unknown-key.yaml", "4:3", "flashcache.gama: unknown key (expected gamma"},
    {"runtime-kvcapsule-key.yaml", "2:13", "kvcapsule.rank: unknown key (expected "
                                           "exact_tiles)"},
    {"runtime-kvcapsule-exact.yaml", "2:26", "kvcapsule.exact_tiles: -1 is outside 0..1048576"},
    {"runtime-gamma-range.yaml", "2:21", "flashcache.gamma: 0 is outside (0, 1]"},
    {"runtime-window-range.yaml", "4:11", "streaming.window: 0 is outside 1..1073741824"},
    {"runtime-streaming-sum.yaml", "4:11", "streaming.sinks + streaming.window: 1073741824 + "
                                           "1073741824 = 2147483648 tokens, at most 1073741824"},
    {"runtime-kvzip-retention.yaml", "2:20", "kvzip.retention: 0 is outside (0, 1]"},
    {"runtime-kvzip-safeguard.yaml", "2:36", "kvzip.safeguard: 1.5 is outside [0, 1]"},
    {"runtime-kvzip-values.yaml", "2:33", "kvzip.values: 'pca' is not rows"},
    {"runtime-vlcache-layer-budgets.yaml", "2:39", "vlcache.layer_budgets: 'even' is not sparsity"},
    {"runtime-random-key.yaml", "2:26", "random.sead: unknown key (expected retention"},
};

static void test_bad_corpus(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, BAD_DIR "%s", bad_cases[i].file);
        enum kvcap_status st;
        if (strncmp(bad_cases[i].file, "runtime-", 8) == 0) {
            struct kvcap_runtime_config r, d;
            st = kvcap_runtime_config_load_file(path, &r);
            kvcap_runtime_config_default(&d);
            if (st == KVCAP_ERR_CONFIG)
                assert_runtime_equal(&r, &d); /* a failed load leaves the defaults */
            kvcap_runtime_config_free(&r);
        } else {
            struct kvcap_calib_config c;
            st = kvcap_calib_config_load_file(path, &c);
            if (st == KVCAP_ERR_CONFIG)
                assert_calib_is_default(&c);
            kvcap_calib_config_free(&c);
        }
        if (st != KVCAP_ERR_CONFIG)
            fail_msg("%s: status %d (%s), message: %s", bad_cases[i].file, (int)st,
                     kvcap_status_str(st), kvcap_last_error());
        assert_error_at(path, bad_cases[i].where, bad_cases[i].needle);
    }
}

/* Every file in the corpus has a row in the table (a file without one would test nothing). */
static void test_bad_corpus_complete(void **state)
{
    (void)state;
    DIR *dir = opendir(BAD_DIR);
    assert_non_null(dir);
    int files = 0;
    for (struct dirent *e; (e = readdir(dir));) {
        if (e->d_name[0] == '.')
            continue;
        files++;
        int listed = 0;
        for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++)
            listed |= strcmp(bad_cases[i].file, e->d_name) == 0;
        if (!listed)
            fail_msg("%s%s has no row in bad_cases", BAD_DIR, e->d_name);
    }
    closedir(dir);
    assert_int_equal(files, (int)(sizeof bad_cases / sizeof bad_cases[0]));
}

/* ---- Arguments, I/O, size limit ------------------------------------------------------------- */
static void test_io_and_arguments(void **state)
{
    (void)state;
    struct kvcap_calib_config c;
    struct kvcap_runtime_config r;
    assert_int_equal(kvcap_calib_config_load_file(BAD_DIR "no-such-file.yaml", &c), KVCAP_ERR_IO);
    assert_non_null(strstr(kvcap_last_error(), "no-such-file.yaml: cannot open"));
    assert_calib_is_default(&c);
    /* a folder is refused before it is read */
    assert_int_equal(kvcap_runtime_config_load_file(BAD_DIR, &r), KVCAP_ERR_IO);
    assert_non_null(strstr(kvcap_last_error(), "not a regular file (a folder)"));

    assert_int_equal(kvcap_calib_config_load_file(NULL, &c), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_calib_config_load_file(SHIPPED "runtime.yaml", NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_calib_config_load_string(NULL, "x", &c), KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_runtime_config_load_string("{}", "x", NULL),
                     KVCAP_ERR_INVALID_ARGUMENT);
    assert_int_equal(kvcap_runtime_config_load_file(NULL, &r), KVCAP_ERR_INVALID_ARGUMENT);
    kvcap_calib_config_free(NULL);
    kvcap_runtime_config_free(NULL);
    kvcap_calib_config_default(NULL);
    kvcap_runtime_config_default(NULL);

    /* A file over the size limit is refused before parsing. */
    const char *tmp = getenv("TMPDIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/kvcap-config-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    assert_non_null(f);
    fputs(TINY, f);
    for (int i = 0; i < KVCAP_CONFIG_MAX_BYTES / 32; i++) /* 2 MiB of comments */
        fputs("# padding padding padding padding padding padding padding padd\n", f);
    fclose(f);
    assert_int_equal(kvcap_calib_config_load_file(path, &c), KVCAP_ERR_CONFIG);
    assert_non_null(strstr(kvcap_last_error(), "larger than"));
    unlink(path);
}

/* Hostile nesting is refused early: libyaml's time grows with the square of the depth. */
static void test_deep_nesting(void **state)
{
    (void)state;
    enum { DEPTH = 100000 };
    char *text = malloc(2 * DEPTH + 16);
    assert_non_null(text);
    size_t n = (size_t)sprintf(text, "model: ");
    memset(text + n, '[', DEPTH);
    memset(text + n + DEPTH, ']', DEPTH);
    text[n + 2 * DEPTH] = '\0';
    struct kvcap_runtime_config r;
    assert_int_equal(kvcap_runtime_config_load_string(text, "deep", &r), KVCAP_ERR_CONFIG);
    assert_error_at("deep", "1:23", "nesting deeper than 16 levels");
    free(text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shipped_qwen),
        cmocka_unit_test(test_shipped_llava),
        cmocka_unit_test(test_shipped_smollm2),
        cmocka_unit_test(test_demo_calib_configs),
        cmocka_unit_test(test_shipped_runtime_configs),
        cmocka_unit_test(test_shipped_runtime),
        cmocka_unit_test(test_calib_defaults),
        cmocka_unit_test(test_schedule_expand),
        cmocka_unit_test(test_numbers_accepted),
        cmocka_unit_test(test_load_string_errors),
        cmocka_unit_test(test_runtime_forms),
        cmocka_unit_test(test_bad_corpus),
        cmocka_unit_test(test_bad_corpus_complete),
        cmocka_unit_test(test_io_and_arguments),
        cmocka_unit_test(test_deep_nesting),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
