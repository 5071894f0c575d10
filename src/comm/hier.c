/*
 * hier.c - the collectives of a communicator across nodes (hier_run of mpi.h): each is
 * node-local operations of the shm backend (shm_run on the node's segment, with local ranks)
 * and the node leaders' point-to-point transfers (mpi.c) between them.
 *
 * Sums go along a chain of the nodes in rank order. Node 0 reduces its ranks' contributions
 * (from recv's contents with acc); its leader hands the partial sum to node 1's leader, whose
 * node broadcasts it locally and adds its own ranks onto it (a local reduction with acc), and
 * so on; the last node holds the result, which goes back along the chain. Every element is
 * thus (((init + s_0) + s_1) + ... + s_{N-1}) in world-rank order, bitwise what one node with
 * all N ranks (or one rank accumulating N contributions) computes: a tree across nodes would
 * add partial sums of different groupings and change the bits. The chain works in chunks of
 * comm_opts.chunk_bytes: while node k + 1 adds chunk c, node k adds chunk c + 1. Its cost:
 * the vector crosses each node boundary once forward and once back.
 *
 * reduce_scatter sends the whole world x count vector along the chain (every shard's chain
 * passes every node), then each node's leader gets its ranks' finished shards. allgather,
 * broadcast and barrier are a node-local step, the leaders' exchange, and a node-local step.
 * alltoall is the one collective whose ranks talk across nodes themselves: each posts its
 * blocks for (and from) every rank of another node by MPI, runs the node-local alltoall of
 * its node's blocks meanwhile (which needs only its node's ranks, none of which waits on
 * MPI before it), then waits for its transfers. Through the leaders the blocks would cross
 * twice.
 *
 * Not here: MPI itself and the waits (mpi.c), the node-local data movement (shm_coll.c),
 * the case of one node (comm.c runs shm_run directly).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "comm/mpi.h"
#include "common.h"

enum { TAG_FWD = 1, TAG_BACK, TAG_INIT, TAG_GATHER, TAG_BCAST, TAG_BARRIER };

struct hier {
    struct mpi *m;
    struct shm *s;
    const struct mpi_layout *l;
    size_t per;   /* floats per chunk of the chain */
    bool leader;  /* the node's local rank 0 */
    bool *pooled; /* a local step read the pools in place */
};

/* One node-local operation; counts in elements of dt. */
static int local(struct hier *h, enum comm_op op, enum comm_dtype dt, const void *send,
                 void *recv, size_t count, bool acc, int root)
{
    struct comm_req q = {.op = op, .dtype = dt, .send = send, .recv = recv, .count = count,
                         .acc = acc, .root = root};
    bool p = false;
    int r = shm_run(h->s, &q, &p);
    *h->pooled |= p;
    return r;
}

static int local_bcast(struct hier *h, void *buf, size_t bytes, int root)
{
    return bytes ? local(h, COMM_BROADCAST, COMM_BYTE, NULL, buf, bytes, false, root) : 0;
}

/* The chain forward: buf (n floats on every rank) gets, on the last node, the sum of every
 * rank's send in rank order, starting from buf's contents on node 0 where init; the other
 * nodes keep their partial sums. tmp (per floats) holds a chunk of send where send is buf.
 * back: the last node's leader also sends each finished chunk back to node K - 2. */
static int chain(struct hier *h, const float *send, float *buf, size_t n, bool init, float *tmp,
                 bool back)
{
    int k = h->l->node, last = h->l->nodes - 1, r = 0;
    for (size_t j = 0; j < n && !r; j += h->per) {
        size_t m = MIN(h->per, n - j);
        const float *src = send + j;
        if (k > 0) {
            if (tmp) {
                memcpy(tmp, src, m * sizeof(float));
                src = tmp;
            }
            if (h->leader && (r = mpi_recv(h->m, k - 1, buf + j, m * sizeof(float), TAG_FWD)))
                break;
            if ((r = local_bcast(h, buf + j, m * sizeof(float), 0))) break;
        }
        if ((r = local(h, COMM_ALLREDUCE, COMM_F32, src, buf + j, m, init || k > 0, 0))) break;
        if (h->leader && k < last) r = mpi_send(h->m, k + 1, buf + j, m * sizeof(float), TAG_FWD);
        if (!r && h->leader && back && k == last)
            r = mpi_send(h->m, k - 1, buf + j, m * sizeof(float), TAG_BACK);
    }
    if (!r && h->leader) r = mpi_flush(h->m);
    return r;
}

/* The chain back: every node but the last gets the last node's buf, chunk by chunk, its
 * leader passing each on to the node before it. */
