/*
 * test_io.c - the IO engine (src/io/uring.c): read-after-write, splitting, concurrency,
 * queue depths, bad input, end of file, injected faults, close with requests in flight,
 * and the fallbacks (no io_uring, no O_DIRECT). The io_uring and thread-pool backends run
 * the same tests.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "helpers.h"
#include "io/uring.h"

#define BLOCK (64 * KiB)

static char *dir;

static void setup(void)
{
    dir = test_tmpdir("io");
    cr_assert_not_null(dir);
}

static void teardown(void)
{
    test_leak_check();
    test_rmtree(dir);
    dir = NULL;
}

TestSuite(io, .init = setup, .fini = teardown, .timeout = 120);

static struct uring *open_engine(enum uring_backend b, unsigned qd)
{
    struct uring *u = NULL;
    struct uring_opts o = {.block_size = BLOCK, .queue_depth = qd, .backend = b};
    int r = uring_open(&o, &u);
    cr_assert_eq(r, 0, "uring_open: %s", strerror(-r));
    return u;
}

static int open_file(struct uring *u, const char *name)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int f = uring_file_open(u, path, O_RDWR | O_CREAT, 0644);
    cr_assert_geq(f, 0, "uring_file_open: %s", strerror(-f));
    return f;
}

/* Write then read back random data of sizes that are not multiples of the block size. */
static void roundtrip(enum uring_backend b, unsigned qd)
{
    static const size_t sizes[] = {4 * KiB, BLOCK + 4 * KiB, 17 * BLOCK - 8 * KiB, MiB + 12 * KiB};
    struct uring *u = open_engine(b, qd);
    int f = open_file(u, "rt.dat");
    uint64_t off = 0;

    for (size_t i = 0; i < ARRAY_SIZE(sizes); i++) {
        size_t n = sizes[i];
        char *w = test_aligned_alloc(n), *r = test_aligned_alloc(n);
        test_fill_random(w, n, 100 + i);
        memset(r, 0xee, n);
        cr_assert_eq(uring_rw(u, URING_WRITE, f, w, n, off), 0);
        cr_assert_eq(uring_rw(u, URING_READ, f, r, n, off), 0);
        cr_assert(memcmp(w, r, n) == 0, "size %zu qd %u backend %s: data differs", n, qd,
                  uring_backend_name(b));
        off += n;
        free(w);
        free(r);
    }
    struct uring_stats st;
    uring_get_stats(u, &st);
    cr_assert_eq(st.backend, b);
    cr_assert_eq(st.bytes_written, off);
    cr_assert_eq(st.bytes_read, off);
    cr_assert_gt(st.chunks, st.requests, "large requests must be split into chunks");
    uring_close(u);
}

Test(io, roundtrip_io_uring) { roundtrip(URING_BACKEND_IO_URING, 32); }

/* With a submit batch the queue is refilled only once that many slots are free: a request
 * of 64 chunks at depth 32 and batch 8 goes out in at most 1 + 32 / 8 submits, and every
 * byte still arrives. A batch over the depth is the depth. */
static void batch_cb(struct uring_req *req, int res)
{
    completion_post(req->data, res);
}

static void batched(enum uring_backend b)
{
    struct uring *u = NULL;
    struct uring_opts o = {.block_size = BLOCK, .queue_depth = 32, .backend = b,
                           .submit_batch = 8};
    cr_assert_eq(uring_open(&o, &u), 0);
    int f = open_file(u, "batch.dat");
    size_t n = 64 * BLOCK;
    char *w = test_aligned_alloc(n), *r = test_aligned_alloc(n);
    test_fill_random(w, n, 7);
    struct uring_stats st;
    uring_get_stats(u, &st);
    cr_assert_eq(st.submit_batch, 8);
    uint64_t calls0 = st.submit_calls;
    cr_assert_eq(uring_rw(u, URING_WRITE, f, w, n, 0), 0);
    uring_get_stats(u, &st);
    if (b == URING_BACKEND_IO_URING)
        cr_assert_leq(st.submit_calls - calls0, 5, "%llu submits for 64 chunks",
                      (unsigned long long)(st.submit_calls - calls0));
    cr_assert_eq(uring_rw(u, URING_READ, f, r, n, 0), 0);
    cr_assert(memcmp(w, r, n) == 0);
    /* Many small requests at once: each waits for its batch, none is stranded. */
    struct completion done[48];
    struct uring_req req[48];
    for (int i = 0; i < 48; i++) {
        done[i] = (struct completion)COMPLETION_INIT;
        req[i] = (struct uring_req){.op = URING_READ, .file = f, .buf = r + (size_t)i * BLOCK,
                                    .len = BLOCK, .off = (uint64_t)((i * 7) % 64) * BLOCK,
                                    .cb = batch_cb, .data = &done[i]};
        cr_assert_eq(uring_submit(u, &req[i]), 0);
    }
    for (int i = 0; i < 48; i++) {
        cr_assert_eq(completion_wait(&done[i]), 0);
        cr_assert(memcmp(r + (size_t)i * BLOCK, w + (size_t)((i * 7) % 64) * BLOCK, BLOCK) == 0);
    }
    uring_close(u);
    o.queue_depth = 4;
    o.submit_batch = 100;
    cr_assert_eq(uring_open(&o, &u), 0);
    uring_get_stats(u, &st);
    cr_assert_eq(st.submit_batch, 4);
    uring_close(u);
    free(w);
    free(r);
}

