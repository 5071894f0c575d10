/*
 * gpt_sp.c - one rank's share of the GPT model under Ulysses sequence parallelism (see
 * gpt_sp.h): the block with its attention run on whole heads over the whole sequence
 * between two all-to-alls, and the embedding and head on the local positions.
 *
 * The layers are ops.c's, called on B*T/sp rows (position-wise ones) or on NH/sp heads of
 * the full sequence (attention), in the order gpt.c calls them, so that with sp == 1 the
 * arithmetic, and so the bits, are gpt.c's. This file adds the packing of the exchanges,
 * its own scratch layout and the checks with their messages.
 *
 * Not here: the exchange itself (the caller's callback), the reduction of the parameter
 * gradients over the ranks, where tensors live, any GPU code.
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "train/gpt_sp.h"
#include "train/ops.h"

#define ALIGN_FLOATS 16 /* sub-buffers of scratch start on 64-byte boundaries */
#define SCRATCH_ALIGN_BYTES 64

/* ---- shapes and checks --------------------------------------------------------------- */

struct sp_dims {
    size_t sp, rank;
    size_t B, T, Tl; /* Tl = T/sp positions per rank */
    size_t C, Cl;    /* Cl = C/sp channels of this rank's heads, in each of q, k, v */
    size_t NH, NHl;  /* NHl = NH/sp heads per rank */
    size_t V, N, Nl; /* N = B*T rows of the whole batch, Nl = B*Tl of this rank */
};

static struct sp_dims sp_dims_of(const struct gpt_config *cfg, int sp, int rank, int B, int T)
{
    struct sp_dims d = {.sp = (size_t)sp,
                        .rank = (size_t)rank,
                        .B = (size_t)B,
                        .T = (size_t)T,
                        .C = (size_t)cfg->C,
                        .NH = (size_t)cfg->NH,
                        .V = (size_t)cfg->V};
    d.Tl = d.T / d.sp;
    d.Cl = d.C / d.sp;
    d.NHl = d.NH / d.sp;
    d.N = d.B * d.T;
    d.Nl = d.B * d.Tl;
    return d;
}

int gpt_sp_check(const struct gpt_config *cfg, int sp, int rank, int B, int T, char *msg,
                 size_t msg_len)
{
    char tmp[160];
    if (!msg || !msg_len) {
        msg = tmp;
        msg_len = sizeof(tmp);
    }
    int r = gpt_config_validate(cfg, msg, msg_len);
    if (r < 0) return r;
    if (sp < 1) {
        snprintf(msg, msg_len, "sp=%d is out of range: it must be at least 1", sp);
        return -EINVAL;
    }
    if (rank < 0 || rank >= sp) {
        snprintf(msg, msg_len, "rank=%d is out of range: it must be in [0, sp=%d)", rank, sp);
        return -EINVAL;
    }
    if (B < 1) {
        snprintf(msg, msg_len, "B=%d is out of range: it must be at least 1", B);
        return -EINVAL;
    }
    if (T < 1 || T > cfg->maxT) {
        snprintf(msg, msg_len, "T=%d is out of range: it must be in [1, maxT=%d]", T, cfg->maxT);
        return -EINVAL;
    }
    /* As gpt.c: B*T rows and the widest GEMM dimension go to BLAS as int. */
    if ((long long)B * T > INT_MAX / 4) {
        snprintf(msg, msg_len, "B*T=%lld is too large: at most %d", (long long)B * T, INT_MAX / 4);
        return -EINVAL;
    }
    if (T % sp != 0) {
        snprintf(msg, msg_len,
                 "T=%d is not a multiple of sp=%d: every rank holds the same T/sp positions", T,
                 sp);
        return -EINVAL;
    }
    if (cfg->NH % sp != 0) {
        snprintf(msg, msg_len,
                 "NH=%d is not a multiple of sp=%d: every rank attends with NH/sp whole heads",
                 cfg->NH, sp);
        return -EINVAL;
    }
    msg[0] = '\0';
    return 0;
}

/* -EINVAL, with what is wrong logged. */
static int refuse(const char *fn, const char *what)
{
    log_error("%s: %s", fn, what);
    return -EINVAL;
}

/* The shape check of every public function: 0, or -EINVAL with the reason logged. */
static int check_call(const char *fn, const struct gpt_config *cfg, int sp, int rank, int B, int T)
{
    char msg[160];
    if (gpt_sp_check(cfg, sp, rank, B, T, msg, sizeof(msg)) < 0) return refuse(fn, msg);
    return 0;
}

