/*
 * ops_avx2.c - AVX2+FMA versions of the CPU layers whose scalar loops showed in a profile
 * of the trainer's step: GELU (glibc's tanhf, scalar, was a third of a 4 x 256 step) and
 * causal attention (dot products over a head, one accumulator, no vectors). ops.c calls
 * them where the CPU has AVX2 and FMA; the scalar functions there stay the references, and
 * tests/test_train_ops.c runs both on the same input and compares them.
 *
 * The whole file is compiled for AVX2+FMA (the pragma below) and nothing in it may run
 * before ops.c has checked the CPU.
 *
 * Same bits for any thread count: GELU walks fixed blocks of 8 elements and takes the last,
 * short block with a masked load and store, so every element goes through the same
 * instructions wherever a thread's share begins; attention gives each (b,h) to one thread.
 *
 * tanh and exp here are not libm's: exp is a Cody-Waite reduction to [-ln2/2, ln2/2] and a
 * degree-7 polynomial; tanh is its Taylor series below |u| = 0.5625 and 1 - 2/(e^2|u| + 1)
 * above. Both stay within a few ulp of libm (the test says how many); NaN and infinity
 * pass through as libm's do.
 *
 * Not here: anything that needs no vectors to be fast, any GPU code.
 */
#pragma GCC target("avx2,fma")

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "train/ops.h"

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_CUBE 0.044715f
#define GELU_BLOCKS_PER_TASK 512 /* 4096 elements per thread task */

/* e^x for x <= 20 (callers clamp); x < -87.3 gives e^-87.3 (callers never need less). */
static inline __m256 exp_ps(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.3f);
    x = _mm256_max_ps(lo, x); /* NaN stays NaN: max_ps returns its second operand then */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, ln2 split so that n * hi is exact. */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n by building the exponent; n is in [-126, 29] after the clamps. */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The coefficients of tanh u = u + u^3 (c3 + u^2 (c5 + ...)) up to u^19: at |u| < 0.5625
 * the first term left out is below 1e-9 of the result. */
static const float tanh_c[9] = {
    -0.333333333333333333f,  0.133333333333333333f,  -0.0539682539682539683f,
    0.0218694885361552028f,  -0.00886323552990219657f, 0.00359212803657248102f,
    -0.00145583438705131827f, 0.000590027440945585981f, -0.000239129114243552481f,
};

static inline __m256 tanh_ps(__m256 u)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, u);
    a = _mm256_min_ps(_mm256_set1_ps(10.0f), a); /* tanh 10 rounds to 1; NaN stays NaN */
    __m256 e = exp_ps(_mm256_add_ps(a, a));
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    __m256 s = _mm256_mul_ps(a, a);
    __m256 p = _mm256_set1_ps(tanh_c[8]);
    for (int k = 7; k >= 0; k--)
        p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(tanh_c[k]));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, s), a, a);
    __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.5625f), _CMP_LT_OQ));
    return _mm256_or_ps(t, _mm256_and_ps(sign, u));
}

/* Lanes [0, n) of a block of 8 (n <= 8): the mask for maskload/maskstore. */
static inline __m256i lanes(size_t n)
{
    static const int32_t ramp[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i *)(ramp + 8 - n));
}

static inline __m256 gelu_u(__m256 x)
{
    __m256 x2 = _mm256_mul_ps(x, x);
    __m256 inner = _mm256_fmadd_ps(_mm256_set1_ps(GELU_CUBE), x2, _mm256_set1_ps(1.0f));
    return _mm256_mul_ps(_mm256_set1_ps(GELU_SCALE), _mm256_mul_ps(x, inner));
}

void ops_gelu_forward_avx2(float *out, const float *inp, size_t n)
{
    size_t nblk = (n + 7) / 8;
#pragma omp parallel for schedule(static, GELU_BLOCKS_PER_TASK)
    for (size_t blk = 0; blk < nblk; blk++) {
        size_t i = blk * 8, m = n - i < 8 ? n - i : 8;
        __m256i k = lanes(m);
        __m256 x = _mm256_maskload_ps(inp + i, k);
        __m256 th = tanh_ps(gelu_u(x));
        __m256 half_x = _mm256_mul_ps(_mm256_set1_ps(0.5f), x);
        _mm256_maskstore_ps(out + i, k, _mm256_fmadd_ps(half_x, th, half_x));
    }
}

