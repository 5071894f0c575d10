/*
 * uring.c - the IO engine behind uring.h.
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
 * Not here: caching, ordering between requests, or knowledge of what the bytes mean.
 */
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "io/uring.h"
#include "trace.h"

#define STOP_TAG UINT64_MAX     /* user_data of the NOP that stops the reaper */
#define MAX_REGIONS 16
#define BUF_SLOTS 64            /* registered buffer table size */
#define SLICE_BYTES GiB         /* one registered buffer covers at most this */
#define MAX_EAGAIN 1000

struct uring;

/* One io_uring and the thread that reaps it. */
struct ring {
    struct io_uring ring;
    struct uring *u;
    bool up, reaper_up;
    pthread_t reaper;
    unsigned prepared;          /* SQEs prepared since the last io_uring_submit() */
};

struct chunk {
    struct uring_req *req;
    struct chunk *next;         /* free list or worker queue */
    uint64_t req_off;           /* where in the request this chunk starts */
    uint64_t phys;              /* file offset of the chunk's start */
    uint32_t len, done;         /* bytes in the chunk, bytes transferred so far */
    int file;
    int forced_res;             /* nonzero: complete with this result without IO */
    unsigned eagains;
};

struct ufile {
    int fd;                     /* -1: slot free */
    bool direct;
};

struct region {
    char *base;
    size_t len;
    unsigned first_slot, nslots;
    bool used;
};

struct uring {
    struct uring_opts o;
    enum uring_backend backend;

    pthread_mutex_t lock;       /* everything below, and the SQ side of the ring */
    pthread_cond_t idle_cv;     /* reqs_active dropped to zero */
    struct uring_req *pend_head, *pend_tail;
    unsigned chunks_inflight;
    unsigned reqs_active;       /* submitted and whose callback has not returned */
    bool closing;
    struct chunk *chunk_mem, *free_chunks;

    struct ufile *files;
    unsigned nfiles;
    struct region regions[MAX_REGIONS];
    bool slot_used[BUF_SLOTS];

    /* io_uring backend */
    struct ring rings[URING_MAX_RINGS];
    unsigned nrings;            /* set up; 0 with the threads backend */
    unsigned next_ring;         /* the ring the next chunk goes to */

    /* threads backend */
    pthread_cond_t work_cv;
    struct chunk *work_head, *work_tail;
    pthread_t *workers;
    unsigned nworkers;
    bool workers_stop;

    enum uring_fault fault;
    unsigned fault_countdown;
    bool fault_no_direct;
    struct uring_stats st;
};

static atomic_bool fault_no_uring; /* consumed by the next uring_open() (of any thread) */

const char *uring_backend_name(enum uring_backend b)
{
    switch (b) {
    case URING_BACKEND_IO_URING: return "io_uring";
    case URING_BACKEND_THREADS: return "threads";
    default: return "auto";
    }
}

size_t uring_block_size(struct uring *u)
{
    return u->o.block_size;
}

unsigned uring_queue_depth(struct uring *u)
{
    return u->o.queue_depth;
}

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

static void *reaper_main(void *arg)
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

static void *worker_main(void *arg)
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

/* ---- setup ---------------------------------------------------------------------- */

static int setup_ring(struct uring *u, struct ring *rg, unsigned entries)
{
    struct io_uring_params p = {0};
    int r;

    rg->u = u;
    if (u->o.sqpoll) {
        p.flags |= IORING_SETUP_SQPOLL;
        p.sq_thread_idle = 100; /* ms the kernel thread spins before it sleeps */
    }
    /* URING_FAULT_NO_URING stands in for a kernel built without io_uring: its answer to
     * setup replaces the real one, and takes the same path. */
    bool no_uring = atomic_exchange(&fault_no_uring, false);
    r = no_uring ? -ENOSYS : io_uring_queue_init_params(entries, &rg->ring, &p);
    if (r < 0 && u->o.sqpoll && !no_uring) {
        if (u->st.sqpoll) /* said once, not once per ring */
            log_notice("io: SQPOLL refused (%s); using plain io_uring submission",
                       strerror(-r));
        u->st.sqpoll = false;
        memset(&p, 0, sizeof(p));
        r = io_uring_queue_init_params(entries, &rg->ring, &p);
    }
    if (r < 0)
        return r;
    rg->up = true;
    /* Files and buffers are registered on every ring alike; where one ring cannot, no
     * ring uses them. */
    if (io_uring_register_files_sparse(&rg->ring, u->o.max_files) != 0)
        u->st.fixed_files = false;
    if (io_uring_register_buffers_sparse(&rg->ring, BUF_SLOTS) != 0)
        u->st.fixed_buffers = false;
    return 0;
}

