/*
 * cmd_tune_report.c - what `zinf tune` concludes from its rounds and how it says it: each
 * point's median and range, the pick, the progress of the sweep on stderr, the table or
 * one JSON object per point, and the block size x queue depth heatmap (gnuplot).
 *
 * The pick: the best is the point with the highest median score. A point whose median falls
 * inside the best's range over the rounds (min..max) cannot be told from it: it ties, and
 * among the ties the cheapest wins (see cheaper()).
 *
 * Not here: the command line and the sweep (cmd_tune.c), or the measurements
 * (cmd_tune_measure.c).
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "cmd_tune.h"
#include "common.h"
#include "gnuplot.h"
#include "tune_util.h"

/* ---- the pick ------------------------------------------------------------------------- */

/* Pinned buffer bytes a point costs: the engine's staging ring (2 x queue depth blocks by
 * default; the swap-in point's own size otherwise). */
static uint64_t point_cost(const struct point *p)
{
    uint64_t slots = p->staging ? MAX(4u, p->staging / p->bs) : MAX(4u, 2 * p->qd);
    return slots * p->bs;
}

/* Is a cheaper than b (the order ties are broken in)? */
static bool cheaper(const struct point *a, const struct point *b)
{
    if (point_cost(a) != point_cost(b))
        return point_cost(a) < point_cost(b);
    if (a->qd != b->qd)
        return a->qd < b->qd;
    if (a->rings != b->rings)
        return a->rings < b->rings;
    if (a->batch != b->batch)
        return a->batch < b->batch;
    if (a->huge != b->huge)
        return a->huge;
    return a->bs < b->bs;
}

void tune_summarise(struct point *p)
{
    p->med = tune_median(p->score, p->n);
    p->med_rd = tune_median(p->rd, p->n);
    p->med_wr = tune_median(p->wr, p->n);
    p->lo = p->hi = p->score[0];
    for (unsigned i = 1; i < p->n; i++) {
        p->lo = MIN(p->lo, p->score[i]);
        p->hi = MAX(p->hi, p->score[i]);
    }
}

/* The best median, then the cheapest point that ties with it. NULL: every point failed. */
struct point *tune_pick(struct point *g, unsigned n, struct point **best_out, unsigned *nties)
{
    struct point *best = NULL, *win = NULL;
    for (unsigned i = 0; i < n; i++)
        if (!g[i].fails && (!best || g[i].med > best->med))
            best = &g[i];
    *best_out = best;
    *nties = 0;
    if (!best)
        return NULL;
    for (unsigned i = 0; i < n; i++) {
        g[i].tie = !g[i].fails && g[i].med >= best->lo;
        if (!g[i].tie)
            continue;
        ++*nties;
        if (!win || cheaper(&g[i], win))
            win = &g[i];
    }
    return win;
}

/* ---- progress --------------------------------------------------------------------------- */

void tune_describe(const struct point *p, char *buf, size_t len)
{
    char bs[32], st[48] = "", sz[32];
    format_size(p->bs, bs, sizeof(bs));
    if (p->staging)
        snprintf(st, sizeof(st), ", staging %s", format_size(p->staging, sz, sizeof(sz)));
    snprintf(buf, len, "block %s, qd %u, batch %u, %u ring%s, huge pages %s%s", bs, p->qd,
             p->batch, p->rings, p->rings == 1 ? "" : "s", p->huge ? "on" : "off", st);
}

/* per_point: the bytes one measurement moves (write and read of --size on each path, or the
 * swap-in's reads): the bar's bytes and rate. */
