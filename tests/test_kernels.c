/*
 * test_kernels.c - every CUDA kernel of kernels/kernels.h against its CPU reference twin
 * (src/train/ops.h, src/train/adamw.h) on the same random input, checkasm style: each test
 * reports the largest difference it saw and the tolerance it holds the kernel to, then
 * asserts it. Each launcher has its bf16 and fp16 variants (the CPU input is rounded through
 * the 16-bit type first, so both twins read the same values) and its bad-input twin (-EINVAL before
 * any launch; those run even without a GPU). Sizes are ragged on purpose (T = 13, C = 72 or 96, N
 * not a multiple of any block or chunk).
 *
 * Tolerances, as |gpu - cpu| <= abs + rel |cpu| + of_max max|cpu| per element:
 *   fp32 elementwise    1e-6 + 1e-5 |x|    (GELU 1e-5 + 1e-5 |x|: see check_gelu)
 *   fp32 long sums      1e-4 + 1e-5 |x|    (GEMMs, LayerNorm, attention, column sums)
 *   bf16                1e-2 |x| + 1e-2 max|x|  (outputs rounded to bf16, or bf16 GEMMs)
 *   fp16                5e-3 |x| + 5e-3 max|x|  (likewise; fp16 keeps 3 more bits than bf16)
 *   exact               0                  (casts, embedding backward)
 *   AdamW               1e-11 + 1e-5 |x|   (the same bits are expected; its 16-bit copy is
 *                                           exactly the rounding of its own fp32 result)
 *   sum of squares      1e-12 relative     (doubles summed in another order)
 * The deterministic reductions are also run twice and must give the same bits.
 *
 * Skips where no GPU is usable or the build has no kernels.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "helpers.h"
#include "tiers/cuda_probe.h"
#include "train/adamw.h"
#include "train/adamw_states.h"
#include "train/moe_int.h"
#include "train/ops.h"

#if ZINF_HAVE_KERNELS
#include "kernels/kernels.h"

/* ---- helpers ----------------------------------------------------------------------------- */

static void need_gpu(void)
{
    struct cuda_probe_info ci;
    if (cuda_probe(&ci) == 0) cr_skip_test("no usable GPU: %s", ci.reason);
}

/* Allowed |gpu - cpu| = abs + rel |cpu| + of_max max|cpu| (max over the buffer). */
struct tol {
    double abs, rel, of_max;
    const char *name;
};
static const struct tol TOL_EXACT = {0, 0, 0, "exact"};
static const struct tol TOL_F32 = {1e-6, 1e-5, 0, "fp32 1e-6 + 1e-5|x|"};
static const struct tol TOL_F32_SUM = {1e-4, 1e-5, 0, "fp32 sums 1e-4 + 1e-5|x|"};
static const struct tol TOL_BF16 = {0, 1e-2, 1e-2, "bf16 1e-2|x| + 1e-2 max|x|"};
static const struct tol TOL_F16 = {0, 5e-3, 5e-3, "fp16 5e-3|x| + 5e-3 max|x|"};

static struct tol tol_for(enum kdtype dt, struct tol f32)
{
    return dt == KDT_BF16 ? TOL_BF16 : dt == KDT_F16 ? TOL_F16 : f32;
}

static const char *dt_name(enum kdtype dt)
{
    return dt == KDT_BF16 ? "bf16" : dt == KDT_F16 ? "fp16" : "fp32";
}

static size_t dt_size(enum kdtype dt)
{
    return dt == KDT_F32 ? 4 : 2;
}

/* A 16-bit element type and its CPU casts (round to nearest even, and exact widening). */
struct type16 {
    enum kdtype dt;
    uint16_t (*narrow)(float f);
    float (*widen)(uint16_t h);
};
static const struct type16 T_BF16 = {KDT_BF16, ops_f32_to_bf16, ops_bf16_to_f32};
static const struct type16 T_F16 = {KDT_F16, ops_f32_to_f16, ops_f16_to_f32};

static const struct type16 *type16_of(enum kdtype dt)
{
    return dt == KDT_BF16 ? &T_BF16 : &T_F16;
}

static float *falloc(size_t n)
{
    float *p = calloc(n ? n : 1, sizeof(float));
    cr_assert_not_null(p);
    return p;
}

static void random_floats(float *x, size_t n, uint64_t seed, float lo, float hi)
{
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++)
        x[i] = lo + (hi - lo) * (float)((double)(test_rand(&s) >> 11) / 9007199254740992.0);
}

/* x rounded through the 16-bit type dt. */
static void round_to(enum kdtype dt, float *x, size_t n)
{
    const struct type16 *t = type16_of(dt);
    for (size_t i = 0; i < n; i++)
        x[i] = t->widen(t->narrow(x[i]));
}

static void *dev_alloc(size_t bytes)
{
    void *d = NULL;
    cr_assert_eq(cudaMalloc(&d, bytes ? bytes : 1), cudaSuccess);
    return d;
}

