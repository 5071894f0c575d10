/*
 * kernels.h - launchers of the CUDA kernels of the trainer. Each takes a cudaStream_t,
 * checks its arguments and its launch, and returns 0 or -errno (-EINVAL for bad input,
 * -EIO for a launch or cuBLAS failure); nothing here synchronises. Each kernel has a CPU
 * reference twin in src/train/ops.h or src/train/adamw.h, and tests/test_kernels.c runs
 * both on the same input and reports the largest difference against a stated tolerance
 * (fp32 1e-5 relative or 1e-4 absolute for long sums, bf16 ~1e-2, fp16 ~5e-3).
 *
 * Activations and weights come in one of three element types, named by enum kdtype for
 * each call: fp32, bf16 (__nv_bfloat16) or fp16 (__half), the last two stored as 16 bits.
 * Whatever the element type the arithmetic is fp32. Gradients of parameters, LayerNorm
 * statistics, attention probabilities, logits and everything the optimizer touches are
 * fp32. Pointers are device memory unless a comment says otherwise.
 *
 * Reductions (column sums, LayerNorm and embedding parameter gradients, sums of squares)
 * are deterministic: they run in a fixed order with no floating-point atomics, so a step
 * computes the same bits every time. Those that need room take a scratch buffer of
 * kernel_scratch_bytes(rows, cols) bytes.
 *
 * Declared only in builds with CUDA (ZINF_HAVE_KERNELS).
 */
#ifndef ZINF_KERNELS_KERNELS_H
#define ZINF_KERNELS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "adamw_hparams.h"

