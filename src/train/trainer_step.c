/*
 * trainer_step.c - one training step through the engine (see trainer.h).
 *
 * A step, for a model of L blocks and a batch (B,T), w being what the device computes with
 * (the fp32 parameters p, or their bf16 copies in mixed precision):
 *   forward   a0 = embed(wte, wpe); a[k+1] = block_k(a[k])      w fetched to DEVICE
 *   head      loss, d = head_backward(a[L], lnf, wte)             grads zeroed on first touch
 *   backward  d = block_k^T(a[k], d), g_k += ...  for k = L-1..0  (block internals recomputed)
 *   embed     g_wte, g_wpe += ...
 *   optimizer for every tensor: p, g, m, v (and w) fetched to where the optimizer states
 *             live (HOST, or DEVICE when they are homed there), AdamW, all but g released
 *             dirty; the engine carries a refreshed w to the device on its next fetch.
 * Only the block inputs a[0..L] are kept between forward and backward (activation
 * checkpointing); they are zinf tensors homed in the host tier, or on NVMe where it cannot
 * hold them (zinf.train.activation_offload): the forward releases each one dirty (the
 * engine writes it back as eviction asks), the backward prefetches them in reverse order
 * ahead of the recompute and drops each unwritten once read. Gradient norms are
 * summed as each gradient is finished, so clipping needs no extra pass. The math runs in a
 * backend (backend.h): every call goes through it, whatever it computes on.
 *
 * The batch of step s is drawn from the data with a generator seeded by (seed, s), and the
 * step count is itself a zinf tensor flushed with everything else: a resumed run sees the
 * same batches and the same states, hence the same losses, as an uninterrupted one.
 *
 * Here: the sets a step pins (waves) and their fetch and release, forward, head, backward
 * and the step driver trainer_step. Not here: the partitions a wave gathers and reduces
 * (trainer_shards.c), the optimizer phase (trainer_optim.c), checkpoints (trainer_resume.c).
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#include "comm/comm.h"
#include "common.h"
#include "train/backend.h"
#include "train/gpt_lora.h"
#include "train/loss_scale.h"
#include "train/trainer_impl.h"
#include "trace.h"

static void wave_member(struct wave *w, enum role role, int idx, bool dirty)
{
    if (w->n >= WAVE_MAX) { /* a set this file builds: WAVE_MAX is wrong */
        log_error("trainer: a set of '%s' outgrew WAVE_MAX (%d)", w->what, WAVE_MAX);
        abort();
    }
    w->role[w->n] = (uint8_t)role;
    w->idx[w->n] = idx;
    w->dirty[w->n] = dirty;
    w->from[w->n] = -1;
    w->async[w->n] = false;
    w->reduce[w->n] = false;
    w->n++;
}

static void wave_add(struct wave *w, enum role role, int idx, bool dirty)
{
    w->at[w->ne++] = (int8_t)w->n;
    wave_member(w, role, idx, dirty);
}

/* The weights of tensor idx as the device computes with them: w, or in stage 3 the rank's
 * shard of p gathered from every rank into a buffer of the device tier. */
static void wave_add_weight(const struct trainer *t, struct wave *w, int idx)
{
    if (train_stage_of(t, idx) < 3) {
        wave_add(w, R_W, idx, false);
        return;
    }
    wave_member(w, R_W, idx, false);
    wave_add(w, R_GW, idx, false);
    w->from[w->n - 1] = (int8_t)(w->n - 2);
}

/* Whether stage 3 gathers the next block ahead: unless stage3_prefetch_bucket_size is 0, or
 * two blocks' parameters would be more than stage3_max_live_parameters (DeepSpeed's
 * meanings: no prefetch; the most gathered at once). */
static bool gather_ahead(const struct trainer *t)
{
    return t->zc.zero.stage3_prefetch_bucket_size && t->cfg.L > 1 &&
           2 * (uint64_t)gpt_block_num_params(&t->cfg) <= t->zc.zero.stage3_max_live_parameters;
}

/* Which of the two sets of gather buffers block k's weights go to: by its parity when the
 * next block is gathered ahead, else the one set. */
int train_gw_set(const struct trainer *t, int k)
{
    return gather_ahead(t) ? k & 1 : 0;
}

/* Whether block k's weights are in its gather buffers already (gathered ahead, or still
 * there from the forward); the budget check counts the worst case, a gather. */
bool train_gathered(const struct trainer *t, int k)
{
    return !t->budgeting && t->gw_holds[train_gw_set(t, k)] == k;
}

/* Which of the two sets of local gradients block k's go to: by its parity when a block's
 * are reduced while the next one computes (overlap_comm), else the one set. */
int train_lg_set(const struct trainer *t, int k)
{
    return t->overlap && t->cfg.L > 1 ? k & 1 : 0;
}

