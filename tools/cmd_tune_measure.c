/*
 * cmd_tune_measure.c - one round of one point of `zinf tune`, in either mode, and the
 * config fragment a point stands for.
 *
 *   io      `zinf bench` (this binary, --json) on each path: write then read, every byte
 *           checked; a round's score is the geometric mean of the write and read GB/s, and
 *           with several paths the slowest path's.
 *   swapin  the engine itself, opened from the point's own fragment (plus small budgets):
 *           tensors with an NVMe home, fetched to the device tier in a fixed order, the
 *           schedule learned in a first step; the score is the tensor bytes per second of
 *           the steps after it. Bytes are checked after the timing, through zinf_read.
 *
 * Not here: the grid, the rounds and the command line (cmd_tune.c), the pick or any
 * output (cmd_tune_report.c).
 */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cmd_tune.h"
#include "common.h"
#include "config.h"
#include "engine/engine.h"

extern char **environ;

/* ---- the fragment --------------------------------------------------------------------- */

/* The config a point stands for: what is written out, and (with budgets) what swap-in mode
 * opens the engine from, so that what was measured is what the fragment says. */
json_t *tune_fragment(const struct tune_opts *o, const struct point *p, const char *swapdir_of,
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

char tune_io_exe[PATH_MAX];

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
    char *argv[] = {tune_io_exe, "bench", "--path", (char *)dir, "--size", size, "--block-size", bs,
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
    int r = posix_spawn(&pid, tune_io_exe, &fa, NULL, argv, environ);
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

int tune_measure_io(const struct tune_opts *o, struct point *p, double *score, double *rd,
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

int tune_measure_swapin(const struct tune_opts *o, struct point *p, double *score)
{
    unsigned nt = (unsigned)(o->size / o->tensor_bytes);
    /* The tensors are four times the device tier and eight times the host tier: every step
     * reads all of them from NVMe. */
    uint64_t dev = align_up(MAX(o->size / 4, 2 * o->tensor_bytes), ZINF_ALIGN);
    uint64_t host = align_up(MAX(o->size / 8, 2 * o->tensor_bytes), ZINF_ALIGN);
    json_t *frag = tune_fragment(o, p, SWAP_SUBDIR, dev, host);
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
