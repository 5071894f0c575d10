/*
 * host.h - the pinned host tier: one arena, allocated on the NUMA node chosen by topo
 * (nearest the GPU, else the NVMe drive, else the caller), locked (mlock, plus
 * cudaHostRegister through the device tier when CUDA is in use), registered once with
 * io_uring as fixed buffers, and sub-allocated (4 KiB aligned, best fit, coalescing)
 * under the host_bytes budget. A staging area for transfers that do not stay in the host
 * tier is carved from the same arena, outside the budget.
 *
 * Not here: what is cached, eviction, or the staging ring's policy (the engine's job).
 */
#ifndef ZINF_TIERS_HOST_H
#define ZINF_TIERS_HOST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct host;
struct uring;
struct device;

struct host_opts {
    size_t capacity_bytes;   /* the budget handed out by host_alloc(); 0: 1 GiB */
    size_t staging_bytes;    /* extra, for host_staging(); may be 0 */
    bool pin;                /* mlock (+ cudaHostRegister); false: unpinned (said as below) */
    bool quiet;              /* unpinned without saying so */
    bool pin_chosen;         /* pin is the user's choice (pin_memory given in the config,
                                ZINF_OPEN_NO_PIN): unpinned goes unsaid */
    bool no_huge_pages;      /* 4 KiB pages for the arena (default: transparent huge pages) */
    int numa_node;           /* -1: no placement (the caller's policy) */
    struct uring *io;        /* register the arena as fixed buffers; may be NULL */
    struct device *dev;      /* cudaHostRegister through it when CUDA; may be NULL */
    bool shared;             /* the arena is a memfd another process may map (host_shared) */
};

struct host_stats {
    size_t capacity_bytes, used_bytes, staging_bytes;
    bool pinned;             /* mlock succeeded */
    bool cuda_registered;
    bool io_registered;
    bool huge_pages;         /* transparent huge pages asked for and accepted (hugemem.h) */
    int numa_node;           /* where the arena lives, -1 unknown */
};

/* -EPERM with one error line naming RLIMIT_MEMLOCK (current value and how to raise it)
 * when the arena cannot be locked. With pin=false it runs unpinned, and says so once a
 * process where pinning was expected: not when quiet or pin_chosen, nor beside an emulated
 * device tier (its copies are memcpy: pinning buys them nothing). A tier opened without a
 * device tier (dev NULL) cannot tell, and says so. */
int host_open(const struct host_opts *o, struct host **out);
void host_close(struct host *h);

int host_alloc(struct host *h, size_t bytes, uint64_t *off); /* -ENOSPC when nothing fits */
int host_free(struct host *h, uint64_t off);
/* host_alloc() is next fit; the next one looks from the arena's start. */
void host_alloc_rewind(struct host *h);
void *host_ptr(struct host *h, uint64_t off);
/* The staging area: staging_bytes at a 4 KiB aligned address, inside the registered
 * arena; NULL when staging_bytes was 0. */
void *host_staging(struct host *h);

void host_get_stats(struct host *h, struct host_stats *out);
/* A shared arena (host_opts.shared): its memfd (owned by the tier), base and size in bytes:
 * the budget only (the staging area is a private mapping of its own). -ENOTSUP for an
 * arena that is not shared. */
int host_shared(struct host *h, int *fd, void **base, size_t *bytes);

#endif
