/*
 * backend_cuda.c - the trainer's math on a CUDA GPU (see backend.h): kernels/ and cuBLAS
 * over the device memory the CUDA device tier hands out, with weights and activations in
 * wdt (bf16 or fp16 for mixed precision, or fp32) and every gradient of a parameter in fp32.
 * With fp16 the loss scale enters at the cross-entropy's gradient, so every gradient after
 * it (the fp16 ones flowing back, the fp32 ones of the parameters) is scaled.
 *
 * All work goes to one compute stream of the backend's own, apart from the engine's copy
 * streams. A tensor the engine hands out has arrived when zinf_fetch returns (the engine
 * waited on its copy's event), so kernels may read it at once; the trainer calls sync,
 * which waits on this stream only, before it releases what the kernels used, so the engine
 * never copies out or reuses memory a kernel still touches. Nothing here synchronises the
 * whole device.
 *
 * A block's internals are recomputed in the backward from its input, as on the CPU, into
 * working buffers the backend allocates once (work_bytes, outside the engine's budget).
 *
 * Sequence-parallel ranks (backend_cuda_sp.c) run the same code on their B*T/sp rows, with
 * their batch, embedding and attention (between two all-to-alls) of their own.
 *
 * Not here: where tensors live, the optimizer on the host (adamw.c), the ops of a
 * tensor-parallel rank (backend_cuda_tp.c), which the ops below hand over to.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/backend_cuda_int.h"
#include "train/backend_cuda_sp.h"
#include "train/backend_moe.h"
#include "train/digest.h"

#if ZINF_HAVE_KERNELS

static void cuda_close(struct backend *b)
{
    struct cuda_backend *c = cub(b);
    if (c->s) cudaStreamSynchronize(c->s);
    backend_cuda_moe_close(c);
    if (c->blas) cublasDestroy(c->blas);
    cuda_tp_close(c);
    cuda_sp_close(c);
    cudaFree(c->mem);
    cudaFreeHost(c->tokens_h);
    cudaFreeHost(c->losses_h);
    cudaFreeHost(c->sumsq_h);
    cudaFree(c->chunks);
    cudaFreeHost(c->chunks_h);
    if (c->s) cudaStreamDestroy(c->s);
    free(c);
}

static int cuda_set_batch(struct backend *b, const int *tokens, const int *targets)
{
    struct cuda_backend *c = cub(b);
    if (c->sp) return cuda_sp_set_batch(c, tokens, targets);
    size_t n = (size_t)c->N;
    /* The staging copy of the last batch may still be on its way. */
    int r = cuerr(cudaStreamSynchronize(c->s));
    if (r < 0) return r;
    memcpy(c->tokens_h, tokens, n * sizeof(int));
    memcpy(c->tokens_h + n, targets, n * sizeof(int));
    /* tokens and targets lie next to each other on the device: one copy. */
    return cuerr(
        cudaMemcpyAsync(c->tokens, c->tokens_h, 2 * n * sizeof(int), cudaMemcpyHostToDevice, c->s));
}

static int cuda_zero(struct backend *b, void *p, size_t bytes)
{
    return cuerr(cudaMemsetAsync(p, 0, bytes, cub(b)->s));
}

static int cuda_embed_forward(struct backend *b, const void *wte, const void *wpe, void *x)
{
    struct cuda_backend *c = cub(b);
    if (c->tp) return cuda_tp_embed_forward(c, wte, wpe, x);
    if (c->sp) return cuda_sp_embed_forward(c, wte, wpe, x);
    return kernel_embed_forward(x, wte, wpe, c->tokens, c->B, c->T, c->C, c->dt, c->s);
}

/* The block's forward into the working buffers; x_out NULL stops before the last
 * projection (what the backward needs). The same order as gpt.c's block_forward_acts. */
