/*
 * soak_serve.c - the daemon (`zinf serve`, a child process) under a long mixed load from two
 * users at once and a hostile client of one of them, with every byte the good clients read
 * checked, and the daemon's memory and descriptors measured before and after.
 *
 * Eight client processes (four as root, four as uid 65534; two per job, jobs r0 r1 n0 n1)
 * run four threads each until the deadline. Each thread owns its tensors (homed in host
 * memory and on NVMe, 4 KiB to 3 MiB, the largest split into several messages by the
 * client) and fetches them to either tier and releases them (clean, or DIRTY after writing
 * a new pattern through the pointer), writes and reads whole or part, fetches
 * asynchronously, prefetches, steps and flushes: every byte read must be what that thread
 * last wrote or released (a reference copy per tensor; the patterns come from a seed and a
 * version, so making one is cheap). Meanwhile a hostile client (uid 65534) loops over:
 * HELLO by hand and every size, seal, hole and mapping trick on the memfds it is given,
 * then calls on that session; files, links, FIFOs and folders in the swap folder and in
 * the job folders (each must fail with EACCES); as many jobs as it is let open; about 200
 * connections that never say HELLO; a child killed in the middle of a 16 MiB zinf_write.
 * What the hostile client is answered does not matter: only a daemon that dies or hangs,
 * a trick that works, or a wrong byte for a good client fails the run.
 *
 * The daemon's RSS and descriptors are sampled before any client, once everything runs
 * (after the hostile client's first round), now and then during the load (printed, so that
 * a long run shows their course) and once everything has closed: the descriptors must come
 * back to within FD_SLACK of the second sample, the RSS to within RSS_SLACK_KIB. A daemon
 * that dies fails the run at once, and so does one that leaves STATUS unanswered for 15 s
 * (taken as hung: its threads' stacks are printed where gdb is installed). SIGTERM must stop
 * it, exit status 0, within 30 s; it is started again and every good tensor must read back
 * as its thread last flushed it.
 *
 * Not here: what each call answers to bad input (test_service.c), each hostile trick on
 * its own with its exact answer (test_serve_guard.c), crashes (test_persist.c).
 *
 *   soak_serve [--seconds N] [--limits] [--atomic-write] [--keep]
 *     --seconds N     how long the load runs (default 25; e.g. --seconds 600 for a soak)
 *     --limits        give the daemon small zinf.serve limits (4 jobs and 16 sessions and 64
 *                     connections a uid, HELLO within 2 s, idle jobs closed after 3 s, 16
 *                     MiB of staged writes a session): then the connections that never
 *                     said HELLO must have been closed, and once every job has gone idle the
 *                     daemon's descriptors must be back to what it had before any client;
 *                     a good client may be refused for a while (retried and counted)
 *     --atomic-write  the write killed half-way must leave its tensor all old or all new
 *     --keep          keep the scratch folder (it is kept anyway when something failed)
 *
 * Runs as root (it acts as a second user); otherwise it says why and exits 77 (skipped).
 * ZINF_BIN names the zinf program; the scratch folder goes under ZINF_TEST_TMPDIR (default
 * /tmp), the socket in a folder of its own under /tmp. Exit status 0 when everything held;
 * 1 with what failed (the daemon's log's last lines too). meson runs 12 s with --limits
 * and --atomic-write, about 25 s in all (600 s with -Dsoak=true).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/falloc.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "raw_call.h"
#include "service/proto.h"
#include "zinf.h"

#define KiB ((size_t)1024)
#define MiB (1024 * KiB)
#define NOBODY 65534
#define CLIENTS 8            /* processes; the first half root, the second uid 65534 */
#define THREADS 4            /* a client's */
#define TENSORS 5            /* a thread's */
#define MAX_JOBS 40          /* the hostile client's job flood */
#define SILENT 200           /* its connections that never say HELLO */
#define BIG_BYTES (16 * MiB) /* the write killed half-way */
/* The daemon's descriptors after everything closed, against the sample taken while it ran:
 * the few a moment's work may hold (a connection being torn down, the sampler's own). */
#define FD_SLACK 4
/* Its RSS, likewise. Every round of the hostile client opens up to 40 jobs and 200
 * connections and stages a 16 MiB write, and the good clients stage writes of up to 3 MiB
 * from 32 threads: a leak of any of these per round would add hundreds of MiB even in the
 * default 25 s. What may legitimately stay is what the allocator keeps of freed staging
 * buffers (glibc keeps up to 8 arenas a core, and the mmap threshold rises to the largest
 * block freed) and the pages of arenas first touched after the sample: 64 MiB. */
#define RSS_SLACK_KIB (64 * 1024)
#define IDLE_JOB_CLOSE_S 3 /* --limits: as the config says */
#define HELLO_TIMEOUT_S 2
#define SILENT_GRACE_S 6 /* past hello_timeout + 2 s: a loaded machine's lag in accepting */

/* ---- options, paths, shared helpers --------------------------------------------------- */

static double opt_seconds = 25;
static bool opt_limits, opt_atomic, opt_keep;
static char dir[4096], swapdir[4200], sockdir[64], sock[108], cfg_path[4200], log_path[4200],
    own_dir[4200];
static const char *zinf_bin, *group;
static uint64_t deadline_ns;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* One line to stderr in one write, so that the processes' lines do not mix. */
static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    char buf[1024];
    int n = snprintf(buf, sizeof(buf), "soak_serve: ");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    n = m < 0 ? n : n + m;
    if (n > (int)sizeof(buf) - 2) n = (int)sizeof(buf) - 2;
    buf[n++] = '\n';
    if (write(STDERR_FILENO, buf, (size_t)n) < 0) {
        /* nowhere else to say it */
    }
}

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The bytes of a pattern: eight at a time from a counter, so a few MiB take a millisecond. */
static void pattern(unsigned char *p, size_t n, uint64_t seed)
{
    uint64_t x = mix(seed + 0x9e3779b97f4a7c15ull);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = mix(x + i);
        memcpy(p + i, &v, 8);
    }
    if (i < n) {
        uint64_t v = mix(x + i);
        memcpy(p + i, &v, n - i);
    }
}

/* The answers a client of uid 65534 may get under --limits while its own uid's hostile
 * client holds the connections, sessions or jobs the limits allow: not the daemon's fault. */
static bool refusal(int r)
{
    return opt_limits && (r == -EAGAIN || r == -EUSERS || r == -EMFILE || r == -ENFILE ||
                          r == -EDQUOT || r == -ECONNREFUSED || r == -ECONNRESET);
}

static void become_nobody(void)
{
    if (setgroups(0, NULL) != 0 || setresgid(NOBODY, NOBODY, NOBODY) != 0 ||
        setresuid(NOBODY, NOBODY, NOBODY) != 0) {
        say("cannot become uid %d: %s", NOBODY, strerror(errno));
        _exit(1);
    }
}

/* A child dies with the test: a test that is killed (meson's timeout) leaves no daemon or
 * client behind. Set after the uid changed, which clears it. */
static void die_with_parent(pid_t parent)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
}

static int write_all(int fd, const void *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p = (const char *)p + w;
        n -= (size_t)w;
    }
    return 0;
}

/* Reads exactly n bytes, waiting at most timeout_ms for each piece: 0, or -1 (EOF, error,
 * or the time ran out). */
static int read_timed(int fd, void *p, size_t n, int timeout_ms)
{
    while (n) {
        struct pollfd pf = {fd, POLLIN, 0};
        int r = poll(&pf, 1, timeout_ms);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        ssize_t got = read(fd, p, n);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        p = (char *)p + got;
        n -= (size_t)got;
    }
    return 0;
}

