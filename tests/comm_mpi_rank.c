/*
 * comm_mpi_rank.c - one rank of a job that mpirun starts, for test_comm_mpi: it opens a shm
 * communicator with comm_opts.mpi (no name, no secret: rank 0 makes them) and runs a fixed
 * pseudo-random sequence of every collective (odd counts, acc and not, in place and not,
 * buffers from the pool or not, several roots), checking each result bitwise against the
 * rank-order chain computed here, then alltoall, a ring of sendrecv and pairs of sends and
 * receives (within and across nodes), and the node layout in its stats. It says "rank R ok".
 *
 *   comm_mpi_rank check       the sequence
 *   comm_mpi_rank die R       rank R kills itself (SIGKILL) after a few operations
 *   comm_mpi_rank exit R      rank R exits (status 3, communicator open) after a few
 *   comm_mpi_rank stop R      rank R stops itself (SIGSTOP) after a few; the others' operations
 *                             time out (ZINF_COMM_OP_TIMEOUT_MS) and the job is aborted
 *   comm_mpi_rank stop-node R as stop, but only the ranks of R's node have that deadline (the
 *                             others four times it): a peer of R's node times out first
 *   comm_mpi_rank longname    a name that leaves no room for the nodes' suffix (-EINVAL)
 *   comm_mpi_rank world       every rank claims a world one larger than mpirun's (-EPROTO)
 *
 * Not a place for timing: bench/ measures.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common.h"
#include "zinf.h"

/* Operations per check; under AddressSanitizer (the sanitizers' leg) a third of them, the
 * same mix of kinds and sizes (the leg's minutes). */
#if defined(__SANITIZE_ADDRESS__)
#define OPS 16
#else
#define OPS 48
#endif
#define POOL_BYTES ((size_t)24 << 20)

static int rank, world;

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        fprintf(stderr, "rank %d: ", rank);                                                        \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        exit(1);                                                                                   \
    } while (0)

static uint64_t mix(uint64_t x)
{
    x ^= x >> 31;
    x *= 0x7fb5d329728ea185ull;
    x ^= x >> 27;
    x *= 0x81dadef4bc2dd44dull;
    return x ^ (x >> 33);
}

/* Rank q's element i of operation op: magnitudes 2^-10 to 2^10, so that the order of a sum
 * shows in its bits. */
static float value(int q, int op, size_t i)
{
    uint64_t h = mix(((uint64_t)op << 48) ^ ((uint64_t)q << 40) ^ i);
    return ldexpf((float)((int)(h % 20001) - 10000), (int)((h >> 20) % 21) - 20);
}

/* A rank's initial recv for acc: the same on every rank for allreduce (q = -1). */
static float init_value(int q, int op, size_t i)
{
    return value(1000 + q, op, i);
}

struct bufs {
    struct comm *c;
    void *send, *recv;
    bool pooled;
};

static void *get(struct comm *c, size_t bytes, bool pooled)
{
    int err = 0;
    void *p = pooled ? comm_alloc(c, bytes, &err) : malloc(bytes);
    if (!p) FAIL("%zu bytes (pooled %d): %s", bytes, pooled, zinf_strerror(err ? err : -ENOMEM));
    return p;
}

static void put(struct comm *c, void *p, bool pooled)
{
    if (pooled) {
        if (comm_free(c, p)) FAIL("comm_free");
    } else {
        free(p);
    }
}

static void same(const float *got, const float *want, size_t n, const char *what, int op)
{
    if (memcmp(got, want, n * sizeof(float)) == 0) return;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)))
            FAIL("operation %d (%s): element %zu of %zu is %a, the chain gives %a", op, what, i,
                 n, (double)got[i], (double)want[i]);
}

