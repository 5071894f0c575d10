/*
 * cmd_stat.c - `zinf stat`: open an engine the way a trainer would (from a DeepSpeed-style
 * config, or from a swap directory) with the saved state there opened read-only, and print
 * what zinf_stats reports: capacity and use per tier, the tensors, NVMe traffic, fetches
 * and hits.
 *
 * It never changes a byte of the swap directory (ZINF_OPEN_READONLY: no lock, no write,
 * no flush), so it may look at the state a running job last flushed. It is an inspection
 * tool for the state on disk and the settings, not a monitor of that job's memory.
 *
 * With --socket it asks a running daemon (zinf serve) instead: the live state of each of
 * its jobs the caller's uid may see, their sessions and pins, as a table (with --watch,
 * again every N seconds with the NVMe GB/s since the last), JSON, or the Prometheus text
 * format for node_exporter's textfile collector.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include "cmd.h"
#include "common.h"
#include "config.h"
#include "engine/engine.h"
#include "service/client.h"
#include "tiers/nvme.h"
#include "zinf_build.h"

static const char *const tier_names[] = {"device", "host", "nvme"};

static void print_json(const struct zinf_stats *s, bool saved)
{
    printf("{\"saved_state\": %s, \"tiers\": {", saved ? "true" : "false");
    for (int i = 0; i < 3; i++) {
        const struct zinf_tier_stats *t = &s->tier[i];
        printf("%s\"%s\": {\"capacity_bytes\": %llu, \"used_bytes\": %llu, \"pinned_bytes\": %llu, "
               "\"fetches\": %llu, \"hits\": %llu, \"evictions\": %llu, \"writebacks\": %llu}",
               i ? ", " : "", tier_names[i], (unsigned long long)t->capacity_bytes,
               (unsigned long long)t->used_bytes, (unsigned long long)t->pinned_bytes,
               (unsigned long long)t->fetches, (unsigned long long)t->hits,
               (unsigned long long)t->evictions, (unsigned long long)t->writebacks);
    }
    printf("}, \"tensors\": %llu, \"nvme_bytes_read\": %llu, \"nvme_bytes_written\": %llu, "
           "\"prefetches\": %llu, \"prefetch_in_time\": %llu, \"prefetch_late\": %llu, "
           "\"prefetch_wasted\": %llu, \"blocked_ns\": %llu, \"steps\": %llu, "
           "\"schedule_length\": %llu, \"schedule_resets\": %llu, \"flushes\": %llu, "
           "\"io_buffered\": %u, \"device_is_cuda\": %s}\n",
           (unsigned long long)s->tensors, (unsigned long long)s->nvme_bytes_read,
           (unsigned long long)s->nvme_bytes_written, (unsigned long long)s->prefetches,
           (unsigned long long)s->prefetch_in_time, (unsigned long long)s->prefetch_late,
           (unsigned long long)s->prefetch_wasted, (unsigned long long)s->blocked_ns,
           (unsigned long long)s->steps, (unsigned long long)s->schedule_length,
           (unsigned long long)s->schedule_resets, (unsigned long long)s->flushes, s->io_buffered,
           s->device_is_cuda ? "true" : "false");
}

static void print_table(const struct zinf_stats *s)
{
    char a[32], b[32], c[32];
    printf("# zinf %s: device tier %s\n", zinf_version(), s->device_is_cuda ? "CUDA" : "emulated");
    printf("# %7s %12s %12s %12s %9s %9s %9s %10s\n", "tier", "capacity", "used", "pinned",
           "fetches", "hits", "evicted", "written");
    for (int i = 0; i < 3; i++) {
        const struct zinf_tier_stats *t = &s->tier[i];
        printf("  %7s %12s %12s %12s %9llu %9llu %9llu %10llu\n", tier_names[i],
               format_size(t->capacity_bytes, a, sizeof(a)),
               format_size(t->used_bytes, b, sizeof(b)), format_size(t->pinned_bytes, c, sizeof(c)),
               (unsigned long long)t->fetches, (unsigned long long)t->hits,
               (unsigned long long)t->evictions, (unsigned long long)t->writebacks);
    }
    printf("# tensors %llu; nvme read %s, written %s; prefetches %llu (in time %llu, late %llu); "
           "blocked %.3f s\n",
           (unsigned long long)s->tensors, format_size(s->nvme_bytes_read, a, sizeof(a)),
           format_size(s->nvme_bytes_written, b, sizeof(b)), (unsigned long long)s->prefetches,
           (unsigned long long)s->prefetch_in_time, (unsigned long long)s->prefetch_late,
           (double)s->blocked_ns / 1e9);
}

/* Does an engine hold DIR's swap files (a lock on the first one)? */
static bool in_use(const char *dir)
{
    char p[4096];
    snprintf(p, sizeof(p), "%s/%s.0", dir, NVME_SWAP_NAME);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    bool held = flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    close(fd);
    return held;
}

