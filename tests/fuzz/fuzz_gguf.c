/* fuzz_gguf.c — the GGUF v3 reader (engine/gguf.c) over hostile bytes, in memory: every key is
 * read through every typed getter, arrays element by element and converted, every tensor is
 * found again and dequantised, and what kvcap-eval builds from the file (engine/tokenizer.c,
 * engine/llama.c) loads or fails with a status. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz_common.h"
#include "engine/gguf.h"
#include "engine/llama.h"
#include "engine/tokenizer.h"

/* Bounds on the work per input: array elements read one by one, elements converted, and
 * tensor elements dequantised. */
#define ARRAY_ITEMS_MAX 64
#define ARRAY_CONVERT_MAX 4096
#define DEQUANT_MAX 65536

static void check_key(const struct kvgguf_file *f, size_t i)
{
    enum kvgguf_type type;
    const char *key = kvgguf_kv_key(f, i, &type);
    FUZZ_ASSERT(key != NULL, "key %zu missing", i);
    FUZZ_ASSERT(kvgguf_has(f, key), "key '%s' not found again", key);
    uint32_t u32;
    int64_t i64;
    float f32;
    int b;
    struct kvgguf_str s;
    enum kvcap_status st;
    /* Each getter either reads the value or names why not; none may misread the file. */
    kvcap_clear_error();
    fuzz_check_status(kvgguf_get_u32(f, key, &u32), "kvgguf_get_u32");
    kvcap_clear_error();
    fuzz_check_status(kvgguf_get_i64(f, key, &i64), "kvgguf_get_i64");
    kvcap_clear_error();
    fuzz_check_status(kvgguf_get_f32(f, key, &f32), "kvgguf_get_f32");
    kvcap_clear_error();
    fuzz_check_status(kvgguf_get_bool(f, key, &b), "kvgguf_get_bool");
    kvcap_clear_error();
    st = kvgguf_get_str(f, key, &s);
    fuzz_check_status(st, "kvgguf_get_str");
    volatile char sink = 0;
    for (uint64_t k = 0; st == KVCAP_OK && k < s.n; k++)
        sink ^= s.s[k];

    enum kvgguf_type elem;
    uint64_t n = 0;
    kvcap_clear_error();
    st = kvgguf_get_array(f, key, &elem, &n);
    fuzz_check_status(st, "kvgguf_get_array");
    if (st != KVCAP_OK)
        return;
    FUZZ_ASSERT(type == KVGGUF_ARRAY, "get_array succeeded on type %d", (int)type);
    for (uint64_t k = 0; k < n && k < ARRAY_ITEMS_MAX; k++) {
        kvcap_clear_error();
        st = kvgguf_array_str(f, key, k, &s);
        fuzz_check_status(st, "kvgguf_array_str");
        for (uint64_t c = 0; st == KVCAP_OK && c < s.n; c++)
            sink ^= s.s[c];
    }
    /* Past the end is refused, not read. */
    kvcap_clear_error();
    st = kvgguf_array_str(f, key, n, &s);
    fuzz_check_status(st, "kvgguf_array_str");
    FUZZ_ASSERT(st != KVCAP_OK, "'%s': element %llu of %llu read", key, (unsigned long long)n,
                (unsigned long long)n);
    if (n <= ARRAY_CONVERT_MAX) {
        static int32_t ints[ARRAY_CONVERT_MAX + 1];
        static float floats[ARRAY_CONVERT_MAX + 1];
        kvcap_clear_error();
        fuzz_check_status(kvgguf_array_i32(f, key, ints, n), "kvgguf_array_i32");
        kvcap_clear_error();
        fuzz_check_status(kvgguf_array_f32(f, key, floats, n), "kvgguf_array_f32");
    }
    (void)sink;
}

