/*
 * admission.c - the daemon's per-uid limits (zinf.serve) at the door: what each uid has
 * open (struct ucount), a new connection admitted or refused at accept
 * (connections_per_uid, max_connections, reserved_connections), the log of refusals,
 * rate-limited per uid, and the open files the limits need (RLIMIT_NOFILE). A connection a
 * limit refuses is told why and closed before anything is made for it.
 *
 * Not here: the limits checked where what they count is made, under the same lock:
 * sessions (session.c), jobs (jobs.c), tickets, stages and swap (requests.c); each tells
 * its refusals through serve_refusal() here.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common.h"
#include "service/server_int.h"

/* Whether uid is exempt from the per-uid limits, and may use the reserved connections:
 * root and the daemon's own uid. */
bool serve_privileged(uid_t uid)
{
    return uid == 0 || uid == geteuid();
}

/* What uid has open; made when first asked for (NULL when out of memory). s->lock held. */
struct ucount *serve_ucount_of(struct service *s, uid_t uid)
{
    struct ucount *u;
    for (u = s->ucounts; u; u = u->next)
        if (u->uid == uid) return u;
    if ((u = calloc(1, sizeof(*u)))) {
        u->uid = uid;
        u->tokens = REFUSAL_BURST;
        u->earned_ns = now_ns();
        u->next = s->ucounts;
        s->ucounts = u;
    }
    return u;
}

/* Whether u may log a line now (a token of its bucket taken). s->lock held. */
static bool refusal_token(struct ucount *u, uint64_t now)
{
    uint64_t earned = (now - u->earned_ns) / REFUSAL_EVERY_NS;
    u->tokens = (unsigned)MIN((uint64_t)REFUSAL_BURST, u->tokens + earned);
    u->earned_ns += earned * REFUSAL_EVERY_NS;
    if (u->tokens == REFUSAL_BURST) u->earned_ns = now; /* full: nothing saved up */
    if (!u->tokens) return false;
    u->tokens--;
    return true;
}

/* One refusal of u's counted: whether it is logged, and *hushed, the refusals not logged
 * before it, to say first. s->lock held; the caller logs (refusal_log) after letting it go. */
static bool refusal_counted(struct ucount *u, uint64_t *hushed)
{
    *hushed = 0;
    if (!refusal_token(u, now_ns())) {
        u->hushed++;
        return false;
    }
    *hushed = u->hushed;
    u->hushed = 0;
    return true;
}

static void refusal_log(uid_t uid, uint64_t hushed, const char *why)
{
    if (hushed)
        log_notice("serve: %llu more refusals from uid %u suppressed", (unsigned long long)hushed,
                   (unsigned)uid);
    log_notice("serve: uid %u: %s", (unsigned)uid, why);
}

/* A refusal of uid's (why: what and the limit) logged, or counted where uid's refusals come
 * faster than the log takes them. Without s->lock. */
void serve_refusal(struct service *s, uid_t uid, const char *why)
{
    uint64_t hushed;
    pthread_mutex_lock(&s->lock);
    struct ucount *u = serve_ucount_of(s, uid);
    bool say = !u || refusal_counted(u, &hushed);
    pthread_mutex_unlock(&s->lock);
    if (say) refusal_log(uid, u ? hushed : 0, why);
}

/* The refusals each uid had that were not logged, said in a line once its bucket gives
 * one: a flood that stopped is still told (a few uids a second at most). */
void serve_refusals_said_late(struct service *s)
{
    struct {
        uid_t uid;
        uint64_t n;
    } late[16];
    unsigned n = 0;
    uint64_t now = now_ns();
    pthread_mutex_lock(&s->lock);
    for (struct ucount *u = s->ucounts; u && n < 16; u = u->next)
        if (u->hushed && refusal_token(u, now)) {
            late[n].uid = u->uid;
            late[n++].n = u->hushed;
            u->hushed = 0;
        }
    pthread_mutex_unlock(&s->lock);
    for (unsigned i = 0; i < n; i++)
        log_notice("serve: %llu more refusals from uid %u suppressed",
                   (unsigned long long)late[i].n, (unsigned)late[i].uid);
}

/* A connection refused at accept is told why before it is closed: unasked, a HELLO's
 * refusal (seq 0), which a client reads in place of the reply to its first request. Without
 * waiting: a peer that reads nothing costs no more than one try. */
static void refuse_at_accept(int fd, const char *why)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0)
        serve_reply_error(fd, PROTO_HELLO, 0, -EUSERS, why);
    close(fd);
}

