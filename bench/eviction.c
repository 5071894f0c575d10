/*
 * eviction.c - how much the engine reads from NVMe for a cyclic trace that does not fit,
 * with and without a learned schedule.
 *
 * Tensors totalling 1.5x the device budget (default: 24 x 16 MiB over 256 MiB) live on
 * NVMe and are fetched to the device tier in the same order, pass after pass. Each
 * configuration opens its own engine on the same swap directory, one after the other:
 *   lru     never calls zinf_step(): no schedule is learned, eviction takes the least
 *           recently used copy, which in a cyclic trace is always the next one needed,
 *           so every access misses and every pass reads everything;
 *   belady  zinf_step() after each pass: from pass 2 on the engine replays the learned
 *           order, evicts the copy whose next use is furthest away, and prefetches ahead;
 *   belady-np  the same, opened with zinf_open_config() and a prefetch budget of 2 bytes
 *           (stage3_prefetch_bucket_size 1), so no prefetch fits: eviction by next use
 *           alone, without loads started ahead taking room it would keep for reuse.
 * One row per pass: bytes read from NVMe, fetches, hits, evictions and prefetches (all
 * zinf_stats deltas), the pass time. The footer compares the bytes read per pass after
 * the first with each other and with the optimum (Belady's MIN replayed on the same trace
 * with the device tier's capacity in tensors), which is what eviction by next use can
 * reach at best.
 *
 * Only the public API (zinf.h) is used. Not a throughput test: the time column is there
 * to show where the passes went, the figure of merit is bytes read.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench_util.h"
#include "zinf.h"

#define MiB ((uint64_t)1 << 20)
#define MAX_PASSES 10000

#define ZINF_CHECK(call)                                                                           \
    do {                                                                                           \
        int r_ = (call);                                                                           \
        if (r_ < 0) {                                                                              \
            fprintf(stderr, "eviction: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,                \
                    zinf_strerror(r_));                                                            \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

enum config { CFG_LRU, CFG_BELADY, CFG_BELADY_NP, NCFG };
static const char *const cfg_names[NCFG] = {"lru", "belady", "belady-np"};

struct opts {
    struct bench_opts com; /* the options the bench programs share */
    unsigned passes;
    bool run[NCFG];
};

struct pass_row {
    enum config cfg;
    unsigned pass;
    double seconds;
    uint64_t nvme_read_bytes, fetches, hits, late, evictions, prefetches, wasted, blocked_ns;
    uint64_t bad_pages;
};

/* Check one page of a pinned device copy: in place when the device tier is emulated (host
 * memory), through zinf_read() on CUDA (the pinned device copy is the only one in memory). */
static uint64_t check_page(zinf_engine *e, zinf_tensor t, uint64_t tid, const void *ptr,
                           bool direct, uint64_t page, void *scratch)
{
    size_t off = page * PAGE_BYTES;
    if (direct) return pattern_bad_pages((const char *)ptr + off, PAGE_BYTES, tid, off);
    int r = zinf_read(e, t, off, scratch, PAGE_BYTES);
    return r < 0 ? 1 : pattern_bad_pages(scratch, PAGE_BYTES, tid, off);
}

/* ---- the optimum ----------------------------------------------------------------------- */

/* Mean misses per pass, over passes 2..passes, of the best eviction by next use on the
 * cyclic trace 0..n-1 repeated with room for cap tensors, starting where the engine
 * starts: pass 1 has no schedule, so it evicts least recently used; from pass 2 on,
 * Belady's MIN (evict the resident tensor whose next use is furthest; in a cyclic trace
 * that of tensor j after position i is (j - i) mod n ahead). MIN's misses vary from pass
 * to pass, hence the mean. */
static double opt_misses_per_pass(unsigned n, unsigned cap, unsigned passes)
{
    uint64_t *last = calloc(n, sizeof(uint64_t)); /* 0: not resident, else last use + 1 */
    uint64_t clock = 0, misses = 0;
    unsigned nres = 0;
    for (unsigned p = 0; p < passes; p++) {
        for (unsigned i = 0; i < n; i++, clock++) {
            if (last[i]) {
                last[i] = clock + 1;
                continue;
            }
            misses += p > 0;
            if (nres == cap && cap) {
                unsigned victim = 0;
                uint64_t best = 0;
                for (unsigned j = 0; j < n; j++) {
                    if (!last[j]) continue;
                    /* pass 1: least recently used; later: furthest next use */
                    uint64_t score = p == 0 ? UINT64_MAX - last[j] : (j + n - i) % n;
                    if (score >= best) {
                        best = score;
                        victim = j;
                    }
                }
                last[victim] = 0;
                nres--;
            }
            if (cap) {
                last[i] = clock + 1;
                nres++;
            }
        }
    }
    free(last);
    return passes > 1 ? (double)misses / (passes - 1) : 0;
}

