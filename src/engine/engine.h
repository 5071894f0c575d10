/*
 * engine.h - the swap manager's internal state, shared by the files of src/engine/.
 *
 * One mutex (e->lock) guards every tensor, copy, schedule and staging slot; IO and copies
 * run outside it and report back through callbacks that take it briefly. One condition
 * variable (e->changed) is broadcast whenever a copy changes state, so waiters re-check.
 *
 * A tensor has a permanent home and up to two cached copies (device, host). Contents are
 * versioned: a copy is valid when its version equals the tensor's; a DIRTY release or a
 * zinf_write makes a new version. The home (NVMe extent, or the home tier's copy) is
 * "stale" while a newer version exists only in caches; such a copy is written back to the
 * home before it is dropped.
 */
#ifndef ZINF_ENGINE_ENGINE_H
#define ZINF_ENGINE_ENGINE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common.h"
#include "handle.h"
#include "io/uring.h"
#include "tiers/device.h"
#include "tiers/host.h"
#include "tiers/nvme.h"

#define MEM_TIERS 2 /* ZINF_TIER_DEVICE and ZINF_TIER_HOST hold copies in memory */
#define SRC_ZERO 3  /* transfer source: the content is all zeros */
#define DST_NONE 3  /* transfer destination: read and checksum only */
#define LOADING_WRITEBACK 4 /* copy.loading_from: a write-back replaces this home copy */
#define ENGINE_MAX_PINSETS 64 /* pin tables (service sessions) an engine serves at once */

/*
 * The states of a copy (one per tensor and memory tier), written once. `state` is the
 * coarse state; the counters and flags refine it.
 *
 *            load_begin                load_ok
 *   NONE ─────────────────▶ LOADING ─────────────▶ READY (valid: version == tensor's)
 *    ▲                        │  ▲                   │   │
 *    │           load_failed  │  │ load_begin        │   │ a newer version is made
 *    │  (a cache; the home    │  │ (stale only)      │   ▼ elsewhere (DIRTY release,
 *    │   goes back to READY   │  └──────────────── READY (stale)      zinf_write)
 *    │   with its old label)  ▼                      │
 *    └──────────── copy_drop ◀── (cache copies only, unpinned, unread)
 *
 * Refinements of READY:
 *   pinned (pins > 0): a caller holds the pointer; never dropped, never loaded into. It
 *     may still be read (a load of the other tier, a write-back, a flush) while its holder
 *     writes through it: what was read keeps the old version, and the DIRTY release that
 *     must follow the write makes that stale, so no fetch after the release is served it
 *     (a load landing stale is dropped or loaded again). Not reading pinned copies would
 *     make a holder's own fetch of the other tier wait for its own pin.
 *   leased (leases != 0): a session of the service may pin it without a message; each
 *     lease is one of the pins. A lease whose client holds no pin through it is idle and
 *     is closed (copy_pinned) by whoever needs the copy unpinned. Leased implies READY,
 *     valid and not prefetched.
 *   imaged (undo != NULL): in an engine that serves other processes (e->undo), a pinned or
 *     leased copy that is its content's only holder keeps an image of that content, put
 *     back if its holder dies (undo.c); dropped with the copy or when no longer needed.
 *   read (readers > 0): a transfer reads from it (a load of the other tier, a write-back,
 *     a flush); never dropped, never loaded into.
 *   written back (wb_inflight): one of those readers is its write-back to the home; at most
 *     one per tensor. evicting: it is dropped when that write-back lands, if still unpinned.
 *     A write-back starts when the copy must be evicted (evicting), at a flush, or at the
 *     DIRTY release that left it unpinned when the learned step says it will be evicted
 *     before its next use (write-behind: sched_write_behind); the copy stays READY and
 *     valid meanwhile, and a newer version made during it leaves the home stale.
 *   wb_failed_version/epoch: that write-back failed; eviction passes over it until the
 *     next call that makes room (or a new version).
 * Refinements of LOADING and READY:
 *   prefetched: loaded ahead of use, charged to the prefetch budget until a fetch uses it
 *     (prefetch_consumed) or it is wasted (prefetch_wasted: dropped, overtaken,
 *     unregistered); never pinned.
 * The home copy of a DEVICE- or HOST-home tensor is never NONE: it is LOADING while a load
 * or a write-back replaces its content (that write-back is the home's "load": its error
 * goes to the home's err, for the fetches that joined it).
 * Cache copies that are not NONE are on their tier's list (res_*), for eviction.
 * A zero release (ZINF_RELEASE_ZERO, NVMe homes only, the caller's the only pin on either
 * copy; idle leases closed before the pins are counted), or a zinf_zero (the same with no
 * pin at all), makes a new version that is all zeros (tensor.zero: a fetch loads it from SRC_ZERO,
 * a flush saves a zero entry): unread READY copies go at once (copy_drop), a LOADING one
 * lands stale and is dropped (copy_load_ok), a read or written-back one stays stale until
 * its transfer is done, as copies overtaken by a DIRTY release elsewhere do.
 * On the tensor: exclusive means zinf_read/zinf_write/flush/unregister own it with the lock
 * dropped: no copy is LOADING or written back, and no copy is dropped meanwhile (eviction
 * passes over it, a DIRTY release waits). damaged: it failed its checksum at resume.
 *
 * engine_check_tensor() asserts all of this in builds with assertions (the default and
 * debug builds), after every transition.
 */
