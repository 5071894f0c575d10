/*
 * engine.c - the engine's life cycle: open (its options and a config's settings turned into
 * parameters, the tiers, the IO engine and the staging ring set up, a saved state resumed
 * or refused), close; and the calls on a whole tensor's content or on the engine that own no
 * state of their own: zinf_read/zinf_write, zinf_step, zinf_flush, zinf_stats.
 *
 * Not here: the registry of tensors (register, lookup, unregister, handles: registry.c),
 * moving copies between tiers (fetch.c, residency.c, release.c) or what a flush and a
 * resume do (persist.c, resume.c).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "config.h"
#include "dirs.h"
#include "engine/engine.h"
#include "trace.h"
#include "tiers/cuda_probe.h"
#include "topo/topo.h"

#define DEFAULT_HOST_BYTES GiB

/* ---- content access ------------------------------------------------------------------ */

static int range_ok(struct tensor *t, size_t off, size_t n)
{
    return off <= t->nbytes && n <= t->nbytes - off;
}

/* Check a content access and take the tensor exclusively. Returns NULL, with *r 0 for an
 * empty range or -EINVAL, when there is nothing to do. The engine lock is held on return
 * either way. */
static struct tensor *content_begin(struct zinf_engine *e, zinf_tensor h, size_t off, size_t n,
                                    int *r)
{
    struct tensor *t;

    pthread_mutex_lock(&e->lock);
    t = engine_tensor(e, h);
    *r = !t || !range_ok(t, off, n) ? -EINVAL : t->damaged ? -EBADMSG : 0;
    if (*r || n == 0) return NULL;
    t = engine_tensor_lock(e, h);
    if (!t) *r = -EINVAL; /* unregistered while this waited */
    return t;
}

int engine_api_read(zinf_engine *e, zinf_tensor h, size_t off, void *dst, size_t n)
{
    struct tensor *t;
    int r = 0;

    if (!e || (!dst && n)) return -EINVAL;
    t = content_begin(e, h, off, n, &r);
    if (!t) goto out;
    /* The newest content: host memory, then device memory, then the swap extent. */
    int src = -1;
    for (int i = ZINF_TIER_HOST; i >= ZINF_TIER_DEVICE; i--)
        if (t->c[i].state == COPY_READY && t->c[i].version == t->version) src = i;
    pthread_mutex_unlock(&e->lock);
    if (src == ZINF_TIER_HOST)
        memcpy(dst, (char *)t->c[src].ptr + off, n);
    else if (src == ZINF_TIER_DEVICE)
        r = device_copy_sync(e->dev, DEVICE_D2H, t->c[src].off + off, dst, n);
    else if (t->zero)
        memset(dst, 0, n);
    else if (t->has_swap && t->swap_version == t->version && (e->opt.flags & ZINF_OPEN_READONLY))
        r = swap_read_checked(e, t, off, dst, n);
    else if (t->has_swap && t->swap_version == t->version)
        r = swap_read_range(e, t, t->swap_off, off, dst, n);
    else
        r = -EIO;
    pthread_mutex_lock(&e->lock);
    engine_tensor_unlock(e, t);
out:
    pthread_mutex_unlock(&e->lock);
    return r;
}

