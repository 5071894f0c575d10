/*
 * nccl.c - the NCCL backend (nccl.h). libnccl is loaded (dlopen) when a communicator first
 * needs it: the library itself runs where NCCL is not installed, and says so only to a
 * caller that asks for the nccl backend. Each operation is enqueued on the rank's stream and
 * waited for by polling the stream, so that a peer found dead (through the rendezvous
 * segment) or an asynchronous NCCL error aborts the communicator instead of hanging in a
 * collective that will never complete.
 *
 * A reduction over a 16-bit wire (comm_req.wire) casts send to 16 bits into the rank's wire
 * buffer on its stream (kernel_cast, to nearest even), reduces that in place in NCCL's
 * ncclFloat16 or ncclBfloat16 (NCCL's sums: in 16 bits, in its own order), and widens the
 * result into recv: half the bytes on the links, the result rounded to 16 bits.
 *
 * Not here: the order of operations and the callbacks (comm.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/nccl.h"
#include "common.h"

#ifndef ZINF_NCCL_LINKED
#define ZINF_NCCL_LINKED 0
#endif

#if ZINF_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>

#include "kernels/kernels.h"

_Static_assert(sizeof(ncclUniqueId) == SHM_ID_BYTES, "NCCL's unique id travels in the segment");

struct nccl {
    ncclComm_t comm;
    cudaStream_t stream;
    int device, world, rank;
    bool aborted;
    void *wire;        /* device memory for a 16-bit wire's elements (wire_bytes), or NULL */
    size_t wire_bytes;
};

/* The NCCL functions used, from libnccl.so.2. */
static struct {
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    ncclResult_t (*CommAbort)(ncclComm_t);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
    const char *(*GetErrorString)(ncclResult_t);
    ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*ReduceScatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                                  ncclComm_t, cudaStream_t);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*GetVersion)(int *);
    ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
} lib;
static char lib_why[256]; /* why it did not load */
static pthread_once_t lib_once = PTHREAD_ONCE_INIT;
static int lib_err; /* 0 loaded, -ENOTSUP not */

static void lib_load(void)
{
#if ZINF_NCCL_LINKED
    /* A build whose programs link an NCCL in (the CPU emulation of tests/cuda_emu). */
    lib.GetUniqueId = ncclGetUniqueId;
    lib.CommInitRank = ncclCommInitRank;
    lib.CommDestroy = ncclCommDestroy;
    lib.CommAbort = ncclCommAbort;
    lib.CommGetAsyncError = ncclCommGetAsyncError;
    lib.GetErrorString = ncclGetErrorString;
    lib.AllGather = ncclAllGather;
    lib.ReduceScatter = ncclReduceScatter;
    lib.AllReduce = ncclAllReduce;
    lib.Broadcast = ncclBroadcast;
    lib.GetVersion = ncclGetVersion;
    lib.Send = ncclSend;
    lib.Recv = ncclRecv;
    lib.GroupStart = ncclGroupStart;
    lib.GroupEnd = ncclGroupEnd;
    return;
#endif
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(lib_why, sizeof(lib_why), "%s", dlerror());
        lib_err = -ENOTSUP;
        return;
    }
    struct {
        void **fn;
        const char *name;
    } syms[] = {{(void **)&lib.GetUniqueId, "ncclGetUniqueId"},
                {(void **)&lib.CommInitRank, "ncclCommInitRank"},
                {(void **)&lib.CommDestroy, "ncclCommDestroy"},
                {(void **)&lib.CommAbort, "ncclCommAbort"},
                {(void **)&lib.CommGetAsyncError, "ncclCommGetAsyncError"},
                {(void **)&lib.GetErrorString, "ncclGetErrorString"},
                {(void **)&lib.AllGather, "ncclAllGather"},
                {(void **)&lib.ReduceScatter, "ncclReduceScatter"},
                {(void **)&lib.AllReduce, "ncclAllReduce"},
                {(void **)&lib.Broadcast, "ncclBroadcast"},
                {(void **)&lib.GetVersion, "ncclGetVersion"},
                {(void **)&lib.Send, "ncclSend"},
                {(void **)&lib.Recv, "ncclRecv"},
                {(void **)&lib.GroupStart, "ncclGroupStart"},
                {(void **)&lib.GroupEnd, "ncclGroupEnd"}};
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        *syms[i].fn = dlsym(h, syms[i].name);
        if (!*syms[i].fn) {
            snprintf(lib_why, sizeof(lib_why), "the libnccl found has no %s (too old)",
                     syms[i].name);
            lib_err = -ENOTSUP;
            return; /* the handle stays open: nothing of it is used */
        }
    }
}

static int lib_ready(void)
{
    pthread_once(&lib_once, lib_load);
    if (lib_err)
        log_error("comm: NCCL cannot be loaded (%s): install NCCL (libnccl2) for the nccl backend",
                  lib_why);
    return lib_err;
}

int comm_nccl_version(int *version, char *why, size_t len)
{
    pthread_once(&lib_once, lib_load);
    if (lib_err) {
        snprintf(why, len, "%s", lib_why);
        return lib_err;
    }
    ncclResult_t r = lib.GetVersion(version);
    if (r != ncclSuccess) {
        snprintf(why, len, "ncclGetVersion: %s", lib.GetErrorString(r));
        return -EIO;
    }
    return 0;
}