enum copy_state { COPY_NONE, COPY_LOADING, COPY_READY };

struct tensor;

struct copy {
    uint8_t state;
    int8_t loading_from; /* while LOADING: the load's source (ZINF_TIER_*, SRC_ZERO), or
                            LOADING_WRITEBACK for a home copy a write-back replaces */
    bool prefetched;            /* loaded ahead of use; cleared by the first fetch */
    bool evicting;              /* a write-back runs so that this copy can be dropped */
    bool wb_inflight;           /* a write-back reads from this copy */
    bool wb_behind;             /* ... a write-behind (started at release): no pin is taken
                                   on the copy until it lands, or a caller could write into
                                   what it reads */
    int err;                    /* result of the last load (or write-back into this home copy), for
                                   its waiters */
    uint64_t wb_failed_version; /* the content version whose write-back from this copy
                                   failed; 0: none */
    uint64_t wb_failed_epoch;   /* ... during this call that made room (e->reserve_epoch):
                                   eviction passes over it until the next such call */
    unsigned pins;              /* callers holding the pointer (and pending fetches) */
    unsigned deferred;          /* zinf_fetch_async tickets whose load could not start yet: pins
                                   the callers hold already, taken for real by zinf_wait */
    unsigned readers;           /* transfers reading from this copy */
    uint64_t leases;            /* pin tables with this copy's slot open (bit = table id):
                                   each holds one of the pins (lease.c) */
    void *undo;                 /* its content when pinned, for pins that may be abandoned
                                   (undo.c); NULL: none */
    uint64_t undo_version;      /* the version undo holds */
    uint64_t version;           /* content held; valid iff == tensor.version */
    uint64_t off;               /* offset in the tier's arena */
    void *ptr;
    uint64_t last_use;                /* LRU clock */
    struct copy *res_prev, *res_next; /* the tier's list of allocated copies */
    struct tensor *t;
};

struct tensor {
    zinf_tensor handle;
    uint32_t index;
    char *name;
    size_t nbytes, alloc_bytes; /* alloc_bytes: nbytes rounded up to 4 KiB */
    enum zinf_tier home;
    uint64_t version;
    bool zero;      /* content is all zeros: never written since registered (or since
                       resumed from a zero entry); flushed as a zero entry */
    bool exclusive; /* zinf_write/zinf_read/flush/unregister owns it */
    /* 1 + the zinf_step() count when its copy in each memory tier was last evicted to
     * make room (0: never): a tensor evicted in the last step is written behind (sched.c). */
    uint64_t evicted_step[MEM_TIERS];
    bool damaged;   /* its saved content failed its checksum at resume:
                       fetch and read answer -EBADMSG, unregister frees it */
    struct copy c[MEM_TIERS];
    /* The swap extent: the home of an NVMe tensor, the persisted copy of the others. */
    bool has_swap;
    uint64_t swap_off;
    uint64_t swap_version; /* content version held there; 0: none */
    uint32_t swap_crc;     /* crc32c of swap_version's content, when known */
    bool swap_crc_valid;
    /* The extent the last committed manifest names, if any (never overwritten). */
    bool persisted;
    uint64_t persisted_off;
    uint32_t persisted_crc;
    bool persisted_zero;
    uint64_t persisted_version;
    /* The extent the manifest a flush is writing names, from the moment the flush has
     * checksummed it until that manifest is committed or abandoned (never overwritten
     * either: a crash may leave that manifest the committed one). */
    bool flush_named;
    uint64_t flush_off;
    struct tensor *hnext; /* name hash chain */
};

