/*
 * cmd_bench.h - what the files of `zinf bench` share: its options, a row of its table, and
 * the functions each offers the others. cmd_bench.c has the command line and runs the
 * passes; cmd_bench_run.c measures one pass (through the engine, or plain pread/pwrite);
 * cmd_bench_report.c prints the table or the JSON.
 */
#ifndef ZINF_TOOLS_CMD_BENCH_H
#define ZINF_TOOLS_CMD_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "io/uring.h"

struct bench_opts {
    const char *dir;
    uint64_t size;
    size_t block_size;
    unsigned queue_depth;
    unsigned submit_batch, rings;
    bool do_read, do_write, sweep, json, baseline, keep, sqpoll, no_fixed, no_huge;
    bool random;    /* blocks in a random order, each once */
    uint64_t seed;  /* of that order */
    enum uring_backend backend;
};

struct row {
    const char *engine; /* "zinf" or "pread" */
    const char *op;
    uint64_t bytes;
    size_t block_size;
    unsigned queue_depth;
    double seconds, cpu_seconds;
    bool verified, huge;
    unsigned submit_batch, rings; /* in use (uring_stats); 1 and 0 for pread rows */
    uint64_t bad_blocks;
    uint64_t requests;
    double lat_us[4]; /* p50, p90, p99, p99.9 of the requests' latencies */
    /* What the block device under the file saw during the pass (the whole device: other
     * IO on it counts too); dev_ok false where there is none (tmpfs) or no stat file. */
    bool dev_ok;
    uint64_t dev_requests, dev_merges, dev_bytes;
};

struct devsnap {
    bool ok;
    uint64_t reqs[2], merges[2], sectors[2]; /* [0] reads, [1] writes */
};

/* cmd_bench_run.c */
/* Whether passes draw a progress bar (a terminal, no --json). */
extern bool bench_show_progress;
/* /sys/dev/block/MAJ:MIN/stat of the device (or partition) that holds path. */
struct devsnap bench_dev_snap(const char *path);
/* What the device did between a and b, for a pass of op, into r. */
void bench_dev_account(struct row *r, const struct devsnap *a, const struct devsnap *b,
                       enum uring_op op);
/* Whether len bytes at buf hold the pattern of file offset off. */
bool bench_pattern_check(const void *buf, size_t len, uint64_t off);
/* The blocks of bs in size bytes, each once: in order, or shuffled by seed. */
uint64_t *bench_block_order(uint64_t size, size_t bs, bool shuffle, uint64_t seed, uint64_t *n);
/* One pass through the engine, nslots requests outstanding (order NULL: sequential). */
int bench_engine_run(struct uring *u, int file, enum uring_op op, uint64_t size, size_t bs,
                     unsigned nslots, char *mem, const uint64_t *order, struct row *row);
/* One pass of plain pread/pwrite, one request at a time. */
int bench_baseline_run(const char *path, enum uring_op op, uint64_t size, size_t bs, char *buf,
                       const uint64_t *order, struct row *row);

/* cmd_bench_report.c */
double bench_gbps(const struct row *r);
void bench_print_header(const struct bench_opts *o, const char *path, struct uring_stats *st,
                        bool direct, bool huge);
void bench_print_row(const struct bench_opts *o, const struct row *r, int err);
/* The sweep's best pair, and the config snippet that says it. */
void bench_print_best(const struct bench_opts *o, size_t best_bs, unsigned best_qd, double best_rd,
                      double best_wr);

#endif
