/*
 * cmd_tune.c - `zinf tune`: which IO settings the drives under the given directories want,
 * measured, and written as a config fragment that `zinf config check` and `zinf train`
 * load as they are.
 *
 * A sweep is a grid of points (block size x queue depth x submit batch x io_uring rings x
 * huge pages, and in swap-in mode x staging ring size). Every point is measured --reps times
 * (at least 3); the rounds take the points in turn, so load that comes and goes on a shared
 * machine falls on every point alike. Two modes:
 *   io      `zinf bench` (this binary, --json) on each path: write then read, every byte
 *           checked; a round's score is the geometric mean of the write and read GB/s, and
 *           with several paths the slowest path's (the swap space is striped over them in
 *           equal shares, so it moves at n times its slowest drive).
 *   swapin  the engine itself, opened from the point's own fragment (plus small budgets):
 *           tensors with an NVMe home, fetched to the device tier in a fixed order, the
 *           schedule learned in a first step; the score is the tensor bytes per second of
 *           the steps after it. Bytes are checked after the timing, through zinf_read.
 *
 * The pick: the best is the point with the highest median score. A point whose median falls
 * inside the best's range over the rounds (min..max) cannot be told from it: it ties, and
 * among the ties the cheapest wins: fewer bytes of pinned buffers, then fewer requests in flight,
 * then fewer rings (a thread each), then the smaller submit batch, then huge pages on (the
 * default), then the smaller block. So a sweep on a noisy machine picks a modest setting
 * rather than a lucky one; and since a tie is judged by its median, one lucky round does not
 * make a slow point tie.
 *
 * Not swept: SQPOLL (a kernel thread spinning on a core per ring).
 *
 * This file holds the command line, the grid and the rounds over it. Not here: measuring a
 * point and the fragment it stands for (cmd_tune_measure.c), the pick and everything said
 * about the sweep (cmd_tune_report.c), or train mode, which cmd_tune() hands the whole
 * command line.
 */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "cmd.h"
#include "cmd_tune.h"
#include "common.h"
#include "config.h"
#include "io/uring.h"
#include "tune_util.h"

#define STR_(x) #x
#define STR(x) STR_(x) /* a number macro as a string */
#define MAX_POINTS 4096
#define BENCH_FILE "zinf-bench.dat" /* what `zinf bench` writes in its --path */

static volatile sig_atomic_t interrupted;

static void on_signal(int sig)
{
    interrupted = sig;
}

/* ---- options ------------------------------------------------------------------------ */

/* A comma-separated list of positive values (sizes: multiples of 4 KiB) of at most max;
 * limit says max as the error names it ("64M", "1024 (aio.queue_depth)"). */
static int parse_axis(const char *opt, const char *arg, struct axis *a, bool sizes, uint64_t max,
                      const char *limit)
{
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", arg);
    a->n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        uint64_t v;
        if (a->n == MAX_AXIS) {
            fprintf(stderr, "zinf tune: %s: at most %d values\n", opt, MAX_AXIS);
            return -1;
        }
        if (parse_size(tok, &v) < 0 || v == 0 || (sizes && !is_aligned(v, ZINF_ALIGN))) {
            fprintf(stderr, "zinf tune: %s: '%s' is not %s\n", opt, tok,
                    sizes ? "a size that is a multiple of 4K (256K, 1M, ...)"
                          : "a positive number");
            return -1;
        }
        if (v > max) {
            fprintf(stderr, "zinf tune: %s: at most %s, got %llu\n", opt, limit,
                    (unsigned long long)v);
            return -1;
        }
        a->v[a->n++] = v;
    }
    if (a->n == 0) {
        fprintf(stderr, "zinf tune: %s: give a comma-separated list\n", opt);
        return -1;
    }
    return 0;
}

