/*
 * emu_rt.cpp - a CPU emulation of the part of the CUDA runtime and cuBLAS that zinf uses,
 * so that the GPU test programs (the kernels against their CPU twins, the trainer on the
 * "GPU", the CUDA device tier and the pinned host pool) run, checked by ASan and UBSan, on
 * a machine without a GPU. The entry points are the real ones, declared by the CUDA
 * toolkit's headers; this file takes the place of libcudart and libcublas at link time.
 * run.sh in this folder builds and runs it.
 *
 * What is modelled:
 *   - One device, ordinal 0 (EMU_DEVICES=n: n ordinals of the same device). Device memory is
 *     host memory. cudaMalloc fills it with 0xff
 *     bytes, NaN in fp32, bf16 and fp16, so that reads of unwritten memory show. Every
 *     allocation is tracked, and copies, memsets and GEMMs check that their device side
 *     lies inside one allocation and their host side in none (a wrong cudaMemcpyKind
 *     aborts).
 *   - Each stream is a FIFO worker thread: kernels, copies, memsets and GEMMs are queued
 *     on it and run in order, asynchronously to the host; a synchronisation waits for the
 *     queue. Events mark a position in a stream's queue. The legacy default stream (0) is
 *     a stream too, with the implicit ordering against blocking streams that CUDA gives it
 *     (non-blocking streams ignore it).
 *   - cudaMemcpyAsync to or from pinned memory (cudaMallocHost, cudaHostRegister) is fully
 *     asynchronous. With pageable memory it behaves as the CUDA documentation says: H2D
 *     waits for the stream, stages the source and returns; D2H returns once done.
 *   - Kernels run one at a time in the process, on their stream's worker: block after
 *     block, the threads of a block as fibers switched at __syncthreads() and at warp
 *     shuffles. A barrier that can never complete (a divergent __syncthreads, a shuffle in
 *     a partial warp) aborts with a message.
 *   - cublasGemmEx widens its operands and computes each dot product in double (or in
 *     fp32 in plain order with EMU_GEMM_ACC=f32), queued on the handle's stream.
 *   - Stress modes, from the environment: EMU_JITTER_US=n delays every queued op by a
 *     random 0..n-1 us; EMU_SHUFFLE=1 runs blocks, and threads between barriers, in a
 *     random order; EMU_PROTECT=1 makes device memory inaccessible whenever no op runs.
 *     EMU_STATS=1 prints op counts at exit.
 *
 * Not modelled: FMA contraction, tensor cores and the fp32 accumulation order of real
 * GEMMs (results agree to rounding, not to the bit); concurrent kernels, and real overlap
 * of copies and kernels; host access to device pointers (it works here unless
 * EMU_PROTECT=1); more than one device; timing and performance. An API call zinf does not
 * make is absent (a link error), and a device attribute or launch shape it does not use
 * aborts rather than guess.
 */
#include "emu.h"

#include <pthread.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <type_traits>
#include <vector>

/* ASan must be told about every switch between fiber stacks (or it takes the other
 * stack's frames for overflows); without ASan the annotations are no-ops. */
#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_ASAN
static void switch_start(void **fake, const void *bottom, size_t size)
{
    __sanitizer_start_switch_fiber(fake, bottom, size);
}
static void switch_finish(void *fake, const void **bottom, size_t *size)
{
    __sanitizer_finish_switch_fiber(fake, bottom, size);
}
static void print_stack()
{
    __sanitizer_print_stack_trace();
}
#else
static void switch_start(void **, const void *, size_t) {}
static void switch_finish(void *, const void **, size_t *) {}
static void print_stack() {}
#endif

static std::atomic<unsigned long> emu_launches, emu_gemms;

[[noreturn]] static void emu_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "EMU: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    print_stack();
    abort();
}

static thread_local cudaError_t last_error = cudaSuccess;
static cudaError_t ret(cudaError_t e)
{
    if (e != cudaSuccess) last_error = e;
    return e;
}

/* ---- fibers: the threads of one block ------------------------------------------------ */

dim3 threadIdx, blockIdx, blockDim, gridDim;

/* Saves the callee-saved registers on the current stack and its stack pointer in *save,
 * then resumes the context whose stack pointer is `to`. x86-64 System V only. */
extern "C" void emu_switch(void **save, void *to);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch,.-emu_switch
)");

namespace
{
struct Fiber {
    void *sp = nullptr;    /* saved stack pointer while switched out */
    char *stack = nullptr; /* FIBER_STACK bytes above a guard page, reused by every block */
    void *fake = nullptr;  /* ASan's fake stack of this fiber */
    bool done = false;
};
/* A barrier of n threads: the generation advances when the last of them arrives. */
struct Bar {
    unsigned n = 0, count = 0, gen = 0;
};
const size_t FIBER_STACK = 256 << 10, GUARD = 4096;
} // namespace

/* One kernel runs at a time in the process: kernel_mu is held for a whole grid, and the
 * scheduler's state below is only touched under it. */
static std::mutex kernel_mu;
static std::vector<Fiber> &fibers = *new std::vector<Fiber>;
static void *sched_sp, *sched_fake;
static const void *sched_bottom;
static size_t sched_size;
static unsigned cur, alive;
static unsigned long progress;
static const std::function<void()> *cur_body;
static Bar block_bar;
static std::vector<Bar> &warp_bars = *new std::vector<Bar>;
static double warp_buf[32][32];

static void yield_to_sched()
{
    Fiber &f = fibers[cur];
    switch_start(&f.fake, sched_bottom, sched_size);
    emu_switch(&f.sp, sched_sp);
    switch_finish(f.fake, &sched_bottom, &sched_size);
}

static void fiber_entry()
{
    switch_finish(nullptr, &sched_bottom, &sched_size);
    (*cur_body)();
    fibers[cur].done = true;
    alive--;
    progress++;
    switch_start(nullptr, sched_bottom, sched_size);
    emu_switch(&fibers[cur].sp, sched_sp);
    __builtin_unreachable();
}