static int block_acts(struct cuda_backend *c, const void *const *w, const void *x_in, void *x_out)
{
    int N = c->N, C = c->C, r;
    enum kdtype dt = c->dt;
    if ((r = kernel_layernorm_forward(c->ln1, c->ln1_mean, c->ln1_rstd, x_in, w[GPT_LN1_W],
                                      w[GPT_LN1_B], N, C, dt, c->s)) < 0 ||
        (r = kernel_matmul_forward(c->blas, c->qkv, dt, c->ln1, w[GPT_QKV_W], w[GPT_QKV_B], NULL, N,
                                   C, 3 * C, dt, c->scratch, c->s)) < 0 ||
        (r = c->sp ? cuda_sp_attention_forward(c)
                   : kernel_attention_forward(c->atty, c->att, c->qkv, c->B, c->T, C, c->NH, dt,
                                              c->s)) < 0 ||
        (r = kernel_matmul_forward(c->blas, c->x2, dt, c->atty, w[GPT_ATTN_PROJ_W],
                                   w[GPT_ATTN_PROJ_B], x_in, N, C, C, dt, c->scratch, c->s)) < 0 ||
        (r = kernel_layernorm_forward(c->ln2, c->ln2_mean, c->ln2_rstd, c->x2, w[GPT_LN2_W],
                                      w[GPT_LN2_B], N, C, dt, c->s)) < 0 ||
        (r = kernel_matmul_forward(c->blas, c->fch, dt, c->ln2, w[GPT_FC_W], w[GPT_FC_B], NULL, N,
                                   C, 4 * C, dt, c->scratch, c->s)) < 0 ||
        (r = kernel_gelu_forward(c->fch_gelu, c->fch, (size_t)N * 4 * C, dt, c->s)) < 0)
        return r;
    if (x_out)
        r = kernel_matmul_forward(c->blas, x_out, dt, c->fch_gelu, w[GPT_MLP_PROJ_W],
                                  w[GPT_MLP_PROJ_B], c->x2, N, 4 * C, C, dt, c->scratch, c->s);
    return r;
}

static int cuda_block_forward(struct backend *b, const void *const *w, const void *x_in,
                              void *x_out)
{
    struct cuda_backend *c = cub(b);
    if (c->tp) return cuda_tp_block_forward(c, w, x_in, x_out);
    return block_acts(c, w, x_in, x_out);
}

static size_t act_bytes(const struct cuda_backend *c, size_t n)
{
    return n * backend_dtype_bytes(c->b.adt);
}

static int cuda_head_backward(struct backend *b, const void *lnf_w, const void *lnf_b,
                              const void *wte, const void *x, float *d_lnf_w, float *d_lnf_b,
                              float *d_wte)
{
    struct cuda_backend *c = cub(b);
    if (c->tp) return cuda_tp_head_backward(c, lnf_w, lnf_b, wte, x, d_lnf_w, d_lnf_b, d_wte);
    int N = c->N, C = c->C, V = c->V, r;
    enum kdtype dt = c->dt;
    /* The kernel's gradient is 1/N per row; the loss is the mean over the batch's B*T rows,
     * of which a sequence-parallel rank holds N: their share (1 without, 1/sp exactly for sp
     * a power of two). */
    float scale = b->loss_scale * ((float)N / ((float)c->B * (float)c->T));
    /* logits (N,V) fp32 = lnf(x) @ wte^T; the loss; dlogits in dt, times the loss scale;
     * then back through the tied head (d_wte +=) and lnf into d. */
    if ((r = kernel_layernorm_forward(c->lnf, c->lnf_mean, c->lnf_rstd, x, lnf_w, lnf_b, N, C, dt,
                                      c->s)) < 0 ||
        (r = kernel_matmul_forward(c->blas, c->logits, KDT_F32, c->lnf, wte, NULL, NULL, N, C, V,
                                   dt, c->scratch, c->s)) < 0 ||
        (r = kernel_crossentropy(c->losses, c->dlogits, c->logits, c->targets, N, V, scale, dt,
                                 c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_lnf, d_wte, NULL, c->dlogits, c->lnf, wte, N, C,
                                    V, dt, c->scratch, c->s)) < 0 ||
        (r = kernel_layernorm_backward(c->d, 0, d_lnf_w, d_lnf_b, c->d_lnf, x, lnf_w, c->lnf_mean,
                                       c->lnf_rstd, N, C, dt, c->scratch, c->s)) < 0)
        return r;
    /* The per-row losses come to the host with the stream; collect() sums them. */
    r = cuerr(cudaMemcpyAsync(c->losses_h, c->losses, (size_t)N * sizeof(float),
                              cudaMemcpyDeviceToHost, c->s));
    c->have_loss = r == 0;
    return r;
}

