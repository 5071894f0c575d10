/*
 * fetch.c - residency: bringing a copy into a tier (fetch, prefetch), making room for it
 * (eviction by next use, LRU without a schedule), writing dirty copies back to their home,
 * and the state changes of release.
 *
 * All of it runs with the engine lock held; loads and write-backs are started here and
 * finish in xfer.c's callbacks, which end in load_done()/wb_done() below.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "trace.h"

void engine_wait(struct zinf_engine *e)
{
    pthread_cond_wait(&e->changed, &e->lock);
}

void engine_wait_until(struct zinf_engine *e, uint64_t deadline)
{
    struct timespec ts = {.tv_sec = (time_t)(deadline / 1000000000u),
                          .tv_nsec = (long)(deadline % 1000000000u)};
    pthread_cond_timedwait(&e->changed, &e->lock, &ts);
}

void copy_link(struct zinf_engine *e, struct copy *c, int tier)
{
    struct copy *h = &e->res[tier];
    c->res_next = h->res_next;
    c->res_prev = h;
    h->res_next->res_prev = c;
    h->res_next = c;
}

static void copy_unlink(struct copy *c)
{
    if (!c->res_next) return;
    c->res_prev->res_next = c->res_next;
    c->res_next->res_prev = c->res_prev;
    c->res_next = c->res_prev = NULL;
}

void prefetch_consumed(struct zinf_engine *e, struct tensor *t, struct copy *c)
{
    if (!c->prefetched) return;
    c->prefetched = false;
    e->prefetch_outstanding_bytes -= t->alloc_bytes;
}

/* A load started ahead of use is charged to the prefetch budget once, however often the
 * copy is prefetched again before a fetch consumes it. */
static void prefetch_charge(struct zinf_engine *e, struct tensor *t, struct copy *c)
{
    e->st.prefetches++;
    if (c->prefetched) return;
    c->prefetched = true;
    e->prefetch_outstanding_bytes += t->alloc_bytes;
}

/* A prefetched copy that will never be used as it is (dropped, overtaken, unregistered). */
void prefetch_wasted(struct zinf_engine *e, struct tensor *t, struct copy *c)
{
    if (!c->prefetched) return;
    e->st.prefetch_wasted++;
    prefetch_consumed(e, t, c);
}

/* Drop a cached copy (never a home copy). The caller checked it is unpinned and unread. */
void copy_drop(struct zinf_engine *e, struct tensor *t, int tier)
{
    struct copy *c = &t->c[tier];
    if (tier == (int)t->home || c->state == COPY_NONE) return;
    prefetch_wasted(e, t, c);
    copy_unlink(c);
    tier_free(e, tier, c->off);
    undo_free(c);
    c->state = COPY_NONE;
    c->ptr = NULL;
    c->version = 0;
    pthread_cond_broadcast(&e->changed);
    ENGINE_CHECK(t);
}

static bool copy_valid(const struct tensor *t, int tier)
{
    const struct copy *c = &t->c[tier];
    return c->state == COPY_READY && c->version == t->version;
}

/* Must this copy reach the home before it is dropped? Only when it holds the newest
 * content and nothing else durable or cached does. */
static bool needs_writeback(const struct tensor *t, int tier)
{
    int other = 1 - tier;
    if (!copy_valid(t, tier) || engine_home_valid(t)) return false;
    if (other != (int)t->home && copy_valid(t, other) && !t->c[other].evicting) return false;
    return true;
}

/* ---- write-back ------------------------------------------------------------------- */

struct wb_arg {
    int tier;
    bool new_extent;
    uint64_t new_off;
    uint64_t home_old_version;
};

/* An eviction, on the trace: the tensor, and how (clean, or after its write-back). */
static void trace_evict(const struct tensor *t, int tier, const char *how)
{
    if (trace_on())
        trace_instant("engine", tier == ZINF_TIER_DEVICE ? "evict from device" : "evict from host",
                      t->name, how, (int64_t)t->alloc_bytes);
}

static void wb_done(struct xfer *x, int err)
{
    struct zinf_engine *e = x->e;
    struct tensor *t = x->t;
    struct wb_arg *a = x->arg;
    struct copy *c = &t->c[a->tier];

    c->readers--;
    c->wb_inflight = false;
    c->wb_behind = false;
    if (err) {
        log_error("engine: writing tensor '%s' back to its home failed: %s; its newest "
                  "content stays in memory (a flush tries again)",
                  t->name, zinf_strerror(err));
        if (a->new_extent) nvme_free(e->nvme, a->new_off);
        if (t->home != ZINF_TIER_NVME) {
            struct copy *h = &t->c[t->home];
            h->state = COPY_READY;
            h->version = a->home_old_version;
            h->err = err; /* for fetches of the home that joined the write-back */
        }
        c->evicting = false;
        /* Eviction passes over this content from now on rather than retry it for ever;
         * a new version or a flush clears the mark. The load result (c->err) is not
         * touched: it belongs to this copy's loads and their waiters. */
        c->wb_failed_version = x->version;
        c->wb_failed_epoch = e->reserve_epoch;
    } else {
        if (t->home == ZINF_TIER_NVME) {
            if (a->new_extent) {
                /* An extent a manifest names is freed by the flush that stops naming it. */
                if (t->has_swap && !engine_swap_named(t)) nvme_free(e->nvme, t->swap_off);
                t->swap_off = a->new_off;
                t->has_swap = true;
            }
            t->swap_version = x->version;
            t->swap_crc_valid = false;
        } else {
            t->c[t->home].state = COPY_READY;
            t->c[t->home].version = x->version;
        }
        e->st.tier[a->tier].writebacks++;
        e->prefetch_kick = true;
        undo_settle(e, t); /* the home holds the content now: images may go */
        if (c->evicting) {
            c->evicting = false;
            if (c->pins == 0 && c->readers == 0 && !needs_writeback(t, a->tier)) {
                trace_evict(t, a->tier, "after its write-back");
                copy_drop(e, t, a->tier);
                e->st.tier[a->tier].evictions++;
                t->evicted_step[a->tier] = e->st.steps + 1;
            }
        }
    }
    ENGINE_CHECK(t);
    free(a);
    free(x);
}

/* Start writing the copy in tier back to the tensor's home. With evict, the copy is
 * dropped when that is done (unless someone pinned it meanwhile). */