static void fiber_init(Fiber &f)
{
    if (!f.stack) {
        char *m = (char *)mmap(nullptr, FIBER_STACK + GUARD, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) emu_fail("cannot map a fiber stack");
        mprotect(m, GUARD, PROT_NONE); /* a stack overflow faults */
        f.stack = m + GUARD;
    }
    /* The previous thread's frames on this stack have returned and unpoisoned their
     * redzones, except fiber_entry's own at the top, which never returns. */
    ASAN_UNPOISON_MEMORY_REGION(f.stack + FIBER_STACK - 8192, 8192);
    uintptr_t top = ((uintptr_t)f.stack + FIBER_STACK) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = nullptr;             /* fiber_entry's return address: it never returns */
    *--sp = (void *)fiber_entry; /* where emu_switch's ret goes */
    for (int i = 0; i < 6; i++)
        *--sp = nullptr; /* rbp rbx r12-r15 */
    f.sp = sp;
    f.done = false;
    f.fake = nullptr;
}

static void bar_wait(Bar &b)
{
    unsigned g = b.gen;
    progress++;
    if (++b.count == b.n) {
        b.count = 0;
        b.gen++;
        return;
    }
    while (b.gen == g)
        yield_to_sched();
}

void __syncthreads()
{
    bar_wait(block_bar);
}

double emu_shfl_xor(double v, int o)
{
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (warp_bars[w].n != 32)
        emu_fail("__shfl_xor_sync with a full mask in a partial warp (%u lanes)", warp_bars[w].n);
    if (o < 0 || o > 31) emu_fail("__shfl_xor_sync lane mask %d", o);
    warp_buf[w][lane] = v;
    bar_wait(warp_bars[w]);
    double r = warp_buf[w][lane ^ (unsigned)o];
    bar_wait(warp_bars[w]);
    return r;
}

/* EMU_SHUFFLE=1: blocks run in a random order, and the threads of a block in a new random
 * order at every round between barriers, so a kernel that depends on an order CUDA does not
 * promise (a read of another thread's write without a barrier, one block's output read by
 * another) computes something else from run to run. */
static bool shuffle_on()
{
    static const bool on = getenv("EMU_SHUFFLE") && atoi(getenv("EMU_SHUFFLE"));
    return on;
}
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static unsigned rnd(unsigned n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (unsigned)(rng_state % n);
}
template <class T> static void shuffle(std::vector<T> &v)
{
    for (size_t i = v.size(); i > 1; i--)
        std::swap(v[i - 1], v[rnd((unsigned)i)]);
}
static std::vector<unsigned> &order = *new std::vector<unsigned>;

static void run_block(unsigned nt)
{
    for (unsigned t = 0; t < nt; t++)
        fiber_init(fibers[t]);
    alive = nt;
    order.resize(nt);
    for (unsigned t = 0; t < nt; t++)
        order[t] = t;
    while (alive) {
        unsigned long p0 = progress;
        if (shuffle_on()) shuffle(order);
        for (unsigned t : order) {
            if (fibers[t].done) continue;
            cur = t;
            threadIdx = dim3(t, 0, 0);
            switch_start(&sched_fake, fibers[t].stack, FIBER_STACK);
            emu_switch(&sched_sp, fibers[t].sp);
            switch_finish(sched_fake, nullptr, nullptr);
        }
        if (alive && progress == p0)
            emu_fail("deadlock in block (%u,%u): %u of %u threads wait at a barrier that the "
                     "others never reach (a divergent __syncthreads or shuffle?); %u wait at "
                     "__syncthreads",
                     blockIdx.x, blockIdx.y, alive, nt, block_bar.count);
    }
}

static void run_grid(dim3 g, dim3 b, const std::function<void()> &body)
{
    std::lock_guard<std::mutex> lk(kernel_mu);
    unsigned nt = b.x;
    if (fibers.size() < nt) fibers.resize(nt);
    blockDim = b;
    gridDim = g;
    cur_body = &body;
    block_bar = Bar{nt, 0, 0};
    warp_bars.assign((nt + 31) / 32, Bar{});
    for (unsigned w = 0; w < warp_bars.size(); w++)
        warp_bars[w].n = nt - 32 * w < 32 ? nt - 32 * w : 32;
    std::vector<std::pair<unsigned, unsigned>> blocks;
    blocks.reserve((size_t)g.x * g.y);
    for (unsigned by = 0; by < g.y; by++)
        for (unsigned bx = 0; bx < g.x; bx++)
            blocks.push_back({bx, by});
    if (shuffle_on()) shuffle(blocks);
    for (auto [bx, by] : blocks) {
        blockIdx = dim3(bx, by, 0);
        block_bar.count = 0;
        for (auto &w : warp_bars)
            w.count = 0;
        run_block(nt);
    }
    cur_body = nullptr;
}

/* ---- streams ------------------------------------------------------------------------- */

typedef std::function<void()> Op;
static void dev_enter();
static void dev_leave();
static std::atomic<unsigned long> ops_run, ops_h2d, ops_d2h, ops_d2d, ops_memset, ops_pinned;

/* EMU_JITTER_US=n: every queued op waits a random 0..n-1 microseconds before it runs, so
 * work lags the host and a missing synchronisation has a wide window to show. */
static void jitter()
{
    static const int max_us = [] {
        const char *e = getenv("EMU_JITTER_US");
        return e ? atoi(e) : 0;
    }();
    static thread_local unsigned seed = (unsigned)(uintptr_t)&seed;
    if (max_us > 0) usleep(rand_r(&seed) % (unsigned)max_us);
}

/* A stream: a FIFO of ops that its own worker thread runs in order. The op pushed as the
 * n-th (push() returns n) has run once done >= n; events and waits are such positions. */
