/*
 * test_engine.c - the swap manager (src/engine/) through the public API: a randomized
 * model-based test (several threads fetching, releasing clean and dirty, writing, reading
 * and prefetching tensors of odd sizes on all three homes under tiny budgets, every byte
 * compared with a reference copy, a watchdog against deadlocks), its deterministic
 * single-thread twin and a repeated-step run for the schedule; every error of the
 * contract beside its success twin, -EIO from injected faults included; pointer
 * semantics (repeated pins, pinned copies never evicted, async fetches, joined
 * transfers); tensors larger than the host tier; zeros at register; and at the end one
 * regression test per engine bug, named after what broke (a few reach into engine.h to
 * hold the engine in the state the bug needed).
 *
 * The device tier is emulated here, so device pointers are host memory the test reads.
 * Durability (flush, close, resume, crashes) is test_persist.c's.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "engine/engine.h"
#include "helpers.h"
#include "zinf.h"

#define BLOCK (64 * KiB)
#define QD 8

static char *dir;

static void setup(void)
{
    dir = test_tmpdir("engine");
    cr_assert_not_null(dir);
}

static void teardown(void)
{
    test_log_capture_stop();
    test_rmtree(dir);
    dir = NULL;
}

TestSuite(engine, .init = setup, .fini = teardown, .timeout = 120);

static zinf_engine *open_eng(size_t dev_bytes, size_t host_bytes, size_t block)
{
    struct zinf_options o = {.nvme_path = dir,
                             .device_bytes = dev_bytes,
                             .host_bytes = host_bytes,
                             .block_size = block,
                             .queue_depth = QD,
                             .device_kind = ZINF_DEVICE_EMULATED};
    zinf_engine *e = NULL;
    int r = zinf_open(&o, &e);
    cr_assert_eq(r, 0, "zinf_open: %s", zinf_strerror(r));
    cr_assert_not_null(e);
    return e;
}

static void put(zinf_engine *e, zinf_tensor t, const void *src, size_t n)
{
    int r = zinf_write(e, t, 0, src, n);
    cr_assert_eq(r, 0, "zinf_write: %s", zinf_strerror(r));
}

static bool all_zero(const unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i]) return false;
    return true;
}

static void expect_zero(zinf_engine *e, zinf_tensor t, size_t n, const char *what)
{
    unsigned char *z = calloc(1, n);
    cr_assert_not_null(z);
    test_expect_content(e, t, z, n, what);
    free(z);
}

static struct zinf_stats stats(zinf_engine *e)
{
    struct zinf_stats st;
    int r = zinf_stats(e, &st);
    cr_assert_eq(r, 0);
    return st;
}

static void check_budgets(zinf_engine *e)
{
    struct zinf_stats st = stats(e);
    for (int k = 0; k < 2; k++) {
        cr_assert_leq(st.tier[k].used_bytes, st.tier[k].capacity_bytes,
                      "tier %d: %llu bytes used of %llu", k,
                      (unsigned long long)st.tier[k].used_bytes,
                      (unsigned long long)st.tier[k].capacity_bytes);
        cr_assert_leq(st.tier[k].pinned_bytes, st.tier[k].used_bytes);
    }
}

/* ==== the randomized model-based test ================================================= */

#define MODEL_MAX_TENSORS 32
#define WATCHDOG_STALL_S 20

struct mtensor {
    char name[32];
    zinf_tensor h;
    size_t n;
    enum zinf_tier home;
    unsigned char *ref;  /* the reference content */
    pthread_rwlock_t lk; /* writers: content changes; readers: clean pins and reads */
};

struct model {
    zinf_engine *e;
    unsigned nthreads, ops;
    uint64_t seed;
    bool allow_enomem; /* several threads pin at once: a full tier is possible */
    unsigned nt;
    struct mtensor t[MODEL_MAX_TENSORS];
    atomic_uint_fast64_t progress[16]; /* operations finished, per thread */
    atomic_bool running[16];
    atomic_bool stop, done;
    atomic_uint_fast64_t enomem, fetches, dirty, writes, reads, prefetches, steps, flushes,
        reregisters;
    pthread_mutex_t fail_lock;
    char fail[1024]; /* the first failure seen by a worker */
};

#define MCHECK(m, cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            model_fail(m, __LINE__, __VA_ARGS__);                                                  \
            return;                                                                                \
        }                                                                                          \
    } while (0)

__attribute__((format(printf, 3, 4))) static void model_fail(struct model *m, int line,
                                                             const char *fmt, ...)
{
    pthread_mutex_lock(&m->fail_lock);
    if (!m->fail[0]) {
        int k = snprintf(m->fail, sizeof(m->fail), "line %d: ", line);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m->fail + k, sizeof(m->fail) - (size_t)k, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&m->fail_lock);
    atomic_store(&m->stop, true);
}

/* The engine's view of one tensor, for failure messages. */
static const char *describe(struct model *m, struct mtensor *mt, char *buf, size_t len)
{
    zinf_engine *e = m->e;
    pthread_mutex_lock(&e->lock);
    struct tensor *t = engine_tensor(e, mt->h);
    if (!t) {
        snprintf(buf, len, "%s: not registered", mt->name);
    } else {
        snprintf(buf, len,
                 "%s: %zu bytes, home %d, version %llu, zero %d; device: state %d "
                 "version %llu pins %u; host: state %d version %llu pins %u; swap %d at %llu "
                 "version %llu; persisted %d at %llu",
                 mt->name, t->nbytes, t->home, (unsigned long long)t->version, t->zero,
                 t->c[0].state, (unsigned long long)t->c[0].version, t->c[0].pins, t->c[1].state,
                 (unsigned long long)t->c[1].version, t->c[1].pins, t->has_swap,
                 (unsigned long long)t->swap_off, (unsigned long long)t->swap_version, t->persisted,
                 (unsigned long long)t->persisted_off);
    }
    pthread_mutex_unlock(&e->lock);
    return buf;
}

static size_t first_diff(const unsigned char *a, const unsigned char *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i]) return i;
    return n;
}

static void model_stats_ok(struct model *m)
{
    struct zinf_stats st;
    int r = zinf_stats(m->e, &st);
    MCHECK(m, r == 0, "zinf_stats: %d", r);
    for (int k = 0; k < 2; k++)
        MCHECK(m, st.tier[k].used_bytes <= st.tier[k].capacity_bytes,
               "tier %d holds %llu bytes over its budget of %llu", k,
               (unsigned long long)st.tier[k].used_bytes,
               (unsigned long long)st.tier[k].capacity_bytes);
}

static void rand_range(uint64_t *rs, size_t n, size_t *off, size_t *len)
{
    switch (test_rand(rs) % 4) {
    case 0: /* all of it */
        *off = 0;
        *len = n;
        break;
    case 1: { /* a few bytes */
        size_t few = 1 + test_rand(rs) % 7;
        *off = test_rand(rs) % n;
        *len = MIN(n - *off, few);
        break;
    }
    default:
        *off = test_rand(rs) % n;
        *len = 1 + test_rand(rs) % (n - *off);
        break;
    }
}

/* Fetch, compare with the reference, optionally write through the pointer and release
 * DIRTY. A fetch may find the tier full of other threads' pins: -ENOMEM. */
static void op_fetch(struct model *m, uint64_t *rs, struct mtensor *mt, int tier, bool dirty)
{
    void *p = NULL, *p2 = NULL;
    int r;

    if (dirty)
        pthread_rwlock_wrlock(&mt->lk);
    else
        pthread_rwlock_rdlock(&mt->lk);
    r = zinf_fetch(m->e, mt->h, tier, &p);
    atomic_fetch_add(&m->fetches, 1);
    if (r == -ENOMEM && m->allow_enomem) {
        atomic_fetch_add(&m->enomem, 1);
        goto out;
    }
    if (r != 0) {
        char desc[512];
        model_fail(m, __LINE__, "fetch to tier %d: %s (%s)", tier, zinf_strerror(r),
                   describe(m, mt, desc, sizeof(desc)));
        goto out;
    }
    size_t d = first_diff(p, mt->ref, mt->n);
    if (d != mt->n) {
        char desc[512];
        model_fail(m, __LINE__, "fetched in tier %d: byte %zu is %02x, want %02x (%s)", tier, d,
                   ((unsigned char *)p)[d], mt->ref[d], describe(m, mt, desc, sizeof(desc)));
        zinf_release(m->e, mt->h, tier, 0);
        goto out;
    }
    if (test_rand(rs) % 4 == 0) {
        /* A second pin of the same copy: the same pointer. */
        r = zinf_fetch(m->e, mt->h, tier, &p2);
        if (r != 0 || p2 != p) {
            model_fail(m, __LINE__, "second fetch: %s, %p vs %p", zinf_strerror(r), p2, p);
            zinf_release(m->e, mt->h, tier, 0);
            goto out;
        }
        r = zinf_release(m->e, mt->h, tier, 0);
        if (r != 0) {
            model_fail(m, __LINE__, "release of the second pin: %s", zinf_strerror(r));
            goto out;
        }
    }
    unsigned flags = 0;
    if (dirty) {
        size_t off, len;
        rand_range(rs, mt->n, &off, &len);
        test_fill_random((char *)p + off, len, test_rand(rs));
        memcpy(mt->ref + off, (char *)p + off, len);
        flags = ZINF_RELEASE_DIRTY;
        atomic_fetch_add(&m->dirty, 1);
    }
    r = zinf_release(m->e, mt->h, tier, flags);
    if (r != 0)
        model_fail(m, __LINE__, "release (flags %u) in tier %d: %s", flags, tier, zinf_strerror(r));
out:
    pthread_rwlock_unlock(&mt->lk);
}

/* Pin one tensor in both memory tiers at once (clean). */
static void op_fetch_both(struct model *m, struct mtensor *mt)
{
    void *pd = NULL, *ph = NULL;
    int rd, rh;

    pthread_rwlock_rdlock(&mt->lk);
    rd = zinf_fetch(m->e, mt->h, ZINF_TIER_DEVICE, &pd);
    rh = zinf_fetch(m->e, mt->h, ZINF_TIER_HOST, &ph);
    atomic_fetch_add(&m->fetches, 2);
    if ((rd != 0 && !(rd == -ENOMEM && m->allow_enomem)) ||
        (rh != 0 && !(rh == -ENOMEM && m->allow_enomem)))
        model_fail(m, __LINE__, "fetch to both tiers: device %s, host %s", zinf_strerror(rd),
                   zinf_strerror(rh));
    if (rd == -ENOMEM || rh == -ENOMEM) atomic_fetch_add(&m->enomem, 1);
    char desc[512];
    if (rd == 0 && first_diff(pd, mt->ref, mt->n) != mt->n)
        model_fail(m, __LINE__, "device copy differs at byte %zu (both pinned; %s)",
                   first_diff(pd, mt->ref, mt->n), describe(m, mt, desc, sizeof(desc)));
    if (rh == 0 && first_diff(ph, mt->ref, mt->n) != mt->n)
        model_fail(m, __LINE__, "host copy differs at byte %zu (both pinned; %s)",
                   first_diff(ph, mt->ref, mt->n), describe(m, mt, desc, sizeof(desc)));
    if (rd == 0 && rh == 0) {
        /* The other tier holds a pin: a DIRTY release is refused and keeps the pin. */
        int r = zinf_release(m->e, mt->h, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY);
        if (r != -EBUSY)
            model_fail(m, __LINE__, "DIRTY release while pinned in the other tier: %s",
                       zinf_strerror(r));
    }
    if (rd == 0 && (rd = zinf_release(m->e, mt->h, ZINF_TIER_DEVICE, 0)) != 0)
        model_fail(m, __LINE__, "release device: %s", zinf_strerror(rd));
    if (rh == 0 && (rh = zinf_release(m->e, mt->h, ZINF_TIER_HOST, 0)) != 0)
        model_fail(m, __LINE__, "release host: %s", zinf_strerror(rh));
    pthread_rwlock_unlock(&mt->lk);
}

static void op_write(struct model *m, uint64_t *rs, struct mtensor *mt)
{
    size_t off, len;
    rand_range(rs, mt->n, &off, &len);
    unsigned char *src = malloc(len);
    if (!src) {
        model_fail(m, __LINE__, "out of memory");
        return;
    }
    test_fill_random(src, len, test_rand(rs));
    pthread_rwlock_wrlock(&mt->lk);
    int r = zinf_write(m->e, mt->h, off, src, len);
    if (r == 0)
        memcpy(mt->ref + off, src, len);
    else
        model_fail(m, __LINE__, "zinf_write [%zu, +%zu) of %zu: %s", off, len, mt->n,
                   zinf_strerror(r));
    pthread_rwlock_unlock(&mt->lk);
    atomic_fetch_add(&m->writes, 1);
    free(src);
}

static void op_read(struct model *m, uint64_t *rs, struct mtensor *mt)
{
    size_t off, len;
    rand_range(rs, mt->n, &off, &len);
    unsigned char *dst = malloc(len);
    if (!dst) {
        model_fail(m, __LINE__, "out of memory");
        return;
    }
    pthread_rwlock_rdlock(&mt->lk);
    int r = zinf_read(m->e, mt->h, off, dst, len);
    if (r != 0)
        model_fail(m, __LINE__, "zinf_read [%zu, +%zu) of %zu: %s", off, len, mt->n,
                   zinf_strerror(r));
    else if (first_diff(dst, mt->ref + off, len) != len) {
        char desc[512];
        model_fail(m, __LINE__, "zinf_read [%zu, +%zu): byte %zu differs (%s)", off, len,
                   off + first_diff(dst, mt->ref + off, len), describe(m, mt, desc, sizeof(desc)));
    }
    pthread_rwlock_unlock(&mt->lk);
    atomic_fetch_add(&m->reads, 1);
    free(dst);
}

static void op_async(struct model *m, struct mtensor *mt, int tier)
{
    uint64_t ticket = 0;
    void *p = NULL;

    pthread_rwlock_rdlock(&mt->lk);
    int r = zinf_fetch_async(m->e, mt->h, tier, &ticket);
    atomic_fetch_add(&m->fetches, 1);
    if (r == 0) {
        r = zinf_wait(m->e, ticket, &p);
        if (r == 0) {
            if (first_diff(p, mt->ref, mt->n) != mt->n) {
                char desc[512];
                model_fail(m, __LINE__, "async fetch to tier %d: byte %zu differs (%s)", tier,
                           first_diff(p, mt->ref, mt->n), describe(m, mt, desc, sizeof(desc)));
            }
            if ((r = zinf_release(m->e, mt->h, tier, 0)) != 0)
                model_fail(m, __LINE__, "release after wait: %s", zinf_strerror(r));
            r = 0;
        }
    }
    if (r == -ENOMEM && m->allow_enomem)
        atomic_fetch_add(&m->enomem, 1);
    else if (r != 0)
        model_fail(m, __LINE__, "fetch_async/wait to tier %d: %s", tier, zinf_strerror(r));
    pthread_rwlock_unlock(&mt->lk);
}

/* Unregister the tensor and register it again under its name: it starts over as zeros.
 * Its home tier may be full of other threads' pins for a moment: -ENOSPC, try again. */
static void op_reregister(struct model *m, struct mtensor *mt)
{
    zinf_tensor h = 0;
    int r;

    pthread_rwlock_wrlock(&mt->lk);
    r = zinf_unregister(m->e, mt->h);
    if (r != 0) {
        model_fail(m, __LINE__, "unregister: %s", zinf_strerror(r));
        goto out;
    }
    r = zinf_lookup(m->e, mt->name, &h);
    if (r != -ENOENT) {
        model_fail(m, __LINE__, "lookup after unregister: %s", zinf_strerror(r));
        goto out;
    }
    for (int tries = 0; tries < 2000; tries++) {
        r = zinf_register(m->e, mt->name, mt->n, mt->home, &h);
        if (r != -ENOSPC || !m->allow_enomem) break;
        usleep(1000);
    }
    if (r != 0) {
        model_fail(m, __LINE__, "register again: %s", zinf_strerror(r));
        goto out;
    }
    mt->h = h;
    memset(mt->ref, 0, mt->n);
    atomic_fetch_add(&m->reregisters, 1);
out:
    pthread_rwlock_unlock(&mt->lk);
}

struct worker {
    struct model *m;
    unsigned id;
};

static void *model_worker(void *arg)
{
    struct worker *w = arg;
    struct model *m = w->m;
    uint64_t rs = m->seed * 1000003u + w->id;

    for (unsigned i = 0; i < m->ops && !atomic_load(&m->stop); i++) {
        struct mtensor *mt = &m->t[test_rand(&rs) % m->nt];
        int tier = (int)(test_rand(&rs) % 2);
        unsigned op = (unsigned)(test_rand(&rs) % 100);
        if (op < 20) {
            op_fetch(m, &rs, mt, tier, false);
        } else if (op < 38) {
            op_fetch(m, &rs, mt, tier, true);
        } else if (op < 45) {
            op_fetch_both(m, mt);
        } else if (op < 57) {
            op_write(m, &rs, mt);
        } else if (op < 70) {
            op_read(m, &rs, mt);
        } else if (op < 80) {
            pthread_rwlock_rdlock(&mt->lk); /* for the handle, which re-registering changes */
            int r = zinf_prefetch(m->e, mt->h, tier);
            pthread_rwlock_unlock(&mt->lk);
            if (r != 0) model_fail(m, __LINE__, "zinf_prefetch: %s", zinf_strerror(r));
            atomic_fetch_add(&m->prefetches, 1);
        } else if (op < 88) {
            op_async(m, mt, tier);
        } else if (op < 93) {
            int r = zinf_step(m->e);
            if (r != 0) model_fail(m, __LINE__, "zinf_step: %s", zinf_strerror(r));
            atomic_fetch_add(&m->steps, 1);
        } else if (op < 95) {
            int r = zinf_flush(m->e);
            if (r != 0) model_fail(m, __LINE__, "zinf_flush: %s", zinf_strerror(r));
            atomic_fetch_add(&m->flushes, 1);
        } else if (op < 97) {
            op_reregister(m, mt);
        } else {
            model_stats_ok(m);
        }
        atomic_fetch_add(&m->progress[w->id], 1);
    }
    atomic_store(&m->running[w->id], false);
    return NULL;
}

/* What the engine holds, for a deadlock report. Best effort: the lock may be the one that
 * is stuck. */
