/* generate.h — `kvcap-eval generate` (generate.c): the reference engine on one prompt of token
 * ids through a libkvcap cache, greedy tokens and a teacher-forced continuation as JSON. */
#ifndef KVCAP_EVAL_GENERATE_H
#define KVCAP_EVAL_GENERATE_H

/* argv[1] is "generate"; returns the process exit status (0, 1 on failure, 2 on bad usage). */
int kvcap_eval_generate(int argc, char **argv);

#endif