/* 0 when every token of tok (n) is in [0,V), else -EINVAL naming the first one that is not. */
static int check_tokens(const char *fn, const char *name, const int *tok, size_t n, int V)
{
    char msg[160];
    if (!tok) {
        snprintf(msg, sizeof(msg), "%s is NULL", name);
        return refuse(fn, msg);
    }
    for (size_t i = 0; i < n; i++) {
        if (tok[i] < 0 || tok[i] >= V) {
            snprintf(msg, sizeof(msg), "%s[%zu]=%d is out of range: it must be in [0, V=%d)", name,
                     i, tok[i], V);
            return refuse(fn, msg);
        }
    }
    return 0;
}

static int check_block_ptrs(const char *fn, const struct gpt_block_params *p,
                            const struct gpt_block_grads *g, int want_grads)
{
    char msg[160];
    if (!p) return refuse(fn, "the block parameters are NULL");
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++) {
        if (!p->t[s]) {
            snprintf(msg, sizeof(msg), "block parameter %s is NULL", gpt_block_slot_name(s));
            return refuse(fn, msg);
        }
    }
    if (!want_grads) return 0;
    if (!g) return refuse(fn, "the block gradients are NULL");
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++) {
        if (!g->t[s]) {
            snprintf(msg, sizeof(msg), "block gradient %s is NULL", gpt_block_slot_name(s));
            return refuse(fn, msg);
        }
    }
    return 0;
}

static int check_exchange(const char *fn, int sp, gpt_sp_alltoall_fn alltoall)
{
    if (sp > 1 && !alltoall) {
        char msg[160];
        snprintf(msg, sizeof(msg),
                 "the alltoall callback is NULL with sp=%d: only sp=1 runs without one", sp);
        return refuse(fn, msg);
    }
    return 0;
}

/* ---- scratch ------------------------------------------------------------------------------ */

/* The next n floats at *off from base (NULL while only sizing), rounded up so every
 * sub-buffer starts 64-byte aligned. */
