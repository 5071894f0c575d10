/*
 * test_host.c - host.h: the arena and its sub-allocator, the staging area, pinning (and
 * the RLIMIT_MEMLOCK failure, provoked for real), NUMA placement, io_uring fixed-buffer
 * registration with real IO into the arena, and the device tier's registration.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <numa.h>
#include <numaif.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"
#include "helpers.h"
#include "io/uring.h"
#include "tiers/cuda_probe.h"
#include "tiers/device.h"
#include "tiers/host.h"

#define CAP (16 * MiB)

/* AddressSanitizer turns mlock() into a no-op that succeeds: nothing is locked or faulted
 * in, so what the kernel reports about locked memory cannot be checked there. */
#if defined(__SANITIZE_ADDRESS__)
#define SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SANITIZED 1
#endif
#endif
#ifndef SANITIZED
#define SANITIZED 0
#endif

static struct host *open_host(size_t cap, size_t staging, bool pin)
{
    struct host_opts o = {
        .capacity_bytes = cap, .staging_bytes = staging, .pin = pin, .numa_node = -1};
    struct host *h = NULL;
    int r = host_open(&o, &h);
    cr_assert_eq(r, 0, "host_open: %s", strerror(-r));
    cr_assert_not_null(h);
    return h;
}

static size_t used(struct host *h)
{
    struct host_stats st;
    host_get_stats(h, &st);
    return st.used_bytes;
}