/* A move of one tensor's content between two places; see xfer.c. */
struct xfer;
typedef void (*xfer_done_fn)(struct xfer *x, int err); /* engine lock held */

struct xfer {
    struct zinf_engine *e;
    struct tensor *t;
    int src, dst;              /* ZINF_TIER_*, SRC_ZERO, DST_NONE */
    uint64_t src_off, dst_off; /* arena offsets, or swap offsets for NVMe */
    void *src_ptr, *dst_ptr;   /* host-side pointers when the side is host memory */
    size_t len;
    uint64_t version; /* the content version being moved */
    void *arg;        /* for done */
    xfer_done_fn done;
    const char *what; /* for the trace: "load", "write-back", ...; NULL: by its tiers */
    uint64_t trace_t0; /* now_ns() at xfer_start when tracing, else 0 */
    /* chunked (staged) transfers */
    size_t next; /* bytes handed to chunks so far */
    unsigned inflight;
    int err;
    bool queued; /* waiting in e->stage_waitq */
    bool want_crc;
    uint32_t *chunk_crc;
    unsigned nchunks;
    uint32_t crc; /* result when want_crc */
    struct xfer *wait_next;
    /* unstaged transfers */
    struct uring_req req;
    struct device_copy dc;
};

struct slot {
    struct zinf_engine *e;
    struct xfer *x;
    char *buf;
    size_t off, len; /* the chunk of x it carries */
    unsigned chunk;
    struct uring_req req;
    struct device_copy dc;
    struct slot *next;
};

struct sched_entry {
    uint32_t tidx;
    uint8_t tier;
};

struct sched {
    bool replaying;
    bool rec_from_start;     /* the recording began at a step boundary */
    struct sched_entry *rec; /* this step's fetches, while learning */
    size_t nrec, caprec;
    struct sched_entry *sch; /* the learned step */
    size_t len, pos;         /* pos: index of the next expected fetch */
    size_t ahead;            /* entries from pos on already considered for prefetch */
    /* occurrences per (tensor index, tier): occ[occ_start[k] .. occ_start[k+1]) */
    uint32_t *occ, *occ_start;
    size_t nkeys;
};

struct zinf_engine {
    struct handle h; /* HANDLE_ENGINE: first, for src/api.c */
    pthread_mutex_t lock;
    pthread_cond_t changed;

    struct zinf_options opt;
    size_t block_size;
    unsigned queue_depth;
    uint64_t prefetch_budget_bytes;
    bool prefetch_one_ahead; /* default budget: one tensor may always run ahead */
    bool write_behind;       /* sched_write_behind() may start write-backs at release */
    /* A write-back landed: its copy is clean, so a prefetch the schedule gave up on (a hint
     * never waits for a write-back) may find room now. The completion that sees it set
     * resumes the schedule's prefetches once it is done with its own state. */
    bool prefetch_kick;
    char **nvme_dirs;
    unsigned nvme_ndirs;

    struct uring *io;
    struct device *dev;
    struct host *host;
    struct nvme *nvme;

    struct tensor **tensors; /* by index; NULL: free slot */
    uint32_t *gens;          /* generation of each slot, for stale handles */
    uint32_t ntensors, captensors, live;
    struct tensor **names; /* hash buckets */
    size_t nbuckets;

    struct copy res[MEM_TIERS]; /* list heads of allocated copies per tier */
    uint64_t clock;

    struct slot *slots, *free_slots;
    unsigned nslots;
    struct xfer *stage_waitq, *stage_waitq_tail;
    unsigned xfers_inflight;
    /* The trace (trace.h): this engine's number in counter names, its transfers' ids, and
     * the NVMe bytes of the current rate window. */
    int trace_id;
    uint64_t trace_seq;
    uint64_t trace_win_t0, trace_win_read, trace_win_written;
    uint64_t trace_counters_t; /* when engine_trace_counters() last wrote */

    uint64_t reserve_epoch; /* counts the calls that make room (fetch, register) */
    uint64_t prefetch_outstanding_bytes;
    /* zinf_fetch_all() calls emptying the tier to lay their set out: no prefetch goes in
     * meanwhile. */
    unsigned compacting[MEM_TIERS];
    struct sched sched;

    /* pin tables of the service's sessions (lease.c), by id */
    struct engine_pinset *pinsets[ENGINE_MAX_PINSETS];
    unsigned npinsets;
    unsigned undo; /* tiers (bits) whose pinned copies that hold the only newest content
                      keep undo images: both, when the engine is shared */

