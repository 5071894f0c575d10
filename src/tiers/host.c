/*
 * host.c - the pinned host tier behind host.h.
 *
 * One anonymous mapping holds the budget [0, capacity) and, right after it, the staging
 * area. A shared tier (the service's) maps its budget from a memfd, for its clients, and
 * its staging area apart, anonymous and private: the kernel rarely backs shared memory
 * with huge pages (transparent huge pages for shmem are off by default), and the staging
 * area is where every NVMe read of a swap-in lands. Each mapping (span) is built in this
 * order, and host_close() undoes it in reverse, from whatever point a failed host_open()
 * reached:
 *   1. mmap, 2 MiB aligned and advised to use transparent huge pages (hugemem.h: whole
 *      IO requests then reach the drive as one or two segments and merge);
 *   2. NUMA placement: mbind(MPOL_PREFERRED) before the first touch, so pages come from
 *      the chosen node while it has free memory and from another one after that, rather
 *      than waking the OOM killer for a placement that is only a speed-up;
 *   3. mlock (pin=true), which also faults every page in, on the node chosen above;
 *   4. cudaHostRegister through the device tier, when that tier is CUDA;
 *   5. io_uring fixed-buffer registration of the whole mapping.
 * Only mlock is allowed to fail the open (that is what pinning promises); a placement,
 * CUDA or io_uring registration that does not work costs speed, not correctness, so it is
 * said once and the tier runs without it.
 *
 * The budget is handed out by the extent allocator at 4 KiB granularity under one mutex.
 *
 * Not here: what lives in the tier, eviction, or how the staging area is shared out.
 */
#include <errno.h>
#include <numa.h>
#include <numaif.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common.h"
#include "hugemem.h"
#include "io/uring.h"
#include "tiers/device.h"
#include "tiers/extent.h"
#include "tiers/host.h"

#define PLACE_SAMPLES 64 /* pages checked after locking to see where the arena landed */

/* A mapping of the tier and what was done to it. */
struct span {
    char *p; /* NULL until mapped */
    size_t len;
    bool huge; /* the kernel took MADV_HUGEPAGE for it */
    bool locked, cuda_registered;
    int io_region; /* -1: not registered */
};

struct host {
    struct uring *io;
    struct device *dev;
    char *base; /* the budget: span[0].p */
    char *staging;
    size_t capacity_bytes, staging_bytes, total_bytes;
    int numa_node; /* where the arena lives, -1 unknown */
    struct span span[2];
    unsigned nspans; /* 1, or 2: a shared budget and the staging area apart */
    int fd;          /* the memfd of a shared arena, else -1 */

    pthread_mutex_t lock; /* ext */
    struct extent_alloc ext;
    uint64_t next_fit; /* where the next allocation starts looking (next fit) */
    uint64_t mark;     /* the end of the room ever handed out (extent_alloc_under) */
};

static const char *limit_str(rlim_t v, char *buf, size_t len)
{
    if (v == RLIM_INFINITY) return "unlimited";
    return format_size((uint64_t)v, buf, len);
}

/* Step 2: ask for pages from node; say so and carry on when that cannot be done. */
static void place(struct host *h, const struct span *sp, int node)
{
    struct bitmask *bm;

    if (numa_available() < 0) {
        log_notice("no NUMA support here: the host arena is not placed on node %d", node);
        return;
    }
    if (node > numa_max_node() || !numa_bitmask_isbitset(numa_all_nodes_ptr, (unsigned)node)) {
        log_notice("NUMA node %d has no memory usable here (nodes 0-%d): the host arena "
                   "is not placed",
                   node, numa_max_node());
        return;
    }
    bm = numa_allocate_nodemask();
    if (!bm) {
        log_notice("cannot place the host arena on NUMA node %d: out of memory", node);
        return;
    }
    numa_bitmask_setbit(bm, (unsigned)node);
    /* The kernel wants one more than the number of bits (libnuma passes size + 1 too). */
    if (mbind(sp->p, sp->len, MPOL_PREFERRED, bm->maskp, bm->size + 1, 0) != 0)
        log_notice("cannot place the host arena on NUMA node %d (mbind: %s): it stays "
                   "where the kernel puts it",
                   node, strerror(errno));
    else
        h->numa_node = node;
    numa_free_nodemask(bm);
}

/* After locking, every page exists: check a sample of them against the preferred node,
 * since a node short of free memory gives pages from elsewhere. Pages not present (a
 * sanitizer's mlock does not fault them in) say nothing and are left out. */
