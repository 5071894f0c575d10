/*
 * tune_search.c - the search of `zinf tune --mode train` (tune_search.h): the grid of points,
 * each planned by the trainer's own budget check and given its config, the sweep's order of
 * runs and the scores it keeps, and the pick.
 *
 * Not here: a run of a point (the caller's: zinf tune runs `zinf train` under `zinf launch`
 * on the point's config, in a scratch swap directory, and scores the tokens per second of the
 * steps after the warm-up), the command line, what is printed.
 */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "train/train_config.h"
#include "train/trainer.h"
#include "train/tune_search.h"

const char *const tune_train_where[3] = {"none", "cpu", "nvme"};

/* p->why, cut to its size. */
void tune_train_say_why(struct tune_train_point *p, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->why, sizeof(p->why), fmt, ap);
    va_end(ap);
}

void tune_train_default_micro(struct tune_train_space *s, uint64_t global)
{
    if (!s->nmicro) {
        for (uint64_t d = 1; d <= global && s->nmicro < TUNE_TRAIN_MAX_AXIS; d++)
            if (global % d == 0) s->micro[s->nmicro++] = (int)d;
    }
}

/* ---- the points' configs -------------------------------------------------------------- */

static json_t *section(json_t *root, const char *key)
{
    json_t *s = json_object_get(root, key);
    if (!json_is_object(s)) {
        s = json_object();
        json_object_set_new(root, key, s);
    }
    return s;
}

json_t *tune_train_point_config(const json_t *base, const struct tune_train_space *s,
                                uint64_t global, const struct tune_train_point *p,
                                const char *swapdir, bool budgets, bool keep_steps)
{
    json_t *j = json_deep_copy(base);
    if (!j) return NULL;
    json_object_set_new(j, "train_batch_size", json_integer((json_int_t)global));
    json_object_set_new(j, "train_micro_batch_size_per_gpu", json_integer(p->micro));
    json_object_set_new(j, "gradient_accumulation_steps", json_integer(p->accum));
    json_t *zero = section(j, "zero_optimization");
    json_object_set_new(zero, "stage", json_integer(p->ranks > 1 ? p->stage : 0));
    json_t *op = section(zero, "offload_param"), *oo = section(zero, "offload_optimizer");
    json_object_set_new(op, "device", json_string(tune_train_where[p->param]));
    json_object_set_new(oo, "device", json_string(tune_train_where[p->optim]));
    json_object_del(op, "nvme_path");
    json_object_del(oo, "nvme_path");
    json_t *zinf = section(j, "zinf");
    json_t *paths = json_array();
    json_array_append_new(paths, json_string(swapdir));
    json_object_set_new(zinf, "nvme_paths", paths);
    json_object_del(zinf, "device_bytes");
    json_object_del(zinf, "host_bytes");
    if (budgets) {
        json_object_set_new(zinf, "device_bytes", json_integer((json_int_t)p->budget[0]));
        json_object_set_new(zinf, "host_bytes", json_integer((json_int_t)p->budget[1]));
    }
    json_t *train = section(zinf, "train");
    json_object_del(train, "batch");
    if (!keep_steps) json_object_del(train, "steps");
    if (s->layers) json_object_set_new(train, "layers", json_integer(s->layers));
    if (s->dim) json_object_set_new(train, "dim", json_integer(s->dim));
    if (s->heads) json_object_set_new(train, "heads", json_integer(s->heads));
    if (s->seq) json_object_set_new(train, "seq", json_integer(s->seq));
    return j;
}

/* zinf train's options for config file `path` (one rank of `ranks`), as it makes them. */
static int opts_of(const char *path, int ranks, struct trainer_opts *to, char *err, size_t errlen)
{
    struct zinf_config zc;
    struct train_config_applied ds = {0};
    char cerr[1024];
    trainer_opts_defaults(to);
    to->world = ranks;
    to->rank = 0;
    int r = config_parse_file_flags(path, &zc, CONFIG_PARSE_QUIET, cerr, sizeof(cerr));
    if (r < 0) {
        snprintf(err, errlen, "%s", cerr);
        return r;
    }
    r = train_config_apply(&zc, to, 0, &ds, cerr, sizeof(cerr));
    config_free(&zc);
    if (r < 0) snprintf(err, errlen, "%s", cerr);
    to->config_path = path;
    return r;
}

