/* report.h — turns kvcap-eval's metrics.json into a CSV (one row per run) and a self-contained
 * HTML report (inline CSS and SVG, no scripts or external resources) a person can read at a
 * glance: a ranking of the policies at each memory budget (task accuracy, then KL, at equal
 * realised retention), the headline table, fidelity vs realised retention per policy, task
 * accuracy by depth, a per-layer fidelity heatmap, KVCapsule's retained-token masks, sample
 * continuations with where each leaves full's, and bytes/time bars.
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
 *   "track": {"kind": "text" | "image",   optional (text when absent): what the span holds;
 *             image: "features": str, "rows": int, "cols": int (the grid), "photos": int,
 *             "heldout_photos": int, "calibration_crops": int, "heldout_crops": int (held
 *             out: development and test, never calibrated on), "photos_split":
 *             "calibration" | "development" | "test" (the prompts' photos; "heldout" in older
 *             files: development), "split_photos": int, "split_crops": int (that split's),
 *             "splits": {"calibration" | "development" | "test": {"photos": int, "crops":
 *             int}}, "splits_recorded": bool (false: an older feature file, split by photo
 *             index), "projector": str},
 *   "setup": {"head_tokens": int, "span_tokens": int, "tail_tokens": int,
 *             "images": int, "gap_tokens": int,  optional (1 and none): spans per prompt, each
 *                                           span_tokens, and the text tokens between two
 *             "generate_tokens": int,      greedy tokens generated per prompt
 *             "continuation_tokens": int,  teacher-forced held-out tokens scored per prompt
 *             "fidelity_steps": int,       decode steps replayed for the attention fidelity
 *             "prompts": int, "threads": int, "storage": str, "read_bandwidth_gbs": num},
 *   "prompt_ids": [{"doc": str, "ids": [int...]} ...],  optional: per prompt, the token ids of
 *                             its head, span, tail and teacher-forced continuation, so that
 *                             another engine replays them (scripts/kvpress_reference.py; the
 *                             image track also writes span_embeddings.safetensors beside the
 *                             file, tensor "span_embeddings" [prompts][images x span][n_embd] f32)
 *   "prompts_sha256": str,    optional: 64 lowercase hex digits, the SHA-256 of what the engine
 *                             was fed, prompt after prompt in prompt_ids' order: that prompt's
 *                             ids as int32 little-endian, then (image track) its span's
 *                             embeddings as float32 little-endian, row after row
 *   "task": {                 optional: the retrieval task asked inside the span
 *       "name": "key-value retrieval",
 *       "line": str,          an example line of the span ("The code of the red door is 4821.")
 *       "question": str,      how the tail asks for one line
 *       "haystack": str,      optional: what fills the span
 *       "queries": int,       questions asked (over all prompts)
 *       "keys": int,          optional (1 when absent): names in the span, each its own line,
 *                             one asked (RULER's multi-key)
 *       "values": int,        optional (1 when absent): lines (codes) of the asked name, all
 *                             asked for; an answer is right when it holds every one (RULER's
 *                             multi-value)
 *       "answer_tokens": int, greedy tokens the answer is read from
 *       "depths": [num...]    per depth bin (8): mean depth 0..1 of the asked line in the span
 *   },
 *   "runs": [ {
 *       "id": "kvcapsule-tiled@0.40",  unique
 *       "policy": "full" | "streaming" | "kvcapsule" | "flashcache" | "vlcache" | "freekv"
 *                 | "composition",
 *       "label": "kvcapsule tiled",  one label per curve: runs sharing a label form a curve
 *                                (e.g. "flashcache", "flashcache+protect", "vlcache+protect",
 *                                "kvcapsule dense", "kvcapsule tiled", "kvcapsule
 *                                tiled-pyramid", "kvcapsule tiled-trained", "composition")
 *       "extension": bool,       true: kvcap's own variant, not a paper's method
 *                                (flashcache+protect, vlcache+protect, kvcapsule tiled /
 *                                tiled-pyramid / tiled-trained, composition); false: the papers'
 *                                methods (streaming, flashcache, vlcache, freekv, kvcapsule
 *                                dense) and full
 *       "retention": num,        the target: fraction of the compressible span kept (1 for
 *                                full); runs sharing it are at equal realised retention
 *       "nominal": num,          the policy's own parameter that reached the target (e.g.
 *                                VL-Cache's alpha, searched because its Algorithm 1 under-fills)
 *       "realised_retention": num | null,  span bytes held / full's span bytes; for eviction the
 *                                share of span tokens kept; for FreeKV the share of span tokens
 *                                attended per step
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
 *       "kl": num,               mean KL divergence (nats) of each teacher-forced step's
 *                                next-token distribution from full's (0 for full)
 *       "per_prompt": {          optional: the same per prompt, in prompt_ids' order
 *           "nll_delta": [num...], "kl": [num...]   setup.prompts entries each
 *       },
 *       "task": {                optional: the retrieval task's answers
 *           "accuracy": num,           0..1, answers equal to the true value (with task.values
 *                                      above 1: holding every true value, in any order)
 *           "agreement_full": num,     0..1, answers equal to full's
 *           "accuracy_by_depth": [num | null...]  per depth bin (as task.depths)
 *       },
 *       "attn_cosine": [num...],  per layer: mean cosine of attention outputs vs full on
 *                                 replayed decode steps (full's own queries and K/V)
 *       "attn_rel_err": [num...], per layer: mean relative L2 error of the same
 *       "bytes_held": num, "bytes_held_full": num,      all layers, per sequence, after prefill
 *       "bytes_held_span": num,  the part of bytes_held that holds the compressible span
 *       "bytes_read_per_step": num, "bytes_read_per_step_full": num,
 *       "step_ms": num, "step_ms_full": num,            decode attention per step (all layers)
 *       "freekv": {              optional, FreeKV runs only; shares of (step, KV head) pairs
 *           "head_steps": num,         the pairs counted
 *           "corrected": num | null,   whose speculative selection was corrected
 *           "reselected": num | null,  re-selected synchronously
 *           "hidden": num | null,      served by a fully hidden speculative selection
 *           "pages_recalled_per_step": num | null
 *       },
 *       "sample": str            optional (or null): the first ~64 generated tokens of prompt 0
 *                                as UTF-8 text (may hold newlines)
 *   } ... ],
 *   "masks": [ {    KVCapsule key masks (token indices kept) of one bucket
 *       "bucket": "1x256 dense", "n_tokens": int, "heads": int,
 *       "kept": [[[int...] per head] per layer],
 *       "rows": int, "cols": int, "thumb": str   optional, together: the image's grid
 *                               (rows * cols == n_tokens) and a "data:image/bmp;base64,..." of
 *                               at most 1 MiB the mask is drawn over (binned to at most 64 cells
 *                               a side)
 *   } ... ],                    any number; the report draws the first 16
 *   "goals": [ {"text": str, "met": bool} ... ]   optional
 * }
 * "extension", "nominal", "realised_retention" (possibly null) and "kl" are required in every
 * run; "task" and "freekv" may be absent.
 *
 * kvpress.json beside metrics.json (optional; scripts/kvpress-reference.sh writes it):
 * {"source": "kvpress", "kvpress_version": str, "transformers_version": str,
 *  "metrics": str,            the metrics file it read (informative: folders move)
 *  "prompts": int, "layout": {"head": int, "span": int, "tail": int, "continuation": int},
 *  "track": "text" | "image", "prompts_sha256": str, "retentions": [num...], "full_nll": num,
 *                             what the script did itself: the prompts it fed transformers hashed
 *                             as above, the retentions it ran, the full cache's mean NLL per
 *                             token (as the full run's "nll")
 *  "rows": [{"press": str, "retention": num, "realised_retention": num, "dnll": num, "kl": num,
 *            "next_token_agreement": num, "per_prompt": {"dnll": [num...], "kl": [num...]}}...]}
 * Its rows are shown only when it was measured on this run: the same prompts and layout, track
 * and prompts_sha256, every retention one this run evaluated, full_nll within 0.005 nats/token
 * of the full run's nll (the two engines' arithmetic differs). Otherwise, and when it lacks one
 * of these fields (an older script), the page names the field and both values instead; a
 * field of the wrong type is an error, as in the metrics.
 */
