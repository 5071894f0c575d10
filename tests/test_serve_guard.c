/*
 * test_serve_guard.c - the daemon as a service shared by the users of a node: what a client
 * (often another user, uid 65534, a member of the daemon's --group) does to what it was
 * given or to the files it can reach must not take the daemon down, hang it, or reach
 * another job.
 *
 * The daemon runs in a thread of the test's process: a SIGBUS in it kills the test. The
 * hostile clients are forked children that drop to uid 65534 where the test runs as root
 * (as in CI); as another user the tests that need two uids are skipped.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/falloc.h>
#include <malloc.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "helpers.h"
#include "pintable.h"
#include "service/client.h"
#include "raw_call.h"
#include "service/proto.h"
#include "service_util.h"

#define NOBODY 65534

static char sockdir[64];
/* The swap directory of write_cfg(true); a test that needs uid 65534 to reach it puts it
 * under the socket's folder (swap_under_sockdir). */
static char swapdir[700];

/* The socket in a folder of its own that uid 65534 can reach (the test's folder may lie
 * under one it cannot traverse). */
static void setup(void)
{
    service_util_setup("guard");
    strcpy(sockdir, "/tmp/zinf-guard-XXXXXX");
    cr_assert_not_null(mkdtemp(sockdir));
    cr_assert_eq(chmod(sockdir, 0711), 0);
    snprintf(sock, sizeof(sock), "%s/zinf.sock", sockdir);
}

static void teardown(void)
{
    swapdir[0] = 0;
    test_rmtree(strdup(sockdir));
    service_util_teardown();
}

TestSuite(serve_guard, .init = setup, .fini = teardown, .timeout = 120);

/* The group uid 65534 is in on Debian: the daemon's --group in these tests. */
static const char *nobody_group(void)
{
    struct group *g = getgrgid(NOBODY);
    return g ? g->gr_name : NULL;
}

static bool as_root(void)
{
    if (geteuid() == 0 && nobody_group()) return true;
    cr_skip_test("needs root (and group %d) to act as a second user", NOBODY);
    return false;
}

/* In a child: every inherited fd but keep (and stdio) closed, then uid (65534, or another
 * user's) and gid 65534 with no other groups. The daemon runs in this process: a child
 * keeping its swap files' fds would keep their locks, and a job closed meanwhile could not
 * open again. */
static void become_keeping(uid_t uid, int keep)
{
    for (int fd = 3; fd < 4096; fd++)
        if (fd != keep) close(fd);
    if (setgroups(0, NULL) != 0 || setresgid(NOBODY, NOBODY, NOBODY) != 0 ||
        setresuid(uid, uid, uid) != 0)
        _exit(90);
}

static void become_nobody_keeping(int keep)
{
    become_keeping(NOBODY, keep);
}

/* A child's report: its failures as text, read by the parent through a pipe. */
struct report {
    int fd;
    int failures;
};

static void say(struct report *rp, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(struct report *rp, const char *fmt, ...)
{
    rp->failures++;
    va_list ap;
    va_start(ap, fmt);
    test_report_line(rp->fd, fmt, ap);
    va_end(ap);
}

/* Runs fn(arg, report) in a child as uid and fails with what it reported. */
static void run_as(uid_t uid, void (*fn)(void *, struct report *), void *arg, const char *what)
{
    int p[2];
    cr_assert_eq(pipe(p), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        become_keeping(uid, p[1]);
        struct report rp = {p[1], 0};
        fn(arg, &rp);
        _exit(rp.failures ? 1 : 0);
    }
    close(p[1]);
    char text[8192];
    size_t got = 0;
    ssize_t r;
    while (got < sizeof(text) - 1 && (r = read(p[0], text + got, sizeof(text) - 1 - got)) > 0)
        got += (size_t)r;
    text[got] = 0;
    close(p[0]);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s (status %#x):\n%s", what, st, text);
}

/* As uid 65534 (the daemon's --group is its group). */
static void run_as_nobody(void (*fn)(void *, struct report *), void *arg, const char *what)
{
    run_as(NOBODY, fn, arg, what);
}

/* ---- raw calls --------------------------------------------------------------------------- */

/* HELLO as a new session of job: the regions' fds and sizes. */
struct hello {
    int fd; /* the connection */
    int nfds;
    int fds[8];
    uint32_t kind[PROTO_MAX_REGIONS];
    uint64_t bytes[PROTO_MAX_REGIONS];
    uint32_t nregions;
};

static int raw_hello(const char *job, struct hello *h)
{
    memset(h, 0, sizeof(*h));
    h->fd = raw_connect();
    struct proto_request q = {.op = PROTO_HELLO};
    snprintf(q.name, sizeof(q.name), "%s", job);
    uint8_t *p = NULL;
    h->nfds = 8;
    size_t len = 0;
    int r = raw_call(h->fd, &q, &p, &len, h->fds, &h->nfds);
    if (r == 0) {
        struct proto_in in;
        proto_in_init(&in, p, len);
        proto_get_i32(&in);
        proto_get_u64(&in);
        proto_get_u64(&in);
        h->nregions = proto_get_u32(&in);
        for (uint32_t i = 0; i < h->nregions && i < PROTO_MAX_REGIONS; i++) {
            h->kind[i] = proto_get_u32(&in);
            h->bytes[i] = proto_get_u64(&in);
        }
    }
    free(p);
    return r;
}

static int raw_register(int fd, const char *name, uint64_t bytes, uint32_t home, uint64_t *t)
{
    struct proto_request q = {.op = PROTO_REGISTER, .handle = bytes, .tier = home};
    snprintf(q.name, sizeof(q.name), "%s", name);
    uint8_t *p = NULL;
    int r = raw_call(fd, &q, &p, NULL, NULL, NULL);
    if (r == 0) memcpy(t, p + 4, 8);
    free(p);
    return r;
}

/* ---- 1, 2: what a client was given -------------------------------------------------------- */

/* Every size, seal and mapping trick on each memfd the daemon handed over, then calls that
 * make the daemon touch that memory. */
static void hostile_memfds(void *arg, struct report *rp)
{
    struct hello h;
    int r = raw_hello("hostile", &h);
    if (r != 0) {
        say(rp, "HELLO: %s", zinf_strerror(r));
        return;
    }
    if (h.nfds < 3) say(rp, "HELLO gave %d fds, not the arenas, the pin table and liveness", h.nfds);
    for (int i = 0; i < h.nfds; i++) {
        int f = h.fds[i];
        struct stat st;
        if (fstat(f, &st) != 0) {
            say(rp, "fd %d: fstat: %s", i, strerror(errno));
            continue;
        }
        int seals = fcntl(f, F_GET_SEALS);
        int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
        if (seals < 0 || (seals & want) != want)
            say(rp, "fd %d (%lld bytes): seals %#x, not shrink, grow and seal", i,
                (long long)st.st_size, seals);
        if (ftruncate(f, 0) == 0) say(rp, "fd %d: truncated to 0 bytes", i);
        if (ftruncate(f, st.st_size / 2) == 0) say(rp, "fd %d: truncated to half", i);
        if (ftruncate(f, st.st_size + 4096) == 0) say(rp, "fd %d: grown", i);
        if (fallocate(f, 0, st.st_size, 1 << 20) == 0) say(rp, "fd %d: grown by fallocate", i);
        if (fcntl(f, F_ADD_SEALS, F_SEAL_WRITE) == 0) say(rp, "fd %d: sealed against writes", i);
#ifdef F_SEAL_FUTURE_WRITE
        if (fcntl(f, F_ADD_SEALS, F_SEAL_FUTURE_WRITE) == 0)
            say(rp, "fd %d: sealed against future writes", i);
#endif
        if (i < (int)h.nregions && h.kind[i] == PROTO_REGION_LIVE) {
            /* The session's liveness mutex: the daemon's alone to write. */
            if (fallocate(f, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, st.st_size) == 0)
                say(rp, "fd %d (liveness): a hole punched", i);
            if (pwrite(f, "x", 1, 0) == 1) say(rp, "fd %d (liveness): written", i);
            void *w = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
            if (w != MAP_FAILED) say(rp, "fd %d (liveness): mapped writable", i);
            void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, f, 0);
            if (m == MAP_FAILED)
                say(rp, "fd %d (liveness): mmap read-only: %s", i, strerror(errno));
            else if (mprotect(m, (size_t)st.st_size, PROT_READ | PROT_WRITE) == 0)
                say(rp, "fd %d (liveness): a read-only mapping made writable", i);
            continue;
        }
        /* Allowed, and only the caller's own job's bytes: they read as zeros after. */
        if (fallocate(f, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, st.st_size) != 0 &&
            errno != EOPNOTSUPP)
            say(rp, "fd %d: punching a hole: %s", i, strerror(errno));
        /* Garbage everywhere a mapping reaches: the arenas and the pin table. */
        void *m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
        if (m == MAP_FAILED) {
            say(rp, "fd %d: mmap: %s", i, strerror(errno));
            continue;
        }
        test_fill_random(m, (size_t)st.st_size, 77 + (uint64_t)i);
        munmap(m, (size_t)st.st_size);
    }
    /* Calls that make the daemon touch the job's memory and the session's table. */
    uint64_t t = 0;
    char name[32];
    snprintf(name, sizeof(name), "x%d", *(int *)arg);
    if ((r = raw_register(h.fd, name, 65536, ZINF_TIER_HOST, &t)) != 0)
        say(rp, "REGISTER after the tricks: %s", zinf_strerror(r));
    for (uint32_t tier = 0; tier < 2; tier++) {
        struct proto_request q = {.op = PROTO_FETCH, .handle = t, .tier = tier};
        if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != 0)
            say(rp, "FETCH to tier %u: %s", tier, zinf_strerror(r));
        q = (struct proto_request){.op = PROTO_RELEASE, .handle = t, .tier = tier,
                                   .flags = ZINF_RELEASE_DIRTY};
        if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != 0)
            say(rp, "RELEASE of tier %u: %s", tier, zinf_strerror(r));
    }
    /* Spent releases (ZINF_RELEASE_ZERO): of pins it does not hold, with flags mixed or
     * unknown, then of one it holds: refused where they must be, the pin kept, and never
     * another job's tensor (handles are the job's). */
    uint64_t u = 0;
    snprintf(name, sizeof(name), "z%d", *(int *)arg);
    if ((r = raw_register(h.fd, name, 65536, ZINF_TIER_NVME, &u)) != 0)
        say(rp, "REGISTER on NVMe: %s", zinf_strerror(r));
    const uint32_t bad[] = {ZINF_RELEASE_ZERO, ZINF_RELEASE_ZERO | ZINF_RELEASE_DIRTY, ~0u};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        uint64_t handles[] = {u, t, 1, u ^ (1ull << 40)};
        for (size_t k = 0; k < sizeof(handles) / sizeof(handles[0]); k++) {
            struct proto_request q = {.op = PROTO_RELEASE, .handle = handles[k],
                                      .tier = ZINF_TIER_HOST, .flags = bad[i]};
            if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != -EINVAL)
                say(rp, "RELEASE %#x of an unpinned handle %zu: %s, not -EINVAL", bad[i], k,
                    zinf_strerror(r));
        }
    }
    struct proto_request q = {.op = PROTO_FETCH, .handle = u, .tier = ZINF_TIER_HOST};
    if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != 0)
        say(rp, "FETCH of the NVMe tensor: %s", zinf_strerror(r));
    q = (struct proto_request){.op = PROTO_RELEASE, .handle = u, .tier = ZINF_TIER_HOST,
                               .flags = ZINF_RELEASE_ZERO | ZINF_RELEASE_DIRTY};
    if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != -EINVAL)
        say(rp, "RELEASE dirty and spent: %s, not -EINVAL", zinf_strerror(r));
    q.flags = ZINF_RELEASE_ZERO;
    if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != 0)
        say(rp, "RELEASE spent of the pin it kept: %s", zinf_strerror(r));
    if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != -EINVAL)
        say(rp, "RELEASE spent twice: %s, not -EINVAL", zinf_strerror(r));
    /* ZERO (zinf_zero, no pin): of handles that name nothing or a home in memory, of its
     * tensor while it holds it, then of its tensor. */
    const uint64_t nothing[] = {t, 1, u ^ (1ull << 40), ~0ull, 0};
    for (size_t k = 0; k < sizeof(nothing) / sizeof(nothing[0]); k++) {
        q = (struct proto_request){.op = PROTO_ZERO, .handle = nothing[k]};
        if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != -EINVAL)
            say(rp, "ZERO of handle %zu: %s, not -EINVAL", k, zinf_strerror(r));
    }
    q = (struct proto_request){.op = PROTO_FETCH, .handle = u, .tier = ZINF_TIER_DEVICE};
    if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != 0)
        say(rp, "FETCH of the zeroed tensor: %s", zinf_strerror(r));
    q = (struct proto_request){.op = PROTO_ZERO, .handle = u};
    if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != -EBUSY)
        say(rp, "ZERO of a tensor it holds: %s, not -EBUSY", zinf_strerror(r));
    q = (struct proto_request){.op = PROTO_RELEASE, .handle = u, .tier = ZINF_TIER_DEVICE};
    if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != 0)
        say(rp, "RELEASE of the zeroed tensor: %s", zinf_strerror(r));
    q = (struct proto_request){.op = PROTO_ZERO, .handle = u};
    if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != 0)
        say(rp, "ZERO of its tensor: %s", zinf_strerror(r));
    q = (struct proto_request){.op = PROTO_STEP};
    if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != 0) say(rp, "STEP: %s", zinf_strerror(r));
    q = (struct proto_request){.op = PROTO_FLUSH};
    if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) < 0) say(rp, "FLUSH: %s", zinf_strerror(r));
    for (int i = 0; i < h.nfds; i++)
        close(h.fds[i]);
    close(h.fd);
}