int engine_api_write(zinf_engine *e, zinf_tensor h, size_t off, const void *src, size_t n)
{
    struct tensor *t;
    bool dev = false, host = false, swap = false;
    void *undo = NULL;
    size_t undo_off = 0, undo_len = 0;
    int r = 0;

    if (!e || (!src && n)) return -EINVAL;
    if (e->opt.flags & ZINF_OPEN_READONLY) return -EROFS;
    t = content_begin(e, h, off, n, &r);
    if (!t) goto out;
    /* Every valid copy in memory takes the bytes; the swap extent only when nothing in
     * memory holds the content (otherwise the home goes stale and is written back later,
     * as after a DIRTY release). */
    dev =
        t->c[ZINF_TIER_DEVICE].state == COPY_READY && t->c[ZINF_TIER_DEVICE].version == t->version;
    host = t->c[ZINF_TIER_HOST].state == COPY_READY && t->c[ZINF_TIER_HOST].version == t->version;
    swap = !dev && !host;
    if (swap && !engine_home_valid(t)) {
        r = -EIO; /* no valid copy anywhere: cannot happen */
        goto unlock;
    }
    bool zero = t->zero;
    uint64_t target = t->swap_off, cow_from = t->swap_off;
    bool cow = false;
    if (swap && (engine_swap_named(t) || n > RANGE_CHUNK_BYTES)) {
        /* A manifest names this extent: never write it, write a new one. A large write
         * does the same, so that it streams in bounded pieces and a failure half-way
         * leaves the old extent whole (no undo buffer of the whole range). */
        r = engine_swap_alloc(e, t->alloc_bytes, &target); /* t is ours: may drop the lock */
        if (r < 0) goto unlock;
        cow = true;
    }
    pthread_mutex_unlock(&e->lock);

    /* Order: the swap extent first (undoable), then the device, then host memory (which
     * cannot fail), so a failure leaves every copy as it was. */
    if (cow)
        r = swap_write_merged(e, cow_from, zero, target, t->alloc_bytes, off, src, n);
    else if (swap)
        r = swap_write_range(e, target, off, src, n, t->alloc_bytes, zero, &undo, &undo_off,
                             &undo_len);
    if (r == 0 && dev) {
        r = device_copy_sync(e->dev, DEVICE_H2D, t->c[ZINF_TIER_DEVICE].off + off, (void *)src, n);
        if (r < 0 && swap && undo && nvme_write(e->nvme, target + undo_off, undo, undo_len))
            log_error("engine: tensor '%s': rolling back a failed write also failed", t->name);
    }
    if (r == 0 && host) memcpy((char *)t->c[ZINF_TIER_HOST].ptr + off, src, n);
    free(undo);

    pthread_mutex_lock(&e->lock);
    if (r == 0) {
        t->version++;
        t->zero = false;
        if (dev) t->c[ZINF_TIER_DEVICE].version = t->version;
        if (host) t->c[ZINF_TIER_HOST].version = t->version;
        if (swap) t->swap_version = t->version;
        if (dev || host) lease_publish(e);
        undo_settle(e, t); /* images of the new content, where they are needed */
        if (cow) {
            /* The old extent stays while a manifest names it (the flush that stops naming
             * it frees it); if the flush that named it failed meanwhile, nobody will. */
            uint64_t old = t->swap_off;
            t->swap_off = target;
            if (!engine_extent_named(t, old)) nvme_free(e->nvme, old);
        }
        t->swap_crc_valid = false;
    } else if (cow) {
        nvme_free(e->nvme, target);
    }
unlock:
    engine_tensor_unlock(e, t);
out:
    pthread_mutex_unlock(&e->lock);
    return r;
}

int engine_api_step(zinf_engine *e)
{
    if (!e) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    lease_drain(e);
    e->st.steps++;
    sched_on_step(e);
    pthread_mutex_unlock(&e->lock);
    return 0;
}

int engine_api_flush(zinf_engine *e)
{
    if (!e) return -EINVAL;
    if (!e->nvme) return 0; /* nothing to be durable on */
    if (e->opt.flags & ZINF_OPEN_READONLY) return -EROFS;
    pthread_mutex_lock(&e->lock);
    int r = persist_flush(e);
    pthread_mutex_unlock(&e->lock);
    return r;
}

int engine_flush_tagged(zinf_engine *e, int64_t tag, bool keep)
{
    if (!e) return -EINVAL;
    if (!e->nvme) return 0;
    if (e->opt.flags & ZINF_OPEN_READONLY) return -EROFS;
    pthread_mutex_lock(&e->lock);
    int r = persist_flush_tagged(e, tag, keep);
    pthread_mutex_unlock(&e->lock);
    return r;
}

int engine_drop_previous(zinf_engine *e)
{
    if (!e) return -EINVAL;
    if (e->opt.flags & ZINF_OPEN_READONLY) return -EROFS;
    if (!e->nvme) return 0;
    pthread_mutex_lock(&e->lock);
    while (e->flushing)
        engine_wait(e);
    int r = persist_drop_previous(e);
    pthread_mutex_unlock(&e->lock);
    return r;
}

