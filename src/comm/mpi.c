/*
 * mpi.c - the MPI plumbing of a communicator across nodes (mpi.h): MPI initialised once per
 * process, each communicator's own copy of MPI_COMM_WORLD, the layout of the ranks into
 * nodes (physical, or ZINF_COMM_RANKS_PER_NODE's), the job's name and secret agreed on, and
 * the leaders' point-to-point transfers with waits that poll.
 *
 * Only point-to-point messages move data between nodes, never MPI's reductions: the order of
 * every sum is the caller's (hier.c), and each byte that crosses nodes is counted here. The
 * collectives MPI does run (a broadcast, allgathers, splits) are the opening's agreement on
 * who is where. A wait polls MPI_Test with short sleeps so that it can watch, between polls,
 * the node's segment (a local rank died or failed), the operation's deadline and the stop
 * flag: a leader that gives up fails its node's segment (its local ranks fail within about
 * 100 ms) and aborts the job (mpirun then ends every other rank).
 *
 * Not here: which transfers make a collective (hier.c), the node-local data movement
 * (shm_coll.c), the queue (comm.c).
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "comm/mpi.h"
#include "common.h"

#if ZINF_HAVE_MPI
#include <mpi.h>

/* Messages are cut into pieces of at most this many bytes (MPI counts are ints). */
#define PIECE_BYTES ((size_t)1 << 30)
#define POLL_MIN_US 20
#define POLL_MAX_US 1000

/* The process's MPI: initialised once (by us, or before us by the program), and whether
 * every call must be serialised (a thread level below MPI_THREAD_MULTIPLE). */
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static bool inited, serial;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
static int open_comms;      /* under init_lock */
static _Atomic bool failed; /* a communicator across nodes failed in this process */

#define LOCKED(expr)                                                                               \
    ({                                                                                             \
        if (serial) pthread_mutex_lock(&call_lock);                                                \
        int e_ = (expr);                                                                           \
        if (serial) pthread_mutex_unlock(&call_lock);                                              \
        e_;                                                                                        \
    })

struct mpi {
    MPI_Comm world;   /* this communicator's copy of MPI_COMM_WORLD */
    MPI_Comm leaders; /* the nodes' leaders, by node; MPI_COMM_NULL on the others */
    struct mpi_layout l;
    int rank;
    int phys[COMM_MAX_RANKS]; /* each world rank's physical node: its first world rank */
    struct shm *s;
    const volatile sig_atomic_t *stop;
    MPI_Request *pend; /* posted sends */
    size_t npend, cap;
    /* mpi_p2p_post's transfers: requests, and per request its peer and, for a receive,
     * the bytes it must get (SIZE_MAX: a send) */
    MPI_Request *p2p;
    struct p2p_want {
        int rank;
        size_t bytes;
    } *want;
    size_t np2p, p2p_cap;
    uint64_t net_out, net_in;
    uint32_t op; /* the operation in progress (enum comm_op), for the reasons */
    bool aborted;
};

bool mpi_built(void)
{
    return true;
}

/* At exit: finalise, unless a communicator across nodes failed or is still open (then a
 * peer may wait on this process forever; aborting ends the job instead). */
static void at_exit(void)
{
    int done = 0;
    MPI_Finalized(&done);
    if (done) return;
    if (failed || open_comms > 0) MPI_Abort(MPI_COMM_WORLD, 1);
    MPI_Finalize();
}

void mpi_note_failed(void)
{
    failed = true;
}

/* Says why, in the log and in o->why. */
__attribute__((format(printf, 2, 3))) static void say(const struct comm_opts *o, const char *fmt,
                                                      ...)
{
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    log_error("comm: rank %d: %s", o->rank, msg);
    if (o->why && o->why_len) snprintf(o->why, o->why_len, "%s", msg);
}

static int mpi_err(const struct comm_opts *o, int e, const char *call)
{
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(e, s, &len);
    say(o, "%s: %.*s", call, len, s);
    return -EIO;
}

