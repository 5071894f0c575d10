/*
 * attention.cu - causal self-attention on the GPU with the softmax fused: the CUDA twins of
 * ops_attention_forward and ops_attention_backward. Same math as the CPU: scores
 * q_i . k_j / sqrt(hs) for j <= i, softmax over them, probabilities kept in att (zero above
 * the diagonal), y_i = sum_j p_ij v_j. fp32 inside; qkv, y and their gradients load and
 * store in the element type, att and d_att are fp32.
 *
 * One block per (b, h, query row i) in the forward and the first backward kernel, one
 * block per (b, h, key row j) in the second: every output element has one owner, so there
 * are no atomics and the results are the same bits on every run. Index conventions:
 * qkv (B,T,3C) row (b,t) starts at (b*T + t)*3C, with q, k, v of head h at columns h*hs,
 * C + h*hs and 2C + h*hs; att and d_att (B,NH,T,T) row r = (b*NH + h)*T + i starts at r*T.
 *
 * Plain loops, not a flash-attention kernel: T*T probabilities are materialised because
 * the CPU twin and the backward want them. Not here: dropout, masks other than causal.
 */
#include <math.h>

#include "kernels/common.cuh"

#define ATT_THREADS 128

/* Block r over the B*NH*T query rows: (b, h, i) with i fastest. */
struct att_row {
    size_t b, h, i, bh;
};
__device__ __forceinline__ att_row att_row_of(size_t r, size_t T, size_t NH)
{
    att_row a;
    a.i = r % T;
    a.bh = r / T;
    a.h = a.bh % NH;
    a.b = a.bh / NH;
    return a;
}

/* Per query row i: scores into att's row (each thread its own j), the block's max and sum,
 * then probabilities (zeros above the diagonal); after the barrier every thread reads the
 * whole row to form y_i, one channel e per thread. */
template <typename E>
__global__ static void attention_forward_kernel(E *__restrict__ y, float *__restrict__ att,
                                                const E *__restrict__ qkv, size_t B, size_t T,
                                                size_t C, size_t NH, float scale)
{
    size_t hs = C / NH, C3 = 3 * C, rows = B * NH * T;
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        att_row a = att_row_of(r, T, NH);
        const E *base = qkv + a.b * T * C3 + a.h * hs; /* q of (b, t=0, h) */
        const E *q = base + a.i * C3;
        float *row = att + r * T;
        float mx = -INFINITY;
        for (size_t j = threadIdx.x; j <= a.i; j += blockDim.x) {
            const E *k = base + j * C3 + C;
            float dot = 0.0f;
            for (size_t e = 0; e < hs; e++)
                dot += ld(q, e) * ld(k, e);
            dot *= scale;
            row[j] = dot;
            mx = fmaxf(mx, dot);
        }
        mx = block_reduce(mx, MaxOp());
        float sum = 0.0f;
        for (size_t j = threadIdx.x; j <= a.i; j += blockDim.x) {
            float p = expf(row[j] - mx);
            row[j] = p;
            sum += p;
        }
        sum = block_reduce(sum, SumOp());
        float inv = 1.0f / sum;
        for (size_t j = threadIdx.x; j < T; j += blockDim.x)
            row[j] = j <= a.i ? row[j] * inv : 0.0f;
        /* Every thread's probabilities (global memory) are visible to the block past here. */
        __syncthreads();
        E *out = y + (a.b * T + a.i) * C + a.h * hs;
        for (size_t e = threadIdx.x; e < hs; e += blockDim.x) {
            float acc = 0.0f;
            for (size_t j = 0; j <= a.i; j++)
                acc += row[j] * ld(base + j * C3 + 2 * C, e);
            st(out, e, acc);
        }
        /* The next row's block_reduce starts with a barrier, so this row's readers of
         * shared memory are done before it is reused. */
    }
}

/* Backward, per query row i: dp_j = dy_i . v_j, dot = sum_j p_ij dp_j, and
 * ds_ij = p_ij (dp_j - dot) * scale into d_att's row i (dp first parks there, each thread
 * rewriting only its own j); after the barrier, dq_i = sum_j ds_ij k_j, one channel per
 * thread. Columns j > i of d_att are not written (the second kernel does not read them). */
