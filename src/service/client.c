/*
 * client.c - zinf_connect() and the zinf.h calls on the handle it returns (client.h).
 *
 * A client is one session of the daemon: the first connection says HELLO with the job's
 * name and gets the session's id and secret and the memfds of the job's arenas, which are
 * mapped here once (so a fetched pointer is the daemon's memory, at the same offset). A
 * call takes an idle connection from the pool, or opens one that joins the session, sends
 * one request and reads its reply, then puts the connection back: threads in calls at the
 * same time each have their own, so a fetch that waits for the drive holds up no other
 * thread's release. Pins belong to the session, whichever connection took them; the
 * daemon drops them when the session's last connection closes (the process exited).
 *
 * A connection that fails mid-call is closed and the call answers -ECONNRESET (or the
 * errno of the failure); the others stay in the pool.
 *
 * Not here: the wire format (proto.c), routing (api.c), anything the daemon decides.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "handle.h"
#include "pintable.h"
#include "service/client.h"
#include "service/proto.h"
#include "tiers/device.h"

struct conn {
    int fd;
    struct conn *next;
};

struct region {
    enum zinf_tier tier;
    char *base;
    size_t bytes;
    bool cuda; /* a GPU arena opened through CUDA IPC, not a mapping */
};

struct client {
    struct handle h; /* HANDLE_CLIENT: first, for src/api.c */
    char *socket_path;
    char job[PROTO_MAX_JOB + 1];
    bool readonly; /* zinf_connect_readonly: the arenas mapped read-only, nothing flushed */
    uint64_t session, secret;
    unsigned nregions; /* the memory tiers' arenas, by tier */
    struct region region[PROTO_MAX_REGIONS];
    struct pt_header *pt; /* the session's pin table, or NULL: every call is a message */
    /* The session's liveness mutex (keeper.c), mapped read-only: held while the session
     * lives in a running daemon */
    const pthread_mutex_t *live;
    atomic_bool gone;      /* the daemon was seen stopped or dead: the table is not used */
    atomic_uint seq;
    uint64_t spin_ns; /* how long a call polls for its reply before it sleeps */

    pthread_mutex_t lock; /* idle */
    struct conn *idle;
};

int service_dial(const char *path, int *out)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(a.sun_path)) return -ENAMETOOLONG;
    strcpy(a.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -errno;
    while (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        if (errno == EINTR) continue;
        int r = -errno;
        close(fd);
        return r;
    }
    *out = fd;
    return 0;
}

static void region_free(struct region *g)
{
    if (!g->base) return;
    if (g->cuda)
        device_ipc_close(g->base);
    else
        munmap(g->base, g->bytes);
    g->base = NULL;
}

/* The session's pin table, when it is one this build reads; otherwise it goes unused. */
static void take_table(struct client *c, struct region *g)
{
    struct pt_header *h = (struct pt_header *)g->base;
    const char *use = getenv("ZINF_PIN_TABLE"); /* "0": every call a message, to compare */
    if (!c->pt && !(use && !strcmp(use, "0")) && g->bytes == PT_BYTES && h->magic == PT_MAGIC && h->version == PT_VERSION &&
        h->tensors == PT_TENSORS && h->ring == PT_RING && h->ring_off == PT_RING_OFF &&
        h->slot_off == PT_SLOT_OFF && h->bytes == PT_BYTES)
        c->pt = h;
    else
        munmap(g->base, g->bytes);
}

