/*
 * session.c - a session of the daemon's, from its HELLO to its end: a HELLO starts one
 * (counted against sessions_per_uid, its job opened or found, its pin table and liveness
 * mutex made, their descriptors handed over) or joins one with its id and secret; each of
 * its connections leaves it, and the last one drops what it held (its pins, its tickets not
 * waited for, its stages).
 *
 * Not here: the calls a session makes (requests.c), the job it attaches to (jobs.c), the
 * connections that carry it (server.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "engine/engine.h"
#include "service/proto.h"
#include "service/server_int.h"

/* Drops what a session left behind; it is in no list any more. */
static void session_free(struct service *s, struct session *se)
{
    zinf_engine *e = se->job->e;
    unsigned dropped = 0, kept = 0, restored = 0;
    /* Tickets never waited for: their pins go without loading anything (waiting for each
     * made a client's thousands of tickets hold up the daemon's stop). */
    for (size_t i = 0; se->ticks && i <= se->ticks_mask; i++)
        for (struct tick *k = se->ticks[i], *n; k; k = n) {
            n = k->next;
            dropped += engine_ticket_drop(e, k->id) == 0;
            free(k);
        }
    free(se->ticks);
    for (struct stage *g = se->stages, *n; g; g = n) { /* a write never ended: never applied */
        n = g->next;
        serve_stage_free(g);
    }
    /* The client may have written through a pin it never released dirty: such a copy goes,
     * so the tensor reads as it was last released, where the engine can tell it apart. */
    for (struct pin *p = se->pins, *n; p; p = n) {
        n = p->next;
        for (uint32_t i = 0; i < p->count; i++) {
            int r = engine_release_abandoned(e, p->t, p->tier);
            dropped += r >= 0;
            kept += r == 1;
            restored += r == 2;
        }
        free(p);
    }
    unsigned d = 0, k = 0, u = 0;
    engine_pinset_close(e, se->ps, &d, &k, &u);
    keeper_live_close(s, se); /* the client's fast path stops here */
    dropped += d;
    kept += k;
    restored += u;
    if (dropped)
        log_notice("serve: job %s: a client (uid %u) went away holding %u pins: dropped; %u "
                   "copies it may have written put back as they were when pinned%s",
                   se->job->name, (unsigned)se->uid, dropped, restored,
                   kept ? "; some kept as it left them (another client holds them)" : "");
    pthread_mutex_destroy(&se->lock);
    free(se);
}

/* Read-only descriptions of job j's arenas, for a read-only session: opened O_RDONLY anew
 * through /proc, so that the client can map them only PROT_READ. The memfds are made the
 * daemon's alone first (0600): one reopened for writing through the client's own
 * /proc/self/fd would otherwise be writable by any uid. 0, or -errno with none left open. */
static int readonly_fds(const struct job *j, int fds[MEM_TIERS])
{
    for (int i = 0; i < MEM_TIERS; i++) {
        char path[64];
        if (j->reg[i].cuda) continue;
        snprintf(path, sizeof(path), "/proc/self/fd/%d", j->reg[i].fd);
        if (fchmod(j->reg[i].fd, 0600) != 0 ||
            (fds[i] = open(path, O_RDONLY | O_CLOEXEC)) < 0) {
            int r = -errno;
            for (int k = 0; k < i; k++)
                if (fds[k] >= 0) close(fds[k]);
            fds[i] = -1;
            return r;
        }
    }
    return 0;
}

