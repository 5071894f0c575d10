/*
 * trainer_moe_step.c - the MoE blocks of a step (trainer_moe.c lays them out), on the CPU
 * backend in fp32, on one rank or on expert-parallel ranks. Block k, whose input is a[k]:
 *   x2 = a[k] + attention(ln1(a[k]))     gpt_attn_forward, the block's own slots 0-5
 *   ln = ln2(x2); route, l_aux = gate(ln)  moe_gate_forward
 *   y = the routed experts' outputs      moe_ep_dispatch_forward .. moe_ep_combine_forward
 *   a[k+1] = x2 + y
 * the ops of gpt_attn_forward and then moe.h's moe_sublock_forward, in the same order.
 *
 * Each phase fetches its set and releases it before the next, as the dense blocks' do:
 * the attention weights, ln2, the gate and a[k]; then each expert of this rank that rows
 * came for, its four tensors as one set; then a[k+1]. An expert that no token chose is not
 * fetched, so its NVMe home is not read. The backward recomputes the attention half and
 * the route from a[k], runs each used expert's backward (fetched again), then the gate's,
 * ln2's and the attention half's, the gradient flowing back taken from the backend and
 * handed back to it through grad_io. The experts a step routed nothing to have no
 * gradient: the optimizer leaves them alone (train_moe_idle), as torch's skip a parameter
 * whose .grad is None. Once the experts to run are known, the next trainer_moe.prefetch of
 * them are asked for ahead of their turn (zinf_prefetch: a hint), and each fetch counts
 * how many of its tensors it found on the device (the hit rate the summary gives).
 *
 * The tokens always travel as moe_ep.c moves them (on one rank the all-to-all is a copy):
 * each rank (the ZeRO ranks are the expert-parallel group, moe.ep_size) routes its own
 * micro-batch, and the owner of an expert runs it on each source rank's rows apart, in
 * rank order, with the shape that source would have had alone. Each (source, micro-batch)
 * gives the expert a gradient of its own, computed from zero and added to what the step
 * holds (copied on the expert's first of the step) in the order of the micro-batches'
 * numbers, micro-batch m of rank r being m x ranks + r (train_load_batch): the chain of one
 * rank's accumulation, so ep ranks of K micro-batches give bitwise one rank of ep x K. An
 * expert whose rows came from no source of a micro-batch adds nothing (one rank does the
 * same). Its chunk sums for the clipping norm are taken after each addition (the last is
 * the step's). The attention half, ln2 and the gate are every rank's, reduced as the dense
 * blocks' tensors are (train_reduce_grad), the gate's local gradient in a buffer of this
 * file's.
 *
 * The math runs in the backend (its MoE ops, backend_moe.h) on the pointers the device tier
 * hands out and on buffers of the backend's memory (x2, ln2 and its statistics, the experts'
 * sum, the gradient of ln2's output, the rows on their way): GPU memory on the CUDA backend,
 * host memory on the CPU's. The route is taken on the host: the gate's logits come over, the
 * decisions, l_aux and the gate's gradient through the softmax are moe_route.c's, and the
 * maps of the rows go back (small: N x E and N x k), so that every backend routes alike.
 * The rows are gathered into the backend's copy of moe_ep.c's send blocks, and the
 * exchange stages through moe_ep.c's host buffers (backend -> host, the all-to-all, host ->
 * backend; on the CPU these are copies); each token's rows are summed in expert order by
 * the backend's combine, the order moe_ep.c sums in.
 *
 * With 16-bit weights (bf16, fp16) on the CPU backend each set's weights are widened to fp32
 * before use, as that backend does for the dense blocks (activations and gradients are fp32
 * there); the CUDA backend takes them as they are, its activations in the weights' type and
 * the rows that travel in fp32 (backend_moe.h).
 *
 * Not here: the layout and the checks of the settings (trainer_moe.c), the dense blocks
 * (trainer_step.c), the MoE math and the exchange (moe.c, moe_ep.c), GPUs.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common.h"
#include "train/backend.h"
#include "train/backend_moe.h"
#include "train/moe.h"
#include "train/ops.h"
#include "train/trainer_impl.h"
#include "trace.h"

/* A buffer of the backend's memory, grown on demand. */
struct dbuf {
    float *p;
    size_t cap; /* floats */
};