/* HELLO on fd: joins c's session, or (c->session 0) starts one and maps its regions. */
static int hello(struct client *c, int fd)
{
    bool first = c->session == 0;
    struct proto_out o;
    proto_out_init(&o, PROTO_HELLO, atomic_fetch_add(&c->seq, 1));
    proto_put_str(&o, c->job);
    proto_put_u64(&o, c->session);
    proto_put_u64(&o, c->secret);
    if (c->readonly) proto_put_u32(&o, PROTO_HELLO_READONLY);
    int r = proto_send(fd, &o, NULL, 0);
    proto_out_free(&o);
    /* A connection the daemon refused at accept was closed after its refusal: read it. */
    if (r < 0 && r != -ECONNRESET) return r;

    struct proto_header h;
    uint8_t *payload = NULL;
    int fds[PROTO_MAX_REGIONS], nfds = first ? PROTO_MAX_REGIONS : 0;
    int rr = proto_recv(fd, true, &h, &payload, fds, &nfds);
    if (rr < 0) return r < 0 ? r : rr;
    r = 0;
    struct proto_in in;
    proto_in_init(&in, payload, h.len);
    r = proto_get_i32(&in);
    if (in.bad || h.op != (PROTO_HELLO | PROTO_REPLY)) r = -EPROTO;
    if (r < 0 && r != -EPROTO && in.off < in.len) { /* the daemon says why: a limit, named */
        char why[512];
        proto_get_str(&in, why, sizeof(why) - 1);
        if (!in.bad) log_error("%s", why);
    }
    if (r == 0) {
        uint64_t session = proto_get_u64(&in), secret = proto_get_u64(&in);
        uint32_t n = proto_get_u32(&in);
        struct region reg[PROTO_MAX_REGIONS] = {0};
        int want_fds = 0;
        for (uint32_t i = 0; i < n && i < PROTO_MAX_REGIONS; i++) {
            uint32_t kind = proto_get_u32(&in);
            reg[i].bytes = (size_t)proto_get_u64(&in);
            reg[i].cuda = kind == PROTO_REGION_CUDA;
            reg[i].tier = reg[i].cuda ? ZINF_TIER_DEVICE : (enum zinf_tier)kind;
            want_fds += !reg[i].cuda;
        }
        /* A GPU arena's CUDA IPC handle and its GPU's bus id follow the list. */
        unsigned char ipc[DEVICE_IPC_HANDLE_BYTES];
        char busid[DEVICE_BUSID_BYTES] = "";
        bool cuda = n && n <= PROTO_MAX_REGIONS && reg[0].cuda;
        if (cuda) {
            const uint8_t *hb = proto_get_u32(&in) == sizeof(ipc) ? proto_get_bytes(&in, sizeof(ipc)) : NULL;
            proto_get_str(&in, busid, sizeof(busid));
            if (hb) memcpy(ipc, hb, sizeof(ipc)); else in.bad = true;
        }
        if (proto_done(&in) < 0 || n > PROTO_MAX_REGIONS || (first && nfds != want_fds))
            r = -EPROTO;
        for (uint32_t i = 0, f = 0; r == 0 && first && i < n; i++) {
            void *p = NULL;
            if (reg[i].cuda) {
                r = device_ipc_open(ipc, busid, &p);
                if (r == -ENOTSUP)
                    log_error("zinf_connect: the daemon's device tier is a GPU, and this "
                              "library was built without CUDA");
            } else if ((p = mmap(NULL, reg[i].bytes,
                                 reg[i].tier == (enum zinf_tier)PROTO_REGION_LIVE ||
                                         (c->readonly && reg[i].tier <= ZINF_TIER_NVME)
                                     ? PROT_READ /* the daemon's alone to write */
                                     : PROT_READ | PROT_WRITE,
                                 MAP_SHARED, fds[f++], 0)) == MAP_FAILED) {
                p = NULL;
                r = -errno;
            }
            reg[i].base = p;
        }
        if (r == 0 && first) {
            c->session = session;
            c->secret = secret;
            for (uint32_t i = 0; i < n; i++) {
                if (reg[i].tier == (enum zinf_tier)PROTO_REGION_PINS)
                    take_table(c, &reg[i]);
                else if (reg[i].tier == (enum zinf_tier)PROTO_REGION_LIVE && !c->live &&
                         reg[i].bytes == PROTO_LIVE_BYTES)
                    c->live = (const pthread_mutex_t *)reg[i].base;
                else if (reg[i].tier == (enum zinf_tier)c->nregions && c->nregions < 2)
                    c->region[c->nregions++] = reg[i];
                else
                    region_free(&reg[i]); /* not ours to use */
            }
        } else if (first) {
            for (uint32_t i = 0; i < n && i < PROTO_MAX_REGIONS; i++)
                region_free(&reg[i]);
        }
    }
    for (int i = 0; i < nfds; i++)
        close(fds[i]); /* the mappings hold the memory */
    free(payload);
    return r;
}

