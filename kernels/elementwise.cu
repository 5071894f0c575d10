/*
 * elementwise.cu - the small elementwise kernels: the residual add (twin of ops_add) and
 * the casts between fp32 and bf16 (twins of ops_cast_f32_to_bf16 and ops_cast_bf16_to_f32;
 * fp32 -> bf16 rounds to nearest even with __float2bfloat16, as ops_f32_to_bf16 does, except
 * that a NaN comes out as the canonical bf16 NaN rather than keeping its payload).
 *
 * Not here: anything that reduces (reduce.cu), GELU (gelu.cu).
 */
#include "kernels/common.cuh"

/* out (n) = a (n) + b (n); out may be a or b (each element is read, then written, by one
 * thread). */
template <typename E> __global__ static void add_kernel(E *out, const E *a, const E *b, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        st(out, i, ld(a, i) + ld(b, i));
}

extern "C" int kernel_add(void *out, const void *a, const void *b, size_t n, enum kdtype dt,
                          cudaStream_t s)
{
    if (!out || !a || !b || n == 0 || !dt_ok(dt)) return -EINVAL;
    if (dt == KDT_F32)
        add_kernel<<<grid_for(n, KTHREADS), KTHREADS, 0, s>>>((float *)out, (const float *)a,
                                                              (const float *)b, n);
    else
        add_kernel<<<grid_for(n, KTHREADS), KTHREADS, 0, s>>>((bf16 *)out, (const bf16 *)a,
                                                              (const bf16 *)b, n);
    return launch_result();
}

/* dst (n) = src (n) through fp32: exact for bf16 -> fp32 and for the same-type copies
 * (NaN payloads aside). */
template <typename D, typename S>
__global__ static void cast_kernel(D *__restrict__ dst, const S *__restrict__ src, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        st(dst, i, ld(src, i));
}

template <typename D, typename S>
static int cast_launch(void *dst, const void *src, size_t n, cudaStream_t s)
{
    cast_kernel<<<grid_for(n, KTHREADS), KTHREADS, 0, s>>>((D *)dst, (const S *)src, n);
    return launch_result();
}

extern "C" int kernel_cast(void *dst, enum kdtype dst_dt, const void *src, enum kdtype src_dt,
                           size_t n, cudaStream_t s)
{
    if (!dst || !src || n == 0 || !dt_ok(dst_dt) || !dt_ok(src_dt)) return -EINVAL;
    if (dst_dt == KDT_BF16)
        return src_dt == KDT_F32 ? cast_launch<bf16, float>(dst, src, n, s)
                                 : cast_launch<bf16, bf16>(dst, src, n, s);
    return src_dt == KDT_F32 ? cast_launch<float, float>(dst, src, n, s)
                             : cast_launch<float, bf16>(dst, src, n, s);
}
