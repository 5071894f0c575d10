/*
 * persist.c - durability: zinf_flush writes every tensor's newest content to the swap
 * space, fsyncs the swap files and replaces a manifest (name, size, home, extent,
 * crc32c per tensor) atomically; ZINF_OPEN_RESUME reads it back and checks every
 * checksum (resume.c).
 *
 * Crash safety rests on one rule: an extent named by the committed manifest (or by the
 * one a flush is writing, which a crash may leave committed) is never written. New content
 * goes to another extent (copy on write, here, in zinf_write and in write-backs); the old
 * one is freed only once a newer manifest no longer names it. A crash at any
 * moment therefore leaves the old manifest with the old bytes, or the new one with the
 * new bytes: each tensor is whole, old or new.
 *
 * Two versions (persist_flush_tagged with keep). Ranks that checkpoint together commit a
 * step only once every rank has saved it, so each keeps its previous manifest, as
 * zinf-manifest.json.prev, until then. The previous manifest's extents are retained:
 * not freed and not written, as the committed one's (they are no tensor's any more, so no
 * write can reach them), until persist_drop_previous or a flush that keeps no previous
 * version frees them. A committing flush that keeps the previous one renames the current
 * manifest over .prev and then the new one into place; a crash between the two renames
 * leaves .prev alone, which then counts as the current one. Resume takes the current
 * manifest and forgets .prev, or (ENGINE_OPEN_PREVIOUS) rolls back to .prev, which takes the
 * current one's place. A manifest carries the tag its flush was given (the trainer's step;
 * -1: none), which persist_versions reads without opening anything; a flush that saves the
 * same state as the committed manifest keeps its tag.
 *
 * Not here: the manifest file's paths, reading and commit (manifest.c), resuming (resume.c),
 * the swap layout (nvme.c) or when to write back (residency.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/manifest.h"
#include "tiers/nvme.h"
#include "trace.h"

/* How long one flush waits in all for callers to release the copies that alone hold a
 * tensor's newest content (flush_reads_held). */
#define FLUSH_HELD_WAIT_NS (200 * 1000000ull)

/* ---- flush ------------------------------------------------------------------------------ */

struct entry {
    zinf_tensor handle;
    uint64_t off, version;
    uint32_t crc;
    bool zero;
};

/* Checksum of what the swap extent holds, by reading it through the staging ring. */
static int swap_checksum(struct zinf_engine *e, struct tensor *t, uint64_t off, uint32_t *crc)
{
    struct xfer x = {.e = e, .t = t, .src = ZINF_TIER_NVME, .dst = DST_NONE, .src_off = off,
                     .len = t->alloc_bytes, .want_crc = true, .what = "checksum"};
    int r = xfer_run_sync(e, &x);
    if (r == 0)
        *crc = x.crc;
    return r;
}

/* The newest content of t in a memory tier to read for a flush: a valid copy that no caller
 * holds, else one that a caller does (-1: none in memory). A caller's pin may be written
 * through at any moment, and the DIRTY release that makes that a version waits for the
 * flush: bytes read from it could mix two versions under the older one's label. Idle leases
 * are closed before the pins are counted: a client could otherwise pin one with atomics while
 * the flush reads, and write through it. */
static int flush_source(struct zinf_engine *e, struct tensor *t)
{
    int held = -1;
    for (int i = ZINF_TIER_HOST; i >= ZINF_TIER_DEVICE; i--) {
        const struct copy *c = &t->c[i];
        if (c->state != COPY_READY || c->version != t->version) continue;
        if (!copy_pinned(e, t, i)) return i;
        held = i;
    }
    return held;
}

/* Would flushing t now read its newest content from a copy that a caller holds? Not where
 * a manifest or the swap extent already has that content. Lock held. */
static bool flush_reads_held(struct zinf_engine *e, struct tensor *t)
{
    if (t->zero || (t->persisted && t->persisted_version == t->version && !t->persisted_zero) ||
        (t->has_swap && t->swap_version == t->version))
        return false;
    int src = flush_source(e, t);
    return src >= 0 && t->c[src].pins; /* its idle leases closed: what is left is held */
}

/* Make t's swap extent hold its newest content, on an extent the manifest does not name.
 * Lock held; t held exclusively. */