/* d = d pulled back through the block; the same order as gpt.c's block_backward_acts. */
static int cuda_block_backward(struct backend *b, const void *const *w, const void *x_in,
                               float *const *g)
{
    struct cuda_backend *c = cub(b);
    if (c->tp) return cuda_tp_block_backward(c, w, x_in, g);
    int N = c->N, C = c->C, r;
    enum kdtype dt = c->dt;
    size_t NC = (size_t)N * C;
    if ((r = block_acts(c, w, x_in, NULL)) < 0) return r;
    if ((r = cuerr(cudaMemcpyAsync(c->d_x2, c->d, act_bytes(c, NC), cudaMemcpyDeviceToDevice,
                                   c->s))) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_big, g[GPT_MLP_PROJ_W], g[GPT_MLP_PROJ_B], c->d,
                                    c->fch_gelu, w[GPT_MLP_PROJ_W], N, 4 * C, C, dt, c->scratch,
                                    c->s)) < 0 ||
        (r = kernel_gelu_backward(c->d_big, c->fch, 4 * NC, dt, c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_small, g[GPT_FC_W], g[GPT_FC_B], c->d_big, c->ln2,
                                    w[GPT_FC_W], N, C, 4 * C, dt, c->scratch, c->s)) < 0 ||
        (r = kernel_layernorm_backward(c->d_x2, 1, g[GPT_LN2_W], g[GPT_LN2_B], c->d_small, c->x2,
                                       w[GPT_LN2_W], c->ln2_mean, c->ln2_rstd, N, C, dt, c->scratch,
                                       c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_small, g[GPT_ATTN_PROJ_W], g[GPT_ATTN_PROJ_B],
                                    c->d_x2, c->atty, w[GPT_ATTN_PROJ_W], N, C, C, dt, c->scratch,
                                    c->s)) < 0 ||
        (r = c->sp ? cuda_sp_attention_backward(c)
                   : kernel_attention_backward(c->d_big, c->d_att, c->d_small, c->qkv, c->att, c->B,
                                               c->T, C, c->NH, dt, c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_small, g[GPT_QKV_W], g[GPT_QKV_B], c->d_big,
                                    c->ln1, w[GPT_QKV_W], N, C, 3 * C, dt, c->scratch, c->s)) < 0 ||
        (r = cuerr(
             cudaMemcpyAsync(c->d, c->d_x2, act_bytes(c, NC), cudaMemcpyDeviceToDevice, c->s))) < 0)
        return r;
    return kernel_layernorm_backward(c->d, 1, g[GPT_LN1_W], g[GPT_LN1_B], c->d_small, x_in,
                                     w[GPT_LN1_W], c->ln1_mean, c->ln1_rstd, N, C, dt, c->scratch,
                                     c->s);
}

static int cuda_embed_backward(struct backend *b, float *d_wte, float *d_wpe)
{
    struct cuda_backend *c = cub(b);
    if (c->tp) return cuda_tp_embed_backward(c, d_wte, d_wpe);
    if (c->sp) return cuda_sp_embed_backward(c, d_wte, d_wpe);
    return kernel_embed_backward(d_wte, d_wpe, c->d, c->tokens, c->B, c->T, c->C, c->V, c->dt,
                                 c->scratch, c->s);
}

static int cuda_sumsq(struct backend *b, const float *g, size_t n)
{
    struct cuda_backend *c = cub(b);
    return kernel_sumsq(c->sumsq, g, n, c->scratch, c->s);
}

static int cuda_adamw(struct backend *b, float *p, const float *g, float *m, float *v,
                      uint16_t *w16, size_t n, const struct adamw_hparams *h, int step,
                      float grad_scale)
{
    struct cuda_backend *c = cub(b);
    return kernel_adamw(p, g, m, v, w16, c->dt, n, h, step, grad_scale, c->s);
}

