/* tokenizer.c — GPT-2 byte-level BPE over a GGUF vocabulary, following llama.cpp's
 * LLAMA_VOCAB_TYPE_BPE path (src/llama-vocab.cpp, src/unicode.cpp): special tokens split out of
 * the raw text, pre-tokenizer regexes (PCRE2, JIT-compiled when available), then rank-ordered
 * merges over the byte-to-unicode alphabet.
 *
 * Where this file knowingly differs from llama.cpp:
 *  - Invalid UTF-8: llama.cpp replaces each invalid byte with U+FFFD before the regexes (lossy);
 *    here every invalid byte becomes its own byte token, so decoding gives the input back.
 *  - A merged symbol that is not a token falls back to the tokens of its bytes' characters;
 *    llama.cpp looks up the single raw bytes of the mapped UTF-8 text, which drops every byte
 *    whose character takes two UTF-8 bytes. Neither happens with a consistent vocabulary.
 *  - Overlong and surrogate UTF-8 sequences count as invalid (llama.cpp decodes them).
 *  - Decoding: UNKNOWN, UNUSED and BYTE tokens are byte-decoded like NORMAL ones (llama.cpp
 *    renders them empty); characters outside the byte alphabet are copied as UTF-8 (llama.cpp
 *    writes "[UNK_BYTE_0x..]"). */
#define PCRE2_CODE_UNIT_WIDTH 8

#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/internal.h"
#include "engine/tokenizer.h"

/* Unicode White_Space, the set llama.cpp's unicode_cpt_flags treat as whitespace. PCRE2's
 * \s under PCRE2_UCP also matches U+180E, which llama.cpp (and Unicode since 6.3) does not. */
#define WS "\\t\\n\\x0B\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}" \
           "\\x{202F}\\x{205F}\\x{3000}"

/* The GPT-2 pre-tokenizer, "'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
 * \s+(?!\S)", with \s spelled out. Text the regex does not match stays a word of its own, as in
 * llama.cpp; with this regex that is only a lone non-space whitespace character before a
 * non-space (the trailing "|\s+" of llama.cpp's hand-written matcher gives the same words). */
static const char re_words_src[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS "])";

/* smollm's first regex "\p{N}" keeps the text between digits as fragments; matching those
 * runs explicitly splits the same way while every match starts where the previous one ended,
 * so no call scans far (group 1 set: a digit). */
static const char re_digits_src[] = "(\\p{N})|[^\\p{N}]+";

#define KVTOK_MAX_TOKEN_BYTES INT32_MAX /* decode returns a long: keep each length small */
#define KVTOK_MAX_WORD (INT32_MAX / 4)  /* symbol positions are int32, the heap holds 3n */
#define KVTOK_SHOW 48                   /* bytes of a token or merge quoted in messages */

struct pair {
    uint64_t key; /* left symbol << 32 | right symbol; PAIR_EMPTY when the slot is free */
    int32_t rank;
    int32_t result;
};
#define PAIR_EMPTY UINT64_MAX

struct kvtok {
    int64_t n_tokens;
    int32_t bos, eos;
    enum kvtok_pre pre;
    int32_t byte_sym[256]; /* symbol of each byte's single character (-1: none) */
    int32_t byte_tok[256]; /* token of each byte's single character (-1: none) */
    size_t *text_off;      /* n_tokens + 1 offsets into text: token strings as stored */
    char *text;
    size_t *dec_off; /* n_tokens + 1 offsets into dec: the bytes each token stands for */
    char *dec;
    uint8_t *types;
    size_t n_special;
    int32_t *special; /* CONTROL, USER_DEFINED and UNKNOWN tokens, longest first */
    struct pair *pairs;
    size_t pair_mask;
    pcre2_code *re_words;
    pcre2_code *re_digits; /* NULL unless KVTOK_PRE_SMOLLM */
};

/* ---- Byte alphabet and UTF-8 ----------------------------------------------------------- */

/* GPT-2's bytes_to_unicode: printable latin-1 bytes stand for themselves, the other 68 bytes
 * (0x00-0x20, 0x7F-0xA0, 0xAD) for U+0100 + n in byte order. */
static unsigned byte_cp(unsigned b)
{
    if (b <= 0x20)
        return 0x100 + b;
    if (b >= 0x7F && b <= 0xA0)
        return 0x100 + 33 + (b - 0x7F);
    if (b == 0xAD)
        return 0x100 + 67;
    return b;
}

#define BYTE_CP_END 0x144 /* every byte's character is below this */

/* Writes the UTF-8 of a byte's character (1 or 2 bytes) and returns its length. */
static size_t byte_char_utf8(unsigned b, char *out)
{
    unsigned cp = byte_cp(b);
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

/* Undoes the byte mapping of one token string into out (at most n bytes are written, since
 * every character becomes at most as many bytes as it had); returns the length. */
static size_t unmap_token(const int16_t *byte_of_cp, const char *s, size_t n, char *out)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t l = kvcap_utf8_seq_len(p + i, n - i);
        if (l == 0) {
            out[o++] = (char)p[i++];
            continue;
        }
        unsigned cp = l == 1 ? p[i] : l == 2 ? ((p[i] & 0x1Fu) << 6) | (p[i + 1] & 0x3Fu) : 0;
        if (l <= 2 && cp < BYTE_CP_END && byte_of_cp[cp] >= 0) {
            out[o++] = (char)byte_of_cp[cp];
        } else {
            memcpy(out + o, p + i, l);
            o += l;
        }
        i += l;
    }
    return o;
}

