/* rng.h — a small deterministic generator (xoshiro256**, seeded by splitmix64) so synthetic
 * data, validation splits and training are reproducible from a seed on every platform. */
#ifndef KVCAP_RNG_H
#define KVCAP_RNG_H

#include <math.h>
#include <stdint.h>

struct kvcap_rng {
    uint64_t s[4];
};

static inline uint64_t kvcap_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline void kvcap_rng_seed(struct kvcap_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        r->s[i] = kvcap_splitmix64(&seed);
}

static inline uint64_t kvcap_rng_u64(struct kvcap_rng *r)
{
    uint64_t *s = r->s;
    uint64_t t = s[1] << 17, x = s[1] * 5;
    uint64_t result = ((x << 7) | (x >> 57)) * 9;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = (s[3] << 45) | (s[3] >> 19);
    return result;
}

/* Uniform in [0, 1). */
static inline double kvcap_rng_uniform(struct kvcap_rng *r)
{
    return (double)(kvcap_rng_u64(r) >> 11) * 0x1.0p-53;
}

/* Uniform integer in [0, n), n >= 1 (the tiny modulo bias is irrelevant at our n). */
static inline uint64_t kvcap_rng_below(struct kvcap_rng *r, uint64_t n)
{
    return kvcap_rng_u64(r) % n;
}

/* Standard normal (Box–Muller; one of the pair is discarded for simplicity). */
static inline double kvcap_rng_normal(struct kvcap_rng *r)
{
    double u1 = kvcap_rng_uniform(r), u2 = kvcap_rng_uniform(r);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

#endif
