/*
 * comm.c - the communicator of comm.h: options and requests checked, a queue of requests
 * run in order by one worker thread per communicator, the self backend, and dispatch to
 * the shm (shm.c) and nccl (nccl.c) backends, and across nodes to hier.c (comm_opts.mpi).
 *
 * One worker per communicator keeps the order every rank must agree on (requests run as
 * submitted) and lets the submitter go on meanwhile; the backends' operations are
 * synchronous inside it.
 *
 * Not here: the segment and the collectives' data movement (shm.c), NCCL calls (nccl.c).
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "comm/mpi.h"
#include "comm/nccl.h"
#include "comm/p2p.h"
#include "comm/shm.h"
#include "common.h"
#include "half.h"
#include "tiers/extent.h"
#include "trace.h"

/* A communicator is open (requests run), failed (an operation failed here or on another
 * rank, or a rank died: every request, queued or new, answers -ECONNABORTED) or closing
 * (the queue is emptied, new requests answer -ESHUTDOWN). open -> failed is one way; both
 * go to closing at comm_close. */
struct comm {
    struct comm_opts o;
    char name[COMM_NAME_BYTES];
    struct shm *shm;   /* shm and nccl: the rendezvous segment */
    struct nccl *nccl; /* nccl */
    struct mpi *mpi;   /* mpi: MPI, the nodes; shm is then the node's segment */
    int nodes;         /* mpi: more than one, and the collectives go through hier.c */
    char secret[COMM_SECRET_HEX + 1]; /* mpi: the job's, as rank 0 made or had it */
    char node_name[COMM_NAME_BYTES + 16]; /* mpi: the node's segment's name, which it keeps */

    pthread_mutex_t lock; /* everything below */
    pthread_cond_t work_cv, idle_cv;
    struct comm_req *head, *tail;
    unsigned inflight; /* queued or running */
    bool closing, failed;
    struct comm_stats st;
    pthread_t worker;
    bool worker_up;

    pthread_mutex_t pool_lock; /* below */
    struct extent_alloc pool;  /* shm: the rank's pool, by offset */
    char *pool_base;
    struct self_alloc *self_allocs; /* self: what comm_alloc handed out */
};

struct self_alloc {
    void *p;
    struct self_alloc *next;
};

const char *comm_op_name(uint32_t op)
{
    switch (op) {
    case COMM_ALLGATHER:
        return "allgather";
    case COMM_REDUCE_SCATTER:
        return "reduce_scatter";
    case COMM_ALLREDUCE:
        return "allreduce";
    case COMM_BROADCAST:
        return "broadcast";
    case COMM_BARRIER:
        return "barrier";
    case COMM_ALLTOALL:
        return "alltoall";
    case COMM_SEND:
        return "send";
    case COMM_RECV:
        return "recv";
    case COMM_SENDRECV:
        return "sendrecv";
    }
    return "no operation";
}

const char *comm_backend_name(enum comm_backend b)
{
    switch (b) {
    case COMM_SELF:
        return "self";
    case COMM_SHM:
        return "shm";
    case COMM_NCCL:
        return "nccl";
    }
    return "unknown";
}

size_t comm_dtype_bytes(enum comm_dtype dt)
{
    switch (dt) {
    case COMM_BYTE:
        return 1;
    case COMM_F32:
        return 4;
    }
    return 0;
}

size_t comm_wire_bytes(const struct comm_req *q)
{
    return q->wire != COMM_WIRE_F32 ? 2 : comm_dtype_bytes(q->dtype);
}

float comm_wire_round(enum comm_wire w, float x)
{
    switch (w) {
    case COMM_WIRE_F16:
        return half_to_f32(half_from_f32(x));
    case COMM_WIRE_BF16:
        return bf16_to_f32(bf16_from_f32(x));
    case COMM_WIRE_F32:
        break;
    }
    return x;
}

