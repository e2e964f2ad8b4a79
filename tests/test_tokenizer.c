/* test_tokenizer.c — the byte-level BPE tokenizer (engine/tokenizer.h): a hand-made vocabulary of
 * a few tokens and merges for each rule (rank order, leftmost first, byte fallback, digit split,
 * special tokens, invalid UTF-8, decoding, named errors), GGUF images built in memory for
 * kvtok_create_gguf, and the real SmolLM2 vocabulary against the ids llama.cpp gives
 * (tests/data/smollm2_reference.json, made by engine/reference/make_reference.py), with the
 * encode speed on ~1 MB of English text printed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "engine/tokenizer.h"
#include "tests/test_status.h"

/* ---- Helpers ---------------------------------------------------------------------------- */

static void print_ids(const char *what, const int32_t *ids, size_t n)
{
    print_message("%s (%zu):", what, n);
    for (size_t i = 0; i < n && i < 64; i++)
        print_message(" %d", ids[i]);
    print_message("%s\n", n > 64 ? " ..." : "");
}

/* Encodes `len` bytes of text and compares with the expected ids (n_want of them). */
static void expect_ids_n(const struct kvtok *t, const char *text, size_t len, int special,
                         const int32_t *want, size_t n_want)
{
    int32_t *ids;
    size_t n;
    expect_ok(kvtok_encode(t, text, len, special, &ids, &n));
    assert_non_null(ids);
    if (n != n_want || (n && memcmp(ids, want, n * sizeof *ids) != 0)) {
        print_ids("got ", ids, n);
        print_ids("want", want, n_want);
        fail_msg("ids differ for '%.*s' (parse_special=%d)", (int)len, text, special);
    }
    free(ids);
}

#define EXPECT_IDS(t, text, special, ...)                                                  \
    do {                                                                                   \
        static const int32_t want_[] = {__VA_ARGS__};                                      \
        expect_ids_n((t), (text), strlen(text), (special), want_,                          \
                     sizeof want_ / sizeof want_[0]);                                      \
    } while (0)

/* Concatenated decoding of ids, NUL-terminated; *len gets its length. */
static char *decode_all(const struct kvtok *t, const int32_t *ids, size_t n, size_t *len)
{
    size_t cap = 64, used = 0;
    char *out = malloc(cap);
    assert_non_null(out);
    for (size_t i = 0; i < n; i++) {
        long l = kvtok_decode_token(t, ids[i], NULL, 0);
        assert_true(l >= 0);
        while (used + (size_t)l + 1 > cap) {
            cap *= 2;
            out = realloc(out, cap);
            assert_non_null(out);
        }
        assert_int_equal(kvtok_decode_token(t, ids[i], out + used, cap - used), l);
        used += (size_t)l;
    }
    out[used] = '\0';
    *len = used;
    return out;
}

/* ---- A hand-made vocabulary ------------------------------------------------------------- */

/* Token strings are in GPT-2's byte alphabet: U+0120 'Ġ' is a space, U+010A 'Ċ' a newline,
 * U+0109 'ĉ' a tab, U+0122 'Ģ' the byte 0x80; 'Ã' and '©' stand for the bytes of "é". */
#define G_SP "\xc4\xa0"
static const char *const tiny_tokens[] = {
    "<|end|>", "<e>", "<e>>",                                   /* 0-2: special */
    "a", "b", "c", "d", "1", "2", "3",                          /* 3-9 */
    G_SP, "\xc4\x8a", "\xc4\x89", "<", "|", ">", "e", "n",      /* 10-17 */
    "\xc3\x83", "\xc2\xa9", "\xc4\xa2",                         /* 18-20: Ã © Ģ */
    "ab", "bc", "aa", G_SP "a", "12", G_SP G_SP,                /* 21-26: merge results */
};
enum { T_END, T_E, T_EGT, T_A, T_B, T_C, T_D, T_1, T_2, T_3, T_SP, T_NL, T_TAB, T_LT, T_BAR,
       T_GT, T_LE, T_LN, T_C3, T_A9, T_80, T_AB, T_BC, T_AA, T_SPA, T_12, T_SPSP, N_TINY };
