/*
 * test_notify.c - tools/notify.c, the service manager's readiness messages: each message
 * reaches a datagram socket named by a path or an abstract address, a missing or bad
 * $NOTIFY_SOCKET sends nothing and harms nothing, and `zinf serve --foreground` says
 * READY=1 once its socket answers and STOPPING=1 when SIGTERM comes, as systemd's
 * Type=notify expects. The test plays systemd's part with a socket of its own.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "notify.h"

/* A datagram socket bound to addr (a path, or '@' then an abstract name). */
static int listen_at(const char *addr)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t len = strlen(addr);
    cr_assert_lt(len, sizeof(sa.sun_path), "%s is too long for a test socket", addr);
    memcpy(sa.sun_path, addr, len);
    if (addr[0] == '@') sa.sun_path[0] = '\0';
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(fd, 0);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa,
                      (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + (addr[0] == '/'))),
                 0, "bind %s: %s", addr, strerror(errno));
    return fd;
}

/* The next message on fd, as a string, waiting at most timeout_ms; "" on a timeout. */
static void next_message(int fd, char *buf, size_t n, int timeout_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    buf[0] = '\0';
    if (poll(&p, 1, timeout_ms) != 1) return;
    ssize_t got = recv(fd, buf, n - 1, 0);
    cr_assert_geq(got, 0, "recv: %s", strerror(errno));
    buf[got] = '\0';
}

Test(notify, ready_and_stopping_reach_a_socket_named_by_a_path)
{
    char *dir = test_tmpdir("notify");
    char addr[4200], msg[256];
    snprintf(addr, sizeof(addr), "%s/notify", dir);
    int fd = listen_at(addr);
    cr_assert_eq(setenv("NOTIFY_SOCKET", addr, 1), 0);
    notify_ready();
    next_message(fd, msg, sizeof(msg), 5000);
    cr_assert_str_eq(msg, "READY=1");
    notify_stopping();
    next_message(fd, msg, sizeof(msg), 5000);
    cr_assert_str_eq(msg, "STOPPING=1");
    cr_assert_str_eq(getenv("NOTIFY_SOCKET"), addr, "the variable is left as it was");
    unsetenv("NOTIFY_SOCKET");
    close(fd);
    test_rmtree(dir);
}

Test(notify, an_abstract_address_starts_with_an_at_sign)
{
    char addr[64], msg[256];
    snprintf(addr, sizeof(addr), "@zinf-test-notify-%d", (int)getpid());
    int fd = listen_at(addr);
    cr_assert_eq(setenv("NOTIFY_SOCKET", addr, 1), 0);
    cr_assert_eq(notify_send("READY=1"), 0);
    next_message(fd, msg, sizeof(msg), 5000);
    cr_assert_str_eq(msg, "READY=1");
    unsetenv("NOTIFY_SOCKET");
    close(fd);
}

Test(notify, no_or_a_bad_address_sends_nothing_and_harms_nothing)
{
    unsetenv("NOTIFY_SOCKET");
    cr_assert_eq(notify_send("READY=1"), 0, "not under a service manager: nothing to do");
    cr_assert_eq(setenv("NOTIFY_SOCKET", "", 1), 0);
    cr_assert_eq(notify_send("READY=1"), 0);
    cr_assert_eq(setenv("NOTIFY_SOCKET", "relative/notify", 1), 0);
    cr_assert_eq(notify_send("READY=1"), -EINVAL);
    char longest[256];
    memset(longest, 'x', sizeof(longest) - 1);
    longest[0] = '/';
    longest[sizeof(longest) - 1] = '\0';
    cr_assert_eq(setenv("NOTIFY_SOCKET", longest, 1), 0);
    cr_assert_eq(notify_send("READY=1"), -EINVAL, "longer than a Unix socket address");
    char *dir = test_tmpdir("notify");
    char addr[4200];
    snprintf(addr, sizeof(addr), "%s/nobody-listens", dir);
    cr_assert_eq(setenv("NOTIFY_SOCKET", addr, 1), 0);
    cr_assert_eq(notify_send("READY=1"), -ENOENT);
    /* The daemon's calls ignore every one of these. */
    notify_ready();
    notify_stopping();
    unsetenv("NOTIFY_SOCKET");
    test_rmtree(dir);
}

/* A connection to the daemon's socket is accepted (it is listening, whether or not it has
 * come to accept() yet). */
static bool answers(const char *sock)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t len = strlen(sock);
    cr_assert_lt(len, sizeof(sa.sun_path), "%s is too long for a Unix socket", sock);
    memcpy(sa.sun_path, sock, len);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(fd, 0);
    bool ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    close(fd);
    return ok;
}

static void show_file(const char *path)
{
    char buf[4096];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n > 0) {
        buf[n] = '\0';
        cr_log_error("%s:\n%s", path, buf);
    }
}

static pid_t serve_pid;

/* A daemon left by a failed assertion is killed, not left running. */
static void kill_serve(void)
{
    if (serve_pid > 0) {
        kill(serve_pid, SIGKILL);
        waitpid(serve_pid, NULL, 0);
    }
}

Test(notify, serve_says_ready_once_its_socket_answers_and_stopping_on_sigterm, .timeout = 60,
     .fini = kill_serve)
{
    const char *bin = getenv("ZINF_BIN");
    if (!bin) cr_skip_test("ZINF_BIN is not set: run through meson test");
    char *dir = test_tmpdir("notify");
    char addr[4200], cfg[4200], sock[4200], out[4200], text[8600], msg[256];
    snprintf(addr, sizeof(addr), "%s/notify", dir);
    snprintf(cfg, sizeof(cfg), "%s/serve.json", dir);
    snprintf(sock, sizeof(sock), "%s/zinf.sock", dir);
    snprintf(out, sizeof(out), "%s/serve.out", dir);
    snprintf(text, sizeof(text),
             "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
             "\"%s/swap\"}}, \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"4M\", "
             "\"host_bytes\": \"4M\"}}",
             dir);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    int fd = listen_at(addr);

    fflush(NULL);
    pid_t pid = serve_pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int o = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (o >= 0) {
            dup2(o, STDOUT_FILENO);
            dup2(o, STDERR_FILENO);
        }
        setenv("NOTIFY_SOCKET", addr, 1);
        execl(bin, "zinf", "serve", "--socket", sock, "--config", cfg, "--foreground",
              (char *)NULL);
        _exit(127);
    }
    next_message(fd, msg, sizeof(msg), 30000);
    if (strcmp(msg, "READY=1")) show_file(out);
    cr_assert_str_eq(msg, "READY=1", "no READY=1 from zinf serve within 30 s");
    cr_assert(answers(sock), "READY=1 came before %s answered", sock);

    kill(pid, SIGTERM);
    next_message(fd, msg, sizeof(msg), 30000);
    if (strcmp(msg, "STOPPING=1")) show_file(out);
    cr_assert_str_eq(msg, "STOPPING=1", "no STOPPING=1 after SIGTERM");
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    serve_pid = 0;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) show_file(out);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "serve exited %#x", st);
    next_message(fd, msg, sizeof(msg), 0);
    cr_assert_str_eq(msg, "", "a message after STOPPING=1: %s", msg);
    close(fd);
    test_rmtree(dir);
}