struct train_moe {
    struct moe_config mc;
    struct moe_route r;
    int N;                  /* tokens of a micro-batch, B x T */
    /* In the backend's memory: */
    struct dbuf x2, ln;     /* (N,C): the attention half's output, ln2 of it */
    struct dbuf mean, rstd; /* (N): ln2's */
    struct dbuf y, dln;     /* (N,C): the experts' sum; the gradient of ln */
    struct dbuf send, recv, back; /* moe_ep_xfer's blocks, the backend's copies */
    struct dbuf lx;         /* one expert's gradient from one source (its four tensors) */
    struct dbuf lg_gate;    /* exact: a gate's local gradient, reduced as the dense ones */
    /* In host memory: */
    float *dw;              /* (N,k): the gradient of the combine weights */
    float *dlogits;         /* (N,E): the gate's gradient through the softmax */
    int64_t *off;           /* (N,k): the rows' maps (backend_moe.h's gather, combine) */
    int *tok;               /* (N,k) */
    float *cw;              /* (N,k): the combine's weights, in its order */
    struct moe_ep ep;       /* the group: the ZeRO ranks (one rank: ep 1) */
    int Epr;                /* experts of each MoE block this rank holds: E / ep */
    float *wbuf;            /* 16-bit weights: a set's weights widened to fp32 */
    size_t wfloats;         /* its size */
    int *gate;              /* by block: its gate's layout index (its experts follow), or -1 */
    bool *idle;             /* by layout index: the optimizer leaves it alone this step */
    float aux;              /* the forward's sum of the MoE blocks' l_aux */
    float *aux_micro;       /* (grad_accum x (ranks + 1)): that sum by micro-batch, then the
                               copies' gathered */
    int experts, used_step; /* experts: this rank's MoE blocks' E each */
    int experts_all;        /* every stage's (after a step) */
    int *local;             /* (E/ep): this rank's experts that rows came for, in order */
    float *aux_blk;         /* pipeline stages: (M, L) each MoE block's l_aux by micro-batch */
    uint64_t read_step, used_total, read_total;
    uint64_t fetch_step, hit_step, fetch_total, hit_total; /* the experts' tensors' */
};

/* Local expert j (this rank's j-th) of the block whose gate is at layout index g: its
 * tensor of slot s. */
static int expert_idx(int g, int j, int s)
{
    return g + 1 + 4 * j + (s - GPT_FC_W);
}

/* buf holds at least floats (its content is lost when it grows). */
static int room(struct trainer *t, struct dbuf *buf, size_t floats)
{
    const struct backend_moe_ops *mo = t->be->moe;
    if (floats <= buf->cap) return 0;
    mo->free(t->be, buf->p, buf->cap * sizeof(float));
    *buf = (struct dbuf){0};
    int r = mo->alloc(t->be, (void **)&buf->p, MAX(floats, 1) * sizeof(float));
    if (r == 0) buf->cap = floats;
    return r;
}

static void dfree(struct trainer *t, struct dbuf *buf)
{
    if (buf->p) t->be->moe->free(t->be, buf->p, buf->cap * sizeof(float));
    *buf = (struct dbuf){0};
}

/* The group's all-to-all: the ZeRO ranks' host communicator; one rank's is a copy. */
static int alltoall(const float *send, float *recv, size_t count, void *ctx)
{
    struct trainer *t = ctx;
    if (t->ep <= 1) {
        memcpy(recv, send, count * sizeof(float));
        return 0;
    }
    return comm_alltoall(t->hcomm, send, recv, count, COMM_F32);
}