static void axis_set(struct axis *a, unsigned n, const uint64_t *v)
{
    a->n = n;
    memcpy(a->v, v, n * sizeof(*v));
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: zinf tune --path DIR [--path DIR ...] [options]\n"
            "  --path DIR            a directory on a drive to tune for (several: one per drive,\n"
            "                        as zinf.nvme_paths stripes over them)\n"
            "  --mode io|swapin      io (default): `zinf bench` write+read per point;\n"
            "                        swapin: the engine's NVMe -> device swap-in per point\n"
            "  --size N              bytes per pass (default 512M; --quick 32M)\n"
            "  --tensor-size N       swapin: bytes per tensor (default 32M; --quick 1M)\n"
            "  --reps N              rounds over the grid, at least 3 (default 3)\n"
            "  --block-sizes LIST    default 256K,1M,4M (swapin: 1M,4M)\n"
            "  --queue-depths LIST   default 8,32,64 (swapin: 8,32)\n"
            "  --submit-batches LIST default 1,8 (a batch over the depth is left out)\n"
            "  --rings LIST          io_uring rings, each with its completion thread: default 1,2\n"
            "  --staging LIST        swapin: staging ring bytes, default 16M,64M\n"
            "  --huge-pages on|off|both   default both\n"
            "  --quick               a small grid at a small size: a smoke run, not a tuning\n"
            "  --out FILE            write the fragment there (not over an existing file\n"
            "                        without --force); otherwise it is printed at the end\n"
            "  --json                results as JSON on stdout (one object per point, then the\n"
            "                        pick with its fragment)\n"
            "  --plot FILE.png       also draw the block size x queue depth heatmap of the\n"
            "                        medians (the best over the other axes) with gnuplot\n"
            "Progress goes to stderr: a bar with an ETA on a terminal, a line per measurement\n"
            "otherwise. The fragment has an \"aio\" and a \"zinf\" section: merge it into a\n"
            "config, or pass it to --config as it is.\n"
            "Exit status: 0 a pick was made; 1 no point could be measured (IO errors);\n"
            "2 bad usage, a bad --path or an --out that exists; 130/143 stopped by\n"
            "SIGINT/SIGTERM (no fragment is written, the scratch files are removed).\n");
}

