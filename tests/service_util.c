/*
 * service_util.c - the daemon's tests' shared parts (service_util.h).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "service_util.h"

char *dir;
char sock[512], cfg_path[512];

void service_util_setup(const char *tag)
{
    dir = test_tmpdir(tag);
    cr_assert_not_null(dir);
    snprintf(sock, sizeof(sock), "%s/zinf.sock", dir);
    snprintf(cfg_path, sizeof(cfg_path), "%s/zinf.json", dir);
    write_cfg(false);
}

void service_util_teardown(void)
{
    test_rmtree(dir);
    dir = NULL;
}

static void *run_service(void *arg)
{
    struct daemon *d = arg;
    cr_assert_eq(service_run(d->s), 0);
    return NULL;
}

void write_cfg(bool swap)
{
    FILE *f = fopen(cfg_path, "w");
    cr_assert_not_null(f);
    if (swap)
        fprintf(f,
                "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", "
                "\"nvme_path\": \"%s/swap\"}},"
                " \"aio\": {\"block_size\": 65536, \"queue_depth\": 8},"
                " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"4M\", "
                "\"host_bytes\": \"4M\"}}",
                dir);
    else
        fprintf(f, "{\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"4M\", "
                   "\"host_bytes\": \"4M\"}}");
    fclose(f);
}

void daemon_start(struct daemon *d)
{
    daemon_start_group(d, NULL);
}

void daemon_start_group(struct daemon *d, const char *group)
{
    char err[512];
    memset(d, 0, sizeof(*d));
    cr_assert_eq(config_parse_file(cfg_path, &d->cfg, err, sizeof(err)), 0, "%s", err);
    struct service_opts o = {.socket_path = sock, .config = &d->cfg, .group = group};
    int r = service_open(&o, &d->s, err, sizeof(err));
    cr_assert_eq(r, 0, "%s", err);
    cr_assert_eq(pthread_create(&d->thread, NULL, run_service, d), 0);
}

void daemon_stop(struct daemon *d)
{
    service_stop(d->s);
    pthread_join(d->thread, NULL);
    service_close(d->s);
    config_free(&d->cfg);
}

zinf_engine *connect_job(const char *job)
{
    zinf_engine *e = NULL;
    int r = zinf_connect(sock, job, &e);
    cr_assert_eq(r, 0, "zinf_connect: %s", zinf_strerror(r));
    return e;
}

void wait_pins_dropped(zinf_engine *e)
{
    for (int i = 0; i < 300; i++) {
        struct zinf_stats st;
        cr_assert_eq(zinf_stats(e, &st), 0);
        if (!st.tier[ZINF_TIER_HOST].pinned_bytes && !st.tier[ZINF_TIER_DEVICE].pinned_bytes)
            return;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    cr_assert_fail("the dead client's pins were not dropped");
}

static struct service *forked; /* in fork_daemon's child: SIGTERM stops it as zinf serve */

static void forked_stop(int sig)
{
    (void)sig;
    service_stop(forked); /* a write to its wake pipe: safe in a handler */
}

pid_t fork_daemon(const char *job, zinf_engine **e)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        struct zinf_config cfg;
        struct service *s;
        char err[512];
        struct service_opts o = {.socket_path = sock, .config = &cfg};
        if (config_parse_file(cfg_path, &cfg, err, sizeof(err)) ||
            service_open(&o, &s, err, sizeof(err)))
            _exit(1);
        forked = s;
        struct sigaction sa = {.sa_handler = forked_stop};
        sigemptyset(&sa.sa_mask);
        sigaction(SIGTERM, &sa, NULL);
        int r = service_run(s);
        service_close(s);
        _exit(r == 0 ? 0 : 1);
    }
    int r = -ENOENT;
    for (int i = 0; i < 1000 && r < 0; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
        r = zinf_connect(sock, job, e);
    }
    cr_assert_eq(r, 0, "the daemon did not come up: %s", zinf_strerror(r));
    return pid;
}

int raw_connect(void)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strcpy(a.sun_path, sock);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    return fd;
}