void tune_progress(bool tty, unsigned done, unsigned total, uint64_t t0, const struct point *p,
                   unsigned round, int err, double score, bool io, uint64_t per_point)
{
    double el = (double)(now_ns() - t0) / 1e9;
    double eta = done ? el / done * (total - done) : 0;
    if (tty && err) { /* above the bar, which is drawn again */
        char d[128];
        tune_describe(p, d, sizeof(d));
        fprintf(stderr, "\r\033[Ktune: round %u, %s: failed: %s\n", round + 1, d, p->err);
    }
    if (tty) {
        char bar[41];
        unsigned fill = total ? 40 * done / total : 40;
        for (unsigned i = 0; i < 40; i++)
            bar[i] = i < fill ? '#' : '.';
        bar[40] = '\0';
        char moved[32];
        uint64_t bytes = (uint64_t)done * per_point;
        fprintf(stderr, "\r\033[Ktune [%s] %3u%% %u/%u, %s moved, %.0f MB/s, ETA %um%02us ", bar,
                total ? 100 * done / total : 100, done, total,
                format_size(bytes, moved, sizeof(moved)), el > 0 ? (double)bytes / el / 1e6 : 0,
                (unsigned)eta / 60, (unsigned)eta % 60);
        if (done == total)
            fputc('\n', stderr);
    } else {
        char d[128];
        tune_describe(p, d, sizeof(d));
        if (err)
            fprintf(stderr, "tune: %u/%u round %u, %s: failed: %s\n", done, total, round + 1, d,
                    p->err);
        else
            fprintf(stderr, "tune: %u/%u round %u, %s: %s %.3f GB/s (ETA %us)\n", done, total,
                    round + 1, d, io ? "score" : "swap-in", score, (unsigned)eta);
    }
}

/* ---- the heatmap ---------------------------------------------------------------------- */

static const char *const heat_names[] = {"heat.dat", "heat.gp", NULL};

/* Block size x queue depth, each cell the best median over the other axes (blank where
 * every point failed), labelled with its GB/s; the picked cell outlined. 0, or 1 said. */
int tune_draw_heatmap(const struct tune_opts *o, const struct point *g, unsigned n,
                      const struct point *win)
{
    char tmp[1024], p[1100];
    int e = gnuplot_tmpdir(tmp, sizeof(tmp));
    if (e < 0) {
        fprintf(stderr, "zinf tune: --plot: a temporary directory: %s\n", strerror(-e));
        return 1;
    }
    snprintf(p, sizeof(p), "%s/heat.dat", tmp);
    FILE *d = fopen(p, "w");
    double top = 0;
    for (unsigned i = 0; d && i < o->bs.n; i++) {
        for (unsigned j = 0; j < o->qd.n; j++) {
            double best = -1;
            for (unsigned k = 0; k < n; k++)
                if (!g[k].fails && g[k].n && g[k].bs == o->bs.v[i] && g[k].qd == o->qd.v[j] &&
                    g[k].med > best)
                    best = g[k].med;
            if (best > top) top = best;
            if (best >= 0)
                fprintf(d, "%u %u %.4f\n", i, j, best);
            else
                fprintf(d, "%u %u NaN\n", i, j);
        }
        fputc('\n', d);
    }
    if (!d || fclose(d)) {
        fprintf(stderr, "zinf tune: --plot: writing %s: %s\n", p, strerror(errno));
        gnuplot_rmdir(tmp, heat_names);
        return 1;
    }
    snprintf(p, sizeof(p), "%s/heat.gp", tmp);
    FILE *s = fopen(p, "w");
    if (!s) {
        fprintf(stderr, "zinf tune: --plot: writing %s: %s\n", p, strerror(errno));
        gnuplot_rmdir(tmp, heat_names);
        return 1;
    }
    unsigned W = 140 + 90 * o->bs.n, H = 140 + 60 * o->qd.n;
    fprintf(s, "set terminal pngcairo size %u,%u noenhanced font 'sans,10'\nset output ",
            W < 640 ? 640 : W, H < 480 ? 480 : H);
    gnuplot_quote(s, o->plot);
    fprintf(s, "\ncd ");
    gnuplot_quote(s, tmp);
    fprintf(s, "\nset datafile missing 'NaN'\nset title '%s: median GB/s over %u rounds (the "
               "best over the other axes)'\n",
            o->mode == MODE_IO ? "zinf tune (write and read)" : "zinf tune (swap-in)", o->reps);
    fprintf(s, "set xlabel 'block size'\nset ylabel 'queue depth'\nset xtics (");
    for (unsigned i = 0; i < o->bs.n; i++) {
        char b[32];
        format_size(o->bs.v[i], b, sizeof(b));
        fprintf(s, "%s'%s' %u", i ? ", " : "", b, i);
    }
    fprintf(s, ")\nset ytics (");
    for (unsigned j = 0; j < o->qd.n; j++)
        fprintf(s, "%s'%llu' %u", j ? ", " : "", (unsigned long long)o->qd.v[j], j);
    fprintf(s, ")\nset xrange [-0.5:%u.5]\nset yrange [-0.5:%u.5]\n", o->bs.n - 1, o->qd.n - 1);
    fprintf(s, "set cbrange [0:%.4f]\nset cblabel 'GB/s'\nset palette rgbformulae 33,13,10\n",
            top > 0 ? top : 1);
    if (win) {
        for (unsigned i = 0; i < o->bs.n; i++)
            for (unsigned j = 0; j < o->qd.n; j++)
                if (o->bs.v[i] == win->bs && o->qd.v[j] == win->qd)
                    fprintf(s, "set object 1 rect from %u-0.5,%u-0.5 to %u+0.5,%u+0.5 front "
                               "fillstyle empty border lc rgb 'black' lw 3\n",
                            i, j, i, j);
    }
    fprintf(s, "plot 'heat.dat' using 1:2:3 with image notitle, '' using 1:2:(sprintf('%%.2f', "
               "$3)) with labels notitle\n");
    fclose(s);
    e = gnuplot_run("tune", p, o->plot);
    gnuplot_rmdir(tmp, heat_names);
    if (!e && !o->json)
        printf("# heatmap written to %s (block size x queue depth, the picked cell outlined)\n",
               o->plot);
    return e;
}