static int init_once(const struct comm_opts *o)
{
    int r = 0;
    pthread_mutex_lock(&init_lock);
    if (!inited) {
        int is = 0, fin = 0, provided = 0;
        MPI_Finalized(&fin);
        MPI_Initialized(&is);
        if (fin) {
            say(o, "MPI was finalised already in this process");
            r = -EPROTO;
        } else if (!is) {
            int e = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
            if (e != MPI_SUCCESS) r = mpi_err(o, e, "MPI_Init_thread");
            else atexit(at_exit);
        } else {
            MPI_Query_thread(&provided);
        }
        if (r == 0 && provided < MPI_THREAD_SERIALIZED) {
            say(o, "MPI gives thread level %d, below MPI_THREAD_SERIALIZED: the communicator's "
                   "worker thread calls MPI (build Open MPI with thread support, or initialise "
                   "MPI with MPI_Init_thread)",
                provided);
            r = -ENOTSUP;
        }
        if (r == 0) {
            serial = provided < MPI_THREAD_MULTIPLE;
            inited = true;
        }
    }
    if (r == 0) open_comms++;
    pthread_mutex_unlock(&init_lock);
    return r;
}

static int random_hex(char *out, size_t digits)
{
    uint8_t b[32];
    size_t n = (digits + 1) / 2;
    if (n > sizeof(b) || getrandom(b, n, 0) != (ssize_t)n) return -EIO;
    for (size_t i = 0; i < digits; i++)
        out[i] = "0123456789abcdef"[(b[i / 2] >> (i % 2 ? 0 : 4)) & 15];
    out[digits] = 0;
    return 0;
}

/* What every rank says of itself at the opening, gathered by all. */
struct hello {
    int32_t rank, world, phys, agrees; /* agrees: its name and secret are rank 0's */
};

/* The nodes: ZINF_COMM_RANKS_PER_NODE's, else the physical ones, which must be
 * consecutive world ranks. */
static int make_layout(const struct comm_opts *o, struct mpi *m, int world)
{
    int node_of[COMM_MAX_RANKS];
    const char *env = getenv("ZINF_COMM_RANKS_PER_NODE");
    if (env && *env) {
        char *end;
        long L = strtol(env, &end, 10);
        if (*end || L < 1 || L > world) {
            say(o, "ZINF_COMM_RANKS_PER_NODE=%s is not a number of ranks from 1 to %d", env,
                world);
            return -EINVAL;
        }
        for (int w = 0; w < world; w++) {
            node_of[w] = w / (int)L;
            if (m->phys[w] != m->phys[w / (int)L * (int)L]) {
                say(o, "ZINF_COMM_RANKS_PER_NODE=%ld puts ranks %d and %d in one node, but they "
                       "run on different machines",
                    L, w / (int)L * (int)L, w);
                return -EINVAL;
            }
        }
    } else {
        int k = -1;
        for (int w = 0; w < world; w++) {
            if (m->phys[w] == w) {
                k++;
            } else if (w == 0 || m->phys[w] != m->phys[w - 1]) {
                say(o, "the ranks of a node are not consecutive (rank %d runs beside rank %d, "
                       "rank %d between them elsewhere): start the job with mpirun --map-by slot "
                       "(the default), not --map-by node",
                    w, m->phys[w], w - 1);
                return -EINVAL;
            }
            node_of[w] = k;
        }
    }
    struct mpi_layout *l = &m->l;
    l->nodes = 0;
    for (int w = 0; w < world; w++) {
        if (w == 0 || node_of[w] != node_of[w - 1]) {
            l->first[l->nodes] = w;
            l->size[l->nodes++] = 0;
        }
        l->size[l->nodes - 1]++;
    }
    l->node = node_of[m->rank];
    l->local = m->rank - l->first[l->node];
    l->local_world = l->size[l->node];
    return 0;
}

