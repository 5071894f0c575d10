/*
 * backend_cuda_moe.c - the MoE block's ops (backend_moe.h) on a CUDA GPU: the attention
 * half and ln2 with the dense block's kernels in gpt.c's order, the gate's and the experts'
 * linear layers with cuBLAS (kernel_matmul_*), and kernels/moe.cu's gather, combine and
 * combine-weight gradient. Everything is queued on the backend's compute stream; the copies
 * to and from the host (the logits, the exchange's blocks) wait for it.
 *
 * Weights and activations are in the backend's type (fp32, bf16 or fp16), as the dense
 * blocks'; the rows that travel between ranks are fp32 (moe_ep.c's blocks): the gather
 * widens, an expert casts its input rows to the weights' type (exact: they were gathered
 * from it), writes its output in fp32 from the GEMM's fp32 accumulation, and its input
 * gradient is cast to fp32 for the way back; the combine rounds each token's sum once.
 *
 * The working buffers are the dense block's (backend_cuda.c): an expert runs on at most N
 * rows (a source's kept choices of one expert), so its hidden layer fits the (N,4C) ones.
 * What is the MoE block's own (the logits and their gradient, an expert's recomputed fp32
 * output, the maps on the device) is allocated on first use and grown, counted in
 * work_bytes. The host-side maps come from pageable memory: cudaMemcpyAsync has copied them
 * out when it returns.
 *
 * Not here: the route (the host's, moe_route.c), the dense blocks (backend_cuda.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "train/backend_cuda_int.h"
#include "train/backend_moe.h"

#if ZINF_HAVE_KERNELS

struct cuda_moe {
    float *logits;   /* (N,E): the gate's logits, then their gradient; then (16-bit types)
                        room for the gradient in dt */
    size_t logits_n; /* floats */
    float *o;        /* (N,C) fp32: an expert's output, recomputed in its backward */
    void *maps;      /* the maps of a gather or a combine */
    size_t maps_bytes;
};

void backend_cuda_moe_close(struct cuda_backend *c)
{
    if (!c->moe) return;
    cudaFree(c->moe->logits);
    cudaFree(c->moe->o);
    cudaFree(c->moe->maps);
    free(c->moe);
    c->moe = NULL;
}

/* *p holds at least bytes of device memory (the old content lost when it grows). */
static int grow(struct cuda_backend *c, void **p, size_t *have, size_t bytes)
{
    if (bytes <= *have) return 0;
    int r = cuerr(cudaStreamSynchronize(c->s));
    if (r < 0) return r;
    cudaFree(*p);
    *p = NULL;
    c->b.work_bytes -= *have;
    *have = 0;
    if ((r = cuerr(cudaMalloc(p, bytes))) < 0) {
        *p = NULL;
        return r;
    }
    *have = bytes;
    c->b.work_bytes += bytes;
    return 0;
}

static int state(struct cuda_backend *c)
{
    if (!c->moe && !(c->moe = calloc(1, sizeof(*c->moe)))) return -ENOMEM;
    return 0;
}

/* The maps (host) of n entries each, one after the other on the device: *d0 and *d1. */
static int maps_to_device(struct cuda_backend *c, const void *h0, size_t b0, const void *h1,
                          size_t b1, void **d0, void **d1)
{
    size_t at1 = (b0 + 255) / 256 * 256;
    int r = state(c);
    if (r == 0) r = grow(c, &c->moe->maps, &c->moe->maps_bytes, at1 + b1 + 1);
    if (r < 0) return r;
    *d0 = c->moe->maps;
    *d1 = h1 ? (char *)c->moe->maps + at1 : NULL;
    if (b0) r = cuerr(cudaMemcpyAsync(*d0, h0, b0, cudaMemcpyHostToDevice, c->s));
    if (r == 0 && h1 && b1) r = cuerr(cudaMemcpyAsync(*d1, h1, b1, cudaMemcpyHostToDevice, c->s));
    return r;
}

static int cm_alloc(struct backend *b, void **p, size_t bytes)
{
    struct cuda_backend *c = cub(b);
    *p = NULL;
    int r = cuerr(cudaMalloc(p, bytes ? bytes : 1));
    if (r < 0) {
        *p = NULL;
        return r;
    }
    if ((r = cuerr(cudaMemsetAsync(*p, 0, bytes, c->s))) == 0) b->work_bytes += bytes;
    return r;
}