static void wave_add_block(struct trainer *t, struct wave *w, enum role role, int k, bool dirty)
{
    for (int i = 0; i < GPT_BLOCK_NSLOTS; i++) {
        int idx = t->block_first[k] + i;
        if (role == R_W && train_stage_of(t, idx) >= 3 && train_gathered(t, k))
            wave_add(w, R_GW, idx, false);
        else if (role == R_W)
            wave_add_weight(t, w, idx);
        else
            wave_add(w, role, idx, dirty);
    }
}

/* Stage 3: block j's shards and the other gather buffers join the set, and their gather runs
 * while this set's block computes (gather_ahead()). */
static void wave_prefetch_block(struct trainer *t, struct wave *w, int j)
{
    if (t->stage < 3 || !gather_ahead(t) || j < 0 || j >= t->cfg.L || train_gathered(t, j)) return;
    for (int i = 0; i < GPT_BLOCK_NSLOTS; i++) {
        int idx = t->block_first[j] + i;
        if (train_stage_of(t, idx) < 3) continue;
        wave_member(w, R_W, idx, false);
        wave_member(w, R_GW, idx, false);
        w->from[w->n - 1] = (int8_t)(w->n - 2);
        w->async[w->n - 1] = true;
        w->ahead = j + 1;
    }
}

/* The embeddings' forward: wte, wpe -> a[0]. */
void train_wave_embed_forward(struct trainer *t, struct wave *w)
{
    *w = (struct wave){.what = "the embeddings' forward (wte, wpe and the first activation)"};
    wave_add_weight(t, w, t->wte);
    wave_add_weight(t, w, t->wpe);
    wave_add(w, R_ACT, 0, true);
}

/* LoRA: block k's adapters of the given role, each target's A then B (entries in that
 * order, the targets without one left out). */
static void wave_add_adapters(struct trainer *t, struct wave *w, enum role role, int k, bool dirty)
{
    for (int j = 0; j < GPT_LORA_NTARGETS; j++)
        for (int ab = 0; ab < 2; ab++) {
            int idx = train_lora_index(t, k, j, ab);
            if (idx >= 0) wave_add(w, role, idx, dirty);
        }
}

/* The pointers of the adapters that wave_add_adapters() put at p, 2 per target (NULL where
 * the target has none), into aw. */
static void adapter_ptrs(const struct trainer *t, void *const *p, void **aw)
{
    int n = 0;
    for (int j = 0; j < GPT_LORA_NTARGETS; j++)
        for (int ab = 0; ab < 2; ab++)
            aw[2 * j + ab] = train_lora_index(t, 0, j, ab) >= 0 ? p[n++] : NULL;
}

/* Block k's forward: its 12 weights, a[k] -> a[k+1] (LoRA: its adapters' weights after). */
void train_wave_block_forward(struct trainer *t, int k, struct wave *w)
{
    *w = (struct wave){.what = "a block's forward (its weights, input and output)"};
    wave_add_block(t, w, R_W, k, false);
    wave_add(w, R_ACT, k, false);
    wave_add(w, R_ACT, k + 1, true);
    wave_add_adapters(t, w, R_W, k, false);
    wave_prefetch_block(t, w, k + 1);
}

/* The head: a[L], lnf, wte and the gradients of lnf and wte. Exact: the gradients go to
 * the local buffers (entries 4-6), and those of lnf are reduced into g (entries 7, 8); wte's
 * local gradient waits for the embeddings' backward. */
void train_wave_head(struct trainer *t, struct wave *w)
{
    *w = (struct wave){.what = "the head (the last activation, the final norm, wte and their "
                               "gradients)"};
    enum role g = t->exact ? R_L : R_G;
    wave_add(w, R_ACT, t->cfg.L, false);
    wave_add_weight(t, w, t->lnfw);
    wave_add_weight(t, w, t->lnfb);
    wave_add_weight(t, w, t->wte);
    if (t->o.lora.r) return; /* frozen: no gradients */
    wave_add(w, g, t->lnfw, true);
    wave_add(w, g, t->lnfb, true);
    wave_add(w, g, t->wte, true);
    if (t->exact) {
        wave_add(w, R_G, t->lnfw, true);
        wave_add(w, R_G, t->lnfb, true);
    }
}

/* overlap_comm: block j's local gradients and their g join the set, and their reduction
 * runs while this set's phase computes; wave_release waits for it. */
static void wave_reduce_behind(struct trainer *t, struct wave *w, int j)
{
    if (!t->overlap || j < 0 || j >= t->cfg.L) return;
    for (int i = 0; i < GPT_BLOCK_NSLOTS; i++) {
        int idx = t->block_first[j] + i;
        wave_member(w, R_L, idx, false);
        w->reduce[w->n - 1] = true;
        wave_member(w, R_G, idx, true);
    }
    w->behind = j + 1;
}

/* Block k's backward: its weights, gradients and input (the block is recomputed). Exact:
 * the gradients go to the local buffers, then are reduced into g (entries 25-36), or with
 * overlap_comm while block k - 1 computes (block k + 1's are reduced during this one). */