static const int32_t tiny_types[N_TINY] = {KVTOK_CONTROL, KVTOK_USER_DEFINED, KVTOK_CONTROL,
                                           1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                           1, 1, 1, 1, 1, 1, 1, 1};
/* Rank = index. "c d" makes "cd", which is not a token. */
static const char *const tiny_merges[] = {"b c", "a b", "a a", G_SP " a", "1 2", G_SP " " G_SP,
                                          "c d"};
#define N_TINY_MERGES 7

struct tiny {
    struct kvgguf_str tokens[N_TINY];
    int32_t types[N_TINY];
    struct kvgguf_str merges[N_TINY_MERGES + 1];
    struct kvtok_vocab v;
};

static struct kvgguf_str str_of(const char *s)
{
    return (struct kvgguf_str){s, strlen(s)};
}

static void tiny_init(struct tiny *m, enum kvtok_pre pre)
{
    assert_int_equal(sizeof tiny_tokens / sizeof tiny_tokens[0], N_TINY);
    for (int i = 0; i < N_TINY; i++) {
        m->tokens[i] = str_of(tiny_tokens[i]);
        m->types[i] = tiny_types[i];
    }
    for (int i = 0; i < N_TINY_MERGES; i++)
        m->merges[i] = str_of(tiny_merges[i]);
    m->v = (struct kvtok_vocab){N_TINY, m->tokens, m->types, N_TINY_MERGES, m->merges, pre,
                                T_END, T_END};
}

static struct kvtok *tiny_create(enum kvtok_pre pre)
{
    struct tiny m;
    tiny_init(&m, pre);
    struct kvtok *t = NULL;
    expect_ok(kvtok_create(&m.v, &t));
    assert_non_null(t);
    return t;
}

static void test_metadata(void **state)
{
    (void)state;
    struct kvtok *t = tiny_create(KVTOK_PRE_GPT2);
    assert_int_equal(kvtok_n_tokens(t), N_TINY);
    assert_int_equal(kvtok_bos(t), T_END);
    assert_int_equal(kvtok_eos(t), T_END);
    kvtok_free(t);
    kvtok_free(NULL);
}

static void test_merge_rank_order(void **state)
{
    (void)state;
    struct kvtok *t = tiny_create(KVTOK_PRE_GPT2);
    EXPECT_IDS(t, "ab", 1, T_AB);
    /* "b c" (rank 0) wins over "a b" (rank 1) although "a b" is further left. */
    EXPECT_IDS(t, "abc", 1, T_A, T_BC);
    EXPECT_IDS(t, "abab", 1, T_AB, T_AB);
    EXPECT_IDS(t, " a", 1, T_SPA);
    EXPECT_IDS(t, "a a", 1, T_A, T_SPA);
    kvtok_free(t);
}

static void test_leftmost_equal_rank(void **state)
{
    (void)state;
    struct kvtok *t = tiny_create(KVTOK_PRE_GPT2);
    EXPECT_IDS(t, "aaa", 1, T_AA, T_A);
    EXPECT_IDS(t, "aaaaa", 1, T_AA, T_AA, T_A);
    /* A run of spaces at the end of the text is one pre-token: 2k+1 spaces pair up from the
     * left. Long enough to exercise the merge queue and the regex on a long subject. */
    size_t n = 200001;
    char *sp = malloc(n + 2);
    assert_non_null(sp);
    memset(sp, ' ', n);
    int32_t *want = malloc((n / 2 + 2) * sizeof *want);
    assert_non_null(want);
    for (size_t i = 0; i < n / 2; i++)
        want[i] = T_SPSP;
    want[n / 2] = T_SP;
    expect_ids_n(t, sp, n, 1, want, n / 2 + 1);
    /* Followed by a word, the run leaves its last space to the word: 200000 spaces, " a". */
    sp[n] = 'a';
    want[n / 2] = T_SPA;
    expect_ids_n(t, sp, n + 1, 1, want, n / 2 + 1);
    free(want);
    free(sp);
    kvtok_free(t);
}