static void check_tensors(const struct kvgguf_file *f)
{
    static float out[DEQUANT_MAX];
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < kvgguf_tensor_count(f); i++) {
        const struct kvgguf_tensor *t = kvgguf_tensor_at(f, i);
        FUZZ_ASSERT(t && t->name, "tensor %zu missing", i);
        FUZZ_ASSERT(t->n_dims >= 1 && t->n_dims <= KVGGUF_MAX_DIMS, "'%s': %d dims", t->name,
                    t->n_dims);
        uint64_t elements = 1;
        for (int d = 0; d < KVGGUF_MAX_DIMS; d++) {
            FUZZ_ASSERT(t->ne[d] >= 1, "'%s': ne[%d] = %lld", t->name, d, (long long)t->ne[d]);
            elements *= (uint64_t)t->ne[d];
        }
        FUZZ_ASSERT(elements == t->n_elements, "'%s': %llu elements, ne says %llu", t->name,
                    (unsigned long long)t->n_elements, (unsigned long long)elements);
        /* Names may repeat only if the reader refuses that; the first one wins a lookup. */
        const struct kvgguf_tensor *found = kvgguf_tensor_find(f, t->name);
        FUZZ_ASSERT(found != NULL, "'%s' not found again", t->name);
        const uint8_t *bytes = t->data;
        for (uint64_t k = 0; k < t->nbytes; k++)
            sink ^= bytes[k];
        if (t->n_elements <= DEQUANT_MAX) {
            kvcap_clear_error();
            fuzz_check_status(kvgguf_dequantize(t, out), "kvgguf_dequantize");
        }
    }
    (void)sink;
}

/* What kvcap-eval reads from a GGUF file: the tokenizer (tokenizer.ggml.*), which then
 * encodes and decodes a little text, and the Llama model, which then runs a two-token
 * prefill. */
static void check_consumers(const struct kvgguf_file *f)
{
    static const char text[] = "Hello, world! 123 \xc3\xa9t\xc3\xa9 <s>";
    struct kvtok *tok = NULL;
    kvcap_clear_error();
    enum kvcap_status st = kvtok_create_gguf(f, &tok);
    fuzz_check_status(st, "kvtok_create_gguf");
    if (st == KVCAP_OK) {
        int32_t *ids = NULL;
        size_t n = 0;
        kvcap_clear_error();
        st = kvtok_encode(tok, text, sizeof text - 1, 1, &ids, &n);
        fuzz_check_status(st, "kvtok_encode");
        char piece[64];
        for (size_t i = 0; st == KVCAP_OK && i < n; i++) {
            FUZZ_ASSERT(ids[i] >= 0 && ids[i] < kvtok_n_tokens(tok), "token %d of %lld",
                        (int)ids[i], (long long)kvtok_n_tokens(tok));
            FUZZ_ASSERT(kvtok_decode_token(tok, ids[i], piece, sizeof piece) >= 0,
                        "token %d does not decode", (int)ids[i]);
        }
        free(ids);
        kvtok_free(tok);
    }

    struct kvllama_model *m = NULL;
    kvcap_clear_error();
    st = kvllama_load_gguf(f, &m);
    fuzz_check_status(st, "kvllama_load_gguf");
    if (st != KVCAP_OK)
        return;
    const struct kvllama_hparams *hp = kvllama_hparams(m);
    float *logits = malloc(sizeof(float) * 2 * (size_t)hp->n_vocab);
    FUZZ_ASSERT(logits != NULL, "out of memory");
    const int32_t ids[2] = {0, hp->n_vocab - 1};
    struct kvllama_prefill_out out = {.logits = logits, .n_logits = 2};
    kvcap_clear_error();
    fuzz_check_status(kvllama_prefill(m, ids, 2, &out), "kvllama_prefill");
    free(logits);
    kvllama_free(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvgguf_file *f = NULL;
    kvcap_clear_error();
    enum kvcap_status st = kvgguf_open_memory(data, size, "fuzz.gguf", &f);
    fuzz_check_status(st, "kvgguf_open_memory");
    if (st != KVCAP_OK) {
        FUZZ_ASSERT(f == NULL, "a failed open left a handle");
        return 0;
    }
    for (size_t i = 0; i < kvgguf_kv_count(f); i++)
        check_key(f, i);
    FUZZ_ASSERT(kvgguf_kv_key(f, kvgguf_kv_count(f), NULL) == NULL, "a key past the end");
    check_tensors(f);
    check_consumers(f);
    kvgguf_close(f);
    return 0;
}
