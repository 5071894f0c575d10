/*
 * server_int.h - what the daemon's files share (server.c, admission.c, jobs.c, session.c,
 * requests.c, status.c, keeper.c): its objects, their states and locks (drawn at the top of
 * server.c), and the functions one calls in another. Not for anything outside src/service/:
 * server.h is the daemon's interface.
 */
#ifndef ZINF_SERVICE_SERVER_INT_H
#define ZINF_SERVICE_SERVER_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "config.h"
#include "engine/engine.h"
#include "service/proto.h"

struct saved_sum;

/* The lists of connections and sessions, doubly linked: a connection or a session is
 * taken out in one step however many there are (a scan for it made N closes cost N^2).
 * s->lock held. */
#define list_push(head, x)                                                                         \
    do {                                                                                           \
        (x)->prev = NULL;                                                                          \
        (x)->next = (head);                                                                        \
        if (head) (head)->prev = (x);                                                              \
        (head) = (x);                                                                              \
    } while (0)
#define list_take(head, x)                                                                         \
    do {                                                                                           \
        if ((x)->prev)                                                                             \
            (x)->prev->next = (x)->next;                                                           \
        else                                                                                       \
            (head) = (x)->next;                                                                    \
        if ((x)->next) (x)->next->prev = (x)->prev;                                                \
        (x)->prev = (x)->next = NULL;                                                              \
    } while (0)

struct job {
    char name[PROTO_MAX_JOB + 1];
    /* s->lock: opening (its folders and engine being made, without the lock; e NULL), then
     * open. A HELLO for a job being opened waits on s->job_cv. */
    bool opening;
    /* s->lock: being closed (idle, or asked to): a HELLO for it waits, then opens it anew */
    bool closing;
    uid_t owner;       /* while opening: the uid that asked */
    /* s->lock: its owner lets every uid attach read-only (JOB_SHARE; kept in its folder as
     * FOLDERS_SHARED_FILE): a base that others fine-tune on */
    bool shared;
    unsigned sessions; /* s->lock: sessions attached */
    uint64_t idle_since; /* s->lock: now_ns() when its last session left */
    uint64_t retry_at;   /* s->lock: a close whose flush failed is tried again from then */
    zinf_engine *e;
    struct engine_region reg[MEM_TIERS];
    struct job *next;
};

struct pin {
    zinf_tensor t;
    uint32_t tier, count;
    struct pin *next;
};

struct tick {
    uint64_t id;
    zinf_tensor t;
    uint32_t tier;
    struct tick *next;
};

/* A zinf_write or zinf_read larger than a message, staged whole (proto.h, STAGE_*). */
struct stage {
    uint64_t id;
    bool write;
    zinf_tensor t;
    uint64_t off, bytes;
    char *buf;
    struct stage *next;
};

struct session {
    struct service *svc;
    uint64_t id, secret;
    struct job *job;
    uid_t uid;
    /* HELLO's PROTO_HELLO_READONLY: the arenas were handed over read-only, there is no pin
     * table, and every request that writes the job is refused (-EROFS) */
    bool readonly;
    unsigned conns; /* s->lock */
    struct session *prev, *next; /* s->sessions */

    pthread_mutex_t lock; /* pins, ticks */
    struct pin *pins;
    /* Its unwaited tickets by id, a hash of ticks_mask + 1 chains; nticks counts them and
     * those being made (at most zinf.serve.tickets_per_session) */
    struct tick **ticks;
    size_t ticks_mask, nticks;
    struct stage *stages; /* not in the list while a call fills or empties it */
    uint64_t staged, stage_limit, next_stage; /* bytes staged; zinf.serve.write_stage_bytes */
    unsigned nstages; /* stages open or being opened; zinf.serve.stages_per_session */
    /* The session's pin table (lease.c), or NULL when the job's engine serves as many as
     * it can: the pins counted there are not in pins. */
    struct engine_pinset *ps;
    int ps_fd;
    size_t ps_bytes;
    /* With a table: the session's liveness mutex, in a memfd only this session maps (live_fd
     * until HELLO has handed it over). The keeper holds it while the session lives. */
    pthread_mutex_t *live;
    int live_fd;
};

