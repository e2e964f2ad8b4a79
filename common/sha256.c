/* sha256.c — SHA-256 as FIPS 180-4 states it, one 64-byte block at a time; checked against the
 * standard's test vectors in tests/test_common.c. */
#include <string.h>

#include "common/sha256.h"

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void block(uint32_t h[8], const unsigned char *p)
{
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 |
               (uint32_t)p[4 * t + 2] << 8 | (uint32_t)p[4 * t + 3];
    for (int t = 16; t < 64; t++) {
        const uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
        const uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int t = 0; t < 64; t++) {
        const uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                            K[t] + w[t];
        const uint32_t t2 =
            (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

void kvcap_sha256_init(struct kvcap_sha256 *s)
{
    static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, H0, sizeof H0);
    s->bytes = 0;
}

void kvcap_sha256_update(struct kvcap_sha256 *s, const void *data, size_t len)
{
    const unsigned char *p = data;
    size_t have = (size_t)(s->bytes % 64);
    s->bytes += len;
    if (have) {
        const size_t take = len < 64 - have ? len : 64 - have;
        memcpy(s->buf + have, p, take);
        p += take, len -= take, have += take;
        if (have < 64)
            return;
        block(s->h, s->buf);
    }
    for (; len >= 64; p += 64, len -= 64)
        block(s->h, p);
    memcpy(s->buf, p, len);
}

/* n 4-byte words (int32 or float, read through memcpy) little-endian, through a small buffer
 * so that a long array costs few update calls. */
static void update_words_le(struct kvcap_sha256 *s, const void *v, size_t n)
{
    const unsigned char *p = v;
    unsigned char b[256];
    while (n > 0) {
        const size_t m = n < sizeof b / 4 ? n : sizeof b / 4;
        for (size_t i = 0; i < m; i++) {
            uint32_t w;
            memcpy(&w, p + 4 * i, 4);
            b[4 * i] = (unsigned char)w, b[4 * i + 1] = (unsigned char)(w >> 8);
            b[4 * i + 2] = (unsigned char)(w >> 16), b[4 * i + 3] = (unsigned char)(w >> 24);
        }
        kvcap_sha256_update(s, b, 4 * m);
        p += 4 * m, n -= m;
    }
}

void kvcap_sha256_update_i32le(struct kvcap_sha256 *s, const int32_t *v, size_t n)
{
    update_words_le(s, v, n);
}

void kvcap_sha256_update_f32le(struct kvcap_sha256 *s, const float *v, size_t n)
{
    _Static_assert(sizeof(float) == 4, "float is IEEE-754 binary32");
    update_words_le(s, v, n);
}

void kvcap_sha256_hex(struct kvcap_sha256 *s, char hex[65])
{
    const uint64_t bits = s->bytes * 8;
    unsigned char pad[72] = {0x80};
    const size_t have = (size_t)(s->bytes % 64), n = have < 56 ? 56 - have : 120 - have;
    for (int i = 0; i < 8; i++)
        pad[n + i] = (unsigned char)(bits >> (56 - 8 * i));
    kvcap_sha256_update(s, pad, n + 8);
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        const unsigned byte = s->h[i / 4] >> (24 - 8 * (i % 4)) & 0xff;
        hex[2 * i] = digits[byte >> 4], hex[2 * i + 1] = digits[byte & 15];
    }
    hex[64] = '\0';
}