static void check_placement(struct host *h, const struct span *sp)
{
    void *pages[PLACE_SAMPLES];
    int status[PLACE_SAMPLES];
    size_t npages = sp->len / ZINF_ALIGN;
    unsigned n = (unsigned)MIN((size_t)PLACE_SAMPLES, npages), present = 0, here = 0;
    int other = -1;

    for (unsigned i = 0; i < n; i++)
        pages[i] = sp->p + (npages * i / n) * ZINF_ALIGN;
    if (move_pages(0, n, pages, NULL, status, 0) != 0) return;
    for (unsigned i = 0; i < n; i++) {
        if (status[i] < 0) continue;
        present++;
        if (status[i] == h->numa_node)
            here++;
        else if (other == -1 || other == status[i])
            other = status[i];
        else
            other = -2; /* on more than one other node */
    }
    if (here == present) return;
    log_notice("only %u of %u sampled host arena pages are on NUMA node %d (the node is "
               "short of free memory)",
               here, present, h->numa_node);
    /* All elsewhere, on one node: that is where it lives; a mix has no one node. */
    h->numa_node = here == 0 && other >= 0 ? other : -1;
}

/* Step 3. Returns 0 or -errno after one error line. */
static int lock_arena(struct span *sp)
{
    char sz[32], soft[32], hard[32];
    struct rlimit rl = {0, 0};
    int e;

    if (mlock(sp->p, sp->len) == 0) {
        sp->locked = true;
        return 0;
    }
    e = errno;
    format_size(sp->len, sz, sizeof(sz));
    if (e != ENOMEM && e != EPERM) {
        log_error("cannot lock the %s host arena in memory (mlock: %s)", sz, strerror(e));
        return -e;
    }
    getrlimit(RLIMIT_MEMLOCK, &rl);
    log_error("cannot lock the %s host arena in memory (mlock: %s): RLIMIT_MEMLOCK is %s "
              "(hard limit %s); raise it with 'ulimit -l unlimited' (in a container: "
              "--ulimit memlock=-1) or a 'memlock' line in /etc/security/limits.conf, or "
              "set \"pin_memory\": false to run unpinned",
              sz, strerror(e), limit_str(rl.rlim_cur, soft, sizeof(soft)),
              limit_str(rl.rlim_max, hard, sizeof(hard)));
    return -EPERM; /* its own error: the limit, not the tier, is too small */
}

/* Step 4: only a CUDA device tier page-locks for the driver. */
static void cuda_register(struct host *h, struct span *sp)
{
    struct device_stats ds;
    int r;

    device_get_stats(h->dev, &ds);
    if (!ds.cuda) return;
    r = device_host_register(h->dev, sp->p, sp->len);
    if (r == 0)
        sp->cuda_registered = true;
    else
        log_warn("cudaHostRegister of the host arena failed (%s): host<->device copies "
                 "will be slower",
                 strerror(-r));
}

/* Step 5. -ENOTSUP (a backend without fixed buffers) is expected and left to stats. */
static void io_register(struct host *h, struct span *sp)
{
    int r = uring_buf_register(h->io, sp->p, sp->len);

    if (r >= 0)
        sp->io_region = r;
    else if (r != -ENOTSUP)
        log_notice("cannot register the host arena as io_uring fixed buffers (%s): IO "
                   "runs without them",
                   strerror(-r));
}

/* Whether to say that the tier runs unpinned (host.h): where pinning was expected and
 * not chosen away, once a process, however many engines it opens (the Python package opens
 * one per Engine, a resumed run one per saved rank it reads). */
static bool say_unpinned(const struct host *h, const struct host_opts *o)
{
    static atomic_flag said = ATOMIC_FLAG_INIT;
    struct device_stats ds;

    if (o->pin || o->quiet || o->pin_chosen) return false;
    if (h->dev) {
        device_get_stats(h->dev, &ds);
        if (!ds.cuda) return false; /* emulated: no GPU copies from it */
    }
    return !atomic_flag_test_and_set(&said);
}

