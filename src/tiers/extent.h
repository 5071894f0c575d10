/*
 * extent.h - an extent allocator over an abstract range of offsets [0, capacity).
 *
 * Space is handed out in multiples of a fixed granularity (a power of two: 4 KiB for the
 * NVMe swap space). Allocation is best fit: the smallest free extent that holds the
 * request, the lowest offset among equals, carved from its start. A free coalesces with
 * both neighbours, so free space is always a set of maximal runs; extent_grow() appends
 * free space at the end, and extent_reserve() allocates at an offset the caller names.
 * Free extents are kept in two treaps (by offset, and by size then offset) and allocated
 * ones in a third (by offset), so alloc, reserve, free and find cost O(log n) expected,
 * whatever the number of extents.
 *
 * It is not thread-safe (callers lock), it owns no memory at the offsets it hands out
 * (they are numbers: a file offset, an index into a pool), and it knows nothing of
 * alignment beyond its granularity.
 */
#ifndef ZINF_TIERS_EXTENT_H
#define ZINF_TIERS_EXTENT_H

#include <stdint.h>

struct extent_node;

struct extent_alloc {
    uint64_t capacity_bytes;
    uint64_t granularity;
    uint64_t free_bytes, used_bytes;
    uint64_t free_extents, used_extents;
    struct extent_node *free_by_off;  /* free extents keyed by offset */
    struct extent_node *free_by_size; /* the same extents keyed by (length, offset) */
    struct extent_node *used_by_off;  /* allocated extents keyed by offset */
    uint64_t rng;                     /* treap priorities */
};

struct extent_stats {
    uint64_t capacity_bytes;
    uint64_t free_bytes, used_bytes;
    uint64_t largest_free_bytes; /* the largest request that would succeed now */
    uint64_t tail_free_bytes;    /* length of the free extent that ends at capacity, or 0 */
    uint64_t free_extents, used_extents;
};

/* capacity_bytes may be 0 (grow later); both it and granularity must satisfy: granularity
 * a power of two, capacity a multiple of it. Returns 0 or -EINVAL. */
int extent_init(struct extent_alloc *a, uint64_t capacity_bytes, uint64_t granularity);
/* Frees the bookkeeping; outstanding allocations are forgotten. Safe on a zeroed struct
 * and after a failed extent_init(). */
void extent_fini(struct extent_alloc *a);

/* Allocate bytes rounded up to the granularity; *off receives the start. Returns 0,
 * -EINVAL for 0 bytes, -ENOSPC when no free extent is large enough (even if the free total
 * is), -ENOMEM when bookkeeping cannot be allocated. State is unchanged on error. */
int extent_alloc(struct extent_alloc *a, uint64_t bytes, uint64_t *off);
/* Allocate [off, off + bytes rounded up to the granularity) at exactly that offset, for a
 * caller that rebuilds the allocations it recorded (a swap space reopened after a
 * restart). The range must lie inside one free extent, which leaves up to two free
 * remainders, one on each side. Returns 0, -EINVAL for 0 bytes, an off that is not a
 * multiple of the granularity or a range that passes the capacity, -EEXIST when any part
 * of the range is allocated already, -ENOMEM. State is unchanged on error. The result is
 * an ordinary allocation: extent_free(a, off) releases it. */
int extent_reserve(struct extent_alloc *a, uint64_t off, uint64_t bytes);
/* Next fit: the first free extent at or after `from` that holds the request (taken from
 * `from` itself when that is free), else the first one from the start. Consecutive
 * allocations then lie side by side, and a cache evicted in allocation order behaves like
 * a ring: what is pinned together stays together instead of being scattered over the
 * holes best fit would pick. O(free extents) at worst. Same returns as extent_alloc(). */
int extent_alloc_from(struct extent_alloc *a, uint64_t bytes, uint64_t from, uint64_t *off);
/* Next fit under a mark: as extent_alloc_from(), but only in room that ends by `mark` (the
 * search wraps at the mark, not at the capacity); where none there holds the request, the
 * lowest free extent that does (first fit), which moves the mark the least. A memory tier
 * passes the end of the room it ever handed out, so that it reuses pages already touched
 * before it touches new ones: room freed and taken again step after step stays in the same
 * pages instead of walking through the whole arena, faulting each page in once. Same
 * returns as extent_alloc(). */
int extent_alloc_under(struct extent_alloc *a, uint64_t bytes, uint64_t from, uint64_t mark,
                       uint64_t *off);
/* Free the allocation that starts at off. -EINVAL when off is not the start of a live
 * allocation (a double free, a stray offset); state is unchanged then. Never allocates. */
int extent_free(struct extent_alloc *a, uint64_t off);
/* Add free space [capacity, new_capacity) at the end, coalescing with a free tail.
 * new_capacity must be a multiple of the granularity and not below the capacity. Returns
 * 0, -EINVAL or -ENOMEM (state unchanged). */
int extent_grow(struct extent_alloc *a, uint64_t new_capacity);

/* The live allocation that contains off: its start and length (rounded, as reserved).
 * Returns 0 or -ENOENT. */
int extent_find(const struct extent_alloc *a, uint64_t off, uint64_t *start, uint64_t *len);
void extent_get_stats(const struct extent_alloc *a, struct extent_stats *out);
/* Walk every structure and check its invariants (free and used extents tile [0, capacity)
 * in order, free neighbours are coalesced, counters and both free indexes agree). O(n),
 * for tests and debugging. Returns 0, or -EFAULT after logging what is wrong. */
int extent_validate(const struct extent_alloc *a);

#endif
