/*
 * p2p.c - the shm backend's point-to-point operations (p2p.h): a send, a receive, or both
 * halves of a sendrecv, each to a peer of this node (a channel of the segment, shm_p2p.c) or
 * of another node (MPI point-to-point from this rank itself, not through the leaders: only
 * the two ranks take part, and the leaders may be busy with operations of their own).
 *
 * The halves progress together in one loop: each pass moves what the channels take and
 * tests the MPI transfers, so a sendrecv whose peers do the same never waits on itself.
 * A pass that moved nothing spins a little, then sleeps; the waits watch for dead ranks,
 * a failed communicator and the operation's deadline, as the barrier's do, and name the
 * rank that did not come.
 *
 * Not here: the channels' rings (shm_p2p.c), MPI's requests (mpi.c), the collectives.
 */
#include <errno.h>
#include <stdio.h>
#include <time.h>

#include "comm/p2p.h"
#include "common.h"

#define SPIN_ROUNDS 2000
#define NAP_NS 50000                  /* a sleep between passes that moved nothing */
#define CHECK_NS (20 * 1000000ull)    /* how often the wait looks for dead ranks */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

struct half {
    bool on, send, remote, done;
    int peer; /* world rank */
    struct shm_msg msg;
};

/* The node of world rank `rank`, and its first rank. */
static int node_of(const struct mpi_layout *l, int rank)
{
    int k = 0;
    while (k + 1 < l->nodes && l->first[k + 1] <= rank)
        k++;
    return k;
}

static int start(struct shm *s, struct mpi *m, struct half *h, bool send, int peer, void *buf,
                 size_t bytes)
{
    *h = (struct half){.on = true, .send = send, .peer = peer};
    const struct mpi_layout *l = m ? mpi_layout(m) : NULL;
    int first = l ? l->first[l->node] : 0;
    if (l && node_of(l, peer) != l->node) {
        h->remote = true;
        return mpi_p2p_post(m, send, peer, buf, bytes, MPI_TAG_P2P);
    }
    (void)s;
    shm_msg_init(&h->msg, peer - first, buf, bytes);
    return 0;
}

static int step(struct shm *s, struct half *h, bool *moved)
{
    if (!h->on || h->remote || h->done) return 0;
    int r = h->send ? shm_msg_send(s, &h->msg, moved) : shm_msg_recv(s, &h->msg, moved);
    h->done = r == 0 && shm_msg_done(&h->msg);
    return r;
}

int p2p_run(struct shm *s, struct mpi *m, const struct comm_req *q)
{
    size_t bytes = q->count * comm_dtype_bytes(q->dtype);
    int r = shm_failed(s);
    if (r) return r;
    if (m) mpi_begin_op(m, q->op);
    struct half h[2] = {{0}};
    if (q->op != COMM_RECV) r = start(s, m, &h[0], true, q->peer, (void *)q->send, bytes);
    if (!r && q->op != COMM_SEND)
        r = start(s, m, &h[1], false, q->op == COMM_RECV ? q->peer : q->recv_peer, q->recv, bytes);
    bool remote = h[0].remote || h[1].remote, remote_done = !remote;
    uint64_t checked = now_ns();
    bool gone = false; /* a local peer was found gone: one more pass takes what it left */
    for (unsigned spin = 0; !r; spin++) {
        bool moved = false;
        r = step(s, &h[0], &moved);
        if (!r) r = step(s, &h[1], &moved);
        if (!r && !remote_done) r = mpi_p2p_test(m, &remote_done);
        if (r) break;
        bool local_done = (!h[0].on || h[0].remote || h[0].done) &&
                          (!h[1].on || h[1].remote || h[1].done);
        if (local_done && remote_done) break;
        if (moved) {
            spin = 0;
            continue;
        }
        if (gone) {
            const struct half *w = h[0].on && !h[0].remote && !h[0].done ? &h[0] : &h[1];
            char why[160], what[200];
            shm_peer_check(s, w->msg.peer, why, sizeof(why));
            snprintf(what, sizeof(what), "%s, its %s rank %d unfinished", why,
                     w->send ? "send to" : "receive from", w->peer);
            shm_fail(s, what);
            r = -ECONNABORTED;
            break;
        }
        if (spin < SPIN_ROUNDS) {
            cpu_relax();
            continue;
        }
        nanosleep(&(struct timespec){0, NAP_NS}, NULL);
        uint64_t now = now_ns();
        if (now - checked >= CHECK_NS) {
            checked = now;
            /* Only the peers of this operation: the other ranks may be done and gone. */
            char why[160];
            for (int i = 0; i < 2 && !r; i++) {
                if (!h[i].on || h[i].remote || h[i].done) continue;
                int g = shm_peer_check(s, h[i].msg.peer, why, sizeof(why));
                if (g < 0) r = g;
                gone |= g == 1;
            }
            if (r) break;
            if (!remote_done && (r = mpi_p2p_check(m))) break;
        }
        if (!local_done && shm_op_late(s)) {
            /* The local half still waiting names its peer. */
            const struct half *w = h[0].on && !h[0].remote && !h[0].done ? &h[0] : &h[1];
            char what[64];
            snprintf(what, sizeof(what), "its %s rank %d", w->send ? "send to" : "receive from",
                     w->peer);
            r = shm_p2p_late(s, w->msg.peer, what);
        }
    }
    if (r == -ECONNABORTED) shm_log_failed(s);
    /* A rank with transfers across nodes still posted, or whose peer on another node waits
     * for it, ends the job: MPI cannot take a posted transfer back. */
    if (r < 0 && m && remote) {
        char why[160];
        snprintf(why, sizeof(why), "%s with a rank of another node failed: %s",
                 comm_op_name(q->op), zinf_strerror(r));
        mpi_abort(m, why);
    }
    return r;
}
