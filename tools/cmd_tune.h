/*
 * cmd_tune.h - what the files of `zinf tune` (its io and swapin modes) share: the options,
 * a point of the grid with its rounds, and the functions each offers the others.
 * cmd_tune.c has the command line and the sweep; cmd_tune_measure.c measures a point;
 * cmd_tune_report.c picks the winner and says it all (progress, table, JSON, heatmap).
 */
#ifndef ZINF_TOOLS_CMD_TUNE_H
#define ZINF_TOOLS_CMD_TUNE_H

#include <jansson.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"

#define MAX_AXIS 16
#define SWAP_SUBDIR "zinf-tune.swap" /* swap-in mode's own swap directory in each path */

enum tune_mode { MODE_IO, MODE_SWAPIN };

struct axis {
    uint64_t v[MAX_AXIS];
    unsigned n;
};

struct tune_opts {
    const char *paths[CONFIG_MAX_NVME_PATHS];
    unsigned npaths;
    enum tune_mode mode;
    uint64_t size, tensor_bytes;
    unsigned reps;
    struct axis bs, qd, batch, rings, staging, huge; /* huge: 1 on, 0 off */
    const char *out;
    const char *plot; /* --plot: the heatmap's PNG */
    bool force, json, quick;
};

struct point {
    size_t bs;
    unsigned qd, batch, rings;
    uint64_t staging; /* swap-in mode only; 0 in io mode */
    bool huge;
    double *score, *rd, *wr; /* one per round */
    unsigned n;
    int fails;
    char err[512];
    double med, lo, hi, med_rd, med_wr;
    bool tie;
};

/* cmd_tune_measure.c */
/* This program, as io mode runs it (`zinf bench`) for each point. */
extern char tune_io_exe[PATH_MAX];
/* The config a point stands for (see there). */
json_t *tune_fragment(const struct tune_opts *o, const struct point *p, const char *swapdir_of,
                      uint64_t device_bytes, uint64_t host_bytes);
/* One round of a point: 0 and its score in GB/s, or -errno; p->err holds the reason when
 * there is one. */
int tune_measure_io(const struct tune_opts *o, struct point *p, double *score, double *rd,
                    double *wr);
int tune_measure_swapin(const struct tune_opts *o, struct point *p, double *score);

/* cmd_tune_report.c */
void tune_summarise(struct point *p);
struct point *tune_pick(struct point *g, unsigned n, struct point **best_out, unsigned *nties);
void tune_describe(const struct point *p, char *buf, size_t len);
void tune_progress(bool tty, unsigned done, unsigned total, uint64_t t0, const struct point *p,
                   unsigned round, int err, double score, bool io, uint64_t per_point);
int tune_draw_heatmap(const struct tune_opts *o, const struct point *g, unsigned n,
                      const struct point *win);
void tune_print_table(const struct tune_opts *o, struct point *g, unsigned n,
                      const struct point *best, const struct point *win);
void tune_json_point(const struct tune_opts *o, const struct point *p, const struct point *win);

#endif
