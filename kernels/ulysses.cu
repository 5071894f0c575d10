/*
 * ulysses.cu - the packing of Ulysses sequence parallelism's all-to-alls on the GPU: the
 * CUDA twins of gpt_sp.c's local_xchg and heads_xchg (see gpt_sp.h for who holds what).
 *
 * An exchange buffer holds sp blocks, block j being what goes to (or came from) rank j:
 * the B*Tl rows (b, t) of G groups (q, k, v: G = 3; y: G = 1) of Cl = C/sp elements, the
 * columns of rank j's heads, B*Tl*G*Cl elements in all, block j starting at element
 * j*stride (stride >= B*Tl*G*Cl: the caller rounds blocks up to whole floats, so that
 * 16-bit elements cross as the fp32 counts the exchange takes). Two layouts meet it:
 *   local (B,Tl,G*C), every head at this rank's positions: block j holds group g's
 *     columns [g*C + j*Cl, g*C + (j+1)*Cl) of every row;
 *   heads (B,T,G*Cl), this rank's heads at every position: block j holds the rows of rank
 *     j's positions [j*Tl, (j+1)*Tl) of every sequence.
 * Packing local and unpacking heads turns "local positions, all heads" into "all positions,
 * local heads" (the attention's input, whose rows are a qkv of Cl channels and NH/sp
 * heads); packing heads and unpacking local turns it back.
 *
 * Every element is moved as its bits (16 or 32 of them, no conversion), one thread each,
 * so the result is exact and the same on every run. Not here: the exchange itself (NCCL,
 * the caller's), anything of attention.
 */
#include "kernels/common.cuh"

/* Element i of the buffer's content (sp blocks of n = B*Tl*G*Cl, i = j*n + e) and its
 * place in the layout: local when heads is false, heads otherwise. */
__device__ __forceinline__ size_t sp_place(size_t j, size_t e, size_t Tl, size_t T, size_t C,
                                           size_t Cl, size_t G, bool heads)
{
    size_t w = G * Cl, r = e / w, k = e % w;
    if (heads) {
        size_t b = r / Tl, t = r % Tl;
        return (b * T + j * Tl + t) * w + k;
    }
    size_t g = k / Cl, c = k % Cl;
    return r * G * C + g * C + j * Cl + c;
}

template <typename W>
__global__ static void sp_xchg_kernel(W *__restrict__ lay, W *__restrict__ buf, size_t sp,
                                      size_t n, size_t stride, size_t Tl, size_t T, size_t C,
                                      size_t Cl, size_t G, bool heads, bool to_buf)
{
    size_t total = sp * n, step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        size_t j = i / n, e = i % n;
        size_t p = sp_place(j, e, Tl, T, C, Cl, G, heads), x = j * stride + e;
        if (to_buf)
            buf[x] = lay[p];
        else
            lay[p] = buf[x];
    }
}

extern "C" int kernel_sp_xchg(void *lay, int heads, void *buf, int to_buf, int B, int T, int C,
                              int sp, int G, size_t stride, enum kdtype dt, cudaStream_t s)
{
    if (!lay || !buf || lay == buf || B <= 0 || T <= 0 || C <= 0 || sp <= 0 || G <= 0 ||
        T % sp || C % sp || !dt_ok(dt))
        return -EINVAL;
    size_t Tl = (size_t)T / sp, Cl = (size_t)C / sp, n = (size_t)B * Tl * G * Cl;
    if (stride < n) return -EINVAL;
    unsigned grid = grid_for((size_t)sp * n, KTHREADS);
    if (dt == KDT_F32)
        sp_xchg_kernel<uint32_t><<<grid, KTHREADS, 0, s>>>(
            (uint32_t *)lay, (uint32_t *)buf, (size_t)sp, n, stride, Tl, (size_t)T, (size_t)C,
            Cl, (size_t)G, heads != 0, to_buf != 0);
    else
        sp_xchg_kernel<uint16_t><<<grid, KTHREADS, 0, s>>>(
            (uint16_t *)lay, (uint16_t *)buf, (size_t)sp, n, stride, Tl, (size_t)T, (size_t)C,
            Cl, (size_t)G, heads != 0, to_buf != 0);
    return launch_result();
}
