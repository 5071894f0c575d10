/*
 * backend_cuda_tp.c - a tensor-parallel rank's math on a CUDA GPU: backend_cuda.c's ops on
 * the rank's slices of gpt_tp.h, with the arithmetic structure of gpt_tp.c and
 * gpt_tp_vocab.c, the collectives of the rank's group (backend_params.tp) running over NCCL
 * on device memory.
 *
 * A block: ln1 -> its heads' qkv (3Cr rows) -> attention over its NHr heads -> its partial of
 * attn.proj -> allreduce -> ln2 -> its 4Cr rows of fc -> GELU -> its partial of mlp.proj ->
 * allreduce. Rank 0 starts its row-parallel partials from residual + bias and the others
 * from zero, so the sum is the output. The backward recomputes the block from its input (as
 * backend_cuda.c does), which runs the first of those allreduces again, and allreduces the
 * input gradients of fc and qkv. The embedding and the head are vocab-parallel (vocab.cu).
 * Replicated parameters' gradients come from the same inputs on every rank, by the same
 * deterministic kernels: the same bits everywhere, with no reduction.
 *
 * The collectives sum fp32 (their callbacks take floats): with 16-bit weights a row-parallel
 * output is accumulated in fp32 (residual widened, bias, partial GEMM in fp32), summed, then
 * rounded once to wdt, as the one-rank GEMM rounds its fp32 accumulator once; an input
 * gradient, which the GEMM hands out in wdt, is widened, summed and rounded back.
 *
 * Ordering: every collective's input is written by kernels on the compute stream, so before
 * each call an event is recorded there and handed over as the backend's coll_wait, which the
 * collective's stream waits for; the callback returns when its result is in place, so the
 * kernels queued after it read the sum.
 *
 * Not here: the one-rank ops and the working buffers (backend_cuda.c, whose buffers are
 * sized for the rank's slices), the collectives themselves (the trainer's), the cut.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/backend_cuda_int.h"

#if ZINF_HAVE_KERNELS

/* The rank's buffers beside backend_cuda.c's, one cudaMalloc. */
struct cuda_tp {
    void *mem;
    float *sum;      /* (N,C) fp32: a 16-bit activation on its way through the allreduce */
    float *maxes;    /* (N): this rank's row maxima of the logits, then the whole rows' */
    float *gathered; /* (tp,N): every rank's row maxima */
    float *stats;    /* (2,N): sums of exponentials, then target logits (gpt_tp_vocab.c's) */
    cudaEvent_t ev;  /* the compute stream up to a collective's call: its coll_wait */
};

int cuda_tp_setup(struct cuda_backend *c, const struct backend_params *p, char *err, size_t errlen)
{
    c->tp = NULL;
    if (!p->tp || p->tp->tp <= 1) return 0;
    char msg[200];
    int lo, hi, r = gpt_tp_validate(&p->cfg, p->tp->tp, p->tp->rank, msg, sizeof(msg));
    if (r < 0) {
        snprintf(err, errlen, "the CUDA backend's tensor-parallel rank: %s", msg);
        return r;
    }
    gpt_tp_vocab_range(&p->cfg, p->tp->tp, p->tp->rank, &lo, &hi);
    c->tp = p->tp;
    c->Cr = c->C / p->tp->tp;
    c->NHr = c->NH / p->tp->tp;
    c->vlo = lo;
    c->Vr = hi - lo;
    return 0;
}

int cuda_tp_alloc(struct cuda_backend *c)
{
    if (!c->tp) return 0;
    struct cuda_tp *x = calloc(1, sizeof(*x));
    if (!x) return -ENOMEM;
    c->tpx = x;
    size_t N = (size_t)c->N, al = 64, off[5] = {0};
    size_t want[4] = {N * (size_t)c->C, N, (size_t)c->tp->tp * N, 2 * N};
    for (int i = 0; i < 4; i++)
        off[i + 1] = off[i] + (want[i] * sizeof(float) + al - 1) / al * al;
    int r = cuerr(cudaMalloc(&x->mem, off[4]));
    if (r < 0) return r;
    char *m = x->mem;
    x->sum = (float *)(m + off[0]);
    x->maxes = (float *)(m + off[1]);
    x->gathered = (float *)(m + off[2]);
    x->stats = (float *)(m + off[3]);
    if ((r = cuerr(cudaEventCreateWithFlags(&x->ev, cudaEventDisableTiming))) < 0) {
        x->ev = NULL;
        return r;
    }
    c->b.work_bytes += off[4];
    return 0;
}

