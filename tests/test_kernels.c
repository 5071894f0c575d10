/*
 * test_kernels.c - every CUDA kernel against its CPU reference twin on the same input,
 * reporting the largest difference against the stated tolerance (fp32: 1e-5 relative).
 * Skips where no GPU is usable or the build has no kernels.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "helpers.h"
#include "tiers/cuda_probe.h"
#include "train/adamw.h"

#if ZINF_HAVE_KERNELS
#include "kernels/kernels.h"

static void need_gpu(void)
{
    struct cuda_probe_info ci;
    if (cuda_probe(&ci) == 0)
        cr_skip_test("no usable GPU: %s", ci.reason);
}

static float *to_device(const float *h, size_t n)
{
    float *d = NULL;
    cr_assert_eq(cudaMalloc((void **)&d, n * sizeof(float)), cudaSuccess);
    cr_assert_eq(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
}

static void random_floats(float *x, size_t n, uint64_t seed, float lo, float hi)
{
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++)
        x[i] = lo + (hi - lo) * (float)((double)(test_rand(&s) >> 11) / 9007199254740992.0);
}

Test(kernels_gpu, adamw_matches_the_cpu_reference)
{
    need_gpu();
    const size_t n = ((size_t)1 << 20) + 3; /* a ragged tail */
    float *hp = malloc(n * 4), *hg = malloc(n * 4), *hm = malloc(n * 4), *hv = malloc(n * 4);
    float *out = malloc(n * 4);
    struct adamw_hparams h;
    adamw_hparams_defaults(&h);
    h.lr = 1e-3f;
    h.weight_decay = 0.1f;
    random_floats(hp, n, 1, -1, 1);
    random_floats(hg, n, 2, -0.1f, 0.1f);
    random_floats(hm, n, 3, -0.01f, 0.01f);
    random_floats(hv, n, 4, 0, 1e-4f);
    float *dp = to_device(hp, n), *dg = to_device(hg, n), *dm = to_device(hm, n),
          *dv = to_device(hv, n);

    for (int step = 1; step <= 3; step++) {
        cr_assert_eq(kernel_adamw(dp, dg, dm, dv, n, &h, step, 0.5f, 0), 0);
        cr_assert_eq(adamw_update_isa(ADAMW_ISA_SCALAR, hp, hg, hm, hv, n, &h, step, 0.5f), 0);
    }
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    const float *ref[3] = {hp, hm, hv};
    float *dev[3] = {dp, dm, dv};
    const char *names[3] = {"param", "m", "v"};
    for (int k = 0; k < 3; k++) {
        cr_assert_eq(cudaMemcpy(out, dev[k], n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        double worst = 0;
        size_t at = 0;
        for (size_t i = 0; i < n; i++) {
            double d = fabs((double)out[i] - ref[k][i]) / fmax(fabs((double)ref[k][i]), 1e-6);
            if (d > worst) {
                worst = d;
                at = i;
            }
        }
        cr_log_info("adamw %s: largest relative difference %.3g at %zu (tolerance 1e-5)",
                    names[k], worst, at);
        cr_assert_leq(worst, 1e-5, "adamw %s: relative difference %.3g at %zu: gpu %.9g cpu %.9g",
                      names[k], worst, at, out[at], ref[k][at]);
    }
    /* Bad input is refused before any launch. */
    cr_assert_eq(kernel_adamw(NULL, dg, dm, dv, n, &h, 1, 1.0f, 0), -EINVAL);
    cr_assert_eq(kernel_adamw(dp, dg, dm, dv, n, &h, 0, 1.0f, 0), -EINVAL);
    cudaFree(dp);
    cudaFree(dg);
    cudaFree(dm);
    cudaFree(dv);
    free(hp);
    free(hg);
    free(hm);
    free(hv);
    free(out);
}
#else
Test(kernels_gpu, adamw_matches_the_cpu_reference)
{
    cr_skip_test("built without the CUDA kernels (no CUDA toolkit)");
}
#endif
