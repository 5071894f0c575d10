/*
 * proto.c - see proto.h: building and parsing messages, and sending and receiving one
 * whole message over a Unix stream socket, file descriptors included.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "common.h"
#include "service/proto.h"

/* ---- writing ------------------------------------------------------------------------- */

static void put_raw(struct proto_out *o, const void *p, size_t n)
{
    void *dst = proto_put_space(o, n);
    if (dst && n) memcpy(dst, p, n);
}

void proto_out_init(struct proto_out *o, uint16_t op, uint32_t seq)
{
    *o = (struct proto_out){0};
    struct proto_header h = {PROTO_MAGIC, PROTO_VERSION, op, seq, 0};
    o->cap = 256;
    o->buf = malloc(o->cap);
    if (!o->buf) {
        o->bad = true;
        return;
    }
    memcpy(o->buf, &h.magic, 4);
    memcpy(o->buf + 4, &h.version, 2);
    memcpy(o->buf + 6, &h.op, 2);
    memcpy(o->buf + 8, &h.seq, 4);
    memcpy(o->buf + 12, &h.len, 4);
    o->len = PROTO_HEADER_BYTES;
}

void proto_out_free(struct proto_out *o)
{
    free(o->buf);
    *o = (struct proto_out){0};
}

void *proto_put_space(struct proto_out *o, size_t n)
{
    if (o->bad) return NULL;
    if (n > PROTO_MAX_PAYLOAD || o->len - PROTO_HEADER_BYTES + n > PROTO_MAX_PAYLOAD) {
        o->bad = true;
        return NULL;
    }
    if (o->len + n > o->cap) {
        size_t cap = o->cap;
        while (cap < o->len + n)
            cap *= 2;
        uint8_t *b = realloc(o->buf, cap);
        if (!b) {
            o->bad = true;
            return NULL;
        }
        o->buf = b;
        o->cap = cap;
    }
    void *at = o->buf + o->len;
    o->len += n;
    uint32_t plen = (uint32_t)(o->len - PROTO_HEADER_BYTES);
    memcpy(o->buf + 12, &plen, 4);
    return at;
}

void proto_put_u32(struct proto_out *o, uint32_t v)
{
    put_raw(o, &v, 4);
}

void proto_put_i32(struct proto_out *o, int32_t v)
{
    put_raw(o, &v, 4);
}

void proto_put_u64(struct proto_out *o, uint64_t v)
{
    put_raw(o, &v, 8);
}

void proto_put_str(struct proto_out *o, const char *s)
{
    size_t n = s ? strlen(s) : 0;
    if (n > UINT32_MAX) {
        o->bad = true;
        return;
    }
    proto_put_u32(o, (uint32_t)n);
    put_raw(o, s, n);
}

void proto_put_bytes(struct proto_out *o, const void *p, size_t n)
{
    put_raw(o, p, n);
}

/* ---- reading ------------------------------------------------------------------------- */

int proto_header_parse(const uint8_t raw[PROTO_HEADER_BYTES], bool reply, struct proto_header *h)
{
    memcpy(&h->magic, raw, 4);
    memcpy(&h->version, raw + 4, 2);
    memcpy(&h->op, raw + 6, 2);
    memcpy(&h->seq, raw + 8, 4);
    memcpy(&h->len, raw + 12, 4);
    if (h->magic != PROTO_MAGIC) return -EPROTO;
    if (h->version != PROTO_VERSION) return -EPROTONOSUPPORT;
    if (h->len > PROTO_MAX_PAYLOAD) return -EMSGSIZE;
    bool is_reply = h->op & PROTO_REPLY;
    unsigned op = h->op & ~PROTO_REPLY;
    if (is_reply != reply || op < PROTO_HELLO || op > PROTO_OP_MAX) return -EBADMSG;
    return 0;
}

void proto_in_init(struct proto_in *in, const uint8_t *p, size_t len)
{
    *in = (struct proto_in){.p = p, .len = len};
}

static const uint8_t *take(struct proto_in *in, size_t n)
{
    if (in->bad || n > in->len - in->off) {
        in->bad = true;
        return NULL;
    }
    const uint8_t *at = in->p + in->off;
    in->off += n;
    return at;
}