void cuda_tp_close(struct cuda_backend *c)
{
    struct cuda_tp *x = c->tpx;
    if (!x) return;
    if (x->ev) cudaEventDestroy(x->ev);
    cudaFree(x->mem);
    free(x);
    c->tpx = NULL;
}

/* Marks the compute stream up to here as the next collective's input: coll_wait. */
static int coll_mark(struct cuda_backend *c)
{
    int r = cuerr(cudaEventRecord(c->tpx->ev, c->s));
    c->b.coll_wait = r < 0 ? NULL : c->tpx->ev;
    return r;
}

/* buf (n fp32, device memory) = its sum over the rank's group. */
static int tp_sum(struct cuda_backend *c, float *buf, size_t n)
{
    if (!c->tp->allreduce) return -EINVAL;
    int r = coll_mark(c);
    if (r == 0) r = c->tp->allreduce(c->tp->ctx, buf, n);
    c->b.coll_wait = NULL;
    return r < 0 ? r : 0;
}

/* recv (tp x n) = every rank's send (n), rank-major. */
static int tp_gather(struct cuda_backend *c, const float *send, float *recv, size_t n)
{
    if (!c->tp->allgather) return -EINVAL;
    int r = coll_mark(c);
    if (r == 0) r = c->tp->allgather(c->tp->ctx, send, recv, n);
    c->b.coll_wait = NULL;
    return r < 0 ? r : 0;
}

/* buf (N,C) in dt = its sum over the group: in place in fp32, through the fp32 buffer
 * otherwise. */
static int tp_sum_act(struct cuda_backend *c, void *buf)
{
    size_t n = (size_t)c->N * c->C;
    if (c->dt == KDT_F32) return tp_sum(c, buf, n);
    float *f = c->tpx->sum;
    int r;
    if ((r = kernel_cast(f, KDT_F32, buf, c->dt, n, c->s)) < 0 || (r = tp_sum(c, f, n)) < 0)
        return r;
    return kernel_cast(buf, c->dt, f, KDT_F32, n, c->s);
}

/* out (N,C) in dt = residual + b + inp (N,IC) @ W^T summed over the group, W (C,IC) being
 * this rank's columns of the row-parallel weight: rank 0's partial starts from residual +
 * b, the others' from zero (gpt_tp.c's row_parallel_forward). */
static int row_parallel(struct cuda_backend *c, void *out, const void *inp, const void *W,
                        const void *b, const void *residual, int IC)
{
    int N = c->N, C = c->C, r;
    size_t n = (size_t)N * C;
    int first = c->tp->rank == 0;
    void *acc = c->dt == KDT_F32 ? out : (void *)c->tpx->sum;
    if (first && acc != out && (r = kernel_cast(acc, KDT_F32, residual, c->dt, n, c->s)) < 0)
        return r;
    const void *res = !first ? NULL : acc != out ? acc : residual;
    if ((r = kernel_matmul_forward(c->blas, acc, KDT_F32, inp, W, first ? b : NULL, res, N, IC, C,
                                   c->dt, c->scratch, c->s)) < 0 ||
        (r = tp_sum(c, acc, n)) < 0)
        return r;
    return acc == out ? 0 : kernel_cast(out, c->dt, acc, KDT_F32, n, c->s);
}

int cuda_tp_embed_forward(struct cuda_backend *c, const void *wte, const void *wpe, void *x)
{
    size_t n = (size_t)c->N * c->C;
    float *acc = c->dt == KDT_F32 ? x : c->tpx->sum;
    int r;
    if ((r = kernel_vp_embed_forward(acc, wte, wpe, c->tokens, c->B, c->T, c->C, c->vlo,
                                     c->vlo + c->Vr, c->dt, c->s)) < 0 ||
        (r = tp_sum(c, acc, n)) < 0)
        return r;
    /* One row and zeros summed: the one-rank embedding's fp32 value, rounded once. */
    return acc == x ? 0 : kernel_cast(x, c->dt, acc, KDT_F32, n, c->s);
}

