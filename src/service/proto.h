/*
 * proto.h - the wire format between a client (client.c) and the zinf daemon (server.c):
 * versioned, length-prefixed binary messages over a Unix stream socket. docs/PROTOCOL.md
 * says the same for people; this header is the reference.
 *
 * Every message is a 16-byte header and a payload of at most PROTO_MAX_PAYLOAD bytes:
 *
 *   u32 magic    PROTO_MAGIC
 *   u16 version  PROTO_VERSION; a peer answers another version with -EPROTONOSUPPORT
 *   u16 op       enum proto_op; a reply has PROTO_REPLY set on the request's op
 *   u32 seq      chosen by the client, copied into the reply
 *   u32 len      payload bytes that follow
 *
 * Integers are in the machine's own byte order (the socket never leaves the machine),
 * strings are a u32 length and that many bytes with no NUL among them. A reply's payload
 * starts with an i32 result: 0 (or a count) or a negative errno, as zinf.h returns it;
 * the fields after it are present only when it is not negative. The payload of each op is
 * written next to it below ("->" the reply's fields after the result).
 *
 * Tensor bytes do not travel here: a fetch answers with a region and an offset into
 * memory the client mapped at HELLO (the daemon passes the regions' memfds once, with
 * SCM_RIGHTS, on a session's first connection). zinf_read and zinf_write, which copy,
 * carry at most PROTO_MAX_DATA bytes a message and are split by the client.
 *
 * The decoder (proto_get_*) never reads past the payload it was given: a field that does
 * not fit marks the reader bad, and proto_done() then fails the whole message, so a
 * truncated or malformed message is an error reply and a closed connection, never a crash.
 *
 * Not here: sockets and file descriptors (proto_send/proto_recv in proto.c do the I/O of
 * one whole message), what an op does (server.c).
 */
#ifndef ZINF_SERVICE_PROTO_H
#define ZINF_SERVICE_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PROTO_MAGIC 0x666e697au /* "zinf" read as a little-endian u32 */
#define PROTO_VERSION 4
#define PROTO_HEADER_BYTES 16
#define PROTO_MAX_DATA ((uint32_t)1 << 20)        /* read/write bytes a message */
#define PROTO_MAX_PAYLOAD (PROTO_MAX_DATA + 4096) /* the largest payload either way */
#define PROTO_MAX_NAME 4096                       /* a tensor's name, bytes */
#define PROTO_MAX_JOB 64                          /* a job's name, bytes */
#define PROTO_MAX_SET 65536                       /* tensors in one FETCH_ALL */
#define PROTO_MAX_REGIONS 4                       /* memory regions a session maps */
#define PROTO_REGION_PINS 0x100u /* a region's "tier": the session's pin table (pintable.h) */
/* A region's "tier": the session's liveness mutex (held by the daemon while the session
 * lives; sent with a pin table only) */
#define PROTO_REGION_LIVE 0x101u
/* A region's "tier": the device arena on a GPU, shared through CUDA IPC (no fd: its handle
 * follows the region list) */
#define PROTO_REGION_CUDA 0x102u
#define PROTO_LIVE_BYTES 4096u
#define PROTO_REPLY 0x8000u
/* HELLO's flags: a read-only session (the job's arenas mapped read-only, no pin table,
 * every call that writes answered -EROFS). */
#define PROTO_HELLO_READONLY 1u