static void cm_free(struct backend *b, void *p, size_t bytes)
{
    if (!p) return;
    cudaStreamSynchronize(cub(b)->s);
    cudaFree(p);
    b->work_bytes -= bytes;
}

static int cm_to_host(struct backend *b, void *host, const void *src, size_t bytes)
{
    struct cuda_backend *c = cub(b);
    int r = bytes ? cuerr(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, c->s)) : 0;
    return r < 0 ? r : cuerr(cudaStreamSynchronize(c->s));
}

static int cm_from_host(struct backend *b, void *dst, const void *host, size_t bytes)
{
    struct cuda_backend *c = cub(b);
    int r = bytes ? cuerr(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, c->s)) : 0;
    return r < 0 ? r : cuerr(cudaStreamSynchronize(c->s));
}

static void *cm_grad(struct backend *b)
{
    return cub(b)->d;
}

/* ln1, qkv, the attention's probabilities and output of x_in into the dense block's
 * buffers: block_acts' first steps. */
static int attn_acts(struct cuda_backend *c, const void *const *w, const void *x_in)
{
    int N = c->N, C = c->C, r;
    enum kdtype dt = c->dt;
    if ((r = kernel_layernorm_forward(c->ln1, c->ln1_mean, c->ln1_rstd, x_in, w[GPT_LN1_W],
                                      w[GPT_LN1_B], N, C, dt, c->s)) < 0 ||
        (r = kernel_matmul_forward(c->blas, c->qkv, dt, c->ln1, w[GPT_QKV_W], w[GPT_QKV_B], NULL,
                                   N, C, 3 * C, dt, c->scratch, c->s)) < 0)
        return r;
    return kernel_attention_forward(c->atty, c->att, c->qkv, c->B, c->T, C, c->NH, dt, c->s);
}

static int cm_attn_forward(struct backend *b, const void *const *w, const void *x_in, void *x2,
                           void *ln, float *mean, float *rstd)
{
    struct cuda_backend *c = cub(b);
    int N = c->N, C = c->C, r;
    if ((r = attn_acts(c, w, x_in)) < 0 ||
        (r = kernel_matmul_forward(c->blas, x2, c->dt, c->atty, w[GPT_ATTN_PROJ_W],
                                   w[GPT_ATTN_PROJ_B], x_in, N, C, C, c->dt, c->scratch, c->s)) <
            0)
        return r;
    return kernel_layernorm_forward(ln, mean, rstd, x2, w[GPT_LN2_W], w[GPT_LN2_B], N, C, c->dt,
                                    c->s);
}

/* Room for the logits (N,E) in fp32, and after them their gradient in dt. */
static int logits_room(struct cuda_backend *c, int E)
{
    size_t n = 2 * (size_t)c->N * (size_t)E, have = c->moe ? c->moe->logits_n * sizeof(float) : 0;
    int r = state(c);
    if (r == 0) r = grow(c, (void **)&c->moe->logits, &have, n * sizeof(float));
    if (r == 0) c->moe->logits_n = have / sizeof(float);
    return r;
}

static int cm_gate_logits(struct backend *b, const void *ln, const void *wg, int E, float *logits)
{
    struct cuda_backend *c = cub(b);
    int r = logits_room(c, E);
    if (r == 0)
        r = kernel_matmul_forward(c->blas, c->moe->logits, KDT_F32, ln, wg, NULL, NULL, c->N, c->C,
                                  E, c->dt, c->scratch, c->s);
    return r < 0 ? r
                 : cm_to_host(b, logits, c->moe->logits, (size_t)c->N * (size_t)E * sizeof(float));
}

static int cm_gather(struct backend *b, float *dst, const void *src, const int64_t *off,
                     const int *tok, int n)
{
    struct cuda_backend *c = cub(b);
    void *doff, *dtok;
    if (n <= 0) return n < 0 ? -EINVAL : 0;
    int r = maps_to_device(c, off, (size_t)n * sizeof(int64_t), tok, (size_t)n * sizeof(int), &doff,
                           &dtok);
    return r < 0 ? r : kernel_moe_gather(dst, src, c->dt, doff, dtok, n, c->C, c->s);
}

