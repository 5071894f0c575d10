/*
 * adamw.c - the AdamW step of adamw.h: a scalar reference, an AVX2+FMA kernel and an
 * AVX-512F kernel (compiled for their targets function by function, chosen at run time with
 * __builtin_cpu_supports), spread over OpenMP threads. All three, and the GPU's twin
 * (kernels/adamw.cu), do the same IEEE operations per element, the same ones fused, so they
 * give the same bits: where the optimizer runs does not change a result.
 *
 * Threads take fixed chunks of CHUNK_ELEMS elements; a vector kernel handles a chunk's
 * ragged end with a masked load and store rather than a scalar loop, so every element goes
 * through the same instructions wherever it sits and the result is the same for any thread
 * count. The sum of squares splits the buffer into SUMSQ_SLICES fixed slices, each summed
 * in double by one thread, and adds the slices in order.
 *
 * Not here: compressed states (adamw_states.c, through adamw_int.h), fused clipping (the caller
 * sums squares over all its buffers first, then passes the scale), anything that allocates.
 */
#include <errno.h>
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "train/adamw.h"
#include "train/adamw_int.h"
#include "train/ops.h"

#define CHUNK_ELEMS ((size_t)1 << 16)        /* elements per thread task: 256 KiB of each array */
#define PARALLEL_MIN_ELEMS ((size_t)1 << 17) /* below this, threads cost more than they save */
#define SUMSQ_SLICES 64                      /* fixed, so the order of the sum is too */

void adamw_hparams_defaults(struct adamw_hparams *h)
{
    *h = (struct adamw_hparams){
        .lr = 3e-4f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f};
}

/* ---- kernels ------------------------------------------------------------------------------ */

static void update_scalar(float *p, const float *g, float *m, float *v, size_t n,
                          const struct adamw_coeffs *c)
{
    /* fmaf where the vector kernels fuse, and nowhere else: the same bits as they give. */
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * c->gs;
        if (c->l2) gi = fmaf(c->wd, p[i], gi);
        float mi = fmaf(c->b1, m[i], c->omb1 * gi);
        float vi = fmaf(c->b2, v[i], c->omb2 * (gi * gi));
        float mhat = mi * c->bc1, vhat = vi * c->bc2;
        float u = mhat / (sqrtf(vhat) + c->eps);
        if (!c->l2) u = fmaf(c->wd, p[i], u);
        p[i] = fmaf(-c->lr, u, p[i]);
        m[i] = mi;
        v[i] = vi;
    }
}

/* The same arithmetic as update_scalar, eight lanes at a time: fused multiply-adds for the
 * moment updates, the decay and the final step, as update_scalar's fmaf. */
#define AVX2_STEP(P, G, M, V, L2)                                                                  \
    do {                                                                                           \
        __m256 gi_ = _mm256_mul_ps((G), gs);                                                       \
        if (L2) gi_ = _mm256_fmadd_ps(wd, (P), gi_);                                               \
        __m256 mi_ = _mm256_fmadd_ps(b1, (M), _mm256_mul_ps(omb1, gi_));                           \
        __m256 vi_ = _mm256_fmadd_ps(b2, (V), _mm256_mul_ps(omb2, _mm256_mul_ps(gi_, gi_)));       \
        __m256 den_ = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(vi_, bc2)), eps);                 \
        __m256 u_ = _mm256_div_ps(_mm256_mul_ps(mi_, bc1), den_);                                  \
        if (!(L2)) u_ = _mm256_fmadd_ps(wd, (P), u_);                                              \
        (P) = _mm256_fmadd_ps(nlr, u_, (P));                                                       \
        (M) = mi_;                                                                                 \
        (V) = vi_;                                                                                 \
    } while (0)