int train_moe_setup(struct trainer *t, char *err, size_t errlen)
{
    if (!t->o.moe.E) return 0;
    const struct trainer_moe *o = &t->o.moe;
    struct train_moe *m = calloc(1, sizeof(*m));
    if (!(t->moe = m)) goto oom;
    moe_config_defaults(&m->mc, t->cfg.C, o->E);
    m->mc.k = o->k;
    m->mc.capacity_factor = o->capacity_factor;
    m->mc.min_capacity = o->min_capacity;
    m->mc.drop_tokens = o->drop_tokens;
    if (moe_config_validate(&m->mc, err, errlen) < 0) return -EINVAL;
    m->N = t->o.batch * t->o.seq;
    size_t N = (size_t)m->N, NC = N * (size_t)t->cfg.C, Nk = N * (size_t)o->k;
    if (!t->be->moe) {
        snprintf(err, errlen, "moe: the %s backend has no MoE ops", t->be->name);
        return -EINVAL;
    }
    int r = 0;
    struct dbuf *nc[] = {&m->x2, &m->ln, &m->y, &m->dln};
    for (size_t i = 0; i < sizeof(nc) / sizeof(nc[0]) && r == 0; i++)
        r = room(t, nc[i], NC);
    if (r == 0) r = room(t, &m->mean, N);
    if (r == 0) r = room(t, &m->rstd, N);
    if (r == 0) r = room(t, &m->lx, moe_expert_num_params(t->cfg.C));
    if (r < 0) {
        snprintf(err, errlen, "moe: no room for the MoE blocks' working buffers in the %s "
                              "backend's memory",
                 t->be->name);
        return r;
    }
    m->dw = malloc(Nk * sizeof(float));
    m->dlogits = malloc(N * (size_t)o->E * sizeof(float));
    m->off = malloc(Nk * sizeof(int64_t));
    m->tok = malloc(Nk * sizeof(int));
    m->cw = malloc(Nk * sizeof(float));
    m->ep = (struct moe_ep){
        .ep = MAX(1, t->ep), .rank = t->ep > 1 ? t->rank : 0, .alltoall = alltoall, .ctx = t};
    m->Epr = o->E / m->ep.ep;
    m->local = malloc((size_t)m->Epr * sizeof(int));
    m->aux_micro = calloc((size_t)t->o.grad_accum * (size_t)(MAX(1, t->world) + 1), sizeof(float));
    if (!m->aux_micro) goto oom;
    if (t->pp > 1 &&
        !(m->aux_blk = calloc((size_t)t->o.grad_accum * (size_t)t->cfg.L, sizeof(float))))
        goto oom;
    m->gate = malloc((size_t)t->cfg.L * sizeof(int));
    m->idle = calloc((size_t)t->ntensors, sizeof(bool));
    if (!m->dw || !m->dlogits || !m->off || !m->tok || !m->cw || !m->local || !m->gate ||
        !m->idle)
        goto oom;
    r = moe_route_init(&m->r, &m->mc, m->N);
    if (r < 0) {
        snprintf(err, errlen, "moe: cannot make the route of %d tokens", m->N);
        return r;
    }
    for (int k = 0; k < t->cfg.L; k++)
        m->gate[k] = -1;
    for (int i = 0; i < t->ntensors; i++) {
        const struct gpt_tensor_desc *d = &t->desc[i];
        if (d->block < 0 || !train_moe_block(t, d->block)) continue;
        if (d->slot == GPT_BLOCK_NSLOTS) {
            m->gate[d->block] = i;
            size_t wn = d->numel; /* the attention half's, ln2's and the gate's weights */
            for (int s = 0; s < GPT_FC_W; s++)
                wn += t->desc[t->block_first[d->block] + s].numel;
            m->wfloats = MAX(m->wfloats, MAX(wn, moe_expert_num_params(t->cfg.C)));
            m->experts += o->E;
            size_t lb = train_role_bytes(t, R_L, i); /* world x shard floats */
            if (t->exact && room(t, &m->lg_gate, lb / sizeof(float)) < 0) goto oom;
        }
        /* The block's own MLP, which the experts stand in for: never trained. */
        if (i < t->block_first[d->block] + GPT_BLOCK_NSLOTS && d->slot >= GPT_FC_W)
            m->idle[i] = true;
    }
    if (t->be->wdt != BACKEND_F32 && t->be->moe->widened &&
        !(m->wbuf = malloc(m->wfloats * sizeof(float))))
        goto oom;
    return 0;
oom:
    snprintf(err, errlen, "out of memory");
    return -ENOMEM;
}

void train_moe_free(struct trainer *t)
{
    struct train_moe *m = t->moe;
    if (!m) return;
    moe_route_release(&m->r);
    struct dbuf *bufs[] = {&m->x2,   &m->ln,   &m->mean, &m->rstd, &m->y,  &m->dln,
                           &m->send, &m->recv, &m->back, &m->lx,   &m->lg_gate};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]) && t->be && t->be->moe; i++)
        dfree(t, bufs[i]);
    free(m->dw);
    free(m->dlogits);
    free(m->off);
    free(m->tok);
    free(m->cw);
    free(m->wbuf);
    free(m->local);
    free(m->aux_blk);
    free(m->aux_micro);
    free(m->gate);
    free(m->idle);
    free(m);
    t->moe = NULL;
}

bool train_moe_idle(const struct trainer *t, int i)
{
    return t->moe && t->moe->idle[i];
}

void train_moe_step_begin(struct trainer *t)
{
    struct train_moe *m = t->moe;
    if (!m) return;
    m->used_step = 0;
    m->read_step = m->fetch_step = m->hit_step = 0;
    if (m->aux_blk)
        memset(m->aux_blk, 0, (size_t)t->o.grad_accum * (size_t)t->cfg.L * sizeof(float));
    /* Every expert is idle until a backward routes a token to it, and adds nothing to the
     * clipping norm until then. */
    for (int k = 0; k < t->cfg.L; k++)
        for (int j = 0; m->gate[k] >= 0 && j < 4 * m->Epr; j++) {
            int i = m->gate[k] + 1 + j;
            m->idle[i] = true;
            if (t->part)
                memset(t->part + t->part_first[i], 0,
                       (t->desc[i].numel + SHARD_FLOATS - 1) / SHARD_FLOATS * sizeof(double));
        }
}