static int self_run(const struct comm_req *q)
{
    size_t bytes = q->count * comm_dtype_bytes(q->dtype);
    switch (q->op) {
    case COMM_ALLGATHER:
    case COMM_REDUCE_SCATTER:
    case COMM_ALLREDUCE:
        if (q->wire != COMM_WIRE_F32) { /* one rank's contribution, as it would travel */
            float *r = q->recv;
            const float *s = q->send;
            bool again = q->op == COMM_ALLREDUCE;
            for (size_t j = 0; j < q->count; j++) {
                float v = comm_wire_round(q->wire, s[j]);
                if (q->acc) v += r[j];
                r[j] = again ? comm_wire_round(q->wire, v) : v;
            }
        } else if (q->acc) {
            float *r = q->recv;
            const float *s = q->send;
            for (size_t j = 0; j < q->count; j++)
                r[j] += s[j];
        } else if (q->recv != q->send) {
            memmove(q->recv, q->send, bytes);
        }
        return 0;
    case COMM_BROADCAST:
    case COMM_BARRIER:
        return 0;
    case COMM_ALLTOALL: /* one rank: its own block */
        if (bytes) memcpy(q->recv, q->send, bytes);
        return 0;
    case COMM_SEND: /* refused at submission: one rank has no peer */
    case COMM_RECV:
    case COMM_SENDRECV:
        break;
    }
    return -EINVAL;
}

/* What each rank sends and receives of a request, in bytes. */
static void req_bytes(const struct comm *c, const struct comm_req *q, uint64_t *in, uint64_t *out)
{
    uint64_t b = (uint64_t)q->count * comm_wire_bytes(q), w = (uint64_t)c->o.world;
    *in = *out = 0;
    switch (q->op) {
    case COMM_ALLGATHER:
        *in = b, *out = b * w;
        return;
    case COMM_REDUCE_SCATTER:
        *in = b * w, *out = b;
        return;
    case COMM_ALLREDUCE:
        *in = *out = b;
        return;
    case COMM_BROADCAST:
        *in = c->o.rank == q->root ? b : 0, *out = c->o.rank == q->root ? 0 : b;
        return;
    case COMM_BARRIER:
        *in = *out = 0;
        return;
    case COMM_ALLTOALL:
        *in = *out = b * w;
        return;
    case COMM_SEND:
        *in = b;
        return;
    case COMM_RECV:
        *out = b;
        return;
    case COMM_SENDRECV:
        *in = *out = b;
        return;
    }
}

