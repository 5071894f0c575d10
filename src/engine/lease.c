/*
 * lease.c - pin tables: copies a client of the service pins without a message.
 *
 * A pin table (src/pintable.h) belongs to one session of the service and lives in a memfd
 * that its client maps. An OPEN slot is a lease: the engine holds one pin of the copy
 * (counted in copy.pins, the session's bit set in copy.leases) and the client takes and
 * gives back pins on top of it with atomics alone. A lease whose slot counts no pin is
 * idle: the copy is as good as unpinned, and whoever needs it unpinned (eviction, a DIRTY
 * release of the other tier, unregister, a dead client's cleanup) closes the slot first,
 * with a compare-and-swap that fails if the client pinned it meanwhile.
 *
 * Invariants (checked with the tensor's): a leased copy is READY and holds the tensor's
 * version (nothing makes a pinned copy stale, and loads never go into one), is not
 * prefetched, and has at least one pin per lease.
 *
 * The engine lock guards the leases; slot words are shared with the clients, so they are
 * read and changed with atomics only. Not here: the daemon's sessions (service/session.c),
 * the client's side of a slot (service/client.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/engine.h"
#include "hugemem.h"
#include "pintable.h"

struct engine_pinset {
    unsigned id; /* its bit in copy.leases */
    int fd;
    struct pt_header *h;
    uint64_t epoch; /* of the last opening */
};

static void pinset_free(struct engine_pinset *ps)
{
    if (ps->h) munmap(ps->h, PT_BYTES);
    if (ps->fd >= 0) close(ps->fd);
    free(ps);
}

int engine_pinset_open(zinf_engine *e, struct engine_pinset **out, int *fd, size_t *bytes)
{
    struct engine_pinset *ps = calloc(1, sizeof(*ps));
    if (!ps) return -ENOMEM;
    ps->fd = hugemem_memfd("zinf-pins", PT_BYTES, NULL);
    int r = ps->fd < 0 ? ps->fd : 0;
    if (r == 0) {
        void *p = mmap(NULL, PT_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, ps->fd, 0);
        if (p == MAP_FAILED)
            r = -errno;
        else
            ps->h = p;
    }
    if (r == 0) {
        *ps->h = (struct pt_header){.magic = PT_MAGIC,
                                    .version = PT_VERSION,
                                    .tensors = PT_TENSORS,
                                    .ring = PT_RING,
                                    .ring_off = PT_RING_OFF,
                                    .slot_off = PT_SLOT_OFF,
                                    .bytes = PT_BYTES};
        pthread_mutex_lock(&e->lock);
        r = -EMFILE; /* every bit of copy.leases taken: that session goes through the daemon */
        for (unsigned i = 0; i < ENGINE_MAX_PINSETS; i++) {
            if (!e->pinsets[i]) {
                ps->id = i;
                e->pinsets[i] = ps;
                e->npinsets++;
                r = 0;
                break;
            }
        }
        pthread_mutex_unlock(&e->lock);
    }
    if (r < 0) {
        pinset_free(ps);
        return r;
    }
    *out = ps;
    *fd = ps->fd;
    *bytes = PT_BYTES;
    return 0;
}

static struct pt_slot *slot_of(struct engine_pinset *ps, const struct tensor *t, int tier)
{
    return pt_slot(ps->h, t->index, tier);
}

static uint32_t gen_of(const struct tensor *t)
{
    return (uint32_t)(t->handle >> 32);
}

/* Close ps's lease of t's copy in tier, unless its client holds a pin through it. Lock
 * held. */
static bool lease_close(struct zinf_engine *e, struct engine_pinset *ps, struct tensor *t, int tier)
{
    struct copy *c = &t->c[tier];
    struct pt_slot *s = slot_of(ps, t, tier);
    uint64_t w = atomic_load_explicit(&s->word, memory_order_acquire);
    if ((w & PT_COUNT_MASK) != 0) return false;
    if (!atomic_compare_exchange_strong_explicit(&s->word, &w, 0, memory_order_acq_rel,
                                                 memory_order_acquire))
        return false; /* pinned just now */
    c->leases &= ~(1ull << ps->id);
    c->pins--;
    if (c->pins == 0) pthread_cond_broadcast(&e->changed);
    return true;
}

void lease_close_idle(struct zinf_engine *e, struct tensor *t, int tier,
                      const struct engine_pinset *keep)
{
    struct copy *c = &t->c[tier];
    for (uint64_t m = c->leases; m; m &= m - 1) {
        struct engine_pinset *ps = e->pinsets[__builtin_ctzll(m)];
        if (ps != keep) lease_close(e, ps, t, tier);
    }
}