#ifndef KVCAP_REPORT_H
#define KVCAP_REPORT_H

#include "kvcap.h"

/* Reads `metrics_path` and writes `html_path` and `csv_path` (either may be NULL to skip), each
 * atomically (temporary file + rename: nothing half-written under the final name), and the two
 * together: both temporaries are written and synced before either is renamed, and SIGINT,
 * SIGTERM, SIGHUP and SIGQUIT are blocked in the calling thread while the pair is written and
 * renamed (the caller's mask is restored after), so such a signal leaves both outputs old or
 * both new. SIGKILL, a crash or a power cut between the two renames can still leave a new CSV
 * beside an old HTML, and so can a failure of the second rename (its error says so). Errors
 * name the file and the JSON field at fault (KVCAP_ERR_FORMAT) or the I/O call (KVCAP_ERR_IO).
 * The work is linear in the size of the metrics file: masks are held as the file lists them, a
 * mask panel is binned to a bounded grid, and at most 16 panels are drawn (the page says how
 * many were left out; every mask is still validated). */
enum kvcap_status kvcap_report_write(const char *metrics_path, const char *html_path,
                                     const char *csv_path);

/* kvcap_report_write of metrics_paths[0] whose report also shows, side by side, every run of it
 * beside the run of the same id in each of the other n_metrics - 1 (up to 7) files: other
 * tracks (text and image spans) of the same evaluation. The CSV is the first file's. */
enum kvcap_status kvcap_report_write_tracks(const char *const *metrics_paths, int n_metrics,
                                            const char *html_path, const char *csv_path);

/* Paired over n prompts: *mean = the mean of f(a[i]) - f(b[i]), f(x) = |x| when `absolute`
 * else x, and *half = the half-width of its 95 % Student-t interval; both NaN when n < 2. The
 * report's comparison of kvcap's best row with an outside reference's on the same prompts. */
void kvcap_report_paired(const double *a, const double *b, int n, int absolute, double *mean,
                         double *half);

#endif /* KVCAP_REPORT_H */