static const char *const tier_labels[] = {"device", "host", "nvme"};

/* The Prometheus text format: one family per line group, a sample per job (and tier). Jobs
 * are labelled zinf_job, not job: Prometheus sets job itself, to the scrape's, and would
 * rename ours. A job's name needs no escaping in a label (letters, digits, '.', '_', '-').
 * Counters end in _total. */
static void print_prometheus(const struct service_job_status *js, size_t n)
{
    printf("# HELP zinf_build_info the zinf that printed these metrics: its version, and "
           "whether it was built with CUDA\n# TYPE zinf_build_info gauge\n"
           "zinf_build_info{version=\"%s\",cuda=\"%d\"} 1\n",
           zinf_version(), ZINF_HAVE_CUDA ? 1 : 0);
    static const struct {
        const char *name, *type, *help;
        size_t off; /* in struct zinf_tier_stats */
    } tier_metrics[] = {
        {"zinf_tier_capacity_bytes", "gauge", "the tier's budget",
         offsetof(struct zinf_tier_stats, capacity_bytes)},
        {"zinf_tier_used_bytes", "gauge", "bytes allocated to copies now",
         offsetof(struct zinf_tier_stats, used_bytes)},
        {"zinf_tier_pinned_bytes", "gauge", "bytes held by callers between fetch and release",
         offsetof(struct zinf_tier_stats, pinned_bytes)},
        {"zinf_tier_fetches_total", "counter", "fetches to the tier",
         offsetof(struct zinf_tier_stats, fetches)},
        {"zinf_tier_hits_total", "counter", "fetches that found a resident copy",
         offsetof(struct zinf_tier_stats, hits)},
        {"zinf_tier_evictions_total", "counter", "copies dropped to make room",
         offsetof(struct zinf_tier_stats, evictions)},
        {"zinf_tier_writebacks_total", "counter",
         "dirty copies written to their home before they were dropped",
         offsetof(struct zinf_tier_stats, writebacks)},
    };
    for (size_t m = 0; m < sizeof(tier_metrics) / sizeof(tier_metrics[0]); m++) {
        printf("# HELP %s %s\n# TYPE %s %s\n", tier_metrics[m].name, tier_metrics[m].help,
               tier_metrics[m].name, tier_metrics[m].type);
        for (size_t j = 0; j < n; j++)
            for (int t = 0; t < 3; t++) {
                uint64_t v;
                memcpy(&v, (const char *)&js[j].stats.tier[t] + tier_metrics[m].off, sizeof(v));
                printf("%s{zinf_job=\"%s\",tier=\"%s\"} %llu\n", tier_metrics[m].name, js[j].name,
                       tier_labels[t], (unsigned long long)v);
            }
    }
    static const struct {
        const char *name, *type, *help;
    } job_metrics[] = {
        {"zinf_job_sessions", "gauge", "client processes attached"},
        {"zinf_job_open", "gauge", "1: opened by the daemon; 0: saved on disk, not open"},
        {"zinf_job_pins", "gauge", "pins the clients hold"},
        {"zinf_job_tensors", "gauge", "tensors registered"},
        {"zinf_nvme_read_bytes_total", "counter", "bytes read from the swap files"},
        {"zinf_nvme_written_bytes_total", "counter", "bytes written to the swap files"},
        {"zinf_blocked_seconds_total", "counter", "time callers spent blocked in fetch and wait"},
        {"zinf_steps_total", "counter", "zinf_step calls"},
        {"zinf_prefetches_total", "counter", "loads started ahead of use"},
        {"zinf_prefetch_late_total", "counter",
         "prefetches still arriving when fetched (the fetch waited for them)"},
    };
    enum { JOB_METRICS = sizeof(job_metrics) / sizeof(job_metrics[0]) };
    for (size_t m = 0; m < JOB_METRICS; m++) {
        printf("# HELP %s %s\n# TYPE %s %s\n", job_metrics[m].name, job_metrics[m].help,
               job_metrics[m].name, job_metrics[m].type);
        for (size_t j = 0; j < n; j++) {
            const struct zinf_stats *s = &js[j].stats;
            /* In job_metrics' order. */
            const double v[] = {js[j].sessions,
                                (double)js[j].open,
                                (double)js[j].pins,
                                (double)s->tensors,
                                (double)s->nvme_bytes_read,
                                (double)s->nvme_bytes_written,
                                (double)s->blocked_ns / 1e9,
                                (double)s->steps,
                                (double)s->prefetches,
                                (double)s->prefetch_late};
            _Static_assert(sizeof(v) / sizeof(v[0]) == JOB_METRICS, "a value per job metric");
            printf("%s{zinf_job=\"%s\"} %.17g\n", job_metrics[m].name, js[j].name, v[m]);
        }
    }
}