static int chain_back(struct hier *h, float *buf, size_t n)
{
    int k = h->l->node, r = 0;
    if (k == h->l->nodes - 1) return 0;
    for (size_t j = 0; j < n && !r; j += h->per) {
        size_t m = MIN(h->per, n - j);
        if (h->leader) {
            if ((r = mpi_recv(h->m, k + 1, buf + j, m * sizeof(float), TAG_BACK))) break;
            if (k > 0 && (r = mpi_send(h->m, k - 1, buf + j, m * sizeof(float), TAG_BACK))) break;
        }
        r = local_bcast(h, buf + j, m * sizeof(float), 0);
    }
    if (!r && h->leader) r = mpi_flush(h->m);
    return r;
}

static int allreduce(struct hier *h, const struct comm_req *q)
{
    float *tmp = NULL;
    if (h->l->node > 0 && q->send == q->recv) {
        tmp = malloc(h->per * sizeof(float));
        if (!tmp) return -ENOMEM;
    }
    int r = chain(h, q->send, q->recv, q->count, q->acc, tmp, true);
    if (!r) r = chain_back(h, q->recv, q->count);
    free(tmp);
    return r;
}

/* The whole world x count vector goes along the chain (from every rank's recv where acc,
 * gathered on node 0 first); then each node's leader gets its ranks' shards from the last
 * node, and each rank takes its own. */
static int reduce_scatter(struct hier *h, const struct comm_req *q, int rank)
{
    const struct mpi_layout *l = h->l;
    int k = l->node, last = l->nodes - 1, world = l->first[last] + l->size[last];
    size_t count = q->count, shard = count * sizeof(float);
    float *v = malloc((size_t)world * shard);
    if (!v) return -ENOMEM;
    int r = 0;
    if (q->acc) {
        /* Every rank's recv, into v on node 0's ranks. */
        r = local(h, COMM_ALLGATHER, COMM_BYTE, q->recv, v + (size_t)l->first[k] * count, shard,
                  false, 0);
        if (!r && h->leader && k > 0) {
            r = mpi_send(h->m, 0, v + (size_t)l->first[k] * count, l->size[k] * shard, TAG_INIT);
            if (!r) r = mpi_flush(h->m);
        }
        if (!r && k == 0) {
            for (int p = 1; p <= last && h->leader && !r; p++)
                r = mpi_recv(h->m, p, v + (size_t)l->first[p] * count, l->size[p] * shard,
                             TAG_INIT);
            if (!r) r = local_bcast(h, v + (size_t)l->size[0] * count,
                                    (size_t)(world - l->size[0]) * shard, 0);
        }
    }
    if (!r) r = chain(h, q->send, v, (size_t)world * count, q->acc, NULL, false);
    float *mine = v + (size_t)l->first[k] * count;
    if (!r && k == last) {
        for (int p = 0; p < last && h->leader && !r; p++)
            r = mpi_send(h->m, p, v + (size_t)l->first[p] * count, l->size[p] * shard, TAG_BACK);
        if (!r && h->leader) r = mpi_flush(h->m);
    } else if (!r) {
        if (h->leader) r = mpi_recv(h->m, last, mine, l->size[k] * shard, TAG_BACK);
        if (!r) r = local_bcast(h, mine, l->size[k] * shard, 0);
    }
    /* In place, recv is part of send, read by now. */
    if (!r) memcpy(q->recv, v + (size_t)rank * count, shard);
    free(v);
    return r;
}

/* Each node gathers its ranks' parts into its slice of recv; the leaders exchange slices;
 * each node broadcasts the slices it lacks. */
static int allgather(struct hier *h, const struct comm_req *q)
{
    const struct mpi_layout *l = h->l;
    int k = l->node, last = l->nodes - 1, world = l->first[last] + l->size[last];
    size_t bytes = q->count * comm_dtype_bytes(q->dtype);
    char *recv = q->recv, *slice = recv + (size_t)l->first[k] * bytes;
    int r = local(h, COMM_ALLGATHER, COMM_BYTE, q->send, slice, bytes, false, 0);
    if (!r && h->leader) {
        for (int p = 0; p <= last && !r; p++)
            if (p != k) r = mpi_send(h->m, p, slice, l->size[k] * bytes, TAG_GATHER);
        for (int p = 0; p <= last && !r; p++)
            if (p != k)
                r = mpi_recv(h->m, p, recv + (size_t)l->first[p] * bytes, l->size[p] * bytes,
                             TAG_GATHER);
        if (!r) r = mpi_flush(h->m);
    }
    if (!r) r = local_bcast(h, recv, (size_t)l->first[k] * bytes, 0);
    if (!r)
        r = local_bcast(h, slice + l->size[k] * bytes,
                        (size_t)(world - l->first[k] - l->size[k]) * bytes, 0);
    return r;
}

static int node_of(const struct mpi_layout *l, int rank)
{
    int k = 0;
    while (k + 1 < l->nodes && l->first[k + 1] <= rank)
        k++;
    return k;
}

