/*
 * server.c - the zinf daemon behind server.h.
 *
 * Threads: service_run() waits in epoll on the listening socket, the stop pipe and every
 * connection between its requests; it accepts (admit: the limits of zinf.serve), and hands
 * a connection with a request waiting to an idle worker thread, or starts one (dispatch).
 * A worker serves that connection's requests while they keep coming (conn_serve: spins,
 * then waits up to CONN_LINGER_MS), calls the job's engine (engine_api_*, thread-safe),
 * and puts the connection back in the epoll set when it goes quiet; idle workers leave
 * after 10 s. The keeper thread (keeper.c) holds the sessions' liveness mutexes; STATUS is
 * answered by status.c; the objects below are in server_int.h. Once a second
 * service_run() closes connections that did not say HELLO in time and starts the closing
 * of jobs idle too long (job_closer, a thread each). A request that cannot be parsed gets
 * an error reply and the connection is closed; a request that fails (whatever its error) is
 * answered and the connection stays; nothing a client sends can take the daemon down.
 *
 * States, all under s->lock:
 *   a connection: waiting in the epoll set (!busy) -> handed to a worker (busy) -> back,
 *     or dropped (its peer left, it broke the protocol, its HELLO was refused, the
 *     service stops); one without a session and !busy past hello_timeout is dropped by the
 *     sweep. One over a limit at accept is never a connection here: it is told why and
 *     closed there (admit), counted nowhere.
 *   a job: opening (in the list, e NULL; its folders and engine made without the lock)
 *     -> open -> closing (idle for idle_job_close, or JOB_CLOSE/JOB_REMOVE: its engine
 *     flushed and closed, its folders removed, without the lock) -> out of the list; or,
 *     where its flush failed (not for JOB_REMOVE), back to open, tried again later
 *     (job_kept). Once the service stops (stopping), no job opens or closes but by the
 *     stop's own path, which flushes every job before it tears down a session. A HELLO or a job
 *     command for a job that is opening or closing waits on job_cv, then finds it open or
 *     opens it anew. sessions counts its sessions; a job with one is never closing.
 *   a session: counted against its uid when its HELLO is admitted, before its job opens
 *     (given back if no session is made) -> in s->sessions while it has connections
 *     (conns); its last connection's leaving takes it out, then drops what it held
 *     (session_free), then counts it out of its job and uid.
 *
 * Locks, outermost first: s->lock (the lists of jobs, sessions and connections, the
 * sessions' connection counts, the limits' counts, the workers), then a session's lock (its
 * pins, tickets and stages), then the engine's (STATUS's stats and pin counts). No file IO
 * and no wait on a client under s->lock: jobs open and close, and STATUS reads saved jobs,
 * without it. The session cleanup's releases are made after the session left every list
 * (no other thread can reach it).
 *
 * The pins a session holds are counted here per (tensor, tier), since the engine counts
 * pins of all sessions together: a release first takes one off the session's count (so
 * two connections of one session cannot both spend the same pin), and puts it back when
 * the engine refuses the release.
 */
#include <dirent.h>
#include <time.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/falloc.h>
#include <malloc.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "engine/engine.h"
#include "hugemem.h"
#include "service/folders.h"
#include "service/proto.h"
#include "service/server.h"
#include "service/server_int.h"

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

/* ---- jobs ---------------------------------------------------------------------------- */

bool serve_job_name_ok(const char *n)
{
    if (!n[0] || n[0] == '.' || strlen(n) > PROTO_MAX_JOB) return false;
    for (const char *p = n; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '.' || *p == '_' || *p == '-'))
            return false;
    return true;
}

/* Whether the job's folder holds a saved state (a manifest naming tensors). */
static bool saved(struct service *s, const char *name)
{
    char d[4096];
    size_t n = 0;
    if (!s->config->nvme_paths.count ||
        snprintf(d, sizeof(d), "%s/%s", s->config->nvme_paths.path[0], name) >= (int)sizeof(d))
        return false;
    return persist_probe(d, &n, NULL) == 0 && n > 0;
}

/* The owner of job name's folder under the first swap directory: 0 and *owner, or -errno
 * (-ENOENT: it has no folder, a new job). File IO, without s->lock. */
static int saved_owner(struct service *s, const char *name, uid_t *owner)
{
    char path[4096];
    struct stat st;
    if (!s->config->nvme_paths.count) return -ENOENT;
    if (snprintf(path, sizeof(path), "%s/%s", s->config->nvme_paths.path[0], name) >=
        (int)sizeof(path))
        return -ENAMETOOLONG;
    if (lstat(path, &st) != 0) return -errno;
    int r = folders_read_owner(path, owner);
    if (r == -ENOENT) *owner = geteuid(); /* a folder without one: the daemon's user's */
    return r == -ENOENT ? 0 : r;
}

/* Opens job j for uid (its folders, then its engine, resuming what it saved): file IO, done
 * without s->lock. Another user's saved job is refused (-EACCES) before anything of it is
 * opened: its engine would resume its tensors and take its memory for a HELLO answered
 * -EACCES anyway. */