void train_wave_block_backward(struct trainer *t, int k, struct wave *w)
{
    *w = (struct wave){.what = "a block's backward (its weights, gradients and input)"};
    wave_add_block(t, w, R_W, k, false);
    if (t->o.lora.r) { /* LoRA: the input, the adapters' weights and gradients */
        wave_add(w, R_ACT, k, false);
        wave_add_adapters(t, w, R_W, k, false);
        wave_add_adapters(t, w, R_G, k, true);
        return;
    }
    wave_add_block(t, w, t->exact ? R_L : R_G, k, true);
    wave_add(w, R_ACT, k, false);
    /* Read for the last time this step: homed on NVMe, the checkpoint is dropped unwritten
     * (the next forward overwrites it before reading it). */
    w->spent[w->n - 1] = t->act_tier == ZINF_TIER_NVME;
    if (t->exact && !t->overlap) wave_add_block(t, w, R_G, k, true);
    wave_prefetch_block(t, w, k - 1);
    wave_reduce_behind(t, w, k + 1);
}

/* Exact: the local gradients of wte and wpe, then their g (entries 2, 3); with overlap_comm,
 * block 0's gradients are reduced meanwhile. */
void train_wave_embed_backward(struct trainer *t, struct wave *w)
{
    *w = (struct wave){.what = "the embeddings' backward (the gradients of wte and wpe)"};
    enum role g = t->exact ? R_L : R_G;
    wave_add(w, g, t->wte, true);
    wave_add(w, g, t->wpe, true);
    if (t->exact) {
        wave_add(w, R_G, t->wte, true);
        wave_add(w, R_G, t->wpe, true);
    }
    wave_reduce_behind(t, w, 0);
}

/* The optimizer's update of tensor i: p, g, m, v (and the 16-bit copy); on GPU ranks that
 * update on the device below stage 3, the tensor's local gradient buffer too, through which
 * the ranks' updated parts are gathered. */
void train_wave_optimizer(struct trainer *t, int i, struct wave *w)
{
    *w = (struct wave){.what = "the optimizer's update of one tensor (its parameters, "
                               "gradient, m and v)"};
    wave_add(w, R_P, i, true);
    wave_add(w, R_G, i, false);
    /* Spent once the update has read it: the next backward zeroes it on its first touch.
     * Only an NVMe home saves anything (no read of stale bytes back into memory). */
    w->spent[w->n - 1] = train_home_of(t->zc.zero.offload_optimizer.device) == ZINF_TIER_NVME;
    wave_add(w, R_M, i, true);
    wave_add(w, R_V, i, true);
    if (t->w != t->p) wave_add(w, R_W, i, true);
    if (t->gpu_ranks && t->opt_tier == ZINF_TIER_DEVICE && train_stage_of(t, i) < 3)
        wave_add(w, R_L, i, false);
}

/* Sampling's logits, on the CPU: the last activation, the final norm and wte in fp32. */
void train_wave_sample(struct trainer *t, struct wave *w)
{
    *w = (struct wave){.what = "sampling (the last activation, the final norm and wte in fp32)"};
    wave_add(w, R_ACT, t->cfg.L, false);
    wave_add(w, R_P, t->lnfw, false);
    wave_add(w, R_P, t->lnfb, false);
    wave_add(w, R_P, t->wte, false);
}

/* The local and gather buffers are one per block slot (every block's are alike), then one
 * for each tensor outside the blocks. */
static int local_slot(const struct trainer *t, int idx)
{
    const struct gpt_tensor_desc *d = &t->desc[idx];
    return d->block >= 0 ? d->slot : GPT_BLOCK_NSLOTS + d->slot;
}

zinf_tensor train_wave_handle(const struct trainer *t, enum role role, int idx)
{
    switch (role) {
    case R_L: /* a block's by its parity: block k + 1's are reduced while block k computes */
        return t->desc[idx].block >= 0 && train_lg_set(t, t->desc[idx].block)
                   ? t->lg1[t->desc[idx].slot]
                   : t->lg[local_slot(t, idx)];
    case R_GW: /* a block's by its parity: block k + 1's gather runs while block k computes */
        return t->desc[idx].block >= 0 && train_gw_set(t, t->desc[idx].block)
                   ? t->gw1[t->desc[idx].slot]
                   : t->gw[local_slot(t, idx)];
    case R_P:
        return t->p[idx];
    case R_G:
        return t->g[idx];
    case R_M:
        return t->m[idx];
    case R_V:
        return t->v[idx];
    case R_W:
        return t->w[idx];
    default:
        return t->act[t->act_base + idx];
    }
}

/* Bytes of a rank's shard of the weights the device computes with, as gathered at stage 3:
 * the fp32 parameters in fp32, their 16-bit copies in bf16 and fp16. */
static size_t gather_bytes(const struct trainer *t, int idx)
{
    return train_shard_of(t, idx) * backend_dtype_bytes(t->be->wdt);
}

