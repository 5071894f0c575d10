/*
 * registry.c - the engine's tensors: the name hash and the handle slots, register, lookup,
 * tensor_info and unregister, owning a tensor exclusively (engine_tensor_lock), its swap
 * extents' bookkeeping (allocate, free, keep while a manifest names them), and the check of
 * a tensor's states drawn in engine.h (engine_check_tensor).
 *
 * Handles carry the tensor's slot index (low 32 bits, plus one so that 0 is never valid)
 * and the slot's generation (high 32 bits), so a handle of an unregistered tensor is
 * refused even after its slot is reused.
 *
 * Not here: opening and closing the engine (engine.c), or moving a tensor's content between
 * tiers (fetch.c, residency.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

#define NAME_MAX_BYTES 1024

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    while (*s)
        h = (h ^ (unsigned char)*s++) * 1099511628211ull;
    return h;
}

static struct tensor *name_find(struct zinf_engine *e, const char *name)
{
    for (struct tensor *t = e->names[name_hash(name) % e->nbuckets]; t; t = t->hnext)
        if (!strcmp(t->name, name)) return t;
    return NULL;
}

static int names_grow(struct zinf_engine *e)
{
    size_t nb = e->nbuckets * 2;
    struct tensor **n = calloc(nb, sizeof(*n));
    if (!n) return -ENOMEM;
    for (size_t i = 0; i < e->nbuckets; i++) {
        struct tensor *t = e->names[i];
        while (t) {
            struct tensor *next = t->hnext;
            size_t b = name_hash(t->name) % nb;
            t->hnext = n[b];
            n[b] = t;
            t = next;
        }
    }
    free(e->names);
    e->names = n;
    e->nbuckets = nb;
    return 0;
}

static void name_remove(struct zinf_engine *e, struct tensor *t)
{
    struct tensor **pp = &e->names[name_hash(t->name) % e->nbuckets];
    while (*pp && *pp != t)
        pp = &(*pp)->hnext;
    if (*pp) *pp = t->hnext;
}

struct tensor *engine_tensor(struct zinf_engine *e, zinf_tensor h)
{
    uint32_t idx = (uint32_t)(h & 0xffffffffu), gen = (uint32_t)(h >> 32);
    if (idx == 0 || idx > e->ntensors) return NULL;
    struct tensor *t = e->tensors[idx - 1];
    return t && e->gens[idx - 1] == gen ? t : NULL;
}

bool engine_revalidate(struct zinf_engine *e, zinf_tensor h, const struct tensor *t)
{
    return engine_tensor(e, h) == t;
}

#ifndef NDEBUG
static void check_failed(const struct tensor *t, int tier, const char *what)
{
    log_error("engine: internal state broken: tensor '%s', tier %d: %s", t->name, tier, what);
    abort();
}

void engine_check_tensor(const struct tensor *t)
{
    unsigned writebacks = 0;
    for (int i = 0; i < MEM_TIERS; i++) {
        const struct copy *c = &t->c[i];
        bool home = i == (int)t->home;
        if (c->state > COPY_READY) check_failed(t, i, "unknown state");
        if (c->state != COPY_READY && (c->readers || c->wb_inflight || c->evicting))
            check_failed(t, i, "read or written back while not READY");
        if (c->evicting && !c->wb_inflight) check_failed(t, i, "evicting without a write-back");
        if (c->wb_inflight && c->readers == 0)
            check_failed(t, i, "a write-back that is not counted as a reader");
        if (c->prefetched && (c->pins || c->state == COPY_NONE))
            check_failed(t, i, "prefetched and pinned, or prefetched and gone");
        if (c->leases && (c->state != COPY_READY || c->version != t->version || c->prefetched))
            check_failed(t, i, "leased while not READY with the newest content, or prefetched");
        if ((unsigned)__builtin_popcountll(c->leases) > c->pins)
            check_failed(t, i, "a lease that holds no pin");
        if (c->version > t->version) check_failed(t, i, "a copy newer than its tensor");
        if (home && c->state == COPY_NONE) check_failed(t, i, "the home copy is gone");
        if (!home && (c->state != COPY_NONE) != (c->res_next != NULL))
            check_failed(t, i, "a cached copy off its tier's list, or a dropped one on it");
        if (t->exclusive && (c->state == COPY_LOADING || c->wb_inflight))
            check_failed(t, i, "moving while owned exclusively");
        writebacks += c->wb_inflight;
    }
    if (writebacks > 1) check_failed(t, -1, "two write-backs at once");
}
#endif

bool engine_home_valid(const struct tensor *t)
{
    if (t->home == ZINF_TIER_NVME) return t->zero || (t->has_swap && t->swap_version == t->version);
    return t->c[t->home].state == COPY_READY && t->c[t->home].version == t->version;
}

bool engine_persisted_extent(const struct tensor *t)
{
    /* A zero NVMe tensor's manifest entry names its (unread) extent too; other homes have
     * none while zero. */
    return t->persisted && (!t->persisted_zero || t->home == ZINF_TIER_NVME);
}

