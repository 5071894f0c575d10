/*
 * xfer.c - moving one tensor's content between two places, asynchronously.
 *
 * Host <-> device is one device copy; NVMe <-> host is one swap-space request (the IO
 * engine cuts it into block_size chunks). NVMe <-> device goes through the staging ring:
 * block_size slots of pinned, registered host memory. Each chunk takes a slot, is read
 * into it (NVMe read, or device->host copy) and, as soon as that lands, written out of it
 * (host->device copy, or NVMe write): disk reads and device copies overlap, and a tensor
 * of any size streams through a ring of any size. Transfers waiting for a slot queue in
 * FIFO order; a full ring makes them wait, never fail.
 *
 * Every function here runs with the engine lock held, callbacks included (they take it).
 * Not here: deciding what to move (fetch.c, residency.c) or where things are (registry.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "trace.h"

/* ---- tier memory ------------------------------------------------------------------ */

/* The trace's counters of each memory tier's allocated bytes. */
const char *const tier_used_name[MEM_TIERS] = {"device bytes in use", "host bytes in use"};

int tier_alloc(struct zinf_engine *e, int tier, size_t bytes, uint64_t *off, void **ptr)
{
    uint64_t used;
    int r;
    if (tier == ZINF_TIER_DEVICE) {
        struct device_stats ds;
        r = device_alloc(e->dev, bytes, off);
        if (r < 0)
            return r;
        *ptr = device_ptr(e->dev, *off);
        device_get_stats(e->dev, &ds);
        used = ds.used_bytes;
    } else {
        struct host_stats hs;
        r = host_alloc(e->host, bytes, off);
        if (r < 0)
            return r;
        *ptr = host_ptr(e->host, *off);
        host_get_stats(e->host, &hs);
        used = hs.used_bytes;
    }
    e->st.tier[tier].peak_bytes = MAX(e->st.tier[tier].peak_bytes, used);
    if (trace_on()) engine_trace_counters(e, false);
    return 0;
}

void tier_free(struct zinf_engine *e, int tier, uint64_t off)
{
    if (tier == ZINF_TIER_DEVICE)
        device_free(e->dev, off);
    else
        host_free(e->host, off);
    if (trace_on()) engine_trace_counters(e, false);
}

/* The trace's counters of this engine: bytes in use per memory tier, NVMe bytes read and
 * written (as zinf_stats counts them). At most once a millisecond (a step allocates and
 * frees thousands of times), unless force (the end of a flush): the last values are then
 * the engine's. */
void engine_trace_counters(struct zinf_engine *e, bool force)
{
    uint64_t now = now_ns();
    if (!force && now - e->trace_counters_t < 1000000ull) return;
    e->trace_counters_t = now;
    for (int k = 0; k < MEM_TIERS; k++)
        trace_counter(tier_used_name[k], e->trace_id, (int64_t)tier_used(e, k));
    trace_counter("nvme bytes read", e->trace_id, (int64_t)e->st.nvme_bytes_read);
    trace_counter("nvme bytes written", e->trace_id, (int64_t)e->st.nvme_bytes_written);
}

uint64_t tier_used(struct zinf_engine *e, int tier)
{
    if (tier == ZINF_TIER_DEVICE) {
        struct device_stats ds;
        device_get_stats(e->dev, &ds);
        return ds.used_bytes;
    }
    struct host_stats hs;
    host_get_stats(e->host, &hs);
    return hs.used_bytes;
}

void tier_rewind(struct zinf_engine *e, int tier)
{
    if (tier == ZINF_TIER_DEVICE)
        device_alloc_rewind(e->dev);
    else
        host_alloc_rewind(e->host);
}

/* ---- completion ------------------------------------------------------------------- */

/* The trace of a finished transfer: an async span named by its tiers (a group of NVMe
 * requests, or one device copy), labelled with what it was for; the NVMe byte counters
 * (as zinf_stats counts them) and, over windows of at least 50 ms, their rates. */