Test(io, submit_batch_io_uring) { batched(URING_BACKEND_IO_URING); }
Test(io, submit_batch_threads) { batched(URING_BACKEND_THREADS); }
Test(io, roundtrip_threads) { roundtrip(URING_BACKEND_THREADS, 32); }
Test(io, roundtrip_qd1) { roundtrip(URING_BACKEND_IO_URING, 1); }
Test(io, roundtrip_qd128) { roundtrip(URING_BACKEND_IO_URING, 128); }
Test(io, roundtrip_threads_qd1) { roundtrip(URING_BACKEND_THREADS, 1); }

/* Hundreds of concurrent asynchronous requests, each to its own region. */
struct counter {
    atomic_uint done;
    atomic_int first_err;
};

static void count_cb(struct uring_req *req, int res)
{
    struct counter *c = req->data;
    if (res < 0) {
        int zero = 0;
        atomic_compare_exchange_strong(&c->first_err, &zero, res);
    }
    atomic_fetch_add(&c->done, 1);
}

static void wait_count(struct counter *c, unsigned n)
{
    while (atomic_load(&c->done) < n)
        usleep(100);
}

static void concurrent(enum uring_backend b)
{
    enum { N = 400 };
    struct uring *u = open_engine(b, 64);
    int f = open_file(u, "conc.dat");
    struct uring_req *reqs = calloc(N, sizeof(*reqs));
    size_t *len = calloc(N, sizeof(*len));
    uint64_t *off = calloc(N, sizeof(*off));
    char **bufs = calloc(N, sizeof(*bufs));
    uint64_t seed = 7, pos = 0;
    struct counter c = {0};

    for (int i = 0; i < N; i++) {
        len[i] = (1 + test_rand(&seed) % 40) * 4 * KiB;
        off[i] = pos;
        pos += len[i];
        bufs[i] = test_aligned_alloc(len[i]);
        test_fill_random(bufs[i], len[i], 1000 + (uint64_t)i);
        reqs[i] = (struct uring_req){.op = URING_WRITE, .file = f, .buf = bufs[i],
                                     .len = len[i], .off = off[i], .cb = count_cb, .data = &c};
        cr_assert_eq(uring_submit(u, &reqs[i]), 0);
    }
    wait_count(&c, N);
    cr_assert_eq(c.first_err, 0);

    /* Read back in reverse order, all at once, into fresh buffers. */
    char **rb = calloc(N, sizeof(*rb));
    c = (struct counter){0};
    for (int i = N - 1; i >= 0; i--) {
        rb[i] = test_aligned_alloc(len[i]);
        reqs[i] = (struct uring_req){.op = URING_READ, .file = f, .buf = rb[i], .len = len[i],
                                     .off = off[i], .cb = count_cb, .data = &c};
        cr_assert_eq(uring_submit(u, &reqs[i]), 0);
    }
    wait_count(&c, N);
    cr_assert_eq(c.first_err, 0);
    for (int i = 0; i < N; i++) {
        cr_assert(memcmp(bufs[i], rb[i], len[i]) == 0, "request %d differs", i);
        free(bufs[i]);
        free(rb[i]);
    }
    struct uring_stats st;
    uring_get_stats(u, &st);
    if (b == URING_BACKEND_IO_URING)
        cr_assert_lt(st.submit_calls, st.chunks, "submission must be batched");
    uring_close(u);
    free(rb);
    free(bufs);
    free(off);
    free(len);
    free(reqs);
}

