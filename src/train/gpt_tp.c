/*
 * gpt_tp.c - tensor parallelism of gpt_tp.h, part one: the checks, the cut of every tensor
 * over the tp ranks (shapes, slicing out and scattering back), the scratch, and one
 * transformer block's forward and backward on a rank's slices.
 *
 * The layers are ops.c's, called on the rank's slices exactly as gpt.c calls them on the
 * whole tensors: at tp == 1 the calls, their shapes and so their bits are gpt.c's, and for
 * tp > 1 the only new arithmetic is the allreduce's sum of the row-parallel partials.
 *
 * Not here: the vocab-parallel embedding and head (gpt_tp_vocab.c), the collectives
 * themselves (the caller's), the optimizer, GPU code.
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "train/gpt.h"
#include "train/gpt_tp.h"
#include "train/gpt_tp_int.h"
#include "train/ops.h"

/* ---- checks ------------------------------------------------------------------------------ */

int gpt_tp_validate(const struct gpt_config *cfg, int tp, int rank, char *msg, size_t msg_len)
{
    char tmp[160];
    if (!msg || !msg_len) {
        msg = tmp;
        msg_len = sizeof(tmp);
    }
    int r = gpt_config_validate(cfg, msg, msg_len);
    if (r < 0) return r;
    if (tp < 1) {
        snprintf(msg, msg_len, "tp=%d is out of range: tensor parallelism needs tp >= 1", tp);
        return -EINVAL;
    }
    if (rank < 0 || rank >= tp) {
        snprintf(msg, msg_len, "rank=%d is out of range: with tp=%d it must be in [0, %d]", rank,
                 tp, tp - 1);
        return -EINVAL;
    }
    if (cfg->NH % tp != 0) {
        snprintf(msg, msg_len,
                 "NH=%d is not a multiple of tp=%d: every rank needs the same number of "
                 "attention heads",
                 cfg->NH, tp);
        return -EINVAL;
    }
    if (cfg->V < tp) {
        snprintf(msg, msg_len,
                 "V=%d is smaller than tp=%d: every rank needs at least one row of wte", cfg->V,
                 tp);
        return -EINVAL;
    }
    msg[0] = '\0';
    return 0;
}

/* 0 when (cfg, tp, rank, B, T) can run, else -EINVAL. */
static int check_shape(const struct gpt_config *cfg, int tp, int rank, int B, int T)
{
    int r = gpt_tp_validate(cfg, tp, rank, NULL, 0);
    if (r < 0) return r;
    /* As gpt.c: B*T rows and the widest GEMM dimension go to BLAS as int. */
    if (B < 1 || T < 1 || T > cfg->maxT || (long long)B * T > INT_MAX / 4) return -EINVAL;
    return 0;
}

int gpt_tp_check_call(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T)
{
    if (!comm) return -EINVAL;
    int r = check_shape(cfg, comm->tp, comm->rank, B, T);
    if (r < 0) return r;
    if (comm->tp > 1 && (!comm->allreduce || !comm->allgather)) return -EINVAL;
    return 0;
}

int gpt_tp_check_tokens(const int *tok, size_t N, int V)
{
    if (!tok) return -EINVAL;
    for (size_t i = 0; i < N; i++)
        if (tok[i] < 0 || tok[i] >= V) return -EINVAL;
    return 0;
}

int gpt_tp_vocab_range(const struct gpt_config *cfg, int tp, int rank, int *lo, int *hi)
{
    int r = gpt_tp_validate(cfg, tp, rank, NULL, 0);
    if (r < 0) return r;
    if (!lo || !hi) return -EINVAL;
    *lo = (int)((long long)cfg->V * rank / tp);
    *hi = (int)((long long)cfg->V * (rank + 1) / tp);
    return 0;
}

/* ---- the cut ----------------------------------------------------------------------------- */

/* Rank's part of a full tensor of full_cols columns: in each of parts groups of part_stride
 * rows, the rows [row0, row0 + nrows) of the group, and of each the columns
 * [col0, col0 + ncols). The slice holds them in that order, contiguous. */
struct cut {
    size_t parts, part_stride, row0, nrows, col0, ncols, full_cols;
};