/* A connection to the daemon whose connect, sends and receives give up after timeout_ms. */
static int dial(int timeout_ms)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", sock);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -errno;
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        int r = -errno;
        close(fd);
        return r;
    }
    return fd;
}

/* ---- the good clients ----------------------------------------------------------------- */

struct tens {
    char name[48];
    zinf_tensor h;
    size_t n;
    enum zinf_tier home;
    unsigned char *ref; /* what the tensor holds: the thread's last write or DIRTY release */
    uint64_t version;
    bool uncertain; /* a write was refused half-way (or a check failed): rewrite it whole */
};

struct worker {
    int client, thread;
    uint64_t seed;
    struct tens t[TENSORS];
    unsigned char *buf; /* room for the largest tensor */
};

/* What a client process tells the parent, once after its load and once after checking its
 * tensors on the restarted daemon. */
struct client_report {
    uint64_t ops, failures, nomem, refused, flushes, checked_bytes, verified, unverified;
};

static zinf_engine *eng;
static int client_index;
static const char *client_job;
static _Atomic uint64_t c_ops, c_failures, c_nomem, c_refused, c_flushes, c_checked;

static const char *tier_name(enum zinf_tier t)
{
    return t == ZINF_TIER_DEVICE ? "device" : t == ZINF_TIER_HOST ? "host" : "nvme";
}

