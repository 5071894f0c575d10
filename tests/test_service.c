/*
 * test_service.c - the daemon (src/service/server.c) and its client (client.c): every
 * zinf.h call through zinf_connect answers as the embedded engine does, fetched pointers
 * are the daemon's memory, jobs do not see each other, a client that dies loses its pins
 * and nobody else notices, a restarted daemon brings back what was flushed, malformed
 * messages get an error and a closed connection while the daemon goes on, and another user
 * gets nothing of a job whose write-behinds are running.
 *
 * The daemon runs in a thread of the test's own process (service_run), except where a
 * test needs a client process to die: that client is a forked child.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "helpers.h"
#include "service_util.h"
#include "pintable.h"
#include "service/client.h"
#include "service/proto.h"
#include "service/server.h"
#include "tiers/cuda_probe.h"

static void setup(void)
{
    service_util_setup("service");
}

static char wb_sockdir[64]; /* write_behind_under_a_second_user's socket folder, in /tmp */

static void teardown(void)
{
    if (wb_sockdir[0]) test_rmtree(strdup(wb_sockdir));
    wb_sockdir[0] = 0;
    service_util_teardown();
}

TestSuite(service, .init = setup, .fini = teardown, .timeout = 120);

Test(service, fetched_pointers_are_the_daemons_memory)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("alpha");
    const size_t n = 300000;
    zinf_tensor t = test_register(e, "w", n, ZINF_TIER_HOST);
    unsigned char *want = test_rand_buf(n, 1);
    for (int tier = ZINF_TIER_DEVICE; tier <= ZINF_TIER_HOST; tier++) {
        void *p;
        cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
        /* Written through the pointer in this process, read back by the daemon. */
        memcpy(p, want, n);
        want[tier] ^= 0x5a;
        ((unsigned char *)p)[tier] ^= 0x5a;
        cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
        test_expect_content(e, t, want, n, "written through the fetched pointer");
    }
    /* A second client of the job sees the same bytes at its own mapping. */
    zinf_engine *e2 = connect_job("alpha");
    zinf_tensor t2;
    void *p2;
    cr_assert_eq(zinf_lookup(e2, "w", &t2), 0);
    cr_assert_eq(t2, t);
    cr_assert_eq(zinf_fetch(e2, t2, ZINF_TIER_HOST, &p2), 0);
    cr_assert_eq(memcmp(p2, want, n), 0);
    cr_assert_eq(zinf_release(e2, t2, ZINF_TIER_HOST, 0), 0);
    zinf_close(e2);
    free(want);
    zinf_close(e);
    daemon_stop(&d);
}

/* The same calls, with their errors, on an embedded engine and through the daemon. */
static void error_script(zinf_engine *e, int *res, int *nres)
{
    zinf_tensor t, u, bogus = 0xdeadbeef;
    void *p, *ps[2];
    uint64_t ticket;
    char buf[64];
    int k = 0;
    res[k++] = zinf_register(e, "t", 8192, ZINF_TIER_HOST, &t);
    res[k++] = zinf_register(e, "t", 8192, ZINF_TIER_HOST, &u);          /* -EEXIST */
    res[k++] = zinf_register(e, "huge", 1ull << 40, ZINF_TIER_HOST, &u); /* -ENOSPC */
    res[k++] = zinf_register(e, "bad-home", 4096, (enum zinf_tier)9, &u);
    res[k++] = zinf_lookup(e, "nobody", &u); /* -ENOENT */
    res[k++] = zinf_fetch(e, bogus, ZINF_TIER_HOST, &p);
    res[k++] = zinf_fetch(e, t, (enum zinf_tier)7, &p);
    res[k++] = zinf_release(e, t, ZINF_TIER_HOST, 0); /* no pin: -EINVAL */
    res[k++] = zinf_fetch(e, t, ZINF_TIER_HOST, &p);
    res[k++] = zinf_unregister(e, t); /* pinned: -EBUSY */
    res[k++] = zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY);
    res[k++] = zinf_fetch(e, t, ZINF_TIER_DEVICE, &p);
    res[k++] = zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY); /* -EBUSY */
    res[k++] = zinf_release(e, t, ZINF_TIER_DEVICE, 0);
    res[k++] = zinf_release(e, t, ZINF_TIER_HOST, 8); /* unknown flag */
    res[k++] = zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_ZERO); /* not on NVMe */
    res[k++] = zinf_zero(e, t);     /* pinned, and not on NVMe: -EINVAL */
    res[k++] = zinf_zero(e, bogus); /* -EINVAL */
    res[k++] = zinf_release(e, t, ZINF_TIER_HOST, 0);
    res[k++] = zinf_read(e, t, 8190, buf, 4); /* past the end */
    res[k++] = zinf_write(e, t, 0, "abcd", 4);
    res[k++] = zinf_read(e, t, 0, buf, 4);
    res[k++] = memcmp(buf, "abcd", 4);
    res[k++] = zinf_write(e, bogus, 0, "abcd", 4);
    res[k++] = zinf_fetch_async(e, t, ZINF_TIER_DEVICE, &ticket);
    res[k++] = zinf_wait(e, ticket, &p);
    res[k++] = zinf_wait(e, ticket, &p); /* spent: -EINVAL */
    res[k++] = zinf_release(e, t, ZINF_TIER_DEVICE, 0);
    res[k++] = zinf_register(e, "u", 4096, ZINF_TIER_NVME, &u); /* no NVMe tier */
    res[k++] = zinf_register(e, "u", 4096, ZINF_TIER_DEVICE, &u);
    zinf_tensor set[2] = {t, u};
    res[k++] = zinf_fetch_all(e, set, 2, ZINF_TIER_HOST, ps);
    res[k++] = zinf_release(e, t, ZINF_TIER_HOST, 0);
    res[k++] = zinf_release(e, u, ZINF_TIER_HOST, 0);
    set[1] = bogus;
    res[k++] = zinf_fetch_all(e, set, 2, ZINF_TIER_HOST, ps);
    res[k++] = zinf_release(e, t, ZINF_TIER_HOST, 0); /* the failed set pinned nothing */
    res[k++] = zinf_prefetch(e, t, ZINF_TIER_DEVICE);
    res[k++] = zinf_step(e);
    res[k++] = zinf_unregister(e, t);
    res[k++] = zinf_unregister(e, t);
    res[k++] = zinf_flush(e);
    *nres = k;
}

Test(service, every_call_answers_as_the_embedded_engine)
{
    struct daemon d;
    daemon_start(&d);
    int emb[64], rem[64], ne, nr;
    zinf_engine *e;
    cr_assert_eq(zinf_open_config(cfg_path, &e), 0);
    error_script(e, emb, &ne);
    zinf_close(e);
    e = connect_job("errors");
    error_script(e, rem, &nr);
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tensors, 1);
    cr_assert_eq(st.device_is_cuda, 0);
    zinf_close(e);
    daemon_stop(&d);
    cr_assert_eq(ne, nr);
    for (int i = 0; i < ne; i++)
        cr_expect_eq(emb[i], rem[i], "call %d: embedded %d (%s), through the daemon %d (%s)", i,
                     emb[i], zinf_strerror(emb[i]), rem[i], zinf_strerror(rem[i]));
}

/* Through the daemon, zinf_tensor_info answers as embedded; the versioned flushes are not
 * the daemon's (-ENOTSUP, after the same -EINVAL checks); the host tier's staging and
 * pinning in zinf_stats are the daemon's; zinf_close_unflushed ends the connection and
 * leaves the job's memory as it was. */
Test(service, tensor_info_and_versioned_flushes_through_the_daemon)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("info");
    zinf_tensor t = test_register(e, "t", 12345, ZINF_TIER_HOST);
    zinf_tensor gone = test_register(e, "gone", 4096, ZINF_TIER_DEVICE);
    struct zinf_tensor_info ti;
    cr_assert_eq(zinf_tensor_info(e, t, &ti), 0);
    cr_expect_eq(ti.home, ZINF_TIER_HOST);
    cr_expect_eq(ti.bytes, 12345);
    cr_assert_eq(zinf_tensor_info(e, gone, &ti), 0);
    cr_expect_eq(ti.home, ZINF_TIER_DEVICE);
    cr_assert_eq(zinf_unregister(e, gone), 0);
    cr_expect_eq(zinf_tensor_info(e, gone, &ti), -ENOENT);
    cr_expect_eq(zinf_tensor_info(e, 0, &ti), -ENOENT);
    cr_expect_eq(zinf_tensor_info(e, t, NULL), -EINVAL);
    cr_expect_eq(zinf_flush_step(e, -2, 0), -EINVAL);
    cr_expect_eq(zinf_flush_step(e, 1, ZINF_FLUSH_KEEP_PREVIOUS), -ENOTSUP);
    cr_expect_eq(zinf_drop_previous(e), -ENOTSUP);
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_expect_leq(st.host_pinned, 1u);
    cr_assert_eq(zinf_write(e, t, 0, "kept", 4), 0);
    zinf_close_unflushed(e);
    e = connect_job("info");
    zinf_tensor x;
    cr_assert_eq(zinf_lookup(e, "t", &x), 0);
    test_expect_content(e, x, (const unsigned char *)"kept", 4, "after an unflushed close");
    zinf_close(e);
    daemon_stop(&d);
}

Test(service, reads_and_writes_larger_than_a_message)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("big");
    const size_t n = 3 * PROTO_MAX_DATA + 12345;
    zinf_tensor t = test_register(e, "big", n, ZINF_TIER_HOST);
    unsigned char *want = test_rand_buf(n, 7), *got = malloc(n);
    cr_assert_eq(zinf_write(e, t, 0, want, n), 0);
    cr_assert_eq(zinf_read(e, t, 0, got, n), 0);
    cr_assert_eq(memcmp(got, want, n), 0);
    /* A range past the end fails before any piece is written. */
    unsigned char *other = test_rand_buf(n, 8);
    cr_assert_eq(zinf_write(e, t, 1, other, n), -EINVAL);
    test_expect_content(e, t, want, n, "after a refused write");
    free(other);
    free(want);
    free(got);
    zinf_close(e);
    daemon_stop(&d);
}

Test(service, jobs_do_not_see_each_other)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *a = connect_job("job-a"), *b = connect_job("job_b");
    zinf_tensor ta = test_register(a, "same", 4096, ZINF_TIER_HOST);
    zinf_tensor tb = test_register(b, "same", 4096, ZINF_TIER_HOST);
    cr_assert_eq(zinf_write(a, ta, 0, "from a", 6), 0);
    cr_assert_eq(zinf_write(b, tb, 0, "from b", 6), 0);
    test_expect_content(a, ta, (const unsigned char *)"from a", 6, "job a");
    test_expect_content(b, tb, (const unsigned char *)"from b", 6, "job b");
    zinf_tensor x;
    cr_assert_eq(zinf_lookup(a, "only-b", &x), -ENOENT);
    cr_assert_eq(zinf_register(b, "only-b", 4096, ZINF_TIER_HOST, &x), 0);
    cr_assert_eq(zinf_lookup(a, "only-b", &x), -ENOENT);
    zinf_close(a);
    zinf_close(b);
    daemon_stop(&d);
}

