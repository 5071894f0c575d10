/*
 * comm_nccl_mpi_rank.c - one GPU rank of a job that mpirun starts: it opens an nccl
 * communicator with comm_opts.mpi (NCCL's unique id made by world rank 0 and broadcast over
 * MPI, every node's segment serving the barriers with a leaders' exchange), runs a fixed
 * pseudo-random sequence of every collective on device buffers (odd counts, in place and
 * not, several roots, barriers between), and checks each result against the sum computed
 * here. The values are small integers times one power of two per element, so that every
 * partial sum is exact in float32: the check is bitwise whatever order NCCL adds in. It
 * checks the node layout in its stats too, and says "rank R ok".
 *
 *   comm_nccl_mpi_rank check    the sequence
 *   comm_nccl_mpi_rank die R    rank R kills itself (SIGKILL) after a few operations; the
 *                               others wait in an NCCL collective until the job is ended
 *
 * Each rank takes the GPU of its local rank (OMPI_COMM_WORLD_LOCAL_RANK) modulo the GPUs
 * it sees. tests/cuda_emu/run.sh comm-mpi runs it on the CPU emulation of CUDA and NCCL. A
 * build without CUDA and NCCL has nothing to run: it says so and exits 77.
 *
 * Not a place for timing, nor for the shm backend across nodes (comm_mpi_rank.c).
 */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common.h"
#include "zinf.h"

#if ZINF_HAVE_CUDA && ZINF_HAVE_NCCL
#include <cuda_runtime_api.h>

#define OPS 40

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

/* Rank q's element i of operation op: an integer of -1000..1000 times 2^e, e (-8..8) the
 * same for every rank at that element. The sum of 64 ranks' needs 17 bits of mantissa at
 * most, so float32 holds it, and any partial sum, exactly. */
static float value(int q, int op, size_t i)
{
    uint64_t h = mix(((uint64_t)op << 48) ^ ((uint64_t)q << 40) ^ i);
    int e = (int)(mix(((uint64_t)op << 48) ^ i ^ 0xe) % 17) - 8;
    return ldexpf((float)((int)(h % 2001) - 1000), e);
}

static float sum_of(int op, size_t i)
{
    float a = 0;
    for (int p = 0; p < world; p++)
        a += value(p, op, i);
    return a;
}

static void *dev(size_t bytes)
{
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) FAIL("cudaMalloc of %zu bytes: %s", bytes, cudaGetErrorString(e));
    return p;
}

static void put(void *d, const void *h, size_t bytes)
{
    cudaError_t e = cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) FAIL("cudaMemcpy to the device: %s", cudaGetErrorString(e));
}

static void get(void *h, const void *d, size_t bytes)
{
    cudaError_t e = cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) FAIL("cudaMemcpy from the device: %s", cudaGetErrorString(e));
}

static void same(const float *got, const float *want, size_t n, const char *what, int op)
{
    if (memcmp(got, want, n * sizeof(float)) == 0) return;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)))
            FAIL("operation %d (%s): element %zu of %zu is %a, the sum is %a", op, what, i, n,
                 (double)got[i], (double)want[i]);
}