static int cuda_adamw_states(struct backend *b, float *p, const float *g, void *m, void *v,
                             uint16_t *w16, size_t n, enum adamw_state_dtype dt,
                             const struct adamw_state_at *at, const struct adamw_hparams *h,
                             int step, float grad_scale)
{
    struct cuda_backend *c = cub(b);
    float maps[512];
    memcpy(maps, adamw_q8_map(1), 256 * sizeof(float));
    memcpy(maps + 256, adamw_q8_map(0), 256 * sizeof(float));
    return kernel_adamw_states(p, g, m, v, w16, c->dt, n, (int)dt, at->first, at->cap, at->seed,
                               at->tensor, maps, h, step, grad_scale, c->s);
}

/* The parameters come to the host a MiB at a time and are hashed there: the log's digest
 * costs a read of the weights over PCIe per step, paid only when it is asked for. */
static int cuda_digest(struct backend *b, const float *p, size_t n, uint32_t tensor,
                       size_t first_block, uint64_t *sum)
{
    struct cuda_backend *c = cub(b);
    const size_t chunk = 256 * DIGEST_BLOCK_FLOATS; /* whole blocks, 1 MiB */
    float *h = malloc(chunk * sizeof(float));
    if (!h) return -ENOMEM;
    int r = cuerr(cudaStreamSynchronize(c->s));
    for (size_t off = 0; r == 0 && off < n; off += chunk) {
        size_t len = n - off < chunk ? n - off : chunk;
        r = cuerr(cudaMemcpy(h, p + off, len * sizeof(float), cudaMemcpyDeviceToHost));
        if (r == 0) *sum += digest_floats(h, len, tensor, first_block + off / DIGEST_BLOCK_FLOATS);
    }
    free(h);
    return r;
}

/* fold and the shard copies run on the compute stream, after the kernels that wrote their
 * inputs; a collective's result is waited for by the trainer before it is folded. */
static int cuda_fold(struct backend *b, float *g, const float *src, size_t n, int first)
{
    struct cuda_backend *c = cub(b);
    if (n == 0 || (first && src == g)) return 0;
    if (first)
        return cuerr(cudaMemcpyAsync(g, src, n * sizeof(float), cudaMemcpyDeviceToDevice, c->s));
    return kernel_add(g, g, src, n, KDT_F32, c->s);
}

/* Room for k doubles in the chunk sums' buffers, on the device and pinned on the host. */
static int chunks_room(struct cuda_backend *c, size_t k)
{
    if (k > c->chunks_cap) {
        /* Waits for what uses the old buffers, then grows them (outside the engine's
         * budget: the backend's working memory). */
        int r = cuerr(cudaStreamSynchronize(c->s));
        if (r < 0) return r;
        cudaFree(c->chunks);
        cudaFreeHost(c->chunks_h);
        c->chunks = NULL;
        c->chunks_h = NULL;
        c->b.work_bytes -= c->chunks_cap * sizeof(double);
        c->chunks_cap = 0;
        if ((r = cuerr(cudaMalloc((void **)&c->chunks, k * sizeof(double)))) < 0 ||
            (r = cuerr(cudaMallocHost((void **)&c->chunks_h, k * sizeof(double)))) < 0) {
            cudaFree(c->chunks);
            c->chunks = NULL;
            return r;
        }
        c->chunks_cap = k;
        c->b.work_bytes += k * sizeof(double);
    }
    return 0;
}

static int cuda_chunk_sumsq(struct backend *b, const float *g, size_t n, size_t chunk, double *out)
{
    struct cuda_backend *c = cub(b);
    if (!chunk) return -EINVAL;
    size_t k = (n + chunk - 1) / chunk;
    if (k == 0) return 0;
    int r = chunks_room(c, k);
    if (r < 0) return r;
    r = kernel_chunk_sumsq(c->chunks, g, n, chunk, c->s);
    if (r == 0)
        r = cuerr(cudaMemcpyAsync(c->chunks_h, c->chunks, k * sizeof(double),
                                  cudaMemcpyDeviceToHost, c->s));
    if (r == 0) r = cuerr(cudaStreamSynchronize(c->s));
    if (r == 0) memcpy(out, c->chunks_h, k * sizeof(double));
    return r;
}