/* L2 is a constant in each of the two instances, so the branches on it compile away. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
update_avx2_as(float *p, const float *g, float *m, float *v, size_t n, const struct adamw_coeffs *c,
               const int L2)
{
    const __m256 gs = _mm256_set1_ps(c->gs), b1 = _mm256_set1_ps(c->b1),
                 omb1 = _mm256_set1_ps(c->omb1), b2 = _mm256_set1_ps(c->b2),
                 omb2 = _mm256_set1_ps(c->omb2), bc1 = _mm256_set1_ps(c->bc1),
                 bc2 = _mm256_set1_ps(c->bc2), eps = _mm256_set1_ps(c->eps),
                 wd = _mm256_set1_ps(c->wd), nlr = _mm256_set1_ps(-c->lr);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 P = _mm256_loadu_ps(p + i), G = _mm256_loadu_ps(g + i);
        __m256 M = _mm256_loadu_ps(m + i), V = _mm256_loadu_ps(v + i);
        AVX2_STEP(P, G, M, V, L2);
        _mm256_storeu_ps(p + i, P);
        _mm256_storeu_ps(m + i, M);
        _mm256_storeu_ps(v + i, V);
    }
    if (i < n) {
        /* Lanes past the end load zeros (harmless: sqrt(0) + eps > 0) and are not stored. */
        __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)),
                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 P = _mm256_maskload_ps(p + i, k), G = _mm256_maskload_ps(g + i, k);
        __m256 M = _mm256_maskload_ps(m + i, k), V = _mm256_maskload_ps(v + i, k);
        AVX2_STEP(P, G, M, V, L2);
        _mm256_maskstore_ps(p + i, k, P);
        _mm256_maskstore_ps(m + i, k, M);
        _mm256_maskstore_ps(v + i, k, V);
    }
}

#define AVX512_STEP(P, G, M, V, L2)                                                                \
    do {                                                                                           \
        __m512 gi_ = _mm512_mul_ps((G), gs);                                                       \
        if (L2) gi_ = _mm512_fmadd_ps(wd, (P), gi_);                                               \
        __m512 mi_ = _mm512_fmadd_ps(b1, (M), _mm512_mul_ps(omb1, gi_));                           \
        __m512 vi_ = _mm512_fmadd_ps(b2, (V), _mm512_mul_ps(omb2, _mm512_mul_ps(gi_, gi_)));       \
        __m512 den_ = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(vi_, bc2)), eps);                 \
        __m512 u_ = _mm512_div_ps(_mm512_mul_ps(mi_, bc1), den_);                                  \
        if (!(L2)) u_ = _mm512_fmadd_ps(wd, (P), u_);                                              \
        (P) = _mm512_fmadd_ps(nlr, u_, (P));                                                       \
        (M) = mi_;                                                                                 \
        (V) = vi_;                                                                                 \
    } while (0)

__attribute__((target("avx512f"), always_inline)) static inline void
update_avx512_as(float *p, const float *g, float *m, float *v, size_t n,
                 const struct adamw_coeffs *c, const int L2)
{
    const __m512 gs = _mm512_set1_ps(c->gs), b1 = _mm512_set1_ps(c->b1),
                 omb1 = _mm512_set1_ps(c->omb1), b2 = _mm512_set1_ps(c->b2),
                 omb2 = _mm512_set1_ps(c->omb2), bc1 = _mm512_set1_ps(c->bc1),
                 bc2 = _mm512_set1_ps(c->bc2), eps = _mm512_set1_ps(c->eps),
                 wd = _mm512_set1_ps(c->wd), nlr = _mm512_set1_ps(-c->lr);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 P = _mm512_loadu_ps(p + i), G = _mm512_loadu_ps(g + i);
        __m512 M = _mm512_loadu_ps(m + i), V = _mm512_loadu_ps(v + i);
        AVX512_STEP(P, G, M, V, L2);
        _mm512_storeu_ps(p + i, P);
        _mm512_storeu_ps(m + i, M);
        _mm512_storeu_ps(v + i, V);
    }
    if (i < n) {
        /* Masked-off lanes are neither read (no fault past the end) nor written. */
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        __m512 P = _mm512_maskz_loadu_ps(k, p + i), G = _mm512_maskz_loadu_ps(k, g + i);
        __m512 M = _mm512_maskz_loadu_ps(k, m + i), V = _mm512_maskz_loadu_ps(k, v + i);
        AVX512_STEP(P, G, M, V, L2);
        _mm512_mask_storeu_ps(p + i, k, P);
        _mm512_mask_storeu_ps(m + i, k, M);
        _mm512_mask_storeu_ps(v + i, k, V);
    }
}