/* ---- one configuration ------------------------------------------------------------------ */

/* A DeepSpeed-style config that says what the options do, plus a prefetch budget of
 * 2 bytes; staging sized to queue_depth blocks, as zinf_open() sizes it. */
static int write_np_config(const struct opts *o, char *path, size_t len)
{
    snprintf(path, len, "%s/eviction-bench-np.json", o->com.path);
    FILE *f = fopen(path, "w");
    if (!f) return -errno;
    fprintf(f, "{\"zero_optimization\": {\"stage\": 3, \"stage3_prefetch_bucket_size\": 1,\n"
               "  \"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"");
    for (const char *c = o->com.path; *c; c++)
        fprintf(f, *c == '"' || *c == '\\' ? "\\%c" : "%c", *c);
    fprintf(f, "\", \"pin_memory\": true,\n    \"buffer_count\": 1, \"buffer_size\": %llu}},\n",
            (unsigned long long)(o->com.block_size * o->com.queue_depth / 2));
    fprintf(f, " \"aio\": {\"block_size\": %llu, \"queue_depth\": %u},\n",
            (unsigned long long)o->com.block_size, o->com.queue_depth);
    fprintf(f, " \"zinf\": {\"device_bytes\": %llu, \"host_bytes\": %llu, \"device\": \"%s\"}}\n",
            (unsigned long long)o->com.device_bytes, (unsigned long long)o->com.host_bytes,
            o->com.kind == ZINF_DEVICE_EMULATED ? "emulated"
            : o->com.kind == ZINF_DEVICE_CUDA   ? "cuda"
                                                : "auto");
    return fclose(f) == 0 ? 0 : -errno;
}

static void print_row(const struct opts *o, const struct pass_row *r)
{
    if (o->com.json) {
        printf("{\"bench\": \"eviction\", \"config\": \"%s\", \"pass\": %u, \"seconds\": %.6f, "
               "\"nvme_bytes_read\": %llu, \"tensors_read\": %.2f, \"fetches\": %llu, \"hits\": "
               "%llu, \"prefetch_late\": %llu, \"evictions\": %llu, \"prefetches\": %llu, "
               "\"prefetch_wasted\": %llu, \"blocked_ns\": %llu, \"verify\": \"sample\", "
               "\"bad_pages\": %llu, \"verified\": %s}\n",
               cfg_names[r->cfg], r->pass, r->seconds, (unsigned long long)r->nvme_read_bytes,
               (double)r->nvme_read_bytes / (double)o->com.tensor_bytes,
               (unsigned long long)r->fetches, (unsigned long long)r->hits,
               (unsigned long long)r->late, (unsigned long long)r->evictions,
               (unsigned long long)r->prefetches, (unsigned long long)r->wasted,
               (unsigned long long)r->blocked_ns, (unsigned long long)r->bad_pages,
               r->bad_pages ? "false" : "true");
    } else {
        printf("  %9s %4u %12llu %7.2f %7llu %6llu %5llu %9llu %8llu %6llu %8.3f %9.1f %8s\n",
               cfg_names[r->cfg], r->pass, (unsigned long long)r->nvme_read_bytes,
               (double)r->nvme_read_bytes / (double)o->com.tensor_bytes,
               (unsigned long long)r->fetches, (unsigned long long)r->hits,
               (unsigned long long)r->late, (unsigned long long)r->evictions,
               (unsigned long long)r->prefetches, (unsigned long long)r->wasted, r->seconds,
               (double)r->blocked_ns / 1e6, r->bad_pages ? "FAIL" : "ok");
    }
    fflush(stdout);
}

static void print_header(const struct opts *o, const struct zinf_stats *st)
{
    uint64_t total = (uint64_t)o->com.tensors * o->com.tensor_bytes;
    printf("# zinf eviction %s: %u tensors x %llu B = %llu B, home NVMe (%s), %.2fx the "
           "device tier\n",
           zinf_version(), o->com.tensors, (unsigned long long)o->com.tensor_bytes,
           (unsigned long long)total, o->com.path, (double)total / (double)o->com.device_bytes);
    printf("# device tier %llu B (%s), host tier %llu B, block %llu B, queue depth %u, %u passes "
           "per configuration, one engine each\n",
           (unsigned long long)st->tier[ZINF_TIER_DEVICE].capacity_bytes,
           st->device_is_cuda ? "CUDA" : "emulated in host memory",
           (unsigned long long)st->tier[ZINF_TIER_HOST].capacity_bytes,
           (unsigned long long)o->com.block_size, o->com.queue_depth, o->passes);
    printf("# lru: no zinf_step; belady: zinf_step after each pass (pass 1 is learned); "
           "belady-np: the same with a 2-byte prefetch budget (no prefetch)\n");
    printf("# a pass fetches every tensor to the device tier in order 0..%u, checks 3 pages of "
           "4 KiB (first, last, one that moves), releases it clean\n",
           o->com.tensors - 1);
    printf("# nvme_read: zinf_stats.nvme_bytes_read delta (prefetches included), tensors: the "
           "same in tensors; late: fetches that joined a prefetch still arriving\n");
    printf("# evictions: device tier; prefetch / wasted: prefetches started / dropped before "
           "any fetch used them\n");
    printf("#\n");
    printf("# %9s %4s %12s %7s %7s %6s %5s %9s %8s %6s %8s %9s %8s\n", "config", "pass",
           "nvme_read", "tensors", "fetches", "hits", "late", "evictions", "prefetch", "wasted",
           "time", "blocked", "verified");
    printf("# %9s %4s %12s %7s %7s %6s %5s %9s %8s %6s %8s %9s %8s\n", "", "", "(B)", "", "", "",
           "", "", "", "", "(s)", "(ms)", "");
}

/* Open an engine for cfg, register and fill the tensors (untimed), run the passes. */
static int run_config(const struct opts *o, enum config cfg, struct pass_row *rows,
                      bool *header_done)
{
    zinf_engine *e = NULL;
    struct zinf_stats s0, s1, opened;
    char cfg_path[4096];
    int fails = 0;

    if (cfg == CFG_BELADY_NP) {
        ZINF_CHECK(write_np_config(o, cfg_path, sizeof(cfg_path)));
        int r = zinf_open_config(cfg_path, &e);
        unlink(cfg_path);
        ZINF_CHECK(r);
    } else {
        struct zinf_options zo = {.nvme_path = o->com.path,
                                  .device_bytes = o->com.device_bytes,
                                  .host_bytes = o->com.host_bytes,
                                  .block_size = o->com.block_size,
                                  .queue_depth = o->com.queue_depth,
                                  .device_kind = o->com.kind};
        ZINF_CHECK(zinf_open(&zo, &e));
    }
    ZINF_CHECK(zinf_stats(e, &opened));
    bool direct = !opened.device_is_cuda;

    zinf_tensor *t = calloc(o->com.tensors, sizeof(*t));
    void *buf = aligned_alloc(PAGE_BYTES, o->com.tensor_bytes);
    if (!t || !buf) {
        fprintf(stderr, "eviction: out of memory\n");
        exit(1);
    }
    for (unsigned i = 0; i < o->com.tensors; i++) {
        char name[64];
        snprintf(name, sizeof(name), "eviction.%u", i);
        ZINF_CHECK(zinf_register(e, name, o->com.tensor_bytes, ZINF_TIER_NVME, &t[i]));
        pattern_fill(buf, o->com.tensor_bytes, i, 0);
        ZINF_CHECK(zinf_write(e, t[i], 0, buf, o->com.tensor_bytes));
    }

    if (!*header_done) {
        print_header(o, &opened);
        *header_done = true;
    }
    uint64_t npages = o->com.tensor_bytes / PAGE_BYTES;
    ZINF_CHECK(zinf_stats(e, &s0));
    for (unsigned p = 0; p < o->passes; p++) {
        struct pass_row *row = &rows[p];
        *row = (struct pass_row){.cfg = cfg, .pass = p + 1};
        uint64_t t0 = now_ns();
        for (unsigned i = 0; i < o->com.tensors; i++) {
            void *ptr;
            ZINF_CHECK(zinf_fetch(e, t[i], ZINF_TIER_DEVICE, &ptr));
            uint64_t pick[3] = {0, npages - 1, page_key(p, i) % npages};
            for (int k = 0; k < 3; k++)
                row->bad_pages += check_page(e, t[i], i, ptr, direct, pick[k], buf);
            ZINF_CHECK(zinf_release(e, t[i], ZINF_TIER_DEVICE, ZINF_RELEASE_CLEAN));
        }
        if (cfg != CFG_LRU) ZINF_CHECK(zinf_step(e));
        row->seconds = (double)(now_ns() - t0) / 1e9;
        ZINF_CHECK(zinf_stats(e, &s1));
        row->nvme_read_bytes = s1.nvme_bytes_read - s0.nvme_bytes_read;
        row->fetches = s1.tier[ZINF_TIER_DEVICE].fetches - s0.tier[ZINF_TIER_DEVICE].fetches;
        row->hits = s1.tier[ZINF_TIER_DEVICE].hits - s0.tier[ZINF_TIER_DEVICE].hits;
        row->late = s1.prefetch_late - s0.prefetch_late;
        row->evictions = s1.tier[ZINF_TIER_DEVICE].evictions - s0.tier[ZINF_TIER_DEVICE].evictions;
        row->prefetches = s1.prefetches - s0.prefetches;
        row->wasted = s1.prefetch_wasted - s0.prefetch_wasted;
        row->blocked_ns = s1.blocked_ns - s0.blocked_ns;
        s0 = s1;
        fails += row->bad_pages != 0;
        print_row(o, row);
    }
    for (unsigned i = 0; i < o->com.tensors; i++)
        ZINF_CHECK(zinf_unregister(e, t[i]));
    zinf_close(e);
    free(buf);
    free(t);
    return fails;
}

/* ---- arguments --------------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f, "usage: eviction [options]\n"
               "  --path DIR            NVMe swap directory (default ./swap; created if missing)\n"
               "  --device-kind K       emulated | auto (default auto: CUDA if usable)\n"
               "  --device-bytes N      device tier budget (default 256M)\n"
               "  --host-bytes N        host tier budget (default 64M; not on this path)\n"
               "  --tensors N           tensors (default 24)\n"
               "  --tensor-size N       bytes per tensor, a multiple of 4K (default 16M)\n"
               "  --passes N            passes over the trace per configuration (default 6)\n"
               "  --block-size N        bytes per IO request (default 1M)\n"
               "  --queue-depth N       IO requests in flight (default 32)\n"
               "  --configs LIST        of lru,belady,belady-np (default all three)\n"
               "  --json                one JSON object per row\n");
}

static int parse_args(int argc, char **argv, struct opts *o)
{
    enum { O_PASSES = BENCH_O_OWN, O_CFG };
    static const struct option longopts[] = {
        {"path", required_argument, NULL, BENCH_O_PATH},
        {"device-kind", required_argument, NULL, BENCH_O_KIND},
        {"device-bytes", required_argument, NULL, BENCH_O_DEV},
        {"host-bytes", required_argument, NULL, BENCH_O_HOST},
        {"tensors", required_argument, NULL, BENCH_O_NT},
        {"tensor-size", required_argument, NULL, BENCH_O_TS},
        {"passes", required_argument, NULL, O_PASSES},
        {"block-size", required_argument, NULL, BENCH_O_BS},
        {"queue-depth", required_argument, NULL, BENCH_O_QD},
        {"configs", required_argument, NULL, O_CFG},
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
                               .tensor_bytes = 16 * MiB,
                               .block_size = MiB,
                               .tensors = 24,
                               .queue_depth = 32},
                       .passes = 6,
                       .run = {true, true, true}};
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        bool bad = false;
        switch (ch) {
        case O_CFG: {
            char list[256];
            snprintf(list, sizeof(list), "%s", optarg);
            memset(o->run, 0, sizeof(o->run));
            for (char *save, *w = strtok_r(list, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
                int c = 0;
                while (c < NCFG && strcmp(w, cfg_names[c]))
                    c++;
                if (c == NCFG)
                    bad = true;
                else
                    o->run[c] = true;
            }
            break;
        }
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
            case O_PASSES:
                bad = v > MAX_PASSES;
                o->passes = (unsigned)v;
                break;
            }
        }
        if (bad) return bench_bad_value("eviction", longopts, ch, optarg);
    }
    return bench_no_operands("eviction", argc, argv);
}

int main(int argc, char **argv)
{
    struct opts o;
    int r = parse_args(argc, argv, &o);
    if (r) return r > 0 ? 0 : 2;
    if (mkdir(o.com.path, 0755) < 0 && errno != EEXIST) {
        fprintf(stderr, "eviction: --path %s: %s\n", o.com.path, strerror(errno));
        return 2;
    }
    struct pass_row *rows = calloc((size_t)NCFG * o.passes, sizeof(*rows));
    double later[NCFG] = {0}; /* mean bytes read per pass after the first */
    bool header = o.com.json;
    int fails = 0;

    for (int c = 0; c < NCFG; c++) {
        if (!o.run[c]) continue;
        fails += run_config(&o, (enum config)c, &rows[(size_t)c * o.passes], &header);
        for (unsigned p = 1; p < o.passes; p++)
            later[c] += (double)rows[(size_t)c * o.passes + p].nvme_read_bytes / (o.passes - 1);
    }

    unsigned cap = (unsigned)(o.com.device_bytes / o.com.tensor_bytes);
    double opt = opt_misses_per_pass(o.com.tensors, cap, o.passes) * (double)o.com.tensor_bytes;
    double every = (double)o.com.tensors * o.com.tensor_bytes; /* a pass that misses every access */
    double lru = later[CFG_LRU], bel = later[CFG_BELADY], np = later[CFG_BELADY_NP];
    /* Without an lru run, compare with what lru reads by construction on this trace. */
    double lru_ref = o.run[CFG_LRU] ? lru : every;
    bool lru_all = lru >= every;
    if (o.com.json) {
        printf("{\"bench\": \"eviction\", \"summary\": true, \"lru_bytes_per_pass\": %.0f, "
               "\"belady_bytes_per_pass\": %.0f, \"belady_np_bytes_per_pass\": %.0f, "
               "\"optimum_bytes_per_pass\": %.0f, \"belady_over_lru\": %.4f, "
               "\"belady_np_over_lru\": %.4f, \"belady_over_optimum\": %.4f, "
               "\"belady_np_over_optimum\": %.4f, \"verified\": %s}\n",
               lru, bel, np, opt, bel / lru_ref, np / lru_ref, opt > 0 ? bel / opt : 0,
               opt > 0 ? np / opt : 0, fails ? "false" : "true");
    } else if (o.passes > 1) {
        printf("# bytes read from NVMe per pass, passes 2..%u (mean):\n", o.passes);
        if (o.run[CFG_LRU])
            printf("#   lru        %12.0f B (%5.2f tensors; every access a miss: %s)\n", lru,
                   lru / o.com.tensor_bytes, lru_all ? "yes, as expected" : "no");
        printf("#   optimum    %12.0f B (%5.2f tensors: Belady's MIN on this trace after an LRU "
               "pass 1, %u of %u tensors fit)\n",
               opt, opt / o.com.tensor_bytes, cap, o.com.tensors);
        for (int c = CFG_BELADY; c < NCFG; c++) {
            double v = later[c];
            if (!o.run[c]) continue;
            printf("#   %-10s %12.0f B (%5.2f tensors; %.3f of %s, %.3f of the optimum)\n",
                   cfg_names[c], v, v / o.com.tensor_bytes, v / lru_ref,
                   o.run[CFG_LRU] ? "lru" : "reading all", opt > 0 ? v / opt : 0);
        }
        for (int c = CFG_BELADY; c < NCFG; c++) {
            if (!o.run[c]) continue;
            /* The target: eviction by next use must not miss every access as lru does.
             * Beside it, how close it comes to the optimum (within a tensor per pass). */
            printf("# target %s reads less than lru per pass: %s (ratio %.3f); within one "
                   "tensor of the optimum: %s (%.3fx)\n",
                   cfg_names[c], later[c] < lru_ref ? "met" : "NOT met", later[c] / lru_ref,
                   later[c] <= opt + (double)o.com.tensor_bytes ? "yes" : "no",
                   opt > 0 ? later[c] / opt : 0);
        }
    }
    if (!o.com.json)
        printf("# %s\n", fails ? "FAILED: see the rows marked FAIL" : "all rows verified");
    free(rows);
    return fails ? 1 : 0;
}