static void failed(struct worker *w, struct tens *t, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void failed(struct worker *w, struct tens *t, const char *fmt, ...)
{
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    if (atomic_fetch_add(&c_failures, 1) < 20) {
        if (t)
            say("FAILED: client %d (job %s, uid %u) thread %d: %s; tensor '%s' (%zu bytes, home "
                "%s, version %llu)",
                w->client, client_job, (unsigned)getuid(), w->thread, what, t->name, t->n,
                tier_name(t->home), (unsigned long long)t->version);
        else
            say("FAILED: client %d (job %s, uid %u) thread %d: %s", w->client, client_job,
                (unsigned)getuid(), w->thread, what);
    }
    if (t) t->uncertain = true;
}

/* got against the reference at [off, off + n). */
static void check(struct worker *w, struct tens *t, size_t off, const unsigned char *got, size_t n,
                  const char *what)
{
    atomic_fetch_add_explicit(&c_checked, n, memory_order_relaxed);
    if (memcmp(got, t->ref + off, n) == 0) return;
    size_t first = 0, bad = 0;
    while (got[first] == t->ref[off + first])
        first++;
    for (size_t i = first; i < n; i++)
        bad += got[i] != t->ref[off + i];
    failed(w, t, "%s of [%zu, +%zu): %zu bytes differ, the first at byte %zu (0x%02x, not 0x%02x)",
           what, off, n, bad, off + first, got[first], t->ref[off + first]);
}

/* A call that uid 65534's limits may refuse is tried again for up to 2 s. */
#define RETRY(expr)                                                                                \
    ({                                                                                             \
        int r_ = (expr);                                                                           \
        for (int k_ = 0; k_ < 100 && refusal(r_); k_++) {                                          \
            atomic_fetch_add(&c_refused, 1);                                                       \
            sleep_ms(20);                                                                          \
            r_ = (expr);                                                                           \
        }                                                                                          \
        r_;                                                                                        \
    })

/* The answers a call may give that are not a failure: a tier without room for the moment
 * (every thread pins up to 3 MiB of an 8 MiB tier), and a refusal that lasted. */
static bool tolerated(int r, bool room)
{
    if (room && r == -ENOMEM) {
        atomic_fetch_add(&c_nomem, 1);
        return true;
    }
    if (refusal(r)) {
        atomic_fetch_add(&c_refused, 1);
        return true;
    }
    return false;
}

static uint64_t next_seed(struct worker *w, struct tens *t)
{
    return ((uint64_t)w->client << 56) ^ ((uint64_t)w->thread << 48) ^
           ((uint64_t)(t - w->t) << 40) ^ ++t->version;
}

/* Writes [off, off + n) anew; on success the reference follows. */
static int write_range(struct worker *w, struct tens *t, size_t off, size_t n)
{
    pattern(w->buf, n, next_seed(w, t));
    int r = RETRY(zinf_write(eng, t->h, off, w->buf, n));
    if (r == 0) {
        memcpy(t->ref + off, w->buf, n);
    } else {
        /* Refused or failed after some of its messages, perhaps: unknown until rewritten. */
        t->uncertain = true;
        if (!tolerated(r, false))
            failed(w, t, "write of [%zu, +%zu): %s", off, n, zinf_strerror(r));
    }
    return r;
}

static void op_fetch(struct worker *w, struct tens *t, uint64_t *s)
{
    enum zinf_tier tier = rnd(s) & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE;
    bool dirty = rnd(s) % 2 == 0;
    void *p;
    int r = RETRY(zinf_fetch(eng, t->h, tier, &p));
    if (r != 0) {
        if (!tolerated(r, true)) failed(w, t, "fetch to %s: %s", tier_name(tier), zinf_strerror(r));
        return;
    }
    check(w, t, 0, p, t->n, tier == ZINF_TIER_HOST ? "fetch to host" : "fetch to device");
    if (dirty) {
        size_t off = rnd(s) % t->n, len = 1 + rnd(s) % (t->n - off);
        pattern(t->ref + off, len, next_seed(w, t));
        memcpy((char *)p + off, t->ref + off, len);
    }
    r = RETRY(zinf_release(eng, t->h, tier, dirty ? ZINF_RELEASE_DIRTY : 0));
    if (r != 0)
        failed(w, t, "%s release from %s: %s", dirty ? "DIRTY" : "clean", tier_name(tier),
               zinf_strerror(r));
}

static void op_async(struct worker *w, struct tens *t, uint64_t *s)
{
    enum zinf_tier tier = rnd(s) & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE;
    uint64_t ticket;
    void *p;
    int r = RETRY(zinf_fetch_async(eng, t->h, tier, &ticket));
    if (r == 0) {
        r = RETRY(zinf_wait(eng, ticket, &p));
        if (r == 0) {
            check(w, t, 0, p, t->n, "asynchronous fetch");
            if ((r = RETRY(zinf_release(eng, t->h, tier, 0))) != 0)
                failed(w, t, "release after zinf_wait: %s", zinf_strerror(r));
            return;
        }
    }
    if (!tolerated(r, true))
        failed(w, t, "asynchronous fetch to %s: %s", tier_name(tier), zinf_strerror(r));
}

static void op_write(struct worker *w, struct tens *t, uint64_t *s)
{
    if (rnd(s) % 3 == 0) {
        write_range(w, t, 0, t->n);
    } else {
        size_t off = rnd(s) % t->n, len = 1 + rnd(s) % (t->n - off);
        write_range(w, t, off, len);
    }
}

static void op_read(struct worker *w, struct tens *t, uint64_t *s)
{
    size_t off = 0, len = t->n;
    if (rnd(s) & 1) {
        off = rnd(s) % t->n;
        len = 1 + rnd(s) % (t->n - off);
    }
    int r = RETRY(zinf_read(eng, t->h, off, w->buf, len));
    if (r == 0)
        check(w, t, off, w->buf, len, "read");
    else if (!tolerated(r, false))
        failed(w, t, "read of [%zu, +%zu): %s", off, len, zinf_strerror(r));
}

static void op_call(struct worker *w, int r, const char *what)
{
    if (r != 0 && !tolerated(r, false)) failed(w, NULL, "%s: %s", what, zinf_strerror(r));
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    uint64_t s = w->seed;
    while (now_ns() < deadline_ns) {
        struct tens *t = &w->t[rnd(&s) % TENSORS];
        unsigned op = (unsigned)(rnd(&s) % 1000);
        if (t->uncertain) {
            if (write_range(w, t, 0, t->n) == 0) t->uncertain = false;
        } else if (op < 400) {
            op_fetch(w, t, &s);
        } else if (op < 500) {
            op_async(w, t, &s);
        } else if (op < 700) {
            op_write(w, t, &s);
        } else if (op < 900) {
            op_read(w, t, &s);
        } else if (op < 950) {
            enum zinf_tier tier = rnd(&s) & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE;
            op_call(w, RETRY(zinf_prefetch(eng, t->h, tier)), "prefetch");
        } else if (op < 995) {
            op_call(w, RETRY(zinf_step(eng)), "step");
        } else {
            op_call(w, RETRY(zinf_flush(eng)), "flush");
            atomic_fetch_add(&c_flushes, 1);
        }
        atomic_fetch_add_explicit(&c_ops, 1, memory_order_relaxed);
    }
    /* The end: every tensor known again, then flushed; the references are what a restarted
     * daemon must give back. */
    for (int i = 0; i < TENSORS; i++)
        for (int k = 0; k < 20 && w->t[i].uncertain; k++)
            if (write_range(w, &w->t[i], 0, w->t[i].n) == 0) w->t[i].uncertain = false;
    op_call(w, RETRY(zinf_flush(eng)), "the last flush");
    return NULL;
}

/* A thread's tensors: two homed in host memory (up to 64 KiB and 256 KiB), three on NVMe
 * (up to 512 KiB, 1 MiB, and one of 1 to 3 MiB that the client splits into messages); odd
 * sizes, so that pieces and pages do not line up. */
static void make_tensors(struct worker *w, uint64_t *s)
{
    static const size_t lo[TENSORS] = {4 * KiB, 64 * KiB, 4 * KiB, 256 * KiB, MiB + 1};
    static const size_t hi[TENSORS] = {64 * KiB, 256 * KiB, 512 * KiB, MiB, 3 * MiB};
    for (int i = 0; i < TENSORS; i++) {
        struct tens *t = &w->t[i];
        snprintf(t->name, sizeof(t->name), "c%d.w%d.t%d", w->client, w->thread, i);
        t->n = lo[i] + (size_t)(rnd(s) % (hi[i] - lo[i])) + (size_t)(rnd(s) % 7);
        t->home = i < 2 ? ZINF_TIER_HOST : ZINF_TIER_NVME;
        t->ref = calloc(1, t->n);
        if (!t->ref) {
            say("client %d: out of memory", w->client);
            _exit(1);
        }
        int r = RETRY(zinf_register(eng, t->name, t->n, t->home, &t->h));
        if (r != 0) {
            say("FAILED: client %d (job %s): register '%s' (%zu bytes, home %s): %s", w->client,
                client_job, t->name, t->n, tier_name(t->home), zinf_strerror(r));
            _exit(1);
        }
        if (write_range(w, t, 0, t->n) == 0) t->uncertain = false;
    }
}

/* After the restart: each tensor read whole by a new session, against its reference. */
static void verify(struct worker *ws, struct client_report *rep)
{
    int r = -ENOENT;
    for (int k = 0; k < 100; k++) {
        r = zinf_connect(sock, client_job, &eng);
        if (r == 0 || !(r == -ENOENT || r == -ECONNREFUSED || refusal(r))) break;
        sleep_ms(100);
    }
    if (r != 0) {
        say("FAILED: client %d: attach to job %s after the restart: %s", client_index, client_job,
            zinf_strerror(r));
        rep->failures++;
        return;
    }
    uint64_t before = atomic_load(&c_failures);
    for (int i = 0; i < THREADS; i++) {
        for (int j = 0; j < TENSORS; j++) {
            struct worker *w = &ws[i];
            struct tens *t = &w->t[j];
            if (t->uncertain) { /* never written whole again: said already */
                rep->unverified++;
                continue;
            }
            zinf_tensor h;
            if ((r = zinf_lookup(eng, t->name, &h)) == 0) {
                t->h = h;
                r = zinf_read(eng, h, 0, w->buf, t->n);
            }
            if (r != 0) {
                failed(w, t, "after the restart: %s", zinf_strerror(r));
                continue;
            }
            check(w, t, 0, w->buf, t->n, "after the restart, read");
            rep->verified++;
        }
    }
    rep->failures += atomic_load(&c_failures) - before;
    zinf_close(eng);
    eng = NULL;
}

static void client_main(int idx, int up, int down)
{
    client_index = idx;
    static const char *jobs[4] = {"r0", "r1", "n0", "n1"};
    client_job = jobs[idx / 2];
    struct worker ws[THREADS];
    uint64_t s = 0x5eed0000ull + (uint64_t)idx * 7919;
    memset(ws, 0, sizeof(ws));

    int r = -ENOENT;
    for (int k = 0; k < 100; k++) {
        r = zinf_connect(sock, client_job, &eng);
        if (r == 0 || !refusal(r)) break;
        sleep_ms(50);
    }
    if (r != 0) {
        say("FAILED: client %d: attach to job %s: %s", idx, client_job, zinf_strerror(r));
        _exit(1);
    }
    for (int i = 0; i < THREADS; i++) {
        ws[i] = (struct worker){.client = idx, .thread = i, .seed = rnd(&s) | 1};
        ws[i].buf = malloc(3 * MiB + 8);
        if (!ws[i].buf) _exit(1);
        make_tensors(&ws[i], &s);
    }
    char c = 'r';
    if (write_all(up, &c, 1) < 0) _exit(1);

    pthread_t th[THREADS];
    for (int i = 0; i < THREADS; i++)
        if (pthread_create(&th[i], NULL, worker_main, &ws[i]) != 0) _exit(1);
    for (int i = 0; i < THREADS; i++)
        pthread_join(th[i], NULL);
    zinf_close(eng); /* flushes the job once more */
    eng = NULL;
    struct client_report rep = {.ops = atomic_load(&c_ops),
                                .failures = atomic_load(&c_failures),
                                .nomem = atomic_load(&c_nomem),
                                .refused = atomic_load(&c_refused),
                                .flushes = atomic_load(&c_flushes),
                                .checked_bytes = atomic_load(&c_checked)};
    if (write_all(up, &rep, sizeof(rep)) < 0) _exit(1);

    /* The parent restarts the daemon meanwhile; "go" says it answers. */
    if (read(down, &c, 1) != 1) _exit(1);
    struct client_report ver = {0};
    verify(ws, &ver);
    if (write_all(up, &ver, sizeof(ver)) < 0) _exit(1);
    for (int i = 0; i < THREADS; i++) {
        for (int j = 0; j < TENSORS; j++)
            free(ws[i].t[j].ref);
        free(ws[i].buf);
    }
    _exit(rep.failures || ver.failures ? 1 : 0);
}

/* ---- the hostile client ----------------------------------------------------------------- */

struct hostile_report {
    uint64_t rounds, failures;
    uint64_t tricks_refused, helloes_refused;    /* 1, 2 */
    uint64_t folder_tries;                       /* 3, 4, 5, 8: each failed with EACCES */
    uint64_t jobs_most, jobs_refused;            /* 6: the most open at once; floods cut short */
    uint64_t silent_held, silent_closed;         /* 7: connected; closed by the daemon in time */
    uint64_t silent_late, silent_late_ms;        /* 7: closed within the grace; the latest */
    uint64_t kills, kills_done, old, new_, torn; /* 10 */
};

static struct hostile_report hr;

static void hostile_failed(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void hostile_failed(const char *fmt, ...)
{
    char what[700];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    if (hr.failures++ < 20) say("FAILED: the hostile client (uid %d): %s", NOBODY, what);
}

/* A trick that must not work: its success is a failure, its error is counted. */
static void refused_trick(int r, int i, const char *what)
{
    if (r == 0)
        hostile_failed("memfd %d: %s worked", i, what);
    else
        hr.tricks_refused++;
}

/* Items 1 and 2: a session started by hand; every fd it came with shrunk, grown, sealed,
 * punched, mapped and scribbled on where the kernel lets it; then calls that make the
 * daemon touch that memory. */
static void hostile_memfds(uint64_t *s)
{
    int fd = dial(10000);
    if (fd < 0) {
        hr.helloes_refused++;
        return;
    }
    struct proto_request q = {.op = PROTO_HELLO};
    snprintf(q.name, sizeof(q.name), "hx");
    int fds[8], nfds = 8;
    uint8_t *p = NULL;
    size_t len = 0;
    int r = raw_call(fd, &q, &p, &len, fds, &nfds);
    if (r != 0) {
        hr.helloes_refused++;
        free(p);
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        close(fd);
        return;
    }
    uint32_t kind[PROTO_MAX_REGIONS] = {0}, nreg;
    struct proto_in in;
    proto_in_init(&in, p, len);
    proto_get_i32(&in);
    proto_get_u64(&in);
    proto_get_u64(&in);
    nreg = proto_get_u32(&in);
    for (uint32_t i = 0; i < nreg && i < PROTO_MAX_REGIONS; i++) {
        kind[i] = proto_get_u32(&in);
        proto_get_u64(&in);
    }
    free(p);
    for (int i = 0; i < nfds; i++) {
        int f = fds[i];
        struct stat st;
        if (fstat(f, &st) != 0) continue;
        refused_trick(ftruncate(f, 0), i, "ftruncate to 0 bytes");
        refused_trick(ftruncate(f, st.st_size / 2), i, "ftruncate to half");
        refused_trick(ftruncate(f, st.st_size + 4096), i, "ftruncate to grow");
        refused_trick(fallocate(f, 0, st.st_size, 1 << 20), i, "fallocate past the end");
        refused_trick(fcntl(f, F_ADD_SEALS, F_SEAL_WRITE), i, "F_ADD_SEALS F_SEAL_WRITE");
#ifdef F_SEAL_FUTURE_WRITE
        refused_trick(fcntl(f, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), i, "F_SEAL_FUTURE_WRITE");
#endif
        if (i < (int)nreg && kind[i] == PROTO_REGION_LIVE) {
            /* The liveness mutex is the daemon's alone to write. */
            refused_trick(fallocate(f, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, st.st_size),
                          i, "punching a hole in the liveness page");
            refused_trick(pwrite(f, "x", 1, 0) == 1 ? 0 : -1, i, "writing the liveness page");
            void *m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
            refused_trick(m != MAP_FAILED ? 0 : -1, i, "a writable mapping of the liveness page");
            if (m != MAP_FAILED) munmap(m, (size_t)st.st_size);
            continue;
        }
        /* Its own job's arenas and its own pin table: allowed, and only its own bytes. */
        if (rnd(s) & 1) fallocate(f, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, st.st_size);
        void *m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
        if (m != MAP_FAILED) {
            pattern(m, (size_t)st.st_size, rnd(s));
            munmap(m, (size_t)st.st_size);
        }
    }
    /* Calls that make the daemon read what was scribbled: the ring of the pin table, the
     * arenas under a tensor. Any answer will do. */
    uint64_t t = 0;
    q = (struct proto_request){.op = PROTO_REGISTER, .handle = 65536 + 17, .tier = ZINF_TIER_HOST};
    snprintf(q.name, sizeof(q.name), "hx.t");
    p = NULL;
    r = raw_call(fd, &q, &p, &len, NULL, NULL);
    if (r == -EEXIST) {
        free(p);
        p = NULL;
        q.op = PROTO_LOOKUP;
        r = raw_call(fd, &q, &p, &len, NULL, NULL);
    }
    if (r == 0 && len >= 12) memcpy(&t, p + 4, 8);
    free(p);
    for (uint32_t tier = 0; t && tier < 2; tier++) {
        q = (struct proto_request){.op = PROTO_FETCH, .handle = t, .tier = tier};
        raw_call(fd, &q, NULL, NULL, NULL, NULL);
        q = (struct proto_request){
            .op = PROTO_RELEASE, .handle = t, .tier = tier, .flags = ZINF_RELEASE_DIRTY};
        raw_call(fd, &q, NULL, NULL, NULL, NULL);
        q = (struct proto_request){.op = PROTO_READ, .handle = t, .offset = 0, .n = 4096};
        raw_call(fd, &q, NULL, NULL, NULL, NULL);
    }
    q = (struct proto_request){.op = PROTO_STEP};
    raw_call(fd, &q, NULL, NULL, NULL, NULL);
    q = (struct proto_request){.op = PROTO_STATS};
    raw_call(fd, &q, NULL, NULL, NULL, NULL);
    q = (struct proto_request){.op = PROTO_FLUSH};
    raw_call(fd, &q, NULL, NULL, NULL, NULL);
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    close(fd);
}

/* One attempt at making something in a folder of the daemon's: it must fail with EACCES. */
static void expect_eacces(int r, const char *what, const char *path)
{
    hr.folder_tries++;
    if (r == 0)
        hostile_failed("%s %s worked", what, path);
    else if (errno != EACCES)
        hostile_failed("%s %s: %s, not EACCES", what, path, strerror(errno));
}

/* Items 3, 4, 5 and 8: files, links (to a file of its own and to a root-only one), FIFOs,
 * folders and renames into the swap folder and every job folder (they are root's, 0700),
 * and opening the files there. */
static void hostile_folders(void)
{
    static const char *jobs[] = {"", "/r0", "/n0", "/hx", "/h0"};
    char mine[4300], fifo[4300], moved[4300];
    snprintf(mine, sizeof(mine), "%s/mine", own_dir);
    snprintf(fifo, sizeof(fifo), "%s/fifo", own_dir);
    snprintf(moved, sizeof(moved), "%s/moved", own_dir);
    int fd = open(mine, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd >= 0) close(fd);
    mkfifo(fifo, 0666);
    for (size_t j = 0; j < sizeof(jobs) / sizeof(jobs[0]); j++) {
        char d[4300], p[4400];
        snprintf(d, sizeof(d), "%s%s", swapdir, jobs[j]);
        snprintf(p, sizeof(p), "%s/planted", d);
        expect_eacces((fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666)) >= 0 ? 0 : -1,
                      "creating", p);
        if (fd >= 0) close(fd);
        snprintf(p, sizeof(p), "%s/zinf-manifest.json.tmp", d);
        expect_eacces(symlink("/etc/shadow", p), "a symbolic link at", p);
        snprintf(p, sizeof(p), "%s/zinf-swap.1", d);
        expect_eacces(link(mine, p), "a hard link at", p);
        snprintf(p, sizeof(p), "%s/zinf-manifest.json", d);
        expect_eacces(mkfifo(p, 0666), "a FIFO at", p);
        expect_eacces(rename(fifo, p), "renaming a FIFO to", p);
        expect_eacces((fd = open(p, O_RDONLY | O_NONBLOCK | O_CLOEXEC)) >= 0 ? 0 : -1, "opening",
                      p);
        if (fd >= 0) close(fd);
        snprintf(p, sizeof(p), "%s/zinf-swap.0", d);
        expect_eacces((fd = open(p, O_RDWR | O_CLOEXEC)) >= 0 ? 0 : -1, "opening", p);
        if (fd >= 0) close(fd);
        snprintf(p, sizeof(p), "%s/sub", d);
        expect_eacces(mkdir(p, 0777), "a folder at", p);
        expect_eacces(rename(p, moved), "moving", p);
    }
    unlink(mine);
    unlink(fifo);
}

/* Item 6: as many jobs as the daemon lets it open, each a session kept open, then all
 * closed. The names come back every round, so that without limits the jobs it opened do
 * not add up (they stay open: the daemon closes no job then). */
static void hostile_jobs(void)
{
    zinf_engine *e[MAX_JOBS];
    int n = 0;
    for (int i = 0; i < MAX_JOBS; i++) {
        char job[16];
        snprintf(job, sizeof(job), "h%d", i);
        if (zinf_connect(sock, job, &e[n]) != 0) {
            hr.jobs_refused++;
            break;
        }
        n++;
    }
    if ((uint64_t)n > hr.jobs_most) hr.jobs_most = (uint64_t)n;
    for (int i = 0; i < n; i++)
        zinf_close(e[i]);
}

/* Item 7: connections that never say HELLO, held past the deadline for one (--limits):
 * those the daemon took must have been closed by then. The daemon's clock starts when it
 * accepts, which on a loaded machine may come a while after the connect, so one closed in a
 * further SILENT_GRACE_S is counted late, not failed; one still open then is a failure. */
/* Whether the daemon still holds a connection open. One refused at accept (over
 * connections_per_uid) gets its refusal first, then the end: what it sent is read past. */
static bool silent_open(int fd)
{
    char buf[512];
    for (;;) {
        ssize_t r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (r > 0) continue;
        return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
    }
}

static void hostile_silent(void)
{
    int fds[SILENT], n = 0;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", sock);
    for (int i = 0; i < SILENT; i++) {
        /* Non-blocking: a full backlog answers EAGAIN instead of waiting. */
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) break;
        if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
            close(fd);
            continue;
        }
        fds[n++] = fd;
    }
    hr.silent_held += (uint64_t)n;
    sleep_ms(opt_limits ? (HELLO_TIMEOUT_S + 2) * 1000 : 3000);
    int open_still = n;
    for (int waited_ms = 0;; waited_ms += 100) {
        int left = 0;
        for (int i = 0; i < open_still; i++) {
            if (silent_open(fds[i])) {
                fds[left++] = fds[i];
                continue;
            }
            close(fds[i]);
            if (!waited_ms) {
                hr.silent_closed++;
            } else {
                hr.silent_late++;
                if ((uint64_t)waited_ms > hr.silent_late_ms)
                    hr.silent_late_ms = (uint64_t)waited_ms;
            }
        }
        open_still = left;
        if (!opt_limits || !open_still || waited_ms >= SILENT_GRACE_S * 1000) break;
        sleep_ms(100);
    }
    for (int i = 0; i < open_still; i++)
        close(fds[i]);
    if (opt_limits && open_still)
        hostile_failed("%d of %d connections that never said HELLO still open after %d s "
                       "(hello_timeout %d s)",
                       open_still, n, HELLO_TIMEOUT_S + 2 + SILENT_GRACE_S, HELLO_TIMEOUT_S);
}