uint32_t proto_get_u32(struct proto_in *in)
{
    uint32_t v = 0;
    const uint8_t *p = take(in, 4);
    if (p) memcpy(&v, p, 4);
    return v;
}

int32_t proto_get_i32(struct proto_in *in)
{
    int32_t v = 0;
    const uint8_t *p = take(in, 4);
    if (p) memcpy(&v, p, 4);
    return v;
}

uint64_t proto_get_u64(struct proto_in *in)
{
    uint64_t v = 0;
    const uint8_t *p = take(in, 8);
    if (p) memcpy(&v, p, 8);
    return v;
}

void proto_get_str(struct proto_in *in, char *buf, size_t max)
{
    buf[0] = 0;
    uint32_t n = proto_get_u32(in);
    if (in->bad) return;
    if (n > max) {
        in->bad = true;
        return;
    }
    const uint8_t *p = take(in, n);
    if (!p) return;
    if (memchr(p, 0, n)) {
        in->bad = true;
        return;
    }
    memcpy(buf, p, n);
    buf[n] = 0;
}

const uint8_t *proto_get_bytes(struct proto_in *in, size_t n)
{
    return take(in, n);
}

int proto_done(const struct proto_in *in)
{
    return in->bad || in->off != in->len ? -EBADMSG : 0;
}

/* ---- requests ------------------------------------------------------------------------ */

int proto_decode_request(uint16_t op, const uint8_t *p, size_t len, struct proto_request *r)
{
    struct proto_in in;
    proto_in_init(&in, p, len);
    memset(r, 0, sizeof(*r));
    r->op = op;
    switch (op) {
    case PROTO_HELLO:
        proto_get_str(&in, r->name, PROTO_MAX_JOB);
        r->handle = proto_get_u64(&in);
        r->offset = proto_get_u64(&in);
        /* The flags are sent only when there are some: one encoding per request. */
        if (in.off < in.len) {
            r->flags = proto_get_u32(&in);
            if (!in.bad && (!r->flags || (r->flags & ~PROTO_HELLO_READONLY))) in.bad = true;
        }
        break;
    case PROTO_REGISTER:
        proto_get_str(&in, r->name, PROTO_MAX_NAME);
        r->handle = proto_get_u64(&in);
        r->tier = proto_get_u32(&in);
        break;
    case PROTO_LOOKUP:
        proto_get_str(&in, r->name, PROTO_MAX_NAME);
        break;
    case PROTO_UNREGISTER:
    case PROTO_WAIT:
    case PROTO_TENSOR_INFO:
    case PROTO_ZERO:
        r->handle = proto_get_u64(&in);
        break;
    case PROTO_FETCH:
    case PROTO_FETCH_ASYNC:
    case PROTO_PREFETCH:
        r->handle = proto_get_u64(&in);
        r->tier = proto_get_u32(&in);
        break;
    case PROTO_RELEASE:
        r->handle = proto_get_u64(&in);
        r->tier = proto_get_u32(&in);
        r->flags = proto_get_u32(&in);
        break;
    case PROTO_FETCH_ALL:
        r->tier = proto_get_u32(&in);
        r->n = proto_get_u32(&in);
        if (!in.bad && (r->n == 0 || r->n > PROTO_MAX_SET)) in.bad = true;
        r->data = in.bad ? NULL : proto_get_bytes(&in, (size_t)r->n * 8);
        break;
    case PROTO_WRITE:
    case PROTO_READ:
    case PROTO_STAGE_PUT:
    case PROTO_STAGE_GET:
        r->handle = proto_get_u64(&in);
        r->offset = proto_get_u64(&in);
        r->n = proto_get_u32(&in);
        if (!in.bad && r->n > PROTO_MAX_DATA) in.bad = true;
        if ((op == PROTO_WRITE || op == PROTO_STAGE_PUT) && !in.bad)
            r->data = proto_get_bytes(&in, r->n);
        break;
    case PROTO_STAGE_WRITE:
    case PROTO_STAGE_READ:
        r->handle = proto_get_u64(&in);
        r->offset = proto_get_u64(&in);
        r->bytes = proto_get_u64(&in);
        break;
    case PROTO_STAGE_END:
        r->handle = proto_get_u64(&in);
        break;
    case PROTO_JOB_CLOSE:
    case PROTO_JOB_REMOVE:
        proto_get_str(&in, r->name, PROTO_MAX_JOB);
        break;
    case PROTO_JOB_SHARE:
        proto_get_str(&in, r->name, PROTO_MAX_JOB);
        r->flags = proto_get_u32(&in);
        if (!in.bad && r->flags > 1) in.bad = true;
        break;
    case PROTO_SHUTDOWN:
        break;
    case PROTO_STATUS: /* the page after that job's name; none: the first */
        if (in.off < in.len) {
            proto_get_str(&in, r->name, PROTO_MAX_JOB);
            /* The first page is asked with no payload: an empty name is not another way to
             * say it (a request decodes to one encoding only). */
            if (!in.bad && !r->name[0]) in.bad = true;
        }
        break;
    case PROTO_STEP:
    case PROTO_FLUSH:
    case PROTO_STATS:
        break;
    default:
        return -EBADMSG;
    }
    return proto_done(&in);
}

