/*
 * comm.c - bus bandwidth of the communicator's collectives (src/comm/), in the shape of
 * nccl-tests: N ranks (child processes of this one) run allgather, reduce_scatter and
 * allreduce of float32 from --min to --max bytes, doubling; rank 0 prints one row per
 * size with the time per operation, algbw (size / time), busbw (algbw times the
 * collective's factor: (N-1)/N for allgather and reduce_scatter, 2(N-1)/N for allreduce)
 * and the number of wrong elements of an operation run after the timed ones on fresh
 * inputs. The footer compares the busbw of the largest size with memcpy bandwidth of the
 * same size: one thread's best, after the ranks exit, and what each rank gets copying size
 * bytes at once with the others right after the collective's timed loop (the ranks share
 * the memory bus as the copies do, and a shared machine's bandwidth drifts within a run).
 * A second baseline, read at once: every rank reads size bytes at once (a sum, read 4 KiB
 * ahead as the reductions do). Each rank of a reduction reads size bytes whatever the
 * algorithm (its part of every rank's input), so where one core's reads are what bound it,
 * busbw is at most that rate times the collective's factor; the footer says how close each
 * reduction came.
 * --in-place runs the collectives in place, as nccl-tests' in-place columns: allgather's
 * send is the rank's part of recv, reduce_scatter's recv the rank's part of send,
 * allreduce's recv its send.
 *
 * size is nccl-tests' size: the whole gathered buffer (allgather), the whole input
 * (reduce_scatter), the buffer (allreduce).
 *
 * An internal module: it links the library's internals. Not a test.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "comm/comm.h"

#define MIB_B ((uint64_t)1 << 20)

struct opts {
    int ranks, iters, warmup;
    uint64_t min_bytes, max_bytes, chunk_bytes;
    bool json, pool, in_place;
    enum comm_backend backend;
};

/* What rank 0 reports for one (op, size), through a shared page. */
struct row {
    double us, algbw, busbw;
    uint64_t wrong;
    double memcpy_gbs; /* the largest size: memcpy of size bytes on every rank at once, right
                          after the operation (the mean of the ranks) */
    double read_gbs;   /* the same, reading size bytes */
};

static const char *op_name(enum comm_op op)
{
    return op == COMM_ALLGATHER ? "allgather" : op == COMM_REDUCE_SCATTER ? "reduce_scatter" : "allreduce";
}

static double bus_factor(enum comm_op op, int n)
{
    return op == COMM_ALLREDUCE ? 2.0 * (n - 1) / n : (double)(n - 1) / n;
}

static float val(int r, size_t i)
{
    return (float)((r + 1) * 3 + (int)(i % 1013)); /* small integers: exact in any order */
}

typedef float v4f __attribute__((vector_size(16)));

/* The sum of n floats (n a multiple of 16) read as the shm reductions read theirs: four
 * vectors at a time, 4 KiB ahead. */
static float read_sum(const float *p, size_t n)
{
    v4f a = {0}, b = {0}, c = {0}, d = {0}, x;
    for (size_t i = 0; i + 16 <= n; i += 16) {
        if (i + 1024 < n) __builtin_prefetch(p + i + 1024);
        memcpy(&x, p + i, 16), a += x;
        memcpy(&x, p + i + 4, 16), b += x;
        memcpy(&x, p + i + 8, 16), c += x;
        memcpy(&x, p + i + 12, 16), d += x;
    }
    x = a + b + c + d;
    return x[0] + x[1] + x[2] + x[3];
}