enum proto_op {
    /* str job, u64 session, u64 secret (0, 0: a new session; else join that one)[, u32
     * flags: PROTO_HELLO_READONLY, never 0 when sent]
     * -> u64 session, u64 secret, u32 nregions, nregions x {u32 tier, u64 bytes}; on a
     *    new session the regions' fds ride along with the reply (SCM_RIGHTS), in order */
    PROTO_HELLO = 1,
    PROTO_REGISTER = 2,    /* str name, u64 nbytes, u32 home -> u64 handle */
    PROTO_LOOKUP = 3,      /* str name -> u64 handle */
    PROTO_UNREGISTER = 4,  /* u64 handle */
    PROTO_FETCH = 5,       /* u64 handle, u32 tier -> u32 region, u64 offset */
    PROTO_FETCH_ASYNC = 6, /* u64 handle, u32 tier -> u64 ticket */
    PROTO_WAIT = 7,        /* u64 ticket -> u32 region, u64 offset */
    PROTO_FETCH_ALL = 8,   /* u32 tier, u32 n, n x u64 handle -> n x {u32 region, u64 offset} */
    PROTO_RELEASE = 9,     /* u64 handle, u32 tier, u32 flags */
    PROTO_PREFETCH = 10,   /* u64 handle, u32 tier */
    PROTO_STEP = 11,       /* (nothing) */
    PROTO_WRITE = 12,      /* u64 handle, u64 offset, u32 n, n bytes */
    PROTO_READ = 13,       /* u64 handle, u64 offset, u32 n -> u32 n, n bytes */
    PROTO_FLUSH = 14,      /* (nothing) */
    PROTO_STATS = 15,      /* (nothing) -> u32 bytes, that many of struct zinf_stats */
    /* Before or instead of HELLO, any number of times: the daemon's jobs that the caller's
     * uid may see (its own; root: all). (nothing) -> u32 n, n x {str job, u32 owner uid,
     * u32 sessions, u64 pins, u32 bytes, that many of struct zinf_stats} */
    PROTO_STATUS = 16,
    /* A zinf_write or zinf_read larger than one message, as whole as embedded: the bytes
     * are staged in the daemon (at most zinf.serve.write_stage_bytes a session at once,
     * else -EMSGSIZE) and the engine is called once for the whole range. STAGE_WRITE opens
     * a stage, STAGE_PUT fills it and STAGE_END applies it (then frees it, either way);
     * STAGE_READ reads the whole range into a stage, STAGE_GET takes it out in pieces and
     * STAGE_END frees it. A stage is its session's: one left open goes with the session.
     * u64 handle, u64 offset, u64 bytes -> u64 stage */
    PROTO_STAGE_WRITE = 17,
    PROTO_STAGE_READ = 18, /* u64 handle, u64 offset, u64 bytes -> u64 stage */
    PROTO_STAGE_PUT = 19,  /* u64 stage, u64 at, u32 n, n bytes */
    PROTO_STAGE_GET = 20,  /* u64 stage, u64 at, u32 n -> u32 n, n bytes */
    PROTO_STAGE_END = 21,  /* u64 stage */
    /* Like STATUS, before or instead of HELLO; the job's owner or root. Closes the job now
     * (flushed, its memory given back; a client attaching later opens it again): -EBUSY
     * while a client is attached, -ENOENT when it is not open. str job */
    PROTO_JOB_CLOSE = 22,
    /* The same, then removes the job's folders and all it saved: -EBUSY while a client is
     * attached, -ENOENT when there is no such job. str job */
    PROTO_JOB_REMOVE = 23,
    /* Root or the daemon's uid: the daemon stops as on SIGTERM (every job flushed), after
     * the reply. (nothing) */
    PROTO_SHUTDOWN = 24,
    PROTO_TENSOR_INFO = 25, /* u64 handle -> u32 home, u64 bytes (zinf_tensor_info) */
    PROTO_ZERO = 26,        /* u64 handle (zinf_zero) */
    /* Like JOB_CLOSE, before or instead of HELLO; the job's owner or root. Grants (flags 1)
     * or takes back (0) read-only HELLOs of every uid to the job: a base that others
     * fine-tune on. Kept in the job's folder. str job, u32 flags */
    PROTO_JOB_SHARE = 27,
    PROTO_OP_MAX = 27,
};

struct proto_header {
    uint32_t magic;
    uint16_t version, op;
    uint32_t seq, len;
};

/* A message being written: the header's fields and a growing payload. */
struct proto_out {
    uint8_t *buf; /* PROTO_HEADER_BYTES of header, then the payload */
    size_t len, cap;
    bool bad; /* out of memory, or past PROTO_MAX_PAYLOAD: proto_send refuses it */
};

/* A payload being read. */
struct proto_in {
    const uint8_t *p;
    size_t len, off;
    bool bad; /* a field ran past the end, or a string broke its rules */
};

/* Starts a message of op and seq (a reply: op | PROTO_REPLY, then proto_put_i32 of the
 * result). Free with proto_out_free. */
void proto_out_init(struct proto_out *o, uint16_t op, uint32_t seq);
void proto_out_free(struct proto_out *o);
void proto_put_u32(struct proto_out *o, uint32_t v);
void proto_put_i32(struct proto_out *o, int32_t v);
void proto_put_u64(struct proto_out *o, uint64_t v);
void proto_put_str(struct proto_out *o, const char *s);
void proto_put_bytes(struct proto_out *o, const void *p, size_t n);
/* Room for n bytes at the end of the payload, to be filled by the caller (NULL when bad). */
void *proto_put_space(struct proto_out *o, size_t n);

