/*
 * optim_offload.c - the optimizer step with its state on NVMe against the same step in
 * memory, in one run: what DeepSpeed's offload_optimizer with pipeline_read/pipeline_write
 * does, through the engine.
 *
 * The state is `--elems` fp32 parameters cut into `--chunks` groups; each group has four
 * tensors (param, grad, m, v) with an NVMe home, under a host budget of `--host-bytes`
 * (default: a quarter of the state), so every step reads the whole state and writes back
 * param, m and v. A step walks the groups in order: fetch the four to the host tier, AdamW
 * (src/train/adamw.h, --threads OpenMP threads), release param, m and v dirty and the grad
 * clean, and zinf_step() at the end. The engine learns the order in step 1 and from then on
 * reads the next groups ahead while AdamW runs on this one, and writes the previous ones
 * back as they are evicted: the pipelining is the engine's schedule, not this program's.
 *
 * The in-memory run does the same AdamW calls on plain arrays. Steps alternate between the
 * two (in-memory, offloaded, ...) so drift on a shared machine hits both; after the last
 * step every offloaded param, m and v is compared with the in-memory one bit for bit.
 *
 * Reported: ms per step (median of steps 2..N) for each, their ratio, bytes the engine read
 * and wrote per step, the NVMe GB/s in the step, the time blocked on fetch, and, given the
 * drive's raw rates (--raw-read/--raw-write GB/s, from `zinf bench` on the same path; see
 * bench/optim_offload.sh), the IO bound of a step (its bytes at those rates) and the ratio
 * of the offloaded step to max(in-memory step, IO bound): 1.0 is a step that hides all of
 * its compute under its IO, or all of its IO under its compute.
 *
 * Not registered with meson's test suite; built with the benchmarks (build/bench/).
 *   build/bench/optim_offload --path DIR [--elems 64M] [--chunks 32] [--steps 5]
 *       [--host-bytes N] [--block-size 1M] [--queue-depth 32] [--submit-batch N]
 *       [--threads N] [--raw-read X --raw-write Y] [--json]
 */
#include <errno.h>
#include <getopt.h>
#include <omp.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_util.h"
#include "train/adamw.h"
#include "zinf.h"

#define MiB ((uint64_t)1 << 20)
#define MAX_STEPS 64

