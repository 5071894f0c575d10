/*
 * vocab.cu - the vocab-parallel embedding and cross-entropy of tensor parallelism on the
 * GPU: the CUDA twins of gpt_tp_vocab.c, each rank holding the rows [lo, hi) of the tied
 * wte (gpt_tp.h). The sums across the ranks are the caller's (its collectives run between
 * these launches): the embedding's rows and zeros, the row maxima (gathered), the sums of
 * exponentials and the target logits (summed).
 *
 * As on the CPU: the embedding writes the rows of the tokens in its range and zeros for the
 * others (the sum over ranks is then exact); each rank's sum of exponentials is accumulated
 * in double against the whole row's maximum and handed on as a float; the loss is
 * log(sum) - (l_tgt - max) in double; dlogits = (softmax - onehot) * scale / N. The d_wte
 * walk of the embedding's backward gives every element one owner that adds its rows in
 * increasing n, and the row reductions are fixed-order block reductions: the same bits on
 * every run, no atomics.
 *
 * Tokens and targets come from device memory and cannot be checked before the launch: a
 * token outside [0, V) contributes to no rank's rows (the forward writes zeros for it, so
 * the position embedding alone shows), a target outside [0, V) makes its row's loss NaN.
 *
 * Not here: the collectives, the head's GEMMs (matmul.cu), the one-rank embedding (embed.cu)
 * and cross-entropy (crossentropy.cu).
 */
#include <math.h>

#include "kernels/common.cuh"

#define VP_THREADS 256
/* Token groups of the d_wte walk: threads per column (as embed.cu's). */
#define VP_WTE_GROUPS 8

/* x (N,C) fp32 = wte_r[tokens[n] - lo] + wpe[n % T] where lo <= tokens[n] < hi, else 0. */
template <typename E>
__global__ static void vp_embed_forward_kernel(float *__restrict__ x, const E *__restrict__ wte_r,
                                               const E *__restrict__ wpe,
                                               const int *__restrict__ tokens, size_t N, size_t T,
                                               size_t C, int lo, int hi)
{
    size_t total = N * C, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        size_t n = i / C, c = i % C;
        int tok = tokens[n];
        x[i] = tok < lo || tok >= hi
                   ? 0.0f
                   : ld(wte_r, (size_t)(tok - lo) * C + c) + ld(wpe, (n % T) * C + c);
    }
}

/* d_wpe (T,C) += sum over b of d_x (B,T,C): one thread per (t, c), b in order. */
template <typename E>
__global__ static void vp_embed_backward_wpe(float *__restrict__ d_wpe, const E *__restrict__ d_x,
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

/* d_wte_r (hi-lo,C) += the rows of d_x (N,C) whose token is in [lo, hi). Block (x, y) = (32
 * columns, token group y): thread c walks n = 0..N-1 and adds row n's column c when
 * (tokens[n] - lo) % VP_WTE_GROUPS == y; every (token, c) has one owner, adding in n's order. */
template <typename E>
__global__ static void vp_embed_backward_wte(float *__restrict__ d_wte_r, const E *__restrict__ d_x,
                                             const int *__restrict__ tokens, size_t N, size_t C,
                                             int lo, int hi)
{
    size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    int group = (int)blockIdx.y;
    if (c >= C) return;
    for (size_t n = 0; n < N; n++) {
        int tok = tokens[n];
        if (tok < lo || tok >= hi || (tok - lo) % VP_WTE_GROUPS != group) continue;
        d_wte_r[(size_t)(tok - lo) * C + c] += ld(d_x, n * C + c);
    }
}

/* maxes[n] = the maximum of row n of logits (N,Vr). One block per row. */
__global__ static void vp_rowmax_kernel(float *__restrict__ maxes, const float *__restrict__ logits,
                                        size_t N, size_t Vr)
{
    for (size_t n = blockIdx.x; n < N; n += gridDim.x) {
        const float *l = logits + n * Vr;
        float mx = -INFINITY;
        for (size_t j = threadIdx.x; j < Vr; j += blockDim.x)
            mx = fmaxf(mx, l[j]);
        mx = block_reduce(mx, MaxOp());
        if (threadIdx.x == 0) maxes[n] = mx;
    }
}

/* With gathered (tp,N) every rank's row maxima: maxes[n] = the whole row's maximum mx,
 * stats[n] = sum over this rank's columns of exp(l - mx), stats[N + n] = l_tgt - mx where
 * the target is one of this rank's columns [lo, lo + Vr), 0 where it is another rank's, NaN
 * where it is outside [0, V). One block per row. */
__global__ static void vp_stats_kernel(float *__restrict__ stats, float *__restrict__ maxes,
                                       const float *__restrict__ gathered, int tp,
                                       const float *__restrict__ logits,
                                       const int *__restrict__ targets, size_t N, size_t Vr, int lo,
                                       int V)
{
    for (size_t n = blockIdx.x; n < N; n += gridDim.x) {
        float mx = -INFINITY;
        for (int k = 0; k < tp; k++)
            mx = fmaxf(mx, gathered[(size_t)k * N + n]);
        const float *l = logits + n * Vr;
        double sum = 0.0;
        for (size_t j = threadIdx.x; j < Vr; j += blockDim.x)
            sum += (double)expf(l[j] - mx);
        sum = block_reduce(sum, SumOp());
        if (threadIdx.x == 0) {
            int tgt = targets[n];
            maxes[n] = mx;
            stats[n] = (float)sum;
            stats[N + n] = tgt < 0 || tgt >= V                    ? NAN
                           : tgt >= lo && (size_t)(tgt - lo) < Vr ? l[tgt - lo] - mx
                                                                  : 0.0f;
        }
    }
}

/* losses[n] = log(sum) - (l_tgt - mx) from the summed stats; dlogits (N,Vr) in E, when not
 * NULL, = (exp(l - mx) / sum - onehot) * factor. One block per row. */
template <typename E>
__global__ static void
vp_crossentropy_kernel(float *__restrict__ losses, E *__restrict__ dlogits,
                       const float *__restrict__ logits, const float *__restrict__ maxes,
                       const float *__restrict__ stats, const int *__restrict__ targets, size_t N,
                       size_t Vr, int lo, float factor)
{
    for (size_t n = blockIdx.x; n < N; n += gridDim.x) {
        float sum = stats[n], mx = maxes[n];
        if (threadIdx.x == 0) losses[n] = (float)(log((double)sum) - (double)stats[N + n]);
        if (!dlogits) continue;
        float inv = (float)(1.0 / (double)sum);
        long long tgt = (long long)targets[n] - lo;
        const float *l = logits + n * Vr;
        E *dl = dlogits + n * Vr;
        for (size_t j = threadIdx.x; j < Vr; j += blockDim.x) {
            float prob = expf(l[j] - mx) * inv;
            st(dl, j, (prob - ((long long)j == tgt ? 1.0f : 0.0f)) * factor);
        }
    }
}

extern "C" int kernel_vp_embed_forward(float *x, const void *wte_r, const void *wpe,
                                       const int *tokens, int B, int T, int C, int lo, int hi,
                                       enum kdtype dt, cudaStream_t s)
{
    if (!x || !wte_r || !wpe || !tokens || B <= 0 || T <= 0 || C <= 0 || lo < 0 || hi <= lo ||
        !dt_ok(dt))
        return -EINVAL;
    size_t N = (size_t)B * T;
    unsigned grid = grid_for(N * C, KTHREADS);
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        vp_embed_forward_kernel<E><<<grid, KTHREADS, 0, s>>>(
            x, (const E *)wte_r, (const E *)wpe, tokens, N, (size_t)T, (size_t)C, lo, hi);
        return launch_result();
    });
}

