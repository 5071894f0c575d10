/*
 * adamw.cu - the AdamW step on the GPU: the CUDA twin of src/train/adamw.c's kernels
 * (same arithmetic, same order of operations, the same multiply-adds fused, per element;
 * one thread per element, grid-stride), fused with the cast of the new parameter to the
 * 16-bit copy the device computes with: bf16 (the twin of adamw_update_bf16) or fp16 (the
 * twin of adamw_update then ops_cast_f32_to_f16), both rounding to nearest even.
 * tests/test_kernels.c runs both on the same input and expects the same bits.
 *
 * Not here: 16-bit optimizer states, fused clipping (the scale comes in, as on the CPU; the
 * sum of squares it is computed from is kernel_sumsq in reduce.cu).
 */
#include <math.h>

#include "kernels/common.cuh"

/* One element per thread: p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p), in adamw.c's
 * order (with L2, wd * p joins the gradient instead). The _rn intrinsics are single IEEE
 * operations that nvcc may not contract, and __fmaf_rn is a multiply-add fused exactly where
 * adamw.c's kernels fuse one, so each element comes out as the CPU's bits. pc is NULL when
 * no 16-bit copy is wanted (a uniform branch). */
template <typename E, bool L2>
__global__ static void
adamw_kernel(float *__restrict__ p, const float *__restrict__ g, float *__restrict__ m,
             float *__restrict__ v, E *__restrict__ pc, size_t n, float gs, float b1, float omb1,
             float b2, float omb2, float bc1, float bc2, float eps, float wd, float lr)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float pi = p[i];
        float gi = __fmul_rn(g[i], gs);
        if (L2) gi = __fmaf_rn(wd, pi, gi); /* Adam's L2, in the gradient */
        float mi = __fmaf_rn(b1, m[i], __fmul_rn(omb1, gi));
        float vi = __fmaf_rn(b2, v[i], __fmul_rn(omb2, __fmul_rn(gi, gi)));
        float mhat = __fmul_rn(mi, bc1), vhat = __fmul_rn(vi, bc2);
        float u = __fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), eps));
        if (!L2) u = __fmaf_rn(wd, pi, u);
        pi = __fmaf_rn(-lr, u, pi);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (pc) st(pc, i, pi);
    }
}

extern "C" int kernel_adamw(float *param, const float *grad, float *m, float *v, void *param16,
                            enum kdtype dt16, size_t n, const struct adamw_hparams *h, int step,
                            float grad_scale, cudaStream_t stream)
{
    if (!adamw_hparams_ok(h, step, grad_scale) || (n && (!param || !grad || !m || !v)))
        return -EINVAL;
    if (param16 && dt16 != KDT_BF16 && dt16 != KDT_F16) return -EINVAL;
    if (n == 0) return 0;
    /* Bias corrections in double on the host, as the CPU path computes them. */
    float bc1 = h->no_bias_correction ? 1.0f : (float)(1.0 / (1.0 - pow(h->beta1, step)));
    float bc2 = h->no_bias_correction ? 1.0f : (float)(1.0 / (1.0 - pow(h->beta2, step)));
    return with_elem(param16 ? dt16 : KDT_BF16, [&](auto t) {
        using E = ELEM(t);
        if (h->l2)
            adamw_kernel<E, true><<<grid_for(n, KTHREADS), KTHREADS, 0, stream>>>(
                param, grad, m, v, (E *)param16, n, grad_scale, h->beta1, 1.0f - h->beta1,
                h->beta2, 1.0f - h->beta2, bc1, bc2, h->eps, h->weight_decay, h->lr);
        else
            adamw_kernel<E, false><<<grid_for(n, KTHREADS), KTHREADS, 0, stream>>>(
                param, grad, m, v, (E *)param16, n, grad_scale, h->beta1, 1.0f - h->beta1,
                h->beta2, 1.0f - h->beta2, bc1, bc2, h->eps, h->weight_decay, h->lr);
        return launch_result();
    });
}
