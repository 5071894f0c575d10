/*
 * common.cuh - what every kernel file shares: the three element types (fp32, bf16, fp16)
 * with their loads and stores, the dispatch from enum kdtype to a template, grid sizing,
 * the warp and block reductions, the second stage of the chunked column sums, and the
 * mapping of a launch's cudaError_t to -errno.
 *
 * The reductions combine their parts in a fixed order (a butterfly within a warp, then
 * the warps' partials one after the other), so a kernel built on them computes the same
 * bits on every run. Every block that calls block_reduce() has a multiple of 32 threads.
 *
 * Not here: kernels of the trainer's layers (one .cu file per family), anything exported
 * (that is kernels.h).
 */
#ifndef ZINF_KERNELS_COMMON_CUH
#define ZINF_KERNELS_COMMON_CUH

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* The CUDA headers come before kernels.h, which includes them again inside extern "C":
 * there their include guards make them no-ops (cuda_fp16.h and cuda_bf16.h, which
 * cublas_v2.h pulls in, hold C++ templates that cannot have C linkage). */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/kernels.h"

typedef __nv_bfloat16 bf16;
typedef __half f16;

/* Threads per block of the elementwise and per-column kernels. */
#define KTHREADS 256
/* Rows per chunk of the two-stage column sums (colsum, LayerNorm dw/db): stage one sums
 * each column over CHUNK_ROWS rows into scratch, stage two adds the chunks in order. A
 * constant, so the order of every sum is a function of the shape alone. */
#define CHUNK_ROWS 64
/* Most blocks of a grid-stride launch; past that the kernels loop. */
#define MAX_BLOCKS ((size_t)65535 * 8)

/* Loads widen to fp32 and stores round from fp32 (to nearest even for bf16 and fp16; fp16
 * overflows to infinity past 65504, which is what fp16 loss scaling looks for): all the
 * arithmetic is fp32 whatever the element type. */
__device__ __forceinline__ float ld(const float *p, size_t i)
{
    return p[i];
}
__device__ __forceinline__ float ld(const bf16 *p, size_t i)
{
    return __bfloat162float(p[i]);
}
__device__ __forceinline__ float ld(const f16 *p, size_t i)
{
    return __half2float(p[i]);
}
__device__ __forceinline__ void st(float *p, size_t i, float v)
{
    p[i] = v;
}
__device__ __forceinline__ void st(bf16 *p, size_t i, float v)
{
    p[i] = __float2bfloat16(v);
}
__device__ __forceinline__ void st(f16 *p, size_t i, float v)
{
    p[i] = __float2half(v);
}

static inline bool dt_ok(enum kdtype dt)
{
    return dt == KDT_F32 || dt == KDT_BF16 || dt == KDT_F16;
}

static inline size_t dt_bytes(enum kdtype dt)
{
    return dt == KDT_F32 ? 4 : 2;
}

/* The element type E as a value, for with_elem's callers. */
template <typename E> struct elem {
    using type = E;
};
#define ELEM(tag) typename decltype(tag)::type

/* f(elem<E>{}) for the E that dt names, so that a launcher writes its launch once, for every
 * element type:
 *     return with_elem(dt, [&](auto t) { using E = ELEM(t); ...; return launch_result(); });
 * -EINVAL for a dt that names none. */
template <typename F> static inline int with_elem(enum kdtype dt, F &&f)
{
    switch (dt) {
    case KDT_F32:
        return f(elem<float>{});
    case KDT_BF16:
        return f(elem<bf16>{});
    case KDT_F16:
        return f(elem<f16>{});
    }
    return -EINVAL;
}

/* Blocks for a grid-stride loop over n items, at least one. */
static inline unsigned grid_for(size_t n, unsigned threads)
{
    size_t want = (n + threads - 1) / threads;
    if (want == 0) want = 1;
    return (unsigned)(want < MAX_BLOCKS ? want : MAX_BLOCKS);
}

/* Blocks for a block-stride loop with one block per row. */
static inline unsigned grid_rows(size_t rows)
{
    return (unsigned)(rows < MAX_BLOCKS ? (rows ? rows : 1) : MAX_BLOCKS);
}

static inline size_t chunks_of(size_t rows)
{
    return (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
}

/* The status of the launch just made (and of any earlier asynchronous failure, which
 * cudaGetLastError also reports). */
static inline int launch_result(void)
{
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return 0;
    return e == cudaErrorInvalidValue || e == cudaErrorInvalidConfiguration ? -EINVAL : -EIO;
}

/* The checks of adamw.c's check_hparams, so that the CPU and the GPU refuse the same
 * optimizer input (adamw.cu, lamb.cu). */
static inline bool adamw_hparams_ok(const struct adamw_hparams *h, int step, float grad_scale)
{
    if (!h || step < 1 || !isfinite(grad_scale)) return false;
    if (!(h->lr >= 0.0f) || !isfinite(h->lr)) return false;
    if (!(h->beta1 >= 0.0f && h->beta1 < 1.0f) || !(h->beta2 >= 0.0f && h->beta2 < 1.0f))
        return false;
    if (!(h->eps > 0.0f) || !isfinite(h->eps)) return false;
    if (!(h->weight_decay >= 0.0f) || !isfinite(h->weight_decay)) return false;
    return true;
}

struct SumOp {
    template <typename V> __device__ __forceinline__ V operator()(V a, V b) const
    {
        return a + b;
    }
};
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const
    {
        return fmaxf(a, b);
    }
};

/* Butterfly over the 32 lanes of a full warp; every lane receives the same bits (each step
 * adds the same two values, and a + b == b + a). */
template <typename V, typename Op> __device__ __forceinline__ V warp_reduce(V v, Op op)
{
    for (int o = 16; o > 0; o >>= 1)
        v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Reduce over the whole block; every thread receives the result. blockDim.x is a
 * multiple of 32, at most 1024. The first barrier keeps a previous call's readers of
 * part[] from seeing this call's writes; the second makes every warp's partial visible. */
template <typename V, typename Op> __device__ V block_reduce(V v, Op op)
{
    __shared__ V part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    V r = part[0];
    for (int w = 1; w < nwarps; w++)
        r = op(r, part[w]);
    return r;
}

/* Stage two of the chunked column sums (reduce.cu): acc[c] += sum over k = 0..nchunks-1,
 * in order, of part[k * stride + col0 + c], for c < ncols. Launches on s; 0 or -errno. */
int kernel_chunk_sums_add(float *acc, const float *part, size_t nchunks, size_t stride, size_t col0,
                          size_t ncols, cudaStream_t s);

#endif
