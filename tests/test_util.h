/* test_util.h — scratch folders for the test programs: made under $TMPDIR (ctest points it at
 * the build tree), removed with their files when a test is done. */
#ifndef KVCAP_TEST_UTIL_H
#define KVCAP_TEST_UTIL_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* A new empty folder TMPDIR/TAG-PID-XXXXXX in out[cap]; returns 0 if it could not be made. */
static inline int test_tmpdir(char *out, size_t cap, const char *tag)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(out, cap, "%s/%s-%d-XXXXXX", tmp && *tmp ? tmp : "/tmp", tag, (int)getpid());
    return mkdtemp(out) != NULL;
}

/* Removes a folder of plain files (hidden entries are not created by the tests). */
static inline void test_rm_tree(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[4096 + 256 + 2];
    while (d && (e = readdir(d)) != NULL)
        if (e->d_name[0] != '.') {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
    if (d)
        closedir(d);
    rmdir(dir);
}

#endif
