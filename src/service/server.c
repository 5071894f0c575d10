/*
 * server.c - the zinf daemon behind server.h: the service (its socket, its epoll loop, the
 * once-a-second sweep, its stop) and the worker threads that serve its connections.
 *
 * Threads: service_run() waits in epoll on the listening socket, the stop pipe and every
 * connection between its requests; it accepts (serve_admit, admission.c: the limits of
 * zinf.serve), and hands a connection with a request waiting to an idle worker thread, or
 * starts one (dispatch). A worker serves that connection's requests while they keep coming
 * (conn_serve: spins, then waits up to CONN_LINGER_MS), calls the job's engine
 * (engine_api_*, thread-safe), and puts the connection back in the epoll set when it goes
 * quiet; idle workers leave after 10 s. The keeper thread (keeper.c) holds the sessions'
 * liveness mutexes; STATUS is answered by status.c; the objects below are in server_int.h.
 * Once a second service_run() closes connections that did not say HELLO in time and starts
 * the closing of jobs idle too long (job_closer in jobs.c, a thread each). A request that
 * cannot be parsed gets an error reply and the connection is closed; a request that fails
 * (whatever its error) is answered and the connection stays; nothing a client sends can
 * take the daemon down.
 *
 * States, all under s->lock:
 *   a connection: waiting in the epoll set (!busy) -> handed to a worker (busy) -> back,
 *     or dropped (its peer left, it broke the protocol, its HELLO was refused, the
 *     service stops); one without a session and !busy past hello_timeout is dropped by the
 *     sweep. One over a limit at accept is never a connection here: it is told why and
 *     closed there (serve_admit), counted nowhere.
 *   a job (jobs.c): opening (in the list, e NULL; its folders and engine made without the
 *     lock) -> open -> closing (idle for idle_job_close, or JOB_CLOSE/JOB_REMOVE: its engine
 *     flushed and closed, its folders removed, without the lock) -> out of the list; or,
 *     where its flush failed (not for JOB_REMOVE), back to open, tried again later
 *     (job_kept). Once the service stops (stopping), no job opens or closes but by the
 *     stop's own path, which flushes every job before it tears down a session. A HELLO or a job
 *     command for a job that is opening or closing waits on job_cv, then finds it open or
 *     opens it anew. sessions counts its sessions; a job with one is never closing.
 *   a session (session.c): counted against its uid when its HELLO is admitted, before its
 *     job opens (given back if no session is made) -> in s->sessions while it has
 *     connections (conns); its last connection's leaving takes it out, then drops what it
 *     held (session_free), then counts it out of its job and uid.
 *
 * Locks, outermost first: s->lock (the lists of jobs, sessions and connections, the
 * sessions' connection counts, the limits' counts, the workers), then a session's lock (its
 * pins, tickets and stages), then the engine's (STATUS's stats and pin counts). No file IO
 * and no wait on a client under s->lock: jobs open and close, and STATUS reads saved jobs,
 * without it. The session cleanup's releases are made after the session left every list
 * (no other thread can reach it).
 *
 * Not here: the per-uid limits and the log of their refusals (admission.c), the jobs' lives
 * (jobs.c), HELLO and a session's end (session.c), a session's calls (requests.c), STATUS
 * (status.c), the keeper (keeper.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "service/folders.h"
#include "service/proto.h"
#include "service/server.h"
#include "service/server_int.h"

/* ---- connections --------------------------------------------------------------------- */

/* An error reply: the result alone, or (HELLO) with why after it, which the client logs. */
int serve_reply_error(int fd, uint16_t op, uint32_t seq, int err, const char *why)
{
    struct proto_out o;
    proto_out_init(&o, (uint16_t)(op | PROTO_REPLY), seq);
    proto_put_i32(&o, err);
    if (why && why[0] && op == PROTO_HELLO) proto_put_str(&o, why);
    int r = proto_send(fd, &o, NULL, 0);
    proto_out_free(&o);
    return r;
}

/* SHUTDOWN, admitted: answered with the daemon's pid, and the connection kept open (a
 * descriptor of it in s->stop_fds) until every job is flushed and closed. Its end, then
 * the pid's, tell the client that the daemon is done: `zinf serve --stop && reboot` loses
 * nothing. */
