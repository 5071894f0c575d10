/*
 * shm.c - the ranks of one job on one node, over a POSIX shared-memory segment: the
 * rendezvous, a barrier, and the liveness and deadlines of their waits (shm.h). The shm
 * backend's collectives, which move their data through the segment, are in shm_coll.c.
 *
 * The segment, /dev/shm/zinf-comm-NAME.TAG while the ranks meet and unlinked once they all
 * have (so a crash leaves nothing behind), holds a header and, for the shm backend, two
 * sets of staging areas: per set, one of chunk_bytes per rank and one result area of
 * chunk_bytes (how the collectives use them is drawn at the top of shm_coll.c), the ranks'
 * pools, and a channel for each ordered pair of ranks (shm_p2p.c).
 *
 * Failure: a rank that fails (or a peer found dead: kill(pid, 0) while waiting) sets the
 * header's failed word with a reason; every wait sees it within WAIT_SLICE_MS and answers
 * -ECONNABORTED from then on. Every wait has a deadline: an operation's barriers wait at
 * most op_timeout_ms from the operation's start, and a rank that finds it passed fails the
 * communicator naming the ranks that did not come (a stopped or wedged one), and the
 * operation each was in (every rank keeps the operation it is in and how many barriers it
 * has entered in its slot of the header). Time the waiting rank itself did not run is not
 * waiting: ranks stopped together (the job's Ctrl-Z) and continued do not fail each other.
 *
 * Who may meet there. The segment is the job's uid's alone: rank 0 creates it exclusively,
 * mode 0600, and never removes an object it did not make unless that object's rank 0 is
 * provably gone (a segment of its own uid whose rank 0 process no longer exists). A rank
 * joins only an object of its own uid with mode 0600 that holds the job's whole secret; the
 * name carries a tag of TAG_HEX digits keyed by the secret and drawn from the communicator's
 * name (comm_segment_name), so a name seen in /dev/shm neither lets anyone in nor tells the
 * names of the job's other communicators, which another user could otherwise create first
 * (/dev/shm is everyone's to create in). Anything else under the name is refused with a
 * message naming it and its owner.
 *
 * Not here: the collectives (shm_coll.c), the queue of operations (comm.c), GPU buffers
 * (nccl.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "comm/shm.h"
#include "comm/shm_int.h"
#include "common.h"

#define SHM_MAGIC 0x7a696e66636f6d6dull /* "zinfcomm" */
#define WAIT_SLICE_MS 100               /* how often a waiter looks for dead peers */
#define SPIN_ROUNDS 2000                /* barrier polls before it sleeps */
/* Two looks at the clock of one wait further apart than this: the rank was not running in
 * between (stopped), and the deadline moves on by the gap. Waits look every WAIT_SLICE_MS
 * (NCCL's every few tens of ms); a machine busy enough to keep a waiter off the CPU this
 * long only lengthens its timeout. */
#define STOPPED_GAP_NS (1000 * 1000000ull)

static size_t hdr_bytes(void)
{
    return align_up(sizeof(struct shm_hdr), ZINF_ALIGN);
}

static size_t seg_bytes(int world, size_t chunk, size_t pool)
{
    size_t ring;
    return hdr_bytes() + 2 * ((size_t)world + 1) * chunk + (size_t)world * pool +
           shm_chan_bytes(world, chunk, &ring);
}

bool comm_name_ok(const char *n)
{
    size_t len = n ? strnlen(n, COMM_NAME_BYTES) : 0;
    if (len == 0 || len >= COMM_NAME_BYTES) return false;
    for (size_t i = 0; i < len; i++)
        if (!(n[i] == '.' || n[i] == '_' || n[i] == '-' || (n[i] >= '0' && n[i] <= '9') ||
              (n[i] >= 'a' && n[i] <= 'z') || (n[i] >= 'A' && n[i] <= 'Z')))
            return false;
    return n[0] != '.';
}

