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
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cmd.h"
#include "common.h"
#include "config.h"
#include "engine/engine.h"
#include "gnuplot.h"
#include "io/uring.h"
#include "tune_util.h"

extern char **environ;

#define MAX_AXIS 16
#define STR_(x) #x
#define STR(x) STR_(x) /* a number macro as a string */
#define MAX_POINTS 4096
#define BENCH_FILE "zinf-bench.dat" /* what `zinf bench` writes in its --path */
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

/* ---- the fragment --------------------------------------------------------------------- */

/* The config a point stands for: what is written out, and (with budgets) what swap-in mode
 * opens the engine from, so that what was measured is what the fragment says. */
static json_t *fragment(const struct tune_opts *o, const struct point *p, const char *swapdir_of,
                        uint64_t device_bytes, uint64_t host_bytes)
{
    json_t *aio = json_pack("{s:I, s:i, s:i, s:b, s:b}", "block_size", (json_int_t)p->bs,
                            "queue_depth", (int)p->qd, "intra_op_parallelism", (int)p->rings,
                            "single_submit", 0, "overlap_events", 1);
    json_t *paths = json_array();
    for (unsigned i = 0; i < o->npaths; i++) {
        char buf[PATH_MAX];
        snprintf(buf, sizeof(buf), "%s%s%s", o->paths[i], swapdir_of ? "/" : "",
                 swapdir_of ? swapdir_of : "");
        json_array_append_new(paths, json_string(buf));
    }
    json_t *z = json_pack("{s:o, s:i, s:b}", "nvme_paths", paths, "submit_batch", (int)p->batch,
                          "huge_pages", p->huge);
    if (p->staging)
        json_object_set_new(z, "staging_bytes", json_integer((json_int_t)p->staging));
    if (device_bytes) {
        json_object_set_new(z, "device_bytes", json_integer((json_int_t)device_bytes));
        json_object_set_new(z, "host_bytes", json_integer((json_int_t)host_bytes));
    }
    return json_pack("{s:o, s:o}", "aio", aio, "zinf", z);
}

/* ---- io mode: `zinf bench` on each path ----------------------------------------------- */

static char self_exe[PATH_MAX];

/* Run `zinf bench` for one point on one path; *rd and *wr get its GB/s. */
static int bench_once(const struct tune_opts *o, const char *dir, const struct point *p,
                      double *rd, double *wr, char *err, size_t errlen)
{
    char size[32], bs[32], qd[16], batch[16], rings[16];
    snprintf(size, sizeof(size), "%llu", (unsigned long long)o->size);
    snprintf(bs, sizeof(bs), "%zu", p->bs);
    snprintf(qd, sizeof(qd), "%u", p->qd);
    snprintf(batch, sizeof(batch), "%u", p->batch);
    snprintf(rings, sizeof(rings), "%u", p->rings);
    char *argv[] = {self_exe, "bench", "--path", (char *)dir, "--size", size, "--block-size", bs,
                    "--queue-depth", qd, "--submit-batch", batch, "--rings", rings, "--json",
                    "--keep",
                    p->huge ? NULL : "--no-huge-pages", NULL};
    int pfd[2];
    if (pipe(pfd) < 0)
        return -errno;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, pfd[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&fa, pfd[0]);
    pid_t pid;
    int r = posix_spawn(&pid, self_exe, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(pfd[1]);
    if (r != 0) {
        close(pfd[0]);
        snprintf(err, errlen, "cannot run zinf bench: %s", strerror(r));
        return -r;
    }
    FILE *f = fdopen(pfd[0], "r");
    char line[2048];
    bool got_rd = false, got_wr = false, bad = false;
    while (f && fgets(line, sizeof(line), f)) {
        json_error_t je;
        json_t *row = json_loads(line, 0, &je);
        const char *op = json_string_value(json_object_get(row, "op"));
        double g = json_real_value(json_object_get(row, "GBps"));
        if (op && json_is_true(json_object_get(row, "verified"))) {
            if (!strcmp(op, "read"))
                *rd = g, got_rd = true;
            else if (!strcmp(op, "write"))
                *wr = g, got_wr = true;
        } else if (op) {
            const char *e = json_string_value(json_object_get(row, "error"));
            snprintf(err, errlen, "%s %s: %s", dir, op, e ? e : "bytes read back wrong");
            bad = true;
        }
        json_decref(row);
    }
    if (f)
        fclose(f);
    else
        close(pfd[0]);
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (bad)
        return -EIO;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !got_rd || !got_wr) {
        if (!err[0])
            snprintf(err, errlen, "%s: zinf bench %s", dir,
                     WIFSIGNALED(status) ? "was killed" : "failed (its message is above)");
        return -EIO;
    }
    return 0;
}

