/*
 * cmd_bench_run.c - the passes of `zinf bench`: one write or read of the file, through the
 * IO engine with nslots requests outstanding, or with plain pread/pwrite one request at a
 * time; each with its time, CPU time, the latency of every request and what the block
 * device under the file saw.
 *
 * Every block carries a pattern derived from its file offset, so each byte read is
 * checked without keeping a copy. Filling and checking run on the main thread while the
 * engine's thread reaps completions, and both are inside the timed region: the figures
 * are what a caller that touches its data gets.
 *
 * Not here: the command line, the engine's setup for a pass (cmd_bench.c), or printing
 * (cmd_bench_report.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/sysmacros.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cmd_bench.h"
#include "common.h"
#include "io/uring.h"
#include "progress.h"

#define PATTERN_SEED 0x7a696e66ull /* "zinf" */

/* ---- what reached the device -------------------------------------------------------- */

/* /sys/dev/block/MAJ:MIN/stat of the device (or partition) that holds path. */
struct devsnap bench_dev_snap(const char *path)
{
    struct devsnap d = {0};
    struct stat st;
    char sys[128];
    unsigned long long f[7];

    if (stat(path, &st) != 0 || major(st.st_dev) == 0)
        return d; /* no block device: tmpfs, overlay and the like */
    snprintf(sys, sizeof(sys), "/sys/dev/block/%u:%u/stat", major(st.st_dev), minor(st.st_dev));
    FILE *fp = fopen(sys, "r");
    if (!fp)
        return d;
    /* reads completed, reads merged, sectors read, ms reading, writes completed, writes
     * merged, sectors written, ... */
    d.ok = fscanf(fp, "%llu %llu %llu %llu %llu %llu %llu", &f[0], &f[1], &f[2], &f[3], &f[4],
                  &f[5], &f[6]) == 7;
    fclose(fp);
    d.reqs[0] = f[0], d.merges[0] = f[1], d.sectors[0] = f[2];
    d.reqs[1] = f[4], d.merges[1] = f[5], d.sectors[1] = f[6];
    return d;
}

void bench_dev_account(struct row *r, const struct devsnap *a, const struct devsnap *b,
                       enum uring_op op)
{
    int k = op == URING_WRITE;
    r->dev_ok = a->ok && b->ok;
    if (!r->dev_ok)
        return;
    r->dev_requests = b->reqs[k] - a->reqs[k];
    r->dev_merges = b->merges[k] - a->merges[k];
    r->dev_bytes = (b->sectors[k] - a->sectors[k]) * 512;
}

/* ---- the pattern ------------------------------------------------------------------ */

/* Word j of the 4 KiB page at file offset `off`: a hash of the page's offset, plus j.
 * Cheap enough to fill and check at memory speed, different on every page. */
static inline uint64_t page_key(uint64_t off)
{
    uint64_t z = (off >> 12) * 0x9e3779b97f4a7c15ull ^ PATTERN_SEED;
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
    return z ^ (z >> 29);
}

static void pattern_fill(void *buf, size_t len, uint64_t off)
{
    uint64_t *w = buf;
    for (size_t p = 0; p < len; p += ZINF_ALIGN, w += ZINF_ALIGN / 8) {
        uint64_t k = page_key(off + p);
        for (unsigned j = 0; j < ZINF_ALIGN / 8; j++)
            w[j] = k + j;
    }
}

bool bench_pattern_check(const void *buf, size_t len, uint64_t off)
{
    const uint64_t *w = buf;
    uint64_t diff = 0;
    for (size_t p = 0; p < len; p += ZINF_ALIGN, w += ZINF_ALIGN / 8) {
        uint64_t k = page_key(off + p);
        for (unsigned j = 0; j < ZINF_ALIGN / 8; j++)
            diff |= w[j] ^ (k + j);
    }
    return diff == 0;
}

