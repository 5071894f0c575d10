/*
 * device.c - the device tier behind device.h: one arena with a best-fit sub-allocator
 * (the extent allocator at 4 KiB granularity) and asynchronous copies between the arena
 * and host memory, on CUDA or emulated in host memory.
 *
 * Both backends share the submission queue, the in-flight count that drain and close
 * wait on, the fault hook and the statistics. They differ in who moves the bytes:
 *   - emulated: one copy thread pops the queue in FIFO order, memcpy()s and runs the
 *     callback. The arena is an anonymous mapping, so pages never written cost nothing.
 *   - CUDA: an issuing thread pops the queue, takes a ticket (a copy slot with its own
 *     event) from a small pool, launches cudaMemcpyAsync on the stream of the copy's
 *     direction and records the ticket's event behind it. One completion thread per
 *     stream waits on its direction's events in issue order, gives the ticket back and
 *     runs the callback. Host->device and device->host copies overlap; each direction
 *     completes in submission order.
 * Callbacks run with no lock held, so a callback may submit more copies. No function here
 * aborts on a CUDA error: each is logged once, with the runtime's message, and passed up
 * as a negative errno.
 *
 * Not here: what the bytes mean, eviction, or ordering between a copy and a device_zero()
 * of the same range (the caller owns its ranges and orders those).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"
#include "hugemem.h"
#include "tiers/cuda_probe.h"
#include "tiers/device.h"
#include "tiers/extent.h"
#include "trace.h"

#if ZINF_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define ARENA_GRANULE_BYTES (4 * KiB)
#define EMULATED_DEFAULT_BYTES GiB
#define CUDA_HEADROOM_BYTES GiB /* left free for the trainer's own allocations */
#define CUDA_MIN_BYTES (64 * MiB)
#define CUDA_ARENA_ALIGN_BYTES (2 * MiB)
#define CUDA_TICKETS 64 /* copies launched on the GPU and not yet completed */
/* device_zero() of the emulated arena returns whole pages to the kernel (they read back
 * as zeros) instead of writing them, once the range is at least this large. */
#define ZERO_DROP_MIN_BYTES (64 * KiB)

#if ZINF_HAVE_CUDA
struct ticket {
    struct device_copy *c;
    struct ticket *next; /* free list, or the completion FIFO of its direction */
    cudaEvent_t ev;
    int res; /* nonzero: failed (or faulted) at issue, no event recorded */
};
#endif

struct device {
    bool cuda;
    int ordinal;
    char name[128];
    size_t capacity_bytes;
    char *base; /* device memory (CUDA) or an anonymous mapping */
    bool lent;  /* emulated: base is the caller's (device_opts.arena): never unmapped */
    int fd;     /* emulated and shared: the arena's memfd, else -1 */

    pthread_mutex_t lock;   /* everything below */
    pthread_cond_t work_cv; /* the queue gained a copy, or stop was set */
    pthread_cond_t idle_cv; /* inflight dropped to zero */
    bool sync_up;
    struct extent_alloc ext;
    uint64_t next_fit; /* where the next allocation starts looking (next fit) */
    uint64_t mark;     /* the end of the room ever handed out (extent_alloc_under) */
    struct device_copy *pend_head, *pend_tail;
    unsigned inflight;              /* accepted copies whose callback has not returned */
    bool closing;                   /* refuse new copies */
    bool stop;                      /* threads leave once their queues are empty */
    struct device_copy *fault_copy; /* the copy picked by device_fault_set() */
    int fault_err;
    unsigned fault_countdown;
    bool hold; /* device_hold(): the emulated copy thread starts no copy */
    uint64_t bytes_h2d, bytes_d2h, copies;

    pthread_t threads[3];
    unsigned nthreads;

#if ZINF_HAVE_CUDA
    cudaStream_t streams[2]; /* indexed by enum device_dir; NULL until created */
    cudaStream_t now;        /* device_copy_now()'s; NULL until created */
    struct ticket tickets[CUDA_TICKETS];
    unsigned nevents; /* tickets[0, nevents) hold a created event */
    struct ticket *free_tickets;
    struct ticket *done_head[2], *done_tail[2]; /* launched, per direction, issue order */
    pthread_cond_t ticket_cv;                   /* a ticket went back to the pool */
    pthread_cond_t done_cv[2];                  /* a direction's completion FIFO gained a ticket */
#endif
};

/* ---- shared by both backends ------------------------------------------------------ */

/* Takes the head of the submission queue (lock held, queue not empty) and says whether
 * device_fault_set() picked it: then *res is the injected error. */