static float *take(float *base, size_t *off, size_t n)
{
    float *p = base ? base + *off : NULL;
    *off += (n + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
    return p;
}

/* One block's internals on this rank. Position-wise ones are (B,Tl,...) with every head;
 * the attention's are (B,T,...) with this rank's heads only. */
struct sp_acts {
    float *ln1, *ln1_mean, *ln1_rstd; /* (B,Tl,C), (B,Tl), (B,Tl) */
    float *qkv;                       /* (B,Tl,3C) */
    float *qkv_h;                     /* (B,T,3Cl): q, k, v of this rank's heads side by side */
    float *att;                       /* (B,NHl,T,T) softmax probabilities */
    float *y_h;                       /* (B,T,Cl) this rank's heads' attention output */
    float *atty;                      /* (B,Tl,C) every head's output, before the projection */
    float *x2;                        /* (B,Tl,C) residual stream after the attention */
    float *ln2, *ln2_mean, *ln2_rstd; /* (B,Tl,C), (B,Tl), (B,Tl) */
    float *fch, *fch_gelu;            /* (B,Tl,4C) each */
    float *send, *recv;               /* sp blocks of up to B*Tl*3Cl floats each: exchanges */
};

/* The gradients of the internals: d_big (B,Tl,4C) is dloss/dfch_gelu, then dloss/dfch in
 * place, then dloss/dqkv (B,Tl,3C); d_small (B,Tl,C) dloss/dln2, then dloss/datty, then
 * dloss/dln1, as in gpt.c. */
struct sp_dacts {
    float *d_x2, *d_big, *d_small;
    float *d_row;   /* (B,NHl,T) */
    float *d_y_h;   /* (B,T,Cl) */
    float *d_qkv_h; /* (B,T,3Cl) */
};

struct sp_head {
    float *lnf, *mean, *rstd; /* (B,Tl,C), (B,Tl), (B,Tl) */
    float *logits;            /* (B,Tl,V); dloss/dlogits in place in the backward */
    float *losses;            /* (B,Tl) */
    float *d_lnf;             /* (B,Tl,C) */
};

static void carve_acts(struct sp_acts *a, float *base, size_t *off, const struct sp_dims *d)
{
    size_t NC = d->Nl * d->C;
    a->ln1 = take(base, off, NC);
    a->ln1_mean = take(base, off, d->Nl);
    a->ln1_rstd = take(base, off, d->Nl);
    a->qkv = take(base, off, 3 * NC);
    a->qkv_h = take(base, off, d->B * d->T * 3 * d->Cl);
    a->att = take(base, off, d->B * d->NHl * d->T * d->T);
    a->y_h = take(base, off, d->B * d->T * d->Cl);
    a->atty = take(base, off, NC);
    a->x2 = take(base, off, NC);
    a->ln2 = take(base, off, NC);
    a->ln2_mean = take(base, off, d->Nl);
    a->ln2_rstd = take(base, off, d->Nl);
    a->fch = take(base, off, 4 * NC);
    a->fch_gelu = take(base, off, 4 * NC);
    a->send = take(base, off, 3 * NC);
    a->recv = take(base, off, 3 * NC);
}

static void carve_dacts(struct sp_dacts *a, float *base, size_t *off, const struct sp_dims *d)
{
    size_t NC = d->Nl * d->C;
    a->d_x2 = take(base, off, NC);
    a->d_big = take(base, off, 4 * NC);
    a->d_small = take(base, off, NC);
    a->d_row = take(base, off, d->B * d->NHl * d->T);
    a->d_y_h = take(base, off, d->B * d->T * d->Cl);
    a->d_qkv_h = take(base, off, d->B * d->T * 3 * d->Cl);
}

static void carve_head(struct sp_head *h, float *base, size_t *off, const struct sp_dims *d)
{
    h->lnf = take(base, off, d->Nl * d->C);
    h->mean = take(base, off, d->Nl);
    h->rstd = take(base, off, d->Nl);
    h->logits = take(base, off, d->Nl * d->V);
    h->losses = take(base, off, d->Nl);
    h->d_lnf = take(base, off, d->Nl * d->C);
}

static size_t scratch_floats(const struct sp_dims *d)
{
    struct sp_acts a;
    struct sp_dacts da;
    struct sp_head h;
    size_t block = 0, head = 0;
    carve_acts(&a, NULL, &block, d);
    carve_dacts(&da, NULL, &block, d);
    carve_head(&h, NULL, &head, d);
    return block > head ? block : head;
}

size_t gpt_sp_scratch_bytes(const struct gpt_config *cfg, int sp, int B, int T)
{
    if (gpt_sp_check(cfg, sp, 0, B, T, NULL, 0) < 0) return 0;
    struct sp_dims d = sp_dims_of(cfg, sp, 0, B, T);
    return scratch_floats(&d) * sizeof(float) + SCRATCH_ALIGN_BYTES;
}

/* The 64-byte aligned start of s, or NULL (with the reason logged) when s is missing or
 * too small. */
static float *scratch_base(const char *fn, const struct sp_dims *d, struct gpt_scratch *s)
{
    size_t need = scratch_floats(d) * sizeof(float) + SCRATCH_ALIGN_BYTES;
    char msg[160];
    if (!s || !s->mem) {
        refuse(fn, "the scratch is NULL");
        return NULL;
    }
    if (s->bytes < need) {
        snprintf(msg, sizeof(msg), "the scratch holds %zu bytes: gpt_sp_scratch_bytes() asks %zu",
                 s->bytes, need);
        refuse(fn, msg);
        return NULL;
    }
    uintptr_t a =
        ((uintptr_t)s->mem + SCRATCH_ALIGN_BYTES - 1) & ~(uintptr_t)(SCRATCH_ALIGN_BYTES - 1);
    return (float *)a;
}

/* ---- the exchanges -------------------------------------------------------------------- */

/* An exchange buffer holds sp blocks of B*Tl*G*Cl floats, block j being what goes to (or
 * came from) rank j: its (b, t) rows of G groups (q, k, v: G = 3; y: G = 1) of Cl floats,
 * the columns of rank j's heads. Two layouts meet it:
 *   local (B,Tl,G*C), every head at this rank's positions: block j holds group g's columns
 *     [g*C + j*Cl, g*C + (j+1)*Cl) of every local row;
 *   heads (B,T,G*Cl), this rank's heads at every position: block j holds the rows of rank
 *     j's positions [j*Tl, (j+1)*Tl) of every sequence.
 * Sending local and receiving heads turns "local positions, all heads" into "all positions,
 * local heads"; sending heads and receiving local turns it back. Each is a copy, so the
 * bits do not depend on which thread copies what. */
static void local_xchg(float *local, float *buf, const struct sp_dims *d, size_t G, int to_buf)
{
    size_t count = d->Nl * G * d->Cl, rows = d->sp * d->Nl;
#pragma omp parallel for schedule(static)
    for (size_t jr = 0; jr < rows; jr++) {
        size_t j = jr / d->Nl, r = jr % d->Nl;
        for (size_t g = 0; g < G; g++) {
            float *l = local + r * G * d->C + g * d->C + j * d->Cl;
            float *x = buf + j * count + (r * G + g) * d->Cl;
            if (to_buf)
                memcpy(x, l, d->Cl * sizeof(float));
            else
                memcpy(l, x, d->Cl * sizeof(float));
        }
    }
}

static void heads_xchg(float *heads, float *buf, const struct sp_dims *d, size_t G, int to_buf)
{
    size_t count = d->Nl * G * d->Cl, rows = d->sp * d->Nl, w = G * d->Cl;
#pragma omp parallel for schedule(static)
    for (size_t jr = 0; jr < rows; jr++) {
        size_t j = jr / d->Nl, r = jr % d->Nl, b = r / d->Tl, t = r % d->Tl;
        float *h = heads + (b * d->T + j * d->Tl + t) * w;
        float *x = buf + j * count + r * w;
        if (to_buf)
            memcpy(x, h, w * sizeof(float));
        else
            memcpy(h, x, w * sizeof(float));
    }
}

/* All-to-all of sp blocks of count floats from send to recv; with sp == 1 and no callback,
 * a copy. */
static int exchange(const struct sp_dims *d, gpt_sp_alltoall_fn fn, void *ctx, const float *send,
                    float *recv, size_t count)
{
    if (!fn) {
        memcpy(recv, send, d->sp * count * sizeof(float));
        return 0;
    }
    return fn(ctx, send, recv, count);
}

/* local (B,Tl,G*C) -> heads (B,T,G*Cl), through a->send and a->recv. */
static int to_heads(const struct sp_dims *d, struct sp_acts *a, float *local, float *heads,
                    size_t G, gpt_sp_alltoall_fn fn, void *ctx)
{
    local_xchg(local, a->send, d, G, 1);
    int r = exchange(d, fn, ctx, a->send, a->recv, d->Nl * G * d->Cl);
    if (r < 0) return r;
    heads_xchg(heads, a->recv, d, G, 0);
    return 0;
}

/* heads (B,T,G*Cl) -> local (B,Tl,G*C), through a->send and a->recv. */
static int to_local(const struct sp_dims *d, struct sp_acts *a, float *heads, float *local,
                    size_t G, gpt_sp_alltoall_fn fn, void *ctx)
{
    heads_xchg(heads, a->send, d, G, 1);
    int r = exchange(d, fn, ctx, a->send, a->recv, d->Nl * G * d->Cl);
    if (r < 0) return r;
    local_xchg(local, a->recv, d, G, 0);
    return 0;
}

/* ---- the block ---------------------------------------------------------------------------- */

/* gpt.c's block_forward_acts with the attention between two exchanges. x_out NULL: stop
 * after the last input of the MLP's projection (what the backward needs). x_out may be
 * x_in: x_in is last read before x_out is written. */
static int block_forward(const struct sp_dims *d, const struct gpt_block_params *p,
                         const float *x_in, float *x_out, struct sp_acts *a, gpt_sp_alltoall_fn fn,
                         void *ctx)
{
    size_t N = d->Nl, C = d->C;
    const float *const *t = p->t;
    ops_layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x_in, t[GPT_LN1_W], t[GPT_LN1_B], N, C);
    ops_linear_forward(a->qkv, a->ln1, t[GPT_QKV_W], t[GPT_QKV_B], NULL, N, C, 3 * C);
    int r = to_heads(d, a, a->qkv, a->qkv_h, 3, fn, ctx);
    if (r < 0) return r;
    /* This rank's heads are a model of C/sp channels and NH/sp heads of the same size. */
    ops_attention_forward(a->y_h, a->att, a->qkv_h, d->B, d->T, d->Cl, d->NHl);
    if ((r = to_local(d, a, a->y_h, a->atty, 1, fn, ctx)) < 0) return r;
    ops_linear_forward(a->x2, a->atty, t[GPT_ATTN_PROJ_W], t[GPT_ATTN_PROJ_B], x_in, N, C, C);
    ops_layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->x2, t[GPT_LN2_W], t[GPT_LN2_B], N,
                          C);
    ops_linear_forward(a->fch, a->ln2, t[GPT_FC_W], t[GPT_FC_B], NULL, N, C, 4 * C);
    ops_gelu_forward(a->fch_gelu, a->fch, N * 4 * C);
    if (x_out)
        ops_linear_forward(x_out, a->fch_gelu, t[GPT_MLP_PROJ_W], t[GPT_MLP_PROJ_B], a->x2, N,
                           4 * C, C);
    return 0;
}

