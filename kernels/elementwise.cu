/*
 * elementwise.cu - the small elementwise kernels: the residual add (twin of ops_add) and
 * the casts between any two of fp32, bf16 and fp16 (twins of ops_cast_f32_to_bf16,
 * ops_cast_bf16_to_f32, ops_cast_f32_to_f16 and ops_cast_f16_to_f32; fp32 -> bf16 and
 * fp32 -> fp16 round to nearest even with __float2bfloat16 and __float2half, as the CPU
 * casts do, except that a NaN comes out as the canonical NaN rather than keeping its
 * payload; bf16 <-> fp16 goes through fp32, exactly, then rounds once).
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
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        add_kernel<E>
            <<<grid_for(n, KTHREADS), KTHREADS, 0, s>>>((E *)out, (const E *)a, (const E *)b, n);
        return launch_result();
    });
}

/* dst (n) = src (n) through fp32: exact for bf16 -> fp32, fp16 -> fp32 and the same-type
 * copies (NaN payloads aside). */
template <typename D, typename S>
__global__ static void cast_kernel(D *__restrict__ dst, const S *__restrict__ src, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        st(dst, i, ld(src, i));
}

extern "C" int kernel_cast(void *dst, enum kdtype dst_dt, const void *src, enum kdtype src_dt,
                           size_t n, cudaStream_t s)
{
    if (!dst || !src || n == 0 || !dt_ok(dst_dt) || !dt_ok(src_dt)) return -EINVAL;
    return with_elem(dst_dt, [&](auto dtag) {
        return with_elem(src_dt, [&](auto stag) {
            using D = ELEM(dtag);
            using S = ELEM(stag);
            cast_kernel<D, S>
                <<<grid_for(n, KTHREADS), KTHREADS, 0, s>>>((D *)dst, (const S *)src, n);
            return launch_result();
        });
    });
}