/* The expert's input rows in the weights' type: in itself in fp32, else cast into ln2 (the
 * dense block's buffer, free while a MoE block runs). */
static int rows_in(struct cuda_backend *c, int n, const float *in, const void **in_e)
{
    *in_e = in;
    if (c->dt == KDT_F32) return 0;
    *in_e = c->ln2;
    return kernel_cast(c->ln2, c->dt, in, KDT_F32, (size_t)n * c->C, c->s);
}

/* out (n,C) fp32 = proj(gelu(fc(in_e))), the hidden layer kept in fch and fch_gelu. */
static int expert_acts(struct cuda_backend *c, const void *const *w, int n, const void *in_e,
                       float *out)
{
    int C = c->C, r;
    enum kdtype dt = c->dt;
    if ((r = kernel_matmul_forward(c->blas, c->fch, dt, in_e, w[0], w[1], NULL, n, C, 4 * C, dt,
                                   c->scratch, c->s)) < 0 ||
        (r = kernel_gelu_forward(c->fch_gelu, c->fch, (size_t)n * 4 * C, dt, c->s)) < 0)
        return r;
    return kernel_matmul_forward(c->blas, out, KDT_F32, c->fch_gelu, w[2], w[3], NULL, n, 4 * C, C,
                                 dt, c->scratch, c->s);
}

static int cm_expert_forward(struct backend *b, const void *const *w, int n, const float *in,
                             float *out)
{
    struct cuda_backend *c = cub(b);
    const void *in_e;
    if (n < 1 || n > c->N) return -EINVAL;
    int r = rows_in(c, n, in, &in_e);
    return r < 0 ? r : expert_acts(c, w, n, in_e, out);
}

/* moe.c's rows_backward: the output recomputed (fp32, into the MoE's o), the weights'
 * gradients and the output's (into d_small, in dt), then back through the projection, GELU
 * and fc; the input's gradient through x2 (the dense block's, free here) when it is cast. */
static int cm_expert_backward(struct backend *b, const void *const *w, float *const *g, int n,
                              const float *in, const float *d_y, const float *wt, float *d_in,
                              float *d_w)
{
    struct cuda_backend *c = cub(b);
    int C = c->C, r;
    enum kdtype dt = c->dt;
    const void *in_e;
    if (n < 1 || n > c->N) return -EINVAL;
    if ((r = state(c)) < 0) return r;
    size_t have = c->moe->o ? (size_t)c->N * C * sizeof(float) : 0;
    if ((r = grow(c, (void **)&c->moe->o, &have, (size_t)c->N * C * sizeof(float))) < 0) return r;
    void *d_o = c->d_small, *d_in_e = dt == KDT_F32 ? (void *)d_in : c->x2;
    if ((r = rows_in(c, n, in, &in_e)) < 0 || (r = expert_acts(c, w, n, in_e, c->moe->o)) < 0 ||
        (r = kernel_moe_weight_grad(d_o, dt, d_w, d_y, c->moe->o, wt, n, C, c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_big, g[2], g[3], d_o, c->fch_gelu, w[2], n,
                                    4 * C, C, dt, c->scratch, c->s)) < 0 ||
        (r = kernel_gelu_backward(c->d_big, c->fch, (size_t)n * 4 * C, dt, c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, d_in_e, g[0], g[1], c->d_big, in_e, w[0], n, C,
                                    4 * C, dt, c->scratch, c->s)) < 0)
        return r;
    return dt == KDT_F32 ? 0 : kernel_cast(d_in, KDT_F32, d_in_e, dt, (size_t)n * C, c->s);
}

static int cm_combine(struct backend *b, void *y, const float *rows, const int64_t *off,
                      const float *wt, int k)
{
    struct cuda_backend *c = cub(b);
    size_t nk = (size_t)c->N * (size_t)k;
    void *doff, *dwt;
    int r = maps_to_device(c, off, nk * sizeof(int64_t), wt, wt ? nk * sizeof(float) : 0, &doff,
                           &dwt);
    return r < 0 ? r : kernel_moe_combine(y, c->dt, rows, doff, dwt, c->N, k, c->C, c->s);
}

