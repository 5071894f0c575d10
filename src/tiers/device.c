/*
 * device.c - the device tier behind device.h: one arena with a best-fit sub-allocator
 * (the extent allocator at 4 KiB granularity) and asynchronous copies between the arena
 * and host memory, on CUDA or emulated in host memory.
 *
 * Both backends share the submission queue, the in-flight count that drain and close
 * wait on, the fault hook and the statistics. They differ in who moves the bytes:
 *   - emulated (here): one copy thread pops the queue in FIFO order, memcpy()s and runs
 *     the callback. The arena is an anonymous mapping, so pages never written cost nothing.
 *   - CUDA (device_cuda.c): an issuing thread launches each copy on the stream of its
 *     direction behind an event; a completion thread per direction waits on the events in
 *     issue order and runs the callbacks.
 * Callbacks run with no lock held, so a callback may submit more copies.
 *
 * Not here: the CUDA backend, host memory registration and CUDA IPC (device_cuda.c); what
 * the bytes mean, eviction, or ordering between a copy and a device_zero() of the same
 * range (the caller owns its ranges and orders those).
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
#include "tiers/device_int.h"
#include "tiers/extent.h"
#include "trace.h"

#define EMULATED_DEFAULT_BYTES GiB
/* device_zero() of the emulated arena returns whole pages to the kernel (they read back
 * as zeros) instead of writing them, once the range is at least this large. */
#define ZERO_DROP_MIN_BYTES (64 * KiB)

/* ---- shared by both backends ------------------------------------------------------ */

/* Takes the head of the submission queue (lock held, queue not empty) and says whether
 * device_fault_set() picked it: then *res is the injected error. */
struct device_copy *device_pop_pending(struct device *d, int *res)
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
void device_count_done(struct device *d, const struct device_copy *c, int res)
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
void device_run_callback(struct device *d, struct device_copy *c, int res)
{
    c->cb(c, res);
    pthread_mutex_lock(&d->lock);
    if (--d->inflight == 0) pthread_cond_broadcast(&d->idle_cv);
    pthread_mutex_unlock(&d->lock);
}

/* ---- lent arenas ------------------------------------------------------------------ */

/* The tiers of this process that run on a lent arena. An arena backs one tier at a time:
 * two would each allocate from its start and load their tensors over each other's, the
 * second reading the first's writes as its own, with nothing said. */
static pthread_mutex_t lent_lock = PTHREAD_MUTEX_INITIALIZER;
static struct device *lent_head; /* linked by lent_next */

/* Take [base, base + bytes) for d, or -EBUSY where another open tier runs on any of it. */
static int lent_take(struct device *d, char *base, size_t bytes)
{
    int r = 0;
    pthread_mutex_lock(&lent_lock);
    for (struct device *o = lent_head; o && r == 0; o = o->lent_next)
        if (base < o->base + o->capacity_bytes && o->base < base + bytes) {
            log_error("device: the lent arena at %p (%zu bytes) overlaps the one at %p (%zu "
                      "bytes) that another open engine's device tier runs on: an arena is lent "
                      "to one engine at a time",
                      (void *)base, bytes, (void *)o->base, o->capacity_bytes);
            r = -EBUSY;
        }
    if (r == 0) {
        d->base = base;
        d->capacity_bytes = bytes;
        d->lent = true;
        d->lent_next = lent_head;
        lent_head = d;
    }
    pthread_mutex_unlock(&lent_lock);
    return r;
}

static void lent_give_back(struct device *d)
{
    pthread_mutex_lock(&lent_lock);
    for (struct device **at = &lent_head; *at; at = &(*at)->lent_next)
        if (*at == d) {
            *at = d->lent_next;
            break;
        }
    pthread_mutex_unlock(&lent_lock);
    d->lent = false;
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
        struct device_copy *c = device_pop_pending(d, &res);
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
        device_count_done(d, c, res);
        pthread_mutex_unlock(&d->lock);
        device_run_callback(d, c, res);
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
        int r = lent_take(d, o->arena, cap);
        if (r == 0) snprintf(d->name, sizeof(d->name), "emulated");
        return r;
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
        r = device_cuda_open(d, o);
    else
#endif
        r = emu_open(d, o);
    if (r < 0) goto err;
    r = extent_init(&d->ext, d->capacity_bytes, ARENA_GRANULE_BYTES);
    if (r < 0) goto err;

#if ZINF_HAVE_CUDA
    if (cuda) {
        if ((r = start_thread(d, device_cuda_issue_thread)) < 0 ||
            (r = start_thread(d, device_cuda_complete_h2d)) < 0 ||
            (r = start_thread(d, device_cuda_complete_d2h)) < 0)
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
    if (d->cuda) device_cuda_teardown(d);
#endif
    if (!d->cuda && d->base && !d->lent) munmap(d->base, d->capacity_bytes);
    if (d->lent) lent_give_back(d);
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
    if (cuda) r = device_cuda_copy_now(d, dir, dev_off, host, len);
#endif
    if (!cuda && dir == DEVICE_H2D) memcpy(d->base + dev_off, host, len);
    if (!cuda && dir == DEVICE_D2H) memcpy(host, d->base + dev_off, len);
    return r;
}

int device_zero(struct device *d, uint64_t off, size_t len)
{
    if (!d || !range_ok(d, off, len)) return -EINVAL;
#if ZINF_HAVE_CUDA
    if (d->cuda) return device_cuda_zero(d, off, len);
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

/* ---- statistics, faults, the shared arena ----------------------------------------- */

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
