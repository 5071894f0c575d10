/*
 * requests.c - a session's calls once its HELLO is answered (serve_request): each request
 * made on its job's engine (engine_api_*, thread-safe) and answered with what it returns,
 * with the session's own account of what it holds (its pins, its tickets not waited for,
 * its stages; struct session) and the limits a call meets (tickets_per_session,
 * stages_per_session, write_stage_bytes, swap_bytes_per_uid).
 *
 * The pins a session holds are counted here per (tensor, tier), since the engine counts
 * pins of all sessions together: a release first takes one off the session's count (so
 * two connections of one session cannot both spend the same pin), and puts it back when
 * the engine refuses the release.
 *
 * Not here: HELLO and a session's end (session.c), the messages' framing (proto.c), the
 * connection that carries them (server.c).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common.h"
#include "engine/engine.h"
#include "service/proto.h"
#include "service/server_int.h"

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

void serve_stage_free(struct stage *g)
{
    if (g->buf && g->bytes >= STAGE_MAPPED_BYTES)
        munmap(g->buf, (size_t)g->bytes);
    else
        free(g->buf);
    free(g);
}

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
        serve_refusal(se->svc, se->uid, why);
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
        serve_refusal(se->svc, se->uid, why);
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
        serve_stage_free(g);
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
    serve_stage_free(g);
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
        if ((u = serve_ucount_of(s, se->uid))) used += u->swap_pending;
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
            serve_refusal(s, se->uid, why);
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

/* Whether request q would change what job j holds (or when it is durable): a read-only
 * session's is refused. A fetch, a clean release, a prefetch and a step change no byte. */
static bool writes(const struct proto_request *q)
{
    switch (q->op) {
    case PROTO_REGISTER:
    case PROTO_UNREGISTER:
    case PROTO_ZERO:
    case PROTO_WRITE:
    case PROTO_STAGE_WRITE:
    case PROTO_FLUSH:
        return true;
    case PROTO_RELEASE:
        return q->flags != 0;
    default:
        return false;
    }
}

int serve_request(struct session *se, const struct proto_request *q, struct proto_out *o)
{
    zinf_engine *e = se->job->e;
    zinf_tensor t;
    int r;

    if (se->readonly && writes(q)) {
        static const char *const what[] = {
            [PROTO_REGISTER] = "REGISTER", [PROTO_UNREGISTER] = "UNREGISTER",
            [PROTO_ZERO] = "ZERO",         [PROTO_WRITE] = "WRITE",
            [PROTO_STAGE_WRITE] = "WRITE", [PROTO_FLUSH] = "FLUSH",
            [PROTO_RELEASE] = "dirty RELEASE"};
        char why[200];
        snprintf(why, sizeof(why), "job %s: %s refused (-EROFS): the session is read-only, "
                 "the job its owner's to change", se->job->name, what[q->op]);
        serve_refusal(se->svc, se->uid, why);
        return -EROFS;
    }

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