/* A connection. Between requests it waits in the epoll set, costing no thread; when a
 * request comes a worker takes it (busy) and serves it, and the next ones while they keep
 * coming, then puts it back. */
struct conn {
    struct service *svc;
    int fd;
    uid_t uid;      /* the peer's, at accept */
    uint64_t since; /* accepted, now_ns() */
    bool busy;      /* s->lock: a worker has it (it is out of the epoll set) */
    char why[256];  /* the reason sent with an error of HELLO (a limit, named) */
    bool stopper;   /* s->lock: it asked the daemon to stop, and waits for its end */
    struct session *sess;
    struct conn *prev, *next; /* s->conns */
    struct conn *qnext; /* s->ready */
};

/* A thread that serves connections' requests. An idle one waits to be handed a connection
 * (k, set by dispatch, which signals cv): each hand-off goes to one thread, so none is
 * lost while a woken thread has not run yet. */
struct worker {
    struct service *s;
    pthread_cond_t cv;
    struct conn *k;
    struct worker *next; /* s->idle */
};

/* What one uid has open, for zinf.serve's limits, and how its refusals are logged: a
 * token bucket of REFUSAL_BURST lines, one more earned each REFUSAL_EVERY_NS; a refusal
 * without a token is counted (hushed), and said in one line before the next one said, or
 * by the sweep once a token is back. */
#define REFUSAL_BURST 5
#define REFUSAL_EVERY_NS 1000000000ull
struct ucount {
    uid_t uid;
    unsigned conns, sessions;
    uint64_t swap_pending; /* bytes of REGISTERs admitted and not done yet */
    unsigned tokens;    /* lines it may log now */
    uint64_t earned_ns; /* now_ns() up to which its tokens are counted in */
    uint64_t hushed;    /* refusals not logged since the last line */
    struct ucount *next;
};

/* The thread that holds every session's liveness mutex (a robust, process-shared mutex in
 * memory only that session's client maps, read-only): the client reads it as held while
 * the session lives, and as free once it has ended or the daemon has died (the kernel lets
 * a dead thread's robust mutexes go). The pin table's hit path asks it before trusting a
 * slot. A robust
 * mutex belongs to the thread that locked it and must be unlocked by it, and connection
 * threads come and go: hence one thread that lives as long as the service, and does the
 * locking and unlocking it is asked for, one request at a time. */
struct keeper {
    pthread_t thread;
    bool started;
    pthread_mutex_t lock;
    pthread_cond_t cv;
    pthread_mutex_t *todo; /* the mutex to lock (hold) or unlock; NULL: nothing asked */
    bool hold, quit;
    int result;
};

struct service {
    const struct zinf_config *config;
    char *socket_path;
    int listen_fd;
    int wake[2];      /* service_stop() writes to wake[1] */
    uint64_t spin_ns; /* how long a connection polls for its next request before it sleeps */

    const struct config_serve *lim; /* &config->zinf.serve */
    int ep;                         /* epoll: the listener, the wake pipe, idle connections */

    pthread_mutex_t lock;
    pthread_cond_t job_cv; /* a job finished opening or closing (or failed to) */
    struct job *jobs;
    struct session *sessions;
    struct conn *conns;
    unsigned nconns;
    struct ucount *ucounts;
    struct worker *idle;             /* workers waiting to be handed a connection */
    struct conn *ready, *ready_tail; /* requests waiting for a worker that could not start */
    pthread_cond_t gone_cv;          /* a worker or a job's closer finished */
    unsigned workers, closers;
    bool stopping;
    /* The connections that asked the daemon to stop (SHUTDOWN), kept open until every job
     * is flushed and closed: their end tells the client that the daemon is done. */
    int stop_fds[8];
    unsigned nstop_fds;
    uint64_t next_session;
    _Atomic uint64_t requests; /* requests served after HELLO */
    struct keeper keeper;
    /* What STATUS and the saved_jobs_per_uid count know of the jobs saved under the first
     * swap directory (status.c): one scan of it at a time, each folder's summary kept until
     * the folder changes. */
    pthread_mutex_t status_lock;
    struct saved_sum **sums;
    size_t sums_mask, nsums;
    uint64_t sums_gen;
};

