/*
 * service_util.h - what the daemon's tests share: a daemon in a thread of the test's
 * process or in a child, a config for it, clients that attach, raw connections.
 *
 * Each test's setup fills dir (a fresh folder), sock and cfg_path (in it) with
 * service_util_setup().
 */
#ifndef ZINF_TESTS_SERVICE_UTIL_H
#define ZINF_TESTS_SERVICE_UTIL_H

#include <pthread.h>
#include <stdbool.h>
#include <sys/types.h>

#include "config.h"
#include "service/server.h"
#include "zinf.h"

extern char *dir;
extern char sock[512], cfg_path[512];

struct daemon {
    struct zinf_config cfg;
    struct service *s;
    pthread_t thread;
};

/* A fresh folder (tag names it), the socket and config paths in it, a config without swap. */
void service_util_setup(const char *tag);
void service_util_teardown(void);
/* A config with small emulated tiers and, when swap, an NVMe swap directory dir/swap. */
void write_cfg(bool swap);
/* The daemon of cfg_path on sock, served by a thread of this process; group as --group. */
void daemon_start(struct daemon *d);
void daemon_start_group(struct daemon *d, const char *group);
/* SIGTERM's way: stop, flush every job, close. */
void daemon_stop(struct daemon *d);
/* The daemon in a child process, serving until it is signalled (SIGTERM stops it as it
 * stops zinf serve: every job flushed, exit 0); returns once *e is attached to job. */
pid_t fork_daemon(const char *job, zinf_engine **e);
zinf_engine *connect_job(const char *job);
/* Waits (up to 3 s) for a dead client's pins to be dropped. */
void wait_pins_dropped(zinf_engine *e);
/* A plain connection to sock. */
int raw_connect(void);

#endif
