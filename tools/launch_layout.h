/*
 * launch_layout.h - `zinf launch -n N -- zinf train --config FILE`: N checked against the
 * parallel layout FILE asks for (pipeline.stages, tensor_parallel.autotp_size,
 * sequence_parallel_size) before any rank starts, and the layout said.
 *
 * Not here: the ranks' own check of the same (src/train/trainer_pipe.c), which stays the
 * word on everything this leaves alone (a config that does not parse, mpirun started
 * directly).
 */
#ifndef ZINF_LAUNCH_LAYOUT_H
#define ZINF_LAUNCH_LAYOUT_H

#include <stdbool.h>

/* Whether command (NULL-terminated, as launch runs it) is zinf itself: the binary named
 * "zinf", or the file this process runs from. */
bool launch_is_zinf(const char *prog);

/* The config file of `zinf train ... --config FILE` (or --config=FILE; the last one given,
 * as zinf train takes it) in command, or NULL when command is no zinf train or has none. */
const char *launch_train_config(char *const *command);

/* n ranks against the layout of command's config: 0 when they fit, or when there is
 * nothing to check (no zinf train, no --config, a config that does not parse: its ranks
 * say what is wrong); then a layout other than plain data parallel is said on stderr in
 * one line. 2 when they do not fit, or when the layout cannot be (tensor and sequence
 * parallel together): said on stderr in one line naming the file, the keys and values, n
 * and the numbers of ranks that would fit. */
int launch_layout_check(char *const *command, int n);

#endif
