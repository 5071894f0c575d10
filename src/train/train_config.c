/*
 * train_config.c - what a DeepSpeed-style config means for `zinf train` (train_config.h):
 * the zinf.train section, then DeepSpeed's batch, accumulation, clipping, optimizer,
 * scheduler and precision keys, under the command line's options, and the trainer's own
 * check of the result. `zinf train` and `zinf config check` both call it, so that whatever
 * one refuses for a config reason the other refuses with the same words (and the training
 * tuner's search, tune_search.c, for the point it plans).
 */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common.h"
#include "train/onebit.h"
#include "train/train_config.h"

#define GIVEN(opt) (given & (1u << ((opt)-O_LAYERS)))

static bool same_name(const char *a, const char *b)
{
    return strcasecmp(a, b) == 0;
}

/* DeepSpeed's training keys into o, under the options given on the command line (they take
 * precedence) and the zinf.train section (a disagreement with it is refused). "auto" is
 * resolved from the options, as Hugging Face's DeepSpeed integration does. */
static int apply_deepspeed(struct zinf_config *zc, struct trainer_opts *o, unsigned given,
                           struct train_config_applied *ds, char *err, size_t errlen)
{
    const struct config_train_keys *k = &zc->train;
    bool micro = config_given(zc, "train_micro_batch_size_per_gpu") &&
                 !config_is_auto(zc, "train_micro_batch_size_per_gpu");
    bool accum = config_given(zc, "gradient_accumulation_steps") &&
                 !config_is_auto(zc, "gradient_accumulation_steps");

    /* A value both the command line and the config give explicitly must agree: refused
     * as Hugging Face's Trainer refuses a DeepSpeed value that differs from its
     * TrainingArguments ("auto" takes the option's). */
    char bad[512] = "";
    size_t nbad = 0;
#define DISAGREE(cond, ...)                                                                        \
    do {                                                                                           \
        if ((cond) && nbad < sizeof(bad))                                                          \
            nbad += (size_t)snprintf(bad + nbad, sizeof(bad) - nbad, __VA_ARGS__);                 \
    } while (0)
    DISAGREE(micro && GIVEN(O_BATCH) && o->batch != k->micro_batch,
             "%strain_micro_batch_size_per_gpu=%d vs --batch %d", nbad ? "; " : "",
             k->micro_batch, o->batch);
    DISAGREE(accum && GIVEN(O_ACCUM) && o->grad_accum != k->grad_accum,
             "%sgradient_accumulation_steps=%d vs --accumulate %d", nbad ? "; " : "",
             k->grad_accum, o->grad_accum);
    bool lr = config_given(zc, "optimizer.params.lr") && !config_is_auto(zc, "optimizer.params.lr");
    bool wd = config_given(zc, "optimizer.params.weight_decay") &&
              !config_is_auto(zc, "optimizer.params.weight_decay");
    bool clip = config_given(zc, "gradient_clipping") && !config_is_auto(zc, "gradient_clipping");
    DISAGREE(lr && GIVEN(O_LR) && (float)k->optimizer.lr != o->lr,
             "%soptimizer.params.lr=%g vs --lr %g", nbad ? "; " : "", k->optimizer.lr, o->lr);
    DISAGREE(wd && GIVEN(O_WD) && (float)k->optimizer.weight_decay != o->weight_decay,
             "%soptimizer.params.weight_decay=%g vs --weight-decay %g", nbad ? "; " : "",
             k->optimizer.weight_decay, o->weight_decay);
    DISAGREE(clip && GIVEN(O_CLIP) && (float)k->grad_clip != o->grad_clip,
             "%sgradient_clipping=%g vs --clip %g", nbad ? "; " : "", k->grad_clip, o->grad_clip);
#undef DISAGREE
    if (nbad) {
        snprintf(err, errlen,
                 "the config and the command line disagree: %s (set these to \"auto\" in "
                 "the config, or leave the options out)",
                 bad);
        return -EINVAL;
    }