int engine_api_stats(zinf_engine *e, struct zinf_stats *out)
{
    struct device_stats ds;
    struct host_stats hs;

    if (!e || !out) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    lease_drain(e);
    *out = e->st;
    device_get_stats(e->dev, &ds);
    host_get_stats(e->host, &hs);
    out->tier[ZINF_TIER_DEVICE].used_bytes = ds.used_bytes;
    out->tier[ZINF_TIER_HOST].used_bytes = hs.used_bytes;
    out->host_staging_bytes = hs.staging_bytes;
    out->host_pinned = hs.pinned;
    out->device_is_cuda = ds.cuda;
    if (e->nvme) {
        struct nvme_stats ns;
        nvme_get_stats(e->nvme, &ns);
        out->tier[ZINF_TIER_NVME].capacity_bytes = ns.capacity_bytes;
        out->tier[ZINF_TIER_NVME].used_bytes = ns.used_bytes;
        e->st.tier[ZINF_TIER_NVME].peak_bytes =
            MAX(e->st.tier[ZINF_TIER_NVME].peak_bytes, ns.used_bytes);
        out->tier[ZINF_TIER_NVME].peak_bytes = e->st.tier[ZINF_TIER_NVME].peak_bytes;
        out->io_buffered = ns.buffered_files;
    }
    for (uint32_t i = 0; i < e->ntensors; i++) {
        struct tensor *t = e->tensors[i];
        for (int k = 0; t && k < MEM_TIERS; k++)
            if (copy_held(e, &t->c[k])) out->tier[k].pinned_bytes += t->alloc_bytes;
    }
    out->tensors = e->live;
    pthread_mutex_unlock(&e->lock);
    return 0;
}

/* ---- open / close ------------------------------------------------------------------------ */