static int parse_args(int argc, char **argv, struct tune_opts *o)
{
    enum { O_MODE = 256, O_SIZE, O_TSIZE, O_REPS, O_BS, O_QD, O_BATCH, O_RINGS, O_STAGING, O_HUGE,
           O_QUICK, O_OUT, O_FORCE, O_JSON, O_PLOT };
    static const struct option longopts[] = {
        {"path", required_argument, NULL, 'p'},
        {"mode", required_argument, NULL, O_MODE},
        {"size", required_argument, NULL, O_SIZE},
        {"tensor-size", required_argument, NULL, O_TSIZE},
        {"reps", required_argument, NULL, O_REPS},
        {"block-sizes", required_argument, NULL, O_BS},
        {"queue-depths", required_argument, NULL, O_QD},
        {"submit-batches", required_argument, NULL, O_BATCH},
        {"rings", required_argument, NULL, O_RINGS},
        {"staging", required_argument, NULL, O_STAGING},
        {"huge-pages", required_argument, NULL, O_HUGE},
        {"quick", no_argument, NULL, O_QUICK},
        {"out", required_argument, NULL, O_OUT},
        {"force", no_argument, NULL, O_FORCE},
        {"json", no_argument, NULL, O_JSON},
        {"plot", required_argument, NULL, O_PLOT},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    bool given_bs = false, given_qd = false, given_batch = false, given_staging = false,
         given_huge = false, given_rings = false;
    uint64_t v;
    int ch;

    *o = (struct tune_opts){.reps = 3};
    optind = 1;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, "p:h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'p':
            if (o->npaths == CONFIG_MAX_NVME_PATHS) {
                fprintf(stderr, "zinf tune: at most %d --path\n", CONFIG_MAX_NVME_PATHS);
                return -1;
            }
            o->paths[o->npaths++] = optarg;
            break;
        case O_MODE:
            if (!strcmp(optarg, "io"))
                o->mode = MODE_IO;
            else if (!strcmp(optarg, "swapin"))
                o->mode = MODE_SWAPIN;
            else {
                fprintf(stderr, "zinf tune: --mode: must be io, swapin or train, got '%s'\n", optarg);
                return -1;
            }
            break;
        case O_SIZE:
        case O_TSIZE:
            if (parse_size(optarg, &v) < 0 || v < ZINF_ALIGN) {
                fprintf(stderr, "zinf tune: %s: expected a size like 512M, got '%s'\n",
                        ch == O_SIZE ? "--size" : "--tensor-size", optarg);
                return -1;
            }
            *(ch == O_SIZE ? &o->size : &o->tensor_bytes) = align_up(v, ZINF_ALIGN);
            break;
        case O_REPS:
            if (parse_size(optarg, &v) < 0 || v < 3 || v > 100) {
                fprintf(stderr, "zinf tune: --reps: must be 3..100 (a spread needs three "
                                "rounds), got '%s'\n", optarg);
                return -1;
            }
            o->reps = (unsigned)v;
            break;
        case O_BS:
            if (parse_axis("--block-sizes", optarg, &o->bs, true, 64 * MiB, "64M") < 0)
                return -1;
            given_bs = true;
            break;
        case O_QD:
            if (parse_axis("--queue-depths", optarg, &o->qd, false, 1024,
                           "1024 (aio.queue_depth)") < 0)
                return -1;
            given_qd = true;
            break;
        case O_BATCH:
            if (parse_axis("--submit-batches", optarg, &o->batch, false, 1024,
                           "1024 (zinf.submit_batch)") < 0)
                return -1;
            given_batch = true;
            break;
        case O_RINGS:
            if (parse_axis("--rings", optarg, &o->rings, false, URING_MAX_RINGS,
                           STR(URING_MAX_RINGS)) < 0)
                return -1;
            given_rings = true;
            break;
        case O_STAGING:
            if (parse_axis("--staging", optarg, &o->staging, true, 4 * GiB,
                           "4G (zinf.staging_bytes)") < 0)
                return -1;
            given_staging = true;
            break;
        case O_HUGE:
            if (!strcmp(optarg, "on"))
                axis_set(&o->huge, 1, (uint64_t[]){1});
            else if (!strcmp(optarg, "off"))
                axis_set(&o->huge, 1, (uint64_t[]){0});
            else if (!strcmp(optarg, "both"))
                axis_set(&o->huge, 2, (uint64_t[]){1, 0});
            else {
                fprintf(stderr, "zinf tune: --huge-pages: must be on, off or both, got '%s'\n",
                        optarg);
                return -1;
            }
            given_huge = true;
            break;
        case O_QUICK: o->quick = true; break;
        case O_OUT: o->out = optarg; break;
        case O_FORCE: o->force = true; break;
        case O_JSON: o->json = true; break;
        case O_PLOT: o->plot = optarg; break;
        case 'h': usage(stdout); return 1;
        default:
            fprintf(stderr, "zinf tune: unknown or incomplete option '%s'\n", argv[optind - 1]);
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "zinf tune: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (o->npaths == 0) {
        fprintf(stderr, "zinf tune: --path DIR is required\n");
        return -1;
    }
    if (given_staging && o->mode != MODE_SWAPIN) {
        fprintf(stderr, "zinf tune: --staging is for --mode swapin (raw IO has no staging "
                        "ring)\n");
        return -1;
    }
    bool sw = o->mode == MODE_SWAPIN;
    if (!given_bs)
        o->quick ? axis_set(&o->bs, 2, (uint64_t[]){256 * KiB, MiB})
        : sw     ? axis_set(&o->bs, 2, (uint64_t[]){MiB, 4 * MiB})
                 : axis_set(&o->bs, 3, (uint64_t[]){256 * KiB, MiB, 4 * MiB});
    if (!given_qd)
        o->quick ? axis_set(&o->qd, 2, (uint64_t[]){4, 16})
        : sw     ? axis_set(&o->qd, 2, (uint64_t[]){8, 32})
                 : axis_set(&o->qd, 3, (uint64_t[]){8, 32, 64});
    if (!given_batch)
        o->quick ? axis_set(&o->batch, 2, (uint64_t[]){1, 4})
                 : axis_set(&o->batch, 2, (uint64_t[]){1, 8});
    if (!given_rings)
        o->quick ? axis_set(&o->rings, 1, (uint64_t[]){1})
                 : axis_set(&o->rings, 2, (uint64_t[]){1, 2});
    if (!given_staging)
        o->quick ? axis_set(&o->staging, 1, (uint64_t[]){4 * MiB})
                 : axis_set(&o->staging, 2, (uint64_t[]){16 * MiB, 64 * MiB});
    if (!given_huge)
        o->quick ? axis_set(&o->huge, 1, (uint64_t[]){1})
                 : axis_set(&o->huge, 2, (uint64_t[]){1, 0});
    if (!o->size)
        o->size = o->quick ? 32 * MiB : 512 * MiB;
    if (!o->tensor_bytes)
        o->tensor_bytes = o->quick ? MiB : 32 * MiB;
    if (sw && o->size / o->tensor_bytes < 8) {
        fprintf(stderr, "zinf tune: --size %llu holds %llu tensors of --tensor-size %llu; "
                        "swap-in needs at least 8\n", (unsigned long long)o->size,
                (unsigned long long)(o->size / o->tensor_bytes),
                (unsigned long long)o->tensor_bytes);
        return -1;
    }
    return 0;
}