/* server.c */
/* An error reply: the result alone, or (HELLO) with why after it, which the client logs. */
int serve_reply_error(int fd, uint16_t op, uint32_t seq, int err, const char *why);
/* Closes k: out of the lists and counts, its session left. in_epoll: it waits there (not
 * busy). */
void serve_conn_drop(struct service *s, struct conn *k, bool in_epoll);

/* admission.c */
/* Root and the daemon's own uid: exempt from the per-uid limits. */
bool serve_privileged(uid_t uid);
/* What uid has open; made when first asked for (NULL when out of memory). s->lock held. */
struct ucount *serve_ucount_of(struct service *s, uid_t uid);
/* A refusal of uid's (why: what and the limit) logged, or counted where uid's refusals come
 * faster than the log takes them. Without s->lock. */
void serve_refusal(struct service *s, uid_t uid, const char *why);
/* The refusals each uid had that were not logged, said once its bucket gives a line. */
void serve_refusals_said_late(struct service *s);
/* A new connection (fd, accepted): counted and put in the epoll set, or refused and closed. */
void serve_admit(struct service *s, int fd);
/* The soft RLIMIT_NOFILE raised to what lim needs: 0, or -errno with err saying why. */
int serve_files_enough(const struct config_serve *lim, char *err, size_t errlen);

/* jobs.c */
bool serve_job_name_ok(const char *n);
/* The job of that name for uid, opened when first asked for. s->lock held (let go while the
 * job opens); -EUSERS with why where a limit refuses it. Another uid's job is -EACCES (why
 * says whose), unless ro (a read-only session) and its owner shared it; ro never makes a job
 * (-ENOENT). */
int serve_job_get(struct service *s, const char *name, uid_t uid, bool ro, struct job **out,
                  char *why, size_t whylen);
/* Closes a closing job's engine, flushed first unless force; without s->lock. */
int serve_job_shut(struct job *j, const char *why, bool force);
/* JOB_CLOSE, JOB_REMOVE, JOB_SHARE and SHUTDOWN, asked on k: 0 or -errno, for the reply. */
int serve_manage(struct conn *k, const struct proto_request *q);
/* The sweep's: jobs idle for zinf.serve.idle_job_close start closing. */
void serve_close_idle_jobs(struct service *s, uint64_t now);
/* Every open job flushed, at the daemon's stop. */
void serve_flush_all(struct service *s);

/* session.c */
/* HELLO on k: 1 once the reply went out, or -errno (k->why may say why). */
int serve_hello(struct conn *k, const struct proto_request *q, uint32_t seq);
/* The session loses a connection; the last one ends it. */
void serve_session_leave(struct service *s, struct session *se);

/* requests.c */
/* A session's request after HELLO: 0 or a count with o's fields, or -errno. */
int serve_request(struct session *se, const struct proto_request *q, struct proto_out *o);
void serve_stage_free(struct stage *g);

/* keeper.c */
int keeper_start(struct keeper *kp);
void keeper_stop(struct keeper *kp);
/* A session's liveness mutex made and held by the keeper (se->live, se->live_fd). */
int keeper_live_open(struct service *s, struct session *se);
/* ... let go (the client then reads it as free) and unmapped. */
void keeper_live_close(struct service *s, struct session *se);

/* status.c */
/* STATUS (q->name: the page starts after that job's name): answered on k. */
int status_reply(struct conn *k, const struct proto_request *q, uint32_t seq);
/* The job folders under the first swap directory that uid owns, open or saved. */
unsigned status_saved_count(struct service *s, uid_t uid);
void status_init(struct service *s);
void status_fini(struct service *s);

#endif
