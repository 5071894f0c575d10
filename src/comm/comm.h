/*
 * comm.h - collectives among the ranks of one job: allgather, reduce_scatter, allreduce,
 * broadcast, alltoall and barrier, and point-to-point send and receive between two ranks,
 * on buffers the caller (the trainer, with memory from the engine) hands in.
 *
 * A communicator is a long-lived handle (comm_open -> comm_close) of one rank. Operations
 * are requests (struct comm_req) queued on it and run in submission order, each finishing
 * with its callback; the synchronous calls submit one and wait. When comm_submit fails,
 * the callback never fires. Every rank must submit the same collectives in the same order
 * (as with NCCL and MPI).
 *
 * Point-to-point (COMM_SEND, COMM_RECV, COMM_SENDRECV) involves only the ranks named: the
 * others do not take part. Each ordered pair of ranks is a channel of its own: the k-th send
 * from rank a to rank b is matched by rank b's k-th receive from rank a, whatever else
 * either rank does in between, and both must move the same number of bytes (else the
 * communicator fails, naming both: the receiver's operation answers -EPROTO, as does an
 * alltoall whose ranks disagree on its size). A send may wait until its receiver takes the data (as
 * NCCL's does; the shm backend finishes a small one at once, but nothing may rely on that):
 * a rank's operations run one at a time, in order, so a schedule is safe when every send
 * and every receive of it can be matched without either rank first waiting for the other.
 * Safe: one rank sends then receives while its peer receives then sends; a chain of stages
 * where each receives from the one before and sends to the one after. Not safe: two ranks
 * that each send to the other before receiving (both sends may wait for ever), or a ring of
 * plain sends. Those are what COMM_SENDRECV is for: it sends to one rank and receives from
 * another (or the same) rank in one operation whose halves progress together, so a pairwise
 * exchange, a ring shift, or a pipeline's steady state (stage s sends activations to s + 1
 * and receives gradients from it, while s + 1 sends gradients to s and receives
 * activations from it) never deadlocks, in whatever order the stages reach it.
 *
 * Backends, chosen at open:
 *   - self: one rank; the collectives are copies.
 *   - shm:  processes of one node over a POSIX shared-memory segment. Reductions add in
 *           rank order, ((r0 + r1) + r2) + ..., so results are bitwise reproducible and
 *           equal to one rank accumulating the same contributions in that order; with
 *           comm_req.acc they add onto what recv holds, (((recv + r0) + r1) + ...).
 *   - nccl: GPU ranks; buffers are device memory; the unique id travels through the same
 *           shared-memory rendezvous.
 * and, with comm_opts.mpi, across nodes: the ranks were started by Open MPI's mpirun and
 * the ranks of each node meet as above (shm, or nccl's barrier), while one leader per node
 * (its lowest rank) moves data between nodes over MPI point-to-point messages. The shm
 * backend's sums then go along a chain of the nodes in rank order, so a result is bitwise
 * the one of a single node (and of one rank accumulating) with the same ranks; nccl runs
 * one NCCL communicator over the whole world (its unique id broadcast over MPI).
 * The rendezvous is by name: every rank of a job opens the communicator with the same
 * name, world and backend, its own rank, within timeout_ms of each other. After it, an
 * operation waits for the other ranks as long as they live: a rank that dies (or fails an
 * operation) fails the communicator for every rank, within about 100 ms.
 *
 * Not here: starting the ranks (zinf launch), what is sharded how (the trainer).
 */
#ifndef ZINF_COMM_H
#define ZINF_COMM_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum comm_backend { COMM_SELF, COMM_SHM, COMM_NCCL };

enum comm_dtype { COMM_BYTE, COMM_F32 };

/* How a reduction's fp32 contributions travel (comm_req.wire). COMM_WIRE_F32: as they are.
 * COMM_WIRE_F16, COMM_WIRE_BF16: each rank's contribution is rounded to 16 bits (to nearest
 * even) and moves as such, half the bytes; the sums are fp32, in the backend's order (shm:
 * rank order, bitwise reproducible), ((recv + h(s0)) + h(s1)) + ... with acc. A
 * reduce-scatter's result is that fp32 sum (it does not travel again); an allreduce's result
 * travels to every rank as 16 bits too, so it is the sum rounded once more. Buffers stay fp32
 * (count floats). The self and shm backends (within one node: the shm backend across nodes
 * answers -ENOTSUP), and nccl, where the sums are NCCL's own, in 16 bits (the contributions
 * cast on the device, reduced as ncclFloat16 or ncclBfloat16, the result widened): its
 * reduce-scatter's result is rounded to 16 bits too. */
enum comm_wire { COMM_WIRE_F32, COMM_WIRE_F16, COMM_WIRE_BF16 };

