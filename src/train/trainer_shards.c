/*
 * trainer_shards.c - ZeRO across ranks: which rank owns which part of each tensor (shards,
 * and stages: what is 1/world per rank), the gathers of stage 3's weights and the
 * reductions of gradients into their owners (in the order of the micro-batches' numbers, so
 * that N ranks of A give bitwise what one rank of N x A does: see train_reduce_req), the
 * asynchronous ones that overlap the compute, the gradient norm summed by fixed chunks, and
 * the communicator's setup and the ranks' agreements (on the run, on an error, on the
 * digest).
 *
 * Not here: the sets that pin the buffers (trainer_step.c), the update of the rank's own
 * shards (trainer_optim.c), re-cutting a run saved by another number of ranks
 * (trainer_resume.c).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common.h"
#include "config.h"
#include "train/adamw.h"
#include "train/backend.h"
#include "train/onebit.h"
#include "train/trainer_impl.h"
#include "trace.h"

static int fold_grad(struct trainer *t, int i, const float *src, float *g, size_t count);

/* An asynchronous collective of the set finished (the comm's thread): count it, and keep
 * the first error for wave_release. */
static void async_done(struct trainer *t, int res)
{
    pthread_mutex_lock(&t->gmu);
    if (res < 0 && !t->gerr) t->gerr = res;
    t->gpending--;
    pthread_cond_broadcast(&t->gcv);
    pthread_mutex_unlock(&t->gmu);
}

void train_gather_done(struct comm_req *req, int res)
{
    async_done(req->data, res);
}

/* A block's gradient reduced behind the next block's backward: folded into g here, on the
 * comm's thread, while the main thread computes (wave_release waits for it), where the
 * backend's folds may run on any thread (the CPU's); on a GPU, wave_release folds it on the
 * main thread, into the compute stream, once the reduction is done. */
void train_reduce_done(struct comm_req *req, int res)
{
    struct reduce_ctx *x = req->data;
    if (res == 0 && x->t->be->any_thread) res = fold_grad(x->t, x->idx, req->recv, x->g, x->count);
    async_done(x->t, res);
}

/* The folds of the reductions that ran behind this set's compute, where the backend wants
 * them on the main thread; n: how many the set submitted. */
int train_fold_behind(struct trainer *t, int n)
{
    int r = 0;
    for (int q = 0; q < n && r == 0 && !t->be->any_thread; q++) {
        struct reduce_ctx *x = &t->rq[q];
        if ((r = t->be->ops->wait(t->be, x->done)) == 0)
            r = fold_grad(t, x->idx, x->req.recv, x->g, x->count);
    }
    return r;
}

/* Queue the async collective of request q (its callback set); a refused one counts as done
 * with its error. */
int train_submit_async(struct trainer *t, struct comm_req *q)
{
    pthread_mutex_lock(&t->gmu);
    t->gpending++;
    pthread_mutex_unlock(&t->gmu);
    int x = comm_submit(t->comm, q);
    if (x < 0) q->cb(q, x); /* the callback never fires: count it here */
    return x;
}

/* ---- ZeRO partitions ---------------------------------------------------------------- */

/* Floats per rank of tensor idx: its elements in world parts, each rounded up to
 * SHARD_FLOATS; rank r holds [r x shard, (r + 1) x shard) of the flattened tensor, padded
 * with zeros past its end (a small tensor lives on the first ranks). One rank: the tensor. */
bool train_private(const struct trainer *t, int idx)
{
    return t->priv && t->priv[idx];
}

size_t train_shard_of(const struct trainer *t, int idx)
{
    size_t n = t->desc[idx].numel;
    if (t->world <= 1 || train_private(t, idx)) return n;
    return align_up((n + (size_t)t->world - 1) / (size_t)t->world, SHARD_FLOATS);
}

/* The first element of tensor idx this rank holds, and how many of its shard are the
 * tensor's (the rest is padding). */
size_t train_shard_lo(const struct trainer *t, int idx)
{
    return train_private(t, idx) ? 0 : (size_t)t->rank * train_shard_of(t, idx);
}

size_t train_shard_own(const struct trainer *t, int idx)
{
    size_t n = t->desc[idx].numel, lo = train_shard_lo(t, idx);
    return lo >= n ? 0 : MIN(train_shard_of(t, idx), n - lo);
}

