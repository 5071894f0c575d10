/*
 * test_comm.c - the communicator (src/comm/): the self backend, the shm backend's
 * collectives across 2-4 processes checked bitwise against a rank-order sum, the order of
 * asynchronous requests, and the faults: a wrong world, a rank started twice, a rendezvous
 * nobody comes to, a rank that dies. Each rank is a child process; it reports through its
 * exit status (0: every check passed) and says what failed on stderr.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common.h"
#include "helpers.h"
#include "tiers/cuda_probe.h"

TestSuite(comm, .timeout = 120);

/* A name no other test (or run) uses. */
static void unique_name(char *buf, size_t len)
{
    static atomic_uint n;
    snprintf(buf, len, "t%d-%u", (int)getpid(), atomic_fetch_add(&n, 1));
}

static bool seg_exists(const char *name)
{
    char p[128];
    struct stat st;
    snprintf(p, sizeof(p), "/dev/shm/zinf-comm-%s", name);
    return stat(p, &st) == 0;
}

#define FAIL(code, ...)                                                                            \
    do {                                                                                           \
        fprintf(stderr, "rank %d: ", rank);                                                        \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        return (code);                                                                             \
    } while (0)

typedef int (*rank_fn)(int rank, int world, const char *name, void *arg);

/* Runs fn as world child processes (rank r as the r-th), waits for them; status[r] gets
 * each one's exit code (or 128 + signal). */
static void run_ranks(int world, rank_fn fn, void *arg, const char *name, int *status)
{
    pid_t pids[COMM_MAX_RANKS];
    fflush(NULL);
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        cr_assert_geq(pids[r], 0);
        if (pids[r] == 0) _exit(fn(r, world, name, arg));
    }
    for (int r = 0; r < world; r++) {
        int st;
        cr_assert_eq(waitpid(pids[r], &st, 0), pids[r]);
        status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
}

static void expect_all(int world, const int *status, int want, const char *what)
{
    for (int r = 0; r < world; r++)
        cr_expect_eq(status[r], want, "%s: rank %d exited %d, not %d", what, r, status[r], want);
}

/* fn on world ranks under a new name; every rank must exit 0. */
static void expect_ranks_pass(int world, rank_fn fn, void *arg, const char *what)
{
    char name[64];
    int status[COMM_MAX_RANKS];
    unique_name(name, sizeof(name));
    run_ranks(world, fn, arg, name, status);
    expect_all(world, status, 0, what);
    cr_expect_not(seg_exists(name), "%s: the segment outlived the rendezvous", what);
}

static struct comm *open_pool(int rank, int world, const char *name, size_t chunk, size_t pool,
                              int *err)
{
    struct comm_opts o = {.backend = COMM_SHM, .rank = rank, .world = world, .name = name,
                          .timeout_ms = 20000, .chunk_bytes = chunk, .pool_bytes = pool};
    struct comm *c = NULL;
    *err = comm_open(&o, &c);
    return c;
}

static struct comm *open_shm(int rank, int world, const char *name, size_t chunk, int *err)
{
    struct comm_opts o = {.backend = COMM_SHM, .rank = rank, .world = world, .name = name,
                          .timeout_ms = 20000, .chunk_bytes = chunk};
    struct comm *c = NULL;
    *err = comm_open(&o, &c);
    return c;
}

/* Rank r's contribution: floats of widely different magnitudes, so that the order of the
 * sum changes its bits. */
static float value(int r, size_t i)
{
    uint64_t x = (uint64_t)(r + 1) * 0x9e3779b97f4a7c15ull ^ (uint64_t)i * 0xbf58476d1ce4e5b9ull;
    x ^= x >> 31;
    float m = (float)(x % 100003) / 977.0f - 50.0f;
    return m * (float)(1u << (x >> 60)); /* times 1 .. 2^15 */
}

/* The sum of element i over world ranks, in rank order, each rank's data at element i. */
static float rank_order_sum(int world, size_t i)
{
    float acc = value(0, i);
    for (int r = 1; r < world; r++)
        acc += value(r, i);
    return acc;
}

/* The same chain going on from init: ((init + rank 0's) + rank 1's) + ... (comm_req.acc). */
static float chain_from(float init, int world, size_t i)
{
    for (int r = 0; r < world; r++)
        init += value(r, i);
    return init;
}

/* A reduction that adds onto recv (acc), run synchronously. */
static int run_acc(struct comm *c, enum comm_op op, const float *send, float *recv, size_t n)
{
    struct comm_req q = {.op = op, .dtype = COMM_F32, .send = send, .recv = recv, .count = n,
                         .acc = true};
    return comm_run(c, &q);
}

struct coll_arg {
    size_t count, chunk;
    int pooled; /* -1: no rank's buffers in its pool, W: all of them, r: rank r's only */
};

