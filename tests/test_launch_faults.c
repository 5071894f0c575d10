/*
 * test_launch_faults.c - a job of `zinf launch -- zinf train` when something happens to it
 * from outside: --overwrite over runs of another number of ranks, the launcher killed, the
 * job stopped with Ctrl-Z and continued. Each test starts the binary ($ZINF_BIN) as a user
 * would and checks what a later --resume finds.
 *
 * Not here: the launcher's own options and rank failures (test_cli.c), the trainer's
 * resume and re-cut across ranks at every stage (test_cli.c's zero_* tests).
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"
#include "helpers.h"

static char *dir;

static void setup(void)
{
    dir = test_tmpdir("launch-faults");
    cr_assert_not_null(dir);
}

static void teardown(void)
{
    test_leak_check();
    test_rmtree(dir);
}

TestSuite(launch_faults, .init = setup, .fini = teardown, .timeout = 120);

#define run test_run_zinf

/* Small enough that a step takes milliseconds, large enough to be a model. */
#define MODEL "--layers 1 --dim 32 --heads 2 --seq 16 --batch 1"
#define MAX_STEPS 2000

/* A config for ranks under dir: the state on NVMe in swap (ZeRO stage 1), an emulated
 * device; and the training text. */
static void files(const char *swap, char *cfg, size_t cfglen, char *data, size_t datalen)
{
    static int n;
    snprintf(cfg, cfglen, "%s/c%d.json", dir, n++);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"stage\": 1, \"offload_param\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}}, \"aio\": {\"block_size\": 65536, \"queue_depth\": 4}, "
            "\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"32M\", \"host_bytes\": "
            "\"32M\"}}",
            swap, swap);
    fclose(f);
    test_write_training_text(dir, data, datalen);
}

/* `zinf ARGS` in the background, stdout and stderr into out_path: its pid. With job, in a
 * process group of its own, as a shell starts a job (a terminal's signals reach the group;
 * a stop signal's default action stops it, which it would not in an orphaned group). */
static pid_t spawn(bool job, const char *out_path, const char *fmt, ...)
{
    char args[4096], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof(args), fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof(cmd), "exec %s %s > '%s' 2>&1", getenv("ZINF_BIN"), args, out_path);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        if (job) setpgid(0, 0);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    if (job) setpgid(pid, pid); /* as the child does: whichever runs first */
    return pid;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "r");
    char *buf = calloc(1, 1 << 20);
    cr_assert_not_null(buf);
    if (f) {
        size_t n = fread(buf, 1, (1 << 20) - 1, f);
        buf[n] = '\0';
        fclose(f);
    }
    return buf;
}

/* The step lines of a JSONL log: how many, the first and the last step, and each step's
 * "loss/digest" into loss (when not NULL; a line cut short is ignored). */
struct steps {
    int lines, first, last;
};

static struct steps read_steps(const char *path, char (*loss)[64])
{
    struct steps s = {0, 0, 0};
    FILE *f = fopen(path, "r");
    char line[4096];
    if (!f) return s;
    while (fgets(line, sizeof(line), f)) {
        int step, n = 0;
        char val[32];
        if (!strchr(line, '\n')) continue;
        if (sscanf(line, "{\"step\":%d,\"loss\":%31[^,],%n", &step, val, &n) != 2 || !n) continue;
        if (!s.lines++) s.first = step;
        s.last = step;
        const char *dg = strstr(line, "\"digest\":");
        if (loss && step >= 1 && step <= MAX_STEPS)
            snprintf(loss[step], sizeof(loss[step]), "%s/%.16s", val,
                     !dg            ? "none"
                     : dg[9] == '"' ? dg + 10
                                    : "null");
    }
    fclose(f);
    return s;
}

