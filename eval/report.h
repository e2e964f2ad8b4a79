/* report.h — turns kvcap-eval's metrics.json into a CSV (one row per run) and a self-contained
 * HTML report (inline CSS and SVG, no scripts or external resources) a person can read at a
 * glance: the headline table, fidelity vs retention per policy, a per-layer fidelity heatmap,
 * KVCapsule's retained-token masks, sample continuations with where each leaves full's, and
 * bytes/time bars.
 *
 * metrics.json (format 1), written by kvcap-eval; every number is a JSON number, null when a
 * measurement does not apply (e.g. no engine run):
 * {
 *   "format": 1,
 *   "title": "kvcap evaluation: SmolLM2-135M-Instruct",
 *   "command": "build/kvcap-eval --out eval-out ...",   reproduces every number
 *   "created": "2026-11-21T10:00:00Z",
 *   "notes": [str...],        optional: caveats, shown as a list under the headline table
 *   "prompt_sample": str,     optional (or null): the last ~200 characters of prompt 0's text,
 *                             which the runs' samples continue
 *   "model": {"name": str, "file": str, "layers": int, "q_heads": int, "kv_heads": int,
 *             "head_dim": int},
 *   "corpus": {"source": str, "calibration": [str...], "heldout": [str...],
 *              "calibration_tokens": int, "heldout_tokens": int},
 *   "setup": {"span_tokens": int, "tail_tokens": int, "generate_tokens": int,
 *             "continuation_tokens": int, "prompts": int, "threads": int, "storage": str,
 *             "read_bandwidth_gbs": num},
 *   "runs": [ {
 *       "id": "kvcapsule-tiled@0.40",  unique
 *       "policy": "full" | "streaming" | "kvcapsule" | "flashcache" | "vlcache" | "freekv"
 *                 | "composition",
 *       "label": "KVCapsule (tiled)",   one label per curve: runs sharing a label form a curve
 *       "retention": num,        nominal fraction of the compressible span kept (1 for full)
 *       "compression": num,      bytes_held_full / bytes_held of the compressible span
 *       "token_agreement": num,  0..1, greedy tokens equal to full's, over all prompts (it
 *                                cascades: after one differing token the continuations part)
 *       "next_token_agreement": num,  optional, 0..1: teacher-forced on the held-out
 *                                continuations, the share of positions where the run's argmax
 *                                next token equals full's (a per-step measure, no cascade)
 *       "first_divergence": [int...],  per prompt: index of the first differing token, or
 *                                      generate_tokens when none differs
 *       "nll": num, "nll_full": num, "nll_delta": num,  mean per-token negative log-likelihood
 *                                      (nats) of the held-out continuations, teacher-forced
 *       "attn_cosine": [num...],  per layer: mean cosine of attention outputs vs full on
 *                                 held-out recorded queries
 *       "attn_rel_err": [num...], per layer: mean relative L2 error of the same
 *       "bytes_held": num, "bytes_held_full": num,      all layers, per sequence, after prefill
 *       "bytes_read_per_step": num, "bytes_read_per_step_full": num,
 *       "step_ms": num, "step_ms_full": num,            decode attention per step (all layers)
 *       "sample": str            optional (or null): the first ~64 generated tokens of prompt 0
 *                                as UTF-8 text (may hold newlines)
 *   } ... ],
 *   "masks": [ {    KVCapsule key masks (token indices kept) of one bucket
 *       "bucket": "1x256 dense", "n_tokens": int, "heads": int,
 *       "kept": [[[int...] per head] per layer]
 *   } ... ],
 *   "goals": [ {"text": str, "met": bool} ... ]   optional
 * }
 */
#ifndef KVCAP_REPORT_H
#define KVCAP_REPORT_H

#include "kvcap.h"

/* Reads `metrics_path` and writes `html_path` and `csv_path` (either may be NULL to skip), each
 * atomically (temporary file + rename: nothing half-written under the final name). Errors name
 * the file and the JSON field at fault (KVCAP_ERR_FORMAT) or the I/O call (KVCAP_ERR_IO). */
enum kvcap_status kvcap_report_write(const char *metrics_path, const char *html_path,
                                     const char *csv_path);

#endif /* KVCAP_REPORT_H */
