/*
 * trainer_moe.c - mixture of experts in zinf train (trainer_opts.moe, the config's moe
 * section): the checks of its settings against each other and against the run, and the
 * model's layout with MoE blocks, where block k's MLP (k % every == 0) is a gate
 * "hK.moe.gate.w" (E,C) and E experts "hK.expertJ.fc.w" ... "hK.expertJ.proj.b" of GPT's
 * MLP shapes, initialised as GPT's MLP is (gpt_init_tensor by slot: the projection scaled
 * by 1/sqrt(2L), the gate with std 0.02). The dense layout stays as it is (every block's 12
 * tensors from block_first[k], which the dense code indexes); the MoE blocks' gates and
 * experts follow it, block by block, and a MoE block's own four MLP tensors are left unused.
 * Expert parallel (moe.ep_size = the ZeRO ranks, or a pipeline's copies of each stage): rank
 * r holds experts [r x E/ep, (r+1) x E/ep) of each block (train_moe_mine, train_moe_owner;
 * trainer_pipe_cut.c drops the others from its layout).
 *
 * Not here: the math (moe.h), the MoE blocks' phases (trainer_moe_step.c), the dense blocks
 * (trainer_step.c).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "train/backend.h"
#include "train/moe.h"
#include "train/trainer_impl.h"

int train_moe_opts_check(const struct trainer_opts *o, char *err, size_t errlen)
{
    const struct trainer_moe *m = &o->moe;
    if (m->E == 0) return 0;
    if (m->E < 1 || m->E > MOE_MAX_E) {
        snprintf(err, errlen, "moe.num_experts (--experts) %d: expected 0 (none) to %d", m->E,
                 MOE_MAX_E);
        return -EINVAL;
    }
    if (m->k != 1 && m->k != 2) {
        snprintf(err, errlen, "moe.top_k (--top-k) %d: expected 1 or 2", m->k);
        return -EINVAL;
    }
    if (m->k > m->E) {
        snprintf(err, errlen, "moe.top_k (--top-k) %d: more than the %d expert%s", m->k, m->E,
                 m->E == 1 ? "" : "s");
        return -EINVAL;
    }
    if (m->every < 1 || m->every > MAX(1, o->model.L)) {
        snprintf(err, errlen, "moe.moe_every %d: expected 1 to the %d blocks", m->every,
                 o->model.L);
        return -EINVAL;
    }
    if (!(m->capacity_factor > 0) || !isfinite(m->capacity_factor) || m->min_capacity < 0) {
        snprintf(err, errlen,
                 "moe.capacity_factor %g and moe.min_capacity %d: expected a "
                 "factor above 0 and a capacity of at least 0",
                 m->capacity_factor, m->min_capacity);
        return -EINVAL;
    }
    if (!(m->loss_coef >= 0) || !isfinite(m->loss_coef)) {
        snprintf(err, errlen, "moe.loss_coef %g: expected a finite number of at least 0",
                 m->loss_coef);
        return -EINVAL;
    }
    return 0;
}

/* The refusals that need the run's shape (after train_zero_shape and the backend). */
static int refuse(const struct trainer *t, char *err, size_t errlen)
{
    const char *why = NULL;
    if (t->tp > 1 || t->zc.tensor_parallel.autotp_size > 1)
        why = "tensor_parallel.autotp_size above 1: tensor parallel MoE blocks are not built";
    else if (t->sp > 1 || t->zc.sequence_parallel_size > 1)
        why = "sequence_parallel_size above 1: sequence parallel MoE blocks are not built";
    else if (t->world > 1 && t->stage >= 3)
        why = "zero_optimization.stage 3: gathering the experts' shards is not built (stages "
              "0-2 are)";
    if (why) {
        snprintf(err, errlen, "moe.num_experts %d with %s", t->o.moe.E, why);
        return -EINVAL;
    }
    /* The expert-parallel group: the ZeRO ranks (of each pipeline stage, its copies). */
    const struct trainer_moe *m = &t->o.moe;
    int ranks = MAX(1, t->world);
    const char *who = t->pp > 1 ? "copies of each pipeline stage" : "ranks";
    if (ranks == 1 && m->ep != 1) {
        snprintf(err, errlen,
                 "moe.ep_size %d: the expert-parallel group is the data-parallel %s, 1 here "
                 "(set ep_size to 1)",
                 m->ep, who);
        return -EINVAL;
    }
    if (ranks > 1 && m->ep != ranks) {
        snprintf(err, errlen,
                 "moe.ep_size %d with %d data-parallel %s: experts replicated on every rank "
                 "are not built; the experts are split across them (set ep_size to %d)",
                 m->ep, ranks, who, ranks);
        return -EINVAL;
    }
    if (m->E % ranks) {
        snprintf(err, errlen,
                 "moe.num_experts %d across moe.ep_size %d ranks: each rank holds E / ep "
                 "experts, so ep_size must divide num_experts",
                 m->E, ranks);
        return -EINVAL;
    }
    return 0;
}