/* The summary's "checkpoint_step" in a JSONL log; -1 without a summary. */
static int summary_checkpoint(const char *path)
{
    char *t = read_text(path);
    const char *p = strstr(t, "{\"summary\"");
    p = p ? strstr(p, "\"checkpoint_step\":") : NULL;
    int v = p ? atoi(p + strlen("\"checkpoint_step\":")) : -1;
    free(t);
    return v;
}

/* The launcher's children (its ranks), up to cap. */
static int children_of(pid_t pid, pid_t *out, int cap)
{
    char path[64], buf[512];
    int n = 0;
    snprintf(path, sizeof(path), "/proc/%d/task/%d/children", (int)pid, (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    if (fgets(buf, sizeof(buf), f)) {
        char *p = buf, *end;
        long v;
        while (n < cap && (v = strtol(p, &end, 10)) > 0 && end != p) {
            out[n++] = (pid_t)v;
            p = end;
        }
    }
    fclose(f);
    return n;
}

/* Until the log holds `lines` step lines (at most 60 s). */
static void wait_lines(const char *log, int lines, const char *out)
{
    double t0 = now_s();
    while (read_steps(log, NULL).lines < lines && now_s() - t0 < 60)
        usleep(2000);
    cr_assert_geq(read_steps(log, NULL).lines, lines, "%s", read_text(out));
}

/* The reviewer's sequence: 2 ranks save step 6; --overwrite on one rank saves step 2;
 * --resume continued the 2 ranks' step 6 (its first step logged was 7, and it exited 0),
 * the new run silently lost. --overwrite now removes every run of the swap path, and only
 * zinf's files of them. */
Test(launch_faults, resume_after_overwrite_on_another_number_of_ranks_continues_the_new_run)
{
    char cfg[4096], data[4096], swap[4096], log[4096], path[4200], *o;
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    snprintf(log, sizeof(log), "%s/run.jsonl", dir);
    files(swap, cfg, sizeof(cfg), data, sizeof(data));
    const char *bin = getenv("ZINF_BIN");

    cr_assert_eq(run(&o, "launch -n 2 -- %s train --config %s --data %s " MODEL " --steps 6", bin,
                     cfg, data),
                 0, "%s", o);
    free(o);
    /* What is not zinf's in the swap path stays, in it and in a rank's folder. */
    snprintf(path, sizeof(path), "%s/notes.txt", swap);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fclose(f);
    snprintf(path, sizeof(path), "%s/rank-0-of-2/notes.txt", swap);
    cr_assert_not_null(f = fopen(path, "w"));
    fclose(f);

    /* One rank runs the 2 ranks' global batch as 2 micro-batches: the saved run would be
     * its to resume. */
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " MODEL " --accumulate 2 --steps 2 "
                     "--overwrite",
                     cfg, data),
                 0, "%s", o);
    char *overwrote = o;
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " MODEL " --accumulate 2 --steps 8 "
                     "--resume --log %s",
                     cfg, data, log),
                 0, "%s", o);
    struct steps s = read_steps(log, NULL);
    cr_assert_eq(s.first, 3, "--resume went on from step %d, not the new run's 2: %s", s.first - 1,
                 o);
    cr_assert_eq(s.last, 8, "%s", o);
    free(o);
    cr_assert(strstr(overwrote, "--overwrite: removed the run saved by 2 ranks in "), "%s",
              overwrote);
    free(overwrote);
    snprintf(path, sizeof(path), "%s/notes.txt", swap);
    cr_assert_eq(access(path, F_OK), 0, "--overwrite removed %s", path);
    snprintf(path, sizeof(path), "%s/rank-0-of-2/notes.txt", swap);
    cr_assert_eq(access(path, F_OK), 0, "--overwrite removed %s", path);
    snprintf(path, sizeof(path), "%s/rank-0-of-2/zinf-swap.0", swap);
    cr_assert_neq(access(path, F_OK), 0, "--overwrite left %s", path);
    snprintf(path, sizeof(path), "%s/rank-1-of-2", swap);
    cr_assert_neq(access(path, F_OK), 0, "--overwrite left %s", path);

    /* The other way: 2 ranks start over the one rank's run, and a resume on one rank
     * re-cuts theirs. */
    cr_assert_eq(
        run(&o, "launch -n 2 -- %s train --config %s --data %s " MODEL " --steps 1 --overwrite",
            bin, cfg, data),
        0, "%s", o);
    cr_assert(strstr(o, "--overwrite: removed the run saved by one rank in "), "%s", o);
    free(o);
    snprintf(path, sizeof(path), "%s/zinf-manifest.json", swap);
    cr_assert_neq(access(path, F_OK), 0, "--overwrite left %s", path);
    unlink(log);
    cr_assert_eq(run(&o,
                     "train --config %s --data %s " MODEL " --accumulate 2 --steps 2 "
                     "--resume --log %s",
                     cfg, data, log),
                 0, "%s", o);
    cr_assert_eq(read_steps(log, NULL).first, 2, "%s", o);
    free(o);
}

