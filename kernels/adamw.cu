/*
 * adamw.cu - the AdamW step on the GPU: the CUDA twin of src/train/adamw.c's scalar
 * reference (same arithmetic, same order of operations per element; one thread per
 * element, grid-stride). tests/test_kernels.c runs both on the same input and reports the
 * largest difference against the fp32 tolerance.
 *
 * Not here: mixed precision, fused clipping (the scale comes in, as on the CPU).
 */
#include <errno.h>
#include <math.h>

#include "kernels/kernels.h"

__global__ static void adamw_kernel(float *p, const float *g, float *m, float *v, size_t n,
                                    float gs, float b1, float omb1, float b2, float omb2,
                                    float bc1, float bc2, float eps, float wd, float lr)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float gi = g[i] * gs;
        float mi = b1 * m[i] + omb1 * gi;
        float vi = b2 * v[i] + omb2 * (gi * gi);
        float mhat = mi * bc1, vhat = vi * bc2;
        p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * p[i]);
        m[i] = mi;
        v[i] = vi;
    }
}

extern "C" int kernel_adamw(float *param, const float *grad, float *m, float *v, size_t n,
                            const struct adamw_hparams *h, int step, float grad_scale,
                            cudaStream_t stream)
{
    if (!h || step < 1 || (n && (!param || !grad || !m || !v)))
        return -EINVAL;
    if (n == 0)
        return 0;
    /* Bias corrections in double on the host, as the CPU path computes them. */
    float bc1 = (float)(1.0 / (1.0 - pow(h->beta1, step)));
    float bc2 = (float)(1.0 / (1.0 - pow(h->beta2, step)));
    unsigned threads = 256;
    size_t want = (n + threads - 1) / threads;
    unsigned blocks = (unsigned)(want < 65535 * 8 ? want : 65535 * 8);
    adamw_kernel<<<blocks, threads, 0, stream>>>(param, grad, m, v, n, grad_scale, h->beta1,
                                                 1.0f - h->beta1, h->beta2, 1.0f - h->beta2,
                                                 bc1, bc2, h->eps, h->weight_decay, h->lr);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : e == cudaErrorInvalidValue ? -EINVAL : -EIO;
}
