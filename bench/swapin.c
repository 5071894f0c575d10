/*
 * swapin.c - how fast the engine brings tensors that live on NVMe into the device tier,
 * next to what the drive reads raw, in one run.
 *
 * A set of tensors totalling several times the device budget (default: 64 x 32 MiB over
 * a 256 MiB device tier, 8x) is registered with an NVMe home and filled with a per-tensor
 * pattern. Each step fetches every tensor to ZINF_TIER_DEVICE in the same fixed order,
 * checks bytes through the returned pointer, releases it clean, and ends with
 * zinf_step(): the first step teaches the engine the order, later steps replay it with
 * prefetch and eviction by next use. One row per step: tensor bytes fetched per second
 * of step wall time, how many fetches found their tensor resident or arriving (from
 * zinf_stats deltas), time callers spent blocked, bytes read from NVMe. The same run
 * then times `zinf bench --read` on the same directory with the same size, block size
 * and queue depth, before and after the steps, and prints the ratio of the two.
 *
 * Only the public API (zinf.h) is used. Not a model of training: nothing computes
 * between fetches, so a fetch that waits waits on the drive, not on the caller.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "cuda_copy.h"
#include "zinf.h"

extern char **environ;

#define MiB ((uint64_t)1 << 20)
#define RAW_FILE "zinf-bench.dat" /* the file `zinf bench` writes in --path */