    if (micro && !GIVEN(O_BATCH)) {
        if (zc->zinf.train.batch && zc->zinf.train.batch != k->micro_batch) {
            snprintf(err, errlen,
                     "train_micro_batch_size_per_gpu %d and zinf.train.batch %d "
                     "disagree: give one",
                     k->micro_batch, zc->zinf.train.batch);
            return -EINVAL;
        }
        o->batch = k->micro_batch;
    }
    if (accum && !GIVEN(O_ACCUM)) o->grad_accum = k->grad_accum;
    /* The values the run uses, before any "auto" is filled from them: so an explicit
     * optimizer.params.lr is what warmup_max_lr "auto" becomes, as in Hugging Face's. */
    if (lr && !GIVEN(O_LR)) o->lr = (float)k->optimizer.lr;
    if (wd && !GIVEN(O_WD)) o->weight_decay = (float)k->optimizer.weight_decay;
    if (clip && !GIVEN(O_CLIP)) o->grad_clip = (float)k->grad_clip;

    /* "auto": what the options say. fp16 and bf16 "auto" are on only where --precision
     * asks for that type, as Hugging Face's are only with --fp16 or --bf16. */
    struct config_auto_inputs in;
    trainer_auto_inputs(o, &in);
    config_resolve_auto(zc, &in, ds->autos, sizeof(ds->autos));

    uint64_t tbs = k->train_batch_size;
    if (config_given(zc, "train_batch_size") && tbs) {
        /* DeepSpeed's rule: train_batch_size = micro batch x accumulation x ranks. */
        uint64_t ranks = (uint64_t)MAX(1, o->world);
        if (!micro && !GIVEN(O_BATCH) && !zc->zinf.train.batch &&
            tbs % ((uint64_t)o->grad_accum * ranks) == 0)
            o->batch = (int)(tbs / ((uint64_t)o->grad_accum * ranks));
        else if (!accum && !GIVEN(O_ACCUM) && tbs % ((uint64_t)o->batch * ranks) == 0)
            o->grad_accum = (int)(tbs / ((uint64_t)o->batch * ranks));
        uint64_t per = (uint64_t)o->batch * (uint64_t)o->grad_accum;
        if (tbs != per * ranks) {
            /* A config for several ranks read as one rank: say how to run it. */
            char hint[160] = "";
            if (ranks == 1 && tbs % per == 0 && tbs / per <= 64)
                snprintf(hint, sizeof(hint),
                         "; a config for %llu ranks? (zinf launch -n %llu runs it; zinf config "
                         "check --ranks %llu checks it)",
                         (unsigned long long)(tbs / per), (unsigned long long)(tbs / per),
                         (unsigned long long)(tbs / per));
            snprintf(err, errlen,
                     "train_batch_size %llu is not the micro batch %d x %d "
                     "gradient accumulation steps x %llu rank%s%s",
                     (unsigned long long)tbs, o->batch, o->grad_accum, (unsigned long long)ranks,
                     ranks == 1 ? "" : "s", hint);
            return -EINVAL;
        }
    }