extern "C" int kernel_vp_embed_backward(float *d_wte_r, float *d_wpe, const void *d_x,
                                        const int *tokens, int B, int T, int C, int lo, int hi,
                                        enum kdtype dt, cudaStream_t s)
{
    if (!d_wte_r || !d_wpe || !d_x || !tokens || B <= 0 || T <= 0 || C <= 0 || lo < 0 || hi <= lo ||
        !dt_ok(dt))
        return -EINVAL;
    size_t N = (size_t)B * T;
    dim3 wte_grid((unsigned)((C + 31) / 32), VP_WTE_GROUPS);
    unsigned wpe_grid = grid_for((size_t)T * C, KTHREADS);
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        vp_embed_backward_wpe<E>
            <<<wpe_grid, KTHREADS, 0, s>>>(d_wpe, (const E *)d_x, (size_t)B, (size_t)T, (size_t)C);
        int r = launch_result();
        if (r < 0) return r;
        vp_embed_backward_wte<E>
            <<<wte_grid, 32, 0, s>>>(d_wte_r, (const E *)d_x, tokens, N, (size_t)C, lo, hi);
        return launch_result();
    });
}

extern "C" int kernel_vp_rowmax(float *maxes, const float *logits, int N, int Vr, cudaStream_t s)
{
    if (!maxes || !logits || N <= 0 || Vr <= 0) return -EINVAL;
    vp_rowmax_kernel<<<grid_rows((size_t)N), VP_THREADS, 0, s>>>(maxes, logits, (size_t)N,
                                                                 (size_t)Vr);
    return launch_result();
}

extern "C" int kernel_vp_stats(float *stats, float *maxes, const float *gathered, int tp,
                               const float *logits, const int *targets, int N, int Vr, int lo,
                               int V, cudaStream_t s)
{
    if (!stats || !maxes || !gathered || !logits || !targets || tp < 1 || N <= 0 || Vr <= 0 ||
        lo < 0 || V < lo + Vr)
        return -EINVAL;
    vp_stats_kernel<<<grid_rows((size_t)N), VP_THREADS, 0, s>>>(
        stats, maxes, gathered, tp, logits, targets, (size_t)N, (size_t)Vr, lo, V);
    return launch_result();
}

extern "C" int kernel_vp_crossentropy(float *losses, void *dlogits, const float *logits,
                                      const float *maxes, const float *stats, const int *targets,
                                      int N, int Vr, int lo, float scale, enum kdtype dt,
                                      cudaStream_t s)
{
    if (!losses || !logits || !maxes || !stats || !targets || N <= 0 || Vr <= 0 || lo < 0 ||
        !dt_ok(dt))
        return -EINVAL;
    if (!(scale > 0.0f) || !isfinite(scale)) return -EINVAL;
    if (dlogits == (const void *)logits) return -EINVAL;
    /* 1/N, then times the scale, as crossentropy.cu: at scale 1 exactly the CPU's 1/N. */
    float factor = (1.0f / (float)N) * scale;
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        vp_crossentropy_kernel<E><<<grid_rows((size_t)N), VP_THREADS, 0, s>>>(
            losses, (E *)dlogits, logits, maxes, stats, targets, (size_t)N, (size_t)Vr, lo, factor);
        return launch_result();
    });
}
