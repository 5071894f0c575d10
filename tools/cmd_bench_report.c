/*
 * cmd_bench_report.c - what `zinf bench` prints: the header, one row per pass in the
 * nccl-tests shape (size, block size, queue depth, time, GB/s, IOPS, latencies, CPU
 * seconds per GB, what the device saw, and whether every byte read back was right), or one
 * JSON object per row with --json; and the sweep's best as an `aio` config snippet.
 *
 * Not here: the command line (cmd_bench.c) or the measurements (cmd_bench_run.c).
 */
#include <stdio.h>

#include "cmd_bench.h"
#include "common.h"
#include "io/uring.h"

/* ---- output ----------------------------------------------------------------------- */

double bench_gbps(const struct row *r)
{
    return r->seconds > 0 ? (double)r->bytes / r->seconds / 1e9 : 0;
}

static double iops(const struct row *r)
{
    return r->seconds > 0 ? (double)r->requests / r->seconds : 0;
}

void bench_print_header(const struct bench_opts *o, const char *path, struct uring_stats *st,
                        bool direct, bool huge)
{
    char sz[32];
    if (o->json)
        return;
    printf("# zinf bench %s: %s, %s\n", zinf_version(), path, format_size(o->size, sz, sizeof(sz)));
    char rings[32] = "";
    if (st->rings) /* the threads backend has none */
        snprintf(rings, sizeof(rings), " (%u ring%s)", st->rings, st->rings == 1 ? "" : "s");
    printf("# backend %s%s, O_DIRECT %s, fixed buffers %s, fixed files %s, sqpoll %s, "
           "submit batch %u, huge pages %s\n",
           uring_backend_name(st->backend), rings, direct ? "yes" : "no (filesystem refused it)",
           st->fixed_buffers && !o->no_fixed ? "yes" : "no", st->fixed_files ? "yes" : "no",
           st->sqpoll ? "yes" : "no", st->submit_batch,
           huge         ? "yes"
           : o->no_huge ? "no (--no-huge-pages)"
                        : "no (the kernel refused them)");
    printf("# GB/s is 10^9 bytes per second; cpu is this process's user+system time per GB\n");
    printf("# dev_reqs, merges, dev_avg: requests the block device under the path completed in\n"
           "#   the pass, how many it merged into others, their average size (the whole device:\n"
           "#   other IO on it counts too; '-' where there is no block device)\n");
    printf("# iops, p50..p99.9: requests per second, and their latency from submission to\n"
           "#   completion (fio's lat)%s\n",
           o->random ? "; --random: the blocks in a random order, each once"
                     : "; sequential passes keep 2 x qd requests out, so these include the\n"
                       "#   wait in the engine's queue");
    printf("#\n");
    printf("# %7s %6s %14s %9s %5s %9s %8s %9s %9s %9s %9s %9s %9s %9s %8s %9s %9s\n", "engine",
           "op", "size", "block", "qd", "time", "GB/s", "iops", "p50", "p90", "p99", "p99.9",
           "cpu_s/GB", "dev_reqs", "merges", "dev_avg", "verified");
    printf("# %7s %6s %14s %9s %5s %9s %8s %9s %9s %9s %9s %9s %9s %9s %8s %9s %9s\n", "", "",
           "(B)", "(B)", "", "(s)", "", "", "(us)", "(us)", "(us)", "(us)", "", "", "", "(B)", "");
}

void bench_print_row(const struct bench_opts *o, const struct row *r, int err)
{
    double gb = (double)r->bytes / 1e9;
    const char *v = err ? "error" : r->verified ? "ok" : "FAIL";
    char reqs[24] = "-", merges[24] = "-", avg[24] = "-";
    if (r->dev_ok) {
        snprintf(reqs, sizeof(reqs), "%llu", (unsigned long long)r->dev_requests);
        snprintf(merges, sizeof(merges), "%llu", (unsigned long long)r->dev_merges);
        snprintf(avg, sizeof(avg), "%llu",
                 (unsigned long long)(r->dev_requests ? r->dev_bytes / r->dev_requests : 0));
    }
    if (o->json) {
        char dev[160] = "null";
        if (r->dev_ok)
            snprintf(dev, sizeof(dev),
                     "{\"requests\": %s, \"merges\": %s, \"avg_request_bytes\": %s}", reqs,
                     merges, avg);
        printf("{\"engine\": \"%s\", \"op\": \"%s\", \"random\": %s, \"bytes\": %llu, "
               "\"block_size\": %zu, "
               "\"queue_depth\": %u, \"submit_batch\": %u, \"rings\": %u, \"huge_pages\": %s, "
               "\"seconds\": %.6f, \"GBps\": %.4f, \"requests\": %llu, \"iops\": %.1f, "
               "\"lat_us\": {\"p50\": %.3f, \"p90\": %.3f, \"p99\": %.3f, \"p99.9\": %.3f}, "
               "\"cpu_s_per_GB\": %.4f, "
               "\"device\": %s, \"verified\": %s, \"bad_blocks\": %llu, \"error\": %s%s%s}\n",
               r->engine, r->op, o->random ? "true" : "false", (unsigned long long)r->bytes,
               r->block_size, r->queue_depth,
               r->submit_batch, r->rings, r->huge ? "true" : "false", r->seconds, bench_gbps(r),
               (unsigned long long)r->requests, iops(r), r->lat_us[0], r->lat_us[1], r->lat_us[2],
               r->lat_us[3], gb > 0 ? r->cpu_seconds / gb : 0, dev,
               !err && r->verified ? "true" : "false",
               (unsigned long long)r->bad_blocks, err ? "\"" : "",
               err ? zinf_strerror(err) : "null", err ? "\"" : "");
    } else {
        printf("  %7s %6s %14llu %9zu %5u %9.3f %8.3f %9.0f %9.1f %9.1f %9.1f %9.1f %9.3f %9s %8s "
               "%9s %9s\n",
               r->engine, r->op, (unsigned long long)r->bytes, r->block_size, r->queue_depth,
               r->seconds, bench_gbps(r), iops(r), r->lat_us[0], r->lat_us[1], r->lat_us[2],
               r->lat_us[3], gb > 0 ? r->cpu_seconds / gb : 0, reqs, merges, avg, v);
        if (err)
            printf("# %s %s failed: %s\n", r->engine, r->op, zinf_strerror(err));
    }
    fflush(stdout);
}

void bench_print_best(const struct bench_opts *o, size_t best_bs, unsigned best_qd, double best_rd,
                      double best_wr)
{
    if (o->json) {
        printf("{\"best\": {\"block_size\": %zu, \"queue_depth\": %u, \"read_GBps\": %.4f, "
               "\"write_GBps\": %.4f}, \"aio\": {\"block_size\": %zu, \"queue_depth\": %u, "
               "\"intra_op_parallelism\": 1, \"single_submit\": false, "
               "\"overlap_events\": true}}\n",
               best_bs, best_qd, best_rd, best_wr, best_bs, best_qd);
    } else {
        printf("# best: block %zu, queue depth %u (read %.3f GB/s, write %.3f GB/s)\n",
               best_bs, best_qd, best_rd, best_wr);
        printf("# as a config (zinf config check accepts it; DeepSpeed reads the same "
               "keys):\n");
        printf("{\"aio\": {\"block_size\": %zu, \"queue_depth\": %u, "
               "\"intra_op_parallelism\": 1, \"single_submit\": false, "
               "\"overlap_events\": true}}\n",
               best_bs, best_qd);
    }
}