static void xfer_trace(struct xfer *x, int err)
{
    struct zinf_engine *e = x->e;
    bool rd = x->src == ZINF_TIER_NVME, wr = x->dst == ZINF_TIER_NVME;
    const char *name = rd                                                        ? "nvme read"
                       : wr                                                      ? "nvme write"
                       : x->src == ZINF_TIER_DEVICE                              ? "device to host copy"
                       : x->src == SRC_ZERO                                      ? "zero fill"
                                                                                 : "host to device copy";
    const char *detail = err ? "failed" : x->what;
    uint64_t id = ((uint64_t)(unsigned)e->trace_id << 40) | ++e->trace_seq;
    trace_async(rd || wr ? "io" : "copy", name, id, x->trace_t0, x->t ? x->t->name : NULL, detail,
                (int64_t)x->len);
    if (!rd && !wr) return;
    engine_trace_counters(e, false);
    uint64_t now = now_ns();
    if (!e->trace_win_t0) {
        e->trace_win_t0 = x->trace_t0;
        e->trace_win_read = e->trace_win_written = 0;
    }
    if (!err && rd) e->trace_win_read += x->len;
    if (!err && wr) e->trace_win_written += x->len;
    if (now - e->trace_win_t0 >= 50000000ull) {
        double s = (double)(now - e->trace_win_t0) / 1e9;
        /* Counters are integers: MB/s (10^6 bytes) reads as GB/s with three decimals. */
        trace_counter("nvme read MB/s", e->trace_id, (int64_t)(e->trace_win_read / s / 1e6));
        trace_counter("nvme write MB/s", e->trace_id, (int64_t)(e->trace_win_written / s / 1e6));
        e->trace_win_t0 = now;
        e->trace_win_read = e->trace_win_written = 0;
    }
}

/* After a completion: the prefetches a landed write-back may have made room for. */
static void prefetch_resume(struct zinf_engine *e)
{
    if (!e->prefetch_kick) return;
    e->prefetch_kick = false;
    sched_prefetch(e);
}

static void xfer_finish(struct xfer *x, int err)
{
    struct zinf_engine *e = x->e;
    if (x->want_crc && !err && x->chunk_crc) {
        size_t chunk = e->block_size;
        uint32_t crc = x->chunk_crc[0];
        for (unsigned i = 1; i < x->nchunks; i++) {
            size_t n = MIN(chunk, x->len - (size_t)i * chunk);
            crc = crc32c_combine(crc, x->chunk_crc[i], n);
        }
        x->crc = crc;
    }
    free(x->chunk_crc);
    x->chunk_crc = NULL;
    if (x->src == ZINF_TIER_NVME || x->dst == ZINF_TIER_NVME) {
        if (!err && x->src == ZINF_TIER_NVME)
            e->st.nvme_bytes_read += x->len;
        if (!err && x->dst == ZINF_TIER_NVME)
            e->st.nvme_bytes_written += x->len;
    }
    if (x->trace_t0 && trace_on()) xfer_trace(x, err);
    e->xfers_inflight--;
    x->done(x, err);
    pthread_cond_broadcast(&e->changed);
}

/* x may be freed by its done callback: keep the engine pointer apart. */
static void req_cb(struct uring_req *req, int res)
{
    struct xfer *x = req->data;
    struct zinf_engine *e = x->e;
    pthread_mutex_lock(&e->lock);
    xfer_finish(x, res);
    prefetch_resume(e);
    pthread_mutex_unlock(&e->lock);
}

static void dc_cb(struct device_copy *c, int res)
{
    struct xfer *x = c->data;
    struct zinf_engine *e = x->e;
    pthread_mutex_lock(&e->lock);
    xfer_finish(x, res);
    prefetch_resume(e);
    pthread_mutex_unlock(&e->lock);
}

/* ---- the staging ring --------------------------------------------------------------- */

static void stage_pump(struct zinf_engine *e);

static void waitq_remove(struct zinf_engine *e, struct xfer *x)
{
    struct xfer **pp = &e->stage_waitq, *prev = NULL;
    while (*pp && *pp != x) {
        prev = *pp;
        pp = &(*pp)->wait_next;
    }
    if (!*pp)
        return;
    *pp = x->wait_next;
    if (e->stage_waitq_tail == x)
        e->stage_waitq_tail = prev;
    x->wait_next = NULL;
    x->queued = false;
}

