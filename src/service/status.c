/*
 * status.c - STATUS for the daemon of server.c: the jobs a uid may see, open ones with
 * their live stats and saved ones with the tensors their manifest names, in pages in the
 * order of their names; and the count of a uid's job folders, for
 * zinf.serve.saved_jobs_per_uid.
 *
 * A saved job's summary (its owner, its tensors) is read once and kept until its folder
 * changes (a new manifest is renamed into it, which changes the folder's mtime): STATUS
 * read and parsed every saved job's whole manifest, and 24 calls at once on a job of
 * 16,000 tensors took 800 MiB. One scan of the swap directory runs at a time
 * (s->status_lock), so a changed manifest is parsed once, not once per caller. A page
 * holds at most STATUS_PAGE jobs: the whole list of a node with thousands of saved jobs
 * overflowed one message, and the connection was closed without a reply.
 *
 * Not here: the jobs' lives (jobs.c).
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "service/folders.h"
#include "service/server_int.h"

/* Jobs in one STATUS reply: ~500 bytes each, well under PROTO_MAX_PAYLOAD. */
#define STATUS_PAGE 256
#define SUM_CHAINS 4096

/* One job folder under the first swap directory, as last read. */
struct saved_sum {
    char name[PROTO_MAX_JOB + 1];
    dev_t dev;
    ino_t ino;
    struct timespec mtime; /* the folder's when read: a new manifest changes it */
    uid_t owner;
    bool saved;     /* its manifest could be probed */
    size_t tensors; /* ... and names this many (SIZE_MAX: unknown) */
    uint64_t gen;   /* the scan that last saw it */
    struct saved_sum *next;
};

void status_init(struct service *s)
{
    pthread_mutex_init(&s->status_lock, NULL);
}

void status_fini(struct service *s)
{
    for (size_t i = 0; s->sums && i <= s->sums_mask; i++)
        for (struct saved_sum *m = s->sums[i], *n; m; m = n) {
            n = m->next;
            free(m);
        }
    free(s->sums);
    s->sums = NULL;
    pthread_mutex_destroy(&s->status_lock);
}

static size_t chain_of(const char *name)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (const char *p = name; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ull;
    return (size_t)(h & (SUM_CHAINS - 1));
}

/* The summary of folder name (st: its lstat), read again where it changed; NULL when it
 * cannot be had (out of memory, or its owner cannot be read). s->status_lock held. */
static struct saved_sum *sum_of(struct service *s, const char *root, const char *name,
                                const struct stat *st)
{
    if (!s->sums) {
        if (!(s->sums = calloc(SUM_CHAINS, sizeof(*s->sums)))) return NULL;
        s->sums_mask = SUM_CHAINS - 1;
    }
    struct saved_sum **pp = &s->sums[chain_of(name)], *m;
    for (m = *pp; m && strcmp(m->name, name); m = m->next)
        ;
    if (m && m->dev == st->st_dev && m->ino == st->st_ino &&
        m->mtime.tv_sec == st->st_mtim.tv_sec && m->mtime.tv_nsec == st->st_mtim.tv_nsec)
        return m;
    if (!m) {
        if (!(m = calloc(1, sizeof(*m)))) return NULL;
        snprintf(m->name, sizeof(m->name), "%.*s", PROTO_MAX_JOB, name);
        m->next = *pp;
        *pp = m;
        s->nsums++;
    }
    char path[4096];
    uid_t owner;
    snprintf(path, sizeof(path), "%s/%s", root, name);
    int ro = folders_read_owner(path, &owner);
    if (ro == -ENOENT) owner = geteuid(); /* a folder without one: the daemon's user's */
    m->dev = st->st_dev;
    m->ino = st->st_ino;
    m->mtime = st->st_mtim;
    m->owner = owner;
    m->saved = ro != -ENOENT && ro < 0 ? false : persist_probe(path, &m->tensors, NULL) == 0;
    if (ro < 0 && ro != -ENOENT) {
        m->mtime.tv_nsec = -1; /* read again next time */
        return NULL;
    }
    return m;
}

/* Calls fn for each job folder under the first swap directory, with its summary; the
 * summaries of folders gone are dropped. Takes s->status_lock (file IO, without s->lock). */
static void scan(struct service *s, void (*fn)(void *, const struct saved_sum *), void *arg)
{
    if (!s->config->nvme_paths.count) return;
    const char *root = s->config->nvme_paths.path[0];
    pthread_mutex_lock(&s->status_lock);
    DIR *d = opendir(root);
    if (!d) {
        pthread_mutex_unlock(&s->status_lock);
        return;
    }
    uint64_t gen = ++s->sums_gen;
    struct dirent *de;
    while ((de = readdir(d))) {
        char path[4096];
        struct stat st;
        if (!serve_job_name_ok(de->d_name) ||
            snprintf(path, sizeof(path), "%s/%s", root, de->d_name) >= (int)sizeof(path) ||
            lstat(path, &st) != 0 || !folders_own(&st, 077))
            continue;
        struct saved_sum *m = sum_of(s, root, de->d_name, &st);
        if (!m) continue;
        m->gen = gen;
        fn(arg, m);
    }
    closedir(d);
    for (size_t i = 0; s->sums && i <= s->sums_mask; i++)
        for (struct saved_sum **pp = &s->sums[i]; *pp;) {
            struct saved_sum *m = *pp;
            if (m->gen == gen) {
                pp = &m->next;
                continue;
            }
            *pp = m->next;
            s->nsums--;
            free(m);
        }
    pthread_mutex_unlock(&s->status_lock);
}

