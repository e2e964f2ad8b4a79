/* main.c — kvcap-convert: inspects and validates kvcap files (datasets, calibration states,
 * artifacts). */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "inspect.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvcap-convert --inspect FILE [FILE...] [--all-tensors]\n"
            "\n"
            "Inspect kvcap files: datasets recorded from a model, calibration states (.kvcs)\n"
            "and compressor artifacts (.kvcap). Every file is validated against the kvcap\n"
            "schema (formats/SPEC.md); the exit status is 0 only if all files are valid.\n"
            "\n"
            "options:\n"
            "  -i, --inspect      print kind, format version, model geometry, buckets,\n"
            "                     schedule and tensors of each FILE\n"
            "  -a, --all-tensors  list every tensor (default: the first 24)\n"
            "  -v, --verbose      also print informational library messages\n"
            "  -V, --version      print the kvcap version\n"
            "  -h, --help         show this help\n");
}

int main(int argc, char **argv)
{
    static const struct option options[] = {
        {"inspect", no_argument, NULL, 'i'},  {"all-tensors", no_argument, NULL, 'a'},
        {"verbose", no_argument, NULL, 'v'},  {"version", no_argument, NULL, 'V'},
        {"help", no_argument, NULL, 'h'},     {NULL, 0, NULL, 0}};
    int inspect = 0, all_tensors = 0, verbose = 0, c;
    cli_init("kvcap-convert", 0);
    while ((c = getopt_long(argc, argv, "iavVh", options, NULL)) != -1) {
        switch (c) {
        case 'i': inspect = 1; break;
        case 'a': all_tensors = 1; break;
        case 'v': verbose = 1; break;
        case 'V': printf("kvcap-convert %s\n", kvcap_version()); return 0;
        case 'h': usage(stdout); return 0;
        default: return cli_usage_error("unknown option");
        }
    }
    cli_init("kvcap-convert", verbose);
    if (!inspect)
        return cli_usage_error("nothing to do: give --inspect FILE");
    if (optind >= argc)
        return cli_usage_error("--inspect needs at least one FILE");
    int rc = 0;
    for (int i = optind; i < argc; i++) {
        if (i > optind)
            printf("\n");
        int r = kvcap_cli_inspect(argv[i], all_tensors);
        rc = rc ? rc : r;
    }
    return rc;
}
