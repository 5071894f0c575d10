/*
 * layernorm.cu - LayerNorm on the GPU: the CUDA twins of ops_layernorm_forward and
 * ops_layernorm_backward, with the same math in fp32 whatever the element type (mean
 * first, then the variance about it; eps 1e-5 inside the square root).
 *
 * One warp per row for the forward and for the input gradient (the row's sums are a
 * butterfly over the warp). The parameter gradients dw, db are column sums over the rows,
 * done in two stages with no atomics (partials per chunk of CHUNK_ROWS rows into
 * scratch, then the chunks in order), so they are the same bits on every run.
 *
 * Not here: fused residual adds, Welford's one-pass variance (the CPU does two passes, and
 * the twins should agree).
 */
#include "kernels/common.cuh"

#define LN_EPS 1e-5f   /* = OPS_LN_EPS of src/train/ops.h */
#define LN_THREADS 128 /* 4 warps, 4 rows per block */

/* out (N,C) = (inp - mean) * rstd * w + b, one warp per row. The row loop is uniform over
 * the warp, so every lane takes part in the shuffles. */
template <typename E>
__global__ static void layernorm_forward_kernel(E *__restrict__ out, float *__restrict__ mean,
                                                float *__restrict__ rstd, const E *__restrict__ inp,
                                                const E *__restrict__ w, const E *__restrict__ b,
                                                size_t N, int C)
{
    int lane = threadIdx.x & 31;
    size_t warps = (size_t)gridDim.x * (blockDim.x >> 5);
    for (size_t n = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); n < N;
         n += warps) {
        const E *x = inp + n * C;
        E *o = out + n * C;
        float m = 0.0f, var = 0.0f;
        for (int i = lane; i < C; i += 32)
            m += ld(x, i);
        m = warp_reduce(m, SumOp()) / (float)C;
        for (int i = lane; i < C; i += 32) {
            float d = ld(x, i) - m;
            var += d * d;
        }
        var = warp_reduce(var, SumOp()) / (float)C;
        float s = 1.0f / sqrtf(var + LN_EPS);
        for (int i = lane; i < C; i += 32)
            st(o, i, (ld(x, i) - m) * s * ld(w, i) + ld(b, i));
        if (lane == 0) {
            mean[n] = m;
            rstd[n] = s;
        }
    }
}

/* part (nchunks, 2C): row k holds chunk k's sums of d_out * norm (columns 0..C-1, for dw)
 * and of d_out (columns C..2C-1, for db), each over the chunk's rows in order. */
template <typename E>
__global__ static void
layernorm_param_partials(float *__restrict__ part, const E *d_out, const E *__restrict__ inp,
                         const float *__restrict__ mean, const float *__restrict__ rstd, size_t N,
                         size_t C, size_t nchunks)
{
    size_t total = nchunks * C, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        size_t k = idx / C, c = idx % C;
        size_t n0 = k * CHUNK_ROWS, n1 = n0 + CHUNK_ROWS < N ? n0 + CHUNK_ROWS : N;
        float dw = 0.0f, db = 0.0f;
        for (size_t n = n0; n < n1; n++) {
            float d = ld(d_out, n * C + c);
            dw += d * ((ld(inp, n * C + c) - mean[n]) * rstd[n]);
            db += d;
        }
        part[k * 2 * C + c] = dw;
        part[k * 2 * C + C + c] = db;
    }
}

/* d_inp (N,C) = (or += with accumulate) the input gradient, one warp per row. d_inp may be
 * d_out (or even inp, as on the CPU): each lane reads element i of the row before it writes
 * element i of d_inp, and no other lane touches i. Hence no __restrict__ on those three. */