Test(service, bad_connects_are_refused_with_a_reason)
{
    zinf_engine *e = (zinf_engine *)1;
    cr_assert_eq(zinf_connect(sock, "x", &e), -ENOENT); /* nobody listens */
    cr_assert_null(e);
    struct daemon d;
    daemon_start(&d);
    cr_assert_eq(zinf_connect(sock, "", &e), -EINVAL);
    cr_assert_eq(zinf_connect(sock, "../escape", &e), -EINVAL);
    cr_assert_eq(zinf_connect(sock, ".hidden", &e), -EINVAL);
    cr_assert_eq(zinf_connect(sock, "a/b", &e), -EINVAL);
    char longname[80];
    memset(longname, 'j', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = 0;
    cr_assert_eq(zinf_connect(sock, longname, &e), -EINVAL);
    cr_assert_eq(zinf_connect(NULL, "x", &e), -EINVAL);
    cr_assert_eq(zinf_connect(sock, "x", NULL), -EINVAL);
    /* A second daemon on the same socket is refused; the first goes on. */
    struct service *s2;
    char err[256];
    struct service_opts o = {.socket_path = sock, .config = &d.cfg};
    cr_assert_eq(service_open(&o, &s2, err, sizeof(err)), -EADDRINUSE);
    cr_assert(strstr(err, "already answers"), "%s", err);
    zinf_engine *ok = connect_job("still-fine");
    zinf_close(ok);
    struct stat st;
    cr_assert_eq(stat(sock, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0600, "socket mode %o", st.st_mode & 0777);
    daemon_stop(&d);
}

/* A child connects, pins a tensor in both tiers, writes garbage through a cached copy of
 * another without releasing it, and is killed: the daemon drops its pins, the cached copy
 * it scribbled on goes (the tensor reads as last released), and the parent's client goes
 * on. */
Test(service, a_killed_client_loses_its_pins_and_nobody_else_notices)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("kill");
    zinf_tensor t = test_register(e, "t", 65536, ZINF_TIER_HOST);
    zinf_tensor u = test_register(e, "u", 65536, ZINF_TIER_HOST);
    unsigned char *want = test_rand_buf(65536, 11);
    cr_assert_eq(zinf_write(e, u, 0, want, 65536), 0);
    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        zinf_engine *c;
        void *p, *q, *w;
        zinf_tensor ct, cu;
        if (zinf_connect(sock, "kill", &c) || zinf_lookup(c, "t", &ct) ||
            zinf_fetch(c, ct, ZINF_TIER_HOST, &p) || zinf_fetch(c, ct, ZINF_TIER_DEVICE, &q) ||
            zinf_lookup(c, "u", &cu) || zinf_fetch(c, cu, ZINF_TIER_DEVICE, &w))
            _exit(1);
        memset(w, 0xee, 65536); /* written through, never released dirty */
        char one = 1;
        if (write(ready[1], &one, 1) != 1) _exit(1);
        for (;;)
            pause();
    }
    char got;
    close(ready[1]);
    cr_assert_eq(read(ready[0], &got, 1), 1, "the child could not pin");
    cr_assert_eq(zinf_unregister(e, t), -EBUSY, "the child's pins hold");
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    close(ready[0]);
    /* The daemon notices the closed connections and drops the pins. */
    wait_pins_dropped(e);
    cr_assert_eq(zinf_unregister(e, t), 0);
    void *p;
    cr_assert_eq(zinf_fetch(e, u, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(memcmp(p, want, 65536), 0, "the dead client's scribbles survived");
    cr_assert_eq(zinf_release(e, u, ZINF_TIER_DEVICE, 0), 0);
    test_expect_content(e, u, want, 65536, "after the client died");
    free(want);
    zinf_close(e);
    daemon_stop(&d);
}

Test(service, a_restarted_daemon_brings_back_what_was_flushed)
{
    write_cfg(true);
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("persist");
    const size_t n = 200000;
    zinf_tensor t = test_register(e, "kept", n, ZINF_TIER_NVME);
    unsigned char *want = test_rand_buf(n, 3);
    cr_assert_eq(zinf_write(e, t, 0, want, n), 0);
    cr_assert_eq(zinf_flush(e), 0);
    zinf_close(e);
    daemon_stop(&d);

    daemon_start(&d);
    /* Before anyone attaches, STATUS lists the job as saved, not open. */
    struct service_job_status *js;
    size_t njobs;
    cr_assert_eq(service_status(sock, &js, &njobs), 0);
    cr_assert_eq(njobs, 1);
    cr_assert_str_eq(js[0].name, "persist");
    cr_assert(!js[0].open);
    cr_assert_eq(js[0].sessions, 0);
    cr_assert_eq(js[0].stats.tensors, 1);
    free(js);
    e = connect_job("persist");
    cr_assert_eq(service_status(sock, &js, &njobs), 0);
    cr_assert_eq(njobs, 1, "an open job is listed once");
    cr_assert(js[0].open);
    cr_assert_eq(js[0].sessions, 1);
    free(js);
    cr_assert_eq(zinf_lookup(e, "kept", &t), 0);
    test_expect_content(e, t, want, n, "after the restart");
    /* The job's swap files are in its own folder. */
    char jd[600];
    struct stat st;
    snprintf(jd, sizeof(jd), "%s/swap/persist", dir);
    cr_assert_eq(stat(jd, &st), 0);
    cr_assert(S_ISDIR(st.st_mode));
    free(want);
    zinf_close(e);
    daemon_stop(&d);
}

struct worker {
    zinf_engine *e;
    int id;
    int failures;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    char name[32];
    snprintf(name, sizeof(name), "w%d", w->id);
    zinf_tensor t;
    if (zinf_register(w->e, name, 16384, ZINF_TIER_HOST, &t)) {
        w->failures++;
        return NULL;
    }
    for (int i = 0; i < 200; i++) {
        void *p;
        int tier = i % 2;
        if (zinf_fetch(w->e, t, tier, &p)) {
            w->failures++;
            continue;
        }
        memset(p, w->id * 16 + i % 16, 16384);
        if (zinf_release(w->e, t, tier, ZINF_RELEASE_DIRTY)) w->failures++;
        unsigned char b[16384], want[16384];
        memset(want, w->id * 16 + i % 16, sizeof(want));
        if (zinf_read(w->e, t, 0, b, sizeof(b)) || memcmp(b, want, sizeof(b))) w->failures++;
    }
    return NULL;
}

/* Threads of one client each get a connection: a call in one does not wait for another. */
Test(service, threads_of_one_client_share_its_pins_and_memory)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("threads");
    struct worker w[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (struct worker){e, i, 0};
        cr_assert_eq(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(w[i].failures, 0, "thread %d: %d failures", i, w[i].failures);
    }
    zinf_close(e);
    daemon_stop(&d);
}

/* Sends raw bytes and returns the daemon's result, or 1 when it closed without one. */
static int raw_exchange(const void *bytes, size_t n)
{
    static int call;
    call++;
    int fd = raw_connect();
    cr_assert_eq(send(fd, bytes, n, MSG_NOSIGNAL), (ssize_t)n);
    shutdown(fd, SHUT_WR);
    /* Read as bytes: the reply to an unknown op names that op, which proto_recv refuses. */
    uint8_t reply[PROTO_HEADER_BYTES + 4];
    size_t got = 0;
    ssize_t r;
    while (got < sizeof(reply) && (r = recv(fd, reply + got, sizeof(reply) - got, 0)) > 0)
        got += (size_t)r;
    int res = 1;
    if (got == sizeof(reply)) {
        uint32_t len;
        memcpy(&len, reply + 12, 4);
        cr_assert_eq(len, 4, "an error reply is its result alone");
        memcpy(&res, reply + PROTO_HEADER_BYTES, 4);
    }
    /* Then the daemon closes the connection (a reset, where it left bytes unread). */
    char c;
    cr_assert_leq(recv(fd, &c, 1, 0), 0, "message %d: the connection stays open after it", call);
    close(fd);
    return res;
}

static size_t header(uint8_t *b, uint32_t magic, uint16_t version, uint16_t op, uint32_t len)
{
    uint32_t seq = 9;
    memcpy(b, &magic, 4);
    memcpy(b + 4, &version, 2);
    memcpy(b + 6, &op, 2);
    memcpy(b + 8, &seq, 4);
    memcpy(b + 12, &len, 4);
    return 16;
}

Test(service, malformed_messages_get_an_error_and_a_closed_connection)
{
    struct daemon d;
    daemon_start(&d);
    uint8_t b[256];
    size_t n;
    /* Garbage, a wrong version, an absurd size, a reply where a request belongs, an
     * unknown op, a request before HELLO, a truncated HELLO, a HELLO with junk after it. */
    memset(b, 0xab, 64);
    cr_assert_eq(raw_exchange(b, 64), 1);
    n = header(b, PROTO_MAGIC, 99, PROTO_HELLO, 0);
    cr_assert_eq(raw_exchange(b, n), -EPROTONOSUPPORT);
    n = header(b, PROTO_MAGIC, PROTO_VERSION, PROTO_HELLO, 0xfffffff0u);
    cr_assert_eq(raw_exchange(b, n), -EMSGSIZE);
    n = header(b, PROTO_MAGIC, PROTO_VERSION, PROTO_HELLO | PROTO_REPLY, 0);
    cr_assert_eq(raw_exchange(b, n), -EBADMSG);
    n = header(b, PROTO_MAGIC, PROTO_VERSION, 77, 0);
    cr_assert_eq(raw_exchange(b, n), -EBADMSG);
    n = header(b, PROTO_MAGIC, PROTO_VERSION, PROTO_STEP, 0);
    cr_assert_eq(raw_exchange(b, n), -EPROTO);
    n = header(b, PROTO_MAGIC, PROTO_VERSION, PROTO_HELLO, 3);
    memcpy(b + n, "\x05\0\0", 3);
    cr_assert_eq(raw_exchange(b, n + 3), -EBADMSG);
    n = header(b, PROTO_MAGIC, PROTO_VERSION, PROTO_HELLO, 4 + 1 + 16 + 4);
    uint32_t one = 1;
    memcpy(b + n, &one, 4);
    b[n + 4] = 'j';
    memset(b + n + 5, 0, 16 + 4);
    cr_assert_eq(raw_exchange(b, n + 25), -EBADMSG);
    /* A header cut short: the daemon just closes. */
    n = header(b, PROTO_MAGIC, PROTO_VERSION, PROTO_HELLO, 10);
    cr_assert_eq(raw_exchange(b, 7), 1);
    /* After all that, a real client is served. */
    zinf_engine *e = connect_job("after-junk");
    zinf_tensor t = test_register(e, "t", 4096, ZINF_TIER_HOST);
    cr_assert_eq(zinf_write(e, t, 0, "ok", 2), 0);
    zinf_close(e);
    daemon_stop(&d);
}

/* A client joins a session only with its secret: a made-up session id is refused. */
Test(service, a_session_cannot_be_joined_without_its_secret)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("sess");
    struct proto_out o;
    proto_out_init(&o, PROTO_HELLO, 1);
    proto_put_str(&o, "sess");
    proto_put_u64(&o, 1); /* the first session's id, guessed */
    proto_put_u64(&o, 12345);
    int fd = raw_connect();
    cr_assert_eq(proto_send(fd, &o, NULL, 0), 0);
    proto_out_free(&o);
    struct proto_header h;
    uint8_t *payload;
    cr_assert_eq(proto_recv(fd, true, &h, &payload, NULL, NULL), 0);
    int32_t res;
    memcpy(&res, payload, 4);
    free(payload);
    cr_assert_eq(res, -ECONNRESET);
    close(fd);
    zinf_close(e);
    daemon_stop(&d);
}

/* ---- the hit path in the session's pin table -------------------------------------------- */

Test(service, hits_send_no_message_and_count_as_fetches)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("hits");
    zinf_tensor t = test_register(e, "t", 65536, ZINF_TIER_HOST);
    const unsigned n = 10000; /* more than the event ring holds: some go as messages */
    void *p, *first = NULL;
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &first), 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    uint64_t before = service_requests(d.s);
    for (unsigned i = 1; i < n; i++) {
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
        cr_assert_eq(p, first, "a resident copy does not move");
        cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    }
    uint64_t sent = service_requests(d.s) - before;
    cr_assert_leq(sent, (n / PT_RING) + 1, "%llu of %u hits went to the daemon",
                  (unsigned long long)sent, n - 1);
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tier[ZINF_TIER_DEVICE].fetches, n);
    cr_assert_eq(st.tier[ZINF_TIER_DEVICE].hits, n - 1);
    cr_assert_eq(st.tier[ZINF_TIER_DEVICE].pinned_bytes, 0, "an idle lease is no pin");
    zinf_close(e);
    daemon_stop(&d);
}