static int cm_add(struct backend *b, void *out, const void *a, const void *x, size_t n)
{
    return kernel_add(out, a, x, n, cub(b)->dt, cub(b)->s);
}

/* d_ln += d_logits @ wg through d_small (kernel_matmul_backward overwrites its d_inp); the
 * gradient of the logits cast to dt first where that is 16 bits. */
static int cm_gate_backward(struct backend *b, const float *d_logits, const void *ln,
                            const void *wg, int E, float *d_wg, void *d_ln)
{
    struct cuda_backend *c = cub(b);
    size_t NE = (size_t)c->N * (size_t)E, NC = (size_t)c->N * (size_t)c->C;
    int r = logits_room(c, E);
    void *dl = c->moe ? (void *)c->moe->logits : NULL;
    if (r == 0)
        r = cuerr(cudaMemcpyAsync(c->moe->logits, d_logits, NE * sizeof(float),
                                  cudaMemcpyHostToDevice, c->s));
    if (r == 0 && c->dt != KDT_F32) {
        dl = c->moe->logits + NE;
        r = kernel_cast(dl, c->dt, c->moe->logits, KDT_F32, NE, c->s);
    }
    if (r == 0)
        r = kernel_matmul_backward(c->blas, c->d_small, d_wg, NULL, dl, ln, wg, c->N, c->C, E,
                                   c->dt, c->scratch, c->s);
    return r < 0 ? r : kernel_add(d_ln, d_ln, c->d_small, NC, c->dt, c->s);
}

/* d += ln2's backward of d_ln; then, as cuda_block_backward's attention half, d through the
 * attention projection, the attention and qkv, and ln1's backward added to d. */
static int cm_attn_backward(struct backend *b, const void *const *w, float *const *g,
                            const void *x_in, const void *x2, const void *d_ln,
                            const float *mean, const float *rstd)
{
    struct cuda_backend *c = cub(b);
    int N = c->N, C = c->C, r;
    if ((r = kernel_layernorm_backward(c->d, 1, g[GPT_LN2_W], g[GPT_LN2_B], d_ln, x2,
                                       w[GPT_LN2_W], mean, rstd, N, C, c->dt, c->scratch,
                                       c->s)) < 0 ||
        (r = attn_acts(c, w, x_in)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_small, g[GPT_ATTN_PROJ_W], g[GPT_ATTN_PROJ_B],
                                    c->d, c->atty, w[GPT_ATTN_PROJ_W], N, C, C, c->dt,
                                    c->scratch, c->s)) < 0 ||
        (r = kernel_attention_backward(c->d_big, c->d_att, c->d_small, c->qkv, c->att, c->B, c->T,
                                       C, c->NH, c->dt, c->s)) < 0 ||
        (r = kernel_matmul_backward(c->blas, c->d_small, g[GPT_QKV_W], g[GPT_QKV_B], c->d_big,
                                    c->ln1, w[GPT_QKV_W], N, C, 3 * C, c->dt, c->scratch,
                                    c->s)) < 0)
        return r;
    return kernel_layernorm_backward(c->d, 1, g[GPT_LN1_W], g[GPT_LN1_B], c->d_small, x_in,
                                     w[GPT_LN1_W], c->ln1_mean, c->ln1_rstd, N, C, c->dt,
                                     c->scratch, c->s);
}

const struct backend_moe_ops backend_cuda_moe_ops = {
    .widened = 0,
    .alloc = cm_alloc,
    .free = cm_free,
    .to_host = cm_to_host,
    .from_host = cm_from_host,
    .grad = cm_grad,
    .attn_forward = cm_attn_forward,
    .gate_logits = cm_gate_logits,
    .gather = cm_gather,
    .expert_forward = cm_expert_forward,
    .expert_backward = cm_expert_backward,
    .combine = cm_combine,
    .add = cm_add,
    .gate_backward = cm_gate_backward,
    .attn_backward = cm_attn_backward,
};

#else /* no CUDA kernels: backend_cuda_open refuses, and nothing here is used */

typedef int backend_cuda_moe_none;

#endif