static void engine_free(struct zinf_engine *e)
{
    if (!e) return;
    for (uint32_t i = 0; i < e->ntensors; i++)
        engine_tensor_free(e->tensors[i]);
    free(e->tensors);
    free(e->gens);
    free(e->names);
    sched_free(&e->sched);
    lease_fini(e);
    for (size_t i = 0; e->tickets && i <= e->tickets_mask; i++)
        for (struct ticket *k = e->tickets[i], *n; k; k = n) {
            n = k->next;
            free(k);
        }
    free(e->tickets);
    staging_fini(e);
    nvme_close(e->nvme);
    host_close(e->host);
    device_close(e->dev);
    uring_close(e->io);
    for (unsigned i = 0; i < e->nvme_ndirs; i++)
        free(e->nvme_dirs[i]);
    free(e->nvme_dirs);
    free(e->deferred_free);
    free(e->retained);
    pthread_cond_destroy(&e->changed);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

static int choose_numa_node(const struct zinf_options *o)
{
    struct topo *tp = NULL;
    struct topo_choice ch = {.numa_node = -1};
    char busid[64];
    bool gpu = o->device_kind != ZINF_DEVICE_EMULATED &&
               cuda_pci_busid(o->cuda_device, busid, sizeof(busid)) == 0;

    if (topo_open(NULL, &tp) < 0) return -1;
    topo_choose(tp, gpu ? busid : NULL, o->nvme_path, &ch);
    if (ch.numa_node >= 0)
        log_debug("engine: host tier and IO thread on NUMA node %d (%s)", ch.numa_node, ch.detail);
    topo_close(tp);
    return ch.numa_node;
}

/* Before anything is opened: the swap directory is the caller's data. A saved state there
 * is refused without a flag that says what to do with it (zinf.h); RESUME and READONLY
 * need one; the directories of a fresh start are created. *id: the manifest's identity. */
static int swapdir_check(const struct zinf_options *o, uint32_t *id)
{
    bool want = (o->flags & (ZINF_OPEN_RESUME | ZINF_OPEN_READONLY)) != 0;
    const char *dir = o->nvme_path;
    struct stat st;
    size_t n = 0;
    int r;

    if (want && stat(dir, &st) < 0 && errno == ENOENT) {
        log_error("engine: no saved run in %s: the directory does not exist", dir);
        return -ENOENT;
    }
    for (unsigned i = 0; !want; i++) {
        const char *d = i == 0 ? dir : o->nvme_paths_extra ? o->nvme_paths_extra[i - 1] : NULL;
        if (!d) break;
        /* mkdir -p, as DeepSpeed does with nvme_path; each folder made is durable. */
        if ((r = dirs_make_all(d, 0755)) < 0) {
            log_error("engine: cannot create the swap directory %s: %s", d, strerror(-r));
            return r;
        }
    }
    r = persist_probe(dir, &n, id);
    if (r == -ENOENT && want) {
        log_error("engine: no saved run in %s: it holds no manifest (nothing was flushed there)",
                  dir);
        return -ENOENT;
    }
    if (r == -ENOENT) return 0;
    if (r < 0) {
        log_error("engine: %s: cannot tell whether it holds a saved state: %s", dir, strerror(-r));
        return r;
    }
    if (!want && !(o->flags & ZINF_OPEN_OVERWRITE) && n > 0) {
        char count[32] = "an unreadable manifest";
        if (n != SIZE_MAX) snprintf(count, sizeof(count), "%zu tensors", n);
        log_error("engine: %s holds a saved state (%s): open it with ZINF_OPEN_RESUME to continue "
                  "it or ZINF_OPEN_READONLY to inspect it; ZINF_OPEN_OVERWRITE deletes it and "
                  "starts over",
                  dir, count);
        return -EEXIST;
    }
    return 0;
}

static int open_once(const struct zinf_options *opt, const struct engine_params *p, uint32_t *id,
                     zinf_engine **out)
{
    struct zinf_options o = opt ? *opt : (struct zinf_options){0};
    struct engine_params params = p ? *p : (struct engine_params){.pin = true};
    struct zinf_engine *e;
    int r;

    if (!out) return -EINVAL;
    *out = NULL;
    /* The public flag for the previous version is the engine's own from here on. */
    if (o.flags & ZINF_OPEN_PREVIOUS) o.flags = (o.flags & ~ZINF_OPEN_PREVIOUS) | ENGINE_OPEN_PREVIOUS;
    for (size_t i = 0; i < ARRAY_SIZE(o.reserved); i++)
        if (o.reserved[i]) return -EINVAL;
    if (o.block_size == 0) o.block_size = MiB;
    if (o.queue_depth == 0) o.queue_depth = 32;
    if (!is_aligned(o.block_size, ZINF_ALIGN) || o.block_size > 64 * MiB || o.queue_depth > 4096 ||
        o.device_kind > ZINF_DEVICE_EMULATED || o.cuda_device < 0 ||
        (o.flags & ~(ZINF_OPEN_RESUME | ZINF_OPEN_NO_PIN | ZINF_OPEN_OVERWRITE |
                     ZINF_OPEN_READONLY | ENGINE_OPEN_PREVIOUS)))
        return -EINVAL;
    if ((o.flags & ENGINE_OPEN_PREVIOUS) && !(o.flags & (ZINF_OPEN_RESUME | ZINF_OPEN_READONLY)))
        return -EINVAL;
    if ((o.flags & (ZINF_OPEN_RESUME | ZINF_OPEN_READONLY)) && !o.nvme_path) return -EINVAL;
    if ((o.flags & ZINF_OPEN_OVERWRITE) && (o.flags & (ZINF_OPEN_RESUME | ZINF_OPEN_READONLY)))
        return -EINVAL; /* start over and keep: one or the other */
    if (o.flags & ZINF_OPEN_NO_PIN) { /* the caller's choice, as pin_memory false is */
        params.pin = false;
        params.pin_chosen = true;
    }
    if (o.host_bytes == 0) o.host_bytes = DEFAULT_HOST_BYTES;
    if (o.host_bytes > SIZE_MAX - ZINF_ALIGN) {
        log_error("engine: host_bytes %zu is larger than any address space", o.host_bytes);
        return -EINVAL; /* rounding up would wrap to 0 and silently mean the default */
    }
    o.host_bytes = align_up(o.host_bytes, ZINF_ALIGN);
    if (o.nvme_path && (r = swapdir_check(&o, id)) < 0) return r;

    e = calloc(1, sizeof(*e));
    if (!e) return -ENOMEM;
    e->h.kind = HANDLE_ENGINE;
    static atomic_int engines_opened;
    e->trace_id = atomic_fetch_add(&engines_opened, 1) + 1;
    pthread_mutex_init(&e->lock, NULL);
    pthread_condattr_t ca; /* engine_wait_until's deadlines are now_ns()'s clock */
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->changed, &ca);
    pthread_condattr_destroy(&ca);
    for (int i = 0; i < MEM_TIERS; i++)
        e->res[i].res_next = e->res[i].res_prev = &e->res[i];
    e->opt = o;
    e->tag = -1;
    e->opt.nvme_path = NULL; /* the caller's strings are not kept: see nvme_dirs */
    e->opt.nvme_paths_extra = NULL;
    e->block_size = o.block_size;
    e->queue_depth = o.queue_depth;
    e->nbuckets = 64;
    e->names = calloc(e->nbuckets, sizeof(*e->names));
    if (!e->names) {
        r = -ENOMEM;
        goto err;
    }

    int node = choose_numa_node(&o);
    struct uring_opts uo = {.block_size = o.block_size,
                            .queue_depth = o.queue_depth,
                            .bind_numa = node >= 0,
                            .numa_node = node,
                            .backend = params.io_backend,
                            .sqpoll = params.sqpoll,
                            .submit_batch = params.submit_batch,
                            .rings = params.rings};
    if ((r = uring_open(&uo, &e->io)) < 0) {
        log_error("engine: cannot set up the IO engine: %s", zinf_strerror(r));
        goto err;
    }
    struct device_opts dop = {.kind = o.device_kind,
                              .cuda_device = o.cuda_device,
                              .capacity_bytes = o.device_bytes,
                              .shared = params.shared,
                              .arena = params.device_arena,
                              .arena_bytes = params.device_arena_bytes};
    if ((r = device_open(&dop, &e->dev)) < 0) goto err;
    /* The service's clients may die holding pins: undo images (undo.c). */
    if (params.shared) e->undo = 1u << ZINF_TIER_HOST | 1u << ZINF_TIER_DEVICE;

    /* Twice the queue depth: a slot stays taken while its chunk is copied to the device,
     * and the drive should still see queue_depth reads meanwhile. */
    unsigned nslots = params.staging_slots ? params.staging_slots : MAX(4u, 2 * o.queue_depth);
    struct host_opts hop = {.capacity_bytes = o.host_bytes,
                            .staging_bytes = (size_t)nslots * o.block_size,
                            .pin = params.pin,
                            /* a read-only view of a saved run stays unpinned unsaid, as does
                             * a config that offloads nothing to the host */
                            .quiet = (o.flags & ZINF_OPEN_READONLY) != 0 || params.quiet_unpinned,
                            .pin_chosen = params.pin_chosen,
                            .no_huge_pages = params.no_huge_pages,
                            .numa_node = node,
                            .io = e->io,
                            .dev = e->dev,
                            .shared = params.shared};
    if ((r = host_open(&hop, &e->host)) < 0) goto err;
    if ((r = staging_init(e, nslots)) < 0) goto err;

    if (o.nvme_path) {
        unsigned n = 1;
        for (const char *const *x = o.nvme_paths_extra; x && *x; x++)
            n++;
        if (n > NVME_MAX_DIRS) {
            r = -EINVAL;
            goto err;
        }
        e->nvme_dirs = calloc(n, sizeof(char *));
        if (!e->nvme_dirs) {
            r = -ENOMEM;
            goto err;
        }
        for (unsigned i = 0; i < n; i++) {
            const char *d = i == 0 ? o.nvme_path : o.nvme_paths_extra[i - 1];
            if (!(e->nvme_dirs[i] = strdup(d))) {
                r = -ENOMEM;
                goto err;
            }
            e->nvme_ndirs++;
        }
        /* Starting over: the manifest goes (durably) before the files it names are
         * emptied, once they are locked, so a crash in between leaves nothing to resume
         * rather than a manifest naming bytes that are gone. */
        char mpath[4096];
        persist_manifest_path(e->nvme_dirs[0], mpath, sizeof(mpath));
        struct nvme_opts nop = {.dirs = (const char *const *)e->nvme_dirs,
                                .ndirs = n,
                                .block_size = o.block_size,
                                .keep = (o.flags & ZINF_OPEN_RESUME) != 0,
                                .readonly = (o.flags & ZINF_OPEN_READONLY) != 0,
                                .remove_before_truncate = mpath};
        if ((r = nvme_open(&nop, e->io, &e->nvme)) < 0) goto err;
    }

    struct device_stats ds;
    struct host_stats hs;
    device_get_stats(e->dev, &ds);
    host_get_stats(e->host, &hs);
    e->st.tier[ZINF_TIER_DEVICE].capacity_bytes = ds.capacity_bytes;
    e->st.tier[ZINF_TIER_HOST].capacity_bytes = hs.capacity_bytes;
    /* Prefetched copies take room that eviction by next use would give to copies used
     * again: by default an eighth of the device tier runs ahead (enough to keep the drive
     * busy), and never more than half, whatever the config asks. */
    uint64_t pf_cap = MAX((uint64_t)ds.capacity_bytes / 2, (uint64_t)o.block_size);
    e->prefetch_budget_bytes = params.prefetch_budget_bytes
                                   ? MIN(params.prefetch_budget_bytes, pf_cap)
                                   : MAX((uint64_t)ds.capacity_bytes / 8, (uint64_t)o.block_size);
    e->prefetch_one_ahead = params.prefetch_budget_bytes == 0;
    e->write_behind = !params.no_write_behind;
    e->sched.rec_from_start = true; /* opening is a step boundary */

    if (e->nvme) {
        r = (o.flags & (ZINF_OPEN_RESUME | ZINF_OPEN_READONLY)) ? persist_resume(e)
                                                                : persist_remove_manifest(e);
        if (r < 0) goto err;
    }
    *out = e;
    return 0;
err:
    engine_free(e);
    return r;
}