static void *worker_main(void *arg)
{
    struct comm *c = arg;
    trace_thread_name("comm");
    if (c->nccl) nccl_bind_thread(c->nccl);
    size_t chunk_bytes = c->o.chunk_bytes ? c->o.chunk_bytes : COMM_DEFAULT_CHUNK_BYTES;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (!c->head && !c->closing)
            pthread_cond_wait(&c->work_cv, &c->lock);
        if (!c->head) break;
        struct comm_req *q = c->head;
        c->head = q->next_;
        if (!c->head) c->tail = NULL;
        bool was_failed = c->failed;
        pthread_mutex_unlock(&c->lock);

        int r = -ECONNABORTED;
        bool pooled = false;
        if (!was_failed && c->shm) shm_begin_op(c->shm, q->op);
        if (!was_failed) {
            switch (c->o.backend) {
            case COMM_SELF:
                r = self_run(q);
                break;
            case COMM_SHM:
                r = p2p_op(q->op) ? p2p_run(c->shm, c->nodes > 1 ? c->mpi : NULL, q)
                    : c->nodes > 1 ? hier_run(c->mpi, c->shm, chunk_bytes, q, &pooled)
                                   : shm_run(c->shm, q, &pooled);
                break;
            case COMM_NCCL:
                /* NCCL spans the nodes itself; only the barrier is the segment's. */
                r = c->nodes > 1 && q->op == COMM_BARRIER
                        ? hier_run(c->mpi, c->shm, chunk_bytes, q, &pooled)
                        : nccl_run(c->nccl, c->shm, q);
                break;
            }
            /* A rank whose operation failed fails the communicator for every rank: the
             * others would wait for it forever. */
            if (r < 0 && c->shm) {
                char why[128];
                snprintf(why, sizeof(why), "rank %d failed an operation: %s", c->o.rank,
                         zinf_strerror(r));
                shm_fail(c->shm, why);
            }
        }

        uint64_t net_out = 0, net_in = 0;
        if (c->mpi) {
            mpi_take_net(c->mpi, &net_out, &net_in);
            if (r < 0) mpi_note_failed();
        }
        pthread_mutex_lock(&c->lock);
        c->st.net_bytes_out += net_out;
        c->st.net_bytes_in += net_in;
        c->st.net_ops += (net_out || net_in) && r == 0;
        if (r < 0) {
            c->failed = true;
        } else {
            uint64_t in, out;
            req_bytes(c, q, &in, &out);
            c->st.ops++;
            c->st.bytes_in += in;
            c->st.bytes_out += out;
            c->st.pooled_ops += pooled;
        }
        pthread_mutex_unlock(&c->lock);
        q->cb(q, r); /* the request is its owner's again from here */
        pthread_mutex_lock(&c->lock);
        if (--c->inflight == 0) pthread_cond_broadcast(&c->idle_cv);
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

/* Under mpi: MPI and the nodes (mpi.c), then the node's ranks meet in their segment as
 * ranks local to it, under "<name>.n<node>", and (nccl) one NCCL communicator spans the
 * world, its id from world rank 0 over MPI. Every rank agrees on the outcome, so that no
 * node goes on into operations that another will never join. */
static int mpi_open_node(struct comm *c)
{
    int r = mpi_open(&c->o, c->name, c->secret, &c->mpi);
    if (r) return r;
    c->o.name = c->name;
    const struct mpi_layout *l = mpi_layout(c->mpi);
    /* mpi_open checked that it fits COMM_NAME_BYTES. */
    snprintf(c->node_name, sizeof(c->node_name), "%s.n%d", c->name, l->node);
    struct comm_opts lo = c->o;
    lo.rank = l->local;
    lo.world = l->local_world;
    lo.name = c->node_name;
    lo.secret = c->secret;
    c->o.secret = c->secret;
    c->st.node = l->node;
    c->st.nodes = l->nodes;
    uint8_t id[SHM_ID_BYTES] = {0};
    if (c->o.backend == COMM_SHM) {
        r = shm_rdv_open(&lo, true, NULL, &c->shm);
        size_t pool_bytes = 0;
        if (r == 0) shm_pool(c->shm, &c->pool_base, &pool_bytes);
        if (r == 0 && pool_bytes) r = extent_init(&c->pool, pool_bytes, ZINF_ALIGN);
    } else {
        if (c->o.rank == 0) r = nccl_unique_id(id);
        r = mpi_agree(c->mpi, r, &c->o);
        if (r == 0) r = mpi_bcast_id(c->mpi, id);
        if (r == 0) r = shm_rdv_open(&lo, false, NULL, &c->shm);
        if (r == 0) r = nccl_open(&c->o, id, &c->nccl);
    }
    r = mpi_agree(c->mpi, r, &c->o);
    if (r == 0) {
        mpi_attach(c->mpi, c->shm, c->o.stop);
        /* A failure the node's segment reports names world ranks, not the node's. */
        shm_name_ranks_from(c->shm, l->first[l->node]);
        c->nodes = l->nodes;
    }
    return r;
}

int comm_open(const struct comm_opts *o, struct comm **out)
{
    if (!out) return -EINVAL;
    *out = NULL;
    if (!o) return -EINVAL;
    if (o->world < 1 || o->world > COMM_MAX_RANKS) {
        log_error("comm: a world of %d ranks (1-%d)", o->world, COMM_MAX_RANKS);
        return -EINVAL;
    }
    if (o->rank < 0 || o->rank >= o->world) {
        log_error("comm: rank %d is not in a world of %d", o->rank, o->world);
        return -EINVAL;
    }
    if (o->backend != COMM_SELF && o->backend != COMM_SHM && o->backend != COMM_NCCL) {
        log_error("comm: unknown backend %d", (int)o->backend);
        return -EINVAL;
    }
    if (o->backend == COMM_SELF && o->world != 1) {
        log_error("comm: the self backend has one rank, not %d", o->world);
        return -EINVAL;
    }
    if (o->mpi && o->backend == COMM_SELF) {
        log_error("comm: the self backend has one rank and no MPI");
        return -EINVAL;
    }
    if (o->mpi && !mpi_built()) {
        log_error("comm: this build has no MPI: install libopenmpi-dev and rebuild");
        if (o->why && o->why_len)
            snprintf(o->why, o->why_len,
                     "this build has no MPI: install libopenmpi-dev and rebuild");
        return -ENOTSUP;
    }
    if (o->backend != COMM_SELF && !(o->mpi && !o->name) && !comm_name_ok(o->name)) {
        size_t len = o->name ? strnlen(o->name, COMM_NAME_BYTES) : 0;
        log_error("comm: the rendezvous name '%.*s%s' is not 1-%d characters of [A-Za-z0-9._-]",
                  40, o->name ? o->name : "(null)", len > 40 ? "..." : "", COMM_NAME_BYTES - 1);
        if (o->why && o->why_len)
            snprintf(o->why, o->why_len, "the rendezvous name is not 1-%d characters of "
                     "[A-Za-z0-9._-]", COMM_NAME_BYTES - 1);
        return -EINVAL;
    }
    if (o->backend == COMM_NCCL && !nccl_built()) {
        log_error("comm: this build has no NCCL (libnccl or nccl.h was not found when it was "
                  "built)");
        return -ENOTSUP;
    }
    struct comm *c = calloc(1, sizeof(*c));
    if (!c) return -ENOMEM;
    c->o = *o;
    snprintf(c->name, sizeof(c->name), "%s", o->name ? o->name : "");
    c->o.name = o->name ? c->name : NULL; /* mpi: NULL until rank 0 names the job */
    c->st.backend = o->backend;
    c->st.rank = o->rank;
    c->st.world = o->world;
    c->st.nodes = 1;
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->work_cv, NULL);
    pthread_cond_init(&c->idle_cv, NULL);
    pthread_mutex_init(&c->pool_lock, NULL);
    int r = 0;
    if (o->mpi) {
        r = mpi_open_node(c);
    } else if (o->backend == COMM_SHM) {
        r = shm_rdv_open(&c->o, true, NULL, &c->shm);
        size_t pool_bytes = 0;
        if (r == 0) shm_pool(c->shm, &c->pool_base, &pool_bytes);
        if (r == 0 && pool_bytes) r = extent_init(&c->pool, pool_bytes, ZINF_ALIGN);
    } else if (o->backend == COMM_NCCL) {
        uint8_t id[SHM_ID_BYTES] = {0};
        if (o->rank == 0) r = nccl_unique_id(id);
        if (r == 0) r = shm_rdv_open(&c->o, false, id, &c->shm);
        if (r == 0) r = nccl_open(&c->o, id, &c->nccl);
    }
    if (r == 0) {
        r = -pthread_create(&c->worker, NULL, worker_main, c);
        c->worker_up = r == 0;
        if (r == 0) pthread_setname_np(c->worker, "zinf-comm");
    }
    if (r < 0) {
        if (c->shm) shm_fail(c->shm, "a rank could not open the communicator");
        comm_close(c);
        return r;
    }
    *out = c;
    return 0;
}