#ifdef __cplusplus
extern "C" {
#endif

/* In C++ (the kernel files) the enum is given int as its type, so that any int a C caller
 * passes is one of its values, which the launchers refuse with -EINVAL, rather than undefined
 * behaviour. */
#ifdef __cplusplus
enum kdtype : int {
#else
enum kdtype {
#endif
    KDT_F32 = 0,
    KDT_BF16 = 1,
    KDT_F16 = 2
};

/* Bytes of scratch that any reduction below needs over a (rows, cols) input. */
size_t kernel_scratch_bytes(size_t rows, size_t cols);

/* x (B,T,C) = wte[tokens] (V,C) + wpe[t] (T,C); tokens (B,T) int in device memory. */
int kernel_embed_forward(void *x, const void *wte, const void *wpe, const int *tokens, int B, int T,
                         int C, enum kdtype dt, cudaStream_t s);
/* d_wte (V,C) += d_x (B,T,C) scattered by token; d_wpe (T,C) += d_x summed over b.
 * scratch: kernel_scratch_bytes(B*T, C). Twin: ops_embed_backward. */
int kernel_embed_backward(float *d_wte, float *d_wpe, const void *d_x, const int *tokens, int B,
                          int T, int C, int V, enum kdtype dt, void *scratch, cudaStream_t s);

/* out (N,C) = LayerNorm(inp (N,C)) * w (C) + b (C); mean, rstd (N) fp32. out, inp, w, b in dt. */
int kernel_layernorm_forward(void *out, float *mean, float *rstd, const void *inp, const void *w,
                             const void *b, int N, int C, enum kdtype dt, cudaStream_t s);
/* dw, db (C) += parameter gradients; d_inp (N,C) = (or += when accumulate) input gradient.
 * d_inp, d_out, inp, w in dt. d_inp may be d_out (not inp). scratch: kernel_scratch_bytes(N, 2*C).
 */
int kernel_layernorm_backward(void *d_inp, int accumulate, float *dw, float *db, const void *d_out,
                              const void *inp, const void *w, const float *mean, const float *rstd,
                              int N, int C, enum kdtype dt, void *scratch, cudaStream_t s);

/* out (N,OC) in out_dt = [residual (N,OC) in out_dt +] [bias (OC) in dt +] inp (N,IC) @ W^T,
 * W (OC,IC); inp and W in dt; out_dt is dt or fp32. bias and residual may be NULL; out may be
 * residual. A cuBLAS GEMM with fp32 accumulation; the handle is set to stream s. Twin:
 * ops_linear_forward. */
int kernel_matmul_forward(cublasHandle_t h, void *out, enum kdtype out_dt, const void *inp,
                          const void *W, const void *bias, const void *residual, int N, int IC,
                          int OC, enum kdtype dt, void *scratch, cudaStream_t s);
/* d_inp (N,IC) = d_out (N,OC) @ W (OC,IC), overwritten, in dt; dW (OC,IC) fp32 +=
 * d_out^T @ inp (N,IC); db (OC) fp32 += column sums of d_out (skipped when NULL). d_out,
 * inp, W in dt. scratch: kernel_scratch_bytes(N, OC). Twin: ops_linear_backward. */
int kernel_matmul_backward(cublasHandle_t h, void *d_inp, float *dW, float *db, const void *d_out,
                           const void *inp, const void *W, int N, int IC, int OC, enum kdtype dt,
                           void *scratch, cudaStream_t s);
/* acc (OC) fp32 += the column sums of x (N,OC) in dt. scratch: kernel_scratch_bytes(N, OC). */
int kernel_colsum(float *acc, const void *x, int N, int OC, enum kdtype dt, void *scratch,
                  cudaStream_t s);
/* out (n) = a (n) + b (n), the residual add; out may be a or b. */
int kernel_add(void *out, const void *a, const void *b, size_t n, enum kdtype dt, cudaStream_t s);

/* out (n) = GELU(inp (n)), tanh approximation; d (n) *= GELU'(inp (n)) in place. */
int kernel_gelu_forward(void *out, const void *inp, size_t n, enum kdtype dt, cudaStream_t s);
int kernel_gelu_backward(void *d, const void *inp, size_t n, enum kdtype dt, cudaStream_t s);

/* Causal self-attention with the softmax fused: qkv (B,T,3C) in dt, att (B,NH,T,T) fp32
 * probabilities (0 above the diagonal), y (B,T,C) in dt. Twin: ops_attention_forward. */
int kernel_attention_forward(void *y, float *att, const void *qkv, int B, int T, int C, int NH,
                             enum kdtype dt, cudaStream_t s);
/* d_qkv (B,T,3C) in dt, overwritten, from d_y (B,T,C) in dt, qkv and att; d_att
 * (B,NH,T,T) fp32 is scratch. Twin: ops_attention_backward. */
int kernel_attention_backward(void *d_qkv, float *d_att, const void *d_y, const void *qkv,
                              const float *att, int B, int T, int C, int NH, enum kdtype dt,
                              cudaStream_t s);

/* Cross-entropy with the softmax fused over logits (N,V) fp32: losses (N) fp32; when
 * dlogits (N,V) in dt is not NULL it receives (softmax - onehot) * scale / N, scale > 0 being
 * the loss scale of fp16 training (1 otherwise). targets (N) int. dlogits may alias logits
 * when dt is fp32. Twin: ops_crossentropy (whose gradient is the one of scale 1). */
int kernel_crossentropy(float *losses, void *dlogits, const float *logits, const int *targets,
                        int N, int V, float scale, enum kdtype dt, cudaStream_t s);

/* Tensor parallelism's vocab-parallel embedding and cross-entropy (vocab.cu), a rank holding
 * the rows [lo, hi) of wte; the sums across the ranks are the caller's, between the calls.
 * Twins: gpt_tp_embed_forward, gpt_tp_embed_backward and gpt_tp_vocab.c's vp_crossentropy.
 *   x (B,T,C) fp32 = wte_r[tok - lo] (hi-lo,C) + wpe[t] (T,C) for the tokens in [lo, hi), 0
 *   for the others; wte_r and wpe in dt. */
int kernel_vp_embed_forward(float *x, const void *wte_r, const void *wpe, const int *tokens,
                            int B, int T, int C, int lo, int hi, enum kdtype dt, cudaStream_t s);
/*   d_wte_r (hi-lo,C) += the rows of d_x (B,T,C, in dt) whose token is in [lo, hi);
 *   d_wpe (T,C) += d_x summed over b. */
int kernel_vp_embed_backward(float *d_wte_r, float *d_wpe, const void *d_x, const int *tokens,
                             int B, int T, int C, int lo, int hi, enum kdtype dt, cudaStream_t s);
/*   maxes (N) = the row maxima of this rank's logits (N,Vr) fp32. */
int kernel_vp_rowmax(float *maxes, const float *logits, int N, int Vr, cudaStream_t s);
/*   From gathered (tp,N), every rank's maxes: maxes (N) = the whole rows' maxima; stats
 *   (2,N) = this rank's sums of exp(l - max) (in double, handed on as float), then the
 *   target logits minus the maxima where the target is in [lo, lo + Vr) (0 for another
 *   rank's, NaN outside [0, V)). targets (N) int. */
int kernel_vp_stats(float *stats, float *maxes, const float *gathered, int tp, const float *logits,
                    const int *targets, int N, int Vr, int lo, int V, cudaStream_t s);
/*   With stats summed over the ranks: losses (N) = log(sum) - target logit; dlogits (N,Vr)
 *   in dt, when not NULL (and not logits), = (softmax - onehot) * scale / N. */
int kernel_vp_crossentropy(float *losses, void *dlogits, const float *logits, const float *maxes,
                           const float *stats, const int *targets, int N, int Vr, int lo,
                           float scale, enum kdtype dt, cudaStream_t s);

/* Ulysses sequence parallelism's all-to-all blocks (gpt_sp.h): buf holds sp blocks of
 * B*(T/sp)*G*(C/sp) elements of dt, block j at element j*stride (stride >= that count); lay
 * is the local layout (B,T/sp,G*C), every head at this rank's positions (heads 0), or the
 * heads layout (B,T,G*C/sp), this rank's heads at every position (heads 1). to_buf 1 packs
 * lay into buf, 0 unpacks buf into lay; G is 3 (q, k, v) or 1. Moves bits only: exact.
 * Twins: gpt_sp.c's local_xchg and heads_xchg. */
int kernel_sp_xchg(void *lay, int heads, void *buf, int to_buf, int B, int T, int C, int sp, int G,
                   size_t stride, enum kdtype dt, cudaStream_t s);

/* AdamW over n fp32 elements in place, fused with the cast of the new parameter into
 * param16 (n elements of dt16, bf16 or fp16; may be NULL, and then dt16 is not read).
 * Twins: adamw_update_isa(ADAMW_ISA_SCALAR), adamw_update_bf16(), and for fp16
 * adamw_update() then ops_cast_f32_to_f16(). */
int kernel_adamw(float *param, const float *grad, float *m, float *v, void *param16,
                 enum kdtype dt16, size_t n, const struct adamw_hparams *h, int step,
                 float grad_scale, cudaStream_t s);
/* AdamW with Adam's moments stored as bf16 (state_dt 1, stochastic rounding) or 8 bits
 * blockwise (2: cap codes, then the blocks' fp32 absmax at cap rounded up to 4 bytes):
 * the twin of adamw_update_states (src/train/adamw_states.h), first and cap as its
 * adamw_state_at's, seed and tensor what the random bits hang on, maps the two dynamic
 * maps (signed then unsigned, 512 floats in host memory) for state_dt 2. */
int kernel_adamw_states(float *param, const float *grad, void *m, void *v, void *param16,
                        enum kdtype dt16, size_t n, int state_dt, uint64_t first, size_t cap,
                        uint64_t seed, uint32_t tensor, const float *maps,
                        const struct adamw_hparams *h, int step, float grad_scale,
                        cudaStream_t s);
/* LAMB over n fp32 elements in two launches, the host making the trust ratio between them:
 * kernel_lamb_moments updates m and v and writes sums[k] = sum of param^2 and
 * sums[nchunks + k] = sum of u^2 over chunk k (nchunks = ceil(n / chunk) doubles each, in
 * device memory, each in a fixed order); kernel_lamb_apply updates param by coeff (and its
 * 16-bit copy param16 in dt16 when not NULL). Twins: lamb_moments (the sums to double
 * rounding) and lamb_apply. */
int kernel_lamb_moments(const float *param, const float *grad, float *m, float *v, size_t n,
                        const struct adamw_hparams *h, float grad_scale, int eps_inside_sqrt,
                        size_t chunk, double *sums, cudaStream_t s);
int kernel_lamb_apply(float *param, const float *m, const float *v, void *param16,
                      enum kdtype dt16, size_t n, const struct adamw_hparams *h, int step,
                      int eps_inside_sqrt, float coeff, cudaStream_t s);
/* *acc (one double in device memory) += sum of x[i]^2 over n fp32 elements, in a fixed
 * order: the global gradient norm, one tensor at a time. scratch: kernel_scratch_bytes(n, 1).
 * Twin: adamw_sum_squares (equal to within double rounding of differently ordered sums). */
int kernel_sumsq(double *acc, const float *x, size_t n, void *scratch, cudaStream_t s);
/* out[k] (device memory, one double per chunk) = sum of x[i]^2 over chunk k of x, the
 * elements [k * chunk, (k + 1) * chunk) of n fp32 (the last one may be short), each in a
 * fixed order. Twin: adamw_sum_squares on each chunk (equal to within double rounding). */
int kernel_chunk_sumsq(double *out, const float *x, size_t n, size_t chunk, cudaStream_t s);
/* dst (n) in dst_dt = src (n) in src_dt, any two of the three types; narrowing rounds to
 * nearest even (fp16 overflows to infinity). Twins: ops_cast_f32_to_bf16,
 * ops_cast_bf16_to_f32, ops_cast_f32_to_f16, ops_cast_f16_to_f32. */
int kernel_cast(void *dst, enum kdtype dst_dt, const void *src, enum kdtype src_dt, size_t n,
                cudaStream_t s);

/* Mixture of experts (maps in device memory; twins in moe_ep.c and moe.c); the rows that
 * travel between ranks (dst, rows) and the weights' gradients are fp32, the activations in
 * the named type. kernel_moe_gather: dst[off[i] + c] = src[tok[i] * C + c] for i < n (the
 * rows of a route into the exchange's blocks; dst elsewhere untouched).
 * kernel_moe_combine: y (N,C) = for token t, from 0, += wt[t*k + j] * rows[off[t*k + j] + c]
 * (+= the row when wt is NULL) for j = 0, 1, .. in order while off[t*k + j] >= 0
 * (moe_row_axpy, moe_row_add in expert order), rounded to y_dt at the end.
 * kernel_moe_weight_grad: for each of n rows, d_w[i] = d_y[i] . out[i] (in double) and
 * d_o[i] = w[i] * d_y[i] (n,C) (moe.c's rows_backward). */
int kernel_moe_gather(float *dst, const void *src, enum kdtype src_dt, const int64_t *off,
                      const int *tok, int n, int C, cudaStream_t s);
int kernel_moe_combine(void *y, enum kdtype y_dt, const float *rows, const int64_t *off,
                       const float *wt, int N, int k, int C, cudaStream_t s);
int kernel_moe_weight_grad(void *d_o, enum kdtype d_o_dt, float *d_w, const float *d_y,
                           const float *out, const float *w, int n, int C, cudaStream_t s);

#ifdef __cplusplus
}
#endif
#endif