bool comm_secret_ok(const char *secret)
{
    if (!secret || strnlen(secret, COMM_SECRET_HEX + 1) != COMM_SECRET_HEX) return false;
    for (int i = 0; i < COMM_SECRET_HEX; i++)
        if (!((secret[i] >= '0' && secret[i] <= '9') || (secret[i] >= 'a' && secret[i] <= 'f')))
            return false;
    return true;
}

#define ROTL64(x, b) (((x) << (b)) | ((x) >> (64 - (b))))

static void sip_round(uint64_t v[4])
{
    v[0] += v[1];
    v[1] = ROTL64(v[1], 13) ^ v[0];
    v[0] = ROTL64(v[0], 32);
    v[2] += v[3];
    v[3] = ROTL64(v[3], 16) ^ v[2];
    v[0] += v[3];
    v[3] = ROTL64(v[3], 21) ^ v[0];
    v[2] += v[1];
    v[1] = ROTL64(v[1], 17) ^ v[2];
    v[2] = ROTL64(v[2], 32);
}

/* SipHash-2-4 (Aumasson and Bernstein) of m under the 128-bit key k0, k1: a keyed function
 * whose outputs for some inputs say nothing of its output for another without the key. */
static uint64_t siphash24(uint64_t k0, uint64_t k1, const uint8_t *m, size_t len)
{
    uint64_t v[4] = {k0 ^ 0x736f6d6570736575ull, k1 ^ 0x646f72616e646f6dull,
                     k0 ^ 0x6c7967656e657261ull, k1 ^ 0x7465646279746573ull};
    uint64_t b = (uint64_t)len << 56;
    size_t whole = len - len % 8;
    for (size_t i = 0; i < whole; i += 8) {
        uint64_t w = 0;
        for (int j = 0; j < 8; j++)
            w |= (uint64_t)m[i + j] << (8 * j);
        v[3] ^= w;
        sip_round(v);
        sip_round(v);
        v[0] ^= w;
    }
    for (size_t j = 0; j < len % 8; j++)
        b |= (uint64_t)m[whole + j] << (8 * j);
    v[3] ^= b;
    sip_round(v);
    sip_round(v);
    v[0] ^= b;
    v[2] ^= 0xff;
    for (int r = 0; r < 4; r++)
        sip_round(v);
    return v[0] ^ v[1] ^ v[2] ^ v[3];
}

/* The segment's tag: SipHash of the communicator's name under the job's secret (its 128
 * bits the key). Each of a job's communicators (a pipeline's links, the tensor-parallel
 * groups, the ZeRO ranks') meets under a name of its own; were the tag the secret's first
 * digits, one segment seen in /dev/shm would tell another user the names the job takes
 * next, which it could create first and so stop the job. */
static uint64_t segment_tag(const char *name, const char *secret)
{
    uint64_t k[2] = {0, 0};
    for (int i = 0; i < COMM_SECRET_HEX; i++) {
        char c = secret[i];
        uint64_t d = (uint64_t)(c <= '9' ? c - '0' : c - 'a' + 10);
        k[i / 16] = (k[i / 16] << 4) | d;
    }
    return siphash24(k[0], k[1], (const uint8_t *)name, strlen(name));
}

int comm_segment_name(const char *name, const char *secret, char *buf, size_t len)
{
    if (!comm_name_ok(name) || (secret && !comm_secret_ok(secret))) return -EINVAL;
    int n = secret ? snprintf(buf, len, "/zinf-comm-%s.%016llx", name,
                              (unsigned long long)segment_tag(name, secret))
                   : snprintf(buf, len, "/zinf-comm-%s", name);
    return n < 0 || (size_t)n >= len ? -EINVAL : 0;
}