static void conn_drop(struct conn *k)
{
    close(k->fd);
    free(k);
}

static int conn_get(struct client *c, struct conn **out)
{
    pthread_mutex_lock(&c->lock);
    struct conn *k = c->idle;
    if (k) c->idle = k->next;
    pthread_mutex_unlock(&c->lock);
    if (k) {
        *out = k;
        return 0;
    }
    k = calloc(1, sizeof(*k));
    if (!k) return -ENOMEM;
    int r = service_dial(c->socket_path, &k->fd);
    if (r == 0 && (r = hello(c, k->fd)) < 0) close(k->fd);
    if (r < 0) {
        free(k);
        /* Nobody listening any more, once the session has begun: the daemon went away. */
        return c->session && (r == -ENOENT || r == -ECONNREFUSED) ? -ECONNRESET : r;
    }
    *out = k;
    return 0;
}

static void conn_put(struct client *c, struct conn *k)
{
    pthread_mutex_lock(&c->lock);
    k->next = c->idle;
    c->idle = k;
    pthread_mutex_unlock(&c->lock);
}

/* A request in flight: o is the request; after call() in reads the reply's fields past the
 * result, from payload (freed by call_end). */
struct call {
    struct proto_out o;
    struct proto_in in;
    uint8_t *payload;
};

static void call_begin(struct client *c, struct call *k, uint16_t op)
{
    memset(k, 0, sizeof(*k));
    proto_out_init(&k->o, op, atomic_fetch_add(&c->seq, 1));
}

static void call_end(struct call *k)
{
    proto_out_free(&k->o);
    free(k->payload);
    k->payload = NULL;
}

/* Sends k's request and reads its reply: the result the daemon gave, or -errno of the
 * transport. */
static int call(struct client *c, struct call *k)
{
    struct conn *cn;
    if (k->o.bad) return -ENOMEM;
    int r = conn_get(c, &cn);
    if (r < 0) return r;
    struct proto_header h;
    uint32_t seq;
    uint16_t op;
    memcpy(&op, k->o.buf + 6, 2);
    memcpy(&seq, k->o.buf + 8, 4);
    r = proto_send(cn->fd, &k->o, NULL, 0);
    if (r == 0) {
        proto_spin_readable(cn->fd, c->spin_ns);
        r = proto_recv(cn->fd, true, &h, &k->payload, NULL, NULL);
    }
    if (r == 0 && (h.seq != seq || h.op != (op | PROTO_REPLY))) r = -EPROTO;
    if (r < 0) {
        conn_drop(cn);
        log_error("zinf client: the connection to %s broke: %s", c->socket_path, strerror(-r));
        return r == -EPROTO || r == -ECONNRESET ? r : -ECONNRESET;
    }
    conn_put(c, cn);
    proto_in_init(&k->in, k->payload, h.len);
    r = proto_get_i32(&k->in);
    return k->in.bad ? -EPROTO : r;
}

/* A reply's (region, offset) as a pointer into the mapped region. */
static int pointer_of(struct client *c, struct proto_in *in, void **ptr)
{
    uint32_t reg = proto_get_u32(in);
    uint64_t off = proto_get_u64(in);
    if (in->bad || reg >= c->nregions || off >= c->region[reg].bytes) return -EPROTO;
    *ptr = c->region[reg].base + off;
    return 0;
}