static int collectives(int rank, int world, const char *name, void *argp)
{
    const struct coll_arg *a = argp;
    size_t n = a->count;
    int err;
    size_t buf_bytes = (n * (size_t)world + 1) * sizeof(float);
    bool mine_pooled = a->pooled == world || a->pooled == rank;
    struct comm *c = open_pool(rank, world, name, a->chunk, a->pooled >= 0 ? 2 * buf_bytes + 8192 : 0, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float *send = mine_pooled ? comm_alloc(c, buf_bytes, &err) : malloc(buf_bytes);
    float *recv = mine_pooled ? comm_alloc(c, buf_bytes, &err) : malloc(buf_bytes);
    if (!send || !recv) FAIL(11, "out of memory");

    /* allreduce, into another buffer and in place */
    for (size_t i = 0; i < n; i++)
        send[i] = value(rank, i);
    if ((err = comm_allreduce(c, send, recv, n, COMM_F32))) FAIL(12, "allreduce: %s", zinf_strerror(err));
    for (size_t i = 0; i < n; i++)
        if (memcmp(&recv[i], &(float){rank_order_sum(world, i)}, 4))
            FAIL(13, "allreduce: element %zu is %a, the rank-order sum %a", i, recv[i],
                 rank_order_sum(world, i));
    if ((err = comm_allreduce(c, send, send, n, COMM_F32))) FAIL(14, "allreduce in place: %s", zinf_strerror(err));
    if (memcmp(send, recv, n * sizeof(float))) FAIL(15, "allreduce in place differs");

    /* reduce_scatter: element i of destination d is value(r, d * n + i) */
    for (size_t i = 0; i < n * (size_t)world; i++)
        send[i] = value(rank, i);
    if ((err = comm_reduce_scatter(c, send, recv, n, COMM_F32)))
        FAIL(16, "reduce_scatter: %s", zinf_strerror(err));
    for (size_t i = 0; i < n; i++) {
        float want = rank_order_sum(world, (size_t)rank * n + i);
        if (memcmp(&recv[i], &want, 4)) FAIL(17, "reduce_scatter: element %zu", i);
    }
    float *mine = send + (size_t)rank * n; /* in place, as NCCL allows */
    if ((err = comm_reduce_scatter(c, send, mine, n, COMM_F32)))
        FAIL(18, "reduce_scatter in place: %s", zinf_strerror(err));
    if (memcmp(mine, recv, n * sizeof(float))) FAIL(19, "reduce_scatter in place differs");

    /* Both reductions adding onto recv: the chain that goes on from it, not recv plus the
     * ranks' sum (value(99, .) is far from the others' magnitudes, so the two differ). */
    for (size_t i = 0; i < n * (size_t)world; i++)
        send[i] = value(rank, i);
    for (size_t i = 0; i < n; i++)
        recv[i] = value(99, (size_t)rank * n + i);
    if ((err = run_acc(c, COMM_REDUCE_SCATTER, send, recv, n)))
        FAIL(28, "reduce_scatter onto recv: %s", zinf_strerror(err));
    for (size_t i = 0; i < n; i++) {
        size_t at = (size_t)rank * n + i;
        float want = chain_from(value(99, at), world, at);
        if (memcmp(&recv[i], &want, 4))
            FAIL(29, "reduce_scatter onto recv: element %zu is %a, the chain %a", i, recv[i], want);
    }
    for (size_t i = 0; i < n; i++) {
        send[i] = value(rank, i);
        recv[i] = value(99, i); /* the same on every rank */
    }
    if ((err = run_acc(c, COMM_ALLREDUCE, send, recv, n)))
        FAIL(30, "allreduce onto recv: %s", zinf_strerror(err));
    for (size_t i = 0; i < n; i++)
        if (memcmp(&recv[i], &(float){chain_from(value(99, i), world, i)}, 4))
            FAIL(31, "allreduce onto recv: element %zu", i);

    /* allgather of bytes, and broadcast from the last rank */
    unsigned char *bs = (unsigned char *)send, *br = (unsigned char *)recv;
    size_t nb = n * 3 + 1;
    for (size_t i = 0; i < nb; i++)
        bs[i] = (unsigned char)(rank * 37 + i * 11);
    if ((err = comm_allgather(c, bs, br, nb, COMM_BYTE))) FAIL(20, "allgather: %s", zinf_strerror(err));
    for (int r = 0; r < world; r++)
        for (size_t i = 0; i < nb; i++)
            if (br[(size_t)r * nb + i] != (unsigned char)(r * 37 + i * 11))
                FAIL(21, "allgather: rank %d's byte %zu", r, i);
    for (size_t i = 0; i < n; i++)
        recv[i] = rank == world - 1 ? value(99, i) : 0.0f;
    if ((err = comm_broadcast(c, recv, n, COMM_F32, world - 1))) FAIL(22, "broadcast: %s", zinf_strerror(err));
    for (size_t i = 0; i < n; i++)
        if (memcmp(&recv[i], &(float){value(99, i)}, 4)) FAIL(23, "broadcast: element %zu", i);

    /* nothing at all, then a barrier */
    if ((err = comm_allreduce(c, send, recv, 0, COMM_F32)) || (err = comm_barrier(c)))
        FAIL(24, "empty allreduce or barrier: %s", zinf_strerror(err));
    struct comm_stats st;
    comm_get_stats(c, &st);
    if (st.ops != 10 || st.rank != rank || st.world != world || st.backend != COMM_SHM)
        FAIL(25, "stats: %llu ops", (unsigned long long)st.ops);
    /* Eight of them carry data: in place in the pools only when every rank's buffers are. */
    if (st.pooled_ops != (a->pooled == world ? 8u : 0u))
        FAIL(26, "%llu operations went through the pools", (unsigned long long)st.pooled_ops);
    if (mine_pooled) {
        if (comm_free(c, send) || comm_free(c, recv) || comm_free(c, recv) != -EINVAL)
            FAIL(27, "comm_free");
    } else {
        free(send);
        free(recv);
    }
    comm_close(c);
    return 0;
}

static void collectives_across_pooled(int world, size_t count, size_t chunk, int pooled)
{
    struct coll_arg a = {count, chunk, pooled};
    expect_ranks_pass(world, collectives, &a, "collectives");
}

static void collectives_across(int world, size_t count, size_t chunk)
{
    collectives_across_pooled(world, count, chunk, -1);
}

/* Buffers from comm_alloc on every rank: one copy, read in place from the peers' pools,
 * and bitwise the same results (in place too: in-place sums read what they overwrite). */
Test(comm, pooled_collectives_are_the_rank_order_sum_on_2_and_3_ranks)
{
    collectives_across_pooled(2, 100003, 64 * KiB, 2);
    collectives_across_pooled(3, 50001, 0, 3);
}

/* Reductions whose results pass SUM_STREAM_BYTES (8 MiB) are written with non-temporal
 * stores where they are apart from their sources and aligned, and copies that large (the
 * gathers and broadcasts) from the first aligned byte: the same bits as the rest. Counts
 * 2^21 + 3 (rank 1's half of an allreduce and its part of a gather start off 16-byte
 * alignment) and 2^21 + 32 (aligned), out of place and in place. */
static int large_collectives(int rank, int world, const char *name, void *arg)
{
    (void)arg;
    const size_t big = ((size_t)1 << 21) + 32;
    int err;
    /* 25 MiB of pool a rank (a small /dev/shm, as in a container, holds both) and small
     * staging areas: send holds a reduce-scatter's input and a gather's output. */
    struct comm *c = open_pool(rank, world, name, 64 * KiB, 3 * big * sizeof(float) + 8192,
                               &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float *send = comm_alloc(c, 2 * big * sizeof(float), &err),
          *recv = comm_alloc(c, big * sizeof(float), &err);
    if (!send || !recv) FAIL(11, "comm_alloc: %s", zinf_strerror(err));
    for (size_t n = ((size_t)1 << 21) + 3; n <= big; n += 29) {
        for (int in_place = 0; in_place < 2; in_place++) {
            for (size_t i = 0; i < n; i++)
                send[i] = value(rank, i);
            float *out = in_place ? send : recv;
            if ((err = comm_allreduce(c, send, out, n, COMM_F32)))
                FAIL(12, "allreduce: %s", zinf_strerror(err));
            for (size_t i = 0; i < n; i++)
                if (memcmp(&out[i], &(float){rank_order_sum(world, i)}, 4))
                    FAIL(13, "allreduce of %zu (in place %d): element %zu is %a, not %a", n,
                         in_place, i, out[i], rank_order_sum(world, i));
            for (size_t i = 0; i < n * (size_t)world; i++)
                send[i] = value(rank, i);
            out = in_place ? send + (size_t)rank * n : recv;
            if ((err = comm_reduce_scatter(c, send, out, n, COMM_F32)))
                FAIL(14, "reduce_scatter: %s", zinf_strerror(err));
            for (size_t i = 0; i < n; i++)
                if (memcmp(&out[i], &(float){rank_order_sum(world, (size_t)rank * n + i)}, 4))
                    FAIL(15, "reduce_scatter of %zu (in place %d): element %zu", n, in_place, i);
            float *part = in_place ? send + (size_t)rank * n : recv;
            for (size_t i = 0; i < n; i++)
                part[i] = value(rank, i);
            if ((err = comm_allgather(c, part, send, n, COMM_F32)))
                FAIL(16, "allgather: %s", zinf_strerror(err));
            for (int r = 0; r < world; r++)
                for (size_t i = 0; i < n; i++)
                    if (memcmp(&send[(size_t)r * n + i], &(float){value(r, i)}, 4))
                        FAIL(17, "allgather of %zu (in place %d): rank %d's element %zu", n,
                             in_place, r, i);
            float *b = send + in_place; /* off alignment the second time */
            for (size_t i = 0; i < n; i++)
                b[i] = rank == 1 ? value(7, i) : 0.0f;
            if ((err = comm_broadcast(c, b, n, COMM_F32, 1)))
                FAIL(18, "broadcast: %s", zinf_strerror(err));
            for (size_t i = 0; i < n; i++)
                if (memcmp(&b[i], &(float){value(7, i)}, 4))
                    FAIL(19, "broadcast of %zu: element %zu", n, i);
        }
    }
    struct comm_stats st;
    comm_get_stats(c, &st);
    if (st.pooled_ops != st.ops) FAIL(20, "%llu of %llu pooled", (unsigned long long)st.pooled_ops,
                                      (unsigned long long)st.ops);
    comm_close(c);
    return 0;
}

Test(comm, large_pooled_collectives_written_around_the_caches_keep_their_bits)
{
    expect_ranks_pass(2, large_collectives, NULL, "large collectives");
}

/* Where one rank's buffers are not in its pool, every rank goes through the staging
 * areas, with the same results. */
Test(comm, a_rank_without_pooled_buffers_sends_all_through_staging)
{
    collectives_across_pooled(3, 30011, 32 * KiB, 1);
}

/* Small chunks: many of them, a ragged last one, both staging sets in turn. */
Test(comm, shm_collectives_are_the_rank_order_sum_on_2_ranks)
{
    collectives_across(2, 100003, 64 * KiB);
}

Test(comm, shm_collectives_are_the_rank_order_sum_on_3_ranks)
{
    collectives_across(3, 50001, 48 * KiB);
}

Test(comm, shm_collectives_are_the_rank_order_sum_on_4_ranks)
{
    collectives_across(4, 77777, 0); /* the default chunk */
}

/* A 16-bit wire (comm_req.wire): each contribution rounded, the sums fp32 in rank order
 * (onto recv with acc), an allreduce's result rounded once more; half the bytes counted;
 * through the staging areas also where every rank's buffers are in its pool. */
static int wire_ranks(int rank, int world, const char *name, void *argp)
{
    const struct coll_arg *a = argp;
    size_t n = a->count;
    int err;
    size_t buf_bytes = (n * (size_t)world + 1) * sizeof(float);
    struct comm *c = open_pool(rank, world, name, a->chunk, 2 * buf_bytes + 8192, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float *send = comm_alloc(c, buf_bytes, &err), *recv = comm_alloc(c, buf_bytes, &err);
    if (!send || !recv) FAIL(11, "out of memory");
    for (int w = COMM_WIRE_F16; w <= COMM_WIRE_BF16; w++) {
        for (int acc = 0; acc < 2; acc++) {
            for (size_t i = 0; i < n * (size_t)world; i++)
                send[i] = value(rank, i) / 4096.0f; /* within fp16's range */
            for (size_t i = 0; i < n; i++)
                recv[i] = value(99, (size_t)rank * n + i) / 4096.0f;
            struct comm_req q = {.op = COMM_REDUCE_SCATTER, .dtype = COMM_F32, .send = send,
                                 .recv = recv, .count = n, .acc = acc, .wire = w};
            if ((err = comm_run(c, &q))) FAIL(40, "reduce_scatter: %s", zinf_strerror(err));
            for (size_t i = 0; i < n; i++) {
                size_t at = (size_t)rank * n + i;
                float want = acc ? value(99, at) / 4096.0f : 0.0f;
                for (int r = 0; r < world; r++)
                    want = (acc || r ? want : 0.0f) +
                           comm_wire_round(w, value(r, at) / 4096.0f);
                if (memcmp(&recv[i], &want, 4))
                    FAIL(41, "wire %d reduce_scatter (acc %d): element %zu is %a, not %a", w, acc,
                         i, recv[i], want);
            }
            for (size_t i = 0; i < n; i++) {
                send[i] = value(rank, i) / 4096.0f;
                recv[i] = value(99, i) / 4096.0f;
            }
            q = (struct comm_req){.op = COMM_ALLREDUCE, .dtype = COMM_F32, .send = send,
                                  .recv = recv, .count = n, .acc = acc, .wire = w};
            if ((err = comm_run(c, &q))) FAIL(42, "allreduce: %s", zinf_strerror(err));
            for (size_t i = 0; i < n; i++) {
                float want = acc ? value(99, i) / 4096.0f : 0.0f;
                for (int r = 0; r < world; r++)
                    want = (acc || r ? want : 0.0f) + comm_wire_round(w, value(r, i) / 4096.0f);
                want = comm_wire_round(w, want);
                if (memcmp(&recv[i], &want, 4))
                    FAIL(43, "wire %d allreduce (acc %d): element %zu is %a, not %a", w, acc, i,
                         recv[i], want);
            }
        }
    }
    struct comm_stats st;
    comm_get_stats(c, &st);
    /* 8 reductions: 4 reduce-scatters of world x n and 4 allreduces of n, 2 bytes each. */
    uint64_t want_in = 4 * (uint64_t)n * 2 * (uint64_t)world + 4 * (uint64_t)n * 2;
    if (st.ops != 8 || st.pooled_ops != 0 || st.bytes_in != want_in)
        FAIL(44, "stats: %llu ops, %llu pooled, %llu bytes in (want %llu)",
             (unsigned long long)st.ops, (unsigned long long)st.pooled_ops,
             (unsigned long long)st.bytes_in, (unsigned long long)want_in);
    comm_free(c, send);
    comm_free(c, recv);
    comm_close(c);
    return 0;
}

Test(comm, sixteen_bit_wire_rounds_each_contribution_and_sums_in_rank_order)
{
    struct coll_arg a = {20011, 24 * KiB, 3};
    expect_ranks_pass(3, wire_ranks, &a, "16-bit wire, 3 ranks");
    struct coll_arg b = {33333, 0, 2};
    expect_ranks_pass(2, wire_ranks, &b, "16-bit wire, 2 ranks");
}

static void order_cb(struct comm_req *q, int res)
{
    int *log = q->data;
    int idx = atomic_fetch_add((atomic_int *)&log[0], 1);
    log[1 + idx] = res < 0 ? -1 : (int)q->root; /* the request's number */
}

/* Requests queued without waiting run and call back in submission order. */
static int async_order(int rank, int world, const char *name, void *arg)
{
    (void)arg;
    int err;
    struct comm *c = open_shm(rank, world, name, 16 * KiB, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    enum { N = 40, COUNT = 5000 };
    static float in[N][COUNT], out[N][COUNT];
    static struct comm_req q[N];
    static int log[1 + N];
    for (int k = 0; k < N; k++) {
        for (int i = 0; i < COUNT; i++)
            in[k][i] = (float)(rank + k * i);
        /* root is unused by allreduce and barrier: it numbers the request here */
        q[k] = (struct comm_req){.op = k % 5 == 4 ? COMM_BARRIER : COMM_ALLREDUCE, .dtype = COMM_F32,
                                 .send = in[k], .recv = out[k], .count = COUNT, .root = k,
                                 .cb = order_cb, .data = log};
        if ((err = comm_submit(c, &q[k]))) FAIL(11, "submit %d: %s", k, zinf_strerror(err));
    }
    comm_close(c); /* waits for every request */
    if (log[0] != N) FAIL(12, "%d callbacks of %d", log[0], N);
    for (int k = 0; k < N; k++) {
        if (log[1 + k] != k) FAIL(13, "callback %d was request %d", k, log[1 + k]);
        if (k % 5 == 4) continue;
        for (int i = 0; i < COUNT; i++) {
            float want = 0;
            for (int r = 0; r < world; r++)
                want += (float)(r + k * i);
            if (out[k][i] != want) FAIL(14, "request %d element %d", k, i);
        }
    }
    return 0;
}

Test(comm, queued_requests_finish_in_submission_order)
{
    expect_ranks_pass(3, async_order, NULL, "async order");
}

/* A random sequence of collectives, the same on every rank (one seed): random sizes
 * (0 to a few chunks, ragged), pooled or private buffers per rank and operation, in place
 * or not, staged chunks and pooled operations interleaved so that every alternation of
 * the staging sets and of the two paths occurs. Every result is checked bitwise. */
static uint64_t rng_next(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

static int random_ops(int rank, int world, const char *name, void *arg)
{
    (void)arg;
    const size_t max = 40000, bytes = (max * (size_t)world + 64) * sizeof(float);
    int err;
    struct comm *c = open_pool(rank, world, name, 16 * KiB, 2 * bytes + 8192, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float *ps = comm_alloc(c, bytes, &err), *pr = comm_alloc(c, bytes, &err);
    float *hs = malloc(bytes), *hr = malloc(bytes);
    if (!ps || !pr || !hs || !hr) FAIL(11, "out of memory");
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int k = 0; k < 150; k++) {
        uint64_t v = rng_next(&x);
        enum comm_op op = (enum comm_op)(v % 4);
        size_t n = (size_t)(rng_next(&x) % (max + 1));
        if (v % 7 == 0) n = 0;
        bool pooled = ((v >> 8) >> rank) & 1 || (v >> 20) % 3 == 0; /* often all, sometimes some */
        bool in_place = (v >> 30) & 1;
        float *send = pooled ? ps : hs, *recv = pooled ? pr : hr;
        size_t in = op == COMM_REDUCE_SCATTER ? n * (size_t)world : n;
        for (size_t i = 0; i < in; i++)
            send[i] = value(rank + k, i);
        if (in_place && op == COMM_ALLREDUCE) recv = send;
        if (in_place && op == COMM_REDUCE_SCATTER) recv = send + (size_t)rank * n;
        if (in_place && op == COMM_ALLGATHER) {
            /* the rank's part already where it goes */
            memmove(recv + (size_t)rank * n, send, n * sizeof(float));
            send = recv + (size_t)rank * n;
        }
        int root = (int)((v >> 40) % (uint64_t)world);
        if (op == COMM_BROADCAST) {
            for (size_t i = 0; i < n; i++)
                recv[i] = rank == root ? value(root + k, i) : -1.0f;
            err = comm_broadcast(c, recv, n, COMM_F32, root);
        } else {
            struct comm_req q = {.op = op, .dtype = COMM_F32, .send = send, .recv = recv, .count = n};
            err = comm_run(c, &q);
        }
        if (err) FAIL(12, "op %d (%d, %zu): %s", k, (int)op, n, zinf_strerror(err));
        size_t out = op == COMM_ALLGATHER ? n * (size_t)world : n;
        for (size_t i = 0; i < out; i++) {
            float want;
            if (op == COMM_BROADCAST) {
                want = value(root + k, i);
            } else if (op == COMM_ALLGATHER) {
                want = value((int)(i / n) + k, i % n);
            } else {
                size_t at = op == COMM_REDUCE_SCATTER ? (size_t)rank * n + i : i;
                want = value(k, at);
                for (int q = 1; q < world; q++)
                    want += value(q + k, at);
            }
            if (memcmp(&recv[i], &want, 4))
                FAIL(13, "op %d (%d, %zu, pooled %d, in place %d): element %zu is %a, not %a", k,
                     (int)op, n, pooled, in_place, i, recv[i], want);
        }
    }
    struct comm_stats st;
    comm_get_stats(c, &st);
    if (st.ops != 150 || st.pooled_ops == 0 || st.pooled_ops > 120)
        FAIL(14, "%llu operations, %llu pooled: not a mix", (unsigned long long)st.ops,
             (unsigned long long)st.pooled_ops);
    free(hs);
    free(hr);
    comm_close(c);
    return 0;
}

Test(comm, random_sequences_of_collectives_stay_exact)
{
    expect_ranks_pass(3, random_ops, NULL, "random sequence");
}

/* ---- the self backend and bad input ------------------------------------------------ */

static int never_called;
static void never_cb(struct comm_req *q, int res)
{
    (void)q, (void)res;
    never_called++;
}

Test(comm, comm_alloc_hands_out_the_pool_and_says_when_it_cannot)
{
    char name[64];
    unique_name(name, sizeof(name));
    int err, rank = 0;
    struct comm *c = open_pool(rank, 1, name, 0, 3 * MiB, &err);
    cr_assert_not_null(c, "%s", zinf_strerror(err));
    void *a = comm_alloc(c, MiB, &err), *b = comm_alloc(c, 2 * MiB, &err);
    cr_assert(a && b);
    cr_assert(is_aligned((uintptr_t)a, 4096));
    cr_assert_null(comm_alloc(c, 1, &err), "the pool is full");
    cr_assert_eq(err, -ENOSPC);
    cr_assert_null(comm_alloc(c, 0, &err));
    cr_assert_eq(err, -EINVAL);
    int x;
    cr_assert_eq(comm_free(c, &x), -EINVAL, "not the pool's");
    cr_assert_eq(comm_free(c, (char *)a + 4096), -EINVAL, "inside an allocation");
    cr_assert_eq(comm_free(c, a), 0);
    cr_assert_eq(comm_free(c, a), -EINVAL, "twice");
    cr_assert_not_null(comm_alloc(c, MiB, &err), "room again");
    comm_close(c);
    /* No pool: -ENOSPC; the self backend: plain memory. */
    unique_name(name, sizeof(name));
    c = open_shm(rank, 1, name, 0, &err);
    cr_assert_null(comm_alloc(c, 4096, &err));
    cr_assert_eq(err, -ENOSPC);
    comm_close(c);
    struct comm_opts so = {.backend = COMM_SELF, .world = 1};
    cr_assert_eq(comm_open(&so, &c), 0);
    a = comm_alloc(c, 100, &err);
    cr_assert_not_null(a);
    cr_assert_eq(comm_free(c, &x), -EINVAL);
    cr_assert_eq(comm_free(c, a), 0);
    cr_assert_not_null(comm_alloc(c, 100, &err), "freed by comm_close");
    comm_close(c);
}

/* Ranks that disagree on the pool's size fail together. */
static int wrong_pool(int rank, int world, const char *name, void *arg)
{
    (void)world, (void)arg;
    int err;
    struct comm *c = open_pool(rank, 2, name, 0, rank ? 2 * MiB : MiB, &err);
    comm_close(c);
    return -err;
}

Test(comm, ranks_with_other_pool_sizes_fail_together)
{
    char name[64];
    int status[2];
    unique_name(name, sizeof(name));
    run_ranks(2, wrong_pool, NULL, name, status);
    expect_all(2, status, EPROTO, "pool sizes");
}

Test(comm, self_backend_copies_and_checks_its_input)
{
    struct comm_opts o = {.backend = COMM_SELF, .rank = 0, .world = 1};
    struct comm *c = NULL;
    cr_assert_eq(comm_open(&o, &c), 0);
    float a[100], b[100];
    for (int i = 0; i < 100; i++)
        a[i] = (float)i * 1.5f;
    cr_assert_eq(comm_allreduce(c, a, b, 100, COMM_F32), 0);
    cr_assert_eq(memcmp(a, b, sizeof(a)), 0);
    memset(b, 0, sizeof(b));
    cr_assert_eq(comm_allgather(c, a, b, 100, COMM_F32), 0);
    cr_assert_eq(memcmp(a, b, sizeof(a)), 0);
    cr_assert_eq(comm_reduce_scatter(c, a, a, 100, COMM_F32), 0, "in place");
    cr_assert_eq(comm_broadcast(c, b, 100, COMM_F32, 0), 0);
    cr_assert_eq(comm_barrier(c), 0);

    /* Bad requests: -EINVAL, and the callback never fires. */
    struct comm_req q = {.op = COMM_ALLREDUCE, .dtype = COMM_BYTE, .send = a, .recv = b,
                         .count = 4, .cb = never_cb};
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "a sum of bytes");
    q.dtype = COMM_F32;
    q.cb = NULL;
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "no callback");
    q.cb = never_cb;
    q.send = NULL;
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "no send buffer");
    q = (struct comm_req){.op = COMM_BROADCAST, .dtype = COMM_F32, .recv = b, .count = 4, .root = 1,
                          .cb = never_cb};
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "a root outside the world");
    q.root = 0;
    q.op = (enum comm_op)99;
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "an unknown operation");
    q.op = COMM_ALLGATHER;
    q.send = a;
    q.count = SIZE_MAX / 2;
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "a count that overflows");
    q.dtype = (enum comm_dtype)7;
    q.count = 1;
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "an unknown type");
    cr_assert_eq(comm_submit(NULL, &q), -EINVAL);
    cr_assert_eq(comm_submit(c, NULL), -EINVAL);
    /* send and recv overlapping other than in the in-place forms */
    q = (struct comm_req){.op = COMM_ALLREDUCE, .dtype = COMM_F32, .send = a, .recv = a + 1,
                          .count = 8, .cb = never_cb};
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "allreduce into its send shifted by one");
    q.op = COMM_REDUCE_SCATTER;
    q.recv = a + 7;
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "reduce_scatter into the end of its send");
    q.op = COMM_ALLGATHER;
    q.send = a + 3;
    q.recv = a;
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "allgather of a part of recv not the rank's");
    q.send = a + 8; /* touching, not overlapping */
    cr_assert_eq(comm_run(c, &q), 0, "allgather from just past recv");
    q.acc = true;
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "a gather that adds");
    q = (struct comm_req){.op = COMM_ALLREDUCE, .dtype = COMM_F32, .send = a, .recv = a,
                          .count = 8, .cb = never_cb, .acc = true};
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "an allreduce in place that adds onto recv");
    q.op = COMM_REDUCE_SCATTER;
    cr_assert_eq(comm_submit(c, &q), -EINVAL, "a reduce_scatter in place that adds onto recv");
    cr_assert_eq(never_called, 0);
    /* One rank adds its send onto recv. */
    for (int i = 0; i < 100; i++)
        b[i] = 0.25f;
    q = (struct comm_req){.op = COMM_ALLREDUCE, .dtype = COMM_F32, .send = a, .recv = b,
                          .count = 100, .acc = true};
    cr_assert_eq(comm_run(c, &q), 0);
    for (int i = 0; i < 100; i++)
        cr_assert_eq(b[i], a[i] + 0.25f);
    /* Still works after all that. */
    cr_assert_eq(comm_allreduce(c, a, b, 100, COMM_F32), 0);
    struct comm_stats st;
    comm_get_stats(c, &st);
    cr_assert_eq(st.ops, 8);
    cr_assert_eq(st.backend, COMM_SELF);
    comm_close(c);
}

