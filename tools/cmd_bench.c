/*
 * cmd_bench.c - `zinf bench`: what the swap path reaches on this machine.
 *
 * Writes a file through the IO engine (io_uring, O_DIRECT, registered buffers), drops it
 * from the page cache, reads it back, and prints one row per run in the nccl-tests shape:
 * size, block size, queue depth, time, GB/s, CPU seconds per GB and whether every byte
 * read back was right. --baseline adds a row done with plain pread/pwrite; --sweep tries
 * block sizes x queue depths and ends with the best as an `aio` config snippet.
 *
 * Each request's latency (from its submission to the engine until its completion reaches
 * the caller) is kept: every row has IOPS and the p50/p90/p99/p99.9 latencies, as fio's
 * lat. --random reads and writes the blocks in a random order (each once, as fio's
 * randread/randwrite do with their random map), with requests of 4 KiB to 1 MiB; it keeps
 * queue_depth requests out (the sequential passes keep twice that, half of them waiting in
 * the engine's queue, which their latencies include).
 *
 * This file holds the command line, the test file and its buffers, and the order of the
 * passes. Not here: a pass itself and the pattern that checks every byte
 * (cmd_bench_run.c), or the table and the JSON (cmd_bench_report.c).
 *
 * Not a general IO benchmark: one file, one process; fio is the tool for more.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "cmd.h"
#include "cmd_bench.h"
#include "common.h"
#include "hugemem.h"
#include "io/uring.h"
#include "progress.h"

#define BENCH_FILE "zinf-bench.dat"

/* ---- orchestration ---------------------------------------------------------------- */

static int drop_cache(int fd)
{
    /* O_DIRECT bypasses the page cache already; this matters for the buffered fallback
     * and for the baseline, so that reads come from the device. */
    if (fdatasync(fd) < 0)
        return -errno;
    int r = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    return -r;
}

struct bench_ctx {
    struct bench_opts o;
    char path[4096];
    struct uring *u;
    int file;
    char *mem;       /* queue_depth x block_size for the largest pair of the run */
    size_t mem_bytes;
    int region;
    bool huge; /* the kernel took MADV_HUGEPAGE for mem */
};

/* One (block size, queue depth) pair through an engine opened for exactly that pair. */
static int run_pair(struct bench_ctx *c, size_t bs, unsigned qd, bool report, double *rd,
                    double *wr)
{
    struct uring_opts uo = {.block_size = bs, .queue_depth = qd, .backend = c->o.backend,
                            .sqpoll = c->o.sqpoll, .submit_batch = c->o.submit_batch,
                            .rings = c->o.rings};
    struct uring *u = NULL;
    struct row row;
    int err, fails = 0, file, region = -1;
    /* Random: exactly qd out, so that a latency is the device's and the engine's only. */
    unsigned nslots = (unsigned)MIN((uint64_t)(c->o.random ? 1 : 2) * qd, c->mem_bytes / bs);
    uint64_t nblocks;
    uint64_t *order = bench_block_order(c->o.size, bs, c->o.random, c->o.seed, &nblocks);
    if (!order) {
        fprintf(stderr, "zinf bench: no memory for the order of %s's blocks\n", c->path);
        return 1;
    }

    if ((err = uring_open(&uo, &u)) < 0 ||
        (file = err = uring_file_open(u, c->path, O_RDWR, 0)) < 0) {
        fprintf(stderr, "zinf bench: %s: %s\n", c->path, zinf_strerror(err));
        uring_close(u);
        return 1;
    }
    if (!c->o.no_fixed)
        region = uring_buf_register(u, c->mem, c->mem_bytes);
    struct uring_stats ps;
    uring_get_stats(u, &ps);
    if (c->o.do_write) {
        row = (struct row){.engine = "zinf",
                           .op = "write",
                           .block_size = bs,
                           .queue_depth = qd,
                           .huge = c->huge,
                           .submit_batch = ps.submit_batch,
                           .rings = ps.rings};
        struct devsnap d0 = bench_dev_snap(c->path);
        err = bench_engine_run(u, file, URING_WRITE, c->o.size, bs, nslots, c->mem, order, &row);
        struct devsnap d1 = bench_dev_snap(c->path);
        bench_dev_account(&row, &d0, &d1, URING_WRITE);
        if (report)
            bench_print_row(&c->o, &row, err);
        fails += err != 0;
        if (wr)
            *wr = err ? 0 : bench_gbps(&row);
    }
    if (c->o.do_read) {
        drop_cache(uring_file_fd(u, file));
        row = (struct row){.engine = "zinf",
                           .op = "read",
                           .block_size = bs,
                           .queue_depth = qd,
                           .huge = c->huge,
                           .submit_batch = ps.submit_batch,
                           .rings = ps.rings};
        struct devsnap d0 = bench_dev_snap(c->path);
        err = bench_engine_run(u, file, URING_READ, c->o.size, bs, nslots, c->mem, order, &row);
        struct devsnap d1 = bench_dev_snap(c->path);
        bench_dev_account(&row, &d0, &d1, URING_READ);
        if (report)
            bench_print_row(&c->o, &row, err);
        fails += err != 0 || !row.verified;
        if (rd)
            *rd = err || !row.verified ? 0 : bench_gbps(&row);
    }
    if (region >= 0)
        uring_buf_unregister(u, region);
    uring_close(u);
    free(order);
    return fails;
}

