/*
 * device_int.h - what the device tier's two files share (device.c: the arena, the queue,
 * the emulated backend; device_cuda.c: the CUDA backend): the tier's objects and the few
 * functions one calls in the other. Not for anything outside src/tiers/: device.h is the
 * tier's interface.
 */
#ifndef ZINF_TIERS_DEVICE_INT_H
#define ZINF_TIERS_DEVICE_INT_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "tiers/device.h"
#include "tiers/extent.h"

#if ZINF_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define ARENA_GRANULE_BYTES (4 * KiB)
#define CUDA_TICKETS 64 /* copies launched on the GPU and not yet completed */

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
    struct device *lent_next; /* lent: the process's other tiers on lent arenas (device.c) */
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
/* device.c, shared by both backends (see there); the lock is held by the first two. */
struct device_copy *device_pop_pending(struct device *d, int *res);
void device_count_done(struct device *d, const struct device_copy *c, int res);
void device_run_callback(struct device *d, struct device_copy *c, int res);

#if ZINF_HAVE_CUDA
/* device_cuda.c: the CUDA backend, called by device.c where d->cuda. */
int device_cuda_open(struct device *d, const struct device_opts *o);
void device_cuda_teardown(struct device *d);
void *device_cuda_issue_thread(void *arg);
void *device_cuda_complete_h2d(void *arg);
void *device_cuda_complete_d2h(void *arg);
int device_cuda_zero(struct device *d, uint64_t off, size_t len);
int device_cuda_copy_now(struct device *d, enum device_dir dir, uint64_t off, void *host,
                         size_t len);
#endif

#endif
