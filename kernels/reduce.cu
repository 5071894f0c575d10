/*
 * reduce.cu - the deterministic reductions: column sums of a (N,OC) matrix (the bias
 * gradient of a linear layer), the sum of squares of a gradient buffer (global-norm
 * clipping), and how much scratch they and the other reductions need.
 *
 * Both run in two stages with no atomics: stage one writes partial sums into scratch, stage
 * two adds the partials in a fixed order. How the work is cut depends only on the shape,
 * never on the GPU, so the same input gives the same bits on every run and every device.
 * The CPU twins (ops_colsum_acc, adamw_sum_squares) sum in another order: the results
 * agree to rounding, not bitwise.
 *
 * The chunked sum of squares (kernel_chunk_sumsq) gives one double per fixed chunk of a
 * gradient: the ranks of a partitioned run sum the chunks they own, and the clipping norm
 * adds every chunk in the layout's order, whichever rank owns it.
 *
 * Not here: fused reductions of other layers (LayerNorm's dw/db partials are in
 * layernorm.cu and finish with kernel_chunk_sums_add below).
 */
#include "kernels/common.cuh"

/* Blocks of the first stage of the sum of squares, at most; each leaves one double. */
#define SUMSQ_BLOCKS 1024
#define SUMSQ_THREADS 256

extern "C" size_t kernel_scratch_bytes(size_t rows, size_t cols)
{
    size_t chunked = chunks_of(rows) * cols * sizeof(float);
    size_t sumsq = SUMSQ_BLOCKS * sizeof(double);
    return chunked > sumsq ? chunked : sumsq;
}

/* part (nchunks,OC): part[k][c] = sum of x[n][c] over the rows n of chunk k, in order.
 * x is (N,OC). One thread per (k, c); neighbouring threads read neighbouring columns. */
template <typename E>
__global__ static void colsum_partials(float *__restrict__ part, const E *__restrict__ x, size_t N,
                                       size_t OC, size_t nchunks)
{
    size_t total = nchunks * OC, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        size_t k = idx / OC, c = idx % OC;
        size_t n0 = k * CHUNK_ROWS, n1 = n0 + CHUNK_ROWS < N ? n0 + CHUNK_ROWS : N;
        float s = 0.0f;
        for (size_t n = n0; n < n1; n++)
            s += ld(x, n * OC + c);
        part[idx] = s;
    }
}

__global__ static void chunk_sums_add(float *__restrict__ acc, const float *__restrict__ part,
                                      size_t nchunks, size_t stride, size_t col0, size_t ncols)
{
    size_t gs = (size_t)gridDim.x * blockDim.x;
    for (size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x; c < ncols; c += gs) {
        float s = 0.0f;
        for (size_t k = 0; k < nchunks; k++)
            s += part[k * stride + col0 + c];
        acc[c] += s;
    }
}

int kernel_chunk_sums_add(float *acc, const float *part, size_t nchunks, size_t stride, size_t col0,
                          size_t ncols, cudaStream_t s)
{
    chunk_sums_add<<<grid_for(ncols, KTHREADS), KTHREADS, 0, s>>>(acc, part, nchunks, stride, col0,
                                                                  ncols);
    return launch_result();
}

extern "C" int kernel_colsum(float *acc, const void *x, int N, int OC, enum kdtype dt,
                             void *scratch, cudaStream_t s)
{
    if (!acc || !x || !scratch || N <= 0 || OC <= 0 || !dt_ok(dt)) return -EINVAL;
    size_t nch = chunks_of((size_t)N), total = nch * (size_t)OC;
    float *part = (float *)scratch;
    int r = with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        colsum_partials<E><<<grid_for(total, KTHREADS), KTHREADS, 0, s>>>(
            part, (const E *)x, (size_t)N, (size_t)OC, nch);
        return launch_result();
    });
    if (r < 0) return r;
    return kernel_chunk_sums_add(acc, part, nch, (size_t)OC, 0, (size_t)OC, s);
}

/* part[blockIdx.x] = sum of x[i]^2 in double over the elements the block's threads visit
 * (a grid-stride walk over a grid whose size is a function of n alone). */
__global__ static void sumsq_partials(double *__restrict__ part, const float *__restrict__ x,
                                      size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    double acc = 0.0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        acc += (double)x[i] * (double)x[i];
    acc = block_reduce(acc, SumOp());
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

/* *acc += the nparts partials: thread t sums parts t, t + blockDim.x, ... in order, then
 * the block reduces the threads' sums. One block. */
__global__ static void sumsq_finish(double *acc, const double *__restrict__ part, unsigned nparts)
{
    double s = 0.0;
    for (unsigned i = threadIdx.x; i < nparts; i += blockDim.x)
        s += part[i];
    s = block_reduce(s, SumOp());
    if (threadIdx.x == 0) *acc += s;
}

extern "C" int kernel_sumsq(double *acc, const float *x, size_t n, void *scratch, cudaStream_t s)
{
    if (!acc || (n && (!x || !scratch))) return -EINVAL;
    if (n == 0) return 0;
    size_t want = (n + SUMSQ_THREADS * 4 - 1) / (SUMSQ_THREADS * 4);
    unsigned blocks = (unsigned)(want < SUMSQ_BLOCKS ? want : SUMSQ_BLOCKS);
    double *part = (double *)scratch;
    sumsq_partials<<<blocks, SUMSQ_THREADS, 0, s>>>(part, x, n);
    int r = launch_result();
    if (r < 0) return r;
    sumsq_finish<<<1, SUMSQ_THREADS, 0, s>>>(acc, part, blocks);
    return launch_result();
}

/* out[k] = sum of x[i]^2 in double over chunk k, the elements [k * chunk, (k + 1) * chunk)
 * of x (the last chunk may be short): one block per chunk, its threads walking the chunk
 * with a stride of the block's size, then the block's reduction. Fixed by the shape alone. */
__global__ static void chunk_sumsq(double *__restrict__ out, const float *__restrict__ x, size_t n,
                                   size_t chunk)
{
    size_t k = blockIdx.x, i0 = k * chunk, i1 = i0 + chunk < n ? i0 + chunk : n;
    double acc = 0.0;
    for (size_t i = i0 + threadIdx.x; i < i1; i += blockDim.x)
        acc += (double)x[i] * (double)x[i];
    acc = block_reduce(acc, SumOp());
    if (threadIdx.x == 0) out[k] = acc;
}

extern "C" int kernel_chunk_sumsq(double *out, const float *x, size_t n, size_t chunk,
                                  cudaStream_t s)
{
    if (!out || !x || !chunk || !n) return n == 0 && out && chunk ? 0 : -EINVAL;
    size_t nchunks = (n + chunk - 1) / chunk;
    if (nchunks > 2147483647u) return -EINVAL;
    chunk_sumsq<<<(unsigned)nchunks, SUMSQ_THREADS, 0, s>>>(out, x, n, chunk);
    return launch_result();
}