static void model_dump(struct model *m)
{
    zinf_engine *e = m->e;
    if (pthread_mutex_trylock(&e->lock) != 0) {
        fprintf(stderr, "  (the engine lock is held)\n");
        return;
    }
    fprintf(stderr, "  flushing %d, transfers in flight %u, staging queue %s\n", e->flushing,
            e->xfers_inflight, e->stage_waitq ? "waiting" : "empty");
    for (uint32_t i = 0; i < e->ntensors; i++) {
        struct tensor *t = e->tensors[i];
        if (!t) continue;
        fprintf(stderr,
                "  %s: version %llu, exclusive %d; device: state %d version %llu pins %u "
                "deferred %u readers %u wb %d evicting %d; host: state %d version %llu pins %u "
                "deferred %u readers %u wb %d evicting %d\n",
                t->name, (unsigned long long)t->version, t->exclusive, t->c[0].state,
                (unsigned long long)t->c[0].version, t->c[0].pins, t->c[0].deferred,
                t->c[0].readers, t->c[0].wb_inflight, t->c[0].evicting, t->c[1].state,
                (unsigned long long)t->c[1].version, t->c[1].pins, t->c[1].deferred,
                t->c[1].readers, t->c[1].wb_inflight, t->c[1].evicting);
    }
    pthread_mutex_unlock(&e->lock);
}

/* A thread that finishes no operation for WATCHDOG_STALL_S seconds is stuck: fail loudly
 * instead of hanging. */
static void *watchdog(void *arg)
{
    struct model *m = arg;
    uint64_t last[16] = {0};
    unsigned still[16] = {0};

    while (!atomic_load(&m->done)) {
        usleep(100 * 1000);
        for (unsigned i = 0; i < m->nthreads; i++) {
            uint64_t now = atomic_load(&m->progress[i]);
            if (now != last[i] || !atomic_load(&m->running[i])) {
                last[i] = now;
                still[i] = 0;
            } else if (++still[i] >= WATCHDOG_STALL_S * 10) {
                fprintf(stderr,
                        "engine model test: thread %u finished no operation for %d s "
                        "(after %llu): deadlock\n",
                        i, WATCHDOG_STALL_S, (unsigned long long)now);
                model_dump(m);
                fflush(stderr);
                abort();
            }
        }
    }
    return NULL;
}

/* Register the model's tensors: odd sizes, every home, a few sizes that are exact pages. */
static void model_setup(struct model *m, unsigned nt, unsigned ndev, unsigned nhost,
                        size_t max_bytes, size_t home_max_bytes)
{
    uint64_t rs = m->seed;
    m->nt = nt;
    pthread_mutex_init(&m->fail_lock, NULL);
    for (unsigned i = 0; i < nt; i++) {
        struct mtensor *mt = &m->t[i];
        char *name = mt->name;
        snprintf(name, sizeof(mt->name), "model.%u", i);
        mt->home = i < ndev ? ZINF_TIER_DEVICE : i < ndev + nhost ? ZINF_TIER_HOST : ZINF_TIER_NVME;
        size_t cap = mt->home == ZINF_TIER_NVME ? max_bytes : home_max_bytes;
        switch (i % 5) {
        case 0:
            mt->n = 1 + test_rand(&rs) % 64; /* a few bytes */
            break;
        case 1:
            mt->n = align_down(cap, ZINF_ALIGN); /* whole pages */
            break;
        default:
            mt->n = 1 + test_rand(&rs) % cap;
            if (mt->n % ZINF_ALIGN == 0) mt->n--;
            break;
        }
        mt->ref = calloc(1, mt->n);
        cr_assert_not_null(mt->ref);
        pthread_rwlock_init(&mt->lk, NULL);
        mt->h = test_register(m->e, name, mt->n, mt->home);
    }
}

static void model_run(struct model *m)
{
    pthread_t th[16], wd;
    struct worker w[16];

    cr_assert_leq(m->nthreads, 16);
    cr_assert_eq(pthread_create(&wd, NULL, watchdog, m), 0);
    for (unsigned i = 0; i < m->nthreads; i++)
        atomic_store(&m->running[i], true);
    for (unsigned i = 0; i < m->nthreads; i++) {
        w[i] = (struct worker){m, i};
        cr_assert_eq(pthread_create(&th[i], NULL, model_worker, &w[i]), 0);
    }
    for (unsigned i = 0; i < m->nthreads; i++)
        pthread_join(th[i], NULL);
    atomic_store(&m->done, true);
    pthread_join(wd, NULL);
    cr_assert(!m->fail[0], "%s", m->fail);

    /* Every tensor, once more, through every path. */
    for (unsigned i = 0; i < m->nt; i++) {
        struct mtensor *mt = &m->t[i];
        char what[64];
        snprintf(what, sizeof(what), "tensor %u (home %d, %zu bytes)", i, mt->home, mt->n);
        test_expect_content(m->e, mt->h, mt->ref, mt->n, what);
        for (int tier = 0; tier < 2; tier++) {
            void *p;
            int r = zinf_fetch(m->e, mt->h, tier, &p);
            cr_assert_eq(r, 0, "%s: final fetch to %d: %s", what, tier, zinf_strerror(r));
            cr_assert_eq(first_diff(p, mt->ref, mt->n), mt->n, "%s in tier %d", what, tier);
            cr_assert_eq(zinf_release(m->e, mt->h, tier, 0), 0);
        }
    }
    check_budgets(m->e);
    struct zinf_stats st = stats(m->e);
    cr_assert_eq(st.tier[0].pinned_bytes, 0);
    cr_assert_eq(st.tier[1].pinned_bytes, 0);
    cr_log_info("model: %u threads, %llu fetches (%llu -ENOMEM), %llu dirty, %llu writes, %llu "
                "reads, %llu prefetch hints, %llu steps, %llu flushes, %llu re-registers; "
                "evictions %llu/%llu, "
                "write-backs %llu/%llu, prefetches %llu (in time %llu)",
                m->nthreads, (unsigned long long)m->fetches, (unsigned long long)m->enomem,
                (unsigned long long)m->dirty, (unsigned long long)m->writes,
                (unsigned long long)m->reads, (unsigned long long)m->prefetches,
                (unsigned long long)m->steps, (unsigned long long)m->flushes,
                (unsigned long long)m->reregisters, (unsigned long long)st.tier[0].evictions,
                (unsigned long long)st.tier[1].evictions, (unsigned long long)st.tier[0].writebacks,
                (unsigned long long)st.tier[1].writebacks, (unsigned long long)st.prefetches,
                (unsigned long long)st.prefetch_in_time);
}

static void model_free(struct model *m)
{
    for (unsigned i = 0; i < m->nt; i++) {
        cr_assert_eq(zinf_unregister(m->e, m->t[i].h), 0);
        free(m->t[i].ref);
        pthread_rwlock_destroy(&m->t[i].lk);
    }
    pthread_mutex_destroy(&m->fail_lock);
    zinf_close(m->e);
    free(m);
}

Test(engine, model_threads)
{
    struct model *m = calloc(1, sizeof(*m));
    cr_assert_not_null(m);
    m->e = open_eng(2 * MiB, 2 * MiB, BLOCK);
    m->nthreads = 4;
    m->ops = 5000;
    m->seed = 0x5eed0001;
    m->allow_enomem = true;
    model_setup(m, 24, 3, 3, 256 * KiB, 96 * KiB);
    model_run(m);
    struct zinf_stats st = stats(m->e);
    cr_assert_gt(st.tier[0].evictions + st.tier[1].evictions, 0, "the budgets were not tight");
    cr_assert_lt(m->enomem * 20, m->fetches, "too many -ENOMEM: %llu of %llu fetches",
                 (unsigned long long)m->enomem, (unsigned long long)m->fetches);
    model_free(m);
}

/* Larger blocks and tensors of many blocks: device loads and write-backs stream through a
 * ring of few slots. */
Test(engine, model_threads_large_blocks)
{
    struct model *m = calloc(1, sizeof(*m));
    cr_assert_not_null(m);
    m->e = open_eng(3 * MiB, 2 * MiB, 256 * KiB);
    m->nthreads = 4;
    m->ops = 2500;
    m->seed = 0x5eed0002;
    m->allow_enomem = true;
    model_setup(m, 16, 2, 2, 600 * KiB, 128 * KiB);
    model_run(m);
    model_free(m);
}

Test(engine, model_single_thread_fixed_seed)
{
    struct model *m = calloc(1, sizeof(*m));
    cr_assert_not_null(m);
    m->e = open_eng(1 * MiB, 1 * MiB, BLOCK);
    m->nthreads = 1;
    m->ops = 6000;
    m->seed = 42;
    m->allow_enomem = false; /* one pin per tier at a time always fits */
    model_setup(m, 20, 2, 2, 200 * KiB, 64 * KiB);
    model_run(m);
    struct zinf_stats st = stats(m->e);
    cr_assert_gt(st.tier[0].evictions, 0);
    cr_assert_gt(st.tier[1].evictions, 0);
    cr_assert_gt(st.tier[0].writebacks + st.tier[1].writebacks, 0);
    model_free(m);
}

/* The same fetch order step after step: the schedule is learned, then replayed with
 * prefetches and eviction by next use, while some steps write. */
Test(engine, model_repeated_steps_use_the_schedule)
{
    enum { NL = 8, STEPS = 24 };
    zinf_engine *e = open_eng(1 * MiB, 1 * MiB, BLOCK);
    zinf_tensor h[NL];
    size_t n[NL];
    unsigned char *ref[NL];
    uint64_t rs = 7;

    for (int i = 0; i < NL; i++) {
        char name[16];
        snprintf(name, sizeof(name), "layer.%d", i);
        n[i] = 150 * KiB + 1 + test_rand(&rs) % (40 * KiB);
        ref[i] = test_rand_buf(n[i], 100 + i);
        h[i] = test_register(e, name, n[i], ZINF_TIER_NVME);
        put(e, h[i], ref[i], n[i]);
    }
    cr_assert_eq(zinf_step(e), 0);
    for (int s = 0; s < STEPS; s++) {
        /* forward on the device, then backward in reverse order, gradients on the host */
        for (int k = 0; k < 2 * NL; k++) {
            int i = k < NL ? k : 2 * NL - 1 - k;
            int tier = k < NL ? ZINF_TIER_DEVICE : ZINF_TIER_HOST;
            void *p;
            int r = zinf_fetch(e, h[i], tier, &p);
            cr_assert_eq(r, 0, "step %d, fetch %d: %s", s, k, zinf_strerror(r));
            cr_assert_eq(first_diff(p, ref[i], n[i]), n[i], "step %d, layer %d, tier %d", s, i,
                         tier);
            unsigned flags = 0;
            if (s % 3 == 2 && k >= NL) {
                size_t off = test_rand(&rs) % n[i];
                size_t len = 1 + test_rand(&rs) % (n[i] - off);
                test_fill_random((char *)p + off, len, test_rand(&rs));
                memcpy(ref[i] + off, (char *)p + off, len);
                flags = ZINF_RELEASE_DIRTY;
            }
            cr_assert_eq(zinf_release(e, h[i], tier, flags), 0);
        }
        cr_assert_eq(zinf_step(e), 0);
        check_budgets(e);
    }
    struct zinf_stats st = stats(e);
    cr_assert_gt(st.schedule_length, 0, "the schedule was not learned");
    cr_assert_eq(st.schedule_length, 2 * NL);
    cr_assert_gt(st.prefetches, 0, "nothing was prefetched from the schedule");
    cr_assert_gt(st.prefetch_in_time + st.prefetch_late, 0);
    cr_assert_gt(st.tier[0].evictions, 0);
    for (int i = 0; i < NL; i++) {
        test_expect_content(e, h[i], ref[i], n[i], "after the steps");
        free(ref[i]);
    }
    zinf_close(e);
}

/* Write-behind: once the step is learned and the host tier has had to evict, a DIRTY
 * release of a tensor the step does not fetch to the host again starts its write-back at
 * once. Meanwhile another thread flushes, reads and looks at the stats, and this one fetches
 * the tensor again, writes it again while its write-behind is in flight, and unregisters
 * one right after its release: nothing is lost, what a flush saved resumes, and a tier
 * that keeps everything never writes behind. */
struct wb_side {
    zinf_engine *e;
    atomic_bool stop;
    unsigned flushes, reads;
    zinf_tensor h[2];
    size_t n;
};

static void *wb_side(void *arg)
{
    struct wb_side *w = arg;
    unsigned char *buf = malloc(w->n);
    cr_assert_not_null(buf);
    /* At least one round, even where the steps ended before this thread first ran (a loaded
     * machine): the checks after the join want a flush and a read to have happened. */
    while (!atomic_load(&w->stop) || w->flushes == 0) {
        int r = zinf_flush(w->e);
        cr_assert_eq(r, 0, "flush during write-behinds: %s", zinf_strerror(r));
        w->flushes++;
        /* h[0] and h[1] are never written: their content is known whatever the steps do. */
        cr_assert_eq(zinf_read(w->e, w->h[w->reads & 1], 0, buf, w->n), 0);
        for (size_t i = 0; i < w->n; i++)
            cr_assert_eq(buf[i], (unsigned char)(w->reads & 1) + 1, "byte %zu", i);
        w->reads++;
        struct zinf_stats st;
        cr_assert_eq(zinf_stats(w->e, &st), 0);
    }
    free(buf);
    return NULL;
}

/* zero: every third fetch of the steps' tensors is released ZINF_RELEASE_ZERO instead (its
 * write-behind, a flush or the schedule's prefetch of it may be in flight): it reads as
 * zeros from then on. */