static int measure_io(const struct tune_opts *o, struct point *p, double *score, double *rd,
                      double *wr)
{
    double worst = INFINITY;
    for (unsigned i = 0; i < o->npaths; i++) {
        double r = 0, w = 0;
        int e = bench_once(o, o->paths[i], p, &r, &w, p->err, sizeof(p->err));
        if (e < 0)
            return e;
        double s = sqrt(r * w);
        if (s < worst)
            worst = s, *rd = r, *wr = w;
    }
    *score = worst;
    return 0;
}

/* ---- swap-in mode: the engine --------------------------------------------------------- */

static uint64_t word_of(unsigned tensor, uint64_t off)
{
    uint64_t z = ((uint64_t)tensor << 40 ^ off) * 0x9e3779b97f4a7c15ull;
    return z ^ (z >> 29);
}

static void fill(uint64_t *w, size_t bytes, unsigned tensor)
{
    for (size_t i = 0; i < bytes / 8; i++)
        w[i] = word_of(tensor, i * 8);
}

static bool check_page(const uint64_t *w, unsigned tensor, uint64_t off)
{
    for (size_t i = 0; i < ZINF_ALIGN / 8; i++)
        if (w[i] != word_of(tensor, off + i * 8))
            return false;
    return true;
}

static int measure_swapin(const struct tune_opts *o, struct point *p, double *score)
{
    unsigned nt = (unsigned)(o->size / o->tensor_bytes);
    /* The tensors are four times the device tier and eight times the host tier: every step
     * reads all of them from NVMe. */
    uint64_t dev = align_up(MAX(o->size / 4, 2 * o->tensor_bytes), ZINF_ALIGN);
    uint64_t host = align_up(MAX(o->size / 8, 2 * o->tensor_bytes), ZINF_ALIGN);
    json_t *frag = fragment(o, p, SWAP_SUBDIR, dev, host);
    char *text = json_dumps(frag, 0);
    json_decref(frag);
    struct zinf_config c;
    char cerr[480];
    zinf_engine *e = NULL;
    zinf_tensor *t = calloc(nt, sizeof(*t));
    uint64_t *buf = malloc(o->tensor_bytes);
    int r = -ENOMEM;

    if (!text || !t || !buf)
        goto out_nocfg;
    r = config_parse_buffer(text, strlen(text), "tune point", &c, cerr, sizeof(cerr));
    if (r < 0) {
        snprintf(p->err, sizeof(p->err), "%s", cerr);
        config_free(&c);
        goto out_nocfg;
    }
    r = engine_open_config(&c, ZINF_OPEN_OVERWRITE, &e);
    config_free(&c);
    if (r < 0) {
        snprintf(p->err, sizeof(p->err), "opening the engine: %s", zinf_strerror(r));
        goto out_nocfg;
    }
    for (unsigned i = 0; i < nt; i++) {
        char name[32];
        snprintf(name, sizeof(name), "tune.%u", i);
        fill(buf, o->tensor_bytes, i);
        if ((r = zinf_register(e, name, o->tensor_bytes, ZINF_TIER_NVME, &t[i])) < 0 ||
            (r = zinf_write(e, t[i], 0, buf, o->tensor_bytes)) < 0) {
            snprintf(p->err, sizeof(p->err), "tensor %u: %s", i, zinf_strerror(r));
            goto out;
        }
    }
    /* Step 1 teaches the engine the order; steps 2 and 3 are timed. */
    uint64_t t0 = 0;
    for (unsigned step = 0; step < 3; step++) {
        if (step == 1)
            t0 = now_ns();
        for (unsigned i = 0; i < nt; i++) {
            void *ptr;
            if ((r = zinf_fetch(e, t[i], ZINF_TIER_DEVICE, &ptr)) < 0 ||
                (r = zinf_release(e, t[i], ZINF_TIER_DEVICE, ZINF_RELEASE_CLEAN)) < 0) {
                snprintf(p->err, sizeof(p->err), "step %u, tensor %u: %s", step + 1, i,
                         zinf_strerror(r));
                goto out;
            }
        }
        if ((r = zinf_step(e)) < 0) {
            snprintf(p->err, sizeof(p->err), "zinf_step: %s", zinf_strerror(r));
            goto out;
        }
    }
    double secs = (double)(now_ns() - t0) / 1e9;
    r = 0;
    *score = (double)nt * 2 * (double)o->tensor_bytes / secs / 1e9;
    /* Checked after the timing: the first and last page of every tensor. */
    for (unsigned i = 0; i < nt && r == 0; i++) {
        uint64_t last = o->tensor_bytes - ZINF_ALIGN;
        if ((r = zinf_read(e, t[i], 0, buf, ZINF_ALIGN)) < 0 ||
            (r = zinf_read(e, t[i], last, buf + ZINF_ALIGN / 8, ZINF_ALIGN)) < 0) {
            snprintf(p->err, sizeof(p->err), "reading tensor %u back: %s", i, zinf_strerror(r));
        } else if (!check_page(buf, i, 0) || !check_page(buf + ZINF_ALIGN / 8, i, last)) {
            snprintf(p->err, sizeof(p->err), "tensor %u read back wrong", i);
            r = -EIO;
        }
    }
out:
    zinf_close(e);
out_nocfg:
    free(text);
    free(t);
    free(buf);
    return r;
}