void proto_encode_request(const struct proto_request *r, uint32_t seq, struct proto_out *o)
{
    proto_out_init(o, r->op, seq);
    switch (r->op) {
    case PROTO_HELLO:
        proto_put_str(o, r->name);
        proto_put_u64(o, r->handle);
        proto_put_u64(o, r->offset);
        if (r->flags) proto_put_u32(o, r->flags);
        break;
    case PROTO_REGISTER:
        proto_put_str(o, r->name);
        proto_put_u64(o, r->handle);
        proto_put_u32(o, r->tier);
        break;
    case PROTO_LOOKUP:
        proto_put_str(o, r->name);
        break;
    case PROTO_UNREGISTER:
    case PROTO_WAIT:
    case PROTO_TENSOR_INFO:
    case PROTO_ZERO:
        proto_put_u64(o, r->handle);
        break;
    case PROTO_FETCH:
    case PROTO_FETCH_ASYNC:
    case PROTO_PREFETCH:
        proto_put_u64(o, r->handle);
        proto_put_u32(o, r->tier);
        break;
    case PROTO_RELEASE:
        proto_put_u64(o, r->handle);
        proto_put_u32(o, r->tier);
        proto_put_u32(o, r->flags);
        break;
    case PROTO_FETCH_ALL:
        proto_put_u32(o, r->tier);
        proto_put_u32(o, r->n);
        proto_put_bytes(o, r->data, (size_t)r->n * 8);
        break;
    case PROTO_WRITE:
    case PROTO_READ:
    case PROTO_STAGE_PUT:
    case PROTO_STAGE_GET:
        proto_put_u64(o, r->handle);
        proto_put_u64(o, r->offset);
        proto_put_u32(o, r->n);
        if (r->op == PROTO_WRITE || r->op == PROTO_STAGE_PUT) proto_put_bytes(o, r->data, r->n);
        break;
    case PROTO_STAGE_WRITE:
    case PROTO_STAGE_READ:
        proto_put_u64(o, r->handle);
        proto_put_u64(o, r->offset);
        proto_put_u64(o, r->bytes);
        break;
    case PROTO_STAGE_END:
        proto_put_u64(o, r->handle);
        break;
    case PROTO_JOB_CLOSE:
    case PROTO_JOB_REMOVE:
        proto_put_str(o, r->name);
        break;
    case PROTO_JOB_SHARE:
        proto_put_str(o, r->name);
        proto_put_u32(o, r->flags);
        break;
    case PROTO_STATUS:
        if (r->name[0]) proto_put_str(o, r->name);
        break;
    default:
        break;
    }
}

/* ---- I/O ----------------------------------------------------------------------------- */

uint64_t proto_spin_ns(void)
{
    const char *v = getenv("ZINF_SPIN_US");
    char *end;
    unsigned long us = PROTO_SPIN_DEFAULT_US;
    if (v && *v) {
        unsigned long got = strtoul(v, &end, 10);
        if (!*end && got <= 1000000) us = got;
    }
    return (uint64_t)us * 1000;
}