static void wb_steps(zinf_engine *e, int steps, uint64_t *behinds, bool zero)
{
    enum { NL = 10 };
    zinf_tensor h[NL], fixed[2];
    size_t n = 192 * KiB;
    unsigned char *ref[NL];
    for (int i = 0; i < NL; i++) {
        char name[16];
        snprintf(name, sizeof(name), "opt.%d", i);
        ref[i] = test_rand_buf(n, 300 + i);
        h[i] = test_register(e, name, n, ZINF_TIER_NVME);
        put(e, h[i], ref[i], n);
    }
    for (int i = 0; i < 2; i++) {
        char name[16];
        unsigned char *b = malloc(n);
        memset(b, i + 1, n);
        snprintf(name, sizeof(name), "fixed.%d", i);
        fixed[i] = test_register(e, name, n, ZINF_TIER_NVME);
        put(e, fixed[i], b, n);
        free(b);
    }
    struct wb_side side = {.e = e, .n = n, .h = {fixed[0], fixed[1]}};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, wb_side, &side), 0);
    uint64_t rs = 11;
    cr_assert_eq(zinf_step(e), 0);
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < NL; i++) {
            void *p;
            int r = zinf_fetch(e, h[i], ZINF_TIER_HOST, &p);
            cr_assert_eq(r, 0, "step %d, tensor %d: %s", s, i, zinf_strerror(r));
            cr_assert_eq(first_diff(p, ref[i], n), n, "step %d, tensor %d", s, i);
            if (zero && (s * NL + i) % 3 == 1) {
                r = zinf_release(e, h[i], ZINF_TIER_HOST, ZINF_RELEASE_ZERO);
                cr_assert_eq(r, 0, "step %d, tensor %d: %s", s, i, zinf_strerror(r));
                memset(ref[i], 0, n);
                continue;
            }
            if (zero && (s * NL + i) % 6 == 2) { /* released, then zeroed without a pin */
                cr_assert_eq(zinf_release(e, h[i], ZINF_TIER_HOST, 0), 0);
                r = zinf_zero(e, h[i]);
                cr_assert_eq(r, 0, "step %d, tensor %d: zinf_zero: %s", s, i, zinf_strerror(r));
                memset(ref[i], 0, n);
                continue;
            }
            size_t off = test_rand(&rs) % n, len = 1 + test_rand(&rs) % (n - off);
            test_fill_random((char *)p + off, len, test_rand(&rs));
            memcpy(ref[i] + off, (char *)p + off, len);
            cr_assert_eq(zinf_release(e, h[i], ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
            if (s == steps - 1 && i == 0) {
                /* Again at once, its write-behind likely in flight: a second version. */
                cr_assert_eq(zinf_write(e, h[0], 0, "again", 5), 0);
                memcpy(ref[0], "again", 5);
            }
        }
        cr_assert_eq(zinf_step(e), 0);
        check_budgets(e);
    }
    /* One released dirty and unregistered at once (its write-behind may be in flight). */
    void *p;
    cr_assert_eq(zinf_fetch(e, h[NL - 1], ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(zinf_release(e, h[NL - 1], ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
    cr_assert_eq(zinf_unregister(e, h[NL - 1]), 0);
    atomic_store(&side.stop, true);
    pthread_join(th, NULL);
    cr_assert_gt(side.flushes, 0);
    struct zinf_stats st = stats(e);
    *behinds = st.write_behinds;
    cr_assert_leq(st.write_behinds, st.tier[ZINF_TIER_HOST].writebacks);
    for (int i = 0; i < NL - 1; i++)
        test_expect_content(e, h[i], ref[i], n, "after write-behinds");
    cr_assert_eq(zinf_flush(e), 0);
    for (int i = 0; i < NL; i++)
        free(ref[i]);
}

Test(engine, write_behind_races_flush_read_rewrite_unregister)
{
    /* The host tier holds about half the tensors: it cycles. */
    zinf_engine *e = open_eng(1 * MiB, 1 * MiB, BLOCK);
    uint64_t behinds = 0;
    wb_steps(e, 6, &behinds, false);
    cr_assert_gt(behinds, 0, "a cycling tier wrote nothing behind");
    zinf_close(e);
}

/* The same with spent tensors released as zeros between the writes. */
Test(engine, zero_releases_racing_write_behinds_flushes_and_reads)
{
    zinf_engine *e = open_eng(1 * MiB, 1 * MiB, BLOCK);
    uint64_t behinds = 0;
    wb_steps(e, 6, &behinds, true);
    cr_assert_gt(behinds, 0, "a cycling tier wrote nothing behind");
    zinf_close(e);
}

/* A host tier that keeps every tensor evicts nothing: nothing is written behind. */
Test(engine, write_behind_not_where_the_tier_keeps_everything)
{
    zinf_engine *e = open_eng(1 * MiB, 8 * MiB, BLOCK);
    uint64_t behinds = 1;
    wb_steps(e, 6, &behinds, false);
    cr_assert_eq(behinds, 0, "%llu write-behinds in a tier that keeps everything",
                 (unsigned long long)behinds);
    zinf_close(e);
}

/* ==== errors, each beside its success ======================================================== */

Test(engine, open_bad_options)
{
    zinf_engine *e = (zinf_engine *)1;
    struct zinf_options o = {.device_kind = ZINF_DEVICE_EMULATED,
                             .device_bytes = MiB,
                             .host_bytes = MiB,
                             .block_size = BLOCK};

    cr_assert_eq(zinf_open(&o, NULL), -EINVAL);
    o.flags = 1u << 7;
    cr_assert_eq(zinf_open(&o, &e), -EINVAL, "unknown flag");
    cr_assert_null(e);
    o.flags = ZINF_OPEN_RESUME;
    cr_assert_eq(zinf_open(&o, &e), -EINVAL, "resume without an NVMe path");
    o.flags = 0;
    o.reserved[3] = 1;
    cr_assert_eq(zinf_open(&o, &e), -EINVAL, "reserved must be zero");
    o.reserved[3] = 0;
    o.block_size = 5000;
    cr_assert_eq(zinf_open(&o, &e), -EINVAL, "block size not a multiple of 4 KiB");
    o.block_size = BLOCK;
    o.device_kind = (enum zinf_device_kind)9;
    cr_assert_eq(zinf_open(&o, &e), -EINVAL);
    o.device_kind = ZINF_DEVICE_EMULATED;
    /* The success twin, without an NVMe tier. */
    cr_assert_eq(zinf_open(&o, &e), 0);
    cr_assert_not_null(e);
    zinf_tensor t;
    test_log_capture_start();
    cr_assert_eq(zinf_register(e, "x", 10, ZINF_TIER_NVME, &t), -EINVAL, "no NVMe tier");
    cr_assert(strstr(test_log_text(), "'x' is homed on NVMe, but this engine has no NVMe tier") &&
                  strstr(test_log_text(), "offload_param.nvme_path"),
              "the log names the missing setting: %s", test_log_text());
    test_log_capture_stop();
    cr_assert_eq(zinf_register(e, "x", 10, ZINF_TIER_HOST, &t), 0);
    cr_assert_eq(zinf_flush(e), 0, "nothing to be durable on");
    cr_assert_eq(zinf_unregister(e, t), 0);
    zinf_close(e);
    zinf_close(NULL);
}

Test(engine, null_arguments)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    zinf_tensor t = test_register(e, "t", 100, ZINF_TIER_NVME);
    void *p;
    uint64_t k;
    char buf[16] = {0};
    struct zinf_stats st;

    cr_assert_eq(zinf_register(NULL, "a", 1, ZINF_TIER_HOST, &t), -EINVAL);
    cr_assert_eq(zinf_register(e, NULL, 1, ZINF_TIER_HOST, &t), -EINVAL);
    cr_assert_eq(zinf_register(e, "", 1, ZINF_TIER_HOST, &t), -EINVAL);
    cr_assert_eq(zinf_register(e, "a", 1, ZINF_TIER_HOST, NULL), -EINVAL);
    cr_assert_eq(zinf_register(e, "a", 0, ZINF_TIER_HOST, &t), -EINVAL);
    cr_assert_eq(zinf_lookup(NULL, "t", &t), -EINVAL);
    cr_assert_eq(zinf_lookup(e, NULL, &t), -EINVAL);
    cr_assert_eq(zinf_lookup(e, "t", NULL), -EINVAL);
    cr_assert_eq(zinf_unregister(NULL, t), -EINVAL);
    cr_assert_eq(zinf_fetch(NULL, t, ZINF_TIER_HOST, &p), -EINVAL);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, NULL), -EINVAL);
    cr_assert_eq(zinf_fetch_async(NULL, t, ZINF_TIER_HOST, &k), -EINVAL);
    cr_assert_eq(zinf_fetch_async(e, t, ZINF_TIER_HOST, NULL), -EINVAL);
    cr_assert_eq(zinf_wait(NULL, 1, &p), -EINVAL);
    cr_assert_eq(zinf_release(NULL, t, ZINF_TIER_HOST, 0), -EINVAL);
    cr_assert_eq(zinf_prefetch(NULL, t, ZINF_TIER_HOST), -EINVAL);
    cr_assert_eq(zinf_step(NULL), -EINVAL);
    cr_assert_eq(zinf_write(NULL, t, 0, buf, 1), -EINVAL);
    cr_assert_eq(zinf_write(e, t, 0, NULL, 1), -EINVAL);
    cr_assert_eq(zinf_read(NULL, t, 0, buf, 1), -EINVAL);
    cr_assert_eq(zinf_read(e, t, 0, NULL, 1), -EINVAL);
    cr_assert_eq(zinf_flush(NULL), -EINVAL);
    cr_assert_eq(zinf_stats(NULL, &st), -EINVAL);
    cr_assert_eq(zinf_stats(e, NULL), -EINVAL);
    cr_assert_not_null(zinf_strerror(-EINVAL));
    cr_assert_not_null(zinf_strerror(-123456));
    cr_assert_not_null(zinf_strerror(0));

    /* The success twins. */
    cr_assert_eq(zinf_lookup(e, "t", &k), 0);
    cr_assert_eq(k, t);
    cr_assert_eq(zinf_write(e, t, 0, NULL, 0), 0, "an empty write needs no buffer");
    cr_assert_eq(zinf_read(e, t, 0, NULL, 0), 0);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(zinf_fetch_async(e, t, ZINF_TIER_DEVICE, &k), 0);
    cr_assert_eq(zinf_wait(e, k, NULL), -EINVAL);
    cr_assert_eq(zinf_wait(e, k, &p), 0, "a refused wait keeps the ticket");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_prefetch(e, t, ZINF_TIER_HOST), 0);
    cr_assert_eq(zinf_step(e), 0);
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tensors, 1);
    cr_assert_eq(zinf_unregister(e, t), 0);
    zinf_close(e);
}

/* Every call that takes a handle refuses one that was never returned or whose tensor is
 * gone, even once its slot has been reused. */
Test(engine, einval_bad_handles)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    zinf_tensor good = test_register(e, "good", 5000, ZINF_TIER_NVME);
    zinf_tensor gone = test_register(e, "gone", 5000, ZINF_TIER_HOST);
    cr_assert_eq(zinf_unregister(e, gone), 0);
    zinf_tensor reused = test_register(e, "reused", 5000, ZINF_TIER_HOST); /* likely gone's slot */
    zinf_tensor bad[] = {0, 12345, good + (1ull << 32), good + 1, ~0ull, gone};
    char buf[8] = {0};
    void *p;
    uint64_t k;

    for (size_t i = 0; i < ARRAY_SIZE(bad); i++) {
        zinf_tensor h = bad[i];
        if (h == reused) continue;
        cr_assert_eq(zinf_fetch(e, h, ZINF_TIER_HOST, &p), -EINVAL, "handle %#llx",
                     (unsigned long long)h);
        cr_assert_eq(zinf_fetch_async(e, h, ZINF_TIER_HOST, &k), -EINVAL);
        cr_assert_eq(zinf_release(e, h, ZINF_TIER_HOST, 0), -EINVAL);
        cr_assert_eq(zinf_prefetch(e, h, ZINF_TIER_HOST), -EINVAL);
        cr_assert_eq(zinf_write(e, h, 0, buf, 1), -EINVAL);
        cr_assert_eq(zinf_read(e, h, 0, buf, 1), -EINVAL);
        cr_assert_eq(zinf_unregister(e, h), -EINVAL);
    }
    cr_assert_eq(zinf_wait(e, 999, &p), -EINVAL, "a ticket never returned");
    /* Success twins. */
    cr_assert_eq(zinf_write(e, good, 0, buf, 1), 0);
    cr_assert_eq(zinf_read(e, reused, 0, buf, 1), 0);
    cr_assert_eq(zinf_unregister(e, good), 0);
    cr_assert_eq(zinf_unregister(e, good), -EINVAL, "twice");
    cr_assert_eq(zinf_unregister(e, reused), 0);
    zinf_close(e);
}

Test(engine, einval_release_without_pin_bad_tier_bad_flags)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    zinf_tensor t = test_register(e, "t", 3000, ZINF_TIER_NVME);
    void *p;
    uint64_t k;

    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), -EINVAL, "never pinned");
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_NVME, &p), -EINVAL, "NVMe is not a fetch target");
    cr_assert_eq(zinf_fetch(e, t, (enum zinf_tier)7, &p), -EINVAL);
    cr_assert_eq(zinf_fetch(e, t, (enum zinf_tier) - 1, &p), -EINVAL);
    cr_assert_eq(zinf_fetch_async(e, t, ZINF_TIER_NVME, &k), -EINVAL);
    cr_assert_eq(zinf_prefetch(e, t, ZINF_TIER_NVME), -EINVAL);
    cr_assert_eq(zinf_prefetch(e, t, (enum zinf_tier)3), -EINVAL);
    cr_assert_eq(zinf_register(e, "bad", 10, (enum zinf_tier)3, &k), -EINVAL);

    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), -EINVAL, "pinned in the other tier");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_NVME, 0), -EINVAL);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 4u), -EINVAL, "unknown flag");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY | ZINF_RELEASE_ZERO),
                 -EINVAL, "dirty and spent at once");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ~0u), -EINVAL);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_CLEAN), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), -EINVAL, "one pin, two releases");
    cr_assert_eq(stats(e).tier[ZINF_TIER_HOST].pinned_bytes, 0);
    cr_assert_eq(zinf_unregister(e, t), 0);
    zinf_close(e);
}

Test(engine, einval_out_of_range)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 10001;
    zinf_tensor t = test_register(e, "t", n, ZINF_TIER_NVME);
    unsigned char *buf = test_rand_buf(n + 10, 3);

    cr_assert_eq(zinf_write(e, t, 0, buf, n + 1), -EINVAL);
    cr_assert_eq(zinf_write(e, t, n, buf, 1), -EINVAL);
    cr_assert_eq(zinf_write(e, t, n + 1, buf, 0), -EINVAL);
    cr_assert_eq(zinf_write(e, t, 1, buf, SIZE_MAX), -EINVAL, "wraps around");
    cr_assert_eq(zinf_write(e, t, SIZE_MAX, buf, 2), -EINVAL);
    cr_assert_eq(zinf_read(e, t, 0, buf, n + 1), -EINVAL);
    cr_assert_eq(zinf_read(e, t, n - 1, buf, 2), -EINVAL);
    cr_assert_eq(zinf_read(e, t, 1, buf, SIZE_MAX), -EINVAL);
    expect_zero(e, t, n, "refused writes change nothing");
    /* Success twins: the last byte, and everything. */
    cr_assert_eq(zinf_write(e, t, n - 1, buf, 1), 0);
    cr_assert_eq(zinf_write(e, t, n, buf, 0), 0, "an empty write at the end");
    cr_assert_eq(zinf_write(e, t, 0, buf, n), 0);
    test_expect_content(e, t, buf, n, "whole write");
    cr_assert_eq(zinf_unregister(e, t), 0);
    free(buf);
    zinf_close(e);
}

Test(engine, enoent_and_eexist)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    zinf_tensor t, u = 77;

    cr_assert_eq(zinf_lookup(e, "w", &u), -ENOENT);
    cr_assert_eq(u, 77, "untouched on error");
    t = test_register(e, "w", 100, ZINF_TIER_HOST);
    cr_assert_eq(zinf_lookup(e, "w", &u), 0);
    cr_assert_eq(u, t);
    cr_assert_eq(zinf_register(e, "w", 100, ZINF_TIER_HOST, &u), -EEXIST);
    cr_assert_eq(zinf_register(e, "w", 999, ZINF_TIER_NVME, &u), -EEXIST, "whatever home");
    cr_assert_eq(zinf_lookup(e, "W", &u), -ENOENT, "names are exact");
    cr_assert_eq(stats(e).tensors, 1);
    cr_assert_eq(zinf_unregister(e, t), 0);
    cr_assert_eq(zinf_lookup(e, "w", &u), -ENOENT, "gone with unregister");
    cr_assert_eq(zinf_register(e, "w", 100, ZINF_TIER_HOST, &u), 0, "the name is free again");
    cr_assert_neq(u, t, "a new handle");
    cr_assert_eq(zinf_unregister(e, u), 0);
    /* Many names: the name table grows and still finds each one. */
    zinf_tensor hs[300];
    for (int i = 0; i < 300; i++) {
        char name[32];
        snprintf(name, sizeof(name), "many/%d", i);
        hs[i] = test_register(e, name, 1 + i, ZINF_TIER_NVME);
    }
    for (int i = 0; i < 300; i++) {
        char name[32];
        snprintf(name, sizeof(name), "many/%d", i);
        cr_assert_eq(zinf_lookup(e, name, &u), 0, "%s", name);
        cr_assert_eq(u, hs[i]);
    }
    for (int i = 0; i < 300; i++)
        cr_assert_eq(zinf_unregister(e, hs[i]), 0);
    zinf_close(e);
}

Test(engine, enospc_larger_than_home_tier)
{
    zinf_engine *e = open_eng(MiB, 2 * MiB, BLOCK);
    zinf_tensor t;

    cr_assert_eq(zinf_register(e, "d", MiB + 1, ZINF_TIER_DEVICE, &t), -ENOSPC);
    cr_assert_eq(zinf_register(e, "h", 2 * MiB + 1, ZINF_TIER_HOST, &t), -ENOSPC);
    cr_assert_eq(zinf_lookup(e, "d", &t), -ENOENT, "a refused register leaves nothing");
    cr_assert_eq(stats(e).tensors, 0);
    cr_assert_eq(stats(e).tier[0].used_bytes, 0);
    /* Exactly the capacity fits. */
    zinf_tensor d = test_register(e, "d", MiB, ZINF_TIER_DEVICE);
    zinf_tensor h = test_register(e, "h", 2 * MiB, ZINF_TIER_HOST);
    zinf_tensor n = test_register(e, "n", 5 * MiB, ZINF_TIER_NVME); /* NVMe grows */
    expect_zero(e, d, MiB, "device home");
    expect_zero(e, h, 2 * MiB, "host home");
    check_budgets(e);
    cr_assert_eq(zinf_unregister(e, d), 0);
    cr_assert_eq(zinf_unregister(e, h), 0);
    cr_assert_eq(zinf_unregister(e, n), 0);
    zinf_close(e);
}

Test(engine, enomem_when_pins_fill_the_tier)
{
    enum { N = 4 };
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    zinf_tensor t[N + 1];
    void *p[N + 1];
    unsigned char *ref[N + 1];

    for (int i = 0; i <= N; i++) {
        char name[16];
        snprintf(name, sizeof(name), "t%d", i);
        t[i] = test_register(e, name, 256 * KiB, ZINF_TIER_NVME);
        ref[i] = test_rand_buf(256 * KiB, 20 + i);
        put(e, t[i], ref[i], 256 * KiB);
    }
    for (int tier = 0; tier < 2; tier++) {
        for (int i = 0; i < N; i++)
            cr_assert_eq(zinf_fetch(e, t[i], tier, &p[i]), 0);
        struct zinf_stats st = stats(e);
        cr_assert_eq(st.tier[tier].pinned_bytes, MiB);
        void *q = (void *)1;
        cr_assert_eq(zinf_fetch(e, t[N], tier, &q), -ENOMEM, "tier %d", tier);
        /* The async twin reports it at once or from zinf_wait. */
        uint64_t tk;
        int r = zinf_fetch_async(e, t[N], tier, &tk);
        if (r == 0) r = zinf_wait(e, tk, &q);
        cr_assert_eq(r, -ENOMEM, "async: %s", zinf_strerror(r));
        cr_assert_eq(zinf_prefetch(e, t[N], tier), 0, "a hint that does not fit is dropped");
        for (int i = 0; i < N; i++)
            cr_assert_eq(memcmp(p[i], ref[i], 256 * KiB), 0, "pinned copies untouched");
        /* Free one pin: the same fetch now succeeds. */
        cr_assert_eq(zinf_release(e, t[0], tier, 0), 0);
        cr_assert_eq(zinf_fetch(e, t[N], tier, &q), 0);
        cr_assert_eq(memcmp(q, ref[N], 256 * KiB), 0);
        cr_assert_eq(zinf_release(e, t[N], tier, 0), 0);
        for (int i = 1; i < N; i++)
            cr_assert_eq(zinf_release(e, t[i], tier, 0), 0);
        check_budgets(e);
    }
    /* Larger than the whole tier: -ENOMEM at once. */
    zinf_tensor big = test_register(e, "big", MiB + 1, ZINF_TIER_NVME);
    void *q;
    cr_assert_eq(zinf_fetch(e, big, ZINF_TIER_HOST, &q), -ENOMEM);
    cr_assert_eq(zinf_unregister(e, big), 0);
    for (int i = 0; i <= N; i++) {
        test_expect_content(e, t[i], ref[i], 256 * KiB, "after -ENOMEM");
        cr_assert_eq(zinf_unregister(e, t[i]), 0);
        free(ref[i]);
    }
    zinf_close(e);
}

Test(engine, ebusy_dirty_release_pinned_in_other_tier)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 70000;
    zinf_tensor t = test_register(e, "t", n, ZINF_TIER_NVME);
    unsigned char *a = test_rand_buf(n, 1), *b = test_rand_buf(n, 2);
    void *pd, *ph;

    put(e, t, a, n);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &pd), 0);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &ph), 0);
    cr_assert_neq(pd, ph);
    memcpy(pd, b, n); /* a caller that wrote anyway */
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), -EBUSY);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), -EBUSY);
    struct zinf_stats st = stats(e);
    cr_assert_gt(st.tier[0].pinned_bytes, 0, "the pin is kept");
    cr_assert_gt(st.tier[1].pinned_bytes, 0);
    cr_assert_eq(memcmp(ph, a, n), 0, "the host view is unchanged");
    /* The kept pins release clean; the refused DIRTY made no new version. */
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), -EINVAL);
    /* Success twin: one tier pinned, DIRTY is accepted and wins everywhere. */
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &pd), 0);
    memcpy(pd, b, n);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    test_expect_content(e, t, b, n, "after the DIRTY release");
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &ph), 0);
    cr_assert_eq(memcmp(ph, b, n), 0, "the host copy follows the device's newest");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(zinf_unregister(e, t), 0);
    free(a);
    free(b);
    zinf_close(e);
}

/* ZINF_RELEASE_ZERO: a spent tensor's content becomes zeros without a byte read or written
 * (its newest content only in memory, or on the drive), and its next fetch to either tier
 * fills zeros without reading; the tensor then takes new content as ever, and a flush saves
 * it as a zero entry. Refused, with the pin kept and the content unchanged, for another
 * holder of either copy, a tensor not homed on NVMe, and DIRTY at once. */