/* The stage tensor idx is partitioned at: stage 3 keeps the weights of fewer elements than
 * stage3_param_persistence_threshold whole on every rank (DeepSpeed's persistent
 * parameters: not worth a gather each time), as stage 2 does. */
int train_stage_of(const struct trainer *t, int idx)
{
    if (train_private(t, idx)) return 0; /* whole on its rank */
    if (t->stage >= 3 && t->persist_below && t->desc[idx].numel < (size_t)t->persist_below)
        return 2;
    return t->stage;
}

/* The bytes of tmp (train_zero_alloc): (world + 1) x the largest shard of a tensor. */
size_t train_tmp_bytes(const struct trainer *t)
{
    size_t most = 0, world = (size_t)t->world;
    int n = gpt_layout(&t->cfg, NULL, 0);
    struct gpt_tensor_desc *d = calloc((size_t)n, sizeof(*d));
    if (!d) return 0;
    gpt_layout(&t->cfg, d, (size_t)n);
    for (int i = 0; i < n; i++)
        most = MAX(most, align_up((d[i].numel + world - 1) / world, SHARD_FLOATS));
    free(d);
    return most * (world + 1) * sizeof(float);
}

int train_zero_shape(struct trainer *t, bool say, char *err, size_t errlen)
{
    const struct trainer_opts *o = &t->o;
    /* Pipeline stages: world and rank are the copies of the pipeline, over which ZeRO
     * partitions each stage's state. */
    int r = train_pipe_shape(t, err, errlen);
    if (r < 0) return r;
    if (!t->mp) {
        t->world = o->world > 1 ? o->world : 1;
        t->rank = t->world > 1 ? o->rank : 0;
    }
    /* On the GPU too: N ranks then give bitwise what one rank of N micro-batches does. */
    t->exact = t->world > 1 || o->grad_accum > 1 || t->mp;
    if (t->world == 1) return 0;
    t->stage = MAX(1, t->zc.zero.stage);
    if (!t->mp && (o->rank < 0 || o->rank >= o->world || o->world > COMM_MAX_RANKS)) {
        snprintf(err, errlen, "RANK %d is not in [0, WORLD_SIZE %d) (or WORLD_SIZE is above %d)",
                 o->rank, o->world, COMM_MAX_RANKS);
        return -EINVAL;
    }
    /* overlap_comm (DeepSpeed's default: on at stage 3 only) reduces a block at a time
     * behind the next block's backward, in a second set of local gradients: the block's
     * gradients must fit in reduce_bucket_size. */
    bool want = config_given(&t->zc, "zero_optimization.overlap_comm") ? t->zc.zero.overlap_comm
                                                                       : t->stage >= 3;
    uint64_t block = gpt_block_num_params(&t->cfg);
    /* A pipeline stage reduces each block's gradients after its backward, and so do MoE
     * blocks (their experts' exchange shares the communicator). */
    /* 1-bit Adam skips the reductions past freeze_step: they run after each block. */
    t->overlap = want && block <= t->zc.zero.reduce_bucket_size && t->pp == 1 && t->sp <= 1 &&
                 !o->moe.E && o->optimizer != TRAINER_OPT_ONEBIT;
    const char *not_with = o->moe.E   ? "MoE blocks (their experts' exchange shares the "
                                        "communicator)"
                           : t->pp > 1 ? "pipeline stages"
                           : t->sp > 1 ? "sequence-parallel ranks"
                                       : NULL;
    if (say && want && not_with && t->rank == 0)
        log_notice("zero_optimization.overlap_comm: not with %s: the gradients are reduced "
                   "after each block's backward",
                   not_with);
    else if (say && want && !t->overlap && t->rank == 0)
        log_notice("zero_optimization.overlap_comm: a block's gradients (%llu elements) exceed "
                   "reduce_bucket_size (%llu): they are reduced after the block's backward",
                   (unsigned long long)block, (unsigned long long)t->zc.zero.reduce_bucket_size);
    return 0;
}

