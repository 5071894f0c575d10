/*
 * adamw_states.c - AdamW over compressed moments (adamw_states.h): each block of
 * ADAMW_Q8_BLOCK elements widened to fp32 on the stack, updated by adamw.c's kernel (the one
 * adamw_update picks, so the arithmetic is fp32 AdamW's to the bit), and stored back as bf16
 * with stochastic rounding or as 8-bit codes with the block's absmax.
 *
 * Threads take fixed chunks of CHUNK_ELEMS elements, a multiple of the block: every block
 * is one thread's, and nothing an element's result depends on (its block, its random bits)
 * changes with the thread count. The random bits hash the element's index in the whole
 * tensor, and q8 blocks are counted from the tensor's first element, so a ZeRO shard that
 * starts on a block boundary computes what the whole tensor's update does on its part.
 *
 * The nearest code is found through a table by the value's top 16 bits (the codes below
 * the least float with them), then one comparison with the next code and one between the
 * two neighbours, without branches: about 10 ns an element for both moments on one core,
 * where a search over the map took 29.
 *
 * The dynamic map is bitsandbytes' create_dynamic_map (signed, 7 exponent bits, 8 bits)
 * computed in float32 as its torch code does: torch.linspace(0.1, 1, k) (start + i step
 * for the first half, end - (k - 1 - i) step for the rest), the midpoints of neighbours
 * halved, times 10^e; plus 0 and 1, sorted.
 *
 * Not here: the fp32 states (adamw.c), where the buffers live (the trainer).
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "train/adamw_int.h"
#include "train/adamw_states.h"
#include "train/ops.h"

#define CHUNK_ELEMS ((size_t)1 << 16)        /* as adamw.c's: a multiple of the block */
#define PARALLEL_MIN_ELEMS ((size_t)1 << 17) /* below this, threads cost more than they save */
#define B ADAMW_Q8_BLOCK

const char *adamw_state_dtype_name(enum adamw_state_dtype dt)
{
    switch (dt) {
    case ADAMW_STATE_FP32:
        return "fp32";
    case ADAMW_STATE_BF16:
        return "bf16";
    case ADAMW_STATE_Q8:
        return "int8";
    }
    return NULL;
}

static size_t q8_scales_at(size_t cap)
{
    return (cap + 3) & ~(size_t)3;
}

size_t adamw_state_bytes(enum adamw_state_dtype dt, size_t cap)
{
    switch (dt) {
    case ADAMW_STATE_BF16:
        return cap * sizeof(uint16_t);
    case ADAMW_STATE_Q8:
        return q8_scales_at(cap) + (cap + B - 1) / B * sizeof(float);
    default:
        return cap * sizeof(float);
    }
}

/* ---- the dynamic map ---------------------------------------------------------------------- */