int engine_open(const struct zinf_options *opt, const struct engine_params *p, zinf_engine **out)
{
    uint32_t id0 = 0, id1;
    size_t n;
    int r;

    trace_from_env(); /* ZINF_TRACE=FILE: any program's first engine starts the trace */
    for (int tries = 0;; tries++) {
        r = open_once(opt, p, &id0, out);
        /* A reader next to a running job may read extents that job reused after replacing
         * the manifest: their checksums then fail (and those tensors are marked damaged).
         * When the manifest did change meanwhile, the new state is read again; a mismatch
         * under an unchanged manifest is real damage, reported as such. */
        if (r == 0) (*out)->manifest_id = id0;
        bool damaged = r == -EBADMSG || (r == 0 && (*out)->st.tensors_damaged);
        if (!damaged || !opt || !(opt->flags & ZINF_OPEN_READONLY) || tries == 16 ||
            persist_probe(opt->nvme_path, &n, &id1) < 0 || id1 == id0)
            return r;
        if (r == 0) {
            engine_api_close(*out); /* read-only: nothing is flushed */
            *out = NULL;
        }
        log_notice("engine: %s: the saved state was replaced while it was read; reading the "
                   "new one",
                   opt->nvme_path);
    }
}

int engine_checksum_failed(struct zinf_engine *e)
{
    size_t n;
    uint32_t id;
    if (persist_probe(e->nvme_dirs[0], &n, &id) == 0 && id == e->manifest_id) return -EBADMSG;
    log_notice("engine: %s: a tensor's saved bytes changed under this read-only engine (the "
               "writer replaced the saved state and reused the extent): -ESTALE; reopen it to "
               "read the new state",
               e->nvme_dirs[0]);
    return -ESTALE;
}

