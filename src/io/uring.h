/*
 * uring.h - the IO engine: one io_uring per engine (or uring_opts.rings of them), a
 * completion thread per ring, batched submission and reaping, requests split into block_size chunks with at most queue_depth
 * chunks in flight, registered (fixed) buffers and files, O_DIRECT.
 *
 * Where io_uring cannot be set up (-ENOSYS/-EPERM: an old kernel, a seccomp sandbox) the
 * same interface is served by a pool of threads doing pread/pwrite. Where a filesystem
 * refuses O_DIRECT the file is opened buffered, with a one-line notice and a flag in stats.
 *
 * It is not a cache and knows nothing of tensors: callers bring aligned memory and
 * offsets, and get one completion per request, from the engine's own thread.
 *
 * Requests are long-lived only while in flight: the caller owns the struct uring_req and
 * must keep it alive until its callback has run. When uring_submit() fails, the callback
 * never fires.
 */
#ifndef ZINF_IO_URING_H
#define ZINF_IO_URING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

struct uring;
struct uring_req;

enum uring_op { URING_READ, URING_WRITE };

enum uring_backend { URING_BACKEND_AUTO, URING_BACKEND_IO_URING, URING_BACKEND_THREADS };

#define URING_MAX_RINGS 8

struct uring_opts {
    size_t block_size;        /* largest chunk per IO; 0: 1 MiB; multiple of 4 KiB */
    unsigned queue_depth;     /* chunks in flight; 0: 32 */
    enum uring_backend backend; /* AUTO: io_uring, threads if it cannot be set up */
    bool sqpoll;              /* ask for a kernel submission-polling thread */
    unsigned rings;           /* io_uring rings, each with its own completion thread;
                               * chunks are dealt to them in turn; 0 or 1: one; at most
                               * URING_MAX_RINGS */
    unsigned submit_batch;    /* refill the queue only once this many slots are free (or
                               * it is empty); 0 or 1: one chunk per completion. At most
                               * queue_depth */
    unsigned max_files;       /* registered file slots; 0: 64 */
    bool bind_numa;           /* run the engine's threads on the CPUs of numa_node */
    int numa_node;
};

/* Map a byte offset of a request onto (file slot, physical offset) and say how many bytes
 * from there are contiguous in that file. Lets a striped swap space submit one request
 * that the engine splits per stripe. Returns 0 or -errno. */
typedef int (*uring_map_fn)(void *map_data, uint64_t off, int *file, uint64_t *phys,
                            uint64_t *contig_bytes);

typedef void (*uring_cb)(struct uring_req *req, int res);

struct uring_req {
    /* Set by the caller. */
    enum uring_op op;
    int file;                 /* slot from uring_file_open(); ignored when map is set */
    void *buf;                /* 4 KiB aligned */
    size_t len;               /* multiple of 4 KiB, > 0 */
    uint64_t off;             /* multiple of 4 KiB: a file offset, or the map's offset */
    uring_map_fn map;         /* NULL: plain (file, off) */
    void *map_data;
    uring_cb cb;              /* runs on the engine's thread with 0 or -errno */
    void *data;               /* the caller's */

    /* Private to the engine. */
    struct uring_req *next_;
    uint64_t split_;          /* bytes handed out as chunks so far */
    unsigned chunks_;         /* chunks in flight */
    int res_;                 /* first error seen */
};

struct uring_stats {
    uint64_t bytes_read, bytes_written;
    uint64_t requests, chunks;
    uint64_t submit_calls;    /* io_uring_submit() calls: chunks / submit_calls = batching */
    uint64_t short_retries;   /* short transfers resubmitted for the remainder */
    uint64_t eagain_retries;
    uint64_t errors;          /* requests that completed with an error */
    unsigned buffered_files;  /* files opened without O_DIRECT (filesystem refused it) */
    enum uring_backend backend; /* the one in use */
    bool sqpoll;              /* SQPOLL in use */
    bool fixed_buffers;       /* registered buffers available */
    bool fixed_files;         /* registered files available */
    unsigned submit_batch;    /* in use: uring_opts.submit_batch clamped to the depth */
    unsigned rings;           /* io_uring rings in use; 0 with the threads backend */
};

