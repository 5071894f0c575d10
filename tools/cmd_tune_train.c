/*
 * cmd_tune_train.c - `zinf tune --mode train`: the fastest way to train one model at a fixed
 * global batch on this machine, measured, and written as a config `zinf train --config` takes
 * as it is (what DeepSpeed's autotuner does for ZeRO).
 *
 * The search is the library's (train/tune_search.h): the points (micro-batch, ranks, ZeRO
 * stage, where the parameters and the optimizer's states live, budgets), each first judged by
 * trainer_plan() with nothing opened, the order of the runs (every point once, then only the
 * best quarter, at least three, --reps - 1 times more; --exhaustive runs every point --reps
 * times) and the pick (the best median, and of the points that tie with it, the cheapest).
 *
 * Here: the command line; a run of a point, which is `zinf train` (under `zinf launch`) on
 * the given data for --warmup + --steps steps in a scratch swap directory, its score the
 * tokens per second of the steps after the warm-up (step 1 learns the access schedule); and
 * what is said: the progress, the table, the pick and its config.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cmd.h"
#include "common.h"
#include "config.h"
#include "dirs.h"
#include "train/train_config.h"
#include "train/trainer.h"
#include "train/tune_search.h"
#include "tune_util.h"

extern char **environ;

#define SCRATCH "zinf-tune.train" /* the sweep's own directory in --path */

struct ttopts {
    const char *config, *data, *path, *out;
    struct tune_train_space sp; /* the axes, and the model's shape where given */
    uint64_t global;            /* 0: the config's train_batch_size, or micro x accum */
    int steps, warmup, reps;
    int seq_len; /* the run's sequence length, as zinf train makes it */
    unsigned timeout_s;
    bool exhaustive, force, json;
};

static volatile sig_atomic_t interrupted;
static volatile pid_t running = -1;

static void on_signal(int sig)
{
    interrupted = sig;
    if (running > 0) kill(running, SIGTERM);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: zinf tune --mode train --config FILE --data FILE --path DIR\n"
            "                 [--global-batch N] [--micro-batches LIST] [--ranks LIST]\n"
            "                 [--stages LIST] [--offload LIST] [--budgets LIST]\n"
            "                 [--layers N] [--dim N] [--heads N] [--seq N]\n"
            "                 [--steps N] [--warmup N] [--reps N] [--exhaustive] [--timeout S]\n"
            "                 [--out FILE [--force]] [--json]\n"
            "\n"
            "Search micro-batch, ranks, ZeRO stage, offload placement and budgets for the\n"
            "most tokens/s at a fixed global batch, and write the pick as a config.\n"
            "\n"
            "  --config FILE        the run's config (model, optimizer, ...): what is searched\n"
            "                       is replaced, the rest is kept\n"
            "  --data FILE          the training data, as zinf train takes it\n"
            "  --path DIR           where the points' swap files go (DIR/" SCRATCH ", removed)\n"
            "  --global-batch N     sequences per optimizer step (default: the config's\n"
            "                       train_batch_size, else its micro-batch x accumulation)\n"
            "  --micro-batches LIST default: every divisor of the global batch\n"
            "  --ranks LIST         default: 1 and 2 on a machine of 2 CPUs or more\n"
            "  --stages LIST        ZeRO stages 1-3 with several ranks (default 1,2,3)\n"
            "  --offload LIST       PARAM:OPTIMIZER pairs of none, cpu, nvme (default\n"
            "                       none:none,none:cpu,cpu:cpu,none:nvme,cpu:nvme,nvme:nvme)\n"
            "  --budgets LIST       fractions in (0,1] of the budgets zinf train derives (or the\n"
            "                       config gives) for each point (default 1,0.25)\n"
            "  --steps N            timed steps per run, 1-1000 (default 3)\n"
            "  --warmup N           untimed steps first, 1-100 (default 2)\n"
            "  --reps N             runs of a point, 3-%d (default 3)\n"
            "  --exhaustive         every point --reps times, no search\n"
            "  --timeout S          a run that takes longer fails (default 600)\n"
            "  --out FILE           write the config there (--force to replace it)\n"
            "  --json               the points and the pick as JSON lines on stdout\n",
            TUNE_TRAIN_MAX_REPS);
}

