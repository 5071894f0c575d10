/*
 * device_cuda.c - the device tier's CUDA backend, and what device.h offers only with CUDA:
 * host memory page-locked for copies, and the arena shared through CUDA IPC.
 *
 * One cudaMalloc arena on the GPU of device_opts.cuda_device, two copy streams (one per
 * direction) and one for device_copy_now(). An issuing thread pops the tier's queue, takes
 * a ticket (a copy slot with its own event) from a small pool, launches cudaMemcpyAsync on
 * the stream of the copy's direction and records the ticket's event behind it. One
 * completion thread per stream waits on its direction's events in issue order, gives the
 * ticket back and runs the callback. Host->device and device->host copies overlap; each
 * direction completes in submission order. No function here aborts on a CUDA error: each
 * is logged once, with the runtime's message, and passed up as a negative errno.
 *
 * Not here: the queue, the in-flight count, the sub-allocator, the statistics and the
 * emulated backend (device.c). In a build without CUDA only the answers of the public
 * functions for an emulated arena remain.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "tiers/device.h"
#include "tiers/device_int.h"
#include "trace.h"

#define CUDA_HEADROOM_BYTES GiB /* left free for the trainer's own allocations */
#define CUDA_MIN_BYTES (64 * MiB)
#define CUDA_ARENA_ALIGN_BYTES (2 * MiB)

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

void *device_cuda_issue_thread(void *arg)
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
        t->c = device_pop_pending(d, &t->res);
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
        device_count_done(d, c, res);
        t->c = NULL;
        t->next = d->free_tickets;
        d->free_tickets = t;
        pthread_cond_signal(&d->ticket_cv);
        pthread_mutex_unlock(&d->lock);
        device_run_callback(d, c, res);
        pthread_mutex_lock(&d->lock);
    }
    pthread_mutex_unlock(&d->lock);
}

void *device_cuda_complete_h2d(void *arg)
{
    trace_thread_name("cuda h2d completion");
    cuda_complete(arg, DEVICE_H2D);
    return NULL;
}

void *device_cuda_complete_d2h(void *arg)
{
    trace_thread_name("cuda d2h completion");
    cuda_complete(arg, DEVICE_D2H);
    return NULL;
}

int device_cuda_open(struct device *d, const struct device_opts *o)
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

/* Frees what device_cuda_open() made, whatever it got to. Threads have stopped. */
void device_cuda_teardown(struct device *d)
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

int device_cuda_zero(struct device *d, uint64_t off, size_t len)
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

int device_cuda_copy_now(struct device *d, enum device_dir dir, uint64_t off, void *host,
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

/* ---- host memory ------------------------------------------------------------------ */

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

/* ---- the arena shared through CUDA IPC -------------------------------------------- */

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