bool nccl_built(void)
{
    return true;
}

static int nccl_errno(ncclResult_t r, const char *what)
{
    log_error("comm: %s: %s", what, lib.GetErrorString(r));
    return r == ncclInvalidArgument || r == ncclInvalidUsage ? -EINVAL : -EIO;
}

static int cuda_err(cudaError_t e, const char *what)
{
    log_error("comm: %s: %s", what, cudaGetErrorString(e));
    cudaGetLastError();
    return e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
}

int nccl_unique_id(uint8_t *id)
{
    int e = lib_ready();
    if (e) return e;
    ncclUniqueId u;
    ncclResult_t r = lib.GetUniqueId(&u);
    if (r != ncclSuccess) return nccl_errno(r, "ncclGetUniqueId");
    memcpy(id, &u, sizeof(u));
    return 0;
}

int nccl_open(const struct comm_opts *o, const uint8_t *id, struct nccl **out)
{
    int le = lib_ready();
    if (le) return le;
    struct nccl *n = calloc(1, sizeof(*n));
    if (!n) return -ENOMEM;
    n->device = o->cuda_device;
    n->world = o->world;
    n->rank = o->rank;
    int r = 0;
    cudaError_t e = cudaSetDevice(n->device);
    if (e != cudaSuccess) {
        r = cuda_err(e, "cudaSetDevice");
        goto err;
    }
    e = cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        n->stream = NULL;
        r = cuda_err(e, "cudaStreamCreateWithFlags");
        goto err;
    }
    ncclUniqueId u;
    memcpy(&u, id, sizeof(u));
    ncclResult_t nr = lib.CommInitRank(&n->comm, o->world, u, o->rank);
    if (nr != ncclSuccess) {
        n->comm = NULL;
        r = nccl_errno(nr, "ncclCommInitRank");
        goto err;
    }
    *out = n;
    return 0;
err:
    nccl_close(n);
    return r;
}

void nccl_bind_thread(struct nccl *n)
{
    if (cudaSetDevice(n->device) != cudaSuccess) cudaGetLastError();
}

static ncclDataType_t nccl_type(enum comm_dtype dt)
{
    return dt == COMM_F32 ? ncclFloat32 : ncclUint8;
}

/* Polls the stream until the operation has finished, the communicator fails, or a peer is
 * found dead (then the NCCL communicator is aborted: its kernels return). */
static int wait_stream(struct nccl *n, struct shm *rdv)
{
    for (unsigned i = 0;; i++) {
        cudaError_t e = cudaStreamQuery(n->stream);
        if (e != cudaSuccess && e != cudaErrorNotReady) return cuda_err(e, "cudaStreamQuery");
        /* A collective that a peer's abort ended returns on the stream like one that ran:
         * the communicator's error says which it was. */
        ncclResult_t ae = ncclSuccess;
        lib.CommGetAsyncError(n->comm, &ae);
        if (e == cudaSuccess && (ae == ncclSuccess || ae == ncclInProgress)) return 0;
        int r = ae != ncclSuccess && ae != ncclInProgress ? nccl_errno(ae, "an NCCL operation")
                : i % 1024 == 1023                          ? shm_check(rdv)
                                                            : 0;
        if (!r && i % 1024 == 1023 && shm_op_late(rdv)) {
            shm_fail(rdv, "an NCCL collective did not finish within the communicator's "
                          "timeout (a rank stopped, or wedged)");
            r = -ETIMEDOUT;
        }
        if (r) {
            lib.CommAbort(n->comm);
            n->comm = NULL;
            n->aborted = true;
            return r;
        }
        struct timespec ts = {0, 20000}; /* 20 us */
        nanosleep(&ts, NULL);
    }
}

/* The point-to-point operations as one NCCL group, so that its sends and receives progress
 * together (a lone ncclSend may wait for its receiver): alltoall is a send and a receive
 * with every rank (this one too), sendrecv one of each. The group is ended whatever failed
 * inside it, as NCCL requires. */
static ncclResult_t p2p(struct nccl *n, const struct comm_req *q, ncclDataType_t t, int world)
{
    size_t bytes = q->count * comm_dtype_bytes(q->dtype);
    const char *send = q->send;
    char *recv = q->recv;
    ncclResult_t r = lib.GroupStart(), e;
    if (r != ncclSuccess) return r;
    switch (q->op) {
    case COMM_ALLTOALL:
        for (int p = 0; p < world && r == ncclSuccess; p++) {
            r = lib.Send(send + (size_t)p * bytes, q->count, t, p, n->comm, n->stream);
            if (r == ncclSuccess)
                r = lib.Recv(recv + (size_t)p * bytes, q->count, t, p, n->comm, n->stream);
        }
        break;
    case COMM_SEND:
        r = lib.Send(send, q->count, t, q->peer, n->comm, n->stream);
        break;
    case COMM_RECV:
        r = lib.Recv(recv, q->count, t, q->peer, n->comm, n->stream);
        break;
    case COMM_SENDRECV:
        r = lib.Send(send, q->count, t, q->peer, n->comm, n->stream);
        if (r == ncclSuccess) r = lib.Recv(recv, q->count, t, q->recv_peer, n->comm, n->stream);
        break;
    default:
        r = ncclInvalidArgument;
        break;
    }
    e = lib.GroupEnd();
    return r != ncclSuccess ? r : e;
}