struct CUstream_st {
    std::mutex mu;
    std::condition_variable work, idle;
    std::deque<Op> q;
    uint64_t enq = 0, done = 0; /* ops queued and finished so far */
    bool stop = false, blocking = false, is_null = false;
    std::thread th;

    void loop()
    {
        std::unique_lock<std::mutex> lk(mu);
        for (;;) {
            work.wait(lk, [&] { return !q.empty() || stop; });
            if (q.empty()) break;
            Op f = std::move(q.front());
            lk.unlock();
            jitter();
            dev_enter();
            f();
            dev_leave();
            ops_run++;
            lk.lock();
            q.pop_front();
            done++;
            idle.notify_all();
        }
    }
    uint64_t push(Op f)
    {
        std::lock_guard<std::mutex> lk(mu);
        q.push_back(std::move(f));
        work.notify_one();
        return ++enq;
    }
    uint64_t tail()
    {
        std::lock_guard<std::mutex> lk(mu);
        return enq;
    }
    void wait(uint64_t seq)
    {
        std::unique_lock<std::mutex> lk(mu);
        idle.wait(lk, [&] { return done >= seq; });
    }
    bool reached(uint64_t seq)
    {
        std::lock_guard<std::mutex> lk(mu);
        return done >= seq;
    }
    void drain()
    {
        wait(tail());
    }
};

/* The registries below are never destroyed: worker threads may outlive static destructors,
 * and LeakSanitizer must still see what they point to. A destroyed stream moves to the
 * graveyard and is never freed, because an event recorded on it may still name it. */
static std::mutex reg_mu;
static std::set<CUstream_st *> &streams = *new std::set<CUstream_st *>;
static std::vector<CUstream_st *> &graveyard = *new std::vector<CUstream_st *>;
static CUstream_st *null_st;

static CUstream_st *new_stream(bool blocking, bool is_null)
{
    CUstream_st *s = new CUstream_st;
    s->blocking = blocking;
    s->is_null = is_null;
    s->th = std::thread([s] { s->loop(); });
    return s;
}

static CUstream_st *null_stream()
{
    std::lock_guard<std::mutex> lk(reg_mu);
    if (!null_st) null_st = new_stream(true, true);
    return null_st;
}

static CUstream_st *resolve(cudaStream_t s)
{
    if (s == nullptr || s == cudaStreamLegacy) return null_stream();
    if (s == cudaStreamPerThread) emu_fail("cudaStreamPerThread is not emulated");
    std::lock_guard<std::mutex> lk(reg_mu);
    if (!streams.count(s)) emu_fail("stream %p is not a live stream (destroyed?)", (void *)s);
    return s;
}

/* Queues f on s with the legacy default stream's implicit ordering: work on the null stream
 * waits for what blocking streams have queued, and theirs for the null stream's. */
static uint64_t enqueue(CUstream_st *s, Op f)
{
    std::vector<std::pair<CUstream_st *, uint64_t>> waits;
    if (s->is_null) {
        std::lock_guard<std::mutex> lk(reg_mu);
        for (CUstream_st *b : streams)
            if (b->blocking) waits.push_back({b, b->tail()});
    } else if (s->blocking) {
        CUstream_st *n = null_stream();
        waits.push_back({n, n->tail()});
    }
    if (waits.empty()) return s->push(std::move(f));
    return s->push([waits, f] {
        for (auto &w : waits)
            w.first->wait(w.second);
        f();
    });
}

static void sync_all()
{
    std::vector<CUstream_st *> all;
    {
        std::lock_guard<std::mutex> lk(reg_mu);
        all.assign(streams.begin(), streams.end());
        if (null_st) all.push_back(null_st);
    }
    for (CUstream_st *s : all)
        s->drain();
}

void emu_launch(dim3 g, dim3 b, size_t shmem, cudaStream_t s, std::function<void()> body)
{
    emu_launches++;
    if (b.x == 0 || b.y == 0 || b.z == 0 || (unsigned long)b.x * b.y * b.z > 1024 || b.z > 64 ||
        g.x == 0 || g.x > 2147483647u || g.y == 0 || g.y > 65535 || g.z == 0 || g.z > 65535 ||
        shmem > 48 * 1024) {
        fprintf(stderr, "EMU: bad launch config grid (%u,%u,%u) block (%u,%u,%u)\n", g.x, g.y, g.z,
                b.x, b.y, b.z);
        last_error = cudaErrorInvalidConfiguration;
        return;
    }
    if (b.y != 1 || b.z != 1 || g.z != 1 || shmem != 0)
        emu_fail("launch shape not emulated: grid (%u,%u,%u) block (%u,%u,%u) shmem %zu", g.x, g.y,
                 g.z, b.x, b.y, b.z, shmem);
    enqueue(resolve(s), [g, b, body] { run_grid(g, b, body); });
}

void emu_enqueue(cudaStream_t s, std::function<void()> op)
{
    enqueue(resolve(s), std::move(op));
}

/* ---- memory -------------------------------------------------------------------------- */

/* The emulated device has EMU_TOTAL_BYTES of memory. An allocation larger than
 * EMU_FILL_MAX_BYTES is mapped and not NaN-filled (it reads as zeros). Under mem_mu:
 * dev_allocs maps each device allocation's start to its size, pinned maps each pinned host
 * range's start to its size and whether cudaMallocHost (rather than cudaHostRegister) made
 * it. */
static const size_t EMU_TOTAL_BYTES = 8ull << 30, EMU_FILL_MAX_BYTES = 1ull << 30;
static std::mutex mem_mu;
struct Alloc {
    size_t len;  /* bytes asked for */
    bool mapped; /* its own mapping (munmap), else aligned_alloc (free) */
};
static std::map<uintptr_t, Alloc> &dev_allocs = *new std::map<uintptr_t, Alloc>;
static std::map<uintptr_t, std::pair<size_t, bool>> &pinned =
    *new std::map<uintptr_t, std::pair<size_t, bool>>;