/* Items 1 and 2: a client shrinks, grows, seals and scribbles on every memfd it was given,
 * and the daemon, another user's job on it, and that job's fast path all go on; SIGTERM then
 * flushes that job, and a restart brings its bytes back. */
Test(serve_guard, a_client_cannot_break_the_memory_it_was_given)
{
    if (!as_root()) return;
    write_cfg(true);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    zinf_engine *v = connect_job("victim");
    const size_t n = 100000;
    zinf_tensor t = test_register(v, "kept", n, ZINF_TIER_NVME);
    unsigned char *want = test_rand_buf(n, 5);
    cr_assert_eq(zinf_write(v, t, 0, want, n), 0);
    void *p;
    cr_assert_eq(zinf_fetch(v, t, ZINF_TIER_HOST, &p), 0);
    cr_assert_eq(zinf_release(v, t, ZINF_TIER_HOST, 0), 0);

    for (int round = 0; round < 2; round++)
        run_as_nobody(hostile_memfds, &round, "a hostile client's tricks");

    /* The victim's hit path still works (its session's liveness is its own), and so do
     * its messages. */
    struct zinf_stats st0, st1;
    cr_assert_eq(zinf_stats(v, &st0), 0);
    for (int i = 0; i < 10; i++) {
        cr_assert_eq(zinf_fetch(v, t, ZINF_TIER_HOST, &p), 0);
        cr_assert_eq(memcmp(p, want, n), 0);
        cr_assert_eq(zinf_release(v, t, ZINF_TIER_HOST, 0), 0);
    }
    cr_assert_eq(zinf_stats(v, &st1), 0);
    cr_assert_eq(st1.tier[ZINF_TIER_HOST].hits - st0.tier[ZINF_TIER_HOST].hits, 10,
                 "the victim's fetches stopped hitting its table");
    test_expect_content(v, t, want, n, "after the hostile client");
    zinf_close(v);
    daemon_stop(&d);

    daemon_start(&d);
    v = connect_job("victim");
    cr_assert_eq(zinf_lookup(v, "kept", &t), 0);
    test_expect_content(v, t, want, n, "after SIGTERM's flush and a restart");
    zinf_close(v);
    daemon_stop(&d);
    free(want);
}

/* ---- 9: errors keep the connection ---------------------------------------------------------- */

/* Flips one byte of the only place needle lies in the job's swap file. */
static void damage_swap(const char *job, const unsigned char *needle, size_t len)
{
    char p[700];
    snprintf(p, sizeof(p), "%s/swap/%s/zinf-swap.0", dir, job);
    int fd = open(p, O_RDWR);
    cr_assert_geq(fd, 0, "%s: %s", p, strerror(errno));
    struct stat st;
    cr_assert_eq(fstat(fd, &st), 0);
    unsigned char *buf = malloc((size_t)st.st_size);
    cr_assert_eq(pread(fd, buf, (size_t)st.st_size, 0), st.st_size);
    unsigned char *hit = memmem(buf, (size_t)st.st_size, needle, len);
    cr_assert_not_null(hit, "the tensor's bytes are in %s", p);
    unsigned char c = hit[len / 2] ^ 0x40;
    cr_assert_eq(pwrite(fd, &c, 1, (off_t)(hit - buf) + (off_t)(len / 2)), 1);
    close(fd);
    free(buf);
}

/* Item 9: reading a damaged tensor answers -EBADMSG, as documented, and the same pooled
 * connection then serves the next call, on a healthy tensor. */
Test(serve_guard, a_damaged_tensor_answers_ebadmsg_and_the_connection_stays)
{
    write_cfg(true);
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("damaged");
    const size_t n = 65536;
    zinf_tensor bad = test_register(e, "bad", n, ZINF_TIER_NVME);
    zinf_tensor good = test_register(e, "good", n, ZINF_TIER_NVME);
    unsigned char *a = test_rand_buf(n, 21), *b = test_rand_buf(n, 22);
    cr_assert_eq(zinf_write(e, bad, 0, a, n), 0);
    cr_assert_eq(zinf_write(e, good, 0, b, n), 0);
    cr_assert_eq(zinf_flush(e), 0);
    zinf_close(e);
    daemon_stop(&d);
    damage_swap("damaged", a, n);

    daemon_start(&d);
    e = connect_job("damaged");
    cr_assert_eq(zinf_lookup(e, "bad", &bad), 0);
    cr_assert_eq(zinf_lookup(e, "good", &good), 0);
    unsigned char *got = malloc(n);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(zinf_read(e, bad, 0, got, n), -EBADMSG, "round %d", i);
        cr_assert_eq(zinf_read(e, good, 0, got, n), 0, "round %d: the call after -EBADMSG", i);
        cr_assert_eq(memcmp(got, b, n), 0);
        void *p;
        cr_assert_eq(zinf_fetch(e, bad, ZINF_TIER_HOST, &p), -EBADMSG);
        cr_assert_eq(zinf_fetch(e, good, ZINF_TIER_HOST, &p), 0);
        cr_assert_eq(zinf_release(e, good, ZINF_TIER_HOST, 0), 0);
    }
    free(got);
    free(a);
    free(b);
    zinf_close(e);
    daemon_stop(&d);
}

/* ---- 3, 4, 5, 8: the daemon's folders are its own ------------------------------------------ */

/* service_open() of cfg_path: its result, the reason in err. */
static int try_open(char *err, size_t errlen)
{
    struct zinf_config cfg;
    struct service *s = NULL;
    cr_assert_eq(config_parse_file(cfg_path, &cfg, err, errlen), 0, "%s", err);
    struct service_opts o = {.socket_path = sock, .config = &cfg};
    int r = service_open(&o, &s, err, errlen);
    if (r == 0) service_close(s);
    config_free(&cfg);
    return r;
}

static void write_cfg_at(const char *swap)
{
    FILE *f = fopen(cfg_path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s\"}}, \"aio\": {\"block_size\": 65536, \"queue_depth\": 8},"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"4M\", \"host_bytes\": \"4M\"}}",
            swap);
    fclose(f);
}

static void mkdir_as_nobody(void *arg, struct report *rp)
{
    if (mkdir(arg, 0777) != 0) say(rp, "mkdir %s: %s", (char *)arg, strerror(errno));
    chmod(arg, 0777);
}

/* Item 8: a swap directory another user made first (in a sticky folder anyone may write, as
 * /tmp), or one others can write, or under a folder others can write, is refused at start
 * with its path, its owner and the fix; one the daemon owns alone is taken. */
Test(serve_guard, a_squatted_or_open_swap_directory_is_refused_at_start)
{
    if (!as_root()) return;
    /* Under the socket's folder (0711, in /tmp): uid 65534 can reach it wherever the test's
     * folder lies. */
    char err[1024], sticky[700], swap[800];
    snprintf(sticky, sizeof(sticky), "%s/shared", sockdir);
    cr_assert_eq(mkdir(sticky, 0700), 0);
    cr_assert_eq(chmod(sticky, 01777), 0);
    snprintf(swap, sizeof(swap), "%s/swap", sticky);
    run_as_nobody(mkdir_as_nobody, swap, "the other user squats the swap directory");
    write_cfg_at(swap);
    cr_assert_eq(try_open(err, sizeof(err)), -EPERM);
    cr_assert(strstr(err, swap) && strstr(err, "belongs to uid 65534") && strstr(err, "chown 0"),
              "%s", err);
    /* The daemon's, but open to everyone. */
    cr_assert_eq(chown(swap, 0, 0), 0);
    cr_assert_eq(try_open(err, sizeof(err)), -EPERM);
    cr_assert(strstr(err, "mode 0777") && strstr(err, "chmod 0700"), "%s", err);
    /* Its own alone, in the sticky folder: taken. */
    cr_assert_eq(chmod(swap, 0700), 0);
    cr_assert_eq(try_open(err, sizeof(err)), 0, "%s", err);
    /* Under a folder anyone may write, without the sticky bit: refused, that folder named. */
    cr_assert_eq(chmod(sticky, 0777), 0);
    cr_assert_eq(try_open(err, sizeof(err)), -EPERM);
    cr_assert(strstr(err, "the folder") && strstr(err, sticky) && strstr(err, "mode 0777"), "%s",
              err);
    cr_assert_eq(chmod(sticky, 0755), 0);
    /* Reached through a link: the folder it leads to is the one checked. */
    char link[800];
    snprintf(link, sizeof(link), "%s/link", dir);
    cr_assert_eq(symlink(swap, link), 0);
    cr_assert_eq(chown(swap, NOBODY, 0), 0);
    write_cfg_at(link);
    cr_assert_eq(try_open(err, sizeof(err)), -EPERM);
    cr_assert(strstr(err, swap) && strstr(err, "uid 65534"), "%s", err);
    cr_assert_eq(chown(swap, 0, 0), 0);
    cr_assert_eq(try_open(err, sizeof(err)), 0, "%s", err);
    rmdir(swap);
    rmdir(sticky);
    /* Not a folder: refused. */
    char file[800];
    snprintf(file, sizeof(file), "%s/a-file", dir);
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fclose(f);
    write_cfg_at(file);
    cr_assert_lt(try_open(err, sizeof(err)), 0);
    cr_assert(strstr(err, file), "%s", err);
    /* Missing: made, the daemon's alone. */
    snprintf(swap, sizeof(swap), "%s/new-swap", dir);
    write_cfg_at(swap);
    cr_assert_eq(try_open(err, sizeof(err)), 0, "%s", err);
    struct stat st;
    cr_assert_eq(stat(swap, &st), 0);
    cr_assert_eq(st.st_mode & 07777, 0700);
}