/* ---- output --------------------------------------------------------------------------- */

void tune_print_table(const struct tune_opts *o, struct point *g, unsigned n,
                      const struct point *best, const struct point *win)
{
    bool io = o->mode == MODE_IO;
    printf("# %7s %4s %5s %5s %4s %8s %8s %8s %8s %8s %8s  %s\n", "block", "qd", "batch", "rings",
           "huge", "staging", io ? "write" : "", io ? "read" : "", io ? "score" : "swapin", "min",
           "max", "");
    for (unsigned i = 0; i < n; i++) {
        struct point *p = &g[i];
        char bs[32], st[32] = "-";
        format_size(p->bs, bs, sizeof(bs));
        if (p->staging)
            format_size(p->staging, st, sizeof(st));
        if (p->fails) {
            printf("  %7s %4u %5u %5u %4s %8s  failed: %s\n", bs, p->qd, p->batch, p->rings,
                   p->huge ? "on" : "off", st, p->err);
            continue;
        }
        char w[16] = "", r[16] = "";
        if (io) {
            snprintf(w, sizeof(w), "%.3f", p->med_wr);
            snprintf(r, sizeof(r), "%.3f", p->med_rd);
        }
        printf("  %7s %4u %5u %5u %4s %8s %8s %8s %8.3f %8.3f %8.3f  %s\n", bs, p->qd, p->batch,
               p->rings, p->huge ? "on" : "off", st, w, r, p->med, p->lo, p->hi,
               p == win ? "<- picked" : p == best ? "best median" : p->tie ? "tie" : "");
    }
}

void tune_json_point(const struct tune_opts *o, const struct point *p, const struct point *win)
{
    json_t *j = json_pack("{s:I, s:i, s:i, s:i, s:b}", "block_size", (json_int_t)p->bs,
                          "queue_depth", (int)p->qd, "submit_batch", (int)p->batch, "rings",
                          (int)p->rings, "huge_pages", p->huge);
    if (p->staging)
        json_object_set_new(j, "staging_bytes", json_integer((json_int_t)p->staging));
    json_t *rounds = json_array();
    for (unsigned i = 0; i < p->n; i++)
        json_array_append_new(rounds, json_real(p->score[i]));
    json_object_set_new(j, "scores_GBps", rounds);
    if (p->fails) {
        json_object_set_new(j, "error", json_string(p->err));
    } else {
        json_object_set_new(j, "median_GBps", json_real(p->med));
        json_object_set_new(j, "min_GBps", json_real(p->lo));
        json_object_set_new(j, "max_GBps", json_real(p->hi));
        if (o->mode == MODE_IO) {
            json_object_set_new(j, "read_GBps", json_real(p->med_rd));
            json_object_set_new(j, "write_GBps", json_real(p->med_wr));
        }
        json_object_set_new(j, "tie", json_boolean(p->tie));
        json_object_set_new(j, "picked", json_boolean(p == win));
    }
    tune_say_json(j);
}
