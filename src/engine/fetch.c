/*
 * fetch.c - bringing a copy into a tier: the transitions of a load, the fetch itself
 * (blocking, asynchronous with a ticket, a prefetch hint, a set laid out together) and the
 * time it waits, counted by what it waited for.
 *
 * All of it runs with the engine lock held; loads are started here and finish in xfer.c's
 * callbacks, which end in load_done() below.
 *
 * Not here: making room for a copy and writing dirty ones back (residency.c), or letting go
 * of a pin (release.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "trace.h"

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

int fetch_check_tier(enum zinf_tier tier)
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
    if (!e || !ptr || fetch_check_tier(tier)) return -EINVAL;
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

    if (!e || (n && (!ts || !ptrs)) || fetch_check_tier(tier)) return -EINVAL;
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

    if (!e || !ticket || fetch_check_tier(tier)) return -EINVAL;
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

    if (!e || fetch_check_tier(tier)) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    lease_drain(e);
    t = engine_tensor(e, h);
    r = t ? fetch_locked(e, t, tier, true, NULL) : -EINVAL;
    pthread_mutex_unlock(&e->lock);
    return r;
}