static struct device_copy *pop_pending(struct device *d, int *res)
{
    struct device_copy *c = d->pend_head;

    d->pend_head = c->next_;
    if (!d->pend_head) d->pend_tail = NULL;
    c->next_ = NULL;
    *res = 0;
    if (c == d->fault_copy) {
        *res = d->fault_err;
        d->fault_copy = NULL;
    }
    return c;
}

/* Accounts a finished copy (lock held), before its callback can reuse the struct. Only
 * copies that moved their bytes count. */
static void count_done(struct device *d, const struct device_copy *c, int res)
{
    if (res != 0) return;
    if (c->dir == DEVICE_H2D)
        d->bytes_h2d += c->len;
    else
        d->bytes_d2h += c->len;
    d->copies++;
}

/* Runs a callback with no lock held, then retires the copy. The struct belongs to its
 * owner again once the callback starts, so it is not touched afterwards. */
static void run_callback(struct device *d, struct device_copy *c, int res)
{
    c->cb(c, res);
    pthread_mutex_lock(&d->lock);
    if (--d->inflight == 0) pthread_cond_broadcast(&d->idle_cv);
    pthread_mutex_unlock(&d->lock);
}

/* ---- emulated backend ------------------------------------------------------------- */

static void emu_zero(struct device *d, uint64_t off, size_t len);

static void *emu_copy_thread(void *arg)
{
    struct device *d = arg;
    trace_thread_name("device copy (emulated)");

    pthread_mutex_lock(&d->lock);
    for (;;) {
        while ((!d->pend_head || d->hold) && !d->stop)
            pthread_cond_wait(&d->work_cv, &d->lock);
        if (!d->pend_head) break;
        int res;
        struct device_copy *c = pop_pending(d, &res);
        pthread_mutex_unlock(&d->lock);
        if (res == 0) {
            char *dev = d->base + c->dev_off;
            if (c->zero)
                emu_zero(d, c->dev_off, c->len);
            else if (c->dir == DEVICE_H2D)
                memcpy(dev, c->host, c->len);
            else
                memcpy(c->host, dev, c->len);
        }
        pthread_mutex_lock(&d->lock);
        count_done(d, c, res);
        pthread_mutex_unlock(&d->lock);
        run_callback(d, c, res);
        pthread_mutex_lock(&d->lock);
    }
    pthread_mutex_unlock(&d->lock);
    return NULL;
}

static int emu_open(struct device *d, const struct device_opts *o)
{
    size_t cap = o->capacity_bytes ? o->capacity_bytes : EMULATED_DEFAULT_BYTES;
    void *p;

    if (cap > SIZE_MAX - ARENA_GRANULE_BYTES) {
        log_error("device: emulated arena of %zu bytes is larger than the address space", cap);
        return -ENOMEM;
    }
    cap = align_up(cap, ARENA_GRANULE_BYTES);
    if (o->arena) {
        /* Lent, and shared with whoever lent it (the ranks' communicator maps it): its
         * pages read as zeros when new, and are zeroed in place after (emu_zero). */
        if (o->shared || o->arena_bytes < cap || !is_aligned((uintptr_t)o->arena, 4 * KiB)) {
            log_error("device: the lent arena (%zu bytes) is smaller than the tier's %zu "
                      "bytes, unaligned or asked shared", o->arena_bytes, cap);
            return -EINVAL;
        }
        d->base = o->arena;
        d->lent = true;
        d->capacity_bytes = cap;
        snprintf(d->name, sizeof(d->name), "emulated");
        return 0;
    }
    /* An anonymous private mapping reads as zeros and costs nothing until written; so does
     * a memfd, which the service shares with its clients. */
    if (o->shared) {
        int fd = hugemem_memfd("zinf-device", cap, NULL);
        if (fd < 0) {
            int r = fd;
            log_error("device: cannot make a %zu-byte memfd for the emulated arena: %s", cap,
                      strerror(-r));
            return r;
        }
        p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
            close(fd);
        else
            d->fd = fd;
    } else {
        p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        /* Transparent huge pages where the kernel gives them on request: the first touch of a
         * model's state then faults 2 MiB at a time, not 4 KiB (a hint; refused, nothing
         * changes). */
        if (p != MAP_FAILED) (void)madvise(p, cap, MADV_HUGEPAGE);
    }
    if (p == MAP_FAILED) {
        int r = -errno;
        log_error("device: cannot map %zu bytes for the emulated arena: %s", cap, strerror(-r));
        return r == -EINVAL ? -ENOMEM : r;
    }
    d->base = p;
    d->capacity_bytes = cap;
    snprintf(d->name, sizeof(d->name), "emulated");
    return 0;
}

