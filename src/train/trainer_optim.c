/*
 * trainer_optim.c - the optimizer phase of a step: for every tensor, its parameters,
 * gradient and Adam states fetched to where the optimizer runs, clipped and updated by
 * AdamW (only the rank's own shard with ZeRO), the device's copy refreshed, and the
 * parameters' digest summed on request; and the clipping scale from the gradient norm.
 *
 * Not here: the norm's sum across ranks and the reductions (trainer_shards.c), the loss
 * scaler (loss_scale.c), the AdamW kernels (adamw.c, kernels/).
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "comm/comm.h"
#include "common.h"
#include "train/adamw.h"
#include "train/adamw_states.h"
#include "train/backend.h"
#include "train/onebit.h"
#include "train/digest.h"
#include "train/ops.h"
#include "train/trainer_impl.h"
#include "trace.h"

/* LAMB on tensor i's n elements (the whole tensor on one rank, the rank's own part on
 * several): the moments and the chunk sums of |w|^2 and |u|^2 (lamb_moments), every rank's
 * sums gathered and added chunk by chunk in the tensor's order (so any number of ranks adds
 * the same numbers in the same order: the ratio does not depend on the ranks), then the
 * update with that ratio. Every rank takes part in the
 * gather, also one that owns nothing of the tensor. Where the states are on the device,
 * the backend's kernels, their chunk sums coming to the host. */
static int lamb_tensor(struct trainer *t, int i, float *p, const float *g, float *m, float *v,
                       void *w16, size_t n, const struct adamw_hparams *h, int step, float scale)
{
    size_t chunks = (t->desc[i].numel + SHARD_FLOATS - 1) / SHARD_FLOATS;
    size_t per =
        t->world > 1 && !train_private(t, i) ? train_shard_of(t, i) / SHARD_FLOATS : chunks;
    double *w_sq = t->lamb_sums, *u_sq = t->lamb_sums + per;
    bool f16 = w16 && t->be->wdt == BACKEND_F16, dev = t->opt_tier == ZINF_TIER_DEVICE;
    int eps_in = t->o.lamb_eps_inside_sqrt;
    memset(t->lamb_sums, 0, 2 * per * sizeof(double));
    int r = dev ? t->be->ops->lamb_moments(t->be, p, g, m, v, n, h, scale, eps_in, SHARD_FLOATS,
                                           w_sq, u_sq)
                : lamb_moments(p, g, m, v, n, h, scale, eps_in, SHARD_FLOATS, w_sq, u_sq);
    if (r < 0) return r;
    const double *all = t->lamb_sums;
    if (t->world > 1 && !train_private(t, i)) { /* an expert is whole on its rank */
        if ((r = comm_allgather(t->hcomm, t->lamb_sums, t->lamb_all, 2 * per * sizeof(double),
                                COMM_BYTE)) < 0)
            return r;
        all = t->lamb_all;
    }
    double W = 0, U = 0;
    for (size_t c = 0; c < chunks; c++) {
        const double *at = all + (c / per) * 2 * per;
        W += at[c % per];
        U += at[per + c % per];
    }
    float coeff = lamb_coeff(W, U, t->o.lamb_max_coeff, t->o.lamb_min_coeff);
    if (dev)
        return train_settle(t,
                            t->be->ops->lamb_apply(t->be, p, m, v, w16, n, h, step, eps_in, coeff));
    if ((r = lamb_apply(p, m, v, w16 && !f16 ? w16 : NULL, n, h, step, eps_in, coeff)) == 0 && f16)
        ops_cast_f32_to_f16(w16, p, n);
    return r;
}

/* AdamW on n elements where the optimizer's states live: on the device with the backend's
 * fused kernel when they are homed there, else on the host. With 16-bit weights the update
 * writes their copy w16 too (released dirty: the engine carries it to the device on its
 * next fetch there). One rank updates whole tensors with it, each of several ranks its own
 * part: the same function on the same elements, so the same bits. LAMB: lamb_tensor. */