static void swap_under_sockdir(void)
{
    snprintf(swapdir, sizeof(swapdir), "%s/swap", sockdir);
    write_cfg_at(swapdir);
}

/* A job's folder as the daemon makes it: 0700, with its owner named. */
static void make_job_folder(const char *job, uid_t owner)
{
    char p[800], f[900];
    if (!swapdir[0]) snprintf(swapdir, sizeof(swapdir), "%s/swap", dir);
    mkdir(swapdir, 0700);
    snprintf(p, sizeof(p), "%s/%s", swapdir, job);
    cr_assert_eq(mkdir(p, 0700), 0);
    snprintf(f, sizeof(f), "%s/zinf-owner", p);
    FILE *o = fopen(f, "w");
    cr_assert_not_null(o);
    fprintf(o, "%u\n", (unsigned)owner);
    fclose(o);
}

static char *job_file(const char *job, const char *name)
{
    static char p[4][900];
    static int k;
    char *b = p[k++ % 4];
    if (!swapdir[0]) snprintf(swapdir, sizeof(swapdir), "%s/swap", dir);
    snprintf(b, sizeof(p[0]), "%s/%s/%s", swapdir, job, name);
    return b;
}

/* A root-only file the daemon must never write or read for a client. */
static char *secret_file(void)
{
    static char p[700];
    snprintf(p, sizeof(p), "%s/root-only", dir);
    FILE *f = fopen(p, "w");
    cr_assert_not_null(f);
    fputs("root's own\n", f);
    fclose(f);
    cr_assert_eq(chmod(p, 0600), 0);
    return p;
}

static void expect_file(const char *p, const char *want)
{
    char buf[64] = "";
    FILE *f = fopen(p, "r");
    cr_assert_not_null(f, "%s", p);
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    buf[n] = 0;
    fclose(f);
    cr_assert_str_eq(buf, want, "%s was written", p);
}

static void attach_as_nobody(void *arg, struct report *rp)
{
    zinf_engine *e;
    int r = zinf_connect(sock, arg, &e);
    if (r == 0)
        zinf_close(e);
    else
        say(rp, "job %s: %s", (char *)arg, zinf_strerror(r));
}

static void refused_as_nobody(void *arg, struct report *rp)
{
    zinf_engine *e;
    int r = zinf_connect(sock, arg, &e);
    if (r == 0) {
        say(rp, "attached to job %s", (char *)arg);
        zinf_close(e);
    }
}

static void write_in_folder_as_nobody(void *arg, struct report *rp)
{
    int fd = open(arg, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd >= 0) {
        say(rp, "made %s", (char *)arg);
        close(fd);
    }
}

/* Items 3 and 8: job folders are made by the daemon, 0700, its own, never given to the job's
 * user, who cannot put anything in them; a folder another user owns (one made by an earlier
 * zinf, or squatted) is refused with the fix, and nothing in it is followed or written. */
Test(serve_guard, job_folders_are_the_daemons_and_others_are_refused)
{
    if (!as_root()) return;
    swap_under_sockdir(); /* uid 65534 reaches the folder above its job's */
    char *secret = secret_file();
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    /* Made by the first HELLO, a second user's job: the daemon's folder. */
    run_as_nobody(attach_as_nobody, "mine", "uid 65534 attaches to a job of its own");
    struct stat st;
    char p[900];
    snprintf(p, sizeof(p), "%s/mine", swapdir);
    cr_assert_eq(lstat(p, &st), 0);
    cr_assert(S_ISDIR(st.st_mode) && st.st_uid == 0 && (st.st_mode & 07777) == 0700,
              "uid %u mode %o", st.st_uid, st.st_mode & 07777);
    expect_file(job_file("mine", "zinf-owner"), "65534\n");
    run_as_nobody(write_in_folder_as_nobody, job_file("mine", "zinf-manifest.json.tmp"),
                  "uid 65534 plants a file in its job's folder");
    /* Another user's: refused to root too, with the fix; the link it holds is not followed. */
    snprintf(p, sizeof(p), "%s/legacy", swapdir);
    cr_assert_eq(mkdir(p, 0700), 0);
    cr_assert_eq(symlink(secret, job_file("legacy", "zinf-manifest.json.tmp")), 0);
    cr_assert_eq(lchown(job_file("legacy", "zinf-manifest.json.tmp"), NOBODY, NOBODY), 0);
    cr_assert_eq(chown(p, NOBODY, NOBODY), 0);
    test_log_capture_start();
    zinf_engine *e;
    cr_assert_eq(zinf_connect(sock, "legacy", &e), -EACCES);
    const char *log = test_log_text();
    cr_assert(strstr(log, p) && strstr(log, "belongs to uid 65534") && strstr(log, "chown -R 0"),
              "%s", log);
    test_log_capture_stop();
    expect_file(secret, "root's own\n");
    /* Nor removed: zinf job rm leaves a folder that is not the daemon's alone. */
    cr_assert_eq(service_manage(sock, PROTO_JOB_REMOVE, "legacy"), -EACCES);
    cr_assert_eq(lstat(job_file("legacy", "zinf-manifest.json.tmp"), &st), 0);
    expect_file(secret, "root's own\n");
    /* The daemon's folder with a link in it (an earlier zinf's, or an admin's mistake): a
     * flush replaces the link and writes nothing through it. */
    zinf_engine *r = connect_job("planted");
    zinf_tensor t = test_register(r, "t", 65536, ZINF_TIER_NVME);
    cr_assert_eq(zinf_write(r, t, 0, "kept", 4), 0);
    cr_assert_eq(symlink(secret, job_file("planted", "zinf-manifest.json.tmp")), 0);
    cr_assert_eq(zinf_flush(r), 0);
    expect_file(secret, "root's own\n");
    cr_assert_eq(lstat(job_file("planted", "zinf-manifest.json"), &st), 0);
    cr_assert(S_ISREG(st.st_mode));
    zinf_close(r);
    daemon_stop(&d);
}

/* Item 4: links in a job's folder to another job's manifest and swap file (they cannot come
 * from a client any more; an earlier zinf let them): the job is refused at resume, and its
 * user never reads the other job's bytes. */
Test(serve_guard, links_to_another_jobs_files_are_not_followed)
{
    if (!as_root()) return;
    write_cfg(true);
    cr_assert_eq(chmod(dir, 0711), 0);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    zinf_engine *v = connect_job("victim");
    zinf_tensor t = test_register(v, "secret", 65536, ZINF_TIER_NVME);
    cr_assert_eq(zinf_write(v, t, 0, "victim's bytes", 14), 0);
    cr_assert_eq(zinf_flush(v), 0);
    zinf_close(v);
    daemon_stop(&d);
    make_job_folder("thief", NOBODY);
    cr_assert_eq(symlink("../victim/zinf-manifest.json", job_file("thief", "zinf-manifest.json")), 0);
    cr_assert_eq(symlink("../victim/zinf-swap.0", job_file("thief", "zinf-swap.0")), 0);
    daemon_start_group(&d, nobody_group());
    test_log_capture_start();
    zinf_engine *e;
    cr_assert_lt(zinf_connect(sock, "thief", &e), 0, "a job resumed through links");
    cr_assert(strstr(test_log_text(), "symbolic link"), "%s", test_log_text());
    test_log_capture_stop();
    run_as_nobody(refused_as_nobody, "thief", "uid 65534 attaches to the linked job");
    v = connect_job("victim");
    cr_assert_eq(zinf_lookup(v, "secret", &t), 0);
    test_expect_content(v, t, (const unsigned char *)"victim's bytes", 14, "the victim's job");
    zinf_close(v);
    daemon_stop(&d);
}

/* uid 65534 on a job of its own asks the daemon what the handles of root's job are: its
 * own job holds no tensor, so every handle is unknown there (-ENOENT), root's included,
 * and nothing of root's tensor (home, size) comes back. */
static void tensor_info_as_nobody(void *arg, struct report *rp)
{
    zinf_tensor theirs = *(zinf_tensor *)arg;
    zinf_engine *e;
    int r = zinf_connect(sock, "prober", &e);
    if (r < 0) {
        say(rp, "cannot attach to a job of its own: %s", zinf_strerror(r));
        return;
    }
    const zinf_tensor probes[] = {theirs, theirs + 1, 1, 0, ~(zinf_tensor)0};
    for (size_t i = 0; i < sizeof(probes) / sizeof(probes[0]); i++) {
        struct zinf_tensor_info ti = {.bytes = 12345};
        r = zinf_tensor_info(e, probes[i], &ti);
        if (r != -ENOENT && r != -EINVAL)
            say(rp, "tensor_info of handle %llu: %d (bytes %llu)", (unsigned long long)probes[i],
                r, (unsigned long long)ti.bytes);
    }
    zinf_close(e);
}

/* A tensor's home and size (TENSOR_INFO) are asked of the caller's own job only. */
Test(serve_guard, tensor_info_sees_the_callers_job_only)
{
    if (!as_root()) return;
    write_cfg(false);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    zinf_engine *v = connect_job("owner");
    zinf_tensor t = test_register(v, "private", 3 * 65536, ZINF_TIER_HOST);
    struct zinf_tensor_info ti;
    cr_assert_eq(zinf_tensor_info(v, t, &ti), 0);
    cr_assert_eq(ti.bytes, 3 * 65536);
    run_as_nobody(tensor_info_as_nobody, &t, "uid 65534 asks for root's handles");
    cr_assert_eq(zinf_tensor_info(v, t, &ti), 0, "the owner's job goes on");
    zinf_close(v);
    daemon_stop(&d);
}

struct fifo_probe {
    int status_r, hello_r, other_r;
    size_t njobs;
};

static void *fifo_calls(void *arg)
{
    struct fifo_probe *fp = arg;
    zinf_engine *e;
    fp->hello_r = zinf_connect(sock, "fifo", &e);
    if (fp->hello_r == 0) zinf_close(e);
    struct service_job_status *js = NULL;
    fp->status_r = service_status(sock, &js, &fp->njobs);
    free(js);
    fp->other_r = zinf_connect(sock, "other", &e);
    if (fp->other_r == 0) zinf_close(e);
    return NULL;
}

/* Item 5: a FIFO in place of a job's manifest (and of its swap file) hangs nothing: the
 * job's HELLO fails, STATUS and every other job's HELLO answer at once. */
Test(serve_guard, a_fifo_in_a_jobs_folder_hangs_nothing)
{
    write_cfg(true);
    make_job_folder("fifo", geteuid());
    make_job_folder("fifo2", geteuid());
    cr_assert_eq(mkfifo(job_file("fifo", "zinf-manifest.json"), 0600), 0);
    cr_assert_eq(mkfifo(job_file("fifo2", "zinf-swap.0"), 0600), 0);
    struct daemon d;
    daemon_start(&d);
    struct fifo_probe fp = {1, 1, 1, 0};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, fifo_calls, &fp), 0);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 20;
    int r = pthread_timedjoin_np(th, NULL, &until);
    cr_assert_eq(r, 0, "a FIFO in a job's folder hung the daemon");
    cr_assert_lt(fp.hello_r, 0, "a job resumed from a FIFO");
    cr_assert_eq(fp.status_r, 0);
    cr_assert_eq(fp.other_r, 0);
    zinf_engine *e;
    cr_assert_lt(zinf_connect(sock, "fifo2", &e), 0, "a job swapped to a FIFO");
    daemon_stop(&d);
}