/* ---- options ------------------------------------------------------------------------ */

static int int_list(const char *opt, const char *arg, int *v, int *n, int lo, int hi)
{
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", arg);
    *n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        char *end;
        long x = strtol(tok, &end, 10);
        if (*n == TUNE_TRAIN_MAX_AXIS) {
            fprintf(stderr, "zinf tune: %s: at most %d values\n", opt, TUNE_TRAIN_MAX_AXIS);
            return -1;
        }
        if (end == tok || *end || x < lo || x > hi) {
            fprintf(stderr, "zinf tune: %s: '%s' is not a whole number in [%d, %d]\n", opt, tok,
                    lo, hi);
            return -1;
        }
        for (int i = 0; i < *n; i++)
            if (v[i] == (int)x) {
                fprintf(stderr, "zinf tune: %s: %ld is given twice\n", opt, x);
                return -1;
            }
        v[(*n)++] = (int)x;
    }
    if (!*n) {
        fprintf(stderr, "zinf tune: %s: an empty list\n", opt);
        return -1;
    }
    return 0;
}

static int where_of(const char *s)
{
    for (int i = 0; i < 3; i++)
        if (!strcmp(s, tune_train_where[i])) return i;
    return -1;
}

static int offload_list(const char *arg, struct ttopts *o)
{
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", arg);
    o->sp.noffload = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(tok, ':');
        int p = -1, q = -1;
        if (colon) {
            *colon = '\0';
            p = where_of(tok);
            q = where_of(colon + 1);
            *colon = ':';
        }
        if (p < 0 || q < 0) {
            fprintf(stderr,
                    "zinf tune: --offload: '%s' is not PARAM:OPTIMIZER, each of none, cpu, "
                    "nvme (e.g. cpu:nvme)\n",
                    tok);
            return -1;
        }
        for (int i = 0; i < o->sp.noffload; i++)
            if (o->sp.param[i] == p && o->sp.optim[i] == q) {
                fprintf(stderr, "zinf tune: --offload: %s is given twice\n", tok);
                return -1;
            }
        if (o->sp.noffload == 9) return -1; /* cannot happen: 9 distinct pairs at most */
        o->sp.param[o->sp.noffload] = p;
        o->sp.optim[o->sp.noffload++] = q;
    }
    if (!o->sp.noffload) {
        fprintf(stderr, "zinf tune: --offload: an empty list\n");
        return -1;
    }
    return 0;
}

static int frac_list(const char *arg, struct ttopts *o)
{
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", arg);
    o->sp.nfrac = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        char *end;
        double x = strtod(tok, &end);
        if (end == tok || *end || !(x > 0 && x <= 1)) {
            fprintf(stderr, "zinf tune: --budgets: '%s' is not a fraction in (0, 1]\n", tok);
            return -1;
        }
        if (o->sp.nfrac == TUNE_TRAIN_MAX_AXIS) {
            fprintf(stderr, "zinf tune: --budgets: at most %d values\n", TUNE_TRAIN_MAX_AXIS);
            return -1;
        }
        o->sp.frac[o->sp.nfrac++] = x;
    }
    if (!o->sp.nfrac) {
        fprintf(stderr, "zinf tune: --budgets: an empty list\n");
        return -1;
    }
    return 0;
}

static int one_int(const char *opt, const char *arg, int lo, int hi, int *out)
{
    int n = 0, v[TUNE_TRAIN_MAX_AXIS];
    if (strchr(arg, ',') || int_list(opt, arg, v, &n, lo, hi) < 0) {
        if (strchr(arg, ','))
            fprintf(stderr, "zinf tune: %s: one whole number in [%d, %d], got '%s'\n", opt, lo,
                    hi, arg);
        return -1;
    }
    *out = v[0];
    return 0;
}