static void chunk_done(struct slot *s, int res)
{
    struct zinf_engine *e = s->e;
    struct xfer *x = s->x;

    if (res < 0 && !x->err)
        x->err = res;
    x->inflight--;
    s->x = NULL;
    s->next = e->free_slots;
    e->free_slots = s;
    if (x->inflight == 0 && (x->err || x->next >= x->len)) {
        if (x->queued)
            waitq_remove(e, x);
        xfer_finish(x, x->err);
    }
    stage_pump(e);
    prefetch_resume(e);
}

static void leg2_req_cb(struct uring_req *req, int res)
{
    struct slot *s = req->data;
    pthread_mutex_lock(&s->e->lock);
    chunk_done(s, res);
    pthread_mutex_unlock(&s->e->lock);
}

static void leg2_dc_cb(struct device_copy *c, int res)
{
    struct slot *s = c->data;
    pthread_mutex_lock(&s->e->lock);
    chunk_done(s, res);
    pthread_mutex_unlock(&s->e->lock);
}

/* The first leg landed in the slot: checksum it if asked, then send it on. */
static void leg1_landed(struct slot *s, int res)
{
    struct zinf_engine *e = s->e;
    struct xfer *x = s->x;
    int r;

    if (res < 0 || x->err) {
        chunk_done(s, res < 0 ? res : 0);
        return;
    }
    if (x->want_crc)
        x->chunk_crc[s->chunk] = crc32c(0, s->buf, s->len);
    switch (x->dst) {
    case ZINF_TIER_DEVICE:
        s->dc = (struct device_copy){.dir = DEVICE_H2D, .dev_off = x->dst_off + s->off,
                                     .host = s->buf, .len = s->len, .cb = leg2_dc_cb, .data = s};
        r = device_copy_async(e->dev, &s->dc);
        break;
    case ZINF_TIER_NVME:
        s->req = (struct uring_req){.op = URING_WRITE, .buf = s->buf, .len = s->len,
                                    .off = x->dst_off + s->off, .cb = leg2_req_cb, .data = s};
        r = nvme_submit(e->nvme, &s->req);
        break;
    case ZINF_TIER_HOST: /* a checksummed load (a read-only engine's) */
        memcpy((char *)x->dst_ptr + s->off, s->buf, s->len);
        chunk_done(s, 0);
        return;
    default: /* DST_NONE: read and checksum only */
        r = 0;
        chunk_done(s, 0);
        return;
    }
    if (r < 0)
        chunk_done(s, r);
}

static void leg1_req_cb(struct uring_req *req, int res)
{
    struct slot *s = req->data;
    pthread_mutex_lock(&s->e->lock);
    leg1_landed(s, res);
    pthread_mutex_unlock(&s->e->lock);
}

static void leg1_dc_cb(struct device_copy *c, int res)
{
    struct slot *s = c->data;
    pthread_mutex_lock(&s->e->lock);
    leg1_landed(s, res);
    pthread_mutex_unlock(&s->e->lock);
}

static void stage_issue(struct zinf_engine *e, struct slot *s)
{
    struct xfer *x = s->x;
    int r;

    if (x->src == ZINF_TIER_NVME) {
        s->req = (struct uring_req){.op = URING_READ, .buf = s->buf, .len = s->len,
                                    .off = x->src_off + s->off, .cb = leg1_req_cb, .data = s};
        r = nvme_submit(e->nvme, &s->req);
    } else if (x->src == ZINF_TIER_DEVICE) {
        s->dc = (struct device_copy){.dir = DEVICE_D2H, .dev_off = x->src_off + s->off,
                                     .host = s->buf, .len = s->len, .cb = leg1_dc_cb, .data = s};
        r = device_copy_async(e->dev, &s->dc);
    } else if (x->src == ZINF_TIER_HOST) {
        /* A checksummed write of host memory: the slot holds the bytes that are both
         * checksummed and written, whatever a caller holding a pin writes meanwhile. */
        memcpy(s->buf, (const char *)x->src_ptr + s->off, s->len);
        leg1_landed(s, 0);
        return;
    } else { /* zeros */
        memset(s->buf, 0, s->len);
        leg1_landed(s, 0);
        return;
    }
    if (r < 0)
        chunk_done(s, r);
}