__attribute__((target("avx2,fma"))) static void
update_avx2(float *p, const float *g, float *m, float *v, size_t n, const struct adamw_coeffs *c)
{
    if (c->l2)
        update_avx2_as(p, g, m, v, n, c, 1);
    else
        update_avx2_as(p, g, m, v, n, c, 0);
}

__attribute__((target("avx512f"))) static void
update_avx512(float *p, const float *g, float *m, float *v, size_t n, const struct adamw_coeffs *c)
{
    if (c->l2)
        update_avx512_as(p, g, m, v, n, c, 1);
    else
        update_avx512_as(p, g, m, v, n, c, 0);
}

/* ---- dispatch ----------------------------------------------------------------------------- */

enum adamw_isa adamw_best_isa(void)
{
    /* -1 until probed; probing twice from two threads gives the same answer. */
    static int best = -1;
    int b = __atomic_load_n(&best, __ATOMIC_RELAXED);
    if (b < 0) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f"))
            b = ADAMW_ISA_AVX512;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
            b = ADAMW_ISA_AVX2;
        else
            b = ADAMW_ISA_SCALAR;
        __atomic_store_n(&best, b, __ATOMIC_RELAXED);
    }
    return (enum adamw_isa)b;
}

const char *adamw_isa_name(enum adamw_isa isa)
{
    switch (isa) {
    case ADAMW_ISA_SCALAR:
        return "scalar";
    case ADAMW_ISA_AVX2:
        return "avx2";
    case ADAMW_ISA_AVX512:
        return "avx512";
    case ADAMW_ISA_BEST:
        return adamw_isa_name(adamw_best_isa());
    }
    return "unknown";
}

static int supported(enum adamw_isa isa)
{
    __builtin_cpu_init();
    switch (isa) {
    case ADAMW_ISA_SCALAR:
    case ADAMW_ISA_BEST:
        return 1;
    case ADAMW_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case ADAMW_ISA_AVX512:
        return __builtin_cpu_supports("avx512f");
    }
    return 0;
}

static int check_hparams(const struct adamw_hparams *h, int step, float grad_scale)
{
    if (!h || step < 1 || !isfinite(grad_scale)) return -EINVAL;
    if (!(h->lr >= 0.0f) || !isfinite(h->lr)) return -EINVAL;
    if (!(h->beta1 >= 0.0f && h->beta1 < 1.0f) || !(h->beta2 >= 0.0f && h->beta2 < 1.0f))
        return -EINVAL;
    if (!(h->eps > 0.0f) || !isfinite(h->eps)) return -EINVAL;
    if (!(h->weight_decay >= 0.0f) || !isfinite(h->weight_decay)) return -EINVAL;
    return 0;
}

/* The update over one chunk, then the bf16 cast of the chunk while it is still in cache. */
static void update_chunk(adamw_kernel_fn fn, float *p, const float *g, float *m, float *v,
                         uint16_t *p16, size_t n, const struct adamw_coeffs *c)
{
    fn(p, g, m, v, n, c);
    if (p16)
        for (size_t i = 0; i < n; i++)
            p16[i] = ops_f32_to_bf16(p[i]);
}