static int job_open(struct service *s, struct job *j, uid_t uid, uid_t *owner, char *why,
                    size_t whylen)
{
    uid_t was;
    int so = saved_owner(s, j->name, &was);
    if (uid != 0 && so == 0 && was != uid) return -EACCES;
    /* A new folder counts against zinf.serve.saved_jobs_per_uid: each is a STATUS entry and
     * a scan's work for every user, long after its job closed. */
    unsigned folders;
    if (so == -ENOENT && !serve_privileged(uid) &&
        (folders = status_saved_count(s, uid)) >= s->lim->saved_jobs_per_uid) {
        snprintf(why, whylen,
                 "zinf serve: job %.64s refused: this uid has %u jobs saved, the limit "
                 "(zinf.serve.saved_jobs_per_uid); zinf job rm removes one",
                 j->name, folders);
        return -EUSERS;
    }
    int r = folders_job(&s->config->nvme_paths, j->name, uid, owner);
    if (r < 0) return r;
    /* A job resumes what it saved in its folder; with nothing saved there it is new. */
    r = engine_open_config_shared(s->config, saved(s, j->name) ? ZINF_OPEN_RESUME : 0, j->name,
                                  &j->e);
    if (r == 0 && (r = engine_regions(j->e, j->reg)) < 0) {
        log_error("serve: job %s: its device arena cannot be shared with clients: %s", j->name,
                  zinf_strerror(r));
        engine_api_close(j->e);
        j->e = NULL;
    }
    if (r < 0) {
        log_error("serve: job %s: cannot open its engine: %s", j->name, zinf_strerror(r));
        return r;
    }
    log_notice("serve: job %s opened (owner uid %u)", j->name, (unsigned)*owner);
    return 0;
}

/* Takes j out of the list of jobs. s->lock held. */
static void job_unlink(struct service *s, struct job *j)
{
    for (struct job **pp = &s->jobs; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            break;
        }
}

/* Closes a closing job's engine, without s->lock. It is flushed first; a flush that fails
 * (the swap filesystem full, a drive gone: -errno) leaves the job open with every write
 * acknowledged, for the caller to keep (job_kept), unless force (the daemon stops, or the
 * job is removed). Once the engine is closed the pages of its arenas are punched out of
 * their memfds: a client that kept them (the fds or a mapping) holds no memory of a closed
 * job, and reads zeros there. The daemon's own mappings went with the engine: nothing
 * here touches that memory again. */
static int job_shut(struct job *j, const char *why, bool force)
{
    if (!j->e) return 0;
    /* Forced, the close's own flush serves (its failure is logged by the engine). */
    int r = force ? 0 : engine_api_flush(j->e);
    if (r < 0) return r;
    int fds[MEM_TIERS];
    for (int i = 0; i < MEM_TIERS; i++)
        fds[i] = j->reg[i].cuda ? -1 : fcntl(j->reg[i].fd, F_DUPFD_CLOEXEC, 0);
    engine_api_close(j->e);
    j->e = NULL;
    for (int i = 0; i < MEM_TIERS; i++) {
        struct stat st;
        if (fds[i] < 0) continue;
        if (fstat(fds[i], &st) == 0 && st.st_size > 0 &&
            fallocate(fds[i], FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, st.st_size) != 0)
            log_warn("serve: job %s: its %s arena's memory cannot be given back while a client "
                     "keeps it: %s",
                     j->name, i ? "host" : "device", strerror(errno));
        close(fds[i]);
    }
    malloc_trim(0); /* what the job's buffers left in the heaps goes back too */
    log_notice("serve: job %s closed (%s)", j->name, why);
    return 0;
}

/* How long a job whose close could not flush waits before it is tried again. */
#define CLOSE_RETRY_NS (10 * 1000000000ull)

/* A closing job whose flush failed (err) stays open: its closing undone, and whoever waits
 * for it told; an idle one is tried again after CLOSE_RETRY_NS (or idle_job_close, if
 * shorter), one line logged each time. */
static void job_kept(struct service *s, struct job *j, int err)
{
    uint64_t retry_ns = MIN(CLOSE_RETRY_NS, (uint64_t)s->lim->idle_job_close * 1000000000ull);
    log_error("serve: job %s: not closed, its flush failed: %s; it stays open with what was "
              "written, and its close is tried again in %llu s",
              j->name, zinf_strerror(err), (unsigned long long)(retry_ns / 1000000000ull));
    pthread_mutex_lock(&s->lock);
    j->closing = false;
    j->retry_at = now_ns() + retry_ns;
    s->closers--;
    pthread_cond_broadcast(&s->job_cv);
    pthread_cond_broadcast(&s->gone_cv);
    pthread_mutex_unlock(&s->lock);
}

/* The end of a job's closing: out of the list, freed, and whoever waits for it told. */
static void job_gone(struct service *s, struct job *j)
{
    pthread_mutex_lock(&s->lock);
    job_unlink(s, j);
    s->closers--;
    pthread_cond_broadcast(&s->job_cv);
    pthread_cond_broadcast(&s->gone_cv);
    pthread_mutex_unlock(&s->lock);
    free(j);
}

/* Whether uid is exempt from the per-uid limits, and may use the reserved connections:
 * root and the daemon's own uid. */
bool serve_privileged(uid_t uid)
{
    return uid == 0 || uid == geteuid();
}

/* What uid has open; made when first asked for (NULL when out of memory). s->lock held. */
static struct ucount *ucount_of(struct service *s, uid_t uid)
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
static void refusal(struct service *s, uid_t uid, const char *why)
{
    uint64_t hushed;
    pthread_mutex_lock(&s->lock);
    struct ucount *u = ucount_of(s, uid);
    bool say = !u || refusal_counted(u, &hushed);
    pthread_mutex_unlock(&s->lock);
    if (say) refusal_log(uid, u ? hushed : 0, why);
}

/* The job of that name, opened (its saved state resumed) when first asked for. s->lock
 * held; it is let go while the job opens (no file IO under it), and a HELLO for a job
 * another is opening or closing waits for that. A new job counts against zinf.serve's
 * jobs_per_uid and max_jobs (-EUSERS, why says which; the caller logs it). */
