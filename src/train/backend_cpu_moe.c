/*
 * backend_cpu_moe.c - the MoE block's ops (backend_moe.h) on the CPU: gpt.c's attention
 * half, ops.c's layer norm and GEMM, moe.c's experts on packed rows, and the combine with
 * moe.c's row operations in the order moe_ep.c sums, so that a MoE block computes the bits
 * it computed when the trainer called those functions itself. The backend's memory is host
 * memory: alloc is malloc and the copies are memcpy. Everything is fp32 (16-bit weights come
 * widened by the trainer, as the dense blocks' are widened by backend_cpu.c).
 *
 * Not here: the dense blocks (backend_cpu.c), the route (moe_route.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "train/backend.h"
#include "train/backend_moe.h"
#include "train/moe_int.h"
#include "train/ops.h"

static int cm_alloc(struct backend *b, void **p, size_t bytes)
{
    (void)b;
    *p = calloc(1, MAX(bytes, 1));
    return *p ? 0 : -ENOMEM;
}

static void cm_free(struct backend *b, void *p, size_t bytes)
{
    (void)b;
    (void)bytes;
    free(p);
}

static int cm_copy(struct backend *b, void *dst, const void *src, size_t bytes)
{
    (void)b;
    if (bytes) memcpy(dst, src, bytes);
    return 0;
}

static void *cm_grad(struct backend *b)
{
    return backend_cpu_view(b)->d;
}

static void block_params(const void *const *w, struct gpt_block_params *bp)
{
    memset(bp, 0, sizeof(*bp));
    for (int s = 0; s < GPT_FC_W; s++)
        bp->t[s] = w[s];
}

static int cm_attn_forward(struct backend *b, const void *const *w, const void *x_in, void *x2,
                           void *ln, float *mean, float *rstd)
{
    struct backend_cpu_view *v = backend_cpu_view(b);
    struct gpt_block_params bp;
    block_params(w, &bp);
    int r = gpt_attn_forward(v->cfg, v->B, v->T, &bp, x_in, x2, v->gs);
    if (r < 0) return r;
    ops_layernorm_forward(ln, mean, rstd, x2, w[GPT_LN2_W], w[GPT_LN2_B],
                          (size_t)v->B * (size_t)v->T, (size_t)v->cfg->C);
    return 0;
}

static int cm_gate_logits(struct backend *b, const void *ln, const void *wg, int E, float *logits)
{
    struct backend_cpu_view *v = backend_cpu_view(b);
    size_t C = (size_t)v->cfg->C;
    /* moe_gate_forward's GEMM. */
    ops_gemm(0, 1, (size_t)v->B * (size_t)v->T, (size_t)E, C, ln, C, wg, C, 0.0f, logits,
             (size_t)E);
    return 0;
}

static int cm_gather(struct backend *b, float *dst, const void *from, const int64_t *off,
                     const int *tok, int n)
{
    size_t C = (size_t)backend_cpu_view(b)->cfg->C;
    const float *src = from;
    for (int i = 0; i < n; i++)
        memcpy(dst + off[i], src + (size_t)tok[i] * C, C * sizeof(float));
    return 0;
}

/* The experts' scratch for n rows, grown when it is short; the config for moe.c's rows
 * functions (which read C alone of it). */
static int scratch(struct backend_cpu_view *v, int n, struct moe_config *mc)
{
    moe_config_defaults(mc, v->cfg->C, 1);
    size_t need = moe_scratch_bytes(mc, MAX(n, 1));
    if (!need) return -EINVAL;
    if (v->ms.bytes < need) {
        void *m = realloc(v->ms.mem, need);
        if (!m) return -ENOMEM;
        v->ms = (struct moe_scratch){.mem = m, .bytes = need};
    }
    return 0;
}

static int cm_expert_forward(struct backend *b, const void *const *w, int n, const float *in,
                             float *out)
{
    struct backend_cpu_view *v = backend_cpu_view(b);
    struct moe_config mc;
    int r = scratch(v, n, &mc);
    if (r < 0) return r;
    struct moe_expert_params p = {w[0], w[1], w[2], w[3]};
    return moe_expert_forward_rows(&mc, &p, n, in, out, &v->ms);
}

static int cm_expert_backward(struct backend *b, const void *const *w, float *const *g, int n,
                              const float *in, const float *d_y, const float *wt, float *d_in,
                              float *d_w)
{
    struct backend_cpu_view *v = backend_cpu_view(b);
    struct moe_config mc;
    int r = scratch(v, n, &mc);
    if (r < 0) return r;
    struct moe_expert_params p = {w[0], w[1], w[2], w[3]};
    struct moe_expert_grads eg = {g[0], g[1], g[2], g[3]};
    return moe_expert_backward_rows(&mc, &p, &eg, n, in, d_y, wt, d_in, d_w, &v->ms);
}

/* Token by token, its rows in the order given: moe_ep.c's unpack and combine_backward add
 * in expert order with the same row operations. */
static int cm_combine(struct backend *b, void *out, const float *rows, const int64_t *off,
                      const float *wt, int k)
{
    float *y = out;
    struct backend_cpu_view *v = backend_cpu_view(b);
    size_t N = (size_t)v->B * (size_t)v->T, C = (size_t)v->cfg->C;
    memset(y, 0, N * C * sizeof(float));
    for (size_t t = 0; t < N; t++)
        for (size_t j = t * (size_t)k; j < (t + 1) * (size_t)k && off[j] >= 0; j++) {
            if (wt)
                moe_row_axpy(y + t * C, wt[j], rows + off[j], C);
            else
                moe_row_add(y + t * C, rows + off[j], C);
        }
    return 0;
}

static int cm_add(struct backend *b, void *out, const void *a, const void *c, size_t n)
{
    (void)b;
    ops_add(out, a, c, n);
    return 0;
}

static int cm_gate_backward(struct backend *b, const float *d_logits, const void *ln,
                            const void *wg, int E, float *d_wg, void *d_ln)
{
    struct backend_cpu_view *v = backend_cpu_view(b);
    size_t N = (size_t)v->B * (size_t)v->T, C = (size_t)v->cfg->C, Ez = (size_t)E;
    /* moe_gate_backward's GEMMs. */
    ops_gemm(1, 0, Ez, C, N, d_logits, Ez, ln, C, 1.0f, d_wg, C);
    ops_gemm(0, 0, N, C, Ez, d_logits, Ez, wg, C, 1.0f, d_ln, C);
    return 0;
}

static int cm_attn_backward(struct backend *b, const void *const *w, float *const *g,
                            const void *x_in, const void *x2, const void *d_ln,
                            const float *mean, const float *rstd)
{
    struct backend_cpu_view *v = backend_cpu_view(b);
    struct gpt_block_params bp;
    struct gpt_block_grads bg = {{0}};
    block_params(w, &bp);
    for (int s = 0; s < GPT_FC_W; s++)
        bg.t[s] = g[s];
    ops_layernorm_backward(v->d, 1, g[GPT_LN2_W], g[GPT_LN2_B], d_ln, x2, w[GPT_LN2_W], mean, rstd,
                           (size_t)v->B * (size_t)v->T, (size_t)v->cfg->C);
    return gpt_attn_backward(v->cfg, v->B, v->T, &bp, x_in, v->d, v->d, &bg, v->gs);
}

const struct backend_moe_ops backend_cpu_moe_ops = {
    .widened = 1,
    .alloc = cm_alloc,
    .free = cm_free,
    .to_host = cm_copy,
    .from_host = cm_copy,
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