/* One rank: every (op, size); rank 0 writes rows[] (ops x sizes). */
static int rank_main(const struct opts *o, int rank, const char *name, struct row *rows, int nsizes)
{
    size_t maxb = (size_t)o->max_bytes;
    struct comm_opts co = {.backend = o->backend, .rank = rank, .world = o->ranks, .name = name,
                           .chunk_bytes = o->chunk_bytes, .pool_bytes = o->pool ? 2 * maxb : 0};
    struct comm *c;
    int r = comm_open(&co, &c);
    if (r) {
        fprintf(stderr, "comm: rank %d: comm_open: %s\n", rank, zinf_strerror(r));
        return 1;
    }
    float *a = o->pool ? comm_alloc(c, maxb, &r) : malloc(maxb),
          *b = o->in_place ? a : o->pool ? comm_alloc(c, maxb, &r) : malloc(maxb);
    if (!a || !b) return 1;
    char *ca = malloc(maxb), *cb = malloc(maxb); /* the memcpy baseline's */
    if (!ca || !cb) return 1;
    memset(a, 0, maxb); /* fault the pages in before timing */
    memset(b, 0, maxb);
    memset(ca, 1, maxb);
    memset(cb, 2, maxb);
    const enum comm_op ops[3] = {COMM_ALLGATHER, COMM_REDUCE_SCATTER, COMM_ALLREDUCE};
    int n = o->ranks;
    for (int k = 0; k < 3; k++) {
        int si = 0;
        for (uint64_t size = o->min_bytes; size <= o->max_bytes; size *= 2, si++) {
            size_t total = (size_t)size / sizeof(float) / (size_t)n * (size_t)n; /* elements */
            size_t count = ops[k] == COMM_ALLREDUCE ? total : total / (size_t)n;
            size_t in = ops[k] == COMM_REDUCE_SCATTER ? total : count;
            /* In place: allgather sends from its part of recv, reduce_scatter receives into
             * its part of send. */
            float *send = a, *recv = b;
            if (o->in_place && ops[k] == COMM_ALLGATHER) send = b + (size_t)rank * count;
            if (o->in_place && ops[k] == COMM_REDUCE_SCATTER) recv = a + (size_t)rank * count;
            for (size_t i = 0; i < in; i++)
                send[i] = val(rank, i);
            struct comm_req q = {.op = ops[k], .dtype = COMM_F32, .send = send, .recv = recv, .count = count};
            for (int w = 0; w < o->warmup; w++)
                if ((r = comm_run(c, &q))) goto fail;
            if ((r = comm_barrier(c))) goto fail;
            uint64_t t0 = now_ns();
            for (int it = 0; it < o->iters; it++)
                if ((r = comm_run(c, &q))) goto fail;
            if ((r = comm_barrier(c))) goto fail;
            double us = (double)(now_ns() - t0) / 1e3 / o->iters;
            /* The check: one more operation on fresh inputs (in place, the timed ones
             * summed their own results again). */
            for (size_t i = 0; i < in; i++)
                send[i] = val(rank, i);
            if ((r = comm_run(c, &q))) goto fail;
            uint64_t wrong = 0;
            size_t out = ops[k] == COMM_ALLGATHER ? total : count;
            for (size_t i = 0; i < out; i++) {
                float want = 0;
                if (ops[k] == COMM_ALLGATHER) {
                    want = val((int)(i / count), i % count);
                } else {
                    size_t at = ops[k] == COMM_REDUCE_SCATTER ? (size_t)rank * count + i : i;
                    for (int q2 = 0; q2 < n; q2++)
                        want += val(q2, at);
                }
                wrong += recv[i] != want;
            }
            /* At the largest size, the baseline at the same moment: every rank copies size
             * bytes between private buffers at once, as many times as the timed loop ran. */
            float mc[2] = {0, 0}, mcsum[2];
            if (size * 2 > o->max_bytes) {
                if ((r = comm_barrier(c))) goto fail;
                uint64_t m0 = now_ns();
                for (int it = 0; it < o->iters; it++)
                    memcpy(it % 2 ? cb : ca, it % 2 ? ca : cb, (size_t)size);
                mc[0] = (float)((double)size * o->iters / (double)(now_ns() - m0));
                if ((r = comm_barrier(c))) goto fail;
                volatile float sink = 0;
                m0 = now_ns();
                for (int it = 0; it < o->iters; it++)
                    sink += read_sum((const float *)(it % 2 ? ca : cb), (size_t)size / 64 * 16);
                mc[1] = (float)((double)size * o->iters / (double)(now_ns() - m0));
                (void)sink;
            }
            if ((r = comm_allreduce(c, mc, mcsum, 2, COMM_F32))) goto fail;
            /* Every rank's wrong count goes to rank 0 in an allreduce of one float. */
            float wf = (float)wrong, wsum = 0;
            if ((r = comm_allreduce(c, &wf, &wsum, 1, COMM_F32))) goto fail;
            if (rank == 0) {
                struct row *w = &rows[k * nsizes + si];
                double bytes = (double)(total * sizeof(float));
                w->us = us;
                w->algbw = bytes / us / 1e3; /* GB/s */
                w->busbw = w->algbw * bus_factor(ops[k], n);
                w->wrong = (uint64_t)wsum;
                w->memcpy_gbs = mcsum[0] / n;
                w->read_gbs = mcsum[1] / n;
            }
        }
    }
    if (o->pool) {
        comm_free(c, a);
        if (b != a) comm_free(c, b);
    } else {
        free(a);
        if (b != a) free(b);
    }
    free(ca);
    free(cb);
    comm_close(c);
    return 0;
fail:
    fprintf(stderr, "comm: rank %d: %s\n", rank, zinf_strerror(r));
    return 1;
}

