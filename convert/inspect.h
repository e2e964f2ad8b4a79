/* inspect.h — the --inspect mode of kvcap-convert. */
#ifndef KVCAP_INSPECT_H
#define KVCAP_INSPECT_H

/* Prints a summary of `path` to stdout and validates it; returns the process exit code
 * (0 valid, 1 invalid or unreadable, with the reason on stderr). */
int kvcap_cli_inspect(const char *path, int all_tensors);

#endif