/* Says why the rendezvous failed: logged, and kept in comm_opts.why. */
__attribute__((format(printf, 2, 3))) static void say(struct shm *s, const char *fmt, ...)
{
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    log_error("comm %s: rank %d: %s", s->job, s->first + s->rank, msg);
    if (s->why && s->why_len) snprintf(s->why, s->why_len, "%s", msg);
}

char comm_proc_state(int32_t pid)
{
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f) return '?';
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* the name may hold spaces and parentheses */
    return p && p[1] == ' ' && p[2] ? p[2] : '?';
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A process that exited but was not yet reaped (a zombie) is dead too: its parent, a
 * launcher, may be busy waiting for another rank. */
static bool alive(int32_t pid)
{
    if (pid <= 0) return true;
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    char st = comm_proc_state(pid); /* '?': no /proc, and kill() said it exists */
    return st != 'Z' && st != 'X';
}

void shm_fail(struct shm *s, const char *why)
{
    uint32_t zero = 0;
    /* Only the first reason is kept: the one that set the word writes it, and a reader
     * takes it after seeing failed == 2 (release/acquire). */
    if (atomic_compare_exchange_strong(&s->h->failed, &zero, 1)) {
        snprintf(s->h->why, WHY_BYTES, "%s", why);
        atomic_store_explicit(&s->h->failed, 2, memory_order_release);
    }
    syscall(SYS_futex, &s->h->bar_gen, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

/* -ECONNABORTED if the communicator has failed (once its reason is written). */
int shm_failed(struct shm *s)
{
    uint32_t f = atomic_load_explicit(&s->h->failed, memory_order_acquire);
    if (f == 0) return 0;
    for (int i = 0; f == 1 && i < 1000; i++) { /* the reason is being written */
        sleep_ms(1);
        f = atomic_load_explicit(&s->h->failed, memory_order_acquire);
    }
    return -ECONNABORTED;
}

const char *shm_fail_reason(struct shm *s)
{
    return atomic_load_explicit(&s->h->failed, memory_order_acquire) == 2 ? s->h->why
                                                                            : "(no reason given)";
}

/* A peer that is gone fails the communicator. */
int shm_check(struct shm *s)
{
    for (int r = 0; r < s->world; r++) {
        int32_t pid = atomic_load_explicit(&s->h->ranks[r].pid, memory_order_relaxed);
        if (r == s->rank || alive(pid)) continue;
        char why[WHY_BYTES];
        snprintf(why, sizeof(why), "rank %d (pid %d) is gone", s->first + r, (int)pid);
        shm_fail(s, why);
    }
    return shm_failed(s);
}

int shm_peer_check(struct shm *s, int peer, char *why, size_t len)
{
    int r = shm_failed(s);
    if (r) return r;
    struct shm_rank *q = &s->h->ranks[peer];
    int32_t pid = atomic_load_explicit(&q->pid, memory_order_relaxed);
    if (atomic_load_explicit(&q->left, memory_order_acquire))
        snprintf(why, len, "rank %d (pid %d) closed its communicator", s->first + peer, (int)pid);
    else if (!alive(pid))
        snprintf(why, len, "rank %d (pid %d) is gone", s->first + peer, (int)pid);
    else
        return 0;
    return 1;
}

void shm_begin_op(struct shm *s, enum comm_op op)
{
    struct shm_rank *me = &s->h->ranks[s->rank];
    atomic_store_explicit(&me->op, (uint32_t)op, memory_order_relaxed);
    atomic_store_explicit(&me->seq, ++s->seq, memory_order_relaxed);
    s->op_looked = now_ns();
    s->op_deadline = s->op_looked + (uint64_t)s->op_timeout_ms * 1000000ull;
}

bool shm_op_late(struct shm *s)
{
    uint64_t now = now_ns();
    /* A gap since the last look that no wait slice explains: this rank was stopped. The
     * deadline counts the time it waited, not the time it was stopped (its peers, stopped
     * with it, could not come meanwhile). A peer stopped alone still makes it late. */
    if (s->op_deadline != UINT64_MAX && now - s->op_looked > STOPPED_GAP_NS)
        s->op_deadline += now - s->op_looked;
    s->op_looked = now;
    return now > s->op_deadline;
}

/* This rank's operation passed its deadline in its barrier number k: the ranks that have
 * not entered it are named, with the operation each is in, and the communicator fails.
 * 0 if every rank turned out to be there after all. */
static int late(struct shm *s, uint64_t k, uint32_t gen)
{
    char why[WHY_BYTES];
    int n = 0, missing = 0;
    for (int r = 0; r < s->world; r++) {
        struct shm_rank *q = &s->h->ranks[r];
        if (r == s->rank || atomic_load_explicit(&q->bars, memory_order_acquire) >= k) continue;
        if (atomic_load_explicit(&s->h->bar_gen, memory_order_acquire) != gen) return 0;
        int32_t pid = atomic_load_explicit(&q->pid, memory_order_relaxed);
        char st = comm_proc_state(pid);
        if (missing++ == 0)
            n = snprintf(why, sizeof(why),
                         "rank %d (pid %d%s) did not come to %s #%llu within %.3g s: it is in %s "
                         "#%llu",
                         s->first + r, (int)pid, st == 'T' || st == 't' ? ", stopped" : "",
                         comm_op_name(atomic_load(&s->h->ranks[s->rank].op)),
                         (unsigned long long)s->seq, s->op_timeout_ms / 1000.0,
                         comm_op_name(atomic_load(&q->op)), (unsigned long long)atomic_load(&q->seq));
        else if (n < (int)sizeof(why))
            n += snprintf(why + n, sizeof(why) - (size_t)n, "%s rank %d", missing == 2 ? "; so did" : ",",
                          s->first + r);
    }
    if (!missing) return 0;
    shm_fail(s, why);
    log_error("comm %s: rank %d: %s", s->job, s->first + s->rank, why);
    return -ETIMEDOUT;
}

int shm_barrier(struct shm *s)
{
    struct shm_hdr *h = s->h;
    int r = shm_failed(s);
    if (r) return r;
    if (s->world == 1) return 0;
    /* Sense by generation: the last to arrive resets the count, then moves the generation
     * on (release: a waiter that sees the new generation sees every write the other ranks
     * made before arriving, which the acq_rel increments chained to the last arrival). The
     * rank's count of barriers entered is stored first, so that a rank that gives up waiting
     * sees who came. */
    uint64_t k = ++s->bars;
    uint32_t gen = atomic_load_explicit(&h->bar_gen, memory_order_acquire);
    atomic_store_explicit(&h->ranks[s->rank].bars, k, memory_order_release);
    if (atomic_fetch_add_explicit(&h->bar_count, 1, memory_order_acq_rel) ==
        (uint32_t)s->world - 1) {
        atomic_store_explicit(&h->bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&h->bar_gen, 1, memory_order_release);
        syscall(SYS_futex, &h->bar_gen, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
        return 0;
    }
    for (unsigned spin = 0;; spin++) {
        if (atomic_load_explicit(&h->bar_gen, memory_order_acquire) != gen) return 0;
        if (spin < SPIN_ROUNDS) {
            cpu_relax();
            continue;
        }
        struct timespec ts = {0, WAIT_SLICE_MS * 1000000L};
        syscall(SYS_futex, &h->bar_gen, FUTEX_WAIT, gen, &ts, NULL, 0);
        if (atomic_load_explicit(&h->bar_gen, memory_order_acquire) != gen) return 0;
        if ((r = shm_check(s))) return r;
        if (shm_op_late(s) && (r = late(s, k, gen))) return r;
    }
}

static int rdv_fail(struct shm *s, int err, const char *why)
{
    say(s, "%s", why);
    if (s->h) shm_fail(s, why);
    return err;
}

static bool stopping(const struct shm *s)
{
    return s->stop && *s->stop;
}

/* The uid's name, or "" where it has none. */
static const char *user_name(uid_t uid, char *buf, size_t len)
{
    struct passwd pw, *res = NULL;
    char tmp[1024];
    if (getpwuid_r(uid, &pw, tmp, sizeof(tmp), &res) == 0 && res)
        snprintf(buf, len, " (%s)", res->pw_name);
    else
        buf[0] = 0;
    return buf;
}

/* Whether st, what is under the segment's name, may be ours to use: this uid's, a regular
 * file, mode 0600. If not, says whose it is and answers -EACCES. */
static int check_owner(struct shm *s, const struct stat *st)
{
    char who[80];
    if (st->st_uid != geteuid()) {
        say(s,
            "/dev/shm%s belongs to uid %u%s, not to this job's user (uid %u): it is not this "
            "job's rendezvous; give the job another name (zinf launch --name)",
            s->name, (unsigned)st->st_uid, user_name(st->st_uid, who, sizeof(who)),
            (unsigned)geteuid());
        return -EACCES;
    }
    if (!S_ISREG(st->st_mode) || (st->st_mode & 07777) != 0600) {
        say(s,
            "/dev/shm%s has mode %04o, not 0600: zinf did not make it; if no job of yours uses "
            "it, remove it",
            s->name, (unsigned)(st->st_mode & 07777));
        return -EACCES;
    }
    return 0;
}

/* Rank 0 found the name taken. A segment of this uid whose rank 0 is gone is removed
 * (-EAGAIN: create it again); anything else is refused, saying whose it is. A segment
 * whose header is not written yet is being made: -EAGAIN, until the deadline says. */
static int rdv_taken(struct shm *s, bool last_try)
{
    char path[sizeof("/dev/shm") + SEG_NAME_BYTES];
    snprintf(path, sizeof(path), "/dev/shm%s", s->name);
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? -EAGAIN : -errno;
    int r = check_owner(s, &st);
    if (r) return r;
    int fd = shm_open(s->name, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) return errno == ENOENT ? -EAGAIN : -errno;
    void *p = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= hdr_bytes())
        p = mmap(NULL, hdr_bytes(), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        if (!last_try) return -EAGAIN;
        say(s, "/dev/shm%s holds no rendezvous (%lld bytes): if no job of yours is starting under "
            "this name, remove it", s->name, (long long)st.st_size);
        return -EBUSY;
    }
    const struct shm_hdr *h = p;
    bool made = atomic_load_explicit(&((struct shm_hdr *)p)->magic, memory_order_acquire) ==
                SHM_MAGIC;
    int32_t pid0 = made ? h->pid0 : 0;
    munmap(p, hdr_bytes());
    if (made && pid0 > 0 && !alive(pid0)) {
        log_notice("comm %s: removing /dev/shm%s, left by a job whose rank 0 (pid %d) is gone",
                   s->job, s->name, (int)pid0);
        shm_unlink(s->name);
        return -EAGAIN;
    }
    if (!made && !last_try) return -EAGAIN;
    if (made)
        say(s, "another job named '%s' is meeting in /dev/shm%s (its rank 0 is pid %d): give "
            "this job another name (zinf launch --name)", s->job, s->name, (int)pid0);
    else
        say(s, "/dev/shm%s holds no rendezvous header: if no job of yours is starting under this "
            "name, remove it", s->name);
    return -EBUSY;
}

/* Rank 0: make the segment and wait for the others. */
static int rdv_create(struct shm *s, const struct comm_opts *o, size_t chunk, size_t pool,
                      const uint8_t *id, uint64_t deadline)
{
    int fd;
    for (;;) {
        fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0) break;
        int e = -errno;
        if (e == -EEXIST) e = rdv_taken(s, now_ns() > deadline);
        if (e == -EAGAIN && !stopping(s)) {
            sleep_ms(2);
            continue;
        }
        if (e == -EAGAIN) {
            say(s, "stopped by a signal before the ranks met");
            return -EINTR;
        }
        if (e != -EACCES && e != -EBUSY)
            say(s, "cannot create /dev/shm%s: %s", s->name, strerror(-e));
        return e;
    }
    size_t bytes = seg_bytes(o->world, chunk, pool);
    void *p = MAP_FAILED;
    /* The pages are reserved now: a /dev/shm too small for them (a container's is often
     * 64 MiB) is an error here, not a SIGBUS at a rank's first touch of a page. */
    int fe = ftruncate(fd, (off_t)bytes) == 0 ? posix_fallocate(fd, 0, (off_t)bytes) : errno;
    if (fe == ENOSPC) {
        close(fd);
        shm_unlink(s->name);
        say(s, "/dev/shm has no room for the %zu bytes of the communicator's segment (staging "
            "2 x %d x %zu B, pools %d x %zu B): make it larger (in a container: --shm-size) or "
            "lower chunk_bytes or pool_bytes",
            bytes, o->world + 1, chunk, o->world, pool);
        return -ENOSPC;
    }
    errno = fe;
    if (fe == 0 || fe == EOPNOTSUPP || fe == EINVAL) /* a filesystem without fallocate */
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = -errno;
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(s->name);
        say(s, "cannot map %zu bytes of /dev/shm%s: %s", bytes, s->name, strerror(-e));
        return e == -EINVAL ? -ENOMEM : e;
    }
    s->h = p;
    s->map_bytes = bytes;
    s->h->world = (uint32_t)o->world;
    s->h->backend = (uint32_t)o->backend;
    s->h->chunk_bytes = chunk;
    s->h->pool_bytes = pool;
    s->h->pid0 = (int32_t)getpid();
    snprintf(s->h->secret, sizeof(s->h->secret), "%s", o->secret ? o->secret : "");
    if (id) memcpy(s->h->id, id, SHM_ID_BYTES);
    atomic_store(&s->h->ranks[0].pid, (int32_t)getpid());
    atomic_store(&s->h->ranks[0].joined, 1);
    atomic_store_explicit(&s->h->magic, SHM_MAGIC, memory_order_release);

    for (;;) {
        int n = 0;
        for (int r = 0; r < o->world; r++)
            n += atomic_load_explicit(&s->h->ranks[r].joined, memory_order_acquire) != 0;
        if (n == o->world) break;
        if (shm_failed(s)) {
            say(s, "%s", shm_fail_reason(s));
            shm_unlink(s->name);
            return -EPROTO;
        }
        if (stopping(s)) {
            shm_unlink(s->name);
            return rdv_fail(s, -EINTR, "rank 0 was stopped by a signal while the ranks met");
        }
        if (now_ns() > deadline) {
            char why[WHY_BYTES];
            int k = snprintf(why, sizeof(why), "%d of %d ranks came within %u ms; missing:", n,
                             o->world, o->timeout_ms ? o->timeout_ms : COMM_DEFAULT_TIMEOUT_MS);
            for (int r = 0; r < o->world && k < (int)sizeof(why) - 8; r++)
                if (!atomic_load(&s->h->ranks[r].joined))
                    k += snprintf(why + k, sizeof(why) - (size_t)k, " %d", r);
            shm_unlink(s->name);
            return rdv_fail(s, -ETIMEDOUT, why);
        }
        sleep_ms(1);
    }
    atomic_store_explicit(&s->h->open, 1, memory_order_release);
    shm_unlink(s->name); /* every rank has it mapped */
    return 0;
}