static void emu_zero(struct device *d, uint64_t off, size_t len)
{
    uint64_t end = off + len;
    /* madvise works on whole pages: only the pages that lie entirely inside the range may
     * be dropped, whatever the page size (4, 16 or 64 KiB), or a neighbour is zeroed. */
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t a = align_up((uint64_t)(uintptr_t)d->base + off, page) - (uint64_t)(uintptr_t)d->base;
    uint64_t b =
        align_down((uint64_t)(uintptr_t)d->base + end, page) - (uint64_t)(uintptr_t)d->base;

    /* MADV_DONTNEED on a private anonymous mapping drops the pages; they read back as
     * zeros and cost no memory until written again. A memfd's pages are dropped by punching
     * a hole in the file (MADV_DONTNEED would only unmap them, keeping their bytes). */
    bool dropped = false;
    /* A lent arena is another's shared mapping: MADV_REMOVE frees its pages (they read back
     * as zeros), as punching a hole does for a memfd. */
    if (b > a && b - a >= ZERO_DROP_MIN_BYTES)
        dropped = d->lent      ? madvise(d->base + a, b - a, MADV_REMOVE) == 0
                  : d->fd >= 0 ? fallocate(d->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                           (off_t)a, (off_t)(b - a)) == 0
                               : madvise(d->base + a, b - a, MADV_DONTNEED) == 0;
    if (dropped) {
        memset(d->base + off, 0, a - off);
        memset(d->base + b, 0, end - b);
        return;
    }
    memset(d->base + off, 0, len);
}

/* ---- CUDA backend ----------------------------------------------------------------- */

#if ZINF_HAVE_CUDA
/* Logs a CUDA error once, with what failed, and turns it into a negative errno. */
static int cuda_errno(cudaError_t e, const char *what)
{
    log_error("device: %s: %s", what, cudaGetErrorString(e));
    cudaGetLastError(); /* clear a non-sticky error so later calls start clean */
    switch (e) {
    case cudaErrorMemoryAllocation:
        return -ENOMEM;
    case cudaErrorInvalidValue:
        return -EINVAL;
    default:
        return -EIO;
    }
}

/* Makes the arena's GPU current on the calling thread; *prev says what to restore. Only
 * a thread whose current device differs is switched, so no other GPU gains a context. */
static int cuda_enter(struct device *d, int *prev)
{
    cudaError_t e;

    *prev = -1;
    if (cudaGetDevice(prev) != cudaSuccess) {
        cudaGetLastError();
        *prev = -1;
    }
    if (*prev == d->ordinal) return 0;
    e = cudaSetDevice(d->ordinal);
    if (e != cudaSuccess) {
        *prev = -1;
        return cuda_errno(e, "cudaSetDevice");
    }
    return 0;
}

static void cuda_leave(struct device *d, int prev)
{
    if (prev >= 0 && prev != d->ordinal) cudaSetDevice(prev);
}

/* Every thread that issues CUDA calls binds itself to the arena's GPU first. */
static void cuda_bind_thread(struct device *d)
{
    cudaError_t e = cudaSetDevice(d->ordinal);
    if (e != cudaSuccess) cuda_errno(e, "cudaSetDevice in a copy thread");
}

