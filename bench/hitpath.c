/*
 * hitpath.c - what zinf_fetch() + zinf_release() cost when the tensor is already resident:
 * the overhead the engine adds to every use of a tensor that needs no IO.
 *
 * Four rows: the device tier and the host tier, each (a) with no schedule (one tensor,
 * never a zinf_step) and (b) with a learned schedule active (K tensors fetched cyclically,
 * zinf_step() after each round, so every fetch also advances the schedule and asks the
 * prefetcher what comes next). Each row runs ITERS fetch+release pairs in batches of
 * BATCH; batches alternate between two ways of timing:
 *   - whole batches: one clock read before and after BATCH pairs; the batch time / BATCH
 *     is a per-call figure with no clock overhead in it (the zinf_step() calls of the
 *     scheduled rows fall inside these batches, one per K pairs);
 *   - per call: a clock read around each pair, for the histogram and the tail; these
 *     carry the cost of one clock read (printed in the header), zinf_step() is left out.
 * Every fetch must hit (the row says what fraction did, from zinf_stats) and return the
 * pointer of the first fetch; the tensor's bytes are checked in full before and after.
 *
 * Only the public API (zinf.h) is used. Not a contention test: one thread.
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

#include "bench_util.h"
#include "zinf.h"

#define MiB ((uint64_t)1 << 20)
#define HIST_BUCKETS 40 /* log2 buckets of ns */

