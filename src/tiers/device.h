/*
 * device.h - the device tier: one arena of device memory with a sub-allocator, and
 * asynchronous copies between it and host memory.
 *
 * Two backends behind one interface:
 *   - CUDA: one cudaMalloc arena; separate host->device and device->host copy streams;
 *     an issuing thread launches cudaMemcpyAsync and records an event per copy, a
 *     completion thread waits on the events in order and runs the callbacks.
 *   - emulated: ordinary host memory with its own capacity and a copy thread, so copies
 *     are asynchronous exactly as on a GPU and the engine's pipeline is the same code.
 * ZINF_DEVICE_AUTO picks CUDA only when the runtime reports a usable device; a machine
 * with the toolkit but no driver gets the emulated tier, never a crash.
 *
 * Not here: eviction, residency, or what the bytes mean (the engine's job).
 */
#ifndef ZINF_TIERS_DEVICE_H
#define ZINF_TIERS_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "zinf.h"

struct device;

struct device_opts {
    enum zinf_device_kind kind; /* AUTO, CUDA or EMULATED */
    int cuda_device;            /* ordinal when CUDA is used */
    size_t capacity_bytes;      /* 0: emulated 1 GiB; CUDA: free memory less 1 GiB headroom */
    bool shared;                /* emulated: the arena is a memfd another process may map */
    void *arena;                /* emulated: the caller's memory as the arena (4 KiB-aligned,
                                   arena_bytes of it, at least the capacity rounded up to
                                   4 KiB), which it keeps and unmaps; NULL: a mapping of the
                                   tier's own. Not with shared. */
    size_t arena_bytes;
};

enum device_dir { DEVICE_H2D, DEVICE_D2H };

struct device_copy;
typedef void (*device_copy_cb)(struct device_copy *c, int res);

/* One asynchronous copy. The caller owns it until its callback has run; when
 * device_copy_async() fails the callback never runs. */
struct device_copy {
    enum device_dir dir;
    uint64_t dev_off;           /* offset in the device arena */
    void *host;                 /* host memory (pinned for full speed with CUDA) */
    size_t len;
    bool zero;                  /* DEVICE_H2D only: write zeros (host unused), in order
                                   with the copies into the arena queued before it */
    device_copy_cb cb;          /* runs on the device's completion thread; may call
                                   device_copy_async() and uring_submit(), never blocks */
    void *data;
    struct device_copy *next_;  /* private */
};

struct device_stats {
    bool cuda;                  /* false: emulated */
    char name[128];             /* GPU name, or "emulated" */
    size_t capacity_bytes, used_bytes;
    uint64_t bytes_h2d, bytes_d2h, copies;
};

int device_open(const struct device_opts *o, struct device **out);
/* Waits for every copy in flight (callbacks run), then frees. NULL is a no-op. */
void device_close(struct device *d);

/* Sub-allocation in the arena, 4 KiB granularity, best fit. -ENOSPC when nothing fits. */
int device_alloc(struct device *d, size_t bytes, uint64_t *off);
int device_free(struct device *d, uint64_t off);
/* device_alloc() is next fit; the next one looks from the arena's start. */
void device_alloc_rewind(struct device *d);
/* The pointer for an arena offset: device memory with CUDA, host memory when emulated. */
void *device_ptr(struct device *d, uint64_t off);
/* An emulated arena opened shared: its memfd (owned by the tier), base and size in bytes.
 * -ENOTSUP otherwise (a CUDA arena is shared through CUDA IPC, not a memfd). */
int device_shared(struct device *d, int *fd, void **base, size_t *bytes);
/* A CUDA arena as another process opens it: its CUDA IPC handle (DEVICE_IPC_HANDLE_BYTES),
 * the PCI bus id of its GPU, its base and size. -ENOTSUP for an emulated arena (or a build
 * without CUDA). */
#define DEVICE_IPC_HANDLE_BYTES 64
#define DEVICE_BUSID_BYTES 32
int device_ipc_export(struct device *d, void *handle, char *busid, void **base, size_t *bytes);
/* In another process: open the arena of that handle on the GPU of that bus id (the
 * caller's current device stays as it was). 0 and *base, a device pointer; -errno. */
int device_ipc_open(const void *handle, const char *busid, void **base);
void device_ipc_close(void *base);

int device_copy_async(struct device *d, struct device_copy *c);
/* Convenience: copy and wait. */
int device_copy_sync(struct device *d, enum device_dir dir, uint64_t dev_off, void *host,
                     size_t len);
/* Copy and wait, outside the queue: on a stream of its own (CUDA) or with memcpy
 * (emulated), waiting for no other copy and for no callback, so a caller may hold a lock
 * that callbacks take. Neither held (device_hold), faulted (device_fault_set) nor counted
 * in the statistics. */
int device_copy_now(struct device *d, enum device_dir dir, uint64_t dev_off, void *host,
                    size_t len);
/* Set [off, off+len) of the arena to zero bytes; synchronous. */
int device_zero(struct device *d, uint64_t off, size_t len);
/* Wait until no copy is in flight. */
void device_drain(struct device *d);

/* Page-lock host memory for fast copies (cudaHostRegister); a no-op (0) when emulated. */
int device_host_register(struct device *d, void *p, size_t len);
int device_host_unregister(struct device *d, void *p);

void device_get_stats(struct device *d, struct device_stats *out);

/* Test-only: the nth copy from now completes with err instead of copying. */
void device_fault_set(struct device *d, unsigned nth, int err);
/* Test-only, emulated backend: while held, queued copies wait (they start, in order, when
 * released), so a test can keep a transfer in flight as long as it needs. */
void device_hold(struct device *d, bool hold);

#endif