int writeback_start(struct zinf_engine *e, struct tensor *t, int tier, bool evict)
{
    struct copy *c = &t->c[tier];
    struct xfer *x = calloc(1, sizeof(*x));
    struct wb_arg *a = calloc(1, sizeof(*a));
    int r;

    if (!x || !a) {
        r = -ENOMEM;
        goto err;
    }
    /* One write-back per tensor at a time: two (of different versions, from the two
     * tiers) into the same extent could land in either order, and the later completion
     * would label the extent with its version whatever bytes won. */
    for (int i = 0; i < MEM_TIERS; i++) {
        if (t->c[i].wb_inflight) {
            r = -EAGAIN;
            goto err;
        }
    }
    a->tier = tier;
    *x = (struct xfer){.e = e,
                       .t = t,
                       .src = tier,
                       .src_off = c->off,
                       .src_ptr = c->ptr,
                       .len = t->alloc_bytes,
                       .version = t->version,
                       .arg = a,
                       .done = wb_done,
                       .what = evict ? "write-back to evict" : "write-back"};
    if (t->home == ZINF_TIER_NVME) {
        /* Never overwrite an extent a manifest (committed or being written) names: write
         * elsewhere and switch over when done (a crash mid-write then leaves the old
         * content whole). */
        if (!t->has_swap || engine_swap_named(t)) {
            /* Never grows the files here (-EAGAIN then: tier_reserve() grows them with the
             * lock dropped and looks again). */
            r = nvme_alloc_nogrow(e->nvme, t->alloc_bytes, &a->new_off);
            if (r == -EAGAIN) r = -ENOBUFS;
            if (r < 0) goto err;
            a->new_extent = true;
            x->dst_off = a->new_off;
        } else {
            x->dst_off = t->swap_off;
        }
        x->dst = ZINF_TIER_NVME;
    } else {
        struct copy *h = &t->c[t->home];
        if (h->state != COPY_READY || copy_pinned(e, t, t->home) || h->readers) {
            r = -EAGAIN;
            goto err;
        }
        x->dst = t->home;
        x->dst_off = h->off;
        x->dst_ptr = h->ptr;
        a->home_old_version = h->version;
        h->state = COPY_LOADING; /* its content is being replaced */
        h->loading_from = LOADING_WRITEBACK;
        h->err = 0;
    }
    c->readers++;
    c->wb_inflight = true;
    if (evict) c->evicting = true;
    r = xfer_start(x);
    if (r < 0) {
        c->readers--;
        c->wb_inflight = false;
        c->evicting = false;
        if (t->home != ZINF_TIER_NVME) t->c[t->home].state = COPY_READY;
        if (a->new_extent) nvme_free(e->nvme, a->new_off);
        goto err;
    }
    ENGINE_CHECK(t);
    return 0;
err:
    free(a);
    free(x);
    return r;
}

/* ---- making room -------------------------------------------------------------------- */

/* Has the write-back of exactly this copy's content failed during the current call that
 * makes room, so that evicting it again would only fail again? Each later call (another
 * fetch, a register) tries it once more, so a passing fault costs one call an -EIO and a
 * drive gone bad costs each call one attempt, never a loop. */
static bool writeback_failed(const struct zinf_engine *e, const struct tensor *t, int tier)
{
    const struct copy *c = &t->c[tier];
    return c->wb_failed_version && c->wb_failed_version == c->version &&
           c->wb_failed_epoch == e->reserve_epoch && needs_writeback(t, tier);
}

static struct copy *pick_victim(struct zinf_engine *e, int tier, bool prefetch, uint64_t need_dist,
                                bool *skipped_failed)
{
    struct copy *best = NULL;
    uint64_t best_d = 0;

    for (struct copy *c = e->res[tier].res_next; c != &e->res[tier]; c = c->res_next) {
        struct tensor *t = c->t;
        if (c->state != COPY_READY || copy_held(e, c) || c->readers || c->evicting ||
            t->exclusive)
            continue;
        if (writeback_failed(e, t, tier)) {
            *skipped_failed = true;
            continue;
        }
        uint64_t d = c->version != t->version ? UINT64_MAX : sched_distance(e, t->index, tier);
        /* A prefetch never evicts what is needed as soon as or sooner than what it brings,
         * nor another prefetch that has not been used yet. */
        if (prefetch && (c->prefetched || (d <= need_dist && d != UINT64_MAX))) continue;
        if (prefetch && need_dist == UINT64_MAX && d != UINT64_MAX) continue;
        if (!best || d > best_d || (d == best_d && c->last_use < best->last_use)) {
            best = c;
            best_d = d;
        }
    }
    return best;
}

static bool tier_has_transients(struct zinf_engine *e, int tier)
{
    for (struct copy *c = e->res[tier].res_next; c != &e->res[tier]; c = c->res_next)
        if (c->state == COPY_LOADING || c->readers || c->evicting || c->t->exclusive) return true;
    return false;
}

static uint64_t tier_capacity(struct zinf_engine *e, int tier)
{
    return e->st.tier[tier].capacity_bytes;
}

/* Room must come from another thread's work (a write-back, a load, a pin going): wait
 * for a change and answer -EAGAIN (the caller looks at everything again, the lock having
 * been dropped), or answer -EINPROGRESS at once when the caller may not wait. (Not
 * -EWOULDBLOCK: on Linux that is -EAGAIN, which means "waited, look again".) */
static int reserve_wait(struct zinf_engine *e, enum reserve_mode mode)
{
    if (mode == RESERVE_NOWAIT) return -EINPROGRESS;
    engine_wait(e);
    return -EAGAIN;
}

/* Make v's room free: 0 when it was dropped (look again at once); -EAGAIN when it waited
 * for its write-back (the lock was dropped: the caller looks at everything again);
 * -EINPROGRESS when it would have waited in RESERVE_NOWAIT; -ENOSPC for a prefetch that
 * would need a write-back; or another -errno. */
static int evict_victim(struct zinf_engine *e, int tier, struct copy *v, enum reserve_mode mode)
{
    struct tensor *vt = v->t;
    int r;

    if (copy_pinned(e, vt, tier)) return 0; /* a client pinned it just now: pick again */
    if (v->version != vt->version) {
        copy_drop(e, vt, tier); /* stale: nothing to keep */
        return 0;
    }
    if (needs_writeback(vt, tier)) {
        if (mode == RESERVE_PREFETCH) return -ENOSPC; /* a hint never waits for a write-back */
        r = writeback_start(e, vt, tier, true);
        if (r == -ENOBUFS) {
            /* Its new extent needs the swap files to grow: never under the engine lock. A
             * blocking caller grows them with the lock dropped and looks again; the others
             * leave it to a blocking call. */
            if (mode != RESERVE_WAIT) return -EINPROGRESS;
            r = engine_grow_swap(e, vt->alloc_bytes);
            return r < 0 ? r : -EAGAIN;
        }
        if (r < 0 && r != -EAGAIN) return r;
        /* A write-back whose submission failed at once has finished already (and marked its
         * content failed): nothing will broadcast, so look again now. */
        if (r == 0 && !v->wb_inflight) return 0;
        return reserve_wait(e, mode);
    }
    trace_evict(vt, tier, "clean");
    copy_drop(e, vt, tier);
    e->st.tier[tier].evictions++;
    vt->evicted_step[tier] = e->st.steps + 1;
    return 0;
}