Test(comm, bad_options_are_refused)
{
    struct comm *c = (struct comm *)1;
    struct comm_opts o = {.backend = COMM_SHM, .rank = 0, .world = 0, .name = "x"};
    cr_assert_eq(comm_open(&o, &c), -EINVAL, "a world of 0");
    cr_assert_null(c);
    o.world = COMM_MAX_RANKS + 1;
    cr_assert_eq(comm_open(&o, &c), -EINVAL, "too many ranks");
    o.world = 2;
    o.rank = 2;
    cr_assert_eq(comm_open(&o, &c), -EINVAL, "rank outside the world");
    o.rank = -1;
    cr_assert_eq(comm_open(&o, &c), -EINVAL, "a negative rank");
    o.rank = 0;
    o.backend = COMM_SELF;
    cr_assert_eq(comm_open(&o, &c), -EINVAL, "self with two ranks");
    o.backend = (enum comm_backend)9;
    cr_assert_eq(comm_open(&o, &c), -EINVAL, "an unknown backend");
    o.backend = COMM_SHM;
    o.world = 1;
    const char *bad[] = {NULL, "", "a/b", ".hidden", "white space",
                         "0123456789012345678901234567890123456789012345678901234567890123456789"};
    for (size_t i = 0; i < ARRAY_SIZE(bad); i++) {
        o.name = bad[i];
        cr_assert_eq(comm_open(&o, &c), -EINVAL, "name %zu", i);
    }
    cr_assert_eq(comm_open(NULL, &c), -EINVAL);
    cr_assert_eq(comm_open(&o, NULL), -EINVAL);
    o.name = "n";
    o.mpi = true;
    o.backend = COMM_SELF;
    cr_assert_eq(comm_open(&o, &c), -EINVAL, "self under mpi");
    o.backend = COMM_SHM;
    char why[200] = "";
    o.why = why;
    o.why_len = sizeof(why);
    if (!ZINF_HAVE_MPI) { /* with MPI: test_comm_mpi */
        cr_assert_eq(comm_open(&o, &c), -ENOTSUP, "mpi in a build without MPI");
        cr_assert(strstr(why, "libopenmpi-dev"), "why: %s", why);
    }
    o.mpi = false;
    o.why = NULL;
    o.backend = COMM_NCCL;
    struct cuda_probe_info pi;
    if (!ZINF_HAVE_NCCL) {
        cr_assert_eq(comm_open(&o, &c), -ENOTSUP, "a build without NCCL");
    } else if (cuda_probe(&pi) == 0) {
        /* NCCL built (and loaded at run time, where it is installed) but no GPU: an error,
         * nothing left behind. */
        char name[64];
        unique_name(name, sizeof(name));
        o.name = name;
        int r = comm_open(&o, &c);
        cr_assert_lt(r, 0, "nccl without a GPU");
        cr_assert_null(c);
        cr_assert_not(seg_exists(name));
    }
}