static size_t dev_used;

/* EMU_PROTECT=1: device allocations are their own mappings, made inaccessible (PROT_NONE)
 * whenever no queued op runs anywhere, so host code that dereferences a device pointer
 * faults, as it would on a GPU. Host accesses while some op runs slip through. */
static bool protect_on()
{
    static const bool on = getenv("EMU_PROTECT") && atoi(getenv("EMU_PROTECT"));
    return on;
}
static std::mutex prot_mu; /* taken before mem_mu where both are */
static unsigned ops_running;
static size_t page_round(size_t n)
{
    return (n + 4095) / 4096 * 4096;
}
static void protect_all(int prot) /* prot_mu and mem_mu held */
{
    for (auto &[a, al] : dev_allocs)
        if (mprotect((void *)a, page_round(al.len), prot) != 0)
            emu_fail("mprotect: %s", strerror(errno));
}
static void dev_enter()
{
    if (!protect_on()) return;
    std::lock_guard<std::mutex> lp(prot_mu);
    std::lock_guard<std::mutex> lk(mem_mu);
    if (ops_running++ == 0) protect_all(PROT_READ | PROT_WRITE);
}
static void dev_leave()
{
    if (!protect_on()) return;
    std::lock_guard<std::mutex> lp(prot_mu);
    std::lock_guard<std::mutex> lk(mem_mu);
    if (--ops_running == 0) protect_all(PROT_NONE);
}

template <class M> static typename M::iterator containing(M &m, const void *p)
{
    uintptr_t a = (uintptr_t)p;
    auto it = m.upper_bound(a);
    if (it == m.begin()) return m.end();
    --it;
    size_t len;
    if constexpr (std::is_same_v<typename M::mapped_type, Alloc>)
        len = it->second.len;
    else
        len = it->second.first;
    return a < it->first + (len ? len : 1) ? it : m.end();
}

/* 1: [p, p+n) lies in one device allocation; 0: it touches none; -1: partly. */
static int dev_where(const void *p, size_t n)
{
    std::lock_guard<std::mutex> lk(mem_mu);
    uintptr_t a = (uintptr_t)p;
    auto it = containing(dev_allocs, p);
    if (it != dev_allocs.end()) return a + n <= it->first + it->second.len ? 1 : -1;
    auto nx = dev_allocs.upper_bound(a);
    if (nx != dev_allocs.end() && nx->first < a + n) return -1;
    return 0;
}

static bool is_pinned(const void *p, size_t n)
{
    std::lock_guard<std::mutex> lk(mem_mu);
    auto it = containing(pinned, p);
    return it != pinned.end() && (uintptr_t)p + n <= it->first + it->second.first;
}

static void need_dev(const void *p, size_t n, const char *what)
{
    int w = dev_where(p, n);
    if (w != 1)
        emu_fail("%s: [%p, +%zu) is %s device memory", what, p, n,
                 w == 0 ? "not" : "partly outside");
}
static void need_host(const void *p, size_t n, const char *what)
{
    if (dev_where(p, n) != 0)
        emu_fail("%s: [%p, +%zu) should be host memory but touches a device allocation", what, p,
                 n);
}

void emu_need_device(const void *p, size_t n, const char *what)
{
    need_dev(p, n, what);
}

/* ---- process ------------------------------------------------------------------------- */

/* Threads do not survive fork() (Criterion runs each test in a child): a child starts
 * with no streams and with every lock of the emulator free. The parent's stream objects
 * are left alone. Work queued before the fork is not carried over, so a fork with
 * emulated work in flight is not supported. */
static void forget_after_fork()
{
    streams.clear();
    null_st = nullptr;
    new (&reg_mu) std::mutex;
    new (&kernel_mu) std::mutex;
    new (&prot_mu) std::mutex;
    new (&mem_mu) std::mutex;
    ops_running = 0;
}
static void print_stats()
{
    if (getenv("EMU_STATS"))
        fprintf(stderr,
                "EMU stats (pid %d): %lu ops run: %lu kernel launches, %lu GEMMs, copies %lu "
                "H2D %lu D2H %lu D2D (%lu of them pinned), %lu memsets\n",
                (int)getpid(), ops_run.load(), emu_launches.load(), emu_gemms.load(),
                ops_h2d.load(), ops_d2h.load(), ops_d2d.load(), ops_pinned.load(),
                ops_memset.load());
}
__attribute__((constructor)) static void emu_init()
{
    pthread_atfork(nullptr, nullptr, forget_after_fork);
    atexit(print_stats);
}

extern "C" {

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void)
{
    return last_error;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
#define N(x)                                                                                       \
    case x:                                                                                        \
        return #x;
        N(cudaSuccess)
        N(cudaErrorInvalidValue)
        N(cudaErrorMemoryAllocation)
        N(cudaErrorInvalidConfiguration)
        N(cudaErrorInvalidDevice)
        N(cudaErrorInvalidResourceHandle)
        N(cudaErrorNotReady)
        N(cudaErrorHostMemoryAlreadyRegistered)
        N(cudaErrorHostMemoryNotRegistered)
        N(cudaErrorNoDevice)
        N(cudaErrorInvalidDevicePointer)
#undef N
    default:
        return "cudaErrorUnknown";
    }
}
const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    case cudaErrorNotReady:
        return "device not ready";
    case cudaErrorHostMemoryAlreadyRegistered:
        return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered:
        return "pointer does not correspond to a registered memory region";
    default:
        return cudaGetErrorName(e);
    }
}

/* ---- API: device --------------------------------------------------------------------- */

static thread_local int cur_dev = 0;

/* EMU_DEVICES=n (1-8, default 1): the process sees n devices, ordinals 0..n-1, each on bus
 * 0000:0k:00.0, all of them the same emulated memory and streams (so that the ranks of
 * `zinf launch`, one per GPU, each take an ordinal of their own). */