static void test_fallback_to_bytes(void **state)
{
    (void)state;
    struct kvtok *t = tiny_create(KVTOK_PRE_GPT2);
    /* "c d" merges into "cd", which is no token: its bytes' tokens stand in. */
    EXPECT_IDS(t, "cd", 1, T_C, T_D);
    EXPECT_IDS(t, "cdd", 1, T_C, T_D, T_D);
    EXPECT_IDS(t, "bcd", 1, T_BC, T_D);
    /* A byte whose character is no token at all is dropped, as in llama.cpp: 'x'. */
    EXPECT_IDS(t, "axb", 1, T_A, T_B);
    kvtok_free(t);
}

static void test_digits(void **state)
{
    (void)state;
    struct kvtok *s = tiny_create(KVTOK_PRE_SMOLLM);
    struct kvtok *g = tiny_create(KVTOK_PRE_GPT2);
    /* smollm: every digit alone, even where a merge would join them. */
    EXPECT_IDS(s, "a123", 1, T_A, T_1, T_2, T_3);
    EXPECT_IDS(s, "12", 1, T_1, T_2);
    EXPECT_IDS(s, " 12", 1, T_SP, T_1, T_2);
    EXPECT_IDS(s, "1 a", 1, T_1, T_SPA);
    /* gpt2: " ?\p{N}+" keeps them together and "1 2" merges. */
    EXPECT_IDS(g, "a123", 1, T_A, T_12, T_3);
    EXPECT_IDS(g, " 12", 1, T_SP, T_12);
    kvtok_free(s);
    kvtok_free(g);
}

static void test_whitespace(void **state)
{
    (void)state;
    struct kvtok *t = tiny_create(KVTOK_PRE_GPT2);
    EXPECT_IDS(t, "a  a", 1, T_A, T_SP, T_SPA);
    EXPECT_IDS(t, "a   ", 1, T_A, T_SPSP, T_SP);
    EXPECT_IDS(t, "\n\na", 1, T_NL, T_NL, T_A);
    EXPECT_IDS(t, "a\t a", 1, T_A, T_TAB, T_SPA);
    EXPECT_IDS(t, "  \n", 1, T_SPSP, T_NL);
    kvtok_free(t);
}

static void test_special_tokens(void **state)
{
    (void)state;
    struct kvtok *t = tiny_create(KVTOK_PRE_GPT2);
    EXPECT_IDS(t, "ab<|end|>ab", 1, T_AB, T_END, T_AB);
    EXPECT_IDS(t, "<|end|><|end|>", 1, T_END, T_END);
    /* Without parse_special a CONTROL token is text: "<|" "end" "|>" pre-tokens. */
    EXPECT_IDS(t, "ab<|end|>ab", 0, T_AB, T_LT, T_BAR, T_LE, T_LN, T_D, T_BAR, T_GT, T_AB);
    /* Longest first: "<e>>" (CONTROL) before "<e>" (USER_DEFINED). */
    EXPECT_IDS(t, "<e>>", 1, T_EGT);
    EXPECT_IDS(t, "<e><e>>a", 1, T_E, T_EGT, T_A);
    /* USER_DEFINED tokens are split out even without parse_special (llama.cpp, HF). */
    EXPECT_IDS(t, "<e>>", 0, T_E, T_GT);
    EXPECT_IDS(t, "a<e>b", 0, T_A, T_E, T_B);
    kvtok_free(t);
}

static void test_invalid_utf8(void **state)
{
    (void)state;
    struct kvtok *t = tiny_create(KVTOK_PRE_SMOLLM);
    EXPECT_IDS(t, "a\x80" "b", 1, T_A, T_80, T_B);
    EXPECT_IDS(t, "\xc3", 1, T_C3);                  /* cut-off sequence */
    EXPECT_IDS(t, "\xc3" "a", 1, T_C3, T_A);         /* lead byte without continuation */
    EXPECT_IDS(t, "\xc3\xa9", 1, T_C3, T_A9);        /* valid "é": a letter, two bytes */
    EXPECT_IDS(t, "1\x80\x80 a", 1, T_1, T_80, T_80, T_SPA);
    EXPECT_IDS(t, "\xc0\x80", 1, T_80);              /* overlong: 0xC0 has no token */
    expect_ids_n(t, "\xff", 1, 1, NULL, 0);         /* 0xFF's character is no token */
    kvtok_free(t);
}