/* zinf launch killed with SIGKILL: the ranks get SIGTERM (PR_SET_PDEATHSIG), and used to
 * die of SIGPIPE at rank 0's next line to the dead launcher's pipe, before the final
 * checkpoint: everything since the last checkpoint was lost. They stop as on SIGTERM
 * now, saving the step they agree on, and the run resumes from it. */
Test(launch_faults, launcher_killed_the_ranks_save_the_step_they_stop_at)
{
    char cfg[4096], data[4096], swap[4096], log[4096], log1[4200], out[4096], *o;
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    snprintf(log, sizeof(log), "%s/run.jsonl", dir);
    snprintf(log1, sizeof(log1), "%s.rank-1", log);
    snprintf(out, sizeof(out), "%s/launch.out", dir);
    files(swap, cfg, sizeof(cfg), data, sizeof(data));
    /* No checkpoint but the one at the start until the run stops. */
    pid_t pid = spawn(false, out,
                      "launch -n 2 -- %s train --config %s --data %s " MODEL
                      " --steps 100000 --checkpoint-every 0 --log %s",
                      getenv("ZINF_BIN"), cfg, data, log);
    wait_lines(log, 5, out);
    pid_t kids[4];
    int nk = children_of(pid, kids, 4);
    cr_assert_eq(nk, 2, "the launcher's ranks: %s", read_text(out));
    cr_assert_eq(kill(pid, SIGKILL), 0);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    /* The ranks are someone else's children now: gone (or a zombie) is what is looked for. */
    double t0 = now_s();
    for (int r = 0; r < nk; r++) {
        char s;
        while ((s = comm_proc_state(kids[r])) != '?' && s != 'Z' && now_s() - t0 < 30)
            usleep(10000);
        cr_assert(s == '?' || s == 'Z', "rank %d (pid %d) still running, state %c", r, (int)kids[r],
                  s);
    }
    int saved0 = summary_checkpoint(log), saved1 = summary_checkpoint(log1);
    int last = read_steps(log, NULL).last;
    cr_assert_gt(saved0, 0, "rank 0 saved no step as it stopped (the last it logged: %d)", last);
    cr_assert_eq(saved1, saved0, "rank 1 saved step %d, rank 0 step %d", saved1, saved0);
    cr_assert_geq(saved0, last, "rank 0 logged step %d, saved %d", last, saved0);

    unlink(log);
    cr_assert_eq(run(&o,
                     "launch -n 2 -- %s train --config %s --data %s " MODEL
                     " --steps %d --resume --log %s",
                     getenv("ZINF_BIN"), cfg, data, saved0 + 2, log),
                 0, "%s", o);
    struct steps s = read_steps(log, NULL);
    cr_assert_eq(s.first, saved0 + 1, "resumed at step %d, not after %d: %s", s.first, saved0, o);
    cr_assert_eq(s.last, saved0 + 2, "%s", o);
    free(o);
}