/* ---- Build-time symbol table ------------------------------------------------------------ */

/* Every string a merge can produce or consume, text -> symbol id: the tokens (ids 0..n-1),
 * then the byte characters and merge results that are not tokens (ids n..). Only kvtok_create
 * uses it; the tokenizer keeps symbol ids, never strings. */
struct symtab {
    const char **s;
    size_t *n;
    int32_t count;
    int32_t *slot; /* -1: free */
    size_t mask;
};

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static int32_t *sym_slot(struct symtab *st, const char *s, size_t n)
{
    size_t i = (size_t)hash_bytes(s, n) & st->mask;
    for (;;) {
        int32_t id = st->slot[i];
        if (id < 0 || (st->n[id] == n && memcmp(st->s[id], s, n) == 0))
            return &st->slot[i];
        i = (i + 1) & st->mask;
    }
}

/* The symbol for s, added as a new non-token symbol when absent. */
static int32_t sym_intern(struct symtab *st, const char *s, size_t n)
{
    int32_t *slot = sym_slot(st, s, n);
    if (*slot < 0) {
        st->s[st->count] = s;
        st->n[st->count] = n;
        *slot = st->count++;
    }
    return *slot;
}

static size_t pow2_at_least(size_t n)
{
    size_t p = 8;
    while (p < n)
        p *= 2;
    return p;
}

static inline size_t pair_hash(uint64_t key, size_t mask)
{
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & mask;
}

static inline const struct pair *pair_find(const struct kvtok *t, int32_t l, int32_t r)
{
    uint64_t key = (uint64_t)(uint32_t)l << 32 | (uint32_t)r;
    for (size_t i = pair_hash(key, t->pair_mask);; i = (i + 1) & t->pair_mask) {
        const struct pair *p = &t->pairs[i];
        if (p->key == key)
            return p;
        if (p->key == PAIR_EMPTY)
            return NULL;
    }
}

/* ---- Creation ------------------------------------------------------------------------- */

static int is_special_type(int type)
{
    return type == KVTOK_CONTROL || type == KVTOK_USER_DEFINED || type == KVTOK_UNKNOWN;
}

/* Offsets of the pieces of the one block a tokenizer lives in. */
struct layout {
    size_t size;
    int ok;
};

static size_t layout_add(struct layout *l, size_t count, size_t elem, size_t align)
{
    size_t off, bytes;
    if (!l->ok || !kvcap_add_size(l->size, align - 1, &off) ||
        !kvcap_mul_size(count, elem, &bytes)) {
        l->ok = 0;
        return 0;
    }
    off &= ~(align - 1);
    if (!kvcap_add_size(off, bytes, &l->size))
        l->ok = 0;
    return off;
}

static enum kvcap_status compile_regex(const char *src, pcre2_code **out)
{
    int err;
    PCRE2_SIZE at;
    *out = pcre2_compile((PCRE2_SPTR)src, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err,
                         &at, NULL);
    if (!*out) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return kvcap_fail(KVCAP_ERR_INTERNAL,
                          "tokenizer: PCRE2 rejects the pre-tokenizer regex at offset %zu: %s",
                          (size_t)at, (const char *)msg);
    }
    /* Without JIT support (or with it disabled) the interpreter gives the same matches. */
    pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE);
    return KVCAP_OK;
}