static void test_empty(void **state)
{
    (void)state;
    struct kvtok *t = tiny_create(KVTOK_PRE_SMOLLM);
    int32_t *ids = NULL;
    size_t n = 99;
    expect_ok(kvtok_encode(t, "", 0, 1, &ids, &n));
    assert_int_equal(n, 0);
    free(ids);
    expect_ok(kvtok_encode(t, NULL, 0, 0, &ids, &n));
    assert_int_equal(n, 0);
    free(ids);
    expect_error(kvtok_encode(t, NULL, 3, 0, &ids, &n), KVCAP_ERR_INVALID_ARGUMENT, "text",
                 NULL);
    assert_null(ids);
    kvtok_free(t);
}

static void test_decode(void **state)
{
    (void)state;
    struct kvtok *t = tiny_create(KVTOK_PRE_SMOLLM);
    char buf[32];
    long l = kvtok_decode_token(t, T_SPA, buf, sizeof buf);
    assert_int_equal(l, 2);
    assert_memory_equal(buf, " a", 2);
    assert_int_equal(kvtok_decode_token(t, T_NL, buf, sizeof buf), 1);
    assert_int_equal(buf[0], '\n');
    assert_int_equal(kvtok_decode_token(t, T_80, buf, sizeof buf), 1);
    assert_int_equal((unsigned char)buf[0], 0x80);
    assert_int_equal(kvtok_decode_token(t, T_END, buf, sizeof buf), 7);
    assert_memory_equal(buf, "<|end|>", 7);
    /* Too small a buffer: the full length comes back, only cap bytes are written. */
    memset(buf, '#', sizeof buf);
    assert_int_equal(kvtok_decode_token(t, T_SPSP, buf, 1), 2);
    assert_int_equal(buf[0], ' ');
    assert_int_equal(buf[1], '#');
    assert_int_equal(kvtok_decode_token(t, T_SPSP, NULL, 0), 2);
    assert_int_equal(kvtok_decode_token(t, -1, buf, sizeof buf), -1);
    assert_int_equal(kvtok_decode_token(t, N_TINY, buf, sizeof buf), -1);
    assert_int_equal(kvtok_decode_token(NULL, 0, buf, sizeof buf), -1);

    /* Round trip over text whose every byte has a token. */
    static const char text[] = "ab<|end|>  a\n\t12 \xc3\xa9\x80<e>>ccd  ";
    int32_t *ids;
    size_t n, len;
    expect_ok(kvtok_encode(t, text, sizeof text - 1, 1, &ids, &n));
    char *back = decode_all(t, ids, n, &len);
    assert_int_equal(len, sizeof text - 1);
    assert_memory_equal(back, text, len);
    free(back);
    free(ids);
    kvtok_free(t);
}

/* kvtok_create on the hand-made vocabulary with one thing broken. */
static enum kvcap_status create_broken(void (*breaker)(struct tiny *))
{
    struct tiny m;
    tiny_init(&m, KVTOK_PRE_SMOLLM);
    breaker(&m);
    struct kvtok *t = (struct kvtok *)&m; /* must be reset to NULL on failure */
    enum kvcap_status st = kvtok_create(&m.v, &t);
    if (st == KVCAP_OK)
        kvtok_free(t);
    else
        assert_null(t);
    return st;
}

static void merge_no_space(struct tiny *m) { m->merges[2] = str_of("aa"); }
static void merge_space_first(struct tiny *m) { m->merges[2] = str_of(" a"); }
static void merge_empty_right(struct tiny *m) { m->merges[2] = str_of("a "); }
static void merge_unknown_part(struct tiny *m) { m->merges[4] = str_of("1 zz"); }
static void merge_extra_ok(struct tiny *m)
{
    /* A part that is no token but the result of another merge is accepted: "cd" comes from
     * "c d". */
    m->merges[N_TINY_MERGES] = str_of("cd d");
    m->v.n_merges = N_TINY_MERGES + 1;
}
static void bad_type(struct tiny *m) { m->types[T_A] = 9; }
static void zero_type(struct tiny *m) { m->types[T_B] = 0; }
static void bad_bos(struct tiny *m) { m->v.bos = N_TINY; }
static void bad_eos(struct tiny *m) { m->v.eos = -2; }
static void no_tokens(struct tiny *m) { m->v.n_tokens = 0; }
static void bad_pre(struct tiny *m) { m->v.pre = (enum kvtok_pre)7; }