/* Ctrl-Z used to stop the launcher only: the ranks trained on, then blocked on a full
 * pipe, and `fg` after zinf.comm_timeout failed the job. SIGTSTP now stops every rank and
 * then the launcher; nothing moves while stopped, for longer than the ranks' timeout of a
 * collective (ranks stopped together do not fail each other); SIGCONT continues them, and
 * the run ends as one never stopped, with the same losses and parameters. */
Test(launch_faults, ctrl_z_stops_the_ranks_and_fg_finishes_the_run_unchanged)
{
    char cfg[4096], data[4096], swap[4096], log[4096], ref_log[4096], out[4096], *o;
    static char ref[MAX_STEPS + 1][64], got[MAX_STEPS + 1][64];
    enum { STEPS = 300 };
    const char *bin = getenv("ZINF_BIN");
    snprintf(swap, sizeof(swap), "%s/ref", dir);
    snprintf(ref_log, sizeof(ref_log), "%s/ref.jsonl", dir);
    files(swap, cfg, sizeof(cfg), data, sizeof(data));
    cr_assert_eq(run(&o,
                     "launch -n 2 -- %s train --config %s --data %s " MODEL " --steps %d --log %s",
                     bin, cfg, data, STEPS, ref_log),
                 0, "%s", o);
    free(o);
    cr_assert_eq(read_steps(ref_log, ref).last, STEPS);

    snprintf(swap, sizeof(swap), "%s/stopped", dir);
    snprintf(log, sizeof(log), "%s/stopped.jsonl", dir);
    snprintf(out, sizeof(out), "%s/stopped.out", dir);
    files(swap, cfg, sizeof(cfg), data, sizeof(data));
    /* A timeout that a collective of this model does not reach on a busy machine (under
     * ASan, beside other tests), and stops longer than it. */
    setenv("ZINF_COMM_OP_TIMEOUT_MS", "4000", 1);
    pid_t pid = spawn(true, out,
                      "launch -n 2 -- %s train --config %s --data %s " MODEL " --steps %d --log %s",
                      bin, cfg, data, STEPS, log);
    unsetenv("ZINF_COMM_OP_TIMEOUT_MS");
    wait_lines(log, 3, out);
    pid_t kids[4];
    int nk = children_of(pid, kids, 4), st;
    cr_assert_eq(nk, 2, "the launcher's ranks: %s", read_text(out));
    /* Stopped three times, each longer than a collective's timeout: a stop that finds one
     * rank waiting for the other in a collective failed the job, the time stopped counted
     * as waiting (one stop in three or four finds them so). */
    for (int stop = 0; stop < 3; stop++) {
        if (stop) wait_lines(log, read_steps(log, NULL).lines + 5, out);
        cr_assert_eq(kill(-pid, SIGTSTP), 0); /* Ctrl-Z */
        cr_assert_eq(waitpid(pid, &st, WUNTRACED), pid);
        cr_assert(WIFSTOPPED(st), "the launcher did not stop: %#x: %s", st, read_text(out));
        double t0 = now_s();
        for (int r = 0; r < nk; r++) {
            char s;
            while ((s = comm_proc_state(kids[r])) != 'T' && now_s() - t0 < 5)
                usleep(2000);
            cr_assert_eq(s, 'T', "rank %d (pid %d) is in state %c, not stopped", r, (int)kids[r],
                         s);
        }
        int before = read_steps(log, NULL).lines;
        cr_assert_lt(before, STEPS, "the run ended before it was stopped");
        usleep(stop ? 4500000 : 5000000);
        int after = read_steps(log, NULL).lines;
        cr_assert_eq(after, before, "%d steps ran while the job was stopped", after - before);
        cr_assert_eq(kill(-pid, SIGCONT), 0); /* fg */
    }
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%#x: %s", st, read_text(out));
    cr_assert_eq(read_steps(log, got).last, STEPS);
    for (int step = 1; step <= STEPS; step++)
        cr_assert_str_eq(got[step], ref[step], "step %d", step);
}