bool engine_extent_named(const struct tensor *t, uint64_t off)
{
    return (engine_persisted_extent(t) && t->persisted_off == off) ||
           (t->flush_named && t->flush_off == off);
}

bool engine_swap_named(const struct tensor *t)
{
    return t->has_swap && engine_extent_named(t, t->swap_off);
}

static int slot_take(struct zinf_engine *e, uint32_t *idx)
{
    for (uint32_t i = 0; i < e->ntensors; i++) {
        if (!e->tensors[i]) {
            *idx = i;
            return 0;
        }
    }
    if (e->ntensors == e->captensors) {
        uint32_t cap = e->captensors ? e->captensors * 2 : 64;
        struct tensor **t = realloc(e->tensors, cap * sizeof(*t));
        if (!t) return -ENOMEM;
        e->tensors = t;
        uint32_t *g = realloc(e->gens, cap * sizeof(*g));
        if (!g) return -ENOMEM;
        e->gens = g;
        e->captensors = cap;
    }
    e->tensors[e->ntensors] = NULL;
    e->gens[e->ntensors] = 0;
    *idx = e->ntensors++;
    return 0;
}

/* Put a new tensor in the registry (lock held). */
int engine_add_tensor(struct zinf_engine *e, struct tensor *t)
{
    uint32_t idx;
    int r;

    if (name_find(e, t->name)) return -EEXIST; /* a manifest that names a tensor twice */
    if (e->live + 1 > e->nbuckets && (r = names_grow(e)) < 0) return r;
    if ((r = slot_take(e, &idx)) < 0) return r;
    e->gens[idx]++;
    t->index = idx;
    t->handle = ((uint64_t)e->gens[idx] << 32) | (idx + 1);
    for (int i = 0; i < MEM_TIERS; i++)
        t->c[i].t = t;
    e->tensors[idx] = t;
    size_t b = name_hash(t->name) % e->nbuckets;
    t->hnext = e->names[b];
    e->names[b] = t;
    e->live++;
    return 0;
}

void engine_tensor_free(struct tensor *t)
{
    if (t) {
        for (int i = 0; i < MEM_TIERS; i++)
            undo_free(&t->c[i]);
        free(t->name);
        free(t);
    }
}

int engine_grow_swap(struct zinf_engine *e, size_t bytes)
{
    /* Never with the engine lock held: fallocate may take seconds while every other call
     * waits. */
    pthread_mutex_unlock(&e->lock);
    int r = nvme_grow_for(e->nvme, bytes);
    pthread_mutex_lock(&e->lock);
    return r;
}

int engine_swap_alloc(struct zinf_engine *e, size_t bytes, uint64_t *off)
{
    for (;;) {
        int r = nvme_alloc_nogrow(e->nvme, bytes, off);
        if (r != -EAGAIN) return r;
        if ((r = engine_grow_swap(e, bytes)) < 0) return r;
    }
}

void engine_keep_extent(uint64_t **list, size_t *n, size_t *cap, uint64_t off)
{
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 16;
        uint64_t *l = realloc(*list, c * sizeof(*l));
        if (!l) {
            log_warn("engine: out of memory: swap extent at %llu stays allocated",
                     (unsigned long long)off);
            return;
        }
        *list = l;
        *cap = c;
    }
    (*list)[(*n)++] = off;
}