static int connect_as(const char *socket_path, const char *job, bool readonly,
                      zinf_engine **out)
{
    if (!out) return -EINVAL;
    *out = NULL;
    if (!socket_path || !job || !job[0] || strlen(job) > PROTO_MAX_JOB) return -EINVAL;
    struct client *c = calloc(1, sizeof(*c));
    if (!c) return -ENOMEM;
    c->h.kind = HANDLE_CLIENT;
    c->spin_ns = proto_spin_ns();
    pthread_mutex_init(&c->lock, NULL);
    strcpy(c->job, job);
    c->readonly = readonly;
    c->socket_path = strdup(socket_path);
    if (!c->socket_path) {
        client_close(c);
        return -ENOMEM;
    }
    struct conn *k;
    int r = conn_get(c, &k); /* the first HELLO starts the session */
    if (r < 0) {
        /* Nobody listening is what the result says, and callers often wait for a daemon
         * by retrying: that one is a debug message. */
        if (r != -ENOENT && r != -ECONNREFUSED)
            log_error("zinf_connect %s, job %s: %s", socket_path, job, zinf_strerror(r));
        else
            log_debug("zinf_connect: no zinf daemon listens on %s", socket_path);
        free(c->socket_path);
        pthread_mutex_destroy(&c->lock);
        free(c);
        return r;
    }
    conn_put(c, k);
    *out = (zinf_engine *)c;
    return 0;
}

ZINF_API int zinf_connect(const char *socket_path, const char *job, zinf_engine **out)
{
    return connect_as(socket_path, job, false, out);
}

ZINF_API int zinf_connect_readonly(const char *socket_path, const char *job, zinf_engine **out)
{
    return connect_as(socket_path, job, true, out);
}

static void close_client(struct client *c, bool flush)
{
    if (!c) return;
    flush &= !c->readonly; /* the job is its owner's to flush */
    /* As an embedded engine does at close: what was written becomes durable. */
    if (c->session && flush) client_flush(c);
    struct conn *k = c->idle;
    while (k) {
        struct conn *next = k->next;
        conn_drop(k);
        k = next;
    }
    for (unsigned i = 0; i < c->nregions; i++)
        region_free(&c->region[i]);
    if (c->pt) munmap(c->pt, PT_BYTES);
    if (c->live) munmap((void *)c->live, PROTO_LIVE_BYTES);
    free(c->socket_path);
    pthread_mutex_destroy(&c->lock);
    c->h.kind = 0;
    free(c);
}

void client_close(struct client *c)
{
    close_client(c, true);
}

void client_close_unflushed(struct client *c)
{
    close_client(c, false);
}

static int handle_reply(struct client *c, struct call *k, zinf_tensor *out)
{
    int r = call(c, k);
    if (r == 0) {
        uint64_t h = proto_get_u64(&k->in);
        r = proto_done(&k->in) < 0 ? -EPROTO : 0;
        if (r == 0) *out = h;
    }
    call_end(k);
    return r;
}

int client_register(struct client *c, const char *name, size_t nbytes, enum zinf_tier home,
                    zinf_tensor *out)
{
    if (!name || !out || strlen(name) > PROTO_MAX_NAME) return -EINVAL;
    struct call k;
    call_begin(c, &k, PROTO_REGISTER);
    proto_put_str(&k.o, name);
    proto_put_u64(&k.o, nbytes);
    proto_put_u32(&k.o, (uint32_t)home);
    return handle_reply(c, &k, out);
}

int client_lookup(struct client *c, const char *name, zinf_tensor *out)
{
    if (!name || !out) return -EINVAL;
    if (strlen(name) > PROTO_MAX_NAME) return -ENOENT;
    struct call k;
    call_begin(c, &k, PROTO_LOOKUP);
    proto_put_str(&k.o, name);
    return handle_reply(c, &k, out);
}

/* A request whose reply is the result alone. */
static int simple(struct client *c, struct call *k)
{
    int r = call(c, k);
    if (r >= 0 && proto_done(&k->in) < 0) r = -EPROTO;
    call_end(k);
    return r;
}

int client_unregister(struct client *c, zinf_tensor t)
{
    struct call k;
    call_begin(c, &k, PROTO_UNREGISTER);
    proto_put_u64(&k.o, t);
    return simple(c, &k);
}

int client_zero(struct client *c, zinf_tensor t)
{
    struct call k;
    call_begin(c, &k, PROTO_ZERO);
    proto_put_u64(&k.o, t);
    return simple(c, &k);
}