int train_zero_setup(struct trainer *t, bool cuda, char *err, size_t errlen)
{
    const struct trainer_opts *o = &t->o;
    int r = train_zero_shape(t, true, err, errlen);
    if (r < 0 || (r = train_onebit_check(t, cuda, err, errlen)) < 0) return r;
    if (t->mp && ((r = train_pipe_setup(t, cuda, err, errlen)) < 0 || t->world == 1)) return r;
    if (t->world == 1) {
        for (unsigned k = 0; k < t->zc.nvme_paths.count; k++)
            if (!(t->base[t->nbase++] = strdup(t->zc.nvme_paths.path[k]))) return -ENOMEM;
        return 0;
    }
    /* 16-bit contributions go through the shm backend's staging areas, within one node (NCCL
     * spans the nodes itself). */
    if (o->comm_wire && !cuda && o->mpi) {
        snprintf(err, errlen,
                 "communication_data_type \"%s\": 16-bit gradient reductions of CPU ranks run "
                 "within one node; not across nodes (MPI)",
                 t->zc.train.comm_dtype);
        return -EINVAL;
    }
    const char *why = NULL;
    bool named = o->comm_name && o->comm_name[0]; /* under mpirun, rank 0 may choose one */
    /* Pipeline stages, tensor-parallel ranks: the copies of each stage's rank meet under a
     * name of their own. */
    char sname[COMM_NAME_BYTES];
    const char *cname = o->comm_name;
    if (t->mp && named) {
        int n = snprintf(sname, sizeof(sname), "%s.s%d.%d", o->comm_name, t->ps, t->tr + t->sq);
        if (n < 0 || (size_t)n + sizeof(HOST_COMM_SUFFIX) > sizeof(sname)) {
            snprintf(err, errlen,
                     "the rendezvous name '%s' is too long for the stages' copies "
                     "(name.sN.R): give zinf launch a shorter --name",
                     o->comm_name);
            return -EINVAL;
        }
        cname = sname;
    }
    if (!named && !o->mpi)
        why = "no rendezvous name (ZINF_COMM_NAME): start the ranks with zinf launch";
    else if (named && cuda && strlen(o->comm_name) + sizeof(HOST_COMM_SUFFIX) > COMM_NAME_BYTES)
        why = "the rendezvous name is too long for the ranks' host communicator (name.host): "
              "give zinf launch a shorter --name";
    if (why) {
        snprintf(err, errlen, "WORLD_SIZE %d: %s", t->world, why);
        return -ENOTSUP;
    }
    for (unsigned k = 0; k < t->zc.nvme_paths.count && !t->remote; k++) {
        char *mine = train_rank_dir(t->zc.nvme_paths.path[k], t->world, t->rank);
        if (!mine) return -ENOMEM;
        t->base[t->nbase++] = t->zc.nvme_paths.path[k];
        t->zc.nvme_paths.path[k] = mine;
        if (k) t->zc.nvme_paths_extra[k - 1] = mine;
    }
    char cwhy[400] = "";
    struct comm_opts co = {.backend = COMM_SHM,
                           .rank = t->rank,
                           .world = t->world,
                           .name = named ? cname : NULL,
                           .mpi = o->mpi,
                           .secret = o->comm_secret,
                           .timeout_ms = o->comm_timeout_ms,
                           .op_timeout_ms = o->comm_op_timeout_ms ? o->comm_op_timeout_ms
                                                                  : t->zc.zinf.comm_timeout * 1000u,
                           .stop = o->stop,
                           .why = cwhy,
                           .why_len = sizeof(cwhy)};
    /* GPU ranks: the collectives on device buffers over NCCL, on the rank's GPU, and what
     * lives on the host (losses, the norm's chunks, shards the optimizer updates on the host,
     * the agreements) over a second, shared-memory communicator. On the CPU both are one. */
    char hname[COMM_NAME_BYTES + sizeof(HOST_COMM_SUFFIX)]; /* the length is checked above */
    const char *what = "";
    if (cuda) {
        co.backend = COMM_NCCL;
        co.cuda_device = t->zc.zinf.cuda_device;
        what = " (NCCL)";
        if ((r = comm_open(&co, &t->comm)) == 0) {
            snprintf(hname, sizeof(hname), "%s%s", named ? cname : "", HOST_COMM_SUFFIX);
            co.backend = COMM_SHM;
            co.name = named ? hname : NULL; /* unnamed: rank 0 chooses this one's too */
            what = " (their host communicator)";
            r = comm_open(&co, &t->hcomm);
        }
    } else {
        /* CPU ranks: the emulated device tier's arena and the optimizer's exchange buffer
         * (tmp) come from the communicator's pool, which every rank maps, so the collectives
         * on them read the peers' buffers in place: one copy, not two through staging. */
        size_t dev = 0, tmp = 0;
        if (t->zc.zinf.comm_pool && !t->remote) {
            dev = align_up(t->zc.zinf.device_bytes ? t->zc.zinf.device_bytes : GiB, 4 * KiB);
            tmp = align_up(train_tmp_bytes(t), 4 * KiB);
            co.pool_bytes = dev + tmp;
        }
        if ((r = comm_open(&co, &t->comm)) == 0) {
            t->hcomm = t->comm;
            int e = 0;
            if (dev && !(t->zc.device_arena = comm_alloc(t->comm, dev, &e))) r = e;
            t->zc.device_arena_bytes = dev;
            if (r == 0 && tmp && !(t->tmp = comm_alloc(t->comm, tmp, &e))) r = e;
            t->tmp_pooled = t->tmp != NULL;
            if (r < 0) what = " (the pool of its device tier)";
        }
    }
    if (r < 0) {
        snprintf(err, errlen, "rank %d of %d: the ranks could not meet as '%s'%s: %s%s%s", t->rank,
                 t->world, named ? cname : "(rank 0's choice, over MPI)", what,
                 cwhy[0] ? cwhy : zinf_strerror(r),
                 r == -ETIMEDOUT ? " (a rank did not start, or failed before it met the others)"
                                 : "",
                 co.pool_bytes ? " (their shared memory holds each rank's device tier: "
                                 "\"zinf\": {\"comm_pool\": false} leaves it out)"
                               : "");
        return r;
    }
    t->gpu_ranks = cuda;
    return 0;
}

