/*
 * test_comm_a2a.c - the communicator's alltoall and point-to-point operations (send, recv,
 * sendrecv): alltoall at worlds of 1 to 4 ranks with odd counts, several chunks of the
 * staging areas, bytes and pooled buffers; the point-to-point patterns a ring, pairwise
 * exchanges in opposite orders, a 3-stage 1F1B pipeline schedule, and ranks that take no
 * part; and the faults: a bad peer, a size the other rank disagrees with, a peer that dies.
 * Each rank is a child process that reports through its exit status, as in test_comm.c.
 * The nccl backend's share runs where there are GPUs or the CPU emulation of
 * tests/cuda_emu. The collectives of before are test_comm.c's; across nodes,
 * test_comm_mpi.c's.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common.h"
#include "helpers.h"
#include "tiers/cuda_probe.h"

TestSuite(comm_a2a, .timeout = 120);

static void unique_name(char *buf, size_t len)
{
    static atomic_uint n;
    snprintf(buf, len, "a%d-%u", (int)getpid(), atomic_fetch_add(&n, 1));
}

#define FAIL(code, ...)                                                                            \
    do {                                                                                           \
        fprintf(stderr, "rank %d: ", rank);                                                        \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        return (code);                                                                             \
    } while (0)

typedef int (*rank_fn)(int rank, int world, const char *name, void *arg);

/* fn as world child processes under a new name; status[r] gets each one's exit code (or
 * 128 + signal). */
static void run_ranks(int world, rank_fn fn, void *arg, int *status)
{
    char name[64];
    pid_t pids[COMM_MAX_RANKS];
    unique_name(name, sizeof(name));
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

static void expect_ranks_pass(int world, rank_fn fn, void *arg, const char *what)
{
    int status[COMM_MAX_RANKS];
    run_ranks(world, fn, arg, status);
    for (int r = 0; r < world; r++)
        cr_expect_eq(status[r], 0, "%s: rank %d exited %d", what, r, status[r]);
}

static struct comm *open_shm(int rank, int world, const char *name, size_t chunk, size_t pool,
                             unsigned op_timeout_ms, int *err)
{
    struct comm_opts o = {.backend = world == 1 && !name ? COMM_SELF : COMM_SHM, .rank = rank,
                          .world = world, .name = name, .timeout_ms = 20000,
                          .chunk_bytes = chunk, .pool_bytes = pool,
                          .op_timeout_ms = op_timeout_ms};
    struct comm *c = NULL;
    *err = comm_open(&o, &c);
    return c;
}

/* Element i of the block rank `from` sends to rank `to`: distinct for every triple. */
static float a2a_value(int from, int to, size_t i)
{
    return (float)((from * 131 + to * 17) % 1000) * 4096.0f + (float)(i % 4093);
}

static void post(struct comm_req *q, int res)
{
    completion_post(q->data, res);
}

struct a2a_arg {
    size_t count, chunk;
    bool pooled;
};

static int alltoall_ranks(int rank, int world, const char *name, void *argp)
{
    const struct a2a_arg *a = argp;
    size_t n = a->count, all = n * (size_t)world, bytes = all * sizeof(float);
    int err;
    struct comm *c = open_shm(rank, world, name, a->chunk, a->pooled ? 2 * bytes + 8192 : 0, 0, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float *send = a->pooled ? comm_alloc(c, bytes, &err) : malloc(bytes);
    float *recv = a->pooled ? comm_alloc(c, bytes, &err) : malloc(bytes);
    if (!send || !recv) FAIL(11, "out of memory");
    for (int d = 0; d < world; d++)
        for (size_t i = 0; i < n; i++)
            send[(size_t)d * n + i] = a2a_value(rank, d, i);
    memset(recv, 0xff, bytes);
    if ((err = comm_alltoall(c, send, recv, n, COMM_F32))) FAIL(12, "alltoall: %s", zinf_strerror(err));
    for (int q = 0; q < world; q++)
        for (size_t i = 0; i < n; i++)
            if (recv[(size_t)q * n + i] != a2a_value(q, rank, i))
                FAIL(13, "alltoall of %zu: block %d element %zu is %g, not %g", n, q, i,
                     recv[(size_t)q * n + i], a2a_value(q, rank, i));
    /* Bytes, a count no float divides; asynchronously, twice in a row. */
    size_t nb = 3 * n + 1;
    unsigned char *bs = malloc(nb * (size_t)world), *br = malloc(nb * (size_t)world),
                  *br2 = malloc(nb * (size_t)world);
    if (!bs || !br || !br2) FAIL(14, "out of memory");
    for (int d = 0; d < world; d++)
        for (size_t i = 0; i < nb; i++)
            bs[(size_t)d * nb + i] = (unsigned char)(rank * 59 + d * 13 + i * 7);
    struct completion w = COMPLETION_INIT;
    struct comm_req q1 = {.op = COMM_ALLTOALL, .dtype = COMM_BYTE, .send = bs, .recv = br,
                          .count = nb, .cb = post, .data = &w};
    struct comm_req q2 = q1;
    q2.recv = br2;
    if ((err = comm_submit(c, &q1)) == 0) err = comm_run(c, &q2);
    if (!err) err = completion_wait(&w);
    if (err) FAIL(15, "alltoall of bytes: %s", zinf_strerror(err));
    for (int p = 0; p < world; p++)
        for (size_t i = 0; i < nb; i++)
            if (br[(size_t)p * nb + i] != (unsigned char)(p * 59 + rank * 13 + i * 7) ||
                br2[(size_t)p * nb + i] != br[(size_t)p * nb + i])
                FAIL(16, "alltoall of bytes: block %d byte %zu", p, i);
    struct comm_stats st;
    comm_get_stats(c, &st);
    uint64_t want = (uint64_t)bytes + 2 * (uint64_t)nb * (uint64_t)world;
    if (st.ops != 3 || st.bytes_in != want || st.bytes_out != want)
        FAIL(17, "stats: %llu ops, %llu bytes in, %llu out; not 3, %llu", (unsigned long long)st.ops,
             (unsigned long long)st.bytes_in, (unsigned long long)st.bytes_out,
             (unsigned long long)want);
    if (a->pooled && world > 1 && st.pooled_ops == 0) FAIL(18, "no alltoall read the pools");
    if (!a->pooled) {
        free(send);
        free(recv);
    }
    free(bs);
    free(br);
    free(br2);
    comm_close(c);
    return 0;
}

/* Odd counts: one element, a few, and more than the staging areas' chunk (64 KiB). */
Test(comm_a2a, alltoall_delivers_every_block_at_1_to_4_ranks)
{
    static const size_t counts[] = {1, 7, 1000003};
    for (int world = 1; world <= 4; world++)
        for (size_t k = 0; k < 3; k++) {
            struct a2a_arg a = {.count = counts[k], .chunk = 64 * KiB};
            char what[64];
            snprintf(what, sizeof(what), "alltoall of %zu at %d ranks", counts[k], world);
            expect_ranks_pass(world, alltoall_ranks, &a, what);
        }
}

Test(comm_a2a, alltoall_reads_the_pools_in_place)
{
    struct a2a_arg a = {.count = 100003, .chunk = 64 * KiB, .pooled = true};
    expect_ranks_pass(3, alltoall_ranks, &a, "pooled alltoall at 3 ranks");
}

/* The self backend: a copy of the one block. */
Test(comm_a2a, alltoall_of_one_rank_on_the_self_backend)
{
    struct a2a_arg a = {.count = 1000, .chunk = 0};
    cr_assert_eq(alltoall_ranks(0, 1, NULL, &a), 0);
}