float *train_moe_aux_blocks(struct trainer *t)
{
    return t->moe ? t->moe->aux_blk : NULL;
}

void train_moe_pipe_aux(struct trainer *t, const float *aux, int M)
{
    for (int m = 0; m < M; m++)
        t->losses[m] += t->o.moe.loss_coef * aux[m];
    for (int m = 0; m < M; m++)
        t->moe->aux_micro[m] = aux[m];
}

float train_moe_aux(struct trainer *t)
{
    if (!t->moe) return 0.0f;
    t->moe->aux_micro[t->fmicro] = t->moe->aux;
    return t->o.moe.loss_coef * t->moe->aux;
}

/* The mean over the step's micro-batches (every copy's) of their MoE blocks' l_aux sums,
 * added in the order of the micro-batches' numbers, as the loss is. */
static float aux_mean(struct trainer *t)
{
    struct train_moe *m = t->moe;
    int K = t->o.grad_accum, W = MAX(1, t->world);
    const float *all = m->aux_micro;
    if (W > 1) {
        if (comm_allgather(t->hcomm, m->aux_micro, m->aux_micro + K, (size_t)K * sizeof(float),
                           COMM_BYTE) < 0)
            return NAN;
        all = m->aux_micro + K;
    }
    double s = 0;
    for (int j = 0; j < K * W; j++)
        s += all[(j % W) * K + j / W];
    return (float)(s / (K * W));
}

void train_moe_step_end(struct trainer *t, struct trainer_step_stats *st)
{
    struct train_moe *m = t->moe;
    if (!m) return;
    /* The experts the step's tokens went to (not idle: train_moe_backward), and their
     * bytes read; expert parallel: every rank's, summed. */
    m->used_step = 0;
    for (int k = 0; k < t->cfg.L; k++)
        for (int j = 0; m->gate[k] >= 0 && j < m->Epr; j++)
            m->used_step += !m->idle[expert_idx(m->gate[k], j, GPT_FC_W)];
    uint64_t mine[4] = {(uint64_t)m->used_step, m->read_step, m->fetch_step, m->hit_step};
    uint64_t all[4 * COMM_MAX_RANKS];
    /* Expert parallel: every copy's experts (of this stage's blocks), summed. */
    if (t->ep > 1 && comm_allgather(t->hcomm, mine, all, sizeof(mine), COMM_BYTE) == 0) {
        memset(mine, 0, sizeof(mine));
        for (int q = 0; q < t->ep; q++)
            for (int v = 0; v < 4; v++)
                mine[v] += all[4 * q + v];
    }
    /* Pipeline stages: every stage's blocks', summed. */
    uint64_t ex[5] = {mine[0], mine[1], mine[2], mine[3], (uint64_t)m->experts};
    if (t->pp > 1 && train_pipe_sum_u64(t, ex, 5) == 0) {
        memcpy(mine, ex, sizeof(mine));
        m->experts_all = (int)ex[4];
    }
    m->used_step = (int)mine[0];
    m->read_step = mine[1];
    m->fetch_step = mine[2];
    m->hit_step = mine[3];
    st->moe_aux_loss = aux_mean(t);
    if (!m->experts_all) m->experts_all = m->experts;
    st->experts = m->experts_all;
    st->experts_used = m->used_step;
    st->expert_bytes_read = m->read_step;
    st->expert_fetches = m->fetch_step;
    st->expert_hits = m->hit_step;
    m->fetch_total += m->fetch_step;
    m->hit_total += m->hit_step;
    m->used_total += (uint64_t)m->used_step;
    m->read_total += m->read_step;
}

void train_moe_summary(struct trainer *t, struct trainer_summary *out)
{
    struct train_moe *m = t->moe;
    if (!m) return;
    out->experts = m->experts_all ? m->experts_all : m->experts;
    out->experts_used = m->used_total;
    out->expert_bytes_read = m->read_total;
    out->expert_fetches = m->fetch_total;
    out->expert_hits = m->hit_total;
}

/* ---- the sets ---------------------------------------------------------------------- */

/* The layout index of block k's gate (its experts follow it). */
static int gate_of(const struct trainer *t, int k)
{
    if (t->moe) return t->moe->gate[k];
    for (int i = t->ntensors - 1; i >= 0; i--) /* before train_moe_setup: the budgets' */
        if (t->desc[i].block == k && t->desc[i].slot == GPT_BLOCK_NSLOTS) return i;
    return -1;
}

static void add(struct wave *w, enum role role, int idx, bool dirty)
{
    w->at[w->ne++] = (int8_t)w->n;
    w->role[w->n] = (uint8_t)role;
    w->idx[w->n] = idx;
    w->dirty[w->n] = dirty;
    w->from[w->n] = -1;
    w->n++;
}

