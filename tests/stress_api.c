/*
 * stress_api.c - the public API from many threads at once, as a plain program (no
 * Criterion), so that it also runs under ThreadSanitizer, whose runtime Criterion's forking
 * runner cannot start under.
 *
 * Worker threads fetch to either tier and release clean or DIRTY, fetch sets of tensors at
 * once (zinf_fetch_all), write and read byte ranges, fetch asynchronously, prefetch and
 * mark steps, on tensors of odd sizes on all
 * three homes under budgets far below their total; one thread flushes, one unregisters and
 * registers a tensor again and again. Every byte is compared with a reference copy (a
 * per-tensor rwlock orders writers against readers, as a trainer would), and at the end
 * the state is closed, resumed and compared once more. Before the threads start, the one
 * race the contract allows is run on purpose, round after round (pin_race(), --pin-race
 * ROUNDS; 0: none).
 *
 * With --service the same runs through the zinf daemon (src/service/), started in this
 * process from the same settings: every call a client's, every thread a connection of its
 * session; the resume is a restart of the daemon. --clients N forks N - 1 more client
 * processes first, each with tensors of its own in the same job, sharing its budgets (N
 * times the single client's) and checking its own bytes.
 *
 * Not here: what each call answers to bad input (test_engine.c), crashes (test_persist.c).
 *
 *   stress_api [SECONDS] [--service [--clients N]] [--pin-race ROUNDS]
 *   (default 3 s, one client, 500 rounds; ZINF_TEST_TMPDIR for the swap directory)
 * Exit status 0 when every check passed; 1 with a message otherwise.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "service/server.h"
#include "zinf.h"

#define KiB ((size_t)1024)
#define MiB (1024 * KiB)
#define NT 12
#define WORKERS 4
#define PIN_RACE_ROUNDS 500 /* pin_race()'s rounds, before the threads start */

struct st_tensor {
    char name[32];
    _Atomic zinf_tensor h;
    size_t n;
    enum zinf_tier home;
    unsigned char *ref;
    pthread_rwlock_t lk; /* writers change the content (and re-register); readers pin clean */
};

static zinf_engine *eng;
static struct st_tensor tens[NT];
static atomic_bool stop_all;
static atomic_ulong ops;
static pthread_mutex_t fail_lock = PTHREAD_MUTEX_INITIALIZER;