/* ---- the grid ------------------------------------------------------------------------ */

static int build_grid(const struct tune_opts *o, struct point **out, unsigned *n)
{
    unsigned cap = o->bs.n * o->qd.n * o->batch.n * o->rings.n * o->huge.n *
                   (o->mode == MODE_SWAPIN ? o->staging.n : 1);
    if (cap > MAX_POINTS) {
        fprintf(stderr, "zinf tune: %u points is too many (at most %d)\n", cap, MAX_POINTS);
        return -1;
    }
    struct point *g = calloc(cap, sizeof(*g));
    unsigned k = 0;
    if (!g)
        return -ENOMEM;
    for (unsigned a = 0; a < o->bs.n; a++)
        for (unsigned b = 0; b < o->qd.n; b++)
            for (unsigned c = 0; c < o->batch.n; c++)
              for (unsigned ri = 0; ri < o->rings.n; ri++)
                for (unsigned s = 0; s < (o->mode == MODE_SWAPIN ? o->staging.n : 1); s++)
                    for (unsigned h = 0; h < o->huge.n; h++) {
                        if (o->batch.v[c] > o->qd.v[b])
                            continue; /* the engine clamps it to the depth: a duplicate */
                        struct point *p = &g[k];
                        p->bs = o->bs.v[a];
                        p->qd = (unsigned)o->qd.v[b];
                        p->batch = (unsigned)o->batch.v[c];
                        p->rings = (unsigned)o->rings.v[ri];
                        p->staging = o->mode == MODE_SWAPIN ? o->staging.v[s] : 0;
                        p->huge = o->huge.v[h];
                        if (p->staging && p->staging < 4 * p->bs)
                            continue; /* the ring would be rounded up to 4 blocks */
                        p->score = calloc(o->reps, sizeof(double));
                        p->rd = calloc(o->reps, sizeof(double));
                        p->wr = calloc(o->reps, sizeof(double));
                        if (!p->score || !p->rd || !p->wr)
                            return -ENOMEM; /* the caller frees what is in g */
                        k++;
                    }
    if (k == 0) {
        free(g);
        fprintf(stderr, "zinf tune: no point left in the grid (every submit batch is over "
                        "every queue depth, or every staging ring under 4 blocks)\n");
        return -1;
    }
    *out = g;
    *n = k;
    return 0;
}

/* ---- the command ---------------------------------------------------------------------- */

/* What the sweep leaves in each path: zinf bench's file, or swap-in mode's swap directory. */
static const char *scratch_name(enum tune_mode m)
{
    return m == MODE_IO ? BENCH_FILE : SWAP_SUBDIR;
}