int client_tensor_info(struct client *c, zinf_tensor t, struct zinf_tensor_info *out)
{
    if (!out) return -EINVAL;
    struct call k;
    call_begin(c, &k, PROTO_TENSOR_INFO);
    proto_put_u64(&k.o, t);
    int r = call(c, &k);
    if (r == 0) {
        uint32_t home = proto_get_u32(&k.in);
        uint64_t bytes = proto_get_u64(&k.in);
        if (proto_done(&k.in) < 0 || home > ZINF_TIER_NVME)
            r = -EPROTO;
        else
            *out = (struct zinf_tensor_info){.home = (enum zinf_tier)home, .bytes = bytes};
    }
    call_end(&k);
    return r;
}

/* A request whose reply is one (region, offset): *ptr. */
static int pointer_reply(struct client *c, struct call *k, void **ptr)
{
    int r = call(c, k);
    if (r == 0) r = pointer_of(c, &k->in, ptr);
    if (r == 0 && proto_done(&k->in) < 0) r = -EPROTO;
    call_end(k);
    return r;
}

/* ---- the hit path: the session's pin table (pintable.h) ------------------------------ */

/* Does the session still live in a running daemon? Its liveness mutex is held while it
 * does. The mutex is read, never taken (the mapping is read-only): its futex word holds the
 * holder's thread id while it is held; 0 once the daemon let it go (the session ended), or
 * the owner-died bit once the kernel let it go for a dead daemon. Once gone, gone for every
 * thread: the calls go as messages, which answer -ECONNRESET. (glibc: the word is the
 * mutex's first member, as the kernel's robust-futex ABI has it.) */
static bool daemon_runs(struct client *c)
{
    if (atomic_load_explicit(&c->gone, memory_order_relaxed)) return false;
    uint32_t w = __atomic_load_n((const uint32_t *)&c->live->__data.__lock, __ATOMIC_ACQUIRE);
    if ((w & FUTEX_TID_MASK) && !(w & FUTEX_OWNER_DIED)) return true;
    atomic_store_explicit(&c->gone, true, memory_order_relaxed);
    return false;
}

/* t's slot for tier in the table, or NULL when the table does not cover it (or must not be
 * used: the daemon is gone). */
static struct pt_slot *slot_of(struct client *c, zinf_tensor t, enum zinf_tier tier)
{
    uint32_t idx = (uint32_t)(t & 0xffffffffu) - 1; /* a handle's index is 1-based */
    if (!c->pt || !c->live || (unsigned)tier >= PT_TIERS || idx >= PT_TENSORS) return NULL;
    if (!daemon_runs(c)) return NULL;
    return pt_slot(c->pt, idx, tier);
}

/* Tell the daemon of a pin taken in the table: false when the ring is full. */
static bool tell(struct client *c, zinf_tensor t, enum zinf_tier tier)
{
    struct pt_header *h = c->pt;
    uint64_t head = atomic_load_explicit(&h->head, memory_order_relaxed);
    do {
        if (head - atomic_load_explicit(&h->tail, memory_order_acquire) >= PT_RING) return false;
    } while (!atomic_compare_exchange_weak_explicit(&h->head, &head, head + 1,
                                                    memory_order_relaxed, memory_order_relaxed));
    struct pt_event *ev = &pt_ring(h)[head & (PT_RING - 1)];
    uint64_t idx = (t & 0xffffffffu) - 1;
    atomic_store_explicit(&ev->what, (t & ~0xffffffffull) | idx << 1 | (unsigned)tier,
                          memory_order_relaxed);
    atomic_store_explicit(&ev->stamp, head + 1, memory_order_release);
    return true;
}

/* zinf_fetch of a copy whose slot is open: one compare-and-swap, no message. */
static bool fetch_fast(struct client *c, zinf_tensor t, enum zinf_tier tier, void **ptr)
{
    struct pt_slot *s = slot_of(c, t, tier);
    if (!s) return false;
    uint64_t w = atomic_load_explicit(&s->word, memory_order_relaxed);
    do {
        if (!(w & PT_OPEN) || (w & PT_COUNT_MASK) == PT_COUNT_MASK) return false;
    } while (!atomic_compare_exchange_weak_explicit(&s->word, &w, w + 1, memory_order_acquire,
                                                    memory_order_relaxed));
    /* Pinned: the slot cannot close, so info is the copy's. */
    uint64_t info = atomic_load_explicit(&s->info, memory_order_relaxed);
    uint64_t off = (info & 0xffffffffu) << PT_PAGE_SHIFT;
    if ((uint32_t)(info >> 32) != (uint32_t)(t >> 32) || (unsigned)tier >= c->nregions ||
        off >= c->region[tier].bytes || !tell(c, t, tier)) {
        /* Another tensor's slot (t is stale), or the ring is full: the daemon answers. */
        atomic_fetch_sub_explicit(&s->word, 1, memory_order_release);
        return false;
    }
    (void)atomic_load_explicit(&c->pt->published, memory_order_acquire);
    *ptr = c->region[tier].base + off;
    return true;
}