static int big_tensor(zinf_engine *e, zinf_tensor *t)
{
    int r = zinf_lookup(e, "big", t);
    if (r == -ENOENT) r = zinf_register(e, "big", BIG_BYTES, ZINF_TIER_NVME, t);
    return r;
}

/* Item 10: a child in its own job (the one of the memfd tricks: uid 65534 has two jobs
 * besides its good clients' under the default limits) starts a 16 MiB zinf_write (split into
 * messages by the client) and is killed at a random moment of it; a new session then reads the
 * tensor, which must hold all the old bytes or all the new ones (checked with --atomic-write). */
static void hostile_killed_write(uint64_t *s, unsigned char *oldb, unsigned char *newb,
                                 unsigned char *got)
{
    zinf_engine *e;
    zinf_tensor t;
    uint64_t v = rnd(s);
    if (zinf_connect(sock, "hx", &e) != 0) return;
    pattern(oldb, BIG_BYTES, v);
    pattern(newb, BIG_BYTES, v + 1);
    int r = big_tensor(e, &t);
    if (r == 0) r = zinf_write(e, t, 0, oldb, BIG_BYTES);
    zinf_close(e);
    if (r != 0) return;

    int pp[2];
    if (pipe2(pp, O_CLOEXEC) != 0) return;
    pid_t me = getpid(), pid = fork();
    if (pid < 0) {
        close(pp[0]);
        close(pp[1]);
        return;
    }
    if (pid == 0) {
        die_with_parent(me);
        close(pp[0]);
        if (zinf_connect(sock, "hx", &e) != 0 || big_tensor(e, &t) != 0) _exit(1);
        char c = 's';
        if (write_all(pp[1], &c, 1) < 0) _exit(1);
        zinf_write(e, t, 0, newb, BIG_BYTES);
        c = 'd';
        if (write_all(pp[1], &c, 1) < 0) _exit(1);
        pause();
        _exit(0);
    }
    close(pp[1]);
    char c;
    bool started = read_timed(pp[0], &c, 1, 20000) == 0;
    if (started) sleep_ms((unsigned)(rnd(s) % 40));
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    bool done = started && read_timed(pp[0], &c, 1, 0) == 0;
    close(pp[0]);
    if (!started) return;
    hr.kills++;
    hr.kills_done += done;

    if (zinf_connect(sock, "hx", &e) != 0) return;
    r = big_tensor(e, &t);
    if (r == 0) r = zinf_read(e, t, 0, got, BIG_BYTES);
    zinf_close(e);
    if (r != 0) return;
    if (memcmp(got, oldb, BIG_BYTES) == 0) {
        hr.old++;
    } else if (memcmp(got, newb, BIG_BYTES) == 0) {
        hr.new_++;
    } else {
        hr.torn++;
        size_t first = 0, olds = 0, news = 0;
        while (got[first] == oldb[first])
            first++;
        for (size_t i = 0; i < BIG_BYTES; i += 4096) {
            olds += memcmp(got + i, oldb + i, 4096) == 0;
            news += memcmp(got + i, newb + i, 4096) == 0;
        }
        if (opt_atomic)
            hostile_failed("a 16 MiB zinf_write killed half-way left its tensor torn: %zu "
                           "pages old, %zu new, %zu neither (the first new byte at %zu)",
                           olds, news, BIG_BYTES / 4096 - olds - news, first);
    }
}