/* The buffers of exact accumulation and of the collectives, once the layout is known. */
int train_zero_alloc(struct trainer *t)
{
    if (t->o.optimizer == TRAINER_OPT_LAMB) {
        /* The most chunks of one tensor a rank holds, twice (|w|^2 and |u|^2). */
        size_t most = 0;
        for (int i = 0; i < t->ntensors; i++)
            most = MAX(most, t->world > 1 && !train_private(t, i)
                                 ? train_shard_of(t, i) / SHARD_FLOATS
                                 : (t->desc[i].numel + SHARD_FLOATS - 1) / SHARD_FLOATS);
        t->lamb_sums = calloc(2 * most, sizeof(double));
        t->lamb_all = calloc(2 * most * (size_t)t->world, sizeof(double));
        if (!t->lamb_sums || !t->lamb_all) return -ENOMEM;
    }
    if (!t->exact) return 0;
    if (t->ntensors < 1) return -EINVAL;
    size_t sh = 0;
    t->part_first = calloc((size_t)t->ntensors, sizeof(size_t));
    if (!t->part_first) return -ENOMEM;
    for (int i = 0; i < t->ntensors; i++) {
        t->part_first[i] = t->nparts;
        t->nparts += (t->desc[i].numel + SHARD_FLOATS - 1) / SHARD_FLOATS;
        sh = MAX(sh, train_shard_of(t, i));
    }
    t->part = calloc(t->nparts, sizeof(double));
    t->part_all = calloc(t->nparts * (size_t)t->world, sizeof(double));
    t->losses = calloc((size_t)t->o.grad_accum * (size_t)(t->world + 1), sizeof(float));
    if (t->world > 1 && !t->tmp) t->tmp = calloc(sh * (size_t)(t->world + 1), sizeof(float));
    /* overlap_comm: the events that order the reductions behind the backward with the
     * compute stream (none on the CPU). */
    int r = 0;
    for (int q = 0; q < GPT_BLOCK_NSLOTS && t->overlap && r == 0; q++)
        if ((r = t->be->ops->event_new(t->be, &t->rq[q].after)) == 0)
            r = t->be->ops->event_new(t->be, &t->rq[q].done);
    if (r < 0) return r;
    return t->part && t->part_all && t->losses && (t->world == 1 || t->tmp) ? 0 : -ENOMEM;
}

/* A resume across ranks: every rank's saved run must be at the same step (a checkpoint
 * that one rank finished and another did not is no state to go on from). */