static double cpu_now(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

/* Whether passes draw a progress bar (a terminal, no --json). */
bool bench_show_progress;

/* ---- the order of the blocks, and the latencies ------------------------------------ */

/* The blocks of bs in size bytes, each once: in order, or shuffled by seed. */
uint64_t *bench_block_order(uint64_t size, size_t bs, bool shuffle, uint64_t seed, uint64_t *n)
{
    *n = (size + bs - 1) / bs;
    uint64_t *o = malloc(*n * sizeof(*o));
    if (!o) return NULL;
    for (uint64_t i = 0; i < *n; i++)
        o[i] = i;
    uint64_t s = seed ? seed : PATTERN_SEED;
    for (uint64_t i = *n; shuffle && i > 1; i--) { /* Fisher-Yates, splitmix64 */
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        uint64_t j = z % i, t = o[i - 1];
        o[i - 1] = o[j];
        o[j] = t;
    }
    return o;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The row's percentiles from n latencies in ns (sorted here). */
static void latency_percentiles(struct row *r, uint64_t *lat, uint64_t n)
{
    static const double q[4] = {0.50, 0.90, 0.99, 0.999};
    r->requests = n;
    if (!n) return;
    qsort(lat, n, sizeof(*lat), cmp_u64);
    for (int i = 0; i < 4; i++) {
        uint64_t k = (uint64_t)ceil(q[i] * (double)n); /* the nearest rank, as fio */
        r->lat_us[i] = (double)lat[(k ? k : 1) - 1] / 1e3;
    }
}

/* ---- one run through the engine --------------------------------------------------- */

struct slot_queue {
    pthread_mutex_t lock;
    pthread_cond_t cv;
    unsigned *ring; /* completed slots, FIFO */
    int *res;
    uint64_t *done; /* when each completed (now_ns) */
    unsigned head, count, cap;
};

static void slot_cb(struct uring_req *req, int res)
{
    struct slot_queue *q = req->data;
    uint64_t t = now_ns();
    pthread_mutex_lock(&q->lock);
    unsigned at = (q->head + q->count) % q->cap;
    q->ring[at] = (unsigned)(uintptr_t)req->map_data;
    q->res[at] = res;
    q->done[at] = t;
    q->count++;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->lock);
}

/* nslots requests are kept outstanding, twice the engine's queue depth where memory
 * allows: the engine keeps queue_depth of them at the device and starts the next one from
 * its own thread as each completes, so filling and checking here never leave the device
 * idle. */
int bench_engine_run(struct uring *u, int file, enum uring_op op, uint64_t size, size_t bs,
                     unsigned nslots, char *mem, const uint64_t *order, struct row *row)
{
    unsigned qd = nslots;
    uint64_t nblocks = (size + bs - 1) / bs;
    struct uring_req *reqs = calloc(qd, sizeof(*reqs));
    uint64_t *t_sub = calloc(qd, sizeof(uint64_t)), *lat = malloc(nblocks * sizeof(uint64_t));
    struct slot_queue q = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                           calloc(qd, sizeof(unsigned)), calloc(qd, sizeof(int)),
                           calloc(qd, sizeof(uint64_t)), 0, 0, qd};
    uint64_t next = 0, finished = 0, nlat = 0; /* next: requests started */
    unsigned inflight = 0;
    int err = 0;

    if (!reqs || !q.ring || !q.res || !q.done || !t_sub || !lat) {
        err = -ENOMEM;
        goto out;
    }
    struct progress pg;
    progress_start(&pg, bench_show_progress, op == URING_WRITE ? "write" : "read", size);
    double c0 = cpu_now();
    uint64_t t0 = now_ns();
    for (unsigned s = 0; s < qd && next < nblocks; s++) {
        uint64_t off = (order ? order[next] : next) * bs;
        size_t n = (size_t)MIN((uint64_t)bs, size - off);
        char *buf = mem + (size_t)s * bs;
        if (op == URING_WRITE)
            pattern_fill(buf, n, off);
        /* map_data is unused by plain requests: it carries the slot number back. */
        reqs[s] = (struct uring_req){.op = op, .file = file, .buf = buf, .len = n, .off = off,
                                     .cb = slot_cb, .data = &q, .map_data = (void *)(uintptr_t)s};
        t_sub[s] = now_ns();
        if ((err = uring_submit(u, &reqs[s])) < 0)
            goto drain;
        next++;
        inflight++;
    }
    while (inflight) {
        pthread_mutex_lock(&q.lock);
        while (q.count == 0)
            pthread_cond_wait(&q.cv, &q.lock);
        unsigned s = q.ring[q.head];
        int res = q.res[q.head];
        uint64_t done = q.done[q.head];
        q.head = (q.head + 1) % q.cap;
        q.count--;
        pthread_mutex_unlock(&q.lock);
        inflight--;

        struct uring_req *r = &reqs[s];
        if (res < 0) {
            if (!err)
                err = res;
            continue;
        }
        lat[nlat++] = done - t_sub[s];
        if (op == URING_READ && !bench_pattern_check(r->buf, r->len, r->off))
            row->bad_blocks++;
        finished += r->len;
        progress_show(&pg, finished);
        if (err || next >= nblocks)
            continue;
        uint64_t off = (order ? order[next] : next) * bs;
        size_t n = (size_t)MIN((uint64_t)bs, size - off);
        r->off = off;
        r->len = n;
        if (op == URING_WRITE)
            pattern_fill(r->buf, n, off);
        t_sub[s] = now_ns();
        if ((err = uring_submit(u, r)) < 0)
            continue;
        next++;
        inflight++;
    }
    if (op == URING_WRITE && !err && fdatasync(uring_file_fd(u, file)) < 0)
        err = -errno;
    row->seconds = (double)(now_ns() - t0) / 1e9;
    row->cpu_seconds = cpu_now() - c0;
    row->bytes = finished;
    row->verified = op == URING_READ ? row->bad_blocks == 0 : true;
    latency_percentiles(row, lat, nlat);
drain:
    progress_end(&pg);
    while (inflight) { /* only after a failed submit: collect what is still out */
        pthread_mutex_lock(&q.lock);
        while (q.count == 0)
            pthread_cond_wait(&q.cv, &q.lock);
        q.head = (q.head + 1) % q.cap;
        q.count--;
        inflight--;
        pthread_mutex_unlock(&q.lock);
    }
out:
    free(q.ring);
    free(q.res);
    free(q.done);
    free(t_sub);
    free(lat);
    free(reqs);
    return err;
}

