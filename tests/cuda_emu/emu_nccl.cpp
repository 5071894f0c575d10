/*
 * emu_nccl.cpp - a CPU emulation of the part of NCCL that zinf calls (src/comm/nccl.c), so
 * that GPU ranks run as processes of one machine without a GPU: the communicator's NCCL
 * tests and `zinf launch -n N -- zinf train` on the emulated CUDA device tier. run.sh links
 * it into the programs in place of libnccl (src/comm/nccl.c is built with
 * ZINF_NCCL_LINKED there, so it calls these functions instead of loading the library).
 *
 * What is modelled:
 *   - ncclGetUniqueId names a POSIX shared-memory segment; ncclCommInitRank maps it (the
 *     first rank creates it) and waits, as NCCL does, until every rank of the world has
 *     come, then the segment's name is unlinked. Each rank has a staging slot in it.
 *   - AllGather, ReduceScatter, AllReduce (ncclSum) and Broadcast on device buffers (each
 *     checked to lie in one emulated device allocation), enqueued on the caller's stream
 *     exactly as the CUDA emulation queues kernels and copies: they run in stream order on
 *     the stream's worker, asynchronously to the host, and events and stream waits order
 *     them with the rest. In place as NCCL allows it (an AllGather whose send buffer is the
 *     rank's part of the receive buffer, a ReduceScatter whose receive buffer is the rank's
 *     part of the send buffer, an AllReduce or Broadcast on one buffer).
 *   - Sums in rank order, ((r0 + r1) + r2) + ..., for float32, float64, the 8- and 32-bit
 *     integers, and bf16 and fp16 (widened to float for each addition and rounded back, as
 *     NCCL's own 16-bit reductions do per step): results are deterministic and the same on
 *     every rank. The data moves through the slots a chunk at a time, with a barrier of
 *     every rank between the phases of each chunk.
 *   - ncclSend and ncclRecv, through a ring per ordered pair of ranks in the segment (a send
 *     to itself too); the k-th send from a to b matches b's k-th receive from a. Outside a
 *     group each is enqueued alone, and a send waits until its receiver has taken all but a
 *     ring of it, as NCCL's may.
 *   - ncclGroupStart/ncclGroupEnd: collectives between them are enqueued as they are called
 *     (every rank calls the same collectives in the same order, so running them one after the
 *     other is one of the orders NCCL may choose); sends and receives are gathered and
 *     enqueued at the outermost ncclGroupEnd as one operation that progresses them together.
 *   - Faults: ncclCommAbort (or a rank's abort anywhere in the world) makes every rank's
 *     pending and later operations return at their next barrier; their streams go on, and
 *     ncclCommGetAsyncError says ncclRemoteError (a peer aborted) or ncclSystemError (this
 *     rank did). A rank that dies without aborting leaves the others waiting, as with NCCL:
 *     the caller's watchdog (nccl.c polls the rendezvous for dead ranks) aborts them.
 *
 * Not modelled: more than one communicator per segment name, ncclCommSplit and the other
 * calls zinf does not make (absent: a link error), a group's sends on several communicators
or streams, any redop but ncclSum,
 * timing, and NCCL's refusal of two ranks on one GPU (each emulated process has a device of
 * its own). Environment: EMU_NCCL_SLOT_BYTES sets the staging per rank (default 1 MiB;
 * small values exercise the chunking).
 */
#include "emu.h"

#include <nccl.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

namespace
{
const char ID_MAGIC[8] = {'z', 'e', 'm', 'u', 'n', 'c', 'c', 'l'};
const uint32_t SEG_MAGIC = 0x7a6e636cu; /* "zncl" */
const int INIT_TIMEOUT_S = 120;

struct Id {
    char magic[8];
    char name[64]; /* the segment, as shm_open names it */
    size_t slot;   /* staging bytes per rank, the same for every rank */
};
static_assert(sizeof(Id) <= NCCL_UNIQUE_ID_BYTES, "the id fits NCCL's");

/* The shared segment: this header, then nranks slots. The atomics are lock-free, hence
 * usable across processes. */
struct Seg {
    std::atomic<uint32_t> magic;
    std::atomic<int32_t> nranks;
    std::atomic<int32_t> joined;  /* ranks that came */
    std::atomic<uint64_t> present; /* bit r: rank r came (a rank given twice is refused) */
    std::atomic<int32_t> aborted; /* a rank aborted: every operation fails */
    std::atomic<uint32_t> count;  /* the barrier: ranks arrived in this generation */
    std::atomic<uint32_t> gen;
    char pad[64];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "lock-free atomics");
const size_t HDR = 4096;

} // namespace