ZINF_API int zinf_open(const struct zinf_options *opt, zinf_engine **out)
{
    if (opt && (opt->flags & ENGINE_OPEN_PREVIOUS)) return -EINVAL; /* not the caller's */
    return engine_open(opt, NULL, out);
}

/* What a DeepSpeed config says beyond zinf_options. DeepSpeed counts buffers and
 * buckets in parameter elements; zinf takes them as 2-byte (fp16/bf16) elements. */
static struct engine_params config_engine_params(const struct zinf_config *c, size_t block_size)
{
    const struct config_offload_param *op = &c->zero.offload_param;
    struct engine_params p = {
        .pin = op->pin_memory || c->zero.offload_optimizer.pin_memory,
        /* pin_memory is about what is offloaded: with neither section offloading, its
         * default (false) says nothing the user chose, and the notice would not apply. */
        .quiet_unpinned = op->device == CONFIG_OFFLOAD_NONE &&
                          c->zero.offload_optimizer.device == CONFIG_OFFLOAD_NONE,
        /* "pin_memory": false in either section: the user chose to run unpinned. */
        .pin_chosen = config_given(c, "zero_optimization.offload_param.pin_memory") ||
                      config_given(c, "zero_optimization.offload_optimizer.pin_memory"),
        .prefetch_budget_bytes = c->zero.stage3_prefetch_bucket_size * 2,
        .sqpoll = c->zinf.sqpoll,
        .io_backend = c->zinf.io_backend == CONFIG_IO_URING     ? URING_BACKEND_IO_URING
                      : c->zinf.io_backend == CONFIG_IO_THREADS ? URING_BACKEND_THREADS
                                                                : URING_BACKEND_AUTO,
        .submit_batch = c->zinf.submit_batch,
        .no_huge_pages = !c->zinf.huge_pages,
        .no_write_behind = !c->zero.offload_optimizer.pipeline_write,
        .rings = MIN(c->aio.intra_op_parallelism, (unsigned)URING_MAX_RINGS),
        .device_arena = c->device_arena,
        .device_arena_bytes = c->device_arena_bytes,
    };
    if (config_is_auto(c, "zero_optimization.stage3_prefetch_bucket_size"))
        log_notice("zero_optimization.stage3_prefetch_bucket_size is \"auto\" and no model is "
                   "known here: DeepSpeed's default, %llu elements, is used",
                   (unsigned long long)c->zero.stage3_prefetch_bucket_size);
    if (c->aio.intra_op_parallelism > URING_MAX_RINGS)
        log_notice("aio.intra_op_parallelism %u: zinf drives at most %d io_uring rings; using "
                   "%d",
                   c->aio.intra_op_parallelism, URING_MAX_RINGS, URING_MAX_RINGS);
    if (c->zinf.staging_bytes) {
        /* Said in bytes: whole blocks, at least four (two in flight, two being copied). */
        p.staging_slots = (unsigned)MAX(4u, c->zinf.staging_bytes / block_size);
        return p;
    }
    if (op->device == CONFIG_OFFLOAD_NVME) {
        /* DeepSpeed's defaults (5 buffers of 1e8 elements) would pin a gigabyte: the ring
         * streams any tensor through any size, so it is capped at 64 MiB. */
        uint64_t bytes = MIN(op->buffer_count * op->buffer_size * 2, (uint64_t)64 * MiB);
        p.staging_slots = (unsigned)MAX(4u, bytes / block_size);
    }
    return p;
}