enum comm_op {
    COMM_ALLGATHER,      /* send: count; recv: world x count, rank r's at r x count (in
                            place: send == recv + rank x count) */
    COMM_REDUCE_SCATTER, /* send: world x count; recv: count, the sum of every rank's r-th
                            (in place: recv == send + rank x count) */
    COMM_ALLREDUCE,      /* send, recv: count; recv the sum (send == recv: in place) */
    COMM_BROADCAST,      /* recv: count, root's (send ignored; root's recv is its data) */
    COMM_BARRIER,        /* nothing moves */
    COMM_ALLTOALL,       /* send, recv: world x count; rank r's recv block j is rank j's send
                            block r (not in place: send and recv apart) */
    COMM_SEND,           /* send: count, to rank peer (only it takes part) */
    COMM_RECV,           /* recv: count, from rank peer (only it takes part) */
    COMM_SENDRECV,       /* send: count to rank peer, and recv: count from rank recv_peer,
                            both halves at once (send and recv apart) */
};

#define COMM_NAME_BYTES 64
#define COMM_MAX_RANKS 64
#define COMM_DEFAULT_TIMEOUT_MS 60000
/* Every barrier and collective waits at most this long for the other ranks (30 minutes, as
 * torch.distributed's default): longer than a checkpoint of hundreds of GB takes, during
 * which the other ranks wait in the checkpoint's barrier. */
#define COMM_DEFAULT_OP_TIMEOUT_MS 1800000u
#define COMM_SECRET_HEX 32 /* the job's secret: 32 hex digits (128 random bits) */
#define COMM_DEFAULT_CHUNK_BYTES ((size_t)4 << 20)

struct comm_opts {
    enum comm_backend backend;
    int rank, world;
    const char *name;   /* the job's rendezvous name: [A-Za-z0-9._-], < COMM_NAME_BYTES */
    const char *secret; /* the job's secret (COMM_SECRET_HEX hex digits; zinf launch hands
                           its ranks one), or NULL: the segment's name carries part of it, and
                           a rank joins only a segment that holds all of it */
    unsigned timeout_ms; /* the rendezvous; 0: the default (60 s) */
    unsigned op_timeout_ms; /* each barrier and collective: a rank that does not come within
                               it fails the communicator, named with the operation it is in;
                               0: COMM_DEFAULT_OP_TIMEOUT_MS */
    const volatile sig_atomic_t *stop; /* a signal handler's flag, or NULL: once non-zero,
                                          the rendezvous gives up (-EINTR) */
    char *why;      /* where comm_open says why it failed, in words (may be NULL) */
    size_t why_len;
    size_t chunk_bytes;  /* shm: staging per rank and step; 0: the default (4 MiB) */
    size_t pool_bytes;   /* shm: memory per rank for comm_alloc, which every rank maps
                            (collectives on it copy once); 0: none */
    int cuda_device;     /* nccl: the rank's GPU ordinal */
    /* The ranks were started by mpirun (Open MPI) and may span several nodes: rank and world
     * must be MPI_COMM_WORLD's (else -EPROTO); name and secret may be NULL (world rank 0
     * makes them and broadcasts them). A node's ranks must have consecutive world ranks
     * (mpirun's default --map-by slot). Pools (pool_bytes, comm_alloc) are shared within a
     * node only: a collective across nodes on pooled buffers works, through the node-local
     * path. Env ZINF_COMM_RANKS_PER_NODE=L (tests, benchmarks) makes nodes of L
     * consecutive ranks instead of the physical ones (L=1: every rank its own node). A
     * build without MPI answers -ENOTSUP. */
    bool mpi;
};

struct comm_req;
typedef void (*comm_cb)(struct comm_req *req, int res);

struct comm_req {
    enum comm_op op;
    enum comm_dtype dtype;
    const void *send;
    void *recv;
    size_t count; /* elements; see enum comm_op */
    int root;     /* broadcast */
    /* send and recv: the other rank (not this one); sendrecv: the rank sent to. */
    int peer;
    int recv_peer; /* sendrecv: the rank received from (peer's value is fine) */
    /* Reductions: add onto recv's contents, recv = ((recv + rank 0's) + rank 1's) + ...,
     * the sum a chain that went on from recv would make (send and recv apart; an allreduce's
     * recv holds the same on every rank). The self and shm backends; nccl refuses it. */
    bool acc;
    enum comm_wire wire; /* reductions of COMM_F32: how the contributions travel */
    comm_cb cb;
    void *data;
    /* nccl: CUDA events (cudaEvent_t; NULL: none). The collective's stream waits for
     * wait_event (recorded on the caller's compute stream after the work that writes send)
     * before it runs, and done_event is recorded on that stream after it, for the compute
     * stream to wait on before it reads recv. The other backends ignore them: their
     * buffers are host memory, ordered by the callback. */
    void *wait_event, *done_event;
    /* private */
    struct comm_req *next_;
};

