/* test_status.h — status assertions the file-reader tests share: a call succeeded (else the
 * library's message is shown), or failed with the expected status and a message naming what it
 * should. Include after <cmocka.h>. */
#ifndef KVCAP_TEST_STATUS_H
#define KVCAP_TEST_STATUS_H

#include <string.h>

#include "kvcap.h"

static inline void expect_ok(enum kvcap_status st)
{
    if (st != KVCAP_OK)
        fail_msg("status %d (%s): %s", (int)st, kvcap_status_str(st), kvcap_last_error());
}

/* Asserts a failure status and that the message contains each of the given substrings. */
static inline void expect_error(enum kvcap_status got, enum kvcap_status want, const char *sub1,
                                const char *sub2)
{
    const char *msg = kvcap_last_error();
    if (got != want)
        fail_msg("status %d (%s), expected %d; message: %s", (int)got, kvcap_status_str(got),
                 (int)want, msg);
    if (sub1 && !strstr(msg, sub1))
        fail_msg("message '%s' lacks '%s'", msg, sub1);
    if (sub2 && !strstr(msg, sub2))
        fail_msg("message '%s' lacks '%s'", msg, sub2);
}

#endif