/* Checks what can be checked per token and merge before anything is allocated. */
static enum kvcap_status check_vocab(const struct kvtok_vocab *v, size_t *text_bytes,
                                     size_t *merge_bytes)
{
    KVCAP_RETURN_IF(v->n_tokens <= 0, KVCAP_ERR_FORMAT, "tokenizer: the vocabulary is empty");
    KVCAP_RETURN_IF(!v->tokens, KVCAP_ERR_INVALID_ARGUMENT, "kvtok_create: vocab->tokens is NULL");
    KVCAP_RETURN_IF(v->n_merges < 0, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvtok_create: vocab->n_merges is %lld", (long long)v->n_merges);
    KVCAP_RETURN_IF(v->n_merges > 0 && !v->merges, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvtok_create: vocab->merges is NULL");
    /* Symbols (tokens, byte characters, merge results) are int32 ids. */
    KVCAP_RETURN_IF(v->n_tokens > (int64_t)INT32_MAX - 256 - v->n_merges, KVCAP_ERR_FORMAT,
                    "tokenizer: %lld tokens and %lld merges are more than this tokenizer "
                    "handles (%d together)",
                    (long long)v->n_tokens, (long long)v->n_merges, INT32_MAX - 256);
    KVCAP_RETURN_IF(v->pre != KVTOK_PRE_GPT2 && v->pre != KVTOK_PRE_SMOLLM,
                    KVCAP_ERR_INVALID_ARGUMENT, "kvtok_create: unknown pre-tokenizer %d",
                    (int)v->pre);
    KVCAP_RETURN_IF(v->bos < -1 || v->bos >= v->n_tokens, KVCAP_ERR_FORMAT,
                    "tokenizer: BOS token id %d is outside 0..%lld", (int)v->bos,
                    (long long)v->n_tokens - 1);
    KVCAP_RETURN_IF(v->eos < -1 || v->eos >= v->n_tokens, KVCAP_ERR_FORMAT,
                    "tokenizer: EOS token id %d is outside 0..%lld", (int)v->eos,
                    (long long)v->n_tokens - 1);

    size_t total = 0;
    for (int64_t i = 0; i < v->n_tokens; i++) {
        const struct kvgguf_str *s = &v->tokens[i];
        KVCAP_RETURN_IF(!s->s && s->n, KVCAP_ERR_INVALID_ARGUMENT,
                        "kvtok_create: token %lld has a NULL string", (long long)i);
        KVCAP_RETURN_IF(s->n > KVTOK_MAX_TOKEN_BYTES, KVCAP_ERR_FORMAT,
                        "tokenizer: token %lld is %llu bytes long (at most %d)", (long long)i,
                        (unsigned long long)s->n, KVTOK_MAX_TOKEN_BYTES);
        int type = v->types ? v->types[i] : KVTOK_NORMAL;
        KVCAP_RETURN_IF(type < KVTOK_NORMAL || type > KVTOK_BYTE, KVCAP_ERR_FORMAT,
                        "tokenizer: token %lld ('%.*s') has type %d (valid: 1..6)", (long long)i,
                        (int)(s->n < KVTOK_SHOW ? s->n : KVTOK_SHOW), s->n ? s->s : "", type);
        KVCAP_RETURN_IF(!kvcap_add_size(total, (size_t)s->n, &total), KVCAP_ERR_FORMAT,
                        "tokenizer: token strings too large");
    }
    *text_bytes = total;

    total = 0;
    for (int64_t i = 0; i < v->n_merges; i++) {
        const struct kvgguf_str *m = &v->merges[i];
        KVCAP_RETURN_IF(!m->s && m->n, KVCAP_ERR_INVALID_ARGUMENT,
                        "kvtok_create: merge %lld has a NULL string", (long long)i);
        int show = (int)(m->n < KVTOK_SHOW ? m->n : KVTOK_SHOW);
        /* As llama.cpp: the separator is the first space after the first byte. */
        const char *sp = m->n >= 2 ? memchr(m->s + 1, ' ', (size_t)m->n - 1) : NULL;
        KVCAP_RETURN_IF(!sp, KVCAP_ERR_FORMAT, "tokenizer: merge %lld ('%.*s') has no space",
                        (long long)i, show, m->n ? m->s : "");
        KVCAP_RETURN_IF(sp == m->s + m->n - 1, KVCAP_ERR_FORMAT,
                        "tokenizer: merge %lld ('%.*s') has nothing after its space", (long long)i,
                        show, m->s);
        KVCAP_RETURN_IF(!kvcap_add_size(total, (size_t)m->n, &total), KVCAP_ERR_FORMAT,
                        "tokenizer: merge strings too large");
    }
    *merge_bytes = total;
    return KVCAP_OK;
}

/* Reads the merges into the pair table: pass 1 makes every merge result a symbol, so that
 * pass 2 can accept as a part any string the merges can build, as llama.cpp's string-keyed
 * ranks do; a part nothing can build is an error. The first of two equal pairs keeps its rank. */
static enum kvcap_status load_merges(struct kvtok *t, const struct kvtok_vocab *v,
                                     struct symtab *st, char *arena, int32_t *result)
{
    for (int64_t i = 0; i < v->n_merges; i++) {
        const struct kvgguf_str *m = &v->merges[i];
        size_t nl = (size_t)((const char *)memchr(m->s + 1, ' ', (size_t)m->n - 1) - m->s);
        memcpy(arena, m->s, nl);
        memcpy(arena + nl, m->s + nl + 1, (size_t)m->n - nl - 1);
        result[i] = sym_intern(st, arena, (size_t)m->n - 1);
        arena += m->n - 1;
    }
    for (int64_t i = 0; i < v->n_merges; i++) {
        const struct kvgguf_str *m = &v->merges[i];
        size_t nl = (size_t)((const char *)memchr(m->s + 1, ' ', (size_t)m->n - 1) - m->s);
        const char *part[2] = {m->s, m->s + nl + 1};
        size_t len[2] = {nl, (size_t)m->n - nl - 1};
        int32_t id[2];
        for (int k = 0; k < 2; k++) {
            id[k] = *sym_slot(st, part[k], len[k]);
            KVCAP_RETURN_IF(id[k] < 0, KVCAP_ERR_FORMAT,
                            "tokenizer: merge %lld ('%.*s'): '%.*s' is not a token (nor the "
                            "result of a merge)",
                            (long long)i, (int)(m->n < KVTOK_SHOW ? m->n : KVTOK_SHOW), m->s,
                            (int)(len[k] < KVTOK_SHOW ? len[k] : KVTOK_SHOW), part[k]);
        }
        uint64_t key = (uint64_t)(uint32_t)id[0] << 32 | (uint32_t)id[1];
        size_t j = pair_hash(key, t->pair_mask);
        while (t->pairs[j].key != PAIR_EMPTY && t->pairs[j].key != key)
            j = (j + 1) & t->pair_mask;
        if (t->pairs[j].key == PAIR_EMPTY)
            t->pairs[j] = (struct pair){key, (int32_t)i, result[i]};
    }
    return KVCAP_OK;
}

struct by_len {
    size_t len;
    int32_t id;
};

/* Special tokens longest first, ties by id (llama.cpp sorts by length only). */
static int cmp_by_len(const void *a, const void *b)
{
    const struct by_len *x = a, *y = b;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

enum kvcap_status kvtok_create(const struct kvtok_vocab *v, struct kvtok **out)
{
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "kvtok_create: out is NULL");
    *out = NULL;
    KVCAP_RETURN_IF(!v, KVCAP_ERR_INVALID_ARGUMENT, "kvtok_create: vocab is NULL");
    size_t text_bytes = 0, merge_bytes = 0;
    KVCAP_TRY(check_vocab(v, &text_bytes, &merge_bytes));

    size_t n = (size_t)v->n_tokens, n_special = 0;
    for (size_t i = 0; i < n; i++)
        if (v->types && is_special_type(v->types[i]) && v->tokens[i].n > 0)
            n_special++;
    size_t pair_cap = pow2_at_least(2 * (size_t)v->n_merges);

    struct layout l = {sizeof(struct kvtok), 1};
    size_t o_text_off = layout_add(&l, n + 1, sizeof(size_t), _Alignof(size_t));
    size_t o_dec_off = layout_add(&l, n + 1, sizeof(size_t), _Alignof(size_t));
    size_t o_pairs = layout_add(&l, pair_cap, sizeof(struct pair), _Alignof(struct pair));
    size_t o_special = layout_add(&l, n_special, sizeof(int32_t), _Alignof(int32_t));
    size_t o_types = layout_add(&l, n, 1, 1);
    size_t o_text = layout_add(&l, text_bytes, 1, 1);
    size_t o_dec = layout_add(&l, text_bytes, 1, 1); /* decoding never lengthens a token */
    KVCAP_RETURN_IF(!l.ok, KVCAP_ERR_OUT_OF_MEMORY, "tokenizer: vocabulary too large");
    char *block = malloc(l.size);
    KVCAP_RETURN_IF(!block, KVCAP_ERR_OUT_OF_MEMORY, "tokenizer: out of memory (%zu bytes)",
                    l.size);
    struct kvtok *t = (struct kvtok *)block;
    memset(t, 0, sizeof *t);
    t->n_tokens = v->n_tokens;
    t->bos = v->bos;
    t->eos = v->eos;
    t->pre = v->pre;
    t->text_off = (size_t *)(block + o_text_off);
    t->dec_off = (size_t *)(block + o_dec_off);
    t->pairs = (struct pair *)(block + o_pairs);
    t->pair_mask = pair_cap - 1;
    t->special = (int32_t *)(block + o_special);
    t->types = (uint8_t *)(block + o_types);
    t->text = block + o_text;
    t->dec = block + o_dec;
    for (size_t i = 0; i < pair_cap; i++)
        t->pairs[i].key = PAIR_EMPTY;

    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        t->text_off[i] = at;
        if (v->tokens[i].n)
            memcpy(t->text + at, v->tokens[i].s, (size_t)v->tokens[i].n);
        at += (size_t)v->tokens[i].n;
        t->types[i] = (uint8_t)(v->types ? v->types[i] : KVTOK_NORMAL);
        if (is_special_type(t->types[i]) && v->tokens[i].n > 0)
            t->special[t->n_special++] = (int32_t)i;
    }
    t->text_off[n] = at;

    int16_t byte_of_cp[BYTE_CP_END];
    for (unsigned c = 0; c < BYTE_CP_END; c++)
        byte_of_cp[c] = -1;
    for (unsigned b = 0; b < 256; b++)
        byte_of_cp[byte_cp(b)] = (int16_t)b;
    at = 0;
    for (size_t i = 0; i < n; i++) {
        const char *s = t->text + t->text_off[i];
        size_t len = t->text_off[i + 1] - t->text_off[i];
        t->dec_off[i] = at;
        if (t->types[i] == KVTOK_CONTROL || t->types[i] == KVTOK_USER_DEFINED) {
            memcpy(t->dec + at, s, len);
            at += len;
        } else {
            at += unmap_token(byte_of_cp, s, len, t->dec + at);
        }
    }
    t->dec_off[n] = at;

    struct by_len *order = malloc((t->n_special ? t->n_special : 1) * sizeof *order);
    if (!order) {
        kvtok_free(t);
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    }
    for (size_t i = 0; i < t->n_special; i++)
        order[i] = (struct by_len){t->text_off[t->special[i] + 1] - t->text_off[t->special[i]],
                                   t->special[i]};
    qsort(order, t->n_special, sizeof *order, cmp_by_len);
    for (size_t i = 0; i < t->n_special; i++)
        t->special[i] = order[i].id;
    free(order);

    /* Symbols: the tokens, then at most 256 byte characters and one result per merge. */
    enum kvcap_status st = KVCAP_OK;
    size_t sym_cap = n + 256 + (size_t)v->n_merges;
    size_t slot_cap = pow2_at_least(2 * sym_cap);
    struct symtab tab = {malloc(sym_cap * sizeof(char *)), malloc(sym_cap * sizeof(size_t)), 0,
                         malloc(slot_cap * sizeof(int32_t)), slot_cap - 1};
    char *arena = malloc(merge_bytes + 1);
    int32_t *result = malloc(((size_t)v->n_merges + 1) * sizeof(int32_t));
    char byte_chars[512];
    if (!tab.s || !tab.n || !tab.slot || !arena || !result) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "tokenizer: out of memory (symbol table)");
        goto done;
    }
    for (size_t i = 0; i < slot_cap; i++)
        tab.slot[i] = -1;
    for (size_t i = 0; i < n; i++) {
        tab.s[i] = t->text + t->text_off[i];
        tab.n[i] = t->text_off[i + 1] - t->text_off[i];
        *sym_slot(&tab, tab.s[i], tab.n[i]) = (int32_t)i; /* a later duplicate wins, as in llama.cpp */
    }
    tab.count = (int32_t)n;
    for (unsigned b = 0; b < 256; b++) {
        size_t len = byte_char_utf8(b, byte_chars + 2 * b);
        int32_t id = sym_intern(&tab, byte_chars + 2 * b, len);
        t->byte_sym[b] = id;
        t->byte_tok[b] = id < (int32_t)n ? id : -1;
    }
    st = load_merges(t, v, &tab, arena, result);
    if (st == KVCAP_OK)
        st = compile_regex(re_words_src, &t->re_words);
    if (st == KVCAP_OK && t->pre == KVTOK_PRE_SMOLLM)
        st = compile_regex(re_digits_src, &t->re_digits);