static void check(struct comm *c)
{
    uint64_t seq = 0x5eed;
    static const size_t counts[] = {1, 7, 1000, 4099, 65537, 1000003};
    for (int op = 0; op < OPS; op++) {
        seq = mix(seq + (uint64_t)op);
        enum comm_op kind = (enum comm_op)(seq % 5);
        size_t count = counts[(seq >> 8) % ARRAY_SIZE(counts)];
        if (count == 1000003 && op % 3) count = 65537; /* keep the largest to a few */
        bool acc = (seq >> 16) & 1;
        int root = (int)((seq >> 24) % (uint64_t)world);
        /* Each rank's own choice: in place, and its buffers from the pool. */
        uint64_t mine = mix(seq ^ (uint64_t)(rank + 1) * 0x9e3779b97f4a7c15ull);
        bool in_place = (mine & 1) && !acc;
        size_t esz = sizeof(float), all = count * (size_t)world;
        size_t in = kind == COMM_REDUCE_SCATTER ? all : count,
               out = kind == COMM_ALLGATHER ? all : count;
        bool pooled = (mine >> 1) & 1 && (in + out) * esz <= POOL_BYTES / 2;
        float *send, *recv, *want;
        struct comm_req q = {.op = kind, .dtype = COMM_F32, .count = count, .root = root};
        int r;
        switch (kind) {
        case COMM_ALLREDUCE:
            recv = get(c, count * esz, pooled);
            send = in_place ? recv : get(c, count * esz, pooled);
            want = malloc(count * esz);
            for (size_t i = 0; i < count; i++) {
                send[i] = value(rank, op, i);
                float a = acc ? init_value(-1, op, i) + value(0, op, i) : value(0, op, i);
                for (int p = 1; p < world; p++)
                    a += value(p, op, i);
                want[i] = a;
                if (acc) recv[i] = init_value(-1, op, i);
            }
            q.send = send, q.recv = recv, q.acc = acc;
            if ((r = comm_run(c, &q))) FAIL("allreduce %d: %s", op, zinf_strerror(r));
            same(recv, want, count, "allreduce", op);
            break;
        case COMM_REDUCE_SCATTER:
            send = get(c, all * esz, pooled);
            recv = in_place ? send + (size_t)rank * count : get(c, count * esz, pooled);
            want = malloc(count * esz);
            for (size_t i = 0; i < all; i++)
                send[i] = value(rank, op, i);
            for (size_t i = 0; i < count; i++) {
                size_t at = (size_t)rank * count + i;
                float a = acc ? init_value(rank, op, i) + value(0, op, at) : value(0, op, at);
                for (int p = 1; p < world; p++)
                    a += value(p, op, at);
                want[i] = a;
                if (acc) recv[i] = init_value(rank, op, i);
            }
            q.send = send, q.recv = recv, q.acc = acc;
            if ((r = comm_run(c, &q))) FAIL("reduce_scatter %d: %s", op, zinf_strerror(r));
            same(recv, want, count, "reduce_scatter", op);
            if (in_place) recv = NULL;
            break;
        case COMM_ALLGATHER:
            recv = get(c, all * esz, pooled);
            send = in_place ? recv + (size_t)rank * count : get(c, count * esz, pooled);
            want = malloc(all * esz);
            for (size_t i = 0; i < count; i++)
                send[i] = value(rank, op, i);
            for (int p = 0; p < world; p++)
                for (size_t i = 0; i < count; i++)
                    want[(size_t)p * count + i] = value(p, op, i);
            q.send = send, q.recv = recv;
            if ((r = comm_run(c, &q))) FAIL("allgather %d: %s", op, zinf_strerror(r));
            same(recv, want, all, "allgather", op);
            if (in_place) send = NULL;
            break;
        case COMM_BROADCAST:
            recv = get(c, count * esz, pooled);
            send = NULL;
            want = malloc(count * esz);
            for (size_t i = 0; i < count; i++) {
                want[i] = value(root, op, i);
                recv[i] = rank == root ? want[i] : -1.0f;
            }
            q.recv = recv;
            if ((r = comm_run(c, &q))) FAIL("broadcast %d from %d: %s", op, root, zinf_strerror(r));
            same(recv, want, count, "broadcast", op);
            break;
        default:
            if ((r = comm_barrier(c))) FAIL("barrier %d: %s", op, zinf_strerror(r));
            continue;
        }
        if (kind == COMM_ALLREDUCE && in_place) send = NULL;
        if (send) put(c, send, pooled);
        if (recv) put(c, recv, pooled);
        free(want);
    }
    /* alltoall: rank r's recv block q is rank q's block r, within and across nodes. */
    static const size_t a2a_counts[] = {1, 7, 65537};
    for (size_t k = 0; k < ARRAY_SIZE(a2a_counts); k++) {
        size_t n = a2a_counts[k], all = n * (size_t)world;
        float *s = malloc(all * sizeof(float)), *r = malloc(all * sizeof(float));
        if (!s || !r) FAIL("out of memory");
        for (size_t i = 0; i < all; i++)
            s[i] = value(rank, 500 + (int)(i / n), i % n);
        if (comm_alltoall(c, s, r, n, COMM_F32)) FAIL("alltoall of %zu", n);
        for (size_t i = 0; i < all; i++)
            if (memcmp(&r[i], &(float){value((int)(i / n), 500 + rank, i % n)}, sizeof(float)))
                FAIL("alltoall of %zu: block %zu element %zu", n, i / n, i % n);
        free(s);
        free(r);
    }
    /* Point-to-point: a ring shift by sendrecv (crossing nodes where ranks per node < world),
     * then pairs (0, 1), (2, 3) in opposite orders, while an odd rank out goes on. */
    size_t pn = 300007;
    float *ps = malloc(pn * sizeof(float)), *pr = malloc(pn * sizeof(float));
    if (!ps || !pr) FAIL("out of memory");
    int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    for (size_t i = 0; i < pn; i++)
        ps[i] = value(rank, 600, i);
    if (world > 1) {
        if (comm_sendrecv(c, ps, next, pr, prev, pn, COMM_F32)) FAIL("ring sendrecv");
        for (size_t i = 0; i < pn; i++)
            if (memcmp(&pr[i], &(float){value(prev, 600, i)}, sizeof(float)))
                FAIL("ring sendrecv: element %zu", i);
    }
    int mate = rank ^ 1, e = 0;
    if (mate < world) {
        if (rank % 2 == 0) {
            e = comm_send(c, ps, pn, COMM_F32, mate);
            if (!e) e = comm_recv(c, pr, pn, COMM_F32, mate);
        } else {
            e = comm_recv(c, pr, pn, COMM_F32, mate);
            if (!e) e = comm_send(c, ps, pn, COMM_F32, mate);
        }
        if (e) FAIL("send and recv with rank %d: %s", mate, zinf_strerror(e));
        for (size_t i = 0; i < pn; i++)
            if (memcmp(&pr[i], &(float){value(mate, 600, i)}, sizeof(float)))
                FAIL("recv from rank %d: element %zu", mate, i);
    }
    free(ps);
    free(pr);
    /* Bytes too: a count no float divides. */
    char gb[3 * COMM_MAX_RANKS], mb[3] = {(char)rank, 'x', (char)(rank * 7)};
    if (comm_allgather(c, mb, gb, 3, COMM_BYTE)) FAIL("allgather of bytes");
    for (int p = 0; p < world; p++)
        if (gb[3 * p] != (char)p || gb[3 * p + 1] != 'x' || gb[3 * p + 2] != (char)(p * 7))
            FAIL("allgather of bytes: rank %d's are wrong", p);
}