/* 1: --help; 0: go on; -1: bad usage (said). */
static int parse_args(int argc, char **argv, struct ttopts *o)
{
    enum { T_MODE = 256, T_CONFIG, T_DATA, T_GLOBAL, T_MICRO, T_RANKS, T_STAGES, T_OFFLOAD,
           T_BUDGETS, T_LAYERS, T_DIM, T_HEADS, T_SEQ, T_STEPS, T_WARMUP, T_REPS, T_EXH,
           T_TIMEOUT, T_OUT, T_FORCE, T_JSON };
    static const struct option longopts[] = {
        {"mode", required_argument, NULL, T_MODE},
        {"config", required_argument, NULL, T_CONFIG},
        {"data", required_argument, NULL, T_DATA},
        {"path", required_argument, NULL, 'p'},
        {"global-batch", required_argument, NULL, T_GLOBAL},
        {"micro-batches", required_argument, NULL, T_MICRO},
        {"ranks", required_argument, NULL, T_RANKS},
        {"stages", required_argument, NULL, T_STAGES},
        {"offload", required_argument, NULL, T_OFFLOAD},
        {"budgets", required_argument, NULL, T_BUDGETS},
        {"layers", required_argument, NULL, T_LAYERS},
        {"dim", required_argument, NULL, T_DIM},
        {"heads", required_argument, NULL, T_HEADS},
        {"seq", required_argument, NULL, T_SEQ},
        {"steps", required_argument, NULL, T_STEPS},
        {"warmup", required_argument, NULL, T_WARMUP},
        {"reps", required_argument, NULL, T_REPS},
        {"exhaustive", no_argument, NULL, T_EXH},
        {"timeout", required_argument, NULL, T_TIMEOUT},
        {"out", required_argument, NULL, T_OUT},
        {"force", no_argument, NULL, T_FORCE},
        {"json", no_argument, NULL, T_JSON},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    static const char *const offload_default = "none:none,none:cpu,cpu:cpu,none:nvme,cpu:nvme,"
                                               "nvme:nvme";
    *o = (struct ttopts){.steps = 3, .warmup = 2, .reps = 3, .timeout_s = 600};
    o->sp.stages[0] = 1, o->sp.stages[1] = 2, o->sp.stages[2] = 3, o->sp.nstages = 3;
    o->sp.frac[0] = 1, o->sp.frac[1] = 0.25, o->sp.nfrac = 2;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    o->sp.ranks[0] = 1, o->sp.nranks = 1;
    if (cpus >= 2) o->sp.ranks[o->sp.nranks++] = 2;
    offload_list(offload_default, o);
    /* The options that take one whole number in a range. */
    const struct {
        int id;
        const char *name;
        int lo, hi;
        int *to;
    } ints[] = {{T_LAYERS, "--layers", 1, 1024, &o->sp.layers},
                {T_DIM, "--dim", 1, 65536, &o->sp.dim},
                {T_HEADS, "--heads", 1, 1024, &o->sp.heads},
                {T_SEQ, "--seq", 2, 65536, &o->sp.seq},
                {T_STEPS, "--steps", 1, 1000, &o->steps},
                {T_WARMUP, "--warmup", 1, 100, &o->warmup},
                {T_REPS, "--reps", 3, TUNE_TRAIN_MAX_REPS, &o->reps}};
    int c, v = 0;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "p:h", longopts, NULL)) != -1) {
        size_t k = 0;
        while (k < sizeof(ints) / sizeof(ints[0]) && ints[k].id != c)
            k++;
        if (k < sizeof(ints) / sizeof(ints[0])) {
            if (one_int(ints[k].name, optarg, ints[k].lo, ints[k].hi, ints[k].to) < 0) return -1;
            continue;
        }
        switch (c) {
        case 'h':
            usage(stdout);
            return 1;
        case T_MODE:
            if (strcmp(optarg, "train")) return -1; /* cmd_tune sent it here: cannot be */
            break;
        case T_CONFIG:
            o->config = optarg;
            break;
        case T_DATA:
            o->data = optarg;
            break;
        case 'p':
            if (o->path) {
                fprintf(stderr, "zinf tune: --mode train takes one --path\n");
                return -1;
            }
            o->path = optarg;
            break;
        case T_GLOBAL:
            if (one_int("--global-batch", optarg, 1, 65536, &v) < 0) return -1;
            o->global = (uint64_t)v;
            break;
        case T_MICRO:
            if (int_list("--micro-batches", optarg, o->sp.micro, &o->sp.nmicro, 1, 65536) < 0)
                return -1;
            break;
        case T_RANKS:
            if (int_list("--ranks", optarg, o->sp.ranks, &o->sp.nranks, 1, 64) < 0) return -1;
            break;
        case T_STAGES:
            if (int_list("--stages", optarg, o->sp.stages, &o->sp.nstages, 1, 3) < 0) return -1;
            break;
        case T_OFFLOAD:
            if (offload_list(optarg, o) < 0) return -1;
            break;
        case T_BUDGETS:
            if (frac_list(optarg, o) < 0) return -1;
            break;
        case T_EXH:
            o->exhaustive = true;
            break;
        case T_TIMEOUT:
            if (one_int("--timeout", optarg, 1, 86400, &v) < 0) return -1;
            o->timeout_s = (unsigned)v;
            break;
        case T_OUT:
            o->out = optarg;
            break;
        case T_FORCE:
            o->force = true;
            break;
        case T_JSON:
            o->json = true;
            break;
        default:
            fprintf(stderr, "zinf tune: unknown or incomplete option '%s'\n", argv[optind - 1]);
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "zinf tune: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    const char *missing = !o->config ? "--config FILE" : !o->data ? "--data FILE"
                          : !o->path ? "--path DIR" : NULL;
    if (missing) {
        fprintf(stderr, "zinf tune: --mode train needs %s\n", missing);
        return -1;
    }
    return 0;
}

/* ---- running a point ------------------------------------------------------------------ */

static char self_exe[PATH_MAX];

/* The last lines of file f (for a failed run's message), on one line. */
static void tail_of(const char *f, char *out, size_t len)
{
    char buf[4096];
    out[0] = '\0';
    int fd = open(f, O_RDONLY);
    if (fd < 0) return;
    off_t end = lseek(fd, 0, SEEK_END);
    off_t from = end > (off_t)sizeof(buf) - 1 ? end - (off_t)sizeof(buf) + 1 : 0;
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, from);
    close(fd);
    if (n <= 0) return;
    buf[n] = '\0';
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' ')) buf[--n] = '\0';
    char *last = strrchr(buf, '\n');
    const char *from_ = last ? last + 1 : buf;
    size_t k = MIN(strlen(from_), len - 1);
    memcpy(out, from_, k);
    out[k] = '\0';
}