done:
    free(tab.s);
    free(tab.n);
    free(tab.slot);
    free(arena);
    free(result);
    if (st != KVCAP_OK) {
        kvtok_free(t);
        return st;
    }
    *out = t;
    return KVCAP_OK;
}

void kvtok_free(struct kvtok *t)
{
    if (!t)
        return;
    pcre2_code_free(t->re_words);
    pcre2_code_free(t->re_digits);
    free(t);
}

int64_t kvtok_n_tokens(const struct kvtok *t)
{
    return t ? t->n_tokens : 0;
}

int32_t kvtok_bos(const struct kvtok *t)
{
    return t ? t->bos : -1;
}

int32_t kvtok_eos(const struct kvtok *t)
{
    return t ? t->eos : -1;
}

long kvtok_decode_token(const struct kvtok *t, int32_t id, char *buf, size_t cap)
{
    if (!t || id < 0 || id >= t->n_tokens)
        return -1;
    size_t len = t->dec_off[id + 1] - t->dec_off[id];
    if (buf && cap)
        memcpy(buf, t->dec + t->dec_off[id], len < cap ? len : cap);
    return (long)len;
}

/* ---- From a GGUF file ------------------------------------------------------------------- */

static int str_is(struct kvgguf_str s, const char *lit)
{
    size_t n = strlen(lit);
    return s.n == n && memcmp(s.s, lit, n) == 0;
}

