/*
 * backend.h - where the trainer's math runs. The trainer fetches tensors to the device
 * tier and hands their pointers to a backend; the backend is chosen at run time by what
 * the device tier is: CUDA kernels and cuBLAS over GPU memory when the tier is CUDA
 * (backend_cuda.c), gpt.c and ops.c over host memory when it is emulated (backend_cpu.c).
 * The trainer's own logic is the same for both: no #ifdef.
 *
 * The element type of the weights the device computes with (wdt) is fp32, bf16 or fp16. In
 * bf16 and fp16 the trainer keeps a 16-bit copy of every parameter as its own tensor next to
 * the fp32 master; the optimizer writes both, and the engine carries the copy to the device
 * on its next fetch. Activation checkpoints are in adt: wdt on a GPU, fp32 otherwise (the
 * CPU backend computes in fp32 from 16-bit weights widened on the fly).
 *
 * Calls are queued in order on the backend's compute stream and may return before the
 * work is done: backend_sync() waits for it, and the trainer calls it before it releases
 * a pointer the queued work uses, so the engine never moves or evicts memory a kernel
 * still reads. The gradient flowing back through the blocks (B,T,C), the batch, the loss
 * and the sum of squared gradients live in the backend.
 *
 * Not here: which tensors exist or where they live (trainer.c), the math (gpt.c, ops.c,
 * kernels/).
 */
#ifndef ZINF_TRAIN_BACKEND_H
#define ZINF_TRAIN_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "train/adamw.h"
#include "train/adamw_states.h"
#include "train/gpt.h"
#include "train/gpt_sp.h"
#include "train/gpt_tp.h"

enum backend_dtype { BACKEND_F32, BACKEND_BF16, BACKEND_F16 };

static inline size_t backend_dtype_bytes(enum backend_dtype d)
{
    return d == BACKEND_F32 ? 4 : 2;
}

struct backend_params {
    struct gpt_config cfg;
    int B, T;
    enum backend_dtype wdt; /* weights on the device */
    int cuda_device;        /* the ordinal the engine's device tier uses */
    /* Tensor parallel (NULL, or tp 1: none): this rank's slices, and the collectives of its
     * tensor-parallel group, which the caller may fill in after the open (ctx, allreduce,
     * allgather: read at each call). The CPU's (gpt_tp.c) and the GPU's
     * (backend_cuda_tp.c), the GPU's over device memory. */
    const struct gpt_tp_comm *tp;
    /* Sequence parallel (NULL, or sp 1: none): this rank's positions of every sequence
     * (gpt_sp.h), B x T / sp rows of activations and gradients, and its group's all-to-all
     * (filled in as tp's; on the CPU's memory or the GPU's, with coll_wait). Not with tp. */
    const struct backend_sp *sp;
};

struct backend_sp {
    int sp, rank;
    gpt_sp_alltoall_fn alltoall;
    void *ctx;
};

struct backend;