/* One run of point p: its score (tokens/s after the warm-up) in *score. */
static int run_point(const struct ttopts *o, const json_t *base, uint64_t global,
                     struct tune_train_point *p, const char *dir, unsigned seq, double *score)
{
    char cfg[PATH_MAX + 64], log[PATH_MAX + 64], out[PATH_MAX + 64], swap[PATH_MAX + 64];
    snprintf(cfg, sizeof(cfg), "%s/point.json", dir);
    snprintf(log, sizeof(log), "%s/point.log", dir);
    snprintf(out, sizeof(out), "%s/point.out", dir);
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    tune_remove_tree(swap);
    unlink(log);
    json_t *j = tune_train_point_config(base, &o->sp, global, p, swap, true, false);
    int r = j ? tune_write_json(cfg, j) : -ENOMEM;
    json_decref(j);
    if (r < 0) {
        tune_train_say_why(p, "writing %s: %s", cfg, strerror(-r));
        return r;
    }
    char steps[16], n[16], name[64];
    snprintf(steps, sizeof(steps), "%d", o->warmup + o->steps);
    snprintf(n, sizeof(n), "%d", p->ranks);
    snprintf(name, sizeof(name), "zinf-tune-%ld-%u", (long)getpid(), seq);
    char *train[] = {self_exe, "train", "--config", cfg, "--data", (char *)o->data, "--steps",
                     steps, "--overwrite", "--log", log, NULL};
    char *launch[] = {self_exe, "launch", "-n", n, "--name", name, "--", self_exe, "train",
                      "--config", cfg, "--data", (char *)o->data, "--steps", steps,
                      "--overwrite", "--log", log, NULL};
    char **argv = p->ranks > 1 ? launch : train;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
    posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    pid_t pid;
    r = posix_spawn(&pid, self_exe, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (r != 0) {
        tune_train_say_why(p, "cannot run zinf train: %s", strerror(r));
        return -r;
    }
    running = pid;
    if (interrupted) kill(pid, SIGTERM);
    uint64_t t0 = now_ns();
    int status = 0;
    bool timed_out = false;
    for (;;) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid) break;
        if (w < 0 && errno != EINTR) break;
        if (!timed_out && now_ns() - t0 > (uint64_t)o->timeout_s * 1000000000ull) {
            timed_out = true;
            kill(pid, SIGKILL); /* under zinf launch, the ranks get SIGTERM from it */
        }
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    running = -1;
    p->seconds += (double)(now_ns() - t0) / 1e9;
    if (interrupted) return -EINTR;
    if (timed_out || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        char t[300];
        tail_of(out, t, sizeof(t));
        if (timed_out)
            tune_train_say_why(p, "over --timeout %u s", o->timeout_s);
        else
            tune_train_say_why(p, "zinf train %s %d: %s",
                               WIFEXITED(status) ? "exited" : "died of signal",
                               WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), t);
        return -EIO;
    }
    /* The log's step lines: the steps after the warm-up are timed. */
    FILE *f = fopen(log, "r");
    char line[4096];
    double ms = 0;
    int timed = 0;
    while (f && fgets(line, sizeof(line), f)) {
        json_t *row = json_loads(line, 0, NULL);
        json_t *st = json_object_get(row, "step"), *m = json_object_get(row, "ms");
        if (json_is_integer(st) && json_is_number(m) && json_integer_value(st) > o->warmup) {
            ms += json_number_value(m);
            timed++;
        }
        json_decref(row);
    }
    if (f) fclose(f);
    if (timed != o->steps || !(ms > 0)) {
        tune_train_say_why(p, "its log holds %d timed steps, not %d", timed, o->steps);
        return -EIO;
    }
    *score = (double)global * o->seq_len * timed / (ms / 1e3);
    return 0;
}