/* The schedule a step teaches the engine is the same whether its hits went through the
 * daemon or the pin table. */
Test(service, the_schedule_is_learned_from_hits_in_the_table)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("sched");
    zinf_tensor t[6];
    for (int i = 0; i < 6; i++) {
        char name[8];
        snprintf(name, sizeof(name), "t%d", i);
        t[i] = test_register(e, name, 65536, ZINF_TIER_HOST);
    }
    cr_assert_eq(zinf_step(e), 0);
    for (int step = 0; step < 4; step++) {
        for (int i = 0; i < 6; i++) {
            void *p;
            cr_assert_eq(zinf_fetch(e, t[i], ZINF_TIER_DEVICE, &p), 0);
            cr_assert_eq(zinf_release(e, t[i], ZINF_TIER_DEVICE, 0), 0);
        }
        cr_assert_eq(zinf_step(e), 0);
    }
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.schedule_length, 6);
    cr_assert_eq(st.schedule_resets, 0);
    cr_assert_eq(st.tier[ZINF_TIER_DEVICE].fetches, 24);
    cr_assert_eq(st.tier[ZINF_TIER_DEVICE].hits, 18);
    zinf_close(e);
    daemon_stop(&d);
}

/* Device tier 4 MiB, tensors of 1.5 MiB: two fit, a third needs room. */
Test(service, an_idle_lease_gives_way_and_a_held_pin_does_not)
{
    struct daemon d;
    write_cfg(true);
    daemon_start(&d);
    zinf_engine *a = connect_job("room"), *b = connect_job("room");
    const size_t n = 3 << 19;
    zinf_tensor t[5];
    unsigned char *want[5];
    for (int i = 0; i < 5; i++) {
        char name[8];
        snprintf(name, sizeof(name), "t%d", i);
        t[i] = test_register(a, name, n, ZINF_TIER_NVME);
        want[i] = test_rand_buf(n, 100 + i);
        cr_assert_eq(zinf_write(a, t[i], 0, want[i], n), 0);
    }
    void *p, *q, *r;
    /* a leaves t0 with an idle lease; b's two fetches need its room. */
    cr_assert_eq(zinf_fetch(a, t[0], ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(zinf_release(a, t[0], ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_fetch(a, t[0], ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(zinf_release(a, t[0], ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_fetch(b, t[1], ZINF_TIER_DEVICE, &q), 0);
    cr_assert_eq(zinf_fetch(b, t[2], ZINF_TIER_DEVICE, &r), 0, "the idle lease held its room");
    cr_assert_eq(memcmp(q, want[1], n), 0);
    cr_assert_eq(memcmp(r, want[2], n), 0);
    cr_assert_eq(zinf_release(b, t[1], ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_release(b, t[2], ZINF_TIER_DEVICE, 0), 0);
    /* t0's slot closed when it went: a's next fetch asks the daemon, which loads it. */
    cr_assert_eq(zinf_fetch(a, t[0], ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(memcmp(p, want[0], n), 0);
    /* a now holds t0 (through its slot): b gets one more tensor in, not two. */
    cr_assert_eq(zinf_fetch(b, t[3], ZINF_TIER_DEVICE, &q), 0);
    cr_assert_eq(zinf_fetch(b, t[4], ZINF_TIER_DEVICE, &r), -ENOMEM, "a's pin was taken");
    cr_assert_eq(memcmp(p, want[0], n), 0, "a held copy moved");
    cr_assert_eq(zinf_release(a, t[0], ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_release(a, t[0], ZINF_TIER_DEVICE, 0), -EINVAL, "one pin, two releases");
    cr_assert_eq(zinf_fetch(b, t[4], ZINF_TIER_DEVICE, &r), 0);
    cr_assert_eq(memcmp(r, want[4], n), 0);
    cr_assert_eq(zinf_release(b, t[3], ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_release(b, t[4], ZINF_TIER_DEVICE, 0), 0);
    for (int i = 0; i < 5; i++) {
        test_expect_content(b, t[i], want[i], n, "after the evictions");
        free(want[i]);
    }
    zinf_close(b);
    zinf_close(a);
    daemon_stop(&d);
}

Test(service, a_dirty_release_closes_idle_leases_of_the_other_tier)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *a = connect_job("dirty"), *b = connect_job("dirty");
    const size_t n = 65536;
    zinf_tensor t = test_register(a, "t", n, ZINF_TIER_HOST);
    unsigned char *v1 = test_rand_buf(n, 1), *v2 = test_rand_buf(n, 2), *v3 = test_rand_buf(n, 3);
    cr_assert_eq(zinf_write(a, t, 0, v1, n), 0);
    void *h, *dv;
    for (int i = 0; i < 2; i++) { /* the second time through a's slot */
        cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_HOST, &h), 0);
        cr_assert_eq(memcmp(h, v1, n), 0);
        cr_assert_eq(zinf_release(a, t, ZINF_TIER_HOST, 0), 0);
    }
    /* b writes on the device: a's idle lease of the host copy does not make it -EBUSY. */
    cr_assert_eq(zinf_fetch(b, t, ZINF_TIER_DEVICE, &dv), 0);
    memcpy(dv, v2, n);
    cr_assert_eq(zinf_release(b, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_HOST, &h), 0);
    cr_assert_eq(memcmp(h, v2, n), 0, "a's slot served a stale copy");
    /* a holds the host copy now: a DIRTY release on the device is refused, as embedded. */
    cr_assert_eq(zinf_fetch(b, t, ZINF_TIER_DEVICE, &dv), 0);
    cr_assert_eq(zinf_release(b, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), -EBUSY);
    cr_assert_eq(zinf_release(b, t, ZINF_TIER_DEVICE, 0), 0);
    /* a writes through its slot's pin and releases DIRTY (a message). */
    memcpy(h, v3, n);
    cr_assert_eq(zinf_release(a, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
    cr_assert_eq(zinf_fetch(b, t, ZINF_TIER_DEVICE, &dv), 0);
    cr_assert_eq(memcmp(dv, v3, n), 0);
    cr_assert_eq(zinf_release(b, t, ZINF_TIER_DEVICE, 0), 0);
    test_expect_content(b, t, v3, n, "after the DIRTY releases");
    free(v1);
    free(v2);
    free(v3);
    zinf_close(b);
    zinf_close(a);
    daemon_stop(&d);
}

/* ZINF_RELEASE_ZERO through the daemon, from an ordinary pin (a message) and from one
 * taken through the session's slot: another session's idle lease gives way, its held pin
 * does not (-EBUSY, the content kept), and the zeros that follow are read from nowhere. */
Test(service, a_zero_release_through_a_message_or_a_slot_skips_the_drive)
{
    struct daemon d;
    write_cfg(true);
    daemon_start(&d);
    zinf_engine *a = connect_job("spent"), *b = connect_job("spent");
    const size_t n = 65536;
    zinf_tensor t = test_register(a, "g", n, ZINF_TIER_NVME);
    unsigned char *v1 = test_rand_buf(n, 1), *v2 = test_rand_buf(n, 2);
    unsigned char *zeros = calloc(1, n);
    void *h, *dv;
    struct zinf_stats s0, s1;
    cr_assert_eq(zinf_write(a, t, 0, v1, n), 0);
    cr_assert_eq(zinf_flush(a), 0);
    for (int i = 0; i < 2; i++) { /* the second time through a's slot: an idle lease */
        cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_HOST, &h), 0);
        cr_assert_eq(memcmp(h, v1, n), 0);
        cr_assert_eq(zinf_release(a, t, ZINF_TIER_HOST, 0), 0);
    }
    cr_assert_eq(zinf_fetch(b, t, ZINF_TIER_HOST, &h), 0);
    cr_assert_eq(zinf_release(b, t, ZINF_TIER_HOST, ZINF_RELEASE_ZERO), 0, "a's idle lease");
    cr_assert_eq(zinf_stats(a, &s0), 0);
    cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_HOST, &h), 0);
    cr_assert_eq(memcmp(h, zeros, n), 0, "a's slot served the spent content");
    cr_assert_eq(zinf_fetch(b, t, ZINF_TIER_DEVICE, &dv), 0);
    cr_assert_eq(memcmp(dv, zeros, n), 0);
    cr_assert_eq(zinf_stats(a, &s1), 0);
    cr_assert_eq(s1.nvme_bytes_read, s0.nvme_bytes_read, "zeros were read from the drive");
    /* a holds the host copy: b's zero release is refused and keeps b's pin. */
    cr_assert_eq(zinf_release(b, t, ZINF_TIER_DEVICE, ZINF_RELEASE_ZERO), -EBUSY);
    cr_assert_eq(zinf_release(b, t, ZINF_TIER_DEVICE, 0), 0);
    memcpy(h, v2, n);
    cr_assert_eq(zinf_release(a, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
    test_expect_content(b, t, v2, n, "after the refused zero release");
    /* a's pin through its slot, released as spent. */
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_HOST, &h), 0);
        cr_assert_eq(memcmp(h, v2, n), 0);
        cr_assert_eq(zinf_release(a, t, ZINF_TIER_HOST, i ? ZINF_RELEASE_ZERO : 0), 0);
    }
    test_expect_content(b, t, zeros, n, "after the zero release through a slot");
    cr_assert_eq(zinf_fetch(b, t, ZINF_TIER_HOST, &h), 0);
    cr_assert_eq(zinf_release(b, t, ZINF_TIER_HOST, 0), 0);
    /* zinf_zero, no pin: refused while a holds the copy through its slot (a's own call too),
     * and once a's lease is idle, b's call closes it; a then reads zeros, not the drive. */
    cr_assert_eq(zinf_write(b, t, 0, v1, n), 0);
    cr_assert_eq(zinf_flush(b), 0);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_HOST, &h), 0);
        cr_assert_eq(memcmp(h, v1, n), 0);
        if (i) {
            cr_assert_eq(zinf_zero(b, t), -EBUSY, "a holds it through its slot");
            cr_assert_eq(zinf_zero(a, t), -EBUSY, "a holds it itself");
        }
        cr_assert_eq(zinf_release(a, t, ZINF_TIER_HOST, 0), 0);
    }
    test_expect_content(b, t, v1, n, "after refused zinf_zero calls");
    cr_assert_eq(zinf_stats(a, &s0), 0);
    cr_assert_eq(zinf_zero(b, t), 0, "a's idle lease");
    cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_HOST, &h), 0);
    cr_assert_eq(memcmp(h, zeros, n), 0, "a's slot served the zeroed content");
    cr_assert_eq(zinf_release(a, t, ZINF_TIER_HOST, 0), 0);
    cr_assert_eq(zinf_stats(a, &s1), 0);
    cr_assert_eq(s1.nvme_bytes_read, s0.nvme_bytes_read, "zeros were read from the drive");
    cr_assert_eq(s1.nvme_bytes_written, s0.nvme_bytes_written, "zinf_zero wrote");
    free(v1);
    free(v2);
    free(zeros);
    zinf_close(b);
    zinf_close(a);
    daemon_stop(&d);
}

