/*
 * trainer_lora.c - LoRA fine-tuning (trainer_opts.lora): low-rank adapters trained on a
 * frozen model.
 *
 * The model's tensors keep their layout and their fp32 and 16-bit copies (p, w), but the
 * frozen ones get no gradient, no Adam m and v: nothing is registered for them, the backward
 * computes none (gpt_lora.h), and the optimizer leaves them alone as it does an idle expert
 * (train_idle), their digest terms taken as they are. The adapters are appended after the
 * model's layout, block by block, target by target (enum gpt_lora_target), A (r, in) then
 * B (out, r), each a tensor with all four roles; A starts as PEFT's kaiming-uniform from the
 * run's seed, B at 0, so that step 1's loss is the base model's.
 *
 * What a run with adapters cannot do is refused here, naming it: several ranks (ZeRO over the
 * adapters), pipeline, tensor- or sequence-parallel ranks, MoE blocks, micro-batches (their
 * exact accumulation keeps the model's local gradients), a backend without the LoRA ops
 * (CUDA's). The update deferred to the next forward is turned off: it updates tensors in the
 * layout's order, and the adapters come after the blocks that read them.
 *
 * Not here: the math (gpt_lora.c), the phases' sets (trainer_step.c), the export (zinf train).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "train/gpt_lora.h"
#include "train/trainer_impl.h"

int train_lora_opts_check(const struct trainer_opts *o, char *err, size_t errlen)
{
    const struct trainer_lora *l = &o->lora;
    if (l->r == 0) return 0;
    if (l->r < 0 || l->r > o->model.C) {
        snprintf(err, errlen, "--lora-rank %d (zinf.train.lora.rank): it must be in [1, %d], the "
                 "model's width",
                 l->r, o->model.C);
        return -EINVAL;
    }
    if (!(l->alpha >= 0.0f) || l->alpha > 1e6f) { /* 0: r, a scale of 1 */
        snprintf(err, errlen, "--lora-alpha %g (zinf.train.lora.alpha): it must be above 0",
                 (double)l->alpha);
        return -EINVAL;
    }
    if (!l->targets || (l->targets & ~GPT_LORA_ALL)) {
        snprintf(err, errlen, "--lora-targets (zinf.train.lora.targets): no linear of GPT-2's "
                 "(c_attn, c_proj, c_fc) is named");
        return -EINVAL;
    }
    if (l->dropout != 0.0f) {
        snprintf(err, errlen, "--lora-dropout %g (zinf.train.lora.dropout): only 0 is supported",
                 (double)l->dropout);
        return -EINVAL;
    }
    const char *no = o->moe.E            ? "--experts (moe.num_experts)"
                     : o->grad_accum > 1 ? "--accumulate above 1 (gradient_accumulation_steps)"
                     : o->world > 1      ? "several ranks (ZeRO over the adapters)"
                                         : NULL;
    if (no) {
        snprintf(err, errlen, "--lora-rank with %s: not supported; train the adapters on one "
                 "rank, one micro-batch a step", no);
        return -EINVAL;
    }
    return 0;
}

static int ntargets(const struct trainer *t)
{
    return __builtin_popcount(t->o.lora.targets);
}

int train_lora_count(const struct trainer *t)
{
    return t->o.lora.r ? 2 * t->cfg.L * ntargets(t) : 0;
}

int train_lora_layout(struct trainer *t, char *err, size_t errlen)
{
    const struct trainer_lora *l = &t->o.lora;
    t->lora_first = t->ntensors - train_lora_count(t);
    if (!l->r) return 0;
    const char *no = t->pp > 1   ? "pipeline stages"
                     : t->tp > 1 ? "tensor-parallel ranks"
                     : t->sp > 1 ? "sequence-parallel ranks"
                     : t->world > 1 ? "several ranks (ZeRO over the adapters)"
                     : !strcmp(t->be->name, "cuda") ? "the CUDA backend"
                                                    : NULL;
    if (no) {
        snprintf(err, errlen, "--lora-rank with %s: not supported; the adapters train on one "
                 "rank of the CPU backend",
                 no);
        return -EINVAL;
    }
    size_t r = (size_t)l->r;
    int n = t->lora_first;
    size_t off = t->desc[n - 1].offset + t->desc[n - 1].numel;
    for (int k = 0; k < t->cfg.L; k++)
        for (int j = 0; j < GPT_LORA_NTARGETS; j++) {
            if (!(l->targets & (1u << j))) continue;
            size_t out, in;
            gpt_lora_dims(&t->cfg, j, &out, &in);
            for (int ab = 0; ab < 2; ab++) {
                struct gpt_tensor_desc *d = &t->desc[n++];
                *d = (struct gpt_tensor_desc){.block = k,
                                              .slot = GPT_BLOCK_NSLOTS + 1 + 2 * j + ab,
                                              .ndim = 2,
                                              .shape = {ab ? out : r, ab ? r : in},
                                              .numel = r * (ab ? out : in),
                                              .offset = off};
                gpt_lora_name(k, j, ab, d->name, sizeof(d->name));
                off += d->numel;
            }
        }
    return 0;
}