struct ncclComm {
    int rank, nranks;
    size_t slot;
    Seg *seg;
    size_t map_bytes;
    std::atomic<int> aborted{0}; /* this rank aborted */
    std::atomic<int> pending{0}; /* operations enqueued and not finished */
    std::atomic<int> async{0};   /* ncclResult_t of the first failure */
    char *slot_of(int r) const
    {
        return (char *)seg + HDR + (size_t)r * slot;
    }
    /* The channel from rank a to rank b: its counters (put, got: bytes written and read)
     * and its ring of slot bytes, after the slots. */
    std::atomic<uint64_t> *chan(int a, int b) const
    {
        return (std::atomic<uint64_t> *)((char *)seg + HDR + (size_t)nranks * slot +
                                          ((size_t)a * (size_t)nranks + (size_t)b) * 128);
    }
    char *ring(int a, int b) const
    {
        size_t pairs = (size_t)nranks * (size_t)nranks;
        return (char *)seg + HDR + (size_t)nranks * slot + pairs * 128 +
               ((size_t)a * (size_t)nranks + (size_t)b) * slot;
    }
};

static size_t seg_bytes(int nranks, size_t slot)
{
    size_t pairs = (size_t)nranks * (size_t)nranks;
    return HDR + (size_t)nranks * slot + pairs * (128 + slot);
}

static int group_depth;

static size_t slot_bytes()
{
    const char *e = getenv("EMU_NCCL_SLOT_BYTES");
    long v = e ? atol(e) : 0;
    return v >= 64 ? (size_t)v / 64 * 64 : (size_t)1 << 20;
}

static void nap()
{
    struct timespec ts = {0, 20000};
    nanosleep(&ts, nullptr);
}

/* Every rank of the world reaches it, or false once the communicator was aborted (here
 * or by a peer). */
static bool barrier(ncclComm *c)
{
    Seg *s = c->seg;
    uint32_t g = s->gen.load(std::memory_order_acquire);
    if (s->count.fetch_add(1, std::memory_order_acq_rel) + 1 == (uint32_t)c->nranks) {
        s->count.store(0, std::memory_order_relaxed);
        s->gen.store(g + 1, std::memory_order_release);
        return !s->aborted.load() && !c->aborted.load();
    }
    for (unsigned i = 0; s->gen.load(std::memory_order_acquire) == g; i++) {
        if (s->aborted.load() || c->aborted.load()) return false;
        if (i > 64) nap();
    }
    return !s->aborted.load() && !c->aborted.load();
}

static size_t type_bytes(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8:
    case ncclUint8:
        return 1;
    case ncclFloat16:
    case ncclBfloat16:
        return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
        return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
        return 8;
    default:
        return 0;
    }
}

static float widen(ncclDataType_t t, const void *p, size_t i)
{
    if (t == ncclFloat16) return __half2float(((const __half *)p)[i]);
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}

static void narrow(ncclDataType_t t, void *p, size_t i, float v)
{
    if (t == ncclFloat16)
        ((__half *)p)[i] = __float2half_rn(v);
    else
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
}

template <class T> static void sum_as(void *dst, const char *const *src, int n, size_t count)
{
    T *d = (T *)dst;
    for (size_t j = 0; j < count; j++) {
        T acc = ((const T *)src[0])[j];
        for (int q = 1; q < n; q++)
            acc = (T)(acc + ((const T *)src[q])[j]);
        d[j] = acc;
    }
}

/* dst[j] = src[0][j] + src[1][j] + ... in rank order. */
static void sum(ncclDataType_t t, void *dst, const char *const *src, int n, size_t count)
{
    switch (t) {
    case ncclInt8:
        return sum_as<int8_t>(dst, src, n, count);
    case ncclUint8:
        return sum_as<uint8_t>(dst, src, n, count);
    case ncclInt32:
        return sum_as<int32_t>(dst, src, n, count);
    case ncclUint32:
        return sum_as<uint32_t>(dst, src, n, count);
    case ncclInt64:
        return sum_as<int64_t>(dst, src, n, count);
    case ncclUint64:
        return sum_as<uint64_t>(dst, src, n, count);
    case ncclFloat32:
        return sum_as<float>(dst, src, n, count);
    case ncclFloat64:
        return sum_as<double>(dst, src, n, count);
    default: /* fp16, bf16: each partial sum rounded to the type */
        for (size_t j = 0; j < count; j++) {
            uint16_t acc = ((const uint16_t *)src[0])[j];
            for (int q = 1; q < n; q++)
                narrow(t, &acc, 0, widen(t, &acc, 0) + widen(t, src[q], j));
            ((uint16_t *)dst)[j] = acc;
        }
        return;
    }
}