int mpi_open(const struct comm_opts *o, char *name, char *secret, struct mpi **out)
{
    *out = NULL;
    int r = init_once(o);
    if (r) return r;
    struct mpi *m = calloc(1, sizeof(*m));
    if (!m) {
        r = -ENOMEM;
        goto err_count;
    }
    m->world = m->leaders = MPI_COMM_NULL;
    int e = LOCKED(MPI_Comm_dup(MPI_COMM_WORLD, &m->world));
    if (e != MPI_SUCCESS) {
        r = mpi_err(o, e, "MPI_Comm_dup");
        goto err;
    }
    int world = 0;
    LOCKED(MPI_Comm_set_errhandler(m->world, MPI_ERRORS_RETURN));
    LOCKED(MPI_Comm_rank(m->world, &m->rank));
    LOCKED(MPI_Comm_size(m->world, &world));
    if (world > COMM_MAX_RANKS) {
        say(o, "mpirun started %d ranks; a communicator has at most %d", world, COMM_MAX_RANKS);
        r = -EPROTO;
        goto err;
    }

    /* The physical node of this rank: the first world rank that shares its memory. */
    MPI_Comm here;
    int phys = m->rank;
    e = LOCKED(MPI_Comm_split_type(m->world, MPI_COMM_TYPE_SHARED, m->rank, MPI_INFO_NULL,
                                   &here));
    if (e == MPI_SUCCESS) {
        e = LOCKED(MPI_Bcast(&phys, 1, MPI_INT, 0, here));
        LOCKED(MPI_Comm_free(&here));
    }
    if (e != MPI_SUCCESS) {
        r = mpi_err(o, e, "MPI_Comm_split_type");
        goto err;
    }

    /* Rank 0's name and secret (its own, or new), to every rank. */
    char job[COMM_NAME_BYTES + COMM_SECRET_HEX + 1] = {0};
    if (m->rank == 0) {
        if (o->name) snprintf(job, COMM_NAME_BYTES, "%s", o->name);
        else if ((r = random_hex(stpcpy(job, "mpi-"), 16))) goto err;
        if (o->secret) memcpy(job + COMM_NAME_BYTES, o->secret, COMM_SECRET_HEX);
        else if ((r = random_hex(job + COMM_NAME_BYTES, COMM_SECRET_HEX))) goto err;
    }
    e = LOCKED(MPI_Bcast(job, (int)sizeof(job), MPI_CHAR, 0, m->world));
    if (e != MPI_SUCCESS) {
        r = mpi_err(o, e, "MPI_Bcast");
        goto err;
    }
    job[COMM_NAME_BYTES - 1] = 0;
    snprintf(name, COMM_NAME_BYTES, "%s", job);
    memcpy(secret, job + COMM_NAME_BYTES, COMM_SECRET_HEX);
    secret[COMM_SECRET_HEX] = 0;
    bool agrees = (!o->name || !strcmp(o->name, name)) &&
                  (!o->secret || !strncmp(o->secret, secret, COMM_SECRET_HEX));

    struct hello me = {o->rank, o->world, phys, agrees}, all[COMM_MAX_RANKS];
    e = LOCKED(MPI_Allgather(&me, (int)sizeof(me), MPI_BYTE, all, (int)sizeof(me), MPI_BYTE,
                             m->world));
    if (e != MPI_SUCCESS) {
        r = mpi_err(o, e, "MPI_Allgather");
        goto err;
    }
    for (int w = 0; w < world; w++) {
        m->phys[w] = all[w].phys;
        if (all[w].rank != w || all[w].world != world) {
            say(o, "MPI rank %d of %d was opened as rank %d of %d: under mpi, a communicator's "
                   "rank and world are MPI_COMM_WORLD's",
                w, world, all[w].rank, all[w].world);
            r = -EPROTO;
            goto err;
        }
        if (!all[w].agrees) {
            say(o, "rank %d has another name or secret than rank 0 ('%s')", w, name);
            r = -EPROTO;
            goto err;
        }
    }
    if ((r = make_layout(o, m, world))) goto err;
    char longest[COMM_NAME_BYTES + 16];
    int n = snprintf(longest, sizeof(longest), "%s.n%d", name, m->l.nodes - 1);
    if (n >= COMM_NAME_BYTES) {
        say(o, "the name '%s' with its node's suffix ('%s') is longer than %d characters", name,
            longest, COMM_NAME_BYTES - 1);
        r = -EINVAL;
        goto err;
    }
    e = LOCKED(MPI_Comm_split(m->world, m->l.local == 0 ? 0 : MPI_UNDEFINED, m->rank,
                              &m->leaders));
    if (e != MPI_SUCCESS) {
        r = mpi_err(o, e, "MPI_Comm_split");
        goto err;
    }
    if (m->leaders != MPI_COMM_NULL)
        LOCKED(MPI_Comm_set_errhandler(m->leaders, MPI_ERRORS_RETURN));
    *out = m;
    return 0;
err:
    if (m->leaders != MPI_COMM_NULL) LOCKED(MPI_Comm_free(&m->leaders));
    if (m->world != MPI_COMM_NULL) LOCKED(MPI_Comm_free(&m->world));
    free(m);
err_count:
    pthread_mutex_lock(&init_lock);
    open_comms--;
    pthread_mutex_unlock(&init_lock);
    return r;
}

