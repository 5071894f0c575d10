/*
 * adamw_states.cu - AdamW over Adam's moments kept in bf16 or in 8 bits, on the GPU: the
 * CUDA twin of src/train/adamw_states.c. The moments are widened to fp32, updated by
 * adamw.cu's arithmetic (the same fused multiply-adds as adamw.c's kernels), and stored
 * back:
 *
 *   bf16  one thread per element: stochastic rounding with the random bits of the element's
 *         index in the whole tensor (the same counter hash as the CPU's);
 *   q8    one block of ADAMW_Q8_BLOCK (256) threads per block of elements: each thread its
 *         element, the block's absmax of the new moments by a reduction in shared memory
 *         (a maximum: the order changes nothing), then each value's nearest code of the
 *         dynamic map (the maps come from the host, as adamw_q8_map builds them, and sit in
 *         shared memory), found by the same halving and the same comparisons as the CPU's.
 *
 * tests/test_kernels.c runs both against adamw_update_states and expects the same bits.
 *
 * Not here: LAMB (fp32 states only), the maps' construction (adamw_states.c).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/common.cuh"

#define QB 256 /* ADAMW_Q8_BLOCK */

struct qmaps {
    float m[256], v[256]; /* signed (m) and unsigned (v), ascending */
};

struct coeffs {
    float gs, b1, omb1, b2, omb2, bc1, bc2, eps, wd, lr;
};

/* adamw.cu's arithmetic on one element: p, and the new m and v in *m, *v. */
template <bool L2>
__device__ __forceinline__ float step_one(float pi, float g, float *m, float *v,
                                          const struct coeffs &c)
{
    float gi = __fmul_rn(g, c.gs);
    if (L2) gi = __fmaf_rn(c.wd, pi, gi);
    float mi = __fmaf_rn(c.b1, *m, __fmul_rn(c.omb1, gi));
    float vi = __fmaf_rn(c.b2, *v, __fmul_rn(c.omb2, __fmul_rn(gi, gi)));
    float mhat = __fmul_rn(mi, c.bc1), vhat = __fmul_rn(vi, c.bc2);
    float u = __fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), c.eps));
    if (!L2) u = __fmaf_rn(c.wd, pi, u);
    *m = mi;
    *v = vi;
    return __fmaf_rn(-c.lr, u, pi);
}

__host__ __device__ __forceinline__ uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* (Bits moved with memcpy, which device code and the emulation both take.) */
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* adamw_bf16_stochastic: NaN and infinity to nearest (ops_f32_to_bf16), a finite value
 * rounded up in magnitude when its low half plus r16 carries, never to infinity. */
__device__ __forceinline__ uint16_t bf16_stochastic(float x, uint32_t r16)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    if ((u & 0x7f800000u) == 0x7f800000u) {
        if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
        return (uint16_t)(u >> 16);
    }
    uint32_t s = u + (r16 & 0xffffu);
    if ((s & 0x7f800000u) == 0x7f800000u) s = u;
    return (uint16_t)(s >> 16);
}

template <typename E, bool L2>
__global__ static void adamw_bf16_kernel(float *__restrict__ p, const float *__restrict__ g,
                                         uint16_t *__restrict__ m, uint16_t *__restrict__ v,
                                         E *__restrict__ pc, size_t n, uint64_t first, uint64_t key,
                                         struct coeffs c)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float mi = bf16_bits_to_f32(m[i]), vi = bf16_bits_to_f32(v[i]);
        float pi = step_one<L2>(p[i], g[i], &mi, &vi, c);
        p[i] = pi;
        if (pc) st(pc, i, pi);
        uint32_t r = (uint32_t)mix64(key + (first + i) * 0x9e3779b97f4a7c15ull);
        m[i] = bf16_stochastic(mi, r);
        v[i] = bf16_stochastic(vi, r >> 16);
    }
}

/* The index of the code nearest x: adamw_states.c's halving and tie rule. */
__device__ __forceinline__ unsigned char nearest(const float *map, float x)
{
    unsigned lo = 0;
    for (unsigned half = 128; half; half >>= 1)
        lo += map[lo + half - 1] < x ? half : 0;
    lo += map[lo] < x;
    if (lo == 256) return 255;
    if (lo == 0) return 0;
    return (unsigned char)(lo - (x - map[lo - 1] <= map[lo] - x));
}