/* Allocate bytes in tier, evicting as needed. Returns 0; -EAGAIN when it waited (the
 * caller re-checks everything: the lock was dropped); -EINPROGRESS when it would have
 * waited in RESERVE_NOWAIT (a write-back it needs was started); -ENOSPC for a prefetch
 * that does not fit (or into a tier being compacted); -ENOMEM when even evicting every
 * unpinned copy would not make room; -EIO when only copies whose write-back failed stand in
 * the way; or another -errno. */
int tier_reserve(struct zinf_engine *e, int tier, size_t bytes, enum reserve_mode mode,
                 uint64_t need_dist, uint64_t *off, void **ptr)
{
    bool prefetch = mode == RESERVE_PREFETCH;

    if (bytes > tier_capacity(e, tier)) return -ENOMEM;
    if (prefetch && e->compacting[tier])
        return -ENOSPC; /* zinf_fetch_all() is laying a set out in it */
    for (;;) {
        int r = tier_alloc(e, tier, bytes, off, ptr);
        if (r != -ENOSPC) return r;
        bool skipped_failed = false;
        struct copy *v = pick_victim(e, tier, prefetch, need_dist, &skipped_failed);
        if (!v) {
            if (prefetch) return -ENOSPC;
            if (tier_has_transients(e, tier)) return reserve_wait(e, mode);
            return skipped_failed ? -EIO : -ENOMEM;
        }
        if ((r = evict_victim(e, tier, v, mode)) < 0) return r;
    }
}

/* Empty tier of every copy nobody holds: evict them all (dirty ones written back first),
 * waiting for loads, write-backs and other threads' zinf_read/zinf_write to end, then let
 * the next allocation look from the arena's start. What stays is pinned or a home, so the
 * free space is as few runs as those allow: one, after the homes, when nothing is pinned.
 * The lock is dropped while it waits. Returns 0 or the -errno of a write-back that could
 * not start. */
static int tier_compact(struct zinf_engine *e, int tier)
{
    for (;;) {
        bool skipped_failed = false;
        struct copy *v = pick_victim(e, tier, false, 0, &skipped_failed);
        if (!v) {
            if (!tier_has_transients(e, tier)) break;
            engine_wait(e);
            continue;
        }
        int r = evict_victim(e, tier, v, RESERVE_WAIT);
        if (r < 0 && r != -EAGAIN) return r;
    }
    tier_rewind(e, tier);
    e->st.compactions++;
    return 0;
}

/* ---- loading ---------------------------------------------------------------------- */

struct load_arg {
    int tier, src;
    uint64_t old_version;
};

/* The transitions of a load (see the drawing in engine.h). */

/* NONE, or READY and stale -> LOADING, for the tensor's current version. A cache copy
 * that was NONE has had its room reserved and is put on its tier's list. */
static void copy_load_begin(struct zinf_engine *e, struct tensor *t, int tier, bool fresh,
                            uint64_t off, void *ptr)
{
    struct copy *c = &t->c[tier];
    if (fresh) {
        c->off = off;
        c->ptr = ptr;
        c->t = t;
        copy_link(e, c, tier);
    }
    c->state = COPY_LOADING;
    c->err = 0;
    c->version = t->version;
}

/* LOADING -> READY with the version the load brought; a cache copy overtaken meanwhile
 * by a newer version, and not pinned, is dropped at once. */
static void copy_load_ok(struct zinf_engine *e, struct tensor *t, int tier, uint64_t version)
{
    struct copy *c = &t->c[tier];
    c->state = COPY_READY;
    c->err = 0;
    c->version = version;
    if (version != t->version && c->pins == 0) copy_drop(e, t, tier);
    undo_settle(e, t); /* an asynchronous fetch's pin waited for this content */
    pthread_cond_broadcast(&e->changed);
}

/* LOADING -> NONE for a cache copy (its room is freed), -> READY with its old label for
 * the home copy (whose bytes were stale anyway). err (0 when the load never started) is
 * kept for the fetches that joined it. */
static void copy_load_failed(struct zinf_engine *e, struct tensor *t, int tier,
                             uint64_t old_version, int err)
{
    struct copy *c = &t->c[tier];
    c->err = err;
    prefetch_consumed(e, t, c);
    if (tier == (int)t->home) {
        c->state = COPY_READY;
        c->version = old_version;
    } else {
        c->state = COPY_NONE;
        copy_unlink(c);
        tier_free(e, tier, c->off);
        c->ptr = NULL;
        c->version = 0;
    }
    pthread_cond_broadcast(&e->changed);
}

static void load_done(struct xfer *x, int err)
{
    struct zinf_engine *e = x->e;
    struct tensor *t = x->t;
    struct load_arg *a = x->arg;

    if (a->src < MEM_TIERS) t->c[a->src].readers--;
    /* A read-only engine's load from swap: the bytes must be the tensor's (see manifest_id). */
    if (!err && x->want_crc && t->swap_crc_valid && x->crc != t->swap_crc)
        err = engine_checksum_failed(e);
    if (err)
        copy_load_failed(e, t, a->tier, a->old_version, err);
    else
        copy_load_ok(e, t, a->tier, x->version);
    ENGINE_CHECK(t);
    free(a);
    free(x);
}

/* Where can tier's copy be loaded from? A tier number, SRC_ZERO, ZINF_TIER_NVME, -EAGAIN
 * (a source is still arriving: wait) or -EIO (no valid copy anywhere: a bug). */
static int pick_source(struct tensor *t, int tier)
{
    int other = 1 - tier;
    if (copy_valid(t, other) && !(other == (int)t->home && t->c[other].state != COPY_READY))
        return other;
    if (t->home == ZINF_TIER_NVME) {
        if (t->zero) return SRC_ZERO;
        if (t->has_swap && t->swap_version == t->version) return ZINF_TIER_NVME;
    }
    if (t->c[other].state == COPY_LOADING || t->c[other].wb_inflight) return -EAGAIN;
    return -EIO;
}