    /* async fetch tickets, by id: a hash of tickets_mask + 1 chains (ids are consecutive,
     * so id & tickets_mask spreads them evenly); a wait or a drop finds its ticket in one
     * step however many are open (a list made N waits cost N^2) */
    struct ticket **tickets;
    size_t tickets_mask, ntickets;
    uint64_t next_ticket;

    bool closing;
    bool flushing; /* persist_flush() runs; unregister waits */
    struct zinf_stats st;
    /* Extents the committed manifest still names although no tensor uses them now; freed
     * once the next manifest no longer names them. */
    uint64_t *deferred_free;
    size_t ndeferred, capdeferred;
    /* The previous version (persist_flush_tagged with keep): whether its manifest is kept,
     * and the extents it names that the current one does not (neither free nor written). */
    bool has_prev;
    uint64_t *retained;
    size_t nretained, capretained;
    int64_t tag;            /* the committed manifest's tag; -1: none */
    size_t persisted_count; /* the tensors it names */
    /* A read-only engine: the identity (persist_probe) of the manifest it read. Its loads
     * and reads from swap are checked against the manifest's checksums, since the writer
     * next to it may reuse any extent once its next manifest is in place. */
    uint32_t manifest_id;
    /* Test-only fault hook: the next fsync of the manifest's directory fails with this. */
    int fault_dir_fsync;
};

struct ticket {
    uint64_t id;
    zinf_tensor t;
    enum zinf_tier tier;
    bool deferred; /* the load could not start without waiting: zinf_wait() fetches */
    struct ticket *next;
};

/* Settings zinf_options has no field for (they come from a config file). */
struct engine_params {
    bool pin;                       /* lock the host tier (pin_memory) */
    bool quiet_unpinned;            /* no notice when unpinned: nothing offloads to it */
    bool pin_chosen;                /* pin_memory given in the config: unpinned is the user's
                                       choice, unsaid (host_opts.pin_chosen) */
    uint64_t prefetch_budget_bytes; /* 0: default */
    unsigned staging_slots;         /* block_size slots in the staging ring; 0: default */
    bool sqpoll;
    enum uring_backend io_backend;
    unsigned submit_batch; /* uring_opts.submit_batch; 0: one chunk per completion */
    unsigned rings;        /* uring_opts.rings (aio.intra_op_parallelism); 0: one */
    bool no_huge_pages;    /* 4 KiB pages for the host arena and staging ring */
    bool no_write_behind;  /* write dirty copies back when evicted only (sched_write_behind) */
    bool shared;           /* the host and (emulated) device arenas are memfds that
                              other processes map: engine_regions() (the service) */
    void *device_arena;    /* device_opts.arena: lent by the caller (zinf_config's) */
    size_t device_arena_bytes;
};

/* An internal ZINF_OPEN_* flag, with RESUME or READONLY: the previous version kept by
 * persist_flush_tagged, rather than the current one (resuming, it becomes the current one).
 * Callers give ZINF_OPEN_PREVIOUS, which engine_open turns into this; zinf_open refuses this
 * one, so that the public flag is the only way in. */
#define ENGINE_OPEN_PREVIOUS (1u << 16)

int engine_open(const struct zinf_options *opt, const struct engine_params *p, zinf_engine **out);
/* Flush with a tag, keeping the previous version (persist_flush_tagged), and forget it:
 * zinf_flush_step and zinf_drop_previous on an engine of this process. */
int engine_flush_tagged(zinf_engine *e, int64_t tag, bool keep);
int engine_drop_previous(zinf_engine *e);
struct zinf_config;
/* Open from a parsed config (what zinf_open_config does), with extra ZINF_OPEN_* flags. */
int engine_open_config(const struct zinf_config *c, unsigned flags, zinf_engine **out);
/* The same with the arenas shared (engine_params.shared), for the service, and the swap
 * files in subdir under each of the config's swap directories (created when missing). */
int engine_open_config_shared(const struct zinf_config *c, unsigned flags, const char *subdir,
                              zinf_engine **out);