Test(engine, zero_release_drops_the_content_without_moving_a_byte)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 300 * KiB + 5;
    zinf_tensor t = test_register(e, "g", n, ZINF_TIER_NVME);
    zinf_tensor hh = test_register(e, "hosted", 4096, ZINF_TIER_HOST);
    unsigned char *a = test_rand_buf(n, 7), *b = test_rand_buf(n, 8);
    void *p, *q;

    for (int round = 0; round < 4; round++) {
        int tier = round & 1;
        bool on_drive = round >= 2; /* else the newest content is only in memory */
        cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
        memcpy(p, round & 1 ? a : b, n);
        cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
        if (on_drive) cr_assert_eq(zinf_flush(e), 0);
        cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
        cr_assert_eq(memcmp(p, round & 1 ? a : b, n), 0, "round %d", round);
        struct zinf_stats s0 = stats(e);
        cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_ZERO), 0, "round %d", round);
        struct zinf_stats sz = stats(e);
        cr_assert_eq(sz.tier[tier].pinned_bytes, 0);
        cr_assert_leq(sz.tier[tier].used_bytes + n, s0.tier[tier].used_bytes,
                      "round %d: the spent copy is still held", round);
        for (int k = 0; k < 2; k++) {
            cr_assert_eq(zinf_fetch(e, t, k, &q), 0);
            cr_assert(all_zero(q, n), "round %d: tier %d after the zero release", round, k);
            cr_assert_eq(zinf_release(e, t, k, 0), 0);
        }
        expect_zero(e, t, n, "read after the zero release");
        struct zinf_stats s1 = stats(e);
        cr_assert_eq(s1.nvme_bytes_read, s0.nvme_bytes_read, "round %d: read the drive", round);
        cr_assert_eq(s1.nvme_bytes_written, s0.nvme_bytes_written, "round %d: wrote", round);
    }
    /* The flush saves a zero entry: no bytes. */
    struct zinf_stats s0 = stats(e);
    cr_assert_eq(zinf_flush(e), 0);
    cr_assert_eq(stats(e).nvme_bytes_written, s0.nvme_bytes_written, "a zero tensor flushed");
    expect_zero(e, t, n, "after the flush");

    /* Refused: the pin stays and the content is unchanged. */
    put(e, t, a, n);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &q), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_ZERO), -EBUSY, "other tier");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &q), 0);
    cr_assert_eq(q, p);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_ZERO), -EBUSY, "two pins");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY | ZINF_RELEASE_ZERO),
                 -EINVAL);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(memcmp(p, a, n), 0, "the refused releases changed the content");
    cr_assert_gt(stats(e).tier[ZINF_TIER_HOST].pinned_bytes, 0, "the pin is kept");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    test_expect_content(e, t, a, n, "after refused zero releases");
    cr_assert_eq(zinf_fetch(e, hh, ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(zinf_release(e, hh, ZINF_TIER_HOST, ZINF_RELEASE_ZERO), -EINVAL, "host home");
    cr_assert_eq(zinf_release(e, hh, ZINF_TIER_HOST, 0), 0);
    /* A zero release and at once new content, written back. */
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_ZERO), 0);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
    memcpy(p, b, n);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    cr_assert_eq(zinf_flush(e), 0);
    test_expect_content(e, t, b, n, "new content after a zero release");
    cr_assert_eq(zinf_unregister(e, t), 0);
    cr_assert_eq(zinf_unregister(e, hh), 0);
    free(a);
    free(b);
    zinf_close(e);
}

/* zinf_zero: the same without a pin, from every place the newest content can be. */
Test(engine, zinf_zero_drops_the_content_without_a_pin_or_a_byte_moved)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 300 * KiB + 5;
    zinf_tensor t = test_register(e, "g", n, ZINF_TIER_NVME);
    zinf_tensor hh = test_register(e, "hosted", 4096, ZINF_TIER_HOST);
    unsigned char *a = test_rand_buf(n, 17);
    void *p, *q;
    uint64_t k;

    /* 0: only in host memory; 1: only in device memory; 2: in both and on the drive; 3: only
     * on the drive; 4: a prefetch loading it from the drive. */
    for (int place = 0; place < 5; place++) {
        int tier = place == 1 ? ZINF_TIER_DEVICE : ZINF_TIER_HOST;
        cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
        memcpy(p, a, n);
        cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
        if (place == 2) {
            cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &q), 0);
            cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
        }
        if (place >= 2) cr_assert_eq(zinf_flush(e), 0);
        if (place >= 3) {
            /* Evict both copies: fill the tiers with another tensor. */
            zinf_tensor big = test_register(e, "room", 900 * KiB, ZINF_TIER_NVME);
            for (int i = 0; i < 2; i++) {
                cr_assert_eq(zinf_fetch(e, big, i, &q), 0);
                cr_assert_eq(zinf_release(e, big, i, 0), 0);
            }
            cr_assert_eq(zinf_unregister(e, big), 0);
            struct zinf_stats se = stats(e);
            cr_assert_lt(se.tier[0].used_bytes + se.tier[1].used_bytes, n, /* "hosted" */
                         "place %d: a copy is still there", place);
        }
        struct zinf_stats s0 = stats(e);
        if (place == 4) cr_assert_eq(zinf_prefetch(e, t, ZINF_TIER_HOST), 0);
        cr_assert_eq(zinf_zero(e, t), 0, "place %d", place);
        if (place < 3) {
            struct zinf_stats sz = stats(e);
            cr_assert_leq(sz.tier[tier].used_bytes + n, s0.tier[tier].used_bytes,
                          "place %d: the zeroed copy is still held", place);
        }
        for (int i = 0; i < 2; i++) {
            cr_assert_eq(zinf_fetch(e, t, i, &q), 0);
            cr_assert(all_zero(q, n), "place %d: tier %d after zinf_zero", place, i);
            cr_assert_eq(zinf_release(e, t, i, 0), 0);
        }
        expect_zero(e, t, n, "read after zinf_zero");
        struct zinf_stats s1 = stats(e);
        if (place < 4)
            cr_assert_eq(s1.nvme_bytes_read, s0.nvme_bytes_read, "place %d: read", place);
        cr_assert_eq(s1.nvme_bytes_written, s0.nvme_bytes_written, "place %d: wrote", place);
    }
    struct zinf_stats s0 = stats(e);
    cr_assert_eq(zinf_flush(e), 0);
    cr_assert_eq(stats(e).nvme_bytes_written, s0.nvme_bytes_written, "a zero tensor flushed");

    /* Refused, the content unchanged: a pin in either tier, an async fetch not waited for,
     * a home in memory, a handle that names nothing. */
    put(e, t, a, n);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(zinf_fetch(e, t, i, &p), 0);
        cr_assert_eq(zinf_zero(e, t), -EBUSY, "pinned in tier %d", i);
        cr_assert_eq(zinf_release(e, t, i, 0), 0);
    }
    cr_assert_eq(zinf_fetch_async(e, t, ZINF_TIER_DEVICE, &k), 0);
    cr_assert_eq(zinf_zero(e, t), -EBUSY, "an async fetch");
    cr_assert_eq(zinf_wait(e, k, &p), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_zero(e, hh), -EINVAL, "host home");
    cr_assert_eq(zinf_zero(e, t + 1000), -EINVAL, "no such tensor");
    cr_assert_eq(zinf_zero(NULL, t), -EINVAL);
    test_expect_content(e, t, a, n, "after refused zinf_zero calls");
    /* Its success twin, then new content, written back as ever. */
    cr_assert_eq(zinf_zero(e, t), 0);
    expect_zero(e, t, n, "after zinf_zero");
    put(e, t, a, n);
    cr_assert_eq(zinf_flush(e), 0);
    test_expect_content(e, t, a, n, "new content after zinf_zero");
    cr_assert_eq(zinf_unregister(e, t), 0);
    cr_assert_eq(zinf_unregister(e, hh), 0);
    free(a);
    zinf_close(e);
}

Test(engine, ebusy_unregister_while_pinned)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    zinf_tensor t = test_register(e, "t", 9000, ZINF_TIER_DEVICE);
    void *p;
    uint64_t k;

    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(zinf_unregister(e, t), -EBUSY);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(zinf_fetch_async(e, t, ZINF_TIER_DEVICE, &k), 0);
    cr_assert_eq(zinf_unregister(e, t), -EBUSY, "an async fetch holds a pin");
    cr_assert_eq(zinf_wait(e, k, &p), 0);
    cr_assert_eq(zinf_unregister(e, t), -EBUSY);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_unregister(e, t), 0);
    cr_assert_eq(stats(e).tier[0].used_bytes, 0);
    cr_assert_eq(stats(e).tier[1].used_bytes, 0);
    zinf_close(e);
}

/* ---- -EIO from injected faults: the data stays as it was and the engine keeps working ---- */

static zinf_tensor nvme_tensor_with(zinf_engine *e, const char *name, const unsigned char *c,
                                    size_t n)
{
    zinf_tensor t = test_register(e, name, n, ZINF_TIER_NVME);
    put(e, t, c, n);
    return t;
}

Test(engine, eio_fetch_from_nvme)
{
    zinf_engine *e = open_eng(2 * MiB, MiB, BLOCK);
    const size_t n = 300 * KiB + 5; /* several chunks */
    unsigned char *a = test_rand_buf(n, 11);
    void *p;

    for (int tier = 0; tier < 2; tier++) {
        for (unsigned nth = 1; nth <= 3; nth += 2) {
            /* A fresh tensor: no copy in memory, the load reads NVMe. */
            zinf_tensor t = nvme_tensor_with(e, "t", a, n);
            uring_fault_set(e->io, URING_FAULT_EIO, nth);
            int r = zinf_fetch(e, t, tier, &p);
            cr_assert_eq(r, -EIO, "tier %d, chunk %u fails: %s", tier, nth, zinf_strerror(r));
            struct zinf_stats st = stats(e);
            cr_assert_eq(st.tier[tier].pinned_bytes, 0, "a failed fetch holds no pin");
            cr_assert_eq(zinf_release(e, t, tier, 0), -EINVAL);
            test_expect_content(e, t, a, n, "after a failed fetch");
            /* The same fetch again. */
            cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
            cr_assert_eq(memcmp(p, a, n), 0);
            cr_assert_eq(zinf_release(e, t, tier, 0), 0);
            cr_assert_eq(zinf_unregister(e, t), 0);
        }
    }
    /* Async: the error comes from zinf_wait. */
    zinf_tensor u = nvme_tensor_with(e, "u", a, n);
    uring_fault_set(e->io, URING_FAULT_EIO, 1);
    uint64_t k;
    int r = zinf_fetch_async(e, u, ZINF_TIER_HOST, &k);
    cr_assert_eq(r, 0);
    cr_assert_eq(zinf_wait(e, k, &p), -EIO);
    cr_assert_eq(stats(e).tier[ZINF_TIER_HOST].pinned_bytes, 0);
    cr_assert_eq(zinf_fetch(e, u, ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(memcmp(p, a, n), 0);
    cr_assert_eq(zinf_release(e, u, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(zinf_unregister(e, u), 0);
    free(a);
    zinf_close(e);
}

Test(engine, eio_device_copy_of_a_host_tensor)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 50000;
    unsigned char *a = test_rand_buf(n, 12);
    zinf_tensor t = test_register(e, "t", n, ZINF_TIER_HOST);
    void *p;

    put(e, t, a, n);
    device_fault_set(e->dev, 1, -EIO);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), -EIO);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(memcmp(p, a, n), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    test_expect_content(e, t, a, n, "host home");
    cr_assert_eq(zinf_unregister(e, t), 0);
    free(a);
    zinf_close(e);
}

/* A dirty copy must be written back to make room; the write-back fails once. The copy
 * and its content survive, and the tensor still reads its newest bytes. */
static void eio_writeback(int tier, enum zinf_tier home, bool device_fault)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 400 * KiB + 77;
    unsigned char *a = test_rand_buf(n, 13), *b = test_rand_buf(n, 14), *f = test_rand_buf(700 * KiB, 15);
    zinf_tensor t = test_register(e, "t", n, home);
    zinf_tensor filler = nvme_tensor_with(e, "filler", f, 700 * KiB);
    void *p;

    put(e, t, a, n);
    cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
    memcpy(p, b, n);
    cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
    if (device_fault)
        device_fault_set(e->dev, 1, -EIO);
    else
        uring_fault_set(e->io, URING_FAULT_EIO, 1);
    test_log_capture_start();
    int r = zinf_fetch(e, filler, tier, &p);
    /* The fetch may retry the write-back and succeed, or report the error; either way
     * nothing is lost. */
    cr_assert(r == 0 || r == -EIO, "fetch that needs the write-back: %s", zinf_strerror(r));
    if (r == 0) {
        cr_assert_eq(memcmp(p, f, 700 * KiB), 0);
        cr_assert_eq(zinf_release(e, filler, tier, 0), 0);
    }
    cr_assert(strstr(test_log_text(), "'t'"), "the failed write-back is logged: %s",
              test_log_text());
    test_log_capture_stop();
    test_expect_content(e, t, b, n, "dirty tensor after a failed write-back");
    cr_assert_eq(zinf_fetch(e, filler, tier, &p), 0);
    cr_assert_eq(memcmp(p, f, 700 * KiB), 0);
    cr_assert_eq(zinf_release(e, filler, tier, 0), 0);
    test_expect_content(e, t, b, n, "dirty tensor once evicted");
    cr_assert_eq(zinf_fetch(e, t, 1 - tier, &p), 0);
    cr_assert_eq(memcmp(p, b, n), 0);
    cr_assert_eq(zinf_release(e, t, 1 - tier, 0), 0);
    check_budgets(e);
    cr_assert_eq(zinf_unregister(e, t), 0);
    cr_assert_eq(zinf_unregister(e, filler), 0);
    free(a);
    free(b);
    free(f);
    zinf_close(e);
}

Test(engine, eio_writeback_host_to_nvme)
{
    eio_writeback(ZINF_TIER_HOST, ZINF_TIER_NVME, false);
}

Test(engine, eio_writeback_device_to_nvme)
{
    eio_writeback(ZINF_TIER_DEVICE, ZINF_TIER_NVME, false);
}

Test(engine, eio_writeback_device_to_host_home)
{
    eio_writeback(ZINF_TIER_DEVICE, ZINF_TIER_HOST, true);
}

Test(engine, eio_flush)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 200 * KiB + 3;
    unsigned char *a = test_rand_buf(n, 16), *b = test_rand_buf(n, 17);
    zinf_tensor t = nvme_tensor_with(e, "t", a, n);
    zinf_tensor d = test_register(e, "d", n, ZINF_TIER_DEVICE);
    void *p;

    put(e, d, a, n);
    cr_assert_eq(zinf_flush(e), 0);
    for (int tier = 0; tier < 2; tier++) {
        cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
        memcpy(p, b, n);
        cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
        put(e, d, b, n);
        uring_fault_set(e->io, URING_FAULT_EIO, 2);
        int r = zinf_flush(e);
        cr_assert_eq(r, -EIO, "tier %d: %s", tier, zinf_strerror(r));
        test_expect_content(e, t, b, n, "after a failed flush");
        test_expect_content(e, d, b, n, "device home after a failed flush");
        cr_assert_eq(zinf_flush(e), 0, "the same flush again");
        test_expect_content(e, t, b, n, "after the flush");
        test_expect_content(e, d, b, n, "device home after the flush");
        memcpy(a, b, n);
        test_fill_random(b, n, 100 + tier);
    }
    cr_assert_eq(zinf_unregister(e, t), 0);
    cr_assert_eq(zinf_unregister(e, d), 0);
    free(a);
    free(b);
    zinf_close(e);
}

Test(engine, eio_write)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 100 * KiB + 9;
    unsigned char *a = test_rand_buf(n, 18), *b = test_rand_buf(n, 19);
    zinf_tensor t = nvme_tensor_with(e, "t", a, n);
    void *p;

    /* Only the swap extent holds it: the read or the write of the swap range fails. */
    for (unsigned nth = 1; nth <= 2; nth++) {
        uring_fault_set(e->io, URING_FAULT_EIO, nth);
        int r = zinf_write(e, t, 5000, b, 20000);
        cr_assert_eq(r, -EIO, "fault on IO %u: %s", nth, zinf_strerror(r));
        test_expect_content(e, t, a, n, "swap-only tensor after a failed write");
    }
    /* After a flush the extent is the persisted one: the write goes to a new extent,
     * streamed in one read and one write of two 64 KiB chunks each; a fault on any of the
     * four leaves the tensor as it was. */
    cr_assert_eq(zinf_flush(e), 0);
    for (unsigned nth = 1; nth <= 4; nth++) {
        uring_fault_set(e->io, URING_FAULT_EIO, nth);
        int r = zinf_write(e, t, 5000, b, 20000);
        cr_assert_eq(r, -EIO, "fault on IO %u: %s", nth, zinf_strerror(r));
        test_expect_content(e, t, a, n, "persisted tensor after a failed write");
    }
    /* A device copy takes the write: the device copy fails. */
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    device_fault_set(e->dev, 1, -EIO);
    cr_assert_eq(zinf_write(e, t, 0, b, n), -EIO);
    test_expect_content(e, t, a, n, "device-cached tensor after a failed write");
    /* Success twin. */
    cr_assert_eq(zinf_write(e, t, 0, b, n), 0);
    test_expect_content(e, t, b, n, "after the write");
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(memcmp(p, b, n), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(zinf_unregister(e, t), 0);
    free(a);
    free(b);
    zinf_close(e);
}

/* ==== pointer semantics ======================================================================= */

Test(engine, same_tier_fetch_same_pointer_two_releases)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 12345;
    unsigned char *a = test_rand_buf(n, 21);
    zinf_tensor t = nvme_tensor_with(e, "t", a, n);
    void *p1, *p2, *p3;

    for (int tier = 0; tier < 2; tier++) {
        cr_assert_eq(zinf_fetch(e, t, tier, &p1), 0);
        cr_assert_eq(zinf_fetch(e, t, tier, &p2), 0);
        cr_assert_eq(p1, p2);
        uint64_t k;
        cr_assert_eq(zinf_fetch_async(e, t, tier, &k), 0);
        cr_assert_eq(zinf_wait(e, k, &p3), 0);
        cr_assert_eq(p3, p1);
        cr_assert_eq(memcmp(p1, a, n), 0);
        struct zinf_stats st = stats(e);
        cr_assert_eq(st.tier[tier].pinned_bytes, align_up(n, ZINF_ALIGN));
        cr_assert_geq(st.tier[tier].hits, 2);
        cr_assert_eq(zinf_release(e, t, tier, 0), 0);
        cr_assert_eq(zinf_release(e, t, tier, 0), 0);
        cr_assert_eq(stats(e).tier[tier].pinned_bytes, align_up(n, ZINF_ALIGN), "one pin left");
        cr_assert_eq(zinf_release(e, t, tier, 0), 0);
        cr_assert_eq(stats(e).tier[tier].pinned_bytes, 0);
        cr_assert_eq(zinf_release(e, t, tier, 0), -EINVAL);
    }
    cr_assert_eq(zinf_unregister(e, t), 0);
    free(a);
    zinf_close(e);
}