static int load_start(struct zinf_engine *e, struct tensor *t, int tier, int src,
                      uint64_t old_version)
{
    struct copy *c = &t->c[tier];
    struct xfer *x;
    struct load_arg *a;
    int r;

    if (src == SRC_ZERO && tier == ZINF_TIER_HOST) {
        /* Zeros come from nowhere: fill in place, now. (In device memory they are queued
         * on the copy stream like a load, below: a synchronous memset there would wait
         * for every copy in flight with the engine lock held.) */
        memset(c->ptr, 0, t->alloc_bytes);
        copy_load_ok(e, t, tier, t->version);
        return 0;
    }
    x = calloc(1, sizeof(*x));
    a = calloc(1, sizeof(*a));
    if (!x || !a) {
        free(x);
        free(a);
        return -ENOMEM;
    }
    *a = (struct load_arg){.tier = tier, .src = src, .old_version = old_version};
    *x = (struct xfer){.e = e,
                       .t = t,
                       .src = src,
                       .dst = tier,
                       .dst_off = c->off,
                       .dst_ptr = c->ptr,
                       .len = t->alloc_bytes,
                       .version = t->version,
                       .arg = a,
                       .done = load_done,
                       .what = "load"};
    c->loading_from = (int8_t)src;
    if (src == ZINF_TIER_NVME) {
        x->src_off = t->swap_off;
        x->want_crc = (e->opt.flags & ZINF_OPEN_READONLY) && t->swap_crc_valid &&
                      t->swap_version == t->version;
    } else if (src < MEM_TIERS) {
        x->src_off = t->c[src].off;
        x->src_ptr = t->c[src].ptr;
        t->c[src].readers++;
    }
    r = xfer_start(x);
    if (r < 0) {
        if (src < MEM_TIERS) t->c[src].readers--;
        free(a);
        free(x);
    }
    return r;
}

enum fetch_mode { FETCH_BLOCK, FETCH_ASYNC, FETCH_PREFETCH };

/* Bring t into tier. FETCH_BLOCK pins and waits; FETCH_ASYNC pins and returns once the
 * load has started (-EWOULDBLOCK if it cannot start without waiting); FETCH_PREFETCH
 * starts a load without a pin and gives up quietly rather than wait or evict something
 * needed sooner. */
/* Time spent blocked in a fetch counts from its first wait. */
static void clock_start(bool *waited, uint64_t *t0)
{
    if (!*waited) {
        *waited = true;
        *t0 = now_ns();
    }
}

/* What a fetch waits for, in zinf_stats' blocked_*_ns. */
enum stall { STALL_NVME, STALL_COPY, STALL_ROOM, STALL_PIN };

static void stall_add(struct zinf_engine *e, enum stall k, uint64_t since)
{
    uint64_t d = now_ns() - since;
    switch (k) {
    case STALL_NVME: e->st.blocked_nvme_ns += d; break;
    case STALL_COPY: e->st.blocked_copy_ns += d; break;
    case STALL_ROOM: e->st.blocked_room_ns += d; break;
    default: e->st.blocked_pin_ns += d; break;
    }
}

/* Waiting for a copy that is LOADING: for NVMe, for a copy between memories, or for the
 * write-back that replaces a home copy. */
static enum stall loading_stall(const struct copy *c)
{
    return c->loading_from == ZINF_TIER_NVME      ? STALL_NVME
           : c->loading_from == LOADING_WRITEBACK ? STALL_ROOM
                                                  : STALL_COPY;
}

void engine_wait_loaded(struct zinf_engine *e, struct copy *c)
{
    uint64_t t0 = now_ns();
    enum stall k = loading_stall(c);
    while (c->state == COPY_LOADING)
        engine_wait(e);
    stall_add(e, k, t0);
}

/* A fetch that has to wait for another thread's work: the non-blocking modes give up (a
 * prefetch quietly, an async fetch with -EWOULDBLOCK); a blocking one starts its clock,
 * waits for a change and answers 1: look again. These waits are for pins (a caller's
 * hold, a transfer reading the copy, exclusive access). */
static int wait_for_change(struct zinf_engine *e, enum fetch_mode mode, bool *waited, uint64_t *t0)
{
    if (mode != FETCH_BLOCK) return mode == FETCH_PREFETCH ? 0 : -EWOULDBLOCK;
    clock_start(waited, t0);
    uint64_t w0 = now_ns();
    engine_wait(e);
    stall_add(e, STALL_PIN, w0);
    return 1;
}