static enum kvcap_status gguf_str_array(const struct kvgguf_file *f, const char *key,
                                        struct kvgguf_str **out, int64_t *n_out)
{
    enum kvgguf_type type;
    uint64_t n;
    KVCAP_TRY(kvgguf_get_array(f, key, &type, &n));
    KVCAP_RETURN_IF(type != KVGGUF_STRING, KVCAP_ERR_FORMAT,
                    "%s: %s is an array of type %d, not of strings", kvgguf_path(f), key,
                    (int)type);
    KVCAP_RETURN_IF(n > INT32_MAX, KVCAP_ERR_FORMAT, "%s: %s has %llu entries", kvgguf_path(f),
                    key, (unsigned long long)n);
    struct kvgguf_str *a = malloc((n ? n : 1) * sizeof *a);
    KVCAP_RETURN_IF(!a, KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory reading %s",
                    kvgguf_path(f), key);
    for (uint64_t i = 0; i < n; i++) {
        enum kvcap_status st = kvgguf_array_str(f, key, i, &a[i]);
        if (st != KVCAP_OK) {
            free(a);
            return st;
        }
    }
    *out = a;
    *n_out = (int64_t)n;
    return KVCAP_OK;
}

static enum kvcap_status gguf_token_id(const struct kvgguf_file *f, const char *key,
                                       int64_t n_tokens, int32_t *out)
{
    *out = -1;
    if (!kvgguf_has(f, key))
        return KVCAP_OK;
    int64_t id;
    KVCAP_TRY(kvgguf_get_i64(f, key, &id));
    KVCAP_RETURN_IF(id < 0 || id >= n_tokens, KVCAP_ERR_FORMAT,
                    "%s: %s is %lld, outside the %lld tokens", kvgguf_path(f), key,
                    (long long)id, (long long)n_tokens);
    *out = (int32_t)id;
    return KVCAP_OK;
}

enum kvcap_status kvtok_create_gguf(const struct kvgguf_file *f, struct kvtok **out)
{
    KVCAP_RETURN_IF(!out, KVCAP_ERR_INVALID_ARGUMENT, "kvtok_create_gguf: out is NULL");
    *out = NULL;
    KVCAP_RETURN_IF(!f, KVCAP_ERR_INVALID_ARGUMENT, "kvtok_create_gguf: file is NULL");
    const char *path = kvgguf_path(f);

    struct kvgguf_str model;
    KVCAP_TRY(kvgguf_get_str(f, "tokenizer.ggml.model", &model));
    KVCAP_RETURN_IF(!str_is(model, "gpt2"), KVCAP_ERR_UNSUPPORTED,
                    "%s: tokenizer.ggml.model is '%.*s'; only 'gpt2' (byte-level BPE) is "
                    "supported",
                    path, (int)(model.n < KVTOK_SHOW ? model.n : KVTOK_SHOW), model.s);

