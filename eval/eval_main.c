/* eval_main.c — kvcap-eval: runs a real model (a Llama-family GGUF, SmolLM2-135M-Instruct by
 * default) through libkvcap on real text.
 *
 *   kvcap-eval record  tokenises documents, prefills fixed-length chunks and records their K/V
 *                      and queries through the runtime's record mode (a calibration dataset);
 *   kvcap-eval run     evaluates every policy × retention against `full` in one batched run:
 *                      greedy generation agreement, teacher-forced log-likelihood, attention
 *                      fidelity on recorded held-out queries, bytes held/read and decode time;
 *                      writes metrics.json, metrics.csv and report.html;
 *   kvcap-eval generate  one prompt of token ids through a cache, as JSON (generate.c).
 *
 * Text is cut into chunks laid out like a vision-language prompt: HEAD tokens kept in full (the
 * system text before an image, which holds the attention sinks), SPAN tokens handed to the
 * cache as one compressible span (kind vision, a 1 x SPAN grid, so every policy, KVCapsule
 * included, applies to it), then TAIL tokens kept in full (the question after the image, whose
 * queries VL-Cache scores with), then the continuation.
 *
 * Here: main and the dispatch. The phases: options.c (the command line), prompts.c (corpus,
 * model, prompts), record.c, run.c (the policies × retentions), fidelity.c (the decode phases),
 * task.c (the retrieval task) and metrics.c (metrics.json); eval.h is what they share. */
#include <string.h>

#include "cli/cli.h"
#include "eval/eval.h"
#include "eval/generate.h"

int main(int argc, char **argv)
{
    struct options o;
    cli_init("kvcap-eval", 0); /* first: usage errors name the tool */
    if (argc >= 2 && !strcmp(argv[1], "generate"))
        return kvcap_eval_generate(argc, argv);
    int rc = parse_options(argc, argv, &o);
    if (rc == 0)
        rc = check_outputs(&o);
    if (rc)
        return rc;
    return o.record ? cmd_record(&o) : cmd_run(&o, argc, argv);
}