/* gpt.c's block_backward_acts with the attention's backward between two exchanges, in the
 * reverse order of the forward's. d_in may be d_out: d_out is last read (step 2) long
 * before d_in is written (step 9). */
static int block_backward(const struct sp_dims *d, const struct gpt_block_params *p,
                          const float *x_in, struct sp_acts *a, const struct sp_dacts *da,
                          const float *d_out, float *d_in, struct gpt_block_grads *g,
                          gpt_sp_alltoall_fn fn, void *ctx)
{
    size_t N = d->Nl, C = d->C;
    const float *const *t = p->t;
    float *const *gt = g->t;
    /* 1. The residual path carries d_out straight to the middle of the block. */
    memcpy(da->d_x2, d_out, N * C * sizeof(float));
    /* 2-4. MLP: projection, GELU, fc. */
    ops_linear_backward(da->d_big, gt[GPT_MLP_PROJ_W], gt[GPT_MLP_PROJ_B], d_out, a->fch_gelu,
                        t[GPT_MLP_PROJ_W], N, 4 * C, C);
    ops_gelu_backward(da->d_big, a->fch, N * 4 * C);
    ops_linear_backward(da->d_small, gt[GPT_FC_W], gt[GPT_FC_B], da->d_big, a->ln2, t[GPT_FC_W], N,
                        C, 4 * C);
    /* 5. ln2 adds its input gradient to the residual stream's. */
    ops_layernorm_backward(da->d_x2, 1, gt[GPT_LN2_W], gt[GPT_LN2_B], da->d_small, a->x2,
                           t[GPT_LN2_W], a->ln2_mean, a->ln2_rstd, N, C);
    /* 6. The attention's projection; its input gradient (B,Tl,C) goes to the heads' ranks. */
    ops_linear_backward(da->d_small, gt[GPT_ATTN_PROJ_W], gt[GPT_ATTN_PROJ_B], da->d_x2, a->atty,
                        t[GPT_ATTN_PROJ_W], N, C, C);
    int r = to_heads(d, a, da->d_small, da->d_y_h, 1, fn, ctx);
    if (r < 0) return r;
    /* 7. Attention over this rank's heads; dloss/dqkv comes back to the positions' ranks. */
    ops_attention_backward(da->d_qkv_h, da->d_row, da->d_y_h, a->qkv_h, a->att, d->B, d->T, d->Cl,
                           d->NHl);
    if ((r = to_local(d, a, da->d_qkv_h, da->d_big, 3, fn, ctx)) < 0) return r;
    /* 8. qkv. */
    ops_linear_backward(da->d_small, gt[GPT_QKV_W], gt[GPT_QKV_B], da->d_big, a->ln1, t[GPT_QKV_W],
                        N, C, 3 * C);
    /* 9. d_in = residual path + ln1's input gradient. */
    memcpy(d_in, da->d_x2, N * C * sizeof(float));
    ops_layernorm_backward(d_in, 1, gt[GPT_LN1_W], gt[GPT_LN1_B], da->d_small, x_in, t[GPT_LN1_W],
                           a->ln1_mean, a->ln1_rstd, N, C);
    return 0;
}

