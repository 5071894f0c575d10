/*
 * comm_rank.c - one rank of a job started by `zinf launch` (test_cli): it opens the shm
 * communicator from RANK, WORLD_SIZE and ZINF_COMM_NAME, allreduces, allgathers and
 * checks the results (also with buffers from its pool), and says "rank R ok". With "die R" as its argument, rank R kills
 * itself (SIGKILL) once the communicator is open, and the others go on into a collective
 * that cannot complete. With "wait", each rank waits for SIGTERM after its checks and
 * exits 0 saying "rank R stopped".
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common.h"
#include "zinf.h"

static volatile sig_atomic_t stop;

static void post(struct comm_req *q, int res)
{
    completion_post(q->data, res);
}

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

int main(int argc, char **argv)
{
    const char *rs = getenv("RANK"), *ws = getenv("WORLD_SIZE"), *name = getenv("ZINF_COMM_NAME");
    if (!rs || !ws || !name) {
        fprintf(stderr, "RANK, WORLD_SIZE or ZINF_COMM_NAME is not set\n");
        return 2;
    }
    int rank = atoi(rs), world = atoi(ws);
    signal(SIGTERM, on_term);
    const char *op_ms = getenv("ZINF_COMM_OP_TIMEOUT_MS");
    struct comm_opts o = {.backend = COMM_SHM, .rank = rank, .world = world, .name = name,
                          .secret = getenv("ZINF_COMM_SECRET"), .timeout_ms = 20000,
                          .op_timeout_ms = op_ms ? (unsigned)atoi(op_ms) : 0, .stop = &stop,
                          .pool_bytes = 1 << 20};
    struct comm *c;
    int r = comm_open(&o, &c);
    if (r) {
        fprintf(stderr, "rank %d: comm_open: %s\n", rank, zinf_strerror(r));
        return 1;
    }
    if (argc > 2 && !strcmp(argv[1], "die") && atoi(argv[2]) == rank) raise(SIGKILL);
    float a[1000], b[1000];
    for (int i = 0; i < 1000; i++)
        a[i] = (float)(rank * 1000 + i);
    if ((r = comm_allreduce(c, a, b, 1000, COMM_F32))) {
        fprintf(stderr, "rank %d: allreduce: %s\n", rank, zinf_strerror(r));
        return 1;
    }
    for (int i = 0; i < 1000; i++) {
        float want = 0;
        for (int q = 0; q < world; q++)
            want += (float)(q * 1000 + i);
        if (b[i] != want) {
            fprintf(stderr, "rank %d: element %d is %g, not %g\n", rank, i, b[i], want);
            return 1;
        }
    }
    int mine = rank * 7, all[64];
    if ((r = comm_allgather(c, &mine, all, sizeof(mine), COMM_BYTE))) {
        fprintf(stderr, "rank %d: allgather: %s\n", rank, zinf_strerror(r));
        return 1;
    }
    for (int q = 0; q < world; q++)
        if (all[q] != q * 7) {
            fprintf(stderr, "rank %d: allgather: rank %d's is %d\n", rank, q, all[q]);
            return 1;
        }
    /* A burst of queued requests, waited for together: the worker thread and callbacks
     * against this thread (what ThreadSanitizer looks at). */
    enum { BURST = 20 };
    static float in[BURST][256], res[BURST][256];
    static struct comm_req q[BURST];
    static struct completion done[BURST];
    for (int k = 0; k < BURST; k++) {
        for (int i = 0; i < 256; i++)
            in[k][i] = (float)(k + i + rank);
        done[k] = (struct completion)COMPLETION_INIT;
        q[k] = (struct comm_req){.op = COMM_ALLREDUCE, .dtype = COMM_F32, .send = in[k],
                                 .recv = res[k], .count = 256, .cb = post, .data = &done[k]};
        if ((r = comm_submit(c, &q[k]))) {
            fprintf(stderr, "rank %d: submit %d: %s\n", rank, k, zinf_strerror(r));
            return 1;
        }
    }
    for (int k = 0; k < BURST; k++) {
        if ((r = completion_wait(&done[k]))) {
            fprintf(stderr, "rank %d: request %d: %s\n", rank, k, zinf_strerror(r));
            return 1;
        }
        for (int i = 0; i < 256; i++)
            if (res[k][i] != (float)(world * (k + i)) + (float)(world * (world - 1) / 2)) {
                fprintf(stderr, "rank %d: request %d element %d is %g\n", rank, k, i, res[k][i]);
                return 1;
            }
    }
    /* Buffers from the pool: read in place by the peers. */
    float *pa = comm_alloc(c, 4096 * sizeof(float), &r), *pb = pa ? comm_alloc(c, 4096 * sizeof(float), &r) : NULL;
    if (!pb) {
        fprintf(stderr, "rank %d: comm_alloc: %s\n", rank, zinf_strerror(r));
        return 1;
    }
    for (int i = 0; i < 4096; i++)
        pa[i] = (float)(rank + i);
    struct comm_stats st;
    if ((r = comm_allreduce(c, pa, pb, 4096, COMM_F32)) || (comm_get_stats(c, &st), st.pooled_ops != 1)) {
        fprintf(stderr, "rank %d: pooled allreduce: %s\n", rank, r ? zinf_strerror(r) : "not pooled");
        return 1;
    }
    for (int i = 0; i < 4096; i++)
        if (pb[i] != (float)(world * i) + (float)(world * (world - 1) / 2)) {
            fprintf(stderr, "rank %d: pooled element %d is %g\n", rank, i, pb[i]);
            return 1;
        }
    printf("rank %d ok\n", rank);
    fflush(stdout);
    comm_close(c);
    if (argc > 1 && !strcmp(argv[1], "wait")) {
        /* SIGTERM blocked between the test of stop and the wait (sigsuspend unblocks it
         * atomically): with pause(), a signal landing between the two was never seen. */
        sigset_t term, old;
        sigemptyset(&term);
        sigaddset(&term, SIGTERM);
        sigprocmask(SIG_BLOCK, &term, &old);
        while (!stop)
            sigsuspend(&old);
        sigprocmask(SIG_SETMASK, &old, NULL);
        printf("rank %d stopped\n", rank);
        fflush(stdout); /* said before exit's own work (a sanitizer's leak check) runs */
    }
    return 0;
}
