/*
 * trainer_optim.c - the optimizer phase of a step: for every tensor, its parameters,
 * gradient and Adam states fetched to where the optimizer runs, clipped and updated by
 * AdamW (only the rank's own shard with ZeRO), the device's copy refreshed, and the
 * parameters' digest summed on request; and the clipping scale from the gradient norm.
 *
 * Not here: the norm's sum across ranks and the reductions (trainer_shards.c), the loss
 * scaler (loss_scale.c), the AdamW kernels (adamw.c, kernels/).
 */
#include <math.h>
#include <string.h>

#include "comm/comm.h"
#include "common.h"
#include "train/adamw.h"
#include "train/backend.h"
#include "train/digest.h"
#include "train/ops.h"
#include "train/trainer_impl.h"
#include "trace.h"

/* AdamW over every tensor where the optimizer's states live: on the device with the
 * backend's fused kernel when they are homed there, else on the host. With bf16 weights the
 * update writes the bf16 copy too (released dirty: the engine carries it to the device on
 * its next fetch there). The learned schedule prefetches the next tensor's parts while this
 * one is updated. */
/* Across ranks: AdamW on the rank's part of tensor i (p[0..3]: p, g, m, v as registered),
 * then, below stage 3, every rank takes the others' parts of p. */
static int zero_update(struct trainer *t, int i, void **p, const struct adamw_hparams *h,
                       int step, float scale)
{
    size_t n = t->desc[i].numel, sh = train_shard_of(t, i), own = train_shard_own(t, i);
    size_t lo = train_shard_lo(t, i);
    int stage = train_stage_of(t, i);
    float *pp = p[0], *mine = stage >= 3 ? pp : pp + MIN(lo, n);
    const float *g = stage >= 2 ? (const float *)p[1] : (const float *)p[1] + MIN(lo, n);
    int r = own ? adamw_update(mine, g, p[2], p[3], own, h, step, scale) : 0;
    if (r < 0 || stage >= 3) return r;
    /* A whole shard is sent from where it is; one cut short by the tensor's end is padded. */
    float *send = mine, *recv = t->tmp + sh;
    if (own < sh) {
        send = t->tmp;
        memcpy(send, mine, own * sizeof(float));
        memset(send + own, 0, (sh - own) * sizeof(float));
    }
    if ((r = comm_allgather(t->comm, send, recv, sh, COMM_F32)) == 0)
        memcpy(pp, recv, n * sizeof(float));
    return r;
}

/* With trainer_opts.digest, *digest += the digest terms of tensor i's fp32 parameters as
 * the update left them: the whole tensor on one rank, the rank's own shard on several (the
 * ranks' sums are added in trainer_step). p[0] is where the update wrote. */
static int digest_tensor(struct trainer *t, int i, void **p, uint64_t *digest)
{
    size_t n = t->desc[i].numel;
    if (t->world > 1) {
        size_t own = train_shard_own(t, i), lo = train_shard_lo(t, i);
        const float *mine =
            train_stage_of(t, i) >= 3 ? (const float *)p[0] : (const float *)p[0] + lo;
        if (own) *digest += digest_floats(mine, own, (uint32_t)i, lo / DIGEST_BLOCK_FLOATS);
        return 0;
    }
    if (t->opt_tier == ZINF_TIER_DEVICE)
        return t->be->ops->digest(t->be, p[0], n, (uint32_t)i, 0, digest);
    *digest += digest_floats(p[0], n, (uint32_t)i, 0);
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

/* The update of step `step` (Adam's count) at rate lr, the gradients times scale. */
int train_optimize(struct trainer *t, int step, float lr, float scale, uint64_t *digest)
{
    struct adamw_hparams h;
    enum zinf_tier tier = t->opt_tier;
    bool mixed = t->w != t->p;
    int r = 0;

    adamw_hparams_defaults(&h);
    h.lr = lr;
    h.beta1 = t->o.beta1;
    h.beta2 = t->o.beta2;
    h.eps = t->o.eps;
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        struct wave w;
        void *p[WAVE_MAX];
        uint64_t s0 = trace_on() ? now_ns() : 0;
        train_wave_optimizer(t, i, &w);
        if ((r = train_wave_fetch(t, &w, tier, p)) < 0) break;
        if (t->fault_err && i == t->fault_tensor) {
            r = -t->fault_err; /* as if fetching had failed */
            t->fault_err = 0;
        }
        if (r == 0) {
            /* Decay the matrices only, as GPT-2 trainers do (not biases, norms). */
            h.weight_decay = t->desc[i].ndim == 2 ? t->o.weight_decay : 0.0f;
            if (t->world > 1)
                r = zero_update(t, i, p, &h, step, scale);
            else if (tier == ZINF_TIER_DEVICE)
                r = train_settle(t, t->be->ops->adamw(t->be, p[0], p[1], p[2], p[3],
                                                      mixed ? p[4] : NULL, t->desc[i].numel, &h,
                                                      step, scale));
            else if (mixed && t->be->wdt == BACKEND_F16) {
                if ((r = adamw_update(p[0], p[1], p[2], p[3], t->desc[i].numel, &h, step, scale)) ==
                    0)
                    ops_cast_f32_to_f16(p[4], p[0], t->desc[i].numel);
            } else if (mixed)
                r = adamw_update_bf16(p[0], p[1], p[2], p[3], p[4], t->desc[i].numel, &h, step,
                                      scale);
            else
                r = adamw_update(p[0], p[1], p[2], p[3], t->desc[i].numel, &h, step, scale);
            if (r == 0 && t->o.digest) r = digest_tensor(t, i, p, digest);
        }
        train_wave_release(t, &w, tier, r == 0);
        if (s0)
            trace_span("train", "optimizer", s0, t->desc[i].name,
                       tier == ZINF_TIER_DEVICE ? "on the device" : "on the host",
                       (int64_t)train_role_bytes(t, R_P, i));
        train_note_peaks(t);
    }
    return r;
}