static int job_get(struct service *s, const char *name, uid_t uid, struct job **out, char *why,
                   size_t whylen)
{
    struct job *j;
    for (;;) {
        for (j = s->jobs; j; j = j->next)
            if (!strcmp(j->name, name)) break;
        if (!j || (!j->opening && !j->closing)) break;
        pthread_cond_wait(&s->job_cv, &s->lock);
    }
    if (!j && s->stopping) {
        snprintf(why, whylen, "zinf serve: job %.64s refused: the daemon is stopping", name);
        return -ESHUTDOWN;
    }
    if (!j) {
        unsigned all = 0, mine = 0;
        for (struct job *o = s->jobs; o; o = o->next) {
            all++;
            mine += o->owner == uid;
        }
        if (all >= s->lim->max_jobs || (!serve_privileged(uid) && mine >= s->lim->jobs_per_uid)) {
            bool total = all >= s->lim->max_jobs;
            snprintf(why, whylen,
                     "zinf serve: job %.64s refused: %s %u jobs open, the limit "
                     "(zinf.serve.%s); a job closes %u s after its last client leaves, or with "
                     "zinf job close",
                     name, total ? "the daemon has" : "this uid has", total ? all : mine,
                     total ? "max_jobs" : "jobs_per_uid", s->lim->idle_job_close);
            return -EUSERS;
        }
        if (!(j = calloc(1, sizeof(*j)))) return -ENOMEM;
        strcpy(j->name, name);
        j->opening = true;
        j->owner = uid;
        j->next = s->jobs;
        s->jobs = j;
        pthread_mutex_unlock(&s->lock);
        uid_t owner;
        int r = job_open(s, j, uid, &owner, why, whylen);
        pthread_mutex_lock(&s->lock);
        pthread_cond_broadcast(&s->job_cv);
        if (r < 0) {
            job_unlink(s, j);
            free(j);
            return r;
        }
        j->opening = false;
        j->owner = owner;
        j->idle_since = now_ns();
    }
    if (uid != j->owner && uid != 0) return -EACCES;
    *out = j;
    return 0;
}

/* ---- sessions ------------------------------------------------------------------------ */

static struct pin **pin_find(struct session *se, zinf_tensor t, uint32_t tier)
{
    struct pin **pp = &se->pins;
    while (*pp && ((*pp)->t != t || (*pp)->tier != tier))
        pp = &(*pp)->next;
    return pp;
}

/* One more pin of (t, tier) for the session; -ENOMEM when it cannot be counted. */
static int pin_add(struct session *se, zinf_tensor t, uint32_t tier)
{
    int r = 0;
    pthread_mutex_lock(&se->lock);
    struct pin **pp = pin_find(se, t, tier);
    if (*pp) {
        (*pp)->count++;
    } else {
        struct pin *p = calloc(1, sizeof(*p));
        if (p) {
            *p = (struct pin){t, tier, 1, se->pins};
            se->pins = p;
        } else {
            r = -ENOMEM;
        }
    }
    pthread_mutex_unlock(&se->lock);
    return r;
}

/* Takes one pin of (t, tier) off the session's count: false when it holds none. */
static bool pin_take(struct session *se, zinf_tensor t, uint32_t tier)
{
    bool had = false;
    pthread_mutex_lock(&se->lock);
    struct pin **pp = pin_find(se, t, tier);
    if (*pp) {
        had = true;
        if (--(*pp)->count == 0) {
            struct pin *p = *pp;
            *pp = p->next;
            free(p);
        }
    }
    pthread_mutex_unlock(&se->lock);
    return had;
}

/* Stages smaller than this come from the heap: each mapped one is a mapping of the daemon's,
 * and a process has 65530 of them for everything (a client's one-byte stages took them
 * all, and no job could open its IO engine). */
#define STAGE_MAPPED_BYTES (1u << 20)

static void stage_free(struct stage *g)
{
    if (g->buf && g->bytes >= STAGE_MAPPED_BYTES)
        munmap(g->buf, (size_t)g->bytes);
    else
        free(g->buf);
    free(g);
}

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
        stage_free(g);
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

/* ---- requests ------------------------------------------------------------------------ */

/* The (region, offset) of a pointer the job's engine handed out for tier. */
static int where(const struct job *j, uint32_t tier, const void *ptr, struct proto_out *o)
{
    if (tier >= MEM_TIERS) return -EIO;
    const struct engine_region *g = &j->reg[tier];
    const char *p = ptr, *b = g->base;
    if (p < b || p >= b + g->bytes) return -EIO;
    proto_put_u32(o, tier);
    proto_put_u64(o, (uint64_t)(p - b));
    return o->bad ? -ENOMEM : 0;
}

/* A pin the engine gave the session: counted and answered with its place, or (0 is not
 * returned) released again. */
static int keep_pin(struct session *se, zinf_tensor t, uint32_t tier, void *ptr,
                    struct proto_out *o)
{
    int r = pin_add(se, t, tier);
    if (r == 0 && (r = where(se->job, tier, ptr, o)) < 0) pin_take(se, t, tier);
    if (r < 0) engine_api_release(se->job->e, t, (enum zinf_tier)tier, 0);
    return r;
}

static int do_fetch(struct session *se, const struct proto_request *q, struct proto_out *o)
{
    void *ptr;
    bool leased;
    zinf_engine *e = se->job->e;
    int r = engine_api_fetch_leased(e, se->ps, q->handle, (enum zinf_tier)q->tier, &ptr, &leased);
    if (r < 0 || !leased) return r < 0 ? r : keep_pin(se, q->handle, q->tier, ptr, o);
    /* The pin is counted in the session's slot, which the client releases by itself. */
    r = where(se->job, q->tier, ptr, o);
    if (r < 0) engine_release_leased(e, se->ps, q->handle, (enum zinf_tier)q->tier, 0);
    return r;
}