bool copy_pinned(struct zinf_engine *e, struct tensor *t, int tier)
{
    lease_close_idle(e, t, tier, NULL);
    return t->c[tier].pins != 0;
}

unsigned lease_count(const struct engine_pinset *ps, const struct tensor *t, int tier)
{
    return (unsigned)(atomic_load_explicit(&slot_of((struct engine_pinset *)ps, t, tier)->word,
                                           memory_order_acquire) &
                      PT_COUNT_MASK);
}

unsigned copy_held(const struct zinf_engine *e, const struct copy *c)
{
    unsigned idle = 0;
    for (uint64_t m = c->leases; m; m &= m - 1) {
        struct engine_pinset *ps = e->pinsets[__builtin_ctzll(m)];
        uint64_t w = atomic_load_explicit(&slot_of(ps, c->t, (int)(c - c->t->c))->word,
                                          memory_order_relaxed);
        idle += (w & PT_COUNT_MASK) == 0;
    }
    return c->pins - idle;
}

/* One event of the ring: a pin the client took through an open slot. */
static void count_fast_fetch(struct zinf_engine *e, uint64_t what)
{
    uint32_t gen = (uint32_t)(what >> 32), idx = (uint32_t)(what & 0xffffffffu) >> 1;
    int tier = (int)(what & 1);
    struct tensor *t = engine_tensor(e, ((uint64_t)gen << 32) | ((uint64_t)idx + 1));
    if (!t) return; /* unregistered since (or made up by a broken client) */
    e->st.tier[tier].fetches++;
    e->st.tier[tier].hits++;
    sched_on_fetch(e, t, tier);
    if (t->c[tier].state == COPY_READY) t->c[tier].last_use = ++e->clock;
}

void lease_drain(struct zinf_engine *e)
{
    bool any = false;
    if (!e->npinsets) return;
    for (unsigned i = 0; i < ENGINE_MAX_PINSETS; i++) {
        struct engine_pinset *ps = e->pinsets[i];
        if (!ps) continue;
        struct pt_header *h = ps->h;
        struct pt_event *ring = pt_ring(h);
        uint64_t tail = atomic_load_explicit(&h->tail, memory_order_relaxed);
        uint64_t head = atomic_load_explicit(&h->head, memory_order_acquire);
        if (head - tail > PT_RING) head = tail + PT_RING; /* a client that scribbled on it */
        for (; tail != head; tail++) {
            struct pt_event *ev = &ring[tail & (PT_RING - 1)];
            /* A thread that claimed this event may not have written it yet: the rest waits
             * for the next call. */
            if (atomic_load_explicit(&ev->stamp, memory_order_acquire) != tail + 1) break;
            count_fast_fetch(e, atomic_load_explicit(&ev->what, memory_order_relaxed));
            any = true;
        }
        atomic_store_explicit(&h->tail, tail, memory_order_release);
    }
    if (any) sched_prefetch(e);
}

void lease_publish(struct zinf_engine *e)
{
    if (!e->npinsets) return;
    for (unsigned i = 0; i < ENGINE_MAX_PINSETS; i++)
        if (e->pinsets[i])
            atomic_fetch_add_explicit(&e->pinsets[i]->h->published, 1, memory_order_release);
}

/* After a fetch through the daemon pinned t's copy in tier for ps's session: move that pin
 * into the session's slot (opening it, with the fetch's pin as the lease), so the client
 * releases it and pins it again by itself. false: the pin stays an ordinary one. Lock
 * held. */
bool lease_open(struct zinf_engine *e, struct engine_pinset *ps, struct tensor *t, int tier)
{
    struct copy *c = &t->c[tier];
    uint64_t bit = 1ull << ps->id;
    if (t->index >= PT_TENSORS || c->state != COPY_READY || c->version != t->version ||
        c->prefetched || (undo_needed(e, t, tier) && !(c->undo && c->undo_version == t->version)) ||
        (c->off & ((1ull << PT_PAGE_SHIFT) - 1)) ||
        (c->off >> PT_PAGE_SHIFT) > UINT32_MAX)
        return false;
    struct pt_slot *s = slot_of(ps, t, tier);
    if (c->leases & bit) {
        /* Open already (the client came here all the same: its ring was full) */
        uint64_t w = atomic_load_explicit(&s->word, memory_order_relaxed);
        do {
            if ((w & PT_COUNT_MASK) == PT_COUNT_MASK) return false;
        } while (!atomic_compare_exchange_weak_explicit(&s->word, &w, w + 1, memory_order_acq_rel,
                                                        memory_order_relaxed));
        c->pins--; /* the fetch's pin is the slot's now; the lease keeps its own */
        return true;
    }
    /* A closed slot is 0: the client cannot change it. A stale count there would be a
     * client writing where it must not; the slot is not reused then. */
    if (atomic_load_explicit(&s->word, memory_order_acquire) != 0) return false;
    ps->epoch = (ps->epoch + 1) & PT_EPOCH_MASK;
    atomic_store_explicit(&s->info, ((uint64_t)gen_of(t) << 32) | (c->off >> PT_PAGE_SHIFT),
                          memory_order_relaxed);
    atomic_store_explicit(&s->word, PT_OPEN | (ps->epoch << PT_EPOCH_SHIFT) | 1,
                          memory_order_release);
    c->leases |= bit; /* the fetch's pin is the lease's; the slot counts the client's */
    return true;
}

