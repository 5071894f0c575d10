/*
 * manage.c - the calls that manage a daemon without a session (client.h): STATUS (zinf job
 * list, zinf stat), JOB_CLOSE, JOB_REMOVE and JOB_SHARE (zinf job), SHUTDOWN (zinf serve
 * --stop), each on a connection of its own.
 *
 * Not here: the sessions (client.c), what the daemon decides (server.c, jobs.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "service/client.h"
#include "service/proto.h"

/* The reply to a request sent on a new connection (the send's result r): the daemon's
 * refusal at accept (an unasked HELLO reply, proto.h) is read, even where the send found the
 * connection closed after it, and answered with its result. */
static int first_reply(int fd, int r, uint16_t op, struct proto_header *h, uint8_t **payload)
{
    *payload = NULL;
    if (r < 0 && r != -ECONNRESET) return r;
    int rr = proto_recv(fd, true, h, payload, NULL, NULL);
    if (rr < 0) return r < 0 ? r : rr;
    if (h->op == (PROTO_HELLO | PROTO_REPLY) && op != PROTO_HELLO && h->len >= 4) {
        int32_t res;
        memcpy(&res, *payload, 4);
        if (res < 0) {
            free(*payload);
            *payload = NULL;
            return res;
        }
    }
    return 0;
}

/* One page of STATUS, the jobs after the name after (""), appended to *js (n of them, cap
 * room); *more: more follow. */
static int status_page(int fd, const char *after, struct service_job_status **js, size_t *n,
                       size_t *cap, bool *more)
{
    struct proto_request q = {.op = PROTO_STATUS};
    snprintf(q.name, sizeof(q.name), "%s", after);
    struct proto_out o;
    proto_encode_request(&q, 1, &o);
    int r = proto_send(fd, &o, NULL, 0);
    proto_out_free(&o);
    struct proto_header h;
    uint8_t *payload;
    r = first_reply(fd, r, PROTO_STATUS, &h, &payload);
    if (r < 0) return r;
    struct proto_in in;
    proto_in_init(&in, payload, h.len);
    r = proto_get_i32(&in);
    uint32_t count = r == 0 ? proto_get_u32(&in) : 0;
    if (r == 0 && !in.bad && *n + count > *cap) {
        size_t c = MAX(*cap * 2, *n + count);
        struct service_job_status *m = realloc(*js, MAX(c, (size_t)1) * sizeof(*m));
        if (m) {
            *js = m;
            *cap = c;
        } else {
            r = -ENOMEM;
        }
    }
    for (uint32_t i = 0; r == 0 && i < count && !in.bad; i++) {
        struct service_job_status *j = &(*js)[*n + i];
        memset(j, 0, sizeof(*j));
        proto_get_str(&in, j->name, 64);
        j->owner_uid = proto_get_u32(&in);
        j->open = proto_get_u32(&in) != 0;
        j->sessions = proto_get_u32(&in);
        j->pins = proto_get_u64(&in);
        uint32_t bytes = proto_get_u32(&in);
        const uint8_t *p = proto_get_bytes(&in, bytes);
        if (p && bytes == sizeof(j->stats))
            memcpy(&j->stats, p, bytes);
        else
            in.bad = true;
    }
    *more = r == 0 && proto_get_u32(&in) != 0;
    if (r == 0 && (in.bad || proto_done(&in) < 0 || (*more && !count))) r = -EPROTO;
    if (r == 0) *n += count;
    free(payload);
    return r;
}

int service_status(const char *socket, struct service_job_status **out, size_t *n)
{
    int fd, r = service_dial(socket, &fd);
    *out = NULL;
    *n = 0;
    if (r < 0) return r;
    /* Page after page, each after the last name of the one before, on one connection. */
    struct service_job_status *js = NULL;
    size_t got = 0, cap = 0;
    bool more = true;
    while (r == 0 && more)
        r = status_page(fd, got ? js[got - 1].name : "", &js, &got, &cap, &more);
    close(fd);
    if (r < 0) {
        free(js);
        return r;
    }
    *out = js;
    *n = got;
    return 0;
}

int service_manage(const char *socket, int op, const char *job)
{
    return op == PROTO_JOB_SHARE ? -EINVAL : service_manage_flags(socket, op, job, 0);
}

int service_manage_flags(const char *socket, int op, const char *job, uint32_t flags)
{
    if (!socket || (op != PROTO_SHUTDOWN && (!job || !job[0] || strlen(job) > PROTO_MAX_JOB)))
        return -EINVAL;
    int fd, d = service_dial(socket, &fd);
    if (d < 0) return d;
    struct proto_out o;
    proto_out_init(&o, (uint16_t)op, 1);
    if (op != PROTO_SHUTDOWN) proto_put_str(&o, job);
    if (op == PROTO_JOB_SHARE) proto_put_u32(&o, flags);
    int r = proto_send(fd, &o, NULL, 0);
    proto_out_free(&o);
    struct proto_header h;
    uint8_t *payload;
    r = first_reply(fd, r, (uint16_t)op, &h, &payload);
    if (r == 0) {
        struct proto_in in;
        proto_in_init(&in, payload, h.len);
        r = proto_get_i32(&in);
        if (op == PROTO_SHUTDOWN && r == 0) proto_get_u32(&in); /* the daemon's pid */
        if (h.op != (op | PROTO_REPLY) || proto_done(&in) < 0) r = -EPROTO;
    }
    free(payload);
    close(fd);
    return r;
}

/* Whether process pid is still there (a zombie is not: it has exited). */
static bool pid_alive(pid_t pid)
{
    char path[64], stat[256];
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return true; /* no /proc: kill() said it is there */
    ssize_t n = read(fd, stat, sizeof(stat) - 1);
    close(fd);
    if (n <= 0) return false;
    stat[n] = 0;
    const char *p = strrchr(stat, ')'); /* "pid (comm) S ...": comm may hold anything */
    return !(p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'));
}

/* How long, after the daemon has closed the connection, its process may take to exit: it
 * has nothing left to do but return. A pid that outlives this is not the daemon's (one of
 * another pid namespace, say): it is not waited for further. */
#define STOP_EXIT_WAIT_MS 10000

int service_shutdown(const char *socket)
{
    if (!socket) return -EINVAL;
    int fd, r = service_dial(socket, &fd);
    if (r < 0) return r;
    struct proto_out o;
    proto_out_init(&o, PROTO_SHUTDOWN, 1);
    r = proto_send(fd, &o, NULL, 0);
    proto_out_free(&o);
    struct proto_header h;
    uint8_t *payload;
    uint32_t pid = 0;
    r = first_reply(fd, r, PROTO_SHUTDOWN, &h, &payload);
    if (r == 0) {
        struct proto_in in;
        proto_in_init(&in, payload, h.len);
        r = proto_get_i32(&in);
        if (r == 0) pid = proto_get_u32(&in);
        if (h.op != (PROTO_SHUTDOWN | PROTO_REPLY) || proto_done(&in) < 0) r = -EPROTO;
    }
    free(payload);
    if (r == 0) {
        /* The daemon keeps this connection until it has flushed and closed every job. */
        char c;
        ssize_t n;
        while ((n = read(fd, &c, 1)) > 0 || (n < 0 && errno == EINTR))
            ;
        /* Then its process exits. */
        for (int ms = 0; pid && ms < STOP_EXIT_WAIT_MS && pid_alive((pid_t)pid); ms += 10) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    close(fd);
    return r;
}
