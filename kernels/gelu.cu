/*
 * gelu.cu - GELU on the GPU, the tanh approximation GPT-2 uses: the CUDA twins of
 * ops_gelu_forward and ops_gelu_backward, with the same constants and the same order of
 * operations per element (fp32 inside, loads and stores in the element type).
 *
 * Not here: the exact erf GELU, fusion with the matmul that feeds it.
 */
#include "kernels/common.cuh"

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */

/* out (n) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). out may be inp. */
template <typename E> __global__ static void gelu_forward_kernel(E *out, const E *inp, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float x = ld(inp, i);
        float u = GELU_SCALE * (x + 0.044715f * x * x * x);
        st(out, i, 0.5f * x * (1.0f + tanhf(u)));
    }
}

/* d (n) *= GELU'(inp (n)): d enters as dloss/dout and leaves as dloss/dinp. */
template <typename E> __global__ static void gelu_backward_kernel(E *d, const E *inp, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float x = ld(inp, i);
        float u = GELU_SCALE * (x + 0.044715f * x * x * x);
        float th = tanhf(u);
        float du = GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
        st(d, i, ld(d, i) * (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du));
    }
}

extern "C" int kernel_gelu_forward(void *out, const void *inp, size_t n, enum kdtype dt,
                                   cudaStream_t s)
{
    if (!out || !inp || n == 0 || !dt_ok(dt)) return -EINVAL;
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        gelu_forward_kernel<E>
            <<<grid_for(n, KTHREADS), KTHREADS, 0, s>>>((E *)out, (const E *)inp, n);
        return launch_result();
    });
}

extern "C" int kernel_gelu_backward(void *d, const void *inp, size_t n, enum kdtype dt,
                                    cudaStream_t s)
{
    if (!d || !inp || n == 0 || !dt_ok(dt)) return -EINVAL;
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        gelu_backward_kernel<E>
            <<<grid_for(n, KTHREADS), KTHREADS, 0, s>>>((E *)d, (const E *)inp, n);
        return launch_result();
    });
}