/* ---- 10: a large zinf_write is whole ------------------------------------------------------ */

static void write_cfg_big(void)
{
    FILE *f = fopen(cfg_path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"64M\", "
               "\"host_bytes\": \"80M\", \"serve\": {\"write_stage_bytes\": \"40M\"}}}");
    fclose(f);
}

#define BIG ((size_t)16 << 20)

/* Whether all of buf is one byte; that byte in *v. */
static bool uniform(const unsigned char *buf, size_t n, unsigned char *v)
{
    *v = buf[0];
    for (size_t i = 0; i < n; i++)
        if (buf[i] != *v) return false;
    return true;
}

struct reader {
    zinf_engine *e;
    zinf_tensor t;
    atomic_bool stop;
    unsigned reads, mixed;
};

static void *read_loop(void *arg)
{
    struct reader *rd = arg;
    unsigned char *buf = malloc(BIG), v;
    while (!atomic_load(&rd->stop)) {
        if (zinf_read(rd->e, rd->t, 0, buf, BIG) != 0) continue;
        rd->reads++;
        rd->mixed += !uniform(buf, BIG, &v);
    }
    free(buf);
    return NULL;
}

/* Item 10: a client killed inside 16 MiB writes leaves the tensor as one of its writes
 * left it, never half old and half new; another session reading all along never sees a
 * mix; a write larger than the session may stage is refused, and nothing of it applied. */
Test(serve_guard, a_large_write_through_the_daemon_is_whole)
{
    write_cfg_big();
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("atomic");
    zinf_tensor t = test_register(e, "big", BIG, ZINF_TIER_HOST);
    unsigned char *buf = malloc(BIG), v;
    memset(buf, 1, BIG);
    cr_assert_eq(zinf_write(e, t, 0, buf, BIG), 0);
    struct reader rd = {.e = connect_job("atomic"), .t = t};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, read_loop, &rd), 0);
    uint64_t seed = 7;
    for (int round = 0; round < 8; round++) {
        pid_t pid = fork();
        cr_assert_geq(pid, 0);
        if (pid == 0) {
            zinf_engine *c;
            if (zinf_connect(sock, "atomic", &c) != 0) _exit(1);
            unsigned char *b = malloc(BIG);
            for (unsigned k = 2;; k++) {
                memset(b, (int)(k & 0xff), BIG);
                if (zinf_write(c, t, 0, b, BIG) != 0) _exit(2);
            }
        }
        struct timespec ts = {0, (long)(test_rand(&seed) % 150) * 1000000 + 5000000};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
        int st;
        waitpid(pid, &st, 0);
        cr_assert(WIFSIGNALED(st), "the writer failed: %#x", st);
        cr_assert_eq(zinf_read(e, t, 0, buf, BIG), 0);
        cr_assert(uniform(buf, BIG, &v), "round %d: a killed writer left a mix", round);
    }
    atomic_store(&rd.stop, true);
    pthread_join(th, NULL);
    cr_assert_gt(rd.reads, 0);
    cr_assert_eq(rd.mixed, 0, "%u of %u reads saw a write half done", rd.mixed, rd.reads);
    /* More than the session may stage: refused whole, nothing applied. */
    zinf_tensor huge = test_register(e, "huge", 48u << 20, ZINF_TIER_HOST);
    unsigned char *h = calloc(1, 48u << 20);
    memset(h, 9, 48u << 20);
    cr_assert_eq(zinf_write(e, huge, 0, h, 48u << 20), -EMSGSIZE);
    cr_assert_eq(zinf_read(e, huge, 0, h, 48u << 20), -EMSGSIZE);
    cr_assert_eq(zinf_read(e, huge, 0, h, 1 << 20), 0);
    cr_assert(uniform(h, 1 << 20, &v) && v == 0, "a refused write left bytes");
    free(h);
    /* A staged write past the end is refused before any byte moves, as embedded. */
    cr_assert_eq(zinf_write(e, t, 1, buf, BIG), -EINVAL);
    zinf_close(rd.e);
    zinf_close(e);
    free(buf);
    daemon_stop(&d);
}

/* ---- 6, 7: limits ------------------------------------------------------------------------ */

static void write_cfg_limits(void)
{
    FILE *f = fopen(cfg_path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s/swap\"}}, \"aio\": {\"block_size\": 65536, \"queue_depth\": 8},"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"4M\", \"host_bytes\": "
            "\"4M\", \"serve\": {\"jobs_per_uid\": 2, \"sessions_per_uid\": 3, "
            "\"connections_per_uid\": 8, \"max_connections\": 40, \"reserved_connections\": 8, "
            "\"hello_timeout\": 1, \"idle_job_close\": 1}}}",
            dir);
    fclose(f);
}

static unsigned open_fds(void)
{
    unsigned n = 0;
    DIR *d = opendir("/proc/self/fd");
    cr_assert_not_null(d);
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

/* A HELLO for job on a raw connection: the result, and the reason the reply carries. */
static int hello_why(int fd, const char *job, char *why, size_t len)
{
    struct proto_request q = {.op = PROTO_HELLO};
    snprintf(q.name, sizeof(q.name), "%s", job);
    uint8_t *p = NULL;
    int fds[8], nfds = 8;
    size_t plen = 0;
    int r = raw_call(fd, &q, &p, &plen, fds, &nfds);
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    why[0] = 0;
    if (r < 0 && p) {
        struct proto_in in;
        proto_in_init(&in, p, plen);
        proto_get_i32(&in);
        proto_get_str(&in, why, len - 1);
    }
    free(p);
    return r;
}

/* Item 6 as the second user: two jobs, three sessions; the third job and the fourth
 * session are refused with the limit named. */
static void over_the_job_and_session_limits(void *arg, struct report *rp)
{
    (void)arg;
    zinf_engine *e[4] = {0};
    int r;
    test_log_capture_start();
    if ((r = zinf_connect(sock, "a", &e[0])) || (r = zinf_connect(sock, "b", &e[1])))
        say(rp, "the first two jobs: %s", zinf_strerror(r));
    if ((r = zinf_connect(sock, "c", &e[2])) != -EUSERS)
        say(rp, "a third job: %s, not -EUSERS", zinf_strerror(r));
    if (!strstr(test_log_text(), "jobs_per_uid"))
        say(rp, "the refusal does not name the limit: %s", test_log_text());
    if ((r = zinf_connect(sock, "a", &e[2])))
        say(rp, "a third session: %s", zinf_strerror(r));
    if ((r = zinf_connect(sock, "b", &e[3])) != -EUSERS)
        say(rp, "a fourth session: %s, not -EUSERS", zinf_strerror(r));
    if (!strstr(test_log_text(), "sessions_per_uid"))
        say(rp, "the refusal does not name the limit: %s", test_log_text());
    test_log_capture_stop();
    /* Through a session, a tensor to find again after the job was closed for idleness. */
    zinf_tensor t;
    if (e[0] && ((r = zinf_register(e[0], "kept", 8192, ZINF_TIER_NVME, &t)) ||
                 (r = zinf_write(e[0], t, 0, "idle-closed", 11))))
        say(rp, "a tensor in job a: %s", zinf_strerror(r));
    for (int i = 0; i < 4; i++)
        zinf_close(e[i]);
}

/* Whether the daemon keeps fd open: what it sent before it closed it (a refusal) is read. */
static bool still_open(int fd)
{
    char buf[512];
    for (;;) {
        ssize_t r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (r > 0) continue;
        return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
}

/* Item 7 as the second user: 60 connections that never say HELLO. Its own limit (8)
 * refuses the rest at once: each is told so, the limit named, and closed, holding no slot
 * of max_connections; the silent ones are closed after hello_timeout. */
static void silent_connections(void *arg, struct report *rp)
{
    int *ready = arg;
    int fd[60], n = 0;
    for (int i = 0; i < 60; i++) {
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        strcpy(a.sun_path, sock);
        fd[n] = socket(AF_UNIX, SOCK_STREAM, 0);
        if (fd[n] >= 0 && connect(fd[n], (struct sockaddr *)&a, sizeof(a)) == 0) n++;
    }
    char why[512];
    int r = hello_why(fd[n - 1], "x", why, sizeof(why));
    if (r >= 0 || (r == -EUSERS && !strstr(why, "connections_per_uid")))
        say(rp, "a connection over the uid's limit: %s (%s)", zinf_strerror(r), why);
    char one = 1;
    if (write(ready[1], &one, 1) != 1) say(rp, "the pipe");
    /* The daemon closes the silent ones after the deadline (1 s, swept every second). */
    struct timespec ts = {3, 500000000};
    nanosleep(&ts, NULL);
    unsigned open = 0;
    for (int i = 0; i < n; i++) {
        open += still_open(fd[i]);
        close(fd[i]);
    }
    if (open) say(rp, "%u silent connections still open after the HELLO deadline", open);
}

/* Items 6 and 7: a second user's jobs, sessions and connections are bounded and refused
 * with the limit named; root attaches at once meanwhile; silent connections
 * go after hello_timeout; jobs without a client are closed after idle_job_close (their
 * memory and fds given back) and come back as they were flushed. */
Test(serve_guard, limits_bound_a_users_jobs_sessions_and_connections, .timeout = 60)
{
    if (!as_root()) return;
    write_cfg_limits();
    cr_assert_eq(chmod(dir, 0711), 0);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    zinf_engine *warm = connect_job("root-job");
    zinf_close(warm);
    unsigned fds0 = open_fds();
    run_as_nobody(over_the_job_and_session_limits, NULL, "jobs and sessions");

    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        become_nobody_keeping(ready[1]);
        struct report rp = {2, 0};
        silent_connections(ready, &rp);
        _exit(rp.failures ? 1 : 0);
    }
    close(ready[1]);
    char c;
    cr_assert_eq(read(ready[0], &c, 1), 1, "the silent connections were not made");
    /* Root attaches at once while they are held. */
    uint64_t t0 = now_ns();
    zinf_engine *e = connect_job("root-job");
    cr_assert_lt(now_ns() - t0, 3000000000ull, "root waited for its connection");
    zinf_close(e);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "silent connections: %#x", st);
    close(ready[0]);

    /* Idle jobs close: the second user may open others now, and "a" comes back. */
    struct timespec ts = {3, 0};
    nanosleep(&ts, NULL);
    struct service_job_status *js;
    size_t njobs;
    cr_assert_eq(service_status(sock, &js, &njobs), 0);
    for (size_t i = 0; i < njobs; i++)
        cr_assert(!js[i].open, "job %s still open with no client", js[i].name);
    free(js);
    cr_assert_leq(open_fds(), fds0, "the daemon kept fds of closed jobs and connections");
    e = connect_job("a"); /* root may attach to any job */
    zinf_tensor t;
    cr_assert_eq(zinf_lookup(e, "kept", &t), 0);
    test_expect_content(e, t, (const unsigned char *)"idle-closed", 11, "after an idle close");
    zinf_close(e);
    daemon_stop(&d);
}

/* A second user's HELLO sent a byte every 300 ms: each wait is within hello_timeout (1 s),
 * but the message as a whole must come within it too, so the daemon drops the connection
 * in a few seconds rather than holding a reader for as long as the trickle lasts. */
