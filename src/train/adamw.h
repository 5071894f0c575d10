/*
 * adamw.h - the AdamW optimizer step on the CPU, over one flat fp32 buffer at a time:
 * bias correction, decoupled weight decay, and what global-norm gradient clipping needs
 * (the sum of squares of a gradient buffer, and a scale applied to the gradient on the fly).
 *
 *   g = grad * grad_scale
 *   m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
 *   param -= lr * ( (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
 *                   + weight_decay * param )
 *
 * The update is memory bound (28 bytes per element: param, grad, m and v read, param, m and
 * v written), so it is written to stream: an AVX-512F or AVX2+FMA kernel chosen at run time,
 * split over OpenMP threads in fixed chunks. Each element is computed alone and the same
 * way wherever it falls (vector tails use masks), so the result does not depend on the
 * thread count; every kernel (the scalar reference with fmaf, the vector ones with their
 * FMA instructions, the GPU's with __fmaf_rn) fuses the same multiply-adds, so the bits do
 * not depend on the kernel either.
 *
 * Not here: where the buffers live, per-parameter-group policies (the caller passes
 * weight_decay = 0 for tensors that should not decay), learning-rate schedules.
 */
#ifndef ZINF_TRAIN_ADAMW_H
#define ZINF_TRAIN_ADAMW_H

#include <stddef.h>
#include <stdint.h>

#include "adamw_hparams.h" /* struct adamw_hparams */

/* lr 3e-4, beta1 0.9, beta2 0.999, eps 1e-8, weight_decay 0 (PyTorch's AdamW but for the
 * decay, which is left to the caller per tensor). */
void adamw_hparams_defaults(struct adamw_hparams *h);

/* The kernels; adamw_update() uses the best one the CPU runs. */
enum adamw_isa { ADAMW_ISA_SCALAR, ADAMW_ISA_AVX2, ADAMW_ISA_AVX512, ADAMW_ISA_BEST };
enum adamw_isa adamw_best_isa(void);
const char *adamw_isa_name(enum adamw_isa isa);

/* One step over n elements, in place on param, m and v; step counts from 1. grad_scale
 * multiplies the gradient before use (1 when not clipping). -EINVAL for step < 1, NULL
 * buffers with n > 0, hyperparameters out of range or a grad_scale that is not finite. */
int adamw_update(float *param, const float *grad, float *m, float *v, size_t n,
                 const struct adamw_hparams *h, int step, float grad_scale);
/* The same with a chosen kernel: ADAMW_ISA_SCALAR is the one-thread plain-C reference;
 * -ENOTSUP when this CPU cannot run the one asked for. Tests and benchmarks compare them. */
int adamw_update_isa(enum adamw_isa isa, float *param, const float *grad, float *m, float *v,
                     size_t n, const struct adamw_hparams *h, int step, float grad_scale);

/* adamw_update() fused with the cast of each new parameter to bf16 into param_bf16 (n
 * elements, rounded to nearest even): the fp32 master is updated where the optimizer runs
 * and the bf16 copy the device computes with is written in the same pass. */
int adamw_update_bf16(float *param, const float *grad, float *m, float *v, uint16_t *param_bf16,
                      size_t n, const struct adamw_hparams *h, int step, float grad_scale);

/* LAMB as DeepSpeed's FusedLamb computes it, on one tensor (or a rank's part of it), in two
 * passes so that the trust ratio can be summed across ranks in between:
 *   g = grad x grad_scale     m = beta1 m + (1 - beta1) g     v = beta2 v + (1 - beta2) g^2
 *   u = m / (sqrt(v) + eps) + weight_decay x param     (eps_inside_sqrt: m / sqrt(v + eps))
 *   coeff = |param| / |u|, clamped to [min_coeff, max_coeff]; 1 where either norm is 0
 *   param -= lr sqrt(1 - beta2^step) / (1 - beta1^step) x coeff x u   (no_bias_correction: lr)
 * h->l2 is not used (LAMB's decay is in u). lamb_moments updates m and v and sums param^2 and
 * u^2 by chunks of `chunk` elements (w_sq[k], u_sq[k] for chunk k, each in double in element
 * order; threads take whole chunks, so the sums do not depend on the thread count);
 * lamb_coeff makes the ratio from the totals; lamb_apply recomputes u from the new m and v
 * and updates param, and its bf16 copy when param_bf16 is not NULL. -EINVAL as adamw_update,
 * and for chunk 0 or NULL sums. */
int lamb_moments(const float *param, const float *grad, float *m, float *v, size_t n,
                 const struct adamw_hparams *h, float grad_scale, int eps_inside_sqrt, size_t chunk,
                 double *w_sq, double *u_sq);
float lamb_coeff(double w_sq, double u_sq, float max_coeff, float min_coeff);
int lamb_apply(float *param, const float *m, const float *v, uint16_t *param_bf16, size_t n,
               const struct adamw_hparams *h, int step, int eps_inside_sqrt, float coeff);

/* *out = sum of x[i]^2 over n elements, accumulated in double in a fixed order that does
 * not depend on the thread count. Clipping sums this over every gradient buffer. */
int adamw_sum_squares(const float *x, size_t n, double *out);
/* The grad_scale that brings a gradient of global norm sqrt(sum_squares) down to max_norm:
 * max_norm / norm when norm > max_norm, else 1; 1 when max_norm <= 0 (no clipping). */
float adamw_clip_scale(double sum_squares, float max_norm);

#endif