bool train_moe_block(const struct trainer *t, int k)
{
    return t->o.moe.E > 0 && k % t->o.moe.every == 0;
}

bool train_moe_expert(const struct trainer *t, const struct gpt_tensor_desc *d)
{
    return t->o.moe.E > 0 && d->block >= 0 && d->slot >= GPT_FC_W && d->slot <= GPT_MLP_PROJ_B &&
           strstr(d->name, ".expert");
}

int train_moe_owner(const struct trainer *t, const struct gpt_tensor_desc *d, int ranks)
{
    int k, e;
    if (ranks <= 1 || !train_moe_expert(t, d)) return 0;
    if (sscanf(d->name, "h%d.expert%d.", &k, &e) != 2) return 0;
    return e / (t->o.moe.E / ranks);
}

bool train_moe_mine(const struct trainer *t, const struct gpt_tensor_desc *d)
{
    return t->ep <= 1 || !train_moe_expert(t, d) || train_moe_owner(t, d, t->ep) == t->rank;
}

int train_moe_layout(struct trainer *t, struct gpt_tensor_desc *out, size_t cap, char *err,
                     size_t errlen)
{
    const struct gpt_config *c = &t->cfg;
    int n = gpt_layout(c, NULL, 0);
    if (n < 0 || t->o.moe.E == 0) return out ? gpt_layout(c, out, cap) : n;
    int r = refuse(t, err, errlen);
    if (r < 0) return r;
    int E = t->o.moe.E, nmoe = 0;
    for (int k = 0; k < c->L; k++)
        nmoe += train_moe_block(t, k);
    /* The dense layout as it is, then each MoE block's gate and 4 E expert tensors. */
    int total = n + nmoe * (1 + 4 * E);
    if (!out) return total;
    if ((size_t)total > cap) return -EINVAL;
    gpt_layout(c, out, (size_t)n);
    size_t C = (size_t)c->C, off = out[n - 1].offset + out[n - 1].numel;
    int j = n;
    for (int k = 0; k < c->L; k++) {
        if (!train_moe_block(t, k)) continue;
        struct gpt_tensor_desc *g = &out[j++];
        *g = (struct gpt_tensor_desc){.block = k,
                                      .slot = GPT_BLOCK_NSLOTS,
                                      .ndim = 2,
                                      .shape = {(size_t)E, C},
                                      .numel = (size_t)E * C,
                                      .offset = off};
        snprintf(g->name, sizeof(g->name), "h%d.moe.gate.w", k);
        off += g->numel;
        /* gpt_layout: wte, wpe, then the blocks' 12 tensors each */
        const struct gpt_tensor_desc *mlp = &out[2 + k * GPT_BLOCK_NSLOTS];
        for (int e = 0; e < E; e++)
            for (int s = GPT_FC_W; s <= GPT_MLP_PROJ_B; s++) {
                struct gpt_tensor_desc *x = &out[j++];
                *x = mlp[s];
                x->offset = off;
                off += x->numel;
                /* "mlp.fc.w" -> "expertJ.fc.w" */
                snprintf(x->name, sizeof(x->name), "h%d.expert%d.%s", k, e,
                         gpt_block_slot_name(s) + 4);
            }
    }
    return j;
}