static int setup_io_uring(struct uring *u)
{
    unsigned entries = 1, want = MAX(u->o.rings, 1u);
    int r = 0;

    while (entries < u->o.queue_depth + 1)
        entries <<= 1;
    /* Each ring clears what it cannot do. */
    u->st.fixed_files = u->st.fixed_buffers = true;
    u->st.sqpoll = u->o.sqpoll;
    for (; u->nrings < want; u->nrings++)
        if ((r = setup_ring(u, &u->rings[u->nrings], entries)) < 0)
            break;
    if (r < 0 && u->nrings == 0) {
        u->st.fixed_files = u->st.fixed_buffers = u->st.sqpoll = false;
        return r;
    }
    if (r < 0) /* fewer rings than asked for: go on with those, and say so */
        log_notice("io: %u of %u io_uring rings set up (%s)", u->nrings, want, strerror(-r));
    for (unsigned i = 0; i < u->nrings; i++) {
        struct ring *rg = &u->rings[i];
        r = pthread_create(&rg->reaper, NULL, reaper_main, rg);
        if (r) {
            /* uring_close() stops the reapers that started and frees every ring. */
            return -r;
        }
        rg->reaper_up = true;
        pthread_setname_np(rg->reaper, "zinf-reap");
    }
    return 0;
}

static int setup_threads(struct uring *u)
{
    unsigned n = MIN(u->o.queue_depth, 32u);

    u->workers = calloc(n, sizeof(*u->workers));
    if (!u->workers)
        return -ENOMEM;
    for (; u->nworkers < n; u->nworkers++) {
        int r = pthread_create(&u->workers[u->nworkers], NULL, worker_main, u);
        if (r)
            return -r;
        pthread_setname_np(u->workers[u->nworkers], "zinf-io");
    }
    return 0;
}

static void stop_threads(struct uring *u)
{
    pthread_mutex_lock(&u->lock);
    u->workers_stop = true;
    pthread_cond_broadcast(&u->work_cv);
    pthread_mutex_unlock(&u->lock);
    for (unsigned i = 0; i < u->nworkers; i++)
        pthread_join(u->workers[i], NULL);
    free(u->workers);
    u->workers = NULL;
    u->nworkers = 0;
}

int uring_open(const struct uring_opts *opts, struct uring **out)
{
    struct uring_opts o = opts ? *opts : (struct uring_opts){0};
    struct uring *u;
    int r;

    if (!out)
        return -EINVAL;
    *out = NULL;
    if (o.block_size == 0)
        o.block_size = MiB;
    if (o.queue_depth == 0)
        o.queue_depth = 32;
    if (o.max_files == 0)
        o.max_files = 64;
    if (o.submit_batch > o.queue_depth)
        o.submit_batch = o.queue_depth;
    if (o.rings > URING_MAX_RINGS)
        return -EINVAL;
    if (!is_aligned(o.block_size, ZINF_ALIGN) || o.block_size > 64 * MiB ||
        o.queue_depth > 4096 || o.max_files > 4096)
        return -EINVAL;

    u = calloc(1, sizeof(*u));
    if (!u)
        return -ENOMEM;
    u->o = o;
    pthread_mutex_init(&u->lock, NULL);
    pthread_cond_init(&u->idle_cv, NULL);
    pthread_cond_init(&u->work_cv, NULL);
    u->chunk_mem = calloc(o.queue_depth, sizeof(*u->chunk_mem));
    u->files = calloc(o.max_files, sizeof(*u->files));
    if (!u->chunk_mem || !u->files) {
        r = -ENOMEM;
        goto err;
    }
    for (unsigned i = 0; i < o.queue_depth; i++) {
        u->chunk_mem[i].next = u->free_chunks;
        u->free_chunks = &u->chunk_mem[i];
    }
    for (unsigned i = 0; i < o.max_files; i++)
        u->files[i].fd = -1;
    u->nfiles = o.max_files;

    const char *env = getenv("ZINF_IO_BACKEND");
    if (o.backend == URING_BACKEND_AUTO && env && !strcmp(env, "threads"))
        o.backend = u->o.backend = URING_BACKEND_THREADS;

    if (o.backend != URING_BACKEND_THREADS) {
        r = setup_io_uring(u);
        if (r == 0) {
            u->backend = URING_BACKEND_IO_URING;
        } else if (o.backend == URING_BACKEND_AUTO && (r == -ENOSYS || r == -EPERM)) {
            log_notice("io: io_uring is not available here (%s); using the pread/pwrite "
                       "thread pool", strerror(-r));
        } else {
            goto err;
        }
    }
    if (u->nrings == 0) {
        u->backend = URING_BACKEND_THREADS;
        r = setup_threads(u);
        if (r < 0)
            goto err;
    }
    u->st.backend = u->backend;
    u->st.submit_batch = MAX(o.submit_batch, 1u);
    u->st.rings = u->nrings;
    *out = u;
    return 0;
err:
    uring_close(u);
    return r;
}