static void fail(const char *fmt, ...)
{
    va_list ap;
    pthread_mutex_lock(&fail_lock);
    fprintf(stderr, "stress_api: FAILED: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void fill(unsigned char *p, size_t n, uint64_t *s)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)rnd(s);
}

/* Budgets with pins everywhere may leave no room for a moment: that is the contract. */
static bool transient(int r)
{
    return r == -ENOMEM;
}

static void check_bytes(const unsigned char *got, const unsigned char *want, size_t n,
                        const struct st_tensor *t, const char *what)
{
    if (memcmp(got, want, n) == 0) return;
    size_t i = 0;
    while (got[i] == want[i])
        i++;
    fail("%s of '%s' (%zu bytes, home %d): byte %zu differs", what, t->name, t->n, t->home, i);
}

/* ThreadSanitizer, where this program is built with it (gcc says so with a macro, clang
 * with a feature test). */
#if defined(__SANITIZE_THREAD__)
#define STRESS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define STRESS_TSAN 1
#endif
#endif
#ifdef STRESS_TSAN
/* The runtime's annotations (it defines them; no header declares them). */
void AnnotateIgnoreWritesBegin(const char *file, int line);
void AnnotateIgnoreWritesEnd(const char *file, int line);
#endif

/* The one access here that races with the engine by contract: a load of the other tier, a
 * write-back or a flush may read a copy while the caller who pinned it writes through the
 * pointer (what it reads is then overtaken by the DIRTY release that follows: a copy
 * loaded from it is stale, and no fetch after that release is served it).
 * ThreadSanitizer is told to ignore these writes, here and nowhere else. A suppression
 * naming this function (as tests/tsan.supp once did) is not enough: it matches only when
 * the runtime can restore the writer's stack, and once the writer has made more accesses
 * than its history holds (a few fills of a tensor: 32 Ki accesses at the default
 * history_size) the race is reported with "[failed to restore the stack]", so the leg
 * failed now and then. The engine's own accesses stay checked, and so do this program's
 * reads through its pins: an engine that wrote into a pinned copy races with those. */
__attribute__((noinline)) static void write_through_pin(void *p, const void *src, size_t n)
{
#ifdef STRESS_TSAN
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
#endif
    memcpy(p, src, n);
#ifdef STRESS_TSAN
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
#endif
}

static void op_fetch(struct st_tensor *t, uint64_t *s)
{
    enum zinf_tier tier = rnd(s) & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE;
    bool dirty = rnd(s) % 3 == 0;
    void *p;

    dirty ? pthread_rwlock_wrlock(&t->lk) : pthread_rwlock_rdlock(&t->lk);
    zinf_tensor h = atomic_load(&t->h);
    int r = zinf_fetch(eng, h, tier, &p);
    if (r == 0) {
        check_bytes(p, t->ref, t->n, t, "fetch");
        if (dirty) {
            size_t off = rnd(s) % t->n, len = 1 + rnd(s) % (t->n - off);
            fill(t->ref + off, len, s);
            write_through_pin((char *)p + off, t->ref + off, len);
        }
        r = zinf_release(eng, h, tier, dirty ? ZINF_RELEASE_DIRTY : 0);
        if (r) fail("release of '%s': %s", t->name, zinf_strerror(r));
    } else if (!transient(r)) {
        fail("fetch of '%s' to tier %d: %s", t->name, tier, zinf_strerror(r));
    }
    pthread_rwlock_unlock(&t->lk);
}

static void op_async(struct st_tensor *t, uint64_t *s)
{
    enum zinf_tier tier = rnd(s) & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE;
    uint64_t k;
    void *p;

    pthread_rwlock_rdlock(&t->lk);
    zinf_tensor h = atomic_load(&t->h);
    int r = zinf_fetch_async(eng, h, tier, &k);
    if (r == 0) r = zinf_wait(eng, k, &p);
    if (r == 0) {
        check_bytes(p, t->ref, t->n, t, "async fetch");
        if ((r = zinf_release(eng, h, tier, 0)))
            fail("release of '%s' after wait: %s", t->name, zinf_strerror(r));
    } else if (!transient(r)) {
        fail("async fetch of '%s': %s", t->name, zinf_strerror(r));
    }
    pthread_rwlock_unlock(&t->lk);
}

/* A set of two to six tensors pinned at once with zinf_fetch_all, which may empty the
 * tier (with the lock dropped) to lay them out: all pinned with their bytes, or none. Read
 * locks are taken in index order, so that sets never wait on each other in a circle. */
static void op_fetch_all(uint64_t *s)
{
    enum zinf_tier tier = rnd(s) & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE;
    int idx[6], n = 2 + (int)(rnd(s) % 5);
    for (int i = 0; i < n; i++) {
        int k;
        bool dup;
        do {
            k = 1 + (int)(rnd(s) % (NT - 1)); /* not tensor 0: it is registered again and again */
            dup = false;
            for (int j = 0; j < i; j++)
                dup |= idx[j] == k;
        } while (dup);
        int j = i;
        while (j > 0 && idx[j - 1] > k) {
            idx[j] = idx[j - 1];
            j--;
        }
        idx[j] = k;
    }
    zinf_tensor hs[6];
    void *p[6];
    for (int i = 0; i < n; i++) {
        pthread_rwlock_rdlock(&tens[idx[i]].lk);
        hs[i] = atomic_load(&tens[idx[i]].h);
    }
    int r = zinf_fetch_all(eng, hs, (size_t)n, tier, p);
    if (r == 0) {
        for (int i = 0; i < n; i++)
            check_bytes(p[i], tens[idx[i]].ref, tens[idx[i]].n, &tens[idx[i]], "fetch_all");
        for (int i = 0; i < n; i++)
            if ((r = zinf_release(eng, hs[i], tier, 0)))
                fail("release of '%s' after fetch_all: %s", tens[idx[i]].name, zinf_strerror(r));
    } else if (!transient(r)) {
        fail("fetch_all of %d tensors to tier %d: %s", n, tier, zinf_strerror(r));
    }
    for (int i = n - 1; i >= 0; i--)
        pthread_rwlock_unlock(&tens[idx[i]].lk);
}

static void op_write_read(struct st_tensor *t, uint64_t *s)
{
    size_t off = rnd(s) % t->n, len = 1 + rnd(s) % (t->n - off);
    unsigned char *buf = malloc(len);
    if (!buf) fail("out of memory");
    if (rnd(s) % 8 == 0) {
        /* Spent content: zeros with no pin, while the engine may still move the tensor. The
         * write lock keeps this program's pins off it. */
        pthread_rwlock_wrlock(&t->lk);
        int r = zinf_zero(eng, atomic_load(&t->h));
        if (r != (t->home == ZINF_TIER_NVME ? 0 : -EINVAL))
            fail("zinf_zero of '%s' (home %d): %s", t->name, t->home, zinf_strerror(r));
        if (r == 0) memset(t->ref, 0, t->n);
    } else if (rnd(s) & 1) {
        pthread_rwlock_wrlock(&t->lk);
        fill(buf, len, s);
        int r = zinf_write(eng, atomic_load(&t->h), off, buf, len);
        if (r) fail("write of '%s' [%zu, +%zu): %s", t->name, off, len, zinf_strerror(r));
        memcpy(t->ref + off, buf, len);
    } else {
        pthread_rwlock_rdlock(&t->lk);
        int r = zinf_read(eng, atomic_load(&t->h), off, buf, len);
        if (r) fail("read of '%s': %s", t->name, zinf_strerror(r));
        check_bytes(buf, t->ref + off, len, t, "read");
    }
    pthread_rwlock_unlock(&t->lk);
    free(buf);
}

static void *worker(void *arg)
{
    uint64_t s = 0x9e3779b97f4a7c15ull * (uintptr_t)arg + 1;
    while (!atomic_load(&stop_all)) {
        struct st_tensor *t = &tens[rnd(&s) % NT];
        unsigned op = rnd(&s) % 11;
        if (op < 5)
            op_fetch(t, &s);
        else if (op == 10)
            op_fetch_all(&s);
        else if (op < 7)
            op_async(t, &s);
        else if (op < 9)
            op_write_read(t, &s);
        else if (rnd(&s) & 1)
            zinf_prefetch(eng, atomic_load(&t->h), rnd(&s) & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE);
        else
            zinf_step(eng);
        atomic_fetch_add(&ops, 1);
    }
    return NULL;
}

static void *flusher(void *arg)
{
    while (!atomic_load(&stop_all)) {
        int r = zinf_flush(eng);
        if (r) fail("flush: %s", zinf_strerror(r));
        usleep(10000);
    }
    return NULL;
}

/* Unregister tensor 0 and register it again: it starts over as zeros. */
static void *reregistrar(void *arg)
{
    struct st_tensor *t = &tens[0];
    while (!atomic_load(&stop_all)) {
        pthread_rwlock_wrlock(&t->lk);
        int r = zinf_unregister(eng, atomic_load(&t->h));
        if (r) fail("unregister: %s", zinf_strerror(r));
        zinf_tensor h;
        while ((r = zinf_register(eng, t->name, t->n, t->home, &h)) == -ENOSPC)
            usleep(100); /* its home tier is full of other threads' pins for a moment */
        if (r) fail("register again: %s", zinf_strerror(r));
        atomic_store(&t->h, h);
        memset(t->ref, 0, t->n);
        pthread_rwlock_unlock(&t->lk);
        usleep(3000);
    }
    return NULL;
}

static void check_all(const char *when)
{
    for (int i = 0; i < NT; i++) {
        struct st_tensor *t = &tens[i];
        unsigned char *buf = malloc(t->n);
        int r = buf ? zinf_read(eng, atomic_load(&t->h), 0, buf, t->n) : -ENOMEM;
        if (r) fail("%s: read of '%s': %s", when, t->name, zinf_strerror(r));
        check_bytes(buf, t->ref, t->n, t, when);
        free(buf);
    }
}

/* --service: the daemon, in a thread of this process; --clients: processes, this one 0. */
static bool use_service;
static int clients = 1, proc_index;
static struct zinf_config svc_cfg;
static struct service *svc;
static pthread_t svc_thread;
static char svc_sock[4200];

static void *serve(void *arg)
{
    (void)arg;
    int r = service_run(svc);
    if (r < 0) fail("service_run: %s", zinf_strerror(r));
    return NULL;
}

static void service_down(void)
{
    if (!svc) return;
    service_stop(svc);
    pthread_join(svc_thread, NULL);
    service_close(svc); /* flushes the job */
    config_free(&svc_cfg);
    svc = NULL;
}

/* The daemon from the settings open_engine() gives an embedded engine (its budgets once per
 * client process); the job's swap folder is dir/stress, and a saved state there is resumed. */
static void start_service(const char *dir)
{
    char json[8192], err[512];
    snprintf(json, sizeof(json),
             "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
             "\"%s\"}}, \"aio\": {\"block_size\": 65536, \"queue_depth\": 8}, \"zinf\": "
             "{\"device\": \"emulated\", \"device_bytes\": %zu, \"host_bytes\": %zu}}",
             dir, 2 * MiB * (size_t)clients, 2 * MiB * (size_t)clients);
    int r = config_parse_buffer(json, strlen(json), "stress", &svc_cfg, err, sizeof(err));
    if (r < 0) fail("the daemon's config: %s", err);
    snprintf(svc_sock, sizeof(svc_sock), "%s/zinf.sock", dir);
    struct service_opts so = {.socket_path = svc_sock, .config = &svc_cfg};
    if ((r = service_open(&so, &svc, err, sizeof(err))) < 0) fail("%s", err);
    pthread_create(&svc_thread, NULL, serve, NULL);
}

/* A client of the job, waiting up to 10 s for the daemon (another process starts it). */
static int connect_service(const char *dir)
{
    snprintf(svc_sock, sizeof(svc_sock), "%s/zinf.sock", dir);
    int r = -ENOENT;
    for (int i = 0; i < 1000 && (r == -ENOENT || r == -ECONNREFUSED); i++)
        if ((r = zinf_connect(svc_sock, "stress", &eng)) == -ENOENT || r == -ECONNREFUSED)
            usleep(10000);
    return r;
}

static int open_engine(const char *dir, unsigned flags)
{
    if (use_service) return connect_service(dir);
    struct zinf_options o = {.nvme_path = dir,
                             .device_bytes = 2 * MiB,
                             .host_bytes = 2 * MiB,
                             .block_size = 64 * KiB,
                             .queue_depth = 8,
                             .device_kind = ZINF_DEVICE_EMULATED,
                             .flags = flags | ZINF_OPEN_NO_PIN};
    return zinf_open(&o, &eng);
}

/* The race the contract allows, on purpose and in every round: one tensor homed on NVMe,
 * two threads in lock step. The writer pins it in tier A and writes through the pin, over
 * and over, bytes that are not the round's, until the loader has brought the tensor into
 * the other tier B, which the engine loads from A: that load reads A while it is written,
 * every round, so a write through a pin that ThreadSanitizer were not told of fails the run
 * at once rather than now and then. The writer then writes the round's bytes, releases
 * DIRTY and checks B, A and zinf_read: the copy of B made from the torn read is stale and
 * must never be served. In half the rounds the loader only prefetches B, so the DIRTY
 * release may also overtake a load still in flight (it lands stale and is dropped). A
 * tier swaps roles every round. */
struct pin_race {
    zinf_tensor h;
    atomic_uint go;     /* the round whose pin the writer holds and writes through */
    atomic_uint loaded; /* the round whose load of B the loader has finished (or started) */
    atomic_bool done;
};

static enum zinf_tier pin_race_tier(unsigned round)
{
    return round & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE;
}

/* A fetch through the budgets that other client processes' threads may fill for a moment. */
static void *pin_race_fetch(zinf_tensor h, enum zinf_tier tier)
{
    void *p;
    int r;
    while ((r = zinf_fetch(eng, h, tier, &p)) == -ENOMEM)
        usleep(100);
    if (r) fail("pin race: fetch to tier %d: %s", tier, zinf_strerror(r));
    return p;
}

static void *pin_race_loader(void *arg)
{
    struct pin_race *pr = arg;
    for (unsigned k = 1;; k++) {
        while (atomic_load(&pr->go) < k) {
            if (atomic_load(&pr->done)) return NULL;
            sched_yield();
        }
        enum zinf_tier b = pin_race_tier(k + 1);
        int r = 0;
        if (k & 2) {
            r = zinf_prefetch(eng, pr->h, b);
        } else {
            pin_race_fetch(pr->h, b); /* its bytes are torn: only the engine's to judge */
            r = zinf_release(eng, pr->h, b, 0);
        }
        if (r) fail("pin race: the loader's round %u: %s", k, zinf_strerror(r));
        atomic_store(&pr->loaded, k);
    }
}

static void pin_race(unsigned rounds, uint64_t *s)
{
    const size_t n = 64 * KiB + 123;
    struct pin_race pr = {0};
    struct st_tensor t = {.n = n, .home = ZINF_TIER_NVME};
    unsigned char *want = malloc(n), *junk = malloc(n), *got = malloc(n);
    pthread_t th;
    int r;

    snprintf(t.name, sizeof(t.name), "p%d.pin-race", proc_index);
    if (!want || !junk || !got) fail("out of memory");
    if ((r = zinf_register(eng, t.name, n, ZINF_TIER_NVME, &pr.h)) < 0)
        fail("register '%s': %s", t.name, zinf_strerror(r));
    fill(want, n, s);
    if ((r = zinf_write(eng, pr.h, 0, want, n)) < 0)
        fail("first write of '%s': %s", t.name, zinf_strerror(r));
    pthread_create(&th, NULL, pin_race_loader, &pr);
    for (unsigned k = 1; k <= rounds; k++) {
        enum zinf_tier a = pin_race_tier(k), b = pin_race_tier(k + 1);
        /* B must not hold the content yet, or the loader would find it there: a DIRTY
         * release with nothing written makes a new version that only A holds. */
        pin_race_fetch(pr.h, a);
        if ((r = zinf_release(eng, pr.h, a, ZINF_RELEASE_DIRTY)))
            fail("pin race: DIRTY release %u: %s", k, zinf_strerror(r));
        void *p = pin_race_fetch(pr.h, a);
        check_bytes(p, want, n, &t, "pin race: the pin");
        fill(want, n, s);
        for (size_t i = 0; i < n; i++)
            junk[i] = (unsigned char)~want[i];
        atomic_store(&pr.go, k);
        do
            write_through_pin(p, junk, n);
        while (atomic_load(&pr.loaded) < k);
        write_through_pin(p, want, n);
        if ((r = zinf_release(eng, pr.h, a, ZINF_RELEASE_DIRTY)))
            fail("pin race: DIRTY release %u after the load: %s", k, zinf_strerror(r));
        check_bytes(pin_race_fetch(pr.h, b), want, n, &t, "pin race: the other tier");
        if ((r = zinf_release(eng, pr.h, b, 0))) fail("pin race: release: %s", zinf_strerror(r));
        check_bytes(pin_race_fetch(pr.h, a), want, n, &t, "pin race: the tier written");
        if ((r = zinf_release(eng, pr.h, a, 0))) fail("pin race: release: %s", zinf_strerror(r));
        if ((r = zinf_read(eng, pr.h, 0, got, n))) fail("pin race: read: %s", zinf_strerror(r));
        check_bytes(got, want, n, &t, "pin race: read");
    }
    atomic_store(&pr.done, true);
    pthread_join(th, NULL);
    if ((r = zinf_unregister(eng, pr.h))) fail("pin race: unregister: %s", zinf_strerror(r));
    free(want);
    free(junk);
    free(got);
}

int main(int argc, char **argv)
{
    double seconds = 3.0;
    unsigned pin_rounds = PIN_RACE_ROUNDS;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--service"))
            use_service = true;
        else if (!strcmp(argv[i], "--clients") && i + 1 < argc)
            clients = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--pin-race") && i + 1 < argc)
            pin_rounds = (unsigned)atoi(argv[++i]);
        else
            seconds = atof(argv[i]);
    }
    if (clients < 1 || clients > 64 || (clients > 1 && !use_service))
        fail("--clients N: 1 to 64, with --service");
    const char *base = getenv("ZINF_TEST_TMPDIR") ? getenv("ZINF_TEST_TMPDIR") : "/tmp";
    char dir[4096];
    uint64_t s = 12345;
    int r;

    snprintf(dir, sizeof(dir), "%s/zinf-stress-XXXXXX", base);
    if (!mkdtemp(dir)) {
        perror(dir);
        return 1;
    }
    /* The other clients first, before this process has threads to fork with. */
    pid_t kids[64];
    for (int k = 1; k < clients; k++) {
        fflush(NULL);
        kids[k] = fork();
        if (kids[k] < 0) fail("fork: %s", strerror(errno));
        if (kids[k] == 0) {
            proc_index = k;
            s += (uint64_t)k * 7919;
            break;
        }
    }
    if (use_service && proc_index == 0) start_service(dir);
    if ((r = open_engine(dir, 0)) < 0) fail("open: %s", zinf_strerror(r));
    for (int i = 0; i < NT; i++) {
        struct st_tensor *t = &tens[i];
        snprintf(t->name, sizeof(t->name), "p%d.t%d", proc_index, i);
        t->n = 4 * KiB + (size_t)(rnd(&s) % (300 * KiB)) + (size_t)i;
        t->home = (enum zinf_tier)(i % 3 == 0   ? ZINF_TIER_NVME
                                   : i % 3 == 1 ? ZINF_TIER_HOST
                                                : ZINF_TIER_DEVICE);
        if (i >= 6) t->home = ZINF_TIER_NVME; /* most of the state lives on the drive */
        t->ref = calloc(1, t->n);
        pthread_rwlock_init(&t->lk, NULL);
        zinf_tensor h;
        if (!t->ref || (r = zinf_register(eng, t->name, t->n, t->home, &h)) < 0)
            fail("register '%s': %s", t->name, zinf_strerror(r));
        atomic_store(&t->h, h);
        fill(t->ref, t->n, &s);
        if ((r = zinf_write(eng, h, 0, t->ref, t->n)) < 0)
            fail("first write of '%s': %s", t->name, zinf_strerror(r));
    }

    pin_race(pin_rounds, &s);

    pthread_t th[WORKERS + 2];
    for (uintptr_t i = 0; i < WORKERS; i++)
        pthread_create(&th[i], NULL, worker, (void *)(i + 1));
    pthread_create(&th[WORKERS], NULL, flusher, NULL);
    pthread_create(&th[WORKERS + 1], NULL, reregistrar, NULL);
    struct timespec ts = {.tv_sec = (time_t)seconds,
                          .tv_nsec = (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
    atomic_store(&stop_all, true);
    for (int i = 0; i < WORKERS + 2; i++)
        pthread_join(th[i], NULL);

    check_all("at the end");
    struct zinf_stats st;
    zinf_stats(eng, &st);
    zinf_close(eng);
    eng = NULL;
    if (proc_index > 0)
        exit(0); /* a client process checked its bytes; the resume is the first one's */
    for (int k = 1; k < clients; k++) {
        int status;
        if (waitpid(kids[k], &status, 0) != kids[k] || !WIFEXITED(status) ||
            WEXITSTATUS(status) != 0)
            fail("client process %d failed (status %#x)", k, status);
    }
    service_down(); /* --service: the resume is the daemon's restart */
    if (use_service) start_service(dir);
    if ((r = open_engine(dir, ZINF_OPEN_RESUME)) < 0) fail("resume: %s", zinf_strerror(r));
    for (int i = 0; i < NT; i++) {
        zinf_tensor h;
        if ((r = zinf_lookup(eng, tens[i].name, &h)) < 0)
            fail("lookup '%s' after the resume: %s", tens[i].name, zinf_strerror(r));
        atomic_store(&tens[i].h, h);
    }
    check_all("after the resume");
    zinf_close(eng);
    service_down();
    for (int i = 0; i < NT; i++) {
        free(tens[i].ref);
        pthread_rwlock_destroy(&tens[i].lk);
    }
    char cmd[4200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "stress_api: could not remove %s\n", dir);
    printf("# %lu operations in %.1f s%s%s, %llu flushes, %llu evictions, %llu tiers emptied "
           "for a set, every byte checked\n"
           "stress_api: 1 passed, 0 failed\n",
           (unsigned long)atomic_load(&ops), seconds, use_service ? " through the daemon" : "",
           clients > 1 ? " (this one of the client processes)" : "", (unsigned long long)st.flushes,
           (unsigned long long)(st.tier[0].evictions + st.tier[1].evictions),
           (unsigned long long)st.compactions);
    return 0;
}
