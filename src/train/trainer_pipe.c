/*
 * trainer_pipe.c - pipeline parallelism: the model's blocks cut into stages, one rank each,
 * the step's micro-batches on the 1F1B schedule, and the activations and their gradients
 * sent between neighbouring stages.
 *
 * The cut (trainer_pipe_cut.c): pipeline.stages ranks, each a contiguous run of at least one
 * block; the first holds the embeddings too, the last the final norm, the head and a copy of
 * wte (the head is tied to it).
 *
 * GPU stages: each stage is an ordinary trainer of its blocks on its own GPU (the CUDA
 * backend), and what crosses between stages lives in its device tier: the activations (R_ACT
 * tensors), the gradient flowing back (the backend's d), wte's local gradient and the norm's
 * chunk sums. It crosses through host memory, on the same shared-memory links as between CPU
 * stages: zinf_read and zinf_write copy an activation or wte's share out of and into the
 * device tier (the engine copies from or to wherever the newest copy is, and the backend has
 * finished with it: every phase ends with its sync), grad_io copies the gradient flowing
 * back (and waits for it), and the chunk sums come to the host from chunk_sumsq. That is the
 * simplest correct choice: the schedule, the messages and their order are the CPU stages'
 * unchanged, so GPU stages are bitwise one GPU rank as CPU stages are one CPU rank, and no
 * NCCL communicator per link (nor ordering of its stream with the compute stream) is needed.
 * NCCL's send and receive between the GPUs (comm/nccl.c has them) would save the two copies
 * over PCIe per message, which matters once the activations are large next to a stage's
 * compute; that is left for later. Tensor- and sequence-parallel ranks run on either: the
 * CPU's math (gpt_tp.c, gpt_sp.c) or the CUDA backend's (backend_cuda_tp.c,
 * backend_cuda_sp.c), whose collectives go over the group's NCCL link (L_TPD, L_SPD) on
 * device memory. MoE blocks run in GPU stages as in CPU ones: their balancing losses are
 * the host route's (moe_aux gathers them), the gradient they pull back is the backend's d that
 * grad_io fills and empties, and the experts' exchange between a stage's copies stages
 * through host buffers over the copies' host communicator.
 *
 * The schedule (1F1B): stage s of P runs min(P - s - 1, M) forwards, then one forward and
 * one backward in turn, then the backwards left, for the M micro-batches of the step. A
 * forward receives its input from stage s - 1 (or embeds the tokens) and sends its output to
 * stage s + 1; a backward receives the gradient of its output from stage s + 1 (or, on the
 * last stage, runs the head) and sends the gradient of its input to stage s - 1. The sends
 * are asynchronous (each link has a communicator of two ranks per direction, a broadcast
 * from the sender); the receives wait, and that wait is the schedule's bubble.
 *
 * Exactness: every micro-batch's arithmetic is one rank's; the gradients fold in the order of
 * the micro-batches; the tied wte's gradient is the head's share, sent from the last stage
 * with each micro-batch, plus the embeddings' share, added on the first stage as one rank
 * adds them, and the step's sum goes to the last stage for its copy's update (the same
 * AdamW on the same numbers: the same bits); the clipping norm adds every stage's chunk sums
 * in the whole layout's order. So P stages give bitwise the losses and weights of one rank
 * running --accumulate M.
 *
 * Data parallel: N ranks make N / P copies of the pipeline, rank d x P + s being copy d's
 * stage s; the copies of a stage are ZeRO ranks (stage 0 or 1) of their own communicator,
 * which reduce each micro-batch's gradients in rank order as ZeRO ranks do, so that copy d's
 * micro-batch m is the step's m x copies + d, and the whole is one rank of M x copies. On GPU
 * copies each round's sum is NCCL's, added to the step's (as GPU ZeRO ranks add theirs): the
 * bits of as many GPU ZeRO ranks of M micro-batches each, and of one GPU rank of M x copies
 * where M is 1.
 *
 * Not here: the cut and each rank's tensors (trainer_pipe_cut.c), ZeRO stages 2 and 3 with a
 * pipeline (refused, as DeepSpeed does), the saved runs of other layouts and their re-cut
 * onto this one (trainer_layouts.c, trainer_recut.c).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common.h"
#include "train/backend.h"
#include "train/trainer_impl.h"
#include "trace.h"

/* A message to a neighbour in flight: its buffer is the comm thread's until done. */
struct pipe_msg {
    struct comm_req q;
    struct pipe *pp;
    void *buf;
    bool busy;
};

/* The links; L_TPD and L_SPD are the tensor- and sequence-parallel groups again, over NCCL
 * on GPU ranks, for the math's collectives on device memory (L_TP and L_SP, shared memory,
 * carry the host's: the norm's sums, broadcasts, barriers). */