/* Fetch the set and, in stage 3, gather the weights; ptrs[j] is entry j's. */
int train_wave_fetch(struct trainer *t, const struct wave *w, enum zinf_tier tier, void **ptrs)
{
    zinf_tensor hs[WAVE_MAX];
    void *m[WAVE_MAX];
    for (int i = 0; i < w->n; i++)
        hs[i] = train_wave_handle(t, (enum role)w->role[i], w->idx[i]);
    int r = train_fetch_set(t, w, hs, tier, m);
    if (r < 0) return r; /* nothing is pinned */
    int blk = -1;
    for (int i = 0; i < w->n && r == 0; i++)
        if (w->from[i] >= 0 && !w->async[i]) {
            if ((blk = t->desc[w->idx[i]].block) >= 0) t->gw_holds[train_gw_set(t, blk)] = -1;
            r = comm_allgather(t->comm, m[w->from[i]], m[i], gather_bytes(t, w->idx[i]),
                               COMM_BYTE);
        }
    if (r == 0 && blk >= 0) t->gw_holds[train_gw_set(t, blk)] = blk;
    /* The next block's gathers, behind this one's compute: wave_release waits for them. */
    if (r == 0 && w->ahead) t->gw_holds[train_gw_set(t, w->ahead - 1)] = -1;
    int q = 0;
    for (int i = 0; i < w->n && r == 0; i++) {
        if (!w->async[i]) continue;
        struct comm_req *req = &t->greq[q++];
        *req = (struct comm_req){.op = COMM_ALLGATHER,
                                 .dtype = COMM_BYTE,
                                 .send = m[w->from[i]],
                                 .recv = m[i],
                                 .count = gather_bytes(t, w->idx[i]),
                                 .cb = train_gather_done,
                                 .data = t};
        if (train_submit_async(t, req) < 0) break;
    }
    /* The previous block's gradient reductions, behind this set's compute. */
    q = 0;
    for (int i = 0; i < w->n && r == 0; i++) {
        if (!w->reduce[i]) continue;
        struct reduce_ctx *x = &t->rq[q++];
        x->t = t;
        x->idx = w->idx[i];
        x->g = m[i + 1];
        train_reduce_req(t, w->idx[i], m[i], x->g, &x->req);
        x->count = x->req.count;
        /* After the kernels that wrote the local gradients, on the reduction's own stream;
         * the fold waits for it on the compute stream (train_fold_behind). */
        if ((r = t->be->ops->record(t->be, x->after)) < 0) break;
        x->req.wait_event = x->after;
        x->req.done_event = x->done;
        x->req.cb = train_reduce_done;
        x->req.data = x;
        if (train_submit_async(t, &x->req) < 0) break;
    }
    if (r < 0) {
        train_wave_release(t, w, tier, false);
        return r;
    }
    for (int j = 0; j < w->ne; j++)
        ptrs[j] = m[w->at[j]];
    return 0;
}

/* Release the whole set: the members it wrote dirty when the phase succeeded (ok) and so
 * did its async collectives, which finish first: the next block's gathers (they read shards
 * of this set) and the previous block's reductions (they read and write members). Their
 * first error is the answer. */
int train_wave_release(struct trainer *t, const struct wave *w, enum zinf_tier tier, bool ok)
{
    int r = 0;
    if (w->ahead || w->behind) {
        uint64_t t0 = now_ns();
        pthread_mutex_lock(&t->gmu);
        while (t->gpending)
            pthread_cond_wait(&t->gcv, &t->gmu);
        r = t->gerr;
        t->gerr = 0;
        pthread_mutex_unlock(&t->gmu);
        if (w->ahead) t->gw_holds[train_gw_set(t, w->ahead - 1)] = r == 0 ? w->ahead - 1 : -1;
        if (w->behind) t->reduce_ns += now_ns() - t0;
        if (r == 0 && w->behind) {
            int n = 0;
            for (int i = 0; i < w->n; i++)
                n += w->reduce[i];
            r = train_settle(t, train_fold_behind(t, n));
        }
        ok &= r == 0;
    }
    for (int i = 0; i < w->n; i++) {
        zinf_tensor h = train_wave_handle(t, (enum role)w->role[i], w->idx[i]);
        zinf_engine *e = train_engine_of(t, w->role[i], w->idx[i]);
        bool spent = ok && w->spent[i];
        int x = spent ? zinf_release(e, h, tier, ZINF_RELEASE_ZERO) : 0;
        /* A spent member that another caller still holds (or that is homed elsewhere after
         * all) keeps its content: released clean, as before. */
        if (!spent || x == -EINVAL || x == -EBUSY)
            x = zinf_release(e, h, tier, ok && w->dirty[i] ? ZINF_RELEASE_DIRTY : 0);
        if (x < 0 && r == 0) r = x;
    }
    return r;
}

/* ---- one step -------------------------------------------------------------------------- */