/* memcpy bandwidth of bytes, GB/s: the best of several copies. */
static double memcpy_gbs(size_t bytes)
{
    char *a = malloc(bytes), *b = malloc(bytes);
    if (!a || !b) return 0;
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    size_t many = ((size_t)1 << 30) / bytes;
    int reps = many > 3 ? (int)many : 3;
    uint64_t best = UINT64_MAX;
    for (int i = 0; i < reps; i++) {
        uint64_t t0 = now_ns();
        memcpy(i % 2 ? a : b, i % 2 ? b : a, bytes);
        uint64_t t = now_ns() - t0;
        if (t < best) best = t;
    }
    free(a);
    free(b);
    return (double)bytes / (double)best;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: comm [--ranks 2] [--min 1M] [--max 256M] [--iters 5] [--warmup 1]\n"
               "            [--chunk 4M] [--pool] [--in-place] [--json]\n"
               "allgather, reduce_scatter and allreduce of float32 across RANKS processes on the\n"
               "shm backend, sizes doubling from MIN to MAX bytes, in the nccl-tests shape.\n"
               "--pool: the buffers come from comm_alloc (every rank maps them: one copy).\n"
               "--in-place: send and recv overlap as in nccl-tests' in-place columns.\n");
}

int main(int argc, char **argv)
{
    struct opts o = {.ranks = 2, .iters = 5, .warmup = 1, .min_bytes = MIB_B, .max_bytes = 256 * MIB_B,
                     .backend = COMM_SHM};
    static const struct option lo[] = {{"ranks", required_argument, NULL, 'n'},
                                       {"min", required_argument, NULL, 'a'},
                                       {"max", required_argument, NULL, 'b'},
                                       {"iters", required_argument, NULL, 'i'},
                                       {"warmup", required_argument, NULL, 'w'},
                                       {"chunk", required_argument, NULL, 'c'},
                                       {"json", no_argument, NULL, 'j'},
                                       {"pool", no_argument, NULL, 'p'},
                                       {"in-place", no_argument, NULL, 'I'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (ch) {
        case 'n':
            o.ranks = atoi(optarg);
            break;
        case 'a':
        case 'b':
        case 'c': {
            uint64_t v;
            if (parse_size(optarg, &v) < 0) {
                fprintf(stderr, "comm: bad size '%s'\n", optarg);
                return 2;
            }
            *(ch == 'a' ? &o.min_bytes : ch == 'b' ? &o.max_bytes : &o.chunk_bytes) = v;
            break;
        }
        case 'i':
            o.iters = atoi(optarg);
            break;
        case 'w':
            o.warmup = atoi(optarg);
            break;
        case 'j':
            o.json = true;
            break;
        case 'p':
            o.pool = true;
            break;
        case 'I':
            o.in_place = true;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (o.ranks < 1 || o.ranks > COMM_MAX_RANKS || o.iters < 1 || o.warmup < 0 ||
        o.min_bytes < 4 * (uint64_t)o.ranks || o.max_bytes < o.min_bytes) {
        usage(stderr);
        return 2;
    }
    int nsizes = 0;
    for (uint64_t s = o.min_bytes; s <= o.max_bytes; s *= 2)
        nsizes++;
    size_t rows_bytes = sizeof(struct row) * 3 * (size_t)nsizes;
    struct row *rows = mmap(NULL, rows_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (rows == MAP_FAILED) return 1;
    char name[64];
    snprintf(name, sizeof(name), "bench-%d", (int)getpid());
    fflush(NULL);
    pid_t pids[COMM_MAX_RANKS];
    for (int r = 0; r < o.ranks; r++) {
        pids[r] = fork();
        if (pids[r] < 0) return 1;
        if (pids[r] == 0) _exit(rank_main(&o, r, name, rows, nsizes));
    }
    int bad = 0;
    for (int r = 0; r < o.ranks; r++) {
        int st;
        waitpid(pids[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "comm: rank %d failed (status %#x)\n", r, st);
            bad = 1;
        }
    }
    if (bad) return 1;
    double mc = memcpy_gbs((size_t)o.max_bytes);
    const enum comm_op ops[3] = {COMM_ALLGATHER, COMM_REDUCE_SCATTER, COMM_ALLREDUCE};
    uint64_t wrong_all = 0;
    if (!o.json) {
        printf("# zinf %s comm: backend %s, %d ranks (processes), float32, %d iterations after %d "
               "warm-up, chunk %llu B (0: default), buffers %s, %s\n",
               zinf_version(), comm_backend_name(o.backend), o.ranks, o.iters, o.warmup,
               (unsigned long long)o.chunk_bytes,
               o.pool ? "from comm_alloc (one copy)" : "private (through staging)",
               o.in_place ? "in place" : "out of place");
        printf("# %-14s %12s %12s %6s %10s %9s %9s %8s\n", "collective", "size", "count", "type",
               "time", "algbw", "busbw", "#wrong");
        printf("# %-14s %12s %12s %6s %10s %9s %9s %8s\n", "", "(B)", "(elements)", "", "(us)",
               "(GB/s)", "(GB/s)", "");
    }
    for (int k = 0; k < 3; k++) {
        int si = 0;
        for (uint64_t s = o.min_bytes; s <= o.max_bytes; s *= 2, si++) {
            const struct row *w = &rows[k * nsizes + si];
            uint64_t total = s / 4 / (uint64_t)o.ranks * (uint64_t)o.ranks;
            wrong_all += w->wrong;
            if (o.json)
                printf("{\"collective\": \"%s\", \"ranks\": %d, \"size\": %llu, \"count\": %llu, "
                       "\"type\": \"float\", \"time_us\": %.1f, \"algbw\": %.3f, \"busbw\": %.3f, "
                       "\"wrong\": %llu}\n",
                       op_name(ops[k]), o.ranks, (unsigned long long)(total * 4),
                       (unsigned long long)total, w->us, w->algbw, w->busbw,
                       (unsigned long long)w->wrong);
            else
                printf("  %-14s %12llu %12llu %6s %10.1f %9.3f %9.3f %8llu\n", op_name(ops[k]),
                       (unsigned long long)(total * 4), (unsigned long long)total, "float", w->us,
                       w->algbw, w->busbw, (unsigned long long)w->wrong);
        }
    }
    if (!o.json) {
        printf("# memcpy of %llu B, one thread, best of several: %.3f GB/s\n",
               (unsigned long long)o.max_bytes, mc);
        for (int k = 0; k < 3; k++) {
            const struct row *w = &rows[k * nsizes + nsizes - 1];
            printf("# %s at %llu B: memcpy on every rank at once right after it, %.3f GB/s "
                   "each; busbw / memcpy: %.3f (at once), %.3f (one thread)\n",
                   op_name(ops[k]), (unsigned long long)o.max_bytes, w->memcpy_gbs,
                   w->busbw / w->memcpy_gbs, w->busbw / mc);
        }
        for (int k = 1; k < 3; k++) { /* the reductions */
            const struct row *w = &rows[k * nsizes + nsizes - 1];
            double bound = w->read_gbs * bus_factor(ops[k], o.ranks);
            printf("# %s at %llu B: reading at once %.3f GB/s each bounds busbw at %.3f GB/s "
                   "(%.3f of the memcpy): busbw / that bound %.3f\n",
                   op_name(ops[k]), (unsigned long long)o.max_bytes, w->read_gbs, bound,
                   bound / w->memcpy_gbs, w->busbw / bound);
        }
        printf("# %s\n", wrong_all ? "SOME ELEMENTS WERE WRONG" : "every element checked");
    }
    munmap(rows, rows_bytes);
    return wrong_all ? 1 : 0;
}