bool train_frozen(const struct trainer *t, int i)
{
    return t->o.lora.r && i < t->lora_first;
}

bool train_idle(const struct trainer *t, int i)
{
    return train_frozen(t, i) || train_moe_idle(t, i);
}

int train_lora_index(const struct trainer *t, int k, int j, int ab)
{
    unsigned m = t->o.lora.targets;
    if (!t->o.lora.r || !(m & (1u << j))) return -1;
    int pos = __builtin_popcount(m & ((1u << j) - 1));
    return t->lora_first + 2 * (k * ntargets(t) + pos) + ab;
}

bool train_lora_adapter(const struct trainer *t, int i)
{
    return t->o.lora.r && i >= t->lora_first;
}

int train_lora_init(const struct trainer *t, int i, float *dst)
{
    const struct gpt_tensor_desc *d = &t->desc[i];
    int j = (d->slot - GPT_BLOCK_NSLOTS - 1) / 2, ab = (d->slot - GPT_BLOCK_NSLOTS - 1) % 2;
    if (ab)
        memset(dst, 0, d->numel * sizeof(float)); /* B = 0: the base model's function */
    else
        gpt_lora_init_a(&t->cfg, d->block, j, t->o.lora.r, dst, t->o.seed);
    return 0;
}

/* "rank 4, alpha 8, targets c_attn" */
static const char *lora_said(const struct lora_state *s, char *buf, size_t len)
{
    char tg[32];
    snprintf(buf, len, "--lora-rank %d --lora-alpha %g --lora-targets %s", s->r,
             (double)(s->alpha > 0 ? s->alpha : (float)s->r),
             gpt_lora_targets_name(s->targets, tg, sizeof(tg)));
    return buf;
}

int train_lora_state(struct trainer *t, char *err, size_t errlen)
{
    const struct trainer_lora *l = &t->o.lora;
    struct lora_state want = {.magic = LORA_MAGIC, .r = l->r, .targets = l->targets,
                              .alpha = l->alpha},
                      saved;
    enum zinf_tier home = train_home_of(t->zc.zero.offload_param.device);
    zinf_tensor h;
    char a[96], b[96];
    int r;
    if (!t->o.resume) {
        /* Through the daemon, --overwrite starts the job over: a LoRA run's settings left in
         * it would be taken again (or make a run without adapters look like one). */
        if (t->remote && t->o.overwrite && zinf_lookup(t->e, LORA_NAME, &h) == 0 &&
            (r = zinf_unregister(t->e, h)) < 0) {
            snprintf(err, errlen, "%s: %s", LORA_NAME, zinf_strerror(r));
            return r;
        }
        if (!l->r) return 0;
        if ((r = zinf_register(t->e, LORA_NAME, sizeof(want), home, &h)) == 0)
            r = zinf_write(t->e, h, 0, &want, sizeof(want));
        if (r < 0) snprintf(err, errlen, "%s: %s", LORA_NAME, zinf_strerror(r));
        return r;
    }
    r = zinf_lookup(t->e, LORA_NAME, &h);
    if (r == -ENOENT && !l->r) return 0;
    if (r == -ENOENT) {
        snprintf(err, errlen, "--resume with --lora-rank: the saved run trains no adapters "
                 "(resume it without --lora-rank, or start a LoRA run from its export with "
                 "--init)");
        return -EINVAL;
    }
    if (r == 0) r = zinf_read(t->e, h, 0, &saved, sizeof(saved));
    if (r < 0) {
        snprintf(err, errlen, "%s: %s", LORA_NAME, zinf_strerror(r));
        return r;
    }
    if (saved.magic != LORA_MAGIC) {
        snprintf(err, errlen, "--resume: %s is not a LoRA run's settings", LORA_NAME);
        return -EINVAL;
    }
    if (!l->r || saved.r != want.r || saved.targets != want.targets ||
        (saved.alpha > 0 ? saved.alpha : (float)saved.r) != trainer_lora_alpha(&t->o)) {
        snprintf(err, errlen, "--resume: the saved run trains LoRA adapters (%s); this run %s%s: "
                 "give the saved run's",
                 lora_said(&saved, a, sizeof(a)), l->r ? "asks for " : "trains none",
                 l->r ? lora_said(&want, b, sizeof(b)) : "");
        return -EINVAL;
    }
    return 0;
}

float train_lora_scale(const struct trainer *t)
{
    return trainer_lora_alpha(&t->o) / (float)t->o.lora.r;
}

float trainer_lora_alpha(const struct trainer_opts *o)
{
    return o->lora.alpha > 0.0f ? o->lora.alpha : (float)o->lora.r;
}
