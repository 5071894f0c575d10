/*
 * shm.h - the shared-memory segment of a job's ranks on one node (shm.c): the rendezvous
 * every backend but self uses, a process-shared barrier, and the shm backend's
 * collectives (shm_coll.c). Internal to src/comm/.
 */
#ifndef ZINF_COMM_SHM_H
#define ZINF_COMM_SHM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm/comm.h"

#define SHM_ID_BYTES 128 /* an opaque id rank 0 hands every rank (NCCL's unique id) */

struct shm;

/* Meet the other ranks of o->name. data: whether the segment carries the staging areas
 * of the shm backend (o->chunk_bytes per rank, twice). id: rank 0's is handed to every
 * rank (in on rank 0, out on the others); NULL: none. 0 or -errno, as comm_open. */
int shm_rdv_open(const struct comm_opts *o, bool data, uint8_t *id, struct shm **out);
void shm_rdv_close(struct shm *s);
/* Under mpi, a node's segment holds the world ranks first .. first + local world - 1 as
 * its ranks 0 ..: from this call on, its messages (and the reasons it fails with, which
 * every rank of the node logs) name the world ranks. */
void shm_name_ranks_from(struct shm *s, int first);

/* The rank begins an operation (every barrier until the next one belongs to it): the
 * other ranks can see which, and its barriers wait until comm_opts.op_timeout_ms from now. */
void shm_begin_op(struct shm *s, enum comm_op op);
/* Whether the operation begun last has passed its deadline. Called as a wait goes on (well
 * within a second): a longer gap between two calls is time this rank was stopped,
 * which moves the deadline on. */
bool shm_op_late(struct shm *s);

/* Wait until every rank has called it as often. -ECONNABORTED once a rank died or failed
 * the communicator (shm_fail); -ETIMEDOUT when the operation's deadline passed with a rank
 * missing (then the communicator has failed, its reason naming that rank). */
int shm_barrier(struct shm *s);
/* -ECONNABORTED if the communicator failed or a peer is gone (then failed), else 0. */
int shm_check(struct shm *s);
/* -ECONNABORTED if the communicator has failed (once its reason is written), else 0. */
int shm_failed(struct shm *s);
/* For an operation that only some ranks take part in: -ECONNABORTED if the communicator
 * failed, 1 (and why, without failing it) if local rank peer is gone or closed its
 * communicator, else 0. */
int shm_peer_check(struct shm *s, int peer, char *why, size_t len);
/* Marks the communicator failed for every rank, with why (the first reason wins). */
void shm_fail(struct shm *s, const char *why);

/* One operation of the shm backend, synchronous; req checked by the caller. *pooled says
 * whether it went through the pools in place. */
int shm_run(struct shm *s, const struct comm_req *req, bool *pooled);

/* A message through the channel from one local rank to another (shm_p2p.c): its size (a
 * header), then its bytes, through a ring in the segment. shm_msg_send and shm_msg_recv
 * move what they can without waiting, and return 0 with *moved saying whether anything
 * went; the caller loops (p2p.c) until shm_msg_done. A receive whose sender announced
 * another size fails the communicator naming both, and answers -EPROTO. */
struct shm_msg {
    int peer;      /* the local rank sent to or received from */
    char *buf;     /* sent from or received into */
    size_t bytes;
    uint64_t hdr;  /* the header, as written or read */
    size_t moved;  /* of the header's and then the message's bytes */
};
void shm_msg_init(struct shm_msg *m, int peer, const void *buf, size_t bytes);
int shm_msg_send(struct shm *s, struct shm_msg *m, bool *moved);
int shm_msg_recv(struct shm *s, struct shm_msg *m, bool *moved);
bool shm_msg_done(const struct shm_msg *m);
/* The operation passed its deadline waiting for local rank peer ("its send to ..." in
 * what): fails the communicator naming that rank and the operation it is in; -ETIMEDOUT. */
int shm_p2p_late(struct shm *s, int peer, const char *what);
/* Logs why the communicator failed, as the rank that failed it said. */
void shm_log_failed(struct shm *s);

/* The rank's pool (comm_opts.pool_bytes) in the segment: base and size; 0 size: none. */
void shm_pool(struct shm *s, char **base, size_t *bytes);

#endif