void mpi_close(struct mpi *m)
{
    if (!m) return;
    if (!m->aborted) {
        if (m->npend) LOCKED(MPI_Waitall((int)m->npend, m->pend, MPI_STATUSES_IGNORE));
        if (m->np2p) LOCKED(MPI_Waitall((int)m->np2p, m->p2p, MPI_STATUSES_IGNORE));
        if (m->leaders != MPI_COMM_NULL) LOCKED(MPI_Comm_free(&m->leaders));
        LOCKED(MPI_Comm_free(&m->world));
    }
    free(m->pend);
    free(m->p2p);
    free(m->want);
    free(m);
    pthread_mutex_lock(&init_lock);
    open_comms--;
    pthread_mutex_unlock(&init_lock);
}

const struct mpi_layout *mpi_layout(const struct mpi *m)
{
    return &m->l;
}

int mpi_agree(struct mpi *m, int r, const struct comm_opts *o)
{
    int all[COMM_MAX_RANKS], world = 0;
    LOCKED(MPI_Comm_size(m->world, &world));
    int e = LOCKED(MPI_Allgather(&r, 1, MPI_INT, all, 1, MPI_INT, m->world));
    if (e != MPI_SUCCESS) return r ? r : mpi_err(o, e, "MPI_Allgather");
    if (r) return r;
    for (int w = 0; w < world; w++)
        if (all[w]) {
            say(o, "rank %d could not open the communicator: %s", w, zinf_strerror(all[w]));
            return -ECONNABORTED;
        }
    return 0;
}

int mpi_bcast_id(struct mpi *m, uint8_t *id)
{
    int e = LOCKED(MPI_Bcast(id, SHM_ID_BYTES, MPI_BYTE, 0, m->world));
    if (e == MPI_SUCCESS) return 0;
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(e, s, &len);
    log_error("comm: rank %d: MPI_Bcast of NCCL's id: %.*s", m->rank, len, s);
    return -EIO;
}

void mpi_attach(struct mpi *m, struct shm *s, const volatile sig_atomic_t *stop)
{
    m->s = s;
    m->stop = stop;
}

void mpi_abort(struct mpi *m, const char *why)
{
    failed = true;
    if (m->s) shm_fail(m->s, why);
    if (m->aborted) return;
    m->aborted = true;
    log_error("comm: rank %d (leader of node %d): %s; aborting the job", m->rank, m->l.node, why);
    /* The local ranks see the segment failed within their next wait slice (100 ms); give
     * them that long to say so before mpirun ends them. */
    usleep(150 * 1000);
    if (serial) pthread_mutex_lock(&call_lock);
    MPI_Abort(m->world, 1);
    if (serial) pthread_mutex_unlock(&call_lock);
}