Test(engine, pinned_copies_are_never_evicted)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 200 * KiB + 1;
    unsigned char *a = test_rand_buf(n, 22), *f[10];
    zinf_tensor t = nvme_tensor_with(e, "pinned", a, n);
    zinf_tensor fill[10];
    void *pd, *ph, *q;

    for (int i = 0; i < 10; i++) {
        char name[16];
        snprintf(name, sizeof(name), "fill%d", i);
        f[i] = test_rand_buf(n, 23 + i);
        fill[i] = nvme_tensor_with(e, name, f[i], n);
    }
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &pd), 0);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &ph), 0);
    for (int round = 0; round < 3; round++) {
        for (int tier = 0; tier < 2; tier++) {
            for (int i = 0; i < 10; i++) {
                cr_assert_eq(zinf_fetch(e, fill[i], tier, &q), 0);
                cr_assert_eq(memcmp(q, f[i], n), 0, "filler %d, tier %d, round %d", i, tier, round);
                memset(q, round + tier, 100);
                cr_assert_eq(zinf_release(e, fill[i], tier, ZINF_RELEASE_DIRTY), 0);
                memset(f[i], round + tier, 100);
            }
        }
        cr_assert_eq(memcmp(pd, a, n), 0, "the pinned device copy is intact");
        cr_assert_eq(memcmp(ph, a, n), 0, "the pinned host copy is intact");
    }
    struct zinf_stats st = stats(e);
    cr_assert_gt(st.tier[0].evictions, 10);
    cr_assert_gt(st.tier[1].evictions, 10);
    void *again;
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &again), 0);
    cr_assert_eq(again, pd, "unmoved");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    for (int i = 0; i < 10; i++) {
        test_expect_content(e, fill[i], f[i], n, "filler");
        cr_assert_eq(zinf_unregister(e, fill[i]), 0);
        free(f[i]);
    }
    cr_assert_eq(zinf_unregister(e, t), 0);
    free(a);
    zinf_close(e);
}

Test(engine, fetch_async_and_wait)
{
    zinf_engine *e = open_eng(2 * MiB, 2 * MiB, BLOCK);
    enum { N = 5 };
    const size_t n = 150 * KiB + 11;
    zinf_tensor t[N];
    unsigned char *a[N];
    uint64_t k[N][2];
    void *p;

    for (int i = 0; i < N; i++) {
        char name[16];
        snprintf(name, sizeof(name), "a%d", i);
        a[i] = test_rand_buf(n, 30 + i);
        t[i] = nvme_tensor_with(e, name, a[i], n);
    }
    /* Start all the loads, then wait for them in reverse order. */
    for (int i = 0; i < N; i++)
        for (int tier = 0; tier < 2; tier++)
            cr_assert_eq(zinf_fetch_async(e, t[i], tier, &k[i][tier]), 0);
    for (int i = N - 1; i >= 0; i--) {
        for (int tier = 1; tier >= 0; tier--) {
            cr_assert_eq(zinf_wait(e, k[i][tier], &p), 0);
            cr_assert_eq(memcmp(p, a[i], n), 0, "tensor %d tier %d", i, tier);
            cr_assert_eq(zinf_wait(e, k[i][tier], &p), -EINVAL, "a ticket is used once");
        }
    }
    for (int i = 0; i < N; i++)
        for (int tier = 0; tier < 2; tier++)
            cr_assert_eq(zinf_release(e, t[i], tier, 0), 0);
    cr_assert_eq(stats(e).tier[0].pinned_bytes + stats(e).tier[1].pinned_bytes, 0);
    for (int i = 0; i < N; i++) {
        cr_assert_eq(zinf_unregister(e, t[i]), 0);
        free(a[i]);
    }
    zinf_close(e);
}

struct joiner {
    zinf_engine *e;
    zinf_tensor t;
    int tier;
    pthread_barrier_t *bar;
    void *p;
    int r;
};

static void *join_fetch(void *arg)
{
    struct joiner *j = arg;
    pthread_barrier_wait(j->bar);
    j->r = zinf_fetch(j->e, j->t, j->tier, &j->p);
    return NULL;
}

Test(engine, concurrent_fetches_join_one_transfer)
{
    enum { T = 4 };
    zinf_engine *e = open_eng(4 * MiB, 4 * MiB, BLOCK);
    const size_t n = 2 * MiB + 99;
    unsigned char *a = test_rand_buf(n, 40);
    pthread_barrier_t bar;
    pthread_t th[T];
    struct joiner j[T];

    for (int tier = 0; tier < 2; tier++) {
        char name[16];
        snprintf(name, sizeof(name), "shared%d", tier);
        zinf_tensor t = nvme_tensor_with(e, name, a, n);
        struct zinf_stats before = stats(e);
        pthread_barrier_init(&bar, NULL, T);
        for (int i = 0; i < T; i++) {
            j[i] = (struct joiner){.e = e, .t = t, .tier = tier, .bar = &bar};
            cr_assert_eq(pthread_create(&th[i], NULL, join_fetch, &j[i]), 0);
        }
        for (int i = 0; i < T; i++)
            pthread_join(th[i], NULL);
        pthread_barrier_destroy(&bar);
        for (int i = 0; i < T; i++) {
            cr_assert_eq(j[i].r, 0, "thread %d: %s", i, zinf_strerror(j[i].r));
            cr_assert_eq(j[i].p, j[0].p, "one copy for everyone");
        }
        cr_assert_eq(memcmp(j[0].p, a, n), 0);
        struct zinf_stats after = stats(e);
        cr_assert_eq(after.nvme_bytes_read - before.nvme_bytes_read, align_up(n, ZINF_ALIGN),
                     "tier %d: one load's worth read, not %llu", tier,
                     (unsigned long long)(after.nvme_bytes_read - before.nvme_bytes_read));
        cr_assert_eq(after.tier[tier].fetches - before.tier[tier].fetches, T);
        for (int i = 0; i < T; i++)
            cr_assert_eq(zinf_release(e, t, tier, 0), 0);
        cr_assert_eq(zinf_release(e, t, tier, 0), -EINVAL, "exactly T pins");
        cr_assert_eq(zinf_unregister(e, t), 0);
    }
    free(a);
    zinf_close(e);
}

/* ==== sizes and homes ========================================================================= */

Test(engine, tensor_larger_than_host_streams_to_device)
{
    zinf_engine *e = open_eng(8 * MiB, MiB, BLOCK);
    const size_t n = 5 * MiB + 123;
    unsigned char *a = test_rand_buf(n, 50), *b = test_rand_buf(n, 51);
    zinf_tensor t = nvme_tensor_with(e, "big", a, n);
    zinf_tensor u = nvme_tensor_with(e, "big2", b, n);
    void *p;

    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), -ENOMEM, "larger than the host tier");
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(memcmp(p, a, n), 0);
    /* Change it on the device; pushing it out writes it back through the staging ring. */
    test_fill_random((char *)p + MiB, 2 * MiB + 7, 52);
    memcpy(a + MiB, (char *)p + MiB, 2 * MiB + 7);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    cr_assert_eq(zinf_fetch(e, u, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(memcmp(p, b, n), 0);
    cr_assert_eq(zinf_release(e, u, ZINF_TIER_DEVICE, 0), 0);
    struct zinf_stats st = stats(e);
    cr_assert_geq(st.tier[0].writebacks, 1);
    cr_assert_geq(st.tier[0].evictions, 1);
    test_expect_content(e, t, a, n, "written back");
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(memcmp(p, a, n), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    /* A device-home tensor larger than the host tier: zeros, then a write and a flush. */
    zinf_tensor d = test_register(e, "dhome", 2 * MiB + 1, ZINF_TIER_DEVICE);
    expect_zero(e, d, 2 * MiB + 1, "device home");
    cr_assert_eq(zinf_write(e, d, 0, b, 2 * MiB + 1), 0);
    cr_assert_eq(zinf_flush(e), 0);
    test_expect_content(e, d, b, 2 * MiB + 1, "device home after flush");
    check_budgets(e);
    cr_assert_eq(zinf_unregister(e, t), 0);
    cr_assert_eq(zinf_unregister(e, u), 0);
    cr_assert_eq(zinf_unregister(e, d), 0);
    free(a);
    free(b);
    zinf_close(e);
}

Test(engine, every_home_round_trip)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 77777;
    enum zinf_tier homes[] = {ZINF_TIER_DEVICE, ZINF_TIER_HOST, ZINF_TIER_NVME};

    for (size_t i = 0; i < ARRAY_SIZE(homes); i++) {
        unsigned char *a = test_rand_buf(n, 60 + i), *b = test_rand_buf(n, 70 + i);
        char name[16];
        snprintf(name, sizeof(name), "home%zu", i);
        zinf_tensor t = test_register(e, name, n, homes[i]);
        void *p, *q;
        /* zeros in both tiers */
        for (int tier = 0; tier < 2; tier++) {
            cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
            cr_assert(all_zero(p, n), "home %d, tier %d", homes[i], tier);
            cr_assert_eq(zinf_release(e, t, tier, 0), 0);
        }
        put(e, t, a, n);
        /* the write is seen from both tiers; a DIRTY release on one is seen from the other */
        for (int tier = 0; tier < 2; tier++) {
            cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
            cr_assert_eq(memcmp(p, a, n), 0, "home %d tier %d", homes[i], tier);
            memcpy(p, b, n / 2);
            memcpy(a, b, n / 2);
            cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
            cr_assert_eq(zinf_fetch(e, t, 1 - tier, &q), 0);
            cr_assert_eq(memcmp(q, a, n), 0, "home %d, dirty in %d, seen in %d", homes[i], tier,
                         1 - tier);
            cr_assert_eq(zinf_release(e, t, 1 - tier, 0), 0);
            test_fill_random(b, n, 80 + tier);
        }
        test_expect_content(e, t, a, n, "zinf_read");
        /* partial writes and reads at odd offsets */
        cr_assert_eq(zinf_write(e, t, 4095, b, 3), 0);
        memcpy(a + 4095, b, 3);
        unsigned char small[5];
        cr_assert_eq(zinf_read(e, t, 4094, small, 5), 0);
        cr_assert_eq(memcmp(small, a + 4094, 5), 0);
        test_expect_content(e, t, a, n, "after a partial write");
        cr_assert_eq(zinf_unregister(e, t), 0);
        free(a);
        free(b);
    }
    check_budgets(e);
    zinf_close(e);
}

/* A new tensor reads as zeros, even where the tier or swap space it lands on held another
 * tensor's bytes a moment ago. */
Test(engine, zero_content_at_register_every_home)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    enum zinf_tier homes[] = {ZINF_TIER_DEVICE, ZINF_TIER_HOST, ZINF_TIER_NVME};
    const size_t n = 300 * KiB + 1;
    unsigned char *junk = malloc(n);
    memset(junk, 0xa5, n);

    for (size_t i = 0; i < ARRAY_SIZE(homes); i++) {
        for (int round = 0; round < 2; round++) {
            zinf_tensor t = test_register(e, "z", n, homes[i]);
            expect_zero(e, t, n, "fresh");
            for (int tier = 0; tier < 2; tier++) {
                void *p;
                cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
                cr_assert(all_zero(p, n), "home %d round %d tier %d", homes[i], round, tier);
                cr_assert_eq(zinf_release(e, t, tier, 0), 0);
            }
            for (int tier = 0; tier < 2; tier++) {
                void *p;
                cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
                memset(p, 0xa5, n);
                cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
            }
            cr_assert_eq(zinf_write(e, t, 0, junk, n), 0);
            if (round == 1) cr_assert_eq(zinf_flush(e), 0); /* its bytes reach the swap space */
            cr_assert_eq(zinf_unregister(e, t), 0);
        }
    }
    free(junk);
    zinf_close(e);
}

/* ==== regressions ============================================================================= */

/* A fetch that had to wait for room (a write-back) and then found the copy loaded by
 * another caller returned the -EAGAIN of the wait instead of 0. */
Test(engine, fetches_that_waited_for_room_then_joined_return_zero)
{
    enum { T = 4, D = 4 };
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 256 * KiB;
    unsigned char *a = test_rand_buf(n, 90);

    for (int round = 0; round < 10; round++) {
        zinf_tensor d[D];
        for (int i = 0; i < D; i++) {
            char name[16];
            snprintf(name, sizeof(name), "dirty%d", i);
            d[i] = test_register(e, name, n, ZINF_TIER_NVME);
            void *p;
            cr_assert_eq(zinf_fetch(e, d[i], ZINF_TIER_HOST, &p), 0);
            memset(p, i + 1, n);
            cr_assert_eq(zinf_release(e, d[i], ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
        }
        zinf_tensor t = nvme_tensor_with(e, "t", a, n);
        pthread_barrier_t bar;
        pthread_t th[T];
        struct joiner j[T];
        pthread_barrier_init(&bar, NULL, T);
        for (int i = 0; i < T; i++) {
            j[i] = (struct joiner){.e = e, .t = t, .tier = ZINF_TIER_HOST, .bar = &bar};
            cr_assert_eq(pthread_create(&th[i], NULL, join_fetch, &j[i]), 0);
        }
        for (int i = 0; i < T; i++)
            pthread_join(th[i], NULL);
        pthread_barrier_destroy(&bar);
        for (int i = 0; i < T; i++) {
            cr_assert_eq(j[i].r, 0, "round %d, thread %d: %s", round, i, zinf_strerror(j[i].r));
            cr_assert_eq(j[i].p, j[0].p);
        }
        cr_assert_eq(memcmp(j[0].p, a, n), 0);
        for (int i = 0; i < T; i++)
            cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
        cr_assert_eq(zinf_unregister(e, t), 0);
        for (int i = 0; i < D; i++) {
            unsigned char *want = malloc(n);
            memset(want, i + 1, n);
            test_expect_content(e, d[i], want, n, "written back");
            free(want);
            cr_assert_eq(zinf_unregister(e, d[i]), 0);
        }
    }
    free(a);
    zinf_close(e);
}

struct flusher {
    zinf_engine *e;
    int r;
};

static void *run_flush(void *arg)
{
    struct flusher *f = arg;
    f->r = zinf_flush(f->e);
    return NULL;
}

/* A flush copying a pinned dirty copy labelled the swap extent with the tensor's version
 * at the end of the copy; a DIRTY release during the copy made that a newer version than
 * the bytes, so the copy was later dropped without a write-back and the update was lost. */
Test(engine, flush_during_a_dirty_release_keeps_the_update)
{
    zinf_engine *e = open_eng(16 * MiB, MiB, BLOCK);
    const size_t n = 6 * MiB + 3;
    unsigned char *a = test_rand_buf(n, 91), *b = test_rand_buf(n, 92), *c = test_rand_buf(n, 93);
    zinf_tensor t = nvme_tensor_with(e, "t", a, n);
    zinf_tensor u = nvme_tensor_with(e, "u", a, n);
    zinf_tensor w = nvme_tensor_with(e, "w", a, n);
    void *p;

    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
    memcpy(p, b, n);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);

    struct flusher f = {.e = e};
    pthread_t th;
    uint64_t flushes0 = stats(e).flushes;
    cr_assert_eq(pthread_create(&th, NULL, run_flush, &f), 0);
    /* Wait until the flush owns t (it is copying it), then write and release DIRTY. */
    struct tensor *ti;
    for (;;) {
        pthread_mutex_lock(&e->lock);
        ti = engine_tensor(e, t);
        bool copying = ti->exclusive, done = e->st.flushes != flushes0;
        pthread_mutex_unlock(&e->lock);
        if (copying || done) break;
        sched_yield();
    }
    memcpy(p, c, n);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    pthread_join(th, NULL);
    cr_assert_eq(f.r, 0, "flush: %s", zinf_strerror(f.r));
    /* Push t's device copy out. */
    cr_assert_eq(zinf_fetch(e, u, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(zinf_fetch(e, w, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(zinf_release(e, u, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_release(e, w, ZINF_TIER_DEVICE, 0), 0);
    test_expect_content(e, t, c, n, "the update released during the flush");
    cr_assert_eq(zinf_unregister(e, t), 0);
    cr_assert_eq(zinf_unregister(e, u), 0);
    cr_assert_eq(zinf_unregister(e, w), 0);
    free(a);
    free(b);
    free(c);
    zinf_close(e);
}

/* Two write-backs of one tensor (an older version from the device, a newer one from the
 * host) ran at once into the same extent; the older one finished last and labelled the
 * extent with its version, so the newest content was lost. The engine's completions take
 * its lock, so holding it keeps the first write-back from finishing while the second is
 * asked for. */
Test(engine, writebacks_of_one_tensor_never_overlap)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 5000;
    unsigned char *a = test_rand_buf(n, 94), *b = test_rand_buf(n, 95), *c = test_rand_buf(n, 96);

    for (int round = 0; round < 20; round++) {
        zinf_tensor t = nvme_tensor_with(e, "t", a, n);
        void *pd, *ph;
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &pd), 0);
        memcpy(pd, b, n);
        cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &ph), 0);
        cr_assert_eq(memcmp(ph, b, n), 0);
        memcpy(ph, c, n);

        pthread_mutex_lock(&e->lock);
        struct tensor *ti = engine_tensor(e, t);
        int r1 = writeback_start(e, ti, ZINF_TIER_DEVICE, true);
        /* What zinf_release(ZINF_RELEASE_DIRTY) of the host pin does, done here so that
         * the device write-back cannot complete in between. */
        ti->version++;
        ti->c[ZINF_TIER_HOST].version = ti->version;
        ti->c[ZINF_TIER_HOST].pins--;
        int r2 = writeback_start(e, ti, ZINF_TIER_HOST, true);
        pthread_mutex_unlock(&e->lock);
        cr_assert_eq(r1, 0, "%s", zinf_strerror(r1));
        cr_assert(r2 == 0 || r2 == -EAGAIN, "%s", zinf_strerror(r2));

        /* Wait for the write-backs, then push whatever is left out of both tiers. */
        pthread_mutex_lock(&e->lock);
        while (ti->c[0].wb_inflight || ti->c[1].wb_inflight)
            engine_wait(e);
        pthread_mutex_unlock(&e->lock);
        zinf_tensor f = test_register(e, "fill", MiB, ZINF_TIER_NVME);
        for (int tier = 0; tier < 2; tier++) {
            void *q;
            cr_assert_eq(zinf_fetch(e, f, tier, &q), 0);
            cr_assert_eq(zinf_release(e, f, tier, 0), 0);
        }
        test_expect_content(e, t, c, n, "the newest version");
        cr_assert_eq(zinf_unregister(e, f), 0);
        cr_assert_eq(zinf_unregister(e, t), 0);
    }
    free(a);
    free(b);
    free(c);
    zinf_close(e);
}

/* An async fetch that could not start its load at once (room had to be made by a
 * write-back) held no pin until zinf_wait: the tensor could be unregistered, or released
 * DIRTY from the other tier, in between. */
Test(engine, fetch_async_pins_even_when_its_load_waits)
{
    enum { D = 4 };
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 256 * KiB;
    unsigned char *a = test_rand_buf(n, 97);
    zinf_tensor d[D];

    for (int i = 0; i < D; i++) {
        char name[16];
        snprintf(name, sizeof(name), "dirty%d", i);
        d[i] = test_register(e, name, n, ZINF_TIER_NVME);
        void *p;
        cr_assert_eq(zinf_fetch(e, d[i], ZINF_TIER_HOST, &p), 0);
        memset(p, i + 1, n);
        cr_assert_eq(zinf_release(e, d[i], ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
    }
    zinf_tensor t = nvme_tensor_with(e, "t", a, n);
    uint64_t k;
    void *p, *q;
    cr_assert_eq(zinf_fetch_async(e, t, ZINF_TIER_HOST, &k), 0);
    cr_assert_eq(zinf_unregister(e, t), -EBUSY, "the async fetch holds a pin");
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &q), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), -EBUSY,
                 "pinned in the host tier by the async fetch");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_wait(e, k, &p), 0);
    cr_assert_eq(memcmp(p, a, n), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(zinf_unregister(e, t), 0);
    for (int i = 0; i < D; i++)
        cr_assert_eq(zinf_unregister(e, d[i]), 0);
    free(a);
    zinf_close(e);
}

