/*
 * fuzz_proto.c - the service protocol's decoder under fuzzing. An input whose first byte
 * is 0xff is a byte stream a client might send: it goes through a socket pair into
 * proto_recv(), message after message, as the daemon reads them. Any other first byte is
 * an op, and the rest that op's payload for proto_decode_request(). Besides crashes and
 * sanitizer reports it aborts when a promise of proto.h is broken: a request that decodes
 * re-encodes to exactly the bytes it came from, its strings are within their limits and
 * NUL-terminated, its counts within theirs, and its data points inside the payload; a
 * message proto_recv() returns has a header proto_header_parse() accepts and a payload of
 * the length it says.
 *
 * Linked into the libFuzzer target fuzz_proto and into fuzz_proto_replay (fuzz_driver.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "service/proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_request(uint16_t op, const uint8_t *p, size_t len)
{
    struct proto_request r;
    if (proto_decode_request(op, p, len, &r) != 0) return;
    size_t max = op == PROTO_HELLO ? PROTO_MAX_JOB : PROTO_MAX_NAME;
    if (strnlen(r.name, sizeof(r.name)) > max) abort();
    if ((op == PROTO_READ || op == PROTO_WRITE) && r.n > PROTO_MAX_DATA) abort();
    if (op == PROTO_FETCH_ALL && (r.n == 0 || r.n > PROTO_MAX_SET)) abort();
    size_t data_bytes = op == PROTO_WRITE ? r.n : op == PROTO_FETCH_ALL ? (size_t)r.n * 8 : 0;
    if (data_bytes && (r.data < p || r.data + data_bytes > p + len)) abort();
    struct proto_out o;
    proto_encode_request(&r, 7, &o);
    if (o.bad || o.len - PROTO_HEADER_BYTES != len ||
        (len && memcmp(o.buf + PROTO_HEADER_BYTES, p, len)))
        abort();
    struct proto_header h;
    if (proto_header_parse(o.buf, false, &h) != 0 || h.op != op || h.seq != 7 || h.len != len)
        abort();
    proto_out_free(&o);
}

static void check_stream(const uint8_t *p, size_t len)
{
    int sv[2];
    if (len > 100000) /* within one socket buffer: the writer never blocks */
        len = 100000;
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return;
    int buf = 1 << 20;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    size_t done = 0;
    while (done < len) {
        ssize_t w = send(sv[0], p + done, len - done, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w <= 0) break;
        done += (size_t)w;
    }
    shutdown(sv[0], SHUT_WR);
    for (;;) {
        struct proto_header h;
        uint8_t *payload;
        int fds[2], nfds = 2;
        if (proto_recv(sv[1], false, &h, &payload, fds, &nfds) != 0) break;
        if (nfds != 0 || (h.len && !payload) || h.len > PROTO_MAX_PAYLOAD || (h.op & PROTO_REPLY))
            abort();
        check_request(h.op, payload, h.len);
        free(payload);
    }
    close(sv[0]);
    close(sv[1]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    if (data[0] == 0xff)
        check_stream(data + 1, size - 1);
    else
        check_request(data[0], data + 1, size - 1);
    return 0;
}