struct comm_stats {
    enum comm_backend backend;
    int rank, world;
    uint64_t ops, bytes_in, bytes_out; /* finished operations; bytes sent and received */
    uint64_t pooled_ops;               /* of ops, those that read peers' pools in place */
    /* mpi: bytes this rank sent to and received from ranks on other physical nodes (the
     * leaders' messages, and a rank's own for send, receive and alltoall, exactly), and of ops those that crossed nodes;
     * node: this rank's logical node (numbered by their first rank), of nodes. Without
     * mpi: 0s, node 0 of 1. */
    uint64_t net_bytes_out, net_bytes_in, net_ops;
    int node, nodes;
};

struct comm;

/* 0 and *out, or -errno: -EINVAL bad options (logged, naming the option), -ETIMEDOUT the
 * other ranks did not come, -ENOTSUP a backend this build lacks, -EEXIST two ranks with
 * the same number, -EPROTO a rank that disagrees on world, backend, pool size or version,
 * -EACCES an object under the job's name that another user owns (or with another mode than
 * 0600), -EBUSY a live job of the same name meeting there, -EINTR *o->stop was set. Each
 * also says why in o->why. */
int comm_open(const struct comm_opts *o, struct comm **out);
/* Waits for the queued operations, then frees. */
void comm_close(struct comm *c);

/* Queue an operation: 0 (the callback fires once, in submission order) or -errno (it never
 * fires): -EINVAL bad request (send and recv overlapping other than in the op's in-place
 * form, a count whose bytes overflow, a peer out of range or this rank, logged, among them), -ECONNABORTED the communicator failed before (a rank died
 * or an operation timed out; every later one fails too), -ESHUTDOWN closing. */
int comm_submit(struct comm *c, struct comm_req *req);
/* Submit and wait: the operation's result. */
int comm_run(struct comm *c, struct comm_req *req);

int comm_allgather(struct comm *c, const void *send, void *recv, size_t count,
                   enum comm_dtype dt);
int comm_reduce_scatter(struct comm *c, const void *send, void *recv, size_t count,
                        enum comm_dtype dt);
int comm_allreduce(struct comm *c, const void *send, void *recv, size_t count,
                   enum comm_dtype dt);
int comm_broadcast(struct comm *c, void *buf, size_t count, enum comm_dtype dt, int root);
int comm_barrier(struct comm *c);
/* send and recv hold world x count elements each, and do not overlap. */
int comm_alltoall(struct comm *c, const void *send, void *recv, size_t count,
                  enum comm_dtype dt);
int comm_send(struct comm *c, const void *buf, size_t count, enum comm_dtype dt, int peer);
int comm_recv(struct comm *c, void *buf, size_t count, enum comm_dtype dt, int peer);
/* count elements of send to rank to, and count from rank from into recv, at once. */
int comm_sendrecv(struct comm *c, const void *send, int to, void *recv, int from, size_t count,
                  enum comm_dtype dt);

/* Memory of the rank's pool (comm_opts.pool_bytes), 4096-aligned, which every rank of
 * the shm backend maps: a collective whose buffers on every rank come from their pools
 * reads the peers' data in place (one copy instead of two through the staging areas).
 * The self backend hands out plain memory. NULL and *err: -EINVAL 0 bytes, -ENOSPC the
 * pool is full (or there is none), -ENOTSUP the nccl backend (use device memory). */
void *comm_alloc(struct comm *c, size_t bytes, int *err);
/* -EINVAL for memory comm_alloc did not hand out (or freed already). */
int comm_free(struct comm *c, void *p);

void comm_get_stats(struct comm *c, struct comm_stats *out);
/* Whether the nccl backend can run here: 0 and NCCL's version code (e.g. 22703 for 2.27.3)
 * once libnccl loads, else -ENOTSUP (or -EIO) and why, in words. */
int comm_nccl_version(int *version, char *why, size_t len);
const char *comm_backend_name(enum comm_backend b);
/* An operation's name ("allreduce"...), "no operation" for any other value. */
const char *comm_op_name(uint32_t op);
/* Whether name is a rendezvous name: 1 to COMM_NAME_BYTES - 1 characters of
 * [A-Za-z0-9._-], not starting with '.'. */
bool comm_name_ok(const char *name);
/* Whether secret is COMM_SECRET_HEX lowercase hex digits. */
bool comm_secret_ok(const char *secret);
/* The shared-memory object a job of this name and secret (NULL: none) meets in, as
 * shm_open names it ("/zinf-comm-..."): 0, or -EINVAL for a bad name or secret. */
int comm_segment_name(const char *name, const char *secret, char *buf, size_t len);
/* The state letter of process pid in /proc (R, S, D, T, t, Z...), or '?'. */
char comm_proc_state(int32_t pid);
size_t comm_dtype_bytes(enum comm_dtype dt);
/* What one element of q occupies on the wire: comm_dtype_bytes but 2 for a 16-bit wire. */
size_t comm_wire_bytes(const struct comm_req *q);
/* x rounded to the wire's 16 bits and back (COMM_WIRE_F32: x). */
float comm_wire_round(enum comm_wire w, float x);

#endif