void engine_free_swap(struct zinf_engine *e, uint64_t off, bool persisted)
{
    if (!persisted) {
        nvme_free(e->nvme, off);
        return;
    }
    /* The committed manifest still names it: keep it until the next one does not. */
    engine_keep_extent(&e->deferred_free, &e->ndeferred, &e->capdeferred, off);
}

/* Wait until nothing is moving in or out of the tensor and no other exclusive user holds
 * it, then take it exclusively. Lock held. The tensor is looked up again after every wait:
 * another thread may have unregistered it meanwhile (then NULL). */
struct tensor *engine_tensor_lock(struct zinf_engine *e, zinf_tensor h)
{
    for (;;) {
        struct tensor *t = engine_tensor(e, h);
        if (!t) return NULL;
        bool moving = t->exclusive;
        for (int i = 0; i < MEM_TIERS; i++) {
            struct copy *c = &t->c[i];
            moving |= c->state == COPY_LOADING || c->readers || c->wb_inflight;
        }
        if (!moving) {
            t->exclusive = true;
            return t;
        }
        engine_wait(e);
    }
}

void engine_tensor_unlock(struct zinf_engine *e, struct tensor *t)
{
    t->exclusive = false;
    pthread_cond_broadcast(&e->changed);
}

int engine_api_register(zinf_engine *e, const char *name, size_t nbytes, enum zinf_tier home,
                        zinf_tensor *out)
{
    struct tensor *t;
    int r;

    if (!e || !name || !*name || strlen(name) >= NAME_MAX_BYTES || nbytes == 0 || !out ||
        (home != ZINF_TIER_DEVICE && home != ZINF_TIER_HOST && home != ZINF_TIER_NVME))
        return -EINVAL;
    if (home == ZINF_TIER_NVME && !e->nvme) {
        /* The errno alone reads as a bad argument: say which setting is missing. */
        log_error("engine: tensor '%s' is homed on NVMe, but this engine has no NVMe tier: give "
                  "it a swap directory (zero_optimization.offload_param.nvme_path in a config, "
                  "zinf_options.nvme_path), or home the tensor in host or device memory",
                  name);
        return -EINVAL;
    }
    if (e->opt.flags & ZINF_OPEN_READONLY) return -EROFS;
    if (nbytes > SIZE_MAX - ZINF_ALIGN) return -ENOSPC;
    t = calloc(1, sizeof(*t));
    if (!t || !(t->name = strdup(name))) {
        free(t);
        return -ENOMEM;
    }
    t->nbytes = nbytes;
    t->alloc_bytes = align_up(nbytes, ZINF_ALIGN);
    t->home = home;
    t->version = 1;

    if (home == ZINF_TIER_NVME) {
        /* Larger than the swap space can ever be: the home tier's capacity, as for the
         * memory homes. */
        if (t->alloc_bytes > NVME_MAX_BYTES) {
            engine_tensor_free(t);
            return -ENOSPC;
        }
        /* Before the engine lock: growing the swap files (fallocate) may take a while,
         * and the tensor is nobody else's yet. */
        r = nvme_alloc(e->nvme, t->alloc_bytes, &t->swap_off);
        if (r < 0) {
            engine_tensor_free(t);
            return r;
        }
        t->has_swap = true;
        t->zero = true; /* the extent's old bytes are nobody's: read as zeros */
    }

    pthread_mutex_lock(&e->lock);
    if (name_find(e, name)) {
        r = -EEXIST;
        goto err;
    }
    if (home != ZINF_TIER_NVME) {
        if (t->alloc_bytes > e->st.tier[home].capacity_bytes) {
            r = -ENOSPC;
            goto err;
        }
        struct copy *c = &t->c[home];
        e->reserve_epoch++; /* a new call: write-backs that failed earlier may be retried */
        do
            r = tier_reserve(e, home, t->alloc_bytes, RESERVE_WAIT, 0, &c->off, &c->ptr);
        while (r == -EAGAIN);
        if (r < 0) {
            r = r == -ENOMEM ? -ENOSPC : r; /* the home tier is full of pinned or home data */
            goto err;
        }
        /* The room is reserved and nobody sees the tensor yet: zero it with the lock
         * dropped (on a GPU that waits for the copies in flight on its stream). */
        pthread_mutex_unlock(&e->lock);
        if (home == ZINF_TIER_DEVICE)
            r = device_zero(e->dev, c->off, t->alloc_bytes);
        else
            memset(c->ptr, 0, t->alloc_bytes);
        pthread_mutex_lock(&e->lock);
        if (r < 0) {
            tier_free(e, home, c->off);
            goto err;
        }
        c->state = COPY_READY;
        c->version = t->version;
        t->zero = true; /* as a tensor resumed from a zero entry: flushed as one, unwritten */
    }
    r = engine_add_tensor(e, t); /* -EEXIST when the name was taken meanwhile */
    if (r < 0) {
        if (home != ZINF_TIER_NVME) tier_free(e, home, t->c[home].off);
        goto err;
    }
    *out = t->handle;
    pthread_mutex_unlock(&e->lock);
    return 0;
err:
    pthread_mutex_unlock(&e->lock);
    if (home == ZINF_TIER_NVME) nvme_free(e->nvme, t->swap_off);
    engine_tensor_free(t);
    return r;
}

