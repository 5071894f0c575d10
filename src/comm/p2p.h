/*
 * p2p.h - point-to-point operations (send, receive, sendrecv) of the shm backend, on one
 * node or across nodes (p2p.c). Internal to src/comm/.
 */
#ifndef ZINF_COMM_P2P_H
#define ZINF_COMM_P2P_H

#include <stdbool.h>

#include "comm/comm.h"
#include "comm/mpi.h"
#include "comm/shm.h"

static inline bool p2p_op(enum comm_op op)
{
    return op == COMM_SEND || op == COMM_RECV || op == COMM_SENDRECV;
}

/* One send, receive or sendrecv, synchronous; req checked by the caller. s: the node's
 * segment; m: MPI where the communicator spans nodes, else NULL. A peer on this node is
 * reached through s's channels, one on another node by MPI from this rank. */
int p2p_run(struct shm *s, struct mpi *m, const struct comm_req *req);

#endif