static void *cuda_issue_thread(void *arg)
{
    struct device *d = arg;
    trace_thread_name("cuda copy issue");

    cuda_bind_thread(d);
    pthread_mutex_lock(&d->lock);
    for (;;) {
        while (!d->pend_head && !d->stop)
            pthread_cond_wait(&d->work_cv, &d->lock);
        if (!d->pend_head) break;
        /* At most CUDA_TICKETS copies are launched and not yet completed. */
        while (!d->free_tickets)
            pthread_cond_wait(&d->ticket_cv, &d->lock);
        struct ticket *t = d->free_tickets;
        d->free_tickets = t->next;
        t->next = NULL;
        t->c = pop_pending(d, &t->res);
        pthread_mutex_unlock(&d->lock);

        struct device_copy *c = t->c;
        cudaStream_t s = d->streams[c->dir];
        if (t->res == 0) {
            char *dev = d->base + c->dev_off;
            cudaError_t e = c->zero ? cudaMemsetAsync(dev, 0, c->len, s)
                            : c->dir == DEVICE_H2D
                                ? cudaMemcpyAsync(dev, c->host, c->len, cudaMemcpyHostToDevice, s)
                                : cudaMemcpyAsync(c->host, dev, c->len, cudaMemcpyDeviceToHost, s);
            if (e != cudaSuccess) {
                t->res = cuda_errno(e, c->zero ? "cudaMemsetAsync" : "cudaMemcpyAsync");
            } else {
                /* The event completes when this copy has, and (a stream runs in order)
                 * after every copy launched before it in the same direction; the
                 * completion thread waits on it before running the callback. */
                e = cudaEventRecord(t->ev, s);
                if (e != cudaSuccess) {
                    t->res = cuda_errno(e, "cudaEventRecord");
                    /* No event to wait on: wait for the whole stream here so the copy
                     * is finished before its callback says it failed. */
                    cudaStreamSynchronize(s);
                }
            }
        }

        pthread_mutex_lock(&d->lock);
        if (d->done_tail[c->dir])
            d->done_tail[c->dir]->next = t;
        else
            d->done_head[c->dir] = t;
        d->done_tail[c->dir] = t;
        pthread_cond_signal(&d->done_cv[c->dir]);
    }
    pthread_mutex_unlock(&d->lock);
    return NULL;
}

static void cuda_complete(struct device *d, enum device_dir dir)
{
    cuda_bind_thread(d);
    pthread_mutex_lock(&d->lock);
    for (;;) {
        while (!d->done_head[dir] && !d->stop)
            pthread_cond_wait(&d->done_cv[dir], &d->lock);
        if (!d->done_head[dir]) break;
        struct ticket *t = d->done_head[dir];
        d->done_head[dir] = t->next;
        if (!d->done_head[dir]) d->done_tail[dir] = NULL;
        pthread_mutex_unlock(&d->lock);

        if (t->res == 0) {
            /* Tickets of one direction are taken in issue order, so callbacks of that
             * direction run in submission order, each after its own copy finished. */
            cudaError_t e = cudaEventSynchronize(t->ev);
            if (e != cudaSuccess) t->res = cuda_errno(e, "cudaEventSynchronize");
        }
        struct device_copy *c = t->c;
        int res = t->res;

        pthread_mutex_lock(&d->lock);
        count_done(d, c, res);
        t->c = NULL;
        t->next = d->free_tickets;
        d->free_tickets = t;
        pthread_cond_signal(&d->ticket_cv);
        pthread_mutex_unlock(&d->lock);
        run_callback(d, c, res);
        pthread_mutex_lock(&d->lock);
    }
    pthread_mutex_unlock(&d->lock);
}

static void *cuda_complete_h2d(void *arg)
{
    trace_thread_name("cuda h2d completion");
    cuda_complete(arg, DEVICE_H2D);
    return NULL;
}

static void *cuda_complete_d2h(void *arg)
{
    trace_thread_name("cuda d2h completion");
    cuda_complete(arg, DEVICE_D2H);
    return NULL;
}

static int cuda_open(struct device *d, const struct device_opts *o)
{
    struct cudaDeviceProp prop;
    size_t cap = o->capacity_bytes, free_bytes = 0, total_bytes = 0;
    void *base = NULL;
    cudaError_t e;
    int prev, r;

    d->ordinal = o->cuda_device;
    r = cuda_enter(d, &prev);
    if (r < 0) return r;
    e = cudaGetDeviceProperties(&prop, d->ordinal);
    if (e != cudaSuccess) {
        r = cuda_errno(e, "cudaGetDeviceProperties");
        goto out;
    }
    snprintf(d->name, sizeof(d->name), "%.*s", (int)sizeof(d->name) - 1, prop.name);
    if (cap == 0) {
        e = cudaMemGetInfo(&free_bytes, &total_bytes);
        if (e != cudaSuccess) {
            r = cuda_errno(e, "cudaMemGetInfo");
            goto out;
        }
        cap = free_bytes > CUDA_HEADROOM_BYTES + CUDA_MIN_BYTES
                  ? align_down(free_bytes - CUDA_HEADROOM_BYTES, CUDA_ARENA_ALIGN_BYTES)
                  : CUDA_MIN_BYTES;
    } else if (cap > SIZE_MAX - ARENA_GRANULE_BYTES) {
        log_error("device: a CUDA arena of %zu bytes cannot exist", cap);
        r = -ENOMEM;
        goto out;
    } else {
        cap = align_up(cap, ARENA_GRANULE_BYTES);
    }
    e = cudaMalloc(&base, cap);
    if (e != cudaSuccess) {
        r = cuda_errno(e, "cudaMalloc of the arena");
        goto out;
    }
    d->base = base;
    d->capacity_bytes = cap;
    for (int i = 0; i < 3; i++) {
        cudaStream_t *s = i < 2 ? &d->streams[i] : &d->now;
        e = cudaStreamCreateWithFlags(s, cudaStreamNonBlocking);
        if (e != cudaSuccess) {
            *s = NULL;
            r = cuda_errno(e, "cudaStreamCreateWithFlags");
            goto out;
        }
    }
    /* BlockingSync: a completion thread sleeps in cudaEventSynchronize instead of
     * spinning a core for as long as a copy runs. */
    for (unsigned i = 0; i < CUDA_TICKETS; i++) {
        struct ticket *t = &d->tickets[i];
        e = cudaEventCreateWithFlags(&t->ev, cudaEventDisableTiming | cudaEventBlockingSync);
        if (e != cudaSuccess) {
            r = cuda_errno(e, "cudaEventCreateWithFlags");
            goto out;
        }
        d->nevents++;
        t->next = d->free_tickets;
        d->free_tickets = t;
    }
    r = 0;
out:
    cuda_leave(d, prev);
    return r;
}