/* An async fetch that joined a prefetch still loading an older version (the other tier
 * was released DIRTY meanwhile) made zinf_wait fail with -EIO instead of loading the
 * newest content. */
Test(engine, wait_after_joining_an_overtaken_prefetch_loads_the_newest)
{
    zinf_engine *e = open_eng(16 * MiB, 5 * MiB, BLOCK); /* prefetch budget: 8 MiB */
    const size_t n = 4 * MiB + 5;
    unsigned char *a = test_rand_buf(n, 98);
    zinf_tensor t = nvme_tensor_with(e, "t", a, n);
    unsigned joined = 0;

    for (int round = 0; round < 10; round++) {
        void *ph, *pd;
        uint64_t k;
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &ph), 0);
        test_fill_random(a, n, 200 + round);
        memcpy(ph, a, n);
        cr_assert_eq(zinf_prefetch(e, t, ZINF_TIER_DEVICE), 0); /* loads from the host copy */
        cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
        cr_assert_eq(zinf_fetch_async(e, t, ZINF_TIER_DEVICE, &k), 0);
        pthread_mutex_lock(&e->lock);
        struct tensor *ti = engine_tensor(e, t);
        joined += ti->c[ZINF_TIER_DEVICE].state == COPY_LOADING &&
                  ti->c[ZINF_TIER_DEVICE].version != ti->version;
        pthread_mutex_unlock(&e->lock);
        int r = zinf_wait(e, k, &pd);
        cr_assert_eq(r, 0, "round %d: %s", round, zinf_strerror(r));
        cr_assert_eq(memcmp(pd, a, n), 0);
        cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
        /* Drop the device copy for the next round. */
        cr_assert_eq(zinf_write(e, t, 0, a, 1), 0);
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &ph), 0);
        cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
    }
    cr_log_info("the async fetch joined an overtaken load in %u of 10 rounds", joined);
    cr_assert_eq(zinf_unregister(e, t), 0);
    free(a);
    zinf_close(e);
}

#define CHURN_SLOTS 4

struct churn {
    zinf_engine *e;
    _Atomic zinf_tensor h[CHURN_SLOTS];
    atomic_bool stop;
    atomic_uint done; /* threads finished */
    atomic_uint_fast64_t progress[3];
    char fail[256];
};

static void *churn_flusher(void *arg)
{
    struct churn *c = arg;
    while (!atomic_load(&c->stop)) {
        int r = zinf_flush(c->e);
        if (r != 0 && !c->fail[0])
            snprintf(c->fail, sizeof(c->fail), "flush: %s", zinf_strerror(r));
        atomic_fetch_add(&c->progress[0], 1);
    }
    atomic_fetch_add(&c->done, 1);
    return NULL;
}

static void *churn_registrar(void *arg)
{
    struct churn *c = arg;
    unsigned char buf[9000];
    memset(buf, 0x5a, sizeof(buf));
    for (unsigned i = 0; !atomic_load(&c->stop); i++) {
        unsigned s = i % CHURN_SLOTS;
        char name[16];
        snprintf(name, sizeof(name), "churn%u", s);
        zinf_tensor old = atomic_load(&c->h[s]), h;
        int r = zinf_unregister(c->e, old);
        if (r == -EBUSY) /* the reader holds a pin */
            continue;
        if (r == 0) r = zinf_register(c->e, name, sizeof(buf), (enum zinf_tier)(i % 3), &h);
        if (r == 0) r = zinf_write(c->e, h, 0, buf, sizeof(buf));
        if (r != 0 && !c->fail[0])
            snprintf(c->fail, sizeof(c->fail), "unregister/register/write: %s", zinf_strerror(r));
        if (r == 0) atomic_store(&c->h[s], h);
        atomic_fetch_add(&c->progress[1], 1);
    }
    atomic_fetch_add(&c->done, 1);
    return NULL;
}

/* Uses handles that the registrar may unregister at any moment: each call either works
 * on the tensor or answers -EINVAL. */
static void *churn_user(void *arg)
{
    struct churn *c = arg;
    unsigned char buf[9000];
    for (unsigned i = 0; !atomic_load(&c->stop); i++) {
        zinf_tensor h = atomic_load(&c->h[i % CHURN_SLOTS]);
        int tier = (int)(i / CHURN_SLOTS % 2);
        void *p;
        int r;
        switch (i % 3) {
        case 0:
            r = zinf_fetch(c->e, h, tier, &p);
            if (r == 0) {
                if (((unsigned char *)p)[8999] != 0x5a && ((unsigned char *)p)[8999] != 0)
                    snprintf(c->fail, sizeof(c->fail), "fetched bytes are neither old nor new");
                r = zinf_release(c->e, h, tier, 0);
            }
            break;
        case 1:
            r = zinf_read(c->e, h, 0, buf, sizeof(buf));
            break;
        default:
            r = zinf_prefetch(c->e, h, tier);
            break;
        }
        if (r != 0 && r != -EINVAL && !c->fail[0])
            snprintf(c->fail, sizeof(c->fail), "use of a churned handle: %s", zinf_strerror(r));
        atomic_fetch_add(&c->progress[2], 1);
    }
    atomic_fetch_add(&c->done, 1);
    return NULL;
}

/* An unregister that waited for its tensor while a flush started went on to free the
 * tensor the flush was waiting for (a use after free, then a deadlock); a fetch waiting
 * for a tensor another thread unregistered touched freed memory the same way. */
Test(engine, unregister_racing_flush_and_fetch)
{
    struct churn *c = calloc(1, sizeof(*c));
    cr_assert_not_null(c);
    c->e = open_eng(MiB, MiB, BLOCK);
    for (unsigned s = 0; s < CHURN_SLOTS; s++) {
        char name[16];
        snprintf(name, sizeof(name), "churn%u", s);
        atomic_store(&c->h[s], test_register(c->e, name, 9000, ZINF_TIER_NVME));
    }
    pthread_t th[3];
    void *(*fn[3])(void *) = {churn_flusher, churn_registrar, churn_user};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, fn[i], c), 0);
    /* Run 3 s, then stop; no progress for 20 s on the way is a deadlock. */
    uint64_t last = 0;
    unsigned still = 0;
    for (int tick = 0; atomic_load(&c->done) < 3; tick++) {
        usleep(100 * 1000);
        if (tick == 30) atomic_store(&c->stop, true);
        uint64_t now = atomic_load(&c->progress[0]) + atomic_load(&c->progress[1]) +
                       atomic_load(&c->progress[2]);
        still = now != last ? 0 : still + 1;
        last = now;
        if (still >= 200) {
            fprintf(stderr, "unregister_racing_flush_and_fetch: no progress for 20 s: "
                            "deadlock\n");
            abort();
        }
    }
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    cr_assert(!c->fail[0], "%s", c->fail);
    cr_assert_gt(atomic_load(&c->progress[1]), 10);
    for (unsigned s = 0; s < CHURN_SLOTS; s++)
        cr_assert_eq(zinf_unregister(c->e, atomic_load(&c->h[s])), 0);
    zinf_close(c->e);
    free(c);
}

struct unreg_arg {
    zinf_engine *e;
    zinf_tensor t;
    int r;
};

static void *run_unregister(void *arg)
{
    struct unreg_arg *u = arg;
    u->r = zinf_unregister(u->e, u->t);
    return NULL;
}

/* The same race, made likely: the unregister and the flush both wait for a tensor that a
 * transfer reads (the test holds a reader count on it); when the reader goes, both wake in
 * either order. An unregister that won used to free the tensor under the flush. */
Test(engine, unregister_waiting_when_a_flush_starts)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    unsigned char buf[5000];
    memset(buf, 7, sizeof(buf));

    for (int round = 0; round < 20; round++) {
        zinf_tensor t = test_register(e, "t", sizeof(buf), ZINF_TIER_NVME);
        put(e, t, buf, sizeof(buf));
        pthread_mutex_lock(&e->lock);
        engine_tensor(e, t)->c[ZINF_TIER_HOST].readers++;
        pthread_mutex_unlock(&e->lock);

        struct unreg_arg u = {.e = e, .t = t};
        struct flusher f = {.e = e};
        pthread_t tu, tf;
        cr_assert_eq(pthread_create(&tu, NULL, run_unregister, &u), 0);
        usleep(5000); /* it waits for the tensor */
        cr_assert_eq(pthread_create(&tf, NULL, run_flush, &f), 0);
        usleep(5000); /* it waits for the tensor too */
        pthread_mutex_lock(&e->lock);
        engine_tensor(e, t)->c[ZINF_TIER_HOST].readers--;
        pthread_cond_broadcast(&e->changed);
        pthread_mutex_unlock(&e->lock);

        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 20;
        cr_assert_eq(pthread_timedjoin_np(tf, NULL, &until), 0, "round %d: the flush hangs", round);
        cr_assert_eq(pthread_timedjoin_np(tu, NULL, &until), 0, "round %d: unregister hangs",
                     round);
        cr_assert_eq(f.r, 0, "flush: %s", zinf_strerror(f.r));
        cr_assert_eq(u.r, 0, "unregister: %s", zinf_strerror(u.r));
        zinf_tensor x;
        cr_assert_eq(zinf_lookup(e, "t", &x), -ENOENT);
    }
    cr_assert_eq(zinf_flush(e), 0);
    cr_assert_eq(stats(e).tier[ZINF_TIER_NVME].used_bytes, 0);
    zinf_close(e);
}

/* ---- regression tests for the defects a review reproduced against zinf.h ---------------- */

/* A call of the public API run on a thread of its own, so that a test can hold the engine
 * in a state and check that the call waits (or does not) for it. */
struct call {
    zinf_engine *e;
    zinf_tensor t;
    enum zinf_tier tier;
    unsigned flags;
    int kind; /* CALL_* */
    uint64_t ticket;
    void *p;
    int r;
    atomic_bool done;
    pthread_t th;
};

enum { CALL_RELEASE, CALL_FETCH, CALL_FETCH_ASYNC };

static void *call_main(void *arg)
{
    struct call *c = arg;
    switch (c->kind) {
    case CALL_RELEASE: c->r = zinf_release(c->e, c->t, c->tier, c->flags); break;
    case CALL_FETCH: c->r = zinf_fetch(c->e, c->t, c->tier, &c->p); break;
    default: c->r = zinf_fetch_async(c->e, c->t, c->tier, &c->ticket); break;
    }
    atomic_store(&c->done, true);
    return NULL;
}

static void call_start(struct call *c, zinf_engine *e, int kind, zinf_tensor t,
                       enum zinf_tier tier, unsigned flags)
{
    *c = (struct call){.e = e, .t = t, .tier = tier, .flags = flags, .kind = kind};
    cr_assert_eq(pthread_create(&c->th, NULL, call_main, c), 0);
}

/* Wait up to ms for the call to return; true if it did (and is joined). */
static bool call_join(struct call *c, unsigned ms)
{
    for (unsigned i = 0; i < ms && !atomic_load(&c->done); i++)
        usleep(1000);
    if (!atomic_load(&c->done))
        return false;
    pthread_join(c->th, NULL);
    return true;
}

/* Poll (lock held while looking) until cond(t) holds, up to 10 s. */
static bool engine_until(zinf_engine *e, zinf_tensor h, bool (*cond)(struct tensor *t))
{
    for (int i = 0; i < 10000; i++) {
        pthread_mutex_lock(&e->lock);
        struct tensor *t = engine_tensor(e, h);
        bool ok = t && cond(t);
        pthread_mutex_unlock(&e->lock);
        if (ok)
            return true;
        usleep(1000);
    }
    return false;
}

/* zinf_release(DIRTY) dropped the other tier's copy without honouring t->exclusive, while
 * zinf_write/zinf_read were using that copy with the lock dropped: the write landed in
 * memory already handed to another tensor, or crashed. The release must wait for them. */
Test(engine, dirty_release_waits_for_a_read_or_write_that_owns_the_tensor)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 100 * KiB + 3;
    unsigned char *a = test_rand_buf(n, 201);
    zinf_tensor t = nvme_tensor_with(e, "t", a, n);
    void *p, *q;

    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &q), 0); /* both copies valid now */

    /* Hold the tensor as zinf_write does while it copies into both copies unlocked. */
    pthread_mutex_lock(&e->lock);
    engine_tensor(e, t)->exclusive = true;
    pthread_mutex_unlock(&e->lock);
    struct call c;
    call_start(&c, e, CALL_RELEASE, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY);
    bool returned = call_join(&c, 100);
    pthread_mutex_lock(&e->lock);
    struct tensor *T = engine_tensor(e, t);
    bool host_kept = T->c[ZINF_TIER_HOST].state == COPY_READY;
    T->exclusive = false;
    pthread_cond_broadcast(&e->changed);
    pthread_mutex_unlock(&e->lock);
    cr_assert(!returned, "the DIRTY release did not wait for the owner of the tensor");
    cr_assert(host_kept, "the copy the owner uses was dropped under it");

    cr_assert(call_join(&c, 10000), "the release hangs once the tensor is let go");
    cr_assert_eq(c.r, 0, "%s", zinf_strerror(c.r));
    test_expect_content(e, t, a, n, "after the release");
    cr_assert_eq(zinf_unregister(e, t), 0);
    free(a);
    zinf_close(e);
}

/* The same race for real: one thread writes the whole tensor over and over, another
 * fetches it to the device, writes through the pointer and releases DIRTY, a third keeps a
 * neighbour moving through the host tier and checks its bytes, which the writer used to
 * scribble on once the region it copied into was handed over. */
struct dirty_race {
    zinf_engine *e;
    zinf_tensor t, o;
    size_t n;
    unsigned char *o_ref;
    atomic_bool stop;
    atomic_int bad;
    char why[256];
};

static void *race_writer(void *arg)
{
    struct dirty_race *d = arg;
    unsigned char *buf = malloc(d->n);
    for (unsigned k = 0; buf && !atomic_load(&d->stop); k++) {
        memset(buf, (int)(k & 0x7f), d->n);
        int r = zinf_write(d->e, d->t, 0, buf, d->n);
        if (r != 0 && !atomic_exchange(&d->bad, 1))
            snprintf(d->why, sizeof(d->why), "zinf_write: %s", zinf_strerror(r));
    }
    free(buf);
    return NULL;
}

static void *race_releaser(void *arg)
{
    struct dirty_race *d = arg;
    for (unsigned k = 0; !atomic_load(&d->stop); k++) {
        void *p;
        int r = zinf_fetch(d->e, d->t, k & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE, &p);
        if (r == -ENOMEM)
            continue;
        if (r == 0) {
            memset(p, 0x80 | (int)(k & 0x7f), d->n);
            r = zinf_release(d->e, d->t, k & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE,
                             ZINF_RELEASE_DIRTY);
            if (r == -EBUSY)
                r = zinf_release(d->e, d->t, k & 1 ? ZINF_TIER_HOST : ZINF_TIER_DEVICE, 0);
        }
        if (r != 0 && !atomic_exchange(&d->bad, 1))
            snprintf(d->why, sizeof(d->why), "fetch/release: %s", zinf_strerror(r));
    }
    return NULL;
}

static void *race_neighbour(void *arg)
{
    struct dirty_race *d = arg;
    while (!atomic_load(&d->stop)) {
        void *p;
        int r = zinf_fetch(d->e, d->o, ZINF_TIER_HOST, &p);
        if (r == -ENOMEM)
            continue;
        if (r == 0) {
            if (memcmp(p, d->o_ref, d->n) && !atomic_exchange(&d->bad, 1))
                snprintf(d->why, sizeof(d->why), "the neighbour's bytes changed");
            r = zinf_release(d->e, d->o, ZINF_TIER_HOST, 0);
        }
        if (r != 0 && !atomic_exchange(&d->bad, 1))
            snprintf(d->why, sizeof(d->why), "neighbour: %s", zinf_strerror(r));
    }
    return NULL;
}

Test(engine, dirty_release_racing_writes_never_touches_another_tensor)
{
    struct dirty_race d = {.n = 96 * KiB};
    /* Room in the host tier for about two of them: the neighbour takes what is freed. */
    d.e = open_eng(MiB, 256 * KiB, BLOCK);
    d.o_ref = test_rand_buf(d.n, 202);
    d.t = test_register(d.e, "t", d.n, ZINF_TIER_NVME);
    d.o = nvme_tensor_with(d.e, "o", d.o_ref, d.n);
    pthread_t th[3];
    void *(*fn[3])(void *) = {race_writer, race_releaser, race_neighbour};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, fn[i], &d), 0);
    usleep(1500 * 1000);
    atomic_store(&d.stop, true);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    cr_assert(!atomic_load(&d.bad), "%s", d.why);
    test_expect_content(d.e, d.o, d.o_ref, d.n, "the neighbour");
    cr_assert_eq(zinf_unregister(d.e, d.t), 0);
    cr_assert_eq(zinf_unregister(d.e, d.o), 0);
    free(d.o_ref);
    zinf_close(d.e);
}

