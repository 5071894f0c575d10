/*
 * server.h - the zinf daemon: one process per node that owns the engines of every job and
 * answers the zinf.h calls of its clients (client.c) over a Unix socket (proto.h).
 *
 * A job is a named set of tensors with its own engine: the daemon's config gives its
 * budgets, and its swap files live in a folder of the job's name under each swap
 * directory, so a job's tensors are invisible to other jobs and come back, flushed, when
 * the daemon restarts. A job belongs to the uid whose client created it (its folder's
 * owner file names it: the folders are the daemon's alone, service/folders.h); other uids
 * are refused with -EACCES (root is not). A job with no client for zinf.serve's
 * idle_job_close is closed (flushed, its memory given back) and opens again on the next
 * attach; zinf.serve's limits bound each uid's jobs, sessions and connections.
 *
 * A session is one client process: its connections share its pins, and when the last of
 * them closes (the process exited or was killed) every pin it still held is dropped and
 * every fetch it started and never waited for is waited for and dropped; what it may have
 * written without a DIRTY release is undone (engine_release_abandoned).
 *
 * The arenas of each job's host and (emulated) device tiers are memfds, handed to a
 * session's first connection and mapped by the client, so fetched pointers are shared
 * memory; a device arena on a GPU is opened by each client through its CUDA IPC handle,
 * sent with the session's first HELLO. Each session also gets a pin table (src/pintable.h): once a fetch
 * through the daemon has opened a copy's slot, the client pins that copy again and
 * releases it clean by itself, without a message, until the engine wants it back.
 *
 * Not here: the wire format (proto.c), the engine, the command line (tools/cmd_serve.c).
 */
#ifndef ZINF_SERVICE_SERVER_H
#define ZINF_SERVICE_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

struct zinf_config;
struct service;

struct service_opts {
    const char *socket_path;          /* where to listen */
    const struct zinf_config *config; /* the jobs' engines: budgets, swap directories */
    const char *group;                /* NULL: the socket is 0600; else 0660 and this group's */
};

/* Binds and listens (a stale socket file is replaced; one a live daemon answers on is
 * -EADDRINUSE), with the soft RLIMIT_NOFILE raised to what zinf.serve's limits need
 * (-EMFILE where the hard limit is lower). 0 and *out, or -errno with a line in err. */
int service_open(const struct service_opts *o, struct service **out, char *err, size_t errlen);
/* Accepts and serves connections until service_stop(); 0, or -errno of the listener. */
int service_run(struct service *s);
/* Makes service_run() return; async-signal-safe (a handler of SIGTERM may call it). */
void service_stop(struct service *s);
/* Closes every connection, drops every session's pins, flushes and closes every job's
 * engine, removes the socket file. */
void service_close(struct service *s);
/* Frees s in a process that handed the service over to another (the parent, after fork):
 * its descriptors are closed here, the socket file stays, nothing else happens. Only
 * before service_run(). */
void service_forget(struct service *s);
/* The requests served so far, HELLO and STATUS not counted (the hit path sends none). */
uint64_t service_requests(struct service *s);

#endif
