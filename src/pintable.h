/*
 * pintable.h - a session's pin table: the hit path of the service in shared memory.
 *
 * The daemon gives each session one memfd laid out as below; the session's process (the
 * client) and the daemon both map it. It lets a client pin a copy that is resident already,
 * and release it clean, without a message:
 *
 * - One slot per (tensor index, memory tier). While a slot is OPEN, the engine holds one
 *   pin of that copy on the session's behalf (a lease); the copy then stays where it is,
 *   valid, and never moves. The slot's count is the pins the session's threads hold
 *   through it. A client pins with a compare-and-swap that adds one to an OPEN slot, and
 *   releases clean by taking one off; nothing else in the slot changes meanwhile.
 * - The engine closes a slot (compare-and-swap from OPEN with count 0 to 0, so never while
 *   the client holds a pin through it) when it wants the copy's room, a DIRTY release of
 *   the other tier, an unregister. A client that finds a slot closed, or sees any other
 *   doubt, asks the daemon instead; so does every call that is not a plain fetch or a
 *   clean release. A fetch through the daemon of a resident copy opens its slot.
 * - The epoch, bumped at each opening, makes a compare-and-swap fail across a close and a
 *   reopening. info (the handle's generation and the copy's offset) changes only while
 *   the slot is closed.
 * - Each pin taken here is told to the daemon through the event ring (several producers:
 *   the client's threads; one consumer: the daemon, before it serves any call of the
 *   session), so the engine counts the hit and the learned schedule sees the fetch, in
 *   order with the session's other calls. A full ring sends the fetch through the daemon.
 * - published: the daemon adds one (release) after content changes in place (a DIRTY
 *   release, zinf_write); a client loads it (acquire) after each pin, so what it reads
 *   through the pointer is ordered after those changes.
 *
 * All fields a peer may write are atomics: the other side may be hostile or dead, so the
 * daemon validates what it reads (an event names a tensor by index and generation).
 */
#ifndef ZINF_PINTABLE_H
#define ZINF_PINTABLE_H

#include <stdatomic.h>
#include <stdint.h>

#define PT_MAGIC 0x6e69707au     /* "zpin" as a little-endian u32 */
#define PT_VERSION 1
#define PT_TENSORS (1u << 18)    /* tensor indices a table covers; others go through the daemon */
#define PT_TIERS 2               /* device, host */
#define PT_RING (1u << 12)       /* events; a power of two */
#define PT_OPEN (1ull << 63)
#define PT_EPOCH_SHIFT 32
#define PT_EPOCH_MASK 0x7fffffffull
#define PT_COUNT_MASK 0xffffffffull
#define PT_PAGE_SHIFT 12         /* info carries the offset in 4 KiB pages */

struct pt_header {
    uint32_t magic, version;
    uint32_t tensors, ring; /* PT_TENSORS, PT_RING */
    uint64_t ring_off, slot_off, bytes;
    _Alignas(64) _Atomic uint64_t head; /* next event to claim (clients) */
    _Alignas(64) _Atomic uint64_t tail; /* next event to read (the daemon) */
    _Alignas(64) _Atomic uint64_t published;
};

struct pt_event {
    _Atomic uint64_t stamp; /* the event's number + 1 once written */
    _Atomic uint64_t what;  /* generation << 32 | tensor index << 1 | tier */
};

struct pt_slot {
    _Atomic uint64_t word; /* PT_OPEN | epoch << 32 | count */
    _Atomic uint64_t info; /* generation << 32 | offset >> PT_PAGE_SHIFT */
};

#define PT_RING_OFF 4096ull
#define PT_SLOT_OFF (PT_RING_OFF + (uint64_t)PT_RING * sizeof(struct pt_event))
#define PT_BYTES (PT_SLOT_OFF + (uint64_t)PT_TENSORS * PT_TIERS * sizeof(struct pt_slot))

static inline struct pt_event *pt_ring(struct pt_header *h)
{
    return (struct pt_event *)((char *)h + PT_RING_OFF);
}

static inline struct pt_slot *pt_slot(struct pt_header *h, uint32_t index, int tier)
{
    return (struct pt_slot *)((char *)h + PT_SLOT_OFF) + (uint64_t)index * PT_TIERS + tier;
}

#endif