/* What the library says of each refusal the hostile client meets is noise here. */
static void quiet(int level, const char *msg, void *user)
{
    (void)level;
    (void)msg;
    (void)user;
}

static void hostile_main(int up, int down)
{
    uint64_t s = 0xbad5eed;
    zinf_set_log(quiet, NULL, -1);
    unsigned char *oldb = malloc(BIG_BYTES), *newb = malloc(BIG_BYTES), *got = malloc(BIG_BYTES);
    if (!oldb || !newb || !got) _exit(1);
    while (now_ns() < deadline_ns || hr.rounds == 0) {
        hostile_memfds(&s);
        hostile_killed_write(&s, oldb, newb, got);
        hostile_folders();
        hostile_jobs();
        hostile_silent();
        if (++hr.rounds == 1) {
            /* Everything has run once: the parent samples the daemon, then says go on. */
            char c = '1';
            if (write_all(up, &c, 1) < 0 || read(down, &c, 1) != 1) _exit(1);
        }
    }
    free(oldb);
    free(newb);
    free(got);
    if (write_all(up, &hr, sizeof(hr)) < 0) _exit(1);
    _exit(hr.failures ? 1 : 0);
}

/* ---- the parent: the daemon, the children, the checks ----------------------------------- */

static pid_t daemon_pid = -1;
static pid_t kids[CLIENTS + 1];
static int nkids;
static int failures;