int engine_api_lookup(zinf_engine *e, const char *name, zinf_tensor *out)
{
    if (!e || !name || !out) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    struct tensor *t = name_find(e, name);
    if (t) *out = t->handle;
    pthread_mutex_unlock(&e->lock);
    return t ? 0 : -ENOENT;
}

int engine_api_tensor_info(zinf_engine *e, zinf_tensor h, struct zinf_tensor_info *out)
{
    if (!e || !out) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    struct tensor *t = engine_tensor(e, h);
    if (t) *out = (struct zinf_tensor_info){.home = t->home, .bytes = t->nbytes};
    pthread_mutex_unlock(&e->lock);
    return t ? 0 : -ENOENT;
}

int engine_api_unregister(zinf_engine *e, zinf_tensor h)
{
    struct tensor *t;

    if (!e) return -EINVAL;
    if (e->opt.flags & ZINF_OPEN_READONLY) return -EROFS;
    pthread_mutex_lock(&e->lock);
    lease_drain(e); /* the fetches clients made of it still count */
    for (;;) {
        /* A flush in progress may be writing a manifest that names this tensor's extents;
         * one may also start while this waits for the tensor. */
        while (e->flushing)
            engine_wait(e);
        t = engine_tensor_lock(e, h);
        if (!t) {
            pthread_mutex_unlock(&e->lock);
            return -EINVAL;
        }
        if (!e->flushing) break;
        engine_tensor_unlock(e, t);
    }
    /* Both idle leases close whatever the first answers: a slot left open on a tensor
     * that goes would let its client pin freed room. */
    bool pinned = copy_pinned(e, t, 0);
    pinned |= copy_pinned(e, t, 1);
    if (pinned || t->c[0].deferred || t->c[1].deferred) {
        engine_tensor_unlock(e, t);
        pthread_mutex_unlock(&e->lock);
        return -EBUSY;
    }
    for (int i = 0; i < MEM_TIERS; i++) {
        if (i == (int)t->home) {
            prefetch_wasted(e, t, &t->c[i]); /* a stale home copy may have been prefetched */
            tier_free(e, i, t->c[i].off);
        } else {
            copy_drop(e, t, i);
        }
    }
    bool persisted = engine_persisted_extent(t);
    if (t->has_swap)
        engine_free_swap(e, t->swap_off, persisted && t->persisted_off == t->swap_off);
    if (persisted && (!t->has_swap || t->persisted_off != t->swap_off))
        engine_free_swap(e, t->persisted_off, true);
    name_remove(e, t);
    e->tensors[t->index] = NULL;
    e->live--;
    sched_forget_tensor(e, t->index);
    pthread_cond_broadcast(&e->changed);
    pthread_mutex_unlock(&e->lock);
    engine_tensor_free(t);
    return 0;
}
