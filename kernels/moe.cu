/*
 * moe.cu - the rows of a mixture-of-experts block on the GPU: gathering the routed
 * rows of each expert into the exchange's blocks, the combine of each token's experts'
 * outputs, and the per-row part of an expert's backward (the gradients of the combine
 * weights). The twins are moe_ep.c's packing (memcpy of rows), moe.c's moe_row_axpy and
 * moe_row_add summed in expert order, and moe.c's rows_backward loop. The rows that travel
 * between ranks are fp32 (moe_ep.c's blocks); the activations they come from and go to are
 * in the model's element type, read and written through common.cuh's ld and st (fp32
 * inside).
 *
 * Each output element is written by one thread, its terms added in the order the maps
 * give (no atomics), so the bits do not depend on the launch. The maps (off, tok) come from
 * moe_ep.c by way of the host; a token's rows are listed in expert order.
 *
 * Not here: the experts' linear layers and GELU (matmul.cu, gelu.cu), the route.
 */
#include "kernels/common.cuh"

/* dst[off[i] + c] = src[tok[i] * C + c]. */
template <typename E>
__global__ static void gather_kernel(float *dst, const E *src, const int64_t *off, const int *tok,
                                     int n, int C)
{
    size_t total = (size_t)n * C, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t x = (size_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += stride) {
        size_t i = x / C, c = x % C;
        dst[off[i] + (int64_t)c] = ld(src, (size_t)tok[i] * C + c);
    }
}

/* y[t,c] = sum over j < k in order, while off[t*k + j] >= 0, of w * rows[off + c], from 0:
 * moe_row_axpy's y += w * x (or moe_row_add's y += x without weights). */
template <typename E>
__global__ static void combine_kernel(E *y, const float *rows, const int64_t *off, const float *wt,
                                      int N, int k, int C)
{
    size_t total = (size_t)N * C, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t x = (size_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += stride) {
        size_t t = x / C, c = x % C;
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            int64_t o = off[t * k + j];
            if (o < 0) break;
            float v = rows[o + (int64_t)c];
            acc = wt ? __fmaf_rn(wt[t * k + j], v, acc) : __fadd_rn(acc, v);
        }
        st(y, x, acc);
    }
}

/* One block per row: d_w[i] = d_y[i] . out[i] summed in double (each thread a strided part,
 * then the block's fixed reduction), d_o[i] = w[i] * d_y[i]. */
template <typename E>
__global__ static void weight_grad_kernel(E *d_o, float *d_w, const float *d_y, const float *out,
                                          const float *w, int C)
{
    size_t i = blockIdx.x;
    const float *dy = d_y + i * C, *o = out + i * C;
    double dot = 0.0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        dot += (double)dy[c] * o[c];
        st(d_o, i * C + c, w[i] * dy[c]);
    }
    __shared__ double part[KTHREADS];
    part[threadIdx.x] = dot;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h /= 2) {
        if ((int)threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0) d_w[i] = (float)part[0];
}

extern "C" int kernel_moe_gather(float *dst, const void *src, enum kdtype src_dt,
                                 const int64_t *off, const int *tok, int n, int C, cudaStream_t s)
{
    if (n < 0 || C < 1 || !dt_ok(src_dt) || (n > 0 && (!dst || !src || !off || !tok)))
        return -EINVAL;
    if (n == 0) return 0;
    size_t total = (size_t)n * C;
    return with_elem(src_dt, [&](auto t) {
        using E = ELEM(t);
        gather_kernel<E>
            <<<grid_for(total, KTHREADS), KTHREADS, 0, s>>>(dst, (const E *)src, off, tok, n, C);
        return launch_result();
    });
}

extern "C" int kernel_moe_combine(void *y, enum kdtype y_dt, const float *rows, const int64_t *off,
                                  const float *wt, int N, int k, int C, cudaStream_t s)
{
    if (!y || !rows || !off || N < 1 || k < 1 || C < 1 || !dt_ok(y_dt)) return -EINVAL;
    size_t total = (size_t)N * C;
    return with_elem(y_dt, [&](auto t) {
        using E = ELEM(t);
        combine_kernel<E>
            <<<grid_for(total, KTHREADS), KTHREADS, 0, s>>>((E *)y, rows, off, wt, N, k, C);
        return launch_result();
    });
}

extern "C" int kernel_moe_weight_grad(void *d_o, enum kdtype d_o_dt, float *d_w, const float *d_y,
                                      const float *out, const float *w, int n, int C,
                                      cudaStream_t s)
{
    if (n < 0 || C < 1 || !dt_ok(d_o_dt) || (n > 0 && (!d_o || !d_w || !d_y || !out || !w)))
        return -EINVAL;
    if (n == 0) return 0;
    return with_elem(d_o_dt, [&](auto t) {
        using E = ELEM(t);
        weight_grad_kernel<E><<<n, KTHREADS, 0, s>>>((E *)d_o, d_w, d_y, out, w, C);
        return launch_result();
    });
}