/* A clean zinf_release of a pin counted in t's slot: one compare-and-swap. */
static bool release_fast(struct client *c, zinf_tensor t, enum zinf_tier tier)
{
    struct pt_slot *s = slot_of(c, t, tier);
    if (!s) return false;
    uint64_t w = atomic_load_explicit(&s->word, memory_order_relaxed);
    do {
        if (!(w & PT_OPEN) || (w & PT_COUNT_MASK) == 0) return false;
        /* The epoch in w makes the swap fail if the slot was reopened since info was read. */
        uint64_t info = atomic_load_explicit(&s->info, memory_order_relaxed);
        if ((uint32_t)(info >> 32) != (uint32_t)(t >> 32)) return false;
    } while (!atomic_compare_exchange_weak_explicit(&s->word, &w, w - 1, memory_order_release,
                                                    memory_order_relaxed));
    return true;
}

int client_fetch(struct client *c, zinf_tensor t, enum zinf_tier tier, void **ptr)
{
    if (!ptr) return -EINVAL;
    if (fetch_fast(c, t, tier, ptr)) return 0;
    struct call k;
    call_begin(c, &k, PROTO_FETCH);
    proto_put_u64(&k.o, t);
    proto_put_u32(&k.o, (uint32_t)tier);
    return pointer_reply(c, &k, ptr);
}

int client_fetch_async(struct client *c, zinf_tensor t, enum zinf_tier tier, uint64_t *ticket)
{
    if (!ticket) return -EINVAL;
    struct call k;
    call_begin(c, &k, PROTO_FETCH_ASYNC);
    proto_put_u64(&k.o, t);
    proto_put_u32(&k.o, (uint32_t)tier);
    return handle_reply(c, &k, ticket);
}

int client_wait(struct client *c, uint64_t ticket, void **ptr)
{
    if (!ptr) return -EINVAL;
    struct call k;
    call_begin(c, &k, PROTO_WAIT);
    proto_put_u64(&k.o, ticket);
    return pointer_reply(c, &k, ptr);
}

int client_fetch_all(struct client *c, const zinf_tensor *ts, size_t n, enum zinf_tier tier,
                     void **ptrs)
{
    if (!ts || !ptrs || n == 0) return -EINVAL;
    if (n > PROTO_MAX_SET) return -E2BIG;
    struct call k;
    call_begin(c, &k, PROTO_FETCH_ALL);
    proto_put_u32(&k.o, (uint32_t)tier);
    proto_put_u32(&k.o, (uint32_t)n);
    for (size_t i = 0; i < n; i++)
        proto_put_u64(&k.o, ts[i]);
    int r = call(c, &k);
    for (size_t i = 0; r == 0 && i < n; i++)
        r = pointer_of(c, &k.in, &ptrs[i]);
    if (r == 0 && proto_done(&k.in) < 0) r = -EPROTO;
    call_end(&k);
    return r;
}

int client_release(struct client *c, zinf_tensor t, enum zinf_tier tier, unsigned flags)
{
    if (flags == 0 && release_fast(c, t, tier)) return 0;
    struct call k;
    call_begin(c, &k, PROTO_RELEASE);
    proto_put_u64(&k.o, t);
    proto_put_u32(&k.o, (uint32_t)tier);
    proto_put_u32(&k.o, flags);
    return simple(c, &k);
}