static void stage_pump(struct zinf_engine *e)
{
    while (e->free_slots && e->stage_waitq) {
        struct xfer *x = e->stage_waitq;
        if (x->err || x->next >= x->len) {
            waitq_remove(e, x);
            continue;
        }
        struct slot *s = e->free_slots;
        e->free_slots = s->next;
        s->x = x;
        s->off = x->next;
        s->len = MIN(e->block_size, x->len - x->next);
        s->chunk = (unsigned)(x->next / e->block_size);
        x->next += s->len;
        x->inflight++;
        if (x->next >= x->len)
            waitq_remove(e, x);
        stage_issue(e, s);
    }
}

int staging_init(struct zinf_engine *e, unsigned nslots)
{
    char *base = host_staging(e->host);
    if (!base || nslots == 0)
        return -EINVAL;
    e->slots = calloc(nslots, sizeof(*e->slots));
    if (!e->slots)
        return -ENOMEM;
    e->nslots = nslots;
    for (unsigned i = 0; i < nslots; i++) {
        e->slots[i].e = e;
        e->slots[i].buf = base + (size_t)i * e->block_size;
        e->slots[i].next = e->free_slots;
        e->free_slots = &e->slots[i];
    }
    return 0;
}

void staging_fini(struct zinf_engine *e)
{
    free(e->slots);
    e->slots = NULL;
    e->free_slots = NULL;
    e->nslots = 0;
}

/* ---- starting a transfer ------------------------------------------------------------- */

int xfer_start(struct xfer *x)
{
    struct zinf_engine *e = x->e;
    int r;

    if (x->len == 0 || !x->done)
        return -EINVAL;
    x->trace_t0 = trace_on() ? now_ns() : 0;
    bool staged = (x->src == ZINF_TIER_NVME && (x->dst == ZINF_TIER_DEVICE || x->dst == DST_NONE)) ||
                  (x->src == ZINF_TIER_DEVICE && x->dst == ZINF_TIER_NVME) ||
                  (x->src == SRC_ZERO && x->dst == ZINF_TIER_NVME) ||
                  (x->src == ZINF_TIER_HOST && x->dst == ZINF_TIER_NVME && x->want_crc) ||
                  (x->src == ZINF_TIER_NVME && x->dst == ZINF_TIER_HOST && x->want_crc);
    if (staged) {
        x->nchunks = (unsigned)((x->len + e->block_size - 1) / e->block_size);
        if (x->want_crc) {
            x->chunk_crc = calloc(x->nchunks, sizeof(uint32_t));
            if (!x->chunk_crc)
                return -ENOMEM;
        }
        x->next = 0;
        x->inflight = 0;
        x->err = 0;
        x->queued = true;
        x->wait_next = NULL;
        if (e->stage_waitq_tail)
            e->stage_waitq_tail->wait_next = x;
        else
            e->stage_waitq = x;
        e->stage_waitq_tail = x;
        e->xfers_inflight++;
        stage_pump(e);
        return 0;
    }

    if (x->want_crc)
        return -EINVAL; /* checksums are taken in the staging ring, of the bytes moved */
    if (x->src == SRC_ZERO && x->dst == ZINF_TIER_DEVICE) {
        x->dc = (struct device_copy){.dir = DEVICE_H2D, .dev_off = x->dst_off, .zero = true,
                                     .len = x->len, .cb = dc_cb, .data = x};
        r = device_copy_async(e->dev, &x->dc);
    } else if (x->src == ZINF_TIER_HOST && x->dst == ZINF_TIER_DEVICE) {
        x->dc = (struct device_copy){.dir = DEVICE_H2D, .dev_off = x->dst_off, .host = x->src_ptr,
                                     .len = x->len, .cb = dc_cb, .data = x};
        r = device_copy_async(e->dev, &x->dc);
    } else if (x->src == ZINF_TIER_DEVICE && x->dst == ZINF_TIER_HOST) {
        x->dc = (struct device_copy){.dir = DEVICE_D2H, .dev_off = x->src_off, .host = x->dst_ptr,
                                     .len = x->len, .cb = dc_cb, .data = x};
        r = device_copy_async(e->dev, &x->dc);
    } else if (x->src == ZINF_TIER_NVME && x->dst == ZINF_TIER_HOST) {
        x->req = (struct uring_req){.op = URING_READ, .buf = x->dst_ptr, .len = x->len,
                                    .off = x->src_off, .cb = req_cb, .data = x};
        r = nvme_submit(e->nvme, &x->req);
    } else if (x->src == ZINF_TIER_HOST && x->dst == ZINF_TIER_NVME) {
        x->req = (struct uring_req){.op = URING_WRITE, .buf = x->src_ptr, .len = x->len,
                                    .off = x->dst_off, .cb = req_cb, .data = x};
        r = nvme_submit(e->nvme, &x->req);
    } else {
        return -EINVAL;
    }
    if (r == 0)
        e->xfers_inflight++;
    return r;
}