static int update(struct trainer *t, int i, float *p, const float *g, void *m, void *v, void *w16,
                  size_t n, const struct adamw_hparams *h, int step, float scale)
{
    if (t->o.optimizer == TRAINER_OPT_LAMB)
        return lamb_tensor(t, i, p, g, m, v, w16, n, h, step, scale);
    if (!n) return 0;
    if (t->o.state_dtype != ADAMW_STATE_FP32) {
        /* Compressed states: the random bits and the blocks by the element's place in the
         * whole tensor, so a rank's part computes what one rank's whole tensor does there;
         * on the device with the backend's kernels where the states are homed there. */
        size_t sh = train_shard_of(t, i);
        bool parted = t->world > 1 && !train_private(t, i) && t->stage >= 1;
        struct adamw_state_at at = {
            .seed = t->o.seed,
            .tensor = t->gidx ? (uint32_t)t->gidx[i] : (uint32_t)i,
            .first = parted ? MIN(train_shard_lo(t, i), t->desc[i].numel) : 0,
            .cap = parted ? sh : t->desc[i].numel,
        };
        enum adamw_state_dtype dt = (enum adamw_state_dtype)t->o.state_dtype;
        if (t->opt_tier == ZINF_TIER_DEVICE)
            return train_settle(
                t, t->be->ops->adamw_states(t->be, p, g, m, v, w16, n, dt, &at, h, step, scale));
        bool f16 = w16 && t->be->wdt == BACKEND_F16;
        int r = adamw_update_states(dt, p, g, m, v, w16 && !f16 ? w16 : NULL, n, &at, h, step,
                                    scale);
        if (r == 0 && f16) ops_cast_f32_to_f16(w16, p, n);
        return r;
    }
    if (t->opt_tier == ZINF_TIER_DEVICE)
        return train_settle(t, t->be->ops->adamw(t->be, p, g, m, v, w16, n, h, step, scale));
    if (w16 && t->be->wdt == BACKEND_F16) {
        int r = adamw_update(p, g, m, v, n, h, step, scale);
        if (r == 0) ops_cast_f32_to_f16(w16, p, n);
        return r;
    }
    if (w16) return adamw_update_bf16(p, g, m, v, w16, n, h, step, scale);
    return adamw_update(p, g, m, v, n, h, step, scale);
}

/* Below stage 3, every rank takes the others' parts of tensor i's `whole` (elements of esz
 * bytes, the rank's own part at its shard's place): through the device tier's buffer L
 * (world x shard floats, the tensor's local gradient buffer, free in the optimizer phase)
 * when the update ran on a GPU, else through host memory (in place when the parts tile the
 * tensor). A part cut short by the tensor's end is padded. */
static int gather_parts(struct trainer *t, int i, void *whole, size_t esz, void *L)
{
    size_t n = t->desc[i].numel, sh = train_shard_of(t, i), own = train_shard_own(t, i);
    size_t lo = MIN(train_shard_lo(t, i), n);
    char *mine = (char *)whole + lo * esz;
    int r;
    if (L) {
        const struct backend_ops *be = t->be->ops;
        char *at = (char *)L + (size_t)t->rank * sh * esz;
        if ((r = be->copy(t->be, at, mine, own * esz)) < 0 ||
            (own < sh && (r = be->zero(t->be, at + own * esz, (sh - own) * esz)) < 0) ||
            (r = train_settle(t, 0)) < 0 ||
            (r = comm_allgather(t->comm, at, L, sh * esz, COMM_BYTE)) < 0)
            return r;
        return train_settle(t, be->copy(t->be, whole, L, n * esz));
    }
    /* Where the parts tile the tensor exactly, in place: each rank's part is where the
     * others' land, so nothing is staged and the own part is not copied at all. */
    if (n == sh * (size_t)t->world)
        return comm_allgather(t->hcomm, mine, whole, sh * esz, COMM_BYTE);
    char *send = mine, *recv = (char *)t->tmp + sh * esz;
    if (own < sh) {
        send = (char *)t->tmp;
        memcpy(send, mine, own * esz);
        memset(send + own * esz, 0, (sh - own) * esz);
    }
    if ((r = comm_allgather(t->hcomm, send, recv, sh * esz, COMM_BYTE)) == 0)
        memcpy(whole, recv, n * esz);
    return r;
}