Test(io, concurrent_io_uring) { concurrent(URING_BACKEND_IO_URING); }
Test(io, concurrent_threads) { concurrent(URING_BACKEND_THREADS); }

static void never_cb(struct uring_req *req, int res)
{
    cr_assert_fail("a refused request's callback ran");
}

Test(io, unaligned_is_refused)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO, 8);
    int f = open_file(u, "bad.dat");
    char *buf = test_aligned_alloc(64 * KiB);
    struct uring_req r = {.op = URING_WRITE, .file = f, .buf = buf, .len = 8 * KiB, .cb = never_cb};

    r.buf = buf + 512;
    cr_assert_eq(uring_submit(u, &r), -EINVAL, "unaligned buffer");
    r.buf = buf;
    r.len = 5000;
    cr_assert_eq(uring_submit(u, &r), -EINVAL, "unaligned length");
    r.len = 0;
    cr_assert_eq(uring_submit(u, &r), -EINVAL, "empty request");
    r.len = 8 * KiB;
    r.off = 100;
    cr_assert_eq(uring_submit(u, &r), -EINVAL, "unaligned offset");
    r.off = 0;
    r.file = 63;
    cr_assert_eq(uring_submit(u, &r), -EINVAL, "file slot never opened");
    r.file = -1;
    cr_assert_eq(uring_submit(u, &r), -EINVAL, "negative file slot");
    r.file = f;
    r.cb = NULL;
    cr_assert_eq(uring_submit(u, &r), -EINVAL, "no callback");
    cr_assert_eq(uring_rw(u, URING_READ, f, buf, 4096, 3), -EINVAL);
    cr_assert_eq(uring_file_close(u, 40), -EINVAL);

    /* The engine still works after all that. */
    test_fill_random(buf, 64 * KiB, 3);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, buf, 64 * KiB, 0), 0);
    char *back = test_aligned_alloc(64 * KiB);
    cr_assert_eq(uring_rw(u, URING_READ, f, back, 64 * KiB, 0), 0);
    cr_assert(memcmp(buf, back, 64 * KiB) == 0);
    free(back);
    free(buf);
    uring_close(u);
}

Test(io, bad_options)
{
    struct uring *u = (struct uring *)1;
    struct uring_opts o = {.block_size = 1000};
    cr_assert_eq(uring_open(&o, &u), -EINVAL);
    cr_assert_null(u);
    o = (struct uring_opts){.queue_depth = 100000};
    cr_assert_eq(uring_open(&o, &u), -EINVAL);
    cr_assert_eq(uring_open(NULL, NULL), -EINVAL);
    uring_close(NULL);
}

static void past_eof(enum uring_backend b)
{
    struct uring *u = open_engine(b, 8);
    int f = open_file(u, "eof.dat");
    char *buf = test_aligned_alloc(256 * KiB);

    test_fill_random(buf, 128 * KiB, 9);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, buf, 128 * KiB, 0), 0);
    /* Wholly past the end. */
    cr_assert_eq(uring_rw(u, URING_READ, f, buf, 64 * KiB, 1 * MiB), -ENODATA);
    /* Straddling the end: never a silent partial transfer. */
    cr_assert_eq(uring_rw(u, URING_READ, f, buf, 256 * KiB, 0), -ENODATA);
    /* The engine still works and the data is still there. */
    char *ref = test_aligned_alloc(128 * KiB);
    test_fill_random(ref, 128 * KiB, 9);
    cr_assert_eq(uring_rw(u, URING_READ, f, buf, 128 * KiB, 0), 0);
    cr_assert(memcmp(buf, ref, 128 * KiB) == 0);
    struct uring_stats st;
    uring_get_stats(u, &st);
    cr_assert_eq(st.errors, 2);
    free(ref);
    free(buf);
    uring_close(u);
}

Test(io, read_past_eof_io_uring) { past_eof(URING_BACKEND_IO_URING); }
Test(io, read_past_eof_threads) { past_eof(URING_BACKEND_THREADS); }