static int do_fetch_all(struct session *se, const struct proto_request *q, struct proto_out *o)
{
    uint32_t n = q->n, tier = q->tier;
    zinf_engine *e = se->job->e;
    zinf_tensor *ts = malloc(n * sizeof(*ts));
    void **ptrs = malloc(n * sizeof(*ptrs));
    bool *leased = malloc(n * sizeof(*leased));
    int r = ts && ptrs && leased ? 0 : -ENOMEM;
    if (r == 0) {
        memcpy(ts, q->data, n * sizeof(*ts));
        r = engine_api_fetch_all_leased(e, se->ps, ts, n, (enum zinf_tier)tier, ptrs, leased);
    }
    bool pinned = r == 0;
    uint32_t added = 0; /* members counted: ordinary pins added, or in their slot */
    for (; r == 0 && added < n; added++)
        if (!leased[added] && (r = pin_add(se, ts[added], tier)) < 0) break;
    for (uint32_t i = 0; r == 0 && i < n; i++)
        r = where(se->job, tier, ptrs[i], o);
    if (r < 0 && pinned) {
        /* Every pin of the set goes, as an embedded zinf_fetch_all that failed leaves none. */
        for (uint32_t i = 0; i < n; i++) {
            if (leased[i]) {
                engine_release_leased(e, se->ps, ts[i], (enum zinf_tier)tier, 0);
                continue;
            }
            if (i < added) pin_take(se, ts[i], tier);
            engine_api_release(e, ts[i], (enum zinf_tier)tier, 0);
        }
    }
    free(ts);
    free(ptrs);
    free(leased);
    return r;
}

/* Room in the session's hash for what nticks counts: doubled when it holds as many as it
 * has chains (left as it is when that cannot be had: longer chains, still right). se->lock
 * held. */
static void tick_room(struct session *se)
{
    size_t n = se->ticks ? se->ticks_mask + 1 : 0;
    if (se->ticks && se->nticks <= n) return;
    size_t nn = n ? 2 * n : 64;
    struct tick **h = calloc(nn, sizeof(*h));
    if (!h) return;
    for (size_t i = 0; i < n; i++)
        for (struct tick *k = se->ticks[i], *next; k; k = next) {
            next = k->next;
            k->next = h[k->id & (nn - 1)];
            h[k->id & (nn - 1)] = k;
        }
    free(se->ticks);
    se->ticks = h;
    se->ticks_mask = nn - 1;
}

/* Takes the session's ticket id out of its hash (still counted in nticks): NULL when it
 * has none of that id. se->lock held. */
static struct tick *tick_take(struct session *se, uint64_t id)
{
    if (!se->ticks) return NULL;
    struct tick **pp = &se->ticks[id & se->ticks_mask];
    while (*pp && (*pp)->id != id)
        pp = &(*pp)->next;
    struct tick *k = *pp;
    if (k) *pp = k->next;
    return k;
}

/* FETCH_ASYNC: a ticket, counted against zinf.serve.tickets_per_session before the engine
 * is asked (-EMFILE past it). */
static int do_fetch_async(struct session *se, const struct proto_request *q, struct proto_out *o)
{
    unsigned limit = se->svc->lim->tickets_per_session;
    pthread_mutex_lock(&se->lock);
    bool room = se->nticks < limit;
    if (room) {
        se->nticks++;
        tick_room(se);
    }
    size_t held = se->nticks;
    pthread_mutex_unlock(&se->lock);
    if (!room) {
        char why[256];
        snprintf(why, sizeof(why),
                 "job %s: a zinf_fetch_async refused: the session holds %zu tickets not waited "
                 "for, the limit (zinf.serve.tickets_per_session): -EMFILE",
                 se->job->name, held);
        refusal(se->svc, se->uid, why);
        return -EMFILE;
    }
    struct tick *k = calloc(1, sizeof(*k));
    uint64_t id;
    int r = k ? engine_api_fetch_async(se->job->e, q->handle, (enum zinf_tier)q->tier, &id)
              : -ENOMEM;
    pthread_mutex_lock(&se->lock);
    bool kept = r == 0 && se->ticks;
    if (kept) {
        *k = (struct tick){id, q->handle, q->tier, se->ticks[id & se->ticks_mask]};
        se->ticks[id & se->ticks_mask] = k;
    } else {
        se->nticks--;
    }
    pthread_mutex_unlock(&se->lock);
    if (r == 0 && !kept) { /* no hash could be had: the ticket goes back */
        engine_ticket_drop(se->job->e, id);
        r = -ENOMEM;
    }
    if (r < 0) {
        free(k);
        return r;
    }
    proto_put_u64(o, id);
    return 0;
}

static int do_wait(struct session *se, const struct proto_request *q, struct proto_out *o)
{
    /* Only the session's own tickets: another's is as unknown as a made-up one. */
    pthread_mutex_lock(&se->lock);
    struct tick *k = tick_take(se, q->handle);
    if (k) se->nticks--;
    pthread_mutex_unlock(&se->lock);
    if (!k) return -EINVAL;
    void *ptr;
    int r = engine_api_wait(se->job->e, k->id, &ptr); /* a wait that fails keeps no pin */
    if (r == 0) r = keep_pin(se, k->t, k->tier, ptr, o);
    free(k);
    return r;
}

static int do_release(struct session *se, const struct proto_request *q)
{
    if (q->tier >= MEM_TIERS || (q->flags & ~(ZINF_RELEASE_DIRTY | ZINF_RELEASE_ZERO)))
        return -EINVAL; /* the engine checks the rest */
    if (!pin_take(se, q->handle, q->tier)) {
        /* Not an ordinary pin: one counted in the session's slot, or none at all. */
        if (!se->ps) return -EINVAL;
        return engine_release_leased(se->job->e, se->ps, q->handle, (enum zinf_tier)q->tier,
                                     q->flags);
    }
    int r = engine_api_release(se->job->e, q->handle, (enum zinf_tier)q->tier, q->flags);
    if (r < 0 && pin_add(se, q->handle, q->tier) < 0)
        log_error("serve: job %s: lost count of a pin kept after a failed release", se->job->name);
    return r;
}