static int broadcast(struct hier *h, const struct comm_req *q)
{
    const struct mpi_layout *l = h->l;
    int k = l->node, from = node_of(l, q->root), r = 0;
    size_t bytes = q->count * comm_dtype_bytes(q->dtype);
    if (k == from) {
        r = local_bcast(h, q->recv, bytes, q->root - l->first[k]);
        for (int p = 0; p < l->nodes && h->leader && !r; p++)
            if (p != k) r = mpi_send(h->m, p, q->recv, bytes, TAG_BCAST);
        if (!r && h->leader) r = mpi_flush(h->m);
    } else {
        if (h->leader) r = mpi_recv(h->m, from, q->recv, bytes, TAG_BCAST);
        if (!r) r = local_bcast(h, q->recv, bytes, 0);
    }
    return r;
}

static int alltoall(struct hier *h, const struct comm_req *q)
{
    const struct mpi_layout *l = h->l;
    int k = l->node, last = l->nodes - 1, world = l->first[last] + l->size[last], r = 0;
    size_t bytes = q->count * comm_dtype_bytes(q->dtype);
    const char *send = q->send;
    char *recv = q->recv;
    for (int p = 0; p < world && !r; p++) {
        if (p >= l->first[k] && p < l->first[k] + l->size[k]) continue;
        r = mpi_p2p_post(h->m, false, p, recv + (size_t)p * bytes, bytes, MPI_TAG_ALLTOALL);
        if (!r)
            r = mpi_p2p_post(h->m, true, p, (void *)(send + (size_t)p * bytes), bytes,
                             MPI_TAG_ALLTOALL);
    }
    if (!r)
        r = local(h, COMM_ALLTOALL, COMM_BYTE, send + (size_t)l->first[k] * bytes,
                  recv + (size_t)l->first[k] * bytes, bytes, false, 0);
    if (!r) r = mpi_p2p_wait(h->m);
    return r;
}

/* Every node's ranks in, the leaders through node 0's, every node's ranks out. */
static int barrier(struct hier *h)
{
    int r = local(h, COMM_BARRIER, COMM_BYTE, NULL, NULL, 0, false, 0), k = h->l->node;
    char none = 0;
    if (!r && h->leader) {
        if (k == 0) {
            for (int p = 1; p < h->l->nodes && !r; p++)
                r = mpi_recv(h->m, p, &none, 0, TAG_BARRIER);
            for (int p = 1; p < h->l->nodes && !r; p++)
                r = mpi_send(h->m, p, &none, 0, TAG_BARRIER);
        } else {
            r = mpi_send(h->m, 0, &none, 0, TAG_BARRIER);
            if (!r) r = mpi_recv(h->m, 0, &none, 0, TAG_BARRIER);
        }
        if (!r) r = mpi_flush(h->m);
    }
    if (!r) r = local(h, COMM_BARRIER, COMM_BYTE, NULL, NULL, 0, false, 0);
    return r;
}

int hier_run(struct mpi *m, struct shm *s, size_t chunk_bytes, const struct comm_req *q,
             bool *pooled)
{
    const struct mpi_layout *l = mpi_layout(m);
    struct hier h = {.m = m, .s = s, .l = l, .per = MAX(chunk_bytes / sizeof(float), 1),
                     .leader = l->local == 0, .pooled = pooled};
    *pooled = false;
    mpi_begin_op(m, q->op);
    int rank = l->first[l->node] + l->local, r = -EINVAL;
    switch (q->op) {
    case COMM_ALLREDUCE:
        r = q->count ? allreduce(&h, q) : 0;
        break;
    case COMM_REDUCE_SCATTER:
        r = q->count ? reduce_scatter(&h, q, rank) : 0;
        break;
    case COMM_ALLGATHER:
        r = q->count ? allgather(&h, q) : 0;
        break;
    case COMM_BROADCAST:
        r = q->count ? broadcast(&h, q) : 0;
        break;
    case COMM_BARRIER:
        r = barrier(&h);
        break;
    case COMM_ALLTOALL:
        r = q->count ? alltoall(&h, q) : 0;
        break;
    default: /* point-to-point: p2p.c */
        break;
    }
    /* A leader whose node failed (a local step answered an error) ends the job: the other
     * nodes' leaders would wait for it until their deadline; so does a rank with its own
     * transfers posted (MPI cannot take them back). The transfers' own failures have done
     * so already. */
    if (r < 0 && (h.leader || mpi_p2p_posted(m))) {
        char why[200];
        snprintf(why, sizeof(why), "node %d (leader rank %d) failed %s: %s", l->node, rank,
                 comm_op_name(q->op), zinf_strerror(r));
        mpi_abort(m, why);
    }
    return r;
}
