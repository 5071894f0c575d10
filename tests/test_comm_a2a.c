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

/* ---- point-to-point ------------------------------------------------------------------ */

#define BIG 1000003 /* floats: many times a channel's ring */

/* Element i of message k from rank `from`. */
static float msg_value(int from, int k, size_t i)
{
    return (float)(from * 1000 + k) * 8192.0f + (float)(i % 8191);
}

static int check_msg(const float *buf, size_t n, int from, int k)
{
    for (size_t i = 0; i < n; i++)
        if (buf[i] != msg_value(from, k, i)) return (int)(i < INT32_MAX ? i : INT32_MAX) + 1;
    return 0;
}

static void fill_msg(float *buf, size_t n, int from, int k)
{
    for (size_t i = 0; i < n; i++)
        buf[i] = msg_value(from, k, i);
}

/* A ring shift by sendrecv (to rank + 1, from rank - 1), large and small, then plain sends
 * and receives in opposite orders between pairs (even ranks send first, odd ones receive
 * first), then a pairwise exchange whose two halves each rank submits without waiting,
 * then ranks 0 and 1 talk while the others do nothing, and last a barrier of all. */
static int patterns(int rank, int world, const char *name, void *arg)
{
    (void)arg;
    int err;
    struct comm *c = open_shm(rank, world, name, 64 * KiB, 0, 0, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float *s = malloc(BIG * sizeof(float)), *r = malloc(BIG * sizeof(float));
    if (!s || !r) FAIL(11, "out of memory");
    int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    static const size_t sizes[] = {0, 1, 7, BIG};
    for (int k = 0; k < 4; k++) {
        fill_msg(s, sizes[k], rank, k);
        if ((err = comm_sendrecv(c, s, next, r, prev, sizes[k], COMM_F32)))
            FAIL(12, "ring %d: %s", k, zinf_strerror(err));
        if ((err = check_msg(r, sizes[k], prev, k))) FAIL(13, "ring %d: element %d", k, err - 1);
    }
    /* Pairs (0, 1), (2, 3): opposite orders. An odd rank out stays out. */
    int mate = rank ^ 1;
    if (mate < world) {
        fill_msg(s, BIG, rank, 10);
        if (rank % 2 == 0) {
            err = comm_send(c, s, BIG, COMM_F32, mate);
            if (!err) err = comm_recv(c, r, BIG, COMM_F32, mate);
        } else {
            err = comm_recv(c, r, BIG, COMM_F32, mate);
            if (!err) err = comm_send(c, s, BIG, COMM_F32, mate);
        }
        if (err) FAIL(14, "send and recv in opposite orders: %s", zinf_strerror(err));
        if ((err = check_msg(r, BIG, mate, 10))) FAIL(15, "opposite orders: element %d", err - 1);
        /* The exchange, both halves in one operation, submitted without waiting; then a
         * second one of bytes behind it. */
        struct completion w = COMPLETION_INIT;
        fill_msg(s, BIG, rank, 11);
        struct comm_req q = {.op = COMM_SENDRECV, .dtype = COMM_F32, .send = s, .recv = r,
                             .count = BIG, .peer = mate, .recv_peer = mate, .cb = post, .data = &w};
        unsigned char bs[5] = {(unsigned char)rank, 1, 2, 3, 4}, br[5] = {0};
        if ((err = comm_submit(c, &q))) FAIL(16, "submit: %s", zinf_strerror(err));
        if ((err = comm_sendrecv(c, bs, mate, br, mate, 5, COMM_BYTE)))
            FAIL(17, "exchange of bytes: %s", zinf_strerror(err));
        if ((err = completion_wait(&w))) FAIL(18, "exchange: %s", zinf_strerror(err));
        if ((err = check_msg(r, BIG, mate, 11))) FAIL(19, "exchange: element %d", err - 1);
        if (br[0] != (unsigned char)mate || br[4] != 4) FAIL(20, "exchange of bytes");
    }
    /* Ranks 0 and 1 only: twenty messages each way, the others go straight on. */
    if (rank < 2) {
        for (int k = 0; k < 20; k++) {
            fill_msg(s, 1000 + (size_t)k, rank, 20 + k);
            if ((err = comm_sendrecv(c, s, 1 - rank, r, 1 - rank, 1000 + (size_t)k, COMM_F32)))
                FAIL(21, "0 and 1 alone, %d: %s", k, zinf_strerror(err));
            if ((err = check_msg(r, 1000 + (size_t)k, 1 - rank, 20 + k)))
                FAIL(22, "0 and 1 alone, %d: element %d", k, err - 1);
        }
    }
    if ((err = comm_barrier(c))) FAIL(23, "barrier: %s", zinf_strerror(err));
    struct comm_stats st;
    comm_get_stats(c, &st);
    if (st.bytes_in == 0 || st.bytes_out == 0) FAIL(24, "no bytes in the stats");
    free(s);
    free(r);
    comm_close(c);
    return 0;
}

Test(comm_a2a, ring_exchanges_and_bystanders_at_2_3_and_4_ranks)
{
    expect_ranks_pass(2, patterns, NULL, "patterns at 2 ranks");
    expect_ranks_pass(3, patterns, NULL, "patterns at 3 ranks");
    expect_ranks_pass(4, patterns, NULL, "patterns at 4 ranks");
}

/* A pipeline of S stages and M micro-batches on the 1F1B schedule (as Megatron-LM runs it):
 * warm-up forwards, then alternating a forward and a backward, whose send of one and receive
 * of the other are one sendrecv, then cool-down backwards. Stage s's forward adds s + 1, the
 * last stage's loss gradient is twice its output, and a backward adds s + 1; every stage
 * checks each activation and gradient it receives, and stage 0 the gradients it ends with. */
#define STAGES 3
#define MICRO 5
#define ACT 300007

static float x0(int mb, size_t i)
{
    return (float)((size_t)(mb * 7) + i % 1009);
}

static float act_in(int s, int mb, size_t i) /* what stage s receives for mb */
{
    float x = x0(mb, i);
    for (int t = 0; t < s; t++)
        x += (float)(t + 1);
    return x;
}

static float grad_in(int s, int mb, size_t i) /* the gradient stage s receives for mb */
{
    float g = 2.0f * act_in(STAGES, mb, i);
    for (int t = STAGES - 1; t > s; t--)
        g += (float)(t + 1);
    return g;
}

static int pipeline(int rank, int world, const char *name, void *arg)
{
    (void)arg;
    int err, s = rank, S = world;
    struct comm *c = open_shm(rank, world, name, 64 * KiB, 0, 0, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float *x = malloc(ACT * sizeof(float)), *y = malloc(ACT * sizeof(float)),
          *g = malloc(ACT * sizeof(float)), *dx = malloc(ACT * sizeof(float));
    if (!x || !y || !g || !dx) FAIL(11, "out of memory");
    int fwd = 0, bwd = 0; /* the next micro-batch of each direction */
    int warm = S - s - 1 < MICRO ? S - s - 1 : MICRO, steady = MICRO - warm;
#define CHECK(buf, fn, mb, what)                                                                   \
    for (size_t i = 0; i < ACT; i++)                                                               \
        if ((buf)[i] != fn(s, mb, i)) FAIL(12, "%s of micro-batch %d: element %zu", what, mb, i);
    /* forward of the micro-batch in x into y */
#define FORWARD()                                                                                  \
    for (size_t i = 0; i < ACT; i++)                                                               \
        y[i] = x[i] + (float)(s + 1);
#define BACKWARD()                                                                                 \
    for (size_t i = 0; i < ACT; i++)                                                               \
        dx[i] = g[i] + (float)(s + 1);
#define LOSS()                                                                                     \
    for (size_t i = 0; i < ACT; i++)                                                               \
        g[i] = 2.0f * y[i];
#define INPUT(mb)                                                                                  \
    for (size_t i = 0; i < ACT; i++)                                                               \
        x[i] = x0(mb, i);
    for (int k = 0; k < warm; k++, fwd++) {
        if (s == 0) {
            INPUT(fwd);
        } else {
            if ((err = comm_recv(c, x, ACT, COMM_F32, s - 1))) FAIL(13, "recv forward: %s", zinf_strerror(err));
            CHECK(x, act_in, fwd, "activation");
        }
        FORWARD();
        if ((err = comm_send(c, y, ACT, COMM_F32, s + 1))) FAIL(14, "send forward: %s", zinf_strerror(err));
    }
    if (steady > 0) {
        if (s == 0) {
            INPUT(fwd);
        } else {
            if ((err = comm_recv(c, x, ACT, COMM_F32, s - 1))) FAIL(15, "recv forward: %s", zinf_strerror(err));
            CHECK(x, act_in, fwd, "activation");
        }
    }
    for (int k = 0; k < steady; k++) {
        FORWARD();
        fwd++;
        if (s == S - 1) {
            LOSS();
        } else {
            if ((err = comm_sendrecv(c, y, s + 1, g, s + 1, ACT, COMM_F32)))
                FAIL(16, "send forward, recv backward: %s", zinf_strerror(err));
            CHECK(g, grad_in, bwd, "gradient");
        }
        BACKWARD();
        for (size_t i = 0; s == 0 && i < ACT; i++)
            if (dx[i] != grad_in(0, bwd, i) + 1.0f)
                FAIL(22, "input gradient of micro-batch %d: element %zu", bwd, i);
        bwd++;
        if (k == steady - 1) {
            if (s > 0 && (err = comm_send(c, dx, ACT, COMM_F32, s - 1)))
                FAIL(17, "send backward: %s", zinf_strerror(err));
        } else if (s > 0) {
            if ((err = comm_sendrecv(c, dx, s - 1, x, s - 1, ACT, COMM_F32)))
                FAIL(18, "send backward, recv forward: %s", zinf_strerror(err));
            CHECK(x, act_in, fwd, "activation");
        } else {
            INPUT(fwd);
        }
    }
    for (int k = 0; k < warm; k++, bwd++) {
        if ((err = comm_recv(c, g, ACT, COMM_F32, s + 1))) FAIL(19, "recv backward: %s", zinf_strerror(err));
        CHECK(g, grad_in, bwd, "gradient");
        BACKWARD();
        if (s > 0 && (err = comm_send(c, dx, ACT, COMM_F32, s - 1)))
            FAIL(20, "send backward: %s", zinf_strerror(err));
    }
    if (fwd != MICRO || bwd != MICRO) FAIL(21, "%d forwards and %d backwards", fwd, bwd);
    free(x);
    free(y);
    free(g);
    free(dx);
    comm_close(c);
    return 0;
}

Test(comm_a2a, a_3_stage_1f1b_pipeline_of_5_micro_batches)
{
    expect_ranks_pass(STAGES, pipeline, NULL, "1F1B");
}

/* ---- faults -------------------------------------------------------------------------- */

static int never_called;
static void never_cb(struct comm_req *q, int res)
{
    (void)q, (void)res;
    never_called++;
}

/* Bad peers and sizes are refused at submission, on the self backend and on shm. */
static int bad_requests(int rank, int world, const char *name, void *arg)
{
    (void)arg;
    int err;
    struct comm *c = open_shm(rank, world, name, 64 * KiB, 0, 0, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float a[8] = {0}, b[64] = {0};
    int other = world > 1 ? 1 - rank : 0;
    struct {
        struct comm_req q;
        const char *what;
    } bad[] = {
        {{.op = COMM_SEND, .dtype = COMM_F32, .send = a, .count = 1, .peer = rank}, "send to itself"},
        {{.op = COMM_RECV, .dtype = COMM_F32, .recv = b, .count = 1, .peer = rank}, "recv from itself"},
        {{.op = COMM_SEND, .dtype = COMM_F32, .send = a, .count = 1, .peer = world}, "peer = world"},
        {{.op = COMM_RECV, .dtype = COMM_F32, .recv = b, .count = 1, .peer = -1}, "peer -1"},
        {{.op = COMM_SENDRECV, .dtype = COMM_F32, .send = a, .recv = b, .count = 1, .peer = other,
          .recv_peer = 64}, "recv_peer out of range"},
        {{.op = COMM_SENDRECV, .dtype = COMM_F32, .send = a, .recv = a + 1, .count = 2,
          .peer = other, .recv_peer = other}, "sendrecv overlapping"},
        {{.op = COMM_SEND, .dtype = COMM_F32, .send = NULL, .count = 1, .peer = other}, "no buffer"},
        {{.op = COMM_SEND, .dtype = COMM_F32, .send = a, .count = SIZE_MAX / 2, .peer = other},
         "send count overflow"},
        {{.op = COMM_ALLTOALL, .dtype = COMM_F32, .send = a, .recv = b, .count = SIZE_MAX / 4 / (size_t)world + 1},
         "alltoall count overflow"},
        {{.op = COMM_ALLTOALL, .dtype = COMM_F32, .send = b, .recv = b, .count = 4}, "alltoall in place"},
        {{.op = COMM_ALLTOALL, .dtype = COMM_F32, .send = b, .recv = b + 1, .count = 4},
         "alltoall overlapping"},
        {{.op = COMM_ALLTOALL, .dtype = COMM_F32, .send = a, .recv = b, .count = 1, .acc = true},
         "alltoall adding"},
    };
    for (size_t i = 0; i < ARRAY_SIZE(bad); i++) {
        if (world == 1 && bad[i].q.op != COMM_ALLTOALL && bad[i].q.peer == 0 && i >= 4) continue;
        bad[i].q.cb = never_cb;
        if ((err = comm_submit(c, &bad[i].q)) != -EINVAL)
            FAIL(11, "%s: %s, not -EINVAL", bad[i].what, zinf_strerror(err));
    }
    if (never_called) FAIL(12, "a refused request called back");
    /* Nothing was queued: the communicator works on. */
    if ((err = comm_alltoall(c, a, b, 1, COMM_F32))) FAIL(13, "then: %s", zinf_strerror(err));
    comm_close(c);
    return 0;
}

Test(comm_a2a, bad_peers_counts_and_overlaps_are_refused)
{
    cr_assert_eq(bad_requests(0, 1, NULL, NULL), 0, "on the self backend");
    expect_ranks_pass(2, bad_requests, NULL, "on shm");
}

/* Rank 1 receives 200 floats where rank 0 sends 100: rank 1's receive answers -EPROTO,
 * naming both, and the communicator has failed for both. Then an alltoall of other sizes. */
static int mismatch(int rank, int world, const char *name, void *arg)
{
    int err, a2a = *(int *)arg;
    struct comm *c = open_shm(rank, world, name, 64 * KiB, 0, 0, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    static float buf[4 * 200];
    if (a2a) {
        err = comm_alltoall(c, buf, buf + 2 * 200, rank ? 200 : 100, COMM_F32);
        if (err != -EPROTO && err != -ECONNABORTED) FAIL(11, "alltoall of other sizes: %s", zinf_strerror(err));
    } else if (rank == 0) {
        err = comm_send(c, buf, 100, COMM_F32, 1);
        if (err && err != -ECONNABORTED) FAIL(12, "send: %s", zinf_strerror(err));
    } else {
        err = comm_recv(c, buf, 200, COMM_F32, 0);
        if (err != -EPROTO) FAIL(13, "recv of another size: %s, not -EPROTO", zinf_strerror(err));
    }
    if ((err = comm_barrier(c)) != -ECONNABORTED) FAIL(14, "then: %s", zinf_strerror(err));
    comm_close(c);
    return 0;
}

Test(comm_a2a, ranks_that_disagree_on_a_size_fail_together)
{
    int a2a = 0;
    expect_ranks_pass(2, mismatch, &a2a, "send and recv of other sizes");
    a2a = 1;
    expect_ranks_pass(2, mismatch, &a2a, "alltoall of other sizes");
}

/* A peer that dies: the rank waiting to receive from it, and the rank whose send fills the
 * ring while its receiver dies, fail within seconds; a peer that closes its communicator
 * with a receive still owed to it fails its sender. */
static int peer_dies(int rank, int world, const char *name, void *arg)
{
    int err, how = *(int *)arg;
    (void)world;
    struct comm *c = open_shm(rank, world, name, 64 * KiB, 0, 0, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    float *buf = calloc(BIG, sizeof(float));
    if (!buf) FAIL(11, "out of memory");
    if ((err = comm_sendrecv(c, buf, 1 - rank, buf + BIG / 2, 1 - rank, 1000, COMM_F32)))
        FAIL(12, "first exchange: %s", zinf_strerror(err));
    int victim = how == 0 ? 0 : 1;
    if (rank == victim) {
        if (how == 2) {
            comm_close(c);
            free(buf);
            return 0;
        }
        raise(SIGKILL);
    }
    uint64_t t0 = now_ns();
    err = how == 0 ? comm_recv(c, buf, BIG, COMM_F32, 0) : comm_send(c, buf, BIG, COMM_F32, 1);
    if (err != -ECONNABORTED) FAIL(13, "with the peer gone: %s", zinf_strerror(err));
    if (now_ns() - t0 > 5ull * 1000000000) FAIL(14, "seen after %llu ms", (unsigned long long)((now_ns() - t0) / 1000000));
    if ((err = comm_send(c, buf, 1, COMM_F32, 1 - rank)) != -ECONNABORTED)
        FAIL(15, "then: %s", zinf_strerror(err));
    free(buf);
    comm_close(c);
    return 0;
}

Test(comm_a2a, a_dead_or_departed_peer_fails_its_partner)
{
    int status[2];
    for (int how = 0; how < 3; how++) {
        run_ranks(2, peer_dies, &how, status);
        int victim = how == 0 ? 0 : 1;
        cr_expect_eq(status[1 - victim], 0, "case %d: the partner exited %d", how, status[1 - victim]);
        cr_expect_eq(status[victim], how == 2 ? 0 : 128 + SIGKILL, "case %d", how);
    }
}

/* A peer that is alive but never comes: the operation's deadline fails it, naming the
 * rank and what it is in. */
static int peer_late(int rank, int world, const char *name, void *arg)
{
    (void)arg;
    int err;
    struct comm *c = open_shm(rank, world, name, 64 * KiB, 0, 1000, &err);
    if (!c) FAIL(10, "comm_open: %s", zinf_strerror(err));
    if (rank == 1) {
        sleep(3); /* never receives; its barrier then finds the communicator failed */
        if ((err = comm_barrier(c)) != -ECONNABORTED) FAIL(11, "late rank: %s", zinf_strerror(err));
    } else {
        float *buf = calloc(BIG, sizeof(float));
        err = comm_send(c, buf, BIG, COMM_F32, 1);
        free(buf);
        if (err != -ETIMEDOUT) FAIL(12, "send to a rank that never receives: %s", zinf_strerror(err));
    }
    comm_close(c);
    return 0;
}

Test(comm_a2a, a_peer_that_never_comes_times_out_the_operation)
{
    expect_ranks_pass(2, peer_late, NULL, "late peer");
}

/* ---- the nccl backend (a GPU per rank, or the CPU emulation; skipped elsewhere) -------- */

#if ZINF_HAVE_NCCL
#include <cuda_runtime_api.h>

/* Whether world NCCL ranks can run here (asked in a child: CUDA does not survive a fork). */
static bool nccl_ranks_here(int world, int *per_rank_device, char *why, size_t len)
{
    struct cuda_probe_info pi;
    int n = test_cuda_probe_forked(&pi);
    if (n <= 0) {
        snprintf(why, len, "no usable GPU: %s", pi.reason);
        return false;
    }
    bool emulated = strncmp(pi.name, "EMU ", 4) == 0;
    *per_rank_device = emulated ? 0 : 1;
    snprintf(why, len, "%d GPU(s): NCCL runs one rank per GPU, and this needs %d", n, world);
    return emulated || n >= world;
}

static int nccl_p2p(int rank, int world, const char *name, void *argp)
{
    int per_rank_device = *(int *)argp, err;
    struct comm_opts o = {.backend = COMM_NCCL, .rank = rank, .world = world, .name = name,
                          .timeout_ms = 60000, .cuda_device = per_rank_device ? rank : 0};
    struct comm *c = NULL;
    if ((err = comm_open(&o, &c))) FAIL(10, "comm_open: %s", zinf_strerror(err));
    size_t n = 100003, all = n * (size_t)world, bytes = all * sizeof(float);
    float *hs = malloc(bytes), *hr = malloc(bytes), *ds = NULL, *dr = NULL;
    if (!hs || !hr || cudaMalloc((void **)&ds, bytes) != cudaSuccess ||
        cudaMalloc((void **)&dr, bytes) != cudaSuccess)
        FAIL(11, "out of memory");
    for (int d = 0; d < world; d++)
        for (size_t i = 0; i < n; i++)
            hs[(size_t)d * n + i] = a2a_value(rank, d, i);
    if (cudaMemcpy(ds, hs, bytes, cudaMemcpyHostToDevice) != cudaSuccess) FAIL(12, "copy in");
    if ((err = comm_alltoall(c, ds, dr, n, COMM_F32))) FAIL(13, "alltoall: %s", zinf_strerror(err));
    if (cudaMemcpy(hr, dr, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) FAIL(14, "copy out");
    for (int q = 0; q < world; q++)
        for (size_t i = 0; i < n; i++)
            if (hr[(size_t)q * n + i] != a2a_value(q, rank, i))
                FAIL(15, "alltoall: block %d element %zu", q, i);
    /* A ring shift by sendrecv, then pairs in opposite orders. */
    int next = (rank + 1) % world, prev = (rank + world - 1) % world, mate = rank ^ 1;
    fill_msg(hs, n, rank, 1);
    if (cudaMemcpy(ds, hs, n * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) FAIL(16, "copy in");
    if ((err = comm_sendrecv(c, ds, next, dr, prev, n, COMM_F32))) FAIL(17, "ring: %s", zinf_strerror(err));
    if (cudaMemcpy(hr, dr, n * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) FAIL(18, "copy out");
    if ((err = check_msg(hr, n, prev, 1))) FAIL(19, "ring: element %d", err - 1);
    if (mate < world) {
        if (rank % 2 == 0) {
            err = comm_send(c, ds, n, COMM_F32, mate);
            if (!err) err = comm_recv(c, dr, n, COMM_F32, mate);
        } else {
            err = comm_recv(c, dr, n, COMM_F32, mate);
            if (!err) err = comm_send(c, ds, n, COMM_F32, mate);
        }
        if (err) FAIL(20, "send and recv: %s", zinf_strerror(err));
        if (cudaMemcpy(hr, dr, n * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess)
            FAIL(21, "copy out");
        if ((err = check_msg(hr, n, mate, 1))) FAIL(22, "send and recv: element %d", err - 1);
    }
    struct comm_stats st;
    comm_get_stats(c, &st);
    if (st.bytes_in < bytes || st.bytes_out < bytes) FAIL(23, "stats");
    cudaFree(ds);
    cudaFree(dr);
    free(hs);
    free(hr);
    comm_close(c);
    return 0;
}

Test(comm_a2a, nccl_alltoall_and_point_to_point_at_2_and_3_ranks)
{
    char why[256];
    int dev;
    if (!nccl_ranks_here(2, &dev, why, sizeof(why))) cr_skip_test("%s", why);
    expect_ranks_pass(2, nccl_p2p, &dev, "nccl at 2 ranks");
    if (!nccl_ranks_here(3, &dev, why, sizeof(why))) cr_skip_test("%s", why);
    expect_ranks_pass(3, nccl_p2p, &dev, "nccl at 3 ranks");
}
#endif