static int stop_asked(struct conn *k, uint32_t seq)
{
    struct service *s = k->svc;
    struct proto_out o;
    proto_out_init(&o, PROTO_SHUTDOWN | PROTO_REPLY, seq);
    proto_put_i32(&o, 0);
    proto_put_u32(&o, (uint32_t)getpid());
    int r = proto_send(k->fd, &o, NULL, 0);
    proto_out_free(&o);
    pthread_mutex_lock(&s->lock);
    if (r == 0 && s->nstop_fds < ARRAY_SIZE(s->stop_fds)) {
        int fd = fcntl(k->fd, F_DUPFD_CLOEXEC, 0);
        if (fd >= 0) {
            s->stop_fds[s->nstop_fds++] = fd;
            k->stopper = true;
        }
    }
    pthread_mutex_unlock(&s->lock);
    log_notice("serve: asked to stop by uid %u", (unsigned)k->uid);
    service_stop(s);
    return r;
}

/* Serves k's requests while they keep coming: true when k is to wait in the epoll set for
 * its next one, false when it is to be closed (its peer left, or broke the protocol). A
 * worker thread runs this; a connection that goes quiet for CONN_LINGER_MS gives it back. */
#define CONN_LINGER_MS 50
static bool conn_serve(struct conn *k)
{
    struct service *s = k->svc;

    for (;;) {
        /* A client in a loop of calls sends the next one within microseconds; one that is
         * busy elsewhere, within milliseconds; one that is silent, gives the thread back. */
        if (!proto_spin_readable(k->fd, s->spin_ns)) {
            struct pollfd p = {k->fd, POLLIN, 0};
            int n = poll(&p, 1, CONN_LINGER_MS);
            if (n == 0) return true;
            if (n < 0 && errno == EINTR) continue;
        }
        struct proto_header h;
        uint8_t *payload = NULL;
        /* The socket's receive timeout (hello_timeout) bounds a message cut short. */
        int r = proto_recv(k->fd, false, &h, &payload, NULL, NULL);
        if (r < 0) {
            /* A header that parsed badly gets a word before the door closes. */
            if (r == -EPROTONOSUPPORT || r == -EMSGSIZE || r == -EBADMSG)
                serve_reply_error(k->fd, h.op & ~PROTO_REPLY, h.seq, r, NULL);
            return false;
        }
        struct proto_request q;
        r = proto_decode_request(h.op, payload, h.len, &q);
        if (r == 0 && h.op == PROTO_STATUS) {
            free(payload); /* q holds the name */
            if (status_reply(k, &q, h.seq) < 0) return false;
            continue;
        }
        if (r == 0 && (h.op == PROTO_JOB_CLOSE || h.op == PROTO_JOB_REMOVE ||
                       h.op == PROTO_JOB_SHARE || h.op == PROTO_SHUTDOWN)) {
            free(payload); /* q holds the name */
            r = serve_manage(k, &q);
            if (h.op == PROTO_SHUTDOWN && r == 0) {
                if (stop_asked(k, h.seq) < 0) return false;
                continue;
            }
            if (serve_reply_error(k->fd, h.op, h.seq, r, NULL) < 0) return false;
            continue;
        }
        if (r == 0 && !k->sess) r = h.op == PROTO_HELLO ? serve_hello(k, &q, h.seq) : -EPROTO;
        if (r != 0 || !k->sess || h.op == PROTO_HELLO) {
            free(payload);
            if (r < 0) {
                serve_reply_error(k->fd, h.op, h.seq, r, h.op == PROTO_HELLO ? k->why : NULL);
                return false;
            }
            if (r == 1) /* the session's HELLO, answered */
                continue;
            serve_reply_error(k->fd, h.op, h.seq, -EBADMSG, NULL); /* a second HELLO */
            return false;
        }
        struct proto_out o;
        proto_out_init(&o, (uint16_t)(h.op | PROTO_REPLY), h.seq);
        proto_put_i32(&o, 0);
        atomic_fetch_add_explicit(&s->requests, 1, memory_order_relaxed);
        r = serve_request(k->sess, &q, &o);
        free(payload); /* q points into it */
        if (o.bad && r >= 0) r = -ENOMEM;
        if (r < 0) { /* the result alone */
            proto_out_free(&o);
            proto_out_init(&o, (uint16_t)(h.op | PROTO_REPLY), h.seq);
            proto_put_i32(&o, r);
        } else {
            memcpy(o.buf + PROTO_HEADER_BYTES, &r, 4);
        }
        int w = proto_send(k->fd, &o, NULL, 0);
        proto_out_free(&o);
        if (w < 0) return false;
        /* A request's own failure (-EBADMSG of a damaged tensor too) leaves the connection
         * open: the client has put it back in its pool. Only a message that breaks the
         * protocol (above) closes it. */
    }
}