/* The attention half, ln2 and the gate: weights (entries 0-8), then with grads their
 * gradients (9-17; exact: the local ones of the block's, the gate's g), then a[k], then
 * (exact) the block's g (19-26). */
static void wave_attn(struct trainer *t, int k, bool grads, struct wave *w)
{
    *w = (struct wave){.what = grads ? "a MoE block's attention and gate backward"
                                     : "a MoE block's attention and gate"};
    int first = t->block_first[k], g = gate_of(t, k);
    for (int s = 0; s < GPT_FC_W; s++)
        add(w, R_W, first + s, false);
    add(w, R_W, g, false);
    for (int s = 0; s < GPT_FC_W && grads; s++)
        add(w, t->exact ? R_L : R_G, first + s, true);
    if (grads) add(w, R_G, g, true);
    add(w, R_ACT, k, false);
    for (int s = 0; s < GPT_FC_W && grads && t->exact; s++)
        add(w, R_G, first + s, true);
}

/* Expert e: its four weights, and with grads their gradients. */
static void wave_expert(struct trainer *t, int k, int e, bool grads, struct wave *w)
{
    *w = (struct wave){.what = grads ? "an expert's backward (its weights and gradients)"
                                     : "an expert's forward (its weights)"};
    for (int s = GPT_FC_W; s <= GPT_MLP_PROJ_B; s++)
        add(w, R_W, expert_idx(gate_of(t, k), e, s), false);
    for (int s = GPT_FC_W; s <= GPT_MLP_PROJ_B && grads; s++)
        add(w, R_G, expert_idx(gate_of(t, k), e, s), true);
}

bool train_moe_wave(struct trainer *t, int k, int n, struct wave *w)
{
    switch (n) {
    case 0:
    case 1:
        wave_attn(t, k, n == 1, w);
        return true;
    case 2: /* every expert's sets are alike */
    case 3:
        wave_expert(t, k, 0, n == 3, w);
        return true;
    case 4:
        *w = (struct wave){.what = "a MoE block's output"};
        add(w, R_ACT, k + 1, true);
        return true;
    default:
        return false;
    }
}

/* 16-bit weights (bf16, fp16): the set's first n entries, weights, widened to fp32 into
 * wbuf and p pointed at the widenings, so that the math is the fp32 reference's on the
 * rounded weights, as the CPU backend's dense blocks compute. */
static void widen(struct trainer *t, const struct wave *w, void **p, int n)
{
    struct train_moe *m = t->moe;
    size_t at = 0;
    for (int i = 0; i < n && t->be->wdt != BACKEND_F32 && t->be->moe->widened; i++) {
        size_t numel = t->desc[w->idx[w->at[i]]].numel;
        float *dst = m->wbuf + at;
        if (t->be->wdt == BACKEND_F16)
            ops_cast_f16_to_f32(dst, p[i], numel);
        else
            ops_cast_bf16_to_f32(dst, p[i], numel);
        p[i] = dst;
        at += numel;
    }
}

/* x2, ln2 and the route of block k from a[k] (the set of wave_attn at p): the logits come
 * to the host, and the route is taken there (backend_moe.h). */
static int attn_and_route(struct trainer *t, void **p, int a)
{
    struct train_moe *m = t->moe;
    const struct backend_moe_ops *mo = t->be->moe;
    int r = mo->attn_forward(t->be, (const void *const *)p, p[a], m->x2.p, m->ln.p, m->mean.p,
                             m->rstd.p);
    if (r == 0) r = mo->gate_logits(t->be, m->ln.p, p[GPT_FC_W], m->mc.E, m->r.logits);
    return r < 0 ? r : moe_route_logits(&m->mc, m->N, &m->r);
}

/* Where the backend's copy of a host buffer of xf holds what the host one holds at hp. */
static float *dev_at(const struct dbuf *d, const float *hbase, const float *hp)
{
    return d->p + (hp - hbase);
}

/* The dispatch of block k's rows (backward: with their output gradients, from the backend's
 * gradient, and their weights) to their experts' owners: gathered in the backend into its
 * copy of the send blocks, staged through the host's for the all-to-all, and what came
 * copied into the backend's recv. A failure releases xf. */