struct sync_arg {
    bool done;
    int err;
};

static void sync_done(struct xfer *x, int err)
{
    struct sync_arg *a = x->arg;
    a->err = err;
    a->done = true;
}

/* Run a transfer and wait for it; the engine lock is held on entry and on return (it is
 * released while waiting). x->done and x->arg are taken over. */
int xfer_run_sync(struct zinf_engine *e, struct xfer *x)
{
    struct sync_arg a = {false, 0};
    x->done = sync_done;
    x->arg = &a;
    int r = xfer_start(x);
    if (r < 0)
        return r;
    while (!a.done)
        engine_wait(e);
    return a.err;
}

/* ---- byte ranges of a swap extent (zinf_read/zinf_write) -------------------------------- */

/* The engine lock is NOT held here: the caller owns the tensor exclusively. The range
 * streams through one aligned buffer of at most RANGE_CHUNK_BYTES, whatever its size. */
int swap_read_range(struct zinf_engine *e, struct tensor *t, uint64_t swap_off, size_t off,
                    void *dst, size_t n)
{
    size_t end = off + n;
    size_t cap = MIN(align_up(end, ZINF_ALIGN) - align_down(off, ZINF_ALIGN), RANGE_CHUNK_BYTES);
    char *tmp = NULL;
    int r = 0;

    if (posix_memalign((void **)&tmp, ZINF_ALIGN, cap))
        return -ENOMEM;
    for (size_t pos = off; pos < end && r == 0;) {
        size_t a0 = align_down(pos, ZINF_ALIGN);
        size_t a1 = MIN(align_up(end, ZINF_ALIGN), a0 + cap);
        size_t upto = MIN(a1, end);
        r = nvme_read(e->nvme, swap_off + a0, tmp, a1 - a0);
        if (r == 0)
            memcpy((char *)dst + (pos - off), tmp + (pos - a0), upto - pos);
        pos = upto;
    }
    free(tmp);
    return r;
}

int swap_read_checked(struct zinf_engine *e, struct tensor *t, size_t off, void *dst, size_t n)
{
    size_t len = t->alloc_bytes, cap = MIN(len, RANGE_CHUNK_BYTES), end = off + n;
    uint64_t at = t->swap_off;
    uint32_t crc = 0;
    char *tmp = NULL;
    int r = 0;

    if (!t->swap_crc_valid)
        return swap_read_range(e, t, at, off, dst, n);
    if (posix_memalign((void **)&tmp, ZINF_ALIGN, cap))
        return -ENOMEM;
    for (size_t pos = 0; pos < len && r == 0; pos += cap) {
        size_t k = MIN(cap, len - pos);
        r = nvme_read(e->nvme, at + pos, tmp, k);
        if (r < 0)
            break;
        crc = crc32c(crc, tmp, k);
        size_t a = MAX(pos, off), b = MIN(pos + k, end);
        if (a < b)
            memcpy((char *)dst + (a - off), tmp + (a - pos), b - a);
    }
    free(tmp);
    if (r == 0 && crc != t->swap_crc)
        r = engine_checksum_failed(e);
    return r;
}