bool proto_spin_readable(int fd, uint64_t spin_ns)
{
    if (!spin_ns) return false;
    uint64_t end = now_ns() + spin_ns;
    do {
        char c;
        ssize_t r = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (r >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            return true; /* bytes, the end, or an error: the read will not sleep */
    } while (now_ns() < end);
    return false;
}

int proto_send(int fd, struct proto_out *o, const int *fds, int nfds)
{
    if (o->bad || !o->buf) return -EMSGSIZE;
    if (nfds < 0 || nfds > PROTO_MAX_REGIONS) return -EINVAL;
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int) * PROTO_MAX_REGIONS)];
    } ctl;
    size_t done = 0;
    while (done < o->len) {
        struct iovec iov = {o->buf + done, o->len - done};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
        if (done == 0 && nfds > 0) {
            /* The descriptors ride with the message's first byte. */
            memset(&ctl, 0, sizeof(ctl));
            m.msg_control = ctl.buf;
            m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
            struct cmsghdr *c = CMSG_FIRSTHDR(&m);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
            memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
        }
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno == EPIPE ? -ECONNRESET : -errno;
        }
        done += (size_t)w;
    }
    return 0;
}

/* Reads exactly n bytes into buf, keeping the descriptors that come along. */
/* A message that comes in pieces must come whole within the socket's receive timeout
 * (SO_RCVTIMEO, which bounds each wait): a peer trickling a byte at a time holds a reader no
 * longer than one that sends nothing. Counted from its first piece; read only then. */
struct recv_clock {
    uint64_t t0, limit_ns; /* limit 0: the socket has no timeout */
    bool started;
};

static bool too_slow(int fd, struct recv_clock *ck)
{
    if (!ck->started) {
        struct timeval tv = {0};
        socklen_t len = sizeof(tv);
        if (getsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, &len) == 0)
            ck->limit_ns = (uint64_t)tv.tv_sec * 1000000000ull + (uint64_t)tv.tv_usec * 1000ull;
        ck->t0 = now_ns();
        ck->started = true;
        return false;
    }
    return ck->limit_ns && now_ns() - ck->t0 > ck->limit_ns;
}

static int read_full(int fd, uint8_t *buf, size_t n, int *fds, int max_fds, int *nfds,
                     struct recv_clock *ck)
{
    size_t done = 0;
    while (done < n) {
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int) * 8)];
        } ctl;
        struct iovec iov = {buf + done, n - done};
        struct msghdr m = {.msg_iov = &iov,
                           .msg_iovlen = 1,
                           .msg_control = ctl.buf,
                           .msg_controllen = sizeof(ctl.buf)};
        ssize_t r = recvmsg(fd, &m, MSG_CMSG_CLOEXEC);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < k; i++) {
                int got;
                memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                if (fds && *nfds < max_fds)
                    fds[(*nfds)++] = got;
                else
                    close(got); /* more than asked for: never leaked */
            }
        }
        if (r == 0) return -ECONNRESET;
        done += (size_t)r;
        if (done < n && too_slow(fd, ck)) return -ETIMEDOUT;
    }
    return 0;
}

int proto_recv(int fd, bool reply, struct proto_header *h, uint8_t **payload, int *fds, int *nfds)
{
    uint8_t raw[PROTO_HEADER_BYTES];
    int max_fds = nfds ? *nfds : 0, got = 0;
    struct recv_clock ck = {0};
    *payload = NULL;
    int r = read_full(fd, raw, sizeof(raw), fds, max_fds, &got, &ck);
    if (r == 0) r = proto_header_parse(raw, reply, h);
    if (r == 0 && h->len) {
        *payload = malloc(h->len);
        r = *payload ? read_full(fd, *payload, h->len, fds, max_fds, &got, &ck) : -ENOMEM;
    }
    if (nfds) *nfds = got;
    if (r < 0) {
        free(*payload);
        *payload = NULL;
        for (int i = 0; i < got; i++)
            close(fds[i]);
        if (nfds) *nfds = 0;
    }
    return r;
}