int host_open(const struct host_opts *o, struct host **out)
{
    struct host *h;
    size_t cap, stg;
    int ret;

    if (!out) return -EINVAL;
    *out = NULL;
    if (!o || o->numa_node < -1) return -EINVAL;
    cap = o->capacity_bytes ? o->capacity_bytes : GiB;
    stg = o->staging_bytes;
    if (cap > SIZE_MAX / 2 || stg > SIZE_MAX / 2) return -EINVAL;
    cap = align_up(cap, ZINF_ALIGN);
    stg = align_up(stg, ZINF_ALIGN);

    h = calloc(1, sizeof(*h));
    if (!h) return -ENOMEM;
    h->io = o->io;
    h->dev = o->dev;
    h->capacity_bytes = cap;
    h->staging_bytes = stg;
    h->total_bytes = cap + stg;
    h->numa_node = -1;
    h->span[0].io_region = h->span[1].io_region = -1;
    h->fd = -1;
    pthread_mutex_init(&h->lock, NULL);
    ret = extent_init(&h->ext, cap, ZINF_ALIGN);
    if (ret) goto err;

    /* The spans: the whole tier, or a shared budget and a private staging area. */
    bool apart = o->shared && stg > 0;
    h->nspans = apart ? 2 : 1;
    h->span[0].len = apart ? cap : h->total_bytes;
    h->span[1].len = apart ? stg : 0;
    for (unsigned i = 0; i < h->nspans; i++) {
        struct span *sp = &h->span[i];
        sp->p = o->shared && i == 0
                    ? hugemem_map_shared(sp->len, !o->no_huge_pages, "zinf-host", &sp->huge, &h->fd, &ret)
                    : hugemem_map(sp->len, !o->no_huge_pages, &sp->huge, &ret);
        if (!sp->p) {
            char sz[32];
            log_error("cannot map the %s host %s: %s", format_size(sp->len, sz, sizeof(sz)),
                      i ? "staging area" : "arena", strerror(-ret));
            goto err;
        }
    }
    h->base = h->span[0].p;
    h->staging = apart ? h->span[1].p : h->base + cap;
    for (unsigned i = 0; i < h->nspans && o->numa_node >= 0; i++)
        place(h, &h->span[i], o->numa_node);

    if (o->pin) {
        for (unsigned i = 0; i < h->nspans; i++) {
            ret = lock_arena(&h->span[i]);
            if (ret) goto err;
            if (h->numa_node >= 0) check_placement(h, &h->span[i]);
            if (h->dev) cuda_register(h, &h->span[i]);
        }
    } else if (say_unpinned(h, o)) {
        log_notice("the host tier runs unpinned (pin_memory is false, its default): its memory "
                   "is not locked, so transfers are slower and pages may be swapped out; "
                   "pin_memory true pins it, false runs unpinned without this notice");
    }
    for (unsigned i = 0; i < h->nspans && h->io; i++)
        io_register(h, &h->span[i]);
    *out = h;
    return 0;

err:
    host_close(h);
    return ret;
}

void host_close(struct host *h)
{
    if (!h) return;
    for (unsigned i = 2; i-- > 0;) {
        struct span *sp = &h->span[i];
        if (sp->io_region >= 0) uring_buf_unregister(h->io, sp->io_region);
        if (sp->cuda_registered) device_host_unregister(h->dev, sp->p);
        if (sp->locked) munlock(sp->p, sp->len);
        hugemem_unmap(sp->p, sp->len);
    }
    if (h->fd >= 0) close(h->fd);
    extent_fini(&h->ext);
    pthread_mutex_destroy(&h->lock);
    free(h);
}

int host_alloc(struct host *h, size_t bytes, uint64_t *off)
{
    int ret;

    if (!h || !off || bytes == 0) return -EINVAL;
    pthread_mutex_lock(&h->lock);
    ret = extent_alloc_under(&h->ext, bytes, h->next_fit, h->mark, off);
    if (ret == 0) {
        h->next_fit = *off + bytes;
        if (h->next_fit > h->mark) h->mark = h->next_fit;
    }
    pthread_mutex_unlock(&h->lock);
    return ret;
}

int host_free(struct host *h, uint64_t off)
{
    int ret;

    if (!h) return -EINVAL;
    pthread_mutex_lock(&h->lock);
    ret = extent_free(&h->ext, off);
    pthread_mutex_unlock(&h->lock);
    return ret;
}

void host_alloc_rewind(struct host *h)
{
    if (!h) return;
    pthread_mutex_lock(&h->lock);
    h->next_fit = 0;
    pthread_mutex_unlock(&h->lock);
}

void *host_ptr(struct host *h, uint64_t off)
{
    if (!h || off >= h->capacity_bytes) return NULL;
    return h->base + off;
}

void *host_staging(struct host *h)
{
    if (!h || !h->staging_bytes) return NULL;
    return h->staging;
}

void host_get_stats(struct host *h, struct host_stats *out)
{
    struct extent_stats es;

    *out = (struct host_stats){.numa_node = -1};
    if (!h) return;
    pthread_mutex_lock(&h->lock);
    extent_get_stats(&h->ext, &es);
    pthread_mutex_unlock(&h->lock);
    out->capacity_bytes = h->capacity_bytes;
    out->used_bytes = es.used_bytes;
    out->staging_bytes = h->staging_bytes;
    /* Each says whether every span has it. */
    out->pinned = out->cuda_registered = out->io_registered = out->huge_pages = true;
    for (unsigned i = 0; i < h->nspans; i++) {
        out->pinned &= h->span[i].locked;
        out->cuda_registered &= h->span[i].cuda_registered;
        out->io_registered &= h->span[i].io_region >= 0;
        out->huge_pages &= h->span[i].huge;
    }
    out->numa_node = h->numa_node;
}

int host_shared(struct host *h, int *fd, void **base, size_t *bytes)
{
    if (!h || h->fd < 0) return -ENOTSUP;
    *fd = h->fd;
    *base = h->base;
    *bytes = h->span[0].len;
    return 0;
}