/* Parses a header: 0, or -EPROTO (bad magic), -EPROTONOSUPPORT (version), -EMSGSIZE (len
 * over PROTO_MAX_PAYLOAD), -EBADMSG (an op that is not a request, or not a reply when
 * reply is true). */
int proto_header_parse(const uint8_t raw[PROTO_HEADER_BYTES], bool reply, struct proto_header *h);

void proto_in_init(struct proto_in *in, const uint8_t *p, size_t len);
uint32_t proto_get_u32(struct proto_in *in);
int32_t proto_get_i32(struct proto_in *in);
uint64_t proto_get_u64(struct proto_in *in);
/* A string of at most max bytes, copied into buf (which holds max + 1) with its NUL. */
void proto_get_str(struct proto_in *in, char *buf, size_t max);
/* n bytes, in place (NULL when bad). */
const uint8_t *proto_get_bytes(struct proto_in *in, size_t n);
/* 0 when every field was read and nothing is left over; -EBADMSG otherwise. */
int proto_done(const struct proto_in *in);

/* A request, decoded: the fields its op has (proto_op says which), the rest zero. */
struct proto_request {
    uint16_t op;
    char name[PROTO_MAX_NAME + 1]; /* REGISTER, LOOKUP: the tensor; HELLO, JOB_*: the job */
    uint64_t handle;               /* REGISTER: nbytes; WAIT: the ticket; HELLO: the session;
                                      STAGE_PUT/GET/END: the stage */
    uint64_t offset;               /* READ, WRITE, STAGE_*: where; HELLO: the secret */
    uint32_t tier;                 /* FETCH*, RELEASE, PREFETCH; REGISTER: home */
    uint32_t flags;                /* RELEASE, HELLO, JOB_SHARE */
    uint32_t n;                    /* READ, WRITE, STAGE_PUT/GET: bytes; FETCH_ALL: handles */
    uint64_t bytes;                /* STAGE_WRITE, STAGE_READ: the whole range's bytes */
    const uint8_t *data;           /* WRITE: n bytes; FETCH_ALL: n u64 handles (read with memcpy);
                                      pointing into the payload decoded */
};

/* Decodes the payload of a request of op (a header proto_header_parse accepted): 0, or
 * -EBADMSG when it is not exactly that op's fields (a field past the end, bytes left over,
 * a string too long or holding a NUL, a count over its limit). */
int proto_decode_request(uint16_t op, const uint8_t *p, size_t len, struct proto_request *r);
/* Writes r as a request of r->op with seq: the inverse of proto_decode_request. */
void proto_encode_request(const struct proto_request *r, uint32_t seq, struct proto_out *o);

/* Waits up to spin_ns, polling without sleeping, for fd to have bytes to read (or its end):
 * a reply or the next request usually comes within a few microseconds, while a blocking
 * read sleeps and pays the scheduler's wake-up, tens of microseconds on a busy or virtual
 * machine. Returns whether something came (the caller's read then does not sleep); the
 * caller reads either way. spin_ns 0: returns at once. */
bool proto_spin_readable(int fd, uint64_t spin_ns);
/* The spin proto_spin_readable is given: ZINF_SPIN_US in the environment (microseconds, 0
 * to never spin), else PROTO_SPIN_DEFAULT_US. */
#define PROTO_SPIN_DEFAULT_US 50
uint64_t proto_spin_ns(void);

/* Writes the whole message o to fd (with fds[0..nfds) attached when nfds > 0). 0 or
 * -errno (-EMSGSIZE for a bad message). Never raises SIGPIPE. */
int proto_send(int fd, struct proto_out *o, const int *fds, int nfds);
/* Reads one whole message from fd: its header (checked as proto_header_parse does) and a
 * payload of h->len bytes into *payload (malloc'ed; the caller frees it, NULL when empty),
 * and up to *nfds file descriptors that came with it (*nfds says how many did; any beyond
 * what fds holds are closed). -ECONNRESET when the peer closed, -errno otherwise. */
int proto_recv(int fd, bool reply, struct proto_header *h, uint8_t **payload, int *fds, int *nfds);

#endif
