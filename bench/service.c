/*
 * service.c - the same work on an engine of this process and through the zinf daemon
 * (zinf_connect), side by side in one run, with the ratio of each pair:
 *   - hit: zinf_fetch + zinf_release of a resident tensor, per pair, in the device and the
 *     host tier: median and p99 of ROUNDS x PAIRS timed pairs (one clock read around each);
 *   - swapin: TENSORS tensors homed on NVMe, TENSORS x SIZE several times the device tier,
 *     each step fetching every one to the device tier, checking a page of it and releasing
 *     it; GB/s of tensor bytes over the steps after the first (the one the engine learns).
 * The embedded engine is opened from --config, the daemon is the one listening on
 * --connect, started from that config's twin (bench/service.sh writes both and starts it),
 * so both have the same budgets, IO settings and drive. Embedded and daemon runs alternate, ROUNDS
 * times; in swap-in rounds the order flips every round (so a drift of the drive over time
 * falls on both sides), and the summary gives the median of the per-round ratios with a
 * distribution-free interval for it (about 95%). Every row says whether the bytes read
 * back were right.
 *
 * Only zinf.h is used. Not a contention test: one thread, one client.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "zinf.h"

#define CHECK(call)                                                                                \
    do {                                                                                           \
        int r_ = (call);                                                                           \
        if (r_ < 0) {                                                                              \
            fprintf(stderr, "service: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,                 \
                    zinf_strerror(r_));                                                            \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

struct opts {
    const char *config, *socket;
    int rounds, pairs, tensors, steps;
    bool swapin_only;
    uint64_t size;
};

#define MIB ((uint64_t)1 << 20)

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#define MAX_ROUNDS 256

/* The k-th smallest of v (0-based), v left as it was. */
static double order_stat(const double *v, int n, int k)
{
    double s[MAX_ROUNDS];
    memcpy(s, v, sizeof(*v) * (size_t)n);
    qsort(s, (size_t)n, sizeof(*s), cmp_double);
    return s[k < 0 ? 0 : k >= n ? n - 1 : k];
}

