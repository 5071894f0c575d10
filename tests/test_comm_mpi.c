/*
 * test_comm_mpi.c - communicators across nodes (comm_opts.mpi, src/comm/mpi.c and hier.c):
 * jobs that mpirun starts on this machine, split into logical nodes by
 * ZINF_COMM_RANKS_PER_NODE, each rank (comm_mpi_rank) running a fixed sequence of every
 * collective and checking each result bitwise against the rank-order chain; and the faults:
 * a rank killed or exiting mid-job ends the job within seconds, a stopped one within the
 * operations' deadline, a bad layout, a name too long or a wrong world fails every rank with
 * the reason. mpirun cannot place a node's ranks apart on one machine, so the refusal of
 * --map-by node is not tested here. Skipped where mpirun is not on PATH or the build has no
 * MPI. The single-node communicator's own tests are in test_comm.c.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common.h"
#include "helpers.h"

TestSuite(comm_mpi, .timeout = 120);

static void need_mpi(void)
{
    if (!ZINF_HAVE_MPI) cr_skip_test("this build has no MPI (libopenmpi-dev)");
    if (system("command -v mpirun >/dev/null 2>&1") != 0) cr_skip_test("mpirun is not on PATH");
    if (!getenv("ZINF_COMM_MPI_RANK")) cr_skip_test("ZINF_COMM_MPI_RANK is not set (run it under meson test)");
}

struct job {
    int status; /* exit status, or 128 + signal */
    double secs;
    char out[16384]; /* what mpirun and the ranks printed (its start, where longer) */
};

/* mpirun -np np of comm_mpi_rank with args, ZINF_COMM_RANKS_PER_NODE=per (NULL: unset). */
static void run_job_env(int np, const char *per, const char *a1, const char *a2, struct job *j,
                        const char *op_timeout_ms)
{
    char path[] = "/tmp/zinf-mpi-out-XXXXXX", nps[16];
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    snprintf(nps, sizeof(nps), "%d", np);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
        setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
        setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
        if (op_timeout_ms) setenv("ZINF_COMM_OP_TIMEOUT_MS", op_timeout_ms, 1);
        if (per) setenv("ZINF_COMM_RANKS_PER_NODE", per, 1);
        else unsetenv("ZINF_COMM_RANKS_PER_NODE");
        dup2(fd, 1);
        dup2(fd, 2);
        const char *argv[] = {"mpirun", "-np", nps, "--oversubscribe", "--bind-to", "none",
                              getenv("ZINF_COMM_MPI_RANK"), a1, a2, NULL};
        execvp("mpirun", (char **)argv);
        _exit(127);
    }
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    j->secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    j->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    ssize_t n = pread(fd, j->out, sizeof(j->out) - 1, 0);
    j->out[n > 0 ? n : 0] = 0;
    close(fd);
    unlink(path);
}

static void run_job(int np, const char *per, const char *a1, const char *a2, struct job *j)
{
    run_job_env(np, per, a1, a2, j, NULL);
}

static void expect_ok(int np, const char *per)
{
    need_mpi();
    struct job j;
    run_job(np, per, "check", NULL, &j);
    cr_assert_eq(j.status, 0, "%d ranks, %s per node: status %d:\n%s", np, per ? per : "all",
                 j.status, j.out);
    for (int r = 0; r < np; r++) {
        char line[32];
        snprintf(line, sizeof(line), "rank %d ok", r);
        cr_assert(strstr(j.out, line), "no '%s' in:\n%s", line, j.out);
    }
}

Test(comm_mpi, two_nodes_of_two_are_the_rank_order_chain)
{
    expect_ok(4, "2");
}

Test(comm_mpi, nodes_of_two_and_one_are_the_rank_order_chain)
{
    expect_ok(3, "2");
}

Test(comm_mpi, every_rank_its_own_node_is_the_rank_order_chain)
{
    expect_ok(4, "1");
}

/* The physical layout: one machine is one node, today's shm backend with no MPI traffic. */
Test(comm_mpi, one_machine_is_one_node)
{
    expect_ok(2, NULL);
}

static void expect_fast_failure(const char *how, const char *victim)
{
    need_mpi();
    struct job j;
    run_job(4, "2", how, victim, &j);
    cr_assert_neq(j.status, 0, "the job went on after rank %s's %s:\n%s", victim, how, j.out);
    /* The operations' deadline is 60 s: this is the abort, not a timeout. */
    cr_assert_lt(j.secs, 15.0, "the job took %.1f s to fail:\n%s", j.secs, j.out);
}