static int *dev_ints(const int *h, size_t n)
{
    int *d = dev_alloc(n * sizeof(int));
    cr_assert_eq(cudaMemcpy(d, h, n * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
}

static int *random_ints(size_t n, uint64_t seed, int below)
{
    int *x = malloc(n * sizeof(int));
    cr_assert_not_null(x);
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++)
        x[i] = (int)(test_rand(&s) % (uint64_t)below);
    return x;
}

static void sync_ok(void)
{
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
}

/* A buffer in two copies holding the same values: h (fp32, host) for the CPU twin and d
 * (device, n elements of dt) for the kernel. */
struct twin {
    float *h;
    void *d;
    size_t n;
    enum kdtype dt;
};

/* h -> d, converting to dt when it is a 16-bit type (h already holds values exact in it). */
static void twin_upload(struct twin *t)
{
    if (t->dt == KDT_F32) {
        cr_assert_eq(cudaMemcpy(t->d, t->h, t->n * 4, cudaMemcpyHostToDevice), cudaSuccess);
        return;
    }
    uint16_t *b = malloc(t->n * 2 + 2);
    cr_assert_not_null(b);
    if (t->dt == KDT_F16)
        ops_cast_f32_to_f16(b, t->h, t->n);
    else
        ops_cast_f32_to_bf16(b, t->h, t->n);
    cr_assert_eq(cudaMemcpy(t->d, b, t->n * 2, cudaMemcpyHostToDevice), cudaSuccess);
    free(b);
}

/* The device copy, as fp32 on the host (the caller frees it). */
static float *twin_download(const struct twin *t)
{
    float *out = falloc(t->n);
    if (t->dt == KDT_F32) {
        cr_assert_eq(cudaMemcpy(out, t->d, t->n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        return out;
    }
    uint16_t *b = malloc(t->n * 2 + 2);
    cr_assert_not_null(b);
    cr_assert_eq(cudaMemcpy(b, t->d, t->n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    if (t->dt == KDT_F16)
        ops_cast_f16_to_f32(out, b, t->n);
    else
        ops_cast_bf16_to_f32(out, b, t->n);
    free(b);
    return out;
}

/* n values uniform in [lo, hi), rounded through dt when it is a 16-bit type, in both copies. */
static struct twin twin_rand(size_t n, enum kdtype dt, uint64_t seed, float lo, float hi)
{
    struct twin t = {falloc(n), dev_alloc(n * dt_size(dt)), n, dt};
    random_floats(t.h, n, seed, lo, hi);
    if (dt != KDT_F32) round_to(dt, t.h, n);
    twin_upload(&t);
    return t;
}

static struct twin twin_zeros(size_t n, enum kdtype dt)
{
    struct twin t = {falloc(n), dev_alloc(n * dt_size(dt)), n, dt};
    cr_assert_eq(cudaMemset(t.d, 0, n * dt_size(dt)), cudaSuccess);
    return t;
}

/* Host values uploaded as they are (the caller made them exact in dt if need be). */
static struct twin twin_of(const float *h, size_t n, enum kdtype dt)
{
    struct twin t = {falloc(n), dev_alloc(n * dt_size(dt)), n, dt};
    memcpy(t.h, h, n * sizeof(float));
    twin_upload(&t);
    return t;
}

static void twin_free(struct twin *t)
{
    free(t->h);
    cudaFree(t->d);
    t->h = NULL;
    t->d = NULL;
}

/* gpu against cpu under tol: logs the largest difference, then asserts every element. */
static void expect_close(const char *what, const float *gpu, const float *cpu, size_t n,
                         struct tol tol)
{
    double amax = 0;
    for (size_t i = 0; i < n; i++)
        amax = fmax(amax, fabs((double)cpu[i]));
    double worst = 0, worst_ratio = 0;
    size_t at = 0, bad = 0, bad_at = 0;
    for (size_t i = 0; i < n; i++) {
        double diff = fabs((double)gpu[i] - (double)cpu[i]);
        double allowed = tol.abs + tol.rel * fabs((double)cpu[i]) + tol.of_max * amax;
        if (diff > worst || isnan(diff)) {
            worst = isnan(diff) ? INFINITY : diff;
            at = i;
        }
        if (!(diff <= allowed)) {
            double ratio = allowed > 0 ? diff / allowed : INFINITY;
            if (!bad || !(ratio <= worst_ratio)) {
                worst_ratio = ratio;
                bad_at = i;
            }
            bad++;
        }
    }
    cr_log_info("%s: largest difference %.3g at %zu of %zu (gpu %.9g, cpu %.9g); tolerance %s",
                what, worst, at, n, n ? gpu[at] : 0.0f, n ? cpu[at] : 0.0f, tol.name);
    cr_assert_eq(bad, 0,
                 "%s: %zu of %zu elements beyond tolerance %s; worst at %zu: gpu %.9g, "
                 "cpu %.9g",
                 what, bad, n, tol.name, bad_at, gpu[bad_at], cpu[bad_at]);
}

/* The kernel's result (t->d) against the CPU twin's (t->h). */
static void twin_check(const char *what, enum kdtype dt, const struct twin *t, struct tol tol)
{
    char name[128];
    snprintf(name, sizeof(name), "%s (%s)", what, dt_name(dt));
    float *gpu = twin_download(t);
    expect_close(name, gpu, t->h, t->n, tol);
    free(gpu);
}

/* The device copy's bytes, for the determinism tests (the caller frees them). */
static void *dev_bytes(const void *d, size_t bytes)
{
    void *h = malloc(bytes);
    cr_assert_not_null(h);
    cr_assert_eq(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
}

static cublasHandle_t blas_new(void)
{
    cublasHandle_t h = NULL;
    cr_assert_eq(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
    /* The default math mode: fp32 GEMMs in true fp32, no TF32 tensor cores. */
    cr_assert_eq(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), CUBLAS_STATUS_SUCCESS);
    return h;
}

/* Never dereferenced: the bad-input tests are refused before anything touches the GPU. */
#define FAKE ((void *)(uintptr_t)0x1000)
#define FAKEF ((float *)FAKE)
#define FAKEI ((int *)FAKE)
#define BAD_DT ((enum kdtype)7)

/* ---- embedding --------------------------------------------------------------------------- */

static void check_embed_forward(enum kdtype dt)
{
    need_gpu();
    const int B = 3, T = 13, C = 72, V = 50;
    size_t N = (size_t)B * T;
    struct twin wte = twin_rand((size_t)V * C, dt, 1, -1, 1);
    struct twin wpe = twin_rand((size_t)T * C, dt, 2, -1, 1);
    struct twin x = twin_zeros(N * C, dt);
    int *tok = random_ints(N, 3, V);
    int *d_tok = dev_ints(tok, N);

    cr_assert_eq(kernel_embed_forward(x.d, wte.d, wpe.d, d_tok, B, T, C, dt, 0), 0);
    sync_ok();
    ops_embed_forward(x.h, wte.h, wpe.h, tok, B, T, C);
    twin_check("embed forward x", dt, &x, tol_for(dt, TOL_F32));

    twin_free(&wte);
    twin_free(&wpe);
    twin_free(&x);
    free(tok);
    cudaFree(d_tok);
}

Test(kernels_gpu, embed_forward_matches_the_cpu_f32)
{
    check_embed_forward(KDT_F32);
}

Test(kernels_gpu, embed_forward_matches_the_cpu_bf16)
{
    check_embed_forward(KDT_BF16);
}

Test(kernels_gpu, embed_forward_matches_the_cpu_f16)
{
    check_embed_forward(KDT_F16);
}

Test(kernels_gpu, embed_forward_refuses_bad_input)
{
    cr_assert_eq(kernel_embed_forward(NULL, FAKE, FAKE, FAKEI, 2, 3, 4, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_embed_forward(FAKE, FAKE, FAKE, NULL, 2, 3, 4, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_embed_forward(FAKE, FAKE, FAKE, FAKEI, 0, 3, 4, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_embed_forward(FAKE, FAKE, FAKE, FAKEI, 2, -1, 4, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_embed_forward(FAKE, FAKE, FAKE, FAKEI, 2, 3, 4, BAD_DT, 0), -EINVAL);
}

/* d_wte and d_wpe start non-zero (they accumulate); few tokens, so rows repeat. Each
 * element is summed in the CPU's order, so fp32 is exact. */
static void run_embed_backward(enum kdtype dt, struct twin *d_wte, struct twin *d_wpe, int B, int T,
                               int C, int V)
{
    size_t N = (size_t)B * T;
    struct twin d_x = twin_rand(N * C, dt, 12, -1, 1);
    int *tok = random_ints(N, 13, V);
    int *d_tok = dev_ints(tok, N);
    void *scratch = dev_alloc(kernel_scratch_bytes(N, C));
    cr_assert_eq(
        kernel_embed_backward(d_wte->d, d_wpe->d, d_x.d, d_tok, B, T, C, V, dt, scratch, 0), 0);
    sync_ok();
    ops_embed_backward(d_wte->h, d_wpe->h, d_x.h, tok, B, T, C);
    twin_free(&d_x);
    free(tok);
    cudaFree(d_tok);
    cudaFree(scratch);
}

static void check_embed_backward(enum kdtype dt)
{
    need_gpu();
    const int B = 4, T = 13, C = 72, V = 11;
    struct twin d_wte = twin_rand((size_t)V * C, KDT_F32, 10, -1, 1);
    struct twin d_wpe = twin_rand((size_t)T * C, KDT_F32, 11, -1, 1);
    run_embed_backward(dt, &d_wte, &d_wpe, B, T, C, V);
    twin_check("embed backward d_wte", dt, &d_wte, TOL_EXACT);
    twin_check("embed backward d_wpe", dt, &d_wpe, TOL_EXACT);
    twin_free(&d_wte);
    twin_free(&d_wpe);
}

Test(kernels_gpu, embed_backward_matches_the_cpu_f32)
{
    check_embed_backward(KDT_F32);
}

Test(kernels_gpu, embed_backward_matches_the_cpu_bf16)
{
    check_embed_backward(KDT_BF16);
}

Test(kernels_gpu, embed_backward_matches_the_cpu_f16)
{
    check_embed_backward(KDT_F16);
}

Test(kernels_gpu, embed_backward_refuses_bad_input)
{
    cr_assert_eq(kernel_embed_backward(NULL, FAKEF, FAKE, FAKEI, 2, 3, 4, 5, KDT_F32, FAKE, 0),
                 -EINVAL);
    cr_assert_eq(kernel_embed_backward(FAKEF, NULL, FAKE, FAKEI, 2, 3, 4, 5, KDT_F32, FAKE, 0),
                 -EINVAL);
    cr_assert_eq(kernel_embed_backward(FAKEF, FAKEF, FAKE, FAKEI, 2, 3, 0, 5, KDT_F32, FAKE, 0),
                 -EINVAL);
    cr_assert_eq(kernel_embed_backward(FAKEF, FAKEF, FAKE, FAKEI, 2, 3, 4, 0, KDT_F32, FAKE, 0),
                 -EINVAL);
    cr_assert_eq(kernel_embed_backward(FAKEF, FAKEF, FAKE, FAKEI, 2, 3, 4, 5, BAD_DT, FAKE, 0),
                 -EINVAL);
}

/* ---- LayerNorm --------------------------------------------------------------------------- */

static void check_layernorm_forward(enum kdtype dt)
{
    need_gpu();
    const int N = 77, C = 96;
    struct twin inp = twin_rand((size_t)N * C, dt, 20, -1, 3); /* a mean away from 0 */
    struct twin w = twin_rand(C, dt, 21, 0.5f, 1.5f);
    struct twin b = twin_rand(C, dt, 22, -0.5f, 0.5f);
    struct twin out = twin_zeros((size_t)N * C, dt);
    struct twin mean = twin_zeros(N, KDT_F32), rstd = twin_zeros(N, KDT_F32);

    cr_assert_eq(kernel_layernorm_forward(out.d, mean.d, rstd.d, inp.d, w.d, b.d, N, C, dt, 0), 0);
    sync_ok();
    ops_layernorm_forward(out.h, mean.h, rstd.h, inp.h, w.h, b.h, N, C);
    twin_check("layernorm forward out", dt, &out, tol_for(dt, TOL_F32_SUM));
    /* Statistics are fp32 from the same (bf16-exact) input either way. */
    twin_check("layernorm forward mean", dt, &mean, TOL_F32_SUM);
    twin_check("layernorm forward rstd", dt, &rstd, TOL_F32_SUM);

    struct twin *all[] = {&inp, &w, &b, &out, &mean, &rstd};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        twin_free(all[i]);
}

Test(kernels_gpu, layernorm_forward_matches_the_cpu_f32)
{
    check_layernorm_forward(KDT_F32);
}

Test(kernels_gpu, layernorm_forward_matches_the_cpu_bf16)
{
    check_layernorm_forward(KDT_BF16);
}

Test(kernels_gpu, layernorm_forward_matches_the_cpu_f16)
{
    check_layernorm_forward(KDT_F16);
}

Test(kernels_gpu, layernorm_forward_refuses_bad_input)
{
    cr_assert_eq(kernel_layernorm_forward(NULL, FAKEF, FAKEF, FAKE, FAKE, FAKE, 4, 8, KDT_F32, 0),
                 -EINVAL);
    cr_assert_eq(kernel_layernorm_forward(FAKE, NULL, FAKEF, FAKE, FAKE, FAKE, 4, 8, KDT_F32, 0),
                 -EINVAL);
    cr_assert_eq(kernel_layernorm_forward(FAKE, FAKEF, FAKEF, FAKE, FAKE, NULL, 4, 8, KDT_F32, 0),
                 -EINVAL);
    cr_assert_eq(kernel_layernorm_forward(FAKE, FAKEF, FAKEF, FAKE, FAKE, FAKE, 0, 8, KDT_F32, 0),
                 -EINVAL);
    cr_assert_eq(kernel_layernorm_forward(FAKE, FAKEF, FAKEF, FAKE, FAKE, FAKE, 4, -8, KDT_F32, 0),
                 -EINVAL);
    cr_assert_eq(kernel_layernorm_forward(FAKE, FAKEF, FAKEF, FAKE, FAKE, FAKE, 4, 8, BAD_DT, 0),
                 -EINVAL);
}

/* The statistics come from the CPU forward and go to both twins, so the backward is
 * compared on its own. dw, db (and d_inp with accumulate) start non-zero. in_place: d_inp
 * is d_out, which both twins allow. */
static void check_layernorm_backward(enum kdtype dt, int accumulate, int in_place)
{
    need_gpu();
    const int N = 300, C = 96; /* 300 rows: four full chunks and a ragged one */
    size_t NC = (size_t)N * C;
    struct twin inp = twin_rand(NC, dt, 30, -1, 3);
    struct twin w = twin_rand(C, dt, 31, 0.5f, 1.5f);
    struct twin d_out = twin_rand(NC, dt, 32, -1, 1);
    struct twin dw = twin_rand(C, KDT_F32, 33, -1, 1), db = twin_rand(C, KDT_F32, 34, -1, 1);
    struct twin d_inp = in_place ? d_out : twin_rand(NC, dt, 35, -1, 1);
    float *out = falloc(NC), *zero = falloc(C), *mean_h = falloc(N), *rstd_h = falloc(N);
    ops_layernorm_forward(out, mean_h, rstd_h, inp.h, w.h, zero, N, C);
    struct twin mean = twin_of(mean_h, N, KDT_F32), rstd = twin_of(rstd_h, N, KDT_F32);
    void *scratch = dev_alloc(kernel_scratch_bytes(N, 2 * (size_t)C));

    cr_assert_eq(kernel_layernorm_backward(d_inp.d, accumulate, dw.d, db.d, d_out.d, inp.d, w.d,
                                           mean.d, rstd.d, N, C, dt, scratch, 0),
                 0);
    sync_ok();
    ops_layernorm_backward(d_inp.h, accumulate, dw.h, db.h, d_out.h, inp.h, w.h, mean.h, rstd.h, N,
                           C);
    twin_check("layernorm backward d_inp", dt, &d_inp, tol_for(dt, TOL_F32_SUM));
    twin_check("layernorm backward dw", dt, &dw, tol_for(dt, TOL_F32_SUM));
    twin_check("layernorm backward db", dt, &db, tol_for(dt, TOL_F32_SUM));

    if (!in_place) twin_free(&d_inp);
    struct twin *all[] = {&inp, &w, &d_out, &dw, &db, &mean, &rstd};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        twin_free(all[i]);
    free(out);
    free(zero);
    free(mean_h);
    free(rstd_h);
    cudaFree(scratch);
}

Test(kernels_gpu, layernorm_backward_matches_the_cpu_f32)
{
    check_layernorm_backward(KDT_F32, 1, 0);
    check_layernorm_backward(KDT_F32, 0, 0);
}

Test(kernels_gpu, layernorm_backward_matches_the_cpu_bf16)
{
    check_layernorm_backward(KDT_BF16, 1, 0);
    check_layernorm_backward(KDT_BF16, 0, 0);
}

Test(kernels_gpu, layernorm_backward_matches_the_cpu_f16)
{
    check_layernorm_backward(KDT_F16, 1, 0);
    check_layernorm_backward(KDT_F16, 0, 0);
}

Test(kernels_gpu, layernorm_backward_in_place_on_d_out)
{
    check_layernorm_backward(KDT_F32, 1, 1);
    check_layernorm_backward(KDT_BF16, 0, 1);
    check_layernorm_backward(KDT_F16, 1, 1);
}

Test(kernels_gpu, layernorm_backward_refuses_bad_input)
{
    cr_assert_eq(kernel_layernorm_backward(NULL, 1, FAKEF, FAKEF, FAKE, FAKE, FAKE, FAKEF, FAKEF, 4,
                                           8, KDT_F32, FAKE, 0),
                 -EINVAL);
    cr_assert_eq(kernel_layernorm_backward(FAKE, 1, NULL, FAKEF, FAKE, FAKE, FAKE, FAKEF, FAKEF, 4,
                                           8, KDT_F32, FAKE, 0),
                 -EINVAL);
    cr_assert_eq(kernel_layernorm_backward(FAKE, 1, FAKEF, FAKEF, FAKE, FAKE, FAKE, FAKEF, NULL, 4,
                                           8, KDT_F32, FAKE, 0),
                 -EINVAL);
    cr_assert_eq(kernel_layernorm_backward(FAKE, 1, FAKEF, FAKEF, FAKE, FAKE, FAKE, FAKEF, FAKEF, 4,
                                           8, KDT_F32, NULL, 0),
                 -EINVAL);
    cr_assert_eq(kernel_layernorm_backward(FAKE, 1, FAKEF, FAKEF, FAKE, FAKE, FAKE, FAKEF, FAKEF, 0,
                                           8, KDT_F32, FAKE, 0),
                 -EINVAL);
    cr_assert_eq(kernel_layernorm_backward(FAKE, 1, FAKEF, FAKEF, FAKE, FAKE, FAKE, FAKEF, FAKEF, 4,
                                           8, BAD_DT, FAKE, 0),
                 -EINVAL);
}

/* ---- linear layers and column sums ------------------------------------------------------- */

enum residual_mode { RES_NONE, RES_SEPARATE, RES_IN_PLACE };

/* out (N,OC) in out_dt = [residual] + [bias] + inp @ W^T. The CPU twin always takes a bias,
 * so "no bias" gives it zeros. */
static void check_matmul_forward(enum kdtype dt, enum kdtype out_dt, int with_bias,
                                 enum residual_mode res)
{
    need_gpu();
    const int N = 77, IC = 96, OC = 200;
    size_t NO = (size_t)N * OC;
    cublasHandle_t h = blas_new();
    struct twin inp = twin_rand((size_t)N * IC, dt, 40, -1, 1);
    struct twin W = twin_rand((size_t)OC * IC, dt, 41, -1, 1);
    struct twin bias = with_bias ? twin_rand(OC, dt, 42, -1, 1) : twin_zeros(OC, dt);
    struct twin out = res == RES_IN_PLACE ? twin_rand(NO, out_dt, 43, -2, 2)
                                          : twin_rand(NO, out_dt, 44, 100, 200); /* garbage */
    struct twin resid = res == RES_SEPARATE ? twin_rand(NO, out_dt, 45, -2, 2) : out;
    const void *res_d = res == RES_NONE ? NULL : resid.d;
    const float *res_h = res == RES_NONE ? NULL : resid.h;
    void *scratch = dev_alloc(kernel_scratch_bytes(N, OC));

    cr_assert_eq(kernel_matmul_forward(h, out.d, out_dt, inp.d, W.d, with_bias ? bias.d : NULL,
                                       res_d, N, IC, OC, dt, scratch, 0),
                 0);
    sync_ok();
    ops_linear_forward(out.h, inp.h, W.h, bias.h, res_h, N, IC, OC);
    char what[96];
    snprintf(what, sizeof(what), "matmul forward out (%s out, %s bias, residual %s)",
             dt_name(out_dt), with_bias ? "with" : "no",
             res == RES_NONE       ? "none"
             : res == RES_SEPARATE ? "separate"
                                   : "in place");
    twin_check(what, dt, &out, tol_for(dt, TOL_F32_SUM));

    if (res == RES_SEPARATE) twin_free(&resid);
    twin_free(&inp);
    twin_free(&W);
    twin_free(&bias);
    twin_free(&out);
    cudaFree(scratch);
    cublasDestroy(h);
}

Test(kernels_gpu, matmul_forward_matches_the_cpu_f32)
{
    check_matmul_forward(KDT_F32, KDT_F32, 1, RES_SEPARATE);
    check_matmul_forward(KDT_F32, KDT_F32, 1, RES_IN_PLACE);
    check_matmul_forward(KDT_F32, KDT_F32, 0, RES_NONE);
    check_matmul_forward(KDT_F32, KDT_F32, 0, RES_IN_PLACE);
    check_matmul_forward(KDT_F32, KDT_F32, 1, RES_NONE);
}

/* A 16-bit dt: out in dt with each residual mode, and out in fp32 (the logits of the head). */
static void check_matmul_forward_16(enum kdtype dt)
{
    check_matmul_forward(dt, dt, 1, RES_SEPARATE);
    check_matmul_forward(dt, dt, 0, RES_IN_PLACE);
    check_matmul_forward(dt, dt, 1, RES_NONE);
    check_matmul_forward(dt, KDT_F32, 0, RES_NONE);
    check_matmul_forward(dt, KDT_F32, 1, RES_SEPARATE);
}

Test(kernels_gpu, matmul_forward_matches_the_cpu_bf16)
{
    check_matmul_forward_16(KDT_BF16);
}

Test(kernels_gpu, matmul_forward_matches_the_cpu_f16)
{
    check_matmul_forward_16(KDT_F16);
}

Test(kernels_gpu, matmul_forward_refuses_bad_input)
{
    cublasHandle_t hb = (cublasHandle_t)FAKE;
    cr_assert_eq(kernel_matmul_forward(NULL, FAKE, KDT_F32, FAKE, FAKE, NULL, NULL, 4, 8, 8,
                                       KDT_F32, FAKE, 0),
                 -EINVAL);
    cr_assert_eq(
        kernel_matmul_forward(hb, NULL, KDT_F32, FAKE, FAKE, NULL, NULL, 4, 8, 8, KDT_F32, FAKE, 0),
        -EINVAL);
    cr_assert_eq(
        kernel_matmul_forward(hb, FAKE, KDT_F32, NULL, FAKE, NULL, NULL, 4, 8, 8, KDT_F32, FAKE, 0),
        -EINVAL);
    cr_assert_eq(
        kernel_matmul_forward(hb, FAKE, KDT_F32, FAKE, FAKE, NULL, NULL, 4, 0, 8, KDT_F32, FAKE, 0),
        -EINVAL);
    cr_assert_eq(kernel_matmul_forward(hb, FAKE, KDT_F32, FAKE, FAKE, NULL, NULL, 4, 8, -8, KDT_F32,
                                       FAKE, 0),
                 -EINVAL);
    cr_assert_eq(
        kernel_matmul_forward(hb, FAKE, BAD_DT, FAKE, FAKE, NULL, NULL, 4, 8, 8, KDT_F32, FAKE, 0),
        -EINVAL);
    /* cuBLAS has no fp32 x fp32 -> bf16 GEMM, nor one that mixes bf16 and fp16. */
    cr_assert_eq(kernel_matmul_forward(hb, FAKE, KDT_BF16, FAKE, FAKE, NULL, NULL, 4, 8, 8, KDT_F32,
                                       FAKE, 0),
                 -EINVAL);
    cr_assert_eq(kernel_matmul_forward(hb, FAKE, KDT_F16, FAKE, FAKE, NULL, NULL, 4, 8, 8, KDT_BF16,
                                       FAKE, 0),
                 -EINVAL);
    cr_assert_eq(kernel_matmul_forward(hb, FAKE, KDT_BF16, FAKE, FAKE, NULL, NULL, 4, 8, 8, KDT_F16,
                                       FAKE, 0),
                 -EINVAL);
}

/* d_inp is overwritten (it starts as garbage); dW and db accumulate. The CPU twin always
 * sums into a db, so "no db" gives it a dummy. */
static void check_matmul_backward(enum kdtype dt, int with_db)
{
    need_gpu();
    const int N = 77, IC = 96, OC = 200;
    cublasHandle_t h = blas_new();
    struct twin d_out = twin_rand((size_t)N * OC, dt, 50, -1, 1);
    struct twin inp = twin_rand((size_t)N * IC, dt, 51, -1, 1);
    struct twin W = twin_rand((size_t)OC * IC, dt, 52, -1, 1);
    struct twin d_inp = twin_rand((size_t)N * IC, dt, 53, 100, 200);
    struct twin dW = twin_rand((size_t)OC * IC, KDT_F32, 54, -1, 1);
    struct twin db = twin_rand(OC, KDT_F32, 55, -1, 1);
    void *scratch = dev_alloc(kernel_scratch_bytes(N, OC));

    cr_assert_eq(kernel_matmul_backward(h, d_inp.d, dW.d, with_db ? db.d : NULL, d_out.d, inp.d,
                                        W.d, N, IC, OC, dt, scratch, 0),
                 0);
    sync_ok();
    ops_linear_backward(d_inp.h, dW.h, db.h, d_out.h, inp.h, W.h, N, IC, OC);
    twin_check("matmul backward d_inp", dt, &d_inp, tol_for(dt, TOL_F32_SUM));
    twin_check("matmul backward dW", dt, &dW, tol_for(dt, TOL_F32_SUM));
    if (with_db) {
        twin_check("matmul backward db", dt, &db, tol_for(dt, TOL_F32_SUM));
    } else {
        float *got = twin_download(&db), *start = falloc(OC);
        random_floats(start, OC, 55, -1, 1);
        expect_close("matmul backward db untouched when NULL", got, start, OC, TOL_EXACT);
        free(got);
        free(start);
    }

    struct twin *all[] = {&d_out, &inp, &W, &d_inp, &dW, &db};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        twin_free(all[i]);
    cudaFree(scratch);
    cublasDestroy(h);
}

Test(kernels_gpu, matmul_backward_matches_the_cpu_f32)
{
    check_matmul_backward(KDT_F32, 1);
    check_matmul_backward(KDT_F32, 0);
}

Test(kernels_gpu, matmul_backward_matches_the_cpu_bf16)
{
    check_matmul_backward(KDT_BF16, 1);
    check_matmul_backward(KDT_BF16, 0);
}

Test(kernels_gpu, matmul_backward_matches_the_cpu_f16)
{
    check_matmul_backward(KDT_F16, 1);
    check_matmul_backward(KDT_F16, 0);
}

Test(kernels_gpu, matmul_backward_refuses_bad_input)
{
    cublasHandle_t hb = (cublasHandle_t)FAKE;
    cr_assert_eq(kernel_matmul_backward(NULL, FAKE, FAKEF, FAKEF, FAKE, FAKE, FAKE, 4, 8, 8,
                                        KDT_F32, FAKE, 0),
                 -EINVAL);
    cr_assert_eq(
        kernel_matmul_backward(hb, FAKE, NULL, FAKEF, FAKE, FAKE, FAKE, 4, 8, 8, KDT_F32, FAKE, 0),
        -EINVAL);
    cr_assert_eq(
        kernel_matmul_backward(hb, FAKE, FAKEF, FAKEF, NULL, FAKE, FAKE, 4, 8, 8, KDT_F32, FAKE, 0),
        -EINVAL);
    /* A bias gradient needs scratch for its column sums. */
    cr_assert_eq(
        kernel_matmul_backward(hb, FAKE, FAKEF, FAKEF, FAKE, FAKE, FAKE, 4, 8, 8, KDT_F32, NULL, 0),
        -EINVAL);
    cr_assert_eq(
        kernel_matmul_backward(hb, FAKE, FAKEF, FAKEF, FAKE, FAKE, FAKE, 0, 8, 8, KDT_F32, FAKE, 0),
        -EINVAL);
    cr_assert_eq(
        kernel_matmul_backward(hb, FAKE, FAKEF, FAKEF, FAKE, FAKE, FAKE, 4, 8, 8, BAD_DT, FAKE, 0),
        -EINVAL);
}

static void check_colsum(enum kdtype dt, int N, int OC)
{
    need_gpu();
    struct twin x = twin_rand((size_t)N * OC, dt, 60, -1, 1);
    struct twin acc = twin_rand(OC, KDT_F32, 61, -1, 1);
    void *scratch = dev_alloc(kernel_scratch_bytes(N, OC));
    cr_assert_eq(kernel_colsum(acc.d, x.d, N, OC, dt, scratch, 0), 0);
    sync_ok();
    ops_colsum_acc(acc.h, x.h, N, OC);
    /* The sums are fp32 either way; only the input was rounded to bf16. */
    twin_check("colsum acc", dt, &acc, TOL_F32_SUM);
    twin_free(&x);
    twin_free(&acc);
    cudaFree(scratch);
}

Test(kernels_gpu, colsum_matches_the_cpu_f32)
{
    check_colsum(KDT_F32, 1000, 72);
    check_colsum(KDT_F32, 13, 96); /* fewer rows than a chunk */
}

Test(kernels_gpu, colsum_matches_the_cpu_bf16)
{
    check_colsum(KDT_BF16, 1000, 72);
}

Test(kernels_gpu, colsum_matches_the_cpu_f16)
{
    check_colsum(KDT_F16, 1000, 72);
}

Test(kernels_gpu, colsum_refuses_bad_input)
{
    cr_assert_eq(kernel_colsum(NULL, FAKE, 4, 8, KDT_F32, FAKE, 0), -EINVAL);
    cr_assert_eq(kernel_colsum(FAKEF, NULL, 4, 8, KDT_F32, FAKE, 0), -EINVAL);
    cr_assert_eq(kernel_colsum(FAKEF, FAKE, 4, 8, KDT_F32, NULL, 0), -EINVAL);
    cr_assert_eq(kernel_colsum(FAKEF, FAKE, 0, 8, KDT_F32, FAKE, 0), -EINVAL);
    cr_assert_eq(kernel_colsum(FAKEF, FAKE, 4, 0, KDT_F32, FAKE, 0), -EINVAL);
    cr_assert_eq(kernel_colsum(FAKEF, FAKE, 4, 8, BAD_DT, FAKE, 0), -EINVAL);
}

Test(kernels_gpu, scratch_bytes_cover_every_reduction)
{
    /* No GPU needed: plain arithmetic. At least a float per (chunk, column), and room for
     * the sum of squares' per-block doubles. */
    cr_assert_geq(kernel_scratch_bytes(1, 1), sizeof(double));
    cr_assert_geq(kernel_scratch_bytes(1000, 72), 72 * sizeof(float));
    cr_assert_geq(kernel_scratch_bytes(2000, 72), kernel_scratch_bytes(1000, 72));
    cr_assert_geq(kernel_scratch_bytes(1000, 144), kernel_scratch_bytes(1000, 72));
}

/* ---- elementwise: add, GELU, cast -------------------------------------------------------- */

static void check_add(enum kdtype dt, int in_place)
{
    need_gpu();
    const size_t n = 100003;
    struct twin a = twin_rand(n, dt, 70, -2, 2), b = twin_rand(n, dt, 71, -2, 2);
    struct twin out = in_place ? a : twin_zeros(n, dt);
    cr_assert_eq(kernel_add(out.d, a.d, b.d, n, dt, 0), 0);
    sync_ok();
    ops_add(out.h, a.h, b.h, n);
    twin_check(in_place ? "add out (out = a)" : "add out", dt, &out, tol_for(dt, TOL_F32));
    if (!in_place) twin_free(&out);
    twin_free(&a);
    twin_free(&b);
}

Test(kernels_gpu, add_matches_the_cpu_f32)
{
    check_add(KDT_F32, 0);
    check_add(KDT_F32, 1);
}

Test(kernels_gpu, add_matches_the_cpu_bf16)
{
    check_add(KDT_BF16, 0);
    check_add(KDT_BF16, 1);
}

Test(kernels_gpu, add_matches_the_cpu_f16)
{
    check_add(KDT_F16, 0);
    check_add(KDT_F16, 1);
}

Test(kernels_gpu, add_refuses_bad_input)
{
    cr_assert_eq(kernel_add(NULL, FAKE, FAKE, 8, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_add(FAKE, NULL, FAKE, 8, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_add(FAKE, FAKE, NULL, 8, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_add(FAKE, FAKE, FAKE, 0, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_add(FAKE, FAKE, FAKE, 8, BAD_DT, 0), -EINVAL);
}

static void check_gelu(enum kdtype dt)
{
    need_gpu();
    const size_t n = 100003;
    struct twin inp = twin_rand(n, dt, 80, -5, 5);
    struct twin out = twin_zeros(n, dt);
    struct twin d = twin_rand(n, dt, 81, -1, 1);
    cr_assert_eq(kernel_gelu_forward(out.d, inp.d, n, dt, 0), 0);
    cr_assert_eq(kernel_gelu_backward(d.d, inp.d, n, dt, 0), 0);
    sync_ok();
    ops_gelu_forward(out.h, inp.h, n);
    ops_gelu_backward(d.h, inp.h, n);
    /* Near x = -5, 1 + tanh(u) and 1 - tanh(u)^2 cancel to ~1e-4: the GPU's tanhf (2 ulp)
     * and glibc's (1 ulp) then differ by up to ~2e-6 absolute in the derivative. */
    struct tol t = {1e-5, 1e-5, 0, "fp32 1e-5 + 1e-5|x| (tanh cancellation)"};
    twin_check("gelu forward out", dt, &out, tol_for(dt, t));
    twin_check("gelu backward d", dt, &d, tol_for(dt, t));
    twin_free(&inp);
    twin_free(&out);
    twin_free(&d);
}

Test(kernels_gpu, gelu_matches_the_cpu_f32)
{
    check_gelu(KDT_F32);
}

Test(kernels_gpu, gelu_matches_the_cpu_bf16)
{
    check_gelu(KDT_BF16);
}

Test(kernels_gpu, gelu_matches_the_cpu_f16)
{
    check_gelu(KDT_F16);
}

Test(kernels_gpu, gelu_refuses_bad_input)
{
    cr_assert_eq(kernel_gelu_forward(NULL, FAKE, 8, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_gelu_forward(FAKE, NULL, 8, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_gelu_forward(FAKE, FAKE, 0, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_gelu_forward(FAKE, FAKE, 8, BAD_DT, 0), -EINVAL);
    cr_assert_eq(kernel_gelu_backward(NULL, FAKE, 8, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_gelu_backward(FAKE, NULL, 8, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_gelu_backward(FAKE, FAKE, 0, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_gelu_backward(FAKE, FAKE, 8, BAD_DT, 0), -EINVAL);
}

/* fp32 -> t and back on the GPU against the CPU casts, bit for bit: random values, exact
 * ties, signed zeros, infinities, subnormals of both types and magnitudes that overflow t.
 * NaN only has to stay NaN (the GPU gives the canonical NaN). specials holds nspecials values
 * chosen for t. */
static void check_cast(const struct type16 *t, const float *specials, size_t nspecials)
{
    need_gpu();
    const size_t n = 4099;
    const char *name = dt_name(t->dt);
    float *src = falloc(n);
    random_floats(src, n, 90, -1000, 1000);
    for (size_t i = 0; i < nspecials; i++)
        src[i] = specials[i];
    src[n - 1] = NAN;

    float *d_f32 = dev_alloc(n * 4), *back = falloc(n);
    uint16_t *d_16 = dev_alloc(n * 2), *got = malloc(n * 2);
    cr_assert(got);
    cr_assert_eq(cudaMemcpy(d_f32, src, n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(kernel_cast(d_16, t->dt, d_f32, KDT_F32, n, 0), 0);
    cr_assert_eq(cudaMemset(d_f32, 0, n * 4), cudaSuccess);
    cr_assert_eq(kernel_cast(d_f32, KDT_F32, d_16, t->dt, n, 0), 0);
    sync_ok();
    cr_assert_eq(cudaMemcpy(got, d_16, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(cudaMemcpy(back, d_f32, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);

    size_t mismatches = 0, first = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        if (got[i] != t->narrow(src[i]) && !mismatches++) first = i;
        uint32_t a, b;
        float wf = t->widen(got[i]);
        memcpy(&a, &wf, 4);
        memcpy(&b, &back[i], 4);
        cr_assert_eq(a, b, "%s -> fp32 of %#06x: got %#010x", name, got[i], b);
    }
    cr_log_info("cast fp32 -> %s: %zu of %zu differ from the CPU's (tolerance exact)", name,
                mismatches, n - 1);
    cr_assert_eq(mismatches, 0, "fp32 %.9g -> %s: gpu %#06x, cpu %#06x", src[first], name,
                 got[first], t->narrow(src[first]));
    cr_assert(isnan(t->widen(got[n - 1])) && isnan(back[n - 1]), "NaN must stay NaN");

    /* Same-type casts are copies. */
    float *d_copy = dev_alloc(n * 4);
    cr_assert_eq(kernel_cast(d_copy, KDT_F32, d_f32, KDT_F32, n - 1, 0), 0);
    float *copy = falloc(n);
    sync_ok();
    cr_assert_eq(cudaMemcpy(copy, d_copy, (n - 1) * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(memcmp(copy, back, (n - 1) * 4), 0);

    cudaFree(d_f32);
    cudaFree(d_16);
    cudaFree(d_copy);
    free(src);
    free(back);
    free(got);
    free(copy);
}

Test(kernels_gpu, cast_matches_the_cpu_bit_for_bit)
{
    /* 1 + k 2^-8 + 2^-9 lies half-way between two bf16. */
    const float bf16_specials[] = {0.0f,
                                   -0.0f,
                                   INFINITY,
                                   -INFINITY,
                                   1e-40f,
                                   -3e-39f,
                                   3.4e38f,
                                   -3.4e38f,
                                   1.0f + 0x1p-9f,
                                   1.0f + 0x1p-8f + 0x1p-9f,
                                   -(1.0f + 0x1p-9f),
                                   0x1p-130f + 0x1p-138f};
    check_cast(&T_BF16, bf16_specials, sizeof(bf16_specials) / sizeof(bf16_specials[0]));
}

Test(kernels_gpu, cast_matches_the_cpu_bit_for_bit_f16)
{
    /* 1 + k 2^-10 + 2^-11 lies half-way between two fp16; 65504 is the largest fp16 and
     * 65520 half-way to the next power of two (rounds to infinity); 2^-24 is the smallest
     * subnormal, 2^-25 half of it (rounds to zero, even) and 3 2^-26 past half (rounds up). */
    const float f16_specials[] = {0.0f,
                                  -0.0f,
                                  INFINITY,
                                  -INFINITY,
                                  1.0f + 0x1p-11f,
                                  1.0f + 0x1p-10f + 0x1p-11f,
                                  -(1.0f + 0x1p-11f),
                                  65504.0f,
                                  65519.0f,
                                  65520.0f,
                                  -1e5f,
                                  0x1p-24f,
                                  0x1p-25f,
                                  3 * 0x1p-26f,
                                  -0x1p-20f - 0x1p-25f,
                                  6.1e-5f,
                                  1e-40f,
                                  3e38f};
    check_cast(&T_F16, f16_specials, sizeof(f16_specials) / sizeof(f16_specials[0]));
}

/* bf16 <-> fp16 on the GPU is one rounding of the exact widening, as on the CPU. */
Test(kernels_gpu, cast_between_bf16_and_f16_rounds_once)
{
    need_gpu();
    const size_t n = 65536;
    uint16_t *all = malloc(n * 2), *got = malloc(n * 2);
    cr_assert(all && got);
    for (size_t i = 0; i < n; i++)
        all[i] = (uint16_t)i; /* every 16-bit pattern */
    uint16_t *d_in = dev_alloc(n * 2), *d_out = dev_alloc(n * 2);
    cr_assert_eq(cudaMemcpy(d_in, all, n * 2, cudaMemcpyHostToDevice), cudaSuccess);
    const struct type16 *pairs[2][2] = {{&T_BF16, &T_F16}, {&T_F16, &T_BF16}};
    for (int k = 0; k < 2; k++) {
        const struct type16 *from = pairs[k][0], *to = pairs[k][1];
        cr_assert_eq(kernel_cast(d_out, to->dt, d_in, from->dt, n, 0), 0);
        sync_ok();
        cr_assert_eq(cudaMemcpy(got, d_out, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) {
            float x = from->widen(all[i]);
            if (isnan(x))
                bad += !isnan(to->widen(got[i]));
            else
                bad += got[i] != to->narrow(x);
        }
        cr_log_info("cast %s -> %s: %zu of %zu patterns differ from the CPU's (tolerance exact)",
                    dt_name(from->dt), dt_name(to->dt), bad, n);
        cr_assert_eq(bad, 0);
    }
    cudaFree(d_in);
    cudaFree(d_out);
    free(all);
    free(got);
}

Test(kernels_gpu, cast_refuses_bad_input)
{
    cr_assert_eq(kernel_cast(NULL, KDT_BF16, FAKE, KDT_F32, 8, 0), -EINVAL);
    cr_assert_eq(kernel_cast(FAKE, KDT_BF16, NULL, KDT_F32, 8, 0), -EINVAL);
    cr_assert_eq(kernel_cast(FAKE, KDT_BF16, FAKE, KDT_F32, 0, 0), -EINVAL);
    cr_assert_eq(kernel_cast(FAKE, BAD_DT, FAKE, KDT_F32, 8, 0), -EINVAL);
    cr_assert_eq(kernel_cast(FAKE, KDT_BF16, FAKE, BAD_DT, 8, 0), -EINVAL);
}

/* ---- attention --------------------------------------------------------------------------- */

/* Forward, then the backward on the CPU forward's att (given to both twins, so the backward
 * is compared on its own). d_qkv starts as garbage on the GPU: it must be overwritten. */
static void check_attention(enum kdtype dt, int B, int T, int C, int NH)
{
    need_gpu();
    size_t BT = (size_t)B * T, natt = (size_t)B * NH * T * T;
    struct twin qkv = twin_rand(BT * 3 * C, dt, 100 + T, -1, 1);
    struct twin y = twin_zeros(BT * C, dt);
    struct twin att = twin_rand(natt, KDT_F32, 101, 5, 6); /* garbage: fully overwritten */
    cr_assert_eq(kernel_attention_forward(y.d, att.d, qkv.d, B, T, C, NH, dt, 0), 0);
    sync_ok();
    ops_attention_forward(y.h, att.h, qkv.h, B, T, C, NH);
    char what[96];
    snprintf(what, sizeof(what), "attention forward y (B %d T %d C %d NH %d)", B, T, C, NH);
    twin_check(what, dt, &y, tol_for(dt, TOL_F32_SUM));
    /* Probabilities are fp32 from the same (bf16-exact) qkv either way. */
    twin_check("attention forward att", dt, &att, TOL_F32_SUM);

    struct twin att_in = twin_of(att.h, natt, KDT_F32);
    struct twin d_y = twin_rand(BT * C, dt, 102, -1, 1);
    struct twin d_qkv = twin_rand(BT * 3 * C, dt, 103, 100, 200);
    float *d_att = dev_alloc(natt * sizeof(float));
    float *d_row = falloc((size_t)B * NH * T);
    cr_assert_eq(
        kernel_attention_backward(d_qkv.d, d_att, d_y.d, qkv.d, att_in.d, B, T, C, NH, dt, 0), 0);
    sync_ok();
    ops_attention_backward(d_qkv.h, d_row, d_y.h, qkv.h, att_in.h, B, T, C, NH);
    snprintf(what, sizeof(what), "attention backward d_qkv (B %d T %d C %d NH %d)", B, T, C, NH);
    twin_check(what, dt, &d_qkv, tol_for(dt, TOL_F32_SUM));

    struct twin *all[] = {&qkv, &y, &att, &att_in, &d_y, &d_qkv};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        twin_free(all[i]);
    cudaFree(d_att);
    free(d_row);
}

Test(kernels_gpu, attention_matches_the_cpu_f32)
{
    check_attention(KDT_F32, 2, 13, 96, 4);
    check_attention(KDT_F32, 1, 150, 72, 3); /* more keys than threads in a block */
}

Test(kernels_gpu, attention_matches_the_cpu_bf16)
{
    check_attention(KDT_BF16, 2, 13, 96, 4);
    check_attention(KDT_BF16, 1, 150, 72, 3);
}

Test(kernels_gpu, attention_matches_the_cpu_f16)
{
    check_attention(KDT_F16, 2, 13, 96, 4);
    check_attention(KDT_F16, 1, 150, 72, 3);
}

Test(kernels_gpu, attention_refuses_bad_input)
{
    cr_assert_eq(kernel_attention_forward(NULL, FAKEF, FAKE, 2, 4, 8, 2, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_attention_forward(FAKE, NULL, FAKE, 2, 4, 8, 2, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_attention_forward(FAKE, FAKEF, NULL, 2, 4, 8, 2, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_attention_forward(FAKE, FAKEF, FAKE, 2, 0, 8, 2, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_attention_forward(FAKE, FAKEF, FAKE, 2, 4, 8, 3, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_attention_forward(FAKE, FAKEF, FAKE, 2, 4, 8, 0, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_attention_forward(FAKE, FAKEF, FAKE, 2, 4, 8, 2, BAD_DT, 0), -EINVAL);
    cr_assert_eq(kernel_attention_backward(NULL, FAKEF, FAKE, FAKE, FAKEF, 2, 4, 8, 2, KDT_F32, 0),
                 -EINVAL);
    cr_assert_eq(kernel_attention_backward(FAKE, FAKEF, FAKE, FAKE, NULL, 2, 4, 8, 2, KDT_F32, 0),
                 -EINVAL);
    cr_assert_eq(kernel_attention_backward(FAKE, NULL, FAKE, FAKE, FAKEF, 2, 4, 8, 2, KDT_F32, 0),
                 -EINVAL);
    cr_assert_eq(kernel_attention_backward(FAKE, FAKEF, FAKE, FAKE, FAKEF, -2, 4, 8, 2, KDT_F32, 0),
                 -EINVAL);
    cr_assert_eq(kernel_attention_backward(FAKE, FAKEF, FAKE, FAKE, FAKEF, 2, 4, 8, 3, KDT_F32, 0),
                 -EINVAL);
    cr_assert_eq(kernel_attention_backward(FAKE, FAKEF, FAKE, FAKE, FAKEF, 2, 4, 8, 2, BAD_DT, 0),
                 -EINVAL);
}

/* ---- cross-entropy ----------------------------------------------------------------------- */

/* mode 0: losses only; 1: dlogits in a separate buffer; 2: dlogits over logits (fp32).
 * scale is the loss scale: the CPU twin's gradient times scale (a power of two, so the
 * product is exact) is what the kernel must give. */
static void check_crossentropy(enum kdtype dt, int mode, float scale)
{
    need_gpu();
    const int N = 37, V = 1003;
    size_t NV = (size_t)N * V;
    struct twin logits = twin_rand(NV, KDT_F32, 110, -4, 4);
    struct twin losses = twin_zeros(N, KDT_F32);
    struct twin dl = mode == 1 ? twin_zeros(NV, dt) : logits;
    int *tgt = random_ints(N, 111, V);
    int *d_tgt = dev_ints(tgt, N);
    cr_assert_eq(
        kernel_crossentropy(losses.d, mode ? dl.d : NULL, logits.d, d_tgt, N, V, scale, dt, 0), 0);
    sync_ok();
    /* The CPU twin writes its gradient over its logits. */
    float *cpu_logits = falloc(NV);
    memcpy(cpu_logits, logits.h, NV * sizeof(float));
    ops_crossentropy(cpu_logits, losses.h, tgt, N, V, mode != 0);
    twin_check("crossentropy losses", dt, &losses, TOL_F32);
    if (mode) {
        for (size_t i = 0; i < NV; i++)
            dl.h[i] = cpu_logits[i] * scale;
        /* dlogits are ~scale/(N V): the relative tolerance is what matters in fp32. */
        struct tol t = {1e-9 * scale, 1e-5, 0, "fp32 1e-9 scale + 1e-5|x|"};
        char what[96];
        snprintf(what, sizeof(what), "crossentropy dlogits%s, loss scale %g",
                 mode == 2 ? " (over logits)" : "", scale);
        twin_check(what, dt, &dl, tol_for(dt, t));
    }
    if (mode == 1) twin_free(&dl);
    twin_free(&logits);
    twin_free(&losses);
    free(cpu_logits);
    free(tgt);
    cudaFree(d_tgt);
}

Test(kernels_gpu, crossentropy_matches_the_cpu_f32)
{
    check_crossentropy(KDT_F32, 0, 1.0f);
    check_crossentropy(KDT_F32, 1, 1.0f);
    check_crossentropy(KDT_F32, 2, 1.0f);
    check_crossentropy(KDT_F32, 2, 8.0f);
}

Test(kernels_gpu, crossentropy_matches_the_cpu_bf16)
{
    check_crossentropy(KDT_BF16, 1, 1.0f);
}

Test(kernels_gpu, crossentropy_matches_the_cpu_f16)
{
    check_crossentropy(KDT_F16, 1, 1.0f);
    /* fp16 training's first loss scale (2^16, DeepSpeed's initial_scale_power): the
     * gradients ~1/(N V) that fp16 holds only as subnormals come out in its normal range. */
    check_crossentropy(KDT_F16, 1, 65536.0f);
}

Test(kernels_gpu, crossentropy_refuses_bad_input)
{
    cr_assert_eq(kernel_crossentropy(NULL, FAKE, FAKEF, FAKEI, 4, 8, 1.0f, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKE, NULL, FAKEI, 4, 8, 1.0f, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKE, FAKEF, NULL, 4, 8, 1.0f, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKE, FAKEF, FAKEI, 0, 8, 1.0f, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKE, FAKEF, FAKEI, 4, -8, 1.0f, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKE, FAKEF, FAKEI, 4, 8, 1.0f, BAD_DT, 0), -EINVAL);
    /* 16-bit dlogits cannot overwrite fp32 logits in place. */
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKEF, FAKEF, FAKEI, 4, 8, 1.0f, KDT_BF16, 0), -EINVAL);
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKEF, FAKEF, FAKEI, 4, 8, 1.0f, KDT_F16, 0), -EINVAL);
    /* A loss scale is positive and finite. */
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKE, FAKEF, FAKEI, 4, 8, 0.0f, KDT_F16, 0), -EINVAL);
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKE, FAKEF, FAKEI, 4, 8, -2.0f, KDT_F16, 0), -EINVAL);
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKE, FAKEF, FAKEI, 4, 8, INFINITY, KDT_F16, 0),
                 -EINVAL);
    cr_assert_eq(kernel_crossentropy(FAKEF, FAKE, FAKEF, FAKEI, 4, 8, NAN, KDT_F16, 0), -EINVAL);
}

/* ---- optimizer: AdamW and the sum of squares --------------------------------------------- */

struct adam_state {
    struct twin p, g, m, v;
};

static struct adam_state adam_state_new(size_t n)
{
    struct adam_state s = {
        twin_rand(n, KDT_F32, 1, -1, 1),
        twin_rand(n, KDT_F32, 2, -0.1f, 0.1f),
        twin_rand(n, KDT_F32, 3, -0.01f, 0.01f),
        twin_rand(n, KDT_F32, 4, 0, 1e-4f),
    };
    return s;
}

static void adam_state_free(struct adam_state *s)
{
    twin_free(&s->p);
    twin_free(&s->g);
    twin_free(&s->m);
    twin_free(&s->v);
}

static struct adamw_hparams adam_hparams(void)
{
    struct adamw_hparams h;
    adamw_hparams_defaults(&h);
    h.lr = 1e-3f;
    h.weight_decay = 0.1f;
    return h;
}

/* Against the scalar reference (whose bits every CPU kernel gives): the kernel fuses the
 * multiply-adds it fuses and keeps nvcc from fusing any other, so the bits are the same. */
Test(kernels_gpu, adamw_matches_the_cpu_reference)
{
    need_gpu();
    const size_t n = ((size_t)1 << 20) + 3; /* a ragged tail */
    struct adamw_hparams h = adam_hparams();
    struct adam_state s = adam_state_new(n);
    for (int step = 1; step <= 3; step++) {
        cr_assert_eq(kernel_adamw(s.p.d, s.g.d, s.m.d, s.v.d, NULL, KDT_BF16, n, &h, step, 0.5f, 0),
                     0);
        cr_assert_eq(
            adamw_update_isa(ADAMW_ISA_SCALAR, s.p.h, s.g.h, s.m.h, s.v.h, n, &h, step, 0.5f), 0);
    }
    sync_ok();
    twin_check("adamw param", KDT_F32, &s.p, TOL_EXACT);
    twin_check("adamw m", KDT_F32, &s.m, TOL_EXACT);
    twin_check("adamw v", KDT_F32, &s.v, TOL_EXACT);
    adam_state_free(&s);
}

/* Compressed moments (adamw_states.h) against adamw_update_states, bit for bit: bf16 with
 * stochastic rounding and 8-bit blockwise, a part of a tensor that starts at element 1024
 * with buffers laid out for more than it updates (a ZeRO shard), a ragged last block, three
 * steps from zero states, decoupled decay and L2, with the bf16 copy of the parameters. */
Test(kernels_gpu, adamw_compressed_states_match_the_cpu)
{
    need_gpu();
    const size_t n = ((size_t)1 << 18) + 77, cap = n + 100;
    float maps[512];
    memcpy(maps, adamw_q8_map(1), sizeof(float) * 256);
    memcpy(maps + 256, adamw_q8_map(0), sizeof(float) * 256);
    for (int dt = ADAMW_STATE_BF16; dt <= ADAMW_STATE_Q8; dt++)
        for (int l2 = 0; l2 < 2; l2++) {
            struct adamw_hparams h = adam_hparams();
            h.l2 = l2;
            struct adam_state s = adam_state_new(n);
            size_t sb = adamw_state_bytes((enum adamw_state_dtype)dt, cap);
            unsigned char *hm = calloc(1, sb), *hv = calloc(1, sb), *gm = malloc(sb),
                          *gv = malloc(sb);
            uint16_t *h16 = malloc(n * 2), *g16 = malloc(n * 2);
            void *dm, *dv, *d16;
            cr_assert(hm && hv && gm && gv && h16 && g16);
            cr_assert_eq(cudaMalloc(&dm, sb), cudaSuccess);
            cr_assert_eq(cudaMalloc(&dv, sb), cudaSuccess);
            cr_assert_eq(cudaMalloc(&d16, n * 2), cudaSuccess);
            cr_assert_eq(cudaMemset(dm, 0, sb), cudaSuccess);
            cr_assert_eq(cudaMemset(dv, 0, sb), cudaSuccess);
            struct adamw_state_at at = {.seed = 5, .tensor = 3, .first = 1024, .cap = cap};
            for (int step = 1; step <= 3; step++) {
                cr_assert_eq(kernel_adamw_states(s.p.d, s.g.d, dm, dv, d16, KDT_BF16, n, dt,
                                                 at.first, at.cap, at.seed, at.tensor, maps, &h,
                                                 step, 0.5f, 0),
                             0);
                cr_assert_eq(adamw_update_states((enum adamw_state_dtype)dt, s.p.h, s.g.h, hm,
                                                 hv, h16, n, &at, &h, step, 0.5f),
                             0);
            }
            sync_ok();
            const char *name = adamw_state_dtype_name((enum adamw_state_dtype)dt);
            twin_check(name, KDT_F32, &s.p, TOL_EXACT);
            cr_assert_eq(cudaMemcpy(gm, dm, sb, cudaMemcpyDeviceToHost), cudaSuccess);
            cr_assert_eq(cudaMemcpy(gv, dv, sb, cudaMemcpyDeviceToHost), cudaSuccess);
            cr_assert_eq(cudaMemcpy(g16, d16, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
            cr_expect(!memcmp(gm, hm, sb), "%s%s: m is not the CPU's", name, l2 ? " (L2)" : "");
            cr_expect(!memcmp(gv, hv, sb), "%s%s: v is not the CPU's", name, l2 ? " (L2)" : "");
            cr_expect(!memcmp(g16, h16, n * 2), "%s: the bf16 copy is not the CPU's", name);
            cudaFree(dm);
            cudaFree(dv);
            cudaFree(d16);
            free(hm);
            free(hv);
            free(gm);
            free(gv);
            free(h16);
            free(g16);
            adam_state_free(&s);
        }
    /* What the CPU refuses: a q8 part off a block boundary, more than the buffers hold. */
    struct adamw_hparams h = adam_hparams();
    float *p = maps; /* never launched on */
    cr_expect_eq(kernel_adamw_states(p, p, p, p, NULL, KDT_BF16, 8, 2, 100, 8, 0, 0, maps, &h, 1,
                                     1.0f, 0),
                 -EINVAL);
    cr_expect_eq(kernel_adamw_states(p, p, p, p, NULL, KDT_BF16, 8, 1, 0, 4, 0, 0, maps, &h, 1,
                                     1.0f, 0),
                 -EINVAL);
}

/* The CPU's AdamW with a 16-bit copy: adamw_update_bf16 for bf16, adamw_update then the
 * cast for fp16 (the trainer's CPU path). */
static int cpu_adamw_16(const struct type16 *t, struct adam_state *s, uint16_t *copy, size_t n,
                        const struct adamw_hparams *h)
{
    if (t->dt == KDT_BF16)
        return adamw_update_bf16(s->p.h, s->g.h, s->m.h, s->v.h, copy, n, h, 1, 1.0f);
    int r = adamw_update(s->p.h, s->g.h, s->m.h, s->v.h, n, h, 1, 1.0f);
    if (r == 0) ops_cast_f32_to_f16(copy, s->p.h, n);
    return r;
}

/* The fused 16-bit copy is exactly the rounding of the kernel's own fp32 parameter, and
 * that parameter and the copy are the CPU's bits. */
static void check_adamw_copy(const struct type16 *t)
{
    need_gpu();
    const size_t n = ((size_t)1 << 16) + 5;
    const char *name = dt_name(t->dt);
    struct adamw_hparams h = adam_hparams();
    struct adam_state s = adam_state_new(n);
    uint16_t *d_16 = dev_alloc(n * 2), *c16 = malloc(n * 2), *cpu_16 = malloc(n * 2);
    cr_assert(c16 && cpu_16);
    cr_assert_eq(kernel_adamw(s.p.d, s.g.d, s.m.d, s.v.d, d_16, t->dt, n, &h, 1, 1.0f, 0), 0);
    cr_assert_eq(cpu_adamw_16(t, &s, cpu_16, n, &h), 0);
    sync_ok();
    char what[96];
    snprintf(what, sizeof(what), "adamw param (with %s copy)", name);
    twin_check(what, KDT_F32, &s.p, TOL_EXACT);
    cr_assert_eq(cudaMemcpy(c16, d_16, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);

    float *gpu_p = twin_download(&s.p), *got = falloc(n), *want = falloc(n);
    size_t own = 0;
    for (size_t i = 0; i < n; i++) {
        own += c16[i] != t->narrow(gpu_p[i]);
        got[i] = t->widen(c16[i]);
        want[i] = t->widen(cpu_16[i]);
    }
    cr_log_info("adamw %s copy: %zu of %zu differ from the rounding of the kernel's fp32 "
                "parameter (tolerance exact)",
                name, own, n);
    cr_assert_eq(own, 0);
    snprintf(what, sizeof(what), "adamw %s copy vs the CPU's", name);
    expect_close(what, got, want, n, TOL_EXACT);

    free(gpu_p);
    free(got);
    free(want);
    free(c16);
    free(cpu_16);
    cudaFree(d_16);
    adam_state_free(&s);
}

Test(kernels_gpu, adamw_bf16_copy_matches_the_cpu_reference)
{
    check_adamw_copy(&T_BF16);
}

Test(kernels_gpu, adamw_f16_copy_matches_the_cpu_reference)
{
    check_adamw_copy(&T_F16);
}

/* LAMB's two launches against lamb_moments and lamb_apply: the moments and the update per
 * element with the CPU's operations (bits expected, fp32 rounding allowed), the chunk sums
 * in another order (double rounding), over chunks with a ragged last one, with the ratio
 * made on the host from the GPU's sums as the trainer makes it; and with an fp16 copy. */
Test(kernels_gpu, lamb_matches_the_cpu_reference)
{
    need_gpu();
    const size_t n = ((size_t)1 << 18) + 5, chunk = 1024, k = (n + chunk - 1) / chunk;
    struct adamw_hparams h = adam_hparams();
    struct adam_state s = adam_state_new(n);
    double *d_sums = dev_alloc(2 * k * sizeof(double)), *gs = malloc(2 * k * sizeof(double)),
           *cw = malloc(k * sizeof(double)), *cu = malloc(k * sizeof(double));
    uint16_t *d_16 = dev_alloc(n * 2), *c16 = malloc(n * 2);
    cr_assert(gs && cw && cu && c16);
    for (int step = 1; step <= 3; step++) {
        int inside = step == 3;
        cr_assert_eq(kernel_lamb_moments(s.p.d, s.g.d, s.m.d, s.v.d, n, &h, 0.5f, inside, chunk,
                                         d_sums, 0),
                     0);
        cr_assert_eq(lamb_moments(s.p.h, s.g.h, s.m.h, s.v.h, n, &h, 0.5f, inside, chunk, cw, cu),
                     0);
        sync_ok();
        cr_assert_eq(cudaMemcpy(gs, d_sums, 2 * k * sizeof(double), cudaMemcpyDeviceToHost),
                     cudaSuccess);
        double W = 0, U = 0, cW = 0, cU = 0;
        for (size_t c = 0; c < k; c++) {
            cr_expect(fabs(gs[c] - cw[c]) <= 1e-12 * cw[c] && fabs(gs[k + c] - cu[c]) <= 1e-12 * cu[c],
                      "step %d chunk %zu: GPU %.17g %.17g, CPU %.17g %.17g", step, c, gs[c],
                      gs[k + c], cw[c], cu[c]);
            W += gs[c];
            U += gs[k + c];
            cW += cw[c];
            cU += cu[c];
        }
        float coeff = lamb_coeff(W, U, 10.0f, 0.01f), ccoeff = lamb_coeff(cW, cU, 10.0f, 0.01f);
        cr_expect(fabsf(coeff - ccoeff) <= 1e-6f * ccoeff, "step %d: ratio %.9g vs %.9g", step,
                  coeff, ccoeff);
        /* The same ratio on both sides, so the update is compared alone. */
        cr_assert_eq(kernel_lamb_apply(s.p.d, s.m.d, s.v.d, step == 2 ? d_16 : NULL, KDT_F16, n, &h,
                                       step, inside, ccoeff, 0),
                     0);
        cr_assert_eq(lamb_apply(s.p.h, s.m.h, s.v.h, NULL, n, &h, step, inside, ccoeff), 0);
        sync_ok();
        if (step == 2) {
            float *gpu_p = twin_download(&s.p);
            cr_assert_eq(cudaMemcpy(c16, d_16, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
            size_t off = 0;
            for (size_t i = 0; i < n; i++)
                off += c16[i] != T_F16.narrow(gpu_p[i]);
            cr_expect_eq(off, 0, "%zu of %zu fp16 copies are not the rounding of the parameter",
                         off, n);
            free(gpu_p);
        }
    }
    struct tol t = {1e-11, 1e-5, 0, "fp32 1e-11 + 1e-5|x| (bitwise expected)"};
    twin_check("lamb param", KDT_F32, &s.p, t);
    twin_check("lamb m", KDT_F32, &s.m, t);
    twin_check("lamb v", KDT_F32, &s.v, t);
    /* Refused: a chunk of 0, no sums, a ratio that is not finite, a step of 0. */
    cr_expect_eq(kernel_lamb_moments(s.p.d, s.g.d, s.m.d, s.v.d, n, &h, 1.0f, 0, 0, d_sums, 0),
                 -EINVAL);
    cr_expect_eq(kernel_lamb_moments(s.p.d, s.g.d, s.m.d, s.v.d, n, &h, 1.0f, 0, chunk, NULL, 0),
                 -EINVAL);
    cr_expect_eq(kernel_lamb_apply(s.p.d, s.m.d, s.v.d, NULL, KDT_F16, n, &h, 1, 0, NAN, 0),
                 -EINVAL);
    cr_expect_eq(kernel_lamb_apply(s.p.d, s.m.d, s.v.d, NULL, KDT_F16, n, &h, 0, 0, 1.0f, 0),
                 -EINVAL);
    cudaFree(d_sums);
    cudaFree(d_16);
    free(gs);
    free(cw);
    free(cu);
    free(c16);
    adam_state_free(&s);
}

Test(kernels_gpu, adamw_refuses_bad_input)
{
    struct adamw_hparams h = adam_hparams(), bad = h;
    cr_assert_eq(kernel_adamw(NULL, FAKEF, FAKEF, FAKEF, NULL, KDT_BF16, 8, &h, 1, 1.0f, 0),
                 -EINVAL);
    cr_assert_eq(kernel_adamw(FAKEF, FAKEF, FAKEF, NULL, NULL, KDT_BF16, 8, &h, 1, 1.0f, 0),
                 -EINVAL);
    cr_assert_eq(kernel_adamw(FAKEF, FAKEF, FAKEF, FAKEF, NULL, KDT_BF16, 8, NULL, 1, 1.0f, 0),
                 -EINVAL);
    cr_assert_eq(kernel_adamw(FAKEF, FAKEF, FAKEF, FAKEF, NULL, KDT_BF16, 8, &h, 0, 1.0f, 0),
                 -EINVAL);
    cr_assert_eq(kernel_adamw(FAKEF, FAKEF, FAKEF, FAKEF, NULL, KDT_BF16, 8, &h, 1, NAN, 0),
                 -EINVAL);
    bad.beta1 = 1.0f;
    cr_assert_eq(kernel_adamw(FAKEF, FAKEF, FAKEF, FAKEF, NULL, KDT_BF16, 8, &bad, 1, 1.0f, 0),
                 -EINVAL);
    bad = h;
    bad.eps = 0.0f;
    cr_assert_eq(kernel_adamw(FAKEF, FAKEF, FAKEF, FAKEF, NULL, KDT_BF16, 8, &bad, 1, 1.0f, 0),
                 -EINVAL);
    /* Nothing to do is not an error, as on the CPU. */
    cr_assert_eq(kernel_adamw(NULL, NULL, NULL, NULL, NULL, KDT_BF16, 0, &h, 1, 1.0f, 0), 0);
    /* The copy is bf16 or fp16. */
    cr_assert_eq(kernel_adamw(FAKEF, FAKEF, FAKEF, FAKEF, FAKE, KDT_F32, 8, &h, 1, 1.0f, 0),
                 -EINVAL);
    cr_assert_eq(kernel_adamw(FAKEF, FAKEF, FAKEF, FAKEF, FAKE, BAD_DT, 8, &h, 1, 1.0f, 0),
                 -EINVAL);
}

static void check_sumsq(size_t n)
{
    need_gpu();
    struct twin x = twin_rand(n, KDT_F32, 120, -1, 1);
    double *d_acc = dev_alloc(sizeof(double)), start = 1.5, got = 0, want = 0;
    void *scratch = dev_alloc(kernel_scratch_bytes(n, 1));
    cr_assert_eq(cudaMemcpy(d_acc, &start, sizeof(start), cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(kernel_sumsq(d_acc, x.d, n, scratch, 0), 0);
    sync_ok();
    cr_assert_eq(cudaMemcpy(&got, d_acc, sizeof(got), cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(adamw_sum_squares(x.h, n, &want), 0);
    want += start;
    double rel = fabs(got - want) / want;
    cr_log_info("sumsq n %zu: gpu %.17g cpu %.17g, relative difference %.3g (tolerance 1e-12)", n,
                got, want, rel);
    cr_assert_leq(rel, 1e-12);
    twin_free(&x);
    cudaFree(d_acc);
    cudaFree(scratch);
}

Test(kernels_gpu, sumsq_matches_the_cpu_reference)
{
    check_sumsq(((size_t)1 << 20) + 7);
    check_sumsq(5);
    check_sumsq(((size_t)3 << 20) + 1); /* more elements than one pass of the grid */
}

Test(kernels_gpu, sumsq_refuses_bad_input)
{
    cr_assert_eq(kernel_sumsq(NULL, FAKEF, 8, FAKE, 0), -EINVAL);
    cr_assert_eq(kernel_sumsq((double *)FAKE, NULL, 8, FAKE, 0), -EINVAL);
    cr_assert_eq(kernel_sumsq((double *)FAKE, FAKEF, 8, NULL, 0), -EINVAL);
    cr_assert_eq(kernel_sumsq((double *)FAKE, NULL, 0, NULL, 0), 0);
}

/* One double per chunk, each the CPU's sum of squares of its chunk to within double
 * rounding, and the same bits on a second run. */
static void check_chunk_sumsq(size_t n, size_t chunk)
{
    need_gpu();
    struct twin x = twin_rand(n, KDT_F32, 121, -3, 3);
    size_t k = (n + chunk - 1) / chunk;
    double *d_out = dev_alloc(k * sizeof(double)), *got = malloc(k * sizeof(double)),
           *again = malloc(k * sizeof(double));
    cr_assert(got && again);
    cr_assert_eq(kernel_chunk_sumsq(d_out, x.d, n, chunk, 0), 0);
    sync_ok();
    cr_assert_eq(cudaMemcpy(got, d_out, k * sizeof(double), cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(kernel_chunk_sumsq(d_out, x.d, n, chunk, 0), 0);
    sync_ok();
    cr_assert_eq(cudaMemcpy(again, d_out, k * sizeof(double), cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(memcmp(got, again, k * sizeof(double)), 0, "the same bits twice");
    double worst = 0;
    for (size_t c = 0; c < k; c++) {
        double want;
        size_t len = n - c * chunk < chunk ? n - c * chunk : chunk;
        cr_assert_eq(adamw_sum_squares(x.h + c * chunk, len, &want), 0);
        double rel = want ? fabs(got[c] - want) / want : fabs(got[c]);
        worst = rel > worst ? rel : worst;
    }
    cr_log_info("chunk_sumsq n %zu chunk %zu: %zu chunks, largest relative difference %.3g "
                "(tolerance 1e-12)", n, chunk, k, worst);
    cr_assert_leq(worst, 1e-12);
    twin_free(&x);
    cudaFree(d_out);
    free(got);
    free(again);
}

Test(kernels_gpu, chunk_sumsq_matches_the_cpu_chunk_by_chunk)
{
    check_chunk_sumsq(((size_t)1 << 20) + 7, 1024); /* a short last chunk */
    check_chunk_sumsq(5, 1024);
    check_chunk_sumsq(3 * 4096, 4096);
}

Test(kernels_gpu, chunk_sumsq_refuses_bad_input)
{
    cr_assert_eq(kernel_chunk_sumsq(NULL, FAKEF, 8, 4, 0), -EINVAL);
    cr_assert_eq(kernel_chunk_sumsq((double *)FAKE, NULL, 8, 4, 0), -EINVAL);
    cr_assert_eq(kernel_chunk_sumsq((double *)FAKE, FAKEF, 8, 0, 0), -EINVAL);
    cr_assert_eq(kernel_chunk_sumsq((double *)FAKE, NULL, 0, 4, 0), 0);
}

/* ---- determinism: the reductions give the same bits twice -------------------------------- */

/* An output of a reduction, and the bytes of its first run in first[] (freed here). */
struct det_out {
    const char *name;
    void *d;
    size_t bytes;
};

static void expect_same_bits(const char *what, struct det_out *outs, int nouts, void **first)
{
    for (int i = 0; i < nouts; i++) {
        void *again = dev_bytes(outs[i].d, outs[i].bytes);
        cr_assert_eq(memcmp(first[i], again, outs[i].bytes), 0, "%s: %s differs between runs", what,
                     outs[i].name);
        free(again);
        free(first[i]);
    }
    cr_log_info("%s: two runs gave the same bits", what);
}

Test(kernels_gpu, reductions_are_deterministic)
{
    need_gpu();
    void *first[3];

    /* LayerNorm backward: dw, db and d_inp. */
    {
        const int N = 1000, C = 96;
        size_t NC = (size_t)N * C;
        struct twin inp = twin_rand(NC, KDT_F32, 130, -1, 3), w = twin_rand(C, KDT_F32, 131, 0, 2);
        struct twin d_out = twin_rand(NC, KDT_F32, 132, -1, 1);
        struct twin mean = twin_rand(N, KDT_F32, 133, 0, 1),
                    rstd = twin_rand(N, KDT_F32, 134, 1, 2);
        struct twin dw = twin_rand(C, KDT_F32, 135, -1, 1), db = twin_rand(C, KDT_F32, 136, -1, 1);
        struct twin d_inp = twin_zeros(NC, KDT_F32);
        void *scratch = dev_alloc(kernel_scratch_bytes(N, 2 * (size_t)C));
        struct det_out outs[] = {
            {"dw", dw.d, C * 4}, {"db", db.d, C * 4}, {"d_inp", d_inp.d, NC * 4}};
        for (int run = 0; run < 2; run++) {
            twin_upload(&dw);
            twin_upload(&db);
            cr_assert_eq(kernel_layernorm_backward(d_inp.d, 0, dw.d, db.d, d_out.d, inp.d, w.d,
                                                   mean.d, rstd.d, N, C, KDT_F32, scratch, 0),
                         0);
            sync_ok();
            if (run == 0)
                for (int i = 0; i < 3; i++)
                    first[i] = dev_bytes(outs[i].d, outs[i].bytes);
        }
        expect_same_bits("layernorm backward", outs, 3, first);
        struct twin *all[] = {&inp, &w, &d_out, &mean, &rstd, &dw, &db, &d_inp};
        for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
            twin_free(all[i]);
        cudaFree(scratch);
    }

    /* Column sums. */
    {
        const int N = 5000, OC = 72;
        struct twin x = twin_rand((size_t)N * OC, KDT_F32, 140, -1, 1);
        struct twin acc = twin_zeros(OC, KDT_F32);
        void *scratch = dev_alloc(kernel_scratch_bytes(N, OC));
        struct det_out outs[] = {{"acc", acc.d, OC * 4}};
        for (int run = 0; run < 2; run++) {
            cr_assert_eq(cudaMemset(acc.d, 0, OC * 4), cudaSuccess);
            cr_assert_eq(kernel_colsum(acc.d, x.d, N, OC, KDT_F32, scratch, 0), 0);
            sync_ok();
            if (run == 0) first[0] = dev_bytes(acc.d, OC * 4);
        }
        expect_same_bits("colsum", outs, 1, first);
        twin_free(&x);
        twin_free(&acc);
        cudaFree(scratch);
    }

    /* Embedding backward. */
    {
        const int B = 8, T = 33, C = 72, V = 20;
        size_t N = (size_t)B * T;
        struct twin d_x = twin_rand(N * C, KDT_F32, 150, -1, 1);
        struct twin d_wte = twin_zeros((size_t)V * C, KDT_F32);
        struct twin d_wpe = twin_zeros((size_t)T * C, KDT_F32);
        int *tok = random_ints(N, 151, V), *d_tok = dev_ints(tok, N);
        struct det_out outs[] = {{"d_wte", d_wte.d, (size_t)V * C * 4},
                                 {"d_wpe", d_wpe.d, (size_t)T * C * 4}};
        for (int run = 0; run < 2; run++) {
            twin_upload(&d_wte);
            twin_upload(&d_wpe);
            cr_assert_eq(
                kernel_embed_backward(d_wte.d, d_wpe.d, d_x.d, d_tok, B, T, C, V, KDT_F32, NULL, 0),
                0);
            sync_ok();
            if (run == 0)
                for (int i = 0; i < 2; i++)
                    first[i] = dev_bytes(outs[i].d, outs[i].bytes);
        }
        expect_same_bits("embed backward", outs, 2, first);
        twin_free(&d_x);
        twin_free(&d_wte);
        twin_free(&d_wpe);
        free(tok);
        cudaFree(d_tok);
    }

    /* Sum of squares. */
    {
        const size_t n = ((size_t)5 << 20) + 3;
        struct twin x = twin_rand(n, KDT_F32, 160, -1, 1);
        double *d_acc = dev_alloc(sizeof(double));
        void *scratch = dev_alloc(kernel_scratch_bytes(n, 1));
        struct det_out outs[] = {{"acc", d_acc, sizeof(double)}};
        for (int run = 0; run < 2; run++) {
            cr_assert_eq(cudaMemset(d_acc, 0, sizeof(double)), cudaSuccess);
            cr_assert_eq(kernel_sumsq(d_acc, x.d, n, scratch, 0), 0);
            sync_ok();
            if (run == 0) first[0] = dev_bytes(d_acc, sizeof(double));
        }
        expect_same_bits("sumsq", outs, 1, first);
        twin_free(&x);
        cudaFree(d_acc);
        cudaFree(scratch);
    }
}

/* ---- Ulysses sequence parallelism's exchange blocks ---------------------------------------- */

/* The all-to-all of sp ranks on the host: recv[r] block j = send[j] block r, blocks of
 * stride elements of es bytes. */
static void host_alltoall(unsigned char *const *send, unsigned char *const *recv, int sp,
                          size_t stride, size_t es)
{
    for (int r = 0; r < sp; r++)
        for (int j = 0; j < sp; j++)
            memcpy(recv[r] + (size_t)j * stride * es, send[j] + (size_t)r * stride * es,
                   stride * es);
}

/* sp ranks' local layouts (B,Tl,G*C) of random bits go through kernel_sp_xchg's packing, a
 * host all-to-all and its unpacking into the heads layout (B,T,G*Cl): each rank's must be,
 * bit for bit, gpt_sp.h's "all positions, this rank's heads" (row (b,t) from rank t/Tl, the
 * columns [g*C + r*Cl, g*C + (r+1)*Cl) of each group g); and back the same way, each rank's
 * own local layout again. Blocks are strided past their content (stride > count), as the
 * backend rounds them to whole floats. */
static void check_sp_xchg(enum kdtype dt, int sp, int G)
{
    need_gpu();
    const int B = 2, T = 12, C = 72;
    size_t es = dt_size(dt), Tl = (size_t)T / sp, Cl = (size_t)C / sp, w = (size_t)G * Cl;
    size_t nl = (size_t)B * Tl * G * C, count = (size_t)B * Tl * w, stride = count + 3;
    unsigned char *loc[4], *heads[4], *send[4], *recv[4], *back[4];
    void *d_lay = dev_alloc(nl * es), *d_buf = dev_alloc(sp * stride * es);
    for (int r = 0; r < sp; r++) {
        loc[r] = test_rand_buf(nl * es, 900 + (uint64_t)r);
        heads[r] = malloc(nl * es);
        back[r] = malloc(nl * es);
        send[r] = calloc(sp * stride, es);
        recv[r] = calloc(sp * stride, es);
        cr_assert(heads[r] && back[r] && send[r] && recv[r]);
    }
    /* local -> heads */
    for (int r = 0; r < sp; r++) {
        cr_assert_eq(cudaMemcpy(d_lay, loc[r], nl * es, cudaMemcpyHostToDevice), cudaSuccess);
        cr_assert_eq(kernel_sp_xchg(d_lay, 0, d_buf, 1, B, T, C, sp, G, stride, dt, 0), 0);
        sync_ok();
        cr_assert_eq(cudaMemcpy(send[r], d_buf, sp * stride * es, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    }
    host_alltoall(send, recv, sp, stride, es);
    size_t bad = 0;
    for (int r = 0; r < sp; r++) {
        cr_assert_eq(cudaMemcpy(d_buf, recv[r], sp * stride * es, cudaMemcpyHostToDevice),
                     cudaSuccess);
        cr_assert_eq(kernel_sp_xchg(d_lay, 1, d_buf, 0, B, T, C, sp, G, stride, dt, 0), 0);
        sync_ok();
        cr_assert_eq(cudaMemcpy(heads[r], d_lay, nl * es, cudaMemcpyDeviceToHost), cudaSuccess);
        for (size_t b = 0; b < (size_t)B; b++)
            for (size_t t = 0; t < (size_t)T; t++)
                for (size_t k = 0; k < w; k++) {
                    size_t g = k / Cl, c = k % Cl, from = t / Tl, tl = t % Tl;
                    const unsigned char *want =
                        loc[from] + ((b * Tl + tl) * G * C + g * C + r * Cl + c) * es;
                    bad += memcmp(heads[r] + ((b * T + t) * w + k) * es, want, es) != 0;
                }
    }
    /* heads -> local: each rank's own rows again */
    for (int r = 0; r < sp; r++) {
        cr_assert_eq(cudaMemcpy(d_lay, heads[r], nl * es, cudaMemcpyHostToDevice), cudaSuccess);
        cr_assert_eq(kernel_sp_xchg(d_lay, 1, d_buf, 1, B, T, C, sp, G, stride, dt, 0), 0);
        sync_ok();
        cr_assert_eq(cudaMemcpy(send[r], d_buf, sp * stride * es, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    }
    host_alltoall(send, recv, sp, stride, es);
    for (int r = 0; r < sp; r++) {
        cr_assert_eq(cudaMemcpy(d_buf, recv[r], sp * stride * es, cudaMemcpyHostToDevice),
                     cudaSuccess);
        cr_assert_eq(kernel_sp_xchg(d_lay, 0, d_buf, 0, B, T, C, sp, G, stride, dt, 0), 0);
        sync_ok();
        cr_assert_eq(cudaMemcpy(back[r], d_lay, nl * es, cudaMemcpyDeviceToHost), cudaSuccess);
        bad += memcmp(back[r], loc[r], nl * es) != 0;
    }
    cr_log_info("sp exchange (%s, sp %d, G %d): %zu elements or layouts differ; tolerance exact",
                dt_name(dt), sp, G, bad);
    cr_assert_eq(bad, 0, "sp exchange (%s, sp %d, G %d): %zu differ", dt_name(dt), sp, G, bad);
    for (int r = 0; r < sp; r++) {
        free(loc[r]);
        free(heads[r]);
        free(back[r]);
        free(send[r]);
        free(recv[r]);
    }
    cudaFree(d_lay);
    cudaFree(d_buf);
}

Test(kernels_gpu, sp_exchange_moves_the_bits_of_gpt_sp_layouts_f32)
{
    for (int sp = 2; sp <= 4; sp++)
        for (int G = 1; G <= 3; G += 2)
            check_sp_xchg(KDT_F32, sp, G);
}

Test(kernels_gpu, sp_exchange_moves_the_bits_of_gpt_sp_layouts_16)
{
    check_sp_xchg(KDT_BF16, 2, 3);
    check_sp_xchg(KDT_BF16, 3, 1);
    check_sp_xchg(KDT_F16, 4, 3);
}

/* The attention of sp ranks, as the CUDA backend runs it: each rank's qkv rows (B,T/sp,3C)
 * of a whole qkv (B,T,3C) packed, exchanged (on the host), unpacked into its heads, the
 * attention kernel over C/sp channels and NH/sp heads of the whole sequence, its output
 * packed, exchanged and unpacked into the rank's rows (B,T/sp,C): the rows put together are
 * the CPU's one-rank attention (ops_attention_forward) of the whole qkv. */
static void check_sp_attention(enum kdtype dt, int sp)
{
    need_gpu();
    const int B = 2, T = 12, C = 72, NH = 6;
    size_t es = dt_size(dt), Tl = (size_t)T / sp, N = (size_t)B * T, Nl = (size_t)B * Tl;
    size_t stride = Nl * 3 * ((size_t)C / sp);
    struct twin qkv = twin_rand(N * 3 * C, dt, 910 + (uint64_t)sp, -1, 1);
    float *y = falloc(N * C), *att = falloc((size_t)B * NH * T * T);
    ops_attention_forward(y, att, qkv.h, B, T, C, NH);
    unsigned char *all = dev_bytes(qkv.d, N * 3 * C * es), *send[4], *recv[4];
    unsigned char *out = malloc(N * C * es);
    void *d_qkv = dev_alloc(Nl * 3 * C * es), *d_y = dev_alloc(Nl * C * es);
    void *d_buf = dev_alloc(sp * stride * es);
    float *d_att = dev_alloc((size_t)B * (NH / sp) * T * T * 4);
    cr_assert_not_null(out);
    for (int r = 0; r < sp; r++) {
        send[r] = calloc(sp * stride, es);
        recv[r] = calloc(sp * stride, es);
        cr_assert(send[r] && recv[r]);
        /* rank r's rows of the whole qkv, packed */
        for (size_t b = 0; b < (size_t)B; b++)
            cr_assert_eq(cudaMemcpy((char *)d_qkv + b * Tl * 3 * C * es,
                                    all + (b * T + r * Tl) * 3 * C * es, Tl * 3 * C * es,
                                    cudaMemcpyHostToDevice),
                         cudaSuccess);
        cr_assert_eq(kernel_sp_xchg(d_qkv, 0, d_buf, 1, B, T, C, sp, 3, stride, dt, 0), 0);
        sync_ok();
        cr_assert_eq(cudaMemcpy(send[r], d_buf, sp * stride * es, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    }
    host_alltoall(send, recv, sp, stride, es);
    size_t ystride = Nl * ((size_t)C / sp);
    for (int r = 0; r < sp; r++) {
        cr_assert_eq(cudaMemcpy(d_buf, recv[r], sp * stride * es, cudaMemcpyHostToDevice),
                     cudaSuccess);
        cr_assert_eq(kernel_sp_xchg(d_qkv, 1, d_buf, 0, B, T, C, sp, 3, stride, dt, 0), 0);
        cr_assert_eq(kernel_attention_forward(d_y, d_att, d_qkv, B, T, C / sp, NH / sp, dt, 0), 0);
        cr_assert_eq(kernel_sp_xchg(d_y, 1, d_buf, 1, B, T, C, sp, 1, ystride, dt, 0), 0);
        sync_ok();
        cr_assert_eq(cudaMemcpy(send[r], d_buf, sp * ystride * es, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    }
    host_alltoall(send, recv, sp, ystride, es);
    for (int r = 0; r < sp; r++) {
        cr_assert_eq(cudaMemcpy(d_buf, recv[r], sp * ystride * es, cudaMemcpyHostToDevice),
                     cudaSuccess);
        cr_assert_eq(kernel_sp_xchg(d_y, 0, d_buf, 0, B, T, C, sp, 1, ystride, dt, 0), 0);
        sync_ok();
        for (size_t b = 0; b < (size_t)B; b++)
            cr_assert_eq(cudaMemcpy(out + (b * T + r * Tl) * C * es, (char *)d_y + b * Tl * C * es,
                                    Tl * C * es, cudaMemcpyDeviceToHost),
                         cudaSuccess);
    }
    /* The rows put together, as a twin of the whole y, against the CPU's. */
    struct twin yt = twin_zeros(N * C, dt);
    memcpy(yt.h, y, N * C * sizeof(float));
    cr_assert_eq(cudaMemcpy(yt.d, out, N * C * es, cudaMemcpyHostToDevice), cudaSuccess);
    char what[64];
    snprintf(what, sizeof(what), "sp %d attention through the exchanges", sp);
    twin_check(what, dt, &yt, tol_for(dt, TOL_F32_SUM));
    for (int r = 0; r < sp; r++) {
        free(send[r]);
        free(recv[r]);
    }
    twin_free(&yt);
    twin_free(&qkv);
    free(y);
    free(att);
    free(all);
    free(out);
    cudaFree(d_qkv);
    cudaFree(d_y);
    cudaFree(d_buf);
    cudaFree(d_att);
}

Test(kernels_gpu, sp_attention_through_the_exchanges_matches_the_cpus_whole_f32)
{
    check_sp_attention(KDT_F32, 2);
    check_sp_attention(KDT_F32, 3);
}

Test(kernels_gpu, sp_attention_through_the_exchanges_matches_the_cpus_whole_16)
{
    check_sp_attention(KDT_BF16, 2);
    check_sp_attention(KDT_F16, 3);
}

Test(kernels_gpu, sp_exchange_refuses_bad_input)
{
    cr_assert_eq(kernel_sp_xchg(NULL, 0, FAKE, 1, 2, 12, 72, 2, 3, 1000, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_sp_xchg(FAKE, 0, NULL, 1, 2, 12, 72, 2, 3, 1000, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_sp_xchg(FAKE, 0, FAKE, 1, 2, 12, 72, 2, 3, 1000, KDT_F32, 0), -EINVAL);
    void *other = (char *)FAKE + 4096;
    /* T, C not multiples of sp; a stride shorter than a block; a bad type. */
    cr_assert_eq(kernel_sp_xchg(FAKE, 0, other, 1, 2, 13, 72, 2, 3, 1000, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_sp_xchg(FAKE, 0, other, 1, 2, 12, 70, 4, 3, 1000, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_sp_xchg(FAKE, 0, other, 1, 2, 12, 72, 2, 3, 647, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_sp_xchg(FAKE, 0, other, 1, 2, 12, 72, 2, 3, 1000, BAD_DT, 0), -EINVAL);
    cr_assert_eq(kernel_sp_xchg(FAKE, 0, other, 1, 0, 12, 72, 2, 3, 1000, KDT_F32, 0), -EINVAL);
}

/* ---- mixture of experts: gather, combine, combine-weight gradient ------------------------ */

/* A route's maps of N tokens, k = 2, into E blocks of cap rows of C: token t's choices go
 * to rows of two distinct experts (lower first, as moe_ep_combine_map lists them), some
 * dropped (-1 from there on). */
static void moe_maps(int N, int E, int cap, int C, int64_t *off, float *w, uint64_t seed)
{
    uint64_t s = seed;
    int used[64] = {0};
    for (int t = 0; t < N; t++) {
        int e1 = (int)(test_rand(&s) % (uint64_t)E), e2 = (e1 + 1 + (int)(test_rand(&s) %
                                                                     (uint64_t)(E - 1))) % E;
        int a = e1 < e2 ? e1 : e2, b = e1 < e2 ? e2 : e1, j = 0;
        int ex[2] = {a, b};
        for (int q = 0; q < 2; q++) {
            int e = ex[q];
            if (used[e] >= cap || test_rand(&s) % 7 == 0) continue; /* dropped */
            off[(size_t)t * 2 + (size_t)j] = ((int64_t)e * cap + used[e]++) * C;
            w[(size_t)t * 2 + (size_t)j] = (float)((double)(test_rand(&s) >> 11) / 9007199254740992.0);
            j++;
        }
        for (; j < 2; j++) {
            off[(size_t)t * 2 + (size_t)j] = -1;
            w[(size_t)t * 2 + (size_t)j] = 0.0f;
        }
    }
}

static void *dev_copy(const void *h, size_t bytes)
{
    void *d = dev_alloc(bytes);
    cr_assert_eq(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return d;
}

Test(kernels_gpu, moe_gather_matches_the_cpu)
{
    need_gpu();
    const int N = 37, C = 72, n = 29;
    const size_t rows = 40;
    struct twin x = twin_rand((size_t)N * C, KDT_F32, 301, -1, 1);
    struct twin dst = twin_rand(rows * C, KDT_F32, 302, -1, 1);
    int64_t off[29];
    int *tok = random_ints((size_t)n, 303, N);
    for (int i = 0; i < n; i++) /* distinct rows, not in order */
        off[i] = (int64_t)((i * 11) % (int)rows) * C;
    for (int i = 0; i < n; i++)
        memcpy(dst.h + off[i], x.h + (size_t)tok[i] * C, C * sizeof(float));
    int64_t *d_off = dev_copy(off, sizeof(off));
    int *d_tok = dev_ints(tok, (size_t)n);
    cr_assert_eq(kernel_moe_gather(dst.d, x.d, KDT_F32, d_off, d_tok, n, C, 0), 0);
    sync_ok();
    twin_check("moe gather", KDT_F32, &dst, TOL_EXACT);
    cr_assert_eq(kernel_moe_gather(dst.d, x.d, KDT_F32, d_off, d_tok, 0, C, 0), 0); /* nothing */
    cr_assert_eq(kernel_moe_gather(NULL, x.d, KDT_F32, d_off, d_tok, n, C, 0), -EINVAL);
    cr_assert_eq(kernel_moe_gather(dst.d, x.d, KDT_F32, d_off, d_tok, -1, C, 0), -EINVAL);
    cr_assert_eq(kernel_moe_gather(dst.d, x.d, KDT_F32, d_off, d_tok, n, 0, 0), -EINVAL);
    twin_free(&x);
    twin_free(&dst);
    free(tok);
    cudaFree(d_off);
    cudaFree(d_tok);
}

/* The combine against moe_ep.c's sum (moe_row_axpy, moe_row_add in expert order), with and
 * without weights, twice for the same bits. */
Test(kernels_gpu, moe_combine_matches_the_cpu)
{
    need_gpu();
    const int N = 53, E = 5, cap = 24, C = 96, k = 2;
    struct twin rows = twin_rand((size_t)E * cap * C, KDT_F32, 311, -2, 2);
    int64_t *off = malloc((size_t)N * k * sizeof(int64_t));
    float *w = falloc((size_t)N * k);
    cr_assert_not_null(off);
    moe_maps(N, E, cap, C, off, w, 312);
    int64_t *d_off = dev_copy(off, (size_t)N * k * sizeof(int64_t));
    float *d_w = dev_copy(w, (size_t)N * k * sizeof(float));
    for (int weighted = 0; weighted < 2; weighted++) {
        struct twin y = twin_rand((size_t)N * C, KDT_F32, 313, -1, 1); /* overwritten */
        memset(y.h, 0, (size_t)N * C * sizeof(float));
        for (int t = 0; t < N; t++)
            for (int j = 0; j < k && off[t * k + j] >= 0; j++) {
                if (weighted)
                    moe_row_axpy(y.h + (size_t)t * C, w[t * k + j], rows.h + off[t * k + j],
                                 (size_t)C);
                else
                    moe_row_add(y.h + (size_t)t * C, rows.h + off[t * k + j], (size_t)C);
            }
        void *first = NULL;
        for (int run = 0; run < 2; run++) {
            cr_assert_eq(kernel_moe_combine(y.d, KDT_F32, rows.d, d_off, weighted ? d_w : NULL, N, k, C, 0),
                         0);
            sync_ok();
            if (run == 0) first = dev_bytes(y.d, (size_t)N * C * sizeof(float));
        }
        void *second = dev_bytes(y.d, (size_t)N * C * sizeof(float));
        cr_assert_eq(memcmp(first, second, (size_t)N * C * sizeof(float)), 0,
                     "moe combine: two runs differ");
        free(first);
        free(second);
        /* One rounding per term: fp32 1e-6 + 1e-5 |x| (an FMA against a multiply-add). */
        twin_check(weighted ? "moe combine (weighted)" : "moe combine (sum)", KDT_F32, &y,
                   weighted ? TOL_F32 : TOL_EXACT);
        twin_free(&y);
    }
    cr_assert_eq(kernel_moe_combine(NULL, KDT_F32, rows.d, d_off, d_w, N, k, C, 0), -EINVAL);
    cr_assert_eq(kernel_moe_combine(rows.d, KDT_F32, rows.d, d_off, d_w, 0, k, C, 0), -EINVAL);
    cr_assert_eq(kernel_moe_combine(rows.d, KDT_F32, rows.d, NULL, d_w, N, k, C, 0), -EINVAL);
    twin_free(&rows);
    free(off);
    free(w);
    cudaFree(d_off);
    cudaFree(d_w);
}

/* d_w[i] = d_y[i] . out[i] in double and d_o = w * d_y: moe.c's rows_backward loop. */
Test(kernels_gpu, moe_weight_grad_matches_the_cpu)
{
    need_gpu();
    const int n = 41, C = 300; /* more columns than a block has threads */
    struct twin d_y = twin_rand((size_t)n * C, KDT_F32, 321, -1, 1);
    struct twin out = twin_rand((size_t)n * C, KDT_F32, 322, -1, 1);
    struct twin w = twin_rand((size_t)n, KDT_F32, 323, 0, 1);
    struct twin d_o = twin_zeros((size_t)n * C, KDT_F32);
    struct twin d_w = twin_zeros((size_t)n, KDT_F32);
    for (int i = 0; i < n; i++) {
        double dot = 0.0;
        for (int c = 0; c < C; c++) {
            size_t at = (size_t)i * C + (size_t)c;
            dot += (double)d_y.h[at] * out.h[at];
            d_o.h[at] = w.h[i] * d_y.h[at];
        }
        d_w.h[i] = (float)dot;
    }
    cr_assert_eq(kernel_moe_weight_grad(d_o.d, KDT_F32, d_w.d, d_y.d, out.d, w.d, n, C, 0), 0);
    sync_ok();
    twin_check("moe weight grad d_o", KDT_F32, &d_o, TOL_EXACT);
    /* A double sum in another order, rounded to fp32. */
    twin_check("moe weight grad d_w", KDT_F32, &d_w, TOL_F32);
    cr_assert_eq(kernel_moe_weight_grad(d_o.d, KDT_F32, d_w.d, d_y.d, NULL, w.d, n, C, 0), -EINVAL);
    cr_assert_eq(kernel_moe_weight_grad(d_o.d, KDT_F32, d_w.d, d_y.d, out.d, w.d, n, 0, 0), -EINVAL);
    cr_assert_eq(kernel_moe_weight_grad(d_o.d, KDT_F32, d_w.d, d_y.d, out.d, w.d, 0, C, 0), 0);
    twin_free(&d_y);
    twin_free(&out);
    twin_free(&w);
    twin_free(&d_o);
    twin_free(&d_w);
}

/* The 16-bit activations' side of the three: the gather widens its source rows (exact),
 * the combine rounds its fp32 sum once at the end, the weight gradient's d_o is rounded. */
static void check_moe_16(enum kdtype dt)
{
    const int N = 29, E = 4, cap = 20, C = 72, k = 2;
    /* Gather: rows of a 16-bit source into fp32. */
    struct twin x = twin_rand((size_t)N * C, dt, 331, -1, 1);
    struct twin dst = twin_zeros((size_t)N * C, KDT_F32);
    int64_t off[29];
    int *tok = random_ints((size_t)N, 332, N);
    for (int i = 0; i < N; i++)
        off[i] = (int64_t)((N - 1 - i) * C);
    for (int i = 0; i < N; i++)
        memcpy(dst.h + off[i], x.h + (size_t)tok[i] * C, C * sizeof(float));
    int64_t *d_off = dev_copy(off, sizeof(off));
    int *d_tok = dev_ints(tok, (size_t)N);
    cr_assert_eq(kernel_moe_gather(dst.d, x.d, dt, d_off, d_tok, N, C, 0), 0);
    sync_ok();
    twin_check("moe gather from 16 bits", dt, &dst, TOL_EXACT);
    /* Combine into 16 bits. */
    struct twin rows = twin_rand((size_t)E * cap * C, KDT_F32, 333, -2, 2);
    int64_t *coff = malloc((size_t)N * k * sizeof(int64_t));
    float *w = falloc((size_t)N * k);
    cr_assert_not_null(coff);
    moe_maps(N, E, cap, C, coff, w, 334);
    int64_t *d_coff = dev_copy(coff, (size_t)N * k * sizeof(int64_t));
    float *d_w = dev_copy(w, (size_t)N * k * sizeof(float));
    struct twin y = twin_zeros((size_t)N * C, dt);
    for (int t = 0; t < N; t++)
        for (int j = 0; j < k && coff[t * k + j] >= 0; j++)
            moe_row_axpy(y.h + (size_t)t * C, w[t * k + j], rows.h + coff[t * k + j], (size_t)C);
    cr_assert_eq(kernel_moe_combine(y.d, dt, rows.d, d_coff, d_w, N, k, C, 0), 0);
    sync_ok();
    twin_check("moe combine into 16 bits", dt, &y, tol_for(dt, TOL_F32));
    /* The weight gradient with a 16-bit d_o. */
    struct twin d_y = twin_rand((size_t)N * C, KDT_F32, 335, -1, 1);
    struct twin out = twin_rand((size_t)N * C, KDT_F32, 336, -1, 1);
    struct twin d_o = twin_zeros((size_t)N * C, dt);
    struct twin d_wt = twin_zeros((size_t)N, KDT_F32);
    for (int i = 0; i < N; i++) {
        double dot = 0.0;
        for (int c = 0; c < C; c++) {
            size_t at = (size_t)i * C + (size_t)c;
            dot += (double)d_y.h[at] * out.h[at];
            d_o.h[at] = w[i] * d_y.h[at];
        }
        d_wt.h[i] = (float)dot;
    }
    cr_assert_eq(kernel_moe_weight_grad(d_o.d, dt, d_wt.d, d_y.d, out.d, d_w, N, C, 0), 0);
    sync_ok();
    twin_check("moe weight grad d_o in 16 bits", dt, &d_o, tol_for(dt, TOL_F32));
    twin_check("moe weight grad d_w", KDT_F32, &d_wt, TOL_F32);
    struct twin *all[] = {&x, &dst, &rows, &y, &d_y, &out, &d_o, &d_wt};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        twin_free(all[i]);
    free(tok);
    free(coff);
    free(w);
    cudaFree(d_off);
    cudaFree(d_tok);
    cudaFree(d_coff);
    cudaFree(d_w);
}

Test(kernels_gpu, moe_rows_match_the_cpu_bf16)
{
    need_gpu();
    check_moe_16(KDT_BF16);
}

Test(kernels_gpu, moe_rows_match_the_cpu_f16)
{
    need_gpu();
    check_moe_16(KDT_F16);
}

#else
Test(kernels_gpu, kernels_match_the_cpu)
{
    cr_skip_test("built without the CUDA kernels (no CUDA toolkit)");
}
#endif