static int cuda_lamb_moments(struct backend *b, const float *p, const float *g, float *m,
                             float *v, size_t n, const struct adamw_hparams *h, float grad_scale,
                             int eps_inside_sqrt, size_t chunk, double *w_sq, double *u_sq)
{
    struct cuda_backend *c = cub(b);
    if (!chunk) return -EINVAL;
    size_t k = (n + chunk - 1) / chunk;
    if (k == 0) return 0;
    int r = chunks_room(c, 2 * k);
    if (r == 0)
        r = kernel_lamb_moments(p, g, m, v, n, h, grad_scale, eps_inside_sqrt, chunk, c->chunks,
                                c->s);
    if (r == 0)
        r = cuerr(cudaMemcpyAsync(c->chunks_h, c->chunks, 2 * k * sizeof(double),
                                  cudaMemcpyDeviceToHost, c->s));
    if (r == 0) r = cuerr(cudaStreamSynchronize(c->s));
    if (r == 0) {
        memcpy(w_sq, c->chunks_h, k * sizeof(double));
        memcpy(u_sq, c->chunks_h + k, k * sizeof(double));
    }
    return r;
}

static int cuda_lamb_apply(struct backend *b, float *p, const float *m, const float *v,
                           uint16_t *w16, size_t n, const struct adamw_hparams *h, int step,
                           int eps_inside_sqrt, float coeff)
{
    struct cuda_backend *c = cub(b);
    return kernel_lamb_apply(p, m, v, w16, c->dt, n, h, step, eps_inside_sqrt, coeff, c->s);
}

static int cuda_copy(struct backend *b, void *dst, const void *src, size_t bytes)
{
    if (!bytes) return 0;
    return cuerr(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cub(b)->s));
}

static int cuda_grad_io(struct backend *b, void *host, bool put)
{
    struct cuda_backend *c = cub(b);
    size_t bytes = act_bytes(c, (size_t)c->N * c->C);
    int r = cuerr(put ? cudaMemcpyAsync(c->d, host, bytes, cudaMemcpyHostToDevice, c->s)
                      : cudaMemcpyAsync(host, c->d, bytes, cudaMemcpyDeviceToHost, c->s));
    return r < 0 ? r : cuerr(cudaStreamSynchronize(c->s));
}

static int cuda_cast(struct backend *b, void *dst, const float *src, size_t n)
{
    struct cuda_backend *c = cub(b);
    if (!n) return 0;
    if (c->dt == KDT_F32)
        return cuerr(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, c->s));
    return kernel_cast(dst, c->dt, src, KDT_F32, n, c->s);
}

static int cuda_event_new(struct backend *b, void **ev)
{
    (void)b;
    *ev = NULL;
    return cuerr(cudaEventCreateWithFlags((cudaEvent_t *)ev, cudaEventDisableTiming));
}

static void cuda_event_free(struct backend *b, void *ev)
{
    (void)b;
    if (ev) cudaEventDestroy((cudaEvent_t)ev);
}

static int cuda_record(struct backend *b, void *ev)
{
    return ev ? cuerr(cudaEventRecord((cudaEvent_t)ev, cub(b)->s)) : 0;
}

static int cuda_wait(struct backend *b, void *ev)
{
    return ev ? cuerr(cudaStreamWaitEvent(cub(b)->s, (cudaEvent_t)ev, 0)) : 0;
}

static int cuda_sync(struct backend *b)
{
    return cuerr(cudaStreamSynchronize(cub(b)->s));
}

static int cuda_collect(struct backend *b, float *loss, double *sumsq)
{
    struct cuda_backend *c = cub(b);
    int r =
        cuerr(cudaMemcpyAsync(c->sumsq_h, c->sumsq, sizeof(double), cudaMemcpyDeviceToHost, c->s));
    if (r == 0) r = cuerr(cudaMemsetAsync(c->sumsq, 0, sizeof(double), c->s));
    if (r == 0) r = cuerr(cudaStreamSynchronize(c->s));
    if (r < 0) return r;
    if (c->have_loss) {
        /* The mean over rows in double and in order, as ops_crossentropy sums it, over the
         * batch's B*T rows (a sequence-parallel rank's N of them: its share of the mean). */
        double total = 0.0;
        for (int i = 0; i < c->N; i++)
            total += c->losses_h[i];
        c->loss = (float)(total / ((double)c->B * c->T));
        c->have_loss = 0;
    }
    *loss = c->loss;
    *sumsq = *c->sumsq_h;
    return 0;
}