void comm_close(struct comm *c)
{
    if (!c) return;
    pthread_mutex_lock(&c->lock);
    while (c->inflight)
        pthread_cond_wait(&c->idle_cv, &c->lock);
    c->closing = true;
    pthread_cond_broadcast(&c->work_cv);
    pthread_mutex_unlock(&c->lock);
    if (c->worker_up) pthread_join(c->worker, NULL);
    nccl_close(c->nccl);
    shm_rdv_close(c->shm);
    mpi_close(c->mpi);
    extent_fini(&c->pool);
    for (struct self_alloc *a = c->self_allocs, *n; a; a = n) {
        n = a->next;
        free(a->p);
        free(a);
    }
    pthread_mutex_destroy(&c->pool_lock);
    pthread_cond_destroy(&c->idle_cv);
    pthread_cond_destroy(&c->work_cv);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* [a, a + an) and [b, b + bn) share no byte. */
static bool apart(const void *a, size_t an, const void *b, size_t bn)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return an == 0 || bn == 0 || x + an <= y || y + bn <= x;
}

/* send and recv either do not overlap or overlap in the collective's one in-place form
 * (as in NCCL): allreduce send == recv, reduce_scatter recv == send + rank x count,
 * allgather send == recv + rank x count; a reduction that adds onto recv (acc) has none.
 * Any other overlap would have the ranks read data that the collective has already
 * overwritten. */