static int do_read(struct session *se, const struct proto_request *q, struct proto_out *o)
{
    size_t mark = o->len;
    proto_put_u32(o, q->n);
    void *dst = proto_put_space(o, q->n);
    if (!dst && q->n) return -ENOMEM;
    int r = engine_api_read(se->job->e, q->handle, q->offset, q->n ? dst : (void *)"", q->n);
    if (r < 0) o->len = mark; /* no fields after a failed result */
    return r;
}

/* STAGE_WRITE and STAGE_READ: a stage of q->bytes for the range, counted against the
 * session's limit; a read stage is filled now, by one call of the engine. */
static int do_stage_open(struct session *se, const struct proto_request *q, struct proto_out *o)
{
    zinf_engine *e = se->job->e;
    char none;
    if (q->bytes == 0 || q->bytes > SIZE_MAX || q->offset > SIZE_MAX - q->bytes) return -EINVAL;
    /* The range is checked first, as embedded (a bad handle, past the end, damaged). */
    int r = engine_api_read(e, q->handle, (size_t)(q->offset + q->bytes), &none, 0);
    if (r < 0) return r;
    struct stage *g = calloc(1, sizeof(*g));
    if (!g) return -ENOMEM;
    unsigned max_stages = se->svc->lim->stages_per_session;
    pthread_mutex_lock(&se->lock);
    bool many = se->nstages >= max_stages;
    bool room = !many && q->bytes <= se->stage_limit - se->staged;
    if (room) {
        se->staged += q->bytes;
        se->nstages++;
    }
    g->id = ++se->next_stage;
    pthread_mutex_unlock(&se->lock);
    if (!room) {
        free(g);
        char why[256];
        if (many)
            snprintf(why, sizeof(why),
                     "job %s: a stage refused: the session has %u open, the limit "
                     "(zinf.serve.stages_per_session): -EMFILE",
                     se->job->name, max_stages);
        else
            snprintf(why, sizeof(why),
                     "job %s: a stage of %llu bytes refused, more than "
                     "zinf.serve.write_stage_bytes (%llu) leaves the session: -EMSGSIZE",
                     se->job->name, (unsigned long long)q->bytes,
                     (unsigned long long)se->stage_limit);
        refusal(se->svc, se->uid, why);
        return many ? -EMFILE : -EMSGSIZE;
    }
    /* A large one mapped, not malloc'ed: given back to the system whole when freed (a
     * freed malloc block this large would raise glibc's mmap threshold, and the daemon's
     * heap would keep every later one). */
    void *buf;
    if (q->bytes >= STAGE_MAPPED_BYTES) {
        buf = mmap(NULL, (size_t)q->bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (buf == MAP_FAILED) buf = NULL;
    } else {
        buf = malloc((size_t)q->bytes);
    }
    *g = (struct stage){g->id, q->op == PROTO_STAGE_WRITE, q->handle, q->offset, q->bytes, buf,
                        NULL};
    r = g->buf ? 0 : -ENOMEM;
    if (r == 0 && !g->write) r = engine_api_read(e, g->t, (size_t)g->off, g->buf, (size_t)g->bytes);
    pthread_mutex_lock(&se->lock);
    if (r == 0) {
        g->next = se->stages;
        se->stages = g;
    } else {
        se->staged -= q->bytes;
        se->nstages--;
    }
    pthread_mutex_unlock(&se->lock);
    if (r < 0) {
        stage_free(g);
        return r;
    }
    proto_put_u64(o, g->id);
    return 0;
}

/* Takes the session's stage id out of its list (so that no other call frees it while this
 * one copies); NULL when it has none of that id, or another call has it now. */
static struct stage *stage_take(struct session *se, uint64_t id)
{
    pthread_mutex_lock(&se->lock);
    struct stage **pp = &se->stages;
    while (*pp && (*pp)->id != id)
        pp = &(*pp)->next;
    struct stage *g = *pp;
    if (g) *pp = g->next;
    pthread_mutex_unlock(&se->lock);
    return g;
}

static void stage_put_back(struct session *se, struct stage *g)
{
    pthread_mutex_lock(&se->lock);
    g->next = se->stages;
    se->stages = g;
    pthread_mutex_unlock(&se->lock);
}

/* STAGE_PUT and STAGE_GET: bytes into a write stage, or out of a read stage. */
static int do_stage_move(struct session *se, const struct proto_request *q, struct proto_out *o)
{
    struct stage *g = stage_take(se, q->handle);
    if (!g) return -EINVAL;
    int r = 0;
    if (g->write != (q->op == PROTO_STAGE_PUT) || q->offset > g->bytes ||
        q->n > g->bytes - q->offset) {
        r = -EINVAL;
    } else if (g->write) {
        memcpy(g->buf + q->offset, q->data, q->n);
    } else {
        proto_put_u32(o, q->n);
        proto_put_bytes(o, g->buf + q->offset, q->n);
        if (o->bad) r = -ENOMEM;
    }
    stage_put_back(se, g);
    return r;
}

/* STAGE_END: a write stage applied whole, by one call of the engine; the stage freed. */
static int do_stage_end(struct session *se, const struct proto_request *q)
{
    struct stage *g = stage_take(se, q->handle);
    if (!g) return -EINVAL;
    int r = g->write ? engine_api_write(se->job->e, g->t, (size_t)g->off, g->buf, (size_t)g->bytes)
                     : 0;
    pthread_mutex_lock(&se->lock);
    se->staged -= g->bytes;
    se->nstages--;
    pthread_mutex_unlock(&se->lock);
    stage_free(g);
    return r;
}

/* REGISTER. A tensor homed on NVMe is counted first against its uid's
 * zinf.serve.swap_bytes_per_uid: the swap that uid's open jobs hold, and the registers of
 * its that are admitted and not done (-EDQUOT past it; root and the daemon's uid are not
 * counted). One user filling the swap filesystem made every other job's flush fail. */
static int do_register(struct session *se, const struct proto_request *q, struct proto_out *o)
{
    struct service *s = se->svc;
    if (q->handle > SIZE_MAX) return -EINVAL;
    uint64_t bytes = q->tier == ZINF_TIER_NVME ? q->handle : 0, used = 0;
    uint64_t limit = s->lim->swap_bytes_per_uid;
    struct ucount *u = NULL;
    if (bytes && !serve_privileged(se->uid)) {
        /* Lock order: the service, then (in engine_api_stats) an engine. */
        pthread_mutex_lock(&s->lock);
        for (struct job *j = s->jobs; j; j = j->next) {
            struct zinf_stats st;
            if (j->opening || j->closing || j->owner != se->uid) continue;
            if (engine_api_stats(j->e, &st) == 0) used += st.tier[ZINF_TIER_NVME].used_bytes;
        }
        if ((u = ucount_of(s, se->uid))) used += u->swap_pending;
        bool room = u && used <= limit && bytes <= limit - used;
        if (room) u->swap_pending += bytes;
        pthread_mutex_unlock(&s->lock);
        if (!room) {
            char why[256];
            snprintf(why, sizeof(why),
                     "job %s: a tensor of %llu bytes on NVMe refused: this uid's jobs hold %llu "
                     "bytes of swap, and zinf.serve.swap_bytes_per_uid is %llu: -EDQUOT",
                     se->job->name, (unsigned long long)bytes, (unsigned long long)used,
                     (unsigned long long)limit);
            refusal(s, se->uid, why);
            return u ? -EDQUOT : -ENOMEM;
        }
    }
    zinf_tensor t;
    int r = engine_api_register(se->job->e, q->name, (size_t)q->handle, (enum zinf_tier)q->tier,
                                &t);
    if (u) {
        pthread_mutex_lock(&s->lock);
        u->swap_pending -= bytes;
        pthread_mutex_unlock(&s->lock);
    }
    if (r == 0) proto_put_u64(o, t);
    return r;
}

static int do_request(struct session *se, const struct proto_request *q, struct proto_out *o)
{
    zinf_engine *e = se->job->e;
    zinf_tensor t;
    int r;

    switch (q->op) {
    case PROTO_REGISTER:
        return do_register(se, q, o);
    case PROTO_LOOKUP:
        r = engine_api_lookup(e, q->name, &t);
        if (r == 0) proto_put_u64(o, t);
        return r;
    case PROTO_UNREGISTER:
        return engine_api_unregister(e, q->handle);
    case PROTO_ZERO:
        return engine_api_zero(e, q->handle);
    case PROTO_TENSOR_INFO: {
        struct zinf_tensor_info ti;
        r = engine_api_tensor_info(e, q->handle, &ti);
        if (r == 0) {
            proto_put_u32(o, (uint32_t)ti.home);
            proto_put_u64(o, ti.bytes);
        }
        return r;
    }
    case PROTO_FETCH:
        return do_fetch(se, q, o);
    case PROTO_FETCH_ASYNC:
        return do_fetch_async(se, q, o);
    case PROTO_WAIT:
        return do_wait(se, q, o);
    case PROTO_FETCH_ALL:
        return do_fetch_all(se, q, o);
    case PROTO_RELEASE:
        return do_release(se, q);
    case PROTO_PREFETCH:
        return engine_api_prefetch(e, q->handle, (enum zinf_tier)q->tier);
    case PROTO_STEP:
        return engine_api_step(e);
    case PROTO_WRITE:
        return engine_api_write(e, q->handle, q->offset, q->n ? (const void *)q->data : "", q->n);
    case PROTO_READ:
        return do_read(se, q, o);
    case PROTO_STAGE_WRITE:
    case PROTO_STAGE_READ:
        return do_stage_open(se, q, o);
    case PROTO_STAGE_PUT:
    case PROTO_STAGE_GET:
        return do_stage_move(se, q, o);
    case PROTO_STAGE_END:
        return do_stage_end(se, q);
    case PROTO_FLUSH:
        return engine_api_flush(e);
    case PROTO_STATS: {
        struct zinf_stats st;
        r = engine_api_stats(e, &st);
        if (r == 0) {
            proto_put_u32(o, sizeof(st));
            proto_put_bytes(o, &st, sizeof(st));
        }
        return r;
    }
    default:
        return -EBADMSG; /* HELLO again */
    }
}

/* ---- connections --------------------------------------------------------------------- */

/* An error reply: the result alone, or (HELLO) with why after it, which the client logs. */
static int reply_error(int fd, uint16_t op, uint32_t seq, int err, const char *why)
{
    struct proto_out o;
    proto_out_init(&o, (uint16_t)(op | PROTO_REPLY), seq);
    proto_put_i32(&o, err);
    if (why && why[0] && op == PROTO_HELLO) proto_put_str(&o, why);
    int r = proto_send(fd, &o, NULL, 0);
    proto_out_free(&o);
    return r;
}

/* The first message of a connection: it starts or joins a session. */
static int hello(struct conn *k, const struct proto_request *q, uint32_t seq)
{
    struct service *s = k->svc;
    const char *job = q->name;
    uint64_t sid = q->handle, secret = q->offset;
    if (!serve_job_name_ok(job)) return -EINVAL;
    uid_t uid = k->uid;

    struct session *se = NULL;
    int r = 0;
    pthread_mutex_lock(&s->lock);
    struct ucount *uc = ucount_of(s, uid);
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
        /* Counted now, under the lock that checked it: job_get() lets the lock go while the
         * job opens, and every HELLO that came meanwhile would pass the same check. Given
         * back below when the session is not made. */
        uc->sessions++;
        struct job *j;
        r = job_get(s, job, uid, &j, k->why, sizeof(k->why));
        if (r == 0 && !(se = calloc(1, sizeof(*se)))) r = -ENOMEM;
        if (r < 0) uc->sessions--;
        if (r == 0) {
            se->svc = s;
            se->id = ++s->next_session;
            if (getrandom(&se->secret, sizeof(se->secret), 0) != sizeof(se->secret))
                se->secret = se->id * 0x9e3779b97f4a7c15ull ^ (uint64_t)now_ns();
            se->job = j;
            se->uid = uid;
            se->conns = 1;
            /* Without a table (the engine serves as many as it can) every call is a
             * message: slower, the same answers. */
            se->live_fd = -1;
            se->stage_limit = s->config->zinf.serve.write_stage_bytes;
            if (engine_pinset_open(j->e, &se->ps, &se->ps_fd, &se->ps_bytes) < 0) se->ps = NULL;
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
    if (r == -EUSERS) refusal(s, uid, k->why + strlen("zinf serve: "));
    if (r < 0) return r;
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
        if (!reg[i].cuda) fds[nfds++] = reg[i].fd;
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
    if (!sid && se->live_fd >= 0) { /* the mapping holds the memory; an fd less to keep */
        close(se->live_fd);
        se->live_fd = -1;
    }
    return r < 0 ? r : 1; /* 1: the reply went out */
}

/* The session loses a connection; the last one takes it out of the lists. */
static void session_leave(struct service *s, struct session *se)
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
    struct ucount *uc = ucount_of(s, se_uid);
    if (uc) uc->sessions--;
    if (--j->sessions == 0) j->idle_since = now_ns();
    pthread_mutex_unlock(&s->lock);
}

/* JOB_CLOSE, JOB_REMOVE and SHUTDOWN (proto.h): the job closed (and its folders removed)
 * for its owner or root; the daemon stopped (by the caller, after the reply) for root or
 * the daemon's uid. A HELLO for the job meanwhile waits, and then opens it anew. */
static int manage(struct conn *k, const struct proto_request *q)
{
    struct service *s = k->svc;
    if (q->op == PROTO_SHUTDOWN) return serve_privileged(k->uid) ? 0 : -EPERM;
    if (!serve_job_name_ok(q->name)) return -EINVAL;
    bool rm = q->op == PROTO_JOB_REMOVE, was_open = false;
    struct job *j;
    int r = 0;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        for (j = s->jobs; j; j = j->next)
            if (!strcmp(j->name, q->name)) break;
        if (!j || (!j->opening && !j->closing)) break;
        pthread_cond_wait(&s->job_cv, &s->lock);
    }
    if (s->stopping)
        r = -ESHUTDOWN; /* every job is being flushed and closed */
    else if (j && k->uid != j->owner && k->uid != 0)
        r = -EACCES;
    else if (j && j->sessions)
        r = -EBUSY;
    else if (!j && !rm)
        r = -ENOENT;
    else if (!j && !(j = calloc(1, sizeof(*j)))) /* a placeholder while the folders go */
        r = -ENOMEM;
    else if (!j->e) {
        strcpy(j->name, q->name);
        j->next = s->jobs;
        s->jobs = j;
    } else {
        was_open = true;
    }
    if (r == 0) {
        j->closing = true;
        s->closers++;
    }
    pthread_mutex_unlock(&s->lock);
    if (r < 0) return r;
    if (was_open) {
        char why[64];
        snprintf(why, sizeof(why), "asked by uid %u", (unsigned)k->uid);
        /* A close whose flush fails keeps the job, and says why; a removal needs none. */
        if ((r = job_shut(j, why, rm)) < 0 && !rm) {
            job_kept(s, j, r);
            return r;
        }
        r = 0;
    }
    if (rm && !was_open && s->config->nvme_paths.count) {
        /* Not open: its owner is the one its folder names. */
        char path[4200];
        uid_t owner;
        snprintf(path, sizeof(path), "%s/%s", s->config->nvme_paths.path[0], j->name);
        int o = folders_read_owner(path, &owner);
        if (o == -ENOENT) owner = geteuid();
        else if (o < 0) r = o == -ENOTDIR || o == -ELOOP ? -EACCES : o;
        if (r == 0 && k->uid != owner && k->uid != 0) r = -EACCES;
        if (o == -ENOENT && access(path, F_OK) != 0) r = -ENOENT;
    }
    if (r == 0 && rm && s->config->nvme_paths.count) {
        r = folders_remove_job(&s->config->nvme_paths, j->name);
        if (r == 0) log_notice("serve: job %s removed (asked by uid %u)", j->name, (unsigned)k->uid);
    } else if (rm && !was_open && !s->config->nvme_paths.count) {
        r = -ENOENT; /* in memory only, and not open: nothing of it is left */
    }
    job_gone(s, j);
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
                reply_error(k->fd, h.op & ~PROTO_REPLY, h.seq, r, NULL);
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
                       h.op == PROTO_SHUTDOWN)) {
            free(payload); /* q holds the name */
            r = manage(k, &q);
            if (h.op == PROTO_SHUTDOWN && r == 0) {
                if (stop_asked(k, h.seq) < 0) return false;
                continue;
            }
            if (reply_error(k->fd, h.op, h.seq, r, NULL) < 0) return false;
            continue;
        }
        if (r == 0 && !k->sess) r = h.op == PROTO_HELLO ? hello(k, &q, h.seq) : -EPROTO;
        if (r != 0 || !k->sess || h.op == PROTO_HELLO) {
            free(payload);
            if (r < 0) {
                reply_error(k->fd, h.op, h.seq, r, h.op == PROTO_HELLO ? k->why : NULL);
                return false;
            }
            if (r == 1) /* the session's HELLO, answered */
                continue;
            reply_error(k->fd, h.op, h.seq, -EBADMSG, NULL); /* a second HELLO */
            return false;
        }
        struct proto_out o;
        proto_out_init(&o, (uint16_t)(h.op | PROTO_REPLY), h.seq);
        proto_put_i32(&o, 0);
        atomic_fetch_add_explicit(&s->requests, 1, memory_order_relaxed);
        r = do_request(k->sess, &q, &o);
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
static void conn_drop(struct service *s, struct conn *k, bool in_epoll)
{
    pthread_mutex_lock(&s->lock);
    list_take(s->conns, k);
    s->nconns--;
    struct ucount *u = ucount_of(s, k->uid); /* made at accept: found */
    if (u) u->conns--;
    pthread_mutex_unlock(&s->lock);
    if (in_epoll) epoll_ctl(s->ep, EPOLL_CTL_DEL, k->fd, NULL);
    if (k->sess) session_leave(s, k->sess);
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
        conn_drop(s, k, false);
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

/* A connection refused at accept is told why before it is closed: unasked, a HELLO's
 * refusal (seq 0), which a client reads in place of the reply to its first request. Without
 * waiting: a peer that reads nothing costs no more than one try. */
static void refuse_at_accept(int fd, const char *why)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0)
        reply_error(fd, PROTO_HELLO, 0, -EUSERS, why);
    close(fd);
}