/* Across ranks: AdamW on the rank's part of tensor i (p[0..3]: p, g, m, v as registered,
 * p[4] the 16-bit copy in mixed precision, then the local gradient buffer when the update
 * runs on a GPU below stage 3), then, below stage 3, every rank takes the others' parts of
 * p and of its 16-bit copy (gathered, not cast again: each element as its owner wrote it). */
static int zero_update(struct trainer *t, int i, void **p, const struct adamw_hparams *h, int step,
                       float scale)
{
    size_t n = t->desc[i].numel, own = train_shard_own(t, i);
    size_t lo = MIN(train_shard_lo(t, i), n);
    int stage = train_stage_of(t, i);
    bool mixed = t->w != t->p;
    size_t wb = backend_dtype_bytes(t->be->wdt);
    float *pp = p[0], *mine = stage >= 3 ? pp : pp + lo;
    const float *g = stage >= 2 ? (const float *)p[1] : (const float *)p[1] + lo;
    void *w16 = !mixed ? NULL : stage >= 3 ? p[4] : (char *)p[4] + lo * wb;
    int r = update(t, i, mine, g, p[2], p[3], w16, own, h, step, scale);
    if (r < 0 || stage >= 3 || train_private(t, i)) return r;
    void *L = t->gpu_ranks && t->opt_tier == ZINF_TIER_DEVICE ? p[mixed ? 5 : 4] : NULL;
    if ((r = gather_parts(t, i, pp, sizeof(float), L)) == 0 && mixed)
        r = gather_parts(t, i, p[4], wb, L);
    return r;
}

/* With trainer_opts.digest, *digest += the digest terms of tensor i's fp32 parameters as
 * the update left them: the whole tensor on one rank, the rank's own shard on several (the
 * ranks' sums are added in trainer_step). p[0] is where the update wrote. */
static int digest_tensor(struct trainer *t, int i, void **p, uint64_t *digest)
{
    size_t n = t->desc[i].numel;
    /* A pipeline stage's tensors by their number in the whole model, its copy of wte left
     * to the first stage's. */
    if (i == t->wte_copy) return 0;
    /* Tensor parallel: a replicated tensor is rank 0's. */
    if (t->tp > 1 && t->tr && !train_tp_sliced(t, i)) return 0;
    uint32_t g = t->gidx ? (uint32_t)t->gidx[i] : (uint32_t)i;
    if (t->world > 1) {
        size_t own = train_shard_own(t, i), lo = train_shard_lo(t, i);
        const float *mine =
            train_stage_of(t, i) >= 3 ? (const float *)p[0] : (const float *)p[0] + lo;
        if (!own) return 0;
        if (t->opt_tier == ZINF_TIER_DEVICE)
            return t->be->ops->digest(t->be, mine, own, g, lo / DIGEST_BLOCK_FLOATS, digest);
        *digest += digest_floats(mine, own, g, lo / DIGEST_BLOCK_FLOATS);
        return 0;
    }
    if (t->opt_tier == ZINF_TIER_DEVICE) return t->be->ops->digest(t->be, p[0], n, g, 0, digest);
    *digest += digest_floats(p[0], n, g, 0);
    return 0;
}

/* The gradients are sums over grad_accum micro-batches of every rank (times the fp16 loss
 * scale): their mean is what is clipped and applied. Returns the factor clipping multiplies
 * that mean by; *norm = its norm, *grad_scale = what the optimizer multiplies the summed
 * gradients by (with one micro-batch and no loss scale, the clip factor itself). */
