/*
 * tune_util.h - what the modes of `zinf tune` share: the program's own path (each point is a
 * run of it), the output file checked before a sweep and written whole after it, the median
 * of rounds, the pick said, and the sweep's scratch directory removed.
 */
#pragma once

#include <jansson.h>
#include <limits.h>
#include <stdbool.h>

/* This program, as the points run it (from /proc/self/exe); 0, or 1 with a message said. */
int tune_self_exe(char buf[PATH_MAX]);
/* --out FILE, said before minutes of sweeping: 0, or 2 with a message said (it exists and
 * force is off, or nothing can be written beside it). */
int tune_check_out(const char *out, bool force);
/* j written to path whole (through path.tmp and a rename), indented, with a newline: 0 or
 * -errno. */
int tune_write_json(const char *path, json_t *j);
/* The median of n values (n <= 128). */
double tune_median(const double *v, unsigned n);
/* The tree under path removed, what cannot be said on stderr; nothing when it is not there. */
void tune_remove_tree(const char *path);
/* The best point's median and the pick, as both modes say them (digits after the point, and
 * the score's unit): nties points tie with the best; the pick is the best itself or the
 * cheapest of those. */
void tune_say_pick(const char *best, double best_med, const char *pick, double pick_med,
                   bool pick_is_best, unsigned nties, int digits, const char *unit);
/* j on one line, its members in their order, then dropped (a NULL j says nothing). */
void tune_say_json(json_t *j);