/* Write the whole extent at to: the bytes of the extent at from (zeros when from_zero),
 * with [off, off+n) replaced by src, streamed through one buffer of at most
 * RANGE_CHUNK_BYTES. The extent at from is only read, so a failure leaves the tensor's
 * content as it was (the caller frees to). No lock held: the caller owns the tensor. */
int swap_write_merged(struct zinf_engine *e, uint64_t from, bool from_zero, uint64_t to,
                      size_t extent_bytes, size_t off, const void *src, size_t n)
{
    size_t cap = MIN(extent_bytes, RANGE_CHUNK_BYTES);
    char *buf = NULL;
    int r = 0;

    if (posix_memalign((void **)&buf, ZINF_ALIGN, cap))
        return -ENOMEM;
    for (size_t p = 0; p < extent_bytes && r == 0; p += cap) {
        size_t len = MIN(cap, extent_bytes - p);
        size_t lo = MAX(p, off), hi = MIN(p + len, off + n); /* the new bytes in it */
        bool all_new = lo == p && hi == p + len;
        if (!all_new) {
            if (from_zero)
                memset(buf, 0, len);
            else
                r = nvme_read(e->nvme, from + p, buf, len);
        }
        if (r == 0 && lo < hi)
            memcpy(buf + (lo - p), (const char *)src + (lo - off), hi - lo);
        if (r == 0)
            r = nvme_write(e->nvme, to + p, buf, len);
    }
    free(buf);
    return r;
}

/* Read-modify-write [off, off+n) of the extent at swap_off. With zero_first, the whole
 * extent (extent_bytes) is first written with zeros (its old bytes belong to nobody). On
 * success *undo holds the aligned range as it was (for rolling back), to be freed by the
 * caller. */
int swap_write_range(struct zinf_engine *e, uint64_t swap_off, size_t off, const void *src,
                     size_t n, size_t extent_bytes, bool zero_first, void **undo,
                     size_t *undo_off, size_t *undo_len)
{
    size_t a0 = align_down(off, ZINF_ALIGN), a1 = align_up(off + n, ZINF_ALIGN);
    char *tmp = NULL, *old = NULL;
    int r = 0;

    *undo = NULL;
    if (posix_memalign((void **)&tmp, ZINF_ALIGN, a1 - a0) ||
        posix_memalign((void **)&old, ZINF_ALIGN, a1 - a0)) {
        free(tmp);
        return -ENOMEM;
    }
    if (zero_first) {
        size_t zb = MIN(extent_bytes, (size_t)8 * MiB);
        char *z = NULL;
        if (posix_memalign((void **)&z, ZINF_ALIGN, zb)) {
            r = -ENOMEM;
            goto out;
        }
        memset(z, 0, zb);
        for (size_t p = 0; p < extent_bytes && r == 0; p += zb)
            r = nvme_write(e->nvme, swap_off + p, z, MIN(zb, extent_bytes - p));
        free(z);
        memset(old, 0, a1 - a0);
    } else {
        r = nvme_read(e->nvme, swap_off + a0, old, a1 - a0);
    }
    if (r < 0)
        goto out;
    memcpy(tmp, old, a1 - a0);
    memcpy(tmp + (off - a0), src, n);
    r = nvme_write(e->nvme, swap_off + a0, tmp, a1 - a0);
    if (r < 0 && !zero_first && nvme_write(e->nvme, swap_off + a0, old, a1 - a0) < 0) {
        /* A write that reports an error may still have landed, whole or in part: put the
         * old bytes back, since the caller keeps the extent as the tensor's content. */
        log_error("engine: swap extent at %llu: restoring bytes after a failed write also "
                  "failed; they may be torn", (unsigned long long)swap_off);
    }
    if (r == 0) {
        *undo = old;
        *undo_off = a0;
        *undo_len = a1 - a0;
        old = NULL;
    }
out:
    free(old);
    free(tmp);
    return r;
}
