/*
 * raw_call.h - one request of the daemon's protocol sent by hand and its reply read, for
 * the tests that act as a client that does not play by the rules (test_serve_guard.c,
 * soak_serve.c). Plain C: no test framework.
 */
#ifndef ZINF_TESTS_RAW_CALL_H
#define ZINF_TESTS_RAW_CALL_H

#include <stddef.h>
#include <stdint.h>

#include "service/proto.h"

/* Sends q on fd and reads its reply: the reply's result (or -errno of the exchange), its
 * payload in *payload (the caller frees it; NULL: dropped) and its length in *len, and the
 * fds that came with it in fds (*nfds: room in, count out; NULL: none taken). */
int raw_call(int fd, const struct proto_request *q, uint8_t **payload, size_t *len, int *fds,
             int *nfds);

#endif
