/* fuzz_calib_state.c — reading a calibration state (calibrate/state.c over formats/schema.c)
 * from hostile bytes: every array of a state that loads is read end to end and keeps the
 * documented invariants, what was read is written and read back unchanged, and a small state
 * converts (convert/convert.c) to an artifact that opens, or fails with a status. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/artifact.h"
#include "convert/convert.h"
#include "tests/fuzz/fuzz_common.h"
#include "calibrate/state.h"

/* States up to this many Gram entries (all units) are also converted to an artifact: the
 * refit is an eigen-decomposition per unit, cheap at these sizes. */
#define CONVERT_GRAM_MAX 16384

/* Reads n doubles or floats so ASan sees an undersized allocation. */
static double sum_d(const double *x, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += x[i];
    return s;
}

static double sum_f(const float *x, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += x[i];
    return s;
}

static void check_state(const struct kvcap_calib_state *s)
{
    kvcap_clear_error();
    FUZZ_ASSERT(kvcap_geometry_validate(&s->model) == KVCAP_OK, "invalid model accepted: %s",
                kvcap_last_error());
    FUZZ_ASSERT(s->n_buckets >= 1 && s->n_buckets <= KVCAP_MAX_BUCKETS, "%d buckets",
                s->n_buckets);
    for (int l = 0; l < s->model.n_layers; l++)
        FUZZ_ASSERT(s->r_keys[l] > 0 && s->r_keys[l] <= 1 && s->r_values[l] > 0 &&
                        s->r_values[l] <= 1,
                    "layer %d ratios %g, %g", l, s->r_keys[l], s->r_values[l]);
    volatile double sink = 0;
    for (int l = 0; l < s->model.n_layers; l++)
        for (int h = 0; h < s->model.n_kv_heads; h++)
            for (int b = 0; b < s->n_buckets; b++) {
                const struct kvcap_calib_unit *u = kvcap_state_unit(s, l, h, b);
                size_t m = (size_t)u->m;
                FUZZ_ASSERT(u->m == kvcap_bucket_points(&s->buckets[b]), "unit m %d", u->m);
                sink += sum_d(u->v_gram, m * m) + sum_d(u->k_gram, m * m);
                FUZZ_ASSERT(!u->v_eigval == !u->v_eigvec, "half a value fit");
                if (u->v_eigval)
                    sink += sum_d(u->v_eigval, m) + sum_f(u->v_eigvec, m * m);
                if (!u->has_keys)
                    continue;
                const struct kvcap_key_maps *k = &u->keys;
                FUZZ_ASSERT(k->m == u->m && k->rk >= 1 && k->rk <= k->m && k->h >= 1,
                            "key maps m %d rk %d h %d", k->m, k->rk, k->h);
                for (int i = 0; i < k->rk; i++)
                    FUZZ_ASSERT(k->mask[i] >= 0 && k->mask[i] < k->m &&
                                    (i == 0 || k->mask[i] > k->mask[i - 1]),
                                "mask[%d] = %d", i, (int)k->mask[i]);
                sink += sum_f(k->w1, (size_t)k->rk * k->h) + sum_f(k->b1, (size_t)k->h) +
                        sum_f(k->w2, (size_t)k->h * m) + sum_f(k->b2, m);
            }
    (void)sink;
}

/* The parts a write and a read must carry over bit for bit. */
static void check_same(const struct kvcap_calib_state *a, const struct kvcap_calib_state *b)
{
    FUZZ_ASSERT(!kvcap_geometry_difference(&a->model, &b->model), "model %s differs",
                kvcap_geometry_difference(&a->model, &b->model));
    FUZZ_ASSERT(a->n_buckets == b->n_buckets, "buckets %d != %d", a->n_buckets, b->n_buckets);
    FUZZ_ASSERT(memcmp(a->train_spans, b->train_spans, sizeof a->train_spans) == 0 &&
                    memcmp(a->val_spans, b->val_spans, sizeof a->val_spans) == 0,
                "span counts differ");
    size_t n = (size_t)a->model.n_layers * a->model.n_kv_heads * a->n_buckets;
    for (size_t i = 0; i < n; i++) {
        const struct kvcap_calib_unit *u = &a->units[i], *v = &b->units[i];
        size_t mm = (size_t)u->m * u->m;
        FUZZ_ASSERT(u->m == v->m && memcmp(u->v_gram, v->v_gram, mm * sizeof(double)) == 0 &&
                        memcmp(u->k_gram, v->k_gram, mm * sizeof(double)) == 0,
                    "unit %zu: Grams differ", i);
        FUZZ_ASSERT(!u->v_eigval == !v->v_eigval && u->has_keys == v->has_keys,
                    "unit %zu: fitted parts differ", i);
        if (u->has_keys)
            FUZZ_ASSERT(u->keys.rk == v->keys.rk && u->keys.h == v->keys.h &&
                            u->keys.gelu == v->keys.gelu &&
                            memcmp(u->keys.mask, v->keys.mask, sizeof(int32_t) * u->keys.rk) == 0,
                        "unit %zu: key maps differ", i);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[4400], again[4400];
    fuzz_write_file(path, sizeof path, "state.kvcs", data, size);
    struct kvcap_calib_state s;
    kvcap_clear_error();
    enum kvcap_status st = kvcap_calib_state_read(path, &s);
    fuzz_check_status(st, "kvcap_calib_state_read");
    if (st != KVCAP_OK) {
        FUZZ_ASSERT(s.units == NULL && s.r_keys == NULL, "a failed read kept its arrays");
        return 0;
    }
    check_state(&s);

    /* kvcap-convert and kvcap-calibrate --merge write what they read. */
    fuzz_path(again, sizeof again, "again.kvcs");
    kvcap_clear_error();
    st = kvcap_calib_state_write(&s, again);
    FUZZ_ASSERT(st == KVCAP_OK, "writing a state that was read: %s", kvcap_last_error());
    struct kvcap_calib_state t;
    kvcap_clear_error();
    st = kvcap_calib_state_read(again, &t);
    FUZZ_ASSERT(st == KVCAP_OK, "reading a state written from one that was read: %s",
                kvcap_last_error());
    check_same(&s, &t);
    kvcap_calib_state_free(&t);

    /* kvcap-convert on what was read: a status, and an artifact that opens when it is OK. */
    size_t grams = 0;
    for (int b = 0; b < s.n_buckets; b++) {
        size_t m = (size_t)kvcap_bucket_points(&s.buckets[b]);
        grams += m * m * (size_t)s.model.n_layers * (size_t)s.model.n_kv_heads;
    }
    kvcap_calib_state_free(&s);
    if (grams > CONVERT_GRAM_MAX)
        return 0;
    char art[4400];
    fuzz_path(art, sizeof art, "converted.kvcap");
    const char *states[1] = {path};
    struct kvcap_convert_options o;
    kvcap_convert_default_options(&o);
    o.states = states;
    o.n_states = 1;
    o.out = art;
    struct kvcap_convert_report report;
    kvcap_clear_error();
    st = kvcap_convert(&o, &report);
    fuzz_check_status(st, "kvcap_convert");
    if (st == KVCAP_OK) {
        struct kvcap_artifact *a = NULL;
        kvcap_clear_error();
        st = kvcap_artifact_open(art, &a);
        FUZZ_ASSERT(st == KVCAP_OK, "the converted artifact does not open: %s",
                    kvcap_last_error());
        kvcap_artifact_free(a);
    }
    return 0;
}
