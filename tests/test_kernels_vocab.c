/*
 * test_kernels_vocab.c - the vocab-parallel kernels of tensor parallelism (kernels/vocab.cu)
 * against the one-rank CPU math they split (ops_embed_forward, ops_embed_backward,
 * ops_crossentropy), part of test_kernels. The ranks are played in turn on one GPU, the
 * host standing in for their collectives (a sum in rank order, a gather): V = 50 over tp = 3
 * gives the uneven rows [0, 16), [16, 33), [33, 50) of gpt_tp_vocab_range.
 *
 * Tolerances: the embedding's sum over the ranks (one row and zeros) and the backward's rows
 * are exact; the loss and its gradient hold the fp32 long-sum tolerance of test_kernels.c
 * (1e-4 + 1e-5 |x|; the sums of exponentials run in another order) in fp32 and its bf16
 * one (1e-2 |x| + 1e-2 max|x|) where dlogits are bf16. Bad input is refused before any
 * launch (those run without a GPU too).
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
#include "train/ops.h"

#if ZINF_HAVE_KERNELS
#include "kernels/kernels.h"

#define VB 3
#define VT 13
#define VC 72
#define VV 50
#define VTP 3

static void vneed_gpu(void)
{
    struct cuda_probe_info ci;
    if (cuda_probe(&ci) == 0) cr_skip_test("no usable GPU: %s", ci.reason);
}

static int range_lo(int rank)
{
    return VV * rank / VTP;
}

static float *vrand(size_t n, uint64_t seed, float lo, float hi, int bf16)
{
    float *x = calloc(n, sizeof(float));
    cr_assert_not_null(x);
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) {
        x[i] = lo + (hi - lo) * (float)((double)(test_rand(&s) >> 11) / 9007199254740992.0);
        if (bf16) x[i] = ops_bf16_to_f32(ops_f32_to_bf16(x[i]));
    }
    return x;
}

/* n floats of h to the device in dt (fp32 or bf16; h exact in it). */
static void *vup(const float *h, size_t n, enum kdtype dt)
{
    void *d = NULL;
    size_t es = dt == KDT_F32 ? 4 : 2;
    cr_assert_eq(cudaMalloc(&d, n * es + 4), cudaSuccess);
    if (dt == KDT_F32) {
        cr_assert_eq(cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice), cudaSuccess);
        return d;
    }
    uint16_t *b = malloc(n * 2 + 2);
    cr_assert_not_null(b);
    ops_cast_f32_to_bf16(b, h, n);
    cr_assert_eq(cudaMemcpy(d, b, n * 2, cudaMemcpyHostToDevice), cudaSuccess);
    free(b);
    return d;
}