/* A memory tier's arena as another process maps it. */
struct engine_region {
    enum zinf_tier tier;
    int fd; /* the tier's memfd, owned by the engine; -1 for a CUDA arena */
    void *base;
    size_t bytes;
    /* A CUDA device arena: other processes open it with device_ipc_open(). */
    bool cuda;
    unsigned char ipc_handle[DEVICE_IPC_HANDLE_BYTES];
    char busid[DEVICE_BUSID_BYTES];
};
/* The device and host arenas of an engine opened shared, in that order: MEM_TIERS, or
 * -errno (the CUDA IPC handle of a CUDA arena could not be made). */
int engine_regions(zinf_engine *e, struct engine_region out[MEM_TIERS]);
/* zinf_close without the flush: what the last flush committed stays the saved state, as
 * after a crash (for a caller whose state in memory is known to be inconsistent). */
void engine_close_unflushed(zinf_engine *e);

/* The engine's side of the calls of zinf.h (src/api.c routes them here for an engine of
 * this process); each behaves as zinf.h says of its zinf_ namesake. */
void engine_api_close(zinf_engine *e);
int engine_api_register(zinf_engine *e, const char *name, size_t nbytes, enum zinf_tier home,
                        zinf_tensor *out);
int engine_api_lookup(zinf_engine *e, const char *name, zinf_tensor *out);
int engine_api_unregister(zinf_engine *e, zinf_tensor t);
int engine_api_tensor_info(zinf_engine *e, zinf_tensor t, struct zinf_tensor_info *out);
int engine_api_fetch(zinf_engine *e, zinf_tensor t, enum zinf_tier tier, void **ptr);
int engine_api_fetch_async(zinf_engine *e, zinf_tensor t, enum zinf_tier tier, uint64_t *ticket);
int engine_api_wait(zinf_engine *e, uint64_t ticket, void **ptr);
/* Drops a zinf_fetch_async ticket its caller will never wait for (a client of the service
 * that went away): its pin, or its claim on a load not started, let go without loading
 * anything. 0, or -EINVAL when no such ticket is open. */
int engine_ticket_drop(zinf_engine *e, uint64_t ticket);
int engine_api_fetch_all(zinf_engine *e, const zinf_tensor *ts, size_t n, enum zinf_tier tier,
                         void **ptrs);
int engine_api_release(zinf_engine *e, zinf_tensor t, enum zinf_tier tier, unsigned flags);
int engine_api_zero(zinf_engine *e, zinf_tensor t);
int engine_api_prefetch(zinf_engine *e, zinf_tensor t, enum zinf_tier tier);
int engine_api_step(zinf_engine *e);
int engine_api_write(zinf_engine *e, zinf_tensor t, size_t off, const void *src, size_t n);
int engine_api_read(zinf_engine *e, zinf_tensor t, size_t off, void *dst, size_t n);
int engine_api_flush(zinf_engine *e);
int engine_api_stats(zinf_engine *e, struct zinf_stats *out);
/* Drops a pin of a caller that went away without releasing it (a client of the service
 * that died): released clean, and the copy, which that caller may have written through
 * without a DIRTY release, put back as it was when pinned (its undo image, undo.c) when it
 * is the only holder of its content and nobody else holds it, or else dropped when nothing
 * else uses it and the newest content is also elsewhere (the home or the other copy); so
 * the tensor reads as its last released content. 0; 2 when it was put back; 1 when it had
 * to be kept as it is (another caller holds it, or no image could be kept); -errno as
 * engine_api_release. */
int engine_release_abandoned(zinf_engine *e, zinf_tensor h, enum zinf_tier tier);

/* Pin tables (src/pintable.h), one per session of the service: see lease.c. */
struct engine_pinset;
/* A new, empty table and the memfd its client maps (owned by the table). -EMFILE when
 * ENGINE_MAX_PINSETS are open. */
int engine_pinset_open(zinf_engine *e, struct engine_pinset **out, int *fd, size_t *bytes);
/* Ends a table whose client is gone: its leases close and the pins the client held
 * through them are dropped as engine_release_abandoned drops one (*dropped of them,
 * *restored of those on a copy put back, *kept of those on a copy kept as it was). */
void engine_pinset_close(zinf_engine *e, struct engine_pinset *ps, unsigned *dropped,
                         unsigned *kept, unsigned *restored);
/* The pins the table's client holds through its slots now. */
uint64_t engine_pinset_pins(zinf_engine *e, struct engine_pinset *ps);
/* engine_api_fetch for ps's session: when *leased, the pin is counted in the session's
 * slot (released there, by the client or engine_release_leased), not as an ordinary pin. */
int engine_api_fetch_leased(zinf_engine *e, struct engine_pinset *ps, zinf_tensor h,
                            enum zinf_tier tier, void **ptr, bool *leased);
