/*
 * tune_util.h - what the modes of `zinf tune` share: the program's own path (each point is a
 * run of it), the output file checked before a sweep, the pick said, and the sweep's scratch
 * directory removed. The output written whole (tune_write_json) and the median of rounds
 * (tune_median) are the library's, beside the training search (train/tune_search.h).
 */
#pragma once

#include <jansson.h>
#include <limits.h>
#include <stdbool.h>

#include "train/tune_search.h"

/* This program, as the points run it (from /proc/self/exe); 0, or 1 with a message said. */
int tune_self_exe(char buf[PATH_MAX]);
/* --out FILE, said before minutes of sweeping: 0, or 2 with a message said (it exists and
 * force is off, or nothing can be written beside it). */
int tune_check_out(const char *out, bool force);
/* The tree under path removed, what cannot be said on stderr; nothing when it is not there. */
void tune_remove_tree(const char *path);
/* The best point's median and the pick, as both modes say them (digits after the point, and
 * the score's unit): nties points tie with the best; the pick is the best itself or the
 * cheapest of those. */
void tune_say_pick(const char *best, double best_med, const char *pick, double pick_med,
                   bool pick_is_best, unsigned nties, int digits, const char *unit);
/* j on one line, its members in their order, then dropped (a NULL j says nothing). */
void tune_say_json(json_t *j);