static int emu_devices()
{
    static const int n = [] {
        const char *e = getenv("EMU_DEVICES");
        int v = e ? atoi(e) : 1;
        return v >= 1 && v <= 8 ? v : 1;
    }();
    return n;
}
static bool bad_dev(int d)
{
    return d < 0 || d >= emu_devices();
}

cudaError_t cudaGetDeviceCount(int *n)
{
    if (!n) return ret(cudaErrorInvalidValue);
    *n = emu_devices();
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int d)
{
    if (bad_dev(d)) return ret(cudaErrorInvalidDevice);
    cur_dev = d;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d)
{
    if (!d) return ret(cudaErrorInvalidValue);
    *d = cur_dev;
    return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int *v)
{
    if (!v) return ret(cudaErrorInvalidValue);
    *v = 13000;
    return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v)
{
    if (!v) return ret(cudaErrorInvalidValue);
    *v = CUDART_VERSION;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d)
{
    if (!p) return ret(cudaErrorInvalidValue);
    if (bad_dev(d)) return ret(cudaErrorInvalidDevice);
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "EMU CPU-emulated GPU");
    p->totalGlobalMem = EMU_TOTAL_BYTES;
    p->sharedMemPerBlock = 48 * 1024;
    p->regsPerBlock = 65536;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = 1024;
    p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = 65535;
    p->maxGridSize[2] = 65535;
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 132;
    p->asyncEngineCount = 2;
    p->unifiedAddressing = 1;
    p->pciBusID = 1 + d;
    p->canMapHostMemory = 1;
    p->concurrentKernels = 1;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int d)
{
    if (!v) return ret(cudaErrorInvalidValue);
    if (bad_dev(d)) return ret(cudaErrorInvalidDevice);
    switch (a) {
    case cudaDevAttrComputeCapabilityMajor:
        *v = 9;
        break;
    case cudaDevAttrComputeCapabilityMinor:
        *v = 0;
        break;
    case cudaDevAttrMultiProcessorCount:
        *v = 132;
        break;
    case cudaDevAttrWarpSize:
        *v = 32;
        break;
    case cudaDevAttrMaxThreadsPerBlock:
        *v = 1024;
        break;
    case cudaDevAttrPciBusId:
        *v = 1;
        break;
    case cudaDevAttrPciDeviceId:
    case cudaDevAttrPciDomainId:
        *v = 0;
        break;
    default:
        emu_fail("cudaDeviceGetAttribute %d not emulated", (int)a);
    }
    return cudaSuccess;
}
cudaError_t cudaDeviceGetPCIBusId(char *buf, int len, int d)
{
    if (!buf || len <= 0) return ret(cudaErrorInvalidValue);
    if (bad_dev(d)) return ret(cudaErrorInvalidDevice);
    snprintf(buf, (size_t)len, "0000:%02x:00.0", 1 + d);
    return cudaSuccess;
}
cudaError_t cudaDeviceGetByPCIBusId(int *d, const char *bus)
{
    if (!d || !bus) return ret(cudaErrorInvalidValue);
    unsigned b = 0;
    int end = 0;
    if (sscanf(bus, "0000:%2x:00.0%n", &b, &end) != 1 || bus[end] || bad_dev((int)b - 1))
        return ret(cudaErrorInvalidDevice);
    *d = (int)b - 1;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    if (!free_bytes || !total_bytes) return ret(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lk(mem_mu);
    *total_bytes = EMU_TOTAL_BYTES;
    *free_bytes = EMU_TOTAL_BYTES - dev_used;
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void)
{
    sync_all();
    return cudaSuccess;
}

/* ---- API: memory --------------------------------------------------------------------- */

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    if (!p) return ret(cudaErrorInvalidValue);
    *p = nullptr;
    if (bytes == 0) return cudaSuccess;
    size_t len = (bytes + 255) / 256 * 256;
    {
        std::lock_guard<std::mutex> lk(mem_mu);
        if (len > EMU_TOTAL_BYTES - dev_used) return ret(cudaErrorMemoryAllocation);
        dev_used += len;
    }
    bool mapped = len > EMU_FILL_MAX_BYTES || protect_on();
    void *m;
    if (mapped) {
        m = mmap(nullptr, page_round(len), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) m = nullptr;
        if (m && len <= EMU_FILL_MAX_BYTES) memset(m, 0xff, len);
        if (m && len > EMU_FILL_MAX_BYTES) {
            /* Too large to fill: reads as zeros, not NaN. */
            static bool said;
            if (!said) fprintf(stderr, "EMU: cudaMalloc of %zu bytes is not NaN-filled\n", bytes);
            said = true;
        }
    } else {
        m = aligned_alloc(256, len);
        if (m) memset(m, 0xff, len); /* NaN in fp32, bf16 and fp16: unwritten reads show */
    }
    std::unique_lock<std::mutex> lp(prot_mu, std::defer_lock);
    if (protect_on()) lp.lock();
    std::lock_guard<std::mutex> lk(mem_mu);
    if (m && protect_on() && ops_running == 0) mprotect(m, page_round(len), PROT_NONE);
    if (!m) {
        dev_used -= len;
        return ret(cudaErrorMemoryAllocation);
    }
    dev_allocs[(uintptr_t)m] = Alloc{bytes, mapped};
    *p = m;
    return cudaSuccess;
}
cudaError_t cudaFree(void *p)
{
    if (!p) return cudaSuccess;
    /* cudaFree synchronises the device before it frees. */
    sync_all();
    std::lock_guard<std::mutex> lk(mem_mu);
    auto it = dev_allocs.find((uintptr_t)p);
    if (it == dev_allocs.end()) emu_fail("cudaFree(%p): not a device allocation", p);
    size_t len = (it->second.len + 255) / 256 * 256;
    if (it->second.mapped)
        munmap(p, page_round(len));
    else
        free(p);
    dev_used -= len;
    dev_allocs.erase(it);
    return cudaSuccess;
}
/* CUDA IPC within this process (the emulated device is this process's memory): a handle
 * names the allocation by its address, and opening it gives that address back. Enough for
 * the service's daemon and client when they run in one test program. */
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p)
{
    if (!h || !p) return ret(cudaErrorInvalidValue);
    {
        std::lock_guard<std::mutex> lk(mem_mu);
        if (dev_allocs.find((uintptr_t)p) == dev_allocs.end()) return ret(cudaErrorInvalidValue);
    }
    memset(h, 0, sizeof(*h));
    memcpy(h->reserved, &p, sizeof(p));
    return cudaSuccess;
}
cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags)
{
    (void)flags;
    if (!p) return ret(cudaErrorInvalidValue);
    void *a;
    memcpy(&a, h.reserved, sizeof(a));
    std::lock_guard<std::mutex> lk(mem_mu);
    if (dev_allocs.find((uintptr_t)a) == dev_allocs.end()) return ret(cudaErrorInvalidValue);
    *p = a;
    return cudaSuccess;
}
cudaError_t cudaIpcCloseMemHandle(void *p)
{
    return p ? cudaSuccess : ret(cudaErrorInvalidValue);
}
cudaError_t cudaMallocHost(void **p, size_t bytes)
{
    if (!p) return ret(cudaErrorInvalidValue);
    *p = nullptr;
    if (bytes == 0) return cudaSuccess;
    void *m = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (!m) return ret(cudaErrorMemoryAllocation);
    memset(m, 0xa5, bytes); /* not zeros: the program must write what it reads */
    std::lock_guard<std::mutex> lk(mem_mu);
    pinned[(uintptr_t)m] = {bytes, true};
    *p = m;
    return cudaSuccess;
}
cudaError_t cudaFreeHost(void *p)
{
    if (!p) return cudaSuccess;
    sync_all();
    std::lock_guard<std::mutex> lk(mem_mu);
    auto it = pinned.find((uintptr_t)p);
    if (it == pinned.end() || !it->second.second)
        emu_fail("cudaFreeHost(%p): not from cudaMallocHost", p);
    pinned.erase(it);
    free(p);
    return cudaSuccess;
}
cudaError_t cudaHostRegister(void *p, size_t len, unsigned flags)
{
    if (!p || len == 0) return ret(cudaErrorInvalidValue);
    if (dev_where(p, len) != 0) emu_fail("cudaHostRegister of device memory");
    std::lock_guard<std::mutex> lk(mem_mu);
    uintptr_t a = (uintptr_t)p;
    auto it = containing(pinned, p);
    auto nx = pinned.upper_bound(a);
    if (it != pinned.end() || (nx != pinned.end() && nx->first < a + len))
        return ret(cudaErrorHostMemoryAlreadyRegistered);
    pinned[a] = {len, false};
    return cudaSuccess;
}
cudaError_t cudaHostUnregister(void *p)
{
    std::lock_guard<std::mutex> lk(mem_mu);
    auto it = pinned.find((uintptr_t)p);
    if (!p || it == pinned.end() || it->second.second) return ret(cudaErrorHostMemoryNotRegistered);
    pinned.erase(it);
    return cudaSuccess;
}