static void trickled_hello(void *arg, struct report *rp)
{
    (void)arg;
    struct proto_request q = {.op = PROTO_HELLO};
    snprintf(q.name, sizeof(q.name), "%s", "trickle-job-with-a-long-name");
    struct proto_out o;
    proto_encode_request(&q, 1, &o);
    uint32_t plen = (uint32_t)(o.len - PROTO_HEADER_BYTES);
    memcpy(o.buf + 12, &plen, 4);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strcpy(a.sun_path, sock);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        say(rp, "connect: %s", strerror(errno));
        proto_out_free(&o);
        if (fd >= 0) close(fd);
        return;
    }
    uint64_t t0 = now_ns();
    size_t sent = 0;
    bool dropped = false;
    while (sent < o.len && !dropped) {
        if (send(fd, o.buf + sent, 1, MSG_NOSIGNAL) != 1) {
            dropped = true;
            break;
        }
        sent++;
        struct timespec ts = {0, 300 * 1000 * 1000};
        nanosleep(&ts, NULL);
        char c;
        ssize_t r = recv(fd, &c, 1, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) dropped = true;
    }
    double secs = (double)(now_ns() - t0) / 1e9;
    if (!dropped)
        say(rp, "a HELLO trickled over %.1f s (%zu bytes) was taken whole", secs, o.len);
    else if (secs > 4.5)
        say(rp, "the trickled HELLO was dropped only after %.1f s (hello_timeout 1 s)", secs);
    proto_out_free(&o);
    close(fd);
}

Test(serve_guard, a_trickled_message_is_dropped_within_hello_timeout, .timeout = 60)
{
    if (!as_root()) return;
    write_cfg_limits();
    cr_assert_eq(chmod(dir, 0711), 0);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    run_as_nobody(trickled_hello, NULL, "a trickled HELLO");
    zinf_engine *e = connect_job("root-job"); /* the daemon serves on */
    zinf_close(e);
    daemon_stop(&d);
}

/* Stages used against their grain: each call is refused with -EINVAL, nothing is applied,
 * and the connection serves on. */
Test(serve_guard, stages_misused_are_refused_and_nothing_is_applied)
{
    write_cfg_big();
    struct daemon d;
    daemon_start(&d);
    struct hello h;
    cr_assert_eq(raw_hello("stages", &h), 0);
    uint64_t t;
    cr_assert_eq(raw_register(h.fd, "t", 4u << 20, ZINF_TIER_HOST, &t), 0);
    struct proto_request q = {.op = PROTO_STAGE_WRITE, .handle = t, .offset = 0, .bytes = 2u << 20};
    uint8_t *p = NULL;
    cr_assert_eq(raw_call(h.fd, &q, &p, NULL, NULL, NULL), 0);
    uint64_t w;
    memcpy(&w, p + 4, 8);
    free(p);
    static uint8_t bytes[4096];
    memset(bytes, 7, sizeof(bytes));
    /* Past the stage's end; a GET on a write stage; an unknown stage; an empty or
     * overflowing range at open. */
    q = (struct proto_request){.op = PROTO_STAGE_PUT, .handle = w, .offset = (2u << 20) - 100,
                               .n = sizeof(bytes), .data = bytes};
    cr_assert_eq(raw_call(h.fd, &q, NULL, NULL, NULL, NULL), -EINVAL);
    q = (struct proto_request){.op = PROTO_STAGE_GET, .handle = w, .offset = 0, .n = 16};
    cr_assert_eq(raw_call(h.fd, &q, NULL, NULL, NULL, NULL), -EINVAL);
    q = (struct proto_request){.op = PROTO_STAGE_PUT, .handle = w + 99, .n = 16, .data = bytes};
    cr_assert_eq(raw_call(h.fd, &q, NULL, NULL, NULL, NULL), -EINVAL);
    q = (struct proto_request){.op = PROTO_STAGE_WRITE, .handle = t, .bytes = 0};
    cr_assert_eq(raw_call(h.fd, &q, NULL, NULL, NULL, NULL), -EINVAL);
    q = (struct proto_request){.op = PROTO_STAGE_READ, .handle = t, .offset = UINT64_MAX - 4,
                               .bytes = 8};
    cr_assert_eq(raw_call(h.fd, &q, NULL, NULL, NULL, NULL), -EINVAL);
    /* A part written, then ended: applied whole; ended again: unknown. */
    q = (struct proto_request){.op = PROTO_STAGE_PUT, .handle = w, .offset = 0,
                               .n = sizeof(bytes), .data = bytes};
    cr_assert_eq(raw_call(h.fd, &q, NULL, NULL, NULL, NULL), 0);
    q = (struct proto_request){.op = PROTO_STAGE_END, .handle = w};
    cr_assert_eq(raw_call(h.fd, &q, NULL, NULL, NULL, NULL), 0);
    cr_assert_eq(raw_call(h.fd, &q, NULL, NULL, NULL, NULL), -EINVAL);
    /* A stage left open goes with its session, unapplied. */
    q = (struct proto_request){.op = PROTO_STAGE_WRITE, .handle = t, .offset = 0, .bytes = 8192};
    cr_assert_eq(raw_call(h.fd, &q, &p, NULL, NULL, NULL), 0);
    memcpy(&w, p + 4, 8);
    free(p);
    memset(bytes, 9, sizeof(bytes));
    q = (struct proto_request){.op = PROTO_STAGE_PUT, .handle = w, .offset = 4096,
                               .n = sizeof(bytes), .data = bytes};
    cr_assert_eq(raw_call(h.fd, &q, NULL, NULL, NULL, NULL), 0);
    for (int i = 0; i < h.nfds; i++)
        close(h.fds[i]);
    close(h.fd);
    zinf_engine *e = connect_job("stages");
    unsigned char got[8192], want[8192];
    memset(want, 7, 4096);
    memset(want + 4096, 0, 4096);
    cr_assert_eq(zinf_read(e, (zinf_tensor)t, 0, got, sizeof(got)), 0);
    cr_assert_eq(memcmp(got, want, sizeof(got)), 0, "a stage was applied that was not ended");
    zinf_close(e);
    daemon_stop(&d);
}

/* ---- admission: a limit counts what it admits, under the lock that checks it ------------- */

/* A config with a swap directory and zinf.serve's members given (JSON, without braces). */
static void write_cfg_serve(const char *serve)
{
    FILE *f = fopen(cfg_path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s/swap\"}}, \"aio\": {\"block_size\": 65536, \"queue_depth\": 8},"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"4M\", \"host_bytes\": "
            "\"4M\", \"serve\": {%s}}}",
            dir, serve);
    fclose(f);
}

/* A connection to sock from a child: -1 (reported) when there is none. */
static int child_connect(struct report *rp)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strcpy(a.sun_path, sock);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0) return fd;
    say(rp, "connect: %s", strerror(errno));
    if (fd >= 0) close(fd);
    return -1;
}

static int send_hello(int fd, const char *job)
{
    struct proto_request q = {.op = PROTO_HELLO};
    snprintf(q.name, sizeof(q.name), "%s", job);
    struct proto_out o;
    proto_encode_request(&q, 1, &o);
    int r = proto_send(fd, &o, NULL, 0);
    proto_out_free(&o);
    return r;
}

/* HELLO's reply: its result, and the reason a refusal carries; the regions' fds closed. */
static int read_hello(int fd, char *why, size_t len)
{
    struct proto_header h;
    uint8_t *p = NULL;
    int fds[PROTO_MAX_REGIONS], nfds = PROTO_MAX_REGIONS;
    int r = proto_recv(fd, true, &h, &p, fds, &nfds);
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    why[0] = 0;
    if (r == 0) {
        struct proto_in in;
        proto_in_init(&in, p, h.len);
        r = proto_get_i32(&in);
        if (r < 0 && in.off < in.len) proto_get_str(&in, why, len - 1);
        if (in.bad) r = -EPROTO;
    }
    free(p);
    return r;
}

/* sessions_per_uid of the configs below. */
#define SESSION_LIMIT 4
#define RUSH 40

/* RUSH HELLOs of one uid for a job not open yet, all sent before a reply is read: they come
 * while the job opens, when the daemon lets its lock go. At most SESSION_LIMIT are sessions,
 * the rest are refused with the limit named; once they have gone the uid has its
 * SESSION_LIMIT sessions again, and no more. */
static void rushed_hellos(void *arg, struct report *rp)
{
    (void)arg;
    int fd[RUSH], n = 0, ok = 0, refused = 0;
    for (; n < RUSH; n++)
        if ((fd[n] = child_connect(rp)) < 0) break;
    for (int i = 0; i < n; i++)
        if (send_hello(fd[i], "rush") < 0) say(rp, "HELLO %d not sent", i);
    for (int i = 0; i < n; i++) {
        char why[512];
        int r = read_hello(fd[i], why, sizeof(why));
        if (r == 0)
            ok++;
        else if (r == -EUSERS && strstr(why, "sessions_per_uid"))
            refused++;
        else
            say(rp, "HELLO %d: %s (%s), not a session or -EUSERS naming the limit", i,
                zinf_strerror(r), why);
    }
    if (ok > SESSION_LIMIT || ok == 0)
        say(rp, "%d of %d HELLOs sent at once made sessions (sessions_per_uid %d)", ok, n,
            SESSION_LIMIT);
    if (ok + refused != n) say(rp, "%d sessions and %d refusals of %d HELLOs", ok, refused, n);
    for (int i = 0; i < n; i++)
        close(fd[i]);

    /* The sessions are counted out as the daemon sees their connections go. */
    int again[SESSION_LIMIT + 1], got = 0;
    for (int tries = 0; tries < 50 && got < SESSION_LIMIT; tries++) {
        for (int i = 0; i < got; i++)
            close(again[i]);
        got = 0;
        char why[512];
        for (; got < SESSION_LIMIT; got++) {
            if ((again[got] = child_connect(rp)) < 0) return;
            if (send_hello(again[got], "rush") < 0 || read_hello(again[got], why, sizeof(why))) {
                close(again[got]);
                break;
            }
        }
        if (got < SESSION_LIMIT) nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
    }
    if (got < SESSION_LIMIT)
        say(rp,
            "after every session closed, only %d of %d new ones were let in (a count "
            "leaked)",
            got, SESSION_LIMIT);
    char why[512];
    if ((again[got] = child_connect(rp)) >= 0) {
        int r = send_hello(again[got], "rush");
        if (r == 0) r = read_hello(again[got], why, sizeof(why));
        if (r != -EUSERS) say(rp, "a session over the limit: %s", zinf_strerror(r));
        close(again[got]);
    }
    for (int i = 0; i < got; i++)
        close(again[i]);
}

Test(serve_guard, sessions_per_uid_holds_for_hellos_sent_at_once, .timeout = 60)
{
    if (!as_root()) return;
    write_cfg_serve("\"sessions_per_uid\": 4, \"connections_per_uid\": 64, "
                    "\"max_connections\": 128, \"hello_timeout\": 10");
    cr_assert_eq(chmod(dir, 0711), 0);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    run_as_nobody(rushed_hellos, NULL, "HELLOs sent at once");
    daemon_stop(&d);
}

/* A third user: a member of the daemon's group too (become_keeping), with no job. */
#define OTHER 65533
#define SILENT 60

/* SILENT connections of uid 65534 that never say HELLO, against connections_per_uid 8 of
 * max_connections 40 (8 of them root's): the 8 it may have stay open, every other one is
 * refused at once, told so (the limit named) and closed. Holds them until the parent says
 * (pipes[1] read) that the other user was served, after it said they were made (pipes[0]). */