/* ---- what is said --------------------------------------------------------------------- */

static void describe(const struct tune_train_point *p, char *buf, size_t len)
{
    char a[32], b[32], stage[16] = "";
    if (p->ranks > 1) snprintf(stage, sizeof(stage), ", stage %d", p->stage);
    snprintf(buf, len, "%d rank%s%s, micro-batch %d x %d, param %s, optimizer %s, budgets %s/%s",
             p->ranks, p->ranks > 1 ? "s" : "", stage, p->micro, p->accum,
             tune_train_where[p->param], tune_train_where[p->optim],
             format_size(p->budget[0], a, sizeof(a)), format_size(p->budget[1], b, sizeof(b)));
}

static void print_row(const struct tune_train_point *p, const struct tune_train_point *best,
                      const struct tune_train_point *win, unsigned reps)
{
    char a[32] = "-", b[32] = "-";
    if (p->budget[0]) format_size(p->budget[0], a, sizeof(a));
    if (p->budget[1]) format_size(p->budget[1], b, sizeof(b));
    printf("  %5d %5d %5d %5d %5s %5s %9s %9s ", p->ranks, p->ranks > 1 ? p->stage : 0, p->micro,
           p->accum, tune_train_where[p->param], tune_train_where[p->optim], a, b);
    if (p->pruned) {
        printf("  pruned: %s\n", p->why);
        return;
    }
    if (p->failed) {
        printf("  failed: %s\n", p->why);
        return;
    }
    if (p->n == reps)
        printf("%9.0f %9.0f %9.0f %4u", p->med, p->lo, p->hi, p->n);
    else
        printf("%9.0f %9s %9s %4u", p->score[0], "", "", p->n);
    printf("%s%s%s\n", p == win ? "  <- picked" : "", p == best && p != win ? "  <- best" : "",
           p->tie && p != win && p != best ? "  ties" : "");
}

