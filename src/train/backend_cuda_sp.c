/*
 * backend_cuda_sp.c - Ulysses sequence-parallel ranks on the CUDA backend: gpt_sp.c's math
 * (see gpt_sp.h) with the kernels of backend_cuda.c. Rank r of sp holds positions
 * [r*T/sp, (r+1)*T/sp) of every sequence, so every position-wise layer (the LayerNorms, the
 * linears, the MLP, the residual adds, the head) is backend_cuda.c's own on its B*T/sp rows
 * (c->N), and only these differ from one rank:
 *   - the batch: the rank's positions of each sequence, taken on the host;
 *   - the embedding: the rows of wpe of those positions (and of d_wpe in the backward);
 *   - the attention: qkv (B,T/sp,3C) of every head goes to the ranks of its heads, one
 *     all-to-all, and comes back as (B,T,3C/sp), a qkv of C/sp channels and NH/sp heads
 *     (c->NH) over the whole sequence, which kernels/attention.cu runs as it is; its
 *     output (B,T,C/sp) goes back by a second all-to-all to (B,T/sp,C). The backward's two
 *     run in the reverse order (dloss/dy out, dloss/dqkv back), after the recompute's two:
 *     four per block backward, two per forward, in the same order on every rank;
 *   - the loss: the cross-entropy's gradient scaled to 1/(B*T) and the loss summed over the
 *     rank's rows and divided by B*T (backend_cuda.c, from c->N against c->B * c->T): this
 *     rank's share of the batch mean, which the trainer sums over the group.
 * The parameter gradients are this rank's positions' share; the trainer sums them over the
 * group (train_sp_grad_sum, NCCL on device memory).
 *
 * The exchanges. kernels/ulysses.cu packs a layout into sp blocks (block j for rank j) in
 * the send buffer and unpacks the received blocks, moving bits; the all-to-all itself is
 * the trainer's callback (backend_params.sp) over NCCL. Its stream waits for the event
 * recorded here on the compute stream after the packing (b->coll_wait), and the callback
 * returns once the result is in place, so the unpacking, queued after it, reads it. Blocks
 * cross in the activations' type: 16-bit elements are sent as half as many floats (a block
 * rounded up to whole floats; the exchange copies bits).
 *
 * Each layout is packed out of and unpacked into the same buffer (qkv, atty, d_small,
 * d_big): the packing has finished with it before the exchange, so no buffer beyond the
 * two exchange buffers is needed, and the forward leaves c->qkv in the heads layout, which
 * the attention's backward reads after the recompute.
 *
 * Determinism: the kernels are backend_cuda.c's (deterministic per shape), the packing and
 * the exchanges copy bits, so a run gives the same bits every time for (config, sp, B, T).
 *
 * Not here: the sum of the gradients over the group (the trainer's), tensor parallel.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "train/backend_cuda_sp.h"

#if ZINF_HAVE_KERNELS

struct cuda_sp {
    const struct backend_sp *p; /* the group's all-to-all, read at each call */
    int sp, rank, Tl;           /* Tl = T/sp positions of each sequence */
    size_t cap;                 /* elements of dt in each exchange buffer */
    void *send, *recv;          /* sp blocks each */
    cudaEvent_t ev;             /* the compute stream up to an exchange's input */
};

int cuda_sp_open(struct cuda_backend *c, const struct backend_params *p, char *err, size_t errlen)
{
    if (!p->sp || p->sp->sp <= 1) return 0;
    int r = gpt_sp_check(&p->cfg, p->sp->sp, p->sp->rank, p->B, p->T, err, errlen);
    if (r < 0) return r;
    if (!(c->sp = calloc(1, sizeof(*c->sp)))) {
        snprintf(err, errlen, "out of memory for the CUDA backend's sequence-parallel state");
        return -ENOMEM;
    }
    struct cuda_sp *s = c->sp;
    s->p = p->sp;
    s->sp = p->sp->sp;
    s->rank = p->sp->rank;
    s->Tl = p->T / s->sp;
    c->N = p->B * s->Tl;
    c->NH = p->cfg.NH / s->sp;
    /* The widest exchange, q, k and v: sp blocks of B*Tl*3*C/sp elements, each rounded up
     * to whole floats. */
    size_t block = (size_t)c->N * 3 * (size_t)(c->C / s->sp);
    s->cap = (size_t)s->sp * (block + 1);
    return 0;
}

int cuda_sp_alloc(struct cuda_backend *c)
{
    struct cuda_sp *s = c->sp;
    size_t bytes = s->cap * backend_dtype_bytes(c->b.adt);
    int r;
    if ((r = cuerr(cudaMalloc(&s->send, bytes))) < 0 ||
        (r = cuerr(cudaMalloc(&s->recv, bytes))) < 0 ||
        (r = cuerr(cudaEventCreateWithFlags(&s->ev, cudaEventDisableTiming))) < 0)
        return r;
    /* The rounding of a block to whole floats sends a few bytes no kernel writes: zeros. */
    if ((r = cuerr(cudaMemsetAsync(s->send, 0, bytes, c->s))) < 0) return r;
    c->b.work_bytes += 2 * bytes;
    return 0;
}

