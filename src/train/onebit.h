/*
 * onebit.h - what the config's communication_data_type and optimizer.type "OneBitAdam"
 * mean for zinf train (train_config.c calls it): the wire of the gradients' reductions across
 * ranks (comm.h's enum comm_wire), and 1-bit Adam's keys, checked.
 *
 * Not here: the reductions (trainer_shards.c), the collectives (comm/).
 */
#ifndef ZINF_TRAIN_ONEBIT_H
#define ZINF_TRAIN_ONEBIT_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"
#include "train/trainer.h"

/* o->comm_wire from communication_data_type ("fp32" or unset, "fp16", "bf16"), and 1-bit
 * Adam's keys (onebit: optimizer.type is "OneBitAdam"): 0, or -EINVAL with err naming the
 * key. */
int train_config_onebit(const struct zinf_config *zc, struct trainer_opts *o, bool onebit,
                        char *err, size_t errlen);

#endif