static int fetch_mode(struct zinf_engine *e, struct tensor *t, int tier, enum fetch_mode mode,
                      uint64_t need_dist, void **ptr)
{
    bool pinned = false, waited = false, started = false;
    zinf_tensor h = t->handle;
    uint64_t t0 = 0, span0 = mode == FETCH_BLOCK && trace_on() ? now_ns() : 0;
    const char *how = NULL; /* for the trace: hit, join (a load in flight) or load */
    int r = 0;

    if (mode != FETCH_PREFETCH)
        e->reserve_epoch++; /* a new call: write-backs that failed earlier may be retried */

    for (;;) {
        /* Every wait comes back here: without a pin, another thread may have unregistered
         * the tensor meanwhile (t must not be touched then). */
        if (!pinned && !engine_revalidate(e, h, t)) {
            r = -EINVAL;
            goto out;
        }
        struct copy *c = &t->c[tier];
        bool stale_home = false;

        if (started && c->state != COPY_LOADING &&
            !(c->state == COPY_READY && c->version == t->version) && c->err) {
            /* The load this call started failed before it could be waited for (its
             * submission was refused): report it rather than start it again for ever. */
            r = c->err;
            if (pinned) {
                c->pins--;
                pinned = false;
                pthread_cond_broadcast(&e->changed);
            }
            goto out;
        }
        if (t->damaged) {
            r = -EBADMSG; /* its saved content failed its checksum at resume */
            goto out;
        }

        if (c->state == COPY_READY && c->version == t->version) {
            if (mode == FETCH_PREFETCH) return 0;
            if (c->wb_behind && !pinned) { /* a caller may write through the pin */
                if ((r = wait_for_change(e, mode, &waited, &t0)) <= 0) goto out;
                continue;
            }
            if (!pinned) c->pins++;
            c->last_use = ++e->clock;
            if (c->prefetched) {
                e->st.prefetch_in_time++;
                prefetch_consumed(e, t, c);
            }
            if (!waited && !started) e->st.tier[tier].hits++;
            if (!how) how = "hit";
            undo_settle(e, t);
            if (ptr) *ptr = c->ptr;
            r = 0; /* an earlier round may have left -EAGAIN from tier_reserve() */
            break;
        }
        if (c->state == COPY_LOADING) {
            if (mode == FETCH_PREFETCH) return 0;
            if (!pinned) {
                c->pins++;
                pinned = true;
                if (c->prefetched) {
                    e->st.prefetch_late++;
                    prefetch_consumed(e, t, c);
                }
            }
            if (!how) how = "join";
            if (mode == FETCH_ASYNC) return 0;
            if (!waited) {
                waited = true;
                t0 = now_ns();
                /* Joining a load still arriving: start what comes next before waiting, or
                 * the drive idles between this tensor's last chunk and the next one's
                 * first. */
                sched_prefetch(e);
            }
            engine_wait_loaded(e, c);
            if (c->state == COPY_READY && c->version == t->version) continue;
            c->pins--;
            pinned = false;
            if (c->state == COPY_NONE || c->err) { /* the load failed */
                r = c->err ? c->err : -EIO;
                pthread_cond_broadcast(&e->changed);
                goto out;
            }
            continue; /* it brought a version already overtaken: load again */
        }
        if (t->exclusive) {
            if ((r = wait_for_change(e, mode, &waited, &t0)) <= 0) goto out;
            continue;
        }
        if (c->state == COPY_READY) { /* holds an older version */
            if (tier != (int)t->home) {
                if (c->pins || c->readers || c->wb_inflight) {
                    if ((r = wait_for_change(e, mode, &waited, &t0)) <= 0) goto out;
                    continue;
                }
                copy_drop(e, t, tier);
                continue;
            }
            if (c->pins || c->readers) {
                /* Pins on a stale home copy are fetches that joined a write-back or a load
                 * whose content was overtaken meanwhile: they let go and load again (a
                 * DIRTY release refuses while a caller holds a real view here). */
                if ((r = wait_for_change(e, mode, &waited, &t0)) <= 0) goto out;
                continue;
            }
            stale_home = true;
        }

        int src = pick_source(t, tier);
        if (src == -EAGAIN) {
            if ((r = wait_for_change(e, mode, &waited, &t0)) <= 0) goto out;
            continue;
        }
        if (src < 0) {
            log_error("engine: tensor '%s' has no valid copy to load from", t->name);
            r = src;
            goto out;
        }
        uint64_t old_version = c->version;
        if (!stale_home && tier != (int)t->home) {
            uint64_t off;
            void *p;
            enum reserve_mode rm = mode == FETCH_PREFETCH ? RESERVE_PREFETCH
                                   : mode == FETCH_ASYNC  ? RESERVE_NOWAIT
                                                          : RESERVE_WAIT;
            /* An asynchronous fetch never waits here (a write-back it needs is started and
             * zinf_wait() fetches); a blocking one looks at everything again after a wait. */
            uint64_t r0 = now_ns();
            r = tier_reserve(e, tier, t->alloc_bytes, rm, need_dist, &off, &p);
            if (r == -EAGAIN) { /* it waited for room: blocked since it began */
                if (!waited) {
                    waited = true;
                    t0 = r0;
                }
                stall_add(e, STALL_ROOM, r0);
                continue;
            }
            if (r == -EINPROGRESS) {
                r = -EWOULDBLOCK; /* zinf_wait() fetches */
                goto out;
            }
            if (r < 0) {
                if (mode == FETCH_PREFETCH) r = 0; /* a hint that does not fit is dropped */
                goto out;
            }
            copy_load_begin(e, t, tier, true, off, p);
        } else {
            copy_load_begin(e, t, tier, false, 0, NULL);
        }
        if (mode == FETCH_PREFETCH) {
            prefetch_charge(e, t, c);
        } else if (!pinned) {
            c->pins++;
            pinned = true;
        }
        r = load_start(e, t, tier, src, old_version);
        if (r < 0) {
            if (pinned) {
                c->pins--;
                pinned = false;
            }
            copy_load_failed(e, t, tier, old_version, 0);
            goto out;
        }
        started = true;
        how = "load";
        if (mode == FETCH_PREFETCH) return 0;
        if (mode == FETCH_ASYNC) return 0;
        /* Start what the schedule says comes next while this one loads. */
        sched_prefetch(e);
        clock_start(&waited, &t0);
    }
out:
    if (waited) e->st.blocked_ns += now_ns() - t0;
    if (r == 0 || pinned || engine_revalidate(e, h, t)) ENGINE_CHECK(t);
    if (span0 && trace_on()) /* the tensor is pinned (r == 0) or may be gone */
        trace_span("engine", tier == ZINF_TIER_DEVICE ? "fetch to device" : "fetch to host", span0,
                   r == 0 ? t->name : NULL, r < 0 ? "failed" : how,
                   r == 0 ? (int64_t)t->alloc_bytes : -1);
    return r;
}

bool prefetch_fits(struct zinf_engine *e, size_t bytes)
{
    if (e->prefetch_outstanding_bytes == 0 && e->prefetch_one_ahead)
        return true; /* a tensor larger than the default budget still runs one ahead */
    return e->prefetch_outstanding_bytes + bytes <= e->prefetch_budget_bytes;
}

int fetch_locked(struct zinf_engine *e, struct tensor *t, int tier, bool prefetch, void **ptr)
{
    if (prefetch) {
        if (!prefetch_fits(e, t->alloc_bytes)) return 0;
        return fetch_mode(e, t, tier, FETCH_PREFETCH, sched_distance(e, t->index, tier), NULL);
    }
    return fetch_mode(e, t, tier, FETCH_BLOCK, 0, ptr);
}

/* ---- the public calls ------------------------------------------------------------------ */

static int check_tier(enum zinf_tier tier)
{
    return tier == ZINF_TIER_DEVICE || tier == ZINF_TIER_HOST ? 0 : -EINVAL;
}

int fetch_pinned(struct zinf_engine *e, zinf_tensor h, int tier, void **ptr)
{
    lease_drain(e);
    struct tensor *t = engine_tensor(e, h);
    if (!t) return -EINVAL;
    e->st.tier[tier].fetches++;
    sched_on_fetch(e, t, tier);
    int r = fetch_mode(e, t, tier, FETCH_BLOCK, 0, ptr);
    if (r == 0) sched_prefetch(e);
    return r;
}