static void connections_held(int ready, int go, struct report *rp)
{
    int fd[SILENT], n = 0;
    for (; n < SILENT; n++)
        if ((fd[n] = child_connect(rp)) < 0) break;
    /* The refused ones carry their refusal and are closed: read as they come. */
    bool refused[SILENT] = {0};
    unsigned nrefused = 0, bad = 0;
    uint64_t t0 = now_ns();
    while (nrefused + bad < (unsigned)n - 8 && now_ns() - t0 < 5000000000ull) {
        for (int i = 0; i < n; i++) {
            struct pollfd p = {fd[i], POLLIN, 0};
            if (refused[i] || poll(&p, 1, 0) != 1) continue;
            char why[512];
            int r = read_hello(fd[i], why, sizeof(why));
            refused[i] = true;
            if (r == -EUSERS && strstr(why, "connections_per_uid")) {
                nrefused++;
            } else {
                say(rp, "a connection over the limit: %s (%s)", zinf_strerror(r), why);
                bad++;
            }
        }
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    }
    if (nrefused != (unsigned)n - 8)
        say(rp, "%u of %d connections refused at once, not all but connections_per_uid (8)",
            nrefused, n);
    /* The library reads the refusal as the reply to its first request, and says why. */
    zinf_engine *e;
    test_log_capture_start();
    int r = zinf_connect(sock, "x", &e);
    if (r != -EUSERS || !strstr(test_log_text(), "connections_per_uid"))
        say(rp, "zinf_connect over the limit: %s (%s)", zinf_strerror(r), test_log_text());
    if (r == 0) zinf_close(e);
    test_log_capture_stop();
    struct service_job_status *js;
    size_t njs;
    if ((r = service_status(sock, &js, &njs)) != -EUSERS) {
        say(rp, "STATUS over the limit: %s", zinf_strerror(r));
        if (r == 0) free(js);
    }
    char c = 1;
    if (write(ready, &c, 1) != 1 || read(go, &c, 1) != 1) say(rp, "the pipes");
    unsigned open = 0;
    for (int i = 0; i < n; i++) {
        struct pollfd p = {fd[i], POLLIN, 0};
        open += !refused[i] && poll(&p, 1, 0) == 0;
        close(fd[i]);
    }
    if (open != 8) say(rp, "%u connections within the limit stayed open, not 8", open);
}

/* The other user, while uid 65534 holds all it may: a session and STATUS, at once. */
static void served_promptly(void *arg, struct report *rp)
{
    (void)arg;
    uint64_t t0 = now_ns();
    zinf_engine *e;
    int r = zinf_connect(sock, "others-job", &e);
    if (r != 0) {
        say(rp, "HELLO: %s", zinf_strerror(r));
    } else {
        zinf_close(e);
    }
    struct service_job_status *js;
    size_t n;
    if ((r = service_status(sock, &js, &n)) != 0)
        say(rp, "STATUS: %s", zinf_strerror(r));
    else
        free(js);
    if (now_ns() - t0 > 3000000000ull)
        say(rp, "served after %.1f s", (double)(now_ns() - t0) / 1e9);
}

Test(serve_guard, connections_over_a_uids_limit_take_no_slot_of_other_users, .timeout = 60)
{
    if (!as_root()) return;
    write_cfg_serve("\"connections_per_uid\": 8, \"max_connections\": 40, "
                    "\"reserved_connections\": 8, \"hello_timeout\": 10");
    cr_assert_eq(chmod(dir, 0711), 0);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    int ready[2], go[2], rep[2];
    cr_assert_eq(pipe(ready), 0);
    cr_assert_eq(pipe(go), 0);
    cr_assert_eq(pipe(rep), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        close(ready[0]);
        close(go[1]);
        close(rep[0]);
        /* become_keeping keeps one fd: the three pipes are moved below it first. */
        if (dup2(rep[1], 3) < 0 || dup2(ready[1], 4) < 0 || dup2(go[0], 5) < 0) _exit(91);
        for (int fd = 6; fd < 4096; fd++)
            close(fd);
        if (setgroups(0, NULL) != 0 || setresgid(NOBODY, NOBODY, NOBODY) != 0 ||
            setresuid(NOBODY, NOBODY, NOBODY) != 0)
            _exit(90);
        struct report rp = {3, 0};
        connections_held(4, 5, &rp);
        _exit(rp.failures ? 1 : 0);
    }
    close(ready[1]);
    close(go[0]);
    close(rep[1]);
    char c;
    cr_assert_eq(read(ready[0], &c, 1), 1, "the connections were not made");
    run_as(OTHER, served_promptly, NULL, "another user while uid 65534 holds its connections");
    cr_assert_eq(write(go[1], &c, 1), 1);
    char text[8192];
    ssize_t got = read(rep[0], text, sizeof(text) - 1);
    text[got > 0 ? got : 0] = 0;
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "connections held (status %#x):\n%s", st,
              text);
    close(ready[0]);
    close(go[1]);
    close(rep[0]);
    daemon_stop(&d);
}

/* The other user's jobs, saved: a tensor in each, written. */
static void victims_jobs(void *arg, struct report *rp)
{
    (void)arg;
    const char *jobs[] = {"v1", "v2"};
    for (int i = 0; i < 2; i++) {
        zinf_engine *e = NULL;
        zinf_tensor t;
        int r = zinf_connect(sock, jobs[i], &e);
        if (r == 0 && ((r = zinf_register(e, "t", 8192, ZINF_TIER_NVME, &t)) == 0))
            r = zinf_write(e, t, 0, "victim's", 8);
        if (r) say(rp, "job %s: %s", jobs[i], zinf_strerror(r));
        if (e) zinf_close(e);
    }
}

/* HELLOs for the other user's saved jobs, more of them than max_jobs (2): each -EACCES. */
static void hellos_for_anothers_jobs(void *arg, struct report *rp)
{
    (void)arg;
    for (int i = 0; i < 6; i++) {
        const char *job = i % 2 ? "v2" : "v1";
        zinf_engine *e;
        int r = zinf_connect(sock, job, &e);
        if (r != -EACCES)
            say(rp, "HELLO for another's job %s: %s, not -EACCES", job, zinf_strerror(r));
        if (r == 0) zinf_close(e);
    }
}

/* The other user again: its job as it left it, and a new one (max_jobs 2). */
static void victim_comes_back(void *arg, struct report *rp)
{
    (void)arg;
    zinf_engine *e = NULL, *f;
    zinf_tensor t;
    char got[9] = "";
    int r = zinf_connect(sock, "v1", &e);
    if (r == 0 && (r = zinf_lookup(e, "t", &t)) == 0) r = zinf_read(e, t, 0, got, 8);
    if (r)
        say(rp, "job v1: %s", zinf_strerror(r));
    else if (strcmp(got, "victim's"))
        say(rp, "job v1 reads \"%s\"", got);
    if (e) zinf_close(e);
    if ((r = zinf_connect(sock, "v3", &f)) != 0)
        say(rp, "a new job: %s", zinf_strerror(r));
    else
        zinf_close(f);
}

Test(serve_guard, a_hello_for_anothers_saved_job_opens_nothing, .timeout = 60)
{
    if (!as_root()) return;
    write_cfg_serve("\"max_jobs\": 2, \"jobs_per_uid\": 2, \"idle_job_close\": 600");
    cr_assert_eq(chmod(dir, 0711), 0);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    run_as(OTHER, victims_jobs, NULL, "the other user's jobs");
    cr_assert_eq(service_manage(sock, PROTO_JOB_CLOSE, "v1"), 0);
    cr_assert_eq(service_manage(sock, PROTO_JOB_CLOSE, "v2"), 0);
    run_as_nobody(hellos_for_anothers_jobs, NULL, "HELLOs for another user's jobs");
    struct service_job_status *js;
    size_t n;
    cr_assert_eq(service_status(sock, &js, &n), 0);
    for (size_t i = 0; i < n; i++)
        cr_expect(!js[i].open, "job %s was opened for a HELLO refused -EACCES", js[i].name);
    free(js);
    run_as(OTHER, victim_comes_back, NULL, "the other user after the HELLOs");
    daemon_stop(&d);
}

#define FLOOD 3000

/* Refused requests as fast as the daemon answers them: stages over write_stage_bytes on
 * one connection, then HELLOs over sessions_per_uid (1), each on a connection of its own. */
static void refusals_flood(void *arg, struct report *rp)
{
    (void)arg;
    struct hello h;
    uint64_t t;
    int r = raw_hello("flood", &h);
    if (r == 0) r = raw_register(h.fd, "t", 2u << 20, ZINF_TIER_NVME, &t);
    if (r != 0) {
        say(rp, "a session and a tensor: %s", zinf_strerror(r));
        return;
    }
    struct proto_request q = {.op = PROTO_STAGE_WRITE, .handle = t, .bytes = 2u << 20};
    for (int i = 0; i < FLOOD; i++)
        if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) != -EMSGSIZE) {
            say(rp, "a stage over write_stage_bytes: %s, not -EMSGSIZE", zinf_strerror(r));
            break;
        }
    for (int i = 0; i < FLOOD / 10; i++) {
        char why[512];
        int fd = child_connect(rp);
        if (fd < 0) break;
        r = send_hello(fd, "flood");
        if (r == 0) r = read_hello(fd, why, sizeof(why));
        close(fd);
        if (r != -EUSERS) {
            say(rp, "a session over sessions_per_uid: %s, not -EUSERS", zinf_strerror(r));
            break;
        }
    }
    for (int i = 0; i < h.nfds; i++)
        close(h.fds[i]);
    close(h.fd);
}

/* The lines of text that name uid 65534 and a refusal, and those that say some went
 * unlogged. */
static void refusal_lines(const char *text, unsigned *said, unsigned *summed)
{
    *said = *summed = 0;
    for (const char *l = text; *l;) {
        const char *end = strchr(l, '\n');
        size_t len = end ? (size_t)(end - l) : strlen(l);
        char line[1100];
        snprintf(line, sizeof(line), "%.*s", (int)MIN(len, sizeof(line) - 1), l);
        if (strstr(line, "65534") && strstr(line, "suppressed"))
            (*summed)++;
        else if (strstr(line, "65534") && (strstr(line, "refused") || strstr(line, "EMSGSIZE")))
            (*said)++;
        l += len + (end != NULL);
    }
}

Test(serve_guard, refusals_of_one_user_are_logged_at_a_bounded_rate, .timeout = 60)
{
    if (!as_root()) return;
    write_cfg_serve("\"sessions_per_uid\": 1, \"write_stage_bytes\": \"1M\", "
                    "\"hello_timeout\": 10");
    cr_assert_eq(chmod(dir, 0711), 0);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    test_log_capture_start();
    run_as_nobody(refusals_flood, NULL, "a flood of refused requests");
    /* What went unsaid is told once the uid's log has room again (the sweep, each second). */
    nanosleep(&(struct timespec){2, 200 * 1000 * 1000}, NULL);
    const char *log = test_log_text();
    unsigned said, summed;
    refusal_lines(log, &said, &summed);
    cr_expect_gt(said, 0, "no refusal was logged");
    cr_expect_lt(said, 50, "%u refusals logged of %d", said, FLOOD + FLOOD / 10);
    cr_expect_gt(summed, 0, "no line says that refusals went unlogged:\n%.2000s", log);
    test_log_capture_stop();
    daemon_stop(&d);
}

/* In a child (the limit is the process's): service_open() under RLIMIT_NOFILE lim, with
 * max_connections 1000 in the config: its result, err, and the soft limit after it. */