/* Closes k: out of the lists and counts, its session left. in_epoll: it waits there (not
 * busy). */
void serve_conn_drop(struct service *s, struct conn *k, bool in_epoll)
{
    pthread_mutex_lock(&s->lock);
    list_take(s->conns, k);
    s->nconns--;
    struct ucount *u = serve_ucount_of(s, k->uid); /* made at accept: found */
    if (u) u->conns--;
    pthread_mutex_unlock(&s->lock);
    if (in_epoll) epoll_ctl(s->ep, EPOLL_CTL_DEL, k->fd, NULL);
    if (k->sess) serve_session_leave(s, k->sess);
    close(k->fd);
    free(k);
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct service *s = w->s;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        struct conn *k = w->k;
        w->k = NULL;
        if (!k && s->ready) { /* one that waited for a thread */
            k = s->ready;
            s->ready = k->qnext;
            if (!s->ready) s->ready_tail = NULL;
        }
        if (!k) {
            if (s->stopping) break;
            /* Idle: wait a while to be handed one, then leave: threads follow the load. */
            w->next = s->idle;
            s->idle = w;
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += 10;
            int r = 0;
            while (!w->k && !s->stopping && r != ETIMEDOUT)
                r = pthread_cond_timedwait(&w->cv, &s->lock, &until);
            if (!w->k) { /* not handed one: still in the idle list */
                for (struct worker **pp = &s->idle; *pp; pp = &(*pp)->next)
                    if (*pp == w) {
                        *pp = w->next;
                        break;
                    }
                if (r == ETIMEDOUT || s->stopping) break;
            }
            continue;
        }
        pthread_mutex_unlock(&s->lock);
        bool keep = conn_serve(k);
        pthread_mutex_lock(&s->lock);
        if (keep && !s->stopping) {
            k->busy = false;
            struct epoll_event ev = {.events = EPOLLIN | EPOLLONESHOT, .data.ptr = k};
            if (epoll_ctl(s->ep, EPOLL_CTL_MOD, k->fd, &ev) == 0) continue;
        }
        pthread_mutex_unlock(&s->lock);
        serve_conn_drop(s, k, false);
        pthread_mutex_lock(&s->lock);
    }
    s->workers--;
    pthread_cond_broadcast(&s->gone_cv);
    pthread_mutex_unlock(&s->lock);
    pthread_cond_destroy(&w->cv);
    free(w);
    return NULL;
}

/* A request waits on k: an idle worker is handed it, or a new one started with it. Where no
 * thread can start, k waits for the next worker that comes free. s->lock held. */
static void dispatch(struct service *s, struct conn *k)
{
    k->busy = true;
    struct worker *w = s->idle;
    if (w) {
        s->idle = w->next;
        w->k = k;
        pthread_cond_signal(&w->cv);
        return;
    }
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    if ((w = calloc(1, sizeof(*w)))) {
        *w = (struct worker){.s = s, .k = k};
        pthread_cond_init(&w->cv, NULL);
    }
    if (w && pthread_create(&t, &a, worker_main, w) == 0) {
        s->workers++;
    } else {
        if (w) pthread_cond_destroy(&w->cv);
        free(w);
        k->qnext = NULL;
        if (s->ready_tail)
            s->ready_tail->qnext = k;
        else
            s->ready = k;
        s->ready_tail = k;
        if (!s->workers) log_error("serve: cannot start a thread to serve a request: it waits");
    }
    pthread_attr_destroy(&a);
}

/* ---- the service --------------------------------------------------------------------- */