float train_clip_of(const struct trainer *t, double sumsq, double loss_scale, double *norm,
                    float *grad_scale)
{
    double K = (double)t->o.grad_accum * t->world * loss_scale;
    *norm = sqrt(sumsq) / K;
    float clip = adamw_clip_scale(K == 1 ? sumsq : sumsq / (K * K), t->o.grad_clip);
    *grad_scale = K == 1 ? clip : clip / (float)K;
    return clip;
}

/* ---- the optimizer's pipeline ------------------------------------------------------ */

/* One tensor's set in the optimizer's pipeline: asked for (zinf_fetch_async, member by
 * member) ahead of its turn, taken (zinf_wait) when its turn comes. */
struct opt_set {
    int i; /* layout index; -1: nothing asked */
    struct wave w;
    uint64_t ticket[WAVE_MAX];
    bool asked[WAVE_MAX]; /* a ticket was handed out (its pin is held) */
};

/* The members the backward leaves alone: asked for while it runs. (The gradient is still
 * being written on the device, and a pin on its host copy would refuse that release.) */
#define PRE_ROLES (1u << R_P | 1u << R_M | 1u << R_V)

/* The order the optimizer takes the tensors in: the last layout index first, which is the
 * order the backward finishes their gradients in (the last block's first, the embeddings'
 * last); an update deferred to the next forward, the layout's order, which is the forward's.
 * Each tensor's update is its own, so the order changes no bits. */
static int opt_index(const struct trainer *t, int k)
{
    return t->defer_ok ? k : t->ntensors - 1 - k;
}

/* Whether the optimizer reads ahead: pipeline_read, with its sets on the host. (On GPU
 * ranks below stage 3 it gathers the update through per-slot buffers that consecutive sets
 * may share; with the states on the device, its sets would take the backward's room.) */
static bool opt_pipelined(const struct trainer *t)
{
    return t->zc.zero.offload_optimizer.pipeline_read && !t->gpu_ranks;
}

/* The sets by position, made at the first use (of the first step's backward, so that every
 * step fetches alike and the engine's learned schedule holds from the first). */
static int opt_sets(struct trainer *t)
{
    if (t->osets) return 0;
    if (!(t->osets = calloc((size_t)t->ntensors, sizeof(*t->osets)))) return -ENOMEM;
    for (int k = 0; k < t->ntensors; k++)
        t->osets[k].i = -1;
    return 0;
}

/* Ask for the members of tensor i's set whose roles are in the mask and that are not asked
 * for yet, without waiting. A member that cannot be asked for now (no room without
 * waiting: -ENOMEM) is fetched when the set is taken. */
static void opt_ask(struct trainer *t, int i, enum zinf_tier tier, struct opt_set *s,
                    unsigned roles)
{
    if (s->i != i) {
        s->i = i;
        train_wave_optimizer(t, i, &s->w);
        memset(s->asked, 0, sizeof(s->asked));
    }
    for (int j = 0; j < s->w.n; j++)
        if (!s->asked[j] && (roles >> s->w.role[j] & 1))
            s->asked[j] =
                zinf_fetch_async(t->e, train_wave_handle(t, (enum role)s->w.role[j], s->w.idx[j]),
                                 tier, &s->ticket[j]) == 0;
}

/* Drop a set asked for and never taken (the step failed before its turn, or the tier
 * needs its room). */
static void opt_drop(struct trainer *t, struct opt_set *s, enum zinf_tier tier)
{
    for (int j = 0; s->i >= 0 && j < s->w.n; j++) {
        void *ptr;
        if (s->asked[j] && zinf_wait(t->e, s->ticket[j], &ptr) == 0)
            zinf_release(t->e, train_wave_handle(t, (enum role)s->w.role[j], s->w.idx[j]), tier, 0);
        s->asked[j] = false;
    }
    s->i = -1;
}

void train_optimizer_drop(struct trainer *t)
{
    for (int k = 0; t->osets && k < t->ntensors; k++)
        opt_drop(t, &t->osets[k], t->opt_tier);
    t->opt_pre = 0;
    t->opt_pre_bytes = 0;
}

