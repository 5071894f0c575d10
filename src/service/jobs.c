/*
 * jobs.c - the lives of the daemon's jobs (struct job, its states drawn at the top of
 * server.c): a job opened when a HELLO first asks for it (its folders, then its engine,
 * resuming what it saved; counted against max_jobs, jobs_per_uid and saved_jobs_per_uid),
 * closed when idle too long or when asked (JOB_CLOSE, JOB_REMOVE: flushed, its memory given
 * back, its folders removed), kept open where its flush failed, and flushed all at the
 * daemon's stop.
 *
 * Not here: the sessions that attach to a job (session.c), what STATUS says of jobs, open
 * or saved (status.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "engine/engine.h"
#include "service/folders.h"
#include "service/server_int.h"

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
static int job_open(struct service *s, struct job *j, uid_t uid, bool ro, uid_t *owner,
                    bool *shared, char *why, size_t whylen)
{
    uid_t was;
    char path[4200];
    int so = saved_owner(s, j->name, &was);
    /* A read-only session is for a base that exists: it never makes a job. */
    if (ro && so == -ENOENT) {
        snprintf(why, whylen, "zinf serve: job %.64s refused: there is no such job to attach "
                 "to read-only", j->name);
        return -ENOENT;
    }
    if (so == 0)
        snprintf(path, sizeof(path), "%s/%s", s->config->nvme_paths.path[0], j->name);
    int sh = so == 0 ? folders_read_shared(path) : 0;
    if (uid != 0 && so == 0 && was != uid && !(ro && sh > 0)) {
        snprintf(why, whylen, "zinf serve: job %.64s refused: it is uid %u's%s", j->name,
                 (unsigned)was, ro ? ", not shared (its owner shares it: zinf job share)" : "");
        return -EACCES;
    }
    *shared = sh > 0;
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
int serve_job_shut(struct job *j, const char *why, bool force)
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

/* The job of that name, opened (its saved state resumed) when first asked for. s->lock
 * held; it is let go while the job opens (no file IO under it), and a HELLO for a job
 * another is opening or closing waits for that. A new job counts against zinf.serve's
 * jobs_per_uid and max_jobs (-EUSERS, why says which; the caller logs it). */
int serve_job_get(struct service *s, const char *name, uid_t uid, bool ro, struct job **out,
                  char *why, size_t whylen)
{
    struct job *j;
    for (;;) {
        for (j = s->jobs; j; j = j->next)
            if (!strcmp(j->name, name)) break;
        if (!j || (!j->opening && !j->closing)) break;
        pthread_cond_wait(&s->job_cv, &s->lock);
    }
    if (!j && ro && !s->config->nvme_paths.count) {
        snprintf(why, whylen, "zinf serve: job %.64s refused: it is not open, and a read-only "
                 "session never makes a job", name);
        return -ENOENT;
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
        bool shared = false;
        int r = job_open(s, j, uid, ro, &owner, &shared, why, whylen);
        pthread_mutex_lock(&s->lock);
        pthread_cond_broadcast(&s->job_cv);
        if (r < 0) {
            job_unlink(s, j);
            free(j);
            return r;
        }
        j->opening = false;
        j->owner = owner;
        j->shared = shared;
        j->idle_since = now_ns();
    }
    if (uid != j->owner && uid != 0 && !(ro && j->shared)) {
        snprintf(why, whylen, "zinf serve: job %.64s refused: it is uid %u's%s", name,
                 (unsigned)j->owner,
                 ro ? ", not shared (its owner shares it: zinf job share)" : "");
        return -EACCES;
    }
    *out = j;
    return 0;
}

/* JOB_SHARE (proto.h): the job's owner or root grants (or takes back) read-only sessions
 * to every uid, kept in the job's first folder; a job in memory only (no swap directory)
 * must be open, and keeps the grant while it is. A session already attached keeps what it
 * was given. */
static int job_share(struct conn *k, const struct proto_request *q)
{
    struct service *s = k->svc;
    bool on = q->flags != 0;
    struct job *j;
    int r = 0;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        for (j = s->jobs; j; j = j->next)
            if (!strcmp(j->name, q->name)) break;
        if (!j || (!j->opening && !j->closing)) break;
        pthread_cond_wait(&s->job_cv, &s->lock);
    }
    if (j && k->uid != j->owner && k->uid != 0) r = -EACCES;
    else if (!j && !s->config->nvme_paths.count) r = -ENOENT;
    /* The file first, then the flag: a grant said done outlives a restart. The lock is held
     * across the file's few calls so that two requests end in the order they took it. */
    if (r == 0 && s->config->nvme_paths.count) {
        char path[4200];
        uid_t owner = 0;
        snprintf(path, sizeof(path), "%s/%s", s->config->nvme_paths.path[0], q->name);
        int o = j ? 0 : folders_read_owner(path, &owner);
        if (o == -ENOENT && !j) {
            owner = geteuid();
            if (access(path, F_OK) != 0) r = -ENOENT;
        } else if (o < 0) {
            r = o == -ENOTDIR || o == -ELOOP ? -EACCES : o;
        }
        if (r == 0 && !j && k->uid != owner && k->uid != 0) r = -EACCES;
        if (r == 0) r = folders_set_shared(path, on);
    }
    if (r == 0 && j) j->shared = on;
    pthread_mutex_unlock(&s->lock);
    if (r == 0)
        log_notice("serve: job %s %s read-only (asked by uid %u)", q->name,
                   on ? "shared" : "no longer shared", (unsigned)k->uid);
    return r;
}

/* JOB_CLOSE, JOB_REMOVE and SHUTDOWN (proto.h): the job closed (and its folders removed)
 * for its owner or root; the daemon stopped (by the caller, after the reply) for root or
 * the daemon's uid. A HELLO for the job meanwhile waits, and then opens it anew. */
int serve_manage(struct conn *k, const struct proto_request *q)
{
    struct service *s = k->svc;
    if (q->op == PROTO_SHUTDOWN) return serve_privileged(k->uid) ? 0 : -EPERM;
    if (!serve_job_name_ok(q->name)) return -EINVAL;
    if (q->op == PROTO_JOB_SHARE) return job_share(k, q);
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
        if ((r = serve_job_shut(j, why, rm)) < 0 && !rm) {
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
    int r = serve_job_shut(j, why, false);
    if (r < 0)
        job_kept(s, j, r);
    else
        job_gone(s, j);
    return NULL;
}

/* Jobs without a session for zinf.serve.idle_job_close seconds (now: the sweep's now_ns())
 * are closed, a thread each (job_closer); one whose close failed waits for its retry_at. */
void serve_close_idle_jobs(struct service *s, uint64_t now)
{
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

/* Flushes every open job, at the daemon's stop, before anything of it is torn down: its
 * sessions are still attached and its socket still there (a `zinf serve --stop` waits for
 * the end of its connection, then of the process). Openings and closings are waited for
 * first (stopping refuses new ones), so the list holds still without s->lock. */
void serve_flush_all(struct service *s)
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
