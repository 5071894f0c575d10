/*
 * trainer_weights.c - a new run's parameters from outside the trainer (trainer_weights.h):
 * every copy of a weight that the run keeps, written from one fp32 tensor, then step 0
 * saved again.
 *
 * The copies are the ones train_init_params() (trainer_tensors.c) writes for a new run:
 * the fp32 master p, or this rank's shard of it at ZeRO stage 3 (the tensor's slice, zeros
 * past its end), and the 16-bit w the device computes with in bf16 and fp16 runs, cast
 * from that master. Gradients and Adam states hold nothing of the weights and stay zero.
 *
 * Not here: where the values come from (the caller's source), the layout (gpt.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "train/trainer_impl.h"
#include "train/trainer_weights.h"

int trainer_load_params(struct trainer *t, trainer_param_source get, void *ctx)
{
    if (!t || !get || t->o.resume || t->step_done != 0) return -EINVAL;
    if (t->torn) return t->torn;
    float *buf = NULL;
    uint16_t *b16 = NULL;
    size_t cap = 0;
    int r = 0;
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        size_t n = t->desc[i].numel;
        bool shard = train_stage_of(t, i) >= 3;
        size_t lo = shard ? train_shard_lo(t, i) : 0, sh = shard ? train_shard_of(t, i) : n;
        size_t room = MAX(n, lo + sh); /* the whole tensor, and the shard's padding */
        if (room > cap) {
            free(buf);
            free(b16);
            buf = malloc(room * sizeof(float));
            b16 = malloc(room * sizeof(uint16_t));
            cap = room;
            if (!buf || !b16) {
                r = -ENOMEM;
                break;
            }
        }
        if ((r = get(ctx, i, buf)) < 0) break;
        if (shard) {
            /* The rank's slice of the whole tensor, zeros past its end (train_init_params). */
            size_t own = train_shard_own(t, i);
            memmove(buf, buf + lo, own * sizeof(float));
            memset(buf + own, 0, (sh - own) * sizeof(float));
        }
        r = zinf_write(t->e, t->p[i], 0, buf, sh * sizeof(float));
        if (r == 0 && t->w != t->p) r = train_write_w(t, i, buf, b16, sh);
    }
    free(buf);
    free(b16);
    /* Half of the weights replaced is no run's state: never flushed (trainer_close). */
    if (r < 0) {
        t->torn = r;
        return r;
    }
    return trainer_checkpoint(t);
}
