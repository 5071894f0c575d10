/*
 * shm_p2p.c - the shm backend's point-to-point channels (shm_msg_* of shm.h): one per ordered
 * pair of a node's ranks, in the segment after the pools, each a ring that only its sender
 * writes and only its receiver reads.
 *
 * A channel is two counters, each on a cache line of its own, and a ring of `ring` bytes:
 * put, the bytes the sender has written so far, and got, those the receiver has read. The
 * sender writes at put % ring while put - got < ring, then publishes put (release); the
 * receiver reads up to the put it loads (acquire) and publishes got (release), which the
 * sender loads (acquire) before it writes over what was read. Each message is its size (8
 * bytes) and then its bytes, so a receive that expects another size is found at once.
 * Messages of a channel are thus matched in order: the k-th send from a to b with b's k-th
 * receive from a.
 *
 * Not here: waiting, and the halves of a sendrecv progressing together (p2p.c); the
 * segment (shm.c); the collectives (shm_coll.c).
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "comm/shm.h"
#include "comm/shm_int.h"
#include "common.h"

#define HDR_BYTES sizeof(uint64_t)

struct chan {
    _Atomic uint64_t put; /* written by the sender */
    char pad0[56];
    _Atomic uint64_t got; /* written by the receiver */
    char pad1[56];
};

size_t shm_chan_bytes(int world, size_t chunk, size_t *ring)
{
    /* One rank has no peer; the nccl backend's segment (no staging) moves nothing itself.
     * chunk is a multiple of 64 x world (shm_rdv_open), so each ring is of 64 bytes. */
    *ring = world > 1 && chunk ? chunk / (size_t)world : 0;
    if (!*ring) return 0;
    size_t pairs = (size_t)world * (size_t)world;
    return align_up(pairs * sizeof(struct chan), ZINF_ALIGN) + pairs * *ring;
}

static struct chan *chan(struct shm *s, int from, int to)
{
    return (struct chan *)(void *)s->chans + (size_t)from * (size_t)s->world + (size_t)to;
}

static char *ring(struct shm *s, int from, int to)
{
    size_t pairs = (size_t)s->world * (size_t)s->world;
    return s->chans + align_up(pairs * sizeof(struct chan), ZINF_ALIGN) +
           ((size_t)from * (size_t)s->world + (size_t)to) * s->ring;
}

/* Up to n bytes of src into the channel to `to`: how many went. */
static size_t ring_put(struct shm *s, int to, const char *src, size_t n)
{
    struct chan *c = chan(s, s->rank, to);
    uint64_t put = atomic_load_explicit(&c->put, memory_order_relaxed); /* ours alone */
    uint64_t got = atomic_load_explicit(&c->got, memory_order_acquire); /* read by then */
    n = MIN(n, s->ring - (size_t)(put - got));
    if (!n) return 0;
    char *r = ring(s, s->rank, to);
    size_t at = (size_t)(put % s->ring), first = MIN(n, s->ring - at);
    memcpy(r + at, src, first);
    memcpy(r, src + first, n - first);
    /* The bytes are in the ring before the receiver can see put cover them. */
    atomic_store_explicit(&c->put, put + n, memory_order_release);
    return n;
}

/* Up to n bytes from the channel from `from` into dst: how many came. */
static size_t ring_get(struct shm *s, int from, char *dst, size_t n)
{
    struct chan *c = chan(s, from, s->rank);
    uint64_t got = atomic_load_explicit(&c->got, memory_order_relaxed); /* ours alone */
    uint64_t put = atomic_load_explicit(&c->put, memory_order_acquire); /* written by then */
    n = MIN(n, (size_t)(put - got));
    if (!n) return 0;
    const char *r = ring(s, from, s->rank);
    size_t at = (size_t)(got % s->ring), first = MIN(n, s->ring - at);
    memcpy(dst, r + at, first);
    memcpy(dst + first, r, n - first);
    /* The bytes are read before the sender can see got free them for writing. */
    atomic_store_explicit(&c->got, got + n, memory_order_release);
    return n;
}

void shm_msg_init(struct shm_msg *m, int peer, const void *buf, size_t bytes)
{
    *m = (struct shm_msg){.peer = peer, .buf = (char *)buf, .bytes = bytes, .hdr = bytes};
}

bool shm_msg_done(const struct shm_msg *m)
{
    return m->moved == HDR_BYTES + m->bytes;
}

int shm_msg_send(struct shm *s, struct shm_msg *m, bool *moved)
{
    if (!s->chans) return -EINVAL;
    while (!shm_msg_done(m)) {
        size_t n;
        if (m->moved < HDR_BYTES)
            n = ring_put(s, m->peer, (const char *)&m->hdr + m->moved, HDR_BYTES - m->moved);
        else
            n = ring_put(s, m->peer, m->buf + (m->moved - HDR_BYTES), m->bytes - (m->moved - HDR_BYTES));
        if (!n) break;
        m->moved += n;
        *moved = true;
    }
    return 0;
}

int shm_msg_recv(struct shm *s, struct shm_msg *m, bool *moved)
{
    if (!s->chans) return -EINVAL;
    while (!shm_msg_done(m)) {
        size_t n;
        if (m->moved < HDR_BYTES) {
            n = ring_get(s, m->peer, (char *)&m->hdr + m->moved, HDR_BYTES - m->moved);
            if (m->moved + n == HDR_BYTES && m->hdr != m->bytes) {
                char why[WHY_BYTES];
                snprintf(why, sizeof(why),
                         "rank %d sent %llu bytes to rank %d, whose receive from it takes %zu",
                         s->first + m->peer, (unsigned long long)m->hdr, s->first + s->rank,
                         m->bytes);
                shm_fail(s, why);
                log_error("comm %s: rank %d: %s", s->job, s->first + s->rank, why);
                return -EPROTO;
            }
        } else {
            n = ring_get(s, m->peer, m->buf + (m->moved - HDR_BYTES), m->bytes - (m->moved - HDR_BYTES));
        }
        if (!n) break;
        m->moved += n;
        *moved = true;
    }
    return 0;
}

int shm_p2p_late(struct shm *s, int peer, const char *what)
{
    char why[WHY_BYTES];
    struct shm_rank *q = &s->h->ranks[peer];
    int32_t pid = atomic_load_explicit(&q->pid, memory_order_relaxed);
    char st = comm_proc_state(pid), in[64] = "has begun no operation";
    uint64_t seq = atomic_load(&q->seq);
    if (seq)
        snprintf(in, sizeof(in), "is in %s #%llu", comm_op_name(atomic_load(&q->op)),
                 (unsigned long long)seq);
    snprintf(why, sizeof(why),
             "rank %d (pid %d%s) did not take part in rank %d's %s #%llu (%s) within %.3g s: it "
             "%s",
             s->first + peer, (int)pid, st == 'T' || st == 't' ? ", stopped" : "",
             s->first + s->rank, comm_op_name(atomic_load(&s->h->ranks[s->rank].op)),
             (unsigned long long)s->seq, what, s->op_timeout_ms / 1000.0, in);
    shm_fail(s, why);
    log_error("comm %s: rank %d: %s", s->job, s->first + s->rank, why);
    return -ETIMEDOUT;
}

void shm_log_failed(struct shm *s)
{
    log_error("comm %s: rank %d: %s", s->job, s->first + s->rank, shm_fail_reason(s));
}