    /* llama.cpp knows the GPT-2 pre-tokenizer as "gpt-2", and gives "default" (and a missing
     * key) a list of four regexes of its own; here both mean the GPT-2 regex. */
    struct kvtok_vocab v = {0};
    v.pre = KVTOK_PRE_GPT2;
    if (kvgguf_has(f, "tokenizer.ggml.pre")) {
        struct kvgguf_str pre;
        KVCAP_TRY(kvgguf_get_str(f, "tokenizer.ggml.pre", &pre));
        if (str_is(pre, "smollm") || str_is(pre, "starcoder") || str_is(pre, "refact"))
            v.pre = KVTOK_PRE_SMOLLM;
        else if (!str_is(pre, "gpt2") && !str_is(pre, "gpt-2") && !str_is(pre, "default"))
            return kvcap_fail(KVCAP_ERR_UNSUPPORTED,
                              "%s: tokenizer.ggml.pre is '%.*s'; supported: smollm, starcoder, "
                              "refact, gpt2, gpt-2, default",
                              path, (int)(pre.n < KVTOK_SHOW ? pre.n : KVTOK_SHOW), pre.s);
    }

    struct kvgguf_str *tokens = NULL, *merges = NULL;
    int32_t *types = NULL;
    enum kvcap_status st = gguf_str_array(f, "tokenizer.ggml.tokens", &tokens, &v.n_tokens);
    if (st == KVCAP_OK)
        st = gguf_str_array(f, "tokenizer.ggml.merges", &merges, &v.n_merges);
    if (st == KVCAP_OK && kvgguf_has(f, "tokenizer.ggml.token_type")) {
        enum kvgguf_type type;
        uint64_t n;
        st = kvgguf_get_array(f, "tokenizer.ggml.token_type", &type, &n);
        if (st == KVCAP_OK && n != (uint64_t)v.n_tokens)
            st = kvcap_fail(KVCAP_ERR_FORMAT,
                            "%s: tokenizer.ggml.token_type has %llu entries for %lld tokens",
                            path, (unsigned long long)n, (long long)v.n_tokens);
        if (st == KVCAP_OK && !(types = malloc((n ? n : 1) * sizeof *types)))
            st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
        if (st == KVCAP_OK)
            st = kvgguf_array_i32(f, "tokenizer.ggml.token_type", types, n);
    }
    if (st == KVCAP_OK)
        st = gguf_token_id(f, "tokenizer.ggml.bos_token_id", v.n_tokens, &v.bos);
    if (st == KVCAP_OK)
        st = gguf_token_id(f, "tokenizer.ggml.eos_token_id", v.n_tokens, &v.eos);
    if (st == KVCAP_OK) {
        v.tokens = tokens;
        v.types = types;
        v.merges = merges;
        kvcap_quiet_push();
        st = kvtok_create(&v, out);
        kvcap_quiet_pop();
        if (st != KVCAP_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", kvcap_last_error());
            st = kvcap_fail(st, "%s: %s", path, msg);
        }
    }
    free(tokens);
    free(merges);
    free(types);
    return st;
}

/* ---- Encoding --------------------------------------------------------------------------- */

struct bpe_sym {
    int32_t id; /* symbol id, -1 for a byte whose character is no symbol */
    int32_t prev, next;
    int32_t len; /* bytes; 0 once merged into the symbol on its left */
};

struct bigram {
    int32_t rank;
    int32_t left, right; /* positions in the word */
    int32_t lid, rid;    /* the symbols they held when queued (stale entries are skipped) */
    int32_t result;
};

/* Per-call state: the tokenizer itself is read-only, so calls may run concurrently. */
struct enc {
    const struct kvtok *t;
    int32_t *ids;
    size_t n_ids, cap;
    pcre2_match_data *md;
    struct bpe_sym *sym;
    struct bigram *heap;
    size_t heap_n, word_cap;
};

static enum kvcap_status emit(struct enc *e, int32_t id)
{
    if (e->n_ids == e->cap) {
        size_t cap = e->cap * 2;
        int32_t *ids = cap > e->cap ? realloc(e->ids, cap * sizeof *ids) : NULL;
        KVCAP_RETURN_IF(!ids, KVCAP_ERR_OUT_OF_MEMORY, "tokenizer: out of memory (%zu ids)",
                        e->n_ids);
        e->ids = ids;
        e->cap = cap;
    }
    e->ids[e->n_ids++] = id;
    return KVCAP_OK;
}

static inline int bigram_before(const struct bigram *a, const struct bigram *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(struct enc *e, struct bigram b)
{
    size_t i = e->heap_n++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!bigram_before(&b, &e->heap[up]))
            break;
        e->heap[i] = e->heap[up];
        i = up;
    }
    e->heap[i] = b;
}

static struct bigram heap_pop(struct enc *e)
{
    struct bigram top = e->heap[0], last = e->heap[--e->heap_n];
    size_t i = 0, n = e->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && bigram_before(&e->heap[c + 1], &e->heap[c]))
            c++;
        if (!bigram_before(&e->heap[c], &last))
            break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n)
        e->heap[i] = last;
    return top;
}

static void queue_pair(struct enc *e, int32_t l, int32_t r)
{
    if (l < 0 || r < 0 || e->sym[l].id < 0 || e->sym[r].id < 0)
        return;
    const struct pair *p = pair_find(e->t, e->sym[l].id, e->sym[r].id);
    if (p)
        heap_push(e, (struct bigram){p->rank, l, r, e->sym[l].id, e->sym[r].id, p->result});
}

