/*
 * half.h - fp32 to and from the 16-bit floats, one value at a time: bf16 (the top half of an
 * fp32) and IEEE binary16 (fp16), both rounded to nearest even. The trainer's casts
 * (train/ops.h) and the collectives' 16-bit wire (comm/) use them, so a value rounds the
 * same wherever it is rounded.
 */
#ifndef ZINF_HALF_H
#define ZINF_HALF_H

#include <stdint.h>

/* bf16 is the top half of an fp32; the cast rounds to nearest even (NaN stays NaN). */
static inline uint16_t bf16_from_f32(float f)
{
    union {
        float f;
        uint32_t u;
    } x = {.f = f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u);
    x.u += 0x7fffu + ((x.u >> 16) & 1u);
    return (uint16_t)(x.u >> 16);
}
static inline float bf16_to_f32(uint16_t h)
{
    union {
        uint32_t u;
        float f;
    } x = {.u = (uint32_t)h << 16};
    return x.f;
}

/* IEEE binary16 (fp16): to nearest even, overflow to infinity, subnormals kept, NaN quiet. */
static inline uint16_t half_from_f32(float f)
{
    union {
        float f;
        uint32_t u;
    } x = {.f = f};
    uint32_t sign = (x.u >> 16) & 0x8000u, a = x.u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN, quiet */
    if (a >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u); /* rounds to past 65504 (or is infinite) */
    if (a < 0x38800000u) {
        /* A subnormal half (or zero): the value in units of 2^-24, rounded to nearest even. */
        if (a < 0x33000000u)
            return (uint16_t)sign; /* below half the smallest subnormal */
        uint32_t m = (a & 0x7fffffu) | 0x800000u, e = a >> 23; /* value = m * 2^(e-150) */
        uint32_t shift = 126 - e;                                /* to units of 2^-24 */
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        q += rem > half || (rem == half && (q & 1));
        return (uint16_t)(sign | q);
    }
    uint32_t r = a - 0x38000000u; /* rebias the exponent from 127 to 15 */
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

static inline float half_to_f32(uint16_t h)
{
    union {
        uint32_t u;
        float f;
    } x;
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) {
        x.u = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        x.u = sign | ((e + 112) << 23) | (m << 13);
    } else if (m) {
        /* A subnormal: m * 2^-24, exact in fp32. */
        float v = (float)m * 0x1p-24f;
        x.f = v;
        x.u |= sign;
    } else {
        x.u = sign;
    }
    return x.f;
}

#endif
