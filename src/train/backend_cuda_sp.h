/*
 * backend_cuda_sp.h - the CUDA backend's sequence-parallel ranks (backend_cuda_sp.c): what
 * backend_cuda.c calls where a rank of Ulysses sequence parallelism (gpt_sp.h) computes
 * otherwise than one rank. Only with the CUDA kernels.
 */
#ifndef ZINF_TRAIN_BACKEND_CUDA_SP_H
#define ZINF_TRAIN_BACKEND_CUDA_SP_H

#include "train/backend_cuda_int.h"

#if ZINF_HAVE_KERNELS

/* With p->sp of sp > 1: checks the shape (gpt_sp_check, the reason in err), makes c->sp and
 * sets c's rows and heads to this rank's (c->N = B*T/sp, c->NH = NH/sp), before the working
 * buffers are sized. 0 without sp. */
int cuda_sp_open(struct cuda_backend *c, const struct backend_params *p, char *err, size_t errlen);
/* The exchange buffers and the stream event, on the backend's device (after its
 * cudaSetDevice); their bytes are added to work_bytes. */
int cuda_sp_alloc(struct cuda_backend *c);
void cuda_sp_close(struct cuda_backend *c);

/* The ops that differ on a sequence-parallel rank (backend.h's, on this rank's rows). */
int cuda_sp_set_batch(struct cuda_backend *c, const int *tokens, const int *targets);
int cuda_sp_embed_forward(struct cuda_backend *c, const void *wte, const void *wpe, void *x);
int cuda_sp_embed_backward(struct cuda_backend *c, float *d_wte, float *d_wpe);
/* The attention of the block between its two all-to-alls: the forward from c->qkv (the
 * local rows) into c->atty (the local rows), leaving c->qkv in the heads layout, as the
 * backward wants it; the backward from c->d_small (dloss/datty, the local rows) into
 * c->d_big (dloss/dqkv, the local rows), c->d_small being clobbered. */
int cuda_sp_attention_forward(struct cuda_backend *c);
int cuda_sp_attention_backward(struct cuda_backend *c);

#endif
#endif