int engine_api_fetch(zinf_engine *e, zinf_tensor h, enum zinf_tier tier, void **ptr)
{
    if (!e || !ptr || check_tier(tier)) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    int r = fetch_pinned(e, h, tier, ptr);
    pthread_mutex_unlock(&e->lock);
    return r;
}

/* Drop the pins fetch_set() took on ts[0..n) (clean releases: nothing was written). */
static void unpin_set(struct zinf_engine *e, const zinf_tensor *ts, size_t n, int tier)
{
    for (size_t i = 0; i < n; i++) {
        struct tensor *t = engine_tensor(e, ts[i]);
        struct copy *c = t ? &t->c[tier] : NULL;
        if (!c || !c->pins) continue; /* cannot happen: a pinned tensor is never unregistered */
        c->pins--;
        c->last_use = ++e->clock;
        undo_settle(e, t);
        ENGINE_CHECK(t);
    }
    pthread_cond_broadcast(&e->changed);
}

/* Fetch and pin ts[0..n) in order; *done says how many were pinned when it stopped. Every
 * handle is looked up again (the lock may have been dropped since the caller did). */
static int fetch_set(struct zinf_engine *e, const zinf_tensor *ts, size_t n, int tier,
                     bool first_pass, void **ptrs, size_t *done)
{
    int r = 0;
    for (*done = 0; *done < n; ++*done) {
        struct tensor *t = engine_tensor(e, ts[*done]);
        if (!t) return -EINVAL;
        if (first_pass) {
            e->st.tier[tier].fetches++;
            sched_on_fetch(e, t, tier);
        }
        if ((r = fetch_mode(e, t, tier, FETCH_BLOCK, 0, &ptrs[*done])) < 0) return r;
    }
    return 0;
}

static int fetch_all(zinf_engine *e, struct engine_pinset *ps, const zinf_tensor *ts, size_t n,
                     enum zinf_tier tier, void **ptrs, bool *leased)
{
    size_t done = 0;
    int r;

    if (!e || (n && (!ts || !ptrs)) || check_tier(tier)) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    lease_drain(e);
    for (size_t i = 0; i < n; i++) {
        if (!engine_tensor(e, ts[i])) {
            pthread_mutex_unlock(&e->lock);
            return -EINVAL;
        }
    }
    r = fetch_set(e, ts, n, tier, true, ptrs, &done);
    if (r == -ENOMEM) {
        /* Room enough, perhaps, but not in one place: let go of the set, empty the tier of
         * what nobody holds and lay the set out again from the start of the arena. The
         * lock is dropped while write-backs land: another thread may unregister a member
         * meanwhile (fetch_set() finds it gone: -EINVAL), or pin what it likes (then the
         * set may still not fit: -ENOMEM). */
        unpin_set(e, ts, done, tier);
        e->compacting[tier]++;
        r = tier_compact(e, tier);
        if (r == 0) r = fetch_set(e, ts, n, tier, false, ptrs, &done);
        e->compacting[tier]--;
    }
    if (r < 0) {
        unpin_set(e, ts, done, tier);
    } else {
        sched_prefetch(e);
        for (size_t i = 0; ps && i < n; i++) /* every member is pinned: none went away */
            leased[i] = lease_open(e, ps, engine_tensor(e, ts[i]), tier);
    }
    pthread_mutex_unlock(&e->lock);
    return r;
}

int engine_api_fetch_all(zinf_engine *e, const zinf_tensor *ts, size_t n, enum zinf_tier tier,
                         void **ptrs)
{
    return fetch_all(e, NULL, ts, n, tier, ptrs, NULL);
}

int engine_api_fetch_all_leased(zinf_engine *e, struct engine_pinset *ps, const zinf_tensor *ts,
                                size_t n, enum zinf_tier tier, void **ptrs, bool *leased)
{
    for (size_t i = 0; i < n; i++)
        leased[i] = false;
    return fetch_all(e, ps, ts, n, tier, ptrs, leased);
}

/* The chain of e->tickets where ticket id is, or would be. e->lock held; e->tickets made. */
static struct ticket **ticket_chain(struct zinf_engine *e, uint64_t id)
{
    return &e->tickets[id & e->tickets_mask];
}

/* Room for one more ticket: the hash doubled when it holds as many as it has chains.
 * -ENOMEM. e->lock held. */
static int ticket_room(struct zinf_engine *e)
{
    size_t n = e->tickets ? e->tickets_mask + 1 : 0;
    if (e->tickets && e->ntickets < n) return 0;
    size_t nn = n ? 2 * n : 64;
    struct ticket **h = calloc(nn, sizeof(*h));
    if (!h) return e->tickets ? 0 : -ENOMEM; /* longer chains, still right */
    for (size_t i = 0; i < n; i++)
        for (struct ticket *k = e->tickets[i], *next; k; k = next) {
            next = k->next;
            k->next = h[k->id & (nn - 1)];
            h[k->id & (nn - 1)] = k;
        }
    free(e->tickets);
    e->tickets = h;
    e->tickets_mask = nn - 1;
    return 0;
}

/* Takes ticket id out of the hash: NULL when it is not open. e->lock held. */
static struct ticket *ticket_take(struct zinf_engine *e, uint64_t id)
{
    if (!e->tickets) return NULL;
    struct ticket **pp = ticket_chain(e, id);
    while (*pp && (*pp)->id != id)
        pp = &(*pp)->next;
    struct ticket *k = *pp;
    if (k) {
        *pp = k->next;
        e->ntickets--;
    }
    return k;
}

int engine_api_fetch_async(zinf_engine *e, zinf_tensor h, enum zinf_tier tier, uint64_t *ticket)
{
    struct tensor *t;
    struct ticket *k;
    int r;

    if (!e || !ticket || check_tier(tier)) return -EINVAL;
    k = calloc(1, sizeof(*k));
    if (!k) return -ENOMEM;
    pthread_mutex_lock(&e->lock);
    lease_drain(e);
    t = engine_tensor(e, h);
    if (!t || ticket_room(e) < 0) {
        pthread_mutex_unlock(&e->lock);
        free(k);
        return t ? -ENOMEM : -EINVAL;
    }
    e->st.tier[tier].fetches++;
    sched_on_fetch(e, t, tier);
    r = fetch_mode(e, t, tier, FETCH_ASYNC, 0, NULL);
    if (r == -EWOULDBLOCK) {
        /* fetch_mode() does not wait in this mode, but whatever it did, a ticket is only
         * handed out for a tensor that is still there. */
        if (!engine_revalidate(e, h, t)) {
            r = -EINVAL;
        } else {
            k->deferred = true; /* zinf_wait() fetches */
            t->c[tier].deferred++;
            r = 0;
        }
    }
    if (r == 0) {
        k->id = ++e->next_ticket;
        k->t = h;
        k->tier = tier;
        k->next = *ticket_chain(e, k->id);
        *ticket_chain(e, k->id) = k;
        e->ntickets++;
        *ticket = k->id;
        sched_prefetch(e);
    } else {
        free(k);
    }
    pthread_mutex_unlock(&e->lock);
    return r;
}