    snprintf(ds->optimizer, sizeof(ds->optimizer), "AdamW");
    bool lamb = false, onebit = false;
    if (k->optimizer.type[0]) {
        lamb = same_name(k->optimizer.type, "Lamb");
        onebit = same_name(k->optimizer.type, "OneBitAdam");
        if (!same_name(k->optimizer.type, "AdamW") && !same_name(k->optimizer.type, "Adam") &&
            !lamb && !onebit) {
            snprintf(err, errlen,
                     "optimizer.type \"%s\": %szinf train runs \"Adam\", \"AdamW\", \"Lamb\" "
                     "and \"OneBitAdam\"",
                     k->optimizer.type,
                     same_name(k->optimizer.type, "ZeroOneAdam") ? "0/1 Adam is not built; " : "");
            return -EINVAL;
        }
        snprintf(ds->optimizer, sizeof(ds->optimizer), "%s", k->optimizer.type);
    }
    int ro = train_config_onebit(zc, o, onebit, err, errlen);
    if (ro < 0) return ro;
    /* What DeepSpeed's optimizers take: a parameter of one given to another is refused, as
     * their constructors refuse an unexpected keyword. */
    static const char *const lamb_only[] = {"optimizer.params.max_coeff",
                                            "optimizer.params.min_coeff",
                                            "optimizer.params.eps_inside_sqrt"};
    for (size_t q = 0; q < sizeof(lamb_only) / sizeof(lamb_only[0]); q++)
        if (!lamb && config_given(zc, lamb_only[q])) {
            snprintf(err, errlen, "%s is Lamb's: optimizer.type is \"%s\"", lamb_only[q],
                     ds->optimizer);
            return -EINVAL;
        }
    if (lamb && config_given(zc, "optimizer.params.adam_w_mode")) {
        snprintf(err, errlen, "optimizer.params.adam_w_mode is Adam's: optimizer.type is \"%s\"",
                 ds->optimizer);
        return -EINVAL;
    }
    /* DeepSpeed's rule: "Adam" is AdamW unless adam_w_mode is false; "AdamW" is AdamW. */
    o->optimizer = lamb     ? TRAINER_OPT_LAMB
                   : onebit ? TRAINER_OPT_ONEBIT
                   : same_name(ds->optimizer, "Adam") && !k->optimizer.adam_w_mode
                       ? TRAINER_OPT_ADAM_L2
                       : TRAINER_OPT_ADAMW;
    if (o->optimizer == TRAINER_OPT_ADAM_L2)
        snprintf(ds->optimizer, sizeof(ds->optimizer), "Adam (L2, adam_w_mode false)");
    /* DeepSpeed's OneBitAdam takes bias_correction and applies none. */
    o->no_bias_correction = onebit || !k->optimizer.bias_correction;
    o->lamb_max_coeff = (float)k->optimizer.max_coeff;
    o->lamb_min_coeff = (float)k->optimizer.min_coeff;
    o->lamb_eps_inside_sqrt = k->optimizer.eps_inside_sqrt;
    o->beta1 = (float)k->optimizer.betas[0];
    o->beta2 = (float)k->optimizer.betas[1];
    o->eps = (float)k->optimizer.eps;
    if (!(o->eps > 0)) {
        snprintf(err, errlen, "optimizer.params.eps must be > 0, got %g", k->optimizer.eps);
        return -EINVAL;
    }