int service_open(const struct service_opts *o, struct service **out, char *err, size_t errlen)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    *out = NULL;
    if (!o || !o->socket_path || !o->config) {
        snprintf(err, errlen, "serve: a socket path and a config are needed");
        return -EINVAL;
    }
    if (strlen(o->socket_path) >= sizeof(a.sun_path)) {
        snprintf(err, errlen, "serve: the socket path %s is longer than %zu bytes", o->socket_path,
                 sizeof(a.sun_path) - 1);
        return -ENAMETOOLONG;
    }
    gid_t gid = (gid_t)-1;
    if (o->group) {
        struct group *g = getgrnam(o->group);
        if (!g) {
            snprintf(err, errlen, "serve: --group %s: no such group", o->group);
            return -EINVAL;
        }
        gid = g->gr_gid;
    }
    strcpy(a.sun_path, o->socket_path);
    for (unsigned i = 0; i < o->config->nvme_paths.count; i++) {
        int r = folders_check_root(o->config->nvme_paths.path[i], err, errlen);
        if (r < 0) return r;
    }
    int fr = serve_files_enough(&o->config->zinf.serve, err, errlen);
    if (fr < 0) return fr;

    struct service *s = calloc(1, sizeof(*s));
    if (!s) return -ENOMEM;
    s->config = o->config;
    s->spin_ns = proto_spin_ns();
    s->listen_fd = -1;
    s->wake[0] = s->wake[1] = -1;
    s->lim = &o->config->zinf.serve;
    s->ep = -1;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->job_cv, NULL);
    pthread_cond_init(&s->gone_cv, NULL);
    status_init(s);
    int r = 0;
    const char *what = "";
    if (!(s->socket_path = strdup(o->socket_path))) {
        r = -ENOMEM;
        what = "strdup";
        goto fail;
    }
    if (pipe2(s->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
        r = -errno;
        what = "pipe";
        goto fail;
    }
    /* A socket file left by a daemon that died is replaced; one a daemon answers on is not. */
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (probe >= 0) {
        bool live = connect(probe, (struct sockaddr *)&a, sizeof(a)) == 0;
        close(probe);
        if (live) {
            snprintf(err, errlen, "serve: a zinf daemon already answers on %s", o->socket_path);
            r = -EADDRINUSE;
            goto fail_quiet;
        }
    }
    unlink(o->socket_path);
    s->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s->listen_fd < 0) {
        r = -errno;
        what = "socket";
        goto fail;
    }
    /* Bound under a umask that lets nobody else in; then opened to the group if asked. */
    mode_t old = umask(0177);
    r = bind(s->listen_fd, (struct sockaddr *)&a, sizeof(a)) == 0 ? 0 : -errno;
    umask(old);
    if (r < 0) {
        what = "bind";
        goto fail;
    }
    if (o->group &&
        (chown(o->socket_path, (uid_t)-1, gid) != 0 || chmod(o->socket_path, 0660) != 0)) {
        r = -errno;
        what = "chown/chmod of the socket for --group";
        goto fail;
    }
    if (listen(s->listen_fd, 64) != 0) {
        r = -errno;
        what = "listen";
        goto fail;
    }
    *out = s;
    return 0;
fail:
    snprintf(err, errlen, "serve: %s on %s: %s", what, o->socket_path, strerror(-r));
fail_quiet:
    if (s->listen_fd >= 0) {
        close(s->listen_fd);
        unlink(o->socket_path);
    }
    for (int i = 0; i < 2; i++)
        if (s->wake[i] >= 0) close(s->wake[i]);
    free(s->socket_path);
    status_fini(s);
    pthread_cond_destroy(&s->job_cv);
    pthread_mutex_destroy(&s->lock);
    free(s);
    return r;
}

void service_stop(struct service *s)
{
    char c = 1;
    if (s && write(s->wake[1], &c, 1) < 0) {
        /* Full pipe: a stop is already pending. */
    }
}

/* Once a second: connections that did not send HELLO in time are closed, and jobs without
 * a session for zinf.serve.idle_job_close seconds are closed. */
static void sweep(struct service *s)
{
    uint64_t now = now_ns(), hello_ns = (uint64_t)s->lim->hello_timeout * 1000000000ull;
    /* One pass: the late ones are made ours (busy: no worker takes them) and chained
     * through qnext (a connection waiting in the epoll set is in no ready queue). */
    struct conn *late = NULL;
    pthread_mutex_lock(&s->lock);
    for (struct conn *k = s->conns; k; k = k->next)
        if (!k->busy && !k->sess && now - k->since > hello_ns) {
            k->busy = true;
            k->qnext = late;
            late = k;
        }
    pthread_mutex_unlock(&s->lock);
    for (struct conn *k = late, *n; k; k = n) {
        n = k->qnext;
        serve_conn_drop(s, k, true);
    }
    serve_refusals_said_late(s);
    serve_close_idle_jobs(s, now);
}

