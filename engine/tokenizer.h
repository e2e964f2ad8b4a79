/* tokenizer.h — the byte-level BPE tokenizer of GPT-2-style GGUF vocabularies
 * (tokenizer.ggml.model = "gpt2"), as llama.cpp applies it: special (control) tokens split out
 * first, then the pre-tokenizer regexes of the vocabulary's `tokenizer.ggml.pre`, then rank-
 * ordered merges over the GPT-2 byte-to-unicode alphabet. Internal to kvcap's evaluation tools. */
#ifndef KVCAP_TOKENIZER_H
#define KVCAP_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "engine/gguf.h"
#include "kvcap.h"

/* Token types as GGUF stores them (tokenizer.ggml.token_type). */
enum kvtok_type {
    KVTOK_NORMAL = 1, KVTOK_UNKNOWN = 2, KVTOK_CONTROL = 3, KVTOK_USER_DEFINED = 4,
    KVTOK_UNUSED = 5, KVTOK_BYTE = 6
};

/* Pre-tokenizers (tokenizer.ggml.pre). */
enum kvtok_pre {
    KVTOK_PRE_GPT2 = 0,   /* "gpt2", "gpt-2" and "default" (or absent): the GPT-2 regex */
    KVTOK_PRE_SMOLLM = 1  /* "smollm" (also starcoder, refact): digits split one by one, then
                           * the GPT-2 regex */
};

struct kvtok_vocab {
    int64_t n_tokens;
    const struct kvgguf_str *tokens; /* token strings in the byte-to-unicode alphabet */
    const int32_t *types;            /* enum kvtok_type per token; NULL: all NORMAL */
    int64_t n_merges;
    const struct kvgguf_str *merges; /* "left right", rank = index */
    enum kvtok_pre pre;
    int32_t bos, eos;                /* -1 when absent */
};

struct kvtok;

/* Builds the tokenizer (copies what it needs). KVCAP_ERR_FORMAT naming the merge or token at
 * fault (a merge without a space, a merge part that no token or earlier merge produces, ...).
 * A merge whose result is not a token is kept, as llama.cpp does: its symbols fall back to the
 * tokens of their characters. */
enum kvcap_status kvtok_create(const struct kvtok_vocab *vocab, struct kvtok **out);
/* From a GGUF file's tokenizer.ggml.* keys (model must be "gpt2"). */
enum kvcap_status kvtok_create_gguf(const struct kvgguf_file *f, struct kvtok **out);
void kvtok_free(struct kvtok *t); /* NULL is a no-op */

int64_t kvtok_n_tokens(const struct kvtok *t);
int32_t kvtok_bos(const struct kvtok *t);
int32_t kvtok_eos(const struct kvtok *t);

/* Tokenises `len` bytes of UTF-8 `text` (invalid UTF-8 is tokenised byte by byte). With
 * `parse_special`, occurrences of CONTROL/USER_DEFINED token strings become those tokens.
 * *ids is malloc'ed (caller frees), *n_ids its length. No BOS is added. */
enum kvcap_status kvtok_encode(const struct kvtok *t, const char *text, size_t len,
                               int parse_special, int32_t **ids, size_t *n_ids);

/* The bytes token `id` stands for (byte-to-unicode undone; CONTROL tokens as their text).
 * Writes at most cap bytes and returns the full length (so a too-small buffer can be retried),
 * or -1 for an out-of-range id. */
long kvtok_decode_token(const struct kvtok *t, int32_t id, char *buf, size_t cap);

#endif /* KVCAP_TOKENIZER_H */