static void open_under_nofile(struct rlimit lim, int *res, char *err, size_t errlen, rlim_t *soft)
{
    int p[2];
    cr_assert_eq(pipe(p), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        struct {
            int res;
            rlim_t soft;
            char err[512];
        } out = {0};
        struct rlimit now;
        if (setrlimit(RLIMIT_NOFILE, &lim) != 0) _exit(90);
        struct zinf_config cfg;
        struct service *s = NULL;
        if (config_parse_file(cfg_path, &cfg, out.err, sizeof(out.err)) != 0) _exit(91);
        struct service_opts o = {.socket_path = sock, .config = &cfg};
        out.res = service_open(&o, &s, out.err, sizeof(out.err));
        getrlimit(RLIMIT_NOFILE, &now);
        out.soft = now.rlim_cur;
        if (s) service_close(s);
        config_free(&cfg);
        _exit(write(p[1], &out, sizeof(out)) == sizeof(out) ? 0 : 92);
    }
    close(p[1]);
    struct {
        int res;
        rlim_t soft;
        char err[512];
    } got;
    cr_assert_eq(read(p[0], &got, sizeof(got)), (ssize_t)sizeof(got));
    close(p[0]);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child: %#x", st);
    *res = got.res;
    *soft = got.soft;
    snprintf(err, errlen, "%s", got.err);
}

Test(serve_guard, max_connections_past_the_open_files_limit_is_refused_or_raised)
{
    if (!as_root()) return; /* root may lower its hard limit, and raise it again */
    write_cfg_serve("\"max_connections\": 1000, \"max_jobs\": 8");
    int r;
    char err[512];
    rlim_t soft;
    /* A hard limit below what 1000 connections need: refused at start, both named. */
    open_under_nofile((struct rlimit){256, 256}, &r, err, sizeof(err), &soft);
    cr_assert_eq(r, -EMFILE, "service_open: %s (%s)", zinf_strerror(r), err);
    cr_assert(strstr(err, "zinf.serve.max_connections") && strstr(err, "256"), "%s", err);
    /* A low soft limit under a hard one high enough: raised. */
    open_under_nofile((struct rlimit){256, 8192}, &r, err, sizeof(err), &soft);
    cr_assert_eq(r, 0, "service_open: %s (%s)", zinf_strerror(r), err);
    cr_assert_geq(soft, 2000, "the soft limit stayed %llu", (unsigned long long)soft);
}

/* ---- the daemon's stop, its closes, and what a session may hold ------------------------- */

/* A config with the swap directory at swap, host and device tiers of those sizes, and
 * zinf.serve's members given (JSON, without braces). */
static void write_cfg_tiers(const char *swap, const char *host, const char *device,
                            const char *serve)
{
    FILE *f = fopen(cfg_path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s\"}}, \"aio\": {\"block_size\": 65536, \"queue_depth\": 8},"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"%s\", \"host_bytes\": "
            "\"%s\", \"serve\": {%s}}}",
            swap, device, host, serve);
    fclose(f);
}

/* n tensors of bytes each in e's job, homed on NVMe, each filled with its number plus seed
 * in the host tier and released dirty: data only a flush makes durable. */
static void dirty_tensors(zinf_engine *e, unsigned n, size_t bytes, int seed)
{
    for (unsigned i = 0; i < n; i++) {
        char name[32];
        zinf_tensor t;
        void *p;
        snprintf(name, sizeof(name), "t%u", i);
        int r = zinf_lookup(e, name, &t);
        if (r == -ENOENT) r = zinf_register(e, name, bytes, ZINF_TIER_NVME, &t);
        cr_assert_eq(r, 0, "register %s: %s", name, zinf_strerror(r));
        cr_assert_eq(r = zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0, "fetch: %s", zinf_strerror(r));
        memset(p, (int)(i + (unsigned)seed) & 0xff, bytes);
        cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
    }
}

/* Whether job's tensors read as dirty_tensors(n, bytes, seed) left them. */
static void expect_tensors(zinf_engine *e, unsigned n, size_t bytes, int seed)
{
    unsigned char *buf = malloc(bytes);
    cr_assert_not_null(buf);
    for (unsigned i = 0; i < n; i++) {
        char name[32];
        zinf_tensor t;
        snprintf(name, sizeof(name), "t%u", i);
        cr_assert_eq(zinf_lookup(e, name, &t), 0, "tensor %s was not saved", name);
        cr_assert_eq(zinf_read(e, t, 0, buf, bytes), 0);
        unsigned char want = (unsigned char)((i + (unsigned)seed) & 0xff);
        for (size_t k = 0; k < bytes; k++)
            cr_assert_eq(buf[k], want, "tensor %s byte %zu reads %u, not %u", name, k, buf[k],
                         want);
    }
    free(buf);
}

static bool exited_now(pid_t pid)
{
    int st;
    return waitpid(pid, &st, WNOHANG) == pid;
}

Test(serve_guard, serve_stop_returns_once_every_job_is_flushed_and_the_daemon_has_exited,
     .timeout = 60)
{
    char swap[600];
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    write_cfg_tiers(swap, "200M", "4M", "\"idle_job_close\": 600");
    zinf_engine *e;
    pid_t pid = fork_daemon("stopjob", &e);
    dirty_tensors(e, 12, 16u << 20, 1); /* 192 MiB that only the stop's flush saves */
    int r = service_shutdown(sock);
    bool gone = exited_now(pid);
    if (!gone) { /* the failure said below, once the daemon is gone */
        int st;
        waitpid(pid, &st, 0);
    }
    zinf_close_unflushed(e);
    cr_assert_eq(r, 0, "serve --stop: %s", zinf_strerror(r));
    cr_assert(gone, "serve --stop returned while the daemon still ran");
    struct daemon d;
    daemon_start(&d);
    e = connect_job("stopjob");
    expect_tensors(e, 12, 16u << 20, 1);
    zinf_close(e);
    daemon_stop(&d);
}

/* Whether job is open in the daemon on sock (STATUS). */
static bool job_is_open(const char *job)
{
    struct service_job_status *js;
    size_t n;
    bool open = false;
    cr_assert_eq(service_status(sock, &js, &n), 0);
    for (size_t i = 0; i < n; i++)
        open |= !strcmp(js[i].name, job) && js[i].open;
    free(js);
    return open;
}

Test(serve_guard, a_job_whose_flush_fails_at_idle_close_stays_open_until_a_retry_saves_it,
     .timeout = 60)
{
    if (geteuid() != 0) cr_skip_test("needs root to mount a small tmpfs");
    char swap[600], filler[700];
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    cr_assert_eq(mkdir(swap, 0700), 0);
    /* In a mount namespace of this test's own (the daemon it starts inherits it): the
     * tmpfs goes with the test's processes, even where an assertion ends the test early. */
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
        mount("zinf-test", swap, "tmpfs", 0, "size=4m,mode=0700") != 0)
        cr_skip_test("cannot mount a tmpfs in a mount namespace: %s", strerror(errno));
    write_cfg_tiers(swap, "4M", "4M", "\"idle_job_close\": 1");
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("full");
    dirty_tensors(e, 2, 256u << 10, 1);
    cr_assert_eq(zinf_flush(e), 0);
    /* Another user fills the swap filesystem; the job's next version has nowhere to go. */
    snprintf(filler, sizeof(filler), "%s/filler", swap);
    int fd = open(filler, O_WRONLY | O_CREAT | O_EXCL, 0600);
    cr_assert_geq(fd, 0);
    static char block[65536];
    while (write(fd, block, sizeof(block)) > 0)
        ;
    close(fd);
    dirty_tensors(e, 2, 256u << 10, 2);
    zinf_close_unflushed(e);
    /* Idle for idle_job_close (1 s), then its close: the flush fails, the job stays. */
    nanosleep(&(struct timespec){3, 0}, NULL);
    cr_expect(job_is_open("full"), "a job whose flush failed was closed: its writes are lost");
    /* Room again: the next try saves it and closes it. */
    cr_assert_eq(unlink(filler), 0);
    for (int i = 0; i < 150 && job_is_open("full"); i++)
        nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
    cr_expect(!job_is_open("full"), "the job's close was not tried again once there was room");
    e = connect_job("full");
    expect_tensors(e, 2, 256u << 10, 2);
    zinf_close(e);
    daemon_stop(&d);
    umount2(swap, MNT_DETACH);
}

/* As a user with a bound on swap (1 MiB): a tensor past it is refused -EDQUOT. */
static void over_the_swap_bound(void *arg, struct report *rp)
{
    (void)arg;
    zinf_engine *e;
    zinf_tensor t;
    int r = zinf_connect(sock, "quota", &e);
    if (r) {
        say(rp, "connect: %s", zinf_strerror(r));
        return;
    }
    for (int i = 0; i < 2; i++) {
        char name[8] = {'t', (char)('0' + i), 0};
        if ((r = zinf_register(e, name, 512u << 10, ZINF_TIER_NVME, &t)) ||
            (r = zinf_write(e, t, 0, "x", 1)))
            say(rp, "a tensor within the bound: %s", zinf_strerror(r));
    }
    if ((r = zinf_register(e, "t2", 512u << 10, ZINF_TIER_NVME, &t)) != -EDQUOT)
        say(rp, "a tensor past swap_bytes_per_uid: %s, not -EDQUOT", zinf_strerror(r));
    if ((r = zinf_register(e, "h", 512u << 10, ZINF_TIER_HOST, &t)) != 0)
        say(rp, "a tensor in host memory: %s", zinf_strerror(r));
    zinf_close(e);
}

Test(serve_guard, swap_past_a_uids_bound_is_refused_edquot_naming_the_key, .timeout = 60)
{
    if (!as_root()) return;
    swap_under_sockdir();
    write_cfg_tiers(swapdir, "4M", "4M", "\"swap_bytes_per_uid\": \"1M\"");
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    test_log_capture_start();
    run_as_nobody(over_the_swap_bound, NULL, "a user past its swap bound");
    cr_expect_not_null(strstr(test_log_text(), "zinf.serve.swap_bytes_per_uid"),
                       "the refusal does not name the limit");
    test_log_capture_stop();
    daemon_stop(&d);
}

#define TICKETS 20000

Test(serve_guard, unwaited_tickets_are_bounded_and_hold_up_no_other_jobs_flush_at_stop,
     .timeout = 60)
{
    char swap[600], serve[128];
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    snprintf(serve, sizeof(serve), "\"tickets_per_session\": %d", TICKETS);
    write_cfg_tiers(swap, "16M", "4M", serve);
    zinf_engine *e, *other;
    pid_t pid = fork_daemon("tickets", &e);
    zinf_tensor t;
    cr_assert_eq(zinf_register(e, "t", 4096, ZINF_TIER_HOST, &t), 0);
    uint64_t k;
    int r = 0, n = 0;
    while (n <= TICKETS && (r = zinf_fetch_async(e, t, ZINF_TIER_HOST, &k)) == 0)
        n++;
    cr_expect_eq(n, TICKETS, "%d tickets held, the bound is %d", n, TICKETS);
    cr_expect_eq(r, -EMFILE, "a ticket past the bound: %s, not -EMFILE", zinf_strerror(r));
    other = connect_job("other");
    dirty_tensors(other, 4, 1u << 20, 5);
    uint64_t t0 = now_ns();
    cr_assert_eq(kill(pid, SIGTERM), 0);
    bool gone = false;
    while (!(gone = exited_now(pid)) && now_ns() - t0 < 5000000000ull)
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    if (!gone) {
        int st;
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
    }
    zinf_close_unflushed(e);
    zinf_close_unflushed(other);
    cr_assert(gone, "the daemon had not exited 5 s after SIGTERM");
    struct daemon d;
    daemon_start(&d);
    other = connect_job("other");
    expect_tensors(other, 4, 1u << 20, 5);
    zinf_close(other);
    daemon_stop(&d);
}