int main(int argc, char **argv)
{
    const char *rs = getenv("OMPI_COMM_WORLD_RANK"), *ws = getenv("OMPI_COMM_WORLD_SIZE");
    if (!rs || !ws || argc < 2) {
        fprintf(stderr, "usage: mpirun ... comm_mpi_rank check|die R|exit R|stop R|stop-node R|longname|world\n");
        return 2;
    }
    rank = atoi(rs), world = atoi(ws);
    const char *mode = argv[1];
    int victim = argc > 2 ? atoi(argv[2]) : -1;
    char why[300] = "";
    struct comm_opts o = {.backend = COMM_SHM, .rank = rank, .world = world, .mpi = true,
                          .timeout_ms = 20000, .why = why,
                          .why_len = sizeof(why), .pool_bytes = POOL_BYTES,
                          .chunk_bytes = (size_t)256 << 10};
    const char *op_ms = getenv("ZINF_COMM_OP_TIMEOUT_MS");
    o.op_timeout_ms = op_ms ? (unsigned)atoi(op_ms) : 60000;
    const char *L = getenv("ZINF_COMM_RANKS_PER_NODE");
    int per = L && *L ? atoi(L) : world; /* the tests run on one machine */
    if (!strcmp(mode, "stop-node") && per > 0 && rank / per != victim / per) o.op_timeout_ms *= 4;
    char longname[COMM_NAME_BYTES];
    memset(longname, 'a', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = 0;
    if (!strcmp(mode, "longname")) o.name = longname;
    if (!strcmp(mode, "world")) o.world = world + 1 > COMM_MAX_RANKS ? world : world + 1;
    struct comm *c;
    int r = comm_open(&o, &c);
    if (r) {
        printf("rank %d: comm_open: %s: %s\n", rank, zinf_strerror(r), why);
        return 1;
    }
    struct comm_stats st;
    comm_get_stats(c, &st);
    if (st.nodes != (world + per - 1) / per || st.node != rank / per)
        FAIL("node %d of %d, not %d of %d", st.node, st.nodes, rank / per,
             (world + per - 1) / per);
    if (!strcmp(mode, "die") || !strcmp(mode, "exit") || !strcmp(mode, "stop") ||
        !strcmp(mode, "stop-node")) {
        float a[1000], b[1000];
        for (int i = 0; i < 1000; i++)
            a[i] = (float)i;
        for (int k = 0; k < 3; k++)
            if ((r = comm_allreduce(c, a, b, 1000, COMM_F32))) FAIL("allreduce: %s", zinf_strerror(r));
        if (rank == victim) {
            fflush(NULL);
            if (!strcmp(mode, "die")) raise(SIGKILL);
            if (!strncmp(mode, "stop", 4)) raise(SIGSTOP);
            exit(3);
        }
        for (;;) /* until the job ends: these cannot complete */
            if ((r = comm_allreduce(c, a, b, 1000, COMM_F32))) FAIL("allreduce: %s", zinf_strerror(r));
    }
    check(c);
    comm_get_stats(c, &st);
    /* One machine: nothing crossed between physical nodes, whatever the logical ones. */
    if (st.net_bytes_out || st.net_bytes_in || st.net_ops)
        FAIL("%llu bytes out, %llu in over the network on one machine",
             (unsigned long long)st.net_bytes_out, (unsigned long long)st.net_bytes_in);
    comm_close(c);
    printf("rank %d ok (%llu of %llu operations through the pools in place)\n", rank,
           (unsigned long long)st.pooled_ops, (unsigned long long)st.ops);
    return 0;
}