enum { L_FWD_IN, L_FWD_OUT, L_BWD_IN, L_BWD_OUT, L_WTE, L_ALL, L_TP, L_SP, L_TPD, L_SPD, L_COUNT };

struct pipe {
    struct comm *c[L_COUNT]; /* the links (NULL where the stage has none), then all stages */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int err;                          /* the first failed send */
    struct pipe_msg *fwd, *bwd, *wte; /* M each: activations, their gradients, wte's share */
    void *rx;                         /* a received activation or gradient */
    float *wrx;                       /* a received wte gradient (V,C) */
    size_t act_bytes, wte_bytes;
    int M;
    /* The norm's chunk sums of every stage, in stage order: counts, and the padded gather;
     * of each stage's count, the first dense[q] are its dense tensors', the rest its MoE
     * blocks' gates' and experts' (which the whole layout puts after every dense one). */
    int32_t counts[COMM_MAX_RANKS], dense[COMM_MAX_RANKS], own_dense;
    size_t maxn, own_parts, mine_n;
    double *mine, *all;
    double *tsum; /* tensor parallel: every rank's sum per tensor */
    /* Time in each stage's forwards and backwards (compute, sends), and the steps' span. */
    uint64_t busy_ns, span_ns, wait_ns;
};

#define CHECK(x)                                                                                   \
    do {                                                                                           \
        int r_ = (x);                                                                              \
        if (r_ < 0) return r_;                                                                     \
    } while (0)

static const char *const link_name[L_COUNT] = {"pf", "pf", "pb", "pb", "pw",
                                                "pp", "tp", "sp", "tpd", "spd"};

/* ---- the stages meet --------------------------------------------------------------- */

static int open_link(struct trainer *t, int which, int id, int rank, int world, bool cuda,
                     char *err, size_t errlen)
{
    const struct trainer_opts *o = &t->o;
    char name[COMM_NAME_BYTES], cwhy[300] = "";
    /* Host buffers on every link, GPU or not (the shared-memory backend), but the math's
     * own on GPU ranks (cuda: L_TPD, L_SPD), which hold device memory: NCCL. */
    /* Copy d's links of tensor-parallel rank R: name.pfS.d.R (S the link's first stage),
     * name.pw.d.R, name.pp.d.R; its stage's tensor-parallel group: name.tp.d.S. */
    int in = t->tr + t->sq; /* the rank within the stage (one of them is 0) */
    int n = id < 0 ? snprintf(name, sizeof(name), "%s.%s.%d.%d", o->comm_name, link_name[which],
                              t->rank, which >= L_TP ? t->ps : in)
                   : snprintf(name, sizeof(name), "%s.%s%d.%d.%d", o->comm_name, link_name[which],
                              id, t->rank, in);
    if (n < 0 || (size_t)n >= sizeof(name)) {
        snprintf(err, errlen,
                 "the rendezvous name '%s' is too long for the pipeline's links "
                 "(name.pfN): give zinf launch a shorter --name",
                 o->comm_name);
        return -EINVAL;
    }
    struct comm_opts co = {.backend = cuda ? COMM_NCCL : COMM_SHM,
                           .cuda_device = t->zc.zinf.cuda_device,
                           .rank = rank,
                           .world = world,
                           .name = name,
                           .secret = o->comm_secret,
                           .timeout_ms = o->comm_timeout_ms,
                           .op_timeout_ms = o->comm_op_timeout_ms ? o->comm_op_timeout_ms
                                                                  : t->zc.zinf.comm_timeout * 1000u,
                           .stop = o->stop,
                           .why = cwhy,
                           .why_len = sizeof(cwhy)};
    int r = comm_open(&co, &t->pipe->c[which]);
    if (r < 0)
        snprintf(err, errlen, "stage %d of %d: the stages could not meet as '%s': %s%s", t->ps,
                 t->pp, name, cwhy[0] ? cwhy : zinf_strerror(r),
                 r == -ETIMEDOUT ? " (a stage did not start, or failed before it met the others)"
                                 : "");
    return r;
}

/* The math's collectives (gpt_tp.h, gpt_sp.h; ctx: the trainer), on the backend's memory:
 * host memory over L_TP or L_SP on the CPU, device memory over L_TPD or L_SPD on GPU ranks,
 * where the collective's stream first waits for the backend's coll_wait (its compute stream
 * up to the call). Each returns once the result is in place. */
static int math_coll(void *ctx, int which, enum comm_op op, const float *send, float *recv,
                     size_t count)
{
    struct trainer *t = ctx;
    struct comm *c = t->pipe->c[which + (L_TPD - L_TP)];
    struct comm_req q = {.op = op,
                         .dtype = COMM_F32,
                         .send = send,
                         .recv = recv,
                         .count = count,
                         .wait_event = c && t->be ? t->be->coll_wait : NULL};
    return comm_run(c ? c : t->pipe->c[which], &q);
}