static unsigned count_lines(const char *s)
{
    unsigned n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* Locked memory of this process, from /proc/self/status, in bytes. */
static size_t vm_locked(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    size_t kb = 0;

    cr_assert(f);
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmLck: %zu kB", &kb) == 1) break;
    fclose(f);
    return kb * KiB;
}

TestSuite(host, .fini = test_leak_check);

Test(host, alloc_free_and_pointers)
{
    struct host *h = open_host(CAP, 0, false);
    char *base = host_ptr(h, 0);
    uint64_t a, b, c;

    cr_assert_eq(host_alloc(h, 4096, &a), 0);
    cr_assert_eq(host_alloc(h, MiB, &b), 0);
    cr_assert_eq(host_alloc(h, 5000, &c), 0, "rounded up to 8 KiB");
    cr_assert_eq(used(h), 4096 + MiB + 8192);
    uint64_t offs[] = {a, b, c};
    for (size_t i = 0; i < ARRAY_SIZE(offs); i++) {
        char *p = host_ptr(h, offs[i]);
        cr_assert_eq(p, base + offs[i]);
        cr_assert(is_aligned((uintptr_t)p, ZINF_ALIGN), "%p", (void *)p);
        cr_assert(p >= base && p < base + CAP);
    }
    /* The memory is there and the allocations do not overlap. */
    memset(host_ptr(h, a), 0xa1, 4096);
    memset(host_ptr(h, b), 0xb2, MiB);
    memset(host_ptr(h, c), 0xc3, 5000);
    cr_assert_eq(((unsigned char *)host_ptr(h, a))[4095], 0xa1);
    cr_assert_eq(((unsigned char *)host_ptr(h, b))[MiB - 1], 0xb2);
    cr_assert(is_aligned((uintptr_t)base, ZINF_ALIGN));

    cr_assert_eq(host_free(h, b), 0);
    cr_assert_eq(used(h), 4096 + 8192);
    cr_assert_eq(host_free(h, a), 0);
    cr_assert_eq(host_free(h, c), 0);
    cr_assert_eq(used(h), 0);
    host_close(h);
}

/* Room freed and taken again, as a step's sets are, stays in the pages used so far: a
 * hundred rounds of two 1 MiB sets never reach past the first 2 MiB of the arena, where
 * next fit over the whole arena would walk through all of it (faulting in each page). */
Test(host, freed_room_is_taken_again_before_untouched_room)
{
    struct host *h = open_host(CAP, 0, false);
    uint64_t x, y, end = 0;
    for (int i = 0; i < 100; i++) {
        cr_assert_eq(host_alloc(h, MiB, &x), 0);
        cr_assert_eq(host_alloc(h, MiB, &y), 0);
        end = MAX(end, MAX(x, y) + MiB);
        cr_assert_eq(host_free(h, x), 0);
        cr_assert_eq(host_free(h, y), 0);
    }
    cr_assert_eq(end, 2 * MiB, "the sets reached %llu bytes into the arena",
                 (unsigned long long)end);
    host_close(h);
}

Test(host, bad_input)
{
    struct host_opts o = {.capacity_bytes = CAP, .numa_node = -1};
    struct host *h = (struct host *)1;
    uint64_t off;

    cr_assert_eq(host_open(NULL, &h), -EINVAL);
    cr_assert_null(h);
    cr_assert_eq(host_open(&o, NULL), -EINVAL);
    o.numa_node = -2;
    cr_assert_eq(host_open(&o, &h), -EINVAL);
    o.numa_node = -1;
    o.capacity_bytes = SIZE_MAX - 100;
    cr_assert_eq(host_open(&o, &h), -EINVAL);

    h = open_host(CAP, 0, false);
    cr_assert_eq(host_alloc(h, 0, &off), -EINVAL);
    cr_assert_eq(host_alloc(h, 4096, NULL), -EINVAL);
    cr_assert_eq(host_alloc(NULL, 4096, &off), -EINVAL);
    cr_assert_eq(host_free(h, 0), -EINVAL, "nothing allocated there");
    cr_assert_eq(host_alloc(h, 8192, &off), 0);
    cr_assert_eq(host_free(h, off + 4096), -EINVAL, "inside, not the start");
    cr_assert_eq(host_free(h, off), 0);
    cr_assert_eq(host_free(h, off), -EINVAL, "double free");
    cr_assert_eq(host_free(NULL, 0), -EINVAL);
    cr_assert_null(host_ptr(h, CAP));
    cr_assert_null(host_ptr(h, UINT64_MAX));
    cr_assert_null(host_ptr(NULL, 0));
    cr_assert_null(host_staging(NULL));
    cr_assert_eq(used(h), 0);
    host_close(h);
    host_close(NULL);
}

Test(host, enospc_and_coalescing)
{
    struct host *h = open_host(CAP, 0, false);
    uint64_t q[4], whole, off;

    cr_assert_eq(host_alloc(h, CAP, &whole), 0);
    cr_assert_eq(whole, 0);
    cr_assert_eq(host_alloc(h, 4096, &off), -ENOSPC);
    cr_assert_eq(host_free(h, whole), 0);
    cr_assert_eq(host_alloc(h, CAP + 4096, &off), -ENOSPC);

    for (int i = 0; i < 4; i++)
        cr_assert_eq(host_alloc(h, CAP / 4, &q[i]), 0);
    cr_assert_eq(used(h), CAP);
    /* Two free quarters that are not neighbours: half the space, no half-sized hole. */
    cr_assert_eq(host_free(h, q[0]), 0);
    cr_assert_eq(host_free(h, q[2]), 0);
    cr_assert_eq(used(h), CAP / 2);
    cr_assert_eq(host_alloc(h, CAP / 2, &off), -ENOSPC);
    /* Freeing the quarter between them joins all three. */
    cr_assert_eq(host_free(h, q[1]), 0);
    cr_assert_eq(host_alloc(h, 3 * CAP / 4, &off), 0);
    cr_assert_eq(off, 0);
    cr_assert_eq(host_free(h, off), 0);
    cr_assert_eq(host_free(h, q[3]), 0);
    cr_assert_eq(host_alloc(h, CAP, &off), 0, "all of it coalesced back");
    cr_assert_eq(host_free(h, off), 0);
    host_close(h);
}

Test(host, default_capacity_and_rounding)
{
    struct host_stats st;
    struct host *h = open_host(0, 0, false);
    uint64_t off;

    host_get_stats(h, &st);
    cr_assert_eq(st.capacity_bytes, GiB);
    cr_assert_eq(st.staging_bytes, 0);
    cr_assert_null(host_staging(h));
    cr_assert_eq(host_alloc(h, GiB, &off), 0);
    cr_assert_eq(host_free(h, off), 0);
    host_close(h);

    h = open_host(10000, 1, false);
    host_get_stats(h, &st);
    cr_assert_eq(st.capacity_bytes, 12288);
    cr_assert_eq(st.staging_bytes, 4096);
    cr_assert_eq((char *)host_staging(h), (char *)host_ptr(h, 0) + 12288);
    host_close(h);
}

Test(host, staging_is_separate)
{
    size_t stg = MiB + 1;
    struct host *h = open_host(CAP, stg, false);
    struct host_stats st;
    char *s = host_staging(h), *base = host_ptr(h, 0);
    uint64_t off;

    host_get_stats(h, &st);
    cr_assert_eq(st.staging_bytes, MiB + 4096);
    cr_assert_not_null(s);
    cr_assert(is_aligned((uintptr_t)s, ZINF_ALIGN));
    cr_assert(s >= base + CAP, "outside the budget");
    /* The whole budget can be handed out and written without touching staging. */
    memset(s, 0x5a, st.staging_bytes);
    cr_assert_eq(host_alloc(h, CAP, &off), 0);
    memset(host_ptr(h, off), 0, CAP);
    for (size_t i = 0; i < st.staging_bytes; i += 4096)
        cr_assert_eq((unsigned char)s[i], 0x5a);
    cr_assert_eq(used(h), CAP, "staging is not in used_bytes");
    cr_assert_eq(host_free(h, off), 0);
    host_close(h);
}

Test(host, pinned)
{
    struct host_opts o = {
        .capacity_bytes = CAP, .staging_bytes = MiB, .pin = true, .numa_node = -1};
    struct host_stats st;
    struct host *h = NULL;
    size_t before = vm_locked();
    int r;

    test_log_capture_start();
    r = host_open(&o, &h);
    if (r == -ENOMEM && geteuid() != 0)
        cr_skip_test("RLIMIT_MEMLOCK too low to lock %zu bytes here", CAP + MiB);
    cr_assert_eq(r, 0, "host_open: %s", strerror(-r));
    cr_assert_str_empty(test_log_text(), "a pinned open says nothing: %s", test_log_text());
    test_log_capture_stop();
    host_get_stats(h, &st);
    cr_assert(st.pinned);
    cr_assert_not(st.cuda_registered);
    cr_assert_not(st.io_registered);
    if (!SANITIZED) {
        cr_assert_geq(vm_locked(), before + CAP + MiB);
        host_close(h);
        cr_assert_eq(vm_locked(), before, "unlocked at close");
    } else {
        host_close(h);
    }
}

/* Drop CAP_IPC_LOCK, which lets root lock memory past RLIMIT_MEMLOCK. */
static void drop_ipc_lock(void)
{
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct data[2];

    if (syscall(SYS_capget, &hdr, data) != 0) return;
    data[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
    data[CAP_IPC_LOCK / 32].permitted &= ~(1u << (CAP_IPC_LOCK % 32));
    syscall(SYS_capset, &hdr, data);
}

/* Criterion runs each test in its own process, so the lowered limit and the dropped
 * capability end with it. */
Test(host, mlock_failure_names_rlimit_memlock)
{
    struct rlimit rl = {.rlim_cur = 64 * KiB, .rlim_max = 64 * KiB};
    struct host_opts o = {.capacity_bytes = CAP, .pin = true, .numa_node = -1};
    struct host *h = (struct host *)1;
    struct host_stats st;
    const char *log;

    if (SANITIZED) cr_skip_test("mlock() is a no-op under AddressSanitizer");
    drop_ipc_lock();
    cr_assert_eq(setrlimit(RLIMIT_MEMLOCK, &rl), 0, "%s", strerror(errno));
    /* Make sure the kernel now refuses: a sandbox might not enforce the limit. */
    void *probe = mmap(NULL, MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert(probe != MAP_FAILED);
    if (mlock(probe, MiB) == 0) {
        munmap(probe, MiB);
        cr_skip_test("mlock past RLIMIT_MEMLOCK succeeds here (CAP_IPC_LOCK kept?)");
    }
    munmap(probe, MiB);

    test_log_capture_start();
    cr_assert_eq(host_open(&o, &h), -EPERM, "its own error, not out of memory in the tier");
    cr_assert_null(h);
    log = test_log_text();
    cr_assert_eq(count_lines(log), 1, "one line: %s", log);
    cr_assert(strstr(log, "RLIMIT_MEMLOCK is 64 KiB (hard limit 64 KiB)"), "%s", log);
    cr_assert(strstr(log, "ulimit -l") && strstr(log, "limits.conf") && strstr(log, "pin_memory"),
              "%s", log);
    test_log_capture_stop();

    /* Unpinned, the same arena opens under the same limit, and says so once. */
    test_log_capture_start();
    o.pin = false;
    cr_assert_eq(host_open(&o, &h), 0);
    log = test_log_text();
    cr_assert_eq(count_lines(log), 1, "one line: %s", log);
    cr_assert(strstr(log, "unpinned"), "%s", log);
    test_log_capture_stop();
    host_get_stats(h, &st);
    cr_assert_not(st.pinned);
    host_close(h);
}

/* Unpinned, a tier says so once a process, however many are opened. */
Test(host, unpinned_says_so_once)
{
    struct host_stats st;
    struct host *h, *h2;

    test_log_capture_start();
    h = open_host(CAP, 0, false);
    h2 = open_host(CAP, 0, false);
    cr_assert_eq(count_lines(test_log_text()), 1, "%s", test_log_text());
    cr_assert(strstr(test_log_text(), "unpinned"), "%s", test_log_text());
    test_log_capture_stop();
    host_get_stats(h, &st);
    cr_assert_not(st.pinned);
    cr_assert_not(st.cuda_registered);
    cr_assert_eq(st.numa_node, -1);
    host_close(h2);
    host_close(h);
}

/* Where pinning was not expected, unpinned goes unsaid: pin_memory false given (the user's
 * choice), or an emulated device tier beside it (its copies are memcpy). Then, where it was
 * expected, it is still said, once. */
Test(host, unpinned_by_choice_or_beside_an_emulated_device_says_nothing)
{
    struct device_opts dopt = {.kind = ZINF_DEVICE_EMULATED, .capacity_bytes = 4 * MiB};
    struct device *d = NULL;
    struct host_opts o = {.capacity_bytes = CAP, .numa_node = -1, .pin_chosen = true};
    struct host *h = NULL, *h2 = NULL;

    cr_assert_eq(device_open(&dopt, &d), 0);
    test_log_capture_start();
    cr_assert_eq(host_open(&o, &h), 0);
    host_close(h);
    o.pin_chosen = false;
    o.dev = d;
    cr_assert_eq(host_open(&o, &h), 0);
    cr_assert_str_eq(test_log_text(), "", "nothing said");
    host_close(h);
    o.dev = NULL; /* no device tier to tell by: said */
    cr_assert_eq(host_open(&o, &h), 0);
    cr_assert_eq(host_open(&o, &h2), 0);
    cr_assert_eq(count_lines(test_log_text()), 1, "%s", test_log_text());
    cr_assert(strstr(test_log_text(), "runs unpinned"), "%s", test_log_text());
    test_log_capture_stop();
    host_close(h2);
    host_close(h);
    device_close(d);
}

/* Beside a GPU's device tier, an unpinned tier whose pin_memory was left unset says so,
 * once a process; one whose pin_memory false was given does not. */
Test(host, unpinned_beside_a_cuda_device_says_so_once)
{
    struct cuda_probe_info ci;
    struct device_opts dopt = {.kind = ZINF_DEVICE_CUDA, .capacity_bytes = 64 * MiB};
    struct device *d = NULL;
    struct host_opts o = {.capacity_bytes = CAP, .numa_node = -1, .pin_chosen = true};
    struct host *h = NULL, *h2 = NULL;

    if (cuda_probe(&ci) <= 0) cr_skip_test("no usable CUDA device: %s", ci.reason);
    cr_assert_eq(device_open(&dopt, &d), 0);
    o.dev = d;
    test_log_capture_start();
    cr_assert_eq(host_open(&o, &h), 0);
    cr_assert_str_eq(test_log_text(), "", "pin_memory false given: nothing said");
    host_close(h);
    o.pin_chosen = false;
    cr_assert_eq(host_open(&o, &h), 0);
    cr_assert_eq(host_open(&o, &h2), 0);
    cr_assert_eq(count_lines(test_log_text()), 1, "%s", test_log_text());
    cr_assert(strstr(test_log_text(), "the host tier runs unpinned (pin_memory is false, its "
                                      "default)"),
              "%s", test_log_text());
    test_log_capture_stop();
    host_close(h2);
    host_close(h);
    device_close(d);
}

static struct uring *open_io(enum uring_backend backend)
{
    struct uring_opts uo = {
        .block_size = 64 * KiB, .queue_depth = 4, .backend = backend, .max_files = 4};
    struct uring *u = NULL;
    int r = uring_open(&uo, &u);
    cr_assert_eq(r, 0, "uring_open: %s", strerror(-r));
    return u;
}

/* Write from one allocation and read back into another and into staging, all through
 * the engine, then compare. */
static void io_roundtrip(enum uring_backend backend)
{
    struct uring *u = open_io(backend);
    struct host_opts o = {
        .capacity_bytes = CAP, .staging_bytes = MiB, .pin = true, .numa_node = -1, .io = u};
    struct host *h = NULL;
    struct host_stats st;
    struct uring_stats us;
    char *dir = test_tmpdir("host-io"), path[4096];
    size_t n = MiB;
    uint64_t w, r;
    int f;

    cr_assert_eq(host_open(&o, &h), 0);
    host_get_stats(h, &st);
    uring_get_stats(u, &us);
    cr_assert_eq(st.io_registered, us.fixed_buffers, "registered exactly when supported");
    if (backend == URING_BACKEND_THREADS) cr_assert_not(st.io_registered);

    snprintf(path, sizeof(path), "%s/host.dat", dir);
    f = uring_file_open(u, path, O_RDWR | O_CREAT, 0644);
    cr_assert_geq(f, 0, "uring_file_open: %s", strerror(-f));
    cr_assert_eq(host_alloc(h, n, &w), 0);
    cr_assert_eq(host_alloc(h, n, &r), 0);
    test_fill_random(host_ptr(h, w), n, 7);
    memset(host_ptr(h, r), 0, n);
    cr_assert_eq(uring_rw(u, URING_WRITE, f, host_ptr(h, w), n, 0), 0);
    cr_assert_eq(uring_rw(u, URING_READ, f, host_ptr(h, r), n, 0), 0);
    cr_assert(memcmp(host_ptr(h, w), host_ptr(h, r), n) == 0);
    memset(host_staging(h), 0, MiB);
    cr_assert_eq(uring_rw(u, URING_READ, f, host_staging(h), MiB, 0), 0);
    cr_assert(memcmp(host_ptr(h, w), host_staging(h), MiB) == 0);

    cr_assert_eq(host_free(h, w), 0);
    cr_assert_eq(host_free(h, r), 0);
    cr_assert_eq(uring_file_close(u, f), 0);
    host_close(h);
    uring_close(u);
    test_rmtree(dir);
}

Test(host, io_registered_roundtrip)
{
    io_roundtrip(URING_BACKEND_AUTO);
}
Test(host, io_threads_backend_roundtrip)
{
    io_roundtrip(URING_BACKEND_THREADS);
}

Test(host, close_unregisters_from_io)
{
    struct uring *u = open_io(URING_BACKEND_AUTO);
    struct host_opts o = {.capacity_bytes = MiB, .numa_node = -1, .io = u};
    struct uring_stats us;

    uring_get_stats(u, &us);
    if (!us.fixed_buffers) {
        uring_close(u);
        cr_skip_test("no io_uring fixed buffers here");
    }
    /* More opens than the engine has regions: each close must give its region back. */
    for (int i = 0; i < 40; i++) {
        struct host *h = NULL;
        struct host_stats st;
        cr_assert_eq(host_open(&o, &h), 0);
        host_get_stats(h, &st);
        cr_assert(st.io_registered, "open %d", i);
        host_close(h);
    }
    uring_close(u);
}

/* The name of the mapping p lies in, from /proc/self/maps ("" for an anonymous one). */
static void mapping_name(const void *p, char *name, size_t len)
{
    FILE *f = fopen("/proc/self/maps", "re");
    char line[512];
    cr_assert_not_null(f);
    name[0] = 0;
    while (fgets(line, sizeof(line), f)) {
        unsigned long lo, hi;
        int at = 0;
        if (sscanf(line, "%lx-%lx %*s %*s %*s %*s %n", &lo, &hi, &at) < 2) continue;
        if ((uintptr_t)p < lo || (uintptr_t)p >= hi) continue;
        snprintf(name, len, "%s", line + at);
        name[strcspn(name, "\n")] = 0;
        break;
    }
    fclose(f);
}

/* A shared tier hands its clients the budget only: the staging area, where swap-in reads
 * land, is a private anonymous mapping of its own (huge pages, where the kernel gives
 * them), and both mappings are io_uring fixed buffers. */
Test(host, shared_budget_and_private_staging)
{
    struct uring *u = open_io(URING_BACKEND_AUTO);
    struct uring_stats us;
    uring_get_stats(u, &us);
    for (int i = 0; i < 40; i++) { /* each close gives both regions back */
        struct host_opts o = {.capacity_bytes = CAP, .staging_bytes = 2 * MiB, .numa_node = -1,
                              .io = u, .shared = true};
        struct host *h = NULL;
        cr_assert_eq(host_open(&o, &h), 0);
        int fd;
        void *base;
        size_t bytes;
        cr_assert_eq(host_shared(h, &fd, &base, &bytes), 0);
        cr_assert_eq(bytes, CAP, "the shared span is the budget only");
        cr_assert_eq(base, host_ptr(h, 0));
        struct stat sb;
        cr_assert_eq(fstat(fd, &sb), 0);
        cr_assert_eq((size_t)sb.st_size, CAP);
        char *stg = host_staging(h), name[256];
        cr_assert_not_null(stg);
        cr_assert(stg + 2 * MiB <= (char *)base || stg >= (char *)base + CAP);
        mapping_name(base, name, sizeof(name));
        cr_assert(strstr(name, "zinf-host") != NULL, "the budget's mapping: '%s'", name);
        mapping_name(stg, name, sizeof(name));
        cr_assert_str_eq(name, "", "the staging area is anonymous");
        struct host_stats st;
        host_get_stats(h, &st);
        cr_assert_eq(st.staging_bytes, 2 * MiB);
        if (us.fixed_buffers) cr_assert(st.io_registered, "open %d: both spans registered", i);
        if (i == 0) {
            /* IO into the staging area and into the budget, through fixed buffers. */
            char *dir = test_tmpdir("host-shared"), path[4096];
            snprintf(path, sizeof(path), "%s/host.dat", dir);
            int f = uring_file_open(u, path, O_RDWR | O_CREAT, 0644);
            cr_assert_geq(f, 0, "uring_file_open: %s", strerror(-f));
            uint64_t off;
            cr_assert_eq(host_alloc(h, MiB, &off), 0);
            test_fill_random(stg, MiB, 7);
            cr_assert_eq(uring_rw(u, URING_WRITE, f, stg, MiB, 0), 0);
            cr_assert_eq(uring_rw(u, URING_READ, f, host_ptr(h, off), MiB, 0), 0);
            cr_assert(memcmp(stg, host_ptr(h, off), MiB) == 0);
            cr_assert_eq(host_free(h, off), 0);
            cr_assert_eq(uring_file_close(u, f), 0);
            test_rmtree(dir);
        }
        host_close(h);
    }
    uring_close(u);
}

static bool numa_here(void)
{
    return numa_available() >= 0;
}

/* The node the page at p is on (it must have been touched). */
static int page_node(void *p)
{
    int node = -1;
    cr_assert_eq(get_mempolicy(&node, NULL, 0, p, MPOL_F_NODE | MPOL_F_ADDR), 0, "%s",
                 strerror(errno));
    return node;
}

Test(host, placed_on_node_0)
{
    struct host_opts o = {.capacity_bytes = CAP, .staging_bytes = MiB, .pin = true, .numa_node = 0};
    struct host_stats st;
    struct host *h = NULL;
    uint64_t off;
    int mode = -1;

    if (!numa_here()) cr_skip_test("no NUMA support");
    cr_assert_eq(host_open(&o, &h), 0);
    host_get_stats(h, &st);
    cr_assert_eq(st.numa_node, 0);
    cr_assert_eq(host_alloc(h, MiB, &off), 0);
    if (SANITIZED) { /* not faulted in by mlock: touch the pages looked at below */
        memset(host_ptr(h, off), 1, 4096);
        memset((char *)host_ptr(h, 0) + CAP - 4096, 1, 4096);
        memset(host_staging(h), 1, 4096);
    }
    cr_assert_eq(page_node(host_ptr(h, off)), 0);
    cr_assert_eq(page_node((char *)host_ptr(h, 0) + CAP - 4096), 0);
    cr_assert_eq(page_node(host_staging(h)), 0);
    cr_assert_eq(get_mempolicy(&mode, NULL, 0, host_ptr(h, off), MPOL_F_ADDR), 0);
    cr_assert_eq(mode, MPOL_PREFERRED);
    cr_assert_eq(host_free(h, off), 0);
    host_close(h);

    /* Unpinned, the policy is set and pages land there when first touched. */
    o.pin = false;
    cr_assert_eq(host_open(&o, &h), 0);
    host_get_stats(h, &st);
    cr_assert_eq(st.numa_node, 0);
    memset(host_ptr(h, 0), 1, 4096);
    cr_assert_eq(page_node(host_ptr(h, 0)), 0);
    host_close(h);
}

Test(host, missing_node_is_a_notice)
{
    struct host_opts o = {.capacity_bytes = CAP, .numa_node = 4000, .pin = true};
    struct host_stats st;
    struct host *h = NULL;

    test_log_capture_start();
    cr_assert_eq(host_open(&o, &h), 0);
    cr_assert(strstr(test_log_text(), "node 4000") && strstr(test_log_text(), "not placed"), "%s",
              test_log_text());
    test_log_capture_stop();
    host_get_stats(h, &st);
    cr_assert_eq(st.numa_node, -1);
    host_close(h);
}

struct worker {
    struct host *h;
    uint64_t seed;
    int errors;
};

static void *churn(void *arg)
{
    struct worker *w = arg;
    uint64_t offs[16] = {0}, s = w->seed;
    size_t lens[16] = {0};

    for (int it = 0; it < 3000; it++) {
        unsigned i = (unsigned)(test_rand(&s) % 16);
        if (lens[i]) {
            unsigned char *p = host_ptr(w->h, offs[i]);
            /* Nobody else wrote into this allocation. */
            if (p[0] != (unsigned char)i || p[lens[i] - 1] != (unsigned char)i) w->errors++;
            if (host_free(w->h, offs[i]) != 0) w->errors++;
            lens[i] = 0;
        } else {
            size_t n = 4096 * (1 + test_rand(&s) % 16);
            if (host_alloc(w->h, n, &offs[i]) == 0) {
                memset(host_ptr(w->h, offs[i]), (int)i, n);
                lens[i] = n;
            }
        }
    }
    for (unsigned i = 0; i < 16; i++)
        if (lens[i] && host_free(w->h, offs[i]) != 0) w->errors++;
    return NULL;
}

Test(host, concurrent_alloc_free)
{
    struct host *h = open_host(CAP, 0, false);
    pthread_t th[4];
    struct worker w[4];

    for (int i = 0; i < 4; i++) {
        w[i] = (struct worker){.h = h, .seed = 100 + (uint64_t)i};
        cr_assert_eq(pthread_create(&th[i], NULL, churn, &w[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        cr_assert_eq(w[i].errors, 0, "worker %d", i);
    }
    cr_assert_eq(used(h), 0);
    host_close(h);
}

/* Copies between the device tier and the arena, both ways. */
static void device_roundtrip(struct device *d, struct host *h)
{
    uint64_t doff, src;
    size_t n = MiB;

    cr_assert_eq(device_alloc(d, n, &doff), 0);
    cr_assert_eq(host_alloc(h, n, &src), 0);
    test_fill_random(host_ptr(h, src), n, 3);
    memset(host_staging(h), 0, n);
    cr_assert_eq(device_copy_sync(d, DEVICE_H2D, doff, host_ptr(h, src), n), 0);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, doff, host_staging(h), n), 0);
    cr_assert(memcmp(host_ptr(h, src), host_staging(h), n) == 0);
    cr_assert_eq(host_free(h, src), 0);
    cr_assert_eq(device_free(d, doff), 0);
}

Test(host, emulated_device_is_not_registered)
{
    struct device_opts dopt = {.kind = ZINF_DEVICE_EMULATED, .capacity_bytes = 4 * MiB};
    struct device *d = NULL;
    struct host_opts o = {
        .capacity_bytes = CAP, .staging_bytes = MiB, .pin = true, .numa_node = -1};
    struct host *h = NULL;
    struct host_stats st;

    cr_assert_eq(device_open(&dopt, &d), 0);
    o.dev = d;
    cr_assert_eq(host_open(&o, &h), 0);
    host_get_stats(h, &st);
    cr_assert(st.pinned);
    cr_assert_not(st.cuda_registered);
    device_roundtrip(d, h);
    host_close(h);
    device_close(d);
}

Test(host, cuda_device_registers_the_arena)
{
    struct cuda_probe_info ci;
    struct device_opts dopt = {.kind = ZINF_DEVICE_CUDA, .capacity_bytes = 64 * MiB};
    struct device *d = NULL;
    struct host_opts o = {
        .capacity_bytes = CAP, .staging_bytes = MiB, .pin = true, .numa_node = -1};
    struct host *h = NULL;
    struct host_stats st;

    if (cuda_probe(&ci) <= 0) cr_skip_test("no usable CUDA device: %s", ci.reason);
    cr_assert_eq(device_open(&dopt, &d), 0);
    o.dev = d;
    cr_assert_eq(host_open(&o, &h), 0);
    host_get_stats(h, &st);
    cr_assert(st.pinned);
    cr_assert(st.cuda_registered);
    device_roundtrip(d, h);
    host_close(h);
    device_close(d);
}