static const struct backend_ops cuda_ops = {
    .close = cuda_close,
    .set_batch = cuda_set_batch,
    .zero = cuda_zero,
    .embed_forward = cuda_embed_forward,
    .block_forward = cuda_block_forward,
    .head_backward = cuda_head_backward,
    .block_backward = cuda_block_backward,
    .embed_backward = cuda_embed_backward,
    .sumsq = cuda_sumsq,
    .adamw = cuda_adamw,
    .adamw_states = cuda_adamw_states,
    .lamb_moments = cuda_lamb_moments,
    .lamb_apply = cuda_lamb_apply,
    .digest = cuda_digest,
    .fold = cuda_fold,
    .chunk_sumsq = cuda_chunk_sumsq,
    .copy = cuda_copy,
    .grad_io = cuda_grad_io,
    .cast = cuda_cast,
    .event_new = cuda_event_new,
    .event_free = cuda_event_free,
    .record = cuda_record,
    .wait = cuda_wait,
    .sync = cuda_sync,
    .collect = cuda_collect,
};

/* Lays the working buffers out in one allocation (base NULL: sizing only), each 256-byte
 * aligned. Those of the heads, of the MLP's 4C and of the logits are sized for a
 * tensor-parallel rank's share (Cr, NHr, Vr: C, NH, V without). */
static size_t carve(struct cuda_backend *c, char *base, size_t max_tensor)
{
    size_t off = 0, N = (size_t)c->N, C = (size_t)c->C, V = (size_t)c->Vr, Cr = (size_t)c->Cr;
    size_t att = (size_t)c->B * c->NHr * c->T * c->T, a = backend_dtype_bytes(c->b.adt);
#define TAKE(ptr, bytes)                                                                           \
    do {                                                                                           \
        *(void **)&(ptr) = base ? base + off : NULL;                                               \
        off += ((bytes) + 255) / 256 * 256;                                                        \
    } while (0)
    TAKE(c->tokens, 2 * N * sizeof(int));
    c->targets = base ? c->tokens + N : NULL;
    TAKE(c->d, N * C * a);
    TAKE(c->ln1, N * C * a);
    TAKE(c->qkv, 3 * N * Cr * a);
    TAKE(c->atty, N * Cr * a);
    TAKE(c->x2, N * C * a);
    TAKE(c->ln2, N * C * a);
    TAKE(c->fch, 4 * N * Cr * a);
    TAKE(c->fch_gelu, 4 * N * Cr * a);
    TAKE(c->ln1_mean, N * 4);
    TAKE(c->ln1_rstd, N * 4);
    TAKE(c->ln2_mean, N * 4);
    TAKE(c->ln2_rstd, N * 4);
    TAKE(c->att, att * 4);
    TAKE(c->d_att, att * 4);
    TAKE(c->d_x2, N * C * a);
    TAKE(c->d_big, 4 * N * Cr * a);
    TAKE(c->d_small, N * C * a);
    TAKE(c->lnf, N * C * a);
    TAKE(c->d_lnf, N * C * a);
    TAKE(c->dlogits, N * V * a);
    TAKE(c->lnf_mean, N * 4);
    TAKE(c->lnf_rstd, N * 4);
    TAKE(c->logits, N * V * 4);
    TAKE(c->losses, N * 4);
    TAKE(c->sumsq, sizeof(double));
    size_t s = kernel_scratch_bytes(N, 4 * C);
    size_t cand[] = {kernel_scratch_bytes(N, V), kernel_scratch_bytes(N, 2 * C),
                     kernel_scratch_bytes(max_tensor, 1)};
    for (size_t i = 0; i < sizeof(cand) / sizeof(cand[0]); i++)
        if (cand[i] > s) s = cand[i];
    TAKE(c->scratch, s);
#undef TAKE
    return off;
}