static enum cudaMemcpyKind check_kind(void *d, const void *s, size_t n, enum cudaMemcpyKind k,
                                      const char *what)
{
    if (k == cudaMemcpyDefault) {
        int dd = dev_where(d, n), sd = dev_where(s, n);
        if (dd < 0 || sd < 0) emu_fail("%s: a range straddles a device allocation", what);
        k = dd ? (sd ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
               : (sd ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
    }
    switch (k) {
    case cudaMemcpyHostToDevice:
        need_dev(d, n, what);
        need_host(s, n, what);
        break;
    case cudaMemcpyDeviceToHost:
        need_host(d, n, what);
        need_dev(s, n, what);
        break;
    case cudaMemcpyDeviceToDevice:
        need_dev(d, n, what);
        need_dev(s, n, what);
        break;
    case cudaMemcpyHostToHost:
        need_host(d, n, what);
        need_host(s, n, what);
        break;
    default:
        emu_fail("%s: kind %d", what, (int)k);
    }
    return k;
}

static void copy_op(void *d, const void *s, size_t n)
{
    if ((const char *)d < (const char *)s + n && (const char *)s < (const char *)d + n && d != s)
        emu_fail("copy between overlapping ranges %p %p %zu", d, s, n);
    memcpy(d, s, n);
}

cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k,
                            cudaStream_t st)
{
    if (n == 0) return cudaSuccess;
    if (!d || !s) return ret(cudaErrorInvalidValue);
    k = check_kind(d, s, n, k, "cudaMemcpyAsync");
    CUstream_st *q = resolve(st);
    (k == cudaMemcpyHostToDevice ? ops_h2d : k == cudaMemcpyDeviceToHost ? ops_d2h : ops_d2d)++;
    if ((k == cudaMemcpyHostToDevice && is_pinned(s, n)) ||
        (k == cudaMemcpyDeviceToHost && is_pinned(d, n)))
        ops_pinned++;
    if (k == cudaMemcpyHostToDevice && !is_pinned(s, n)) {
        /* Pageable source: the stream is synchronised, the source staged, and the call
         * returns before the copy to the device is done. */
        q->drain();
        std::shared_ptr<char[]> stage(new char[n]);
        memcpy(stage.get(), s, n);
        enqueue(q, [d, stage, n] { memcpy(d, stage.get(), n); });
        return cudaSuccess;
    }
    uint64_t seq = enqueue(q, [d, s, n] { copy_op(d, s, n); });
    if ((k == cudaMemcpyDeviceToHost && !is_pinned(d, n)) || k == cudaMemcpyHostToHost)
        q->wait(seq); /* a pageable destination, or host to host: synchronous */
    return cudaSuccess;
}
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k)
{
    if (n == 0) return cudaSuccess;
    if (!d || !s) return ret(cudaErrorInvalidValue);
    check_kind(d, s, n, k, "cudaMemcpy");
    CUstream_st *q = null_stream();
    q->wait(enqueue(q, [d, s, n] { copy_op(d, s, n); }));
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st)
{
    if (n == 0) return cudaSuccess;
    need_dev(d, n, "cudaMemsetAsync");
    ops_memset++;
    enqueue(resolve(st), [d, v, n] { memset(d, v, n); });
    return cudaSuccess;
}
cudaError_t cudaMemset(void *d, int v, size_t n)
{
    /* Asynchronous to the host for device memory, on the legacy stream. */
    return cudaMemsetAsync(d, v, n, nullptr);
}