static void json_row(const struct tune_train_point *p, const struct tune_train_point *win)
{
    json_t *j = json_pack(
        "{s:i, s:i, s:i, s:i, s:s, s:s, s:f, s:I, s:I, s:I, s:I, s:f}", "ranks", p->ranks, "stage",
        p->ranks > 1 ? p->stage : 0, "micro_batch", p->micro, "accumulation", p->accum, "param",
        tune_train_where[p->param], "optimizer", tune_train_where[p->optim], "budget_fraction",
        p->frac, "device_bytes", (json_int_t)p->budget[0], "host_bytes", (json_int_t)p->budget[1],
        "min_device_bytes", (json_int_t)p->min_budget[0], "min_host_bytes",
        (json_int_t)p->min_budget[1], "seconds", p->seconds);
    if (p->pruned || p->failed) {
        json_object_set_new(j, p->pruned ? "pruned" : "failed", json_string(p->why));
    } else {
        json_t *s = json_array();
        for (unsigned i = 0; i < p->n; i++)
            json_array_append_new(s, json_real(p->score[i]));
        json_object_set_new(j, "tokens_per_s", s);
        if (p->n >= 3) {
            json_object_set_new(j, "median", json_real(p->med));
            json_object_set_new(j, "tie", json_boolean(p->tie));
        }
        json_object_set_new(j, "picked", json_boolean(p == win));
    }
    tune_say_json(j);
}

static void progress(unsigned done, unsigned total, uint64_t t0, const struct tune_train_point *p,
                     int r, double s, const char *phase)
{
    char d[256];
    describe(p, d, sizeof(d));
    double el = (double)(now_ns() - t0) / 1e9;
    double eta = done ? el / done * (total - done) : 0;
    if (r < 0)
        fprintf(stderr, "tune: %u/%u %s: %s: failed: %s (ETA %.0f s)\n", done, total, phase, d,
                p->why, eta);
    else
        fprintf(stderr, "tune: %u/%u %s: %s: %.0f tokens/s (ETA %.0f s)\n", done, total, phase,
                d, s, eta);
}

/* A sweep under way: what each run needs, and the count of runs for the progress line. */
struct sweep_ctx {
    const struct ttopts *o;
    const json_t *base;
    uint64_t global;
    const char *dir;
    unsigned seq;
    uint64_t t0;
};

static int sweep_run(void *ctx, struct tune_train_point *p, double *score)
{
    struct sweep_ctx *c = ctx;
    return run_point(c->o, c->base, c->global, p, c->dir, c->seq++, score);
}

static bool sweep_stopped(void *ctx)
{
    return interrupted != 0;
}

static void sweep_ran(void *ctx, const struct tune_train_sweep *w, const struct tune_train_point *p,
                      int r, double score, const char *phase)
{
    const struct sweep_ctx *c = ctx;
    progress(w->done, w->total, c->t0, p, r, score, phase);
}