static bool home_loading(struct tensor *t)
{
    return t->c[t->home].state == COPY_LOADING;
}

static bool home_pinned_twice(struct tensor *t)
{
    return t->c[t->home].pins == 2;
}

/* A fetch_async that needed a write-back to make room waited for the whole write-back in
 * tier_reserve (553 ms for a 256 MiB one), with the lock dropped and no pin: a tensor
 * unregistered meanwhile was then used after it was freed. It must return at once with a
 * ticket, whatever the write-back takes; zinf_wait() does the waiting. */
Test(engine, fetch_async_needing_a_writeback_returns_at_once)
{
    zinf_engine *e = open_eng(MiB, 4 * MiB, BLOCK);
    const size_t n = 600 * KiB;
    unsigned char *a = test_rand_buf(n, 203), *b = test_rand_buf(n, 204);
    zinf_tensor d = test_register(e, "dirty", n, ZINF_TIER_NVME);
    zinf_tensor t = nvme_tensor_with(e, "t", a, n);
    void *p;

    cr_assert_eq(zinf_fetch(e, d, ZINF_TIER_DEVICE, &p), 0);
    memcpy(p, b, n);
    cr_assert_eq(zinf_release(e, d, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);

    device_hold(e->dev, true); /* the write-back of "dirty" cannot move until released */
    struct call c;
    call_start(&c, e, CALL_FETCH_ASYNC, t, ZINF_TIER_DEVICE, 0);
    bool returned = call_join(&c, 2000);
    if (!returned)
        device_hold(e->dev, false);
    cr_assert(returned, "zinf_fetch_async waited for the write-back");
    cr_assert_eq(c.r, 0, "%s", zinf_strerror(c.r));
    /* The ticket holds the tensor: it cannot go while the write-back runs. */
    cr_assert_eq(zinf_unregister(e, t), -EBUSY);
    device_hold(e->dev, false);
    cr_assert_eq(zinf_wait(e, c.ticket, &p), 0);
    cr_assert_eq(memcmp(p, a, n), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    test_expect_content(e, d, b, n, "the written-back tensor");
    cr_assert_eq(zinf_unregister(e, t), 0);
    cr_assert_eq(zinf_unregister(e, d), 0);
    free(a);
    free(b);
    zinf_close(e);
}

/* Unregistering while an async fetch of the same tensor is being made, under memory
 * pressure from dirty copies: never a ticket for a dead handle, never a crash (ASan). */
struct async_churn {
    zinf_engine *e;
    _Atomic zinf_tensor t;
    atomic_bool stop;
    atomic_int bad;
    char why[256];
};

static void *async_churn_fetcher(void *arg)
{
    struct async_churn *a = arg;
    while (!atomic_load(&a->stop)) {
        zinf_tensor t = atomic_load(&a->t);
        uint64_t k;
        void *p;
        int r = zinf_fetch_async(a->e, t, ZINF_TIER_DEVICE, &k);
        if (r == 0) {
            r = zinf_wait(a->e, k, &p);
            if (r == 0) {
                memset(p, 3, 1000);
                r = zinf_release(a->e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY);
            }
        }
        if (r != 0 && r != -EINVAL && r != -ENOMEM && !atomic_exchange(&a->bad, 1))
            snprintf(a->why, sizeof(a->why), "fetch_async/wait/release: %s", zinf_strerror(r));
    }
    return NULL;
}

static void *async_churn_registrar(void *arg)
{
    struct async_churn *a = arg;
    while (!atomic_load(&a->stop)) {
        zinf_tensor t = atomic_load(&a->t), n;
        if (zinf_unregister(a->e, t) != 0)
            continue; /* pinned or waited on: try again */
        int r = zinf_register(a->e, "churn", 300 * KiB, ZINF_TIER_NVME, &n);
        if (r != 0) {
            if (!atomic_exchange(&a->bad, 1))
                snprintf(a->why, sizeof(a->why), "register: %s", zinf_strerror(r));
            break;
        }
        atomic_store(&a->t, n);
    }
    return NULL;
}

Test(engine, unregister_racing_async_fetches_that_need_writebacks)
{
    struct async_churn a = {0};
    a.e = open_eng(MiB, 4 * MiB, BLOCK);
    zinf_tensor d[2], t;
    for (int i = 0; i < 2; i++) {
        char name[16];
        snprintf(name, sizeof(name), "dirty%d", i);
        d[i] = test_register(a.e, name, 300 * KiB, ZINF_TIER_NVME);
    }
    cr_assert_eq(zinf_register(a.e, "churn", 300 * KiB, ZINF_TIER_NVME, &t), 0);
    atomic_store(&a.t, t);
    pthread_t th[2];
    cr_assert_eq(pthread_create(&th[0], NULL, async_churn_fetcher, &a), 0);
    cr_assert_eq(pthread_create(&th[1], NULL, async_churn_registrar, &a), 0);
    /* Keep dirty copies filling the device, so that the async fetches need write-backs. */
    for (int k = 0; k < 300; k++) {
        void *p;
        int r = zinf_fetch(a.e, d[k & 1], ZINF_TIER_DEVICE, &p);
        if (r == -ENOMEM)
            continue;
        cr_assert_eq(r, 0, "%s", zinf_strerror(r));
        memset(p, k, 300 * KiB);
        cr_assert_eq(zinf_release(a.e, d[k & 1], ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    }
    atomic_store(&a.stop, true);
    pthread_join(th[0], NULL);
    pthread_join(th[1], NULL);
    cr_assert(!atomic_load(&a.bad), "%s", a.why);
    zinf_close(a.e);
}

/* A write-back that kept failing made zinf_fetch retry the same victim for ever, logging
 * a line per attempt. Now the fetch gives -EIO after one attempt, the dirty content stays
 * in memory, a later fetch tries once more, and a flush writes it once the drive works. */
Test(engine, writeback_that_keeps_failing_gives_eio_and_keeps_the_data)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 400 * KiB + 77;
    unsigned char *b = test_rand_buf(n, 205), *f = test_rand_buf(700 * KiB, 206);
    zinf_tensor t = test_register(e, "t", n, ZINF_TIER_NVME);
    zinf_tensor filler = nvme_tensor_with(e, "filler", f, 700 * KiB);
    void *p;

    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
    memcpy(p, b, n);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
    uring_fault_set(e->io, URING_FAULT_EIO_STICKY, 1);
    test_log_capture_start();
    for (int attempt = 1; attempt <= 2; attempt++) {
        struct call c;
        call_start(&c, e, CALL_FETCH, filler, ZINF_TIER_HOST, 0);
        bool returned = call_join(&c, 10000);
        if (!returned)
            uring_fault_set(e->io, URING_FAULT_NONE, 0); /* let it out */
        cr_assert(returned, "attempt %d: the fetch keeps retrying the failing write-back",
                  attempt);
        cr_assert_eq(c.r, -EIO, "attempt %d: %s", attempt, zinf_strerror(c.r));
        /* One logged attempt per fetch. */
        unsigned lines = 0;
        for (const char *s = test_log_text(); (s = strstr(s, "writing tensor 't'")); s++)
            lines++;
        cr_assert_eq(lines, (unsigned)attempt, "%s", test_log_text());
    }
    test_log_capture_stop();
    test_expect_content(e, t, b, n, "the dirty tensor, kept in memory");
    cr_assert_eq(zinf_flush(e), -EIO, "the drive still fails");
    uring_fault_set(e->io, URING_FAULT_NONE, 0);
    cr_assert_eq(zinf_flush(e), 0, "a later flush retries and succeeds");
    cr_assert_eq(zinf_fetch(e, filler, ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(memcmp(p, f, 700 * KiB), 0);
    cr_assert_eq(zinf_release(e, filler, ZINF_TIER_HOST, 0), 0);
    zinf_close(e);
    e = NULL;
    struct zinf_options o = {.nvme_path = dir, .device_bytes = MiB, .host_bytes = MiB,
                             .block_size = BLOCK, .queue_depth = QD,
                             .device_kind = ZINF_DEVICE_EMULATED, .flags = ZINF_OPEN_RESUME};
    cr_assert_eq(zinf_open(&o, &e), 0);
    cr_assert_eq(zinf_lookup(e, "t", &t), 0);
    test_expect_content(e, t, b, n, "after the resume");
    zinf_close(e);
    free(b);
    free(f);
}

/* Two fetches of a home tier that joined a write-back into it, whose content a DIRTY
 * release overtook meanwhile: the first to wake saw the other's pin on the stale home and
 * returned a spurious -EBUSY, or the error of an earlier failed load of the home that the
 * write-back never cleared. Both must get the newest content. */
Test(engine, two_fetches_joining_an_overtaken_writeback_of_the_home_both_succeed)
{
    zinf_engine *e = open_eng(MiB, 4 * MiB, BLOCK);
    const size_t n = 300 * KiB;
    unsigned char *b = test_rand_buf(n, 207), *c2 = test_rand_buf(n, 208),
                  *f = test_rand_buf(800 * KiB, 209);
    zinf_tensor t = test_register(e, "t", n, ZINF_TIER_HOST);
    zinf_tensor filler = nvme_tensor_with(e, "filler", f, 800 * KiB);
    void *p, *q;

    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
    memcpy(p, b, n);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    /* An earlier load of the stale home from the device copy fails: its error stays on
     * the home copy for whoever joined that load. */
    device_fault_set(e->dev, 1, -EIO);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &q), -EIO);

    device_hold(e->dev, true);
    struct call fa, fb, fc;
    call_start(&fa, e, CALL_FETCH, filler, ZINF_TIER_DEVICE, 0); /* evicts t: write-back */
    cr_assert(engine_until(e, t, home_loading), "the write-back into the home started");
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &q), 0); /* still resident */
    memcpy(q, c2, n);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0); /* overtakes */
    call_start(&fb, e, CALL_FETCH, t, ZINF_TIER_HOST, 0);
    call_start(&fc, e, CALL_FETCH, t, ZINF_TIER_HOST, 0);
    cr_assert(engine_until(e, t, home_pinned_twice), "both fetches joined");
    device_hold(e->dev, false);
    cr_assert(call_join(&fb, 10000) && call_join(&fc, 10000), "the home fetches hang");
    cr_assert_eq(fb.r, 0, "first: %s", zinf_strerror(fb.r));
    cr_assert_eq(fc.r, 0, "second: %s", zinf_strerror(fc.r));
    cr_assert_eq(memcmp(fb.p, c2, n), 0, "the newest content");
    cr_assert_eq(fb.p, fc.p);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    cr_assert(call_join(&fa, 10000), "the filler's fetch hangs");
    cr_assert_eq(fa.r, 0, "%s", zinf_strerror(fa.r));
    cr_assert_eq(memcmp(fa.p, f, 800 * KiB), 0);
    cr_assert_eq(zinf_release(e, filler, ZINF_TIER_DEVICE, 0), 0);
    test_expect_content(e, t, c2, n, "t at the end");
    zinf_close(e);
    free(b);
    free(c2);
    free(f);
}

static bool home_ready_valid(struct tensor *t)
{
    return t->c[t->home].state == COPY_READY && t->c[t->home].version == t->version;
}

/* Prefetching a stale home copy charged the prefetch budget, and nothing gave it back:
 * unregister freed the home without it, so prefetching silently stopped for good. */
Test(engine, prefetch_of_a_stale_home_copy_gives_its_budget_back)
{
    zinf_engine *e = open_eng(MiB, 4 * MiB, BLOCK);
    const size_t n = 100 * KiB;
    void *p;

    for (int round = 0; round < 3; round++) {
        zinf_tensor t = test_register(e, "t", n, ZINF_TIER_HOST);
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
        memset(p, round + 1, n);
        cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
        cr_assert_eq(zinf_prefetch(e, t, ZINF_TIER_HOST), 0);
        cr_assert_eq(zinf_prefetch(e, t, ZINF_TIER_HOST), 0, "twice: charged once");
        cr_assert(engine_until(e, t, home_ready_valid));
        if (round == 1) { /* overtaken before use: wasted, and given back */
            cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
            cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
        }
        cr_assert_eq(zinf_unregister(e, t), 0);
        pthread_mutex_lock(&e->lock);
        uint64_t left = e->prefetch_outstanding_bytes;
        pthread_mutex_unlock(&e->lock);
        cr_assert_eq(left, 0, "round %d: %llu bytes of prefetch budget never given back", round,
                     (unsigned long long)left);
    }
    zinf_close(e);
}

/* A 2^61-byte NVMe-home register returned -EINVAL; the contract says -ENOSPC (larger than
 * its home tier), as for the memory homes. */
Test(engine, nvme_tensor_larger_than_any_swap_space_is_enospc)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    zinf_tensor t;
    cr_assert_eq(zinf_register(e, "huge", (size_t)1 << 61, ZINF_TIER_NVME, &t), -ENOSPC);
    cr_assert_eq(zinf_register(e, "huge", SIZE_MAX, ZINF_TIER_NVME, &t), -ENOSPC);
    t = test_register(e, "huge", 4096, ZINF_TIER_NVME); /* the name was not taken */
    cr_assert_eq(zinf_unregister(e, t), 0);
    zinf_close(e);
}

/* host_bytes near SIZE_MAX wrapped to 0 when rounded up and silently meant the 1 GiB
 * default. */
Test(engine, host_bytes_that_would_wrap_is_refused)
{
    zinf_engine *e = NULL;
    struct zinf_options o = {.host_bytes = SIZE_MAX - 100, .device_kind = ZINF_DEVICE_EMULATED};
    test_log_capture_start();
    cr_assert_eq(zinf_open(&o, &e), -EINVAL);
    cr_assert_null(e);
    cr_assert(strstr(test_log_text(), "host_bytes"), "%s", test_log_text());
    test_log_capture_stop();
}

/* zinf_strerror(INT_MIN) negated INT_MIN (undefined behaviour, caught by UBSan). */
Test(engine, strerror_of_int_min)
{
    cr_assert_not_null(zinf_strerror(INT_MIN));
    cr_assert_not_null(zinf_strerror(INT_MAX));
    cr_assert_not_null(zinf_strerror(-INT_MAX));
}

/* The copy states drawn in engine.h are checked after every transition in builds with
 * assertions: a broken one stops the process at once, naming what broke, rather than
 * corrupting data later. */
Test(engine, a_broken_copy_state_is_caught_at_the_next_transition, .signal = SIGABRT)
{
#ifdef NDEBUG
    cr_skip_test("built without assertions: the state checks are compiled out");
#endif
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    zinf_tensor t = test_register(e, "t", 8192, ZINF_TIER_NVME);
    void *p;
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
    pthread_mutex_lock(&e->lock);
    engine_tensor(e, t)->c[ZINF_TIER_HOST].evicting = true; /* with no write-back */
    pthread_mutex_unlock(&e->lock);
    test_log_capture_start();
    zinf_release(e, t, ZINF_TIER_HOST, 0);
    cr_assert_fail("not caught");
}

/* zinf_read and zinf_write of a tensor held only on NVMe bounced the whole range through
 * one heap buffer (a 1 GiB tensor took 1 GiB, twice with the undo copy). They now stream
 * in RANGE_CHUNK_BYTES pieces: ranges across several pieces, at odd offsets, with faults
 * on pieces past the first, read and write exactly what they should. */
Test(engine, large_reads_and_writes_of_a_swap_only_tensor_stream_in_pieces)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 2 * RANGE_CHUNK_BYTES + 3 * RANGE_CHUNK_BYTES / 4 + 4097;
    unsigned char *a = test_rand_buf(n, 210), *b = test_rand_buf(n, 211);
    zinf_tensor t = test_register(e, "big", n, ZINF_TIER_NVME);

    /* From zeros, a write of everything but the first and last few bytes. */
    cr_assert_eq(zinf_write(e, t, 3, a + 3, n - 10), 0);
    memset(a, 0, 3);
    memset(a + n - 7, 0, 7);
    test_expect_content(e, t, a, n, "after the first large write");
    unsigned char *got = malloc(n);
    cr_assert_not_null(got);
    size_t off = RANGE_CHUNK_BYTES - 5, len = RANGE_CHUNK_BYTES + 11;
    cr_assert_eq(zinf_read(e, t, off, got, len), 0);
    cr_assert_eq(memcmp(got, a + off, len), 0, "a read across a piece boundary");

    /* A fault on an IO past the first piece: the content stays as it was. */
    uring_fault_set(e->io, URING_FAULT_EIO, RANGE_CHUNK_BYTES / BLOCK + 3);
    cr_assert_eq(zinf_write(e, t, 1, b + 1, n - 1), -EIO);
    uring_fault_set(e->io, URING_FAULT_NONE, 0);
    test_expect_content(e, t, a, n, "after a failed large write");
    cr_assert_eq(zinf_write(e, t, 0, b, n), 0);
    test_expect_content(e, t, b, n, "after the second large write");
    cr_assert_eq(zinf_flush(e), 0);
    cr_assert_eq(zinf_write(e, t, 100, a, RANGE_CHUNK_BYTES + 1), 0); /* a persisted extent */
    memcpy(b + 100, a, RANGE_CHUNK_BYTES + 1);
    test_expect_content(e, t, b, n, "after a write over the persisted extent");
    cr_assert_eq(zinf_unregister(e, t), 0);
    free(got);
    free(a);
    free(b);
    zinf_close(e);
}

/* A chunk whose submission was refused at once inside the staging ring finished its
 * transfer with an error before the fetch that started it could wait: the fetch saw no
 * load, started another, and spun for ever with the engine lock held. It must report the
 * error; the next fetch works. */