Test(comm_mpi, a_killed_local_rank_ends_the_job_within_seconds)
{
    expect_fast_failure("die", "1");
}

Test(comm_mpi, a_killed_leader_ends_the_job_within_seconds)
{
    expect_fast_failure("die", "2");
}

Test(comm_mpi, a_rank_exiting_with_its_communicator_open_ends_the_job)
{
    expect_fast_failure("exit", "3");
}

Test(comm_mpi, a_bad_ranks_per_node_fails_every_rank_with_why)
{
    need_mpi();
    struct job j;
    run_job(2, "0", "check", NULL, &j);
    cr_assert_neq(j.status, 0);
    cr_assert(strstr(j.out, "ZINF_COMM_RANKS_PER_NODE=0 is not a number of ranks"), "%s", j.out);
    /* mpirun ends the job once the first rank returns: one rank's word, and none went on. */
    cr_assert(strstr(j.out, "rank 0: comm_open") || strstr(j.out, "rank 1: comm_open"), "%s",
              j.out);
    cr_assert_null(strstr(j.out, " ok ("), "%s", j.out);
}

Test(comm_mpi, a_world_other_than_mpiruns_is_eproto_on_every_rank)
{
    need_mpi();
    struct job j;
    run_job(2, "1", "world", NULL, &j);
    cr_assert_neq(j.status, 0);
    cr_assert(strstr(j.out, "rank and world are MPI_COMM_WORLD's"), "%s", j.out);
    /* mpirun ends the job once the first rank returns: one rank's word, and none went on. */
    cr_assert(strstr(j.out, "rank 0: comm_open: ") || strstr(j.out, "rank 1: comm_open: "), "%s",
              j.out);
    cr_assert_null(strstr(j.out, " ok ("), "%s", j.out);
}

/* A leader stopped mid-job: the other node's leader waits for its chain in MPI, finds the
 * operation's deadline (2 s) passed and aborts the job, naming why. */
Test(comm_mpi, a_stopped_leader_times_out_the_others_and_ends_the_job)
{
    need_mpi();
    struct job j;
    run_job_env(4, "2", "stop", "2", &j, "2000");
    cr_assert_neq(j.status, 0, "%s", j.out);
    cr_assert_lt(j.secs, 20.0, "the job took %.1f s to fail:\n%s", j.secs, j.out);
    /* The deadline is named by whichever rank finds it first: a leader waiting in MPI, or a
     * rank of the stopped leader's node waiting for it in shared memory. */
    cr_assert(strstr(j.out, "deadline passed") || strstr(j.out, "did not come to allreduce"),
              "%s", j.out);
    /* A regression: the node's segment named its job from memory gone after comm_open. */
    for (const char *p = j.out; (p = strstr(p, "zinf: error: comm ")); p++)
        cr_assert(!strncmp(p + 18, "mpi-", 4), "a segment's job name is garbled:\n%s", j.out);
}

/* A regression: a node's segment named its ranks by their place in the node, so that node 1's
 * leader (world rank 2) said "rank 0: rank 1 (pid ...) did not come" of world rank 3. Only
 * node 1's ranks have the short deadline, so its leader is the one that times out. */
Test(comm_mpi, a_node_segment_names_world_ranks_in_its_failures)
{
    need_mpi();
    struct job j;
    run_job_env(4, "2", "stop-node", "3", &j, "2000");
    cr_assert_neq(j.status, 0, "%s", j.out);
    cr_assert_lt(j.secs, 20.0, "the job took %.1f s to fail:\n%s", j.secs, j.out);
    cr_assert(strstr(j.out, ".n1: rank 2: rank 3 (pid ") && strstr(j.out, ", stopped) did not come"),
              "node 1's leader does not name world rank 3:\n%s", j.out);
}

Test(comm_mpi, a_name_without_room_for_the_nodes_suffix_is_refused)
{
    need_mpi();
    struct job j;
    run_job(2, "1", "longname", NULL, &j);
    cr_assert_neq(j.status, 0);
    cr_assert(strstr(j.out, "with its node's suffix"), "%s", j.out);
    /* Every rank refuses it, before any meets: the first to return ends the job (mpirun
     * then stops the others), so the log of at least one says so, and no rank went on. */
    cr_assert(strstr(j.out, "rank 0: comm_open: ") || strstr(j.out, "rank 1: comm_open: "), "%s",
              j.out);
    cr_assert_null(strstr(j.out, " ok ("), "%s", j.out);
}
