/*
 * train_config.h - what a DeepSpeed-style config means for `zinf train`, decided in one
 * place: `zinf train` runs what train_config_apply() makes of it, and `zinf config check`
 * refuses what it refuses, with the same message.
 */
#ifndef ZINF_TRAIN_TRAIN_CONFIG_H
#define ZINF_TRAIN_TRAIN_CONFIG_H

#include <stddef.h>

#include "config.h"
#include "train/trainer.h"

/* The settings that shape the model and the run that a command line may give (the values
 * of their getopt_long options, in tools/train_options.h): bit (option - O_LAYERS) of
 * `given` says one was given, and a config may not override it. */
enum train_option {
    O_LAYERS = 256,
    O_DIM,
    O_HEADS,
    O_SEQ,
    O_BATCH,
    O_STEPS,
    O_LR,
    O_WD,
    O_CLIP,
    O_SEED,
    O_PRECISION,
    O_ACCUM,
    O_EXPERTS,
    O_TOP_K,
    O_EXPERT_PREFETCH,
    O_LORA_RANK,
    O_LORA_ALPHA,
    O_LORA_TARGETS,
    O_LORA_DROPOUT,
};

/* What the config's keys did, for the start of the run (and for config check). */
struct train_config_applied {
    char autos[1024];   /* "json.path = value" lines: what each "auto" became */
    char ignored[4096]; /* the keys named as ignored, one per line */
    char optimizer[32], scheduler[32];
};

/* The config's zinf.train section, then DeepSpeed's training keys, into o, under the options
 * given on the command line (`given`; they take precedence; a disagreement between the
 * config's own keys is refused), "auto" resolved from the options as Hugging Face's
 * DeepSpeed integration does; then trainer_opts_check() on the result. -EINVAL with a
 * message in err for a config zinf train would not run. */
int train_config_apply(struct zinf_config *zc, struct trainer_opts *o, unsigned given,
                       struct train_config_applied *ds, char *err, size_t errlen);

#endif