static int ensure_file(struct bench_ctx *c)
{
    struct stat st;
    struct row row = {0};
    int fd = uring_file_fd(c->u, c->file);

    if (fstat(fd, &st) == 0 && (uint64_t)st.st_size >= c->o.size) {
        /* Check one block at each end: a file from elsewhere fails here, not mid-run. */
        size_t n = ZINF_ALIGN;
        if (uring_rw(c->u, URING_READ, c->file, c->mem, n, 0) == 0 &&
            bench_pattern_check(c->mem, n, 0) &&
            uring_rw(c->u, URING_READ, c->file, c->mem, n, align_down(c->o.size - 1, n)) == 0 &&
            bench_pattern_check(c->mem, n, align_down(c->o.size - 1, n)))
            return 0;
    }
    return bench_engine_run(
        c->u, c->file, URING_WRITE, c->o.size, c->o.block_size,
        (unsigned)MIN((uint64_t)c->o.queue_depth, c->mem_bytes / c->o.block_size), c->mem, NULL,
        &row);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: zinf bench --path DIR [options]\n"
            "  --path DIR          directory for the test file (%s), on the drive to measure\n"
            "  --size N            bytes to write and read (default 1G; 4G, 512M, 1048576)\n"
            "  --block-size N      bytes per IO request (default 1M; multiple of 4K, <= 64M)\n"
            "  --queue-depth N     requests in flight (default 32; 1..4096)\n"
            "  --read | --write | --both   which passes to time (default both); --read alone\n"
            "                      first writes the file when it is missing\n"
            "  --baseline          add rows done with plain pread/pwrite, one at a time\n"
            "  --random            the blocks in a random order, each once (fio's randread and\n"
            "                      randwrite); --block-size 4K..1M, default 4K\n"
            "  --seed N            that order (default: a fixed one)\n"
            "  --sweep             block sizes 128K..8M x queue depths 1..128; prints the best\n"
            "                      as an aio config snippet\n"
            "  --json              one JSON object per row on stdout\n"
            "  --backend B         io_uring | threads (default: io_uring, threads if unavailable)\n"
            "  --sqpoll            use a kernel submission-polling thread\n"
            "  --submit-batch N    refill the queue only once N slots are free (default 1:\n"
            "                      one request per completion; zinf.submit_batch)\n"
            "  --rings N           io_uring rings, each with its own completion thread\n"
            "                      (default 1, at most 8; aio.intra_op_parallelism)\n"
            "  --no-fixed-buffers  do not register the buffers with io_uring\n"
            "  --no-huge-pages     4 KiB pages for the buffers (default: transparent huge\n"
            "                      pages, as the engine's host arena uses)\n"
            "  --keep              keep the test file afterwards\n"
            "Exit status: 0 done, every byte read back as written; 1 an IO error or a byte\n"
            "that read back wrong; 2 bad usage, or a --path that is not a directory or lacks\n"
            "room for --size.\n",
            BENCH_FILE);
}