static int tp_allreduce(void *ctx, float *buf, size_t count)
{
    return math_coll(ctx, L_TP, COMM_ALLREDUCE, buf, buf, count);
}

static int tp_allgather(void *ctx, const float *send, float *recv, size_t count)
{
    return math_coll(ctx, L_TP, COMM_ALLGATHER, send, recv, count);
}

static int sp_alltoall(void *ctx, const float *send, float *recv, size_t count)
{
    return math_coll(ctx, L_SP, COMM_ALLTOALL, send, recv, count);
}

int train_sp_sum(struct trainer *t, float *l, size_t n)
{
    if (t->sp <= 1) return 0;
    return comm_allreduce(t->pipe->c[L_SP], l, l, n, COMM_F32);
}

int train_sp_grad_sum(struct trainer *t, float *l, size_t n)
{
    if (t->sp <= 1) return 0;
    struct comm *c = t->pipe->c[L_SPD];
    return comm_allreduce(c ? c : t->pipe->c[L_SP], l, l, n, COMM_F32);
}

int train_pipe_setup(struct trainer *t, bool cuda, char *err, size_t errlen)
{
    const struct trainer_opts *o = &t->o;
    if (!o->comm_name || !o->comm_name[0]) {
        snprintf(err, errlen,
                 "pipeline stages and tensor-parallel ranks: no rendezvous name "
                 "(ZINF_COMM_NAME): start them with zinf launch");
        return -ENOTSUP;
    }
    /* Each stage keeps its tensors in a folder of its own under each nvme path (and its
     * copies, ZeRO ranks, theirs in rank-R-of-N under that). */
    for (unsigned k = 0; k < t->zc.nvme_paths.count && !t->remote; k++) {
        size_t n = strlen(t->zc.nvme_paths.path[k]) + 48;
        char *mine = malloc(n);
        if (!mine) return -ENOMEM;
        const char *kind = t->tp > 1 ? "tp" : "sp";
        int in = t->tp > 1 ? t->tr : t->sq, of = t->tp * t->sp;
        if (of == 1)
            snprintf(mine, n, "%s/stage-%d-of-%d", t->zc.nvme_paths.path[k], t->ps, t->pp);
        else if (t->pp == 1)
            snprintf(mine, n, "%s/%s-%d-of-%d", t->zc.nvme_paths.path[k], kind, in, of);
        else
            snprintf(mine, n, "%s/stage-%d-of-%d.%s-%d-of-%d", t->zc.nvme_paths.path[k], t->ps,
                     t->pp, kind, in, of);
        if (t->world == 1)
            t->base[t->nbase++] = t->zc.nvme_paths.path[k];
        else /* the copies' base is the stage's folder: the path as given is the root */
            t->root[k] = t->zc.nvme_paths.path[k];
        t->zc.nvme_paths.path[k] = mine;
        if (k) t->zc.nvme_paths_extra[k - 1] = mine;
    }
    struct pipe *p = calloc(1, sizeof(*p));
    if (!p) return -ENOMEM;
    t->pipe = p;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    int s = t->ps, P = t->pp, r;
    /* The tensor-parallel group, every stage, then the links in their order (stage s meets
     * s - 1, then s + 1), then the first and the last stage: no two ranks wait for each other
     * in opposite orders. */
    if (t->tp > 1) {
        if ((r = open_link(t, L_TP, -1, t->tr, t->tp, false, err, errlen)) < 0 ||
            (cuda && (r = open_link(t, L_TPD, -1, t->tr, t->tp, true, err, errlen)) < 0))
            return r;
        t->tpc.ctx = t;
        t->tpc.allreduce = tp_allreduce;
        t->tpc.allgather = tp_allgather;
    }
    if (t->sp > 1) {
        if ((r = open_link(t, L_SP, -1, t->sq, t->sp, false, err, errlen)) < 0 ||
            (cuda && (r = open_link(t, L_SPD, -1, t->sq, t->sp, true, err, errlen)) < 0))
            return r;
        t->spc.ctx = t;
        t->spc.alltoall = sp_alltoall;
    }
    if (P == 1) return 0;
    if ((r = open_link(t, L_ALL, -1, s, P, false, err, errlen)) < 0) return r;
    if (s > 0 && ((r = open_link(t, L_FWD_IN, s - 1, 1, 2, false, err, errlen)) < 0 ||
                  (r = open_link(t, L_BWD_OUT, s - 1, 1, 2, false, err, errlen)) < 0))
        return r;
    if (s < P - 1 && ((r = open_link(t, L_FWD_OUT, s, 0, 2, false, err, errlen)) < 0 ||
                      (r = open_link(t, L_BWD_IN, s, 0, 2, false, err, errlen)) < 0))
        return r;
    if ((s == 0 || s == P - 1) &&
        (r = open_link(t, L_WTE, -1, s == 0 ? 0 : 1, 2, false, err, errlen)) < 0)
        return r;
    return 0;
}