static bool overlap_ok(const struct comm *c, const struct comm_req *q, size_t bytes)
{
    const char *s = q->send, *r = q->recv;
    size_t all = bytes * (size_t)c->o.world, mine = bytes * (size_t)c->o.rank;
    switch (q->op) {
    case COMM_ALLREDUCE:
        return (s == r && !q->acc) || apart(s, bytes, r, bytes);
    case COMM_REDUCE_SCATTER:
        return (r == s + mine && !q->acc) || apart(s, all, r, bytes);
    case COMM_ALLGATHER:
        return s == r + mine || apart(s, bytes, r, all);
    default:
        return true;
    }
}

/* A point-to-point request's peer (which: "peer" or "recv_peer"): a rank of the world other
 * than this one. */
static bool peer_ok(const struct comm *c, const struct comm_req *q, int peer, const char *which)
{
    if (peer >= 0 && peer < c->o.world && peer != c->o.rank) return true;
    if (peer == c->o.rank)
        log_error("comm: rank %d: %s with %s %d: a rank does not send to or receive from itself",
                  c->o.rank, comm_op_name(q->op), which, peer);
    else
        log_error("comm: rank %d: %s with %s %d: not a rank of a world of %d", c->o.rank,
                  comm_op_name(q->op), which, peer, c->o.world);
    return false;
}