static struct cut cut_whole(size_t rows, size_t cols)
{
    return (struct cut){
        .parts = 1, .part_stride = rows, .nrows = rows, .ncols = cols, .full_cols = cols};
}

/* The cut of a block slot; cfg, tp and rank already validated. */
static struct cut block_cut(const struct gpt_config *cfg, int tp, int rank, int slot)
{
    size_t C = (size_t)cfg->C, Cr = C / (size_t)tp, r = (size_t)rank;
    switch (slot) {
    case GPT_QKV_W:
    case GPT_QKV_B:
        return (struct cut){.parts = 3,
                            .part_stride = C,
                            .row0 = r * Cr,
                            .nrows = Cr,
                            .ncols = slot == GPT_QKV_W ? C : 1,
                            .full_cols = slot == GPT_QKV_W ? C : 1};
    case GPT_FC_W:
    case GPT_FC_B:
        return (struct cut){.parts = 1,
                            .part_stride = 4 * C,
                            .row0 = r * 4 * Cr,
                            .nrows = 4 * Cr,
                            .ncols = slot == GPT_FC_W ? C : 1,
                            .full_cols = slot == GPT_FC_W ? C : 1};
    case GPT_ATTN_PROJ_W:
        return (struct cut){
            .parts = 1, .part_stride = C, .nrows = C, .col0 = r * Cr, .ncols = Cr, .full_cols = C};
    case GPT_MLP_PROJ_W:
        return (struct cut){.parts = 1,
                            .part_stride = C,
                            .nrows = C,
                            .col0 = r * 4 * Cr,
                            .ncols = 4 * Cr,
                            .full_cols = 4 * C};
    default: /* LayerNorms and the two biases of the row-parallel linears: replicated */
        return cut_whole(C, 1);
    }
}

/* The full shape gpt_layout gives a tensor, to check a caller's description against. */
static int tensor_cut(const struct gpt_config *cfg, int tp, int rank,
                      const struct gpt_tensor_desc *d, struct cut *c, size_t full[2])
{
    int r = gpt_tp_validate(cfg, tp, rank, NULL, 0);
    if (r < 0) return r;
    if (!d) return -EINVAL;
    size_t C = (size_t)cfg->C;
    if (d->block >= 0) {
        if (d->block >= cfg->L || d->slot < 0 || d->slot >= GPT_BLOCK_NSLOTS) return -EINVAL;
        static const unsigned char rows[GPT_BLOCK_NSLOTS] = {1, 1, 3, 3, 1, 1, 1, 1, 4, 4, 1, 1};
        static const unsigned char cols[GPT_BLOCK_NSLOTS] = {0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4, 0};
        full[0] = rows[d->slot] * C;
        full[1] = cols[d->slot] ? cols[d->slot] * C : 1;
        *c = block_cut(cfg, tp, rank, d->slot);
    } else if (d->block == -1) {
        switch (d->slot) {
        case GPT_WTE: {
            int lo = 0, hi = 0;
            gpt_tp_vocab_range(cfg, tp, rank, &lo, &hi);
            full[0] = (size_t)cfg->V;
            full[1] = C;
            *c = (struct cut){.parts = 1,
                              .part_stride = full[0],
                              .row0 = (size_t)lo,
                              .nrows = (size_t)(hi - lo),
                              .ncols = C,
                              .full_cols = C};
            break;
        }
        case GPT_WPE:
            full[0] = (size_t)cfg->maxT;
            full[1] = C;
            *c = cut_whole(full[0], C);
            break;
        case GPT_LNF_W:
        case GPT_LNF_B:
            full[0] = C;
            full[1] = 1;
            *c = cut_whole(C, 1);
            break;
        default:
            return -EINVAL;
        }
    } else {
        return -EINVAL;
    }
    if (d->shape[0] != full[0] || d->shape[1] != full[1] || d->numel != full[0] * full[1])
        return -EINVAL;
    return 0;
}

int gpt_tp_block_slot_shape(const struct gpt_config *cfg, int tp, int rank, int slot,
                            size_t shape[2])
{
    int r = gpt_tp_validate(cfg, tp, rank, NULL, 0);
    if (r < 0) return r;
    if (slot < 0 || slot >= GPT_BLOCK_NSLOTS || !shape) return -EINVAL;
    struct cut c = block_cut(cfg, tp, rank, slot);
    shape[0] = c.parts * c.nrows;
    shape[1] = c.ncols;
    return 0;
}