#define ZINF_CHECK(call)                                                                           \
    do {                                                                                           \
        int r_ = (call);                                                                           \
        if (r_ < 0) {                                                                              \
            fprintf(stderr, "hitpath: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,                 \
                    zinf_strerror(r_));                                                            \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

struct opts {
    struct bench_opts com; /* the options the bench programs share */
    uint64_t iters;
    unsigned batch, k;
};

struct row {
    const char *tier_name, *mode;
    uint64_t iters;
    double batch_p50, batch_p90, batch_p99;        /* ns per pair, from whole batches */
    double call_p50, call_p90, call_p99, call_max; /* ns per pair, from per-call samples */
    uint64_t fetches, hits, moved_ptrs, bad_pages;
    uint64_t sched_len, sched_resets;
    uint64_t hist[HIST_BUCKETS];
};

/* Check every byte of a pinned copy. Host memory and the emulated device tier are read
 * in place; CUDA device memory through zinf_read(), which reads the newest copy in memory
 * (the host copy first when there is one: each tensor here has a copy in one tier only). */
static uint64_t check_all(zinf_engine *e, zinf_tensor t, uint64_t tid, const void *ptr, bool direct,
                          size_t len, void *scratch)
{
    if (direct) return pattern_bad_pages(ptr, len, tid, 0);
    int r = zinf_read(e, t, 0, scratch, len);
    return r < 0 ? len / PAGE_BYTES : pattern_bad_pages(scratch, len, tid, 0);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double percentile(uint64_t *v, size_t n, double q) /* v sorted */
{
    if (n == 0) return 0;
    size_t i = (size_t)ceil(q * (double)n) - 1;
    return (double)v[i < n ? i : n - 1];
}

/* ---- one row ------------------------------------------------------------------------- */

/* Fetch+release the tensors t[0..n) cyclically, with zinf_step() after each round when
 * sched is set. The tensors are resident and their pointers are in ptr[]. */
static void run_row(const struct opts *o, zinf_engine *e, enum zinf_tier tier, const zinf_tensor *t,
                    void *const *ptr, unsigned n, bool sched, struct row *row)
{
    uint64_t nbatches = (o->iters + o->batch - 1) / o->batch;
    uint64_t *batch_ns = calloc(nbatches, sizeof(uint64_t));
    uint64_t *call_ns = calloc(nbatches / 2 * o->batch + o->batch, sizeof(uint64_t));
    uint64_t nb = 0, nc = 0, done = 0;
    unsigned j = 0;
    struct zinf_stats s0, s1;

    if (!batch_ns || !call_ns) {
        fprintf(stderr, "hitpath: out of memory\n");
        exit(1);
    }
    ZINF_CHECK(zinf_stats(e, &s0));
    for (uint64_t b = 0; b < nbatches; b++) {
        unsigned len = (unsigned)(o->iters - done < o->batch ? o->iters - done : o->batch);
        void *p;
        if (b % 2 == 0) {
            uint64_t t0 = now_ns();
            for (unsigned i = 0; i < len; i++) {
                ZINF_CHECK(zinf_fetch(e, t[j], tier, &p));
                row->moved_ptrs += p != ptr[j];
                ZINF_CHECK(zinf_release(e, t[j], tier, ZINF_RELEASE_CLEAN));
                if (++j == n) {
                    j = 0;
                    if (sched) ZINF_CHECK(zinf_step(e));
                }
            }
            batch_ns[nb++] = (now_ns() - t0 + len / 2) / len;
        } else {
            for (unsigned i = 0; i < len; i++) {
                uint64_t t0 = now_ns();
                ZINF_CHECK(zinf_fetch(e, t[j], tier, &p));
                ZINF_CHECK(zinf_release(e, t[j], tier, ZINF_RELEASE_CLEAN));
                uint64_t d = now_ns() - t0;
                row->moved_ptrs += p != ptr[j];
                call_ns[nc++] = d;
                unsigned bk = 0;
                while (bk + 1 < HIST_BUCKETS && (d >> (bk + 1)))
                    bk++;
                row->hist[bk]++;
                if (++j == n) {
                    j = 0;
                    if (sched) ZINF_CHECK(zinf_step(e));
                }
            }
        }
        done += len;
    }
    ZINF_CHECK(zinf_stats(e, &s1));
    qsort(batch_ns, nb, sizeof(uint64_t), cmp_u64);
    qsort(call_ns, nc, sizeof(uint64_t), cmp_u64);
    row->iters = done;
    row->batch_p50 = percentile(batch_ns, nb, 0.50);
    row->batch_p90 = percentile(batch_ns, nb, 0.90);
    row->batch_p99 = percentile(batch_ns, nb, 0.99);
    row->call_p50 = percentile(call_ns, nc, 0.50);
    row->call_p90 = percentile(call_ns, nc, 0.90);
    row->call_p99 = percentile(call_ns, nc, 0.99);
    row->call_max = nc ? (double)call_ns[nc - 1] : 0;
    row->fetches = s1.tier[tier].fetches - s0.tier[tier].fetches;
    row->hits = s1.tier[tier].hits - s0.tier[tier].hits;
    row->sched_len = s1.schedule_length;
    row->sched_resets = s1.schedule_resets - s0.schedule_resets;
    free(batch_ns);
    free(call_ns);
}

/* ---- output ---------------------------------------------------------------------------- */

static bool row_ok(const struct row *r)
{
    return r->bad_pages == 0 && r->moved_ptrs == 0 && r->hits == r->fetches;
}

static void print_header(const struct opts *o, const struct zinf_stats *st, double clock_ns)
{
    if (o->com.json) return;
    printf("# zinf hit path %s: fetch + release of a resident tensor, %llu pairs per row in "
           "batches of %u, one thread\n",
           zinf_version(), (unsigned long long)o->iters, o->batch);
    printf("# device tier %llu B (%s), host tier %llu B, tensors of %llu B with an NVMe home "
           "(%s), loaded once before timing\n",
           (unsigned long long)st->tier[ZINF_TIER_DEVICE].capacity_bytes,
           st->device_is_cuda ? "CUDA" : "emulated in host memory",
           (unsigned long long)st->tier[ZINF_TIER_HOST].capacity_bytes,
           (unsigned long long)o->com.tensor_bytes, o->com.path);
    printf("# plain: one tensor, no zinf_step (no schedule); sched: %u tensors cyclically, "
           "zinf_step after each round, the learned schedule active\n",
           o->k);
    printf("# batch_*: percentiles over batches of (batch time / pairs), every other batch "
           "(sched: its zinf_step calls included)\n");
    printf("# call_*: percentiles over single pairs timed one by one, the other batches; each "
           "carries one clock read, about %.0f ns here\n",
           clock_ns);
    printf("# hit%%: tier hits / tier fetches from zinf_stats; verified: every byte checked "
           "before and after, and every fetch returned the same pointer\n");
    printf("#\n");
    printf("# %6s %6s %8s %9s %9s %9s %8s %8s %8s %9s %6s %8s\n", "tier", "mode", "pairs",
           "batch_p50", "batch_p90", "batch_p99", "call_p50", "call_p90", "call_p99", "call_max",
           "hit%", "verified");
    printf("# %6s %6s %8s %9s %9s %9s %8s %8s %8s %9s %6s %8s\n", "", "", "", "(ns)", "(ns)",
           "(ns)", "(ns)", "(ns)", "(ns)", "(ns)", "", "");
}

static void print_row(const struct opts *o, const struct row *r)
{
    double hit = r->fetches ? 100.0 * (double)r->hits / (double)r->fetches : 0;
    if (o->com.json) {
        printf("{\"bench\": \"hitpath\", \"tier\": \"%s\", \"mode\": \"%s\", \"pairs\": %llu, "
               "\"batch\": %u, \"batch_p50_ns\": %.1f, \"batch_p90_ns\": %.1f, "
               "\"batch_p99_ns\": %.1f, \"call_p50_ns\": %.1f, \"call_p90_ns\": %.1f, "
               "\"call_p99_ns\": %.1f, \"call_max_ns\": %.1f, \"fetches\": %llu, \"hits\": "
               "%llu, \"schedule_length\": %llu, \"schedule_resets\": %llu, \"moved_pointers\": "
               "%llu, \"bad_pages\": %llu, \"histogram_log2_ns\": [",
               r->tier_name, r->mode, (unsigned long long)r->iters, o->batch, r->batch_p50,
               r->batch_p90, r->batch_p99, r->call_p50, r->call_p90, r->call_p99, r->call_max,
               (unsigned long long)r->fetches, (unsigned long long)r->hits,
               (unsigned long long)r->sched_len, (unsigned long long)r->sched_resets,
               (unsigned long long)r->moved_ptrs, (unsigned long long)r->bad_pages);
        for (int b = 0; b < HIST_BUCKETS; b++)
            printf("%s%llu", b ? ", " : "", (unsigned long long)r->hist[b]);
        printf("], \"verified\": %s}\n", row_ok(r) ? "true" : "false");
    } else {
        printf("  %6s %6s %8llu %9.0f %9.0f %9.0f %8.0f %8.0f %8.0f %9.0f %6.1f %8s\n",
               r->tier_name, r->mode, (unsigned long long)r->iters, r->batch_p50, r->batch_p90,
               r->batch_p99, r->call_p50, r->call_p90, r->call_p99, r->call_max, hit,
               row_ok(r) ? "ok" : "FAIL");
    }
    fflush(stdout);
}

static void print_hist(const struct row *r)
{
    printf("# histogram %s/%s (single pairs, ns range: count):", r->tier_name, r->mode);
    for (int b = 0; b < HIST_BUCKETS; b++)
        if (r->hist[b])
            printf(" %llu-%llu: %llu", b ? 1ull << b : 0ull, (2ull << b) - 1,
                   (unsigned long long)r->hist[b]);
    printf("\n");
}

/* ---- arguments --------------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f, "usage: hitpath [options]\n"
               "  --path DIR            NVMe swap directory (default ./swap; created if missing)\n"
               "  --device-kind K       emulated | auto (default auto: CUDA if usable)\n"
               "  --device-bytes N      device tier budget (default 64M)\n"
               "  --host-bytes N        host tier budget (default 64M)\n"
               "  --tensor-size N       bytes per tensor, a multiple of 4K (default 1M)\n"
               "  --iters N             fetch+release pairs per row (default 1e6)\n"
               "  --batch N             pairs per batch (default 1000)\n"
               "  --k N                 tensors in the scheduled rows (default 8)\n"
               "  --json                one JSON object per row\n");
}

static int parse_args(int argc, char **argv, struct opts *o)
{
    enum { O_ITERS = BENCH_O_OWN, O_BATCH, O_K };
    static const struct option longopts[] = {
        {"path", required_argument, NULL, BENCH_O_PATH},
        {"device-kind", required_argument, NULL, BENCH_O_KIND},
        {"device-bytes", required_argument, NULL, BENCH_O_DEV},
        {"host-bytes", required_argument, NULL, BENCH_O_HOST},
        {"tensor-size", required_argument, NULL, BENCH_O_TS},
        {"iters", required_argument, NULL, O_ITERS},
        {"batch", required_argument, NULL, O_BATCH},
        {"k", required_argument, NULL, O_K},
        {"json", no_argument, NULL, BENCH_O_JSON},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    uint64_t v;
    int ch;

    *o = (struct opts){.com = {.path = "./swap",
                               .kind = ZINF_DEVICE_AUTO,
                               .device_bytes = 64 * MiB,
                               .host_bytes = 64 * MiB,
                               .tensor_bytes = MiB},
                       .iters = 1000000,
                       .batch = 1000,
                       .k = 8};
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        bool bad = false;
        switch (ch) {
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
            case O_ITERS:
                o->iters = v;
                break;
            case O_BATCH:
                bad = v > 10000000;
                o->batch = (unsigned)v;
                break;
            case O_K:
                bad = v > 65536;
                o->k = (unsigned)v;
                break;
            }
        }
        if (bad) return bench_bad_value("hitpath", longopts, ch, optarg);
    }
    return bench_no_operands("hitpath", argc, argv);
}

/* Median cost of one clock read, as the per-call samples see it. */
static double clock_cost_ns(void)
{
    enum { N = 100001 };
    static uint64_t d[N];
    for (int i = 0; i < N; i++) {
        uint64_t a = now_ns();
        d[i] = now_ns() - a;
    }
    qsort(d, N, sizeof(uint64_t), cmp_u64);
    return (double)d[N / 2];
}

int main(int argc, char **argv)
{
    static const enum zinf_tier tiers[] = {ZINF_TIER_DEVICE, ZINF_TIER_HOST};
    static const char *const tier_names[] = {"device", "host"};
    struct opts o;
    zinf_engine *e = NULL;
    struct zinf_stats st;
    int r = parse_args(argc, argv, &o);
    if (r) return r > 0 ? 0 : 2;
    if (mkdir(o.com.path, 0755) < 0 && errno != EEXIST) {
        fprintf(stderr, "hitpath: --path %s: %s\n", o.com.path, strerror(errno));
        return 2;
    }
    if ((1 + o.k) * o.com.tensor_bytes > o.com.device_bytes ||
        (1 + o.k) * o.com.tensor_bytes > o.com.host_bytes) {
        fprintf(stderr, "hitpath: %u tensors of %llu B must fit in each tier at once\n", 1 + o.k,
                (unsigned long long)o.com.tensor_bytes);
        return 2;
    }
    unsigned ntensors = 2 * (1 + o.k); /* per tier: one plain, k scheduled */
    struct zinf_options zo = {.nvme_path = o.com.path,
                              .device_bytes = o.com.device_bytes,
                              .host_bytes = o.com.host_bytes,
                              .device_kind = o.com.kind};
    ZINF_CHECK(zinf_open(&zo, &e));
    ZINF_CHECK(zinf_stats(e, &st));
    bool dev_direct = !st.device_is_cuda;

    zinf_tensor *t = calloc(ntensors, sizeof(*t));
    void **ptr = calloc(ntensors, sizeof(*ptr));
    void *buf = aligned_alloc(PAGE_BYTES, o.com.tensor_bytes);
    if (!t || !ptr || !buf) {
        fprintf(stderr, "hitpath: out of memory\n");
        return 1;
    }
    for (unsigned i = 0; i < ntensors; i++) {
        char name[64];
        snprintf(name, sizeof(name), "hitpath.%u", i);
        ZINF_CHECK(zinf_register(e, name, o.com.tensor_bytes, ZINF_TIER_NVME, &t[i]));
        pattern_fill(buf, o.com.tensor_bytes, i, 0);
        ZINF_CHECK(zinf_write(e, t[i], 0, buf, o.com.tensor_bytes));
    }
    print_header(&o, &st, clock_cost_ns());

    struct row rows[4];
    int fails = 0;
    for (int m = 0; m < 2; m++) {
        for (int ti = 0; ti < 2; ti++) {
            enum zinf_tier tier = tiers[ti];
            bool sched = m == 1, direct = tier == ZINF_TIER_HOST || dev_direct;
            unsigned first = ti * (1 + o.k) + (sched ? 1 : 0), n = sched ? o.k : 1;
            struct row *row = &rows[m * 2 + ti];
            *row = (struct row){.tier_name = tier_names[ti], .mode = sched ? "sched" : "plain"};
            /* Load (untimed) and check. With sched, rounds and steps until the engine
             * replays this order: the first step may end a recording that began earlier
             * (opening is a step boundary), which the next fetch then diverges from. */
            for (int round = 0; round < (sched ? 4 : 1); round++) {
                for (unsigned i = 0; i < n; i++) {
                    void *p;
                    ZINF_CHECK(zinf_fetch(e, t[first + i], tier, &p));
                    if (round == 0) {
                        ptr[first + i] = p;
                        row->bad_pages += check_all(e, t[first + i], first + i, p, direct,
                                                    o.com.tensor_bytes, buf);
                    }
                    row->moved_ptrs += p != ptr[first + i];
                    ZINF_CHECK(zinf_release(e, t[first + i], tier, ZINF_RELEASE_CLEAN));
                }
                if (sched) {
                    ZINF_CHECK(zinf_step(e));
                    ZINF_CHECK(zinf_stats(e, &st));
                    if (st.schedule_length == n) break;
                }
            }
            run_row(&o, e, tier, &t[first], &ptr[first], n, sched, row);
            for (unsigned i = 0; i < n; i++) {
                void *p;
                ZINF_CHECK(zinf_fetch(e, t[first + i], tier, &p));
                row->moved_ptrs += p != ptr[first + i];
                row->bad_pages +=
                    check_all(e, t[first + i], first + i, p, direct, o.com.tensor_bytes, buf);
                ZINF_CHECK(zinf_release(e, t[first + i], tier, ZINF_RELEASE_CLEAN));
            }
            if (sched && (row->sched_len != o.k || row->sched_resets)) {
                fprintf(stderr,
                        "hitpath: the schedule was not active (length %llu, resets "
                        "%llu)\n",
                        (unsigned long long)row->sched_len, (unsigned long long)row->sched_resets);
                fails++;
            }
            fails += !row_ok(row);
            print_row(&o, row);
        }
    }
    if (!o.com.json) {
        for (int i = 0; i < 4; i++)
            print_hist(&rows[i]);
        double worst = 0;
        for (int i = 0; i < 4; i++)
            worst = fmax(worst, rows[i].batch_p50);
        printf("# median per fetch+release (batch_p50): device %.0f ns, host %.0f ns; with a "
               "schedule: device %.0f ns, host %.0f ns\n",
               rows[0].batch_p50, rows[1].batch_p50, rows[2].batch_p50, rows[3].batch_p50);
        printf("# target <= 1000 ns median: %s (worst row %.0f ns, %.2f of the target)\n",
               worst <= 1000 ? "met" : "NOT met", worst, worst / 1000);
        printf("# %s\n", fails ? "FAILED: see the rows marked FAIL" : "all rows verified");
    } else {
        printf("{\"bench\": \"hitpath\", \"summary\": true, \"worst_batch_p50_ns\": %.1f, "
               "\"target_met\": %s, \"verified\": %s}\n",
               fmax(fmax(rows[0].batch_p50, rows[1].batch_p50),
                    fmax(rows[2].batch_p50, rows[3].batch_p50)),
               fmax(fmax(rows[0].batch_p50, rows[1].batch_p50),
                    fmax(rows[2].batch_p50, rows[3].batch_p50)) <= 1000
                   ? "true"
                   : "false",
               fails ? "false" : "true");
    }

    for (unsigned i = 0; i < ntensors; i++)
        ZINF_CHECK(zinf_unregister(e, t[i]));
    zinf_close(e);
    free(buf);
    free(ptr);
    free(t);
    return fails ? 1 : 0;
}