/* An injected -EIO fails that request only; the engine and the stored bytes are fine. */
static void injected_eio(enum uring_backend b)
{
    struct uring *u = open_engine(b, 16);
    int f = open_file(u, "eio.dat");
    size_t n = 8 * BLOCK;
    char *w = test_aligned_alloc(n), *r = test_aligned_alloc(n), *w2 = test_aligned_alloc(n);

    test_fill_random(w, n, 11);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, w, n, 0), 0);

    uring_fault_set(u, URING_FAULT_EIO, 3);
    cr_assert_eq(uring_rw(u, URING_READ, f, r, n, 0), -EIO);

    /* A failed write reports -EIO; a retry of the same write succeeds. */
    test_fill_random(w2, n, 12);
    uring_fault_set(u, URING_FAULT_EIO, 1);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, w2, n, n), -EIO);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, w2, n, n), 0);

    memset(r, 0, n);
    cr_assert_eq(uring_rw(u, URING_READ, f, r, n, 0), 0);
    cr_assert(memcmp(w, r, n) == 0, "data written before the fault is intact");
    cr_assert_eq(uring_rw(u, URING_READ, f, r, n, n), 0);
    cr_assert(memcmp(w2, r, n) == 0);
    struct uring_stats st;
    uring_get_stats(u, &st);
    cr_assert_eq(st.errors, 2);
    free(w);
    free(w2);
    free(r);
    uring_close(u);
}

Test(io, injected_eio_io_uring) { injected_eio(URING_BACKEND_IO_URING); }
Test(io, injected_eio_threads) { injected_eio(URING_BACKEND_THREADS); }

/* Short completions and -EAGAIN are resubmitted: the result is complete and correct. */
static void injected_short(enum uring_backend b, enum uring_fault kind)
{
    struct uring *u = open_engine(b, 4);
    int f = open_file(u, "short.dat");
    size_t n = 6 * BLOCK;
    char *w = test_aligned_alloc(n), *r = test_aligned_alloc(n);

    test_fill_random(w, n, 21);
    uring_fault_set(u, kind, 2);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, w, n, 0), 0);
    uring_fault_set(u, kind, 4);
    cr_assert_eq(uring_rw(u, URING_READ, f, r, n, 0), 0);
    cr_assert(memcmp(w, r, n) == 0);
    struct uring_stats st;
    uring_get_stats(u, &st);
    if (kind == URING_FAULT_SHORT)
        cr_assert_eq(st.short_retries, 2);
    else
        cr_assert_eq(st.eagain_retries, 2);
    cr_assert_eq(st.errors, 0);
    cr_assert_eq(st.bytes_written, n);
    cr_assert_eq(st.bytes_read, n);
    free(w);
    free(r);
    uring_close(u);
}

Test(io, injected_short_io_uring) { injected_short(URING_BACKEND_IO_URING, URING_FAULT_SHORT); }
Test(io, injected_short_threads) { injected_short(URING_BACKEND_THREADS, URING_FAULT_SHORT); }
Test(io, injected_eagain) { injected_short(URING_BACKEND_IO_URING, URING_FAULT_EAGAIN); }

/* Closing waits for every request in flight and runs every callback. */
static void close_in_flight(enum uring_backend b)
{
    enum { N = 200 };
    struct uring *u = open_engine(b, 8);
    int f = open_file(u, "close.dat");
    struct uring_req reqs[N];
    char *buf = test_aligned_alloc(N * 16 * KiB);
    struct counter c = {0};

    test_fill_random(buf, N * 16 * KiB, 5);
    for (int i = 0; i < N; i++) {
        reqs[i] = (struct uring_req){.op = URING_WRITE, .file = f, .buf = buf + i * 16 * KiB,
                                     .len = 16 * KiB, .off = (uint64_t)i * 16 * KiB,
                                     .cb = count_cb, .data = &c};
        cr_assert_eq(uring_submit(u, &reqs[i]), 0);
    }
    uring_close(u);
    cr_assert_eq(atomic_load(&c.done), N, "every callback ran before close returned");
    cr_assert_eq(c.first_err, 0);

    /* And the bytes reached the file. */
    char path[4096];
    snprintf(path, sizeof(path), "%s/close.dat", dir);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq((size_t)st.st_size, (size_t)N * 16 * KiB);
    free(buf);
}

Test(io, close_with_requests_in_flight) { close_in_flight(URING_BACKEND_IO_URING); }
Test(io, close_with_requests_in_flight_threads) { close_in_flight(URING_BACKEND_THREADS); }