/* --socket: the daemon's jobs, once or every watch seconds. */
static int stat_socket(const char *sock, bool json, bool prom, double watch)
{
    struct service_job_status *prev = NULL;
    size_t nprev = 0;
    for (int round = 0;; round++) {
        struct service_job_status *js;
        size_t n;
        int r = service_status(sock, &js, &n);
        if (r < 0) {
            fprintf(stderr, "zinf stat: %s: %s\n", sock,
                    r == -ENOENT || r == -ECONNREFUSED ? "no zinf daemon listens there"
                                                       : zinf_strerror(r));
            free(prev);
            return 1;
        }
        if (prom) {
            print_prometheus(js, n);
        } else if (json) {
            printf("{\"socket\": ");
            json_print_string(stdout, sock);
            printf(", \"jobs\": [");
            for (size_t j = 0; j < n; j++) {
                printf("%s{\"job\": ", j ? ", " : "");
                json_print_string(stdout, js[j].name);
                printf(", \"owner_uid\": %u, \"open\": %s, \"sessions\": %u, \"pins\": %llu, "
                       "\"stats\": ",
                       js[j].owner_uid, js[j].open ? "true" : "false", js[j].sessions,
                       (unsigned long long)js[j].pins);
                fflush(stdout);
                print_json(&js[j].stats, true);
                printf("}"); /* print_json ends its object with a newline: JSON allows it */
            }
            printf("]}\n");
        } else {
            printf("# zinf daemon on %s: %zu job%s\n", sock, n, n == 1 ? "" : "s");
            for (size_t j = 0; j < n; j++) {
                if (!js[j].open) {
                    printf("## job %s (owner uid %u): saved, not open (%llu tensors); it opens "
                           "when a client attaches\n",
                           js[j].name, js[j].owner_uid, (unsigned long long)js[j].stats.tensors);
                    continue;
                }
                printf("## job %s (owner uid %u): %u session%s, %llu pins\n", js[j].name,
                       js[j].owner_uid, js[j].sessions, js[j].sessions == 1 ? "" : "s",
                       (unsigned long long)js[j].pins);
                print_table(&js[j].stats);
                for (size_t k = 0; round && k < nprev; k++)
                    if (!strcmp(prev[k].name, js[j].name))
                        printf(
                            "# last %.1f s: NVMe read %.3f GB/s, written %.3f GB/s\n", watch,
                            (double)(js[j].stats.nvme_bytes_read - prev[k].stats.nvme_bytes_read) /
                                watch / 1e9,
                            (double)(js[j].stats.nvme_bytes_written -
                                     prev[k].stats.nvme_bytes_written) /
                                watch / 1e9);
            }
        }
        fflush(stdout);
        free(prev);
        prev = js;
        nprev = n;
        if (watch <= 0) break;
        struct timespec ts = {(time_t)watch, (long)((watch - (double)(time_t)watch) * 1e9)};
        nanosleep(&ts, NULL);
    }
    free(prev);
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf stat (--config FILE | --path DIR) [--json]\n"
               "       zinf stat --socket PATH [--json | --prometheus] [--watch SECONDS]\n"
               "  --socket PATH   the live state of a running daemon's jobs (zinf serve): each\n"
               "                  job the caller's uid may see, its sessions, pins and tiers\n"
               "  --prometheus    the Prometheus text format (node_exporter textfile collector)\n"
               "  --watch N       print again every N seconds, with the NVMe GB/s since the last\n"
               "  --config FILE   open the engine a DeepSpeed-style config describes, with the\n"
               "                  state saved in its nvme_path (if any) opened read-only\n"
               "  --path DIR      open the state saved in the swap directory DIR, read-only\n"
               "  --json          one JSON object instead of the table\n"
               "Nothing in the swap directory is changed, even next to a job that uses it.\n"
               "Exit status: 0 printed; 1 the engine could not be opened, or --path holds no\n"
               "saved state; 2 bad usage or a bad config file.\n");
}

