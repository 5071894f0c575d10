/*
 * cmd_plot.c - `zinf plot`: a picture of a training run from its `zinf train --log` file:
 * the loss (train, and validation where --eval-every ran), tokens/s, NVMe read and write
 * GB/s per step, and the device and host tiers' bytes in use against their budgets, as one
 * PNG of four panels drawn by gnuplot (Debian's gnuplot-nox; scripts/setup.sh installs it).
 *
 * Several logs (runs to compare: another optimizer, another communication_data_type) share
 * the loss and throughput panels, one line each named by its file; the NVMe and tier panels
 * are the first log's.
 *
 * The log is read with a JSON parser, line by line; a resumed run appends to it, and a step
 * logged twice (run again after a crash) counts as its last line says. The data and the
 * gnuplot script go to a temporary directory, removed afterwards.
 */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cmd.h"
#include "common.h"
#include "gnuplot.h"
#include "trainlog.h"

struct point {
    bool set, eval;
    double loss, tps, rd, wr, dev, host, val;
};

struct run {
    struct trainlog_steps steps_at; /* struct point by step */
    struct point *p;                /* steps_at's entries, once read */
    int last;                       /* steps 1..last */
    int steps, evals;
    bool tiers;      /* the steps carry device_used_bytes */
    double dev_budget, host_budget; /* MiB, from the summary; 0: none */
    char title[160];
};

#define MAX_MORE 7 /* logs beside the first */

/* A log's name in a legend: its file's name without the directory and .jsonl. */
static void legend_name(const char *path, char *buf, size_t len)
{
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t n = strlen(b);
    if (n > 6 && !strcmp(b + n - 6, ".jsonl")) n -= 6;
    snprintf(buf, len, "%.*s", (int)n, b);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf plot FILE.jsonl [MORE.jsonl...] [-o OUT.png] [--size WxH] [--title TEXT]\n"
               "Draws a `zinf train --log` file as one PNG (default: FILE.png): the loss (train,\n"
               "and validation where --eval-every ran), tokens/s, NVMe read and write GB/s per\n"
               "step, and the device and host tiers' bytes in use against their budgets.\n"
               "MORE logs (up to %d) add their loss and tokens/s to the first's panels.\n"
               "--size: the picture in pixels (default 1200x900). Needs gnuplot (Debian's\n"
               "gnuplot-nox, which scripts/setup.sh installs).\n"
               "Exit status: 0 drawn, 1 gnuplot missing or failed (its message in one line),\n"
               "2 bad usage, a log it cannot read or an OUT.png in no directory.\n",
            MAX_MORE);
}

static double num(json_t *o, const char *k)
{
    return json_number_value(json_object_get(o, k));
}

struct reading {
    struct run *r;
    const char *path;
};

static int take_line(json_t *j, int line, void *arg)
{
    struct reading *rd = arg;
    struct run *r = rd->r;
    json_t *s;
    if (json_is_integer(json_object_get(j, "step")) && json_is_number(json_object_get(j, "loss"))) {
        json_int_t k = json_integer_value(json_object_get(j, "step"));
        struct point *p =
            k >= 1 && k <= TRAINLOG_MAX_STEP ? trainlog_at(&r->steps_at, (int)k, sizeof(*p)) : NULL;
        if (!p) {
            fprintf(stderr, "zinf plot: %s:%d: step %lld is out of range\n", rd->path, line,
                    (long long)k);
            return 2;
        }
        p->set = true;
        p->loss = num(j, "loss");
        p->tps = num(j, "tokens_per_s");
        p->rd = num(j, "nvme_read_GBps");
        p->wr = num(j, "nvme_write_GBps");
        if (json_object_get(j, "device_used_bytes")) {
            r->tiers = true;
            p->dev = num(j, "device_used_bytes") / (1 << 20);
            p->host = num(j, "host_used_bytes") / (1 << 20);
        }
    } else if (json_is_integer(json_object_get(j, "eval"))) {
        json_int_t k = json_integer_value(json_object_get(j, "eval"));
        struct point *p =
            k >= 0 && k <= TRAINLOG_MAX_STEP ? trainlog_at(&r->steps_at, (int)k, sizeof(*p)) : NULL;
        if (p) {
            p->eval = true;
            p->val = num(j, "val_loss");
        }
    } else if ((s = json_object_get(j, "summary"))) {
        r->dev_budget = num(json_object_get(s, "device"), "budget_bytes") / (1 << 20);
        r->host_budget = num(json_object_get(s, "host"), "budget_bytes") / (1 << 20);
    } else if ((s = json_object_get(j, "settings")) && !r->title[0]) {
        snprintf(r->title, sizeof(r->title), "%lld layers, dim %lld, seq %lld, batch %lld",
                 (long long)json_integer_value(json_object_get(s, "layers")),
                 (long long)json_integer_value(json_object_get(s, "dim")),
                 (long long)json_integer_value(json_object_get(s, "seq")),
                 (long long)json_integer_value(json_object_get(s, "batch")));
    }
    return 0;
}