/* ---- progress --------------------------------------------------------------------------- */

static void describe(const struct point *p, char *buf, size_t len)
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
static void progress(bool tty, unsigned done, unsigned total, uint64_t t0, const struct point *p,
                     unsigned round, int err, double score, bool io, uint64_t per_point)
{
    double el = (double)(now_ns() - t0) / 1e9;
    double eta = done ? el / done * (total - done) : 0;
    if (tty && err) { /* above the bar, which is drawn again */
        char d[128];
        describe(p, d, sizeof(d));
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
        describe(p, d, sizeof(d));
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
static int draw_heatmap(const struct tune_opts *o, const struct point *g, unsigned n,
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

/* ---- the pick ------------------------------------------------------------------------- */

static void summarise(struct point *p)
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
static struct point *pick(struct point *g, unsigned n, struct point **best_out, unsigned *nties)
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

/* ---- output --------------------------------------------------------------------------- */

static void print_table(const struct tune_opts *o, struct point *g, unsigned n,
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

static void json_point(const struct tune_opts *o, const struct point *p, const struct point *win)
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
    if (tune_self_exe(self_exe)) return 1;
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
            r = io ? measure_io(&o, p, &s, &rd, &wr) : measure_swapin(&o, p, &s);
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
            progress(tty, done, total, t0, p, round, r < 0, s, io,
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
            summarise(&g[i]);
    struct point *best;
    unsigned nties;
    struct point *win = pick(g, n, &best, &nties);
    if (o.json) {
        for (unsigned i = 0; i < n; i++)
            json_point(&o, &g[i], win);
    } else {
        print_table(&o, g, n, best, win);
    }
    int plot_failed = o.plot ? draw_heatmap(&o, g, n, win) : 0;
    if (!win) {
        fprintf(stderr, "zinf tune: every point failed (see the table); no fragment written\n");
        goto out;
    }
    char d[160];
    describe(win, d, sizeof(d));
    /* The swap space is the paths themselves, not the sweep's subdirectory. */
    json_t *frag = fragment(&o, win, NULL, 0, 0);
    if (o.json) {
        json_t *j = json_pack("{s:s, s:f, s:f, s:i, s:O}", "picked", d, "picked_median_GBps",
                              win->med, "best_median_GBps", best->med, "ties", (int)nties,
                              "fragment", frag);
        tune_say_json(j);
    } else {
        char bd[160];
        describe(best, bd, sizeof(bd));
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