static void msg_done(struct comm_req *q, int res)
{
    struct pipe_msg *m = q->data;
    struct pipe *p = m->pp;
    pthread_mutex_lock(&p->mu);
    m->busy = false;
    if (res < 0 && !p->err) p->err = res;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static int alloc_msgs(struct pipe *p, struct pipe_msg **out, int n, size_t bytes)
{
    if (!(*out = calloc((size_t)n, sizeof(**out)))) return -ENOMEM;
    for (int k = 0; k < n; k++) {
        (*out)[k].pp = p;
        if (!((*out)[k].buf = malloc(bytes))) return -ENOMEM;
    }
    return 0;
}

/* Expert parallel (the copies hold E / ep experts of each MoE block each): into out, the
 * MoE blocks' chunk sums in the whole layout's order, each gate's (from mine, where its
 * owners' shards put them) then its E experts', expert e's from copy e / (E/ep), which holds
 * it at the place of its local number (every copy's layout has the same shape; all: the
 * copies' gathered chunk sums, np a copy's); their number (out NULL: only counted). */
static size_t moe_norm(struct trainer *t, double *out, const double *all, size_t np)
{
    int Epr = t->o.moe.E / MAX(1, t->ep);
    size_t n = 0;
    for (int i = 0; i < t->ntensors; i++) {
        const struct gpt_tensor_desc *d = &t->desc[i];
        if (d->block < 0 || d->slot != GPT_BLOCK_NSLOTS) continue; /* gates only */
        size_t gc = (d->numel + SHARD_FLOATS - 1) / SHARD_FLOATS;
        size_t per = train_shard_of(t, i) / SHARD_FLOATS;
        for (size_t c = 0; c < gc; c++, n++)
            if (out) out[n] = all[(c / per) * np + t->part_first[i] + c];
        for (int e = 0; e < t->o.moe.E; e++)
            for (int q = 0; q < 4; q++) {
                int x = i + 1 + 4 * (e % Epr) + q;
                size_t xc = (t->desc[x].numel + SHARD_FLOATS - 1) / SHARD_FLOATS;
                for (size_t c = 0; c < xc; c++, n++)
                    if (out) out[n] = all[(size_t)(e / Epr) * np + t->part_first[x] + c];
            }
    }
    return n;
}

int train_pipe_alloc(struct trainer *t)
{
    struct pipe *p = t->pipe;
    if (!p) return 0;
    p->M = MAX(1, t->o.grad_accum);
    p->act_bytes = train_role_bytes(t, R_ACT, 0);
    p->wte_bytes = t->wte >= 0 ? t->desc[t->wte].numel * sizeof(float) : 0;
    int r;
    if (!(p->rx = malloc(p->act_bytes))) return -ENOMEM;
    if (p->c[L_FWD_OUT] && (r = alloc_msgs(p, &p->fwd, p->M, p->act_bytes)) < 0) return r;
    if (p->c[L_BWD_OUT] && (r = alloc_msgs(p, &p->bwd, p->M, p->act_bytes)) < 0) return r;
    if (t->wte_copy >= 0 && (r = alloc_msgs(p, &p->wte, p->M, p->wte_bytes)) < 0) return r;
    if (t->ps == 0 && !(p->wrx = malloc(p->wte_bytes))) return -ENOMEM;
    /* What this stage adds to the norm: its chunk sums, all but its copy of wte's (the last);
     * with tensor-parallel ranks, a sum per tensor over the ranks' slices. */
    p->own_parts = t->nparts;
    if (t->wte_copy >= 0) p->own_parts = t->part_first[t->wte_copy];
    if (t->tp > 1) {
        p->own_parts = (size_t)(t->wte_copy >= 0 ? t->wte_copy : t->ntensors);
        if (!(p->tsum = calloc(p->own_parts * (size_t)t->tp, sizeof(double)))) return -ENOMEM;
    }
    int32_t mine[2] = {(int32_t)p->own_parts, (int32_t)p->own_parts}, both[2 * COMM_MAX_RANKS];
    for (int i = 0; i < t->ntensors && t->tp == 1; i++)
        if (t->desc[i].block >= 0 && t->desc[i].slot == GPT_BLOCK_NSLOTS) { /* a MoE gate */
            mine[1] = (int32_t)t->part_first[i];
            break;
        }
    /* Expert parallel: the MoE blocks' part holds every expert's chunks, each copy's own. */
    if (t->ep > 1) mine[0] = mine[1] + (int32_t)moe_norm(t, NULL, NULL, 0);
    p->counts[0] = mine[0];
    p->dense[0] = p->own_dense = mine[1];
    if (t->pp > 1 && (r = comm_allgather(p->c[L_ALL], mine, both, sizeof(mine), COMM_BYTE)) < 0)
        return r;
    for (int q = 0; q < t->pp && t->pp > 1; q++) {
        p->counts[q] = both[2 * q];
        p->dense[q] = both[2 * q + 1];
    }
    p->maxn = 1;
    for (int q = 0; q < t->pp; q++)
        p->maxn = MAX(p->maxn, (size_t)p->counts[q]);
    p->mine_n = MAX(MAX(p->maxn, t->nparts), (size_t)mine[0]);
    p->mine = calloc(p->mine_n, sizeof(double));
    p->all = calloc(p->maxn * (size_t)t->pp, sizeof(double));
    return p->mine && p->all ? 0 : -ENOMEM;
}

int train_pipe_bcast(struct trainer *t, void *buf, size_t bytes)
{
    return t->pipe ? comm_broadcast(t->pipe->c[L_ALL], buf, bytes, COMM_BYTE, 0) : 0;
}

int train_group_bcast(struct trainer *t, void *buf, size_t bytes)
{
    struct comm *c = t->pipe ? t->pipe->c[t->tp > 1 ? L_TP : L_SP] : NULL;
    return c ? comm_broadcast(c, buf, bytes, COMM_BYTE, 0) : 0;
}

void train_pipe_close(struct trainer *t)
{
    struct pipe *p = t->pipe;
    free(t->gidx);
    free(t->gdesc);
    free(t->priv);
    t->priv = NULL;
    t->gidx = NULL;
    t->gdesc = NULL;
    for (unsigned k = 0; k < CONFIG_MAX_NVME_PATHS; k++) {
        free(t->root[k]);
        t->root[k] = NULL;
    }
    if (!p) return;
    /* The communicators first: they end (fail) what is in flight before the buffers go. */
    for (int k = 0; k < L_COUNT; k++)
        comm_close(p->c[k]);
    struct pipe_msg *sets[] = {p->fwd, p->bwd, p->wte};
    for (size_t s = 0; s < ARRAY_SIZE(sets); s++) {
        for (int k = 0; sets[s] && k < p->M; k++)
            free(sets[s][k].buf);
        free(sets[s]);
    }
    free(p->rx);
    free(p->wrx);
    free(p->mine);
    free(p->all);
    free(p->tsum);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
    t->pipe = NULL;
}

/* ---- sends and receives -------------------------------------------------------------- */

/* Message m (its buffer filled) goes to the link's other rank, root the sender. */
static int send_async(struct pipe *p, int link, int root, struct pipe_msg *m, size_t bytes)
{
    m->q = (struct comm_req){.op = COMM_BROADCAST,
                             .dtype = COMM_BYTE,
                             .recv = m->buf,
                             .count = bytes,
                             .root = root,
                             .cb = msg_done,
                             .data = m};
    pthread_mutex_lock(&p->mu);
    m->busy = true;
    pthread_mutex_unlock(&p->mu);
    int r = comm_submit(p->c[link], &m->q);
    if (r < 0) {
        pthread_mutex_lock(&p->mu);
        m->busy = false;
        pthread_mutex_unlock(&p->mu);
    }
    return r;
}

/* Waits until no message of the set is in flight; the first failure of any send. */
static int wait_sent(struct pipe *p, const struct pipe_msg *set, int n)
{
    pthread_mutex_lock(&p->mu);
    for (int k = 0; set && k < n; k++)
        while (set[k].busy)
            pthread_cond_wait(&p->cv, &p->mu);
    int r = p->err;
    pthread_mutex_unlock(&p->mu);
    return r;
}

static int recv_sync(struct trainer *t, int link, int root, void *buf, size_t bytes)
{
    uint64_t t0 = now_ns();
    int r = comm_broadcast(t->pipe->c[link], buf, bytes, COMM_BYTE, root);
    uint64_t dt = now_ns() - t0;
    t->pipe->wait_ns += dt;
    if (trace_on()) trace_span("train", "pipeline wait", t0, NULL, NULL, -1);
    return r;
}

/* The head's share of wte's gradient for this micro-batch, to the first stage. */
static int wte_share_out(struct trainer *t, int m)
{
    struct pipe *p = t->pipe;
    struct pipe_msg *msg = &p->wte[m];
    int r = zinf_read(t->e, train_wave_handle(t, R_L, t->wte), 0, msg->buf, p->wte_bytes);
    return r < 0 ? r : send_async(p, L_WTE, 1, msg, p->wte_bytes);
}

/* The first stage, before its embeddings' backward: the local gradient of wte starts as the
 * head's share, as one rank's does. */
int train_pipe_wte_in(struct trainer *t)
{
    struct pipe *p = t->pipe;
    int r = recv_sync(t, L_WTE, 1, p->wrx, p->wte_bytes);
    return r < 0 ? r : zinf_write(t->e, train_wave_handle(t, R_L, t->wte), 0, p->wrx, p->wte_bytes);
}

/* The step's gradient of wte, from the first stage to the last's copy. */
int train_pipe_wte_out(struct trainer *t)
{
    struct pipe *p = t->pipe;
    if (!p || t->pp == 1) return 0;
    int r;
    if (t->ps == 0) {
        if ((r = zinf_read(t->e, t->g[t->wte], 0, p->wrx, p->wte_bytes)) < 0) return r;
        return comm_broadcast(p->c[L_WTE], p->wrx, p->wte_bytes, COMM_BYTE, 0);
    }
    if (t->wte_copy < 0) return 0;
    float *buf = p->wte[0].buf; /* every share has been sent (the queue is in order) */
    if ((r = comm_broadcast(p->c[L_WTE], buf, p->wte_bytes, COMM_BYTE, 0)) < 0) return r;
    return zinf_write(t->e, t->g[t->wte_copy], 0, buf, p->wte_bytes);
}

/* ---- the schedule ------------------------------------------------------------------- */

static int micro_setup(struct trainer *t, int step, int m)
{
    t->act_base = (m % t->nslots) * (t->cfg.L + 1);
    /* Copy d's m-th is the step's micro-batch m x copies + d (as ZeRO ranks number theirs). */
    train_load_batch(t, step, m * t->world + t->rank);
    return t->be->ops->set_batch(t->be, t->tokens, t->targets);
}

static int pipe_forward(struct trainer *t, int step, int m)
{
    struct pipe *p = t->pipe;
    CHECK(micro_setup(t, step, m));
    t->fmicro = m;
    if (t->ps > 0) {
        CHECK(recv_sync(t, L_FWD_IN, 0, p->rx, p->act_bytes));
        CHECK(zinf_write(t->e, t->act[t->act_base + t->kb], 0, p->rx, p->act_bytes));
    }
    uint64_t t0 = now_ns();
    CHECK(train_forward(t));
    if (t->ps < t->pp - 1) {
        struct pipe_msg *msg = &p->fwd[m];
        CHECK(zinf_read(t->e, t->act[t->act_base + t->ke], 0, msg->buf, p->act_bytes));
        CHECK(send_async(p, L_FWD_OUT, 0, msg, p->act_bytes));
    }
    p->busy_ns += now_ns() - t0;
    trace_span_n("train", "stage forward", m, t0);
    return 0;
}

static int pipe_backward(struct trainer *t, int step, int m, float *loss)
{
    struct pipe *p = t->pipe;
    const struct backend_ops *be = t->be->ops;
    CHECK(micro_setup(t, step, m));
    t->micro = m;
    t->last_micro = m == p->M - 1;
    if (t->ps < t->pp - 1) {
        CHECK(recv_sync(t, L_BWD_IN, 1, p->rx, p->act_bytes));
        CHECK(be->grad_io(t->be, p->rx, true));
    }
    uint64_t t0 = now_ns();
    if (t->ps == t->pp - 1) {
        CHECK(train_head(t, true, false, true));
        CHECK(wte_share_out(t, m));
    }
    CHECK(train_backward(t, true, false));
    if (t->ps > 0) {
        struct pipe_msg *msg = &p->bwd[m];
        CHECK(be->grad_io(t->be, msg->buf, false));
        CHECK(send_async(p, L_BWD_OUT, 1, msg, p->act_bytes));
    }
    double ss;
    CHECK(be->collect(t->be, loss, &ss));
    CHECK(train_sp_sum(t, loss, 1)); /* each rank's positions' share of the mean */
    p->busy_ns += now_ns() - t0;
    trace_span_n("train", "stage backward", m, t0);
    return 0;
}

/* MoE blocks: each micro-batch's loss adds loss_coef x its l_aux summed over every stage's
 * blocks in block order (the others' entries are zeros, which add nothing), as one rank adds
 * them in its forward. */
static int moe_aux(struct trainer *t, int M)
{
    struct pipe *p = t->pipe;
    const size_t ML = (size_t)M * (size_t)t->cfg.L;
    float *all = malloc(ML * (size_t)t->pp * sizeof(float)),
          *aux = malloc((size_t)M * sizeof(float));
    int r = all && aux ? comm_allgather(p->c[L_ALL], train_moe_aux_blocks(t), all,
                                        ML * sizeof(float), COMM_BYTE)
                       : -ENOMEM;
    for (int m = 0; m < M && r == 0; m++) {
        aux[m] = 0;
        for (int k = 0; k < t->cfg.L; k++) {
            float v = 0;
            for (int s = 0; s < t->pp; s++)
                v += all[(size_t)s * ML + (size_t)m * (size_t)t->cfg.L + (size_t)k];
            aux[m] += v;
        }
    }
    if (r == 0) train_moe_pipe_aux(t, aux, M);
    free(all);
    free(aux);
    return r;
}

int train_pipe_sum_u64(struct trainer *t, uint64_t *v, int n)
{
    if (!t->pipe || t->pp <= 1) return 0;
    uint64_t *all = malloc(sizeof(uint64_t) * (size_t)n * (size_t)t->pp);
    if (!all) return -ENOMEM;
    int r = comm_allgather(t->pipe->c[L_ALL], v, all, sizeof(uint64_t) * (size_t)n, COMM_BYTE);
    for (int j = 0; j < n && r == 0; j++) {
        v[j] = 0;
        for (int s = 0; s < t->pp; s++)
            v[j] += all[(size_t)s * (size_t)n + (size_t)j];
    }
    free(all);
    return r;
}

int train_pipe_step(struct trainer *t, int step, double *loss_sum)
{
    struct pipe *p = t->pipe;
    int M = p->M, P = t->pp, s = t->ps, warm = MIN(P - s - 1, M), f = 0, b = 0, r = 0;
    uint64_t t0 = now_ns();
    memset(t->losses, 0, sizeof(float) * (size_t)M);
    while (r == 0 && f < warm)
        r = pipe_forward(t, step, f++);
    while (r == 0 && f < M) {
        if ((r = pipe_forward(t, step, f++)) == 0) r = pipe_backward(t, step, b, &t->losses[b]);
        b++;
    }
    while (r == 0 && b < M) {
        r = pipe_backward(t, step, b, &t->losses[b]);
        b++;
    }
    /* Every send has landed before the buffers are written again (next step) and before the
     * step's wte goes to the last stage behind this stage's shares. */
    int x = wait_sent(p, p->fwd, M);
    if (r == 0) r = x;
    x = wait_sent(p, p->bwd, M);
    if (r == 0) r = x;
    x = wait_sent(p, p->wte, M);
    if (r == 0) r = x;
    p->span_ns += now_ns() - t0;
    if (r < 0) return r;
    /* The losses are the last stage's; every stage reports them. */
    CHECK(comm_broadcast(p->c[L_ALL], t->losses, (size_t)M, COMM_F32, P - 1));
    if (t->moe) CHECK(moe_aux(t, M));
    *loss_sum = 0;
    for (int m = 0; m < M; m++)
        *loss_sum += t->losses[m];
    return train_pipe_wte_out(t);
}

/* ---- the stages' agreements ----------------------------------------------------------- */

/* Every stage's chunk sums, added in the whole layout's order (the stages' order). */
int train_pipe_norm(struct trainer *t, double *sumsq)
{
    struct pipe *p = t->pipe;
    const double *all = t->part;
    size_t np = t->nparts;
    int r;
    memset(p->mine, 0, p->mine_n * sizeof(double));
    if (t->world > 1) { /* each chunk from the copy that owns it, as train_grad_norm */
        if ((r = comm_allgather(t->hcomm, t->part, t->part_all, np * sizeof(double), COMM_BYTE)) <
            0)
            return r;
        all = t->part_all;
    }
    for (int i = 0; i < t->ntensors; i++) {
        if (i == t->wte_copy || train_private(t, i)) continue;
        size_t chunks = (t->desc[i].numel + SHARD_FLOATS - 1) / SHARD_FLOATS;
        size_t per = train_shard_of(t, i) / SHARD_FLOATS;
        for (size_t c = 0; c < chunks; c++) {
            size_t owner = t->world > 1 ? c / per : 0;
            p->mine[t->part_first[i] + c] = all[owner * np + t->part_first[i] + c];
        }
    }
    /* Expert parallel: the MoE blocks' part, every expert's from its owner, in order. */
    if (t->ep > 1) moe_norm(t, p->mine + p->own_dense, all, np);
    if (t->tp > 1) {
        /* Each tensor's sum over its slices, added over the ranks in their order; a
         * replicated tensor (the same on every rank) counted once, rank 0's. */
        size_t n = p->own_parts;
        double *sums = p->tsum + (size_t)t->tr * n;
        for (size_t i = 0; i < n; i++) {
            size_t chunks = (t->desc[i].numel + SHARD_FLOATS - 1) / SHARD_FLOATS;
            double s = 0;
            for (size_t c = 0; c < chunks; c++)
                s += p->mine[t->part_first[i] + c];
            sums[i] = t->tr == 0 || train_tp_sliced(t, (int)i) ? s : 0;
        }
        if ((r = comm_allgather(p->c[L_TP], sums, p->tsum, n * sizeof(double), COMM_BYTE)) < 0)
            return r;
        memset(p->mine, 0, p->maxn * sizeof(double));
        for (int q = 0; q < t->tp; q++)
            for (size_t i = 0; i < n; i++)
                p->mine[i] += p->tsum[(size_t)q * n + i];
    }
    if (t->pp == 1) {
        double s = 0;
        for (size_t c = 0; c < p->own_parts; c++)
            s += p->mine[c];
        *sumsq = s;
        return 0;
    }
    r = comm_allgather(p->c[L_ALL], p->mine, p->all, p->maxn * sizeof(double), COMM_BYTE);
    if (r < 0) return r;
    /* In the whole layout's order: every stage's dense tensors, then every stage's MoE
     * blocks' tensors. */
    double s = 0;
    for (int q = 0; q < t->pp; q++)
        for (int c = 0; c < p->dense[q]; c++)
            s += p->all[(size_t)q * p->maxn + (size_t)c];
    for (int q = 0; q < t->pp; q++)
        for (int c = p->dense[q]; c < p->counts[q]; c++)
            s += p->all[(size_t)q * p->maxn + (size_t)c];
    *sumsq = s;
    return 0;
}

/* *d = the sum of every rank's of the group (none: as it is). */
static int sum_over(struct comm *c, int n, uint64_t *d)
{
    uint64_t all[COMM_MAX_RANKS];
    if (!c) return 0;
    int r = comm_allgather(c, d, all, sizeof(uint64_t), COMM_BYTE);
    if (r == 0) {
        *d = 0;
        for (int k = 0; k < n; k++)
            *d += all[k];
    }
    return r;
}

int train_pipe_digest(struct trainer *t, uint64_t *d)
{
    int r = sum_over(t->pipe->c[L_TP], t->tp, d);
    return r < 0 ? r : sum_over(t->pipe->c[L_ALL], t->pp, d);
}

static bool any_over(struct comm *c, int n, bool mine)
{
    uint8_t me = mine, all[COMM_MAX_RANKS];
    if (!c) return mine;
    if (comm_allgather(c, &me, all, 1, COMM_BYTE) < 0) return true;
    for (int q = 0; q < n; q++)
        if (all[q]) return true;
    return false;
}

bool train_pipe_any(struct trainer *t, bool mine)
{
    bool any = any_over(t->pipe->c[L_SP], t->sp, any_over(t->pipe->c[L_TP], t->tp, mine));
    return any_over(t->pipe->c[L_ALL], t->pp, any);
}

void train_pipe_summary(struct trainer *t, struct trainer_summary *out)
{
    out->pp = t->pp;
    out->pp_stage = t->ps;
    out->tp = t->tp;
    out->tp_rank = t->tr;
    out->sp = t->sp;
    out->sp_rank = t->sq;
    out->seq_local = t->o.seq / MAX(1, t->sp);
    out->first_block = t->kb;
    out->blocks = t->ke - t->kb;
    struct pipe *p = t->pipe;
    if (!p) return;
    int M = p->M, P = t->pp;
    out->pipeline_bubble_ideal = (double)(P - 1) / (double)(M + P - 1);
    out->pipeline_bubble = p->span_ns ? 1.0 - (double)p->busy_ns / (double)p->span_ns : 0;
    out->pipeline_wait_seconds = (double)p->wait_ns / 1e9;
    for (int k = 0; k < L_COUNT; k++) {
        struct comm_stats cs;
        if (!p->c[k]) continue;
        comm_get_stats(p->c[k], &cs);
        out->pipeline_bytes += cs.bytes_out;
    }
}

/* Every rank of the run has come: the copies of this rank (ZeRO), then its stage's tensor-
 * or sequence-parallel group, then its copy's stages; each barrier's ranks passed the one
 * before, so once through the last, every rank of the world has come to the first. */
int train_barrier_all(struct trainer *t)
{
    int r = t->world > 1 ? comm_barrier(t->hcomm) : 0;
    for (int k = L_TP; k <= L_SP && r == 0 && t->pipe; k++)
        if (t->pipe->c[k]) r = comm_barrier(t->pipe->c[k]);
    if (r == 0 && t->pipe && t->pipe->c[L_ALL]) r = comm_barrier(t->pipe->c[L_ALL]);
    return r;
}