/* One shm rank is a world of its own. */
Test(comm, one_shm_rank)
{
    char name[64];
    unique_name(name, sizeof(name));
    int err;
    int rank = 0;
    struct comm *c = open_shm(rank, 1, name, 0, &err);
    cr_assert_not_null(c, "%s", zinf_strerror(err));
    float a[3] = {1, 2, 3}, b[3];
    cr_assert_eq(comm_allreduce(c, a, b, 3, COMM_F32), 0);
    cr_assert_eq(memcmp(a, b, sizeof(a)), 0);
    cr_assert_eq(comm_barrier(c), 0);
    comm_close(c);
    cr_assert_not(seg_exists(name));
}

/* ---- faults ------------------------------------------------------------------------ */

/* Each rank opens with world = 2 + rank (rank 1 disagrees) and exits with -comm_open. */
static int wrong_world(int rank, int world, const char *name, void *arg)
{
    (void)world, (void)arg;
    int err;
    struct comm *c = open_shm(rank, rank == 0 ? 2 : 3, name, 0, &err);
    comm_close(c);
    return -err;
}

Test(comm, a_rank_with_another_world_fails_every_rank_at_once)
{
    char name[64];
    int status[2];
    unique_name(name, sizeof(name));
    uint64_t t0 = now_ns();
    run_ranks(2, wrong_world, NULL, name, status);
    expect_all(2, status, EPROTO, "wrong world");
    cr_expect_lt(now_ns() - t0, 10ull * 1000000000, "not the 20 s rendezvous timeout");
    cr_expect_not(seg_exists(name));
}