int gpt_sp_block_forward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                         const struct gpt_block_params *p, const float *x_in, float *x_out,
                         struct gpt_scratch *s, gpt_sp_alltoall_fn alltoall, void *ctx)
{
    static const char fn[] = "gpt_sp_block_forward";
    int r = check_call(fn, cfg, sp, rank, B, T);
    if (r < 0) return r;
    if ((r = check_block_ptrs(fn, p, NULL, 0)) < 0) return r;
    if (!x_in) return refuse(fn, "x_in is NULL");
    if (!x_out) return refuse(fn, "x_out is NULL");
    if ((r = check_exchange(fn, sp, alltoall)) < 0) return r;
    struct sp_dims d = sp_dims_of(cfg, sp, rank, B, T);
    float *base = scratch_base(fn, &d, s);
    if (!base) return -EINVAL;
    struct sp_acts a;
    size_t off = 0;
    carve_acts(&a, base, &off, &d);
    return block_forward(&d, p, x_in, x_out, &a, alltoall, ctx);
}

int gpt_sp_block_backward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                          const struct gpt_block_params *p, const float *x_in, const float *d_out,
                          float *d_in, struct gpt_block_grads *g, struct gpt_scratch *s,
                          gpt_sp_alltoall_fn alltoall, void *ctx)
{
    static const char fn[] = "gpt_sp_block_backward";
    int r = check_call(fn, cfg, sp, rank, B, T);
    if (r < 0) return r;
    if ((r = check_block_ptrs(fn, p, g, 1)) < 0) return r;
    if (!x_in) return refuse(fn, "x_in is NULL");
    if (!d_out) return refuse(fn, "d_out is NULL");
    if (!d_in) return refuse(fn, "d_in is NULL");
    if (d_in == x_in) return refuse(fn, "d_in is x_in: the recompute reads x_in to the end");
    if ((r = check_exchange(fn, sp, alltoall)) < 0) return r;
    struct sp_dims d = sp_dims_of(cfg, sp, rank, B, T);
    float *base = scratch_base(fn, &d, s);
    if (!base) return -EINVAL;
    struct sp_acts a;
    struct sp_dacts da;
    size_t off = 0;
    carve_acts(&a, base, &off, &d);
    carve_dacts(&da, base, &off, &d);
    if ((r = block_forward(&d, p, x_in, NULL, &a, alltoall, ctx)) < 0) return r;
    return block_backward(&d, p, x_in, &a, &da, d_out, d_in, g, alltoall, ctx);
}