/* subdir, when not NULL, is a folder under each of the config's swap directories. */
static int open_config(const struct zinf_config *c, unsigned flags, bool shared, const char *subdir,
                       zinf_engine **out)
{
    struct zinf_options o;
    char *dirs[CONFIG_MAX_NVME_PATHS] = {0};
    const char *extra[CONFIG_MAX_NVME_PATHS + 1] = {0};
    int r = 0;

    config_to_options(c, &o);
    o.flags |= flags;
    if (subdir && o.nvme_path) {
        for (unsigned i = 0; i < c->nvme_paths.count && r == 0; i++)
            if (asprintf(&dirs[i], "%s/%s", c->nvme_paths.path[i], subdir) < 0) {
                dirs[i] = NULL;
                r = -ENOMEM;
            }
        o.nvme_path = dirs[0];
        for (unsigned i = 1; i < c->nvme_paths.count; i++)
            extra[i - 1] = dirs[i];
        o.nvme_paths_extra = c->nvme_paths.count > 1 ? extra : NULL;
    }
    if (r == 0) {
        struct engine_params p = config_engine_params(c, o.block_size ? o.block_size : MiB);
        p.shared = shared;
        r = engine_open(&o, &p, out);
    }
    for (unsigned i = 0; i < CONFIG_MAX_NVME_PATHS; i++)
        free(dirs[i]);
    return r;
}