static int give_up(struct mpi *m, int r, const char *what, int e)
{
    char why[300], s[MPI_MAX_ERROR_STRING + 1] = "";
    int len = 0;
    if (e != MPI_SUCCESS && MPI_Error_string(e, s, &len) == MPI_SUCCESS) s[len] = 0;
    const char *reason = r == -EIO         ? s
                         : r == -ETIMEDOUT ? "the operation's deadline passed"
                         : r == -EINTR     ? "it was asked to stop"
                         : r == -ENOMEM    ? "out of memory"
                                           : "a rank of its node failed";
    snprintf(why, sizeof(why), "node %d's leader (rank %d) gave up on %s in %s: %s", m->l.node,
             m->rank, what, comm_op_name(m->op), reason);
    mpi_abort(m, why);
    return r;
}

/* Waits for n requests (polling, see the top), progressing the posted sends meanwhile. */
static int wait_reqs(struct mpi *m, MPI_Request *rq, int n, const char *what)
{
    unsigned us = POLL_MIN_US;
    for (;;) {
        int done = 0, e = LOCKED(MPI_Testall(n, rq, &done, MPI_STATUSES_IGNORE));
        if (e != MPI_SUCCESS) return give_up(m, -EIO, what, e);
        if (done) return 0;
        if (rq != m->pend && m->npend) {
            int all = 0;
            e = LOCKED(MPI_Testall((int)m->npend, m->pend, &all, MPI_STATUSES_IGNORE));
            if (e != MPI_SUCCESS) return give_up(m, -EIO, what, e);
            if (all) m->npend = 0;
        }
        if (m->s && shm_check(m->s)) return give_up(m, -ECONNABORTED, what, MPI_SUCCESS);
        if (m->s && shm_op_late(m->s)) return give_up(m, -ETIMEDOUT, what, MPI_SUCCESS);
        if (m->stop && *m->stop) return give_up(m, -EINTR, what, MPI_SUCCESS);
        usleep(us);
        us = us * 2 > POLL_MAX_US ? POLL_MAX_US : us * 2;
    }
}

static bool remote(const struct mpi *m, int node)
{
    return m->phys[m->l.first[node]] != m->phys[m->rank];
}

int mpi_send(struct mpi *m, int node, const void *buf, size_t bytes, int tag)
{
    for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += PIECE_BYTES) {
        size_t n = MIN(PIECE_BYTES, bytes - off);
        if (m->npend == m->cap) {
            size_t cap = m->cap ? 2 * m->cap : 64;
            MPI_Request *p = realloc(m->pend, cap * sizeof(*p));
            if (!p) return give_up(m, -ENOMEM, "a send", MPI_SUCCESS);
            m->pend = p, m->cap = cap;
        }
        int e = LOCKED(MPI_Isend((const char *)buf + off, (int)n, MPI_BYTE, node, tag,
                                 m->leaders, &m->pend[m->npend]));
        if (e != MPI_SUCCESS) return give_up(m, -EIO, "a send", e);
        m->npend++;
        if (bytes == 0) break;
    }
    if (remote(m, node)) m->net_out += bytes;
    return 0;
}

int mpi_recv(struct mpi *m, int node, void *buf, size_t bytes, int tag)
{
    char what[64];
    snprintf(what, sizeof(what), "a receive from node %d", node);
    for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += PIECE_BYTES) {
        size_t n = MIN(PIECE_BYTES, bytes - off);
        MPI_Request rq;
        int e = LOCKED(MPI_Irecv((char *)buf + off, (int)n, MPI_BYTE, node, tag, m->leaders, &rq));
        if (e != MPI_SUCCESS) return give_up(m, -EIO, what, e);
        int r = wait_reqs(m, &rq, 1, what);
        if (r) return r;
        if (bytes == 0) break;
    }
    if (remote(m, node)) m->net_in += bytes;
    return 0;
}

