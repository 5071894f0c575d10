/*
 * uring_req.c - the IO engine's data path: requests from uring_submit() to their callback.
 *
 * Requests wait in a FIFO; pump() cuts the head request into chunks of at most
 * block_size (and at most what the request's map calls contiguous) while fewer than
 * queue_depth chunks are in flight, and hands them to the backend:
 *   - io_uring: SQEs are prepared under the lock and pushed with one io_uring_submit()
 *     per pump, so a burst of chunks costs one syscall; a reaper thread waits for CQEs,
 *     handles every CQE available in one pass, then refills. With uring_opts.rings > 1
 *     there are that many rings, each with its own reaper, and chunks are dealt to them
 *     in turn (what DeepSpeed's aio.intra_op_parallelism asks for): the queue depth,
 *     the pending list and the lock stay shared.
 *   - threads: a pool of workers doing pread/pwrite, for kernels and sandboxes without
 *     io_uring.
 * Every completion, in either backend, goes through chunk_done(): short transfers are
 * resubmitted for the remainder, -EAGAIN is retried, anything else becomes the request's
 * result. Callbacks run on the engine's thread, outside the lock, so a callback may submit.
 *
 * Not here: setting the rings or the workers up and tearing them down, files and
 * registered buffers (uring.c); caching, ordering between requests, or knowledge of what
 * the bytes mean.
 */
#include <errno.h>
#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "io/uring.h"
#include "io/uring_int.h"
#include "trace.h"

#define MAX_EAGAIN 1000

/* ---- chunk issue (lock held) ---------------------------------------------------- */

static int region_slot(struct uring *u, const char *p, size_t len)
{
    for (unsigned i = 0; i < MAX_REGIONS; i++) {
        struct region *r = &u->regions[i];
        if (!r->used || p < r->base || p + len > r->base + r->len)
            continue;
        size_t a = (size_t)(p - r->base) / SLICE_BYTES;
        size_t b = (size_t)(p + len - 1 - r->base) / SLICE_BYTES;
        return a == b ? (int)(r->first_slot + a) : -1;
    }
    return -1;
}

static void issue_chunk(struct uring *u, struct chunk *c)
{
    if (u->backend == URING_BACKEND_THREADS) {
        c->next = NULL;
        if (u->work_tail)
            u->work_tail->next = c;
        else
            u->work_head = c;
        u->work_tail = c;
        pthread_cond_signal(&u->work_cv);
        return;
    }

    /* At most queue_depth chunks are in flight and every SQ has more entries than that,
     * so an SQE is always free here. */
    struct ring *rg = &u->rings[u->next_ring];
    u->next_ring = (u->next_ring + 1) % u->nrings;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&rg->ring);
    if (!sqe) {
        io_uring_submit(&rg->ring);
        u->st.submit_calls++;
        rg->prepared = 0;
        sqe = io_uring_get_sqe(&rg->ring);
    }
    if (c->forced_res) {
        io_uring_prep_nop(sqe);
    } else {
        char *buf = (char *)c->req->buf + c->req_off + c->done;
        unsigned len = c->len - c->done;
        uint64_t off = c->phys + c->done;
        int slot = u->st.fixed_buffers ? region_slot(u, buf, len) : -1;
        bool rd = c->req->op == URING_READ;
        int fd = u->st.fixed_files ? c->file : u->files[c->file].fd;

        if (slot >= 0 && rd)
            io_uring_prep_read_fixed(sqe, fd, buf, len, off, slot);
        else if (slot >= 0)
            io_uring_prep_write_fixed(sqe, fd, buf, len, off, slot);
        else if (rd)
            io_uring_prep_read(sqe, fd, buf, len, off);
        else
            io_uring_prep_write(sqe, fd, buf, len, off);
        if (u->st.fixed_files)
            sqe->flags |= IOSQE_FIXED_FILE;
    }
    io_uring_sqe_set_data(sqe, c);
    rg->prepared++;
}