int cmd_stat(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'}, {"path", required_argument, NULL, 'p'},
        {"json", no_argument, NULL, 'j'},         {"socket", required_argument, NULL, 's'},
        {"prometheus", no_argument, NULL, 'P'},   {"watch", required_argument, NULL, 'w'},
        {"help", no_argument, NULL, 'h'},         {0},
    };
    const char *config = NULL, *path = NULL, *sock = NULL;
    bool json = false, prom = false;
    double watch = 0;
    zinf_engine *e = NULL;
    struct zinf_stats st;
    int ch, r;

    optind = 1;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, "c:p:jh", longopts, NULL)) != -1) {
        char *end;
        switch (ch) {
        case 'c':
            config = optarg;
            break;
        case 'p':
            path = optarg;
            break;
        case 'j':
            json = true;
            break;
        case 's':
            sock = optarg;
            break;
        case 'P':
            prom = true;
            break;
        case 'w':
            watch = strtod(optarg, &end);
            if (*end || !(watch > 0 && watch <= 86400)) {
                fprintf(stderr, "zinf stat: --watch %s: seconds between 0 and 86400\n", optarg);
                return 2;
            }
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            fprintf(stderr, "zinf stat: unknown or incomplete option '%s'\n", argv[optind - 1]);
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc || (!!config + !!path + !!sock) != 1 || (json && prom) ||
        (!sock && (prom || watch > 0))) {
        fprintf(stderr, "zinf stat: give exactly one of --config FILE, --path DIR or --socket "
                        "PATH (--prometheus and --watch with --socket; --json or --prometheus)\n");
        usage(stderr);
        return 2;
    }
    if (sock) return stat_socket(sock, json, prom, watch);
    bool saved = true;
    char swapbuf[4096];
    const char *swap = path;
    if (config) {
        struct zinf_config c;
        char err[512];
        if (config_parse_file(config, &c, err, sizeof(err)) < 0) {
            fprintf(stderr, "zinf stat: %s\n", err);
            config_free(&c);
            return 2;
        }
        swap = NULL;
        if (c.nvme_paths.count) {
            snprintf(swapbuf, sizeof(swapbuf), "%s", c.nvme_paths.path[0]);
            swap = swapbuf;
        }
        size_t n, npaths = c.nvme_paths.count;
        if (!swap || persist_probe(swap, &n, NULL) == -ENOENT) {
            /* No saved state: the tiers as configured, without opening the swap space
             * (which would create its files). */
            saved = false;
            c.nvme_paths.count = 0;
        }
        r = engine_open_config(&c, saved ? ZINF_OPEN_READONLY : 0, &e);
        c.nvme_paths.count = npaths; /* so that config_free() frees every path */
        config_free(&c);
    } else {
        /* The stripe layout on disk depends on the block size it was written with: take
         * it from the manifest when there is one. */
        char mpath[4096];
        /* Unpinned: an inspection has no transfers to speed up, and should not lock a
         * default-sized host tier in memory next to a job that needs it. */
        struct zinf_options o = {.nvme_path = path, .flags = ZINF_OPEN_READONLY | ZINF_OPEN_NO_PIN};
        snprintf(mpath, sizeof(mpath), "%s/zinf-manifest.json", path);
        json_t *m = json_load_file(mpath, 0, NULL);
        if (m) {
            json_int_t bs = json_integer_value(json_object_get(m, "block_size"));
            if (bs > 0) o.block_size = (size_t)bs;
            json_decref(m);
        }
        r = zinf_open(&o, &e);
        if (r == -ENOENT && !in_use(path)) {
            fprintf(stderr, "zinf stat: no saved run in %s\n", path);
            return 1;
        }
        if (r == -ENOENT)
            r = -EBUSY; /* an engine works there but has saved nothing yet: said below */
    }
    if (r == -EBUSY) {
        fprintf(stderr,
                "zinf stat: %s is in use by another engine, and holds no saved state "
                "to inspect yet (read-only inspection needs one: after that engine's "
                "first flush, or zinf train's first checkpoint)\n",
                swap ? swap : path);
        return 1;
    }
    if (r < 0) {
        fprintf(stderr, "zinf stat: cannot open the engine (%s): %s\n", config ? config : path,
                zinf_strerror(r));
        return r == -EINVAL || r == -ENOENT ? 2 : 1;
    }
    zinf_stats(e, &st);
    if (json) {
        print_json(&st, saved);
    } else {
        print_table(&st);
        if (swap)
            printf("# %s: %s\n", swap, saved ? "saved state opened read-only" : "no saved state");
    }
    zinf_close(e);
    return 0;
}
