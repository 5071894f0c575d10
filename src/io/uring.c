/*
 * uring.c - the IO engine behind uring.h: setting it up and tearing it down, its files and
 * registered buffers, its statistics and fault hook.
 *
 * uring_open() sets up uring_opts.rings io_urings, each with its own reaper thread, with
 * sparse tables of registered files and buffers on every ring alike; where io_uring
 * cannot be set up (-ENOSYS/-EPERM) it starts a pool of pread/pwrite workers instead.
 * Files are opened O_DIRECT where the filesystem allows it, buffered otherwise, and
 * registered on every ring; buffers are registered in slices of at most 1 GiB.
 *
 * Not here: the requests themselves, from uring_submit() through chunking, the backends'
 * completion threads and retries to the callback (uring_req.c); caching, ordering between
 * requests, or knowledge of what the bytes mean.
 */
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "io/uring.h"
#include "io/uring_int.h"

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
        r = pthread_create(&rg->reaper, NULL, uring_reaper_main, rg);
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
        int r = pthread_create(&u->workers[u->nworkers], NULL, uring_worker_main, u);
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

bool uring_file_ok(struct uring *u, int file)
{
    return file >= 0 && (unsigned)file < u->nfiles && u->files[file].fd >= 0;
}

int uring_file_fd(struct uring *u, int file)
{
    return u && uring_file_ok(u, file) ? u->files[file].fd : -EINVAL;
}

bool uring_file_direct(struct uring *u, int file)
{
    return u && uring_file_ok(u, file) && u->files[file].direct;
}

int uring_file_close(struct uring *u, int file)
{
    int fd, minus1 = -1;

    if (!u)
        return -EINVAL;
    pthread_mutex_lock(&u->lock);
    if (!uring_file_ok(u, file)) {
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

/* ---- statistics and faults ------------------------------------------------------- */

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