int gpt_tp_tensor_shape(const struct gpt_config *cfg, int tp, int rank,
                        const struct gpt_tensor_desc *d, size_t shape[2])
{
    struct cut c;
    size_t full[2];
    if (!shape) return -EINVAL;
    int r = tensor_cut(cfg, tp, rank, d, &c, full);
    if (r < 0) return r;
    shape[0] = c.parts * c.nrows;
    shape[1] = c.ncols;
    return 0;
}

size_t gpt_tp_block_num_params(const struct gpt_config *cfg, int tp, int rank)
{
    if (gpt_tp_validate(cfg, tp, rank, NULL, 0) < 0) return 0;
    size_t n = 0;
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++) {
        struct cut c = block_cut(cfg, tp, rank, s);
        n += c.parts * c.nrows * c.ncols;
    }
    return n;
}

int gpt_tp_block_params_at(const struct gpt_config *cfg, int tp, int rank, const float *block,
                           struct gpt_block_params *p)
{
    int r = gpt_tp_validate(cfg, tp, rank, NULL, 0);
    if (r < 0) return r;
    if (!block || !p) return -EINVAL;
    size_t off = 0;
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++) {
        struct cut c = block_cut(cfg, tp, rank, s);
        p->t[s] = block + off;
        off += c.parts * c.nrows * c.ncols;
    }
    return 0;
}

int gpt_tp_block_grads_at(const struct gpt_config *cfg, int tp, int rank, float *block,
                          struct gpt_block_grads *g)
{
    struct gpt_block_params p;
    if (!g) return -EINVAL;
    int r = gpt_tp_block_params_at(cfg, tp, rank, block, &p);
    if (r < 0) return r;
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++)
        g->t[s] = block + (p.t[s] - block);
    return 0;
}

/* Copies rank's part between full and slice: out of full when to_slice, else back in. */
static void cut_copy(const struct cut *c, float *full, float *slice, int to_slice)
{
    size_t k = 0;
    for (size_t part = 0; part < c->parts; part++) {
        for (size_t i = 0; i < c->nrows; i++, k++) {
            float *f = full + (part * c->part_stride + c->row0 + i) * c->full_cols + c->col0;
            float *s = slice + k * c->ncols;
            if (to_slice)
                memcpy(s, f, c->ncols * sizeof(float));
            else
                memcpy(f, s, c->ncols * sizeof(float));
        }
    }
}

int gpt_tp_slice_out(const struct gpt_config *cfg, int tp, int rank,
                     const struct gpt_tensor_desc *d, const float *full, float *slice)
{
    struct cut c;
    size_t shape[2];
    int r = tensor_cut(cfg, tp, rank, d, &c, shape);
    if (r < 0) return r;
    if (!full || !slice) return -EINVAL;
    cut_copy(&c, (float *)full, slice, 1); /* only read: to_slice writes slice alone */
    return 0;
}

int gpt_tp_slice_in(const struct gpt_config *cfg, int tp, int rank, const struct gpt_tensor_desc *d,
                    const float *slice, float *full)
{
    struct cut c;
    size_t shape[2];
    int r = tensor_cut(cfg, tp, rank, d, &c, shape);
    if (r < 0) return r;
    if (!full || !slice) return -EINVAL;
    cut_copy(&c, full, (float *)slice, 0); /* only read: the copy back in writes full alone */
    return 0;
}

/* ---- scratch ----------------------------------------------------------------------------- */

/* Shapes of one call on one rank: N = B*T rows; Cr = C/tp channels of NHr = NH/tp heads. */
struct tp_dims {
    size_t B, T, C, NH, N, Cr, NHr;
};

static struct tp_dims tp_dims_of(const struct gpt_config *cfg, int tp, int B, int T)
{
    size_t C = (size_t)cfg->C, NH = (size_t)cfg->NH;
    return (struct tp_dims){.B = (size_t)B,
                            .T = (size_t)T,
                            .C = C,
                            .NH = NH,
                            .N = (size_t)B * (size_t)T,
                            .Cr = C / (size_t)tp,
                            .NHr = NH / (size_t)tp};
}