#define ZINF_CHECK(call)                                                                           \
    do {                                                                                           \
        int r_ = (call);                                                                           \
        if (r_ < 0) {                                                                              \
            fprintf(stderr, "swapin: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,                  \
                    zinf_strerror(r_));                                                            \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

enum verify_mode { VERIFY_SAMPLE, VERIFY_ALL };

struct opts {
    struct bench_opts com; /* the options the bench programs share */
    const char *zinf_bin;
    unsigned steps;
    enum verify_mode verify;
    bool no_raw;
};

struct step_row {
    unsigned step;
    uint64_t bytes, nvme_read_bytes;
    double seconds;
    uint64_t fetches, hits, in_time, late, blocked_ns;
    uint64_t checked_bytes, bad_pages;
    double raw_gbps; /* mean of the zinf bench runs just before and just after; 0: none */
};

/* Check tensor bytes [off, off + len) of a copy pinned at ptr. An emulated device copy
 * is host memory and is read in place; CUDA device memory is read back with zinf_read(),
 * which takes the newest copy in memory: here the pinned device copy, the only one. */
static uint64_t check_range(zinf_engine *e, zinf_tensor t, uint64_t tid, const void *ptr,
                            bool direct, size_t off, size_t len, void *scratch)
{
    if (direct) return pattern_bad_pages((const char *)ptr + off, len, tid, off);
    int r = zinf_read(e, t, off, scratch, len);
    return r < 0 ? len / PAGE_BYTES : pattern_bad_pages(scratch, len, tid, off);
}

/* ---- the raw read figure: `zinf bench --read --json` ---------------------------------- */

/* Run the zinf binary once and take GB/s and verified from its read row. */
static int raw_read(const struct opts *o, uint64_t size, double *gbps, bool *verified)
{
    char sz[32], bs[32], qd[32], out[8192];
    posix_spawn_file_actions_t fa;
    int fd[2], status, r;
    size_t n = 0;
    pid_t pid;

    snprintf(sz, sizeof(sz), "%llu", (unsigned long long)size);
    snprintf(bs, sizeof(bs), "%llu", (unsigned long long)o->com.block_size);
    snprintf(qd, sizeof(qd), "%u", o->com.queue_depth);
    /* --keep: the file is written once, by the first run, and read by every run. */
    const char *argv[] = {o->zinf_bin,    "bench", "--path",        o->com.path, "--size", sz,
                          "--block-size", bs,      "--queue-depth", qd,          "--read", "--keep",
                          "--json",       NULL};
    fflush(stdout);
    if (pipe(fd) < 0) return -errno;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&fa, fd[0]);
    r = -posix_spawn(&pid, o->zinf_bin, &fa, NULL, (char *const *)argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fd[1]);
    if (r < 0) {
        fprintf(stderr, "swapin: cannot run %s: %s\n", o->zinf_bin, strerror(-r));
        close(fd[0]);
        return r;
    }
    for (ssize_t k; n < sizeof(out) - 1 && (k = read(fd[0], out + n, sizeof(out) - 1 - n));) {
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) break;
        n += (size_t)k;
    }
    out[n] = 0;
    close(fd[0]);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    const char *row = strstr(out, "\"op\": \"read\"");
    const char *g = row ? strstr(row, "\"GBps\": ") : NULL;
    if (!g || sscanf(g + 8, "%lf", gbps) != 1) {
        fprintf(stderr, "swapin: %s bench printed no read row:\n%s", o->zinf_bin, out);
        return -EIO;
    }
    *verified =
        strstr(row, "\"verified\": true") != NULL && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    return 0;
}

/* ---- output ------------------------------------------------------------------------ */

static double res_arr_pct(const struct step_row *r)
{
    /* A fetch that finds its prefetched copy ready counts in hits and in prefetch_in_time
     * both, so in_time is inside hits and is not added again. */
    return r->fetches ? 100.0 * (double)(r->hits + r->late) / (double)r->fetches : 0;
}

static double gbps(uint64_t bytes, double seconds)
{
    return seconds > 0 ? (double)bytes / seconds / 1e9 : 0;
}

static void print_header(const struct opts *o, uint64_t total, const struct zinf_stats *st)
{
    if (o->com.json) return;
    printf("# zinf swap-in %s: %u tensors x %llu B = %llu B, home NVMe (%s), %.1fx the device "
           "tier\n",
           zinf_version(), o->com.tensors, (unsigned long long)o->com.tensor_bytes,
           (unsigned long long)total, o->com.path, (double)total / (double)o->com.device_bytes);
    printf("# device tier %llu B (%s), host tier %llu B, block %llu B, queue depth %u, %u "
           "steps, swap files %s\n",
           (unsigned long long)st->tier[ZINF_TIER_DEVICE].capacity_bytes,
           st->device_is_cuda ? "CUDA" : "emulated in host memory",
           (unsigned long long)st->tier[ZINF_TIER_HOST].capacity_bytes,
           (unsigned long long)o->com.block_size, o->com.queue_depth, o->steps,
           st->io_buffered ? "buffered (O_DIRECT refused)" : "O_DIRECT");
    printf("# each step fetches every tensor to the device tier in the same order, checks it, "
           "releases it clean, then calls zinf_step(); step 1 is the one the engine learns\n");
    if (o->verify == VERIFY_ALL)
        printf("# verified: every byte of every fetch, inside the timed step\n");
    else
        printf("# verified: 3 pages of 4 KiB per fetch (first, last, one that moves with the "
               "step), inside the timed step\n");
    printf("# GB/s: tensor bytes fetched / step wall time (10^9 B/s); nvme: bytes read from "
           "NVMe in the step / the same time\n");
    printf("# hits: fetches that found a resident copy (prefetched ones included: in_time "
           "counts those again); late: fetches that joined a prefetch still arriving\n");
    printf("# res+arr: (hits + late) / fetches; blocked: zinf_stats.blocked_ns, time callers "
           "waited inside fetch\n");
    if (!o->no_raw)
        printf("# raw: `%s bench --read` on the same path, size, block and queue depth, run "
               "before each step and after the last; the mean of the runs on either side of the "
               "step; ratio: GB/s / raw\n",
               o->zinf_bin);
    if (!o->no_raw)
        printf("# the pause for a raw run lets the prefetches started at the end of a step land "
               "before the next begins (in_time counts them); nvme GB/s does not gain from it\n");
    printf("#\n");
    printf("# %4s %12s %7s %6s %12s %6s %7s %4s %7s %4s %7s %8s %6s %6s %8s\n", "step", "bytes",
           "time", "GB/s", "nvme_read", "nvme", "fetches", "hits", "in_time", "late", "res+arr",
           "blocked", "raw", "ratio", "verified");
    printf("# %4s %12s %7s %6s %12s %6s %7s %4s %7s %4s %7s %8s %6s %6s %8s\n", "", "(B)", "(s)",
           "", "(B)", "(GB/s)", "", "", "", "", "(%)", "(ms)", "(GB/s)", "", "");
}

static void print_row(const struct opts *o, const struct step_row *r)
{
    double g = gbps(r->bytes, r->seconds), ratio = r->raw_gbps > 0 ? g / r->raw_gbps : 0;
    if (o->com.json) {
        printf("{\"bench\": \"swapin\", \"step\": %u, \"bytes\": %llu, \"seconds\": %.6f, "
               "\"GBps\": %.4f, \"nvme_bytes_read\": %llu, \"nvme_GBps\": %.4f, \"fetches\": "
               "%llu, \"hits\": %llu, \"prefetch_in_time\": %llu, \"prefetch_late\": %llu, "
               "\"resident_or_arriving\": %.4f, \"blocked_ns\": %llu, ",
               r->step, (unsigned long long)r->bytes, r->seconds, g,
               (unsigned long long)r->nvme_read_bytes, gbps(r->nvme_read_bytes, r->seconds),
               (unsigned long long)r->fetches, (unsigned long long)r->hits,
               (unsigned long long)r->in_time, (unsigned long long)r->late, res_arr_pct(r) / 100,
               (unsigned long long)r->blocked_ns);
        if (r->raw_gbps > 0)
            printf("\"raw_read_GBps\": %.4f, \"ratio\": %.4f, ", r->raw_gbps, ratio);
        else
            printf("\"raw_read_GBps\": null, \"ratio\": null, ");
        printf("\"verify\": \"%s\", \"checked_bytes\": %llu, \"bad_pages\": %llu, \"verified\": "
               "%s}\n",
               o->verify == VERIFY_ALL ? "all" : "sample", (unsigned long long)r->checked_bytes,
               (unsigned long long)r->bad_pages, r->bad_pages ? "false" : "true");
    } else {
        printf("  %4u %12llu %7.3f %6.3f %12llu %6.3f %7llu %4llu %7llu %4llu %7.1f %8.1f %6.3f "
               "%6.3f %8s\n",
               r->step, (unsigned long long)r->bytes, r->seconds, g,
               (unsigned long long)r->nvme_read_bytes, gbps(r->nvme_read_bytes, r->seconds),
               (unsigned long long)r->fetches, (unsigned long long)r->hits,
               (unsigned long long)r->in_time, (unsigned long long)r->late, res_arr_pct(r),
               (double)r->blocked_ns / 1e6, r->raw_gbps, ratio, r->bad_pages ? "FAIL" : "ok");
    }
    fflush(stdout);
}

/* ---- arguments ----------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f, "usage: swapin [options]\n"
               "  --path DIR            NVMe swap directory (default ./swap; created if missing)\n"
               "  --device-kind K       emulated | auto (default auto: CUDA if usable)\n"
               "  --device-bytes N      device tier budget (default 256M)\n"
               "  --host-bytes N        host tier budget (default 64M; not on this path)\n"
               "  --tensors N           tensors (default 64)\n"
               "  --tensor-size N       bytes per tensor, a multiple of 4K (default 32M)\n"
               "  --steps N             steps (default 5)\n"
               "  --block-size N        bytes per IO request (default 1M)\n"
               "  --queue-depth N       IO requests in flight (default 32)\n"
               "  --verify sample|all   bytes checked per fetch (default sample)\n"
               "  --zinf BIN            the zinf binary for the raw read figure "
               "(default build/tools/zinf)\n"
               "  --no-raw              skip the raw read figure\n"
               "  --json                one JSON object per row\n");
}

static int parse_args(int argc, char **argv, struct opts *o)
{
    enum { O_STEPS = BENCH_O_OWN, O_VERIFY, O_ZINF, O_NORAW };
    static const struct option longopts[] = {
        {"path", required_argument, NULL, BENCH_O_PATH},
        {"device-kind", required_argument, NULL, BENCH_O_KIND},
        {"device-bytes", required_argument, NULL, BENCH_O_DEV},
        {"host-bytes", required_argument, NULL, BENCH_O_HOST},
        {"tensors", required_argument, NULL, BENCH_O_NT},
        {"tensor-size", required_argument, NULL, BENCH_O_TS},
        {"steps", required_argument, NULL, O_STEPS},
        {"block-size", required_argument, NULL, BENCH_O_BS},
        {"queue-depth", required_argument, NULL, BENCH_O_QD},
        {"verify", required_argument, NULL, O_VERIFY},
        {"zinf", required_argument, NULL, O_ZINF},
        {"no-raw", no_argument, NULL, O_NORAW},
        {"json", no_argument, NULL, BENCH_O_JSON},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    uint64_t v;
    int ch;

    *o = (struct opts){.com = {.path = "./swap",
                               .kind = ZINF_DEVICE_AUTO,
                               .device_bytes = 256 * MiB,
                               .host_bytes = 64 * MiB,
                               .tensor_bytes = 32 * MiB,
                               .block_size = MiB,
                               .tensors = 64,
                               .queue_depth = 32},
                       .zinf_bin = "build/tools/zinf",
                       .steps = 5};
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        bool bad = false;
        switch (ch) {
        case O_ZINF:
            o->zinf_bin = optarg;
            break;
        case O_NORAW:
            o->no_raw = true;
            break;
        case O_VERIFY:
            if (!strcmp(optarg, "sample"))
                o->verify = VERIFY_SAMPLE;
            else if (!strcmp(optarg, "all"))
                o->verify = VERIFY_ALL;
            else
                bad = true;
            break;
        case 'h':
            usage(stdout);
            return 1;
        case '?':
            usage(stderr);
            return -1;
        default:
            if (bench_common_opt(&o->com, ch, optarg, &bad)) break;
            if (parse_size(optarg, &v) < 0 || v == 0) {
                bad = true;
                break;
            }
            switch (ch) {
            case O_STEPS:
                bad = v > 1000000;
                o->steps = (unsigned)v;
                break;
            }
        }
        if (bad) return bench_bad_value("swapin", longopts, ch, optarg);
    }
    return bench_no_operands("swapin", argc, argv);
}

/* ---- the run ------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    struct opts o;
    struct zinf_stats st0, st1;
    zinf_engine *e = NULL;
    int r = parse_args(argc, argv, &o);
    if (r) return r > 0 ? 0 : 2;
    if (mkdir(o.com.path, 0755) < 0 && errno != EEXIST) {
        fprintf(stderr, "swapin: --path %s: %s\n", o.com.path, strerror(errno));
        return 2;
    }
    if (!o.no_raw && access(o.zinf_bin, X_OK) != 0) {
        fprintf(stderr, "swapin: %s is not an executable (--zinf BIN, or --no-raw)\n", o.zinf_bin);
        return 2;
    }
    uint64_t total = (uint64_t)o.com.tensors * o.com.tensor_bytes;

    struct zinf_options zo = {.nvme_path = o.com.path,
                              .device_bytes = o.com.device_bytes,
                              .host_bytes = o.com.host_bytes,
                              .block_size = o.com.block_size,
                              .queue_depth = o.com.queue_depth,
                              .device_kind = o.com.kind};
    ZINF_CHECK(zinf_open(&zo, &e));
    ZINF_CHECK(zinf_stats(e, &st0));
    bool direct = !st0.device_is_cuda;

    /* Setup, untimed: register and write each tensor's pattern to its NVMe home. */
    zinf_tensor *t = calloc(o.com.tensors, sizeof(*t));
    void *buf = aligned_alloc(PAGE_BYTES, o.com.tensor_bytes);
    if (!t || !buf) {
        fprintf(stderr, "swapin: out of memory\n");
        return 1;
    }
    for (unsigned i = 0; i < o.com.tensors; i++) {
        char name[64];
        snprintf(name, sizeof(name), "swapin.%u", i);
        ZINF_CHECK(zinf_register(e, name, o.com.tensor_bytes, ZINF_TIER_NVME, &t[i]));
        pattern_fill(buf, o.com.tensor_bytes, i, 0);
        ZINF_CHECK(zinf_write(e, t[i], 0, buf, o.com.tensor_bytes));
    }
    print_header(&o, total, &st0);

    /* The raw figure is taken before each step and after the last, so that each step sits
     * between two runs of it: the drive's speed drifts, and a ratio to runs seconds away is
     * fairer than one to runs minutes away. With --keep the file is written once. */
    char raw_file[4096];
    snprintf(raw_file, sizeof(raw_file), "%s/%s", o.com.path, RAW_FILE);
    bool raw_file_was_there = access(raw_file, F_OK) == 0, raw_ok = true;
    double *raw = calloc(o.steps + 1, sizeof(double));
    struct step_row *rows = calloc(o.steps, sizeof(*rows));
    if (!raw || !rows) {
        fprintf(stderr, "swapin: out of memory\n");
        return 1;
    }

    uint64_t npages = o.com.tensor_bytes / PAGE_BYTES;
    int fails = 0;
    for (unsigned s = 0; s < o.steps; s++) {
        struct step_row *row = &rows[s];
        bool v = true;
        if (!o.no_raw && s == 0 && raw_read(&o, total, &raw[0], &v) < 0) return 1;
        raw_ok &= v;
        ZINF_CHECK(zinf_stats(e, &st0));
        row->step = s + 1;
        uint64_t t0 = now_ns();
        for (unsigned i = 0; i < o.com.tensors; i++) {
            void *p;
            ZINF_CHECK(zinf_fetch(e, t[i], ZINF_TIER_DEVICE, &p));
            if (o.verify == VERIFY_ALL) {
                row->bad_pages += check_range(e, t[i], i, p, direct, 0, o.com.tensor_bytes, buf);
                row->checked_bytes += o.com.tensor_bytes;
            } else {
                uint64_t pick[3] = {0, npages - 1, (page_key(s, i) % npages)};
                for (int k = 0; k < 3; k++)
                    row->bad_pages +=
                        check_range(e, t[i], i, p, direct, pick[k] * PAGE_BYTES, PAGE_BYTES, buf);
                row->checked_bytes += 3 * PAGE_BYTES;
            }
            ZINF_CHECK(zinf_release(e, t[i], ZINF_TIER_DEVICE, ZINF_RELEASE_CLEAN));
        }
        ZINF_CHECK(zinf_step(e));
        row->seconds = (double)(now_ns() - t0) / 1e9;
        ZINF_CHECK(zinf_stats(e, &st1));
        row->bytes = total;
        row->nvme_read_bytes = st1.nvme_bytes_read - st0.nvme_bytes_read;
        row->fetches = st1.tier[ZINF_TIER_DEVICE].fetches - st0.tier[ZINF_TIER_DEVICE].fetches;
        row->hits = st1.tier[ZINF_TIER_DEVICE].hits - st0.tier[ZINF_TIER_DEVICE].hits;
        row->in_time = st1.prefetch_in_time - st0.prefetch_in_time;
        row->late = st1.prefetch_late - st0.prefetch_late;
        row->blocked_ns = st1.blocked_ns - st0.blocked_ns;
        fails += row->bad_pages != 0;
        if (!o.no_raw) {
            if (raw_read(&o, total, &raw[s + 1], &v) < 0) return 1;
            raw_ok &= v;
            row->raw_gbps = (raw[s] + raw[s + 1]) / 2;
        }
        print_row(&o, row);
    }
    if (!o.no_raw && !raw_file_was_there) /* a file that was there before is the user's */
        unlink(raw_file);

    /* Summary over the steps after the learned one: bytes over time, not a mean of rates;
     * the raw figure is the mean of the runs around those steps. */
    double later_s = 0, min_res = 100, raw_mean = 0;
    uint64_t later_bytes = 0, later_nvme = 0;
    for (unsigned s = 1; s < o.steps; s++) {
        later_s += rows[s].seconds;
        later_bytes += rows[s].bytes;
        later_nvme += rows[s].nvme_read_bytes;
        min_res = fmin(min_res, res_arr_pct(&rows[s]));
    }
    for (unsigned k = 1; k <= o.steps && o.steps > 1; k++)
        raw_mean += raw[k] / o.steps;
    double later_gbps = gbps(later_bytes, later_s), later_nvme_gbps = gbps(later_nvme, later_s);
    double ratio = raw_mean > 0 ? later_gbps / raw_mean : 0;
    double nvme_ratio = raw_mean > 0 ? later_nvme_gbps / raw_mean : 0;
    bool ratio_met = ratio >= 0.9, res_met = min_res >= 95.0;
    /* On a GPU the path ends with a PCIe copy: a plain pinned cudaMemcpy H2D from this run is
     * the other bound, and swap-in is held to the slower of the two. */
    double h2d = 0, bound = 0, gpu_ratio = 0;
    bool on_gpu = !direct;
    if (on_gpu) {
        size_t hb = total < ((size_t)256 << 20) ? (size_t)total : (size_t)256 << 20;
        if (bench_pinned_h2d(0, hb, 8, &h2d) < 0) {
            fprintf(stderr, "swapin: the pinned H2D copy failed\n");
            h2d = 0;
        }
        bound = o.no_raw ? h2d : fmin(raw_mean, h2d);
        gpu_ratio = bound > 0 ? later_gbps / bound : 0;
    }
    if (o.com.json) {
        printf("{\"bench\": \"swapin\", \"summary\": true, \"steps_after_first_GBps\": %.4f, "
               "\"steps_after_first_nvme_GBps\": %.4f, ",
               later_gbps, later_nvme_gbps);
        if (o.no_raw)
            printf("\"raw_read_GBps\": null, \"ratio\": null, \"nvme_ratio\": null, "
                   "\"ratio_target_met\": null, ");
        else
            printf("\"raw_read_GBps\": %.4f, \"raw_read_verified\": %s, \"ratio\": %.4f, "
                   "\"nvme_ratio\": %.4f, \"ratio_target_met\": %s, ",
                   raw_mean, raw_ok ? "true" : "false", ratio, nvme_ratio,
                   ratio_met ? "true" : "false");
        if (on_gpu)
            printf("\"pinned_h2d_GBps\": %.4f, \"bound_GBps\": %.4f, \"gpu_ratio\": %.4f, "
                   "\"gpu_target_met\": %s, ",
                   h2d, bound, gpu_ratio, gpu_ratio >= 0.9 ? "true" : "false");
        printf("\"min_resident_or_arriving_after_first\": %.4f, \"resident_target_met\": %s, "
               "\"verified\": %s}\n",
               min_res / 100, res_met ? "true" : "false", fails ? "false" : "true");
    } else if (o.steps > 1) {
        printf("# steps 2..%u: %.3f GB/s of tensor bytes fetched, %.3f GB/s read from NVMe\n",
               o.steps, later_gbps, later_nvme_gbps);
        if (!o.no_raw) {
            printf("# zinf bench --read around those steps: %.3f GB/s (runs:", raw_mean);
            for (unsigned k = 0; k <= o.steps; k++)
                printf(" %.3f", raw[k]);
            printf("; %s)\n", raw_ok ? "verified" : "NOT verified");
            printf("# ratio swap-in / zinf bench read: %.3f (target >= 0.9: %s); NVMe bytes read "
                   "per second in the steps / zinf bench read: %.3f\n",
                   ratio, ratio_met ? "met" : "NOT met", nvme_ratio);
        }
        if (on_gpu)
            printf("# pinned cudaMemcpy H2D, same run: %.3f GB/s; swap-in / min(NVMe read, H2D) "
                   "= %.3f / %.3f = %.3f (target >= 0.9: %s)\n",
                   h2d, later_gbps, bound, gpu_ratio, gpu_ratio >= 0.9 ? "met" : "NOT met");
        printf("# resident or arriving, steps 2..%u: min %.1f%% (target >= 95%%: %s)\n", o.steps,
               min_res, res_met ? "met" : "NOT met");
    }
    if (!o.com.json)
        printf("# %s\n",
               fails || !raw_ok ? "FAILED: see the rows marked FAIL" : "all rows verified");

    for (unsigned i = 0; i < o.com.tensors; i++)
        ZINF_CHECK(zinf_unregister(e, t[i]));
    zinf_close(e);
    free(rows);
    free(raw);
    free(buf);
    free(t);
    return fails || !raw_ok ? 1 : 0;
}
