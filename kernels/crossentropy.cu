/*
 * crossentropy.cu - the loss head on the GPU: softmax and cross-entropy fused over fp32
 * logits (N,V), the CUDA twin of ops_crossentropy. Per row, as on the CPU: the max, the
 * normaliser sum_j exp(l_j - max) accumulated in double, loss = log(sum) - (l_tgt - max),
 * and optionally dlogits = (softmax - onehot) * scale / N in the element type, scale being
 * the fp16 loss scale (1 otherwise: then the factor is exactly 1/N). One block per row;
 * the row's sums are fixed-order block reductions, so the results are the same bits on
 * every run.
 *
 * A target outside [0, V) cannot be checked before the launch (targets live on the
 * device): its row's loss is NaN and its dlogits are the plain softmax / N.
 *
 * Not here: the mean over rows (the caller sums losses, on the host or with a reduction),
 * label smoothing, ignore indices.
 */
#include <math.h>

#include "kernels/common.cuh"

#define CE_THREADS 256

/* dlogits may alias logits (fp32): every read of the row (l_tgt, the max and the sum) is
 * done before the barriers inside the second block_reduce, and the write loop has each
 * thread read l_j just before it overwrites element j. Hence no __restrict__ on them. */
template <typename E>
__global__ static void crossentropy_kernel(float *__restrict__ losses, E *dlogits,
                                           const float *logits, const int *__restrict__ targets,
                                           size_t N, size_t V, float factor)
{
    for (size_t n = blockIdx.x; n < N; n += gridDim.x) {
        const float *l = logits + n * V;
        int tgt = targets[n];
        bool ok = tgt >= 0 && (size_t)tgt < V;
        float lt = ok ? l[tgt] : NAN;
        float mx = -INFINITY;
        for (size_t j = threadIdx.x; j < V; j += blockDim.x)
            mx = fmaxf(mx, l[j]);
        mx = block_reduce(mx, MaxOp());
        double sum = 0.0;
        for (size_t j = threadIdx.x; j < V; j += blockDim.x)
            sum += (double)expf(l[j] - mx);
        sum = block_reduce(sum, SumOp());
        if (threadIdx.x == 0) losses[n] = (float)(log(sum) - (double)(lt - mx));
        if (dlogits) {
            float inv = (float)(1.0 / sum);
            E *dl = dlogits + n * V;
            for (size_t j = threadIdx.x; j < V; j += blockDim.x) {
                float prob = expf(l[j] - mx) * inv;
                st(dl, j, (prob - (ok && j == (size_t)tgt ? 1.0f : 0.0f)) * factor);
            }
        }
        /* Rows do not overlap, and the next row's first block_reduce starts with a
         * barrier before it reuses shared memory: nothing more is needed here. */
    }
}

extern "C" int kernel_crossentropy(float *losses, void *dlogits, const float *logits,
                                   const int *targets, int N, int V, float scale, enum kdtype dt,
                                   cudaStream_t s)
{
    if (!losses || !logits || !targets || N <= 0 || V <= 0 || !dt_ok(dt)) return -EINVAL;
    if (!(scale > 0.0f) || !isfinite(scale)) return -EINVAL;
    if (dt != KDT_F32 && dlogits == (const void *)logits) return -EINVAL;
    /* 1/N, then times the scale: a power of two (what loss scalers use) keeps it exact. */
    float factor = (1.0f / (float)N) * scale;
    return with_elem(dt, [&](auto t) {
        using E = ELEM(t);
        crossentropy_kernel<E><<<grid_rows((size_t)N), CE_THREADS, 0, s>>>(
            losses, (E *)dlogits, logits, targets, (size_t)N, (size_t)V, factor);
        return launch_result();
    });
}