/* The block's forward into the working buffers on the rank's slices; x_out NULL stops
 * before the last projection (what the backward needs). gpt_tp.c's block_forward_acts. */
static int block_acts(struct cuda_backend *c, const void *const *w, const void *x_in, void *x_out)
{
    int N = c->N, C = c->C, Cr = c->Cr, r;
    enum kdtype dt = c->dt;
    if ((r = kernel_layernorm_forward(c->ln1, c->ln1_mean, c->ln1_rstd, x_in, w[GPT_LN1_W],
                                      w[GPT_LN1_B], N, C, dt, c->s)) < 0 ||
        (r = kernel_matmul_forward(c->blas, c->qkv, dt, c->ln1, w[GPT_QKV_W], w[GPT_QKV_B], NULL, N,
                                   C, 3 * Cr, dt, c->scratch, c->s)) < 0 ||
        (r = kernel_attention_forward(c->atty, c->att, c->qkv, c->B, c->T, Cr, c->NHr, dt, c->s)) <
            0 ||
        (r = row_parallel(c, c->x2, c->atty, w[GPT_ATTN_PROJ_W], w[GPT_ATTN_PROJ_B], x_in, Cr)) <
            0 ||
        (r = kernel_layernorm_forward(c->ln2, c->ln2_mean, c->ln2_rstd, c->x2, w[GPT_LN2_W],
                                      w[GPT_LN2_B], N, C, dt, c->s)) < 0 ||
        (r = kernel_matmul_forward(c->blas, c->fch, dt, c->ln2, w[GPT_FC_W], w[GPT_FC_B], NULL, N,
                                   C, 4 * Cr, dt, c->scratch, c->s)) < 0 ||
        (r = kernel_gelu_forward(c->fch_gelu, c->fch, (size_t)N * 4 * Cr, dt, c->s)) < 0)
        return r;
    if (x_out)
        r = row_parallel(c, x_out, c->fch_gelu, w[GPT_MLP_PROJ_W], w[GPT_MLP_PROJ_B], c->x2,
                         4 * Cr);
    return r;
}

int cuda_tp_block_forward(struct cuda_backend *c, const void *const *w, const void *x_in,
                          void *x_out)
{
    return block_acts(c, w, x_in, x_out);
}

/* logits (N,Vr) fp32 = lnf(x) @ wte_r^T; the cross-entropy over the whole vocabulary (the
 * row maxima gathered, the sums of exponentials and target logits summed); dlogits in dt,
 * times the loss scale; back through the rank's rows (d_wte_r +=) into lnf's input
 * gradient, summed over the group, and through lnf into d. */
int cuda_tp_head_backward(struct cuda_backend *c, const void *lnf_w, const void *lnf_b,
                          const void *wte, const void *x, float *d_lnf_w, float *d_lnf_b,
                          float *d_wte)
{
    struct cuda_tp *t = c->tpx;
    int N = c->N, C = c->C, Vr = c->Vr, r;
    enum kdtype dt = c->dt;
    if ((r = kernel_layernorm_forward(c->lnf, c->lnf_mean, c->lnf_rstd, x, lnf_w, lnf_b, N, C, dt,
                                      c->s)) < 0 ||
        (r = kernel_matmul_forward(c->blas, c->logits, KDT_F32, c->lnf, wte, NULL, NULL, N, C, Vr,
                                   dt, c->scratch, c->s)) < 0 ||
        (r = kernel_vp_rowmax(t->maxes, c->logits, N, Vr, c->s)) < 0 ||
        (r = tp_gather(c, t->maxes, t->gathered, (size_t)N)) < 0 ||
        (r = kernel_vp_stats(t->stats, t->maxes, t->gathered, c->tp->tp, c->logits, c->targets, N,
                             Vr, c->vlo, c->V, c->s)) < 0 ||
        (r = tp_sum(c, t->stats, 2 * (size_t)N)) < 0 ||
        (r = kernel_vp_crossentropy(c->losses, c->dlogits, c->logits, t->maxes, t->stats,
                                    c->targets, N, Vr, c->vlo, c->b.loss_scale, dt, c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_lnf, d_wte, NULL, c->dlogits, c->lnf, wte, N, C,
                                    Vr, dt, c->scratch, c->s)) < 0 ||
        (r = tp_sum_act(c, c->d_lnf)) < 0 ||
        (r = kernel_layernorm_backward(c->d, 0, d_lnf_w, d_lnf_b, c->d_lnf, x, lnf_w, c->lnf_mean,
                                       c->lnf_rstd, N, C, dt, c->scratch, c->s)) < 0)
        return r;
    /* The per-row losses, the same on every rank, come to the host with the stream. */
    r = cuerr(cudaMemcpyAsync(c->losses_h, c->losses, (size_t)N * sizeof(float),
                              cudaMemcpyDeviceToHost, c->s));
    c->have_loss = r == 0;
    return r;
}

