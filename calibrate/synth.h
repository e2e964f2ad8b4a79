/* synth.h — structured synthetic K/V data with known answers (kvcap-synth): every later test
 * and benchmark can check what calibration and compression recover against the truth. */
#ifndef KVCAP_SYNTH_H
#define KVCAP_SYNTH_H

#include <stdint.h>

#include "kvcap.h"

#define KVCAP_SYNTH_MAX_GRIDS 16

/* Per span, layer and KV head, with A_k / A_v the first rank_k / rank_v low-frequency 2-D DCT
 * basis functions of the grid (shared by all spans of a grid; A_v skips the constant one,
 * which the per-span mean removes):
 *   K' = A_k B_k + outliers + noise          (offset-free keys, exact rank rank_k without noise)
 *   K  = R(p0) K'                            (what the engine caches)
 *   V  = A_v B_v + 1 mu^T + outliers + noise (exact rank rank_v after centering)
 * B rows have decaying scales so the spectrum is realistic. Queries are q = R(p0) q' with q'
 * drawn from the span of B_k, scaled so scores q.K/sqrt(d) have standard deviation
 * `score_scale` (peaked, not flat, attention). */
struct kvcap_synth_params {
    int n_spans;        /* default 16 */
    int n_grids;        /* grids cycled over the spans; 0 means 16x16 */
    int grid_rows[KVCAP_SYNTH_MAX_GRIDS], grid_cols[KVCAP_SYNTH_MAX_GRIDS];
    int rank_k;         /* default 8 */
    int rank_v;         /* default 8 */
    double noise;       /* noise std relative to the signal's, default 0.01 */
    int outliers;       /* high-norm tokens per span (same positions for K and V), default 2 */
    double outlier_scale; /* outlier norm relative to a typical token, default 6 */
    int post_queries;   /* post-vision queries per span (q_post), default 8; 0 for none */
    int decode_queries; /* decode queries per span (q_dec), default 8; 0 for none */
    double score_scale; /* default 2 */
    int p0_max;         /* p0 uniform in [0, p0_max], default 4096 */
    uint64_t seed;      /* default 1 */
    enum kvcap_dtype dtype;  /* storage: F32, F16 (default), BF16 */
    uint64_t shard_bytes;    /* default 256 MiB */
};

void kvcap_synth_default_params(struct kvcap_synth_params *p);

/* Called after each span; return nonzero to stop early (status KVCAP_ERR_STATE). */
typedef int (*kvcap_progress_fn)(int64_t done, int64_t total, void *user);

/* Writes the dataset shards into `dir` (SPEC §4.1) for model geometry `g`, creating `dir` if
 * needed. On failure the shards this call wrote are removed again (shards that were in `dir`
 * before stay); folders it created are left to the caller, which knows which existed. */
enum kvcap_status kvcap_synth(const struct kvcap_model_geometry *g,
                              const struct kvcap_synth_params *p, const char *dir,
                              kvcap_progress_fn progress, void *user);

/* The same generator for one span, one layer and one KV head into caller memory (tests use
 * it to know the truth): k_offset_free, k, v are [n][head_dim]; q_post/q_dec are
 * [G][count][head_dim] (G = q_heads / kv_heads) and may be NULL. */
enum kvcap_status kvcap_synth_head(const struct kvcap_model_geometry *g,
                                   const struct kvcap_synth_params *p, int64_t span, int rows,
                                   int cols, int p0, int layer, int kv_head, float *k_offset_free,
                                   float *k, float *v, float *q_post, float *q_dec);

/* The p0 and grid the generator picks for span number `span`. */
void kvcap_synth_span_layout(const struct kvcap_synth_params *p, int64_t span, int *rows,
                             int *cols, int *p0);

#endif