Test(io, fixed_buffers)
{
    struct uring *u = open_engine(URING_BACKEND_IO_URING, 16);
    int f = open_file(u, "fixed.dat");
    size_t n = 4 * MiB;
    char *w = test_aligned_alloc(n), *r = test_aligned_alloc(n);
    int rw = uring_buf_register(u, w, n);
    int rr = uring_buf_register(u, r, n);
    struct uring_stats st;

    uring_get_stats(u, &st);
    if (!st.fixed_buffers) {
        cr_assert_eq(rw, -ENOTSUP);
    } else {
        cr_assert_geq(rw, 0);
        cr_assert_geq(rr, 0);
        cr_assert_neq(rw, rr);
    }
    test_fill_random(w, n, 31);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, w, n, 0), 0);
    cr_assert_eq(uring_rw(u, URING_READ, f, r, n, 0), 0);
    cr_assert(memcmp(w, r, n) == 0);
    if (st.fixed_buffers) {
        cr_assert_eq(uring_buf_unregister(u, rw), 0);
        cr_assert_eq(uring_buf_unregister(u, rw), -EINVAL, "double unregister");
        /* Still works through the unregistered path. */
        cr_assert_eq(uring_rw(u, URING_WRITE, f, w, n, n), 0);
        cr_assert_eq(uring_buf_unregister(u, rr), 0);
    }
    cr_assert_eq(uring_buf_register(u, NULL, 4096), -EINVAL);
    free(w);
    free(r);
    uring_close(u);
}

Test(io, no_io_uring_falls_back_to_threads)
{
    struct uring *u = NULL;
    struct uring_opts o = {.block_size = BLOCK};
    struct uring_stats st;

    test_log_capture_start();
    uring_fault_set(NULL, URING_FAULT_NO_URING, 1);
    cr_assert_eq(uring_open(&o, &u), 0);
    uring_get_stats(u, &st);
    cr_assert_eq(st.backend, URING_BACKEND_THREADS);
    cr_assert(strstr(test_log_text(), "io_uring is not available") != NULL, "says so: %s",
              test_log_text());
    test_log_capture_stop();
    int f = open_file(u, "fb.dat");
    char *buf = test_aligned_alloc(BLOCK * 3);
    test_fill_random(buf, BLOCK * 3, 1);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, buf, BLOCK * 3, 0), 0);
    cr_assert_eq(uring_rw(u, URING_READ, f, buf, BLOCK * 3, 0), 0);
    free(buf);
    uring_close(u);

    /* Asking for io_uring explicitly when it cannot be set up is an error, not a
     * silent fallback. */
    uring_fault_set(NULL, URING_FAULT_NO_URING, 1);
    o.backend = URING_BACKEND_IO_URING;
    cr_assert_eq(uring_open(&o, &u), -ENOSYS);
}

Test(io, no_odirect_falls_back_to_buffered)
{
    struct uring *u = open_engine(URING_BACKEND_IO_URING, 8);
    struct uring_stats st;

    test_log_capture_start();
    uring_fault_set(u, URING_FAULT_NO_DIRECT, 1);
    int f = open_file(u, "buffered.dat");
    cr_assert(!uring_file_direct(u, f));
    cr_assert(strstr(test_log_text(), "refused O_DIRECT") != NULL);
    test_log_capture_stop();
    uring_get_stats(u, &st);
    cr_assert_eq(st.buffered_files, 1);
    int g = open_file(u, "direct.dat");
    cr_assert(uring_file_direct(u, g), "only the next open is affected");

    char *w = test_aligned_alloc(BLOCK * 2), *r = test_aligned_alloc(BLOCK * 2);
    test_fill_random(w, BLOCK * 2, 2);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, w, BLOCK * 2, 0), 0);
    cr_assert_eq(uring_rw(u, URING_READ, f, r, BLOCK * 2, 0), 0);
    cr_assert(memcmp(w, r, BLOCK * 2) == 0);
    cr_assert_eq(uring_file_close(u, f), 0);
    uring_get_stats(u, &st);
    cr_assert_eq(st.buffered_files, 0);
    free(w);
    free(r);
    uring_close(u);
}

