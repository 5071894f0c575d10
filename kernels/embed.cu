/*
 * embed.cu - the token and position embeddings on the GPU: the CUDA twins of
 * ops_embed_forward and ops_embed_backward.
 *
 * The backward is deterministic without atomics and sums in the CPU's order: every element
 * of d_wpe and of d_wte is owned by one thread, which adds its rows in increasing n, so
 * the fp32 result equals the CPU's bit for bit. d_wpe has one thread per (t, c) walking
 * b; d_wte one thread per (c, token group) walking every row and keeping those whose token
 * falls in its group. That walk is sequential in N (B*T), which is fine at the trainer's
 * sizes; a sort by token would be the next step if it ever shows in a profile.
 *
 * Tokens come from device memory and cannot be checked before the launch: the forward
 * writes NaN for a negative token (so the loss shows it), the backward skips tokens
 * outside [0, V). A token >= V in the forward reads past wte; the caller's data loader
 * keeps tokens in range.
 *
 * Not here: the tied output projection (matmul.cu), anything that picks tokens.
 */
#include <math.h>

#include "kernels/common.cuh"

/* Token groups of the d_wte walk: threads per column. */
#define WTE_GROUPS 8

/* x (N,C) = wte[tokens[n]] + wpe[n % T], N = B*T. */
template <typename E>
__global__ static void
embed_forward_kernel(E *__restrict__ x, const E *__restrict__ wte, const E *__restrict__ wpe,
                     const int *__restrict__ tokens, size_t N, size_t T, size_t C)
{
    size_t total = N * C, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        size_t n = i / C, c = i % C;
        int tok = tokens[n];
        float v = tok < 0 ? NAN : ld(wte, (size_t)tok * C + c) + ld(wpe, (n % T) * C + c);
        st(x, i, v);
    }
}

/* d_wpe (T,C) += sum over b of d_x (B,T,C): one thread per (t, c), b in order. Row
 * (b, t) of d_x starts at (b*T + t)*C, so element (t, c) of batch b is at b*T*C + i. */
template <typename E>
__global__ static void embed_backward_wpe(float *__restrict__ d_wpe, const E *__restrict__ d_x,
                                          size_t B, size_t T, size_t C)
{
    size_t total = T * C, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        float s = d_wpe[i];
        for (size_t b = 0; b < B; b++)
            s += ld(d_x, b * total + i);
        d_wpe[i] = s;
    }
}

/* d_wte (V,C) += d_x (N,C) scattered by token. Block (x, y) = (32 columns, token group y):
 * thread c walks n = 0..N-1 and adds row n's column c when tokens[n] % WTE_GROUPS == y.
 * (tok, c) belongs to exactly one thread, so there are no races and the order is n's. The
 * branch is uniform over the warp (all its lanes see the same token). */
template <typename E>
__global__ static void embed_backward_wte(float *__restrict__ d_wte, const E *__restrict__ d_x,
                                          const int *__restrict__ tokens, size_t N, size_t C, int V)
{
    size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    int group = (int)blockIdx.y;
    if (c >= C) return;
    for (size_t n = 0; n < N; n++) {
        int tok = tokens[n];
        if (tok < 0 || tok >= V || tok % WTE_GROUPS != group) continue;
        d_wte[(size_t)tok * C + c] += ld(d_x, n * C + c);
    }
}

extern "C" int kernel_embed_forward(void *x, const void *wte, const void *wpe, const int *tokens,
                                    int B, int T, int C, enum kdtype dt, cudaStream_t s)
{
    if (!x || !wte || !wpe || !tokens || B <= 0 || T <= 0 || C <= 0 || !dt_ok(dt)) return -EINVAL;
    size_t N = (size_t)B * T;
    unsigned grid = grid_for(N * C, KTHREADS);
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        embed_forward_kernel<E><<<grid, KTHREADS, 0, s>>>((E *)x, (const E *)wte, (const E *)wpe,
                                                          tokens, N, (size_t)T, (size_t)C);
        return launch_result();
    });
}

/* scratch is not used (each output element has one owner); it is in the signature so a
 * faster split that needs room can come without changing callers, and may be NULL. */
extern "C" int kernel_embed_backward(float *d_wte, float *d_wpe, const void *d_x, const int *tokens,
                                     int B, int T, int C, int V, enum kdtype dt, void *scratch,
                                     cudaStream_t s)
{
    if (!d_wte || !d_wpe || !d_x || !tokens || B <= 0 || T <= 0 || C <= 0 || V <= 0 || !dt_ok(dt))
        return -EINVAL;
    size_t N = (size_t)B * T;
    dim3 wte_grid((unsigned)((C + 31) / 32), WTE_GROUPS);
    unsigned wpe_grid = grid_for((size_t)T * C, KTHREADS);
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        embed_backward_wpe<E>
            <<<wpe_grid, KTHREADS, 0, s>>>(d_wpe, (const E *)d_x, (size_t)B, (size_t)T, (size_t)C);
        int r = launch_result();
        if (r < 0) return r;
        embed_backward_wte<E>
            <<<wte_grid, 32, 0, s>>>(d_wte, (const E *)d_x, tokens, N, (size_t)C, V);
        return launch_result();
    });
}