/* Spent content made zeros (zinf_zero, spent releases) while another session pins the copy
 * through its slot with atomics alone, a third tensor takes the room a dropped copy frees,
 * and flushes own the tensor: every call answers 0 or -EBUSY, and the reader only ever sees
 * the content's two values. A copy dropped under a pin would show it the other tensor's
 * bytes, or fail the daemon's own checks. */
struct zr_reader {
    zinf_engine *e;
    zinf_tensor t;
    size_t n;
    atomic_bool stop;
    unsigned long fetches;
    char bad[160];
};

static void *zr_read(void *arg)
{
    struct zr_reader *r = arg;
    while (!atomic_load(&r->stop) && !r->bad[0]) {
        void *p;
        int x = zinf_fetch(r->e, r->t, ZINF_TIER_HOST, &p);
        if (x) {
            snprintf(r->bad, sizeof(r->bad), "fetch: %s", zinf_strerror(x));
            break;
        }
        const unsigned char *b = p;
        for (size_t i = 0; i < r->n; i++)
            if (b[i] != 0 && b[i] != 0x5a) {
                snprintf(r->bad, sizeof(r->bad), "fetch %lu: byte %zu is %#x", r->fetches, i,
                         b[i]);
                break;
            }
        if ((x = zinf_release(r->e, r->t, ZINF_TIER_HOST, 0)) && !r->bad[0])
            snprintf(r->bad, sizeof(r->bad), "release: %s", zinf_strerror(x));
        r->fetches++;
        /* Idle a moment now and then: the lease is idle, for the others' calls to close. */
        if (r->fetches % 4 == 0) nanosleep(&(struct timespec){.tv_nsec = 20000}, NULL);
    }
    return NULL;
}

Test(service, spent_content_races_a_session_pinning_through_its_slot)
{
    struct daemon d;
    write_cfg(true);
    daemon_start(&d);
    zinf_engine *a = connect_job("zrace"), *b = connect_job("zrace");
    const size_t n = 256 * 1024;
    zinf_tensor t = test_register(b, "g", n, ZINF_TIER_NVME);
    zinf_tensor u = test_register(b, "other", n, ZINF_TIER_NVME);
    unsigned char *pat = malloc(n), *oth = malloc(n);
    memset(pat, 0x5a, n);
    memset(oth, 0xc3, n);
    cr_assert_eq(zinf_write(b, t, 0, pat, n), 0);
    cr_assert_eq(zinf_write(b, u, 0, oth, n), 0);
    struct zr_reader r = {.e = a, .t = t, .n = n};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, zr_read, &r), 0);
    unsigned zeroed = 0, spent = 0, busy = 0;
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; !r.bad[0]; i++) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec - t0.tv_sec >= 2 && (zeroed && spent)) break;
        if (now.tv_sec - t0.tv_sec >= 10) break;
        void *p;
        int x = 0;
        switch (i % 5) {
        case 0:
            x = zinf_write(b, t, 0, pat, n);
            break;
        case 1:
            x = zinf_zero(b, t);
            zeroed += x == 0;
            break;
        case 2:
            cr_assert_eq(zinf_fetch(b, t, i % 2 ? ZINF_TIER_DEVICE : ZINF_TIER_HOST, &p), 0);
            x = zinf_release(b, t, i % 2 ? ZINF_TIER_DEVICE : ZINF_TIER_HOST,
                             ZINF_RELEASE_ZERO);
            if (x == -EBUSY)
                cr_assert_eq(zinf_release(b, t, i % 2 ? ZINF_TIER_DEVICE : ZINF_TIER_HOST, 0),
                             0, "the refused release kept no pin");
            spent += x == 0;
            break;
        case 3: /* the room a dropped copy frees */
            cr_assert_eq(zinf_fetch(b, u, ZINF_TIER_HOST, &p), 0);
            cr_assert_eq(memcmp(p, oth, n), 0);
            cr_assert_eq(zinf_release(b, u, ZINF_TIER_HOST, 0), 0);
            break;
        case 4:
            if (i % 50 == 4) x = zinf_flush(b);
            break;
        }
        busy += x == -EBUSY;
        cr_assert(x == 0 || x == -EBUSY, "call %d (%d): %s", i, i % 5, zinf_strerror(x));
    }
    atomic_store(&r.stop, true);
    pthread_join(th, NULL);
    cr_assert_eq(r.bad[0], 0, "the reader: %s", r.bad);
    cr_assert_gt(r.fetches, 0);
    cr_assert_gt(zeroed, 0, "no zinf_zero went through (%u refused)", busy);
    cr_assert_gt(spent, 0, "no spent release went through (%u refused)", busy);
    cr_assert_eq(zinf_write(b, t, 0, pat, n), 0);
    test_expect_content(a, t, pat, n, "after the race");
    test_expect_content(a, u, oth, n, "the other tensor after the race");
    free(pat);
    free(oth);
    zinf_close(b);
    zinf_close(a);
    daemon_stop(&d);
}

Test(service, unregister_closes_idle_leases_and_stale_handles_miss)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *a = connect_job("unreg"), *b = connect_job("unreg");
    zinf_tensor t = test_register(a, "t", 65536, ZINF_TIER_HOST);
    void *p;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_DEVICE, &p), 0);
        cr_assert_eq(zinf_release(a, t, ZINF_TIER_DEVICE, 0), 0);
        cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_HOST, &p), 0);
        cr_assert_eq(zinf_release(a, t, ZINF_TIER_HOST, 0), 0);
    }
    cr_assert_eq(zinf_unregister(b, t), 0, "idle leases kept the tensor registered");
    cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_DEVICE, &p), -EINVAL);
    cr_assert_eq(zinf_release(a, t, ZINF_TIER_DEVICE, 0), -EINVAL);
    /* The same slot for a new tensor: the old handle still misses. */
    zinf_tensor u = test_register(b, "u", 65536, ZINF_TIER_HOST);
    cr_assert_eq((uint32_t)u, (uint32_t)t, "the slot was not reused; the test proves nothing");
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(zinf_fetch(a, u, ZINF_TIER_DEVICE, &p), 0);
        cr_assert_eq(zinf_release(a, u, ZINF_TIER_DEVICE, 0), 0);
    }
    cr_assert_eq(zinf_fetch(a, u, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(zinf_fetch(a, t, ZINF_TIER_DEVICE, &p), -EINVAL);
    cr_assert_eq(zinf_release(a, t, ZINF_TIER_DEVICE, 0), -EINVAL);
    cr_assert_eq(zinf_unregister(b, u), -EBUSY, "a holds u through its slot");
    cr_assert_eq(zinf_release(a, u, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_unregister(b, u), 0);
    zinf_close(b);
    zinf_close(a);
    daemon_stop(&d);
}

/* The daemon in a child process, killed: the pin table's hit path must not go on handing
 * out its memory as if nothing happened. */
Test(service, after_the_daemon_dies_every_call_answers_econnreset)
{
    zinf_engine *e = NULL;
    pid_t pid = fork_daemon("dies", &e);
    zinf_tensor t = test_register(e, "t", 65536, ZINF_TIER_HOST);
    void *p;
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
        cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    }
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0); /* held when it dies */
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), -ECONNRESET);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), -ECONNRESET);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), -ECONNRESET);
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), -ECONNRESET);
    zinf_close(e);
}

/* The same after a clean stop. */
Test(service, after_the_daemon_stops_the_table_is_not_used)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("stops");
    zinf_tensor t = test_register(e, "t", 65536, ZINF_TIER_HOST);
    void *p;
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
        cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), 0);
    }
    daemon_stop(&d);
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), -ECONNRESET);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, 0), -ECONNRESET);
    zinf_close(e);
}