    snprintf(ds->scheduler, sizeof(ds->scheduler), "constant");
    if (k->scheduler.type[0]) {
        struct trainer_lr_schedule *s = &o->sched;
        const char *ty = k->scheduler.type;
        if (same_name(ty, "WarmupLR"))
            s->type = TRAINER_SCHED_WARMUP;
        else if (same_name(ty, "WarmupDecayLR"))
            s->type = TRAINER_SCHED_WARMUP_DECAY;
        else if (same_name(ty, "WarmupCosineLR"))
            s->type = TRAINER_SCHED_WARMUP_COSINE;
        else if (same_name(ty, "LRRangeTest"))
            s->type = TRAINER_SCHED_LR_RANGE;
        else if (same_name(ty, "OneCycle"))
            s->type = TRAINER_SCHED_ONE_CYCLE;
        else {
            snprintf(err, errlen,
                     "scheduler.type \"%s\": zinf train runs \"WarmupLR\", "
                     "\"WarmupDecayLR\", \"WarmupCosineLR\", \"OneCycle\" and \"LRRangeTest\"",
                     ty);
            return -EINVAL;
        }
        snprintf(ds->scheduler, sizeof(ds->scheduler), "%s", ty);
        s->min_lr = k->scheduler.warmup_min_lr;
        /* WarmupLR's warmup_max_lr defaults to the optimizer's lr; WarmupDecayLR's to 0.001. */
        s->max_lr = config_given(zc, "scheduler.params.warmup_max_lr") ? k->scheduler.warmup_max_lr
                    : s->type == TRAINER_SCHED_WARMUP                  ? o->lr
                                                                       : 0.001;
        s->min_ratio = k->scheduler.warmup_min_ratio;
        s->cos_min_ratio = k->scheduler.cos_min_ratio;
        s->warmup_steps = k->scheduler.warmup_num_steps;
        s->total_steps = k->scheduler.total_num_steps;
        s->linear = k->scheduler.warmup_type == 1;
        s->range_min_lr = k->scheduler.lr_range_test_min_lr;
        s->range_rate = k->scheduler.lr_range_test_step_rate;
        s->range_size = k->scheduler.lr_range_test_step_size;
        s->range_staircase = k->scheduler.lr_range_test_staircase;
        const typeof(k->scheduler) *c = &k->scheduler;
        s->cycle_min_lr = c->cycle_min_lr;
        s->cycle_max_lr = c->cycle_max_lr;
        s->decay_lr_rate = c->decay_lr_rate;
        s->cycle_first_size = c->cycle_first_step_size;
        s->cycle_second_size = config_given(zc, "scheduler.params.cycle_second_step_size")
                                   ? c->cycle_second_step_size
                                   : -1;
        s->cycle_first_stairs = c->cycle_first_stair_count;
        s->cycle_second_stairs = config_given(zc, "scheduler.params.cycle_second_stair_count")
                                     ? c->cycle_second_stair_count
                                     : -1;
        s->decay_step_size = c->decay_step_size;
        s->cycle_momentum = c->cycle_momentum;
        s->cycle_min_mom = c->cycle_min_mom;
        s->cycle_max_mom = c->cycle_max_mom;
        s->decay_mom_rate = c->decay_mom_rate;
        if (s->type == TRAINER_SCHED_ONE_CYCLE &&
            (!config_given(zc, "scheduler.params.cycle_min_lr") ||
             !config_given(zc, "scheduler.params.cycle_max_lr"))) {
            snprintf(err, errlen,
                     "scheduler.params.cycle_min_lr and cycle_max_lr: OneCycle needs both");
            return -EINVAL;
        }
        /* The config's lr as written (a double, as DeepSpeed holds it), where it is the
         * lr the run uses. */
        s->base_lr = lr && !GIVEN(O_LR) ? k->optimizer.lr : 0;
        if ((s->type == TRAINER_SCHED_WARMUP_DECAY || s->type == TRAINER_SCHED_WARMUP_COSINE) &&
            s->total_steps < 1) {
            snprintf(err, errlen, "scheduler.params.total_num_steps: %s needs it", ty);
            return -EINVAL;
        }
    }

    o->fp16 = (struct trainer_fp16){.loss_scale = k->fp16.loss_scale,
                                    .min_loss_scale = k->fp16.min_loss_scale,
                                    .initial_scale_power = k->fp16.initial_scale_power,
                                    .loss_scale_window = k->fp16.loss_scale_window,
                                    .hysteresis = k->fp16.hysteresis,
                                    .consecutive_hysteresis = k->fp16.consecutive_hysteresis};
    if (k->fp16.enabled && k->bf16.enabled && !config_is_auto(zc, "bf16.enabled")) {
        snprintf(err, errlen, "fp16.enabled and bf16.enabled are both true: give one");
        return -EINVAL;
    }
    if (k->fp16.enabled && !GIVEN(O_PRECISION)) {
        if (zc->zinf.train.precision && zc->zinf.train.precision != TRAINER_PRECISION_FP16) {
            snprintf(err, errlen, "fp16.enabled true and zinf.train.precision disagree: give one");
            return -EINVAL;
        }
        o->precision = TRAINER_PRECISION_FP16;
    }
    if (config_given(zc, "bf16.enabled") && !config_is_auto(zc, "bf16.enabled") &&
        !GIVEN(O_PRECISION)) {
        enum trainer_precision p =
            k->bf16.enabled ? TRAINER_PRECISION_BF16 : TRAINER_PRECISION_FP32;
        if (zc->zinf.train.precision && zc->zinf.train.precision != (int)p) {
            snprintf(err, errlen, "bf16.enabled %s and zinf.train.precision disagree: give one",
                     k->bf16.enabled ? "true" : "false");
            return -EINVAL;
        }
        o->precision = p;
    }