enum Kind { ALLGATHER, REDUCE_SCATTER, ALLREDUCE, BROADCAST };

struct Op {
    Kind kind;
    const char *send;
    char *recv;
    size_t count; /* elements: per rank for AllGather and ReduceScatter */
    ncclDataType_t type;
    int root;
};

/* One collective, on the stream's worker. False when the communicator was aborted. */
static bool run(ncclComm *c, const Op &o)
{
    const size_t es = type_bytes(o.type), N = (size_t)c->nranks, me = (size_t)c->rank;
    const char *src[64];
    for (size_t q = 0; q < N; q++)
        src[q] = c->slot_of((int)q);
    char *mine = c->slot_of(c->rank);
    switch (o.kind) {
    case ALLGATHER: {
        size_t bytes = o.count * es;
        for (size_t off = 0; off < bytes; off += c->slot) {
            size_t len = std::min(c->slot, bytes - off);
            memcpy(mine, o.send + off, len);
            if (!barrier(c)) return false;
            for (size_t q = 0; q < N; q++)
                memcpy(o.recv + q * bytes + off, src[q], len);
            if (!barrier(c)) return false;
        }
        return true;
    }
    case ALLREDUCE: {
        size_t per = c->slot / es;
        for (size_t off = 0; off < o.count; off += per) {
            size_t len = std::min(per, o.count - off);
            memcpy(mine, o.send + off * es, len * es);
            if (!barrier(c)) return false;
            sum(o.type, o.recv + off * es, src, (int)N, len);
            if (!barrier(c)) return false;
        }
        return true;
    }
    case REDUCE_SCATTER: {
        size_t per = c->slot / es / N; /* elements of each rank's part per chunk */
        if (per == 0) return false;
        const char *part[64];
        for (size_t off = 0; off < o.count; off += per) {
            size_t len = std::min(per, o.count - off);
            for (size_t r = 0; r < N; r++)
                memcpy(mine + r * len * es, o.send + (r * o.count + off) * es, len * es);
            if (!barrier(c)) return false;
            for (size_t q = 0; q < N; q++)
                part[q] = src[q] + me * len * es;
            sum(o.type, o.recv + off * es, part, (int)N, len);
            if (!barrier(c)) return false;
        }
        return true;
    }
    case BROADCAST: {
        size_t bytes = o.count * es;
        for (size_t off = 0; off < bytes; off += c->slot) {
            size_t len = std::min(c->slot, bytes - off);
            if (c->rank == o.root) memcpy(mine, o.send + off, len);
            if (!barrier(c)) return false;
            if (o.recv + off != o.send + off || c->rank != o.root)
                memmove(o.recv + off, src[o.root], len);
            if (!barrier(c)) return false;
        }
        return true;
    }
    }
    return false;
}

/* One send or receive of a group. */
struct P2p {
    bool send;
    int peer;
    char *buf;
    size_t bytes, moved;
};

/* Moves what the channel takes: whether anything went. */
static bool p2p_step(ncclComm *c, P2p &p)
{
    int from = p.send ? c->rank : p.peer, to = p.send ? p.peer : c->rank;
    std::atomic<uint64_t> *put = c->chan(from, to), *got = put + 8; /* 64 bytes apart */
    uint64_t w = put->load(p.send ? std::memory_order_relaxed : std::memory_order_acquire);
    uint64_t r = got->load(p.send ? std::memory_order_acquire : std::memory_order_relaxed);
    size_t n = std::min(p.bytes - p.moved, p.send ? c->slot - (size_t)(w - r) : (size_t)(w - r));
    if (!n) return false;
    char *ring = c->ring(from, to);
    uint64_t at64 = p.send ? w : r;
    size_t at = (size_t)(at64 % c->slot), first = std::min(n, c->slot - at);
    if (p.send) {
        memcpy(ring + at, p.buf + p.moved, first);
        memcpy(ring, p.buf + p.moved + first, n - first);
        put->store(w + n, std::memory_order_release);
    } else {
        memcpy(p.buf + p.moved, ring + at, first);
        memcpy(p.buf + p.moved + first, ring, n - first);
        got->store(r + n, std::memory_order_release);
    }
    p.moved += n;
    return true;
}