struct counting {
    uid_t uid;
    unsigned n;
};

static void count_one(void *arg, const struct saved_sum *m)
{
    struct counting *c = arg;
    c->n += m->owner == c->uid;
}

unsigned status_saved_count(struct service *s, uid_t uid)
{
    struct counting c = {uid, 0};
    scan(s, count_one, &c);
    return c.n;
}

/* A job of a STATUS reply. */
struct entry {
    char name[PROTO_MAX_JOB + 1];
    uint32_t owner, open, sessions;
    uint64_t pins;
    struct zinf_stats st;
};

struct listing {
    uid_t uid;
    const char *after;
    char (*names)[PROTO_MAX_JOB + 1]; /* the jobs the daemon has: not listed as saved */
    size_t nnames;
    struct entry *e;
    size_t n, cap;
    bool nomem;
};

static struct entry *entry_new(struct listing *l)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        struct entry *e = realloc(l->e, cap * sizeof(*e));
        if (!e) {
            l->nomem = true;
            return NULL;
        }
        l->e = e;
        l->cap = cap;
    }
    struct entry *e = &l->e[l->n++];
    memset(e, 0, sizeof(*e));
    return e;
}

static void list_saved(void *arg, const struct saved_sum *m)
{
    struct listing *l = arg;
    if (!m->saved || (l->uid != m->owner && l->uid != 0) || strcmp(m->name, l->after) <= 0)
        return;
    for (size_t i = 0; i < l->nnames; i++)
        if (!strcmp(l->names[i], m->name)) return;
    struct entry *e = entry_new(l);
    if (!e) return;
    strcpy(e->name, m->name);
    e->owner = (uint32_t)m->owner;
    e->st.tensors = m->tensors == SIZE_MAX ? 0 : m->tensors;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const struct entry *)a)->name, ((const struct entry *)b)->name);
}

int status_reply(struct conn *k, const struct proto_request *q, uint32_t seq)
{
    struct service *s = k->svc;
    struct listing l = {.uid = k->uid, .after = q->name}; /* the peer's uid, at accept */
    /* Lock order: the service, then a session, then (in engine_api_stats) the engine. */
    pthread_mutex_lock(&s->lock);
    for (struct job *j = s->jobs; j; j = j->next)
        l.nnames++;
    l.names = calloc(l.nnames ? l.nnames : 1, sizeof(*l.names));
    l.nnames = 0;
    for (struct job *j = s->jobs; j && l.names; j = j->next)
        strcpy(l.names[l.nnames++], j->name);
    for (struct job *j = s->jobs; j; j = j->next) {
        if (j->opening || j->closing || (l.uid != j->owner && l.uid != 0) ||
            strcmp(j->name, l.after) <= 0)
            continue;
        struct entry *e = entry_new(&l);
        if (!e) break;
        for (struct session *se = s->sessions; se; se = se->next) {
            if (se->job != j) continue;
            e->sessions++;
            pthread_mutex_lock(&se->lock);
            for (struct pin *p = se->pins; p; p = p->next)
                e->pins += p->count;
            pthread_mutex_unlock(&se->lock);
            if (se->ps) e->pins += engine_pinset_pins(j->e, se->ps);
        }
        engine_api_stats(j->e, &e->st);
        strcpy(e->name, j->name);
        e->owner = (uint32_t)j->owner;
        e->open = 1;
    }
    pthread_mutex_unlock(&s->lock);
    if (l.names) scan(s, list_saved, &l);
    free(l.names);
    if (l.n) qsort(l.e, l.n, sizeof(*l.e), by_name); /* l.e is NULL where nothing was listed */
    uint32_t n = (uint32_t)MIN(l.n, (size_t)STATUS_PAGE);

    struct proto_out o;
    proto_out_init(&o, PROTO_STATUS | PROTO_REPLY, seq);
    proto_put_i32(&o, l.nomem || !l.names ? -ENOMEM : 0);
    if (!l.nomem && l.names) {
        proto_put_u32(&o, n);
        for (uint32_t i = 0; i < n; i++) {
            const struct entry *e = &l.e[i];
            proto_put_str(&o, e->name);
            proto_put_u32(&o, e->owner);
            proto_put_u32(&o, e->open);
            proto_put_u32(&o, e->sessions);
            proto_put_u64(&o, e->pins);
            proto_put_u32(&o, sizeof(e->st));
            proto_put_bytes(&o, &e->st, sizeof(e->st));
        }
        proto_put_u32(&o, l.n > n); /* more: ask again after the last name */
    }
    free(l.e);
    int r = proto_send(k->fd, &o, NULL, 0);
    proto_out_free(&o);
    return r;
}