/* ---- the baseline: plain pread/pwrite, one request at a time ------------------------ */

int bench_baseline_run(const char *path, enum uring_op op, uint64_t size, size_t bs, char *buf,
                       const uint64_t *order, struct row *row)
{
    int fd = open(path, (op == URING_WRITE ? O_WRONLY | O_CREAT : O_RDONLY) | O_DIRECT, 0644);
    if (fd < 0 && errno == EINVAL)
        fd = open(path, op == URING_WRITE ? O_WRONLY | O_CREAT : O_RDONLY, 0644);
    if (fd < 0)
        return -errno;
    uint64_t nblocks = (size + bs - 1) / bs, nlat = 0, moved = 0;
    uint64_t *lat = malloc(nblocks * sizeof(uint64_t));
    if (!lat) {
        close(fd);
        return -ENOMEM;
    }
    struct progress pg;
    progress_start(&pg, bench_show_progress, op == URING_WRITE ? "pwrite" : "pread", size);
    double c0 = cpu_now();
    uint64_t t0 = now_ns();
    int err = 0;
    for (uint64_t k = 0; k < nblocks && !err; k++) {
        uint64_t off = (order ? order[k] : k) * bs, end = MIN(off + bs, size);
        uint64_t s0 = now_ns();
        while (off < end) { /* a short transfer: the rest, as the engine does */
            size_t n = (size_t)(end - off);
            ssize_t r;
            if (op == URING_WRITE) {
                pattern_fill(buf, n, off);
                r = pwrite(fd, buf, n, (off_t)off);
            } else {
                r = pread(fd, buf, n, (off_t)off);
            }
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0) {
                err = r < 0 ? -errno : -ENODATA;
                break;
            }
            size_t got = (size_t)r == n ? n : (size_t)align_down((uint64_t)r, ZINF_ALIGN);
            if (!got) {
                err = -EIO; /* less than a page moved: O_DIRECT cannot go on from there */
                break;
            }
            if (op == URING_READ && !bench_pattern_check(buf, got, off))
                row->bad_blocks++;
            off += got;
            moved += got;
        }
        lat[nlat++] = now_ns() - s0;
        progress_show(&pg, moved);
    }
    progress_end(&pg);
    if (!err && op == URING_WRITE && fdatasync(fd) < 0)
        err = -errno;
    row->seconds = (double)(now_ns() - t0) / 1e9;
    row->cpu_seconds = cpu_now() - c0;
    row->bytes = moved;
    row->verified = op == URING_READ ? row->bad_blocks == 0 : true;
    latency_percentiles(row, lat, nlat);
    free(lat);
    close(fd);
    return err;
}