static int parse_args(int argc, char **argv, struct bench_opts *o)
{
    enum { O_READ = 256, O_WRITE, O_BOTH, O_SWEEP, O_JSON, O_BASE, O_KEEP, O_BACKEND, O_SQPOLL,
           O_NOFIXED, O_NOHUGE, O_BATCH, O_RINGS, O_RANDOM, O_SEED };
    static const struct option longopts[] = {
        {"path", required_argument, NULL, 'p'},
        {"size", required_argument, NULL, 's'},
        {"block-size", required_argument, NULL, 'b'},
        {"queue-depth", required_argument, NULL, 'q'},
        {"read", no_argument, NULL, O_READ},
        {"write", no_argument, NULL, O_WRITE},
        {"both", no_argument, NULL, O_BOTH},
        {"sweep", no_argument, NULL, O_SWEEP},
        {"json", no_argument, NULL, O_JSON},
        {"baseline", no_argument, NULL, O_BASE},
        {"keep", no_argument, NULL, O_KEEP},
        {"backend", required_argument, NULL, O_BACKEND},
        {"sqpoll", no_argument, NULL, O_SQPOLL},
        {"no-fixed-buffers", no_argument, NULL, O_NOFIXED},
        {"no-huge-pages", no_argument, NULL, O_NOHUGE},
        {"submit-batch", required_argument, NULL, O_BATCH},
        {"rings", required_argument, NULL, O_RINGS},
        {"random", no_argument, NULL, O_RANDOM},
        {"seed", required_argument, NULL, O_SEED},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    bool rd = false, wr = false, bs_given = false;
    uint64_t v;
    int ch;

    *o = (struct bench_opts){.size = GiB, .block_size = MiB, .queue_depth = 32};
    optind = 1;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, "p:s:b:q:h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'p': o->dir = optarg; break;
        case 's':
            if (parse_size(optarg, &v) < 0 || v == 0) {
                fprintf(stderr, "zinf bench: --size: expected a size like 4G, got '%s'\n", optarg);
                return -1;
            }
            o->size = align_up(v, ZINF_ALIGN);
            break;
        case 'b':
            if (parse_size(optarg, &v) < 0 || v == 0 || !is_aligned(v, ZINF_ALIGN) || v > 64 * MiB) {
                fprintf(stderr, "zinf bench: --block-size: must be a multiple of 4096 up to 64M, "
                                "got '%s'\n", optarg);
                return -1;
            }
            o->block_size = v;
            bs_given = true;
            break;
        case 'q':
            if (parse_size(optarg, &v) < 0 || v == 0 || v > 4096) {
                fprintf(stderr, "zinf bench: --queue-depth: must be 1..4096, got '%s'\n", optarg);
                return -1;
            }
            o->queue_depth = (unsigned)v;
            break;
        case O_READ: rd = true; break;
        case O_WRITE: wr = true; break;
        case O_BOTH: rd = wr = true; break;
        case O_SWEEP: o->sweep = true; break;
        case O_JSON: o->json = true; break;
        case O_BASE: o->baseline = true; break;
        case O_KEEP: o->keep = true; break;
        case O_RANDOM: o->random = true; break;
        case O_SEED:
            if (parse_size(optarg, &v) < 0) {
                fprintf(stderr, "zinf bench: --seed: expected a number, got '%s'\n", optarg);
                return -1;
            }
            o->seed = v;
            break;
        case O_SQPOLL: o->sqpoll = true; break;
        case O_NOFIXED: o->no_fixed = true; break;
        case O_NOHUGE: o->no_huge = true; break;
        case O_BATCH:
            if (parse_size(optarg, &v) < 0 || v > 1024) {
                fprintf(stderr, "zinf bench: --submit-batch: must be 0..1024, got '%s'\n", optarg);
                return -1;
            }
            o->submit_batch = (unsigned)v;
            break;
        case O_RINGS:
            if (parse_size(optarg, &v) < 0 || v < 1 || v > URING_MAX_RINGS) {
                fprintf(stderr, "zinf bench: --rings: must be 1..%d, got '%s'\n", URING_MAX_RINGS,
                        optarg);
                return -1;
            }
            o->rings = (unsigned)v;
            break;
        case O_BACKEND:
            if (!strcmp(optarg, "io_uring"))
                o->backend = URING_BACKEND_IO_URING;
            else if (!strcmp(optarg, "threads"))
                o->backend = URING_BACKEND_THREADS;
            else {
                fprintf(stderr, "zinf bench: --backend: must be io_uring or threads, got '%s'\n",
                        optarg);
                return -1;
            }
            break;
        case 'h': usage(stdout); return 1;
        default:
            fprintf(stderr, "zinf bench: unknown or incomplete option '%s'\n", argv[optind - 1]);
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "zinf bench: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (!o->dir) {
        fprintf(stderr, "zinf bench: --path DIR is required\n");
        return -1;
    }
    if (o->random) {
        if (!bs_given) o->block_size = 4 * KiB;
        if (o->block_size > MiB) {
            fprintf(stderr, "zinf bench: --random: requests of 4K to 1M, got --block-size %zu\n",
                    o->block_size);
            return -1;
        }
        if (o->sweep) {
            fprintf(stderr, "zinf bench: --random and --sweep: the sweep is sequential; give one\n");
            return -1;
        }
    }
    o->do_read = rd || !wr;
    o->do_write = wr || !rd;
    return 0;
}