/* Take the set at position k: wait for every ticket, then fetch what was not asked for.
 * Where the tier has no room for a member (the sets ahead hold it, or it is fragmented),
 * every pin the set took is dropped, and so are the sets asked for after it, and the set
 * is fetched again as one (zinf_fetch_all: with nothing else pinned it fits, as the budget
 * check promised). On any other error nothing of the set stays pinned. ptrs[] as
 * train_wave_fetch's. */
static int opt_take(struct trainer *t, int k, enum zinf_tier tier, void **ptrs)
{
    struct opt_set *s = &t->osets[k];
    void *m[WAVE_MAX];
    bool got[WAVE_MAX];
    int r = 0;
    for (int j = 0; j < s->w.n; j++) {
        bool asked = s->asked[j];
        int x;
        s->asked[j] = false;
        got[j] = false;
        zinf_tensor h = train_wave_handle(t, (enum role)s->w.role[j], s->w.idx[j]);
        if (asked) {
            x = zinf_wait(t->e, s->ticket[j], &m[j]);
            /* A read ahead that failed (the drive erred while it ran, maybe a step before:
             * its pin went with it) is read again now, once. */
            if (x < 0 && x != -ENOMEM && (r == 0 || r == -ENOMEM))
                x = zinf_fetch(t->e, h, tier, &m[j]);
        } else if (r == 0 || r == -ENOMEM) {
            x = zinf_fetch(t->e, h, tier, &m[j]);
        } else {
            continue; /* the set has failed: what was not asked for is not fetched */
        }
        got[j] = x == 0;
        if (x < 0 && (r == 0 || r == -ENOMEM)) r = x;
    }
    s->i = -1;
    if (r < 0) {
        for (int j = 0; j < s->w.n; j++)
            if (got[j])
                zinf_release(t->e, train_wave_handle(t, (enum role)s->w.role[j], s->w.idx[j]), tier,
                             0);
        if (r != -ENOMEM) return r;
        for (int j = k + 1; j < t->ntensors; j++)
            opt_drop(t, &t->osets[j], tier);
        t->opt_refetched++;
        return train_wave_fetch(t, &s->w, tier, ptrs);
    }
    for (int j = 0; j < s->w.ne; j++)
        ptrs[j] = m[s->w.at[j]];
    return 0;
}

/* The room the sets asked for during the backward may take: the optimizer tier's capacity
 * less its homes and two of the largest sets (the one updated and the one ahead). */
static uint64_t opt_room(struct trainer *t)
{
    if (t->opt_room_known) return t->opt_room;
    struct zinf_stats st;
    uint64_t need[MEM_TIERS], homes[MEM_TIERS], most = 0;
    const char *what[MEM_TIERS];
    t->opt_room_known = true;
    t->opt_room = 0;
    if (zinf_stats(t->e, &st) < 0) return 0;
    train_min_budgets(t, need, homes, what);
    for (int i = 0; i < t->ntensors; i++) {
        struct wave w;
        train_wave_optimizer(t, i, &w);
        most = MAX(most, train_wave_need(t, &w, t->opt_tier, ~0u));
    }
    uint64_t cap = st.tier[t->opt_tier].capacity_bytes, keep = homes[t->opt_tier] + 2 * most;
    t->opt_room = cap > keep ? cap - keep : 0;
    return t->opt_room;
}

void train_optimizer_ahead(struct trainer *t, int done, int of)
{
    if (!opt_pipelined(t) || t->opt_tier != ZINF_TIER_HOST || of < 1 || opt_sets(t) < 0) return;
    /* Spread over the backward, so that its own reads are not queued behind them all. */
    uint64_t goal = (uint64_t)((double)opt_room(t) * MIN(done, of) / of);
    while (t->opt_pre < t->ntensors) {
        struct opt_set *s = &t->osets[t->opt_pre];
        int i = opt_index(t, t->opt_pre);
        struct wave w;
        if (train_idle(t, i)) { /* no gradient (yet): read when its turn comes, if any */
            t->opt_pre++;
            continue;
        }
        train_wave_optimizer(t, i, &w);
        uint64_t b = train_wave_need(t, &w, ZINF_TIER_HOST, PRE_ROLES);
        if (t->opt_pre_bytes + b > goal) break;
        opt_ask(t, i, ZINF_TIER_HOST, s, PRE_ROLES);
        t->opt_pre_bytes += b;
        t->opt_pre++;
    }
}