float *gpt_tp_take(float *base, size_t *off, size_t n)
{
    float *p = base ? base + *off : NULL;
    *off += (n + GPT_TP_ALIGN_FLOATS - 1) / GPT_TP_ALIGN_FLOATS * GPT_TP_ALIGN_FLOATS;
    return p;
}

/* A block's internals on one rank: the replicated (B,T,C) ones whole, the rest its heads'
 * or its share of the MLP's 4C. */
struct tp_acts {
    float *ln1, *ln1_mean, *ln1_rstd; /* (B,T,C), (B,T), (B,T) */
    float *qkv;                       /* (B,T,3Cr): this rank's q, k, v side by side */
    float *att;                       /* (B,NHr,T,T) */
    float *atty;                      /* (B,T,Cr) */
    float *x2;                        /* (B,T,C) residual stream after the attention */
    float *ln2, *ln2_mean, *ln2_rstd; /* (B,T,C), (B,T), (B,T) */
    float *fch, *fch_gelu;            /* (B,T,4Cr) */
};

/* Their gradients, buffers reused as gpt.c's are:
 *   d_big   (B,T,4Cr): dloss/dfch_gelu, then dloss/dfch in place, then dloss/dqkv (B,T,3Cr);
 *   d_small (B,T,C):   dloss/dln2 (summed over ranks), then dloss/datty (B,T,Cr), then
 *                      dloss/dln1 (summed over ranks). */
struct tp_dacts {
    float *d_x2, *d_big, *d_small, *d_row; /* d_row (B,NHr,T) */
};

static void carve_acts(struct tp_acts *a, float *base, size_t *off, const struct tp_dims *d)
{
    size_t NC = d->N * d->C, NCr = d->N * d->Cr;
    a->ln1 = gpt_tp_take(base, off, NC);
    a->ln1_mean = gpt_tp_take(base, off, d->N);
    a->ln1_rstd = gpt_tp_take(base, off, d->N);
    a->qkv = gpt_tp_take(base, off, 3 * NCr);
    a->att = gpt_tp_take(base, off, d->B * d->NHr * d->T * d->T);
    a->atty = gpt_tp_take(base, off, NCr);
    a->x2 = gpt_tp_take(base, off, NC);
    a->ln2 = gpt_tp_take(base, off, NC);
    a->ln2_mean = gpt_tp_take(base, off, d->N);
    a->ln2_rstd = gpt_tp_take(base, off, d->N);
    a->fch = gpt_tp_take(base, off, 4 * NCr);
    a->fch_gelu = gpt_tp_take(base, off, 4 * NCr);
}

static void carve_dacts(struct tp_dacts *a, float *base, size_t *off, const struct tp_dims *d)
{
    a->d_x2 = gpt_tp_take(base, off, d->N * d->C);
    a->d_big = gpt_tp_take(base, off, 4 * d->N * d->Cr);
    a->d_small = gpt_tp_take(base, off, d->N * d->C);
    a->d_row = gpt_tp_take(base, off, d->B * d->NHr * d->T);
}

static size_t scratch_floats(const struct gpt_config *cfg, int tp, int B, int T)
{
    struct tp_dims d = tp_dims_of(cfg, tp, B, T);
    struct tp_acts a;
    struct tp_dacts da;
    size_t block = 0, head = gpt_tp_head_scratch_floats(cfg, tp, B, T);
    carve_acts(&a, NULL, &block, &d);
    carve_dacts(&da, NULL, &block, &d);
    return block > head ? block : head;
}

size_t gpt_tp_scratch_bytes(const struct gpt_config *cfg, int tp, int B, int T)
{
    if (check_shape(cfg, tp, 0, B, T) < 0) return 0;
    return scratch_floats(cfg, tp, B, T) * sizeof(float) + GPT_TP_SCRATCH_ALIGN_BYTES;
}