/* Merges one pre-token (raw bytes) as llama.cpp's llm_tokenizer_bpe_session does: the lowest
 * rank first, the leftmost among equal ranks, until no adjacent pair has a rank. */
static enum kvcap_status bpe_word(struct enc *e, const unsigned char *w, size_t n)
{
    const struct kvtok *t = e->t;
    if (n == 1)
        return t->byte_tok[w[0]] >= 0 ? emit(e, t->byte_tok[w[0]]) : KVCAP_OK;
    if (n == 0)
        return KVCAP_OK;
    KVCAP_RETURN_IF(n > KVTOK_MAX_WORD, KVCAP_ERR_UNSUPPORTED,
                    "tokenizer: a pre-token of %zu bytes (at most %d)", n, KVTOK_MAX_WORD);
    if (n > e->word_cap) {
        size_t cap = n > 2 * e->word_cap ? n : 2 * e->word_cap;
        struct bpe_sym *sym = realloc(e->sym, cap * sizeof *sym);
        if (sym)
            e->sym = sym;
        /* Every merge queues at most two pairs: 3n entries cover a whole word. */
        struct bigram *heap = sym ? realloc(e->heap, 3 * cap * sizeof *heap) : NULL;
        KVCAP_RETURN_IF(!heap, KVCAP_ERR_OUT_OF_MEMORY,
                        "tokenizer: out of memory (a pre-token of %zu bytes)", n);
        e->heap = heap;
        e->word_cap = cap;
    }
    struct bpe_sym *sym = e->sym;
    for (size_t i = 0; i < n; i++)
        sym[i] = (struct bpe_sym){t->byte_sym[w[i]], (int32_t)i - 1,
                                  i + 1 < n ? (int32_t)i + 1 : -1, 1};
    e->heap_n = 0;
    for (size_t i = 1; i < n; i++)
        queue_pair(e, (int32_t)i - 1, (int32_t)i);
    while (e->heap_n) {
        struct bigram b = heap_pop(e);
        struct bpe_sym *L = &sym[b.left], *R = &sym[b.right];
        /* A symbol's text only grows, so unchanged ids mean the pair is still there. */
        if (L->len == 0 || R->len == 0 || L->id != b.lid || R->id != b.rid ||
            L->next != b.right)
            continue;
        L->id = b.result;
        L->len += R->len;
        R->len = 0;
        L->next = R->next;
        if (R->next >= 0)
            sym[R->next].prev = b.left;
        queue_pair(e, L->prev, b.left);
        queue_pair(e, b.left, L->next);
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next) {
        if (sym[i].id >= 0 && sym[i].id < t->n_tokens) {
            KVCAP_TRY(emit(e, sym[i].id));
            continue;
        }
        for (int32_t j = i; j < i + sym[i].len; j++)
            if (t->byte_tok[w[j]] >= 0)
                KVCAP_TRY(emit(e, t->byte_tok[w[j]]));
    }
    return KVCAP_OK;
}

static enum kvcap_status regex_failed(int rc)
{
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    return kvcap_fail(KVCAP_ERR_INTERNAL, "tokenizer: PCRE2 match failed (%d): %s", rc,
                      (const char *)msg);
}

/* The GPT-2 regex over one fragment (valid UTF-8): its matches and the gaps between them are
 * the pre-tokens. The fragment is the whole subject, so (?!\S) sees its end as the end. */
static enum kvcap_status split_words(struct enc *e, const char *s, size_t n)
{
    size_t pos = 0;
    while (pos < n) {
        int rc = pcre2_match(e->t->re_words, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, e->md,
                             NULL);
        if (rc == PCRE2_ERROR_NOMATCH)
            return bpe_word(e, (const unsigned char *)s + pos, n - pos);
        if (rc < 0)
            return regex_failed(rc);
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t start = ov[0], end = ov[1];
        KVCAP_RETURN_IF(end <= start, KVCAP_ERR_INTERNAL,
                        "tokenizer: empty pre-tokenizer match at byte %zu", start);
        if (start > pos)
            KVCAP_TRY(bpe_word(e, (const unsigned char *)s + pos, start - pos));
        KVCAP_TRY(bpe_word(e, (const unsigned char *)s + start, end - start));
        pos = end;
    }
    return KVCAP_OK;
}

/* Pre-tokenizes and merges one run of valid UTF-8. */
static enum kvcap_status encode_valid(struct enc *e, const char *s, size_t n)
{
    if (!e->t->re_digits)
        return split_words(e, s, n);
    size_t pos = 0;
    while (pos < n) {
        int rc = pcre2_match(e->t->re_digits, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, e->md,
                             NULL);
        if (rc < 0)
            return regex_failed(rc); /* the pattern matches any character */
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t end = ov[1]; /* split_words reuses the match data */
        KVCAP_RETURN_IF(ov[0] != pos || end <= pos, KVCAP_ERR_INTERNAL,
                        "tokenizer: digit split stalled at byte %zu", pos);
        if (rc == 2) /* one number character: the GPT-2 regex would keep it whole */
            KVCAP_TRY(bpe_word(e, (const unsigned char *)s + pos, end - pos));
        else
            KVCAP_TRY(split_words(e, s + pos, end - pos));
        pos = end;
    }
    return KVCAP_OK;
}