/* The bytes of position k's set for tensor i: those asked for already, or those not. */
static uint64_t opt_set_bytes(struct trainer *t, int k, int i, bool asked)
{
    struct opt_set *s = &t->osets[k];
    struct wave w;
    uint64_t b = 0;
    train_wave_optimizer(t, i, &w);
    for (int j = 0; j < w.n; j++)
        if ((s->i == i && s->asked[j]) == asked)
            b += train_role_bytes(t, (enum role)w.role[j], w.idx[j]);
    return b;
}

/* A deferred update between two of the forward's sets: the next tensors' sets asked for,
 * as many as opt_room holds (at least the next one), so that their reads run while the
 * forward computes the blocks before them. */
static void opt_ask_ahead(struct trainer *t)
{
    uint64_t room = opt_room(t), held = 0;
    for (int k = t->upd.next; k < t->ntensors; k++)
        held += opt_set_bytes(t, k, opt_index(t, k), true);
    for (int k = t->upd.next; k < t->ntensors; k++) {
        int i = opt_index(t, k);
        uint64_t more = opt_set_bytes(t, k, i, false);
        if (!more) continue;
        if (held + more > room && k > t->upd.next) break;
        opt_ask(t, i, t->opt_tier, &t->osets[k], ~0u);
        held += more;
    }
}

/* A tensor the step leaves alone (train_idle): its digest terms, from its parameters
 * as they are. */
static int digest_idle(struct trainer *t, int i, enum zinf_tier tier, uint64_t *digest)
{
    zinf_tensor h = train_wave_handle(t, R_P, i);
    zinf_engine *e = train_engine_of(t, R_P, i); /* a LoRA base may be another job's */
    void *p;
    int r = zinf_fetch(e, h, tier, &p);
    if (r < 0) return r;
    r = digest_tensor(t, i, &p, digest);
    r = train_settle(t, r);
    zinf_release(e, h, tier, 0);
    return r;
}

/* Set on the update's thread (train_update_start): the trainer's peaks are the forward's to
 * note while it runs. */
static _Thread_local bool on_update_thread;

/* Positions [t->upd.next, upto) of the update t->upd describes; each one done moves
 * upd.next past it. */