int engine_api_wait(zinf_engine *e, uint64_t ticket, void **ptr)
{
    struct ticket *k;
    struct tensor *t;
    int r;

    if (!e || !ptr) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    k = ticket_take(e, ticket);
    if (!k) {
        pthread_mutex_unlock(&e->lock);
        return -EINVAL;
    }
    t = engine_tensor(e, k->t);
    if (!t) {
        r = -EINVAL;
    } else if (k->deferred) {
        t->c[k->tier].deferred--;
        r = fetch_mode(e, t, k->tier, FETCH_BLOCK, 0, ptr);
    } else {
        /* The pin was taken at zinf_fetch_async(); wait for the copy under it. */
        struct copy *c = &t->c[k->tier];
        uint64_t t0 = now_ns();
        bool waited = c->state == COPY_LOADING;
        if (waited) engine_wait_loaded(e, c);
        if (waited) e->st.blocked_ns += now_ns() - t0;
        if (c->state == COPY_READY && c->version == t->version) {
            *ptr = c->ptr;
            r = 0;
        } else {
            c->pins--;
            pthread_cond_broadcast(&e->changed);
            if (c->state == COPY_NONE || c->err)
                r = c->err ? c->err : -EIO;
            else /* the load it joined brought a version overtaken meanwhile: load again */
                r = fetch_mode(e, t, k->tier, FETCH_BLOCK, 0, ptr);
        }
    }
    pthread_mutex_unlock(&e->lock);
    free(k);
    return r;
}

int engine_ticket_drop(zinf_engine *e, uint64_t ticket)
{
    if (!e) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    struct ticket *k = ticket_take(e, ticket);
    struct tensor *t = k ? engine_tensor(e, k->t) : NULL;
    if (t && k->deferred) {
        t->c[k->tier].deferred--; /* its load never started: nothing to undo */
        pthread_cond_broadcast(&e->changed);
    } else if (t) {
        /* The pin taken at zinf_fetch_async(), given back once its load is over (a load
         * in flight owns the copy until then). Its caller never saw the pointer: nothing
         * was written through it. */
        struct copy *c = &t->c[k->tier];
        if (c->state == COPY_LOADING) engine_wait_loaded(e, c);
        if ((t = engine_tensor(e, k->t))) {
            c = &t->c[k->tier];
            c->pins--;
            undo_settle(e, t);
            pthread_cond_broadcast(&e->changed);
        }
    }
    pthread_mutex_unlock(&e->lock);
    int r = k ? 0 : -EINVAL;
    free(k);
    return r;
}

int engine_api_prefetch(zinf_engine *e, zinf_tensor h, enum zinf_tier tier)
{
    struct tensor *t;
    int r;

    if (!e || check_tier(tier)) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    lease_drain(e);
    t = engine_tensor(e, h);
    r = t ? fetch_locked(e, t, tier, true, NULL) : -EINVAL;
    pthread_mutex_unlock(&e->lock);
    return r;
}

/* Does nobody but the caller hold t? No deferred fetch, and no pin on either copy but the
 * caller's own on tier's (tier -1: it holds none; with ps, the one it took from ps's slot,
 * whose lease stays open and counts one there, and through which it holds no other). Idle
 * leases are closed before the pins are counted: a lease a client pins with atomics meanwhile
 * fails to close and is counted as the pin it is. */
static bool held_by_caller_alone(struct zinf_engine *e, struct tensor *t, int tier,
                                 const struct engine_pinset *ps)
{
    for (int i = 0; i < MEM_TIERS; i++) {
        struct copy *c = &t->c[i];
        bool mine = i == tier;
        lease_close_idle(e, t, i, mine ? ps : NULL);
        if (c->deferred || c->pins != (mine ? 1u : 0u)) return false;
        if (mine && ps && lease_count(ps, t, i)) return false;
    }
    return true;
}

/* t's content becomes zeros, no copy held (held_by_caller_alone, the caller's pin gone). A new
 * version with t->zero set, so that a fetch fills zeros (pick_source) and a flush writes a
 * zero entry; the copies go now where nothing reads them, else as overtaken ones do (a load
 * in flight lands stale and is dropped, a write-back lands under a newer version). */
static void content_zero(struct zinf_engine *e, struct tensor *t, const char *why)
{
    t->version++;
    t->zero = true;
    t->swap_crc_valid = false;
    for (int i = 0; i < MEM_TIERS; i++) {
        struct copy *x = &t->c[i];
        x->wb_failed_version = 0;
        prefetch_wasted(e, t, x);
        if (x->state == COPY_READY && !x->readers && !x->wb_inflight) copy_drop(e, t, i);
    }
    if (trace_on()) trace_instant("engine", "zeroed", t->name, why, (int64_t)t->alloc_bytes);
    lease_publish(e);
    undo_settle(e, t);
    pthread_cond_broadcast(&e->changed);
    ENGINE_CHECK(t);
}

/* ZINF_RELEASE_ZERO of t's copy in tier, whose pin (ps: one in ps's slot, already taken) is
 * the caller's: with nobody else holding either copy, the content becomes zeros. -EBUSY,
 * with the pin kept, where another caller holds a copy or a fetch waits to load one. */
static int release_zero(struct zinf_engine *e, struct engine_pinset *ps, struct tensor *t,
                        int tier)
{
    if (!held_by_caller_alone(e, t, tier, ps)) {
        if (ps) lease_untake(ps, t, tier);
        return -EBUSY;
    }
    if (ps) {
        lease_close_idle(e, t, tier, NULL); /* its lease, idle now, goes with the pin */
        if (t->c[tier].pins) {
            /* Another thread of the session pinned it through the slot just now: the lease
             * stays open, and the pin this release took goes back to it. */
            lease_untake(ps, t, tier);
            return -EBUSY;
        }
    } else {
        t->c[tier].pins--;
    }
    content_zero(e, t, "released as spent");
    return 0;
}