int adamw_prepare(enum adamw_isa isa, const struct adamw_hparams *h, int step, float grad_scale,
                  struct adamw_kernel *k)
{
    int r = check_hparams(h, step, grad_scale);
    if (r < 0) return r;
    if ((unsigned)isa > ADAMW_ISA_BEST) return -EINVAL;
    if (!supported(isa)) return -ENOTSUP;
    if (isa == ADAMW_ISA_BEST) isa = adamw_best_isa();
    k->c = (struct adamw_coeffs){
        .gs = grad_scale,
        .b1 = h->beta1,
        .omb1 = 1.0f - h->beta1,
        .b2 = h->beta2,
        .omb2 = 1.0f - h->beta2,
        .bc1 = h->no_bias_correction ? 1.0f : (float)(1.0 / (1.0 - pow(h->beta1, step))),
        .bc2 = h->no_bias_correction ? 1.0f : (float)(1.0 / (1.0 - pow(h->beta2, step))),
        .eps = h->eps,
        .wd = h->weight_decay,
        .lr = h->lr,
        .l2 = h->l2 != 0,
    };
    k->fn = isa == ADAMW_ISA_AVX512 ? update_avx512
            : isa == ADAMW_ISA_AVX2 ? update_avx2
                                    : update_scalar;
    k->isa = isa;
    return 0;
}

static int update(enum adamw_isa isa, float *param, const float *grad, float *m, float *v,
                  uint16_t *param_bf16, size_t n, const struct adamw_hparams *h, int step,
                  float grad_scale)
{
    struct adamw_kernel k;
    int r = adamw_prepare(isa, h, step, grad_scale, &k);
    if (r < 0) return r;
    if (n && (!param || !grad || !m || !v)) return -EINVAL;
    if (!n) return 0;
    if (k.isa == ADAMW_ISA_SCALAR) {
        update_chunk(k.fn, param, grad, m, v, param_bf16, n, &k.c);
        return 0;
    }
    size_t nchunks = (n + CHUNK_ELEMS - 1) / CHUNK_ELEMS;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ELEMS)
    for (size_t c = 0; c < nchunks; c++) {
        size_t i0 = c * CHUNK_ELEMS, len = n - i0 < CHUNK_ELEMS ? n - i0 : CHUNK_ELEMS;
        update_chunk(k.fn, param + i0, grad + i0, m + i0, v + i0,
                     param_bf16 ? param_bf16 + i0 : NULL, len, &k.c);
    }
    return 0;
}

int adamw_update_isa(enum adamw_isa isa, float *param, const float *grad, float *m, float *v,
                     size_t n, const struct adamw_hparams *h, int step, float grad_scale)
{
    return update(isa, param, grad, m, v, NULL, n, h, step, grad_scale);
}

int adamw_update(float *param, const float *grad, float *m, float *v, size_t n,
                 const struct adamw_hparams *h, int step, float grad_scale)
{
    return update(ADAMW_ISA_BEST, param, grad, m, v, NULL, n, h, step, grad_scale);
}

int adamw_update_bf16(float *param, const float *grad, float *m, float *v, uint16_t *param_bf16,
                      size_t n, const struct adamw_hparams *h, int step, float grad_scale)
{
    if (n && !param_bf16) return -EINVAL;
    return update(ADAMW_ISA_BEST, param, grad, m, v, param_bf16, n, h, step, grad_scale);
}

/* ---- LAMB -------------------------------------------------------------------------------- */

/* u of one element, the same code in both passes. */
static inline float lamb_u(float m, float v, float p, float eps, float wd, int inside)
{
    float denom = inside ? sqrtf(v + eps) : sqrtf(v) + eps;
    return m / denom + wd * p;
}

