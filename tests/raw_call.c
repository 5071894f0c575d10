/*
 * raw_call.c - one request by hand (raw_call.h).
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "raw_call.h"

int raw_call(int fd, const struct proto_request *q, uint8_t **payload, size_t *len, int *fds,
             int *nfds)
{
    static atomic_uint seq;
    /* *nfds is the room in fds going in and the count received coming out: none where the
     * call fails, so that a caller closing what it got closes nothing it did not get. */
    int room = nfds ? *nfds : 0;
    if (nfds) *nfds = 0;
    struct proto_out o;
    proto_encode_request(q, atomic_fetch_add(&seq, 1) + 1, &o);
    int r = proto_send(fd, &o, NULL, 0);
    proto_out_free(&o);
    if (r < 0) return r;
    struct proto_header h;
    uint8_t *p = NULL;
    if (nfds) *nfds = room;
    r = proto_recv(fd, true, &h, &p, fds, nfds);
    if (r < 0) {
        if (nfds) *nfds = 0;
        return r;
    }
    int32_t res = -EPROTO;
    if (h.len >= 4) memcpy(&res, p, 4);
    if (len) *len = h.len;
    if (payload)
        *payload = p;
    else
        free(p);
    return res;
}