int cmd_tune_train(int argc, char **argv)
{
    struct ttopts o;
    int r = parse_args(argc, argv, &o), ret = 1;
    if (r) return r > 0 ? 0 : (usage(stderr), 2);
    struct stat sb;
    if (stat(o.path, &sb) < 0 || !S_ISDIR(sb.st_mode) || access(o.path, W_OK) < 0) {
        fprintf(stderr, "zinf tune: --path %s: not a writable directory\n", o.path);
        return 2;
    }
    if (access(o.data, R_OK) < 0) {
        fprintf(stderr, "zinf tune: --data %s: %s\n", o.data, strerror(errno));
        return 2;
    }
    json_error_t je;
    json_t *base = json_load_file(o.config, 0, &je);
    if (!json_is_object(base)) {
        fprintf(stderr, "zinf tune: --config %s: %s\n", o.config,
                base ? "not a JSON object" : je.text);
        json_decref(base);
        return 2;
    }
    /* The config as zinf train takes it, with the options written into it: refused here
     * in its words rather than on every point. */
    struct trainer_opts to;
    struct zinf_config zc;
    char err[2048];
    trainer_opts_defaults(&to);
    if (config_parse_file(o.config, &zc, err, sizeof(err)) < 0) {
        fprintf(stderr, "zinf tune: --config %s\n", err);
        json_decref(base);
        return 2;
    }
    struct train_config_applied ds = {0};
    r = train_config_apply(&zc, &to, 0, &ds, err, sizeof(err));
    bool daemon = zc.zinf.connect.count > 0;
    char swapdir[PATH_MAX];
    snprintf(swapdir, sizeof(swapdir), "%s", zc.nvme_paths.count ? zc.nvme_paths.path[0] : o.path);
    config_free(&zc);
    if (r < 0 || daemon) {
        fprintf(stderr, "zinf tune: --config %s: %s\n", o.config,
                daemon ? "zinf.connect: a daemon's job has the daemon's budgets; tune a config "
                         "that runs in the process"
                       : err);
        json_decref(base);
        return 2;
    }
    uint64_t global = o.global ? o.global : (uint64_t)to.batch * (uint64_t)to.grad_accum;
    o.seq_len = o.sp.seq ? o.sp.seq : to.seq;
    tune_train_default_micro(&o.sp, global);
    /* Said now, not after minutes of sweeping. */
    r = o.out ? tune_check_out(o.out, o.force) : 0;
    if (!r) r = tune_self_exe(self_exe);
    if (r) {
        json_decref(base);
        return r;
    }
    char dir[PATH_MAX];
    if (snprintf(dir, sizeof(dir), "%s/" SCRATCH, o.path) >= (int)sizeof(dir)) {
        fprintf(stderr, "zinf tune: --path %s: too long\n", o.path);
        json_decref(base);
        return 2;
    }
    if (access(dir, F_OK) == 0) {
        fprintf(stderr, "zinf tune: %s exists (another sweep's, or one that was killed): remove "
                        "it first\n", dir);
        json_decref(base);
        return 2;
    }
    if ((r = dirs_make(dir, 0700)) < 0) {
        fprintf(stderr, "zinf tune: %s: %s\n", dir, strerror(-r));
        json_decref(base);
        return 1;
    }

    struct sigaction sa = {.sa_handler = on_signal}, old_int, old_term;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    struct tune_train_point *g = NULL;
    unsigned n = 0;
    uint64_t t0 = now_ns();
    char gerr[256];
    if ((r = tune_train_grid(&o.sp, base, global, dir, &g, &n, gerr, sizeof(gerr))) < 0) {
        if (gerr[0]) fprintf(stderr, "zinf tune: %s\n", gerr);
        if (r == -ENOMEM) fprintf(stderr, "zinf tune: out of memory\n");
        ret = r == -ENOMEM ? 1 : 2;
        goto out;
    }
    unsigned live = tune_train_runnable(g, n);
    if (!o.json) {
        printf("# zinf tune %s: train mode, %d layers, dim %d, %d heads, seq %d, global batch "
               "%llu; %u point(s), %u pruned by the budget check\n",
               zinf_version(), o.sp.layers ? o.sp.layers : to.model.L,
               o.sp.dim ? o.sp.dim : to.model.C, o.sp.heads ? o.sp.heads : to.model.NH,
               o.sp.seq ? o.sp.seq : to.seq, (unsigned long long)global, n, n - live);
        printf("# each run: zinf train, %d warm-up + %d timed steps; score = tokens/s of the "
               "timed steps\n# %s\n",
               o.warmup, o.steps,
               o.exhaustive ? "exhaustive: every point --reps times"
                            : "search: every point once, then the best quarter (at least 3) "
                              "to --reps runs");
        printf("# rule: best = highest median; a point whose median is within the best's "
               "min..max and at least %.0f%% of it\n#   ties with it; of the ties the cheapest "
               "wins: fewer ranks, then fewer budget bytes, then the lower\n#   stage, then the "
               "larger micro-batch\n",
               TUNE_TRAIN_TIE_FLOOR * 100);
        fflush(stdout);
    }
    /* Every point that can run, once (--exhaustive: --reps times), then the best quarter
     * to --reps runs each. */
    struct sweep_ctx c = {.o = &o, .base = base, .global = global, .dir = dir, .t0 = t0};
    struct tune_train_sweep w = {.g = g,
                                 .n = n,
                                 .reps = (unsigned)o.reps,
                                 .exhaustive = o.exhaustive,
                                 .run = sweep_run,
                                 .stopped = sweep_stopped,
                                 .ran = sweep_ran,
                                 .ctx = &c};
    if (tune_train_sweep_run(&w) < 0) goto out;
    if (interrupted) {
        fprintf(stderr, "zinf tune: interrupted; no config written\n");
        ret = interrupted == SIGINT ? 130 : 143;
        goto out;
    }
    double secs = (double)(now_ns() - t0) / 1e9;
    struct tune_train_point *best, *win;
    unsigned nties;
    win = tune_train_pick(g, n, (unsigned)o.reps, &best, &nties);
    if (o.json) {
        for (unsigned i = 0; i < n; i++)
            json_row(&g[i], win);
    } else {
        printf("# %5s %5s %5s %5s %5s %5s %9s %9s %9s %9s %9s %4s\n", "ranks", "stage", "micro",
               "accum", "param", "optim", "device", "host", "tokens/s", "min", "max", "runs");
        for (unsigned i = 0; i < n; i++)
            print_row(&g[i], best, win, (unsigned)o.reps);
    }
    if (!win) {
        fprintf(stderr, "zinf tune: no point ran --reps times (see the table); no config "
                        "written\n");
        goto out;
    }
    char d[256];
    describe(win, d, sizeof(d));
    json_t *cfg = tune_train_point_config(base, &o.sp, global, win, swapdir, true, true);
    if (!cfg) goto out;
    char cmd[PATH_MAX + 128] = "";
    if (win->ranks > 1) snprintf(cmd, sizeof(cmd), "zinf launch -n %d -- ", win->ranks);
    if (o.json) {
        json_t *j = json_pack("{s:s, s:f, s:f, s:i, s:f, s:i, s:O}", "picked", d,
                              "picked_median_tokens_per_s", win->med,
                              "best_median_tokens_per_s", best->med, "ties", (int)nties,
                              "seconds", secs, "ranks", win->ranks, "config", cfg);
        tune_say_json(j);
    } else {
        char bd[256];
        describe(best, bd, sizeof(bd));
        tune_say_pick(bd, best->med, d, win->med, win == best, nties, 0, "tokens/s");
        printf("# %u runs in %.1f s\n", c.seq, secs);
    }
    if (o.out) {
        if ((r = tune_write_json(o.out, cfg)) < 0) {
            fprintf(stderr, "zinf tune: writing %s: %s\n", o.out, strerror(-r));
            json_decref(cfg);
            goto out;
        }
        if (!o.json)
            printf("# config written to %s; run it: %szinf train --config %s --data %s\n", o.out,
                   cmd, o.out, o.data);
    } else if (!o.json) {
        printf("# config (--out FILE writes it; run it with %szinf train --config FILE):\n",
               cmd);
        char *s = json_dumps(cfg, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        printf("%s\n", s);
        free(s);
    }
    json_decref(cfg);
    ret = 0;
out:
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    tune_remove_tree(dir);
    free(g);
    json_decref(base);
    return ret;
}