/* ---- embedding ------------------------------------------------------------------------- */

/* The embedding is gpt.h's over (B, T/sp) with wpe moved to this rank's first position:
 * ops_embed_* take the position of row n as n % T. */
int gpt_sp_embed_forward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                         const float *wte, const float *wpe, const int *tokens, float *x)
{
    static const char fn[] = "gpt_sp_embed_forward";
    int r = check_call(fn, cfg, sp, rank, B, T);
    if (r < 0) return r;
    if (!wte) return refuse(fn, "wte is NULL");
    if (!wpe) return refuse(fn, "wpe is NULL");
    if (!x) return refuse(fn, "x is NULL");
    struct sp_dims d = sp_dims_of(cfg, sp, rank, B, T);
    if ((r = check_tokens(fn, "tokens", tokens, d.Nl, cfg->V)) < 0) return r;
    ops_embed_forward(x, wte, wpe + d.rank * d.Tl * d.C, tokens, d.B, d.Tl, d.C);
    return 0;
}

int gpt_sp_embed_backward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                          const int *tokens, const float *d_x, float *d_wte, float *d_wpe)
{
    static const char fn[] = "gpt_sp_embed_backward";
    int r = check_call(fn, cfg, sp, rank, B, T);
    if (r < 0) return r;
    if (!d_x) return refuse(fn, "d_x is NULL");
    if (!d_wte) return refuse(fn, "d_wte is NULL");
    if (!d_wpe) return refuse(fn, "d_wpe is NULL");
    struct sp_dims d = sp_dims_of(cfg, sp, rank, B, T);
    if ((r = check_tokens(fn, "tokens", tokens, d.Nl, cfg->V)) < 0) return r;
    ops_embed_backward(d_wte, d_wpe + d.rank * d.Tl * d.C, d_x, tokens, d.B, d.Tl, d.C);
    return 0;
}

/* ---- head ------------------------------------------------------------------------------- */

/* lnf and logits of x (B,Tl,C) into h, as gpt.c's head_logits. */
static void head_logits(const struct sp_dims *d, const float *lnf_w, const float *lnf_b,
                        const float *wte, const float *x, struct sp_head *h)
{
    ops_layernorm_forward(h->lnf, h->mean, h->rstd, x, lnf_w, lnf_b, d->Nl, d->C);
    ops_gemm(0, 1, d->Nl, d->V, d->C, h->lnf, d->C, wte, d->C, 0.0f, h->logits, d->V);
}

/* This rank's share of the batch mean: its per-position losses summed in double, in order,
 * over B*T, as ops_crossentropy sums its mean (so that sp == 1 gives its bits). */
