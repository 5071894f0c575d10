/*
 * lamb.cu - LAMB on the GPU, the twin of src/train/adamw.c's lamb_moments and lamb_apply:
 * the moments and the chunk sums of |w|^2 and |u|^2 (one block per chunk, each sum in double
 * in a fixed order: the shape alone decides it), then the update with the trust ratio the
 * host made from the sums. Per element the arithmetic is the CPU's, operation for operation,
 * with the _rn intrinsics that nvcc does not fuse; the sums are ordered otherwise than the
 * CPU's sequential ones, so the ratio agrees to double rounding, not to the bit.
 *
 * Not here: the sums across chunks and ranks and the ratio (the trainer's, on the host).
 */
#include <math.h>

#include "kernels/common.cuh"

#define LAMB_THREADS 256

/* u of one element, as adamw.c's lamb_u. */
__device__ __forceinline__ float lamb_u(float m, float v, float p, float eps, float wd, bool inside)
{
    float denom = inside ? __fsqrt_rn(__fadd_rn(v, eps)) : __fadd_rn(__fsqrt_rn(v), eps);
    return __fadd_rn(__fdiv_rn(m, denom), __fmul_rn(wd, p));
}

/* Block k: the moments of chunk k, and sums[k] = sum of p^2, sums[nchunks + k] = sum of u^2,
 * in double (each thread's stride of the chunk, then the block's reduction). */
__global__ static void lamb_moments_kernel(const float *__restrict__ p, const float *__restrict__ g,
                                           float *__restrict__ m, float *__restrict__ v, size_t n,
                                           size_t chunk, size_t nchunks, float gs, float b1,
                                           float omb1, float b2, float omb2, float eps, float wd,
                                           bool inside, double *__restrict__ sums)
{
    size_t k = blockIdx.x, i0 = k * chunk, i1 = i0 + chunk < n ? i0 + chunk : n;
    double w = 0.0, uu = 0.0;
    for (size_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        float gi = __fmul_rn(g[i], gs);
        float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(omb1, gi));
        float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(omb2, __fmul_rn(gi, gi)));
        float pi = p[i], u = lamb_u(mi, vi, pi, eps, wd, inside);
        m[i] = mi;
        v[i] = vi;
        w += (double)pi * (double)pi;
        uu += (double)u * (double)u;
    }
    w = block_reduce(w, SumOp());
    uu = block_reduce(uu, SumOp());
    if (threadIdx.x == 0) {
        sums[k] = w;
        sums[nchunks + k] = uu;
    }
}

template <typename E>
__global__ static void lamb_apply_kernel(float *__restrict__ p, const float *__restrict__ m,
                                         const float *__restrict__ v, E *__restrict__ pc, size_t n,
                                         float sc, float eps, float wd, bool inside)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float pi = p[i];
        pi = __fsub_rn(pi, __fmul_rn(sc, lamb_u(m[i], v[i], pi, eps, wd, inside)));
        p[i] = pi;
        if (pc) st(pc, i, pi);
    }
}

extern "C" int kernel_lamb_moments(const float *param, const float *grad, float *m, float *v,
                                   size_t n, const struct adamw_hparams *h, float grad_scale,
                                   int eps_inside_sqrt, size_t chunk, double *sums,
                                   cudaStream_t s)
{
    if (!adamw_hparams_ok(h, 1, grad_scale) || !chunk || !sums ||
        (n && (!param || !grad || !m || !v)))
        return -EINVAL;
    if (n == 0) return 0;
    size_t nchunks = (n + chunk - 1) / chunk;
    if (nchunks > 2147483647u) return -EINVAL;
    lamb_moments_kernel<<<(unsigned)nchunks, LAMB_THREADS, 0, s>>>(
        param, grad, m, v, n, chunk, nchunks, grad_scale, h->beta1, 1.0f - h->beta1, h->beta2,
        1.0f - h->beta2, h->eps, h->weight_decay, eps_inside_sqrt != 0, sums);
    return launch_result();
}

extern "C" int kernel_lamb_apply(float *param, const float *m, const float *v, void *param16,
                                 enum kdtype dt16, size_t n, const struct adamw_hparams *h,
                                 int step, int eps_inside_sqrt, float coeff, cudaStream_t s)
{
    if (!adamw_hparams_ok(h, step, 1.0f) || !isfinite(coeff) ||
        (n && (!param || !m || !v)))
        return -EINVAL;
    if (param16 && dt16 != KDT_BF16 && dt16 != KDT_F16) return -EINVAL;
    if (n == 0) return 0;
    /* The step size as the CPU makes it (adamw.c's lamb_apply). */
    float step_size = h->lr;
    if (!h->no_bias_correction) {
        float bc1 = (float)(1.0 - pow(h->beta1, step)), bc2 = (float)(1.0 - pow(h->beta2, step));
        step_size = h->lr * sqrtf(bc2) / bc1;
    }
    float sc = step_size * coeff;
    return with_elem(param16 ? dt16 : KDT_BF16, [&](auto t) {
        using E = ELEM(t);
        lamb_apply_kernel<E><<<grid_for(n, KTHREADS), KTHREADS, 0, s>>>(
            param, m, v, (E *)param16, n, sc, h->eps, h->weight_decay, eps_inside_sqrt != 0);
        return launch_result();
    });
}