static void test_malformed_vocab(void **state)
{
    (void)state;
    expect_error(create_broken(merge_no_space), KVCAP_ERR_FORMAT, "merge 2 ('aa')", "no space");
    expect_error(create_broken(merge_space_first), KVCAP_ERR_FORMAT, "merge 2", "no space");
    expect_error(create_broken(merge_empty_right), KVCAP_ERR_FORMAT, "merge 2 ('a ')",
                 "nothing after");
    expect_error(create_broken(merge_unknown_part), KVCAP_ERR_FORMAT, "merge 4 ('1 zz')",
                 "'zz' is not a token");
    expect_ok(create_broken(merge_extra_ok));
    expect_error(create_broken(bad_type), KVCAP_ERR_FORMAT, "token 3 ('a')", "type 9");
    expect_error(create_broken(zero_type), KVCAP_ERR_FORMAT, "token 4 ('b')", "type 0");
    expect_error(create_broken(bad_bos), KVCAP_ERR_FORMAT, "BOS", "27");
    expect_error(create_broken(bad_eos), KVCAP_ERR_FORMAT, "EOS", "-2");
    expect_error(create_broken(no_tokens), KVCAP_ERR_FORMAT, "empty", NULL);
    expect_error(create_broken(bad_pre), KVCAP_ERR_INVALID_ARGUMENT, "pre-tokenizer", NULL);

    struct kvtok *t = NULL;
    expect_error(kvtok_create(NULL, &t), KVCAP_ERR_INVALID_ARGUMENT, "vocab", NULL);
    struct tiny m;
    tiny_init(&m, KVTOK_PRE_GPT2);
    expect_error(kvtok_create(&m.v, NULL), KVCAP_ERR_INVALID_ARGUMENT, "out", NULL);
    /* types may be absent: all NORMAL, so nothing is special. */
    m.v.types = NULL;
    expect_ok(kvtok_create(&m.v, &t));
    EXPECT_IDS(t, "<e>", 1, T_LT, T_LE, T_GT);
    kvtok_free(t);
}

/* ---- GGUF images built in memory -------------------------------------------------------- */

struct gbuf {
    unsigned char *p;
    size_t n, cap;
    uint64_t n_kv;
};