/* A new connection: counted against zinf.serve's limits and put in the epoll set. One over
 * its uid's connections_per_uid, over max_connections, or into the reserve, is refused at
 * once (refuse_at_accept) and never counted: it holds no slot of the limits another uid
 * needs. */
static void admit(struct service *s, int fd)
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
    struct ucount *u = ucount_of(s, cred.uid);
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
    if (!in) conn_drop(s, k, false);
}

/* ---- the service --------------------------------------------------------------------- */

/* Open files the limits may need at once: a connection's socket and its session's pin table
 * (a session has a connection at least), a job's (its arenas, its swap files, its ring),
 * and the daemon's own (the listener, epoll, stdio, the log). */
#define FILES_PER_CONNECTION 2
#define FILES_PER_JOB 16
#define FILES_OWN 64

/* The soft RLIMIT_NOFILE raised to what zinf.serve's limits need, up to the hard limit; a
 * hard limit below that refuses the config (-EMFILE, err naming both): past it, accept()
 * would fail with the daemon's connections still under max_connections. */
static int files_enough(const struct config_serve *lim, char *err, size_t errlen)
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
    int fr = files_enough(&o->config->zinf.serve, err, errlen);
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

struct closing {
    struct service *s;
    struct job *j;
};

/* Closes an idle job (flushed, its memory given back): a HELLO for it meanwhile waits, and
 * then opens it anew, resuming what was flushed. */