static int check_path(const struct tune_opts *o, const char *dir)
{
    struct stat sb;
    struct statvfs vfs;
    if (stat(dir, &sb) < 0 || !S_ISDIR(sb.st_mode)) {
        fprintf(stderr, "zinf tune: --path %s: %s\n", dir,
                stat(dir, &sb) < 0 ? strerror(errno) : "not a directory");
        return -1;
    }
    if (access(dir, W_OK) < 0) {
        fprintf(stderr, "zinf tune: --path %s: not writable: %s\n", dir, strerror(errno));
        return -1;
    }
    uint64_t need = o->size + 64 * MiB;
    if (statvfs(dir, &vfs) == 0 && (uint64_t)vfs.f_bavail * vfs.f_frsize < need) {
        char a[32], b[32];
        fprintf(stderr, "zinf tune: --path %s: %s free, the sweep needs %s (--size and room)\n",
                dir, format_size((uint64_t)vfs.f_bavail * vfs.f_frsize, a, sizeof(a)),
                format_size(need, b, sizeof(b)));
        return -1;
    }
    return 0;
}

int cmd_tune(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if ((!strcmp(argv[i], "--mode") && i + 1 < argc && !strcmp(argv[i + 1], "train")) ||
            !strcmp(argv[i], "--mode=train"))
            return cmd_tune_train(argc, argv);
    struct tune_opts o;
    struct point *g = NULL;
    unsigned n = 0;
    bool created[CONFIG_MAX_NVME_PATHS] = {0};
    int r = parse_args(argc, argv, &o), ret = 1;

    if (r)
        return r > 0 ? 0 : (usage(stderr), 2);
    for (unsigned i = 0; i < o.npaths; i++) {
        if (check_path(&o, o.paths[i]) < 0)
            return 2;
        for (unsigned j = 0; j < i; j++)
            if (!strcmp(o.paths[i], o.paths[j])) {
                fprintf(stderr, "zinf tune: --path %s is given twice\n", o.paths[i]);
                return 2;
            }
    }
    /* Said now, not after minutes of sweeping. */
    if (o.out && tune_check_out(o.out, o.force)) return 2;
    if (tune_self_exe(tune_io_exe)) return 1;
    if ((r = build_grid(&o, &g, &n)) < 0) {
        if (r == -ENOMEM)
            fprintf(stderr, "zinf tune: out of memory\n");
        ret = r == -ENOMEM ? 1 : 2; /* otherwise a grid the options leave empty */
        goto out;
    }
    for (unsigned i = 0; i < o.npaths; i++) {
        char f[PATH_MAX];
        snprintf(f, sizeof(f), "%s/%s", o.paths[i], scratch_name(o.mode));
        created[i] = access(f, F_OK) != 0;
    }

    /* In place before the header is out: whoever waits for it may stop the sweep then. */
    struct sigaction sa = {.sa_handler = on_signal}, old_int, old_term;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    bool io = o.mode == MODE_IO;
    bool tty = isatty(STDERR_FILENO);
    if (!o.json) {
        char sz[32];
        printf("# zinf tune %s: %s mode, %u point(s) x %u rounds, %s per pass, %u path(s):",
               zinf_version(), io ? "io" : "swapin", n, o.reps,
               format_size(o.size, sz, sizeof(sz)), o.npaths);
        for (unsigned i = 0; i < o.npaths; i++)
            printf(" %s", o.paths[i]);
        printf("\n");
        if (io)
            printf("# each point: `zinf bench` write + read on each path, every byte checked; "
                   "score = sqrt(write x read GB/s),\n#   with several paths the slowest path's\n");
        else
            printf("# each point: %llu tensors of %llu B with an NVMe home, fetched to the device "
                   "tier in order;\n#   step 1 learns the order, steps 2-3 timed; score = tensor "
                   "GB/s; bytes checked after\n",
                   (unsigned long long)(o.size / o.tensor_bytes),
                   (unsigned long long)o.tensor_bytes);
        printf("# rule: best = highest median over the rounds; a point whose median is within "
               "the best's min..max\n#   ties with it; of the ties the cheapest wins: fewer pinned "
               "buffer bytes, then fewer requests in\n#   flight, then fewer rings, then the "
               "smaller submit batch, then huge pages on, then the smaller block\n");
        printf("# not swept: sqpoll (a kernel thread spinning on a core per ring)\n");
        fflush(stdout);
    }

    unsigned total = n * o.reps, done = 0;
    uint64_t t0 = now_ns();
    for (unsigned round = 0; round < o.reps && !interrupted; round++) {
        for (unsigned i = 0; i < n && !interrupted; i++) {
            struct point *p = &g[i];
            double s = 0, rd = 0, wr = 0;
            if (p->fails) { /* a point that failed once is not measured again */
                done++;
                continue;
            }
            r = io ? tune_measure_io(&o, p, &s, &rd, &wr) : tune_measure_swapin(&o, p, &s);
            /* The engine's notices (unpinned host tier, buffered files) are said once, not
             * once per point. */
            if (!io)
                log_set_level(LOG_WARN);
            if (interrupted)
                break;
            done++;
            if (r < 0) {
                p->fails++;
            } else {
                p->score[p->n] = s;
                p->rd[p->n] = rd;
                p->wr[p->n] = wr;
                p->n++;
            }
            tune_progress(tty, done, total, t0, p, round, r < 0, s, io,
                          io ? 2 * o.size * o.npaths : o.size);
        }
    }
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (interrupted) {
        if (tty)
            fputc('\n', stderr);
        fprintf(stderr, "zinf tune: interrupted; no fragment written\n");
        ret = interrupted == SIGINT ? 130 : 143;
        goto out;
    }

    for (unsigned i = 0; i < n; i++)
        if (!g[i].fails)
            tune_summarise(&g[i]);
    struct point *best;
    unsigned nties;
    struct point *win = tune_pick(g, n, &best, &nties);
    if (o.json) {
        for (unsigned i = 0; i < n; i++)
            tune_json_point(&o, &g[i], win);
    } else {
        tune_print_table(&o, g, n, best, win);
    }
    int plot_failed = o.plot ? tune_draw_heatmap(&o, g, n, win) : 0;
    if (!win) {
        fprintf(stderr, "zinf tune: every point failed (see the table); no fragment written\n");
        goto out;
    }
    char d[160];
    tune_describe(win, d, sizeof(d));
    /* The swap space is the paths themselves, not the sweep's subdirectory. */
    json_t *frag = tune_fragment(&o, win, NULL, 0, 0);
    if (o.json) {
        json_t *j = json_pack("{s:s, s:f, s:f, s:i, s:O}", "picked", d, "picked_median_GBps",
                              win->med, "best_median_GBps", best->med, "ties", (int)nties,
                              "fragment", frag);
        tune_say_json(j);
    } else {
        char bd[160];
        tune_describe(best, bd, sizeof(bd));
        tune_say_pick(bd, best->med, d, win->med, win == best, nties, 3, "GB/s");
    }
    if (o.out) {
        if ((r = tune_write_json(o.out, frag)) < 0) {
            fprintf(stderr, "zinf tune: writing %s: %s\n", o.out, strerror(-r));
            json_decref(frag);
            goto out;
        }
        if (!o.json)
            printf("# fragment written to %s (zinf config check %s; zinf train --config %s)\n",
                   o.out, o.out, o.out);
    } else if (!o.json) {
        printf("# fragment (an \"aio\" and a \"zinf\" section; --out FILE writes it):\n");
        char *s = json_dumps(frag, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        printf("%s\n", s);
        free(s);
    }
    json_decref(frag);
    ret = plot_failed ? 1 : 0; /* the fragment is written all the same */

out:
    for (unsigned i = 0; i < o.npaths; i++) {
        if (!created[i])
            continue; /* what was there before is the user's */
        char f[PATH_MAX];
        snprintf(f, sizeof(f), "%s/%s", o.paths[i], scratch_name(o.mode));
        tune_remove_tree(f);
    }
    for (unsigned i = 0; g && i < n; i++) {
        free(g[i].score);
        free(g[i].rd);
        free(g[i].wr);
    }
    free(g);
    return ret;
}