int train_ranks_agree(struct trainer *t, char *err, size_t errlen)
{
    int32_t mine = t->step_done, all[COMM_MAX_RANKS];
    int r = comm_allgather(t->hcomm, &mine, all, sizeof(mine), COMM_BYTE);
    if (r < 0) {
        snprintf(err, errlen, "--resume: the ranks could not compare their steps: %s",
                 zinf_strerror(r));
        return r;
    }
    for (int q = 0; q < t->world; q++)
        if (all[q] != all[0]) {
            snprintf(err, errlen,
                     "--resume: the ranks' saved runs are at different steps (rank 0 at %d, "
                     "rank %d at %d): a checkpoint was cut short on some; nothing resumes "
                     "from this",
                     all[0], q, all[q]);
            return -EINVAL;
        }
    return 0;
}

static bool any_copy(struct trainer *t, bool mine);

/* Over a pipeline's stages too: the copies of each stage, then the stages. */
bool trainer_any_rank(struct trainer *t, bool mine)
{
    bool any = any_copy(t, mine);
    return t->mp ? train_pipe_any(t, any) : any;
}

static bool any_copy(struct trainer *t, bool mine)
{
    if (t->world <= 1) return mine;
    uint8_t me = mine, all[COMM_MAX_RANKS];
    if (comm_allgather(t->hcomm, &me, all, 1, COMM_BYTE) < 0) return true;
    for (int q = 0; q < t->world; q++)
        if (all[q]) return true;
    return false;
}

/* The order of a step's sum. Every micro-batch of a step has a number, 0 to world x
 * grad_accum - 1, which alone decides its data (train_load_batch), and the step's gradient
 * is their chain in that order, ((m0 + m1) + m2) + ..., whatever the split between ranks
 * and accumulation: so N ranks of A micro-batches give bitwise what one rank of N x A does,
 * and a run re-cut onto other ranks goes on bitwise as the run that never moved.
 *
 * One rank adds its micro-batches in turn (fold_grad). Across ranks, rank r's micro-batch m
 * is number m x world + r: each round of micro-batches is a run of consecutive numbers, one
 * per rank in rank order, and the round's collective adds them onto the chain's partial sum
 * that g holds, in rank order, g = ((g + rank 0's) + rank 1's) + ... (comm_req.acc: the
 * shm backend's reductions go on from recv's contents); the first round writes g itself.
 * The other orders were worse: a pairwise tree over the numbers needs log2(A) more gradient
 * buffers per rank and cross-rank sums that are trees, and fits only where the ranks are a
 * power of two; summing each rank's own micro-batches first needs whole gradients on every
 * rank from stage 2. The chain needs nothing more than one rank's accumulation, and is its
 * order to the bit, so old single-rank runs keep theirs.
 *
 * NCCL sums in its own order and cannot add onto recv: GPU ranks reduce each round in
 * place in l and fold_grad adds the round's sum to g, g + (rank 0's + rank 1's + ...),
 * bitwise one rank's only with one micro-batch per rank.
 *
 * The collective of one round for tensor i (l: world x shard floats, on the device tier):
 * from stage 2 a reduce-scatter into this rank's shard, else an allreduce; fold_grad then
 * takes its result (q->recv, q->count floats), which is g itself but on GPU ranks' later
 * rounds. With communication_data_type fp16 or bf16 (comm_req.wire), each rank's
 * contribution is rounded to 16 bits and the sums stay fp32 in rank order (an allreduce's
 * result rounded once more as it travels back: comm.h): the chain above holds with every
 * micro-batch's gradient so rounded. */
void train_reduce_req(struct trainer *t, int i, float *l, float *g, struct comm_req *q)
{
    size_t sh = train_shard_of(t, i);
    bool first = t->micro == 0, scatter = train_stage_of(t, i) >= 2;
    bool acc = !first && !t->gpu_ranks;
    *q = (struct comm_req){.op = scatter ? COMM_REDUCE_SCATTER : COMM_ALLREDUCE,
                           .dtype = COMM_F32,
                           .send = l,
                           .recv = first || acc ? g
                                   : scatter    ? l + (size_t)t->rank * sh
                                                : l,
                           .count = scatter ? sh : t->desc[i].numel,
                           .acc = acc,
                           .wire = (enum comm_wire)t->o.comm_wire};
    /* What this rank contributes: its whole buffer, world shards when scattered. */
    t->grad_bytes += (uint64_t)q->count * comm_wire_bytes(q) * (scatter ? (size_t)t->world : 1);
}