static void g_put(struct gbuf *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void g_u32(struct gbuf *b, uint32_t v) /* little-endian hosts only, as the reader */
{
    g_put(b, &v, 4);
}

static void g_u64(struct gbuf *b, uint64_t v)
{
    g_put(b, &v, 8);
}

static void g_str(struct gbuf *b, const char *s, size_t n)
{
    g_u64(b, n);
    g_put(b, s, n);
}

static void g_kv_str(struct gbuf *b, const char *key, const char *val)
{
    g_str(b, key, strlen(key));
    g_u32(b, 8);
    g_str(b, val, strlen(val));
    b->n_kv++;
}

static void g_kv_u32(struct gbuf *b, const char *key, uint32_t v)
{
    g_str(b, key, strlen(key));
    g_u32(b, 4);
    g_u32(b, v);
    b->n_kv++;
}

static void g_kv_strs(struct gbuf *b, const char *key, const struct kvgguf_str *s, size_t n)
{
    g_str(b, key, strlen(key));
    g_u32(b, 9);
    g_u32(b, 8);
    g_u64(b, n);
    for (size_t i = 0; i < n; i++)
        g_str(b, s[i].s, (size_t)s[i].n);
    b->n_kv++;
}

static void g_kv_i32s(struct gbuf *b, const char *key, const int32_t *v, size_t n)
{
    g_str(b, key, strlen(key));
    g_u32(b, 9);
    g_u32(b, 5);
    g_u64(b, n);
    g_put(b, v, n * 4);
    b->n_kv++;
}

/* The tiny vocabulary as a GGUF image without tensors. model/pre NULL: key left out;
 * n_types: how many token types to write. */
static struct gbuf tiny_gguf(const char *model, const char *pre, const struct tiny *m,
                             size_t n_types)
{
    struct gbuf kv = {0}, out = {0};
    g_kv_str(&kv, "general.architecture", "llama");
    if (model)
        g_kv_str(&kv, "tokenizer.ggml.model", model);
    if (pre)
        g_kv_str(&kv, "tokenizer.ggml.pre", pre);
    g_kv_strs(&kv, "tokenizer.ggml.tokens", m->tokens, (size_t)m->v.n_tokens);
    g_kv_i32s(&kv, "tokenizer.ggml.token_type", m->types, n_types);
    g_kv_strs(&kv, "tokenizer.ggml.merges", m->merges, (size_t)m->v.n_merges);
    g_kv_u32(&kv, "tokenizer.ggml.bos_token_id", T_END);
    g_kv_u32(&kv, "tokenizer.ggml.eos_token_id", T_E);
    g_put(&out, "GGUF", 4);
    g_u32(&out, 3);
    g_u64(&out, 0);
    g_u64(&out, kv.n_kv);
    g_put(&out, kv.p, kv.n);
    static const unsigned char zeros[32];
    g_put(&out, zeros, (32 - out.n % 32) % 32);
    free(kv.p);
    return out;
}

static enum kvcap_status create_from_image(struct gbuf *img, struct kvtok **t)
{
    struct kvgguf_file *f = NULL;
    expect_ok(kvgguf_open_memory(img->p, img->n, "tiny.gguf", &f));
    enum kvcap_status st = kvtok_create_gguf(f, t);
    kvgguf_close(f);
    free(img->p);
    return st;
}

static void test_gguf(void **state)
{
    (void)state;
    struct tiny m;
    tiny_init(&m, KVTOK_PRE_GPT2);
    struct kvtok *t = NULL;

    struct gbuf img = tiny_gguf("gpt2", "smollm", &m, N_TINY);
    expect_ok(create_from_image(&img, &t));
    assert_int_equal(kvtok_n_tokens(t), N_TINY);
    assert_int_equal(kvtok_bos(t), T_END);
    assert_int_equal(kvtok_eos(t), T_E);
    EXPECT_IDS(t, "a123<|end|>", 1, T_A, T_1, T_2, T_3, T_END);
    kvtok_free(t);

    static const char *const smollm_like[] = {"starcoder", "refact"};
    for (int i = 0; i < 2; i++) {
        img = tiny_gguf("gpt2", smollm_like[i], &m, N_TINY);
        expect_ok(create_from_image(&img, &t));
        EXPECT_IDS(t, "a12", 1, T_A, T_1, T_2);
        kvtok_free(t);
    }
    static const char *const gpt2_like[] = {NULL, "gpt2", "default"};
    for (int i = 0; i < 3; i++) {
        img = tiny_gguf("gpt2", gpt2_like[i], &m, N_TINY);
        expect_ok(create_from_image(&img, &t));
        EXPECT_IDS(t, "a123", 1, T_A, T_12, T_3);
        kvtok_free(t);
    }

    img = tiny_gguf("llama", "smollm", &m, N_TINY);
    expect_error(create_from_image(&img, &t), KVCAP_ERR_UNSUPPORTED, "tokenizer.ggml.model",
                 "'llama'");
    assert_null(t);
    img = tiny_gguf(NULL, "smollm", &m, N_TINY);
    expect_error(create_from_image(&img, &t), KVCAP_ERR_NOT_FOUND, "tokenizer.ggml.model", NULL);
    img = tiny_gguf("gpt2", "qwen2", &m, N_TINY);
    expect_error(create_from_image(&img, &t), KVCAP_ERR_UNSUPPORTED, "tokenizer.ggml.pre",
                 "'qwen2'");
    img = tiny_gguf("gpt2", "smollm", &m, N_TINY - 1);
    expect_error(create_from_image(&img, &t), KVCAP_ERR_FORMAT, "tokenizer.ggml.token_type",
                 "26 entries");
    /* Errors from the vocabulary itself carry the file's label. */
    m.merges[1] = str_of("ab");
    img = tiny_gguf("gpt2", "smollm", &m, N_TINY);
    expect_error(create_from_image(&img, &t), KVCAP_ERR_FORMAT, "tiny.gguf: tokenizer: merge 1",
                 "no space");
    assert_null(t);
}

/* ---- The real SmolLM2 vocabulary against llama.cpp -------------------------------------- */

struct real {
    struct kvgguf_file *f;
    struct kvtok *t;
};

static int real_setup(void **state)
{
    static struct real r;
    char path[4096];
    const char *env = getenv("KVCAP_SMOLLM2_GGUF"), *home = getenv("HOME");
    if (env && *env)
        snprintf(path, sizeof path, "%s", env);
    else
        snprintf(path, sizeof path, "%s/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                 home ? home : ".");
    *state = &r;
    if (access(path, R_OK) != 0) {
        printf("SKIP: real-vocabulary checks (%s not found; set KVCAP_SMOLLM2_GGUF)\n", path);
        return 0;
    }
    if (kvgguf_open(path, &r.f) != KVCAP_OK || kvtok_create_gguf(r.f, &r.t) != KVCAP_OK) {
        printf("cannot load %s: %s\n", path, kvcap_last_error());
        return -1;
    }
    return 0;
}

static int real_teardown(void **state)
{
    struct real *r = *state;
    kvtok_free(r->t);
    kvgguf_close(r->f);
    return 0;
}

static const struct kvtok *real_tok(void **state)
{
    struct real *r = *state;
    if (!r->t)
        skip();
    return r->t;
}

static cJSON *load_fixture(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/smollm2_reference.json", KVCAP_TEST_DATA);
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    assert_non_null(text);
    assert_int_equal(fread(text, 1, (size_t)n, f), (size_t)n);
    text[n] = '\0';
    fclose(f);
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j)
        fail_msg("%s is not valid JSON", path);
    return j;
}

/* Encodes the entry's text and compares with its ids array `key`; then decodes them back. */
static void check_entry(const struct kvtok *t, const cJSON *entry, const char *key,
                        int special)
{
    const cJSON *text = cJSON_GetObjectItem(entry, "text");
    const cJSON *ids_j = cJSON_GetObjectItem(entry, key);
    assert_true(cJSON_IsString(text));
    assert_true(cJSON_IsArray(ids_j));
    size_t n_want = (size_t)cJSON_GetArraySize(ids_j);
    int32_t *want = malloc((n_want + 1) * sizeof *want);
    assert_non_null(want);
    for (size_t i = 0; i < n_want; i++)
        want[i] = (int32_t)cJSON_GetArrayItem(ids_j, (int)i)->valueint;
    const char *s = text->valuestring;
    size_t len = strlen(s);
    expect_ids_n(t, s, len, special, want, n_want);
    size_t back_len;
    char *back = decode_all(t, want, n_want, &back_len);
    if (back_len != len || memcmp(back, s, len) != 0)
        fail_msg("decoding the ids of '%.40s' gives '%.40s'", s, back);
    free(back);
    free(want);
}

static void test_real_metadata(void **state)
{
    const struct kvtok *t = real_tok(state);
    assert_int_equal(kvtok_n_tokens(t), 49152);
    assert_int_equal(kvtok_bos(t), 1);
    assert_int_equal(kvtok_eos(t), 2);
    char buf[64];
    long l = kvtok_decode_token(t, 0, buf, sizeof buf);
    assert_int_equal(l, 13);
    assert_memory_equal(buf, "<|endoftext|>", 13);
    l = kvtok_decode_token(t, 2, buf, sizeof buf);
    assert_int_equal(l, 10);
    assert_memory_equal(buf, "<|im_end|>", 10);
    EXPECT_IDS(t, "<|im_start|>", 1, 1);
}

static void test_real_matches_llamacpp(void **state)
{
    const struct kvtok *t = real_tok(state);
    cJSON *fx = load_fixture();
    const cJSON *prompts = cJSON_GetObjectItem(fx, "prompts");
    const cJSON *cases = cJSON_GetObjectItem(fx, "tokenizer_cases");
    assert_true(cJSON_IsArray(prompts));
    assert_true(cJSON_IsArray(cases));
    int n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, prompts) {
        check_entry(t, e, "ids", 1);
        check_entry(t, e, "ids_plain", 0);
        n++;
    }
    cJSON_ArrayForEach(e, cases) {
        check_entry(t, e, "ids", 1);
        n++;
    }
    assert_true(n >= 10);
    print_message("%d texts tokenised as llama.cpp does\n", n);
    cJSON_Delete(fx);
}