static float partial_loss(const struct sp_dims *d, const float *losses)
{
    double total = 0.0;
    for (size_t n = 0; n < d->Nl; n++)
        total += losses[n];
    return (float)(total / (double)d->N);
}

static int check_head_ptrs(const char *fn, const float *lnf_w, const float *lnf_b, const float *wte,
                           const float *x)
{
    if (!lnf_w) return refuse(fn, "lnf_w is NULL");
    if (!lnf_b) return refuse(fn, "lnf_b is NULL");
    if (!wte) return refuse(fn, "wte is NULL");
    if (!x) return refuse(fn, "x is NULL");
    return 0;
}

int gpt_sp_head_forward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                        const float *lnf_w, const float *lnf_b, const float *wte, const float *x,
                        const int *targets, float *loss, float *logits, struct gpt_scratch *s)
{
    static const char fn[] = "gpt_sp_head_forward";
    int r = check_call(fn, cfg, sp, rank, B, T);
    if (r < 0) return r;
    if ((r = check_head_ptrs(fn, lnf_w, lnf_b, wte, x)) < 0) return r;
    struct sp_dims d = sp_dims_of(cfg, sp, rank, B, T);
    if (loss && (r = check_tokens(fn, "targets", targets, d.Nl, cfg->V)) < 0) return r;
    float *base = scratch_base(fn, &d, s);
    if (!base) return -EINVAL;
    struct sp_head h;
    size_t off = 0;
    carve_head(&h, base, &off, &d);
    head_logits(&d, lnf_w, lnf_b, wte, x, &h);
    if (logits) memcpy(logits, h.logits, d.Nl * d.V * sizeof(float));
    if (loss) {
        ops_crossentropy(h.logits, h.losses, targets, d.Nl, d.V, 0);
        *loss = partial_loss(&d, h.losses);
    }
    return 0;
}

int gpt_sp_head_backward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                         const float *lnf_w, const float *lnf_b, const float *wte, const float *x,
                         const int *targets, float *d_x, float *d_lnf_w, float *d_lnf_b,
                         float *d_wte, float *loss, struct gpt_scratch *s)
{
    static const char fn[] = "gpt_sp_head_backward";
    int r = check_call(fn, cfg, sp, rank, B, T);
    if (r < 0) return r;
    if ((r = check_head_ptrs(fn, lnf_w, lnf_b, wte, x)) < 0) return r;
    if (!d_x) return refuse(fn, "d_x is NULL");
    if (!d_lnf_w) return refuse(fn, "d_lnf_w is NULL");
    if (!d_lnf_b) return refuse(fn, "d_lnf_b is NULL");
    if (!d_wte) return refuse(fn, "d_wte is NULL");
    struct sp_dims d = sp_dims_of(cfg, sp, rank, B, T);
    if ((r = check_tokens(fn, "targets", targets, d.Nl, cfg->V)) < 0) return r;
    float *base = scratch_base(fn, &d, s);
    if (!base) return -EINVAL;
    struct sp_head h;
    size_t off = 0;
    carve_head(&h, base, &off, &d);
    size_t N = d.Nl, C = d.C, V = d.V;
    head_logits(&d, lnf_w, lnf_b, wte, x, &h);
    /* ops_crossentropy divides dloss/dlogits by its own N = B*Tl rows; the loss is the mean
     * over B*T, so the rows scale by Tl/T = 1/sp. With sp == 1 nothing is scaled (gpt.c's
     * bits); with sp a power of two the scale is exact and dloss/dlogits has the one-rank
     * bits; otherwise it is within an ulp or two of them. */
    ops_crossentropy(h.logits, h.losses, targets, N, V, 1);
    if (d.sp > 1) {
        float scale = (float)d.Nl / (float)d.N;
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < N * V; i++)
            h.logits[i] *= scale;
    }
    /* d_lnf (N,C) = dlogits (N,V) @ wte (V,C); d_wte (V,C) += dlogits^T @ lnf (N,C). */
    ops_gemm(0, 0, N, C, V, h.logits, V, wte, C, 0.0f, h.d_lnf, C);
    ops_gemm(1, 0, V, C, N, h.logits, V, h.lnf, C, 1.0f, d_wte, C);
    ops_layernorm_backward(d_x, 0, d_lnf_w, d_lnf_b, h.d_lnf, x, lnf_w, h.mean, h.rstd, N, C);
    if (loss) *loss = partial_loss(&d, h.losses);
    return 0;
}
