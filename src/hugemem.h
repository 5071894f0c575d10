/*
 * hugemem.h - anonymous memory for IO buffers, backed by transparent huge pages where the
 * kernel allows it.
 *
 * Why: a 1 MiB O_DIRECT request into 4 KiB pages is 256 scatter-gather segments, and a
 * device whose limit is lower (virtio-blk allows 254) splits every such request in two
 * and can merge nothing. Physically contiguous 2 MiB pages make one request one or two
 * segments, so requests reach the device whole and adjacent ones merge.
 *
 * Not here: where the memory lives (NUMA) or whether it is locked; callers do that on the
 * mapping these return, before they touch it.
 */
#ifndef ZINF_HUGEMEM_H
#define ZINF_HUGEMEM_H

#include <stdbool.h>
#include <stddef.h>

#define HUGEMEM_PAGE_BYTES ((size_t)2 << 20)

/* Map bytes of zero-filled anonymous memory, 2 MiB aligned, with MADV_HUGEPAGE asked for
 * when huge (where transparent huge pages are off it is ordinary memory). NULL with
 * *err = -errno on failure. Free with hugemem_unmap(p, bytes). *huge_ok says whether the
 * kernel took the advice (it may still hand out small pages under memory pressure). */
void *hugemem_map(size_t bytes, bool huge, bool *huge_ok, int *err);
/* The same over a memfd (named name) that *fd receives, mapped shared: what another process
 * maps from that fd is the same memory (the service hands it to its clients). Huge pages
 * then depend on the shmem setting of transparent huge pages. Close *fd after unmapping. */
void *hugemem_map_shared(size_t bytes, bool huge, const char *name, bool *huge_ok, int *fd,
                         int *err);
/* A memfd of bytes (named name) to share with another process that must not be able to
 * change its size: sealed against shrinking and growing, and against further seals (a
 * holder of the fd cannot seal writes away from the maker). A mapping of it can then never
 * lose its pages to an ftruncate, which would kill the maker with SIGBUS at its next access.
 * With map, the memory is first mapped here (shared, read-write, *map) and then sealed
 * against every other write: whoever else gets the fd can map it read-only and nothing
 * else (no write(), no writable mapping, no hole punched). The fd (close-on-exec), or
 * -errno. */
int hugemem_memfd(const char *name, size_t bytes, void **map);
void hugemem_unmap(void *p, size_t bytes);

#endif