/* Whatever happens, nothing is left running. */
static void kill_all(void)
{
    for (int i = 0; i < nkids; i++)
        if (kids[i] > 0) kill(kids[i], SIGKILL);
    if (daemon_pid > 0) kill(daemon_pid, SIGKILL);
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char m[] = "soak_serve: FAILED: the run took far longer than it should "
                            "(a daemon or client hung); everything killed\n";
    kill_all();
    if (write(STDERR_FILENO, m, sizeof(m) - 1) < 0) {
    }
    _exit(1);
}

static void log_tail(void)
{
    FILE *f = fopen(log_path, "r");
    if (!f) return;
    static char lines[40][512];
    int n = 0;
    while (fgets(lines[n % 40], sizeof(lines[0]), f))
        n++;
    fclose(f);
    fprintf(stderr, "# the daemon's log (%s), its last lines:\n", log_path);
    for (int i = n > 40 ? n - 40 : 0; i < n; i++)
        fprintf(stderr, "#   %s", lines[i % 40]);
}

static void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fatal(const char *fmt, ...)
{
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    kill_all();
    unlink(sock);
    rmdir(sockdir);
    say("FAILED: %s", what);
    log_tail();
    say("the scratch folder %s is kept", dir);
    fprintf(stderr, "soak_serve: 0 passed, 1 failed\n");
    exit(1);
}

static void check_failed(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void check_failed(const char *fmt, ...)
{
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    say("FAILED: %s", what);
    failures++;
}

/* STATUS on a new connection: 0 once answered, -errno otherwise (-EAGAIN: no answer in
 * timeout_ms). */
static int ping(int timeout_ms, const char **stage)
{
    *stage = "connect";
    int fd = dial(timeout_ms);
    if (fd < 0) return fd;
    *stage = "reply";
    struct proto_request q = {.op = PROTO_STATUS};
    int r = raw_call(fd, &q, NULL, NULL, NULL, NULL);
    close(fd);
    return r;
}

/* Where a hung daemon's threads wait, when gdb is there to ask, and its listening socket's
 * backlog (into the test's log). */
static void dump_stacks(void)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "ss -xl src '%s' >&2", sock);
    say("the daemon's socket (Recv-Q: connections waiting to be accepted):");
    fflush(NULL);
    if (system(cmd) != 0) say("(ss could not tell)");
    if (system("command -v gdb >/dev/null 2>&1") != 0) return;
    snprintf(cmd, sizeof(cmd),
             "timeout 120 gdb -p %d -batch -ex 'thread apply all bt' 2>/dev/null | "
             "grep -E '^(Thread|#)' >&2",
             (int)daemon_pid);
    say("the daemon's threads:");
    fflush(NULL);
    if (system(cmd) != 0) say("(gdb could not tell)");
}

/* The daemon still runs: it has not exited, and answers STATUS within 15 s. */
static void daemon_alive(const char *when)
{
    int st;
    if (waitpid(daemon_pid, &st, WNOHANG) == daemon_pid) {
        daemon_pid = -1;
        if (WIFSIGNALED(st))
            fatal("%s: the daemon died of signal %d (%s)", when, WTERMSIG(st),
                  strsignal(WTERMSIG(st)));
        fatal("%s: the daemon exited with status %d", when, WEXITSTATUS(st));
    }
    const char *stage;
    int r = ping(15000, &stage);
    if (r == -EAGAIN || r == -EWOULDBLOCK) {
        dump_stacks();
        fatal("%s: the daemon did not %s within 15 s (hung?)", when,
              strcmp(stage, "connect") ? "answer STATUS" : "accept a connection");
    }
    if (r < 0) fatal("%s: the daemon's STATUS (%s): %s", when, stage, zinf_strerror(r));
}

/* Waits for n bytes from fd for up to timeout_s, checking the daemon every 2 s. */
static void wait_for(int fd, void *p, size_t n, int timeout_s, const char *what)
{
    uint64_t until = now_ns() + (uint64_t)timeout_s * 1000000000ull;
    size_t got = 0;
    while (got < n) {
        if (now_ns() > until) fatal("no word from %s within %d s", what, timeout_s);
        struct pollfd pf = {fd, POLLIN, 0};
        int r = poll(&pf, 1, 2000);
        if (r < 0 && errno != EINTR) fatal("poll: %s", strerror(errno));
        if (r > 0) {
            ssize_t k = read(fd, (char *)p + got, n - got);
            if (k == 0) fatal("%s exited early (its messages above)", what);
            if (k > 0) got += (size_t)k;
            continue;
        }
        daemon_alive(what);
    }
}

static void daemon_start(void)
{
    pid_t parent = getpid();
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) fatal("fork: %s", strerror(errno));
    if (pid == 0) {
        die_with_parent(parent);
        int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd < 0 || dup2(fd, STDOUT_FILENO) < 0 || dup2(fd, STDERR_FILENO) < 0) _exit(127);
        execl(zinf_bin, "zinf", "serve", "--foreground", "--socket", sock, "--config", cfg_path,
              "--group", group, (char *)NULL);
        _exit(127);
    }
    daemon_pid = pid;
    for (int i = 0; i < 300; i++) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            daemon_pid = -1;
            fatal("zinf serve exited at start (status %#x)", st);
        }
        const char *stage;
        if (ping(5000, &stage) == 0) return;
        sleep_ms(100);
    }
    fatal("zinf serve did not answer on %s within 30 s", sock);
}

/* SIGTERM: every job flushed, exit status 0, within 30 s. */
static void daemon_stop(const char *when)
{
    uint64_t t0 = now_ns();
    kill(daemon_pid, SIGTERM);
    for (;;) {
        int st;
        pid_t r = waitpid(daemon_pid, &st, WNOHANG);
        if (r == daemon_pid) {
            daemon_pid = -1;
            double s = (double)(now_ns() - t0) / 1e9;
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
                fatal("%s: after SIGTERM the daemon ended with status %#x", when, st);
            printf("# %s: SIGTERM stopped the daemon in %.2f s, exit status 0\n", when, s);
            return;
        }
        if (now_ns() - t0 > 30000000000ull)
            fatal("%s: the daemon did not exit within 30 s of SIGTERM", when);
        sleep_ms(50);
    }
}

struct sample {
    long rss_kib, anon_kib, shmem_kib; /* VmRSS, and its anonymous and shared-memory parts */
    int fds;
};

static struct sample daemon_sample(void)
{
    /* A connection just closed may still hold its descriptor for a moment, and finished
     * connections' threads are joined when the next one is accepted. */
    for (int i = 0; i < 3; i++) {
        const char *stage;
        ping(15000, &stage);
        sleep_ms(100);
    }
    struct sample sm = {-1, 0, 0, 0};
    char p[64], line[256];
    snprintf(p, sizeof(p), "/proc/%d/status", (int)daemon_pid);
    FILE *f = fopen(p, "r");
    while (f && fgets(line, sizeof(line), f))
        if (!strncmp(line, "VmRSS:", 6))
            sm.rss_kib = atol(line + 6);
        else if (!strncmp(line, "RssAnon:", 8))
            sm.anon_kib = atol(line + 8);
        else if (!strncmp(line, "RssShmem:", 9))
            sm.shmem_kib = atol(line + 9);
    if (f) fclose(f);
    snprintf(p, sizeof(p), "/proc/%d/fd", (int)daemon_pid);
    DIR *d = opendir(p);
    struct dirent *de;
    while (d && (de = readdir(d)))
        sm.fds += de->d_name[0] != '.';
    if (d) closedir(d);
    if (sm.rss_kib < 0 || !d) fatal("cannot read the daemon's %s", p);
    return sm;
}