int cmd_bench(int argc, char **argv)
{
    static const size_t sweep_bs[] = {128 * KiB, 256 * KiB, 512 * KiB, MiB, 2 * MiB, 4 * MiB,
                                      8 * MiB};
    static const unsigned sweep_qd[] = {1, 2, 4, 8, 16, 32, 64, 128};
    struct bench_ctx c = {.file = -1, .region = -1};
    struct uring_stats st;
    struct statvfs vfs;
    struct stat sb;
    bool created = false;
    int fails = 0, r;

    r = parse_args(argc, argv, &c.o);
    if (r)
        return r > 0 ? 0 : (usage(stderr), 2);
    bench_show_progress = progress_wanted(c.o.json);
    if (stat(c.o.dir, &sb) < 0 || !S_ISDIR(sb.st_mode)) {
        fprintf(stderr, "zinf bench: --path %s: %s\n", c.o.dir,
                stat(c.o.dir, &sb) < 0 ? strerror(errno) : "not a directory");
        return 2;
    }
    snprintf(c.path, sizeof(c.path), "%s/%s", c.o.dir, BENCH_FILE);
    created = access(c.path, F_OK) != 0;
    if (created && statvfs(c.o.dir, &vfs) == 0 &&
        (uint64_t)vfs.f_bavail * vfs.f_frsize < c.o.size + 64 * MiB) {
        char a[32], b[32];
        fprintf(stderr, "zinf bench: --path %s: %s free, the test needs %s (--size)\n", c.o.dir,
                format_size((uint64_t)vfs.f_bavail * vfs.f_frsize, a, sizeof(a)),
                format_size(c.o.size, b, sizeof(b)));
        return 2;
    }

    size_t max_bs = c.o.block_size;
    unsigned max_qd = c.o.queue_depth;
    if (c.o.sweep) {
        max_bs = MAX(max_bs, sweep_bs[ARRAY_SIZE(sweep_bs) - 1]);
        max_qd = MAX(max_qd, sweep_qd[ARRAY_SIZE(sweep_qd) - 1]);
    }
    struct uring_opts uo = {.block_size = max_bs,
                            .queue_depth = max_qd,
                            .backend = c.o.backend,
                            .sqpoll = c.o.sqpoll,
                            .submit_batch = c.o.submit_batch,
                            .rings = c.o.rings};
    if ((r = uring_open(&uo, &c.u)) < 0) {
        fprintf(stderr, "zinf bench: cannot set up the IO engine: %s\n", zinf_strerror(r));
        return 1;
    }
    c.file = uring_file_open(c.u, c.path, O_RDWR | O_CREAT, 0644);
    if (c.file < 0) {
        fprintf(stderr, "zinf bench: %s: %s\n", c.path, zinf_strerror(c.file));
        fails++;
        goto out;
    }
    /* Lay the file out first, as fio does: a write that extends a file serialises on the
     * inode and is not what the swap path does (swap files are preallocated). */
    if (fstat(uring_file_fd(c.u, c.file), &sb) == 0 && (uint64_t)sb.st_size < c.o.size) {
        int fd = uring_file_fd(c.u, c.file);
        if (fallocate(fd, 0, 0, (off_t)c.o.size) < 0 &&
            (errno != EOPNOTSUPP || ftruncate(fd, (off_t)c.o.size) < 0)) {
            fprintf(stderr, "zinf bench: %s: cannot preallocate %llu bytes: %s\n", c.path,
                    (unsigned long long)c.o.size, strerror(errno));
            fails++;
            goto out;
        }
    }
    /* Two requests per queue slot (see bench_engine_run), and a slot is used only while its
     * offset is inside the file: never more than size + one block of buffers. */
    c.mem_bytes = (size_t)MIN((uint64_t)max_bs * max_qd * 2, c.o.size + max_bs);
    /* The buffers are what the engine's host arena is: huge pages, so that a request is one
     * or two segments for the device (hugemem.h); --no-huge-pages measures without. */
    int merr = 0;
    c.mem = hugemem_map(c.mem_bytes, !c.o.no_huge, &c.huge, &merr);
    if (!c.mem) {
        fprintf(stderr, "zinf bench: cannot allocate %zu bytes of buffers: %s\n", c.mem_bytes,
                strerror(-merr));
        fails++;
        goto out;
    }
    memset(c.mem, 0, c.mem_bytes);
    if (!c.o.no_fixed)
        c.region = uring_buf_register(c.u, c.mem, c.mem_bytes);
    uring_get_stats(c.u, &st);
    if (c.region < 0)
        st.fixed_buffers = false;
    bench_print_header(&c.o, c.path, &st, uring_file_direct(c.u, c.file), c.huge);

    if (!c.o.do_write && (r = ensure_file(&c)) < 0) {
        fprintf(stderr, "zinf bench: writing %s for the read test failed: %s\n", c.path,
                zinf_strerror(r));
        fails++;
        goto out;
    }

    if (!c.o.sweep) {
        fails += run_pair(&c, c.o.block_size, c.o.queue_depth, true, NULL, NULL);
    } else {
        double best = -1, best_rd = 0, best_wr = 0;
        size_t best_bs = 0;
        unsigned best_qd = 0;
        for (size_t i = 0; i < ARRAY_SIZE(sweep_bs); i++) {
            for (size_t j = 0; j < ARRAY_SIZE(sweep_qd); j++) {
                double rd = 0, wr = 0;
                int f = run_pair(&c, sweep_bs[i], sweep_qd[j], true, &rd, &wr);
                fails += f;
                /* Rank by the geometric mean of the passes that ran. */
                double score = c.o.do_read && c.o.do_write ? sqrt(rd * wr)
                               : c.o.do_read               ? rd
                                                           : wr;
                if (!f && score > best) {
                    best = score;
                    best_bs = sweep_bs[i];
                    best_qd = sweep_qd[j];
                    best_rd = rd;
                    best_wr = wr;
                }
            }
        }
        if (best > 0)
            bench_print_best(&c.o, best_bs, best_qd, best_rd, best_wr);
    }

    if (c.o.baseline) {
        struct row row;
        char *buf = c.mem;
        uint64_t nblocks;
        uint64_t *order =
            bench_block_order(c.o.size, c.o.block_size, c.o.random, c.o.seed, &nblocks);
        if (!order) {
            fprintf(stderr, "zinf bench: no memory for the order of the blocks\n");
            fails++;
            goto out;
        }
        if (c.o.do_write) {
            row = (struct row){.engine = "pread",
                               .op = "write",
                               .block_size = c.o.block_size,
                               .queue_depth = 1,
                               .huge = c.huge,
                               .submit_batch = 1};
            struct devsnap d0 = bench_dev_snap(c.path);
            r = bench_baseline_run(c.path, URING_WRITE, c.o.size, c.o.block_size, buf, order, &row);
            struct devsnap d1 = bench_dev_snap(c.path);
            bench_dev_account(&row, &d0, &d1, URING_WRITE);
            bench_print_row(&c.o, &row, r);
            fails += r != 0;
        }
        if (c.o.do_read) {
            drop_cache(uring_file_fd(c.u, c.file));
            row = (struct row){.engine = "pread",
                               .op = "read",
                               .block_size = c.o.block_size,
                               .queue_depth = 1,
                               .huge = c.huge,
                               .submit_batch = 1};
            struct devsnap d0 = bench_dev_snap(c.path);
            r = bench_baseline_run(c.path, URING_READ, c.o.size, c.o.block_size, buf, order, &row);
            struct devsnap d1 = bench_dev_snap(c.path);
            bench_dev_account(&row, &d0, &d1, URING_READ);
            bench_print_row(&c.o, &row, r);
            fails += r != 0 || !row.verified;
        }
        free(order);
    }
    if (!c.o.json)
        printf("# %s\n", fails ? "FAILED: see the rows marked error or FAIL" : "all rows verified");

out:
    if (c.region >= 0)
        uring_buf_unregister(c.u, c.region);
    uring_close(c.u);
    hugemem_unmap(c.mem, c.mem_bytes);
    if (created && !c.o.keep) /* a file that was there before is the user's */
        unlink(c.path);
    return fails ? 1 : 0;
}