static void flush_ring(struct uring *u, struct ring *rg)
{
    for (int tries = 0; tries < 1000; tries++) {
        int r = io_uring_submit(&rg->ring);
        u->st.submit_calls++;
        if (r >= 0) {
            rg->prepared = 0;
            return;
        }
        if (r != -EAGAIN && r != -EBUSY && r != -EINTR) {
            /* The SQEs stay in the ring and go with the next submit. */
            log_error("io: io_uring_submit failed: %s", strerror(-r));
            return;
        }
        sched_yield();
    }
}

static void flush_sqes(struct uring *u)
{
    if (u->backend != URING_BACKEND_IO_URING)
        return;
    for (unsigned i = 0; i < u->nrings; i++)
        if (u->rings[i].prepared)
            flush_ring(u, &u->rings[i]);
}

/* Cut chunks from the pending requests while there is room in the queue. */
static void pump(struct uring *u)
{
    /* With a submit batch, refill only once that many slots are free (or the queue has run
     * dry): the chunks then reach the block layer together, where it can plug and merge
     * them, rather than one per completion. */
    if (u->o.submit_batch > 1 && u->chunks_inflight > 0 &&
        u->o.queue_depth - u->chunks_inflight < u->o.submit_batch) {
        flush_sqes(u);
        return;
    }
    while (u->chunks_inflight < u->o.queue_depth && u->pend_head && u->free_chunks) {
        struct uring_req *req = u->pend_head;
        struct chunk *c = u->free_chunks;
        uint64_t rem = req->len - req->split_;
        uint64_t clen = MIN(rem, (uint64_t)u->o.block_size);

        u->free_chunks = c->next;
        *c = (struct chunk){.req = req, .req_off = req->split_};
        if (req->map) {
            uint64_t contig = 0;
            int r = req->map(req->map_data, req->off + req->split_, &c->file, &c->phys, &contig);
            if (r == 0 && (c->file < 0 || (unsigned)c->file >= u->nfiles ||
                           u->files[c->file].fd < 0 || contig == 0 ||
                           !is_aligned(c->phys, ZINF_ALIGN) || !is_aligned(contig, ZINF_ALIGN)))
                r = -EINVAL;
            if (r < 0) {
                /* Fail the rest of the request through the completion path, so the
                 * callback still runs on the engine's thread. */
                c->forced_res = r;
                clen = rem;
            } else {
                clen = MIN(clen, contig);
            }
        } else {
            c->file = req->file;
            c->phys = req->off + req->split_;
        }
        c->len = (uint32_t)clen;
        req->split_ += clen;
        req->chunks_++;
        if (req->split_ == req->len) {
            u->pend_head = req->next_;
            if (!u->pend_head)
                u->pend_tail = NULL;
        }
        u->chunks_inflight++;
        u->st.chunks++;
        issue_chunk(u, c);
    }
    flush_sqes(u);
}

/* ---- completion (lock held) ----------------------------------------------------- */

static int apply_fault(struct uring *u, struct chunk *c, int res)
{
    if (u->fault == URING_FAULT_NONE || u->fault == URING_FAULT_SUBMIT ||
        u->fault_countdown == 0 || c->forced_res)
        return res;
    if (u->fault == URING_FAULT_EIO_STICKY)
        return -EIO; /* a drive gone bad: every completion fails until the hook is reset */
    if (u->fault == URING_FAULT_EIO_READ_STICKY)
        return c->req->op == URING_READ ? -EIO : res;
    if (u->fault == URING_FAULT_EIO_READ && c->req->op != URING_READ)
        return res;
    if (u->fault == URING_FAULT_EIO_WRITE && c->req->op == URING_READ)
        return res;
    if (--u->fault_countdown > 0)
        return res;
    enum uring_fault f = u->fault;
    u->fault = URING_FAULT_NONE;
    switch (f) {
    case URING_FAULT_EIO:
    case URING_FAULT_EIO_READ:
    case URING_FAULT_EIO_WRITE:
        return -EIO;
    case URING_FAULT_EAGAIN:
        return -EAGAIN;
    case URING_FAULT_SHORT:
        /* Pretend the kernel moved only part of it; the rest must be resubmitted. A
         * chunk too small to shorten on a 4 KiB boundary reports -EAGAIN instead. */
        if (res > 0 && align_down((uint64_t)res / 2, ZINF_ALIGN) > 0)
            return (int)align_down((uint64_t)res / 2, ZINF_ALIGN);
        return res > 0 ? -EAGAIN : res;
    default:
        return res;
    }
}