static int serve(struct service *s)
{
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = &s->listen_fd},
                       wev = {.events = EPOLLIN, .data.ptr = &s->wake[0]};
    if (epoll_ctl(s->ep, EPOLL_CTL_ADD, s->listen_fd, &lev) != 0 ||
        epoll_ctl(s->ep, EPOLL_CTL_ADD, s->wake[0], &wev) != 0)
        return -errno;
    uint64_t swept = now_ns();
    for (;;) {
        struct epoll_event ev[64];
        int n = epoll_wait(s->ep, ev, 64, 1000);
        if (n < 0 && errno != EINTR) return -errno;
        for (int i = 0; i < n; i++) {
            if (ev[i].data.ptr == &s->wake[0]) return 0;
            if (ev[i].data.ptr != &s->listen_fd) {
                pthread_mutex_lock(&s->lock);
                dispatch(s, ev[i].data.ptr);
                pthread_mutex_unlock(&s->lock);
                continue;
            }
            for (;;) {
                int fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
                if (fd >= 0) {
                    serve_admit(s, fd);
                    continue;
                }
                if (errno == EINTR || errno == ECONNABORTED) continue;
                if (errno == EAGAIN) break;
                log_error("serve: accept: %s", strerror(errno));
                if (errno == EMFILE || errno == ENFILE || errno == ENOMEM) {
                    poll(NULL, 0, 100); /* let connections close before trying again */
                    break;
                }
                return -errno;
            }
        }
        if (now_ns() - swept >= 1000000000ull) {
            sweep(s);
            swept = now_ns();
        }
    }
}

int service_run(struct service *s)
{
    /* Here, not in service_open(): a daemon going to the background forks in between. */
    if (!s->keeper.started) {
        int r = keeper_start(&s->keeper);
        if (r < 0) return r;
    }
    if (s->ep < 0 && (s->ep = epoll_create1(EPOLL_CLOEXEC)) < 0) return -errno;
    return serve(s);
}

void service_close(struct service *s)
{
    if (!s) return;
    pthread_mutex_lock(&s->lock);
    s->stopping = true; /* no job opens or closes from here on */
    pthread_mutex_unlock(&s->lock);
    serve_flush_all(s);
    /* Workers see their sockets shut and leave (after the call they may be in); idle
     * connections are closed here; the last connection of each session drops its pins. A
     * connection that asked for the stop stays open (s->stop_fds) until the end. */
    pthread_mutex_lock(&s->lock);
    for (struct conn *k = s->conns; k; k = k->next)
        if (!k->stopper) shutdown(k->fd, SHUT_RDWR);
    for (struct worker *w = s->idle; w; w = w->next)
        pthread_cond_signal(&w->cv);
    while (s->workers || s->closers)
        pthread_cond_wait(&s->gone_cv, &s->lock);
    pthread_mutex_unlock(&s->lock);
    for (;;) {
        pthread_mutex_lock(&s->lock);
        struct conn *k = s->conns;
        pthread_mutex_unlock(&s->lock);
        if (!k) break;
        serve_conn_drop(s, k, !k->busy);
    }
    for (struct job *j = s->jobs, *n; j; j = n) {
        n = j->next;
        serve_job_shut(j, "the daemon stops", true); /* flushed above: what the sessions left */
        free(j);
    }
    for (struct ucount *u = s->ucounts, *n; u; u = n) {
        n = u->next;
        free(u);
    }
    close(s->listen_fd);
    unlink(s->socket_path);
    for (unsigned i = 0; i < s->nstop_fds; i++)
        close(s->stop_fds[i]); /* the stopping clients see the end now */
    close(s->wake[0]);
    close(s->wake[1]);
    if (s->ep >= 0) close(s->ep);
    keeper_stop(&s->keeper);
    free(s->socket_path);
    status_fini(s);
    pthread_cond_destroy(&s->job_cv);
    pthread_cond_destroy(&s->gone_cv);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

void service_forget(struct service *s)
{
    if (!s) return;
    close(s->listen_fd);
    close(s->wake[0]);
    close(s->wake[1]);
    free(s->socket_path);
    status_fini(s);
    pthread_cond_destroy(&s->job_cv);
    pthread_cond_destroy(&s->gone_cv);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

uint64_t service_requests(struct service *s)
{
    return atomic_load_explicit(&s->requests, memory_order_relaxed);
}