/* A text fragment: valid UTF-8 runs are pre-tokenized, each invalid byte is its byte token. */
static enum kvcap_status encode_text(struct enc *e, const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t run = 0, i = 0;
    while (i < n) {
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        size_t l = kvcap_utf8_seq_len(p + i, n - i);
        if (l) {
            i += l;
            continue;
        }
        if (i > run)
            KVCAP_TRY(encode_valid(e, s + run, i - run));
        if (e->t->byte_tok[p[i]] >= 0)
            KVCAP_TRY(emit(e, e->t->byte_tok[p[i]]));
        run = ++i;
    }
    return i > run ? encode_valid(e, s + run, i - run) : KVCAP_OK;
}

/* First occurrence of needle (nn >= 1 bytes) in hay, or NULL. */
static const char *find_bytes(const char *hay, size_t hn, const char *needle, size_t nn)
{
    while (hn >= nn) {
        const char *p = memchr(hay, needle[0], hn - nn + 1);
        if (!p)
            return NULL;
        if (memcmp(p + 1, needle + 1, nn - 1) == 0)
            return p;
        hn -= (size_t)(p - hay) + 1;
        hay = p + 1;
    }
    return NULL;
}

/* A piece of the input after the special-token split: text, or one special token. */
struct frag {
    size_t off, len;
    int32_t tok; /* -1: text */
};

struct frags {
    struct frag *a;
    size_t n, cap;
};

static int frags_push(struct frags *f, size_t off, size_t len, int32_t tok)
{
    if (f->n == f->cap) {
        size_t cap = f->cap ? 2 * f->cap : 16;
        struct frag *a = realloc(f->a, cap * sizeof *a);
        if (!a)
            return 0;
        f->a = a;
        f->cap = cap;
    }
    f->a[f->n++] = (struct frag){off, len, tok};
    return 1;
}

/* llama.cpp's tokenizer_st_partition: for each special token, longest first, every text
 * fragment is cut at each (non-overlapping, leftmost-first) occurrence. USER_DEFINED tokens
 * are cut out even without parse_special, as llama.cpp and HF tokenizers do. */
static enum kvcap_status split_special(const struct kvtok *t, const char *text, size_t len,
                                       int parse_special, struct frags *cur)
{
    struct frags next = {0};
    if (!frags_push(cur, 0, len, -1))
        return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    for (size_t k = 0; k < t->n_special; k++) {
        int32_t id = t->special[k];
        if (!parse_special && t->types[id] != KVTOK_USER_DEFINED)
            continue;
        const char *sp = t->text + t->text_off[id];
        size_t sn = t->text_off[id + 1] - t->text_off[id];
        next.n = 0;
        int ok = 1;
        for (size_t i = 0; i < cur->n && ok; i++) {
            struct frag f = cur->a[i];
            if (f.tok >= 0 || f.len < sn) {
                ok = frags_push(&next, f.off, f.len, f.tok);
                continue;
            }
            size_t at = f.off, end = f.off + f.len;
            const char *m;
            while (ok && end - at >= sn && (m = find_bytes(text + at, end - at, sp, sn)) != NULL) {
                size_t mo = (size_t)(m - text);
                if (mo > at)
                    ok = frags_push(&next, at, mo - at, -1);
                ok = ok && frags_push(&next, mo, sn, id);
                at = mo + sn;
            }
            if (ok && at < end)
                ok = frags_push(&next, at, end - at, -1);
        }
        if (!ok) {
            free(next.a);
            return kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
        }
        struct frags tmp = *cur;
        *cur = next;
        next = tmp;
    }
    free(next.a);
    return KVCAP_OK;
}

enum kvcap_status kvtok_encode(const struct kvtok *t, const char *text, size_t len,
                               int parse_special, int32_t **ids, size_t *n_ids)
{
    KVCAP_RETURN_IF(!ids || !n_ids, KVCAP_ERR_INVALID_ARGUMENT,
                    "kvtok_encode: ids or n_ids is NULL");
    *ids = NULL;
    *n_ids = 0;
    KVCAP_RETURN_IF(!t, KVCAP_ERR_INVALID_ARGUMENT, "kvtok_encode: tokenizer is NULL");
    KVCAP_RETURN_IF(!text && len, KVCAP_ERR_INVALID_ARGUMENT, "kvtok_encode: text is NULL");

    struct enc e = {.t = t, .cap = len / 3 + 16};
    struct frags fr = {0};
    enum kvcap_status st = KVCAP_OK;
    e.ids = malloc(e.cap * sizeof *e.ids);
    e.md = pcre2_match_data_create(3, NULL);
    if (!e.ids || !e.md) {
        st = kvcap_fail(KVCAP_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
        goto done;
    }
    if (len == 0)
        goto done;
    st = split_special(t, text, len, parse_special, &fr);
    for (size_t i = 0; st == KVCAP_OK && i < fr.n; i++)
        st = fr.a[i].tok >= 0 ? emit(&e, fr.a[i].tok)
                              : encode_text(&e, text + fr.a[i].off, fr.a[i].len);
done:
    free(fr.a);
    free(e.sym);
    free(e.heap);
    pcre2_match_data_free(e.md);
    if (st != KVCAP_OK) {
        free(e.ids);
        return st;
    }
    *ids = e.ids;
    *n_ids = e.n_ids;
    return KVCAP_OK;
}