static void *job_closer(void *arg)
{
    struct closing *c = arg;
    struct service *s = c->s;
    struct job *j = c->j;
    free(c);
    char why[64];
    snprintf(why, sizeof(why), "no client for %u s", s->lim->idle_job_close);
    int r = job_shut(j, why, false);
    if (r < 0)
        job_kept(s, j, r);
    else
        job_gone(s, j);
    return NULL;
}

/* The refusals each uid had that were not logged, said in a line once its bucket gives
 * one: a flood that stopped is still told (a few uids a second at most). */
static void refusals_said_late(struct service *s)
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
        conn_drop(s, k, true);
    }
    refusals_said_late(s);
    if (!s->lim->idle_job_close) return;
    uint64_t idle_ns = (uint64_t)s->lim->idle_job_close * 1000000000ull;
    pthread_mutex_lock(&s->lock);
    for (struct job *j = s->jobs; j; j = j->next) {
        if (j->opening || j->closing || j->sessions || now - j->idle_since < idle_ns ||
            now < j->retry_at)
            continue;
        struct closing *c = malloc(sizeof(*c));
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (c) *c = (struct closing){s, j};
        j->closing = true;
        s->closers++;
        if (!c || pthread_create(&t, &a, job_closer, c) != 0) { /* next time */
            free(c);
            j->closing = false;
            s->closers--;
        }
        pthread_attr_destroy(&a);
    }
    pthread_mutex_unlock(&s->lock);
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
                    admit(s, fd);
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