static int opt_run(struct trainer *t, int upto)
{
    struct adamw_hparams h;
    enum zinf_tier tier = t->opt_tier;
    bool mixed = t->w != t->p, ahead = opt_pipelined(t);
    int r = 0, step = t->upd.applied;
    float scale = t->upd.scale;

    adamw_hparams_defaults(&h);
    double b1, b2;
    trainer_betas_at(&t->o.sched, t->o.beta1, t->o.beta2, step, &b1, &b2);
    h.lr = t->upd.lr;
    h.beta1 = (float)b1;
    h.beta2 = (float)b2;
    h.eps = t->o.eps;
    h.l2 = t->o.optimizer == TRAINER_OPT_ADAM_L2;
    h.no_bias_correction = t->o.no_bias_correction;
    if (!t->upd.begun) {
        t->upd.begun = true;
        if (t->fault_begin) {
            t->fault_begin(t, t->fault_begin_arg);
            t->fault_begin = NULL;
        }
    }
    for (int k = t->upd.next; k < MIN(upto, t->ntensors) && r == 0; k++) {
        int i = opt_index(t, k);
        void *p[WAVE_MAX];
        uint64_t s0 = trace_on() ? now_ns() : 0;
        if (train_idle(t, i)) {
            /* An expert no token was routed to (or a MoE block's unused MLP, or a frozen
             * weight under LoRA): no gradient, no update, as torch's optimizers skip a
             * parameter whose .grad is None. Adam's
             * count stays the run's step for the others and for its next update. */
            opt_drop(t, &t->osets[k], tier);
            if (t->o.digest) r = digest_idle(t, i, tier, &t->upd.digest);
            if (r == 0) t->upd.next = k + 1;
            continue;
        }
        opt_ask(t, i, tier, &t->osets[k], ~0u);
        r = opt_take(t, k, tier, p);
        if (r < 0) break;
        /* The next set is completed only now: while this one was taken, only sets asked
         * for ahead were pinned beside it, and its fallback drops them. */
        if (ahead && k + 1 < t->ntensors && !train_idle(t, opt_index(t, k + 1))) {
            opt_ask(t, opt_index(t, k + 1), tier, &t->osets[k + 1], ~0u);
            t->opt_ahead++;
        }
        if (t->fault_err && i == t->fault_tensor) {
            r = -t->fault_err; /* as if fetching had failed */
            t->fault_err = 0;
        }
        if (r == 0) {
            /* Decay the matrices only, as GPT-2 trainers do (not biases, norms). */
            h.weight_decay = t->desc[i].ndim == 2 ? t->o.weight_decay : 0.0f;
            if (t->o.optimizer == TRAINER_OPT_ONEBIT && step > t->o.freeze_step)
                r = train_onebit_update(t, i, p, &h, scale);
            else if (t->world > 1)
                r = zero_update(t, i, p, &h, step, scale);
            else
                r = update(t, i, p[0], p[1], p[2], p[3], mixed ? p[4] : NULL, t->desc[i].numel, &h,
                           step, scale);
            if (r == 0 && t->o.digest) r = digest_tensor(t, i, p, &t->upd.digest);
        }
        train_wave_release(t, &t->osets[k].w, tier, r == 0);
        /* The forward computes with what was just written: on its way to the device now,
         * while the next tensors update, before the room their sets need evicts it from the
         * host (it would be read from the drive again). Pinned until it is there. */
        if (r == 0 && t->fwd_pin && t->nfwd_pins < (int)ARRAY_SIZE(t->fwd_pins)) {
            struct train_pin *q = &t->fwd_pins[t->nfwd_pins];
            q->h = train_wave_handle(t, R_W, i);
            if (zinf_fetch_async(t->e, q->h, ZINF_TIER_DEVICE, &q->ticket) == 0) t->nfwd_pins++;
        }
        if (s0)
            trace_span("train", t->upd.pending ? "update before its forward" : "optimizer", s0,
                       t->desc[i].name, tier == ZINF_TIER_DEVICE ? "on the device" : "on the host",
                       (int64_t)train_role_bytes(t, R_P, i));
        if (!on_update_thread) train_note_peaks(t); /* the forward notes them meanwhile */
        if (r == 0) t->upd.next = k + 1;
    }
    return r;
}

/* The update of step `step` (Adam's count) at rate lr, the gradients times scale. With
 * offload_optimizer.pipeline_read (on unless the config turns it off), the first sets'
 * parameters and Adam states were asked for during the backward (train_optimizer_ahead),
 * and each next set is asked for while one is updated; the one before is written back
 * behind them by the engine (write-behind), so reading, updating and writing run at once. */
int train_optimize(struct trainer *t, int step, float lr, float scale, uint64_t *digest)
{
    int r = opt_sets(t);
    if (r < 0) return r;
    t->upd = (struct train_update){.step = step, .applied = step, .lr = lr, .scale = scale};
    r = opt_run(t, t->ntensors);
    *digest += t->upd.digest;
    t->upd = (struct train_update){0};
    train_optimizer_drop(t);
    return r;
}

/* ---- the update deferred to the next forward ------------------------------------ */

void train_update_defer(struct trainer *t, int step, int applied, float lr, float scale)
{
    t->upd = (struct train_update){
        .pending = true, .step = step, .applied = applied, .lr = lr, .scale = scale};
}