#define STAGES 100

/* As another user, while the stages are held: a job of its own opens and works. */
static void a_job_while_stages_are_held(void *arg, struct report *rp)
{
    (void)arg;
    zinf_engine *e;
    zinf_tensor t;
    int r = zinf_connect(sock, "another", &e);
    if (r == 0 && (r = zinf_register(e, "t", 8192, ZINF_TIER_NVME, &t)) == 0)
        r = zinf_write(e, t, 0, "written", 7);
    if (r) say(rp, "another user's job: %s", zinf_strerror(r));
    if (r != -ECONNRESET && e) zinf_close(e);
}

Test(serve_guard, one_byte_stages_are_bounded_per_session_and_others_still_open_jobs,
     .timeout = 60)
{
    if (!as_root()) return;
    swap_under_sockdir();
    char serve[128];
    snprintf(serve, sizeof(serve), "\"stages_per_session\": %d", STAGES);
    write_cfg_tiers(swapdir, "4M", "4M", serve);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    struct hello h;
    cr_assert_eq(raw_hello("stages", &h), 0);
    uint64_t t;
    cr_assert_eq(raw_register(h.fd, "t", 4096, ZINF_TIER_HOST, &t), 0);
    int r = 0, n = 0;
    while (n <= STAGES + 10) {
        struct proto_request q = {.op = PROTO_STAGE_WRITE, .handle = t, .offset = 0, .bytes = 1};
        if ((r = raw_call(h.fd, &q, NULL, NULL, NULL, NULL)) < 0) break;
        n++;
    }
    cr_expect_eq(n, STAGES, "%d one-byte stages held, the bound is %d", n, STAGES);
    cr_expect_eq(r, -EMFILE, "a stage past the bound: %s, not -EMFILE", zinf_strerror(r));
    run_as(OTHER, a_job_while_stages_are_held, NULL, "another user while the stages are held");
    for (int i = 0; i < h.nfds; i++)
        close(h.fds[i]);
    close(h.fd);
    daemon_stop(&d);
}

/* Bytes the file behind fd holds in memory. */
static uint64_t held_bytes(int fd)
{
    struct stat st;
    cr_assert_eq(fstat(fd, &st), 0);
    return (uint64_t)st.st_blocks * 512;
}

#define CYCLES 3

Test(serve_guard, a_closed_jobs_memory_is_given_back_while_a_client_keeps_its_memfds,
     .timeout = 60)
{
    char swap[600];
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    write_cfg_tiers(swap, "32M", "16M", "\"idle_job_close\": 600");
    struct daemon d;
    daemon_start(&d);
    int kept[CYCLES][8], nkept[CYCLES];
    void *maps[CYCLES][8];
    for (int c = 0; c < CYCLES; c++) {
        struct hello h;
        cr_assert_eq(raw_hello("mem", &h), 0);
        /* The client fills the arenas it was given (device, host), and keeps them mapped. */
        nkept[c] = 0;
        for (int i = 0; i < h.nfds && i < 2; i++) {
            void *p = mmap(NULL, h.bytes[i], PROT_READ | PROT_WRITE, MAP_SHARED, h.fds[i], 0);
            cr_assert_neq(p, MAP_FAILED);
            memset(p, 0x5a, h.bytes[i]);
            cr_assert_geq(held_bytes(h.fds[i]), h.bytes[i] / 2);
            maps[c][nkept[c]] = p;
            kept[c][nkept[c]++] = h.fds[i];
        }
        for (int i = 2; i < h.nfds; i++)
            close(h.fds[i]);
        close(h.fd);
        int r;
        for (int i = 0; i < 300 && (r = service_manage(sock, PROTO_JOB_CLOSE, "mem")) == -EBUSY; i++)
            nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
        cr_assert_eq(r, 0, "JOB_CLOSE: %s", zinf_strerror(r));
        for (int i = 0; i < nkept[c]; i++)
            cr_expect_lt(held_bytes(kept[c][i]), 1u << 20,
                         "cycle %d: a closed job's arena still holds %llu bytes for a client", c,
                         (unsigned long long)held_bytes(kept[c][i]));
    }
    for (int c = 0; c < CYCLES; c++)
        for (int i = 0; i < nkept[c]; i++) {
            munmap(maps[c][i], (size_t)lseek(kept[c][i], 0, SEEK_END));
            close(kept[c][i]);
        }
    daemon_stop(&d);
}

/* ---- STATUS of many saved jobs ------------------------------------------------------------ */

#define SAVED_COPIES 3000

/* JOB_CLOSE of job, once the session that used it has ended. */
static void close_job(const char *job)
{
    int r;
    for (int i = 0; i < 500 && (r = service_manage(sock, PROTO_JOB_CLOSE, job)) == -EBUSY; i++)
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    cr_assert_eq(r, 0, "JOB_CLOSE %s: %s", job, zinf_strerror(r));
}

/* As uid 65534: job "orig" saved, with ntensors tensors of 64 bytes. */
static void a_saved_job(void *arg, struct report *rp)
{
    unsigned ntensors = *(unsigned *)arg;
    zinf_engine *e;
    int r = zinf_connect(sock, "orig", &e);
    for (unsigned i = 0; r == 0 && i < ntensors; i++) {
        char name[32];
        zinf_tensor t;
        snprintf(name, sizeof(name), "tensor.%u", i);
        r = zinf_register(e, name, 64, ZINF_TIER_NVME, &t);
    }
    if (r) say(rp, "a saved job: %s", zinf_strerror(r));
    if (e) zinf_close(e);
}

/* Folder orig copied n times under the swap directory (its small files: the manifest and the
 * owner; the swap files are not read by STATUS), as job0 ... jobN-1. */
static void copy_job(unsigned n)
{
    char src[900];
    snprintf(src, sizeof(src), "%s/orig", swapdir);
    DIR *d = opendir(src);
    cr_assert_not_null(d);
    struct {
        char name[256];
        char *buf;
        size_t len;
    } f[16];
    unsigned nf = 0;
    struct dirent *de;
    while ((de = readdir(d)) && nf < 16) {
        char p[1200];
        struct stat st;
        snprintf(p, sizeof(p), "%s/%s", src, de->d_name);
        if (lstat(p, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > (1 << 20)) continue;
        FILE *in = fopen(p, "r");
        cr_assert_not_null(in);
        snprintf(f[nf].name, sizeof(f[nf].name), "%s", de->d_name);
        f[nf].buf = malloc((size_t)st.st_size + 1);
        f[nf].len = fread(f[nf].buf, 1, (size_t)st.st_size, in);
        fclose(in);
        nf++;
    }
    closedir(d);
    for (unsigned i = 0; i < n; i++) {
        char dst[900], p[1200];
        snprintf(dst, sizeof(dst), "%.700s/a-saved-job-%u", swapdir, i);
        cr_assert_eq(mkdir(dst, 0700), 0);
        for (unsigned k = 0; k < nf; k++) {
            snprintf(p, sizeof(p), "%.900s/%.255s", dst, f[k].name);
            FILE *out = fopen(p, "w");
            cr_assert_not_null(out);
            fwrite(f[k].buf, 1, f[k].len, out);
            fclose(out);
        }
    }
    for (unsigned k = 0; k < nf; k++)
        free(f[k].buf);
}

static void a_new_job_past_the_saved_bound(void *arg, struct report *rp)
{
    (void)arg;
    int fd = child_connect(rp);
    char why[256];
    if (fd < 0) return;
    send_hello(fd, "one.more");
    int r = read_hello(fd, why, sizeof(why));
    if (r != -EUSERS || !strstr(why, "zinf.serve.saved_jobs_per_uid"))
        say(rp, "a new job past saved_jobs_per_uid: %s (\"%s\")", zinf_strerror(r), why);
    close(fd);
    zinf_engine *e;
    if ((r = zinf_connect(sock, "orig", &e)) != 0)
        say(rp, "a saved job of its own, past the bound: %s", zinf_strerror(r));
    else
        zinf_close(e);
}

Test(serve_guard, status_of_thousands_of_saved_jobs_comes_in_pages_and_saved_jobs_are_bounded,
     .timeout = 60)
{
    if (!as_root()) return;
    swap_under_sockdir();
    char serve[128];
    snprintf(serve, sizeof(serve), "\"saved_jobs_per_uid\": %d", SAVED_COPIES + 1);
    write_cfg_tiers(swapdir, "4M", "4M", serve);
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    unsigned one = 1;
    run_as_nobody(a_saved_job, &one, "a saved job");
    close_job("orig");
    copy_job(SAVED_COPIES);
    struct service_job_status *js;
    size_t n;
    int r = service_status(sock, &js, &n);
    cr_assert_eq(r, 0, "STATUS of %d saved jobs: %s", SAVED_COPIES + 1, zinf_strerror(r));
    cr_expect_eq(n, SAVED_COPIES + 1, "STATUS listed %zu jobs of %d", n, SAVED_COPIES + 1);
    for (size_t i = 1; i < n; i++)
        cr_assert_lt(strcmp(js[i - 1].name, js[i].name), 0, "listed twice or out of order");
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(js[i].stats.tensors, 1, "job %s: %llu tensors", js[i].name,
                     (unsigned long long)js[i].stats.tensors);
    free(js);
    run_as_nobody(a_new_job_past_the_saved_bound, NULL, "past saved_jobs_per_uid");
    daemon_stop(&d);
}

/* The daemon's peak resident memory (this process's: the daemon runs in it). */
static uint64_t peak_rss(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long kb = 0;
    cr_assert_not_null(f);
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmHWM: %llu kB", &kb) == 1) break;
    fclose(f);
    return kb << 10;
}

static void *status_call(void *arg)
{
    struct service_job_status *js;
    size_t n;
    *(int *)arg = service_status(sock, &js, &n);
    if (*(int *)arg == 0) free(js);
    return NULL;
}

#define CALLERS 24
#define MANY_TENSORS 16000

Test(serve_guard, status_calls_at_once_on_a_large_saved_job_parse_its_manifest_once,
     .timeout = 60)
{
    if (!as_root()) return;
    swap_under_sockdir();
    write_cfg_tiers(swapdir, "16M", "4M", "\"idle_job_close\": 600");
    struct daemon d;
    daemon_start_group(&d, nobody_group());
    unsigned many = MANY_TENSORS;
    run_as_nobody(a_saved_job, &many, "a large saved job");
    close_job("orig");
    malloc_trim(0);
    /* 5: the peak (VmHWM) starts again from what is resident now. */
    int fd = open("/proc/self/clear_refs", O_WRONLY);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, "5", 1), 1);
    close(fd);
    uint64_t before = peak_rss();
    pthread_t t[CALLERS];
    int res[CALLERS];
    for (int i = 0; i < CALLERS; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, status_call, &res[i]), 0);
    for (int i = 0; i < CALLERS; i++) {
        pthread_join(t[i], NULL);
        cr_expect_eq(res[i], 0, "STATUS: %s", zinf_strerror(res[i]));
    }
    uint64_t grew = peak_rss() - before;
    cr_expect_lt(grew, 64u << 20, "%d STATUS calls at once raised the peak by %llu MiB", CALLERS,
                 (unsigned long long)(grew >> 20));
    daemon_stop(&d);
}
