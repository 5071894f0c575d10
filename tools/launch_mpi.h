/*
 * launch_mpi.h - `zinf launch --hostfile`: the ranks of one job on several nodes, started by
 * Open MPI's mpirun. The hostfile (DeepSpeed's format) is read here, turned into Open MPI's,
 * and mpirun runs as the launcher's one child, its tagged output prefixed as a job on one
 * node prints.
 *
 * Not here: the job's name and secret (cmd_launch.c makes them and holds the name), the
 * ranks' communicator across nodes (src/comm/).
 */
#ifndef ZINF_LAUNCH_MPI_H
#define ZINF_LAUNCH_MPI_H

#include <stddef.h>

#define HOSTFILE_MAX_HOSTS 64
#define HOSTNAME_MAX_BYTES 253

struct hostfile {
    int n;                 /* hosts */
    int total_slots;
    struct {
        char name[HOSTNAME_MAX_BYTES + 1];
        int slots;
        int line;          /* where it was given */
    } host[HOSTFILE_MAX_HOSTS];
};

/* Reads FILE (`host [slots=N]` per line, `#` comments, blank lines) into *h: 0, or -errno
 * with err naming the file, the line and what is wrong there. */
int hostfile_read(const char *path, struct hostfile *h, char *err, size_t errlen);

struct launch_mpi {
    const char *hostfile; /* as given */
    int ranks;            /* 0: the total slots */
    const char *name, *secret; /* the job's: ZINF_COMM_NAME, ZINF_COMM_SECRET */
    char **mpi_args;      /* --mpi-arg, each passed to mpirun verbatim */
    int n_mpi_args;
    char **command;       /* NULL-terminated */
};

/* Runs the job: mpirun's exit status (128 + the signal where a signal ended it), 2 for a
 * bad hostfile or -n, 127 where mpirun cannot be run. */
int launch_mpi_run(const struct launch_mpi *l);

#endif