float *gpt_tp_scratch_base(const struct gpt_config *cfg, int tp, int B, int T,
                           struct gpt_scratch *s)
{
    if (!s || !s->mem) return NULL;
    if (s->bytes < scratch_floats(cfg, tp, B, T) * sizeof(float) + GPT_TP_SCRATCH_ALIGN_BYTES)
        return NULL;
    uintptr_t a = ((uintptr_t)s->mem + GPT_TP_SCRATCH_ALIGN_BYTES - 1) &
                  ~(uintptr_t)(GPT_TP_SCRATCH_ALIGN_BYTES - 1);
    return (float *)a;
}

/* ---- the block --------------------------------------------------------------------------- */

int gpt_tp_allreduce(const struct gpt_tp_comm *c, float *buf, size_t count)
{
    if (c->tp == 1) return 0;
    int r = c->allreduce(c->ctx, buf, count);
    return r < 0 ? r : 0;
}

/* out (N,OC) = residual + b + inp (N,IC) @ W^T summed over the ranks, W being this rank's
 * (OC,IC) columns of the row-parallel weight. Rank 0's partial starts from residual + b,
 * as the one-rank linear's accumulate does, and the others' from zero: the allreduce then
 * sums the whole output, and at tp == 1 this is gpt.c's call exactly. */
static int row_parallel_forward(const struct gpt_tp_comm *c, float *out, const float *inp,
                                const float *W, const float *b, const float *residual, size_t N,
                                size_t IC, size_t OC)
{
    if (c->rank == 0)
        ops_linear_forward(out, inp, W, b, residual, N, IC, OC);
    else
        ops_gemm(0, 1, N, OC, IC, inp, IC, W, IC, 0.0f, out, OC);
    return gpt_tp_allreduce(c, out, N * OC);
}

/* x_out (B,T,C) = block(x_in); x_out NULL: fill a up to the MLP's GELU only (what the
 * backward needs). x_out may be x_in: x_in is last read before x_out is written. */
static int block_forward_acts(const struct tp_dims *d, const struct gpt_tp_comm *c,
                              const struct gpt_block_params *p, const float *x_in, float *x_out,
                              struct tp_acts *a)
{
    size_t N = d->N, C = d->C, Cr = d->Cr;
    const float *const *t = p->t;
    ops_layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x_in, t[GPT_LN1_W], t[GPT_LN1_B], N, C);
    ops_linear_forward(a->qkv, a->ln1, t[GPT_QKV_W], t[GPT_QKV_B], NULL, N, C, 3 * Cr);
    ops_attention_forward(a->atty, a->att, a->qkv, d->B, d->T, Cr, d->NHr);
    int r = row_parallel_forward(c, a->x2, a->atty, t[GPT_ATTN_PROJ_W], t[GPT_ATTN_PROJ_B], x_in, N,
                                 Cr, C);
    if (r < 0) return r;
    ops_layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->x2, t[GPT_LN2_W], t[GPT_LN2_B], N,
                          C);
    ops_linear_forward(a->fch, a->ln2, t[GPT_FC_W], t[GPT_FC_B], NULL, N, C, 4 * Cr);
    ops_gelu_forward(a->fch_gelu, a->fch, N * 4 * Cr);
    if (!x_out) return 0;
    return row_parallel_forward(c, x_out, a->fch_gelu, t[GPT_MLP_PROJ_W], t[GPT_MLP_PROJ_B], a->x2,
                                N, 4 * Cr, C);
}

/* d_in (B,T,C) = d_out pulled back through the block whose internals are in a; g += this
 * rank's gradients. The two allreduces sum the input gradients of the column-parallel
 * linears (fc, qkv), each rank holding its share of their outputs. The replicated
 * parameters' gradients come from replicated inputs (d_out, d_x2, x2, x_in), so every rank
 * computes the same ones. d_in may be d_out: d_out is last read long before d_in is
 * written. */
