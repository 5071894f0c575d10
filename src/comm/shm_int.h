/*
 * shm_int.h - what shm.c (the segment, its rendezvous and barrier) and shm_coll.c (the shm
 * backend's collectives) share: the segment's header, a rank's view of it, and how a rank
 * reads that the communicator failed. Not for the rest of src/comm/, which uses shm.h.
 */
#ifndef ZINF_COMM_SHM_INT_H
#define ZINF_COMM_SHM_INT_H

#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "comm/comm.h"
#include "comm/shm.h"

#define WHY_BYTES 200
#define TAG_HEX 16 /* the hex digits of the tag in the segment's name (comm_segment_name) */
#define SEG_NAME_BYTES (sizeof("/zinf-comm-") + COMM_NAME_BYTES + 1 + TAG_HEX)

struct shm_rank {
    _Atomic uint32_t joined;
    _Atomic int32_t pid; /* 0 until the rank has written it: taken as alive until then */
    _Atomic uint32_t op;   /* the operation it is in (enum comm_op) ... */
    _Atomic uint64_t seq;  /* ... and its number: how many it has begun */
    _Atomic uint64_t bars; /* barriers it has entered */
    _Atomic uint32_t left; /* it closed its communicator (its operations are over) */
    /* An operation's arguments, written before its first barrier and read after it: whether
     * the rank's buffers are in its pool, and where. */
    uint32_t pooled;
    uint64_t off_send, off_recv;
    /* What the rank says it runs (operation, bytes), for its barrier number k in [k % 2]:
     * written before that barrier and read after it; a rank gone ahead into its next
     * operation writes the other one. */
    uint32_t says_op[2];
    uint64_t says_bytes[2];
};

struct shm_hdr {
    _Atomic uint64_t magic; /* stored last by rank 0: the rest of the header is valid */
    uint32_t world, backend;
    uint64_t chunk_bytes; /* 0: no staging areas */
    uint64_t pool_bytes;  /* per rank, after the staging areas; 0: none */
    int32_t pid0;
    _Atomic uint32_t open; /* every rank joined: rank 0 sets it, then unlinks the name */
    _Atomic uint32_t failed;
    char why[WHY_BYTES]; /* written by the one rank that set failed from 0 to 1 */
    _Atomic uint32_t bar_count, bar_gen;
    uint8_t id[SHM_ID_BYTES];
    char secret[COMM_SECRET_HEX + 1]; /* the job's; "" without one */
    struct shm_rank ranks[COMM_MAX_RANKS];
};

struct shm {
    struct shm_hdr *h;
    size_t map_bytes;
    char *data;      /* the staging sets, or NULL */
    size_t chunk;    /* bytes per area */
    char *pools;     /* rank r's pool at pools + r x pool; NULL: none */
    size_t pool;
    char *chans;     /* the point-to-point channels (shm_p2p.c); NULL: none */
    size_t ring;     /* bytes of each channel's ring */
    uint64_t chunks; /* chunks moved so far (set = chunks % 2) */
    int rank, world;
    int first;                 /* what messages add to a rank: shm_name_ranks_from */
    char name[SEG_NAME_BYTES]; /* "/zinf-comm-NAME[.TAG]" */
    const char *job;           /* NAME */
    /* The operation in progress: its number, and when its barriers stop waiting. */
    uint64_t seq, bars, op_deadline;
    uint64_t op_looked; /* when shm_op_late last read the clock (or the operation began) */
    unsigned op_timeout_ms;
    const volatile sig_atomic_t *stop;
    char *why; /* comm_opts.why */
    size_t why_len;
};

/* The point-to-point channels' bytes in a segment of world ranks whose staging areas are
 * chunk bytes (0: none), and each one's ring (shm_p2p.c). */
size_t shm_chan_bytes(int world, size_t chunk, size_t *ring);

/* Why it failed, as the rank that failed it wrote. */
const char *shm_fail_reason(struct shm *s);

#endif