Test(engine, fetch_whose_submission_is_refused_reports_it)
{
    zinf_engine *e = open_eng(MiB, MiB, BLOCK);
    const size_t n = 200 * KiB + 1;
    unsigned char *a = test_rand_buf(n, 212);
    zinf_tensor t = nvme_tensor_with(e, "t", a, n);
    for (unsigned nth = 1; nth <= 2; nth++) {
        uring_fault_set(e->io, URING_FAULT_SUBMIT, nth);
        struct call c;
        call_start(&c, e, CALL_FETCH, t, ZINF_TIER_DEVICE, 0); /* NVMe -> staging -> device */
        bool returned = call_join(&c, 10000);
        cr_assert(returned, "chunk %u refused: the fetch spins", nth);
        cr_assert_eq(c.r, -EIO, "chunk %u refused: %s", nth, zinf_strerror(c.r));
        uring_fault_set(e->io, URING_FAULT_NONE, 0);
    }
    void *p;
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(memcmp(p, a, n), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    check_budgets(e);
    cr_assert_eq(zinf_unregister(e, t), 0);
    free(a);
    zinf_close(e);
}

/* A write-back that needs a new extent when the swap files are full must grow them, and
 * never with the engine lock held: an asynchronous fetch leaves the growth to zinf_wait()
 * (its ticket comes back at once, the files as they were), whose blocking fetch grows them
 * with the lock dropped, writes the dirty copy back and loads. */
Test(engine, writeback_that_needs_the_swap_files_to_grow)
{
    zinf_engine *e = open_eng(MiB, 48 * MiB, MiB);
    const size_t n = 30 * MiB;
    zinf_tensor big = test_register(e, "big", 190 * MiB, ZINF_TIER_NVME); /* 256 MiB files */
    zinf_tensor t = test_register(e, "t", n, ZINF_TIER_NVME);
    zinf_tensor f = test_register(e, "f", n, ZINF_TIER_NVME);
    uint64_t cap0 = stats(e).tier[ZINF_TIER_NVME].capacity_bytes;
    cr_assert_lt(cap0 - stats(e).tier[ZINF_TIER_NVME].used_bytes, n, "the files are nearly full");
    cr_assert_eq(zinf_flush(e), 0); /* the manifest names t's extent: its write-back moves */

    unsigned char *b = test_rand_buf(n, 213);
    void *p;
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
    memcpy(p, b, n);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);

    uint64_t k;
    cr_assert_eq(zinf_fetch_async(e, f, ZINF_TIER_HOST, &k), 0); /* evicts t: no room */
    cr_assert_eq(stats(e).tier[ZINF_TIER_NVME].capacity_bytes, cap0,
                 "the asynchronous fetch grew the files under the lock");
    cr_assert_eq(zinf_wait(e, k, &p), 0);
    cr_assert(all_zero(p, n));
    cr_assert_eq(zinf_release(e, f, ZINF_TIER_HOST, 0), 0);
    cr_assert_gt(stats(e).tier[ZINF_TIER_NVME].capacity_bytes, cap0, "the files grew");
    cr_assert_gt(stats(e).tier[ZINF_TIER_HOST].writebacks, 0);
    test_expect_content(e, t, b, n, "the written-back tensor");

    for (zinf_tensor *x = (zinf_tensor[]){big, t, f, 0}; *x; x++)
        cr_assert_eq(zinf_unregister(e, *x), 0);
    free(b);
    zinf_close(e);
}

/* ---- zinf_fetch_all: a set that fits is placed, however fragmented the tier ----------- */

/* A tier of 256 pages laid out as [f0: 80 pages][s0][f1: 89 pages][s1][f2: 85 pages]: once
 * s0 and s1 are pinned, no free run is longer than 89 pages, whatever is evicted. s0 and s1
 * are left dirty in the tier (their home is NVMe), so emptying the tier must write them
 * back. */
struct frag {
    zinf_engine *e;
    zinf_tensor f[3], s[2], big;
    unsigned char *s_new[2], *big_ref;
};

#define PAGE (4 * KiB)
#define BIG_BYTES (200 * PAGE)

static void frag_setup(struct frag *fr, int tier)
{
    static const size_t fill[3] = {80 * PAGE, 89 * PAGE, 85 * PAGE};
    struct zinf_options o = {.nvme_path = dir, .device_bytes = tier ? 2 * MiB : MiB,
                             .host_bytes = tier ? MiB : 2 * MiB, .block_size = BLOCK,
                             .queue_depth = QD, .device_kind = ZINF_DEVICE_EMULATED,
                             .flags = ZINF_OPEN_OVERWRITE};
    void *p;
    fr->e = NULL;
    cr_assert_eq(zinf_open(&o, &fr->e), 0);
    for (int i = 0; i < 3; i++) {
        char name[8];
        snprintf(name, sizeof(name), "f%d", i);
        fr->f[i] = test_register(fr->e, name, fill[i], ZINF_TIER_NVME);
        cr_assert_eq(zinf_fetch(fr->e, fr->f[i], tier, &p), 0);
        cr_assert_eq(zinf_release(fr->e, fr->f[i], tier, 0), 0);
        if (i == 2)
            break;
        snprintf(name, sizeof(name), "s%d", i);
        fr->s[i] = test_register(fr->e, name, PAGE, ZINF_TIER_NVME);
        fr->s_new[i] = test_rand_buf(PAGE, 300 + i);
        cr_assert_eq(zinf_fetch(fr->e, fr->s[i], tier, &p), 0);
        memcpy(p, fr->s_new[i], PAGE);
        cr_assert_eq(zinf_release(fr->e, fr->s[i], tier, ZINF_RELEASE_DIRTY), 0);
    }
    fr->big_ref = test_rand_buf(BIG_BYTES, 310);
    fr->big = test_register(fr->e, "big", BIG_BYTES, ZINF_TIER_NVME);
    put(fr->e, fr->big, fr->big_ref, BIG_BYTES);
}

static void frag_free(struct frag *fr)
{
    zinf_close(fr->e);
    free(fr->s_new[0]);
    free(fr->s_new[1]);
    free(fr->big_ref);
}

Test(engine, fetch_all_lays_out_a_set_in_a_fragmented_tier)
{
    for (int tier = 0; tier < 2; tier++) {
        struct frag fr;
        void *p[3];
        frag_setup(&fr, tier);
        /* Member by member, the set does not fit: s0 and s1 split the tier. */
        cr_assert_eq(zinf_fetch(fr.e, fr.s[0], tier, &p[0]), 0);
        cr_assert_eq(zinf_fetch(fr.e, fr.s[1], tier, &p[1]), 0);
        cr_assert_eq(zinf_fetch(fr.e, fr.big, tier, &p[2]), -ENOMEM, "tier %d", tier);
        cr_assert_eq(zinf_release(fr.e, fr.s[0], tier, 0), 0);
        cr_assert_eq(zinf_release(fr.e, fr.s[1], tier, 0), 0);

        zinf_tensor set[3] = {fr.s[0], fr.s[1], fr.big};
        int r = zinf_fetch_all(fr.e, set, 3, tier, p);
        cr_assert_eq(r, 0, "tier %d: %s", tier, zinf_strerror(r));
        struct zinf_stats st = stats(fr.e);
        cr_assert_eq(st.compactions, 1);
        cr_assert_eq(st.tier[tier].pinned_bytes, 2 * PAGE + BIG_BYTES);
        cr_assert_eq(memcmp(p[0], fr.s_new[0], PAGE), 0, "s0's update survived the move");
        cr_assert_eq(memcmp(p[1], fr.s_new[1], PAGE), 0, "s1's update survived the move");
        cr_assert_eq(memcmp(p[2], fr.big_ref, BIG_BYTES), 0);
        for (int i = 0; i < 3; i++)
            cr_assert_eq(zinf_release(fr.e, set[i], tier, 0), 0);
        /* Now laid out in one run: the same set fits member by member, without emptying. */
        r = zinf_fetch_all(fr.e, set, 3, tier, p);
        cr_assert_eq(r, 0, "%s", zinf_strerror(r));
        cr_assert_eq(stats(fr.e).compactions, 1);
        for (int i = 0; i < 3; i++)
            cr_assert_eq(zinf_release(fr.e, set[i], tier, 0), 0);
        check_budgets(fr.e);
        test_expect_content(fr.e, fr.s[0], fr.s_new[0], PAGE, "s0");
        test_expect_content(fr.e, fr.s[1], fr.s_new[1], PAGE, "s1");
        frag_free(&fr);
    }
}

Test(engine, fetch_all_that_fails_pins_nothing)
{
    struct frag fr;
    void *p[3];
    frag_setup(&fr, ZINF_TIER_DEVICE);
    zinf_engine *e = fr.e;
    zinf_tensor set[3] = {fr.s[0], fr.s[1], fr.big};

    cr_assert_eq(zinf_fetch_all(e, set, 0, ZINF_TIER_DEVICE, p), 0, "an empty set");
    cr_assert_eq(zinf_fetch_all(NULL, set, 3, ZINF_TIER_DEVICE, p), -EINVAL);
    cr_assert_eq(zinf_fetch_all(e, NULL, 3, ZINF_TIER_DEVICE, p), -EINVAL);
    cr_assert_eq(zinf_fetch_all(e, set, 3, ZINF_TIER_DEVICE, NULL), -EINVAL);
    cr_assert_eq(zinf_fetch_all(e, set, 3, ZINF_TIER_NVME, p), -EINVAL);
    zinf_tensor bad[3] = {fr.s[0], fr.big + 12345, fr.s[1]};
    cr_assert_eq(zinf_fetch_all(e, bad, 3, ZINF_TIER_DEVICE, p), -EINVAL);
    cr_assert_eq(stats(e).tier[ZINF_TIER_DEVICE].pinned_bytes, 0);

    /* Another pin in the middle of the tier: once emptied, the tier still has no 200-page
     * run (s0 holds page 80 of 256), so the set cannot be placed; s0 keeps its pin. */
    void *q;
    cr_assert_eq(zinf_fetch(e, fr.s[0], ZINF_TIER_DEVICE, &q), 0);
    zinf_tensor set2[2] = {fr.s[1], fr.big};
    int r = zinf_fetch_all(e, set2, 2, ZINF_TIER_DEVICE, p);
    cr_assert_eq(r, -ENOMEM, "%s", zinf_strerror(r));
    struct zinf_stats st = stats(e);
    cr_assert_eq(st.tier[ZINF_TIER_DEVICE].pinned_bytes, PAGE, "only s0's pin is left");
    cr_assert_eq(memcmp(q, fr.s_new[0], PAGE), 0);
    cr_assert_eq(zinf_release(e, fr.s[0], ZINF_TIER_DEVICE, 0), 0);

    /* More than the tier holds. */
    zinf_tensor huge = test_register(e, "huge", 60 * PAGE, ZINF_TIER_NVME);
    zinf_tensor too_much[3] = {fr.big, fr.s[0], huge};
    cr_assert_eq(zinf_fetch_all(e, too_much, 3, ZINF_TIER_DEVICE, p), -ENOMEM);
    cr_assert_eq(stats(e).tier[ZINF_TIER_DEVICE].pinned_bytes, 0);

    /* The engine goes on: the set fits now, every byte where it was. */
    cr_assert_eq(zinf_fetch_all(e, set, 3, ZINF_TIER_DEVICE, p), 0);
    cr_assert_eq(memcmp(p[0], fr.s_new[0], PAGE), 0);
    cr_assert_eq(memcmp(p[1], fr.s_new[1], PAGE), 0);
    cr_assert_eq(memcmp(p[2], fr.big_ref, BIG_BYTES), 0);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(zinf_release(e, set[i], ZINF_TIER_DEVICE, 0), 0);
    check_budgets(e);
    frag_free(&fr);
}

struct fetch_all_call {
    zinf_engine *e;
    const zinf_tensor *set;
    size_t n;
    void *p[3];
    int r;
    atomic_bool done;
};

static void *fetch_all_main(void *arg)
{
    struct fetch_all_call *c = arg;
    c->r = zinf_fetch_all(c->e, c->set, c->n, ZINF_TIER_DEVICE, c->p);
    atomic_store(&c->done, true);
    return NULL;
}

/* While zinf_fetch_all waits for the write-backs that empty the tier, it holds no pin:
 * another thread may unregister a member. It finds it gone and fails with -EINVAL, pinning
 * nothing; the write-backs land and lose nothing. */
Test(engine, fetch_all_racing_unregister_of_a_member)
{
    struct frag fr;
    frag_setup(&fr, ZINF_TIER_DEVICE);
    zinf_engine *e = fr.e;
    zinf_tensor set[3] = {fr.s[0], fr.s[1], fr.big};
    struct fetch_all_call c = {.e = e, .set = set, .n = 3};
    pthread_t th;

    device_hold(e->dev, true); /* the write-backs of s0 and s1 wait until released */
    cr_assert_eq(pthread_create(&th, NULL, fetch_all_main, &c), 0);
    bool compacting = false;
    for (int i = 0; i < 10000 && !compacting; i++) {
        pthread_mutex_lock(&e->lock);
        compacting = e->compacting[ZINF_TIER_DEVICE] > 0;
        pthread_mutex_unlock(&e->lock);
        if (!compacting)
            usleep(1000);
    }
    if (!compacting)
        device_hold(e->dev, false);
    cr_assert(compacting, "zinf_fetch_all never emptied the tier");
    cr_assert_eq(zinf_unregister(e, fr.big), 0, "a member is not pinned meanwhile");
    cr_assert_not(atomic_load(&c.done), "it waits for the write-backs");
    device_hold(e->dev, false);
    pthread_join(th, NULL);
    cr_assert_eq(c.r, -EINVAL, "%s", zinf_strerror(c.r));
    cr_assert_eq(stats(e).tier[ZINF_TIER_DEVICE].pinned_bytes, 0);
    test_expect_content(e, fr.s[0], fr.s_new[0], PAGE, "s0 after the race");
    test_expect_content(e, fr.s[1], fr.s_new[1], PAGE, "s1 after the race");
    check_budgets(e);
    frag_free(&fr);
}

/* ---- zinf_set_log: an embedding program owns the library's output ----------------------- */

struct log_capture {
    int n, level, first_level;
    char first[256], last[256];
};

static void capture_log(int level, const char *msg, void *user)
{
    struct log_capture *c = user;
    if (c->n++ == 0) {
        c->first_level = level;
        snprintf(c->first, sizeof(c->first), "%s", msg);
    }
    c->level = level;
    snprintf(c->last, sizeof(c->last), "%s", msg);
}

/* An engine opened from a config that asks for more io_uring rings than zinf drives: it
 * says so (a notice), whatever else the machine makes it say. */
static void open_with_a_notice_and_close(void)
{
    static const char text[] = "{\"aio\": {\"intra_op_parallelism\": 16}, \"zinf\": "
                               "{\"device\": \"emulated\", \"device_bytes\": \"1M\", "
                               "\"host_bytes\": \"1M\"}}";
    struct zinf_config c;
    char err[256];
    zinf_engine *e = NULL;
    cr_assert_eq(config_parse_buffer(text, strlen(text), "rings.json", &c, err, sizeof(err)), 0,
                 "%s", err);
    cr_assert_eq(zinf_open_parsed(&c, 0, &e), 0);
    zinf_close(e);
    config_free(&c);
}

Test(engine, set_log_routes_every_message_to_the_caller)
{
    struct log_capture c = {0};
    zinf_set_log(capture_log, &c, ZINF_LOG_NOTICE);
    open_with_a_notice_and_close();
    cr_assert_geq(c.n, 1, "the notice reached the function");
    cr_assert_eq(c.first_level, ZINF_LOG_NOTICE);
    cr_assert(strstr(c.first, "aio.intra_op_parallelism 16: zinf drives at most"), "%s", c.first);
    cr_assert_null(strchr(c.first, '\n'), "one line, without its newline");

    /* Below the level: nothing. */
    c.n = 0;
    zinf_set_log(capture_log, &c, ZINF_LOG_ERROR);
    open_with_a_notice_and_close();
    cr_assert_eq(c.n, 0, "a notice under ZINF_LOG_ERROR: %s", c.last);

    /* An error still comes through at that level, with what it is about. */
    struct zinf_options bad = {.nvme_path = "/proc/version/swap", .device_bytes = MiB,
                               .host_bytes = MiB, .device_kind = ZINF_DEVICE_EMULATED};
    zinf_engine *e = NULL;
    cr_assert_lt(zinf_open(&bad, &e), 0);
    cr_assert_geq(c.n, 1);
    cr_assert_eq(c.level, ZINF_LOG_ERROR);
    cr_assert(strstr(c.last, "/proc/version"), "%s", c.last);

    /* Back to stderr; the function is not called any more. */
    c.n = 0;
    zinf_set_log(NULL, NULL, ZINF_LOG_NOTICE);
    open_with_a_notice_and_close();
    cr_assert_eq(c.n, 0);
}

/* zinf_tensor_info answers a tensor's home and size as registered, and -ENOENT for a
 * handle that names none (never one, or one unregistered); NULL arguments are -EINVAL. */
Test(engine, tensor_info_gives_home_and_size)
{
    zinf_engine *e = open_eng(4 * MiB, 4 * MiB, BLOCK);
    zinf_tensor h = test_register(e, "h", 12345, ZINF_TIER_HOST);
    zinf_tensor n = test_register(e, "n", 3 * BLOCK, ZINF_TIER_NVME);
    zinf_tensor gone = test_register(e, "gone", 4096, ZINF_TIER_DEVICE);
    struct zinf_tensor_info ti;
    cr_assert_eq(zinf_tensor_info(e, h, &ti), 0);
    cr_expect_eq(ti.home, ZINF_TIER_HOST);
    cr_expect_eq(ti.bytes, 12345);
    cr_assert_eq(zinf_tensor_info(e, n, &ti), 0);
    cr_expect_eq(ti.home, ZINF_TIER_NVME);
    cr_expect_eq(ti.bytes, 3 * BLOCK);
    cr_assert_eq(zinf_tensor_info(e, gone, &ti), 0);
    cr_expect_eq(ti.home, ZINF_TIER_DEVICE);
    cr_assert_eq(zinf_unregister(e, gone), 0);
    cr_expect_eq(zinf_tensor_info(e, gone, &ti), -ENOENT, "unregistered");
    cr_expect_eq(zinf_tensor_info(e, 0, &ti), -ENOENT, "0 is never a handle");
    cr_expect_eq(zinf_tensor_info(e, h, NULL), -EINVAL);
    cr_expect_eq(zinf_tensor_info(NULL, h, &ti), -EINVAL);
    zinf_close(e);
}

/* zinf_stats ends with the host tier's staging bytes and pinning, as the tier has them. */
Test(engine, stats_tell_the_host_tiers_staging_and_pinning)
{
    zinf_engine *e = open_eng(4 * MiB, 4 * MiB, BLOCK);
    struct zinf_stats st;
    struct host_stats hs;
    cr_assert_eq(zinf_stats(e, &st), 0);
    host_get_stats(e->host, &hs);
    cr_expect_eq(st.host_staging_bytes, hs.staging_bytes);
    cr_expect_eq(st.host_pinned, hs.pinned ? 1u : 0u);
    zinf_close(e);
}