/* Another rank: find rank 0's segment (a stale one, of a dead rank 0, is passed over). */
static int rdv_join(struct shm *s, const struct comm_opts *o, uint8_t *id, uint64_t deadline)
{
    for (;; sleep_ms(2)) {
        if (stopping(s)) {
            say(s, "stopped by a signal before the ranks met");
            return -EINTR;
        }
        if (now_ns() > deadline) {
            char why[WHY_BYTES];
            snprintf(why, sizeof(why), "rank 0 did not open the communicator within %u ms",
                     o->timeout_ms ? o->timeout_ms : COMM_DEFAULT_TIMEOUT_MS);
            return rdv_fail(s, -ETIMEDOUT, why);
        }
        int fd = shm_open(s->name, O_RDWR | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EACCES) {
            /* Not ours to open: whose, then? */
            char path[sizeof("/dev/shm") + SEG_NAME_BYTES];
            struct stat st;
            snprintf(path, sizeof(path), "/dev/shm%s", s->name);
            if (lstat(path, &st) == 0 && check_owner(s, &st)) return -EACCES;
        }
        if (fd < 0) continue;
        struct stat st;
        void *p = MAP_FAILED;
        if (fstat(fd, &st) != 0) {
            close(fd);
            continue;
        }
        int r = check_owner(s, &st);
        if (r) {
            close(fd);
            return r;
        }
        if ((size_t)st.st_size >= hdr_bytes())
            p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) continue;
        struct shm_hdr *h = p;
        if (atomic_load_explicit(&h->magic, memory_order_acquire) != SHM_MAGIC ||
            !alive(h->pid0) || atomic_load(&h->open)) {
            munmap(p, (size_t)st.st_size);
            continue;
        }
        if (strncmp(h->secret, o->secret ? o->secret : "", sizeof(h->secret))) {
            int32_t pid0 = h->pid0;
            munmap(p, (size_t)st.st_size);
            say(s, "/dev/shm%s is another job's rendezvous (its rank 0 is pid %d; the job's "
                "secret differs): two jobs share the name '%s'", s->name, (int)pid0, s->job);
            return -EBUSY;
        }
        s->h = h;
        s->map_bytes = (size_t)st.st_size;
        break;
    }
    char what[WHY_BYTES];
    if (s->h->world != (uint32_t)o->world) {
        snprintf(what, sizeof(what), "WORLD_SIZE disagrees: rank %d has a world of %d, rank 0 of %u",
                 o->rank, o->world, s->h->world);
        return rdv_fail(s, -EPROTO, what);
    }
    if (s->h->backend != (uint32_t)o->backend) {
        snprintf(what, sizeof(what), "the backend disagrees: rank %d uses the %s backend, rank 0 the %s backend", o->rank,
                 comm_backend_name(o->backend), comm_backend_name((enum comm_backend)s->h->backend));
        return rdv_fail(s, -EPROTO, what);
    }
    if (s->h->pool_bytes != align_up(o->pool_bytes, ZINF_ALIGN) && s->h->chunk_bytes) {
        snprintf(what, sizeof(what), "the pool size disagrees: rank %d has a pool of %zu bytes, rank 0 of %llu", o->rank,
                 (size_t)align_up(o->pool_bytes, ZINF_ALIGN), (unsigned long long)s->h->pool_bytes);
        return rdv_fail(s, -EPROTO, what);
    }
    if (s->map_bytes < seg_bytes(o->world, s->h->chunk_bytes, s->h->pool_bytes))
        return rdv_fail(s, -EPROTO, "the segment is smaller than its header says (another version of zinf made it?)");
    uint32_t zero = 0;
    if (!atomic_compare_exchange_strong(&s->h->ranks[o->rank].joined, &zero, 1)) {
        snprintf(what, sizeof(what), "rank %d was started twice", o->rank);
        return rdv_fail(s, -EEXIST, what);
    }
    atomic_store(&s->h->ranks[o->rank].pid, (int32_t)getpid());
    while (!atomic_load_explicit(&s->h->open, memory_order_acquire)) {
        if (shm_failed(s)) {
            say(s, "%s", shm_fail_reason(s));
            return -EPROTO;
        }
        if (stopping(s)) {
            snprintf(what, sizeof(what), "rank %d was stopped by a signal while the ranks met",
                     o->rank);
            return rdv_fail(s, -EINTR, what);
        }
        if (!alive(s->h->pid0))
            return rdv_fail(s, -ECONNABORTED, "rank 0 died while the ranks met");
        if (now_ns() > deadline)
            return rdv_fail(s, -ETIMEDOUT, "the other ranks did not all come in time");
        sleep_ms(1);
    }
    if (id) memcpy(id, s->h->id, SHM_ID_BYTES);
    return 0;
}