#define TRY(x)                                                                                     \
    do {                                                                                           \
        if ((r = (x)) < 0) goto out;                                                               \
    } while (0)

/* The backend's queued work that reads or writes what is about to be released must be
 * done first; when it failed, r keeps the first error. */
int train_settle(struct trainer *t, int r)
{
    int x = t->be->ops->sync(t->be);
    return r < 0 ? r : x;
}

int train_forward(struct trainer *t)
{
    const struct backend_ops *be = t->be->ops;
    struct wave w;
    void *p[WAVE_MAX];
    int r;

    /* The weights gathered in the last step are stale: the optimizer changed the shards. */
    t->gw_holds[0] = t->gw_holds[1] = -1;
    uint64_t s0 = trace_on() ? now_ns() : 0;
    if (t->ps > 0) goto blocks; /* a later pipeline stage: its input came from the one before */
    train_wave_embed_forward(t, &w);
    /* (The set is fetched with no other pin of the caller's in the device tier, as
     * zinf_fetch_all's guarantee of room asks: the weights the update sent are unpinned
     * first, once there.) */
    r = train_update_until(t, MAX(t->wte, t->wpe) + 1, true);
    train_update_unpin(t);
    TRY(r);
    TRY(train_wave_fetch(t, &w, ZINF_TIER_DEVICE, p));
    /* A deferred update runs one block ahead, on its own thread, while this thread
     * computes: the next block's sets are read and updated during this one's compute. It
     * starts once this block's set is fetched (fetched with no other pin of ours in the
     * device tier) and is joined before the next is. */
    if (t->ke > t->kb) train_update_start(t, t->block_first[t->kb] + GPT_BLOCK_NSLOTS);
    r = train_settle(t, be->embed_forward(t->be, p[0], p[1], p[2]));
    train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
    if (s0) trace_span("train", "embeddings forward", s0, NULL, NULL, -1);
    if (r < 0) goto out;

blocks:
    for (int k = t->kb; k < t->ke; k++) {
        if (train_moe_block(t, k)) { /* its own phases (no update is deferred with MoE) */
            TRY(train_moe_forward(t, k));
            train_note_peaks(t);
            continue;
        }
        s0 = trace_on() ? now_ns() : 0;
        train_wave_block_forward(t, k, &w);
        r = train_update_join(t);
        if (r == 0) r = train_update_until(t, t->block_first[k] + GPT_BLOCK_NSLOTS, true);
        train_update_unpin(t);
        TRY(r);
        TRY(train_wave_fetch(t, &w, ZINF_TIER_DEVICE, p));
        if (k + 1 < t->ke) train_update_start(t, t->block_first[k + 1] + GPT_BLOCK_NSLOTS);
        if (t->o.lora.r) {
            void *aw[2 * GPT_LORA_NTARGETS];
            adapter_ptrs(t, p + GPT_BLOCK_NSLOTS + 2, aw);
            r = be->lora_block_forward(t->be, (const void *const *)p, (const void *const *)aw,
                                       t->o.lora.r, train_lora_scale(t), p[GPT_BLOCK_NSLOTS],
                                       p[GPT_BLOCK_NSLOTS + 1]);
        } else {
            r = be->block_forward(t->be, (const void *const *)p, p[GPT_BLOCK_NSLOTS],
                                  p[GPT_BLOCK_NSLOTS + 1]);
        }
        r = train_settle(t, r);
        int x = train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
        if (r == 0) r = x; /* the next block's gather failed */
        if (s0) trace_span_n("train", "block forward", k, s0);
        if (r < 0) goto out;
        train_note_peaks(t);
    }
    /* The head's weights, and the gradients that it and the backward overwrite. */
    r = train_update_finish(t);
out:;
    /* Whatever failed, the update's thread is done with the trainer before this returns
     * (its own failure, where this step's compute went well, is the step's). */
    int x = train_update_join(t);
    return r < 0 ? r : x;
}

/* The head's backward gives the loss and the first gradient. Gradients are zeroed on their
 * first touch of the step (the first micro-batch: the others add to them), and their squares
 * summed for the clipping norm on the last micro-batch, once they are whole. Exact: every
 * micro-batch's go to the local buffers (zero, no norm), which reduce folds into g. */