/* 0, or 2 with the reason said (file, line). */
static int read_log(const char *path, struct run *r)
{
    struct reading rd = {.r = r, .path = path};
    int rc = trainlog_each("plot", path, take_line, &rd);
    r->p = r->steps_at.v;
    r->last = r->steps_at.last;
    if (rc) return rc;
    for (int k = 0; k <= r->last && r->p; k++) {
        r->steps += r->p[k].set;
        r->evals += r->p[k].eval;
    }
    if (!r->steps) {
        fprintf(stderr, "zinf plot: %s holds no step lines: is it a zinf train --log file?\n",
                path);
        return 2;
    }
    return 0;
}

/* 0 when out's directory is there; else 2, said naming out and its directory. Checked before
 * gnuplot runs, so that a mistyped directory is named as such: gnuplot says only that it
 * "cannot open file". */
static int check_out_dir(const char *out)
{
    const char *slash = strrchr(out, '/');
    char d[4096];
    struct stat sb;

    if (!slash) return 0; /* the current directory */
    snprintf(d, sizeof(d), "%.*s", slash == out ? 1 : (int)(slash - out), out);
    int e = stat(d, &sb) ? errno : S_ISDIR(sb.st_mode) ? 0 : ENOTDIR;
    if (!e) return 0;
    if (e == ENOENT)
        fprintf(stderr, "zinf plot: cannot write %s: the directory %s does not exist\n", out, d);
    else
        fprintf(stderr, "zinf plot: cannot write %s: %s: %s\n", out, d, strerror(e));
    return 2;
}

/* The other logs' loss and tokens/s, moreK.dat (K from 1). */
static int write_more(const char *tmp, const struct run *more, int nmore)
{
    char p[4096];
    for (int i = 0; i < nmore; i++) {
        snprintf(p, sizeof(p), "%s/more%d.dat", tmp, i + 1);
        FILE *d = fopen(p, "w");
        if (!d) return -errno;
        for (int k = 0; k <= more[i].last; k++)
            if (more[i].p[k].set)
                fprintf(d, "%d %.9g %.3f\n", k, more[i].p[k].loss, more[i].p[k].tps);
        if (fclose(d)) return -errno;
    }
    return 0;
}

/* Each more log's line after the first's, column col of its file. */
static void plot_more(FILE *g, int col, char (*names)[128], int nmore)
{
    for (int i = 0; i < nmore; i++) {
        fprintf(g, ", 'more%d.dat' using 1:%d with lines lw 2 title ", i + 1, col);
        gnuplot_quote(g, names[i + 1]);
    }
}

static int write_files(const char *tmp, const struct run *r, const char *out, int w, int h,
                       const char *title, char (*names)[128], int nmore)
{
    char p[4096];
    snprintf(p, sizeof(p), "%s/steps.dat", tmp);
    FILE *d = fopen(p, "w");
    if (!d) return -errno;
    for (int k = 0; k <= r->last; k++)
        if (r->p[k].set)
            fprintf(d, "%d %.9g %.3f %.6f %.6f %.6f %.6f\n", k, r->p[k].loss, r->p[k].tps,
                    r->p[k].rd, r->p[k].wr, r->p[k].dev, r->p[k].host);
    if (fclose(d)) return -errno;
    snprintf(p, sizeof(p), "%s/evals.dat", tmp);
    if (!(d = fopen(p, "w"))) return -errno;
    for (int k = 0; k <= r->last; k++)
        if (r->p[k].eval) fprintf(d, "%d %.9g\n", k, r->p[k].val);
    if (fclose(d)) return -errno;

    snprintf(p, sizeof(p), "%s/plot.gp", tmp);
    FILE *g = fopen(p, "w");
    if (!g) return -errno;
    fprintf(g, "set terminal pngcairo size %d,%d noenhanced font 'sans,10'\nset output ", w, h);
    gnuplot_quote(g, out);
    fprintf(g, "\nset datafile missing 'NaN'\ncd ");
    gnuplot_quote(g, tmp);
    fprintf(g, "\nset multiplot layout 2,2 title ");
    gnuplot_quote(g, title);
    fprintf(g, "\nset grid\nset key top right\nset xlabel 'step'\n");
    fprintf(g, "set title 'loss'\nplot 'steps.dat' using 1:2 with lines lw 2 title ");
    gnuplot_quote(g, nmore ? names[0] : "train");
    if (r->evals) fprintf(g, ", 'evals.dat' using 1:2 with linespoints lw 2 title 'validation'");
    plot_more(g, 2, names, nmore);
    fprintf(g, "\nset title 'throughput'\nset ylabel 'tokens/s'\nset yrange [0:*]\n"
               "plot 'steps.dat' using 1:3 with lines lw 2 title ");
    gnuplot_quote(g, nmore ? names[0] : "tokens/s");
    plot_more(g, 3, names, nmore);
    fputc('\n', g);
    fprintf(g, "set title 'NVMe'\nset ylabel 'GB/s'\nplot 'steps.dat' using 1:4 with lines lw 2 "
               "title 'read', 'steps.dat' using 1:5 with lines lw 2 title 'write'\n");
    fprintf(g, "set title 'memory tiers (at the end of each step)'\nset ylabel 'MiB'\n");
    if (r->dev_budget > 0 || r->host_budget > 0)
        fprintf(g, "set yrange [0:%.6f]\nset key bottom right opaque\n",
                1.2 * (r->dev_budget > r->host_budget ? r->dev_budget : r->host_budget));
    if (r->tiers) {
        fprintf(g, "plot 'steps.dat' using 1:6 with lines lw 2 lc 1 title 'device in use', "
                   "'steps.dat' using 1:7 with lines lw 2 lc 2 title 'host in use'");
        if (r->dev_budget > 0)
            fprintf(g, ", %.6f with lines dt 2 lw 2 lc 1 title 'device budget', %.6f with lines "
                       "dt 2 lw 2 lc 2 title 'host budget'",
                    r->dev_budget, r->host_budget);
        fputc('\n', g);
    } else {
        fprintf(g, "set label 1 'this log has no tier occupancy (an older zinf wrote it)' at "
                   "graph 0.5,0.5 center\nplot [0:1] [0:1] NaN notitle\n");
    }
    fprintf(g, "unset multiplot\n");
    if (fclose(g)) return -errno;
    return 0;
}