/* Runs the sequence; returns the number of collectives it submitted. */
static unsigned check(struct comm *c)
{
    uint64_t seq = 0x6e63636c;
    static const size_t counts[] = {1, 7, 1000, 4099, 65537, 300007};
    unsigned ops = 0;
    for (int op = 0; op < OPS; op++) {
        seq = mix(seq + (uint64_t)op);
        enum comm_op kind = (enum comm_op)(seq % 5);
        size_t count = counts[(seq >> 8) % ARRAY_SIZE(counts)];
        int root = (int)((seq >> 24) % (uint64_t)world);
        bool in_place = (mix(seq ^ 0x1b) & 1) != 0; /* the same on every rank */
        size_t esz = sizeof(float), all = count * (size_t)world;
        size_t in = kind == COMM_REDUCE_SCATTER ? all : count,
               out = kind == COMM_ALLGATHER ? all : count;
        float *h = malloc(MAX(in, out) * esz), *want = malloc(out * esz);
        if (!h || !want) FAIL("out of memory");
        float *dsend = NULL, *drecv = NULL;
        int r = 0;
        ops++;
        switch (kind) {
        case COMM_ALLREDUCE:
            drecv = dev(count * esz);
            dsend = in_place ? drecv : dev(count * esz);
            for (size_t i = 0; i < count; i++)
                h[i] = value(rank, op, i), want[i] = sum_of(op, i);
            put(dsend, h, count * esz);
            if ((r = comm_allreduce(c, dsend, drecv, count, COMM_F32)))
                FAIL("allreduce %d: %s", op, zinf_strerror(r));
            get(h, drecv, count * esz);
            same(h, want, count, "allreduce", op);
            break;
        case COMM_REDUCE_SCATTER:
            dsend = dev(all * esz);
            drecv = in_place ? dsend + (size_t)rank * count : dev(count * esz);
            for (size_t i = 0; i < all; i++)
                h[i] = value(rank, op, i);
            for (size_t i = 0; i < count; i++)
                want[i] = sum_of(op, (size_t)rank * count + i);
            put(dsend, h, all * esz);
            if ((r = comm_reduce_scatter(c, dsend, drecv, count, COMM_F32)))
                FAIL("reduce_scatter %d: %s", op, zinf_strerror(r));
            get(h, drecv, count * esz);
            same(h, want, count, "reduce_scatter", op);
            break;
        case COMM_ALLGATHER:
            drecv = dev(all * esz);
            dsend = in_place ? drecv + (size_t)rank * count : dev(count * esz);
            for (size_t i = 0; i < count; i++)
                h[i] = value(rank, op, i);
            for (int p = 0; p < world; p++)
                for (size_t i = 0; i < count; i++)
                    want[(size_t)p * count + i] = value(p, op, i);
            put(dsend, h, count * esz);
            if ((r = comm_allgather(c, dsend, drecv, count, COMM_F32)))
                FAIL("allgather %d: %s", op, zinf_strerror(r));
            get(h, drecv, all * esz);
            same(h, want, all, "allgather", op);
            break;
        case COMM_BROADCAST:
            drecv = dev(count * esz);
            for (size_t i = 0; i < count; i++) {
                want[i] = value(root, op, i);
                h[i] = rank == root ? want[i] : -1.0f;
            }
            put(drecv, h, count * esz);
            if ((r = comm_broadcast(c, drecv, count, COMM_F32, root)))
                FAIL("broadcast %d from %d: %s", op, root, zinf_strerror(r));
            get(h, drecv, count * esz);
            same(h, want, count, "broadcast", op);
            break;
        default:
            if ((r = comm_barrier(c))) FAIL("barrier %d: %s", op, zinf_strerror(r));
            break;
        }
        /* In place, one of the two pointers is inside the other's buffer. */
        if (kind == COMM_REDUCE_SCATTER) {
            cudaFree(dsend);
            if (!in_place) cudaFree(drecv);
        } else {
            cudaFree(drecv);
            if (dsend && !in_place) cudaFree(dsend);
        }
        free(h);
        free(want);
    }
    /* Bytes too: a count no float divides, gathered. */
    unsigned char mb[3] = {(unsigned char)rank, 'x', (unsigned char)(rank * 7)};
    unsigned char gb[3 * COMM_MAX_RANKS];
    unsigned char *ds = dev(3), *dr = dev(3 * (size_t)world);
    put(ds, mb, 3);
    int r = comm_allgather(c, ds, dr, 3, COMM_BYTE);
    if (r) FAIL("allgather of bytes: %s", zinf_strerror(r));
    get(gb, dr, 3 * (size_t)world);
    for (int p = 0; p < world; p++)
        if (gb[3 * p] != (unsigned char)p || gb[3 * p + 1] != 'x' ||
            gb[3 * p + 2] != (unsigned char)(p * 7))
            FAIL("allgather of bytes: rank %d's are wrong", p);
    cudaFree(ds);
    cudaFree(dr);
    return ops + 1;
}

