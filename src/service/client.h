/*
 * client.h - the zinf.h calls on a handle zinf_connect() returned: each is one request to
 * the daemon on a connection of the client's pool (one per thread that is in a call at
 * the same time), answered as the embedded engine answers it. Fetched pointers point into
 * the daemon's arenas, which the client mapped once at zinf_connect.
 *
 * Not here: the wire format (proto.h), routing a zinf_engine * here (api.c).
 */
#ifndef ZINF_SERVICE_CLIENT_H
#define ZINF_SERVICE_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "zinf.h"

struct client;

void client_close(struct client *c);
/* The connection ends without the flush client_close makes. */
void client_close_unflushed(struct client *c);
int client_register(struct client *c, const char *name, size_t nbytes, enum zinf_tier home,
                    zinf_tensor *out);
int client_lookup(struct client *c, const char *name, zinf_tensor *out);
int client_unregister(struct client *c, zinf_tensor t);
int client_zero(struct client *c, zinf_tensor t);
int client_tensor_info(struct client *c, zinf_tensor t, struct zinf_tensor_info *out);
int client_fetch(struct client *c, zinf_tensor t, enum zinf_tier tier, void **ptr);
int client_fetch_async(struct client *c, zinf_tensor t, enum zinf_tier tier, uint64_t *ticket);
int client_wait(struct client *c, uint64_t ticket, void **ptr);
int client_fetch_all(struct client *c, const zinf_tensor *ts, size_t n, enum zinf_tier tier,
                     void **ptrs);
int client_release(struct client *c, zinf_tensor t, enum zinf_tier tier, unsigned flags);
int client_prefetch(struct client *c, zinf_tensor t, enum zinf_tier tier);
int client_step(struct client *c);
int client_write(struct client *c, zinf_tensor t, size_t off, const void *src, size_t n);
int client_read(struct client *c, zinf_tensor t, size_t off, void *dst, size_t n);
int client_flush(struct client *c);
int client_stats(struct client *c, struct zinf_stats *out);

/* What `zinf stat --socket` shows of one job of a daemon. */
struct service_job_status {
    char name[64 + 1];
    uint32_t owner_uid, sessions;
    bool open; /* false: saved on disk, not opened since the daemon started (stats: tensors) */
    uint64_t pins;
    struct zinf_stats stats;
};
/* A connection to the daemon on path (client.c; manage.c's too): 0 and *out, or -errno. */
int service_dial(const char *path, int *out);
/* Asks the daemon on socket for the jobs the caller may see: 0 and *out (n of them, freed
 * with free()), or -errno (-ENOENT, -ECONNREFUSED: nobody listens). */
int service_status(const char *socket, struct service_job_status **out, size_t *n);
/* Asks the daemon on socket to close job (op PROTO_JOB_CLOSE), to close it and remove all it
 * saved (PROTO_JOB_REMOVE), or to stop (PROTO_SHUTDOWN, job NULL): the daemon's answer
 * (proto.h), or -errno of the exchange. */
int service_manage(const char *socket, int op, const char *job);
/* The same with the request's u32 flags: JOB_SHARE's (1 share, 0 take back). */
int service_manage_flags(const char *socket, int op, const char *job, uint32_t flags);
/* Asks the daemon on socket to stop (root or its uid) and returns once it has: every job
 * flushed and closed, the socket gone, the process exited. 0, or -errno (-EPERM: the caller
 * may not stop it). */
int service_shutdown(const char *socket);

#endif
