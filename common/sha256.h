/* sha256.h — SHA-256 (FIPS 180-4), streamed: what binds a file to the data it was made from
 * (metrics.json's prompts_sha256, which kvpress.json must repeat). Needs nothing but libc. */
#ifndef KVCAP_SHA256_H
#define KVCAP_SHA256_H

#include <stddef.h>
#include <stdint.h>

struct kvcap_sha256 {
    uint32_t h[8];
    uint64_t bytes;         /* fed so far */
    unsigned char buf[64];  /* the block being filled: bytes % 64 of them */
};

void kvcap_sha256_init(struct kvcap_sha256 *s);
void kvcap_sha256_update(struct kvcap_sha256 *s, const void *data, size_t len);
/* n values as 4-byte little-endian words, whatever the host's byte order: what Python's
 * struct.pack("<%di") and numpy's "<f4" give, so either side can hash the same numbers. */
void kvcap_sha256_update_i32le(struct kvcap_sha256 *s, const int32_t *v, size_t n);
void kvcap_sha256_update_f32le(struct kvcap_sha256 *s, const float *v, size_t n);
/* The digest as 64 lowercase hex digits and a NUL (hashlib's hexdigest()); `s` is spent. */
void kvcap_sha256_hex(struct kvcap_sha256 *s, char hex[65]);

#endif