    size_t n = 0;
    ds->ignored[0] = '\0';
    for (size_t i = 0; i < zc->n_ignored && n < sizeof(ds->ignored); i++) {
        /* Across ranks stage 3 gathers ahead within stage3_max_live_parameters, and
         * gradients are reduced behind the backward (overlap_comm) when a block's fit in
         * reduce_bucket_size. */
        static const char *const used_by_ranks[] = {
            "zero_optimization.stage3_max_live",
            "zero_optimization.overlap_comm ", "zero_optimization.reduce_bucket_size "};
        bool used = false;
        for (size_t u = 0; u < sizeof(used_by_ranks) / sizeof(used_by_ranks[0]); u++)
            used |= !strncmp(zc->ignored[i], used_by_ranks[u], strlen(used_by_ranks[u]));
        if (o->world > 1 && used) continue;
        n += (size_t)snprintf(ds->ignored + n, sizeof(ds->ignored) - n, "%s%s", n ? "\n" : "",
                              zc->ignored[i]);
    }
    return 0;
}

int train_config_apply(struct zinf_config *zc, struct trainer_opts *o, unsigned given,
                       struct train_config_applied *ds, char *err, size_t errlen)
{
    /* The zinf.train section fills what the command line left out. */
#define FROM_CONFIG(opt, field, dst)                                                               \
    if (zc->zinf.train.field && !GIVEN(opt)) dst = zc->zinf.train.field;
    FROM_CONFIG(O_LAYERS, layers, o->model.L)
    FROM_CONFIG(O_DIM, dim, o->model.C)
    FROM_CONFIG(O_HEADS, heads, o->model.NH)
    FROM_CONFIG(O_SEQ, seq, o->seq)
    FROM_CONFIG(O_BATCH, batch, o->batch)
    FROM_CONFIG(O_STEPS, steps, o->steps)
    FROM_CONFIG(O_SEED, seed, o->seed)
    FROM_CONFIG(O_PRECISION, precision, o->precision)
#undef FROM_CONFIG
    /* The moe section, under --experts, --top-k and --expert-prefetch. */
    struct trainer_moe moe = {.E = GIVEN(O_EXPERTS) ? o->moe.E : zc->moe.num_experts,
                              .k = GIVEN(O_TOP_K) ? o->moe.k : zc->moe.top_k,
                              .every = zc->moe.moe_every,
                              .ep = zc->moe.ep_size,
                              .min_capacity = zc->moe.min_capacity,
                              .drop_tokens = zc->moe.drop_tokens,
                              .capacity_factor = (float)zc->moe.capacity_factor,
                              .loss_coef = (float)zc->moe.loss_coef,
                              .prefetch = GIVEN(O_EXPERT_PREFETCH) ? o->moe.prefetch : 1};
    o->moe = moe;
    o->no_start_checkpoint = !zc->zinf.train.checkpoint_start;
    o->update_in_forward = zc->zinf.train.update_in_forward;
    o->state_dtype = zc->zinf.optimizer_state_dtype;
    int r = apply_deepspeed(zc, o, given, ds, err, errlen);
    if (r < 0) return r;
    if (o->model.NH > 0 && o->model.C % o->model.NH) {
        /* Named as the user gave them: an option, the zinf.train section or the default. */
        snprintf(err, errlen, "%s %d does not divide %s %d (each head takes dim / heads)",
                 GIVEN(O_HEADS) ? "--heads" : zc->zinf.train.heads ? "zinf.train.heads"
                                                                    : "the default heads",
                 o->model.NH,
                 GIVEN(O_DIM) ? "--dim" : zc->zinf.train.dim ? "zinf.train.dim" : "the default dim",
                 o->model.C);
        return -EINVAL;
    }
    return trainer_opts_check(o, err, errlen);
}
