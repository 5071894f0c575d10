/*
 * mpi.h - a communicator across nodes (comm_opts.mpi): the MPI side of it (mpi.c: joining
 * MPI, the layout of ranks into nodes, the leaders' point-to-point transfers and their
 * waits) and the collectives composed of node-local shm operations and those transfers
 * (hier.c). Built without MPI, mpi_built() is false and mpi_open answers -ENOTSUP. Internal
 * to src/comm/.
 */
#ifndef ZINF_COMM_MPI_H
#define ZINF_COMM_MPI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm/comm.h"
#include "comm/shm.h"

struct mpi;

/* Where a rank sits: nodes of consecutive world ranks, node k holding world ranks
 * [first[k], first[k] + size[k]); its leader is its local rank 0. */
struct mpi_layout {
    int node, nodes;        /* this rank's (logical) node, of nodes */
    int local, local_world; /* this rank within its node */
    int first[COMM_MAX_RANKS], size[COMM_MAX_RANKS];
};

bool mpi_built(void);
/* Joins MPI (initialising it once per process), checks o->rank and o->world against
 * MPI_COMM_WORLD's (-EPROTO), works out the nodes (-EINVAL for a layout whose nodes are not
 * consecutive ranks, saying so in o->why) and agrees on the job's name and secret: those of
 * o, or, where NULL, world rank 0's new ones. name: COMM_NAME_BYTES, secret:
 * COMM_SECRET_HEX + 1 ("" for none). Collective over the world. */
int mpi_open(const struct comm_opts *o, char *name, char *secret, struct mpi **out);
void mpi_close(struct mpi *m);
const struct mpi_layout *mpi_layout(const struct mpi *m);
/* Every rank's outcome of a step of the opening: r where it is an error, else
 * -ECONNABORTED where another rank's is (said in o->why, naming it), else 0. Collective. */
int mpi_agree(struct mpi *m, int r, const struct comm_opts *o);
/* World rank 0's SHM_ID_BYTES (NCCL's unique id) to every rank. Collective. */
int mpi_bcast_id(struct mpi *m, uint8_t *id);
/* The node's segment: the leaders' waits watch it, and fail it when they fail. stop:
 * comm_opts.stop. */
void mpi_attach(struct mpi *m, struct shm *s, const volatile sig_atomic_t *stop);
/* Whether this process must not finalise MPI at exit (a communicator across nodes failed
 * or is still open): it aborts the job instead, so that no rank waits on it. */
void mpi_note_failed(void);

/* The leaders' transfers (the node's local rank 0 only), to and from other nodes' leaders by
 * node number. A send is posted and returns; mpi_flush waits for every posted send (the
 * buffer may be written again after it). mpi_recv waits until the data is there. Waits poll,
 * watch the node's segment, the operation's deadline and the stop flag, and on any failure
 * fail the segment and abort the job: they return only -ECONNABORTED, -ETIMEDOUT, -EINTR or
 * -EIO (an MPI error), with the segment failed. */
int mpi_send(struct mpi *m, int node, const void *buf, size_t bytes, int tag);
int mpi_recv(struct mpi *m, int node, void *buf, size_t bytes, int tag);
int mpi_flush(struct mpi *m);
/* Fails the node's segment with why and aborts the job (on a leader; a later call does
 * nothing more). */
void mpi_abort(struct mpi *m, const char *why);
/* Any rank's own transfers with another world rank (send, receive and alltoall across
 * nodes), on the world's communicator, not the leaders': posted (mpi_p2p_post, which
 * counts the bytes that cross physical nodes), then tested or waited for all together. A
 * message posted with tag t from a to b matches b's next receive from a with tag t. Waits
 * and failures are as the leaders' (the job is aborted); a receive that got fewer bytes
 * than it posted fails so, naming both ranks. mpi_p2p_test: *done once every posted
 * transfer has finished (then none is posted). */
enum { MPI_TAG_P2P = 100, MPI_TAG_ALLTOALL = 101 };
int mpi_p2p_post(struct mpi *m, bool send, int rank, void *buf, size_t bytes, int tag);
int mpi_p2p_test(struct mpi *m, bool *done);
int mpi_p2p_wait(struct mpi *m);
/* Between tests in a caller's own wait: the node's segment failed (not its other ranks'
 * lives: they may take no part), the operation's deadline and the stop flag, as the waits here watch them (the job aborted where one says so). */
int mpi_p2p_check(struct mpi *m);
/* Whether transfers of mpi_p2p_post are still posted. */
bool mpi_p2p_posted(const struct mpi *m);

/* The operation the next transfers belong to (their failures name it). */
void mpi_begin_op(struct mpi *m, enum comm_op op);
/* The bytes this rank's leader transfers moved to and from other physical nodes since the
 * last call, zeroed by it. */
void mpi_take_net(struct mpi *m, uint64_t *out, uint64_t *in);

/* hier.c: one operation across the nodes (layout nodes > 1), synchronous, on every rank;
 * req checked by the caller, scratch memory its own. *pooled: whether a node-local step
 * read the pools in place. */
int hier_run(struct mpi *m, struct shm *s, size_t chunk_bytes, const struct comm_req *req,
             bool *pooled);

#endif
