/*
 * test_optim_states.c - src/train/adamw_states.c: AdamW over moments kept in bf16 or in
 * bitsandbytes' 8-bit blockwise form.
 *
 * The 8-bit map against a transcription of create_dynamic_map in double (the float32 one
 * must be within a few float ulps of it), the quantizer against a plain transcription of
 * bitsandbytes' blockwise quantization written here (absmax per block of 256, value / absmax,
 * the nearest code by a linear scan), its table against the search over the map at every
 * 16-bit prefix of a float, the round trip within half the gap between the codes
 * around each value; bf16's stochastic rounding between the two neighbours, unbiased, never
 * negative for a non-negative value, never infinite; and the update: fp32 states as
 * adamw_update's bits, the compressed ones the same bits for 1 and 2 threads and for a
 * tensor updated whole or in two parts (a ZeRO cut), and within a stated distance of fp32's
 * after a few steps.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "train/adamw.h"
#include "train/adamw_states.h"
#include "train/ops.h"

TestSuite(optim_states, .fini = test_leak_check);

static float urand(uint64_t *s) /* uniform in [-1, 1) */
{
    return (float)((double)(test_rand(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* create_dynamic_map(signed, 7, 8) in double: the reference the float32 map is held to. */
static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void map_double(int is_signed, double out[256])
{
    int k = 0;
    for (int i = 0; i < 7; i++) {
        int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
        double scale = pow(10.0, -6 + i);
        for (int j = 0; j + 1 < items; j++) {
            double a = 0.1 + 0.9 * j / (items - 1), b = 0.1 + 0.9 * (j + 1) / (items - 1);
            out[k++] = scale * (a + b) / 2;
            if (is_signed) out[k++] = -scale * (a + b) / 2;
        }
    }
    out[k++] = 0;
    out[k++] = 1;
    cr_assert_eq(k, 256);
    qsort(out, 256, sizeof(double), cmp_double);
}

Test(optim_states, dynamic_map_is_bitsandbytes)
{
    for (int s = 0; s < 2; s++) {
        const float *map = adamw_q8_map(s);
        double ref[256];
        map_double(s, ref);
        for (int i = 0; i < 256; i++) {
            cr_expect(fabs(map[i] - ref[i]) <= 4 * FLT_EPSILON * fabs(ref[i]),
                      "%s map[%d] = %.9g, create_dynamic_map's %.12g", s ? "signed" : "unsigned", i,
                      map[i], ref[i]);
            if (i) cr_expect(map[i] > map[i - 1], "the map is not increasing at %d", i);
        }
        cr_expect_eq(map[255], 1.0f);
        if (!s) cr_expect_eq(map[0], 0.0f);
    }
    /* The signed map's extremes: 1 at the top, -(1 - 0.9 / 128) at the bottom. */
    cr_expect(fabsf(adamw_q8_map(1)[0] + 0.99296875f) < 1e-6f);
}

/* bitsandbytes' blockwise quantization as its definition reads, written here apart from
 * the library: each block's absmax, each value divided by it, the nearest code by scanning
 * them all (the first of two as near). */
static void ref_quantize(const float *x, size_t n, int is_signed, uint8_t *codes, float *absmax)
{
    const float *map = adamw_q8_map(is_signed);
    for (size_t b = 0; b * ADAMW_Q8_BLOCK < n; b++) {
        size_t i0 = b * ADAMW_Q8_BLOCK, i1 = n < i0 + ADAMW_Q8_BLOCK ? n : i0 + ADAMW_Q8_BLOCK;
        float mx = 0;
        for (size_t i = i0; i < i1; i++)
            mx = fmaxf(mx, fabsf(x[i]));
        absmax[b] = mx;
        for (size_t i = i0; i < i1; i++) {
            float y = mx > 0 ? x[i] / mx : 0.0f;
            int best = 0;
            for (int c = 1; c < 256; c++)
                if (fabsf(map[c] - y) < fabsf(map[best] - y)) best = c;
            codes[i] = (uint8_t)best;
        }
    }
}

Test(optim_states, q8_matches_reference_and_round_trips)
{
    const size_t n = 256 * 7 + 45; /* a ragged last block */
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    uint8_t *c = malloc(n), *rc = malloc(n);
    float s[8], rs[8];
    uint64_t seed = 11;
    for (int is_signed = 0; is_signed < 2; is_signed++) {
        for (size_t i = 0; i < n; i++) {
            /* magnitudes over eight decades, as Adam's moments spread */
            float u = urand(&seed), e = powf(10.0f, -8.0f * fabsf(urand(&seed)));
            x[i] = (is_signed ? u : fabsf(u)) * e;
        }
        for (size_t i = 512; i < 768; i++) /* a block of zeros */
            x[i] = 0;
        adamw_q8_quantize(x, n, is_signed, c, s);
        ref_quantize(x, n, is_signed, rc, rs);
        cr_assert(!memcmp(s, rs, sizeof(float) * 8), "absmax differs from the reference");
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(c[i], rc[i], "%s x[%zu] = %g: code %d, the reference's %d",
                         is_signed ? "signed" : "unsigned", i, x[i], c[i], rc[i]);
        adamw_q8_dequantize(c, s, n, is_signed, y);
        const float *map = adamw_q8_map(is_signed);
        for (size_t i = 0; i < n; i++) {
            float a = s[i / ADAMW_Q8_BLOCK];
            if (a == 0) {
                cr_assert_eq(y[i], 0.0f);
                continue;
            }
            /* within half the gap between the codes on either side of x / absmax */
            float v = x[i] / a;
            int k = 0;
            while (k < 255 && map[k + 1] < v)
                k++;
            float gap = k < 255 ? map[k + 1] - map[k] : 0;
            cr_assert(fabsf(y[i] - x[i]) <= (gap / 2) * a * (1 + 1e-5f) + 1e-30f,
                      "x[%zu] = %g came back %g (absmax %g, gap %g)", i, x[i], y[i], a, gap);
            if (!is_signed) cr_assert(y[i] >= 0);
        }
    }
    free(x);
    free(y);
    free(c);
    free(rc);
}

Test(optim_states, bf16_stochastic_rounding)
{
    float x = 1.0f + 3.0f / 512; /* 3/4 of the way from bf16's 1 to the next, 1 + 1/128 */
    uint16_t lo = ops_f32_to_bf16(1.0f), hi = lo + 1;
    double sum = 0;
    const int N = 1 << 16;
    for (int i = 0; i < N; i++) {
        uint16_t b = adamw_bf16_stochastic(x, adamw_state_bits(5, 3, 1, (uint64_t)i));
        cr_assert(b == lo || b == hi, "%04x is neither neighbour", b);
        sum += ops_bf16_to_f32(b);
    }
    cr_expect(fabs(sum / N - x) < 2e-4, "mean %.9g for %.9g: biased", sum / N, x);
    /* never negative, never infinite, zero stays zero, exact values stay */
    uint64_t s = 3;
    for (int i = 0; i < 100000; i++) {
        float v = fabsf(urand(&s)) * powf(10.0f, -30.0f * fabsf(urand(&s)));
        float r = ops_bf16_to_f32(adamw_bf16_stochastic(v, (uint32_t)test_rand(&s)));
        cr_assert(r >= 0 && r >= v * (1 - 1.0f / 128) && r <= v * (1 + 1.0f / 128), "%g -> %g", v,
                  r);
    }
    cr_expect_eq(ops_bf16_to_f32(adamw_bf16_stochastic(FLT_MAX, 0xffff)), ops_bf16_to_f32(0x7f7f));
    cr_expect_eq(adamw_bf16_stochastic(0.0f, 0xffff), 0);
    cr_expect_eq(adamw_bf16_stochastic(-2.0f, 0xffff), ops_f32_to_bf16(-2.0f));
    cr_expect(isnan(ops_bf16_to_f32(adamw_bf16_stochastic(NAN, 0x1234))));
}

/* Random parameters and gradients, zero moments in the dtype's layout for cap elements. */
struct run {
    size_t n;
    float *p, *g;
    void *m, *v;
};

static struct run run_new(size_t n, enum adamw_state_dtype dt, uint64_t seed)
{
    struct run r = {.n = n,
                    .p = malloc(n * sizeof(float)),
                    .g = malloc(n * sizeof(float)),
                    .m = calloc(1, adamw_state_bytes(dt, n)),
                    .v = calloc(1, adamw_state_bytes(dt, n))};
    for (size_t i = 0; i < n; i++)
        r.p[i] = urand(&seed) * 0.1f;
    return r;
}

static void run_free(struct run *r)
{
    free(r->p);
    free(r->g);
    free(r->m);
    free(r->v);
}

static void grads(struct run *r, int step)
{
    uint64_t s = 1000 + (uint64_t)step;
    for (size_t i = 0; i < r->n; i++)
        r->g[i] = urand(&s) * (i % 3 ? 1e-2f : 1e-4f);
}

static const struct adamw_hparams hp = {
    .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};

static int steps(struct run *r, enum adamw_state_dtype dt, int k, size_t from, size_t to,
                 size_t cap)
{
    struct adamw_state_at at = {.seed = 42, .tensor = 7, .first = from, .cap = cap};
    return adamw_update_states(dt, r->p + from, r->g + from, r->m, r->v, NULL, to - from, &at, &hp,
                               k, 0.5f);
}

Test(optim_states, fp32_is_adamw_update)
{
    const size_t n = 3001;
    struct run a = run_new(n, ADAMW_STATE_FP32, 1), b = run_new(n, ADAMW_STATE_FP32, 1);
    for (int k = 1; k <= 3; k++) {
        grads(&a, k);
        grads(&b, k);
        cr_assert_eq(steps(&a, ADAMW_STATE_FP32, k, 0, n, n), 0);
        cr_assert_eq(adamw_update(b.p, b.g, b.m, b.v, n, &hp, k, 0.5f), 0);
    }
    cr_expect(!memcmp(a.p, b.p, n * 4) && !memcmp(a.m, b.m, n * 4) && !memcmp(a.v, b.v, n * 4));
    run_free(&a);
    run_free(&b);
}

/* 1 and 2 threads; whole against two parts cut at a block boundary, each part its own
 * buffers (as two ranks' shards). */
Test(optim_states, compressed_bits_do_not_depend_on_threads_or_cut)
{
    const size_t n = (1 << 17) + 777, cut = (1 << 16) + 1024; /* large enough for threads */
    for (int d = ADAMW_STATE_BF16; d <= ADAMW_STATE_Q8; d++) {
        enum adamw_state_dtype dt = (enum adamw_state_dtype)d;
        struct run one = run_new(n, dt, 2), two = run_new(n, dt, 2);
        struct run lo = run_new(cut, dt, 2), hi = run_new(n - cut, dt, 2);
        float *pw = malloc(n * sizeof(float)), *gw = malloc(n * sizeof(float));
        memcpy(pw, one.p, n * sizeof(float));
        for (int k = 1; k <= 3; k++) {
            grads(&one, k);
            grads(&two, k);
            omp_set_num_threads(1);
            cr_assert_eq(steps(&one, dt, k, 0, n, n), 0);
            omp_set_num_threads(2);
            cr_assert_eq(steps(&two, dt, k, 0, n, n), 0);
            /* the parts: their parameters and gradients from the whole's place */
            memcpy(gw, two.g, n * sizeof(float));
            struct adamw_state_at a0 = {.seed = 42, .tensor = 7, .first = 0, .cap = cut},
                                  a1 = {.seed = 42, .tensor = 7, .first = cut, .cap = n - cut};
            cr_assert_eq(adamw_update_states(dt, pw, gw, lo.m, lo.v, NULL, cut, &a0, &hp, k, 0.5f),
                         0);
            cr_assert_eq(adamw_update_states(dt, pw + cut, gw + cut, hi.m, hi.v, NULL, n - cut, &a1,
                                             &hp, k, 0.5f),
                         0);
        }
        cr_expect(!memcmp(one.p, two.p, n * 4), "%s: 1 and 2 threads differ",
                  adamw_state_dtype_name(dt));
        cr_expect(!memcmp(one.m, two.m, adamw_state_bytes(dt, n)));
        cr_expect(!memcmp(one.p, pw, n * 4), "%s: the whole and its two parts differ",
                  adamw_state_dtype_name(dt));
        /* the parts' states are the whole's: decoded, the same values */
        float *wm = malloc(n * 4), *pm = malloc(n * 4);
        if (dt == ADAMW_STATE_BF16) {
            ops_cast_bf16_to_f32(wm, one.m, n);
            ops_cast_bf16_to_f32(pm, lo.m, cut);
            ops_cast_bf16_to_f32(pm + cut, hi.m, n - cut);
        } else {
            adamw_q8_dequantize(one.m, (const float *)((char *)one.m + ((n + 3) & ~(size_t)3)), n,
                                1, wm);
            adamw_q8_dequantize(lo.m, (const float *)((char *)lo.m + cut), cut, 1, pm);
            adamw_q8_dequantize(hi.m, (const float *)((char *)hi.m + ((n - cut + 3) & ~(size_t)3)),
                                n - cut, 1, pm + cut);
        }
        cr_expect(!memcmp(wm, pm, n * 4), "%s: m of the parts is not the whole's",
                  adamw_state_dtype_name(dt));
        free(wm);
        free(pm);
        free(pw);
        free(gw);
        run_free(&one);
        run_free(&two);
        run_free(&lo);
        run_free(&hi);
    }
}

/* 30 steps: each compressed run's parameters against fp32 states', relative to how far the
 * fp32 run moved them (bf16: 1%; int8: 8%: gradients of two magnitudes 100x apart share
 * its blocks, and the small ones' moments are coarse beside the block's absmax). */
Test(optim_states, compressed_close_to_fp32)
{
    const size_t n = 5000;
    struct run f = run_new(n, ADAMW_STATE_FP32, 3);
    float *p0 = malloc(n * 4);
    memcpy(p0, f.p, n * 4);
    for (int k = 1; k <= 30; k++) {
        grads(&f, k);
        cr_assert_eq(steps(&f, ADAMW_STATE_FP32, k, 0, n, n), 0);
    }
    const double tol[] = {0, 0.01, 0.08};
    for (int d = ADAMW_STATE_BF16; d <= ADAMW_STATE_Q8; d++) {
        struct run c = run_new(n, (enum adamw_state_dtype)d, 3);
        for (int k = 1; k <= 30; k++) {
            grads(&c, k);
            cr_assert_eq(steps(&c, (enum adamw_state_dtype)d, k, 0, n, n), 0);
        }
        double moved = 0, off = 0;
        for (size_t i = 0; i < n; i++) {
            moved += (double)(f.p[i] - p0[i]) * (f.p[i] - p0[i]);
            off += (double)(c.p[i] - f.p[i]) * (c.p[i] - f.p[i]);
            cr_assert(isfinite(c.p[i]));
        }
        double rel = sqrt(off / moved);
        cr_expect(rel < tol[d], "%s: %.4g of the update off fp32's (tolerance %g)",
                  adamw_state_dtype_name((enum adamw_state_dtype)d), rel, tol[d]);
        cr_log_info("%s: %.4g of the update off fp32's", adamw_state_dtype_name(d), rel);
        run_free(&c);
    }
    free(p0);
    run_free(&f);
}

Test(optim_states, errors)
{
    struct run r = run_new(600, ADAMW_STATE_Q8, 4);
    struct adamw_state_at at = {.seed = 1, .tensor = 0, .first = 100, .cap = 600};
    grads(&r, 1);
    /* a q8 part off a block boundary, more elements than the buffers hold, an unknown type */
    cr_expect_eq(
        adamw_update_states(ADAMW_STATE_Q8, r.p, r.g, r.m, r.v, NULL, 600, &at, &hp, 1, 1.0f),
        -EINVAL);
    at.first = 256;
    at.cap = 500;
    cr_expect_eq(
        adamw_update_states(ADAMW_STATE_Q8, r.p, r.g, r.m, r.v, NULL, 600, &at, &hp, 1, 1.0f),
        -EINVAL);
    at.cap = 600;
    cr_expect_eq(adamw_update_states((enum adamw_state_dtype)7, r.p, r.g, r.m, r.v, NULL, 600, &at,
                                     &hp, 1, 1.0f),
                 -EINVAL);
    cr_expect_eq(
        adamw_update_states(ADAMW_STATE_BF16, r.p, r.g, r.m, r.v, NULL, 600, NULL, &hp, 1, 1.0f),
        -EINVAL);
    cr_expect_eq(
        adamw_update_states(ADAMW_STATE_Q8, r.p, r.g, r.m, r.v, NULL, 600, &at, &hp, 0, 1.0f),
        -EINVAL);
    cr_expect_eq(
        adamw_update_states(ADAMW_STATE_Q8, r.p, r.g, r.m, r.v, NULL, 600, &at, &hp, 1, 1.0f), 0);
    cr_expect_str_eq(adamw_state_dtype_name(ADAMW_STATE_Q8), "int8");
    cr_expect_null(adamw_state_dtype_name((enum adamw_state_dtype)3));
    cr_expect_eq(adamw_state_bytes(ADAMW_STATE_Q8, 600), 600 + 3 * 4);
    cr_expect_eq(adamw_state_bytes(ADAMW_STATE_BF16, 600), 1200);
    run_free(&r);
}

/* The quantizer's table (by a float's top 16 bits) against the search over the map, at both
 * ends of every 16-bit prefix in [-1, 1] (each block led by 1, so absmax is 1 and a value
 * is its own x / absmax). */
Test(optim_states, q8_table_is_the_nearest_code_everywhere)
{
    const size_t per = ADAMW_Q8_BLOCK - 1,
                 n = 2 * 65536 / per * ADAMW_Q8_BLOCK + 2 * ADAMW_Q8_BLOCK;
    float *x = malloc(n * sizeof(float));
    uint8_t *c = malloc(n);
    float *s = malloc((n / ADAMW_Q8_BLOCK + 1) * sizeof(float));
    for (int is_signed = 0; is_signed < 2; is_signed++) {
        size_t k = 0;
        for (uint32_t key = 0; key < 65536; key++)
            for (uint32_t low = 0; low <= 0xffff; low += 0xffff) {
                uint32_t u = key << 16 | low;
                float y;
                memcpy(&y, &u, sizeof(y));
                if (!(fabsf(y) <= 1.0f) || (!is_signed && y < 0)) continue;
                if (k % ADAMW_Q8_BLOCK == 0) x[k++] = 1.0f;
                x[k++] = y;
            }
        cr_assert_leq(k, n);
        adamw_q8_quantize(x, k, is_signed, c, s);
        const float *map = adamw_q8_map(is_signed);
        for (size_t i = 0; i < k; i++) {
            cr_assert_eq(s[i / ADAMW_Q8_BLOCK], 1.0f);
            cr_assert_eq(c[i], adamw_q8_nearest(map, x[i]), "%s %.9g: code %d, the search's %d",
                         is_signed ? "signed" : "unsigned", x[i], c[i],
                         adamw_q8_nearest(map, x[i]));
        }
    }
    free(x);
    free(c);
    free(s);
}