/* d = d pulled back through the block on the rank's slices, g += its gradients; gpt_tp.c's
 * block_backward_acts. d_big holds dloss/dfch_gelu, then dloss/dfch, then dloss/dqkv;
 * d_small fc's input gradient (summed), then dloss/datty (N,Cr), then qkv's input gradient
 * (summed). */
int cuda_tp_block_backward(struct cuda_backend *c, const void *const *w, const void *x_in,
                           float *const *g)
{
    int N = c->N, C = c->C, Cr = c->Cr, r;
    enum kdtype dt = c->dt;
    size_t NC = (size_t)N * C, bytes = NC * backend_dtype_bytes(c->b.adt);
    if ((r = block_acts(c, w, x_in, NULL)) < 0) return r;
    if ((r = cuerr(cudaMemcpyAsync(c->d_x2, c->d, bytes, cudaMemcpyDeviceToDevice, c->s))) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_big, g[GPT_MLP_PROJ_W], g[GPT_MLP_PROJ_B], c->d,
                                    c->fch_gelu, w[GPT_MLP_PROJ_W], N, 4 * Cr, C, dt, c->scratch,
                                    c->s)) < 0 ||
        (r = kernel_gelu_backward(c->d_big, c->fch, (size_t)N * 4 * Cr, dt, c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_small, g[GPT_FC_W], g[GPT_FC_B], c->d_big, c->ln2,
                                    w[GPT_FC_W], N, C, 4 * Cr, dt, c->scratch, c->s)) < 0 ||
        (r = tp_sum_act(c, c->d_small)) < 0 ||
        (r = kernel_layernorm_backward(c->d_x2, 1, g[GPT_LN2_W], g[GPT_LN2_B], c->d_small, c->x2,
                                       w[GPT_LN2_W], c->ln2_mean, c->ln2_rstd, N, C, dt, c->scratch,
                                       c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_small, g[GPT_ATTN_PROJ_W], g[GPT_ATTN_PROJ_B],
                                    c->d_x2, c->atty, w[GPT_ATTN_PROJ_W], N, Cr, C, dt, c->scratch,
                                    c->s)) < 0 ||
        (r = kernel_attention_backward(c->d_big, c->d_att, c->d_small, c->qkv, c->att, c->B, c->T,
                                       Cr, c->NHr, dt, c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_small, g[GPT_QKV_W], g[GPT_QKV_B], c->d_big,
                                    c->ln1, w[GPT_QKV_W], N, C, 3 * Cr, dt, c->scratch, c->s)) <
            0 ||
        (r = tp_sum_act(c, c->d_small)) < 0 ||
        (r = cuerr(cudaMemcpyAsync(c->d, c->d_x2, bytes, cudaMemcpyDeviceToDevice, c->s))) < 0)
        return r;
    return kernel_layernorm_backward(c->d, 1, g[GPT_LN1_W], g[GPT_LN1_B], c->d_small, x_in,
                                     w[GPT_LN1_W], c->ln1_mean, c->ln1_rstd, N, C, dt, c->scratch,
                                     c->s);
}

/* d_wte_r += the rows of d of the tokens in the rank's range; d_wpe += d summed over b, the
 * same on every rank. No collective. */
int cuda_tp_embed_backward(struct cuda_backend *c, float *d_wte, float *d_wpe)
{
    return kernel_vp_embed_backward(d_wte, d_wpe, c->d, c->tokens, c->B, c->T, c->C, c->vlo,
                                    c->vlo + c->Vr, c->dt, c->s);
}

#endif