static int flush_tensor(struct zinf_engine *e, struct tensor *t, struct entry *en)
{
    int r;

    en->handle = t->handle;
    en->version = t->version;
    if (t->zero) {
        en->zero = true;
        en->off = t->has_swap ? t->swap_off : 0;
        return 0;
    }
    if (t->persisted && t->persisted_version == t->version && !t->persisted_zero) {
        en->off = t->persisted_off; /* unchanged since the last manifest */
        en->crc = t->persisted_crc;
        return 0;
    }
    if (t->has_swap && t->swap_version == t->version) {
        if (!t->swap_crc_valid) {
            r = swap_checksum(e, t, t->swap_off, &t->swap_crc);
            if (r < 0)
                return r;
            t->swap_crc_valid = true;
        }
        en->off = t->swap_off;
        en->crc = t->swap_crc;
        return 0;
    }
    /* The newest content is in memory: write it out. */
    int src = flush_source(e, t);
    if (src < 0) {
        log_error("engine: tensor '%s' has no valid copy to flush", t->name);
        return -EIO;
    }
    bool in_place = t->has_swap && !engine_swap_named(t);
    uint64_t off = t->swap_off;
    if (!in_place && (r = engine_swap_alloc(e, t->alloc_bytes, &off)) < 0) /* t is ours */
        return r;
    struct xfer x = {.e = e, .t = t, .src = src, .dst = ZINF_TIER_NVME,
                     .src_off = t->c[src].off, .src_ptr = t->c[src].ptr, .dst_off = off,
                     .len = t->alloc_bytes, .version = t->version, .want_crc = true,
                     .what = "flush"};
    t->c[src].readers++;
    r = xfer_run_sync(e, &x);
    t->c[src].readers--;
    if (r < 0) {
        if (!in_place)
            nvme_free(e->nvme, off);
        log_error("engine: flushing tensor '%s' failed: %s", t->name, zinf_strerror(r));
        return r;
    }
    if (!in_place && t->has_swap && !engine_swap_named(t))
        nvme_free(e->nvme, t->swap_off);
    t->swap_off = off;
    t->has_swap = true;
    /* The version that was copied: a pinned copy may have been released DIRTY while the
     * lock was dropped, and the extent does not hold that newer content. */
    t->swap_version = x.version;
    t->swap_crc = x.crc;
    t->swap_crc_valid = true;
    en->off = off;
    en->crc = x.crc;
    return 0;
}

static char *manifest_text(struct zinf_engine *e, struct entry *ents, size_t n, int64_t tag)
{
    json_t *root = json_object(), *arr = json_array();
    char *text = NULL;

    if (!root || !arr)
        goto out;
    json_object_set_new(root, "format", json_string(MANIFEST_FORMAT));
    json_object_set_new(root, "version", json_integer(MANIFEST_VERSION));
    json_object_set_new(root, "block_size", json_integer((json_int_t)e->block_size));
    json_object_set_new(root, "dirs", json_integer(e->nvme_ndirs));
    if (tag >= 0)
        json_object_set_new(root, "tag", json_integer((json_int_t)tag));
    for (size_t i = 0; i < n; i++) {
        struct tensor *t = engine_tensor(e, ents[i].handle);
        json_t *o = json_object();
        if (!t || !o) {
            json_decref(o);
            continue;
        }
        json_t *name = json_string(t->name);
        if (name) {
            json_object_set_new(o, "name", name);
        } else { /* not UTF-8: keep the bytes as hex */
            size_t len = strlen(t->name);
            char *hex = malloc(len * 2 + 1);
            for (size_t k = 0; hex && k < len; k++)
                sprintf(hex + 2 * k, "%02x", (unsigned char)t->name[k]);
            json_object_set_new(o, "name_hex", json_string(hex ? hex : ""));
            free(hex);
        }
        json_object_set_new(o, "nbytes", json_integer((json_int_t)t->nbytes));
        json_object_set_new(o, "home", json_string(manifest_tier_name(t->home)));
        json_object_set_new(o, "zero", json_boolean(ents[i].zero));
        json_object_set_new(o, "offset", json_integer((json_int_t)ents[i].off));
        json_object_set_new(o, "crc32c", json_integer(ents[i].crc));
        json_array_append_new(arr, o);
    }
    json_object_set_new(root, "tensors", arr);
    arr = NULL;
    text = json_dumps(root, JSON_INDENT(1));
out:
    json_decref(arr);
    json_decref(root);
    return text;
}

/* No previous version any more: its manifest goes (durably), then its extents are free.
 * Lock held. */