static void write_config(void)
{
    FILE *f = fopen(cfg_path, "w");
    if (!f) fatal("%s: %s", cfg_path, strerror(errno));
    /* pin_memory false: the host arenas of the 40-odd jobs the hostile client may open are
     * not locked (nor faulted in) up front, which a container's RLIMIT_MEMLOCK would refuse;
     * staging_bytes: each job's ring for NVMe reads is 1 MiB, not the 64 MiB that
     * DeepSpeed's buffer defaults give, so that jobs are cheap and a leak stands out. */
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s\", \"pin_memory\": false}},\n"
            " \"aio\": {\"block_size\": 65536, \"queue_depth\": 8},\n"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"8M\", \"host_bytes\": "
            "\"8M\", \"staging_bytes\": \"1M\"",
            swapdir);
    if (opt_limits)
        fprintf(f,
                ",\n  \"serve\": {\"jobs_per_uid\": 4, \"sessions_per_uid\": 16, "
                "\"connections_per_uid\": 64, \"hello_timeout\": %d, \"idle_job_close\": %d, "
                "\"write_stage_bytes\": \"16M\"}",
                HELLO_TIMEOUT_S, IDLE_JOB_CLOSE_S);
    fprintf(f, "}}\n");
    fclose(f);
}

/* The scratch folder (0711: uid 65534 reaches the swap folder, to be refused there), the
 * swap folder (root's, 0700), a folder uid 65534 owns for its own files, and the socket's
 * folder under /tmp (0711), which uid 65534 can reach wherever the scratch folder lies. */
static void make_folders(void)
{
    const char *base = getenv("ZINF_TEST_TMPDIR") ? getenv("ZINF_TEST_TMPDIR") : "/tmp";
    mkdir(base, 0755); /* the first test of a fresh build folder makes it */
    snprintf(dir, sizeof(dir), "%s/zinf-soak-XXXXXX", base);
    if (!mkdtemp(dir)) fatal("mkdtemp %s: %s", dir, strerror(errno));
    snprintf(swapdir, sizeof(swapdir), "%s/swap", dir);
    snprintf(own_dir, sizeof(own_dir), "%s/nobody", dir);
    snprintf(cfg_path, sizeof(cfg_path), "%s/zinf.json", dir);
    snprintf(log_path, sizeof(log_path), "%s/daemon.log", dir);
    if (chmod(dir, 0711) != 0 || mkdir(swapdir, 0700) != 0 || mkdir(own_dir, 0700) != 0 ||
        chown(own_dir, NOBODY, NOBODY) != 0)
        fatal("making the folders in %s: %s", dir, strerror(errno));
    strcpy(sockdir, "/tmp/zinf-soak-sock-XXXXXX");
    if (!mkdtemp(sockdir) || chmod(sockdir, 0711) != 0)
        fatal("the socket's folder %s: %s", sockdir, strerror(errno));
    snprintf(sock, sizeof(sock), "%s/zinf.sock", sockdir);
}

static void remove_folders(bool all)
{
    rmdir(sockdir);
    if (!all) return;
    char cmd[4200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) != 0) say("could not remove %s", dir);
}

/* A child of the parent with a pipe each way (the parent's ends in *up, *down). */
static pid_t spawn(bool nobody, int *up, int *down, void (*fn)(int, int, int), int arg)
{
    int u[2], d[2];
    if (pipe2(u, O_CLOEXEC) != 0 || pipe2(d, O_CLOEXEC) != 0) fatal("pipe: %s", strerror(errno));
    pid_t parent = getpid();
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) fatal("fork: %s", strerror(errno));
    if (pid == 0) {
        close(u[0]);
        close(d[1]);
        /* Not the other children's pipes: each must see its own end when the parent goes. */
        for (int fd = 3; fd < 1024; fd++)
            if (fd != u[1] && fd != d[0]) close(fd);
        signal(SIGALRM, SIG_DFL);
        if (nobody) become_nobody();
        die_with_parent(parent);
        fn(arg, u[1], d[0]);
        _exit(0);
    }
    close(u[1]);
    close(d[0]);
    *up = u[0];
    *down = d[1];
    kids[nkids++] = pid;
    return pid;
}

static void run_client(int idx, int up, int down)
{
    client_main(idx, up, down);
}

static void run_hostile(int idx, int up, int down)
{
    (void)idx;
    hostile_main(up, down);
}

/* A child's exit status, waiting up to timeout_s. */
static int reap(pid_t pid, int timeout_s)
{
    uint64_t until = now_ns() + (uint64_t)timeout_s * 1000000000ull;
    int st;
    while (waitpid(pid, &st, WNOHANG) != pid) {
        if (now_ns() > until) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        sleep_ms(20);
    }
    for (int i = 0; i < nkids; i++)
        if (kids[i] == pid) kids[i] = -1;
    return st;
}