static double median(const double *v, int n)
{
    return n % 2 ? order_stat(v, n, n / 2)
                 : (order_stat(v, n, n / 2 - 1) + order_stat(v, n, n / 2)) / 2;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t pct(uint64_t *v, size_t n, double p)
{
    qsort(v, n, sizeof(*v), cmp_u64);
    size_t i = (size_t)(p * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

static zinf_engine *open_one(const struct opts *o, bool remote, const char *job)
{
    zinf_engine *e;
    if (remote)
        CHECK(zinf_connect(o->socket, job, &e));
    else
        CHECK(zinf_open_config_flags(o->config, ZINF_OPEN_OVERWRITE, &e));
    return e;
}

/* Median and p99 of fetch+release pairs of one resident tensor in tier; *ok whether its
 * bytes stayed right. */
static void hit(const struct opts *o, bool remote, enum zinf_tier tier, uint64_t *t_ns, bool *ok)
{
    char job[64];
    snprintf(job, sizeof(job), "bench-hit-%d", (int)tier);
    zinf_engine *e = open_one(o, remote, job);
    zinf_tensor t;
    const size_t n = 1 << 20;
    if (zinf_lookup(e, "hit", &t) != 0) CHECK(zinf_register(e, "hit", n, ZINF_TIER_HOST, &t));
    unsigned char *want = malloc(n), *got = malloc(n);
    for (size_t i = 0; i < n; i++)
        want[i] = (unsigned char)(i * 131 + tier);
    CHECK(zinf_write(e, t, 0, want, n));
    void *p0, *p;
    CHECK(zinf_fetch(e, t, tier, &p0)); /* resident from here on */
    uint64_t *v = malloc(sizeof(*v) * (size_t)o->pairs);
    *ok = true;
    for (int i = 0; i < o->pairs; i++) {
        uint64_t a = now_ns();
        CHECK(zinf_fetch(e, t, tier, &p));
        CHECK(zinf_release(e, t, tier, 0));
        v[i] = now_ns() - a;
        *ok &= p == p0;
    }
    CHECK(zinf_release(e, t, tier, 0));
    CHECK(zinf_read(e, t, 0, got, n));
    *ok &= !memcmp(got, want, n);
    t_ns[0] = pct(v, (size_t)o->pairs, 0.5);
    t_ns[1] = pct(v, (size_t)o->pairs, 0.99);
    free(v);
    free(want);
    free(got);
    zinf_close(e);
}

/* GB/s of tensor bytes fetched to the device tier over steps 2..steps. */
static double swapin(const struct opts *o, bool remote, bool *ok)
{
    zinf_engine *e = open_one(o, remote, "bench-swapin");
    zinf_tensor *ts = calloc((size_t)o->tensors, sizeof(*ts));
    char name[32];
    uint64_t *buf = calloc(1, o->size);
    if (!buf) CHECK(-ENOMEM);
    *ok = true;
    for (int i = 0; i < o->tensors; i++) {
        snprintf(name, sizeof(name), "s%d", i);
        /* The daemon's job keeps its tensors from round to round; they are written again
         * all the same, as the embedded engine, which starts over, writes its own: both
         * sides read what they have just written. */
        if (zinf_lookup(e, name, &ts[i]) != 0)
            CHECK(zinf_register(e, name, o->size, ZINF_TIER_NVME, &ts[i]));
        for (uint64_t pg = 0; pg < o->size / PAGE_BYTES; pg++)
            for (size_t j = 0; j < PAGE_BYTES / 8; j++)
                buf[pg * (PAGE_BYTES / 8) + j] = page_key((uint64_t)i, pg) + j;
        CHECK(zinf_write(e, ts[i], 0, buf, o->size));
    }
    free(buf);
    CHECK(zinf_flush(e));
    uint64_t bytes = 0, ns = 0;
    for (int s = 0; s < o->steps; s++) {
        uint64_t a = now_ns();
        for (int i = 0; i < o->tensors; i++) {
            void *p;
            CHECK(zinf_fetch(e, ts[i], ZINF_TIER_DEVICE, &p));
            uint64_t pg = (uint64_t)(s + i) % (o->size / PAGE_BYTES);
            const uint64_t *w = (const uint64_t *)((const char *)p + pg * PAGE_BYTES);
            *ok &= w[0] == page_key((uint64_t)i, pg) &&
                   w[PAGE_BYTES / 8 - 1] == page_key((uint64_t)i, pg) + PAGE_BYTES / 8 - 1;
            CHECK(zinf_release(e, ts[i], ZINF_TIER_DEVICE, 0));
        }
        CHECK(zinf_step(e));
        if (s > 0) {
            ns += now_ns() - a;
            bytes += (uint64_t)o->tensors * o->size;
        }
    }
    free(ts);
    zinf_close(e);
    return ns ? (double)bytes / (double)ns : 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: service --config FILE --connect SOCKET [--rounds 3] [--pairs 20000]\n"
               "               [--tensors 24] [--tensor-size 16M] [--steps 4] [--swapin-only]\n"
               "The same work embedded (an engine from FILE) and through the daemon on SOCKET\n"
               "(started from FILE: bench/service.sh), alternating, with their ratio.\n");
}

int main(int argc, char **argv)
{
    struct opts o = {.rounds = 3, .pairs = 20000, .tensors = 24, .steps = 4, .size = 16 * MIB};
    static const struct option longopts[] = {{"config", required_argument, NULL, 'c'},
                                             {"connect", required_argument, NULL, 's'},
                                             {"rounds", required_argument, NULL, 'r'},
                                             {"pairs", required_argument, NULL, 'p'},
                                             {"tensors", required_argument, NULL, 't'},
                                             {"tensor-size", required_argument, NULL, 'z'},
                                             {"steps", required_argument, NULL, 'n'},
                                             {"swapin-only", no_argument, NULL, 'w'},
                                             {"help", no_argument, NULL, 'h'},
                                             {NULL, 0, NULL, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'c':
            o.config = optarg;
            break;
        case 's':
            o.socket = optarg;
            break;
        case 'r':
            o.rounds = atoi(optarg);
            break;
        case 'p':
            o.pairs = atoi(optarg);
            break;
        case 't':
            o.tensors = atoi(optarg);
            break;
        case 'n':
            o.steps = atoi(optarg);
            break;
        case 'w':
            o.swapin_only = true;
            break;
        case 'z':
            if (parse_size(optarg, &o.size) < 0 || o.size < PAGE_BYTES) {
                fprintf(stderr, "service: --tensor-size %s: a size of at least 4K\n", optarg);
                return 2;
            }
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (!o.config || !o.socket || o.rounds < 1 || o.rounds > MAX_ROUNDS || o.pairs < 100 ||
        o.tensors < 1 || o.steps < 2) {
        usage(stderr);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0); /* rows as they come, into a file too */
    printf("# zinf %s: embedded (%s) against the daemon on %s, %d rounds alternating\n",
           zinf_version(), o.config, o.socket, o.rounds);
    printf("# hit: %d fetch+release pairs of a resident 1 MiB tensor per round, one clock read "
           "around each; swapin: %d tensors x %llu B homed on NVMe, %d steps, GB/s over steps "
           "2..%d\n",
           o.pairs, o.tensors, (unsigned long long)o.size, o.steps, o.steps);
    printf("# %-12s %5s %14s %14s %8s %8s\n", "row", "round", "embedded", "daemon", "ratio",
           "verified");
    bool all_ok = true;
    static double hm[2][2][MAX_ROUNDS], hp[2][2][MAX_ROUNDS], sw[2][MAX_ROUNDS], ratio[MAX_ROUNDS];
    for (int r = 0; r < o.rounds; r++) {
        for (int tier = 0; tier < 2 && !o.swapin_only; tier++) {
            uint64_t t[2][2];
            bool ok[2];
            for (int remote = 0; remote < 2; remote++)
                hit(&o, remote, (enum zinf_tier)tier, t[remote], &ok[remote]);
            const char *tn = tier ? "host" : "device";
            printf("  hit-%-6s p50 %5d %11llu ns %11llu ns %8.1f %8s\n", tn, r + 1,
                   (unsigned long long)t[0][0], (unsigned long long)t[1][0],
                   (double)t[1][0] / (double)t[0][0], ok[0] && ok[1] ? "yes" : "NO");
            printf("  hit-%-6s p99 %5d %11llu ns %11llu ns %8.1f %8s\n", tn, r + 1,
                   (unsigned long long)t[0][1], (unsigned long long)t[1][1],
                   (double)t[1][1] / (double)t[0][1], ok[0] && ok[1] ? "yes" : "NO");
            for (int k = 0; k < 2; k++) {
                hm[tier][k][r] = (double)t[k][0];
                hp[tier][k][r] = (double)t[k][1];
            }
            all_ok &= ok[0] && ok[1];
        }
        bool ok[2];
        double g[2];
        for (int k = 0; k < 2; k++) {
            int remote = (r + k) % 2; /* embedded first in odd rounds, the daemon in even */
            g[remote] = swapin(&o, remote, &ok[remote]);
        }
        printf("  %-16s %5d %10.3f GB/s %9.3f GB/s %8.3f %8s\n", "swapin", r + 1, g[0], g[1],
               g[1] / g[0], ok[0] && ok[1] ? "yes" : "NO");
        sw[0][r] = g[0];
        sw[1][r] = g[1];
        ratio[r] = g[1] / g[0];
        all_ok &= ok[0] && ok[1];
    }
    int n = o.rounds;
    for (int tier = 0; tier < 2 && !o.swapin_only; tier++)
        printf("# hit %-6s medians over rounds: embedded p50 %.0f ns, p99 %.0f ns; daemon p50 "
               "%.0f ns, p99 %.0f ns\n",
               tier ? "host" : "device", median(hm[tier][0], n), median(hp[tier][0], n),
               median(hm[tier][1], n), median(hp[tier][1], n));
    double se = median(sw[0], n), sd = median(sw[1], n);
    printf("# swapin medians over rounds: embedded %.3f GB/s, daemon %.3f GB/s, ratio %.3f\n", se,
           sd, sd / se);
    /* The median's interval from order statistics: ranks n/2 -+ 0.98 sqrt(n) (the normal
     * approximation of the binomial), about 95% whatever the distribution of the ratios. */
    double half = 0.98 * sqrt((double)n);
    int lo = (int)floor((double)n / 2 - half), hi = (int)ceil((double)n / 2 + half);
    printf("# swapin per-round ratio daemon/embedded over %d rounds: median %.3f, quartiles "
           "%.3f-%.3f, ~95%% interval of the median %.3f-%.3f%s\n",
           n, median(ratio, n), order_stat(ratio, n, n / 4), order_stat(ratio, n, 3 * n / 4),
           order_stat(ratio, n, lo), order_stat(ratio, n, hi),
           n < 10 ? " (too few rounds for an interval)" : "");
    printf("# %s\n", all_ok ? "all rows verified" : "SOME ROWS FAILED VERIFICATION");
    return all_ok ? 0 : 1;
}
