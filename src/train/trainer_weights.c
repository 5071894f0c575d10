/*
 * trainer_weights.c - a new run's parameters from outside the trainer (trainer_weights.h):
 * every copy of a weight that the run keeps, written from one fp32 tensor, then step 0
 * saved again.
 *
 * The copies are the ones a new run's initialisation writes (train_write_params in
 * trainer_tensors.c): the fp32 master p, or this rank's shard of it at ZeRO stage 3, and the
 * 16-bit w the device computes with in bf16 and fp16 runs, cast from that master. Gradients
 * and Adam states hold nothing of the weights and stay zero.
 *
 * Not here: where the values come from (the caller's source), the layout (gpt.c).
 */
#include <errno.h>

#include "train/trainer_impl.h"
#include "train/trainer_weights.h"

int trainer_load_params(struct trainer *t, trainer_param_source get, void *ctx)
{
    if (!t || !get || t->o.resume || t->step_done != 0) return -EINVAL;
    if (t->torn) return t->torn;
    int r = train_write_params(t, get, ctx);
    /* Half of the weights replaced is no run's state: never flushed (trainer_close). */
    if (r < 0) {
        t->torn = r;
        return r;
    }
    return trainer_checkpoint(t);
}
