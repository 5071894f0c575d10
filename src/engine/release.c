/*
 * release.c - letting go of a pin: zinf_release (clean; DIRTY, which makes a new version and
 * may start a write-behind; ZERO, which spends the content), zinf_zero, and the pins of
 * callers that went away (engine_release_abandoned).
 *
 * Not here: taking a pin (fetch.c), writing a copy back (residency.c), or the leases through
 * which the service's clients pin (lease.c).
 */
#include <errno.h>

#include "engine/engine.h"
#include "trace.h"

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
    if (!e || fetch_check_tier(tier) || (flags & ~known) || flags == known) return -EINVAL;
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
        writeback_needed(t, tier) && !c->wb_inflight && sched_write_behind(e, t, tier) &&
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
    if (tier == (int)t->home || writeback_needed(t, tier))
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
