/* geometry.c — validation shared by configs, file headers and caches: the model geometry,
 * buckets, and the whole numbers their readers take from JSON and YAML. */
#include <limits.h>
#include <math.h>
#include <string.h>

#include "common/internal.h"

int kvcap_int64_from_double(double v, int64_t lo, int64_t hi, int64_t *out)
{
    /* [-2^63, 2^63) first: (double)INT64_MAX rounds up to 2^63, which no int64_t holds. */
    if (!isfinite(v) || v != floor(v) || !(v >= -0x1p63 && v < 0x1p63))
        return 0;
    int64_t i = (int64_t)v;
    if (i < lo || i > hi)
        return 0;
    *out = i;
    return 1;
}

int kvcap_int_from_double(double v, long lo, long hi, int *out)
{
    int64_t i;
    if (!kvcap_int64_from_double(v, lo < INT_MIN ? INT_MIN : lo, hi > INT_MAX ? INT_MAX : hi, &i))
        return 0;
    *out = (int)i;
    return 1;
}

enum kvcap_status kvcap_geometry_validate(const struct kvcap_model_geometry *g)
{
    KVCAP_RETURN_IF(!g, KVCAP_ERR_INVALID_ARGUMENT, "geometry: NULL pointer");
    KVCAP_RETURN_IF(g->n_layers < 1 || g->n_layers > 1024, KVCAP_ERR_GEOMETRY,
                    "model.layers: %d is outside 1..1024", g->n_layers);
    KVCAP_RETURN_IF(g->n_kv_heads < 1 || g->n_kv_heads > 1024, KVCAP_ERR_GEOMETRY,
                    "model.kv_heads: %d is outside 1..1024", g->n_kv_heads);
    KVCAP_RETURN_IF(g->n_q_heads < g->n_kv_heads || g->n_q_heads % g->n_kv_heads != 0,
                    KVCAP_ERR_GEOMETRY,
                    "model.q_heads: %d is not a positive multiple of kv_heads (%d)",
                    g->n_q_heads, g->n_kv_heads);
    int d = g->head_dim;
    KVCAP_RETURN_IF(d != 64 && d != 80 && d != 96 && d != 128 && d != 256, KVCAP_ERR_GEOMETRY,
                    "model.head_dim: %d is not one of 64, 80, 96, 128, 256", d);
    if (g->rope_type == KVCAP_ROPE_NONE)
        return KVCAP_OK;
    KVCAP_RETURN_IF(g->rope_type != KVCAP_ROPE_ROPE && g->rope_type != KVCAP_ROPE_MROPE,
                    KVCAP_ERR_GEOMETRY, "model.rope.type: unknown value %d", (int)g->rope_type);
    KVCAP_RETURN_IF(g->rope_pairing != KVCAP_ROPE_PAIRING_HALF &&
                        g->rope_pairing != KVCAP_ROPE_PAIRING_ADJACENT,
                    KVCAP_ERR_GEOMETRY, "model.rope.pairing: unknown value %d",
                    (int)g->rope_pairing);
    int rd = g->rope_dim ? g->rope_dim : d;
    KVCAP_RETURN_IF(rd < 2 || rd > d || rd % 2 != 0, KVCAP_ERR_GEOMETRY,
                    "model.rope.dim: %d must be even and in 2..head_dim (%d)", g->rope_dim, d);
    /* An infinite base makes every frequency but the first 0 (and a NaN every angle NaN):
     * refused here, so the API, file headers and YAML configs agree. */
    KVCAP_RETURN_IF(!isfinite(g->rope_theta) || !(g->rope_theta > 0.0), KVCAP_ERR_GEOMETRY,
                    "model.rope.theta: %g must be > 0 and finite", g->rope_theta);
    if (g->rope_type == KVCAP_ROPE_MROPE) {
        KVCAP_RETURN_IF(g->n_rope_sections < 1 || g->n_rope_sections > KVCAP_MAX_ROPE_SECTIONS,
                        KVCAP_ERR_GEOMETRY, "model.rope.sections: %d sections, need 1..%d",
                        g->n_rope_sections, KVCAP_MAX_ROPE_SECTIONS);
        /* Summed in 64 bits: sections near INT_MAX must not wrap around to the right total. */
        int64_t sum = 0;
        for (int i = 0; i < g->n_rope_sections; i++) {
            KVCAP_RETURN_IF(g->rope_sections[i] < 0, KVCAP_ERR_GEOMETRY,
                            "model.rope.sections[%d]: %d is negative", i, g->rope_sections[i]);
            sum += g->rope_sections[i];
        }
        KVCAP_RETURN_IF(sum != rd / 2, KVCAP_ERR_GEOMETRY,
                        "model.rope.sections: sum %lld != rotated pairs %d (rope dim / 2)",
                        (long long)sum, rd / 2);
    } else {
        KVCAP_RETURN_IF(g->n_rope_sections != 0, KVCAP_ERR_GEOMETRY,
                        "model.rope.sections: only valid with type mrope");
    }
    return KVCAP_OK;
}