static int duplicate_rank(int rank, int world, const char *name, void *arg)
{
    (void)world, (void)arg;
    int err;
    struct comm *c = open_shm(rank == 2 ? 1 : rank, 3, name, 0, &err); /* rank 1 twice */
    comm_close(c);
    return -err;
}

Test(comm, a_rank_started_twice_is_refused)
{
    char name[64];
    int status[3];
    unique_name(name, sizeof(name));
    run_ranks(3, duplicate_rank, NULL, name, status);
    cr_expect_eq(status[0], EPROTO);
    cr_expect(status[1] == EEXIST || status[2] == EEXIST, "%d %d", status[1], status[2]);
    cr_expect(status[1] == EPROTO || status[2] == EPROTO, "%d %d", status[1], status[2]);
}

Test(comm, a_rendezvous_nobody_comes_to_times_out)
{
    char name[64];
    unique_name(name, sizeof(name));
    struct comm_opts o = {.backend = COMM_SHM, .rank = 0, .world = 3, .name = name, .timeout_ms = 300};
    struct comm *c = NULL;
    uint64_t t0 = now_ns();
    cr_assert_eq(comm_open(&o, &c), -ETIMEDOUT);
    cr_assert_lt(now_ns() - t0, 3ull * 1000000000);
    cr_assert_not(seg_exists(name), "rank 0 left its segment behind");
    o.rank = 1; /* and a rank whose rank 0 never comes */
    cr_assert_eq(comm_open(&o, &c), -ETIMEDOUT);
}

/* The last rank dies once the communicator is open; the others' next collective fails
 * within seconds, and so does every later request. */