static int drop_previous(struct zinf_engine *e)
{
    char prev[4200];
    if (!e->has_prev)
        return 0;
    manifest_path(e, prev, sizeof(prev), PREV_SUFFIX);
    int dfd = manifest_dir_fd(e);
    int r = unlinkat(dfd, manifest_rel(dfd, prev), 0) == 0 || errno == ENOENT ? 0 : -errno;
    if (r == 0)
        r = manifest_sync_dir(e);
    if (r < 0) {
        log_error("engine: removing the previous version %s failed: %s; its extents stay "
                  "allocated", prev, strerror(-r));
        return r;
    }
    for (size_t i = 0; i < e->nretained; i++)
        nvme_free(e->nvme, e->retained[i]);
    e->nretained = 0;
    e->has_prev = false;
    return 0;
}

int persist_drop_previous(struct zinf_engine *e)
{
    return drop_previous(e);
}

/* The two versions' invariants (debug builds): without a previous version nothing is
 * retained; no tensor's swap extent, and no extent the committed manifest names, is a
 * retained one (a write there would reach the previous version's bytes); no extent is
 * retained twice. Lock held. */
static void check_versions(struct zinf_engine *e)
{
#ifndef NDEBUG
    if (!e->has_prev && e->nretained) {
        log_error("engine: internal state broken: %zu extents retained without a previous "
                  "version", e->nretained);
        abort();
    }
    for (size_t k = 0; k < e->nretained; k++) {
        uint64_t off = e->retained[k];
        for (size_t j = k + 1; j < e->nretained; j++)
            if (e->retained[j] == off) {
                log_error("engine: internal state broken: extent %llu retained twice",
                          (unsigned long long)off);
                abort();
            }
        for (uint32_t i = 0; i < e->ntensors; i++) {
            const struct tensor *t = e->tensors[i];
            if (t && ((t->has_swap && t->swap_off == off) ||
                      (engine_persisted_extent(t) && t->persisted_off == off))) {
                log_error("engine: internal state broken: tensor '%s' uses extent %llu of the "
                          "previous version", t->name, (unsigned long long)off);
                abort();
            }
        }
    }
#else
    (void)e;
#endif
}

int persist_flush(struct zinf_engine *e)
{
    return persist_flush_tagged(e, -1, false);
}