template <typename E, bool L2>
__global__ static void
adamw_q8_kernel(float *__restrict__ p, const float *__restrict__ g, unsigned char *__restrict__ mc,
                unsigned char *__restrict__ vc, float *__restrict__ ms, float *__restrict__ vs,
                E *__restrict__ pc, size_t n, struct qmaps q, struct coeffs c)
{
    __shared__ float map_m[256], map_v[256], red_m[QB], red_v[QB];
    unsigned t = threadIdx.x;
    map_m[t] = q.m[t];
    map_v[t] = q.v[t];
    __syncthreads();
    for (size_t b = blockIdx.x; b * QB < n; b += gridDim.x) {
        size_t i = b * QB + t;
        bool in = i < n;
        float mi = 0.0f, vi = 0.0f;
        if (in) {
            mi = __fmul_rn(map_m[mc[i]], ms[b]);
            vi = __fmul_rn(map_v[vc[i]], vs[b]);
            float pi = step_one<L2>(p[i], g[i], &mi, &vi, c);
            p[i] = pi;
            if (pc) st(pc, i, pi);
        }
        red_m[t] = in ? fabsf(mi) : 0.0f;
        red_v[t] = in ? fabsf(vi) : 0.0f;
        __syncthreads(); /* every thread has read ms[b] and vs[b] */
        for (unsigned s = QB / 2; s; s >>= 1) {
            if (t < s) {
                red_m[t] = fmaxf(red_m[t], red_m[t + s]);
                red_v[t] = fmaxf(red_v[t], red_v[t + s]);
            }
            __syncthreads();
        }
        float am = red_m[0], av = red_v[0];
        if (in) {
            mc[i] = am > 0.0f ? nearest(map_m, __fdiv_rn(mi, am)) : nearest(map_m, 0.0f);
            vc[i] = av > 0.0f ? nearest(map_v, __fdiv_rn(vi, av)) : nearest(map_v, 0.0f);
        }
        if (t == 0) {
            ms[b] = am > 0.0f ? am : 0.0f;
            vs[b] = av > 0.0f ? av : 0.0f;
        }
        __syncthreads(); /* red_m[0] read before the next block's writes */
    }
}

extern "C" int kernel_adamw_states(float *param, const float *grad, void *m, void *v, void *param16,
                                   enum kdtype dt16, size_t n, int state_dt, uint64_t first,
                                   size_t cap, uint64_t seed, uint32_t tensor, const float *maps,
                                   const struct adamw_hparams *h, int step, float grad_scale,
                                   cudaStream_t stream)
{
    if (!adamw_hparams_ok(h, step, grad_scale) || (n && (!param || !grad || !m || !v)))
        return -EINVAL;
    if (param16 && dt16 != KDT_BF16 && dt16 != KDT_F16) return -EINVAL;
    if ((state_dt != 1 && state_dt != 2) || n > cap || (state_dt == 2 && (first % QB || !maps)))
        return -EINVAL;
    if (n == 0) return 0;
    struct coeffs c = {grad_scale,
                       h->beta1,
                       1.0f - h->beta1,
                       h->beta2,
                       1.0f - h->beta2,
                       h->no_bias_correction ? 1.0f : (float)(1.0 / (1.0 - pow(h->beta1, step))),
                       h->no_bias_correction ? 1.0f : (float)(1.0 / (1.0 - pow(h->beta2, step))),
                       h->eps,
                       h->weight_decay,
                       h->lr};
    if (state_dt == 1) {
        /* adamw_states.c's key of the tensor's step */
        uint64_t key =
            mix64(mix64(seed * 0x9e3779b97f4a7c15ull + tensor) + (uint64_t)(uint32_t)step);
        return with_elem(param16 ? dt16 : KDT_BF16, [&](auto t) {
            using E = ELEM(t);
            if (h->l2)
                adamw_bf16_kernel<E, true><<<grid_for(n, KTHREADS), KTHREADS, 0, stream>>>(
                    param, grad, (uint16_t *)m, (uint16_t *)v, (E *)param16, n, first, key, c);
            else
                adamw_bf16_kernel<E, false><<<grid_for(n, KTHREADS), KTHREADS, 0, stream>>>(
                    param, grad, (uint16_t *)m, (uint16_t *)v, (E *)param16, n, first, key, c);
            return launch_result();
        });
    }
    struct qmaps q;
    memcpy(q.m, maps, sizeof(q.m));
    memcpy(q.v, maps + 256, sizeof(q.v));
    size_t at = (cap + 3) & ~(size_t)3; /* the scales after the codes, as adamw_state_bytes */
    float *ms = (float *)((char *)m + at), *vs = (float *)((char *)v + at);
    unsigned blocks = grid_rows((n + QB - 1) / QB);
    return with_elem(param16 ? dt16 : KDT_BF16, [&](auto t) {
        using E = ELEM(t);
        if (h->l2)
            adamw_q8_kernel<E, true><<<blocks, QB, 0, stream>>>(
                param, grad, (unsigned char *)m, (unsigned char *)v, ms, vs, (E *)param16, n, q, c);
        else
            adamw_q8_kernel<E, false><<<blocks, QB, 0, stream>>>(
                param, grad, (unsigned char *)m, (unsigned char *)v, ms, vs, (E *)param16, n, q, c);
        return launch_result();
    });
}