static void finish_request(struct uring_req *req, struct uring_req **done)
{
    req->next_ = *done;
    *done = req;
}

static void chunk_done(struct uring *u, struct chunk *c, int res, struct uring_req **done)
{
    struct uring_req *req = c->req;

    if (c->forced_res)
        res = c->forced_res;
    res = apply_fault(u, c, res);

    if (res == -EAGAIN && ++c->eagains < MAX_EAGAIN) {
        u->st.eagain_retries++;
        issue_chunk(u, c);
        return;
    }
    if (res > 0) {
        if (req->op == URING_READ)
            u->st.bytes_read += (uint64_t)res;
        else
            u->st.bytes_written += (uint64_t)res;
        c->done += (uint32_t)res;
        if (c->done < c->len) {
            u->st.short_retries++;
            issue_chunk(u, c);
            return;
        }
        res = 0;
    } else if (res == 0 && c->done < c->len) {
        /* No progress: a read at end of file, or a write the device took none of. */
        res = req->op == URING_READ ? -ENODATA : -EIO;
    }
    if (res < 0 && req->res_ == 0) {
        req->res_ = res;
        /* Stop cutting chunks from a failed request; wait for those in flight. */
        if (req->split_ < req->len) {
            req->split_ = req->len;
            if (u->pend_head == req) {
                u->pend_head = req->next_;
                if (!u->pend_head)
                    u->pend_tail = NULL;
            }
        }
    }
    req->chunks_--;
    u->chunks_inflight--;
    c->next = u->free_chunks;
    u->free_chunks = c;
    if (req->chunks_ == 0 && req->split_ == req->len) {
        if (req->res_)
            u->st.errors++;
        finish_request(req, done);
    }
}

/* Run callbacks outside the lock, then account for them, so uring_drain()/close() only
 * return once every callback has returned. */
static void run_callbacks(struct uring *u, struct uring_req *done)
{
    unsigned n = 0;
    while (done) {
        struct uring_req *next = done->next_;
        done->next_ = NULL;
        done->cb(done, done->res_);
        done = next;
        n++;
    }
    if (n) {
        pthread_mutex_lock(&u->lock);
        u->reqs_active -= n;
        if (u->reqs_active == 0)
            pthread_cond_broadcast(&u->idle_cv);
        pthread_mutex_unlock(&u->lock);
    }
}

/* Completions are handled next to the memory they land in (the host tier's node). */
static void bind_thread(struct uring *u)
{
    if (!u->o.bind_numa || numa_available() < 0)
        return;
    pthread_mutex_lock(&numa_call_lock);
    int r = numa_run_on_node(u->o.numa_node), err = errno;
    pthread_mutex_unlock(&numa_call_lock);
    if (r < 0)
        log_notice("io: cannot run the IO thread on NUMA node %d: %s", u->o.numa_node,
                   strerror(err));
}

void *uring_reaper_main(void *arg)
{
    struct ring *rg = arg;
    struct uring *u = rg->u;
    bool stop = false;
    trace_thread_name("io completion");

    bind_thread(u);

    while (!stop) {
        struct io_uring_cqe *cqe;
        struct uring_req *done = NULL;
        unsigned head, n = 0;
        int r = io_uring_wait_cqe(&rg->ring, &cqe);
        if (r == -EINTR || r == -EAGAIN)
            continue;
        if (r < 0) {
            log_error("io: waiting for completions failed: %s", strerror(-r));
            break;
        }
        pthread_mutex_lock(&u->lock);
        io_uring_for_each_cqe(&rg->ring, head, cqe)
        {
            n++;
            if (cqe->user_data == STOP_TAG) {
                stop = true;
                continue;
            }
            chunk_done(u, io_uring_cqe_get_data(cqe), cqe->res, &done);
        }
        io_uring_cq_advance(&rg->ring, n);
        pump(u);
        pthread_mutex_unlock(&u->lock);
        run_callbacks(u, done);
    }
    return NULL;
}