/* A group's sends and receives, on the stream's worker, together. False once aborted. */
static bool run_p2p(ncclComm *c, std::vector<P2p> ops)
{
    for (unsigned idle = 0;;) {
        bool all = true, moved = false;
        for (P2p &p : ops) {
            if (p.moved < p.bytes) moved |= p2p_step(c, p);
            all &= p.moved == p.bytes;
        }
        if (all) return true;
        if (c->seg->aborted.load() || c->aborted.load()) return false;
        idle = moved ? 0 : idle + 1;
        if (idle > 64) nap();
    }
}

static std::vector<P2p> group_ops;
static ncclComm *group_comm;
static cudaStream_t group_stream;

static void enqueue_p2p(ncclComm *c, std::vector<P2p> ops, cudaStream_t s)
{
    c->pending++;
    emu_enqueue(s, [c, ops] {
        if (!c->aborted.load() && !c->seg->aborted.load() && !run_p2p(c, ops)) {
            int none = ncclSuccess;
            c->async.compare_exchange_strong(
                none, c->aborted.load() ? ncclSystemError : ncclRemoteError);
        }
        c->pending--;
    });
}

static ncclResult_t add_p2p(bool send, const void *buf, size_t count, ncclDataType_t t, int peer,
                            ncclComm_t c, cudaStream_t s)
{
    if (!c || !c->seg || !type_bytes(t) || peer < 0 || peer >= c->nranks) return ncclInvalidArgument;
    if (c->aborted.load()) return ncclInvalidUsage;
    size_t bytes = count * type_bytes(t);
    if (bytes) emu_need_device(buf, bytes, send ? "nccl send buffer" : "nccl receive buffer");
    P2p p = {send, peer, (char *)buf, bytes, 0};
    if (group_depth == 0) {
        enqueue_p2p(c, std::vector<P2p>{p}, s);
        return ncclSuccess;
    }
    if (!group_ops.empty() && (group_comm != c || group_stream != s)) return ncclInvalidUsage;
    group_comm = c;
    group_stream = s;
    group_ops.push_back(p);
    return ncclSuccess;
}

static ncclResult_t enqueue(ncclComm *c, const Op &o, cudaStream_t s)
{
    if (!c || !c->seg) return ncclInvalidArgument;
    size_t es = type_bytes(o.type);
    if (!es) return ncclInvalidArgument;
    if (o.root < 0 || o.root >= c->nranks) return ncclInvalidArgument;
    if (c->slot / es / (size_t)c->nranks == 0) return ncclInvalidUsage;
    size_t in = o.count * es, out = o.count * es;
    if (o.kind == ALLGATHER) out *= (size_t)c->nranks;
    if (o.kind == REDUCE_SCATTER) in *= (size_t)c->nranks;
    if (o.count) {
        if (o.kind != BROADCAST || c->rank == o.root) emu_need_device(o.send, in, "nccl send buffer");
        emu_need_device(o.recv, out, "nccl receive buffer");
    }
    if (c->aborted.load()) return ncclInvalidUsage;
    c->pending++;
    emu_enqueue(s, [c, o] {
        if (!c->aborted.load() && !c->seg->aborted.load() && !run(c, o)) {
            int none = ncclSuccess;
            c->async.compare_exchange_strong(
                none, c->aborted.load() ? ncclSystemError : ncclRemoteError);
        }
        c->pending--;
    });
    return ncclSuccess;
}