int engine_open_config(const struct zinf_config *c, unsigned flags, zinf_engine **out)
{
    return open_config(c, flags, false, NULL, out);
}

int engine_open_config_shared(const struct zinf_config *c, unsigned flags, const char *subdir,
                              zinf_engine **out)
{
    return open_config(c, flags, true, subdir, out);
}

/* The ZINF_OPEN_* flags a caller may give. */
#define OPEN_FLAGS                                                                                 \
    (ZINF_OPEN_RESUME | ZINF_OPEN_NO_PIN | ZINF_OPEN_OVERWRITE | ZINF_OPEN_READONLY |              \
     ZINF_OPEN_PREVIOUS)

ZINF_API int zinf_open_parsed(const struct zinf_config *cfg, unsigned flags, zinf_engine **out)
{
    if (!cfg || !out) return -EINVAL;
    *out = NULL;
    if (flags & ~OPEN_FLAGS) return -EINVAL;
    return engine_open_config(cfg, flags, out);
}

ZINF_API int zinf_open_config(const char *json_path, zinf_engine **out)
{
    return zinf_open_config_flags(json_path, 0, out);
}

ZINF_API int zinf_open_config_flags(const char *json_path, unsigned flags, zinf_engine **out)
{
    struct zinf_config c;
    char err[512];
    int r;

    if (!json_path || !out) return -EINVAL;
    *out = NULL;
    if (flags & ~OPEN_FLAGS) return -EINVAL;
    r = config_parse_file(json_path, &c, err, sizeof(err));
    if (r < 0) {
        log_error("%s", err);
        config_free(&c);
        return r;
    }
    r = engine_open_config(&c, flags, out);
    config_free(&c);
    return r;
}

static void close_engine(zinf_engine *e, bool flush)
{
    if (!e) return;
    pthread_mutex_lock(&e->lock);
    e->closing = true;
    if (e->nvme && flush) {
        int r = persist_flush(e);
        if (r < 0) log_error("engine: flush at close failed: %s", zinf_strerror(r));
    }
    while (e->xfers_inflight)
        engine_wait(e);
    pthread_mutex_unlock(&e->lock);
    engine_free(e);
}

void engine_api_close(zinf_engine *e)
{
    /* A read-only engine has nothing to flush, and must not write a manifest. */
    close_engine(e, e && !(e->opt.flags & ZINF_OPEN_READONLY));
}

void engine_close_unflushed(zinf_engine *e)
{
    close_engine(e, false);
}

int engine_regions(zinf_engine *e, struct engine_region out[MEM_TIERS])
{
    memset(out, 0, MEM_TIERS * sizeof(*out));
    int r = device_shared(e->dev, &out[0].fd, &out[0].base, &out[0].bytes);
    if (r == -ENOTSUP) { /* a CUDA arena: shared through CUDA IPC */
        out[0].fd = -1;
        out[0].cuda = true;
        r = device_ipc_export(e->dev, out[0].ipc_handle, out[0].busid, &out[0].base,
                              &out[0].bytes);
    }
    if (r == 0) r = host_shared(e->host, &out[1].fd, &out[1].base, &out[1].bytes);
    if (r < 0) return r;
    out[0].tier = ZINF_TIER_DEVICE;
    out[1].tier = ZINF_TIER_HOST;
    return MEM_TIERS;
}