/* Frees what cuda_open() made, whatever it got to. Threads have stopped. */
static void cuda_teardown(struct device *d)
{
    int prev;

    if (!d->base && !d->nevents && !d->streams[0] && !d->streams[1] && !d->now) return;
    if (cuda_enter(d, &prev) < 0)
        return; /* the GPU is gone; the process is losing its context anyway */
    for (unsigned i = 0; i < d->nevents; i++)
        cudaEventDestroy(d->tickets[i].ev);
    for (int i = 0; i < 2; i++)
        if (d->streams[i]) cudaStreamDestroy(d->streams[i]);
    if (d->now) cudaStreamDestroy(d->now);
    if (d->base) cudaFree(d->base);
    d->base = NULL;
    cuda_leave(d, prev);
}

static int cuda_zero(struct device *d, uint64_t off, size_t len)
{
    cudaError_t e;
    int prev, r = cuda_enter(d, &prev);

    if (r < 0) return r;
    /* On the host->device stream, the zeros land after every copy into the arena launched
     * before this call; synchronizing that stream makes the call synchronous. */
    e = cudaMemsetAsync(d->base + off, 0, len, d->streams[DEVICE_H2D]);
    if (e != cudaSuccess)
        r = cuda_errno(e, "cudaMemsetAsync");
    else if ((e = cudaStreamSynchronize(d->streams[DEVICE_H2D])) != cudaSuccess)
        r = cuda_errno(e, "cudaStreamSynchronize after cudaMemsetAsync");
    cuda_leave(d, prev);
    return r;
}

static int cuda_copy_now(struct device *d, enum device_dir dir, uint64_t off, void *host,
                         size_t len)
{
    cudaError_t e;
    int prev, r = cuda_enter(d, &prev);

    if (r < 0) return r;
    char *dev = d->base + off;
    e = dir == DEVICE_H2D ? cudaMemcpyAsync(dev, host, len, cudaMemcpyHostToDevice, d->now)
                          : cudaMemcpyAsync(host, dev, len, cudaMemcpyDeviceToHost, d->now);
    if (e != cudaSuccess)
        r = cuda_errno(e, "cudaMemcpyAsync");
    else if ((e = cudaStreamSynchronize(d->now)) != cudaSuccess)
        r = cuda_errno(e, "cudaStreamSynchronize after cudaMemcpyAsync");
    cuda_leave(d, prev);
    return r;
}
#endif /* ZINF_HAVE_CUDA */

/* ---- open and close --------------------------------------------------------------- */

static int start_thread(struct device *d, void *(*fn)(void *))
{
    int r = pthread_create(&d->threads[d->nthreads], NULL, fn, d);
    if (r != 0) {
        log_error("device: cannot start a copy thread: %s", strerror(r));
        return -r;
    }
    pthread_setname_np(d->threads[d->nthreads], "zinf-copy");
    d->nthreads++;
    return 0;
}

/* Decides the backend: *cuda says whether to open CUDA. -ENODEV when CUDA was asked for
 * and is not usable. */