static int dispatch(struct trainer *t, struct moe_ep_xfer *xf, bool backward)
{
    struct train_moe *m = t->moe;
    const struct backend_moe_ops *mo = t->be->moe;
    int r = moe_ep_begin(&m->mc, &m->ep, &m->r, backward, xf);
    if (r < 0) return r;
    size_t P = (size_t)m->ep.ep, out = P * xf->bf_out, back = P * xf->bf_back;
    if ((r = room(t, &m->send, out)) == 0 && (r = room(t, &m->recv, MAX(out, back))) == 0)
        r = room(t, &m->back, back);
    if (r == 0) r = t->be->ops->zero(t->be, m->send.p, out * sizeof(float));
    if (r == 0) r = t->be->ops->zero(t->be, m->back.p, back * sizeof(float));
    for (int plane = 0; plane < (backward ? 2 : 1) && r == 0; plane++) {
        int n = moe_ep_send_map(&m->mc, &m->ep, &m->r, xf, plane, m->off, m->tok);
        r = mo->gather(t->be, m->send.p, plane ? mo->grad(t->be) : m->ln.p, m->off, m->tok, n);
    }
    if (r == 0) r = mo->to_host(t->be, xf->send, m->send.p, out * sizeof(float));
    if (r == 0 && backward) moe_ep_send_weights(&m->mc, &m->ep, &m->r, xf);
    if (r == 0 && (r = moe_ep_exchange(&m->ep, xf, 0)) < 0) return r;
    if (r == 0) r = mo->from_host(t->be, m->recv.p, xf->recv, out * sizeof(float));
    if (r < 0) moe_ep_xfer_release(xf);
    return r;
}

/* The experts' outputs back to their tokens' ranks (the forward's from the send blocks,
 * the backward's from the back blocks), and each token's rows summed in expert order into
 * y (the forward: weighted; the backward: the gradient of ln, and d_weight on the host).
 * Releases xf. */
static int combine(struct trainer *t, struct moe_ep_xfer *xf, bool backward, float *y)
{
    struct train_moe *m = t->moe;
    const struct backend_moe_ops *mo = t->be->moe;
    size_t P = (size_t)m->ep.ep, n = P * xf->bf_back;
    int r = backward ? mo->to_host(t->be, xf->back, m->back.p, n * sizeof(float))
                     : mo->to_host(t->be, xf->send, m->send.p, n * sizeof(float));
    if (r == 0 && (r = moe_ep_exchange(&m->ep, xf, 1)) < 0) return r;
    if (r == 0 && backward) moe_ep_combine_weights(&m->mc, &m->ep, &m->r, xf, m->dw);
    if (r == 0) r = mo->from_host(t->be, m->recv.p, xf->recv, n * sizeof(float));
    if (r == 0) {
        moe_ep_combine_map(&m->mc, &m->ep, &m->r, xf, m->off, backward ? NULL : m->cw);
        r = mo->combine(t->be, y, m->recv.p, m->off, backward ? NULL : m->cw, m->mc.k);
    }
    moe_ep_xfer_release(xf);
    return r;
}

/* The engine's NVMe bytes read so far: what the experts' phase reads, from their first
 * prefetch to the last one's fetch, is counted as theirs (a prefetch reads outside the
 * fetch that takes it). */
static uint64_t nvme_read(struct trainer *t)
{
    struct zinf_stats s;
    zinf_stats(t->e, &s);
    return s.nvme_bytes_read;
}

/* Fetch the set, counting how many of its tensors were resident on the device tier
 * already. */
static int fetch_expert(struct trainer *t, const struct wave *w, void **p)
{
    struct zinf_stats s0, s1;
    const struct zinf_tier_stats *d0 = &s0.tier[ZINF_TIER_DEVICE];
    const struct zinf_tier_stats *d1 = &s1.tier[ZINF_TIER_DEVICE];
    zinf_stats(t->e, &s0);
    int r = train_wave_fetch(t, w, ZINF_TIER_DEVICE, p);
    zinf_stats(t->e, &s1);
    t->moe->fetch_step += d1->fetches - d0->fetches;
    t->moe->hit_step += d1->hits - d0->hits;
    return r;
}

/* The experts rows came for (after a dispatch) into m->local; their number. */
static int local_used(struct train_moe *m, const struct moe_ep_xfer *xf)
{
    int n = 0;
    for (int j = 0; j < m->Epr; j++)
        if (moe_ep_rows_for(&m->mc, &m->ep, xf, j)) m->local[n++] = j;
    return n;
}

/* Ask for the weights of the u-th of block k's n used experts ahead of its turn: a hint,
 * which the engine drops where it has no room. */
static void prefetch(struct trainer *t, int k, int u, int n)
{
    struct train_moe *m = t->moe;
    if (u >= n || t->o.moe.prefetch < 1) return;
    for (int s = GPT_FC_W; s <= GPT_MLP_PROJ_B; s++)
        zinf_prefetch(t->e, train_wave_handle(t, R_W, expert_idx(gate_of(t, k), m->local[u], s)),
                      ZINF_TIER_DEVICE);
}