int engine_api_zero(zinf_engine *e, zinf_tensor h)
{
    struct tensor *t;
    int r = 0;

    if (!e) return -EINVAL;
    if (e->opt.flags & ZINF_OPEN_READONLY) return -EROFS;
    pthread_mutex_lock(&e->lock);
    lease_drain(e);
    for (;;) {
        t = engine_tensor(e, h);
        if (!t || t->home != ZINF_TIER_NVME) {
            r = -EINVAL;
            goto out;
        }
        /* zinf_read/zinf_write/flush own it with the lock dropped: their copies stay. */
        if (!t->exclusive) break;
        engine_wait(e);
    }
    if (held_by_caller_alone(e, t, -1, NULL))
        content_zero(e, t, "zinf_zero");
    else
        r = -EBUSY;
out:
    pthread_mutex_unlock(&e->lock);
    return r;
}

/* A release of a pin the caller holds: an ordinary one, or (ps) one counted in ps's slot. */
static int release(zinf_engine *e, struct engine_pinset *ps, zinf_tensor h, enum zinf_tier tier,
                   unsigned flags)
{
    struct tensor *t;
    struct copy *c;
    int r = 0;

    const unsigned known = ZINF_RELEASE_DIRTY | ZINF_RELEASE_ZERO;
    bool zero = flags & ZINF_RELEASE_ZERO;
    if (!e || check_tier(tier) || (flags & ~known) || flags == known) return -EINVAL;
    if (flags && (e->opt.flags & ZINF_OPEN_READONLY))
        return -EROFS; /* the pin stays: release it clean */
    pthread_mutex_lock(&e->lock);
    if (ps) lease_drain(e);
    for (;;) {
        t = engine_tensor(e, h);
        if (!t) {
            r = -EINVAL;
            goto out;
        }
        c = &t->c[tier];
        if (c->pins == 0 || c->state != COPY_READY || c->version != t->version ||
            (zero && t->home != ZINF_TIER_NVME)) {
            r = -EINVAL;
            goto out;
        }
        /* zinf_read/zinf_write/flush use the copies with the lock dropped while they own
         * the tensor: a DIRTY release, which makes the other copy stale and may free it,
         * waits for them (they never wait for pins, so this cannot deadlock). The caller's
         * pin keeps the tensor registered, but it is looked up again all the same. */
        if (!flags || !t->exclusive) break;
        engine_wait(e);
    }
    /* From here on the lock stays held: the slot's pin, once taken, is this release's. */
    if (ps && !lease_take(ps, t, tier)) {
        r = -EINVAL; /* the slot counts no pin of the session */
        goto out;
    }
    if (flags & ZINF_RELEASE_DIRTY) {
        int other = 1 - tier;
        struct copy *oc = &t->c[other];
        if (copy_pinned(e, t, other) || oc->deferred) {
            if (ps) lease_untake(ps, t, tier);
            r = -EBUSY; /* another tier holds a view: the pin stays */
            goto out;
        }
        t->version++;
        c->version = t->version;
        c->wb_failed_version = 0;
        t->zero = false;
        prefetch_wasted(e, t, oc); /* whatever was prefetched there is stale now */
        if (other != (int)t->home && oc->state == COPY_READY && !oc->readers && !oc->wb_inflight)
            copy_drop(e, t, other);
        lease_publish(e);
    }
    if (zero) {
        r = release_zero(e, ps, t, tier);
        goto out;
    }
    if (!ps) c->pins--; /* a slot's pin went with lease_take; its lease stays */
    c->last_use = ++e->clock;
    undo_settle(e, t);
    if (c->pins == 0) pthread_cond_broadcast(&e->changed);
    ENGINE_CHECK(t);
    /* Write-behind: the newest content of a copy the step will not use again here goes
     * home now, while the drive has time, so that the fetch that later needs its room
     * finds it clean. A hint: one that cannot start (another write-back of the tensor in
     * flight, swap files that must grow, no memory) is left to eviction, as before. Idle
     * leases on the copy (a client's fetch through the daemon leaves one) are closed
     * first, as eviction closes them: a client could pin a leased copy with atomics alone
     * while the write-back reads it. */
    if ((flags & ZINF_RELEASE_DIRTY) && (int)tier != (int)t->home && !t->exclusive &&
        needs_writeback(t, tier) && !c->wb_inflight && sched_write_behind(e, t, tier) &&
        !copy_pinned(e, t, tier) && writeback_start(e, t, tier, false) == 0) {
        c->wb_behind = true;
        e->st.write_behinds++;
    }
out:
    pthread_mutex_unlock(&e->lock);
    return r;
}

int engine_api_release(zinf_engine *e, zinf_tensor h, enum zinf_tier tier, unsigned flags)
{
    return release(e, NULL, h, tier, flags);
}

int engine_release_leased(zinf_engine *e, struct engine_pinset *ps, zinf_tensor h,
                          enum zinf_tier tier, unsigned flags)
{
    return ps ? release(e, ps, h, tier, flags) : -EINVAL;
}

int abandon_locked(struct zinf_engine *e, struct tensor *t, int tier)
{
    struct copy *c = &t->c[tier];
    if (tier == (int)t->home || needs_writeback(t, tier))
        return 1; /* the home, or the only holder of the newest content: kept as it is */
    if (c->state == COPY_READY && !c->deferred && !c->readers && !c->wb_inflight &&
        !c->evicting && !t->exclusive && !copy_pinned(e, t, tier))
        copy_drop(e, t, tier);
    /* Otherwise another caller holds or reads it now, and sees what it sees. */
    return 0;
}

int engine_release_abandoned(zinf_engine *e, zinf_tensor h, enum zinf_tier tier)
{
    /* First what the copy held when it was pinned, if it is the content's only holder. */
    bool restored = false;
    pthread_mutex_lock(&e->lock);
    struct tensor *rt = engine_tensor(e, h);
    /* Not under another caller's pin: what it wrote there is its own to publish. */
    if (rt && rt->c[tier].pins && copy_held(e, &rt->c[tier]) == 1)
        restored = undo_restore(e, rt, tier);
    pthread_mutex_unlock(&e->lock);
    int r = engine_api_release(e, h, tier, 0);
    if (r < 0) return r;
    if (restored) return 2;
    pthread_mutex_lock(&e->lock);
    struct tensor *t = engine_tensor(e, h);
    if (t) r = abandon_locked(e, t, tier);
    pthread_mutex_unlock(&e->lock);
    return r;
}