static void usage(void)
{
    fprintf(stderr, "usage: soak_serve [--seconds N] [--limits] [--atomic-write] [--keep]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--seconds") && i + 1 < argc)
            opt_seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--limits"))
            opt_limits = true;
        else if (!strcmp(argv[i], "--atomic-write"))
            opt_atomic = true;
        else if (!strcmp(argv[i], "--keep"))
            opt_keep = true;
        else
            usage();
    }
    if (!(opt_seconds > 0 && opt_seconds <= 7 * 86400)) usage();
    struct group *g = getgrgid(NOBODY);
    if (geteuid() != 0 || !g) {
        printf("soak_serve: skipped: needs root%s, to act as a second user (uid %d) beside "
               "root\n",
               g ? "" : " and a group of gid 65534", NOBODY);
        return 77;
    }
    group = strdup(g->gr_name);
    zinf_bin = getenv("ZINF_BIN");
    if (!zinf_bin || access(zinf_bin, X_OK) != 0) {
        fprintf(stderr, "soak_serve: ZINF_BIN must name the zinf program (meson test sets it)\n");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    signal(SIGALRM, on_alarm);
    /* Whatever hangs, the run ends: the load, then at most 30 s for each stop, a restart
     * and the checks, with room for a slow machine. */
    alarm((unsigned)opt_seconds + 300);
    setvbuf(stdout, NULL, _IOLBF, 0);

    make_folders();
    write_config();
    printf("# soak_serve: %.0f s, %d client processes (%d as uid 0, %d as uid %d) x %d threads x "
           "%d tensors, a hostile client as uid %d; limits %s, atomic-write check %s\n"
           "# scratch %s, socket %s, daemon group %s\n",
           opt_seconds, CLIENTS, CLIENTS / 2, CLIENTS / 2, NOBODY, THREADS, TENSORS, NOBODY,
           opt_limits ? "on" : "off", opt_atomic ? "on" : "off", dir, sock, group);
    daemon_start();
    struct sample base = daemon_sample();

    uint64_t start = now_ns();
    deadline_ns = start + (uint64_t)(opt_seconds * 1e9);
    int up[CLIENTS + 1], down[CLIENTS + 1];
    pid_t pids[CLIENTS + 1];
    for (int i = 0; i < CLIENTS; i++)
        pids[i] = spawn(i >= CLIENTS / 2, &up[i], &down[i], run_client, i);
    for (int i = 0; i < CLIENTS; i++) {
        char c;
        char what[64];
        snprintf(what, sizeof(what), "client %d (registering its tensors)", i);
        wait_for(up[i], &c, 1, 120, what);
    }
    pids[CLIENTS] = spawn(true, &up[CLIENTS], &down[CLIENTS], run_hostile, 0);
    char c;
    wait_for(up[CLIENTS], &c, 1, 300, "the hostile client's first round");
    struct sample warm = daemon_sample();
    printf("# %.1f s in, the hostile client's first round done: daemon RSS %.1f MiB (anonymous "
           "%.1f, shared %.1f), %d fds (before any client: %.1f MiB, %d fds)\n",
           (double)(now_ns() - start) / 1e9, warm.rss_kib / 1024.0, warm.anon_kib / 1024.0,
           warm.shmem_kib / 1024.0, warm.fds, base.rss_kib / 1024.0, base.fds);
    if (write_all(down[CLIENTS], "g", 1) < 0) fatal("the hostile client is gone");

    /* The daemon's RSS and descriptors now and then, so that a long run shows their course. */
    uint64_t every_ns = (uint64_t)(opt_seconds < 50 ? 5e9 : opt_seconds * 1e8), said = now_ns();
    while (now_ns() < deadline_ns) {
        sleep_ms(1000);
        daemon_alive("during the load");
        if (now_ns() - said >= every_ns && now_ns() + 1000000000ull < deadline_ns) {
            struct sample sm = daemon_sample();
            printf("# %.0f s in: daemon RSS %.1f MiB (anonymous %.1f, shared %.1f), %d fds\n",
                   (double)(now_ns() - start) / 1e9, sm.rss_kib / 1024.0, sm.anon_kib / 1024.0,
                   sm.shmem_kib / 1024.0, sm.fds);
            said = now_ns();
        }
    }
    struct client_report tot = {0};
    for (int i = 0; i < CLIENTS; i++) {
        struct client_report r;
        char what[64];
        snprintf(what, sizeof(what), "client %d (its last flush and close)", i);
        wait_for(up[i], &r, sizeof(r), 120, what);
        tot.ops += r.ops;
        tot.failures += r.failures;
        tot.nomem += r.nomem;
        tot.refused += r.refused;
        tot.flushes += r.flushes;
        tot.checked_bytes += r.checked_bytes;
    }
    struct hostile_report h;
    wait_for(up[CLIENTS], &h, sizeof(h), 120, "the hostile client (its last round)");
    int st = reap(pids[CLIENTS], 30);
    if (st != 0) check_failed("the hostile client ended with status %#x", st);
    double load_s = (double)(now_ns() - start) / 1e9;
    printf("# the load: %llu operations by the good clients in %.1f s, %llu flushes, %.0f MiB "
           "checked, %llu fetches without room (-ENOMEM), %llu refusals; %llu failures\n",
           (unsigned long long)tot.ops, load_s, (unsigned long long)tot.flushes,
           (double)tot.checked_bytes / (double)MiB, (unsigned long long)tot.nomem,
           (unsigned long long)tot.refused, (unsigned long long)tot.failures);
    printf("# the hostile client: %llu rounds; %llu memfd tricks refused, %llu HELLOs refused; "
           "%llu tries in the daemon's folders, each EACCES; at most %llu jobs open at once "
           "(%llu floods refused); %llu silent connections held, %llu closed by the daemon in time "
           "(%llu more up to %.1f s late); "
           "%llu writes killed (%llu finished first): %llu left old, %llu new, %llu torn%s; "
           "%llu failures\n",
           (unsigned long long)h.rounds, (unsigned long long)h.tricks_refused,
           (unsigned long long)h.helloes_refused, (unsigned long long)h.folder_tries,
           (unsigned long long)h.jobs_most, (unsigned long long)h.jobs_refused,
           (unsigned long long)h.silent_held, (unsigned long long)h.silent_closed,
           (unsigned long long)h.silent_late, (double)h.silent_late_ms / 1e3,
           (unsigned long long)h.kills, (unsigned long long)h.kills_done, (unsigned long long)h.old,
           (unsigned long long)h.new_, (unsigned long long)h.torn,
           opt_atomic ? "" : " (not checked without --atomic-write)",
           (unsigned long long)h.failures);
    if (tot.failures)
        check_failed("%llu failures in the good clients (above)", (unsigned long long)tot.failures);

    /* Everything closed: with --limits, the daemon closes the jobs once idle. */
    sleep_ms(opt_limits ? (IDLE_JOB_CLOSE_S + 3) * 1000 : 1000);
    daemon_alive("after the load");
    struct sample end = daemon_sample();
    printf("# everything closed: daemon RSS %.1f MiB (anonymous %.1f, shared %.1f), %d fds\n",
           end.rss_kib / 1024.0, end.anon_kib / 1024.0, end.shmem_kib / 1024.0, end.fds);
    if (end.fds > warm.fds + FD_SLACK)
        check_failed("the daemon holds %d descriptors once every client has closed, %d while "
                     "they ran: %d more",
                     end.fds, warm.fds, end.fds - warm.fds);
    if (opt_limits && end.fds > base.fds + FD_SLACK)
        check_failed("the daemon holds %d descriptors once every job has gone idle, %d before "
                     "any client: its idle jobs were not closed whole",
                     end.fds, base.fds);
    if (end.rss_kib > warm.rss_kib + (long)RSS_SLACK_KIB)
        check_failed("the daemon's RSS grew from %.1f MiB to %.1f MiB (more than %zu MiB; its "
                     "anonymous part from %.1f to %.1f MiB)",
                     warm.rss_kib / 1024.0, end.rss_kib / 1024.0, (size_t)RSS_SLACK_KIB / 1024,
                     warm.anon_kib / 1024.0, end.anon_kib / 1024.0);

    daemon_stop("after the load");
    daemon_start();
    for (int i = 0; i < CLIENTS; i++)
        if (write_all(down[i], "g", 1) < 0) check_failed("client %d is gone", i);
    uint64_t verified = 0, unverified = 0;
    for (int i = 0; i < CLIENTS; i++) {
        struct client_report r;
        char what[64];
        snprintf(what, sizeof(what), "client %d (reading back after the restart)", i);
        wait_for(up[i], &r, sizeof(r), 120, what);
        verified += r.verified;
        unverified += r.unverified;
        if (r.failures)
            check_failed("client %d: %llu tensors wrong after the restart", i,
                         (unsigned long long)r.failures);
        if ((st = reap(pids[i], 30)) != 0) check_failed("client %d ended with status %#x", i, st);
    }
    if (unverified)
        check_failed("%llu tensors could not be written whole again before the end",
                     (unsigned long long)unverified);
    daemon_stop("after the restart");

    printf("soak_serve: %llu operations, %llu failures in %.1f s; daemon fds %d -> %d (%d "
           "before any client), RSS %.1f -> %.1f MiB; %llu tensors read back after the restart\n",
           (unsigned long long)tot.ops, (unsigned long long)(tot.failures + h.failures), load_s,
           warm.fds, end.fds, base.fds, warm.rss_kib / 1024.0, end.rss_kib / 1024.0,
           (unsigned long long)verified);
    if (failures) {
        log_tail();
        remove_folders(false);
        say("the scratch folder %s is kept", dir);
        printf("soak_serve: 0 passed, 1 failed\n");
        return 1;
    }
    remove_folders(!opt_keep);
    printf("soak_serve: 1 passed, 0 failed\n");
    return 0;
}
