/*
 * trainer_weights.h - a new run's parameters from outside the trainer (zinf train --init):
 * each weight handed in whole, as fp32 in the model's layout, becomes every copy the run
 * keeps of it, and the run's step 0 is saved again with them.
 *
 * Not here: files and their formats (tools/weights_io.c reads safetensors), the trainer's
 * own initialisation (trainer_tensors.c), reading the parameters back out (their "p.<name>"
 * tensors, through zinf_read).
 */
#ifndef ZINF_TRAIN_TRAINER_WEIGHTS_H
#define ZINF_TRAIN_TRAINER_WEIGHTS_H

#include <stddef.h>

#include "train/trainer.h"

/* Writes tensor idx of gpt_layout()'s order, all numel floats of it, to dst: 0 or -errno. */
typedef int (*trainer_param_source)(void *ctx, int idx, float *dst);

/* Replace the parameters of a run that trainer_open() started anew (not resumed, no step
 * run yet) by what get gives, tensor by tensor in the layout's order: the fp32 master (at
 * ZeRO stage 3, this rank's shard of it) and the bf16 or fp16 copy the device computes
 * with, where the run has one. Then the state is checkpointed, so that the saved step 0 is
 * these weights. The Adam states stay zero, as in any new run.
 * -EINVAL for a NULL argument, a resumed run or one that has run a step. When get, a write
 * or the checkpoint fails, its -errno, and the trainer is left unusable: trainer_step and
 * trainer_checkpoint answer that error, and trainer_close keeps the step-0 state saved
 * before (the trainer's own initial weights) rather than half of these. */
int trainer_load_params(struct trainer *t, trainer_param_source get, void *ctx);

#endif