static const char *const tmp_names[] = {"steps.dat", "evals.dat", "plot.gp",   "more1.dat",
                                        "more2.dat", "more3.dat", "more4.dat", "more5.dat",
                                        "more6.dat", "more7.dat", NULL};

int cmd_plot(int argc, char **argv)
{
    static const struct option lo[] = {{"output", required_argument, NULL, 'o'},
                                       {"size", required_argument, NULL, 's'},
                                       {"title", required_argument, NULL, 't'},
                                       {"help", no_argument, NULL, 'h'},
                                       {0}};
    const char *out = NULL, *title = NULL;
    int w = 1200, h = 900, ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "o:h", lo, NULL)) != -1) {
        switch (ch) {
        case 'o':
            out = optarg;
            break;
        case 's': {
            char x;
            if (sscanf(optarg, "%d%c%d", &w, &x, &h) != 3 || (x != 'x' && x != 'X') || w < 200 ||
                h < 150 || w > 10000 || h > 10000) {
                fprintf(stderr, "zinf plot: --size %s: give WxH, each 200 to 10000 (150 for H)\n",
                        optarg);
                return 2;
            }
            break;
        }
        case 't':
            title = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    int nmore = argc - optind - 1;
    if (nmore < 0 || nmore > MAX_MORE) {
        usage(stderr);
        return 2;
    }
    const char *in = argv[optind];
    char outbuf[4096];
    if (!out) {
        size_t n = strlen(in);
        if (n > 6 && !strcmp(in + n - 6, ".jsonl")) n -= 6;
        snprintf(outbuf, sizeof(outbuf), "%.*s.png", (int)n, in);
        out = outbuf;
    }
    struct run r = {0}, more[MAX_MORE] = {0};
    char names[MAX_MORE + 1][128];
    legend_name(in, names[0], sizeof(names[0]));
    int rc = read_log(in, &r);
    for (int i = 0; i < nmore && !rc; i++) {
        legend_name(argv[optind + 1 + i], names[i + 1], sizeof(names[i + 1]));
        rc = read_log(argv[optind + 1 + i], &more[i]);
    }
    if (!rc) rc = check_out_dir(out);
    if (rc) {
        free(r.p);
        for (int i = 0; i < nmore; i++)
            free(more[i].p);
        return rc;
    }
    char ttl[512];
    snprintf(ttl, sizeof(ttl), "%s: %s%s%d steps", title ? title : in, r.title,
             r.title[0] ? ", " : "", r.steps);
    char tmp[1024];
    int e = gnuplot_tmpdir(tmp, sizeof(tmp));
    if (e < 0) {
        fprintf(stderr, "zinf plot: a temporary directory: %s\n", strerror(-e));
        free(r.p);
        for (int i = 0; i < nmore; i++)
            free(more[i].p);
        return 1;
    }
    e = write_files(tmp, &r, out, w, h, ttl, names, nmore);
    if (e == 0) e = write_more(tmp, more, nmore);
    free(r.p);
    for (int i = 0; i < nmore; i++)
        free(more[i].p);
    if (e < 0) {
        fprintf(stderr, "zinf plot: writing gnuplot's input in %s: %s\n", tmp, strerror(-e));
        gnuplot_rmdir(tmp, tmp_names);
        return 1;
    }
    char script[1100];
    snprintf(script, sizeof(script), "%s/plot.gp", tmp);
    e = gnuplot_run("plot", script, out);
    gnuplot_rmdir(tmp, tmp_names);
    if (e) return e;
    printf("zinf plot: wrote %s (%d x %d): loss%s, tokens/s, NVMe GB/s%s over %d steps", out, w,
           h, r.evals ? " (train and validation)" : "", r.tiers ? ", tier occupancy" : "",
           r.steps);
    if (nmore) printf("; the loss and tokens/s of %d more log%s beside", nmore, nmore > 1 ? "s" : "");
    printf("\n");
    return 0;
}