template <typename E>
__global__ static void attention_backward_query(E *__restrict__ d_qkv, float *__restrict__ d_att,
                                                const E *__restrict__ d_y,
                                                const E *__restrict__ qkv,
                                                const float *__restrict__ att, size_t B, size_t T,
                                                size_t C, size_t NH, float scale)
{
    size_t hs = C / NH, C3 = 3 * C, rows = B * NH * T;
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        att_row a = att_row_of(r, T, NH);
        const E *base = qkv + a.b * T * C3 + a.h * hs;
        const E *dy = d_y + (a.b * T + a.i) * C + a.h * hs;
        const float *p = att + r * T;
        float *ds = d_att + r * T;
        float dot = 0.0f;
        for (size_t j = threadIdx.x; j <= a.i; j += blockDim.x) {
            const E *v = base + j * C3 + 2 * C;
            float d = 0.0f;
            for (size_t e = 0; e < hs; e++)
                d += ld(dy, e) * ld(v, e);
            ds[j] = d;
            dot += p[j] * d;
        }
        dot = block_reduce(dot, SumOp());
        for (size_t j = threadIdx.x; j <= a.i; j += blockDim.x)
            ds[j] = p[j] * (ds[j] - dot) * scale;
        /* Every thread's ds_ij is visible to the block past here. */
        __syncthreads();
        E *dq = d_qkv + (a.b * T + a.i) * C3 + a.h * hs;
        for (size_t e = threadIdx.x; e < hs; e += blockDim.x) {
            float acc = 0.0f;
            for (size_t j = 0; j <= a.i; j++)
                acc += ds[j] * ld(base + j * C3 + C, e);
            st(dq, e, acc);
        }
    }
}

/* Backward, per key row j: dk_j = sum_{i >= j} ds_ij q_i and dv_j = sum_{i >= j} p_ij dy_i,
 * i in increasing order, one channel per thread. No block-wide reduction, no barrier. */
template <typename E>
__global__ static void
attention_backward_key(E *__restrict__ d_qkv, const float *__restrict__ d_att,
                       const E *__restrict__ d_y, const E *__restrict__ qkv,
                       const float *__restrict__ att, size_t B, size_t T, size_t C, size_t NH)
{
    size_t hs = C / NH, C3 = 3 * C, rows = B * NH * T;
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        att_row a = att_row_of(r, T, NH); /* a.i is the key row j here */
        size_t j = a.i;
        const float *ds_col = d_att + a.bh * T * T + j; /* ds_ij at ds_col[i*T] */
        const float *p_col = att + a.bh * T * T + j;
        const E *q0 = qkv + a.b * T * C3 + a.h * hs; /* q_i at q0 + i*3C */
        const E *dy0 = d_y + a.b * T * C + a.h * hs; /* dy_i at dy0 + i*C */
        E *dk = d_qkv + (a.b * T + j) * C3 + C + a.h * hs, *dv = dk + C;
        for (size_t e = threadIdx.x; e < hs; e += blockDim.x) {
            float ak = 0.0f, av = 0.0f;
            for (size_t i = j; i < T; i++) {
                ak += ds_col[i * T] * ld(q0 + i * C3, e);
                av += p_col[i * T] * ld(dy0 + i * C, e);
            }
            st(dk, e, ak);
            st(dv, e, av);
        }
    }
}

static int att_check(const void *a, const void *b, const void *c, const void *d, int B, int T,
                     int C, int NH, enum kdtype dt)
{
    if (!a || !b || !c || !d || B <= 0 || T <= 0 || C <= 0 || NH <= 0 || C % NH != 0 || !dt_ok(dt))
        return -EINVAL;
    return 0;
}

extern "C" int kernel_attention_forward(void *y, float *att, const void *qkv, int B, int T, int C,
                                        int NH, enum kdtype dt, cudaStream_t s)
{
    int r = att_check(y, att, qkv, qkv, B, T, C, NH, dt);
    if (r < 0) return r;
    size_t rows = (size_t)B * NH * T;
    float scale = 1.0f / sqrtf((float)(C / NH));
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        attention_forward_kernel<E><<<grid_rows(rows), ATT_THREADS, 0, s>>>(
            (E *)y, att, (const E *)qkv, (size_t)B, (size_t)T, (size_t)C, (size_t)NH, scale);
        return launch_result();
    });
}

template <typename E>
static int attention_backward_launch(E *d_qkv, float *d_att, const E *d_y, const E *qkv,
                                     const float *att, size_t B, size_t T, size_t C, size_t NH,
                                     cudaStream_t s)
{
    size_t rows = B * NH * T, hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    attention_backward_query<<<grid_rows(rows), ATT_THREADS, 0, s>>>(d_qkv, d_att, d_y, qkv, att, B,
                                                                     T, C, NH, scale);
    int r = launch_result();
    if (r < 0) return r;
    /* One thread per channel of the head; the second kernel reads the first's d_att (same
     * stream, so in order). */
    unsigned threads = (unsigned)((hs + 31) / 32 * 32);
    if (threads > ATT_THREADS) threads = ATT_THREADS;
    attention_backward_key<<<grid_rows(rows), threads, 0, s>>>(d_qkv, d_att, d_y, qkv, att, B, T, C,
                                                               NH);
    return launch_result();
}

extern "C" int kernel_attention_backward(void *d_qkv, float *d_att, const void *d_y,
                                         const void *qkv, const float *att, int B, int T, int C,
                                         int NH, enum kdtype dt, cudaStream_t s)
{
    int r = att_check(d_qkv, d_att, d_y, qkv, B, T, C, NH, dt);
    if (r < 0) return r;
    if (!att) return -EINVAL;
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        return attention_backward_launch((E *)d_qkv, d_att, (const E *)d_y, (const E *)qkv, att,
                                         (size_t)B, (size_t)T, (size_t)C, (size_t)NH, s);
    });
}