static int block_backward_acts(const struct tp_dims *d, const struct gpt_tp_comm *c,
                               const struct gpt_block_params *p, const float *x_in,
                               const struct tp_acts *a, const struct tp_dacts *da,
                               const float *d_out, float *d_in, struct gpt_block_grads *g)
{
    size_t N = d->N, C = d->C, Cr = d->Cr;
    const float *const *t = p->t;
    float *const *gt = g->t;
    /* The residual path carries d_out straight to the middle of the block. */
    memcpy(da->d_x2, d_out, N * C * sizeof(float));
    /* MLP: projection (this rank's columns), GELU, fc (this rank's rows). */
    ops_linear_backward(da->d_big, gt[GPT_MLP_PROJ_W], gt[GPT_MLP_PROJ_B], d_out, a->fch_gelu,
                        t[GPT_MLP_PROJ_W], N, 4 * Cr, C);
    ops_gelu_backward(da->d_big, a->fch, N * 4 * Cr);
    ops_linear_backward(da->d_small, gt[GPT_FC_W], gt[GPT_FC_B], da->d_big, a->ln2, t[GPT_FC_W], N,
                        C, 4 * Cr);
    int r = gpt_tp_allreduce(c, da->d_small, N * C);
    if (r < 0) return r;
    ops_layernorm_backward(da->d_x2, 1, gt[GPT_LN2_W], gt[GPT_LN2_B], da->d_small, a->x2,
                           t[GPT_LN2_W], a->ln2_mean, a->ln2_rstd, N, C);
    /* Attention: projection (this rank's columns), attention over its heads, qkv. */
    ops_linear_backward(da->d_small, gt[GPT_ATTN_PROJ_W], gt[GPT_ATTN_PROJ_B], da->d_x2, a->atty,
                        t[GPT_ATTN_PROJ_W], N, Cr, C);
    ops_attention_backward(da->d_big, da->d_row, da->d_small, a->qkv, a->att, d->B, d->T, Cr,
                           d->NHr);
    ops_linear_backward(da->d_small, gt[GPT_QKV_W], gt[GPT_QKV_B], da->d_big, a->ln1, t[GPT_QKV_W],
                        N, C, 3 * Cr);
    if ((r = gpt_tp_allreduce(c, da->d_small, N * C)) < 0) return r;
    /* d_in = residual path + ln1's input gradient. */
    memcpy(d_in, da->d_x2, N * C * sizeof(float));
    ops_layernorm_backward(d_in, 1, gt[GPT_LN1_W], gt[GPT_LN1_B], da->d_small, x_in, t[GPT_LN1_W],
                           a->ln1_mean, a->ln1_rstd, N, C);
    return 0;
}

static int check_params(const struct gpt_block_params *p)
{
    if (!p) return -EINVAL;
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++)
        if (!p->t[s]) return -EINVAL;
    return 0;
}

static int check_grads(const struct gpt_block_grads *g)
{
    if (!g) return -EINVAL;
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++)
        if (!g->t[s]) return -EINVAL;
    return 0;
}

int gpt_tp_block_forward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T,
                         const struct gpt_block_params *p, const float *x_in, float *x_out,
                         struct gpt_scratch *s)
{
    int r = gpt_tp_check_call(cfg, comm, B, T);
    if (r < 0) return r;
    if (check_params(p) < 0 || !x_in || !x_out) return -EINVAL;
    float *base = gpt_tp_scratch_base(cfg, comm->tp, B, T, s);
    if (!base) return -EINVAL;
    struct tp_dims d = tp_dims_of(cfg, comm->tp, B, T);
    struct tp_acts a;
    size_t off = 0;
    carve_acts(&a, base, &off, &d);
    return block_forward_acts(&d, comm, p, x_in, x_out, &a);
}

int gpt_tp_block_backward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B,
                          int T, const struct gpt_block_params *p, const float *x_in,
                          const float *d_out, float *d_in, struct gpt_block_grads *g,
                          struct gpt_scratch *s)
{
    int r = gpt_tp_check_call(cfg, comm, B, T);
    if (r < 0) return r;
    if (check_params(p) < 0 || check_grads(g) < 0 || !x_in || !d_out || !d_in || d_in == x_in)
        return -EINVAL;
    float *base = gpt_tp_scratch_base(cfg, comm->tp, B, T, s);
    if (!base) return -EINVAL;
    struct tp_dims d = tp_dims_of(cfg, comm->tp, B, T);
    struct tp_acts a;
    struct tp_dacts da;
    size_t off = 0;
    carve_acts(&a, base, &off, &d);
    carve_dacts(&da, base, &off, &d);
    if ((r = block_forward_acts(&d, comm, p, x_in, NULL, &a)) < 0) return r;
    return block_backward_acts(&d, comm, p, x_in, &a, &da, d_out, d_in, g);
}
