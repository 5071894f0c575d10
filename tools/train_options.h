/*
 * train_options.h - the command-line options that shape the model and the run, as
 * `zinf train` and `zinf config check` both take them (src/train/train_config.h says what
 * a config does under them).
 */
#ifndef ZINF_TOOLS_TRAIN_OPTIONS_H
#define ZINF_TOOLS_TRAIN_OPTIONS_H

#include <getopt.h>
#include <stddef.h>

#include "train/train_config.h"
#include "train/trainer.h"

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
    {"accumulate", required_argument, NULL, O_ACCUM},    \
    {"experts", required_argument, NULL, O_EXPERTS},     \
    {"top-k", required_argument, NULL, O_TOP_K},         \
    {"expert-prefetch", required_argument, NULL, O_EXPERT_PREFETCH}, \
    {"lora-rank", required_argument, NULL, O_LORA_RANK},             \
    {"lora-alpha", required_argument, NULL, O_LORA_ALPHA},           \
    {"lora-targets", required_argument, NULL, O_LORA_TARGETS},       \
    {"lora-dropout", required_argument, NULL, O_LORA_DROPOUT}
extern const struct option train_shape_options[];
int train_option_apply(int opt, const char *arg, struct trainer_opts *o, unsigned *given,
                       char *err, size_t errlen);

#endif
