/* test_json.h — files and JSON documents for the tests that write and read metrics.json and
 * reports (include after <cmocka.h> and <cjson/cJSON.h>): a file's text, a JSON file parsed,
 * a JSON document written; each fails the test when it cannot. */
#ifndef KVCAP_TEST_JSON_H
#define KVCAP_TEST_JSON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The whole file as a string (free it), or NULL when it cannot be opened. */
static inline char *test_slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0, got;
    char *p = malloc(cap);
    assert_non_null(p);
    while ((got = fread(p + n, 1, cap - n - 1, f)) > 0) {
        n += got;
        if (n + 1 == cap) {
            cap *= 2;
            p = realloc(p, cap);
            assert_non_null(p);
        }
    }
    fclose(f);
    p[n] = '\0';
    return p;
}

/* A JSON file parsed (cJSON_Delete it). */
static inline cJSON *test_load_json(const char *path)
{
    char *text = test_slurp(path);
    assert_non_null(text);
    cJSON *doc = cJSON_Parse(text);
    free(text);
    assert_non_null(doc);
    return doc;
}

/* doc written to path, pretty-printed. */
static inline void test_write_json(const char *path, const cJSON *doc)
{
    char *text = cJSON_Print(doc);
    assert_non_null(text);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    assert_int_equal(fclose(f), 0);
    cJSON_free(text);
}

#endif
