/*
 * backend_moe.h - the ops of a mixture-of-experts block (trainer_moe_step.c) that a backend
 * computes where its math runs: on the CPU (backend_cpu_moe.c) by calling gpt.c's and moe.c's
 * functions, so that the bits are theirs; on a GPU (backend_cuda_moe.c) with kernels/ and
 * cuBLAS. A backend hands them out as b->moe (NULL: it has none).
 *
 * Pointers are in the backend's memory (the device tier's, or what alloc gave) unless a
 * comment says host. The activations (x_in, x2, ln, y, d_ln, the gradient) are in the
 * backend's adt, the weights in wdt unless widened says the caller widens them to fp32 (the
 * CPU's), and the rows that travel between ranks, the statistics and every gradient of a
 * parameter are fp32. Calls are queued in order on the backend's stream as backend.h's are;
 * those that hand something to the host wait for it.
 *
 * The route stays on the host (moe_route.c): the gate's logits (N,E) come to the host, the
 * decisions (top-k, capacity, drops), the balancing loss and the gate's gradient through
 * the softmax are taken there, and the row maps and weights go back, small arrays each.
 * One routing code for every backend keeps a GPU's choices those of the CPU's on the same
 * logits. Rows are moved by maps of floats offsets (int64) and row numbers, in the order
 * moe_ep.c lays its blocks out, so the exchange between expert-parallel ranks can stage
 * through the host buffers of moe_ep.c.
 *
 * Not here: which rows go where (moe_ep.c), the route (moe_route.c), the exchange.
 */
#ifndef ZINF_TRAIN_BACKEND_MOE_H
#define ZINF_TRAIN_BACKEND_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "train/gpt.h"
#include "train/moe.h"

struct backend;

struct backend_moe_ops {
    /* 1: the weights handed in are fp32, 16-bit ones widened by the caller (the CPU's, whose
     * adt is fp32 too); 0: they are in wdt as the device tier holds them. */
    int widened;
    /* Working memory of the backend's kind: *p (bytes) or -ENOMEM; free takes NULL. Counted
     * in work_bytes. free waits for what is queued. */
    int (*alloc)(struct backend *b, void **p, size_t bytes);
    void (*free)(struct backend *b, void *p, size_t bytes);
    /* bytes between host memory and the backend's; both wait until the copy is done. */
    int (*to_host)(struct backend *b, void *host, const void *src, size_t bytes);
    int (*from_host)(struct backend *b, void *dst, const void *host, size_t bytes);
    /* The gradient flowing back (backend.h's d, (B,T,C)), where the MoE block reads and
     * writes it in place. */
    void *(*grad)(struct backend *b);
    /* The attention half and ln2 from x_in (N,C): x2 = x_in + attention(ln1(x_in)) and
     * ln = ln2(x2) with its mean and rstd (N); w: slots 0-7 of the block (gpt.h). */
    int (*attn_forward)(struct backend *b, const void *const *w, const void *x_in, void *x2,
                        void *ln, float *mean, float *rstd);
    /* logits (N,E, host) = ln (N,C) @ wg^T, wg (E,C). */
    int (*gate_logits)(struct backend *b, const void *ln, const void *wg, int E, float *logits);
    /* dst[off[i] .. + C) = src row tok[i] (C floats) for i < n; off and tok in host memory,
     * n >= 0; dst outside those rows untouched. */
    int (*gather)(struct backend *b, float *dst, const void *src, const int64_t *off,
                  const int *tok, int n);
    /* One expert (w: fc_w, fc_b, proj_w, proj_b) on n packed rows: out (n,C) =
     * proj(gelu(fc(in))); the backward recomputes it and, given d_y (n,C) and the rows'
     * combine weights wt (n): g (four, fp32) +=, d_in (n,C) and d_w (n) written (moe.h's
     * moe_expert_backward_rows). */
    int (*expert_forward)(struct backend *b, const void *const *w, int n, const float *in,
                          float *out);
    int (*expert_backward)(struct backend *b, const void *const *w, float *const *g, int n,
                           const float *in, const float *d_y, const float *wt, float *d_in,
                           float *d_w);
    /* y (N,C) = for each token t the sum, j = 0 .. k-1 in order while off[t*k + j] >= 0, of
     * wt[t*k + j] (1 when wt is NULL) times the row at rows + off[t*k + j]; 0 for a token
     * with none. off and wt in host memory. */
    int (*combine)(struct backend *b, void *y, const float *rows, const int64_t *off,
                   const float *wt, int k);
    /* out (n) = a + c, element by element; out may be a or c. */
    int (*add)(struct backend *b, void *out, const void *a, const void *c, size_t n);
    /* From d_logits (N,E, host): d_wg (E,C) += d_logits^T @ ln and d_ln (N,C) += d_logits @
     * wg. */
    int (*gate_backward)(struct backend *b, const float *d_logits, const void *ln,
                         const void *wg, int E, float *d_wg, void *d_ln);
    /* The gradient d (grad) += ln2's backward of d_ln, then d pulled back through the
     * attention half recomputed from x_in: g (slots 0-7, fp32) +=. */
    int (*attn_backward)(struct backend *b, const void *const *w, float *const *g,
                         const void *x_in, const void *x2, const void *d_ln, const float *mean,
                         const float *rstd);
};

/* What the CPU backend's MoE ops use of it (backend_cpu.c keeps it, backend_cpu_moe.c reads
 * it): the model, the batch's shape, the gradient d, gpt.c's scratch, and the experts'
 * scratch, grown on demand. */
struct backend_cpu_view {
    const struct gpt_config *cfg;
    int B, T;
    float *d;
    struct gpt_scratch *gs;
    struct moe_scratch ms;
};
struct backend_cpu_view *backend_cpu_view(struct backend *b);

extern const struct backend_moe_ops backend_cpu_moe_ops;
extern const struct backend_moe_ops backend_cuda_moe_ops;

#endif