/* Add this micro-batch's gradient of tensor i (src, count floats, summed over the ranks)
 * into what the step keeps of it (g: the whole tensor, or from stage 2 this rank's shard):
 * copied on the step's first micro-batch and added on the others, nothing to do where the
 * reduction wrote g itself (src == g: train_reduce_req). On the last, the squares
 * of the rank's part are summed by chunks of SHARD_FLOATS for the clipping norm
 * (grad_norm() adds the chunks up in the layout's order). Both are the backend's: on the
 * device where g is. Runs on the comm's thread for a reduction behind the backward when the
 * backend allows it (any_thread): it touches g and tensor i's chunk sums only. */
static int fold_grad(struct trainer *t, int i, const float *src, float *g, size_t count)
{
    const struct backend_ops *be = t->be->ops;
    int r = be->fold(t->be, g, src, count, t->micro == 0 || src == g);
    size_t own = train_shard_own(t, i), lo = t->world > 1 ? train_shard_lo(t, i) : 0;
    if (r == 0 && t->micro == t->o.grad_accum - 1 && own) {
        const float *mine = train_stage_of(t, i) >= 2 ? g : g + lo;
        r = be->chunk_sumsq(t->be, mine, own, SHARD_FLOATS,
                            t->part + t->part_first[i] + lo / SHARD_FLOATS);
    }
    return r;
}

/* Reduce tensor i's local gradient l into g now (fold_grad); one rank: fold it. Sequence
 * parallel: l is this rank's positions' share, summed over the group first. */
int train_reduce_grad(struct trainer *t, int i, float *l, float *g)
{
    int rs = train_sp_grad_sum(t, l, t->desc[i].numel);
    if (rs < 0) return rs;
    /* 1-bit Adam past freeze_step: the rank's own gradient (onebit.h). */
    if (t->world <= 1 || train_onebit_local(t)) return fold_grad(t, i, l, g, t->desc[i].numel);
    struct comm_req q;
    train_reduce_req(t, i, l, g, &q);
    uint64_t t0 = now_ns();
    int r = comm_run(t->comm, &q);
    t->reduce_ns += now_ns() - t0;
    return r < 0 ? r : fold_grad(t, i, q.recv, g, q.count);
}

/* The squared norm of the step's gradient: every chunk's sum, from the rank that owns it, in
 * the layout's order, so that any number of ranks adds the same numbers in the same order. */
int train_grad_norm(struct trainer *t, double *sumsq)
{
    if (t->mp) return train_pipe_norm(t, sumsq);
    const double *all = t->part;
    size_t np = t->nparts;
    if (t->world > 1) {
        int r = comm_allgather(t->hcomm, t->part, t->part_all, np * sizeof(double), COMM_BYTE);
        if (r < 0) return r;
        all = t->part_all;
    }
    double s = 0;
    for (int i = 0; i < t->ntensors; i++) {
        if (train_private(t, i)) continue; /* after their gate, in the whole model's order */
        size_t chunks = (t->desc[i].numel + SHARD_FLOATS - 1) / SHARD_FLOATS;
        size_t per = train_shard_of(t, i) / SHARD_FLOATS; /* chunks per rank */
        for (size_t c = 0; c < chunks; c++) {
            size_t owner = t->world > 1 ? c / per : 0;
            s += all[owner * np + t->part_first[i] + c];
        }
        if (t->ep <= 1 || t->desc[i].block < 0 || t->desc[i].slot != GPT_BLOCK_NSLOTS) continue;
        /* A gate: its E experts follow, expert e whole on rank e / (E/ep), at the place of
         * its local number there (every rank's layout has the same shape). */
        int Epr = t->o.moe.E / t->ep;
        for (int e = 0; e < t->o.moe.E; e++)
            for (int q = 0; q < 4; q++) {
                int x = i + 1 + 4 * (e % Epr) + q;
                size_t n = (t->desc[x].numel + SHARD_FLOATS - 1) / SHARD_FLOATS;
                for (size_t c = 0; c < n; c++)
                    s += all[(size_t)(e / Epr) * np + t->part_first[x] + c];
            }
    }
    *sumsq = s;
    return 0;
}

/* *d = the sum of every rank's *d (each rank's digest terms of its own shards). */
int train_digest_across(struct trainer *t, uint64_t *d)
{
    uint64_t all[COMM_MAX_RANKS];
    int r = comm_allgather(t->hcomm, d, all, sizeof(uint64_t), COMM_BYTE);
    if (r == 0) {
        *d = 0;
        for (int k = 0; k < t->world; k++)
            *d += all[k];
    }
    return r;
}
