/*
 * trainer_schedule.c - the learning-rate and momentum schedules of DeepSpeed's schedulers
 * (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest), as functions of the
 * step: trainer_lr_at and trainer_betas_at, in DeepSpeed's arithmetic operation for
 * operation, so that the rates are its rates to the last bit.
 *
 * Not here: the options that choose them (trainer.c checks them) or the step that applies
 * them (trainer_step.c, trainer_optim.c).
 */
#include <math.h>

#include "common.h"
#include "train/trainer.h"

/* OneCycle's cycle length in iterations, and where iteration `it` stands in it as a
 * factor from 0 (the cycle's ends) to 1 (its peak): DeepSpeed's _get_scale_factor, operation
 * for operation. */
static double cycle_second(const struct trainer_lr_schedule *s)
{
    return s->cycle_second_size < 0 ? s->cycle_first_size : s->cycle_second_size;
}

static double cycle_total(const struct trainer_lr_schedule *s)
{
    return s->cycle_first_size + cycle_second(s);
}

static double cycle_scale(const struct trainer_lr_schedule *s, int it)
{
    double total = cycle_total(s), ratio = s->cycle_first_size / total;
    int bi = it + 1;
    double cycle = floor(1 + bi / total);
    double x = 1. + bi / total - cycle, scale;
    int stairs;
    if (x <= ratio) {
        scale = x / ratio;
        stairs = s->cycle_first_stairs;
    } else {
        scale = (x - 1) / (ratio - 1);
        stairs = s->cycle_second_stairs < 0 ? s->cycle_first_stairs : s->cycle_second_stairs;
    }
    if (stairs > 0) {
        double ci = fmod((double)bi, total), pos;
        if (ci <= s->cycle_first_size)
            pos = ci * stairs / s->cycle_first_size;
        else
            pos = (total - ci) * stairs / cycle_second(s);
        scale = floor(pos) / stairs;
    }
    return scale;
}

void trainer_betas_at(const struct trainer_lr_schedule *s, double beta1, double beta2, int step,
                      double *b1, double *b2)
{
    int it = step - 2;
    *b1 = beta1;
    *b2 = beta2;
    if (s->type != TRAINER_SCHED_ONE_CYCLE || !s->cycle_momentum) return;
    /* Its constructor puts (cycle_min_mom, 0.99) in the optimizer; each step after sets
     * beta1 from the cycle, or past it from cycle_max_mom with its decay. */
    *b2 = 0.99;
    if (it < 0)
        *b1 = s->cycle_min_mom;
    else if (it < cycle_total(s))
        *b1 = s->cycle_max_mom - (s->cycle_max_mom - s->cycle_min_mom) * cycle_scale(s, it);
    else if (s->decay_step_size == 0 || s->decay_mom_rate == 0)
        *b1 = s->cycle_max_mom;
    else
        *b1 = s->cycle_max_mom *
              (1 + s->decay_mom_rate * ((it - cycle_total(s) + 1) / (double)s->decay_step_size));
}

double trainer_lr_at(const struct trainer_lr_schedule *s, double lr, int step)
{
    int it = step - 2; /* DeepSpeed's last_batch_iteration when step runs */
    int W = MAX(2, s->warmup_steps);
    /* DeepSpeed's arithmetic, operation for operation (1 / log W kept and multiplied), so
     * that the rates are its rates to the last bit. */
    double warm = it < 0      ? 0
                  : s->linear ? (double)it / W
                              : (1.0 / log((double)W)) * log(it + 1.0);
    if (s->base_lr > 0) lr = s->base_lr;
    switch (s->type) {
    case TRAINER_SCHED_WARMUP:
    case TRAINER_SCHED_WARMUP_DECAY: {
        if (it < 0) return s->min_lr;
        double gamma =
            it < W ? warm
            : s->type == TRAINER_SCHED_WARMUP
                ? 1.0
                : MAX(0.0, (double)(s->total_steps - it) / MAX(1.0, (double)(s->total_steps - W)));
        return s->min_lr + (s->max_lr - s->min_lr) * gamma;
    }
    case TRAINER_SCHED_WARMUP_COSINE: {
        if (it < 0) return 0;
        if (it < W) return lr * (s->min_ratio + warm * (1 - s->min_ratio));
        /* Held at the floor past total_num_steps, as DeepSpeed clamps it. */
        double progress = MIN(1.0, (double)(it - W + 1) / MAX(1, s->total_steps - W));
        double ratio = (1 + cos(M_PI * progress)) / 2;
        return lr * MAX(0.0, s->cos_min_ratio + (1 - s->cos_min_ratio) * ratio);
    }
    case TRAINER_SCHED_ONE_CYCLE: {
        if (it < 0) return s->cycle_min_lr;
        double total = cycle_total(s);
        if (it < total)
            return s->cycle_min_lr + (s->cycle_max_lr - s->cycle_min_lr) * cycle_scale(s, it);
        if (s->decay_step_size == 0 || s->decay_lr_rate == 0) return s->cycle_min_lr;
        double interval = (it - total + 1) / (double)s->decay_step_size;
        return s->cycle_min_lr / (1 + s->decay_lr_rate * interval);
    }
    case TRAINER_SCHED_LR_RANGE: {
        /* DeepSpeed's LRRangeTest: min_lr at the start (its constructor sets it), then
         * min_lr (1 + rate x interval) with interval (last_batch_iteration + 1) / size. */
        double interval = (double)(it + 1) / MAX(1, s->range_size);
        if (s->range_staircase) interval = floor(interval);
        return s->range_min_lr * (1 + s->range_rate * interval);
    }
    default:
        return lr;
    }
}