struct backend_ops {
    void (*close)(struct backend *b);
    /* This step's batch: tokens and targets (B,T) in host memory, copied. */
    int (*set_batch)(struct backend *b, const int *tokens, const int *targets);
    /* bytes of device memory at p set to 0. */
    int (*zero)(struct backend *b, void *p, size_t bytes);
    /* x (B,T,C) in adt = wte[tokens] + wpe. */
    int (*embed_forward)(struct backend *b, const void *wte, const void *wpe, void *x);
    /* x_out = block(x_in), both (B,T,C) in adt; w: the block's 12 weights in wdt. */
    int (*block_forward)(struct backend *b, const void *const *w, const void *x_in, void *x_out);
    /* The loss of x (B,T,C), the last block's output, and the first gradient: sets the
     * backend's gradient d (B,T,C); d_lnf_w, d_lnf_b (C) and d_wte (V,C) fp32 +=. All three
     * NULL: a frozen head (LoRA), d only (the CPU backend's; others refuse LoRA). */
    int (*head_backward)(struct backend *b, const void *lnf_w, const void *lnf_b, const void *wte,
                         const void *x, float *d_lnf_w, float *d_lnf_b, float *d_wte);
    /* d = d pulled back through the block whose input was x_in; g (12, fp32) +=. */
    int (*block_backward)(struct backend *b, const void *const *w, const void *x_in,
                          float *const *g);
    /* LoRA (gpt_lora.h): block_forward and block_backward with low-rank adapters on a frozen
     * block. aw: each target's A then B (2 GPT_LORA_NTARGETS, in wdt; NULL where the target
     * has none), of rank r, scaled by scale; the base weights get no gradient, ag (fp32,
     * as aw) += the adapters'. NULL on a backend without them (the trainer refuses LoRA). */
    int (*lora_block_forward)(struct backend *b, const void *const *w, const void *const *aw,
                              int r, float scale, const void *x_in, void *x_out);
    int (*lora_block_backward)(struct backend *b, const void *const *w, const void *const *aw,
                               int r, float scale, const void *x_in, float *const *ag);
    /* d_wte (V,C) and d_wpe (T,C) fp32 += the embedding's share of d. */
    int (*embed_backward)(struct backend *b, float *d_wte, float *d_wpe);
    /* The step's sum of squared gradients += sum of g[i]^2 (n fp32). */
    int (*sumsq)(struct backend *b, const float *g, size_t n);
    /* AdamW in device memory (the optimizer's states live on the device); w16 (n), may be
     * NULL, receives the cast of the new parameter to wdt (bf16 or fp16). */
    int (*adamw)(struct backend *b, float *p, const float *g, float *m, float *v, uint16_t *w16,
                 size_t n, const struct adamw_hparams *h, int step, float grad_scale);
    /* The same with m and v stored as dt (adamw_states.h: bf16 or 8-bit blockwise), at in
     * the whole tensor as adamw_update_states takes it. */
    int (*adamw_states)(struct backend *b, float *p, const float *g, void *m, void *v,
                        uint16_t *w16, size_t n, enum adamw_state_dtype dt,
                        const struct adamw_state_at *at, const struct adamw_hparams *h, int step,
                        float grad_scale);
    /* LAMB in the tier where the states are (adamw.h's lamb_moments and lamb_apply):
     * lamb_moments updates m and v and leaves the chunk sums of p^2 and u^2 in w_sq and u_sq
     * (host memory, one double per chunk; written when it returns); lamb_apply updates p by
     * coeff, and w16 (n, may be NULL) receives the cast of the new parameter to wdt. */
    int (*lamb_moments)(struct backend *b, const float *p, const float *g, float *m, float *v,
                        size_t n, const struct adamw_hparams *h, float grad_scale,
                        int eps_inside_sqrt, size_t chunk, double *w_sq, double *u_sq);
    int (*lamb_apply)(struct backend *b, float *p, const float *m, const float *v, uint16_t *w16,
                      size_t n, const struct adamw_hparams *h, int step, int eps_inside_sqrt,
                      float coeff);
    /* *sum += the digest terms (digest.h) of p (n fp32 in the device tier), which start at
     * block first_block of tensor `tensor`. Runs after what is queued. */
    int (*digest)(struct backend *b, const float *p, size_t n, uint32_t tensor,
                  size_t first_block, uint64_t *sum);
    /* g (n fp32) = src (first), or g += src element by element: a micro-batch's gradient,
     * summed over the ranks, folded into what the step keeps. src may be g when first. */
    int (*fold)(struct backend *b, float *g, const float *src, size_t n, int first);
    /* out[k] (host memory) = the sum of squares of g's chunk k, the floats [k * chunk,
     * (k + 1) * chunk) of n (the last may be short): the clipping norm's chunk sums. Waits
     * for what is queued: out is written when it returns. */
    int (*chunk_sumsq)(struct backend *b, const float *g, size_t n, size_t chunk, double *out);
    /* The gradient flowing back, d (B,T,C) in adt, to host memory (put false) or from it
     * (put true): what a pipeline stage sends to the one before and receives from the one
     * after. Waits for what is queued. */
    int (*grad_io)(struct backend *b, void *host, bool put);
    /* bytes of device memory from src to dst (the two do not overlap). */
    int (*copy)(struct backend *b, void *dst, const void *src, size_t bytes);
    /* dst (n elements of wdt, device memory) = src (n fp32): the copy the device computes
     * with, refreshed from the master weights. */
    int (*cast)(struct backend *b, void *dst, const float *src, size_t n);
    /* Events of the compute stream, to order it with a collective's stream (comm_req's
     * wait_event and done_event): event_new makes one (*ev NULL where the backend has no
     * streams: the CPU's), record marks the end of what is queued now, wait makes what is
     * queued after it wait for ev. All accept NULL. */
    int (*event_new)(struct backend *b, void **ev);
    void (*event_free)(struct backend *b, void *ev);
    int (*record)(struct backend *b, void *ev);
    int (*wait)(struct backend *b, void *ev);
    /* Waits until everything queued has finished. */
    int (*sync)(struct backend *b);
    /* Waits, then hands out the step's loss and sum of squares and resets the sum. */
    int (*collect)(struct backend *b, float *loss, double *sumsq);
};

struct backend {
    const struct backend_ops *ops;
    const char *name;       /* "cpu", "cuda" */
    enum backend_dtype wdt; /* weights the device computes with */
    enum backend_dtype adt; /* activation checkpoints */
    uint64_t work_bytes;    /* device memory the backend holds outside the engine's budget */
    float loss_scale;       /* head_backward multiplies the loss's gradient by this (fp16
                               loss scaling), so every gradient after it is scaled; 1 */
    int any_thread;         /* 1: fold and chunk_sumsq may run on another thread than the
                               compute's, beside it (the CPU's); 0: the caller's thread only */
    /* Where the math calls a collective of tp's or sp's (backend_params), the event its
     * stream recorded just before, after the work that wrote the collective's input: the
     * collective's own stream waits for it (comm_req.wait_event). NULL: no streams (the
     * CPU's), the input is in place when the call is made. */
    void *coll_wait;
    /* The MoE block's ops (backend_moe.h); NULL where the backend has none. */
    const struct backend_moe_ops *moe;
};

/* The activation checkpoints' type: the CPU keeps them in fp32, the GPU in the weights'. */
static inline enum backend_dtype backend_act_dtype(bool cuda, enum backend_dtype wdt)
{
    return cuda ? wdt : BACKEND_F32;
}

/* 0, or -EINVAL with one line in err naming what is wrong with p: the model, (B,T) or wdt. */
int backend_params_check(const struct backend_params *p, char *err, size_t errlen);
/* 0 and *out, or -errno with one line in err. backend_cuda_open answers -ENODEV in builds
 * without the CUDA kernels. */
int backend_cpu_open(const struct backend_params *p, struct backend **out, char *err,
                     size_t errlen);
int backend_cuda_open(const struct backend_params *p, struct backend **out, char *err,
                      size_t errlen);
/* Whether this build has the CUDA backend. */
int backend_cuda_built(void);

static inline void backend_close(struct backend *b)
{
    if (b) b->ops->close(b);
}

#endif