void uring_drain(struct uring *u)
{
    pthread_mutex_lock(&u->lock);
    while (u->reqs_active)
        pthread_cond_wait(&u->idle_cv, &u->lock);
    pthread_mutex_unlock(&u->lock);
}

void uring_close(struct uring *u)
{
    if (!u)
        return;
    pthread_mutex_lock(&u->lock);
    u->closing = true;
    while (u->reqs_active)
        pthread_cond_wait(&u->idle_cv, &u->lock);
    for (unsigned i = 0; i < u->nrings; i++) {
        struct ring *rg = &u->rings[i];
        if (!rg->reaper_up)
            continue;
        struct io_uring_sqe *sqe = io_uring_get_sqe(&rg->ring);
        if (!sqe) {
            io_uring_submit(&rg->ring);
            sqe = io_uring_get_sqe(&rg->ring);
        }
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, STOP_TAG);
        io_uring_submit(&rg->ring);
    }
    pthread_mutex_unlock(&u->lock);
    for (unsigned i = 0; i < u->nrings; i++)
        if (u->rings[i].reaper_up)
            pthread_join(u->rings[i].reaper, NULL);
    if (u->workers)
        stop_threads(u);
    for (unsigned i = 0; i < u->nrings; i++) {
        if (!u->rings[i].up)
            continue;
        /* The files first, at once: a ring's teardown runs later, in the kernel's own time
         * (seconds on a loaded machine), and the files it still holds keep their locks: an
         * engine opened next on the same swap files would find them in use. */
        io_uring_unregister_files(&u->rings[i].ring);
        io_uring_queue_exit(&u->rings[i].ring); /* drops registered buffers too */
    }
    for (unsigned i = 0; u->files && i < u->nfiles; i++)
        if (u->files[i].fd >= 0)
            close(u->files[i].fd);
    free(u->files);
    free(u->chunk_mem);
    pthread_cond_destroy(&u->work_cv);
    pthread_cond_destroy(&u->idle_cv);
    pthread_mutex_destroy(&u->lock);
    free(u);
}

/* ---- files and buffers ------------------------------------------------------------ */

int uring_file_adopt(struct uring *u, int fd, bool direct)
{
    int slot = -1;

    if (!u || fd < 0)
        return -EINVAL;
    pthread_mutex_lock(&u->lock);
    for (unsigned i = 0; i < u->nfiles; i++) {
        if (u->files[i].fd < 0) {
            slot = (int)i;
            break;
        }
    }
    if (slot < 0) {
        pthread_mutex_unlock(&u->lock);
        return -EMFILE;
    }
    for (unsigned i = 0; u->st.fixed_files && i < u->nrings; i++) {
        int r = io_uring_register_files_update(&u->rings[i].ring, (unsigned)slot, &fd, 1);
        if (r < 0) {
            int minus1 = -1;
            while (i--)
                io_uring_register_files_update(&u->rings[i].ring, (unsigned)slot, &minus1, 1);
            pthread_mutex_unlock(&u->lock);
            return r;
        }
    }
    u->files[slot] = (struct ufile){.fd = fd, .direct = direct};
    if (!direct)
        u->st.buffered_files++;
    pthread_mutex_unlock(&u->lock);
    return slot;
}

int uring_file_open(struct uring *u, const char *path, int flags, mode_t mode)
{
    return uring_file_openat(u, AT_FDCWD, path, flags, mode);
}

int uring_file_openat(struct uring *u, int dirfd, const char *path, int flags, mode_t mode)
{
    bool direct = true;
    int fd, slot;

    if (!u || !path)
        return -EINVAL;
    if (u->fault_no_direct) {
        u->fault_no_direct = false;
        fd = -1;
        errno = EINVAL;
    } else {
        fd = openat(dirfd, path, flags | O_DIRECT | O_CLOEXEC, mode);
    }
    if (fd < 0 && errno == EINVAL) {
        fd = openat(dirfd, path, flags | O_CLOEXEC, mode);
        if (fd >= 0) {
            direct = false;
            log_notice("io: %s: the filesystem refused O_DIRECT; using buffered IO "
                       "(figures include the page cache)", path);
        }
    }
    if (fd < 0)
        return -errno;
    slot = uring_file_adopt(u, fd, direct);
    if (slot < 0)
        close(fd);
    return slot;
}

static bool file_ok(struct uring *u, int file)
{
    return file >= 0 && (unsigned)file < u->nfiles && u->files[file].fd >= 0;
}

