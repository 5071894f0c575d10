/*
 * residency.c - what the memory tiers hold: each tier's list of copies, dropping a cached
 * copy, the prefetch budget's accounting, writing dirty copies back to their home, and
 * making room (eviction by next use, LRU without a schedule; emptying a tier for
 * zinf_fetch_all).
 *
 * All of it runs with the engine lock held; write-backs are started here and finish in
 * xfer.c's callbacks, which end in wb_done() below.
 *
 * Not here: bringing a copy into a tier (fetch.c), or what a release changes (release.c).
 */
#include <errno.h>
#include <stdlib.h>

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

void copy_unlink(struct copy *c)
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
void prefetch_charge(struct zinf_engine *e, struct tensor *t, struct copy *c)
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

bool copy_valid(const struct tensor *t, int tier)
{
    const struct copy *c = &t->c[tier];
    return c->state == COPY_READY && c->version == t->version;
}

/* Must this copy reach the home before it is dropped? Only when it holds the newest
 * content and nothing else durable or cached does. */
bool writeback_needed(const struct tensor *t, int tier)
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
            if (c->pins == 0 && c->readers == 0 && !writeback_needed(t, a->tier)) {
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
           c->wb_failed_epoch == e->reserve_epoch && writeback_needed(t, tier);
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
    if (writeback_needed(vt, tier)) {
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
int tier_compact(struct zinf_engine *e, int tier)
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
