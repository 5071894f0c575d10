/*
 * train_config.h - what a DeepSpeed-style config means for `zinf train`, decided in one
 * place: `zinf train` runs what train_config_apply() makes of it, and `zinf config check`
 * refuses what it refuses, with the same message.
 */
#pragma once

#include <getopt.h>
#include <stddef.h>

#include "config.h"
#include "train/trainer.h"

/* zinf train's options (getopt_long values). The first ones, up to O_SEED, and
 * O_PRECISION and O_ACCUM, are the options a config may not override: given on the command
 * line, bit (option - O_LAYERS) of `given` is set. */
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
    O_LOG,
    O_RESUME,
    O_PRECISION,
    O_OVERWRITE,
    O_CKPT,
    O_ACCUM,
    O_EVAL,
    O_EVAL_BATCHES,
    O_SAMPLE,
    O_SAMPLE_BYTES,
    O_CONNECT,
    O_JOB,
    O_TRACE,
    O_EXPORT,
    O_STRICT,
    O_DRY_RUN,
    O_PRINT_LR
};

/* The options that shape the model and the run (O_LAYERS to O_SEED, O_PRECISION and
 * O_ACCUM), as zinf train and zinf config check both take them: their names for
 * getopt_long (ending with a zeroed entry), and the value of one of them (opt, its text arg)
 * into o, its bit set in *given. 1 where opt is one of them, 0 where it is not, -EINVAL with
 * "--NAME: what was expected" in err for a bad value. */
extern const struct option train_shape_options[];
int train_option_apply(int opt, const char *arg, struct trainer_opts *o, unsigned *given,
                       char *err, size_t errlen);

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