/* A client killed while it writes into the only copy of a tensor's newest content: the
 * copy goes back to what it held when pinned, never left half-written as the newest. */
Test(service, a_killed_client_leaves_no_half_written_newest_copy)
{
    struct daemon d;
    write_cfg(true);
    daemon_start(&d);
    zinf_engine *e = connect_job("torn");
    const size_t n = 100000;
    zinf_tensor h = test_register(e, "h", n, ZINF_TIER_HOST); /* its home: the only copy */
    zinf_tensor v = test_register(e, "v", n, ZINF_TIER_NVME);
    zinf_tensor w = test_register(e, "w", n, ZINF_TIER_NVME);
    unsigned char *hv = test_rand_buf(n, 21), *v2 = test_rand_buf(n, 22),
                  *w1 = test_rand_buf(n, 23), *w2 = test_rand_buf(n, 24);
    cr_assert_eq(zinf_write(e, h, 0, hv, n), 0);
    cr_assert_eq(zinf_write(e, w, 0, w1, n), 0);
    cr_assert_eq(zinf_flush(e), 0); /* w's home holds w1: its cached copies are not alone */
    int ready[2], go[2];
    cr_assert_eq(pipe(ready), 0);
    cr_assert_eq(pipe(go), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        zinf_engine *c;
        void *p, *q, *s;
        char one = 1;
        if (zinf_connect(sock, "torn", &c) || zinf_fetch(c, h, ZINF_TIER_HOST, &p) ||
            zinf_fetch(c, v, ZINF_TIER_DEVICE, &q))
            _exit(1);
        memcpy(q, v2, n);
        if (zinf_release(c, v, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY) ||
            zinf_fetch(c, v, ZINF_TIER_DEVICE, &q)) /* v's newest content: only here */
            _exit(2);
        /* w through the pin table: leased while its home held it too. */
        for (int i = 0; i < 3; i++)
            if (zinf_fetch(c, w, ZINF_TIER_HOST, &s) || (i < 2 && zinf_release(c, w, ZINF_TIER_HOST, 0)))
                _exit(3);
        if (write(ready[1], &one, 1) != 1 || read(go[0], &one, 1) != 1) _exit(4);
        memset(p, 0xee, n / 2); /* half-written, never released */
        memset(q, 0xdd, n / 2);
        memset(s, 0xcc, n / 2);
        if (write(ready[1], &one, 1) != 1) _exit(5);
        for (;;)
            pause();
    }
    char got = 0;
    close(ready[1]);
    cr_assert_eq(read(ready[0], &got, 1), 1, "the child could not pin");
    /* w2 goes into w's copies in place (the child holds its host copy): now only memory
     * holds w's newest content, and the child's pin is on one of its holders. */
    cr_assert_eq(zinf_write(e, w, 0, w2, n), 0);
    cr_assert_eq(write(go[1], &got, 1), 1);
    cr_assert_eq(read(ready[0], &got, 1), 1, "the child did not scribble");
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    close(ready[0]);
    close(go[0]);
    close(go[1]);
    wait_pins_dropped(e);
    test_expect_content(e, h, hv, n, "a home copy the dead client scribbled on");
    test_expect_content(e, v, v2, n, "the only newest copy the dead client scribbled on");
    test_expect_content(e, w, w2, n, "a leased copy that became the newest's only holder");
    free(hv);
    free(v2);
    free(w1);
    free(w2);
    zinf_close(e);
    daemon_stop(&d);
}

/* A set fetched in one call is released member by member without a message. */
Test(service, a_fetched_set_is_released_through_the_table)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e = connect_job("set");
    zinf_tensor ts[4];
    void *p[4], *q[4];
    for (int i = 0; i < 3; i++) {
        char name[8];
        snprintf(name, sizeof(name), "s%d", i);
        ts[i] = test_register(e, name, 65536, ZINF_TIER_HOST);
    }
    ts[3] = ts[0]; /* twice in the set: two pins */
    cr_assert_eq(zinf_fetch_all(e, ts, 4, ZINF_TIER_DEVICE, p), 0);
    cr_assert_eq(p[3], p[0]);
    uint64_t before = service_requests(d.s);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(zinf_release(e, ts[i], ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(service_requests(d.s), before, "a release of a set member was a message");
    cr_assert_eq(zinf_release(e, ts[0], ZINF_TIER_DEVICE, 0), -EINVAL, "released three times");
    /* And fetched again one by one, through the table. */
    before = service_requests(d.s);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(zinf_fetch(e, ts[i], ZINF_TIER_DEVICE, &q[i]), 0);
    cr_assert_eq(service_requests(d.s), before);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(q[i], p[i]);
        cr_assert_eq(zinf_release(e, ts[i], ZINF_TIER_DEVICE, 0), 0);
    }
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tier[ZINF_TIER_DEVICE].fetches, 7);
    cr_assert_eq(st.tier[ZINF_TIER_DEVICE].pinned_bytes, 0);
    zinf_close(e);
    daemon_stop(&d);
}

/* ---- a GPU arena, shared through CUDA IPC (skipped without a usable GPU) ----------------- */

#if ZINF_HAVE_CUDA
#include <cuda_runtime_api.h>

/* A daemon on a GPU arena of 8 MiB. On a real GPU it runs in a child process (a process
 * cannot open its own IPC handle); the CPU emulation of CUDA shares memory within one
 * process only, so there it runs in a thread (d). Returns the child, or -1. */
static pid_t gpu_daemon(struct daemon *d, const char *job, zinf_engine **e)
{
    struct cuda_probe_info pi;
    if (test_cuda_probe_forked(&pi) <= 0) cr_skip_test("no usable GPU: %s", pi.reason);
    FILE *f = fopen(cfg_path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"zinf\": {\"device\": \"cuda\", \"device_bytes\": \"8M\", \"host_bytes\": \"4M\"}}");
    fclose(f);
    if (strstr(pi.name, "EMU")) {
        daemon_start(d);
        *e = connect_job(job);
        return -1;
    }
    return fork_daemon(job, e);
}

static void gpu_daemon_stop(struct daemon *d, pid_t pid)
{
    if (pid < 0) {
        daemon_stop(d);
        return;
    }
    kill(pid, SIGTERM);
    int status;
    waitpid(pid, &status, 0);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the daemon: %#x", status);
}

Test(service, a_gpu_arena_is_opened_through_cuda_ipc)
{
    struct daemon d;
    zinf_engine *e = NULL;
    pid_t pid = gpu_daemon(&d, "gpu", &e);
    const size_t n = 1 << 20;
    zinf_tensor t = test_register(e, "t", n, ZINF_TIER_HOST);
    unsigned char *a = test_rand_buf(n, 31), *b = test_rand_buf(n, 32), *got = malloc(n);
    cr_assert_eq(zinf_write(e, t, 0, a, n), 0);
    void *p, *q;
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(cudaMemcpy(got, p, n, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(memcmp(got, a, n), 0, "the daemon's GPU copy, read through the IPC mapping");
    cr_assert_eq(cudaMemcpy(p, b, n, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    test_expect_content(e, t, b, n, "written on the GPU through the IPC mapping");
    cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &q), 0);
    cr_assert_eq(q, p, "a resident copy stays where it is");
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_DEVICE, 0), 0);
    free(a);
    free(b);
    free(got);
    zinf_close(e);
    gpu_daemon_stop(&d, pid);
}

/* A client that goes away holding a GPU copy that is its tensor's only newest content
 * (a DIRTY release not yet written back, a DEVICE home) leaves it as last released: the
 * daemon put back the image it took when the copy was pinned. The connection ends without
 * a release or a flush, as when the process is killed. */