/* A reduction over a 16-bit wire: send cast into the wire buffer, reduced there in place,
 * widened into recv, all on the rank's stream (after wait_event, which the caller waited
 * for). */
static int run_wire(struct nccl *n, const struct comm_req *q)
{
    bool scatter = q->op == COMM_REDUCE_SCATTER;
    size_t in = scatter ? q->count * (size_t)n->world : q->count, bytes = in * 2;
    if (bytes > n->wire_bytes) {
        if (n->wire) cudaFree(n->wire);
        n->wire = NULL;
        n->wire_bytes = 0;
        cudaError_t e = cudaMalloc(&n->wire, bytes);
        if (e != cudaSuccess) return cuda_err(e, "cudaMalloc of the 16-bit wire's buffer");
        n->wire_bytes = bytes;
    }
    enum kdtype kt = q->wire == COMM_WIRE_F16 ? KDT_F16 : KDT_BF16;
    ncclDataType_t t = q->wire == COMM_WIRE_F16 ? ncclFloat16 : ncclBfloat16;
    char *w = n->wire, *out = scatter ? w + (size_t)n->rank * q->count * 2 : w;
    int r = kernel_cast(w, kt, q->send, KDT_F32, in, n->stream);
    if (r < 0) return r;
    ncclResult_t x = scatter ? lib.ReduceScatter(w, out, q->count, t, ncclSum, n->comm, n->stream)
                             : lib.AllReduce(w, w, q->count, t, ncclSum, n->comm, n->stream);
    if (x != ncclSuccess) return nccl_errno(x, "an NCCL collective");
    return kernel_cast(q->recv, KDT_F32, out, kt, q->count, n->stream);
}

int nccl_run(struct nccl *n, struct shm *rdv, const struct comm_req *q)
{
    if (n->aborted) return -ECONNABORTED;
    ncclDataType_t t = nccl_type(q->dtype);
    ncclResult_t r = ncclSuccess;
    cudaError_t e;
    if (q->wait_event && q->op != COMM_BARRIER &&
        (e = cudaStreamWaitEvent(n->stream, (cudaEvent_t)q->wait_event, 0)) != cudaSuccess)
        return cuda_err(e, "cudaStreamWaitEvent");
    if (q->wire != COMM_WIRE_F32) {
        int x = run_wire(n, q);
        if (x < 0) return x;
        goto done;
    }
    switch (q->op) {
    case COMM_ALLGATHER:
        r = lib.AllGather(q->send, q->recv, q->count, t, n->comm, n->stream);
        break;
    case COMM_REDUCE_SCATTER:
        r = lib.ReduceScatter(q->send, q->recv, q->count, t, ncclSum, n->comm, n->stream);
        break;
    case COMM_ALLREDUCE:
        r = lib.AllReduce(q->send, q->recv, q->count, t, ncclSum, n->comm, n->stream);
        break;
    case COMM_BROADCAST:
        r = lib.Broadcast(q->recv, q->recv, q->count, t, q->root, n->comm, n->stream);
        break;
    case COMM_BARRIER:
        return shm_barrier(rdv);
    case COMM_ALLTOALL:
    case COMM_SEND:
    case COMM_RECV:
    case COMM_SENDRECV:
        r = p2p(n, q, t, n->world);
        break;
    }
    if (r != ncclSuccess) return nccl_errno(r, "an NCCL collective");
done:
    if (q->done_event && (e = cudaEventRecord((cudaEvent_t)q->done_event, n->stream)) != cudaSuccess)
        return cuda_err(e, "cudaEventRecord");
    return wait_stream(n, rdv);
}

void nccl_close(struct nccl *n)
{
    if (!n) return;
    if (n->comm) lib.CommDestroy(n->comm);
    if (n->stream) cudaStreamDestroy(n->stream);
    if (n->wire) cudaFree(n->wire);
    free(n);
}
#else
bool nccl_built(void)
{
    return false;
}

int comm_nccl_version(int *version, char *why, size_t len)
{
    (void)version;
    snprintf(why, len, "built without NCCL");
    return -ENOTSUP;
}

int nccl_unique_id(uint8_t *id)
{
    (void)id;
    return -ENOTSUP;
}

int nccl_open(const struct comm_opts *o, const uint8_t *id, struct nccl **out)
{
    (void)o, (void)id, (void)out;
    return -ENOTSUP;
}

void nccl_bind_thread(struct nccl *n)
{
    (void)n;
}

int nccl_run(struct nccl *n, struct shm *rdv, const struct comm_req *q)
{
    (void)n, (void)rdv, (void)q;
    return -ENOTSUP;
}

void nccl_close(struct nccl *n)
{
    (void)n;
}
#endif
