/*
 * loss_scale.h - DeepSpeed's loss scaling for fp16 training, rule for rule (its
 * DynamicLossScaler and static LossScaler): the loss's gradient is multiplied by the scale;
 * a step whose gradients overflowed (a non-finite norm) is skipped and, dynamically, the
 * scale halves once the hysteresis is used up (never below the minimum); after
 * scale_window steps without an overflow it doubles.
 *
 * The state is plain data, so that the trainer persists it with the run and a resumed run
 * scales exactly as an uninterrupted one. Not here: where the scale is applied (the
 * backend's head) or what a skipped step leaves alone (the trainer).
 */
#ifndef ZINF_TRAIN_LOSS_SCALE_H
#define ZINF_TRAIN_LOSS_SCALE_H

#include <stdbool.h>
#include <stdint.h>

struct loss_scale {
    double scale;             /* cur_scale */
    double min_scale;
    int32_t window;           /* scale_window */
    int32_t delayed_shift;    /* hysteresis */
    int32_t hysteresis;       /* cur_hysteresis */
    int32_t consecutive;      /* consecutive_hysteresis (0 or 1) */
    int32_t dynamic;          /* 0: a static scale, never changed */
    int32_t pad_;
    int64_t iter;             /* cur_iter */
    int64_t last_overflow;    /* last_overflow_iter */
    int64_t skipped;          /* steps skipped for an overflow */
};

/* DeepSpeed's fp16 keys: loss_scale 0 is dynamic from 2^initial_scale_power, else static. */
void loss_scale_init(struct loss_scale *s, double loss_scale, int initial_scale_power,
                     int loss_scale_window, int hysteresis, double min_loss_scale,
                     bool consecutive_hysteresis);
/* After a step's backward: overflow says its gradients were not finite (the step is then
 * skipped by the caller). Updates the scale as DeepSpeed's update_scale() does. */
void loss_scale_update(struct loss_scale *s, bool overflow);

#endif
