/*
 * train_config.h - what a DeepSpeed-style config means for `zinf train`, decided in one
 * place: `zinf train` runs what train_config_apply() makes of it, and `zinf config check`
 * refuses what it refuses, with the same message.
 */
#ifndef ZINF_TRAIN_TRAIN_CONFIG_H
#define ZINF_TRAIN_TRAIN_CONFIG_H

#include <getopt.h>
#include <stddef.h>

#include "config.h"
#include "train/trainer.h"

/* The options that shape the model and the run (getopt_long values): given on the command
 * line, bit (option - O_LAYERS) of `given` is set, and a config may not override them.
 * zinf train's other options are its own. */
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
};

/* The options that shape the model and the run, as zinf train and zinf config check both
 * take them: their names for getopt_long (ending with a zeroed entry; TRAIN_SHAPE_OPTIONS
 * is the same entries, for a command's own table), and the value of one of them (opt, its
 * text arg) into o, its bit set in *given. 1 where opt is one of them, 0 where it is not,
 * -EINVAL with "--NAME: what was expected" in err for a bad value. */
#define TRAIN_SHAPE_OPTIONS                              \
    {"layers", required_argument, NULL, O_LAYERS},       \
    {"dim", required_argument, NULL, O_DIM},             \
    {"heads", required_argument, NULL, O_HEADS},         \
    {"seq", required_argument, NULL, O_SEQ},             \
    {"batch", required_argument, NULL, O_BATCH},         \
    {"steps", required_argument, NULL, O_STEPS},         \
    {"lr", required_argument, NULL, O_LR},               \
    {"weight-decay", required_argument, NULL, O_WD},     \
    {"clip", required_argument, NULL, O_CLIP},           \
    {"seed", required_argument, NULL, O_SEED},           \
    {"precision", required_argument, NULL, O_PRECISION}, \
    {"accumulate", required_argument, NULL, O_ACCUM}
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

#endif