int uring_file_fd(struct uring *u, int file)
{
    return u && file_ok(u, file) ? u->files[file].fd : -EINVAL;
}

bool uring_file_direct(struct uring *u, int file)
{
    return u && file_ok(u, file) && u->files[file].direct;
}

int uring_file_close(struct uring *u, int file)
{
    int fd, minus1 = -1;

    if (!u)
        return -EINVAL;
    pthread_mutex_lock(&u->lock);
    if (!file_ok(u, file)) {
        pthread_mutex_unlock(&u->lock);
        return -EINVAL;
    }
    fd = u->files[file].fd;
    for (unsigned i = 0; u->st.fixed_files && i < u->nrings; i++)
        io_uring_register_files_update(&u->rings[i].ring, (unsigned)file, &minus1, 1);
    if (!u->files[file].direct)
        u->st.buffered_files--;
    u->files[file].fd = -1;
    pthread_mutex_unlock(&u->lock);
    return close(fd) == 0 ? 0 : -errno;
}

int uring_buf_register(struct uring *u, void *base, size_t len)
{
    struct iovec iov[BUF_SLOTS];
    unsigned n, first = 0;
    int ri = -1, r;

    if (!u || !base || len == 0)
        return -EINVAL;
    if (!u->st.fixed_buffers)
        return -ENOTSUP;
    n = (unsigned)((len + SLICE_BYTES - 1) / SLICE_BYTES);
    pthread_mutex_lock(&u->lock);
    for (unsigned i = 0; i < MAX_REGIONS; i++) {
        if (!u->regions[i].used) {
            ri = (int)i;
            break;
        }
    }
    /* First fit over the slot table: n consecutive free slots. */
    for (first = 0; first + n <= BUF_SLOTS; first++) {
        unsigned k = 0;
        while (k < n && !u->slot_used[first + k])
            k++;
        if (k == n)
            break;
    }
    if (ri < 0 || first + n > BUF_SLOTS) {
        pthread_mutex_unlock(&u->lock);
        return -ENOSPC;
    }
    for (unsigned k = 0; k < n; k++) {
        size_t off = (size_t)k * SLICE_BYTES;
        iov[k] = (struct iovec){(char *)base + off, MIN(SLICE_BYTES, len - off)};
    }
    for (unsigned i = 0; i < u->nrings; i++) {
        r = io_uring_register_buffers_update_tag(&u->rings[i].ring, first, iov, NULL, n);
        if (r < 0) {
            struct iovec none[BUF_SLOTS] = {{0}};
            while (i--)
                io_uring_register_buffers_update_tag(&u->rings[i].ring, first, none, NULL, n);
            pthread_mutex_unlock(&u->lock);
            return r;
        }
    }
    for (unsigned k = 0; k < n; k++)
        u->slot_used[first + k] = true;
    u->regions[ri] = (struct region){base, len, first, n, true};
    pthread_mutex_unlock(&u->lock);
    return ri;
}

int uring_buf_unregister(struct uring *u, int region)
{
    struct iovec iov[BUF_SLOTS];
    struct region *r;

    if (!u || region < 0 || region >= MAX_REGIONS)
        return -EINVAL;
    pthread_mutex_lock(&u->lock);
    r = &u->regions[region];
    if (!r->used) {
        pthread_mutex_unlock(&u->lock);
        return -EINVAL;
    }
    /* An empty iovec clears a slot of a sparse table. The kernel keeps the old buffer
     * alive until requests already using it complete. */
    for (unsigned k = 0; k < r->nslots; k++) {
        iov[k] = (struct iovec){NULL, 0};
        u->slot_used[r->first_slot + k] = false;
    }
    for (unsigned i = 0; i < u->nrings; i++)
        io_uring_register_buffers_update_tag(&u->rings[i].ring, r->first_slot, iov, NULL,
                                             r->nslots);
    r->used = false;
    pthread_mutex_unlock(&u->lock);
    return 0;
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
    if (!req->map && !file_ok(u, req->file)) {
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

void uring_get_stats(struct uring *u, struct uring_stats *out)
{
    pthread_mutex_lock(&u->lock);
    *out = u->st;
    pthread_mutex_unlock(&u->lock);
}

void uring_fault_set(struct uring *u, enum uring_fault kind, unsigned nth)
{
    if (kind == URING_FAULT_NO_URING) {
        atomic_store(&fault_no_uring, true);
        return;
    }
    if (!u)
        return;
    pthread_mutex_lock(&u->lock);
    if (kind == URING_FAULT_NO_DIRECT) {
        u->fault_no_direct = true;
    } else {
        u->fault = kind;
        u->fault_countdown = kind == URING_FAULT_NONE ? 0 : MAX(nth, 1u);
    }
    pthread_mutex_unlock(&u->lock);
}