static int pick_backend(const struct device_opts *o, bool *cuda)
{
    struct cuda_probe_info info;
    int n;

    *cuda = false;
    if (o->kind == ZINF_DEVICE_EMULATED) return 0;
    n = cuda_probe(&info);
    if (n <= 0) {
        if (o->kind == ZINF_DEVICE_AUTO) return 0;
        log_error("device: CUDA was requested but no GPU is usable: %s", info.reason);
        return -ENODEV;
    }
    /* With GPUs present an out-of-range ordinal is a mistake, not a reason to emulate. */
    if (o->cuda_device < 0 || o->cuda_device >= n) {
        log_error("device: CUDA device %d requested but only %d present", o->cuda_device, n);
        return -ENODEV;
    }
    *cuda = true;
    return 0;
}

int device_open(const struct device_opts *o, struct device **out)
{
    struct device *d;
    bool cuda;
    int r;

    if (!o || !out) return -EINVAL;
    *out = NULL;
    if (o->kind != ZINF_DEVICE_AUTO && o->kind != ZINF_DEVICE_CUDA &&
        o->kind != ZINF_DEVICE_EMULATED)
        return -EINVAL;
    r = pick_backend(o, &cuda);
    if (r < 0) return r;
#if !ZINF_HAVE_CUDA
    cuda = false; /* cuda_probe() reports no device in a build without CUDA */
#endif
    d = calloc(1, sizeof(*d));
    if (!d) return -ENOMEM;
    d->cuda = cuda;
    d->fd = -1;
    if (pthread_mutex_init(&d->lock, NULL) || pthread_cond_init(&d->work_cv, NULL) ||
        pthread_cond_init(&d->idle_cv, NULL)
#if ZINF_HAVE_CUDA
        || pthread_cond_init(&d->ticket_cv, NULL) || pthread_cond_init(&d->done_cv[0], NULL) ||
        pthread_cond_init(&d->done_cv[1], NULL)
#endif
    ) {
        r = -ENOMEM;
        goto err;
    }
    d->sync_up = true;

#if ZINF_HAVE_CUDA
    if (cuda)
        r = cuda_open(d, o);
    else
#endif
        r = emu_open(d, o);
    if (r < 0) goto err;
    r = extent_init(&d->ext, d->capacity_bytes, ARENA_GRANULE_BYTES);
    if (r < 0) goto err;

#if ZINF_HAVE_CUDA
    if (cuda) {
        if ((r = start_thread(d, cuda_issue_thread)) < 0 ||
            (r = start_thread(d, cuda_complete_h2d)) < 0 ||
            (r = start_thread(d, cuda_complete_d2h)) < 0)
            goto err;
    } else
#endif
    {
        if ((r = start_thread(d, emu_copy_thread)) < 0) goto err;
    }
    log_debug("device: %s arena of %zu bytes", d->name, d->capacity_bytes);
    *out = d;
    return 0;
err:
    device_close(d);
    return r;
}

void device_close(struct device *d)
{
    if (!d) return;
    if (d->sync_up) {
        pthread_mutex_lock(&d->lock);
        d->closing = true;
        while (d->inflight)
            pthread_cond_wait(&d->idle_cv, &d->lock);
        d->stop = true;
        pthread_cond_broadcast(&d->work_cv);
#if ZINF_HAVE_CUDA
        pthread_cond_broadcast(&d->done_cv[0]);
        pthread_cond_broadcast(&d->done_cv[1]);
#endif
        pthread_mutex_unlock(&d->lock);
    }
    for (unsigned i = 0; i < d->nthreads; i++)
        pthread_join(d->threads[i], NULL);
#if ZINF_HAVE_CUDA
    if (d->cuda) cuda_teardown(d);
#endif
    if (!d->cuda && d->base && !d->lent) munmap(d->base, d->capacity_bytes);
    if (d->fd >= 0) close(d->fd);
    extent_fini(&d->ext);
    if (d->sync_up) {
#if ZINF_HAVE_CUDA
        pthread_cond_destroy(&d->done_cv[1]);
        pthread_cond_destroy(&d->done_cv[0]);
        pthread_cond_destroy(&d->ticket_cv);
#endif
        pthread_cond_destroy(&d->idle_cv);
        pthread_cond_destroy(&d->work_cv);
        pthread_mutex_destroy(&d->lock);
    }
    free(d);
}

/* ---- arena ------------------------------------------------------------------------ */

int device_alloc(struct device *d, size_t bytes, uint64_t *off)
{
    int r;

    if (!d || !off || bytes == 0) return -EINVAL;
    pthread_mutex_lock(&d->lock);
    r = extent_alloc_under(&d->ext, bytes, d->next_fit, d->mark, off);
    if (r == 0) {
        d->next_fit = *off + bytes;
        if (d->next_fit > d->mark) d->mark = d->next_fit;
    }
    pthread_mutex_unlock(&d->lock);
    return r;
}