void ops_gelu_backward_avx2(float *d, const float *inp, size_t n)
{
    size_t nblk = (n + 7) / 8;
#pragma omp parallel for schedule(static, GELU_BLOCKS_PER_TASK)
    for (size_t blk = 0; blk < nblk; blk++) {
        size_t i = blk * 8, m = n - i < 8 ? n - i : 8;
        __m256i k = lanes(m);
        __m256 x = _mm256_maskload_ps(inp + i, k);
        __m256 th = tanh_ps(gelu_u(x));
        __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
        __m256 x2 = _mm256_mul_ps(x, x);
        __m256 du = _mm256_mul_ps(_mm256_set1_ps(GELU_SCALE),
                                  _mm256_fmadd_ps(_mm256_set1_ps(3.0f * GELU_CUBE), x2, one));
        /* 0.5 (1 + th) + 0.5 x (1 - th^2) du */
        __m256 sech2 = _mm256_fnmadd_ps(th, th, one);
        __m256 g = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(half, x), sech2), du,
                                   _mm256_mul_ps(half, _mm256_add_ps(one, th)));
        _mm256_maskstore_ps(d + i, k, _mm256_mul_ps(_mm256_maskload_ps(d + i, k), g));
    }
}

/* ---- attention: hs a multiple of 8 ----------------------------------------------------- */

static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* a . b over n (a multiple of 8), two accumulators in a fixed pairing. */
static inline float dot(const float *a, const float *b, size_t n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    size_t e = 0;
    for (; e + 16 <= n; e += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e + 8), _mm256_loadu_ps(b + e + 8), s1);
    }
    if (e < n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), s0);
    return hsum(_mm256_add_ps(s0, s1));
}

/* y (n) += a x (n), n a multiple of 8. */
static inline void axpy(float *y, float a, const float *x, size_t n)
{
    __m256 va = _mm256_set1_ps(a);
    for (size_t e = 0; e < n; e += 8)
        _mm256_storeu_ps(y + e, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + e), _mm256_loadu_ps(y + e)));
}

/* row[0..n) = e^(row - mx), returning their sum (8 lanes, then the lanes in order). */
static inline float exp_row(float *row, float mx, size_t n)
{
    __m256 vmx = _mm256_set1_ps(mx), s = _mm256_setzero_ps();
    for (size_t j = 0; j < n; j += 8) {
        size_t m = n - j < 8 ? n - j : 8;
        __m256i k = lanes(m);
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_maskload_ps(row + j, k), vmx));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(k));
        _mm256_maskstore_ps(row + j, k, e);
        s = _mm256_add_ps(s, e);
    }
    return hsum(s);
}

void ops_attention_forward_avx2(float *y, float *att, const float *qkv, size_t B, size_t T,
                                size_t C, size_t NH)
{
    size_t hs = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for collapse(2) schedule(static)
    for (size_t b = 0; b < B; b++) {
        for (size_t h = 0; h < NH; h++) {
            const float *base = qkv + b * T * C3 + h * hs;
            float *att_bh = att + (b * NH + h) * T * T;
            for (size_t i = 0; i < T; i++) {
                const float *q = base + i * C3;
                float *row = att_bh + i * T;
                float mx = -INFINITY;
                for (size_t j = 0; j <= i; j++) {
                    float s = dot(q, base + j * C3 + C, hs) * scale;
                    row[j] = s;
                    if (s > mx) mx = s;
                }
                float inv = 1.0f / exp_row(row, mx, i + 1);
                for (size_t j = 0; j <= i; j++)
                    row[j] *= inv;
                if (i + 1 < T) memset(row + i + 1, 0, (T - i - 1) * sizeof(float));
                float *out = y + (b * T + i) * C + h * hs;
                memset(out, 0, hs * sizeof(float));
                for (size_t j = 0; j <= i; j++)
                    axpy(out, row[j], base + j * C3 + 2 * C, hs);
            }
        }
    }
}

void ops_attention_backward_avx2(float *d_qkv, float *d_row, const float *d_y, const float *qkv,
                                 const float *att, size_t B, size_t T, size_t C, size_t NH)
{
    size_t hs = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);
    memset(d_qkv, 0, B * T * C3 * sizeof(float));
#pragma omp parallel for collapse(2) schedule(static)
    for (size_t b = 0; b < B; b++) {
        for (size_t h = 0; h < NH; h++) {
            const float *base = qkv + b * T * C3 + h * hs;
            float *dbase = d_qkv + b * T * C3 + h * hs;
            const float *att_bh = att + (b * NH + h) * T * T;
            float *datt = d_row + (b * NH + h) * T;
            for (size_t i = 0; i < T; i++) {
                const float *dy = d_y + (b * T + i) * C + h * hs;
                const float *row = att_bh + i * T;
                float dot_sum = 0.0f;
                for (size_t j = 0; j <= i; j++) {
                    float dd = dot(dy, base + j * C3 + 2 * C, hs);
                    axpy(dbase + j * C3 + 2 * C, row[j], dy, hs);
                    datt[j] = dd;
                    dot_sum += row[j] * dd;
                }
                const float *q = base + i * C3;
                float *dq = dbase + i * C3;
                for (size_t j = 0; j <= i; j++) {
                    float dpre = row[j] * (datt[j] - dot_sum) * scale;
                    axpy(dq, dpre, base + j * C3 + C, hs);
                    axpy(dbase + j * C3 + C, dpre, q, hs);
                }
            }
        }
    }
}