static int req_check(const struct comm *c, const struct comm_req *q)
{
    if (!q->cb || comm_dtype_bytes(q->dtype) == 0) return -EINVAL;
    size_t esz = comm_dtype_bytes(q->dtype);
    if (q->count > SIZE_MAX / esz / (size_t)c->o.world) {
        log_error("comm: %s of %zu elements of %zu bytes at a world of %d: the size overflows",
                  comm_op_name(q->op), q->count, esz, c->o.world);
        return -EINVAL;
    }
    bool reduce = q->op == COMM_REDUCE_SCATTER || q->op == COMM_ALLREDUCE;
    if (reduce && q->dtype != COMM_F32) return -EINVAL;
    if (q->wire != COMM_WIRE_F32) {
        if (!reduce || q->wire > COMM_WIRE_BF16) return -EINVAL;
        if (c->o.backend == COMM_SHM && c->nodes > 1) {
            log_error("comm: rank %d: %s with 16-bit contributions: the shm backend within "
                      "one node only",
                      c->o.rank, comm_op_name(q->op));
            return -ENOTSUP;
        }
    }
    if (q->acc && !reduce) return -EINVAL;
    if (q->acc && c->o.backend == COMM_NCCL) return -ENOTSUP; /* NCCL sums in its own order */
    switch (q->op) {
    case COMM_ALLGATHER:
    case COMM_REDUCE_SCATTER:
    case COMM_ALLREDUCE:
        if (!q->count) return 0;
        if (!q->send || !q->recv) return -EINVAL;
        if (!overlap_ok(c, q, q->count * esz)) {
            log_error("comm: %s of %zu elements: send and recv overlap, and not in its "
                      "in-place form",
                      comm_op_name(q->op), q->count);
            return -EINVAL;
        }
        return 0;
    case COMM_BROADCAST:
        if (q->root < 0 || q->root >= c->o.world) return -EINVAL;
        return q->count && !q->recv ? -EINVAL : 0;
    case COMM_BARRIER:
        return 0;
    case COMM_ALLTOALL: {
        size_t all = q->count * esz * (size_t)c->o.world;
        if (!q->count) return 0;
        if (!q->send || !q->recv) return -EINVAL;
        if (!apart(q->send, all, q->recv, all)) {
            log_error("comm: alltoall of %zu elements: send and recv overlap (it has no in-place "
                      "form)", q->count);
            return -EINVAL;
        }
        return 0;
    }
    case COMM_SEND:
        if (!peer_ok(c, q, q->peer, "peer")) return -EINVAL;
        return q->count && !q->send ? -EINVAL : 0;
    case COMM_RECV:
        if (!peer_ok(c, q, q->peer, "peer")) return -EINVAL;
        return q->count && !q->recv ? -EINVAL : 0;
    case COMM_SENDRECV:
        if (!peer_ok(c, q, q->peer, "peer") || !peer_ok(c, q, q->recv_peer, "recv_peer"))
            return -EINVAL;
        if (!q->count) return 0;
        if (!q->send || !q->recv) return -EINVAL;
        if (!apart(q->send, q->count * esz, q->recv, q->count * esz)) {
            log_error("comm: sendrecv of %zu elements: send and recv overlap", q->count);
            return -EINVAL;
        }
        return 0;
    }
    return -EINVAL;
}

int comm_submit(struct comm *c, struct comm_req *q)
{
    if (!c || !q) return -EINVAL;
    int r = req_check(c, q);
    if (r) return r;
    pthread_mutex_lock(&c->lock);
    if (c->closing || c->failed) {
        r = c->closing ? -ESHUTDOWN : -ECONNABORTED;
        pthread_mutex_unlock(&c->lock);
        return r;
    }
    q->next_ = NULL;
    if (c->tail)
        c->tail->next_ = q;
    else
        c->head = q;
    c->tail = q;
    c->inflight++;
    pthread_cond_signal(&c->work_cv);
    pthread_mutex_unlock(&c->lock);
    return 0;
}

static void run_cb(struct comm_req *q, int res)
{
    completion_post(q->data, res);
}

int comm_run(struct comm *c, struct comm_req *q)
{
    if (!q) return -EINVAL;
    struct completion w = COMPLETION_INIT;
    q->cb = run_cb;
    q->data = &w;
    int r = comm_submit(c, q);
    return r < 0 ? r : completion_wait(&w);
}

int comm_allgather(struct comm *c, const void *send, void *recv, size_t count,
                   enum comm_dtype dt)
{
    struct comm_req q = {.op = COMM_ALLGATHER, .dtype = dt, .send = send, .recv = recv, .count = count};
    return comm_run(c, &q);
}

int comm_reduce_scatter(struct comm *c, const void *send, void *recv, size_t count,
                        enum comm_dtype dt)
{
    struct comm_req q = {
        .op = COMM_REDUCE_SCATTER, .dtype = dt, .send = send, .recv = recv, .count = count};
    return comm_run(c, &q);
}

int comm_allreduce(struct comm *c, const void *send, void *recv, size_t count,
                   enum comm_dtype dt)
{
    struct comm_req q = {.op = COMM_ALLREDUCE, .dtype = dt, .send = send, .recv = recv, .count = count};
    return comm_run(c, &q);
}