static int one_dies(int rank, int world, const char *name, void *arg)
{
    (void)arg;
    int err;
    struct comm *c = open_shm(rank, world, name, 0, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float a[1000] = {0}, b[1000];
    if ((err = comm_allreduce(c, a, b, 1000, COMM_F32))) FAIL(11, "first allreduce: %s", zinf_strerror(err));
    if (rank == world - 1) raise(SIGKILL);
    uint64_t t0 = now_ns();
    err = comm_allreduce(c, a, b, 1000, COMM_F32);
    if (err != -ECONNABORTED) FAIL(12, "allreduce after a death: %s", zinf_strerror(err));
    if (now_ns() - t0 > 5ull * 1000000000) FAIL(13, "the death was seen after %llu ms",
                                                  (unsigned long long)((now_ns() - t0) / 1000000));
    if ((err = comm_barrier(c)) != -ECONNABORTED) FAIL(14, "then: %s", zinf_strerror(err));
    comm_close(c);
    return 0;
}

Test(comm, a_dead_rank_fails_the_others_collectives)
{
    char name[64];
    int status[3];
    unique_name(name, sizeof(name));
    run_ranks(3, one_dies, NULL, name, status);
    cr_expect_eq(status[0], 0);
    cr_expect_eq(status[1], 0);
    cr_expect_eq(status[2], 128 + SIGKILL);
}

/* A /dev/shm too small for the segment (as in a container) is -ENOSPC at comm_open, with
 * nothing left behind, not a SIGBUS later. Needs a mount namespace (root). */
static int small_shm(void)
{
    if (unshare(CLONE_NEWNS) != 0) return 77;
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
        mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=1m") != 0)
        return 77;
    struct comm_opts o = {.backend = COMM_SHM, .world = 1, .name = "small", .pool_bytes = 4 * MiB};
    struct comm *c = NULL;
    if (comm_open(&o, &c) != -ENOSPC || c) return 1;
    if (seg_exists("small")) return 2;
    o.pool_bytes = 0;
    o.chunk_bytes = 64 * KiB; /* 2 x 2 x 64 KiB: fits */
    if (comm_open(&o, &c) != 0) return 3;
    float a[4] = {1, 2, 3, 4}, b[4];
    int r = comm_allreduce(c, a, b, 4, COMM_F32);
    comm_close(c);
    return r || memcmp(a, b, sizeof(a)) ? 4 : 0;
}

Test(comm, a_dev_shm_too_small_is_enospc_at_open)
{
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) _exit(small_shm());
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st));
    if (WEXITSTATUS(st) == 77) cr_skip_test("no mount namespace here (not root)");
    cr_assert_eq(WEXITSTATUS(st), 0, "step %d failed", WEXITSTATUS(st));
}

/* ---- NCCL on one GPU (the gpu check; skipped elsewhere) ------------------------------ */

#if ZINF_HAVE_NCCL
#include <cuda_runtime_api.h>