/* engine_api_fetch_all for ps's session: leased[i] as *leased of engine_api_fetch_leased. */
int engine_api_fetch_all_leased(zinf_engine *e, struct engine_pinset *ps, const zinf_tensor *ts,
                                size_t n, enum zinf_tier tier, void **ptrs, bool *leased);
/* engine_api_release of a pin counted in ps's slot: -EINVAL when the slot counts none. */
int engine_release_leased(zinf_engine *e, struct engine_pinset *ps, zinf_tensor h,
                          enum zinf_tier tier, unsigned flags);
/* Lock held: */
/* Is the copy pinned, once the idle leases on it are closed? */
bool copy_pinned(struct zinf_engine *e, struct tensor *t, int tier);
/* Close the idle leases on t's copy in tier, all but keep's (NULL: every one). A client pins
 * a leased copy with atomics alone: only a closed lease is known to hold nothing, so what
 * needs a copy nobody holds closes them first and then counts the pins (an open lease counts
 * one there, idle or not). */
void lease_close_idle(struct zinf_engine *e, struct tensor *t, int tier,
                      const struct engine_pinset *keep);
/* The pins ps's client holds through its slot for t's copy in tier now. */
unsigned lease_count(const struct engine_pinset *ps, const struct tensor *t, int tier);
/* Its pins that callers hold (the idle leases not counted). */
unsigned copy_held(const struct zinf_engine *e, const struct copy *c);
/* Count the pins clients took through their slots as fetches (in order with the calls
 * that follow) and prefetch what the schedule says comes next. */
void lease_drain(struct zinf_engine *e);
/* Content changed in place (a DIRTY release, zinf_write): clients order their next reads
 * after it. */
void lease_publish(struct zinf_engine *e);
/* Move the pin a fetch for ps's session just took on t's copy into the session's slot,
 * opening it (the pin becomes the lease): false when it stays an ordinary pin. */
bool lease_open(struct zinf_engine *e, struct engine_pinset *ps, struct tensor *t, int tier);
/* Take one pin off ps's slot of the copy (false: it counts none); put it back. */
bool lease_take(struct engine_pinset *ps, struct tensor *t, int tier);
void lease_untake(struct engine_pinset *ps, struct tensor *t, int tier);
void lease_fini(struct zinf_engine *e);

/* undo.c (lock held) */
/* Would a pin of this copy need an undo image (e->undo, and nothing else holds its content)? */
bool undo_needed(const struct zinf_engine *e, const struct tensor *t, int tier);
/* Take or drop t's images after a change: pinned copies that need one get one. */
void undo_settle(struct zinf_engine *e, struct tensor *t);
/* Put back the image of the copy (its content when pinned): false when it has none. */
bool undo_restore(struct zinf_engine *e, struct tensor *t, int tier);
void undo_free(struct copy *c);

/* registry.c */
struct tensor *engine_tensor(struct zinf_engine *e, zinf_tensor h);
/* After any wait that dropped the lock: is h still the tensor t? (Lock held.) A caller
 * without a pin must not touch t when this says no: it may have been freed. */
bool engine_revalidate(struct zinf_engine *e, zinf_tensor h, const struct tensor *t);
int engine_add_tensor(struct zinf_engine *e, struct tensor *t);
/* Frees a tensor that is in no registry (any more), with its undo images; NULL: nothing. */
void engine_tensor_free(struct tensor *t);
/* Wait until nothing moves in or out of the tensor, then own it (fetches of it wait); NULL
 * when it was unregistered meanwhile. Lock held. */
struct tensor *engine_tensor_lock(struct zinf_engine *e, zinf_tensor h);
void engine_tensor_unlock(struct zinf_engine *e, struct tensor *t);
bool engine_home_valid(const struct tensor *t);
/* The invariants drawn above, for one tensor (lock held); aborts naming the broken one. */
#ifndef NDEBUG
void engine_check_tensor(const struct tensor *t);
#define ENGINE_CHECK(t) engine_check_tensor(t)
#else
#define ENGINE_CHECK(t) ((void)0)
#endif
/* Does a manifest, committed or being written, name t's swap extent? Then new content
 * must go to another extent (copy on write). */
bool engine_swap_named(const struct tensor *t);
/* Does a manifest, committed or being written, name t's extent at off? */
bool engine_extent_named(const struct tensor *t, uint64_t off);
/* Whether the last manifest names an extent of t's (persisted_off): not while it saved t as
 * zeros from a memory home. */