int persist_flush_tagged(struct zinf_engine *e, int64_t tag, bool keep)
{
    struct entry *ents = NULL;
    bool renamed = false;
    size_t n = 0;
    int r = 0;
    uint64_t span0 = trace_on() ? now_ns() : 0;

    while (e->flushing)
        engine_wait(e);
    e->flushing = true;

    /* Handles first: tensors registered while this runs are not part of it. */
    zinf_tensor *hs = calloc(e->ntensors + 1, sizeof(*hs));
    ents = calloc(e->ntensors + 1, sizeof(*ents));
    if (!hs || !ents) {
        r = -ENOMEM;
        goto out;
    }
    size_t nh = 0;
    e->st.flush_bytes_total = e->st.flush_bytes_done = 0;
    for (uint32_t i = 0; i < e->ntensors; i++)
        if (e->tensors[i]) {
            hs[nh++] = e->tensors[i]->handle;
            e->st.flush_bytes_total += e->tensors[i]->alloc_bytes;
        }

    /* A tensor whose newest content only a caller's pin holds is waited for, up to
     * FLUSH_HELD_WAIT_NS in all: a writer releases it (DIRTY) and the flush saves a whole
     * version. The flushing thread's own pins, or pins held for longer, are read as they
     * are once the time is up. */
    uint64_t held_until = now_ns() + FLUSH_HELD_WAIT_NS;
    for (size_t i = 0; i < nh; i++) {
        struct tensor *t = engine_tensor_lock(e, hs[i]);
        bool traced = false;
        while (t && flush_reads_held(e, t) && now_ns() < held_until) {
            if (!traced && trace_on())
                trace_instant("engine", "flush waits for a held copy", t->name, "pinned",
                              (int64_t)t->alloc_bytes);
            traced = true;
            engine_tensor_unlock(e, t); /* its DIRTY release waits for an exclusive owner */
            engine_wait_until(e, held_until);
            t = engine_tensor_lock(e, hs[i]);
        }
        if (!t)
            continue;
        r = flush_tensor(e, t, &ents[n]);
        e->st.flush_bytes_done += t->alloc_bytes;
        if (r == 0 && t->has_swap) {
            /* From here until the manifest is committed or abandoned, writes to t must not
             * land in the extent it names (the lock is dropped while it is written). */
            t->flush_named = true;
            t->flush_off = ents[n].off;
        }
        engine_tensor_unlock(e, t);
        if (r < 0)
            goto out;
        n++;
    }
    e->st.flush_bytes_done = e->st.flush_bytes_total; /* those unregistered meanwhile too */

    pthread_mutex_unlock(&e->lock);
    r = nvme_sync(e->nvme);
    pthread_mutex_lock(&e->lock);
    if (r < 0) {
        log_error("engine: syncing the swap files failed: %s", zinf_strerror(r));
        goto out;
    }
    /* Untagged, a flush that saves what the committed manifest saved keeps its tag. */
    if (tag < 0 && e->ndeferred == 0 && n == e->persisted_count) {
        bool same = true;
        for (size_t i = 0; i < n && same; i++) {
            struct tensor *t = engine_tensor(e, ents[i].handle);
            same = t && t->persisted && t->persisted_off == ents[i].off &&
                   t->persisted_crc == ents[i].crc && t->persisted_zero == ents[i].zero;
        }
        if (same)
            tag = e->tag;
    }
    char *text = manifest_text(e, ents, n, tag);
    if (!text) {
        r = -ENOMEM;
        goto out;
    }
    /* At most two versions: the one kept so far goes when this one takes its place. */
    bool had_prev = e->has_prev;
    pthread_mutex_unlock(&e->lock);
    r = manifest_commit(e, text, keep, &renamed);
    pthread_mutex_lock(&e->lock);
    free(text);
    if (r < 0 && !renamed)
        goto out;
    e->tag = tag;
    e->persisted_count = n;

    /* The new manifest is in place: what it names is now the persisted state. What the old
     * one named and this one does not is free once the new one is durable; when the
     * directory's fsync failed, the old manifest may come back after a crash, so those
     * extents wait (deferred) for a flush that completes. */
    bool durable = r == 0;
    /* Keeping the previous version: what the old manifest named and this one does not is
     * retained for it, as are the extents it named of tensors gone since. What the version
     * kept before named is free once this commit is durable (its manifest was replaced). */
    size_t old_retained = keep ? e->nretained : 0;
    for (size_t i = 0; i < n; i++) {
        struct tensor *t = engine_tensor(e, ents[i].handle);
        if (!t)
            continue;
        if (engine_persisted_extent(t) && t->persisted_off != ents[i].off &&
            !(t->has_swap && t->swap_off == t->persisted_off)) {
            if (keep)
                engine_keep_extent(&e->retained, &e->nretained, &e->capretained,
                                   t->persisted_off);
            else
                engine_free_swap(e, t->persisted_off, !durable);
        }
        t->persisted = true;
        t->persisted_off = ents[i].off;
        t->persisted_crc = ents[i].crc;
        t->persisted_zero = ents[i].zero;
        t->persisted_version = ents[i].version;
    }
    if (keep) {
        for (size_t i = 0; i < e->ndeferred; i++)
            engine_keep_extent(&e->retained, &e->nretained, &e->capretained,
                               e->deferred_free[i]);
        e->ndeferred = 0;
        e->has_prev = true;
    }
    if (!durable)
        goto out;
    if (keep && had_prev && old_retained) {
        for (size_t i = 0; i < old_retained; i++)
            nvme_free(e->nvme, e->retained[i]);
        memmove(e->retained, e->retained + old_retained,
                (e->nretained - old_retained) * sizeof(*e->retained));
        e->nretained -= old_retained;
    }
    for (size_t i = 0; i < e->ndeferred; i++)
        nvme_free(e->nvme, e->deferred_free[i]);
    e->ndeferred = 0;
    /* Without a previous version to keep, one kept before goes now. */
    if (!keep && e->has_prev && (r = drop_previous(e)) < 0)
        goto out;
    check_versions(e);
    e->st.flushes++;
out:
    for (size_t i = 0; ents && i < n; i++) {
        struct tensor *t = engine_tensor(e, ents[i].handle);
        if (!t || !t->flush_named)
            continue;
        t->flush_named = false;
        /* Abandoned: an extent only this manifest named, and that writes moved away from
         * meanwhile, belongs to nobody now. (Once the manifest was renamed into place it
         * is not abandoned: it is the persisted state, durable or not.) */
        if (r < 0 && !renamed && t->flush_off != t->swap_off &&
            !(engine_persisted_extent(t) && t->persisted_off == t->flush_off))
            nvme_free(e->nvme, t->flush_off);
    }
    free(hs);
    free(ents);
    e->flushing = false;
    pthread_cond_broadcast(&e->changed);
    if (span0 && trace_on()) {
        trace_span("engine", "flush", span0, NULL, r < 0 ? "failed" : NULL, -1);
        engine_trace_counters(e, true); /* the values zinf_stats gives now */
    }
    return r;
}