/* torch.linspace(0.1, 1, k)[j] in float32. */
static float linspace_at(int k, int j)
{
    float start = 0.1f, end = 1.0f, step = (end - start) / (float)(k - 1);
    if (j < k / 2) {
        float d = step * (float)j;
        return start + d;
    }
    float d = step * (float)(k - 1 - j);
    return end - d;
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void build_map(int is_signed, float *out)
{
    /* 8 bits, of which one (signed: the sign; unsigned: none, as bitsandbytes counts it)
     * is not the value's; up to 7 of the remaining 7 are the exponent, so no item is left
     * for the linear region and every code is one of the exponents' fractions. */
    const int max_exp = 7, non_sign = 7;
    int k = 0;
    for (int i = 0; i < max_exp; i++) {
        int items = (1 << (i + non_sign - max_exp + (is_signed ? 0 : 1))) + 1;
        float scale = (float)pow(10.0, (double)(-(max_exp - 1) + i));
        for (int j = 0; j + 1 < items; j++) {
            float mean = (linspace_at(items, j) + linspace_at(items, j + 1)) / 2.0f;
            out[k++] = scale * mean;
            if (is_signed) out[k++] = -scale * mean;
        }
    }
    out[k++] = 0.0f;
    out[k++] = 1.0f;
    qsort(out, (size_t)k, sizeof(float), cmp_float);
}

static float maps[2][256];
/* By the top 16 bits of a float y: how many codes are below the least float with those bits
 * (at most 255). Codes are at least 1.4% apart (64 in the top decade) and floats that share
 * their top 16 bits within 0.8% of each other, so at most one code lies among them: the
 * codes below y are the table's count, or one more. */
static uint8_t below[2][65536];
static pthread_once_t maps_once = PTHREAD_ONCE_INIT;

static unsigned count_below(const float *map, float x)
{
    unsigned lo = 0;
    for (unsigned half = 128; half; half >>= 1)
        lo += map[lo + half - 1] < x ? half : 0;
    return lo + (map[lo] < x);
}

static void build_maps(void)
{
    for (int s = 0; s < 2; s++) {
        build_map(s, maps[s]);
        for (uint32_t key = 0; key < 65536; key++) {
            /* the least float with these top bits: the largest magnitude of a negative */
            uint32_t u = key << 16 | (key & 0x8000 ? 0xffffu : 0);
            float least;
            memcpy(&least, &u, sizeof(least));
            unsigned c = isnan(least) ? 0 : count_below(maps[s], least);
            below[s][key] = (uint8_t)(c > 255 ? 255 : c);
        }
    }
}

const float *adamw_q8_map(int is_signed)
{
    pthread_once(&maps_once, build_maps);
    return maps[is_signed != 0];
}

/* lo codes are below x: the nearer of codes lo - 1 and lo. */
static inline uint8_t nearer(const float *map, unsigned lo, float x)
{
    if (lo == 256) return 255;
    if (lo == 0) return 0;
    /* a coin toss a value: without a branch */
    return (uint8_t)(lo - (x - map[lo - 1] <= map[lo] - x));
}

uint8_t adamw_q8_nearest(const float *map, float x)
{
    /* By halving without branches (a conditional move a step). */
    return nearer(map, count_below(map, x), x);
}

/* The same through the table of its map (s: signed). */
static inline uint8_t nearest_fast(int s, float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    unsigned lo = below[s][u >> 16]; /* at most 255 */
    lo += maps[s][lo] < x;
    return nearer(maps[s], lo, x);
}

/* One block: its absmax (of |x|), then each value's code. A block of zeros (or one whose
 * absmax is not a positive number) stores zeros' code under absmax 0. */
static void q8_block(int s, const float *x, size_t n, uint8_t *codes, float *absmax)
{
    float mx = 0.0f;
    for (size_t i = 0; i < n; i++)
        mx = fmaxf(mx, fabsf(x[i]));
    if (!(mx > 0.0f)) {
        uint8_t zero = adamw_q8_nearest(maps[s], 0.0f);
        memset(codes, zero, n);
        *absmax = 0.0f;
        return;
    }
    for (size_t i = 0; i < n; i++)
        codes[i] = nearest_fast(s, x[i] / mx);
    *absmax = mx;
}

void adamw_q8_quantize(const float *x, size_t n, int is_signed, uint8_t *codes, float *absmax)
{
    (void)adamw_q8_map(0); /* the maps and tables built */
    for (size_t b = 0; b * B < n; b++) {
        size_t len = n - b * B < B ? n - b * B : B;
        q8_block(is_signed != 0, x + b * B, len, codes + b * B, &absmax[b]);
    }
}

void adamw_q8_dequantize(const uint8_t *codes, const float *absmax, size_t n, int is_signed,
                         float *x)
{
    const float *map = adamw_q8_map(is_signed);
    for (size_t i = 0; i < n; i++)
        x[i] = map[codes[i]] * absmax[i / B];
}

/* ---- bf16 with stochastic rounding -------------------------------------------------------- */

uint16_t adamw_bf16_stochastic(float x, uint32_t r16)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    if ((u & 0x7f800000u) == 0x7f800000u) return ops_f32_to_bf16(x); /* NaN, infinity */
    /* The magnitude grows or stays (the sign bit is never reached: at most 0x7f7fffff +
     * 0xffff); one that would become infinite is truncated instead. */
    uint32_t s = u + (r16 & 0xffffu);
    if ((s & 0x7f800000u) == 0x7f800000u) s = u;
    return (uint16_t)(s >> 16);
}

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The key of a tensor's step: every element's bits are mix64(key + index x golden). */
static uint64_t bits_key(uint64_t seed, uint32_t tensor, int step)
{
    return mix64(mix64(seed * 0x9e3779b97f4a7c15ull + tensor) + (uint64_t)(uint32_t)step);
}

static inline uint32_t bits_at(uint64_t key, uint64_t index)
{
    return (uint32_t)mix64(key + index * 0x9e3779b97f4a7c15ull);
}

uint32_t adamw_state_bits(uint64_t seed, uint32_t tensor, int step, uint64_t index)
{
    return bits_at(bits_key(seed, tensor, step), index);
}