static enum kvcap_status bucket_rules(const struct kvcap_bucket *b, const char *field)
{
    KVCAP_RETURN_IF(!b, KVCAP_ERR_INVALID_ARGUMENT, "%s: NULL bucket", field);
    KVCAP_RETURN_IF(b->rows < 1 || b->cols < 1 || b->rows > 4096 || b->cols > 4096,
                    KVCAP_ERR_GEOMETRY, "%s: grid %dx%d must be within 1..4096 per side", field,
                    b->rows, b->cols);
    if (b->structure == KVCAP_STRUCTURE_DENSE) {
        KVCAP_RETURN_IF(b->tile_rows != 0 || b->tile_cols != 0, KVCAP_ERR_GEOMETRY,
                        "%s.tile: only valid with structure tiled", field);
        return KVCAP_OK;
    }
    KVCAP_RETURN_IF(b->structure != KVCAP_STRUCTURE_TILED, KVCAP_ERR_GEOMETRY,
                    "%s.structure: unknown value %d", field, (int)b->structure);
    KVCAP_RETURN_IF(b->tile_rows < 1 || b->tile_cols < 1 || b->rows % b->tile_rows != 0 ||
                        b->cols % b->tile_cols != 0,
                    KVCAP_ERR_GEOMETRY, "%s.tile: [%d, %d] does not divide the grid %dx%d", field,
                    b->tile_rows, b->tile_cols, b->rows, b->cols);
    return KVCAP_OK;
}

enum kvcap_status kvcap_bucket_check(const struct kvcap_bucket *b, const char *field)
{
    kvcap_quiet_push();
    enum kvcap_status st = bucket_rules(b, field);
    kvcap_quiet_pop();
    return st;
}

enum kvcap_status kvcap_geometry_check(const struct kvcap_model_geometry *g)
{
    kvcap_quiet_push();
    enum kvcap_status st = kvcap_geometry_validate(g);
    kvcap_quiet_pop();
    return st;
}

const char *kvcap_geometry_difference(const struct kvcap_model_geometry *a,
                                       const struct kvcap_model_geometry *b)
{
    if (a->n_layers != b->n_layers) return "model.layers";
    if (a->n_q_heads != b->n_q_heads) return "model.q_heads";
    if (a->n_kv_heads != b->n_kv_heads) return "model.kv_heads";
    if (a->head_dim != b->head_dim) return "model.head_dim";
    if (a->rope_type != b->rope_type) return "model.rope.type";
    if (a->rope_type != KVCAP_ROPE_NONE) {
        if (a->rope_pairing != b->rope_pairing) return "model.rope.pairing";
        if (a->rope_theta != b->rope_theta) return "model.rope.theta";
        if ((a->rope_dim ? a->rope_dim : a->head_dim) != (b->rope_dim ? b->rope_dim : b->head_dim))
            return "model.rope.dim";
        if (a->n_rope_sections != b->n_rope_sections ||
            memcmp(a->rope_sections, b->rope_sections, sizeof a->rope_sections) != 0)
            return "model.rope.sections";
    }
    return NULL;
}

size_t kvcap_bucket_token(const struct kvcap_bucket *b, int t, int p)
{
    if (b->structure == KVCAP_STRUCTURE_DENSE)
        return (size_t)p;
    int tiles_per_row = b->cols / b->tile_cols;
    int ti = t / tiles_per_row, tj = t % tiles_per_row;
    int a = p / b->tile_cols, c = p % b->tile_cols;
    return (size_t)(ti * b->tile_rows + a) * (size_t)b->cols + (size_t)(tj * b->tile_cols + c);
}