void *uring_worker_main(void *arg)
{
    struct uring *u = arg;

    trace_thread_name("io worker");
    bind_thread(u);

    pthread_mutex_lock(&u->lock);
    for (;;) {
        while (!u->work_head && !u->workers_stop)
            pthread_cond_wait(&u->work_cv, &u->lock);
        if (!u->work_head)
            break;
        struct chunk *c = u->work_head;
        u->work_head = c->next;
        if (!u->work_head)
            u->work_tail = NULL;
        int fd = c->forced_res ? -1 : u->files[c->file].fd;
        pthread_mutex_unlock(&u->lock);

        ssize_t res = c->forced_res;
        if (!c->forced_res) {
            char *buf = (char *)c->req->buf + c->req_off + c->done;
            size_t len = c->len - c->done;
            off_t off = (off_t)(c->phys + c->done);
            res = c->req->op == URING_READ ? pread(fd, buf, len, off) : pwrite(fd, buf, len, off);
            if (res < 0)
                res = -errno;
        }

        struct uring_req *done = NULL;
        pthread_mutex_lock(&u->lock);
        chunk_done(u, c, (int)res, &done);
        pump(u);
        if (done) {
            pthread_mutex_unlock(&u->lock);
            run_callbacks(u, done);
            pthread_mutex_lock(&u->lock);
        }
    }
    pthread_mutex_unlock(&u->lock);
    return NULL;
}

/* ---- requests --------------------------------------------------------------------- */

int uring_submit(struct uring *u, struct uring_req *req)
{
    if (!u || !req || !req->cb || !req->buf || req->len == 0)
        return -EINVAL;
    if (!is_aligned((uintptr_t)req->buf, ZINF_ALIGN) || !is_aligned(req->len, ZINF_ALIGN) ||
        !is_aligned(req->off, ZINF_ALIGN) || (req->op != URING_READ && req->op != URING_WRITE))
        return -EINVAL;
    pthread_mutex_lock(&u->lock);
    if (u->closing) {
        pthread_mutex_unlock(&u->lock);
        return -ESHUTDOWN;
    }
    if (u->fault == URING_FAULT_SUBMIT && u->fault_countdown && --u->fault_countdown == 0) {
        u->fault = URING_FAULT_NONE;
        pthread_mutex_unlock(&u->lock);
        return -EIO; /* as if the request were refused before it was queued */
    }
    if (!req->map && !uring_file_ok(u, req->file)) {
        pthread_mutex_unlock(&u->lock);
        return -EINVAL;
    }
    req->next_ = NULL;
    req->split_ = 0;
    req->chunks_ = 0;
    req->res_ = 0;
    if (u->pend_tail)
        u->pend_tail->next_ = req;
    else
        u->pend_head = req;
    u->pend_tail = req;
    u->reqs_active++;
    u->st.requests++;
    pump(u);
    pthread_mutex_unlock(&u->lock);
    return 0;
}

static void sync_cb(struct uring_req *req, int res)
{
    completion_post(req->data, res);
}

int uring_rw(struct uring *u, enum uring_op op, int file, void *buf, size_t len, uint64_t off)
{
    struct completion w = COMPLETION_INIT;
    struct uring_req req = {.op = op, .file = file, .buf = buf, .len = len, .off = off,
                            .cb = sync_cb, .data = &w};
    int r = uring_submit(u, &req);
    if (r < 0)
        return r;
    return completion_wait(&w);
}