int lamb_moments(const float *param, const float *grad, float *m, float *v, size_t n,
                 const struct adamw_hparams *h, float grad_scale, int eps_inside_sqrt, size_t chunk,
                 double *w_sq, double *u_sq)
{
    int r = check_hparams(h, 1, grad_scale);
    if (r < 0) return r;
    if (!chunk || (n && (!param || !grad || !m || !v || !w_sq || !u_sq))) return -EINVAL;
    const float b1 = h->beta1, omb1 = 1.0f - h->beta1, b2 = h->beta2, omb2 = 1.0f - h->beta2;
    size_t nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ELEMS)
    for (size_t k = 0; k < nchunks; k++) {
        size_t i0 = k * chunk, i1 = n - i0 < chunk ? n : i0 + chunk;
        double w = 0, u2 = 0;
        for (size_t i = i0; i < i1; i++) {
            float gi = grad[i] * grad_scale;
            float mi = b1 * m[i] + omb1 * gi;
            float vi = b2 * v[i] + omb2 * (gi * gi);
            float u = lamb_u(mi, vi, param[i], h->eps, h->weight_decay, eps_inside_sqrt);
            m[i] = mi;
            v[i] = vi;
            w += (double)param[i] * param[i];
            u2 += (double)u * u;
        }
        w_sq[k] = w;
        u_sq[k] = u2;
    }
    return 0;
}

float lamb_coeff(double w_sq, double u_sq, float max_coeff, float min_coeff)
{
    float w = (float)sqrt(w_sq), u = (float)sqrt(u_sq), c = 1.0f;
    if (w != 0 && u != 0) {
        c = w / u;
        if (c > max_coeff) c = max_coeff;
        if (c < min_coeff) c = min_coeff;
    }
    return c;
}

int lamb_apply(float *param, const float *m, const float *v, uint16_t *param_bf16, size_t n,
               const struct adamw_hparams *h, int step, int eps_inside_sqrt, float coeff)
{
    int r = check_hparams(h, step, 1.0f);
    if (r < 0) return r;
    if (!isfinite(coeff) || (n && (!param || !m || !v))) return -EINVAL;
    /* DeepSpeed's step size: the bias corrections in float, from pow in double. */
    float step_size = h->lr;
    if (!h->no_bias_correction) {
        float bc1 = (float)(1.0 - pow(h->beta1, step)), bc2 = (float)(1.0 - pow(h->beta2, step));
        step_size = h->lr * sqrtf(bc2) / bc1;
    }
    float sc = step_size * coeff;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ELEMS)
    for (size_t i = 0; i < n; i++) {
        float p = param[i];
        p = p - sc * lamb_u(m[i], v[i], p, h->eps, h->weight_decay, eps_inside_sqrt);
        param[i] = p;
        if (param_bf16) param_bf16[i] = ops_f32_to_bf16(p);
    }
    return 0;
}

/* ---- clipping ----------------------------------------------------------------------------- */

/* Eight running sums, so the loop is not one long dependency chain; their order is fixed. */
static double slice_sum_squares(const float *x, size_t n)
{
    double acc[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            acc[j] += (double)x[i + j] * (double)x[i + j];
    for (; i < n; i++)
        acc[i % 8] += (double)x[i] * (double)x[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

int adamw_sum_squares(const float *x, size_t n, double *out)
{
    if (!out || (n && !x)) return -EINVAL;
    if (!n) {
        *out = 0.0;
        return 0;
    }
    double part[SUMSQ_SLICES];
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ELEMS)
    for (size_t s = 0; s < SUMSQ_SLICES; s++) {
        size_t i0 = n / SUMSQ_SLICES * s,
               i1 = s + 1 == SUMSQ_SLICES ? n : n / SUMSQ_SLICES * (s + 1);
        part[s] = slice_sum_squares(x + i0, i1 - i0);
    }
    double total = 0.0;
    for (size_t s = 0; s < SUMSQ_SLICES; s++)
        total += part[s];
    *out = total;
    return 0;
}

float adamw_clip_scale(double sum_squares, float max_norm)
{
    double norm = sqrt(sum_squares);
    if (!(max_norm > 0.0f) || !(norm > (double)max_norm)) return 1.0f;
    return (float)((double)max_norm / norm);
}