bool engine_persisted_extent(const struct tensor *t);
void engine_free_swap(struct zinf_engine *e, uint64_t off, bool persisted);
/* Appends off to a growable list of extents kept allocated (said, and left allocated, when
 * memory runs out). */
void engine_keep_extent(uint64_t **list, size_t *n, size_t *cap, uint64_t off);
/* Allocate a swap extent; when the files must grow, the lock is dropped meanwhile, so the
 * caller must hold what it works on exclusively (engine_tensor_lock). Lock held. */
int engine_swap_alloc(struct zinf_engine *e, size_t bytes, uint64_t *off);
/* Grow the swap files until bytes fit, with the engine lock dropped meanwhile (held on
 * entry and return): the caller looks at everything again afterwards. */
int engine_grow_swap(struct zinf_engine *e, size_t bytes);

/* residency.c */
enum reserve_mode {
    RESERVE_WAIT,     /* a blocking fetch or a register: may wait for room */
    RESERVE_NOWAIT,   /* an asynchronous fetch: starts what is needed, never waits */
    RESERVE_PREFETCH, /* a hint: never waits, never evicts what is needed sooner */
};
void copy_drop(struct zinf_engine *e, struct tensor *t, int tier);
void copy_link(struct zinf_engine *e, struct copy *c, int tier);
/* Takes c off its tier's list (if it is on it). */
void copy_unlink(struct copy *c);
/* Is t's copy in tier READY with the tensor's newest content? */
bool copy_valid(const struct tensor *t, int tier);
/* Must t's copy in tier reach the home before it is dropped? */
bool writeback_needed(const struct tensor *t, int tier);
void engine_wait(struct zinf_engine *e);
/* The same, until deadline (now_ns()'s clock) at the latest. */
void engine_wait_until(struct zinf_engine *e, uint64_t deadline);
int writeback_start(struct zinf_engine *e, struct tensor *t, int tier, bool evict);
/* Allocate in a memory tier, evicting as needed: 0, -EAGAIN (waited; re-check), -EINPROGRESS
 * (RESERVE_NOWAIT: would wait), -ENOSPC (a prefetch), -ENOMEM, -EIO; see residency.c. */
int tier_reserve(struct zinf_engine *e, int tier, size_t bytes, enum reserve_mode mode,
                 uint64_t need_dist, uint64_t *off, void **ptr);
/* Empty tier of every copy nobody holds and rewind its allocator (the lock is dropped
 * meanwhile): 0 or the -errno of a write-back that could not start. */
int tier_compact(struct zinf_engine *e, int tier);
void prefetch_consumed(struct zinf_engine *e, struct tensor *t, struct copy *c);
/* A load started ahead of use, charged to the prefetch budget (once per copy). */
void prefetch_charge(struct zinf_engine *e, struct tensor *t, struct copy *c);
void prefetch_wasted(struct zinf_engine *e, struct tensor *t, struct copy *c);

/* fetch.c */
int fetch_locked(struct zinf_engine *e, struct tensor *t, int tier, bool prefetch, void **ptr);
/* engine_api_fetch with the lock held. */
int fetch_pinned(struct zinf_engine *e, zinf_tensor h, int tier, void **ptr);
/* 0 for a memory tier (ZINF_TIER_DEVICE, ZINF_TIER_HOST), else -EINVAL. */
int fetch_check_tier(enum zinf_tier tier);

/* release.c */
/* What engine_release_abandoned does after the release (lock held): 1 when the copy was
 * kept as it is. */
int abandon_locked(struct zinf_engine *e, struct tensor *t, int tier);

/* xfer.c */
int xfer_start(struct xfer *x);
int staging_init(struct zinf_engine *e, unsigned nslots);
void staging_fini(struct zinf_engine *e);
int tier_alloc(struct zinf_engine *e, int tier, size_t bytes, uint64_t *off, void **ptr);
/* Wait (engine lock held) until c is no longer LOADING, counting the time as a stall for
 * NVMe, a copy or room by what it loads from. */
