/*
 * trace.c - the Chrome trace-event writer (trace.h): per-thread rings, one writer thread.
 *
 * A ring belongs to the thread that pushes into it (head) and to the writer, which drains it
 * (tail). Rings live in a registry (a list under reg_lock, taken by a thread's first event
 * and by the writer). A ring outlives its session: a thread that pushed in one trace pushes
 * into the same ring in the next, and trace_start() discards what an old session left. A
 * ring is freed only after its thread has exited (the key's destructor marks it) and it is
 * drained, so no push can land in freed memory.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "trace.h"

#define RING_EVENTS 8192  /* per thread: about 1 MiB */
#define DRAIN_EVERY_MS 20 /* the writer's period */
#define NAME_CHARS 32

atomic_bool trace_on_;

enum ph { PH_SPAN = 'X', PH_ASYNC = 'b', PH_COUNTER = 'C', PH_INSTANT = 'i' };

struct ev {
    uint64_t ts, dur, id; /* ns since the epoch of now_ns(); id: async spans */
    int64_t num;          /* bytes (< 0: none), a counter's value, or the label's number */
    const char *cat, *name, *detail;
    int who;               /* counters: the engine, -1 none; spans: 1 when num labels the name */
    uint8_t ph;
    char tensor[TRACE_TENSOR_CHARS];
};

struct ring {
    _Atomic uint64_t head; /* written by the owner */
    _Atomic uint64_t tail; /* written by the writer */
    _Atomic uint64_t dropped;
    _Atomic bool dead; /* the owner exited: nothing more is pushed */
    int tid;
    char name[NAME_CHARS];
    unsigned named_session; /* the session whose file has this ring's thread name */
    struct ring *next;
    struct ev ev[RING_EVENTS];
};

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static struct ring *rings;
static pthread_key_t ring_key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static __thread struct ring *my_ring;
static __thread char my_name[NAME_CHARS]; /* trace_thread_name(), kept without a ring */

/* The session: the file and the writer. start/stop are serialised by ctl_lock. */
static pthread_mutex_t ctl_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t wr_lock = PTHREAD_MUTEX_INITIALIZER; /* stop flag, wakeups */
static pthread_cond_t wr_cv = PTHREAD_COND_INITIALIZER;
static bool wr_stop;
static pthread_t writer;
static FILE *out;
static char *out_path;
static int out_err; /* the first write error, -errno */
static uint64_t epoch_ns;
static unsigned session;
static bool first_event;
static uint64_t dropped_total;

static void ring_gone(void *p)
{
    atomic_store(&((struct ring *)p)->dead, true);
}

static void make_key(void)
{
    pthread_key_create(&ring_key, ring_gone);
}

static struct ring *ring_get(void)
{
    struct ring *r = my_ring;
    if (__builtin_expect(r != NULL, 1)) return r;
    pthread_once(&key_once, make_key);
    if (!(r = calloc(1, sizeof(*r)))) return NULL;
    r->tid = (int)syscall(SYS_gettid);
    if (my_name[0])
        snprintf(r->name, sizeof(r->name), "%s", my_name);
    else
        snprintf(r->name, sizeof(r->name), "thread %d", r->tid);
    pthread_mutex_lock(&reg_lock);
    r->next = rings;
    rings = r;
    pthread_mutex_unlock(&reg_lock);
    pthread_setspecific(ring_key, r);
    my_ring = r;
    return r;
}

void trace_thread_name(const char *name)
{
    if (my_name[0]) return; /* the first name sticks */
    snprintf(my_name, sizeof(my_name), "%s", name);
    struct ring *r = my_ring; /* a ring is made by the first event only */
    if (!r) return;
    pthread_mutex_lock(&reg_lock); /* the writer may be printing the old one */
    snprintf(r->name, sizeof(r->name), "%s", name);
    pthread_mutex_unlock(&reg_lock);
}

static void push(const struct ev *e)
{
    struct ring *r = ring_get();
    if (!r) return;
    uint64_t h = atomic_load_explicit(&r->head, memory_order_relaxed);
    if (h - atomic_load_explicit(&r->tail, memory_order_acquire) >= RING_EVENTS) {
        atomic_fetch_add_explicit(&r->dropped, 1, memory_order_relaxed);
        return;
    }
    r->ev[h % RING_EVENTS] = *e;
    atomic_store_explicit(&r->head, h + 1, memory_order_release);
}

static void set_tensor(struct ev *e, const char *tensor)
{
    if (tensor) snprintf(e->tensor, sizeof(e->tensor), "%s", tensor);
}

void trace_span(const char *cat, const char *name, uint64_t t0, const char *tensor,
                const char *detail, int64_t bytes)
{
    if (!trace_on()) return;
    uint64_t t1 = now_ns();
    struct ev e = {.ts = t0, .dur = t1 - t0, .num = bytes, .cat = cat, .name = name,
                   .detail = detail, .who = -1, .ph = PH_SPAN};
    set_tensor(&e, tensor);
    push(&e);
}