/* The point's budgets and whether the trainer's check lets it run (p->pruned and why). */
static int plan_point(const json_t *base, const struct tune_train_space *s, uint64_t global,
                      struct tune_train_point *p, const char *dir)
{
    char path[PATH_MAX + 64], err[2048];
    snprintf(path, sizeof(path), "%s/plan.json", dir);
    json_t *j = tune_train_point_config(base, s, global, p, dir, false, false);
    if (!j) return -ENOMEM;
    int r = tune_write_json(path, j);
    json_decref(j);
    if (r < 0) return r;
    struct trainer_opts to;
    struct trainer_plan pl;
    if ((r = opts_of(path, p->ranks, &to, err, sizeof(err))) < 0 ||
        (r = trainer_plan(&to, &pl, err, sizeof(err))) < 0) {
        p->pruned = true;
        tune_train_say_why(p, "%s", err);
        return r == -ENOMEM ? r : 0;
    }
    for (int k = 0; k < 2; k++) {
        /* The fraction, in whole MiB (which every tier takes as it is), at most the whole. */
        uint64_t b = (uint64_t)ceil(p->frac * (double)pl.budget[k] / (double)MiB) * MiB;
        p->budget[k] = MIN(MAX(b, MiB), align_up(pl.budget[k], MiB));
        p->min_budget[k] = pl.min_budget[k];
    }
    if (p->budget[0] < p->min_budget[0] || p->budget[1] < p->min_budget[1]) {
        char a[32], b[32], c[32], d[32];
        p->pruned = true;
        tune_train_say_why(p, "needs device %s, host %s; the budgets are %s, %s",
                           format_size(p->min_budget[0], a, sizeof(a)),
                           format_size(p->min_budget[1], b, sizeof(b)),
                           format_size(p->budget[0], c, sizeof(c)),
                           format_size(p->budget[1], d, sizeof(d)));
    }
    return 0;
}

/* ---- the grid ------------------------------------------------------------------------- */

static bool same_point(const struct tune_train_point *a, const struct tune_train_point *b)
{
    return a->micro == b->micro && a->ranks == b->ranks && a->stage == b->stage &&
           a->param == b->param && a->optim == b->optim && a->budget[0] == b->budget[0] &&
           a->budget[1] == b->budget[1];
}

int tune_train_grid(const struct tune_train_space *s, const json_t *base, uint64_t global,
                    const char *dir, struct tune_train_point **out, unsigned *n, char *err,
                    size_t errlen)
{
    err[0] = '\0';
    struct tune_train_point *g = calloc(TUNE_TRAIN_MAX_POINTS, sizeof(*g));
    unsigned k = 0;
    if (!g) return -ENOMEM;
    for (int ri = 0; ri < s->nranks; ri++)
        for (int si = 0; si < (s->ranks[ri] > 1 ? s->nstages : 1); si++)
            for (int mi = 0; mi < s->nmicro; mi++)
                for (int pi = 0; pi < s->noffload; pi++)
                    for (int fi = 0; fi < s->nfrac; fi++) {
                        uint64_t per = (uint64_t)s->micro[mi] * (uint64_t)s->ranks[ri];
                        if (global % per) continue; /* the batch does not split so */
                        if (k == TUNE_TRAIN_MAX_POINTS) {
                            snprintf(err, errlen, "more than %d points: narrow the lists",
                                     TUNE_TRAIN_MAX_POINTS);
                            free(g);
                            return -E2BIG;
                        }
                        struct tune_train_point *p = &g[k];
                        *p =
                            (struct tune_train_point){.micro = s->micro[mi],
                                                      .accum = (int)(global / per),
                                                      .ranks = s->ranks[ri],
                                                      .stage = s->ranks[ri] > 1 ? s->stages[si] : 0,
                                                      .param = s->param[pi],
                                                      .optim = s->optim[pi],
                                                      .frac = s->frac[fi]};
                        int r = plan_point(base, s, global, p, dir);
                        if (r < 0) {
                            free(g);
                            return r;
                        }
                        bool dup = false;
                        for (unsigned q = 0; q < k && !dup; q++)
                            dup = same_point(&g[q], p) && g[q].pruned == p->pruned;
                        if (!dup) k++;
                    }
    if (!k) {
        free(g);
        snprintf(err, errlen,
                 "the global batch %llu splits into none of the micro-batches x ranks given",
                 (unsigned long long)global);
        return -EINVAL;
    }
    *out = g;
    *n = k;
    return 0;
}

unsigned tune_train_runnable(const struct tune_train_point *g, unsigned n)
{
    unsigned live = 0;
    for (unsigned i = 0; i < n; i++)
        live += !g[i].pruned;
    return live;
}

/* ---- the sweep ------------------------------------------------------------------------ */

/* One run of p: its score kept (or the point marked failed) and the progress said. A run
 * a signal cut short counts for nothing. */
static void run_once(struct tune_train_sweep *w, struct tune_train_point *p, const char *phase)
{
    double s = 0;
    int r = w->run(w->ctx, p, &s);
    if (w->stopped(w->ctx)) return;
    w->done++;
    if (r < 0)
        p->failed = true;
    else
        p->score[p->n++] = s;
    if (w->ran) w->ran(w->ctx, w, p, r, s, phase);
}