/* Flushes every open job, at the daemon's stop, before anything of it is torn down: its
 * sessions are still attached and its socket still there (a `zinf serve --stop` waits for
 * the end of its connection, then of the process). Openings and closings are waited for
 * first (stopping refuses new ones), so the list holds still without s->lock. */
static void flush_all(struct service *s)
{
    pthread_mutex_lock(&s->lock);
    for (;;) {
        bool opening = false;
        for (struct job *j = s->jobs; j; j = j->next)
            opening |= j->opening;
        if (!opening && !s->closers) break;
        pthread_cond_wait(&s->job_cv, &s->lock);
    }
    pthread_mutex_unlock(&s->lock);
    for (struct job *j = s->jobs; j; j = j->next) {
        int r = engine_api_flush(j->e);
        if (r < 0) log_error("serve: job %s: its flush at stop failed: %s", j->name, zinf_strerror(r));
    }
}

void service_close(struct service *s)
{
    if (!s) return;
    pthread_mutex_lock(&s->lock);
    s->stopping = true; /* no job opens or closes from here on */
    pthread_mutex_unlock(&s->lock);
    flush_all(s);
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
        conn_drop(s, k, !k->busy);
    }
    for (struct job *j = s->jobs, *n; j; j = n) {
        n = j->next;
        job_shut(j, "the daemon stops", true); /* flushed above: what the sessions left */
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
