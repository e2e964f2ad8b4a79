/* fuzz_metrics.c — kvcap-report's reader of metrics.json (report/metrics.c) over hostile text:
 * any input either renders to HTML and a well-formed CSV or fails with a status naming the
 * field, without leaking, and never leaves a file behind on failure. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/fuzz/fuzz_common.h"
#include "report/report.h"

/* Every CSV record (RFC 4180: quoted fields may hold commas, quotes doubled, line breaks) has
 * as many fields as the header, whatever the strings of the JSON held. */
static void check_csv(const char *path)
{
    FILE *f = fopen(path, "rb");
    FUZZ_ASSERT(f != NULL, "cannot read %s", path);
    int fields = 1, header = -1, quoted = 0, at_start = 1, c, prev = 0;
    long record = 0;
    while ((c = fgetc(f)) != EOF) {
        if (quoted) {
            if (c == '"')
                quoted = 0; /* a doubled quote reopens at once, below */
        } else if (c == '"') {
            FUZZ_ASSERT(at_start || prev == '"', "record %ld: a quote inside a bare field",
                        record);
            quoted = 1;
        } else if (c == ',') {
            fields++;
        } else if (c == '\n') {
            if (header < 0)
                header = fields;
            FUZZ_ASSERT(fields == header, "record %ld: %d fields, the header has %d", record,
                        fields, header);
            fields = 1, record++;
        }
        at_start = !quoted && (c == ',' || c == '\n');
        prev = c;
    }
    fclose(f);
    FUZZ_ASSERT(!quoted, "an unterminated quoted field");
    FUZZ_ASSERT(prev == '\n' && record >= 2, "%ld records, last byte %d", record, prev);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char metrics[4400], html[4400], csv[4400];
    fuzz_write_file(metrics, sizeof metrics, "metrics.json", data, size);
    fuzz_path(html, sizeof html, "report.html");
    fuzz_path(csv, sizeof csv, "report.csv");
    unlink(html);
    unlink(csv);
    kvcap_clear_error();
    enum kvcap_status st = kvcap_report_write(metrics, html, csv);
    fuzz_check_status(st, "kvcap_report_write");
    if (st != KVCAP_OK)
        FUZZ_ASSERT(access(html, F_OK) != 0 && access(csv, F_OK) != 0,
                    "a failed report left an output behind");
    else {
        FUZZ_ASSERT(access(html, F_OK) == 0 && access(csv, F_OK) == 0, "an output is missing");
        check_csv(csv);
    }
    return 0;
}