static int by_first_score(const void *a, const void *b)
{
    const struct tune_train_point *x = *(const struct tune_train_point *const *)a,
                                  *y = *(const struct tune_train_point *const *)b;
    return (y->score[0] > x->score[0]) - (y->score[0] < x->score[0]);
}

int tune_train_sweep_run(struct tune_train_sweep *w)
{
    struct tune_train_point *g = w->g;
    unsigned n = w->n, live = tune_train_runnable(g, n);
    /* Round one: every point that can run, once (exhaustive: reps times). */
    w->done = 0;
    w->total = live * (w->exhaustive ? w->reps : 1u);
    if (!w->exhaustive) {
        unsigned keep = MAX(3u, (live + 3) / 4);
        w->total += MIN(keep, live) * (w->reps - 1);
    }
    for (unsigned rep = 0; rep < (w->exhaustive ? w->reps : 1) && !w->stopped(w->ctx); rep++)
        for (unsigned i = 0; i < n && !w->stopped(w->ctx); i++)
            if (!g[i].pruned && !g[i].failed)
                run_once(w, &g[i], w->exhaustive ? "grid" : "round 1");
    if (w->exhaustive || w->stopped(w->ctx)) return 0;
    /* The search: the best quarter of round one, to reps runs each. */
    struct tune_train_point **order = calloc(n, sizeof(*order));
    if (!order) return -ENOMEM;
    unsigned m = 0;
    for (unsigned i = 0; i < n; i++)
        if (!g[i].pruned && !g[i].failed) order[m++] = &g[i];
    qsort(order, m, sizeof(*order), by_first_score);
    unsigned keep = MIN(m, MAX(3u, (live + 3) / 4));
    w->total = w->done + keep * (w->reps - 1);
    for (unsigned rep = 1; rep < w->reps && !w->stopped(w->ctx); rep++)
        for (unsigned i = 0; i < keep && !w->stopped(w->ctx); i++)
            if (!order[i]->failed) run_once(w, order[i], "round 2");
    free(order);
    return 0;
}

/* ---- the pick ------------------------------------------------------------------------- */

static void summarise(struct tune_train_point *p)
{
    p->med = tune_median(p->score, p->n);
    p->lo = p->hi = p->score[0];
    for (unsigned i = 1; i < p->n; i++) {
        p->lo = MIN(p->lo, p->score[i]);
        p->hi = MAX(p->hi, p->score[i]);
    }
}

static bool cheaper(const struct tune_train_point *a, const struct tune_train_point *b)
{
    uint64_t ca = a->budget[0] + a->budget[1], cb = b->budget[0] + b->budget[1];
    if (a->ranks != b->ranks) return a->ranks < b->ranks;
    if (ca != cb) return ca < cb;
    if (a->stage != b->stage) return a->stage < b->stage;
    return a->micro > b->micro;
}

static bool measured(const struct tune_train_point *p, unsigned reps)
{
    return !p->pruned && !p->failed && p->n == reps;
}

struct tune_train_point *tune_train_pick(struct tune_train_point *g, unsigned n, unsigned reps,
                                         struct tune_train_point **best_out, unsigned *nties)
{
    struct tune_train_point *best = NULL, *win = NULL;
    for (unsigned i = 0; i < n; i++)
        if (g[i].n == reps) summarise(&g[i]);
    for (unsigned i = 0; i < n; i++)
        if (measured(&g[i], reps) && (!best || g[i].med > best->med)) best = &g[i];
    *best_out = best;
    *nties = 0;
    if (!best) return NULL;
    for (unsigned i = 0; i < n; i++) {
        g[i].tie = measured(&g[i], reps) && g[i].med >= best->lo &&
                   g[i].med >= TUNE_TRAIN_TIE_FLOOR * best->med;
        if (!g[i].tie) continue;
        ++*nties;
        if (!win || cheaper(&g[i], win)) win = &g[i];
    }
    return win;
}

/* ---- shared with zinf tune's other mode ----------------------------------------------- */

int tune_write_json(const char *path, json_t *j)
{
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp)) return -ENAMETOOLONG;
    if (json_dump_file(j, tmp, JSON_INDENT(2) | JSON_PRESERVE_ORDER) < 0) {
        int e = errno ? -errno : -EIO;
        unlink(tmp);
        return e;
    }
    FILE *f = fopen(tmp, "a");
    if (!f || fputc('\n', f) == EOF || fclose(f) == EOF) {
        unlink(tmp);
        return -EIO;
    }
    if (rename(tmp, path) < 0) {
        int e = -errno;
        unlink(tmp);
        return e;
    }
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double tune_median(const double *v, unsigned n)
{
    double s[128];
    memcpy(s, v, n * sizeof(*v));
    qsort(s, n, sizeof(*s), cmp_double);
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}