void trace_span_n(const char *cat, const char *name, int n, uint64_t t0)
{
    if (!trace_on()) return;
    uint64_t t1 = now_ns();
    struct ev e = {.ts = t0, .dur = t1 - t0, .num = n, .cat = cat, .name = name, .who = 1,
                   .ph = PH_SPAN};
    push(&e);
}

void trace_async(const char *cat, const char *name, uint64_t id, uint64_t t0, const char *tensor,
                 const char *detail, int64_t bytes)
{
    if (!trace_on()) return;
    uint64_t t1 = now_ns();
    struct ev e = {.ts = t0, .dur = t1 > t0 ? t1 - t0 : 0, .id = id, .num = bytes, .cat = cat,
                   .name = name, .detail = detail, .who = -1, .ph = PH_ASYNC};
    set_tensor(&e, tensor);
    push(&e);
}

void trace_counter(const char *name, int who, int64_t value)
{
    if (!trace_on()) return;
    struct ev e = {.ts = now_ns(), .num = value, .cat = "counter", .name = name, .who = who,
                   .ph = PH_COUNTER};
    push(&e);
}

void trace_instant(const char *cat, const char *name, const char *tensor, const char *detail,
                   int64_t bytes)
{
    if (!trace_on()) return;
    struct ev e = {.ts = now_ns(), .num = bytes, .cat = cat, .name = name, .detail = detail,
                   .who = -1, .ph = PH_INSTANT};
    set_tensor(&e, tensor);
    push(&e);
}

/* ---- the writer ---------------------------------------------------------------------- */

static double us(uint64_t ns)
{
    return (double)(ns - epoch_ns) / 1e3;
}

static void sep(void)
{
    if (!first_event) fputs(",\n", out);
    first_event = false;
}

/* args: the tensor, the detail and the bytes that are set. */
static void write_args(const struct ev *e)
{
    bool any = false;
    fputs(",\"args\":{", out);
    if (e->tensor[0]) {
        fputs("\"tensor\":", out);
        json_print_string(out, e->tensor);
        any = true;
    }
    if (e->detail) {
        fprintf(out, "%s\"detail\":", any ? "," : "");
        json_print_string(out, e->detail);
        any = true;
    }
    if (e->num >= 0 && e->who != 1) fprintf(out, "%s\"bytes\":%" PRId64, any ? "," : "", e->num);
    fputc('}', out);
}

static void write_name(const struct ev *e)
{
    fputs("\"name\":\"", out);
    fputs(e->name, out); /* static names, written without characters to escape */
    if (e->ph == PH_SPAN && e->who == 1) fprintf(out, " %" PRId64, e->num);
    if (e->ph == PH_COUNTER && e->who >= 0) fprintf(out, " (engine %d)", e->who);
    fputc('"', out);
}

static void write_event(const struct ring *r, const struct ev *e)
{
    int pid = (int)getpid();
    if (e->ts < epoch_ns) return; /* pushed before this trace started */
    sep();
    switch (e->ph) {
    case PH_SPAN:
        fprintf(out, "{\"ph\":\"X\",\"cat\":\"%s\",", e->cat);
        write_name(e);
        fprintf(out, ",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f", pid, r->tid, us(e->ts),
                (double)e->dur / 1e3);
        write_args(e);
        fputc('}', out);
        break;
    case PH_ASYNC: /* begin and end, both from here: the end is known already */
        fprintf(out, "{\"ph\":\"b\",\"cat\":\"%s\",", e->cat);
        write_name(e);
        fprintf(out, ",\"id\":\"0x%" PRIx64 "\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f", e->id, pid,
                r->tid, us(e->ts));
        write_args(e);
        fprintf(out, "},\n{\"ph\":\"e\",\"cat\":\"%s\",", e->cat);
        write_name(e);
        fprintf(out, ",\"id\":\"0x%" PRIx64 "\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f}", e->id, pid,
                r->tid, us(e->ts + e->dur));
        break;
    case PH_COUNTER:
        fputs("{\"ph\":\"C\",", out);
        write_name(e);
        fprintf(out, ",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"args\":{\"value\":%" PRId64 "}}", pid,
                r->tid, us(e->ts), e->num);
        break;
    default:
        fprintf(out, "{\"ph\":\"i\",\"s\":\"t\",\"cat\":\"%s\",", e->cat);
        write_name(e);
        fprintf(out, ",\"pid\":%d,\"tid\":%d,\"ts\":%.3f", pid, r->tid, us(e->ts));
        write_args(e);
        fputc('}', out);
        break;
    }
}

/* Everything the rings hold now; rings of exited threads, once empty, are freed. Holds
 * reg_lock (a thread's first event waits meanwhile; pushes do not). */