/* A new connection: counted against zinf.serve's limits and put in the epoll set. One over
 * its uid's connections_per_uid, over max_connections, or into the reserve, is refused at
 * once (refuse_at_accept) and never counted: it holds no slot of the limits another uid
 * needs. */
void serve_admit(struct service *s, int fd)
{
    struct ucred cred = {0};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        close(fd);
        return;
    }
    /* A message cut short, or replies left unread, end the connection after this long (set
     * before a worker may read it). */
    struct timeval tv = {.tv_sec = s->lim->hello_timeout};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    pthread_mutex_lock(&s->lock);
    unsigned open_to_all = s->lim->max_connections > s->lim->reserved_connections
                               ? s->lim->max_connections - s->lim->reserved_connections
                               : 0;
    bool priv = serve_privileged(cred.uid);
    struct ucount *u = serve_ucount_of(s, cred.uid);
    struct conn *k = NULL;
    char why[256] = "";
    if (u && !priv && u->conns >= s->lim->connections_per_uid)
        snprintf(why, sizeof(why),
                 "zinf serve: connection refused: this uid has %u connections open, the limit "
                 "(zinf.serve.connections_per_uid)",
                 u->conns);
    else if (u && s->nconns >= (priv ? s->lim->max_connections : open_to_all))
        snprintf(why, sizeof(why),
                 "zinf serve: connection refused: %u connections open, %s "
                 "(zinf.serve.max_connections %u, reserved_connections %u)",
                 s->nconns, priv ? "all there are" : "all but the reserve", s->lim->max_connections,
                 s->lim->reserved_connections);
    else if (!u || !(k = calloc(1, sizeof(*k))))
        snprintf(why, sizeof(why), "zinf serve: connection refused: out of memory");
    if (!k) {
        uint64_t hushed = 0;
        bool say = !u || refusal_counted(u, &hushed);
        pthread_mutex_unlock(&s->lock);
        refuse_at_accept(fd, why);
        if (say) refusal_log(cred.uid, hushed, why + strlen("zinf serve: "));
        return;
    }
    *k = (struct conn){.svc = s, .fd = fd, .uid = cred.uid, .since = now_ns()};
    u->conns++;
    s->nconns++;
    list_push(s->conns, k);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLONESHOT, .data.ptr = k};
    bool in = epoll_ctl(s->ep, EPOLL_CTL_ADD, fd, &ev) == 0;
    pthread_mutex_unlock(&s->lock);
    if (!in) serve_conn_drop(s, k, false);
}

/* Open files the limits may need at once: a connection's socket and its session's pin table
 * (a session has a connection at least), a job's (its arenas, its swap files, its ring),
 * and the daemon's own (the listener, epoll, stdio, the log). */
#define FILES_PER_CONNECTION 2
#define FILES_PER_JOB 16
#define FILES_OWN 64

/* The soft RLIMIT_NOFILE raised to what zinf.serve's limits need, up to the hard limit; a
 * hard limit below that refuses the config (-EMFILE, err naming both): past it, accept()
 * would fail with the daemon's connections still under max_connections. */
int serve_files_enough(const struct config_serve *lim, char *err, size_t errlen)
{
    rlim_t need = (rlim_t)lim->max_connections * FILES_PER_CONNECTION +
                  (rlim_t)lim->max_jobs * FILES_PER_JOB + FILES_OWN;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
        snprintf(err, errlen, "serve: getrlimit(RLIMIT_NOFILE): %s", strerror(errno));
        return -errno;
    }
    if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= need) return 0;
    if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < need) {
        snprintf(err, errlen,
                 "serve: zinf.serve.max_connections %u (and max_jobs %u) need %llu open files, "
                 "more than this process may open (RLIMIT_NOFILE, hard limit %llu): lower "
                 "zinf.serve.max_connections, or raise the limit (ulimit -n, or LimitNOFILE= "
                 "of the service's unit)",
                 lim->max_connections, lim->max_jobs, (unsigned long long)need,
                 (unsigned long long)rl.rlim_max);
        return -EMFILE;
    }
    rl.rlim_cur = need;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
        int r = -errno;
        snprintf(err, errlen,
                 "serve: raising RLIMIT_NOFILE to %llu for "
                 "zinf.serve.max_connections %u: %s",
                 (unsigned long long)need, lim->max_connections, strerror(-r));
        return r;
    }
    return 0;
}
