/*
 * ops.h - the layers of the GPT trainer on the CPU, one function per operation, in fp32:
 * the reference twins of the CUDA kernels in kernels/ (tests/test_kernels.c runs both on
 * the same input) and the pieces gpt.c builds blocks from.
 *
 * Shapes are written next to every buffer: N = B*T rows, C channels, V vocabulary,
 * NH heads of hs = C/NH channels. Reductions run in a fixed order (no atomics), so the
 * results do not depend on the thread count. Nothing here checks its input: gpt.c's
 * public functions do.
 *
 * Not here: where buffers live, the optimizer (adamw.h), any GPU code.
 */
#ifndef ZINF_TRAIN_OPS_H
#define ZINF_TRAIN_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "half.h"

#define OPS_LN_EPS 1e-5f

/* x (B,T,C) = wte[tokens] (V,C) + wpe[t] (maxT,C); tokens (B,T). */
void ops_embed_forward(float *x, const float *wte, const float *wpe, const int *tokens, size_t B,
                       size_t T, size_t C);
/* d_wte (V,C) += d_x scattered by token; d_wpe (maxT,C) += d_x summed over b. Each column
 * is summed over (b,t) in order. */
void ops_embed_backward(float *d_wte, float *d_wpe, const float *d_x, const int *tokens, size_t B,
                        size_t T, size_t C);

/* out (N,C) = (inp (N,C) - mean) * rstd * w (C) + b (C); mean and rstd (N) are kept for
 * the backward. */
void ops_layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *w,
                           const float *b, size_t N, size_t C);
/* dw, db (C) += the parameter gradients; d_inp (N,C) = (or += when accumulate) the input
 * gradient. d_inp may be inp. */
void ops_layernorm_backward(float *d_inp, int accumulate, float *dw, float *db, const float *d_out,
                            const float *inp, const float *w, const float *mean, const float *rstd,
                            size_t N, size_t C);

/* How ops_gemm cuts a GEMM's output (M,N): a grid of rows x cols tiles of tm x tn elements
 * (the last of each row and column of the grid holds the rest). A function of the shape. */
struct ops_gemm_plan {
    size_t tm, tn;
    unsigned rows, cols;
};
void ops_gemm_plan(size_t M, size_t N, size_t K, struct ops_gemm_plan *p);

/* Row-major C (M,N) = op(A) (M,K) @ op(B) (K,N) + beta * C, op transposing when ta (tb) is
 * set; its tiles (ops_gemm_plan) spread over the OpenMP threads, with the same bits for any
 * thread count. */
void ops_gemm(int ta, int tb, size_t M, size_t N, size_t K, const float *A, size_t lda,
              const float *B, size_t ldb, float beta, float *C, size_t ldc);

/* out (N,OC) = [residual (N,OC) +] b (OC) + inp (N,IC) @ W^T, W being (OC,IC). */
void ops_linear_forward(float *out, const float *inp, const float *W, const float *b,
                        const float *residual, size_t N, size_t IC, size_t OC);
/* d_inp (N,IC) = d_out (N,OC) @ W (OC,IC); dW (OC,IC) += d_out^T @ inp (N,IC);
 * db (OC) += the column sums of d_out (skipped when db is NULL). */
void ops_linear_backward(float *d_inp, float *dW, float *db, const float *d_out, const float *inp,
                         const float *W, size_t N, size_t IC, size_t OC);
/* acc (OC) += the sum over the N rows of x (N,OC), each column in row order. */
void ops_colsum_acc(float *acc, const float *x, size_t N, size_t OC);
/* out (n) = a (n) + b (n): the residual add. out may be a or b. */
void ops_add(float *out, const float *a, const float *b, size_t n);

/* out (n) = GELU(inp (n)), tanh approximation. */
void ops_gelu_forward(float *out, const float *inp, size_t n);
/* d (n) *= GELU'(inp (n)), in place: dloss/dout in, dloss/dinp out. */
void ops_gelu_backward(float *d, const float *inp, size_t n);

/* Causal self-attention. qkv (B,T,3C): q, k, v side by side, head h at columns h*hs of
 * each; att (B,NH,T,T) receives the softmax probabilities (0 above the diagonal); y (B,T,C). */
void ops_attention_forward(float *y, float *att, const float *qkv, size_t B, size_t T, size_t C,
                           size_t NH);
/* d_qkv (B,T,3C) = the input gradient, given d_y (B,T,C), qkv and att. d_row (B,NH,T) is
 * scratch. d_qkv is overwritten. */
void ops_attention_backward(float *d_qkv, float *d_row, const float *d_y, const float *qkv,
                            const float *att, size_t B, size_t T, size_t C, size_t NH);

/* The scalar references (_ref) and AVX2+FMA versions (_avx2) of GELU and attention, which
 * the functions above choose between: ops_have_avx2() says whether this CPU runs the
 * second, and the attention ones need C/NH a multiple of 8. Tests compare the two. */
int ops_have_avx2(void);
void ops_gelu_forward_ref(float *out, const float *inp, size_t n);
void ops_gelu_backward_ref(float *d, const float *inp, size_t n);
void ops_attention_forward_ref(float *y, float *att, const float *qkv, size_t B, size_t T,
                               size_t C, size_t NH);
void ops_attention_backward_ref(float *d_qkv, float *d_row, const float *d_y, const float *qkv,
                                const float *att, size_t B, size_t T, size_t C, size_t NH);
void ops_gelu_forward_avx2(float *out, const float *inp, size_t n);
void ops_gelu_backward_avx2(float *d, const float *inp, size_t n);
void ops_attention_forward_avx2(float *y, float *att, const float *qkv, size_t B, size_t T,
                                size_t C, size_t NH);
void ops_attention_backward_avx2(float *d_qkv, float *d_row, const float *d_y, const float *qkv,
                                 const float *att, size_t B, size_t T, size_t C, size_t NH);

/* Cross-entropy with the softmax fused: losses (N) = -log softmax(logits (N,V))[targets];
 * returns their mean (summed in double, in order). With want_grad, logits becomes
 * dloss/dlogits = (softmax - onehot) / N in place. */
float ops_crossentropy(float *logits, float *losses, const int *targets, size_t N, size_t V,
                       int want_grad);

/* bf16 is the top half of an fp32; the cast rounds to nearest even (NaN stays NaN). */
static inline uint16_t ops_f32_to_bf16(float f)
{
    return bf16_from_f32(f);
}
static inline float ops_bf16_to_f32(uint16_t h)
{
    return bf16_to_f32(h);
}
void ops_cast_f32_to_bf16(uint16_t *dst, const float *src, size_t n);
void ops_cast_bf16_to_f32(float *dst, const uint16_t *src, size_t n);

/* IEEE binary16 (fp16): to nearest even, overflow to infinity, subnormals kept, NaN quiet. */
uint16_t ops_f32_to_f16(float f);
float ops_f16_to_f32(uint16_t h);
void ops_cast_f32_to_f16(uint16_t *dst, const float *src, size_t n);
void ops_cast_f16_to_f32(float *dst, const uint16_t *src, size_t n);

#endif