/* ---- API: streams -------------------------------------------------------------------- */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    if (!s || (flags & ~cudaStreamNonBlocking)) return ret(cudaErrorInvalidValue);
    CUstream_st *x = new_stream(!(flags & cudaStreamNonBlocking), false);
    std::lock_guard<std::mutex> lk(reg_mu);
    streams.insert(x);
    *s = x;
    return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}
cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (!s || s == cudaStreamLegacy) return ret(cudaErrorInvalidResourceHandle);
    CUstream_st *x = resolve(s);
    {
        std::lock_guard<std::mutex> lk(reg_mu);
        streams.erase(x);
        graveyard.push_back(x);
    }
    /* Queued work still completes; then the worker leaves. */
    {
        std::lock_guard<std::mutex> lk(x->mu);
        x->stop = true;
        x->work.notify_all();
    }
    x->th.join();
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    resolve(s)->drain();
    return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s)
{
    CUstream_st *x = resolve(s);
    return x->reached(x->tail()) ? cudaSuccess : cudaErrorNotReady;
}

/* ---- API: events --------------------------------------------------------------------- */

namespace
{
struct EvState {
    std::mutex mu;
    CUstream_st *s = nullptr;
    uint64_t seq = 0, gen = 0;
    double t = 0;
};
} // namespace
struct CUevent_st {
    unsigned flags;
    std::shared_ptr<EvState> st;
};
static std::set<CUevent_st *> &events = *new std::set<CUevent_st *>;

static CUevent_st *ev_of(cudaEvent_t e)
{
    std::lock_guard<std::mutex> lk(reg_mu);
    if (!events.count(e)) emu_fail("event %p is not a live event", (void *)e);
    return e;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    if (!e || (flags & ~(cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess)))
        return ret(cudaErrorInvalidValue);
    CUevent_st *x = new CUevent_st{flags, std::make_shared<EvState>()};
    std::lock_guard<std::mutex> lk(reg_mu);
    events.insert(x);
    *e = x;
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    return cudaEventCreateWithFlags(e, cudaEventDefault);
}
cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    if (!e) return ret(cudaErrorInvalidResourceHandle);
    ev_of(e);
    {
        std::lock_guard<std::mutex> lk(reg_mu);
        events.erase(e);
    }
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    CUevent_st *x = ev_of(e);
    CUstream_st *q = resolve(s);
    std::shared_ptr<EvState> st = x->st;
    std::lock_guard<std::mutex> lk(st->mu);
    uint64_t gen = ++st->gen;
    st->s = q;
    st->seq = enqueue(q, [st, gen] {
        std::lock_guard<std::mutex> l(st->mu);
        if (st->gen == gen)
            st->t =
                std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
                    .count();
    });
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    std::shared_ptr<EvState> st = ev_of(e)->st;
    CUstream_st *q;
    uint64_t seq;
    {
        std::lock_guard<std::mutex> lk(st->mu);
        q = st->s;
        seq = st->seq;
    }
    if (q) q->wait(seq);
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e)
{
    std::shared_ptr<EvState> st = ev_of(e)->st;
    std::lock_guard<std::mutex> lk(st->mu);
    return !st->s || st->s->reached(st->seq) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    CUevent_st *x = ev_of(a), *y = ev_of(b);
    if (!ms || (x->flags | y->flags) & cudaEventDisableTiming)
        return ret(cudaErrorInvalidResourceHandle);
    if (cudaEventQuery(a) != cudaSuccess || cudaEventQuery(b) != cudaSuccess)
        return ret(cudaErrorNotReady);
    *ms = (float)((y->st->t - x->st->t) * 1e3);
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    CUstream_st *q = resolve(s);
    std::shared_ptr<EvState> st = ev_of(e)->st;
    CUstream_st *src;
    uint64_t seq;
    {
        std::lock_guard<std::mutex> lk(st->mu);
        src = st->s;
        seq = st->seq;
    }
    if (src) enqueue(q, [src, seq] { src->wait(seq); });
    return cudaSuccess;
}

/* ---- API: cuBLAS --------------------------------------------------------------------- */

struct cublasContext {
    cudaStream_t s;
    cublasPointerMode_t pm;
    cublasMath_t mm;
};
static std::set<cublasContext *> &handles = *new std::set<cublasContext *>;

static cublasContext *h_of(cublasHandle_t h)
{
    std::lock_guard<std::mutex> lk(reg_mu);
    if (!handles.count(h)) emu_fail("cuBLAS handle %p is not live", (void *)h);
    return h;
}

