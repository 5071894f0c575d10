/*
 * loss_scale.c - DeepSpeed's loss scalers (see loss_scale.h), as its
 * runtime/fp16/loss_scaler.py has them: DynamicLossScaler.update_scale with scale_factor 2,
 * and LossScaler, whose scale never moves. (Where DeepSpeed raises at the minimum scale, the
 * scale simply stays there.)
 */
#include <math.h>
#include <string.h>

#include "train/loss_scale.h"

void loss_scale_init(struct loss_scale *s, double loss_scale, int initial_scale_power,
                     int loss_scale_window, int hysteresis, double min_loss_scale,
                     bool consecutive_hysteresis)
{
    memset(s, 0, sizeof(*s));
    s->dynamic = loss_scale == 0;
    s->scale = s->dynamic ? ldexp(1.0, initial_scale_power) : loss_scale;
    s->min_scale = min_loss_scale;
    s->window = loss_scale_window;
    s->delayed_shift = hysteresis;
    s->hysteresis = hysteresis;
    s->consecutive = consecutive_hysteresis;
    s->last_overflow = -1;
}

void loss_scale_update(struct loss_scale *s, bool overflow)
{
    if (overflow)
        s->skipped++;
    if (!s->dynamic)
        return;
    if (overflow) {
        if (s->delayed_shift == 1 || s->hysteresis == 1) {
            double next = s->scale / 2;
            s->scale = next > s->min_scale ? next : s->min_scale;
        } else {
            s->hysteresis--;
        }
        s->last_overflow = s->iter;
    } else {
        if (s->consecutive)
            s->hysteresis = s->delayed_shift;
        int64_t stable = s->iter - s->last_overflow - 1;
        if (stable > 0 && stable % s->window == 0) {
            if (!s->consecutive)
                s->hysteresis = s->delayed_shift;
            s->scale *= 2;
        }
    }
    s->iter++;
}