/* The first message of a connection: it starts or joins a session. */
int serve_hello(struct conn *k, const struct proto_request *q, uint32_t seq)
{
    struct service *s = k->svc;
    const char *job = q->name;
    uint64_t sid = q->handle, secret = q->offset;
    if (!serve_job_name_ok(job)) return -EINVAL;
    uid_t uid = k->uid;

    struct session *se = NULL;
    int r = 0;
    pthread_mutex_lock(&s->lock);
    struct ucount *uc = serve_ucount_of(s, uid);
    if (sid) {
        for (se = s->sessions; se; se = se->next)
            if (se->id == sid) break;
        /* A session ends with its last connection: joining one that ended, or one of
         * another job, uid or secret, is refused alike. */
        if (!se || se->secret != secret || se->uid != uid || strcmp(se->job->name, job))
            r = -ECONNRESET;
        else
            se->conns++;
    } else if (!uc) {
        r = -ENOMEM;
    } else if (!serve_privileged(uid) && uc->sessions >= s->lim->sessions_per_uid) {
        snprintf(k->why, sizeof(k->why),
                 "zinf serve: a new session refused: this uid has %u sessions (client "
                 "processes attached), the limit (zinf.serve.sessions_per_uid)",
                 uc->sessions);
        r = -EUSERS;
    } else {
        /* Counted now, under the lock that checked it: serve_job_get() lets the lock go while
         * the job opens, and every HELLO that came meanwhile would pass the same check. Given
         * back below when the session is not made. */
        uc->sessions++;
        struct job *j;
        bool ro = q->flags & PROTO_HELLO_READONLY;
        r = serve_job_get(s, job, uid, ro, &j, k->why, sizeof(k->why));
        /* CUDA IPC hands out a GPU arena writable: no read-only session can be had on it. */
        if (r == 0 && ro && j->reg[0].cuda) {
            snprintf(k->why, sizeof(k->why), "zinf serve: job %.64s refused: its device tier "
                     "is a GPU, whose arena cannot be handed over read-only", job);
            r = -ENOTSUP;
        }
        if (r == 0 && !(se = calloc(1, sizeof(*se)))) r = -ENOMEM;
        if (r < 0) uc->sessions--;
        if (r == 0) {
            se->svc = s;
            se->id = ++s->next_session;
            if (getrandom(&se->secret, sizeof(se->secret), 0) != sizeof(se->secret))
                se->secret = se->id * 0x9e3779b97f4a7c15ull ^ (uint64_t)now_ns();
            se->job = j;
            se->uid = uid;
            se->readonly = ro;
            se->conns = 1;
            /* Without a table (the engine serves as many as it can) every call is a
             * message: slower, the same answers. */
            se->live_fd = -1;
            se->stage_limit = s->config->zinf.serve.write_stage_bytes;
            /* A read-only session has none: a table's slots are pins the client writes
             * itself, and the job's other sessions would wait on whatever it wrote there. */
            if (ro || engine_pinset_open(j->e, &se->ps, &se->ps_fd, &se->ps_bytes) < 0)
                se->ps = NULL;
            /* The table's hit path needs to know the session lives. */
            if (se->ps && keeper_live_open(s, se) < 0) {
                unsigned d, kept, u;
                engine_pinset_close(j->e, se->ps, &d, &kept, &u);
                se->ps = NULL;
            }
            pthread_mutex_init(&se->lock, NULL);
            list_push(s->sessions, se);
            j->sessions++;
        }
    }
    pthread_mutex_unlock(&s->lock);
    if (r == -EUSERS) serve_refusal(s, uid, k->why + strlen("zinf serve: "));
    if (r < 0) return r;
    int rofd[MEM_TIERS];
    for (int i = 0; i < MEM_TIERS; i++)
        rofd[i] = -1;
    if (se->readonly && !sid && (r = readonly_fds(se->job, rofd)) < 0) {
        log_error("serve: job %s: cannot hand its arenas over read-only: %s", job,
                  zinf_strerror(r));
        k->sess = se;
        return r; /* the caller's end of the connection ends the session */
    }
    k->sess = se;

    struct proto_out o;
    proto_out_init(&o, PROTO_HELLO | PROTO_REPLY, seq);
    proto_put_i32(&o, 0);
    proto_put_u64(&o, se->id);
    proto_put_u64(&o, se->secret);
    const struct engine_region *reg = se->job->reg;
    int nreg = MEM_TIERS + 2 * (se->ps != NULL), nfds = 0;
    proto_put_u32(&o, (uint32_t)nreg);
    int fds[PROTO_MAX_REGIONS];
    for (int i = 0; i < MEM_TIERS; i++) {
        /* A CUDA arena has no fd: the client opens it with the handle that follows. */
        proto_put_u32(&o, reg[i].cuda ? PROTO_REGION_CUDA : (uint32_t)reg[i].tier);
        proto_put_u64(&o, reg[i].bytes);
        if (!reg[i].cuda) fds[nfds++] = rofd[i] >= 0 ? rofd[i] : reg[i].fd;
    }
    if (se->ps) {
        proto_put_u32(&o, PROTO_REGION_PINS);
        proto_put_u64(&o, se->ps_bytes);
        fds[nfds++] = se->ps_fd;
        proto_put_u32(&o, PROTO_REGION_LIVE);
        proto_put_u64(&o, PROTO_LIVE_BYTES);
        fds[nfds++] = se->live_fd;
    }
    if (reg[0].cuda) {
        proto_put_u32(&o, DEVICE_IPC_HANDLE_BYTES);
        proto_put_bytes(&o, reg[0].ipc_handle, DEVICE_IPC_HANDLE_BYTES);
        proto_put_str(&o, reg[0].busid);
    }
    r = proto_send(k->fd, &o, fds, sid ? 0 : nfds);
    proto_out_free(&o);
    for (int i = 0; i < MEM_TIERS; i++)
        if (rofd[i] >= 0) close(rofd[i]);
    if (!sid && se->live_fd >= 0) { /* the mapping holds the memory; an fd less to keep */
        close(se->live_fd);
        se->live_fd = -1;
    }
    return r < 0 ? r : 1; /* 1: the reply went out */
}

/* The session loses a connection; the last one takes it out of the lists. */
void serve_session_leave(struct service *s, struct session *se)
{
    bool last = false;
    struct job *j = se->job;
    uid_t se_uid = se->uid;
    pthread_mutex_lock(&s->lock);
    if (--se->conns == 0) {
        last = true;
        list_take(s->sessions, se);
    }
    pthread_mutex_unlock(&s->lock);
    if (!last) return;
    session_free(s, se);
    /* Counted out once its pins are dropped: an idle job's close finds none. */
    pthread_mutex_lock(&s->lock);
    struct ucount *uc = serve_ucount_of(s, se_uid);
    if (uc) uc->sessions--;
    if (--j->sessions == 0) j->idle_since = now_ns();
    pthread_mutex_unlock(&s->lock);
}