Test(io, tmpfs_file)
{
    char *shm = test_shmdir("io");
    if (!shm)
        cr_skip_test("no /dev/shm");
    struct uring *u = open_engine(URING_BACKEND_AUTO, 8);
    char path[4096];
    snprintf(path, sizeof(path), "%s/t.dat", shm);
    int f = uring_file_open(u, path, O_RDWR | O_CREAT, 0644);
    cr_assert_geq(f, 0);
    char *w = test_aligned_alloc(BLOCK * 2), *r = test_aligned_alloc(BLOCK * 2);
    test_fill_random(w, BLOCK * 2, 4);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, w, BLOCK * 2, 0), 0);
    cr_assert_eq(uring_rw(u, URING_READ, f, r, BLOCK * 2, 0), 0);
    cr_assert(memcmp(w, r, BLOCK * 2) == 0);
    free(w);
    free(r);
    uring_close(u);
    test_rmtree(shm);
}

Test(io, sqpoll_option)
{
    struct uring *u = NULL;
    struct uring_opts o = {.block_size = BLOCK, .queue_depth = 8, .sqpoll = true};
    cr_assert_eq(uring_open(&o, &u), 0);
    int f = open_file(u, "sqpoll.dat");
    char *w = test_aligned_alloc(BLOCK * 4), *r = test_aligned_alloc(BLOCK * 4);
    test_fill_random(w, BLOCK * 4, 6);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, w, BLOCK * 4, 0), 0);
    cr_assert_eq(uring_rw(u, URING_READ, f, r, BLOCK * 4, 0), 0);
    cr_assert(memcmp(w, r, BLOCK * 4) == 0);
    free(w);
    free(r);
    uring_close(u);
}

/* A map that stripes a request over two files in BLOCK units, as the swap space does. */
struct stripe {
    int files[2];
    int fail_at; /* stripe index that fails to map; -1 none */
};

static int stripe_map(void *data, uint64_t off, int *file, uint64_t *phys, uint64_t *contig)
{
    struct stripe *s = data;
    uint64_t k = off / BLOCK;
    if ((int)k == s->fail_at)
        return -ERANGE;
    *file = s->files[k % 2];
    *phys = (k / 2) * BLOCK + off % BLOCK;
    *contig = BLOCK - off % BLOCK;
    return 0;
}

static void map_cb(struct uring_req *req, int res)
{
    count_cb(req, res);
}

Test(io, mapped_request_is_split_per_stripe)
{
    struct uring *u = open_engine(URING_BACKEND_IO_URING, 8);
    struct stripe s = {{open_file(u, "s0.dat"), open_file(u, "s1.dat")}, -1};
    size_t n = 10 * BLOCK;
    char *w = test_aligned_alloc(n), *r = test_aligned_alloc(n);
    struct counter c = {0};
    struct uring_req req = {.op = URING_WRITE, .buf = w, .len = n, .off = 0, .map = stripe_map,
                            .map_data = &s, .cb = map_cb, .data = &c};

    test_fill_random(w, n, 8);
    cr_assert_eq(uring_submit(u, &req), 0);
    wait_count(&c, 1);
    cr_assert_eq(c.first_err, 0);
    /* Each file holds every other block. */
    cr_assert_eq(uring_rw(u, URING_READ, s.files[1], r, BLOCK, BLOCK), 0);
    cr_assert(memcmp(r, w + 3 * BLOCK, BLOCK) == 0);

    c = (struct counter){0};
    req = (struct uring_req){.op = URING_READ, .buf = r, .len = n, .off = 0, .map = stripe_map,
                             .map_data = &s, .cb = map_cb, .data = &c};
    cr_assert_eq(uring_submit(u, &req), 0);
    wait_count(&c, 1);
    cr_assert_eq(c.first_err, 0);
    cr_assert(memcmp(w, r, n) == 0);

    /* A map that fails part-way fails the request with its error, through the callback. */
    s.fail_at = 5;
    c = (struct counter){0};
    cr_assert_eq(uring_submit(u, &req), 0);
    wait_count(&c, 1);
    cr_assert_eq(c.first_err, -ERANGE);
    free(w);
    free(r);
    uring_close(u);
}

/* A callback may submit the next request (the engine calls it outside its lock). */
struct chain {
    struct uring *u;
    struct uring_req req;
    char *buf;
    int left;
    atomic_int done;
};

static void chain_cb(struct uring_req *req, int res)
{
    struct chain *c = req->data;
    cr_assert_eq(res, 0);
    if (--c->left > 0) {
        req->off += 4 * KiB;
        cr_assert_eq(uring_submit(c->u, req), 0);
    } else {
        atomic_store(&c->done, 1);
    }
}