/* n elements of dt on the device, as fp32 into out. */
static void vdown(float *out, const void *d, size_t n, enum kdtype dt)
{
    if (dt == KDT_F32) {
        cr_assert_eq(cudaMemcpy(out, d, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        return;
    }
    uint16_t *b = malloc(n * 2 + 2);
    cr_assert_not_null(b);
    cr_assert_eq(cudaMemcpy(b, d, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ops_cast_bf16_to_f32(out, b, n);
    free(b);
}

/* Every |gpu - cpu| <= abs + rel |cpu| + of_max max|cpu|; logs the largest difference. */
static void vclose(const char *what, const float *gpu, const float *cpu, size_t n, double abs,
                   double rel, double of_max)
{
    double amax = 0, worst = 0;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        amax = fmax(amax, fabs((double)cpu[i]));
    for (size_t i = 0; i < n; i++) {
        double diff = fabs((double)gpu[i] - (double)cpu[i]);
        if (!(diff <= worst)) worst = isnan(diff) ? INFINITY : diff;
        if (!(diff <= abs + rel * fabs((double)cpu[i]) + of_max * amax)) bad++;
    }
    cr_log_info("%s: largest difference %.3g of %zu", what, worst, n);
    cr_assert_eq(bad, 0, "%s: %zu of %zu elements beyond tolerance (largest %.3g)", what, bad, n,
                 worst);
}

static int *vtokens(size_t n, uint64_t seed)
{
    int *t = malloc(n * sizeof(int));
    cr_assert_not_null(t);
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++)
        t[i] = (int)(test_rand(&s) % VV);
    return t;
}

static int *vdev_ints(const int *h, size_t n)
{
    int *d = NULL;
    cr_assert_eq(cudaMalloc((void **)&d, n * sizeof(int)), cudaSuccess);
    cr_assert_eq(cudaMemcpy(d, h, n * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
}

/* Every rank's share of the embedding, summed on the host in rank order: the one-rank
 * embedding exactly (in bf16 the fp32 sum of the bf16 weights, which the backend rounds). */
static void check_vp_embed_forward(enum kdtype dt)
{
    vneed_gpu();
    size_t N = (size_t)VB * VT, NC = N * VC;
    int bf = dt != KDT_F32;
    float *wte = vrand((size_t)VV * VC, 1, -1, 1, bf), *wpe = vrand((size_t)VT * VC, 2, -1, 1, bf);
    float *want = calloc(NC, sizeof(float)), *sum = calloc(NC, sizeof(float)),
          *got = calloc(NC, sizeof(float));
    cr_assert(want && sum && got);
    int *tok = vtokens(N, 3), *d_tok = vdev_ints(tok, N);
    void *d_wpe = vup(wpe, (size_t)VT * VC, dt);
    float *d_x = NULL;
    cr_assert_eq(cudaMalloc((void **)&d_x, NC * 4), cudaSuccess);
    for (int r = 0; r < VTP; r++) {
        int lo = range_lo(r), hi = range_lo(r + 1);
        void *d_wte = vup(wte + (size_t)lo * VC, (size_t)(hi - lo) * VC, dt);
        cr_assert_eq(kernel_vp_embed_forward(d_x, d_wte, d_wpe, d_tok, VB, VT, VC, lo, hi, dt, 0),
                     0);
        vdown(got, d_x, NC, KDT_F32);
        for (size_t i = 0; i < NC; i++)
            sum[i] += got[i];
        cudaFree(d_wte);
    }
    ops_embed_forward(want, wte, wpe, tok, VB, VT, VC);
    vclose(dt == KDT_F32 ? "vp embed forward (fp32)" : "vp embed forward (bf16)", sum, want, NC, 0,
           0, 0);
    cudaFree(d_x);
    cudaFree(d_wpe);
    cudaFree(d_tok);
    free(tok);
    free(wte);
    free(wpe);
    free(want);
    free(sum);
    free(got);
}

Test(kernels_gpu, vp_embed_forward_sums_to_the_cpu_f32)
{
    check_vp_embed_forward(KDT_F32);
}

Test(kernels_gpu, vp_embed_forward_sums_to_the_cpu_bf16)
{
    check_vp_embed_forward(KDT_BF16);
}

/* Each rank's d_wte rows and its d_wpe are the one-rank backward's, bit for bit. */
static void check_vp_embed_backward(enum kdtype dt)
{
    vneed_gpu();
    size_t N = (size_t)VB * VT, NC = N * VC, TC = (size_t)VT * VC;
    int bf = dt != KDT_F32;
    float *d_x = vrand(NC, 4, -1, 1, bf), *init = vrand((size_t)VV * VC, 5, -1, 1, 0);
    float *want_wte = malloc((size_t)VV * VC * 4), *want_wpe = calloc(TC, 4),
          *got = malloc((size_t)VV * VC * 4);
    cr_assert(want_wte && want_wpe && got);
    memcpy(want_wte, init, (size_t)VV * VC * 4);
    int *tok = vtokens(N, 6), *d_tok = vdev_ints(tok, N);
    ops_embed_backward(want_wte, want_wpe, d_x, tok, VB, VT, VC);
    void *dd_x = vup(d_x, NC, dt);
    for (int r = 0; r < VTP; r++) {
        int lo = range_lo(r), hi = range_lo(r + 1);
        float *d_wte = vup(init + (size_t)lo * VC, (size_t)(hi - lo) * VC, KDT_F32);
        float *zeros = calloc(TC, 4);
        float *d_wpe = vup(zeros, TC, KDT_F32);
        cr_assert_eq(kernel_vp_embed_backward(d_wte, d_wpe, dd_x, d_tok, VB, VT, VC, lo, hi, dt, 0),
                     0);
        vdown(got, d_wte, (size_t)(hi - lo) * VC, KDT_F32);
        vclose("vp embed backward d_wte rows", got, want_wte + (size_t)lo * VC,
               (size_t)(hi - lo) * VC, 0, 0, 0);
        vdown(got, d_wpe, TC, KDT_F32);
        vclose("vp embed backward d_wpe", got, want_wpe, TC, 0, 0, 0);
        cudaFree(d_wte);
        cudaFree(d_wpe);
        free(zeros);
    }
    cudaFree(dd_x);
    cudaFree(d_tok);
    free(tok);
    free(d_x);
    free(init);
    free(want_wte);
    free(want_wpe);
    free(got);
}

Test(kernels_gpu, vp_embed_backward_matches_the_cpu_f32)
{
    check_vp_embed_backward(KDT_F32);
}

Test(kernels_gpu, vp_embed_backward_matches_the_cpu_bf16)
{
    check_vp_embed_backward(KDT_BF16);
}

/* The loss and dlogits of the vocab-parallel cross-entropy, the ranks' maxima gathered and
 * their stats summed on the host, against ops_crossentropy over the whole rows; run twice,
 * the same bits. */
static void check_vp_crossentropy(enum kdtype dt, float scale)
{
    vneed_gpu();
    const int N = VB * VT;
    size_t NV = (size_t)N * VV;
    float *logits = vrand(NV, 7, -4, 4, 0), *want = malloc(NV * 4), *want_l = calloc(N, 4);
    float *gathered = calloc((size_t)VTP * N, 4), *stats = calloc(2 * (size_t)N, 4),
          *part = calloc(2 * (size_t)N, 4), *got = calloc(NV, 4), *got_l = calloc(N, 4),
          *first = calloc(NV, 4);
    cr_assert(want && want_l && gathered && stats && part && got && got_l && first);
    memcpy(want, logits, NV * 4);
    int *tgt = vtokens((size_t)N, 8), *d_tgt = vdev_ints(tgt, (size_t)N);
    ops_crossentropy(want, want_l, tgt, (size_t)N, VV, 1);
    for (size_t i = 0; i < NV; i++)
        want[i] *= scale;
    float *d_l[VTP], *d_max[VTP], *d_st = NULL, *d_g = NULL, *d_loss = NULL;
    void *d_dl = NULL;
    cr_assert_eq(cudaMalloc((void **)&d_st, 2 * (size_t)N * 4), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&d_g, (size_t)VTP * N * 4), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&d_loss, (size_t)N * 4), cudaSuccess);
    cr_assert_eq(cudaMalloc(&d_dl, NV * 4), cudaSuccess);
    for (int run = 0; run < 2; run++) {
        /* The ranks' row maxima, gathered. */
        for (int r = 0; r < VTP; r++) {
            int lo = range_lo(r), Vr = range_lo(r + 1) - lo;
            float *rows = malloc((size_t)N * Vr * 4);
            cr_assert_not_null(rows);
            for (int n = 0; n < N; n++)
                memcpy(rows + (size_t)n * Vr, logits + (size_t)n * VV + lo, (size_t)Vr * 4);
            d_l[r] = vup(rows, (size_t)N * Vr, KDT_F32);
            d_max[r] = vup(part, (size_t)N, KDT_F32);
            free(rows);
            cr_assert_eq(kernel_vp_rowmax(d_max[r], d_l[r], N, Vr, 0), 0);
            vdown(gathered + (size_t)r * N, d_max[r], (size_t)N, KDT_F32);
        }
        cr_assert_eq(cudaMemcpy(d_g, gathered, (size_t)VTP * N * 4, cudaMemcpyHostToDevice),
                     cudaSuccess);
        /* Their stats, summed in rank order. */
        memset(stats, 0, 2 * (size_t)N * 4);
        for (int r = 0; r < VTP; r++) {
            int lo = range_lo(r), Vr = range_lo(r + 1) - lo;
            cr_assert_eq(kernel_vp_stats(d_st, d_max[r], d_g, VTP, d_l[r], d_tgt, N, Vr, lo, VV, 0),
                         0);
            vdown(part, d_st, 2 * (size_t)N, KDT_F32);
            for (int i = 0; i < 2 * N; i++)
                stats[i] += part[i];
        }
        cr_assert_eq(cudaMemcpy(d_st, stats, 2 * (size_t)N * 4, cudaMemcpyHostToDevice),
                     cudaSuccess);
        for (int r = 0; r < VTP; r++) {
            int lo = range_lo(r), Vr = range_lo(r + 1) - lo;
            cr_assert_eq(kernel_vp_crossentropy(d_loss, d_dl, d_l[r], d_max[r], d_st, d_tgt, N, Vr,
                                                lo, scale, dt, 0),
                         0);
            float *rows = malloc((size_t)N * Vr * 4);
            cr_assert_not_null(rows);
            vdown(rows, d_dl, (size_t)N * Vr, dt);
            for (int n = 0; n < N; n++)
                memcpy(got + (size_t)n * VV + lo, rows + (size_t)n * Vr, (size_t)Vr * 4);
            free(rows);
            vdown(got_l, d_loss, (size_t)N, KDT_F32);
            vclose("vp cross-entropy losses", got_l, want_l, (size_t)N, 1e-4, 1e-5, 0);
            cudaFree(d_l[r]);
            cudaFree(d_max[r]);
        }
        if (dt == KDT_F32)
            vclose("vp cross-entropy dlogits (fp32)", got, want, NV, 1e-4 * scale, 1e-5, 0);
        else
            vclose("vp cross-entropy dlogits (bf16)", got, want, NV, 0, 1e-2, 1e-2);
        if (run == 0)
            memcpy(first, got, NV * 4);
        else
            cr_assert_eq(memcmp(first, got, NV * 4), 0, "vp cross-entropy: not the same bits");
    }
    cudaFree(d_st);
    cudaFree(d_g);
    cudaFree(d_loss);
    cudaFree(d_dl);
    cudaFree(d_tgt);
    free(tgt);
    free(logits);
    free(want);
    free(want_l);
    free(gathered);
    free(stats);
    free(part);
    free(got);
    free(got_l);
    free(first);
}

Test(kernels_gpu, vp_crossentropy_matches_the_cpu_f32)
{
    check_vp_crossentropy(KDT_F32, 1.0f);
}

Test(kernels_gpu, vp_crossentropy_matches_the_cpu_bf16)
{
    check_vp_crossentropy(KDT_BF16, 1.0f);
}

Test(kernels_gpu, vp_crossentropy_scales_by_the_loss_scale)
{
    check_vp_crossentropy(KDT_F32, 1024.0f);
}

#define VFAKE ((void *)(uintptr_t)0x1000)

Test(kernels_gpu, vp_kernels_refuse_bad_input)
{
    float *f = VFAKE;
    int *i = VFAKE;
    cr_assert_eq(kernel_vp_embed_forward(NULL, f, f, i, 2, 3, 4, 0, 5, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_vp_embed_forward(f, f, f, i, 2, 3, 4, 5, 5, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_vp_embed_forward(f, f, f, i, 2, 3, 4, -1, 5, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_vp_embed_forward(f, f, f, i, 2, 3, 4, 0, 5, (enum kdtype)7, 0), -EINVAL);
    cr_assert_eq(kernel_vp_embed_backward(f, f, f, NULL, 2, 3, 4, 0, 5, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_vp_embed_backward(f, f, f, i, 2, 0, 4, 0, 5, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_vp_rowmax(NULL, f, 2, 3, 0), -EINVAL);
    cr_assert_eq(kernel_vp_rowmax(f, f, 2, 0, 0), -EINVAL);
    cr_assert_eq(kernel_vp_stats(f, f, f, 0, f, i, 2, 3, 0, 5, 0), -EINVAL);
    cr_assert_eq(kernel_vp_stats(f, f, f, 2, f, i, 2, 3, 3, 5, 0), -EINVAL); /* lo + Vr > V */
    cr_assert_eq(kernel_vp_crossentropy(f, f, f, f, f, i, 2, 3, 0, 0.0f, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_vp_crossentropy(f, f, f, f, f, i, 2, 3, 0, 1.0f, KDT_F32, 0), -EINVAL);
    cr_assert_eq(kernel_vp_crossentropy(f, VFAKE, (float *)0x2000, f, f, i, 2, 3, 0, 1.0f,
                                        (enum kdtype)7, 0),
                 -EINVAL);
}

#endif
