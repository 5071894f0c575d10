/*
 * backend_cuda_int.h - the CUDA backend's state (backend_cuda.c), for the files that compute
 * parts of it apart: its buffers, stream and cuBLAS handle. Only with the CUDA kernels.
 */
#ifndef ZINF_TRAIN_BACKEND_CUDA_INT_H
#define ZINF_TRAIN_BACKEND_CUDA_INT_H

#include <errno.h>

#include "zinf_build.h"
#include "train/backend.h"

#if ZINF_HAVE_KERNELS
#include "kernels/kernels.h"

struct cuda_sp;

struct cuda_backend {
    struct backend b;
    struct gpt_config cfg;
    /* N = B*T rows; sequence parallel (sp): this rank's B*T/sp, NH its NH/sp heads, T the
     * whole sequence's length. */
    int B, T, N, C, NH, V;
    /* Tensor parallel (backend_cuda_tp.c; NULL without): the rank's group, its channels Cr,
     * heads NHr and rows [vlo, vlo + Vr) of wte, which size the working buffers below (C, NH,
     * V and 0 without), and the buffers of its own. */
    const struct gpt_tp_comm *tp;
    int Cr, NHr, Vr, vlo;
    struct cuda_tp *tpx;
    enum kdtype dt;
    cudaStream_t s;
    cublasHandle_t blas;
    void *mem;       /* one cudaMalloc holding every buffer below */
    int *tokens_h;   /* (B,T) x 2, pinned: the batch on its way to the device */
    float *losses_h; /* (N), pinned */
    double *sumsq_h; /* (1), pinned */
    float loss;      /* the head's, once collected */
    int have_loss;

    int *tokens, *targets;                              /* (N) */
    void *d;                                            /* (N,C) dt: the gradient flowing back */
    void *ln1, *qkv, *atty, *x2, *ln2, *fch, *fch_gelu; /* (N,C) (N,3C) (N,C) x3 (N,4C) x2 */
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd;   /* (N) */
    float *att, *d_att;                                 /* (B,NH,T,T) */
    void *d_x2, *d_big, *d_small;                       /* (N,C) (N,4C) (N,C) */
    void *lnf, *d_lnf, *dlogits;                        /* (N,C) (N,C) (N,V) */
    float *lnf_mean, *lnf_rstd;                         /* (N) */
    float *logits, *losses;                             /* (N,V) (N) */
    double *sumsq;                                      /* (1) */
    void *scratch;                                      /* reductions */
    /* chunk_sumsq's sums on the device and on their way to the host (pinned), grown to
     * the most chunks asked for at once. */
    double *chunks, *chunks_h;
    size_t chunks_cap;
    struct cuda_sp *sp; /* sequence parallel (backend_cuda_sp.c), or NULL */
    struct cuda_moe *moe; /* the MoE ops' buffers (backend_cuda_moe.c), made on first use */
};

/* Frees the MoE ops' buffers (backend_cuda_moe.c). */
void backend_cuda_moe_close(struct cuda_backend *c);

/* The tensor-parallel parts (backend_cuda_tp.c). cuda_tp_setup (before the working buffers
 * are sized) checks the cut and sets tp, Cr, NHr, Vr and vlo; cuda_tp_alloc (on the device,
 * after them) makes the buffers of its own and adds them to work_bytes; cuda_tp_close frees
 * them. The ops are backend_ops' on the rank's slices (gpt_tp.h). */
int cuda_tp_setup(struct cuda_backend *c, const struct backend_params *p, char *err, size_t errlen);
int cuda_tp_alloc(struct cuda_backend *c);
void cuda_tp_close(struct cuda_backend *c);
int cuda_tp_embed_forward(struct cuda_backend *c, const void *wte, const void *wpe, void *x);
int cuda_tp_block_forward(struct cuda_backend *c, const void *const *w, const void *x_in,
                          void *x_out);
int cuda_tp_head_backward(struct cuda_backend *c, const void *lnf_w, const void *lnf_b,
                          const void *wte, const void *x, float *d_lnf_w, float *d_lnf_b,
                          float *d_wte);
int cuda_tp_block_backward(struct cuda_backend *c, const void *const *w, const void *x_in,
                           float *const *g);
int cuda_tp_embed_backward(struct cuda_backend *c, float *d_wte, float *d_wpe);

static inline struct cuda_backend *cub(struct backend *b)
{
    return (struct cuda_backend *)b;
}

static inline int cuerr(cudaError_t e)
{
    return e == cudaSuccess                 ? 0
           : e == cudaErrorMemoryAllocation ? -ENOMEM
           : e == cudaErrorInvalidValue     ? -EINVAL
                                            : -EIO;
}

#endif
#endif