int train_head(struct trainer *t, bool zero, bool norm, bool reduce)
{
    const struct gpt_config *c = &t->cfg;
    const struct backend_ops *be = t->be->ops;
    struct wave w;
    void *p[WAVE_MAX];
    int r;

    uint64_t s0 = trace_on() ? now_ns() : 0;
    train_wave_head(t, &w);
    if ((r = train_wave_fetch(t, &w, ZINF_TIER_DEVICE, p)) < 0) return r;
    size_t C = (size_t)c->C * sizeof(float);
    if (t->o.lora.r) { /* a frozen head: the loss and the gradient it hands on */
        r = train_settle(t, be->head_backward(t->be, p[1], p[2], p[3], p[0], NULL, NULL, NULL));
        train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
        return r;
    }
    if (zero && (r = be->zero(t->be, p[4], C)) == 0 && (r = be->zero(t->be, p[5], C)) == 0)
        r = be->zero(t->be, p[6], t->desc[t->wte].numel * sizeof(float));
    if (r == 0 && (r = be->head_backward(t->be, p[1], p[2], p[3], p[0], p[4], p[5], p[6])) == 0 &&
        norm && (r = be->sumsq(t->be, p[4], (size_t)c->C)) == 0)
        r = be->sumsq(t->be, p[5], (size_t)c->C);
    r = train_settle(t, r);
    if (r == 0 && t->exact && reduce && (r = train_reduce_grad(t, t->lnfw, p[4], p[7])) == 0)
        r = train_reduce_grad(t, t->lnfb, p[5], p[8]);
    train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
    if (s0) trace_span("train", "head (loss and its gradient)", s0, NULL, NULL, -1);
    return r;
}

/* Homed on NVMe, the checkpoints the next two blocks' backwards read start coming back to
 * the device while block k recomputes (hints: the engine drops one that finds no room). */
static void act_ahead(struct trainer *t, int k)
{
    if (t->act_tier != ZINF_TIER_NVME) return;
    for (int j = k - 1; j >= MAX(t->kb, k - 2); j--)
        zinf_prefetch(t->e, train_wave_handle(t, R_ACT, j), ZINF_TIER_DEVICE);
}

/* LoRA: block k's backward from its set p (train_wave_block_backward's): the gradient
 * pulled through the frozen block, the adapters' gradients zeroed on the step's first touch,
 * accumulated, and their squares summed on its last. */
static int lora_backward(struct trainer *t, int k, void *const *p, bool zero, bool norm)
{
    const struct backend_ops *be = t->be->ops;
    void *aw[2 * GPT_LORA_NTARGETS], *ag[2 * GPT_LORA_NTARGETS];
    int na = 2 * __builtin_popcount(t->o.lora.targets), r = 0;
    void *const *pa = p + GPT_BLOCK_NSLOTS + 1;
    adapter_ptrs(t, pa, aw);
    adapter_ptrs(t, pa + na, ag);
    for (int n = 0; n < na && r == 0 && zero; n++)
        r = be->zero(t->be, pa[na + n], t->desc[t->lora_first + n].numel * sizeof(float));
    if (r == 0)
        r = be->lora_block_backward(t->be, (const void *const *)p, (const void *const *)aw,
                                    t->o.lora.r, train_lora_scale(t), p[GPT_BLOCK_NSLOTS],
                                    (float *const *)ag);
    for (int n = 0; n < na && r == 0 && norm; n++)
        r = be->sumsq(t->be, pa[na + n], t->desc[t->lora_first + n].numel);
    return train_settle(t, r);
}

int train_backward(struct trainer *t, bool zero, bool norm)
{
    const struct backend_ops *be = t->be->ops;
    struct wave w;
    void *p[WAVE_MAX];
    int r = 0;

    for (int k = t->ke - 1; k >= t->kb; k--) {
        if (train_moe_block(t, k)) {
            TRY(train_moe_backward(t, k, zero, norm));
            if (t->last_micro) train_optimizer_ahead(t, t->ke - k, t->ke - t->kb);
            continue;
        }
        uint64_t s0 = trace_on() ? now_ns() : 0;
        train_wave_block_backward(t, k, &w);
        TRY(train_wave_fetch(t, &w, ZINF_TIER_DEVICE, p));
        act_ahead(t, k);
        if (t->o.lora.r) {
            r = lora_backward(t, k, p, zero, norm);
            train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
            if (s0) trace_span_n("train", "block backward", k, s0);
            if (r < 0) goto out;
            train_note_peaks(t);
            continue;
        }
        void **gw = p + GPT_BLOCK_NSLOTS, *a = p[2 * GPT_BLOCK_NSLOTS];
        size_t first = (size_t)t->block_first[k];
        for (int i = 0; i < GPT_BLOCK_NSLOTS && r == 0 && zero; i++)
            r = be->zero(t->be, gw[i], t->desc[first + i].numel * sizeof(float));
        if (r == 0) r = be->block_backward(t->be, (const void *const *)p, a, (float *const *)gw);
        for (int i = 0; i < GPT_BLOCK_NSLOTS && r == 0 && norm; i++)
            r = be->sumsq(t->be, gw[i], t->desc[first + i].numel);
        r = train_settle(t, r);
        for (int i = 0; i < GPT_BLOCK_NSLOTS && r == 0 && t->exact && !t->overlap; i++)
            r = train_reduce_grad(t, (int)first + i, gw[i], p[2 * GPT_BLOCK_NSLOTS + 1 + i]);
        int x = train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
        if (r == 0) r = x; /* a reduction behind this block failed */
        if (s0) trace_span_n("train", "block backward", k, s0);
        if (r < 0) goto out;
        train_note_peaks(t);
        if (t->last_micro) train_optimizer_ahead(t, t->ke - k, t->ke - t->kb);
    }
    if (t->ps > 0) goto out; /* a later pipeline stage: the gradient goes to the one before */
    if (t->o.lora.r) goto out; /* frozen embeddings */
    /* The first of several stages: wte's local gradient starts as the head's share. */
    if (t->pp > 1) TRY(train_pipe_wte_in(t));

    /* The embeddings: g_wte already holds the head's share. */
    uint64_t s0 = trace_on() ? now_ns() : 0;
    train_wave_embed_backward(t, &w);
    TRY(train_wave_fetch(t, &w, ZINF_TIER_DEVICE, p));
    if (zero) r = be->zero(t->be, p[1], t->desc[t->wpe].numel * sizeof(float));
    if (r == 0 && (r = be->embed_backward(t->be, p[0], p[1])) == 0 && norm &&
        (r = be->sumsq(t->be, p[0], t->desc[t->wte].numel)) == 0)
        r = be->sumsq(t->be, p[1], t->desc[t->wpe].numel);
    r = train_settle(t, r);
    if (r == 0 && t->exact && (r = train_reduce_grad(t, t->wte, p[0], p[2])) == 0)
        r = train_reduce_grad(t, t->wpe, p[1], p[3]);
    int x = train_wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
    if (r == 0) r = x;
    if (s0) trace_span("train", "embeddings backward", s0, NULL, NULL, -1);
out:
    return r;
}

