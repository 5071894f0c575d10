/*
 * uring_int.h - what the IO engine's two files share (uring.c: setup, teardown, files and
 * registered buffers; uring_req.c: requests from uring_submit() to their callback): the
 * engine's objects and the few functions one calls in the other. Not for anything outside
 * src/io/: uring.h is the engine's interface.
 */
#ifndef ZINF_IO_URING_INT_H
#define ZINF_IO_URING_INT_H

#include <liburing.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "common.h"
#include "io/uring.h"

#define STOP_TAG UINT64_MAX     /* user_data of the NOP that stops the reaper */
#define MAX_REGIONS 16
#define BUF_SLOTS 64            /* registered buffer table size */
#define SLICE_BYTES GiB         /* one registered buffer covers at most this */

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

/* uring_req.c: the threads that complete chunks, one per ring (arg: its struct ring) or a
 * pool of pread/pwrite workers (arg: the engine). */
void *uring_reaper_main(void *arg);
void *uring_worker_main(void *arg);
/* uring.c: whether file names an open slot of u. */
bool uring_file_ok(struct uring *u, int file);

#endif