Test(comm, nccl_with_one_rank)
{
    struct cuda_probe_info pi;
    if (cuda_probe(&pi) == 0) cr_skip_test("no usable GPU: %s", pi.reason);
    char name[64];
    unique_name(name, sizeof(name));
    struct comm_opts o = {.backend = COMM_NCCL, .rank = 0, .world = 1, .name = name};
    struct comm *c = NULL;
    int r = comm_open(&o, &c);
    cr_assert_eq(r, 0, "comm_open: %s", zinf_strerror(r));
    const size_t n = 1 << 20;
    float *h = malloc(n * sizeof(float)), *back = malloc(n * sizeof(float)), *d_in, *d_out;
    for (size_t i = 0; i < n; i++)
        h[i] = value(0, i);
    cr_assert_eq(cudaMalloc((void **)&d_in, n * sizeof(float)), cudaSuccess);
    cr_assert_eq(cudaMalloc((void **)&d_out, n * sizeof(float)), cudaSuccess);
    cr_assert_eq(cudaMemcpy(d_in, h, n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(comm_allreduce(c, d_in, d_out, n, COMM_F32), 0);
    cr_assert_eq(cudaMemcpy(back, d_out, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(memcmp(h, back, n * sizeof(float)), 0, "an allreduce of one rank");
    cr_assert_eq(comm_allgather(c, d_in, d_out, n, COMM_F32), 0);
    cr_assert_eq(comm_reduce_scatter(c, d_in, d_out, n, COMM_F32), 0);
    cr_assert_eq(comm_broadcast(c, d_out, n, COMM_F32, 0), 0);
    cr_assert_eq(comm_barrier(c), 0);
    cr_assert_eq(cudaMemcpy(back, d_out, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(memcmp(h, back, n * sizeof(float)), 0);
    cudaFree(d_in);
    cudaFree(d_out);
    free(h);
    free(back);
    comm_close(c);
}

/* Whether world NCCL ranks can run here: a GPU each, or the CPU emulation of
 * tests/cuda_emu, where every process has an emulated device of its own. */
static bool nccl_ranks_here(int world, int *device_of_rank1, char *why, size_t len)
{
    /* Asked in a child: the ranks are forked from here, and CUDA does not survive a fork. */
    struct cuda_probe_info pi;
    int n = test_cuda_probe_forked(&pi);
    if (n <= 0) {
        snprintf(why, len, "no usable GPU: %s", pi.reason);
        return false;
    }
    bool emulated = strncmp(pi.name, "EMU ", 4) == 0;
    *device_of_rank1 = emulated ? 0 : 1;
    snprintf(why, len, "%d GPU(s): NCCL runs one rank per GPU, and this needs %d", n, world);
    return emulated || n >= world;
}

struct nccl_arg {
    size_t count;
    int per_rank_device; /* rank r on GPU r (1), or every rank on device 0 (0: emulated) */
};

static int put(void *d, const void *h, size_t bytes)
{
    return cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -EIO;
}

static int get(void *h, const void *d, size_t bytes)
{
    return cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -EIO;
}

/* The collectives of the nccl backend on device buffers: the same checks as the shm
 * backend's, bitwise against the rank-order sum. */
static int nccl_collectives(int rank, int world, const char *name, void *argp)
{
    const struct nccl_arg *a = argp;
    size_t n = a->count, bytes = n * (size_t)world * sizeof(float);
    struct comm_opts o = {.backend = COMM_NCCL, .rank = rank, .world = world, .name = name,
                          .timeout_ms = 60000, .cuda_device = a->per_rank_device ? rank : 0};
    struct comm *c = NULL;
    int err = comm_open(&o, &c);
    if (err) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float *hs = malloc(bytes), *hr = malloc(bytes), *ds = NULL, *dr = NULL;
    if (!hs || !hr || cudaMalloc((void **)&ds, bytes) != cudaSuccess ||
        cudaMalloc((void **)&dr, bytes) != cudaSuccess)
        FAIL(11, "out of memory");

    for (size_t i = 0; i < n; i++)
        hs[i] = value(rank, i);
    if (put(ds, hs, n * 4) || (err = comm_allreduce(c, ds, dr, n, COMM_F32)) || get(hr, dr, n * 4))
        FAIL(12, "allreduce: %s", zinf_strerror(err));
    for (size_t i = 0; i < n; i++)
        if (memcmp(&hr[i], &(float){rank_order_sum(world, i)}, 4))
            FAIL(13, "allreduce: element %zu is %a, the rank-order sum %a", i, hr[i],
                 rank_order_sum(world, i));
    if ((err = comm_allreduce(c, ds, ds, n, COMM_F32)) || get(hs, ds, n * 4))
        FAIL(14, "allreduce in place: %s", zinf_strerror(err));
    if (memcmp(hs, hr, n * sizeof(float))) FAIL(15, "allreduce in place differs");

    for (size_t i = 0; i < n * (size_t)world; i++)
        hs[i] = value(rank, i);
    if (put(ds, hs, bytes) || (err = comm_reduce_scatter(c, ds, dr, n, COMM_F32)) ||
        get(hr, dr, n * 4))
        FAIL(16, "reduce_scatter: %s", zinf_strerror(err));
    for (size_t i = 0; i < n; i++) {
        float want = rank_order_sum(world, (size_t)rank * n + i);
        if (memcmp(&hr[i], &want, 4)) FAIL(17, "reduce_scatter: element %zu", i);
    }
    float *mine = ds + (size_t)rank * n;
    if ((err = comm_reduce_scatter(c, ds, mine, n, COMM_F32)) || get(hs, mine, n * 4))
        FAIL(18, "reduce_scatter in place: %s", zinf_strerror(err));
    if (memcmp(hs, hr, n * sizeof(float))) FAIL(19, "reduce_scatter in place differs");

    /* allgather of bytes (into another buffer, and in place), broadcast from the last rank */
    unsigned char *bs = (unsigned char *)hs, *br = (unsigned char *)hr;
    size_t nb = n * 3 + 1;
    for (size_t i = 0; i < nb; i++)
        bs[i] = (unsigned char)(rank * 37 + i * 11);
    if (put(ds, bs, nb) || (err = comm_allgather(c, ds, dr, nb, COMM_BYTE)) ||
        get(br, dr, nb * (size_t)world))
        FAIL(20, "allgather: %s", zinf_strerror(err));
    for (int r = 0; r < world; r++)
        for (size_t i = 0; i < nb; i++)
            if (br[(size_t)r * nb + i] != (unsigned char)(r * 37 + i * 11))
                FAIL(21, "allgather: rank %d's byte %zu", r, i);
    unsigned char *at = (unsigned char *)dr + (size_t)rank * nb;
    if (put(at, bs, nb) || (err = comm_allgather(c, at, dr, nb, COMM_BYTE)) ||
        get(bs, dr, nb * (size_t)world))
        FAIL(22, "allgather in place: %s", zinf_strerror(err));
    if (memcmp(bs, br, nb * (size_t)world)) FAIL(23, "allgather in place differs");
    for (size_t i = 0; i < n; i++)
        hr[i] = rank == world - 1 ? value(99, i) : 0.0f;
    if (put(dr, hr, n * 4) || (err = comm_broadcast(c, dr, n, COMM_F32, world - 1)) ||
        get(hr, dr, n * 4))
        FAIL(24, "broadcast: %s", zinf_strerror(err));
    for (size_t i = 0; i < n; i++)
        if (memcmp(&hr[i], &(float){value(99, i)}, 4)) FAIL(25, "broadcast: element %zu", i);
    if ((err = comm_barrier(c))) FAIL(26, "barrier: %s", zinf_strerror(err));
    struct comm_stats st;
    comm_get_stats(c, &st);
    if (st.ops != 8 || st.backend != COMM_NCCL) FAIL(27, "stats: %llu ops", (unsigned long long)st.ops);
    cudaFree(ds);
    cudaFree(dr);
    free(hs);
    free(hr);
    comm_close(c);
    return 0;
}

/* Across ranks: a GPU each (skipped where there are fewer), or the CPU emulation. Odd
 * counts and several chunks of the emulation's staging. */
Test(comm, nccl_collectives_are_the_rank_order_sum_on_2_and_4_ranks)
{
    char why[256];
    int dev1;
    if (!nccl_ranks_here(2, &dev1, why, sizeof(why))) cr_skip_test("%s", why);
    struct nccl_arg a = {.count = 300007, .per_rank_device = dev1};
    expect_ranks_pass(2, nccl_collectives, &a, "nccl collectives on 2 ranks");
    if (!nccl_ranks_here(4, &dev1, why, sizeof(why))) cr_skip_test("%s", why);
    a.count = 77777;
    expect_ranks_pass(4, nccl_collectives, &a, "nccl collectives on 4 ranks");
}

/* The collective's stream waits for an event of the caller's stream (after the copy that
 * writes its input), and the caller's stream for the event recorded after it (before the
 * copy that reads its output): no host wait orders them. */
static int nccl_events(int rank, int world, const char *name, void *argp)
{
    const struct nccl_arg *a = argp;
    size_t n = a->count, bytes = n * sizeof(float);
    struct comm_opts o = {.backend = COMM_NCCL, .rank = rank, .world = world, .name = name,
                          .timeout_ms = 60000, .cuda_device = a->per_rank_device ? rank : 0};
    struct comm *c = NULL;
    cudaStream_t s;
    cudaEvent_t after, done;
    float *h = NULL, *d = NULL;
    int err = comm_open(&o, &c);
    if (err) FAIL(10, "comm_open: %s", zinf_strerror(err));
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&after, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess ||
        cudaMallocHost((void **)&h, bytes) != cudaSuccess ||
        cudaMalloc((void **)&d, 2 * bytes) != cudaSuccess)
        FAIL(11, "CUDA setup");
    for (int round = 0; round < 3; round++) {
        for (size_t i = 0; i < n; i++)
            h[i] = value(rank + round, i);
        struct comm_req q = {.op = COMM_ALLREDUCE, .dtype = COMM_F32, .send = d, .recv = d + n,
                             .count = n, .wait_event = after, .done_event = done};
        if (cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s) != cudaSuccess ||
            cudaEventRecord(after, s) != cudaSuccess)
            FAIL(12, "copy in");
        if ((err = comm_run(c, &q))) FAIL(13, "allreduce: %s", zinf_strerror(err));
        if (cudaStreamWaitEvent(s, done, 0) != cudaSuccess ||
            cudaMemcpyAsync(h, d + n, bytes, cudaMemcpyDeviceToHost, s) != cudaSuccess ||
            cudaStreamSynchronize(s) != cudaSuccess)
            FAIL(14, "copy out");
        for (size_t i = 0; i < n; i++) {
            float want = value(round, i);
            for (int r = 1; r < world; r++)
                want += value(r + round, i);
            if (memcmp(&h[i], &want, 4)) FAIL(15, "round %d: element %zu", round, i);
        }
    }
    cudaFree(d);
    cudaFreeHost(h);
    cudaEventDestroy(after);
    cudaEventDestroy(done);
    cudaStreamDestroy(s);
    comm_close(c);
    return 0;
}

Test(comm, nccl_collectives_are_ordered_with_the_callers_stream_by_events)
{
    char why[256];
    int dev1;
    if (!nccl_ranks_here(2, &dev1, why, sizeof(why))) {
        /* One GPU: the same at world 1. */
        if (!nccl_ranks_here(1, &dev1, why, sizeof(why))) cr_skip_test("%s", why);
        struct nccl_arg a = {.count = 1 << 20, .per_rank_device = 0};
        expect_ranks_pass(1, nccl_events, &a, "nccl events on 1 rank");
        return;
    }
    struct nccl_arg a = {.count = 1 << 20, .per_rank_device = dev1};
    expect_ranks_pass(2, nccl_events, &a, "nccl events on 2 ranks");
}

/* The last rank dies once the communicator is open; the others' next collective (waiting
 * in NCCL for a peer that will never come) fails within seconds, as every later one. */
static int nccl_one_dies(int rank, int world, const char *name, void *argp)
{
    const struct nccl_arg *a = argp;
    struct comm_opts o = {.backend = COMM_NCCL, .rank = rank, .world = world, .name = name,
                          .timeout_ms = 60000, .cuda_device = a->per_rank_device ? rank : 0};
    struct comm *c = NULL;
    float *d = NULL;
    int err = comm_open(&o, &c);
    if (err) FAIL(10, "comm_open: %s", zinf_strerror(err));
    if (cudaMalloc((void **)&d, 4000 * sizeof(float)) != cudaSuccess) FAIL(11, "cudaMalloc");
    if ((err = comm_allreduce(c, d, d + 2000, 1000, COMM_F32)))
        FAIL(12, "first allreduce: %s", zinf_strerror(err));
    if (rank == world - 1) raise(SIGKILL);
    uint64_t t0 = now_ns();
    err = comm_allreduce(c, d, d + 2000, 1000, COMM_F32);
    if (err >= 0) FAIL(13, "an allreduce after a death succeeded");
    if (now_ns() - t0 > 10ull * 1000000000)
        FAIL(14, "the death was seen after %llu ms", (unsigned long long)((now_ns() - t0) / 1000000));
    if ((err = comm_barrier(c)) != -ECONNABORTED) FAIL(15, "then: %s", zinf_strerror(err));
    comm_close(c);
    cudaFree(d);
    return 0;
}

Test(comm, nccl_a_dead_rank_fails_the_others_collectives)
{
    char name[64], why[256];
    int status[3], dev1;
    if (!nccl_ranks_here(3, &dev1, why, sizeof(why))) cr_skip_test("%s", why);
    struct nccl_arg a = {.per_rank_device = dev1};
    unique_name(name, sizeof(name));
    run_ranks(3, nccl_one_dies, &a, name, status);
    cr_expect_eq(status[0], 0);
    cr_expect_eq(status[1], 0);
    cr_expect_eq(status[2], 128 + SIGKILL);
}
#endif

/* ---- who may meet where --------------------------------------------------------------- */

/* Rank 0 of world 2 under name (and secret), waiting for a rank 1 that never comes. */
static pid_t lone_rank0(const char *name, const char *secret)
{
    fflush(NULL);
    pid_t p = fork();
    cr_assert_geq(p, 0);
    if (p == 0) {
        struct comm_opts o = {.backend = COMM_SHM, .rank = 0, .world = 2, .name = name,
                              .secret = secret, .timeout_ms = 30000};
        struct comm *c = NULL;
        _exit(comm_open(&o, &c) == 0 ? 0 : 1);
    }
    return p;
}

static bool wait_seg(const char *obj)
{
    char p[256];
    struct stat st;
    snprintf(p, sizeof(p), "/dev/shm%s", obj);
    for (int i = 0; i < 3000; i++) {
        if (stat(p, &st) == 0) return true;
        usleep(1000);
    }
    return false;
}

/* A second job's rank 0 under a live job's name is refused, naming that job's rank 0, and
 * leaves its segment alone; once that rank 0 is dead, its segment is stale and the next
 * rank 0 of the name takes it over. */
Test(comm, a_live_jobs_rendezvous_is_never_taken_and_a_dead_ones_is)
{
    char name[64], obj[128], why[400];
    unique_name(name, sizeof(name));
    cr_assert_eq(comm_segment_name(name, NULL, obj, sizeof(obj)), 0);
    pid_t a = lone_rank0(name, NULL);
    cr_assert(wait_seg(obj), "rank 0 made no %s", obj);
    struct comm_opts o = {.backend = COMM_SHM, .rank = 0, .world = 2, .name = name,
                          .timeout_ms = 1000, .why = why, .why_len = sizeof(why)};
    struct comm *c = NULL;
    cr_assert_eq(comm_open(&o, &c), -EBUSY, "%s", why);
    char want[400];
    snprintf(want, sizeof(want), "another job named '%s' is meeting in /dev/shm%s (its rank 0 is "
             "pid %d)", name, obj, (int)a);
    cr_assert(strstr(why, want), "%s", why);
    cr_assert(seg_exists(name), "the live job's segment was removed");
    kill(a, SIGKILL);
    int st;
    cr_assert_eq(waitpid(a, &st, 0), a);
    cr_assert(seg_exists(name), "a killed rank 0 leaves its segment");
    o.world = 1;
    why[0] = 0;
    cr_assert_eq(comm_open(&o, &c), 0, "the stale segment was not taken over: %s", why);
    comm_close(c);
    cr_assert_not(seg_exists(name));
}

/* With a job's secret: the segment's name carries a tag keyed by it, which neither shows
 * the secret nor tells one communicator's name from another's (another user who saw one
 * could create the next first); a rank whose secret differs under the same tag (as two jobs
 * could only have by chance: made here with a second link to the segment) is refused as
 * another job's, and a secret that is not 32 hex digits is an error. */
Test(comm, only_the_jobs_secret_joins)
{
    char name[64], obj[160], obj2[160], other[160], why[400];
    const char *s1 = "0123456789abcdef0123456789abcdef", *s2 = "0123456789abcdeffedcba9876543210";
    unique_name(name, sizeof(name));
    cr_assert_eq(comm_segment_name(name, s1, obj, sizeof(obj)), 0);
    const char *tag = strrchr(obj, '.');
    cr_assert(tag && strlen(tag + 1) == 16 && strspn(tag + 1, "0123456789abcdef") == 16, "%s",
              obj);
    cr_assert(!strstr(obj, "0123456789") && !strstr(obj, "abcdef0123"), "%s", obj);
    char again[160];
    cr_assert_eq(comm_segment_name(name, s1, again, sizeof(again)), 0);
    cr_assert_str_eq(obj, again, "one name and secret, one segment name");
    /* Another communicator of the job, or the same name under another secret (even one of
     * the same first digits): another tag. */
    char name2[80];
    snprintf(name2, sizeof(name2), "%s.pf0.0.0", name);
    cr_assert_eq(comm_segment_name(name2, s1, other, sizeof(other)), 0);
    cr_assert_str_neq(strrchr(other, '.'), tag, "%s and %s", obj, other);
    cr_assert_eq(comm_segment_name(name, s2, obj2, sizeof(obj2)), 0);
    cr_assert_str_neq(obj2, obj);
    pid_t a = lone_rank0(name, s1);
    cr_assert(wait_seg(obj), "rank 0 made no %s", obj);
    char p1[200], p2[200];
    snprintf(p1, sizeof(p1), "/dev/shm%s", obj);
    snprintf(p2, sizeof(p2), "/dev/shm%s", obj2);
    cr_assert_eq(link(p1, p2), 0, "%s", strerror(errno));
    struct comm_opts o = {.backend = COMM_SHM, .rank = 1, .world = 2, .name = name,
                          .secret = s2, .timeout_ms = 2000, .why = why, .why_len = sizeof(why)};
    struct comm *c = NULL;
    cr_assert_eq(comm_open(&o, &c), -EBUSY, "%s", why);
    cr_assert(strstr(why, "another job's rendezvous") && strstr(why, "secret differs"), "%s", why);
    unlink(p2);
    o.secret = "0123";
    cr_assert_eq(comm_open(&o, &c), -EINVAL);
    cr_assert(strstr(why, "32 lowercase hex digits"), "%s", why);
    o.secret = s1; /* the right one joins */
    cr_assert_eq(comm_open(&o, &c), 0, "%s", why);
    comm_close(c);
    int st;
    cr_assert_eq(waitpid(a, &st, 0), a);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static void *stop_soon(void *arg)
{
    usleep(300000);
    *(volatile sig_atomic_t *)arg = 1;
    return NULL;
}

/* The stop flag (a signal handler's) ends a rendezvous wait at once, and rank 0 removes its
 * segment. */
Test(comm, a_stop_ends_the_rendezvous_wait)
{
    char name[64], why[400];
    unique_name(name, sizeof(name));
    static volatile sig_atomic_t stop;
    stop = 0;
    pthread_t th;
    struct comm_opts o = {.backend = COMM_SHM, .rank = 0, .world = 3, .name = name,
                          .timeout_ms = 30000, .stop = &stop, .why = why, .why_len = sizeof(why)};
    struct comm *c = NULL;
    cr_assert_eq(pthread_create(&th, NULL, stop_soon, (void *)&stop), 0);
    uint64_t t0 = now_ns();
    cr_assert_eq(comm_open(&o, &c), -EINTR, "%s", why);
    cr_assert_lt(now_ns() - t0, 2000000000ull);
    pthread_join(th, NULL);
    cr_assert_not(seg_exists(name));
}