extern "C" {

ncclResult_t ncclGetVersion(int *version)
{
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess:
        return "no error";
    case ncclUnhandledCudaError:
        return "unhandled cuda error";
    case ncclSystemError:
        return "unhandled system error (emulated NCCL: this rank aborted)";
    case ncclInternalError:
        return "internal error";
    case ncclInvalidArgument:
        return "invalid argument";
    case ncclInvalidUsage:
        return "invalid usage";
    case ncclRemoteError:
        return "remote process exited or there was a network error (emulated NCCL: a peer "
               "aborted)";
    case ncclInProgress:
        return "NCCL operation in progress";
    default:
        return "unknown result code";
    }
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uid)
{
    if (!uid) return ncclInvalidArgument;
    uint64_t rnd;
    if (getrandom(&rnd, sizeof(rnd), 0) != sizeof(rnd)) return ncclSystemError;
    Id id = {};
    memcpy(id.magic, ID_MAGIC, sizeof(ID_MAGIC));
    snprintf(id.name, sizeof(id.name), "/zinf-emu-nccl-%d-%016llx", (int)getpid(),
             (unsigned long long)rnd);
    id.slot = slot_bytes();
    memset(uid, 0, sizeof(*uid));
    memcpy(uid->internal, &id, sizeof(id));
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId uid, int rank)
{
    if (!out || nranks < 1 || nranks > 64 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    Id id;
    memcpy(&id, uid.internal, sizeof(id));
    if (memcmp(id.magic, ID_MAGIC, sizeof(ID_MAGIC)) || !memchr(id.name, 0, sizeof(id.name)) ||
        id.slot < 64)
        return ncclInvalidArgument;
    size_t bytes = seg_bytes(nranks, id.slot);
    int fd = shm_open(id.name, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return ncclSystemError;
    struct stat st;
    if (fstat(fd, &st) < 0 || ((size_t)st.st_size < bytes && ftruncate(fd, (off_t)bytes) < 0)) {
        close(fd);
        return ncclSystemError;
    }
    void *m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return ncclSystemError;
    Seg *s = (Seg *)m;
    uint32_t zero = 0;
    if (!s->magic.compare_exchange_strong(zero, SEG_MAGIC)) {
        for (int i = 0; i < 1000 && s->nranks.load() == 0; i++)
            nap();
    } else {
        s->nranks.store(nranks);
    }
    ncclComm *c = new ncclComm;
    c->rank = rank;
    c->nranks = nranks;
    c->slot = id.slot;
    c->seg = s;
    c->map_bytes = bytes;
    uint64_t bit = 1ull << rank;
    if (s->nranks.load() != nranks || (s->present.fetch_or(bit) & bit)) {
        /* Another world, or this rank twice: every rank of it fails. */
        s->aborted.store(1);
        munmap(m, bytes);
        delete c;
        return ncclInvalidUsage;
    }
    s->joined++;
    time_t t0 = time(nullptr);
    while (s->joined.load() < nranks && !s->aborted.load() && time(nullptr) - t0 < INIT_TIMEOUT_S)
        nap();
    bool ok = s->joined.load() == nranks && !s->aborted.load() && barrier(c);
    if (rank == 0 || !ok) shm_unlink(id.name);
    if (!ok) {
        s->aborted.store(1);
        munmap(m, bytes);
        delete c;
        return ncclSystemError;
    }
    *out = c;
    return ncclSuccess;
}

/* Waits for this rank's operations to finish (an aborted one finishes at its next
 * barrier), then frees. */
static ncclResult_t release(ncclComm_t c)
{
    if (!c) return ncclInvalidArgument;
    while (c->pending.load())
        nap();
    munmap(c->seg, c->map_bytes);
    delete c;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t c)
{
    return release(c);
}

ncclResult_t ncclCommAbort(ncclComm_t c)
{
    if (!c) return ncclInvalidArgument;
    c->aborted.store(1);
    c->seg->aborted.store(1);
    return release(c);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *err)
{
    if (!c || !err) return ncclInvalidArgument;
    int a = c->async.load();
    if (a == ncclSuccess && c->seg->aborted.load()) a = ncclRemoteError;
    *err = (ncclResult_t)a;
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t c, int *count)
{
    if (!c || !count) return ncclInvalidArgument;
    *count = c->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t c, int *rank)
{
    if (!c || !rank) return ncclInvalidArgument;
    *rank = c->rank;
    return ncclSuccess;
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclComm_t c, cudaStream_t s)
{
    return enqueue(c, Op{ALLGATHER, (const char *)send, (char *)recv, count, t, 0}, s);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t c, cudaStream_t s)
{
    if (op != ncclSum) return ncclInvalidArgument;
    return enqueue(c, Op{REDUCE_SCATTER, (const char *)send, (char *)recv, count, t, 0}, s);
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclRedOp_t op, ncclComm_t c, cudaStream_t s)
{
    if (op != ncclSum) return ncclInvalidArgument;
    return enqueue(c, Op{ALLREDUCE, (const char *)send, (char *)recv, count, t, 0}, s);
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root,
                           ncclComm_t c, cudaStream_t s)
{
    return enqueue(c, Op{BROADCAST, (const char *)send, (char *)recv, count, t, root}, s);
}

ncclResult_t ncclGroupStart(void)
{
    group_depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void)
{
    if (group_depth == 0) return ncclInvalidUsage;
    if (--group_depth == 0 && !group_ops.empty()) {
        enqueue_p2p(group_comm, group_ops, group_stream);
        group_ops.clear();
    }
    return ncclSuccess;
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer, ncclComm_t c,
                      cudaStream_t s)
{
    return add_p2p(true, send, count, t, peer, c, s);
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t c,
                      cudaStream_t s)
{
    return add_p2p(false, recv, count, t, peer, c, s);
}

} /* extern "C" */