/* Each of n gradients (entries of p from `at`) zeroed when zero. */
static int grads_begin(struct trainer *t, void **p, int at, const struct wave *w, int n, bool zero)
{
    int r = 0;
    for (int i = 0; i < n && r == 0 && zero; i++)
        r = t->be->ops->zero(t->be, p[at + i],
                             t->desc[w->idx[w->at[at + i]]].numel * sizeof(float));
    return r;
}

/* Each of n gradients summed into the norm when norm (one rank, one micro-batch). */
static int grads_norm(struct trainer *t, void **p, int at, const struct wave *w, int n, bool norm)
{
    int r = 0;
    for (int i = 0; i < n && r == 0 && norm; i++)
        r = t->be->ops->sumsq(t->be, p[at + i], t->desc[w->idx[w->at[at + i]]].numel);
    return r;
}

/* Local expert j's backward on every source's rows (its set at p: weights, gradients):
 * each source's gradient from zero into lx, then added to the step's (train_moe_step.c's
 * head comment). */
static int expert_backward(struct trainer *t, int j, const struct moe_ep_xfer *xf, void **p,
                           const struct wave *w, bool norm)
{
    struct train_moe *m = t->moe;
    const struct backend_ops *be = t->be->ops;
    struct moe_expert_grads lg;
    moe_expert_grads_at(t->cfg.C, m->lx.p, &lg);
    float *lgs[4] = {lg.fc_w, lg.fc_b, lg.proj_w, lg.proj_b};
    int r = 0;
    for (int src = 0; src < m->ep.ep && r == 0; src++) {
        struct moe_ep_rows rw;
        if (moe_ep_rows(&m->mc, &m->ep, xf, src, j, &rw) <= 0) continue;
        r = be->zero(t->be, m->lx.p, moe_expert_num_params(t->cfg.C) * sizeof(float));
        if (r == 0)
            r = t->be->moe->expert_backward(
                t->be, (const void *const *)p, lgs, rw.n, dev_at(&m->recv, xf->recv, rw.in),
                dev_at(&m->recv, xf->recv, rw.d_y), dev_at(&m->recv, xf->recv, rw.w),
                dev_at(&m->back, xf->back, rw.out), dev_at(&m->back, xf->back, rw.d_w));
        for (int s = 0; s < 4 && r == 0; s++) {
            int i = w->idx[w->at[4 + s]];
            size_t n = t->desc[i].numel;
            r = be->fold(t->be, p[4 + s], lgs[s], n, m->idle[i]);
            m->idle[i] = false;
            if (r == 0 && t->exact)
                r = be->chunk_sumsq(t->be, p[4 + s], n, SHARD_FLOATS, t->part + t->part_first[i]);
        }
    }
    if (r == 0) r = grads_norm(t, p, 4, w, 4, norm);
    return train_settle(t, r);
}

/* x2, ln2 and the route of block k from a[k], its weights fetched for it. */
static int route(struct trainer *t, int k)
{
    struct wave w;
    void *p[WAVE_MAX];
    wave_attn(t, k, false, &w);
    int r = train_wave_fetch(t, &w, ZINF_TIER_DEVICE, p);
    if (r < 0) return r;
    widen(t, &w, p, GPT_FC_W + 1);
    r = train_settle(t, attn_and_route(t, p, GPT_FC_W + 1));
    int x = train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
    return r < 0 ? r : x;
}

/* Local expert j's forward on every source's rows (its weights at p). */
static int expert_forward(struct trainer *t, int j, const struct moe_ep_xfer *xf, void **p)
{
    struct train_moe *m = t->moe;
    int r = 0;
    for (int src = 0; src < m->ep.ep && r == 0; src++) {
        struct moe_ep_rows rw;
        if (moe_ep_rows(&m->mc, &m->ep, xf, src, j, &rw) > 0)
            r = t->be->moe->expert_forward(t->be, (const void *const *)p, rw.n,
                                           dev_at(&m->recv, xf->recv, rw.in),
                                           dev_at(&m->send, xf->send, rw.out));
    }
    return train_settle(t, r);
}

/* Block k's experts of this rank that rows came for (after a dispatch into xf), in order:
 * each fetched (the next ones asked for ahead), run forward or backward, released; what the
 * phase reads from NVMe counted as the experts'. A failure releases xf. */
static int run_experts(struct trainer *t, int k, struct moe_ep_xfer *xf, bool backward, bool norm)
{
    struct train_moe *m = t->moe;
    struct wave w;
    void *p[WAVE_MAX];
    int n = local_used(m, xf), ahead = t->o.moe.prefetch, r = 0;
    uint64_t rd0 = nvme_read(t);
    for (int u = 0; u < ahead; u++)
        prefetch(t, k, u, n);
    for (int u = 0; u < n && r == 0; u++) {
        int j = m->local[u];
        prefetch(t, k, u + ahead, n);
        wave_expert(t, k, j, backward, &w);
        if ((r = fetch_expert(t, &w, p)) < 0) break;
        widen(t, &w, p, 4);
        r = backward ? expert_backward(t, j, xf, p, &w, norm) : expert_forward(t, j, xf, p);
        train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
        train_note_peaks(t);
    }
    if (r < 0) {
        moe_ep_xfer_release(xf);
        return r;
    }
    m->read_step += nvme_read(t) - rd0;
    return 0;
}