int uring_open(const struct uring_opts *opts, struct uring **out);
/* Waits for every request in flight (their callbacks run), then frees. NULL is a no-op. */
void uring_close(struct uring *u);

/* Open a file for IO through the engine. Tries O_DIRECT first; if the filesystem refuses
 * it (EINVAL), opens buffered and says so once. Returns a file slot (>= 0) or -errno.
 * flags are open(2) flags (O_RDWR, O_CREAT, ...); O_DIRECT is added by the engine. */
int uring_file_open(struct uring *u, const char *path, int flags, mode_t mode);
/* The same, path relative to the folder dirfd (openat; AT_FDCWD: as uring_file_open). */
int uring_file_openat(struct uring *u, int dirfd, const char *path, int flags, mode_t mode);
/* Adopt an fd the caller opened (the engine closes it at uring_file_close). */
int uring_file_adopt(struct uring *u, int fd, bool direct);
int uring_file_fd(struct uring *u, int file);
bool uring_file_direct(struct uring *u, int file);
int uring_file_close(struct uring *u, int file);

/* Register [base, base+len) as fixed buffers (in <= 1 GiB slices) so requests inside it
 * use READ_FIXED/WRITE_FIXED. Returns a region id (>= 0) or -errno; -ENOTSUP when the
 * backend has no fixed buffers (requests still work). */
int uring_buf_register(struct uring *u, void *base, size_t len);
int uring_buf_unregister(struct uring *u, int region);

/* Queue a request. Returns 0 (the callback will run exactly once) or -errno (it never
 * runs): -EINVAL for unaligned buffer/offset/length or a bad file slot, -ESHUTDOWN while
 * closing. */
int uring_submit(struct uring *u, struct uring_req *req);
/* Submit one request and wait for it. */
int uring_rw(struct uring *u, enum uring_op op, int file, void *buf, size_t len, uint64_t off);
/* Wait until no request is in flight. */
void uring_drain(struct uring *u);

void uring_get_stats(struct uring *u, struct uring_stats *out);
const char *uring_backend_name(enum uring_backend b);
size_t uring_block_size(struct uring *u);
unsigned uring_queue_depth(struct uring *u);

/* Test-only fault hook, compiled in and off by default: the nth chunk completion from now
 * (1 = the next one) is made to fail with -EIO, come back short, or report -EAGAIN.
 * URING_FAULT_NO_DIRECT makes the next uring_file_open() behave as if the filesystem
 * refused O_DIRECT. URING_FAULT_NO_URING makes the next uring_open() in this process
 * behave as if io_uring_queue_init() returned -ENOSYS (pass u = NULL).
 * URING_FAULT_EIO_STICKY fails every completion from now on with -EIO, until the hook is
 * set to URING_FAULT_NONE. URING_FAULT_SUBMIT makes the nth uring_submit() from now return
 * -EIO at once (the request is never queued, its callback never runs).
 * URING_FAULT_EIO_READ is URING_FAULT_EIO counting read chunks only: writes, which an engine
 * retries in the background, pass, so the fault lands on a read someone waits for.
 * URING_FAULT_EIO_WRITE counts write chunks only. URING_FAULT_EIO_READ_STICKY fails every
 * read completion from now on (writes pass), until the hook is set to URING_FAULT_NONE. */
enum uring_fault { URING_FAULT_NONE, URING_FAULT_EIO, URING_FAULT_SHORT, URING_FAULT_EAGAIN,
                   URING_FAULT_NO_DIRECT, URING_FAULT_NO_URING, URING_FAULT_EIO_STICKY,
                   URING_FAULT_SUBMIT, URING_FAULT_EIO_READ, URING_FAULT_EIO_WRITE,
                   URING_FAULT_EIO_READ_STICKY };
void uring_fault_set(struct uring *u, enum uring_fault kind, unsigned nth);

#endif