static void test_real_invalid_utf8(void **state)
{
    const struct kvtok *t = real_tok(state);
    /* Each invalid byte is its byte token, so decoding gives the bytes back. (Not for every
     * byte: 0xC0, 0xC1, 0xF1, 0xF2, 0xF5..0xFF and a few control bytes have no token here.) */
    static const char text[] = "ok \x80\xbf caf\xc3 \xe6\x97 end\xed\xa0\x80!";
    int32_t *ids;
    size_t n, len;
    expect_ok(kvtok_encode(t, text, sizeof text - 1, 1, &ids, &n));
    char *back = decode_all(t, ids, n, &len);
    assert_int_equal(len, sizeof text - 1);
    assert_memory_equal(back, text, len);
    free(back);
    free(ids);
}

static void test_real_speed(void **state)
{
    const struct kvtok *t = real_tok(state);
    static const char *const files[] = {"Apache-2.0", "GPL-3", "LGPL-3", "MPL-2.0", "GPL-2",
                                        "LGPL-2.1", "Artistic", "BSD", "CC0-1.0", "GFDL-1.3"};
    size_t cap = (1u << 20) + (1u << 17), len = 0;
    char *text = malloc(cap);
    assert_non_null(text);
    while (len < (1u << 20)) {
        size_t before = len;
        for (size_t i = 0; i < sizeof files / sizeof files[0] && len < cap; i++) {
            char path[256];
            snprintf(path, sizeof path, "/usr/share/common-licenses/%s", files[i]);
            FILE *f = fopen(path, "rb");
            if (!f)
                continue;
            len += fread(text + len, 1, cap - len, f);
            fclose(f);
        }
        if (len == before)
            break;
    }
    if (len < 4096) {
        printf("SKIP: encode speed (no /usr/share/common-licenses texts)\n");
        free(text);
        skip();
    }
    int32_t *ids;
    size_t n;
    struct timespec a, b;
    clock_t c0 = clock();
    clock_gettime(CLOCK_MONOTONIC, &a);
    expect_ok(kvtok_encode(t, text, len, 0, &ids, &n));
    clock_gettime(CLOCK_MONOTONIC, &b);
    double cpu = (double)(clock() - c0) / CLOCKS_PER_SEC;
    double s = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    printf("encode speed: %.2f MB/s wall, %.2f MB/s CPU (%zu bytes -> %zu tokens in %.3f s, "
           "%.2f bytes/token)\n",
           (double)len / 1e6 / s, cpu > 0 ? (double)len / 1e6 / cpu : 0.0, len, n, s,
           (double)len / (double)n);
    size_t back_len;
    char *back = decode_all(t, ids, n, &back_len);
    assert_int_equal(back_len, len);
    assert_memory_equal(back, text, len);
    free(back);
    free(ids);
    free(text);
}

int main(void)
{
    const struct CMUnitTest tiny[] = {
        cmocka_unit_test(test_metadata),
        cmocka_unit_test(test_merge_rank_order),
        cmocka_unit_test(test_leftmost_equal_rank),
        cmocka_unit_test(test_fallback_to_bytes),
        cmocka_unit_test(test_digits),
        cmocka_unit_test(test_whitespace),
        cmocka_unit_test(test_special_tokens),
        cmocka_unit_test(test_invalid_utf8),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_decode),
        cmocka_unit_test(test_malformed_vocab),
        cmocka_unit_test(test_gguf),
    };
    const struct CMUnitTest real[] = {
        cmocka_unit_test(test_real_metadata),
        cmocka_unit_test(test_real_matches_llamacpp),
        cmocka_unit_test(test_real_invalid_utf8),
        cmocka_unit_test(test_real_speed),
    };
    int failed = cmocka_run_group_tests_name("tokenizer", tiny, NULL, NULL);
    failed += cmocka_run_group_tests_name("tokenizer_smollm2", real, real_setup, real_teardown);
    return failed;
}