int shm_rdv_open(const struct comm_opts *o, bool data, uint8_t *id, struct shm **out)
{
    *out = NULL;
    struct shm tmp = {.rank = o->rank, .job = o->name ? o->name : "(null)", .why = o->why,
                      .why_len = o->why_len};
    if (!comm_name_ok(o->name)) {
        say(&tmp, "the rendezvous name '%.*s' is not 1-%d characters of [A-Za-z0-9._-]", 80,
            o->name ? o->name : "(null)", COMM_NAME_BYTES - 1);
        return -EINVAL;
    }
    if (o->secret && !comm_secret_ok(o->secret)) {
        say(&tmp, "the job's secret (ZINF_COMM_SECRET) is not %d lowercase hex digits",
            COMM_SECRET_HEX);
        return -EINVAL;
    }
    struct shm *s = calloc(1, sizeof(*s));
    if (!s) return -ENOMEM;
    *s = tmp;
    s->world = o->world;
    s->op_timeout_ms = o->op_timeout_ms ? o->op_timeout_ms : COMM_DEFAULT_OP_TIMEOUT_MS;
    s->op_deadline = UINT64_MAX; /* until an operation begins */
    s->stop = o->stop;
    comm_segment_name(o->name, o->secret, s->name, sizeof(s->name));
    size_t chunk = data ? align_up(o->chunk_bytes ? o->chunk_bytes : COMM_DEFAULT_CHUNK_BYTES,
                                   (size_t)64 * (size_t)o->world)
                        : 0;
    uint64_t deadline =
        now_ns() + (uint64_t)(o->timeout_ms ? o->timeout_ms : COMM_DEFAULT_TIMEOUT_MS) * 1000000ull;
    size_t pool = data ? align_up(o->pool_bytes, ZINF_ALIGN) : 0;
    if (pool > SIZE_MAX / 2 / (size_t)o->world) {
        say(s, "a pool of %zu bytes per rank is too large", o->pool_bytes);
        free(s);
        return -EINVAL;
    }
    int r = o->rank == 0 ? rdv_create(s, o, chunk, pool, id, deadline) : rdv_join(s, o, id, deadline);
    if (r < 0) {
        shm_rdv_close(s);
        return r;
    }
    s->why = NULL; /* the caller's buffer is for comm_open only */
    s->chunk = s->h->chunk_bytes;
    s->data = s->chunk ? (char *)s->h + hdr_bytes() : NULL;
    s->pool = s->h->pool_bytes;
    s->pools = s->pool ? (char *)s->h + hdr_bytes() + 2 * ((size_t)s->world + 1) * s->chunk : NULL;
    s->chans = shm_chan_bytes(s->world, s->chunk, &s->ring)
                   ? (char *)s->h + hdr_bytes() + 2 * ((size_t)s->world + 1) * s->chunk +
                         (size_t)s->world * s->pool
                   : NULL;
    *out = s;
    return 0;
}

void shm_name_ranks_from(struct shm *s, int first)
{
    s->first = first;
}

void shm_rdv_close(struct shm *s)
{
    if (!s) return;
    /* After every message it sent is in the channels (release): a peer that sees it gone
     * still takes them. */
    if (s->h && s->chans)
        atomic_store_explicit(&s->h->ranks[s->rank].left, 1, memory_order_release);
    if (s->h) munmap(s->h, s->map_bytes);
    free(s);
}