void device_alloc_rewind(struct device *d)
{
    if (!d) return;
    pthread_mutex_lock(&d->lock);
    d->next_fit = 0;
    pthread_mutex_unlock(&d->lock);
}

int device_free(struct device *d, uint64_t off)
{
    int r;

    if (!d) return -EINVAL;
    pthread_mutex_lock(&d->lock);
    r = extent_free(&d->ext, off);
    pthread_mutex_unlock(&d->lock);
    return r;
}

void *device_ptr(struct device *d, uint64_t off)
{
    if (!d || off >= d->capacity_bytes) return NULL;
    return d->base + off;
}

static bool range_ok(const struct device *d, uint64_t off, size_t len)
{
    return len > 0 && off < d->capacity_bytes && len <= d->capacity_bytes - off;
}

/* ---- copies ----------------------------------------------------------------------- */

int device_copy_async(struct device *d, struct device_copy *c)
{
    if (!d || !c || (!c->host && !c->zero) || !c->cb ||
        (c->dir != DEVICE_H2D && c->dir != DEVICE_D2H) || (c->zero && c->dir != DEVICE_H2D) ||
        !range_ok(d, c->dev_off, c->len))
        return -EINVAL;
    pthread_mutex_lock(&d->lock);
    if (d->closing) {
        pthread_mutex_unlock(&d->lock);
        return -ESHUTDOWN;
    }
    c->next_ = NULL;
    if (d->fault_countdown && --d->fault_countdown == 0) d->fault_copy = c;
    if (d->pend_tail)
        d->pend_tail->next_ = c;
    else
        d->pend_head = c;
    d->pend_tail = c;
    d->inflight++;
    pthread_cond_signal(&d->work_cv);
    pthread_mutex_unlock(&d->lock);
    return 0;
}

static void sync_cb(struct device_copy *c, int res)
{
    completion_post(c->data, res);
}

int device_copy_sync(struct device *d, enum device_dir dir, uint64_t dev_off, void *host,
                     size_t len)
{
    struct completion w = COMPLETION_INIT;
    struct device_copy c = {
        .dir = dir, .dev_off = dev_off, .host = host, .len = len, .cb = sync_cb, .data = &w};
    int r = device_copy_async(d, &c);

    if (r < 0) return r;
    return completion_wait(&w);
}

int device_copy_now(struct device *d, enum device_dir dir, uint64_t dev_off, void *host,
                    size_t len)
{
    if (!d || !host || (dir != DEVICE_H2D && dir != DEVICE_D2H) || !range_ok(d, dev_off, len))
        return -EINVAL;
    int r = 0;
    bool cuda = d->cuda;
#if ZINF_HAVE_CUDA
    if (cuda) r = cuda_copy_now(d, dir, dev_off, host, len);
#endif
    if (!cuda && dir == DEVICE_H2D) memcpy(d->base + dev_off, host, len);
    if (!cuda && dir == DEVICE_D2H) memcpy(host, d->base + dev_off, len);
    return r;
}

int device_zero(struct device *d, uint64_t off, size_t len)
{
    if (!d || !range_ok(d, off, len)) return -EINVAL;
#if ZINF_HAVE_CUDA
    if (d->cuda) return cuda_zero(d, off, len);
#endif
    emu_zero(d, off, len);
    return 0;
}

void device_drain(struct device *d)
{
    if (!d) return;
    pthread_mutex_lock(&d->lock);
    while (d->inflight)
        pthread_cond_wait(&d->idle_cv, &d->lock);
    pthread_mutex_unlock(&d->lock);
}

/* ---- host memory, statistics, faults ---------------------------------------------- */

int device_host_register(struct device *d, void *p, size_t len)
{
    if (!d || !p || len == 0) return -EINVAL;
#if ZINF_HAVE_CUDA
    if (d->cuda) {
        int prev, r = cuda_enter(d, &prev);
        if (r < 0) return r;
        cudaError_t e = cudaHostRegister(p, len, cudaHostRegisterDefault);
        if (e == cudaErrorHostMemoryAlreadyRegistered)
            cudaGetLastError(); /* already page-locked: what the caller wanted */
        else if (e != cudaSuccess)
            r = cuda_errno(e, "cudaHostRegister");
        cuda_leave(d, prev);
        return r;
    }
#endif
    return 0;
}