template <typename E>
__global__ static void layernorm_dinp_kernel(E *d_inp, int accumulate, const E *d_out, const E *inp,
                                             const E *__restrict__ w,
                                             const float *__restrict__ mean,
                                             const float *__restrict__ rstd, size_t N, int C)
{
    int lane = threadIdx.x & 31;
    size_t warps = (size_t)gridDim.x * (blockDim.x >> 5);
    for (size_t n = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); n < N;
         n += warps) {
        const E *x = inp + n * C, *d = d_out + n * C;
        E *dx = d_inp + n * C;
        float m = mean[n], s = rstd[n];
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (int i = lane; i < C; i += 32) {
            float dnorm = ld(w, i) * ld(d, i);
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * ((ld(x, i) - m) * s);
        }
        dnorm_mean = warp_reduce(dnorm_mean, SumOp()) / (float)C;
        dnorm_norm_mean = warp_reduce(dnorm_norm_mean, SumOp()) / (float)C;
        for (int i = lane; i < C; i += 32) {
            float norm = (ld(x, i) - m) * s;
            float v = s * (ld(w, i) * ld(d, i) - dnorm_mean - norm * dnorm_norm_mean);
            st(dx, i, accumulate ? ld(dx, i) + v : v);
        }
    }
}

template <typename E>
static int layernorm_forward_launch(E *out, float *mean, float *rstd, const E *inp, const E *w,
                                    const E *b, size_t N, int C, cudaStream_t s)
{
    size_t rows_per_block = LN_THREADS / 32;
    layernorm_forward_kernel<<<grid_rows((N + rows_per_block - 1) / rows_per_block), LN_THREADS, 0,
                               s>>>(out, mean, rstd, inp, w, b, N, C);
    return launch_result();
}

extern "C" int kernel_layernorm_forward(void *out, float *mean, float *rstd, const void *inp,
                                        const void *w, const void *b, int N, int C, enum kdtype dt,
                                        cudaStream_t s)
{
    if (!out || !mean || !rstd || !inp || !w || !b || N <= 0 || C <= 0 || !dt_ok(dt))
        return -EINVAL;
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        return layernorm_forward_launch((E *)out, mean, rstd, (const E *)inp, (const E *)w,
                                        (const E *)b, (size_t)N, C, s);
    });
}

/* The parameter gradients first: they read d_out for every row, and the input gradient
 * may overwrite d_out. Kernels on one stream run in order, so no event is needed. */
template <typename E>
static int layernorm_backward_launch(E *d_inp, int accumulate, float *dw, float *db, const E *d_out,
                                     const E *inp, const E *w, const float *mean, const float *rstd,
                                     size_t N, size_t C, float *part, cudaStream_t s)
{
    size_t nch = chunks_of(N);
    layernorm_param_partials<<<grid_for(nch * C, KTHREADS), KTHREADS, 0, s>>>(
        part, d_out, inp, mean, rstd, N, C, nch);
    int r = launch_result();
    if (r == 0) r = kernel_chunk_sums_add(dw, part, nch, 2 * C, 0, C, s);
    if (r == 0) r = kernel_chunk_sums_add(db, part, nch, 2 * C, C, C, s);
    if (r < 0) return r;
    size_t rows_per_block = LN_THREADS / 32;
    layernorm_dinp_kernel<<<grid_rows((N + rows_per_block - 1) / rows_per_block), LN_THREADS, 0,
                            s>>>(d_inp, accumulate, d_out, inp, w, mean, rstd, N, (int)C);
    return launch_result();
}

extern "C" int kernel_layernorm_backward(void *d_inp, int accumulate, float *dw, float *db,
                                         const void *d_out, const void *inp, const void *w,
                                         const float *mean, const float *rstd, int N, int C,
                                         enum kdtype dt, void *scratch, cudaStream_t s)
{
    if (!d_inp || !dw || !db || !d_out || !inp || !w || !mean || !rstd || !scratch || N <= 0 ||
        C <= 0 || !dt_ok(dt))
        return -EINVAL;
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        return layernorm_backward_launch((E *)d_inp, accumulate, dw, db, (const E *)d_out,
                                         (const E *)inp, (const E *)w, mean, rstd, (size_t)N,
                                         (size_t)C, (float *)scratch, s);
    });
}