cublasStatus_t cublasCreate_v2(cublasHandle_t *h)
{
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    cublasContext *c = new cublasContext{nullptr, CUBLAS_POINTER_MODE_HOST, CUBLAS_DEFAULT_MATH};
    std::lock_guard<std::mutex> lk(reg_mu);
    handles.insert(c);
    *h = c;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h)
{
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h_of(h);
    sync_all(); /* cublasDestroy synchronises the device */
    std::lock_guard<std::mutex> lk(reg_mu);
    handles.erase(h);
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m)
{
    h_of(h)->mm = m;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetMathMode(cublasHandle_t h, cublasMath_t *m)
{
    *m = h_of(h)->mm;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s)
{
    if (s) resolve(s);
    h_of(h)->s = s;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream_v2(cublasHandle_t h, cudaStream_t *s)
{
    *s = h_of(h)->s;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t h, cublasPointerMode_t m)
{
    if (m != CUBLAS_POINTER_MODE_HOST && m != CUBLAS_POINTER_MODE_DEVICE)
        return CUBLAS_STATUS_INVALID_VALUE;
    h_of(h)->pm = m;
    return CUBLAS_STATUS_SUCCESS;
}

void emu_gemm_core(int m, int n, int k, const double *A, const double *B, double *out, int acc32);

static double rd(const void *p, cudaDataType_t t, size_t i)
{
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    if (t == CUDA_R_16F) return __half2float(((const __half *)p)[i]);
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}
/* The epilogue's fp32 value rounded once into C's type, as cuBLAS stores it. */
static void wr(void *p, cudaDataType_t t, size_t i, float v)
{
    if (t == CUDA_R_32F)
        ((float *)p)[i] = v;
    else if (t == CUDA_R_16F)
        ((__half *)p)[i] = __float2half(v);
    else
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16(v);
}
static size_t tbytes(cudaDataType_t t)
{
    return t == CUDA_R_32F ? 4 : 2;
}
static float tf32(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & ~0x1fffu; /* 10 mantissa bits */
    memcpy(&x, &u, 4);
    return x;
}

/* Column-major: op(A) (m,k), op(B) (k,n), C (m,n); element (i,j) of X at X[i + j*ld]. */
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType_t at,
                            int lda, const void *B, cudaDataType_t bt, int ldb, const void *beta,
                            void *C, cudaDataType_t ct, int ldc, cublasComputeType_t comp,
                            cublasGemmAlgo_t algo)
{
    emu_gemms++;
    cublasContext *hc = h_of(h);
    if (comp != CUBLAS_COMPUTE_32F) emu_fail("cublasGemmEx compute type %d", comp);
    if ((ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T))
        emu_fail("cublasGemmEx op %d %d", ta, tb);
    if (at != bt || !((at == CUDA_R_32F && ct == CUDA_R_32F) ||
                      (at == CUDA_R_16BF && (ct == CUDA_R_32F || ct == CUDA_R_16BF)) ||
                      (at == CUDA_R_16F && (ct == CUDA_R_32F || ct == CUDA_R_16F))))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m < 0 || n < 0 || k < 0 || lda < (ta == CUBLAS_OP_N ? m : k) ||
        ldb < (tb == CUBLAS_OP_N ? k : n) || ldc < m || lda < 1 || ldb < 1 || ldc < 1) {
        fprintf(stderr, "EMU: gemm invalid value m %d n %d k %d lda %d ldb %d ldc %d\n", m, n, k,
                lda, ldb, ldc);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    int arows = ta == CUBLAS_OP_N ? m : k, acols = ta == CUBLAS_OP_N ? k : m;
    int brows = tb == CUBLAS_OP_N ? k : n, bcols = tb == CUBLAS_OP_N ? n : k;
    if (k > 0) {
        need_dev(A, ((size_t)(acols - 1) * lda + arows) * tbytes(at), "cublasGemmEx A");
        need_dev(B, ((size_t)(bcols - 1) * ldb + brows) * tbytes(bt), "cublasGemmEx B");
    }
    need_dev(C, ((size_t)(n - 1) * ldc + m) * tbytes(ct), "cublasGemmEx C");
    bool dev_scalars = hc->pm == CUBLAS_POINTER_MODE_DEVICE;
    if (dev_scalars) {
        need_dev(alpha, 4, "cublasGemmEx alpha");
        need_dev(beta, 4, "cublasGemmEx beta");
    }
    float a = dev_scalars ? 0 : *(const float *)alpha, b = dev_scalars ? 0 : *(const float *)beta;
    bool round_tf32 = at == CUDA_R_32F && (hc->mm & 0xf) == CUBLAS_TF32_TENSOR_OP_MATH;
    const char *acc = getenv("EMU_GEMM_ACC");
    int acc32 = acc && !strcmp(acc, "f32");
    enqueue(resolve(hc->s), [=] {
        float al = dev_scalars ? *(const float *)alpha : a,
              be = dev_scalars ? *(const float *)beta : b;
        std::vector<double> Ad((size_t)m * k), Bd((size_t)n * k), out((size_t)m * n);
        for (int i = 0; i < m; i++)
            for (int l = 0; l < k; l++) {
                double x = ta == CUBLAS_OP_N ? rd(A, at, i + (size_t)l * lda)
                                             : rd(A, at, l + (size_t)i * lda);
                Ad[(size_t)i * k + l] = round_tf32 ? tf32((float)x) : x;
            }
        for (int j = 0; j < n; j++)
            for (int l = 0; l < k; l++) {
                double y = tb == CUBLAS_OP_N ? rd(B, bt, l + (size_t)j * ldb)
                                             : rd(B, bt, j + (size_t)l * ldb);
                Bd[(size_t)j * k + l] = round_tf32 ? tf32((float)y) : y;
            }
        emu_gemm_core(m, n, k, Ad.data(), Bd.data(), out.data(), acc32);
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                size_t ci = i + (size_t)j * ldc;
                /* With beta == 0, C is not read (it may hold NaN), as cuBLAS promises.
                 * The epilogue is in fp32. */
                float s = (float)out[i + (size_t)j * m];
                float c = be == 0.0f ? 0.0f : be * (float)rd(C, ct, ci);
                wr(C, ct, ci, al * s + c);
            }
    });
    return CUBLAS_STATUS_SUCCESS;
}

} /* extern "C" */