static void drain(void)
{
    pthread_mutex_lock(&reg_lock);
    for (struct ring **pp = &rings; *pp;) {
        struct ring *r = *pp;
        bool dead = atomic_load(&r->dead); /* before the last look at head */
        uint64_t t = atomic_load_explicit(&r->tail, memory_order_relaxed),
                 h = atomic_load_explicit(&r->head, memory_order_acquire);
        if (h != t && r->named_session != session) {
            sep();
            fprintf(out, "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,"
                         "\"args\":{\"name\":",
                    (int)getpid(), r->tid);
            json_print_string(out, r->name);
            fputs("}}", out);
            r->named_session = session;
        }
        for (; t != h; t++)
            write_event(r, &r->ev[t % RING_EVENTS]);
        atomic_store_explicit(&r->tail, h, memory_order_release);
        if (dead) {
            dropped_total += atomic_load(&r->dropped);
            *pp = r->next;
            free(r);
        } else {
            pp = &r->next;
        }
    }
    pthread_mutex_unlock(&reg_lock);
    if (ferror(out) && !out_err) out_err = -EIO;
}

static void *writer_main(void *arg)
{
    (void)arg;
    trace_thread_name("trace writer");
    pthread_mutex_lock(&wr_lock);
    while (!wr_stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += DRAIN_EVERY_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&wr_cv, &wr_lock, &ts);
        pthread_mutex_unlock(&wr_lock);
        drain();
        fflush(out);
        pthread_mutex_lock(&wr_lock);
    }
    pthread_mutex_unlock(&wr_lock);
    return NULL;
}

int trace_start(const char *path)
{
    pthread_mutex_lock(&ctl_lock);
    if (out) {
        pthread_mutex_unlock(&ctl_lock);
        return -EALREADY;
    }
    FILE *f = fopen(path, "w");
    if (!f) {
        int r = -errno;
        log_error("trace: cannot write %s: %s", path, strerror(errno));
        pthread_mutex_unlock(&ctl_lock);
        return r;
    }
    /* What an earlier session's stragglers left in the rings is not this trace's. */
    pthread_mutex_lock(&reg_lock);
    for (struct ring *r = rings; r; r = r->next) {
        atomic_store(&r->tail, atomic_load(&r->head));
        atomic_store(&r->dropped, 0);
    }
    pthread_mutex_unlock(&reg_lock);
    out = f;
    out_path = strdup(path);
    out_err = 0;
    dropped_total = 0;
    first_event = true;
    session++;
    epoch_ns = now_ns();
    fputs("[\n", out);
    sep();
    fprintf(out, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"args\":{\"name\":"
                 "\"zinf\"}}",
            (int)getpid());
    wr_stop = false;
    int r = -pthread_create(&writer, NULL, writer_main, NULL);
    if (r == 0) pthread_setname_np(writer, "zinf-trace");
    if (r) {
        fclose(out);
        out = NULL;
        free(out_path);
        out_path = NULL;
        pthread_mutex_unlock(&ctl_lock);
        return r;
    }
    atomic_store(&trace_on_, true);
    pthread_mutex_unlock(&ctl_lock);
    return 0;
}

uint64_t trace_dropped(void)
{
    uint64_t n = dropped_total;
    pthread_mutex_lock(&reg_lock);
    for (struct ring *r = rings; r; r = r->next)
        n += atomic_load(&r->dropped);
    pthread_mutex_unlock(&reg_lock);
    return n;
}

int trace_stop(void)
{
    pthread_mutex_lock(&ctl_lock);
    if (!out) {
        pthread_mutex_unlock(&ctl_lock);
        return 0;
    }
    atomic_store(&trace_on_, false);
    pthread_mutex_lock(&wr_lock);
    wr_stop = true;
    pthread_cond_signal(&wr_cv);
    pthread_mutex_unlock(&wr_lock);
    pthread_join(writer, NULL);
    drain();
    uint64_t dropped = trace_dropped();
    sep();
    fprintf(out, "{\"ph\":\"M\",\"name\":\"zinf_dropped_events\",\"pid\":%d,\"args\":{"
                 "\"dropped\":%" PRIu64 "}}\n]\n",
            (int)getpid(), dropped);
    if (dropped)
        log_warn("trace: %" PRIu64 " events were dropped (a thread's ring of %d was full)",
                 dropped, RING_EVENTS);
    int r = out_err;
    if (fflush(out) && !r) r = -errno;
    if (fclose(out) && !r) r = -errno;
    if (r) log_error("trace: writing %s failed: %s", out_path, strerror(-r));
    out = NULL;
    free(out_path);
    out_path = NULL;
    pthread_mutex_unlock(&ctl_lock);
    return r;
}

static void stop_at_exit(void)
{
    trace_stop();
}

/* A rank of a job (zinf launch sets RANK) other than 0 writes PATH.rank-R, as --trace does. */
static void env_start(void)
{
    const char *path = getenv("ZINF_TRACE"), *rank = getenv("RANK");
    if (!path || !path[0]) return;
    char buf[4096];
    if (rank && atoi(rank) > 0) {
        snprintf(buf, sizeof(buf), "%s.rank-%d", path, atoi(rank));
        path = buf;
    }
    if (trace_start(path) == 0) atexit(stop_at_exit);
}

void trace_from_env(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, env_start);
}