int device_host_unregister(struct device *d, void *p)
{
    if (!d || !p) return -EINVAL;
#if ZINF_HAVE_CUDA
    if (d->cuda) {
        int prev, r = cuda_enter(d, &prev);
        if (r < 0) return r;
        cudaError_t e = cudaHostUnregister(p);
        if (e == cudaErrorHostMemoryNotRegistered) {
            cudaGetLastError(); /* the caller's mistake, answered like a bad free */
            r = -EINVAL;
        } else if (e != cudaSuccess) {
            r = cuda_errno(e, "cudaHostUnregister");
        }
        cuda_leave(d, prev);
        return r;
    }
#endif
    return 0;
}

void device_get_stats(struct device *d, struct device_stats *out)
{
    struct extent_stats es;

    *out = (struct device_stats){0};
    if (!d) return;
    out->cuda = d->cuda;
    snprintf(out->name, sizeof(out->name), "%s", d->name);
    out->capacity_bytes = d->capacity_bytes;
    pthread_mutex_lock(&d->lock);
    extent_get_stats(&d->ext, &es);
    out->used_bytes = es.used_bytes;
    out->bytes_h2d = d->bytes_h2d;
    out->bytes_d2h = d->bytes_d2h;
    out->copies = d->copies;
    pthread_mutex_unlock(&d->lock);
}

void device_hold(struct device *d, bool hold)
{
    if (!d) return;
    pthread_mutex_lock(&d->lock);
    d->hold = hold;
    pthread_cond_broadcast(&d->work_cv);
    pthread_mutex_unlock(&d->lock);
}

void device_fault_set(struct device *d, unsigned nth, int err)
{
    if (!d) return;
    pthread_mutex_lock(&d->lock);
    /* nth counts device_copy_async() calls from now: 1 is the next copy. nth 0 or err 0
     * disarms, including a copy already picked and not yet started. */
    d->fault_countdown = err ? nth : 0;
    d->fault_err = err;
    d->fault_copy = NULL;
    pthread_mutex_unlock(&d->lock);
}

int device_shared(struct device *d, int *fd, void **base, size_t *bytes)
{
    if (!d || d->fd < 0) return -ENOTSUP;
    *fd = d->fd;
    *base = d->base;
    *bytes = d->capacity_bytes;
    return 0;
}

int device_ipc_export(struct device *d, void *handle, char *busid, void **base, size_t *bytes)
{
#if ZINF_HAVE_CUDA
    if (!d || !d->cuda) return -ENOTSUP;
    int prev, r = cuda_enter(d, &prev);
    if (r < 0) return r;
    cudaIpcMemHandle_t h;
    _Static_assert(sizeof(h) == DEVICE_IPC_HANDLE_BYTES, "the size of a CUDA IPC handle");
    cudaError_t e = cudaIpcGetMemHandle(&h, d->base);
    if (e != cudaSuccess)
        r = cuda_errno(e, "cudaIpcGetMemHandle of the arena");
    else if ((e = cudaDeviceGetPCIBusId(busid, DEVICE_BUSID_BYTES, d->ordinal)) != cudaSuccess)
        r = cuda_errno(e, "cudaDeviceGetPCIBusId");
    cuda_leave(d, prev);
    if (r < 0) return r;
    memcpy(handle, &h, sizeof(h));
    *base = d->base;
    *bytes = d->capacity_bytes;
    return 0;
#else
    (void)d, (void)handle, (void)busid, (void)base, (void)bytes;
    return -ENOTSUP;
#endif
}

int device_ipc_open(const void *handle, const char *busid, void **base)
{
#if ZINF_HAVE_CUDA
    int dev, prev;
    cudaError_t e = cudaDeviceGetByPCIBusId(&dev, busid);
    if (e != cudaSuccess) return cuda_errno(e, "cudaDeviceGetByPCIBusId of the daemon's GPU");
    if ((e = cudaGetDevice(&prev)) != cudaSuccess) return cuda_errno(e, "cudaGetDevice");
    if (dev != prev && (e = cudaSetDevice(dev)) != cudaSuccess)
        return cuda_errno(e, "cudaSetDevice");
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof(h));
    void *p = NULL;
    e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (dev != prev) cudaSetDevice(prev);
    if (e != cudaSuccess) return cuda_errno(e, "cudaIpcOpenMemHandle of the daemon's arena");
    *base = p;
    return 0;
#else
    (void)handle, (void)busid, (void)base;
    return -ENOTSUP;
#endif
}

void device_ipc_close(void *base)
{
#if ZINF_HAVE_CUDA
    if (base) cudaIpcCloseMemHandle(base);
#else
    (void)base;
#endif
}
