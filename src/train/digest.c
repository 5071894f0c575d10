/*
 * digest.c - the parameter digest of digest.h: each block hashed by four 64-bit lanes of
 * xor, rotate and multiply by an odd constant (every step a bijection of the word taken
 * in), the lanes and the block's length folded the same way, then a splitmix-style
 * finaliser keyed by where the block sits. Blocks are spread over the OpenMP threads; their
 * terms are added as integers, so the order does not matter.
 *
 * Not here: anything about which tensors are hashed or when.
 */
#include <string.h>

#include "train/digest.h"

#define LANE_MUL 0x9e3779b97f4a7c15ull
#define FOLD_MUL 0xc2b2ae3d27d4eb4full

static inline uint64_t rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t finalise(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* n floats (1..DIGEST_BLOCK_FLOATS). */
static uint64_t block_hash(const float *p, size_t n)
{
    uint64_t l[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull,
                     0x082efa98ec4e6c89ull};
    const unsigned char *b = (const unsigned char *)p;
    size_t words = n / 2, i = 0;
    for (; i + 4 <= words; i += 4)
        for (int k = 0; k < 4; k++) {
            uint64_t w;
            memcpy(&w, b + 8 * (i + (size_t)k), 8);
            l[k] = rotl(l[k] ^ w, 31) * LANE_MUL;
        }
    for (; i < words; i++) {
        uint64_t w;
        memcpy(&w, b + 8 * i, 8);
        l[i & 3] = rotl(l[i & 3] ^ w, 31) * LANE_MUL;
    }
    if (n & 1) {
        uint32_t w;
        memcpy(&w, b + 8 * words, 4);
        l[words & 3] = rotl(l[words & 3] ^ w, 31) * LANE_MUL;
    }
    uint64_t h = (uint64_t)n * FOLD_MUL;
    for (int k = 0; k < 4; k++)
        h = (rotl(h, 27) ^ l[k]) * FOLD_MUL;
    return h;
}

uint64_t digest_floats(const float *p, size_t n, uint32_t tensor, size_t first_block)
{
    size_t nblk = (n + DIGEST_BLOCK_FLOATS - 1) / DIGEST_BLOCK_FLOATS;
    uint64_t sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum) if (nblk >= 64)
    for (size_t k = 0; k < nblk; k++) {
        size_t off = k * DIGEST_BLOCK_FLOATS;
        size_t len = n - off < DIGEST_BLOCK_FLOATS ? n - off : DIGEST_BLOCK_FLOATS;
        uint64_t where = ((uint64_t)tensor << 40) ^ (uint64_t)(first_block + k);
        sum += finalise(block_hash(p + off, len) + where * LANE_MUL);
    }
    return sum;
}