int backend_cuda_open(const struct backend_params *p, struct backend **out, char *err,
                      size_t errlen)
{
    *out = NULL;
    int r = backend_params_check(p, err, errlen);
    if (r < 0) return r;
    struct cuda_backend *c = calloc(1, sizeof(*c));
    if (!c) return -ENOMEM;
    c->b = (struct backend){
        .ops = &cuda_ops, .name = "cuda", .wdt = p->wdt, .adt = backend_act_dtype(true, p->wdt), .loss_scale = 1.0f};
    c->cfg = p->cfg;
    c->B = p->B;
    c->T = p->T;
    c->N = p->B * p->T;
    c->C = p->cfg.C;
    c->NH = p->cfg.NH;
    c->V = p->cfg.V;
    c->dt = p->wdt == BACKEND_BF16 ? KDT_BF16 : p->wdt == BACKEND_F16 ? KDT_F16 : KDT_F32;
    /* A sequence-parallel rank's rows and heads first (N, NH), then the tensor-parallel
     * share of the channels, heads and vocabulary (the two are not used together). */
    if ((r = cuda_sp_open(c, p, err, errlen)) < 0) {
        free(c);
        return r;
    }
    c->Cr = c->C;
    c->NHr = c->NH;
    c->Vr = c->V;
    if ((r = cuda_tp_setup(c, p, err, errlen)) < 0) {
        cuda_sp_close(c);
        free(c);
        return r;
    }

    size_t C = (size_t)p->cfg.C;
    size_t max_tensor = (size_t)p->cfg.V * C;
    if (4 * C * C > max_tensor) max_tensor = 4 * C * C;
    if ((size_t)p->cfg.maxT * C > max_tensor) max_tensor = (size_t)p->cfg.maxT * C;
    size_t bytes = carve(c, NULL, max_tensor);
    const char *what = "cudaSetDevice";
    if ((r = cuerr(cudaSetDevice(p->cuda_device))) < 0) goto fail;
    what = "cudaStreamCreate";
    if ((r = cuerr(cudaStreamCreateWithFlags(&c->s, cudaStreamNonBlocking))) < 0) goto fail;
    what = "cublasCreate";
    if (cublasCreate(&c->blas) != CUBLAS_STATUS_SUCCESS) {
        c->blas = NULL;
        r = -EIO;
        goto fail;
    }
    what = "cudaMalloc of the working buffers";
    if ((r = cuerr(cudaMalloc(&c->mem, bytes))) < 0) goto fail;
    carve(c, c->mem, max_tensor);
    what = "cudaMalloc of the sequence-parallel exchange buffers";
    if (c->sp && (r = cuda_sp_alloc(c)) < 0) goto fail;
    what = "cudaMallocHost";
    if ((r = cuerr(cudaMallocHost((void **)&c->tokens_h, 2 * (size_t)c->N * sizeof(int)))) < 0 ||
        (r = cuerr(cudaMallocHost((void **)&c->losses_h, (size_t)c->N * sizeof(float)))) < 0 ||
        (r = cuerr(cudaMallocHost((void **)&c->sumsq_h, sizeof(double)))) < 0)
        goto fail;
    what = "cudaMemsetAsync";
    if ((r = cuerr(cudaMemsetAsync(c->sumsq, 0, sizeof(double), c->s))) < 0) goto fail;
    c->b.work_bytes += bytes;
    c->b.moe = &backend_cuda_moe_ops;
    what = "cudaMalloc of the tensor-parallel buffers";
    if ((r = cuda_tp_alloc(c)) < 0) goto fail;
    *out = &c->b;
    return 0;
fail:
    snprintf(err, errlen, "the CUDA backend: %s failed (%s, %zu bytes of working memory)", what,
             strerror(-r), bytes);
    cuda_close(&c->b);
    return r;
}

int backend_cuda_built(void)
{
    return 1;
}

#else /* no CUDA kernels in this build */

int backend_cuda_open(const struct backend_params *p, struct backend **out, char *err,
                      size_t errlen)
{
    (void)p;
    *out = NULL;
    snprintf(err, errlen,
             "this build of zinf has no CUDA kernels (built without the CUDA "
             "toolkit); use zinf.device \"emulated\" or \"auto\"");
    return -ENODEV;
}

int backend_cuda_built(void)
{
    return 0;
}

#endif