int mpi_flush(struct mpi *m)
{
    if (!m->npend) return 0;
    int r = wait_reqs(m, m->pend, (int)m->npend, "sending to other nodes");
    if (r == 0) m->npend = 0;
    return r;
}

void mpi_begin_op(struct mpi *m, enum comm_op op)
{
    m->op = op;
}

int mpi_p2p_post(struct mpi *m, bool send, int rank, void *buf, size_t bytes, int tag)
{
    const char *what = send ? "a send" : "a receive";
    for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += PIECE_BYTES) {
        size_t n = MIN(PIECE_BYTES, bytes - off);
        if (m->np2p == m->p2p_cap) {
            size_t cap = m->p2p_cap ? 2 * m->p2p_cap : 64;
            MPI_Request *p = realloc(m->p2p, cap * sizeof(*p));
            if (p) m->p2p = p;
            struct p2p_want *w = p ? realloc(m->want, cap * sizeof(*w)) : NULL;
            if (!w) return give_up(m, -ENOMEM, what, MPI_SUCCESS);
            m->want = w, m->p2p_cap = cap;
        }
        int e = send ? LOCKED(MPI_Isend((char *)buf + off, (int)n, MPI_BYTE, rank, tag, m->world,
                                        &m->p2p[m->np2p]))
                     : LOCKED(MPI_Irecv((char *)buf + off, (int)n, MPI_BYTE, rank, tag, m->world,
                                        &m->p2p[m->np2p]));
        if (e != MPI_SUCCESS) return give_up(m, -EIO, what, e);
        m->want[m->np2p++] = (struct p2p_want){rank, send ? SIZE_MAX : n};
        if (bytes == 0) break;
    }
    if (m->phys[rank] != m->phys[m->rank]) {
        if (send) m->net_out += bytes;
        else m->net_in += bytes;
    }
    return 0;
}

bool mpi_p2p_posted(const struct mpi *m)
{
    return m->np2p != 0;
}

/* Every receive got the bytes it posted for (a sender of fewer fails the job). */
static int p2p_sizes(struct mpi *m, MPI_Status *st)
{
    for (size_t i = 0; i < m->np2p; i++) {
        int n = 0;
        if (m->want[i].bytes == SIZE_MAX) continue;
        MPI_Get_count(&st[i], MPI_BYTE, &n);
        if ((size_t)n == m->want[i].bytes) continue;
        char why[200];
        snprintf(why, sizeof(why), "rank %d sent %d bytes to rank %d, whose %s from it takes %zu",
                 m->want[i].rank, n, m->rank, comm_op_name(m->op), m->want[i].bytes);
        mpi_abort(m, why);
        return -EPROTO;
    }
    m->np2p = 0;
    return 0;
}

int mpi_p2p_test(struct mpi *m, bool *done)
{
    *done = m->np2p == 0;
    if (*done) return 0;
    MPI_Status *st = malloc(m->np2p * sizeof(*st));
    if (!st) return give_up(m, -ENOMEM, "a transfer", MPI_SUCCESS);
    int all = 0, e = LOCKED(MPI_Testall((int)m->np2p, m->p2p, &all, st));
    int r = e != MPI_SUCCESS ? give_up(m, -EIO, "a transfer", e) : all ? p2p_sizes(m, st) : 0;
    free(st);
    *done = all && r == 0;
    return r;
}

int mpi_p2p_wait(struct mpi *m)
{
    for (unsigned us = POLL_MIN_US;; us = us * 2 > POLL_MAX_US ? POLL_MAX_US : us * 2) {
        bool done;
        int r = mpi_p2p_test(m, &done);
        if (r || done) return r;
        if (m->npend) { /* the leaders' sends progress meanwhile */
            int all = 0, e = LOCKED(MPI_Testall((int)m->npend, m->pend, &all, MPI_STATUSES_IGNORE));
            if (e != MPI_SUCCESS) return give_up(m, -EIO, "sending to other nodes", e);
            if (all) m->npend = 0;
        }
        if (m->s && shm_check(m->s)) return give_up(m, -ECONNABORTED, "a transfer", MPI_SUCCESS);
        if (m->s && shm_op_late(m->s)) return give_up(m, -ETIMEDOUT, "a transfer", MPI_SUCCESS);
        if (m->stop && *m->stop) return give_up(m, -EINTR, "a transfer", MPI_SUCCESS);
        usleep(us);
    }
}