/* ---- the update --------------------------------------------------------------------------- */

struct job {
    const struct adamw_kernel *k;
    enum adamw_state_dtype dt;
    float *p;
    const float *g;
    void *m, *v;
    uint16_t *p16;
    const struct adamw_state_at *at;
    uint64_t key;
};

/* Elements [i0, i0 + n) (n <= B, i0 a multiple of B): widened, updated, stored. */
static void update_block(const struct job *j, size_t i0, size_t n)
{
    float m[B], v[B];
    if (j->dt == ADAMW_STATE_BF16) {
        const uint16_t *m16 = (const uint16_t *)j->m + i0, *v16 = (const uint16_t *)j->v + i0;
        for (size_t i = 0; i < n; i++) {
            m[i] = ops_bf16_to_f32(m16[i]);
            v[i] = ops_bf16_to_f32(v16[i]);
        }
    } else {
        const float *ms = (const float *)((const char *)j->m + q8_scales_at(j->at->cap)),
                    *vs = (const float *)((const char *)j->v + q8_scales_at(j->at->cap));
        const float *mm = adamw_q8_map(1), *vm = adamw_q8_map(0);
        const uint8_t *mc = (const uint8_t *)j->m + i0, *vc = (const uint8_t *)j->v + i0;
        float sm = ms[i0 / B], sv = vs[i0 / B];
        for (size_t i = 0; i < n; i++) {
            m[i] = mm[mc[i]] * sm;
            v[i] = vm[vc[i]] * sv;
        }
    }
    j->k->fn(j->p + i0, j->g + i0, m, v, n, &j->k->c);
    if (j->p16)
        for (size_t i = 0; i < n; i++)
            j->p16[i0 + i] = ops_f32_to_bf16(j->p[i0 + i]);
    if (j->dt == ADAMW_STATE_BF16) {
        uint16_t *m16 = (uint16_t *)j->m + i0, *v16 = (uint16_t *)j->v + i0;
        for (size_t i = 0; i < n; i++) {
            uint32_t r = bits_at(j->key, j->at->first + i0 + i);
            m16[i] = adamw_bf16_stochastic(m[i], r);
            v16[i] = adamw_bf16_stochastic(v[i], r >> 16);
        }
    } else {
        float *ms = (float *)((char *)j->m + q8_scales_at(j->at->cap)),
              *vs = (float *)((char *)j->v + q8_scales_at(j->at->cap));
        q8_block(1, m, n, (uint8_t *)j->m + i0, &ms[i0 / B]);
        q8_block(0, v, n, (uint8_t *)j->v + i0, &vs[i0 / B]);
    }
}

int adamw_update_states(enum adamw_state_dtype dt, float *param, const float *grad, void *m,
                        void *v, uint16_t *param_bf16, size_t n, const struct adamw_state_at *at,
                        const struct adamw_hparams *h, int step, float grad_scale)
{
    if (dt == ADAMW_STATE_FP32)
        return param_bf16 ? adamw_update_bf16(param, grad, m, v, param_bf16, n, h, step, grad_scale)
                          : adamw_update(param, grad, m, v, n, h, step, grad_scale);
    if (dt != ADAMW_STATE_BF16 && dt != ADAMW_STATE_Q8) return -EINVAL;
    struct adamw_kernel k;
    int r = adamw_prepare(ADAMW_ISA_BEST, h, step, grad_scale, &k);
    if (r < 0) return r;
    if (!n) return 0;
    if (!at || !param || !grad || !m || !v || n > at->cap) return -EINVAL;
    if (dt == ADAMW_STATE_Q8 && at->first % B) return -EINVAL;
    (void)adamw_q8_map(0); /* built before the threads read it */
    struct job j = {.k = &k,
                    .dt = dt,
                    .p = param,
                    .g = grad,
                    .m = m,
                    .v = v,
                    .p16 = param_bf16,
                    .at = at,
                    .key = bits_key(at->seed, at->tensor, step)};
    size_t nchunks = (n + CHUNK_ELEMS - 1) / CHUNK_ELEMS;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ELEMS)
    for (size_t c = 0; c < nchunks; c++) {
        size_t end = n - c * CHUNK_ELEMS < CHUNK_ELEMS ? n : (c + 1) * CHUNK_ELEMS;
        for (size_t i0 = c * CHUNK_ELEMS; i0 < end; i0 += B)
            update_block(&j, i0, end - i0 < B ? end - i0 : B);
    }
    return 0;
}