struct opts {
    const char *path;
    uint64_t elems, host_bytes, block_size;
    unsigned chunks, steps, queue_depth, submit_batch;
    int threads;
    double raw_read, raw_write;
    bool json;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: optim_offload --path DIR [--elems 64M] [--chunks 32] [--steps 5]\n"
               "       [--host-bytes N] [--block-size 1M] [--queue-depth 32] [--submit-batch N]\n"
               "       [--threads N] [--raw-read GBPS --raw-write GBPS] [--json]\n");
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, unsigned n)
{
    qsort(v, n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Deterministic start values: small params, grads of both signs, zero moments. */
static void init_group(float *p, float *g, size_t n, unsigned c)
{
    uint64_t s = 0x9e3779b97f4a7c15ull * (c + 1);
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        p[i] = (float)((int64_t)(s % 2001) - 1000) * 1e-4f;
        g[i] = (float)((int64_t)((s >> 20) % 2001) - 1000) * 1e-5f;
    }
}

#define CHECK(call)                                                                            \
    do {                                                                                       \
        int r_ = (call);                                                                       \
        if (r_ < 0) {                                                                          \
            fprintf(stderr, "optim_offload: %s: %s\n", #call, zinf_strerror(r_));              \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

int main(int argc, char **argv)
{
    enum { O_PATH = 256, O_ELEMS, O_CHUNKS, O_STEPS, O_HOST, O_BS, O_QD, O_BATCH, O_THREADS,
           O_RAWR, O_RAWW, O_JSON };
    static const struct option longopts[] = {
        {"path", required_argument, NULL, O_PATH},
        {"elems", required_argument, NULL, O_ELEMS},
        {"chunks", required_argument, NULL, O_CHUNKS},
        {"steps", required_argument, NULL, O_STEPS},
        {"host-bytes", required_argument, NULL, O_HOST},
        {"block-size", required_argument, NULL, O_BS},
        {"queue-depth", required_argument, NULL, O_QD},
        {"submit-batch", required_argument, NULL, O_BATCH},
        {"threads", required_argument, NULL, O_THREADS},
        {"raw-read", required_argument, NULL, O_RAWR},
        {"raw-write", required_argument, NULL, O_RAWW},
        {"json", no_argument, NULL, O_JSON},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    struct opts o = {.elems = 64 * MiB, .chunks = 32, .steps = 5, .block_size = MiB,
                     .queue_depth = 32, .threads = omp_get_max_threads()};
    uint64_t v;
    int ch;
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        bool bad = false;
        switch (ch) {
        case O_PATH: o.path = optarg; break;
        case O_ELEMS: bad = parse_size(optarg, &o.elems) < 0 || o.elems == 0; break;
        case O_HOST: bad = parse_size(optarg, &o.host_bytes) < 0; break;
        case O_BS: bad = parse_size(optarg, &o.block_size) < 0 || o.block_size % 4096; break;
        case O_CHUNKS:
        case O_STEPS:
        case O_QD:
        case O_BATCH:
        case O_THREADS:
            bad = parse_size(optarg, &v) < 0 || v > 100000 || (v == 0 && ch != O_BATCH);
            if (ch == O_CHUNKS) o.chunks = (unsigned)v;
            if (ch == O_STEPS) o.steps = (unsigned)v;
            if (ch == O_QD) o.queue_depth = (unsigned)v;
            if (ch == O_BATCH) o.submit_batch = (unsigned)v;
            if (ch == O_THREADS) o.threads = (int)v;
            break;
        case O_RAWR: o.raw_read = atof(optarg); break;
        case O_RAWW: o.raw_write = atof(optarg); break;
        case O_JSON: o.json = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (bad) {
            fprintf(stderr, "optim_offload: bad value '%s' for %s\n", optarg, argv[optind - 1]);
            return 2;
        }
    }
    if (!o.path || optind < argc || o.steps < 2 || o.steps > MAX_STEPS) {
        fprintf(stderr, "optim_offload: --path DIR is required, and 2 <= --steps <= %d\n",
                MAX_STEPS);
        return 2;
    }
    size_t n = (size_t)(o.elems / o.chunks) & ~(size_t)1023; /* elements per group: 4 KiB */
    size_t gb = n * sizeof(float);
    if (n == 0) {
        fprintf(stderr, "optim_offload: --elems / --chunks must be at least 1024\n");
        return 2;
    }
    uint64_t state = (uint64_t)o.chunks * 4 * gb;
    if (!o.host_bytes)
        o.host_bytes = state / 4;
    omp_set_num_threads(o.threads);

    /* The engine, from a config as a user would write it (a file in the swap directory). */
    char cfg[4096];
    snprintf(cfg, sizeof(cfg), "%s/optim_offload.json", o.path);
    FILE *f = fopen(cfg, "w");
    if (!f) {
        fprintf(stderr, "optim_offload: %s: %s\n", cfg, strerror(errno));
        return 1;
    }
    fprintf(f,
            "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s/swap\", \"pin_memory\": true}},\n \"aio\": {\"block_size\": %llu, "
            "\"queue_depth\": %u},\n \"zinf\": {\"device\": \"emulated\", \"device_bytes\": "
            "\"4M\", \"host_bytes\": %llu, \"submit_batch\": %u}}\n",
            o.path, (unsigned long long)o.block_size, o.queue_depth,
            (unsigned long long)o.host_bytes, o.submit_batch);
    fclose(f);
    zinf_engine *e;
    CHECK(zinf_open_config_flags(cfg, ZINF_OPEN_OVERWRITE, &e));

    float **mp = calloc(o.chunks, sizeof(float *)), **mg = calloc(o.chunks, sizeof(float *));
    float **mm = calloc(o.chunks, sizeof(float *)), **mv = calloc(o.chunks, sizeof(float *));
    zinf_tensor(*t)[4] = calloc(o.chunks, sizeof(*t));
    for (unsigned c = 0; c < o.chunks; c++) {
        mp[c] = aligned_alloc(4096, gb), mg[c] = aligned_alloc(4096, gb);
        mm[c] = aligned_alloc(4096, gb), mv[c] = aligned_alloc(4096, gb);
        if (!mp[c] || !mg[c] || !mm[c] || !mv[c]) {
            fprintf(stderr, "optim_offload: out of memory for the in-memory copy\n");
            return 1;
        }
        init_group(mp[c], mg[c], n, c);
        memset(mm[c], 0, gb);
        memset(mv[c], 0, gb);
        static const char *const role[4] = {"param", "grad", "m", "v"};
        for (int k = 0; k < 4; k++) {
            char name[64];
            snprintf(name, sizeof(name), "group%u.%s", c, role[k]);
            CHECK(zinf_register(e, name, gb, ZINF_TIER_NVME, &t[c][k]));
        }
        CHECK(zinf_write(e, t[c][0], 0, mp[c], gb));
        CHECK(zinf_write(e, t[c][1], 0, mg[c], gb));
        /* m and v start as zeros, as registered. */
    }
    CHECK(zinf_flush(e));

    struct adamw_hparams h;
    adamw_hparams_defaults(&h);
    h.weight_decay = 0.01f;
    double mem_ms[MAX_STEPS], off_ms[MAX_STEPS], blocked_ms[MAX_STEPS];
    uint64_t rd[MAX_STEPS], wr[MAX_STEPS];
    if (!o.json) {
        char sz[64];
        snprintf(sz, sizeof(sz), "%.1f MiB", (double)state / MiB);
        printf("# optim_offload %s: %llu params in %u groups of %zu (state %s: param, grad, m, "
               "v fp32), host tier %.1f MiB, device tier emulated\n",
               zinf_version(), (unsigned long long)n * o.chunks, o.chunks, n, sz,
               (double)o.host_bytes / MiB);
        printf("# aio block %llu, queue depth %llu, submit batch %u; AdamW %s, %d threads; "
               "steps alternate in-memory / offloaded\n",
               (unsigned long long)o.block_size, (unsigned long long)o.queue_depth,
               o.submit_batch, adamw_isa_name(adamw_best_isa()), o.threads);
        printf("# %4s %9s %9s %6s %12s %12s %8s %10s\n", "step", "mem_ms", "offl_ms", "ratio",
               "nvme_read", "nvme_write", "GB/s", "blocked_ms");
    }
    for (unsigned s = 0; s < o.steps; s++) {
        uint64_t t0 = now_ns();
        for (unsigned c = 0; c < o.chunks; c++)
            CHECK(adamw_update(mp[c], mg[c], mm[c], mv[c], n, &h, (int)s + 1, 1.0f));
        mem_ms[s] = (double)(now_ns() - t0) / 1e6;

        struct zinf_stats a, b;
        zinf_stats(e, &a);
        t0 = now_ns();
        for (unsigned c = 0; c < o.chunks; c++) {
            void *ptr[4];
            for (int k = 0; k < 4; k++)
                CHECK(zinf_fetch(e, t[c][k], ZINF_TIER_HOST, &ptr[k]));
            CHECK(adamw_update(ptr[0], ptr[1], ptr[2], ptr[3], n, &h, (int)s + 1, 1.0f));
            for (int k = 0; k < 4; k++)
                CHECK(zinf_release(e, t[c][k], ZINF_TIER_HOST,
                                   k == 1 ? ZINF_RELEASE_CLEAN : ZINF_RELEASE_DIRTY));
        }
        CHECK(zinf_step(e));
        off_ms[s] = (double)(now_ns() - t0) / 1e6;
        zinf_stats(e, &b);
        rd[s] = b.nvme_bytes_read - a.nvme_bytes_read;
        wr[s] = b.nvme_bytes_written - a.nvme_bytes_written;
        blocked_ms[s] = (double)(b.blocked_ns - a.blocked_ns) / 1e6;
        if (!o.json)
            printf("  %4u %9.1f %9.1f %6.3f %12llu %12llu %8.3f %10.1f\n", s + 1, mem_ms[s],
                   off_ms[s], off_ms[s] / mem_ms[s], (unsigned long long)rd[s],
                   (unsigned long long)wr[s], (double)(rd[s] + wr[s]) / off_ms[s] / 1e6,
                   blocked_ms[s]);
        fflush(stdout);
    }

    /* Bit for bit: every param, m and v the engine holds against the in-memory ones. */
    uint64_t bad = 0;
    float *buf = aligned_alloc(4096, gb);
    for (unsigned c = 0; c < o.chunks && buf; c++) {
        float *want[4] = {mp[c], mg[c], mm[c], mv[c]};
        for (int k = 0; k < 4; k++) {
            CHECK(zinf_read(e, t[c][k], 0, buf, gb));
            bad += memcmp(buf, want[k], gb) != 0;
        }
    }

    unsigned m = o.steps - 1; /* steps 2..N: step 1 is the one the engine learns */
    double rb = 0, wb = 0, bl = 0;
    for (unsigned s = 1; s < o.steps; s++)
        rb += (double)rd[s] / m, wb += (double)wr[s] / m, bl += blocked_ms[s] / m;
    double mem = median(mem_ms + 1, m), off = median(off_ms + 1, m);
    double io_ms = o.raw_read > 0 && o.raw_write > 0 ? rb / o.raw_read / 1e6 + wb / o.raw_write / 1e6
                                                   : 0;
    double bound = io_ms > mem ? io_ms : mem;
    if (o.json) {
        printf("{\"elems\": %llu, \"groups\": %u, \"state_bytes\": %llu, \"host_bytes\": %llu, "
               "\"threads\": %d, \"mem_step_ms\": %.3f, \"offloaded_step_ms\": %.3f, "
               "\"ratio\": %.4f, \"nvme_read_bytes_per_step\": %.0f, "
               "\"nvme_write_bytes_per_step\": %.0f, \"nvme_GBps\": %.4f, \"blocked_ms\": %.3f, "
               "\"io_bound_ms\": %.3f, \"ratio_to_bound\": %.4f, \"bitwise_equal\": %s}\n",
               (unsigned long long)n * o.chunks, o.chunks, (unsigned long long)state,
               (unsigned long long)o.host_bytes, o.threads, mem, off, off / mem, rb, wb,
               (rb + wb) / off / 1e6, bl, io_ms, io_ms > 0 ? off / bound : 0,
               bad ? "false" : "true");
    } else {
        printf("# steps 2..%u (medians): in memory %.1f ms, offloaded %.1f ms, ratio %.3f\n",
               o.steps, mem, off, off / mem);
        printf("# per step: %.1f MiB read, %.1f MiB written, %.3f GB/s; blocked on fetch "
               "%.1f ms (%.0f%% of the step)\n",
               rb / MiB, wb / MiB, (rb + wb) / off / 1e6, bl, 100 * bl / off);
        if (io_ms > 0)
            printf("# IO bound at the drive's raw rates (read %.3f, write %.3f GB/s): %.1f ms; "
                   "offloaded / max(in memory, IO bound) = %.3f\n",
                   o.raw_read, o.raw_write, io_ms, off / bound);
        printf("# %s\n", bad ? "FAILED: offloaded state differs from the in-memory state"
                             : "param, grad, m, v bitwise equal to the in-memory run");
    }
    zinf_close(e);
    for (unsigned c = 0; c < o.chunks; c++)
        free(mp[c]), free(mg[c]), free(mm[c]), free(mv[c]);
    free(mp), free(mg), free(mm), free(mv), free(t), free(buf);
    unlink(cfg);
    return bad ? 1 : 0;
}