int client_prefetch(struct client *c, zinf_tensor t, enum zinf_tier tier)
{
    struct call k;
    call_begin(c, &k, PROTO_PREFETCH);
    proto_put_u64(&k.o, t);
    proto_put_u32(&k.o, (uint32_t)tier);
    return simple(c, &k);
}

int client_step(struct client *c)
{
    struct call k;
    call_begin(c, &k, PROTO_STEP);
    return simple(c, &k);
}

int client_flush(struct client *c)
{
    struct call k;
    call_begin(c, &k, PROTO_FLUSH);
    return simple(c, &k);
}

/* One message of bytes: WRITE or STAGE_PUT (src), READ or STAGE_GET (dst); a is the tensor
 * or the stage, at the offset in it. */
static int piece(struct client *c, uint16_t op, uint64_t a, uint64_t at, const void *src,
                 void *dst, size_t n)
{
    struct call k;
    call_begin(c, &k, op);
    proto_put_u64(&k.o, a);
    proto_put_u64(&k.o, at);
    proto_put_u32(&k.o, (uint32_t)n);
    if (src) proto_put_bytes(&k.o, src, n);
    int r = call(c, &k);
    if (r == 0 && dst) {
        uint32_t got = proto_get_u32(&k.in);
        const uint8_t *p = proto_get_bytes(&k.in, got);
        if (!p || got != n)
            r = -EPROTO;
        else if (n)
            memcpy(dst, p, n);
    }
    if (r >= 0 && proto_done(&k.in) < 0) r = -EPROTO;
    call_end(&k);
    return r;
}

/* zinf_write (src) or zinf_read (dst). Up to a message's worth is one message (an empty one
 * still asks, for its errors); more is staged in the daemon and the engine called once for
 * the whole range (proto.h, STAGE_*): as whole as embedded, whichever session looks. */
static int transfer(struct client *c, zinf_tensor t, size_t off, const void *src, void *dst,
                    size_t n)
{
    if (n <= PROTO_MAX_DATA) return piece(c, src ? PROTO_WRITE : PROTO_READ, t, off, src, dst, n);
    struct call k;
    call_begin(c, &k, src ? PROTO_STAGE_WRITE : PROTO_STAGE_READ);
    proto_put_u64(&k.o, t);
    proto_put_u64(&k.o, off);
    proto_put_u64(&k.o, n);
    int r = call(c, &k);
    uint64_t stage = r == 0 ? proto_get_u64(&k.in) : 0;
    if (r >= 0 && proto_done(&k.in) < 0) r = -EPROTO;
    call_end(&k);
    if (r < 0) return r;
    for (size_t done = 0; done < n && r == 0;) {
        size_t len = MIN(n - done, (size_t)PROTO_MAX_DATA);
        r = piece(c, src ? PROTO_STAGE_PUT : PROTO_STAGE_GET, stage, done,
                  src ? (const char *)src + done : NULL, dst ? (char *)dst + done : NULL, len);
        done += len;
    }
    /* Ended either way: a write that failed midway is dropped, not applied. */
    struct call end;
    call_begin(c, &end, PROTO_STAGE_END);
    proto_put_u64(&end.o, stage);
    int e = simple(c, &end);
    return r < 0 ? r : e;
}

int client_write(struct client *c, zinf_tensor t, size_t off, const void *src, size_t n)
{
    if (!src && n) return -EINVAL;
    return transfer(c, t, off, src ? src : "", NULL, n);
}

int client_read(struct client *c, zinf_tensor t, size_t off, void *dst, size_t n)
{
    if (!dst && n) return -EINVAL;
    char none;
    return transfer(c, t, off, NULL, dst ? dst : &none, n);
}

int client_stats(struct client *c, struct zinf_stats *out)
{
    if (!out) return -EINVAL;
    struct call k;
    call_begin(c, &k, PROTO_STATS);
    int r = call(c, &k);
    if (r == 0) {
        uint32_t n = proto_get_u32(&k.in);
        const uint8_t *p = proto_get_bytes(&k.in, n);
        if (!p || n != sizeof(*out) || proto_done(&k.in) < 0)
            r = -EPROTO;
        else
            memcpy(out, p, sizeof(*out));
    }
    call_end(&k);
    return r;
}
