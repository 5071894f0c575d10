/*
 * nccl.h - the NCCL backend of comm.h (nccl.c): one NCCL communicator per rank, its unique
 * id handed out through the shared-memory rendezvous, operations on a stream of its own,
 * waited for in the communicator's worker thread. Buffers are device memory. Built without
 * NCCL, nccl_built() is false and the rest answers -ENOTSUP. Internal to src/comm/.
 */
#ifndef ZINF_COMM_NCCL_H
#define ZINF_COMM_NCCL_H

#include <stdbool.h>
#include <stdint.h>

#include "comm/comm.h"
#include "comm/shm.h"

struct nccl;

bool nccl_built(void);
/* Rank 0: a new unique id into id (SHM_ID_BYTES). */
int nccl_unique_id(uint8_t *id);
int nccl_open(const struct comm_opts *o, const uint8_t *id, struct nccl **out);
/* The worker thread makes the rank's GPU current before it runs anything. */
void nccl_bind_thread(struct nccl *n);
/* One operation, waited for; a barrier is the rendezvous segment's. */
int nccl_run(struct nccl *n, struct shm *rdv, const struct comm_req *req);
void nccl_close(struct nccl *n);

#endif