void train_update_unpin(struct trainer *t)
{
    for (int k = 0; k < t->nfwd_pins; k++) {
        void *ptr;
        if (zinf_wait(t->e, t->fwd_pins[k].ticket, &ptr) == 0)
            zinf_release(t->e, t->fwd_pins[k].h, ZINF_TIER_DEVICE, 0);
    }
    t->nfwd_pins = 0;
}

int train_update_until(struct trainer *t, int upto, bool pin)
{
    if (!t->upd.pending) return 0;
    int r = opt_sets(t);
    t->fwd_pin = pin;
    if (r == 0) r = opt_run(t, upto);
    t->fwd_pin = false;
    if (r < 0) {
        /* The tensors before upd.next hold the update, the others none of it (a set that
         * failed to arrive was not changed), and nothing has touched their gradients yet:
         * the next try goes on from there. */
        train_optimizer_drop(t);
        return r;
    }
    if (t->upd.next < t->ntensors) {
        opt_ask_ahead(t);
        return 0;
    }
    if (t->o.digest) {
        t->digest = t->upd.digest;
        t->have_digest = true;
        t->digest_step = t->upd.step;
    }
    t->upd = (struct train_update){0};
    train_optimizer_drop(t);
    return 0;
}

int train_update_finish(struct trainer *t)
{
    return t->torn ? t->torn : train_update_until(t, t->ntensors, false);
}

/* The update's thread: one request at a time, train_update_until of the next block's sets,
 * while the forward computes the block before it. Its AdamW runs on this thread alone, so
 * that it takes one core's share beside the forward's threads rather than a team of its
 * own (the update's bits do not depend on the split: each element is its own). */
static void *update_thread(void *arg)
{
    struct trainer *t = arg;
    on_update_thread = true;
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
    pthread_mutex_lock(&t->umu);
    for (;;) {
        while (!t->ubusy && !t->ustop)
            pthread_cond_wait(&t->ucv, &t->umu);
        if (!t->ubusy) break; /* stopping, and nothing asked */
        int upto = t->uupto;
        pthread_mutex_unlock(&t->umu);
        int r = train_update_until(t, upto, true);
        pthread_mutex_lock(&t->umu);
        t->ur = r;
        t->ubusy = false;
        pthread_cond_broadcast(&t->ucv);
    }
    pthread_mutex_unlock(&t->umu);
    return NULL;
}

void train_update_start(struct trainer *t, int upto)
{
    if (!t->upd.pending || t->upd.next >= upto) return;
    if (!t->uth_started && !t->uth_failed) {
        t->ustop = false;
        t->uth_started = pthread_create(&t->uth, NULL, update_thread, t) == 0;
        t->uth_failed = !t->uth_started; /* not asked again for every block */
        if (t->uth_started) pthread_setname_np(t->uth, "zinf-update");
    }
    /* No thread: nothing here. The forward's own train_update_until before the block runs
     * whatever no thread ran, as it always does. */
    if (!t->uth_started) return;
    pthread_mutex_lock(&t->umu);
    t->uupto = upto;
    t->ubusy = true;
    t->ur = 0;
    pthread_cond_broadcast(&t->ucv);
    pthread_mutex_unlock(&t->umu);
}

int train_update_join(struct trainer *t)
{
    pthread_mutex_lock(&t->umu);
    while (t->ubusy)
        pthread_cond_wait(&t->ucv, &t->umu);
    int r = t->ur;
    t->ur = 0;
    pthread_mutex_unlock(&t->umu);
    return r;
}

void train_update_stop(struct trainer *t)
{
    if (!t->uth_started) return;
    (void)train_update_join(t);
    pthread_mutex_lock(&t->umu);
    t->ustop = true;
    pthread_cond_broadcast(&t->ucv);
    pthread_mutex_unlock(&t->umu);
    pthread_join(t->uth, NULL);
    t->uth_started = false;
}