int engine_api_fetch_leased(zinf_engine *e, struct engine_pinset *ps, zinf_tensor h,
                            enum zinf_tier tier, void **ptr, bool *leased)
{
    *leased = false;
    if (!e || !ptr || (tier != ZINF_TIER_DEVICE && tier != ZINF_TIER_HOST)) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    int r = fetch_pinned(e, h, tier, ptr);
    if (r == 0 && ps) {
        struct tensor *t = engine_tensor(e, h);
        *leased = lease_open(e, ps, t, tier);
        ENGINE_CHECK(t);
    }
    pthread_mutex_unlock(&e->lock);
    return r;
}

bool lease_take(struct engine_pinset *ps, struct tensor *t, int tier)
{
    struct copy *c = &t->c[tier];
    if (!(c->leases & (1ull << ps->id))) return false;
    struct pt_slot *s = slot_of(ps, t, tier);
    uint64_t w = atomic_load_explicit(&s->word, memory_order_acquire);
    do {
        if (!(w & PT_OPEN) || (w & PT_COUNT_MASK) == 0) return false;
    } while (!atomic_compare_exchange_weak_explicit(&s->word, &w, w - 1, memory_order_acq_rel,
                                                    memory_order_acquire));
    return true;
}

void lease_untake(struct engine_pinset *ps, struct tensor *t, int tier)
{
    atomic_fetch_add_explicit(&slot_of(ps, t, tier)->word, 1, memory_order_acq_rel);
}

uint64_t engine_pinset_pins(zinf_engine *e, struct engine_pinset *ps)
{
    uint64_t n = 0;
    pthread_mutex_lock(&e->lock);
    for (uint32_t i = 0; i < e->ntensors; i++) {
        struct tensor *t = e->tensors[i];
        for (int k = 0; t && k < MEM_TIERS; k++)
            if (t->c[k].leases & (1ull << ps->id))
                n += atomic_load_explicit(&slot_of(ps, t, k)->word, memory_order_relaxed) &
                     PT_COUNT_MASK;
    }
    pthread_mutex_unlock(&e->lock);
    return n;
}

void engine_pinset_close(zinf_engine *e, struct engine_pinset *ps, unsigned *dropped,
                         unsigned *kept, unsigned *restored)
{
    *dropped = *kept = *restored = 0;
    if (!ps) return;
    pthread_mutex_lock(&e->lock);
    lease_drain(e); /* the fetches it made count */
    for (uint32_t i = 0; i < e->ntensors; i++) {
        struct tensor *t = e->tensors[i];
        for (int k = 0; t && k < MEM_TIERS; k++) {
            struct copy *c = &t->c[k];
            if (!(c->leases & (1ull << ps->id))) continue;
            uint64_t w = atomic_exchange_explicit(&slot_of(ps, t, k)->word, 0, memory_order_acq_rel);
            c->leases &= ~(1ull << ps->id);
            c->pins--;
            if (w & PT_COUNT_MASK) {
                /* Its client went away holding pins here, and may have written through
                 * them: the copy goes if the newest content is elsewhere too. */
                (*dropped)++;
                if (copy_held(e, c) == 0 && undo_restore(e, t, k))
                    (*restored)++;
                else
                    *kept += abandon_locked(e, t, k) == 1;
            }
            if (c->pins == 0) pthread_cond_broadcast(&e->changed);
            ENGINE_CHECK(t);
        }
    }
    e->pinsets[ps->id] = NULL;
    e->npinsets--;
    pthread_mutex_unlock(&e->lock);
    pinset_free(ps);
}

void lease_fini(struct zinf_engine *e)
{
    for (unsigned i = 0; i < ENGINE_MAX_PINSETS; i++) {
        struct engine_pinset *ps = e->pinsets[i];
        if (ps) pinset_free(ps);
        e->pinsets[i] = NULL;
    }
}