Test(io, callback_may_submit)
{
    struct chain c = {.left = 50};
    c.u = open_engine(URING_BACKEND_IO_URING, 4);
    c.buf = test_aligned_alloc(4 * KiB);
    memset(c.buf, 1, 4 * KiB);
    c.req = (struct uring_req){.op = URING_WRITE, .file = open_file(c.u, "chain.dat"),
                               .buf = c.buf, .len = 4 * KiB, .cb = chain_cb, .data = &c};
    cr_assert_eq(uring_submit(c.u, &c.req), 0);
    while (!atomic_load(&c.done))
        usleep(100);
    uring_close(c.u);
    free(c.buf);
}

/* Several rings: chunks are dealt to them in turn, each with its own reaper; registered
 * buffers and files are on every ring; data from many concurrent requests on two files
 * arrives intact, closing a file and the engine with requests in flight loses nothing. */
Test(io, several_rings)
{
    enum { N = 96 };
    struct uring *u = NULL;
    struct uring_opts o = {.block_size = BLOCK, .queue_depth = 16, .rings = 3,
                           .backend = URING_BACKEND_IO_URING};
    cr_assert_eq(uring_open(&o, &u), 0);
    struct uring_stats st;
    uring_get_stats(u, &st);
    cr_assert_eq(st.rings, 3);
    int f[2] = {open_file(u, "r0.dat"), open_file(u, "r1.dat")};
    size_t n = (size_t)N * 2 * BLOCK;
    char *w = test_aligned_alloc(n), *r = test_aligned_alloc(n);
    int region = uring_buf_register(u, w, n);
    cr_assert(region >= 0 || (region == -ENOTSUP && !st.fixed_buffers));
    test_fill_random(w, n, 77);
    struct uring_req reqs[N];
    struct counter c = {0};
    for (int i = 0; i < N; i++) {
        reqs[i] = (struct uring_req){.op = URING_WRITE, .file = f[i % 2],
                                     .buf = w + (size_t)i * 2 * BLOCK, .len = 2 * BLOCK,
                                     .off = (uint64_t)(i / 2) * 2 * BLOCK, .cb = count_cb,
                                     .data = &c};
        cr_assert_eq(uring_submit(u, &reqs[i]), 0);
    }
    wait_count(&c, N);
    cr_assert_eq(c.first_err, 0);
    for (int i = 0; i < N; i++)
        cr_assert_eq(uring_rw(u, URING_READ, f[i % 2], r + (size_t)i * 2 * BLOCK, 2 * BLOCK,
                              (uint64_t)(i / 2) * 2 * BLOCK), 0);
    cr_assert(memcmp(w, r, n) == 0, "data differs with 3 rings");
    uring_get_stats(u, &st);
    cr_assert_eq(st.chunks, (uint64_t)N * 2 * 2);
    cr_assert_eq(uring_file_close(u, f[1]), 0);
    cr_assert_eq(uring_rw(u, URING_READ, f[1], r, BLOCK, 0), -EINVAL);
    /* The engine closes with writes in flight on every ring; each callback still runs. */
    struct counter c2 = {0};
    for (int i = 0; i < N; i++) {
        reqs[i] = (struct uring_req){.op = URING_WRITE, .file = f[0],
                                     .buf = w + (size_t)i * BLOCK, .len = BLOCK,
                                     .off = (uint64_t)i * BLOCK, .cb = count_cb, .data = &c2};
        cr_assert_eq(uring_submit(u, &reqs[i]), 0);
    }
    if (region >= 0)
        cr_assert_eq(uring_buf_unregister(u, region), 0);
    uring_close(u);
    cr_assert_eq(atomic_load(&c2.done), N);
    cr_assert_eq(c2.first_err, 0);
    /* Too many rings is refused; the threads backend has none. */
    o.rings = URING_MAX_RINGS + 1;
    cr_assert_eq(uring_open(&o, &u), -EINVAL);
    o.rings = 2;
    o.backend = URING_BACKEND_THREADS;
    cr_assert_eq(uring_open(&o, &u), 0);
    uring_get_stats(u, &st);
    cr_assert_eq(st.rings, 0);
    uring_close(u);
    free(w);
    free(r);
}