int comm_broadcast(struct comm *c, void *buf, size_t count, enum comm_dtype dt, int root)
{
    struct comm_req q = {.op = COMM_BROADCAST, .dtype = dt, .recv = buf, .count = count, .root = root};
    return comm_run(c, &q);
}

int comm_barrier(struct comm *c)
{
    struct comm_req q = {.op = COMM_BARRIER, .dtype = COMM_BYTE};
    return comm_run(c, &q);
}

int comm_alltoall(struct comm *c, const void *send, void *recv, size_t count,
                  enum comm_dtype dt)
{
    struct comm_req q = {.op = COMM_ALLTOALL, .dtype = dt, .send = send, .recv = recv, .count = count};
    return comm_run(c, &q);
}

int comm_send(struct comm *c, const void *buf, size_t count, enum comm_dtype dt, int peer)
{
    struct comm_req q = {.op = COMM_SEND, .dtype = dt, .send = buf, .count = count, .peer = peer};
    return comm_run(c, &q);
}

int comm_recv(struct comm *c, void *buf, size_t count, enum comm_dtype dt, int peer)
{
    struct comm_req q = {.op = COMM_RECV, .dtype = dt, .recv = buf, .count = count, .peer = peer};
    return comm_run(c, &q);
}

int comm_sendrecv(struct comm *c, const void *send, int to, void *recv, int from, size_t count,
                  enum comm_dtype dt)
{
    struct comm_req q = {.op = COMM_SENDRECV, .dtype = dt, .send = send, .recv = recv,
                         .count = count, .peer = to, .recv_peer = from};
    return comm_run(c, &q);
}

void *comm_alloc(struct comm *c, size_t bytes, int *err)
{
    int e = 0;
    void *p = NULL;
    if (!c || bytes == 0) {
        e = -EINVAL;
    } else if (c->o.backend == COMM_NCCL) {
        e = -ENOTSUP;
    } else if (c->o.backend == COMM_SELF) {
        struct self_alloc *a = malloc(sizeof(*a));
        if (!a || posix_memalign(&p, ZINF_ALIGN, bytes) != 0) {
            free(a);
            p = NULL;
            e = -ENOMEM;
        } else {
            pthread_mutex_lock(&c->pool_lock);
            a->p = p;
            a->next = c->self_allocs;
            c->self_allocs = a;
            pthread_mutex_unlock(&c->pool_lock);
        }
    } else if (!c->pool_base) {
        e = -ENOSPC;
    } else {
        uint64_t off;
        pthread_mutex_lock(&c->pool_lock);
        e = extent_alloc(&c->pool, bytes, &off);
        pthread_mutex_unlock(&c->pool_lock);
        if (e == 0) p = c->pool_base + off;
    }
    if (err) *err = e;
    return p;
}

int comm_free(struct comm *c, void *p)
{
    if (!c || !p) return -EINVAL;
    int r = -EINVAL;
    pthread_mutex_lock(&c->pool_lock);
    if (c->o.backend == COMM_SELF) {
        for (struct self_alloc **a = &c->self_allocs; *a; a = &(*a)->next) {
            if ((*a)->p != p) continue;
            struct self_alloc *d = *a;
            *a = d->next;
            free(d->p);
            free(d);
            r = 0;
            break;
        }
    } else if (c->pool_base && (char *)p >= c->pool_base) {
        r = extent_free(&c->pool, (uint64_t)((char *)p - c->pool_base));
    }
    pthread_mutex_unlock(&c->pool_lock);
    return r;
}

void comm_get_stats(struct comm *c, struct comm_stats *out)
{
    if (!out) return;
    *out = (struct comm_stats){0};
    if (!c) return;
    pthread_mutex_lock(&c->lock);
    *out = c->st;
    pthread_mutex_unlock(&c->lock);
}