int main(int argc, char **argv)
{
    const char *rs = getenv("OMPI_COMM_WORLD_RANK"), *ws = getenv("OMPI_COMM_WORLD_SIZE"),
               *ls = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    if (!rs || !ws || argc < 2 || (strcmp(argv[1], "check") && strcmp(argv[1], "die"))) {
        fprintf(stderr, "usage: mpirun ... comm_nccl_mpi_rank check|die R\n");
        return 2;
    }
    rank = atoi(rs), world = atoi(ws);
    int local = ls ? atoi(ls) : 0, gpus = 0;
    cudaError_t ce = cudaGetDeviceCount(&gpus);
    if (ce != cudaSuccess || gpus < 1) {
        printf("rank %d: no GPU (%s): skipped\n", rank,
               ce != cudaSuccess ? cudaGetErrorString(ce) : "none");
        return 77;
    }
    int device = local % gpus;
    if ((ce = cudaSetDevice(device)) != cudaSuccess)
        FAIL("cudaSetDevice(%d): %s", device, cudaGetErrorString(ce));
    int victim = argc > 2 ? atoi(argv[2]) : -1;
    char why[300] = "";
    struct comm_opts o = {.backend = COMM_NCCL, .rank = rank, .world = world, .mpi = true,
                          .timeout_ms = 60000, .op_timeout_ms = 120000, .cuda_device = device,
                          .why = why, .why_len = sizeof(why), .chunk_bytes = (size_t)64 << 10};
    struct comm *c;
    int r = comm_open(&o, &c);
    if (r) {
        printf("rank %d: comm_open: %s: %s\n", rank, zinf_strerror(r), why);
        return 1;
    }
    struct comm_stats st;
    comm_get_stats(c, &st);
    const char *L = getenv("ZINF_COMM_RANKS_PER_NODE");
    int per = L && *L ? atoi(L) : world; /* the tests run on one machine */
    if (st.backend != COMM_NCCL || st.nodes != (world + per - 1) / per || st.node != rank / per)
        FAIL("backend %d, node %d of %d, not nccl, node %d of %d", (int)st.backend, st.node,
             st.nodes, rank / per, (world + per - 1) / per);
    if (!strcmp(argv[1], "die")) {
        size_t n = 1000;
        float *d = dev(n * sizeof(float));
        if (cudaMemset(d, 0, n * sizeof(float)) != cudaSuccess) FAIL("cudaMemset");
        for (int k = 0; k < 3; k++) {
            if ((r = comm_allreduce(c, d, d, n, COMM_F32))) FAIL("allreduce: %s", zinf_strerror(r));
            if ((r = comm_barrier(c))) FAIL("barrier: %s", zinf_strerror(r));
        }
        if (rank == victim) {
            printf("rank %d: killing itself\n", rank);
            fflush(NULL);
            raise(SIGKILL);
        }
        for (;;) /* until the job ends: these cannot complete */
            if ((r = comm_allreduce(c, d, d, n, COMM_F32))) FAIL("allreduce: %s", zinf_strerror(r));
    }
    unsigned ops = check(c);
    comm_get_stats(c, &st);
    if (st.ops != ops) FAIL("stats: %llu operations, %u run", (unsigned long long)st.ops, ops);
    comm_close(c);
    printf("rank %d ok (node %d of %d, %u operations)\n", rank, st.node, st.nodes, ops);
    return 0;
}
#else
int main(void)
{
    printf("comm_nccl_mpi_rank: built without CUDA and NCCL: nothing to run (see "
           "tests/cuda_emu/run.sh comm-mpi)\n");
    return 77;
}
#endif