int train_moe_forward(struct trainer *t, int k)
{
    struct train_moe *m = t->moe;
    const size_t NC = (size_t)m->N * (size_t)t->cfg.C;
    struct wave w;
    void *p[WAVE_MAX];
    struct moe_ep_xfer xf;
    uint64_t s0 = trace_on() ? now_ns() : 0;

    if (k == t->kb) m->aux = 0; /* the first block of a forward */
    int r = route(t, k);
    if (r < 0) return r;
    m->aux += m->r.l_aux;
    if (m->aux_blk) m->aux_blk[(size_t)t->fmicro * (size_t)t->cfg.L + (size_t)k] = m->r.l_aux;
    if ((r = dispatch(t, &xf, false)) < 0) return r;
    if ((r = run_experts(t, k, &xf, false, false)) < 0) return r;
    if ((r = combine(t, &xf, false, m->y.p)) < 0) return r;
    train_moe_wave(t, k, 4, &w);
    if ((r = train_wave_fetch(t, &w, ZINF_TIER_DEVICE, p)) < 0) return r;
    r = train_settle(t, t->be->moe->add(t->be, p[0], m->x2.p, m->y.p, NC));
    int x = train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
    if (s0) trace_span_n("train", "MoE block forward", k, s0);
    return r < 0 ? r : x;
}

int train_moe_backward(struct trainer *t, int k, bool zero, bool norm)
{
    struct train_moe *m = t->moe;
    const struct backend_ops *be = t->be->ops;
    const struct backend_moe_ops *mo = t->be->moe;
    struct wave w;
    void *p[WAVE_MAX];
    struct moe_ep_xfer xf;
    uint64_t s0 = trace_on() ? now_ns() : 0;

    /* The route again, from the block's input; the gradient flowing back stays in the
     * backend (its grad), read by the dispatch and pulled back in place below. */
    int r = route(t, k);
    if (r < 0) return r;
    memset(m->dw, 0, (size_t)m->N * (size_t)m->mc.k * sizeof(float));
    if ((r = dispatch(t, &xf, true)) < 0) return r;
    if ((r = run_experts(t, k, &xf, true, norm)) < 0) return r;
    if ((r = combine(t, &xf, true, m->dln.p)) < 0) return r;
    /* The gate, ln2 and the attention half: d becomes the gradient of a[k]. */
    wave_attn(t, k, true, &w);
    if ((r = train_wave_fetch(t, &w, ZINF_TIER_DEVICE, p)) < 0) return r;
    widen(t, &w, p, GPT_FC_W + 1);
    const int G = GPT_FC_W + 1; /* the gradients' first entry */
    float *d_wg = t->exact ? m->lg_gate.p : p[G + GPT_FC_W];
    r = grads_begin(t, p, G, &w, t->exact ? GPT_FC_W : G, zero);
    if (r == 0 && t->exact)
        r = be->zero(t->be, m->lg_gate.p, train_role_bytes(t, R_L, gate_of(t, k)));
    if (r == 0)
        r = moe_gate_dlogits(&m->mc, &m->r, m->dw, t->o.moe.loss_coef * t->be->loss_scale,
                             m->dlogits);
    if (r == 0)
        r = mo->gate_backward(t->be, m->dlogits, m->ln.p, p[GPT_FC_W], m->mc.E, d_wg, m->dln.p);
    if (r == 0)
        r = mo->attn_backward(t->be, (const void *const *)p, (float *const *)(p + G), p[2 * G],
                              m->x2.p, m->dln.p, m->mean.p, m->rstd.p);
    if (r == 0) r = grads_norm(t, p, G, &w, G, norm);
    r = train_settle(t, r);
    /* Exact: the block's and the gate's local gradients reduced into their g. */
    int first = t->block_first[k];
    for (int s = 0; s < GPT_FC_W && r == 0 && t->exact; s++)
        r = train_reduce_grad(t, first + s, p[G + s], p[2 * G + 1 + s]);
    if (r == 0 && t->exact) r = train_reduce_grad(t, gate_of(t, k), d_wg, p[G + GPT_FC_W]);
    int x = train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
    if (s0) trace_span_n("train", "MoE block backward", k, s0);
    return r < 0 ? r : x;
}
