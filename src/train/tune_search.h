/*
 * tune_search.h - the search of `zinf tune --mode train`: the fastest way to train one model
 * at a fixed global batch, as points of a grid. A point is a micro-batch (the accumulation
 * follows from the global batch), a number of ranks, a ZeRO stage (with more than one rank),
 * where the parameters and the optimizer's states live (none: the device tier; cpu: the host
 * tier; nvme) and the budgets, as fractions of those zinf train derives for the point (or the
 * config's own).
 *
 * Here: the points the axes and the global batch make, each judged first by trainer_plan()
 * with nothing opened (a point whose budgets are under the smallest that run is pruned, with
 * the reason), the config each point runs with, the order of the runs and their scores kept
 * (every point once, then only the best quarter, at least three, to reps runs; or every point
 * reps times), and the pick: the best median, and of the points whose median is within its
 * min..max and at least TUNE_TRAIN_TIE_FLOOR of it, the cheapest: fewer ranks, then fewer
 * budget bytes, then the lower stage, then the larger micro-batch.
 *
 * Not here: running a point (the caller's run function: zinf tune starts `zinf train` on the
 * point's config and reads its tokens per second), the command line, the table and the
 * progress said.
 */
#ifndef ZINF_TRAIN_TUNE_SEARCH_H
#define ZINF_TRAIN_TUNE_SEARCH_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TUNE_TRAIN_MAX_AXIS 16    /* values of one axis */
#define TUNE_TRAIN_MAX_REPS 20    /* runs of one point */
#define TUNE_TRAIN_MAX_POINTS 2048
/* A tie is also within this share of the best median: where runs spread widely (ranks
 * sharing few cores), the best's min..max alone would let a much slower point tie. */
#define TUNE_TRAIN_TIE_FLOOR 0.9

/* Where a point keeps the parameters or the optimizer's states: indices of this. */
extern const char *const tune_train_where[3]; /* "none", "cpu", "nvme" */

/* The axes of the search, and the model's shape where it replaces the config's. */
struct tune_train_space {
    int layers, dim, heads, seq; /* 0: the config's */
    int micro[TUNE_TRAIN_MAX_AXIS], nmicro;
    int ranks[TUNE_TRAIN_MAX_AXIS], nranks;
    int stages[4], nstages;
    int param[9], optim[9], noffload; /* tune_train_where indices */
    double frac[TUNE_TRAIN_MAX_AXIS];
    int nfrac;
};

struct tune_train_point {
    int micro, accum, ranks, stage, param, optim;
    double frac;
    uint64_t budget[2], min_budget[2];
    bool pruned;
    char why[400];
    double score[TUNE_TRAIN_MAX_REPS];
    unsigned n;
    bool failed;
    double med, lo, hi, seconds;
    bool tie;
};

/* p->why, cut to its size. */
__attribute__((format(printf, 2, 3))) void tune_train_say_why(struct tune_train_point *p,
                                                              const char *fmt, ...);

/* Where the space gives no micro-batches: every divisor of the global batch (the first
 * TUNE_TRAIN_MAX_AXIS). */
void tune_train_default_micro(struct tune_train_space *s, uint64_t global);

/* The base config with the point's keys: its batch split, stage, placement, and the swap
 * directory swapdir; budgets (per rank) when given, else none (zinf train derives them);
 * zinf.train's steps kept with keep_steps. A new object, or NULL. */
json_t *tune_train_point_config(const json_t *base, const struct tune_train_space *s,
                                uint64_t global, const struct tune_train_point *p,
                                const char *swapdir, bool budgets, bool keep_steps);

/* Every point of the axes that the global batch splits into, planned (its config written to
 * dir/plan.json for trainer_plan); budgets that round to another point's are that point. 0
 * with the points in *out (free them) and their count in *n; -E2BIG (too many points) or
 * -EINVAL (none) with a line in err; -ENOMEM, or -errno of writing the plan, with err empty. */
int tune_train_grid(const struct tune_train_space *s, const json_t *base, uint64_t global,
                    const char *dir, struct tune_train_point **out, unsigned *n, char *err,
                    size_t errlen);

/* The points that were not pruned. */
unsigned tune_train_runnable(const struct tune_train_point *g, unsigned n);

/* The runs of a grid: every point that can run once (exhaustive: reps times), then the best
 * quarter of those (at least three) to reps runs each. */
struct tune_train_sweep {
    struct tune_train_point *g;
    unsigned n, reps;
    bool exhaustive;
    /* One run of p: 0 with its score (tokens/s) in *score, or -errno with p->why said. */
    int (*run)(void *ctx, struct tune_train_point *p, double *score);
    /* Whether the sweep stops now (a signal): a run it cut short counts for nothing. */
    bool (*stopped)(void *ctx);
    /* After each run that counts (w->done of w->total), with its result; may be NULL. */
    void (*ran)(void *ctx, const struct tune_train_sweep *w, const struct tune_train_point *p,
                int r, double score, const char *phase);
    void *ctx;
    unsigned done, total; /* runs that counted, and the runs the sweep expects */
};

/* The sweep, each run's score kept in its point (or the point marked failed): 0 (also when
 * stopped), or -ENOMEM. */
int tune_train_sweep_run(struct tune_train_sweep *w);

/* Among the points measured reps times: their median and spread, the best median (in
 * *best_out, NULL where none was), each point's tie with it and their count (*nties), and
 * the cheapest of the ties: the pick, or NULL. */
struct tune_train_point *tune_train_pick(struct tune_train_point *g, unsigned n, unsigned reps,
                                         struct tune_train_point **best_out, unsigned *nties);

/* What both modes of zinf tune use too. The median of n values (n <= 128). */
double tune_median(const double *v, unsigned n);
/* j written to path whole (through path.tmp and a rename), indented, with a newline: 0 or
 * -errno. */
int tune_write_json(const char *path, json_t *j);

#endif