void engine_wait_loaded(struct zinf_engine *e, struct copy *c);
void tier_free(struct zinf_engine *e, int tier, uint64_t off);
/* The bytes a memory tier has allocated now. */
uint64_t tier_used(struct zinf_engine *e, int tier);
extern const char *const tier_used_name[MEM_TIERS];
/* The engine's counters into the trace (lock held): at most once a millisecond, or now. */
void engine_trace_counters(struct zinf_engine *e, bool force);
/* The next allocation in tier looks from the arena's start (after tier_compact). */
void tier_rewind(struct zinf_engine *e, int tier);
/* Synchronous helpers that run without the engine lock (the caller holds the tensor
 * exclusively or as a reader). */
int swap_read_range(struct zinf_engine *e, struct tensor *t, uint64_t swap_off, size_t off,
                    void *dst, size_t n);
/* The same, for a read-only engine: the whole extent is read and checked against the
 * manifest's checksum; -ESTALE or -EBADMSG (engine_checksum_failed) when it fails. */
int swap_read_checked(struct zinf_engine *e, struct tensor *t, size_t off, void *dst, size_t n);
/* A read-only engine read content that failed its checksum: -ESTALE where the saved state
 * was replaced since the engine read it (the writer may have reused the extent), else
 * -EBADMSG (damage). Reads the manifest. */
int engine_checksum_failed(struct zinf_engine *e);
/* zinf_read/zinf_write of swap extents move at most this much through one buffer. */
#define RANGE_CHUNK_BYTES ((size_t)8 << 20)
int swap_write_merged(struct zinf_engine *e, uint64_t from, bool from_zero, uint64_t to,
                      size_t extent_bytes, size_t off, const void *src, size_t n);
int swap_write_range(struct zinf_engine *e, uint64_t swap_off, size_t off, const void *src,
                     size_t n, size_t extent_bytes, bool zero_first, void **undo, size_t *undo_off,
                     size_t *undo_len);
int xfer_run_sync(struct zinf_engine *e, struct xfer *x);

/* sched.c */
void sched_on_fetch(struct zinf_engine *e, struct tensor *t, int tier);
void sched_on_step(struct zinf_engine *e);
void sched_forget_tensor(struct zinf_engine *e, uint32_t tidx);
void sched_free(struct sched *s);
/* May a prefetch of bytes start now, within the prefetch budget? */
bool prefetch_fits(struct zinf_engine *e, size_t bytes);
/* Fetches until (t, tier) is next needed; UINT64_MAX when the schedule does not say. */
uint64_t sched_distance(struct zinf_engine *e, uint32_t tidx, int tier);
bool sched_write_behind(struct zinf_engine *e, const struct tensor *t, int tier);
void sched_prefetch(struct zinf_engine *e);

/* manifest.c (its internals for persist.c and resume.c: manifest.h) */
uint32_t crc32c(uint32_t crc, const void *buf, size_t len);
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, size_t len2);
/* The tags of dir's current manifest (tags[0]) and of its previous version (tags[1]),
 * without opening anything: -1 where a manifest has no tag or there is none. 0, or -ENOENT
 * where there is no saved state, or -errno. */
int persist_versions(const char *dir, int64_t tags[2]);
int persist_remove_manifest(struct zinf_engine *e);
/* Where the manifest of swap directory dir lives. */
void persist_manifest_path(const char *dir, char *buf, size_t len);
/* Is there a saved state in swap directory dir? 0 with *ntensors the tensors its manifest
 * names (SIZE_MAX when it cannot be read: a state all the same) and, when id is not NULL,
 * a checksum of the manifest's bytes (a different value means a different state);
 * -ENOENT where there is no manifest (or no dir); another -errno when it cannot tell. */
int persist_probe(const char *dir, size_t *ntensors, uint32_t *id);
/* When the saved state in dir was last committed (its manifest's mtime); -ENOENT: none. */
int persist_saved_at(const char *dir, struct timespec *when);

/* persist.c */
int persist_flush(struct zinf_engine *e);
/* persist_flush, the manifest tagged (tag >= 0; -1: none) and, with keep, the previous
 * manifest and what it names kept as the previous version (at most one: a version kept
 * before goes). Lock held. */
int persist_flush_tagged(struct zinf_engine *e, int64_t tag, bool keep);
/* Forget the previous version: its manifest is removed, its extents freed. Lock held. */
int persist_drop_previous(struct zinf_engine *e);

/* resume.c */
int persist_resume(struct zinf_engine *e);
/* The resume running in this process (the last one to start): the bytes of the tensors its
 * manifest names, and of those read and verified so far. A tool's progress bar reads it
 * from another thread while the engine opens. */
struct resume_progress {
    _Atomic uint64_t total, done;
};
extern struct resume_progress resume_progress;

#endif
