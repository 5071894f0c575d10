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

struct cuda_backend {
    struct backend b;
    struct gpt_config cfg;
    int B, T, N, C, NH, V;
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
    struct cuda_moe *moe; /* the MoE ops' buffers (backend_cuda_moe.c), made on first use */
};

/* Frees the MoE ops' buffers (backend_cuda_moe.c). */
void backend_cuda_moe_close(struct cuda_backend *c);

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