/* The step's count, written once its update is made or deferred (trainer_fault_step_save
 * fails it instead, once). */
static int save_count(struct trainer *t, int step)
{
    int err = t->fault_save_err;
    t->fault_save_err = 0;
    return err ? -err : train_state_save_step(t, step);
}

/* The bytes this rank has sent to collectives (both communicators where there are two). */
static uint64_t comm_sent(struct trainer *t)
{
    struct comm_stats cs;
    uint64_t b = 0;
    if (t->comm) comm_get_stats(t->comm, &cs), b += cs.bytes_in;
    if (t->hcomm && t->hcomm != t->comm) comm_get_stats(t->hcomm, &cs), b += cs.bytes_in;
    return b;
}

int trainer_step(struct trainer *t, struct trainer_step_stats *st)
{
    struct zinf_stats s0, s1;
    int step = t->step_done + 1, r;
    float loss = 0;
    double sumsq = 0;

    if (t->torn) return t->torn;
    zinf_stats(t->e, &s0);
    uint64_t t0 = now_ns(), c0 = comm_sent(t), g0 = t->grad_bytes;
    double loss_sum = 0;
    bool fp16 = t->be->wdt == BACKEND_F16;
    double S = fp16 ? t->ls.scale : 1;
    t->be->loss_scale = (float)S;
    int K = t->o.grad_accum, total = K * t->world;
    train_moe_step_begin(t);
    if (t->pp > 1) TRY(train_pipe_step(t, step, &loss_sum));
    for (int m = 0; m < K && t->pp == 1; m++) {
        /* Exact: every micro-batch's gradients start from zero; the reductions add them. */
        bool first = m == 0 || t->exact, last = m == K - 1 && !t->exact;
        float l;
        double ss;
        /* Rank r's m-th is the step's micro-batch m x world + r: the order of the step's sum
         * (train_reduce_req). */
        train_load_batch(t, step, m * t->world + t->rank);
        t->micro = t->fmicro = m;
        t->last_micro = m == K - 1;
        TRY(t->be->ops->set_batch(t->be, t->tokens, t->targets));
        TRY(train_forward(t));
        TRY(train_head(t, first, last, true));
        TRY(train_backward(t, first, last));
        TRY(t->be->ops->collect(t->be, &l, &ss));
        TRY(train_sp_sum(t, &l, 1)); /* each rank's positions' share of the mean */
        if (t->moe) l += train_moe_aux(t); /* the balancing loss of the MoE blocks */
        if (t->losses) t->losses[m] = l;
        loss_sum += l;
        sumsq += ss;
    }
    if (t->exact) TRY(train_grad_norm(t, &sumsq));
    if (t->world > 1) {
        /* Every micro-batch's loss, in the order one rank would have run them: number j is
         * rank j % world's (j / world)-th. */
        float *all = t->losses + K;
        TRY(comm_allgather(t->hcomm, t->losses, all, (size_t)K, COMM_F32));
        loss_sum = 0;
        for (int j = 0; j < total; j++)
            loss_sum += all[(j % t->world) * K + j / t->world];
    }
    loss = total == 1 ? (float)loss_sum : (float)(loss_sum / total);
    if (fp16 && t->fault_overflow) {
        sumsq = INFINITY; /* trainer_fault_overflow() */
        t->fault_overflow = false;
    }
    /* fp16: gradients that overflowed skip the update (DeepSpeed's rule); Adam and the
     * schedule count the steps applied. */
    bool overflow = fp16 && !isfinite(sumsq);
    int applied = step - (int)t->ls.skipped - (overflow ? 1 : 0);
    struct loss_scale ls = t->ls;
    if (fp16) loss_scale_update(&ls, overflow);
    /* Up to here only gradients and activations changed, which the next step rebuilds (and
     * the forward finished the previous step's deferred update, which a failure leaves for
     * the next try to go on with); from here the parameters and Adam states change, tensor by
     * tensor, until the step count says they belong to this step. Deferred to the next
     * forward, the step's update changes nothing yet. */
    uint64_t digest = 0;
    double grad_norm;
    float grad_scale, clip = train_clip_of(t, sumsq, S, &grad_norm, &grad_scale);
    if (t->o.optimizer == TRAINER_OPT_ONEBIT && applied > t->o.freeze_step) {
        /* 1-bit Adam's compressed phase: the rank's own gradient, its micro-batches' mean,
         * not clipped (no rank holds the whole gradient: grad_norm adds the ranks' parts of
         * their own). */
        clip = 1;
        grad_scale = (float)(1.0 / ((double)K * S));
    }
    /* A skipped step's rate is that of the update it would have made. */
    float lr = (float)trainer_lr_at(&t->o.sched, t->o.lr, overflow ? applied + 1 : applied);
    bool defer = t->defer_ok && !overflow;
    if (defer) train_update_defer(t, step, applied, lr, grad_scale);
    if ((!overflow && !defer && (r = train_optimize(t, applied, lr, grad_scale, &digest)) < 0) ||
        (fp16 && (r = zinf_write(t->e, t->scaler, 0, &ls, sizeof(ls))) < 0) ||
        (r = save_count(t, step)) < 0) {
        /* Deferred, the step's update has changed nothing yet, and a failed zinf_write leaves
         * the count as it was: the step fails as one before its optimizer does, and the next
         * try runs it again. Otherwise the parameters are half updated. */
        if (defer)
            t->upd = (struct train_update){0};
        else
            t->torn = r;
        goto out;
    }
    t->ls = ls;
    t->step_done = step;
    if (t->o.digest && !overflow && !defer) {
        /* Every rank's sum over its shards, added: the digest of the whole. */
        if (t->world > 1) TRY(train_digest_across(t, &digest));
        if (t->mp) TRY(train_pipe_digest(t, &digest));
        t->digest = digest;
        t->have_digest = true;
        t->digest_step = step;
    }
    TRY(zinf_step(t->e));
    double sec = (double)(now_ns() - t0) / 1e9;
    zinf_stats(t->e, &s1);
    *st = (struct trainer_step_stats){
        .step = step,
        .loss = loss,
        .seconds = sec,
        .tokens_per_s = (double)t->o.batch * t->o.seq * total / sec,
        .nvme_read_GBps = (double)(s1.nvme_bytes_read - s0.nvme_bytes_read) / sec / 1e9,
        .nvme_write_GBps = (double)(s1.nvme_bytes_written - s0.nvme_bytes_written) / sec / 1e9,
        .nvme_read_bytes = s1.nvme_bytes_read - s0.nvme_bytes_read,
        .nvme_write_bytes = s1.nvme_bytes_written - s0.nvme_bytes_written,
        .blocked_fraction = (double)(s1.blocked_ns - s0.blocked_ns) / 1e9 / sec,
        .blocked_nvme = (double)(s1.blocked_nvme_ns - s0.blocked_nvme_ns) / 1e9 / sec,
        .blocked_copy = (double)(s1.blocked_copy_ns - s0.blocked_copy_ns) / 1e9 / sec,
        .blocked_room = (double)(s1.blocked_room_ns - s0.blocked_room_ns) / 1e9 / sec,
        .blocked_pin = (double)(s1.blocked_pin_ns - s0.blocked_pin_ns) / 1e9 / sec,
        .device_used = s1.tier[ZINF_TIER_DEVICE].used_bytes,
        .host_used = s1.tier[ZINF_TIER_HOST].used_bytes,
        .skipped = overflow,
        .loss_scale = S,
        .grad_norm = grad_norm,
        .clip_scale = clip,
        .lr = lr,
        .have_digest = t->o.digest && t->have_digest && (!defer || t->digest_step == step - 1),
        .digest = t->digest,
        .digest_step = defer ? t->digest_step : step,
        .update_pending = defer,
        .comm_bytes = comm_sent(t) - c0,
        .grad_comm_bytes = t->grad_bytes - g0,
    };
    train_moe_step_end(t, st);
out:
    trace_span_n("train", "step", step, t0);
    t->last_micro = false;
    /* Sets asked for ahead that a failure or a skip left; a deferred update keeps them. */
    if (r < 0 || !t->upd.pending) train_optimizer_drop(t);
    if (r < 0) {
        /* A failed step leaves no half-summed norm behind for the next one. */
        float l;
        double d;
        t->be->ops->collect(t->be, &l, &d);
    }
    return r;
}