int mpi_p2p_check(struct mpi *m)
{
    /* Not shm_check: ranks of this node that take no part may be done and gone. */
    if (m->s && shm_failed(m->s)) return give_up(m, -ECONNABORTED, "a transfer", MPI_SUCCESS);
    if (m->s && shm_op_late(m->s)) return give_up(m, -ETIMEDOUT, "a transfer", MPI_SUCCESS);
    if (m->stop && *m->stop) return give_up(m, -EINTR, "a transfer", MPI_SUCCESS);
    return 0;
}

void mpi_take_net(struct mpi *m, uint64_t *out, uint64_t *in)
{
    *out = m->net_out, *in = m->net_in;
    m->net_out = m->net_in = 0;
}
#else
bool mpi_built(void)
{
    return false;
}

int mpi_open(const struct comm_opts *o, char *name, char *secret, struct mpi **out)
{
    (void)name, (void)secret;
    *out = NULL;
    log_error("comm: this build has no MPI: install libopenmpi-dev and rebuild");
    if (o->why && o->why_len)
        snprintf(o->why, o->why_len, "this build has no MPI: install libopenmpi-dev and rebuild");
    return -ENOTSUP;
}

void mpi_close(struct mpi *m)
{
    (void)m;
}

const struct mpi_layout *mpi_layout(const struct mpi *m)
{
    (void)m;
    return NULL;
}

int mpi_agree(struct mpi *m, int r, const struct comm_opts *o)
{
    (void)m, (void)o;
    return r;
}

int mpi_bcast_id(struct mpi *m, uint8_t *id)
{
    (void)m, (void)id;
    return -ENOTSUP;
}

void mpi_attach(struct mpi *m, struct shm *s, const volatile sig_atomic_t *stop)
{
    (void)m, (void)s, (void)stop;
}

void mpi_note_failed(void)
{
}

int mpi_send(struct mpi *m, int node, const void *buf, size_t bytes, int tag)
{
    (void)m, (void)node, (void)buf, (void)bytes, (void)tag;
    return -ENOTSUP;
}

int mpi_recv(struct mpi *m, int node, void *buf, size_t bytes, int tag)
{
    (void)m, (void)node, (void)buf, (void)bytes, (void)tag;
    return -ENOTSUP;
}

int mpi_flush(struct mpi *m)
{
    (void)m;
    return -ENOTSUP;
}

void mpi_abort(struct mpi *m, const char *why)
{
    (void)m, (void)why;
}

void mpi_begin_op(struct mpi *m, enum comm_op op)
{
    (void)m, (void)op;
}

void mpi_take_net(struct mpi *m, uint64_t *out, uint64_t *in)
{
    (void)m;
    *out = *in = 0;
}

int mpi_p2p_post(struct mpi *m, bool send, int rank, void *buf, size_t bytes, int tag)
{
    (void)m, (void)send, (void)rank, (void)buf, (void)bytes, (void)tag;
    return -ENOTSUP;
}

int mpi_p2p_test(struct mpi *m, bool *done)
{
    (void)m;
    *done = true;
    return -ENOTSUP;
}

int mpi_p2p_wait(struct mpi *m)
{
    (void)m;
    return -ENOTSUP;
}

int mpi_p2p_check(struct mpi *m)
{
    (void)m;
    return -ENOTSUP;
}

bool mpi_p2p_posted(const struct mpi *m)
{
    (void)m;
    return false;
}
#endif