void cuda_sp_close(struct cuda_backend *c)
{
    struct cuda_sp *s = c->sp;
    if (!s) return;
    cudaFree(s->send);
    cudaFree(s->recv);
    if (s->ev) cudaEventDestroy(s->ev);
    free(s);
    c->sp = NULL;
}

int cuda_sp_set_batch(struct cuda_backend *c, const int *tokens, const int *targets)
{
    struct cuda_sp *s = c->sp;
    size_t Tl = (size_t)s->Tl, T = (size_t)c->T, n = (size_t)c->N, off = (size_t)s->rank * Tl;
    /* The staging copy of the last batch may still be on its way. */
    int r = cuerr(cudaStreamSynchronize(c->s));
    if (r < 0) return r;
    for (size_t b = 0; b < (size_t)c->B; b++) {
        memcpy(c->tokens_h + b * Tl, tokens + b * T + off, Tl * sizeof(int));
        memcpy(c->tokens_h + n + b * Tl, targets + b * T + off, Tl * sizeof(int));
    }
    return cuerr(
        cudaMemcpyAsync(c->tokens, c->tokens_h, 2 * n * sizeof(int), cudaMemcpyHostToDevice, c->s));
}

/* Elements of wpe (T,C) before this rank's first position. */
static size_t wpe_offset(const struct cuda_backend *c)
{
    return (size_t)c->sp->rank * c->sp->Tl * c->C;
}

/* gpt_sp_embed_forward: the embedding of (B, T/sp) with wpe from this rank's first
 * position on (the kernel takes row n's position as n % Tl). */
int cuda_sp_embed_forward(struct cuda_backend *c, const void *wte, const void *wpe, void *x)
{
    const char *wp = (const char *)wpe + wpe_offset(c) * backend_dtype_bytes(c->b.wdt);
    return kernel_embed_forward(x, wte, wp, c->tokens, c->B, c->sp->Tl, c->C, c->dt, c->s);
}

/* gpt_sp_embed_backward: d_wpe's rows of this rank's positions only. */
int cuda_sp_embed_backward(struct cuda_backend *c, float *d_wte, float *d_wpe)
{
    return kernel_embed_backward(d_wte, d_wpe + wpe_offset(c), c->d, c->tokens, c->B, c->sp->Tl,
                                 c->C, c->V, c->dt, c->scratch, c->s);
}

/* from (local layout, heads 0; or heads layout, heads 1) -> to (the other layout), G
 * groups of columns: packed into send, exchanged after the compute stream's event, then
 * unpacked. from may be to. */
static int exchange(struct cuda_backend *c, void *from, int heads, void *to, int G)
{
    struct cuda_sp *s = c->sp;
    size_t es = backend_dtype_bytes(c->b.adt), per = 4 / es;
    size_t n = (size_t)c->N * G * (size_t)(c->C / s->sp);
    size_t stride = (n + per - 1) / per * per; /* whole floats */
    if (!s->p->alltoall) {
        log_error("the CUDA backend: sequence-parallel rank %d of %d has no all-to-all (its "
                  "group has not met)",
                  s->rank, s->sp);
        return -EINVAL;
    }
    int r;
    if ((r = kernel_sp_xchg(from, heads, s->send, 1, c->B, c->T, c->C, s->sp, G, stride, c->dt,
                            c->s)) < 0 ||
        (r = cuerr(cudaEventRecord(s->ev, c->s))) < 0)
        return r;
    c->b.coll_wait = s->ev;
    r = s->p->alltoall(s->p->ctx, s->send, s->recv, stride / per);
    c->b.coll_wait = NULL;
    if (r < 0) return r;
    return kernel_sp_xchg(to, !heads, s->recv, 0, c->B, c->T, c->C, s->sp, G, stride, c->dt, c->s);
}

int cuda_sp_attention_forward(struct cuda_backend *c)
{
    int Cl = c->C / c->sp->sp, r;
    /* qkv: every head at the local positions -> this rank's heads at every position. */
    if ((r = exchange(c, c->qkv, 0, c->qkv, 3)) < 0 ||
        (r = kernel_attention_forward(c->atty, c->att, c->qkv, c->B, c->T, Cl, c->NH, c->dt,
                                      c->s)) < 0)
        return r;
    /* y: this rank's heads at every position -> every head at the local positions. */
    return exchange(c, c->atty, 1, c->atty, 1);
}

int cuda_sp_attention_backward(struct cuda_backend *c)
{
    int Cl = c->C / c->sp->sp, r;
    /* dloss/dy to the heads' ranks, the attention's backward over them, dloss/dqkv back. */
    if ((r = exchange(c, c->d_small, 0, c->d_small, 1)) < 0 ||
        (r = kernel_attention_backward(c->d_big, c->d_att, c->d_small, c->qkv, c->att, c->B, c->T,
                                       Cl, c->NH, c->dt, c->s)) < 0)
        return r;
    return exchange(c, c->d_big, 1, c->d_big, 3);
}

#endif