Test(service, a_dead_clients_gpu_copy_is_put_back_as_released)
{
    struct daemon d;
    zinf_engine *e = NULL;
    pid_t pid = gpu_daemon(&d, "undo", &e);
    const size_t n = 1 << 20;
    zinf_tensor t = test_register(e, "t", n, ZINF_TIER_HOST);
    zinf_tensor g = test_register(e, "g", n, ZINF_TIER_DEVICE);
    unsigned char *a = test_rand_buf(n, 41), *b = test_rand_buf(n, 42), *ga = test_rand_buf(n, 43),
                  *junk = test_rand_buf(n, 44);
    cr_assert_eq(zinf_write(e, t, 0, a, n), 0);
    cr_assert_eq(zinf_write(e, g, 0, ga, n), 0);
    zinf_engine *c;
    cr_assert_eq(zinf_connect(sock, "undo", &c), 0);
    void *p, *q;
    cr_assert_eq(zinf_fetch(c, t, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(cudaMemcpy(p, b, n, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(zinf_release(c, t, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    /* Pinned again, released, and pinned once more (through the pin table, where the
     * first pin opened its slot), then half-written. */
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(zinf_fetch(c, t, ZINF_TIER_DEVICE, &p), 0);
        cr_assert_eq(zinf_fetch(c, g, ZINF_TIER_DEVICE, &q), 0);
        if (i == 0) {
            cr_assert_eq(zinf_release(c, t, ZINF_TIER_DEVICE, 0), 0);
            cr_assert_eq(zinf_release(c, g, ZINF_TIER_DEVICE, 0), 0);
        }
    }
    cr_assert_eq(cudaMemcpy(p, junk, n / 2, cudaMemcpyHostToDevice), cudaSuccess);
    cr_assert_eq(cudaMemcpy(q, junk, n / 2, cudaMemcpyHostToDevice), cudaSuccess);
    client_close_unflushed((struct client *)c);
    wait_pins_dropped(e);
    test_expect_content(e, t, b, n, "a GPU copy with the only newest content, abandoned");
    test_expect_content(e, g, ga, n, "a DEVICE home, abandoned");
    free(a);
    free(b);
    free(ga);
    free(junk);
    zinf_close(e);
    gpu_daemon_stop(&d, pid);
}
#endif

/* An engine serves ENGINE_MAX_PINSETS (64) pin tables: a session beyond them gets none,
 * and every call of it is a message, with the same answers. */
Test(service, a_session_without_a_pin_table_answers_the_same)
{
    struct daemon d;
    daemon_start(&d);
    zinf_engine *e[65];
    for (int i = 0; i < 65; i++)
        e[i] = connect_job("many");
    zinf_engine *last = e[64];
    zinf_tensor t = test_register(last, "t", 65536, ZINF_TIER_HOST);
    void *p, *q;
    cr_assert_eq(zinf_fetch(last, t, ZINF_TIER_DEVICE, &p), 0);
    cr_assert_eq(zinf_release(last, t, ZINF_TIER_DEVICE, 0), 0);
    uint64_t before = service_requests(d.s);
    cr_assert_eq(zinf_fetch(last, t, ZINF_TIER_DEVICE, &q), 0);
    cr_assert_eq(q, p);
    cr_assert_eq(zinf_release(last, t, ZINF_TIER_DEVICE, 0), 0);
    cr_assert_eq(zinf_release(last, t, ZINF_TIER_DEVICE, 0), -EINVAL);
    cr_assert_eq(service_requests(d.s) - before, 3, "the 65th session's hits were messages");
    /* One of the first 64 goes: the next session gets its table. */
    zinf_close(e[0]);
    zinf_engine *again = NULL;
    for (int i = 0; i < 300; i++) { /* the daemon frees the table once it sees the close */
        zinf_engine *c = connect_job("many");
        cr_assert_eq(zinf_fetch(c, t, ZINF_TIER_DEVICE, &q), 0);
        cr_assert_eq(zinf_release(c, t, ZINF_TIER_DEVICE, 0), 0);
        before = service_requests(d.s);
        cr_assert_eq(zinf_fetch(c, t, ZINF_TIER_DEVICE, &q), 0);
        cr_assert_eq(zinf_release(c, t, ZINF_TIER_DEVICE, 0), 0);
        if (service_requests(d.s) == before) {
            again = c;
            break;
        }
        zinf_close(c);
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    cr_assert_not_null(again, "a freed pin table was never given out again");
    zinf_close(again);
    for (int i = 1; i < 65; i++)
        zinf_close(e[i]);
    daemon_stop(&d);
}

/* ---- write-behind while a second user pokes at the daemon ------------------------------ */

/* Root's job steps through a learned schedule whose DIRTY releases start write-behinds,
 * while a child that dropped to uid 65534 (as `setpriv --reuid=65534 --regid=65534
 * --clear-groups` would) tries every way it has into that job: by name, by guessed session
 * and secret, by job command, through STATUS, through the handles of root's tensors in a job
 * of its own, and with malformed and half-sent messages. Needs root; skipped otherwise. */

#define WB_NOBODY 65534
#define WB_JOB "wb-owner"
#define WB_OTHER "wb-other"
#define WB_TENSORS 12         /* root's tensors, NVMe-homed */
#define WB_BYTES (256 * 1024) /* each; 12 of them cycle through the 2 MiB host tier */
#define WB_MINE 3             /* the second user's own tensors: w0..w2, as root's */
#define WB_MINE_BYTES (64 * 1024)
#define WB_MINE_BYTE 0xee /* their every byte */
#define WB_STEPS 6        /* learned steps at least */

/* Shared between the test and its uid-65534 child (MAP_SHARED, anonymous). */
struct wb_shared {
    atomic_int go;      /* 1: root's tensors are registered, their handles below */
    atomic_int ready;   /* 1: the child is attached to its own job; -1: it could not be */
    atomic_int stop;    /* 1: root's steps are over */
    atomic_uint rounds; /* the child's rounds of attempts, done */
    zinf_tensor owner[WB_TENSORS];
};

/* The child's failures as text through a pipe (at most 40 lines, so that a child failing
 * in a loop cannot fill the pipe and wait on it), and their count. */
struct wb_report {
    int fd;
    int failures;
};

static void wb_say(struct wb_report *rp, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void wb_say(struct wb_report *rp, const char *fmt, ...)
{
    if (rp->failures++ >= 40) return;
    va_list ap;
    va_start(ap, fmt);
    test_report_line(rp->fd, fmt, ap);
    va_end(ap);
}

static void wb_quiet(enum log_level level, const char *msg, void *data)
{
    (void)level, (void)msg, (void)data; /* the client's notes on each refusal */
}

static bool wb_err_unknown(int r)
{
    return r == -ENOENT || r == -EINVAL;
}

/* A connection to the daemon, for the child (no Criterion asserts there): the fd or -errno.
 * A reply that does not come in 5 s is a failure, not a hang. */
static int wb_connect(void)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(sock) >= sizeof(a.sun_path)) return -ENAMETOOLONG;
    memcpy(a.sun_path, sock, strlen(sock) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -errno;
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        int r = -errno;
        close(fd);
        return r;
    }
    return fd;
}

/* One request as q says and its reply's result, or -errno of the exchange (-ECONNRESET: the
 * daemon closed). File descriptors that come with the reply are closed. */
static int wb_call(int fd, const struct proto_request *q)
{
    struct proto_out o;
    proto_encode_request(q, 7, &o);
    int r = proto_send(fd, &o, NULL, 0);
    proto_out_free(&o);
    if (r < 0) return r;
    struct proto_header h;
    uint8_t *p = NULL;
    int fds[8], nfds = 8;
    r = proto_recv(fd, true, &h, &p, fds, &nfds);
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    if (r < 0) return r;
    int32_t res = -EBADMSG;
    if (h.len >= 4) memcpy(&res, p, 4);
    free(p);
    return res;
}

/* Whether the daemon has closed fd (nothing more to read; a reset counts). */
static bool wb_closed(int fd)
{
    char c;
    return recv(fd, &c, 1, 0) <= 0;
}

/* Raw bytes on a connection of their own: the daemon's result, 1 when it closed without
 * one; then it must close. */
static void wb_junk(struct wb_report *rp, const char *what, const void *bytes, size_t n, int want)
{
    int fd = wb_connect();
    if (fd < 0) {
        wb_say(rp, "%s: connect: %s", what, zinf_strerror(fd));
        return;
    }
    if (send(fd, bytes, n, MSG_NOSIGNAL) != (ssize_t)n) {
        wb_say(rp, "%s: send: %s", what, strerror(errno));
        close(fd);
        return;
    }
    shutdown(fd, SHUT_WR);
    uint8_t reply[PROTO_HEADER_BYTES + 4];
    size_t got = 0;
    ssize_t r;
    while (got < sizeof(reply) && (r = recv(fd, reply + got, sizeof(reply) - got, 0)) > 0)
        got += (size_t)r;
    int res = 1;
    if (got == sizeof(reply)) memcpy(&res, reply + PROTO_HEADER_BYTES, 4);
    if (res != want) wb_say(rp, "%s: answered %d, not %d", what, res, want);
    if (!wb_closed(fd)) wb_say(rp, "%s: the connection stays open", what);
    close(fd);
}

static size_t wb_header(uint8_t *b, uint16_t version, uint16_t op, uint32_t len)
{
    uint32_t magic = PROTO_MAGIC, seq = 3;
    memcpy(b, &magic, 4);
    memcpy(b + 4, &version, 2);
    memcpy(b + 6, &op, 2);
    memcpy(b + 8, &seq, 4);
    memcpy(b + 12, &len, 4);
    return PROTO_HEADER_BYTES;
}

/* Messages that break the protocol, before any HELLO: an error (or nothing) and a close. */
static void wb_malformed(struct wb_report *rp, zinf_tensor theirs)
{
    uint8_t b[256];
    size_t n;
    memset(b, 0xab, 64);
    wb_junk(rp, "garbage", b, 64, 1);
    n = wb_header(b, 99, PROTO_HELLO, 0);
    wb_junk(rp, "version 99", b, n, -EPROTONOSUPPORT);
    n = wb_header(b, PROTO_VERSION, PROTO_HELLO, 0xfffffff0u);
    wb_junk(rp, "an absurd length", b, n, -EMSGSIZE);
    n = wb_header(b, PROTO_VERSION, PROTO_HELLO | PROTO_REPLY, 0);
    wb_junk(rp, "a reply as a request", b, n, -EBADMSG);
    n = wb_header(b, PROTO_VERSION, 77, 0);
    wb_junk(rp, "op 77", b, n, -EBADMSG);
    n = wb_header(b, PROTO_VERSION, PROTO_STEP, 0);
    wb_junk(rp, "STEP before HELLO", b, n, -EPROTO);
    /* Root's tensor asked for before any HELLO: no session, no job, no answer but -EPROTO. */
    n = wb_header(b, PROTO_VERSION, PROTO_FETCH, 12);
    memcpy(b + n, &theirs, 8);
    uint32_t host = ZINF_TIER_HOST;
    memcpy(b + n + 8, &host, 4);
    wb_junk(rp, "FETCH of root's tensor before HELLO", b, n + 12, -EPROTO);
    n = wb_header(b, PROTO_VERSION, PROTO_READ, 20);
    memcpy(b + n, &theirs, 8);
    memset(b + n + 8, 0, 8);
    uint32_t sixteen = 16;
    memcpy(b + n + 16, &sixteen, 4);
    wb_junk(rp, "READ of root's tensor before HELLO", b, n + 20, -EPROTO);
    n = wb_header(b, PROTO_VERSION, PROTO_HELLO, 3);
    memcpy(b + n, "\x05\0\0", 3);
    wb_junk(rp, "a truncated HELLO", b, n + 3, -EBADMSG);
    /* HELLO to root's job with junk after its fields. */
    uint32_t len = (uint32_t)strlen(WB_JOB);
    n = wb_header(b, PROTO_VERSION, PROTO_HELLO, 4 + len + 16 + 4);
    memcpy(b + n, &len, 4);
    memcpy(b + n + 4, WB_JOB, len);
    memset(b + n + 4 + len, 0, 16 + 4);
    wb_junk(rp, "HELLO to root's job with junk after it", b, n + 4 + len + 20, -EBADMSG);
    n = wb_header(b, PROTO_VERSION, PROTO_HELLO, 10);
    wb_junk(rp, "a header cut short", b, 7, 1);
}

/* Requests in a session of the second user's own job that name root's tensors, or are
 * wrong: each answered with an error, the connection kept, until a second HELLO ends it. */
static void wb_bad_requests(struct wb_report *rp, zinf_tensor theirs, zinf_tensor mine)
{
    int fd = wb_connect();
    if (fd < 0) {
        wb_say(rp, "own session: connect: %s", zinf_strerror(fd));
        return;
    }
    struct proto_request q = {.op = PROTO_HELLO};
    snprintf(q.name, sizeof(q.name), "%s", WB_OTHER);
    int r = wb_call(fd, &q);
    if (r != 0) {
        wb_say(rp, "HELLO to its own job: %s", zinf_strerror(r));
        close(fd);
        return;
    }
    zinf_tensor both[2] = {theirs, theirs};
    const struct {
        const char *what;
        struct proto_request q;
    } bad[] = {
        {"FETCH, tier 9", {.op = PROTO_FETCH, .handle = theirs, .tier = 9}},
        {"FETCH", {.op = PROTO_FETCH, .handle = theirs, .tier = ZINF_TIER_HOST}},
        {"FETCH_ASYNC", {.op = PROTO_FETCH_ASYNC, .handle = theirs, .tier = ZINF_TIER_HOST}},
        {"PREFETCH", {.op = PROTO_PREFETCH, .handle = theirs, .tier = ZINF_TIER_HOST}},
        {"FETCH_ALL",
         {.op = PROTO_FETCH_ALL, .tier = ZINF_TIER_HOST, .n = 2, .data = (const uint8_t *)both}},
        {"WAIT of a ticket not its own", {.op = PROTO_WAIT, .handle = 1}},
        {"RELEASE DIRTY unpinned",
         {.op = PROTO_RELEASE,
          .handle = theirs,
          .tier = ZINF_TIER_HOST,
          .flags = ZINF_RELEASE_DIRTY}},
        {"RELEASE with flags 0x80",
         {.op = PROTO_RELEASE, .handle = mine, .tier = ZINF_TIER_HOST, .flags = 0x80}},
        {"READ", {.op = PROTO_READ, .handle = theirs, .n = 16}},
        {"WRITE", {.op = PROTO_WRITE, .handle = theirs, .n = 4, .data = (const uint8_t *)"evil"}},
        {"TENSOR_INFO", {.op = PROTO_TENSOR_INFO, .handle = theirs}},
        {"ZERO", {.op = PROTO_ZERO, .handle = theirs}},
        {"UNREGISTER", {.op = PROTO_UNREGISTER, .handle = theirs}},
        {"STAGE_READ of 1 TiB", {.op = PROTO_STAGE_READ, .handle = theirs, .bytes = 1ull << 40}},
        {"STAGE_READ", {.op = PROTO_STAGE_READ, .handle = theirs, .bytes = 4096}},
        {"STAGE_GET of a stage not its own", {.op = PROTO_STAGE_GET, .handle = 1, .n = 16}},
        {"STAGE_END of a stage not its own", {.op = PROTO_STAGE_END, .handle = 1}},
        {"LOOKUP of root's w9", {.op = PROTO_LOOKUP, .name = "w9"}},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        r = wb_call(fd, &bad[i].q);
        if (r >= 0 || r == -ECONNRESET || r == -EAGAIN)
            wb_say(rp, "own session, %s of handle %#llx: %d", bad[i].what,
                   (unsigned long long)theirs, r);
        if (r == -ECONNRESET || r == -EAGAIN) break; /* closed, or no answer */
    }
    r = wb_call(fd, &q);
    if (r != -EBADMSG) wb_say(rp, "a second HELLO: %d, not -EBADMSG", r);
    if (!wb_closed(fd)) wb_say(rp, "a second HELLO left the connection open");
    close(fd);
}

/* One round of everything the second user tries. mine[] are its own tensors' handles. */
static void wb_round(const struct wb_shared *sh, zinf_engine *e, const zinf_tensor *mine,
                     struct wb_report *rp)
{
    zinf_engine *x;
    int r;
    /* Root's job by its name, and by names that would lead to its folder. */
    r = zinf_connect(sock, WB_JOB, &x);
    if (r != -EACCES) wb_say(rp, "attach to root's job: %d, not -EACCES", r);
    if (r == 0) zinf_close(x);
    static const char *const tricks[] = {"../" WB_JOB, WB_JOB "/", "./" WB_JOB, ".", ".."};
    for (size_t i = 0; i < sizeof(tricks) / sizeof(tricks[0]); i++) {
        r = zinf_connect(sock, tricks[i], &x);
        if (r != -EINVAL) wb_say(rp, "attach to job '%s': %d, not -EINVAL", tricks[i], r);
        if (r == 0) zinf_close(x);
    }
    /* Root's session, by guessed ids and secrets (and its own job's, by a wrong secret). */
    for (uint64_t sid = 1; sid <= 6; sid++) {
        for (int k = 0; k < 2; k++) {
            int fd = wb_connect();
            if (fd < 0) {
                wb_say(rp, "connect: %s", zinf_strerror(fd));
                continue;
            }
            struct proto_request q = {
                .op = PROTO_HELLO, .handle = sid, .offset = sid * 0x9e3779b97f4a7c15ull};
            snprintf(q.name, sizeof(q.name), "%s", k ? WB_OTHER : WB_JOB);
            r = wb_call(fd, &q);
            if (r != -ECONNRESET)
                wb_say(rp, "join session %llu of %s: %d, not -ECONNRESET", (unsigned long long)sid,
                       q.name, r);
            close(fd);
        }
    }
    /* Root's job closed, removed, the daemon stopped. */
    if ((r = service_manage(sock, PROTO_JOB_CLOSE, WB_JOB)) != -EACCES)
        wb_say(rp, "JOB_CLOSE of root's job: %d, not -EACCES", r);
    if ((r = service_manage(sock, PROTO_JOB_REMOVE, WB_JOB)) != -EACCES)
        wb_say(rp, "JOB_REMOVE of root's job: %d, not -EACCES", r);
    if ((r = service_manage(sock, PROTO_SHUTDOWN, NULL)) != -EPERM)
        wb_say(rp, "SHUTDOWN: %d, not -EPERM", r);
    /* STATUS shows its own job only, nothing of root's (not even the name). */
    struct service_job_status *js = NULL;
    size_t nj = 0;
    if ((r = service_status(sock, &js, &nj)) != 0) wb_say(rp, "STATUS: %s", zinf_strerror(r));
    for (size_t i = 0; i < nj; i++)
        if (strcmp(js[i].name, WB_OTHER) || js[i].owner_uid != WB_NOBODY)
            wb_say(rp, "STATUS shows job %s of uid %u", js[i].name, js[i].owner_uid);
    free(js);
    /* Root's handles and names in its own job: its own tensors where they coincide (handles
     * are per job), else unknown. Never a byte of root's. */
    unsigned char buf[WB_MINE_BYTES];
    for (int i = 0; i < WB_TENSORS; i++) {
        zinf_tensor h = sh->owner[i];
        int own = -1;
        for (int k = 0; k < WB_MINE; k++)
            if (mine[k] == h) own = k;
        char name[16];
        snprintf(name, sizeof(name), "w%d", i);
        zinf_tensor found = 0;
        r = zinf_lookup(e, name, &found);
        if (i < WB_MINE ? (r != 0 || found != mine[i]) : r != -ENOENT)
            wb_say(rp, "lookup of %s in its own job: %d (handle %#llx)", name, r,
                   (unsigned long long)found);
        if (own >= 0) {
            memset(buf, 0, sizeof(buf));
            r = zinf_read(e, h, 0, buf, sizeof(buf));
            size_t k = 0;
            while (r == 0 && k < sizeof(buf) && buf[k] == WB_MINE_BYTE)
                k++;
            if (r != 0 || k != sizeof(buf))
                wb_say(rp, "read of handle %#llx (its own w%d): %d, byte %zu is %#x",
                       (unsigned long long)h, own, r, k, k < sizeof(buf) ? buf[k] : 0);
            continue;
        }
        struct zinf_tensor_info ti = {.bytes = 12345};
        void *p = NULL;
        uint64_t ticket = 0;
        if (!wb_err_unknown(r = zinf_tensor_info(e, h, &ti)))
            wb_say(rp, "tensor_info of root's %s: %d (bytes %llu)", name, r,
                   (unsigned long long)ti.bytes);
        if (!wb_err_unknown(r = zinf_read(e, h, 0, buf, 64)))
            wb_say(rp, "read of root's %s: %d", name, r);
        if (!wb_err_unknown(r = zinf_write(e, h, 0, "evil", 4)))
            wb_say(rp, "write of root's %s: %d", name, r);
        if (!wb_err_unknown(r = zinf_fetch(e, h, ZINF_TIER_HOST, &p)))
            wb_say(rp, "fetch of root's %s: %d (%p)", name, r, p);
        if (r == 0) zinf_release(e, h, ZINF_TIER_HOST, 0);
        if (!wb_err_unknown(r = zinf_fetch_async(e, h, ZINF_TIER_DEVICE, &ticket)))
            wb_say(rp, "fetch_async of root's %s: %d", name, r);
        if (r == 0 && zinf_wait(e, ticket, &p) == 0) zinf_release(e, h, ZINF_TIER_DEVICE, 0);
        if (!wb_err_unknown(r = zinf_prefetch(e, h, ZINF_TIER_HOST)))
            wb_say(rp, "prefetch of root's %s: %d", name, r);
        if (!wb_err_unknown(r = zinf_release(e, h, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY)))
            wb_say(rp, "dirty release of root's %s: %d", name, r);
        if (!wb_err_unknown(r = zinf_unregister(e, h)))
            wb_say(rp, "unregister of root's %s: %d", name, r);
    }
    /* Its own tensor through the pin table's fast path: its own bytes. */
    void *p;
    if ((r = zinf_fetch(e, mine[0], ZINF_TIER_HOST, &p)) != 0) {
        wb_say(rp, "fetch of its own w0: %s", zinf_strerror(r));
    } else {
        for (size_t k = 0; k < WB_MINE_BYTES; k++)
            if (((unsigned char *)p)[k] != WB_MINE_BYTE) {
                wb_say(rp, "its own w0 at byte %zu: %#x", k, ((unsigned char *)p)[k]);
                break;
            }
        zinf_release(e, mine[0], ZINF_TIER_HOST, 0);
    }
    /* Root's last handle: never one of its own, which are fewer. */
    zinf_tensor theirs = sh->owner[WB_TENSORS - 1];
    wb_malformed(rp, theirs);
    wb_bad_requests(rp, theirs, mine[0]);
}

/* The child: uid and gid 65534, no other groups, every inherited fd but out closed. */
static void wb_second_user(struct wb_shared *sh, int out) __attribute__((noreturn));
static void wb_second_user(struct wb_shared *sh, int out)
{
    for (int fd = 3; fd < 4096; fd++)
        if (fd != out) close(fd);
    if (setgroups(0, NULL) != 0 || setresgid(WB_NOBODY, WB_NOBODY, WB_NOBODY) != 0 ||
        setresuid(WB_NOBODY, WB_NOBODY, WB_NOBODY) != 0)
        _exit(90);
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* after the uid change, which clears it */
    log_set_sink(wb_quiet, NULL, NULL);
    struct wb_report rp = {out, 0};
    uint64_t deadline = now_ns() + 40ull * 1000000000ull;
    while (!atomic_load(&sh->go) && now_ns() < deadline)
        usleep(1000);
    /* Half-sent messages, held open while root steps: a header cut short, and a HELLO to
     * root's job that never finishes. Each holds a thread of the daemon, not the daemon. */
    int slow[4];
    for (int i = 0; i < 4; i++) {
        slow[i] = wb_connect();
        uint8_t b[PROTO_HEADER_BYTES + 16];
        size_t n = wb_header(b, PROTO_VERSION, PROTO_HELLO, 100);
        memcpy(b + n, "\x08\0\0\0wb-ow", 9);
        if (slow[i] < 0)
            wb_say(&rp, "half a message: connect: %s", zinf_strerror(slow[i]));
        else if (send(slow[i], b, i < 2 ? 8 : n + 9, MSG_NOSIGNAL) < 0)
            wb_say(&rp, "half a message: send: %s", strerror(errno));
    }
    zinf_engine *e = NULL;
    zinf_tensor mine[WB_MINE];
    int r = zinf_connect(sock, WB_OTHER, &e);
    if (r != 0) {
        wb_say(&rp, "attach to a job of its own: %s", zinf_strerror(r));
        atomic_store(&sh->ready, -1);
        _exit(1);
    }
    unsigned char *fill = malloc(WB_MINE_BYTES);
    memset(fill, WB_MINE_BYTE, WB_MINE_BYTES);
    for (int k = 0; k < WB_MINE; k++) {
        char name[16];
        snprintf(name, sizeof(name), "w%d", k);
        if ((r = zinf_register(e, name, WB_MINE_BYTES, ZINF_TIER_HOST, &mine[k])) != 0 ||
            (r = zinf_write(e, mine[k], 0, fill, WB_MINE_BYTES)) != 0) {
            wb_say(&rp, "its own %s: %s", name, zinf_strerror(r));
            atomic_store(&sh->ready, -1);
            _exit(1);
        }
    }
    free(fill);
    atomic_store(&sh->ready, 1);
    while (!atomic_load(&sh->stop) && now_ns() < deadline) {
        wb_round(sh, e, mine, &rp);
        atomic_fetch_add(&sh->rounds, 1);
    }
    for (int i = 0; i < 4; i++)
        if (slow[i] >= 0) close(slow[i]);
    zinf_close(e);
    _exit(rp.failures ? 1 : 0);
}

/* The child's report once it exits: fails the test with it if the child failed, or did not
 * exit within 15 s (it is killed then). */
static void wb_collect(pid_t pid, int in)
{
    char text[8192];
    size_t got = 0;
    uint64_t deadline = now_ns() + 15ull * 1000000000ull;
    for (;;) {
        struct pollfd p = {in, POLLIN, 0};
        int n = poll(&p, 1, 100);
        if (n > 0) {
            ssize_t r = read(in, text + got, sizeof(text) - 1 - got);
            if (r <= 0) break; /* the child has gone */
            got += (size_t)r;
            if (got == sizeof(text) - 1) break;
        }
        if (now_ns() > deadline) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            text[got] = 0;
            cr_assert_fail("the second user did not finish in 15 s:\n%s", text);
        }
    }
    text[got] = 0;
    close(in);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the second user (status %#x):\n%s", st, text);
}

static void wb_config(void)
{
    FILE *f = fopen(cfg_path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s/swap\"}},"
            " \"aio\": {\"block_size\": 65536, \"queue_depth\": 8},"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"2M\", "
            "\"host_bytes\": \"2M\"}}",
            dir);
    fclose(f);
}

/* One fetch of t to the host tier, checked against want, a random range of it rewritten
 * (want follows), released DIRTY. Half the tensors are fetched with zinf_fetch, which pins
 * through a lease in the session's pin table (the release closes the idle lease before a
 * write-behind starts: the client could pin it with atomics alone), half with
 * zinf_fetch_async and zinf_wait, whose pin is an ordinary one. */
static void wb_use(zinf_engine *e, zinf_tensor t, unsigned char *want, int i, int step,
                   uint64_t *rs)
{
    void *p;
    int r;
    if (i % 2) {
        r = zinf_fetch(e, t, ZINF_TIER_HOST, &p);
    } else {
        uint64_t ticket;
        r = zinf_fetch_async(e, t, ZINF_TIER_HOST, &ticket);
        if (r == 0) r = zinf_wait(e, ticket, &p);
    }
    cr_assert_eq(r, 0, "step %d, w%d: %s", step, i, zinf_strerror(r));
    size_t k = 0;
    while (k < WB_BYTES && ((unsigned char *)p)[k] == want[k])
        k++;
    cr_assert_eq(k, WB_BYTES, "step %d, w%d: byte %zu is %#x, not %#x", step, i, k,
                 ((unsigned char *)p)[k], want[k]);
    size_t off = test_rand(rs) % WB_BYTES, len = 1 + test_rand(rs) % (WB_BYTES - off);
    test_fill_random((char *)p + off, len, test_rand(rs));
    memcpy(want + off, (char *)p + off, len);
    cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
}

Test(service, write_behind_under_a_second_user, .timeout = 60)
{
    struct group *g = getgrgid(WB_NOBODY);
    if (geteuid() != 0 || !g)
        cr_skip_test("needs root (and group %d) to act as a second user", WB_NOBODY);
    char group[64];
    snprintf(group, sizeof(group), "%s", g->gr_name);
    /* The socket in a folder uid 65534 can reach (the test's folder may lie under one it
     * cannot), and the daemon's --group its group: the daemon is what refuses it. */
    strcpy(wb_sockdir, "/tmp/zinf-wb-XXXXXX");
    cr_assert_not_null(mkdtemp(wb_sockdir));
    cr_assert_eq(chmod(wb_sockdir, 0711), 0);
    snprintf(sock, sizeof(sock), "%s/zinf.sock", wb_sockdir);
    wb_config();

    /* The child is forked before the daemon starts: it holds none of the daemon's threads'
     * locks, none of its fds and no mapping of root's memory. */
    struct wb_shared *sh =
        mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(sh, MAP_FAILED);
    int pfd[2];
    cr_assert_eq(pipe(pfd), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) wb_second_user(sh, pfd[1]); /* never returns */
    close(pfd[1]);

    struct daemon d;
    daemon_start_group(&d, group);
    zinf_engine *e = connect_job(WB_JOB);
    zinf_tensor t[WB_TENSORS];
    unsigned char *want[WB_TENSORS];
    for (int i = 0; i < WB_TENSORS; i++) {
        char name[16];
        snprintf(name, sizeof(name), "w%d", i);
        t[i] = test_register(e, name, WB_BYTES, ZINF_TIER_NVME);
        want[i] = test_rand_buf(WB_BYTES, 500 + i);
        cr_assert_eq(zinf_write(e, t[i], 0, want[i], WB_BYTES), 0);
        sh->owner[i] = t[i];
    }
    atomic_store(&sh->go, 1);
    uint64_t t0 = now_ns();
    while (!atomic_load(&sh->ready) && now_ns() - t0 < 10ull * 1000000000ull)
        usleep(1000);
    if (atomic_load(&sh->ready) != 1) {
        atomic_store(&sh->stop, 1);
        wb_collect(pid, pfd[0]);
        cr_assert_fail("the second user never attached to a job of its own");
    }

    /* The learned steps, for as long as it takes the second user to go through all it tries
     * twice (at most 10 s). */
    uint64_t rs = 99;
    cr_assert_eq(zinf_step(e), 0);
    unsigned rounds0 = atomic_load(&sh->rounds);
    int steps = 0;
    t0 = now_ns();
    while (steps < WB_STEPS ||
           (atomic_load(&sh->rounds) < rounds0 + 2 && now_ns() - t0 < 10ull * 1000000000ull)) {
        for (int i = 0; i < WB_TENSORS; i++)
            wb_use(e, t[i], want[i], i, steps, &rs);
        cr_assert_eq(zinf_step(e), 0);
        steps++;
    }
    unsigned rounds = atomic_load(&sh->rounds) - rounds0;
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.schedule_resets, 0, "the steps did not replay alike");
    cr_assert_gt(st.write_behinds, 0, "%d learned steps and nothing was written behind", steps);
    cr_assert_leq(st.write_behinds, st.tier[ZINF_TIER_HOST].writebacks);

    /* Right behind a DIRTY release, its write-behind likely in flight: a write, a fetch and
     * a read of that tensor (each waits for the write-behind, or for nothing). */
    wb_use(e, t[0], want[0], 0, steps, &rs);
    cr_assert_eq(zinf_write(e, t[0], 100, "again", 5), 0);
    memcpy(want[0] + 100, "again", 5);
    wb_use(e, t[1], want[1], 1, steps, &rs);
    wb_use(e, t[1], want[1], 1, steps, &rs);
    wb_use(e, t[2], want[2], 2, steps, &rs);
    test_expect_content(e, t[2], want[2], WB_BYTES, "read right after its write-behind began");

    atomic_store(&sh->stop, 1);
    wb_collect(pid, pfd[0]);
    cr_assert_geq(rounds, 2, "the second user went through %u rounds during %d steps", rounds,
                  steps);

    /* The daemon still answers root, on this session and on a new one, and still knows its
     * job and the second user's apart. */
    cr_assert_eq(zinf_stats(e, &st), 0);
    zinf_engine *e2 = connect_job(WB_JOB);
    zinf_tensor h;
    cr_assert_eq(zinf_lookup(e2, "w5", &h), 0);
    cr_assert_eq(h, t[5]);
    struct service_job_status *js;
    size_t nj;
    cr_assert_eq(service_status(sock, &js, &nj), 0);
    int seen = 0;
    for (size_t i = 0; i < nj; i++) {
        if (!strcmp(js[i].name, WB_JOB)) {
            seen |= 1;
            cr_assert_eq(js[i].owner_uid, 0);
            cr_assert_eq(js[i].sessions, 2);
        } else if (!strcmp(js[i].name, WB_OTHER)) {
            seen |= 2;
            cr_assert_eq(js[i].owner_uid, WB_NOBODY);
        }
    }
    free(js);
    cr_assert_eq(seen, 3, "STATUS as root lists both jobs");
    zinf_close(e2);

    /* Every byte root wrote: from the daemon's memory, then from the drive after a restart
     * (the stop flushes; the write-behinds' bytes are what it finds there). */
    for (int i = 0; i < WB_TENSORS; i++)
        test_expect_content(e, t[i], want[i], WB_BYTES, "after the write-behinds");
    zinf_close(e);
    daemon_stop(&d);
    daemon_start_group(&d, group);
    e = connect_job(WB_JOB);
    for (int i = 0; i < WB_TENSORS; i++) {
        char name[16];
        snprintf(name, sizeof(name), "w%d", i);
        cr_assert_eq(zinf_lookup(e, name, &h), 0, "%s", name);
        test_expect_content(e, h, want[i], WB_BYTES, "after the restart");
        free(want[i]);
    }
    zinf_close(e);
    daemon_stop(&d);
    munmap(sh, sizeof(*sh));
    cr_log_info("write_behind_under_a_second_user: %d steps, %llu write-behinds, %u rounds of "
                "the second user",
                steps, (unsigned long long)st.write_behinds, rounds);
}
